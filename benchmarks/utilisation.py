"""Learner utilisation: the FrozenLake job with slow environments, asynchronous vs synchronous.

Every environment step gets an injected delay (default 0.5 s, as a sandboxed tool call would
take). Both modes run the same manifest one after the other in this process's run, each until the
rolling success rate reaches the target or the time budget ends:

    .venv/bin/python benchmarks/utilisation.py [--manifest examples/frozenlake.yaml] [--latency 0.5]
                                     [--minutes 10] [--target 0.9] [--out runs/bench-utilisation]

Reported per mode: learner duty cycle (time inside train steps / wall time, averaged over the
run's last record), wall-clock seconds to the target success rate, and for async the
sampler-vs-trainer log-prob difference on same-version tokens and the staleness distribution.
The ratio async/sync is the figure; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from local_runs import REPO, fresh_run, manifest_variant


def with_latency(manifest: Path, latency: float, concurrency: int | None, out: Path) -> Path:
    def edit(doc: dict[str, Any]) -> None:
        doc["spec"].setdefault("environment", {})["stepLatency"] = {"distribution": "fixed", "seconds": latency}
        if concurrency is not None:
            # Slow environments need more episodes in flight (docs/sizing.md); sync mode always runs a
            # whole batch at once, so this only changes what the actors may overlap.
            doc["spec"].setdefault("actors", {})["concurrency"] = concurrency

    return manifest_variant(manifest, out / "job.yaml", edit)


def run_mode(manifest: Path, mode: str, run_dir: Path, minutes: float, target: float) -> dict[str, Any]:
    run = fresh_run(
        manifest, run_dir, "--mode", mode, "--max-minutes", str(minutes), "--target-success", str(target)
    )
    tito = [m["tito_logprob_diff_mean"] for m in run.metrics if m.get("tito_tokens")]
    tito_std = [m["tito_logprob_diff_std"] for m in run.metrics if m.get("tito_tokens")]
    return {
        "mode": mode,
        "steps": run.steps,
        "wall_seconds": run.wall_seconds,
        "duty_cycle": run.metrics[-1].get("duty_cycle") if run.metrics else None,
        "seconds_to_target": run.seconds_to(target),
        "final_success": run.final_success(),
        "tito_logprob_diff_mean": sum(tito) / len(tito) if tito else None,
        "tito_logprob_diff_std": sum(tito_std) / len(tito_std) if tito_std else None,
        "staleness_histogram": run.buffer[-1].get("staleness_histogram") if run.buffer else None,
        "dropped": run.buffer[-1].get("dropped") if run.buffer else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds injected per environment step")
    parser.add_argument("--minutes", type=float, default=10.0, help="budget per mode")
    parser.add_argument("--target", type=float, default=0.9, help="rolling success rate to reach")
    parser.add_argument("--concurrency", type=int, help="episodes per actor (default: the manifest's)")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-utilisation")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifest = with_latency(args.manifest, args.latency, args.concurrency, args.out)
    results = {}
    for mode in ("async", "sync"):
        results[mode] = run_mode(manifest, mode, args.out / mode, args.minutes, args.target)
        print(json.dumps(results[mode]), flush=True)
    a, s = results["async"], results["sync"]
    print(f"duty cycle: async {a['duty_cycle']:.3f}, sync {s['duty_cycle']:.3f}")
    if a["seconds_to_target"] and s["seconds_to_target"]:
        print(f"time to {args.target}: async {a['seconds_to_target']:.0f} s, sync {s['seconds_to_target']:.0f} s, "
              f"speed-up {s['seconds_to_target'] / a['seconds_to_target']:.2f}x")
    else:
        print(f"time to {args.target}: async {a['seconds_to_target']}, sync {s['seconds_to_target']} (None = not reached)")
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

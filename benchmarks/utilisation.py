"""Learner utilisation: the FrozenLake job with slow environments, asynchronous vs synchronous.

Every environment step gets an injected delay (default 0.5 s, as a sandboxed tool call would
take). Both modes run the same manifest one after the other in this process's run, each until the
rolling success rate reaches the target or the time budget ends:

    .venv/bin/python benchmarks/utilisation.py [--manifest examples/frozenlake.yaml] [--latency 0.5]
                                     [--minutes 10] [--target 0.9] [--out runs/bench-utilisation]
                                     [--concurrency N] [--staleness S] [--batch-groups B] [--sandbox inline]
                                     [--weight-sync between-episodes] [--weight-poll SECONDS] [--sample-order newest-first]
                                     [--repeats R]
                                     [--learning-rate LR] [--sync-learning-rate LR] [--clip-high EPS] [--modes async sync]

Reported per mode: learner duty cycle (time inside train steps / wall time: the learner's own
figure since it started, and the steady state from its first step on), wall-clock seconds to the target success rate, and for async the
sampler-vs-trainer log-prob difference on same-version tokens and the staleness distribution.
The ratio async/sync is the figure; absolute times depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from local_runs import REPO, fresh_run, manifest_variant


def with_latency(manifest: Path, args: argparse.Namespace, mode: str = "async") -> Path:
    def edit(doc: dict[str, Any]) -> None:
        spec = doc["spec"]
        spec.setdefault("environment", {})["stepLatency"] = {"distribution": "fixed", "seconds": args.latency}
        # Slow environments need more episodes in flight (docs/sizing.md, `stoker audit`), and more
        # in flight means more policy versions between sampling and training. Sync mode always runs
        # one batch at a time, on-policy, so these only change what the actors may overlap.
        if args.concurrency is not None:
            spec.setdefault("actors", {})["concurrency"] = args.concurrency
        if args.staleness is not None:
            spec.setdefault("buffer", {})["maxStaleness"] = args.staleness
        if args.batch_groups is not None:  # the one option that changes sync mode too: its batch
            spec.setdefault("learner", {})["batchGroups"] = args.batch_groups
        if args.sandbox is not None:
            spec["environment"]["sandbox"] = {**spec["environment"].get("sandbox", {}), "kind": args.sandbox}
        algorithm = spec.setdefault("algorithm", {})
        learning_rate = args.sync_learning_rate if mode == "sync" and args.sync_learning_rate else args.learning_rate
        if learning_rate is not None:
            algorithm["learningRate"] = learning_rate
        if args.clip_high is not None:
            # Only stale data ever reaches the clip: an on-policy update (sync mode) has ratio 1.
            algorithm["clipEpsilonHigh"] = args.clip_high
        if args.weight_sync is not None:
            # between-episodes keeps a conversation's cached keys/values valid to its end; with a
            # swap every ~0.4 s and 0.5 s steps, between-turns would prefill nearly every turn anew.
            spec.setdefault("actors", {})["weightSync"] = args.weight_sync
        if args.weight_poll is not None:
            # Each swap sends every running conversation back to a full prefill (between-turns): with
            # turns >= 0.5 s apart, polling every second re-prefills nearly every turn. Sync mode
            # samples in-process with the trainer's weights and never polls.
            spec.setdefault("actors", {})["weightPollSeconds"] = args.weight_poll
        if args.sample_order is not None:
            # Sync mode trains each batch as soon as it completes, so only async has a queue to order.
            spec.setdefault("buffer", {})["sampleOrder"] = args.sample_order

    return manifest_variant(manifest, args.out / ("job-sync.yaml" if mode == "sync" else "job.yaml"), edit)


def steady_duty_cycle(metrics: list[dict[str, Any]]) -> float | None:
    """Time inside train steps / wall time from the start of the first step to the end of the last.

    The learner's own ``duty_cycle`` counts from its start, so it also charges the wait for the
    very first batch (actors starting, the first episodes running); this is the steady state.
    """
    steps = [m for m in metrics if m.get("trained")]
    if len(steps) < 2:
        return None
    start = steps[0]["time"] - steps[0]["step_seconds"]
    return sum(m["step_seconds"] for m in steps) / (steps[-1]["time"] - start)


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
        # A last batch with nothing to learn from makes no update and reports no duty cycle.
        "duty_cycle": next((m["duty_cycle"] for m in reversed(run.metrics) if m.get("duty_cycle") is not None), None),
        "steady_duty_cycle": steady_duty_cycle(run.metrics),
        "seconds_to_target": run.seconds_to(target),
        "final_success": run.final_success(),
        "tito_logprob_diff_mean": sum(tito) / len(tito) if tito else None,
        "tito_logprob_diff_std": sum(tito_std) / len(tito_std) if tito_std else None,
        "staleness_histogram": run.buffer[-1].get("staleness_histogram") if run.buffer else None,
        "dropped": run.buffer[-1].get("dropped") if run.buffer else None,
    }


def fmt(value: float | None) -> str:
    return "n/a (no updates)" if value is None else f"{value:.3f}"


def compare(results: dict[str, Any], args: argparse.Namespace) -> None:
    """Print one async/sync pair's duty cycles and speed-up; record the speed-up in ``results``."""
    a, s = results["async"], results["sync"]
    print(f"duty cycle: async {fmt(a['duty_cycle'])}, sync {fmt(s['duty_cycle'])} (steady state from the first "
          f"step: async {fmt(a['steady_duty_cycle'])}, sync {fmt(s['steady_duty_cycle'])})")
    if a["seconds_to_target"] and s["seconds_to_target"]:
        results["speed_up"] = s["seconds_to_target"] / a["seconds_to_target"]
        print(f"time to {args.target}: async {a['seconds_to_target']:.0f} s, sync {s['seconds_to_target']:.0f} s, "
              f"speed-up {results['speed_up']:.2f}x")
    else:
        print(f"time to {args.target}: async {a['seconds_to_target']}, sync {s['seconds_to_target']} (None = not reached)")
        if a["seconds_to_target"]:  # sync ran out of budget: the speed-up is at least this
            results["speed_up_at_least"] = args.minutes * 60 / a["seconds_to_target"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds injected per environment step")
    parser.add_argument("--minutes", type=float, default=10.0, help="budget per mode")
    parser.add_argument("--target", type=float, default=0.9, help="rolling success rate to reach")
    parser.add_argument("--concurrency", type=int, help="episodes per actor (default: the manifest's)")
    parser.add_argument("--staleness", type=int, help="buffer.maxStaleness (default: the manifest's)")
    parser.add_argument(
        "--batch-groups", type=int,
        help="learner.batchGroups for both modes (default: the manifest's); `stoker audit` tells the batch at "
        "which an episode spans fewer updates than maxStaleness allows",
    )
    parser.add_argument(
        "--sandbox", choices=("process", "inline"),
        help="environment.sandbox.kind (default: the manifest's); inline spares a process per episode",
    )
    parser.add_argument(
        "--weight-sync", choices=("between-turns", "between-episodes"),
        help="actors.weightSync (default: the manifest's)",
    )
    parser.add_argument("--weight-poll", type=float, help="actors.weightPollSeconds (default: the manifest's)")
    parser.add_argument(
        "--sample-order", choices=("oldest-first", "newest-first"), help="buffer.sampleOrder (default: the manifest's)"
    )
    parser.add_argument("--learning-rate", type=float, help="algorithm.learningRate for both modes (default: the manifest's)")
    parser.add_argument(
        "--sync-learning-rate", type=float,
        help="algorithm.learningRate for sync mode alone (default: as async), e.g. the manifest's own when "
        "--learning-rate suits stale data: each mode at its best",
    )
    parser.add_argument(
        "--clip-high", type=float,
        help="algorithm.clipEpsilonHigh (default: the manifest's); sync mode never reaches the clip",
    )
    parser.add_argument("--modes", nargs="+", choices=("async", "sync"), default=["async", "sync"])
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="async/sync pairs to run, alternating (single runs' step counts vary by ~20 %%)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-utilisation")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    manifests = {mode: with_latency(args.manifest, args, mode) for mode in args.modes}
    pairs = []
    for repeat in range(args.repeats):
        results: dict[str, Any] = {}
        for mode in args.modes:
            run_dir = args.out / (mode if args.repeats == 1 else f"{mode}-{repeat}")
            results[mode] = run_mode(manifests[mode], mode, run_dir, args.minutes, args.target)
            print(json.dumps(results[mode]), flush=True)
        if len(results) == 2:
            compare(results, args)
        pairs.append(results)
        (args.out / "results.json").write_text(json.dumps(pairs[0] if args.repeats == 1 else pairs, indent=2))
    if args.repeats > 1:
        # A pair whose sync run missed the budget counts with its lower bound (conservative).
        bounds = [p.get("speed_up", p.get("speed_up_at_least")) for p in pairs]
        speed_ups = sorted(float(b) for b in bounds if b is not None)
        duties = sorted(p["async"]["steady_duty_cycle"] for p in pairs if p.get("async", {}).get("steady_duty_cycle"))
        if speed_ups:
            print(f"speed-up over {len(speed_ups)} pairs (a sync run out of budget counted at its bound): "
                  f"median {speed_ups[len(speed_ups) // 2]:.2f}x, range {speed_ups[0]:.2f}-{speed_ups[-1]:.2f}x")
        if all(p.get("speed_up") for p in pairs):  # both modes reached the target in every pair
            a = statistics.median(p["async"]["seconds_to_target"] for p in pairs)
            s = statistics.median(p["sync"]["seconds_to_target"] for p in pairs)
            print(f"median time to {args.target}: async {a:.1f} s, sync {s:.1f} s: ratio of medians {s / a:.2f}x")
        if duties:
            print(f"async steady duty cycle: median {duties[len(duties) // 2]:.3f}, range {duties[0]:.3f}-{duties[-1]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Staleness and importance-sampling correction on the FrozenLake job (asynchronous mode).

Runs the job four ways, one after the other, each for the same number of learner steps:

* ``maxStaleness: 0``: strictly on-policy (admission lets no work start ahead of the learner);
* ``maxStaleness: 4`` with ``offPolicyCorrection: clip`` (the default: PPO's clipped ratio against
  the sampler's log-probs, i.e. importance weights inside a trust region);
* ``maxStaleness: 4`` with ``offPolicyCorrection: decoupled`` (AReaL's truncated weight
  ``min(pi/mu, 2)``, clip around the current policy);
* ``maxStaleness: 4`` with ``offPolicyCorrection: none`` (plain policy gradient on stale data).

    .venv/bin/python benchmarks/staleness.py [--manifest examples/frozenlake.yaml] [--steps 120]
                                             [--out runs/bench-staleness]

Reports the final success rate (mean of the last 10 steps' on-policy batch success) of each, the
staleness actually consumed, and wall time. Goal: staleness 4 with correction within 5 points of
on-policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from local_runs import REPO, fresh_run, manifest_variant

ON_POLICY = "on-policy (maxStaleness 0)"
CORRECTED = "maxStaleness 4, clip (default)"
CONFIGS = {
    ON_POLICY: {"maxStaleness": 0, "offPolicyCorrection": "clip"},
    CORRECTED: {"maxStaleness": 4, "offPolicyCorrection": "clip"},
    "maxStaleness 4, decoupled": {"maxStaleness": 4, "offPolicyCorrection": "decoupled"},
    "maxStaleness 4, none": {"maxStaleness": 4, "offPolicyCorrection": "none"},
}


def variant(manifest: Path, settings: dict[str, Any], path: Path) -> Path:
    def edit(doc: dict[str, Any]) -> None:
        doc["spec"].setdefault("buffer", {})["maxStaleness"] = settings["maxStaleness"]
        doc["spec"].setdefault("algorithm", {})["offPolicyCorrection"] = settings["offPolicyCorrection"]

    return manifest_variant(manifest, path, edit)


def run(manifest: Path, run_dir: Path, steps: int) -> dict[str, Any]:
    metrics = fresh_run(manifest, run_dir, "--max-steps", str(steps)).metrics
    return {
        "steps": metrics[-1]["step"],
        "final_success": sum(m.get("success_rate", 0.0) for m in metrics[-10:]) / len(metrics[-10:]),
        "staleness_mean": sum(m.get("staleness_mean", 0.0) for m in metrics) / len(metrics),
        "staleness_max": max(m.get("staleness_max", 0.0) for m in metrics),
        "wall_seconds": metrics[-1]["time"] - metrics[0]["time"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--steps", type=int, default=120, help="learner steps per configuration")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-staleness")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for index, (name, settings) in enumerate(CONFIGS.items()):
        manifest = variant(args.manifest, settings, args.out / f"job-{index}.yaml")
        results[name] = run(manifest, args.out / f"run-{index}", args.steps)
        print(f"{name}: {json.dumps(results[name])}", flush=True)
    on_policy = results[ON_POLICY]["final_success"]
    corrected = results[CORRECTED]["final_success"]
    print(f"staleness 4 + clip vs on-policy: {100 * (corrected - on_policy):+.1f} points (goal: within 5)")
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

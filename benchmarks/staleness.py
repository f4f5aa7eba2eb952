"""Staleness and importance-sampling correction on the FrozenLake job (asynchronous mode).

Runs the job four ways, one after the other, each for the same number of learner steps and for
each of the given seeds (``spec.seed``, the run's random seed):

* ``maxStaleness: 0``: strictly on-policy (admission lets no work start ahead of the learner);
* ``maxStaleness: 4`` with ``offPolicyCorrection: clip`` (the default: PPO's clipped ratio against
  the sampler's log-probs, i.e. importance weights inside a trust region);
* ``maxStaleness: 4`` with ``offPolicyCorrection: decoupled`` (AReaL's truncated weight
  ``min(pi/mu, 2)``, clip around the current policy);
* ``maxStaleness: 4`` with ``offPolicyCorrection: none`` (plain policy gradient on stale data).

    .venv/bin/python benchmarks/staleness.py [--manifest examples/frozenlake.yaml] [--steps 400]
                                             [--seeds 0 1 2] [--configs on-policy clip decoupled none]
                                             [--out runs/bench-staleness]

``--steps`` defaults to the manifest's own ``learner.maxSteps`` (400 for the example): the stale
runs learn less per step, so a shorter budget (120 or 150 steps, the earlier default) compares
how fast the configurations learn rather than where they end, which is what the goal is about.
A 400-step run takes 5-7 minutes on a 2-core machine.

Reports the final success rate (mean of the last 10 steps' batch success) of each run, the
staleness actually consumed, and wall time; with several seeds, each configuration's mean over
them. Single runs swing by 10 points or more, so the goal is judged on the means: staleness 4
with correction within 5 points of on-policy.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from local_runs import REPO, fresh_run, manifest_variant
from stoker.manifest import load_job

ON_POLICY, CORRECTED = "on-policy", "clip"
CONFIGS = {  # name -> (description, settings)
    ON_POLICY: ("maxStaleness 0", {"maxStaleness": 0, "offPolicyCorrection": "clip"}),
    CORRECTED: ("maxStaleness 4, clip (the default)", {"maxStaleness": 4, "offPolicyCorrection": "clip"}),
    "decoupled": ("maxStaleness 4, decoupled", {"maxStaleness": 4, "offPolicyCorrection": "decoupled"}),
    "none": ("maxStaleness 4, no correction", {"maxStaleness": 4, "offPolicyCorrection": "none"}),
}


def variant(manifest: Path, settings: dict[str, Any], seed: int, path: Path) -> Path:
    def edit(doc: dict[str, Any]) -> None:
        doc["spec"]["seed"] = seed
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
    parser.add_argument(
        "--steps", type=int, default=None, help="learner steps per configuration (default: the manifest's learner.maxSteps)"
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="spec.seed values to run each configuration with")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-staleness")
    args = parser.parse_args()
    steps = args.steps if args.steps is not None else load_job(args.manifest).spec.learner.max_steps
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[int, dict[str, Any]]] = {name: {} for name in args.configs}
    for seed in args.seeds:  # seeds outermost: a run cut short still compares configurations
        for name in args.configs:
            description, settings = CONFIGS[name]
            manifest = variant(args.manifest, settings, seed, args.out / f"job-{name}-seed{seed}.yaml")
            results[name][seed] = run(manifest, args.out / f"run-{name}-seed{seed}", steps)
            print(f"{name} ({description}), seed {seed}: {json.dumps(results[name][seed])}", flush=True)
            (args.out / "results.json").write_text(json.dumps(results, indent=2))
    means = {name: sum(r["final_success"] for r in runs.values()) / len(runs) for name, runs in results.items()}
    for name, mean in means.items():
        per_seed = ", ".join(f"{results[name][seed]['final_success']:.2f}" for seed in args.seeds)
        print(f"{name:10} final success mean {mean:.3f} over seeds {args.seeds}: {per_seed}")
    if ON_POLICY in means and CORRECTED in means:
        gap = 100 * (means[CORRECTED] - means[ON_POLICY])
        print(f"staleness 4 + clip vs on-policy, mean of {len(args.seeds)} seed(s): {gap:+.1f} points (goal: within 5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

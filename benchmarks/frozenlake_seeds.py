"""Does the example job learn reliably? Runs it for several seeds, one after the other.

    .venv/bin/python benchmarks/frozenlake_seeds.py [--seeds 0 1 2] [--minutes 10] [--target 0.9]
                                                    [--mode async] [--out runs/bench-seeds]

Each seed is a fresh run of examples/frozenlake.yaml with ``spec.seed`` replaced (model init,
sampling and task order change; the maps stay), stopped once the rolling success rate (10
steps) reaches the target or the time budget ends. Reports each seed's wall-clock time to the
target, measured from the start of ``stoker run`` (compilation included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from local_runs import REPO, fresh_run, manifest_variant


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--manifest", type=Path, default=REPO / "examples" / "frozenlake.yaml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--mode", choices=("async", "sync"), default="async")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-seeds")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for seed in args.seeds:
        def with_seed(doc: dict[str, Any], seed: int = seed) -> None:
            doc["spec"]["seed"] = seed

        manifest = manifest_variant(args.manifest, args.out / f"seed-{seed}.yaml", with_seed)
        run = fresh_run(
            manifest, args.out / f"seed-{seed}", "--mode", args.mode,
            "--max-minutes", str(args.minutes), "--target-success", str(args.target),
        )
        results[seed] = {
            "seconds_to_target": run.seconds_to(args.target),
            "steps": run.steps,
            "final_rolling_success": run.final_success(),
        }
        print(f"seed {seed}: {json.dumps(results[seed])}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    reached = [r["seconds_to_target"] for r in results.values() if r["seconds_to_target"] is not None]
    print(f"{len(reached)}/{len(results)} seeds reached {args.target}; times (s): {reached}")
    return 0 if len(reached) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

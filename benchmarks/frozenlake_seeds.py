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
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from stoker.report import read_jsonl, time_to_reach

REPO = Path(__file__).resolve().parent.parent


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
        doc = yaml.safe_load(args.manifest.read_text())
        doc["spec"]["seed"] = seed
        manifest = args.out / f"seed-{seed}.yaml"
        manifest.write_text(yaml.safe_dump(doc, sort_keys=False))
        run_dir = args.out / f"seed-{seed}"
        if run_dir.exists():
            shutil.rmtree(run_dir)
        command = [
            sys.executable, "-m", "stoker.cli", "run", str(manifest), "--mode", args.mode, "--run-dir", str(run_dir),
            "--max-minutes", str(args.minutes), "--target-success", str(args.target), "--no-progress",
        ]
        print(f"$ {' '.join(command)}", file=sys.stderr, flush=True)
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"seed {seed} failed ({result.returncode}):\n{result.stderr[-3000:]}")
        metrics = read_jsonl(run_dir / "learner_metrics.jsonl")
        started = read_jsonl(run_dir / "runs.jsonl")[-1]["started_unix"]
        reach = time_to_reach([{"time": started}, *metrics], "success_rate", args.target)
        results[seed] = {
            "seconds_to_target": reach,
            "steps": metrics[-1]["step"] if metrics else 0,
            "final_rolling_success": sum(m.get("success_rate", 0.0) for m in metrics[-10:]) / max(len(metrics[-10:]), 1),
        }
        print(f"seed {seed}: {json.dumps(results[seed])}", flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    reached = [r["seconds_to_target"] for r in results.values() if r["seconds_to_target"] is not None]
    print(f"{len(reached)}/{len(results)} seeds reached {args.target}; times (s): {reached}")
    return 0 if len(reached) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())

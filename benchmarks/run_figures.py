"""The figures of finished `stoker run` folders, one row each, as JSON and a markdown table.

    python benchmarks/run_figures.py RUN_DIR [RUN_DIR ...] [--target 0.9] [--json out.json] [--markdown out.md]

Per run: its mode, seconds from the start of `stoker run` to the first learner step (compilation,
actors starting), seconds from that first step to the target rolling success (10 steps, as
``--target-success`` judges it), the steps it took, the learner's duty cycle, trajectories/s the
actors delivered (async) or the loop played (sync), the staleness trained and the behaviour
ratio's effective sample size, the median wall time between steps (after the first five) and a
group's latency (generated, then waiting to be trained; the learner's medians). ``chip.sh`` writes
its tables with this.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from stoker.runner.report import read_jsonl, time_to_reach


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def figures(run_dir: Path, target: float) -> dict[str, Any]:
    metrics = read_jsonl(run_dir / "learner_metrics.jsonl")
    runs = read_jsonl(run_dir / "runs.jsonl")
    buffer = read_jsonl(run_dir / "buffer_stats.jsonl")
    if not metrics or not runs:
        return {"run": run_dir.name, "mode": runs[-1]["mode"] if runs else None, "steps": 0}
    started = runs[-1]["started_unix"]
    first = metrics[0]["time"]
    to_target = time_to_reach(metrics, "success_rate", target, start=first)
    reached_step = None
    if to_target is not None:
        reached_step = next(m["step"] for m in metrics if m["time"] - first >= to_target)
    seconds = metrics[-1]["time"] - first
    episodes = sum(m.get("episodes", 0) for m in metrics[1:])
    delivered = [b["generation"]["trajectories_per_second"] for b in buffer if b.get("generation")]
    duty = next((m["duty_cycle"] for m in reversed(metrics) if m.get("duty_cycle") is not None), None)
    actors = buffer[-1].get("generation", {}).get("actors") if buffer else None
    return {
        "run": run_dir.name,
        "mode": runs[-1]["mode"],
        "actors": actors,
        "first_step_seconds": first - started,
        "seconds_to_target": to_target,
        "steps_to_target": reached_step,
        "steps": metrics[-1]["step"],
        "duty_cycle": duty,
        "trajectories_per_second": delivered[-1] if delivered else (episodes / seconds if seconds > 0 else None),
        "staleness_mean": _mean([m["staleness_mean"] for m in metrics if m.get("staleness_mean") is not None]),
        "behaviour_ess": _mean([m["behaviour_ess"] for m in metrics if m.get("behaviour_ess") is not None]),
        "seconds_per_step": _median([b["time"] - a["time"] for a, b in zip(metrics[5:], metrics[6:])]),
        "group_seconds": _median([m["group_seconds"] for m in metrics if "group_seconds" in m]),
        "group_wait_seconds": _median([m["group_wait_seconds"] for m in metrics if "group_wait_seconds" in m]),
    }


def _cell(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def markdown(rows: list[dict[str, Any]], target: float) -> str:
    header = (
        f"| run | mode | actors | first step after start (s) | time to {target} from the first step (s) | steps to {target} | "
        "learner duty | trajectories/s | staleness mean | behaviour ESS | s per step | group generated (s) | "
        "group waited (s) |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['run']} | {r['mode']} | {_cell(r.get('actors'))} | {_cell(r.get('first_step_seconds'))} | "
        f"{_cell(r.get('seconds_to_target'))} | {_cell(r.get('steps_to_target'))} | {_cell(r.get('duty_cycle'), 2)} | "
        f"{_cell(r.get('trajectories_per_second'))} | {_cell(r.get('staleness_mean'), 2)} | {_cell(r.get('behaviour_ess'), 3)} | "
        f"{_cell(r.get('seconds_per_step'), 3)} | {_cell(r.get('group_seconds'), 3)} | {_cell(r.get('group_wait_seconds'), 3)} |"
        for r in rows
    ]
    return header + "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args()
    rows = [figures(run, args.target) for run in args.runs if (run / "runs.jsonl").exists()]
    table = markdown(rows, args.target)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.markdown:
        args.markdown.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The run report: ``report.md`` with matplotlib plots, written from a run directory's records.

Inputs are the learner's ``learner_metrics.jsonl`` (one record per training step) and the runner's
``buffer_stats.jsonl`` (buffer samples); either may be missing or short (an interrupted run still
gets a report of what happened). Held-out evaluation rounds (``eval_*`` fields of the learner's
records) get their own line and curve, apart from the training success rate.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # headless: the report is files, never a window
import matplotlib.pyplot as plt  # noqa: E402


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return records
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from an interrupted writer
    return records


def _series(records: list[dict[str, Any]], key: str, t0: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for record in records:
        if key in record and "time" in record and record[key] is not None:
            xs.append((record["time"] - t0) / 60.0)
            ys.append(float(record[key]))
    return xs, ys


def rolling_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        out.append(total / min(index + 1, window))
    return out


def time_to_reach(
    records: list[dict[str, Any]], key: str, target: float, window: int = 10, start: float | None = None
) -> float | None:
    """Seconds from ``start`` (default: the first record) until the rolling mean of ``key`` first
    reaches ``target``."""
    points = [(r["time"], float(r[key])) for r in records if r.get(key) is not None and "time" in r]
    if not points:
        return None
    smoothed = rolling_mean([v for _, v in points], window)
    t0 = records[0]["time"] if start is None else start
    for (moment, _), value in zip(points, smoothed):
        if value >= target:
            return moment - t0
    return None


def _plot(path: Path, title: str, xlabel: str, ylabel: str, series: list[tuple[list[float], list[float], str]]) -> None:
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for xs, ys, label in series:
        axis.plot(xs, ys, label=label)
    axis.set_title(title)
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    if len(series) > 1:
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def eval_rounds(metrics: list[dict[str, Any]]) -> list[tuple[int, float, float, int]]:
    """(policy version, success rate, mean reward, episodes) per evaluation round, by version; a
    round that grew as more actors reported keeps its last figures."""
    rounds: dict[int, tuple[int, float, float, int]] = {}
    for record in metrics:
        if record.get("eval_policy_version") is None or record.get("eval_success_rate") is None:
            continue
        version = int(record["eval_policy_version"])
        rounds[version] = (
            version, float(record["eval_success_rate"]), float(record.get("eval_reward_mean") or 0.0),
            int(record.get("eval_episodes") or 0),
        )
    return [rounds[v] for v in sorted(rounds)]


def _evaluation(metrics: list[dict[str, Any]], plots: Path) -> list[str]:
    rounds = eval_rounds(metrics)
    if not rounds:
        return []
    versions = [float(r[0]) for r in rounds]
    _plot(
        plots / "eval_success.png",
        "Held-out success (greedy)",
        "policy version",
        "success rate / mean reward",
        [(versions, [r[1] for r in rounds], "success rate"), (versions, [r[2] for r in rounds], "mean reward")],
    )
    first, last = rounds[0], rounds[-1]
    return [
        "## Held-out evaluation (greedy, never trained on)",
        "",
        f"- rounds: {len(rounds)}, versions {first[0]}..{last[0]}",
        f"- success: {first[1]:.3f} at v{first[0]} -> {last[1]:.3f} at v{last[0]} ({last[3]} episodes)",
        f"- mean reward: {first[2]:.3f} -> {last[2]:.3f}",
        "",
        "| policy version | success | mean reward | episodes |",
        "|---|---|---|---|",
        *(f"| {v} | {s:.3f} | {r:.3f} | {n} |" for v, s, r, n in rounds),
        "",
        "![held-out success](plots/eval_success.png)",
        "",
    ]


def write_report(run_dir: Path) -> Path:
    metrics = read_jsonl(run_dir / "learner_metrics.jsonl")
    buffer = read_jsonl(run_dir / "buffer_stats.jsonl")
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    lines = [f"# Run report: {run_dir.name}", ""]
    if not metrics:
        lines += ["No training steps were recorded.", ""]
    else:
        t0 = metrics[0]["time"]
        xs, success = _series(metrics, "success_rate", t0)
        _plot(
            plots / "success.png",
            "Success rate",
            "wall time (min)",
            "success rate",
            [(xs, success, "per step"), (xs, rolling_mean(success, 10), "rolling mean (10 steps)")],
        )
        xs_duty, duty = _series(metrics, "duty_cycle", t0)
        _plot(plots / "duty_cycle.png", "Learner duty cycle", "wall time (min)", "duty cycle", [(xs_duty, duty, "")])
        last = metrics[-1]
        reach = time_to_reach(metrics, "success_rate", 0.9)
        lines += [
            f"- steps: {last.get('step')}, policy version {last.get('policy_version')}",
            f"- wall time: {(last['time'] - t0) / 60:.1f} min",
            f"- final rolling success rate: {rolling_mean(success, 10)[-1]:.3f}" if success else "- success: n/a",
            f"- time to 0.9 success: {reach:.0f} s" if reach is not None else "- time to 0.9 success: not reached",
            f"- mean learner duty cycle: {sum(duty) / len(duty):.3f}" if duty else "- duty cycle: n/a",
            "",
            "![success](plots/success.png)",
            "![duty cycle](plots/duty_cycle.png)",
            "",
        ]
    if buffer:
        t0 = buffer[0]["time"]
        xs, fill = _series(buffer, "fill", t0)
        _plot(plots / "buffer_fill.png", "Buffer fill", "wall time (min)", "fill", [(xs, fill, "")])
        histogram = {int(k): int(v) for k, v in (buffer[-1].get("staleness_histogram") or {}).items()}
        figure, axis = plt.subplots(figsize=(6, 3.5))
        keys = sorted(histogram)
        axis.bar([str(k) for k in keys], [histogram[k] for k in keys])
        axis.set_title("Staleness at sample time")
        axis.set_xlabel("policy versions behind")
        axis.set_ylabel("groups")
        figure.tight_layout()
        figure.savefig(plots / "staleness.png", dpi=100)
        plt.close(figure)
        dropped = buffer[-1].get("dropped") or {}
        lines += [
            f"- trajectories accepted: {buffer[-1].get('accepted_total')}",
            f"- dropped: {dropped or 'none'}",
            f"- staleness histogram (versions behind: groups): {dict(sorted(histogram.items()))}",
            "",
            "![buffer fill](plots/buffer_fill.png)",
            "![staleness](plots/staleness.png)",
            "",
        ]
    lines += _evaluation(metrics, plots)
    report = run_dir / "report.md"
    report.write_text("\n".join(lines))
    return report

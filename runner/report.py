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
import numpy as np

from stoker.actor.diagnostics import combine, episode_time_line, read_snapshots
from stoker.jsonl import read_jsonl as read_jsonl  # re-exported: the benchmarks read runs with it
from stoker.learner.samples import SAMPLES_FILE, as_markdown
from stoker.runner import phases

matplotlib.use("Agg")  # headless: the report is files, never a window
import matplotlib.pyplot as plt  # noqa: E402


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


DUTY_WINDOW_SECONDS = 60.0
REPORT_SAMPLES = 4  # the newest sample episodes shown (samples.jsonl holds them all)
REPORT_FAILURE_REASONS = 5


def windowed_duty(records: list[dict[str, Any]], window: float = DUTY_WINDOW_SECONDS) -> tuple[list[float], list[float]]:
    """(time, duty cycle over the ``window`` seconds before it) per step record: train-step
    seconds inside the window / the window's length (shorter at the start). The cumulative figure
    the learner reports flattens out late in a run; this one shows when the learner was busy."""
    points = [(float(r["time"]), float(r.get("step_seconds") or 0.0)) for r in records if "time" in r]
    if not points:
        return [], []
    start = points[0][0] - points[0][1]
    times, duty = [], []
    begin, busy = 0, 0.0
    for moment, seconds in points:
        busy += seconds
        while points[begin][0] <= moment - window:
            busy -= points[begin][1]
            begin += 1
        span = min(window, moment - start)
        times.append(moment)
        duty.append(min(busy / span, 1.0) if span > 0 else 0.0)
    return times, duty


def _run_started(run_dir: Path) -> float | None:
    """When the newest ``stoker run`` in this directory started (runs.jsonl), for the wall time."""
    runs = read_jsonl(run_dir / "runs.jsonl")
    return float(runs[-1]["started_unix"]) if runs and "started_unix" in runs[-1] else None


def _generation(run_dir: Path, metrics: list[dict[str, Any]]) -> list[str]:
    snapshots = read_snapshots(sorted((run_dir / "actors").glob("*.json")))
    sampled = sum(float(r.get("sampled_tokens") or 0.0) for r in metrics)
    trained = sum(float(r.get("trained_tokens") or 0.0) for r in metrics)
    if not snapshots and not sampled:
        return []
    lines = ["## Generation", ""]
    if snapshots:
        g = combine(snapshots)
        lines += [
            f"- sampled tokens/s (all actors, over their wall time): {g['sampled_tokens_per_second']:.1f}",
            f"- trajectories/s: {g['trajectories_per_second']:.2f} ({g['episodes']} episodes by {g['actors']} actors)",
            f"- mean completion length: {g['completion_tokens_mean']:.1f} sampled tokens per episode",
            f"- truncated episodes: {100 * g['truncation_rate']:.1f}%",
            f"- failed or timed-out episodes: {g['failed_episodes']}",
        ]
        if (split := episode_time_line(g)) is not None:
            lines.append(f"- {split}")
    if (latency := group_latency_line(metrics)) is not None:
        lines.append(f"- {latency}")
    if sampled:
        lines.append(
            f"- tokens the learner received: {sampled:.0f} sampled, {trained:.0f} trained on "
            "(groups without reward spread and stale tokens do not train)"
        )
    lines.append("")
    if snapshots and g["failures"]:
        lines += ["## Why episodes failed", "", "| episodes | reason |", "|---|---|"]
        top = g["failures"][:REPORT_FAILURE_REASONS]
        lines += [f"| {f['count']} | {f['reason']} |" for f in top]
        lines.append("")
        for entry in top:
            lines += [f"First message of `{entry['reason']}`:", "", "````", entry["example"] or "(none)", "````", ""]
    if snapshots and g["reward_tampering_total"]:  # the judge refused these (reward 0 each time)
        lines += ["## Judge tampering (reward_tampering_total)", "", "| attempts | kind |", "|---|---|"]
        lines += [f"| {n} | {kind.replace('_', ' ')} |" for kind, n in g["reward_tampering_total"].items()]
        lines.append("")
    return lines


def group_latency_line(metrics: list[dict[str, Any]]) -> str | None:
    """How long a group took to generate and then waited to be trained (the learner's
    ``group_seconds`` and ``group_wait_seconds``, median over steps): with bounded staleness the
    sum of the two, not the actors' throughput, is what spaces the asynchronous loop's steps."""
    made = [float(r["group_seconds"]) for r in metrics if "group_seconds" in r]
    waited = [float(r["group_wait_seconds"]) for r in metrics if "group_wait_seconds" in r]
    if not made or not waited:
        return None
    return (
        f"a group's latency (median over {len(made)} steps): generated in {float(np.median(made)):.2f} s "
        f"(its first episode's start to its last one's end), trained {float(np.median(waited)):.2f} s after that"
    )


def _samples(run_dir: Path) -> list[str]:
    records = read_jsonl(run_dir / SAMPLES_FILE)
    if not records:
        return []
    lines = [f"## Sample episodes (newest {min(REPORT_SAMPLES, len(records))} of {len(records)}, all in {SAMPLES_FILE})", ""]
    for record in records[-REPORT_SAMPLES:]:
        try:
            lines += [as_markdown(record), ""]
        except (KeyError, TypeError, ValueError):
            continue  # a record from another version of Stoker
    return lines


def _bottlenecks(buffer: list[dict[str, Any]]) -> list[str]:
    """What capped the learner, sample by sample (``stoker.bottleneck``, as the live progress said)."""
    judged = [s for s in buffer if "bottleneck" in s]
    if not judged:
        return []
    limits = [(s["bottleneck"] or {}).get("limit", "none") for s in judged]
    counts = {limit: limits.count(limit) for limit in ("actors", "learner", "none")}
    share = {limit: 100 * n / len(limits) for limit, n in counts.items()}
    lines = [
        f"- what capped the learner ({len(limits)} buffer samples): actors {share['actors']:.0f} %, "
        f"the learner itself {share['learner']:.0f} %, balanced or warming up {share['none']:.0f} %",
    ]
    last = next((s["bottleneck"] for s in reversed(judged) if s["bottleneck"]), None)
    if last is not None:
        lines.append(f"- last bottleneck seen: {last['why']}; {last['fix']}")
    return lines


def write_report(run_dir: Path, failure: str | None = None) -> Path | None:
    """Write ``report.md``; None (and no file) for a failed run that recorded nothing to report,
    whose report would only say that no steps were made. ``failure`` heads the report."""
    metrics = read_jsonl(run_dir / "learner_metrics.jsonl")
    buffer = read_jsonl(run_dir / "buffer_stats.jsonl")
    if failure is not None and not metrics:
        return None
    plots = run_dir / "plots"
    plots.mkdir(exist_ok=True)
    lines = [f"# Run report: {run_dir.name}", ""]
    if failure is not None:
        lines += ["**The run failed**; what follows is what it recorded before that:", "", "````",
                  failure.strip()[:4000], "````", ""]
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
        times, window = windowed_duty(metrics)
        _plot(
            plots / "duty_cycle.png", "Learner duty cycle", "wall time (min)", "duty cycle",
            [([(t - t0) / 60.0 for t in times], window, f"last {DUTY_WINDOW_SECONDS:.0f} s"), (xs_duty, duty, "since start")],
        )
        last = metrics[-1]
        reach = time_to_reach(metrics, "success_rate", 0.9)
        started = _run_started(run_dir)
        ends = [last["time"], *([buffer[-1]["time"]] if buffer and "time" in buffer[-1] else [])]
        wall = (max(ends) - started) if started is not None and started <= t0 else last["time"] - t0
        lines += [
            f"- steps: {last.get('step')}, policy version {last.get('policy_version')}",
            f"- wall time: {wall / 60:.1f} min" + (f" (first step {(t0 - started):.0f} s after the start)" if started is not None and started <= t0 else ""),
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
        lines += _bottlenecks(buffer)
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
    lines += _generation(run_dir, metrics)
    lines += phases.report_lines(run_dir)
    lines += _samples(run_dir)
    report = run_dir / "report.md"
    report.write_text("\n".join(lines))
    return report

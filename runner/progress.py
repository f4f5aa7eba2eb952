"""The live progress of a local run: the learner's metrics stream plus the buffer's stats.

Reads ``learner_metrics.jsonl`` incrementally (the learner appends one record per step) and polls the
buffer's Stats; renders a ``rich`` live table on a terminal, or a plain line every few seconds
otherwise (CI logs, pipes). Buffer samples are also appended to ``buffer_stats.jsonl`` for the
report.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from rich.console import Console
from rich.live import Live
from rich.table import Table

from stoker.actor.diagnostics import combine, read_snapshots
from stoker.bottleneck import Bottleneck, combine_loads, diagnose, figures_from
from stoker.buffer.client import BufferClient, BufferClientError, RetryPolicy
from stoker.jsonl import json_line
from stoker.runner.diskfull import disk_full_error, is_no_space

if TYPE_CHECKING:
    from stoker.runner.options import RunOptions
    from stoker.runner.placement import Placement

# Steps averaged for the displayed (and target-checked) success rate.
SUCCESS_WINDOW_STEPS = 10
PLAIN_LINE_SECONDS = 10.0
BUFFER_POLL_SECONDS = 1.0
# Steps before the duty cycle says something about the loop rather than the first compile.
WARM_STEPS = 3


@dataclass
class MetricsTail:
    """Reads the records appended to a JSONL file since the last call (tolerates a partial line)."""

    path: Path
    _offset: int = 0
    _partial: str = ""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with self.path.open() as handle:
                handle.seek(self._offset)
                chunk = handle.read()
                self._offset = handle.tell()
        except FileNotFoundError:
            return []
        text = self._partial + chunk
        lines = text.split("\n")
        self._partial = lines.pop()
        records = []
        for line in lines:
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a torn line from a killed writer; the next record is whole
        return records


@dataclass
class RunState:
    """What the display shows, folded from metrics records and buffer stats."""

    started: float = field(default_factory=time.monotonic)
    last: dict[str, Any] = field(default_factory=dict)
    recent_success: deque[float] = field(default_factory=lambda: deque(maxlen=SUCCESS_WINDOW_STEPS))
    buffer: dict[str, Any] = field(default_factory=dict)
    generation: dict[str, Any] = field(default_factory=dict)  # the actors' snapshots combined
    first_step: int | None = None
    first_step_time: float | None = None
    eval_loss: float | None = None  # SFT's newest held-out loss
    bottleneck: Bottleneck | None = None  # what caps the learner now (stoker.bottleneck)

    def fold(self, record: dict[str, Any]) -> None:
        self.last = record
        if record.get("eval_loss") is not None:
            self.eval_loss = float(record["eval_loss"])
        if record.get("success_rate") is not None:  # null: no finite value this step
            self.recent_success.append(float(record["success_rate"]))
        step = record.get("step")
        if isinstance(step, int) and self.first_step is None:
            self.first_step, self.first_step_time = step, time.monotonic()

    def success_rate(self) -> float:
        return sum(self.recent_success) / len(self.recent_success) if self.recent_success else 0.0

    def reached(self, target: float) -> bool:
        """The rolling success rate is at ``target`` over a full window: one lucky first batch
        (a window of one step) must not end a ``--target-success`` run."""
        return len(self.recent_success) == self.recent_success.maxlen and self.success_rate() >= target

    def eta_seconds(self, max_steps: int) -> float | None:
        step = self.last.get("step")
        if not isinstance(step, int) or self.first_step is None or self.first_step_time is None:
            return None
        done = step - self.first_step
        if done <= 0:
            return None
        rate = done / max(time.monotonic() - self.first_step_time, 1e-9)
        return max(max_steps - step, 0) / rate


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def _eval_text(buffer_sample: dict[str, Any]) -> str:
    """The newest evaluation round, e.g. ``0.800 at v20 (10 episodes)``; ``-`` before any."""
    rounds = buffer_sample.get("eval_rounds") or []
    if not rounds:
        return "-"
    newest = rounds[-1]
    return f"{newest['success_rate']:.3f} at v{newest['policy_version']} ({newest['episodes']} episodes)"


def _tampering_text(last: dict[str, Any]) -> str:
    """``  tampering 0.25 (frame_introspection, ...)`` once a batch's episodes were caught trying
    to game the judge (docs/environments.md, "Seeing it try"); "" otherwise."""
    rate = last.get("episode_tampering_attempts")
    if not isinstance(rate, int | float) or not rate > 0:
        return ""
    kinds = sorted(k.removeprefix("episode_tampering/") for k, v in last.items() if k.startswith("episode_tampering/") and v)
    return f"  tampering {rate:.2f}" + (f" ({', '.join(kinds)})" if kinds else "")


def _failures_text(generation: dict[str, Any]) -> str:
    """``N`` failed episodes and the most common reason."""
    failed = generation.get("failed_episodes")
    if not failed:
        return "0" if generation else "-"
    top = (generation.get("failures") or [{}])[0]
    return f"{failed} (top: {top.get('count')} x {top.get('reason')})"


def _load_sample(stats: Any) -> dict[str, float] | None:
    load = combine_loads(stats.actor_loads.values())
    if load is None:
        return None
    return {"actors": load.actors, "cpu_cores": round(load.cpu_cores * load.actors, 3),
            "episodes_in_flight": round(load.episodes_in_flight, 2), "slots": load.slots}


def _load_text(buffer_sample: dict[str, Any]) -> str:
    """``1.62 cores, 7.9 of 8 episode slots (2 actors)``; ``-`` before any actor reports."""
    load = buffer_sample.get("actor_load")
    if not load:
        return "-"
    return (f"{load['cpu_cores']:.2f} cores, {load['episodes_in_flight']:.1f} of {load['slots']} episode slots "
            f"({load['actors']} actors)")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s"


class Progress:
    """Context manager: live display while a run is supervised."""

    def __init__(self, options: RunOptions):
        self.options = options
        self.max_steps = options.max_steps or options.job.spec.learner.max_steps
        self.state = RunState()
        self.tail = MetricsTail(options.metrics_path)
        self._buffer_client: Any = None
        self._placement: Placement | None = None  # the actors started and the host, for the advice
        self._last_poll = 0.0
        self._last_line = 0.0
        self._live: Live | None = None
        self._buffer_log = (options.run_dir / "buffer_stats.jsonl").open("a")

    def __enter__(self) -> Progress:
        if self.options.live:
            self._live = Live(self.render(), console=Console(stderr=True), refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_display()
        try:
            self._buffer_log.close()
        except OSError as exc:  # what a full disk left in its buffer: the run already stops for it
            if not is_no_space(exc):
                raise
        if self._buffer_client is not None:
            self._buffer_client.close()

    def stop_display(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(None, None, None)
            self._live = None

    def note(self, text: str) -> None:
        """A message for the user (a child died, was restarted): above the live display, or a line."""
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=sys.stderr, flush=True)

    def attach_buffer(self, address: str, placement: Placement | None = None) -> None:
        self._placement = placement
        # One try, briefly: this runs on the loop that watches the children, and a buffer that has
        # died must not hold it in the client's minutes of retries before it notices.
        self._buffer_client = BufferClient(address, token=None, retry=RetryPolicy(deadline=0.0), timeout=2.0)

    def success_rate(self) -> float:
        return self.state.success_rate()

    def reached(self, target: float) -> bool:
        return self.state.reached(target)

    def refresh(self) -> None:
        for record in self.tail.read_new():
            self.state.fold(record)
        now = time.monotonic()
        if now - self._last_poll >= BUFFER_POLL_SECONDS:
            self._last_poll = now
            self._poll_actors()
            if self._buffer_client is not None:
                self._poll_buffer()
        if self._live is not None:
            self._live.update(self.render())
        elif now - self._last_line >= PLAIN_LINE_SECONDS:
            self._last_line = now
            print(self.summary(), file=sys.stderr, flush=True)

    def _poll_actors(self) -> None:
        snapshots = read_snapshots(sorted(self.options.actor_stats_dir.glob("*.json")))
        if snapshots:
            self.state.generation = combine(snapshots)

    def _poll_buffer(self) -> None:
        try:
            stats = self._buffer_client.stats()
        except (grpc.RpcError, BufferClientError):
            return  # the buffer is starting or stopping; the next poll will tell
        self.state.bottleneck = self._diagnose(stats)
        found = self.state.bottleneck
        sample = {
            "time": time.time(),
            "bottleneck": None if found is None else {
                "limit": found.limit, "why": found.why, "fix": found.fix, "bound": found.bound, "knob": found.knob,
                "value": found.value, "factor": found.factor,
            },
            "fill": stats.fill,
            "stored": stats.stored_trajectories,
            "complete_groups": stats.complete_groups,
            "accepted_total": stats.accepted_total,
            "put_rate": stats.put_rate,
            # The actors' own loads (Stats.actor_loads): CPU cores and episodes in flight, summed.
            "actor_load": _load_sample(stats),
            "policy_version": stats.policy_version,
            "dropped": dict(stats.dropped),
            "staleness_histogram": {str(k): v for k, v in stats.staleness_histogram.items()},
            # What the actors generated (sampled tokens, not the learner's trained ones).
            "generation": {k: v for k, v in self.state.generation.items() if k != "failures"},
            "eval_rounds": [
                {"policy_version": r.policy_version, "episodes": r.episodes, "success_rate": r.success_rate,
                 "mean_reward": r.mean_reward}
                for r in stats.eval_rounds[-1:]
            ],
        }
        self.state.buffer = sample
        try:
            self._buffer_log.write(json_line(sample))
            self._buffer_log.flush()
        except OSError as exc:
            if not is_no_space(exc):
                raise
            raise disk_full_error(self.options.run_dir / "buffer_stats.jsonl", exc, self.options.run_dir) from exc

    def _diagnose(self, stats: Any) -> Bottleneck | None:
        """The loop's bottleneck, once the learner has stepped past its compile (before that its
        duty cycle measures the compiler, not the actors)."""
        step = self.state.last.get("step")
        if not isinstance(step, int) or step < WARM_STEPS:
            return None
        duty = self.state.last.get("duty_cycle")
        placement = self._placement
        return diagnose(figures_from(
            stats, self.options.job.spec, None if duty is None else float(duty),
            replicas=placement.actors.replicas if placement is not None else None,
            host=placement.host if placement is not None else None,
        ))

    def summary(self) -> str:
        last, buf, gen = self.state.last, self.state.buffer, self.state.generation
        if self.options.job.spec.algorithm.trains_on_dataset:  # SFT, DPO on pairs: the learner alone
            return (
                f"step {_fmt(last.get('step'))}/{self.max_steps}  version {_fmt(last.get('policy_version'))}  "
                f"loss {_fmt(last.get('loss'))}  held-out loss {_fmt(self.state.eval_loss)}  "
                f"elapsed {_duration(time.monotonic() - self.state.started)}"
            )
        return (
            f"step {_fmt(last.get('step'))}/{self.max_steps}  version {_fmt(last.get('policy_version'))}  "
            f"success {self.success_rate():.2f}  reward {_fmt(last.get('reward_mean'))}  "
            f"duty {_fmt(last.get('duty_cycle'), 2)}  fill {_fmt(buf.get('fill'), 2)}  "
            f"staleness {_fmt(last.get('staleness_mean'), 2)}  traj/s {_fmt(buf.get('put_rate'), 1)}  "
            f"sampled tok/s {_fmt(gen.get('recent_sampled_tokens_per_second'), 1)}  "
            f"trained tok/s {_fmt(last.get('tokens_per_second'), 0)}  "
            f"len {_fmt(gen.get('completion_tokens_mean'), 1)}  truncated {_fmt(gen.get('truncation_rate'), 2)}  "
            f"failed {_fmt(gen.get('failed_episodes'))}  "
            f"elapsed {_duration(time.monotonic() - self.state.started)}"
            + _tampering_text(last)
            + (f"\n  bottleneck: {self.state.bottleneck}" if self.state.bottleneck is not None else "")
        )

    def render(self) -> Table:
        last, buf, gen = self.state.last, self.state.buffer, self.state.generation
        table = Table(title=f"stoker run {self.options.job.metadata.name} ({self.options.mode})", show_header=False)
        table.add_column("metric", style="bold")
        table.add_column("value")
        dropped = buf.get("dropped") or {}
        rows = [
            ("step", f"{_fmt(last.get('step'))} / {self.max_steps}"),
            ("policy version", _fmt(last.get("policy_version"))),
            ("success rate", f"{self.success_rate():.3f} (last {SUCCESS_WINDOW_STEPS} steps)"),
            ("reward", _fmt(last.get("reward_mean"))),
            ("held-out success (greedy)", _eval_text(buf)),
            ("loss (held-out)", f"{_fmt(last.get('loss'))} ({_fmt(self.state.eval_loss)})"),
            ("learner duty cycle", _fmt(last.get("duty_cycle"), 3)),
            ("buffer fill", _fmt(buf.get("fill"), 3)),
            ("staleness (mean / max)", f"{_fmt(last.get('staleness_mean'), 2)} / {_fmt(last.get('staleness_max'))}"),
            ("dropped", ", ".join(f"{k} {v}" for k, v in dropped.items()) or "0"),
            ("judge tampering (per episode)", _fmt(last.get("episode_tampering_attempts"), 3)),
            ("trajectories/s (buffer puts)", _fmt(buf.get("put_rate"), 1)),
            ("actors' CPU and episodes in flight", _load_text(buf)),
            ("generated tokens/s (actors, last 30 s)", _fmt(gen.get("recent_sampled_tokens_per_second"), 1)),
            ("generated trajectories/s (last 30 s)", _fmt(gen.get("recent_trajectories_per_second"), 2)),
            ("trained tokens/s (step time)", _fmt(last.get("tokens_per_second"), 0)),
            ("completion length (tokens)", _fmt(gen.get("completion_tokens_mean"), 1)),
            ("truncated episodes", _fmt(gen.get("truncation_rate"), 3)),
            ("failed episodes", _failures_text(gen)),
            ("elapsed", _duration(time.monotonic() - self.state.started)),
            ("ETA", _duration(self.state.eta_seconds(self.max_steps))),
            ("bottleneck", str(self.state.bottleneck) if self.state.bottleneck is not None else "none seen"),
        ]
        for name, value in rows:
            table.add_row(name, value)
        return table

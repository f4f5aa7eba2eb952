"""What an actor's episodes say about the run: generation throughput and why episodes failed.

``ActorDiagnostics`` folds every finished episode: tokens the policy sampled, trajectories, model
turns, truncations, failed or timed-out episodes counted by reason (``failure_key``) with the
first full message of each reason kept as its example, and the judge's refused attempts by kind
(``reward_tampering_total``, from the episodes' ``tampering/<kind>`` metrics). The actor logs the top reasons and, when
given a path (``stoker actor --stats-file``), rewrites a small JSON snapshot there that
``stoker run``'s progress and report read (``read_snapshots``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from stoker.trajectory import Episode
from stoker.v1 import trajectory_pb2

log = logging.getLogger("stoker.actor")

STATUS_NAMES: dict[int, str] = {
    trajectory_pb2.EPISODE_STATUS_OK: "ok",
    trajectory_pb2.EPISODE_STATUS_TRUNCATED: "truncated",
    trajectory_pb2.EPISODE_STATUS_FAILED: "failed",
    trajectory_pb2.EPISODE_STATUS_TIMEOUT: "timeout",
}
FAILED_STATUSES = (trajectory_pb2.EPISODE_STATUS_FAILED, trajectory_pb2.EPISODE_STATUS_TIMEOUT)
MAX_REASON_CHARS = 120
MAX_EXAMPLE_CHARS = 4000
MAX_REASONS = 50  # distinct reasons kept; the rest count under "other"
SNAPSHOT_SECONDS = 2.0  # the stats file is rewritten this often while the actor runs (and at the end)
RECENT_SECONDS = 30.0  # the window of the "recent" rates the progress display shows
# The window of an actor's load: short, so the start's compilation soon leaves it.
LOAD_SECONDS = 10.0
EPISODE_TIME_KEYS = ("episode_seconds", "sample_seconds", "environment_seconds")  # summed over episodes


@dataclass(frozen=True)
class LoadReading:
    """What an actor measured of itself over about the last ``LOAD_SECONDS`` (sent to the buffer
    as ``stoker.v1.ActorLoad`` with each Acquire): whether more episodes in flight would help it
    (slots full, CPU idle: latency-bound) or only more actors or cores would (CPU-bound)."""

    cpu_cores: float  # the process's CPU seconds (all threads) per wall second
    episodes_in_flight: float  # mean episodes running at once
    concurrency: int  # the most it runs at once
    trajectories_per_second: float


class LoadMeter:
    """Reads an actor's load: ``time.process_time`` for its CPU, ``slot_seconds`` (the running
    episodes' summed wall time, ``EpisodeSlots.slot_seconds``) for what it has in flight, and the
    finished episodes; each reading spans the newest window at least ``LOAD_SECONDS`` long."""

    def __init__(
        self, concurrency: int, slot_seconds: Callable[[], float], episodes: Callable[[], int], *,
        clock: Callable[[], float] = time.monotonic, cpu: Callable[[], float] = time.process_time,
    ):
        self.concurrency = concurrency
        self._clock, self._cpu = clock, cpu
        self._slot_seconds = slot_seconds
        self._episodes = episodes
        # (wall, process CPU, slot-seconds, episodes) at each reading: the window's start.
        self._history: deque[tuple[float, float, float, int]] = deque(maxlen=256)
        self._history.append(self._now())

    def _now(self) -> tuple[float, float, float, int]:
        return self._clock(), self._cpu(), self._slot_seconds(), self._episodes()

    def read(self) -> LoadReading:
        now = self._now()
        self._history.append(now)
        while len(self._history) > 2 and self._history[1][0] <= now[0] - LOAD_SECONDS:
            self._history.popleft()
        then = self._history[0]
        span = max(now[0] - then[0], 1e-9)
        return LoadReading(
            cpu_cores=(now[1] - then[1]) / span,
            episodes_in_flight=(now[2] - then[2]) / span,
            concurrency=self.concurrency,
            trajectories_per_second=(now[3] - then[3]) / span,
        )


def failure_key(episode: Episode) -> str:
    """A failure's reason as a countable key: its status and the first line of its message, with
    numbers (turns, seconds, ids) replaced by N so one bug is one reason."""
    lines = (episode.status_reason or "").strip().splitlines()
    first = lines[0] if lines else "no reason given"
    first = re.sub(r"\d+(\.\d+)?", "N", first)
    if len(first) > MAX_REASON_CHARS:
        first = first[: MAX_REASON_CHARS - 3] + "..."
    return f"{STATUS_NAMES.get(int(episode.status), str(episode.status))}: {first}"


def sampled_tokens(episode: Episode) -> int:
    return int(np.asarray(episode.loss_mask).sum())


@dataclass
class ActorDiagnostics:
    """Running totals over every episode an actor finished (training episodes, not evaluation)."""

    actor_id: str = ""
    started: float = field(default_factory=time.monotonic)
    episodes: int = 0
    sampled_tokens: int = 0
    model_turns: int = 0
    truncated: int = 0
    # Summed over episodes: wall time (sandbox start included), waiting on the sampler, on the environment.
    episode_seconds: float = 0.0
    sample_seconds: float = 0.0
    environment_seconds: float = 0.0
    failures: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    # The judge's refused attempts by kind (``reward_tampering_total``), from each episode's metrics.
    tampering: Counter[str] = field(default_factory=Counter)
    # (monotonic time, sampled tokens, episodes) at each snapshot: the recent rates' window.
    _history: deque[tuple[float, int, int]] = field(default_factory=lambda: deque(maxlen=256))

    def add(self, episodes: Iterable[Episode]) -> list[str]:
        """Fold finished episodes; returns the failure reasons seen for the first time."""
        new: list[str] = []
        for episode in episodes:
            self.episodes += 1
            self.sampled_tokens += sampled_tokens(episode)
            self.model_turns += int(episode.num_turns)
            self.episode_seconds += max(0.0, float(episode.finished_unix) - float(episode.started_unix))
            self.sample_seconds += float(episode.sample_seconds)
            self.environment_seconds += float(episode.environment_seconds)
            self.truncated += int(episode.status == trajectory_pb2.EPISODE_STATUS_TRUNCATED)
            for key, value in (episode.metrics or {}).items():  # cumulative over the episode: its last value
                if key.startswith("tampering/") and value:
                    self.tampering[key.removeprefix("tampering/")] += int(value)
            if episode.status in FAILED_STATUSES:
                key = failure_key(episode)
                if key not in self.examples and len(self.examples) >= MAX_REASONS:
                    key = "other reasons"
                if key not in self.examples:
                    self.examples[key] = (episode.status_reason or "")[:MAX_EXAMPLE_CHARS]
                    new.append(key)
                self.failures[key] += 1
        return new

    def recent_rates(self, now: float) -> tuple[float, float]:
        """(sampled tokens/s, episodes/s) since the newest snapshot at least ``RECENT_SECONDS`` old
        (since the start when there is none): what the actor generates now, 0 while it is held back."""
        self._history.append((now, self.sampled_tokens, self.episodes))
        while len(self._history) > 1 and self._history[1][0] <= now - RECENT_SECONDS:
            self._history.popleft()
        then, tokens, episodes = self._history[0] if self._history[0][0] <= now - RECENT_SECONDS else (self.started, 0, 0)
        span = max(now - then, 1e-9)
        return (self.sampled_tokens - tokens) / span, (self.episodes - episodes) / span

    def snapshot(self) -> dict[str, Any]:
        now = time.monotonic()
        elapsed = max(now - self.started, 1e-9)
        recent_tokens, recent_episodes = self.recent_rates(now)
        n = max(self.episodes, 1)
        return {
            "actor_id": self.actor_id,
            "time": time.time(),
            "elapsed_seconds": elapsed,
            "episodes": self.episodes,
            "sampled_tokens": self.sampled_tokens,
            # Throughput of the whole actor (all its concurrent episodes) over its wall time.
            "sampled_tokens_per_second": self.sampled_tokens / elapsed,
            "trajectories_per_second": self.episodes / elapsed,
            "recent_sampled_tokens_per_second": recent_tokens,  # over the last RECENT_SECONDS
            "recent_trajectories_per_second": recent_episodes,
            "completion_tokens_mean": self.sampled_tokens / n,
            "turn_tokens_mean": self.sampled_tokens / max(self.model_turns, 1),
            "truncation_rate": self.truncated / n,
            "episode_seconds": self.episode_seconds,
            "sample_seconds": self.sample_seconds,
            "environment_seconds": self.environment_seconds,
            "failed_episodes": sum(self.failures.values()),
            "failures": [
                {"reason": key, "count": count, "example": self.examples.get(key, "")}
                for key, count in self.failures.most_common()
            ],
            "reward_tampering_total": dict(self.tampering.most_common()),
        }

    def summary_line(self) -> str:
        s = self.snapshot()
        return (
            f"generated {s['recent_sampled_tokens_per_second']:.1f} tok/s, {s['recent_trajectories_per_second']:.2f} traj/s "
            f"(last {RECENT_SECONDS:.0f} s; {s['sampled_tokens_per_second']:.1f} tok/s since the start), "
            f"{s['completion_tokens_mean']:.1f} tokens per episode, truncated {100 * s['truncation_rate']:.0f}%"
        )

    def top_failures(self, n: int = 3) -> list[tuple[str, int]]:
        return self.failures.most_common(n)


def episode_time_line(combined: dict[str, Any]) -> str | None:
    """Where an episode's wall time went (``combine``'s sums), or None before any episode: the
    split that tells an actor held up by its sampler from one held up by its environments."""
    total, episodes = float(combined.get("episode_seconds", 0.0)), int(combined.get("episodes", 0))
    if total <= 0 or episodes == 0:
        return None
    sample, environment = float(combined.get("sample_seconds", 0.0)), float(combined.get("environment_seconds", 0.0))
    rest = max(0.0, total - sample - environment)
    return (
        f"an episode's wall time (mean {total / episodes:.2f} s): waiting for the sampler {100 * sample / total:.0f}%, "
        f"the environment {100 * environment / total:.0f}% (its sandbox's start included), the rest {100 * rest / total:.0f}%"
    )


def write_snapshot(path: Path, snapshot: dict[str, Any]) -> None:
    """Atomically replace ``path`` (readers never see a half-written file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(snapshot))
    os.replace(partial, path)


class StatsFile:
    """An actor's snapshot file: rewritten at most every ``SNAPSHOT_SECONDS`` as groups finish,
    and every ``SNAPSHOT_SECONDS`` regardless (``keep``), so it stays current while the actor waits."""

    def __init__(self, path: Path):
        self.path = path
        self._written_at = 0.0

    def write(self, diagnostics: ActorDiagnostics, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._written_at < SNAPSHOT_SECONDS:
            return
        self._written_at = now
        try:
            write_snapshot(self.path, diagnostics.snapshot())
        except OSError as exc:  # diagnostics never stop the actor
            log.warning("could not write %s: %s", self.path, exc)

    async def keep(self, diagnostics: ActorDiagnostics) -> None:
        while True:
            await asyncio.sleep(SNAPSHOT_SECONDS)  # the snapshot's period
            self.write(diagnostics, force=True)


def read_snapshots(paths: Sequence[Path]) -> list[dict[str, Any]]:
    out = []
    for path in paths:
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    return out


def combine(snapshots: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """All actors' snapshots as one: rates add up, means are weighted by episodes, failures merge."""
    episodes = sum(int(s.get("episodes", 0)) for s in snapshots)
    tokens = sum(int(s.get("sampled_tokens", 0)) for s in snapshots)
    truncated = sum(float(s.get("truncation_rate", 0.0)) * int(s.get("episodes", 0)) for s in snapshots)
    counts: Counter[str] = Counter()
    tampering: Counter[str] = Counter()
    examples: dict[str, str] = {}
    for s in snapshots:
        tampering.update({kind: int(n) for kind, n in (s.get("reward_tampering_total") or {}).items()})
        for entry in s.get("failures", []):
            counts[entry["reason"]] += int(entry["count"])
            examples.setdefault(entry["reason"], entry.get("example", ""))
    return {
        "actors": len(snapshots),
        "episodes": episodes,
        "sampled_tokens": tokens,
        "sampled_tokens_per_second": sum(float(s.get("sampled_tokens_per_second", 0.0)) for s in snapshots),
        "trajectories_per_second": sum(float(s.get("trajectories_per_second", 0.0)) for s in snapshots),
        "recent_sampled_tokens_per_second": sum(float(s.get("recent_sampled_tokens_per_second", 0.0)) for s in snapshots),
        "recent_trajectories_per_second": sum(float(s.get("recent_trajectories_per_second", 0.0)) for s in snapshots),
        "completion_tokens_mean": tokens / episodes if episodes else 0.0,
        "truncation_rate": truncated / episodes if episodes else 0.0,
        **{key: sum(float(s.get(key, 0.0)) for s in snapshots) for key in EPISODE_TIME_KEYS},
        "failed_episodes": sum(counts.values()),
        "failures": [{"reason": k, "count": c, "example": examples[k]} for k, c in counts.most_common()],
        "reward_tampering_total": dict(tampering.most_common()),
    }

"""What the rollout engine takes and gives: turns, their results, its errors, the window of
recent sampler calls its load figures come from, and its log of weight versions."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from stoker.spec import TransformerConfig

STATS_WINDOW_SECONDS = 10.0


class EngineBusy(Exception):
    """The queue is full; the caller should retry after ``retry_after_ms``."""

    def __init__(self, retry_after_ms: int, queued: int):
        super().__init__(f"{queued} requests are waiting for a batch slot; retry in {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class EngineStopped(Exception):
    """The engine stopped before the turn was answered."""


@dataclass
class TurnResult:
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # one per token id
    finished: bool  # ended on a stop token


@dataclass
class Turn:
    """One turn in the engine: the request and what it has sampled so far."""

    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    session: str
    pinned: bool
    greedy: bool  # temperature 0 (evaluation); the sampler takes one temperature per call
    private: bool  # no session named: the engine made one up and ends it with the turn
    on_done: Callable[[TurnResult | BaseException], None]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    started: bool = False
    cancelled: bool = False
    queued_at: float = 0.0


@dataclass
class EngineStats:
    policy_version: int
    live_versions: list[int]
    tokens_per_second: float
    queue_depth: int
    running: int
    max_batch: int
    batch_occupancy: float
    kv_cache_bytes_used: int
    kv_cache_bytes_total: int
    requests_total: int
    rejected_total: int
    segments_total: int


class LoadWindow:
    """The sampler calls of the last ``seconds`` (tokens sampled; rows for a decode segment, None
    for a prefill call, which is not the decode batch) and a moving mean of a turn's time in the
    engine. Not thread-safe: the engine holds its lock."""

    def __init__(self, seconds: float = STATS_WINDOW_SECONDS):
        self.seconds = seconds
        self._calls: deque[tuple[float, int, int | None]] = deque()  # (end time, tokens, rows)
        self._turn_seconds = 0.0

    def record(self, now: float, tokens: int, rows: int | None) -> None:
        self._calls.append((now, tokens, rows))
        self.trim(now)

    def answered(self, seconds_in_engine: float) -> None:
        self._turn_seconds = 0.8 * self._turn_seconds + 0.2 * seconds_in_engine

    def trim(self, now: float) -> None:
        while self._calls and self._calls[0][0] < now - self.seconds:
            self._calls.popleft()

    def tokens_per_second(self, now: float) -> float:
        if not self._calls:
            return 0.0
        span = min(self.seconds, max(now - self._calls[0][0], 1e-3))
        return sum(t for _, t, _ in self._calls) / span

    def occupancy(self, max_batch: int) -> float:
        """Mean live rows of the decode segments, as a fraction of the batch."""
        rows = [r for _, _, r in self._calls if r is not None]
        return sum(rows) / len(rows) / max_batch if rows else 0.0

    def retry_after_ms(self, queued: int, max_batch: int) -> int:
        """About when a slot frees: a turn's recent time in the engine, per batch of queued turns."""
        waves = queued / max_batch
        seconds = self._turn_seconds * max(waves, 1.0) if self._turn_seconds else 0.2
        return int(min(max(seconds * 1000, 50), 5000))


@dataclass
class VersionLog:
    """One log line per weight version change at most every ``seconds`` (a learner publishing every
    step would otherwise fill the log), with how many versions it spans; the rest at debug."""

    seconds: float = 60.0
    clock: Callable[[], float] = time.monotonic
    _last: tuple[float, int] | None = None  # when the last line was logged, and its version

    def changed(self, version: int) -> None:
        log = logging.getLogger("stoker.rollout")
        now = self.clock()
        if self._last is None or now - self._last[0] >= self.seconds:
            since = "" if self._last is None else f" ({version - self._last[1]} versions since the last such line)"
            log.info("rollout engine now samples new turns with policy version %d%s", version, since)
            self._last = (now, version)
        else:
            log.debug("rollout engine now samples new turns with policy version %d", version)


def check_turn(
    config: TransformerConfig, session_len: int, prompt: Sequence[int], max_new_tokens: int,
    stop_token_ids: Sequence[int],
) -> None:
    """Raises ``ValueError`` for a turn the model cannot serve."""
    vocab = config.vocab_size
    if not prompt:
        raise ValueError("prompt_ids is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {min(prompt)}..{max(prompt)}")
    if any(not 0 <= t < vocab for t in stop_token_ids):
        raise ValueError(f"stop token ids must lie in [0, {vocab})")
    limit = min(config.max_seq_len, session_len)
    if len(prompt) + max_new_tokens > limit:
        raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens exceed the model's {limit}")

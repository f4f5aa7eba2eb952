"""Continuous batching over the ``Sampler``: every connected actor's turns share one decode batch.

The engine runs the model in *segments* of at most ``segment_tokens`` decode steps. Each segment
takes every running turn -- plus queued ones admitted into free batch slots -- into one
``Sampler.generate(..., sessions=...)`` call. A turn's session cache already holds its context,
so a continuation prefills only the token sampled last; a turn that hits a stop token or its
limit is answered at once, and its slot goes to the next queued turn at the next segment. The
sampler's jitted program is unchanged: a segment is an ordinary call with a small
``max_new_tokens``. Why segments and how long (docs/architecture.md, "The rollout tier").

Weights. Sessions are pinned (``pin_sessions=True``): a turn keeps the weights it started with,
so every token of an answer carries one version. A ``pin_weights`` session keeps its first version
until it ends (``between-episodes``); any other moves to the newest at its next turn (its cache
dropped and the conversation prefilled again). A version is released once no session uses it.

One thread (``run`` / ``start``) drives the sampler; ``submit``, ``load_weights``,
``end_session`` and ``stats`` may be called from any thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from stoker.distributed import PeerFailure
from stoker.rollout.sampling import Sampler
from stoker.rollout.turns import (
    EngineBusy, EngineStats, EngineStopped, LoadWindow, Turn, TurnResult, VersionLog, check_turn,
)
from stoker.weights.errors import WeightsError

__all__ = ["PREFILL_APART_ABOVE", "PREFILL_ROWS", "SEGMENT_TOKENS", "Engine"]

log = logging.getLogger("stoker.rollout")

# Decode steps per segment: see docs/architecture.md ("The rollout tier") for the measurement.
SEGMENT_TOKENS = 16
# A turn whose uncached prompt pads wider than this is prefilled in a call of its own, sampling
# its first token, and then decodes with the others: in the segment's call it would pad every
# decoding row to its width (benchmarks/README.md, "Long prefills").
PREFILL_APART_ABOVE = 64
# Rows of such a prefill call: a long prompt is already a wide matrix, so calls are not batched
# further, and one prefill call per segment bounds what the decoding rows wait.
PREFILL_ROWS = 1
# Sessions nobody ended (an actor that died mid-episode) are forgotten after this long idle.
SESSION_IDLE_SECONDS = 600.0


class Engine:
    """Turns in, answers out, batched continuously over one ``Sampler`` with sessions.

    ``max_batch``: turns decoded together (at most the sampler's session rows). ``max_queue``:
    turns waiting for a slot beyond which ``submit`` raises ``EngineBusy``. ``prefill_apart_above``:
    the prefill width (a ``Sampler.prefill_bucket``) beyond which a turn is prefilled apart from
    the decoding rows, in calls of ``prefill_rows`` rows (None: never)."""

    def __init__(
        self,
        sampler: Sampler,
        *,
        max_batch: int,
        max_queue: int,
        segment_tokens: int = SEGMENT_TOKENS,
        prefill_apart_above: int | None = PREFILL_APART_ABOVE,
        prefill_rows: int = PREFILL_ROWS,
        session_idle_seconds: float = SESSION_IDLE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not sampler.keeps_sessions or not sampler.pin_sessions:
            raise ValueError("the engine needs a sampler with session rows and pin_sessions=True")
        if max_batch > sampler.session_capacity:
            raise ValueError(f"max_batch {max_batch} exceeds the sampler's {sampler.session_capacity} session rows")
        if not 1 <= prefill_rows <= max_batch:
            raise ValueError(f"prefill_rows must lie in [1, max_batch={max_batch}], got {prefill_rows}")
        self.sampler = sampler
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.segment_tokens = segment_tokens
        self.prefill_apart_above = prefill_apart_above
        self.prefill_rows = prefill_rows
        self.session_idle_seconds = session_idle_seconds
        self._clock = clock
        self._lock = threading.Condition()
        self._queue: deque[Turn] = deque()
        self._running: list[Turn] = []
        self._busy: set[str] = set()  # sessions with a turn queued or running
        self._idle: dict[str, tuple[bool, float]] = {}  # sessions between turns: (pinned, since)
        self._ends: list[str] = []
        self._weights: list[tuple[Mapping[str, np.ndarray], int, threading.Event]] = []
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._anonymous = itertools.count()
        self._window = LoadWindow()  # tokens/s, occupancy and the retry hint
        self.requests_total = 0
        self.rejected_total = 0
        self.segments_total = 0
        self._version = sampler.version
        self._versions = VersionLog()
        self.failure: PeerFailure | None = None  # why the engine ended on its own
        self.finished = threading.Event()  # the engine thread has ended

    # ------------------------------------------------------------------ any thread

    def submit(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        session: str,
        pin_weights: bool,
        on_done: Callable[[TurnResult | BaseException], None],
        greedy: bool = False,
    ) -> Callable[[], None]:
        """Queue one turn; ``on_done`` gets its result (or exception) on the engine thread.
        Returns a function that cancels the turn. Raises ``ValueError`` for a request the model
        cannot serve and ``EngineBusy`` when the queue is full."""
        check_turn(self.sampler.config, self.sampler.session_len, prompt, max_new_tokens, stop_token_ids)
        private = not session
        turn = Turn(
            list(prompt), int(max_new_tokens), tuple(stop_token_ids), session or f"\0anonymous/{next(self._anonymous)}",
            pinned=pin_weights, greedy=greedy, private=private, on_done=on_done, queued_at=self._clock(),
        )
        with self._lock:
            if self._stopping:
                raise EngineStopped("the rollout engine is stopping")
            self.requests_total += 1
            if len(self._queue) >= self.max_queue:
                self.rejected_total += 1
                raise EngineBusy(self._window.retry_after_ms(len(self._queue), self.max_batch), len(self._queue))
            if turn.session in self._busy:
                raise ValueError(f"session {session!r} already has a turn in flight")
            self._busy.add(turn.session)
            self._idle.pop(turn.session, None)
            self._queue.append(turn)
            self._lock.notify_all()

        def cancel() -> None:
            turn.cancelled = True

        return cancel

    async def generate(
        self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: str = "",
        pin_weights: bool = False, greedy: bool = False,
    ) -> TurnResult:
        """``submit`` for an event loop: awaits the answer; cancelling the task cancels the turn."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TurnResult] = loop.create_future()

        def deliver(outcome: TurnResult | BaseException) -> None:
            def settle() -> None:
                if future.done():
                    return
                if isinstance(outcome, BaseException):
                    future.set_exception(outcome)
                else:
                    future.set_result(outcome)

            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:  # the caller's event loop is closed: nobody waits for the answer
                pass

        cancel = self.submit(
            prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, session=session,
            pin_weights=pin_weights, on_done=deliver, greedy=greedy,
        )
        try:
            return await future
        except asyncio.CancelledError:
            cancel()
            raise

    def load_weights(self, flat: Mapping[str, np.ndarray], version: int, timeout: float | None = None) -> bool:
        """Serve ``version`` from the next segment on; blocks until it is loaded (False on timeout,
        or when it could not be loaded)."""
        loaded = threading.Event()
        with self._lock:
            self._weights.append((flat, version, loaded))
            self._lock.notify_all()
        if self._thread is None:  # not started: load here (start-up, tests)
            self._apply_control()
        return loaded.wait(timeout) and self._version >= version

    def end_session(self, session: str) -> None:
        with self._lock:
            self._ends.append(session)
            self._lock.notify_all()

    @property
    def version(self) -> int:
        return self._version

    def stats(self) -> EngineStats:
        sampler = self.sampler
        row_bytes = sampler.session_row_nbytes
        with self._lock:
            now = self._clock()
            self._window.trim(now)
            return EngineStats(
                policy_version=self._version,
                live_versions=sorted(sampler.live_versions),
                tokens_per_second=self._window.tokens_per_second(now),
                queue_depth=len(self._queue),
                running=len(self._running),
                max_batch=self.max_batch,
                batch_occupancy=self._window.occupancy(self.max_batch),
                kv_cache_bytes_used=sampler.rows_in_use * row_bytes,
                kv_cache_bytes_total=sampler.session_capacity * row_bytes,
                requests_total=self.requests_total,
                rejected_total=self.rejected_total,
                segments_total=self.segments_total,
            )

    def start(self) -> Engine:
        self._thread = threading.Thread(target=self.run, name="rollout-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Fail every waiting and running turn with ``EngineStopped`` and end the engine thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()

    # ------------------------------------------------------------------ engine thread

    def run(self) -> None:
        try:
            while self.step(block=True):
                pass
        except PeerFailure as exc:
            log.error("the rollout engine stops: %s", exc)
            self.failure = exc
        finally:
            with self._lock:
                self._stopping = True
                turns = [*self._running, *self._queue]
                self._running, self._queue = [], deque()
            for turn in turns:
                turn.on_done(EngineStopped("the rollout server stopped before answering"))
            self.finished.set()

    def step(self, block: bool = False) -> bool:
        """Apply pending weights and session ends, then, if any turn waits, prefill one long prompt
        apart and run one decode segment. Returns False once stopping."""
        with self._lock:
            while block and not self._stopping and not (self._queue or self._running or self._ends or self._weights):
                self._lock.wait(timeout=60.0)
            if self._stopping:
                return False
        self._apply_control()
        batch = self._take_segment()
        if not batch:
            return True
        self._begin(batch)
        prefill, decode = self._split_long_prefills(batch)
        if prefill:
            self._run_segment(prefill, prefill=True)
            with self._lock:  # their prompts are cached now: the unanswered ones decode along
                decode += [t for t in prefill if t in self._running]
        if decode:
            self._run_segment(decode)
        return True

    def _apply_control(self) -> None:
        with self._lock:
            weights, self._weights = self._weights, []
            self._forget_idle_sessions()
            # A session with a turn in flight ends once that turn is answered.
            ends = [s for s in self._ends if s not in self._busy]
            self._ends = [s for s in self._ends if s in self._busy]
            for session in ends:
                self._idle.pop(session, None)
        for session in ends:
            self.sampler.end_session(session)
        for flat, version, loaded in weights:
            try:
                self.sampler.load_weights(flat, version)
            except WeightsError as exc:  # a multi-host server's other hosts lack it: asked again later
                log.warning("policy version %d not loaded: %s", version, exc)
                loaded.set()
                continue
            self._version = version
            loaded.set()
            self._versions.changed(version)
        if weights:
            # Sessions between turns that do not pin their weights move to the new ones at their
            # next turn anyway; dropping their old keys/values now releases the old version.
            with self._lock:
                stale = [s for s, (pinned, _) in self._idle.items() if not pinned]
            for session in stale:
                if self.sampler.session_version(session) not in (None, self._version):
                    self.sampler.end_session(session)

    def _take_segment(self) -> list[Turn]:
        """Running turns plus queued ones in free slots; those sharing the oldest's stop tokens
        and greediness (the sampler takes one set and one temperature per call)."""
        with self._lock:
            for turn in [t for t in self._running if t.cancelled]:
                self._finish(turn)
            while self._queue and len(self._running) < self.max_batch:
                turn = self._queue.popleft()
                if turn.cancelled:
                    self._busy.discard(turn.session)
                    continue
                self._running.append(turn)
            if not self._running:
                return []
            first = self._running[0]
            return [t for t in self._running if (t.stop_token_ids, t.greedy) == (first.stop_token_ids, first.greedy)]

    def _begin(self, batch: list[Turn]) -> None:
        for turn in batch:
            if not turn.started:
                turn.started = True
                version = self.sampler.session_version(turn.session)
                if not turn.pinned and version is not None and version != self._version:
                    self.sampler.end_session(turn.session)  # a new turn samples with the newest weights

    def _split_long_prefills(self, batch: list[Turn]) -> tuple[list[Turn], list[Turn]]:
        """(turns to prefill apart now, turns for the decode call): a turn whose uncached prompt
        pads beyond ``prefill_apart_above`` stays out of the decode call; the oldest
        ``prefill_rows`` of them are prefilled now, the rest at the next segments."""
        if self.prefill_apart_above is None:
            return [], batch
        long = [
            t for t in batch
            if self.sampler.prefill_bucket(t.session, t.prompt + t.tokens) > self.prefill_apart_above
        ]
        return long[: self.prefill_rows], [t for t in batch if t not in long]

    def _run_segment(self, batch: list[Turn], prefill: bool = False) -> None:
        """One sampler call over ``batch``: a decode segment of up to ``segment_tokens`` tokens per
        turn, padded to the sampler's rows; or (``prefill``) the first token of long prompts in a
        call of ``prefill_rows`` rows."""
        sampler = self.sampler
        steps = min(1 if prefill else self.segment_tokens, *(t.max_new_tokens - len(t.tokens) for t in batch))
        try:
            generations = sampler.generate(
                [t.prompt + t.tokens for t in batch],
                max_new_tokens=steps,
                stop_token_ids=batch[0].stop_token_ids,
                sessions=[t.session for t in batch],
                min_batch=self.prefill_rows if prefill else None,
                **({"temperature": 0.0} if batch[0].greedy else {}),
            )
        except PeerFailure:
            raise  # a multi-host server lost a host: the engine ends (``run``) and the server with it
        except Exception as exc:  # noqa: BLE001 - the turns of this call fail with it; the engine goes on
            log.exception("a rollout segment failed")
            with self._lock:
                for turn in batch:
                    self._finish(turn, exc)
            return
        now = self._clock()
        answered: list[tuple[Turn, TurnResult]] = []
        with self._lock:
            if not prefill:
                self.segments_total += 1
            self._window.record(now, sum(len(g.token_ids) for g in generations), None if prefill else len(batch))
            for turn, gen in zip(batch, generations, strict=True):
                turn.tokens += gen.token_ids
                turn.logprobs += gen.logprobs
                turn.versions += [gen.version] * len(gen.token_ids)
                if gen.finished or len(turn.tokens) >= turn.max_new_tokens:
                    result = TurnResult(turn.tokens, turn.logprobs, turn.versions, gen.finished)
                    answered.append((turn, result))
                    self._window.answered(now - turn.queued_at)
                    self._finish(turn, None)
        for turn, result in answered:
            turn.on_done(result)

    def _finish(self, turn: Turn, error: BaseException | None = None) -> None:
        """Take a turn out of the batch (lock held); failures are delivered here."""
        self._running.remove(turn)
        self._busy.discard(turn.session)
        if turn.private:
            self._ends.append(turn.session)
        else:
            self._idle[turn.session] = (turn.pinned, self._clock())
        if error is not None:
            turn.on_done(error)

    def _forget_idle_sessions(self) -> None:
        cutoff = self._clock() - self.session_idle_seconds
        for session in [s for s, (_, since) in self._idle.items() if since < cutoff]:
            del self._idle[session]
            self._ends.append(session)

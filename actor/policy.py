"""The policy an episode samples from, and the adapter that batches episodes onto one Sampler.

Episodes ask for one turn at a time through the small ``Policy`` protocol. ``BatchedSampler``
implements it over the JAX ``Sampler``: requests from all concurrent episodes that arrive while the
sampler is busy are answered by a single batched ``generate`` call (the sampler is the actor's CPU
bottleneck, and a batch of B costs far less than B calls). Each answer carries the policy version
its tokens were sampled with, as the sampler reports it for that very call, so a weight update
between turns is recorded exactly.

An episode names its conversation (``session``) on every turn and ends it when done; a sampler
that keeps conversations (``keeps_sessions``) then prefills only each turn's new tokens, and with
``weightSync: between-episodes`` keeps every episode on the weights it started with (see
``stoker.rollout.sampling``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from stoker.conversation.policy import Policy, PolicyError, Sampled


class GenerationLike(Protocol):
    token_ids: list[int]
    logprobs: list[float]
    finished: bool
    version: int


class SamplerLike(Protocol):
    """The part of ``stoker.rollout.sampling.Sampler`` the actor uses."""

    version: int
    keeps_sessions: bool
    min_batch: int  # every call is padded to at least this many rows

    def load_weights(self, flat: Mapping[str, np.ndarray], version: int) -> None: ...

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        sessions: Sequence[Hashable] | None = None,
    ) -> Sequence[GenerationLike]: ...

    def prefill_bucket(self, session: Hashable, prompt: Sequence[int]) -> int: ...

    def warm_up(self, max_rows: int, first: int = 0, max_call_tokens: int | None = None) -> int: ...

    def end_session(self, session: Hashable) -> None: ...


@dataclass
class _Request:
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    session: Hashable
    bucket: int  # the prefill length class it batches with (see _take_batch)
    future: asyncio.Future[Sampled]
    temperature: float | None = None  # None: the sampler's own; 0: greedy (evaluation rounds)


CALL_SIZES_KEPT = 4096  # a long run makes millions of calls: the sizes of the newest are enough


@dataclass
class BatchStats:
    calls: int = 0
    requests: int = 0
    sizes: deque[int] = field(default_factory=lambda: deque(maxlen=CALL_SIZES_KEPT))  # the newest calls' rows
    busy_seconds: float = 0.0  # in the sampler's calls (compiles included)
    started: float = field(default_factory=time.monotonic)

    @property
    def mean_batch(self) -> float:
        return self.requests / self.calls if self.calls else 0.0

    @property
    def busy_share(self) -> float:
        """The sampler thread's share of the wall time since the start spent in calls."""
        return self.busy_seconds / max(time.monotonic() - self.started, 1e-9)


# Per-row cost of a CPU sampler call doubles once a call outgrows the caches: at 16 rows x 256
# prefill tokens and at 64 rows x 64 (benchmarks/README.md, "Actor sampling: call sizes").
MAX_CALL_ROWS = 32
MAX_CALL_TOKENS = 2048
# On an accelerator a call's rows share each decode step's read of the weights: on a v5e the
# 0.5B-shaped sampler decodes 17.8k tokens/s at 32 rows and 53.7k at 128 (benchmarks/README.md,
# "The decode step's kernels"), and the CPU's limits split a colocated loop's 128 episodes into four
# calls of 32, one after the other ("The colocated loop on the chip").
ACCELERATOR_CALL_ROWS = 256
ACCELERATOR_CALL_TOKENS = 65536


def call_limits(platform: str) -> tuple[int, int]:
    """(most rows, most rows x prefill bucket) of one sampler call on JAX's ``platform``."""
    if platform == "cpu":
        return MAX_CALL_ROWS, MAX_CALL_TOKENS
    return ACCELERATOR_CALL_ROWS, ACCELERATOR_CALL_TOKENS


class BatchedSampler:
    """A ``Policy`` over a sampler; concurrent requests share one ``generate`` call.

    Every sampler call (generate and load_weights) runs on one dedicated thread, in order, so a
    weight update never interleaves with a batch and the event loop never blocks on JAX. A call
    takes at most ``max_batch`` rows, ``max_call_tokens`` rows x prefill bucket and, with
    sessions, the sampler's ``session_rows``; requests beyond wait for the next call.
    """

    def __init__(self, sampler: SamplerLike, max_batch: int = MAX_CALL_ROWS, max_call_tokens: int = MAX_CALL_TOKENS):
        self.sampler = sampler
        self.max_batch = max_batch
        self.max_call_tokens = max_call_tokens
        # The sampler's length buckets (if it has them): requests are batched within a bucket.
        self._buckets: tuple[int, ...] = tuple(sorted(getattr(sampler, "buckets", ()) or ()))
        # Rows of the sampler's conversation cache (0: it keeps none; see max_session_batch).
        self._session_rows = int(getattr(sampler, "session_rows", 0) or 0)
        self.stats = BatchStats()
        self._queue: list[_Request] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sampler")
        self._worker: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def version(self) -> int:
        return int(self.sampler.version)

    @property
    def max_session_batch(self) -> int:
        """The most conversations one sampler call may name: each needs a cache row for the call."""
        return min(self.max_batch, self._session_rows) if self._session_rows else self.max_batch

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        session: Hashable = None,
        temperature: float | None = None,
    ) -> Sampled:
        """One turn; ``temperature`` overrides the sampler's (0 is greedy), and such requests
        never share a sampler call with others."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:  # a new event loop (e.g. one asyncio.run per training step)
            self._loop, self._queue, self._wake, self._worker = loop, [], asyncio.Event(), None
        future: asyncio.Future[Sampled] = loop.create_future()
        prompt = list(prompt)
        if self.sampler.keeps_sessions and session is not None:
            # Asked once, on the event loop while the sampler thread may be updating its cache: a
            # stale answer only makes a less tidy batch, the sampler decides what to prefill.
            bucket = self.sampler.prefill_bucket(session, prompt)
        else:
            session = None
            length = len(prompt) + max_new_tokens
            bucket = next((b for b in self._buckets if b >= length), length)
        self._queue.append(_Request(prompt, max_new_tokens, tuple(stop_token_ids), session, bucket, future, temperature))
        self._wake.set()
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._serve())
        return await future

    def warm_up(self, concurrency: int, first: int = 0) -> int:
        """Compile every program the calls of ``concurrency`` episodes can take
        (``stoker.rollout.warmup``); before the first ``generate``, on the calling thread."""
        rows = min(concurrency, self.max_session_batch if self.sampler.keeps_sessions else self.max_batch)
        return self.sampler.warm_up(rows, first, max_call_tokens=self.max_call_tokens)

    async def end_session(self, session: Hashable) -> None:
        if self.sampler.keeps_sessions:
            await asyncio.get_running_loop().run_in_executor(self._executor, self.sampler.end_session, session)

    async def load_weights(self, flat: Mapping[str, np.ndarray], version: int) -> None:
        """Switch weights after the batch in flight (if any) finishes."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.sampler.load_weights, flat, version)

    async def close(self) -> None:
        if self._worker is not None and self._loop is asyncio.get_running_loop():
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
        self._executor.shutdown(wait=True)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch = self._take_batch()
                if not batch:
                    continue
                first = batch[0]
                prompts = [r.prompt for r in batch]
                sessions = [r.session for r in batch] if first.session is not None else None
                # Passed only when set: a sampler without a temperature argument still serves training.
                override: dict[str, Any] = {} if first.temperature is None else {"temperature": first.temperature}
                called = time.monotonic()
                try:
                    generations = await loop.run_in_executor(
                        self._executor,
                        functools.partial(
                            self.sampler.generate,
                            prompts,
                            max_new_tokens=first.max_new_tokens,
                            stop_token_ids=first.stop_token_ids,
                            sessions=sessions,
                            **override,
                        ),
                    )
                except Exception as exc:  # noqa: BLE001 - forwarded to every waiting episode, not swallowed
                    for request in batch:
                        if not request.future.done():
                            request.future.set_exception(exc)
                    continue
                finally:
                    self.stats.busy_seconds += time.monotonic() - called
                self.stats.calls += 1
                self.stats.requests += len(batch)
                self.stats.sizes.append(len(batch))
                for request, gen in zip(batch, generations, strict=True):
                    if not request.future.done():  # an episode may have timed out meanwhile
                        request.future.set_result(
                            Sampled(list(gen.token_ids), [float(x) for x in gen.logprobs], bool(gen.finished), gen.version)
                        )

    def _take_batch(self) -> list[_Request]:
        """Live requests sharing the oldest one's limits and length bucket: all of them when they
        fit twice the sampler's minimal padding, else a power of two of them.

        Rows of one call are padded to the longest prefill's bucket -- the whole prompt, or with
        sessions the part the sampler has not cached -- so mixing a 40-token prefill into a batch of
        200-token ones would cost that row a 256-token prefill; grouping by bucket keeps padding
        waste out of the batch.
        """
        live = [r for r in self._queue if not r.future.done()]
        if not live:
            self._queue.clear()
            return []
        key = self._key(live[0])
        same = [r for r in live if self._key(r) == key]
        most = self.max_batch if live[0].session is None else self.max_session_batch
        rows = min(len(same), most, max(1, self.max_call_tokens // live[0].bucket))
        # The sampler pads a call to a power of two rows, at least its min_batch: 8 + 3 rows cost
        # less than 11 padded to 16, but up to twice min_batch one padded call costs less than two
        # (8 rows cost 1.55x 4: benchmarks/README.md, "Actor sampling: call sizes"), and a
        # group's turn that waits for a second call takes twice as long.
        size = rows if rows <= 2 * self.sampler.min_batch else 1 << (rows.bit_length() - 1)
        batch = same[:size]
        taken = {id(r) for r in batch}
        self._queue = [r for r in live if id(r) not in taken]
        return batch

    def _key(self, request: _Request) -> tuple[int, tuple[int, ...], int, bool, float | None]:
        return request.max_new_tokens, request.stop_token_ids, request.bucket, request.session is None, request.temperature


class ScriptedPolicy:
    """A policy that answers with a function of the prompt (tests, audits, benchmarks).

    ``respond`` gets the whole conversation so far as ids and returns the ids to "sample"; the
    answer is cut at ``max_new_tokens`` and just after the first stop token, as a sampler would.
    Every id gets log-prob ``logprob`` and the current ``version``.
    """

    def __init__(self, respond: Callable[[Sequence[int]], Sequence[int]], *, logprob: float = -0.5, version: int = 0):
        self.respond = respond
        self.logprob = logprob
        self.version = version
        self.calls = 0
        self.temperatures: list[float | None] = []  # each call's temperature override

    async def generate(
        self,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int],
        session: Hashable = None,
        temperature: float | None = None,
    ) -> Sampled:
        self.calls += 1
        self.temperatures.append(temperature)
        ids = list(self.respond(prompt))[:max_new_tokens]
        stops = set(stop_token_ids)
        cut = next((i + 1 for i, t in enumerate(ids) if t in stops), None)
        finished = cut is not None
        ids = ids[:cut] if cut is not None else ids
        await asyncio.sleep(0)  # yield like a real sampler call would
        return Sampled(ids, [self.logprob] * len(ids), finished, self.version)

    async def end_session(self, session: Hashable) -> None:
        pass

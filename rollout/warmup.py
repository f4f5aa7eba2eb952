"""Compiling a sampler's programs before its first episode.

A sampler compiles one program per call shape: rows (a power of two, at least ``min_batch``) by
prefill width (a chunk bucket with the conversation cache, else a prompt and cache bucket). Left
to the episodes, each new shape stops every episode of the actor for a compile when a run first
meets it -- longer conversations, a re-prefill after new weights -- and in an asynchronous run the
learner then waits on all the actors at once (benchmarks/README.md, "Compiles in the loop").
Compiling them up front, while the learner compiles its own step, takes that out of the loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx

from stoker.model.layers import LayerCache
from stoker.rollout.programs import Limits
from stoker.rollout.sessions import chunk_buckets
from stoker.spec import SamplingSpec


def padded_batch(n: int, min_batch: int = 1) -> int:
    """Batch rows actually computed for ``n`` prompts: the next power of two, at least ``min_batch``."""
    return 1 << max(0, math.ceil(math.log2(max(n, min_batch, 1))))


def row_counts(max_rows: int, min_batch: int) -> list[int]:
    """Every padded row count of a call of 1..``max_rows`` prompts, ascending."""
    return sorted({padded_batch(n, min_batch) for n in range(1, max_rows + 1)})


class SamplerWarmup:
    """The warm-up half of the ``Sampler``, which sets these attributes in its constructor."""

    sampling: SamplingSpec
    buckets: tuple[int, ...]
    min_batch: int
    min_chunk: int
    session_len: int
    _state: nnx.State
    _store: tuple[LayerCache, ...]
    _row_owner: list[Any]
    _traces: int
    _ran: dict[str, set[tuple[int, ...]]]  # the call shapes each program kind has run at
    reuse_compiled: bool
    _jit: Callable[..., Any]
    _jit_continue: Callable[..., Any]
    decode_kernels: bool

    @property
    def truncates(self) -> bool:
        raise NotImplementedError  # the Sampler's

    def _limits(self, max_new_tokens: int, stop_token_ids: tuple[int, ...], temperature: float) -> Limits:
        raise NotImplementedError  # the Sampler's

    def warm_up(self, max_rows: int, first: int = 0, max_call_tokens: int | None = None) -> int:
        """Compile the program of every call of up to ``max_rows`` prompts -- and, with
        ``max_call_tokens``, at most that many rows x length bucket beyond the smallest row count,
        as the actor's batcher calls -- starting at the ``first``-th shape (actors sharing a
        compilation cache each start elsewhere, then read the others' back); returns how many were
        compiled (0 when all were already). Every row is inactive and writes to the scratch row,
        and the sampling stream is not used: no conversation or sample changes."""
        before = self._traces
        limits = self._limits(1, (), self.sampling.temperature)
        key = jax.random.key(0)
        use_top_p = self.sampling.top_p < 1.0
        shapes = self._call_shapes(max_rows, max_call_tokens)
        for rows, width, cache_len in shapes[first % len(shapes):] + shapes[: first % len(shapes)]:
            inactive = np.zeros((rows,), np.bool_)
            ones = np.ones((rows,), np.int32)
            self._ran.setdefault("continue" if cache_len is None else "fresh", set()).add(
                (rows, width) if cache_len is None else (rows, width, cache_len))
            if cache_len is None:
                scratch = np.full((rows,), len(self._row_owner), np.int32)
                self._store, *_ = self._jit_continue(
                    self._state, self._store, scratch, scratch, np.zeros((rows, width), np.int32),
                    np.zeros((rows,), np.int32), ones, inactive, limits, key,
                    use_top_p=use_top_p, truncate=self.truncates,
                )
            else:
                self._jit(
                    self._state, np.zeros((rows, width), np.int32), ones, inactive, limits, key,
                    cache_len=cache_len, use_top_p=use_top_p, truncate=self.truncates, decode_kernels=self.decode_kernels,
                )
        jax.block_until_ready(self._store)
        return self._traces - before

    def _program_shape(self, kind: str, want: tuple[int, ...]) -> tuple[int, ...]:
        """The shape to run a call of shape ``want`` (rows, widths) at: ``want``, or with
        ``reuse_compiled``, when ``want`` has never run, the smallest shape already run that covers
        it (padded rows and widths change no result beyond rounding). On an accelerator a new
        shape's compile stops the loop for tens of seconds (36 s at a 0.5B size on a v5e,
        benchmarks/README.md, "The colocated loop on the chip") while the padding costs little;
        on a CPU the reverse."""
        ran = self._ran.setdefault(kind, set())
        if self.reuse_compiled and want not in ran:
            covering = [shape for shape in ran if all(a >= b for a, b in zip(shape, want, strict=True))]
            if covering:
                return min(covering, key=math.prod)
        ran.add(want)
        return want

    def _call_shapes(self, max_rows: int, max_call_tokens: int | None) -> list[tuple[int, int, int | None]]:
        """(rows, prefill width, cache length) of every call: with the conversation cache a chunk
        width (the cache is the store, None); without, a prompt bucket and each cache bucket
        that can follow it. The batcher bounds a call's rows by its length bucket (the chunk
        width, or the cache bucket) against ``max_call_tokens``, but never below the smallest."""
        widths: list[tuple[int, int | None]]
        if self._store:
            widths = [(w, None) for w in chunk_buckets(self.session_len, self.min_chunk)]
        else:
            widths = [(p, c) for p in self.buckets for c in self.buckets if c >= p]
        counts = row_counts(max_rows, self.min_batch)
        return [
            (rows, w, c) for rows in counts for w, c in widths
            if rows == counts[0] or max_call_tokens is None or rows <= max_call_tokens // (c or w)
        ]

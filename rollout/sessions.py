"""The conversation cache's bookkeeping, for the ``Sampler``: which session holds which row of
its persistent cache, which tokens that row holds and under which weights, and which sessions
opened alike (prefix donors). Why reusing them stays exact: docs/architecture.md, "Sampler
conversations and shared openings"."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from stoker.model.layers import LayerCache, head_dim
from stoker.rollout.mesh import cache_sharding
from stoker.spec import TransformerConfig


@dataclass
class CacheStats:
    """How much of the prompts of session calls the conversation cache saved from prefilling."""

    prompt_tokens: int = 0
    reused_tokens: int = 0  # read from the cache instead of being prefilled again

    @property
    def reuse(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class Session:
    """A conversation the sampler keeps cached keys/values for."""

    version: int  # weights its cached keys/values were computed with (pinned: its sampling weights)
    row: int | None = None  # its row of the persistent cache, while it has one
    cached: list[int] = field(default_factory=list)  # ids held in slots 0..len-1 of that row
    last_used: int = 0
    opening: tuple[int, ...] = ()  # the prompt of its first turn (what conversations share)


def cached_prefix(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """How many of ``prompt``'s first tokens the cache holds; never the last one, whose logits
    start the sampling and so must be computed."""
    n = min(len(cached), len(prompt) - 1)
    if list(cached[:n]) == list(prompt[:n]):  # the usual case, compared at C speed
        return n
    return next(i for i in range(n) if cached[i] != prompt[i])


class SessionRows:
    """The session half of the ``Sampler``, which sets these attributes in its constructor; the
    device work (filling and reading the rows) stays in the Sampler."""

    version: int
    pin_sessions: bool
    share_prefixes: bool
    cache_stats: CacheStats
    _state: nnx.State
    _sessions: dict[Any, Session]
    _row_owner: list[Any]  # the session holding each row, None when free
    _openings: dict[tuple[int, ...], set[Any]]  # live sessions by the prompt of their first turn
    _pinned_states: dict[int, nnx.State]  # weights by version that pinned sessions still sample with
    _uses: int
    fresh_prompt_tokens: int  # prompts of calls without sessions, all prefilled

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens prefilled so far: fresh calls' whole prompts, conversations' uncached ends."""
        return self.fresh_prompt_tokens + self.cache_stats.prompt_tokens - self.cache_stats.reused_tokens

    def bookkeeping_digest(self) -> int:
        """A 63-bit digest of everything that decides the programs the next call runs: the
        weights version, every session's row, version, cached length and last use, and the
        versions pinned sessions hold. Hosts replaying one sampler's calls (rollout/hosts.py) compare it to catch a
        divergence before it deadlocks or corrupts a turn."""
        table = sorted(
            (repr(key), -1 if r.row is None else r.row, r.version, len(r.cached), r.last_used)
            for key, r in self._sessions.items()
        )
        text = repr((self.version, self._uses, sorted(self._pinned_states), table)).encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1

    def end_session(self, session: Any) -> None:
        """Forget a conversation: its cache row is free again (and, pinned, its weights if no other
        session uses them). Unknown sessions are ignored."""
        record = self._sessions.pop(session, None)
        if record is not None and record.row is not None:
            self._row_owner[record.row] = None
        if record is not None and record.opening:
            peers = self._openings.get(record.opening)
            if peers is not None:
                peers.discard(session)
                if not peers:
                    del self._openings[record.opening]
        self._drop_unpinned_states()

    def session_version(self, session: Any) -> int | None:
        """The weight version a live session's cached keys/values (pinned: its sampling) use."""
        record = self._sessions.get(session)
        return None if record is None else record.version

    @property
    def live_versions(self) -> set[int]:
        """Weight versions held now: the newest, and any a live session still uses."""
        return {self.version, *self._pinned_states}

    @property
    def rows_in_use(self) -> int:
        """Rows of the conversation cache that hold a session now."""
        return sum(owner is not None for owner in self._row_owner)

    @property
    def session_capacity(self) -> int:
        """Rows of the conversation cache: sessions held at once."""
        return len(self._row_owner)

    def _assign_rows(self, prompts: list[list[int]], sessions: list[Any]) -> list[Session]:
        """The records of one call's sessions, each with a row of the cache."""
        records = [self._session(s) for s in sessions]
        for session, record, prompt in zip(sessions, records, prompts, strict=True):
            if not record.opening:
                record.opening = tuple(prompt)
                self._openings.setdefault(record.opening, set()).add(session)
            if record.row is None:  # never takes the row of another session of this call
                record.row = self._free_row(set(sessions))
                self._row_owner[record.row] = session
                record.cached = []
        return records

    def _session(self, key: Any) -> Session:
        record = self._sessions.get(key)
        if record is None:
            record = self._sessions[key] = Session(version=self.version)
        elif not self._cache_usable(record):
            record.version, record.cached = self.version, []
        if self.pin_sessions and record.version == self.version:
            self._pinned_states.setdefault(self.version, self._state)
        self._uses += 1
        record.last_used = self._uses
        return record

    def _cache_usable(self, record: Session) -> bool:
        """Its cached keys/values were computed by the weights it samples with next: pinned, its
        own; unpinned, the current ones (else the replaced weights computed them)."""
        return self.pin_sessions or record.version == self.version

    def _free_row(self, busy: set[Any]) -> int:
        for row, owner in enumerate(self._row_owner):
            if owner is None:
                return row
        # All rows taken: evict the least recently used conversation outside this call.
        candidates = [(self._sessions[o].last_used, row) for row, o in enumerate(self._row_owner) if o not in busy]
        if not candidates:
            raise ValueError(f"{len(busy)} sessions in one call exceed the cache's {len(self._row_owner)} rows")
        _, row = min(candidates)
        self._sessions[self._row_owner[row]].row = None
        return row

    def _chunk_starts(
        self, prompts: list[list[int]], records: list[Session], version: int
    ) -> tuple[list[int], list[int]]:
        """Per prompt: where its uncached end starts, and the row whose keys/values precede it
        (its own, or a prefix donor's under the same weights)."""
        # At least the prompt's last token is fed again: its logits start the sampling.
        starts = [cached_prefix(r.cached, p) for r, p in zip(records, prompts, strict=True)]
        sources = [r.row for r in records]
        if self.share_prefixes:
            for i, (record, prompt) in enumerate(zip(records, prompts, strict=True)):
                if starts[i] < len(record.opening) - 1:  # its own cache lacks even the opening
                    donor, shared = self._donor(record, prompt, version)
                    if donor is not None and shared > starts[i]:
                        sources[i], starts[i] = donor.row, shared
        self.cache_stats.prompt_tokens += sum(map(len, prompts))
        self.cache_stats.reused_tokens += sum(starts)
        assert all(s is not None for s in sources)  # every session of the call has a row; donors have theirs
        return starts, cast(list[int], sources)

    def _donor(self, record: Session, prompt: list[int], version: int) -> tuple[Session | None, int]:
        """The session that opened like ``record`` and holds the longest start of ``prompt`` in
        keys/values computed by ``version``'s weights, and how many tokens it holds."""
        best, best_shared = None, 0
        for key in self._openings.get(record.opening, ()):
            other = self._sessions.get(key)
            if other is None or other is record or other.row is None:
                continue
            if other.version != version or not self._cache_usable(other):
                continue
            shared = cached_prefix(other.cached, prompt)
            if shared > best_shared:
                best, best_shared = other, shared
                if shared == len(prompt) - 1:
                    break
        return best, best_shared

    def _drop_unpinned_states(self) -> None:
        live = {r.version for r in self._sessions.values()}
        for version in [v for v in self._pinned_states if v not in live and v != self.version]:
            del self._pinned_states[version]


def session_length(config: TransformerConfig, buckets: Sequence[int]) -> int:
    """Slots of one conversation-cache row: the largest bucket the model can hold (0 if none)."""
    return max((b for b in buckets if b <= config.max_seq_len), default=0)


def session_row_bytes(config: TransformerConfig, buckets: Sequence[int], dtype: Any) -> int:
    """Memory of one conversation-cache row: keys and values of every layer, for every slot."""
    slots = session_length(config, buckets)
    return 2 * config.num_layers * slots * config.num_kv_heads * head_dim(config) * np.dtype(dtype).itemsize



def conversation_store(
    config: TransformerConfig, rows: int, slots: int, dtype: Any, mesh: Mesh | None, *, flat: bool
) -> tuple[LayerCache, ...]:
    """The conversation cache, zeroed: ``rows`` x ``slots`` keys and values per layer, in the
    heads' layout or ``flat`` (the decode kernels', ``stoker.model.decode_attention``). Made in
    place over ``mesh``: the whole cache may exceed one chip's memory."""
    shape: tuple[int, ...] = (rows, slots, config.num_kv_heads, head_dim(config))
    if flat:
        shape = (rows, slots, config.num_kv_heads * head_dim(config))
    where = None if mesh is None else cache_sharding(config, mesh)
    return tuple(
        LayerCache(jnp.zeros(shape, dtype, device=where), jnp.zeros(shape, dtype, device=where))
        for _ in range(config.num_layers)
    )


def chunk_buckets(longest: int, smallest: int = 16) -> tuple[int, ...]:
    """Chunk lengths a session call pads to: powers of two from 16 up to ``longest`` (a turn's
    new tokens are usually few; a re-prefill after new weights takes the largest), and
    ``smallest`` below them when it is less than 16 (the rollout engine continues a turn with
    a 1-token chunk: padded to 16 it cost ~16 decode steps of compute per segment)."""
    sizes = [16]
    while sizes[-1] < longest:
        sizes.append(sizes[-1] * 2)
    if smallest < 16:
        sizes.insert(0, smallest)
    return tuple(min(s, longest) for s in sizes)


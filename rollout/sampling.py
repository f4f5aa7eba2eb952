"""Batched sampling with a KV cache, for the actors (and colocated training).

``Sampler.generate`` runs one jitted program per call: a prefill over the prompts, then a
``lax.while_loop`` of cached decode steps that stops early once every row has hit a stop token.
Shapes come only from three small sets, so steady-state calls never recompile:

* batch: the number of prompts rounded up to a power of two (extra rows are inert);
* prefill length: the smallest bucket holding the longest prompt;
* cache length: the smallest bucket holding the longest prompt plus ``max_new_tokens``.

Prompts are right-padded, so row b's token at position p sits in cache slot p, and the step
limit ``max_new_tokens``, the stop tokens, the temperature and top-p are runtime values.

Conversations (``sessions``) and shared openings: a session keeps its keys/values in a cache row
so a turn prefills only its new tokens; why it stays exact is in docs/architecture.md, "Sampler
conversations and shared openings".

Log-probs are the softmax at the sampling temperature before top-p, renormalised over what top-k
and min-p keep (greedy: at tau = 1), so the
trainer's ``token_logprobs`` reproduces them exactly: docs/architecture.md, "Sampler log-probs".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from stoker.model.hf import load_hf
from stoker.model.decode_attention import runs_by_default, takes
from stoker.model.layers import LayerCache
from stoker.model.model import Transformer, init_model
from stoker.rollout.mesh import param_shardings

# Imported under the names the Sampler's constructor has always used for them.
from stoker.rollout.programs import Limits as _Limits
from stoker.rollout.programs import call_limits
from stoker.rollout.programs import continue_cached as _continue
from stoker.rollout.programs import generate_fresh as _generate
from stoker.rollout.programs import sample_token
from stoker.rollout.warmup import SamplerWarmup, padded_batch
from stoker.rollout.sessions import Session as _Session
from stoker.rollout.sessions import (
    CacheStats, SessionRows, cached_prefix, chunk_buckets, conversation_store, session_length, session_row_bytes,
)
from stoker.spec import SamplingSpec, TransformerConfig
from stoker.weights.shard_layout import layout_of

__all__ = [
    "CacheStats", "Generation", "PromptTooLong", "Sampler", "chunk_buckets", "padded_batch", "pick_bucket",
    "sample_token", "session_length", "session_row_bytes",
]


class PromptTooLong(ValueError):
    """Prompt plus ``max_new_tokens`` exceeds the largest cache bucket."""


@dataclass
class Generation:
    """One prompt's continuation. ``logprobs[i]`` belongs to ``token_ids[i]`` (see module doc)."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended on a stop token (which is included in token_ids)
    version: int = 0  # policy version of the weights that sampled it


def pick_bucket(buckets: Sequence[int], length: int) -> int:
    """The smallest bucket >= ``length``."""
    for bucket in buckets:
        if bucket >= length:
            return bucket
    raise PromptTooLong(f"{length} tokens do not fit the largest bucket ({max(buckets)})")


class Sampler(SessionRows, SamplerWarmup):
    """Generates continuations with the current policy weights.

    ``params``: HF-named arrays to start from; without them the weights are ``init_model(config,
    seed)``, the same arrays as the learner's version 0 for the same seed. ``version`` is the
    policy version of the loaded weights (0 until ``load_weights``). ``min_batch``: pad every
    call to at least this many rows (e.g. the actor's concurrency), so one batch shape serves all
    calls. ``session_rows``: rows of the persistent conversation cache (see docs/architecture.md, "Sampler conversations and shared openings"; at
    least the number of conversations in flight, else the least recently used lose their cache).
    ``pin_sessions``: a session samples with the weights it started with. ``share_prefixes``: a
    session with nothing usable cached starts from the cached keys/values of another session that
    opened with the same prompt and holds the same tokens under the same weights (see the module
    doc). Calls must not overlap (one thread drives a sampler)."""

    def __init__(
        self,
        config: TransformerConfig,
        sampling: SamplingSpec,
        *,
        seed: int,
        buckets: Sequence[int],
        params: Mapping[str, np.ndarray] | None = None,
        dtype: Any = jnp.float32,
        min_batch: int = 1,
        allowed_token_ids: Sequence[int] | None = None,
        session_rows: int = 0,
        pin_sessions: bool = False,
        share_prefixes: bool = True,
        min_chunk: int = 16,
        mesh: Mesh | None = None,
        decode_kernels: bool | None = None,
    ):
        if not buckets or list(buckets) != sorted(set(buckets)):
            raise ValueError(f"buckets must be strictly ascending, got {list(buckets)}")
        self.config = config
        self.sampling = sampling
        self.buckets = tuple(int(b) for b in buckets)
        # Padding every call to at least this many rows trades idle rows for fewer programs.
        self.min_batch = min_batch
        self.allowed = np.ones((config.vocab_size,), np.bool_)
        if allowed_token_ids is not None:
            ids = list(allowed_token_ids)
            if not ids or min(ids) < 0 or max(ids) >= config.vocab_size:
                raise ValueError(f"allowed token ids must be a non-empty subset of [0, {config.vocab_size}), got {ids}")
            self.allowed[:] = False
            self.allowed[ids] = True
        self.version = 0
        if params is None:
            self._model = init_model(config, seed, dtype)
        else:
            # Abstract shapes only: no random init is computed just to be overwritten. Over a
            # mesh they carry their shardings too, so each array goes from the host straight to
            # its chips (``load_hf``).
            self._model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype))
            if mesh is not None:
                abstract = nnx.state(self._model)
                nnx.update(self._model, jax.tree.map(
                    lambda a, where: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=where),
                    abstract, param_shardings(abstract, config, mesh),
                ))
            load_hf(self._model, params)
        self._graphdef, self._state = nnx.split(self._model)
        # ``mesh``: parameters and the conversation cache are laid out over it (rollout/mesh.py).
        self.mesh = mesh
        self._state = self._placed(_snapshot(self._state))
        # Sampling randomness is independent of the init stream that used the same seed.
        self._key = jax.random.fold_in(jax.random.key(seed), 0x5A)
        self._traces = 0
        self._ran: dict[str, set[tuple[int, ...]]] = {}
        self.platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()  # where it samples
        self.reuse_compiled = self.platform != "cpu"
        self._limits_cache: dict[tuple[int, tuple[int, ...], float], _Limits] = {}

        def traced(*args: Any, **kwargs: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
            # Runs only when jit misses its cache, i.e. once per program compiled.
            self._traces += 1
            return _generate(self._graphdef, *args, **kwargs)

        self._jit = jax.jit(traced, static_argnames=("cache_len", "use_top_p", "truncate", "decode_kernels"))
        # Decode steps on the TPU kernels (``generate_fresh``; with sessions, a flat conversation
        # cache). Off a TPU they run in Pallas' interpreter.
        if decode_kernels is None:
            decode_kernels = mesh is None and runs_by_default(jax.default_backend(), 1)
        self.decode_kernels = decode_kernels
        if self.decode_kernels and mesh is not None:
            raise ValueError("the decode kernels run on one chip: no mesh with decode_kernels")

        # The conversation cache: one row per session plus a scratch row for batch padding, each
        # as long as the largest bucket the model can hold.
        self.keeps_sessions = session_rows > 0
        self.pin_sessions = pin_sessions
        self.share_prefixes = share_prefixes
        # The smallest chunk a session call pads to (see chunk_buckets).
        self.min_chunk = min_chunk
        # Live sessions by the prompt of their first turn: where a prefix donor is looked for.
        self._openings: dict[tuple[int, ...], set[Any]] = {}
        self.cache_stats = CacheStats()
        self.fresh_prompt_tokens = 0  # prompts of calls without sessions, all prefilled
        self._sessions: dict[Any, _Session] = {}
        self._row_owner: list[Any] = [None] * session_rows
        self._uses = 0
        self._pinned_states: dict[int, nnx.State] = {}
        self._store: tuple[LayerCache, ...] = ()
        self.session_len = 0
        if session_rows > 0:
            self.session_len = session_length(config, self.buckets)
            if not self.session_len:
                raise ValueError(f"no bucket of {list(self.buckets)} fits maxSeqLen {config.max_seq_len}")
            flat = self.decode_kernels and takes(self.session_len)
            self._store = conversation_store(config, session_rows + 1, self.session_len, dtype, mesh, flat=flat)

            def traced_continue(*args: Any, **kwargs: Any) -> Any:
                self._traces += 1
                return _continue(self._graphdef, *args, **kwargs)

            # The cache is donated: XLA updates the rows in place instead of copying the store.
            self._jit_continue = jax.jit(traced_continue, static_argnames=("use_top_p", "truncate"), donate_argnums=(1,))

    @property
    def truncates(self) -> bool:
        """Whether top-k or min-p is on (programs without them skip the sort)."""
        return self.sampling.top_k > 0 or self.sampling.min_p > 0

    @property
    def temperature(self) -> float:
        """Divide logits by this to recompute the recorded log-probs (see module doc)."""
        return self.sampling.temperature

    @property
    def session_rows(self) -> int:
        """Rows of the conversation cache: the most sessions one call may name."""
        return len(self._row_owner)

    @property
    def compile_count(self) -> int:
        """Distinct programs compiled so far (one per batch/prefill/cache shape triple)."""
        return self._traces

    def load_weights(self, flat: Mapping[str, np.ndarray], version: int) -> None:
        """Swap in new HF-named weights (same shapes, so nothing recompiles)."""
        load_hf(self._model, flat)
        self._state = self._placed(_snapshot(nnx.state(self._model)))
        self.version = version
        self._drop_unpinned_states()

    def weight_layout(self) -> Any:
        """Where each parameter lives on this host's devices (``stoker.weights.shard_layout.layout_of``),
        so a follower can read and verify its slices of a version before the swap."""
        return layout_of(self._model)

    def _placed(self, state: nnx.State) -> nnx.State:
        """``state`` laid out over the mesh; the model then holds the same arrays, so no whole
        copy stays on one chip and ``load_hf`` keeps new weights in this layout."""
        if self.mesh is None:
            return state
        placed = jax.device_put(state, param_shardings(state, self.config, self.mesh))
        nnx.update(self._model, placed)
        return placed


    @property
    def session_row_nbytes(self) -> int:
        """Memory of one conversation-cache row (keys and values, every layer)."""
        return sum((layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[0] for layer in self._store)

    def prefill_bucket(self, session: Any, prompt: Sequence[int]) -> int:
        """The chunk length a session call would pad ``prompt`` to now (for grouping calls)."""
        record = self._sessions.get(session)
        uncached = len(prompt)
        if record is not None and record.row is not None and self._cache_usable(record):
            uncached -= cached_prefix(record.cached, prompt)
        buckets = chunk_buckets(self.session_len, self.min_chunk) if self._store else self.buckets
        return next((b for b in buckets if b >= uncached), uncached)

    def generate(
        self,
        prompts: list[list[int]],
        *,
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        sessions: Sequence[Any] | None = None,
        temperature: float | None = None,
        min_batch: int | None = None,
    ) -> list[Generation]:
        """Continue each prompt (the whole conversation so far, as token ids) by up to
        ``max_new_tokens`` tokens, stopping a row at its first stop token. ``sessions[i]`` names
        prompt i's conversation (any hashable, distinct within a call) to reuse its cache.
        ``temperature`` overrides the sampler's for this call; 0 is greedy (see module doc).
        ``min_batch`` overrides the sampler's row padding for this call (the rollout engine
        prefills a long prompt in a call of few rows)."""
        if not prompts:
            return []
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        vocab = self.config.vocab_size
        lens = [len(p) for p in prompts]
        if min(lens) == 0:
            raise ValueError("every prompt needs at least one token")
        for p in prompts:
            if min(p) < 0 or max(p) >= vocab:
                raise ValueError(f"prompt token ids must lie in [0, {vocab}), got {min(p)}..{max(p)}")
        longest = max(lens)
        if longest + max_new_tokens > self.config.max_seq_len:
            raise PromptTooLong(f"{longest + max_new_tokens} tokens exceed maxSeqLen {self.config.max_seq_len}")
        if temperature is not None and not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        tau = self.sampling.temperature if temperature is None else float(temperature)
        limits = self._limits(max_new_tokens, tuple(stop_token_ids), tau)
        rows = self.min_batch if min_batch is None else min_batch
        if sessions is not None:
            return self._generate_sessions(prompts, list(sessions), limits, longest + max_new_tokens, rows)

        self.fresh_prompt_tokens += sum(lens)
        cache_len = pick_bucket(self.buckets, longest + max_new_tokens)
        prefill_len = pick_bucket(self.buckets, longest)
        batch, prefill_len, cache_len = self._program_shape("fresh", (padded_batch(len(prompts), rows), prefill_len, cache_len))
        ids = np.zeros((batch, prefill_len), np.int32)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
        prompt_lens = np.ones((batch,), np.int32)
        prompt_lens[: len(prompts)] = lens
        active = np.arange(batch) < len(prompts)
        self._key, key = jax.random.split(self._key)
        out = self._jit(
            self._state, ids, prompt_lens, active, limits, key,
            cache_len=cache_len, use_top_p=self.sampling.top_p < 1.0, truncate=self.truncates,
            decode_kernels=self.decode_kernels,
        )
        return self._generations(out, len(prompts), [self.version] * len(prompts))

    def _limits(self, max_new_tokens: int, stop_token_ids: tuple[int, ...], temperature: float) -> _Limits:
        """The call's runtime settings as device arrays, made once per (limit, stop tokens,
        temperature): an actor asks with the same ones every turn, and five host-to-device copies
        per call were a sizeable part of a small call's Python time."""
        key = (max_new_tokens, stop_token_ids, temperature)
        limits = self._limits_cache.get(key)
        if limits is None:
            limits = self._limits_cache[key] = call_limits(
                max_new_tokens, stop_token_ids, self.allowed, temperature, self.sampling
            )
        return limits

    def _generations(self, out: Any, n: int, versions: list[int]) -> list[Generation]:
        tokens, logprobs, generated, finished = jax.device_get(out)
        return [
            Generation(
                token_ids=[int(t) for t in tokens[row, : generated[row]]],
                logprobs=[float(x) for x in logprobs[row, : generated[row]]],
                finished=bool(finished[row]),
                version=versions[row],
            )
            for row in range(n)
        ]

    def _generate_sessions(
        self, prompts: list[list[int]], sessions: list[Any], limits: _Limits, slots_needed: int, min_batch: int
    ) -> list[Generation]:
        if not self._store:
            raise ValueError("this sampler keeps no conversations (session_rows=0)")
        if len(sessions) != len(prompts):
            raise ValueError(f"{len(sessions)} sessions for {len(prompts)} prompts")
        if len(set(sessions)) != len(sessions):
            raise ValueError("a session may appear only once per call")
        if slots_needed > self.session_len:
            raise PromptTooLong(f"{slots_needed} tokens do not fit the cache ({self.session_len} slots)")
        records = self._assign_rows(prompts, sessions)
        results: list[Generation | None] = [None] * len(prompts)
        by_version: dict[int, list[int]] = {}
        for i, record in enumerate(records):
            by_version.setdefault(record.version, []).append(i)
        for version, members in sorted(by_version.items()):  # one call per weight version
            gens = self._continue_rows(
                [prompts[i] for i in members], [records[i] for i in members], version, limits, min_batch
            )
            for i, gen in zip(members, gens, strict=True):
                results[i] = gen
        return [g for g in results if g is not None]

    def _continue_rows(
        self, prompts: list[list[int]], records: list[_Session], version: int, limits: _Limits, min_batch: int
    ) -> list[Generation]:
        state = self._state if version == self.version else self._pinned_states[version]
        starts, sources = self._chunk_starts(prompts, records, version)
        chunks = [p[s:] for p, s in zip(prompts, starts, strict=True)]
        width = pick_bucket(chunk_buckets(self.session_len, self.min_chunk), max(map(len, chunks)))
        batch, width = self._program_shape("continue", (padded_batch(len(prompts), min_batch), width))
        scratch = len(self._row_owner)
        rows = np.full((batch,), scratch, np.int32)
        source_arr = np.full((batch,), scratch, np.int32)
        ids = np.zeros((batch, width), np.int32)
        start_arr = np.zeros((batch,), np.int32)
        chunk_lens = np.ones((batch,), np.int32)
        for i, (record, chunk) in enumerate(zip(records, chunks, strict=True)):
            assert record.row is not None
            rows[i], source_arr[i], start_arr[i], chunk_lens[i] = record.row, sources[i], starts[i], len(chunk)
            ids[i, : len(chunk)] = chunk
        active = np.arange(batch) < len(prompts)
        self._key, key = jax.random.split(self._key)
        self._store, *out = self._jit_continue(
            state, self._store, rows, source_arr, ids, start_arr, chunk_lens, active, limits, key,
            use_top_p=self.sampling.top_p < 1.0, truncate=self.truncates,
        )
        gens = self._generations(out, len(prompts), [version] * len(prompts))
        for record, prompt, gen in zip(records, prompts, gens, strict=True):
            # Every sampled token but the last went through a decode step, so its keys are cached.
            record.cached = prompt + gen.token_ids[:-1]
        return gens


def _snapshot(state: nnx.State) -> nnx.State:
    """A state holding the current arrays, unlike ``nnx.state``'s live view of the model: pinned
    sessions keep sampling with it after ``load_weights`` overwrites the model in place."""
    return jax.tree.map(lambda x: x, state)


"""Batched sampling with a KV cache, for the actors (and colocated training).

``Sampler.generate`` runs one jitted program per call: a prefill over the prompts, then a
``lax.while_loop`` of cached decode steps that stops early once every row has hit a stop token.
Shapes come only from three small sets, so steady-state calls never recompile:

* batch: the number of prompts rounded up to a power of two (extra rows are inert);
* prefill length: the smallest bucket holding the longest prompt;
* cache length: the smallest bucket holding the longest prompt plus ``max_new_tokens``.

Prompts are right-padded, so row b's token at position p sits in cache slot p, and the step
limit ``max_new_tokens``, the stop tokens, the temperature and top-p are runtime values.

Log-probs. For a sampled token y the sampler records

    log pi(y) = z_y / tau - logsumexp(z / tau)

with z the model's logits and tau the sampling temperature: the softmax at the sampling
temperature, *before* top-p truncation. The trainer reproduces exactly this number with
``token_logprobs(logits, targets, temperature=sampler.temperature)`` on the same token ids (at
tau = 1 that is the plain model log-prob), which is what the token-in/token-out consistency check
compares. Top-p only restricts which tokens can be drawn; the log-prob is not renormalised over
the nucleus, so with top_p < 1 the recorded value is the untruncated policy's log-prob.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stoker.learner.hf import load_hf
from stoker.learner.model import KVCache, Transformer, init_model
from stoker.spec import SamplingSpec, TransformerConfig


class PromptTooLong(ValueError):
    """Prompt plus ``max_new_tokens`` exceeds the largest cache bucket."""


@dataclass
class Generation:
    """One prompt's continuation. ``logprobs[i]`` belongs to ``token_ids[i]`` (see module doc)."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended on a stop token (which is included in token_ids)


def pick_bucket(buckets: Sequence[int], length: int) -> int:
    """The smallest bucket >= ``length``."""
    for bucket in buckets:
        if bucket >= length:
            return bucket
    raise PromptTooLong(f"{length} tokens do not fit the largest bucket ({max(buckets)})")


def padded_batch(n: int, min_batch: int = 1) -> int:
    """Batch rows actually computed for ``n`` prompts: the next power of two, at least ``min_batch``."""
    return 1 << max(0, math.ceil(math.log2(max(n, min_batch, 1))))


def sample_token(
    key: jax.Array, logits: jax.Array, temperature: jax.Array, top_p: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row from softmax(logits / temperature), restricted to the top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probability mass reaches top_p
    (always at least the most likely token). Returns (tokens [B], log pi(token) [B]) with the
    log-prob under the untruncated tempered softmax."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    allowed = logp
    if top_p is not None:
        sorted_logp = jnp.sort(logp, axis=-1)[:, ::-1]
        probs = jnp.exp(sorted_logp)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        # Smallest log-prob still inside the nucleus; ties with it are kept too.
        in_nucleus = mass_before < top_p
        threshold = jnp.min(jnp.where(in_nucleus, sorted_logp, jnp.inf), axis=-1, keepdims=True)
        allowed = jnp.where(logp >= threshold, logp, -jnp.inf)
    tokens = jax.random.categorical(key, allowed, axis=-1)
    return tokens.astype(jnp.int32), jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


class _Loop(NamedTuple):
    step: jax.Array  # tokens drawn so far, shared by all rows
    logits: jax.Array  # [B, V] next-token logits
    cache: KVCache
    tokens: jax.Array  # [B, S] prompt + generated ids
    logprobs: jax.Array  # [B, S] log-prob of each generated token
    done: jax.Array  # [B] row has hit a stop token (or is batch padding)
    generated: jax.Array  # [B] tokens generated per row
    key: jax.Array


def _generate(
    graphdef: nnx.GraphDef[Transformer],
    state: nnx.State,
    prompt_ids: jax.Array,  # [B, P] right-padded
    prompt_lens: jax.Array,  # [B]
    active: jax.Array,  # [B] false for batch padding
    max_new_tokens: jax.Array,
    is_stop: jax.Array,  # [V] bool
    allowed: jax.Array,  # [V] bool: constrained decoding (all true when unconstrained)
    temperature: jax.Array,
    top_p: jax.Array,
    key: jax.Array,
    *,
    cache_len: int,
    use_top_p: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    batch, prefill_len = prompt_ids.shape
    idx = jnp.arange(prefill_len)[None, :]
    segments = (idx < prompt_lens[:, None]).astype(jnp.int32)
    positions = jnp.broadcast_to(idx, prompt_ids.shape).astype(jnp.int32)
    last, cache = model.prefill(prompt_ids, positions, segments, cache_len=cache_len, logits_at=prompt_lens - 1)
    assert cache is not None
    tokens = jnp.zeros((batch, cache_len), jnp.int32).at[:, :prefill_len].set(prompt_ids)
    rows = jnp.arange(batch)

    def cond(s: _Loop) -> jax.Array:
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def body(s: _Loop) -> _Loop:
        key, draw = jax.random.split(s.key)
        logits = jnp.where(allowed, s.logits, jnp.asarray(-1e9, s.logits.dtype))  # as restrict_logits
        token, logprob = sample_token(draw, logits, temperature, top_p if use_top_p else None)
        slot = prompt_lens + s.step  # where this token goes
        live = ~s.done
        tokens = s.tokens.at[rows, slot].set(jnp.where(live, token, s.tokens[rows, slot]))
        logprobs = s.logprobs.at[rows, slot].set(jnp.where(live, logprob, 0.0))
        generated = s.generated + live.astype(jnp.int32)
        done = s.done | is_stop[token]
        step = s.step + 1

        def advance(c: KVCache) -> tuple[jax.Array, KVCache]:
            return model.decode(token, slot, c)

        def stay(c: KVCache) -> tuple[jax.Array, KVCache]:
            return s.logits, c

        # The final draw needs no further forward pass.
        more = (step < max_new_tokens) & ~jnp.all(done)
        logits, cache = jax.lax.cond(more, advance, stay, s.cache)
        return _Loop(step, logits, cache, tokens, logprobs, done, generated, key)

    init = _Loop(
        step=jnp.zeros((), jnp.int32),
        logits=last,
        cache=cache,
        tokens=tokens,
        logprobs=jnp.zeros((batch, cache_len), jnp.float32),
        done=~active,
        generated=jnp.zeros((batch,), jnp.int32),
        key=key,
    )
    out = jax.lax.while_loop(cond, body, init)
    finished = out.done & active & (out.generated > 0)
    return out.tokens, out.logprobs, out.generated, finished


class Sampler:
    """Generates continuations with the current policy weights.

    ``params``: HF-named arrays to start from; without them the weights are ``init_model(config,
    seed)``, the same arrays as the learner's version 0 for the same seed. ``version`` is the
    policy version of the loaded weights (0 until ``load_weights``). ``min_batch``: pad every
    call to at least this many rows (e.g. the actor's concurrency), so one batch shape serves all
    calls. Calls must not overlap (one thread drives a sampler)."""

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
            # Abstract shapes only: no random init is computed just to be overwritten.
            self._model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=dtype))
            load_hf(self._model, params)
        self._graphdef, self._state = nnx.split(self._model)
        # Sampling randomness is independent of the init stream that used the same seed.
        self._key = jax.random.fold_in(jax.random.key(seed), 0x5A)
        self._traces = 0

        def traced(*args: Any, **kwargs: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
            # Runs only when jit misses its cache, i.e. once per program compiled.
            self._traces += 1
            return _generate(self._graphdef, *args, **kwargs)

        self._jit = jax.jit(traced, static_argnames=("cache_len", "use_top_p"))

    @property
    def temperature(self) -> float:
        """Divide logits by this to recompute the recorded log-probs (see module doc)."""
        return self.sampling.temperature

    @property
    def compile_count(self) -> int:
        """Distinct programs compiled so far (one per batch/prefill/cache shape triple)."""
        return self._traces

    def load_weights(self, flat: Mapping[str, np.ndarray], version: int) -> None:
        """Swap in new HF-named weights (same shapes, so nothing recompiles)."""
        load_hf(self._model, flat)
        self._state = nnx.state(self._model)
        self.version = version

    def generate(
        self, prompts: list[list[int]], *, max_new_tokens: int, stop_token_ids: Sequence[int] = ()
    ) -> list[Generation]:
        """Continue each prompt (the whole conversation so far, as token ids) by up to
        ``max_new_tokens`` tokens, stopping a row at its first stop token."""
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
        cache_len = pick_bucket(self.buckets, longest + max_new_tokens)
        if longest + max_new_tokens > self.config.max_seq_len:
            raise PromptTooLong(f"{longest + max_new_tokens} tokens exceed maxSeqLen {self.config.max_seq_len}")
        prefill_len = pick_bucket(self.buckets, longest)
        batch = padded_batch(len(prompts), self.min_batch)

        ids = np.zeros((batch, prefill_len), np.int32)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = prompt
        prompt_lens = np.ones((batch,), np.int32)
        prompt_lens[: len(prompts)] = lens
        active = np.arange(batch) < len(prompts)
        is_stop = np.zeros((vocab,), np.bool_)
        for token in stop_token_ids:
            if not 0 <= token < vocab:
                raise ValueError(f"stop token {token} is outside the vocabulary [0, {vocab})")
            is_stop[token] = True

        self._key, key = jax.random.split(self._key)
        tokens, logprobs, generated, finished = self._jit(
            self._state,
            ids,
            prompt_lens,
            active,
            np.int32(max_new_tokens),
            is_stop,
            self.allowed,
            np.float32(self.sampling.temperature),
            np.float32(self.sampling.top_p),
            key,
            cache_len=cache_len,
            use_top_p=self.sampling.top_p < 1.0,
        )
        tokens, logprobs, generated, finished = jax.device_get((tokens, logprobs, generated, finished))
        out = []
        for row, start in enumerate(lens):
            end = start + int(generated[row])
            out.append(
                Generation(
                    token_ids=[int(t) for t in tokens[row, start:end]],
                    logprobs=[float(x) for x in logprobs[row, start:end]],
                    finished=bool(finished[row]),
                )
            )
        return out

"""The jitted programs one ``Sampler`` call runs: a prefill (of whole prompts, or of the uncached
ends of cached conversations), then a ``lax.while_loop`` of cached decode steps that stops once
every row has hit a stop token. Why the log-probs are recorded as they are is in
``stoker.rollout.sampling``'s module doc."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stoker.model.logprobs import truncation_mask
from stoker.model.selection import weighted_threshold
from stoker.rollout.draw import draw, draw_scored
from stoker.model.layers import LayerCache
from stoker.model.decode_attention import takes
from stoker.model.model import KVCache, Transformer, flatten_cache
from stoker.spec import SamplingSpec


def sample_token(
    key: jax.Array,
    logits: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array | None,
    top_k: jax.Array | None = None,
    min_p: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Draw one token per row from softmax(logits / temperature), restricted to the top-p nucleus.

    The nucleus is the smallest set of most likely tokens whose probability mass reaches top_p
    (always at least the most likely token). Returns (tokens [B], log pi(token) [B]) with the
    log-prob under the untruncated tempered softmax. ``temperature <= 0`` is greedy: the argmax
    of the logits, its log-prob taken at temperature 1.

    ``top_k``/``min_p`` (None: off) truncate first (``logprobs.truncation_mask``), and the
    distribution is renormalised over what they keep: the recorded log-prob is the one of the
    distribution the token is drawn from (before top-p), which the trainer reproduces."""
    greedy = temperature <= 0
    scaled = logits.astype(jnp.float32) / jnp.where(greedy, 1.0, temperature)
    if top_p is None and top_k is None and min_p is None:
        # Drawn from the scaled logits themselves (a shift per row changes no Gumbel-max draw), the
        # log-sum-exp of the log-prob in the same pass: the [rows, vocab] floats are read once.
        tokens, picked, log_normalizer = draw_scored(key, scaled, greedy)
        return tokens, picked - log_normalizer
    logp = jax.nn.log_softmax(scaled, axis=-1)
    if top_k is not None or min_p is not None:
        keep = truncation_mask(logp, 0 if top_k is None else top_k, 0.0 if min_p is None else min_p)
        logp = jax.nn.log_softmax(jnp.where(keep, logp, -1e9), axis=-1)
    allowed = logp
    if top_p is not None:  # ties with the nucleus' smallest log-prob are kept too
        allowed = jnp.where(logp >= nucleus_floor(logp, top_p), logp, -jnp.inf)
    # A greedy row's argmax of ``allowed`` is the one of ``logp``: the top token is always kept.
    tokens = draw(key, allowed, greedy)
    return tokens, jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]


def nucleus_floor(logp: jax.Array, top_p: jax.Array) -> jax.Array:
    """The smallest log-prob in each row's top-p nucleus, [B, 1], from log-probs [B, V]: the
    nucleus is the most likely tokens up to and including the one whose mass reaches ``top_p``
    (and its ties), found by weighing, not by sorting the vocabulary."""
    return weighted_threshold(logp, top_p, jnp.exp(logp))


class _Loop(NamedTuple):
    step: jax.Array  # tokens drawn so far, shared by all rows
    hidden: jax.Array  # [B, D] the final norm's output for the next token (the head's input)
    cache: KVCache
    tokens: jax.Array  # [B, W] generated ids, by step
    logprobs: jax.Array  # [B, W] log-prob of each generated token
    done: jax.Array  # [B] row has hit a stop token (or is batch padding)
    generated: jax.Array  # [B] tokens generated per row
    key: jax.Array


class Limits(NamedTuple):
    """The runtime sampling settings of one call."""

    max_new_tokens: jax.Array
    is_stop: jax.Array  # [V] bool
    allowed: jax.Array  # [V] bool: constrained decoding (all true when unconstrained)
    temperature: jax.Array
    top_p: jax.Array
    top_k: jax.Array  # 0: off
    min_p: jax.Array  # 0: off


def call_limits(
    max_new_tokens: int, stop_token_ids: Sequence[int], allowed: np.ndarray, temperature: float, sampling: SamplingSpec
) -> Limits:
    """One call's ``Limits`` as device arrays; ``ValueError`` for a stop token outside the vocabulary."""
    vocab = allowed.shape[0]
    is_stop = np.zeros((vocab,), np.bool_)
    for token in stop_token_ids:
        if not 0 <= token < vocab:
            raise ValueError(f"stop token {token} is outside the vocabulary [0, {vocab})")
        is_stop[token] = True
    return Limits(
        jnp.asarray(max_new_tokens, jnp.int32), jnp.asarray(is_stop), jnp.asarray(allowed),
        jnp.asarray(temperature, jnp.float32), jnp.asarray(sampling.top_p, jnp.float32),
        jnp.asarray(sampling.top_k, jnp.int32), jnp.asarray(sampling.min_p, jnp.float32),
    )


# The shortest cache for which the shared slot's in-place write beats the per-row select on a
# TPU v5e: measured per decode step for the Qwen2.5-0.5B shape in bf16 (benchmarks/README.md,
# "Decode's cache write, in place"), the shared slot took 9.3 ms against 15.9 at 128 rows x
# 2,048 slots but 9.1 against 7.3 at 128 x 1,024 and 7.1 against 4.5 at 128 x 512: its write
# costs per row, the select per slot.
SHARED_SLOT_MIN_SLOTS = 2048


def shared_slot_pays(slots: int) -> bool:
    """Whether a decode step over ``slots`` cache slots should write one shared slot."""
    return slots >= SHARED_SLOT_MIN_SLOTS


# The fewest rows at which the head's matmul fused with the draw's reduction beats the two apart
# on a TPU v5e (benchmarks/README.md, "The decode step's kernels"): fused, the [B, V] logits
# never reach HBM (17 % faster at 128 rows), but at 32 rows the two apart ran 4 % faster (at 8, a tie).
HEAD_FUSED_MIN_ROWS = 64


def head_and_draw(
    model: Transformer, hidden: jax.Array, key: jax.Array, limits: Limits, *, use_top_p: bool, truncate: bool
) -> tuple[jax.Array, jax.Array]:
    """A decode step's draw from the final norm's output [B, D]: the LM head, the allowed tokens,
    then one token a row and its log-prob (``sample_token``). From ``HEAD_FUSED_MIN_ROWS`` rows
    XLA fuses the head's matmul into the draw; below, a barrier keeps them apart."""
    logits = model.output_head().logits(hidden)
    if hidden.shape[0] < HEAD_FUSED_MIN_ROWS:
        logits = jax.lax.optimization_barrier(logits)
    masked = jnp.where(limits.allowed, logits, jnp.asarray(-1e9, logits.dtype))  # as restrict_logits
    return sample_token(key, masked, limits.temperature, limits.top_p if use_top_p else None,
                        *((limits.top_k, limits.min_p) if truncate else (None, None)))


def sample_loop(
    model: Transformer,
    hidden: jax.Array,  # [B, D] the final norm's output at the prompt's last token (``head=False``)
    cache: KVCache,
    first_slot: jax.Array,  # [B] where the first generated token goes
    active: jax.Array,  # [B] false for batch padding
    limits: Limits,
    key: jax.Array,
    *,
    width: int,
    use_top_p: bool,
    truncate: bool = False,
    shared_slot: bool = False,
) -> tuple[KVCache, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Draw up to ``limits.max_new_tokens`` (<= ``width``) tokens per row, one cached decode step
    each; returns (cache, tokens [B, width], logprobs [B, width], generated [B], finished [B]).

    ``shared_slot``: every row writes step t's keys and values into the same slot, ``start + t``
    (``start``: the latest ``first_slot``; ``Transformer.decode``'s ``slot``), so that the write
    is one in-place slice per layer instead of a select over the whole cache. The cache returned
    then holds a row's generated tokens from ``start`` on, not at their positions: for callers
    that drop it (``generate_fresh``; see ``shared_slot_pays``).

    The loop carries hidden states, not logits, and applies the head where it draws: from
    ``HEAD_FUSED_MIN_ROWS`` rows XLA fuses the head's matmul with the draw's reduction, and the
    [B, V] float32 logits never reach HBM (plain sampling; top-p and top-k still make them)."""
    batch = hidden.shape[0]
    rows = jnp.arange(batch)
    start = jnp.max(first_slot)

    def cond(s: _Loop) -> jax.Array:
        return (s.step < limits.max_new_tokens) & ~jnp.all(s.done)

    def body(s: _Loop) -> _Loop:
        key, draw = jax.random.split(s.key)
        token, logprob = head_and_draw(model, s.hidden, draw, limits, use_top_p=use_top_p, truncate=truncate)
        live = ~s.done
        tokens = s.tokens.at[rows, s.step].set(jnp.where(live, token, 0))
        logprobs = s.logprobs.at[rows, s.step].set(jnp.where(live, logprob, 0.0))
        generated = s.generated + live.astype(jnp.int32)
        done = s.done | limits.is_stop[token]
        step = s.step + 1

        def advance(c: KVCache) -> tuple[jax.Array, KVCache]:
            if shared_slot:
                return model.decode(token, first_slot + s.step, c, slot=start + s.step, start=start, head=False)
            return model.decode(token, first_slot + s.step, c, head=False)

        def stay(c: KVCache) -> tuple[jax.Array, KVCache]:
            return s.hidden, c

        # The final draw needs no further forward pass.
        more = (step < limits.max_new_tokens) & ~jnp.all(done)
        next_hidden, next_cache = jax.lax.cond(more, advance, stay, s.cache)
        return _Loop(step, next_hidden, next_cache, tokens, logprobs, done, generated, key)

    init = _Loop(
        step=jnp.zeros((), jnp.int32),
        hidden=hidden,
        cache=cache,
        tokens=jnp.zeros((batch, width), jnp.int32),
        logprobs=jnp.zeros((batch, width), jnp.float32),
        done=~active,
        generated=jnp.zeros((batch,), jnp.int32),
        key=key,
    )
    out = jax.lax.while_loop(cond, body, init)
    finished = out.done & active & (out.generated > 0)
    return out.cache, out.tokens, out.logprobs, out.generated, finished


def generate_fresh(
    graphdef: nnx.GraphDef[Transformer],
    state: nnx.State,
    prompt_ids: jax.Array,  # [B, P] right-padded
    prompt_lens: jax.Array,  # [B]
    active: jax.Array,  # [B] false for batch padding
    limits: Limits,
    key: jax.Array,
    *,
    cache_len: int,
    use_top_p: bool,
    truncate: bool = False,
    decode_kernels: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Stateless: prefill whole prompts into a fresh cache, then sample. ``decode_kernels``: the
    decode steps run the TPU kernels on a flat cache (``stoker.model.decode_attention``: each
    row's write in place, attention over its filled slots only); where they do not take the cache
    length (``decode_attention.takes``), the shared slot or per-row select as before."""
    model = nnx.merge(graphdef, state)
    idx = jnp.arange(prompt_ids.shape[1])[None, :]
    segments = (idx < prompt_lens[:, None]).astype(jnp.int32)
    positions = jnp.broadcast_to(idx, prompt_ids.shape).astype(jnp.int32)
    last, cache = model.prefill(prompt_ids, positions, segments, cache_len=cache_len, logits_at=prompt_lens - 1, head=False)
    assert cache is not None
    flat = decode_kernels and takes(cache_len)
    _, tokens, logprobs, generated, finished = sample_loop(
        model, last, flatten_cache(cache) if flat else cache, prompt_lens, active, limits, key, width=cache_len,
        use_top_p=use_top_p, truncate=truncate, shared_slot=not flat and shared_slot_pays(cache_len),
    )
    return tokens, logprobs, generated, finished


def continue_cached(
    graphdef: nnx.GraphDef[Transformer],
    state: nnx.State,
    store: tuple[LayerCache, ...],  # the persistent cache, [R, S, ...] per layer (donated)
    rows: jax.Array,  # [B] store row of each batch row (padding rows share a scratch row)
    sources: jax.Array,  # [B] store row whose keys/values start it: its own, or a prefix donor's
    chunk_ids: jax.Array,  # [B, C] the uncached end of each prompt, right-padded
    starts: jax.Array,  # [B] slot of each chunk's first token (= cached prefix length)
    chunk_lens: jax.Array,  # [B] >= 1
    active: jax.Array,  # [B]
    limits: Limits,
    key: jax.Array,
    *,
    use_top_p: bool,
    truncate: bool = False,
) -> tuple[tuple[LayerCache, ...], jax.Array, jax.Array, jax.Array, jax.Array]:
    """With sessions: extend cached rows by their chunks, sample, write the rows back. A row read
    from a donor keeps the donor's slots before ``starts`` (the same tokens under the same weights)
    and overwrites the rest."""
    model = nnx.merge(graphdef, state)
    idx = jnp.arange(chunk_ids.shape[1])[None, :]
    cache = KVCache(
        tuple(LayerCache(layer.keys[sources], layer.values[sources]) for layer in store),
        jnp.zeros((rows.shape[0], store[0].keys.shape[1]), jnp.int32),  # extend() recomputes it
    )
    last, cache = model.extend(
        chunk_ids, starts[:, None] + idx, idx < chunk_lens[:, None], cache, logits_at=chunk_lens - 1, head=False
    )
    # Per-row slots: the store wants each token at its position's slot, and moving rows back
    # after a shared-slot loop (a gather along the slots) took 211 ms on the v5e at 128 x 2,048,
    # against 15.6 ms for the write-back below (benchmarks/README.md, "Decode's cache write, in place").
    cache, tokens, logprobs, generated, finished = sample_loop(
        model, last, cache, starts + chunk_lens, active, limits, key, width=store[0].keys.shape[1], use_top_p=use_top_p,
        truncate=truncate,
    )
    store = tuple(
        LayerCache(old.keys.at[rows].set(new.keys), old.values.at[rows].set(new.values))
        for old, new in zip(store, cache.layers, strict=True)
    )
    return store, tokens, logprobs, generated, finished


"""The sampler's decode step with every row writing one shared slot (``Transformer.decode``'s
``slot``, issue 52) against the per-row write: the same logits step after step, for rows of
different lengths (gaps between a row's prompt and the shared slot) and sliding windows, the same
tokens from the sampler's loop, and a v5e program that no longer reads and writes the whole cache."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.model.layers import LayerCache, head_dim
from stoker.model.model import KVCache, Transformer, init_model
from stoker.rollout.programs import HEAD_FUSED_MIN_ROWS, Limits, sample_loop
from stoker.spec import TransformerConfig

QWEN_LIKE = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=48, attention_bias=True, qk_norm=True, tie_embeddings=False)
# Local layers with a window shorter than the prompts and the gap: the window counts positions, not slots.
GEMMA_LIKE = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                               intermediate_size=48, sliding_window=3, global_layer_every=2, attn_logit_softcap=5.0)
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
SLOTS, STEPS = 16, 6


def _prefill(model: Transformer, head: bool = True) -> tuple[jax.Array, KVCache, jax.Array]:
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    ids = jnp.asarray([p + [0] * (8 - len(p)) for p in PROMPTS], jnp.int32)
    idx = jnp.arange(8, dtype=jnp.int32)[None, :]
    segments = (idx < lens[:, None]).astype(jnp.int32)
    logits, cache = model.prefill(ids, jnp.broadcast_to(idx, ids.shape), segments, cache_len=SLOTS, logits_at=lens - 1,
                                  head=head)
    assert cache is not None
    return logits, cache, lens


def _maybe_jit(fn: Callable[..., Any], jit: bool) -> Callable[..., Any]:
    return jax.jit(fn) if jit else fn


@pytest.mark.parametrize("config", [QWEN_LIKE, GEMMA_LIKE], ids=["qwen", "gemma"])
@pytest.mark.parametrize("jit", [False, True])
def test_a_shared_slot_gives_the_per_row_slots_logits_and_settles_into_their_cache(
    config: TransformerConfig, jit: bool
) -> None:
    model = init_model(config, seed=0)
    logits, cache, lens = _prefill(model)
    per_row = _maybe_jit(lambda t, p, c: model.decode(t, p, c), jit)
    shared = _maybe_jit(lambda t, p, c, slot, start: model.decode(t, p, c, slot=slot, start=start), jit)
    start = jnp.max(lens)
    ours = theirs = cache
    for step in range(STEPS):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits, theirs = per_row(token, lens + step, theirs)
        mine, ours = shared(token, lens + step, ours, start + step, start)
        np.testing.assert_allclose(np.asarray(mine), np.asarray(logits), rtol=1e-5, atol=1e-5)
    # Row b's generated tokens sit from slot `start` on, its prompt where it was.
    for got, want in zip(ours.layers, theirs.layers, strict=True):
        for a, b in ((got.keys, want.keys), (got.values, want.values)):
            for row, n in enumerate(np.asarray(lens)):
                np.testing.assert_array_equal(np.asarray(a)[row, :n], np.asarray(b)[row, :n])
                np.testing.assert_allclose(np.asarray(a)[row, int(start) : int(start) + STEPS],
                                           np.asarray(b)[row, n : n + STEPS], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_the_sampler_loop_draws_the_same_tokens_with_a_shared_slot(jit: bool) -> None:
    model = init_model(QWEN_LIKE, seed=1)
    hidden, cache, lens = _prefill(model, head=False)
    vocab = QWEN_LIKE.vocab_size
    limits = Limits(jnp.asarray(STEPS), jnp.zeros(vocab, bool).at[5].set(True), jnp.ones(vocab, bool),
                    jnp.asarray(0.0), jnp.asarray(1.0), jnp.asarray(0), jnp.asarray(0.0))

    def run(shared: bool) -> tuple[np.ndarray, ...]:
        loop = lambda l, c: sample_loop(model, l, c, lens, jnp.ones(3, bool), limits, jax.random.key(0), width=SLOTS,
                                        use_top_p=False, shared_slot=shared)[1:]
        return tuple(np.asarray(x) for x in _maybe_jit(loop, jit)(hidden, cache))

    (tokens, logprobs, generated, finished), want = run(True), run(False)
    np.testing.assert_array_equal(tokens, want[0])  # greedy: the same argmax at every step
    np.testing.assert_allclose(logprobs, want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(generated, want[2])
    np.testing.assert_array_equal(finished, want[3])


@pytest.mark.parametrize("jit", [False, True])
def test_without_the_head_each_forward_returns_what_the_head_turns_into_its_logits(jit: bool) -> None:
    """The sampler's loop carries the final norm's output and applies the head where it draws."""
    model = init_model(QWEN_LIKE, seed=1)
    head = model.output_head()
    (logits, cache, lens), (hidden, _, _) = _prefill(model), _prefill(model, head=False)
    assert hidden.shape == (3, QWEN_LIKE.hidden_size)
    np.testing.assert_allclose(np.asarray(head.logits(hidden)), np.asarray(logits), rtol=1e-6, atol=1e-6)
    def step(t: jax.Array, p: jax.Array, c: KVCache, head: bool) -> tuple[jax.Array, KVCache]:
        return model.decode(t, p, c, head=head)

    step = jax.jit(step, static_argnums=3) if jit else step
    tokens = jnp.asarray([3, 4, 5], jnp.int32)
    (want, want_cache), (got, got_cache) = step(tokens, lens, cache, True), step(tokens, lens, cache, False)
    np.testing.assert_allclose(np.asarray(head.logits(got)), np.asarray(want), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got_cache.layers[0].keys), np.asarray(want_cache.layers[0].keys))
    chunk = jnp.asarray([[6, 7], [8, 0], [9, 10]], jnp.int32)
    positions = lens[:, None] + jnp.arange(2)[None, :]
    valid = jnp.asarray([[True, True], [True, False], [True, True]])
    last = jnp.asarray([1, 0, 1])
    want, _ = model.extend(chunk, positions, valid, cache, logits_at=last)
    got, _ = model.extend(chunk, positions, valid, cache, logits_at=last, head=False)
    np.testing.assert_allclose(np.asarray(head.logits(got)), np.asarray(want), rtol=1e-6, atol=1e-6)


def v5e_decode_step(
    config: TransformerConfig, rows: int, slots: int, cache_shape: tuple[int, ...], **decode: Any
) -> Any:
    """The decode step of a bfloat16 ``config`` over a donated [rows, slots, ...] cache, lowered
    for one v5e chip by libtpu on this CPU (abstract arguments: nothing is computed)."""
    from flax import nnx

    from stoker.sizing.compiler import load_slice

    placed = jax.sharding.SingleDeviceSharding(load_slice("v5e:1x1", 1).devices[0])

    def shaped(shape: tuple[int, ...], dtype: object = jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed)

    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
    state = jax.tree.map(lambda a: shaped(a.shape, a.dtype), abstract)
    layer = LayerCache(shaped(cache_shape), shaped(cache_shape))
    cache = KVCache((layer,) * config.num_layers, shaped((rows, slots), jnp.int32))
    ints = shaped((rows,), jnp.int32)

    def step(state: nnx.State, cache: KVCache, tokens: jax.Array, positions: jax.Array) -> object:
        model = nnx.merge(graphdef, state)
        return model.decode(tokens, positions, cache, **{k: f(positions) if callable(f) else f for k, f in decode.items()})

    return jax.jit(step, donate_argnums=(1,)).lower(state, cache, ints, ints).compile()


@pytest.mark.slow
def test_on_the_v5e_a_shared_slot_step_moves_far_fewer_bytes_than_the_per_row_select() -> None:
    """libtpu on this CPU: a cache-heavy shape where the select's whole-cache read and write
    dominated (2.0x the bytes of the shared slot's program when this was written)."""
    config = TransformerConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                               intermediate_size=256, max_seq_len=2048)
    rows, slots = 64, 2048
    shape = (rows, slots, 2, head_dim(config))

    def moved(shared: bool) -> float:
        decode = {"slot": jnp.max} if shared else {}
        costs: Any = v5e_decode_step(config, rows, slots, shape, **decode).cost_analysis()
        return float(costs["bytes accessed"])

    assert moved(shared=True) < 0.7 * moved(shared=False)


@pytest.mark.slow
@pytest.mark.parametrize("rows", [8, HEAD_FUSED_MIN_ROWS])
def test_on_the_v5e_the_head_fuses_into_the_draw_only_from_enough_rows(rows: int) -> None:
    """libtpu on this CPU: below ``HEAD_FUSED_MIN_ROWS`` the loop's logits are a fusion's result
    (the head's matmul apart, as measured faster there); from it on no [rows, V] float32 array
    leaves a fusion (the matmul inside the draw's reduction)."""
    from flax import nnx

    from stoker.sizing.compiler import load_slice

    config = TransformerConfig(vocab_size=4096, hidden_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                               intermediate_size=256, max_seq_len=256)
    placed = jax.sharding.SingleDeviceSharding(load_slice("v5e:1x1", 1).devices[0])
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)))
    shaped = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed)  # noqa: E731
    cache_shape = (rows, 64, 1, head_dim(config))
    layer = LayerCache(*(jnp.zeros(cache_shape, jnp.bfloat16),) * 2)
    cache = KVCache((layer,), jnp.zeros((rows, 64), jnp.int32))
    vocab = config.vocab_size
    limits = Limits(jnp.asarray(8), jnp.zeros(vocab, bool), jnp.ones(vocab, bool), jnp.asarray(1.0), jnp.asarray(1.0),
                    jnp.asarray(0), jnp.asarray(0.0))

    def loop(state: nnx.State, hidden: jax.Array, cache: KVCache, limits: Limits) -> Any:
        return sample_loop(nnx.merge(graphdef, state), hidden, cache, jnp.full(rows, 8, jnp.int32), jnp.ones(rows, bool),
                           limits, jax.random.key(0), width=8, use_top_p=False)

    args = jax.tree.map(shaped, (abstract, jnp.zeros((rows, config.hidden_size), jnp.bfloat16), cache, limits))
    text = jax.jit(loop).lower(*args).compile().as_text()
    logits_out = re.search(rf"= f32\[{rows},{vocab}\]\S* fusion\(", text) is not None
    assert logits_out == (rows < HEAD_FUSED_MIN_ROWS)

"""The TPU decode kernels (``stoker.model.decode_attention``, issue 52) in Pallas' interpreter
against the dense forms: attention over rows of different lengths with gaps, windows, soft-cap and
grouped heads; the in-place write touching one slot a row; ``Transformer.decode`` on a flat cache
step for step against the per-row select; the sampler's tokens unchanged; and, compiled for the
v5e by libtpu here, a decode program of Mosaic kernels that copies no cache."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.model import layers
from stoker.model.attention import Visibility, attention
from stoker.model.decode_attention import key_positions, ragged_decode_attention, write_rows
from stoker.model.model import flatten_cache, init_model
from stoker.rollout.sampling import Sampler
from stoker.spec import SamplingSpec, TransformerConfig
from tests.model.test_decode import v5e_decode_step
from tests.rollout.test_warmup import CONFIG as WARMUP_CONFIG
from tests.rollout.test_warmup import play

QWEN_LIKE = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                              intermediate_size=48, attention_bias=True, qk_norm=True, tie_embeddings=False)
GEMMA_LIKE = TransformerConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                               intermediate_size=48, sliding_window=3, global_layer_every=2, attn_logit_softcap=5.0)


def _maybe_jit(fn: Callable[..., Any], jit: bool) -> Callable[..., Any]:
    return jax.jit(fn) if jit else fn


@pytest.mark.parametrize("window, softcap", [(None, None), (40, 3.0)])
@pytest.mark.parametrize("jit", [False, True])
def test_ragged_attention_equals_dense_attention_over_the_visible_slots(
    window: int | None, softcap: float | None, jit: bool
) -> None:
    """16 rows in two groups of 8, 512 slots in blocks of 128: rows of 5 to 500 tokens (a group
    whose rows all end in the first block skips the rest), a gap of unfilled slots inside a row."""
    rows, slots, kv_heads, dim, heads = 16, 512, 2, 8, 6
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(rows, heads, dim)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(rows, slots, kv_heads, dim)), jnp.float32) for _ in range(2))
    q_pos = jnp.asarray([5, 60, 127, 3, 100, 90, 20, 7, 500, 130, 300, 256, 511, 200, 129, 400], jnp.int32)
    index = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (rows, slots))
    segments = (index <= q_pos[:, None]) & ~((index >= 10) & (index < 30) & (jnp.arange(rows) % 2 == 1)[:, None])
    vis = Visibility(q_pos[:, None], index, jnp.ones((rows, 1), jnp.int32), segments.astype(jnp.int32))
    want = attention(q[:, None], k, v, vis, scale=0.3, softcap=softcap, window=window)[:, 0]

    def ours(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return ragged_decode_attention(
            q, k.reshape(rows, slots, -1), v.reshape(rows, slots, -1), q_pos, key_positions(segments, index),
            scale=0.3, softcap=softcap, window=window, interpret=True, block_slots=128,
        )

    np.testing.assert_allclose(np.asarray(_maybe_jit(ours, jit)(q, k, v)), np.asarray(want), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("jit", [False, True])
def test_write_rows_sets_one_slot_a_row_and_nothing_outside_the_cache(jit: bool) -> None:
    rows, slots, features = 4, 64, 16
    keys = jnp.arange(rows * slots * features, dtype=jnp.float32).reshape(rows, slots, features)
    values = -keys
    new_keys, new_values = jnp.full((rows, features), 1e4), jnp.full((rows, features), 2e4)
    at = jnp.asarray([5, 17, slots, -1], jnp.int32)  # the last two lie outside: nothing written
    write = _maybe_jit(lambda *a: write_rows(*a, interpret=True), jit)
    got_k, got_v = write(keys, values, new_keys, new_values, at)
    np.testing.assert_array_equal(np.asarray(got_k), np.asarray(keys.at[0, 5].set(1e4).at[1, 17].set(1e4)))
    np.testing.assert_array_equal(np.asarray(got_v), np.asarray(values.at[0, 5].set(2e4).at[1, 17].set(2e4)))


@pytest.mark.parametrize("config", [QWEN_LIKE, GEMMA_LIKE], ids=["qwen", "gemma"])
@pytest.mark.parametrize(("jit", "write"), [
    (False, "in the attention kernel"), (True, "in the attention kernel"),
    (True, "a kernel of its own"),  # past WRITE_FUSED_MAX_ROWS rows (its eager run is the interpreter's slowest)
])
def test_decode_on_a_flat_cache_gives_the_per_row_steps_logits_and_cache(
    config: TransformerConfig, jit: bool, write: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if write == "a kernel of its own":
        monkeypatch.setattr(layers, "WRITE_FUSED_MAX_ROWS", 0)
    model = init_model(config, seed=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    ids = jnp.asarray([p + [0] * (8 - len(p)) for p in prompts], jnp.int32)
    idx = jnp.arange(8, dtype=jnp.int32)[None, :]
    logits, cache = model.prefill(ids, jnp.broadcast_to(idx, ids.shape), (idx < lens[:, None]).astype(jnp.int32),
                                  cache_len=16, logits_at=lens - 1)
    assert cache is not None
    step = _maybe_jit(lambda t, p, c: model.decode(t, p, c), jit)
    flat = flatten_cache(cache)
    for n in range(6):
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        logits, cache = step(token, lens + n, cache)
        ours, flat = step(token, lens + n, flat)
        np.testing.assert_allclose(np.asarray(ours), np.asarray(logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(flat.segment_ids), np.asarray(cache.segment_ids))
    for got, want in zip(flat.layers, flatten_cache(cache).layers, strict=True):
        np.testing.assert_allclose(np.asarray(got.keys), np.asarray(want.keys), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(got.values), np.asarray(want.values), rtol=1e-5, atol=1e-6)


def test_the_sampler_draws_the_same_tokens_on_the_kernels() -> None:
    config = TransformerConfig(max_seq_len=64)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]]

    def play(kernels: bool) -> list[tuple[list[int], list[float]]]:
        sampler = Sampler(config, SamplingSpec(temperature=1.0), seed=3, buckets=(16, 32), decode_kernels=kernels)
        out = sampler.generate(prompts, max_new_tokens=12)
        return [(g.token_ids, g.logprobs) for g in out]

    ours, want = play(True), play(False)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


def test_conversations_on_a_flat_cache_draw_the_same_tokens() -> None:
    """The rollout server's calls: turns that extend cached conversations (the cache flat), new
    weights, a long prompt (``tests/rollout/test_warmup.py``'s conversations)."""
    def sampler(kernels: bool) -> Sampler:
        return Sampler(WARMUP_CONFIG, SamplingSpec(temperature=1.0), seed=3, buckets=(16, 32, 64), min_batch=2,
                       session_rows=4, decode_kernels=kernels)

    flat = sampler(True)
    assert flat._store[0].keys.ndim == 3
    ours, want = play(flat, sessions=True), play(sampler(False), sessions=True)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(ours, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [1, 2])
def test_on_the_v5e_the_flat_decode_step_runs_mosaic_kernels_and_copies_no_cache(
    kernels: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """libtpu on this CPU: one Mosaic kernel a layer up to ``WRITE_FUSED_MAX_ROWS`` rows, two past
    it, and no copy of a cache-sized array (a reshape between the heads' and the flat layout, or a
    non-aliased write, would make one). The flat width is 128 lanes as in Qwen2.5-0.5B (2 x 64):
    a narrower one the compiler lays out slots-minor at the program's boundary, and copies there."""
    config = TransformerConfig(vocab_size=256, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                               intermediate_size=256, max_seq_len=2048)
    rows, slots = 64, 2048
    monkeypatch.setattr(layers, "WRITE_FUSED_MAX_ROWS", rows if kernels == 1 else rows - 1)
    text = v5e_decode_step(config, rows, slots, (rows, slots, 128), interpret=False).as_text()
    assert text.count('custom_call_target="tpu_custom_call"') == kernels * config.num_layers
    cache_copies = re.findall(rf"bf16\[{rows},{slots},128\]\{{[^}}]*\}} copy", text)
    assert cache_copies == []


def test_the_kernels_take_caches_whose_blocks_fit() -> None:
    from stoker.model.decode_attention import takes

    assert takes(16) and takes(128) and takes(2048) and takes(8192)
    assert not takes(100)  # not a multiple of the write's tile
    assert not takes(1008)  # a tile multiple, but one 1,008-slot block a group of rows

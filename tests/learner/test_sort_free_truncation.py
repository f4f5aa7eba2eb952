"""Top-k and the top-p nucleus over a real-size vocabulary, found by weighing rather than sorting
(``stoker.model.selection``): the set the definition names, ties kept, narrow and wide alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.model.logprobs import truncation_mask
from stoker.model.selection import from_key, ordered_keys, weighted_threshold
from stoker.rollout.programs import nucleus_floor, sample_token

VOCAB = 3000


def logits(scale: float, seed: int, rows: int = 3) -> np.ndarray:
    z = np.asarray(jax.random.normal(jax.random.key(seed), (rows, VOCAB)), np.float32) * scale
    return np.round(z * 4) / 4  # coarse values: ties at every k-th value and nucleus floor


def nucleus_floor_by_definition(logp: np.ndarray, top_p: float) -> np.ndarray:
    """Sort descending; the nucleus runs to the first token whose cumulative mass reaches top_p."""
    desc = -np.sort(-logp.astype(np.float64), axis=-1)
    reached = np.cumsum(np.exp(desc), axis=-1) >= top_p
    return desc[np.arange(len(desc)), np.argmax(reached, axis=-1)][:, None]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("k", [1, 7, 256, 1000, VOCAB])
def test_top_k_keeps_the_k_largest_and_their_ties(jit: bool, k: int) -> None:
    z = logits(2.0, seed=k)
    want = z >= np.sort(z, axis=-1)[:, -k][:, None]
    runtime = jax.jit(truncation_mask) if jit else truncation_mask
    assert (np.asarray(runtime(jnp.asarray(z), jnp.asarray(k), jnp.asarray(0.0))) == want).all()
    assert (np.asarray(truncation_mask(jnp.asarray(z), k, 0.0)) == want).all()  # a static k (the trainer's)
    if 1 < k < VOCAB:
        assert (want.sum(-1) > k).any()  # ties with the k-th are kept


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("scale", "top_p", "size"), [(4.0, 0.9, (16, 57)), (4.0, 0.99, (148, 353)), (0.5, 0.9, (2349, 2663))])
def test_the_nucleus_is_the_sorted_definitions(jit: bool, scale: float, top_p: float, size: tuple[int, int]) -> None:
    """Peaked rows (tens of tokens), wider ones, and flat ones (thousands)."""
    z = logits(scale, seed=int(scale * 10))
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(z), axis=-1))
    floor = (jax.jit(nucleus_floor) if jit else nucleus_floor)(jnp.asarray(logp), jnp.float32(top_p))
    want = nucleus_floor_by_definition(logp, top_p)
    np.testing.assert_array_equal(np.asarray(floor), want.astype(np.float32))
    sizes = (logp >= want).sum(-1)
    assert (sizes.min(), sizes.max()) == size


def test_drawn_tokens_stay_in_the_nucleus() -> None:
    z = jnp.asarray(logits(1.5, seed=5, rows=64))
    logp = np.asarray(jax.nn.log_softmax(z, axis=-1))
    floor = nucleus_floor_by_definition(logp, 0.8)
    tokens, recorded = jax.jit(sample_token)(jax.random.key(0), z, jnp.float32(1.0), jnp.float32(0.8))
    tokens = np.asarray(tokens)
    assert (logp[np.arange(64), tokens] >= floor[:, 0]).all()
    np.testing.assert_allclose(np.asarray(recorded), logp[np.arange(64), tokens], atol=1e-5)
    assert len(set(tokens.tolist())) > 32  # it samples


def test_keys_keep_the_floats_order_and_invert() -> None:
    x = np.asarray([-np.inf, -3e38, -1.5, -1e-40, -0.0, 0.0, 1e-40, 2.5, 3e38, np.inf], np.float32)
    keys = np.asarray(ordered_keys(jnp.asarray(x)))
    assert (np.diff(keys.astype(np.int64)) > 0).all()
    np.testing.assert_array_equal(np.asarray(from_key(jnp.asarray(keys))), x)


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_every_pass_width_finds_the_same_threshold(bits: int) -> None:
    z = jax.random.normal(jax.random.key(9), (3, VOCAB))  # distinct values: exactly k reach the k-th
    for k in (1, 100, VOCAB):
        want = np.sort(np.asarray(z), axis=-1)[:, -k]
        np.testing.assert_array_equal(np.asarray(weighted_threshold(z, k, bits=bits))[:, 0], want)
    np.testing.assert_array_equal(np.asarray(weighted_threshold(z, VOCAB + 5, bits=bits))[:, 0], np.asarray(z).min(-1))
    with pytest.raises(ValueError, match="divide 32"):
        weighted_threshold(z, 1, bits=3)

"""Top-k and the top-p nucleus over a real-size vocabulary: found among each row's
``SORT_FREE_CANDIDATES`` most likely tokens when those decide it, by a full sort otherwise; either
way the set the definition names (ties kept)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.model.logprobs import SORT_FREE_CANDIDATES, truncation_mask
from stoker.rollout.programs import nucleus_floor, sample_token

VOCAB = 3000  # > SORT_FREE_CANDIDATES


def logits(scale: float, seed: int, rows: int = 3) -> np.ndarray:
    z = np.asarray(jax.random.normal(jax.random.key(seed), (rows, VOCAB)), np.float32) * scale
    return np.round(z * 4) / 4  # coarse values: ties at every k-th value and nucleus floor


def nucleus_floor_by_definition(logp: np.ndarray, top_p: float) -> np.ndarray:
    """Sort descending; the nucleus runs to the first token whose cumulative mass reaches top_p."""
    desc = -np.sort(-logp.astype(np.float64), axis=-1)
    reached = np.cumsum(np.exp(desc), axis=-1) >= top_p
    return desc[np.arange(len(desc)), np.argmax(reached, axis=-1)][:, None]


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("k", [1, 7, SORT_FREE_CANDIDATES, SORT_FREE_CANDIDATES + 1, 1000, VOCAB])
def test_top_k_keeps_the_k_largest_and_their_ties(jit: bool, k: int) -> None:
    z = logits(2.0, seed=k)
    want = z >= np.sort(z, axis=-1)[:, -k][:, None]
    runtime = jax.jit(truncation_mask) if jit else truncation_mask
    assert (np.asarray(runtime(jnp.asarray(z), jnp.asarray(k), jnp.asarray(0.0))) == want).all()
    assert (np.asarray(truncation_mask(jnp.asarray(z), k, 0.0)) == want).all()  # a static k (the trainer's)
    if 1 < k < VOCAB:
        assert (want.sum(-1) > k).any()  # ties with the k-th are kept


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize(("scale", "top_p", "within_candidates"), [(4.0, 0.9, True), (0.5, 0.9, False), (4.0, 0.99, False)])
def test_the_nucleus_is_the_sorted_definitions(jit: bool, scale: float, top_p: float, within_candidates: bool) -> None:
    """Peaked rows (every nucleus within the top 256), flat ones (thousands of tokens), and a batch
    where one row's nucleus is wider than the candidates (the whole batch goes to the sort)."""
    z = logits(scale, seed=int(scale * 10))
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(z), axis=-1))
    floor = (jax.jit(nucleus_floor) if jit else nucleus_floor)(jnp.asarray(logp), jnp.float32(top_p))
    want = nucleus_floor_by_definition(logp, top_p)
    np.testing.assert_array_equal(np.asarray(floor), want.astype(np.float32))
    assert ((logp >= want).sum(-1) <= SORT_FREE_CANDIDATES).all() == within_candidates


def test_drawn_tokens_stay_in_the_nucleus() -> None:
    z = jnp.asarray(logits(1.5, seed=5, rows=64))
    logp = np.asarray(jax.nn.log_softmax(z, axis=-1))
    floor = nucleus_floor_by_definition(logp, 0.8)
    tokens, recorded = jax.jit(sample_token)(jax.random.key(0), z, jnp.float32(1.0), jnp.float32(0.8))
    tokens = np.asarray(tokens)
    assert (logp[np.arange(64), tokens] >= floor[:, 0]).all()
    np.testing.assert_allclose(np.asarray(recorded), logp[np.arange(64), tokens], atol=1e-5)
    assert len(set(tokens.tolist())) > 32  # it samples

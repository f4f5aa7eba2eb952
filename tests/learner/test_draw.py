"""The sampler's draw (``stoker.rollout.draw``): the softmax's frequencies, uniform and independent
noise, greedy as the first argmax, and the one-pass token, score and log-sum-exp."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.rollout.draw import draw, draw_scored, gumbel_noise
from stoker.rollout.sampling import sample_token


@pytest.mark.parametrize("jit", [False, True])
def test_the_draw_follows_the_softmax_over_a_large_vocabulary(jit: bool) -> None:
    """The hashed Gumbel noise: over a 3,000-token vocabulary with mass spread over it, the
    frequencies are the tempered softmax's, and each log-prob is the log-softmax's value."""
    vocab = 3000
    heavy = {5: 0.3, 1023: 0.15, 1024: 0.05, 1500: 0.25, vocab - 1: 0.2}
    probs = np.full(vocab, 0.05 / (vocab - len(heavy)))
    for token, p in heavy.items():
        probs[token] = p
    logits = jnp.asarray(np.tile(np.log(probs), (20_000, 1)), jnp.float32)
    sample = jax.jit(sample_token) if jit else sample_token
    for temperature in (1.0, 2.0):
        tempered = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
        tokens, logp = sample(jax.random.key(3), logits, jnp.float32(temperature), None)
        tokens = np.asarray(tokens)
        freqs = np.bincount(tokens, minlength=vocab) / len(tokens)
        np.testing.assert_allclose(freqs[list(heavy)], tempered[list(heavy)], atol=0.012)
        rest = np.setdiff1d(np.arange(vocab), list(heavy))
        assert abs(freqs[rest].sum() - tempered[rest].sum()) < 0.012
        assert len(set(tokens[freqs[tokens] < 1e-3])) > 50  # the tail is drawn all over, not from a few
        np.testing.assert_allclose(np.asarray(logp), np.log(tempered[tokens]), rtol=1e-4, atol=1e-5)


def test_the_noise_is_uniform_and_differs_by_key_row_and_column() -> None:
    u = np.exp(-np.exp(-np.asarray(gumbel_noise(jax.random.key(0), (256, 4096)))))  # back to uniform
    counts = np.histogram(u, bins=64, range=(0, 1))[0]
    expected = u.size / 64
    assert ((counts - expected) ** 2 / expected).sum() < 120  # chi-square, 63 dof (p ~ 1e-5)
    assert abs(np.corrcoef(u[:, :-1].ravel(), u[:, 1:].ravel())[0, 1]) < 0.01
    assert abs(np.corrcoef(u[:-1].ravel(), u[1:].ravel())[0, 1]) < 0.01
    other = np.asarray(gumbel_noise(jax.random.key(1), (256, 4096)))
    assert abs(np.corrcoef(-np.log(-np.log(u)).ravel(), other.ravel())[0, 1]) < 0.01


@pytest.mark.parametrize("jit", [False, True])
def test_a_greedy_draw_is_the_first_argmax(jit: bool) -> None:
    scores = jax.random.normal(jax.random.key(1), (64, 3000)) * 3.0
    scores = scores.at[0, 1023].set(50.0).at[0, 1024].set(50.0)  # a tie
    scores = scores.at[1].set(-jnp.inf).at[1, 7].set(0.0)  # one allowed token
    run = jax.jit(draw) if jit else draw
    tokens = run(jax.random.key(0), scores, jnp.asarray(True))
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jnp.argmax(scores, axis=-1)))
    assert int(tokens[0]) == 1023 and int(tokens[1]) == 7
    assert int(run(jax.random.key(0), scores, jnp.asarray(False))[1]) == 7  # -inf is never drawn


@pytest.mark.parametrize("jit", [False, True])
def test_the_one_pass_draw_gives_the_draws_tokens_their_scores_and_the_log_sum_exp(jit: bool) -> None:
    scores = jax.random.normal(jax.random.key(2), (64, 3000)) * 3.0
    scores = scores.at[0, 1023].set(50.0).at[0, 1024].set(50.0)  # a tie: the lower index
    scores = scores.at[1].set(-jnp.inf).at[1, 7].set(0.0)  # one allowed token
    scores = scores.at[2, :2000].set(-jnp.inf)  # a masked head of the vocabulary
    run = jax.jit(draw_scored) if jit else draw_scored
    for greedy in (False, True):
        tokens, picked, log_normalizer = run(jax.random.key(4), scores, jnp.asarray(greedy))
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(draw(jax.random.key(4), scores, jnp.asarray(greedy))))
        np.testing.assert_array_equal(np.asarray(picked), np.asarray(jnp.take_along_axis(scores, tokens[:, None], axis=-1)[:, 0]))
        np.testing.assert_allclose(np.asarray(log_normalizer), np.asarray(jax.nn.logsumexp(scores, axis=-1)), rtol=1e-6, atol=1e-6)
        assert int(tokens[1]) == 7 and int(tokens[2]) >= 2000
    assert int(run(jax.random.key(4), scores, jnp.asarray(True))[0][0]) == 1023

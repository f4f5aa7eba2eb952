"""One token a row drawn from softmax(scores) by the Gumbel-max trick, with cheap noise.

argmax_i(score_i + g_i) with g_i i.i.d. Gumbel(0, 1) is a draw from softmax(score). The noise is
made from a counter hash keyed by the step's PRNG key rather than by ``jax.random``'s threefry:
for a [rows, vocabulary] draw threefry's ~60 integer operations an element made the draw
compute-bound on a TPU (0.48 ms of a 3.6 ms decode step at 128 rows of a 152k vocabulary,
benchmarks/README.md, "Where the decode call's time goes"); the hash takes ~10, and fuses with
the argmax into one read of the scores. Greedy rows add no noise, so one reduction serves both.
``draw_scored`` also returns the drawn token's score and the log-sum-exp in that same pass (an
online log-sum-exp as a variadic reduction): one read of the [rows, vocabulary] floats where a
separate log-sum-exp and gather took three more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash with full avalanche (the "lowbias32" constants of Wellons' search)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def gumbel_noise(key: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """[rows, cols] float32 Gumbel(0, 1) noise, a function of ``key`` and each element's index."""
    seed = jax.random.bits(key, (2,), jnp.uint32)
    index = jax.lax.broadcasted_iota(jnp.uint32, shape, 0) * jnp.uint32(shape[1])
    index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    bits = _mix(_mix(index ^ seed[0]) ^ seed[1])
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -jnp.log(-jnp.log(uniform))


def draw(key: jax.Array, scores: jax.Array, greedy: jax.Array) -> jax.Array:
    """scores [B, V] float32 (-inf: never drawn), greedy bool [B] or scalar -> tokens [B] int32:
    a draw from softmax(scores), or the (first) argmax where greedy."""
    return jnp.argmax(_noisy(key, scores, greedy), axis=-1).astype(jnp.int32)


def _noisy(key: jax.Array, scores: jax.Array, greedy: jax.Array) -> jax.Array:
    """The scores plus Gumbel noise, none on greedy rows."""
    rows, vocab = scores.shape
    return scores + jnp.where(jnp.broadcast_to(greedy, (rows,))[:, None], 0.0, gumbel_noise(key, (rows, vocab)))


def _combine(a: tuple[jax.Array, ...], b: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
    """Merges two partial reductions: (running max, sum of exp(score - max), best noisy score, its
    index, its score); ties go to the lower index, as ``argmax``."""
    max_a, sum_a, best_a, index_a, score_a = a
    max_b, sum_b, best_b, index_b, score_b = b
    top = jnp.maximum(max_a, max_b)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)  # all -inf so far: both sums are 0
    total = sum_a * jnp.exp(max_a - shift) + sum_b * jnp.exp(max_b - shift)
    take_b = (best_b > best_a) | ((best_b == best_a) & (index_b < index_a))
    return (top, total, jnp.where(take_b, best_b, best_a), jnp.where(take_b, index_b, index_a),
            jnp.where(take_b, score_b, score_a))


def draw_scored(key: jax.Array, scores: jax.Array, greedy: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``draw``'s tokens [B] int32, each token's score [B] and each row's log-sum-exp of the scores
    [B], in one reduction over the scores."""
    rows, vocab = scores.shape
    index = jax.lax.broadcasted_iota(jnp.int32, (rows, vocab), 1)
    start = (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.float32(-jnp.inf), jnp.int32(vocab), jnp.float32(0.0))
    top, total, _, tokens, picked = jax.lax.reduce(
        (scores, jnp.ones_like(scores), _noisy(key, scores, greedy), index, scores), start, _combine, (1,)
    )
    return tokens, picked, top + jnp.log(total)

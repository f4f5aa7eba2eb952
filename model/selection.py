"""Thresholds over a row without sorting it: the k-th largest value (top-k) and the smallest
log-prob of the top-p nucleus, both as "the largest t whose elements >= t weigh at least a
target" (weight 1 a token for top-k, its probability for top-p).

A sort of a [128, 151,936] vocabulary on the v5e takes 43 ms and ``lax.top_k`` of 256 candidates
15 ms, against 0.3 ms for a plain draw; this weighing 1.3 ms at 2 bits a pass (1.5 at 1, 2.3 at
4; benchmarks/README.md, "Top-k and top-p without a sort"). t is built a few bits at a time over
the float's order-preserving 32-bit key: each pass weighs the 2^bits - 1 candidates for the next
bits (reductions over the row), so 32 / bits passes give the exact element, ties included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BITS_PER_PASS = 2


def ordered_keys(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (-0.0 just below +0.0; no NaNs expected)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def from_key(key: jax.Array) -> jax.Array:
    """The float32 whose ``ordered_keys`` is ``key``."""
    bits = jnp.where(key >> 31 == 1, key & jnp.uint32(0x7FFFFFFF), ~key)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def weighted_threshold(
    x: jax.Array, target: jax.Array | float, weight: jax.Array | None = None, *, bits: int = BITS_PER_PASS
) -> jax.Array:
    """The largest element t of each row of ``x`` [..., V] such that the elements >= t weigh at
    least ``target`` ([..., 1], x's float32 value); ``weight`` [..., V] (None: 1 an element, so
    target k gives the k-th largest). A target above the row's whole weight gives the row's
    smallest element."""
    if 32 % bits:
        raise ValueError(f"bits={bits} must divide 32")
    keys = ordered_keys(x)
    weight = jnp.ones(x.shape, jnp.float32) if weight is None else weight.astype(jnp.float32)
    found = jnp.zeros((*x.shape[:-1], 1), jnp.uint32)  # the key's bits decided so far
    for shift in range(32 - bits, -1, -bits):
        # Candidate c sets the next bits to c; the largest candidate that still weighs enough wins.
        weighs = [jnp.sum(jnp.where(keys >= (found | jnp.uint32(c << shift)), weight, 0.0), axis=-1, keepdims=True)
                  >= target for c in range(1, 1 << bits)]
        digit = sum((w.astype(jnp.uint32) for w in weighs), jnp.zeros_like(found))  # weighing is monotone in c
        found = found | (digit << shift)
    # ``found`` is the largest key that weighs enough, so an element's (0 when none does).
    return from_key(jnp.maximum(found, jnp.min(keys, axis=-1, keepdims=True)))

"""Masked grouped-query attention, blockwise over queries so long rows fit in memory.

    out_t = sum_s softmax_s(score(t, s)) v_s,   score(t, s) = c tanh(scale q_t.k_s / c)  (c: soft-cap)

over the keys s that query t may see (``Visibility``). Grouped-query: query head h reads key/value
head h // (num_heads / num_kv_heads), without repeating the keys in memory.

Queries are processed ``block`` at a time under ``jax.checkpoint``: the forward keeps only the
[block, keys] scores of one block alive, and the backward recomputes each block's scores instead
of storing all [heads, T, T] of them, so a layer's attention memory is O(T * block) rather than
O(T^2). Scores and the softmax are float32 whatever the model's dtype. The result equals the dense
computation (each block is a full softmax over all keys, not an online approximation).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

# Added to masked scores; finite so fully-masked (padding) rows stay NaN-free.
MASKED = -1e30
# Float32 score elements one query block may hold (per device row): 2^24 * 4 B = 64 MiB.
BLOCK_SCORE_ELEMENTS = 1 << 24


class Visibility(NamedTuple):
    """Which keys each query sees: key s is visible from query t iff

        k_index[s] <= q_index[t],  q_segment[t] == k_segment[s] != 0,
        and, for a local layer, q_index[t] - k_index[s] < window.

    Indices are positions in the sequence (token indices within a packed row, cache slots in the
    sampler); segments label packed sequences (0 = padding)."""

    q_index: jax.Array  # [B, T] int32
    k_index: jax.Array  # [B, S] int32
    q_segment: jax.Array  # [B, T] int32
    k_segment: jax.Array  # [B, S] int32


def visible(vis: Visibility, window: int | None) -> jax.Array:
    """The [B, T, S] boolean mask ``vis`` describes."""
    qi, ki = vis.q_index[:, :, None], vis.k_index[:, None, :]
    mask = (ki <= qi) & (vis.q_segment[:, :, None] == vis.k_segment[:, None, :]) & (vis.q_segment != 0)[:, :, None]
    if window is not None:
        mask &= qi - ki < window
    return mask


def _dense(
    q: jax.Array, k: jax.Array, v: jax.Array, vis: Visibility, scale: float, softcap: float | None, window: int | None
) -> jax.Array:
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(visible(vis, window)[:, None, None], scores, MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, heads, d).astype(q.dtype)


def query_block(rows: int, heads: int, queries: int, keys: int) -> int:
    """The largest power-of-two query block whose scores fit ``BLOCK_SCORE_ELEMENTS`` (>= 16)."""
    block = 16
    while block * 2 <= queries and rows * heads * block * 2 * keys <= BLOCK_SCORE_ELEMENTS:
        block *= 2
    return block


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    vis: Visibility,
    *,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    block: int | None = None,
) -> jax.Array:
    """q [B, T, H, D], k/v [B, S, K, D] -> [B, T, H, D] in q's dtype.

    ``block``: queries per block (default: ``query_block``); rows of T or fewer run in one block."""
    b, t, heads, d = q.shape
    block = block or query_block(b, heads, t, k.shape[1])
    if t <= block:
        return _dense(q, k, v, vis, scale, softcap, window)
    pad = -t % block
    n = (t + pad) // block

    def split(x: jax.Array) -> jax.Array:  # [B, T, ...] -> [n, B, block, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, n, block, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def one_block(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        q_blk, qi_blk, qs_blk = args
        return _dense(q_blk, k, v, vis._replace(q_index=qi_blk, q_segment=qs_blk), scale, softcap, window)

    # Padded queries have segment 0: they see nothing and are cut off below.
    out = jax.lax.map(one_block, (split(q), split(vis.q_index), split(vis.q_segment)))
    return jnp.moveaxis(out, 0, 1).reshape(b, t + pad, heads, d)[:, :t]

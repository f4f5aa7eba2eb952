"""Advantages: GRPO's group-relative advantage over episodes, GAE over the model tokens of packed rows."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from stoker.learner.algorithms.config import AdvantageNormalization, Array
from stoker.learner.algorithms.ops import array_module, check_rank, check_same_shape


def group_advantages(
    rewards: Array, valid: Array, *, normalization: AdvantageNormalization = "population-std", eps: float = 1e-6
) -> Array:
    """GRPO's group-relative advantage (Shao et al. 2024, DeepSeekMath, eq. 3 outcome supervision).

        A_i = (r_i - mean_j r_j) / (s + eps),   s = sqrt( sum_j (r_j - mean r)^2 / (n - ddof) )

    over the n valid episodes j of i's group. ``normalization`` picks the scale:

    "population-std" (Stoker's default)
        ddof = 0, the group's own spread: a two-episode group scores +-1.
    "sample-std"
        ddof = 1 (Bessel's correction), the convention of TRL, verl and Tunix (torch's ``std()`` and
        ``jnp.std(ddof=1)``). The advantages are sqrt((n-1)/n) times the population-std ones (eps
        aside): 0.935x at n = 8, 0.707x at n = 2. A per-group constant factor, so it changes the
        step size, not the direction within a group.
    "none"
        Dr. GRPO's unscaled ``r_i - mean r`` (Liu et al. 2025).

    ``rewards`` and ``valid`` are [G, N] (groups x episodes, padded; ``valid`` 0 on padding and on
    failed episodes, which get advantage 0). A group with fewer than two valid episodes carries no
    signal and gets all-zero advantages. Works on numpy and jax arrays.
    """
    check_rank("rewards", rewards, 2)
    check_same_shape(rewards=rewards, valid=valid)
    ddof = {"population-std": 0.0, "sample-std": 1.0, "none": None}
    if normalization not in ddof:
        raise ValueError(f"normalization {normalization!r}; expected one of {', '.join(ddof)}")
    xp = array_module(rewards, valid)
    r = xp.asarray(rewards, dtype=xp.float32)
    v = xp.asarray(valid, dtype=xp.float32)
    count = v.sum(axis=-1, keepdims=True)
    mean = (r * v).sum(axis=-1, keepdims=True) / xp.maximum(count, 1.0)
    centred = (r - mean) * v
    correction = ddof[normalization]
    if correction is not None:
        std = xp.sqrt((centred**2).sum(axis=-1, keepdims=True) / xp.maximum(count - correction, 1.0))
        centred = centred / (std + eps)
    return xp.where(count >= 2, centred, 0.0).astype(xp.float32)


def gae(
    rewards: Array, values: Array, mask: Array, segment_ids: Array, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016) over the model tokens of packed rows.

        delta_k = r_k + gamma * V_{k+1} - V_k,     A_k = delta_k + gamma * lambda * A_{k+1}

    where k runs over the *model* tokens (``mask`` = 1) of one sequence, k+1 is the next model
    token of the same sequence (environment tokens in between are observations, not actions), and
    V_{k+1} = A_{k+1} = 0 after the last one (the episode ends). Sequences are told apart by
    ``segment_ids`` (a new id starts a new episode, so packed neighbours never leak into each
    other). Returns ``(advantages, returns = advantages + values)``, zero off the mask; no gradient
    flows through either. All inputs [B, T].
    """
    check_rank("rewards", rewards, 2)
    check_same_shape(rewards=rewards, values=values, mask=mask, segment_ids=segment_ids)
    r = jnp.asarray(rewards, jnp.float32)
    v = jax.lax.stop_gradient(jnp.asarray(values, jnp.float32))
    m = jnp.asarray(mask) > 0
    seg = jnp.asarray(segment_ids)

    def step(carry: tuple[jax.Array, jax.Array, jax.Array], x: tuple[jax.Array, ...]) -> tuple[Any, jax.Array]:
        next_value, next_adv, next_seg = carry
        r_t, v_t, m_t, s_t = x
        same = next_seg == s_t
        nv = jnp.where(same, next_value, 0.0)
        na = jnp.where(same, next_adv, 0.0)
        adv = r_t + gamma * nv - v_t + gamma * lam * na
        carry = (
            jnp.where(m_t, v_t, next_value),
            jnp.where(m_t, adv, next_adv),
            jnp.where(m_t, s_t, next_seg),
        )
        return carry, jnp.where(m_t, adv, 0.0)

    # Built from the inputs so that, under shard_map, the carry varies over the same axes they do.
    init = (jnp.zeros_like(r[:, 0]), jnp.zeros_like(r[:, 0]), jnp.full_like(seg[:, 0], -1))
    # scan runs over time, last to first; each row is an independent lane.
    xs = (r.T[::-1], v.T[::-1], m.T[::-1], seg.T[::-1])
    _, adv_rev = jax.lax.scan(step, init, xs)
    advantages = adv_rev[::-1].T
    returns = jnp.where(m, advantages + v, 0.0)
    return advantages, returns

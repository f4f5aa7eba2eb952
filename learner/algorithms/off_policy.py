"""How far the trained policy is from the one that sampled: the behaviour ratio's statistics, the
second-moment token mask (M2PO), the trust region that widens with a token's lag and the weight of
the rest of a token's episode.

All take the per-token log-ratio ``log pi_theta(y_t) - log mu(y_t)`` (``mu``: the sampler's
log-probs, ``behaviour_logprobs``), with no gradient; ``total`` sums over every shard the rows
are split over (``jax.lax.psum`` over the row axes inside ``shard_map``; the identity outside).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from stoker.learner.algorithms.config import LOG_RATIO_LIMIT, Array, LossConfig
from stoker.learner.algorithms.ops import exp_log_ratio, gather_segments, segment_sum

Total = Callable[[jax.Array], jax.Array]
BISECTION_STEPS = 40  # halvings of [0, LOG_RATIO_LIMIT^2]: the threshold to ~4e-10


def one_shard(x: jax.Array) -> jax.Array:
    """``total`` outside shard_map: the rows are all here."""
    return x


def behaviour_ratio_stats(log_ratio: Array, mask: Array) -> dict[str, jax.Array]:
    """Sums for the behaviour importance weights ``w_t = pi_theta(y_t) / mu(y_t)`` of the trained
    tokens: ``behaviour_w_sum``, ``behaviour_w_sumsq`` (ESS = (sum w)^2 / sum w^2, Kish's effective
    sample size, out of ``behaviour_tokens``), ``behaviour_log_w_sumsq`` (the second moment M2PO
    bounds) and ``behaviour_log_w_abs_max``. At staleness 0 every w is ~1 (ESS = N, M2 ~ 0)
    unless sampler and trainer disagree numerically."""
    on = jnp.asarray(mask) > 0
    log_w = jnp.where(on, jax.lax.stop_gradient(jnp.asarray(log_ratio)), 0.0)
    w = jnp.where(on, exp_log_ratio(log_w), 0.0)
    return {
        "behaviour_w_sum": jnp.sum(w),
        "behaviour_w_sumsq": jnp.sum(w * w),
        "behaviour_log_w_sumsq": jnp.sum(log_w * log_w),
        "behaviour_log_w_abs_max": jnp.max(jnp.abs(log_w)),
        "behaviour_tokens": jnp.sum(on.astype(jnp.float32)),
    }


def second_moment_mask(log_ratio: Array, mask: Array, budget: float, total: Total = one_shard) -> jax.Array:
    """M2PO's mask (Zheng et al. 2025, "Prosperity before Collapse"): drop the tokens with the
    largest ``(log w)^2`` until the kept tokens' mean ``(log w)^2`` is at most ``budget``.

    Kept: ``(log w_t)^2 <= tau`` for the largest ``tau`` whose kept mean is within the budget.
    That mean only grows with ``tau`` (each token added is at least the mean so far), so ``tau``
    is found by bisection, every probe one ``total`` of two sums: the same mask on every shard.
    Returns a 0/1 float mask (0 off ``mask``)."""
    on = jnp.asarray(mask) > 0
    m2 = jnp.where(on, jnp.square(jax.lax.stop_gradient(jnp.asarray(log_ratio))), 0.0)
    m2 = jnp.minimum(m2, LOG_RATIO_LIMIT**2)

    def within(tau: jax.Array) -> jax.Array:
        kept = on & (m2 <= tau)
        return total(jnp.sum(jnp.where(kept, m2, 0.0))) <= budget * total(jnp.sum(kept.astype(jnp.float32)))

    def halve(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        low, high = bounds
        mid = 0.5 * (low + high)
        ok = within(mid)
        return jnp.where(ok, mid, low), jnp.where(ok, high, mid)

    top = jnp.float32(LOG_RATIO_LIMIT**2)
    low, _ = jax.lax.fori_loop(0, BISECTION_STEPS, halve, (jnp.float32(0.0), top))
    tau = jnp.where(within(top), top, low)
    return (on & (m2 <= tau)).astype(jnp.float32)


def lag_scaled_clip(config: LossConfig, lag: Array) -> tuple[jax.Array, jax.Array]:
    """The ratio bounds ``[(1 - eps_lo)^(1 + k), (1 + eps_hi)^(1 + k)]`` of a token ``k`` versions
    stale: a clip of ``eps`` per update the policy made since the token was sampled, so a stale
    token's trust region around ``mu`` is the one the updates in between would each have had. At
    ``k = 0`` (on-policy) exactly PPO's ``[1 - eps_lo, 1 + eps_hi]``."""
    steps = 1.0 + jnp.maximum(jnp.asarray(lag, jnp.float32), 0.0)
    return (1.0 - config.clip_low) ** steps, (1.0 + config.clip_high) ** steps


def episode_weights(log_ratio: Array, mask: Array, sequence_ids: Array, cap: float) -> jax.Array:
    """Each trained token's weight for the rest of its episode: the likelihood ratio of the
    episode's other sampled tokens, truncated to ``[1 / cap, cap]``,

        v_t = clip( prod_{s in episode(t), s != t} pi_theta(y_s) / mu(y_s), 1 / cap, cap ).

    An episode's return depends on every move in it, so ``A * r_t`` alone (PPO's per-token ratio)
    is the gradient of a surrogate whose states and continuation are the sampler's; with ``v_t``
    the episode is weighted as a whole, ``A * prod_s r_s`` (the trajectory's importance weight,
    Precup et al. 2000), which corrects both. On-policy every factor is ~1. The spread of the
    product grows with the episode's sampled tokens, so this is for episodes of a few decisions
    (a move per turn), not for long generations. No gradient; 1 off ``mask``."""
    on = jnp.asarray(mask) > 0
    log_w = jnp.where(on, jax.lax.stop_gradient(jnp.asarray(log_ratio)), 0.0)
    ids = jnp.asarray(sequence_ids)
    others = gather_segments(segment_sum(log_w, ids), ids) - log_w
    bound = float(np.log(cap))
    return jnp.where(on, jnp.exp(jnp.clip(others, -bound, bound)), 1.0)

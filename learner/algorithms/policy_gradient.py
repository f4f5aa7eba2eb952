"""Policy-gradient objectives: GRPO, GSPO and PPO with their clipped surrogate, the KL penalty,
the entropy bonus and the stuck groups' unlikelihood term."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from stoker.learner.algorithms.config import LOG_RATIO_LIMIT, Array, LossConfig
from stoker.learner.algorithms.ops import (
    check_rank,
    check_same_shape,
    exp_log_ratio,
    gather_segments,
    segment_sum,
)
from stoker.learner.algorithms.off_policy import (
    Total,
    episode_weights,
    lag_scaled_clip,
    one_shard,
    second_moment_mask,
)
from stoker.learner.algorithms.token_weights import truncated_importance_weights


def _clipped_surrogate(
    ratio: jax.Array, advantages: jax.Array, config: LossConfig, bounds: tuple[Array, Array] | None = None
) -> jax.Array:
    """min(r A, clip(r, low, high) A) (Schulman et al. 2017, eq. 7), dual-clipped; ``bounds``
    (low, high) default to PPO's ``1 - eps_low, 1 + eps_high``.

    For A < 0 the surrogate is also bounded below by ``dual_clip * A`` (Ye et al. 2020, "Mastering
    complex control in MOBA games"), so a token the policy now strongly prefers but the data says
    was bad contributes at most ``dual_clip`` times its advantage instead of an unbounded ratio.
    """
    low, high = bounds if bounds is not None else (1.0 - config.clip_low, 1.0 + config.clip_high)
    surrogate = jnp.minimum(ratio * advantages, jnp.clip(ratio, low, high) * advantages)
    return jnp.where(advantages < 0, jnp.maximum(surrogate, config.dual_clip * advantages), surrogate)


def _ratio_bounds(config: LossConfig, lag: Array | None) -> tuple[Array, Array]:
    """The clip of the chosen off-policy correction: a lag-scaled one, none at all (m2po: its
    token mask is the trust region), or PPO's."""
    if config.off_policy == "lag-clip":
        if lag is None:
            raise ValueError("offPolicyCorrection lag-clip needs each token's lag")
        return lag_scaled_clip(config, lag)
    if config.off_policy == "m2po":
        return 0.0, jnp.inf
    return 1.0 - config.clip_low, 1.0 + config.clip_high


def stuck_unlikelihood(log_not_taken: Array, advantages: Array) -> jax.Array:
    """Per-token loss that pushes a stuck group's sampled tokens down (``advantages`` <= 0):

        l_t = A_t * log(1 - pi_theta(y_t))        d l_t / d z_y = -A_t * pi_theta(y_t)

    Unlikelihood training (Welleck et al. 2020, "Neural text generation with unlikelihood
    training") weighted by the advantage. The policy gradient's own push, -A_t * (1 - pi(y_t)) on
    the logit, and the entropy bonus's, ~pi log pi, both vanish as the policy turns deterministic on
    the failing tokens; this one grows to -A_t there, so a saturated policy still gets a push, and
    it fades as pi(y_t) falls (by then the group's samples differ and GRPO's own signal takes over).
    """
    check_same_shape(log_not_taken=log_not_taken, advantages=advantages)
    return jnp.asarray(advantages) * jnp.asarray(log_not_taken)


def _with_stuck(
    per_token: jax.Array, advantages: jax.Array, stuck: Array | None, log_not_taken: Array | None
) -> jax.Array:
    """``per_token`` with the ``stuck`` tokens' loss replaced by ``stuck_unlikelihood``."""
    if stuck is None:
        return per_token
    if log_not_taken is None:
        raise ValueError("stuck tokens need log_not_taken")
    check_same_shape(per_token=per_token, stuck=stuck)
    return jnp.where(jnp.asarray(stuck) > 0, stuck_unlikelihood(log_not_taken, advantages), per_token)


def kl_k3(logprobs: Array, ref_logprobs: Array) -> jax.Array:
    """Per-token KL(pi_theta || pi_ref) estimator k3 = exp(q - p) - (q - p) - 1, q = log pi_ref, p = log pi_theta.

    Unbiased and always >= 0 (Schulman 2020, "Approximating KL divergence"), as in GRPO's eq. 4.
    q - p is clamped to +-``LOG_RATIO_LIMIT`` first: past it the penalty is constant (no gradient)
    instead of overflowing to inf.
    """
    delta = jnp.clip(jnp.asarray(ref_logprobs) - jnp.asarray(logprobs), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    return jnp.exp(delta) - delta - 1.0


def grpo_loss(
    logprobs: Array,
    old_logprobs: Array,
    behaviour_logprobs: Array,
    advantages: Array,
    weights: Array,
    config: LossConfig,
    *,
    ref_logprobs: Array | None = None,
    entropy: Array | None = None,
    stuck: Array | None = None,
    log_not_taken: Array | None = None,
    lag: Array | None = None,
    total: Total = one_shard,
    sequence_ids: Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO (Shao et al. 2024) with the decoupled truncated-IS correction, per token.

        l_t = - w_t * min(r_t A_t, clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t) + beta_KL * k3_t - c_H * H_t
        r_t = exp(log pi_theta - log pi_old),   w_t = min(pi_old / mu, cap)
        L   = sum_t weights_t * l_t

    ``config.off_policy`` "lag-clip" clips r_t to ``lag_scaled_clip`` of the token's ``lag``
    (versions since it was sampled); "m2po" drops the clip and keeps the surrogate only on the
    tokens ``second_moment_mask`` keeps (``total`` sums its budget over the shards); "episode"
    multiplies A_t by ``episode_weights``, the ratio of the rest of the token's episode (its
    ``sequence_ids``, then required).

    ``advantages`` is the episode's group-relative advantage broadcast to its tokens (see
    ``group_advantages``). ``ref_logprobs`` is required when ``config.kl_coef > 0``; ``entropy``
    (per-token entropy of pi_theta) when ``config.entropy_coef > 0``. Tokens where ``stuck`` > 0
    train by ``stuck_unlikelihood`` instead of the surrogate (``log_not_taken`` = log(1 - pi_theta(y_t))
    is then required). All inputs are [B, T].
    """
    check_rank("logprobs", logprobs, 2)
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs,
        advantages=advantages, weights=weights,
    )
    weights = jnp.asarray(weights)
    mask = weights > 0
    is_w, stats = truncated_importance_weights(
        old_logprobs, behaviour_logprobs, mask, config.importance_cap, config.importance_correction
    )
    log_ratio = jnp.asarray(logprobs) - jax.lax.stop_gradient(jnp.asarray(old_logprobs))
    ratio = exp_log_ratio(log_ratio)
    adv = jnp.asarray(advantages)
    if config.off_policy == "episode":
        if sequence_ids is None:
            raise ValueError("offPolicyCorrection episode needs each token's sequence_ids")
        rest = episode_weights(jnp.asarray(logprobs) - jnp.asarray(behaviour_logprobs), mask, sequence_ids,
                               config.episode_cap)
        adv = adv * rest
        stats["episode_w_sum"] = jnp.sum(jnp.where(mask, rest, 0.0))
        stats["episode_w_capped"] = jnp.sum((mask & (jnp.abs(jnp.log(rest)) >= np.log(config.episode_cap) - 1e-6))
                                            .astype(jnp.float32))
    bounds = _ratio_bounds(config, lag)
    surrogate = _clipped_surrogate(ratio, adv, config, bounds)
    if config.off_policy == "m2po":
        kept = second_moment_mask(log_ratio, mask, config.m2po_budget, total)
        surrogate = kept * surrogate
        stats["m2_masked"] = jnp.sum(mask.astype(jnp.float32) - kept)
    per_token = _with_stuck(-is_w * surrogate, adv, stuck, log_not_taken)
    stats["pg_loss"] = jnp.sum(weights * per_token)
    clipped = mask & ((ratio < bounds[0]) | (ratio > bounds[1]))
    stats["ratio_clipped"] = jnp.sum(clipped.astype(jnp.float32))
    per_token = per_token + _kl_and_entropy(logprobs, weights, config, ref_logprobs, entropy, stats)
    loss = jnp.sum(weights * per_token)
    return loss, stats


def _kl_and_entropy(
    logprobs: Array,
    weights: jax.Array,
    config: LossConfig,
    ref_logprobs: Array | None,
    entropy: Array | None,
    stats: dict[str, jax.Array],
) -> jax.Array:
    """The per-token KL penalty minus entropy bonus, with their weighted means added to ``stats``."""
    extra = jnp.zeros(jnp.shape(logprobs), jnp.float32)
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
        kl = kl_k3(logprobs, ref_logprobs)
        stats["kl"] = jnp.sum(weights * jax.lax.stop_gradient(kl))
        extra = extra + config.kl_coef * kl
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        check_same_shape(logprobs=logprobs, entropy=entropy)
        stats["entropy"] = jnp.sum(weights * jax.lax.stop_gradient(jnp.asarray(entropy)))
        extra = extra - config.entropy_coef * jnp.asarray(entropy)
    return extra


def gspo_loss(
    logprobs: Array,
    old_logprobs: Array,
    behaviour_logprobs: Array,
    advantages: Array,
    weights: Array,
    sequence_ids: Array,
    config: LossConfig,
    *,
    ref_logprobs: Array | None = None,
    entropy: Array | None = None,
    stuck: Array | None = None,
    log_not_taken: Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): a sequence-level ratio.

        s_i = exp( (1/|y_i|) sum_t log(pi_theta(y_i,t) / pi_old(y_i,t)) )
        l_i = - w_i * min(s_i A_i, clip(s_i, 1 - eps_lo, 1 + eps_hi) A_i)
        w_i = min( exp( (1/|y_i|) sum_t log(pi_old / mu) ), cap )        (sequence-level truncated IS)
        L   = sum_t weights_t * l_{i(t)}

    With "sequence-mean" weights this is exactly the paper's (1/G) sum_i l_i; the geometric-mean IS
    weight is the sequence-level analogue of GSPO's own ratio. |y_i| counts the trained tokens of
    sequence i. KL and entropy terms, when enabled, stay per token as in GRPO, and so does the
    ``stuck`` unlikelihood term (``grpo_loss``).
    """
    check_rank("logprobs", logprobs, 2)
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs,
        advantages=advantages, weights=weights, sequence_ids=sequence_ids,
    )
    weights = jnp.asarray(weights)
    ids = jnp.asarray(sequence_ids)
    mask = (weights > 0).astype(jnp.float32)
    logp = jnp.asarray(logprobs)
    old = jax.lax.stop_gradient(jnp.asarray(old_logprobs))
    length = jnp.maximum(segment_sum(mask, ids), 1.0)
    mean_log_ratio = segment_sum(mask * (logp - old), ids) / length
    seq_ratio = gather_segments(exp_log_ratio(mean_log_ratio), ids)
    mean_log_rho = jax.lax.stop_gradient(segment_sum(mask * (old - jnp.asarray(behaviour_logprobs)), ids) / length)
    rho = gather_segments(exp_log_ratio(mean_log_rho), ids)
    is_w = jnp.minimum(rho, config.importance_cap) if config.importance_correction else jnp.ones_like(rho)
    on = mask > 0
    adv = jnp.asarray(advantages)
    per_token = _with_stuck(-is_w * _clipped_surrogate(seq_ratio, adv, config), adv, stuck, log_not_taken)
    stats: dict[str, jax.Array] = {
        "is_weight_sum": jnp.sum(jnp.where(on, rho, 0.0)),
        "is_weight_max": jnp.max(jnp.where(on, rho, 0.0)),
        "is_clipped": jnp.sum(jnp.where(on & (rho > config.importance_cap), 1.0, 0.0)),
        "is_tokens": jnp.sum(mask),
        "pg_loss": jnp.sum(weights * per_token),
        "ratio_clipped": jnp.sum(
            jnp.where(on & ((seq_ratio < 1 - config.clip_low) | (seq_ratio > 1 + config.clip_high)), 1.0, 0.0)
        ),
    }
    per_token = per_token + _kl_and_entropy(logprobs, weights, config, ref_logprobs, entropy, stats)
    return jnp.sum(weights * per_token), stats


def ppo_loss(
    logprobs: Array,
    old_logprobs: Array,
    behaviour_logprobs: Array,
    advantages: Array,
    values: Array,
    returns: Array,
    weights: Array,
    config: LossConfig,
    *,
    ref_logprobs: Array | None = None,
    entropy: Array | None = None,
    lag: Array | None = None,
    total: Total = one_shard,
    sequence_ids: Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip with a learned value function (Schulman et al. 2017, eq. 9), truncated IS, per token.

        l_t = - w_t * min(r_t A_t, clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t) + c_V * 1/2 (V_t - R_t)^2
              + beta_KL * k3_t - c_H * H_t

    ``advantages`` and ``returns`` come from ``gae`` (no gradient); ``values`` is the value head's
    output with gradient. The IS weight corrects the policy term only: the value regression target
    already comes from the same off-policy data and is not reweighted (as in IMPALA's baseline loss
    without V-trace). All inputs [B, T].
    """
    check_rank("logprobs", logprobs, 2)
    check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs,
        advantages=advantages, values=values, returns=returns, weights=weights,
    )
    pg, stats = grpo_loss(
        logprobs, old_logprobs, behaviour_logprobs, advantages, weights, config,
        ref_logprobs=ref_logprobs, entropy=entropy, lag=lag, total=total, sequence_ids=sequence_ids,
    )
    weights = jnp.asarray(weights)
    value_err = jnp.asarray(values) - jax.lax.stop_gradient(jnp.asarray(returns))
    value_loss = jnp.sum(weights * 0.5 * value_err**2)
    stats["value_loss"] = value_loss
    return pg + config.value_coef * value_loss, stats

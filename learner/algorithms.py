"""RL objectives as pure functions of per-token arrays (GRPO, PPO, GSPO, DPO).

Every function here is pure and shape-checked on entry, works on plain arrays with or without
``jax.jit``, and takes arrays laid out the way ``stoker.learner.packing`` lays out a micro-batch:
``[B, T]`` rows of packed sequences, aligned to the *targets* (position ``t`` holds the token
predicted from inputs ``<= t``). Conventions shared by all of them:

``logprobs``
    log pi_theta(y_t | y_<t) under the parameters being differentiated.
``old_logprobs``
    log pi_old, the policy the clipped ratio is taken against, chosen by ``LossConfig.off_policy``:

    "clip" (the default)
        pi_old = mu, the behaviour policy: the standard PPO surrogate on the sampled data, so the
        ratio ``pi_theta / mu`` is itself the importance weight, and clipping it is a trust region
        around the policy that generated the tokens, however many versions ago that was. Tokens the
        policy has already moved far enough toward (A > 0, ratio > 1 + eps) or away from (A < 0,
        ratio < 1 - eps) give no gradient, so stale data cannot push a move past where its
        evidence holds -- the overshoot that makes stale GRPO oscillate. Negative-advantage tokens
        whose ratio grew beyond ``dual_clip`` are bounded by dual clipping (Ye et al. 2020). The
        separate weight below is then ``min(mu / mu, cap) = 1``.
    "decoupled"
        pi_old = the parameters being trained, held fixed (``stop_gradient(logprobs)``), times the
        truncated weight below: the *decoupled* objective of Hilton et al. 2021 ("Batch
        size-invariance for policy optimization") as used by AReaL (Fu et al. 2025). The learner
        makes one optimizer update per batch, so the ratio is 1 where the gradient is taken, the
        clip never binds, and nothing limits how far stale data moves the policy (measured: worse
        than "clip" on stale FrozenLake data, benchmarks/README.md).
    "none"
        pi_old = the parameters being trained and no weight: plain policy gradient on stale data.
``behaviour_logprobs``
    log mu, what the actor's sampler reported when it generated the token (possibly several policy
    versions ago). The separate truncated importance weight is ``w = min(pi_old / mu, cap)``
    (IMPALA's truncation, Espeholt et al. 2018), with no gradient through ``w``. DPO has no ratio to
    clip, so the trainer always passes pi_old = the current parameters to it and the weight applies
    unless ``off_policy`` is "none".
``weights``
    per-token aggregation weights; zero on environment/template tokens, padding and stale tokens,
    so those never train. ``aggregation_weights`` builds them for "token-mean" and
    "sequence-mean"; the learner builds them over the whole batch so that gradient accumulation
    over several micro-batches sums to exactly the full-batch loss.
``sequence_ids``
    int32, a batch-unique id per packed sequence (any value on padding, whose weight is 0), used
    for sequence-level reductions (GSPO's ratio, DPO's pair log-likelihoods, sequence-mean).

Each loss returns ``(loss, stats)``: ``stats`` holds *sums* and *counts* (never means), so stats of
several micro-batches add up; ``finalize_stats`` turns them into means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

Array = Any  # a jax.Array or np.ndarray; both are accepted everywhere
Aggregation = Literal["token-mean", "sequence-mean"]
OffPolicy = Literal["clip", "decoupled", "none"]
AdvantageNormalization = Literal["population-std", "sample-std", "none"]

# Every log-ratio (pi/mu, pi/pi_old, pi_ref/pi) is clamped to +-LOG_RATIO_LIMIT before exp. exp
# overflows float32 past 88.7, and then even the branch a min/max/where did not select turns its
# zero cotangent into 0 * inf = NaN. e^20 ~ 4.9e8 is far past any clip range, dual clip or
# importance cap, so a token clamped here is one those have already stopped from training.
LOG_RATIO_LIMIT = 20.0


@dataclass(frozen=True)
class LossConfig:
    """Hyperparameters of the objectives (hashable, so it can be a static jit argument)."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    off_policy: OffPolicy = "clip"
    importance_cap: float = 2.0
    dual_clip: float = 3.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    gamma: float = 1.0
    gae_lambda: float = 0.95
    dpo_beta: float = 0.1

    @property
    def importance_correction(self) -> bool:
        """Whether ``w = min(pi_old / mu, cap)`` multiplies the loss (every mode but "none")."""
        return self.off_policy != "none"

    def clips_against_behaviour(self, algorithm: str) -> bool:
        """Whether the trainer passes mu as ``old_logprobs`` (see the module docstring)."""
        return self.off_policy == "clip" and algorithm != "dpo"


# ----------------------------------------------------------------------------------- helpers


def _check_same_shape(**arrays: Array) -> tuple[int, ...]:
    """All arrays share one shape; a ValueError naming the odd one out otherwise."""
    items = list(arrays.items())
    first_name, first = items[0]
    shape = tuple(np.shape(first))
    for name, value in items[1:]:
        if tuple(np.shape(value)) != shape:
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}; expected {shape} like {first_name}")
    return shape


def _check_rank(name: str, value: Array, rank: int) -> None:
    if np.ndim(value) != rank:
        raise ValueError(f"{name} has rank {np.ndim(value)} (shape {np.shape(value)}); expected rank {rank}")


def _xp(*arrays: Array) -> Any:
    """numpy for host arrays, jax.numpy for device arrays and tracers."""
    return jnp if any(isinstance(a, jax.Array) for a in arrays) else np


def _segment_sum(values: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Sums per segment id; ids index a table as large as the input, so any id < size is valid."""
    return jax.ops.segment_sum(values.reshape(-1), segment_ids.reshape(-1), num_segments=values.size)


def _gather(table: jax.Array, segment_ids: jax.Array) -> jax.Array:
    return table[segment_ids.reshape(-1)].reshape(segment_ids.shape)


def exp_log_ratio(log_ratio: Array) -> jax.Array:
    """exp(clip(log_ratio, -L, L)), L = ``LOG_RATIO_LIMIT``: finite values and gradients everywhere
    (the gradient is 0 where the clamp binds)."""
    return jnp.exp(jnp.clip(jnp.asarray(log_ratio), -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))


def aggregation_weights(mask: Array, sequence_ids: Array, mode: Aggregation) -> Array:
    """Per-token weights that turn a per-token loss into its aggregate by a weighted sum.

    token-mean:     w_t = m_t / sum_t' m_t'                   (every trained token counts once)
    sequence-mean:  w_t = m_t / (|S| * sum_{t' in s(t)} m_t')  (every sequence counts once; |S| the
                    number of sequences with at least one trained token)

    ``mask`` is 0/1 (float or bool), shape [B, T]. The weights sum to 1 (or 0 when nothing trains).
    Works on numpy arrays (the learner's host side) and jax arrays alike.
    """
    _check_rank("mask", mask, 2)
    _check_same_shape(mask=mask, sequence_ids=sequence_ids)
    xp = _xp(mask, sequence_ids)
    m = xp.asarray(mask, dtype=xp.float32)
    if mode == "token-mean":
        return m / xp.maximum(m.sum(), 1.0)
    if mode != "sequence-mean":
        raise ValueError(f"aggregation {mode!r}; expected 'token-mean' or 'sequence-mean'")
    ids = xp.asarray(sequence_ids).reshape(-1)
    flat = m.reshape(-1)
    counts: Array = (
        np.bincount(ids, weights=flat, minlength=flat.size).astype(np.float32)
        if xp is np
        else jax.ops.segment_sum(flat, ids, num_segments=flat.size)
    )
    num_sequences = xp.maximum((counts > 0).sum(), 1)
    per_token = counts[ids].reshape(m.shape)
    return xp.where(m > 0, m / (xp.maximum(per_token, 1.0) * num_sequences), 0.0).astype(xp.float32)


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
    _check_rank("rewards", rewards, 2)
    _check_same_shape(rewards=rewards, valid=valid)
    ddof = {"population-std": 0.0, "sample-std": 1.0, "none": None}
    if normalization not in ddof:
        raise ValueError(f"normalization {normalization!r}; expected one of {', '.join(ddof)}")
    xp = _xp(rewards, valid)
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


# ------------------------------------------------------------------------ off-policy correction


def truncated_importance_weights(
    old_logprobs: Array, behaviour_logprobs: Array, mask: Array, cap: float, enabled: bool = True
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token truncated importance weights against the behaviour (sampling) policy.

        rho_t = pi_old(y_t) / mu(y_t) = exp(log pi_old - log mu),   w_t = min(rho_t, cap)

    (IMPALA's truncated rho, Espeholt et al. 2018). No gradient flows through ``w``. Returns the
    weights (1 off the mask, or everywhere when ``enabled`` is False) and sums for the metrics:
    ``is_weight_sum`` / ``is_weight_max`` of the untruncated rho, ``is_clipped`` (tokens whose rho
    exceeded the cap), ``is_tokens``.
    """
    _check_same_shape(old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    on = jnp.asarray(mask) > 0
    log_rho = jnp.where(on, jax.lax.stop_gradient(jnp.asarray(old_logprobs)) - jnp.asarray(behaviour_logprobs), 0.0)
    rho = exp_log_ratio(log_rho)
    weights = jnp.minimum(rho, cap) if enabled else jnp.ones_like(rho)
    stats = {
        "is_weight_sum": jnp.sum(jnp.where(on, rho, 0.0)),
        "is_weight_max": jnp.max(jnp.where(on, rho, 0.0)),
        "is_clipped": jnp.sum(jnp.where(on & (rho > cap), 1.0, 0.0)),
        "is_tokens": jnp.sum(on.astype(jnp.float32)),
    }
    return jax.lax.stop_gradient(jnp.where(on, weights, 1.0)), stats


def sampler_trainer_logprob_stats(
    trainer_logprobs: Array, behaviour_logprobs: Array, versions: Array, mask: Array, trainer_version: Array
) -> dict[str, jax.Array]:
    """The TiTO consistency check: trainer minus sampler log-probs on same-version tokens.

    On tokens the actor sampled with exactly the parameters the trainer holds (``versions ==
    trainer_version``), both sides compute log pi(y_t) of the same token with the same weights, so
    ``d_t = log pi_trainer - log mu`` should be ~0; a mean or spread away from 0 means token-in /
    token-out drifted (re-tokenisation, a chat template mismatch, a sampler temperature not
    accounted for). Returns sums (``tito_sum``, ``tito_sumsq``, ``tito_tokens``) for the mean and
    std.
    """
    _check_same_shape(trainer_logprobs=trainer_logprobs, behaviour_logprobs=behaviour_logprobs, versions=versions, mask=mask)
    same = (jnp.asarray(mask) > 0) & (jnp.asarray(versions) == trainer_version)
    diff = jnp.where(same, jax.lax.stop_gradient(jnp.asarray(trainer_logprobs)) - jnp.asarray(behaviour_logprobs), 0.0)
    return {"tito_sum": diff.sum(), "tito_sumsq": (diff**2).sum(), "tito_tokens": same.sum().astype(jnp.float32)}


def stale_tokens(versions: Array, mask: Array, current_version: int, max_staleness: int) -> Array:
    """Model tokens sampled more than ``max_staleness`` versions before ``current_version``.

    The learner zeroes these out of the loss weights before anything else, so data past
    ``buffer.maxStaleness`` never reaches the loss. Works on numpy and jax arrays.
    """
    _check_same_shape(versions=versions, mask=mask)
    return (mask > 0) & ((current_version - versions) > max_staleness)


# ------------------------------------------------------------------------------------- losses


def _clipped_surrogate(ratio: jax.Array, advantages: jax.Array, config: LossConfig) -> jax.Array:
    """min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) (Schulman et al. 2017, eq. 7), dual-clipped.

    For A < 0 the surrogate is also bounded below by ``dual_clip * A`` (Ye et al. 2020, "Mastering
    complex control in MOBA games"), so a token the policy now strongly prefers but the data says
    was bad contributes at most ``dual_clip`` times its advantage instead of an unbounded ratio.
    """
    surrogate = jnp.minimum(
        ratio * advantages, jnp.clip(ratio, 1.0 - config.clip_low, 1.0 + config.clip_high) * advantages
    )
    return jnp.where(advantages < 0, jnp.maximum(surrogate, config.dual_clip * advantages), surrogate)


def stuck_unlikelihood(log_not_taken: Array, advantages: Array) -> jax.Array:
    """Per-token loss that pushes a stuck group's sampled tokens down (``advantages`` <= 0):

        l_t = A_t * log(1 - pi_theta(y_t))        d l_t / d z_y = -A_t * pi_theta(y_t)

    Unlikelihood training (Welleck et al. 2020, "Neural text generation with unlikelihood
    training") weighted by the advantage. The policy gradient's own push, -A_t * (1 - pi(y_t)) on
    the logit, and the entropy bonus's, ~pi log pi, both vanish as the policy turns deterministic on
    the failing tokens; this one grows to -A_t there, so a saturated policy still gets a push, and
    it fades as pi(y_t) falls (by then the group's samples differ and GRPO's own signal takes over).
    """
    _check_same_shape(log_not_taken=log_not_taken, advantages=advantages)
    return jnp.asarray(advantages) * jnp.asarray(log_not_taken)


def _with_stuck(
    per_token: jax.Array, advantages: jax.Array, stuck: Array | None, log_not_taken: Array | None
) -> jax.Array:
    """``per_token`` with the ``stuck`` tokens' loss replaced by ``stuck_unlikelihood``."""
    if stuck is None:
        return per_token
    if log_not_taken is None:
        raise ValueError("stuck tokens need log_not_taken")
    _check_same_shape(per_token=per_token, stuck=stuck)
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO (Shao et al. 2024) with the decoupled truncated-IS correction, per token.

        l_t = - w_t * min(r_t A_t, clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t) + beta_KL * k3_t - c_H * H_t
        r_t = exp(log pi_theta - log pi_old),   w_t = min(pi_old / mu, cap)
        L   = sum_t weights_t * l_t

    ``advantages`` is the episode's group-relative advantage broadcast to its tokens (see
    ``group_advantages``). ``ref_logprobs`` is required when ``config.kl_coef > 0``; ``entropy``
    (per-token entropy of pi_theta) when ``config.entropy_coef > 0``. Tokens where ``stuck`` > 0
    train by ``stuck_unlikelihood`` instead of the surrogate (``log_not_taken`` = log(1 - pi_theta(y_t))
    is then required). All inputs are [B, T].
    """
    _check_rank("logprobs", logprobs, 2)
    _check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs,
        advantages=advantages, weights=weights,
    )
    weights = jnp.asarray(weights)
    mask = weights > 0
    is_w, stats = truncated_importance_weights(
        old_logprobs, behaviour_logprobs, mask, config.importance_cap, config.importance_correction
    )
    ratio = exp_log_ratio(jnp.asarray(logprobs) - jax.lax.stop_gradient(jnp.asarray(old_logprobs)))
    adv = jnp.asarray(advantages)
    per_token = _with_stuck(-is_w * _clipped_surrogate(ratio, adv, config), adv, stuck, log_not_taken)
    stats["pg_loss"] = jnp.sum(weights * per_token)
    clipped = mask & ((ratio < 1.0 - config.clip_low) | (ratio > 1.0 + config.clip_high))
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
        _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
        kl = kl_k3(logprobs, ref_logprobs)
        stats["kl"] = jnp.sum(weights * jax.lax.stop_gradient(kl))
        extra = extra + config.kl_coef * kl
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs entropy")
        _check_same_shape(logprobs=logprobs, entropy=entropy)
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
    _check_rank("logprobs", logprobs, 2)
    _check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs,
        advantages=advantages, weights=weights, sequence_ids=sequence_ids,
    )
    weights = jnp.asarray(weights)
    ids = jnp.asarray(sequence_ids)
    mask = (weights > 0).astype(jnp.float32)
    logp = jnp.asarray(logprobs)
    old = jax.lax.stop_gradient(jnp.asarray(old_logprobs))
    length = jnp.maximum(_segment_sum(mask, ids), 1.0)
    mean_log_ratio = _segment_sum(mask * (logp - old), ids) / length
    seq_ratio = _gather(exp_log_ratio(mean_log_ratio), ids)
    mean_log_rho = jax.lax.stop_gradient(_segment_sum(mask * (old - jnp.asarray(behaviour_logprobs)), ids) / length)
    rho = _gather(exp_log_ratio(mean_log_rho), ids)
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
    _check_rank("rewards", rewards, 2)
    _check_same_shape(rewards=rewards, values=values, mask=mask, segment_ids=segment_ids)
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO-clip with a learned value function (Schulman et al. 2017, eq. 9), truncated IS, per token.

        l_t = - w_t * min(r_t A_t, clip(r_t, 1 - eps_lo, 1 + eps_hi) A_t) + c_V * 1/2 (V_t - R_t)^2
              + beta_KL * k3_t - c_H * H_t

    ``advantages`` and ``returns`` come from ``gae`` (no gradient); ``values`` is the value head's
    output with gradient. The IS weight corrects the policy term only: the value regression target
    already comes from the same off-policy data and is not reweighted (as in IMPALA's baseline loss
    without V-trace). All inputs [B, T].
    """
    _check_rank("logprobs", logprobs, 2)
    _check_same_shape(
        logprobs=logprobs, old_logprobs=old_logprobs, behaviour_logprobs=behaviour_logprobs,
        advantages=advantages, values=values, returns=returns, weights=weights,
    )
    pg, stats = grpo_loss(
        logprobs, old_logprobs, behaviour_logprobs, advantages, weights, config,
        ref_logprobs=ref_logprobs, entropy=entropy,
    )
    weights = jnp.asarray(weights)
    value_err = jnp.asarray(values) - jax.lax.stop_gradient(jnp.asarray(returns))
    value_loss = jnp.sum(weights * 0.5 * value_err**2)
    stats["value_loss"] = value_loss
    return pg + config.value_coef * value_loss, stats


def dpo_loss(
    logprobs: Array,
    ref_logprobs: Array,
    old_logprobs: Array,
    behaviour_logprobs: Array,
    behaviour_known: Array,
    mask: Array,
    pair_ids: Array,
    pair_sign: Array,
    config: LossConfig,
    *,
    num_pairs: Array | float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """DPO (Rafailov et al. 2023, eq. 7) over chosen/rejected pairs packed as two sequences each.

        h_p = beta * [ (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l)) ]
        L   = (1/P) sum_p - w_p * log sigmoid(h_p)

    log pi(y) sums the masked (response) tokens of a sequence. ``pair_ids`` gives each token its
    pair, ``pair_sign`` +1 on the chosen and -1 on the rejected sequence (0 on padding). ``w_p`` is
    the truncated geometric-mean IS weight of the pair's tokens,
    ``min(exp(mean_t log(pi_old / mu)), cap)``, over the tokens whose sampler log-prob is known
    (``behaviour_known``; a dataset pair has none, so its weight is 1). ``num_pairs`` is the
    normaliser P (the whole batch's pair count under gradient accumulation; this micro-batch's when
    None).
    """
    _check_rank("logprobs", logprobs, 2)
    _check_same_shape(
        logprobs=logprobs, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs,
        behaviour_logprobs=behaviour_logprobs, behaviour_known=behaviour_known, mask=mask,
        pair_ids=pair_ids, pair_sign=pair_sign,
    )
    m = (jnp.asarray(mask) > 0).astype(jnp.float32)
    ids = jnp.asarray(pair_ids)
    sign = jnp.asarray(pair_sign, jnp.float32)
    log_ratio = jnp.asarray(logprobs) - jax.lax.stop_gradient(jnp.asarray(ref_logprobs))
    margin = config.dpo_beta * _segment_sum(m * sign * log_ratio, ids)
    has_chosen = _segment_sum(m * (sign > 0), ids) > 0
    has_rejected = _segment_sum(m * (sign < 0), ids) > 0
    present = has_chosen & has_rejected
    known = m * (jnp.asarray(behaviour_known) > 0)
    log_rho_tok = known * (jax.lax.stop_gradient(jnp.asarray(old_logprobs)) - jnp.asarray(behaviour_logprobs))
    log_rho = _segment_sum(log_rho_tok, ids) / jnp.maximum(_segment_sum(known, ids), 1.0)
    rho = exp_log_ratio(jax.lax.stop_gradient(log_rho))
    is_w = jnp.minimum(rho, config.importance_cap) if config.importance_correction else jnp.ones_like(rho)
    count = jnp.sum(present.astype(jnp.float32))
    denom = jnp.maximum(count if num_pairs is None else jnp.asarray(num_pairs, jnp.float32), 1.0)
    per_pair = jnp.where(present, -is_w * jax.nn.log_sigmoid(margin), 0.0)
    loss = jnp.sum(per_pair) / denom
    known_pairs = present & (_segment_sum(known, ids) > 0)
    stats = {
        "pg_loss": loss,
        "dpo_accuracy_sum": jnp.sum(jnp.where(present & (margin > 0), 1.0, 0.0)),
        "dpo_margin_sum": jnp.sum(jnp.where(present, jax.lax.stop_gradient(margin), 0.0)),
        "dpo_pairs": count,
        "is_weight_sum": jnp.sum(jnp.where(known_pairs, rho, 0.0)),
        "is_weight_max": jnp.max(jnp.where(known_pairs, rho, 0.0)),
        "is_clipped": jnp.sum(jnp.where(known_pairs & (rho > config.importance_cap), 1.0, 0.0)),
        "is_tokens": jnp.sum(known_pairs.astype(jnp.float32)),
    }
    return loss, stats


# -------------------------------------------------------------------------------------- stats

# Stats combined by maximum rather than sum (across micro-batches and shards).
MAX_STATS = frozenset({"is_weight_max", "staleness_max"})


def combine_stats(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Add two micro-batches' stats (maxima take the max)."""
    out = dict(a)
    for key, value in b.items():
        if key in out:
            out[key] = max(out[key], value) if key in MAX_STATS else out[key] + value
        else:
            out[key] = value
    return out


def finalize_stats(sums: dict[str, float]) -> dict[str, float]:
    """Turn summed stats into the reported metrics (means, fractions, std)."""
    out: dict[str, float] = {}
    for key in ("pg_loss", "value_loss", "kl", "entropy", "loss"):
        if key in sums:
            out[key] = float(sums[key])
    tokens = sums.get("is_tokens", 0.0)
    if tokens:
        out["is_weight_mean"] = sums["is_weight_sum"] / tokens
        out["is_weight_max"] = float(sums["is_weight_max"])
        out["is_clipped_fraction"] = sums["is_clipped"] / tokens
    if "ratio_clipped" in sums and sums.get("trained_tokens"):
        out["ratio_clipped_fraction"] = sums["ratio_clipped"] / sums["trained_tokens"]
    n = sums.get("tito_tokens", 0.0)
    if n:
        mean = sums["tito_sum"] / n
        out["tito_logprob_diff_mean"] = mean
        out["tito_logprob_diff_std"] = float(np.sqrt(max(sums["tito_sumsq"] / n - mean**2, 0.0)))
        out["tito_tokens"] = n
    if sums.get("dpo_pairs"):
        out["dpo_accuracy"] = sums["dpo_accuracy_sum"] / sums["dpo_pairs"]
        out["dpo_margin_mean"] = sums["dpo_margin_sum"] / sums["dpo_pairs"]
    return out

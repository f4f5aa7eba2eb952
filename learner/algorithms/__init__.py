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

The modules: ``config`` (``LossConfig`` and the types), ``advantages`` (GRPO's group advantage,
GAE), ``token_weights`` (aggregation and importance weights, stale tokens, the TiTO check),
``policy_gradient`` (GRPO, GSPO, PPO), ``dpo``, ``stats``; import from here.
"""

from __future__ import annotations

from stoker.learner.algorithms.advantages import gae, group_advantages
from stoker.learner.algorithms.config import (
    LOG_RATIO_LIMIT,
    AdvantageNormalization,
    Aggregation,
    Array,
    LossConfig,
    OffPolicy,
)
from stoker.learner.algorithms.dpo import dpo_loss
from stoker.learner.algorithms.ops import exp_log_ratio
from stoker.learner.algorithms.policy_gradient import grpo_loss, gspo_loss, kl_k3, ppo_loss, stuck_unlikelihood
from stoker.learner.algorithms.stats import MAX_STATS, combine_stats, finalize_stats
from stoker.learner.algorithms.token_weights import (
    aggregation_weights,
    sampler_trainer_logprob_stats,
    stale_tokens,
    truncated_importance_weights,
)

__all__ = [
    "AdvantageNormalization",
    "Aggregation",
    "Array",
    "LOG_RATIO_LIMIT",
    "LossConfig",
    "MAX_STATS",
    "OffPolicy",
    "aggregation_weights",
    "combine_stats",
    "dpo_loss",
    "exp_log_ratio",
    "finalize_stats",
    "gae",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_k3",
    "ppo_loss",
    "sampler_trainer_logprob_stats",
    "stale_tokens",
    "stuck_unlikelihood",
    "truncated_importance_weights",
]

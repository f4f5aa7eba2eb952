"""Training objectives as pure functions of per-token arrays (GRPO, PPO, GSPO, DPO, SFT, on-policy distillation).

Each function is pure, shape-checked on entry and works with or without ``jax.jit``, on arrays
laid out as ``stoker.learner.packing`` lays out a micro-batch; each loss returns ``(loss, stats)``
with summable stats. The conventions of every argument (``logprobs``, ``old_logprobs`` and the
``off_policy`` choice, ``behaviour_logprobs``, ``weights``, ``sequence_ids``) are in
docs/architecture.md, "Loss conventions".

The modules: ``config`` (``LossConfig`` and the types), ``advantages`` (GRPO's group advantage,
GAE), ``token_weights`` (aggregation and importance weights, stale tokens, the TiTO check),
``off_policy`` (the behaviour ratio's statistics, M2PO's mask, the lag-scaled clip, the rest
of the episode's ratio),
``policy_gradient`` (GRPO, GSPO, PPO), ``dpo``, ``sft``, ``distill``, ``stats``; import from here.
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
from stoker.learner.algorithms.distill import distill_loss
from stoker.learner.algorithms.dpo import dpo_loss
from stoker.learner.algorithms.off_policy import (
    behaviour_ratio_stats,
    episode_weights,
    lag_scaled_clip,
    second_moment_mask,
)
from stoker.learner.algorithms.ops import exp_log_ratio
from stoker.learner.algorithms.policy_gradient import grpo_loss, gspo_loss, kl_k3, ppo_loss, stuck_unlikelihood
from stoker.learner.algorithms.sft import sft_loss
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
    "behaviour_ratio_stats",
    "combine_stats",
    "distill_loss",
    "episode_weights",
    "dpo_loss",
    "exp_log_ratio",
    "finalize_stats",
    "gae",
    "group_advantages",
    "grpo_loss",
    "gspo_loss",
    "kl_k3",
    "lag_scaled_clip",
    "ppo_loss",
    "sampler_trainer_logprob_stats",
    "second_moment_mask",
    "sft_loss",
    "stale_tokens",
    "stuck_unlikelihood",
    "truncated_importance_weights",
]

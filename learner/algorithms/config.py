"""Types and hyperparameters shared by the objectives (``stoker.learner.algorithms``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Array = Any  # a jax.Array or np.ndarray; both are accepted everywhere
Aggregation = Literal["token-mean", "sequence-mean"]
OffPolicy = Literal["clip", "episode", "lag-clip", "m2po", "decoupled", "none"]
AdvantageNormalization = Literal["population-std", "sample-std", "none"]
Divergence = Literal["reverse_kl", "jsd"]  # distillation's per-token divergence to the teacher

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
    m2po_budget: float = 0.04  # off_policy "m2po": the kept tokens' mean (log pi/mu)^2
    episode_cap: float = 1.5  # off_policy "episode": the rest of the episode's ratio within [1/cap, cap]
    dual_clip: float = 3.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    value_coef: float = 0.5
    gamma: float = 1.0
    gae_lambda: float = 0.95
    dpo_beta: float = 0.1
    divergence: Divergence = "reverse_kl"
    jsd_beta: float = 0.5  # generalized JSD's mixture weight of the teacher (divergence "jsd")

    @property
    def importance_correction(self) -> bool:
        """Whether ``w = min(pi_old / mu, cap)`` multiplies the loss (every mode but "none")."""
        return self.off_policy != "none"

    def clips_against_behaviour(self, algorithm: str) -> bool:
        """Whether the trainer passes mu as ``old_logprobs`` (see ``stoker.learner.algorithms``):
        every correction whose ratio is taken against the sampler's policy."""
        return self.off_policy in ("clip", "episode", "lag-clip", "m2po") and algorithm != "dpo"

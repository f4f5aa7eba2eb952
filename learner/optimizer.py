"""The optimizer: Adam or AdamW after global-norm clipping, with a learning-rate schedule (optax).

The schedule counts optimizer updates -- the optimizer state's own step count, which checkpoints
keep and a skipped non-finite update does not advance (``train.Trainer``) -- so a resumed run
continues the schedule where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from stoker.spec import AlgorithmSpec

Schedule = Literal["constant", "cosine", "linear"]


@dataclass(frozen=True)
class OptimizerConfig:
    """The learning-rate schedule and AdamW weight decay (``spec.algorithm``), around the peak
    learning rate and gradient clip that ``make_optimizer`` takes."""

    schedule: Schedule = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0  # updates from the peak to the end of the decay, after the warmup
    min_learning_rate: float = 0.0  # where cosine/linear decay ends (and stays)
    weight_decay: float = 0.0

    @classmethod
    def from_spec(cls, algorithm: AlgorithmSpec, max_steps: int) -> OptimizerConfig:
        """The spec's schedule; the decay runs to ``max_steps`` unless ``decaySteps`` says otherwise."""
        schedule = algorithm.learning_rate_schedule
        decay = schedule.decay_steps if schedule.decay_steps is not None else max(max_steps - schedule.warmup_steps, 1)
        return cls(schedule.kind, schedule.warmup_steps, decay, schedule.min_learning_rate, algorithm.weight_decay)


def learning_rate_schedule(learning_rate: float, config: OptimizerConfig) -> optax.Schedule:
    """lr(t) over update count t: linear warmup from 0 to the peak over W steps, then

        constant:  lr(t) = peak
        linear:    lr(t) = peak + (min - peak) * min(t - W, D) / D
        cosine:    lr(t) = min + (peak - min) * (1 + cos(pi * min(t - W, D) / D)) / 2

    (cosine as in Loshchilov & Hutter 2017, SGDR, without restarts). D = ``decay_steps`` (>= 1)."""
    peak, low = learning_rate, config.min_learning_rate
    if config.schedule != "constant" and low > peak:
        raise ValueError(
            f"algorithm.learningRateSchedule.minLearningRate: got {low:g}; expected <= learningRate ({peak:g})"
        )
    decay_steps = max(config.decay_steps, 1)
    if config.schedule == "constant":
        after: optax.Schedule = optax.constant_schedule(peak)
    elif config.schedule == "linear":
        after = optax.linear_schedule(peak, low, decay_steps)
    elif config.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, decay_steps, alpha=low / peak)
    else:
        raise ValueError(f"schedule {config.schedule!r}; expected constant, cosine or linear")
    if config.warmup_steps <= 0:
        return after
    warmup = optax.linear_schedule(0.0, peak, config.warmup_steps)
    return optax.join_schedules([warmup, after], [config.warmup_steps])


def _decays(params: Any) -> Any:
    """Weight decay on matrices (projections, embeddings) only, never on norm scales or biases."""
    return jax.tree.map(lambda x: jnp.ndim(x) >= 2, params)


def make_optimizer(
    learning_rate: float, max_grad_norm: float, config: OptimizerConfig = OptimizerConfig()
) -> optax.GradientTransformation:
    """Adam after global-norm clipping (clipping first so one outlier batch cannot blow up Adam);
    AdamW (decoupled weight decay, Loshchilov & Hutter 2019) with the learning-rate schedule when
    ``config`` asks for either. The default is plain Adam at a constant rate, whose state is what
    checkpoints written before schedules existed hold."""
    clip = optax.clip_by_global_norm(max_grad_norm)
    if config.schedule == "constant" and config.warmup_steps <= 0 and config.weight_decay == 0:
        return optax.chain(clip, optax.adam(learning_rate))
    schedule = learning_rate_schedule(learning_rate, config)
    return optax.chain(clip, optax.adamw(schedule, weight_decay=config.weight_decay, mask=_decays))


def updates_applied(opt_state: Any) -> int:
    """How many updates the optimizer state has taken (Adam's own step count)."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    if not found:
        raise ValueError("the optimizer state holds no step count")
    return int(found[0][1])

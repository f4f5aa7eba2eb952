"""The optimizer: Adam or AdamW after global-norm clipping, with a learning-rate schedule (optax).

The schedule counts optimizer updates -- the optimizer state's own step count, which checkpoints
keep and a skipped non-finite update does not advance (``train.Trainer``) -- so a resumed run
continues the schedule where it stopped.

Adam's two moments are float32 by default (optax's own Adam); ``OptimizerConfig.state_dtype``
bfloat16 stores both in bfloat16 (``scale_by_adam_stored``), half the optimizer's memory, with
the same state tree, so a checkpoint of either restores into the other (cast on restore).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax

from stoker.spec import AlgorithmSpec

Schedule = Literal["constant", "cosine", "linear"]
StateDtype = Literal["float32", "bfloat16"]
# Adam's constants, optax's defaults (Kingma & Ba 2015's b1, b2, eps).
B1, B2, EPS = 0.9, 0.999, 1e-8


@dataclass(frozen=True)
class OptimizerConfig:
    """The learning-rate schedule and AdamW weight decay (``spec.algorithm``), around the peak
    learning rate and gradient clip that ``make_optimizer`` takes."""

    schedule: Schedule = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0  # updates from the peak to the end of the decay, after the warmup
    min_learning_rate: float = 0.0  # where cosine/linear decay ends (and stays)
    weight_decay: float = 0.0
    state_dtype: StateDtype = "float32"  # spec.learner.optimizerStateDtype: Adam's moments as stored

    @classmethod
    def from_spec(cls, algorithm: AlgorithmSpec, max_steps: int, state_dtype: StateDtype = "float32") -> OptimizerConfig:
        """The spec's schedule; the decay runs to ``max_steps`` unless ``decaySteps`` says otherwise."""
        schedule = algorithm.learning_rate_schedule
        decay = schedule.decay_steps if schedule.decay_steps is not None else max(max_steps - schedule.warmup_steps, 1)
        return cls(schedule.kind, schedule.warmup_steps, decay, schedule.min_learning_rate, algorithm.weight_decay,
                   state_dtype)


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


def scale_by_adam_stored(state_dtype: Any, b1: float = B1, b2: float = B2, eps: float = EPS) -> optax.GradientTransformation:
    """Adam's direction (Kingma & Ba 2015, Algorithm 1) with both moments stored in ``state_dtype``.

    Each update computes in float32 from the stored moments upcast, t = count + 1:
        m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
        update = m_hat / (sqrt(v_hat) + eps),   m_hat = m / (1 - b1^t),  v_hat = v / (1 - b2^t)
    and stores m and v rounded once to ``state_dtype``; the update uses them before rounding.
    The state is optax's ``ScaleByAdamState``, so its tree (and a checkpoint's names) is optax
    Adam's. bfloat16 resolves 2^-8 relative: with b2 = 0.999 a step moves v by 0.1%, so once v
    is settled (after ~500 updates) it no longer decays, only grows on a larger gradient: the
    denominator errs large and the step small, never large."""

    def init(params: Any) -> optax.ScaleByAdamState:
        zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), state_dtype), params)
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=zeros, nu=jax.tree.map(jnp.copy, zeros))

    def update(updates: Any, state: optax.ScaleByAdamState, params: Any = None) -> tuple[Any, optax.ScaleByAdamState]:
        del params
        g = jax.tree.map(lambda x: x.astype(jnp.float32), updates)
        m = jax.tree.map(lambda m, g: b1 * m.astype(jnp.float32) + (1 - b1) * g, state.mu, g)
        v = jax.tree.map(lambda v, g: b2 * v.astype(jnp.float32) + (1 - b2) * jnp.square(g), state.nu, g)
        count = optax.safe_int32_increment(state.count)
        t = count.astype(jnp.float32)
        # 1 - b^t as -expm1(t log b): 1 - 0.999^t in float32 would lose ~1e-5 to cancellation.
        m_correction, v_correction = -jnp.expm1(t * math.log(b1)), -jnp.expm1(t * math.log(b2))
        direction = jax.tree.map(lambda m, v: (m / m_correction) / (jnp.sqrt(v / v_correction) + eps), m, v)
        stored = optax.ScaleByAdamState(
            count=count,
            mu=jax.tree.map(lambda x: x.astype(state_dtype), m),
            nu=jax.tree.map(lambda x: x.astype(state_dtype), v),
        )
        return direction, stored

    return optax.GradientTransformation(init, update)


def make_optimizer(
    learning_rate: float, max_grad_norm: float, config: OptimizerConfig = OptimizerConfig()
) -> optax.GradientTransformation:
    """Adam after global-norm clipping (clipping first so one outlier batch cannot blow up Adam);
    AdamW (decoupled weight decay, Loshchilov & Hutter 2019) with the learning-rate schedule when
    ``config`` asks for either. The default is plain Adam at a constant rate, whose state is what
    checkpoints written before schedules existed hold. Float32 state is optax's Adam itself;
    another ``state_dtype`` swaps in ``scale_by_adam_stored`` at the same place in the chain
    (optax's adam/adamw are scale_by_adam, [add_decayed_weights,] scale_by_learning_rate)."""
    clip = optax.clip_by_global_norm(max_grad_norm)
    constant = config.schedule == "constant" and config.warmup_steps <= 0 and config.weight_decay == 0
    if config.state_dtype == "float32":
        if constant:
            return optax.chain(clip, optax.adam(learning_rate))
        schedule = learning_rate_schedule(learning_rate, config)
        return optax.chain(clip, optax.adamw(schedule, weight_decay=config.weight_decay, mask=_decays))
    if config.state_dtype != "bfloat16":
        raise ValueError(f"optimizer state dtype {config.state_dtype!r}; expected float32 or bfloat16")
    adam = scale_by_adam_stored(jnp.bfloat16)
    if constant:
        return optax.chain(clip, optax.chain(adam, optax.scale_by_learning_rate(learning_rate)))
    schedule = learning_rate_schedule(learning_rate, config)
    decay = optax.add_decayed_weights(config.weight_decay, _decays)
    return optax.chain(clip, optax.chain(adam, decay, optax.scale_by_learning_rate(schedule)))


def updates_applied(opt_state: Any) -> int:
    """How many updates the optimizer state has taken (Adam's own step count)."""
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
    if not found:
        raise ValueError("the optimizer state holds no step count")
    return int(found[0][1])

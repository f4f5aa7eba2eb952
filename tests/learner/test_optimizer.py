"""The learning-rate schedule and AdamW weight decay, against their equations, jit and eager."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from stoker.learner.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from stoker.spec import AlgorithmSpec

PEAK, LOW, WARMUP, DECAY = 0.1, 0.01, 4, 10


def expected_lr(t: int, kind: str) -> float:
    """The schedule written out: linear warmup 0 -> PEAK over WARMUP updates, then the decay."""
    if t < WARMUP:
        return PEAK * t / WARMUP
    done = min(t - WARMUP, DECAY) / DECAY
    if kind == "constant":
        return PEAK
    if kind == "linear":
        return PEAK + (LOW - PEAK) * done
    return LOW + (PEAK - LOW) * (1 + math.cos(math.pi * done)) / 2


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request: pytest.FixtureRequest) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return (lambda f: jax.jit(f)) if request.param else (lambda f: f)


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
def test_schedule_values(kind: str) -> None:
    schedule = learning_rate_schedule(PEAK, OptimizerConfig(kind, WARMUP, DECAY, LOW))  # type: ignore[arg-type]
    for t in range(WARMUP + DECAY + 3):
        assert float(schedule(t)) == pytest.approx(expected_lr(t, kind), rel=1e-6, abs=1e-9), t


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_the_optimizer_applies_the_schedule_and_weight_decay(kind: str, maybe_jit: Any) -> None:
    """Adam's step on a constant gradient g is exactly -lr_t * g / (|g| + eps) (both moments are
    bias-corrected to g and g^2), and AdamW adds -lr_t * wd * p on matrices only."""
    wd = 0.5
    optimizer = make_optimizer(PEAK, 100.0, OptimizerConfig(kind, WARMUP, DECAY, LOW, wd))  # type: ignore[arg-type]
    params = {"kernel": jnp.full((2, 3), 2.0), "scale": jnp.full((3,), 2.0)}
    grads = {"kernel": jnp.full((2, 3), 0.25), "scale": jnp.full((3,), -0.25)}

    @maybe_jit
    def step(p: Any, state: Any) -> tuple[Any, Any]:
        updates, state = optimizer.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    state = optimizer.init(params)
    kernel, scale = 2.0, 2.0
    sign = 0.25 / (0.25 + 1e-8)
    for t in range(WARMUP + DECAY + 2):
        params, state = step(params, state)
        lr = expected_lr(t, kind)
        kernel -= lr * (sign + wd * kernel)
        scale += lr * sign  # a 1-D leaf: no weight decay
        np.testing.assert_allclose(np.asarray(params["kernel"]), kernel, rtol=1e-5, err_msg=f"update {t}")
        np.testing.assert_allclose(np.asarray(params["scale"]), scale, rtol=1e-5, err_msg=f"update {t}")


def test_default_is_plain_adam_and_spec_sets_the_schedule() -> None:
    # The default keeps Adam's state layout, so checkpoints written before schedules still restore.
    plain = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    params = {"w": jnp.ones((2, 2))}
    same = jax.tree.structure(make_optimizer(1e-3, 1.0).init(params)) == jax.tree.structure(plain.init(params))
    assert same
    spec = AlgorithmSpec.model_validate(
        {"learningRateSchedule": {"kind": "cosine", "warmupSteps": 10, "minLearningRate": 1e-5}, "weightDecay": 0.01}
    )
    config = OptimizerConfig.from_spec(spec, max_steps=110)
    assert config == OptimizerConfig("cosine", 10, 100, 1e-5, 0.01)


def test_a_minimum_above_the_peak_is_refused() -> None:
    with pytest.raises(ValueError, match="minLearningRate"):
        make_optimizer(1e-3, 1.0, OptimizerConfig("cosine", 0, 10, 1e-2))


@pytest.mark.usefixtures("xla_cache")
def test_the_learner_reports_and_applies_the_scheduled_rate() -> None:
    """Warmup from 0: the first update's rate is 0, so it leaves the policy exactly as it was; the
    metrics report each update's rate as the schedule gives it."""
    import uuid

    from stoker.learner.batches import Group
    from stoker.learner.loop import Learner
    from stoker.learner.settings import LearnerSettings
    from stoker.learner.testing import tiny_spec
    from stoker.trajectory import Episode

    schedule = {"kind": "linear", "warmupSteps": 2, "decaySteps": 10, "minLearningRate": 0.0}
    spec = tiny_spec(learner={"sequenceBuckets": [8], "microbatchTokens": 64}, buffer={"groupSize": 4},
                     algorithm={"learningRate": 0.05, "learningRateSchedule": schedule})
    learner = Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None))

    def group() -> Group:
        return Group([
            Episode(
                episode_id=uuid.uuid4().hex, group_id="g", group_size=4, task_id="t",
                token_ids=np.asarray([1, 2, t], np.int32), loss_mask=np.asarray([0, 0, 1], np.uint8),
                logprobs=np.asarray([0, 0, -2.0], np.float32),
                policy_versions=np.asarray([-1, -1, learner.version], np.int32), reward=float(t == 3), status=1,
            )
            for t in (3, 4, 3, 5)
        ])

    before = jax.device_get(learner.trainer.params)
    rates = [learner.train_on([group()])["learning_rate"]]
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(learner.trainer.params)), strict=True):
        np.testing.assert_array_equal(x, y)
    rates += [learner.train_on([group()])["learning_rate"] for _ in range(3)]
    np.testing.assert_allclose(rates, [0.0, 0.025, 0.05, 0.045], rtol=1e-6)

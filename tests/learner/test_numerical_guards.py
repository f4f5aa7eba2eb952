"""Numerical guards: log-ratios past float32's exp range, non-finite gradients, advantage scale."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.learner import algorithms as alg
from stoker.learner.algorithms import LossConfig
from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import tiny_spec
from stoker.trajectory import Episode

HUGE = 100.0  # log(pi / mu) far past 88.7, where exp overflows float32


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request: pytest.FixtureRequest) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return (lambda f: jax.jit(f)) if request.param else (lambda f: f)


def a(*rows: list[float]) -> jax.Array:
    return jnp.asarray(rows, jnp.float32)


def test_grpo_huge_log_ratio_gives_finite_gradients(maybe_jit: Any) -> None:
    # Token 0: A > 0 and ratio e^100: the min selects the clipped branch, the unselected r*A branch
    # overflowed. Token 1: A < 0, ratio e^100: the dual clip selects dual_clip * A. Token 2: ratio 1.
    zeros = a([0.0, 0.0, 0.0])
    adv = a([1.0, -1.0, 2.0])
    weights = a([1 / 3, 1 / 3, 1 / 3])

    def loss(lp: jax.Array) -> jax.Array:
        return alg.grpo_loss(lp, zeros, zeros, adv, weights, LossConfig())[0]

    logp = a([HUGE, HUGE, 0.0])
    value = maybe_jit(loss)(logp)
    grad = maybe_jit(jax.grad(loss))(logp)
    assert np.isfinite(np.asarray(grad)).all(), grad
    # l = -(1/3) [1.2 * 1 + 3 * (-1) + r * 2]: only token 2's ratio (d r / d logp = r = 1) moves it.
    assert float(value) == pytest.approx(-(1.2 - 3.0 + 2.0) / 3, rel=1e-5)
    np.testing.assert_allclose(np.asarray(grad), [[0.0, 0.0, -2.0 / 3]], atol=1e-6)


def test_grpo_huge_behaviour_ratio_keeps_the_importance_weight_finite(maybe_jit: Any) -> None:
    # pi_old / mu = e^100 with the decoupled objective: the weight is the cap, the stats finite.
    mu = a([-HUGE, 0.0])
    logp = a([0.0, 0.0])
    cfg = LossConfig(off_policy="decoupled", importance_cap=2.0)

    def loss(lp: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        return alg.grpo_loss(lp, jax.lax.stop_gradient(lp), mu, a([1.0, 1.0]), a([0.5, 0.5]), cfg)

    (value, stats), grad = maybe_jit(jax.value_and_grad(loss, has_aux=True))(logp)
    assert all(np.isfinite(np.asarray(v)).all() for v in stats.values()), stats
    assert float(value) == pytest.approx(-(2.0 + 1.0) / 2, rel=1e-6)
    np.testing.assert_allclose(np.asarray(grad), [[-1.0, -0.5]], rtol=1e-6)


def test_gspo_huge_mean_log_ratio_gives_finite_gradients(maybe_jit: Any) -> None:
    # Sequence 0's mean log-ratio is 100 (clipped branch selected); sequence 1 sits at ratio 1.
    zeros = a([0.0, 0.0, 0.0, 0.0])
    ids = jnp.asarray([[0, 0, 1, 1]], jnp.int32)

    def loss(lp: jax.Array) -> jax.Array:
        return alg.gspo_loss(lp, zeros, zeros, a([1.0, 1.0, 1.0, 1.0]), a([0.25] * 4), ids, LossConfig())[0]

    logp = a([2 * HUGE, 0.0, 0.0, 0.0])
    grad = np.asarray(maybe_jit(jax.grad(loss))(logp))
    assert np.isfinite(grad).all(), grad
    # Sequence 1: L = -(0.25 + 0.25) s A, s = exp(mean log ratio), d s / d lp_t = s / 2 = 1/2 at s = 1.
    np.testing.assert_allclose(grad, [[0.0, 0.0, -0.25, -0.25]], atol=1e-6)


def test_kl_k3_huge_log_ratio_gives_finite_gradients(maybe_jit: Any) -> None:
    ref = a([HUGE, math.log(0.5)])
    logp = a([0.0, math.log(0.25)])
    grad = np.asarray(maybe_jit(jax.grad(lambda lp: jnp.sum(alg.kl_k3(lp, ref))))(logp))
    assert np.isfinite(grad).all(), grad
    # d k3 / d p = 1 - exp(q - p): 1 - 2 = -1 in range; 0 where the clamp binds.
    np.testing.assert_allclose(grad, [[0.0, -1.0]], atol=1e-5)
    # The KL path of the GRPO loss too (kl_coef > 0).
    zeros = a([0.0, 0.0])
    cfg = LossConfig(kl_coef=0.1)
    g = maybe_jit(jax.grad(lambda lp: alg.grpo_loss(lp, zeros, zeros, zeros, a([0.5, 0.5]), cfg, ref_logprobs=ref)[0]))
    assert np.isfinite(np.asarray(g(a([0.0, 0.0])))).all()


@pytest.mark.parametrize("normalization", ["population-std", "sample-std", "none"])
def test_group_advantage_normalisation_matches_the_equation(normalization: str, maybe_jit: Any) -> None:
    rewards = np.asarray([[1.0, 0.0, 0.0, 3.0, 9.0], [2.0, 5.0, 0.0, 0.0, 0.0]], np.float32)
    valid = np.asarray([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0]], np.float32)
    eps = 1e-6
    expected = np.zeros_like(rewards)
    for g, n in ((0, 4), (1, 2)):
        r = rewards[g, :n].astype(np.float64)
        centred = r - r.mean()
        if normalization == "population-std":
            centred = centred / (np.std(r, ddof=0) + eps)
        elif normalization == "sample-std":
            centred = centred / (np.std(r, ddof=1) + eps)
        expected[g, :n] = centred
    fn = maybe_jit(lambda r, v: alg.group_advantages(r, v, normalization=normalization))  # type: ignore[arg-type]
    np.testing.assert_allclose(np.asarray(fn(jnp.asarray(rewards), jnp.asarray(valid))), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(alg.group_advantages(rewards, valid, normalization=normalization), expected, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]


def test_group_advantage_normalisation_rejects_an_unknown_name() -> None:
    with pytest.raises(ValueError, match="sample-std"):
        alg.group_advantages(np.zeros((1, 2)), np.ones((1, 2)), normalization="ddof2")  # type: ignore[arg-type]


def _episode(token: int, reward: float, version: int) -> Episode:
    return Episode(
        episode_id=uuid.uuid4().hex, group_id="g", group_size=4, task_id="t",
        token_ids=np.asarray([1, 2, token], np.int32), loss_mask=np.asarray([0, 0, 1], np.uint8),
        logprobs=np.asarray([0, 0, -2.0], np.float32), policy_versions=np.asarray([-1, -1, version], np.int32),
        reward=reward, status=1,
    )


@pytest.mark.usefixtures("xla_cache")
def test_a_non_finite_gradient_skips_the_update_and_is_counted() -> None:
    spec = tiny_spec(learner={"sequenceBuckets": [8], "microbatchTokens": 64}, algorithm={"learningRate": 0.05},
                     buffer={"groupSize": 4})
    learner = Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None))
    before = jax.device_get(learner.trainer.params)
    opt_before = jax.device_get(learner.trainer.opt_state)
    # A sampler that recorded a NaN log-prob: the ratio, the loss and every gradient are NaN. (A NaN
    # reward no longer gets this far: its episode is failed and never trains, test_learner_updates.py.)
    bad = Group([_episode(3, r, 0) for r in (1.0, 0.0, 1.0, 0.0)])
    bad.episodes[2].logprobs = np.asarray([0, 0, np.nan], np.float32)
    metrics = learner.train_on([bad])
    assert metrics["trained"] == 0.0 and metrics["nonfinite_updates"] == 1.0
    assert learner.version == 0 and learner.steps == 1
    for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(learner.trainer.params)), strict=True):
        np.testing.assert_array_equal(x, y)
    for x, y in zip(jax.tree.leaves(opt_before), jax.tree.leaves(jax.device_get(learner.trainer.opt_state)), strict=True):
        np.testing.assert_array_equal(x, y)
    # The next good batch trains normally, from the untouched parameters.
    good = Group([_episode(t, float(t == 3), 0) for t in (3, 4, 3, 5)])
    metrics = learner.train_on([good])
    assert metrics["trained"] == 1.0 and metrics["nonfinite_updates"] == 1.0 and learner.version == 1
    after = jax.device_get(learner.trainer.params)
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(after))
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True))

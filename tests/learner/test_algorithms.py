"""The objectives against hand-computed values, each with and without jit."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.learner import algorithms as alg
from stoker.learner.algorithms import LossConfig

CFG = LossConfig(clip_low=0.2, clip_high=0.2, importance_cap=2.0)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request: pytest.FixtureRequest) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return (lambda f: jax.jit(f)) if request.param else (lambda f: f)


def a(*rows: list[float]) -> jax.Array:
    return jnp.asarray(rows, jnp.float32)


def test_group_advantages_hand_computed() -> None:
    rewards = np.asarray([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 0.0, 0.0], [5.0, 0.0, 0.0, 0.0]], np.float32)
    valid = np.asarray([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], np.float32)
    adv = alg.group_advantages(rewards, valid)
    # Group 0: mean 0.5, std 0.5 -> +-1. Group 1: equal rewards -> 0. Group 2: one episode -> 0.
    np.testing.assert_allclose(adv, [[1, -1, -1, 1], [0, 0, 0, 0], [0, 0, 0, 0]], atol=1e-5)
    jitted = jax.jit(alg.group_advantages)(jnp.asarray(rewards), jnp.asarray(valid))
    np.testing.assert_allclose(jitted, adv, atol=1e-6)
    dr = alg.group_advantages(rewards, valid, normalization="none")
    np.testing.assert_allclose(dr[0], [0.5, -0.5, -0.5, 0.5], atol=1e-6)


def test_aggregation_weights_token_and_sequence_mean() -> None:
    mask = np.asarray([[0, 1, 1, 1, 0, 1]], np.float32)
    seq = np.asarray([[0, 0, 0, 0, 1, 1]], np.int32)
    np.testing.assert_allclose(alg.aggregation_weights(mask, seq, "token-mean"), [[0, 0.25, 0.25, 0.25, 0, 0.25]])
    # Sequence 0 has 3 trained tokens, sequence 1 has 1: each sequence weighs 1/2 in total.
    expected = [[0, 1 / 6, 1 / 6, 1 / 6, 0, 0.5]]
    np.testing.assert_allclose(alg.aggregation_weights(mask, seq, "sequence-mean"), expected, rtol=1e-6)
    on_device = jax.jit(alg.aggregation_weights, static_argnums=2)(jnp.asarray(mask), jnp.asarray(seq), "sequence-mean")
    np.testing.assert_allclose(on_device, expected, rtol=1e-6)


def test_truncated_importance_weights(maybe_jit: Any) -> None:
    old = a([math.log(0.5), math.log(0.9), math.log(0.1)])
    mu = a([math.log(0.5), math.log(0.3), math.log(0.2)])
    mask = a([1, 1, 0])
    w, stats = maybe_jit(lambda o, b, m: alg.truncated_importance_weights(o, b, m, 2.0))(old, mu, mask)
    # rho = 1, 3 (-> capped at 2), masked -> 1.
    np.testing.assert_allclose(w, [[1.0, 2.0, 1.0]], rtol=1e-6)
    assert float(stats["is_weight_sum"]) == pytest.approx(4.0, rel=1e-5)
    assert float(stats["is_weight_max"]) == pytest.approx(3.0, rel=1e-5)
    assert float(stats["is_clipped"]) == 1 and float(stats["is_tokens"]) == 2


def test_grpo_loss_clipping_and_value(maybe_jit: Any) -> None:
    # Two tokens, A = +1 and -1; ratios 1.5 (clipped to 1.2 for A>0) and 0.5 (clipped to 0.8 for A<0).
    logp = a([math.log(0.6), math.log(0.2)])
    old = a([math.log(0.4), math.log(0.4)])
    mu = old
    adv = a([1.0, -1.0])
    weights = a([0.5, 0.5])
    loss, stats = maybe_jit(lambda *x: alg.grpo_loss(*x, CFG))(logp, old, mu, adv, weights)
    # token 1: -min(1.5, 1.2) = -1.2 ; token 2: -min(-0.5, -0.8) = 0.8 ; mean = -0.2
    assert float(loss) == pytest.approx(-0.2, abs=1e-6)
    assert float(stats["ratio_clipped"]) == 2


def test_grpo_gradient_is_weighted_policy_gradient(maybe_jit: Any) -> None:
    """At old = current (one update per batch) the gradient is -w A d log pi, weighted."""
    old = a([math.log(0.5), math.log(0.25)])
    mu = a([math.log(0.25), math.log(0.25)])  # rho = 2, 1
    adv = a([1.0, 2.0])
    weights = a([0.5, 0.5])
    grad = maybe_jit(jax.grad(lambda lp: alg.grpo_loss(lp, jax.lax.stop_gradient(lp), mu, adv, weights, CFG)[0]))(old)
    np.testing.assert_allclose(grad, [[-0.5 * 2 * 1.0, -0.5 * 1 * 2.0]], rtol=1e-6)


def test_stuck_tokens_train_by_unlikelihood_and_the_rest_by_the_surrogate(maybe_jit: Any) -> None:
    """l_t = A log(1 - pi) on stuck tokens (gradient -A pi / (1 - pi) d log pi), the surrogate elsewhere."""
    logp = a([math.log(0.5), math.log(0.9)])
    log_not_taken = jnp.log1p(-jnp.exp(logp))
    adv = a([1.0, -0.5])
    weights = a([0.5, 0.5])
    stuck = a([0.0, 1.0])

    def loss(lp: jax.Array) -> jax.Array:
        return alg.grpo_loss(
            lp, jax.lax.stop_gradient(lp), lp, adv, weights, CFG, stuck=stuck, log_not_taken=jnp.log1p(-jnp.exp(lp))
        )[0]

    value = maybe_jit(loss)(logp)
    assert float(value) == pytest.approx(0.5 * -1.0 + 0.5 * -0.5 * math.log(0.1), rel=1e-5)
    grad = maybe_jit(jax.grad(loss))(logp)
    # Stuck token: d/dlogp [A log(1 - e^logp)] = -A p / (1 - p) = 0.5 * 9, weighted 0.5.
    np.testing.assert_allclose(grad, [[-0.5 * 1.0, 0.5 * 0.5 * 9.0]], rtol=1e-5)
    with pytest.raises(ValueError, match="log_not_taken"):
        alg.grpo_loss(logp, logp, logp, adv, weights, CFG, stuck=stuck)
    gspo, _ = alg.gspo_loss(
        logp, logp, logp, adv, weights, jnp.asarray([[0, 1]]), CFG, stuck=stuck, log_not_taken=log_not_taken
    )
    assert float(gspo) == pytest.approx(float(value), rel=1e-5)  # one-token sequences: ratio = token ratio


def test_stuck_push_survives_a_saturated_policy(maybe_jit: Any) -> None:
    """On a policy sure of the failing token, the policy-gradient and entropy pushes on its logit
    are ~0; unlikelihood's is -A, whatever the saturation."""
    logits = a([12.0, 0.0, 0.0, 0.0])  # p(0) = 1 - 1.8e-5
    adv = a([-0.35])
    weights = a([1.0])
    config = LossConfig(entropy_coef=0.05)

    def loss(z: jax.Array, stuck: float) -> jax.Array:
        lz = jax.nn.log_softmax(z)[None, :]
        lp, lnt = lz[:, :1], jnp.log(jnp.sum(jnp.exp(lz[:, 1:]), axis=-1, keepdims=True))
        entropy = -jnp.sum(jnp.exp(lz) * lz, axis=-1, keepdims=True)
        return alg.grpo_loss(
            lp, jax.lax.stop_gradient(lp), lp, adv, weights, config,
            entropy=entropy, stuck=a([stuck]), log_not_taken=lnt,
        )[0]

    policy_gradient = maybe_jit(jax.grad(lambda z: loss(z, 0.0)))(logits[0])
    unlikelihood = maybe_jit(jax.grad(lambda z: loss(z, 1.0)))(logits[0])
    assert abs(float(policy_gradient[0])) < 1e-3  # advantage and entropy bonus together
    assert float(unlikelihood[0]) == pytest.approx(0.35, rel=1e-3)  # gradient descent lowers z_0


def test_clip_against_behaviour_stops_pushing_a_token_past_the_trust_region(maybe_jit: Any) -> None:
    """off_policy="clip": old = mu, so the ratio to the sampler's policy is the IS weight, clipped.

    Token 1 (A > 0) was sampled at mu = 0.25 and the policy already moved it to 0.5: ratio 2 > 1.2,
    so stale data gives it no further push. Token 2 (A > 0, ratio 1.1) still gets r A d log pi.
    """
    cfg = LossConfig(off_policy="clip")
    assert cfg.clips_against_behaviour("grpo") and not cfg.clips_against_behaviour("dpo")
    logp = a([math.log(0.5), math.log(0.55)])
    mu = a([math.log(0.25), math.log(0.5)])
    adv = a([1.0, 1.0])
    weights = a([0.5, 0.5])
    grad = maybe_jit(jax.grad(lambda lp: alg.grpo_loss(lp, mu, mu, adv, weights, cfg)[0]))(logp)
    np.testing.assert_allclose(grad, [[0.0, -0.5 * 1.1 * 1.0]], rtol=1e-5)


def test_dual_clip_bounds_a_negative_advantage_token_with_a_large_ratio(maybe_jit: Any) -> None:
    # A = -1 and ratio 5: plain PPO's term is -min(-5, -1.2) = 5 with gradient 5 d log pi; dual
    # clipping at 3 bounds it to 3 with no gradient.
    logp = a([math.log(0.5)])
    mu = a([math.log(0.1)])
    adv = a([-1.0])
    loss_fn = lambda lp, cfg: alg.grpo_loss(lp, mu, mu, adv, jnp.ones_like(lp), cfg)[0]  # noqa: E731
    assert float(maybe_jit(lambda lp: loss_fn(lp, LossConfig(dual_clip=3.0)))(logp)) == pytest.approx(3.0, rel=1e-5)
    assert float(maybe_jit(lambda lp: loss_fn(lp, LossConfig(dual_clip=100.0)))(logp)) == pytest.approx(5.0, rel=1e-5)
    grad = maybe_jit(jax.grad(lambda lp: loss_fn(lp, LossConfig(dual_clip=3.0))))(logp)
    np.testing.assert_allclose(grad, [[0.0]], atol=1e-7)


def test_off_policy_none_applies_no_importance_weight(maybe_jit: Any) -> None:
    cfg = LossConfig(off_policy="none")
    assert not cfg.importance_correction and not cfg.clips_against_behaviour("grpo")
    lp = a([math.log(0.5)])
    mu = a([math.log(0.1)])  # rho = 5 would be capped at 2 by the decoupled weight
    grad = maybe_jit(jax.grad(lambda x: alg.grpo_loss(x, jax.lax.stop_gradient(x), mu, a([1.0]), a([1.0]), cfg)[0]))(lp)
    np.testing.assert_allclose(grad, [[-1.0]], rtol=1e-6)


def test_grpo_kl_k3_and_entropy(maybe_jit: Any) -> None:
    logp = a([math.log(0.5)])
    ref = a([math.log(0.25)])
    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    loss, stats = maybe_jit(
        lambda lp, r, h: alg.grpo_loss(lp, lp, lp, jnp.zeros_like(lp), jnp.ones_like(lp), cfg, ref_logprobs=r, entropy=h)
    )(logp, ref, a([2.0]))
    k3 = 0.5 - math.log(0.5) - 1  # exp(q-p) - (q-p) - 1 with q - p = log 0.5
    assert float(stats["kl"]) == pytest.approx(k3, rel=1e-5)
    assert float(loss) == pytest.approx(0.1 * k3 - 0.01 * 2.0, rel=1e-5)
    with pytest.raises(ValueError, match="ref_logprobs"):
        alg.grpo_loss(logp, logp, logp, logp, logp, cfg)


def test_environment_tokens_never_train(maybe_jit: Any) -> None:
    logp = a([-1.0, -2.0, -3.0])
    weights = a([0.0, 1.0, 0.0])  # only the middle token was sampled by the model
    adv = a([5.0, 1.0, 5.0])
    grad = maybe_jit(jax.grad(lambda lp: alg.grpo_loss(lp, jax.lax.stop_gradient(lp), lp, adv, weights, CFG)[0]))(logp)
    assert float(grad[0, 0]) == 0 and float(grad[0, 2]) == 0 and float(grad[0, 1]) == pytest.approx(-1.0)


def test_gspo_sequence_ratio(maybe_jit: Any) -> None:
    # One sequence of two tokens with log-ratios +0.2 and 0.0: s = exp(0.1); A = 1; no clipping.
    logp = a([0.2 - 1.0, -1.0, -5.0])
    old = a([-1.0, -1.0, -5.0])
    ids = jnp.asarray([[0, 0, 1]], jnp.int32)
    weights = a([0.5, 0.5, 0.0])
    adv = a([1.0, 1.0, 0.0])
    fn = maybe_jit(lambda lp, o, w, s: alg.gspo_loss(lp, o, o, adv, w, s, CFG))
    loss, stats = fn(logp, old, weights, ids)
    assert float(loss) == pytest.approx(-math.exp(0.1), rel=1e-5)
    # With ratio exp(0.5) > 1.2 the clipped branch wins for A > 0.
    loss_clipped, stats = fn(a([0.5 - 1.0, 0.5 - 1.0, -5.0]), old, weights, ids)
    assert float(loss_clipped) == pytest.approx(-1.2, rel=1e-5)
    assert float(stats["ratio_clipped"]) == 2


def test_gspo_sequence_level_importance_weight(maybe_jit: Any) -> None:
    old = a([-1.0, -1.0])
    mu = a([-1.0 - 0.4, -1.0 - 0.2])  # mean log rho = 0.3
    ids = jnp.zeros((1, 2), jnp.int32)
    fn = maybe_jit(lambda o, b: alg.gspo_loss(o, o, b, a([1.0, 1.0]), a([0.5, 0.5]), ids, CFG))
    loss, stats = fn(old, mu)
    assert float(loss) == pytest.approx(-math.exp(0.3), rel=1e-5)
    assert float(stats["is_weight_max"]) == pytest.approx(math.exp(0.3), rel=1e-5)


def test_gae_hand_computed(maybe_jit: Any) -> None:
    # Row: [prompt, a1, env, a2 | next sequence: a1']; rewards on the last model token.
    rewards = a([0, 0, 0, 1, 2])
    values = a([0, 0.5, 9.0, 0.25, 1.0])
    mask = a([0, 1, 0, 1, 1])
    seg = jnp.asarray([[1, 1, 1, 1, 2]], jnp.int32)
    gamma, lam = 0.9, 0.5
    adv, ret = maybe_jit(lambda *x: alg.gae(*x, gamma, lam))(rewards, values, mask, seg)
    a2 = 1 - 0.25  # terminal: delta = r - V
    a1 = (0 + gamma * 0.25 - 0.5) + gamma * lam * a2  # the env token in between is skipped
    a1_next = 2 - 1.0  # a separate sequence, terminal on its own
    np.testing.assert_allclose(adv, [[0, a1, 0, a2, a1_next]], rtol=1e-6)
    np.testing.assert_allclose(ret, [[0, a1 + 0.5, 0, a2 + 0.25, a1_next + 1.0]], rtol=1e-6)


def test_ppo_loss_adds_value_regression(maybe_jit: Any) -> None:
    lp = a([-1.0])
    loss, stats = maybe_jit(
        lambda lp, v: alg.ppo_loss(lp, lp, lp, a([2.0]), v, a([3.0]), a([1.0]), LossConfig(value_coef=0.5))
    )(lp, a([1.0]))
    # policy: -2 ; value: 0.5 * 0.5 * (1 - 3)^2 = 1
    assert float(stats["value_loss"]) == pytest.approx(2.0)
    assert float(loss) == pytest.approx(-2.0 + 1.0)


def test_dpo_loss_hand_computed(maybe_jit: Any) -> None:
    # Pair 0: chosen tokens log-ratios (0.3, 0.2), rejected (-0.5) -> margin beta * 1.0.
    logp = a([-1.0 + 0.3, -1.0 + 0.2, -2.0 - 0.5, 0.0])
    ref = a([-1.0, -1.0, -2.0, 0.0])
    mask = a([1, 1, 1, 0])
    pairs = jnp.asarray([[0, 0, 0, 0]], jnp.int32)
    sign = a([1, 1, -1, 0])
    known = a([0, 0, 0, 0])  # a dataset pair: no sampler log-probs, weight 1
    cfg = LossConfig(dpo_beta=0.5)
    loss, stats = maybe_jit(lambda lp: alg.dpo_loss(lp, ref, lp, lp, known, mask, pairs, sign, cfg))(logp)
    assert float(loss) == pytest.approx(math.log1p(math.exp(-0.5)), rel=1e-5)
    assert float(stats["dpo_accuracy_sum"]) == 1 and float(stats["dpo_pairs"]) == 1
    grad = jax.grad(lambda lp: alg.dpo_loss(lp, ref, lp, lp, known, mask, pairs, sign, cfg)[0])(logp)
    g = -0.5 * (1 - 1 / (1 + math.exp(-0.5)))  # d/dh -log sigmoid(h) * beta
    np.testing.assert_allclose(grad, [[g, g, -g, 0.0]], rtol=1e-5)


def test_tito_check_only_counts_same_version_tokens(maybe_jit: Any) -> None:
    trainer = a([-1.0, -1.0, -2.0, -3.0])
    sampler = a([-1.1, -0.9, -2.0, -9.0])
    versions = jnp.asarray([[7, 7, 7, 6]], jnp.int32)
    mask = a([1, 1, 1, 1])
    stats = maybe_jit(alg.sampler_trainer_logprob_stats)(trainer, sampler, versions, mask, jnp.asarray(7))
    out = alg.finalize_stats({k: float(v) for k, v in stats.items()})
    assert out["tito_tokens"] == 3
    assert out["tito_logprob_diff_mean"] == pytest.approx(0.0, abs=1e-6)
    assert out["tito_logprob_diff_std"] == pytest.approx(math.sqrt(0.02 / 3), rel=1e-4)


def test_stale_tokens() -> None:
    versions = np.asarray([[-1, 3, 5, 8]])
    mask = np.asarray([[0, 1, 1, 1]])
    np.testing.assert_array_equal(alg.stale_tokens(versions, mask, 8, 3), [[False, True, False, False]])


def test_shapes_are_checked_on_entry() -> None:
    with pytest.raises(ValueError, match=r"advantages has shape \(1, 3\); expected \(1, 2\)"):
        alg.grpo_loss(a([0, 0]), a([0, 0]), a([0, 0]), a([0, 0, 0]), a([1, 1]), CFG)
    with pytest.raises(ValueError, match="rank"):
        alg.grpo_loss(jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), CFG)

"""The off-policy corrections against their equations, each with and without jit: the behaviour
ratio's statistics (ESS, second moment), M2PO's second-moment mask (against sorting, and the same
on every shard under shard_map), and the lag-scaled clip inside the GRPO loss."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.learner import algorithms as alg
from stoker.learner.algorithms import LossConfig
from tests.host_devices import run_on_host_devices


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request: pytest.FixtureRequest) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    return (lambda f: jax.jit(f)) if request.param else (lambda f: f)


def kept_by_sorting(log_w: np.ndarray, mask: np.ndarray, budget: float) -> int:
    """M2PO's rule read literally: drop the largest (log w)^2 one by one until the mean of the rest
    is within the budget; how many tokens stay."""
    m2 = np.sort((log_w[mask > 0].astype(np.float64)) ** 2)
    for keep in range(len(m2), 0, -1):
        if m2[:keep].mean() <= budget:
            return keep
    return 0


def test_behaviour_ratio_stats_give_kish_ess_and_the_second_moment(maybe_jit: Any) -> None:
    w = np.asarray([[1.0, 2.0, 0.5, 4.0]], np.float32)
    mask = np.asarray([[1, 1, 1, 0]], np.float32)
    stats = maybe_jit(alg.behaviour_ratio_stats)(jnp.log(w), mask)
    on = w[mask > 0]
    assert float(stats["behaviour_w_sum"]) == pytest.approx(on.sum(), rel=1e-6)
    assert float(stats["behaviour_w_sumsq"]) == pytest.approx((on**2).sum(), rel=1e-6)
    assert float(stats["behaviour_log_w_sumsq"]) == pytest.approx((np.log(on) ** 2).sum(), rel=1e-5)
    assert float(stats["behaviour_log_w_abs_max"]) == pytest.approx(math.log(2.0), rel=1e-6)  # 4.0 is off the mask
    out = alg.finalize_stats({k: float(v) for k, v in stats.items()})
    assert out["behaviour_ess"] == pytest.approx(on.sum() ** 2 / (on**2).sum() / 3, rel=1e-6)
    assert out["behaviour_log_w_m2"] == pytest.approx((np.log(on) ** 2).mean(), rel=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("budget", [0.04, 0.2])
def test_second_moment_mask_keeps_what_sorting_keeps(maybe_jit: Any, seed: int, budget: float) -> None:
    rng = np.random.default_rng(seed)
    log_w = rng.normal(0.0, 0.5, (4, 32)).astype(np.float32)
    mask = (rng.random((4, 32)) > 0.25).astype(np.float32)
    kept = np.asarray(maybe_jit(lambda x, m: alg.second_moment_mask(x, m, budget))(log_w, mask))
    assert kept.sum() == kept_by_sorting(log_w, mask, budget)
    assert np.all(kept <= mask)  # never a token off the mask
    m2 = log_w**2
    assert m2[kept > 0].mean() <= budget + 1e-6
    # What stays are the smallest: every dropped trained token is at least every kept one.
    assert m2[(kept == 0) & (mask > 0)].min() >= m2[kept > 0].max()


def test_second_moment_mask_keeps_everything_within_the_budget() -> None:
    log_w = np.full((2, 8), 0.1, np.float32)  # (log w)^2 = 0.01 everywhere
    mask = np.ones((2, 8), np.float32)
    assert float(alg.second_moment_mask(log_w, mask, 0.04).sum()) == 16


SHARDED_MASK = textwrap.dedent(
    """
    import json
    import jax, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    from stoker.learner import algorithms as alg

    mesh = Mesh(np.asarray(jax.devices()), ("fsdp",))
    rng = np.random.default_rng(3)
    log_w = rng.normal(0.0, 0.4, (8, 16)).astype(np.float32)
    log_w[0] *= 4  # one shard far off-policy: a budget of its own would drop far more of it
    mask = np.ones((8, 16), np.float32)

    def per_shard(x, m):
        return alg.second_moment_mask(x, m, 0.04, lambda v: jax.lax.psum(v, "fsdp"))

    sharded = jax.jit(jax.shard_map(per_shard, mesh=mesh, in_specs=(P("fsdp"), P("fsdp")), out_specs=P("fsdp")))
    alone = [np.asarray(alg.second_moment_mask(x[None], m[None], 0.04)).tolist() for x, m in zip(log_w, mask)]
    print(json.dumps({"sharded": np.asarray(sharded(log_w, mask)).tolist(),
                      "whole": np.asarray(alg.second_moment_mask(log_w, mask, 0.04)).tolist(), "alone": alone}))
    """
)


def test_second_moment_mask_is_one_decision_over_all_shards() -> None:
    """Under shard_map, ``total`` = psum over the rows' axis: every shard applies the threshold of
    the whole batch, so the kept tokens are those of the unsharded batch (8 host devices)."""
    out = run_on_host_devices(SHARDED_MASK)
    np.testing.assert_array_equal(out["sharded"], out["whole"])
    assert sum(map(sum, out["whole"][:1])) > sum(map(sum, out["alone"][0]))  # a shard alone would differ


def test_lag_scaled_clip_is_ppo_on_policy_and_one_clip_per_version() -> None:
    cfg = LossConfig(clip_low=0.2, clip_high=0.28)
    low, high = alg.lag_scaled_clip(cfg, jnp.asarray([0, 1, 3]))
    np.testing.assert_allclose(low, [0.8, 0.8**2, 0.8**4], rtol=1e-6)
    np.testing.assert_allclose(high, [1.28, 1.28**2, 1.28**4], rtol=1e-6)


def grpo_grad(cfg: LossConfig, logp: jax.Array, mu: jax.Array, adv: jax.Array, lag: jax.Array) -> jax.Array:
    weights = jnp.full(logp.shape, 1.0 / logp.size)

    def loss(x: jax.Array) -> jax.Array:
        return alg.grpo_loss(x, mu, mu, adv, weights, cfg, lag=lag)[0]

    return jax.grad(loss)(logp)


def test_lag_clip_lets_a_stale_token_move_where_ppo_clip_stops_it(maybe_jit: Any) -> None:
    """A token sampled 2 versions ago whose ratio pi/mu rose to 1.5 with A > 0: PPO's clip around mu
    (1.2) gives it no gradient; the lag-scaled clip (1.2^3 = 1.728) still does, exactly the
    unclipped -A r / N; at lag 0 both are PPO."""
    mu = jnp.log(jnp.asarray([[0.2, 0.2]]))
    logp = mu + jnp.log(jnp.asarray([[1.5, 1.5]]))
    adv = jnp.asarray([[1.0, 1.0]])
    lag = jnp.asarray([[2, 0]])
    clip = maybe_jit(lambda x: grpo_grad(LossConfig(off_policy="clip"), x, mu, adv, lag))(logp)
    lagged = maybe_jit(lambda x: grpo_grad(LossConfig(off_policy="lag-clip"), x, mu, adv, lag))(logp)
    np.testing.assert_allclose(clip, [[0.0, 0.0]], atol=1e-7)
    np.testing.assert_allclose(lagged, [[-1.5 / 2, 0.0]], rtol=1e-5)


def test_m2po_trains_unclipped_on_kept_tokens_and_not_on_dropped_ones(maybe_jit: Any) -> None:
    """m2po: no ratio clip (a kept token at r = 1.5 gets -A r / N), the outlier past the budget none."""
    ratios = np.asarray([[1.05, 1.5, 0.97, 40.0]], np.float32)
    mu = jnp.log(jnp.full((1, 4), 0.01))
    logp = mu + jnp.log(jnp.asarray(ratios))
    adv = jnp.ones((1, 4))
    cfg = LossConfig(off_policy="m2po", m2po_budget=0.1)  # mean of the first three (log r)^2 is 0.057
    grad = maybe_jit(lambda x: grpo_grad(cfg, x, mu, adv, jnp.zeros((1, 4), jnp.int32)))(logp)
    np.testing.assert_allclose(grad, [[-1.05 / 4, -1.5 / 4, -0.97 / 4, 0.0]], rtol=1e-5)
    _, stats = alg.grpo_loss(logp, mu, mu, adv, jnp.full((1, 4), 0.25), cfg)
    assert float(stats["m2_masked"]) == 1.0


def rest_of_episode(log_w: np.ndarray, mask: np.ndarray, ids: np.ndarray, cap: float) -> np.ndarray:
    """The equation read literally: for each trained token, the product of the other trained
    tokens' ratios in its episode, clipped to [1/cap, cap]; 1 off the mask."""
    out = np.ones(log_w.shape)
    for index in zip(*np.nonzero(mask)):
        same = (ids == ids[index]) & (mask > 0)
        same[index] = False
        out[index] = np.clip(np.prod(np.exp(log_w[same].astype(np.float64))), 1 / cap, cap)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_episode_weights_are_the_rest_of_the_episodes_ratio(maybe_jit: Any, seed: int) -> None:
    rng = np.random.default_rng(seed)
    log_w = rng.normal(0.0, 0.6, (2, 12)).astype(np.float32)
    mask = (rng.random((2, 12)) > 0.3).astype(np.float32)
    ids = np.asarray([[0] * 5 + [1] * 7, [12] * 4 + [13] * 4 + [14] * 4], np.int32)  # row-local ids, as packed
    got = np.asarray(maybe_jit(lambda x, m, i: alg.episode_weights(x, m, i, 1.5))(log_w, mask, ids))
    np.testing.assert_allclose(got, rest_of_episode(log_w, mask, ids, 1.5), rtol=1e-5)
    assert np.any(np.isclose(got, 1.5)) and np.any(np.isclose(got, 1 / 1.5))  # the cap binds both ways here
    on_policy = np.asarray(alg.episode_weights(np.zeros_like(log_w), mask, ids, 1.5))
    np.testing.assert_allclose(on_policy, 1.0)


def test_episode_correction_weights_each_tokens_advantage_by_the_rest_of_its_episode(maybe_jit: Any) -> None:
    """episode: clip's gradient with A_t times v_t. Episode 0 holds tokens of ratios 1.1 and 1.3,
    episode 1 one token alone (v = 1); the second token of episode 0 has A < 0 and r = 1.3."""
    ratios = np.asarray([[1.1, 1.3, 0.9]], np.float32)
    mu = jnp.log(jnp.full((1, 3), 0.3))
    logp = mu + jnp.log(jnp.asarray(ratios))
    adv = jnp.asarray([[1.0, -1.0, 2.0]])
    ids = jnp.asarray([[0, 0, 1]])
    weights = jnp.full((1, 3), 1.0 / 3)

    def grad(cfg: LossConfig) -> jax.Array:
        return jax.grad(lambda x: alg.grpo_loss(x, mu, mu, adv, weights, cfg, sequence_ids=ids)[0])(logp)

    got = maybe_jit(lambda: grad(LossConfig(off_policy="episode", clip_high=1.0)))()
    # d/dlogp of -v A r / 3 is -v A r / 3 for an unclipped token
    np.testing.assert_allclose(got, [[-1.3 * 1.0 * 1.1 / 3, 1.1 * 1.3 / 3, -2.0 * 0.9 / 3]], rtol=1e-5)
    with pytest.raises(ValueError, match="sequence_ids"):
        alg.grpo_loss(logp, mu, mu, adv, weights, LossConfig(off_policy="episode"))
    _, stats = alg.grpo_loss(logp, mu, mu, adv, weights, LossConfig(off_policy="episode", episode_cap=1.2),
                             sequence_ids=ids)
    out = alg.finalize_stats({**{k: float(v) for k, v in stats.items()}, "trained_tokens": 3.0})
    assert out["episode_weight_mean"] == pytest.approx((1.2 + 1.1 + 1.0) / 3, rel=1e-5)
    assert out["episode_weight_capped_fraction"] == pytest.approx(1 / 3)

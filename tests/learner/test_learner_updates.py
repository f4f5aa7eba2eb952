"""What one learner update does on the CPU: it moves the policy toward reward, keeps stale tokens
out of the loss, pushes a stuck policy off a lost task, and weighs off-policy tokens."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.learner.batches import Group, prepare_groups
from stoker.learner.loop import SAMPLE_LAG_VERSIONS, Learner
from stoker.learner.optimizer import updates_applied
from stoker.learner.testing import TINY_ARCHITECTURE
from stoker.model.logprobs import token_logprobs
from stoker.trajectory import Episode
from tests.learner.bandit import GOOD, PROMPT, bandit_groups, next_token_probs, settings, with_reward_spread

pytestmark = pytest.mark.usefixtures("xla_cache")  # programs shared across learners


@pytest.mark.parametrize("algorithm", ["grpo", "gspo", "ppo", "dpo"])
def test_training_moves_the_policy_toward_reward(algorithm: str) -> None:
    learner = Learner(settings(algorithm={"name": algorithm, "klCoef": 0.01 if algorithm == "grpo" else 0.0}))
    rng = np.random.default_rng(0)
    before = next_token_probs(learner)[GOOD]
    updates = 0
    for _ in range(12):
        out = learner.train_on(bandit_groups(learner, rng))
        if out["trained"]:  # DPO skips a batch whose groups all tie (no GOOD sampled)
            metrics, updates = out, updates + 1
    after = next_token_probs(learner)[GOOD]
    assert before < 0.2 and after > 0.8, (algorithm, before, after)  # seeds 0-2 all reach >= 0.997
    assert updates >= 6 and learner.version == updates == metrics["policy_version"]
    # Every token was sampled by the version trained on it: the sampler/trainer check is ~0.
    assert metrics["tito_tokens"] > 0
    assert abs(metrics["tito_logprob_diff_mean"]) < 1e-4
    assert metrics["is_weight_max"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["staleness_max"] == 0


def test_updates_per_batch_take_the_gradient_again_where_the_last_update_left(tmp_path: Path) -> None:
    """algorithm.updatesPerBatch 2: one batch, two Adam updates, one version -- exactly what two
    single-update steps on the same batch do (the clip correction does not read the version)."""
    once = Learner(settings(tmp_path / "once"))
    twice = Learner(settings(tmp_path / "twice", algorithm={"updatesPerBatch": 2}))
    groups = with_reward_spread(bandit_groups(once, np.random.default_rng(0)))
    first = once.train_on(copy.deepcopy(groups))
    once.train_on(copy.deepcopy(groups))
    both = twice.train_on(copy.deepcopy(groups))
    assert updates_applied(twice.trainer.opt_state) == 2 and twice.version == 1 and both["trained"] == 1.0
    for a, b in zip(jax.tree.leaves(once.trainer.params), jax.tree.leaves(twice.trainer.params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    assert both["pg_loss"] == pytest.approx(first["pg_loss"])  # the stats are the batch as it came


def test_stale_tokens_never_reach_the_loss(grpo_learner: Learner) -> None:
    learner = grpo_learner
    rng = np.random.default_rng(1)
    learner.train_on(with_reward_spread(bandit_groups(learner, rng)))  # Adam now has momentum that a 0-gradient step would apply
    stale_groups = with_reward_spread(bandit_groups(learner, rng))
    fresh_groups = with_reward_spread(bandit_groups(learner, rng))
    learner.version += 5  # both batches are now 5 versions old
    for ep in fresh_groups[1].episodes:  # ... except one group, sampled by the current version
        ep.policy_versions = np.where(ep.loss_mask > 0, learner.version, -1).astype(np.int32)
    version = learner.version
    before = jax.tree.map(np.asarray, learner.trainer.params)
    metrics = learner.train_on(stale_groups)
    after = jax.tree.map(np.asarray, learner.trainer.params)
    assert metrics["stale_tokens"] == 16 and metrics["trained"] == 0 and learner.version == version
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(a, b)
    metrics = learner.train_on(fresh_groups)
    assert metrics["stale_tokens"] == 8 and metrics["trained_tokens"] == 8
    assert metrics["staleness_max"] == 0 and learner.version == version + 1


def groups_sampled_by(learner: Learner, rng: np.random.Generator, version: int) -> list[Group]:
    """A batch whose model tokens all carry policy ``version``."""
    groups = with_reward_spread(bandit_groups(learner, rng))
    for group in groups:
        for ep in group.episodes:
            ep.policy_versions = np.where(ep.loss_mask > 0, version, -1).astype(np.int32)
    return groups


def test_staleness_is_judged_by_the_limit_the_buffer_sampled_with(grpo_learner: Learner) -> None:
    """buffer.maxStaleness edited live (Configure): the learner, started with the old limit, drops
    stale tokens by the limit its batch came with, so a raised limit does not mask what the buffer
    now delivers, and a lowered one is kept."""
    learner = grpo_learner
    rng = np.random.default_rng(5)
    s = learner.settings.max_staleness
    learner.version += 10
    behind = s + 2  # past the learner's own limit, within a raised one

    def batch_at(version: int) -> list[Group]:
        return groups_sampled_by(learner, rng, version)

    metrics = learner.train_on(batch_at(learner.version - behind), sampled_at=learner.version, max_staleness=behind)
    assert metrics["trained"] == 1 and metrics["stale_tokens"] == 0
    metrics = learner.train_on(batch_at(learner.version - behind), sampled_at=learner.version)  # its own limit
    assert metrics["trained"] == 0 and metrics["stale_tokens"] == 16
    metrics = learner.train_on(batch_at(learner.version - 1), sampled_at=learner.version, max_staleness=0)
    assert metrics["trained"] == 0 and metrics["stale_tokens"] == 16


def test_staleness_is_judged_at_the_version_the_buffer_sampled_at(grpo_learner: Learner) -> None:
    """A batch the buffer passed at version v trains whole although the learner is already ahead
    of v (it fetched the batch while training the previous one): the learner does not strip the
    oldest tokens -- an episode's first turns -- from groups the buffer had just checked. Metrics
    still report the lag at training time."""
    learner = grpo_learner
    rng = np.random.default_rng(3)
    s = learner.settings.max_staleness
    learner.version += 10  # room for versions behind it, whichever test used the learner first

    def batch_sampled_at(version: int) -> list[Group]:
        return groups_sampled_by(learner, rng, version)

    # The buffer is two versions behind; the tokens are exactly maxStaleness behind the buffer.
    buffer_version = learner.version - 2
    metrics = learner.train_on(batch_sampled_at(buffer_version - s), sampled_at=buffer_version)
    assert metrics["trained"] == 1 and metrics["stale_tokens"] == 0
    assert metrics["staleness_max"] == s + 2
    # One version older than the buffer allows: dropped.
    buffer_version = learner.version - 2
    metrics = learner.train_on(batch_sampled_at(buffer_version - s - 1), sampled_at=buffer_version)
    assert metrics["trained"] == 0 and metrics["stale_tokens"] == 16
    # A buffer that fell further behind is trusted only SAMPLE_LAG_VERSIONS versions back.
    old = learner.version - s - SAMPLE_LAG_VERSIONS - 1
    metrics = learner.train_on(batch_sampled_at(old), sampled_at=learner.version - 10)
    assert metrics["trained"] == 0 and metrics["stale_tokens"] == 16
    # Without a sample version (sync mode, offline data) the learner's own version is the clock.
    metrics = learner.train_on(batch_sampled_at(learner.version - s - 1))
    assert metrics["trained"] == 0 and metrics["stale_tokens"] == 16


def test_a_policy_copy_outlives_the_next_update(grpo_learner: Learner) -> None:
    """The outbox publishes from a copy while training goes on; the step donates the live arrays."""
    from stoker.weights.channel import flatten_params

    learner = grpo_learner
    expected = learner.flat_weights()
    copy = learner.trainer.policy_copy()
    metrics = learner.train_on(with_reward_spread(bandit_groups(learner, np.random.default_rng(7))))
    assert metrics["trained"] == 1
    published = flatten_params(learner.trainer.policy_model(copy))
    assert published.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(published[name], value)
    assert any(not np.array_equal(learner.flat_weights()[n], v) for n, v in expected.items())


def test_a_batch_without_reward_spread_makes_no_update(grpo_learner: Learner) -> None:
    learner = grpo_learner
    rng = np.random.default_rng(4)
    groups = bandit_groups(learner, rng)
    for group in groups:
        for ep in group.episodes:
            ep.reward = 1.0  # every episode solved: nothing to prefer
    version, steps = learner.version, learner.steps
    before = jax.tree.map(np.asarray, learner.trainer.params)
    metrics = learner.train_on(groups)
    # No update at all: one made of the entropy bonus and noise, scaled up by Adam, is what
    # drifted a solved FrozenLake policy off its maps. It still counts as a step (a batch consumed).
    assert metrics["trained"] == 0 and metrics["zero_signal_groups"] == 2
    assert learner.version == version and learner.steps == metrics["step"] == steps + 1
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(learner.trainer.params), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    groups = bandit_groups(learner, rng)
    with_reward_spread(groups[:1])
    for ep in groups[1].episodes:
        ep.reward = 0.0  # all failed alike, below the task's best (1.0): stuck, not solved ...
    metrics = learner.train_on(groups)
    # ... so it trains too, pushed off the tokens it failed with (prepare_groups' tests below).
    assert metrics["trained"] == 1 and metrics["zero_signal_groups"] == 1 and metrics["stuck_groups"] == 1
    assert metrics["trained_tokens"] == 16 and learner.version == version + 1
    groups = bandit_groups(learner, rng)
    for group in groups:
        for ep in group.episodes:
            ep.reward = 0.0
    metrics = learner.train_on(groups)  # only stuck groups: still an update
    assert metrics["trained"] == 1 and metrics["zero_signal_groups"] == 2 and learner.version == version + 2
    assert metrics["stuck_groups"] == 2


def _flat_group(task: str, reward: float, size: int = 4) -> Group:
    episodes = [
        Episode(
            episode_id=uuid.uuid4().hex, group_id=task, group_size=size, task_id=task,
            token_ids=np.asarray(PROMPT + [GOOD], np.int32), loss_mask=np.asarray([0, 0, 1], np.uint8),
            logprobs=np.asarray([0, 0, -0.1], np.float32), policy_versions=np.asarray([-1, -1, 0], np.int32),
            reward=reward, status=1,
        )
        for _ in range(size)
    ]
    return Group(episodes)


def test_stuck_groups_get_a_negative_advantage_and_solved_ones_stay_out() -> None:
    best: dict[str, float] = {}
    spread = _flat_group("a", 0.0)
    spread.episodes[0].reward = 1.0
    prepared = prepare_groups([spread, _flat_group("b", 0.5)], "grpo", best)
    assert best == {"a": 1.0, "b": 0.5}
    # a's spread group trains as usual; b's first group is flat at its best so far: solved, left out.
    assert [seq[0].stuck for seq in prepared.items] == [False] * 4 and prepared.stuck_groups == 0
    assert [seq[0].advantage for seq in prepared.items][0] > 0
    prepared = prepare_groups([_flat_group("a", 0.25), _flat_group("b", 0.5), _flat_group("a", 1.0)], "grpo", best)
    # a at 0.25 < 1.0 is stuck: as if a fifth sample had scored 1.0, (0.25 - 0.4) / 0.3 = -1/sqrt(4),
    # shared by the 4 copies of one path.
    assert prepared.zero_signal_groups == 3 and prepared.stuck_groups == 1
    assert all(seq[0].stuck for seq in prepared.items) and len(prepared.items) == 4
    np.testing.assert_allclose([seq[0].advantage for seq in prepared.items], [-0.5 / 4] * 4, rtol=1e-4)
    assert best == {"a": 1.0, "b": 0.5}
    # Only solved groups: nothing to train, not even on the entropy bonus (the drift the docstring tells of).
    assert prepare_groups([_flat_group("a", 1.0), _flat_group("b", 0.5)], "grpo", best).items == []


def test_a_non_finite_reward_never_trains_nor_enters_the_best_reward_table() -> None:
    best: dict[str, float] = {}
    spread = _flat_group("a", 0.0)
    spread.episodes[0].reward = 1.0
    poisoned = _flat_group("a", 0.5)
    poisoned.episodes[1].reward = float("nan")
    poisoned.episodes[2].reward = float("inf")
    poisoned.episodes[3].metrics = {"success": float("nan"), "steps": float("inf")}
    prepared = prepare_groups([poisoned, spread], "grpo", best)
    assert best == {"a": 1.0}
    assert prepared.skipped_episodes == 2 and all(np.isfinite(prepared.rewards))
    assert all(np.isfinite(seq[0].advantage) for seq in prepared.items)
    # The environment's non-finite metrics are dropped (the generation figures sit beside them).
    environment = {k: v for k, v in prepared.episode_metrics.items() if k.startswith(("episode_", "success"))}
    assert environment == {"success_rate": 0.0} and all(np.isfinite(list(prepared.episode_metrics.values())))
    # Later groups of the task are still judged against a finite best: stuck below it.
    assert prepare_groups([_flat_group("a", 0.5)], "grpo", best).stuck_groups == 1


def test_a_saturated_policy_is_pushed_off_a_lost_task() -> None:
    """A policy sure (p > 0.9995) of a token that no longer pays, as when an outsized step knocks a
    solved FrozenLake map onto one losing path: its stuck groups must make it sample something else.

    Measured on this bandit: with the earlier rule (advantage 0, entropy bonus only) or with a plain
    policy gradient at the stuck advantage, p stays > 0.9999 for 30 steps (Adam's momentum from the
    saturating steps still pushes it up); the unlikelihood push brings it under 0.05 by step 9."""
    learner = Learner(settings(algorithm={"entropyCoef": 0.05}))
    rng = np.random.default_rng(3)
    bad = 5
    forced = np.full(TINY_ARCHITECTURE.vocab_size, 0.5 / (TINY_ARCHITECTURE.vocab_size - 1))
    forced[bad] = 0.5
    for _ in range(60):  # saturate on `bad`, which pays for now; half the samples are forced to others
        probs = next_token_probs(learner)
        if probs[bad] > 0.9995:
            break
        groups = bandit_groups(learner, rng, probs=forced)
        for group in groups:
            for ep in group.episodes:
                ep.reward = float(ep.token_ids[-1] == bad)
                ep.logprobs[-1] = np.log(probs[ep.token_ids[-1]])  # what the current policy gives it
        learner.train_on(groups)
    assert next_token_probs(learner)[bad] > 0.9995
    lowest = 1.0
    for _ in range(10):  # `bad` now pays nothing: every sample fails alike, below the best (1.0)
        groups = bandit_groups(learner, rng)
        for group in groups:
            for ep in group.episodes:
                ep.reward = 0.0
        metrics = learner.train_on(groups)
        assert metrics["stuck_groups"] == 2 and metrics["trained"] == 1
        lowest = min(lowest, float(next_token_probs(learner)[bad]))
    assert lowest < 0.5


def _sampler_was_less_sure(groups: list[Group]) -> list[Group]:
    for group in groups:
        for ep in group.episodes:
            ep.logprobs = ep.logprobs + np.asarray([0, 0, -1.0], np.float32)
    return groups


def test_decoupled_importance_weights_report_off_policy_data() -> None:
    learner = Learner(settings(algorithm={"offPolicyCorrection": "decoupled"}))
    metrics = learner.train_on(_sampler_was_less_sure(with_reward_spread(bandit_groups(learner, np.random.default_rng(2)))))
    # rho = pi_old / mu = e^1 > cap 2: every token truncated.
    assert metrics["is_weight_mean"] == pytest.approx(np.e, rel=1e-3)
    assert metrics["is_clipped_fraction"] == 1.0


def test_clip_correction_takes_the_ratio_against_the_sampler(grpo_learner: Learner) -> None:
    learner = grpo_learner  # the default offPolicyCorrection: clip
    metrics = learner.train_on(_sampler_was_less_sure(with_reward_spread(bandit_groups(learner, np.random.default_rng(2)))))
    # pi_theta / mu = e^1 is outside [0.8, 1.2] on every token; the separate weight is mu / mu = 1.
    assert metrics["ratio_clipped_fraction"] == 1.0
    assert metrics["is_weight_mean"] == pytest.approx(1.0, rel=1e-6)


def test_logprob_alignment_matches_the_model(grpo_learner: Learner) -> None:
    """Behaviour log-probs equal to the model's own make the TiTO difference exactly zero."""
    learner = grpo_learner
    ids = np.asarray([1, 2, 5, 6, 7], np.int32)
    model = learner.trainer.policy_model()
    logits = model(jnp.asarray(ids[None]), jnp.arange(5)[None], jnp.ones((1, 5), jnp.int32))
    lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(ids[None, 1:])))[0]
    ep = Episode(
        episode_id="e", group_id="g", group_size=2, task_id="t", token_ids=ids,
        loss_mask=np.asarray([0, 0, 1, 0, 1], np.uint8),
        logprobs=np.asarray([0, 0, lp[1], 0, lp[3]], np.float32),
        policy_versions=np.asarray([-1, -1, learner.version, -1, learner.version], np.int32), reward=1.0, status=1,
    )
    other = Episode(**{**ep.__dict__, "episode_id": "f", "reward": 0.0})
    metrics = learner.train_on([Group([ep, other])])
    assert metrics["tito_tokens"] == 4
    assert abs(metrics["tito_logprob_diff_mean"]) < 1e-5 and metrics["tito_logprob_diff_std"] < 1e-5


@pytest.mark.slow
def test_bfloat16_model_keeps_float32_master_weights() -> None:
    learner = Learner(settings(model={"dtype": "bfloat16"}, algorithm={"learningRate": 1e-5}))
    leaves = jax.tree.leaves(learner.trainer.params)
    assert all(x.dtype == jnp.float32 for x in leaves)
    before = [np.asarray(x) for x in leaves]
    learner.train_on(with_reward_spread(bandit_groups(learner, np.random.default_rng(7))))
    after = [np.asarray(x) for x in jax.tree.leaves(learner.trainer.params)]
    moved = [np.abs(a - b).max() for a, b in zip(before, after, strict=True)]
    # Adam moves each weight by ~lr = 1e-5, far below bfloat16's spacing near 1 (2^-7): kept in
    # bfloat16 the update would round away; the float32 master weights keep it.
    assert 0 < max(moved) < 1e-4
    embedding = learner.trainer.policy_model().embed_tokens.embedding[...]
    assert embedding.dtype == jnp.bfloat16
    assert learner.flat_weights()["model.embed_tokens.weight"].dtype.name == "bfloat16"

"""The learner end to end on the CPU: it really learns, resumes, publishes, and compiles little."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stoker.buffer.client import SampledBatch
from stoker.learner.batches import Group, load_dpo_pairs, prepare_groups
from stoker.learner.loop import SAMPLE_LAG_VERSIONS, Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import TINY_ARCHITECTURE, tiny_spec
from stoker.model.logprobs import token_logprobs
from stoker.weights.channel import WeightSubscriber
from stoker.spec import RLJobSpec
from stoker.trajectory import Episode

# The bandit's job: two buckets, and a learning rate that moves the tiny policy in a few updates.
BANDIT_JOB = {
    "learner": {"sequenceBuckets": [8, 16], "microbatchTokens": 128, "batchGroups": 2, "checkpoint": {"intervalSteps": 2}},
    "algorithm": {"learningRate": 0.05},
    "buffer": {"groupSize": 8},
}
PROMPT = [1, 2]
GOOD = 3  # the bandit pays 1 for this token

pytestmark = pytest.mark.usefixtures("xla_cache")  # programs shared across learners


def settings(tmp_path: Path | None = None, *layers: dict[str, Any], **sections: Any) -> LearnerSettings:
    """The bandit learner's settings with ``layers`` and ``sections`` of the spec merged in
    (``tiny_spec``); checkpoints in ``tmp_path`` when given, none otherwise."""
    spec = tiny_spec(BANDIT_JOB, *layers, **sections)
    if tmp_path is None:
        return LearnerSettings.from_spec(spec, checkpoint_dir=None)
    return LearnerSettings.from_spec(spec, run_dir=tmp_path)


def next_token_probs(learner: Learner) -> np.ndarray:
    """pi(. | PROMPT) under the learner's current parameters."""
    model = learner.trainer.policy_model()
    ids = jnp.asarray([PROMPT], jnp.int32)
    logits = model(ids, jnp.asarray([[0, 1]], jnp.int32), jnp.ones_like(ids))
    return np.asarray(jax.nn.softmax(logits[0, -1]))


def bandit_groups(
    learner: Learner, rng: np.random.Generator, groups: int = 2, size: int = 8, probs: np.ndarray | None = None
) -> list[Group]:
    """Episodes PROMPT + one sampled token, reward 1 for GOOD, sampled from ``probs`` (the current
    policy when None)."""
    probs = next_token_probs(learner) if probs is None else probs
    out = []
    for g in range(groups):
        episodes = []
        for _ in range(size):
            token = int(rng.choice(len(probs), p=probs / probs.sum()))
            episodes.append(
                Episode(
                    episode_id=uuid.uuid4().hex, group_id=f"g{g}", group_size=size, task_id="bandit",
                    token_ids=np.asarray(PROMPT + [token], np.int32),
                    loss_mask=np.asarray([0, 0, 1], np.uint8),
                    logprobs=np.asarray([0, 0, np.log(probs[token])], np.float32),
                    policy_versions=np.asarray([-1, -1, learner.version], np.int32),
                    reward=float(token == GOOD), status=1,
                )
            )
        out.append(Group(episodes))
    return out


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


@pytest.fixture(scope="module")
def grpo_learner() -> Learner:
    """One GRPO learner shared by the tests that only look at a single update's metrics."""
    return Learner(settings(buffer={"maxStaleness": 1}))


def with_reward_spread(groups: list[Group]) -> list[Group]:
    """Alternate rewards 0/1 in every group, so that no group is left out for lack of signal."""
    for group in groups:
        for j, ep in enumerate(group.episodes):
            ep.reward = float(j % 2)
    return groups


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


@pytest.mark.slow
def test_200_random_batches_compile_once_per_bucket() -> None:
    learner = Learner(settings(learner={"sequenceBuckets": [8, 16, 32], "microbatchTokens": 64}, algorithm={"name": "grpo"}))
    rng = np.random.default_rng(3)
    for _ in range(200):
        episodes = []
        for i in range(int(rng.integers(2, 9))):
            n = int(rng.integers(3, 33))
            mask = (rng.random(n) < 0.5).astype(np.uint8)
            mask[-1] = 1
            episodes.append(
                Episode(
                    episode_id=str(i), group_id="g", group_size=8, task_id="t",
                    token_ids=rng.integers(0, 8, n).astype(np.int32), loss_mask=mask,
                    logprobs=np.where(mask, -1.0, 0.0).astype(np.float32),
                    policy_versions=np.where(mask, learner.version, -1).astype(np.int32),
                    reward=float(rng.random()), status=1,
                )
            )
        metrics = learner.train_on([Group(episodes)])
        assert 0.0 <= metrics["padding_waste"] < 1.0
    programs = learner.trainer.compiled_programs()
    assert programs["grad"] <= 3
    assert programs["apply"] == 1 and programs["accumulate"] <= 1


def test_checkpoint_resume_continues_the_version(tmp_path: Path) -> None:
    first = Learner(settings(tmp_path))
    rng = np.random.default_rng(4)
    for _ in range(3):
        first.train_on(with_reward_spread(bandit_groups(first, rng)))
    first.save(wait=True)
    probs = next_token_probs(first)
    groups = with_reward_spread(bandit_groups(first, np.random.default_rng(5)))

    second = Learner(settings(tmp_path))
    assert second.resumed and second.version == 3 and second.steps == 3
    np.testing.assert_allclose(next_token_probs(second), probs, rtol=1e-6)
    restored_params = jax.tree.map(jnp.copy, second.trainer.params)
    # Adam's moments came back too: the next update equals the one the first learner makes ...
    first.train_on(groups)
    second.train_on(groups)
    assert second.version == first.version == 4
    expected = [np.asarray(x) for x in jax.tree.leaves(first.trainer.params)]
    for a, b in zip(expected, jax.tree.leaves(second.trainer.params), strict=True):
        np.testing.assert_allclose(a, np.asarray(b), rtol=1e-6, atol=1e-7)
    # ... which the same parameters with a fresh optimizer state would not reproduce.
    no_moments = Learner(settings())
    no_moments.trainer.params = restored_params
    no_moments.train_on(groups)
    got = [np.asarray(x) for x in jax.tree.leaves(no_moments.trainer.params)]
    assert not all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(expected, got, strict=True))
    first.close()
    second.close()


@dataclass
class ScriptedBuffer:
    """An in-process stand-in for the buffer client, recording the learner's calls."""

    learner_ref: list[Learner] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(6))

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch:
        # Called from the learner's prefetch thread while it trains, so it must not run the model
        # (a real buffer is another process): a fixed sampling policy stands in for the actors'.
        uniform = np.full(TINY_ARCHITECTURE.vocab_size, 1.0 / TINY_ARCHITECTURE.vocab_size)
        groups = bandit_groups(self.learner_ref[0], self.rng, groups=max_groups, probs=uniform)
        reported = self.versions[-1] if self.versions else 0  # the buffer's version: the last one reported
        return SampledBatch(uuid.uuid4().hex, with_reward_spread(groups), reported)  # Group stands in for SampledGroup

    def commit(self, batch_id: str) -> None:
        self.committed.append(batch_id)

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
        self.versions.append(version)


def test_run_loop_commits_publishes_checkpoints_and_resumes(tmp_path: Path) -> None:
    from stoker.learner.metrics import MetricsSink
    from stoker.weights.channel import WeightPublisher

    weights_dir = tmp_path / "weights"
    buffer = ScriptedBuffer()
    learner = Learner(settings(tmp_path, learner={"publishIntervalSteps": 2}))
    buffer.learner_ref.append(learner)
    with WeightPublisher(directory=weights_dir, keep=2) as publisher, MetricsSink(tmp_path / "m.jsonl") as sink:
        made = learner.run(buffer, publisher, max_steps=4, sink=sink)
        assert sink.registry.get_sample_value("stoker_learner_policy_version") == 4
        assert 0 < sink.registry.get_sample_value("stoker_learner_duty_cycle") <= 1  # type: ignore[operator]
        assert sink.registry.get_sample_value("stoker_learner_steps_total") == 4
    learner.close()
    assert made == 4 and learner.version == 4
    assert len(buffer.committed) == 4
    # Every second version, reported after it is published; newest wins if publishing falls behind.
    assert buffer.versions[0] == 0 and buffer.versions[-1] == 4 and set(buffer.versions) <= {0, 2, 4}
    assert buffer.versions == sorted(set(buffer.versions))
    reported_before_restart = len(buffer.versions)
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [line["policy_version"] for line in lines] == [1, 2, 3, 4]
    assert all(0 < line["duty_cycle"] <= 1 for line in lines)
    assert {"tokens_per_second", "compilations", "padding_waste", "is_weight_mean", "reward_mean"} <= set(lines[0])
    with WeightSubscriber(directory=weights_dir) as sub:
        version, flat = sub.fetch_latest()  # type: ignore[misc]
    assert version == 4
    np.testing.assert_allclose(flat["model.norm.weight"], np.asarray(learner.trainer.params["policy"]["norm"]["weight"][...]))

    # A restarted learner picks up at step 4 and keeps counting.
    resumed = Learner(settings(tmp_path, learner={"publishIntervalSteps": 2}))
    buffer.learner_ref[0] = resumed
    with WeightPublisher(directory=weights_dir, keep=2) as publisher:
        stop = threading.Event()
        assert resumed.run(buffer, publisher, max_steps=6, stop=stop) == 2
    assert resumed.version == 6
    assert buffer.versions[reported_before_restart:] in ([4, 6], [6])
    resumed.close()


def test_run_loop_logs_sample_episodes_and_what_was_sampled(tmp_path: Path) -> None:
    from stoker.learner.metrics import MetricsSink
    from stoker.learner.samples import SampleLog

    buffer = ScriptedBuffer()
    learner = Learner(settings())
    buffer.learner_ref.append(learner)
    with MetricsSink(tmp_path / "m.jsonl") as sink:
        sink.attach_samples(SampleLog(tmp_path / "samples.jsonl", lambda ids: " ".join(map(str, ids)), every=1))
        assert learner.run(buffer, max_steps=2, sink=sink) == 2
    learner.close()
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["rank"]) for r in samples] == [(1, "best"), (1, "worst"), (2, "best"), (2, "worst")]
    assert all(r["completion"] and r["prompt"] for r in samples) and samples[0]["reward"] > samples[1]["reward"]
    lines = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert all(line["sampled_tokens"] >= line["trained_tokens"] > 0 for line in lines)
    assert all(line["completion_tokens_mean"] > 0 and "truncation_rate" in line for line in lines)


def test_publishing_that_falls_behind_skips_to_the_newest_weights(tmp_path: Path) -> None:
    """Training goes on while weights are published; a slow publisher gets the newest version next,
    not a backlog, and the buffer still hears of every version, each after weights that new."""
    published: list[int] = []
    release = threading.Event()

    class SlowPublisher:
        latest_version = -1

        def publish(self, version: int, flat: object) -> None:
            release.wait(timeout=60)  # a slow disk or network: the first publish outlasts 3 steps
            published.append(version)
            self.latest_version = version

    class ReleaseAfter:
        def record(self, metrics: dict[str, float]) -> None:
            if metrics.get("policy_version") == 3:
                release.set()

    buffer = ScriptedBuffer()
    learner = Learner(settings(tmp_path))
    buffer.learner_ref.append(learner)
    assert learner.run(buffer, SlowPublisher(), max_steps=3, sink=ReleaseAfter()) == 3
    assert published == [3] or published == [0, 3]  # v0 may start before training does
    assert buffer.versions == [0, 1, 2, 3]
    assert len(buffer.committed) == 3
    learner.close()


def test_a_lost_lease_is_not_fatal(grpo_learner: Learner) -> None:
    """A batch whose lease ran out during training is redelivered by the buffer; keep going."""
    from stoker.buffer.client import LeaseLostError

    class LosingBuffer(ScriptedBuffer):
        def commit(self, batch_id: str) -> None:
            raise LeaseLostError(f"batch {batch_id} is not leased")

    buffer = LosingBuffer()
    buffer.learner_ref.append(grpo_learner)
    start = grpo_learner.steps
    assert grpo_learner.run(buffer, max_steps=start + 2) == 2
    assert buffer.versions[-1] == grpo_learner.version


def test_a_stop_with_the_buffer_gone_checkpoints_and_returns(tmp_path: Path) -> None:
    """``stoker run`` stops the learner when the buffer dies; every commit would then retry for the
    client's whole deadline. The learner must still write its final checkpoint and exit promptly."""
    stop, gone = threading.Event(), threading.Event()

    class DyingBuffer(ScriptedBuffer):
        def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch:
            if gone.is_set():
                threading.Event().wait(120)  # retrying against an unreachable buffer
            return super().sample(max_groups, min_groups, timeout)

        def commit(self, batch_id: str) -> None:
            if len(self.committed) == 1:  # the buffer dies after the first commit ...
                gone.set()
                stop.set()  # ... and the runner stops the learner
            if gone.is_set():
                threading.Event().wait(120)
            super().commit(batch_id)

    buffer = DyingBuffer()
    learner = Learner(settings(tmp_path, learner={"checkpoint": {"intervalSteps": 100}}))
    buffer.learner_ref.append(learner)
    started = time.monotonic()
    learner.run(buffer, max_steps=50, stop=stop)
    assert time.monotonic() - started < 60  # two stop waits, not the buffer's 120 s
    assert 2 <= learner.steps < 50
    steps = learner.steps
    learner.close()
    resumed = Learner(settings(tmp_path, learner={"checkpoint": {"intervalSteps": 100}}))
    assert resumed.resumed and resumed.steps == steps  # the final checkpoint was written
    resumed.close()


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


def test_settings_from_spec_resolve_paths(tmp_path: Path) -> None:
    spec = RLJobSpec.model_validate(
        {"learner": {"compilationCacheDir": "cache", "checkpoint": {"dir": "ck"}}, "algorithm": {"name": "gspo"}}
    )
    s = LearnerSettings.from_spec(spec, run_dir=tmp_path)
    assert s.checkpoint_dir == str(tmp_path / "ck")
    assert s.compilation_cache_dir == str(tmp_path / "cache")
    assert s.algorithm == "gspo" and s.microbatch_tokens_on("cpu") == 4 * max(spec.learner.sequence_buckets)
    assert s.loss.clip_high == spec.algorithm.clip_epsilon


def test_settings_hold_the_spec_and_only_what_it_cannot_say(tmp_path: Path) -> None:
    """A value the spec holds is read from it, never overridden beside it; --max-steps stops the
    run early but leaves the schedule decaying over learner.maxSteps."""
    spec = tiny_spec(algorithm={"learningRateSchedule": {"kind": "cosine"}}, learner={"maxSteps": 40})
    s = LearnerSettings.from_spec(spec, run_dir=tmp_path, max_steps=3, checkpoint_dir=None)
    assert s.spec is spec and s.max_steps == 3 and s.checkpoint_dir is None
    assert s.optimizer.decay_steps == 40 and s.buckets == (8, 16) and s.architecture == TINY_ARCHITECTURE
    with pytest.raises(TypeError):
        LearnerSettings.from_spec(spec, buckets=(8,))
    sft = LearnerSettings.from_spec(tiny_spec(algorithm={"name": "sft", "sft": {"dataset": "d.jsonl"}},
                                              actors={"sampling": {"temperature": 0.7}}))
    assert sft.sft is not None and sft.sft.dataset == "d.jsonl" and sft.temperature == 1.0


def test_dpo_dataset_pairs(tmp_path: Path) -> None:
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        "\n".join(json.dumps({"prompt_ids": PROMPT, "chosen_ids": [GOOD], "rejected_ids": [t]}) for t in (0, 4, 5, 6))
    )
    pairs = load_dpo_pairs(path)
    learner = Learner(settings(algorithm={"name": "dpo", "dpoDataset": str(path)}, learner={"batchGroups": 4}))
    before = next_token_probs(learner)[GOOD]
    assert learner.run(None, max_steps=8) == 8
    assert next_token_probs(learner)[GOOD] > max(before + 0.2, 0.5)
    assert len(pairs) == 4 and pairs[0][0].pair_sign == 1 and not pairs[0][0].behaviour_known
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1], "chosen_ids": "x", "rejected_ids": [2]}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: chosen_ids must be a list"):
        load_dpo_pairs(bad)


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


def two_bucket_groups(learner: Learner, rng: np.random.Generator) -> list[Group]:
    """Two groups that fill both of ``settings()``'s buckets: eight 13-token episodes take the
    8 rows of 16 (3 tokens left in each), eight 6-token ones then take a micro-batch of 8."""
    groups = []
    for g, n in enumerate([13, 6]):
        episodes = []
        for i in range(8):
            mask = np.zeros(n, np.uint8)
            mask[2:] = 1
            episodes.append(
                Episode(
                    episode_id=f"{g}-{i}", group_id=f"g{g}", group_size=8, task_id="t",
                    token_ids=rng.integers(0, 8, n).astype(np.int32), loss_mask=mask,
                    logprobs=np.where(mask, -1.0, 0.0).astype(np.float32),
                    policy_versions=np.where(mask, learner.version, -1).astype(np.int32),
                    reward=float(i % 2), status=1,
                )
            )
        groups.append(Group(episodes))
    return groups


@pytest.mark.slow  # ~7 s in this file (its programs are the other tests'), ~23 s alone
def test_steps_after_the_first_compile_nothing() -> None:
    """A step compiles each bucket's program once; later steps (new versions, new scalars, a weights
    copy for publishing each time) reuse every program. A recompile per step would be a silent
    many-fold slowdown, so this counts XLA compilations through jax.monitoring, not time."""
    from collections import Counter

    from stoker.learner.metrics import CompileCounter

    counter = CompileCounter.install()
    learner = Learner(settings())
    rng = np.random.default_rng(7)

    def step() -> None:
        assert learner.train_on(two_bucket_groups(learner, rng))["trained"]
        jax.block_until_ready(learner.trainer.policy_copy())

    before = Counter(counter.by_function)
    step()
    first = Counter(counter.by_function) - before
    assert first["jit(_grad_impl)"] == 2 and first["jit(_apply_impl)"] == 1, first  # one per bucket; one update
    for _ in range(3):
        step()
    assert Counter(counter.by_function) - before == first, "a later step compiled again"
    assert learner.version == 4

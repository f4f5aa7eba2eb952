"""The bandit the learner's tests train on: its settings, its episodes, and a scripted buffer.

One prompt, one sampled token, reward 1 for ``GOOD``: a tiny policy learns it in a few updates, so
the tests can check that the learner really learns, not only that it runs."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from stoker.buffer.client import SampledBatch
from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import TINY_ARCHITECTURE, tiny_spec
from stoker.trajectory import Episode

# The bandit's job: two buckets, and a learning rate that moves the tiny policy in a few updates.
BANDIT_JOB = {
    "learner": {"sequenceBuckets": [8, 16], "microbatchTokens": 128, "batchGroups": 2, "checkpoint": {"intervalSteps": 2}},
    "algorithm": {"learningRate": 0.05},
    "buffer": {"groupSize": 8},
}
PROMPT = [1, 2]
GOOD = 3  # the bandit pays 1 for this token


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


def with_reward_spread(groups: list[Group]) -> list[Group]:
    """Alternate rewards 0/1 in every group, so that no group is left out for lack of signal."""
    for group in groups:
        for j, ep in enumerate(group.episodes):
            ep.reward = float(j % 2)
    return groups


@dataclass
class ScriptedBuffer:
    """An in-process stand-in for the buffer client, recording the learner's calls."""

    learner_ref: list[Learner] = field(default_factory=list)
    committed: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # commits and version reports, in order
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
        self.calls.append(f"commit {batch_id}")

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
        self.versions.append(version)
        self.calls.append(f"version {version}")

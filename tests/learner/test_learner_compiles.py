"""The learner compiles little: one program per bucket, and nothing after the first step."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.trajectory import Episode
from tests.learner.bandit import settings

pytestmark = pytest.mark.usefixtures("xla_cache")  # programs shared across learners


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

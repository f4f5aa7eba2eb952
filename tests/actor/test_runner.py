"""The actor loop against a real buffer server: admission, whole groups, weight sync."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from stoker.actor.diagnostics import LoadReading
from stoker.actor.environments import Observation, StepResult
from stoker.actor.episode import FAILED
from stoker.actor.policy import BatchedSampler, ScriptedPolicy
from stoker.actor.runner import Actor, Grant
from stoker.actor.process_sandbox import process_factory
from stoker.actor.sandbox import inline_factory
from stoker.actor.settings import ActorSettings
from stoker.conversation.tokenization import TextInterface
from stoker.actor.wiring import GrpcBuffer
from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.spec import BufferSpec, RLJobSpec
from stoker.trajectory import Episode

pytestmark = pytest.mark.asyncio

G = 4


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BufferServer]:
    # Budget (maxStaleness + version + 1) * batchGroups = 1 group at policy version 0.
    settings = BufferSettings(group_size=G, max_staleness=0, batch_groups=1, retry_after_seconds=0.05, sync="none")
    buffer = BufferServer(settings, tmp_path / "wal").start()
    yield buffer
    buffer.stop(grace=0.1)


def settings_for(spec: RLJobSpec, **changes: object) -> ActorSettings:
    base = ActorSettings.from_spec(spec, actor_id="actor-test", job="t")
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


async def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_admission_refusal_holds_groups_until_credit(server: BufferServer, lake: TextInterface, lake_expert) -> None:  # type: ignore[no-untyped-def]
    spec = RLJobSpec(buffer=BufferSpec(group_size=G))
    settings = settings_for(spec, max_groups=2, concurrency=8)
    client = BufferClient(f"127.0.0.1:{server.port}", client_id="actor-test")
    learner = BufferClient(f"127.0.0.1:{server.port}", learner_id="learner")
    policy = ScriptedPolicy(lake_expert)
    actor = Actor(settings, policy, lake, inline_factory(settings.sandbox), GrpcBuffer(client))
    running = asyncio.create_task(actor.run())
    await wait_for(lambda: actor.stats.admission_refusals >= 3 and actor.stats.groups_submitted == 1)
    assert actor.stats.groups_started == 1  # refused credit: the second group never started
    # The learner trains on the first group and publishes version 1: one more group of credit.
    # The commit alone already frees it (the buffer cannot tell an update from a batch without
    # one until the version arrives), so the policy is at version 1 before the commit: a group
    # granted in between samples with it too, and is not stale once version 1 is reported.
    first = await asyncio.to_thread(learner.sample, 1, 1, 5.0)
    assert first is not None and len(first.groups) == 1
    policy.version = 1
    await asyncio.to_thread(learner.commit, first.batch_id)
    await asyncio.to_thread(learner.set_policy_version, 1)
    stats = await asyncio.wait_for(running, 20)
    assert stats.groups_submitted == 2 and stats.episodes == 2 * G
    second = await asyncio.to_thread(learner.sample, 1, 1, 5.0)
    assert second is not None
    for group in [*first.groups, *second.groups]:
        assert len(group.episodes) == G and not group.masked
        assert all(e.metrics["success"] == 1.0 for e in group.episodes)
    client.close()
    learner.close()


class MemoryBuffer:
    """An in-memory BufferPort that refuses the first ``refusals`` acquisitions."""

    def __init__(self, refusals: int = 0):
        self.refusals = refusals
        self.groups: list[list[Episode]] = []

    async def acquire(self, groups: int, load: LoadReading | None = None) -> Grant:
        if self.refusals:
            self.refusals -= 1
            return Grant(0, 0.01)
        return Grant(groups)

    async def put(self, episodes: list[Episode]) -> None:
        self.groups.append(episodes)

    async def release(self, groups: int) -> None:
        return None


async def test_failed_sandboxes_still_submit_whole_groups(lake: TextInterface) -> None:
    spec = RLJobSpec(buffer=BufferSpec(group_size=3))
    settings = settings_for(spec, max_groups=2)
    broken = dataclasses.replace(settings.sandbox, memory_mb=24)  # cannot start: every episode fails
    buffer = MemoryBuffer(refusals=2)
    factory = process_factory(broken)
    actor = Actor(settings, ScriptedPolicy(lambda _: [0]), lake, factory, buffer)
    stats = await asyncio.wait_for(actor.run(), 30)
    await factory.aclose()
    assert stats.admission_refusals == 2 and len(buffer.groups) == 2
    for group in buffer.groups:
        assert len(group) == 3 and all(e.status == FAILED and e.status_reason for e in group)


class StragglerLake:
    """A one-step environment whose episode 0 of every group (seed ending in 000) waits for
    ``release`` before its first step: each group's straggler."""

    def __init__(self, release: asyncio.Event, running: list[int]):
        self.release, self.running = release, running

    async def reset(self, task_id: str, seed: int) -> Observation:
        self.running[0] += 1
        self.running[1] = max(self.running[1], self.running[0])
        if seed % 1000 == 0:
            await self.release.wait()
        return Observation("P F G .")

    async def step(self, action: str) -> StepResult:
        return StepResult(Observation("done"), 1.0, terminated=True)

    async def close(self) -> None:
        self.running[0] -= 1


async def test_a_groups_straggler_holds_one_slot_not_the_groups(lake: TextInterface) -> None:
    # 8 episode slots, groups of 4, and every group's first episode hangs until released. Its
    # three siblings end at once, so a group left running holds one slot: new groups keep starting
    # until the stragglers fill all 8 slots (counting running groups, as the actor did before,
    # stopped at 3 groups with 5 slots idle).
    spec = RLJobSpec(buffer=BufferSpec(group_size=4))
    settings = settings_for(spec, max_groups=12, concurrency=8)
    release, running = asyncio.Event(), [0, 0]

    async def factory() -> StragglerLake:
        return StragglerLake(release, running)

    buffer = MemoryBuffer()
    actor = Actor(settings, ScriptedPolicy(lambda _: [lake.tokenizer.get_vocab()["up"]]), lake, factory, buffer)
    task = asyncio.create_task(actor.run())
    await wait_for(lambda: running[0] == 8, timeout=5)
    for _ in range(50):  # event-loop turns: the chance a ninth group must not take
        await asyncio.sleep(0)
    assert actor.stats.groups_started == 8 and running[0] == 8  # every slot busy, no group waiting
    release.set()
    stats = await asyncio.wait_for(task, 20)
    assert stats.groups_submitted == 12 and running[1] == 8  # never more than the limit at once
    assert all(len(group) == 4 for group in buffer.groups)


class Weights:
    """A weight channel whose latest version the test controls."""

    def __init__(self) -> None:
        self.latest = 0

    def latest_version(self) -> int:
        return self.latest

    def fetch(self, version: int) -> dict[str, np.ndarray]:
        return {"v": np.array([version])}


class CountingSampler:
    keeps_sessions = False
    min_batch = 1

    def __init__(self, move: int):
        self.move = move
        self.version = 0
        self.loads: list[int] = []

    def load_weights(self, flat: dict[str, np.ndarray], version: int) -> None:
        self.loads.append(int(flat["v"][0]))
        self.version = version

    def generate(self, prompts, *, max_new_tokens, stop_token_ids=(), sessions=None):  # type: ignore[no-untyped-def]
        from stoker.rollout.sampling import Generation

        return [Generation([self.move], [-0.3], True, self.version) for _ in prompts]


async def test_actor_pulls_newer_weights(lake: TextInterface) -> None:
    spec = RLJobSpec(buffer=BufferSpec(group_size=2))
    settings = settings_for(spec, max_groups=40, weight_poll_seconds=0.01)
    sampler = CountingSampler(lake.tokenizer.get_vocab()["up"])  # "up" never reaches the goal
    policy = BatchedSampler(sampler)
    weights = Weights()
    buffer = MemoryBuffer()
    actor = Actor(settings, policy, lake, inline_factory(settings.sandbox), buffer, weights=weights, loader=policy)
    running = asyncio.create_task(actor.run())
    await wait_for(lambda: len(buffer.groups) >= 2)
    weights.latest = 5
    await wait_for(lambda: sampler.version == 5)
    stats = await asyncio.wait_for(running, 30)
    await policy.close()
    assert sampler.loads == [5] and stats.weight_updates == 1
    episodes = [e for g in buffer.groups for e in g]
    seen = {tuple(sorted(set(e.policy_versions[e.loss_mask == 1].tolist()))) for e in episodes}
    assert (0,) in seen and (5,) in seen


class PublishingBuffer(MemoryBuffer):
    """Grants credit at its version, as the buffer answers an Acquire; the first group submitted
    is trained at once: version 5 is published to ``weights`` and then reported."""

    def __init__(self, weights: Weights):
        super().__init__()
        self.weights, self.version = weights, 0

    async def acquire(self, groups: int, load: LoadReading | None = None) -> Grant:
        return Grant(groups, policy_version=self.version)

    async def put(self, episodes: list[Episode]) -> None:
        await super().put(episodes)
        self.weights.latest = self.version = 5


async def test_a_group_granted_at_a_new_version_starts_on_its_weights(lake: TextInterface) -> None:
    # The poll would not look again for an hour: only the grant's version can make the actor
    # fetch version 5 before its next group (one version fresher than the poll would give it).
    spec = RLJobSpec(buffer=BufferSpec(group_size=2))
    settings = settings_for(spec, max_groups=3, concurrency=2, weight_poll_seconds=3600.0)
    sampler = CountingSampler(lake.tokenizer.get_vocab()["up"])
    policy = BatchedSampler(sampler)
    weights = Weights()
    buffer = PublishingBuffer(weights)
    actor = Actor(settings, policy, lake, inline_factory(settings.sandbox), buffer, weights=weights, loader=policy)
    stats = await asyncio.wait_for(actor.run(), 30)
    await policy.close()
    versions = [sorted({int(v) for e in g for v in e.policy_versions[e.loss_mask == 1]}) for g in buffer.groups]
    # The second group may be granted before the first is submitted; the last one is not.
    assert versions[0] == [0] and versions[-1] == [5] and sampler.loads == [5] and stats.weight_updates == 1


async def test_between_episodes_keeps_each_episode_on_its_first_weights(
    lake: TextInterface, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="stoker.actor")
    from stoker.actor.wiring import make_policy
    from stoker.model.model import init_model
    from stoker.weights.channel import flatten_params
    from stoker.spec import ActorsSpec, EnvironmentSpec, SamplingSpec, StepLatency

    # The real sampler, allowed only "up" (which never reaches the goal: every episode plays all
    # its 8 turns of at least 0.05 s each), so the swap lands inside running episodes.
    sampling = SamplingSpec(max_new_tokens=1, allowed_tokens=["up"])
    spec = RLJobSpec(
        buffer=BufferSpec(group_size=2),
        actors=ActorsSpec(sampling=sampling, weight_sync="between-episodes"),
        environment=EnvironmentSpec(step_latency=StepLatency(distribution="fixed", seconds=0.05)),
    )
    settings = settings_for(spec, max_groups=12, concurrency=8, weight_poll_seconds=0.01)
    new_weights = flatten_params(init_model(settings.model, seed=5))

    class RealWeights(Weights):
        def fetch(self, version: int) -> dict[str, np.ndarray]:
            return new_weights

    policy = make_policy(settings)
    weights, buffer = RealWeights(), MemoryBuffer()
    actor = Actor(settings, policy, lake, inline_factory(settings.sandbox), buffer, weights=weights, loader=policy)
    running = asyncio.create_task(actor.run())
    await wait_for(lambda: policy.stats.calls >= 3, timeout=120)
    weights.latest = 5
    await wait_for(lambda: policy.version == 5, timeout=120)
    swapped = time.time()
    stats = await asyncio.wait_for(running, 120)
    await policy.close()
    assert stats.weight_updates == 1
    episodes = [e for g in buffer.groups for e in g]
    seen = [set(e.policy_versions[e.loss_mask == 1].tolist()) for e in episodes]
    assert {5} in seen and all(len(v) == 1 for v in seen)
    # Episodes running at the swap finished on version 0: it never reached their later turns.
    assert any(v == {0} and e.finished_unix > swapped for v, e in zip(seen, episodes, strict=True))
    # Every turn after an episode's first prefilled only its new tokens -- and the progress log says so.
    assert policy.sampler.cache_stats.reuse > 0.5  # type: ignore[attr-defined]
    progress = [r.getMessage() for r in caplog.records if "groups," in r.getMessage()]
    assert progress and re.search(r"sampler: busy \d+% of the time, [\d.]+ rows per call, (\d+)% of prompt tokens cached", progress[-1])
    assert int(re.search(r"(\d+)% of prompt", progress[-1]).group(1)) > 50  # type: ignore[union-attr]


async def test_weights_that_cannot_load_stop_the_actor_loudly(lake: TextInterface) -> None:
    class Incompatible(CountingSampler):
        def load_weights(self, flat: dict[str, np.ndarray], version: int) -> None:
            raise ValueError("model.embed_tokens.weight: shape (8, 4) does not match (27, 64)")

    spec = RLJobSpec(buffer=BufferSpec(group_size=2))
    settings = settings_for(spec, max_groups=None, weight_poll_seconds=0.01)
    policy = BatchedSampler(Incompatible(lake.tokenizer.get_vocab()["up"]))
    weights = Weights()
    weights.latest = 1
    actor = Actor(settings, policy, lake, inline_factory(settings.sandbox), MemoryBuffer(), weights=weights, loader=policy)
    with pytest.raises(ValueError, match="does not match"):
        await asyncio.wait_for(actor.run(), 30)  # no max_groups: only the failure ends it
    await policy.close()


async def test_a_stopping_actor_does_not_wait_for_a_buffer_that_is_gone(lake: TextInterface) -> None:
    """The buffer dies, then the actor is told to stop: Puts (and admission) retrying against it
    for the client's whole deadline must not hold the actor until it is killed."""
    from stoker.actor import runner

    class DeadBuffer(MemoryBuffer):
        def __init__(self) -> None:
            super().__init__()
            self.dead = False

        async def acquire(self, groups: int, load: LoadReading | None = None) -> Grant:
            if self.dead:
                await asyncio.Event().wait()  # retrying against an unreachable buffer
            return await super().acquire(groups)

        async def put(self, episodes: list[Episode]) -> None:
            if self.dead:
                await asyncio.Event().wait()
            await super().put(episodes)

    spec = RLJobSpec(buffer=BufferSpec(group_size=2))
    settings = settings_for(spec, concurrency=4)
    buffer = DeadBuffer()
    actor = Actor(settings, ScriptedPolicy(lambda _: [0]), lake, inline_factory(settings.sandbox), buffer)
    running = asyncio.create_task(actor.run())
    await wait_for(lambda: len(buffer.groups) >= 2)
    buffer.dead = True
    await wait_for(lambda: actor.stats.groups_started > len(buffer.groups) + 1)  # groups finishing into a dead buffer
    stopped = time.monotonic()
    actor.stop()
    stats = await asyncio.wait_for(running, 30)
    assert time.monotonic() - stopped <= runner.STOP_SUBMIT_SECONDS + 5
    assert stats.abandoned_groups >= 1 and stats.groups_submitted == len(buffer.groups)

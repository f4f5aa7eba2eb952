"""The learner reports its duty cycle with every policy version it reports to the buffer (the
operator's starvation check reads it from the buffer's Stats), and nothing before its first step."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from stoker.buffer.client import BufferClient, SampledBatch
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.learner.batches import Group
from stoker.learner.loop import Learner
from stoker.learner.settings import LearnerSettings
from stoker.learner.testing import tiny_spec
from stoker.trajectory import Episode

GROUP_SIZE = 4
BATCH_GROUPS = 2

pytestmark = pytest.mark.usefixtures("xla_cache")  # programs shared with the other learner tests


@pytest.fixture(scope="module")
def learner() -> Learner:
    """One learner for the module; each test runs it a few steps further."""
    spec = tiny_spec(
        learner={"sequenceBuckets": [8, 16], "microbatchTokens": 128, "batchGroups": BATCH_GROUPS},
        algorithm={"learningRate": 0.05}, buffer={"groupSize": GROUP_SIZE},
    )
    return Learner(LearnerSettings.from_spec(spec, checkpoint_dir=None))


def bandit_group(rng: np.random.Generator, version: int) -> list[Episode]:
    """Prompt [1, 2] + one token drawn uniformly; rewards alternate 1/0, so every group trains."""
    group_id = uuid.uuid4().hex
    episodes = []
    for index in range(GROUP_SIZE):
        token = int(rng.integers(0, 8))
        episodes.append(
            Episode(
                episode_id=uuid.uuid4().hex, group_id=group_id, group_size=GROUP_SIZE, task_id="bandit",
                token_ids=np.asarray([1, 2, token], np.int32), loss_mask=np.asarray([0, 0, 1], np.uint8),
                logprobs=np.asarray([0, 0, -np.log(8)], np.float32),
                policy_versions=np.asarray([-1, -1, version], np.int32),
                reward=float(index % 2 == 0), status=1,
            )
        )
    return episodes


@dataclass
class RecordingSource:
    """A BatchSource that hands out fresh bandit batches and records every version report."""

    learner: Learner
    reports: list[tuple[int, float | None]] = field(default_factory=list)
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch:
        groups = [Group(bandit_group(self.rng, self.learner.version)) for _ in range(max_groups)]
        reported = self.reports[-1][0] if self.reports else 0
        return SampledBatch(uuid.uuid4().hex, groups, reported)  # Group stands in for SampledGroup: same fields

    def commit(self, batch_id: str) -> None:
        pass

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
        self.reports.append((version, duty_cycle))


@dataclass
class StarvingSource(RecordingSource):
    """Batches only on the sample calls listed in ``fed``; otherwise nothing arrived in time."""

    fed: tuple[int, ...] = ()
    calls: int = 0

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch | None:
        self.calls += 1
        return super().sample(max_groups, min_groups, timeout) if self.calls in self.fed else None


@dataclass
class ListSink:
    records: list[dict[str, float]] = field(default_factory=list)

    def record(self, metrics: dict[str, float]) -> None:
        self.records.append(dict(metrics))


def test_each_version_report_carries_the_duty_cycle_of_that_step(learner: Learner) -> None:
    source, sink = RecordingSource(learner), ListSink()
    start = learner.version
    assert learner.run(source, None, max_steps=learner.steps + 3, sink=sink) == 3
    versions = [v for v, _ in source.reports]
    assert versions == [start, start + 1, start + 2, start + 3]
    # The report made before any step says nothing about the duty cycle ...
    assert source.reports[0][1] is None
    # ... and every later one carries exactly the value the step's metrics show.
    assert [d for _, d in source.reports[1:]] == [m["duty_cycle"] for m in sink.records]
    assert all(d is not None and 0.0 < d <= 1.0 for _, d in source.reports[1:])


def test_a_starved_learner_keeps_reporting_its_falling_duty_cycle(learner: Learner) -> None:
    """Without these reports the buffer would show the last step's duty cycle for as long as the
    learner waits, and the operator could never see it starving."""
    source = StarvingSource(learner, fed=(3, 4, 5, 8))  # empty samples before any step and after three
    start = learner.version
    assert learner.run(source, None, max_steps=learner.steps + 4) == 4
    reports = source.reports
    if reports and reports[0] == (start, None):
        reports = reports[1:]  # the start-up report (made unless an earlier run already made it)
    # No duty cycle at all while no step has been made; then one report per step, and one per
    # empty sample with the version already reported.
    assert [v for v, _ in reports] == [start + 1, start + 2, start + 3, start + 3, start + 3, start + 4]
    duties = [d for _, d in reports]
    stepped, idle_1, idle_2 = duties[-4], duties[-3], duties[-2]
    assert stepped is not None and idle_1 is not None and idle_2 is not None
    assert idle_2 <= idle_1 <= stepped  # busy time fixed, wall time growing


def test_the_buffer_shows_the_learners_duty_cycle_in_stats(learner: Learner, tmp_path: Path) -> None:
    """Through the real client and server on loopback, as the operator reads it."""
    settings = BufferSettings(group_size=GROUP_SIZE, batch_groups=BATCH_GROUPS, max_staleness=8, capacity=256)
    server = BufferServer(settings, tmp_path / "buffer", host="127.0.0.1", port=0).start()
    try:
        with BufferClient(f"127.0.0.1:{server.port}", learner_id="learner", client_id="actor") as client:
            client.wait_ready(10)
            rng = np.random.default_rng(1)
            client.set_policy_version(learner.version)
            for _ in range(2 * BATCH_GROUPS):
                client.put(bandit_group(rng, learner.version))
            assert not client.stats().HasField("learner_duty_cycle")
            sink = ListSink()
            source: Any = client
            assert learner.run(source, None, max_steps=learner.steps + 2, sink=sink) == 2
            stats = client.stats()
            assert stats.policy_version == learner.version
            assert stats.HasField("learner_duty_cycle")
            assert stats.learner_duty_cycle == pytest.approx(sink.records[-1]["duty_cycle"])
            assert 0.0 < stats.learner_duty_cycle <= 1.0
    finally:
        server.stop(grace=0)


@dataclass
class EvaluatedSource(RecordingSource):
    """Its Stats show held-out evaluation rounds; the first batch waits until they were read."""

    rounds: list[Any] = field(default_factory=list)
    stats_calls: int = 0
    read: Any = field(default_factory=threading.Event)

    def stats(self) -> Any:
        from stoker.v1 import buffer_pb2

        self.stats_calls += 1
        stats = buffer_pb2.BufferStats(policy_version=self.reports[-1][0] if self.reports else -1)
        stats.eval_rounds.extend(self.rounds)
        self.read.set()
        return stats

    def sample(self, max_groups: int, min_groups: int, timeout: float) -> SampledBatch:
        self.read.wait(10)
        return super().sample(max_groups, min_groups, timeout)


def test_the_newest_evaluation_round_goes_into_the_metrics_once(learner: Learner) -> None:
    from stoker.v1 import buffer_pb2

    round_0 = buffer_pb2.EvalRound(policy_version=0, episodes=8, success_rate=0.25, mean_reward=0.5)
    source, sink = EvaluatedSource(learner, rounds=[round_0]), ListSink()
    assert learner.run(source, None, max_steps=learner.steps + 3, sink=sink) == 3
    assert source.stats_calls >= 2  # read after each version report
    evaluated = [r for r in sink.records if "eval_success_rate" in r]
    assert len(evaluated) == 1  # an unchanged round is not written again
    assert {k: v for k, v in evaluated[0].items() if k.startswith("eval_")} == {
        "eval_policy_version": 0.0, "eval_success_rate": 0.25, "eval_reward_mean": 0.5, "eval_episodes": 8.0,
    }
    assert all("success_rate" in r for r in sink.records)  # the training success is its own figure

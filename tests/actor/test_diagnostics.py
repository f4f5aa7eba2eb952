"""What an actor's episodes tell the user: failure reasons with an example each, generation figures."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from pathlib import Path

import numpy as np
import pytest

from stoker.actor.diagnostics import (
    ActorDiagnostics, LoadMeter, LoadReading, combine, episode_time_line, failure_key, read_snapshots,
)
from stoker.actor.environments import Observation, StepResult
from stoker.actor.episode import FAILED, OK, TIMEOUT, TRUNCATED, EpisodeSlots
from stoker.actor.policy import ScriptedPolicy
from stoker.actor.runner import Actor, Grant
from stoker.actor.sandbox import SandboxFailed
from stoker.actor.settings import ActorSettings
from stoker.conversation.tokenization import TextInterface
from stoker.spec import BufferSpec, RLJobSpec
from stoker.trajectory import Episode


def episode(status: int, reason: str = "", sampled: int = 3, context: int = 2, turns: int = 1) -> Episode:
    n = sampled + context
    return Episode(
        episode_id="e", group_id="g", group_size=1, task_id="t",
        token_ids=np.zeros(n, np.int32), loss_mask=np.array([0] * context + [1] * sampled, np.uint8),
        logprobs=np.zeros(n, np.float32), policy_versions=np.zeros(n, np.int32),
        status=status, status_reason=reason, num_turns=turns,
    )


def test_one_bug_is_one_reason_and_keeps_its_first_full_message() -> None:
    diagnostics = ActorDiagnostics("a")
    first = "environment raised RuntimeError: bad cell 3 at turn 2\nTraceback (most recent call last):\n  line 9"
    new = diagnostics.add([
        episode(FAILED, first), episode(FAILED, "environment raised RuntimeError: bad cell 17 at turn 5"),
        episode(TIMEOUT, "episode exceeded its 300 s limit"), episode(OK), episode(TRUNCATED, "turn limit (8)"),
    ])
    key = failure_key(episode(FAILED, first))
    assert key == "failed: environment raised RuntimeError: bad cell N at turn N"
    assert new == [key, "timeout: episode exceeded its N s limit"]
    assert diagnostics.failures[key] == 2 and diagnostics.examples[key] == first  # traceback kept
    snapshot = diagnostics.snapshot()
    assert snapshot["failed_episodes"] == 3 and snapshot["episodes"] == 5
    assert snapshot["sampled_tokens"] == 15 and snapshot["completion_tokens_mean"] == 3.0
    assert snapshot["truncation_rate"] == pytest.approx(0.2)
    assert snapshot["failures"][0] == {"reason": key, "count": 2, "example": first}


def test_actors_combine_into_one_view() -> None:
    a, b = ActorDiagnostics("a"), ActorDiagnostics("b")
    a.add([episode(FAILED, "boom"), episode(OK, sampled=5)])
    b.add([episode(FAILED, "boom"), episode(TRUNCATED, sampled=1), episode(OK, sampled=1)])
    first, second = a.snapshot(), b.snapshot()
    both = combine([first, second])
    assert both["episodes"] == 5 and both["sampled_tokens"] == 3 + 5 + 3 + 1 + 1
    assert both["truncation_rate"] == pytest.approx(1 / 5)
    assert both["failures"] == [{"reason": "failed: boom", "count": 2, "example": "boom"}]
    # Each actor's rate is over its own wall time; the run's is their sum.
    assert both["sampled_tokens_per_second"] == first["sampled_tokens_per_second"] + second["sampled_tokens_per_second"]
    assert both["trajectories_per_second"] == first["trajectories_per_second"] + second["trajectories_per_second"]


class BrokenOnSecondTurn:
    """Steps once fine, then raises as a buggy environment plugin would (through the sandbox)."""

    def __init__(self) -> None:
        self.turn = 0

    async def reset(self, task_id: str, seed: int) -> Observation:
        return Observation("P F G .")

    async def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.turn == 2:
            raise SandboxFailed(f"environment raised RuntimeError: no cell {self.turn}\nTraceback: plugin.py line 7")
        return StepResult(Observation("P F G ."), 0.0, terminated=False)

    async def close(self) -> None:
        return None


class MemoryBuffer:
    def __init__(self) -> None:
        self.groups: list[list[Episode]] = []
        self.loads: list[LoadReading | None] = []  # what the actor sent with each Acquire

    async def acquire(self, groups: int, load: LoadReading | None = None) -> Grant:
        self.loads.append(load)
        return Grant(groups)

    async def put(self, episodes: list[Episode]) -> None:
        self.groups.append(episodes)

    async def release(self, groups: int) -> None:
        return None

    async def report_eval(self, outcome: object, report_id: str) -> None:
        return None


@pytest.mark.asyncio
async def test_an_actor_logs_and_writes_why_its_episodes_fail(
    lake: TextInterface, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    spec = RLJobSpec(buffer=BufferSpec(group_size=2))
    settings = dataclasses.replace(ActorSettings.from_spec(spec, actor_id="actor-0", job="t"), max_groups=3)

    async def factory() -> BrokenOnSecondTurn:
        return BrokenOnSecondTurn()

    vocab = lake.tokenizer.get_vocab()
    stats_file = tmp_path / "actors" / "actor-0.json"
    buffer = MemoryBuffer()
    actor = Actor(
        settings, ScriptedPolicy(lambda _: [vocab["right"]]), lake, factory, buffer,  # type: ignore[arg-type]
        stats_path=stats_file,
    )
    with caplog.at_level(logging.INFO, logger="stoker.actor"):
        await asyncio.wait_for(actor.run(), 30)
    # Every Acquire carries the actor's load (stoker.bottleneck reads it from the buffer's Stats).
    assert len(buffer.loads) == 3 and all(load is not None and load.concurrency == 8 for load in buffer.loads)
    [snapshot] = read_snapshots([stats_file])
    assert snapshot["episodes"] == 6 and snapshot["failed_episodes"] == 6
    [failure] = snapshot["failures"]
    assert failure["reason"] == "failed: environment raised RuntimeError: no cell N" and failure["count"] == 6
    assert "Traceback: plugin.py line 7" in failure["example"]
    assert snapshot["sampled_tokens"] == 6 * 2  # two model turns of one token each
    warnings = [r.getMessage() for r in caplog.records if "new reason" in r.getMessage()]
    assert len(warnings) == 1 and "Traceback: plugin.py line 7" in warnings[0]  # once, with its example
    assert any("6 x failed: environment raised RuntimeError" in r.getMessage() for r in caplog.records)
    assert json.loads(stats_file.read_text()) == snapshot  # whole JSON, written atomically


@pytest.mark.asyncio
async def test_an_inline_environments_crash_keeps_its_traceback_under_one_reason(lake: TextInterface) -> None:
    from stoker.actor.episode import run_episode, EpisodeLimits
    from stoker.actor.sandbox import InlineEnvironment

    class Buggy:
        def reset(self, task_id: str, seed: int) -> Observation:
            return Observation("P F G .")

        def step(self, action: str) -> StepResult:
            return {}["calc"]  # type: ignore[return-value]  # a plugin's bug

        def close(self) -> None:
            return None

    vocab = lake.tokenizer.get_vocab()
    episode = await run_episode(
        ScriptedPolicy(lambda _: [vocab["right"]]), InlineEnvironment(Buggy(), blocking=False), lake, "t",  # type: ignore[arg-type]
        seed=0, limits=EpisodeLimits(max_turns=2, max_new_tokens=1, max_tokens=256),
    )
    assert episode.status == FAILED
    assert failure_key(episode) == "failed: environment raised KeyError: 'calc'"
    assert "Traceback (most recent call last)" in episode.status_reason and "in step" in episode.status_reason
    assert len(episode.status_reason) < 4096  # what the buffer accepts


def test_recent_rates_fall_to_zero_while_an_actor_is_held_back() -> None:
    diagnostics = ActorDiagnostics("a", started=0.0)
    diagnostics.add([episode(OK, sampled=10)] * 3)
    assert diagnostics.recent_rates(10.0) == (3.0, 0.3)  # younger than the window: since the start
    assert diagnostics.recent_rates(40.0) == (0.0, 0.0)  # nothing new in the last 30 s
    diagnostics.add([episode(OK, sampled=10)] * 6)
    tokens, episodes = diagnostics.recent_rates(55.0)
    # Since the newest snapshot at least 30 s old (t=10): 60 tokens and 6 episodes in 45 s.
    assert (tokens, episodes) == pytest.approx((60 / 45, 6 / 45))


@pytest.mark.asyncio
async def test_the_stats_file_stays_current_while_admission_is_refused(lake: TextInterface, tmp_path: Path) -> None:
    class Refusing(MemoryBuffer):
        async def acquire(self, groups: int, load: LoadReading | None = None) -> Grant:
            return Grant(0, 0.05)

    spec = RLJobSpec(buffer=BufferSpec(group_size=2))
    settings = ActorSettings.from_spec(spec, actor_id="actor-0", job="t")
    stats_file = tmp_path / "actor-0.json"
    actor = Actor(settings, ScriptedPolicy(lambda _: [0]), lake, None, Refusing(), stats_path=stats_file)  # type: ignore[arg-type]
    running = asyncio.create_task(actor.run())
    async with asyncio.timeout(20):
        while not stats_file.exists():
            await asyncio.sleep(0.05)  # polling for the file the actor writes on its own
    [snapshot] = read_snapshots([stats_file])
    assert snapshot["episodes"] == 0 and snapshot["recent_sampled_tokens_per_second"] == 0.0
    actor.stop()
    await asyncio.wait_for(running, 10)


def test_refused_tampering_is_totalled_by_kind_and_shown_in_the_run_report(tmp_path: Path) -> None:
    from stoker.actor.diagnostics import write_snapshot
    from stoker.runner.report import _generation

    def tried(**kinds: float) -> Episode:
        e = episode(OK)
        e.metrics = {"success": 0.0, "tampering_attempts": sum(kinds.values()), **{f"tampering/{k}": v for k, v in kinds.items()}}
        return e

    a, b = ActorDiagnostics("a"), ActorDiagnostics("b")
    a.add([tried(frame_introspection=2.0), tried(), episode(OK)])  # the episode's last (cumulative) counts
    b.add([tried(frame_introspection=1.0, **{"always-equal_value": 1.0})])
    assert a.snapshot()["reward_tampering_total"] == {"frame_introspection": 2}
    both = combine([a.snapshot(), b.snapshot()])
    assert both["reward_tampering_total"] == {"frame_introspection": 3, "always-equal_value": 1}
    for diagnostics in (a, b):
        write_snapshot(tmp_path / "actors" / f"actor-{diagnostics.actor_id}.json", diagnostics.snapshot())
    report = "\n".join(_generation(tmp_path, []))
    assert "## Judge tampering (reward_tampering_total)" in report
    assert "| 3 | frame introspection |" in report and "| 1 | always-equal value |" in report


def test_the_load_meter_reads_cpu_and_episodes_in_flight_per_wall_second() -> None:
    now, cpu = [100.0], [5.0]
    slots = EpisodeSlots(8, clock=lambda: now[0])
    episodes = [0]
    meter = LoadMeter(8, slots.slot_seconds, lambda: episodes[0], clock=lambda: now[0], cpu=lambda: cpu[0])

    async def hold_two_for_ten_seconds() -> None:
        async with slots, slots:
            now[0] += 10.0
            cpu[0] += 9.0  # a busy actor: 0.9 cores
        episodes[0] += 2

    asyncio.run(hold_two_for_ten_seconds())
    now[0] += 10.0  # then ten idle seconds
    assert meter.read() == LoadReading(cpu_cores=0.45, episodes_in_flight=1.0, concurrency=8, trajectories_per_second=0.1)
    # The window moves on: the next reading 10 s later spans only the idle part.
    now[0] += 10.0
    assert meter.read() == LoadReading(cpu_cores=0.0, episodes_in_flight=0.0, concurrency=8, trajectories_per_second=0.0)


def test_the_report_says_where_the_episodes_time_went_over_all_actors() -> None:
    def timed(wall: float, sample: float, environment: float) -> Episode:
        e = episode(OK)
        return dataclasses.replace(
            e, started_unix=100.0, finished_unix=100.0 + wall, sample_seconds=sample, environment_seconds=environment
        )

    a, b = ActorDiagnostics("a"), ActorDiagnostics("b")
    assert episode_time_line(combine([a.snapshot()])) is None  # nothing to say before an episode
    a.add([timed(1.0, 0.2, 0.6), timed(1.0, 0.2, 0.6)])
    b.add([timed(2.0, 0.6, 0.8)])
    line = episode_time_line(combine([a.snapshot(), b.snapshot()]))
    assert line == (
        "an episode's wall time (mean 1.33 s): waiting for the sampler 25%, "
        "the environment 50% (its sandbox's start included), the rest 25%"
    )

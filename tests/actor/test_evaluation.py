"""Held-out evaluation rounds in the actor: greedy, every k versions, on a share of the slots,
reported to a real buffer, and never trained on."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from stoker.actor.environments import Observation, StepResult
from stoker.actor.evaluation import EvalPlan, round_due
from stoker.conversation.policy import Sampled
from stoker.actor.policy import ScriptedPolicy
from stoker.actor.runner import Actor
from stoker.actor.sandbox import EnvironmentFactory, inline_factory
from stoker.actor.settings import ActorSettings
from stoker.conversation.tokenization import TextInterface
from stoker.actor.wiring import GrpcBuffer
from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.manifest import validate_document
from stoker.actor.job_checks import environment_problems
from stoker.spec import BufferSpec, RLJobSpec

pytestmark = pytest.mark.asyncio

G = 2
TRAINING = {"0", "1", "2", "3"}  # the default FrozenLake map seeds
HELD_OUT = ("7", "9")


class GreedyExpert(ScriptedPolicy):
    """Walks the lake well only when asked greedily (temperature 0); sampled turns walk into the
    wall. So evaluation success says which turns were greedy."""

    def __init__(self, expert: Callable[[Sequence[int]], list[int]], wall: list[int]):
        super().__init__(expert)
        self.expert, self.wall = expert, wall

    async def generate(
        self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int],
        session: Hashable = None, temperature: float | None = None,
    ) -> Sampled:
        self.respond = self.expert if temperature == 0.0 else (lambda _: self.wall)
        return await super().generate(
            prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, session=session, temperature=temperature
        )


class Watched:
    """An environment factory that tracks how many evaluation episodes run at once."""

    def __init__(self, factory: EnvironmentFactory):
        self.factory, self.running, self.most = factory, 0, 0

    async def __call__(self) -> Any:
        env = await self.factory()
        watcher = self

        class Env:
            task = ""

            async def reset(self, task_id: str, seed: int) -> Observation:
                self.task = task_id
                if task_id in HELD_OUT:
                    watcher.running += 1
                    watcher.most = max(watcher.most, watcher.running)
                return await env.reset(task_id, seed)

            async def step(self, action: str) -> StepResult:
                await asyncio.sleep(0.001)  # let the other episodes interleave
                return await env.step(action)

            async def close(self) -> None:
                if self.task in HELD_OUT:
                    watcher.running -= 1
                await env.close()

        return Env()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[BufferServer]:
    settings = BufferSettings(group_size=G, max_staleness=8, batch_groups=4, retry_after_seconds=0.05, sync="none")
    buffer = BufferServer(settings, tmp_path / "wal").start()
    yield buffer
    buffer.stop(grace=0.1)


async def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_rounds_are_greedy_every_k_versions_on_their_share_and_never_trained_on(
    server: BufferServer, lake: TextInterface, lake_expert: Callable[[Sequence[int]], list[int]]
) -> None:
    spec = RLJobSpec(buffer=BufferSpec(group_size=G))
    base = ActorSettings.from_spec(spec, actor_id="actor-e", job="t")
    # Rounds of G episodes per task: a leaked round would be a valid group the buffer accepts.
    plan = EvalPlan(tasks=HELD_OUT, every_versions=2, slots=2, episodes_per_task=G)
    settings = dataclasses.replace(base, concurrency=6, evaluation=plan, weight_poll_seconds=0.02)
    policy = GreedyExpert(lake_expert, [lake.tokenizer.get_vocab()["left"]])
    client = BufferClient(f"127.0.0.1:{server.port}", client_id="actor-e")
    watched = Watched(inline_factory(settings.sandbox))
    actor = Actor(settings, policy, lake, watched, GrpcBuffer(client))
    running = asyncio.create_task(actor.run())

    def rounds() -> list[int]:
        return [r.policy_version for r in client.stats().eval_rounds]

    await wait_for(lambda: rounds() == [0])
    for version, expected in ((1, [0]), (3, [0, 2]), (7, [0, 2, 6])):  # 7 skips round 4: one round per check
        policy.version = version
        await wait_for(lambda: len(actor.stats.eval_rounds) == len(expected) and actor.stats.groups_submitted >= 2 * version)
        assert rounds() == expected
    actor.stop()
    stats = await asyncio.wait_for(running, 30)

    eval_rounds = list(client.stats().eval_rounds)
    assert [(r.episodes, r.reports) for r in eval_rounds] == [(2 * G, 1)] * 3
    assert all(r.success_rate == 1.0 for r in eval_rounds)  # every evaluation turn was greedy
    assert 1 <= watched.most <= plan.slots  # its share of the slots, no more
    assert stats.groups_submitted >= 14  # training went on meanwhile
    # The learner sees training episodes only, every one of them sampled (not greedy).
    learner = BufferClient(f"127.0.0.1:{server.port}", learner_id="learner")
    seen: list[Any] = []
    while (batch := await asyncio.to_thread(learner.sample, 64, 1, 0.5)) is not None:
        seen += [e for group in batch.groups for e in group.episodes]
        await asyncio.to_thread(learner.commit, batch.batch_id)
    assert len(seen) == stats.episodes > 0
    assert {e.task_id for e in seen} <= TRAINING
    assert all(e.metrics.get("success", 0.0) == 0.0 for e in seen)
    learner.close()
    client.close()


async def test_round_due_names_the_newest_multiple_once() -> None:
    assert [round_due(v, -1, 5) for v in (0, 4, 5, 12)] == [0, 0, 5, 10]
    assert round_due(9, 5, 5) is None and round_due(10, 5, 5) == 10


# ----------------------------------------------------------------------- bad evaluation tasks


def job(environment: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": "e"}, "spec": {"environment": environment}}


def problems_of(environment: dict[str, Any]) -> list[str]:
    parsed, problems = validate_document(job(environment), "job.yaml")
    if parsed is None:
        return [str(p) for p in problems]
    return [str(p) for p in environment_problems(parsed, "job.yaml")]


def write_tasks(path: Path, ids: Sequence[str]) -> str:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"say {i}", "answer": i}) + "\n" for i in ids))
    return str(path)


async def test_bad_eval_tasks_are_clear_problems_at_start(tmp_path: Path) -> None:
    train = write_tasks(tmp_path / "train.jsonl", ["a", "b"])
    held = write_tasks(tmp_path / "held.jsonl", ["c", "d"])
    answers = {"name": "answers", "tasks": [train]}
    assert problems_of({**answers, "evalTasks": [held]}) == []
    missing = problems_of({**answers, "evalTasks": [str(tmp_path / "nope.jsonl")]})
    assert len(missing) == 1 and "spec.environment.evalTasks" in missing[0] and "nope.jsonl" in missing[0]
    unknown = problems_of({**answers, "evalTasks": [held, "zz"]})
    assert len(unknown) == 1 and "spec.environment.evalTasks" in unknown[0] and "'zz'" in unknown[0]
    trained = problems_of({**answers, "evalTasks": ["a"]})
    assert len(trained) == 1 and "also training tasks" in trained[0]
    assert "also training tasks" in problems_of({"evalTasks": ["1"]})[0]  # map seed 1 is trained on
    assert "spec.environment.evalTasks" in problems_of({"evalTasks": ["left"]})[0]
    assert "unknown SWE tasks" in problems_of({"name": "swe", "evalTasks": ["no-such-task"]})[0]
    # The answers sandbox gets the held-out file too, so it can score those tasks.
    parsed, _ = validate_document(job({**answers, "evalTasks": [held]}), "job.yaml")
    assert parsed is not None
    settings = ActorSettings.from_spec(parsed.spec, actor_id="a")
    assert settings.evaluation is not None and settings.evaluation.tasks == ("c", "d")
    assert settings.evaluation.slots == 2  # evalShare 0.25 of 8 slots
    assert json.loads(settings.sandbox.options_json)["taskFiles"] == [train, held]
    assert set(settings.tasks) == {"a", "b"}


async def test_a_refused_report_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    import grpc

    from stoker.actor.evaluation import EvalOutcome

    class Unimplemented(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNIMPLEMENTED

        def details(self) -> str:
            return "Method not found!"

    class OldBuffer:  # a buffer from before ReportEval
        def report_eval(self, *args: Any, **kwargs: Any) -> None:
            raise Unimplemented()

    outcome = EvalOutcome(version=0, episodes=2, reward_sum=1.0, success_sum=1.0, failed=0)
    await GrpcBuffer(OldBuffer()).report_eval(outcome, "a/0")
    assert "UNIMPLEMENTED" in caplog.text

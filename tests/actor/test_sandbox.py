"""Process sandboxes: real subprocess gRPC servers with limits; crashes and hangs end episodes."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
import os
import signal
import sys
import threading
import time
from pathlib import Path
from collections.abc import Sequence

import pytest
import pytest_asyncio

from stoker.actor.episode import FAILED, OK, TIMEOUT, TRUNCATED, EpisodeLimits, run_group
from stoker.actor.environments import Observation, StepLatency, StepResult
from stoker.conversation.policy import Sampled
from stoker.actor.policy import ScriptedPolicy
from stoker.actor.process_sandbox import ProcessSandbox, ProcessSandboxFactory, Zygote
from stoker.actor.sandbox import InlineEnvironment, SandboxConfig, SandboxEnvironment, SandboxFailed, inline_factory
from stoker.actor.swe import bundled_tasks
from stoker.conversation.tokenization import TextInterface
from stoker.procstat import proc_stat
from stoker.trajectory import array_problem, to_proto

pytestmark = pytest.mark.asyncio


@pytest_asyncio.fixture
async def zygote() -> AsyncIterator[Zygote]:
    forker = Zygote()
    yield forker
    await forker.aclose()


@pytest.fixture
def process_factory(zygote: Zygote) -> Callable[[SandboxConfig], ProcessSandboxFactory]:
    return lambda config: ProcessSandboxFactory(config, zygote)

LAKE_LIMITS = EpisodeLimits(max_turns=10, max_new_tokens=4, max_tokens=512, episode_seconds=60)
SWE_LIMITS = EpisodeLimits(max_turns=4, max_new_tokens=400, max_tokens=4096, episode_seconds=60)


async def test_frozenlake_in_process_sandboxes_solved_and_failed(
    lake: TextInterface, lake_config: SandboxConfig, lake_expert
, process_factory) -> None:  # type: ignore[no-untyped-def]
    solved = await run_group(ScriptedPolicy(lake_expert), process_factory(lake_config), lake, "2", 2, limits=LAKE_LIMITS)
    assert [e.status for e in solved] == [OK, OK]
    assert all(e.metrics["success"] == 1.0 and e.reward > 1.0 for e in solved)  # 1 + shaping
    up = lake.tokenizer.get_vocab()["up"]
    failed = await run_group(ScriptedPolicy(lambda _: [up]), process_factory(lake_config), lake, "2", 1, limits=LAKE_LIMITS)
    assert failed[0].status == TRUNCATED and failed[0].metrics["success"] == 0.0


@pytest.mark.parametrize("task", bundled_tasks())
async def test_swe_task_solved_by_scripted_policy(task: str, swe: TextInterface, swe_config: SandboxConfig, swe_solver, process_factory) -> None:  # type: ignore[no-untyped-def]
    [episode] = await run_group(ScriptedPolicy(swe_solver(task)), process_factory(swe_config), swe, task, 1, limits=SWE_LIMITS)
    assert episode.status == OK, episode.status_reason
    assert episode.reward == 1.0 and episode.metrics["success"] == 1.0
    assert array_problem(to_proto(episode)) is None


async def test_swe_wrong_policy_fails(swe: TextInterface, swe_config: SandboxConfig, process_factory) -> None:
    # Runs the tests every turn without fixing anything: never rewarded.
    run_tests = [*swe.encode("run_tests"), swe.stop_token_ids[0]]
    [episode] = await run_group(
        ScriptedPolicy(lambda _: run_tests), process_factory(swe_config), swe, "median", 1, limits=SWE_LIMITS
    )
    assert episode.status == TRUNCATED and episode.reward == 0.0 and episode.metrics["success"] == 0.0, episode.status_reason
    assert episode.metrics["test_runs"] == SWE_LIMITS.max_turns


async def test_sandbox_killed_mid_episode_fails_the_episode_not_the_group(
    lake: TextInterface, lake_config: SandboxConfig
, zygote: Zygote) -> None:
    sandboxes: list[ProcessSandbox] = []

    async def factory() -> SandboxEnvironment:
        sandbox = await zygote.spawn(lake_config)
        sandboxes.append(sandbox)
        return SandboxEnvironment(sandbox, lake_config)

    vocab = lake.tokenizer.get_vocab()

    class KillOnSecondTurn:
        version = 0
        turns = 0

        async def end_session(self, session: object) -> None:
            pass

        async def generate(self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: object = None) -> Sampled:
            self.turns += 1
            if self.turns == 2:  # episode 0's second turn: its sandbox dies before the step
                os.killpg(sandboxes[0].pid, signal.SIGKILL)
            return Sampled([vocab["G"]], [-0.1], False, 0)  # invalid: the lake never ends

    group = await run_group(KillOnSecondTurn(), factory, lake, "0", 1, limits=LAKE_LIMITS)
    [episode] = group
    assert episode.status == FAILED and "SIGKILL" in episode.status_reason
    assert episode.num_turns == 1 and episode.loss_mask.sum() == 2  # the turns it did play are kept
    assert array_problem(to_proto(episode)) is None
    assert sandboxes[0].returncode == -signal.SIGKILL and not sandboxes[0].workdir.exists()


async def test_hanging_step_times_out_and_the_sandbox_is_killed(lake: TextInterface, lake_config: SandboxConfig, lake_expert, zygote: Zygote) -> None:  # type: ignore[no-untyped-def]
    hang = dataclasses.replace(lake_config, step_latency=StepLatency("fixed", 30.0), step_timeout_seconds=0.5)
    sandboxes: list[ProcessSandbox] = []

    async def factory() -> SandboxEnvironment:
        sandbox = await zygote.spawn(hang)
        sandboxes.append(sandbox)
        return SandboxEnvironment(sandbox, hang)

    group = await asyncio.wait_for(
        run_group(ScriptedPolicy(lake_expert), factory, lake, "1", 2, limits=LAKE_LIMITS), timeout=20
    )
    assert [e.status for e in group] == [TIMEOUT, TIMEOUT]
    assert "0.5 s step limit" in group[0].status_reason
    assert all(s.returncode == -signal.SIGKILL for s in sandboxes)


async def test_sandbox_over_its_memory_limit_fails_with_a_reason(lake: TextInterface, lake_config: SandboxConfig, process_factory) -> None:
    starved = dataclasses.replace(lake_config, memory_mb=24)  # too little for Python plus gRPC
    with pytest.raises(SandboxFailed, match="did not start"):
        await Zygote().spawn(starved)
    group = await run_group(ScriptedPolicy(lambda _: [0]), process_factory(starved), lake, "1", 2, limits=LAKE_LIMITS)
    assert [e.status for e in group] == [FAILED, FAILED] and "did not start" in group[0].status_reason
    assert all(array_problem(to_proto(e)) is None for e in group)  # submitted so the group completes


async def test_unknown_task_is_rejected_with_its_name(lake: TextInterface, swe_config: SandboxConfig, swe: TextInterface, process_factory) -> None:
    [episode] = await run_group(ScriptedPolicy(lambda _: [0]), process_factory(swe_config), swe, "nope", 1, limits=SWE_LIMITS)
    assert episode.status == FAILED and "nope" in episode.status_reason


async def test_sandbox_exits_when_closed_and_removes_its_directory(lake_config: SandboxConfig, zygote: Zygote) -> None:
    sandbox = await zygote.spawn(lake_config)
    env = SandboxEnvironment(sandbox, lake_config)
    observation = await env.reset("1", 0)
    assert "reach G" in observation.text
    await env.close()
    assert sandbox.returncode is not None and not sandbox.workdir.exists()


async def test_inline_environment_gets_a_private_directory_only_when_it_touches_files(
    lake_config: SandboxConfig, swe_config: SandboxConfig
) -> None:
    lake_env = await inline_factory(lake_config)()
    assert getattr(lake_env, "workdir") is None  # FrozenLake: nothing to create and remove per episode
    await lake_env.close()
    swe_env = await inline_factory(swe_config)()
    workdir = Path(getattr(swe_env, "workdir"))
    assert workdir.is_dir()
    await swe_env.close()
    assert not workdir.exists()


class ThreadRecordingEnv:
    """Steps by blocking its caller for a while, and notes which thread made each call."""

    def __init__(self, step_seconds: float):
        self.step_seconds = step_seconds
        self.threads: list[int] = []

    def reset(self, task_id: str, seed: int) -> Observation:
        self.threads.append(threading.get_ident())
        return Observation("start")

    def step(self, action: str) -> StepResult:
        self.threads.append(threading.get_ident())
        time.sleep(self.step_seconds)  # the environment's own slow work (a command, a simulator)
        return StepResult(Observation("next"), 0.0, terminated=False)

    def close(self) -> None:
        self.threads.append(threading.get_ident())


async def test_a_blocking_inline_environment_leaves_the_event_loop_to_other_episodes() -> None:
    env = ThreadRecordingEnv(step_seconds=0.3)
    inline = InlineEnvironment(env, blocking=True)
    ticks = 0

    async def other_episode() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.01)

    other = asyncio.create_task(other_episode())
    await inline.reset("0", 0)
    before = ticks
    await inline.step("up")
    other.cancel()
    assert ticks - before >= 5  # the loop kept running while the step blocked its thread
    assert threading.get_ident() not in env.threads


async def test_a_cheap_inline_environment_is_called_on_the_event_loop(
    lake_config: SandboxConfig, swe_config: SandboxConfig
) -> None:
    env = ThreadRecordingEnv(step_seconds=0.0)
    inline = InlineEnvironment(env, blocking=False)
    await inline.reset("0", 0)
    await inline.step("up")
    await inline.close()
    assert env.threads == [threading.get_ident()] * 3  # no thread handoff per call
    # FrozenLake's calls are table lookups: direct; SWE's run commands: in a thread.
    lake_env, swe_env = await inline_factory(lake_config)(), await inline_factory(swe_config)()
    assert not getattr(lake_env, "blocking") and getattr(swe_env, "blocking")
    await lake_env.close()
    await swe_env.close()


def _gone(pid: int) -> bool:
    try:
        state = proc_stat(pid)[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # exited; only waiting to be reaped by whoever adopted it


PARENT = """
import asyncio, sys
from stoker.actor.process_sandbox import Zygote
from stoker.actor.sandbox import SandboxConfig
async def main():
    zygote = Zygote()
    sandbox = await zygote.spawn(SandboxConfig("frozenlake"))
    print(sandbox.pid, zygote.process.pid, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
async def test_sandbox_dies_with_a_crashed_actor() -> None:
    parent = await asyncio.create_subprocess_exec(sys.executable, "-c", PARENT, stdout=asyncio.subprocess.PIPE)
    assert parent.stdout is not None
    sandbox_pid, zygote_pid = map(int, (await asyncio.wait_for(parent.stdout.readline(), 30)).split())
    assert not _gone(sandbox_pid) and not _gone(zygote_pid)
    parent.kill()  # the actor crashes without closing anything
    await parent.wait()
    async with asyncio.timeout(10):
        while not (_gone(sandbox_pid) and _gone(zygote_pid)):
            await asyncio.sleep(0.02)


SPAWN_AND_WAIT = """
import asyncio
from stoker.actor.process_sandbox import Zygote
from stoker.actor.sandbox import SandboxConfig
async def main():
    zygote = Zygote()
    sandbox = await zygote.spawn(SandboxConfig("frozenlake"))
    print(sandbox.pid, zygote.process.pid, sandbox.workdir, flush=True)
    await asyncio.Event().wait()
asyncio.run(main())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
async def test_a_crashed_actors_sandbox_folders_go_when_the_next_actor_starts_sandboxes(tmp_path: Path) -> None:
    """kill -9 of an actor leaves its sandboxes' folders (nothing ran their clean-up): they are in
    the actor's TMPDIR, named by its zygote, and the next zygote there removes them."""
    async def actor() -> tuple[asyncio.subprocess.Process, int, int, Path]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", SPAWN_AND_WAIT, stdout=asyncio.subprocess.PIPE, env={**os.environ, "TMPDIR": str(tmp_path)}
        )
        assert process.stdout is not None
        sandbox, zygote, workdir = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().split()
        return process, int(sandbox), int(zygote), Path(workdir)

    first, sandbox_pid, zygote_pid, orphan = await actor()
    assert orphan.parent == tmp_path and orphan.name.startswith(f"stoker-sandbox-{zygote_pid}-")
    first.kill()
    await first.wait()
    async with asyncio.timeout(10):
        while not (_gone(sandbox_pid) and _gone(zygote_pid)):
            await asyncio.sleep(0.02)
    assert orphan.exists()  # nobody removed it
    second, _, _, workdir = await actor()
    try:
        assert not orphan.exists() and workdir.exists()  # the live one's is kept
    finally:
        second.kill()
        await second.wait()

@pytest.mark.parametrize("heartbeat_seconds", [0.05, 60.0])
async def test_heartbeats_keep_a_slow_episode_alive_and_silence_reaps_it(
    heartbeat_seconds: float, lake: TextInterface, lake_config: SandboxConfig, zygote: Zygote
) -> None:
    # The sandbox exits after 0.4 s without calls; the model "thinks" 1 s between its turns.
    config = dataclasses.replace(lake_config, heartbeat_seconds=heartbeat_seconds, heartbeat_ttl_seconds=0.4)
    vocab = lake.tokenizer.get_vocab()
    turns = 0

    class SlowThinker:
        version = 0

        async def end_session(self, session: object) -> None:
            pass

        async def generate(self, prompt: Sequence[int], *, max_new_tokens: int, stop_token_ids: Sequence[int], session: object = None) -> Sampled:
            nonlocal turns
            turns += 1
            if turns == 2:
                await asyncio.sleep(1.0)  # a slow model turn, the situation under test
            return Sampled([vocab["G"]], [-0.1], False, 0)

    factory = ProcessSandboxFactory(config, zygote)
    limits = EpisodeLimits(max_turns=3, episode_seconds=30)
    [episode] = await run_group(SlowThinker(), factory, lake, "1", 1, limits=limits)
    if heartbeat_seconds < 1.0:
        assert episode.status == TRUNCATED and episode.num_turns == 3
    else:
        assert episode.status == FAILED and "exited with code 0" in episode.status_reason


async def test_a_killed_sandbox_leaves_no_folder_and_is_deleted_off_the_event_loop(
    process_factory, lake_config: SandboxConfig, monkeypatch: pytest.MonkeyPatch  # type: ignore[no-untyped-def]
) -> None:
    """Deleting a sandbox's folder (a repository, test caches) takes a while; the actor's other
    episodes run on the same event loop, so the delete runs in a worker thread."""
    import stoker.actor.process_sandbox as process_sandbox

    deleting_threads: list[str] = []
    real_rmtree = process_sandbox.shutil.rmtree

    def recording_rmtree(path: Path, ignore_errors: bool = False) -> None:
        deleting_threads.append(threading.current_thread().name)
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(process_sandbox.shutil, "rmtree", recording_rmtree)
    environment = await process_factory(lake_config)()
    sandbox = environment.handle
    assert isinstance(sandbox, ProcessSandbox) and sandbox.workdir.is_dir()
    (sandbox.workdir / "left-by-an-episode").write_text("x")
    await sandbox.kill()
    assert not sandbox.workdir.exists()
    assert deleting_threads and threading.main_thread().name not in deleting_threads
    await environment.close()

"""The actor's side of a sandbox: start one per episode, talk to it over gRPC, kill it.

An episode sees an ``EpisodeEnvironment`` (async reset/step/close). ``SandboxEnvironment`` is the
real one: a ``stoker.v1.Sandbox`` client bound to a sandbox that persists across the episode's
turns, a local process (``stoker.actor.process_sandbox``) or a Kubernetes pod
(``stoker.actor.pods``).
``InlineEnvironment`` runs the environment inside the actor, without isolation; it exists for
trusted environments in the local runner's synchronous baseline and for tests.

Failures become two exception types the episode turns into a status: ``SandboxTimeout`` (a step
overran its wall-clock limit: the sandbox is killed) and ``SandboxFailed`` (it crashed, exceeded a
resource limit, or rejected the request), each with a reason a user can read.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import grpc

from stoker.actor.environments import (
    Environment, EnvironmentProblem, Observation, StepLatency, StepResult, crash_reason, make_environment, may_block,
    uses_workdir,
)
from stoker.channels import channel_options
from stoker.v1 import sandbox_pb2, sandbox_pb2_grpc

T = TypeVar("T")

log = logging.getLogger("stoker.actor.sandbox")


class SandboxFailed(Exception):
    """The sandbox crashed, exceeded a resource limit or rejected the request."""


class SandboxTimeout(Exception):
    """A step (or the sandbox's start) overran its wall-clock limit."""


class EpisodeEnvironment(Protocol):
    """What an episode talks to: one environment instance for the whole episode."""

    async def reset(self, task_id: str, seed: int) -> Observation: ...

    async def step(self, action: str) -> StepResult: ...

    async def close(self) -> None: ...


# Makes one episode's environment; factories holding resources also have ``async aclose()``.
EnvironmentFactory = Callable[[], Awaitable[EpisodeEnvironment]]


async def close_factory(factory: EnvironmentFactory) -> None:
    """Release what a factory holds (a process factory's zygote); a no-op for the others."""
    aclose = getattr(factory, "aclose", None)
    if aclose is not None:
        await aclose()


@dataclass(frozen=True)
class SandboxConfig:
    """Everything needed to start and drive one episode's sandbox (from the RLJob spec)."""

    environment: str
    options_json: str = "{}"
    step_latency: StepLatency = field(default_factory=StepLatency)
    cpu_seconds: int = 60
    memory_mb: int = 512
    step_timeout_seconds: float = 30.0
    heartbeat_seconds: float = 10.0
    heartbeat_ttl_seconds: float = 120.0
    startup_timeout_seconds: float = 60.0


class InlineEnvironment:
    """An environment in the actor's own process (no isolation).

    With ``blocking`` its calls run in a thread, so a slow one does not stall the event loop
    (and every other episode's sampling) while it runs; without, they are made directly.
    """

    def __init__(self, env: Environment, step_latency: StepLatency | None = None, *, blocking: bool = True):
        self.env = env
        self.step_latency = step_latency or StepLatency()
        self.blocking = blocking
        self._rng = random.Random(0)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.to_thread(fn, *args) if self.blocking else fn(*args)

    async def reset(self, task_id: str, seed: int) -> Observation:
        self._rng = random.Random(seed)
        try:
            return await self._call(self.env.reset, task_id, seed)
        except EnvironmentProblem as exc:
            raise SandboxFailed(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - the sandbox boundary: an environment crash fails the episode
            raise SandboxFailed(crash_reason(exc)) from exc

    async def step(self, action: str) -> StepResult:
        delay = self.step_latency.sample(self._rng)
        if delay > 0:
            await asyncio.sleep(delay)  # injected latency (benchmarks), not synchronisation
        try:
            return await self._call(self.env.step, action)
        except EnvironmentProblem as exc:
            raise SandboxFailed(str(exc)) from exc
        except Exception as exc:  # noqa: BLE001 - as in a process sandboxed environment, a crash fails the episode
            raise SandboxFailed(crash_reason(exc)) from exc

    async def close(self) -> None:
        await self._call(self.env.close)


def inline_factory(config: SandboxConfig) -> EnvironmentFactory:
    """Episodes get an in-process environment (see ``InlineEnvironment``).

    Only environments that touch files get a private directory: creating and removing one per
    episode was a fifth of an actor's CPU on FrozenLake at high concurrency.
    """

    async def make() -> EpisodeEnvironment:
        workdir = tempfile.mkdtemp(prefix="stoker-inline-") if uses_workdir(config.environment) else None
        env = make_environment(config.environment, json.loads(config.options_json), workdir or "")
        return _CleanupInline(env, config.step_latency, workdir, blocking=may_block(config.environment))

    return make


class _CleanupInline(InlineEnvironment):
    def __init__(self, env: Environment, latency: StepLatency, workdir: str | None, *, blocking: bool):
        super().__init__(env, latency, blocking=blocking)
        self.workdir = workdir

    async def close(self) -> None:
        await super().close()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)


# ------------------------------------------------------------------------------- sandboxes


class SandboxHandle(Protocol):
    """A started sandbox server, wherever it runs."""

    address: str

    async def exit_reason(self, wait: float = 0.0) -> str | None:
        """Why the sandbox is gone ("killed by SIGKILL", ...), or None while it runs.

        ``wait``: how long to give a dying sandbox to be reaped before answering.
        """
        ...

    async def mark_alive(self) -> None:
        """Record a heartbeat where the reaper looks (a pod annotation); may be a no-op."""
        ...

    async def kill(self) -> None: ...


class SandboxEnvironment:
    """An ``EpisodeEnvironment`` served by a sandbox over gRPC; owns the sandbox's lifetime."""

    def __init__(self, handle: SandboxHandle, config: SandboxConfig):
        self.handle = handle
        self.config = config
        self.channel = grpc.aio.insecure_channel(handle.address, options=channel_options())
        self.stub = sandbox_pb2_grpc.SandboxStub(self.channel)
        self._heartbeat: asyncio.Task[None] | None = None
        self._closed = False

    async def reset(self, task_id: str, seed: int) -> Observation:
        request = sandbox_pb2.ResetRequest(
            environment=self.config.environment,
            options_json=self.config.options_json,
            task_id=task_id,
            seed=seed,
            step_latency=sandbox_pb2.StepLatency(
                distribution=self.config.step_latency.distribution, seconds=self.config.step_latency.seconds
            ),
        )
        reply = await self._call("reset", self.stub.Reset, request)
        if self._heartbeat is None:
            self._heartbeat = asyncio.create_task(self._beat())
        return Observation(reply.text, json.loads(reply.info_json or "{}"))

    async def step(self, action: str) -> StepResult:
        reply = await self._call("step", self.stub.Step, sandbox_pb2.StepRequest(action=action))
        observation = Observation(reply.observation.text, json.loads(reply.observation.info_json or "{}"))
        return StepResult(observation, reply.reward, reply.terminated, reply.truncated)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if await self.handle.exit_reason() is None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.stub.Close(sandbox_pb2.CloseRequest(), timeout=5.0)
        await self.channel.close()
        await self.handle.kill()

    async def _call(self, what: str, rpc: Any, request: Any) -> Any:
        limit = self.config.step_timeout_seconds
        try:
            return await rpc(request, timeout=limit)
        except grpc.aio.AioRpcError as err:
            code = err.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                await self.handle.kill()  # a hung environment must not outlive its episode
                raise SandboxTimeout(f"{what} exceeded the {limit:g} s step limit; sandbox killed") from None
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                raise SandboxFailed(f"{what} rejected: {err.details()}") from None
            if code == grpc.StatusCode.INTERNAL and (err.details() or "").startswith("environment raised"):
                raise SandboxFailed(f"{what}: {err.details()}") from None  # the sandbox is fine, the episode is not
            # An RPC can fail a moment before the child is reaped; give the reaper a short chance.
            reason = await self.handle.exit_reason(wait=1.0)
            if reason is not None:
                tail = getattr(self.handle, "log_tail", lambda: "")()  # a process sandbox's own log
                raise SandboxFailed(f"sandbox {reason} during {what}{': ' + tail if tail else ''}") from None
            raise SandboxFailed(f"{what} failed: {code.name}: {err.details()}") from None

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_seconds)  # the heartbeat period itself
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.stub.Heartbeat(sandbox_pb2.HeartbeatRequest(), timeout=self.config.heartbeat_seconds)
            await self.handle.mark_alive()

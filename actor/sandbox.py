"""The actor's side of a sandbox: start one per episode, talk to it over gRPC, kill it.

An episode sees an ``EpisodeEnvironment`` (async reset/step/close). ``SandboxEnvironment`` is the
real one: a ``stoker.v1.Sandbox`` client bound to a sandbox that persists across the episode's
turns, a local process (``ProcessSandbox``, forked by a ``Zygote``) or a Kubernetes pod
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
import itertools
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import grpc

from stoker.actor.environments import (
    Environment, EnvironmentProblem, Observation, StepLatency, StepResult, crash_reason,
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
    from stoker.actor.environments import make_environment, may_block, uses_workdir

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


def _signal_reason(returncode: int, config: SandboxConfig) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    sig = signal.Signals(-returncode)
    if sig == signal.SIGXCPU:
        return f"exceeded its CPU-time limit ({config.cpu_seconds} s)"
    return f"was killed by {sig.name}"


class Zygote:
    """The actor's side of ``sandbox_server --zygote``: one forker process, many sandboxes.

    Started on first use; a sandbox then costs a fork (milliseconds) rather than an interpreter
    start. The zygote reports each child's start and exit; it dies with the actor (parent-death
    signal) and kills its children when its stdin closes.
    """

    def __init__(self, startup_timeout_seconds: float = 60.0):
        self.startup_timeout_seconds = startup_timeout_seconds
        self.process: asyncio.subprocess.Process | None = None
        self._pending: dict[str, asyncio.Future[tuple[int, int, str]]] = {}
        self._configs: dict[str, SandboxConfig] = {}  # of pending requests: for exit reasons
        self._exits: dict[int, int] = {}  # pid -> exit code (negative: killed by that signal)
        self._exit_events: dict[int, asyncio.Event] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._ids = itertools.count()

    async def spawn(self, config: SandboxConfig) -> ProcessSandbox:
        await self._ensure_started()
        assert self.process is not None and self.process.stdin is not None
        request_id = str(next(self._ids))
        future: asyncio.Future[tuple[int, int, str]] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._configs[request_id] = config
        request = {
            "id": request_id,
            "cpu_seconds": config.cpu_seconds,
            "memory_mb": config.memory_mb,
            "idle_exit_seconds": config.heartbeat_ttl_seconds,
        }
        try:
            self.process.stdin.write((json.dumps(request) + "\n").encode())
            await self.process.stdin.drain()
            pid, port, workdir = await asyncio.wait_for(future, config.startup_timeout_seconds)
        except TimeoutError:
            raise SandboxTimeout(f"sandbox did not start within {config.startup_timeout_seconds:g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            raise SandboxFailed("sandbox did not start: the sandbox launcher is gone") from None
        finally:
            self._pending.pop(request_id, None)
            self._configs.pop(request_id, None)
        return ProcessSandbox(self, pid, port, Path(workdir), config)

    def exit_code(self, pid: int) -> int | None:
        return self._exits.get(pid)

    def forget(self, pid: int) -> None:
        """Drop an ended sandbox's record (a long-running actor forks millions)."""
        self._exits.pop(pid, None)
        self._exit_events.pop(pid, None)

    async def wait_exit(self, pid: int, timeout: float) -> int | None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event(pid).wait(), timeout)
        return self._exits.get(pid)

    async def aclose(self) -> None:
        """Close the zygote's stdin: it kills every sandbox it forked and exits."""
        process, self.process = self.process, None
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        try:
            await asyncio.wait_for(process.wait(), 10.0)
        except TimeoutError:
            process.kill()
            await process.wait()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)

    def _event(self, pid: int) -> asyncio.Event:
        event = self._exit_events.setdefault(pid, asyncio.Event())
        if pid in self._exits:
            event.set()
        return event

    async def _ensure_started(self) -> None:
        async with self._lock:
            if self.process is not None and self.process.returncode is None:
                return
            # A minimal environment: sandboxes see no credentials the actor may hold.
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir()}
            # Per-thread malloc arenas and BLAS thread buffers would eat the address-space limit.
            env["MALLOC_ARENA_MAX"] = "2"
            env["OPENBLAS_NUM_THREADS"] = env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
            env["PYTHONDONTWRITEBYTECODE"] = "1"
            if "PYTHONPATH" in os.environ:
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
            try:
                self.process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "stoker.actor.sandbox_server",
                    "--zygote",
                    f"--parent-pid={os.getpid()}",
                    cwd=tempfile.gettempdir(),
                    env=env,
                    stdin=asyncio.subprocess.PIPE,
                    stdout=asyncio.subprocess.PIPE,
                )
            except OSError as exc:  # out of processes or file descriptors
                raise SandboxFailed(f"cannot start the sandbox launcher: {exc.strerror or exc}") from None
            self._reader = asyncio.create_task(self._read(self.process))

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        while line := await process.stdout.readline():
            kind, _, rest = line.decode(errors="replace").strip().partition(" ")
            if kind == "READY":
                request_id, pid, port, workdir = rest.split(" ", 3)
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_result((int(pid), int(port), workdir))
            elif kind == "FAILED":
                request_id, _, reason = rest.partition(" ")
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_exception(SandboxFailed(f"sandbox did not start: {reason}"))
            elif kind == "EXIT":
                child_text, status_text, request_id = rest.split(" ", 2)
                child = int(child_text)
                self._exits[child] = os.waitstatus_to_exitcode(int(status_text))
                self._event(child).set()
                future = self._pending.get(request_id)
                if future is not None and not future.done():  # it died before it was ready
                    config = self._configs[request_id]
                    reason = _signal_reason(self._exits[child], config)
                    hint = f"; is environment.sandbox.memoryMb ({config.memory_mb}) too small?"
                    future.set_exception(SandboxFailed(f"sandbox did not start: it {reason}{hint}"))
        # The zygote is gone, and its children with it (parent-death signal).
        for future in self._pending.values():
            if not future.done():
                future.set_exception(SandboxFailed("sandbox did not start: the sandbox launcher exited"))
        for child, event in self._exit_events.items():
            self._exits.setdefault(child, -signal.SIGKILL)
            event.set()


class ProcessSandbox:
    """A sandbox server in a local process (forked by a ``Zygote``): own session, temp dir, limits."""

    def __init__(self, zygote: Zygote, pid: int, port: int, workdir: Path, config: SandboxConfig):
        self.zygote = zygote
        self.pid = pid
        self.workdir = workdir
        self.address = f"127.0.0.1:{port}"
        self.config = config
        self._final: int | None = None

    @property
    def returncode(self) -> int | None:
        """None while it runs; the exit code, or minus the signal that killed it."""
        return self._final if self._final is not None else self.zygote.exit_code(self.pid)

    def log_tail(self, limit: int = 200) -> str:
        """The end of the sandbox's own log (a traceback, if it died of one)."""
        try:
            return (self.workdir / "sandbox.log").read_text(errors="replace").strip()[-limit:]
        except OSError:
            return ""

    async def exit_reason(self, wait: float = 0.0) -> str | None:
        code = await self.zygote.wait_exit(self.pid, wait) if wait > 0 else self.returncode
        if code is None:
            return None
        return _signal_reason(code, self.config)

    async def mark_alive(self) -> None:
        return None  # the server's idle watchdog sees the Heartbeat RPC itself

    async def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)  # its whole session: test runs included
            await self.zygote.wait_exit(self.pid, 10.0)
        if self._final is None and self.returncode is not None:
            self._final = self.returncode
            self.zygote.forget(self.pid)
        shutil.rmtree(self.workdir, ignore_errors=True)


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


class ProcessSandboxFactory:
    """Episodes each get a fresh local sandbox process; ``aclose()`` ends the zygote and them all."""

    def __init__(self, config: SandboxConfig, zygote: Zygote | None = None):
        self.config = config
        self.zygote = zygote or Zygote()

    async def __call__(self) -> EpisodeEnvironment:
        return SandboxEnvironment(await self.zygote.spawn(self.config), self.config)

    async def aclose(self) -> None:
        await self.zygote.aclose()


def process_factory(config: SandboxConfig) -> ProcessSandboxFactory:
    return ProcessSandboxFactory(config)

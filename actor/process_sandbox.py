"""Sandboxes as local processes: a ``Zygote`` forks each episode's sandbox server.

The zygote (``sandbox_server --zygote``) is one long-lived forker per actor, so a sandbox costs a
fork rather than an interpreter start; ``ProcessSandbox`` is the actor's handle on one forked
sandbox (its exit, its log, its kill) and ``ProcessSandboxFactory`` gives each episode a fresh one,
driven over gRPC by ``stoker.actor.sandbox.SandboxEnvironment``. The pod-backed counterpart is
``stoker.actor.pods``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from stoker.actor.sandbox import (
    EpisodeEnvironment, SandboxConfig, SandboxEnvironment, SandboxFailed, SandboxTimeout,
)


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
        self._pending: dict[str, asyncio.Future[tuple[int, str, str]]] = {}
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
        future: asyncio.Future[tuple[int, str, str]] = asyncio.get_running_loop().create_future()
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
            pid, address, workdir = await asyncio.wait_for(future, config.startup_timeout_seconds)
        except TimeoutError:
            raise SandboxTimeout(f"sandbox did not start within {config.startup_timeout_seconds:g} s") from None
        except (BrokenPipeError, ConnectionResetError):
            raise SandboxFailed("sandbox did not start: the sandbox launcher is gone") from None
        finally:
            self._pending.pop(request_id, None)
            self._configs.pop(request_id, None)
        return ProcessSandbox(self, pid, address, Path(workdir), config)

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
            # TMPDIR kept: the sandboxes' folders go where the actor's temporary files go.
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tempfile.gettempdir(),
                   "TMPDIR": tempfile.gettempdir()}
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
                request_id, pid, address, workdir = rest.split(" ", 3)
                future = self._pending.get(request_id)
                if future is not None and not future.done():
                    future.set_result((int(pid), address, workdir))
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

    def __init__(self, zygote: Zygote, pid: int, address: str, workdir: Path, config: SandboxConfig):
        self.zygote = zygote
        self.pid = pid
        self.workdir = workdir
        self.address = address  # a unix socket in its workdir (or loopback TCP, see sandbox_server)
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
        # Off the event loop: a sandbox's folder (a repository, test caches) takes a while to delete,
        # and every other episode of the actor waits on this loop meanwhile.
        await asyncio.to_thread(shutil.rmtree, self.workdir, True)


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

"""The sandbox server: one episode's environment behind the ``stoker.v1.Sandbox`` gRPC service.

    python -m stoker.actor.sandbox_server --port 0 [--ready-file F] [--cpu-seconds N] [--memory-mb M]

Started by the actor as a subprocess (or as a pod's container). It applies its own resource limits
first thing: setting them here rather than in a ``preexec_fn`` of the parent is safe in a parent
with threads (JAX, gRPC), and they bind the environment's own children (a SWE task's test run)
too. Its working directory is the sandbox's private temp dir. Inference never runs here, and JAX
is never imported, so a sandbox starts in a fraction of a second.

When ready it prints ``SANDBOX_READY port=<port>`` on stdout (``SANDBOX_READY address=unix:///...``
with ``--listen unix:///PATH``) and writes the same to ``--ready-file`` if given. It exits after Close, when its parent dies (Linux parent-death
signal), or after ``--idle-exit-seconds`` without any call (the actor heartbeats), so a crashed
actor leaves no sandboxes behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import random
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from stoker.actor.environments import EnvironmentProblem, StepLatency, crash_reason, make_environment
from stoker.actor.isolation import describe, drop_root
from stoker.endpoints import MAX_UNIX_PATH_BYTES, Address, AddressError, add_grpc_port, parse, write_ready_file
from stoker.procstat import proc_stat
from stoker.v1 import sandbox_pb2, sandbox_pb2_grpc

log = logging.getLogger("stoker.sandbox")


def apply_limits(cpu_seconds: int, memory_mb: int) -> None:
    """RLIMIT_CPU (SIGXCPU, then SIGKILL at the hard limit) and RLIMIT_AS for this process tree."""
    if cpu_seconds > 0:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    if memory_mb > 0:
        limit = memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


SANDBOX_DIR_PREFIX = "stoker-sandbox-"  # then the zygote's pid and a dash: whose sandbox it was


def sweep_orphans(temp_dir: str) -> list[str]:
    """Remove the folders of sandboxes whose zygote is gone (its actor was killed: nothing ran
    their clean-up); the names removed. A zygote still alive keeps its sandboxes' folders."""
    removed = []
    for entry in Path(temp_dir).glob(f"{SANDBOX_DIR_PREFIX}*-*"):
        owner = entry.name.removeprefix(SANDBOX_DIR_PREFIX).split("-", 1)[0]
        if not owner.isdigit() or _alive(int(owner)):
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (exited, its adopter not yet reaping it) does not."""
    try:
        state = proc_stat(pid)[0]
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process
            return True
        return True
    return state not in ("Z", "X")


def die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when the parent exits (prctl PR_SET_PDEATHSIG); no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m stoker.actor.sandbox_server", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--listen", metavar="ADDRESS", help="serve on HOST:PORT or unix:///PATH (instead of --host/--port)")
    parser.add_argument("--ready-file", type=Path, help="write the bound port (a unix socket: its address) here when ready")
    parser.add_argument("--cpu-seconds", type=int, default=0, help="RLIMIT_CPU (0: unlimited)")
    parser.add_argument("--memory-mb", type=int, default=0, help="RLIMIT_AS in MiB (0: unlimited)")
    parser.add_argument("--idle-exit-seconds", type=float, default=0.0, help="exit after this long without calls")
    parser.add_argument("--parent-pid", type=int, default=0, help="die with this parent (Linux)")
    parser.add_argument("--zygote", action="store_true", help="fork sandboxes on request (see zygote_main)")
    args = parser.parse_args(argv)
    try:
        address = parse(args.listen, where="--listen") if args.listen else Address(host=args.host, port=args.port)
    except AddressError as exc:
        parser.error(str(exc))
    if args.parent_pid:
        die_with_parent(args.parent_pid)
    if args.zygote:
        return zygote_main()
    apply_limits(args.cpu_seconds, args.memory_mb)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s")

    def ready(bound: Address) -> None:
        if args.ready_file:
            write_ready_file(args.ready_file, bound)
        print(f"SANDBOX_READY {'address=' + bound.target if bound.is_unix else f'port={bound.port}'}", flush=True)

    return serve(address, args.idle_exit_seconds, ready)


def serve(address: Address, idle_exit_seconds: float, ready: Callable[[Address], None]) -> int:
    """Serve one environment until Close, SIGTERM or ``idle_exit_seconds`` without calls."""
    done = threading.Event()
    servicer = SandboxServicer(workdir=os.getcwd(), on_close=done.set)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    sandbox_pb2_grpc.add_SandboxServicer_to_server(servicer, server)
    try:
        bound = add_grpc_port(server, address, where="sandbox")
    except (OSError, AddressError) as exc:
        print(f"sandbox: {exc}", file=sys.stderr)
        return 2
    server.start()
    ready(bound)
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    period = min(1.0, idle_exit_seconds / 4) if idle_exit_seconds > 0 else 1.0
    while not done.wait(timeout=period):
        idle = time.monotonic() - servicer.last_call
        if idle_exit_seconds and idle > idle_exit_seconds:
            log.warning("no calls for %.0f s; exiting", idle)
            break
    server.stop(grace=1.0).wait()
    servicer.close_environment()
    return 0


# ---------------------------------------------------------------------------------- zygote


def zygote_main() -> int:
    """Fork sandboxes on request, so each costs a fork instead of an interpreter start.

    A fresh interpreter that imports gRPC and gymnasium costs ~0.2 s of CPU; on a small box that
    caps an actor at a few episodes per second. The zygote pays the imports once (it creates no
    gRPC object, so forking is safe) and forks one child per request. Each child is a full sandbox:
    its own session (process group), its own temp dir as cwd, its own resource limits, and it dies
    with the zygote, which dies with the actor.

    Protocol, one line each. stdin: a JSON request ``{"id", "cpu_seconds", "memory_mb",
    "idle_exit_seconds"}``. stdout: ``READY <id> <pid> <address> <workdir>`` or ``FAILED <id>
    <reason>`` per request, and ``EXIT <pid> <wait status> <id>`` when a child ends. On stdin EOF the
    zygote kills its children and exits.
    """
    # Preloaded here, not at the top, so every fork inherits them: a standalone server (a sandbox
    # pod) imports only the environment it plays, when Reset names it.
    import stoker.actor.frozenlake  # noqa: F401
    import stoker.actor.swe  # noqa: F401

    print(f"sandbox isolation: {describe()}", file=sys.stderr, flush=True)  # probes once; forks inherit
    orphans = sweep_orphans(tempfile.gettempdir())
    if orphans:
        print(f"sandbox: removed {len(orphans)} folders of sandboxes whose actor died", file=sys.stderr, flush=True)

    zygote_pid = os.getpid()
    children: dict[int, str] = {}  # pid -> request id
    changed = threading.Condition()

    def say(line: str) -> None:
        os.write(1, (line + "\n").encode())  # one write per line: atomic on a pipe

    def reap() -> None:
        while True:
            with changed:
                changed.wait_for(lambda: bool(children))
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                continue
            with changed:
                request_id = children.pop(pid, "-")
            say(f"EXIT {pid} {status} {request_id}")

    threading.Thread(target=reap, name="reaper", daemon=True).start()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, zygote_pid, say)  # never returns
        with changed:
            children[pid] = str(request["id"])
            changed.notify_all()
    for pid in list(children):  # the actor went away: take every sandbox with us
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
    return 0


def _child(request: dict[str, Any], zygote_pid: int, say: Callable[[str], None]) -> None:
    code = 1
    try:
        os.setsid()
        die_with_parent(zygote_pid)
        workdir = tempfile.mkdtemp(prefix=f"{SANDBOX_DIR_PREFIX}{zygote_pid}-")
        os.chdir(workdir)
        os.environ["HOME"] = os.environ["TMPDIR"] = workdir
        logfile = os.open(os.path.join(workdir, "sandbox.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        drop_root(workdir)  # a root actor's sandboxes run as nobody
        die_with_parent(zygote_pid)  # a credential change clears the parent-death signal: set it again
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(logfile, 2)
        logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s", force=True)
        apply_limits(int(request["cpu_seconds"]), int(request["memory_mb"]))

        def ready(bound: Address) -> None:
            say(f"READY {request['id']} {os.getpid()} {bound.target} {workdir}")
            os.dup2(logfile, 1)  # from now on stdout is this sandbox's own log

        code = serve(_child_address(workdir), float(request["idle_exit_seconds"]), ready)
    except BaseException as exc:  # noqa: BLE001 - a forked child must never return into the zygote
        with contextlib.suppress(OSError):
            say(f"FAILED {request.get('id')} {type(exc).__name__}: {exc}".replace("\n", " "))
    finally:
        os._exit(code)


def _child_address(workdir: str) -> Address:
    """A forked sandbox serves on a unix socket in its own folder: no port to find, and none on a
    host that allows no inet socket. Loopback TCP only where the path cannot be a socket's."""
    path = os.path.join(workdir, "sandbox.sock")
    if len(os.fsencode(path)) <= MAX_UNIX_PATH_BYTES and not any(c.isspace() for c in path):
        return Address(path=path)
    return Address(host="127.0.0.1", port=0)


class SandboxServicer:
    """Hosts one environment; calls are serialised (one episode, one conversation)."""

    def __init__(self, workdir: str, on_close: Any):
        self.workdir = workdir
        self.on_close = on_close
        self.started = time.monotonic()
        self.last_call = self.started
        self._lock = threading.Lock()
        self._env: Any = None
        self._latency: Any = None
        self._rng = random.Random(0)

    def _touch(self) -> None:
        self.last_call = time.monotonic()

    def Reset(self, request: Any, context: Any) -> Any:
        self._touch()
        with self._lock:
            self.close_environment()
            try:
                options = json.loads(request.options_json or "{}")
                self._env = make_environment(request.environment, options, self.workdir)
                observation = self._env.reset(request.task_id, int(request.seed))
            except (EnvironmentProblem, ValueError) as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # noqa: BLE001 - a plugin's crash fails this episode, not the sandbox server
                context.abort(grpc.StatusCode.INTERNAL, crash_reason(exc))
            self._latency = StepLatency(request.step_latency.distribution or "none", request.step_latency.seconds)
            self._rng = random.Random(int(request.seed))
            return _observation(observation)

    def Step(self, request: Any, context: Any) -> Any:
        self._touch()
        with self._lock:
            if self._env is None:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, "step before reset")
            delay = self._latency.sample(self._rng)
            if delay > 0:
                time.sleep(delay)  # the injected latency is the point: a slow environment
            try:
                result = self._env.step(request.action)
            except EnvironmentProblem as exc:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except Exception as exc:  # noqa: BLE001 - as in Reset: the episode fails with a readable reason
                context.abort(grpc.StatusCode.INTERNAL, crash_reason(exc))
            self._touch()
            return sandbox_pb2.StepResult(
                observation=_observation(result.observation),
                reward=result.reward,
                terminated=result.terminated,
                truncated=result.truncated,
            )

    def Close(self, request: Any, context: Any) -> Any:
        self._touch()
        with self._lock:
            self.close_environment()
        self.on_close()
        return sandbox_pb2.CloseResponse()

    def Heartbeat(self, request: Any, context: Any) -> Any:
        self._touch()
        return sandbox_pb2.HeartbeatResponse(uptime_seconds=time.monotonic() - self.started)

    def close_environment(self) -> None:
        if self._env is not None:
            env, self._env = self._env, None
            env.close()


def _observation(observation: Any) -> Any:
    return sandbox_pb2.Observation(text=observation.text, info_json=json.dumps(observation.info))


if __name__ == "__main__":
    sys.exit(main())

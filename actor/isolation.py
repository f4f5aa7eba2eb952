"""Confining the code an agent wrote: bubblewrap, or a fallback only when asked for.

See docs/environments.md, "Isolation". A judged test run (``stoker.actor.judge``) starts here:

- **bubblewrap** (the default): the run is uid 65534 *outside* the namespace too (bwrap is started
  as ``nobody`` when the actor is root, with an interpreter ``nobody`` can run), in a root built
  from nothing: ``/usr``, ``/etc`` and the interpreter's prefix read-only, the judged copy and the
  harness read-only, a private ``/tmp`` bounded by the memory limit, no ``/proc``, no network
  (not even loopback), its own PID namespace whose init is the test process (so every process it
  starts dies with it). Nothing else of the host is there: not the Stoker package or its task
  files, not the sandbox's directory, not another episode's.
- **rlimits** (``STOKER_SANDBOX_ISOLATION=rlimits`` only): a fresh process as ``nobody`` with the
  resource limits and the audit hook, but the host's filesystem and loopback. It refuses to run
  tests as root.

Without a working bwrap and without that variable, a run refuses to start with one line saying why.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NOBODY = 65534
BUBBLEWRAP = "bubblewrap"
FALLBACK = "rlimits"
UNAVAILABLE = "unavailable"
ENV = "STOKER_SANDBOX_ISOLATION"
TMP_DEFAULT_BYTES = 256 << 20


class IsolationUnavailable(Exception):
    """The sandbox cannot isolate a test run here (the message says why and what to do)."""


def _as_nobody() -> dict[str, Any]:
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []} if os.geteuid() == 0 else {}


# Becomes nobody, then execs argv[1:]. Starting bwrap through this instead of Popen(user=...)
# lets subprocess spawn with vfork: with user/group set it must fork(), and in a sandbox whose
# gRPC server is running, gRPC's fork handlers then crash the child before it execs (SIGSEGV).
_DROP_TO_NOBODY = (
    f"import os, sys; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); os.execv(sys.argv[1], sys.argv[1:])"
)


def _dropping_to_nobody() -> list[str]:
    """The argv prefix that runs the rest as nobody when we are root (nothing otherwise)."""
    return [interpreter() or sys.executable, "-I", "-S", "-c", _DROP_TO_NOBODY] if os.geteuid() == 0 else []


def _runs(argv: list[str], **kwargs: Any) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=30, env={}, **kwargs).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def interpreter() -> str:
    """A Python >= 3.11 that the test run's uid can start (``nobody`` when we are root), or ""."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    candidates = [
        os.path.realpath(sys.executable),
        os.path.join(sys.base_prefix, "bin", version),
        shutil.which(version) or "",
        "/usr/local/bin/python3",
        "/usr/bin/python3",
    ]
    probe = "import sys, ast, json, socket, unittest; sys.exit(sys.version_info < (3, 11))"
    for candidate in dict.fromkeys(c for c in candidates if c and os.path.isfile(c)):
        if _runs([candidate, "-I", "-S", "-c", probe], **_as_nobody()):
            return candidate
    return ""


def _prefix_of(python: str) -> str:
    try:
        done = subprocess.run([python, "-I", "-S", "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                              text=True, timeout=30, env={}, **_as_nobody())
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip()


def _root_args() -> list[str]:
    """A root from nothing: system directories read-only, the interpreter's prefix, /dev."""
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for name in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    python = interpreter()
    prefix = _prefix_of(python) if python else ""
    if prefix and not prefix.startswith("/usr/"):
        args += ["--ro-bind", prefix, prefix]
    if python and not python.startswith(("/usr/", prefix + "/")):
        args += ["--ro-bind", python, python]
    return [*args, "--dev", "/dev", "--unshare-all", "--die-with-parent", "--new-session", "--as-pid-1"]


@functools.cache
def _bwrap_problem() -> str:
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bwrap is not installed (apt-get install bubblewrap)"
    python = interpreter()
    if not python:
        return "no Python >= 3.11 here that uid 65534 can run (install one under /usr, e.g. apt-get install python3)"
    if not _runs([bwrap, *_root_args(), "--", python, "-I", "-S", "-c", "pass"], **_as_nobody()):
        return "bwrap cannot start a sandbox as uid 65534 here (are unprivileged user namespaces disabled?)"
    return ""


def isolation() -> str:
    """``bubblewrap``; ``rlimits`` when ``STOKER_SANDBOX_ISOLATION=rlimits``; else ``unavailable``."""
    if os.environ.get(ENV) == FALLBACK:
        return FALLBACK
    return UNAVAILABLE if _bwrap_problem() else BUBBLEWRAP


isolation.cache_clear = _bwrap_problem.cache_clear  # type: ignore[attr-defined]  # tests switch modes


def problem() -> str:
    """Why a test run cannot start with the isolation in use, or ""."""
    mode = isolation()
    if mode == UNAVAILABLE:
        return f"sandbox isolation unavailable: {_bwrap_problem()}; set {ENV}={FALLBACK} to run without it"
    if mode == FALLBACK and os.geteuid() == 0 and not interpreter():
        return "the rlimits fallback will not run tests as root, and uid 65534 cannot run any Python here"
    return ""


def describe() -> str:
    """Which isolation is in use, for the actor's log and the run report."""
    mode = isolation()
    if mode == BUBBLEWRAP:
        return "bubblewrap (own root, read-only, private bounded /tmp, no /proc, no network, as uid 65534)"
    if mode == FALLBACK:
        network = "own network namespace" if os.geteuid() == 0 else "host network, loopback open"
        return (f"rlimits only, by request: NO filesystem confinement (host files readable by uid 65534), {network}"
                + ("" if not problem() else f"; {problem()}"))
    return f"NONE: {problem()}"


def tmp_limit_bytes() -> int:
    """The private /tmp's size: the memory limit of this process tree (RLIMIT_AS), else a default."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    return min(soft // 2, 1 << 34) if soft not in (resource.RLIM_INFINITY, -1) and soft > 0 else TMP_DEFAULT_BYTES


@dataclass
class Confined:
    """How to start one confined run: the command and Popen keywords; bwrap's info pipe if any."""

    argv: list[str]
    popen: dict[str, Any] = field(default_factory=dict)
    info_fd: int = -1  # the read end of bwrap's --info-fd (the test process's pid), or -1


def confine(argv: list[str], workdir: str, readonly: list[str], tmp_bytes: int) -> Confined:
    """``argv`` (``argv[0]`` replaced by ``interpreter()``) confined; sees only ``readonly`` paths.

    ``workdir`` is the run's current directory. Raises ``IsolationUnavailable``.
    """
    reason = problem()
    if reason:
        raise IsolationUnavailable(reason)
    argv = [interpreter() or sys.executable, *argv[1:]]
    env = {"PATH": "/usr/bin:/bin", "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
    popen: dict[str, Any] = {"env": env, "start_new_session": True}
    if isolation() == FALLBACK:
        # Root starts the harness, which leaves the host network and becomes nobody before
        # anything of the agent's runs; as any other user it just runs (loopback stays open).
        return Confined([*argv[:5], f"--drop-to={NOBODY}", *argv[5:]] if os.geteuid() == 0 else argv, popen)
    read_end, write_end = os.pipe()
    args = [*_dropping_to_nobody(), shutil.which("bwrap") or "bwrap", *_root_args()]
    for path, size in (("/tmp", tmp_bytes), ("/dev/shm", tmp_bytes // 4), ("/var/tmp", tmp_bytes // 4)):
        args += ["--size", str(max(size, 1 << 20)), "--tmpfs", path]  # together 3/4 of the memory limit
    for path in readonly:
        args += ["--ro-bind", path, path]
    args += ["--chdir", workdir, "--info-fd", str(write_end), "--"]
    popen["pass_fds"] = (write_end,)
    return Confined([*args, *argv], popen, info_fd=read_end)


def make_readable_by_nobody(path: Path) -> None:
    """Let a root-owned tree be read by the unprivileged test process (no-op unless we are root)."""
    if os.geteuid() != 0:
        return
    for root, _dirs, files in os.walk(path):
        os.chmod(root, 0o755)
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, 0o644)
    parent = path.resolve().parent
    while parent != parent.parent:  # traversal (not listing) of the ancestors
        mode = parent.stat().st_mode
        if not mode & 0o001:
            os.chmod(parent, mode | 0o001)
        parent = parent.parent


@functools.cache
def nobody_can_run_python() -> bool:
    """Whether uid 65534 can start this interpreter (the sandbox server's, with its packages)."""
    return os.geteuid() != 0 or _runs([sys.executable, "-I", "-c", "pass"], user=NOBODY, group=NOBODY, extra_groups=[])


def drop_root(workdir: str) -> None:
    """Become nobody (a sandbox process started by a root actor), keeping ``workdir`` ours.

    Also non-dumpable: the processes of a test run (uid 65534 too, in the fallback) cannot
    ptrace this judge or read its memory.
    """
    if os.geteuid() != 0 or not nobody_can_run_python():
        return
    os.chown(workdir, NOBODY, NOBODY)
    for name in os.listdir(workdir):
        os.chown(os.path.join(workdir, name), NOBODY, NOBODY)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)
    set_not_dumpable()


def set_not_dumpable() -> None:
    """prctl(PR_SET_DUMPABLE, 0) on Linux; a no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)

"""Confining the code an agent wrote: bubblewrap where it works, a documented fallback where not.

Two layers (see docs/environments.md, "Isolation"):

- **Dropping root.** A sandbox process started by a root actor switches to ``nobody`` (uid/gid
  65534) before it serves, and every agent-controlled process (a test run) starts as ``nobody`` too.
- **Confinement** (``bubblewrap``): the command sees the filesystem read-only, a private empty
  ``/tmp``, no network, its own PID namespace, and none of the other sandboxes' directories (the
  directory holding them is hidden by an empty tmpfs); only the paths it is given are visible
  under it. The fallback (``rlimits``, where ``bwrap`` is missing or user namespaces are off) keeps
  the fresh process, the uid drop and the resource limits, but not the filesystem confinement.

``isolation()`` says which is in use; the actor logs it at start.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

NOBODY = 65534
BUBBLEWRAP = "bubblewrap"
FALLBACK = "rlimits"


@functools.cache
def isolation() -> str:
    """``bubblewrap`` when ``bwrap`` can start a confined interpreter here, else ``rlimits``.

    ``STOKER_SANDBOX_ISOLATION=rlimits`` forces the fallback (tests of it, hosts where bwrap
    misbehaves).
    """
    if os.environ.get("STOKER_SANDBOX_ISOLATION") == FALLBACK:
        return FALLBACK
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return FALLBACK
    try:
        probe = subprocess.run(
            [bwrap, *_bwrap_base(()), "--", sys.executable, "-I", "-c", "pass"],
            capture_output=True,
            timeout=30,
            **_drop_root_kwargs(),
        )
    except (OSError, subprocess.SubprocessError):
        return FALLBACK
    return BUBBLEWRAP if probe.returncode == 0 else FALLBACK


def describe() -> str:
    """Which isolation is in use, for the actor's log and the run report."""
    who = "as nobody" if os.geteuid() != 0 or nobody_can_run_python() else "as uid 65534 in a user namespace (root outside)"
    if isolation() == BUBBLEWRAP:
        return f"bubblewrap (read-only filesystem, private /tmp, no network, {who})"
    if os.geteuid() == 0 and not nobody_can_run_python():
        return "rlimits only, running as root (bwrap unavailable and nobody cannot run this interpreter)"
    return "rlimits only (bwrap unavailable: no filesystem confinement)"


@functools.cache
def nobody_can_run_python() -> bool:
    """Whether uid 65534 can start this interpreter (a pyenv under /root, say, it cannot)."""
    if os.geteuid() != 0:
        return True
    try:
        probe = subprocess.run(
            [sys.executable, "-I", "-c", "pass"], capture_output=True, timeout=30, user=NOBODY, group=NOBODY, extra_groups=[]
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


def _drop_root_kwargs() -> dict[str, Any]:
    """subprocess arguments that start the child as nobody when we are root (no preexec_fn)."""
    if os.geteuid() != 0 or not nobody_can_run_python():
        return {}
    return {"user": NOBODY, "group": NOBODY, "extra_groups": []}


def _bwrap_base(hidden: tuple[str, ...]) -> list[str]:
    args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for path in ("/tmp", "/var/tmp", "/dev/shm", *hidden):
        args += ["--tmpfs", path]
    args += ["--unshare-all", "--die-with-parent", "--new-session"]
    if os.geteuid() == 0 and not nobody_can_run_python():
        args += ["--unshare-user", "--uid", str(NOBODY), "--gid", str(NOBODY)]  # no capabilities inside
    return args


def hidden_dirs(visible: Path) -> tuple[str, ...]:
    """Directories to cover with an empty tmpfs: where sandboxes' private directories live.

    The interpreter (and so the harness) must stay visible: a directory holding it is not hidden.
    """
    keep = [Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), Path(__file__).resolve().parent]
    candidates = {Path(tempfile.gettempdir()).resolve(), visible.resolve().parent}
    hidden = []
    for path in sorted(candidates):
        if path == Path("/") or any(k.is_relative_to(path) for k in keep):
            continue
        hidden.append(str(path))
    return tuple(hidden)


def confined_command(argv: list[str], visible: Path) -> list[str]:
    """``argv`` wrapped so that it sees ``visible`` (read-only) and nothing private outside it."""
    if isolation() != BUBBLEWRAP:
        return argv
    bwrap = shutil.which("bwrap") or "bwrap"
    path = str(visible.resolve())
    return [bwrap, *_bwrap_base(hidden_dirs(visible)), "--ro-bind", path, path, "--chdir", path, "--", *argv]


def confined_popen_kwargs() -> dict[str, Any]:
    """Process arguments for a confined run: nobody when root, its own session, minimal env."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}
    return {"env": env, "start_new_session": True, **_drop_root_kwargs()}


def make_readable_by_nobody(path: Path) -> None:
    """Let a root-owned tree be read by the unprivileged test process (no-op unless we drop root)."""
    if not _drop_root_kwargs():
        return
    for root, dirs, files in os.walk(path):
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


def drop_root(workdir: str) -> None:
    """Become nobody (a sandbox process started by a root actor), keeping ``workdir`` ours."""
    if not _drop_root_kwargs():
        return
    os.chown(workdir, NOBODY, NOBODY)
    for name in os.listdir(workdir):
        os.chown(os.path.join(workdir, name), NOBODY, NOBODY)
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)

"""Supervised child processes for ``stoker run``: each in its own process group (so its sandboxes
die with it), stopped with SIGTERM then SIGKILL, and the signal handling that makes a run's stop
orderly."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from stoker.procstat import proc_stat

# How long a child gets to shut down cleanly after SIGTERM before it is killed.
STOP_GRACE_SECONDS = 30.0
READY_TIMEOUT_SECONDS = 120.0
# How long ``finish`` waits for a killed group's processes to be gone (SIGKILL is delivered
# asynchronously: a process killed a moment ago may still be tearing down).
GROUP_EXIT_SECONDS = 10.0


def live_group_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` still running (zombies, dead but not yet reaped, left out)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = proc_stat(entry.name)  # [0] the state, [2] the process group
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


@dataclass
class Child:
    """One supervised subprocess, in its own process group so its sandboxes die with it."""

    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def signal(self, signum: int) -> None:
        if self.running and self.process is not None:
            try:
                os.killpg(self.process.pid, signum)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> bool:
        if self.process is None:
            return True
        try:
            self.process.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """SIGTERM, wait, then SIGKILL the whole process group (sandboxes included)."""
        self.signal(signal.SIGTERM)
        self.finish(grace)

    def finish(self, grace: float) -> None:
        """After SIGTERM: wait up to ``grace``, then SIGKILL the whole process group."""
        if not self.wait(grace):
            self.signal(signal.SIGKILL)
            self.wait(10.0)
        # Whatever the child left in its group (e.g. a sandbox mid-step) goes too, and is gone
        # before the run says it stopped.
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            deadline = time.monotonic() + GROUP_EXIT_SECONDS
            while live_group_members(self.process.pid) and time.monotonic() < deadline:
                time.sleep(0.05)  # polling for the killed processes to be gone
        if self._log is not None:
            self._log.close()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def wait_for_ready_file(path: Path, child: Child, timeout: float = READY_TIMEOUT_SECONDS) -> str:
    """The content a child writes to ``path`` once it serves (its address), or RuntimeError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_size:
            return path.read_text().strip()
        if not child.running:
            raise RuntimeError(f"{child.name} exited with code {child.returncode} before it was ready:\n{child.tail()}")
        child.wait(0.1)
    raise RuntimeError(f"{child.name} was not ready after {timeout:.0f} s:\n{child.tail()}")


@contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Turn the first SIGINT or SIGTERM into KeyboardInterrupt; ignore the ones after it.

    Both stop the run the same orderly way. A second signal (an impatient Ctrl-C, or a supervisor
    that signals the whole process tree) must not interrupt that stop halfway, which would leave
    the remaining children running."""
    stopping = False

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal stopping
        if stopping:
            return
        stopping = True
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

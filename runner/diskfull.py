"""A full disk stops ``stoker run`` with one clear message instead of a restart loop.

Every process of a local run writes into the run directory (checkpoints, metrics, the buffer's
log, the logs themselves), so once its filesystem is full a restarted child dies the same way, and
a traceback from whichever write failed first says little. A child's death counts as a disk-full
death when it exits with ``EXIT_DISK_FULL`` (the learner's word for it), when its log's last
lines say ``No space left on device`` (or ``Disk quota exceeded``), or, since its log may be
exactly what it could not write, when the run directory's filesystem has less than
``LOW_SPACE_BYTES`` free. Any of these stops the run with ``EXIT_DISK_FULL``, naming the
filesystem and what could not be written, without spending the child's restart budget; what is on
disk stays resumable (Orbax finalizes a checkpoint only once all of it is written, the buffer's log
replays up to its last whole record), so the same command resumes once space is freed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from stoker.learner.diskfull import EXIT_DISK_FULL, NO_SPACE

__all__ = [
    "EXIT_DISK_FULL", "LOW_SPACE_BYTES", "DiskFull", "death_by_full_disk", "disk_full_error", "free_bytes", "is_no_space",
    "mount_point", "seal_torn_lines",
]

# Below this a run cannot write a checkpoint or a log segment; a death then is the disk's doing.
LOW_SPACE_BYTES = 1 << 20
# How Python, Orbax and our own warnings spell the failed write in a log.
_NO_SPACE_LINE = re.compile(r"\[Errno (?:28|122)\]|No space left on device|Disk quota exceeded")


class DiskFull(RuntimeError):
    """The run's disk is full: the message says where and what could not be written."""


def is_no_space(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (``path`` or the nearest
    existing folder above it)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem ``path`` is on: what to free space on."""
    path = path.absolute()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _where(run_dir: Path) -> str:
    return f"{run_dir} ({free_bytes(run_dir)} bytes free on {mount_point(run_dir)})"


def _resume_hint(run_dir: Path) -> str:
    return (f"Free space on {mount_point(run_dir)} and run the same command again: the learner resumes from its last "
            "complete checkpoint and the buffer replays its log.")


def death_by_full_disk(name: str, code: int, tail: str, run_dir: Path | None) -> str | None:
    """Why the stop, when ``name``'s death (exit ``code``, its log's last lines ``tail``) was the
    disk's doing (its exit code or log says so, or ``run_dir``'s filesystem is nearly full); None
    otherwise."""
    said = [line.strip() for line in tail.splitlines() if _NO_SPACE_LINE.search(line)]
    low = run_dir is not None and free_bytes(run_dir) < LOW_SPACE_BYTES
    if code != EXIT_DISK_FULL and not said and not low:
        return None
    what = f"{name} could not write: {said[-1][:300]}" if said else f"{name} died for want of space"
    where = f" in {_where(run_dir)}" if run_dir is not None else ""
    hint = f"\n{_resume_hint(run_dir)}" if run_dir is not None else ""
    return f"the disk is full{where}: {what}. Stopping the run instead of restarting {name}: it would die the same way.{hint}"


def disk_full_error(path: Path | None, exc: BaseException, run_dir: Path) -> DiskFull:
    """The run's own write of ``path`` (None: the one ``exc`` names, if any) failed for want of space."""
    what = path or getattr(exc, "filename", None) or "a file"
    return DiskFull(f"the disk is full in {_where(run_dir)}: stoker run could not write {what} "
                    f"({getattr(exc, 'strerror', None) or exc}). "
                    f"Stopping the run.\n{_resume_hint(run_dir)}")


def seal_torn_lines(*paths: Path) -> None:
    """End each JSONL file whose last line a full disk (or a kill) cut short with a newline, so the
    records appended on a resume start on a line of their own instead of joining the torn one.
    Called before any writer starts."""
    for path in paths:
        try:
            with path.open("rb+") as handle:
                if handle.seek(0, os.SEEK_END) == 0:
                    continue
                handle.seek(-1, os.SEEK_END)
                if handle.read(1) != b"\n":
                    handle.write(b"\n")
        except FileNotFoundError:
            continue

"""The write-ahead log's file-system calls: vectored and aligned writes, preallocation, fsync."""

from __future__ import annotations

import errno
import mmap
import os
from collections.abc import Sequence
from pathlib import Path

# writev accepts at most IOV_MAX buffers per call; 1024 on Linux.
IOV_MAX = 1024


class WalError(OSError):
    """The log could not be written or flushed; nothing written since the last sync is durable."""


class WalFull(WalError):
    """No space on the log's volume for this append; nothing was written and the log stays usable."""


NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def write_all(fd: int, chunks: Sequence[bytes | memoryview], offset: int) -> None:
    """Write every chunk, in order, from ``offset``; loops over short writes and the writev limit."""
    for start in range(0, len(chunks), IOV_MAX):
        part = list(chunks[start : start + IOV_MAX])
        size = sum(len(c) for c in part)
        written = os.pwritev(fd, part, offset)
        if written < size:  # rare short write: finish with plain writes
            rest = memoryview(b"".join(part))[written:]
            while rest:
                n = os.pwrite(fd, rest, offset + written)
                written += n
                rest = rest[n:]
        offset += size


def write_aligned(fd: int, view: memoryview, offset: int) -> None:
    """Write an aligned buffer at an aligned offset (O_DIRECT); short writes end on a block
    boundary, so the rest stays aligned."""
    while view:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, "direct write made no progress")
        view, offset = view[written:], offset + written


def preallocate(fd: int, start: int, end: int) -> None:
    """Allocate ``[start, end)``; raises only when the volume is full (``NO_SPACE``)."""
    if end <= start:
        return
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno in NO_SPACE:
            raise
        # The file system cannot preallocate: the write itself reports what fails.


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_segment_file(path: Path, data: bytes, preallocated: int, *, fsync: bool) -> tuple[int, int]:
    """Create ``path`` (it must not exist) holding ``data``, preallocated to ``preallocated`` bytes
    or, on a volume without room for that, to ``len(data)``; return (fd, bytes preallocated).
    ``WalFull`` (and no file left behind) when not even ``data`` fits."""
    allocated = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for want in (preallocated, len(data)):
            try:
                preallocate(fd, 0, want)
            except OSError as exc:
                if exc.errno not in NO_SPACE or want == len(data):
                    raise
                continue
            allocated = want
            break
        write_all(fd, [data], 0)
        if fsync:
            os.fdatasync(fd)
            fsync_dir(path.parent)
    except OSError as exc:
        os.close(fd)
        path.unlink(missing_ok=True)
        if exc.errno in NO_SPACE:
            raise WalFull(errno.ENOSPC, f"no space for a new log segment ({exc.strerror or exc})") from exc
        raise
    return fd, allocated


class StagingBuffers:
    """Page-aligned buffers for direct writes, reused: up to ``kept`` of them (about one per
    concurrent writer), each at most ``kept_max`` bytes, so a rare huge append does not pin its
    buffer. Not thread-safe: the log calls it under its lock."""

    def __init__(self, kept: int, kept_max: int):
        self.kept = kept
        self.kept_max = kept_max
        self._free: list[mmap.mmap] = []

    def take(self, length: int) -> mmap.mmap:
        """A page-aligned buffer of at least ``length`` bytes."""
        for index, staging in enumerate(self._free):
            if len(staging) >= length:
                return self._free.pop(index)
        return mmap.mmap(-1, length)

    def give_back(self, staging: mmap.mmap) -> None:
        if len(self._free) < self.kept and len(staging) <= self.kept_max:
            self._free.append(staging)
        else:
            staging.close()

    def close(self) -> None:
        for staging in self._free:
            staging.close()
        self._free.clear()

"""The write-ahead log's direct appends: large appends written with ``O_DIRECT``, off the log's lock.

Large appends (``DIRECT_MIN`` bytes and up, with fsync on) bypass the page cache: their records
are copied into a page-aligned buffer and written with ``O_DIRECT`` at a 4 KiB-aligned offset,
outside the log's lock, while other appends go on. A buffered 3.4 MB append + ``fdatasync`` cost
2-3 ms of CPU once the page cache was under pressure; direct, ~0.3 ms (benchmarks/README.md, buffer
section). The gaps alignment leaves are filled with padding records (type ``PAD``, zero payload) that
readers skip, so a segment stays one unbroken run of records. A position becomes durable only once
every append before it has been written (``written_through``), so an acknowledged record never
sits behind a hole.

``Wal`` claims each write's stretch of the segment and books its end under the log's lock;
``DirectAppends`` holds the direct file, the writes under way and the staging buffers.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from stoker.buffer import wal_files
from stoker.buffer.wal_files import StagingBuffers, write_all
from stoker.buffer.wal_format import Position, padding_record

# Appends from this size up go through O_DIRECT. Below it the two cost the same CPU (measured from
# 53 KB to 256 KB); above it the page cache's copy and writeback cost up to 7x more.
DIRECT_MIN = 256 << 10
DIRECT_MAX = 64 << 20  # larger appends stay buffered rather than hold a staging buffer this big
STAGING_KEPT = 4  # staging buffers kept for reuse (about one per concurrent writer)...
STAGING_KEPT_MAX = 16 << 20  # ...if at most this big: a rare huge append does not pin its buffer


@dataclass(eq=False)
class DirectWrite:
    """An aligned stretch of the active segment claimed by one direct append."""

    segment: int
    start: int  # where the stretch begins: a padding record up to ``offset`` when unaligned
    offset: int  # aligned: where the records (then a padding record up to alignment) go
    length: int  # aligned
    staging: mmap.mmap  # page-aligned, at least ``length`` bytes


class DirectAppends:
    """The active segment's ``O_DIRECT`` file and the direct writes under way.

    Guarded by the log's lock (``landed`` is a condition on it): every method but ``write`` is
    called with it held; ``write`` runs without it.
    """

    def __init__(self, lock: threading.Lock, *, enabled: bool):
        self.landed = threading.Condition(lock)  # a direct write finished
        self.fd = -1  # the active segment opened with O_DIRECT; -1 when unused or unsupported
        self.ok = enabled  # cleared for good when the file system refuses O_DIRECT
        self.draining = False  # rotation or close waits for direct writes: new ones go buffered
        self.in_flight: dict[int, int] = {}  # direct writes under way: id -> start offset
        self.staging = StagingBuffers(STAGING_KEPT, STAGING_KEPT_MAX)
        self.appends = 0  # appends written with O_DIRECT so far

    def open(self, path: Path) -> None:
        """Open the new active segment for direct writes (the log closes the previous ``fd``)."""
        self.fd = -1
        if not self.ok:
            return
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
        except (OSError, AttributeError):  # e.g. tmpfs refuses O_DIRECT: buffered appends only
            self.ok = False

    def usable(self, total: int) -> bool:
        """Whether an append of ``total`` bytes goes direct now."""
        return DIRECT_MIN <= total <= DIRECT_MAX and self.fd >= 0 and self.ok and not self.draining

    def claim(self, segment: int, start: int, offset: int, length: int) -> DirectWrite:
        """Book a write of the stretch ``[start, offset + length)`` of ``segment`` as under way."""
        write = DirectWrite(segment, start, offset, length, self.staging.take(length))
        self.in_flight[id(write)] = start
        return write

    def write(self, write: DirectWrite, chunks: Sequence[bytes | memoryview], total: int, buffered_fd: int) -> bool:
        """Copy the records (``total`` bytes) into the staging buffer, pad it to alignment and write
        it with O_DIRECT, outside the log's lock. True when written direct; False when the file
        system refused the direct write itself and it went through ``buffered_fd`` (and every later
        append goes buffered). Raises ``OSError``."""
        view = memoryview(write.staging)[: write.length]
        try:
            position = 0
            for chunk in chunks:
                view[position : position + len(chunk)] = chunk
                position += len(chunk)
            if write.length > total:
                view[total:] = padding_record(write.length - total)
            try:
                wal_files.write_aligned(self.fd, view, write.offset)
                return True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # The file system opened the file for O_DIRECT but refuses the write itself.
                self.ok = False
                write_all(buffered_fd, [view], write.offset)
                return False
        finally:
            view.release()

    def finish(self, write: DirectWrite, direct: bool) -> None:
        """The write is over, landed or not: give its buffer back and wake whoever waits for it."""
        del self.in_flight[id(write)]
        self.appends += direct
        self.staging.give_back(write.staging)
        self.landed.notify_all()

    def written_through(self, written: Position) -> Position:
        """The end of the unbroken run of written records, given the end of the last append:
        appends after a direct write that is still under way are not readable yet."""
        if self.in_flight:
            return (written[0], min(self.in_flight.values()))
        return written

    def drain(self) -> None:
        """Wait until no direct write is under way. Appends arriving meanwhile go buffered, so this ends."""
        self.draining = True
        try:
            while self.in_flight:
                self.landed.wait()
        finally:
            self.draining = False

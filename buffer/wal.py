"""The write-ahead log: append-only segment files of checksummed records, with group commit.

The format of segments and records, and reading them back, is ``stoker.buffer.wal_format``; the
file-system calls are ``wal_files``. Segments are preallocated (``posix_fallocate``) ahead of the
appends and written at explicit offsets: appending to a preallocated file costs a fraction of
growing it block by block (about 10x less CPU for a 32k-token trajectory on ext4), so a clean
segment ends in zeros. Each step doubles what the segment has, from 1 MiB up to the segment size:
a busy log preallocates a few times per segment, and a small one (a local job, a test) holds
megabytes of disk rather than a whole segment's worth when it is not closed cleanly. Writers
append under a lock; ``sync`` makes a position durable with one ``fdatasync`` shared by every
writer waiting at that moment (group commit, ``wal_commit``), so concurrent Puts pay for one flush
between them. Large appends go to disk with ``O_DIRECT``, outside the lock (``wal_direct``).

What the records mean is the caller's business (see ``stoker.buffer.core_state``); this module knows
files, offsets, checksums and which segments still hold live records ("pins").
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from stoker.buffer.wal_commit import GroupCommit
from stoker.buffer.wal_direct import DirectAppends, DirectWrite
from stoker.buffer.wal_files import NO_SPACE, WalError, WalFull, create_segment_file, preallocate, write_all
from stoker.buffer.wal_format import (
    MAGIC,
    Position,
    ReplayRecord,
    ReplayReport,
    Segment,
    padding_after,
    padding_record,
    record_chunks,
    replay_segments,
    segment_name,
)

PREALLOCATE_FIRST = 1 << 20  # a new segment's first preallocation; each later one doubles it


class Wal:
    """Segmented append-only log with group commit. Thread-safe.

    Lock order: callers may hold their own lock while calling any method; ``append`` and ``sync``
    take only the log's locks.
    """

    def __init__(
        self,
        directory: Path,
        *,
        fsync: bool = True,
        segment_bytes: int = 256 << 20,
        max_record: int = 1 << 30,
        reserve: int = 0,
    ):
        self.directory = Path(directory)
        self.fsync = fsync
        self.segment_bytes = segment_bytes
        self.max_record = max_record
        # Bytes kept preallocated past every ordinary append, for ``reserved`` ones (the consumption
        # records that free space): a full volume refuses Puts but still takes Commits.
        self.reserve = reserve
        self.full: str | None = None  # why the last ordinary append found no space; None once one fits
        self.segments: dict[int, Segment] = {}
        self._lock = threading.Lock()  # file appends, segment table
        self._commit = GroupCommit()
        self.direct = DirectAppends(self._lock, enabled=fsync)  # the O_DIRECT path; guarded by _lock
        self._fd = -1
        self._active: Segment | None = None
        self._written: Position = (0, 0)  # the end of the last append (earlier ones may be in flight)
        self._broken: str | None = None
        self.bytes_written = 0
        self.syncs = 0

    # ------------------------------------------------------------------ reading (at startup)

    def replay(self) -> tuple[Iterator[ReplayRecord], ReplayReport]:
        """Every intact record of the existing segments, oldest first (before ``start``)."""
        segments, records, report = replay_segments(self.directory, self.max_record)
        self.segments.update(segments)
        return records, report

    # ------------------------------------------------------------------ writing

    def start(self, first_record: tuple[int, bytes] | None = None) -> None:
        """Open a fresh active segment after the existing ones (never append to an old tail)."""
        with self._lock:
            self._open_segment(max(self.segments, default=0) + 1, first_record)

    def _open_segment(self, number: int, first_record: tuple[int, bytes] | None) -> None:
        """Create segment ``number`` and make it the active one. On a nearly full volume it holds
        only its first record (``full`` says so); ``WalFull`` when not even that fits."""
        path = self.directory / segment_name(number)
        chunks: list[bytes | memoryview] = [MAGIC]
        if first_record is not None:
            chunks += record_chunks(*first_record)
        data = b"".join(chunks)
        first = max(min(PREALLOCATE_FIRST, self.segment_bytes), len(data)) + self.reserve
        fd, allocated = create_segment_file(path, data, first, fsync=self.fsync)
        fits = allocated >= len(data) + self.reserve
        self.full = None if fits else f"no space to preallocate the new segment {path.name}"
        segment = Segment(number, path, size=len(data), allocated=allocated)
        self.segments[number] = segment
        self._active, self._fd = segment, fd
        self.direct.open(path)
        self._written = self._commit.synced = (number, len(data))

    def append(self, kind: int, payloads: Sequence[bytes | memoryview], *, pin: bool = False, reserved: bool = False) -> Position:
        """Append one record per payload in a single write; return the end position (not yet durable).

        With ``pin`` each record counts as live in its segment until ``unpin``; the segment is
        then kept until every pin is released. An ordinary append leaves ``reserve`` bytes
        preallocated after it, a ``reserved`` one may use them; ``WalFull`` (nothing written) when
        the volume has no room.
        """
        chunks: list[bytes | memoryview] = []
        for payload in payloads:
            chunks += record_chunks(kind, payload)
        total = sum(len(c) for c in chunks)
        with self._lock:
            if self._broken:
                raise WalError(f"write-ahead log unusable: {self._broken}")
            segment = self._active
            assert segment is not None, "Wal.start() not called"
            pins = len(payloads) if pin else 0
            keep = 0 if reserved else self.reserve
            direct = self._reserve_direct(segment, total, keep) if self.direct.usable(total) else None
            if direct is None:
                self._write_buffered(segment, chunks, total, keep)
                self._count(segment, total, pins)
                return self._written
        return self._write_direct(direct, segment, chunks, total, pins)

    def _count(self, segment: Segment, total: int, pins: int) -> None:
        """Book a written append (caller holds the lock)."""
        segment.pins += pins
        segment.pinned_bytes += total if pins else 0
        self.bytes_written += total

    def _write_buffered(self, segment: Segment, chunks: Sequence[bytes | memoryview], total: int, keep: int) -> None:
        """Write at the end of the active segment through the page cache (caller holds the lock)."""
        before = segment.size
        self._grow(segment, before + total, keep)
        try:
            write_all(self._fd, chunks, before)
        except OSError as exc:
            # Overwrite the partial record with zeros (a clean end) so later appends, which
            # start at the same offset, stay readable; where even that finds no space (a file
            # system that cannot preallocate), cut the file back to where the append began.
            try:
                os.pwrite(self._fd, bytes(total), before)
            except OSError:
                try:
                    os.ftruncate(self._fd, before)
                    segment.allocated = min(segment.allocated, before)
                except OSError as undo_exc:
                    self._broken = f"append failed ({exc}) and could not be undone ({undo_exc})"
            if exc.errno in NO_SPACE and not self._broken:
                self.full = f"no space left on the log's volume ({exc.strerror})"
                raise WalFull(exc.errno, self.full) from exc
            raise WalError(f"write-ahead log append failed: {exc.strerror or exc}") from exc
        segment.size += total
        self._written = (segment.number, segment.size)

    def _reserve_direct(self, segment: Segment, total: int, keep: int) -> DirectWrite | None:
        """Claim an aligned stretch at the end of the active segment for a direct write of ``total``
        bytes of records (caller holds the lock); None when this append should go buffered.

        The stretch is: a padding record up to an aligned offset (written here, buffered), the
        records, and a padding record up to the next aligned offset.
        """
        start = segment.size
        lead = padding_after(start)
        offset = start + lead
        length = total + padding_after(offset + total)
        self._grow(segment, offset + length, keep)
        if lead:
            try:
                write_all(self._fd, [padding_record(lead)], start)
            except OSError:
                return None  # the buffered append reports the failure and keeps the log readable
        write = self.direct.claim(segment.number, start, offset, length)
        segment.size = offset + length
        self._written = (segment.number, segment.size)
        return write

    def _write_direct(
        self, write: DirectWrite, segment: Segment, chunks: Sequence[bytes | memoryview], total: int, pins: int
    ) -> Position:
        """Write a claimed stretch with O_DIRECT, outside the lock, then book it. If anything fails
        the stretch becomes one padding record, so the records after it stay readable."""
        landed = direct = False
        try:
            direct = self.direct.write(write, chunks, total, self._fd)
            landed = True
        except OSError as exc:
            raise WalError(f"write-ahead log append failed: {exc.strerror or exc}") from exc
        finally:
            with self._lock:
                if landed:
                    self._count(segment, total, pins)
                else:
                    self._fill_hole(write.start, write.offset + write.length)
                self.direct.finish(write, direct)
        return (write.segment, write.offset + write.length)

    def _grow(self, segment: Segment, end: int, keep: int) -> None:
        """Preallocate the active segment up to ``end + keep`` at least (caller holds the lock):
        double what it has, up to the segment size. ``WalFull`` when the volume has no room for
        ``end + keep`` (``full`` is set for ordinary appends, cleared when one fits)."""
        need = end + keep
        if need <= segment.allocated:
            if keep:
                self.full = None
            return
        target = max(need, min(2 * segment.allocated, self.segment_bytes) + keep)
        for want in (target, need) if target > need else (need,):
            try:
                preallocate(self._fd, segment.allocated, want)
            except OSError as exc:
                if exc.errno not in NO_SPACE:
                    raise WalError(f"write-ahead log preallocation failed: {exc.strerror or exc}") from exc
                continue
            segment.allocated = want
            if keep:
                self.full = None
            return
        message = f"no space left on the log's volume for {need - segment.size} more bytes"
        if keep:
            self.full = message
        raise WalFull(errno.ENOSPC, message)

    def ensure_reserve(self) -> bool:
        """Try to preallocate the reserve past the active segment's end; True (and ``full``
        cleared) when it is in place."""
        with self._lock:
            segment = self._active
            if segment is None or self._broken:
                return False
            try:
                self._grow(segment, segment.size, max(self.reserve, 1))
            except WalError:
                return False
            return True

    def free_bytes(self) -> int:
        """Bytes the log's volume has free for this process (``statvfs``); 0 when unknown."""
        try:
            info = os.statvfs(self.directory)
        except OSError:
            return 0
        return info.f_bavail * info.f_frsize

    def trim(self, number: int, end: int) -> None:
        """Cut an inactive segment's unused tail (preallocated zeros past ``end``, its last record)."""
        with self._lock:
            segment = self.segments[number]
            assert self._active is None or number != self._active.number, "cannot trim the active segment"
        if segment.size > end:
            os.truncate(segment.path, end)
            segment.size = end

    def _fill_hole(self, start: int, end: int) -> None:
        """Turn a failed direct write's stretch into one padding record (caller holds the lock)."""
        try:
            write_all(self._fd, [padding_record(end - start)], start)
        except OSError as exc:
            self._broken = f"a failed append could not be padded over ({exc})"

    def sync(self, position: Position) -> None:
        """Return once everything up to ``position`` is on disk (no-op with ``fsync`` off)."""
        if self.fsync:
            self._commit.sync(position, self._flush)

    def _flush(self, position: Position) -> Position:
        """One group commit's flush: everything written so far, at least up to ``position``
        (once the direct writes before it have landed). Returns how far is now durable."""
        with self._lock:
            while self.direct.written_through(self._written) < position and not self._broken:
                self.direct.landed.wait()  # an earlier direct write is still under way
            if self._broken:
                raise WalError(f"write-ahead log unusable: {self._broken}")
            target, fd = self.direct.written_through(self._written), self._fd
        try:
            os.fdatasync(fd)
        except OSError as exc:
            # After a failed fsync the page cache state is unknown: never acknowledge again.
            with self._lock:
                self._broken = f"fdatasync failed: {exc}"
            raise WalError(f"write-ahead log flush failed: {exc.strerror or exc}") from exc
        self.syncs += 1
        return target

    def flush_all(self) -> None:
        """Make everything appended so far durable."""
        self.sync(self.written)

    @property
    def written(self) -> Position:
        """The end of everything appended so far (durable once ``sync`` of it returns)."""
        with self._lock:
            return self._written

    @property
    def broken(self) -> str | None:
        """Why the log refuses writes (after a failed flush), or None."""
        return self._broken

    @property
    def active_segment(self) -> int:
        return self._active.number if self._active else 0

    def active_size(self) -> int:
        return self._active.size if self._active else 0

    def rotate(self, first_record: tuple[int, bytes] | None = None) -> int:
        """Close the active segment (flushed) and open the next; return the new segment number."""
        with self._commit.exclusive(), self._lock:
            self.direct.drain()
            if self._broken:
                raise WalError(f"write-ahead log unusable: {self._broken}")
            old_fd, old_direct_fd, old = self._fd, self.direct.fd, self._active
            assert old is not None
            try:
                if self.fsync:
                    os.fdatasync(old_fd)
                try:
                    self._open_segment(old.number + 1, first_record)
                except WalFull:
                    # A full volume: give back the old segment's unused preallocated space
                    # first, then try again; if that fails too the old segment stays active.
                    os.ftruncate(old_fd, old.size)
                    old.allocated = old.size
                    self._open_segment(old.number + 1, first_record)
                os.ftruncate(old_fd, old.size)  # give back the unused preallocated space
            except WalFull:
                self.full = "no space left on the log's volume for a new segment"
                raise
            except OSError as exc:
                self._broken = f"segment rotation failed: {exc}"
                raise WalError(f"write-ahead log rotation failed: {exc.strerror or exc}") from exc
            old.allocated = old.size
            os.close(old_fd)
            if old_direct_fd >= 0:
                os.close(old_direct_fd)
            return self._active.number if self._active else 0

    # ------------------------------------------------------------------ live records, compaction

    def pin(self, segment: int, count: int, nbytes: int) -> None:
        with self._lock:
            seg = self.segments[segment]
            seg.pins += count
            seg.pinned_bytes += nbytes

    def unpin(self, segment: int, count: int, nbytes: int) -> None:
        with self._lock:
            seg = self.segments.get(segment)
            if seg is not None:
                seg.pins -= count
                seg.pinned_bytes -= nbytes

    def oldest_segments(self) -> list[Segment]:
        """Inactive segments, oldest first."""
        with self._lock:
            active = self._active.number if self._active else None
            return [self.segments[n] for n in sorted(self.segments) if n != active]

    def delete_segment(self, number: int) -> None:
        """Remove an inactive segment. Callers delete oldest first: a later segment may hold the
        consumption records of an earlier one's trajectories, never the reverse."""
        with self._lock:
            segment = self.segments.pop(number)
            assert self._active is None or number != self._active.number, "cannot delete the active segment"
        segment.path.unlink(missing_ok=True)

    def disk_bytes(self) -> int:
        with self._lock:
            return sum(s.size for s in self.segments.values())

    def close(self) -> None:
        with self._lock:
            self.direct.drain()
            if self._fd >= 0:
                try:
                    if not self._broken and self._active is not None:
                        os.ftruncate(self._fd, self._active.size)
                    if self.fsync and not self._broken:
                        os.fdatasync(self._fd)
                finally:
                    os.close(self._fd)
                    if self.direct.fd >= 0:
                        os.close(self.direct.fd)
                    self._fd = self.direct.fd = -1
                    self._active = None
            self.direct.staging.close()


"""Log compaction and disk-full recovery: keeping the write-ahead log bounded (part of ``BufferCore``)."""

from __future__ import annotations

from stoker.buffer.core_state import PUT, CoreState, log
from stoker.buffer.wal import WalError, WalFull


class Compaction(CoreState):
    """``BufferCore``'s log housekeeping: compaction, and getting room back on a full volume."""

    def recover_space(self) -> None:
        """While the volume is full: move to a fresh segment once the active one is mostly consumed
        (so compaction can delete it), delete what is consumed, and take the reserve back."""
        with self._lock:
            if not self._opened or self._closed:
                return
            if self.wal.full is None:
                self._note_disk_full(None)
                return
            active = self.wal.segments.get(self.wal.active_segment)
            if active is not None and active.size - active.pinned_bytes > max(self.settings.disk_reserve_bytes, active.size // 2):
                self._rotate()
        self.compact()
        with self._lock:
            if self._closed:
                return
            self.wal.ensure_reserve()
            self._note_disk_full(self.wal.full)

    def compact(self) -> None:
        """Bound the log: delete fully consumed segments (oldest first); when old segments are
        pinned by a few long-lived trajectories, copy those forward so the segments can go.

        Disk use stays below about ``2 x live bytes + 3 segments``.
        """
        with self._lock:
            if not self._opened or self._closed:
                return
            segments = self.wal.oldest_segments()
            disk = self.wal.disk_bytes()
            live = sum(s.pinned_bytes for s in self.wal.segments.values())
            budget = 2 * live + 2 * self.settings.segment_bytes
            for segment in segments:
                if segment.pins == 0:
                    continue
                # A full volume also gains from copying a segment's few live records forward.
                if disk <= budget and (self.wal.full is None or segment.pinned_bytes >= segment.size // 2):
                    break
                entries = [e for g in self._groups.values() for e in g.entries.values() if e.segment == segment.number]
                if len(entries) != segment.pins:
                    break  # a Put into this segment is still being logged; try next time
                try:
                    position = self.wal.append(PUT, [e.raw for e in entries], pin=True)
                except WalFull:
                    break  # no room to copy into: the disk-full state says so
                except WalError as exc:
                    log.error("log compaction failed: %s", exc)
                    break
                for entry in entries:
                    self.wal.unpin(entry.segment, 1, entry.record_bytes)
                    entry.segment = position[0]
                disk -= segment.size
            deletable: list[int] = []
            for segment in self.wal.oldest_segments():
                if segment.pins != 0:
                    break  # strictly oldest first
                deletable.append(segment.number)
        if not deletable:
            return
        try:
            self.wal.flush_all()  # the consumption records that free these segments must be durable first
        except WalError as exc:
            log.error("log compaction skipped: %s", exc)
            return
        for number in deletable:
            self.wal.delete_segment(number)
        log.debug("log compaction removed %d segments", len(deletable))

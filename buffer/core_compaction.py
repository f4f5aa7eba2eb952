"""Log compaction and disk-full recovery: keeping the write-ahead log bounded (``BufferCore.compact``,
``recover_space``).

Functions over the shared ``CoreState``; each takes its lock itself.
"""

from __future__ import annotations

from stoker.buffer.core_state import PUT, CoreState, log
from stoker.buffer.wal_files import WalError, WalFull


def recover_space(state: CoreState) -> None:
    """While the volume is full: move to a fresh segment once the active one is mostly consumed
    (so compaction can delete it), delete what is consumed, and take the reserve back."""
    with state.lock:
        if not state.opened or state.closed:
            return
        if state.wal.full is None:
            state.note_disk_full(None)
            return
        active = state.wal.segments.get(state.wal.active_segment)
        if active is not None and active.size - active.pinned_bytes > max(state.settings.disk_reserve_bytes, active.size // 2):
            state.rotate()
    compact(state)
    with state.lock:
        if state.closed:
            return
        state.wal.ensure_reserve()
        state.note_disk_full(state.wal.full)


def compact(state: CoreState) -> None:
    """Bound the log: delete fully consumed segments (oldest first); when old segments are
    pinned by a few long-lived trajectories, copy those forward so the segments can go.

    Disk use stays below about ``2 x live bytes + 3 segments``.
    """
    wal = state.wal
    with state.lock:
        if not state.opened or state.closed:
            return
        segments = wal.oldest_segments()
        disk = wal.disk_bytes()
        live = sum(s.pinned_bytes for s in wal.segments.values())
        budget = 2 * live + 2 * state.settings.segment_bytes
        for segment in segments:
            if segment.pins == 0:
                continue
            # A full volume also gains from copying a segment's few live records forward.
            if disk <= budget and (wal.full is None or segment.pinned_bytes >= segment.size // 2):
                break
            entries = [e for g in state.groups.values() for e in g.entries.values() if e.segment == segment.number]
            if len(entries) != segment.pins:
                break  # a Put into this segment is still being logged; try next time
            try:
                position = wal.append(PUT, [e.raw for e in entries], pin=True)
            except WalFull:
                break  # no room to copy into: the disk-full state says so
            except WalError as exc:
                log.error("log compaction failed: %s", exc)
                break
            for entry in entries:
                wal.unpin(entry.segment, 1, entry.record_bytes)
                entry.segment = position[0]
            disk -= segment.size
        deletable: list[int] = []
        for segment in wal.oldest_segments():
            if segment.pins != 0:
                break  # strictly oldest first
            deletable.append(segment.number)
    if not deletable:
        return
    try:
        wal.flush_all()  # the consumption records that free these segments must be durable first
    except WalError as exc:
        log.error("log compaction skipped: %s", exc)
        return
    for number in deletable:
        wal.delete_segment(number)
    log.debug("log compaction removed %d segments", len(deletable))

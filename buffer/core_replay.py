"""Startup: replay the write-ahead log into the shared ``CoreState`` (``BufferCore.open``).

Replay applies the records in order, so a trajectory is live iff its Put record is not followed
by a consumption of its group.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from stoker.buffer.core_state import CHECKPOINT, CONSUME, MAX_POLICY_VERSION, PUT, VERSION, CoreState, log
from stoker.buffer.state import Entry, Group
from stoker.buffer.validate import parse_meta
from stoker.buffer.wal_files import WalFull
from stoker.v1 import buffer_pb2


def replay(state: CoreState) -> None:
    """Replay the log into memory, then start a fresh segment (``open`` compacts after)."""
    state.admission.reload()
    records, report = state.wal.replay()
    completed: list[Group] = []
    with state.lock:
        for record in records:
            try:
                _replay_record(state, record.segment, record.kind, record.payload, completed)
            except DecodeError:
                # The checksum matched, so the bytes are as written; a body that does not parse
                # came from a different version. Skip it rather than refuse to start.
                log.warning("write-ahead log: unreadable record of type %d in segment %d skipped", record.kind, record.segment)
        # Live payloads are views into whole segment files; copy them so the files' memory goes.
        for group in state.groups.values():
            for entry in group.entries.values():
                entry.raw = bytes(entry.raw)
        state.corrupt_tails = len(report.corrupt)
        state.replayed = state.stored
        _free_space_before_start(state, report.clean_ends)
        try:
            state.wal.start((CHECKPOINT, state.checkpoint()))
        except WalFull as exc:
            raise WalFull(
                exc.errno,
                f"cannot start: the log's volume {state.wal.directory} is full ({state.wal.free_bytes()} bytes free) "
                f"and {state.stored_bytes} bytes of it are live trajectories: grow the volume",
            ) from exc
        state.opened = True
        for group in completed:
            if state.groups.get(group.group_id) is group and group.state == "incomplete":
                state.on_complete(group, None)
    if report.segments:
        log.info(
            "write-ahead log replayed: %d segments, %d records, %d live trajectories in %d groups, policy version %d",
            report.segments,
            report.records,
            state.stored,
            len(state.groups),
            state.policy_version,
        )


def _free_space_before_start(state: CoreState, clean_ends: dict[int, int]) -> None:
    """Give back what a crash left preallocated and delete consumed segments before the new
    segment is created, so a restart on a full volume finds room for it. The newest segment
    stays: its records after its head checkpoint are known nowhere else."""
    for number, end in clean_ends.items():
        try:
            state.wal.trim(number, end)
        except OSError as exc:
            log.warning("write-ahead log: could not trim segment %d: %s", number, exc.strerror or exc)
    numbers = sorted(state.wal.segments)
    for number in numbers[:-1]:
        if state.wal.segments[number].pins:
            break  # strictly oldest first
        state.wal.delete_segment(number)


def _replay_record(state: CoreState, segment: int, kind: int, payload: memoryview, completed: list[Group]) -> None:
    if kind == PUT:
        _replay_put(state, segment, payload, completed)
    elif kind == CONSUME:
        consume = buffer_pb2.LogConsume.FromString(bytes(payload))
        for episode_id in consume.episode_ids:
            state.consumed_episodes.add(episode_id)
        for group_id in consume.group_ids:
            group = state.groups.get(group_id)
            if group is not None:
                state.forget(group)
            state.consumed_groups.add(group_id)
            if consume.reason == "commit":
                state.committed_groups += 1
    elif kind == CHECKPOINT:
        checkpoint = buffer_pb2.LogCheckpoint.FromString(bytes(payload))
        _replay_version(state, checkpoint.policy_version, segment)
        # A checkpoint is a snapshot of the counters as of its place in the log.
        state.committed_groups = checkpoint.committed_groups
        for episode_id in checkpoint.consumed_episode_ids:
            state.consumed_episodes.add(episode_id)
        for group_id in checkpoint.consumed_group_ids:
            state.consumed_groups.add(group_id)
    elif kind == VERSION:
        _replay_version(state, buffer_pb2.LogPolicyVersion.FromString(bytes(payload)).policy_version, segment)
    else:
        log.warning("write-ahead log: unknown record type %d in segment %d skipped", kind, segment)


def _replay_version(state: CoreState, version: int, segment: int) -> None:
    """A logged version; one out of range (logged before versions were checked) is skipped."""
    if 0 <= version <= MAX_POLICY_VERSION:
        state.policy_version = version
    else:
        log.warning("write-ahead log: policy version %d in segment %d out of range; skipped", version, segment)


def _replay_put(state: CoreState, segment: int, payload: memoryview, completed: list[Group]) -> None:
    meta = parse_meta(payload)
    group = state.live.get(meta.episode_id)
    if group is not None:
        # A copy made by compaction: the newest copy is the one that must be kept.
        entry = group.entries[meta.episode_id]
        state.wal.unpin(entry.segment, 1, entry.record_bytes)
        entry.segment = segment
        state.wal.pin(segment, 1, entry.record_bytes)
        return
    if meta.episode_id in state.consumed_episodes:
        return
    entry = Entry(meta, payload, segment)
    state.wal.pin(segment, 1, entry.record_bytes)
    group = state.insert(entry)
    if len(group.entries) >= group.size:
        completed.append(group)

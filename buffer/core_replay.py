"""Startup: replay the write-ahead log into ``BufferCore``'s state (``CoreState``).

Replay applies the records in order, so a trajectory is live iff its Put record is not followed
by a consumption of its group.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError

from stoker.buffer.core_state import CHECKPOINT, CONSUME, MAX_POLICY_VERSION, PUT, VERSION, CoreState, log
from stoker.buffer.state import Entry, Group
from stoker.buffer.validate import parse_meta
from stoker.buffer.wal import WalFull
from stoker.v1 import buffer_pb2


class Replay(CoreState):
    """``BufferCore``'s startup: what ``open`` does before it compacts."""

    def _replay(self) -> None:
        """Replay the log into memory, then start a fresh segment (``open`` compacts after)."""
        self.admission.reload()
        records, report = self.wal.replay()
        completed: list[Group] = []
        with self._lock:
            for record in records:
                try:
                    self._replay_record(record.segment, record.kind, record.payload, completed)
                except DecodeError:
                    # The checksum matched, so the bytes are as written; a body that does not parse
                    # came from a different version. Skip it rather than refuse to start.
                    log.warning("write-ahead log: unreadable record of type %d in segment %d skipped", record.kind, record.segment)
            # Live payloads are views into whole segment files; copy them so the files' memory goes.
            for group in self._groups.values():
                for entry in group.entries.values():
                    entry.raw = bytes(entry.raw)
            self.corrupt_tails = len(report.corrupt)
            self.replayed = self._stored
            self._free_space_before_start(report.clean_ends)
            try:
                self.wal.start((CHECKPOINT, self._checkpoint()))
            except WalFull as exc:
                raise WalFull(
                    exc.errno,
                    f"cannot start: the log's volume {self.wal.directory} is full ({self.wal.free_bytes()} bytes free) "
                    f"and {self._stored_bytes} bytes of it are live trajectories: grow the volume",
                ) from exc
            self._opened = True
            for group in completed:
                if self._groups.get(group.group_id) is group and group.state == "incomplete":
                    self._on_complete(group)
        if report.segments:
            log.info(
                "write-ahead log replayed: %d segments, %d records, %d live trajectories in %d groups, policy version %d",
                report.segments,
                report.records,
                self._stored,
                len(self._groups),
                self.policy_version,
            )

    def _free_space_before_start(self, clean_ends: dict[int, int]) -> None:
        """Give back what a crash left preallocated and delete consumed segments before the new
        segment is created, so a restart on a full volume finds room for it. The newest segment
        stays: its records after its head checkpoint are known nowhere else."""
        for number, end in clean_ends.items():
            try:
                self.wal.trim(number, end)
            except OSError as exc:
                log.warning("write-ahead log: could not trim segment %d: %s", number, exc.strerror or exc)
        numbers = sorted(self.wal.segments)
        for number in numbers[:-1]:
            if self.wal.segments[number].pins:
                break  # strictly oldest first
            self.wal.delete_segment(number)

    def _replay_record(self, segment: int, kind: int, payload: memoryview, completed: list[Group]) -> None:
        if kind == PUT:
            self._replay_put(segment, payload, completed)
        elif kind == CONSUME:
            consume = buffer_pb2.LogConsume.FromString(bytes(payload))
            for episode_id in consume.episode_ids:
                self._consumed_episodes.add(episode_id)
            for group_id in consume.group_ids:
                group = self._groups.get(group_id)
                if group is not None:
                    self._forget(group)
                self._consumed_groups.add(group_id)
                if consume.reason == "commit":
                    self.committed_groups += 1
        elif kind == CHECKPOINT:
            checkpoint = buffer_pb2.LogCheckpoint.FromString(bytes(payload))
            self._replay_version(checkpoint.policy_version, segment)
            # A checkpoint is a snapshot of the counters as of its place in the log.
            self.committed_groups = checkpoint.committed_groups
            for episode_id in checkpoint.consumed_episode_ids:
                self._consumed_episodes.add(episode_id)
            for group_id in checkpoint.consumed_group_ids:
                self._consumed_groups.add(group_id)
        elif kind == VERSION:
            self._replay_version(buffer_pb2.LogPolicyVersion.FromString(bytes(payload)).policy_version, segment)
        else:
            log.warning("write-ahead log: unknown record type %d in segment %d skipped", kind, segment)

    def _replay_version(self, version: int, segment: int) -> None:
        """A logged version; one out of range (logged before versions were checked) is skipped."""
        if 0 <= version <= MAX_POLICY_VERSION:
            self.policy_version = version
        else:
            log.warning("write-ahead log: policy version %d in segment %d out of range; skipped", version, segment)

    def _replay_put(self, segment: int, payload: memoryview, completed: list[Group]) -> None:
        meta = parse_meta(payload)
        group = self._live.get(meta.episode_id)
        if group is not None:
            # A copy made by compaction: the newest copy is the one that must be kept.
            entry = group.entries[meta.episode_id]
            self.wal.unpin(entry.segment, 1, entry.record_bytes)
            entry.segment = segment
            self.wal.pin(segment, 1, entry.record_bytes)
            return
        if meta.episode_id in self._consumed_episodes:
            return
        entry = Entry(meta, payload, segment)
        self.wal.pin(segment, 1, entry.record_bytes)
        group = self._insert(entry)
        if len(group.entries) >= group.size:
            completed.append(group)

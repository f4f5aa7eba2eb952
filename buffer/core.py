"""The buffer's state machine, without gRPC: groups, leases, staleness, admission, durability.

``BufferCore`` owns the in-memory state and the write-ahead log (``stoker.buffer.wal``). Its
methods are what the RPCs do; the gRPC layer (``stoker.buffer.server``) only decodes requests and
maps exceptions to status codes.

Log records (types): ``PUT`` = a serialized Trajectory exactly as received; ``CONSUME`` = groups
gone for good (committed, or dropped with a reason); ``CHECKPOINT`` = counters and recently
consumed ids, written first in every new segment; ``VERSION`` = the learner's policy version.
Replay applies them in order, so a trajectory is live iff its Put record is not followed by a
consumption of its group.

Admission credit follows the AReaL rule, scaled by the operator (``stoker.buffer.admission``).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from google.protobuf.message import DecodeError

from stoker.buffer.admission import AdmissionScale, Clock
from stoker.buffer.counters import BoundedSet, RateWindow
from stoker.buffer.settings import BufferSettings
from stoker.buffer.state import (
    CODE_INVALID_ARGUMENT,
    CODE_OK,
    BatchTooLarge,
    BufferFull,
    DiskFull,
    Entry,
    Group,
    Lease,
    PendingPut,
    PutOutcome,
    SampledBatch,
    Unavailable,
    UnknownBatch,
)
from stoker.buffer.validate import Invalid, TrajectoryMeta, parse_meta, validate_batch
from stoker.buffer.wal import HEADER, Position, Wal, WalError, WalFull
from stoker.v1 import buffer_pb2

__all__ = [
    "CODE_INVALID_ARGUMENT",
    "CODE_OK",
    "BatchTooLarge",
    "BufferCore",
    "BufferFull",
    "DiskFull",
    "PendingPut",
    "PutOutcome",
    "SampledBatch",
    "Unavailable",
    "UnknownBatch",
]

log = logging.getLogger("stoker.buffer")

PUT, CONSUME, CHECKPOINT, VERSION = 1, 2, 3, 4

# The largest policy version accepted: far past any real run (a step a millisecond for 30 years),
# and small enough that no admission arithmetic leaves int64.
MAX_POLICY_VERSION = 1 << 40
INT64_MAX = (1 << 63) - 1


class BufferCore:
    """Thread-safe buffer state over a write-ahead log in ``data_dir``; call ``open()`` first."""

    def __init__(self, settings: BufferSettings, data_dir: str | Path, *, clock: Clock = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.wal = Wal(
            Path(data_dir),
            fsync=settings.sync == "batch",
            segment_bytes=settings.segment_bytes,
            max_record=settings.max_message_bytes,
            reserve=settings.disk_reserve_bytes,
        )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._groups: dict[str, Group] = {}
        self._live: dict[str, Group] = {}  # episode id -> its group
        # Trajectories written to the log but not yet durable and in the state: they count for
        # duplicates, group sizes and capacity already.
        self._pending_ids: set[str] = set()
        self._pending_groups: collections.Counter[str] = collections.Counter()
        self._ready: collections.deque[Group] = collections.deque()
        self._sample_waiters: collections.Counter[int] = collections.Counter()  # min_groups -> Samples waiting
        self._leases: dict[str, Lease] = {}
        self._sessions: dict[str, str] = {}  # learner id -> its current session
        self._consumed_episodes = BoundedSet(settings.dedup_memory)
        self._consumed_groups = BoundedSet(max(1024, settings.dedup_memory // max(1, settings.group_size)))
        self.policy_version = 0
        self._in_flight = 0
        self._stored = 0
        self._leased = 0  # trajectories in leased batches (part of _stored)
        self._stored_bytes = 0
        self._closed = False
        self._opened = False
        self._puts_running = 0  # Puts between their admission and their answer; close() waits for them
        self._started = clock()
        # counters since start (committed_groups also survives restarts, for admission)
        self.committed_groups = 0
        self.accepted_total = 0
        self.sampled_total = 0
        self.committed_total = 0
        self.duplicates_total = 0
        self.redelivered_groups = 0
        self.masked_delivered = 0
        self.full_rejections = 0
        self.disk_full_rejections = 0
        self._disk_full_logged: str | None = None
        self.replayed = 0
        self.corrupt_tails = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.staleness: collections.Counter[int] = collections.Counter()
        self.per_actor: collections.Counter[str] = collections.Counter()
        self._put_rate = RateWindow()
        self._sample_rate = RateWindow()
        self.admission = AdmissionScale(settings.admission_file, clock=clock, interval=settings.admission_check_seconds)
        self.learner_duty_cycle: float | None = None  # the learner's last report; None until it sends one
        # Called as ``listener(ready groups)`` when groups become ready, with the lock held, from
        # whichever thread made them ready: how an event-loop server wakes its waiting Samples.
        self.ready_listener: Callable[[int], None] | None = None

    # ================================================================== startup, replay

    def open(self) -> None:
        """Replay the log, then start a fresh segment. Every live trajectory is back, none twice."""
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
        self.compact()

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

    def _checkpoint(self) -> bytes:
        return buffer_pb2.LogCheckpoint(
            policy_version=self.policy_version,
            committed_groups=self.committed_groups,
            consumed_episode_ids=self._consumed_episodes.keys(),
            consumed_group_ids=self._consumed_groups.keys(),
        ).SerializeToString()

    def close(self) -> None:
        """Let running Puts finish, wake every waiting Sample, close the log."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._puts_running:
                self._cond.wait()
        self.wal.close()

    # ================================================================== Put

    def put(self, raws: Sequence[bytes | memoryview], client_id: str = "") -> PutOutcome:
        """Validate, log durably, then admit a batch. Invalid items are reported, the rest stored.

        Raises ``BufferFull`` (nothing stored), ``BatchTooLarge`` or ``Unavailable``.

        The same as ``begin_put``, ``Wal.sync`` of its position, ``finish_put``; an event-loop server
        calls the three itself so that a Put waiting for its flush holds no thread. Concurrent Puts
        share flushes: each waits for the first ``fdatasync`` that covers its bytes (group commit in
        ``Wal.sync``).
        """
        pending = self.begin_put(raws, client_id)
        try:
            self.wal.sync(pending.durable_at)
        except WalError as exc:
            self.abandon_put(pending)
            raise Unavailable(str(exc)) from exc
        return self.finish_put(pending)

    def begin_put(self, raws: Sequence[bytes | memoryview], client_id: str = "") -> PendingPut:
        """Validate a batch, admit it and append it to the log (not yet durable).

        Until ``finish_put`` (once ``Wal.sync(pending.durable_at)`` returned) or ``abandon_put``
        its trajectories are "pending": they count for duplicates, group sizes and capacity, but are
        not sampleable. Raises like ``put``.
        """
        checked = validate_batch(raws, self.settings)  # outside the lock: the expensive part
        with self._cond:
            if self._closed or not self._opened:
                raise Unavailable("the buffer is shutting down")
            outcome, new = self._admit_batch(raws, checked)
            outcome.stored = len(new)
            self._mark_pending(new, +1)
            self._puts_running += 1
        pending = PendingPut(outcome, new, None, (0, 0), client_id)
        try:
            if new:
                pending.logged = self.wal.append(PUT, [raw for raw, _ in new], pin=True)
            # Even a batch of duplicates waits for a flush: their originals may still be pending.
            pending.durable_at = pending.logged or self.wal.written
        except WalFull as exc:
            self.abandon_put(pending)
            with self._lock:
                self.disk_full_rejections += 1
                self._note_disk_full(str(exc))
            retry = max(1.0, self.settings.retry_after_seconds)
            raise DiskFull(
                f"disk full: {exc.strerror or exc} ({self.wal.free_bytes()} bytes free); Puts are refused until "
                f"the learner's commits free log space (Commits still go through); retry after {retry:g}s",
                retry,
            ) from exc
        except WalError as exc:
            self.abandon_put(pending)
            raise Unavailable(str(exc)) from exc
        return pending

    def finish_put(self, pending: PendingPut) -> PutOutcome:
        """The batch's records are durable: its trajectories join their groups."""
        with self._cond:
            try:
                self._mark_pending(pending.new, -1)
                self._store(pending.new, pending.logged[0] if pending.logged else 0, pending.client_id)
                if self.wal.active_size() > self.settings.segment_bytes:
                    self._rotate()
            finally:
                self._put_done()
        return pending.outcome

    def abandon_put(self, pending: PendingPut) -> None:
        """Take back what ``begin_put`` admitted (its log write or flush failed), and let ``close`` go on."""
        with self._cond:
            self._mark_pending(pending.new, -1)
            if pending.logged is not None:
                self.wal.unpin(pending.logged[0], len(pending.new), sum(HEADER.size + len(raw) for raw, _ in pending.new))
            self._put_done()

    def _put_done(self) -> None:
        """One Put fewer under way (caller holds the lock); ``close`` waits for none."""
        self._puts_running -= 1
        if self._closed and not self._puts_running:
            self._cond.notify_all()

    def _admit_batch(
        self, raws: Sequence[bytes | memoryview], checked: Sequence[TrajectoryMeta | Invalid]
    ) -> tuple[PutOutcome, list[tuple[bytes | memoryview, TrajectoryMeta]]]:
        """Sort a batch into new, duplicate and invalid, and check it fits (caller holds the lock)."""
        outcome, new = self._admit(raws, checked)
        if len(new) > self.settings.capacity:
            raise BatchTooLarge(
                f"trajectories: {len(new)} new trajectories in one batch; the buffer holds at most "
                f"{self.settings.capacity} (buffer.capacity): send smaller batches"
            )
        # Capacity bounds what waits for the learner. Batches it has leased are its working set:
        # counting them would throttle the actors for the learner's prefetch. They are held on top,
        # up to as much again, so memory stays bounded even for a learner that never commits.
        waiting = self._stored - self._leased + len(self._pending_ids)
        capacity = self.settings.capacity
        if waiting + len(new) > capacity or waiting + self._leased + len(new) > 2 * capacity:
            self.full_rejections += 1
            raise BufferFull(
                f"buffer full: {waiting} of {capacity} trajectories waiting, {self._leased} more leased to the "
                f"learner; retry after {self.settings.retry_after_seconds:g}s",
                self.settings.retry_after_seconds,
            )
        for code, name, _ in outcome.results:
            if code == CODE_INVALID_ARGUMENT:
                self.rejected[name] += 1
        self.duplicates_total += outcome.duplicates
        return outcome, new

    def _mark_pending(self, new: Sequence[tuple[bytes | memoryview, TrajectoryMeta]], step: int) -> None:
        """Count (``+1``) or uncount (``-1``) trajectories written but not yet durable."""
        for _, meta in new:
            if step > 0:
                self._pending_ids.add(meta.episode_id)
                self._pending_groups[meta.group_id] += 1
            else:
                self._pending_ids.discard(meta.episode_id)
                self._pending_groups[meta.group_id] -= 1
                if self._pending_groups[meta.group_id] <= 0:
                    del self._pending_groups[meta.group_id]

    def _store(self, new: Sequence[tuple[bytes | memoryview, TrajectoryMeta]], segment: int, client_id: str) -> None:
        """Durable trajectories join their groups (caller holds the lock)."""
        for raw, meta in new:
            group = self._insert(Entry(meta, raw, segment))
            self.per_actor[meta.actor_id or client_id or "unknown"] += 1
            if len(group.entries) >= group.size:
                self._on_complete(group)
        self.accepted_total += len(new)
        self._put_rate.add(self.clock(), len(new))

    def _admit(
        self, raws: Sequence[bytes | memoryview], checked: Sequence[TrajectoryMeta | Invalid]
    ) -> tuple[PutOutcome, list[tuple[bytes | memoryview, TrajectoryMeta]]]:
        """Sort one batch's trajectories into new, duplicate and refused (caller holds the lock)."""
        outcome = PutOutcome(results=[(CODE_OK, "", "")] * len(raws))
        new: list[tuple[bytes | memoryview, TrajectoryMeta]] = []
        in_batch: set[str] = set()
        batch_groups: dict[str, tuple[int, int]] = {}  # group id -> (episodes earlier in this batch, size)
        for index, (raw, meta) in enumerate(zip(raws, checked, strict=True)):
            if isinstance(meta, Invalid):
                outcome.results[index] = (CODE_INVALID_ARGUMENT, meta.field, meta.message)
                continue
            problem = self._admission_problem(meta, in_batch, batch_groups)
            if problem is None:
                count = batch_groups.get(meta.group_id, (0, 0))[0]
                in_batch.add(meta.episode_id)
                batch_groups[meta.group_id] = (count + 1, meta.group_size)
                new.append((raw, meta))
            elif problem[0] == CODE_OK:
                outcome.duplicates += 1
            else:
                outcome.results[index] = problem
        return outcome, new

    def _admission_problem(
        self, meta: TrajectoryMeta, in_batch: set[str], batch_groups: dict[str, tuple[int, int]]
    ) -> tuple[int, str, str] | None:
        """None to store; (CODE_OK, ...) for a duplicate; otherwise the per-item error."""
        episode_id, group_id = meta.episode_id, meta.group_id
        if (
            episode_id in self._live
            or episode_id in self._consumed_episodes
            or episode_id in in_batch
            or episode_id in self._pending_ids
        ):
            return CODE_OK, "", "duplicate"
        if group_id in self._consumed_groups:
            return CODE_INVALID_ARGUMENT, "group_id", f"group {group_id!r} was already complete and consumed"
        group = self._groups.get(group_id)
        in_this_batch, declared = batch_groups.get(group_id, (0, meta.group_size))
        if group is not None:
            declared = group.size
        if declared != meta.group_size:
            return (
                CODE_INVALID_ARGUMENT,
                "group_size",
                f"got {meta.group_size}; other episodes of group {group_id!r} declared {declared}",
            )
        have = (len(group.entries) if group else 0) + self._pending_groups[group_id] + in_this_batch
        if have >= meta.group_size:
            return CODE_INVALID_ARGUMENT, "group_id", f"group {group_id!r} already has all {meta.group_size} episodes"
        return None

    def _insert(self, entry: Entry) -> Group:
        meta = entry.meta
        group = self._groups.get(meta.group_id)
        if group is None:
            group = self._groups[meta.group_id] = Group(meta.group_id, meta.group_size, self.clock())
        group.entries[meta.episode_id] = entry
        self._live[meta.episode_id] = group
        if not meta.ok:
            group.failed += 1
        if meta.oldest_version >= 0 and (group.oldest_version < 0 or meta.oldest_version < group.oldest_version):
            group.oldest_version = meta.oldest_version
        self._stored += 1
        self._stored_bytes += len(entry.raw)
        return group

    def _is_stale(self, group: Group) -> bool:
        return group.oldest_version >= 0 and self.policy_version - group.oldest_version > self.settings.max_staleness

    def _on_complete(self, group: Group) -> None:
        """All episodes are in: the group becomes sampleable, or is dropped by policy."""
        self._in_flight = max(0, self._in_flight - 1)
        if group.failed == group.size:
            self._drop([group], "failed")  # nothing in it can train, whatever the policy
        elif group.failed and self.settings.failed_group_policy == "discard":
            self._drop([group], "failed")
        elif self._is_stale(group):
            self._drop([group], "stale")
        else:
            group.state = "ready"
            self._ready.append(group)
            # Wake Samples only once one of them can return: waking a learner that wants 8 groups
            # for each of them costs two thread switches per group for nothing.
            if self._sample_waiters and len(self._ready) >= min(self._sample_waiters):
                self._cond.notify_all()
            if self.ready_listener is not None:
                self.ready_listener(len(self._ready))

    # ================================================================== consumption

    def _forget(self, group: Group) -> None:
        """Remove a consumed group from memory (its consumption is already logged)."""
        del self._groups[group.group_id]
        released: collections.Counter[int] = collections.Counter()  # segment -> record bytes
        counts: collections.Counter[int] = collections.Counter()  # segment -> records
        for episode_id, entry in group.entries.items():
            del self._live[episode_id]
            self._consumed_episodes.add(episode_id)
            released[entry.segment] += entry.record_bytes
            counts[entry.segment] += 1
            self._stored_bytes -= len(entry.raw)
        self._stored -= len(group.entries)
        for segment, nbytes in released.items():  # one log call per segment, not per trajectory
            self.wal.unpin(segment, counts[segment], nbytes)
        self._consumed_groups.add(group.group_id)

    def _log_consume(self, groups: Sequence[Group], reason: str) -> Position:
        payload = buffer_pb2.LogConsume(
            group_ids=[g.group_id for g in groups],
            reason=reason,
            episode_ids=[episode_id for g in groups for episode_id in g.entries],
        ).SerializeToString()
        return self.wal.append(CONSUME, [payload], reserved=True)

    def _drop(self, groups: Sequence[Group], reason: str) -> None:
        """Drop groups for good, counted by reason. Logged without waiting for the flush: if the
        record is lost in a crash the groups come back and are dropped again."""
        if not groups:
            return
        try:
            self._log_consume(groups, reason)
        except WalError as exc:
            log.error("could not log dropped groups (%s); they stay until the next attempt", exc)
            return
        for group in groups:
            if group.state == "ready":
                self._ready.remove(group)
            self._forget(group)
            log.info("dropped group %s (%s): %d episodes", group.group_id, reason, len(group.entries))
        self.dropped[reason] += len(groups)

    # ================================================================== Sample, Commit

    def sample(
        self,
        max_groups: int,
        min_groups: int = 1,
        timeout: float = 0.0,
        *,
        learner_id: str = "",
        session_id: str = "",
    ) -> SampledBatch | None:
        """Lease up to ``max_groups`` complete groups (in ``sample_order``), waiting up to ``timeout``
        seconds for at least ``min_groups``; None when fewer arrived in time."""
        if max_groups < 1:
            raise ValueError("max_groups: got 0; expected >= 1")
        min_groups = max(1, min(min_groups, max_groups))
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._touch(learner_id, session_id)
            if not self._wait_ready(min_groups, deadline):
                return None
            now = self.clock()
            groups: list[Group] = []
            # Stay under the message size limit (with room for framing); one group always goes.
            budget = self.settings.max_message_bytes - 64 * 1024
            newest_first = self.settings.sample_order == "newest-first"
            while self._ready and len(groups) < max_groups:
                size = sum(len(e.raw) + 16 for e in self._ready[-1 if newest_first else 0].entries.values())
                if groups and size > budget:
                    break
                budget -= size
                groups.append(self._ready.pop() if newest_first else self._ready.popleft())
            batch_id = uuid.uuid4().hex
            self._leases[batch_id] = Lease(
                batch_id, learner_id, session_id, groups, now + self.settings.lease_timeout_seconds
            )
            count = 0
            for group in groups:
                group.state = "leased"
                count += len(group.entries)
                if group.oldest_version >= 0:
                    self.staleness[max(0, self.policy_version - group.oldest_version)] += 1
                if group.masked:
                    self.masked_delivered += 1
            self.sampled_total += count
            self._leased += count
            self._sample_rate.add(now, count)
            return SampledBatch(
                batch_id,
                [(g.group_id, [e.raw for e in g.entries.values()], g.masked) for g in groups],
                self.policy_version,
                self.settings.max_staleness,
            )

    def _wait_ready(self, count: int, deadline: float) -> bool:
        """Wait (holding ``_cond``) until ``count`` groups are ready; False at the deadline or close."""
        self._sample_waiters[count] += 1
        try:
            while len(self._ready) < count:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(remaining)
            return True
        finally:
            self._sample_waiters[count] -= 1
            if not self._sample_waiters[count]:
                del self._sample_waiters[count]

    def _touch(self, learner_id: str, session_id: str) -> None:
        """A call from a learner: extend its leases; a new session means it restarted."""
        if not learner_id:
            return
        previous = self._sessions.get(learner_id)
        if session_id and previous is not None and previous != session_id:
            orphans = [b for b, lease in self._leases.items() if lease.learner_id == learner_id and lease.session_id != session_id]
            if orphans:
                log.info("learner %s restarted: redelivering %d uncommitted batches", learner_id, len(orphans))
                self._redeliver(orphans)
        if session_id:
            self._sessions[learner_id] = session_id
        deadline = self.clock() + self.settings.lease_timeout_seconds
        for lease in self._leases.values():
            if lease.learner_id == learner_id:
                lease.deadline = deadline

    def _redeliver(self, batch_ids: Sequence[str]) -> None:
        groups: list[Group] = []
        for batch_id in batch_ids:
            groups += self._leases.pop(batch_id).groups
        self._leased -= sum(len(group.entries) for group in groups)
        stale = [g for g in groups if self._is_stale(g)]
        fresh = [g for g in groups if not self._is_stale(g)]
        # Back at the end of the queue that is sampled next, in their original order.
        put_back = self._ready.append if self.settings.sample_order == "newest-first" else self._ready.appendleft
        for group in reversed(fresh):
            group.state = "ready"
            put_back(group)
        self.redelivered_groups += len(fresh)
        self._drop(stale, "stale")
        self._cond.notify_all()
        if self.ready_listener is not None and fresh:
            self.ready_listener(len(self._ready))

    def commit(self, batch_id: str, *, learner_id: str = "") -> int:
        """The learner trained on ``batch_id``: its trajectories are gone for good (durably, before
        this returns). Returns the number of trajectories; ``UnknownBatch`` if not leased."""
        count, position = self.begin_commit(batch_id, learner_id=learner_id)
        try:
            self.wal.sync(position)
        except WalError as exc:
            raise Unavailable(str(exc)) from exc
        return count

    def begin_commit(self, batch_id: str, *, learner_id: str = "") -> tuple[int, Position]:
        """``commit`` up to its flush: returns the trajectory count and the log position that must
        be durable before the commit is acknowledged."""
        with self._lock:
            lease = self._leases.get(batch_id)
            if lease is None:
                raise UnknownBatch(batch_id)
            try:
                position = self._log_consume(lease.groups, "commit")
            except WalError as exc:
                raise Unavailable(str(exc)) from exc
            del self._leases[batch_id]
            count = 0
            for group in lease.groups:
                count += len(group.entries)
                self._forget(group)
            self.committed_groups += len(lease.groups)
            self.committed_total += count
            self._leased -= count
            self._touch(learner_id, "")
        return count, position

    # ================================================================== version, admission

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
        """The learner's current version: stale ready groups are dropped now, credit grows.

        ``duty_cycle`` (when given) is kept for Stats only: the operator's starvation check."""
        if duty_cycle is not None and not 0.0 <= duty_cycle <= 1.0:  # NaN fails too
            raise ValueError(f"learner_duty_cycle: got {duty_cycle}; expected 0..1")
        if not 0 <= version <= MAX_POLICY_VERSION:
            raise ValueError(f"policy_version: got {version}; expected 0..{MAX_POLICY_VERSION}")
        with self._cond:
            if version < self.policy_version:
                # A restarted learner resumes at the buffer's version + 1 (it asks Stats first), so
                # a smaller number is a second learner or a bug: its weights would reuse a number.
                raise ValueError(
                    f"policy_version: got {version}, below the current {self.policy_version}; versions never go "
                    "backwards (a restarted learner continues from the buffer's version + 1)"
                )
            if duty_cycle is not None:
                self.learner_duty_cycle = duty_cycle
            if version == self.policy_version:
                return
            self.policy_version = version
            try:
                self.wal.append(VERSION, [buffer_pb2.LogPolicyVersion(policy_version=version).SerializeToString()], reserved=True)
            except WalError as exc:
                log.error("could not log policy version %d: %s", version, exc)
            self._drop([g for g in self._ready if self._is_stale(g)], "stale")
            self._cond.notify_all()

    def configure(self, *, capacity: int | None = None, max_staleness: int | None = None) -> dict[str, tuple[int, int]]:
        """Apply the settings the buffer takes live (``Configure``): all or nothing, checked as
        ``BufferSettings`` checks them (``ValueError``). Returns what changed, ``{name: (old, new)}``.

        A lower ``max_staleness`` drops the ready groups now past it, as a new policy version
        would; a lower ``capacity`` refuses Puts until the learner has taken enough (nothing
        stored is given up)."""
        with self._cond:
            old = self.settings
            updated = replace(
                old,
                capacity=old.capacity if capacity is None else capacity,
                max_staleness=old.max_staleness if max_staleness is None else max_staleness,
            )
            changed = {
                name: (before, after)
                for name, before, after in (
                    ("capacity", old.capacity, updated.capacity),
                    ("max_staleness", old.max_staleness, updated.max_staleness),
                )
                if before != after
            }
            if not changed:
                return changed
            self.settings = updated  # one reference: every reader sees the old settings or the new
            if "max_staleness" in changed:
                self._drop([g for g in self._ready if self._is_stale(g)], "stale")
            self._cond.notify_all()
        log.info("settings applied live: %s", ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        return changed

    def _credit(self) -> int:
        """``floor(s * allowance) - outstanding`` (module docstring); may be negative."""
        b = self.settings.batch_groups
        # Only groups of batches that moved the learner count: a batch it committed without an
        # update (every group already solved, every token past maxStaleness) did not advance the
        # version, and counting it would shrink the credit for good -- the actors would stop while
        # the learner waits for data, each for the other.
        trained = min(self.committed_groups, self.policy_version * b)
        allowance = (self.settings.max_staleness + self.policy_version + 1) * b - trained
        outstanding = len(self._ready) + sum(len(lease.groups) for lease in self._leases.values()) + self._in_flight
        return math.floor(self.admission.value * allowance) - outstanding

    def acquire(self, groups: int, actor_id: str = "") -> tuple[int, int, float]:
        """Credit to start ``groups`` episode groups: ``(granted, policy version, retry hint)``."""
        self.admission.maybe_reload()  # outside the lock: a slow file system must not stall the buffer
        with self._lock:
            granted = max(0, min(groups, self._credit()))
            self._in_flight += granted
            retry = 0.0 if granted else self.settings.retry_after_seconds
            return granted, self.policy_version, retry

    def release(self, groups: int, actor_id: str = "") -> None:
        """Give back credit for groups that will never be submitted."""
        with self._lock:
            self._in_flight = max(0, self._in_flight - groups)

    # ================================================================== housekeeping

    def tick(self) -> None:
        """Periodic work: expire leases, report overdue incomplete groups, re-read the admission
        file (so Stats shows a new scale even while no actor asks for credit), compact the log."""
        self.admission.maybe_reload()
        now = self.clock()
        with self._cond:
            expired = [b for b, lease in self._leases.items() if lease.deadline < now]
            if expired:
                log.warning("%d leased batches not committed in %gs: redelivering", len(expired), self.settings.lease_timeout_seconds)
                self._redeliver(expired)
            for group in self._groups.values():
                if (
                    group.state == "incomplete"
                    and not group.timeout_reported
                    and now - group.created > self.settings.group_timeout_seconds
                ):
                    group.timeout_reported = True
                    log.warning(
                        "group %s incomplete after %gs: %d of %d episodes arrived",
                        group.group_id,
                        self.settings.group_timeout_seconds,
                        len(group.entries),
                        group.size,
                    )
        self.compact()
        self.recover_space()

    def _rotate(self) -> bool:
        """Start a new segment (caller holds the lock) headed by a checkpoint; False if it failed."""
        try:
            self.wal.rotate((CHECKPOINT, self._checkpoint()))
        except WalFull as exc:
            self._note_disk_full(str(exc))
            return False
        except WalError as exc:
            log.error("log rotation failed: %s", exc)
            return False
        return True

    def _note_disk_full(self, reason: str | None) -> None:
        """Log the disk-full state once when it begins and once when it ends (caller holds the lock)."""
        if (reason is None) == (self._disk_full_logged is None):
            return
        if reason is None:
            log.info("write-ahead log volume has room again: accepting Puts")
        else:
            log.warning("write-ahead log volume full (%s): refusing Puts until commits free space", reason)
        self._disk_full_logged = reason

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

    # ================================================================== stats

    def stats(self) -> buffer_pb2.BufferStats:
        now = self.clock()
        with self._lock:
            incomplete = [g for g in self._groups.values() if g.state == "incomplete"]
            overdue = sum(1 for g in incomplete if now - g.created > self.settings.group_timeout_seconds)
            return buffer_pb2.BufferStats(
                capacity=self.settings.capacity,
                stored_trajectories=self._stored,
                complete_groups=len(self._ready),
                incomplete_groups=len(incomplete),
                leased_batches=len(self._leases),
                fill=(self._stored - self._leased) / self.settings.capacity,
                policy_version=self.policy_version,
                admission_credit=max(-INT64_MAX, min(INT64_MAX, self._credit())),
                in_flight_groups=self._in_flight,
                accepted_total=self.accepted_total,
                sampled_total=self.sampled_total,
                committed_total=self.committed_total,
                dropped=dict(self.dropped),
                staleness_histogram=dict(self.staleness),
                per_actor_accepted=dict(self.per_actor),
                put_rate=self._put_rate.rate(now, self._started),
                sample_rate=self._sample_rate.rate(now, self._started),
                stale_incomplete_groups=overdue,
                rejected=dict(self.rejected),
                duplicates_total=self.duplicates_total,
                redelivered_groups=self.redelivered_groups,
                masked_groups_delivered=self.masked_delivered,
                committed_groups_total=self.committed_groups,
                log_bytes=self.wal.disk_bytes(),
                log_segments=len(self.wal.segments),
                replayed_trajectories=self.replayed,
                corrupt_log_tails=self.corrupt_tails,
                full_rejections=self.full_rejections,
                disk_full=self.wal.full is not None,
                disk_free_bytes=self.wal.free_bytes(),
                disk_full_rejections=self.disk_full_rejections,
                stored_bytes=self._stored_bytes,
                admission_scale=self.admission.value,
                learner_duty_cycle=self.learner_duty_cycle,
                max_staleness=self.settings.max_staleness,
            )

"""The buffer's in-memory state, and the steps every part of ``BufferCore`` shares.

``CoreState`` holds what the core's parts (``core_replay``, ``core_put``, ``core_lease``,
``core_compaction``) read and change under its lock: the groups, the ready queue, the leases, the
counters. Its methods are a group's life from first episode to consumption (insert, complete,
drop, forget) and the log records that say so: what replay, Put, Sample and housekeeping all do.

Log records (types): ``PUT`` = a serialized Trajectory exactly as received; ``CONSUME`` = groups
gone for good (committed, or dropped with a reason); ``CHECKPOINT`` = counters and recently
consumed ids, written first in every new segment; ``VERSION`` = the learner's policy version.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from stoker.buffer.admission import AdmissionScale, Clock
from stoker.buffer.counters import BoundedSet, RateWindow
from stoker.buffer.settings import BufferSettings
from stoker.buffer.state import Entry, Group, Lease
from stoker.buffer.wal import Position, Wal, WalError, WalFull
from stoker.v1 import buffer_pb2

log = logging.getLogger("stoker.buffer")

PUT, CONSUME, CHECKPOINT, VERSION = 1, 2, 3, 4

# The largest policy version accepted: far past any real run (a step a millisecond for 30 years),
# and small enough that no admission arithmetic leaves int64.
MAX_POLICY_VERSION = 1 << 40
INT64_MAX = (1 << 63) - 1


class CoreState:
    """The state behind ``BufferCore`` (which see), over a write-ahead log in ``data_dir``."""

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

    def _checkpoint(self) -> bytes:
        return buffer_pb2.LogCheckpoint(
            policy_version=self.policy_version,
            committed_groups=self.committed_groups,
            consumed_episode_ids=self._consumed_episodes.keys(),
            consumed_group_ids=self._consumed_groups.keys(),
        ).SerializeToString()

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

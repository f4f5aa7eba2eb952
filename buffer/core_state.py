"""The buffer's in-memory state and its one lock, and the steps every part of ``BufferCore`` shares.

``CoreState`` holds what the core's parts (``core_replay``, ``core_put``, ``core_lease``,
``core_compaction``, and ``core`` itself) read and change under ``lock``: the groups, the ready
queue, the leases, the counters. Its methods are a group's life from first episode to consumption
(insert, complete, drop, forget) and the log records that say so: what replay, Put, Sample and
housekeeping all do. Methods and functions documented "caller holds the lock" expect ``lock`` held.

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

from stoker.buffer.admission import AdmissionScale, Clock, CreditLedger
from stoker.buffer.counters import BoundedSet, RateWindow
from stoker.buffer.settings import BufferSettings
from stoker.buffer.state import Entry, Group, Lease
from stoker.buffer.wal import Wal
from stoker.buffer.wal_files import WalError, WalFull
from stoker.buffer.wal_format import Position
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
        self.settings = settings  # replaced whole by Configure, never changed in place
        self.clock = clock
        self.wal = Wal(
            Path(data_dir),
            fsync=settings.sync == "batch",
            segment_bytes=settings.segment_bytes,
            max_record=settings.max_message_bytes,
            reserve=settings.disk_reserve_bytes,
        )
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.groups: dict[str, Group] = {}
        self.live: dict[str, Group] = {}  # episode id -> its group
        # Trajectories written to the log but not yet durable and in the state: they count for
        # duplicates, group sizes and capacity already.
        self.pending_ids: set[str] = set()
        self.pending_groups: collections.Counter[str] = collections.Counter()
        self.ready: collections.deque[Group] = collections.deque()
        self.sample_waiters: collections.Counter[int] = collections.Counter()  # min_groups -> Samples waiting
        self.leases: dict[str, Lease] = {}  # batch id -> its lease
        self.sessions: dict[str, str] = {}  # learner id -> its current session
        self.consumed_episodes = BoundedSet(settings.dedup_memory)
        self.consumed_groups = BoundedSet(max(1024, settings.dedup_memory // max(1, settings.group_size)))
        self.policy_version = 0
        self.credits = CreditLedger()  # groups granted admission credit and not yet complete, per actor process
        self.stored = 0
        self.leased = 0  # trajectories in leased batches (part of stored)
        self.stored_bytes = 0
        self.closed = False
        self.opened = False
        self.puts_running = 0  # Puts between their admission and their answer; close() waits for them
        self.started = clock()
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
        self.disk_full_logged: str | None = None  # the disk-full reason last logged; None while there is room
        self.replayed = 0
        self.corrupt_tails = 0
        self.dropped: collections.Counter[str] = collections.Counter()
        self.rejected: collections.Counter[str] = collections.Counter()
        self.staleness: collections.Counter[int] = collections.Counter()
        self.per_actor: collections.Counter[str] = collections.Counter()
        self.put_rate = RateWindow()
        self.sample_rate = RateWindow()
        self.admission = AdmissionScale(settings.admission_file, clock=clock, interval=settings.admission_check_seconds)
        self.learner_duty_cycle: float | None = None  # the learner's last report; None until it sends one
        # Each actor's newest ActorLoad and when it came (Acquire), for Stats' actor_loads.
        self.actor_loads: dict[str, tuple[float, buffer_pb2.ActorLoad]] = {}
        # Called as ``listener(ready groups)`` when groups become ready, with the lock held, from
        # whichever thread made them ready: how an event-loop server wakes its waiting Samples.
        self.ready_listener: Callable[[int], None] | None = None
        # Called as ``listener()`` when admission credit may have grown (a new version, a commit,
        # groups dropped or given back), lock held, any thread: how it wakes its waiting Acquires.
        self.credit_listener: Callable[[], None] | None = None

    def insert(self, entry: Entry) -> Group:
        """Add a durable trajectory to its group, creating the group (caller holds the lock)."""
        meta = entry.meta
        group = self.groups.get(meta.group_id)
        if group is None:
            group = self.groups[meta.group_id] = Group(meta.group_id, meta.group_size, self.clock())
        group.entries[meta.episode_id] = entry
        self.live[meta.episode_id] = group
        if not meta.ok:
            group.failed += 1
        if meta.oldest_version >= 0 and (group.oldest_version < 0 or meta.oldest_version < group.oldest_version):
            group.oldest_version = meta.oldest_version
        self.stored += 1
        self.stored_bytes += len(entry.raw)
        return group

    def is_stale(self, group: Group) -> bool:
        return group.oldest_version >= 0 and self.policy_version - group.oldest_version > self.settings.max_staleness

    @property
    def in_flight(self) -> int:
        return self.credits.total

    def on_complete(self, group: Group, incarnation: str | None) -> None:
        """All episodes are in: the group becomes sampleable, or is dropped by policy. The credit
        it used goes back to ``incarnation`` (the actor process whose Put completed it; None on
        replay, where no credit was granted)."""
        if incarnation is not None:
            self.credits.give_back(incarnation, 1, self.clock())
        if group.failed == group.size:
            self.drop([group], "failed")  # nothing in it can train, whatever the policy
        elif group.failed and self.settings.failed_group_policy == "discard":
            self.drop([group], "failed")
        elif self.is_stale(group):
            self.drop([group], "stale")
        else:
            group.state = "ready"
            self.ready.append(group)
            # Wake Samples only once one of them can return: waking a learner that wants 8 groups
            # for each of them costs two thread switches per group for nothing.
            if self.sample_waiters and len(self.ready) >= min(self.sample_waiters):
                self.cond.notify_all()
            if self.ready_listener is not None:
                self.ready_listener(len(self.ready))

    def forget(self, group: Group) -> None:
        """Remove a consumed group from memory (its consumption is already logged)."""
        del self.groups[group.group_id]
        released: collections.Counter[int] = collections.Counter()  # segment -> record bytes
        counts: collections.Counter[int] = collections.Counter()  # segment -> records
        for episode_id, entry in group.entries.items():
            del self.live[episode_id]
            self.consumed_episodes.add(episode_id)
            released[entry.segment] += entry.record_bytes
            counts[entry.segment] += 1
            self.stored_bytes -= len(entry.raw)
        self.stored -= len(group.entries)
        for segment, nbytes in released.items():  # one log call per segment, not per trajectory
            self.wal.unpin(segment, counts[segment], nbytes)
        self.consumed_groups.add(group.group_id)

    def log_consume(self, groups: Sequence[Group], reason: str) -> Position:
        """Append the record that consumes ``groups`` (not yet durable); returns its end."""
        payload = buffer_pb2.LogConsume(
            group_ids=[g.group_id for g in groups],
            reason=reason,
            episode_ids=[episode_id for g in groups for episode_id in g.entries],
        ).SerializeToString()
        return self.wal.append(CONSUME, [payload], reserved=True)

    def drop(self, groups: Sequence[Group], reason: str) -> None:
        """Drop groups for good, counted by reason. Logged without waiting for the flush: if the
        record is lost in a crash the groups come back and are dropped again."""
        if not groups:
            return
        try:
            self.log_consume(groups, reason)
        except WalError as exc:
            log.error("could not log dropped groups (%s); they stay until the next attempt", exc)
            return
        for group in groups:
            if group.state == "ready":
                self.ready.remove(group)
            self.forget(group)
            log.info("dropped group %s (%s): %d episodes", group.group_id, reason, len(group.entries))
        self.dropped[reason] += len(groups)
        self.credit_may_have_grown()

    def credit_may_have_grown(self) -> None:
        if self.credit_listener is not None:
            self.credit_listener()

    def checkpoint(self) -> bytes:
        """The ``CHECKPOINT`` record that heads a new segment."""
        return buffer_pb2.LogCheckpoint(
            policy_version=self.policy_version,
            committed_groups=self.committed_groups,
            consumed_episode_ids=self.consumed_episodes.keys(),
            consumed_group_ids=self.consumed_groups.keys(),
        ).SerializeToString()

    def rotate(self) -> bool:
        """Start a new segment (caller holds the lock) headed by a checkpoint; False if it failed."""
        try:
            self.wal.rotate((CHECKPOINT, self.checkpoint()))
        except WalFull as exc:
            self.note_disk_full(str(exc))
            return False
        except WalError as exc:
            log.error("log rotation failed: %s", exc)
            return False
        return True

    def note_disk_full(self, reason: str | None) -> None:
        """Log the disk-full state once when it begins and once when it ends (caller holds the lock)."""
        if (reason is None) == (self.disk_full_logged is None):
            return
        if reason is None:
            log.info("write-ahead log volume has room again: accepting Puts")
        else:
            log.warning("write-ahead log volume full (%s): refusing Puts until commits free space", reason)
        self.disk_full_logged = reason

    def credit(self) -> int:
        """``floor(s * allowance) - outstanding`` (``stoker.buffer.admission``); may be negative."""
        b = self.settings.batch_groups
        # Only groups of batches that moved the learner count: a batch it committed without an
        # update (every group already solved, every token past maxStaleness) did not advance the
        # version, and counting it would shrink the credit for good -- the actors would stop while
        # the learner waits for data, each for the other.
        trained = min(self.committed_groups, self.policy_version * b)
        allowance = (self.settings.max_staleness + self.policy_version + 1) * b - trained
        outstanding = len(self.ready) + sum(len(lease.groups) for lease in self.leases.values()) + self.in_flight
        return math.floor(self.admission.value * allowance) - outstanding

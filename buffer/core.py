"""The buffer's state machine, without gRPC: groups, leases, staleness, admission, durability.

``BufferCore`` owns the in-memory state and the write-ahead log (``stoker.buffer.wal``). Its
methods are what the RPCs do; the gRPC layer (``stoker.buffer.server``) only decodes requests and
maps exceptions to status codes. It is assembled from parts that share one state and one lock
(``core_state.CoreState``, which also lists the log's record types): startup replay
(``core_replay``), Put (``core_put``), Sample and Commit (``core_lease``) and log compaction
(``core_compaction``). This module adds the lifecycle, the learner's version, live settings,
admission credit, the periodic tick and Stats.

Admission credit follows the AReaL rule, scaled by the operator (``stoker.buffer.admission``).
"""

from __future__ import annotations

from dataclasses import replace

from stoker.buffer.core_compaction import Compaction
from stoker.buffer.core_lease import Leases
from stoker.buffer.core_put import Puts
from stoker.buffer.core_replay import Replay
from stoker.buffer.core_state import CHECKPOINT, CONSUME, INT64_MAX, MAX_POLICY_VERSION, PUT, VERSION, log
from stoker.buffer.state import (
    CODE_INVALID_ARGUMENT,
    CODE_OK,
    BatchTooLarge,
    BufferFull,
    DiskFull,
    PendingPut,
    PutOutcome,
    SampledBatch,
    Unavailable,
    UnknownBatch,
)
from stoker.buffer.wal import WalError
from stoker.v1 import buffer_pb2

__all__ = [
    "CHECKPOINT",
    "CODE_INVALID_ARGUMENT",
    "CODE_OK",
    "CONSUME",
    "PUT",
    "VERSION",
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


class BufferCore(Replay, Puts, Leases, Compaction):
    """Thread-safe buffer state over a write-ahead log in ``data_dir``; call ``open()`` first."""

    def open(self) -> None:
        """Replay the log, then start a fresh segment. Every live trajectory is back, none twice."""
        self._replay()
        self.compact()

    def close(self) -> None:
        """Let running Puts finish, wake every waiting Sample, close the log."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._puts_running:
                self._cond.wait()
        self.wal.close()

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

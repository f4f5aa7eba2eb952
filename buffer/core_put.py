"""Put: validate, admit, log durably, then store a batch of trajectories (part of ``BufferCore``)."""

from __future__ import annotations

from collections.abc import Sequence

from stoker.buffer.core_state import PUT, CoreState
from stoker.buffer.state import (
    CODE_INVALID_ARGUMENT,
    CODE_OK,
    BatchTooLarge,
    BufferFull,
    DiskFull,
    Entry,
    PendingPut,
    PutOutcome,
    Unavailable,
)
from stoker.buffer.validate import Invalid, TrajectoryMeta, validate_batch
from stoker.buffer.wal import HEADER, WalError, WalFull


class Puts(CoreState):
    """``BufferCore``'s Put path."""

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

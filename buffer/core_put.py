"""Put: validate, admit, log durably, then store a batch of trajectories (``BufferCore.put``).

Functions over the shared ``CoreState``; they take its lock themselves unless they say "caller
holds the lock".
"""

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
from stoker.buffer.wal_files import WalError, WalFull
from stoker.buffer.wal_format import HEADER

NewTrajectories = list[tuple[bytes | memoryview, TrajectoryMeta]]


def put(state: CoreState, raws: Sequence[bytes | memoryview], client_id: str = "", incarnation: str = "") -> PutOutcome:
    """Validate, log durably, then admit a batch. Invalid items are reported, the rest stored.

    Raises ``BufferFull`` (nothing stored), ``BatchTooLarge`` or ``Unavailable``.

    The same as ``begin_put``, ``Wal.sync`` of its position, ``finish_put``; an event-loop server
    calls the three itself so that a Put waiting for its flush holds no thread. Concurrent Puts
    share flushes: each waits for the first ``fdatasync`` that covers its bytes (group commit in
    ``Wal.sync``).
    """
    pending = begin_put(state, raws, client_id, incarnation)
    try:
        state.wal.sync(pending.durable_at)
    except WalError as exc:
        abandon_put(state, pending)
        raise Unavailable(str(exc)) from exc
    return finish_put(state, pending)


def begin_put(
    state: CoreState, raws: Sequence[bytes | memoryview], client_id: str = "", incarnation: str = ""
) -> PendingPut:
    """Validate a batch, admit it and append it to the log (not yet durable). ``incarnation``: the
    sending actor process, whose credit a group it completes gives back.

    Until ``finish_put`` (once ``Wal.sync(pending.durable_at)`` returned) or ``abandon_put``
    its trajectories are "pending": they count for duplicates, group sizes and capacity, but are
    not sampleable. Raises like ``put``.
    """
    checked = validate_batch(raws, state.settings)  # outside the lock: the expensive part
    with state.cond:
        if state.closed or not state.opened:
            raise Unavailable("the buffer is shutting down")
        outcome, new = _admit_batch(state, raws, checked)
        outcome.stored = len(new)
        _mark_pending(state, new, +1)
        state.puts_running += 1
    pending = PendingPut(outcome, new, None, (0, 0), client_id, incarnation)
    try:
        if new:
            pending.logged = state.wal.append(PUT, [raw for raw, _ in new], pin=True)
        # Even a batch of duplicates waits for a flush: their originals may still be pending.
        pending.durable_at = pending.logged or state.wal.written
    except WalFull as exc:
        abandon_put(state, pending)
        with state.lock:
            state.disk_full_rejections += 1
            state.note_disk_full(str(exc))
        retry = max(1.0, state.settings.retry_after_seconds)
        raise DiskFull(
            f"disk full: {exc.strerror or exc} ({state.wal.free_bytes()} bytes free); Puts are refused until "
            f"the learner's commits free log space (Commits still go through); retry after {retry:g}s",
            retry,
        ) from exc
    except WalError as exc:
        abandon_put(state, pending)
        raise Unavailable(str(exc)) from exc
    return pending


def finish_put(state: CoreState, pending: PendingPut) -> PutOutcome:
    """The batch's records are durable: its trajectories join their groups."""
    with state.cond:
        try:
            _mark_pending(state, pending.new, -1)
            _store(state, pending.new, pending.logged[0] if pending.logged else 0, pending.client_id, pending.incarnation)
            if state.wal.active_size() > state.settings.segment_bytes:
                state.rotate()
        finally:
            _put_done(state)
    return pending.outcome


def abandon_put(state: CoreState, pending: PendingPut) -> None:
    """Take back what ``begin_put`` admitted (its log write or flush failed), and let ``close`` go on."""
    with state.cond:
        _mark_pending(state, pending.new, -1)
        if pending.logged is not None:
            state.wal.unpin(pending.logged[0], len(pending.new), sum(HEADER.size + len(raw) for raw, _ in pending.new))
        _put_done(state)


def _put_done(state: CoreState) -> None:
    """One Put fewer under way (caller holds the lock); ``close`` waits for none."""
    state.puts_running -= 1
    if state.closed and not state.puts_running:
        state.cond.notify_all()


def _admit_batch(
    state: CoreState, raws: Sequence[bytes | memoryview], checked: Sequence[TrajectoryMeta | Invalid]
) -> tuple[PutOutcome, NewTrajectories]:
    """Sort a batch into new, duplicate and invalid, and check it fits (caller holds the lock)."""
    outcome, new = _admit(state, raws, checked)
    if len(new) > state.settings.capacity:
        raise BatchTooLarge(
            f"trajectories: {len(new)} new trajectories in one batch; the buffer holds at most "
            f"{state.settings.capacity} (buffer.capacity): send smaller batches"
        )
    # Capacity bounds what waits for the learner. Batches it has leased are its working set:
    # counting them would throttle the actors for the learner's prefetch. They are held on top,
    # up to as much again, so memory stays bounded even for a learner that never commits.
    waiting = state.stored - state.leased + len(state.pending_ids)
    capacity = state.settings.capacity
    if waiting + len(new) > capacity or waiting + state.leased + len(new) > 2 * capacity:
        state.full_rejections += 1
        raise BufferFull(
            f"buffer full: {waiting} of {capacity} trajectories waiting, {state.leased} more leased to the "
            f"learner; retry after {state.settings.retry_after_seconds:g}s",
            state.settings.retry_after_seconds,
        )
    for code, name, _ in outcome.results:
        if code == CODE_INVALID_ARGUMENT:
            state.rejected[name] += 1
    state.duplicates_total += outcome.duplicates
    return outcome, new


def _mark_pending(state: CoreState, new: NewTrajectories, step: int) -> None:
    """Count (``+1``) or uncount (``-1``) trajectories written but not yet durable (caller holds the lock)."""
    for _, meta in new:
        if step > 0:
            state.pending_ids.add(meta.episode_id)
            state.pending_groups[meta.group_id] += 1
        else:
            state.pending_ids.discard(meta.episode_id)
            state.pending_groups[meta.group_id] -= 1
            if state.pending_groups[meta.group_id] <= 0:
                del state.pending_groups[meta.group_id]


def _store(state: CoreState, new: NewTrajectories, segment: int, client_id: str, incarnation: str) -> None:
    """Durable trajectories join their groups (caller holds the lock)."""
    state.credits.seen(incarnation, state.clock())
    for raw, meta in new:
        group = state.insert(Entry(meta, raw, segment))
        state.per_actor[meta.actor_id or client_id or "unknown"] += 1
        if len(group.entries) >= group.size:
            state.on_complete(group, incarnation)
    state.accepted_total += len(new)
    state.put_rate.add(state.clock(), len(new))


def _admit(
    state: CoreState, raws: Sequence[bytes | memoryview], checked: Sequence[TrajectoryMeta | Invalid]
) -> tuple[PutOutcome, NewTrajectories]:
    """Sort one batch's trajectories into new, duplicate and refused (caller holds the lock)."""
    outcome = PutOutcome(results=[(CODE_OK, "", "")] * len(raws))
    new: NewTrajectories = []
    in_batch: set[str] = set()
    batch_groups: dict[str, tuple[int, int]] = {}  # group id -> (episodes earlier in this batch, size)
    for index, (raw, meta) in enumerate(zip(raws, checked, strict=True)):
        if isinstance(meta, Invalid):
            outcome.results[index] = (CODE_INVALID_ARGUMENT, meta.field, meta.message)
            continue
        problem = _admission_problem(state, meta, in_batch, batch_groups)
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
    state: CoreState, meta: TrajectoryMeta, in_batch: set[str], batch_groups: dict[str, tuple[int, int]]
) -> tuple[int, str, str] | None:
    """None to store; (CODE_OK, ...) for a duplicate; otherwise the per-item error (caller holds the lock)."""
    episode_id, group_id = meta.episode_id, meta.group_id
    if (
        episode_id in state.live
        or episode_id in state.consumed_episodes
        or episode_id in in_batch
        or episode_id in state.pending_ids
    ):
        return CODE_OK, "", "duplicate"
    if group_id in state.consumed_groups:
        return CODE_INVALID_ARGUMENT, "group_id", f"group {group_id!r} was already complete and consumed"
    group = state.groups.get(group_id)
    in_this_batch, declared = batch_groups.get(group_id, (0, meta.group_size))
    if group is not None:
        declared = group.size
    if declared != meta.group_size:
        return (
            CODE_INVALID_ARGUMENT,
            "group_size",
            f"got {meta.group_size}; other episodes of group {group_id!r} declared {declared}",
        )
    have = (len(group.entries) if group else 0) + state.pending_groups[group_id] + in_this_batch
    if have >= meta.group_size:
        return CODE_INVALID_ARGUMENT, "group_id", f"group {group_id!r} already has all {meta.group_size} episodes"
    return None

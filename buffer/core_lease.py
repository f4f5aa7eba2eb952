"""Sample and Commit: leasing complete groups to learners, and taking them back (``BufferCore.sample``,
``commit``), with redelivery of batches never committed.

Functions over the shared ``CoreState``; they take its lock themselves unless they say "caller
holds the lock".
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from stoker.buffer.core_state import CoreState, log
from stoker.buffer.state import Group, Lease, SampledBatch, Unavailable, UnknownBatch
from stoker.buffer.wal_files import WalError
from stoker.buffer.wal_format import Position


def sample(
    state: CoreState,
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
    with state.cond:
        _touch(state, learner_id, session_id)
        if not _wait_ready(state, min_groups, deadline):
            return None
        now = state.clock()
        groups: list[Group] = []
        # Stay under the message size limit (with room for framing); one group always goes.
        budget = state.settings.max_message_bytes - 64 * 1024
        newest_first = state.settings.sample_order == "newest-first"
        while state.ready and len(groups) < max_groups:
            size = sum(len(e.raw) + 16 for e in state.ready[-1 if newest_first else 0].entries.values())
            if groups and size > budget:
                break
            budget -= size
            groups.append(state.ready.pop() if newest_first else state.ready.popleft())
        batch_id = uuid.uuid4().hex
        state.leases[batch_id] = Lease(batch_id, learner_id, session_id, groups, now + state.settings.lease_timeout_seconds)
        count = 0
        for group in groups:
            group.state = "leased"
            count += len(group.entries)
            if group.oldest_version >= 0:
                state.staleness[max(0, state.policy_version - group.oldest_version)] += 1
            if group.masked:
                state.masked_delivered += 1
        state.sampled_total += count
        state.leased += count
        state.sample_rate.add(now, count)
        return SampledBatch(
            batch_id,
            [(g.group_id, [e.raw for e in g.entries.values()], g.masked) for g in groups],
            state.policy_version,
            state.settings.max_staleness,
        )


def _wait_ready(state: CoreState, count: int, deadline: float) -> bool:
    """Wait (holding ``cond``) until ``count`` groups are ready; False at the deadline or close."""
    state.sample_waiters[count] += 1
    try:
        while len(state.ready) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or state.closed:
                return False
            state.cond.wait(remaining)
        return True
    finally:
        state.sample_waiters[count] -= 1
        if not state.sample_waiters[count]:
            del state.sample_waiters[count]


def _touch(state: CoreState, learner_id: str, session_id: str) -> None:
    """A call from a learner: extend its leases; a new session means it restarted (caller holds the lock)."""
    if not learner_id:
        return
    previous = state.sessions.get(learner_id)
    if session_id and previous is not None and previous != session_id:
        orphans = [b for b, lease in state.leases.items() if lease.learner_id == learner_id and lease.session_id != session_id]
        if orphans:
            log.info("learner %s restarted: redelivering %d uncommitted batches", learner_id, len(orphans))
            redeliver(state, orphans)
    if session_id:
        state.sessions[learner_id] = session_id
    deadline = state.clock() + state.settings.lease_timeout_seconds
    for lease in state.leases.values():
        if lease.learner_id == learner_id:
            lease.deadline = deadline


def redeliver(state: CoreState, batch_ids: Sequence[str]) -> None:
    """End these leases: their groups are sampleable again, or dropped if now stale (caller holds the lock)."""
    groups: list[Group] = []
    for batch_id in batch_ids:
        groups += state.leases.pop(batch_id).groups
    state.leased -= sum(len(group.entries) for group in groups)
    stale = [g for g in groups if state.is_stale(g)]
    fresh = [g for g in groups if not state.is_stale(g)]
    # Back at the end of the queue that is sampled next, in their original order.
    put_back = state.ready.append if state.settings.sample_order == "newest-first" else state.ready.appendleft
    for group in reversed(fresh):
        group.state = "ready"
        put_back(group)
    state.redelivered_groups += len(fresh)
    state.drop(stale, "stale")
    state.cond.notify_all()
    if state.ready_listener is not None and fresh:
        state.ready_listener(len(state.ready))


def commit(state: CoreState, batch_id: str, *, learner_id: str = "") -> int:
    """The learner trained on ``batch_id``: its trajectories are gone for good (durably, before
    this returns). Returns the number of trajectories; ``UnknownBatch`` if not leased."""
    count, position = begin_commit(state, batch_id, learner_id=learner_id)
    try:
        state.wal.sync(position)
    except WalError as exc:
        raise Unavailable(str(exc)) from exc
    return count


def begin_commit(state: CoreState, batch_id: str, *, learner_id: str = "") -> tuple[int, Position]:
    """``commit`` up to its flush: returns the trajectory count and the log position that must
    be durable before the commit is acknowledged."""
    with state.lock:
        lease = state.leases.get(batch_id)
        if lease is None:
            raise UnknownBatch(batch_id)
        try:
            position = state.log_consume(lease.groups, "commit")
        except WalError as exc:
            raise Unavailable(str(exc)) from exc
        del state.leases[batch_id]
        count = 0
        for group in lease.groups:
            count += len(group.entries)
            state.forget(group)
        state.committed_groups += len(lease.groups)
        state.committed_total += count
        state.leased -= count
        _touch(state, learner_id, "")
        state.credit_may_have_grown()
    return count, position

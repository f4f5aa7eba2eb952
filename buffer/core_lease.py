"""Sample and Commit: leasing complete groups to learners, and taking them back (part of ``BufferCore``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from stoker.buffer.core_state import CoreState, log
from stoker.buffer.state import Group, Lease, SampledBatch, Unavailable, UnknownBatch
from stoker.buffer.wal import Position, WalError


class Leases(CoreState):
    """``BufferCore``'s leases: Sample, Commit, and redelivery of batches never committed."""

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

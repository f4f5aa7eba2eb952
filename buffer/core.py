"""The buffer's state machine, without gRPC: groups, leases, staleness, admission, durability.

``BufferCore`` owns the in-memory state and the write-ahead log (``stoker.buffer.wal``). Its
methods are what the RPCs do; the gRPC layer (``stoker.buffer.service``) only decodes requests and
maps exceptions to status codes.

It is built by composition, not inheritance: one ``CoreState`` (``core_state``: the state, its one
lock, the steps of a group's life, the log's record types) and parts that are modules of functions
taking that state explicitly: startup replay (``core_replay``), Put (``core_put``), Sample and
Commit (``core_lease``), log compaction (``core_compaction``). Each public method below delegates
in one hop (``core.put(...)`` is ``core_put.put(state, ...)``), so a method is found from here, not
by searching mixins; the state's fields are in one ``__init__``. One class holding all of it would
be about 900 lines. This module adds the lifecycle, the learner's version, live settings, admission
credit, the periodic tick and Stats.

Thread safety: every part takes ``state.lock`` (or ``state.cond``, the same lock) for what it reads
and changes, and releases it while waiting for the disk.

Admission credit follows the AReaL rule, scaled by the operator (``stoker.buffer.admission``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from stoker.buffer import core_compaction, core_lease, core_put, core_replay
from stoker.buffer.admission import Clock
from stoker.buffer.core_state import INT64_MAX, MAX_POLICY_VERSION, VERSION, CoreState, log
from stoker.buffer.settings import BufferSettings
from stoker.buffer.state import PendingPut, PutOutcome, SampledBatch
from stoker.buffer.wal import Wal
from stoker.buffer.wal_files import WalError
from stoker.buffer.wal_format import Position
from stoker.v1 import buffer_pb2

# An actor's load report older than this is dropped from Stats: the actor has stopped (a running one
# reports with every group it starts, so this allows for groups of slow episodes).
LOAD_SECONDS = 180.0


class BufferCore:
    """Thread-safe buffer state over a write-ahead log in ``data_dir``; call ``open()`` first."""

    def __init__(self, settings: BufferSettings, data_dir: str | Path, *, clock: Clock = time.monotonic):
        self.state = CoreState(settings, data_dir, clock=clock)

    @property
    def settings(self) -> BufferSettings:
        """The settings in force (``configure`` replaces them)."""
        return self.state.settings

    @property
    def policy_version(self) -> int:
        return self.state.policy_version

    @property
    def wal(self) -> Wal:
        return self.state.wal

    @property
    def ready_listener(self) -> Callable[[int], None] | None:
        """Called as ``listener(ready groups)`` when groups become ready (``CoreState.ready_listener``)."""
        return self.state.ready_listener

    @ready_listener.setter
    def ready_listener(self, listener: Callable[[int], None] | None) -> None:
        self.state.ready_listener = listener

    @property
    def credit_listener(self) -> Callable[[], None] | None:
        """Called as ``listener()`` when admission credit may have grown (``CoreState.credit_listener``)."""
        return self.state.credit_listener

    @credit_listener.setter
    def credit_listener(self, listener: Callable[[], None] | None) -> None:
        self.state.credit_listener = listener

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Replay the log, then start a fresh segment. Every live trajectory is back, none twice."""
        core_replay.replay(self.state)
        self.compact()

    def close(self) -> None:
        """Let running Puts finish, wake every waiting Sample, close the log."""
        state = self.state
        with state.cond:
            state.closed = True
            state.cond.notify_all()
            while state.puts_running:
                state.cond.wait()
        state.wal.close()

    # ------------------------------------------------------------------ the parts' calls

    def put(self, raws: Sequence[bytes | memoryview], client_id: str = "", incarnation: str = "") -> PutOutcome:
        """Validate, log durably, then admit a batch (``core_put.put``)."""
        return core_put.put(self.state, raws, client_id, incarnation)

    def begin_put(self, raws: Sequence[bytes | memoryview], client_id: str = "", incarnation: str = "") -> PendingPut:
        """``put`` up to its flush: validated, admitted, appended (``core_put.begin_put``)."""
        return core_put.begin_put(self.state, raws, client_id, incarnation)

    def finish_put(self, pending: PendingPut) -> PutOutcome:
        """``pending`` is durable: store it (``core_put.finish_put``)."""
        return core_put.finish_put(self.state, pending)

    def abandon_put(self, pending: PendingPut) -> None:
        """``pending``'s write or flush failed: take it back (``core_put.abandon_put``)."""
        core_put.abandon_put(self.state, pending)

    def sample(
        self,
        max_groups: int,
        min_groups: int = 1,
        timeout: float = 0.0,
        *,
        learner_id: str = "",
        session_id: str = "",
    ) -> SampledBatch | None:
        """Lease up to ``max_groups`` complete groups, waiting up to ``timeout`` (``core_lease.sample``)."""
        return core_lease.sample(self.state, max_groups, min_groups, timeout, learner_id=learner_id, session_id=session_id)

    def commit(self, batch_id: str, *, learner_id: str = "") -> int:
        """Consume a leased batch durably; returns its trajectories (``core_lease.commit``)."""
        return core_lease.commit(self.state, batch_id, learner_id=learner_id)

    def begin_commit(self, batch_id: str, *, learner_id: str = "") -> tuple[int, Position]:
        """``commit`` up to its flush (``core_lease.begin_commit``)."""
        return core_lease.begin_commit(self.state, batch_id, learner_id=learner_id)

    def compact(self) -> None:
        """Delete consumed segments, copy long-lived records forward (``core_compaction.compact``)."""
        core_compaction.compact(self.state)

    def recover_space(self) -> None:
        """On a full volume, get room back (``core_compaction.recover_space``)."""
        core_compaction.recover_space(self.state)

    # ------------------------------------------------------------------ the learner's version, live settings

    def set_policy_version(self, version: int, duty_cycle: float | None = None) -> None:
        """The learner's current version: stale ready groups are dropped now, credit grows.

        ``duty_cycle`` (when given) is kept for Stats only: the operator's starvation check."""
        if duty_cycle is not None and not 0.0 <= duty_cycle <= 1.0:  # NaN fails too
            raise ValueError(f"learner_duty_cycle: got {duty_cycle}; expected 0..1")
        if not 0 <= version <= MAX_POLICY_VERSION:
            raise ValueError(f"policy_version: got {version}; expected 0..{MAX_POLICY_VERSION}")
        state = self.state
        with state.cond:
            if version < state.policy_version:
                # A restarted learner resumes at the buffer's version + 1 (it asks Stats first), so
                # a smaller number is a second learner or a bug: its weights would reuse a number.
                raise ValueError(
                    f"policy_version: got {version}, below the current {state.policy_version}; versions never go "
                    "backwards (a restarted learner continues from the buffer's version + 1)"
                )
            if duty_cycle is not None:
                state.learner_duty_cycle = duty_cycle
            if version == state.policy_version:
                return
            state.policy_version = version
            try:
                state.wal.append(VERSION, [buffer_pb2.LogPolicyVersion(policy_version=version).SerializeToString()], reserved=True)
            except WalError as exc:
                log.error("could not log policy version %d: %s", version, exc)
            state.drop([g for g in state.ready if state.is_stale(g)], "stale")
            state.cond.notify_all()
            state.credit_may_have_grown()

    def configure(self, *, capacity: int | None = None, max_staleness: int | None = None) -> dict[str, tuple[int, int]]:
        """Apply the settings the buffer takes live (``Configure``): all or nothing, checked as
        ``BufferSettings`` checks them (``ValueError``). Returns what changed, ``{name: (old, new)}``.

        A lower ``max_staleness`` drops the ready groups now past it, as a new policy version
        would; a lower ``capacity`` refuses Puts until the learner has taken enough (nothing
        stored is given up)."""
        state = self.state
        with state.cond:
            old = state.settings
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
            state.settings = updated  # one reference: every reader sees the old settings or the new
            if "max_staleness" in changed:
                state.drop([g for g in state.ready if state.is_stale(g)], "stale")
            state.cond.notify_all()
            state.credit_may_have_grown()
        log.info("settings applied live: %s", ", ".join(f"{k} {old} -> {new}" for k, (old, new) in changed.items()))
        return changed

    # ------------------------------------------------------------------ admission credit

    def acquire(
        self, groups: int, actor_id: str = "", load: buffer_pb2.ActorLoad | None = None, incarnation: str = ""
    ) -> tuple[int, int, float]:
        """Credit to start ``groups`` episode groups: ``(granted, policy version, retry hint)``.
        ``load``, the actor's own figures, is kept (the newest per actor) for Stats. The credit is
        held by ``incarnation`` (the actor's process, ``CreditLedger``): a new one of the same
        actor first gets back what the previous one held."""
        state = self.state
        state.admission.maybe_reload()  # outside the lock: a slow file system must not stall the buffer
        with state.lock:
            if load is not None:
                state.actor_loads[actor_id] = (state.clock(), load)
            now = state.clock()
            state.credits.register(actor_id, incarnation, now)  # a restarted actor's old credit comes back first
            granted = max(0, min(groups, state.credit()))
            state.credits.grant(incarnation, granted, now)
            retry = 0.0 if granted else state.settings.retry_after_seconds
            return granted, state.policy_version, retry

    def release(self, groups: int, actor_id: str = "", incarnation: str = "") -> None:
        """Give back credit for groups that will never be submitted."""
        with self.state.lock:
            self.state.credits.give_back(incarnation, groups, self.state.clock())
            self.state.credit_may_have_grown()

    # ------------------------------------------------------------------ housekeeping, Stats

    def tick(self) -> None:
        """Periodic work: expire leases and the credit of actors silent for longer than a group
        may take, report overdue incomplete groups, re-read the admission file (so Stats shows a
        new scale even while no actor asks for credit), compact the log."""
        state = self.state
        state.admission.maybe_reload()
        now = state.clock()
        with state.cond:
            expired = [b for b, lease in state.leases.items() if lease.deadline < now]
            if expired:
                log.warning("%d leased batches not committed in %gs: redelivering", len(expired), state.settings.lease_timeout_seconds)
                core_lease.redeliver(state, expired)
            for actor_id, groups in state.credits.expire(now, state.settings.group_timeout_seconds):
                log.warning("actor %s silent for %gs: its credit for %d groups given back", actor_id,
                            state.settings.group_timeout_seconds, groups)
            for group in state.groups.values():
                if (
                    group.state == "incomplete"
                    and not group.timeout_reported
                    and now - group.created > state.settings.group_timeout_seconds
                ):
                    group.timeout_reported = True
                    log.warning(
                        "group %s incomplete after %gs: %d of %d episodes arrived",
                        group.group_id,
                        state.settings.group_timeout_seconds,
                        len(group.entries),
                        group.size,
                    )
            state.credit_may_have_grown()  # expired credit, a new admission scale
        self.compact()
        self.recover_space()

    def stats(self) -> buffer_pb2.BufferStats:
        state = self.state
        now = state.clock()
        with state.lock:
            incomplete = [g for g in state.groups.values() if g.state == "incomplete"]
            overdue = sum(1 for g in incomplete if now - g.created > state.settings.group_timeout_seconds)
            return buffer_pb2.BufferStats(
                capacity=state.settings.capacity,
                stored_trajectories=state.stored,
                complete_groups=len(state.ready),
                incomplete_groups=len(incomplete),
                leased_batches=len(state.leases),
                fill=(state.stored - state.leased) / state.settings.capacity,
                policy_version=state.policy_version,
                admission_credit=max(-INT64_MAX, min(INT64_MAX, state.credit())),
                in_flight_groups=state.in_flight,
                accepted_total=state.accepted_total,
                sampled_total=state.sampled_total,
                committed_total=state.committed_total,
                dropped=dict(state.dropped),
                staleness_histogram=dict(state.staleness),
                per_actor_accepted=dict(state.per_actor),
                put_rate=state.put_rate.rate(now, state.started),
                sample_rate=state.sample_rate.rate(now, state.started),
                stale_incomplete_groups=overdue,
                rejected=dict(state.rejected),
                duplicates_total=state.duplicates_total,
                redelivered_groups=state.redelivered_groups,
                masked_groups_delivered=state.masked_delivered,
                committed_groups_total=state.committed_groups,
                log_bytes=state.wal.disk_bytes(),
                log_segments=len(state.wal.segments),
                replayed_trajectories=state.replayed,
                corrupt_log_tails=state.corrupt_tails,
                full_rejections=state.full_rejections,
                disk_full=state.wal.full is not None,
                disk_free_bytes=state.wal.free_bytes(),
                disk_full_rejections=state.disk_full_rejections,
                stored_bytes=state.stored_bytes,
                admission_scale=state.admission.value,
                learner_duty_cycle=state.learner_duty_cycle,
                max_staleness=state.settings.max_staleness,
                actor_loads=self._fresh_loads(now),
            )

    def _fresh_loads(self, now: float) -> dict[str, buffer_pb2.ActorLoad]:
        """Loads reported in the last ``LOAD_SECONDS``; older ones are forgotten (caller holds the lock)."""
        loads = self.state.actor_loads
        for actor in [a for a, (at, _) in loads.items() if now - at > LOAD_SECONDS]:
            del loads[actor]
        return {actor: load for actor, (_, load) in loads.items()}

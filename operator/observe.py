"""Pure readers: children's API objects and the buffer's Stats -> small observation records."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from stoker.bottleneck import ActorLoad


@dataclass(frozen=True)
class LearnerObservation:
    exists: bool
    ready: bool = False
    completed: bool = False
    failed: bool = False
    deleting: bool = False
    """Deletion requested (suspend): its pods are checkpointing within their grace period."""
    message: str = ""
    restarts: int = 0


@dataclass(frozen=True)
class DeploymentObservation:
    exists: bool
    ready: int = 0
    replicas: int = 0
    """``spec.replicas`` as the Deployment currently has it."""


@dataclass(frozen=True)
class StatsSnapshot:
    """The fields of ``stoker.v1.BufferStats`` the operator acts on."""

    policy_version: int = 0
    fill: float = 0.0
    complete_groups: int = 0
    stored_trajectories: int = 0
    in_flight_groups: int = 0
    staleness_histogram: Mapping[int, int] = field(default_factory=dict)
    dropped: Mapping[str, int] = field(default_factory=dict)
    learner_duty_cycle: float | None = None
    disk_full: bool = False  # the log's volume is full: the buffer refuses Puts
    disk_free_bytes: int = 0
    # The live settings in force (``stoker.operator.rollout.LIVE_BUFFER_FIELDS``); None = not reported.
    capacity: int | None = None
    max_staleness: int | None = None
    # The newest held-out evaluation round: (policy version, success rate, mean reward, episodes).
    evaluation: tuple[int, float, float, int] | None = None
    # Trajectories/s put by actors and sampled by the learner (last minute), groups delivered in all:
    # what stoker.bottleneck reads to name the loop's bottleneck.
    put_rate: float = 0.0
    sample_rate: float = 0.0
    committed_groups_total: int = 0
    # Each actor's own load (Stats.actor_loads), by actor id: CPU-bound or latency-bound actors.
    actor_loads: Mapping[str, ActorLoad] = field(default_factory=dict)


def _conditions(obj: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def _true(conditions: Mapping[str, Mapping[str, Any]], kind: str) -> bool:
    return conditions.get(kind, {}).get("status") == "True"


def observe_deployment(obj: Mapping[str, Any] | None) -> DeploymentObservation:
    if obj is None:
        return DeploymentObservation(exists=False)
    status = obj.get("status") or {}
    return DeploymentObservation(
        exists=True, ready=int(status.get("readyReplicas") or 0), replicas=int((obj.get("spec") or {}).get("replicas") or 0)
    )


def _deleting(obj: Mapping[str, Any]) -> bool:
    return bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def observe_jobset(obj: Mapping[str, Any] | None, slices: int) -> LearnerObservation:
    """JobSet status: Completed/Failed conditions, and per replicated job the count of ready Jobs."""
    if obj is None:
        return LearnerObservation(exists=False, message="no learner JobSet")
    conditions = _conditions(obj)
    status = obj.get("status") or {}
    restarts = int(status.get("restarts") or 0)
    if _true(conditions, "Failed"):
        message = conditions["Failed"].get("message") or "the learner JobSet failed"
        return LearnerObservation(exists=True, failed=True, message=message, restarts=restarts)
    if _true(conditions, "Completed"):
        return LearnerObservation(exists=True, completed=True, message="training finished", restarts=restarts)
    ready = sum(int(r.get("ready") or 0) for r in status.get("replicatedJobsStatus") or [])
    return LearnerObservation(
        exists=True,
        ready=ready >= slices and not _deleting(obj),
        deleting=_deleting(obj),
        message=f"{min(ready, slices)}/{slices} slices ready" + (f", {restarts} restarts" if restarts else ""),
        restarts=restarts,
    )


def observe_indexed_jobs(objs: Sequence[Mapping[str, Any] | None], hosts: int) -> LearnerObservation:
    """The fallback's Indexed Jobs, one per slice: ready when every host of every slice is."""
    present = [o for o in objs if o is not None]
    if not present:
        return LearnerObservation(exists=False, message="no learner Jobs")
    for obj in present:
        conditions = _conditions(obj)
        if _true(conditions, "Failed"):
            message = conditions["Failed"].get("message") or f"learner Job {obj['metadata']['name']} failed"
            return LearnerObservation(exists=True, failed=True, message=message)
    if len(present) == len(objs) and all(_true(_conditions(o), "Complete") for o in present):
        return LearnerObservation(exists=True, completed=True, message="training finished")
    ready_slices = sum(1 for o in present if int((o.get("status") or {}).get("ready") or 0) >= hosts)
    deleting = any(_deleting(o) for o in present)
    return LearnerObservation(
        exists=True,
        ready=ready_slices == len(objs) and not deleting,
        deleting=deleting,
        message=f"{ready_slices}/{len(objs)} slices ready",
    )


def snapshot_from_proto(stats: Any) -> StatsSnapshot:
    """``stoker.v1.BufferStats`` -> ``StatsSnapshot`` (duty cycle only when the learner reported it)."""
    duty: float | None = None
    if "learner_duty_cycle" in type(stats).DESCRIPTOR.fields_by_name and stats.HasField("learner_duty_cycle"):
        duty = float(stats.learner_duty_cycle)
    max_staleness: int | None = None
    if "max_staleness" in type(stats).DESCRIPTOR.fields_by_name and stats.HasField("max_staleness"):
        max_staleness = int(stats.max_staleness)
    return StatsSnapshot(
        policy_version=int(stats.policy_version),
        fill=float(stats.fill),
        complete_groups=int(stats.complete_groups),
        stored_trajectories=int(stats.stored_trajectories),
        in_flight_groups=int(stats.in_flight_groups),
        staleness_histogram={int(k): int(v) for k, v in stats.staleness_histogram.items()},
        dropped={str(k): int(v) for k, v in stats.dropped.items()},
        learner_duty_cycle=duty,
        disk_full=bool(getattr(stats, "disk_full", False)),
        disk_free_bytes=int(getattr(stats, "disk_free_bytes", 0)),
        capacity=int(stats.capacity) or None,
        max_staleness=max_staleness,
        evaluation=_newest_eval(stats),
        put_rate=float(stats.put_rate),
        sample_rate=float(stats.sample_rate),
        committed_groups_total=int(stats.committed_groups_total),
        actor_loads={
            str(actor): ActorLoad(float(load.cpu_cores), float(load.episodes_in_flight), int(load.concurrency))
            for actor, load in getattr(stats, "actor_loads", {}).items()  # a buffer older than ActorLoad has none
        },
    )


def _newest_eval(stats: Any) -> tuple[int, float, float, int] | None:
    rounds = list(getattr(stats, "eval_rounds", ()))  # a buffer older than ReportEval has none
    if not rounds:
        return None
    newest = rounds[-1]
    return int(newest.policy_version), float(newest.success_rate), float(newest.mean_reward), int(newest.episodes)

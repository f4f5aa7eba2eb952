"""Observed state -> the RLJob's ``status`` (phase, figures and ``metav1.Condition``s).

``build_status`` is pure: the timer gathers observations, this decides what they mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from stoker.bottleneck import Bottleneck
from stoker.operator.conditions import Cond
from stoker.operator.control import StalenessWindow, actors_diagnosis
from stoker.operator.health import Part, Restarts, health_conditions
from stoker.operator.observe import DeploymentObservation, LearnerObservation, StatsSnapshot
from stoker.operator.rollout_control import RolloutReading
from stoker.spec import RLJobSpec
from stoker.status import Condition, RestartLedger, RLJobStatus


def rfc3339(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


MAX_CONDITION_MESSAGE = 32768  # metav1.Condition's limit, declared in the CRD


def merge_conditions(
    previous: Sequence[Mapping[str, Any]], new: Sequence[Cond], now: datetime, generation: int | None
) -> list[dict[str, Any]]:
    """New conditions, keeping each one's ``lastTransitionTime`` unless its status changed."""
    before = {c.get("type"): c for c in previous}
    out: list[dict[str, Any]] = []
    for cond in new:
        old = before.get(cond.type)
        changed = old is None or old.get("status") != cond.status or not old.get("lastTransitionTime")
        stamp = rfc3339(now) if changed or old is None else str(old["lastTransitionTime"])
        model = Condition(
            type=cond.type,
            status=cond.status,
            reason=cond.reason,
            message=cond.message[:MAX_CONDITION_MESSAGE],
            observed_generation=generation,
            last_transition_time=stamp,
        )
        out.append(model.model_dump(by_alias=True, exclude_none=True))
    return out


@dataclass(frozen=True)
class Observed:
    """Everything one status computation looks at."""

    spec: RLJobSpec
    generation: int | None
    learner: LearnerObservation
    actors: DeploymentObservation | None
    """None in colocated mode."""
    actor_target: int
    buffer: DeploymentObservation | None
    stats: StatsSnapshot | None
    stats_error: str | None
    window: StalenessWindow | None
    exceeded: bool | None
    starved: bool | None
    zombies_reaped: int
    admission_scale: float
    spec_problem: tuple[str, str] | None = None
    """(reason, message) when the current spec was refused and ``spec`` is the one still applied."""
    rollout_target: int = 0
    rollout_ready: int = 0
    rollout_reading: RolloutReading | None = None
    """The servers' Stats; None without a rollout tier."""
    rollout_blocked: str | None = None
    """Why no rollout server can run (a multi-host tier without the JobSet API)."""
    restarts: Mapping[str, Restarts] = field(default_factory=dict)
    """Per component (``restart_ledger.track_restarts``); absent ones restarted 0 times."""
    restart_ledger: RestartLedger | None = None
    """What those counts are kept from (``status.restartLedger``); None keeps the previous one."""


def _learner_condition(o: Observed) -> Cond:
    learner = o.learner
    if o.spec.suspend:
        if learner.exists:
            return Cond("LearnerReady", "False", "Checkpointing", "suspending: the learner checkpoints, then stops")
        return Cond("LearnerReady", "False", "Suspended", "the learner is removed while suspended")
    if learner.failed:
        return Cond("LearnerReady", "False", "Failed", learner.message)
    if learner.completed:
        return Cond("LearnerReady", "False", "Completed", learner.message)
    if not learner.exists:
        return Cond("LearnerReady", "False", "Creating", learner.message)
    if learner.ready:
        return Cond("LearnerReady", "True", "Running", learner.message)
    return Cond("LearnerReady", "False", "Pending", learner.message)


def _actors_condition(o: Observed) -> Cond:
    if o.actors is None and o.spec.algorithm.trains_on_dataset:
        return Cond("ActorsAvailable", "True", "Dataset", "the learner trains on a dataset file: no actors")
    if o.actors is None:
        return Cond("ActorsAvailable", "True", "Colocated", "colocated mode: the learner runs episodes")
    if o.spec.suspend:
        return Cond("ActorsAvailable", "False", "Suspended", "actors are scaled to 0 while suspended")
    message = f"{o.actors.ready}/{o.actor_target} actors ready"
    if not o.actors.exists:
        return Cond("ActorsAvailable", "False", "Creating", "no actor Deployment")
    floor = max(1, min(o.actor_target, o.spec.actors.min_replicas))
    if o.actors.ready >= floor:
        return Cond("ActorsAvailable", "True", "MinimumReplicasAvailable", message)
    return Cond("ActorsAvailable", "False", "MinimumReplicasUnavailable", message)


def _rollout_condition(o: Observed) -> Cond:
    if o.spec.rollout is None:
        return Cond("RolloutReady", "True", "InProcess", "no rollout tier: actors sample in-process")
    if o.actors is None and o.spec.algorithm.trains_on_dataset:
        return Cond("RolloutReady", "True", "Dataset", "the learner trains on a dataset file: nothing samples")
    if o.actors is None:
        return Cond("RolloutReady", "True", "Colocated", "colocated mode: the learner generates")
    if o.spec.suspend:
        return Cond("RolloutReady", "False", "Suspended", "rollout servers are scaled to 0 while suspended")
    if o.rollout_blocked:
        return Cond("RolloutReady", "False", "JobSetMissing", o.rollout_blocked)
    message = f"{o.rollout_ready}/{o.rollout_target} rollout servers ready"
    reading = o.rollout_reading
    if reading is not None and reading.errors:
        message += f"; {len(reading.errors)} not answering Stats: " + "; ".join(reading.errors[:3])
    floor = max(1, min(o.rollout_target, o.spec.rollout.min_replicas))
    if o.rollout_ready < floor:
        return Cond("RolloutReady", "False", "MinimumReplicasUnavailable", message)
    if reading is None or not reading.servers:
        return Cond("RolloutReady", "False", "StatsUnavailable", message)
    return Cond("RolloutReady", "True", "Serving", f"{message}, {reading.tokens_per_second:.0f} tokens/s")


def _rollout_status(o: Observed, previous: Mapping[str, Any]) -> dict[str, Any] | None:
    """Figures from the servers that answered; the last ones kept when none did."""
    if o.spec.rollout is None or o.actors is None:
        return None
    before = previous.get("rollout") or {}
    out: dict[str, Any] = {"ready": o.rollout_ready, "desired": o.rollout_target, "summary": f"{o.rollout_ready}/{o.rollout_target}",
                           "specReplicas": o.spec.rollout.replicas}
    reading = o.rollout_reading
    if reading is not None and reading.servers:
        occupancy = reading.occupancy
        out |= {"tokensPerSecond": round(reading.tokens_per_second, 1), "queueDepth": reading.queue_depth,
                "batchOccupancy": None if occupancy is None else round(occupancy, 4)}
    else:
        out |= {k: before[k] for k in ("tokensPerSecond", "queueDepth", "batchOccupancy") if k in before}
    out["answering"] = len(reading.servers) if reading is not None else 0
    return {k: v for k, v in out.items() if v is not None}


def disk_full_condition(stats: StatsSnapshot) -> Cond | None:
    """``BufferReady=False/DiskFull`` while the buffer's log volume refuses Puts; None otherwise."""
    if not stats.disk_full:
        return None
    return Cond(
        "BufferReady",
        "False",
        "DiskFull",
        f"the buffer's log volume is full ({stats.disk_free_bytes} bytes free): Puts are refused until the "
        "learner's commits free space; raise spec.buffer.storageSize if this persists",
    )


def _buffer_condition(o: Observed) -> Cond:
    if o.buffer is None and o.spec.algorithm.trains_on_dataset:
        return Cond("BufferReady", "True", "Dataset", "the learner trains on a dataset file: no buffer")
    if o.buffer is None:
        return Cond("BufferReady", "True", "Colocated", "colocated mode: no buffer")
    if not o.buffer.exists:
        return Cond("BufferReady", "False", "Creating", "no buffer Deployment")
    if o.buffer.ready < 1:
        return Cond("BufferReady", "False", "Pending", "the buffer pod is not ready")
    if o.stats is None:
        return Cond("BufferReady", "False", "StatsUnavailable", o.stats_error or "no Stats from the buffer")
    disk_full = disk_full_condition(o.stats)
    if disk_full is not None:
        return disk_full
    return Cond("BufferReady", "True", "Serving", f"fill {o.stats.fill:.0%}, {o.stats.complete_groups} complete groups")


def _staleness_condition(o: Observed) -> Cond:
    limit = o.spec.buffer.max_staleness
    if o.exceeded is None or o.window is None:
        return Cond("StalenessExceeded", "Unknown", "NoStats", "no staleness figures from the buffer")
    detail = f"window max {o.window.max}, p50 {o.window.p50}, {o.window.dropped} groups dropped as stale; limit {limit}"
    if o.exceeded:
        return Cond("StalenessExceeded", "True", "AboveLimit", detail)
    return Cond("StalenessExceeded", "False", "WithinLimit", detail)


def _bottleneck(o: Observed) -> Bottleneck | None:
    """What caps the learner now (stoker.bottleneck); None while balanced, unknown or colocated."""
    if o.actors is None:
        return None
    return actors_diagnosis(o.stats, o.spec, o.actor_target)


def _starved_condition(o: Observed) -> Cond:
    if o.stats is None:
        return Cond("LearnerStarved", "Unknown", "NoStats", "no Stats from the buffer")
    if o.starved is None:
        return Cond("LearnerStarved", "Unknown", "DutyCycleUnknown", "the learner has not reported its duty cycle")
    duty = o.stats.learner_duty_cycle or 0.0
    detail = f"{o.stats.complete_groups} complete groups buffered, learner busy {duty:.0%} of the time"
    found = _bottleneck(o)
    if found is not None and found.limit == "actors":
        detail += f": {found}"
    if o.starved:
        return Cond("LearnerStarved", "True", "BufferEmpty", detail)
    return Cond("LearnerStarved", "False", "Fed", detail)


def _spec_condition(o: Observed) -> Cond:
    if o.spec_problem is None:
        return Cond("SpecAccepted", "True", "Applied", "the children run the current spec")
    reason, message = o.spec_problem
    return Cond("SpecAccepted", "False", reason, f"edit refused, the children keep the last applied spec: {message}")


def _evaluation(stats: StatsSnapshot) -> dict[str, Any]:
    assert stats.evaluation is not None
    version, success, reward, episodes = stats.evaluation
    return {"policyVersion": version, "successRate": round(success, 4), "meanReward": round(reward, 4), "episodes": episodes}


def _parts(o: Observed, learner_c: Cond, actors_c: Cond, buffer_c: Cond, rollout_c: Cond) -> list[Part]:
    """This job's components for ``health_conditions``: down while their condition is False,
    except while suspended or done (nothing is meant to run then)."""
    learner = o.learner
    finished = learner.completed or learner.failed  # the actors and servers are scaled to 0 then

    def down(c: Cond) -> bool:
        return c.status == "False" and not o.spec.suspend and not finished and c.reason != "Suspended"

    parts = [Part("learner", learner.failed or down(learner_c), o.restarts.get("learner") or Restarts(),
                  failed=learner.failed)]
    if o.buffer is not None:
        parts.append(Part("buffer", down(buffer_c), o.restarts.get("buffer") or Restarts()))
    if o.actors is not None:
        parts.append(Part("actors", down(actors_c), o.restarts.get("actors") or Restarts()))
    if o.spec.rollout is not None and o.actors is not None:
        parts.append(Part("rollout", down(rollout_c), o.restarts.get("rollout") or Restarts()))
    return parts


def build_status(o: Observed, previous: Mapping[str, Any], now: datetime) -> dict[str, Any]:
    """The whole ``status`` (camelCase, as patched) for observations ``o``.

    Figures the operator could not read this time keep their previous values.
    """
    learner_c, actors_c, buffer_c = _learner_condition(o), _actors_condition(o), _buffer_condition(o)
    rollout_c = _rollout_condition(o)
    if o.spec.suspend:
        suspended = Cond("Suspended", "True", "Suspended" if not o.learner.exists else "Suspending", "spec.suspend is true")
    else:
        suspended = Cond("Suspended", "False", "Running", "")
    parts_ready = all(c.status == "True" for c in (learner_c, actors_c, buffer_c, rollout_c))
    if parts_ready and not o.spec.suspend:
        ready = Cond("Ready", "True", "AllComponentsReady", "learner, actors and buffer are ready"
                     + (" and the rollout tier serves" if rollout_c.reason == "Serving" else ""))
    else:
        first = next(c for c in (suspended, learner_c, actors_c, buffer_c, rollout_c)
                     if c.status != ("False" if c is suspended else "True"))
        ready = Cond("Ready", "False", first.reason, first.message)

    policy_version = o.stats.policy_version if o.stats is not None else previous.get("policyVersion")
    if o.learner.failed:
        phase = "Failed"
    elif o.learner.completed:
        phase = "Succeeded"
    elif o.spec.suspend:
        phase = "Suspended"
    elif parts_ready:
        phase = "Running"
    elif policy_version:
        phase = "Degraded"  # it has trained before, and a part is down now
    else:
        phase = "Pending"

    # "Has run": trained (a policy version), or was Running before; a part down now is then degraded.
    started = bool(policy_version) or previous.get("phase") in ("Running", "Degraded")
    degraded, recovering = health_conditions(_parts(o, learner_c, actors_c, buffer_c, rollout_c), started=started)
    actors_ready = o.actors.ready if o.actors is not None else 0
    desired = o.actor_target if o.actors is not None else 0
    status = RLJobStatus.model_validate(
        {
            "phase": phase,
            "observedGeneration": o.generation,
            "policyVersion": policy_version,
            "staleness": (
                {"p50": o.window.p50, "max": o.window.max, "dropped": o.window.dropped}
                if o.window is not None
                else previous.get("staleness")
            ),
            "bufferFill": round(o.stats.fill, 4) if o.stats is not None else previous.get("bufferFill"),
            "learnerDutyCycle": (
                round(o.stats.learner_duty_cycle, 4)
                if o.stats is not None and o.stats.learner_duty_cycle is not None
                else previous.get("learnerDutyCycle")
            ),
            "actors": {"ready": actors_ready, "desired": desired, "summary": f"{actors_ready}/{desired}"},
            "rollout": _rollout_status(o, previous),
            "zombiesReaped": o.zombies_reaped,
            "restarts": {name: r.total for name, r in o.restarts.items()},
            "restartLedger": (o.restart_ledger.model_dump(by_alias=True) if o.restart_ledger is not None
                              else previous.get("restartLedger")),
            "evaluation": _evaluation(o.stats) if o.stats is not None and o.stats.evaluation else previous.get("evaluation"),
            "admissionScale": o.admission_scale,
            "bottleneck": (
                (str(found) if (found := _bottleneck(o)) is not None else "") if o.stats is not None
                else previous.get("bottleneck")
            ),
            "message": _spec_condition(o).message if o.spec_problem else (ready.message if ready.status != "True" else ""),
            "conditions": merge_conditions(
                previous.get("conditions") or [],
                [ready, learner_c, actors_c, buffer_c, suspended, _staleness_condition(o), _starved_condition(o),
                 _spec_condition(o), rollout_c, degraded, recovering],
                now,
                o.generation,
            ),
        }
    )
    return status.model_dump(by_alias=True, exclude_none=True)


def failed_status(message: str, reason: str, previous: Mapping[str, Any], now: datetime, generation: int | None) -> dict[str, Any]:
    """Status of an RLJob the operator refuses (invalid spec, a child refused): phase Failed,
    Ready False with why; the other conditions stay as last observed."""
    before = list(previous.get("conditions") or [])
    conditions = merge_conditions(before, [Cond("Ready", "False", reason, message)], now, generation)
    conditions += [dict(c) for c in before if c.get("type") != "Ready"]
    status = RLJobStatus.model_validate(
        {"phase": "Failed", "observedGeneration": generation, "message": message, "conditions": conditions}
    )
    return status.model_dump(by_alias=True, exclude_none=True)

"""pod status -> restarts per component -> the RLJob's Degraded and Recovering conditions."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from stoker.operator.health import Part, Restarts, component_restarts, describe, health_conditions
from stoker.operator.jobstatus import build_status
from stoker.operator.observe import DeploymentObservation, LearnerObservation
from stoker.operator.podhealth import PodHealth, pod_health
from stoker.operator.zombies import PodRecord, find_zombies, pod_record
from stoker.status import RLJobStatus

from .test_status import T0, conditions, observed


def container(restarts: int = 0, *, last: str = "", last_at: str = "", now: str = "", waiting: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {"name": "c", "restartCount": restarts, "state": {}}
    if last:
        out["lastState"] = {"terminated": {"reason": last, "exitCode": 137, "finishedAt": last_at}}
    if now:
        out["state"] = {"terminated": {"reason": now, "finishedAt": "2026-01-01T00:09:00Z"}}
    if waiting:
        out["state"] = {"waiting": {"reason": waiting}}
    return out


def test_pod_health_reads_restarts_reasons_and_back_off() -> None:
    status = {"phase": "Running", "containerStatuses": [
        container(2, last="OOMKilled", last_at="2026-01-01T00:05:00Z", waiting="CrashLoopBackOff"),
        container(1, last="Error", last_at="2026-01-01T00:01:00Z"),
    ], "initContainerStatuses": [container(1)]}
    health = pod_health(status)
    assert health.restarts == 4  # init containers count too
    assert health.last_reason == "OOMKilled"  # the newest termination, not the first container's
    assert health.waiting == "CrashLoopBackOff" and not health.finished
    # Waiting to start (ContainerCreating) is no back-off: the pod is coming up.
    assert pod_health({"containerStatuses": [container(waiting="ContainerCreating")]}).waiting == ""
    evicted = pod_health({"phase": "Failed", "reason": "Evicted", "containerStatuses": [container()]})
    assert evicted.finished and evicted.last_reason == "Evicted"
    assert pod_health(None) == PodHealth() == pod_health({})  # not scheduled yet


def test_restarts_per_component() -> None:
    def rec(name: str, role: str, **status: Any) -> PodRecord:
        return pod_record(name, {"stoker.dev/role": role}, {}, {}, status)

    pods = [
        rec("b", "buffer", containerStatuses=[container(2, last="OOMKilled", last_at="2026-01-01T00:05:00Z")]),
        rec("a1", "actor", containerStatuses=[container(1, last="Error", last_at="2026-01-01T00:01:00Z")]),
        rec("a2", "actor", containerStatuses=[container(3, last="OOMKilled", last_at="2026-01-01T00:07:00Z",
                                                        waiting="CrashLoopBackOff")]),
        rec("s", "sandbox", containerStatuses=[container(9)]),  # an episode's sandbox is no component
        rec("l", "learner"),
    ]
    restarts = component_restarts(pods, learner_workload_restarts=2)
    assert restarts["buffer"] == Restarts(pods=2, last_reason="OOMKilled")
    assert restarts["actors"] == Restarts(pods=4, last_reason="OOMKilled", waiting="CrashLoopBackOff")
    assert restarts["learner"] == Restarts(workload=2) and restarts["learner"].total == 2
    assert restarts["rollout"] == Restarts()


def test_a_restarted_buffer_that_is_up_again_is_not_degraded_but_counted() -> None:
    parts = [Part("learner", False), Part("buffer", False, Restarts(pods=2, last_reason="OOMKilled")),
             Part("actors", False)]
    degraded, recovering = health_conditions(parts, started=True)
    assert (degraded.status, degraded.reason) == ("False", "AllComponentsUp")
    assert "restarts: learner 0, buffer 2 (last: OOMKilled), actors 0" in degraded.message
    assert (recovering.status, recovering.reason) == ("False", "NothingToRecover")


def test_a_crash_looping_buffer_is_degraded_and_not_recovering() -> None:
    buffer = Part("buffer", True, Restarts(pods=2, last_reason="OOMKilled", waiting="CrashLoopBackOff"))
    degraded, recovering = health_conditions([Part("learner", False), buffer], started=True)
    assert (degraded.status, degraded.reason) == ("True", "CrashLoopBackOff")
    assert degraded.message.startswith("buffer down: buffer pod restarted 2 times, last: OOMKilled, now CrashLoopBackOff")
    assert (recovering.status, recovering.reason) == ("False", "Stuck")


def test_a_lost_learner_slice_is_recovering_from_its_checkpoint() -> None:
    learner = Part("learner", True, Restarts(workload=1))
    degraded, recovering = health_conditions([learner, Part("buffer", False), Part("actors", False)], started=True)
    assert (recovering.status, recovering.reason) == ("True", "Restarting")
    assert recovering.message.startswith("learner coming back: learner JobSet restarted 1 time")
    assert "resumes from its last checkpoint, the buffer keeps its data" in recovering.message
    assert (degraded.status, degraded.reason) == ("True", "ComponentDown")
    assert "restarts: learner 1, buffer 0, actors 0" in degraded.message


def test_starting_is_neither_degraded_nor_recovering_until_something_dies() -> None:
    parts = [Part("learner", True), Part("buffer", True), Part("actors", True)]
    degraded, recovering = health_conditions(parts, started=False)
    assert (degraded.status, degraded.reason, recovering.status) == ("False", "Starting", "False")
    assert degraded.message.startswith("starting: learner, buffer, actors")
    # The buffer killed before the job ever ran: it died, and it is coming back.
    parts[1] = Part("buffer", True, Restarts(pods=1, last_reason="OOMKilled"))
    degraded, recovering = health_conditions(parts, started=False)
    assert (degraded.status, recovering.status) == ("True", "True")
    assert recovering.message == "buffer coming back: buffer pod restarted 1 time, last: OOMKilled"
    # Once the job has run, any part down is a part coming back (a Deployment replacing a lost pod).
    degraded, recovering = health_conditions([Part("actors", True)], started=True)
    assert (degraded.status, recovering.status, recovering.message) == ("True", "True", "actors coming back")


def test_a_learner_out_of_restarts_is_degraded_for_good() -> None:
    learner = Part("learner", True, Restarts(workload=3, last_reason="Error"), failed=True)
    degraded, recovering = health_conditions([learner], started=True)
    assert (degraded.status, degraded.reason, recovering.reason) == ("True", "Failed", "Stuck")
    assert describe(learner).endswith("last: Error; out of restarts")


def test_build_status_reports_a_learner_restart() -> None:
    restarting = observed(learner=LearnerObservation(exists=True, message="0/1 slices ready, 1 restarts", restarts=1),
                          restarts={"learner": Restarts(workload=1), "buffer": Restarts(pods=2, last_reason="OOMKilled")})
    status = build_status(restarting, {"phase": "Running"}, T0)
    RLJobStatus.model_validate(status)  # the CRD's status schema admits the new conditions
    conds = conditions(status)
    assert status["phase"] == "Degraded"
    assert (conds["Recovering"]["status"], conds["Recovering"]["reason"]) == ("True", "Restarting")
    assert (conds["Degraded"]["status"], conds["Degraded"]["reason"]) == ("True", "ComponentDown")
    assert "restarts: learner 1, buffer 2 (last: OOMKilled), actors 0" in conds["Degraded"]["message"]
    assert status["restarts"] == {"learner": 1, "buffer": 2, "actors": 0, "rollout": 0}
    back = build_status(observed(restarts=restarting.restarts), status, T0)
    assert back["phase"] == "Running"
    assert [conditions(back)[t]["status"] for t in ("Degraded", "Recovering")] == ["False", "False"]
    assert "learner 1, buffer 2" in conditions(back)["Degraded"]["message"]  # the count stays visible


def test_finished_or_suspended_jobs_have_nothing_down() -> None:
    done = observed(learner=LearnerObservation(exists=True, completed=True), actors=DeploymentObservation(exists=True))
    assert conditions(build_status(done, {"phase": "Running"}, T0))["Degraded"]["status"] == "False"
    failed = build_status(observed(learner=LearnerObservation(exists=True, failed=True, message="restarts exhausted"),
                                   actors=DeploymentObservation(exists=True)), {"phase": "Running"}, T0)
    assert conditions(failed)["Degraded"]["reason"] == "Failed"
    assert conditions(failed)["Degraded"]["message"].startswith("learner down: out of restarts")
    assert conditions(failed)["Recovering"]["status"] == "False"  # the actors scaled to 0 are not coming back


def test_sandboxes_of_an_evicted_actor_are_zombies() -> None:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    evicted = pod_record("actor-old", {"stoker.dev/role": "actor"}, {}, {}, {"phase": "Failed", "reason": "Evicted"})
    live = pod_record("actor-new", {"stoker.dev/role": "actor"}, {}, {}, {"phase": "Running"})
    pods = [evicted, live, PodRecord("sb-old", "sandbox", actor="actor-old", heartbeat=now),
            PodRecord("sb-new", "sandbox", actor="actor-new", heartbeat=now)]
    zombies = find_zombies(pods, now, ttl_seconds=120)
    assert [(z.name, z.reason) for z in zombies] == [("sb-old", "actor actor-old is dead (Evicted)")]

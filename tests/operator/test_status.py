"""observed state -> status: phase, figures and metav1.Condition semantics."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from stoker.buffer.client import BufferClient
from stoker.buffer.server import BufferServer
from stoker.buffer.settings import BufferSettings
from stoker.operator.control import StalenessWindow
from stoker.operator.jobstatus import Cond, Observed, build_status, failed_status, merge_conditions
from stoker.bottleneck import ActorLoad
from stoker.operator.observe import (
    DeploymentObservation,
    LearnerObservation,
    StatsSnapshot,
    observe_deployment,
    observe_indexed_jobs,
    observe_jobset,
    snapshot_from_proto,
)
from stoker.spec import RLJobSpec
from stoker.status import CONDITION_TYPES, RLJobStatus
from stoker.v1 import buffer_pb2

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def observed(**kw: Any) -> Observed:
    base: dict[str, Any] = dict(
        spec=RLJobSpec(),
        generation=3,
        learner=LearnerObservation(exists=True, ready=True, message="1/1 slices ready"),
        actors=DeploymentObservation(exists=True, ready=2, replicas=2),
        actor_target=2,
        buffer=DeploymentObservation(exists=True, ready=1, replicas=1),
        stats=StatsSnapshot(policy_version=12, fill=0.25, complete_groups=4, learner_duty_cycle=0.8),
        stats_error=None,
        window=StalenessWindow(p50=1, max=3, dropped=0, groups=10),
        exceeded=False,
        starved=False,
        zombies_reaped=5,
        admission_scale=1.0,
    )
    base.update(kw)
    return Observed(**base)


def conditions(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in status["conditions"]}


def test_running_job() -> None:
    status = build_status(observed(), {}, T0)
    RLJobStatus.model_validate(status)  # the CRD's status schema accepts it
    assert status["phase"] == "Running"
    assert status["policyVersion"] == 12 and status["bufferFill"] == 0.25 and status["learnerDutyCycle"] == 0.8
    assert status["staleness"] == {"p50": 1, "max": 3, "dropped": 0}
    assert status["actors"] == {"ready": 2, "desired": 2, "summary": "2/2"}
    assert status["observedGeneration"] == 3 and status["zombiesReaped"] == 5
    conds = conditions(status)
    assert set(conds) == set(CONDITION_TYPES)
    assert conds["Ready"]["status"] == "True" and conds["Ready"]["observedGeneration"] == 3
    assert conds["StalenessExceeded"]["status"] == "False" and conds["LearnerStarved"]["reason"] == "Fed"


def test_unready_parts_and_phases() -> None:
    buffer_down = build_status(observed(stats=None, stats_error="Stats from b:1: UNAVAILABLE", window=None,
                                        exceeded=None, starved=None), {"policyVersion": 9}, T0)
    conds = conditions(buffer_down)
    assert conds["BufferReady"]["reason"] == "StatsUnavailable" and "UNAVAILABLE" in conds["BufferReady"]["message"]
    assert conds["Ready"]["reason"] == "StatsUnavailable"
    assert buffer_down["phase"] == "Degraded" and buffer_down["policyVersion"] == 9  # last known value kept
    assert conds["StalenessExceeded"]["status"] == "Unknown"
    fresh = build_status(observed(stats=None, window=None, exceeded=None, starved=None,
                                  learner=LearnerObservation(exists=False)), {}, T0)
    assert fresh["phase"] == "Pending"
    failed = build_status(observed(learner=LearnerObservation(exists=True, failed=True, message="restarts exhausted")), {}, T0)
    assert failed["phase"] == "Failed" and conditions(failed)["LearnerReady"]["message"] == "restarts exhausted"
    done = build_status(observed(learner=LearnerObservation(exists=True, completed=True)), {}, T0)
    assert done["phase"] == "Succeeded"
    starved = build_status(observed(starved=True, exceeded=True), {}, T0)
    assert conditions(starved)["LearnerStarved"]["status"] == "True"
    assert conditions(starved)["StalenessExceeded"]["reason"] == "AboveLimit"


def test_suspension_and_colocated() -> None:
    suspended_spec = RLJobSpec(suspend=True)
    going = build_status(observed(spec=suspended_spec, learner=LearnerObservation(exists=True)), {}, T0)
    assert conditions(going)["Suspended"]["reason"] == "Suspending"
    assert conditions(going)["LearnerReady"]["reason"] == "Checkpointing"
    gone = build_status(observed(spec=suspended_spec, learner=LearnerObservation(exists=False)), {}, T0)
    assert gone["phase"] == "Suspended" and conditions(gone)["Ready"]["reason"] == "Suspended"
    colocated = build_status(observed(spec=RLJobSpec(mode="colocated"), actors=None, buffer=None, stats=None,
                                      window=None, exceeded=None, starved=None), {}, T0)
    assert colocated["phase"] == "Running" and conditions(colocated)["BufferReady"]["reason"] == "Colocated"


def test_transition_time_moves_only_on_status_change() -> None:
    first = build_status(observed(), {}, T0)
    later = build_status(observed(), first, T0 + timedelta(minutes=5))
    assert conditions(later)["Ready"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    broken = build_status(observed(actors=DeploymentObservation(exists=True, ready=0, replicas=2)), later,
                          T0 + timedelta(minutes=6))
    assert conditions(broken)["Ready"]["lastTransitionTime"] == "2026-01-01T00:06:00Z"
    assert conditions(broken)["BufferReady"]["lastTransitionTime"] == "2026-01-01T00:00:00Z"


statuses = st.sampled_from(["True", "False", "Unknown"])


@given(st.lists(st.tuples(st.sampled_from(CONDITION_TYPES), statuses), unique_by=lambda x: x[0]),
       st.lists(st.tuples(st.sampled_from(CONDITION_TYPES), statuses), unique_by=lambda x: x[0]))
def test_merge_conditions_properties(before: list[tuple[str, str]], after: list[tuple[str, str]]) -> None:
    old = merge_conditions([], [Cond(t, s, "Old") for t, s in before], T0, 1)
    new = merge_conditions(old, [Cond(t, s, "New") for t, s in after], T0 + timedelta(hours=1), 2)
    previous = {c["type"]: c for c in old}
    assert [c["type"] for c in new] == [t for t, _ in after]
    for cond in new:
        kept = cond["type"] in previous and previous[cond["type"]]["status"] == cond["status"]
        assert cond["lastTransitionTime"] == ("2026-01-01T00:00:00Z" if kept else "2026-01-01T01:00:00Z")
        assert cond["observedGeneration"] == 2 and cond["reason"] == "New"


def test_failed_status() -> None:
    status = failed_status("spec.learner.topology: bad", "InvalidTopology", {}, T0, 1)
    assert status["phase"] == "Failed" and status["conditions"][0]["reason"] == "InvalidTopology"


def test_observers() -> None:
    assert observe_deployment(None) == DeploymentObservation(exists=False)
    assert observe_deployment({"spec": {"replicas": 3}, "status": {"readyReplicas": 2}}) == DeploymentObservation(True, 2, 3)
    jobset = {"metadata": {}, "status": {"restarts": 1, "replicatedJobsStatus": [{"name": "slice", "ready": 2}]}}
    assert observe_jobset(jobset, 2).ready and "1 restarts" in observe_jobset(jobset, 2).message
    assert not observe_jobset(jobset, 3).ready
    failed = {"metadata": {}, "status": {"conditions": [{"type": "Failed", "status": "True", "message": "boom"}]}}
    assert observe_jobset(failed, 1).failed and observe_jobset(failed, 1).message == "boom"
    deleting = {"metadata": {"deletionTimestamp": "x"}, "status": {"replicatedJobsStatus": [{"ready": 1}]}}
    assert observe_jobset(deleting, 1).deleting and not observe_jobset(deleting, 1).ready
    jobs = [{"metadata": {"name": "a"}, "status": {"ready": 4}}, {"metadata": {"name": "b"}, "status": {"ready": 3}}]
    assert not observe_indexed_jobs(jobs, 4).ready and observe_indexed_jobs(jobs[:1], 4).ready
    assert observe_indexed_jobs([None, None], 4).exists is False
    complete = [{"metadata": {"name": "a"}, "status": {"conditions": [{"type": "Complete", "status": "True"}]}}]
    assert observe_indexed_jobs(complete, 1).completed


def test_snapshot_from_proto() -> None:
    stats = buffer_pb2.BufferStats(policy_version=4, fill=0.5, complete_groups=2, staleness_histogram={0: 1, 2: 3},
                                   dropped={"stale": 1})
    snap = snapshot_from_proto(stats)
    assert snap.learner_duty_cycle is None and snap.staleness_histogram == {0: 1, 2: 3}
    stats.learner_duty_cycle = 0.0
    assert snapshot_from_proto(stats).learner_duty_cycle == 0.0  # reported zero is not "unknown"


learners = st.builds(LearnerObservation, exists=st.booleans(), ready=st.booleans(), completed=st.booleans(),
                     failed=st.booleans(), deleting=st.booleans(), message=st.text(max_size=20))
deployments = st.none() | st.builds(DeploymentObservation, exists=st.booleans(), ready=st.integers(0, 5),
                                    replicas=st.integers(0, 5))
snapshots = st.none() | st.builds(StatsSnapshot, policy_version=st.integers(0, 100), fill=st.floats(0, 1),
                                  complete_groups=st.integers(0, 5),
                                  learner_duty_cycle=st.none() | st.floats(0, 1))


@given(learner=learners, actors=deployments, buffer=deployments, stats=snapshots, suspend=st.booleans(),
       exceeded=st.none() | st.booleans(), starved=st.none() | st.booleans(), target=st.integers(0, 5))
def test_any_observation_gives_a_valid_consistent_status(learner: LearnerObservation, actors: Any, buffer: Any,
                                                         stats: Any, suspend: bool, exceeded: Any, starved: Any,
                                                         target: int) -> None:
    window = StalenessWindow(0, 1, 0, 1) if stats is not None else None
    o = observed(spec=RLJobSpec(suspend=suspend), learner=learner, actors=actors, buffer=buffer, stats=stats,
                 window=window, exceeded=exceeded if stats else None, starved=starved if stats else None,
                 actor_target=target)
    status = build_status(o, {}, T0)
    RLJobStatus.model_validate(status)
    conds = conditions(status)
    assert set(conds) == set(CONDITION_TYPES)
    parts = [conds[t]["status"] == "True" for t in ("LearnerReady", "ActorsAvailable", "BufferReady")]
    assert (conds["Ready"]["status"] == "True") == (all(parts) and not suspend)
    assert conds["Suspended"]["status"] == ("True" if suspend else "False")
    if conds["Ready"]["status"] == "True":
        assert status["phase"] == "Running"
        assert conds["Degraded"]["status"] == conds["Recovering"]["status"] == "False"  # nothing is down
    if learner.failed:
        assert status["phase"] == "Failed"
        assert conds["Degraded"]["reason"] == "Failed" and conds["Recovering"]["status"] == "False"
    elif suspend or learner.completed:
        assert conds["Degraded"]["status"] == conds["Recovering"]["status"] == "False"  # nothing is meant to run


def test_refused_edit_keeps_the_figures_and_says_why() -> None:
    """An invalid edit of a running job: it keeps running (phase, figures) on the applied spec."""
    status = build_status(observed(spec_problem=("InvalidTopology", "spec.learner.topology: bad")), {}, T0)
    assert status["phase"] == "Running" and status["policyVersion"] == 12
    spec = conditions(status)["SpecAccepted"]
    assert spec["status"] == "False" and spec["reason"] == "InvalidTopology" and "topology: bad" in spec["message"]
    assert "edit refused" in status["message"]
    assert conditions(build_status(observed(), {}, T0))["SpecAccepted"]["status"] == "True"


def test_failed_status_keeps_the_other_conditions() -> None:
    running = build_status(observed(), {}, T0)
    failed = failed_status("the API server refused JobSet lake-learner", "CreateRejected", running, T0, 4)
    assert {c["type"] for c in failed["conditions"]} == {c["type"] for c in running["conditions"]}
    assert conditions(failed)["Ready"]["reason"] == "CreateRejected"


def test_the_newest_round_from_a_real_buffer_is_the_status_evaluation(tmp_path: Path) -> None:
    server = BufferServer(BufferSettings(group_size=2, sync="none"), tmp_path / "wal", host="127.0.0.1", port=0).start()
    try:
        with BufferClient(f"127.0.0.1:{server.port}", client_id="op") as client:
            client.wait_ready(10)
            before = build_status(observed(stats=snapshot_from_proto(client.stats())), {}, T0)
            assert "evaluation" not in before  # no round yet: nothing invented
            client.report_eval("a/0", 0, episodes=4, reward_sum=0.4, success_sum=1.0)
            client.report_eval("a/10", 10, episodes=4, reward_sum=2.0, success_sum=3.0)
            client.report_eval("b/10", 10, episodes=4, reward_sum=2.0, success_sum=2.0)
            status = build_status(observed(stats=snapshot_from_proto(client.stats())), {}, T0)
    finally:
        server.stop(grace=0.1)
    RLJobStatus.model_validate(status)  # the CRD's status schema accepts it
    assert status["evaluation"] == {"policyVersion": 10, "successRate": 0.625, "meanReward": 0.5, "episodes": 8}
    assert status["policyVersion"] == 0  # the training figures are the learner's, untouched
    # With the buffer unreachable the last known evaluation stays.
    kept = build_status(observed(stats=None, stats_error="Stats: UNAVAILABLE"), status, T0)
    assert kept["evaluation"] == status["evaluation"]


def test_rollout_tier_status_and_readiness() -> None:
    from stoker.operator.rollout_control import RolloutReading, ServerStats

    tier = RLJobSpec.model_validate({"rollout": {"replicas": 2, "minReplicas": 1}})
    servers = (ServerStats("10.0.0.1:50053", tokens_per_second=1200.0, queue_depth=3, batch_occupancy=0.5),
               ServerStats("10.0.0.2:50053", tokens_per_second=800.25, batch_occupancy=0.7))
    serving = build_status(observed(spec=tier, rollout_target=2, rollout_ready=2, rollout_reading=RolloutReading(servers)), {}, T0)
    RLJobStatus.model_validate(serving)
    assert serving["rollout"] == {"ready": 2, "desired": 2, "summary": "2/2", "tokensPerSecond": 2000.2, "queueDepth": 3,
                                  "batchOccupancy": 0.6, "answering": 2, "specReplicas": 2}
    assert conditions(serving)["RolloutReady"]["reason"] == "Serving" and serving["phase"] == "Running"
    # One server down: the other's figures, and the silent one named; still serving.
    one = RolloutReading(servers[:1], errors=("10.0.0.2:50053: UNAVAILABLE: connection refused",))
    partial = build_status(observed(spec=tier, rollout_target=2, rollout_ready=2, rollout_reading=one), serving, T0)
    assert partial["rollout"]["tokensPerSecond"] == 1200.0 and partial["rollout"]["answering"] == 1
    assert "10.0.0.2:50053: UNAVAILABLE" in conditions(partial)["RolloutReady"]["message"]
    # None answers: the last figures stay, the condition says why, and the job is not Ready.
    silent = RolloutReading(errors=("10.0.0.1:50053: DEADLINE_EXCEEDED: x", "10.0.0.2:50053: UNAVAILABLE: y"))
    down = build_status(observed(spec=tier, rollout_target=2, rollout_ready=2, rollout_reading=silent), serving, T0)
    assert down["rollout"]["tokensPerSecond"] == 2000.2 and down["rollout"]["answering"] == 0
    assert conditions(down)["RolloutReady"]["reason"] == "StatsUnavailable" and conditions(down)["Ready"]["status"] == "False"
    starting = build_status(observed(spec=tier, rollout_target=2, rollout_ready=0), {}, T0)
    assert conditions(starting)["RolloutReady"]["reason"] == "MinimumReplicasUnavailable"
    assert conditions(starting)["Ready"]["reason"] == "MinimumReplicasUnavailable"
    blocked = build_status(observed(spec=tier, rollout_target=2, rollout_blocked="install JobSet"), {}, T0)
    assert conditions(blocked)["RolloutReady"]["reason"] == "JobSetMissing"
    # No tier: nothing under status.rollout, and readiness does not wait for one.
    plain = build_status(observed(), {}, T0)
    assert "rollout" not in plain and conditions(plain)["RolloutReady"]["reason"] == "InProcess"


def test_a_dataset_job_is_ready_with_the_learner_alone() -> None:
    """SFT has no buffer or actors: their conditions say so, and the job runs on its learner."""
    spec = RLJobSpec.model_validate({"algorithm": {"name": "sft", "sft": {"dataset": "/data/chats.jsonl"}}})
    status = build_status(observed(spec=spec, actors=None, buffer=None, stats=None, window=None, exceeded=None,
                                   starved=None), {}, T0)
    conds = conditions(status)
    assert conds["BufferReady"]["status"] == "True" and conds["BufferReady"]["reason"] == "Dataset"
    assert conds["ActorsAvailable"]["status"] == "True" and conds["ActorsAvailable"]["reason"] == "Dataset"
    assert conds["RolloutReady"]["status"] == "True"
    assert status["phase"] == "Running" and conds["Ready"]["status"] == "True"


def test_the_status_names_what_caps_the_learner_with_its_numbers_and_knob() -> None:
    # The actors' own loads: every slot full, little CPU -- they wait on their environments.
    waiting = {"actor-0": ActorLoad(cpu_cores=0.05, episodes_in_flight=7.9, concurrency=8)}
    starved_stats = StatsSnapshot(policy_version=12, fill=0.02, complete_groups=0, learner_duty_cycle=0.049,
                                  put_rate=4.75, sample_rate=4.75, committed_groups_total=40, actor_loads=waiting)
    status = build_status(observed(stats=starved_stats, starved=True), {}, T0)
    RLJobStatus.model_validate(status)
    assert "actors deliver 4.75 trajectories/s and a step needs 32" in status["bottleneck"]
    assert "latency-bound; raise actors.concurrency from 8 to" in status["bottleneck"]
    starved = conditions(status)["LearnerStarved"]
    assert starved["status"] == "True" and "learner waits 95 % of the time" in starved["message"]
    behind = StatsSnapshot(policy_version=12, fill=0.97, complete_groups=30, learner_duty_cycle=0.99,
                           put_rate=20.0, sample_rate=5.0, committed_groups_total=40)
    assert "the buffer is 97 % full" in build_status(observed(stats=behind), {}, T0)["bottleneck"]
    assert build_status(observed(), {}, T0)["bottleneck"] == ""  # balanced: nothing to name
    kept = build_status(observed(stats=None, stats_error="down", window=None, exceeded=None, starved=None),
                        {"bottleneck": "before"}, T0)
    assert kept["bottleneck"] == "before"  # not read this time: the last figure stays


def test_snapshot_carries_the_rates_the_bottleneck_needs() -> None:
    proto = buffer_pb2.BufferStats(put_rate=4.75, sample_rate=4.5, committed_groups_total=7)
    snapshot = snapshot_from_proto(proto)
    assert (snapshot.put_rate, snapshot.sample_rate, snapshot.committed_groups_total) == (4.75, 4.5, 7)

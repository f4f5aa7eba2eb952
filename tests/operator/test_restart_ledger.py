"""status.restarts for the life of the job: a replaced pod counts, a gone pod's count stays, the
ledger survives the operator (it lives in the status), and nothing goes down."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from stoker.operator.health import Restarts
from stoker.operator.jobstatus import build_status
from stoker.operator.podhealth import pod_health
from stoker.operator.restart_ledger import PENDING_SECONDS, read_ledger, track_restarts
from stoker.operator.zombies import PodRecord, pod_record
from stoker.status import RestartLedger, RLJobStatus

from .test_status import observed

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
ROLE = "stoker.dev/role"


def pod(name: str, role: str, restarts: int = 0, *, last: str = "", phase: str = "Running", deleting: bool = False,
        reason: str = "", disruption: str = "", revision: str = "", jobset: bool = False) -> PodRecord:
    labels = {ROLE: role, **({"pod-template-hash": revision} if revision else {}),
              **({"jobset.sigs.k8s.io/jobset-name": "j"} if jobset else {})}
    meta: dict[str, Any] = {"uid": f"uid-{name}", **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    container: dict[str, Any] = {"name": "c", "restartCount": restarts, "state": {}}
    if last:
        container["lastState"] = {"terminated": {"reason": last, "finishedAt": "2025-12-31T23:00:00Z"}}
    status: dict[str, Any] = {"phase": phase, "containerStatuses": [container]}
    if reason:
        status["reason"] = reason
    if disruption:
        status["conditions"] = [{"type": "DisruptionTarget", "status": "True", "reason": disruption}]
    return pod_record(name, labels, {}, meta, status)


class Job:
    """Looks in a row, the ledger carried from one to the next as the status carries it."""

    def __init__(self, **wanted: int) -> None:
        self.ledger, self.wanted, self.now, self.jobset = RestartLedger(), dict(wanted), T0, 0
        self.reported: dict[str, int] = {}

    def look(self, *pods: PodRecord, after: float = 10.0) -> dict[str, Restarts]:
        self.now += timedelta(seconds=after)
        restarts, self.ledger = track_restarts(list(pods), self.ledger, jobset_restarts=self.jobset, wanted=self.wanted,
                                               now=self.now, floor=self.reported)
        self.reported = {c: r.total for c, r in restarts.items()}
        return restarts


def test_a_replaced_buffer_pod_keeps_its_count_and_adds_one() -> None:
    job = Job(buffer=1)
    assert job.look(pod("b1", "buffer", 2, last="OOMKilled"))["buffer"] == Restarts(pods=2, last_reason="OOMKilled")
    # Deleted by hand: the Deployment's replacement starts at 0, the old pod's 2 stay, +1 for the replacement.
    job.look(pod("b1", "buffer", 2, last="OOMKilled", deleting=True), pod("b2", "buffer"))
    after = job.look(pod("b2", "buffer"))
    assert after["buffer"] == Restarts(pods=3, last_reason="deleted")
    assert job.look(pod("b2", "buffer", 1, last="Error"))["buffer"].pods == 4  # its own restarts add on
    assert job.ledger.carried["buffer"].count == 3


def test_evicted_and_preempted_pods_count_once_with_their_reason() -> None:
    job = Job(actors=2)
    job.look(pod("a1", "actor"), pod("a2", "actor"))
    evicted = (pod("a1", "actor", phase="Failed", reason="Evicted"), pod("a2", "actor"), pod("a3", "actor"))
    assert job.look(*evicted)["actors"] == Restarts(pods=1, last_reason="Evicted")
    assert job.look(*evicted)["actors"].pods == 1  # still listed: not counted again
    assert job.look(*evicted[1:])["actors"].pods == 1  # garbage-collected: nor now
    preempted = pod("a2", "actor", deleting=True, disruption="PreemptionByScheduler")
    assert job.look(preempted, pod("a3", "actor"))["actors"] == Restarts(pods=2, last_reason="Preempted")
    # One the operator never saw running (it died between looks) counts as well.
    assert job.look(pod("a3", "actor"), pod("a4", "actor", phase="Failed", reason="Evicted"))["actors"].pods == 3


def test_pods_removed_on_purpose_are_no_restarts() -> None:
    job = Job(actors=3)
    job.look(pod("a1", "actor", revision="r1"), pod("a2", "actor", revision="r1"), pod("a3", "actor", revision="r1"))
    job.wanted["actors"] = 2  # scaled down: the surplus pod goes (a deleted pod turns Failed on its way out)
    job.look(pod("a1", "actor", revision="r1"), pod("a2", "actor", revision="r1"),
             pod("a3", "actor", revision="r1", deleting=True, phase="Failed"))
    assert job.look(pod("a1", "actor", revision="r1"), pod("a2", "actor", revision="r1"))["actors"].pods == 0
    # A spec edit rolls the pods onto a new template: replaced by another hash, not restarted.
    job.look(pod("a1", "actor", revision="r1", deleting=True), pod("a2", "actor", revision="r1"),
             pod("b1", "actor", revision="r2"))
    assert job.look(pod("a2", "actor", revision="r1"), pod("b1", "actor", revision="r2"))["actors"].pods == 0
    job.wanted["actors"] = 0  # suspended
    assert job.look(pod("a2", "actor", deleting=True), pod("b1", "actor", deleting=True))["actors"].pods == 0
    assert job.look()["actors"].pods == 0
    assert not job.ledger.pods


def test_a_deleted_pod_counts_when_its_replacement_comes_and_not_if_none_does() -> None:
    job = Job(buffer=1)
    job.look(pod("b1", "buffer"))
    assert job.look()["buffer"].pods == 0  # gone, the replacement not created yet
    assert job.look(pod("b2", "buffer"))["buffer"] == Restarts(pods=1, last_reason="deleted")
    job.look(pod("b2", "buffer"))
    job.look()
    assert job.look(after=PENDING_SECONDS + 1)["buffer"].pods == 1  # never replaced: removed, no restart
    assert job.look(pod("b3", "buffer"))["buffer"].pods == 1  # a pod much later is no replacement
    assert not [s for s in job.ledger.pods if s.left]


def test_the_ledger_lives_in_the_status_and_survives_an_operator_restart() -> None:
    job = Job(buffer=1, actors=1)
    job.look(pod("b1", "buffer", 2, last="OOMKilled"), pod("a1", "actor", 1))
    restarts, ledger = track_restarts([pod("b2", "buffer"), pod("a1", "actor", 1)], job.ledger, jobset_restarts=0,
                                      wanted=job.wanted, now=job.now + timedelta(seconds=10))
    status = build_status(observed(restarts=restarts, restart_ledger=ledger), {}, T0)
    RLJobStatus.model_validate(status)  # the CRD's status schema holds the ledger
    assert status["restarts"] == {"learner": 0, "buffer": 3, "actors": 1, "rollout": 0}
    # A new operator process knows only the status: the gone pod's 2 and the replacement stay.
    later, _ = track_restarts([pod("b2", "buffer"), pod("a1", "actor", 1)], read_ledger(status["restartLedger"]),
                              jobset_restarts=0, wanted=job.wanted, now=job.now + timedelta(seconds=20))
    assert later["buffer"] == Restarts(pods=3, last_reason="deleted")
    # The buffer replaced while the operator was down: seen as gone, and counted, on the first look.
    again, _ = track_restarts([pod("b3", "buffer"), pod("a1", "actor", 1)], read_ledger(status["restartLedger"]),
                              jobset_restarts=0, wanted=job.wanted, now=job.now + timedelta(seconds=20))
    assert again["buffer"].pods == 4
    # No ledger (written by an older operator, or edited away): the counts reported stay the floor.
    floor, _ = track_restarts([pod("b3", "buffer")], read_ledger({"pods": "garbage"}), jobset_restarts=0,
                              wanted=job.wanted, now=job.now, floor=status["restarts"])
    assert (floor["buffer"].total, floor["actors"].total) == (3, 1)
    # No pod index to read: the pods last seen stand in, the ledger is kept as it was.
    blind, kept = track_restarts(None, ledger, jobset_restarts=0, wanted=job.wanted, now=job.now)
    assert (blind["buffer"].pods, blind["actors"].pods, kept.pods) == (3, 1, ledger.pods)


def test_learner_restarts_are_the_jobsets_and_outlive_a_recreated_jobset() -> None:
    job = Job()
    job.look(pod("l1", "learner", 1, jobset=True))
    job.jobset = 2  # the JobSet restarted the group twice: new pods, no +1 per pod on top
    assert job.look(pod("l2", "learner", jobset=True))["learner"] == Restarts(pods=1, workload=2)
    job.jobset = 0  # suspended and resumed: a new JobSet counts from 0
    assert job.look(pod("l3", "learner", jobset=True))["learner"].total == 3
    job.jobset = 1
    assert job.look(pod("l3", "learner", jobset=True))["learner"].total == 4


def test_disruption_reasons() -> None:
    def why(**status: Any) -> str:
        return pod_health(status).disruption

    assert why(phase="Failed", reason="Evicted") == "Evicted"
    assert why(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}]) == "Preempted"
    assert why(conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]) == "NodeLost"
    assert why(conditions=[{"type": "DisruptionTarget", "status": "False", "reason": "PreemptionByScheduler"}]) == ""
    assert why(phase="Running") == ""


# A look: each pod slot is absent, or present with (restarts so far, state). States: running,
# deleting, evicted. Pods of one slot are one pod; a new uid is minted when a slot comes back.
STATES = ("running", "deleting", "evicted")


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(("buffer", "actor", "learner")),
                          st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 3), st.sampled_from(STATES))),
                                   min_size=3, max_size=3),
                          st.integers(0, 3), st.integers(0, 3), st.floats(1, 2 * PENDING_SECONDS)),
                min_size=1, max_size=12))
def test_counts_never_go_down(looks: list[Any]) -> None:
    job = Job()
    slots: dict[int, tuple[str, int]] = {}  # slot -> (uid suffix, its restarts so far)
    generation = 0
    previous: dict[str, int] = {}
    for role, states, wanted, jobset, after in looks:
        job.wanted = {"buffer": wanted, "actors": wanted}
        job.jobset = jobset
        pods = []
        for slot, state in enumerate(states):
            if state is None:
                slots.pop(slot, None)
                continue
            generation += 1
            suffix, so_far = slots.get(slot, (f"{slot}-{generation}", 0))
            so_far = max(so_far, state[0])  # a pod's own count only grows
            slots[slot] = (suffix, so_far)
            kind = state[1]
            pods.append(pod(f"{role}-{suffix}", role, so_far, deleting=kind == "deleting",
                            phase="Failed" if kind == "evicted" else "Running", reason="Evicted" if kind == "evicted" else ""))
        # Through the status and back each time, as the operator does.
        restarts, ledger = track_restarts(pods, read_ledger(job.ledger.model_dump(by_alias=True)), jobset_restarts=jobset,
                                          wanted=job.wanted, now=job.now + timedelta(seconds=after), floor=None)
        job.now += timedelta(seconds=after)
        job.ledger = ledger
        totals = {c: r.total for c, r in restarts.items()}
        assert all(totals[c] >= previous.get(c, 0) for c in totals), (previous, totals)
        previous = totals

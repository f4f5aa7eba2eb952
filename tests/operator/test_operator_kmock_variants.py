"""The operator against kmock in the other shapes: no JobSet API (Indexed Jobs + headless
Service), colocated mode, a generated token, an impossible TPU topology, and enforcement driven
by a buffer whose Stats report stale data and then a starved learner."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from concurrent import futures
from typing import Any

import grpc
import kmock
import pytest

from stoker.v1 import buffer_pb2, buffer_pb2_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

RLJOBS = "/apis/stoker.dev/v1alpha1/namespaces/{ns}/rljobs"
DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"


def rljob(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


def status_of(c: Any, job: str) -> dict[str, Any]:
    return dict((c.get("stoker.dev/v1alpha1/rljobs", job) or {}).get("status") or {})


def condition(c: Any, job: str, kind: str) -> dict[str, Any]:
    return next((x for x in status_of(c, job).get("conditions", []) if x["type"] == kind), {})


async def test_no_jobset_api_falls_back_to_indexed_jobs(operator_factory: Any) -> None:
    c = await operator_factory(jobset=False)
    await c.create(RLJOBS, rljob("tpu", learner={"accelerator": "tpu-v5p-slice", "topology": "2x2x2", "numSlices": 2}))
    await c.eventually(lambda: {"tpu-learner-0", "tpu-learner-1"} <= c.names("batch/v1/jobs"), what="one Job per slice")
    assert "tpu-learner" in c.names("v1/services")
    service = c.get("v1/services", "tpu-learner")
    assert service["spec"]["clusterIP"] == "None"
    job = c.get("batch/v1/jobs", "tpu-learner-1")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == 2
    env = {e["name"]: e for e in job["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["TPU_WORKER_HOSTNAMES"]["value"] == "tpu-learner-1-0.tpu-learner,tpu-learner-1-1.tpu-learner"
    assert env["MEGASCALE_SLICE_ID"]["value"] == "1"
    # Four hosts with a relative checkpoint dir: each host's checkpoints would die with its pod.
    await c.eventually(lambda: c.events("EphemeralCheckpoints"), what="an EphemeralCheckpoints warning")
    # A token was generated (no Secret existed): 32 random bytes, url-safe.
    await c.eventually(lambda: c.get("v1/secrets", "tpu-buffer-token"), what="generated token Secret")
    token = base64.b64decode(c.get("v1/secrets", "tpu-buffer-token")["data"]["token"]).decode()
    assert len(token) >= 40
    # Suspend removes the Jobs and their Service; the buffer stays.
    await c.patch(RLJOBS + "/tpu", {"spec": {"suspend": True}})
    await c.eventually(lambda: not c.names("batch/v1/jobs") and "tpu-learner" not in c.names("v1/services"),
                       what="learner Jobs removed")
    assert "tpu-buffer" in c.names("apps/v1/deployments")


async def test_colocated_runs_only_the_learner(operator_factory: Any) -> None:
    c = await operator_factory()
    await c.create(RLJOBS, rljob("solo", mode="colocated"))
    await c.eventually(lambda: "solo-learner" in c.names("jobset.x-k8s.io/v1alpha2/jobsets"), what="learner")
    await c.eventually(lambda: "solo-sandboxes" in c.names("networking.k8s.io/v1/networkpolicies"), what="policy")
    assert not c.names("apps/v1/deployments")  # no actors, no buffer
    assert c.names("v1/persistentvolumeclaims") == {"solo-learner-run"}
    assert not c.names("v1/secrets")
    jobset = c.get("jobset.x-k8s.io/v1alpha2/jobsets", "solo-learner")
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "solo-sandbox-manager"  # it creates its own sandboxes
    policy = c.get("networking.k8s.io/v1/networkpolicies", "solo-sandboxes")
    assert policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["stoker.dev/role"] == "learner"
    await c.eventually(lambda: condition(c, "solo", "BufferReady").get("reason") == "Colocated", what="status")


async def test_wrong_topology_is_a_clear_status_error(operator_factory: Any) -> None:
    c = await operator_factory()
    await c.create(RLJOBS, rljob("bad", learner={"accelerator": "tpu-v6e-slice", "topology": "2x2x2"}))
    await c.eventually(lambda: status_of(c, "bad").get("phase") == "Failed", what="phase Failed")
    ready = condition(c, "bad", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "InvalidTopology"
    assert "2x2x2" in ready["message"] and "2-D" in ready["message"]
    assert not c.names("apps/v1/deployments")  # nothing was created for an impossible job
    await c.eventually(lambda: c.events("InvalidTopology"), what="an InvalidTopology Event")


class ScriptedBuffer(buffer_pb2_grpc.BufferServicer):
    """A real gRPC server whose Stats the test sets; it checks the operator's bearer token."""

    def __init__(self, token: str):
        self.token = token
        self.stats = buffer_pb2.BufferStats(capacity=100, complete_groups=9, staleness_histogram={1: 3},
                                            learner_duty_cycle=0.9)
        self.stale_per_call = 0
        self.lock = threading.Lock()

    def Stats(self, request: Any, context: grpc.ServicerContext) -> buffer_pb2.BufferStats:
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "bad token")
        with self.lock:
            if self.stale_per_call:  # the learner keeps sampling groups 5 versions old
                self.stats.staleness_histogram[5] += self.stale_per_call
                self.stats.dropped["stale"] += 1
            return self.stats


@pytest.fixture
def scripted_buffer() -> Any:
    servicer = ScriptedBuffer("t0ken")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    buffer_pb2_grpc.add_BufferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


async def test_enforcement_scales_actors_and_admission(scripted_buffer: Any, operator_factory: Any) -> None:
    servicer, address = scripted_buffer
    c = await operator_factory(buffer_address_template=address)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hot-buffer-token"},
              "data": {"token": base64.b64encode(b"t0ken").decode()}}
    await c.create("/api/v1/namespaces/{ns}/secrets", secret)
    await c.create(RLJOBS, rljob("hot", actors={"replicas": 4, "minReplicas": 2, "maxReplicas": 6},
                                 buffer={"maxStaleness": 2}))
    await c.eventually(lambda: "hot-actor" in c.names("apps/v1/deployments"), what="actors")
    await c.patch(DEPLOYMENTS + "/hot-buffer/status", {"status": {"readyReplicas": 1}})
    await c.eventually(lambda: condition(c, "hot", "StalenessExceeded").get("status") == "False", what="within limit")

    # Groups keep arriving 5 versions behind (limit 2): fewer actors down to minReplicas, tighter
    # admission, Events.
    servicer.stale_per_call = 3
    await c.eventually(lambda: condition(c, "hot", "StalenessExceeded").get("status") == "True", what="exceeded")
    await c.eventually(lambda: c.get("apps/v1/deployments", "hot-actor")["spec"]["replicas"] == 2, what="4 -> 2")
    await c.eventually(lambda: status_of(c, "hot")["actors"]["desired"] == 2, what="status desired 2")
    assert status_of(c, "hot")["staleness"]["max"] == 5
    await c.eventually(lambda: status_of(c, "hot")["admissionScale"] == 0.125, what="admission at its floor")
    assert c.get("apps/v1/deployments", "hot-actor")["spec"]["replicas"] == 2  # never below minReplicas
    control = json.loads(c.get("v1/configmaps", "hot-buffer-control")["data"]["admission.json"])
    assert control["admissionScale"] == 0.125
    await c.eventually(lambda: c.events("TightenedAdmission") and c.events("ScaledDownActors"), what="Events")
    servicer.stale_per_call = 0

    # Nothing new sampled, buffer empty, learner idle: starved -> more actors, admission restored.
    with servicer.lock:
        servicer.stats.complete_groups = 0
        servicer.stats.learner_duty_cycle = 0.1
    await c.eventually(lambda: condition(c, "hot", "LearnerStarved").get("status") == "True", what="starved")
    await c.eventually(lambda: c.get("apps/v1/deployments", "hot-actor")["spec"]["replicas"] == 6, what="scaled up")
    # never above maxReplicas (the status lands just after the Deployment patch of the same look)
    await c.eventually(lambda: status_of(c, "hot")["actors"]["desired"] == 6, what="status desired 6")
    assert c.get("apps/v1/deployments", "hot-actor")["spec"]["replicas"] == 6
    await c.eventually(lambda: c.events("ScaledUpActors"), what="a ScaledUpActors Event")
    await c.eventually(
        lambda: json.loads(c.get("v1/configmaps", "hot-buffer-control")["data"]["admission.json"])["admissionScale"] == 1,
        what="admission restored",
    )


async def test_wrong_token_shows_in_buffer_condition(scripted_buffer: Any, operator_factory: Any) -> None:
    """No token Secret yet: the operator generates one, which this buffer does not know."""
    _, address = scripted_buffer
    c = await operator_factory(buffer_address_template=address)
    await c.create(RLJOBS, rljob("locked"))
    await c.eventually(lambda: "locked-buffer" in c.names("apps/v1/deployments"), what="buffer")
    await c.patch(DEPLOYMENTS + "/locked-buffer/status", {"status": {"readyReplicas": 1}})
    await c.eventually(lambda: condition(c, "locked", "BufferReady").get("reason") == "StatsUnavailable",
                       what="StatsUnavailable")
    assert "refused the token" in condition(c, "locked", "BufferReady")["message"]
    assert condition(c, "locked", "Ready")["status"] == "False"
    # The user puts the buffer's real token in the Secret: the operator re-reads it and recovers.
    await c.patch("/api/v1/namespaces/{ns}/secrets/locked-buffer-token",
                  {"data": {"token": base64.b64encode(b"t0ken").decode()}})
    await c.eventually(lambda: condition(c, "locked", "BufferReady").get("status") == "True", what="token re-read")


async def test_refused_learner_fails_the_job_and_starts_nothing_else(operator_factory: Any) -> None:
    """JobSet's webhook refuses the learner: the job says so in its status at once, and no actors
    or buffer are left running without a learner (the learner is created before them)."""
    c = await operator_factory()
    c.k.refusals = {"jobsets": (422, "Invalid", 'admission webhook "vjobset.kb.io" denied the request: '
                                "JobSet name is too long, pod names generated for this JobSet will exceed 63 characters")}
    await c.create(RLJOBS, rljob("lake"))
    await c.eventually(lambda: status_of(c, "lake").get("phase") == "Failed", what="phase Failed")
    ready = condition(c, "lake", "Ready")
    assert ready["status"] == "False" and ready["reason"] == "CreateRejected"
    assert "JobSet lake-learner" in ready["message"] and "exceed 63 characters" in ready["message"]
    assert not c.names("apps/v1/deployments")
    await c.eventually(lambda: c.events("CreateRejected"), what="a CreateRejected Event")


async def test_forbidden_child_is_retried_a_bounded_number_of_times(operator_factory: Any) -> None:
    """A 403 may be fixed by an admin, so it is retried, but not forever, and the job shows Failed
    while it is."""
    c = await operator_factory(forbidden_retries=2, forbidden_retry_seconds=0.1)
    c.k.refusals = {"configmaps": (403, "Forbidden", 'configmaps is forbidden: User "system:serviceaccount:x:y" '
                                   'cannot create resource "configmaps"')}
    await c.create(RLJOBS, rljob("lake"))
    await c.eventually(lambda: status_of(c, "lake").get("phase") == "Failed", what="phase Failed")
    assert condition(c, "lake", "Ready")["reason"] == "Forbidden"
    await c.eventually(lambda: "gave up after 3 attempts" in condition(c, "lake", "Ready").get("message", ""),
                       what="the operator giving up")
    posts = [r for r in c.k if r.action == kmock.action.CREATE and r.resource == kmock.resource("v1/configmaps")]
    assert len(posts) == 3
    assert not c.names("apps/v1/deployments") and not c.names("jobset.x-k8s.io/v1alpha2/jobsets")


async def test_actors_block_added_later_sets_the_replicas(operator_factory: Any) -> None:
    c = await operator_factory()
    await c.create(RLJOBS, rljob("lake"))
    # Unset actors.replicas: as many actors as admission keeps busy, up to maxReplicas (8).
    await c.eventually(lambda: (c.get("apps/v1/deployments", "lake-actor") or {}).get("spec", {}).get("replicas") == 8,
                       what="the default 8 actors")
    await c.patch(RLJOBS + "/lake", {"spec": {"actors": {"replicas": 5}}})
    await c.eventually(lambda: c.get("apps/v1/deployments", "lake-actor")["spec"]["replicas"] == 5, what="5 actors")
    await c.eventually(lambda: status_of(c, "lake").get("actors", {}).get("desired") == 5, what="desired 5")


async def test_pods_are_listed_and_watched_by_label_on_the_server(operator_factory: Any) -> None:
    """The operator asks the API server for Stoker's pods only (kmock ignores the selector, so
    the test checks what the operator asked for)."""
    c = await operator_factory()
    pod_reads = [r for r in c.k if r.resource == kmock.resource("v1/pods") and r.action in (kmock.action.LIST, kmock.action.WATCH)]
    assert pod_reads and all(r.params.get("labelSelector") == "stoker.dev/job" for r in pod_reads), pod_reads
    rljob_reads = [r for r in c.k if r.resource == kmock.resource("stoker.dev/v1alpha1/rljobs") and r.action == kmock.action.WATCH]
    assert rljob_reads and not any(r.params.get("labelSelector") for r in rljob_reads)  # every RLJob


async def test_deleting_the_job_deletes_its_sandbox_pods(operator_factory: Any) -> None:
    """Sandbox pods are no RLJob children (their owner is the actor pod), so the operator removes
    the ones left when the job goes; other jobs' pods stay."""
    c = await operator_factory()
    await c.create(RLJOBS, rljob("lake"))
    await c.eventually(lambda: "lake-actor" in c.names("apps/v1/deployments"), what="actors")

    def pod(name: str, job: str, role: str, **labels: str) -> dict[str, Any]:
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {
            "stoker.dev/job": job, "stoker.dev/role": role, **labels}}}

    await c.create("/api/v1/namespaces/{ns}/pods", pod("lake-actor-a", "lake", "actor"))
    for i in range(3):
        await c.create("/api/v1/namespaces/{ns}/pods", pod(f"lake-sbx-{i}", "lake", "sandbox", **{"stoker.dev/actor": "lake-actor-a"}))
    await c.create("/api/v1/namespaces/{ns}/pods", pod("other-sbx-0", "other", "sandbox"))
    await c.delete(RLJOBS + "/lake")
    # kopf stops the status timer before the deletion handler runs, and a tick in flight may be
    # waiting out its buffer Stats deadline (no buffer runs here): the job goes after that tick
    # (test_a_deletion_during_a_status_look_is_not_held_behind_it).
    await c.eventually(lambda: c.get("stoker.dev/v1alpha1/rljobs", "lake") is None, timeout=30.0, what="RLJob gone")
    await c.eventually(lambda: not {f"lake-sbx-{i}" for i in range(3)} & c.names("v1/pods"), what="sandboxes deleted")
    assert {"lake-actor-a", "other-sbx-0"} <= c.names("v1/pods")  # the actor goes by garbage collection
    # Listed from the server (a pod made just before the deletion may not be in the index yet).
    lists = [r for r in c.k if r.resource == kmock.resource("v1/pods") and r.action == kmock.action.LIST
             and r.params.get("labelSelector") == "stoker.dev/job=lake,stoker.dev/role=sandbox"]
    assert lists, "the deletion handler listed no sandbox pods"


async def test_a_deletion_during_a_status_look_is_not_held_behind_it(operator_factory: Any) -> None:
    """The job is deleted while a status look is waiting on the API server: kopf stops the timer
    before the deletion handler and keeps the finalizer until the look's thread ends. A look that
    then writes nothing wakes nobody, so the job stays until kopf's next poll of exiting timers
    (60 s by default): the operator polls every second instead."""
    c = await operator_factory(stats_timeout_seconds=0.5)  # no buffer runs: each look waits this out
    await c.create(RLJOBS, rljob("lake"))
    await c.eventually(lambda: status_of(c, "lake").get("conditions"), what="a full status look")
    c.k.held, c.k.released = asyncio.Event(), asyncio.Event()
    c.k.hold = lambda r: r.action == kmock.action.FETCH and r.resource == kmock.resource("jobset.x-k8s.io/v1alpha2/jobsets")
    await asyncio.wait_for(c.k.held.wait(), 30)  # the next look reads the learner's JobSet first
    await c.delete(RLJOBS + "/lake")
    await c.eventually(lambda: any(  # the deletion handler lists the job's sandboxes first
        r.resource == kmock.resource("v1/pods") and r.action == kmock.action.LIST
        and r.params.get("labelSelector") == "stoker.dev/job=lake,stoker.dev/role=sandbox" for r in c.k
    ), what="the deletion handler")
    c.k.released.set()  # the look ends (its status unchanged: the job is going)
    await c.eventually(lambda: c.get("stoker.dev/v1alpha1/rljobs", "lake") is None, timeout=20.0, what="RLJob gone")


async def test_refused_edit_keeps_the_job_observed(scripted_buffer: Any, operator_factory: Any) -> None:
    """An edit the operator cannot run (a topology the accelerator lacks, which kmock admits as no
    CEL runs here) leaves the children on the last applied spec, still observed and reported."""
    servicer, address = scripted_buffer
    c = await operator_factory(buffer_address_template=address)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "lake-buffer-token"},
              "data": {"token": base64.b64encode(b"t0ken").decode()}}
    await c.create("/api/v1/namespaces/{ns}/secrets", secret)
    await c.create(RLJOBS, rljob("lake", learner={"accelerator": "tpu-v6e-slice", "topology": "2x4"}))
    await c.eventually(lambda: "lake-buffer" in c.names("apps/v1/deployments"), what="buffer")
    await c.patch(DEPLOYMENTS + "/lake-buffer/status", {"status": {"readyReplicas": 1}})
    await c.eventually(lambda: status_of(c, "lake").get("bufferFill") == 0.0, what="figures")
    await c.patch(RLJOBS + "/lake", {"spec": {"learner": {"topology": "2x2x2"}}})
    await c.eventually(lambda: condition(c, "lake", "SpecAccepted").get("status") == "False", what="SpecAccepted False")
    assert condition(c, "lake", "SpecAccepted")["reason"] == "InvalidTopology"
    assert status_of(c, "lake")["phase"] != "Failed"
    with servicer.lock:
        servicer.stats.fill = 0.5
    # The figures keep moving (fill from the buffer), and the children keep the applied spec.
    await c.eventually(lambda: status_of(c, "lake").get("bufferFill") == 0.5, what="fill updated after the refused edit")
    assert "topology: 2x4" in c.get("v1/configmaps", "lake-spec")["data"]["job.yaml"]
    # A valid edit is accepted again.
    await c.patch(RLJOBS + "/lake", {"spec": {"learner": {"topology": "2x4"}, "actors": {"replicas": 3}}})
    await c.eventually(lambda: condition(c, "lake", "SpecAccepted").get("status") == "True", what="SpecAccepted True")

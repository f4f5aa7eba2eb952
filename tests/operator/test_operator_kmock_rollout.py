"""The rollout tier against kmock with the real operator (kopf): an RLJob with spec.rollout gets
its Deployment and Service and its actors the address; the servers' real Stats (fake Rollout
servicers over gRPC on loopback) reach the status and scale the tier; suspend and resume keep the
scaled target; removing spec.rollout removes it; a multi-host TPU tier is one JobSet per server,
read for Stats at host 0 only while all its hosts are ready. One operator runs both jobs (each
operator start and stop costs seconds). A second test holds the operator's look across a resume
and checks that it does not undo it, and the lifecycle Events."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
import kmock
import pytest

from stoker.labels import JOB_LABEL, ROLE_LABEL
from stoker.operator.learner_workload import COMPLETION_INDEX_LABEL
from stoker.operator.rollout_workload import SERVER_LABEL
from stoker.v1 import buffer_pb2_grpc, rollout_pb2, rollout_pb2_grpc

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(90)]

RLJOBS = "/apis/stoker.dev/v1alpha1/namespaces/{ns}/rljobs"
DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"
PODS = "/api/v1/namespaces/{ns}/pods"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets"
# Nothing listens here: the buffer's Stats fail at once instead of waiting out a DNS lookup.
NO_BUFFER = "127.0.0.1:1"


class FakeRollout(rollout_pb2_grpc.RolloutServicer):
    """A server whose Stats the test sets."""

    def __init__(self) -> None:
        self.stats = rollout_pb2.RolloutStats(ready=True, tokens_per_second=1500.0, max_batch=32,
                                              batch_occupancy=0.5, policy_version=3)

    def Stats(self, request: Any, context: grpc.ServicerContext) -> rollout_pb2.RolloutStats:
        return self.stats


@pytest.fixture
def rollout_servers() -> Iterator[tuple[list[FakeRollout], list[grpc.Server], int]]:
    """Two servers on one port, at 127.0.0.2 and 127.0.0.3 (two pod IPs on loopback)."""
    servicers, servers, port = [], [], 0
    for host in ("127.0.0.2", "127.0.0.3"):
        servicer = FakeRollout()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rollout_pb2_grpc.add_RolloutServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"{host}:{port}")
        server.start()
        servicers.append(servicer)
        servers.append(server)
    yield servicers, servers, port
    for server in servers:
        server.stop(None)


def rljob(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


def status_of(c: Any, job: str) -> dict[str, Any]:
    return dict((c.get("stoker.dev/v1alpha1/rljobs", job) or {}).get("status") or {})


def condition(c: Any, job: str, kind: str) -> dict[str, Any]:
    return next((x for x in status_of(c, job).get("conditions", []) if x["type"] == kind), {})


def actor_env(c: Any, job: str) -> dict[str, str]:
    container = c.get("apps/v1/deployments", f"{job}-actor")["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", "") for e in container["env"]}


def server_pod(name: str, job: str, ip: str, *, server: int | None = None, host: int = 0, ready: bool = True) -> dict[str, Any]:
    """A rollout pod as its controller makes it; ``server``: a host of that multi-host server."""
    labels = {JOB_LABEL: job, ROLE_LABEL: "rollout"}
    if server is not None:
        labels |= {SERVER_LABEL: str(server), COMPLETION_INDEX_LABEL: str(host)}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


async def test_rollout_tier_children_status_scaling_and_removal(rollout_servers: Any, operator_factory: Any) -> None:
    servicers, servers, port = rollout_servers
    c = await operator_factory(buffer_address_template=NO_BUFFER, stats_timeout_seconds=0.3)
    await c.create(RLJOBS, rljob("gen", rollout={"replicas": 2, "minReplicas": 1, "maxReplicas": 3, "port": port}))
    tpu = {"accelerator": "tpu-v5p-slice", "topology": "2x2x4", "replicas": 2, "maxReplicas": 4, "port": port}
    await c.create(RLJOBS, rljob("big", rollout=tpu))  # multi-host servers, beside it

    # -- children: the servers' Deployment and Service, owned by the job; actors get the address
    await c.eventually(lambda: {"gen-rollout", "gen-actor"} <= c.names("apps/v1/deployments"), what="rollout Deployment")
    assert "gen-rollout" in c.names("v1/services")
    deployment = c.get("apps/v1/deployments", "gen-rollout")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["metadata"]["ownerReferences"][0]["name"] == "gen"
    assert deployment["spec"]["template"]["metadata"]["labels"]["stoker.dev/role"] == "rollout"
    assert c.get("v1/services", "gen-rollout")["spec"]["ports"][0]["port"] == port
    assert actor_env(c, "gen")["STOKER_ROLLOUT_ADDRESS"] == f"gen-rollout:{port}"
    await c.eventually(lambda: condition(c, "gen", "RolloutReady").get("reason") == "MinimumReplicasUnavailable",
                       what="RolloutReady False while no server is ready")

    # -- two ready servers: their Stats in the status (tokens/s summed), RolloutReady True
    await c.create(PODS, server_pod("gen-rollout-a", "gen", "127.0.0.2"))
    await c.create(PODS, server_pod("gen-rollout-b", "gen", "127.0.0.3"))
    await c.patch(DEPLOYMENTS + "/gen-rollout/status", {"status": {"readyReplicas": 2}})
    await c.eventually(lambda: status_of(c, "gen").get("rollout", {}).get("tokensPerSecond") == 3000.0, what="tokens/s")
    rollout = status_of(c, "gen")["rollout"]
    assert rollout["summary"] == "2/2" and rollout["answering"] == 2 and rollout["batchOccupancy"] == 0.5
    assert condition(c, "gen", "RolloutReady")["status"] == "True"
    assert "3000 tokens/s" in condition(c, "gen", "RolloutReady")["message"]

    # -- one server stops answering: named in the condition, its tokens no longer counted
    servers[1].stop(None)
    await c.eventually(lambda: status_of(c, "gen")["rollout"].get("tokensPerSecond") == 1500.0, what="one server's tokens/s")
    assert "127.0.0.3" in condition(c, "gen", "RolloutReady")["message"]
    assert status_of(c, "gen")["rollout"]["answering"] == 1

    # -- requests queue beyond the batch slots: one more server, up to maxReplicas, with an Event
    servicers[0].stats.queue_depth = 40
    await c.eventually(lambda: c.get("apps/v1/deployments", "gen-rollout")["spec"]["replicas"] == 3, what="scaled to 3")
    await c.eventually(lambda: status_of(c, "gen")["rollout"]["desired"] == 3, what="status desired 3")
    await c.eventually(lambda: c.events("ScaledUpRollout"), what="a ScaledUpRollout Event")
    assert "generation saturated" in c.events("ScaledUpRollout")[0]["message"]

    # -- suspend: the servers go to 0 and the target stays; resume brings them back
    replicas = lambda: c.get("apps/v1/deployments", "gen-rollout")["spec"]["replicas"]  # noqa: E731
    await c.patch(RLJOBS + "/gen", {"spec": {"suspend": True}})
    await c.eventually(lambda: replicas() == 0, timeout=30, what="servers scaled to 0")
    await c.eventually(lambda: condition(c, "gen", "RolloutReady").get("reason") == "Suspended", what="RolloutReady Suspended")
    await c.patch(DEPLOYMENTS + "/gen-rollout/status", {"status": {"readyReplicas": 0}})
    assert status_of(c, "gen")["rollout"]["desired"] == 3
    await c.patch(RLJOBS + "/gen", {"spec": {"suspend": False}})
    await c.eventually(lambda: replicas() == 3, timeout=30, what="servers back at 3")
    await c.patch(DEPLOYMENTS + "/gen-rollout/status", {"status": {"readyReplicas": 3}})
    await c.eventually(lambda: condition(c, "gen", "RolloutReady").get("status") == "True", timeout=30,
                       what="RolloutReady after resume")
    await c.eventually(lambda: condition(c, "gen", "Suspended").get("status") == "False", what="Suspended False")
    assert status_of(c, "gen")["rollout"]["desired"] == 3 and replicas() == 3

    # -- spec.rollout removed: its children and its status go, actors sample in-process again
    await c.patch(RLJOBS + "/gen", {"spec": {"rollout": None}})
    await c.eventually(lambda: "gen-rollout" not in c.names("apps/v1/deployments"), what="rollout Deployment deleted")
    await c.eventually(lambda: "gen-rollout" not in c.names("v1/services"), what="rollout Service deleted")
    await c.eventually(lambda: "STOKER_ROLLOUT_ADDRESS" not in actor_env(c, "gen"), what="actors without the address")
    await c.eventually(lambda: "rollout" not in status_of(c, "gen"), what="status.rollout removed")
    assert condition(c, "gen", "RolloutReady")["reason"] == "InProcess"

    # -- a multi-host TPU tier is one JobSet per server, and fewer servers delete the last ones
    jobsets = "jobset.x-k8s.io/v1alpha2/jobsets"
    await c.eventually(lambda: {"big-rollout-0", "big-rollout-1"} <= c.names(jobsets), what="two server JobSets")
    job = c.get(jobsets, "big-rollout-1")["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == 4 and job["template"]["spec"]["containers"][0]["resources"]["limits"]["google.com/tpu"] == "4"
    assert "big-rollout" not in c.names("apps/v1/deployments")
    assert c.get("v1/services", "big-rollout")["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    await c.patch(RLJOBS + "/big", {"spec": {"rollout": {**tpu, "replicas": 1}}})
    await c.eventually(lambda: "big-rollout-1" not in c.names(jobsets), what="server 1 removed")
    assert "big-rollout-0" in c.names(jobsets)
    await c.eventually(lambda: status_of(c, "big").get("rollout", {}).get("desired") == 1, what="status desired 1")

    # -- its Stats come from host 0 while all 4 hosts are ready; the followers serve only gRPC
    #    health (Stats UNIMPLEMENTED, as at 127.0.0.5) and are never read
    servicers[0].stats.queue_depth = 0
    follower = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    follower.add_insecure_port(f"127.0.0.5:{port}")
    follower.start()
    try:
        for host, ip in enumerate(["127.0.0.2", "127.0.0.5", "127.0.0.6", "127.0.0.7"]):
            await c.create(PODS, server_pod(f"big-rollout-0-{host}", "big", ip, server=0, host=host))
        await c.patch(JOBSETS + "/big-rollout-0/status", {"status": {"replicatedJobsStatus": [{"name": "slice", "ready": 1}]}})
        await c.eventually(lambda: condition(c, "big", "RolloutReady").get("reason") == "Serving", what="the slice serving")
        rollout = status_of(c, "big")["rollout"]
        assert rollout["answering"] == 1 and rollout["tokensPerSecond"] == 1500.0 and rollout["summary"] == "1/1"
        assert "not answering" not in condition(c, "big", "RolloutReady")["message"]
        # a host restarting: the server cannot generate, and is no longer read
        await c.patch(PODS + "/big-rollout-0-3/status", {"status": {"conditions": [{"type": "Ready", "status": "False"}]}})
        await c.patch(JOBSETS + "/big-rollout-0/status", {"status": {"replicatedJobsStatus": [{"name": "slice", "ready": 0}]}})
        await c.eventually(lambda: status_of(c, "big")["rollout"]["answering"] == 0, what="a slice missing a host not read")
        assert condition(c, "big", "RolloutReady")["reason"] == "MinimumReplicasUnavailable"
    finally:
        follower.stop(None)



class HeldBuffer(buffer_pb2_grpc.BufferServicer):
    """A buffer whose Stats the test can hold: the operator's look waits inside its buffer read --
    after it read the spec and observed the children, before it syncs them -- until released or
    ``hold_seconds`` pass, then fails. Calls are counted per job (each job has its own token)."""

    def __init__(self, hold_seconds: float) -> None:
        self.hold_seconds = hold_seconds
        self.calls: dict[str, int] = {}
        self.held: set[str] = set()
        self.release = threading.Event()
        self._armed = False
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def arm(self) -> None:
        """Hold the next look of every job, once."""
        with self._lock:
            self._armed, self._done = True, set()
            self.release.clear()

    def Stats(self, request: Any, context: grpc.ServicerContext) -> Any:
        token = dict(context.invocation_metadata()).get("authorization", "")
        with self._lock:
            self.calls[token] = self.calls.get(token, 0) + 1
            hold = self._armed and token not in self._done
            if hold:
                self.held.add(token)
                self._done.add(token)
        if hold:
            self.release.wait(self.hold_seconds)
            with self._lock:
                self.held.discard(token)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this buffer only holds the operator's look")


@pytest.fixture
def held_buffer() -> Iterator[tuple[HeldBuffer, str]]:
    servicer = HeldBuffer(hold_seconds=3.0)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    buffer_pb2_grpc.add_BufferServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    servicer.release.set()
    server.stop(None)


async def test_a_look_begun_while_suspended_does_not_undo_the_resume(held_buffer: Any, operator_factory: Any) -> None:
    """Suspend scales a rollout tier to zero (multi-host: its JobSets go) and resume brings it back,
    even when the operator's periodic look read the spec just before the resume arrived: that look
    is held inside its buffer read until the resume has had every chance to be applied."""
    buffer, address = held_buffer
    c = await operator_factory(buffer_address_template=address, stats_timeout_seconds=3.0)
    jobsets = "jobset.x-k8s.io/v1alpha2/jobsets"
    servers = {"big-rollout-0", "big-rollout-1"}
    tpu = {"accelerator": "tpu-v5p-slice", "topology": "2x2x4", "replicas": 2, "maxReplicas": 4}
    await c.create(RLJOBS, rljob("gen", rollout={"replicas": 2, "maxReplicas": 3}))
    await c.create(RLJOBS, rljob("big", rollout=tpu))

    def replicas() -> Any:
        return (c.get("apps/v1/deployments", "gen-rollout") or {}).get("spec", {}).get("replicas")

    def serving() -> bool:
        return replicas() == 2 and servers <= c.names(jobsets)

    await c.eventually(serving, timeout=30, what="both rollout tiers")
    for job in ("gen", "big"):
        await c.patch(RLJOBS + f"/{job}", {"spec": {"suspend": True}})
    await c.eventually(lambda: replicas() == 0, timeout=30, what="single-host servers scaled to 0")
    await c.eventually(lambda: not servers & c.names(jobsets), timeout=30, what="multi-host server JobSets deleted")
    for job in ("gen", "big"):
        await c.eventually(lambda: condition(c, job, "RolloutReady").get("reason") == "Suspended", what=f"{job} suspended")
        assert status_of(c, job)["rollout"]["desired"] == 2  # the target is kept for the resume

    # -- each job's next look has read the suspended spec and waits; the jobs are resumed meanwhile
    await c.eventually(lambda: len(buffer.calls) == 2, what="both jobs' looks reading the buffer")
    buffer.arm()
    await c.eventually(lambda: len(buffer.held) == 2, what="both looks held")
    mark = max(r.id for r in c.k)
    for job in ("gen", "big"):
        await c.patch(RLJOBS + f"/{job}", {"spec": {"suspend": False}})
    await c.eventually(lambda: serving() or not buffer.held, timeout=20, what="the resume applied, or the looks let go")
    buffer.release.set()
    calls = dict(buffer.calls)
    await c.eventually(lambda: all(buffer.calls[t] > n for t, n in calls.items()), timeout=30, what="the held looks finished")
    await c.eventually(serving, timeout=30, what="both rollout tiers back")
    for job in ("gen", "big"):
        await c.eventually(lambda: condition(c, job, "Suspended").get("status") == "False", timeout=30, what=f"{job} resumed")
        assert condition(c, job, "RolloutReady")["reason"] != "Suspended"

    undone = [
        f"{r.method.name} {r.resource.plural}/{r.name} {r.data}" for r in c.k
        if r.id > mark and r.resource is not None and (
            (r.method == kmock.method.DELETE and r.resource.plural == "jobsets" and r.name in servers)
            or (r.method == kmock.method.PATCH and r.name == "gen-rollout" and r.resource.plural == "deployments"
                and isinstance(r.data, dict) and (r.data.get("spec") or {}).get("replicas") == 0)
            or (r.method == kmock.method.PATCH and r.resource.plural == "rljobs" and r.subresource == "status"
                and isinstance(r.data, dict) and any(x.get("type") == "Suspended" and x.get("status") == "True"
                                                     for x in (r.data.get("status") or {}).get("conditions") or []))
        )
    ]
    assert not undone, f"the resume was undone by a look that read the suspended spec: {undone}"

    # -- what `kubectl describe rljob` lists: the lifecycle as Normal Events on each job
    def reasons(job: str) -> set[str]:
        events = [o.raw for o in c.objects("v1/events")]
        return {e["reason"] for e in events if e["involvedObject"]["name"] == job and e["type"] == "Normal"}

    for job in ("gen", "big"):
        await c.eventually(lambda: {"CreatedChildren", "Suspending", "Resuming"} <= reasons(job), timeout=30,
                           what=f"{job}'s Events")
    assert "actors and rollout servers scaled to 0" in c.events("Suspending")[0]["message"]
    assert "deleted JobSet/big-rollout-0" in " ".join(e["message"] for e in c.events("SyncedRolloutTier"))
    assert any("JobSet/big-rollout-1" in e["message"] for e in c.events("CreatedChildren"))  # recreated on resume

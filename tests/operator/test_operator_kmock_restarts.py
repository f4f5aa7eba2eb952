"""The operator process (kopf) against kmock when components die: restarts per component and the
Degraded/Recovering conditions in the RLJob's status; a lost learner slice (JobSet restart) leaves
the buffer, its volume and the learner's run volume alone; an evicted actor's sandboxes are reaped.

kmock runs no controllers: the test plays the kubelet, the Deployment controller and the JobSet
controller by writing the status they would write."""

from __future__ import annotations

import base64
from datetime import datetime, timezone
from typing import Any

import kmock
import pytest

from stoker.buffer.client import BufferClient
from stoker.labels import ACTOR_LABEL, HEARTBEAT_ANNOTATION, JOB_LABEL, ROLE_LABEL, rfc3339

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

RLJOBS = "/apis/stoker.dev/v1alpha1/namespaces/{ns}/rljobs"
PODS = "/api/v1/namespaces/{ns}/pods"
DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"
JOBSETS = "/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets"
JOB = "lake"


def status_of(c: Any) -> dict[str, Any]:
    return dict((c.get("stoker.dev/v1alpha1/rljobs", JOB) or {}).get("status") or {})


def condition(c: Any, kind: str) -> dict[str, Any]:
    return next((x for x in status_of(c).get("conditions", []) if x["type"] == kind), {})


def pod(name: str, role: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {JOB_LABEL: JOB, ROLE_LABEL: role, **labels}}}


def container_status(restarts: int, *, last: str = "", waiting: str = "", ready: bool = True) -> dict[str, Any]:
    state = {"waiting": {"reason": waiting}} if waiting else {"running": {"startedAt": "2026-01-01T00:10:00Z"}}
    out: dict[str, Any] = {"name": "main", "ready": ready, "restartCount": restarts, "state": state}
    if last:
        out["lastState"] = {"terminated": {"reason": last, "exitCode": 137, "finishedAt": "2026-01-01T00:09:00Z"}}
    return out


def writes(c: Any, plural: str) -> list[Any]:
    """The operator's creates and deletes of ``plural`` (not the test's own calls)."""
    return [r for r in c.k if r.resource is not None and r.resource.plural == plural
            and r.method in (kmock.method.POST, kmock.method.DELETE)
            and not r.headers.get("User-Agent", "").startswith("kmock")]


async def test_component_deaths_in_status(buffer_process: tuple[str, str], operator_factory: Any) -> None:
    address, token = buffer_process
    c = await operator_factory(buffer_address_template=address)
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{JOB}-buffer-token"},
              "data": {"token": base64.b64encode(token.encode()).decode()}}
    await c.create("/api/v1/namespaces/{ns}/secrets", secret)
    await c.create(RLJOBS, {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": JOB},
                            "spec": {"actors": {"replicas": 2, "minReplicas": 1, "maxReplicas": 2}}})
    await c.eventually(lambda: {f"{JOB}-actor", f"{JOB}-buffer"} <= c.names("apps/v1/deployments"), what="deployments")
    await c.eventually(lambda: f"{JOB}-learner" in c.names("jobset.x-k8s.io/v1alpha2/jobsets"), what="the JobSet")

    # -- everything comes up; the buffer pod was OOM-killed twice on the way
    BufferClient(address, token=token).set_policy_version(3)
    await c.create(PODS, pod(f"{JOB}-buffer-x", "buffer"))
    await c.patch(PODS + f"/{JOB}-buffer-x/status", {"status": {
        "phase": "Running", "containerStatuses": [container_status(2, last="OOMKilled")]}})
    await c.patch(DEPLOYMENTS + f"/{JOB}-buffer/status", {"status": {"readyReplicas": 1}})
    await c.patch(DEPLOYMENTS + f"/{JOB}-actor/status", {"status": {"readyReplicas": 2}})
    await c.patch(JOBSETS + f"/{JOB}-learner/status", {"status": {"replicatedJobsStatus": [{"name": "slice", "ready": 1}]}})
    await c.eventually(lambda: status_of(c).get("phase") == "Running", what="phase Running")
    await c.eventually(lambda: "buffer 2 (last: OOMKilled)" in condition(c, "Degraded").get("message", ""),
                       what="the buffer's restarts in Degraded's message")
    assert (condition(c, "Degraded")["status"], condition(c, "Recovering")["status"]) == ("False", "False")
    assert status_of(c)["restarts"]["buffer"] == 2

    # -- a learner slice is lost: the JobSet restarts it (status.restarts), its pods not ready yet
    before = {p: len(writes(c, p)) for p in ("deployments", "persistentvolumeclaims", "jobsets")}
    assert before == {"deployments": 2, "persistentvolumeclaims": 2, "jobsets": 1}  # the log sees the operator's creates
    await c.patch(JOBSETS + f"/{JOB}-learner/status", {"status": {
        "restarts": 1, "replicatedJobsStatus": [{"name": "slice", "ready": 0}]}})
    await c.eventually(lambda: condition(c, "Recovering").get("status") == "True", what="Recovering True")
    recovering = condition(c, "Recovering")
    assert recovering["reason"] == "Restarting"
    assert recovering["message"].startswith("learner coming back: learner JobSet restarted 1 time")
    assert status_of(c)["phase"] == "Degraded"
    assert (condition(c, "Degraded")["status"], condition(c, "Degraded")["reason"]) == ("True", "ComponentDown")
    assert "restarts: learner 1, buffer 2 (last: OOMKilled), actors 0" in condition(c, "Degraded")["message"]
    await c.patch(JOBSETS + f"/{JOB}-learner/status", {"status": {
        "restarts": 1, "replicatedJobsStatus": [{"name": "slice", "ready": 1}]}})
    await c.eventually(lambda: condition(c, "Recovering").get("status") == "False", what="recovered")
    assert status_of(c)["phase"] == "Running" and condition(c, "Degraded")["status"] == "False"
    assert "learner 1" in condition(c, "Degraded")["message"]  # the count stays in the status
    # The learner came back by itself: the operator neither recreated nor deleted the JobSet, the
    # buffer (its data: the Deployment and its volume) or the learner's run volume (checkpoints).
    # (kmock gives children no uid to compare: the request log is the witness.)
    assert {p: len(writes(c, p)) for p in before} == before
    assert f"{JOB}-buffer" in c.names("apps/v1/deployments")
    assert {f"{JOB}-buffer", f"{JOB}-learner-run"} <= c.names("v1/persistentvolumeclaims")

    # -- the buffer crash-loops: down, and not coming back by itself
    await c.patch(PODS + f"/{JOB}-buffer-x/status", {"status": {"containerStatuses": [
        container_status(3, last="OOMKilled", waiting="CrashLoopBackOff", ready=False)]}})
    await c.patch(DEPLOYMENTS + f"/{JOB}-buffer/status", {"status": {"readyReplicas": 0}})
    await c.eventually(lambda: condition(c, "Degraded").get("reason") == "CrashLoopBackOff", what="Degraded CrashLoopBackOff")
    assert condition(c, "Degraded")["message"].startswith(
        "buffer down: buffer pod restarted 3 times, last: OOMKilled, now CrashLoopBackOff")
    assert (condition(c, "Recovering")["status"], condition(c, "Recovering")["reason"]) == ("False", "Stuck")
    assert len(writes(c, "deployments")) == before["deployments"]  # the buffer is left to its kubelet

    # -- the crash-looping buffer pod is deleted; its Deployment replaces it with a pod at 0 restarts:
    # the count does not drop to 0, the gone pod's 3 stay and the replacement is one more
    await c.delete(PODS + f"/{JOB}-buffer-x")
    await c.create(PODS, pod(f"{JOB}-buffer-y", "buffer"))
    await c.patch(PODS + f"/{JOB}-buffer-y/status", {"status": {"phase": "Running", "containerStatuses": [container_status(0)]}})
    await c.patch(DEPLOYMENTS + f"/{JOB}-buffer/status", {"status": {"readyReplicas": 1}})
    await c.eventually(lambda: status_of(c).get("restarts", {}).get("buffer") == 4, what="buffer restarts 3 + 1")
    await c.eventually(lambda: "buffer 4 (last: deleted)" in condition(c, "Degraded").get("message", ""),
                       what="the replacement in Degraded's message")
    assert status_of(c)["restartLedger"]["carried"]["buffer"]["count"] == 4  # kept where a new operator reads it

    # -- an actor pod is evicted (it stays listed, Failed) and the Deployment replaces it: the dead
    # actor's sandbox is reaped, the replacement's is kept
    now = rfc3339(datetime.now(timezone.utc))
    for name in (f"{JOB}-actor-old", f"{JOB}-actor-new"):
        await c.create(PODS, pod(name, "actor"))
    await c.patch(PODS + f"/{JOB}-actor-old/status", {"status": {"phase": "Failed", "reason": "Evicted"}})
    await c.patch(PODS + f"/{JOB}-actor-new/status", {"status": {"phase": "Running"}})
    for sandbox, actor in (("sb-old", f"{JOB}-actor-old"), ("sb-new", f"{JOB}-actor-new")):
        body = pod(sandbox, "sandbox", **{ACTOR_LABEL: actor})
        body["metadata"]["annotations"] = {HEARTBEAT_ANNOTATION: now}
        await c.create(PODS, body)
    await c.eventually(lambda: "sb-old" not in c.names("v1/pods"), what="the evicted actor's sandbox reaped")
    assert {"sb-new", f"{JOB}-actor-old", f"{JOB}-actor-new"} <= c.names("v1/pods")
    await c.eventually(lambda: c.events("ReapedZombieSandboxes"), what="a ReapedZombieSandboxes Event")
    assert "actor lake-actor-old is dead (Evicted)" in c.events("ReapedZombieSandboxes")[0]["message"]
    # Replacing the dead actor is the Deployment's job: the operator kept its Deployment as it was.
    assert len(writes(c, "deployments")) == before["deployments"]
    assert c.get("apps/v1/deployments", f"{JOB}-actor")["spec"]["replicas"] == 2  # type: ignore[index]
    # The evicted pod is a restart of the actors, once, and stays one after it is garbage-collected.
    await c.eventually(lambda: status_of(c).get("restarts", {}).get("actors") == 1, what="actors restarts 1")
    assert "actors 1 (last: Evicted)" in condition(c, "Degraded")["message"]
    await c.delete(PODS + f"/{JOB}-actor-old")
    await c.eventually(lambda: len(status_of(c)["restartLedger"]["pods"]) == 2,  # buffer-y, actor-new
                       what="the gone pod out of the ledger")
    assert status_of(c)["restarts"] == {"learner": 1, "buffer": 4, "actors": 1, "rollout": 0}

"""The operator process (kopf) against kmock's Kubernetes emulator on loopback, end to end:
create -> children with owner references -> real buffer Stats in status -> zombie sandboxes
reaped -> spec update -> suspend/resume -> delete, and every API call it made is in the RBAC table."""

from __future__ import annotations

import base64
from datetime import datetime, timedelta, timezone
from typing import Any

import kmock
import pytest

from stoker.labels import ACTOR_LABEL, HEARTBEAT_ANNOTATION, JOB_LABEL, ROLE_LABEL, rfc3339
from stoker.buffer.client import BufferClient
from stoker.operator import rbac

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

RLJOBS = "/apis/stoker.dev/v1alpha1/namespaces/{ns}/rljobs"
PODS = "/api/v1/namespaces/{ns}/pods"
DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"


def rljob(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


def condition(c: Any, job: str, kind: str) -> dict[str, Any] | None:
    status = (c.get("stoker.dev/v1alpha1/rljobs", job) or {}).get("status") or {}
    return next((x for x in status.get("conditions", []) if x["type"] == kind), None)


def status_of(c: Any, job: str) -> dict[str, Any]:
    return dict((c.get("stoker.dev/v1alpha1/rljobs", job) or {}).get("status") or {})


def pod(name: str, job: str, role: str, **annotations: str) -> dict[str, Any]:
    labels = {JOB_LABEL: job, ROLE_LABEL: role}
    if "actor" in annotations:
        labels[ACTOR_LABEL] = annotations.pop("actor")
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels, "annotations": annotations}}


def api_verb(request: Any) -> str:
    """The RBAC verb of an HTTP request, as the API server's authorizer derives it."""
    method = str(request.method.value).upper()
    if method == "GET":
        if request.params.get("watch") in ("true", "1"):
            return "watch"
        return "get" if request.name else "list"
    if method == "DELETE":
        return "delete" if request.name else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]


def assert_rbac_covers(c: Any) -> None:
    """Every request the operator sent is allowed by stoker.operator.rbac (the chart's source)."""
    used, missing = set(), set()
    for request in c.k:
        if request.resource is None or request.resource.plural is None:
            continue  # discovery (/api, /apis/group/version) is open to every authenticated client
        if request.headers.get("User-Agent", "").startswith("kmock"):
            continue  # the test's own kubectl-like calls
        resource = request.resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verb = api_verb(request)
        used.add((request.resource.group, resource, verb))
        if not rbac.allows(request.resource.group, resource, verb, standalone=True):
            missing.add((request.resource.group, resource, verb))
    assert not missing, f"operator used API calls its RBAC table does not grant: {sorted(missing)}"
    # The check saw the operator's real traffic, from kopf and from the operator's own client.
    assert {("stoker.dev", "rljobs", "watch"), ("stoker.dev", "rljobs/status", "patch"), ("", "pods", "delete"),
            ("apps", "deployments", "create"), ("apps", "deployments", "patch"), ("", "secrets", "get"),
            ("jobset.x-k8s.io", "jobsets", "delete"), ("", "events", "create")} <= used


async def test_rljob_lifecycle_with_real_buffer(buffer_process: tuple[str, str], operator_factory: Any) -> None:
    address, token = buffer_process
    c = await operator_factory(buffer_address_template=address)
    job = "lake"
    # The token Secret exists before the job (as after an operator restart): it must be kept.
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": f"{job}-buffer-token"}, "data": {
        "token": base64.b64encode(token.encode()).decode()}}
    await c.create("/api/v1/namespaces/{ns}/secrets", secret)
    await c.create(RLJOBS, rljob(job, actors={"replicas": 2, "minReplicas": 1, "maxReplicas": 4}))

    # -- children, each owned by the RLJob
    expected = {
        "apps/v1/deployments": {f"{job}-actor", f"{job}-buffer"},
        "v1/services": {f"{job}-buffer"},
        "v1/persistentvolumeclaims": {f"{job}-buffer", f"{job}-learner-run"},
        "v1/configmaps": {f"{job}-spec", f"{job}-buffer-control"},
        "v1/serviceaccounts": {f"{job}-sandbox-manager"},
        "rbac.authorization.k8s.io/v1/roles": {f"{job}-sandbox-manager"},
        "rbac.authorization.k8s.io/v1/rolebindings": {f"{job}-sandbox-manager"},
        "networking.k8s.io/v1/networkpolicies": {f"{job}-sandboxes"},
        "jobset.x-k8s.io/v1alpha2/jobsets": {f"{job}-learner"},
    }
    for resource, names in expected.items():
        await c.eventually(lambda r=resource, n=names: n <= c.names(r), what=f"{resource} {names}")
        for name in names:
            owners = c.get(resource, name)["metadata"]["ownerReferences"]  # type: ignore[index]
            assert owners == [{"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "name": job,
                               "uid": "uid-0002", "controller": True, "blockOwnerDeletion": True}]
    stored = c.get("v1/secrets", f"{job}-buffer-token")
    assert base64.b64decode(stored["data"]["token"]).decode() == token  # type: ignore[index]
    assert c.get("apps/v1/deployments", f"{job}-actor")["spec"]["replicas"] == 2  # type: ignore[index]

    # -- the buffer's real Stats flow into status once its pod is ready
    BufferClient(address, token=token).set_policy_version(7)
    await c.patch(DEPLOYMENTS + f"/{job}-buffer/status", {"status": {"readyReplicas": 1}})
    await c.patch(DEPLOYMENTS + f"/{job}-actor/status", {"status": {"readyReplicas": 2}})
    await c.eventually(lambda: status_of(c, job).get("policyVersion") == 7, what="policyVersion 7 in status")
    await c.eventually(lambda: (condition(c, job, "BufferReady") or {}).get("status") == "True", what="BufferReady")
    await c.eventually(lambda: status_of(c, job).get("actors", {}).get("ready") == 2, what="2 actors ready")
    status = status_of(c, job)
    assert status["bufferFill"] == 0.0
    assert status["actors"] == {"ready": 2, "desired": 2, "summary": "2/2"}
    assert (condition(c, job, "ActorsAvailable") or {})["status"] == "True"
    assert (condition(c, job, "LearnerReady") or {})["status"] == "False"  # no JobSet controller here
    assert status["phase"] == "Degraded"  # it has a policy version, and the learner is not ready
    await c.patch("/apis/jobset.x-k8s.io/v1alpha2/namespaces/{ns}/jobsets/" + f"{job}-learner/status",
                  {"status": {"replicatedJobsStatus": [{"name": "slice", "ready": 1}]}})
    await c.eventually(lambda: status_of(c, job).get("phase") == "Running", what="phase Running")
    assert (condition(c, job, "Ready") or {})["reason"] == "AllComponentsReady"

    # -- zombie sandboxes: one whose actor is gone, one with a stale heartbeat; a live one stays
    now = datetime.now(timezone.utc)
    await c.create(PODS, pod(f"{job}-actor-a", job, "actor"))
    await c.create(PODS, pod("sb-live", job, "sandbox", actor=f"{job}-actor-a", **{HEARTBEAT_ANNOTATION: rfc3339(now)}))
    await c.create(PODS, pod("sb-orphan", job, "sandbox", actor=f"{job}-actor-gone", **{HEARTBEAT_ANNOTATION: rfc3339(now)}))
    stale = rfc3339(now - timedelta(hours=1))
    await c.create(PODS, pod("sb-silent", job, "sandbox", actor=f"{job}-actor-a", **{HEARTBEAT_ANNOTATION: stale}))
    await c.create(PODS, pod("sb-other-job", "other", "sandbox", actor="nobody"))
    await c.eventually(lambda: not {"sb-orphan", "sb-silent"} & c.names("v1/pods"), what="zombies deleted")
    assert {"sb-live", "sb-other-job", f"{job}-actor-a"} <= c.names("v1/pods")
    await c.eventually(lambda: status_of(c, job).get("zombiesReaped") == 2, what="zombiesReaped 2")
    await c.eventually(lambda: c.events("ReapedZombieSandboxes"), what="a ReapedZombieSandboxes Event")
    event = c.events("ReapedZombieSandboxes")[0]
    assert event["involvedObject"]["name"] == job and "sb-orphan" in event["message"] + str(c.events("ReapedZombieSandboxes"))
    await c.delete(PODS + f"/{job}-actor-a")  # the actor dies: its sandbox is a zombie now
    await c.eventually(lambda: "sb-live" not in c.names("v1/pods"), what="sb-live reaped")
    await c.eventually(lambda: status_of(c, job).get("zombiesReaped") == 3, what="zombiesReaped 3")

    # -- spec update: actor replicas
    await c.patch(RLJOBS + f"/{job}", {"spec": {"actors": {"replicas": 3}}})
    await c.eventually(lambda: c.get("apps/v1/deployments", f"{job}-actor")["spec"]["replicas"] == 3,  # type: ignore[index]
                     what="actors scaled to 3")

    # -- suspend: actors to 0, learner removed, buffer kept; resume restores both
    await c.patch(RLJOBS + f"/{job}", {"spec": {"suspend": True}})
    await c.eventually(lambda: f"{job}-learner" not in c.names("jobset.x-k8s.io/v1alpha2/jobsets"), what="learner removed")
    await c.eventually(lambda: c.get("apps/v1/deployments", f"{job}-actor")["spec"]["replicas"] == 0,  # type: ignore[index]
                       what="actors at 0")
    assert f"{job}-buffer" in c.names("apps/v1/deployments")
    assert {f"{job}-buffer", f"{job}-learner-run"} <= c.names("v1/persistentvolumeclaims")  # data and checkpoints stay
    await c.eventually(lambda: status_of(c, job).get("phase") == "Suspended", what="phase Suspended")
    assert (condition(c, job, "Suspended") or {})["status"] == "True"
    deletes = [r for r in c.k if r.method == kmock.method.DELETE and r.resource == kmock.resource("jobset.x-k8s.io/v1alpha2/jobsets")]
    assert deletes and deletes[-1].data["propagationPolicy"] == "Foreground"  # pods checkpoint before it goes

    await c.patch(RLJOBS + f"/{job}", {"spec": {"suspend": False}})
    await c.eventually(lambda: f"{job}-learner" in c.names("jobset.x-k8s.io/v1alpha2/jobsets"), what="learner recreated")
    await c.eventually(lambda: c.get("apps/v1/deployments", f"{job}-actor")["spec"]["replicas"] == 3,  # type: ignore[index]
                     what="actors restored")
    await c.eventually(lambda: (condition(c, job, "Suspended") or {}).get("status") == "False", what="Suspended False")

    # -- delete: kopf's finalizer is released promptly and the RLJob goes
    await c.delete(RLJOBS + f"/{job}")
    await c.eventually(lambda: c.get("stoker.dev/v1alpha1/rljobs", job) is None, what="RLJob gone")
    assert_rbac_covers(c)

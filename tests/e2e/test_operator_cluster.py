"""The operator against a real cluster (kind, GKE): what an emulator cannot show — the CRD's
schema and CEL rules enforced by a real API server, and deletion cascading through owner
references by the real garbage collector.

Skipped unless ``STOKER_E2E_KUBECONFIG`` names a kubeconfig whose user may install CRDs and
create namespaces (see docs/operator.md, "End-to-end tests"). Pods need not run: the checks are
about the control plane, so no images are pulled.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from stoker.operator.cli import run_operator
from stoker.operator.kube import RESOURCES, ApiError, Conflict, Kube, NotFound, Resource, load_configuration
from stoker.operator.settings import OperatorSettings

KUBECONFIG = os.environ.get("STOKER_E2E_KUBECONFIG")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not KUBECONFIG, reason="set STOKER_E2E_KUBECONFIG to run against a real cluster"),
]

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / "rljob.yaml"
CRD = Resource("apiextensions.k8s.io", "v1", "customresourcedefinitions", namespaced=False)
NAMESPACE = Resource("", "v1", "namespaces", namespaced=False)
RLJOB = RESOURCES[("stoker.dev/v1alpha1", "RLJob")]
DEPLOYMENT = RESOURCES[("apps/v1", "Deployment")]
POD = RESOURCES[("v1", "Pod")]
SECRET = RESOURCES[("v1", "Secret")]


def wait_for(check: Callable[[], Any], timeout: float = 60, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def exists(kube: Kube, res: Resource, namespace: str, name: str) -> bool:
    try:
        kube.get(res, namespace, name)
    except NotFound:
        return False
    return True


@pytest.fixture(scope="module")
def kube() -> Iterator[Kube]:
    client = Kube(load_configuration(KUBECONFIG), timeout=30)
    crd = yaml.safe_load(CRD_FILE.read_text())
    try:
        client.request("POST", CRD.path(), crd)
    except Conflict:  # installed before: bring it up to date
        current = client.request("GET", CRD.path(name=crd["metadata"]["name"]))
        crd["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        client.request("PUT", CRD.path(name=crd["metadata"]["name"]), crd)
    wait_for(
        lambda: any(c["type"] == "Established" and c["status"] == "True"
                    for c in client.request("GET", CRD.path(name=crd["metadata"]["name"]))["status"].get("conditions", [])),
        what="the CRD to be established",
    )
    yield client
    client.close()


@pytest.fixture(scope="module")
def namespace(kube: Kube) -> Iterator[str]:
    name = os.environ.get("STOKER_E2E_NAMESPACE") or f"stoker-e2e-{uuid.uuid4().hex[:6]}"
    created = False
    try:
        kube.request("POST", NAMESPACE.path(), {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        created = True
    except Conflict:
        pass
    yield name
    if created:
        kube.delete(NAMESPACE, "", name)


@pytest.fixture(scope="module")
def operator(namespace: str) -> Iterator[None]:
    settings = OperatorSettings(namespaces=(namespace,), standalone=True, kubeconfig=KUBECONFIG,
                                status_interval_seconds=1.0, request_timeout_seconds=5.0)
    stop, ready = threading.Event(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(run_operator(settings, stop_flag=stop, ready_flag=ready)),
                              daemon=True)
    thread.start()
    assert ready.wait(60), "the operator did not start"
    yield
    stop.set()
    thread.join(60)


def rljob(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "stoker.dev/v1alpha1", "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


def test_api_server_enforces_schema_and_cel(kube: Kube, namespace: str) -> None:
    """No operator involved: the generated CRD itself rejects what the spec forbids."""
    bad = rljob("bad-replicas", actors={"minReplicas": 5, "maxReplicas": 2})
    bad["metadata"]["namespace"] = namespace
    with pytest.raises(ApiError) as caught:
        kube.create(bad)
    assert caught.value.status == 422 and "minReplicas must be <= maxReplicas" in str(caught.value)
    job = rljob("immutable", learner={"accelerator": "tpu-v5p-slice", "topology": "2x2x1"}, suspend=True)
    job["metadata"]["namespace"] = namespace
    kube.create(job)
    try:
        for patch, message in (({"spec": {"mode": "colocated"}}, "mode is immutable"),
                               ({"spec": {"learner": {"topology": "2x2x2"}}}, "topology is immutable")):
            with pytest.raises(ApiError) as caught:
                kube.patch(RLJOB, namespace, "immutable", patch)
            assert caught.value.status == 422 and message in str(caught.value)
    finally:
        kube.delete(RLJOB, namespace, "immutable")


def test_lifecycle_on_a_real_cluster(kube: Kube, namespace: str, operator: None) -> None:
    job = rljob("e2e", actors={"replicas": 1, "minReplicas": 1, "maxReplicas": 2})
    job["metadata"]["namespace"] = namespace
    kube.create(job)
    uid = kube.get(RLJOB, namespace, "e2e")["metadata"]["uid"]
    for res, name in ((DEPLOYMENT, "e2e-actor"), (DEPLOYMENT, "e2e-buffer"), (SECRET, "e2e-buffer-token")):
        wait_for(lambda r=res, n=name: exists(kube, r, namespace, n), what=f"{name}")
        owner = kube.get(res, namespace, name)["metadata"]["ownerReferences"][0]
        assert owner["uid"] == uid and owner["controller"] is True
    wait_for(lambda: kube.get(RLJOB, namespace, "e2e").get("status", {}).get("conditions"), what="conditions")

    # A sandbox pod whose actor never existed is reaped.
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {
        "name": "e2e-zombie", "namespace": namespace,
        "labels": {"stoker.dev/job": "e2e", "stoker.dev/role": "sandbox", "stoker.dev/actor": "e2e-actor-gone"}},
        "spec": {"containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}]}})
    wait_for(lambda: not exists(kube, POD, namespace, "e2e-zombie")
             or kube.get(POD, namespace, "e2e-zombie")["metadata"].get("deletionTimestamp"), what="zombie reaped")
    wait_for(lambda: kube.get(RLJOB, namespace, "e2e")["status"].get("zombiesReaped", 0) >= 1, what="zombiesReaped")

    # Suspend scales actors to 0 and keeps the buffer.
    kube.patch(RLJOB, namespace, "e2e", {"spec": {"suspend": True}})
    wait_for(lambda: kube.get(DEPLOYMENT, namespace, "e2e-actor")["spec"]["replicas"] == 0, what="actors at 0")
    wait_for(lambda: kube.get(RLJOB, namespace, "e2e")["status"].get("phase") == "Suspended", what="Suspended")
    assert exists(kube, DEPLOYMENT, namespace, "e2e-buffer")
    kube.patch(RLJOB, namespace, "e2e", {"spec": {"suspend": False}})
    wait_for(lambda: kube.get(DEPLOYMENT, namespace, "e2e-actor")["spec"]["replicas"] == 1, what="actors back")

    # Deleting the RLJob releases kopf's finalizer and the garbage collector removes the children.
    kube.delete(RLJOB, namespace, "e2e", propagation="Foreground")
    wait_for(lambda: not exists(kube, RLJOB, namespace, "e2e"), timeout=120, what="RLJob gone")
    wait_for(lambda: not exists(kube, DEPLOYMENT, namespace, "e2e-actor")
             and not exists(kube, SECRET, namespace, "e2e-buffer-token"), timeout=120, what="children collected")


def test_sandbox_policy_confines_the_sandbox_manager(kube: Kube, namespace: str, operator: None) -> None:
    """The chart's admission policy (operator/sandbox_policy.py): actors may touch only their sandboxes."""
    from stoker.operator.sandbox_policy import sandbox_admission_policy

    vap = Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicies", namespaced=False)
    binding = Resource("admissionregistration.k8s.io", "v1", "validatingadmissionpolicybindings", namespaced=False)
    policy_docs = sandbox_admission_policy()
    for res, doc in zip((vap, binding), policy_docs):
        try:
            kube.request("POST", res.path(), doc)
        except Conflict:
            pass
    job = rljob("guard", actors={"replicas": 0, "minReplicas": 0})
    job["metadata"]["namespace"] = namespace
    kube.create(job)
    wait_for(lambda: exists(kube, RESOURCES[("rbac.authorization.k8s.io/v1", "RoleBinding")], namespace,
                            "guard-sandbox-manager"), what="the sandbox manager's RoleBinding")
    actor = Kube(load_configuration(KUBECONFIG), timeout=30)
    actor.api.set_default_header("Impersonate-User", f"system:serviceaccount:{namespace}:guard-sandbox-manager")

    def pod(name: str, labels: dict[str, str]) -> dict[str, Any]:
        """The actor's real sandbox pod, relabelled: only the labels decide here."""
        from stoker.actor.pods import sandbox_pod_manifest

        manifest = sandbox_pod_manifest(name=name, namespace=namespace, job="guard", actor_pod="guard-actor-x",
                                        image="registry.k8s.io/pause:3.10", cpu_seconds=10, memory_mb=64,
                                        heartbeat_ttl_seconds=60)
        manifest["metadata"]["labels"] = labels
        return manifest

    def denied(name: str, labels: dict[str, str]) -> bool:
        try:
            actor.create(pod(name, labels))
        except ApiError as exc:
            return exc.status in (403, 422) and "sandbox" in str(exc)
        remove(name)
        return False

    def remove(name: str) -> None:
        try:
            actor.delete(POD, namespace, name)
        except NotFound:
            pass  # the operator reaped it first (its actor does not exist)

    try:
        # Policies take effect a few seconds after creation.
        wait_for(lambda: denied("not-a-sandbox", {"app": "miner"}), what="the policy to deny a non-sandbox pod")
        assert denied("other-jobs-sandbox", {"stoker.dev/job": "someone-else", "stoker.dev/role": "sandbox"})
        actor.create(pod("own-sandbox", {"stoker.dev/job": "guard", "stoker.dev/role": "sandbox",
                                         "stoker.dev/actor": "guard-actor-x"}))
        remove("own-sandbox")
    finally:
        actor.close()
        kube.delete(RLJOB, namespace, "guard")
        for res, doc in zip((binding, vap), reversed(policy_docs)):
            kube.delete(res, "", doc["metadata"]["name"])  # type: ignore[index]

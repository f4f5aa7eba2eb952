"""The sandbox admission policy, evaluated as the API server does (cel-python): match conditions,
then variables, then every validation, with ``object`` and ``oldObject`` bound as the API server
binds them (CREATE: no old object; UPDATE: both; DELETE: no new object). Both the policy the
operator module builds and the one the Helm chart renders (real Helm SDK) are run. The actor's
real sandbox pod and its heartbeat pass; anything else a sandbox manager (the account untrusted
agent code can reach) tries is denied. Every pod tried is first validated against the Kubernetes
schema, so a denial is never of an object the API server would refuse anyway."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from stoker.actor.pods import sandbox_pod_manifest
from stoker.operator.sandbox_policy import sandbox_admission_policy

ENV = celpy.Environment()
MANAGER = "system:serviceaccount:research:lake-sandbox-manager"
KUBE_VERSION = "1.33.0"
CHART_DIR = Path(__file__).resolve().parents[2] / "helm" / "stoker"
_PROGRAMS: dict[str, Any] = {}


def _helm_policy() -> dict[str, Any]:
    with helm.Chart.load(CHART_DIR) as chart:
        rendered = chart.render({}, name="stoker", namespace="stoker-system", is_install=True)
    docs = [d for path, text in rendered.items() if path.endswith(".yaml") for d in yaml.safe_load_all(text) if d]
    (policy,) = [d for d in docs if d.get("kind") == "ValidatingAdmissionPolicy"]
    return dict(policy["spec"])


@pytest.fixture(scope="module", params=["operator", "helm"])
def policy(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """The policy's spec: as operator/sandbox_policy.py builds it, and as the chart renders it."""
    yield dict(sandbox_admission_policy()[0]["spec"]) if request.param == "operator" else _helm_policy()  # type: ignore[arg-type]


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    if expression not in _PROGRAMS:
        _PROGRAMS[expression] = ENV.program(ENV.compile(expression))
    try:
        return _PROGRAMS[expression].evaluate(activation)
    except celpy.CELEvalError as exc:  # an erroring validation denies (failurePolicy: Fail)
        return exc


def admit(policy: dict[str, Any], operation: str, user: str, obj: dict[str, Any] | None,
          old: dict[str, Any] | None = None) -> list[str]:
    """The messages of the validations that deny this request ([] = admitted)."""
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel({"operation": operation, "namespace": "research", "userInfo": {"username": user}}),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
    }
    if not all(bool(evaluate(c["expression"], activation)) for c in policy["matchConditions"]):
        return []
    variables = {v["name"]: evaluate(v["expression"], activation) for v in policy["variables"]}
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    denied = []
    for validation in policy["validations"]:
        result = evaluate(validation["expression"], activation)
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            denied.append(validation["message"])
    return denied


def valid(pod: dict[str, Any]) -> dict[str, Any]:
    kubernetes_validate.validate(pod, KUBE_VERSION, strict=True)
    return pod


def sandbox(job: str = "lake") -> dict[str, Any]:
    pod = sandbox_pod_manifest(name=f"{job}-sbx-1", namespace="research", job=job, actor_pod=f"{job}-actor-0",
                               image="stoker/actor:1", cpu_seconds=10, memory_mb=128, heartbeat_ttl_seconds=60,
                               actor_pod_uid="0b5e3c2e-0000-4000-8000-000000000001")
    pod["spec"]["serviceAccountName"] = "default"  # the ServiceAccount admission plugin sets it first
    return valid(pod)


def learner_pod(job: str) -> dict[str, Any]:
    """Another pod in the namespace: a job's learner, running as its own account with a token."""
    return valid({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": f"{job}-learner-0", "namespace": "research",
                     "labels": {"stoker.dev/job": job, "stoker.dev/role": "learner"}},
        "spec": {"serviceAccountName": "trainer",
                 "containers": [{"name": "learner", "image": "stoker/learner:1",
                                 "env": [{"name": "STOKER_BUFFER_TOKEN", "valueFrom": {
                                     "secretKeyRef": {"name": f"{job}-buffer-token", "key": "token"}}}]}]},
    })


def edit(pod: dict[str, Any], path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    pod = copy.deepcopy(pod)
    node: Any = pod
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return valid(pod)


def changed(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    return edit(sandbox(), path, value)


def heartbeat(pod: dict[str, Any]) -> dict[str, Any]:
    """What PodSandbox.mark_alive's merge patch makes of the pod."""
    pod = copy.deepcopy(pod)
    pod["metadata"].setdefault("annotations", {})["stoker.dev/heartbeat"] = "2026-01-01T00:00:00.000000Z"
    return valid(pod)


def test_policy_objects_are_valid_kubernetes() -> None:
    for namespaces in ((), ("team-a",)):
        for manifest in sandbox_admission_policy(namespaces):
            kubernetes_validate.validate(manifest, KUBE_VERSION, strict=True)


def test_the_actors_own_sandbox_pod_is_admitted(policy: dict[str, Any]) -> None:
    pod = sandbox()
    assert admit(policy, "CREATE", MANAGER, pod) == []
    assert admit(policy, "UPDATE", MANAGER, heartbeat(pod), pod) == []
    assert admit(policy, "UPDATE", MANAGER, pod, pod) == []  # a no-op patch
    assert admit(policy, "DELETE", MANAGER, None, pod) == []


PROJECTED_TOKEN = {"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}
SECRET_ENV = {"name": "T", "valueFrom": {"secretKeyRef": {"name": "other-buffer-token", "key": "token"}}}
CONFIGMAP_ENV = {"name": "J", "valueFrom": {"configMapKeyRef": {"name": "other-job", "key": "job.yaml"}}}


@pytest.mark.parametrize(
    ("path", "value", "why"),
    [
        (("metadata", "labels"), {"app": "miner"}, "only create, change and delete that job's sandbox"),
        (("metadata", "labels", "stoker.dev/job"), "other", "only create, change and delete that job's sandbox"),
        (("spec", "automountServiceAccountToken"), True, "automountServiceAccountToken"),
        (("spec", "serviceAccountName"), "lake-sandbox-manager", "default ServiceAccount"),
        (("spec", "hostNetwork"), True, "host's network"),
        (("spec", "hostPID"), True, "host's network, PID"),
        (("spec", "volumes"), [{"name": "root", "hostPath": {"path": "/"}}], "only emptyDir"),
        (("spec", "volumes"), [{"name": "s", "secret": {"secretName": "lake-buffer-token"}}], "only emptyDir"),
        # Secrets and tokens by any other door.
        (("spec", "volumes"), [PROJECTED_TOKEN], "only emptyDir"),
        (("spec", "volumes"), [{"name": "d", "downwardAPI": {"items": [{"path": "l", "fieldRef": {
            "fieldPath": "metadata.labels"}}]}}], "only emptyDir"),
        (("spec", "volumes"), [{"name": "c", "configMap": {"name": "other-job"}}], "only emptyDir"),
        (("spec", "containers", 0, "env"), [SECRET_ENV], "literal values only"),
        (("spec", "containers", 0, "env"), [CONFIGMAP_ENV], "literal values only"),
        (("spec", "containers", 0, "envFrom"), [{"secretRef": {"name": "other-buffer-token"}}], "literal values only"),
        (("spec", "containers", 0, "envFrom"), [{"configMapRef": {"name": "other-job"}}], "literal values only"),
        (("spec", "initContainers"), [{"name": "i", "image": "x", "env": [SECRET_ENV], "securityContext": {
            "allowPrivilegeEscalation": False}}], "literal values only"),
        # Root and unconfined, at either level (a container's securityContext overrides the pod's).
        (("spec", "securityContext", "runAsNonRoot"), False, "runAsNonRoot"),
        (("spec", "securityContext", "runAsUser"), 0, "runAsUser: 0"),
        (("spec", "containers", 0, "securityContext", "runAsNonRoot"), False, "runAsNonRoot: false"),
        (("spec", "containers", 0, "securityContext", "runAsUser"), 0, "runAsUser: 0"),
        (("spec", "securityContext", "seccompProfile"), {"type": "Unconfined"}, "seccomp profile"),
        (("spec", "containers", 0, "securityContext", "seccompProfile"), {"type": "Unconfined"}, "Unconfined"),
        (("spec", "containers", 0, "securityContext", "appArmorProfile"), {"type": "Unconfined"}, "Unconfined"),
        (("spec", "containers", 0, "securityContext", "procMount"), "Unmasked", "unmask /proc"),
        (("spec", "containers", 0, "securityContext", "privileged"), True, "may not be privileged"),
        (("spec", "containers", 0, "securityContext", "allowPrivilegeEscalation"), True, "escalate"),
        (("spec", "containers", 0, "securityContext", "capabilities"), {"add": ["SYS_ADMIN"]}, "capabilities"),
        (("spec", "containers", 0, "ports"), [{"containerPort": 80, "hostPort": 80}], "host ports"),
        (("spec", "initContainers"), [{"name": "i", "image": "x", "securityContext": {"privileged": True}}],
         "may not be privileged"),
        # Placement: beside a learner, ahead of one, or under another runtime.
        (("spec", "nodeName"), "gke-tpu-v5p-node-0", "may not name their node"),
        (("spec", "tolerations"), [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}],
         "an accelerator's"),
        (("spec", "tolerations"), [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "present"}], "an accelerator's"),
        (("spec", "tolerations"), [{"operator": "Exists"}], "tolerate every taint"),
        (("spec", "priorityClassName"), "system-node-critical", "system-critical priority class"),
        (("spec", "runtimeClassName"), "runc-privileged", "runtime class other than gvisor"),
    ],
)
def test_anything_else_is_denied_at_creation(policy: dict[str, Any], path: tuple[str | int, ...], value: Any, why: str) -> None:
    denied = admit(policy, "CREATE", MANAGER, changed(path, value))
    assert denied and any(why in message for message in denied), denied


def test_what_mutating_admission_adds_and_gvisor_are_admitted(policy: dict[str, Any]) -> None:
    """DefaultTolerationSeconds adds keyed NoExecute tolerations, the Priority plugin a cluster's
    global default class; GKE Sandbox (gVisor) confines more than the default runtime."""
    pod = changed(("spec", "tolerations"), [
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
        {"key": "sandbox.gke.io/runtime", "operator": "Equal", "value": "gvisor", "effect": "NoSchedule"},
    ])
    pod = edit(edit(pod, ("spec", "priorityClassName"), "batch-default"), ("spec", "runtimeClassName"), "gvisor")
    assert admit(policy, "CREATE", MANAGER, pod) == []


def test_a_pod_without_a_seccomp_profile_is_denied(policy: dict[str, Any]) -> None:
    pod = sandbox()
    del pod["spec"]["securityContext"]["seccompProfile"]
    assert any("seccomp" in m for m in admit(policy, "CREATE", MANAGER, valid(pod)))


def test_takeover_by_relabelling_another_pod_is_denied(policy: dict[str, Any]) -> None:
    """The hole: one PATCH relabels another job's learner as this job's sandbox and swaps its
    image; were it admitted, a later DELETE of it would be too (it would look like a sandbox)."""
    victim = learner_pod("other")
    hijacked = edit(victim, ("metadata", "labels"), {"stoker.dev/job": "lake", "stoker.dev/role": "sandbox"})
    hijacked = edit(hijacked, ("spec", "containers", 0, "image"), "evil/miner:1")
    assert any("already were" in m for m in admit(policy, "UPDATE", MANAGER, hijacked, victim))
    relabelled_only = edit(victim, ("metadata", "labels"), {"stoker.dev/job": "lake", "stoker.dev/role": "sandbox"})
    assert admit(policy, "UPDATE", MANAGER, relabelled_only, victim)
    # The relabel was refused, so the pod the DELETE sees is still the other job's learner.
    assert admit(policy, "DELETE", MANAGER, None, victim)
    # Not even the job's own learner (a colocated learner's pod runs as the same account).
    own_learner = learner_pod("lake")
    assert admit(policy, "UPDATE", MANAGER, heartbeat(edit(own_learner, ("metadata", "labels", "stoker.dev/role"),
                                                            "sandbox")), own_learner)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("spec", "containers", 0, "image"), "evil/miner:1"),
        (("spec", "activeDeadlineSeconds"), 999999),
        (("spec", "tolerations"), [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]),
        (("metadata", "labels", "stoker.dev/actor"), "lake-actor-9"),  # hide it from its actor's reaping
        (("metadata", "labels", "stoker.dev/job"), "other"),  # hand it to another job
        (("metadata", "annotations", "example.com/anything"), "x"),
        (("metadata", "ownerReferences"), []),  # outlive the actor pod
        (("metadata", "finalizers"), ["example.com/keep"]),  # block deletion
    ],
)
def test_a_sandbox_may_change_only_its_heartbeat(policy: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    pod = sandbox()
    assert admit(policy, "UPDATE", MANAGER, heartbeat(edit(pod, path, value)), pod)


def test_other_jobs_pods_cannot_be_changed_or_deleted(policy: dict[str, Any]) -> None:
    other = sandbox(job="other")
    assert admit(policy, "DELETE", MANAGER, None, other)
    assert admit(policy, "UPDATE", MANAGER, heartbeat(other), other)
    # The other job's sandbox relabelled as ours: the old object decides.
    assert admit(policy, "UPDATE", MANAGER, edit(other, ("metadata", "labels", "stoker.dev/job"), "lake"), other)
    worker = changed(("metadata", "labels"), {"stoker.dev/job": "lake", "stoker.dev/role": "learner"})
    assert admit(policy, "DELETE", MANAGER, None, worker)  # not even its own job's other pods


def test_other_accounts_are_not_matched(policy: dict[str, Any]) -> None:
    """The operator, users and controllers are out of the policy's scope (RBAC governs them)."""
    anything = changed(("spec", "hostNetwork"), True)
    assert admit(policy, "CREATE", "system:serviceaccount:stoker-system:stoker", anything) == []
    assert admit(policy, "CREATE", "alice@example.com", anything) == []
    assert admit(policy, "UPDATE", "system:serviceaccount:research:other-learner", anything, learner_pod("other")) == []

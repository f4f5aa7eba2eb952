"""The sandbox admission policy, evaluated as the API server does (cel-python): match conditions,
then variables, then every validation. The actor's real sandbox pod passes; anything else a
sandbox manager (the account untrusted agent code can reach) tries is denied."""

from __future__ import annotations

import copy
from typing import Any

import celpy
import kubernetes_validate
import pytest

from stoker.actor.pods import sandbox_pod_manifest
from stoker.operator.sandbox_policy import sandbox_admission_policy

ENV = celpy.Environment()
MANAGER = "system:serviceaccount:research:lake-sandbox-manager"


def evaluate(expression: str, activation: dict[str, Any]) -> Any:
    return ENV.program(ENV.compile(expression)).evaluate(activation)


def admit(operation: str, user: str, obj: dict[str, Any] | None, old: dict[str, Any] | None = None) -> list[str]:
    """The messages of the validations that deny this request ([] = admitted)."""
    policy = sandbox_admission_policy()[0]["spec"]
    activation: dict[str, Any] = {
        "request": celpy.json_to_cel({"operation": operation, "namespace": "research", "userInfo": {"username": user}}),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
    }
    if not all(bool(evaluate(c["expression"], activation)) for c in policy["matchConditions"]):  # type: ignore[index]
        return []
    variables = {v["name"]: evaluate(v["expression"], activation) for v in policy["variables"]}  # type: ignore[index]
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    denied = []
    for validation in policy["validations"]:  # type: ignore[index]
        result = evaluate(validation["expression"], activation)
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):
            denied.append(validation["message"])
    return denied


def sandbox(job: str = "lake") -> dict[str, Any]:
    pod = sandbox_pod_manifest(name=f"{job}-sbx-1", namespace="research", job=job, actor_pod=f"{job}-actor-0",
                               image="stoker/actor:1", cpu_seconds=10, memory_mb=128, heartbeat_ttl_seconds=60)
    pod["spec"]["serviceAccountName"] = "default"  # the ServiceAccount admission plugin sets it first
    return pod


def changed(path: tuple[str | int, ...], value: Any) -> dict[str, Any]:
    pod = sandbox()
    node: Any = pod
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return pod


def test_policy_objects_are_valid_kubernetes() -> None:
    for namespaces in ((), ("team-a",)):
        for manifest in sandbox_admission_policy(namespaces):
            kubernetes_validate.validate(manifest, "1.33.0", strict=True)


def test_the_actors_own_sandbox_pod_is_admitted() -> None:
    pod = sandbox()
    assert admit("CREATE", MANAGER, pod) == []
    heartbeat = copy.deepcopy(pod)
    heartbeat["metadata"]["annotations"]["stoker.dev/heartbeat"] = "2026-01-01T00:00:00Z"
    assert admit("UPDATE", MANAGER, heartbeat, pod) == []
    assert admit("DELETE", MANAGER, None, pod) == []


@pytest.mark.parametrize(
    ("pod", "why"),
    [
        (changed(("metadata", "labels"), {"app": "miner"}), "only create, change and delete that job's sandbox"),
        (sandbox(job="other"), "only create, change and delete that job's sandbox"),
        (changed(("spec", "automountServiceAccountToken"), True), "automountServiceAccountToken"),
        (changed(("spec", "serviceAccountName"), "lake-sandbox-manager"), "default ServiceAccount"),
        (changed(("spec", "hostNetwork"), True), "host's network"),
        (changed(("spec", "hostPID"), True), "host's network, PID"),
        (changed(("spec", "volumes"), [{"name": "root", "hostPath": {"path": "/"}}]), "only emptyDir"),
        (changed(("spec", "volumes"), [{"name": "s", "secret": {"secretName": "lake-buffer-token"}}]), "only emptyDir"),
        (changed(("spec", "securityContext", "runAsNonRoot"), False), "runAsNonRoot"),
        (changed(("spec", "containers", 0, "securityContext", "privileged"), True), "may not be privileged"),
        (changed(("spec", "containers", 0, "securityContext", "allowPrivilegeEscalation"), True), "escalate"),
        (changed(("spec", "containers", 0, "securityContext", "capabilities"), {"add": ["SYS_ADMIN"]}), "capabilities"),
        (changed(("spec", "containers", 0, "ports"), [{"containerPort": 80, "hostPort": 80}]), "host ports"),
        (changed(("spec", "initContainers"), [{"name": "i", "image": "x", "securityContext": {"privileged": True}}]),
         "may not be privileged"),
    ],
)
def test_anything_else_is_denied(pod: dict[str, Any], why: str) -> None:
    denied = admit("CREATE", MANAGER, pod)
    assert denied and any(why in message for message in denied), denied


def test_other_jobs_pods_cannot_be_changed_or_deleted() -> None:
    other = sandbox(job="other")
    assert admit("DELETE", MANAGER, None, other)
    assert admit("UPDATE", MANAGER, other, other)
    worker = changed(("metadata", "labels"), {"stoker.dev/job": "lake", "stoker.dev/role": "learner"})
    assert admit("DELETE", MANAGER, None, worker)  # not even its own job's other pods


def test_other_accounts_are_not_matched() -> None:
    """The operator, users and controllers are out of the policy's scope (RBAC governs them)."""
    anything = changed(("spec", "hostNetwork"), True)
    assert admit("CREATE", "system:serviceaccount:stoker-system:stoker", anything) == []
    assert admit("CREATE", "alice@example.com", anything) == []

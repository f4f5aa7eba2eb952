"""The permissions ``stoker operator`` needs, as data: the one source of truth for RBAC.

The Helm chart renders its ClusterRole/Roles from ``OPERATOR_RULES`` and a test checks it does;
``tests/operator`` checks that every API request the running operator makes is allowed here.

* ``scope="cluster"`` rules are needed cluster-wide even when the operator watches only some
  namespaces (kopf discovers CRDs and namespaces); everything else may be granted per watched
  namespace with a Role, or cluster-wide with a ClusterRole for ``--all-namespaces``.
* ``peering=True`` rules are only needed without ``--standalone``.
* pods ``create``/``patch`` are never used by the operator itself: Kubernetes only lets it grant
  the actors' Role (create/patch/delete sandbox pods) if it holds those verbs, and the operator
  holds no ``escalate``/``bind``.
* Secrets: ``create`` (the generated buffer token) and ``get`` (to read it for the buffer's Stats
  call); no ``list``/``watch``, so the operator cannot enumerate the namespace's secrets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Scope = Literal["cluster", "namespace"]


@dataclass(frozen=True)
class Rule:
    api_group: str
    """"" is the core group."""
    resource: str
    """Plural resource, with ``/subresource`` where that is what is granted (``rljobs/status``)."""
    verbs: tuple[str, ...]
    why: str
    scope: Scope = "namespace"
    peering: bool = False


# The verbs the actors' (or colocated learner's) Role grants on pods: create sandbox pods,
# annotate their heartbeat, delete them, and find their IPs.
SANDBOX_MANAGER_POD_VERBS: tuple[str, ...] = ("create", "delete", "get", "list", "watch", "patch")

OPERATOR_RULES: tuple[Rule, ...] = (
    # kopf itself
    Rule("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), "kopf resource discovery", "cluster"),
    Rule("", "namespaces", ("list", "watch"), "kopf namespace discovery", "cluster"),
    Rule("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch"), "kopf peering (cluster-wide)", "cluster", True),
    Rule("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch"), "kopf peering (per namespace)", peering=True),
    Rule("", "events", ("create",), "Events on RLJobs (scaling, reaping, errors)"),
    # the custom resource
    Rule("stoker.dev", "rljobs", ("get", "list", "watch", "patch"), "watch RLJobs; kopf's finalizer and progress annotations"),
    Rule("stoker.dev", "rljobs/status", ("get", "patch"), "write RLJob status"),
    # children
    Rule("", "configmaps", ("get", "create", "patch", "delete"), "the job file and the buffer's admission control"),
    Rule("", "secrets", ("get", "create"), "the generated buffer token (create once, read for Stats)"),
    Rule("", "services", ("get", "create", "patch", "delete"), "the buffer's Service; the learner's headless Service"),
    Rule("", "serviceaccounts", ("get", "create"), "the sandbox manager's ServiceAccount"),
    Rule("", "persistentvolumeclaims", ("get", "create"), "the buffer's log volume"),
    Rule("", "pods", ("get", "list", "watch", "delete", *("create", "patch")), "index and reap sandbox pods; grant actors"),
    Rule("apps", "deployments", ("get", "create", "patch", "delete"), "actors and buffer"),
    Rule("batch", "jobs", ("get", "create", "delete"), "the learner without JobSet (Indexed Jobs)"),
    Rule("jobset.x-k8s.io", "jobsets", ("get", "create", "delete"), "the learner (JobSet)"),
    Rule("rbac.authorization.k8s.io", "roles", ("get", "create", "patch"), "the sandbox manager's Role"),
    Rule("rbac.authorization.k8s.io", "rolebindings", ("get", "create", "patch"), "the sandbox manager's RoleBinding"),
    Rule("networking.k8s.io", "networkpolicies", ("get", "create", "patch"), "sandbox isolation"),
)


def allows(api_group: str, resource: str, verb: str, *, standalone: bool = False) -> bool:
    """Whether ``OPERATOR_RULES`` grant ``verb`` on ``api_group``/``resource``."""
    return any(
        rule.api_group == api_group and rule.resource == resource and verb in rule.verbs
        for rule in OPERATOR_RULES
        if not (standalone and rule.peering)
    )


def policy_rules(scope: Scope | None = None, *, standalone: bool = False) -> list[dict[str, list[str]]]:
    """``OPERATOR_RULES`` as Kubernetes PolicyRules (for a ClusterRole/Role), one per resource."""
    return [
        {"apiGroups": [rule.api_group], "resources": [rule.resource], "verbs": sorted(set(rule.verbs))}
        for rule in OPERATOR_RULES
        if (scope is None or rule.scope == scope) and not (standalone and rule.peering)
    ]


# RBAC cannot scope the actors' pod verbs by label. This cluster-wide admission policy does: a
# job's sandbox manager ServiceAccount (``<job>-sandbox-manager``) may create, change and delete
# only pods labelled as that job's sandboxes. Static (one per cluster, any number of jobs), so it
# ships with the Helm chart rather than being created by the operator (which holds no
# cluster-scoped write access).
SANDBOX_POLICY_NAME = "stoker-sandbox-pods"
_MANAGER = "request.userInfo.username"
_SANDBOX_RULE = (
    "has(variables.pod.metadata.labels)"
    " && 'stoker.dev/role' in variables.pod.metadata.labels"
    " && variables.pod.metadata.labels['stoker.dev/role'] == 'sandbox'"
    " && 'stoker.dev/job' in variables.pod.metadata.labels"
    f" && {_MANAGER} == 'system:serviceaccount:' + request.namespace + ':'"
    " + variables.pod.metadata.labels['stoker.dev/job'] + '-sandbox-manager'"
)


def sandbox_admission_policy() -> list[dict[str, object]]:
    """ValidatingAdmissionPolicy + binding confining sandbox managers to their own sandboxes."""
    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": SANDBOX_POLICY_NAME},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "resourceRules": [
                        {
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "operations": ["CREATE", "UPDATE", "DELETE"],
                            "resources": ["pods"],
                        }
                    ]
                },
                "matchConditions": [
                    {
                        "name": "is-a-sandbox-manager",
                        "expression": f"{_MANAGER}.startsWith('system:serviceaccount:')"
                        f" && {_MANAGER}.endsWith('-sandbox-manager')",
                    }
                ],
                "variables": [{"name": "pod", "expression": "request.operation == 'DELETE' ? oldObject : object"}],
                "validations": [
                    {
                        "expression": _SANDBOX_RULE,
                        "message": "a job's sandbox manager may only create, change and delete that job's sandbox pods",
                        "reason": "Forbidden",
                    }
                ],
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": SANDBOX_POLICY_NAME},
            "spec": {"policyName": SANDBOX_POLICY_NAME, "validationActions": ["Deny"]},
        },
    ]

"""The permissions ``stoker operator`` needs, as data: the one source of truth for RBAC.

The Helm chart renders its ClusterRole/Roles from ``OPERATOR_RULES`` and a test checks it does;
``tests/operator`` checks that every API request the running operator makes is allowed here.

* ``scope="cluster"`` rules are needed cluster-wide even when the operator watches only some
  namespaces (kopf discovers CRDs and namespaces); everything else may be granted per watched
  namespace with a Role, or cluster-wide with a ClusterRole for ``--all-namespaces``.
* ``peering=True`` rules are only needed without ``--standalone``.
* pods ``create``/``get``/``patch`` are never used by the operator itself: Kubernetes only lets it
  grant the actors' Role (create/patch/delete sandbox pods) if it holds those verbs, and the
  operator holds no ``escalate``/``bind``.
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
# Pod verbs the operator never calls itself, held only so it may grant them in that Role.
GRANTED_ONLY_POD_VERBS: tuple[str, ...] = ("create", "get", "patch")

OPERATOR_RULES: tuple[Rule, ...] = (
    # kopf itself
    Rule("apiextensions.k8s.io", "customresourcedefinitions", ("list", "watch"), "kopf resource discovery", "cluster"),
    Rule("", "namespaces", ("list", "watch"), "kopf namespace discovery", "cluster"),
    Rule("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch"), "kopf peering (cluster-wide)", "cluster", True),
    Rule("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch"), "kopf peering (per namespace)", peering=True),
    Rule("", "events", ("create",), "Events on RLJobs (scaling, reaping, errors)"),
    # the custom resource
    Rule("stoker.dev", "rljobs", ("list", "watch", "patch"), "watch RLJobs; kopf's finalizer and progress annotations"),
    Rule("stoker.dev", "rljobs/status", ("patch",), "write RLJob status"),
    # OwnerReferencesPermissionEnforcement (OpenShift, hardened clusters): a child whose owner
    # reference sets blockOwnerDeletion may only be created by who may update the owner's finalizers.
    Rule("stoker.dev", "rljobs/finalizers", ("update",), "children's blockOwnerDeletion owner references"),
    # children: create (409 means it exists), patch back to the spec, get what is observed,
    # delete what suspend and reaping remove; tests/operator/test_rbac.py derives these verbs
    # from the code paths and fails on any verb more or less.
    Rule("", "configmaps", ("get", "create", "patch"), "the job file (read back after a refused edit) and the buffer's admission control"),
    Rule("", "secrets", ("get", "create"), "the generated buffer token (create once, read for Stats)"),
    Rule("", "services", ("create", "patch", "delete"), "the buffer's Service; the learner's headless Service; the rollout tier's"),
    Rule("", "serviceaccounts", ("create",), "the sandbox manager's ServiceAccount"),
    Rule("", "persistentvolumeclaims", ("create",), "the buffer's log volume; a single-host learner's run volume"),
    Rule("", "pods", ("list", "watch", "delete", *GRANTED_ONLY_POD_VERBS), "index and reap sandbox pods; grant actors"),
    Rule("apps", "deployments", ("get", "create", "patch", "delete"), "actors, buffer and single-host rollout servers (deleted with spec.rollout)"),
    Rule("batch", "jobs", ("get", "create", "delete"), "the learner without JobSet (Indexed Jobs)"),
    Rule("jobset.x-k8s.io", "jobsets", ("get", "list", "create", "delete"), "the learner; one per multi-host rollout server (listed to scale)"),
    Rule("rbac.authorization.k8s.io", "roles", ("create", "patch"), "the sandbox manager's Role"),
    Rule("rbac.authorization.k8s.io", "rolebindings", ("create", "patch"), "the sandbox manager's RoleBinding"),
    Rule("networking.k8s.io", "networkpolicies", ("create", "patch"), "sandbox isolation"),
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

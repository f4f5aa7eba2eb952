"""The RBAC table is complete for what the operator does, and grants no escalation paths."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from stoker.operator import rbac
from stoker.operator.bufferstats import StatsReader
from stoker.operator.kube import Conflict, NotFound, Resource, resource_of
from stoker.operator.reconcile import (
    Runtime,
    apply_admission,
    apply_children,
    applied_spec,
    observe_children,
    reap_pods,
    remove_learner,
    sync_actor_replicas,
)
from stoker.operator.rollout_tier import observe_rollout, sync_rollout
from stoker.operator.sandbox_policy import sandbox_admission_policy
from stoker.operator.children import desired_children
from stoker.operator.kube import RESOURCES
from stoker.operator.manifests import JobContext, build_sandbox_manager_account
from stoker.operator.settings import OperatorSettings
from stoker.spec import RLJobSpec


def ctx(**spec: object) -> JobContext:
    return JobContext("job", "ns", "uid", RLJobSpec.model_validate(spec), OperatorSettings(), actor_replicas=2)


class RecordingKube:
    """An in-memory API server that records (group, resource, verb) of every call."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.calls: set[tuple[str, str, str]] = set()

    def _key(self, res: Resource, namespace: str, name: str) -> tuple[str, str, str]:
        return (res.api_version + "/" + res.plural, namespace, name)

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        res = resource_of(obj["apiVersion"], obj["kind"])
        self.calls.add((res.group, res.plural, "create"))
        key = self._key(res, obj["metadata"]["namespace"], obj["metadata"]["name"])
        if key in self.objects:
            raise Conflict("exists")
        self.objects[key] = obj
        return obj

    def get(self, res: Resource, namespace: str, name: str) -> dict[str, Any]:
        self.calls.add((res.group, res.plural, "get"))
        if self._key(res, namespace, name) not in self.objects:
            raise NotFound(name)
        return self.objects[self._key(res, namespace, name)]

    def patch(self, res: Resource, namespace: str, name: str, patch: dict[str, Any], subresource: str | None = None) -> dict[str, Any]:
        self.calls.add((res.group, res.plural, "patch"))
        obj = self.objects[self._key(res, namespace, name)]
        obj.update(patch)  # top-level merge: all these tests read back
        return obj

    def delete(self, res: Resource, namespace: str, name: str, *, propagation: str = "Background") -> None:
        self.calls.add((res.group, res.plural, "delete"))
        if self.objects.pop(self._key(res, namespace, name), None) is None:
            raise NotFound(name)

    def list(self, res: Resource, namespace: str, label_selector: str | None = None) -> list[dict[str, Any]]:
        self.calls.add((res.group, res.plural, "list"))
        prefix = res.api_version + "/" + res.plural
        return [obj for (kind, ns, _), obj in self.objects.items() if kind == prefix and ns == namespace]


def operator_calls() -> set[tuple[str, str, str]]:
    """What the operator's own code paths call, over every shape of job: create and re-apply
    (conflict -> patch), observe, read the token, tighten admission, scale, suspend, reap."""
    kube = RecordingKube()
    runtime = Runtime(OperatorSettings(), kube, StatsReader(timeout=0.1))  # type: ignore[arg-type]
    shapes = [ctx(), ctx(learner={"accelerator": "tpu-v6e-slice", "topology": "4x4"}), ctx(mode="colocated"),
              ctx(buffer={"authSecretRef": {"name": "mine"}})]
    shapes += [replace(c, jobset_api=False) for c in shapes]
    for job in shapes:
        apply_children(kube, job, patch_existing=True, logger=logging.getLogger("test"))  # type: ignore[arg-type]
        apply_children(kube, job, patch_existing=True, logger=logging.getLogger("test"))  # type: ignore[arg-type]
        children = observe_children(kube, job, jobset_api=job.jobset_api)  # type: ignore[arg-type]
        runtime.token(job.namespace, *job.token_secret)
        if job.disaggregated:
            apply_admission(kube, job)  # type: ignore[arg-type]
            sync_actor_replicas(kube, job, children.actors, 5)  # type: ignore[arg-type]
        remove_learner(kube, job, jobset_api=job.jobset_api)  # type: ignore[arg-type]
        assert applied_spec(kube, job.namespace, job.name) == job.spec  # type: ignore[arg-type]  # a refused edit
    # The rollout tier, each shape: created, observed and scaled by the timer, then removed with spec.rollout.
    for rollout in ({}, {"accelerator": "tpu-v5p-slice", "topology": "2x2x4"}):
        job = replace(ctx(rollout=rollout), rollout_replicas=2)
        apply_children(kube, job, patch_existing=True, logger=logging.getLogger("test"))  # type: ignore[arg-type]
        sync_rollout(kube, replace(job, rollout_replicas=1), observe_rollout(kube, job))  # type: ignore[arg-type]
        gone = replace(job, spec=job.spec.model_copy(update={"rollout": None}))
        sync_rollout(kube, gone, observe_rollout(kube, gone))  # type: ignore[arg-type]
    kube.create({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "sbx", "namespace": "ns"}})
    kube.calls.discard(("", "pods", "create"))  # the test's own sandbox pod
    reap_pods(kube, "ns", ["sbx"])  # type: ignore[arg-type]
    return kube.calls


def test_rbac_verbs_are_exactly_what_the_code_calls() -> None:
    """Every child verb in the table is called by some code path and every call is granted:
    nothing granted "just in case" (the issue found configmaps/deployments delete and nine gets)."""
    called = operator_calls()
    kopf_and_grants = {("", "pods", "list"), ("", "pods", "watch")}  # the pod index (kopf)
    kopf_and_grants |= {("", "pods", verb) for verb in rbac.GRANTED_ONLY_POD_VERBS}
    children = {(r.group, r.plural) for r in RESOURCES.values()} - {("stoker.dev", "rljobs")}
    table = {(rule.api_group, rule.resource, verb) for rule in rbac.OPERATOR_RULES for verb in rule.verbs
             if (rule.api_group, rule.resource) in children}
    missing, surplus = called - table, table - called - kopf_and_grants
    assert not missing and not surplus, f"missing {sorted(missing)}, surplus {sorted(surplus)}"
    assert set(rbac.GRANTED_ONLY_POD_VERBS) == set(rbac.SANDBOX_MANAGER_POD_VERBS) - {v for g, r, v in called if r == "pods"} - {"list", "watch"}


def test_owner_references_that_block_deletion_have_the_finalizers_permission() -> None:
    """OwnerReferencesPermissionEnforcement refuses a child with blockOwnerDeletion unless its
    creator may update the owner's finalizers subresource."""
    for child in desired_children(ctx()):
        for owner in child["metadata"]["ownerReferences"]:
            if owner.get("blockOwnerDeletion"):
                plural = next(r.plural for (v, k), r in RESOURCES.items() if (v, k) == (owner["apiVersion"], owner["kind"]))
                group = owner["apiVersion"].split("/")[0] if "/" in owner["apiVersion"] else ""
                assert rbac.allows(group, f"{plural}/finalizers", "update"), child["kind"]


def test_actor_role_is_grantable_without_escalate() -> None:
    """Kubernetes only lets the operator create a Role granting verbs the operator itself holds."""
    role = build_sandbox_manager_account(ctx())[1]
    for rule in role["rules"]:
        for resource in rule["resources"]:
            for verb in rule["verbs"]:
                assert rbac.allows(rule["apiGroups"][0], resource, verb), (resource, verb)


def test_no_dangerous_grants() -> None:
    for rule in rbac.OPERATOR_RULES:
        assert not {"escalate", "bind", "impersonate", "*"} & set(rule.verbs), rule
        assert rule.resource not in ("pods/exec", "*"), rule
        if rule.resource == "secrets":
            assert not {"list", "watch"} & set(rule.verbs)  # cannot enumerate the namespace's secrets


def test_policy_rules_shape_and_peering() -> None:
    rules = rbac.policy_rules()
    assert all(set(r) == {"apiGroups", "resources", "verbs"} for r in rules)
    assert any(r["resources"] == ["kopfpeerings"] for r in rules)
    assert not any("kopfpeerings" in r["resources"][0] for r in rbac.policy_rules(standalone=True))
    cluster = rbac.policy_rules("cluster", standalone=True)
    assert {r["resources"][0] for r in cluster} == {"customresourcedefinitions", "namespaces"}


def test_sandbox_admission_policy_is_valid_and_names_the_managers() -> None:
    import kubernetes_validate

    policy, binding = sandbox_admission_policy()
    for manifest in (policy, binding):
        kubernetes_validate.validate(manifest, "1.37.0", strict=True)
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]  # type: ignore[index]
    # The ServiceAccount the policy confines is the one the operator gives actors.
    account = build_sandbox_manager_account(ctx())[0]
    assert account["metadata"]["name"] == "job-sandbox-manager"
    assert "'-sandbox-manager'" in str(policy["spec"])  # type: ignore[index]


def test_patch_is_granted_only_on_children_the_operator_patches() -> None:
    """Nothing more than used: a child kind gets `patch` exactly when reconcile patches it."""
    from stoker.operator.reconcile import PATCHABLE_FIELDS

    kinds = {(m["apiVersion"], m["kind"]) for m in desired_children(ctx())}
    kinds |= {(m["apiVersion"], m["kind"]) for m in desired_children(ctx(learner={"numSlices": 1}))}
    for api_version, kind in kinds:
        res = RESOURCES[(api_version, kind)]
        assert rbac.allows(res.group, res.plural, "patch") == bool(PATCHABLE_FIELDS[kind]), kind

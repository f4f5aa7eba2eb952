"""The RBAC table is complete for what the operator does, and grants no escalation paths."""

from __future__ import annotations

from stoker.operator import rbac
from stoker.operator.children import desired_children
from stoker.operator.kube import RESOURCES
from stoker.operator.manifests import JobContext, build_sandbox_manager_account
from stoker.operator.settings import OperatorSettings
from stoker.spec import RLJobSpec


def ctx(**spec: object) -> JobContext:
    return JobContext("job", "ns", "uid", RLJobSpec.model_validate(spec), OperatorSettings(), actor_replicas=2)


def test_every_child_kind_can_be_created_read_and_patched() -> None:
    kinds = {(m["apiVersion"], m["kind"]) for m in desired_children(ctx())}
    kinds |= {(m["apiVersion"], m["kind"]) for m in desired_children(ctx(learner={"numSlices": 1}))}
    for api_version, kind in kinds:
        res = RESOURCES[(api_version, kind)]
        for verb in ("create", "get"):
            assert rbac.allows(res.group, res.plural, verb), (kind, verb)


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

    policy, binding = rbac.sandbox_admission_policy()
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

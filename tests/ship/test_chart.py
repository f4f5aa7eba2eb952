"""The Helm chart, rendered and linted by the real Helm SDK (helm-python-sdk, no helm binary).

What a user relies on: `helm install` accepts the defaults and the documented alternatives, every
object it creates is valid for the Kubernetes API, the operator gets exactly the permissions its
code uses, the CRD is the generated one, and bad values are refused with the key named.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from kubernetes_validate import utils as kube_validate

from stoker.cli import build_parser
from stoker.crd import render_crd
from stoker.operator.cli import settings_from_args
from stoker.operator.rbac import OPERATOR_RULES
from stoker.operator.sandbox_policy import SANDBOX_POLICY_NAME, sandbox_admission_policy
from stoker.operator.settings import OperatorSettings

KUBE_VERSION = "1.33.0"
RELEASE, NAMESPACE = "stoker", "stoker-system"

# Values a user is told about in values.yaml and docs/install.md, beyond the defaults.
NAMESPACED: dict[str, Any] = {"watch": {"allNamespaces": False, "namespaces": ["team-a", "team-b"]}}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "namespaced": NAMESPACED,
    "customised": {
        **NAMESPACED,
        "image": {"repository": "registry.example.com/stoker/actor", "digest": "sha256:" + "a" * 64},
        "jobImages": {"learner": {"repository": "registry.example.com/stoker/learner", "tag": "v2"}},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccount": {"create": True, "name": "rl-operator", "annotations": {"iam.gke.io/gcp-service-account": "x@p.iam.gserviceaccount.com"}},
        "metrics": {"enabled": False},
        "operator": {"logFormat": "text", "verbose": True, "statusInterval": 5, "storageClass": "premium-rwo", "extraEnv": [{"name": "TZ", "value": "UTC"}]},
        "nodeSelector": {"cloud.google.com/gke-nodepool": "system"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "system", "effect": "NoSchedule"}],
        "priorityClassName": "system-cluster-critical",
        "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        "resources": {"requests": {"cpu": "200m", "memory": "512Mi"}, "limits": {"cpu": 2, "memory": "1Gi"}},
    },
    "external-rbac": {"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "preexisting"}},
    "service-monitor": {"metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}}},
}
# Kinds from CRDs kubernetes-validate has no schema for; their wiring is tested on its own.
NOT_IN_KUBERNETES = {"monitoring.coreos.com/v1"}

# kopf lists/watches namespaces only when given a list of them; cluster-wide it never does
# (kopf/_core/reactor/observation.py), so the cluster-wide install leaves that rule out.
NAMESPACE_DISCOVERY = ("", "namespaces")
FORBIDDEN_VERBS = {"*", "escalate", "bind", "impersonate"}

Grant = tuple[str, str, str]  # (api group, resource, verb)


def render(chart: helm.Chart, values: dict[str, Any]) -> dict[str, str]:
    chart.validate_schema(values)
    return chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def expand(rules: Iterable[tuple[str, str, Iterable[str]]]) -> set[Grant]:
    return {(group, resource, verb) for group, resource, verbs in rules for verb in verbs}


def operator_rules(scope: str | None = None) -> list[tuple[str, str, tuple[str, ...]]]:
    """The operator's permission table (operator/rbac.py; tests/operator check its API calls
    against it), without kopf's peering rules: the chart runs the operator --standalone."""
    return [
        (rule.api_group, rule.resource, rule.verbs)
        for rule in OPERATOR_RULES
        if not rule.peering and (scope is None or rule.scope == scope)
    ]


def granted(docs: list[dict[str, Any]], account: str, account_ns: str) -> dict[str, set[Grant]]:
    """What the ServiceAccount may do: {"cluster" or a namespace: grants}, following bindings."""
    roles = {(d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d for d in docs if d["kind"] in ("Role", "ClusterRole")}
    out: dict[str, set[Grant]] = {}
    for binding in (d for d in docs if d["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account and s["namespace"] == account_ns for s in binding["subjects"]):
            continue
        ref = binding["roleRef"]
        role_ns = binding["metadata"]["namespace"] if ref["kind"] == "Role" else None
        role = roles[(ref["kind"], role_ns, ref["name"])]
        scope = "cluster" if binding["kind"] == "ClusterRoleBinding" else binding["metadata"]["namespace"]
        rules = [(g, r, rule["verbs"]) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]]
        out.setdefault(scope, set()).update(expand(rules))
    return out


def table_as_yaml(grants: set[Grant]) -> str:
    by_resource: dict[tuple[str, str], list[str]] = {}
    for group, resource, verb in sorted(grants):
        by_resource.setdefault((group, resource), []).append(verb)
    return "\n".join(f"  {g or 'core'}/{r}: {v}" for (g, r), v in by_resource.items())


# ------------------------------------------------------------------------------ render and lint


@pytest.mark.parametrize("name", VALUE_SETS)
def test_chart_lints_clean_in_strict_mode(chart_dir: Path, name: str) -> None:
    report = helm.lint(chart_dir, VALUE_SETS[name], strict=True, kube_version=f"v{KUBE_VERSION}", namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 2 = warning, 3 = error; only the "icon is recommended" info note is tolerated.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_rendered_object_validates_against_kubernetes_schemas(chart: helm.Chart, name: str) -> None:
    docs = objects(render(chart, VALUE_SETS[name]))
    assert docs, "the chart rendered nothing"
    for doc in docs:
        if doc["apiVersion"] in NOT_IN_KUBERNETES:
            continue
        try:
            kube_validate.validate(doc, KUBE_VERSION, strict=True)
        except kube_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}")


def test_schema_validator_catches_a_misspelt_field(chart: helm.Chart) -> None:
    """Guards the test above: strict validation really rejects what the API server would."""
    deployment = one(objects(render(chart, {})), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kube_validate.ValidationError):
        kube_validate.validate(deployment, KUBE_VERSION, strict=True)


def test_notes_tell_the_user_where_jobs_run(chart: helm.Chart) -> None:
    notes = render(chart, NAMESPACED)["stoker/templates/NOTES.txt"]
    assert "team-a, team-b" in notes
    assert "kubectl apply --server-side" in notes  # CRD upgrades are the user's job under Helm
    assert "every namespace" in render(chart, {})["stoker/templates/NOTES.txt"]


# ------------------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    ("values", "named"),
    [
        ({"imge": {"repository": "x"}}, "imge"),
        ({"watch": {"allNamespaces": False, "namespaces": []}}, "namespaces"),
        ({"watch": {"allNamespaces": False, "namespaces": ["Team_A"]}}, "namespaces"),
        ({"securityContext": {"readOnlyRootFilesystem": False, "allowPrivilegeEscalation": False}}, "readOnlyRootFilesystem"),
        ({"podSecurityContext": {"runAsNonRoot": False}}, "runAsNonRoot"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"metrics": {"port": 70000}}, "port"),
        ({"metrics": {"serviceMonitor": {"interval": "soon"}}}, "interval"),
        ({"operator": {"logFormat": "xml"}}, "logFormat"),
        ({"operator": {"statusInterval": 0}}, "statusInterval"),
        ({"resources": {"limits": {"memory": "lots"}}}, "memory"),
    ],
)
def test_schema_refuses_bad_values_and_names_the_key(chart: helm.Chart, values: dict[str, Any], named: str) -> None:
    with pytest.raises(helm.HelmValuesError, match=named):
        chart.validate_schema(values)


def test_every_default_value_is_documented_in_the_schema(chart: helm.Chart) -> None:
    schema = chart.schema
    assert schema is not None

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        for key, value in values.items():
            assert key in node.get("properties", {}), f"values.yaml key {path}{key} is missing from values.schema.json"
            child = node["properties"][key]
            # Open objects (securityContext, affinity) take any Kubernetes field; closed ones recurse.
            if isinstance(value, dict) and child.get("additionalProperties") is False:
                walk(value, child, f"{path}{key}.")

    walk(chart.values, schema, "")


# ------------------------------------------------------------------------------------ the CRD


def test_chart_crd_is_the_generated_crd_not_a_copy(chart: helm.Chart, chart_dir: Path, repo: Path) -> None:
    link = chart_dir / "crds" / "rljob.yaml"
    assert link.is_symlink(), "helm/stoker/crds/rljob.yaml must link to crds/rljob.yaml (one source)"
    assert link.resolve() == (repo / "crds" / "rljob.yaml").resolve()
    [crd] = chart.crds
    kube_validate.validate(yaml.safe_load(crd["data"]), KUBE_VERSION, strict=True)
    assert crd["data"] == render_crd(), "crds/rljob.yaml is stale: run `stoker crd --write`"


def test_packaged_chart_carries_the_crd_itself(chart_dir: Path, repo: Path, tmp_path: Path) -> None:
    """`helm package` follows the symlink, so a published chart holds the CRD's content."""
    archive = helm.package(chart_dir, destination=tmp_path)
    with helm.Chart.load(archive) as packaged:
        assert [c["data"] for c in packaged.crds] == [(repo / "crds" / "rljob.yaml").read_text()]


# ------------------------------------------------------------------------------ the Deployment


@pytest.mark.parametrize("name", ["defaults", "customised"])
def test_operator_pod_is_locked_down(chart: helm.Chart, name: str) -> None:
    pod = one(objects(render(chart, VALUE_SETS[name])), "Deployment")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert {"cpu", "memory"} <= set(container["resources"]["requests"]) and {"cpu", "memory"} <= set(container["resources"]["limits"])
    # A read-only root needs a writable /tmp, and HOME pointing at it.
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "HOME", "value": "/tmp"} in container["env"]


def test_probes_hit_kopfs_liveness_endpoint(chart: helm.Chart) -> None:
    [container] = one(objects(render(chart, {"health": {"port": 8181}})), "Deployment")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert ports["health"] == 8181
    assert "--liveness=http://0.0.0.0:8181/healthz" in container["args"]


def test_metrics_service_reaches_the_metrics_port(chart: helm.Chart) -> None:
    docs = objects(render(chart, {}))
    deployment, service = one(docs, "Deployment"), one(docs, "Service")
    template = deployment["spec"]["template"]
    [container] = template["spec"]["containers"]
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert deployment["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    [port] = service["spec"]["ports"]
    assert port["targetPort"] in {p["name"] for p in container["ports"]}
    assert not [d for d in objects(render(chart, {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True}}})) if d["kind"] in ("Service", "ServiceMonitor")]


def test_service_monitor_scrapes_the_metrics_service(chart: helm.Chart) -> None:
    docs = objects(render(chart, VALUE_SETS["service-monitor"]))
    service, monitor = one(docs, "Service"), one(docs, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"]["matchNames"] == [service["metadata"]["namespace"]]
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert not [d for d in objects(render(chart, {})) if d["kind"] == "ServiceMonitor"], "off by default"


def test_single_operator_never_overlaps_another(chart: helm.Chart) -> None:
    spec = one(objects(render(chart, {})), "Deployment")["spec"]
    assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate"
    assert "--standalone" in spec["template"]["spec"]["containers"][0]["args"]


def operator_settings(container: dict[str, Any]) -> OperatorSettings:
    """What the operator would run with, parsed from the pod's command by the real CLI."""
    assert container["command"] == ["stoker", "operator"]
    argv = [*container["command"][1:], *container["args"]]
    parsed = build_parser(argv).parse_args(argv)  # argparse exits (SystemExit) on an unknown flag
    assert parsed.command == "operator"
    return settings_from_args(parsed)


@pytest.mark.parametrize(("name", "clusterwide", "namespaces"), [("defaults", True, ()), ("namespaced", False, ("team-a", "team-b"))])
def test_operator_command_is_accepted_by_the_real_cli(chart: helm.Chart, name: str, clusterwide: bool, namespaces: tuple[str, ...]) -> None:
    [container] = one(objects(render(chart, VALUE_SETS[name])), "Deployment")["spec"]["template"]["spec"]["containers"]
    settings = operator_settings(container)
    assert (settings.all_namespaces, settings.namespaces, settings.standalone) == (clusterwide, namespaces, True)


def test_job_image_defaults_reach_the_operator(chart: helm.Chart) -> None:
    [container] = one(objects(render(chart, VALUE_SETS["customised"])), "Deployment")["spec"]["template"]["spec"]["containers"]
    settings = operator_settings(container)
    assert container["image"] == "registry.example.com/stoker/actor@sha256:" + "a" * 64
    assert settings.learner_image == "registry.example.com/stoker/learner:v2"
    assert settings.image == f"stoker/actor:{chart.metadata['appVersion']}"
    assert {"name": "TZ", "value": "UTC"} in container["env"]


def test_operator_settings_reach_the_operator(chart: helm.Chart) -> None:
    [container] = one(objects(render(chart, VALUE_SETS["customised"])), "Deployment")["spec"]["template"]["spec"]["containers"]
    settings = operator_settings(container)
    assert (settings.storage_class, settings.status_interval_seconds, settings.image_pull_policy) == ("premium-rwo", 5.0, "IfNotPresent")
    argv = [*container["command"][1:], *container["args"]]
    parsed = build_parser(argv).parse_args(argv)
    assert (parsed.log_format, parsed.verbose, parsed.metrics_port) == ("text", True, None)
    [default] = one(objects(render(chart, {})), "Deployment")["spec"]["template"]["spec"]["containers"]
    argv = [*default["command"][1:], *default["args"]]
    parsed = build_parser(argv).parse_args(argv)
    assert (parsed.log_format, parsed.verbose, parsed.metrics_port, parsed.liveness) == ("json", False, 9090, "http://0.0.0.0:8080/healthz")
    assert operator_settings(default).storage_class is None


# ----------------------------------------------------------------------------------------- RBAC


def test_cluster_wide_rbac_is_exactly_the_operators_table(chart: helm.Chart) -> None:
    docs = objects(render(chart, {}))
    grants = granted(docs, RELEASE, NAMESPACE)
    assert set(grants) == {"cluster"}, "cluster-wide mode binds one ClusterRole and no Roles"
    needed = expand(r for r in operator_rules() if (r[0], r[1]) != NAMESPACE_DISCOVERY)
    missing, surplus = needed - grants["cluster"], grants["cluster"] - needed
    assert not missing and not surplus, f"missing:\n{table_as_yaml(missing)}\nsurplus:\n{table_as_yaml(surplus)}"


def test_namespaced_rbac_grants_the_table_only_in_watched_namespaces(chart: helm.Chart) -> None:
    docs = objects(render(chart, NAMESPACED))
    grants = granted(docs, RELEASE, NAMESPACE)
    assert set(grants) == {"cluster", "team-a", "team-b"}
    cluster_needed, namespaced_needed = expand(operator_rules("cluster")), expand(operator_rules("namespace"))
    assert grants["cluster"] == cluster_needed, "cluster-wide, a namespaced operator may only discover CRDs and namespaces"
    for namespace in ("team-a", "team-b"):
        missing, surplus = namespaced_needed - grants[namespace], grants[namespace] - namespaced_needed
        assert not missing and not surplus, f"{namespace} missing:\n{table_as_yaml(missing)}\nsurplus:\n{table_as_yaml(surplus)}"


def test_operator_table_holds_no_dangerous_permission() -> None:
    grants = expand(operator_rules())
    assert not {g for g in grants if g[2] in FORBIDDEN_VERBS or g[1] in ("*", "pods/exec", "pods/attach")}
    # Secrets: the operator creates its buffer tokens and reads them by name; it never lists or
    # watches, so it cannot enumerate a namespace's secrets.
    assert not {"list", "watch"} & {v for g, r, v in grants if r == "secrets"}


@pytest.mark.parametrize("name", ["defaults", "namespaced"])
def test_no_rendered_role_grants_forbidden_verbs(chart: helm.Chart, name: str) -> None:
    for doc in objects(render(chart, VALUE_SETS[name])):
        for rule in doc.get("rules", []):
            assert not FORBIDDEN_VERBS & set(rule["verbs"]), rule
            assert not {"*", "pods/exec", "pods/attach"} & set(rule["resources"]), rule
            assert "*" not in rule["apiGroups"], rule


def test_rbac_disabled_renders_no_rbac_and_uses_the_given_account(chart: helm.Chart) -> None:
    docs = objects(render(chart, VALUE_SETS["external-rbac"]))
    assert not [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding", "ServiceAccount")]
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "preexisting"


# ---------------------------------------------------------------------- the sandbox admission policy


@pytest.mark.parametrize(("name", "namespaces"), [("defaults", ()), ("namespaced", ("team-a", "team-b"))])
def test_chart_ships_the_sandbox_admission_policy(chart: helm.Chart, name: str, namespaces: tuple[str, ...]) -> None:
    """Without it, a job's sandbox manager account (held by actors running agent code) may create
    any pod in its namespace. The chart renders exactly operator/sandbox_policy.py's policy (whose
    behaviour tests/operator/test_sandbox_policy.py checks), bound to the watched namespaces."""
    docs = objects(render(chart, VALUE_SETS[name]))
    policy, binding = one(docs, "ValidatingAdmissionPolicy"), one(docs, "ValidatingAdmissionPolicyBinding")
    expected_policy, expected_binding = sandbox_admission_policy(namespaces)
    for rendered, expected in ((policy, expected_policy), (binding, expected_binding)):
        assert rendered["apiVersion"] == "admissionregistration.k8s.io/v1"
        assert rendered["spec"] == expected["spec"]
        assert rendered["metadata"]["name"] == SANDBOX_POLICY_NAME
        kube_validate.validate(rendered, KUBE_VERSION, strict=True)
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]


def test_sandbox_policy_can_be_left_to_another_release(chart: helm.Chart) -> None:
    docs = objects(render(chart, {"sandboxPolicy": {"create": False, "name": SANDBOX_POLICY_NAME}}))
    assert not [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]

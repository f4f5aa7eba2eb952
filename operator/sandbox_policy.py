"""The cluster-wide admission policy that confines each job's sandbox manager to its sandboxes.

RBAC cannot scope the actors' pod verbs by label, and actors run untrusted agent code, so a
ValidatingAdmissionPolicy (Kubernetes 1.30+) does: a ``<job>-sandbox-manager`` ServiceAccount may
create, change and delete only pods labelled as that job's sandboxes, and may create them only
in the shape ``stoker.actor.pods.sandbox_pod_manifest`` builds: no API token, the namespace's
default account, no host namespaces, only ``emptyDir`` volumes, non-root, no privilege,
escalation or added capabilities. Static (one per cluster, any number of jobs), so the Helm chart
ships it (``templates/sandbox-policy.yaml``; tests/ship/test_chart.py checks it renders this) and
the operator, which holds no cluster-scoped write access, never creates it.
"""

from __future__ import annotations

SANDBOX_POLICY_NAME = "stoker-sandbox-pods"
_MANAGER = "request.userInfo.username"

_OWN_SANDBOX = (
    "has(variables.pod.metadata.labels)"
    " && 'stoker.dev/role' in variables.pod.metadata.labels"
    " && variables.pod.metadata.labels['stoker.dev/role'] == 'sandbox'"
    " && 'stoker.dev/job' in variables.pod.metadata.labels"
    f" && {_MANAGER} == 'system:serviceaccount:' + request.namespace + ':'"
    " + variables.pod.metadata.labels['stoker.dev/job'] + '-sandbox-manager'"
)

# Every container of the pod, init containers too (ephemeral ones need pods/ephemeralcontainers,
# which the sandbox manager's Role does not grant).
_CONTAINERS = "object.spec.containers + (has(object.spec.initContainers) ? object.spec.initContainers : [])"

# (name, CEL that must hold on CREATE, message): the sandbox pod's own lockdown.
SANDBOX_SHAPE: tuple[tuple[str, str, str], ...] = (
    (
        "no-token",
        "has(object.spec.automountServiceAccountToken) && object.spec.automountServiceAccountToken == false",
        "sandbox pods must set automountServiceAccountToken: false",
    ),
    (
        "default-account",
        "!has(object.spec.serviceAccountName) || object.spec.serviceAccountName == 'default'",
        "sandbox pods run as the namespace's default ServiceAccount",
    ),
    (
        "no-host-namespaces",
        "!(has(object.spec.hostNetwork) && object.spec.hostNetwork)"
        " && !(has(object.spec.hostPID) && object.spec.hostPID)"
        " && !(has(object.spec.hostIPC) && object.spec.hostIPC)",
        "sandbox pods may not use the host's network, PID or IPC namespace",
    ),
    (
        "emptydir-volumes-only",
        "!has(object.spec.volumes) || object.spec.volumes.all(v, has(v.emptyDir))",
        "sandbox pods may mount only emptyDir volumes",
    ),
    (
        "non-root",
        "has(object.spec.securityContext) && has(object.spec.securityContext.runAsNonRoot)"
        " && object.spec.securityContext.runAsNonRoot == true",
        "sandbox pods must set securityContext.runAsNonRoot: true",
    ),
    (
        "unprivileged-containers",
        f"({_CONTAINERS}).all(c, has(c.securityContext)"
        " && !(has(c.securityContext.privileged) && c.securityContext.privileged)"
        " && has(c.securityContext.allowPrivilegeEscalation) && c.securityContext.allowPrivilegeEscalation == false"
        " && !(has(c.securityContext.capabilities) && has(c.securityContext.capabilities.add)"
        " && c.securityContext.capabilities.add.size() > 0)"
        " && (!has(c.ports) || c.ports.all(p, !has(p.hostPort) || p.hostPort == 0)))",
        "sandbox containers may not be privileged, escalate privileges, add capabilities or use host ports",
    ),
)


def sandbox_admission_policy(namespaces: tuple[str, ...] = ()) -> list[dict[str, object]]:
    """ValidatingAdmissionPolicy + binding; the binding covers ``namespaces`` (every one when empty)."""
    validations: list[dict[str, str]] = [
        {
            "expression": _OWN_SANDBOX,
            "message": "a job's sandbox manager may only create, change and delete that job's sandbox pods",
            "reason": "Forbidden",
        }
    ]
    validations += [
        {"expression": f"request.operation != 'CREATE' || ({rule})", "message": message, "reason": "Forbidden"}
        for _, rule, message in SANDBOX_SHAPE
    ]
    binding: dict[str, object] = {"policyName": SANDBOX_POLICY_NAME, "validationActions": ["Deny"]}
    if namespaces:
        binding["matchResources"] = {
            "namespaceSelector": {
                "matchExpressions": [
                    {"key": "kubernetes.io/metadata.name", "operator": "In", "values": list(namespaces)}
                ]
            }
        }
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
                "validations": validations,
            },
        },
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": SANDBOX_POLICY_NAME},
            "spec": binding,
        },
    ]

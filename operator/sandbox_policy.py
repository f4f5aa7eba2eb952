"""The cluster-wide admission policy that confines each job's sandbox manager to its sandboxes.

RBAC cannot scope the actors' pod verbs by label, and actors run untrusted agent code, so a
ValidatingAdmissionPolicy (Kubernetes 1.30+) does: a ``<job>-sandbox-manager`` ServiceAccount may
create only pods labelled as that job's sandboxes, in the shape
``stoker.actor.pods.sandbox_pod_manifest`` builds (no API token, the namespace's default account,
no host namespaces, only ``emptyDir`` volumes, no Secret or ConfigMap through env, non-root in
every container, confined by seccomp, no privilege, escalation or added capabilities, no chosen
node, critical priority or accelerator toleration); may change a pod only if it already was that
job's sandbox, and then only its heartbeat annotation; and may delete only that job's sandboxes.
Static (one per cluster, any number of jobs), so the Helm chart ships it
(``templates/sandbox-policy.yaml``; tests/ship/test_chart.py checks it renders this) and the
operator, which holds no cluster-scoped write access, never creates it.
"""

from __future__ import annotations

from stoker.labels import HEARTBEAT_ANNOTATION, JOB_LABEL, ROLE_LABEL, ROLE_SANDBOX

SANDBOX_POLICY_NAME = "stoker-sandbox-pods"
_MANAGER = "request.userInfo.username"


def own_sandbox(pod: str) -> str:
    """CEL: ``pod`` is labelled as a sandbox of the job whose sandbox manager sends the request."""
    labels = f"{pod}.metadata.labels"
    return (
        f"has({labels}) && '{ROLE_LABEL}' in {labels} && {labels}['{ROLE_LABEL}'] == '{ROLE_SANDBOX}'"
        f" && '{JOB_LABEL}' in {labels}"
        f" && {_MANAGER} == 'system:serviceaccount:' + request.namespace + ':' + {labels}['{JOB_LABEL}'] + '-sandbox-manager'"
    )


def _same(field: str) -> str:
    """CEL: ``object`` and ``oldObject`` agree on an optional ``field`` (both unset, or equal)."""
    new, old = f"object.{field}", f"oldObject.{field}"
    return f"(has({new}) == has({old}) && (!has({new}) || {new} == {old}))"


def _same_except(field: str, key: str) -> str:
    """CEL: the string maps ``object.field`` and ``oldObject.field`` agree on every key but ``key``."""
    new, old = f"object.{field}", f"oldObject.{field}"
    return (
        f"(!has({new}) || {new}.all(k, k == '{key}' || (has({old}) && k in {old} && {old}[k] == {new}[k])))"
        f" && (!has({old}) || {old}.all(k, k == '{key}' || (has({new}) && k in {new})))"
    )


# Every container of the pod, init containers too (ephemeral ones need pods/ephemeralcontainers,
# which the sandbox manager's Role does not grant).
_CONTAINERS = "(object.spec.containers + (has(object.spec.initContainers) ? object.spec.initContainers : []))"
_POD_SC = "object.spec.securityContext"
_CONFINED = "['RuntimeDefault', 'Localhost']"
_RUNTIME_CLASSES = "['gvisor']"
_CRITICAL_PRIORITIES = "['system-node-critical', 'system-cluster-critical']"
_ACCELERATOR_TAINTS = "['google.com/tpu', 'nvidia.com/gpu']"  # GKE's taints on TPU and GPU nodes

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
        # Also keeps out secret, configMap, projected (service-account token) and downwardAPI volumes.
        "emptydir-volumes-only",
        "!has(object.spec.volumes) || object.spec.volumes.all(v, has(v.emptyDir))",
        "sandbox pods may mount only emptyDir volumes",
    ),
    (
        # The kubelet resolves secretKeyRef/configMapKeyRef/envFrom whatever the creator may read:
        # a sandbox naming another job's buffer token would get it. Sandboxes take literal values only.
        "literal-env-only",
        f"{_CONTAINERS}.all(c, !has(c.envFrom) && (!has(c.env) || c.env.all(e, !has(e.valueFrom))))",
        "sandbox containers take env as literal values only (no secretKeyRef, configMapKeyRef, fieldRef or envFrom)",
    ),
    (
        # A container's securityContext overrides the pod's, so both levels are checked.
        "non-root",
        f"has({_POD_SC}) && has({_POD_SC}.runAsNonRoot) && {_POD_SC}.runAsNonRoot == true"
        f" && !(has({_POD_SC}.runAsUser) && {_POD_SC}.runAsUser == 0)"
        f" && {_CONTAINERS}.all(c, !has(c.securityContext)"
        " || (!(has(c.securityContext.runAsNonRoot) && c.securityContext.runAsNonRoot == false)"
        " && !(has(c.securityContext.runAsUser) && c.securityContext.runAsUser == 0)))",
        "sandbox pods must set securityContext.runAsNonRoot: true, and no container may set runAsNonRoot: false or runAsUser: 0",
    ),
    (
        "confined",
        f"has({_POD_SC}) && has({_POD_SC}.seccompProfile) && {_POD_SC}.seccompProfile.type in {_CONFINED}"
        f" && !(has({_POD_SC}.appArmorProfile) && {_POD_SC}.appArmorProfile.type == 'Unconfined')"
        f" && {_CONTAINERS}.all(c, !has(c.securityContext)"
        f" || ((!has(c.securityContext.seccompProfile) || c.securityContext.seccompProfile.type in {_CONFINED})"
        " && !(has(c.securityContext.appArmorProfile) && c.securityContext.appArmorProfile.type == 'Unconfined')"
        " && (!has(c.securityContext.procMount) || c.securityContext.procMount == 'Default')))",
        "sandbox pods must use a RuntimeDefault or Localhost seccomp profile, and no container may be Unconfined "
        "(seccomp or AppArmor) or unmask /proc",
    ),
    (
        "unprivileged-containers",
        f"{_CONTAINERS}.all(c, has(c.securityContext)"
        " && !(has(c.securityContext.privileged) && c.securityContext.privileged)"
        " && has(c.securityContext.allowPrivilegeEscalation) && c.securityContext.allowPrivilegeEscalation == false"
        " && !(has(c.securityContext.capabilities) && has(c.securityContext.capabilities.add)"
        " && c.securityContext.capabilities.add.size() > 0)"
        " && (!has(c.ports) || c.ports.all(p, !has(p.hostPort) || p.hostPort == 0)))",
        "sandbox containers may not be privileged, escalate privileges, add capabilities or use host ports",
    ),
    (
        # Placement is privilege too: nodeName skips the scheduler (and with it every taint), an
        # accelerator toleration lands agent code beside a learner, a critical priority class
        # preempts one, and a runtime class could pick a less confining runtime. gVisor (GKE
        # Sandbox) confines more, so it stays allowed; mutating admission adds only keyed
        # tolerations (not-ready, unreachable) and a cluster's global default priority class.
        "placed-like-a-sandbox",
        "!has(object.spec.nodeName)"
        f" && (!has(object.spec.runtimeClassName) || object.spec.runtimeClassName in {_RUNTIME_CLASSES})"
        f" && (!has(object.spec.priorityClassName) || !(object.spec.priorityClassName in {_CRITICAL_PRIORITIES}))"
        " && (!has(object.spec.tolerations) || object.spec.tolerations.all(t, has(t.key)"
        f" && !({_ACCELERATOR_TAINTS}.exists(a, t.key == a || t.key.startsWith(a + '/')))))",
        "sandbox pods may not name their node, use a runtime class other than gvisor, a system-critical "
        "priority class, or tolerate every taint or an accelerator's",
    ),
)

# (name, CEL that must hold on UPDATE, message). The new object being an own sandbox is not enough:
# a PATCH could relabel any pod (another job's learner) as one and swap its image, and a DELETE of
# it would then be admitted too. The pod must have been this job's sandbox already, and a heartbeat
# is the one change the manager makes (stoker.actor.pods.PodSandbox.mark_alive).
SANDBOX_UPDATE: tuple[tuple[str, str, str], ...] = (
    (
        "was-own-sandbox",
        own_sandbox("oldObject"),
        "a job's sandbox manager may only change pods that already were that job's sandbox pods",
    ),
    (
        "heartbeat-only",
        "object.spec == oldObject.spec"
        f" && {_same('metadata.labels')} && {_same('metadata.ownerReferences')} && {_same('metadata.finalizers')}"
        f" && {_same_except('metadata.annotations', HEARTBEAT_ANNOTATION)}",
        f"a job's sandbox manager may change only a sandbox pod's {HEARTBEAT_ANNOTATION} annotation",
    ),
)


def sandbox_admission_policy(namespaces: tuple[str, ...] = ()) -> list[dict[str, object]]:
    """ValidatingAdmissionPolicy + binding; the binding covers ``namespaces`` (every one when empty)."""
    validations: list[dict[str, str]] = [
        {
            "expression": own_sandbox("variables.pod"),
            "message": "a job's sandbox manager may only create, change and delete that job's sandbox pods",
            "reason": "Forbidden",
        }
    ]
    validations += [
        {"expression": f"request.operation != 'UPDATE' || ({rule})", "message": message, "reason": "Forbidden"}
        for _, rule, message in SANDBOX_UPDATE
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

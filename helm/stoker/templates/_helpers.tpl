{{/* Names, labels and the operator's RBAC rules, shared by every template. */}}

{{- define "stoker.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The release's full name; a release named like the chart is not repeated ("stoker", not "stoker-stoker"). */}}
{{- define "stoker.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "stoker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "stoker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "stoker.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "stoker.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: stoker
{{- end -}}

{{- define "stoker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "stoker.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "repository:tag" or "repository@digest"; the tag defaults to the chart's appVersion. */}}
{{- define "stoker.image" -}}
{{- if .image.digest -}}
{{- printf "%s@%s" .image.repository .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository (default .appVersion .image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
RBAC: exactly the permissions `stoker operator` uses, mirrored from OPERATOR_RULES in
operator/rbac.py (the table the operator's own tests check its API calls against).
tests/ship/test_chart.py renders both watch modes and fails if the granted set differs from that
table in either direction, so a new API call cannot ship without its permission and a permission
the code no longer uses cannot linger. The operator runs --standalone, so kopf's peering rules
are left out. Never add pods/exec, escalate, bind, impersonate or "*".
*/}}

{{/* Rules on namespaced objects: a Role per watched namespace, or the ClusterRole cluster-wide. */}}
{{- define "stoker.namespacedRules" -}}
# Events on RLJobs (scaling, reaping, errors).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
# Watch RLJobs; kopf's finalizer and progress annotations.
- apiGroups: ["stoker.dev"]
  resources: ["rljobs"]
  verbs: ["list", "patch", "watch"]
# Phase, conditions, staleness and actor counts.
- apiGroups: ["stoker.dev"]
  resources: ["rljobs/status"]
  verbs: ["patch"]
# Children carry blockOwnerDeletion owner references to their RLJob: clusters running the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift, hardened clusters) require it.
- apiGroups: ["stoker.dev"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
# The job file (read back after a refused edit: the children keep the spec it holds) and the
# buffer's admission control.
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "get", "patch"]
# The buffer token the operator generates: created once, read for the buffer's Stats call.
# No list/watch: the operator cannot enumerate a namespace's secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "get"]
# The buffer's Service; the learner's headless Service (deleted on suspend); the rollout tier's
# Service (deleted with spec.rollout).
- apiGroups: [""]
  resources: ["services"]
  verbs: ["create", "delete", "patch"]
# The sandbox manager's ServiceAccount (actors create sandbox pods with it).
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["create"]
# The buffer's write-ahead-log volume; a single-host learner's run volume.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["create"]
# Index and reap sandbox pods. create/get/patch are never called by the operator itself:
# Kubernetes lets it grant the actors' Role those verbs only if it holds them (it holds no escalate).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "delete", "get", "list", "patch", "watch"]
# Actors, the buffer and single-host rollout servers (deleted with spec.rollout).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["create", "delete", "get", "patch"]
# The learner without JobSet (Indexed Jobs).
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "delete", "get"]
# The learner on TPU slices (JobSet); one JobSet per multi-host rollout server, listed to scale.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["create", "delete", "get", "list"]
# The sandbox manager's Role and RoleBinding, in the job's namespace.
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles"]
  verbs: ["create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["create", "patch"]
# Sandbox isolation.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* Cluster-scoped reads kopf needs to discover the RLJob resource. */}}
{{- define "stoker.crdRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}

{{/*
Namespace discovery: given a list of namespaces kopf lists and watches namespaces to notice them
appear and disappear; cluster-wide it never does (kopf/_core/reactor/observation.py), so only
the namespaced install grants it.
*/}}
{{- define "stoker.namespaceRules" -}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end -}}

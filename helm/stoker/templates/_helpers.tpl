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
RBAC: exactly the permissions `stoker operator` uses, mirrored from operator/rbac.py (RULES).
tests/ship/test_chart.py renders both watch modes and fails if the granted set differs from that
table in either direction, so a new API call in the operator cannot ship without its permission
and a permission the code no longer uses cannot linger. Never add pods/exec, escalate, bind,
impersonate or "*".
*/}}

{{/* Rules on namespaced objects: a Role per watched namespace, or the ClusterRole cluster-wide. */}}
{{- define "stoker.namespacedRules" -}}
# The RLJobs themselves: kopf lists/watches them and patches finalizers and annotations.
- apiGroups: ["stoker.dev"]
  resources: ["rljobs"]
  verbs: ["get", "list", "watch", "patch"]
# Phase, conditions, staleness and actor counts are written to the status subresource.
- apiGroups: ["stoker.dev"]
  resources: ["rljobs/status"]
  verbs: ["get", "patch"]
# Actor pods and sandbox pods; zombie sandboxes are deleted.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "create", "delete"]
# The buffer's Service and the learner's headless Service.
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create", "patch"]
# The buffer's write-ahead-log volume.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create"]
# Only the bearer token the operator generates for each job's buffer (create; never list/read).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# The actor Deployment (scaled for autoscaling and suspend) and the buffer Deployment.
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
# The learner on TPU: a JobSet, one child Job per slice.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The learner on CPU: a plain Job.
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Sandbox pods may reach only their actor.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch"]
# kopf posts reconciliation events on the RLJob.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end -}}

{{/* Cluster-scoped reads kopf needs to discover the RLJob resource. */}}
{{- define "stoker.crdRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end -}}

{{/*
Namespace observation: with a list of namespaces kopf lists and watches namespaces to notice
them appear and disappear; cluster-wide it does not (kopf/_core/reactor/observation.py).
*/}}
{{- define "stoker.namespaceRules" -}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end -}}

{{/* Chart name, truncated to 63 characters (a label value's limit). */}}
{{- define "kubemoe.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: <release>-<chart>, or the release name when it already contains the chart name. */}}
{{- define "kubemoe.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Chart label: name-version. */}}
{{- define "kubemoe.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the release. */}}
{{- define "kubemoe.labels" -}}
helm.sh/chart: {{ include "kubemoe.chart" . }}
{{ include "kubemoe.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kubemoe
{{- end }}

{{/* Selector labels of the operator pods (immutable in a Deployment: never add to them). */}}
{{- define "kubemoe.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kubemoe.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "kubemoe.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kubemoe.fullname" .) .Values.serviceAccount.name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Operator image reference. */}}
{{- define "kubemoe.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) }}
{{- end }}

{{/*
RBAC rules for objects in the namespaces the operator serves: exactly what the handlers call
(kubemoe.operator.kube) and what Kopf itself needs there. No wildcards.
*/}}
{{- define "kubemoe.namespacedRules" -}}
# The custom resource: Kopf watches it and patches its annotations (progress); the operator patches status.
- apiGroups: [kubemoe.io]
  resources: [moedeployments]
  verbs: [get, list, watch, patch]
- apiGroups: [kubemoe.io]
  resources: [moedeployments/status]
  verbs: [get, patch]
# Owner references with blockOwnerDeletion need this where OwnerReferencesPermissionEnforcement is on.
- apiGroups: [kubemoe.io]
  resources: [moedeployments/finalizers]
  verbs: [update]
# Children: server-side apply (create + patch), list to diff and prune, delete when retired; the
# workloads are watched too, so the status follows their readiness (operator/status_follower.py).
- apiGroups: [""]
  resources: [configmaps, services, serviceaccounts]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, create, patch, delete]
- apiGroups: [serving.knative.dev]
  resources: [services]
  verbs: [get, list, watch, create, patch, delete]
# spec.experts.gpuSharing.mode dra: one ResourceClaim per planned GPU, shared by the functions on it.
- apiGroups: [resource.k8s.io]
  resources: [resourceclaims]
  verbs: [get, list, create, patch, delete]
# The frontends' Role and RoleBinding (read the routing ConfigMap). The operator holds that permission
# itself (configmaps get/list above; watch below), so granting it is no escalation.
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, create, patch, delete]
- apiGroups: [""]
  resources: [configmaps]
  verbs: [watch]
# Kubernetes Events about what changed (Kopf posts core/v1 Events).
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create]
# Kopf peering when watching namespaces one by one.
- apiGroups: [kopf.dev]
  resources: [kopfpeerings]
  verbs: [get, list, watch, patch, create]
{{- end }}

{{/* Cluster-scoped rules: planning reads nodes and pods; Kopf observes CRDs and namespaces and peers cluster-wide. */}}
{{- define "kubemoe.clusterRules" -}}
# Planning reads the nodes and what every pod holds on them (GPUs, shares: operator/capacity.py), so plans
# never over-commit; and the frontend pods' IPs, to pull their /loads. Watched: the operator keeps them
# (Kopf indices) instead of listing the whole cluster every reconcile.
- apiGroups: [""]
  resources: [nodes, pods]
  verbs: [list, watch]
# spec.experts.gpuSharing.mode dra: the GPUs a DRA driver publishes per node.
- apiGroups: [resource.k8s.io]
  resources: [resourceslices]
  verbs: [list]
- apiGroups: [apiextensions.k8s.io]
  resources: [customresourcedefinitions]
  verbs: [list, watch]
# get: the Pod Security level a namespace enforces (pod-security.kubernetes.io/enforce), read before
# rendering hostPath volumes into it (operator/pod_security.py).
- apiGroups: [""]
  resources: [namespaces]
  verbs: [get, list, watch]
- apiGroups: [kopf.dev]
  resources: [clusterkopfpeerings]
  verbs: [get, list, watch, patch, create]
{{- end }}

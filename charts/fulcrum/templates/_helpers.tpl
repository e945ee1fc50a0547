{{/*
Names and labels shared by every template. Kubernetes names are at most 63 characters.
*/}}
{{- define "fulcrum.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "fulcrum.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The name of one of the chart's objects: the full name, shortened so that "<full name>-<suffix>" keeps within
max characters (pass a dict: ctx, suffix, max; max defaults to 63, a DNS-1035 label). StatefulSets pass 52:
their pods' controller-revision-hash label is the name, "-" and a 10-character hash.
*/}}
{{- define "fulcrum.componentName" -}}
{{- $max := .max | default 63 -}}
{{- $room := sub $max (add 1 (len .suffix)) | int -}}
{{- printf "%s-%s" (include "fulcrum.fullname" .ctx | trunc $room | trimSuffix "-") .suffix -}}
{{- end -}}

{{- define "fulcrum.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels on every object the chart creates. */}}
{{- define "fulcrum.labels" -}}
helm.sh/chart: {{ include "fulcrum.chart" . }}
app.kubernetes.io/name: {{ include "fulcrum.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: fulcrum
{{- end -}}

{{/* Selector labels of one component (pass a dict: ctx, component). */}}
{{- define "fulcrum.selectorLabels" -}}
app.kubernetes.io/name: {{ include "fulcrum.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "fulcrum.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "fulcrum.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "fulcrum.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* etcd endpoint handed to the operator: the bundled one, else etcd.endpoint (may be empty). */}}
{{- define "fulcrum.etcdEndpoint" -}}
{{- if .Values.etcd.enabled -}}
{{- printf "http://%s.%s.svc:2379" (include "fulcrum.componentName" (dict "ctx" . "suffix" "etcd" "max" 52)) .Release.Namespace -}}
{{- else -}}
{{- .Values.etcd.endpoint -}}
{{- end -}}
{{- end -}}

{{/* NATS URL handed to the operator: the bundled one, else nats.url (may be empty). */}}
{{- define "fulcrum.natsUrl" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s.%s.svc:4222" (include "fulcrum.componentName" (dict "ctx" . "suffix" "nats" "max" 52)) .Release.Namespace -}}
{{- else -}}
{{- .Values.nats.url -}}
{{- end -}}
{{- end -}}

{{/* Scheduling constraints shared by every pod. */}}
{{- define "fulcrum.scheduling" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The operator's rules on namespaced resources (rbac.yaml grants them cluster-wide or per namespace). */}}
{{- define "fulcrum.namespacedRules" -}}
# the LLMServe resource: kopf watches it, patches finalizers/annotations, writes status; HPA-style scale
- apiGroups: ["fulcrum.dev"]
  resources: ["llmserves"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["fulcrum.dev"]
  resources: ["llmserves/status", "llmserves/scale"]
  verbs: ["get", "patch", "update"]
# what the operator builds for each LLMServe (server-side apply, owner references; pruned when gone)
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
# drain protocol: find pods, set pod-deletion-cost on the drained one
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch", "patch"]
# readiness of pool instances (and what the router Role it creates may read)
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
# kopf posts events on the LLMServe
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- if .Values.operator.peering.enabled }}
# kopf peering within a namespace (namespaced mode)
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}

{{/*
Relabelings of the workload PodMonitor's endpoints: the operator's pod labels become the series' labels, and
job = the pod's Deployment (<llmserve>-router, <llmserve>-prefill, ...): the operator's observe step selects the
router's series by job="<llmserve>-router".
*/}}
{{- define "fulcrum.workloadRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_name]
  regex: (.+)-[a-z0-9]+-[a-z0-9]+
  targetLabel: job
  replacement: $1
- sourceLabels: [__meta_kubernetes_pod_label_fulcrum_dev_llmserve]
  targetLabel: llmserve
- sourceLabels: [__meta_kubernetes_pod_label_fulcrum_dev_pool]
  targetLabel: pool
- sourceLabels: [__meta_kubernetes_pod_label_fulcrum_dev_role]
  targetLabel: role
- sourceLabels: [__meta_kubernetes_namespace]
  targetLabel: namespace
- sourceLabels: [__meta_kubernetes_pod_name]
  targetLabel: pod
{{- end }}


{{/*
Operator values that render but cannot work: helm install/upgrade stops with a message naming the value and the fix.
*/}}
{{- define "fulcrum.validateOperator" -}}
{{- $op := .Values.operator -}}
{{- if and (gt (int $op.replicas) 1) (not $op.peering.enabled) -}}
{{- fail (printf "operator.replicas is %d but operator.peering.enabled is false: without peering every operator pod is active and each one scales and drains every LLMServe. Set operator.peering.enabled=true or operator.replicas=1." (int $op.replicas)) -}}
{{- end -}}
{{- if eq (int $op.metricsPort) (int $op.livenessPort) -}}
{{- fail (printf "operator.metricsPort and operator.livenessPort are both %d: the metrics server and kopf's /healthz cannot share a port. Give them different ports." (int $op.metricsPort)) -}}
{{- end -}}
{{- range $k := list "app.kubernetes.io/name" "app.kubernetes.io/instance" "app.kubernetes.io/component" -}}
{{- if hasKey $op.podLabels $k -}}
{{- fail (printf "operator.podLabels sets %s, a label the chart selects the operator pods by: the Deployment's selector would not match its pods. Remove %s from operator.podLabels." $k $k) -}}
{{- end -}}
{{- end -}}
{{- end -}}

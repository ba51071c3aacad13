{{/*
Names, labels and the pieces every pdserve pod shares. Helpers that take a role are
called with (dict "root" $ "role" "prefill").
*/}}

{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The name of a role's Deployment, Service, PDB and autoscaler: <fullname>-<role>. */}}
{{- define "pdserve.roleName" -}}
{{- printf "%s-%s" (include "pdserve.fullname" .root) .role -}}
{{- end -}}

{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- if .role }}
app.kubernetes.io/component: {{ .role }}
{{- end }}
{{- end -}}

{{- define "pdserve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{/* Every pod of this release (all roles): who may reach the internal ports. */}}
{{- define "pdserve.releasePodSelector" -}}
{{ include "pdserve.selectorLabels" (dict "root" .root "role" "") }}
{{- end -}}

{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.secretName" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecret -}}
{{- else -}}
{{- printf "%s-auth" (include "pdserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.secretKey" -}}
{{- if .Values.auth.existingSecret -}}
{{- .Values.auth.existingSecretKey -}}
{{- else -}}
token
{{- end -}}
{{- end -}}

{{/* The role's image: its own image block over the global one; tag defaults to appVersion. */}}
{{- define "pdserve.image" -}}
{{- $cfg := index .root.Values .role -}}
{{- $image := merge (deepCopy $cfg.image) (deepCopy .root.Values.image) -}}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion (toString $image.tag)) -}}
{{- end -}}

{{- define "pdserve.imagePullPolicy" -}}
{{- $cfg := index .root.Values .role -}}
{{- $image := merge (deepCopy $cfg.image) (deepCopy .root.Values.image) -}}
{{- $image.pullPolicy -}}
{{- end -}}

{{- /* The headless registry Service: its name resolves to every bootstrap pod, and each node
registers with each address it resolves to. */}}
{{- define "pdserve.registryURL" -}}
{{- printf "http://%s-registry:%v" (include "pdserve.roleName" (dict "root" . "role" "bootstrap")) .Values.bootstrap.ports.registry -}}
{{- end -}}

{{/* The --model-path value for a mounted model; "" for the built-in one. */}}
{{- define "pdserve.modelPath" -}}
{{- $m := .Values.model -}}
{{- if ne $m.source "builtin" -}}
{{- if $m.path -}}
{{- printf "%s/%s" (trimSuffix "/" $m.mountPath) (trimPrefix "/" $m.path) -}}
{{- else -}}
{{- $m.mountPath -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Env every pdserve container gets: downward API, cluster token, no hub access. */}}
{{- define "pdserve.commonEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: PDSERVE_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pdserve.secretName" . }}
      key: {{ include "pdserve.secretKey" . }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
- name: HOME
  value: /tmp
{{- end -}}

{{/* UCX_TLS for a node role, or "" to keep pdserve's default. */}}
{{- define "pdserve.ucxTls" -}}
{{- $cfg := index .root.Values .role -}}
{{- $ucx := .root.Values.transfer.ucx -}}
{{- if $ucx.tls -}}
{{- $ucx.tls -}}
{{- else if or $cfg.rdma.enabled $cfg.gpu.enabled -}}
{{- $tls := list "tcp" "self" "sm" -}}
{{- if $cfg.rdma.enabled -}}{{- $tls = prepend $tls "rc" -}}{{- end -}}
{{- if $cfg.gpu.enabled -}}{{- $tls = concat $tls (list "cuda_copy" "cuda_ipc") -}}{{- end -}}
{{- join "," $tls -}}
{{- end -}}
{{- end -}}

{{- define "pdserve.modelVolumeMounts" -}}
{{- if ne .Values.model.source "builtin" -}}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "pdserve.modelVolumes" -}}
{{- $m := .Values.model -}}
{{- if eq $m.source "pvc" -}}
- name: model
  persistentVolumeClaim:
    claimName: {{ required "model.pvc.claimName is required when model.source is pvc" $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" -}}
- name: model
  hostPath:
    path: {{ required "model.hostPath.path is required when model.source is hostPath" $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- end }}
{{- end -}}

{{/* Pod annotations: the role's own plus prometheus.io scrape hints. */}}
{{- define "pdserve.podAnnotations" -}}
{{- $cfg := index .root.Values .role -}}
{{- $ann := deepCopy $cfg.podAnnotations -}}
{{- if .root.Values.monitoring.podAnnotations -}}
{{- $_ := set $ann "prometheus.io/scrape" "true" -}}
{{- $_ := set $ann "prometheus.io/port" (toString $cfg.ports.http) -}}
{{- $_ := set $ann "prometheus.io/path" "/metrics" -}}
{{- end -}}
{{- if $ann -}}
{{- toYaml $ann -}}
{{- end -}}
{{- end -}}

{{/* The Prometheus label matchers that select one role's pods of this release. */}}
{{- define "pdserve.promSelector" -}}
{{- printf "namespace=%q,pod=~%q,role=%q" .root.Release.Namespace (printf "%s-[a-z0-9]+-[a-z0-9]+" (include "pdserve.roleName" .)) .role -}}
{{- end -}}

{{/*
A node role's scaling signal, as YAML: the custom metric the Prometheus Adapter rules
(files/prometheus-adapter-rules.yaml) expose for the HPA, its per-pod target, and the
equivalent PromQL for KEDA's prometheus trigger over this release's pods of the role.
*/}}
{{- define "pdserve.scalingSignal" -}}
{{- $as := (index .root.Values .role).autoscaling -}}
{{- $sel := include "pdserve.promSelector" . -}}
{{- if eq .role "prefill" -}}
metric: pdserve_prefill_waiting_requests
target: {{ $as.waitingRequestsPerReplica | toString | quote }}
kedaQuery: {{ printf "sum(pdserve_queue_requests{%s,queue=\"waiting\"})" $sel | quote }}
kedaMetricType: AverageValue
{{- else if eq $as.metric "kvUsage" -}}
metric: pdserve_decode_kv_usage_ratio
target: {{ $as.kvUsageTarget | toString | quote }}
kedaQuery: {{ printf "sum(pdserve_kv_pages_used{%s}) / clamp_min(sum(pdserve_kv_pages_total{%s}), 1)" $sel $sel | quote }}
kedaMetricType: Value
{{- else -}}
metric: pdserve_decode_running_requests
target: {{ $as.runningRequestsPerReplica | toString | quote }}
kedaQuery: {{ printf "sum(pdserve_queue_requests{%s,queue=\"running\"})" $sel | quote }}
kedaMetricType: AverageValue
{{- end -}}
{{- end -}}

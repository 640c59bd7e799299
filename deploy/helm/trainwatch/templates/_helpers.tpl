{{/* Names and labels shared by every resource of the release. */}}
{{- define "trainwatch.agentName" -}}
{{- printf "%s-agent" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "trainwatch.selectorLabels" -}}
app.kubernetes.io/name: trainwatch-agent
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "trainwatch.labels" -}}
{{ include "trainwatch.selectorLabels" . }}
app.kubernetes.io/part-of: trainwatch
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "trainwatch.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The agent's config: the values' keys, with the ones that must match the pod. */}}
{{- define "trainwatch.agentConfig" -}}
{{- $fixed := dict "listen" (printf "0.0.0.0:%v" .Values.agent.port) "discover" (list "/var/lib/trainwatch/runs") "sys_root" "/host/sys" "proc_root" "/host/proc" -}}
{{- toYaml (merge $fixed (deepCopy .Values.agent.config)) -}}
{{- end -}}

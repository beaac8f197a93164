{{- define "vllm-kvdisk.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "vllm-kvdisk.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "vllm-kvdisk.selectorLabels" -}}
app.kubernetes.io/name: {{ include "vllm-kvdisk.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "vllm-kvdisk.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "vllm-kvdisk.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "vllm-kvdisk.claimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-cache" (include "vllm-kvdisk.fullname" .)) }}
{{- end }}

{{/* Refuse values that would cut shutdown saves short. */}}
{{- define "vllm-kvdisk.validate" -}}
{{- if le (int .Values.terminationGracePeriodSeconds) (int .Values.shutdownTimeoutSeconds) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be larger than shutdownTimeoutSeconds (%v): pending checkpoint saves are flushed during the shutdown timeout" .Values.terminationGracePeriodSeconds .Values.shutdownTimeoutSeconds) }}
{{- end }}
{{- if le (int .Values.kvdisk.spaceMb) 0 }}
{{- fail "kvdisk.spaceMb must be positive" }}
{{- end }}
{{- end }}

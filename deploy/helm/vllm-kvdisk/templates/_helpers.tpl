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

{{/* Refuse two scrapes of the same pods: every series would exist twice. */}}
{{- define "vllm-kvdisk.validateMonitoring" -}}
{{- if and (.Values.serviceMonitor | default dict).enabled (.Values.podMonitor | default dict).enabled }}
{{- fail "serviceMonitor.enabled and podMonitor.enabled: enable one of them (both would scrape every pod twice)" }}
{{- end }}
{{- end }}

{{/* Labels of one alert: its severity, then prometheusRule.labels. */}}
{{- define "vllm-kvdisk.alertLabels" -}}
severity: {{ .severity | quote }}
{{- with omit .root.Values.prometheusRule.labels "severity" }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* prometheusRule.annotations, less the keys each alert sets itself. */}}
{{- define "vllm-kvdisk.alertAnnotations" -}}
{{- with omit .Values.prometheusRule.annotations "summary" "description" "runbook" "runbook_url" }}
{{- toYaml . }}
{{- end }}
{{- end }}

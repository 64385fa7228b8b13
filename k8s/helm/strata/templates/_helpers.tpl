{{/* Names: every object is called <release>-<part>, e.g. strata-master. */}}
{{- define "strata.fullname" -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "strata.labels" -}}
app.kubernetes.io/name: strata
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component; "strata.io/metrics" marks pods the metrics Service scrapes. */}}
{{- define "strata.selector" -}}
app.kubernetes.io/name: strata
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "strata.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The master's gRPC address as pods of this namespace reach it (short name: no namespace is
baked into the rendered objects, so the kustomize base can be put in any namespace). */}}
{{- define "strata.masterAddr" -}}
{{ include "strata.fullname" . }}-master:{{ .Values.master.rpcPort }}
{{- end -}}

{{/* The master's address from any namespace. */}}
{{- define "strata.masterAddrFqdn" -}}
{{ include "strata.fullname" . }}-master.{{ .Release.Namespace }}.svc.{{ .Values.clusterDomain }}:{{ .Values.master.rpcPort }}
{{- end -}}

{{/* Container security context shared by every Strata container. */}}
{{- define "strata.securityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.runAsUser }}
runAsGroup: {{ .Values.runAsUser }}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{- define "strata.podSecurityContext" -}}
fsGroup: {{ .Values.runAsUser }}
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* A TOML value: strings quoted, numbers as integers (YAML numbers arrive as floats). */}}
{{- define "strata.tomlValue" -}}
{{- if kindIs "string" . -}}
{{ . | toJson }}
{{- else if kindIs "bool" . -}}
{{ . }}
{{- else if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{ int64 . }}
{{- else -}}
{{ fail (printf "config values must be strings, booleans or integers, not %s" (kindOf .)) }}
{{- end -}}
{{- end -}}

{{/* TOML lines of a config map (sorted keys). */}}
{{- define "strata.tomlFields" -}}
{{- range $k, $v := . }}
{{ $k }} = {{ include "strata.tomlValue" $v }}
{{- end -}}
{{- end -}}

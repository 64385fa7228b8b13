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
{{/* With several masters: every master pod by name, comma-separated (clients follow the leader). */}}
{{- define "strata.masterAddr" -}}
{{- include "strata.masterList" (dict "root" . "suffix" "") -}}
{{- end -}}

{{/* The master's address from any namespace. */}}
{{- define "strata.masterAddrFqdn" -}}
{{- include "strata.masterList" (dict "root" . "suffix" (printf ".%s.svc.%s" .Release.Namespace .Values.clusterDomain)) -}}
{{- end -}}

{{- define "strata.masterList" -}}
{{- $root := .root -}}
{{- $name := printf "%s-master" (include "strata.fullname" $root) -}}
{{- $port := int $root.Values.master.rpcPort -}}
{{- if gt (int $root.Values.master.replicas) 1 -}}
{{- $addrs := list -}}
{{- range $i := until (int $root.Values.master.replicas) -}}
{{- $addrs = append $addrs (printf "%s-%d.%s%s:%d" $name $i $name $.suffix $port) -}}
{{- end -}}
{{- join "," $addrs -}}
{{- else -}}
{{- printf "%s%s:%d" $name .suffix $port -}}
{{- end -}}
{{- end -}}

{{/* Whether the masters run on etcd (several replicas), checked: etcd must be given. */}}
{{- define "strata.masterHa" -}}
{{- if gt (int .Values.master.replicas) 1 -}}
{{- if and (not .Values.etcd.enabled) (empty .Values.etcd.endpoints) -}}
{{- fail "master.replicas > 1 keeps the masters' state in etcd: set etcd.enabled=true or etcd.endpoints" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The masters' --meta value: the chart's etcd members, or etcd.endpoints. */}}
{{- define "strata.etcdMeta" -}}
{{- if .Values.etcd.enabled -}}
{{- $name := printf "%s-etcd" (include "strata.fullname" .) -}}
{{- $eps := list -}}
{{- range $i := until (int .Values.etcd.replicas) -}}
{{- $eps = append $eps (printf "%s-%d.%s:%d" $name $i $name (int $.Values.etcd.clientPort)) -}}
{{- end -}}
etcd://{{ join "," $eps }}
{{- else -}}
etcd://{{ join "," .Values.etcd.endpoints }}
{{- end -}}
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

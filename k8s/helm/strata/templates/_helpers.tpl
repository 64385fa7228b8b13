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

{{/* TLS (values tls.*): the name every server certificate carries. */}}
{{- define "strata.tlsServerName" -}}
{{- .Values.tls.serverName | default (include "strata.fullname" .) -}}
{{- end -}}

{{/* The [tls] table of a master's or worker's TOML config: the mounted Secret's files. */}}
{{- define "strata.tlsToml" -}}
{{- if .Values.tls.enabled -}}
[tls]
cert = "/etc/strata-tls/tls.crt"
key = "/etc/strata-tls/tls.key"
ca = "/etc/strata-tls/ca.crt"
client_auth = {{ .Values.tls.clientAuth }}
server_name = "{{ include "strata.tlsServerName" . }}"
{{- end }}
{{- end -}}

{{/* The Secret volume of a master or worker pod (all three files). */}}
{{- define "strata.tlsVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName | default (printf "%s-tls" (include "strata.fullname" .)) }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* The Secret volume of a client pod: ca.crt, and its own certificate with clientAuth. */}}
{{- define "strata.tlsClientVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ .Values.tls.clientSecretName | default .Values.tls.secretName | default (printf "%s-tls" (include "strata.fullname" .)) }}
    defaultMode: 0440
    items:
      - {key: ca.crt, path: ca.crt}
      {{- if .Values.tls.clientAuth }}
      - {key: tls.crt, path: tls.crt}
      - {key: tls.key, path: tls.key}
      {{- end }}
{{- end }}
{{- end -}}

{{- define "strata.tlsMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  mountPath: /etc/strata-tls
  readOnly: true
{{- end }}
{{- end -}}

{{/* The STRATA_TLS_* environment of a client (the Python client and the CLI read it). */}}
{{- define "strata.tlsClientEnv" -}}
{{- if .Values.tls.enabled -}}
- name: STRATA_TLS_CA
  value: /etc/strata-tls/ca.crt
- name: STRATA_TLS_SERVER_NAME
  value: {{ include "strata.tlsServerName" . | quote }}
{{- if .Values.tls.clientAuth }}
- name: STRATA_TLS_CERT
  value: /etc/strata-tls/tls.crt
- name: STRATA_TLS_KEY
  value: /etc/strata-tls/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{/* Tokens (docs/SECURITY.md): the Secret with admin.token and worker.token. */}}
{{- define "strata.tokensSecret" -}}
{{- .Values.auth.secretName | default (printf "%s-tokens" (include "strata.fullname" .)) -}}
{{- end -}}

{{/* The tokens volume of a master: both tokens (it accepts them; they are its bootstrap tokens). */}}
{{- define "strata.tokensMasterVolume" -}}
{{- if .Values.auth.enabled -}}
- name: tokens
  secret:
    secretName: {{ include "strata.tokensSecret" . }}
    defaultMode: 0440
    items:
      - {key: admin.token, path: admin.token}
      - {key: worker.token, path: worker.token}
{{- end }}
{{- end -}}

{{/* The tokens volume of a worker or sidecar: the workers' token only. */}}
{{- define "strata.tokensWorkerVolume" -}}
{{- if .Values.auth.enabled -}}
- name: tokens
  secret:
    secretName: {{ include "strata.tokensSecret" . }}
    defaultMode: 0440
    items:
      - {key: worker.token, path: worker.token}
{{- end }}
{{- end -}}

{{/* The token volume of a client pod (trainer, warmup CronJob): one key, as "token". */}}
{{- define "strata.tokenClientVolume" -}}
{{- if .Values.auth.enabled -}}
- name: token
  secret:
    secretName: {{ .Values.auth.clientSecretName | default (include "strata.tokensSecret" .) }}
    defaultMode: 0440
    items:
      - {key: {{ .Values.auth.clientSecretKey }}, path: token}
{{- end }}
{{- end -}}

{{- define "strata.tokensMount" -}}
{{- if .Values.auth.enabled -}}
- name: tokens
  mountPath: /etc/strata-tokens
  readOnly: true
{{- end }}
{{- end -}}

{{- define "strata.tokenClientMount" -}}
{{- if .Values.auth.enabled -}}
- name: token
  mountPath: /etc/strata-token
  readOnly: true
{{- end }}
{{- end -}}

{{/* The environment of a master: its bootstrap token files, and the admin token for a
`strata` run in the pod (kubectl exec). */}}
{{- define "strata.tokensMasterEnv" -}}
{{- if .Values.auth.enabled -}}
- name: STRATA_MASTER_ADMIN_TOKEN_FILE
  value: /etc/strata-tokens/admin.token
- name: STRATA_MASTER_WORKER_TOKEN_FILE
  value: /etc/strata-tokens/worker.token
- name: STRATA_TOKEN_FILE
  value: /etc/strata-tokens/admin.token
{{- end }}
{{- end -}}

{{/* The environment of a worker or sidecar: the token it presents. */}}
{{- define "strata.tokensWorkerEnv" -}}
{{- if .Values.auth.enabled -}}
- name: STRATA_TOKEN_FILE
  value: /etc/strata-tokens/worker.token
{{- end }}
{{- end -}}

{{/* The environment of a client pod: the token it presents. */}}
{{- define "strata.tokenClientEnv" -}}
{{- if .Values.auth.enabled -}}
- name: STRATA_TOKEN_FILE
  value: /etc/strata-token/token
{{- end }}
{{- end -}}

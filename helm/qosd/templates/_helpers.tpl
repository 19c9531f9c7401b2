{{/* Names and labels. */}}
{{- define "qosd.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "qosd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "qosd.instanceLabels" -}}
app.kubernetes.io/name: {{ include "qosd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The daemon's pods; the trial Redis has component redis-trial, never matched. */}}
{{- define "qosd.selectorLabels" -}}
{{ include "qosd.instanceLabels" . }}
app.kubernetes.io/component: qosd
{{- end -}}

{{- define "qosd.commonLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "qosd.instanceLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "qosd.labels" -}}
{{ include "qosd.commonLabels" . }}
app.kubernetes.io/component: qosd
{{- end -}}

{{- define "qosd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "qosd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "qosd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The Redis URL qosd uses: the external one, the trial one, or none (embedded). */}}
{{- define "qosd.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if .Values.redis.trial.enabled -}}
{{- printf "redis://%s-redis:6379/0" (include "qosd.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* qosd.yaml: the user's config with the settings the chart owns on top. */}}
{{- define "qosd.config" -}}
{{- $config := deepCopy (default dict .Values.config) -}}
{{- $server := default dict (get $config "server") -}}
{{- if eq .Values.mode "sidecar" -}}
{{- $_ := set $server "listen" (list .Values.sidecar.listen) -}}
{{- else -}}
{{- $_ := set $server "listen" (list (printf "0.0.0.0:%v" .Values.grpc.port)) -}}
{{- end -}}
{{- $_ := set $server "http_listen" (printf "0.0.0.0:%v" .Values.http.port) -}}
{{- if and (eq .Values.mode "standalone") (include "qosd.redisUrl" .) -}}
{{- $_ := set $server "workers" .Values.workers -}}
{{- else -}}
{{- $_ := set $server "workers" 1 -}}
{{- end -}}
{{- $_ := set $server "admin_listen" (list (printf "unix:%s/admin.sock" .Values.admin.socketDir)) -}}
{{- if .Values.tls.secretName -}}
{{- $tls := dict "cert_file" "/var/run/secrets/qosd/tls/tls.crt" "key_file" "/var/run/secrets/qosd/tls/tls.key" -}}
{{- if .Values.tls.requireClientCert }}{{ $_ := set $tls "client_ca_file" "/var/run/secrets/qosd/tls/ca.crt" }}{{ end -}}
{{- $_ := set $server "tls" $tls -}}
{{- end -}}
{{- $_ := set $config "server" $server -}}
{{- $auth := dict -}}
{{- range $group := list "control" "qos" -}}
{{- $values := get $.Values.auth $group -}}
{{- $rule := dict -}}
{{- if $values.tokenSecret }}{{ $_ := set $rule "token_file" (printf "/var/run/secrets/qosd/%s-token/token" $group) }}{{ end -}}
{{- if $values.identities }}{{ $_ := set $rule "identities" $values.identities }}{{ end -}}
{{- if $rule }}{{ $_ := set $auth $group $rule }}{{ end -}}
{{- end -}}
{{- if $auth }}{{ $_ := set $config "auth" $auth }}{{ end -}}
{{- $_ := set $config "logging" (dict "level" .Values.logging.level "format" .Values.logging.format) -}}
{{- $redis := default dict (get $config "redis") -}}
{{- $url := include "qosd.redisUrl" . -}}
{{- if $url -}}
{{- $_ := set $redis "url" $url -}}
{{- $_ := set $redis "mode" (ternary "standalone" .Values.redis.mode (and (not .Values.redis.url) .Values.redis.trial.enabled)) -}}
{{- end -}}
{{- $_ := set $config "redis" $redis -}}
{{- if .Values.otel.enabled -}}
{{- $tracing := dict "enabled" true "service_name" .Values.otel.serviceName -}}
{{- with .Values.otel.endpoint }}{{ $_ := set $tracing "endpoint" . }}{{ end -}}
{{- if not (kindIs "invalid" .Values.otel.sampleRatio) }}{{ $_ := set $tracing "sample_ratio" .Values.otel.sampleRatio }}{{ end -}}
{{- with .Values.otel.resourceAttributes }}{{ $_ := set $tracing "resource_attributes" . }}{{ end -}}
{{- $_ := set $config "tracing" $tracing -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Checks that stop a release that could not work as intended. */}}
{{- define "qosd.validate" -}}
{{- if and (eq .Values.mode "proxy") (not .Values.proxy.upstreams) -}}
{{- fail "qosd: proxy mode needs proxy.upstreams (model: [URL of an OpenAI-compatible server such as a vLLM Service])" -}}
{{- end -}}
{{- if and (eq .Values.mode "proxy") (ne (toString .Values.workers) "auto") (gt (int .Values.workers) 1) -}}
{{- fail "qosd: proxy mode runs one process per pod; scale it with replicaCount" -}}
{{- end -}}
{{- if and (ne .Values.mode "sidecar") (gt (int .Values.replicaCount) 1) (not (include "qosd.redisUrl" .)) -}}
{{- fail "qosd: replicaCount > 1 needs redis.url or redis.trial.enabled: replicas on the embedded store would each keep a budget of their own" -}}
{{- end -}}
{{- if and (eq .Values.mode "standalone") (ne (toString .Values.workers) "auto") (gt (int .Values.workers) 1) (not (include "qosd.redisUrl" .)) -}}
{{- fail "qosd: workers > 1 needs redis.url or redis.trial.enabled: the embedded store keeps its budgets in one process" -}}
{{- end -}}
{{- if and .Values.redis.url .Values.redis.trial.enabled -}}
{{- fail "qosd: set redis.url or redis.trial.enabled, not both" -}}
{{- end -}}
{{- if and .Values.redis.trial.enabled .Values.redis.existingSecret -}}
{{- fail "qosd: the trial Redis has no password; unset redis.existingSecret" -}}
{{- end -}}
{{- if and .Values.tls.requireClientCert (not .Values.tls.secretName) -}}
{{- fail "qosd: tls.requireClientCert needs tls.secretName (mTLS is TLS first)" -}}
{{- end -}}
{{- if and (or .Values.auth.control.identities .Values.auth.qos.identities) (not .Values.tls.requireClientCert) -}}
{{- fail "qosd: auth identities come from client certificates: set tls.requireClientCert" -}}
{{- end -}}
{{- end -}}

{{/* The probes, on HTTPS when the listeners are on TLS. */}}
{{- define "qosd.probe" -}}
{{- $probe := deepCopy .probe -}}
{{- if and .root.Values.tls.secretName $probe.httpGet -}}
{{- $_ := set $probe.httpGet "scheme" "HTTPS" -}}
{{- end -}}
{{- toYaml $probe -}}
{{- end -}}

{{/* Volumes the qosd container mounts beyond its config: the admin socket's, and the
TLS and token Secrets. */}}
{{- define "qosd.secretVolumes" -}}
- name: qosd-admin
  emptyDir: {}
{{- with .Values.tls.secretName }}
- name: qosd-tls
  secret: {secretName: {{ . }}}
{{- end }}
{{- range $group := list "control" "qos" }}
{{- with (get $.Values.auth $group).tokenSecret }}
- name: qosd-{{ $group }}-token
  secret: {secretName: {{ . }}, items: [{key: token, path: token}]}
{{- end }}
{{- end }}
{{- end -}}

{{/* The qosd container; used by the Deployment and by gateway pods (sidecar). */}}
{{- define "qosd.container" -}}
name: qosd
image: {{ include "qosd.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
{{- if eq .Values.mode "proxy" }}
args:
  - proxy
  - --config
  - /etc/qosd/qosd.yaml
  - --listen
  - "0.0.0.0:{{ .Values.proxy.port }}"
  {{- range $model, $urls := .Values.proxy.upstreams }}
  {{- range $url := $urls }}
  - --upstream
  - {{ printf "%s=%s" $model $url | quote }}
  {{- end }}
  {{- end }}
  {{- with .Values.proxy.defaultClass }}
  - --default-class
  - {{ . | quote }}
  {{- end }}
  {{- if .Values.proxy.priorityUpstreams }}
  - --priority-upstreams
  {{- end }}
{{- else }}
args: ["serve", "--config", "/etc/qosd/qosd.yaml"]
{{- end }}
ports:
  {{- if ne .Values.mode "sidecar" }}
  - {name: qosd-grpc, containerPort: {{ .Values.grpc.port }}, protocol: TCP}
  {{- end }}
  {{- if eq .Values.mode "proxy" }}
  - {name: qosd-openai, containerPort: {{ .Values.proxy.port }}, protocol: TCP}
  {{- end }}
  - {name: qosd-http, containerPort: {{ .Values.http.port }}, protocol: TCP}
{{- if or .Values.redis.existingSecret .Values.otel.headersSecret .Values.extraEnv }}
env:
  {{- if .Values.redis.existingSecret }}
  - name: QOSD_REDIS_PASSWORD
    valueFrom:
      secretKeyRef: {name: {{ .Values.redis.existingSecret }}, key: {{ .Values.redis.passwordKey }}}
  {{- end }}
  {{- if .Values.otel.headersSecret }}
  - name: OTEL_EXPORTER_OTLP_HEADERS
    valueFrom:
      secretKeyRef: {name: {{ .Values.otel.headersSecret }}, key: OTEL_EXPORTER_OTLP_HEADERS}
  {{- end }}
  {{- with .Values.extraEnv }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- end }}
livenessProbe:
  {{- include "qosd.probe" (dict "root" . "probe" .Values.livenessProbe) | nindent 2 }}
readinessProbe:
  {{- if and (eq .Values.mode "sidecar") (not .Values.sidecar.readinessFollowsStore) }}
  {{- $probe := deepCopy .Values.readinessProbe }}
  {{- $_ := set $probe "httpGet" (dict "path" "/healthz" "port" "qosd-http") }}
  {{- include "qosd.probe" (dict "root" . "probe" $probe) | nindent 2 }}
  {{- else }}
  {{- include "qosd.probe" (dict "root" . "probe" .Values.readinessProbe) | nindent 2 }}
  {{- end }}
resources:
  {{- toYaml .Values.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - {name: qosd-config, mountPath: /etc/qosd, readOnly: true}
  - {name: qosd-admin, mountPath: {{ .Values.admin.socketDir }}}
  {{- if .Values.tls.secretName }}
  - {name: qosd-tls, mountPath: /var/run/secrets/qosd/tls, readOnly: true}
  {{- end }}
  {{- range $group := list "control" "qos" }}
  {{- if (get $.Values.auth $group).tokenSecret }}
  - {name: qosd-{{ $group }}-token, mountPath: /var/run/secrets/qosd/{{ $group }}-token, readOnly: true}
  {{- end }}
  {{- end }}
  {{- if and (eq .Values.mode "sidecar") (hasPrefix "unix:" .Values.sidecar.listen) }}
  - {name: qosd-socket, mountPath: {{ .Values.sidecar.socketDir }}}
  {{- end }}
  {{- if ne .Values.mode "sidecar" }}
  {{- /* The workers' supervisor keeps their ready files and metrics there. */}}
  - {name: qosd-tmp, mountPath: /tmp}
  {{- end }}
{{- end -}}

{{/*
Sidecar mode: the container and the volumes to add to a gateway's pod template.
In the gateway chart (qosd as a dependency):
  containers:
    {{- include "qosd.sidecar.container" .Subcharts.qosd | nindent 8 }}
  volumes:
    {{- include "qosd.sidecar.volumes" .Subcharts.qosd | nindent 8 }}
The gateway container mounts the "qosd-socket" volume too when qosd listens on a
Unix socket.
*/}}
{{- define "qosd.sidecar.container" -}}
- {{ include "qosd.container" . | nindent 2 | trim }}
{{- end -}}

{{- define "qosd.sidecar.volumes" -}}
- name: qosd-config
  configMap:
    name: {{ include "qosd.fullname" . }}
{{ include "qosd.secretVolumes" . }}
{{- if hasPrefix "unix:" .Values.sidecar.listen }}
- name: qosd-socket
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The checksum that restarts pods when the config changes. */}}
{{- define "qosd.configChecksum" -}}
{{- include "qosd.config" . | sha256sum -}}
{{- end -}}

{{/* The SLO target per class, for the PrometheusRule: each of classSloTargets, then
sloTarget for every other class that reports samples (rules/qosd-alerts.yaml holds
what the defaults give). Called with .Values.monitoring.prometheusRule. */}}
{{- define "qosd.sloTargetExpr" -}}
{{- range $class, $target := .classSloTargets -}}
label_replace(vector({{ $target }}), "class", "{{ $class }}", "", "") or {{ end -}}
0 * max by (class) (qosd_slo_samples_total) + {{ .sloTarget }}
{{- end -}}

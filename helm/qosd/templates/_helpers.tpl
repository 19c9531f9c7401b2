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
{{- $_ := set $config "server" $server -}}
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
{{- if and (eq .Values.mode "standalone") (gt (int .Values.replicaCount) 1) (not (include "qosd.redisUrl" .)) -}}
{{- fail "qosd: replicaCount > 1 needs redis.url or redis.trial.enabled: replicas on the embedded store would each keep a budget of their own" -}}
{{- end -}}
{{- if and .Values.redis.url .Values.redis.trial.enabled -}}
{{- fail "qosd: set redis.url or redis.trial.enabled, not both" -}}
{{- end -}}
{{- if and .Values.redis.trial.enabled .Values.redis.existingSecret -}}
{{- fail "qosd: the trial Redis has no password; unset redis.existingSecret" -}}
{{- end -}}
{{- end -}}

{{/* The qosd container; used by the Deployment and by gateway pods (sidecar). */}}
{{- define "qosd.container" -}}
name: qosd
image: {{ include "qosd.image" . }}
imagePullPolicy: {{ .Values.image.pullPolicy }}
args: ["serve", "--config", "/etc/qosd/qosd.yaml"]
ports:
  {{- if ne .Values.mode "sidecar" }}
  - {name: qosd-grpc, containerPort: {{ .Values.grpc.port }}, protocol: TCP}
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
  {{- toYaml .Values.livenessProbe | nindent 2 }}
readinessProbe:
  {{- if and (eq .Values.mode "sidecar") (not .Values.sidecar.readinessFollowsStore) }}
  {{- $probe := deepCopy .Values.readinessProbe }}
  {{- $_ := set $probe "httpGet" (dict "path" "/healthz" "port" "qosd-http") }}
  {{- toYaml $probe | nindent 2 }}
  {{- else }}
  {{- toYaml .Values.readinessProbe | nindent 2 }}
  {{- end }}
resources:
  {{- toYaml .Values.resources | nindent 2 }}
securityContext:
  {{- toYaml .Values.securityContext | nindent 2 }}
volumeMounts:
  - {name: qosd-config, mountPath: /etc/qosd, readOnly: true}
  {{- if and (eq .Values.mode "sidecar") (hasPrefix "unix:" .Values.sidecar.listen) }}
  - {name: qosd-socket, mountPath: {{ .Values.sidecar.socketDir }}}
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
{{- if hasPrefix "unix:" .Values.sidecar.listen }}
- name: qosd-socket
  emptyDir: {}
{{- end }}
{{- end -}}

{{/* The checksum that restarts pods when the config changes. */}}
{{- define "qosd.configChecksum" -}}
{{- include "qosd.config" . | sha256sum -}}
{{- end -}}

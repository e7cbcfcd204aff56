{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "conveyor.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release name, plus the chart name unless it already contains it. */}}
{{- define "conveyor.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "conveyor.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "conveyor.selectorLabels" -}}
app.kubernetes.io/name: {{ include "conveyor.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "conveyor.labels" -}}
helm.sh/chart: {{ include "conveyor.chart" . }}
{{ include "conveyor.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: conveyor
{{- end }}

{{- define "conveyor.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "conveyor.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "conveyor.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Name of the Secret the gateway reads its credentials from. */}}
{{- define "conveyor.secretName" -}}
{{- default (include "conveyor.fullname" .) .Values.secrets.existingSecret }}
{{- end }}

{{/* Key names inside that Secret: the chart's own Secret uses the environment variable names. */}}
{{- define "conveyor.secretKey" -}}
{{- $root := index . 0 }}{{- $key := index . 1 }}
{{- if $root.Values.secrets.existingSecret }}
{{- index $root.Values.secrets.existingSecretKeys $key }}
{{- else }}
{{- index (dict "adminTokens" "CONVEYOR_ADMIN_TOKENS" "keyHashSecret" "CONVEYOR_KEY_HASH_SECRET" "databaseUrl" "CONVEYOR_DATABASE_URL" "redisUrl" "CONVEYOR_REDIS_URL") $key }}
{{- end }}
{{- end }}

{{/*
Admin tokens joined with commas. When none are given, reuse the ones stored in the release's
Secret (so upgrades keep them) or generate one at first install.
*/}}
{{- define "conveyor.adminTokens" -}}
{{- if .Values.secrets.adminTokens }}
{{- join "," .Values.secrets.adminTokens }}
{{- else }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "conveyor.fullname" .) }}
{{- if and $existing $existing.data (hasKey $existing.data "CONVEYOR_ADMIN_TOKENS") }}
{{- index $existing.data "CONVEYOR_ADMIN_TOKENS" | b64dec }}
{{- else }}
{{- printf "cva-%s" (randAlphaNum 40) }}
{{- end }}
{{- end }}
{{- end }}

{{/* Minimum grace period: drain timeout plus the preStop pause. */}}
{{- define "conveyor.drainWindow" -}}
{{- add (int .Values.config.drainTimeout) (int .Values.preStopSleepSeconds) }}
{{- end }}

{{/*
terminationGracePeriodSeconds: always above the drain window, so Kubernetes never kills a
replica that is still finishing requests.
*/}}
{{- define "conveyor.terminationGracePeriodSeconds" -}}
{{- $window := int (include "conveyor.drainWindow" .) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $window 15 }}
{{- else }}
{{- $grace := int .Values.terminationGracePeriodSeconds }}
{{- if le $grace $window }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be above config.drainTimeout + preStopSleepSeconds (%d), or the replica is killed while it drains" $grace $window) }}
{{- end }}
{{- $grace }}
{{- end }}
{{- end }}

{{/* Path the server loads the model from; empty for the bundled default. */}}
{{- define "conveyor.modelPath" -}}
{{- if ne .Values.model.source "bundled" }}
{{- $path := trimPrefix "/" .Values.model.path }}
{{- if $path }}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.mountPath) $path }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}
{{- end }}

{{/* Restricted-profile security context for the hook and test pods. */}}
{{- define "conveyor.hookPodSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.podSecurityContext.runAsUser | default 10001 }}
runAsGroup: {{ .Values.podSecurityContext.runAsGroup | default 10001 }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{- define "conveyor.hookContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Selects the gateway pods only (not the migration or test pods). */}}
{{- define "conveyor.gatewaySelectorLabels" -}}
{{ include "conveyor.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

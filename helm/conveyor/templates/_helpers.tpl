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
A value stored in the release's own Secret by an earlier install, or nothing: the usual
`lookup` idiom, so generated values survive upgrades (lookup is empty under `helm template`
and `--dry-run=client`, where a fresh value is generated).
*/}}
{{- define "conveyor.storedSecretValue" -}}
{{- $root := index . 0 }}{{- $key := index . 1 }}
{{- $existing := lookup "v1" "Secret" $root.Release.Namespace (include "conveyor.fullname" $root) }}
{{- if and $existing $existing.data (hasKey $existing.data $key) }}
{{- index $existing.data $key | b64dec }}
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
{{- include "conveyor.storedSecretValue" (list . "CONVEYOR_ADMIN_TOKENS") | default (printf "cva-%s" (randAlphaNum 40)) }}
{{- end }}
{{- end }}

{{/*
HMAC secret for API-key hashes. When none is given, reuse the one stored in the release's
Secret or generate one at first install. It must never change under a database of keys: every
key hashed with the old secret would stop working, hence the lookup.
*/}}
{{- define "conveyor.keyHashSecret" -}}
{{- if .Values.secrets.keyHashSecret }}
{{- .Values.secrets.keyHashSecret }}
{{- else }}
{{- include "conveyor.storedSecretValue" (list . "CONVEYOR_KEY_HASH_SECRET") | default (randAlphaNum 64) }}
{{- end }}
{{- end }}

{{/*
Embedded mode. The database is external when secrets.databaseUrl is set (or, with
secrets.existingSecret, when existingSecretKeys.databaseUrl names a key); otherwise the server
uses SQLite on the state volume. Likewise Redis: without a URL, rate limits and quotas run
in-process (fakeredis). Each helper prints "true" or nothing.
*/}}
{{- define "conveyor.externalDatabase" -}}
{{- if .Values.secrets.existingSecret }}
{{- if .Values.secrets.existingSecretKeys.databaseUrl }}true{{ end }}
{{- else if .Values.secrets.databaseUrl }}true{{ end }}
{{- end }}

{{- define "conveyor.externalRedis" -}}
{{- if .Values.secrets.existingSecret }}
{{- if .Values.secrets.existingSecretKeys.redisUrl }}true{{ end }}
{{- else if .Values.secrets.redisUrl }}true{{ end }}
{{- end }}

{{/* "true" when every replica shares external PostgreSQL and Redis, so several may run. */}}
{{- define "conveyor.canScale" -}}
{{- if and (include "conveyor.externalDatabase" .) (include "conveyor.externalRedis" .) }}true{{ end }}
{{- end }}

{{/* Where the embedded SQLite database lives: the state volume, mounted at HOME. */}}
{{- define "conveyor.sqliteUrl" -}}
sqlite:////var/lib/conveyor/conveyor.db
{{- end }}

{{/* "true" when the state volume is a PersistentVolumeClaim (embedded database only). */}}
{{- define "conveyor.persistentState" -}}
{{- if and (not (include "conveyor.externalDatabase" .)) .Values.persistence.enabled }}true{{ end }}
{{- end }}

{{- define "conveyor.stateClaimName" -}}
{{- .Values.persistence.existingClaim | default (printf "%s-data" (include "conveyor.fullname" .) | trunc 63 | trimSuffix "-") }}
{{- end }}

{{/* "true" when the pre-install/pre-upgrade migration Job runs (external database only). */}}
{{- define "conveyor.migrationJob" -}}
{{- if and .Values.migrations.enabled (include "conveyor.externalDatabase" .) }}true{{ end }}
{{- end }}

{{/*
The embedded database and in-process limits belong to one process: refuse anything that would
run two gateway pods at once (replicas, autoscaling, a rolling update).
*/}}
{{- define "conveyor.checkSingleReplica" -}}
{{- if not (include "conveyor.canScale" .) }}
{{- $embedded := list }}
{{- if not (include "conveyor.externalDatabase" .) }}{{ $embedded = append $embedded "no secrets.databaseUrl: SQLite on one pod's volume" }}{{ end }}
{{- if not (include "conveyor.externalRedis" .) }}{{ $embedded = append $embedded "no secrets.redisUrl: rate limits and quotas in one pod's memory" }}{{ end }}
{{- $why := printf "several gateway pods need external PostgreSQL and Redis that they all share (%s); set secrets.databaseUrl and secrets.redisUrl (or secrets.existingSecret)" (join "; " $embedded) }}
{{- if .Values.autoscaling.enabled }}
{{- fail (printf "autoscaling.enabled=true is refused: %s" $why) }}
{{- end }}
{{- if gt (int .Values.replicaCount) 1 }}
{{- fail (printf "replicaCount=%d is refused: %s, or keep replicaCount at 1" (int .Values.replicaCount) $why) }}
{{- end }}
{{- if eq (.Values.updateStrategy.type | default "Recreate") "RollingUpdate" }}
{{- fail (printf "updateStrategy.type=RollingUpdate is refused (it runs two pods at once): %s, or leave updateStrategy empty (Recreate)" $why) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Deployment strategy: as given, else Recreate for a single-pod install (never two pods on one
SQLite file) and a surge-first rolling update when replicas share external services.
*/}}
{{- define "conveyor.updateStrategy" -}}
{{- if .Values.updateStrategy }}
{{- toYaml .Values.updateStrategy }}
{{- else if include "conveyor.canScale" . }}
type: RollingUpdate
rollingUpdate:
  maxSurge: 1
  maxUnavailable: 0
{{- else }}
type: Recreate
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

{{/* ---- the Kubernetes Inference Gateway (inferenceGateway) ---- */}}
{{- define "conveyor.inferencePoolName" -}}
{{- .Values.inferenceGateway.poolName | default (include "conveyor.fullname" .) }}
{{- end }}

{{/* An objective's priority for the endpoint picker: higher is more urgent there. */}}
{{- define "conveyor.pickerPriority" -}}
{{- if hasKey . "pickerPriority" }}{{ .pickerPriority | int64 }}{{ else }}{{ mul -1 (.priority | int64) }}{{ end }}
{{- end }}

{{/* CONVEYOR_INFERENCE_OBJECTIVES: name=priority,... */}}
{{- define "conveyor.inferenceObjectives" -}}
{{- $pairs := list }}
{{- range .Values.inferenceGateway.objectives }}
{{- $pairs = append $pairs (printf "%s=%d" .name (.priority | int64)) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/* Fails unless names are unique and Conveyor and the picker order the objectives alike. */}}
{{- define "conveyor.checkObjectives" -}}
{{- $objectives := .Values.inferenceGateway.objectives }}
{{- $names := dict }}
{{- range $a := $objectives }}
{{- if hasKey $names $a.name }}
{{- fail (printf "inferenceGateway.objectives: %s appears twice" $a.name) }}
{{- end }}
{{- $_ := set $names $a.name true }}
{{- range $b := $objectives }}
{{- $pa := include "conveyor.pickerPriority" $a | int64 }}
{{- $pb := include "conveyor.pickerPriority" $b | int64 }}
{{- if and (lt ($a.priority | int64) ($b.priority | int64)) (lt $pa $pb) }}
{{- fail (printf "inferenceGateway.objectives: %s is more urgent than %s for Conveyor (priority %d < %d) but less urgent for the picker (pickerPriority %d < %d)" $a.name $b.name ($a.priority | int64) ($b.priority | int64) $pa $pb) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

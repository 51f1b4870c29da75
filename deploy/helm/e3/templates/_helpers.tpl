{{/* Names and labels shared by every manifest. */}}
{{- define "e3.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "e3.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The Deployment and Service of a pool: (dict "root" $ "pool" $pool) */}}
{{- define "e3.poolName" -}}
{{- printf "%s-triton-%s" (include "e3.fullname" .root) .pool.name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "e3.poolSelector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: triton
e3.pool: {{ .pool.name }}
{{- end -}}

{{- define "e3.apiKeySecret" -}}
{{- default (printf "%s-api-key" (include "e3.fullname" .)) .Values.restrictedApi.existingSecret -}}
{{- end -}}

{{- define "e3.routerPool" -}}
{{- $found := "" -}}
{{- range .Values.pools -}}{{- if eq .name $.Values.router.pool -}}{{- $found = .name -}}{{- end -}}{{- end -}}
{{- if not $found -}}
{{- fail (printf "router.pool %q names no pool in pools (have: %s)" .Values.router.pool (include "e3.poolNames" .)) -}}
{{- end -}}
{{- $found -}}
{{- end -}}

{{- define "e3.poolNames" -}}
{{- $names := list -}}{{- range .Values.pools -}}{{- $names = append $names .name -}}{{- end -}}
{{- join ", " $names -}}
{{- end -}}

{{/* A pool entry with every optional field filled in, as JSON (use: include "e3.pool" $entry | fromJson). */}}
{{- define "e3.pool" -}}
{{- $d := dict "replicas" 1 "minReplicas" 1 "devicesPerPod" 1 "price" 1.0 "gpu" (dict "type" "" "count" 0)
      "nodeSelector" (dict) "tolerations" (list) "resources" (dict) "models" (list) "repository" (dict)
      "affinity" (dict) "topologySpreadConstraints" (list) "extraArgs" (list) "extraEnv" (list) -}}
{{- $p := mergeOverwrite $d (deepCopy .) -}}
{{- if not (hasKey . "maxReplicas") -}}{{- $_ := set $p "maxReplicas" (max $p.replicas $p.minReplicas) -}}{{- end -}}
{{- toJson $p -}}
{{- end -}}

{{/* The headless Service of a pool: one DNS record per ready pod, for the controller. */}}
{{- define "e3.podsName" -}}
{{- printf "%s-pods" (include "e3.poolName" . | trunc 58 | trimSuffix "-") -}}
{{- end -}}

{{/* Does a pool's replica count belong to its owner (the controller or an autoscaler) rather than the chart?
     Every pool that may run between minReplicas and maxReplicas pods, except the router's (one pod).
     Use: include "e3.scales" (dict "root" $ "pool" $pool) -> "true" or "". */}}
{{- define "e3.scales" -}}
{{- if and (ne .pool.name (include "e3.routerPool" .root)) (lt (int .pool.minReplicas) (int .pool.maxReplicas)) -}}true{{- end -}}
{{- end -}}

{{/* The checksum of the API key every pod that reads it carries: a changed key rolls those pods together. */}}
{{- define "e3.apiKeyChecksum" -}}
{{- if .Values.restrictedApi.existingSecret -}}
{{- printf "existing:%s/%s" .Values.restrictedApi.existingSecret .Values.restrictedApi.secretKey | sha256sum -}}
{{- else -}}
{{- include (print .Template.BasePath "/secret.yaml") . | sha256sum -}}
{{- end -}}
{{- end -}}

{{/* A container's securityContext (PSS restricted), with readOnlyRootFilesystem: (dict "root" $ "readOnly" bool) */}}
{{- define "e3.containerSecurity" -}}
{{- $sc := deepCopy .root.Values.containerSecurityContext -}}
{{- $_ := set $sc "readOnlyRootFilesystem" .readOnly -}}
{{- toYaml $sc -}}
{{- end -}}


{{/* The pod spec's imagePullSecrets (every pod: Triton pools and the controller); nothing when none are set. */}}
{{- define "e3.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* A pod's affinity and topology spread constraints: (dict "affinity" ... "spread" ... "selector" labels).
     A spread constraint without a labelSelector counts the pods of its own Deployment (the selector given). */}}
{{- define "e3.placement" -}}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .spread }}
{{- $constraints := list }}
{{- range .spread }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}{{ $_ := set $c "labelSelector" (dict "matchLabels" $.selector) }}{{ end }}
{{- $constraints = append $constraints $c }}
{{- end }}
topologySpreadConstraints:
  {{- toYaml $constraints | nindent 2 }}
{{- end }}
{{- end -}}

{{/* tritonserver flags a pool's extraArgs may not carry: the ones the chart sets (a later flag would override
     them: the Unix sockets the guard fronts, the repository and its control mode, readiness, metrics) and the
     ones that would open another door past the guard or change what it relies on (docs/kubernetes.md). */}}
{{- define "e3.refusedTritonFlags" -}}
model-repository model-store model-control-mode load-model strict-readiness exit-timeout-secs log-verbose
http-address http-port grpc-address grpc-port allow-http allow-grpc reuse-http-port reuse-grpc-port
http-restricted-api grpc-restricted-api http-header-forward-pattern grpc-header-forward-pattern
grpc-use-ssl grpc-use-ssl-mutual grpc-server-cert grpc-server-key grpc-root-cert
allow-sagemaker sagemaker-port sagemaker-safe-port-range sagemaker-thread-count
allow-vertex-ai vertex-ai-port vertex-ai-thread-count vertex-ai-default-model
allow-metrics allow-gpu-metrics allow-cpu-metrics metrics-address metrics-port
{{- end -}}

{{/* A pool's extraArgs, checked: (dict "pool" $pool). Each is one --flag=value word; a refused flag fails the
     render with its name. */}}
{{- define "e3.extraTritonArgs" -}}
{{- $refused := splitList " " (include "e3.refusedTritonFlags" . | replace "\n" " ") -}}
{{- range .pool.extraArgs }}
{{- $flag := regexReplaceAll "^--([^=]*).*$" . "${1}" }}
{{- if has $flag $refused }}
{{- fail (printf "pools[%s].extraArgs: %s is the chart's own or would bypass the guard (refused: --%s)" $.pool.name . (join ", --" $refused)) }}
{{- end }}
- {{ . | quote }}
{{- end }}
{{- end -}}

{{/* Names ------------------------------------------------------------------------------ */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Object names get a component suffix (-vllm-headless is the longest, 14 chars), so the
     base is kept to 40 characters: StatefulSet pod names and Service names stay valid. */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvroute.router.fullname" -}}{{ include "kvroute.fullname" . }}{{- end -}}
{{- define "kvroute.redis.fullname" -}}{{ include "kvroute.fullname" . }}-redis{{- end -}}
{{- define "kvroute.vllm.fullname" -}}{{ include "kvroute.fullname" . }}-vllm{{- end -}}
{{- define "kvroute.vllm.headless" -}}{{ include "kvroute.fullname" . }}-vllm-headless{{- end -}}
{{- define "kvroute.lmcache.fullname" -}}{{ include "kvroute.fullname" . }}-lmcache{{- end -}}

{{- define "kvroute.router.serviceAccountName" -}}
{{- if .Values.router.serviceAccount.create -}}
{{- default (include "kvroute.router.fullname" .) .Values.router.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.router.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.router.authSecretName" -}}
{{- default (printf "%s-auth" (include "kvroute.router.fullname" .)) .Values.router.auth.existingSecret -}}
{{- end -}}

{{/* Labels ----------------------------------------------------------------------------- */}}

{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" .root }}
{{ include "kvroute.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Addresses -------------------------------------------------------------------------- */}}

{{- define "kvroute.svcDomain" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain -}}
{{- end -}}

{{/* The Redis URL the router uses when it can go into the ConfigMap (bundled, or an
     external URL given in values). An external URL from a Secret goes through env. */}}
{{- define "kvroute.redisUrl" -}}
{{- if eq .Values.redis.mode "bundled" -}}
{{- printf "redis://%s.%s:%d/0" (include "kvroute.redis.fullname" .) (include "kvroute.svcDomain" .) (int .Values.redis.bundled.port) -}}
{{- else if and (eq .Values.redis.mode "external") (not .Values.redis.external.existingSecret) -}}
{{- required "redis.mode=external needs redis.external.url or redis.external.existingSecret" .Values.redis.external.url -}}
{{- end -}}
{{- end -}}

{{- define "kvroute.lmcache.host" -}}
{{- printf "%s.%s" (include "kvroute.lmcache.fullname" .) (include "kvroute.svcDomain" .) -}}
{{- end -}}

{{/* vLLM's --kv-transfer-config for LMCache multiprocess mode (LMCacheMPConnector). The
     connector joins lmcache.mp.host and lmcache.mp.port into a ZMQ endpoint, hence tcp://. */}}
{{- define "kvroute.vllm.kvTransferConfig" -}}
{{- $extra := dict "lmcache.mp.host" (printf "tcp://%s" (include "kvroute.lmcache.host" .)) "lmcache.mp.port" (int .Values.lmcache.port) -}}
{{- if eq .Values.lmcache.ipc "isolated" -}}
{{- $_ := set $extra "lmcache.mp.isolated_ipc" true -}}
{{- end -}}
{{- dict "kv_connector" "LMCacheMPConnector" "kv_role" "kv_both" "kv_connector_extra_config" $extra | toJson -}}
{{- end -}}

{{/* Whether each node runs its own LMCache server (lmcache.kind=DaemonSet): a pool per
     node, which the router tells apart only by each worker's node. */}}
{{- define "kvroute.lmcache.perNode" -}}
{{- if and .Values.lmcache.enabled (eq .Values.lmcache.kind "DaemonSet") -}}true{{- end -}}
{{- end -}}

{{/* LMCache's disk tier: its fs_native L2 adapter on the pod's disk volume, bounded by
     sizeGb (max_capacity_gb counts usage; the eviction block is what enforces it). */}}
{{- define "kvroute.lmcache.diskAdapter" -}}
{{- $d := .Values.lmcache.disk -}}
{{- $spec := dict "type" "fs_native" "base_path" $d.path "max_capacity_gb" $d.sizeGb "eviction" (dict "eviction_policy" "LRU") -}}
{{- mergeOverwrite $spec (deepCopy ($d.adapter | default dict)) | toJson -}}
{{- end -}}

{{/* LMCache's remote tier, an L2 adapter every node's server shares: from a redis:// URL
     (the resp adapter), with lmcache.remote.adapter merged over it or standing alone. The
     MP server takes its tiers as --l2-adapter specs, not the in-process engine's
     remote_url, so other stores (s3, valkey, mooncake_store, a shared fs_native, ...) are
     given as their adapter spec. */}}
{{- define "kvroute.lmcache.remoteAdapter" -}}
{{- $rm := .Values.lmcache.remote -}}
{{- $spec := dict "shared" true -}}
{{- with $rm.url -}}
{{- $u := urlParse . -}}
{{- if ne $u.scheme "redis" -}}
{{- fail (printf "lmcache.remote.url must be redis://HOST:PORT (LMCache's resp adapter), not %q: set lmcache.remote.adapter for other stores" .) -}}
{{- end -}}
{{- if $u.userinfo -}}
{{- fail "lmcache.remote.url must not carry credentials (they would show in the pod spec): set lmcache.remote.existingSecret" -}}
{{- end -}}
{{- if not (has $u.path (list "" "/")) -}}
{{- fail (printf "lmcache.remote.url: LMCache's resp adapter has no database number (%s)" $u.path) -}}
{{- end -}}
{{- $port := regexFind ":[0-9]+$" $u.host -}}
{{- $host := trimSuffix $port $u.host | trimPrefix "[" | trimSuffix "]" -}}
{{- $_ := set $spec "type" "resp" -}}
{{- $_ := set $spec "host" $host -}}
{{- $_ := set $spec "port" (int (trimPrefix ":" $port | default "6379")) -}}
{{- end -}}
{{- $spec = mergeOverwrite $spec (deepCopy ($rm.adapter | default dict)) -}}
{{- if not (hasKey $spec "type") -}}
{{- fail "lmcache.remote.enabled needs lmcache.remote.url (redis://HOST:PORT) or lmcache.remote.adapter (an LMCache L2 adapter spec with a type)" -}}
{{- end -}}
{{- toJson $spec -}}
{{- end -}}

{{- define "kvroute.vllm.kvEventsConfig" -}}
{{- dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int .Values.vllm.kvEvents.port)) "topic" .Values.vllm.kvEvents.topic | toJson -}}
{{- end -}}

{{/* Whether pods get a memory-backed /dev/shm: not with hostIPC, where /dev/shm must be the
     host's for CUDA IPC between the vLLM and LMCache pods. */}}
{{- define "kvroute.podShm" -}}
{{- if not (and .Values.lmcache.enabled (eq .Values.lmcache.ipc "host")) -}}true{{- end -}}
{{- end -}}

{{/* REGISTRY/REPOSITORY:TAG; registry optional (only the router's image has one), tag
     defaulting to .default (the chart's appVersion). */}}
{{- define "kvroute.image" -}}
{{- $repository := .image.repository -}}
{{- with .image.registry }}{{ $repository = printf "%s/%s" (trimSuffix "/" .) $repository }}{{ end -}}
{{- printf "%s:%s" $repository (toString (default .default .image.tag)) -}}
{{- end -}}

{{/* How the router finds the vLLM workers. auto: k8s:// with one LMCache server per node
     (EndpointSlices say each worker's node, and so which pool it loads from), else dns://.
     DNS and static names cannot say where a pod runs: with a pool per node they would let
     the router count on one node's pool for a worker on another, so they are refused. */}}
{{- define "kvroute.router.discoveryMode" -}}
{{- $mode := .Values.router.discovery.mode -}}
{{- $perNode := include "kvroute.lmcache.perNode" . -}}
{{- if eq $mode "auto" -}}
{{- ternary "k8s" "dns" (eq $perNode "true") -}}
{{- else -}}
{{- if and $perNode .Values.vllm.enabled (ne $mode "k8s") -}}
{{- fail (printf "lmcache.kind=DaemonSet needs router.discovery.mode k8s or auto, not %s: only EndpointSlices tell the router which node (and LMCache pool) each worker is on" $mode) -}}
{{- end -}}
{{- $mode -}}
{{- end -}}
{{- end -}}

{{/* Whether the router talks to the API server (k8s:// discovery of the chart's workers,
     or of the InferencePool's pods in epp mode). */}}
{{- define "kvroute.router.usesApi" -}}
{{- if or (include "kvroute.epp.enabled" .) (and .Values.vllm.enabled (eq (include "kvroute.router.discoveryMode" .) "k8s")) -}}true{{- end -}}
{{- end -}}

{{/* EPP mode (router.mode=epp): the router is the InferencePool's endpoint picker. */}}
{{- define "kvroute.epp.enabled" -}}
{{- if eq .Values.router.mode "epp" -}}true{{- end -}}
{{- end -}}

{{- define "kvroute.epp.poolName" -}}
{{- default (include "kvroute.fullname" .) .Values.epp.inferencePool.name -}}
{{- end -}}

{{/* The headless Service whose selector is the pool's: its EndpointSlices are the pool's
     ready pods, which the picker discovers. */}}
{{- define "kvroute.epp.poolService" -}}{{ include "kvroute.fullname" . }}-pool{{- end -}}

{{/* The pool's pod selector (matchLabels), as YAML: the chart's vLLM pods unless given. */}}
{{- define "kvroute.epp.selector" -}}
{{- with .Values.epp.inferencePool.selector -}}
{{- toYaml . -}}
{{- else -}}
{{- if not .Values.vllm.enabled -}}
{{- fail "router.mode=epp without vllm.enabled needs epp.inferencePool.selector (the model servers' pod labels)" -}}
{{- end -}}
{{- include "kvroute.selectorLabels" (dict "root" . "component" "vllm") -}}
{{- end -}}
{{- end -}}

{{/* The pool's target ports, as a JSON list of numbers (vllm.port unless given). */}}
{{- define "kvroute.epp.targetPorts" -}}
{{- $ports := list -}}
{{- range (.Values.epp.inferencePool.targetPorts | default (list .Values.vllm.port)) -}}
{{- $ports = append $ports (int .) -}}
{{- end -}}
{{- toJson $ports -}}
{{- end -}}

{{/* The router's config file: keys are `kvroute serve` flag names with underscores. */}}
{{- define "kvroute.router.config" -}}
{{- $r := .Values.router -}}
{{- $cfg := dict "host" "0.0.0.0" "port" (int $r.port) "policy" $r.policy "processes" (int $r.processes) "log_level" $r.logLevel -}}
{{- $workers := list -}}
{{- $kvEvents := list -}}
{{- if include "kvroute.epp.enabled" . -}}
{{- /* The picker's candidates are the pool's endpoints: every ready pod of its selector,
       at each target port (named IP:PORT, as the gateway names them). */ -}}
{{- $_ := set $cfg "epp_listen" (printf "0.0.0.0:%d" (int .Values.epp.grpcPort)) -}}
{{- if eq .Values.epp.tls.mode "selfSigned" -}}
{{- $_ := set $cfg "epp_self_signed_tls" true -}}
{{- else if eq .Values.epp.tls.mode "secret" -}}
{{- $_ := required "epp.tls.mode=secret needs epp.tls.secretName (a kubernetes.io/tls Secret)" .Values.epp.tls.secretName -}}
{{- $_ := set $cfg "epp_tls_cert_file" "/etc/kvroute/epp-tls/tls.crt" -}}
{{- $_ := set $cfg "epp_tls_key_file" "/etc/kvroute/epp-tls/tls.key" -}}
{{- end -}}
{{- $discover := list -}}
{{- range (include "kvroute.epp.targetPorts" . | fromJsonArray) -}}
{{- $discover = append $discover (printf "k8s://%s/%s:%d" $.Release.Namespace (include "kvroute.epp.poolService" $) (int .)) -}}
{{- end -}}
{{- $_ := set $cfg "discover" $discover -}}
{{- else if .Values.vllm.enabled -}}
{{- $mode := include "kvroute.router.discoveryMode" . -}}
{{- if eq $mode "dns" -}}
{{- $_ := set $cfg "discover" (list (printf "dns://%s.%s:%d" (include "kvroute.vllm.headless" .) (include "kvroute.svcDomain" .) (int .Values.vllm.port))) -}}
{{- else if eq $mode "k8s" -}}
{{- $_ := set $cfg "discover" (list (printf "k8s://%s/%s:%d" .Release.Namespace (include "kvroute.vllm.headless" .) (int .Values.vllm.port))) -}}
{{- else -}}
{{- range $i, $_ := until (int .Values.vllm.replicas) -}}
{{- $host := printf "%s-%d.%s.%s" (include "kvroute.vllm.fullname" $) $i (include "kvroute.vllm.headless" $) (include "kvroute.svcDomain" $) -}}
{{- $workers = append $workers (printf "vllm-%d=http://%s:%d" $i $host (int $.Values.vllm.port)) -}}
{{- if $.Values.vllm.kvEvents.enabled -}}
{{- $kvEvents = append $kvEvents (printf "vllm-%d=tcp://%s:%d" $i $host (int $.Values.vllm.kvEvents.port)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and (include "kvroute.epp.enabled" .) $r.workers -}}
{{- fail "router.mode=epp: the picker's endpoints are the InferencePool's pods; router.workers would name endpoints the gateway cannot reach" -}}
{{- end -}}
{{- $workers = concat $workers $r.workers -}}
{{- $kvEvents = concat $kvEvents $r.kvEvents -}}
{{- if $workers -}}{{- $_ := set $cfg "workers" $workers -}}{{- end -}}
{{- $p := $r.precise -}}
{{- if $p.tokenizer -}}
{{- /* Precise mode: its settings are config keys like every other (router/config_loader.py);
       KV-event endpoints only mean something with it (the router refuses them alone). */ -}}
{{- $_ := set $cfg "tokenizer" $p.tokenizer -}}
{{- if $p.blockSize -}}{{- $_ := set $cfg "block_size" (int $p.blockSize) -}}{{- end -}}
{{- if $p.hashAlgo -}}{{- $_ := set $cfg "hash_algo" $p.hashAlgo -}}{{- end -}}
{{- if $p.hashSeed -}}{{- $_ := set $cfg "hash_seed" (toString $p.hashSeed) -}}{{- end -}}
{{- $_ := set $cfg "kv_events_discover" $p.kvEventsDiscover -}}
{{- $_ := set $cfg "kv_events_cpu" $p.kvEventsCpu -}}
{{- if $kvEvents -}}{{- $_ := set $cfg "kv_events" $kvEvents -}}{{- end -}}
{{- end -}}
{{- if $r.kvCapacityTokens -}}{{- $_ := set $cfg "kv_capacity_tokens" (int64 $r.kvCapacityTokens) -}}{{- end -}}
{{- $lm := .Values.lmcache -}}
{{- if $r.poolCapacityTokens -}}
{{- $_ := set $cfg "pool_capacity_tokens" (int64 $r.poolCapacityTokens) -}}
{{- else if $lm.enabled -}}
{{- /* Tell the router each node's pool exists and how many tokens it holds (one server,
       or one per node: the flag is per node either way): without it the router never
       counts on a pool hit. */ -}}
{{- $_ := set $cfg "pool_capacity_tokens" (div (mul (int64 $lm.maxMemoryGb) 1073741824) (int64 $lm.kvBytesPerToken)) -}}
{{- end -}}
{{- if and $lm.enabled $lm.disk.enabled -}}
{{- $tokens := $lm.disk.capacityTokens | default (div (mul (int64 $lm.disk.sizeGb) 1073741824) (int64 $lm.kvBytesPerToken)) -}}
{{- $_ := set $cfg "disk_capacity_tokens" (int64 $tokens) -}}
{{- if $lm.disk.gbytesPerSecond -}}{{- $_ := set $cfg "disk_gbytes_s" (float64 $lm.disk.gbytesPerSecond) -}}{{- end -}}
{{- end -}}
{{- if and $lm.enabled $lm.remote.enabled -}}
{{- /* A remote store's size is not LMCache's to know (Redis' maxmemory, a bucket): say it. */ -}}
{{- $_ := set $cfg "remote_capacity_tokens" (int64 (required "lmcache.remote.enabled needs lmcache.remote.capacityTokens (how many tokens of KV the remote store holds)" $lm.remote.capacityTokens)) -}}
{{- if $lm.remote.gbps -}}{{- $_ := set $cfg "remote_gbps" (float64 $lm.remote.gbps) -}}{{- end -}}
{{- end -}}
{{- if and $lm.enabled (or $lm.disk.enabled $lm.remote.enabled) -}}
{{- /* Disk and remote loads are priced from their bandwidth and the model's KV size. */ -}}
{{- $_ := set $cfg "kv_bytes_per_token" (int64 $lm.kvBytesPerToken) -}}
{{- end -}}
{{- $redis := include "kvroute.redisUrl" . -}}
{{- if $redis -}}{{- $_ := set $cfg "redis" $redis -}}{{- end -}}
{{- if ne .Values.redis.mode "none" -}}{{- $_ := set $cfg "redis_prefix" .Values.redis.prefix -}}{{- end -}}
{{- if or $r.auth.apiKeys $r.auth.existingSecret -}}
{{- $_ := set $cfg "api_keys_file" (printf "/etc/kvroute/secrets/%s" $r.auth.apiKeysKey) -}}
{{- end -}}
{{- if or $r.auth.adminToken (and $r.auth.existingSecret $r.auth.adminTokenKey) -}}
{{- $_ := set $cfg "admin_token_file" (printf "/etc/kvroute/secrets/%s" $r.auth.adminTokenKey) -}}
{{- end -}}
{{- $t := .Values.tracing -}}
{{- if $t.otlpEndpoint -}}
{{- $_ := set $cfg "otlp_endpoint" $t.otlpEndpoint -}}
{{- $_ := set $cfg "otlp_protocol" $t.protocol -}}
{{- $_ := set $cfg "trace_sample_ratio" (float64 $t.sampleRatio) -}}
{{- $_ := set $cfg "trace_service_name" $t.serviceName -}}
{{- end -}}
{{- if and (not $workers) (not (hasKey $cfg "discover")) (not (hasKey $r.extraConfig "workers")) (not (hasKey $r.extraConfig "discover")) -}}
{{- fail "the router has no workers: enable vllm, or list router.workers / set router.extraConfig.discover" -}}
{{- end -}}
{{- toYaml (mergeOverwrite $cfg $r.extraConfig) -}}
{{- end -}}

{{/* vLLM's --otlp-traces-endpoint: the collector's traces URL over http (vLLM's HTTP exporter
     takes it whole), its address over grpc. */}}
{{- define "kvroute.vllm.tracesEndpoint" -}}
{{- $t := .Values.tracing -}}
{{- if and (eq $t.protocol "http") (not (regexMatch "^[a-z]+://[^/]+/." $t.otlpEndpoint)) -}}
{{- printf "%s/v1/traces" (trimSuffix "/" $t.otlpEndpoint) -}}
{{- else -}}
{{- $t.otlpEndpoint -}}
{{- end -}}
{{- end -}}

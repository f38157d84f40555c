{{/* Chart name. */}}
{{- define "kube-vgpu.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Prefix of every resource name (kept short enough for "-device-plugin" suffixes). */}}
{{- define "kube-vgpu.fullname" -}}
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

{{- define "kube-vgpu.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Selector labels; call with (dict "root" $ "component" "scheduler"). */}}
{{- define "kube-vgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kube-vgpu.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Labels of every object; call with (dict "root" $ "component" "scheduler"). */}}
{{- define "kube-vgpu.labels" -}}
{{ include "kube-vgpu.selectorLabels" . }}
helm.sh/chart: {{ include "kube-vgpu.chart" .root }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: kube-vgpu
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Pod labels: the selector labels only. Our own pods are not mutated because the webhook skips the
     release namespace (namespaceSelector); they carry no kube-vgpu.io/ label, which the chart's
     ValidatingAdmissionPolicy would refuse on a pod. */}}
{{- define "kube-vgpu.podLabels" -}}
{{ include "kube-vgpu.selectorLabels" . }}
{{- end -}}

{{/* The image of one component: (dict "root" $ "component" "webhook"), overrides from image.overrides. */}}
{{- define "kube-vgpu.image" -}}
{{- $img := .root.Values.image -}}
{{- $o := get (default (dict) $img.overrides) .component | default (dict) -}}
{{- printf "%s:%s" (default $img.repository $o.repository) (default (default .root.Chart.AppVersion $img.tag) $o.tag) -}}
{{- end -}}

{{/* kube-scheduler tag: the value, else the cluster version without vendor suffix (v1.31.4-eks-x -> v1.31.4). */}}
{{- define "kube-vgpu.kubeSchedulerTag" -}}
{{- $img := .Values.scheduler.kubeScheduler.image -}}
{{- if $img.tag -}}
{{- $img.tag -}}
{{- else -}}
{{- $v := regexFind "^v?[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- if not $v -}}
{{- fail (printf "cannot derive a kube-scheduler image tag from the cluster version %q; set scheduler.kubeScheduler.image.tag" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
{{- if hasPrefix "v" $v }}{{ $v }}{{ else }}v{{ $v }}{{ end -}}
{{- end -}}
{{- end -}}

{{/* "true" when kube-scheduler leader election is on. */}}
{{- define "kube-vgpu.leaderElect" -}}
{{- $le := toString .Values.scheduler.leaderElection.enabled -}}
{{- if eq $le "auto" -}}
{{- if gt (int .Values.scheduler.replicas) 1 }}true{{ else }}false{{ end -}}
{{- else if eq $le "true" -}}
true
{{- else -}}
{{- if gt (int .Values.scheduler.replicas) 1 -}}
{{- fail (printf "scheduler.leaderElection.enabled=false with scheduler.replicas=%d: several kube-schedulers without leader election would bind the same pods; use auto or true" (int .Values.scheduler.replicas)) -}}
{{- end -}}
false
{{- end -}}
{{- end -}}

{{/* "true" when the extender runs its own Lease election. */}}
{{- /* The extender's election: "follow" (lead while this pod's kube-scheduler holds its Lease;
     auto, when kube-scheduler elects), "own" (true: a Lease of its own), or "off". */ -}}
{{- define "kube-vgpu.extenderLeaderElect" -}}
{{- $le := toString .Values.scheduler.extender.leaderElect -}}
{{- if eq $le "true" }}own{{ else if and (eq $le "auto") (eq (include "kube-vgpu.leaderElect" .) "true") }}follow{{ else }}off{{ end -}}
{{- end -}}

{{- define "kube-vgpu.webhookService" -}}
{{- printf "%s-webhook" (include "kube-vgpu.fullname" .) -}}
{{- end -}}

{{- define "kube-vgpu.webhookSecret" -}}
{{- default (printf "%s-webhook-tls" (include "kube-vgpu.fullname" .)) .Values.webhook.tlsSecretName -}}
{{- end -}}

{{- define "kube-vgpu.webhookConfigName" -}}
{{- printf "%s-webhook" (include "kube-vgpu.fullname" .) -}}
{{- end -}}

{{/* The policy file: the domain config (kube-vgpu.io/v1) exactly as the components read it, with
     webhook.systemUsers completed by the extender's and device plugin's ServiceAccount user names, and
     webhook.mutateBareGpu false while DRA maps config.resourceNames.gpu (kube-vgpu.draMapsGpu). */}}
{{- define "kube-vgpu.configYaml" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $webhook := default dict $cfg.webhook -}}
{{- $users := concat (include "kube-vgpu.systemUsers" . | fromJsonArray) (default list $webhook.systemUsers) | uniq -}}
{{- $_ := set $webhook "systemUsers" $users -}}
{{- /* DRA serves the GPU count resource on every node (dra.nodes=all and the extended-resource mapping
     of config.resourceNames.gpu): a pod asking only for it is left to its own scheduler (docs/dra.md). */ -}}
{{- if eq (include "kube-vgpu.draMapsGpu" .) "true" -}}
{{- $_ := set $webhook "mutateBareGpu" false -}}
{{- end -}}
{{- $_ := set $cfg "webhook" $webhook -}}
apiVersion: kube-vgpu.io/v1
{{ toYaml $cfg }}
{{- end -}}

{{/* The default preferred anti-affinity for a component; call with (dict "root" $ "component" "x"). */}}
{{- define "kube-vgpu.spreadAffinity" -}}
podAntiAffinity:
  preferredDuringSchedulingIgnoredDuringExecution:
    - weight: 100
      podAffinityTerm:
        topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "kube-vgpu.selectorLabels" . | nindent 12 }}
{{- end -}}

{{/* Restricted container security context for our non-root containers. */}}
{{- define "kube-vgpu.restrictedSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* Cross-value checks the schema cannot express; rendered (as nothing) by configmap-policy.yaml. */}}
{{- define "kube-vgpu.validate" -}}
{{- if eq (toString .Values.config.schedulerName) "default-scheduler" -}}
{{- fail "config.schedulerName=default-scheduler: the chart runs a second kube-scheduler, which would race the control plane's default-scheduler for every pod; use a name of its own (default kube-vgpu-scheduler)" -}}
{{- end -}}
{{- include "kube-vgpu.validateConfig" .Values.config -}}
{{- if and .Values.scheduler.enabled (eq (include "kube-vgpu.leaderElect" .) "true") -}}
{{- $le := .Values.scheduler.leaderElection -}}
{{- $lease := float64 (include "kube-vgpu.durationSeconds" $le.leaseDuration) -}}
{{- $renew := float64 (include "kube-vgpu.durationSeconds" $le.renewDeadline) -}}
{{- $retry := float64 (include "kube-vgpu.durationSeconds" $le.retryPeriod) -}}
{{- /* kube-scheduler refuses to start otherwise: its config validation wants leaseDuration >
     renewDeadline and every period > 0, client-go's elector renewDeadline > 1.2 x retryPeriod */ -}}
{{- if not (and (gt $lease $renew) (gt $retry 0.0) (gt $renew (mulf 1.2 $retry))) -}}
{{- fail (printf "scheduler.leaderElection: leaseDuration=%s, renewDeadline=%s, retryPeriod=%s would stop kube-scheduler at start; allowed: leaseDuration > renewDeadline > 1.2 x retryPeriod > 0 (default 15s, 10s, 2s)" (toString $le.leaseDuration) (toString $le.renewDeadline) (toString $le.retryPeriod)) -}}
{{- end -}}
{{- end -}}
{{- range $key := list "pluginDir" "podResourcesDir" "shimHostDir" "cacheHostDir" -}}
{{- include "kube-vgpu.validateHostDir" (list (printf "devicePlugin.%s" $key) (index $.Values.devicePlugin $key)) -}}
{{- end -}}
{{- range $key := list "pluginsDir" "registryDir" "cdiDir" -}}
{{- include "kube-vgpu.validateHostDir" (list (printf "dra.%s" $key) (index $.Values.dra $key)) -}}
{{- end -}}
{{- /* the schema checks simulateGPUs' form; the device plugin (deviceplugin/simgpu.py) also
     refuses these numbers at start, so every device plugin pod would crash-loop */ -}}
{{- with .Values.devicePlugin.simulateGPUs -}}
{{- $spec := toString . -}}
{{- $allowed := "comma-separated COUNTxMIB[:MODEL] groups, e.g. 4x24576 or 2x81920:H100-sim,1x16384; 1..64 GPUs in all, 1..1048576 MiB each" -}}
{{- $total := 0 -}}
{{- range $part := splitList "," $spec -}}
{{- $g := trim $part -}}
{{- $count := atoi (regexReplaceAll `^(\d+)x.*$` $g "${1}") -}}
{{- $mib := atoi (regexReplaceAll `^\d+x(\d+).*$` $g "${1}") -}}
{{- if or (lt $count 1) (lt $mib 1) (gt $mib 1048576) -}}
{{- fail (printf "devicePlugin.simulateGPUs=%q: group %q is out of range; allowed: %s" $spec $g $allowed) -}}
{{- end -}}
{{- $total = add $total $count -}}
{{- end -}}
{{- if gt (int $total) 64 -}}
{{- fail (printf "devicePlugin.simulateGPUs=%q: %d GPUs; allowed: %s" $spec (int $total) $allowed) -}}
{{- end -}}
{{- end -}}
{{- if and .Values.scheduler.enabled .Values.devicePlugin.enabled -}}
{{- $stale := float64 .Values.config.scheduling.inventoryStaleSeconds -}}
{{- $hb := float64 .Values.devicePlugin.heartbeatSeconds -}}
{{- if lt $stale (mulf 2 $hb) -}}
{{- fail (printf "config.scheduling.inventoryStaleSeconds=%v must be at least 2 x devicePlugin.heartbeatSeconds=%v (%v): otherwise every node's inventory goes stale between heartbeats and no vGPU pod can be scheduled; raise inventoryStaleSeconds or lower heartbeatSeconds" $stale $hb (mulf 2 $hb)) -}}
{{- end -}}
{{- end -}}
{{- end -}}


{{/* The config loader's checks that JSON Schema cannot state ("not in the schema" in
     docs/configuration.md): the chart refuses these values too, or helm would install a policy file
     every component refuses to start with. Call with .Values.config. */}}
{{- define "kube-vgpu.validateConfig" -}}
{{- $names := list -}}
{{- range $k := list "gpu" "gpumem" "gpumemPercentage" "gpucores" "priority" -}}
{{- $v := toString (dig "resourceNames" $k "" $) -}}
{{- if has $v $names -}}
{{- fail (printf "config.resourceNames.%s=%q is also another resourceNames entry: the five names must be distinct (each request kind needs its own extended resource)" $k $v) -}}
{{- end -}}
{{- $names = append $names $v -}}
{{- end -}}
{{- $firstNode := dict -}}
{{- range $i, $n := ($.nodes | default list) -}}
{{- $nn := toString (get $n "name") -}}
{{- if hasKey $firstNode $nn -}}
{{- fail (printf "config.nodes[%d].name=%q is also config.nodes[%v].name: only one entry would apply; allowed: one entry per node" $i $nn (get $firstNode $nn)) -}}
{{- end -}}
{{- $_ := set $firstNode $nn $i -}}
{{- end -}}
{{- $rc := toString (dig "webhook" "runtimeClassName" "" $) -}}
{{- $allowedRc := dig "webhook" "allowedRuntimeClasses" (list) $ -}}
{{- if and $rc (not (has $rc $allowedRc)) -}}
{{- fail (printf "config.webhook.runtimeClassName=%q is not in config.webhook.allowedRuntimeClasses (%s): the webhook would write a runtime class its own rules deny; allowed: one of config.webhook.allowedRuntimeClasses, or \"\"" $rc (join ", " $allowedRc)) -}}
{{- end -}}
{{- $shm := toString (dig "webhook" "shmSizeLimit" "" $) -}}
{{- if $shm -}}
{{- $exp := regexFind `[eE][-+]?[0-9]+$` $shm -}}
{{- $e := atoi (regexReplaceAll `^[eE]\+?` $exp "") -}}
{{- if regexMatch `^\+?(0+(\.0*)?|\.0+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?[0-9]+)?$` $shm -}}
{{- fail (printf "config.webhook.shmSizeLimit=%q is not allowed: a /dev/shm of size 0 is unusable; allowed: a quantity > 0 (e.g. 64Mi, 8Gi), or \"\" for no limit" $shm) -}}
{{- else if or (gt $e 30) (lt $e -30) -}}
{{- fail (printf "config.webhook.shmSizeLimit=%q is not allowed: exponent out of range; allowed: a quantity > 0 (e.g. 64Mi, 8Gi) with an exponent of at most 30, or \"\" for no limit" $shm) -}}
{{- end -}}
{{- end -}}
{{- $t := toString (dig "scheduling" "adoptUnsignedBefore" "" $) -}}
{{- if $t -}}
{{- /* as the loader reads it (Python's datetime.fromisoformat): a real date and time (checked here in
     UTC), and a zone offset of less than 24 hours */ -}}
{{- $u := upper $t -}}
{{- $local := regexReplaceAll `(Z|[+-][0-9]{2}:[0-9]{2})$` $u "Z" -}}
{{- $off := regexFind `[+-][0-9]{2}:[0-9]{2}$` $u -}}
{{- $offMinutes := 0 -}}
{{- if $off -}}
{{- $offMinutes = add (mul (atoi (substr 1 3 $off)) 60) (atoi (substr 4 6 $off)) -}}
{{- end -}}
{{- $zero := and (toDate "2006-01-02T15:04:05Z07:00" $local).IsZero (not (regexMatch `^0001-01-01T00:00:00(\.0+)?Z$` $local)) -}}
{{- if or $zero (ge (int $offMinutes) 1440) -}}
{{- fail (printf "config.scheduling.adoptUnsignedBefore=%q is not a real date and time; allowed: an RFC 3339 time with a zone (e.g. 2026-03-01T00:00:00Z), or \"\" (off)" $t) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* A host directory the chart mounts (most read-write, files replaced in them) must be a dedicated
     directory: no "." or ".." component, and not a system directory itself. The schema checks the
     shape (absolute, no trailing slash). Call with (list "<key>" <value>). */}}
{{- define "kube-vgpu.validateHostDir" -}}
{{- $key := index . 0 -}}
{{- $dir := toString (index . 1) -}}
{{- $system := list "/bin" "/boot" "/dev" "/etc" "/home" "/lib" "/lib32" "/lib64" "/opt" "/proc" "/root" "/run" "/sbin" "/srv" "/sys" "/tmp" "/usr" "/usr/bin" "/usr/lib" "/usr/lib64" "/usr/local" "/usr/local/bin" "/usr/local/lib" "/usr/sbin" "/var" "/var/lib" "/var/lib/kubelet" "/var/run" -}}
{{- if regexMatch `(^|/)\.{1,2}(/|$)` $dir -}}
{{- fail (printf "%s=%q has a . or .. component; allowed: an absolute path of a dedicated directory, written without . or .." $key $dir) -}}
{{- else if has $dir $system -}}
{{- fail (printf "%s=%q is a system directory, not one of its own: the chart mounts it into a pod from the host (most of these read-write); allowed: a dedicated directory of its own, e.g. %s/kube-vgpu" $key $dir $dir) -}}
{{- end -}}
{{- end -}}

{{/* Seconds (a float) of a Go duration such as 1m30s or 500ms; the schema checks its form. */}}
{{- define "kube-vgpu.durationSeconds" -}}
{{- $units := dict "ns" 0.000000001 "us" 0.000001 "µs" 0.000001 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 -}}
{{- $total := 0.0 -}}
{{- range $part := regexFindAll `[0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h)` (toString .) -1 -}}
{{- $num := regexFind `^[0-9]+(\.[0-9]+)?` $part -}}
{{- $total = addf $total (mulf (float64 $num) (get $units (trimPrefix $num $part))) -}}
{{- end -}}
{{- $total -}}
{{- end -}}

{{/* ServiceAccount names, one per component. */}}
{{- define "kube-vgpu.schedulerSA" -}}
{{- printf "%s-scheduler" (include "kube-vgpu.fullname" .) -}}
{{- end -}}

{{/* The extender's ServiceAccount: its own (<fullname>-extender) unless
     scheduler.extender.ownServiceAccount is false, then the pod's (<fullname>-scheduler). */}}
{{- define "kube-vgpu.extenderSA" -}}
{{- if .Values.scheduler.extender.ownServiceAccount -}}
{{- printf "%s-extender" (include "kube-vgpu.fullname" .) -}}
{{- else -}}
{{- include "kube-vgpu.schedulerSA" . -}}
{{- end -}}
{{- end -}}

{{- define "kube-vgpu.devicePluginSA" -}}
{{- printf "%s-device-plugin" (include "kube-vgpu.fullname" .) -}}
{{- end -}}

{{/* The user names the API server gives a ServiceAccount's requests: call with (list $ "<sa name>"). */}}
{{- define "kube-vgpu.saUser" -}}
{{- printf "system:serviceaccount:%s:%s" (index . 0).Release.Namespace (index . 1) -}}
{{- end -}}

{{/* The users allowed to write system-owned pod annotations and labels (kube_vgpu.resources.system_owned):
     the extender's and the device plugin's ServiceAccounts, as a JSON list. */}}
{{- define "kube-vgpu.systemUsers" -}}
{{- $users := list (include "kube-vgpu.saUser" (list . (include "kube-vgpu.extenderSA" .)))
                   (include "kube-vgpu.saUser" (list . (include "kube-vgpu.devicePluginSA" .))) -}}
{{- toJson $users -}}
{{- end -}}

{{/* "true" when the ValidatingAdmissionPolicies are installed (admissionPolicies.enabled: auto = on
     Kubernetes >= 1.30, where admissionregistration.k8s.io/v1 serves them). */}}
{{- define "kube-vgpu.admissionPolicies" -}}
{{- $on := toString .Values.admissionPolicies.enabled -}}
{{- $served := semverCompare ">=1.30.0-0" .Capabilities.KubeVersion.Version -}}
{{- if eq $on "auto" -}}
{{- if $served }}true{{ else }}false{{ end -}}
{{- else if eq $on "true" -}}
{{- if not $served -}}
{{- fail (printf "admissionPolicies.enabled=true needs Kubernetes >= 1.30 (admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy), the cluster is %s; use auto or false" .Capabilities.KubeVersion.Version) -}}
{{- end -}}
true
{{- else -}}
false
{{- end -}}
{{- end -}}

{{/* The allocation signing keys: Secret name and where the extender and device plugin mount it. */}}
{{- define "kube-vgpu.signingKeysSecret" -}}
{{- printf "%s-signing-keys" (include "kube-vgpu.fullname" .) -}}
{{- end -}}

{{- define "kube-vgpu.signingKeysDir" -}}
/etc/kube-vgpu/signing
{{- end -}}

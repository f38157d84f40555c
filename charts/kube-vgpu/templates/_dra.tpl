{{/* "true" when the DRA plugin runs on every GPU node (dra.enabled, dra.nodes=all): the device-plugin
     DaemonSet is then not rendered (one node component per node). */}}
{{- define "kube-vgpu.draAllNodes" -}}
{{- if and .Values.dra.enabled (eq .Values.dra.nodes "all") }}true{{ else }}false{{ end -}}
{{- end -}}

{{/* "true" when the extender scores the nodes of pods that carry DRA claims (dra.extenderScoring: the
     second extender entry, its flags and its RBAC); it needs dra.enabled (the DeviceClasses). */}}
{{- define "kube-vgpu.draScoring" -}}
{{- if and .Values.dra.extenderScoring (not .Values.dra.enabled) -}}
{{- fail "dra.extenderScoring=true needs dra.enabled=true: the extender ranks nodes for claims on kube-vgpu's DeviceClasses, which dra.enabled installs" -}}
{{- end -}}
{{- if and .Values.dra.enabled .Values.dra.extenderScoring }}true{{ else }}false{{ end -}}
{{- end -}}

{{/* "true" when DRA serves the GPU count resource itself (config.resourceNames.gpu, nvidia.com/gpu by
     default) through the extended-resource mapping: dra.enabled and dra.deviceClass or one of
     dra.modelClasses has extendedResourceName equal to it (docs/dra.md, "Extended-resource mapping"). */}}
{{- define "kube-vgpu.draMapsGpu" -}}
{{- $gpu := .Values.config.resourceNames.gpu -}}
{{- $maps := false -}}
{{- if .Values.dra.enabled -}}
{{- if eq (toString .Values.dra.deviceClass.extendedResourceName) $gpu }}{{ $maps = true }}{{ end -}}
{{- range .Values.dra.modelClasses }}{{ if eq (toString .extendedResourceName) $gpu }}{{ $maps = true }}{{ end }}{{ end -}}
{{- end -}}
{{- if $maps }}true{{ else }}false{{ end -}}
{{- end -}}

{{/* Cross-value checks of the extended-resource mapping (rendered, as nothing, by dra.yaml). */}}
{{- define "kube-vgpu.draValidateMapping" -}}
{{- $rn := .Values.config.resourceNames -}}
{{- $gpu := $rn.gpu -}}
{{- $names := list .Values.dra.deviceClass.extendedResourceName -}}
{{- range .Values.dra.modelClasses }}{{ $names = append $names .extendedResourceName }}{{ end -}}
{{- range $names -}}
{{- $n := toString . -}}
{{- if and $n (has $n (list $rn.gpumem $rn.gpumemPercentage $rn.gpucores $rn.priority)) -}}
{{- fail (printf "dra extendedResourceName=%s is one of config.resourceNames' vGPU amounts (gpumem, gpumemPercentage, gpucores, priority): the mapping counts whole GPUs, so a pod asking %s: 3000 would get 3000 GPUs; allowed: config.resourceNames.gpu (%s) with dra.nodes=all, or a name of its own" $n $n $gpu) -}}
{{- end -}}
{{- end -}}
{{- if and (eq (include "kube-vgpu.draMapsGpu" .) "true") (ne (toString .Values.dra.nodes) "all") -}}
{{- fail (printf "dra extendedResourceName=%s (dra.deviceClass or dra.modelClasses) equals config.resourceNames.gpu, refused with dra.nodes=%s: the device-plugin nodes advertise %s as vGPU slots that only the kube-vgpu scheduler may book, so the webhook routes every pod asking for it to that scheduler, whose extender never places a pod on a DRA node: the mapping would serve no pod. Allowed: dra.nodes=all (no device plugin; the webhook then leaves whole-GPU pods to their own scheduler), or an extendedResourceName of its own (e.g. example.com/dra-gpu)" $gpu (toString .Values.dra.nodes) $gpu) -}}
{{- end -}}
{{- end -}}

{{/* "true" when the DRA plugin runs on every GPU node (dra.enabled, dra.nodes=all): the device-plugin
     DaemonSet is then not rendered (one node component per node). */}}
{{- define "kube-vgpu.draAllNodes" -}}
{{- if and .Values.dra.enabled (eq .Values.dra.nodes "all") }}true{{ else }}false{{ end -}}
{{- end -}}

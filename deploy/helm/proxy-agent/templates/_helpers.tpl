{{/* The app name: the chart's, or nameOverride. */}}
{{- define "proxy-agent.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' name: fullnameOverride, else the release name if it
contains the app name, else "<release>-<app>". */}}
{{- define "proxy-agent.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "proxy-agent.name" . -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The labels of every object, and the DaemonSet's selector: the same as
deploy/'s, so the chart can take over what `kubectl apply -k deploy/` made. */}}
{{- define "proxy-agent.labels" -}}
app.kubernetes.io/name: {{ include "proxy-agent.name" . }}
{{- end -}}

{{/* The agent's configuration file: .Values.config with the settings that
have values of their own written into it. */}}
{{- define "proxy-agent.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $_ := set $cfg "hostSocketLB" .Values.hostSocketLB -}}
{{- with .Values.deliveryMode }}{{ $_ := set $cfg "deliveryMode" . }}{{ end -}}
{{- with .Values.acceleration }}{{ $_ := set $cfg "acceleration" . }}{{ end -}}
{{- with .Values.loadBalancing }}{{ $_ := set $cfg "loadBalancing" . }}{{ end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The port of an "address:port" bind address. */}}
{{- define "proxy-agent.port" -}}
{{- regexFind "[0-9]+$" . -}}
{{- end -}}

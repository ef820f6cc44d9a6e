{{/* Name of the chart, or nameOverride. */}}
{{- define "diloco.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name of the release's resources: fullnameOverride, or "<release>-<name>" (the release name alone when it already holds the chart name). */}}
{{- define "diloco.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels of every resource. */}}
{{- define "diloco.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "diloco.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: diloco
{{- end -}}

{{/* Labels of the operator's resources. */}}
{{- define "diloco.operatorLabels" -}}
{{ include "diloco.labels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels that select the operator's pods. */}}
{{- define "diloco.selectorLabels" -}}
app.kubernetes.io/name: {{ include "diloco.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Name of the operator's ServiceAccount. */}}
{{- define "diloco.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "diloco.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "repository:tag" of an image value; an empty tag means the chart's appVersion. */}}
{{- define "diloco.imageRef" -}}
{{- $image := index . 0 -}}
{{- $root := index . 1 -}}
{{- printf "%s:%s" $image.repository (default $root.Chart.AppVersion $image.tag) -}}
{{- end -}}

{{/* Namespaces that get a synchronizer NetworkPolicy. */}}
{{- define "diloco.networkPolicyNamespaces" -}}
{{- $namespaces := .Values.networkPolicy.namespaces | default .Values.watchNamespaces | default (list .Release.Namespace) -}}
{{- toJson (uniq $namespaces) -}}
{{- end -}}

{{/* Name of the kopf peering object(s): `diloco operator`'s default unless set. */}}
{{- define "diloco.peeringName" -}}
{{- default "diloco" .Values.peering.name -}}
{{- end -}}

{{/* Command-line arguments of `diloco operator`, one per line as a YAML list. */}}
{{- define "diloco.operatorArgs" -}}
- --liveness=http://0.0.0.0:{{ .Values.operator.healthPort }}/healthz
{{- range (uniq .Values.watchNamespaces) }}
- --namespace={{ . }}
{{- end }}
{{- if .Values.peering.enabled }}
- --peering={{ include "diloco.peeringName" . }}
- --priority={{ .Values.peering.priority }}
{{- else }}
- --standalone
{{- end }}
{{- if .Values.operator.verbose }}
- --verbose
{{- end }}
{{- range .Values.operator.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}

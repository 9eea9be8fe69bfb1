{{/* Names and labels shared by every template. */}}
{{- define "sharegpu.fullname" -}}
{{- printf "%s" .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{- define "sharegpu.labels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sharegpu
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sharegpu.image" -}}
{{- $img := .img | default dict -}}
{{- printf "%s:%s" ($img.repository | default .root.Values.image.repository) ($img.tag | default .root.Values.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{- define "sharegpu.extenderName" -}}{{ include "sharegpu.fullname" . }}-extender{{- end -}}
{{- define "sharegpu.webhookName" -}}{{ include "sharegpu.fullname" . }}-webhook{{- end -}}
{{- define "sharegpu.schedulerName" -}}{{ include "sharegpu.fullname" . }}-scheduler{{- end -}}

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

{{- /*
The webhooks' matchCondition: the pod names a sharegpu.io/ resource in a container or init container, or carries a
sharegpu.io/ annotation (before or after an UPDATE). Every field is guarded with has(): an error in a condition
would count as a webhook failure.
*/ -}}
{{- define "sharegpu.webhookMatch" -}}
{{- $res := "has(c.resources) && ((has(c.resources.limits) && c.resources.limits.exists(r, r.startsWith('sharegpu.io/'))) || (has(c.resources.requests) && c.resources.requests.exists(r, r.startsWith('sharegpu.io/'))))" -}}
(has(object.metadata.annotations) && object.metadata.annotations.exists(k, k.startsWith('sharegpu.io/')))
|| (request.operation == 'UPDATE' && has(oldObject.metadata.annotations) && oldObject.metadata.annotations.exists(k, k.startsWith('sharegpu.io/')))
|| (has(object.spec.containers) && object.spec.containers.exists(c, {{ $res }}))
|| (has(object.spec.initContainers) && object.spec.initContainers.exists(c, {{ $res }}))
{{- end -}}

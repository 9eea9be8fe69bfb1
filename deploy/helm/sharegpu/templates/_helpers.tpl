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

{{- /*
The extender's TLS material, shared by extender.yaml (its server pair) and scheduler.yaml (the scheduler's client
pair): a CA, the extender's server certificate and the scheduler's client certificate, both signed by it. Helm
renders every template on its own and genCA makes a new CA each call, so the first caller stores the result in
.Values for the others. On an upgrade both Secrets are read back with `lookup` and reused (when both are there and
share their CA); delete them to get new ones at the next upgrade (both Deployments roll: their pods carry a checksum).
`helm template` and --dry-run look nothing up and make a fresh set. JSON: {ca, serverCrt, serverKey, clientCrt,
clientKey}, each base64 PEM.
*/ -}}
{{- define "sharegpu.extenderTls" -}}
{{- if not (hasKey .Values "_sharegpuExtenderTls") -}}
{{- $ns := .Release.Namespace -}}
{{- $ext := include "sharegpu.extenderName" . -}}
{{- $server := lookup "v1" "Secret" $ns (printf "%s-tls" $ext) | default dict -}}
{{- $client := lookup "v1" "Secret" $ns (include "sharegpu.extenderClientSecret" .) | default dict -}}
{{- $ca := dig "data" "ca.crt" "" $server -}}
{{- $tls := dict -}}
{{- if and $ca (eq $ca (dig "data" "ca.crt" "" $client)) (dig "data" "tls.crt" "" $server) (dig "data" "tls.key" "" $server) (dig "data" "tls.crt" "" $client) (dig "data" "tls.key" "" $client) -}}
{{- $tls = dict "ca" $ca "serverCrt" (dig "data" "tls.crt" "" $server) "serverKey" (dig "data" "tls.key" "" $server) "clientCrt" (dig "data" "tls.crt" "" $client) "clientKey" (dig "data" "tls.key" "" $client) -}}
{{- else -}}
{{- $days := int .Values.extender.tls.certValidityDays -}}
{{- $svc := printf "%s.%s.svc" $ext $ns -}}
{{- $newCa := genCA (printf "%s-ca" $ext) $days -}}
{{- $srv := genSignedCert $svc nil (list $ext (printf "%s.%s" $ext $ns) $svc) $days $newCa -}}
{{- $cli := genSignedCert .Values.scheduler.name nil nil $days $newCa -}}
{{- $tls = dict "ca" ($newCa.Cert | b64enc) "serverCrt" ($srv.Cert | b64enc) "serverKey" ($srv.Key | b64enc) "clientCrt" ($cli.Cert | b64enc) "clientKey" ($cli.Key | b64enc) -}}
{{- end -}}
{{- $_ := set .Values "_sharegpuExtenderTls" $tls -}}
{{- end -}}
{{- toJson (get .Values "_sharegpuExtenderTls") -}}
{{- end -}}

{{- define "sharegpu.extenderClientSecret" -}}{{ include "sharegpu.schedulerName" . }}-extender-client{{- end -}}

{{- /*
"true" when the ServiceMonitor and PodMonitor are to be made: asked for, and the Prometheus Operator's API is served
(or assumed, for renderings that cannot see the cluster). Without the CRDs the API server refuses the whole release.
*/ -}}
{{- define "sharegpu.monitors" -}}
{{- $m := .Values.metrics.serviceMonitor -}}
{{- if and $m.enabled (or $m.assumeCrds (.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}true{{- end -}}
{{- end -}}

{{/* The kube-scheduler image's tag: scheduler.image.tag when set, else the cluster's own version (the scheduler must
match it). A provider's suffix (v1.31.4-eks-1a2b3c, v1.30.2+k3s1) is no tag of registry.k8s.io/kube-scheduler: only
vMAJOR.MINOR.PATCH is kept. */}}
{{- define "sharegpu.kubeSchedulerTag" -}}
{{- $tag := .Values.scheduler.image.tag -}}
{{- if not $tag -}}
{{- $tag = regexFind "^v?[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version -}}
{{- if not (hasPrefix "v" $tag) }}{{ $tag = printf "v%s" $tag }}{{ end -}}
{{- end -}}
{{- $tag -}}
{{- end -}}

{{/* The name of every object of the release: the release name when it holds the chart's name. */}}
{{- define "pps.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* Selector labels (stable across upgrades; without the release's name for a release that
adopted the kustomize manifests' objects, whose Deployment selector cannot change). */}}
{{- define "pps.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
{{- if and .Values.helmLabels .Values.instanceInSelectors }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}
{{- end -}}

{{/* Labels of every object; the Helm ones are left out when rendering the kustomize base. */}}
{{- define "pps.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
{{- if .Values.helmLabels }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}
{{- end -}}

{{/* The Secret holding the serving certificate (tls.crt, tls.key, ca.crt). */}}
{{- define "pps.tlsSecret" -}}
{{- if and (eq .Values.certificates.mode "external") .Values.certificates.external.secretName -}}
{{- .Values.certificates.external.secretName -}}
{{- else -}}
{{- include "pps.fullname" . }}-tls
{{- end -}}
{{- end -}}

{{/* The Service's DNS name, which the serving certificate names. */}}
{{- define "pps.serviceHost" -}}
{{- printf "%s.%s.svc" (include "pps.fullname" .) .Release.Namespace -}}
{{- end -}}

{{/* Whether the conversion webhook has a Service of its own that publishes replicas not ready
yet (crd.conversionService). auto: on while the cluster's CRD says objects may be stored as
v1alpha1 (status.storedVersions, read with lookup: an install over OpenKruise's objects), which
only conversion reads, and a replica must read to become ready; off otherwise (a fresh install,
or `helm template`, which reads nothing), and with an external certificate (it would have to
name that Service too). Never with webhook.url (no Service is called). */}}
{{- define "pps.conversionService" -}}
{{- $setting := .Values.crd.conversionService | toString -}}
{{- if .Values.webhook.url -}}
false
{{- else if eq $setting "auto" -}}
{{- $crd := lookup "apiextensions.k8s.io/v1" "CustomResourceDefinition" "" "persistentpodstates.apps.kruise.io" -}}
{{- $stored := list -}}
{{- if and $crd $crd.status -}}
{{- $stored = $crd.status.storedVersions | default list -}}
{{- end -}}
{{- and (ne .Values.certificates.mode "external") (has "v1alpha1" $stored) -}}
{{- else -}}
{{- eq $setting "true" -}}
{{- end -}}
{{- end -}}

{{/* The conversion webhook's Service. */}}
{{- define "pps.conversionName" -}}
{{- printf "%s-conversion" (include "pps.fullname" . | trunc 52 | trimSuffix "-") -}}
{{- end -}}

{{/* The DNS names the serving certificate names: the Service's and the conversion Service's,
the latter whether it is on or not, so that an upgrade turning it on (auto, once the cluster's
CRD lists v1alpha1) finds it named by the certificate the replicas already serve: the kubelet
brings a Secret's new certificate to the pods only a minute or so later. */}}
{{- define "pps.dnsNames" -}}
{{- $hosts := list (include "pps.serviceHost" .) -}}
{{- $hosts = append $hosts (printf "%s.%s.svc" (include "pps.conversionName" .) .Release.Namespace) -}}
{{- $names := list -}}
{{- range $hosts -}}
{{- $names = append $names . -}}
{{- $names = append $names (printf "%s.cluster.local" .) -}}
{{- end -}}
{{- $url := include "pps.urlHost" . -}}
{{- if and $url (not (include "pps.urlHostIsIP" .)) -}}
{{- $names = append $names $url -}}
{{- end -}}
{{- toJson ($names | uniq) -}}
{{- end -}}

{{/* The host of webhook.url (no port, no brackets), or empty: the serving certificate names it
too, or the API server, calling that URL, would trust none of the answers. */}}
{{- define "pps.urlHost" -}}
{{- with .Values.webhook.url -}}
{{- $host := (urlParse .).host -}}
{{- if hasPrefix "[" $host -}}
{{- regexReplaceAll "^\\[(.*)\\](:[0-9]+)?$" $host "${1}" -}}
{{- else -}}
{{- regexReplaceAll ":[0-9]+$" $host "" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Non-empty when the host of webhook.url is an IP address (an IP SAN, not a DNS one). */}}
{{- define "pps.urlHostIsIP" -}}
{{- $host := include "pps.urlHost" . -}}
{{- if or (regexMatch "^[0-9a-fA-F:.]*:[0-9a-fA-F:.]*$" $host) (regexMatch "^([0-9]{1,3}\\.){3}[0-9]{1,3}$" $host) -}}true{{- end -}}
{{- end -}}

{{/* The IP addresses the serving certificate names: webhook.url's host when it is one. */}}
{{- define "pps.ipAddresses" -}}
{{- if include "pps.urlHostIsIP" . -}}
{{- toJson (list (include "pps.urlHost" .)) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* The workload kinds whose pods the webhook handles: GROUP/KIND, built-in first. */}}
{{- define "pps.kinds" -}}
{{- $kinds := list (list "apps" "StatefulSet") (list "apps.kruise.io" "StatefulSet") -}}
{{- range .Values.customWorkloads -}}
{{- $kinds = append $kinds (list .group .kind) -}}
{{- end -}}
{{- toJson $kinds -}}
{{- end -}}

{{/* Whether a setting of auto, true or false is on: auto where the cluster's version meets the
constraint. Called with (list SETTING CONSTRAINT $). */}}
{{- define "pps.onWhereSupported" -}}
{{- $setting := index . 0 | toString -}}
{{- if eq $setting "auto" -}}
{{- semverCompare (index . 1) (index . 2).Capabilities.KubeVersion.Version -}}
{{- else -}}
{{- eq $setting "true" -}}
{{- end -}}
{{- end -}}

{{/* Whether the CRD declares spec.targetRef.name a selectable field (Kubernetes >= 1.31). */}}
{{- define "pps.selectableFields" -}}
{{- include "pps.onWhereSupported" (list .Values.crd.selectableFields ">=1.31.0-0" .) -}}
{{- end -}}

{{/* Whether the pod webhook is registered with matchConditions (Kubernetes >= 1.28). */}}
{{- define "pps.matchConditions" -}}
{{- include "pps.onWhereSupported" (list .Values.webhook.matchConditions ">=1.28.0-0" .) -}}
{{- end -}}

{{/*
The CA bundle the API server trusts for the webhooks and the conversion webhook: the
self-signed CA (made once, kept across upgrades) or the one given. cert-manager's CA injector
fills it in otherwise. Computed once per render and shared through the root context.
*/}}
{{- define "pps.caBundle" -}}
{{- if eq .Values.certificates.mode "self-signed" -}}
{{- (include "pps.selfSigned" . | fromJson).ca | b64enc -}}
{{- else if eq .Values.certificates.mode "external" -}}
{{- .Values.certificates.external.caBundle -}}
{{- end -}}
{{- end -}}

{{/*
The self-signed CA and serving certificate as JSON {ca, caKey, crt, key}. The CA is read back
from the release's CA Secret when it exists (so the caBundle and the running replicas agree
across upgrades); the serving certificate is issued anew on every install and upgrade (rotated),
under that CA. Memoized in .Values so that every template of one render sees the same pair.
*/}}
{{- define "pps.selfSigned" -}}
{{- if not (hasKey .Values "__selfSigned") -}}
{{- $caName := printf "%s-ca" (include "pps.fullname" .) -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace $caName -}}
{{- $ca := dict -}}
{{- if and $existing (hasKey $existing.data "ca.crt") (hasKey $existing.data "ca.key") -}}
{{- $ca = buildCustomCert (index $existing.data "ca.crt") (index $existing.data "ca.key") -}}
{{- else -}}
{{- $ca = genCA (printf "%s CA" (include "pps.fullname" .)) 3650 -}}
{{- end -}}
{{- $host := include "pps.serviceHost" . -}}
{{- $dns := include "pps.dnsNames" . | fromJsonArray -}}
{{- $ips := include "pps.ipAddresses" . | fromJsonArray -}}
{{- $cert := genSignedCert $host $ips $dns (int .Values.certificates.selfSigned.validityDays) $ca -}}
{{- $_ := set .Values "__selfSigned" (dict "ca" $ca.Cert "caKey" $ca.Key "crt" $cert.Cert "key" $cert.Key) -}}
{{- end -}}
{{- toJson (get .Values "__selfSigned") -}}
{{- end -}}

{{/* A duration (Go's form with h, m, s and ms parts: 240h, 360h0m0s, 90s) in milliseconds. */}}
{{- define "pps.durationMillis" -}}
{{- $ms := 0 -}}
{{- $unit := dict "h" 3600000 "m" 60000 "s" 1000 "ms" 1 -}}
{{- range regexFindAll "[0-9]+(ms|h|m|s)" . -1 -}}
{{- $n := regexFind "^[0-9]+" . -}}
{{- $ms = add $ms (mul (int64 $n) (get $unit (trimPrefix $n .))) -}}
{{- end -}}
{{- $ms -}}
{{- end -}}

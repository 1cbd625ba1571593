{{/*
Names are fixed, not release-prefixed, where the binaries' defaults expect them: the webhook
Service "hearth-webhook" and the webhook configurations "hearth" are what
hearth_webhook::registration::Registration::in_cluster generates. Cluster-scoped RBAC objects
carry the release name so that two releases never fight over them.
*/}}
{{- define "hearth.webhookName" -}}hearth-webhook{{- end -}}
{{- define "hearth.controllerName" -}}hearth-controller{{- end -}}
{{- define "hearth.webhookConfigurationName" -}}hearth{{- end -}}

{{- define "hearth.clusterRoleName" -}}
{{- printf "%s-%s" .root.Release.Name .component | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hearth.labels" -}}
app.kubernetes.io/name: hearth
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Selector labels of one component: dict "root" $ "component" "webhook". */}}
{{- define "hearth.selectorLabels" -}}
app.kubernetes.io/name: hearth
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "hearth.componentLabels" -}}
{{ include "hearth.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{/* Image reference: dict "root" $ "image" .Values.webhook.image: the override, else
<registry>/<repository>:<tag>, pinned with @<digest> when the image's digest is set. */}}
{{- define "hearth.image" -}}
{{- if .image.override -}}
{{- .image.override -}}
{{- else -}}
{{- $tag := .root.Values.image.tag | default (printf "v%s" .root.Chart.AppVersion) -}}
{{- printf "%s/%s:%s" (.root.Values.image.registry | trimSuffix "/") .image.repository $tag -}}
{{- with .image.digest -}}@{{ . }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* The drain sidecar's image, empty when drain.sidecar is false. */}}
{{- define "hearth.drainImage" -}}
{{- if .Values.drain.sidecar -}}
{{- .Values.drain.image | default (include "hearth.image" (dict "root" . "image" .Values.gateway.image)) -}}
{{- end -}}
{{- end -}}

{{/* Pod-level security: non-root, RuntimeDefault seccomp (Pod Security "restricted"). */}}
{{- define "hearth.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 65532
runAsGroup: 65532
fsGroup: 65532
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "hearth.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
privileged: false
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "hearth.imagePullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The webhooks' namespace selector: never kube-system nor the release namespace. */}}
{{- define "hearth.webhookNamespaceSelector" -}}
namespaceSelector:
  matchExpressions:
    - key: kubernetes.io/metadata.name
      operator: NotIn
      values:
        - kube-system
{{- if ne .Release.Namespace "kube-system" }}
        - {{ .Release.Namespace }}
{{- end }}
{{- end -}}

{{/* The CEL match condition of the workload webhooks (registration::opted_in_expression). */}}
{{- define "hearth.optedIn" -}}
matchConditions:
  - name: hearth-opted-in
    expression: "(has(object.metadata.annotations) && ('serving.hearth.dev/runtime' in object.metadata.annotations || 'serving.hearth.dev/vendor' in object.metadata.annotations)) || (has(object.metadata.labels) && ('serving.hearth.dev/runtime' in object.metadata.labels || 'serving.hearth.dev/vendor' in object.metadata.labels))"
{{- end -}}

{{/* clientConfig of one endpoint: dict "root" $ "path" "/validate". */}}
{{- define "hearth.clientConfig" -}}
clientConfig:
  service:
    namespace: {{ .root.Release.Namespace }}
    name: {{ include "hearth.webhookName" .root }}
    path: {{ .path }}
    port: 443
{{- end -}}

{{- define "hearth.webhookAnnotations" -}}
{{- if eq .Values.certificates.mode "certManager" }}
annotations:
  cert-manager.io/inject-ca-from: {{ .Release.Namespace }}/{{ include "hearth.webhookName" . }}
{{- end }}
{{- end -}}

{{- define "hearth.timeout" -}}
{{- $t := int .Values.webhook.timeoutSeconds -}}
{{- if gt $t 10 }}{{ $t = 10 }}{{ end -}}
{{- if lt $t 1 }}{{ $t = 1 }}{{ end -}}
{{- $t -}}
{{- end -}}

{{/* Egress of both components: the apiserver, and DNS. */}}
{{- define "hearth.egress" -}}
egress:
  # The Kubernetes API.
  - to:
      {{- range .Values.networkPolicy.apiServer.cidrs }}
      - ipBlock:
          cidr: {{ . }}
      {{- end }}
    ports:
      {{- range .Values.networkPolicy.apiServer.ports }}
      - protocol: TCP
        port: {{ . }}
      {{- end }}
  {{- if .Values.networkPolicy.dns }}
  - to:
      - namespaceSelector: {}
    ports:
      - protocol: UDP
        port: 53
      - protocol: TCP
        port: 53
  {{- end }}
{{- end -}}

{{/* The controller's rules on namespaced objects (see controller-rbac.yaml). */}}
{{- define "hearth.controllerNamespacedRules" -}}
- apiGroups: ["serving.hearth.dev"]
  resources: ["llmservices"]
  verbs: ["list", "watch"]
- apiGroups: ["serving.hearth.dev"]
  resources: ["llmservices/status"]
  verbs: ["patch"]
- apiGroups: ["serving.hearth.dev"]
  resources: ["llmendpoints"]
  verbs: ["list", "watch"]
- apiGroups: ["serving.hearth.dev"]
  resources: ["llmendpoints/status"]
  verbs: ["patch"]
- apiGroups: ["serving.hearth.dev"]
  resources: ["llmadapters"]
  verbs: ["list", "watch"]
- apiGroups: ["serving.hearth.dev"]
  resources: ["llmadapters/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["list", "watch", "create", "patch", "get"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
# The gateways' and backends' NetworkPolicies (networkPolicy.models); watched whether on or
# off, so those written while it was on are deleted once it is off.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "watch", "create", "patch", "get", "delete"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["list", "watch"]
{{- if or .Values.controller.scalerTLS.enabled .Values.gateway.adminAuth.enabled }}
# Secrets written and never read: the ExternalScaler's certificates (mutual TLS with KEDA,
# N-scaler-tls and N-scaler-client-tls), each gateway's admin Secret (N-gateway-admin) and the
# token Secrets of KEDA and the scrapers.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create", "patch", "delete"]
{{- end }}
{{- if .Values.controller.scalerTLS.enabled }}
# The TriggerAuthentication N-scaler, through which KEDA reads its client certificate.
- apiGroups: ["keda.sh"]
  resources: ["triggerauthentications"]
  verbs: ["create", "patch", "delete"]
{{- end }}
{{- if .Values.controller.policyScan.enabled }}
# Policy scans: the StatefulSets annotated for Hearth (Deployments above), and one
# PolicyReport per scanned workload (written by server-side apply, deleted when stale).
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["list"]
- apiGroups: ["wgpolicyk8s.io"]
  resources: ["policyreports"]
  verbs: ["list", "create", "patch", "delete"]
{{- end }}
{{- end -}}

{{/*
Whether the controller runs device handovers: controller.deviceHandover.enabled, and not with
controller.watchNamespace (a handover counts the devices of every pod bound to a node, which a
namespace-scoped installation may not list). Empty when off.
*/}}
{{- define "hearth.deviceHandover" -}}
{{- if and .Values.controller.deviceHandover.enabled (not .Values.controller.watchNamespace) -}}
true
{{- end -}}
{{- end -}}

{{- /* The Secret of the key every gateway admin token derives from (controller/src/admin_tokens.rs). */ -}}
{{- define "hearth.adminKeysSecret" -}}
{{- printf "%s-keys" (include "hearth.controllerName" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* The Secret of the scrapers' gateway admin token, read by the hearth-gateways PodMonitor. */ -}}
{{- define "hearth.gatewayMetricsSecret" -}}
hearth-gateway-metrics
{{- end -}}

{{- /* The Secret of KEDA's gateway admin token, in gateway.adminAuth.kedaNamespace. */ -}}
{{- define "hearth.gatewayKedaSecret" -}}
hearth-gateway-keda
{{- end -}}

{{- /* The Secret of KEDA's client certificate for the shared gateways' ExternalScalers, in
gateway.adminAuth.kedaNamespace. */ -}}
{{- define "hearth.scalerKedaSecret" -}}
hearth-scaler-keda
{{- end -}}

{{- /* The ConfigMap where the controller publishes the CA of its metrics certificate
(controller.scalerTLS.enabled: issued from the scaler CA; the ServiceMonitor verifies with it). */ -}}
{{- define "hearth.controllerMetricsCA" -}}
{{- printf "%s-metrics-ca" (include "hearth.controllerName" .) -}}
{{- end -}}

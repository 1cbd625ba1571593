#!/usr/bin/env bash
# Prints the objects `up` applies before KEDA starts: the fake nodes and the wiring that lets the
# apiserver's aggregator reach the KEDA metrics adapter, a local process, on loopback.
#   lib/manifests.sh <CA certificate that signed the adapter's serving cert>
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
ca_bundle="$(base64 -w0 <"$1")"

# node <index> <name> <cpu> <memory> <labels as 'k: v' lines> <extended resources as 'k: "n"' lines>
# Node i gets InternalIP $NET.1.i and podCIDR $NET.(10+i).0/24, from which kwok gives its pods
# their IPs (README.md, "Addresses").
node() {
  local i="$1" name="$2" cpu="$3" mem="$4" labels="$5" extra="$6" resources
  resources="$(printf '    cpu: "%s"\n    memory: %s\n    pods: "110"\n    ephemeral-storage: 500Gi\n' "$cpu" "$mem")"
  if [[ -n "$extra" ]]; then
    resources+=$'\n'"$(sed 's/^/    /' <<<"$extra")"
  fi
  cat <<NODE
---
apiVersion: v1
kind: Node
metadata:
  name: $name
  annotations:
    kwok.x-k8s.io/node: fake
  labels:
    type: kwok
    kubernetes.io/hostname: $name
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
$(sed 's/^/    /' <<<"$labels")
spec:
  podCIDR: $NET.$((10 + i)).0/24
  podCIDRs:
  - $NET.$((10 + i)).0/24
status:
  addresses:
  - type: InternalIP
    address: $NET.1.$i
  - type: Hostname
    address: $name
  capacity:
$resources
  allocatable:
$resources
  nodeInfo:
    architecture: amd64
    operatingSystem: linux
    kubeletVersion: $KUBE_VERSION
NODE
}

node 1 kwok-gpu-0 32 256Gi \
  $'nvidia.com/gpu.present: "true"\nnvidia.com/gpu.product: NVIDIA-A10\nnvidia.com/gpu.count: "2"' \
  'nvidia.com/gpu: "2"'
node 2 kwok-gpu-1 32 256Gi \
  $'nvidia.com/gpu.present: "true"\nnvidia.com/gpu.product: NVIDIA-A10\nnvidia.com/gpu.count: "2"' \
  'nvidia.com/gpu: "2"'
# The second label is the one the upstream Ascend 910B3 example selects on.
node 3 kwok-ascend-0 192 1Ti \
  $'accelerator: huawei-Ascend910\nserving.hearth.dev/ascend-product: ascend-910b3' \
  'huawei.com/Ascend910: "8"'
node 4 kwok-cpu-0 16 64Gi '' ''
# Advertises the fake extended resource the upstream stub InferenceRuntime requests, as the
# kind node of upstream's end-to-end suite does.
node 5 kwok-stub-0 16 64Gi 'tests.hearth.dev/stub: "true"' 'hearth.dev/fake-gpu: "4"'

cat <<KEDA
---
apiVersion: v1
kind: Namespace
metadata:
  name: keda
---
# The adapter is a local process on a loopback address, which neither Endpoints nor
# EndpointSlices accept ("may not be in the loopback range"). An ExternalName Service may name an
# IP literal, and the aggregator (with --enable-aggregator-routing=false, the default) resolves
# an ExternalName Service to https://<externalName>:<APIService port>, verifying the serving
# certificate for keda-metrics-apiserver.keda.svc.
apiVersion: v1
kind: Service
metadata:
  name: keda-metrics-apiserver
  namespace: keda
spec:
  type: ExternalName
  externalName: $KEDA_ADAPTER_IP
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata:
  name: v1beta1.external.metrics.k8s.io
spec:
  group: external.metrics.k8s.io
  version: v1beta1
  groupPriorityMinimum: 100
  versionPriority: 100
  caBundle: $ca_bundle
  service:
    name: keda-metrics-apiserver
    namespace: keda
    port: $KEDA_ADAPTER_PORT
---
# As KEDA's chart does: the HPA controller reads external metrics through the aggregator.
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: keda-external-metrics-reader
rules:
- apiGroups: ["external.metrics.k8s.io"]
  resources: ["*"]
  verbs: ["get", "list", "watch"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: keda-hpa-controller-external-metrics
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: keda-external-metrics-reader
subjects:
- kind: ServiceAccount
  name: horizontal-pod-autoscaler
  namespace: kube-system
KEDA

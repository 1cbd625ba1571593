#!/usr/bin/env bash
# Prints the fake nodes that `up` creates for kwok to keep Ready. (KEDA comes from its own
# manifests: keda/kustomization.yaml.)
#   lib/manifests.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

# node <index> <name> <cpu> <memory> <labels as 'k: v' lines> <extended resources as 'k: "n"' lines> <taint key>
# Node i gets InternalIP $NET.1.i and podCIDR $NET.(10+i).0/24, from which kwok gives its pods
# their IPs (README.md, "Addresses"). Every fake node is tainted NoSchedule, so a pod lands on one
# only when it asks to: accelerator nodes carry the taint of their device resource, as GPU node
# pools do in production (GKE taints nvidia.com/gpu), which the apiserver's
# ExtendedResourceToleration admission plugin tolerates for every pod that requests that
# resource; the CPU node carries kwok.x-k8s.io/node, tolerated only by tests that target it.
# Everything else (Hearth, KEDA, gateways, stub backends) runs on the real node.
node() {
  local i="$1" name="$2" cpu="$3" mem="$4" labels="$5" extra="$6" taint="$7" resources
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
  taints:
  - key: $taint
    value: present
    effect: NoSchedule
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
  'nvidia.com/gpu: "2"' nvidia.com/gpu
node 2 kwok-gpu-1 32 256Gi \
  $'nvidia.com/gpu.present: "true"\nnvidia.com/gpu.product: NVIDIA-A10\nnvidia.com/gpu.count: "2"' \
  'nvidia.com/gpu: "2"' nvidia.com/gpu
# The second label is the one the upstream Ascend 910B3 example selects on.
node 3 kwok-ascend-0 192 1Ti \
  $'accelerator: huawei-Ascend910\nserving.hearth.dev/ascend-product: ascend-910b3' \
  'huawei.com/Ascend910: "8"' huawei.com/Ascend910
node 4 kwok-cpu-0 16 64Gi '' '' kwok.x-k8s.io/node

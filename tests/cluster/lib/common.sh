# shellcheck shell=bash
# Shared settings and helpers of tests/cluster/{build,up,down,status}. Sourced, never executed.
#
# Environment (all optional):
#   HEARTH_CACHE          build cache, outside the repo (default ~/.cache/hearth); binaries land
#                         in $HEARTH_CACHE/bin/<name>-<version>
#   HEARTH_CLUSTER_STATE  state dir: certs, kubeconfigs, logs, PID files, etcd data
#                         (default tests/cluster/.state)
#   HEARTH_CLUSTER_NET    first two octets of the loopback /16 the control plane lives in
#                         (default 127.100); see README.md for the address plan
#   HEARTH_NODE_NET       the /18 of the real node: its link to the host, pod and Service
#                         addresses (default 198.19.0.0/18; any /18 of 198.19.0.0/16, part of
#                         RFC 2544's benchmarking block, never a private range)
# When neither is set and another cluster of this machine holds the defaults, `up` picks free
# ones and records them in $STATE/addresses.env, which the other scripts read.
#   HEARTH_CLUSTER_VERSIONS  which Kubernetes and KEDA the cluster runs: `current` (default:
#                         go/kubernetes, go/keda) or `oldest`, the oldest versions Hearth
#                         supports (go/kubernetes-1.30, go/keda-2.17); every other component is
#                         the same in both. `up` records it in $STATE/versions.env, which the
#                         other scripts read, so that `down`, `status` and `restart` find the
#                         binaries the cluster runs without the environment.

set -euo pipefail

CLUSTER_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${HEARTH_CACHE:-${HOME:-/root}/.cache/hearth}"
BIN="$CACHE/bin"
STATE="${HEARTH_CLUSTER_STATE:-$CLUSTER_DIR/.state}"
# The addresses a running cluster was started with (`up` writes them, and may have chosen free
# ones itself: see there), so that down, status and restart find it without the environment.
ADDRESSES_FILE="$STATE/addresses.env"
ADDRESSES_FROM_ENV="${HEARTH_CLUSTER_NET:+cluster}${HEARTH_NODE_NET:+node}"
if [[ -f "$ADDRESSES_FILE" ]]; then
  while IFS='=' read -r key value; do
    case "$key" in
      HEARTH_CLUSTER_NET | HEARTH_NODE_NET) [[ -n "${!key:-}" ]] || printf -v "$key" '%s' "$value" ;;
    esac
  done <"$ADDRESSES_FILE"
fi
NET="${HEARTH_CLUSTER_NET:-127.100}"

# The Kubernetes and KEDA of the cluster (see above). A state dir keeps the set its `up` chose
# until `down` removes it; asking for another one there is an error, since the scripts would
# then look for processes of binaries the cluster does not run.
VERSIONS_FILE="$STATE/versions.env"
recorded_versions=""
if [[ -f "$VERSIONS_FILE" ]]; then
  recorded_versions="$(sed -n 's/^HEARTH_CLUSTER_VERSIONS=//p' "$VERSIONS_FILE")"
fi
CLUSTER_VERSIONS="${HEARTH_CLUSTER_VERSIONS:-${recorded_versions:-current}}"
if [[ -n "$recorded_versions" && "$CLUSTER_VERSIONS" != "$recorded_versions" ]]; then
  echo "error: the cluster in $STATE runs HEARTH_CLUSTER_VERSIONS=$recorded_versions ($VERSIONS_FILE), not $CLUSTER_VERSIONS: run the scripts there without HEARTH_CLUSTER_VERSIONS (or with the recorded set), and tests/cluster/down before starting the other set" >&2
  exit 2
fi
# The module dirs under go/ that the Kubernetes binaries (control plane, kubelet, kube-proxy,
# pause) and KEDA's are built from.
case "$CLUSTER_VERSIONS" in
  current) KUBE_GO_DIR=kubernetes KEDA_GO_DIR=keda ;;
  oldest) KUBE_GO_DIR=kubernetes-1.30 KEDA_GO_DIR=keda-2.17 ;;
  *)
    echo "error: HEARTH_CLUSTER_VERSIONS='$CLUSTER_VERSIONS' must be current or oldest" >&2
    exit 2
    ;;
esac

if ! [[ "$NET" =~ ^127\.([0-9]{1,3})$ ]] || ((BASH_REMATCH[1] > 255)); then
  echo "error: HEARTH_CLUSTER_NET='$NET' must be the first two octets of a loopback /16, e.g. 127.100" >&2
  exit 2
fi

NODE_NET="${HEARTH_NODE_NET:-198.19.0.0/18}"
# The node's /18 holds its link, pod CIDR and Service CIDR (README.md, "Addresses").
if ! [[ "$NODE_NET" =~ ^198\.(19)\.([0-9]{1,3})\.0/18$ ]] || ((BASH_REMATCH[2] % 64 != 0 || BASH_REMATCH[2] > 192)); then
  echo "error: HEARTH_NODE_NET='$NODE_NET' must be a /18 of 198.19.0.0/16, e.g. 198.19.0.0/18 or 198.19.64.0/18" >&2
  exit 2
fi
node_b="${BASH_REMATCH[1]}" node_c="${BASH_REMATCH[2]}"

# Address plan (README.md, "Addresses").
CP_IP="$NET.0.1"          # etcd, controller-manager, scheduler, kwok
APISERVER_PORT=6443
ETCD_CLIENT_PORT=2379
ETCD_PEER_PORT=2380
KCM_PORT=10257
SCHEDULER_PORT=10259
KWOK_PORT=10247
# The real node lives in a network namespace of its own, linked to the host by a veth pair; the
# host routes $NODE_NET (and nothing else) into it. The apiserver listens on the host end of the
# link, the one address of the control plane that pods and the kubelet can reach.
NODE_HOST_IP="198.$node_b.$node_c.1"   # host end of the veth pair: kube-apiserver
NODE_IP="198.$node_b.$node_c.2"        # node end: the node's InternalIP (kubelet, kube-proxy)
NODE_POD_CIDR="198.$node_b.$((node_c + 1)).0/24"
NODE_NAME=hearth-node
NODE_HOST_IF="hearth-$node_b-$node_c"     # hearth-19-0
NODE_CGROUP="hearth-198-$node_b-$node_c"  # cgroup of the node's processes and pods
SERVICE_CIDR="198.$node_b.$((node_c + 16)).0/20"
SERVICE_FIRST_IP="198.$node_b.$((node_c + 16)).1"
CLUSTER_DNS_IP="198.$node_b.$((node_c + 16)).10"
APISERVER_IP="$NODE_HOST_IP"
KUBELET_PORT=10250
# The cluster's OCI registry (lib/registry.sh): the distribution registry, with TLS (a certificate
# of the cluster CA) and basic auth, on the host end of the node's link, where the node and the
# host both reach it.
REGISTRY_PORT=5000
REGISTRY="$NODE_HOST_IP:$REGISTRY_PORT"
KUBE_ROUTER_HEALTH_PORT=20244

# Versions come from our go.mod files, so there is one place to change them.
gomod_version() { # <dir under go/> <module path>
  local v
  v="$(awk -v m="$2" '($1 == m) { print $2; exit } ($1 == "require" && $2 == m) { print $3; exit }' \
    "$CLUSTER_DIR/go/$1/go.mod")"
  if [[ -z "$v" ]]; then
    echo "error: tests/cluster/go/$1/go.mod does not require $2" >&2
    exit 2
  fi
  printf '%s' "$v"
}
ETCD_VERSION="$(gomod_version etcd go.etcd.io/etcd/server/v3)"
KUBE_VERSION="$(gomod_version "$KUBE_GO_DIR" k8s.io/kubernetes)"
KWOK_VERSION="$(gomod_version kwok sigs.k8s.io/kwok)"
KEDA_VERSION="$(gomod_version "$KEDA_GO_DIR" github.com/kedacore/keda/v2)"
# Minor versions, for what differs between the sets (flags, kubelet config, KEDA's images).
KUBE_MINOR="$(cut -d. -f2 <<<"$KUBE_VERSION")"
KEDA_MINOR="$(cut -d. -f2 <<<"$KEDA_VERSION")"
HELM_VERSION="$(gomod_version helm helm.sh/helm/v4)"
COREDNS_VERSION="$(gomod_version coredns github.com/coredns/coredns)"
KUBE_ROUTER_VERSION="$(gomod_version kube-router github.com/cloudnativelabs/kube-router/v2)"
CONTAINERD_VERSION="$(gomod_version containerd github.com/containerd/containerd/v2)"
RUNC_VERSION="$(gomod_version runc github.com/opencontainers/runc)"
COSIGN_VERSION="$(gomod_version cosign github.com/sigstore/cosign/v2)"
ACTIONLINT_VERSION="$(gomod_version actionlint github.com/rhysd/actionlint)"

ETCD="$BIN/etcd-$ETCD_VERSION"
KUBE_APISERVER="$BIN/kube-apiserver-$KUBE_VERSION"
KUBE_CONTROLLER_MANAGER="$BIN/kube-controller-manager-$KUBE_VERSION"
KUBE_SCHEDULER="$BIN/kube-scheduler-$KUBE_VERSION"
KUBECTL="$BIN/kubectl-$KUBE_VERSION"
KUBELET="$BIN/kubelet-$KUBE_VERSION"
KUBE_PROXY="$BIN/kube-proxy-$KUBE_VERSION"
COREDNS="$BIN/coredns-$COREDNS_VERSION"
# The real node's NetworkPolicy implementation: kube-router's network policy controller alone.
KUBE_ROUTER="$BIN/kube-router-$KUBE_ROUTER_VERSION"
# The pod sandbox ("pause") binary, compiled from build/pause of the same Kubernetes module.
PAUSE="$BIN/pause-$KUBE_VERSION"
KWOK="$BIN/kwok-$KWOK_VERSION"
# KEDA's operator, metrics adapter and admission webhooks run as pods on the real node, from
# images built of these binaries (lib/images.sh) and KEDA's own manifests: the config/ dir of the
# same module version, copied here (lib/build.sh) and rendered by `up` through keda/.
KEDA_OPERATOR="$BIN/keda-operator-$KEDA_VERSION"
KEDA_ADAPTER="$BIN/keda-adapter-$KEDA_VERSION"
KEDA_WEBHOOKS="$BIN/keda-admission-webhooks-$KEDA_VERSION"
KEDA_CONFIG="$CACHE/share/keda-$KEDA_VERSION/config"
HELM="$BIN/helm-$HELM_VERSION"
# Signs the images and the chart build/push pushes to the registry, with the cluster's test key
# pair (lib/registry.sh), and verifies them (the e2e registry suite).
COSIGN="$BIN/cosign-$COSIGN_VERSION"
# Lints .github/workflows/ (.ci/run).
ACTIONLINT="$BIN/actionlint-$ACTIONLINT_VERSION"
# The registry: Debian's docker-registry (distribution 2.8); its storage, htpasswd file,
# credentials (a Docker config, auth.json) and configuration live in $REGISTRY_DIR.
REGISTRY_BIN=/usr/bin/docker-registry
REGISTRY_DIR="$STATE/registry"
REGISTRY_USER=hearth
# The real node's container runtime, built from its Go modules (lib/build.sh): containerd 2 (new
# enough for Kubernetes image volumes) with ctr and the runc shim in one directory, which `up`
# puts first on containerd's PATH (where containerd looks for its shims), and runc with seccomp.
CONTAINERD_DIR="$BIN/containerd-$CONTAINERD_VERSION"
CONTAINERD="$CONTAINERD_DIR/containerd"
CTR="$CONTAINERD_DIR/ctr"
# ctr repeats the deprecations containerd reports (cgroup v1, the node's registry credentials:
# `ctr deprecations list`) on every command; they are known here.
export CONTAINERD_SUPPRESS_DEPRECATION_WARNINGS=1
CONTAINERD_SHIM="$CONTAINERD_DIR/containerd-shim-runc-v2"
RUNC="$BIN/runc-$RUNC_VERSION"
# The CNI plugins come from Debian's package (see README.md).
CNI_BIN_DIR=/usr/lib/cni
# Cluster images (pause, CoreDNS, test tools, KEDA), built once from the binaries above.
IMAGES="$CACHE/images"
PAUSE_IMAGE="hearth.dev/pause:${KUBE_VERSION}"
COREDNS_IMAGE="hearth.dev/coredns:${COREDNS_VERSION}"
TOOLS_IMAGE="hearth.dev/test-tools:busybox"
# keda/kustomization.yaml points KEDA's image names (ghcr.io/kedacore/...) at these.
KEDA_IMAGE="hearth.dev/keda:${KEDA_VERSION}"
KEDA_ADAPTER_IMAGE="hearth.dev/keda-metrics-apiserver:${KEDA_VERSION}"
KEDA_WEBHOOKS_IMAGE="hearth.dev/keda-admission-webhooks:${KEDA_VERSION}"
ROOT_DIR="$(cd "$CLUSTER_DIR/../.." && pwd)"
TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT_DIR/target}"
DEVICE_PLUGIN="$TARGET_DIR/debug/hearth-fake-device-plugin"
# Where build/images writes Hearth's image archives (always below the checkout).
HEARTH_IMAGES="$ROOT_DIR/target/images"

KUBECONFIG_PATH="$STATE/kubeconfig"
NODE_DIR="$STATE/node" # containerd, kubelet and CNI state of the real node
NS_DIR="$STATE/ns"     # the node's network namespace (a bind mount) and its mount namespace's holder (mnt.pid)
NODE_OWNER="$STATE/node-owner" # written before the node's first change to the host: `down`
                               # removes a node only when its state dir has this record
PIDS="$STATE/pids"
LOGS="$STATE/logs"

# Processes in start order; `down` stops them in reverse. (CoreDNS and KEDA are pods on the
# real node: `down` ends them with the node.)
COMPONENTS=(etcd kube-apiserver kube-controller-manager kube-scheduler kwok registry
  containerd kubelet kube-proxy device-plugin kube-router)
# The real node's daemons, in the order `down` stops them.
NODE_COMPONENTS=(kube-router device-plugin kube-proxy kubelet containerd)

log() { printf '[cluster %5ss] %s\n' "$SECONDS" "$*" >&2; }
die() {
  printf 'error: %s\n' "$*" >&2
  exit 1
}

# The binary a component runs, used to start it and to check a PID still belongs to it.
component_binary() {
  case "$1" in
    etcd) echo "$ETCD" ;;
    kube-apiserver) echo "$KUBE_APISERVER" ;;
    kube-controller-manager) echo "$KUBE_CONTROLLER_MANAGER" ;;
    kube-scheduler) echo "$KUBE_SCHEDULER" ;;
    kwok) echo "$KWOK" ;;
    registry) echo "$REGISTRY_BIN" ;;
    containerd) echo "$CONTAINERD" ;;
    kubelet) echo "$KUBELET" ;;
    kube-proxy) echo "$KUBE_PROXY" ;;
    device-plugin) echo "$DEVICE_PLUGIN" ;;
    kube-router) echo "$KUBE_ROUTER" ;;
    *) die "unknown component $1" ;;
  esac
}

# Prints the PID of a component if its PID file names a live process that runs the component's
# binary (guards against PID reuse after a reboot or a crash); prints nothing otherwise.
component_pid() {
  local pidfile="$PIDS/$1.pid" pid exe
  [[ -f "$pidfile" ]] || return 0
  pid="$(<"$pidfile")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 0
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 0
  # A binary replaced on disk (rebuilt) shows as "<path> (deleted)".
  [[ "${exe% (deleted)}" == "$(component_binary "$1")" ]] || return 0
  echo "$pid"
}

# Prints the PID in FILE if it names a live process whose binary's file name is NAME (a
# rebuilt binary shows as "<path> (deleted)"); prints nothing otherwise. For processes recorded
# outside $PIDS (what an older `make demo` started, and the KEDA host processes of an older `up`).
pid_of_binary() {
  local file="$1" name="$2" pid exe
  [[ -f "$file" ]] || return 0
  pid="$(<"$file")"
  [[ "$pid" =~ ^[0-9]+$ ]] || return 0
  exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || return 0
  [[ "$(basename "${exe% (deleted)}")" == "$name" ]] || return 0
  echo "$pid"
}

# apt_install <why> <Debian package...>: installs them with apt-get (refreshing the package lists
# first, which a fresh machine lacks), or dies saying what to install when that is not possible.
apt_install() {
  local why="$1"
  shift
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    die "$why needs: $* (Debian package names; apt-get install -y $*)"
  fi
  log "installing $* with apt-get ($why)"
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } >&2 ||
    die "apt-get install $* failed"
}

# record_started <component> <pid>: writes the PID file and waits (5 s at most) until it names
# the component's own process (a wrapper may still be exec'ing into it), since `down` checks the
# executable; dies with the end of the component's log when it exits first.
record_started() {
  local name="$1" pid="$2" i
  echo "$pid" >"$PIDS/$name.pid"
  for ((i = 0; i < 100; i++)); do
    [[ -z "$(component_pid "$name")" ]] || return 0
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  tail -n 25 "$LOGS/$name.log" >&2 || true
  die "$name did not start (log: $LOGS/$name.log)"
}

# Resident memory of a PID in KiB.
rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }

kubectl_() { "$KUBECTL" --kubeconfig "$KUBECONFIG_PATH" "$@"; }

source "$CLUSTER_DIR/lib/registry.sh"

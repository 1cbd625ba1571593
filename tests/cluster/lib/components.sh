# shellcheck shell=bash
# Starting, awaiting and stopping the cluster's components (sourced after common.sh and
# node.sh): `up` starts each with the arguments below, `restart` stops and starts some of them
# again with the same arguments, `down` stops them. Sourced, never executed.

# wait_until <seconds> <what is awaited> <component whose log helps> <command...>
# Polls the command every 0.25 s; on timeout shows its last output and the component's log. The
# component may also be pods:<namespace>/<label selector>, pods on the real node: then it stops
# early if the kubelet exits, and shows those pods (show_pods) and the kubelet's log if so.
wait_until() {
  local timeout="$1" what="$2" component="$3" deadline out proc
  shift 3
  proc="$component"
  [[ "$component" != pods:* ]] || proc=kubelet
  deadline=$((SECONDS + timeout))
  until out="$("$@" 2>&1)"; do
    if [[ -n "$proc" && -z "$(component_pid "$proc")" ]]; then
      printf 'error: %s exited while waiting for %s\n' "$proc" "$what" >&2
      deadline=0
    elif ((SECONDS >= deadline)); then
      printf 'error: timed out after %ss waiting for %s\nlast attempt said: %s\n' "$timeout" "$what" "$out" >&2
    fi
    if ((SECONDS >= deadline)); then
      if [[ "$component" == pods:* ]]; then
        component="${component#pods:}"
        show_pods "${component%%/*}" "${component#*/}"
      fi
      if [[ -n "$proc" && ("$proc" == "$component" || -z "$(component_pid "$proc")") ]]; then
        printf -- '--- last lines of %s ---\n' "$LOGS/$proc.log" >&2
        tail -n 25 "$LOGS/$proc.log" >&2 || true
      fi
      printf 'the cluster is left as it is for inspection; tests/cluster/down removes it\n' >&2
      exit 1
    fi
    sleep 0.25
  done
}

port_open() { (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null; }

# show_pods <namespace> <label selector>: why those pods are not ready: the list, then each
# one's description (container states, restarts, events) and the end of its log (and of the
# previous container's, after a restart).
show_pods() {
  local ns="$1" selector="$2" pod
  printf -- '--- pods in %s with %s ---\n' "$ns" "$selector" >&2
  kubectl_ --namespace "$ns" get pods -l "$selector" -o wide >&2 || return 0
  # A pod that cannot be scheduled usually means the real node is tainted: say by what.
  printf -- '--- the real node %s: conditions and taints; free disk ---\n' "$NODE_NAME" >&2
  kubectl_ get node "$NODE_NAME" -o 'jsonpath={range .status.conditions[*]}{.type}={.status} {.reason}: {.message}{"\n"}{end}{range .spec.taints[*]}taint {.key}:{.effect}{"\n"}{end}' >&2 || true
  df -h "$STATE" >&2 || true
  for pod in $(kubectl_ --namespace "$ns" get pods -l "$selector" -o name); do
    printf -- '--- kubectl --namespace %s describe %s ---\n' "$ns" "$pod" >&2
    kubectl_ --namespace "$ns" describe "$pod" >&2 || true
    printf -- '--- last lines of its log ---\n' >&2
    kubectl_ --namespace "$ns" logs "$pod" --all-containers --tail=25 >&2 || true
    if kubectl_ --namespace "$ns" logs "$pod" --all-containers --previous --tail=25 >"$STATE/run/previous.log" 2>/dev/null; then
      printf -- '--- last lines of its previous container ---\n' >&2
      cat "$STATE/run/previous.log" >&2
    fi
  done
}

# An APIService is Available; otherwise prints its condition (what the aggregator saw).
apiservice_available() {
  local c
  c="$(kubectl_ get apiservice "$1" -o 'jsonpath={.status.conditions[?(@.type=="Available")]}')"
  [[ "$c" == *'"status":"True"'* ]] || { echo "${c:-no Available condition yet}"; return 1; }
}

# The path the HPA controller takes, end to end: aggregator -> Service keda-metrics-apiserver ->
# adapter -> the operator's metrics gRPC (Service keda-operator, port 9666, TLS with KEDA's own
# certificates). Asked about a ScaledObject that does not exist, the operator answers that it is
# not found; until the adapter's gRPC connection is up (it retries with backoff while the
# operator is not yet Ready), the error is the adapter's own ("Unavailable").
keda_metrics_path_up() {
  local out
  out="$(kubectl_ get --raw "/apis/external.metrics.k8s.io/v1beta1/namespaces/keda/s0-probe?labelSelector=scaledobject.keda.sh%2Fname%3Dhearth-up-probe" 2>&1)"
  [[ "$out" == *'"hearth-up-probe" not found'* ]] || { echo "$out"; return 1; }
}

# The real node carries no taint (it registers with `not-ready`, which kube-controller-manager
# removes once the node is Ready; the kubelet adds `disk-pressure` and the like); else prints them.
node_untainted() {
  local t
  t="$(kubectl_ get node "$NODE_NAME" -o 'jsonpath={range .spec.taints[*]}{.key}:{.effect} {end}')" || return 1
  [[ -z "$t" ]] || { echo "taints: $t"; return 1; }
}

# The real node advertises every fake device the device plugin registers.
node_has_devices() {
  local out
  out="$(kubectl_ get node "$NODE_NAME" -o 'jsonpath={.status.allocatable.nvidia\.com/gpu} {.status.allocatable.huawei\.com/Ascend910} {.status.allocatable.hearth\.dev/fake-gpu}')"
  [[ "$out" == "2 8 4" ]] || { echo "allocatable nvidia.com/gpu, huawei.com/Ascend910, hearth.dev/fake-gpu: '$out'"; return 1; }
}

# start <component> [VAR=value ...] -- <args...>
start() {
  local name="$1" bin envs=()
  shift
  while [[ "$1" != "--" ]]; do
    envs+=("$1")
    shift
  done
  shift
  bin="$(component_binary "$name")"
  # setsid: its own session, so a terminal's Ctrl-C or hang-up after `up` does not reach it.
  env "${envs[@]}" setsid "$bin" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  record_started "$name" "$!"
}

# start_component <component>: starts one component (see COMPONENTS) as `up` does.
start_component() {
  local pki="$STATE/pki"
  case "$1" in
  etcd)
    start etcd -- \
      --name=hearth --data-dir="$STATE/etcd" \
      --listen-client-urls="https://$CP_IP:$ETCD_CLIENT_PORT" \
      --advertise-client-urls="https://$CP_IP:$ETCD_CLIENT_PORT" \
      --listen-peer-urls="http://$CP_IP:$ETCD_PEER_PORT" \
      --initial-advertise-peer-urls="http://$CP_IP:$ETCD_PEER_PORT" \
      --initial-cluster="hearth=http://$CP_IP:$ETCD_PEER_PORT" \
      --cert-file="$pki/etcd-server.crt" --key-file="$pki/etcd-server.key" \
      --client-cert-auth --trusted-ca-file="$pki/ca.crt" \
      --unsafe-no-fsync --log-level=warn
    ;;
  kube-apiserver)
    # The aggregator's UID header came with Kubernetes 1.32; an older apiserver refuses the flag
    # (and sends no UID to extension apiservers).
    local uid_headers=()
    ((KUBE_MINOR < 32)) || uid_headers=(--requestheader-uid-headers=X-Remote-Uid)
    # MutatingAdmissionPolicy (v1beta1 on 1.34 and 1.35, behind its feature gate; GA in 1.36),
    # which exported ServingPolicies use; older apiservers refuse the gate.
    local admission_policies=()
    ((KUBE_MINOR < 34 || KUBE_MINOR > 35)) || admission_policies=(
      --feature-gates=MutatingAdmissionPolicy=true
      --runtime-config=admissionregistration.k8s.io/v1beta1=true
    )
    # An audit log of the writes to the kinds Hearth's workload webhook reviews, at Metadata
    # level (which carries the admission webhooks' audit annotations): where the tests read
    # what ServingPolicies in Audit mode recorded. $LOGS/audit.log, at most 3 x 20 MB.
    cat >"$STATE/audit-policy.yaml" <<'POLICY'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch]
    resources:
      - group: apps
        resources: [deployments, statefulsets]
      - group: ""
        resources: [pods]
  - level: None
POLICY
    start kube-apiserver -- \
      --audit-policy-file="$STATE/audit-policy.yaml" --audit-log-path="$LOGS/audit.log" \
      --audit-log-maxsize=20 --audit-log-maxbackup=2 --audit-log-format=json \
      --advertise-address="$APISERVER_IP" --bind-address="$APISERVER_IP" --secure-port="$APISERVER_PORT" \
      --etcd-servers="https://$CP_IP:$ETCD_CLIENT_PORT" --etcd-cafile="$pki/ca.crt" \
      --etcd-certfile="$pki/apiserver-etcd-client.crt" --etcd-keyfile="$pki/apiserver-etcd-client.key" \
      --tls-cert-file="$pki/apiserver.crt" --tls-private-key-file="$pki/apiserver.key" \
      --client-ca-file="$pki/ca.crt" \
      --authorization-mode=Node,RBAC \
      --enable-admission-plugins=ExtendedResourceToleration \
      "${admission_policies[@]}" \
      --service-account-issuer="https://$APISERVER_IP:$APISERVER_PORT" \
      --service-account-key-file="$pki/sa.pub" --service-account-signing-key-file="$pki/sa.key" \
      --service-cluster-ip-range="$SERVICE_CIDR" \
      --kubelet-preferred-address-types=InternalIP \
      --kubelet-certificate-authority="$pki/ca.crt" \
      --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
      --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
      --enable-aggregator-routing=false \
      --requestheader-client-ca-file="$pki/front-proxy-ca.crt" \
      --requestheader-allowed-names=front-proxy-client \
      --requestheader-username-headers=X-Remote-User \
      --requestheader-group-headers=X-Remote-Group \
      "${uid_headers[@]}" \
      --requestheader-extra-headers-prefix=X-Remote-Extra- \
      --proxy-client-cert-file="$pki/front-proxy-client.crt" \
      --proxy-client-key-file="$pki/front-proxy-client.key" \
      --allow-privileged=true \
      --profiling=false
    ;;
  kube-controller-manager)
    start kube-controller-manager -- \
      --kubeconfig="$STATE/kubeconfigs/controller-manager" \
      --authentication-kubeconfig="$STATE/kubeconfigs/controller-manager" \
      --authorization-kubeconfig="$STATE/kubeconfigs/controller-manager" \
      --bind-address="$CP_IP" --secure-port="$KCM_PORT" --cert-dir="$STATE/run/controller-manager" \
      --service-account-private-key-file="$pki/sa.key" --root-ca-file="$pki/ca.crt" \
      --cluster-signing-cert-file="$pki/ca.crt" --cluster-signing-key-file="$pki/ca.key" \
      --use-service-account-credentials=true \
      --service-cluster-ip-range="$SERVICE_CIDR" \
      --horizontal-pod-autoscaler-sync-period=5s \
      --leader-elect=false --profiling=false
    ;;
  kube-scheduler)
    start kube-scheduler -- \
      --kubeconfig="$STATE/kubeconfigs/scheduler" \
      --authentication-kubeconfig="$STATE/kubeconfigs/scheduler" \
      --authorization-kubeconfig="$STATE/kubeconfigs/scheduler" \
      --bind-address="$CP_IP" --secure-port="$SCHEDULER_PORT" --cert-dir="$STATE/run/scheduler" \
      --leader-elect=false --profiling=false
    ;;
  kwok)
    sed -e "s/@CP_IP@/$CP_IP/g" -e "s/@KWOK_PORT@/$KWOK_PORT/g" -e "s/@NET@/$NET/g" \
      "$CLUSTER_DIR/kwok/kwok.yaml" >"$STATE/kwok.yaml"
    start kwok -- --kubeconfig="$STATE/kubeconfigs/kwok" --config="$STATE/kwok.yaml"
    ;;
  registry)
    # On the host (the node and the host reach it at $REGISTRY): lib/registry.sh.
    start registry -- serve "$REGISTRY_DIR/config.yml"
    ;;
  containerd)
    start_in_node containerd PATH="$CONTAINERD_DIR:/usr/sbin:/usr/bin:/sbin:/bin" -- --config="$NODE_DIR/containerd.toml"
    ;;
  kubelet)
    start_in_node kubelet PATH=/usr/sbin:/usr/bin:/sbin:/bin -- \
      --config="$NODE_DIR/kubelet.yaml" --kubeconfig="$STATE/kubeconfigs/kubelet" \
      --root-dir="$NODE_DIR/kubelet" --hostname-override="$NODE_NAME" --node-ip="$NODE_IP" \
      --node-labels="tests.hearth.dev/real-node=true,nvidia.com/gpu.present=true,accelerator=huawei-Ascend910"
    ;;
  device-plugin)
    # The kubelet serves the device-plugin API at a fixed path (not below --root-dir); in the node's
    # mount namespace that path is in the node's own tmpfs.
    start_in_node device-plugin -- \
      --device-plugin-dir=/var/lib/kubelet/device-plugins \
      --resource=nvidia.com/gpu=2:NVIDIA_VISIBLE_DEVICES \
      --resource=huawei.com/Ascend910=8:ASCEND_VISIBLE_DEVICES \
      --resource=hearth.dev/fake-gpu=4:HEARTH_VISIBLE_DEVICES
    ;;
  kube-proxy)
    start_in_node kube-proxy PATH=/usr/sbin:/usr/bin:/sbin:/bin -- --config="$NODE_DIR/kube-proxy.yaml"
    ;;
  kube-router)
    # NetworkPolicies: kube-router's network policy controller alone (no routing, no Service
    # proxy, no CNI: the bridge plugin and kube-proxy do those), with iptables and ipsets in the
    # node's network namespace, where they die with it. Needs the node object (its InternalIP).
    start_in_node kube-router PATH=/usr/sbin:/usr/bin:/sbin:/bin -- \
      --kubeconfig="$STATE/kubeconfigs/kube-router" --hostname-override="$NODE_NAME" \
      --run-firewall=true --run-router=false --run-service-proxy=false --enable-cni=false \
      --service-cluster-ip-range="$SERVICE_CIDR" \
      --health-port="$KUBE_ROUTER_HEALTH_PORT" --metrics-port=0
    ;;
  *) die "unknown component $1" ;;
  esac
}

# await_component <component>: waits until a started component serves: etcd its port,
# kube-apiserver /readyz, the registry an authenticated /v2/, containerd its socket, the kubelet its /healthz and its node Ready,
# the device plugin its devices on the node. The others are not waited for.
await_component() {
  case "$1" in
  etcd)
    wait_until 30 "etcd to listen on $CP_IP:$ETCD_CLIENT_PORT" etcd port_open "$CP_IP" "$ETCD_CLIENT_PORT"
    ;;
  kube-apiserver)
    wait_until 120 "kube-apiserver to report ready (https://$APISERVER_IP:$APISERVER_PORT/readyz)" kube-apiserver \
      kubectl_ get --raw /readyz
    ;;
  registry)
    wait_until 30 "the registry to answer https://$REGISTRY/v2/ (TLS, basic auth)" registry registry_ready
    ;;
  containerd)
    wait_until 30 "containerd to serve $NODE_DIR/containerd.sock" containerd \
      in_node "$CTR" --address "$NODE_DIR/containerd.sock" version
    ;;
  kubelet)
    # Its own health first: after a restart, the node's Ready condition is still the old one.
    wait_until 60 "the kubelet to serve http://$NODE_IP:10248/healthz" kubelet \
      busybox wget -q -O /dev/null "http://$NODE_IP:10248/healthz"
    wait_until 60 "node $NODE_NAME to become Ready (kubelet)" kubelet \
      kubectl_ wait --for=condition=Ready --timeout=1s "node/$NODE_NAME"
    ;;
  device-plugin)
    wait_until 60 "node $NODE_NAME to advertise its fake devices (device plugin)" device-plugin \
      node_has_devices
    ;;
  kube-router)
    # Healthy once its first full sync of the policies into iptables and ipsets is done.
    wait_until 60 "kube-router to serve http://$NODE_IP:$KUBE_ROUTER_HEALTH_PORT/healthz (network policies synced)" \
      kube-router busybox wget -q -O /dev/null "http://$NODE_IP:$KUBE_ROUTER_HEALTH_PORT/healthz"
    ;;
  *) ;;
  esac
}

# stop_components <component...>: SIGTERM to each (in the order given), up to 15 s for a clean
# exit, then SIGKILL.
stop_components() {
  local c pid pids=() left=() deadline
  for c in "$@"; do
    pid="$(component_pid "$c")"
    if [[ -n "$pid" ]]; then
      kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
      log "stopping $c (pid $pid)"
    fi
  done
  deadline=$((SECONDS + 15))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.1; done
  done
  for c in "$@"; do
    pid="$(component_pid "$c")"
    if [[ -n "$pid" ]]; then
      log "$c (pid $pid) did not exit after SIGTERM; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      left+=("$pid")
    fi
  done
  for pid in "${left[@]}"; do
    while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
  done
}

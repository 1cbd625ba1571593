# shellcheck shell=bash
# The real node (sourced after common.sh): containerd + runc, the kubelet, kube-proxy, CNI and a
# fake device plugin, all inside a network and a mount namespace of their own, every process in
# one cgroup subtree. See README.md, "The real node".
#
# What `up` creates on the host, and nothing else (`node_teardown` removes all of it):
# - $NS_DIR/net, bind-mounted onto itself, holding the node's network namespace (a bind mount of
#   its nsfs file `ns`); the node's mount namespace is held by a process, $NS_DIR/mnt.pid (see
#   node_network_up for why it is not bind-mounted too);
# - the veth end $NODE_HOST_IF with $NODE_HOST_IP/30, and one route: $NODE_NET via the node;
# - the cgroup $NODE_CGROUP in every cgroup hierarchy;
# - while the kubelet runs, the kernel settings it insists on (vm.overcommit_memory,
#   kernel.panic, kernel.panic_on_oops, ...): their values before the first real node of this
#   machine started are saved in $HOST_SYSCTLS_SAVED and put back when the last one stops.
# Mounts made inside the node (container root filesystems, volumes, pod network namespaces, the
# tmpfs on /run, /var/lib and /var/log) live in the node's mount namespace and die with it;
# iptables rules, bridges and conntrack entries live in its network namespace and die with it.

# The kernel settings the kubelet sets at start (pkg/kubelet/cm setupKernelTunables).
KUBELET_SYSCTLS=(vm.overcommit_memory vm.panic_on_oom kernel.panic kernel.panic_on_oops
  kernel.keys.root_maxkeys kernel.keys.root_maxbytes)
# Machine-wide: the settings are not per namespace, and several clusters may run at once.
HOST_SYSCTLS_SAVED=/run/hearth-kubelet-sysctls

# node_mnt_ns: prints the path of the node's mount namespace, /proc/<holder>/ns/mnt, where the
# holder is the process whose PID is in $NS_DIR/mnt.pid, and only while that PID is a `sleep` in
# the node's cgroup and network namespace (a reused PID, even a host-network container's of this
# node, is never taken for it); dies otherwise.
node_mnt_ns() {
  local pid="" exe=""
  [[ -f "$NS_DIR/mnt.pid" ]] && pid="$(<"$NS_DIR/mnt.pid")"
  if [[ "$pid" =~ ^[0-9]+$ ]]; then
    exe="$(readlink "/proc/$pid/exe" 2>/dev/null)" || exe=""
  fi
  if [[ -n "$exe" && "$(basename "${exe% (deleted)}")" == sleep && -e "$NS_DIR/net/ns" &&
    "/proc/$pid/ns/net" -ef "$NS_DIR/net/ns" ]] &&
    grep -q ":/$NODE_CGROUP/node\$" "/proc/$pid/cgroup" 2>/dev/null; then
    echo "/proc/$pid/ns/mnt"
    return 0
  fi
  die "the real node's mount namespace is gone (no process ${pid:-?} from $NS_DIR/mnt.pid in the node's network namespace $NS_DIR/net/ns): the node was stopped or is broken; run tests/cluster/down, then tests/cluster/up"
}

# in_node <command...>: runs a command in the node's network and mount namespaces.
in_node() {
  local mnt
  mnt="$(node_mnt_ns)" || return 1
  nsenter --net="$NS_DIR/net/ns" --mount="$mnt" -- "$@"
}

# Mount points of the cgroup hierarchies (v1 controllers, name=systemd, the v2 "unified" one).
cgroup_mounts() { findmnt -rn -t cgroup,cgroup2 -o TARGET; }

# Other real nodes of this machine (their cgroups), besides this one.
other_nodes() {
  local d
  for d in /sys/fs/cgroup/memory/hearth-198-*; do
    [[ -d "$d" && "${d##*/}" != "$NODE_CGROUP" ]] && echo "${d##*/}"
  done
  return 0
}

# Checks the tools the node needs; installs Debian's packages for the missing ones when root.
node_require() {
  [[ "$(id -u)" == 0 ]] ||
    die "the real node needs root (network and mount namespaces, cgroups, a veth pair); run tests/cluster/up as root"
  local missing=()
  [[ -x "$CONTAINERD" && -x "$CTR" && -x "$CONTAINERD_SHIM" && -x "$RUNC" ]] ||
    die "containerd $CONTAINERD_VERSION or runc $RUNC_VERSION is not built in $BIN (tests/cluster/build builds them)"
  [[ -x "$CNI_BIN_DIR/bridge" && -x "$CNI_BIN_DIR/host-local" && -x "$CNI_BIN_DIR/loopback" &&
    -x "$CNI_BIN_DIR/portmap" ]] || missing+=(containernetworking-plugins)
  command -v iptables >/dev/null 2>&1 || missing+=(iptables)
  command -v conntrack >/dev/null 2>&1 || missing+=(conntrack)
  command -v nsenter >/dev/null 2>&1 && command -v unshare >/dev/null 2>&1 || missing+=(util-linux)
  command -v ip >/dev/null 2>&1 || missing+=(iproute2)
  ((${#missing[@]} == 0)) || apt_install "the real node" "${missing[@]}"
  case "$STATE/" in
    /run/* | /var/run/* | /var/lib/* | /var/log/*)
      die "HEARTH_CLUSTER_STATE=$STATE is below /run, /var/lib or /var/log, which the node covers with a tmpfs of its own; choose another dir" ;;
  esac
  [[ -d /sys/fs/cgroup/memory ]] ||
    die "the real node expects cgroups v1 controllers under /sys/fs/cgroup (found none for memory)"
}

# require_free_disk <dir>: the node's filesystem has room for what `up` and the tests put there
# (images imported into containerd, etcd, pod logs and volumes: 0.75 GiB after `up`, at most
# 0.8 GiB in a full test run). Below 2 GiB free (what unprivileged writers may use, as the
# kubelet counts it) `up` stops here with the figure, rather than later with a node tainted
# `disk-pressure` and pods that never schedule; below 5 GiB it warns. HEARTH_MIN_FREE_MIB
# overrides the 2 GiB.
require_free_disk() {
  local dir="$1" need="${HEARTH_MIN_FREE_MIB:-2048}" free
  free="$(df -Pk "$dir" | awk 'NR == 2 { print int($4 / 1024) }')"
  [[ "$free" =~ ^[0-9]+$ ]] || die "could not read the free space of $dir (df -Pk $dir)"
  ((free >= need)) ||
    die "$dir has ${free} MiB free; the real node needs at least ${need} MiB (HEARTH_MIN_FREE_MIB). Free some (cargo clean, go clean -cache) or point HEARTH_CLUSTER_STATE at a larger filesystem"
  ((free >= 5120)) ||
    log "warning: only ${free} MiB free on the filesystem of $dir; the kubelet evicts pods below 256 MiB (node/kubelet.yaml)"
}

# Creates the node's namespaces, its link to the host and its cgroup.
node_network_up() {
  [[ -d "/sys/fs/cgroup/memory/$NODE_CGROUP" ]] &&
    die "cgroup $NODE_CGROUP exists: a real node of another cluster uses $NODE_NET (or one crashed without down). Stop it with its own tests/cluster/down, or set HEARTH_NODE_NET (e.g. 198.19.64.0/18) for this one."
  echo "$NODE_NET $NODE_HOST_IF $NODE_CGROUP" >"$NODE_OWNER"
  # The node's cgroup first: the process that holds the node's namespaces starts in it, so
  # that node_kill ends it with everything else of the node.
  local d procs=""
  for d in $(cgroup_mounts); do
    mkdir -p "$d/$NODE_CGROUP/node"
    # cpuset: a v1 cgroup starts with no CPUs or memory nodes; inherit the parent's.
    if [[ -f "$d/cpuset.cpus" ]]; then
      cat "$d/cpuset.cpus" >"$d/$NODE_CGROUP/cpuset.cpus"
      cat "$d/cpuset.mems" >"$d/$NODE_CGROUP/cpuset.mems"
      cat "$d/cpuset.cpus" >"$d/$NODE_CGROUP/node/cpuset.cpus"
      cat "$d/cpuset.mems" >"$d/$NODE_CGROUP/node/cpuset.mems"
    fi
    procs+="$d/$NODE_CGROUP/node/cgroup.procs "
  done
  # The network namespace is kept by bind-mounting its nsfs file onto a file on a shared mount
  # (as iproute2 keeps /run/netns), so that unmounting it also unmounts the copies that mount
  # namespaces made later hold (the node of a second cluster), and the namespace really goes.
  #
  # The mount namespace is held by a process instead (`sleep infinity` in the node's cgroup,
  # PID in $NS_DIR/mnt.pid), and entered through /proc/<pid>/ns/mnt. A bind mount of a mount
  # namespace's file is refused with EINVAL whenever the new namespace's id is not above the
  # id of the namespace of the process that binds it (the kernel's loop check, mnt_ns_loop).
  # Since Linux 6.18 namespace ids come from per-CPU batches (gen_cookie_next), so a namespace
  # made later can get a lower id: from the host's initial namespace (the lowest id) the bind
  # always worked, but from inside another new mount namespace (`unshare -m`, a CI runner, a
  # container) it failed about half the time, depending on the CPU each was made on.
  mkdir -p "$NS_DIR/net"
  mount --bind "$NS_DIR/net" "$NS_DIR/net"
  mount --make-shared "$NS_DIR/net"
  : >"$NS_DIR/net/ns"
  rm -f "$NS_DIR/mnt.pid" "$NS_DIR/mnt.ready"
  # Slave propagation: the host's mounts stay visible, the node's never reach the host. The
  # tmpfs mounts catch what the node's programs write to their default paths (/run/containerd,
  # /var/lib/cni, /var/log/pods, ...). The state dir is not below them (node_require), so the
  # ready file written from inside is the host's.
  setsid /bin/sh -c '
    for f in $1; do echo $$ >"$f" || exit 1; done
    exec unshare --net="$2/net/ns" --mount --propagation slave -- /bin/sh -ec "
      mount -t tmpfs -o mode=0755,size=512m hearth-node-run /run
      mount -t tmpfs -o mode=0755,size=1g hearth-node-var-lib /var/lib
      mount -t tmpfs -o mode=0755,size=1g hearth-node-var-log /var/log
      ip link set lo up
      : >\"\$0/mnt.ready\"
      exec sleep infinity" "$2"' sh "$procs" "$NS_DIR" >>"$LOGS/node-namespaces.log" 2>&1 </dev/null &
  local holder=$! i exe=""
  echo "$holder" >"$NS_DIR/mnt.pid"
  # Ready once the mounts are made and the holder has become the `sleep` node_mnt_ns looks
  # for: the ready file is written just before that exec, and on a busy machine the exec can
  # come well after it.
  for ((i = 0; i < 200; i++)); do
    if [[ -f "$NS_DIR/mnt.ready" ]]; then
      exe="$(readlink "/proc/$holder/exe" 2>/dev/null)" || exe=""
      [[ "$(basename "${exe% (deleted)}")" == sleep ]] && break
    fi
    kill -0 "$holder" 2>/dev/null || break
    sleep 0.05
  done
  if [[ ! -f "$NS_DIR/mnt.ready" || "$(basename "${exe% (deleted)}")" != sleep ]]; then
    tail -n 20 "$LOGS/node-namespaces.log" >&2 || true
    die "creating the real node's namespaces failed (log: $LOGS/node-namespaces.log); tests/cluster/down removes what was made"
  fi
  # The veth pair: eth0 in the node, $NODE_HOST_IF on the host (the netns of this script).
  in_node ip link add eth0 type veth peer name "$NODE_HOST_IF" netns "$$"
  ip addr add "$NODE_HOST_IP/30" dev "$NODE_HOST_IF"
  ip link set "$NODE_HOST_IF" up
  in_node ip addr add "$NODE_IP/30" dev eth0
  in_node ip link set eth0 up
  # The host reaches pods and Service VIPs through the node; the node has no default route, so
  # nothing from a pod leaves the node's block except to the host.
  ip route add "$NODE_NET" via "$NODE_IP" dev "$NODE_HOST_IF"
  # Per network namespace: forwarding between pods, and bridged traffic through iptables so
  # kube-proxy's rules see pod-to-Service traffic on the same bridge.
  in_node sysctl -q -w net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 ||
    die "setting net.ipv4.ip_forward and net.bridge.bridge-nf-call-iptables in the node's network namespace failed: the kernel needs bridge netfilter (br_netfilter); tests/cluster/down removes what was made"
}

# Renders the node's configuration files from tests/cluster/node/*.
node_configure() {
  local f drop=()
  # The kubelet's failCgroupV1 came with Kubernetes 1.31; an older kubelet runs on cgroups v1
  # anyway, and would only warn of an unknown field.
  ((KUBE_MINOR >= 31)) || drop=(-e '/^failCgroupV1:/d')
  mkdir -p "$NODE_DIR/cni/net.d" "$NODE_DIR/cni/ipam" "$NODE_DIR/kubelet" "$NODE_DIR/containerd"
  for f in containerd.toml kubelet.yaml kube-proxy.yaml cluster.yaml; do
    sed "${drop[@]}" -e "s|@NODE_DIR@|$NODE_DIR|g" -e "s|@STATE@|$STATE|g" -e "s|@PKI@|$STATE/pki|g" \
      -e "s|@PAUSE_IMAGE@|$PAUSE_IMAGE|g" -e "s|@COREDNS_IMAGE@|$COREDNS_IMAGE|g" \
      -e "s|@CNI_BIN_DIR@|$CNI_BIN_DIR|g" -e "s|@RUNC@|$RUNC|g" \
      -e "s|@NODE_POD_CIDR@|$NODE_POD_CIDR|g" -e "s|@NODE_CGROUP@|$NODE_CGROUP|g" -e "s|@NODE_IP@|$NODE_IP|g" \
      -e "s|@NODE_NAME@|$NODE_NAME|g" -e "s|@KUBELET_PORT@|$KUBELET_PORT|g" \
      -e "s|@CLUSTER_DNS_IP@|$CLUSTER_DNS_IP|g" -e "s|@REGISTRY@|$REGISTRY|g" \
      -e "s|@REGISTRY_USER@|$REGISTRY_USER|g" \
      "$CLUSTER_DIR/node/$f" >"$NODE_DIR/$f"
  done
  # The registry's password: through the environment (not a command line) into a file only root
  # reads.
  (
    umask 077
    REGISTRY_PASSWORD="$(registry_password)" awk '{ gsub(/@REGISTRY_PASSWORD@/, ENVIRON["REGISTRY_PASSWORD"]) } 1' \
      "$NODE_DIR/containerd.toml" >"$NODE_DIR/containerd.toml.tmp"
  )
  mv -f "$NODE_DIR/containerd.toml.tmp" "$NODE_DIR/containerd.toml"
  sed -e "s|@NODE_DIR@|$NODE_DIR|g" -e "s|@NODE_POD_CIDR@|$NODE_POD_CIDR|g" \
    "$CLUSTER_DIR/node/cni.conflist" >"$NODE_DIR/cni/net.d/10-hearth.conflist"
}

# start_in_node <component> [VAR=value ...] -- <args...>: like `start`, but the process runs in
# the node's namespaces and in the node's cgroup, so `down` finds it and every child it forks.
start_in_node() {
  local name="$1" bin envs=() procs="" d mnt
  shift
  while [[ "$1" != "--" ]]; do
    envs+=("$1")
    shift
  done
  shift
  bin="$(component_binary "$name")"
  for d in $(cgroup_mounts); do procs+="$d/$NODE_CGROUP/node/cgroup.procs "; done
  mnt="$(node_mnt_ns)" || return 1
  # The shell joins the cgroup, then nsenter enters the namespaces and execs the component
  # (no fork: the PID stays the one recorded).
  env "${envs[@]}" setsid /bin/sh -c '
    for f in $1; do echo $$ >"$f" || exit 1; done
    net="$2"; mnt="$3"; shift 3
    exec nsenter --net="$net" --mount="$mnt" -- "$@"' \
    sh "$procs" "$NS_DIR/net/ns" "$mnt" "$bin" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
  record_started "$name" "$!"
}

# Saves the kernel settings the kubelet changes, once per machine: not when another real node
# (whose kubelet set them already) runs, nor when a record exists (a restarted kubelet must not
# overwrite the original values with its own).
node_save_sysctls() {
  [[ -s "$HOST_SYSCTLS_SAVED" || -n "$(other_nodes)" ]] && return 0
  local s
  for s in "${KUBELET_SYSCTLS[@]}"; do
    printf '%s=%s\n' "$s" "$(sysctl -n "$s")"
  done >"$HOST_SYSCTLS_SAVED.tmp"
  mv "$HOST_SYSCTLS_SAVED.tmp" "$HOST_SYSCTLS_SAVED"
}

# PIDs of every process in the node's cgroup subtree (daemons, shims, containers).
node_pids() {
  local d
  for d in $(cgroup_mounts); do
    [[ -d "$d/$NODE_CGROUP" ]] || continue
    find "$d/$NODE_CGROUP" -name cgroup.procs -exec cat {} + 2>/dev/null
  done | sort -un
}

# Removes everything node_network_up and the node's processes made on the host; safe to run on
# a node that was never (or only partly) started, and twice.
node_teardown() {
  node_kill
  node_remove
}

# node_leftovers: prints one line for each thing of the node that is still on the host (a
# process in its cgroup, the host's end of its link, a cgroup, the namespace's bind mount);
# nothing once node_teardown did its work.
node_leftovers() {
  local pids d
  pids="$(node_pids | tr '\n' ' ')"
  [[ -z "${pids// /}" ]] || echo "processes in cgroup $NODE_CGROUP: $pids"
  ! ip link show "$NODE_HOST_IF" >/dev/null 2>&1 || echo "link $NODE_HOST_IF"
  for d in $(cgroup_mounts); do
    [[ ! -d "$d/$NODE_CGROUP" ]] || echo "cgroup $d/$NODE_CGROUP"
  done
  for d in "$NS_DIR/net" "$NS_DIR/mnt"; do
    ! mountpoint -q "$d" 2>/dev/null || echo "mount $d"
  done
  return 0
}

# Whether this state dir made a real node (so `down` may remove it).
node_owned() { [[ -f "$NODE_OWNER" ]]; }

# Kills every process of the node: the daemons `down` already stopped, and what they leave
# behind (containerd's shims and the containers themselves).
node_kill() {
  local pids i
  for ((i = 0; i < 50; i++)); do
    pids="$(node_pids)"
    [[ -n "$pids" ]] || break
    ((i > 0)) || log "stopping the node's remaining processes: $(wc -w <<<"$pids")"
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
  done
  [[ -z "$(node_pids)" ]] || log "warning: processes left in cgroup $NODE_CGROUP: $(node_pids | tr '\n' ' ')"
}

# Removes the node's namespaces (and with them its link and route), cgroups and the kernel
# settings the kubelet changed. Run it once the control plane has stopped: the apiserver listens
# on the host end of the link, and without the link its own connections to itself would go out
# through the host's default route.
node_remove() {
  local d i s
  # Namespaces: with no process left in them (node_kill ended the mount namespace's holder),
  # dropping the bind mount frees them, and with them every mount, interface, route and
  # iptables rule made inside. The veth pair goes with the node's end, and the host route with
  # the link. ($NS_DIR/mnt is a bind mount only in a state dir of an older `up`.)
  if [[ -d "$NS_DIR" ]]; then
    umount "$NS_DIR/mnt/ns" 2>/dev/null || true
    umount "$NS_DIR/net/ns" 2>/dev/null || true
    for d in "$NS_DIR/mnt" "$NS_DIR/net"; do
      while mountpoint -q "$d" 2>/dev/null; do umount "$d" || break; done
    done
  fi
  # The kernel frees a namespace asynchronously: give the veth pair a moment to go with it.
  for ((i = 0; i < 30; i++)); do
    ip link show "$NODE_HOST_IF" >/dev/null 2>&1 || break
    sleep 0.1
  done
  if ip link show "$NODE_HOST_IF" >/dev/null 2>&1; then
    ip link del "$NODE_HOST_IF" 2>/dev/null || log "warning: could not delete link $NODE_HOST_IF"
  fi
  # cgroups, deepest first (a cgroup can only be removed once empty of processes and children).
  for d in $(cgroup_mounts); do
    [[ -d "$d/$NODE_CGROUP" ]] || continue
    for ((i = 0; i < 20; i++)); do
      find "$d/$NODE_CGROUP" -depth -type d -exec rmdir {} + 2>/dev/null || true
      [[ -d "$d/$NODE_CGROUP" ]] || break
      sleep 0.1
    done
    [[ ! -d "$d/$NODE_CGROUP" ]] || log "warning: could not remove cgroup $d/$NODE_CGROUP"
  done
  # The last real node of the machine puts the kernel settings back.
  if [[ -s "$HOST_SYSCTLS_SAVED" && -z "$(other_nodes)" ]]; then
    local failed=0
    while IFS= read -r s; do
      sysctl -q -w "$s" >/dev/null || { log "warning: could not restore $s"; failed=1; }
    done <"$HOST_SYSCTLS_SAVED"
    ((failed)) || rm -f "$HOST_SYSCTLS_SAVED"
  fi
  # The owner file goes last, and only when nothing is left: a second `down` must still know
  # that this node is its to remove.
  [[ -n "$(node_leftovers)" ]] || rm -f "$NODE_OWNER"
}

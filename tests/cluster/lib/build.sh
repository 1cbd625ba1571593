# shellcheck shell=bash
# Builds the pinned upstream binaries from Go modules into $BIN (sourced after common.sh).
# Each binary is named <name>-<version>; an existing file is reused, so only the first run
# compiles. Module versions and go.sum files live in tests/cluster/go/<group>/; Kubernetes' and
# KEDA's in $KUBE_GO_DIR and $KEDA_GO_DIR, which HEARTH_CLUSTER_VERSIONS chooses (common.sh).

require_go() {
  command -v go >/dev/null 2>&1 ||
    die "the Go toolchain (>= 1.26) is needed to build the cluster binaries; install it and put 'go' on PATH"
  local v
  v="$(go env GOVERSION)"
  if ! [[ "$v" =~ ^go1\.([0-9]+) ]] || ((BASH_REMATCH[1] < 26)); then
    die "Go >= 1.26 is needed (kwok 0.8 and KEDA 2.20 require it), found $v"
  fi
}

# build_lock / build_unlock: hold $CACHE/build.lock (flock) while building, so that two builds
# (CI's background one and `make test`'s, or two checkouts) never write the cache at once: the
# second waits, then finds the binaries built. Unlock before starting long-lived processes, which
# would otherwise inherit the lock's descriptor and hold it.
build_lock() {
  mkdir -p "$CACHE"
  exec {BUILD_LOCK_FD}>"$CACHE/build.lock"
  if ! flock -n "$BUILD_LOCK_FD"; then
    log "waiting for another build of the cluster binaries to finish ($CACHE/build.lock)"
    flock "$BUILD_LOCK_FD"
  fi
}
build_unlock() {
  [[ -n "${BUILD_LOCK_FD:-}" ]] || return 0
  exec {BUILD_LOCK_FD}>&-
  BUILD_LOCK_FD=""
}

# Reads `go build -v` output (one package per line) and prints a progress line every 5%.
progress() { # <label> <total packages>
  awk -v label="$1" -v total="$2" -v start="$(date +%s)" '
    { n++; pct = int(n * 100 / total); if (pct > 100) pct = 100
      if (pct >= next_pct) {
        printf "[build] %-11s %5d/%d packages (%3d%%) %4ds\n", label, n, total, pct, systime() - start
        fflush(); next_pct = pct - pct % 5 + 5
      } }'
}

# go_build <label> <module dir under go/> <ldflags> <output dir> <package>...
go_build() {
  local label="$1" dir="$CLUSTER_DIR/go/$2" ldflags="$3" out="$4"
  shift 4
  local logf="$CACHE/build/$label.log" total start
  mkdir -p "$out" "$CACHE/build"
  start=$SECONDS
  log "building $label: resolving packages, downloading modules (full log: $logf)"
  # CGO_ENABLED=0 as upstream's release builds; GO_BUILD_CGO=1 and GO_BUILD_TAGS for the one
  # program that needs cgo (runc's seccomp).
  export CGO_ENABLED="${GO_BUILD_CGO:-0}"
  local tags=(-tags "${GO_BUILD_TAGS:-}")
  if ! total="$(cd "$dir" && go list "${tags[@]}" -deps "$@" 2>"$logf" | wc -l)"; then
    tail -n 30 "$logf" >&2
    die "resolving the packages of $label failed (a first build needs the Go module proxy); log: $logf"
  fi
  log "$label: $(grep -c '^go: downloading' "$logf" || true) modules downloaded, $total packages"
  if ! (cd "$dir" && go build "${tags[@]}" -v -trimpath -ldflags "$ldflags" -o "$out/" "$@" 2>&1) |
    tee -a "$logf" | progress "$label" "$total" >&2; then
    tail -n 30 "$logf" >&2
    die "building $label failed; full log in $logf"
  fi
  log "built $label in $((SECONDS - start))s"
}

# install_bin <built file> <final path>: atomic rename within the cache.
install_bin() { mv -f "$1" "$2"; }

build_all() {
  local need=() tmp
  [[ -x "$ETCD" ]] || need+=(etcd)
  [[ -x "$KUBE_APISERVER" && -x "$KUBE_CONTROLLER_MANAGER" && -x "$KUBE_SCHEDULER" && -x "$KUBECTL" ]] ||
    need+=(kubernetes)
  [[ -x "$KWOK" ]] || need+=(kwok)
  [[ -x "$KEDA_OPERATOR" && -x "$KEDA_ADAPTER" && -x "$KEDA_WEBHOOKS" &&
    -f "$KEDA_CONFIG/default/kustomization.yaml" ]] || need+=(keda)
  [[ -x "$HELM" ]] || need+=(helm)
  [[ -x "$KUBELET" && -x "$KUBE_PROXY" ]] || need+=(kube-node)
  [[ -x "$COREDNS" ]] || need+=(coredns)
  [[ -x "$KUBE_ROUTER" ]] || need+=(kube-router)
  [[ -x "$PAUSE" ]] || need+=(pause)
  [[ -x "$CONTAINERD" && -x "$CTR" && -x "$CONTAINERD_SHIM" ]] || need+=(containerd)
  [[ -x "$RUNC" ]] || need+=(runc)
  [[ -x "$COSIGN" ]] || need+=(cosign)
  [[ -x "$ACTIONLINT" ]] || need+=(actionlint)
  if ((${#need[@]} == 0)); then
    return 0
  fi
  require_go
  # -mod=readonly: go.mod/go.sum are committed and must already be complete; GOTOOLCHAIN=local
  # keeps Go from fetching another toolchain. GOCACHE and GOMODCACHE of their own, removed once
  # every binary is built: Kubernetes and KEDA leave ~7 GiB of compiled packages and the modules
  # of all the programs take over 4 GiB, on the disk the real node and the Rust builds share
  # (-modcacherw lets the modules be removed).
  export GOTOOLCHAIN=local GOFLAGS="-mod=readonly -modcacherw -buildvcs=false"
  export GOCACHE="$CACHE/build/go-cache" GOMODCACHE="$CACHE/build/go-mod"
  log "building into $BIN: ${need[*]} (first time only; Kubernetes and KEDA take a while on 2 cores)"
  local kube_ld p
  # What hack/lib/version.sh sets for release builds; the commit is not known from the module,
  # so gitCommit keeps its default.
  kube_ld="-s -w"
  for p in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
    kube_ld+=" -X $p.gitVersion=$KUBE_VERSION -X $p.gitTreeState=clean"
    kube_ld+=" -X $p.gitMajor=$(cut -d. -f1 <<<"${KUBE_VERSION#v}")"
    kube_ld+=" -X $p.gitMinor=$(cut -d. -f2 <<<"$KUBE_VERSION")"
  done
  mkdir -p "$BIN"
  tmp="$CACHE/build/out"
  rm -rf "$tmp"
  local g ld
  for g in "${need[@]}"; do
    case "$g" in
      etcd)
        go_build etcd etcd "-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=$ETCD_VERSION" \
          "$tmp/etcd" go.etcd.io/etcd/server/v3
        install_bin "$tmp/etcd/server" "$ETCD"
        ;;
      kubernetes)
        go_build kubernetes "$KUBE_GO_DIR" "$kube_ld" "$tmp/kubernetes" \
          k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
          k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubectl
        install_bin "$tmp/kubernetes/kube-apiserver" "$KUBE_APISERVER"
        install_bin "$tmp/kubernetes/kube-controller-manager" "$KUBE_CONTROLLER_MANAGER"
        install_bin "$tmp/kubernetes/kube-scheduler" "$KUBE_SCHEDULER"
        install_bin "$tmp/kubernetes/kubectl" "$KUBECTL"
        ;;
      kube-node)
        # The real node's kubelet and kube-proxy: same module, so the shared packages come from
        # Go's build cache.
        go_build kube-node "$KUBE_GO_DIR" "$kube_ld" "$tmp/kube-node" \
          k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-proxy
        install_bin "$tmp/kube-node/kubelet" "$KUBELET"
        install_bin "$tmp/kube-node/kube-proxy" "$KUBE_PROXY"
        ;;
      coredns)
        go_build coredns coredns \
          "-s -w -X github.com/coredns/coredns/coremain.GitCommit=$COREDNS_VERSION" \
          "$tmp/coredns" hearth.test/cluster/coredns
        install_bin "$tmp/coredns/coredns" "$COREDNS"
        ;;
      kube-router)
        # Its k8s.io modules are raised to the cluster's (go.mod), so after the Kubernetes build
        # they come from Go's build cache.
        go_build kube-router kube-router \
          "-s -w -X github.com/cloudnativelabs/kube-router/v2/pkg/version.Version=$KUBE_ROUTER_VERSION" \
          "$tmp/kube-router" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router
        install_bin "$tmp/kube-router/kube-router" "$KUBE_ROUTER"
        ;;
      pause)
        # The pod sandbox: Kubernetes' own pause.c from the same module, compiled the way its
        # build/pause/Makefile does (static, -Os).
        local src
        # (go mod download: the module cache is the build's own, empty when only pause is missing.)
        src="$(cd "$CLUSTER_DIR/go/$KUBE_GO_DIR" && go mod download k8s.io/kubernetes &&
          go list -m -f '{{.Dir}}' k8s.io/kubernetes)/build/pause/linux/pause.c"
        [[ -x /usr/bin/gcc && -f /usr/lib/x86_64-linux-gnu/libc.a ]] ||
          apt_install "compiling the pod sandbox (pause)" gcc libc6-dev
        mkdir -p "$tmp/pause"
        gcc -Os -Wall -Werror -static -DVERSION="$KUBE_VERSION" -o "$tmp/pause/pause" "$src" ||
          die "compiling $src failed (needs gcc and libc6-dev for a static binary)"
        install_bin "$tmp/pause/pause" "$PAUSE"
        ;;
      containerd)
        # The daemon, ctr and the runc shim, as containerd's Makefile builds them (static, the
        # version in the binaries; its Revision is not known from the module); the snapshotters
        # the node does not use are left out, as the Makefile's no_* tags do.
        ld="-s -w -X github.com/containerd/containerd/v2/version.Version=$CONTAINERD_VERSION"
        ld+=" -X github.com/containerd/containerd/v2/version.Package=github.com/containerd/containerd/v2"
        GO_BUILD_TAGS="no_btrfs no_devmapper no_zfs" go_build containerd containerd "$ld" "$tmp/containerd" \
          github.com/containerd/containerd/v2/cmd/containerd \
          github.com/containerd/containerd/v2/cmd/ctr \
          github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2
        mkdir -p "$CONTAINERD_DIR.tmp"
        mv -f "$tmp/containerd/containerd" "$tmp/containerd/ctr" "$tmp/containerd/containerd-shim-runc-v2" \
          "$CONTAINERD_DIR.tmp/"
        rm -rf "$CONTAINERD_DIR"
        mv "$CONTAINERD_DIR.tmp" "$CONTAINERD_DIR"
        ;;
      runc)
        # As runc's `make static`: cgo for libseccomp (the RuntimeDefault profile pods ask for),
        # linked statically; without libpathrs (a Rust library Debian does not ship here).
        [[ -f /usr/lib/x86_64-linux-gnu/libseccomp.a && -x /usr/bin/gcc ]] ||
          apt_install "runc's seccomp support" libseccomp-dev gcc libc6-dev
        GO_BUILD_CGO=1 GO_BUILD_TAGS="seccomp urfave_cli_no_docs netgo osusergo" go_build runc runc \
          "-s -w -linkmode external -extldflags -static" \
          "$tmp/runc" github.com/opencontainers/runc
        install_bin "$tmp/runc/runc" "$RUNC"
        ;;
      cosign)
        go_build cosign cosign "-s -w -X sigs.k8s.io/release-utils/version.gitVersion=$COSIGN_VERSION -X sigs.k8s.io/release-utils/version.gitTreeState=clean" \
          "$tmp/cosign" github.com/sigstore/cosign/v2/cmd/cosign
        install_bin "$tmp/cosign/cosign" "$COSIGN"
        ;;
      actionlint)
        go_build actionlint actionlint "-s -w -X github.com/rhysd/actionlint.version=${ACTIONLINT_VERSION#v}" \
          "$tmp/actionlint" github.com/rhysd/actionlint/cmd/actionlint
        install_bin "$tmp/actionlint/actionlint" "$ACTIONLINT"
        ;;
      kwok)
        go_build kwok kwok "-s -w -X sigs.k8s.io/kwok/pkg/consts.Version=${KWOK_VERSION#v}" \
          "$tmp/kwok" sigs.k8s.io/kwok/cmd/kwok
        install_bin "$tmp/kwok/kwok" "$KWOK"
        ;;
      keda)
        # The three programs of KEDA's release (its Makefile's manager, adapter and webhooks),
        # only those missing: they share most packages, so a later one mostly links.
        local pkgs=() dir
        [[ -x "$KEDA_OPERATOR" ]] || pkgs+=(github.com/kedacore/keda/v2/cmd/operator)
        [[ -x "$KEDA_ADAPTER" ]] || pkgs+=(github.com/kedacore/keda/v2/cmd/adapter)
        [[ -x "$KEDA_WEBHOOKS" ]] || pkgs+=(github.com/kedacore/keda/v2/cmd/webhooks)
        if ((${#pkgs[@]} > 0)); then
          ld="-s -w -X github.com/kedacore/keda/v2/version.Version=${KEDA_VERSION#v}"
          go_build keda "$KEDA_GO_DIR" "$ld" "$tmp/keda" "${pkgs[@]}"
          [[ -x "$KEDA_OPERATOR" ]] || install_bin "$tmp/keda/operator" "$KEDA_OPERATOR"
          [[ -x "$KEDA_ADAPTER" ]] || install_bin "$tmp/keda/adapter" "$KEDA_ADAPTER"
          [[ -x "$KEDA_WEBHOOKS" ]] || install_bin "$tmp/keda/webhooks" "$KEDA_WEBHOOKS"
        fi
        # KEDA's manifests (config/: CRDs, RBAC, Deployments, Services, APIService, webhooks)
        # from the same module version, which `up` renders with keda/kustomization.yaml. A copy,
        # so that `up` needs neither Go nor the module cache.
        # (go mod download: a no-op when the module is cached; needed when only config/ is missing.)
        dir="$(cd "$CLUSTER_DIR/go/$KEDA_GO_DIR" && go mod download github.com/kedacore/keda/v2 &&
          go list -m -f '{{.Dir}}' github.com/kedacore/keda/v2)" && [[ -d "$dir/config/default" ]] ||
          die "KEDA's module source (for config/) is not in the build's module cache ($GOMODCACHE)"
        rm -rf "$KEDA_CONFIG.tmp"
        mkdir -p "$(dirname "$KEDA_CONFIG")"
        cp -R "$dir/config" "$KEDA_CONFIG.tmp"
        chmod -R u+w "$KEDA_CONFIG.tmp"
        rm -rf "$KEDA_CONFIG"
        mv "$KEDA_CONFIG.tmp" "$KEDA_CONFIG"
        ;;
      helm)
        ld="-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION"
        ld+=" -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
        go_build helm helm "$ld" "$tmp/helm" helm.sh/helm/v4/cmd/helm
        install_bin "$tmp/helm/helm" "$HELM"
        ;;
    esac
  done
  rm -rf "$tmp" "$CACHE/build/go-cache" "$CACHE/build/go-mod"
  log "binaries ready in $BIN"
}

# shellcheck shell=bash
# The cluster's own images, built FROM nothing (no base image can be pulled) with buildah and
# written as OCI archives into $IMAGES, once per version (sourced after common.sh):
#
# | image                | content                                             | user  |
# |----------------------|-----------------------------------------------------|-------|
# | $PAUSE_IMAGE         | /pause (Kubernetes' pause.c): containerd's sandbox  | 65535 |
# | $COREDNS_IMAGE       | /coredns (tests/cluster/go/coredns)                 | 65532 |
# | $TOOLS_IMAGE         | Debian's static busybox as /bin/* (test pods only)  | root  |
# | $KEDA_IMAGE          | /keda (KEDA's operator) + keda_base_rootfs          | 65532 |
# | $KEDA_ADAPTER_IMAGE  | /keda-adapter (metrics adapter) + keda_base_rootfs  | 65532 |
# | $KEDA_WEBHOOKS_IMAGE | /keda-admission-webhooks + keda_base_rootfs         | 65532 |
#
# The KEDA images are laid out as KEDA's own Dockerfiles make them (binary at the path the
# manifests' `command` names, same ENTRYPOINT, USER 65532:65532), on what their base image
# (distroless/static:nonroot) provides. buildah keeps its storage under $CACHE/buildah (never the
# host's default container storage).

# Every cluster image, in the order load-images imports them.
CLUSTER_IMAGES=(pause coredns test-tools keda keda-metrics-apiserver keda-admission-webhooks)

require_buildah() {
  command -v buildah >/dev/null 2>&1 || apt_install "building the cluster's images" buildah
}

buildah_() {
  buildah --root "$CACHE/buildah/root" --runroot "$CACHE/buildah/runroot" --storage-driver vfs "$@"
}

# cluster_image_archive <one of CLUSTER_IMAGES>: the archive's path (versioned name).
cluster_image_archive() {
  case "$1" in
    pause) echo "$IMAGES/pause-$KUBE_VERSION.tar" ;;
    coredns) echo "$IMAGES/coredns-$COREDNS_VERSION.tar" ;;
    test-tools) echo "$IMAGES/test-tools-busybox-$(busybox_version).tar" ;;
    keda | keda-metrics-apiserver | keda-admission-webhooks) echo "$IMAGES/$1-$KEDA_VERSION.tar" ;;
    *) die "unknown cluster image $1" ;;
  esac
}

busybox_version() { dpkg-query -W -f '${Version}' busybox-static 2>/dev/null | tr -c 'A-Za-z0-9.\n' - || echo none; }

# scratch_image <reference> <archive> <user> <entrypoint as JSON> <rootfs dir>
# Commits the directory as the single layer of an image with that entrypoint and user, and
# writes it as an OCI archive whose index names <reference>.
scratch_image() {
  local ref="$1" archive="$2" user="$3" entrypoint="$4" rootfs="$5" ctr
  ctr="$(buildah_ from scratch)"
  buildah_ copy "$ctr" "$rootfs" / >/dev/null
  buildah_ config --entrypoint "$entrypoint" --cmd '' --user "$user" \
    --label org.opencontainers.image.source=tests/cluster "$ctr"
  buildah_ commit --quiet --rm "$ctr" "$ref" >/dev/null
  rm -f "$archive.tmp"
  buildah_ push --quiet "$ref" "oci-archive:$archive.tmp:$ref" >/dev/null
  mv -f "$archive.tmp" "$archive"
}

# keda_base_rootfs <dir>: what distroless/static:nonroot, the base of KEDA's images, gives the
# binaries, from this machine's Debian packages: CA roots (ca-certificates; Go reads
# /etc/ssl/certs/ca-certificates.crt, for scalers that talk TLS to servers with public
# certificates), time zones (tzdata; the cron scaler loads its `timezone`), /etc/passwd and
# /etc/group naming user 65532 (nonroot), and a world-writable /tmp. KEDA's manifests make the
# root filesystem read-only and mount what must be writable (the adapter's /tmp, /certs).
keda_base_rootfs() {
  local root="$1"
  mkdir -p "$root/etc/ssl/certs" "$root/usr/share" "$root/tmp" "$root/home/nonroot"
  chmod 1777 "$root/tmp"
  install -m 0644 /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  cp -a /usr/share/zoneinfo "$root/usr/share/zoneinfo"
  printf '%s\n' 'root:x:0:0:root:/root:/sbin/nologin' 'nobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin' \
    'nonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin' >"$root/etc/passwd"
  printf '%s\n' 'root:x:0:' 'nobody:x:65534:' 'nonroot:x:65532:' >"$root/etc/group"
}

build_cluster_images() {
  local need=() name archive root
  for name in "${CLUSTER_IMAGES[@]}"; do
    [[ -s "$(cluster_image_archive "$name")" ]] || need+=("$name")
  done
  ((${#need[@]} > 0)) || return 0
  require_buildah
  if [[ " ${need[*]} " == *" test-tools "* ]] && ! dpkg-query -W busybox-static >/dev/null 2>&1; then
    apt_install "the test-tools image" busybox-static
  fi
  if [[ " ${need[*]} " == *" keda"* ]] &&
    [[ ! -s /etc/ssl/certs/ca-certificates.crt || ! -f /usr/share/zoneinfo/UTC ]]; then
    apt_install "the KEDA images" ca-certificates tzdata
  fi
  mkdir -p "$IMAGES" "$CACHE/buildah"
  for name in "${need[@]}"; do
    archive="$(cluster_image_archive "$name")"
    root="$CACHE/build/image-$name"
    rm -rf "$root"
    mkdir -p "$root"
    case "$name" in
      pause)
        install -m 0755 "$PAUSE" "$root/pause"
        scratch_image "$PAUSE_IMAGE" "$archive" 65535:65535 '["/pause"]' "$root"
        ;;
      coredns)
        install -m 0755 "$COREDNS" "$root/coredns"
        scratch_image "$COREDNS_IMAGE" "$archive" 65532:65532 '["/coredns"]' "$root"
        ;;
      test-tools)
        # Every busybox applet as a link to /bin/busybox; /tmp for tools that write there.
        mkdir -p "$root/bin" "$root/tmp"
        chmod 1777 "$root/tmp"
        install -m 0755 /bin/busybox "$root/bin/busybox"
        local applet
        for applet in $(/bin/busybox --list); do
          [[ "$applet" == busybox ]] || ln -s busybox "$root/bin/$applet"
        done
        scratch_image "$TOOLS_IMAGE" "$archive" 0:0 '["/bin/sh"]' "$root"
        ;;
      # Entrypoints as in KEDA's Dockerfile, Dockerfile.adapter and Dockerfile.webhooks (the
      # manifests override them with `command` and `args`).
      keda)
        keda_base_rootfs "$root"
        install -m 0755 "$KEDA_OPERATOR" "$root/keda"
        scratch_image "$KEDA_IMAGE" "$archive" 65532:65532 \
          '["/keda", "--zap-log-level=info", "--zap-encoder=console"]' "$root"
        ;;
      keda-metrics-apiserver)
        keda_base_rootfs "$root"
        install -m 0755 "$KEDA_ADAPTER" "$root/keda-adapter"
        local adapter_entrypoint='["/keda-adapter", "--secure-port=6443", "--zap-log-level=info", "--zap-encoder=console"]'
        # Before 2.18 the adapter logged with klog and knew no --zap-* flag, and KEDA's
        # Deployment gave it only `args` (led by a path the image lacks, which the adapter takes
        # as a positional argument), so this entrypoint runs with them: that version's own.
        if ((KEDA_MINOR < 18)); then
          adapter_entrypoint='["/keda-adapter", "--secure-port=6443", "--logtostderr=true", "--v=0"]'
        fi
        scratch_image "$KEDA_ADAPTER_IMAGE" "$archive" 65532:65532 "$adapter_entrypoint" "$root"
        ;;
      keda-admission-webhooks)
        keda_base_rootfs "$root"
        install -m 0755 "$KEDA_WEBHOOKS" "$root/keda-admission-webhooks"
        scratch_image "$KEDA_WEBHOOKS_IMAGE" "$archive" 65532:65532 \
          '["/keda-admission-webhooks", "--zap-log-level=info", "--zap-encoder=console"]' "$root"
        ;;
    esac
    rm -rf "$root"
    log "image $name: $archive ($(du -k "$archive" | cut -f1) KiB)"
  done
}

# archive_ref <OCI archive>: the image reference its index.json names (build/oci-archive.sh).
source "$ROOT_DIR/build/oci-archive.sh"

# ref_repository <reference>: the reference without its tag or digest.
ref_repository() {
  local ref="${1%@*}" last
  last="${ref##*/}"
  [[ "$last" == *:* ]] && ref="${ref%:*}"
  printf '%s\n' "$ref"
}

# shellcheck shell=bash
# The Debian packages that the local cluster, its real node and the image builds use, in one
# list (`tests/run-tests` and `.ci/run` install them before any build starts, so that no two
# builds run apt-get at once). Sourced, never executed.

# require_packages: installs the missing ones with apt-get (checked by file, so an installed
# package costs nothing); returns 2 with what to install when not root or without apt-get.
require_packages() {
  local missing=()
  need() { [[ -e "$1" ]] || missing+=("$2"); }
  # By the package itself where a file could come from another one (busybox vs busybox-static),
  # as the cluster's image build checks it.
  need_package() { dpkg-query -W "$1" >/dev/null 2>&1 || missing+=("$1"); }
  need /usr/bin/openssl openssl
  need /etc/ssl/certs/ca-certificates.crt ca-certificates
  need /usr/share/zoneinfo/UTC tzdata
  need /usr/lib/cni/bridge containernetworking-plugins
  need /usr/sbin/iptables iptables
  need /usr/sbin/conntrack conntrack
  # kube-router's network policy controller drives ipsets with the ipset command.
  need /usr/sbin/ipset ipset
  need /usr/bin/buildah buildah
  # The local cluster's registry, its htpasswd file, and pushing images to it.
  need /usr/bin/docker-registry docker-registry
  need /usr/bin/htpasswd apache2-utils
  need /usr/bin/skopeo skopeo
  need_package busybox-static
  need /usr/bin/musl-gcc musl-tools
  need /usr/bin/gcc gcc
  need /usr/lib/x86_64-linux-gnu/libc.a libc6-dev
  # runc's seccomp support (the RuntimeDefault profile), linked statically (lib/build.sh).
  need /usr/lib/x86_64-linux-gnu/libseccomp.a libseccomp-dev
  need /usr/bin/flock util-linux
  ((${#missing[@]} > 0)) || return 0
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "error: install ${missing[*]} (Debian: apt-get install -y ${missing[*]})" >&2
    return 2
  fi
  echo "installing ${missing[*]} with apt-get" >&2
  export DEBIAN_FRONTEND=noninteractive
  { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null; } >&2 ||
    { echo "error: apt-get install ${missing[*]} failed" >&2; return 2; }
}

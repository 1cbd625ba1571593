# shellcheck shell=bash
# The local cluster's OCI registry (sourced after common.sh): Debian's distribution registry
# (docker-registry) at https://$REGISTRY, on the host end of the real node's link, with a serving
# certificate of the cluster CA and basic auth (htpasswd, bcrypt). `up` configures and starts it
# before the node's containerd; `down` stops it and removes its storage with the state dir.
#
# What lives in $REGISTRY_DIR:
#   config.yml   the registry's configuration          data/      its storage (filesystem driver)
#   htpasswd     the one user, $REGISTRY_USER           password   that user's password (random)
#   auth.json    a Docker config with the credentials, for skopeo (--authfile), helm
#                (--registry-config) and the pull Secrets (kubernetes.io/dockerconfigjson)
#   certs.d/$REGISTRY/ca.crt   the cluster CA, as skopeo's --cert-dir wants it
#   cosign.key, cosign.pub, cosign.password   the cluster's signing key pair (cosign) and the
#                private key's password: what push-images pushes is signed with it
#
# The node's containerd (node/containerd.toml, config_path) trusts the CA for $REGISTRY and
# resolves hearth.dev/* there too (certs.d/hearth.dev/hosts.toml), as the nodes of an air-gapped
# cluster resolve upstream names at their mirror: the upstream stub runtime's image
# hearth.dev/vllm-stub:e2e is pulled from $REGISTRY/vllm-stub:e2e. The node also holds the
# registry's credentials (containerd's registry.configs.<host>.auth) for pods that name no pull
# Secret; a pod whose pull Secret matches the image's registry pulls with that Secret's
# credentials alone (the kubelet passes them; a wrong one fails).

# The password, made once per state dir.
registry_password() { cat "$REGISTRY_DIR/password"; }

# registry_configure: the password, htpasswd, credentials, CA copy, configuration and the node's
# containerd registry hosts. Needs the PKI (make_pki) and runs before node_configure, which puts
# the credentials into the node's containerd configuration.
registry_configure() {
  [[ -x "$REGISTRY_BIN" ]] ||
    die "the registry ($REGISTRY_BIN) is missing: apt-get install -y docker-registry (tests/lib/packages.sh lists it)"
  command -v htpasswd >/dev/null 2>&1 ||
    die "htpasswd is missing: apt-get install -y apache2-utils (tests/lib/packages.sh lists it)"
  mkdir -p "$REGISTRY_DIR/data" "$REGISTRY_DIR/certs.d/$REGISTRY"
  chmod 700 "$REGISTRY_DIR"
  openssl rand -hex 24 >"$REGISTRY_DIR/password"
  # The password on stdin, never on a command line (ps shows those).
  htpasswd -niB "$REGISTRY_USER" <"$REGISTRY_DIR/password" | sed '/^$/d' >"$REGISTRY_DIR/htpasswd"
  printf '{"auths":{"%s":{"auth":"%s"}}}\n' "$REGISTRY" \
    "$(printf '%s:%s' "$REGISTRY_USER" "$(registry_password)" | base64 -w0)" >"$REGISTRY_DIR/auth.json"
  cp "$STATE/pki/ca.crt" "$REGISTRY_DIR/certs.d/$REGISTRY/ca.crt"
  # The cluster's signing key pair (cosign; a random password, through the environment):
  # push-images signs what it pushes with cosign.key, the e2e registry suite verifies with
  # cosign.pub, as a platform team verifies a release with the project's public key.
  [[ -x "$COSIGN" ]] || die "cosign $COSIGN_VERSION is not built in $BIN (tests/cluster/build builds it)"
  rm -f "$REGISTRY_DIR/cosign.key" "$REGISTRY_DIR/cosign.pub"
  openssl rand -hex 24 >"$REGISTRY_DIR/cosign.password"
  local out
  out="$(COSIGN_PASSWORD="$(cat "$REGISTRY_DIR/cosign.password")" \
    "$COSIGN" generate-key-pair --output-key-prefix "$REGISTRY_DIR/cosign" 2>&1)" ||
    die "cosign generate-key-pair failed: $out"
  cat >"$REGISTRY_DIR/config.yml" <<CONFIG
version: 0.1
log:
  level: info
  formatter: text
  accesslog:
    disabled: false
storage:
  filesystem:
    rootdirectory: $REGISTRY_DIR/data
  delete:
    enabled: true
http:
  addr: $REGISTRY
  secret: $(openssl rand -hex 16)
  tls:
    certificate: $STATE/pki/registry.crt
    key: $STATE/pki/registry.key
auth:
  htpasswd:
    realm: hearth-registry
    path: $REGISTRY_DIR/htpasswd
CONFIG
  # The node's containerd: hosts.toml per registry host (containerd's config_path).
  local hosts="$NODE_DIR/containerd/certs.d" host
  for host in "$REGISTRY" hearth.dev; do
    mkdir -p "$hosts/$host"
    # A [host] table (containerd 1.6 refused a hosts.toml without one), and `server`, which
    # containerd tries last with the top-level settings: both trust the CA, so a missing image is
    # reported as the registry's 404, not as a certificate error of the fallback.
    cat >"$hosts/$host/hosts.toml" <<HOSTS
# $host: served by the local cluster's registry (tests/cluster/lib/registry.sh).
server = "https://$REGISTRY"
ca = "$STATE/pki/ca.crt"

[host."https://$REGISTRY"]
  capabilities = ["pull", "resolve"]
  ca = "$STATE/pki/ca.crt"
HOSTS
  done
}

# registry_ready: the registry answers an authenticated /v2/ over TLS (else prints what it said).
# The credentials go to curl on stdin (-K -), not on its command line.
registry_ready() {
  printf 'user = "%s:%s"\n' "$REGISTRY_USER" "$(registry_password)" |
    curl -sS --fail --max-time 2 --cacert "$STATE/pki/ca.crt" -K - "https://$REGISTRY/v2/" -o /dev/null
}

# shellcheck shell=bash
# Certificates and kubeconfigs of the local cluster, made with openssl (sourced after common.sh).
# Keys are ECDSA P-256 (fast to make); everything is valid for 10 years and lives in the state
# dir, so `down` throws it away with the cluster.

require_openssl() {
  command -v openssl >/dev/null 2>&1 ||
    die "openssl is needed to make the cluster's certificates: apt-get install -y openssl"
}

new_key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# new_ca <dir> <name> <common name>
new_ca() {
  new_key "$1/$2.key"
  openssl req -x509 -new -key "$1/$2.key" -subj "/CN=$3" -days 3650 -out "$1/$2.crt" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    2>/dev/null
}

# issue <dir> <ca name> <name> <subject> <extendedKeyUsage> [subjectAltName]
issue() {
  local dir="$1" ca="$2" name="$3" subj="$4" eku="$5" san="${6:-}" ext
  new_key "$dir/$name.key"
  ext="$dir/$name.ext"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -z "$san" ]] || echo "subjectAltName=$san"
  } >"$ext"
  openssl req -new -key "$dir/$name.key" -subj "$subj" 2>/dev/null |
    openssl x509 -req -CA "$dir/$ca.crt" -CAkey "$dir/$ca.key" -CAcreateserial -days 3650 \
      -extfile "$ext" -out "$dir/$name.crt" 2>/dev/null
  rm -f "$ext"
}

# write_kubeconfig <file> <cert dir> <client name> <user>
write_kubeconfig() {
  local file="$1" dir="$2" client="$3" user="$4"
  cat >"$file" <<KUBECONFIG
apiVersion: v1
kind: Config
clusters:
- name: hearth
  cluster:
    server: https://$APISERVER_IP:$APISERVER_PORT
    certificate-authority-data: $(base64 -w0 <"$dir/ca.crt")
users:
- name: $user
  user:
    client-certificate-data: $(base64 -w0 <"$dir/$client.crt")
    client-key-data: $(base64 -w0 <"$dir/$client.key")
contexts:
- name: hearth
  context:
    cluster: hearth
    user: $user
current-context: hearth
KUBECONFIG
  chmod 600 "$file"
}

make_pki() {
  require_openssl
  local d="$STATE/pki"
  mkdir -p "$d"
  chmod 700 "$d"
  # Cluster CA: signs serving certs and client certs of every component.
  new_ca "$d" ca hearth-cluster-ca
  # Front-proxy CA: the aggregator's client identity towards extension apiservers (KEDA's
  # metrics adapter, which reads this CA from kube-system/extension-apiserver-authentication).
  new_ca "$d" front-proxy-ca hearth-front-proxy-ca
  issue "$d" front-proxy-ca front-proxy-client "/CN=front-proxy-client" clientAuth
  issue "$d" ca etcd-server "/CN=etcd" serverAuth "IP:$CP_IP"
  issue "$d" ca apiserver-etcd-client "/CN=kube-apiserver-etcd-client" clientAuth
  issue "$d" ca apiserver "/CN=kube-apiserver" serverAuth \
    "IP:$APISERVER_IP,IP:$SERVICE_FIRST_IP,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
  issue "$d" ca admin "/O=system:masters/CN=hearth-admin" clientAuth
  # The real node: the kubelet's client identity (the Node authorizer and NodeRestriction confine
  # it to its own node), its serving certificate (the apiserver verifies it for logs and exec),
  # the apiserver's client identity towards kubelets, and kube-proxy's (bound to
  # system:node-proxier by the apiserver's default RBAC).
  issue "$d" ca kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" clientAuth
  issue "$d" ca kubelet-serving "/CN=$NODE_NAME" serverAuth "IP:$NODE_IP,DNS:$NODE_NAME"
  issue "$d" ca apiserver-kubelet-client "/CN=kube-apiserver-kubelet-client" clientAuth
  issue "$d" ca kube-proxy "/CN=system:kube-proxy" clientAuth
  issue "$d" ca controller-manager "/CN=system:kube-controller-manager" clientAuth
  # kube-router's network policy controller (node/cluster.yaml binds its ClusterRole).
  issue "$d" ca kube-router "/CN=system:kube-router" clientAuth
  issue "$d" ca scheduler "/CN=system:kube-scheduler" clientAuth
  # kwok plays the kubelet of many nodes at once; the Node authorizer would confine one
  # identity to one node, so it gets admin rights.
  issue "$d" ca kwok "/O=system:masters/CN=hearth-kwok" clientAuth
  # The registry's serving certificate (lib/registry.sh): the node's containerd, skopeo and helm
  # trust the cluster CA for it.
  issue "$d" ca registry "/CN=hearth-registry" serverAuth "IP:$NODE_HOST_IP"
  # (KEDA makes its own certificates: its operator keeps them in the Secret keda/kedaorg-certs.)
  # Service-account token signing key pair.
  new_key "$d/sa.key"
  openssl pkey -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
  rm -f "$d"/*.srl

  write_kubeconfig "$KUBECONFIG_PATH" "$d" admin hearth-admin
  mkdir -p "$STATE/kubeconfigs"
  write_kubeconfig "$STATE/kubeconfigs/controller-manager" "$d" controller-manager system:kube-controller-manager
  write_kubeconfig "$STATE/kubeconfigs/scheduler" "$d" scheduler system:kube-scheduler
  write_kubeconfig "$STATE/kubeconfigs/kwok" "$d" kwok hearth-kwok
  write_kubeconfig "$STATE/kubeconfigs/kubelet" "$d" kubelet "system:node:$NODE_NAME"
  write_kubeconfig "$STATE/kubeconfigs/kube-proxy" "$d" kube-proxy system:kube-proxy
  write_kubeconfig "$STATE/kubeconfigs/kube-router" "$d" kube-router system:kube-router
}

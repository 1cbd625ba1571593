//! Child object names: each a fixed function of the `LLMService` name, so a rename never leaves
//! orphans behind and users can find children without labels.

/// Longest `LLMService` name whose children are all valid: Service names are RFC 1035 labels
/// (at most 63 characters) and the longest Service suffix is `-backend` (8).
pub const MAX_SERVICE_NAME_LEN: usize = 63 - "-backend".len();

/// The backend Deployment: the `LLMService` name itself, as upstream Hearth names it (so
/// `kubectl logs deploy/<name>` reaches the model).
pub fn backend(service: &str) -> String {
    service.to_owned()
}

/// The backend Service: `<name>-backend` (the gateway's `--backend-service`).
pub fn backend_service(service: &str) -> String {
    format!("{service}-backend")
}

/// The backend Deployment's name in earlier versions of this controller (`<name>-backend`):
/// the reconciler deletes it, when this `LLMService` controls it, before creating [`backend`].
pub fn legacy_backend(service: &str) -> String {
    format!("{service}-backend")
}

/// The gateway Deployment, ServiceAccount, Role and RoleBinding: `<name>-gateway`.
pub fn gateway(service: &str) -> String {
    format!("{service}-gateway")
}

/// ConfigMap `N-adapters`: the adapters the gateway of service `N` routes and loads
/// (`hearth_crds::llmadapter::AdapterTable`).
pub fn adapters(service: &str) -> String {
    format!("{service}-adapters")
}

/// The ConfigMap of the service's accelerator-seconds ledger ([`crate::metering::Ledger`]).
pub fn usage(service: &str) -> String {
    format!("{service}-usage")
}

/// The client-facing gateway Service: the `LLMService` name itself, so clients call
/// `http://<name>.<namespace>.svc/v1`.
pub fn gateway_service(service: &str) -> String {
    service.to_owned()
}

/// The ClusterIP Service for the gateway's KEDA ExternalScaler port (push mode): `<name>-scaler`.
pub fn scaler_service(service: &str) -> String {
    format!("{service}-scaler")
}

/// `N-gateway-admin`: the gateway's admin Service (headless, port `admin`: KEDA's endpoint
/// aggregation and the peer replicas find the admin ports through it) and its admin Secret
/// (the tokens, [`hearth_crds::admin`]).
pub fn gateway_admin(service: &str) -> String {
    format!("{}-admin", gateway(service))
}

/// Secret `N-scaler-tls`: the ExternalScaler's CA, its signing key and the gateway's serving
/// certificate (mutual TLS with KEDA, see `crate::scaler_tls`).
pub fn scaler_tls(service: &str) -> String {
    format!("{service}-scaler-tls")
}

/// `kubernetes.io/tls` Secret `N-scaler-client-tls`: KEDA's client certificate for the
/// ExternalScaler of service `N`, read through its TriggerAuthentication `N-scaler`.
pub fn scaler_client_tls(service: &str) -> String {
    format!("{service}-scaler-client-tls")
}

/// The DNS name in KEDA's client certificate for the ExternalScaler of service `service` in
/// `namespace`: `keda.<service>-scaler.<namespace>` (not a Service's name; the gateway checks
/// it, `hearth-gateway --scaler-client-name`).
pub fn scaler_client(service: &str, namespace: &str) -> String {
    format!("keda.{}.{namespace}", scaler_service(service))
}

/// The DNS name in KEDA's one client certificate for the ExternalScaler of every
/// `LLMEndpoint`'s shared gateway (`crate::scaler_tls::SharedClient`; not a Service's name).
/// Those gateways take no other, and a service's own gateway does not take it.
pub const SHARED_SCALER_CLIENT: &str = "keda.llmendpoints.serving.hearth.dev";

/// The NodeLocalPVC model cache claim: `<name>-cache`, as upstream Hearth names it (an
/// upstream installation's cache is adopted with its contents).
pub fn cache_claim(service: &str) -> String {
    format!("{service}-cache")
}

/// The prewarm Job: `<name>-prewarm`.
pub fn prewarm_job(service: &str) -> String {
    format!("{service}-prewarm")
}

/// The Job fetching the hub adapter source `source` (a key naming the hub, repository and
/// credentials: `crate::render::fetch_job_name`) into service `service`'s model cache:
/// `<service>-adapter-<16 hex>`, the hash of both (the service name shortened where the whole
/// would pass 63 characters, a label value's limit, which a Job's name must fit).
pub fn adapter_fetch_job(service: &str, source: &str) -> String {
    let hash = stable_hash(format!("{service}\n{source}").as_bytes());
    let suffix = format!("-adapter-{hash:016x}");
    let keep = service.len().min(63 - suffix.len());
    let prefix = service[..keep].trim_end_matches(['-', '.']);
    format!("{prefix}{suffix}")
}

/// The KEDA ScaledObject: the `LLMService` name (KEDA names its HPA `keda-hpa-<name>`).
pub fn scaled_object(service: &str) -> String {
    service.to_owned()
}

/// The image pre-pull DaemonSet of the InferenceRuntime `runtime` (in the controller's
/// namespace): `hearth-pre-pull-<runtime>`, or `hearth-pre-pull-<hash>` when that would be
/// longer than a label value (63), which a DaemonSet's name must fit.
pub fn pre_pull(runtime: &str) -> String {
    let full = format!("hearth-pre-pull-{runtime}");
    if full.len() <= 63 {
        return full;
    }
    format!("hearth-pre-pull-{:016x}", stable_hash(runtime.as_bytes()))
}

/// 64-bit FNV-1a of `bytes`: stable across builds and platforms (unlike `std`'s hasher), for
/// names and the template hashes of create-once children.
pub fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The objects rendered for a plain Deployment `deployment` that joins an `LLMEndpoint` (its
/// `serving.hearth.dev/endpoint` annotation): the Service the endpoint's gateway finds its pods
/// through, the Role and RoleBinding letting that gateway read its EndpointSlices, and the
/// ScaledObject: `<name>-hearth`. A Deployment name of at most 56 characters
/// (`hearth_crds::rules::MAX_MEMBER_NAME_LEN`) keeps the Service name within 63.
pub fn member(deployment: &str) -> String {
    format!("{deployment}-hearth")
}

//! Child object names: each a fixed function of the `LLMService` name, so a rename never leaves
//! orphans behind and users can find children without labels.

/// Longest `LLMService` name whose children are all valid: Service names are RFC 1035 labels
/// (at most 63 characters) and the longest Service suffix is `-backend` (8).
pub const MAX_SERVICE_NAME_LEN: usize = 63 - "-backend".len();

/// The backend Deployment and its Service: `<name>-backend`.
pub fn backend(service: &str) -> String {
    format!("{service}-backend")
}

/// The gateway Deployment, ServiceAccount, Role and RoleBinding: `<name>-gateway`.
pub fn gateway(service: &str) -> String {
    format!("{service}-gateway")
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

/// The NodeLocalPVC model cache claim: `<name>-model-cache`.
pub fn cache_claim(service: &str) -> String {
    format!("{service}-model-cache")
}

/// The prewarm Job: `<name>-prewarm`.
pub fn prewarm_job(service: &str) -> String {
    format!("{service}-prewarm")
}

/// The KEDA ScaledObject: the `LLMService` name (KEDA names its HPA `keda-hpa-<name>`).
pub fn scaled_object(service: &str) -> String {
    service.to_owned()
}

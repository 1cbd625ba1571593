//! `LLMEndpoint`: one OpenAI-compatible base URL for many `LLMService`s, routed by the request's
//! `model` field. A Hearth extension of the public API (upstream Hearth gives every service its
//! own gateway).
//!
//! Attachment follows Gateway API's rules for routes and Gateways: a service joins by reference
//! (`spec.endpoint.sharedEndpointRef` on the `LLMService`, like a route's `parentRefs`), and the
//! endpoint says which namespaces may join (`spec.allowedServices.namespaces`, like a listener's
//! `allowedRoutes.namespaces`: `Same` by default, `All`, or `Selector`). A service that is not
//! accepted (endpoint missing, namespace not allowed, model name taken by an older service)
//! keeps its own gateway and says why in its `EndpointAccepted` condition, as a route that is
//! not accepted reports it in `status.parents[].conditions`.
//!
//! A plain `Deployment` joins the same way, by reference, with annotations instead of a spec
//! (`serving.hearth.dev/endpoint`, `serving.hearth.dev/model`, ...: see
//! [`crate::wellknown::ENDPOINT_ANNOTATION`] and `rules::check_deployment`); it claims its
//! model name under the same rules, and `status.models[]` and `status.conflicts[]` say
//! `kind: Deployment` for it ([`MemberKind`]).
//!
//! The controller hands the shared gateway its routes as data: the [`RouteTable`], JSON in the
//! ConfigMap [`routes_config_map`] (key [`ROUTES_KEY`]) in the endpoint's namespace, which the
//! gateway watches.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    duration::Duration,
    llmservice::{ApiKeySecretRef, ColdStartMode},
};

/// spec is the desired state of an LLMEndpoint: who may join it, and its gateway.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[kube(
    group = "serving.hearth.dev",
    version = "v1alpha1",
    kind = "LLMEndpoint",
    plural = "llmendpoints",
    singular = "llmendpoint",
    shortname = "llmep",
    category = "hearth",
    namespaced,
    status = "LLMEndpointStatus",
    printcolumn = r#"{"name":"URL","type":"string","jsonPath":".status.endpointURL"}"#,
    printcolumn = r#"{"name":"Models","type":"integer","jsonPath":".status.attachedServices"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    doc = "LLMEndpoint is one OpenAI-compatible base URL for many LLMServices, routed by the request's model field."
)]
#[serde(rename_all = "camelCase")]
pub struct LLMEndpointSpec {
    /// allowedServices says which namespaces' LLMServices (and Deployments, joined with the
    /// `serving.hearth.dev/endpoint` annotation) may join (default: the endpoint's own namespace
    /// only), as Gateway API's `allowedRoutes`.
    #[serde(default)]
    pub allowed_services: AllowedServices,

    /// replicas is the number of gateway replicas (default 1), spread over nodes and kept
    /// available by a PodDisruptionBudget; the replicas agree on every model's demand.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 20))]
    pub replicas: Option<i32>,

    /// apiKeySecretRef names a Secret key (in the endpoint's namespace) holding the API keys
    /// clients must send as `Authorization: Bearer <key>`, one per line; editing the Secret
    /// rotates them without a restart. Unset: no authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<ApiKeySecretRef>,

    /// tenants are the endpoint's callers, for every model on it (see the LLMService's
    /// `spec.endpoint.tenants`): their keys, priority bands and quotas.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 100),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub tenants: Vec<crate::llmservice::TenantSpec>,
}

/// Which LLMServices may join an endpoint (Gateway API's `AllowedRoutes`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AllowedServices {
    /// namespaces from which services may join.
    #[serde(default)]
    pub namespaces: ServiceNamespaces,
}

/// Namespaces admitted: whose services may join an endpoint (`allowedServices`), whose
/// adapters may attach to a service (`allowedAdapters`); Gateway API's `RouteNamespaces`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.from == 'Selector' ? has(self.selector) : !has(self.selector)",
    "message": "set namespaces.selector exactly when namespaces.from is Selector"
}]))]
pub struct ServiceNamespaces {
    /// from: `Same` (the object's own namespace, the default), `All`, or `Selector`
    /// (namespaces whose labels match `selector`).
    #[serde(default)]
    pub from: FromNamespaces,

    /// selector of namespaces, with `from: Selector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
}

/// Gateway API's `FromNamespaces`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum FromNamespaces {
    /// Only the endpoint's own namespace.
    #[default]
    Same,
    /// Every namespace.
    All,
    /// Namespaces whose labels match `selector`.
    Selector,
}

/// A reference from an LLMService to the LLMEndpoint it joins (Gateway API's
/// `ParentReference`, name and namespace only).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointReference {
    /// name of the LLMEndpoint.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,

    /// namespace of the LLMEndpoint (default: the service's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub namespace: Option<String>,
}

/// status is the observed state of an LLMEndpoint.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LLMEndpointStatus {
    /// endpointURL is the OpenAI-compatible base URL clients call for every model.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "endpointURL"
    )]
    pub endpoint_url: Option<String>,

    /// observedGeneration is the metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// attachedServices counts the models routed (one per accepted service or Deployment).
    #[serde(default)]
    pub attached_services: i32,

    /// models served on this endpoint, sorted by name.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<EndpointModel>,

    /// conflicts lists services (and Deployments) that reference this endpoint and were not
    /// accepted, with the reason (`ModelNameConflict`, `NotAllowedByEndpoint`, `InvalidMember`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conflicts: Vec<EndpointConflict>,

    /// conditions: `Accepted` (the spec is valid) and `Ready` (a gateway replica is available).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// kind of the object serving the model: `LLMService` (joined with
/// `spec.endpoint.sharedEndpointRef`; the default, when absent) or `Deployment` (joined with
/// the `serving.hearth.dev/endpoint` annotation).
#[derive(
    Serialize,
    Deserialize,
    Clone,
    Copy,
    Debug,
    Default,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    JsonSchema,
)]
pub enum MemberKind {
    /// An `LLMService` (the default when `kind` is absent).
    #[default]
    LLMService,
    /// An `apps/v1` `Deployment`.
    Deployment,
}

impl MemberKind {
    /// The kind's name, as the API spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LLMService => "LLMService",
            Self::Deployment => "Deployment",
        }
    }

    /// The kind of a `status.models[]` or `status.conflicts[]` entry: `LLMService` when absent.
    pub fn of(kind: Option<MemberKind>) -> Self {
        kind.unwrap_or_default()
    }
}

impl std::fmt::Display for MemberKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A model served on an endpoint (`status.models[]`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointModel {
    /// name is the OpenAI model name clients send in `model`.
    pub name: String,
    /// namespace of the LLMService (or Deployment).
    pub namespace: String,
    /// service is the LLMService's name (or the Deployment's, with `kind: Deployment`).
    pub service: String,
    /// kind of the object serving the model: `LLMService` (the default, when absent) or
    /// `Deployment`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<MemberKind>,
}

/// A service (or Deployment) that references an endpoint and was not accepted
/// (`status.conflicts[]`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointConflict {
    /// namespace of the LLMService (or Deployment).
    pub namespace: String,
    /// service is the LLMService's name (or the Deployment's, with `kind: Deployment`).
    pub service: String,
    /// model it asked for (empty when a Deployment's model annotation is missing).
    pub model: String,
    /// reason, CamelCase: `ModelNameConflict`, `NotAllowedByEndpoint` or (a Deployment whose
    /// annotations, name or selector cannot join) `InvalidMember`.
    pub reason: String,
    /// message for humans, naming the service that holds the model where there is one, or the
    /// field to fix.
    pub message: String,
    /// kind of the object: `LLMService` (the default, when absent) or `Deployment`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<MemberKind>,
}

/// The LLMService condition type that reports its attachment to an endpoint.
pub const CONDITION_ENDPOINT_ACCEPTED: &str = "EndpointAccepted";

/// Why a service is, or is not, attached (reasons of [`CONDITION_ENDPOINT_ACCEPTED`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AttachReason {
    /// Attached: the shared gateway routes its model.
    Accepted,
    /// The referenced LLMEndpoint does not exist.
    EndpointNotFound,
    /// The endpoint's `allowedServices` does not admit the service's namespace.
    NotAllowedByEndpoint,
    /// An older service on the endpoint serves the same model name.
    ModelNameConflict,
    /// A Deployment's annotations (or its name, owner or selector) do not let it join: the
    /// message names the field and the fix (`hearth_crds::rules::check_deployment`).
    InvalidMember,
}

impl AttachReason {
    /// The CamelCase reason of the condition.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Accepted => "Accepted",
            Self::EndpointNotFound => "EndpointNotFound",
            Self::NotAllowedByEndpoint => "NotAllowedByEndpoint",
            Self::ModelNameConflict => "ModelNameConflict",
            Self::InvalidMember => "InvalidMember",
        }
    }
}

/// Key of the [`RouteTable`] JSON in the routes ConfigMap.
pub const ROUTES_KEY: &str = "routes.json";

/// Name of the ConfigMap holding endpoint `endpoint`'s [`RouteTable`]: `<endpoint>-routes`.
pub fn routes_config_map(endpoint: &str) -> String {
    format!("{endpoint}-routes")
}

/// A shared gateway's routing table, written by the controller (ConfigMap
/// [`routes_config_map`], key [`ROUTES_KEY`]) and read by every replica of the endpoint's
/// gateway. Entries are sorted by `model` and model names are unique (conflicts are resolved
/// before the table is written).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct RouteTable {
    /// One entry per accepted service.
    #[serde(default)]
    pub models: Vec<ModelRoute>,
}

/// One model of a shared endpoint: where its engines are and how its cold starts behave (the
/// settings a per-service gateway takes as flags).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ModelRoute {
    /// The OpenAI model name (the service's served model name).
    pub model: String,
    /// More names clients may send in `model` for it (the LLMService's `spec.model.aliases`):
    /// routed like `model`, and forwarded with `model` set to `model`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// The LLMService's (or Deployment's) namespace (where its backend Service is).
    pub namespace: String,
    /// The LLMService's (or Deployment's) name. `<namespace>/<service>` identifies the model to
    /// KEDA (the ExternalScaler's `service` metadata, `/hearth/queue/<namespace>/<service>`).
    pub service: String,
    /// The LLMService's UID (Events and `status.lastWake` of the sleeping tier); none for a
    /// Deployment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// The backend Service whose EndpointSlices list the engines.
    pub backend_service: String,
    /// The backend port's name in those EndpointSlices.
    pub backend_port_name: String,
    /// Requests admitted at once (held + in flight) for this model; beyond it, 429.
    pub max_queue: u64,
    /// What a request that finds no ready engine gets.
    #[serde(default)]
    pub cold_start: ColdStartMode,
    /// Interval of SSE comment lines while a streaming request is held.
    pub heartbeat_interval: Duration,
    /// How long a request may wait for a ready engine.
    pub activation_timeout: Duration,
    /// Target demand per backend replica (KEDA's `targetSize`).
    pub metric_target: f64,
    /// The last activation's total duration (`status.lastActivation.phases.total`), shown in
    /// `/v1/models` as the expected wait until the gateway measured one itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_activation: Option<Duration>,
    /// The sleeping tier, when the service has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<SleepRoute>,
    /// Requests in flight per ready engine (`spec.endpoint.containerConcurrency`); the rest
    /// wait in the gateway's fair queue. Absent: the gateway's default (256, vLLM's
    /// `--max-num-seqs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container_concurrency: Option<u32>,
    /// The LoRA adapters the model's engines serve, routed by their own names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<crate::llmadapter::AdapterTable>,
}

impl ModelRoute {
    /// `<namespace>/<service>`: the model's key for KEDA and metrics.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.service)
    }
}

/// A model's sleeping tier (the per-service gateway's `--sleep-*` and `--wake-up-call` flags).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SleepRoute {
    /// Idle time before an engine is put to sleep.
    pub after: Duration,
    /// vLLM's sleep level.
    pub level: i32,
    /// The engine's sleep path.
    pub sleep_path: String,
    /// The engine's is-sleeping path.
    pub is_sleeping_path: String,
    /// The wake-up calls, in order: path and optional JSON body.
    #[serde(default)]
    pub wake_up: Vec<WakeUpCall>,
}

/// One wake-up call of a [`SleepRoute`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct WakeUpCall {
    /// Path (and query) on the engine.
    pub path: String,
    /// JSON body, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
}

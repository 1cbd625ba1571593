//! `LLMService`: what model to serve, on which runtime, and how to scale it.
//!
//! Field for field compatible with the public Hearth `serving.hearth.dev/v1alpha1` API
//! (`api/v1alpha1/llmservice_types.go`): same JSON names, enums, defaults and minimums. Hearth
//! adds `status.observedGeneration` and CEL rules (`x-kubernetes-validations`) so that the
//! apiserver rejects contradictory scaling settings before any webhook runs, and a few
//! extensions, each marked "A Hearth extension of the public API" (`scaling.warmWindows`,
//! `endpoint.replicas`, `endpoint.apiKeySecretRef`, `status.lastActivation`).

use k8s_openapi::{
    api::core::v1::LocalObjectReference,
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{Condition, Time},
    },
};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::Duration;

/// spec is the desired state of an LLMService: a model, a runtime, resources, scaling, cache
/// and client endpoint.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "serving.hearth.dev",
    version = "v1alpha1",
    kind = "LLMService",
    plural = "llmservices",
    singular = "llmservice",
    shortname = "llmsvc",
    category = "hearth",
    namespaced,
    status = "LLMServiceStatus",
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Runtime","type":"string","jsonPath":".status.resolvedRuntime"}"#,
    printcolumn = r#"{"name":"Replicas","type":"integer","jsonPath":".status.replicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Last Activation","type":"string","priority":1,"jsonPath":".status.lastActivation.phases.total","description":"How long the last 0->1 took"}"#,
    doc = "LLMService declaratively serves one model behind a scale-to-zero gateway."
)]
#[serde(rename_all = "camelCase")]
pub struct LLMServiceSpec {
    /// model identifies the weights served by the backend.
    pub model: ModelSpec,

    /// runtime selects the backend: pinned by name or picked by vendor preference.
    #[serde(default)]
    pub runtime: RuntimeSelection,

    /// resources requests accelerators and compute for each backend replica.
    #[serde(default)]
    pub resources: ResourceSpec,

    /// scaling configures KEDA and cold-start timing.
    #[serde(default)]
    pub scaling: ScalingSpec,

    /// cache configures model-weight storage and prewarming.
    #[serde(default)]
    pub cache: CacheSpec,

    /// endpoint configures client-facing cold-start behaviour.
    #[serde(default)]
    pub endpoint: EndpointSpec,

    /// imagePullSecrets are applied to the backend, gateway and prewarm pods; they must exist in
    /// the LLMService's namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<LocalObjectReference>,

    /// owner is the tenant the service's accelerator time is charged to when no request used
    /// it: idle, sleeping, warm windows, and cold starts nobody waited for (`status.usage`).
    /// A DNS label; default the namespace's name. A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub owner: Option<String>,

    /// allowedAdapters says from which namespaces LLMAdapters may attach to this service
    /// (default: its own namespace only), as Gateway API's `allowedRoutes`. A Hearth extension
    /// of the public API.
    #[serde(default, skip_serializing_if = "AllowedAdapters::is_default")]
    pub allowed_adapters: AllowedAdapters,
}

/// Which LLMAdapters may attach to a service (Gateway API's `AllowedRoutes`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AllowedAdapters {
    /// namespaces from which adapters may attach.
    #[serde(default)]
    pub namespaces: crate::llmendpoint::ServiceNamespaces,
}

impl AllowedAdapters {
    fn is_default(&self) -> bool {
        *self == Self::default()
    }
}

/// Where the model comes from: an inline source, or (not implemented yet) a catalog entry.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.source) || has(self.catalogRef)",
    "message": "set model.source.uri (for example hf://Qwen/Qwen2.5-0.5B-Instruct)"
}]))]
pub struct ModelSpec {
    /// catalogRef points to an external model catalog entry. Catalog resolution is not
    /// implemented; use model.source.uri.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub catalog_ref: Option<String>,

    /// source is the inline model location.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ModelSource>,

    /// aliases are more names clients may send in a request's `model` for this model, besides
    /// the LLMService's name: for example the hub id they already use
    /// (`Qwen/Qwen2.5-0.5B-Instruct`). The gateway answers to them while the model is cold too,
    /// lists them in `GET /v1/models`, and forwards such a request with `model` set to the
    /// service's name, the one the engine serves (answers name the model that way). On a shared
    /// LLMEndpoint they are claimed like the service's name. Each is 1 to 256 characters
    /// without whitespace or commas. Hearth extension.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 16),
        inner(length(min = 1, max = 256), regex(pattern = r"^[^\s,]+$")),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub aliases: Vec<String>,
}

/// An inline model location and optional credentials.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelSource {
    /// uri is the model location: `hf://<org>/<name>` (alias `huggingface://`),
    /// `modelscope://<org>/<name>`,
    /// `pvc://<claim>[/<subpath>]` (pre-staged weights on an existing PVC, mounted read-only), or
    /// `oci://<registry>/<repository>:<tag>` (weights packaged as an OCI image, mounted
    /// read-only as a Kubernetes image volume; Hearth extension).
    #[schemars(length(min = 1, max = 2048))]
    pub uri: String,

    /// secretRef holds credentials for private sources (for example a ModelScope token).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<LocalObjectReference>,
}

/// Pins a runtime by name, or selects one by vendor preference.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSelection {
    /// name pins one cluster-scoped InferenceRuntime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub name: Option<String>,

    /// selector picks among runtimes by vendor preference order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<RuntimeSelector>,

    /// argsOverride is appended after the runtime's serving args; a repeated flag overrides an
    /// earlier one where the runtime's CLI allows it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 4096)))]
    pub args_override: Vec<String>,
}

/// Ordered runtime preferences.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSelector {
    /// vendor lists acceptable vendors in preference order (first is preferred).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(max = 63)))]
    pub vendor: Vec<String>,
}

/// The abstract accelerator request, mapped onto the runtime's accelerator at reconcile time.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ResourceSpec {
    /// accelerators is the number of whole devices requested per backend replica.
    #[serde(default = "default_accelerators")]
    #[schemars(range(min = 1))]
    pub accelerators: i32,

    /// fraction requests a slice of a device; valid only with a runtime whose
    /// accelerator.sharing.supported is true (for example NVIDIA through HAMi).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fraction: Option<AcceleratorFraction>,

    /// cpu is the CPU request for each backend replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<Quantity>,

    /// memory is the memory request and limit for each backend replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,
}

impl Default for ResourceSpec {
    fn default() -> Self {
        Self {
            accelerators: default_accelerators(),
            fraction: None,
            cpu: None,
            memory: None,
        }
    }
}

fn default_accelerators() -> i32 {
    1
}

/// A slice of one device (device memory, compute share), as HAMi-style schedulers offer.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.memory) || (has(self.cores) && self.cores > 0)",
    "message": "fraction must request device memory (fraction.memory) or a compute share (fraction.cores, 1-100); remove fraction to request whole devices"
}]))]
pub struct AcceleratorFraction {
    /// memory requests a device-memory slice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<Quantity>,

    /// cores requests a device-compute share, in percent of one device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 100))]
    pub cores: Option<i32>,
}

/// KEDA-driven autoscaling. Scaling is limited to LLM-aware signals: CPU and raw request rate
/// are not offered.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "(has(self.min) ? self.min : 0) <= (has(self.max) ? self.max : 1)",
        "message": "scaling.min must not exceed scaling.max: lower min or raise max",
        "fieldPath": ".min",
        "reason": "FieldValueInvalid"
    },
    {
        "rule": "!has(self.warmWindows) || self.warmWindows.all(w, w.replicas <= (has(self.max) ? self.max : 1))",
        "message": "scaling.warmWindows[].replicas must not exceed scaling.max: lower the window's replicas or raise max",
        "fieldPath": ".warmWindows",
        "reason": "FieldValueInvalid"
    }
]))]
pub struct ScalingSpec {
    /// min is the minimum number of backend replicas; 0 enables scale-to-zero.
    #[serde(default)]
    #[schemars(range(min = 0))]
    pub min: i32,

    /// max is the maximum number of backend replicas.
    #[serde(default = "default_max")]
    #[schemars(range(min = 1))]
    pub max: i32,

    /// metric selects the scaling signal. Only queueDepth is wired to the autoscaler;
    /// kvCacheUtil is reserved.
    #[serde(default)]
    pub metric: ScalingMetric,

    /// target is the desired metric value per replica (KEDA's threshold).
    #[serde(default = "default_target")]
    #[schemars(range(min = 1))]
    pub target: i32,

    /// activationTimeout is how long the gateway holds a request while the model starts.
    #[serde(default = "default_activation_timeout")]
    pub activation_timeout: Duration,

    /// scaleDownStabilization delays HPA scale-down and the final transition to zero. Whole
    /// seconds, at most one hour (the HPA's limit for `stabilizationWindowSeconds`).
    #[serde(default = "default_scale_down_stabilization")]
    #[schemars(extend("x-kubernetes-validations" = [
        {
            "rule": "duration(self).getMilliseconds() % 1000 == 0",
            "message": "scaleDownStabilization must be whole seconds (for example 90s or 5m): the HPA stabilization window counts seconds"
        },
        {
            "rule": "duration(self) <= duration('1h')",
            "message": "scaleDownStabilization must be at most 1h, the HPA's maximum stabilization window"
        }
    ]))]
    pub scale_down_stabilization: Duration,

    /// drainTimeout bounds the preStop wait for in-flight requests; Hearth widens the pod's
    /// termination grace period when the drain needs more room.
    #[serde(default = "default_drain_timeout")]
    pub drain_timeout: Duration,

    /// warmWindows keep at least `replicas` backend replicas during recurring time windows
    /// (business hours, say) and let the service scale to zero outside them; demand still
    /// scales it above a window's minimum. Each window is one KEDA `cron` trigger. At most 10
    /// (`rules::MAX_WARM_WINDOWS`). A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 10))]
    pub warm_windows: Vec<WarmWindow>,

    /// sleep puts the backend engines to sleep once the service has been idle for `after`,
    /// before (or, with `min` above 0, instead of) scaling to zero: the pods keep running with
    /// their accelerator memory freed, and the gateway wakes them on demand in seconds. Needs a
    /// runtime with `spec.sleepMode` supporting `level`; with any other runtime it has no
    /// effect (a warning). A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep: Option<SleepSpec>,

    /// priority orders services that compete for accelerators (device handover): when a cold
    /// service's backend pod cannot be scheduled for lack of its accelerator, Hearth may take
    /// an idle service of the same or lower priority to zero to free one, lowest priority
    /// first. Higher wins; -1000 to 1000. Hearth's own value, not a PriorityClass: the
    /// scheduler would preempt a busy backend for a PriorityClass, cutting requests in flight.
    /// A Hearth extension of the public API.
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,

    /// minResidency is how long a backend replica serves after it turned Ready before a device
    /// handover may take this service to zero for another one, so two models on one device do
    /// not thrash. A Hearth extension of the public API.
    #[serde(default = "default_min_residency")]
    pub min_residency: Duration,
}

/// The sleeping tier of a service (see `ScalingSpec::sleep`). Checked by `hearth_crds::rules`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SleepSpec {
    /// after is how long the service must have had no request (at any gateway replica) before
    /// its engines are put to sleep. Shorter than `scaleDownStabilization` when `min` is 0, or
    /// the service is at zero first.
    pub after: Duration,

    /// level is the engine's sleep level: 1 (vLLM: weights offloaded to CPU memory, wakes in
    /// about a second) or 2 (weights dropped and reloaded on wake-up).
    #[serde(default = "default_sleep_level")]
    #[schemars(range(min = 1, max = 2))]
    pub level: i32,
}

fn default_sleep_level() -> i32 {
    1
}

/// A recurring window with a minimum number of backend replicas: KEDA's `cron` scaler
/// (<https://keda.sh/docs/latest/scalers/cron/>) asks for `replicas` from each time `start`
/// matches until the next time `end` matches, read in `timezone`, and for nothing outside.
/// Checked by `hearth_crds::rules` (webhook and controller). A Hearth extension of the public
/// API.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.start != self.end",
    "message": "a warm window's start and end must differ: the window opens when start matches and closes when end matches",
    "fieldPath": ".end",
    "reason": "FieldValueInvalid"
}]))]
pub struct WarmWindow {
    /// timezone is the IANA time zone `start` and `end` are read in, such as `Europe/Berlin`,
    /// `America/New_York` or `UTC` (daylight saving time included).
    #[schemars(length(min = 1, max = 64))]
    pub timezone: String,

    /// start is a five-field cron expression (minute hour day-of-month month day-of-week, such
    /// as `0 8 * * MON-FRI`) for when the window opens.
    #[schemars(length(min = 1, max = 128))]
    pub start: String,

    /// end is a five-field cron expression for when the window closes (such as
    /// `0 18 * * MON-FRI`).
    #[schemars(length(min = 1, max = 128))]
    pub end: String,

    /// replicas is the minimum number of backend replicas while the window is open: at least
    /// 1, at most `scaling.max`.
    #[schemars(range(min = 1))]
    pub replicas: i32,
}

impl Default for ScalingSpec {
    fn default() -> Self {
        Self {
            min: 0,
            max: default_max(),
            metric: ScalingMetric::default(),
            target: default_target(),
            activation_timeout: default_activation_timeout(),
            scale_down_stabilization: default_scale_down_stabilization(),
            drain_timeout: default_drain_timeout(),
            warm_windows: Vec::new(),
            sleep: None,
            priority: 0,
            min_residency: default_min_residency(),
        }
    }
}

fn default_max() -> i32 {
    1
}
fn default_target() -> i32 {
    10
}
fn default_activation_timeout() -> Duration {
    Duration::new("5m")
}
fn default_scale_down_stabilization() -> Duration {
    Duration::new("5m")
}
fn default_drain_timeout() -> Duration {
    Duration::new("2m")
}
fn default_min_residency() -> Duration {
    Duration::new("2m")
}

/// The scaling signal.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum ScalingMetric {
    /// Requests waiting at the gateway (and the engine): the demand KEDA scales on.
    #[default]
    #[serde(rename = "queueDepth")]
    QueueDepth,
    /// KV-cache utilisation; reserved, not wired to the autoscaler yet.
    #[serde(rename = "kvCacheUtil")]
    KvCacheUtil,
}

/// How model weights are cached so cold pods load from local disk instead of re-downloading.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CacheSpec {
    /// strategy selects the model cache backend.
    #[serde(default)]
    pub strategy: CacheStrategy,

    /// size is the requested NodeLocalPVC or SharedPVC capacity; [`DEFAULT_CACHE_SIZE`] when
    /// unset (as upstream Hearth).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<Quantity>,

    /// storageClassName pins the cache PVC to a StorageClass; empty uses the cluster default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub storage_class_name: Option<String>,

    /// prewarm requests a one-time Job that downloads the weights into the cache.
    #[serde(default)]
    pub prewarm: bool,
}

/// The NodeLocalPVC capacity of a service that sets no `cache.size` (upstream Hearth's default).
pub const DEFAULT_CACHE_SIZE: &str = "50Gi";

impl CacheSpec {
    /// `size`, or [`DEFAULT_CACHE_SIZE`].
    pub fn size_or_default(&self) -> Quantity {
        self.size
            .clone()
            .unwrap_or_else(|| Quantity(DEFAULT_CACHE_SIZE.to_owned()))
    }
}

/// The model cache backend.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum CacheStrategy {
    /// A PersistentVolumeClaim per service, on node-local storage.
    #[default]
    NodeLocalPVC,
    /// A directory on the node.
    HostPath,
    /// A ReadWriteMany claim per service, filled once by the prewarm Job and mounted read-only
    /// by every replica on any node (`hf://` models, `prewarm: true`); reserved upstream.
    SharedPVC,
    /// Weights baked into the runtime image; reserved.
    BakedImage,
    /// No cache: each pod downloads the model.
    None,
}

/// Client-facing protocol and cold-start behaviour.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EndpointSpec {
    /// openAICompatible is informational: the gateway always serves the OpenAI-compatible API.
    #[serde(default = "default_true", rename = "openAICompatible")]
    pub openai_compatible: bool,

    /// coldStart configures requests received while the backend is unavailable.
    #[serde(default)]
    pub cold_start: ColdStartSpec,

    /// replicas is the number of gateway replicas (default 1), spread over nodes and kept
    /// available by a PodDisruptionBudget; the replicas agree on the total demand KEDA sees.
    /// A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 20))]
    pub replicas: Option<i32>,

    /// apiKeySecretRef names a Secret key (in the service's namespace) holding the API keys
    /// clients must send as `Authorization: Bearer <key>`, one per line. Editing the Secret
    /// rotates them without a restart. Unset: no authentication. A Hearth extension of the
    /// public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<ApiKeySecretRef>,

    /// sharedEndpointRef joins an LLMEndpoint: clients reach the model at the endpoint's URL
    /// under the service's name, and the service renders no gateway of its own. Where the
    /// endpoint does not accept it (missing, namespace not allowed, model name taken) the
    /// service keeps its own gateway and its `EndpointAccepted` condition says why. While
    /// attached, `replicas` and `apiKeySecretRef` here do not apply (the endpoint's do). A
    /// Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_endpoint_ref: Option<crate::llmendpoint::EndpointReference>,

    /// tenants are the callers of the service's own gateway: each known by the API keys in
    /// its Secret, dispatched in its priority band (fair share by tokens inside a band) and
    /// held to its quotas across the gateway's replicas. Requests with the keys of
    /// `apiKeySecretRef`, and every request while no key is configured, are the tenant
    /// `default`, which a tenant of that name configures. While attached to an LLMEndpoint,
    /// the endpoint's tenants apply. A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 100),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"])
    )]
    pub tenants: Vec<TenantSpec>,

    /// containerConcurrency is the number of requests the gateway sends each ready backend
    /// replica at once; the rest wait in the gateway, dispatched by band and fair share.
    /// Default: the engine's `--max-num-seqs` when the runtime's or the service's arguments
    /// set it, else 256 (vLLM's default), so the engine batches what it is sent and queues
    /// nothing first come, first served. A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub container_concurrency: Option<i32>,
}

/// A tenant of a gateway: who sends requests, their priority band and their quotas.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.name == 'default' || has(self.apiKeySecretRef)",
    "message": "apiKeySecretRef is required for every tenant but default"
}]))]
pub struct TenantSpec {
    /// name is a DNS label, unique among the tenants, and the `tenant` label of the metrics.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,

    /// apiKeySecretRef names the Secret key (in the gateway's namespace) holding this tenant's
    /// API keys, one per line; editing the Secret rotates them without a restart. Required,
    /// except for the tenant `default`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_secret_ref: Option<ApiKeySecretRef>,

    /// priority is the tenant's band: requests of a higher band are dispatched before any of a
    /// lower one (default 0, from -1000 to 1000).
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,

    /// requestsPerMinute is the tenant's request quota over all the gateway's replicas;
    /// unset: unlimited. Past it: 429 `rate_limit_exceeded` with `Retry-After`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub requests_per_minute: Option<i64>,

    /// tokensPerMinute is the tenant's token quota (prompt and completion, as the responses'
    /// `usage` counts them) over all the gateway's replicas; unset: unlimited.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub tokens_per_minute: Option<i64>,
}

impl Default for EndpointSpec {
    fn default() -> Self {
        Self {
            openai_compatible: true,
            cold_start: ColdStartSpec::default(),
            replicas: None,
            api_key_secret_ref: None,
            shared_endpoint_ref: None,
            tenants: Vec::new(),
            container_concurrency: None,
        }
    }
}

/// A key of a Secret in the LLMService's namespace.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ApiKeySecretRef {
    /// name of the Secret.
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub name: String,

    /// key of the Secret holding the keys (default `api-keys`).
    #[serde(default = "default_api_key_key")]
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[-._a-zA-Z0-9]+$"))]
    pub key: String,
}

/// The default key of [`ApiKeySecretRef`].
pub fn default_api_key_key() -> String {
    "api-keys".to_owned()
}

fn default_true() -> bool {
    true
}

/// How the gateway handles a cold backend.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ColdStartSpec {
    /// mode: keepalive (SSE heartbeats hold the connection) or reject (fast 503 with
    /// Retry-After for the client to retry).
    #[serde(default)]
    pub mode: ColdStartMode,

    /// heartbeatInterval is the gap between SSE keepalive comments while activation waits.
    #[serde(default = "default_heartbeat_interval")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('100ms')",
        "message": "heartbeatInterval must be at least 100ms"
    }]))]
    pub heartbeat_interval: Duration,
}

impl Default for ColdStartSpec {
    fn default() -> Self {
        Self {
            mode: ColdStartMode::default(),
            heartbeat_interval: default_heartbeat_interval(),
        }
    }
}

fn default_heartbeat_interval() -> Duration {
    Duration::new("10s")
}

/// Cold-start handling mode.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum ColdStartMode {
    /// Hold the request; streaming clients get SSE comment heartbeats.
    #[default]
    Keepalive,
    /// Answer 503 with Retry-After at once, and still wake the model.
    Reject,
}

/// A summary of backend availability (`status.phase`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, JsonSchema)]
pub enum LLMServicePhase {
    /// Children are being created, or the runtime is not resolved yet.
    Pending,
    /// A backend pod exists and is loading the model.
    Loading,
    /// At least one backend replica is ready.
    Ready,
    /// No backend replica runs; the next request wakes one.
    ScaledToZero,
    /// A backend pod waits for its accelerator: the scheduler finds no node with a free one,
    /// and a device handover frees one (or none is possible, see the `Ready` condition). A
    /// Hearth extension of the public API.
    WaitingForDevices,
    /// Something prevents serving; see the conditions.
    Degraded,
}

/// status is the observed state of an LLMService.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LLMServiceStatus {
    /// phase summarizes backend availability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<LLMServicePhase>,

    /// resolvedRuntime is the InferenceRuntime actually selected.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resolved_runtime: Option<String>,

    /// replicas is the number of ready backend replicas.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<i32>,

    /// endpointURL is the OpenAI-compatible base URL clients should call.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "endpointURL"
    )]
    pub endpoint_url: Option<String>,

    /// observedGeneration is the metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// conditions describe the service's observed state (Ready, RuntimeResolved,
    /// AutoscalingReady, CacheReady, Prewarmed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,

    /// lastActivation is the timeline of the last activation: a backend pod that turned Ready
    /// while no other backend replica was ready (a 0->1). Written once per pod. A Hearth
    /// extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_activation: Option<Activation>,

    /// lastActivationFailure is the last way a backend failed to come up (the phase of the
    /// activation timeline it stopped in, the reason and the kubelet's or scheduler's words),
    /// kept after the failure is fixed. Written when a new failure is diagnosed (a new pod or
    /// reason). A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_activation_failure: Option<ActivationFailure>,

    /// lastWake is the last sleep->awake of one of the service's engines (the sleeping tier,
    /// `spec.scaling.sleep`). Written by the gateway replica that woke it, under the field
    /// manager `hearth-gateway`; the controller neither writes nor compares it. A Hearth
    /// extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_wake: Option<Wake>,

    /// usage is the accelerator time of the backend pods since metering began, by phase and by
    /// tenant; the parts add up to the pods' device-seconds. Written by the controller's meter
    /// under the field manager `hearth-metering` about every 30 seconds; the per-minute and
    /// per-hour history is in the ConfigMap `<name>-usage` (`kubectl hearth usage`). A Hearth
    /// extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// The accelerator time of a service's backend pods (`status.usage`): extended-resource
/// units (`nvidia.com/gpu: 2` counts 2) times the seconds from each pod's scheduling until it
/// was gone, in whole seconds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Usage {
    /// since is when metering of this service began.
    pub since: Time,

    /// updated is the time charged up to.
    pub updated: Time,

    /// acceleratorSeconds is the device-seconds since `since`, every tenant and phase.
    pub accelerator_seconds: i64,

    /// phases splits acceleratorSeconds: `coldStart` (scheduled, not yet Ready), `serving` (a
    /// request in flight), `idle`, `sleeping` (the sleeping tier) and `warmWindow` (idle in a
    /// warm window).
    pub phases: UsagePhases,

    /// tenants lists each tenant charged, by name; the owner (`spec.owner`) carries what no
    /// request used.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<TenantUsage>,
}

/// Device-seconds by phase, whole seconds.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsagePhases {
    /// coldStart: scheduled, not yet Ready.
    pub cold_start: i64,
    /// serving: Ready and a request in flight.
    pub serving: i64,
    /// idle: Ready, awake, no request, no warm window.
    pub idle: i64,
    /// sleeping: the engine asleep.
    pub sleeping: i64,
    /// warmWindow: Ready, awake, no request, a warm window open.
    pub warm_window: i64,
}

/// One tenant's device-seconds.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TenantUsage {
    /// name is the tenant's.
    pub name: String,
    /// acceleratorSeconds is its share of every phase.
    pub accelerator_seconds: i64,
    /// phases splits it.
    pub phases: UsagePhases,
}

/// `Ready=False` reasons that say a backend cannot come up without a change to the service,
/// its runtime, the node or the registry. The controller sets one when it diagnoses a backend
/// pod (or the Deployment) so; a gateway answers the requests it holds for that service at once
/// with the condition's message (`activation_failed`), instead of after `activationTimeout`.
///
/// | reason | from |
/// |---|---|
/// | `Unschedulable` | `PodScheduled=False` `Unschedulable`, other than a lack of the accelerator (that is `WaitingForDevices`) |
/// | `FailedCreate` | the Deployment's `ReplicaFailure=True` (an admission refusal: Pod Security, a quota, a webhook) |
/// | `ImagePullFailed` | a container waiting in `ErrImagePull`, `ImagePullBackOff`, `InvalidImageName` or `ErrImageNeverPull` |
/// | `OOMKilled` | a container restarting after its last run ended `OOMKilled` |
/// | `CrashLoopBackOff` | a container restarting after it exited by itself |
/// | `RepeatedTermination` | a container restarting after it was killed (exit 137 or 143: a failing probe, a signal) |
/// | `ProgressDeadlineExceeded` | the Deployment's `Progressing=False` |
/// | `BackendFailing` | any other container that cannot start (`CreateContainerError`, `CreateContainerConfigError`, `RunContainerError`) |
///
/// "Restarting" is the kubelet's `CrashLoopBackOff` wait, or a second restart without
/// readiness: one restart alone is not a failure (an engine OOM-killed once while serving
/// comes back).
pub const ACTIVATION_FAILED_REASONS: &[&str] = &[
    "Unschedulable",
    "FailedCreate",
    "ImagePullFailed",
    "OOMKilled",
    "CrashLoopBackOff",
    "RepeatedTermination",
    "ProgressDeadlineExceeded",
    "BackendFailing",
];

/// The last way a backend failed to come up (`status.lastActivationFailure`).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActivationFailure {
    /// time is when the controller diagnosed it.
    pub time: Time,

    /// pod is the backend pod it was read from; absent when from the Deployment
    /// (`FailedCreate`, `ProgressDeadlineExceeded`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub pod: Option<String>,

    /// phase is the step of the activation timeline (`status.lastActivation.phases`) it
    /// stopped in: `scaleDecision` (no pod could be created), `scheduled`, `imagePull`,
    /// `containersStarted` or `modelReady`.
    #[schemars(length(max = 32))]
    pub phase: String,

    /// reason is one of the `Ready=False` reasons of an activation failure
    /// (`Unschedulable`, `FailedCreate`, `ImagePullFailed`, `OOMKilled`, `CrashLoopBackOff`,
    /// `RepeatedTermination`, `ProgressDeadlineExceeded`, `BackendFailing`).
    #[schemars(length(max = 64))]
    pub reason: String,

    /// message is what the kubelet, the scheduler or the Deployment said, and what to change.
    #[schemars(length(max = 1024))]
    pub message: String,
}

/// The timeline of one activation (`status.lastActivation`), measured from the backend pod,
/// its kubelet Events and the KEDA ScaledObject. Durations are Go duration strings rounded to
/// milliseconds (`"250ms"`, `"34.2s"`, `"1m2.5s"`); most sources have whole-second precision.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Activation {
    /// startTime is when the activation started: when KEDA's scaler turned active, else the
    /// pod's creation.
    pub start_time: Time,

    /// readyTime is when the pod turned Ready.
    pub ready_time: Time,

    /// pod is the backend pod's name.
    #[schemars(length(max = 253))]
    pub pod: String,

    /// podUID identifies the pod: an activation is recorded once per pod.
    #[serde(rename = "podUID")]
    #[schemars(length(max = 64))]
    pub pod_uid: String,

    /// node is the node the pod ran on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub node: Option<String>,

    /// imagePresent is true when the kubelet found the model container's image on the node,
    /// false when it pulled it; absent when its Events were not found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_present: Option<bool>,

    /// phases splits the activation into its steps.
    pub phases: ActivationPhases,
}

/// The steps of an activation, as Go duration strings (see [`Activation`]). Apart from
/// `scaleDecision` they add up to the time from the pod's creation to its readiness, unless a
/// step measured negative (clock skew between nodes and control plane) and was set to zero.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActivationPhases {
    /// scaleDecision: the ScaledObject's `Active` condition turning true until the pod was
    /// created; absent when unknown (no KEDA, or the scaler did not turn active for this pod).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub scale_decision: Option<String>,

    /// waitingForDevices: the scheduler's first verdict that no node had the pod's
    /// accelerator free until the pod was scheduled (a device handover, or a device freed by
    /// other means); absent when the pod was never refused for its accelerator. A Hearth
    /// extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub waiting_for_devices: Option<String>,

    /// scheduled: pod created until `PodScheduled`, less `waitingForDevices`.
    #[schemars(length(max = 32))]
    pub scheduled: String,

    /// imagePull: the kubelet pulling the model container's image (0s when present); absent
    /// when its Events were not found.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub image_pull: Option<String>,

    /// containersStarted: scheduled and pulled until the model container started (sandbox,
    /// volumes, init containers, sidecars).
    #[schemars(length(max = 32))]
    pub containers_started: String,

    /// modelReady: the model container started until the pod turned Ready (loading the model).
    #[schemars(length(max = 32))]
    pub model_ready: String,

    /// total: startTime until readyTime.
    #[schemars(length(max = 32))]
    pub total: String,
}

/// One sleep->awake (`status.lastWake`), measured by the gateway replica that woke the engine.
/// Durations are Go duration strings rounded to milliseconds; times have whole seconds.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Wake {
    /// startTime is when demand reached the gateway replica while the engine slept (its first
    /// held request).
    pub start_time: Time,

    /// readyTime is when the engine served again: its wake-up calls all answered 2xx.
    pub ready_time: Time,

    /// endpoint is the engine's address, `host:port` as in the backend's EndpointSlices.
    #[schemars(length(max = 261))]
    pub endpoint: String,

    /// level is the sleep level the engine woke from (vLLM's 1 or 2).
    #[schemars(range(min = 1, max = 2))]
    pub level: i32,

    /// gateway is the gateway pod that woke the engine; absent when it does not know its name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub gateway: Option<String>,

    /// phases splits the wake into its steps; they add up to `total`.
    pub phases: WakePhases,
}

/// The steps of a sleep->awake (see [`Wake`]), as Go duration strings.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WakePhases {
    /// wakeDecision: demand raised until the wake-up calls started (the gateway noticing the
    /// demand, and asking the engine `is_sleeping` in case another replica woke it).
    #[schemars(length(max = 32))]
    pub wake_decision: String,

    /// wakeUp: the wake-up calls (`POST /wake_up`, and at level 2 the weights' reload), until
    /// the last one answered.
    #[schemars(length(max = 32))]
    pub wake_up: String,

    /// total: startTime until readyTime.
    #[schemars(length(max = 32))]
    pub total: String,
}

//! `InferenceRuntime`: a backend driver as data — image, args templates, accelerator resource,
//! scheduling, probes, drain and metrics for one vendor's serving engine.
//!
//! Field for field compatible with the public Hearth `serving.hearth.dev/v1alpha1` API
//! (`api/v1alpha1/inferenceruntime_types.go`). One deliberate widening: `vendor` is any DNS
//! label rather than a fixed list, so a new accelerator vendor is a new object, never a new
//! Hearth release (every upstream value — nvidia, ascend, cambricon, hygon — stays valid).

use std::collections::BTreeMap;

use k8s_openapi::{
    api::core::v1::{EnvVar, Probe, SecurityContext, Toleration},
    apimachinery::pkg::apis::meta::v1::Condition,
};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// spec is the desired state of an InferenceRuntime.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "serving.hearth.dev",
    version = "v1alpha1",
    kind = "InferenceRuntime",
    plural = "inferenceruntimes",
    singular = "inferenceruntime",
    shortname = "infrt",
    category = "hearth",
    status = "InferenceRuntimeStatus",
    printcolumn = r#"{"name":"Family","type":"string","jsonPath":".spec.family"}"#,
    printcolumn = r#"{"name":"Vendor","type":"string","jsonPath":".spec.vendor"}"#,
    printcolumn = r#"{"name":"Image","type":"string","jsonPath":".spec.container.image","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    doc = "InferenceRuntime is a cluster-scoped, reusable backend driver for one vendor runtime."
)]
#[serde(rename_all = "camelCase")]
pub struct InferenceRuntimeSpec {
    /// family identifies the serving engine; vllm (and its vendor forks) is supported.
    #[serde(default)]
    pub family: RuntimeFamily,

    /// vendor names the accelerator vendor this runtime targets (nvidia, ascend, cambricon,
    /// hygon, ...). LLMServices select runtimes by it.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub vendor: String,

    /// priority breaks ties when several runtimes match an LLMService selector (higher wins).
    #[serde(default)]
    pub priority: i32,

    /// container is the serving container; it must expose the OpenAI-compatible API on its port.
    pub container: RuntimeContainer,

    /// accelerator maps the abstract request onto a device-plugin resource and scheduling.
    pub accelerator: AcceleratorSpec,

    /// health configures model-load-aware probes.
    #[serde(default)]
    pub health: RuntimeHealth,

    /// lifecycle configures graceful termination of serving pods.
    #[serde(default)]
    pub lifecycle: RuntimeLifecycle,

    /// metrics describes the runtime's Prometheus telemetry; Hearth's autoscaling uses the
    /// gateway's queue, so these fields are informational for external integrations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics: Option<RuntimeMetrics>,

    /// sleepMode says that the engine can sleep: free its accelerator memory while the pod
    /// keeps running, and wake in seconds (vLLM's sleep mode). LLMServices using this runtime
    /// may then set `spec.scaling.sleep`; without it they scale to zero without sleeping. A
    /// Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sleep_mode: Option<RuntimeSleepMode>,

    /// prePull keeps `container.image` pulled on every node this runtime can schedule to (its
    /// `accelerator.nodeSelector` and `tolerations`), so a model's first start on a node does
    /// not wait for a multi-gigabyte pull: the controller runs a DaemonSet whose init container
    /// is the image (`python3 -c ''`, as the prewarm Job runs it) in its own namespace, and
    /// reports progress in the `ImagePrePulled` condition. A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pre_pull: bool,

    /// adapters says that the engine serves LoRA adapters (`LLMAdapter`s) on top of the base
    /// model, loaded and unloaded at run time, and within which limits. Without it an
    /// LLMAdapter naming a service on this runtime is refused. A Hearth extension of the public
    /// API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adapters: Option<RuntimeAdapters>,
}

/// How an engine serves LoRA adapters (vLLM:
/// <https://docs.vllm.ai/en/latest/features/lora.html>): the flags and environment that turn
/// it on, the limits Hearth keeps to, and the calls that load and unload one, each `POST` with
/// a JSON body: `{"lora_name": <servedName>, "lora_path": <directory>}` to load,
/// `{"lora_name": <servedName>}` to unload (vLLM's `/v1/load_lora_adapter` and
/// `/v1/unload_lora_adapter`, served with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`). Hearth
/// loads through these calls rather than vLLM's filesystem resolver because the resolver
/// never unloads: Hearth keeps at most `maxLoaded` per engine and unloads the least recently
/// used. A Hearth extension of the public API.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeAdapters {
    /// args are added to the engine's arguments when its service has adapters (vLLM:
    /// `--enable-lora`, `--max-loras=<adapters in one batch>`,
    /// `--max-cpu-loras=<maxLoaded or more>`, `--max-lora-rank=<maxRank>`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 4096)))]
    pub args: Vec<String>,

    /// env is added to the engine's environment when its service has adapters (vLLM serves
    /// the load and unload calls only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub env: Vec<EnvVar>,

    /// maxRank is the highest LoRA rank the engine accepts (vLLM's `--max-lora-rank`, default
    /// 16); an adapter declaring a higher `spec.rank` is refused.
    #[serde(default = "default_max_rank")]
    #[schemars(range(min = 1, max = 512))]
    pub max_rank: i32,

    /// maxLoaded is how many adapters Hearth keeps loaded in one engine at once (default 8;
    /// not more than vLLM's `--max-cpu-loras`, or the engine evicts and reloads them itself);
    /// loading one more first unloads the least recently used.
    #[serde(default = "default_max_loaded")]
    #[schemars(range(min = 1, max = 1024))]
    pub max_loaded: i32,

    /// maxAdapters is how many LLMAdapters one service may have (default 100, at most 1000:
    /// the adapter table of a service is one ConfigMap, and a shared endpoint's route table
    /// holds every member's).
    #[serde(default = "default_max_adapters")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_adapters: i32,

    /// loadPath is the path of the load call.
    #[serde(default = "default_load_path")]
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^/[^?#\s]*$"))]
    pub load_path: String,

    /// unloadPath is the path of the unload call.
    #[serde(default = "default_unload_path")]
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^/[^?#\s]*$"))]
    pub unload_path: String,
}

/// vLLM's default `--max-lora-rank`.
pub const DEFAULT_MAX_RANK: i32 = 16;
/// The default `spec.adapters.maxLoaded`.
pub const DEFAULT_MAX_LOADED: i32 = 8;
/// The default `spec.adapters.maxAdapters`.
pub const DEFAULT_MAX_ADAPTERS: i32 = 100;

fn default_max_rank() -> i32 {
    DEFAULT_MAX_RANK
}
fn default_max_loaded() -> i32 {
    DEFAULT_MAX_LOADED
}
fn default_max_adapters() -> i32 {
    DEFAULT_MAX_ADAPTERS
}
fn default_load_path() -> String {
    "/v1/load_lora_adapter".to_owned()
}
fn default_unload_path() -> String {
    "/v1/unload_lora_adapter".to_owned()
}

/// How an engine sleeps and wakes, over HTTP on its serving port (vLLM:
/// <https://docs.vllm.ai/en/latest/features/sleep_mode.html>). The gateway calls it: `POST
/// <sleepPath>?level=<n>` to sleep, each `wakeUp` call of the level in order to wake, `GET
/// <isSleepingPath>` (answering `{"is_sleeping": bool}`) to learn the state. A Hearth
/// extension of the public API.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSleepMode {
    /// levels are the sleep levels the engine supports (vLLM: 1 offloads the weights to CPU
    /// memory, 2 drops them), each with its wake-up.
    #[schemars(length(min = 1, max = 2))]
    pub levels: Vec<RuntimeSleepLevel>,

    /// args are added to the engine's arguments when a service sleeps (vLLM:
    /// `--enable-sleep-mode`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub args: Vec<String>,

    /// env is added to the engine's environment when a service sleeps (vLLM serves the sleep
    /// endpoints only with `VLLM_SERVER_DEV_MODE=1`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,

    /// sleepPath is the path of the sleep call, `POST <sleepPath>?level=<n>`.
    #[serde(default = "default_sleep_path")]
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^/[^?#\s]*$"))]
    pub sleep_path: String,

    /// isSleepingPath is the path of the state call, `GET <isSleepingPath>`, answering
    /// `{"is_sleeping": true|false}`.
    #[serde(default = "default_is_sleeping_path")]
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^/[^?#\s]*$"))]
    pub is_sleeping_path: String,
}

/// One sleep level and how the engine wakes from it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeSleepLevel {
    /// level is the engine's sleep level, 1 or 2.
    #[schemars(range(min = 1, max = 2))]
    pub level: i32,

    /// wakeUp are the calls that wake the engine from this level, in order, each `POST`;
    /// empty means one `POST /wake_up`. vLLM's level 2 reloads the weights: `/wake_up?tags=weights`,
    /// `/collective_rpc` with body `{"method":"reload_weights"}`, `/wake_up?tags=kv_cache`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub wake_up: Vec<RuntimeEngineCall>,
}

/// One HTTP call to the engine.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeEngineCall {
    /// path is the call's path and optional query, such as `/wake_up?tags=weights`.
    #[schemars(length(min = 1, max = 256), regex(pattern = r"^/[^#\s]*$"))]
    pub path: String,

    /// body is a JSON document sent with `Content-Type: application/json`; absent, the call
    /// has no body.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096))]
    pub body: Option<String>,
}

fn default_sleep_path() -> String {
    "/sleep".to_owned()
}

fn default_is_sleeping_path() -> String {
    "/is_sleeping".to_owned()
}

/// The serving engine family.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum RuntimeFamily {
    /// vLLM and its vendor forks (vllm-ascend, vllm-mlu, ...).
    #[default]
    Vllm,
}

/// The serving container rendered into backend pods.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeContainer {
    /// image is the serving runtime image.
    #[schemars(length(min = 1, max = 1024))]
    pub image: String,

    /// args are templates rendered with `{{ .Model.Path }}`, `{{ .Service.Name }}` and
    /// `{{ .Service.Namespace }}`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128), inner(length(max = 4096)))]
    pub args: Vec<String>,

    /// env is copied to the serving container; literal values may use the same templates.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 128))]
    pub env: Vec<EnvVar>,

    /// port serves the OpenAI-compatible API and, for vLLM, `/metrics`.
    #[serde(default)]
    pub port: RuntimePort,

    /// securityContext replaces the serving container's default one (no privilege escalation,
    /// every capability dropped, the RuntimeDefault seccomp profile; root and a writable root
    /// filesystem allowed, as upstream vLLM images need). Set it to harden an image that runs
    /// as non-root with a read-only root filesystem, or to relax the default for an engine
    /// that needs a capability. A Hearth extension of the public API.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_context: Option<SecurityContext>,
}

/// The serving container's named TCP port.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimePort {
    /// name is referenced by Services and probes.
    #[serde(default = "default_port_name")]
    #[schemars(length(min = 1, max = 15))]
    pub name: String,

    /// containerPort is the serving API port.
    #[serde(default = "default_container_port")]
    #[schemars(range(min = 1, max = 65535))]
    pub container_port: i32,
}

impl Default for RuntimePort {
    fn default() -> Self {
        Self {
            name: default_port_name(),
            container_port: default_container_port(),
        }
    }
}

fn default_port_name() -> String {
    "http".to_owned()
}
fn default_container_port() -> i32 {
    8000
}

/// Maps an abstract accelerator request to a device-plugin resource and a scheduler.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorSpec {
    /// resourceName is the device-plugin extended resource (nvidia.com/gpu,
    /// huawei.com/Ascend910, cambricon.com/mlu, ...).
    #[schemars(length(min = 1, max = 253))]
    pub resource_name: String,

    /// sharing declares whether this runtime supports fractional devices.
    #[serde(default)]
    pub sharing: AcceleratorSharing,

    /// nodeSelector constrains backend and prewarm pods to compatible nodes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub node_selector: BTreeMap<String, String>,

    /// tolerations let backend and prewarm pods use tainted accelerator nodes.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,

    /// scheduler routes pods to an installed scheduler (for example Volcano).
    #[serde(default)]
    pub scheduler: RuntimeScheduler,
}

/// Fractional-device support.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AcceleratorSharing {
    /// supported declares that the device plugin can honour fractional requests (HAMi-style).
    #[serde(default)]
    pub supported: bool,
}

/// An installed scheduler and queue for backend and prewarm pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeScheduler {
    /// name is the scheduler name; empty uses the default scheduler.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub name: Option<String>,

    /// queue is rendered as the `scheduling.volcano.sh/queue-name` pod annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 253))]
    pub queue: Option<String>,
}

/// Model-load-aware probes: startup gives slow weight loads minutes of headroom before liveness
/// may restart the pod.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeHealth {
    /// readiness controls when the backend receives traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub readiness: Option<Probe>,

    /// liveness detects a failed serving process after startup.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub liveness: Option<Probe>,

    /// startup protects slow model loading from liveness restarts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub startup: Option<Probe>,
}

/// Graceful termination of serving pods.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeLifecycle {
    /// terminationGracePeriodSeconds is the base shutdown budget, in seconds; Hearth widens it
    /// when the service's drainTimeout needs more room.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub termination_grace_period_seconds: Option<i64>,

    /// preStopDrain stops routing new requests and waits for in-flight streams to finish before
    /// the pod is torn down.
    #[serde(default)]
    pub pre_stop_drain: bool,
}

/// Runtime Prometheus metric names, for observability integrations.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RuntimeMetrics {
    /// path is the runtime's Prometheus scrape path.
    #[serde(default = "default_metrics_path")]
    #[schemars(length(max = 1024))]
    pub path: String,

    /// port names the container port that serves the metrics.
    #[serde(default = "default_port_name")]
    #[schemars(length(max = 15))]
    pub port: String,

    /// queueDepth is the runtime's pending-request metric (vLLM: `vllm:num_requests_waiting`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<String>,

    /// kvCacheUtil is the runtime's KV-cache utilisation metric.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        rename = "kvCacheUtil"
    )]
    pub kv_cache_util: Option<String>,

    /// running is the runtime's in-flight request metric (vLLM: `vllm:num_requests_running`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub running: Option<String>,

    /// ttft is the runtime's time-to-first-token metric.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttft: Option<String>,
}

fn default_metrics_path() -> String {
    "/metrics".to_owned()
}

/// status is the observed state of an InferenceRuntime.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct InferenceRuntimeStatus {
    /// conditions describe the runtime's observed state.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

//! `LLMAdapter`: a LoRA adapter served on a base `LLMService`'s engine. A Hearth extension of
//! the public API (upstream Hearth lists LoRA as roadmap).
//!
//! An adapter is an object of its own, not a list on the service, so that an app team can add
//! a fine-tune without edit rights on the base: creating `llmadapters` in a namespace is the
//! permission to attach adapters there. The base decides who else may attach, as a Gateway
//! API `Gateway` decides with `allowedRoutes`: its `spec.allowedAdapters.namespaces` (default
//! `Same`, only its own namespace). Every limit an adapter is checked against at admission
//! comes from the base's runtime (`InferenceRuntime.spec.adapters`): the highest LoRA rank the
//! engine accepts and how many adapters one service may have; names must not clash with any
//! other model the client could name on the same gateway (`rules::check_llmadapter`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::llmservice::ModelSource;

/// spec is the desired state of an LLMAdapter: which base serves it, where its files come
/// from, and the name clients call it by.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "serving.hearth.dev",
    version = "v1alpha1",
    kind = "LLMAdapter",
    plural = "llmadapters",
    singular = "llmadapter",
    shortname = "llmad",
    category = "hearth",
    namespaced,
    status = "LLMAdapterStatus",
    printcolumn = r#"{"name":"Service","type":"string","jsonPath":".spec.serviceRef.name"}"#,
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".status.servedName"}"#,
    printcolumn = r#"{"name":"Accepted","type":"string","jsonPath":".status.conditions[?(@.type==\"Accepted\")].status"}"#,
    printcolumn = r#"{"name":"Loaded","type":"integer","jsonPath":".status.loadedReplicas"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    doc = "LLMAdapter is a LoRA adapter served by a base LLMService's engine, called by its own model name."
)]
#[serde(rename_all = "camelCase")]
pub struct LLMAdapterSpec {
    /// serviceRef names the base LLMService whose engine loads the adapter; in another
    /// namespace only where the base's `spec.allowedAdapters` admits this one. Immutable: to
    /// move an adapter to another base, create it there.
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self == oldSelf",
        "message": "spec.serviceRef is immutable: create the adapter anew on the other base"
    }]))]
    pub service_ref: ServiceReference,

    /// source is where the adapter's files (`adapter_config.json` and the weights) come from,
    /// with the URIs of `LLMService.spec.model.source.uri`: `hf://`, `modelscope://`,
    /// `pvc://<claim>[/<subpath>]` and `oci://`. They reach the engine through the base's model
    /// cache, never from a hub at wake-up.
    pub source: ModelSource,

    /// servedName is the `model` clients send to call the adapter, and the name the engine
    /// loads it under (vLLM's `lora_name`); default `metadata.name`. Must differ from every
    /// other model on the same gateway.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[A-Za-z0-9]([A-Za-z0-9._:/-]*[A-Za-z0-9])?$")
    )]
    pub served_name: Option<String>,

    /// rank is the adapter's LoRA rank (`r` in its `adapter_config.json`), when known: it is
    /// checked at admission against the runtime's `spec.adapters.maxRank`; the engine checks
    /// the files' own rank when it loads them either way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 512))]
    pub rank: Option<i32>,
}

/// A reference to an LLMService (Gateway API's `ParentReference`, name and namespace only).
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServiceReference {
    /// name of the LLMService.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,

    /// namespace of the LLMService (default: the adapter's own).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub namespace: Option<String>,
}

/// status is the observed state of an LLMAdapter: what the engines report, never assumed.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LLMAdapterStatus {
    /// observedGeneration is the metadata.generation this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// servedName is the model name clients call the adapter by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_name: Option<String>,

    /// loadedReplicas counts the base's backend pods whose engine lists the adapter in its
    /// `/v1/models`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loaded_replicas: Option<i32>,

    /// loadedOn names those pods, sorted; the first 64 when there are more (`loadedReplicas`
    /// counts them all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub loaded_on: Vec<String>,

    /// conditions: `Accepted` (the base exists, admits the adapter, its runtime serves
    /// adapters within its limits, the name is free; written by the controller's reconciler)
    /// and `Loaded` (at least one of the base's ready engines lists it in `/v1/models`; written
    /// every few seconds under the field manager `hearth-adapters`, with `loadedReplicas` and
    /// `loadedOn`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl LLMAdapter {
    /// The `model` clients send for this adapter: `spec.servedName`, else `metadata.name`.
    pub fn served_name(&self) -> &str {
        self.spec
            .served_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .or(self.metadata.name.as_deref())
            .unwrap_or_default()
    }

    /// The base service's namespace: `spec.serviceRef.namespace`, else the adapter's own.
    pub fn service_namespace(&self) -> &str {
        self.spec
            .service_ref
            .namespace
            .as_deref()
            .filter(|n| !n.is_empty())
            .or(self.metadata.namespace.as_deref())
            .unwrap_or_default()
    }
}

/// The adapters one model's engines serve, as the controller hands them to the gateway: a
/// per-service gateway reads it from the ConfigMap `<service>-adapters` (key
/// [`ADAPTERS_KEY`]), a shared gateway from its route table (`ModelRoute.adapters`). Entries
/// are the accepted LLMAdapters, sorted by `name`, names unique.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AdapterTable {
    /// The engine's load call (`POST`, body `{"lora_name", "lora_path"}`), from the runtime's
    /// `spec.adapters.loadPath`.
    pub load_path: String,
    /// The engine's unload call (`POST`, body `{"lora_name"}`), from `spec.adapters.unloadPath`.
    pub unload_path: String,
    /// Adapters kept loaded in one engine at once (`spec.adapters.maxLoaded`); loading one more
    /// first unloads the least recently used.
    pub max_loaded: u32,
    /// The adapters.
    #[serde(default)]
    pub adapters: Vec<AdapterRoute>,
}

/// One adapter of an [`AdapterTable`].
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AdapterRoute {
    /// The `model` clients send, and the engine's `lora_name`.
    pub name: String,
    /// The adapter's directory as the engine sees it (`lora_path`).
    pub path: String,
    /// `<namespace>/<name>` of the LLMAdapter (metrics, Events, status).
    pub adapter: String,
    /// Why the engines cannot load the adapter yet (its files are still being fetched into
    /// the model cache, or the fetch failed), for the client: a request for it is answered
    /// `503` with this message and `Retry-After`, and no load is tried. Absent when it can be
    /// loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// The key of an [`AdapterTable`] in its ConfigMap.
pub const ADAPTERS_KEY: &str = "adapters.json";

/// `GET` this path on a gateway replica's HTTP port: an [`AdapterFailures`] as JSON (on a
/// shared endpoint's gateway, `?service=<namespace>/<name>` keeps one model's). The
/// controller reads it from every replica to put an engine's refusal of a load into the
/// adapter's `Loaded` condition.
pub const ADAPTER_FAILURES_PATH: &str = "/hearth/adapter-failures";

/// The adapter loads that failed at one gateway replica and were not followed by a successful
/// load of the same adapter on the same engine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AdapterFailures {
    /// The failures, sorted by service, adapter and engine.
    #[serde(default)]
    pub failures: Vec<AdapterLoadFailure>,
}

/// The last failed load of one adapter on one engine.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct AdapterLoadFailure {
    /// `<namespace>/<name>` of the model (LLMService or member Deployment) on a shared
    /// endpoint's gateway; empty on a service's own gateway.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub service: String,
    /// `<namespace>/<name>` of the LLMAdapter ([`AdapterRoute::adapter`]).
    pub adapter: String,
    /// The adapter's served name (the `lora_name` sent).
    pub name: String,
    /// `ip:port` (`[ip]:port` for IPv6) of the engine that refused.
    pub engine: String,
    /// The engine's HTTP status; `0` when it did not answer.
    pub status: u16,
    /// The engine's error message (or the gateway's, when the engine did not answer).
    pub message: String,
    /// When the load failed (RFC 3339).
    pub time: String,
}

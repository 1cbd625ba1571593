//! The `serving.hearth.dev/v1alpha1` API.
//!
//! - [`LLMService`] (namespaced): what model to serve and how to scale it.
//! - [`InferenceRuntime`] (cluster-scoped): a backend driver as data.
//! - [`ServingPolicy`] (cluster-scoped): a platform team's CEL policy.
//! - [`LLMEndpoint`] (namespaced): one OpenAI base URL for many services, routed by `model`.
//! - [`LLMAdapter`] (namespaced): a LoRA adapter on a base service's engine.
//!
//! The CRD manifests under `crds/` are generated from these types by
//! `cargo run -p hearth-crds --example crdgen` and checked fresh by this crate's tests.

pub mod admin;
pub mod admission_apis;
pub mod cron;
pub mod duration;
pub mod inferenceruntime;
pub mod llmadapter;
pub mod llmendpoint;
pub mod llmservice;
pub mod metering;
pub mod model_uri;
pub mod naming;
pub mod path;
pub mod quantity;
pub mod rules;
pub mod servingpolicy;
pub mod template;
pub mod wellknown;

pub use duration::{Duration, DurationError, go_duration, parse_duration};
pub use inferenceruntime::{InferenceRuntime, InferenceRuntimeSpec, InferenceRuntimeStatus};
pub use llmadapter::{LLMAdapter, LLMAdapterSpec, LLMAdapterStatus};
pub use llmendpoint::{LLMEndpoint, LLMEndpointSpec, LLMEndpointStatus};
pub use llmservice::{
    ACTIVATION_FAILED_REASONS, Activation, ActivationFailure, ActivationPhases, LLMService,
    LLMServicePhase, LLMServiceSpec, LLMServiceStatus, TenantUsage, Usage, UsagePhases, Wake,
    WakePhases,
};
pub use servingpolicy::{ServingPolicy, ServingPolicySpec, ServingPolicyStatus};

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The API group of every Hearth kind.
pub const GROUP: &str = "serving.hearth.dev";
/// The API version of every Hearth kind.
pub const VERSION: &str = "v1alpha1";

/// Every Hearth CRD with the file name it is checked in under (`crds/<file>`).
pub fn crds() -> Vec<(&'static str, CustomResourceDefinition)> {
    vec![
        ("llmservices.yaml", LLMService::crd()),
        ("inferenceruntimes.yaml", InferenceRuntime::crd()),
        ("servingpolicies.yaml", ServingPolicy::crd()),
        ("llmendpoints.yaml", LLMEndpoint::crd()),
        ("llmadapters.yaml", LLMAdapter::crd()),
    ]
}

/// A CRD as the YAML document checked in under `crds/`, with a header saying how it is made.
///
/// Errors only if serialization fails, which the generated types do not do.
pub fn crd_yaml(crd: &CustomResourceDefinition) -> Result<String, serde_yaml::Error> {
    let body = serde_yaml::to_string(crd)?;
    Ok(format!(
        "# Generated from the Rust types in crds/src by `cargo run -p hearth-crds --example crdgen`.\n\
         # Do not edit by hand.\n{body}"
    ))
}

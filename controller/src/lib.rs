//! Hearth's controller: reconciles each `LLMService` into its children — backend Deployment and
//! Service, gateway Deployment/Service/ServiceAccount/Role/RoleBinding, model cache, prewarm Job
//! and KEDA `ScaledObject` — and each `LLMEndpoint` into a shared gateway with a routing table
//! for the services it accepts, and plain Deployments that join one (an annotation) into their
//! Service, member RBAC and `ScaledObject`, and reports status.
//!
//! - [`attach`] decides which services (and annotated plain Deployments) an endpoint accepts
//!   (Gateway API's attachment rules), one pure function every reconciler calls.
//! - [`mod@render`] turns an `LLMService` and its resolved `InferenceRuntime` into children, offline
//!   (`hearth-controller render` and the golden tests use it; the reconciler applies its output).
//! - [`resolve`] picks the runtime (pinned name, or vendor preference, then priority, then name).
//! - [`reconcile`] is the kube-runtime controller: server-side apply under one field manager,
//!   status, Events, metrics.
//! - [`activation`] is the timeline of a 0→1 (`status.lastActivation`, the `Activated` Event,
//!   `hearth_activation_phase_seconds`).
//! - [`leader`] is leader election on a `coordination.k8s.io` Lease.

pub mod activation;
pub mod admin_tokens;
pub mod adopt;
pub mod attach;
pub mod diff;
pub mod export;
pub mod handover;
pub mod keys;
pub mod labels;
pub mod leader;
pub mod metering;
pub mod metrics;
pub mod model;
pub mod names;
pub mod policy;
pub mod prepull;
pub mod reconcile;
pub mod render;
pub mod resolve;
pub mod scaler_tls;
pub mod scan;
pub mod status;
pub mod template;
pub mod upgrade;
pub mod versions;

pub use reconcile::{Context, Error, run};
pub use render::{Children, RenderConfig, render};
pub use resolve::resolve_runtime;

//! Hearth's admission webhook.
//!
//! - `POST /validate`: `LLMService`, `LLMEndpoint`, `LLMAdapter` and `InferenceRuntime` checks
//!   beyond the CRD schema ([`validate`]), and platform `ServingPolicy` validations of annotated
//!   workloads.
//! - `POST /mutate`: Deployments, StatefulSets and Pods annotated with
//!   `serving.hearth.dev/runtime` or `serving.hearth.dev/vendor` get the built-in and platform
//!   policies' mutations ([`workload`]).
//! - `/healthz`, `/readyz`, `/metrics`.
//!
//! The wire protocol lives in [`admission`] (a pure function of the body and a [`Snapshot`],
//! fuzzed by `webhook/fuzz`), the HTTPS server in [`server`], certificates in [`tls`] and
//! [`selfmanaged`], the cluster watches in [`watch`] (and, for the policies the apiserver runs as
//! exported, [`exported`]), and the webhook configurations it is
//! registered with in [`registration`]. See `docs/webhook.md`.

pub mod admission;
pub mod exported;
pub mod metrics;
pub mod readthrough;
pub mod registration;
pub mod selfmanaged;
pub mod server;
pub mod tls;
pub mod validate;
pub mod watch;
pub mod workload;

pub use admission::{Endpoint, handle};
pub use server::{AppState, Limits, router, serve};
pub use workload::{ServingStores, Snapshot};

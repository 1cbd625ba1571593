//! Hearth's data plane: an OpenAI-compatible reverse proxy that makes scale-to-zero usable.
//!
//! - bounded admission (`maxQueue`, 429 + `Retry-After` beyond it);
//! - cold start: hold (SSE heartbeats for streams) or reject (503 + `Retry-After`), an
//!   activation timeout, and an activation lease that keeps demand raised until the backend is
//!   ready;
//! - backends discovered from the backend Service's EndpointSlices ([`discovery`]) into an
//!   [`endpoints::EndpointSet`], least outstanding requests, held requests forwarded the moment
//!   an endpoint turns ready;
//! - streaming passed through chunk by chunk, bytes unchanged ([`proxy`]);
//! - KEDA: `GET /hearth/queue` (metrics-api) and the ExternalScaler gRPC service ([`scaler`]),
//!   with demand aggregated over gateway replicas ([`peers`]);
//! - the admin endpoints (demand, metrics, metering) on a port of their own, each caller's
//!   bearer token opening its own paths ([`admin`]);
//! - drain on SIGTERM, and the backend `preStop` drain command ([`drain`]);
//! - request bodies bounded in size, read time and total memory ([`proxy`], [`budget`]);
//! - LoRA adapters routed to their base model and loaded into its engines on demand
//!   ([`adapters`]);
//! - optional API keys ([`apikeys`]) and Prometheus metrics ([`metrics`]);
//! - every refusal one typed [`reject::Rejection`], answered as an OpenAI error;
//! - one model per replica (a single-service gateway), or many behind one endpoint (a shared
//!   gateway, routed by the request's `model`): each model's state is a [`model::Model`], the
//!   shared gateway's table of them the [`routes`] module's.
//!
//! `docs/gateway.md` describes the flags and the behaviour.

pub mod adapters;
pub mod admin;
pub mod apikeys;
pub mod budget;
pub mod cli;
pub mod config;
pub(crate) mod configmap;
pub mod demand;
pub mod diagnosis;
pub mod discovery;
pub mod drain;
pub mod endpoints;
pub mod fair;
pub mod gateway;
pub mod metrics;
pub mod model;
pub mod openai;
pub mod peers;
pub mod proxy;
pub mod quota;
pub mod reject;
pub(crate) mod reload;
pub mod routes;
pub mod scaler;
pub mod scaler_tls;
pub mod sleep;
pub mod tenants;
pub mod timer;
pub mod upstream;

pub use config::{ColdStartMode, GatewayConfig, ModelConfig};
pub use endpoints::EndpointSet;
pub use gateway::{Gateway, RunningGateway, spawn, spawn_with_admin};
pub use model::{Model, ModelStatus};
pub use routes::{BackendSource, KubeBackends, RoutesApplied, RoutesError};

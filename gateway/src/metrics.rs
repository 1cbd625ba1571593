//! The gateway's Prometheus metrics, served as text at `GET /metrics`.
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `hearth_gateway_pending` | gauge | requests admitted by this replica and not finished |
//! | `hearth_gateway_demand` | gauge | this replica's demand (pending, at least 1 while the activation lease is held) |
//! | `hearth_gateway_demand_total` | gauge | demand summed over all gateway replicas; absent while unknown |
//! | `hearth_gateway_requests_total{code}` | counter | finished requests by HTTP status code sent |
//! | `hearth_gateway_requests_canceled_total` | counter | requests whose client left before the response finished |
//! | `hearth_gateway_rejections_total{reason}` | counter | requests refused by the gateway itself (`rate_limit_exceeded`, `queue_full`, `cold_reject`, `activation_timeout`, `activation_failed`, `body_too_large`, `body_timeout`, `body_memory`, `loop_detected`, `bad_request`, `method_not_allowed`, `unsupported_transfer_coding`, `unauthorized`, `draining`, `model_required`, `unknown_model`, `adapter_unavailable`) |
//! | `hearth_gateway_activation_wait_seconds` | histogram | cold requests: arrival until forwarded to a ready backend |
//! | `hearth_gateway_upstream_latency_seconds` | histogram | request sent to the backend until its response headers |
//! | `hearth_gateway_time_to_first_token_seconds` | histogram | streaming requests: arrival until the first body chunk from the backend |
//! | `hearth_gateway_upstream_errors_total{kind}` | counter | backend failures (`connect`, `request`, `stream`) |
//! | `hearth_gateway_scaler_streams` | gauge | open KEDA `StreamIsActive` streams |
//! | `hearth_gateway_activation_events_total` | counter | rises of this replica's demand from 0 (upstream Hearth's "inactive-to-active transitions") |
//! | `hearth_gateway_backend_endpoints` | gauge | ready backend endpoints known |
//! | `hearth_gateway_request_body_bytes` | gauge | request body bytes held: being read, or kept to forward (bounded by `--body-memory-limit`) |
//! | `hearth_gateway_backends_sleeping` | gauge | sleeping tier: backend engines asleep, falling asleep or waking up, as this replica knows them |
//! | `hearth_gateway_engine_calls_total{call,result}` | counter | sleeping tier: calls to the engine's sleep API (`call`: `sleep`, `wake_up`, `is_sleeping`; `result`: `ok`, `error`) |
//! | `hearth_activation_phase_seconds{phase}` | histogram | activation phases seen by the gateway: `demand_to_ready` (activation lease raised, a cold request with no lease held, until a ready backend was first seen) `wake_up` (the wake-up calls of a sleeping engine, sent until answered) and `first_byte` (a cold request, held for an activation or a wake-up, from its arrival until the first byte of the answer was forwarded); the controller observes the pod's phases under the same name |
//! | `hearth_gateway_tenant_requests_total{tenant}` | counter | requests dispatched to a backend, by tenant (see [`crate::tenants`]) |
//! | `hearth_gateway_tenant_tokens_total{tenant,kind}` | counter | tokens served, by tenant and `kind` (`prompt`, `completion`): the response's `usage` when it has one, else the estimate (prompt bytes / 4, one completion token per streamed event) |
//! | `hearth_gateway_queue_wait_seconds{tenant}` | histogram | time a request waited in the fair queue for a place in flight (`containerConcurrency` per ready replica; see [`crate::fair`]), 0 when dispatched at once; a cold request's wait includes the activation |
//! | `hearth_gateway_route_table_models` | gauge | shared mode: models in the route table applied last |
//! | `hearth_gateway_route_table_errors_total` | counter | shared mode: route tables refused (not JSON, a field missing or out of range); the last good table stays |
//! | `hearth_gateway_adapter_loads_total{model,adapter,outcome}` | counter | LoRA adapters loaded into an engine by this replica (`outcome`: `loaded`, `failed`); `model` is the base model's name, `adapter` the adapter's, both from the adapter table |
//! | `hearth_gateway_adapter_unloads_total{model,adapter}` | counter | LoRA adapters unloaded from an engine to make room (least recently used) |
//! | `hearth_gateway_adapter_load_duration_seconds{model}` | histogram | time an engine took to load an adapter (loads that succeeded) |
//! | `hearth_gateway_adapter_reloads_total{model,adapter}` | counter | adapter requests an engine answered `404` "does not exist" though this replica had the adapter loaded there (another replica unloaded it): the adapter was loaded again and the request sent once more |
//! | `hearth_gateway_adapter_table_errors_total` | counter | single-service mode: adapter tables refused (not JSON, a field missing or out of range, no `adapters.json` key); the last good table stays |
//!
//! **The `service` label.** Every per-model series (all of the above but
//! `hearth_gateway_scaler_streams`, `hearth_gateway_request_body_bytes`, the route table's and
//! `hearth_gateway_adapter_table_errors_total`)
//! carries `service="<namespace>/<name>"`, the LLMService the series is about: in shared mode
//! each model of the route table has its own series; a single-service gateway labels its series
//! with `--service-key` (by default `<--namespace>/<--llmservice>`). The label is left out when
//! empty: a single-service gateway that does not know its service, and, in shared mode, the
//! requests refused before a model was chosen (draining, framing, API key, body, and an unknown
//! or missing `model`). A model's counters and histograms are removed once it has left the
//! table and its last request finished; its gauges follow the table at every scrape.
//! Prometheus adds `namespace` and `pod` (the chart's `hearth-gateways` PodMonitor also
//! `llmservice`).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
};

use prometheus_client::{
    encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder},
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

use hearth_crds::metering::TenantMetering;

use crate::reject::RejectionKind;

/// The `(model, adapter)` label pairs with series, per `service`.
type AdapterSeries = HashMap<Arc<str>, std::collections::HashSet<(Arc<str>, Arc<str>)>>;

/// The metering counts by `(service, tenant)`.
type MeteringCounts = std::collections::BTreeMap<(Arc<str>, Arc<str>), TenantMetering>;

/// Encodes `service="<service>"`, or nothing when `service` is empty.
fn encode_service(service: &str, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
    if service.is_empty() {
        return Ok(());
    }
    ("service", service).encode(encoder.encode_label())
}

/// Declares a label set that starts with `service` (left out when empty) and the given fields.
macro_rules! service_labels {
    ($(#[doc = $doc:literal])* $name:ident { $($(#[doc = $fdoc:literal])* $field:ident: $ty:ty,)* }) => {
        $(#[doc = $doc])*
        #[derive(Clone, Debug, Hash, PartialEq, Eq)]
        pub struct $name {
            /// `<namespace>/<name>` of the LLMService; empty: left out.
            pub service: Arc<str>,
            $($(#[doc = $fdoc])* pub $field: $ty,)*
        }

        impl EncodeLabelSet for $name {
            fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
                encode_service(&self.service, encoder)?;
                $((stringify!($field), self.$field).encode(encoder.encode_label())?;)*
                Ok(())
            }
        }
    };
}

service_labels! {
    /// `service` alone.
    ServiceLabel {}
}

service_labels! {
    /// `service` and `code`: an HTTP status code.
    CodeLabel {
        /// The status code, e.g. `200`.
        code: u16,
    }
}

service_labels! {
    /// `service` and `reason`.
    ReasonLabel {
        /// Why, in `snake_case`.
        reason: &'static str,
    }
}

service_labels! {
    /// `service` and `kind` of upstream errors.
    KindLabel {
        /// What failed, in `snake_case`.
        kind: &'static str,
    }
}

service_labels! {
    /// `service`, `call` and `result` of the sleeping tier's engine calls.
    EngineCallLabel {
        /// `sleep`, `wake_up` or `is_sleeping`.
        call: &'static str,
        /// `ok` or `error`.
        result: &'static str,
    }
}

/// `service` and `tenant`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct TenantLabel {
    /// `<namespace>/<name>` of the LLMService; empty: left out.
    pub service: Arc<str>,
    /// The tenant's name.
    pub tenant: Arc<str>,
}

impl EncodeLabelSet for TenantLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        encode_service(&self.service, encoder)?;
        ("tenant", &*self.tenant).encode(encoder.encode_label())
    }
}

/// `service`, `tenant` and `kind` (`prompt` or `completion`) of
/// `hearth_gateway_tenant_tokens_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct TenantTokensLabel {
    /// `<namespace>/<name>` of the LLMService; empty: left out.
    pub service: Arc<str>,
    /// The tenant's name.
    pub tenant: Arc<str>,
    /// `prompt` or `completion`.
    pub kind: &'static str,
}

impl EncodeLabelSet for TenantTokensLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        encode_service(&self.service, encoder)?;
        ("tenant", &*self.tenant).encode(encoder.encode_label())?;
        ("kind", self.kind).encode(encoder.encode_label())
    }
}

service_labels! {
    /// `service` and `phase` of `hearth_activation_phase_seconds`.
    PhaseLabel {
        /// The phase, in `snake_case`: `demand_to_ready`, `wake_up` or `first_byte` here.
        phase: &'static str,
    }
}

/// `service`, `model` and `adapter` of `hearth_gateway_adapter_unloads_total` and
/// `hearth_gateway_adapter_reloads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct AdapterLabel {
    /// `<namespace>/<name>` of the LLMService; empty: left out.
    pub service: Arc<str>,
    /// The base model's name.
    pub model: Arc<str>,
    /// The adapter's name.
    pub adapter: Arc<str>,
}

impl EncodeLabelSet for AdapterLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        encode_service(&self.service, encoder)?;
        ("model", &*self.model).encode(encoder.encode_label())?;
        ("adapter", &*self.adapter).encode(encoder.encode_label())
    }
}

/// `service`, `model`, `adapter` and `outcome` (`loaded`, `failed`) of
/// `hearth_gateway_adapter_loads_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct AdapterLoadLabel {
    /// `<namespace>/<name>` of the LLMService; empty: left out.
    pub service: Arc<str>,
    /// The base model's name.
    pub model: Arc<str>,
    /// The adapter's name.
    pub adapter: Arc<str>,
    /// `loaded` or `failed`.
    pub outcome: &'static str,
}

impl EncodeLabelSet for AdapterLoadLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        encode_service(&self.service, encoder)?;
        ("model", &*self.model).encode(encoder.encode_label())?;
        ("adapter", &*self.adapter).encode(encoder.encode_label())?;
        ("outcome", self.outcome).encode(encoder.encode_label())
    }
}

/// `service` and `model` of `hearth_gateway_adapter_load_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct BaseModelLabel {
    /// `<namespace>/<name>` of the LLMService; empty: left out.
    pub service: Arc<str>,
    /// The base model's name.
    pub model: Arc<str>,
}

impl EncodeLabelSet for BaseModelLabel {
    fn encode(&self, encoder: &mut LabelSetEncoder) -> Result<(), std::fmt::Error> {
        encode_service(&self.service, encoder)?;
        ("model", &*self.model).encode(encoder.encode_label())
    }
}

/// The values of `outcome` in `hearth_gateway_adapter_loads_total`.
const ADAPTER_OUTCOMES: [&str; 2] = ["loaded", "failed"];

/// The values of `kind` in `hearth_gateway_upstream_errors_total`.
const UPSTREAM_ERROR_KINDS: [&str; 3] = ["connect", "request", "stream"];
/// The values of `call` in `hearth_gateway_engine_calls_total`.
const ENGINE_CALLS: [&str; 3] = ["sleep", "wake_up", "is_sleeping"];
/// The values of `phase` the gateway observes.
const PHASES: [&str; 3] = ["demand_to_ready", "wake_up", "first_byte"];

type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// One model's demand and endpoints at a scrape (the gauges computed then).
#[derive(Debug, Clone)]
pub struct ScrapeModel {
    /// The model's `service` label.
    pub service: Arc<str>,
    /// Requests admitted by this replica and not finished.
    pub pending: u64,
    /// This replica's demand.
    pub local: u64,
    /// Demand over all replicas; `None` while unknown (the series is left out).
    pub total: Option<u64>,
    /// Ready (with the sleeping tier: awake) backend endpoints.
    pub endpoints: usize,
}

/// All gateway metrics and their registry. Per-model series are written through a
/// [`ModelMetrics`]; the gauges of demand and endpoints are computed at each scrape
/// ([`Metrics::encode_scrape`]).
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `hearth_gateway_pending{service}`, set at scrape time.
    pub pending: Family<ServiceLabel, Gauge>,
    /// `hearth_gateway_demand{service}`, set at scrape time.
    pub demand: Family<ServiceLabel, Gauge>,
    /// `hearth_gateway_demand_total{service}`, set at scrape time.
    pub demand_total: Family<ServiceLabel, Gauge>,
    /// `hearth_gateway_backend_endpoints{service}`, set at scrape time.
    pub backend_endpoints: Family<ServiceLabel, Gauge>,
    /// `hearth_gateway_requests_total{service,code}`.
    pub requests: Family<CodeLabel, Counter>,
    /// `hearth_gateway_requests_canceled_total{service}`.
    pub canceled: Family<ServiceLabel, Counter>,
    /// `hearth_gateway_rejections_total{service,reason}`.
    pub rejections: Family<ReasonLabel, Counter>,
    /// `hearth_gateway_activation_wait_seconds{service}`.
    pub activation_wait: HistogramFamily<ServiceLabel>,
    /// `hearth_gateway_upstream_latency_seconds{service}`.
    pub upstream_latency: HistogramFamily<ServiceLabel>,
    /// `hearth_gateway_time_to_first_token_seconds{service}`.
    pub ttft: HistogramFamily<ServiceLabel>,
    /// `hearth_gateway_upstream_errors_total{service,kind}`.
    pub upstream_errors: Family<KindLabel, Counter>,
    /// `hearth_gateway_scaler_streams`.
    pub scaler_streams: Gauge,
    /// `hearth_gateway_activation_events_total{service}`.
    pub activation_events: Family<ServiceLabel, Counter>,
    /// `hearth_gateway_request_body_bytes`.
    pub request_body_bytes: Gauge,
    /// `hearth_gateway_backends_sleeping{service}`.
    pub backends_sleeping: Family<ServiceLabel, Gauge>,
    /// `hearth_gateway_engine_calls_total{service,call,result}`.
    pub engine_calls: Family<EngineCallLabel, Counter>,
    /// `hearth_activation_phase_seconds{service,phase}`.
    pub activation_phases: HistogramFamily<PhaseLabel>,
    /// `hearth_gateway_route_table_models`.
    pub route_table_models: Gauge,
    /// `hearth_gateway_route_table_errors_total`.
    pub route_table_errors: Counter,
    /// `hearth_gateway_adapter_loads_total{service,model,adapter,outcome}`.
    pub adapter_loads: Family<AdapterLoadLabel, Counter>,
    /// `hearth_gateway_adapter_unloads_total{service,model,adapter}`.
    pub adapter_unloads: Family<AdapterLabel, Counter>,
    /// `hearth_gateway_adapter_load_duration_seconds{service,model}`.
    pub adapter_load_duration: HistogramFamily<BaseModelLabel>,
    /// `hearth_gateway_adapter_reloads_total{service,model,adapter}`.
    pub adapter_reloads: Family<AdapterLabel, Counter>,
    /// `hearth_gateway_adapter_table_errors_total`.
    pub adapter_table_errors: Counter,
    /// The `(model, adapter)` pairs with series, per `service`: removed with the service's.
    adapter_series: Mutex<AdapterSeries>,
    /// `hearth_gateway_tenant_requests_total{service,tenant}`.
    pub tenant_requests: Family<TenantLabel, Counter>,
    /// `hearth_gateway_tenant_tokens_total{service,tenant,kind}`.
    pub tenant_tokens: Family<TenantTokensLabel, Counter>,
    /// `hearth_gateway_queue_wait_seconds{service,tenant}`.
    pub queue_wait: HistogramFamily<TenantLabel>,
    /// Per `(service, tenant)`: requests, tokens and cold arrivals so far, for
    /// [`hearth_crds::metering`] (kept when a service's series are removed: the counts are
    /// cumulative for the replica's life).
    metering: Mutex<MeteringCounts>,
    /// The tenants' names, for removing a model's series.
    pub(crate) tenant_names: std::sync::OnceLock<Vec<Arc<str>>>,
    /// How many [`ModelMetrics`] are alive per `service`: a model's series are removed when
    /// its last one drops.
    live: Mutex<HashMap<Arc<str>, usize>>,
    /// Makes [`Metrics::encode_scrape`] one step for concurrent scrapes.
    scrape: Mutex<()>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let pending = Family::default();
        let demand = Family::default();
        let demand_total = Family::default();
        let backend_endpoints = Family::default();
        let requests = Family::default();
        let canceled = Family::default();
        let rejections = Family::default();
        // 1 ms .. ~9 min.
        let activation_wait: HistogramFamily<ServiceLabel> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 20)));
        // 0.1 ms .. ~52 s.
        let upstream_latency: HistogramFamily<ServiceLabel> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.0001, 2.0, 20)));
        let ttft: HistogramFamily<ServiceLabel> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 20)));
        let upstream_errors = Family::default();
        let scaler_streams = Gauge::default();
        let activation_events = Family::default();
        let request_body_bytes = Gauge::default();
        let backends_sleeping = Family::default();
        let engine_calls = Family::default();
        let activation_phases: HistogramFamily<PhaseLabel> =
            Family::new_with_constructor(activation_histogram);
        let route_table_models = Gauge::default();
        let route_table_errors = Counter::default();
        let adapter_loads = Family::default();
        let adapter_unloads = Family::default();
        // 10 ms .. ~5.5 min.
        let adapter_load_duration: HistogramFamily<BaseModelLabel> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.01, 2.0, 16)));
        let adapter_reloads = Family::default();
        let adapter_table_errors = Counter::default();
        let tenant_requests = Family::default();
        let tenant_tokens = Family::default();
        // 1 ms .. ~9 min.
        let queue_wait: HistogramFamily<TenantLabel> =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 20)));
        registry.register(
            "hearth_gateway_tenant_requests",
            "Requests dispatched to a backend, by tenant",
            tenant_requests.clone(),
        );
        registry.register(
            "hearth_gateway_tenant_tokens",
            "Tokens served by tenant and kind (prompt, completion): the response's usage, else an estimate",
            tenant_tokens.clone(),
        );
        registry.register(
            "hearth_gateway_queue_wait_seconds",
            "Time a request waited in the fair queue for a place in flight, by tenant",
            queue_wait.clone(),
        );
        registry.register(
            "hearth_gateway_pending",
            "Requests admitted by this replica and not finished",
            pending.clone(),
        );
        registry.register(
            "hearth_gateway_demand",
            "This replica's demand: pending, at least 1 while the activation lease is held",
            demand.clone(),
        );
        registry.register(
            "hearth_gateway_demand_total",
            "Demand summed over all gateway replicas (absent while unknown)",
            demand_total.clone(),
        );
        registry.register(
            "hearth_gateway_requests",
            "Finished requests by HTTP status code sent",
            requests.clone(),
        );
        registry.register(
            "hearth_gateway_requests_canceled",
            "Requests whose client left before the response finished",
            canceled.clone(),
        );
        registry.register(
            "hearth_gateway_rejections",
            "Requests refused by the gateway itself, by reason",
            rejections.clone(),
        );
        registry.register(
            "hearth_gateway_activation_wait_seconds",
            "Cold requests: arrival until forwarded to a ready backend",
            activation_wait.clone(),
        );
        registry.register(
            "hearth_gateway_upstream_latency_seconds",
            "Request sent to the backend until its response headers",
            upstream_latency.clone(),
        );
        registry.register(
            "hearth_gateway_time_to_first_token_seconds",
            "Streaming requests: arrival until the first body chunk from the backend",
            ttft.clone(),
        );
        registry.register(
            "hearth_gateway_upstream_errors",
            "Backend failures by kind",
            upstream_errors.clone(),
        );
        registry.register(
            "hearth_gateway_scaler_streams",
            "Open KEDA StreamIsActive streams",
            scaler_streams.clone(),
        );
        registry.register(
            "hearth_gateway_activation_events",
            "Rises of this replica's demand from 0 (a cold or idle replica becoming active)",
            activation_events.clone(),
        );
        registry.register(
            "hearth_gateway_backend_endpoints",
            "Ready backend endpoints known",
            backend_endpoints.clone(),
        );
        registry.register(
            "hearth_gateway_request_body_bytes",
            "Request body bytes held: being read, or kept to forward (bounded by --body-memory-limit)",
            request_body_bytes.clone(),
        );
        registry.register(
            "hearth_gateway_backends_sleeping",
            "Sleeping tier: backend engines asleep, falling asleep or waking up",
            backends_sleeping.clone(),
        );
        registry.register(
            "hearth_gateway_engine_calls",
            "Sleeping tier: calls to the engine's sleep API, by call and result",
            engine_calls.clone(),
        );
        registry.register(
            "hearth_activation_phase_seconds",
            "Phases of activations (0 to 1 backend replicas, and sleeping engines woken), in seconds",
            activation_phases.clone(),
        );
        registry.register(
            "hearth_gateway_route_table_models",
            "Shared mode: models in the route table applied last",
            route_table_models.clone(),
        );
        registry.register(
            "hearth_gateway_route_table_errors",
            "Shared mode: route tables refused (the last good table stays)",
            route_table_errors.clone(),
        );
        registry.register(
            "hearth_gateway_adapter_loads",
            "LoRA adapters loaded into an engine, by base model, adapter and outcome (loaded, failed)",
            adapter_loads.clone(),
        );
        registry.register(
            "hearth_gateway_adapter_unloads",
            "LoRA adapters unloaded from an engine to make room, by base model and adapter",
            adapter_unloads.clone(),
        );
        registry.register(
            "hearth_gateway_adapter_load_duration_seconds",
            "Time an engine took to load a LoRA adapter, by base model",
            adapter_load_duration.clone(),
        );
        registry.register(
            "hearth_gateway_adapter_reloads",
            "Adapter requests an engine answered 404 for though this replica had the adapter loaded there: loaded again and sent once more, by base model and adapter",
            adapter_reloads.clone(),
        );
        registry.register(
            "hearth_gateway_adapter_table_errors",
            "Single-service mode: adapter tables refused (the last good table stays)",
            adapter_table_errors.clone(),
        );
        Self {
            registry,
            adapter_loads,
            adapter_unloads,
            adapter_load_duration,
            adapter_reloads,
            adapter_table_errors,
            adapter_series: Mutex::new(HashMap::new()),
            tenant_requests,
            tenant_tokens,
            queue_wait,
            tenant_names: std::sync::OnceLock::new(),
            pending,
            demand,
            demand_total,
            backend_endpoints,
            requests,
            canceled,
            rejections,
            activation_wait,
            upstream_latency,
            ttft,
            upstream_errors,
            scaler_streams,
            activation_events,
            request_body_bytes,
            backends_sleeping,
            engine_calls,
            activation_phases,
            route_table_models,
            route_table_errors,
            live: Mutex::new(HashMap::new()),
            scrape: Mutex::new(()),
            metering: Mutex::new(std::collections::BTreeMap::new()),
        }
    }

    /// The metering counts of `service` (its key: `<namespace>/<name>`, or empty), by tenant.
    pub fn metering(&self, service: &str) -> Vec<TenantMetering> {
        self.metering
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|((s, _), _)| &**s == service)
            .map(|(_, m)| m.clone())
            .collect()
    }

    /// Adds to the metering counts of `(service, tenant)`.
    fn meter(&self, service: &Arc<str>, tenant: &Arc<str>, add: impl FnOnce(&mut TenantMetering)) {
        let mut all = self.metering.lock().unwrap_or_else(|e| e.into_inner());
        let entry = all
            .entry((service.clone(), tenant.clone()))
            .or_insert_with(|| TenantMetering {
                tenant: tenant.to_string(),
                ..TenantMetering::default()
            });
        add(entry);
    }

    /// Sets the gauges of demand and endpoints to `models` (the models of the route table now;
    /// series of other models are dropped; `total: None` leaves `hearth_gateway_demand_total`
    /// out) and encodes, as one step. Clearing and setting the shared families around
    /// [`Metrics::encode`] instead lets a concurrent scrape encode between another's clear and
    /// set, and miss a value.
    pub fn encode_scrape(&self, models: &[ScrapeModel]) -> String {
        let _one_at_a_time = self.scrape.lock().unwrap_or_else(|e| e.into_inner());
        for family in [
            &self.pending,
            &self.demand,
            &self.demand_total,
            &self.backend_endpoints,
        ] {
            family.clear();
        }
        let gauge = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for m in models {
            let label = ServiceLabel {
                service: m.service.clone(),
            };
            self.pending.get_or_create(&label).set(gauge(m.pending));
            self.demand.get_or_create(&label).set(gauge(m.local));
            if let Some(t) = m.total {
                self.demand_total.get_or_create(&label).set(gauge(t));
            }
            self.backend_endpoints
                .get_or_create(&label)
                .set(i64::try_from(m.endpoints).unwrap_or(i64::MAX));
        }
        self.encode()
    }

    /// [`Metrics::encode_scrape`] for one model without a `service` label and with nothing
    /// pending: `hearth_gateway_demand_total` is `total`, absent when `None`.
    pub fn encode_with_total(&self, total: Option<i64>) -> String {
        self.encode_scrape(&[ScrapeModel {
            service: Arc::from(""),
            pending: 0,
            local: 0,
            total: total.map(|t| u64::try_from(t).unwrap_or(0)),
            endpoints: 0,
        }])
    }

    /// The text exposition format (Prometheus `text/plain; version=0.0.4` compatible
    /// OpenMetrics text).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Counts one more [`ModelMetrics`] of `service`.
    fn hold(&self, service: &Arc<str>) {
        *self
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(service.clone())
            .or_default() += 1;
    }

    /// One [`ModelMetrics`] of `service` dropped; the last one removes the service's series.
    fn release(&self, service: &Arc<str>) {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        let last = match live.get_mut(service) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => true,
        };
        if !last {
            return;
        }
        live.remove(service);
        drop(live);
        self.remove_series(service);
    }

    /// Removes every counter, histogram and gauge series of `service`.
    fn remove_series(&self, service: &Arc<str>) {
        let s = || service.clone();
        let label = ServiceLabel { service: s() };
        self.canceled.remove(&label);
        self.activation_wait.remove(&label);
        self.upstream_latency.remove(&label);
        self.ttft.remove(&label);
        self.activation_events.remove(&label);
        self.backends_sleeping.remove(&label);
        // Status codes are 100..=999 (`http::StatusCode`).
        for code in 100..=999 {
            self.requests.remove(&CodeLabel { service: s(), code });
        }
        for kind in RejectionKind::ALL {
            self.rejections.remove(&ReasonLabel {
                service: s(),
                reason: kind.label(),
            });
        }
        for kind in UPSTREAM_ERROR_KINDS {
            self.upstream_errors
                .remove(&KindLabel { service: s(), kind });
        }
        for call in ENGINE_CALLS {
            for result in ["ok", "error"] {
                self.engine_calls.remove(&EngineCallLabel {
                    service: s(),
                    call,
                    result,
                });
            }
        }
        for phase in PHASES {
            self.activation_phases.remove(&PhaseLabel {
                service: s(),
                phase,
            });
        }
        let adapters = self
            .adapter_series
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(service)
            .unwrap_or_default();
        for (model, adapter) in adapters {
            for outcome in ADAPTER_OUTCOMES {
                self.adapter_loads.remove(&AdapterLoadLabel {
                    service: s(),
                    model: model.clone(),
                    adapter: adapter.clone(),
                    outcome,
                });
            }
            let label = AdapterLabel {
                service: s(),
                model: model.clone(),
                adapter,
            };
            self.adapter_unloads.remove(&label);
            self.adapter_reloads.remove(&label);
            self.adapter_load_duration.remove(&BaseModelLabel {
                service: s(),
                model,
            });
        }
        for tenant in self.tenant_names.get().into_iter().flatten() {
            let label = TenantLabel {
                service: s(),
                tenant: tenant.clone(),
            };
            self.tenant_requests.remove(&label);
            self.queue_wait.remove(&label);
            for kind in ["prompt", "completion"] {
                self.tenant_tokens.remove(&TenantTokensLabel {
                    service: s(),
                    tenant: tenant.clone(),
                    kind,
                });
            }
        }
    }
}

/// The series of one model (one `service` label value), written by its requests, its lease
/// and its sleeping tier. The series that exist from the start (counters at 0, empty
/// histograms) are resolved once here, so the request path looks up only the ones with a
/// second label. Dropping the last one of a `service` removes its series.
#[derive(Debug)]
pub struct ModelMetrics {
    metrics: Arc<Metrics>,
    service: Arc<str>,
    canceled: Counter,
    activation_wait: Histogram,
    upstream_latency: Histogram,
    ttft: Histogram,
    activation_events: Counter,
    backends_sleeping: Gauge,
}

impl ModelMetrics {
    /// The series of `service` (`<namespace>/<name>`; empty: no `service` label) in `metrics`.
    pub fn new(metrics: Arc<Metrics>, service: &str) -> Self {
        let service: Arc<str> = Arc::from(service);
        metrics.hold(&service);
        let label = ServiceLabel {
            service: service.clone(),
        };
        let canceled = metrics.canceled.get_or_create_owned(&label);
        let activation_wait = metrics.activation_wait.get_or_create_owned(&label);
        let upstream_latency = metrics.upstream_latency.get_or_create_owned(&label);
        let ttft = metrics.ttft.get_or_create_owned(&label);
        let activation_events = metrics.activation_events.get_or_create_owned(&label);
        let backends_sleeping = metrics.backends_sleeping.get_or_create_owned(&label);
        Self {
            metrics,
            service,
            canceled,
            activation_wait,
            upstream_latency,
            ttft,
            activation_events,
            backends_sleeping,
        }
    }

    /// The series of requests a shared gateway refuses before they have a model: counted
    /// without a `service` label. Only their outcomes (`requests_total`, `rejections_total`,
    /// `requests_canceled_total`) are exported; nothing else is about them.
    pub fn unrouted(metrics: Arc<Metrics>) -> Self {
        let service: Arc<str> = Arc::from("");
        metrics.hold(&service);
        let canceled = metrics.canceled.get_or_create_owned(&ServiceLabel {
            service: service.clone(),
        });
        let detached = || Histogram::new(std::iter::empty());
        Self {
            metrics,
            service,
            canceled,
            activation_wait: detached(),
            upstream_latency: detached(),
            ttft: detached(),
            activation_events: Counter::default(),
            backends_sleeping: Gauge::default(),
        }
    }

    /// The `service` label value.
    pub fn service(&self) -> &Arc<str> {
        &self.service
    }

    /// The replica's metrics.
    pub fn replica(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// A request of `tenant` dispatched after waiting `seconds` in the fair queue.
    pub fn dispatched(&self, tenant: &Arc<str>, seconds: f64) {
        let label = TenantLabel {
            service: self.service.clone(),
            tenant: tenant.clone(),
        };
        self.metrics.tenant_requests.get_or_create(&label).inc();
        self.metrics
            .queue_wait
            .get_or_create(&label)
            .observe(seconds);
        self.metrics.meter(&self.service, tenant, |m| {
            m.requests = m.requests.saturating_add(1)
        });
    }

    /// A request of `tenant` arrived while no backend engine was ready and awake (metering:
    /// the tenants who waited for a cold start or a wake-up).
    pub fn cold_request(&self, tenant: &Arc<str>) {
        self.metrics.meter(&self.service, tenant, |m| {
            m.cold_requests = m.cold_requests.saturating_add(1);
        });
    }

    /// Tokens served to `tenant`.
    pub fn tokens(&self, tenant: &Arc<str>, prompt: u64, completion: u64) {
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            self.metrics
                .tenant_tokens
                .get_or_create(&TenantTokensLabel {
                    service: self.service.clone(),
                    tenant: tenant.clone(),
                    kind,
                })
                .inc_by(n);
        }
        let total = prompt.saturating_add(completion);
        self.metrics.meter(&self.service, tenant, |m| {
            m.tokens = m.tokens.saturating_add(total)
        });
    }

    /// Counts a finished request by status code.
    pub fn finished(&self, code: u16) {
        self.metrics
            .requests
            .get_or_create(&CodeLabel {
                service: self.service.clone(),
                code,
            })
            .inc();
    }

    /// Counts a request whose client left first.
    pub fn canceled(&self) {
        self.canceled.inc();
    }

    /// Requests canceled so far.
    pub fn canceled_count(&self) -> u64 {
        self.canceled.get()
    }

    /// Counts a refusal by the gateway.
    pub fn rejected(&self, reason: &'static str) {
        self.metrics
            .rejections
            .get_or_create(&ReasonLabel {
                service: self.service.clone(),
                reason,
            })
            .inc();
    }

    /// Refusals for `reason` so far.
    pub fn rejected_count(&self, reason: &'static str) -> u64 {
        self.metrics
            .rejections
            .get(&ReasonLabel {
                service: self.service.clone(),
                reason,
            })
            .map_or(0, |c| c.get())
    }

    /// Requests finished with `code` so far.
    pub fn finished_count(&self, code: u16) -> u64 {
        self.metrics
            .requests
            .get(&CodeLabel {
                service: self.service.clone(),
                code,
            })
            .map_or(0, |c| c.get())
    }

    /// Counts a backend failure.
    pub fn upstream_error(&self, kind: &'static str) {
        self.metrics
            .upstream_errors
            .get_or_create(&KindLabel {
                service: self.service.clone(),
                kind,
            })
            .inc();
    }

    /// Observes a cold request's wait from arrival until sent to a ready backend, in seconds.
    pub fn activation_wait(&self, seconds: f64) {
        self.activation_wait.observe(seconds);
    }

    /// Observes the time from sending a request to the backend's response head, in seconds.
    pub fn upstream_latency(&self, seconds: f64) {
        self.upstream_latency.observe(seconds);
    }

    /// Observes a stream's time to its first token, in seconds.
    pub fn ttft(&self, seconds: f64) {
        self.ttft.observe(seconds);
    }

    /// The counter of rises of the model's demand from 0, for its demand hub.
    pub fn activation_events(&self) -> Counter {
        self.activation_events.clone()
    }

    /// Sets how many engines are not awake (sleeping tier).
    pub fn set_backends_sleeping(&self, n: usize) {
        self.backends_sleeping
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts a call to the engine's sleep API.
    pub fn engine_call(&self, call: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.metrics
            .engine_calls
            .get_or_create(&EngineCallLabel {
                service: self.service.clone(),
                call,
                result,
            })
            .inc();
    }

    /// Notes that `(model, adapter)` has series of this model's, to remove with them.
    fn adapter_series(&self, model: &Arc<str>, adapter: &Arc<str>) {
        self.metrics
            .adapter_series
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(self.service.clone())
            .or_default()
            .insert((model.clone(), adapter.clone()));
    }

    /// Counts a load of `adapter` (of base model `model`) into an engine: `loaded` (observing
    /// its duration) or `failed`.
    pub fn adapter_load(&self, model: &Arc<str>, adapter: &Arc<str>, loaded: bool, seconds: f64) {
        self.adapter_series(model, adapter);
        let outcome = if loaded { "loaded" } else { "failed" };
        self.metrics
            .adapter_loads
            .get_or_create(&AdapterLoadLabel {
                service: self.service.clone(),
                model: model.clone(),
                adapter: adapter.clone(),
                outcome,
            })
            .inc();
        if loaded {
            self.metrics
                .adapter_load_duration
                .get_or_create(&BaseModelLabel {
                    service: self.service.clone(),
                    model: model.clone(),
                })
                .observe(seconds);
        }
    }

    /// Counts an unload of `adapter` (of base model `model`) from an engine.
    pub fn adapter_unload(&self, model: &Arc<str>, adapter: &Arc<str>) {
        self.adapter_series(model, adapter);
        self.metrics
            .adapter_unloads
            .get_or_create(&AdapterLabel {
                service: self.service.clone(),
                model: model.clone(),
                adapter: adapter.clone(),
            })
            .inc();
    }

    /// Counts an adapter request of `adapter` (of base model `model`) sent once more after the
    /// engine said it did not have the adapter and it was loaded again.
    pub fn adapter_reload(&self, model: &Arc<str>, adapter: &Arc<str>) {
        self.adapter_series(model, adapter);
        self.metrics
            .adapter_reloads
            .get_or_create(&AdapterLabel {
                service: self.service.clone(),
                model: model.clone(),
                adapter: adapter.clone(),
            })
            .inc();
    }

    /// The `demand_to_ready` series of `hearth_activation_phase_seconds`, for the lease.
    pub fn demand_to_ready(&self) -> Histogram {
        self.phase("demand_to_ready")
    }

    fn phase(&self, phase: &'static str) -> Histogram {
        self.metrics
            .activation_phases
            .get_or_create_owned(&PhaseLabel {
                service: self.service.clone(),
                phase,
            })
    }

    /// Records that activation phase `phase` took `seconds`.
    pub fn observe_phase(&self, phase: &'static str, seconds: f64) {
        self.metrics
            .activation_phases
            .get_or_create(&PhaseLabel {
                service: self.service.clone(),
                phase,
            })
            .observe(seconds);
    }
}

impl Drop for ModelMetrics {
    fn drop(&mut self) {
        self.metrics.release(&self.service);
    }
}

/// Histogram of one activation phase: 1 ms .. ~35 min, as the controller's phases under the
/// same name.
fn activation_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 22))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_carry_the_service_unless_it_is_empty() {
        let m = Arc::new(Metrics::new());
        let a = ModelMetrics::new(m.clone(), "ns/a");
        let unlabelled = ModelMetrics::new(m.clone(), "");
        a.finished(200);
        a.rejected("queue_full");
        a.engine_call("sleep", true);
        unlabelled.finished(404);
        let text = m.encode_scrape(&[
            ScrapeModel {
                service: Arc::from("ns/a"),
                pending: 3,
                local: 3,
                total: Some(5),
                endpoints: 1,
            },
            ScrapeModel {
                service: Arc::from("ns/b"),
                pending: 0,
                local: 0,
                total: None,
                endpoints: 0,
            },
        ]);
        for line in [
            "hearth_gateway_requests_total{service=\"ns/a\",code=\"200\"} 1",
            "hearth_gateway_requests_total{code=\"404\"} 1",
            "hearth_gateway_rejections_total{service=\"ns/a\",reason=\"queue_full\"} 1",
            "hearth_gateway_engine_calls_total{service=\"ns/a\",call=\"sleep\",result=\"ok\"} 1",
            "hearth_gateway_pending{service=\"ns/a\"} 3",
            "hearth_gateway_demand_total{service=\"ns/a\"} 5",
            "hearth_gateway_backend_endpoints{service=\"ns/b\"} 0",
            "hearth_gateway_requests_canceled_total{service=\"ns/a\"} 0",
            "hearth_gateway_requests_canceled_total 0",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        assert!(
            !text.contains("hearth_gateway_demand_total{service=\"ns/b\"}"),
            "an unknown total is left out"
        );
        // The next scrape's models replace these gauges.
        let text = m.encode_scrape(&[]);
        assert!(!text.contains("hearth_gateway_pending{"), "{text}");
    }

    #[test]
    fn the_last_series_holder_of_a_service_removes_its_series() {
        let m = Arc::new(Metrics::new());
        let first = ModelMetrics::new(m.clone(), "ns/a");
        let second = ModelMetrics::new(m.clone(), "ns/a");
        first.finished(200);
        first.observe_phase("first_byte", 0.5);
        drop(first);
        let has = |text: &str| text.contains("service=\"ns/a\"");
        assert!(has(&m.encode()), "another holder is alive");
        second.finished(503);
        second.adapter_load(&Arc::from("m"), &Arc::from("x"), true, 0.2);
        second.adapter_unload(&Arc::from("m"), &Arc::from("x"));
        second.adapter_reload(&Arc::from("m"), &Arc::from("x"));
        let text = m.encode();
        for line in [
            "hearth_gateway_adapter_loads_total{service=\"ns/a\",model=\"m\",adapter=\"x\",outcome=\"loaded\"} 1",
            "hearth_gateway_adapter_unloads_total{service=\"ns/a\",model=\"m\",adapter=\"x\"} 1",
            "hearth_gateway_adapter_reloads_total{service=\"ns/a\",model=\"m\",adapter=\"x\"} 1",
            "hearth_gateway_adapter_load_duration_seconds_count{service=\"ns/a\",model=\"m\"} 1",
        ] {
            assert!(text.lines().any(|l| l == line), "{line} not in\n{text}");
        }
        drop(second);
        let text = m.encode();
        assert!(!has(&text), "{text}");
    }
}

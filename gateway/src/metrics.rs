//! The gateway's Prometheus metrics, served as text at `GET /metrics`.
//!
//! | metric | type | meaning |
//! |---|---|---|
//! | `hearth_gateway_pending` | gauge | requests admitted by this replica and not finished |
//! | `hearth_gateway_demand` | gauge | this replica's demand (pending, at least 1 while the activation lease is held) |
//! | `hearth_gateway_demand_total` | gauge | demand summed over all gateway replicas; absent while unknown |
//! | `hearth_gateway_requests_total{code}` | counter | finished requests by HTTP status code sent |
//! | `hearth_gateway_requests_canceled_total` | counter | requests whose client left before the response finished |
//! | `hearth_gateway_rejections_total{reason}` | counter | requests refused by the gateway itself (`queue_full`, `cold_reject`, `activation_timeout`, `body_too_large`, `body_timeout`, `body_memory`, `loop_detected`, `bad_request`, `method_not_allowed`, `unsupported_transfer_coding`, `unauthorized`, `draining`, `unknown_model`) |
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
//!
//! The gateway names no namespace, pod or service in its series: Prometheus adds `namespace` and
//! `pod` (the chart's `hearth-gateways` PodMonitor also `llmservice`); the dashboard groups by
//! them.

use std::sync::{Mutex, atomic::AtomicI64};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// `code` label: an HTTP status code.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabel {
    /// The status code, e.g. `200`.
    pub code: u16,
}

/// `reason` or `kind` label.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// Why, in `snake_case`.
    pub reason: &'static str,
}

/// `kind` label of upstream errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabel {
    /// What failed, in `snake_case`.
    pub kind: &'static str,
}

/// `call` and `result` labels of the sleeping tier's engine calls.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EngineCallLabel {
    /// `sleep`, `wake_up` or `is_sleeping`.
    pub call: &'static str,
    /// `ok` or `error`.
    pub result: &'static str,
}

/// `phase` label of `hearth_activation_phase_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// The phase, in `snake_case`: `demand_to_ready`, `wake_up` or `first_byte` here.
    pub phase: &'static str,
}

/// All gateway metrics and their registry.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// `hearth_gateway_pending`.
    pub pending: Gauge,
    /// `hearth_gateway_demand`.
    pub demand: Gauge,
    /// `hearth_gateway_demand_total`, set at scrape time.
    pub demand_total: Family<Vec<(String, String)>, Gauge<i64, AtomicI64>>,
    /// `hearth_gateway_requests_total{code}`.
    pub requests: Family<CodeLabel, Counter>,
    /// `hearth_gateway_requests_canceled_total`.
    pub canceled: Counter,
    /// `hearth_gateway_rejections_total{reason}`.
    pub rejections: Family<ReasonLabel, Counter>,
    /// `hearth_gateway_activation_wait_seconds`.
    pub activation_wait: Histogram,
    /// `hearth_gateway_upstream_latency_seconds`.
    pub upstream_latency: Histogram,
    /// `hearth_gateway_time_to_first_token_seconds`.
    pub ttft: Histogram,
    /// `hearth_gateway_upstream_errors_total{kind}`.
    pub upstream_errors: Family<KindLabel, Counter>,
    /// `hearth_gateway_scaler_streams`.
    pub scaler_streams: Gauge,
    /// `hearth_gateway_activation_events_total`.
    pub activation_events: Counter,
    /// `hearth_gateway_backend_endpoints`.
    pub backend_endpoints: Gauge,
    /// `hearth_gateway_request_body_bytes`.
    pub request_body_bytes: Gauge,
    /// `hearth_gateway_backends_sleeping`.
    pub backends_sleeping: Gauge,
    /// `hearth_gateway_engine_calls_total{call,result}`.
    pub engine_calls: Family<EngineCallLabel, Counter>,
    /// `hearth_activation_phase_seconds{phase}`.
    pub activation_phases: Family<PhaseLabel, Histogram, fn() -> Histogram>,
    /// Makes [`Metrics::encode_with_total`] one step for concurrent scrapes.
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
        let pending = Gauge::default();
        let demand = Gauge::default();
        let demand_total = Family::default();
        let requests = Family::default();
        let canceled = Counter::default();
        let rejections = Family::default();
        // 1 ms .. ~9 min.
        let activation_wait = Histogram::new(exponential_buckets(0.001, 2.0, 20));
        // 0.1 ms .. ~52 s.
        let upstream_latency = Histogram::new(exponential_buckets(0.0001, 2.0, 20));
        let ttft = Histogram::new(exponential_buckets(0.001, 2.0, 20));
        let upstream_errors = Family::default();
        let scaler_streams = Gauge::default();
        let activation_events = Counter::default();
        let backend_endpoints = Gauge::default();
        let request_body_bytes = Gauge::default();
        let backends_sleeping = Gauge::default();
        let engine_calls = Family::default();
        let activation_phases: Family<PhaseLabel, Histogram, fn() -> Histogram> =
            Family::new_with_constructor(activation_histogram);
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
        Self {
            registry,
            pending,
            demand,
            demand_total,
            requests,
            canceled,
            rejections,
            activation_wait,
            upstream_latency,
            ttft,
            upstream_errors,
            scaler_streams,
            activation_events,
            backend_endpoints,
            request_body_bytes,
            backends_sleeping,
            engine_calls,
            activation_phases,
            scrape: Mutex::new(()),
        }
    }

    /// The `demand_to_ready` series of `hearth_activation_phase_seconds`, for the lease.
    pub fn demand_to_ready(&self) -> Histogram {
        self.activation_phases
            .get_or_create(&PhaseLabel {
                phase: "demand_to_ready",
            })
            .clone()
    }

    /// Counts a finished request by status code.
    pub fn finished(&self, code: u16) {
        self.requests.get_or_create(&CodeLabel { code }).inc();
    }

    /// Counts a refusal by the gateway.
    pub fn rejected(&self, reason: &'static str) {
        self.rejections.get_or_create(&ReasonLabel { reason }).inc();
    }

    /// Counts a backend failure.
    pub fn upstream_error(&self, kind: &'static str) {
        self.upstream_errors
            .get_or_create(&KindLabel { kind })
            .inc();
    }

    /// Counts a call to the engine's sleep API.
    pub fn engine_call(&self, call: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.engine_calls
            .get_or_create(&EngineCallLabel { call, result })
            .inc();
    }

    /// Records that activation phase `phase` took `seconds`.
    pub fn observe_phase(&self, phase: &'static str, seconds: f64) {
        self.activation_phases
            .get_or_create(&PhaseLabel { phase })
            .observe(seconds);
    }

    /// Sets `hearth_gateway_demand_total` to `total` (absent when `None`) and encodes, as one
    /// step. Clearing and setting the shared family around [`Metrics::encode`] instead lets a
    /// concurrent scrape encode between another's clear and set, and miss a known total.
    pub fn encode_with_total(&self, total: Option<i64>) -> String {
        let _one_at_a_time = self.scrape.lock().unwrap_or_else(|e| e.into_inner());
        self.demand_total.clear();
        if let Some(t) = total {
            self.demand_total.get_or_create(&Vec::new()).set(t);
        }
        self.encode()
    }

    /// The text exposition format (Prometheus `text/plain; version=0.0.4` compatible
    /// OpenMetrics text).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// Histogram of one activation phase: 1 ms .. ~35 min, as the controller's phases under the
/// same name.
fn activation_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 22))
}

//! The gateway's runtime settings (built from the command line by [`crate::cli`], or directly by
//! tests and benchmarks).

use std::time::Duration;

/// What a request that finds no ready backend gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ColdStartMode {
    /// Hold the request until a backend is ready: a streaming request gets `200` and an SSE
    /// comment line every heartbeat interval, a non-streaming one waits silently.
    #[default]
    Keepalive,
    /// Answer `503 Service Unavailable` with `Retry-After` at once (demand is still raised).
    Reject,
}

/// Settings of one gateway replica.
///
/// The replica-wide settings apply in both modes. The per-model ones (`served_model_names`,
/// `max_queue`, `cold_start`, `heartbeat_interval`, `activation_timeout`, `metric_target`,
/// `sleep`, `service_key`) describe the one model of a single-service gateway
/// ([`crate::Gateway::new`], see [`ModelConfig::single`]); a shared gateway
/// ([`crate::Gateway::new_shared`]) takes them from each model's route instead and ignores
/// these.
#[derive(Debug, Clone)]
pub struct GatewayConfig {
    /// The single-service gateway's `service` label and KEDA key, `<namespace>/<name>` of its
    /// LLMService (`--service-key`); `None`: unknown (series without `service`, and KEDA's
    /// `service` parameter, when given, is not checked).
    pub service_key: Option<String>,
    /// Model names clients may use (`--served-model-name`). When non-empty, `GET /v1/models`
    /// is answered by the gateway while no backend is ready, and a request naming another
    /// model gets 404 without waking a backend. Empty: every request is forwarded.
    pub served_model_names: Vec<String>,
    /// More names clients may send in `model` (`--model-alias`, the LLMService's
    /// `spec.model.aliases`): answered like the served names, cold or warm, and forwarded with
    /// `model` set to the first served name (the engine serves only that).
    pub model_aliases: Vec<String>,
    /// Requests admitted at once (held + in flight); beyond it, 429 with `Retry-After`.
    pub max_queue: u64,
    /// Cold-start behaviour.
    pub cold_start: ColdStartMode,
    /// Interval between SSE comment lines while a streaming request is held.
    pub heartbeat_interval: Duration,
    /// How long a request may wait for a ready backend.
    pub activation_timeout: Duration,
    /// How long demand stays raised after a backend turned ready.
    pub activation_grace: Duration,
    /// After SIGTERM, how long in-flight requests may take before the gateway exits.
    pub drain_timeout: Duration,
    /// Largest request body accepted, in bytes; larger gets 413.
    pub body_limit: usize,
    /// Request-body bytes the replica holds at once (being read, or kept to forward); a request
    /// that would pass it gets `503` (see [`crate::budget`]). At least `body_limit`.
    pub body_memory_limit: usize,
    /// `Retry-After` sent with 429 and 503.
    pub retry_after: Duration,
    /// The metric name served to KEDA (`GetMetricSpec`, `GetMetrics`).
    pub metric_name: String,
    /// Target demand per backend replica (`targetSizeFloat`), unless the ScaledObject trigger
    /// metadata sets `targetSize`.
    pub metric_target: f64,
    /// Demand is summed over peer gateway replicas (see [`crate::peers`]).
    pub aggregate_peers: bool,
    /// Timeout for establishing a TCP connection to a backend endpoint.
    pub connect_timeout: Duration,
    /// How long a client connection may take to send a request's header section, and how long
    /// a keep-alive connection may sit idle between requests, before it is closed (slow-client
    /// protection). Enforced to within one second (see [`crate::timer`]).
    pub header_read_timeout: Duration,
    /// How long a client may take to send a request's body once its header section arrived;
    /// then `408` and the connection is closed. The body is read whole before forwarding, so
    /// this bounds how long a slow or stalled upload keeps its connection and up to
    /// `body_limit` bytes of the body budget. Enforced to within one second (see
    /// [`crate::timer`]).
    pub body_read_timeout: Duration,
    /// How long an unused backend connection is kept for reuse. Keep it below the backend's
    /// own keep-alive timeout (vLLM's uvicorn: 5 s) so the gateway never sends a request on a
    /// connection the backend is closing at that moment.
    pub backend_idle_timeout: Duration,
    /// Interval of HTTP/2 PINGs on ExternalScaler connections, and how long a PING may go
    /// unanswered before the connection is closed: a KEDA connection that died without closing
    /// (its node lost, say) releases its push stream instead of holding it until TCP gives up.
    pub scaler_keepalive: Duration,
    /// The sleeping tier (see [`crate::sleep`]): idle engines are put to sleep and woken on
    /// demand. `None`: engines are never put to sleep.
    pub sleep: Option<crate::sleep::SleepConfig>,
    /// Requests in flight per ready backend replica (`--container-concurrency`); the rest wait
    /// in the model's fair queue ([`crate::fair`]).
    pub container_concurrency: u32,
    /// The tenants (`--tenant`), replica-wide: bands, quotas and key files.
    pub tenants: crate::tenants::Tenants,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            service_key: None,
            served_model_names: Vec::new(),
            model_aliases: Vec::new(),
            max_queue: 1000,
            cold_start: ColdStartMode::Keepalive,
            heartbeat_interval: Duration::from_secs(5),
            activation_timeout: Duration::from_secs(300),
            activation_grace: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(60),
            body_limit: 8 * 1024 * 1024,
            body_memory_limit: crate::budget::DEFAULT_LIMIT,
            retry_after: Duration::from_secs(5),
            metric_name: "hearth_queue_depth".into(),
            metric_target: 1.0,
            aggregate_peers: false,
            connect_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(30),
            body_read_timeout: Duration::from_secs(60),
            backend_idle_timeout: Duration::from_secs(4),
            scaler_keepalive: Duration::from_secs(30),
            sleep: None,
            container_concurrency: crate::fair::DEFAULT_CONTAINER_CONCURRENCY,
            tenants: crate::tenants::Tenants::default(),
        }
    }
}

/// The settings of one model: a single-service gateway's flags, or one entry of a shared
/// gateway's route table.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// `<namespace>/<name>` of the LLMService: the `service` label and the KEDA key; empty when
    /// unknown (a single-service gateway without `--service-key`).
    pub key: String,
    /// Names clients send in `model`. A shared gateway routes by the first (its route's
    /// `model`); a single-service gateway checks a cold request's `model` against them (empty:
    /// not checked).
    pub served_model_names: Vec<String>,
    /// More names clients may send in `model` for this model: routed and checked like its
    /// served names, and forwarded with `model` set to the first served name.
    pub aliases: Vec<String>,
    /// Requests admitted at once (held + in flight); beyond it, 429 with `Retry-After`.
    pub max_queue: u64,
    /// Cold-start behaviour.
    pub cold_start: ColdStartMode,
    /// Interval between SSE comment lines while a streaming request is held.
    pub heartbeat_interval: Duration,
    /// How long a request may wait for a ready backend.
    pub activation_timeout: Duration,
    /// Target demand per backend replica (KEDA's `targetSizeFloat`), unless the ScaledObject
    /// trigger metadata sets `targetSize`.
    pub metric_target: f64,
    /// The last activation's duration known from outside the gateway (the LLMService's
    /// `status.lastActivation`), shown in `/v1/models` until the gateway measured one.
    pub last_activation: Option<Duration>,
    /// The sleeping tier, when on.
    pub sleep: Option<crate::sleep::SleepConfig>,
    /// Requests in flight per ready backend replica; the rest wait in the fair queue.
    pub container_concurrency: u32,
}

impl ModelConfig {
    /// The one model of a single-service gateway configured by `cfg`.
    pub fn single(cfg: &GatewayConfig) -> Self {
        Self {
            key: cfg.service_key.clone().unwrap_or_default(),
            served_model_names: cfg.served_model_names.clone(),
            aliases: cfg.model_aliases.clone(),
            max_queue: cfg.max_queue,
            cold_start: cfg.cold_start,
            heartbeat_interval: cfg.heartbeat_interval,
            activation_timeout: cfg.activation_timeout,
            metric_target: cfg.metric_target,
            last_activation: None,
            sleep: cfg.sleep.clone(),
            container_concurrency: cfg.container_concurrency,
        }
    }
}

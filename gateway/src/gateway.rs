//! One gateway replica: shared state, the HTTP router and server loop, drain.
//!
//! HTTP endpoints of the gateway itself. On the client port (`--listen`; everything else there
//! is proxied to the backend, and an admin path is `404` naming the admin port):
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /healthz` | `200` while the process runs (liveness) |
//! | `GET /readyz` | `200`, or `503` once draining (readiness) |
//!
//! On the admin port (`--admin-listen`), each request let in by its bearer token's scope
//! ([`crate::admin`]; `401`/`403` otherwise):
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /hearth/queue` | `{"pending": N}`: total demand over all replicas (KEDA `metrics-api`); `503` with an error while the total is unknown |
//! | `GET /hearth/queue/local` | this replica's demand only (what KEDA's `aggregateFromKubeServiceEndpoints` sums; KEDA drops a URL's query there, so the path says it), and `idleSeconds`: since its last request finished, 0 while it has demand (the controller's device handover reads both) |
//! | `GET /hearth/queue/<namespace>/<name>[/local]` | the same for one model of a shared gateway (required there: `/hearth/queue` is `400`; `404` for a service not in the table) |
//! | `GET /hearth/queue?scope=local&service=<namespace>/<name>` | the query forms of the above, for clients that keep the query |
//! | `GET /hearth/local-demand` | internal: newline-delimited `{"demand": N}` (a shared gateway: `{"demand": {"<namespace>/<name>": N, ...}}`) on every change of this replica's demand, for peer replicas |
//! | `GET /metrics` | Prometheus text |
//! | `GET /hearth/quota-usage` | internal: `{"instance", "tenants": {"<tenant>": [requests, tokens]}}`, this replica's usage so far, read by its peers to share the tenants' quotas ([`crate::quota`]) |
//! | `GET /hearth/metering` | internal, for the controller: per service, each tenant's requests, tokens and cold arrivals so far, and each discovered backend endpoint with whether it serves and its busy seconds ([`hearth_crds::metering`]) |
//! | `GET /hearth/adapter-failures` | internal, for the controller: the last failed load of each LoRA adapter on each engine, not followed by a successful one ([`hearth_crds::llmadapter::AdapterFailures`]; a shared gateway: every model's, `service` naming each, `?service=<namespace>/<name>` one model's, `404` for a service not in the table) |
//!
//! A replica serves one model ([`Gateway::new`]: a single-service gateway) or the models of a
//! route table ([`Gateway::new_shared`], [`Gateway::apply_routes`]: a shared gateway, which
//! also answers `GET /v1/models` itself); either way each model has the state of
//! [`crate::model`], and what is shared by all lives here.

use std::{
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use axum::{
    Router,
    extract::{Path, Query, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use futures::future::Either;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::{net::TcpListener, sync::watch};
use tower_service::Service;

use hearth_crds::{llmadapter::AdapterTable, llmendpoint::RouteTable};

use crate::{
    adapters::{AdapterTableError, AdaptersApplied},
    apikeys::ApiKeys,
    config::{GatewayConfig, ModelConfig},
    demand::DemandHub,
    endpoints::EndpointSet,
    metrics::{Metrics, ModelMetrics, ScrapeModel},
    model::{Model, ModelState, StateParts},
    peers,
    proxy::{self, ClientAddr},
    routes::{BackendSource, Routes, RoutesApplied, RoutesError, SelectError},
    scaler::Scaler,
    timer::CoarseTimer,
    upstream::UpstreamPool,
};

/// The paths the client port answers itself: the kubelet's probes. Everything else there is
/// proxied, except the admin paths ([`is_admin_path`]), answered `404` naming the admin port.
pub const CLIENT_PATHS: [&str; 2] = ["/healthz", "/readyz"];

/// The admin paths with a fixed name (see the module table), served on the admin port only;
/// the `/hearth/queue/...` forms are admin paths too ([`is_admin_path`]).
pub const ADMIN_PATHS: [&str; 6] = [
    "/hearth/queue",
    "/hearth/local-demand",
    "/metrics",
    crate::quota::USAGE_PATH,
    hearth_crds::metering::METERING_PATH,
    hearth_crds::llmadapter::ADAPTER_FAILURES_PATH,
];

/// `/hearth/queue/local`: this replica's demand only (one model's:
/// `/hearth/queue/<namespace>/<name>/local`). In the path, not the query, because KEDA's
/// `metrics-api` with `aggregateFromKubeServiceEndpoints` asks each endpoint for the URL's path
/// and drops its query.
pub const QUEUE_LOCAL_PATH: &str = "/hearth/queue/local";

/// Whether `path` is served on the admin port: [`ADMIN_PATHS`] and the `/hearth/queue/...`
/// forms ([`hearth_crds::admin::is_queue_path`]).
pub fn is_admin_path(path: &str) -> bool {
    ADMIN_PATHS.contains(&path) || hearth_crds::admin::is_queue_path(path)
}

/// Whether the client port answers `path` itself ([`CLIENT_PATHS`], and a `404` for an admin
/// path, also in disguise: [`names_admin_path`]) instead of proxying it.
pub fn is_own_path(path: &str) -> bool {
    CLIENT_PATHS.contains(&path) || names_admin_path(path)
}

/// Whether `path` names an admin path as the backend may read it: as written, or once
/// percent-decoded with empty and `.` segments dropped and `..` resolved (`/metrics/`,
/// `//metrics`, `/%6Detrics`, `/x/../metrics`). The client port refuses such a path rather
/// than proxy it: an engine that normalizes paths would otherwise serve its own `/metrics`.
/// Paths without `%`, `//`, `/.` or a trailing `/` are checked as written, without allocating.
pub fn names_admin_path(path: &str) -> bool {
    if is_admin_path(path) {
        return true;
    }
    let disguised =
        path.contains('%') || path.contains("//") || path.contains("/.") || path.ends_with('/');
    disguised && is_admin_path(&normalized(path))
}

/// `path` percent-decoded (an encoded `/` counts as one), its empty and `.` segments dropped
/// and `..` resolved, as `/a/b`.
fn normalized(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: Option<&u8>| b.and_then(|b| char::from(*b).to_digit(16));
        match (bytes[i], hex(bytes.get(i + 1)), hex(bytes.get(i + 2))) {
            (b'%', Some(h), Some(l)) => {
                decoded.push((h * 16 + l) as u8);
                i += 3;
            }
            (b, _, _) => {
                decoded.push(b);
                i += 1;
            }
        }
    }
    let decoded = String::from_utf8_lossy(&decoded);
    format!("/{}", hearth_crds::path::segments(&decoded).join("/"))
}

/// State shared by all handlers of one replica.
#[derive(Debug)]
pub struct Shared {
    pub(crate) cfg: GatewayConfig,
    /// The models: one (single-service), or the route table's (shared).
    pub(crate) routes: Arc<Routes>,
    /// The model of a single-service gateway; `None` in shared mode.
    pub(crate) single: Option<Arc<Model>>,
    /// Every request this replica admitted (single-service: the model's own hub; shared: one
    /// counting the requests of every model), for drain.
    pub(crate) admitted: DemandHub,
    /// The series requests count in until routed to a model (single-service: the model's;
    /// shared: the unlabelled ones).
    pub(crate) unrouted: Arc<ModelMetrics>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) keys: ApiKeys,
    /// The tenants' quotas (see [`crate::quota`]).
    pub(crate) quotas: Arc<crate::quota::Quotas>,
    pub(crate) pool: UpstreamPool,
    /// Request-body bytes held (see [`crate::budget`]).
    pub(crate) budget: crate::budget::BodyBudget,
    /// The `Via` this replica adds (see [`proxy::Via`]).
    pub(crate) via: proxy::Via,
    /// Every backend connection pool of this replica: the shared one and one per HTTP worker.
    pools: std::sync::Mutex<Vec<UpstreamPool>>,
    /// hyper's connection timeouts (see [`CoarseTimer`]).
    pub(crate) timer: CoarseTimer,
    /// What [`Gateway::backends`] returns in shared mode.
    no_backends: EndpointSet,
    draining: AtomicBool,
    stop_tx: watch::Sender<bool>,
}

impl Shared {
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }
}

/// A gateway replica. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Gateway {
    shared: Arc<Shared>,
}

#[cfg(test)]
impl Gateway {
    /// The replica's state, for the request path's unit tests.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

/// What every model's state is made with, and the replica-wide parts.
struct Parts {
    state: StateParts,
    pool: UpstreamPool,
    timer: CoarseTimer,
    budget: crate::budget::BodyBudget,
    via: proxy::Via,
}

impl Parts {
    fn new(cfg: &GatewayConfig, instance: u64, shared: bool) -> std::io::Result<Self> {
        let metrics = Arc::new(Metrics::new());
        let pool = UpstreamPool::new(cfg.connect_timeout, cfg.backend_idle_timeout);
        Ok(Self {
            state: StateParts {
                instance,
                aggregate: cfg.aggregate_peers,
                grace: cfg.activation_grace,
                metrics,
                pool: pool.clone(),
                rises: shared.then(|| Arc::new(watch::channel(0).0)),
                gateways: Arc::new(std::sync::atomic::AtomicUsize::new(1)),
                tenants: cfg.tenants.iter().count() > 1,
            },
            pool,
            timer: CoarseTimer::new()?,
            budget: crate::budget::BodyBudget::new(cfg.body_memory_limit),
            via: proxy::Via::new(instance),
        })
    }
}

impl Gateway {
    /// A single-service replica: one model, configured by `cfg`'s per-model settings
    /// ([`ModelConfig::single`]), forwarding to `backends` (with the sleeping tier on, to the
    /// awake engines among them), checking `keys`. Background work (the activation lease, key
    /// reloads) starts with [`Gateway::spawn_background`].
    ///
    /// # Errors
    /// The thread of the header-read timer could not start.
    pub fn new(cfg: GatewayConfig, backends: EndpointSet, keys: ApiKeys) -> std::io::Result<Self> {
        let model_cfg = ModelConfig::single(&cfg);
        let instance = crate::demand::random_instance();
        let parts = Parts::new(&cfg, instance, false)?;
        let state = ModelState::new(&model_cfg, backends, &parts.state);
        let model = Arc::new(Model {
            cfg: Arc::new(model_cfg),
            state: Arc::new(state),
            route: None,
        });
        let routes = Arc::new(Routes::single(model.clone(), parts.state.clone()));
        let admitted = model.state.demand.clone();
        let unrouted = model.state.metrics.clone();
        Ok(Self::assemble(
            cfg,
            keys,
            parts,
            routes,
            Some(model),
            admitted,
            unrouted,
        ))
    }

    /// A shared replica: no model until [`Gateway::apply_routes`] gives it a route table;
    /// each model's backends come from `source` ([`crate::routes::KubeBackends`] in a cluster;
    /// a function filling each model's [`EndpointSet`] in tests and benchmarks). The per-model
    /// settings of `cfg` are not used: each model's come from its route.
    ///
    /// # Errors
    /// The thread of the header-read timer could not start.
    pub fn new_shared(
        cfg: GatewayConfig,
        keys: ApiKeys,
        source: Arc<dyn BackendSource>,
    ) -> std::io::Result<Self> {
        let admitted = DemandHub::new(u64::MAX, false);
        let parts = Parts::new(&cfg, admitted.instance(), true)?;
        let routes = Arc::new(Routes::shared(source, parts.state.clone()));
        let unrouted = Arc::new(ModelMetrics::unrouted(parts.state.metrics.clone()));
        Ok(Self::assemble(
            cfg, keys, parts, routes, None, admitted, unrouted,
        ))
    }

    fn assemble(
        cfg: GatewayConfig,
        keys: ApiKeys,
        parts: Parts,
        routes: Arc<Routes>,
        single: Option<Arc<Model>>,
        admitted: DemandHub,
        unrouted: Arc<ModelMetrics>,
    ) -> Self {
        let quotas = Arc::new(crate::quota::Quotas::new(cfg.tenants.clone()));
        let _ = parts
            .state
            .metrics
            .tenant_names
            .set(cfg.tenants.iter().map(|(_, t)| t.name.clone()).collect());
        Self {
            shared: Arc::new(Shared {
                quotas,
                cfg,
                routes,
                single,
                admitted,
                unrouted,
                metrics: parts.state.metrics.clone(),
                keys,
                pools: std::sync::Mutex::new(vec![parts.pool.clone()]),
                budget: parts.budget,
                via: parts.via,
                pool: parts.pool,
                timer: parts.timer,
                no_backends: EndpointSet::new(),
                draining: AtomicBool::new(false),
                stop_tx: watch::channel(false).0,
            }),
        }
    }

    /// Applies a route table (shared mode; see [`crate::routes`]): models enter, change and
    /// leave as it says; requests already admitted for a model that left finish.
    ///
    /// # Errors
    /// A [`RoutesError`] naming the field at fault (the table in force stays, and the refusal
    /// is counted in `hearth_gateway_route_table_errors_total`), or
    /// [`RoutesError::SingleService`] on a single-service gateway.
    pub fn apply_routes(&self, table: &RouteTable) -> Result<RoutesApplied, RoutesError> {
        let applied = self.shared.routes.apply(table);
        if applied.is_err() && self.shared.routes.shared {
            self.shared.metrics.route_table_errors.inc();
        }
        applied
    }

    /// Parses `json` (a [`RouteTable`], as the routes ConfigMap holds it) and applies it.
    ///
    /// # Errors
    /// As [`Gateway::apply_routes`], and [`RoutesError::Json`] with the path of the value that
    /// does not parse.
    pub fn apply_routes_json(&self, json: &str) -> Result<RoutesApplied, RoutesError> {
        match crate::routes::parse_route_table(json) {
            Ok(table) => self.apply_routes(&table),
            Err(e) => {
                self.shared.metrics.route_table_errors.inc();
                Err(e)
            }
        }
    }

    /// Applies an adapter table to a single-service gateway's model (see [`crate::adapters`]):
    /// its adapters are served from now on, each routed to the model; an adapter named like a
    /// served model name is left out (the model wins) and logged. A shared gateway's models
    /// take theirs from the route table.
    ///
    /// # Errors
    /// An [`AdapterTableError`] naming the field at fault (the table in force stays, and the
    /// refusal is counted in `hearth_gateway_adapter_table_errors_total`), or
    /// [`AdapterTableError::Shared`] on a shared gateway.
    pub fn apply_adapters(
        &self,
        table: &AdapterTable,
    ) -> Result<AdaptersApplied, AdapterTableError> {
        let Some(model) = &self.shared.single else {
            return Err(AdapterTableError::Shared);
        };
        if let Err(e) = crate::adapters::check(table) {
            self.shared.metrics.adapter_table_errors.inc();
            return Err(e);
        }
        // An adapter named like the model (a served name or an alias) is left out.
        let (catalog, left_out) =
            crate::adapters::catalog_for(table, model.key(), |n| model.answers_to(n));
        let adapters = catalog
            .adapters()
            .iter()
            .map(|a| a.name.to_string())
            .collect();
        model.state.adapters.set_catalog(catalog);
        Ok(AdaptersApplied { adapters, left_out })
    }

    /// Parses `json` (an [`AdapterTable`], as the adapters ConfigMap holds it) and applies it.
    ///
    /// # Errors
    /// As [`Gateway::apply_adapters`], and [`AdapterTableError::Json`] with the path of the
    /// value that does not parse.
    pub fn apply_adapters_json(&self, json: &str) -> Result<AdaptersApplied, AdapterTableError> {
        if self.shared.single.is_none() {
            return Err(AdapterTableError::Shared);
        }
        match crate::adapters::parse_adapter_table(json) {
            Ok(table) => self.apply_adapters(&table),
            Err(e) => {
                self.shared.metrics.adapter_table_errors.inc();
                Err(e)
            }
        }
    }

    /// Serves no adapters from now on (single-service; the adapters ConfigMap is missing).
    pub fn clear_adapters(&self) {
        if let Some(model) = &self.shared.single {
            model
                .state
                .adapters
                .set_catalog(crate::adapters::Catalog::default());
        }
    }

    /// Whether this replica is a shared gateway (routes by `model`).
    pub fn is_shared(&self) -> bool {
        self.shared.routes.shared
    }

    /// The model of service `key` (`<namespace>/<name>`); a single-service gateway's for its
    /// own key (or any, when it does not know it).
    pub fn model(&self, key: &str) -> Option<Arc<Model>> {
        self.shared.routes.select(Some(key)).ok()
    }

    /// The model clients call `name` (shared mode), or the single-service gateway's model.
    pub fn model_named(&self, name: &str) -> Option<Arc<Model>> {
        match &self.shared.single {
            Some(m) => Some(m.clone()),
            None => self.shared.routes.load().by_name(name).cloned(),
        }
    }

    /// Every model, sorted by name.
    pub fn models(&self) -> Vec<Arc<Model>> {
        self.shared.routes.load().models().to_vec()
    }

    /// Where peer replicas' demand goes ([`crate::peers::PeerSet::new`]): the model's hub of a
    /// single-service gateway, the route table of a shared one.
    pub fn peer_sink(&self) -> Arc<dyn crate::peers::PeerSink> {
        match &self.shared.single {
            Some(m) => Arc::new(m.state.demand.clone()),
            None => self.shared.routes.clone(),
        }
    }

    /// Sets how many gateway replicas there are (`peers` others and this one): every model's
    /// fair queue takes its share of the in-flight bound ([`crate::fair`]).
    pub fn set_peer_count(&self, peers: usize) {
        self.shared
            .routes
            .parts()
            .gateways
            .store(peers + 1, std::sync::atomic::Ordering::Relaxed);
        for m in self.shared.routes.load().models() {
            m.state.fair.refresh();
        }
    }

    /// The tenants' quotas, shared with peer replicas by [`crate::quota::sync_peers`].
    pub fn quotas(&self) -> Arc<crate::quota::Quotas> {
        self.shared.quotas.clone()
    }

    /// This replica's instance, in hex as its peers see it (see [`DemandHub::instance`]).
    pub fn instance(&self) -> String {
        format!("{:016x}", self.shared.admitted.instance())
    }

    /// The settings.
    pub fn config(&self) -> &GatewayConfig {
        &self.shared.cfg
    }

    /// The backend endpoints requests go to (with the sleeping tier on, the awake engines) of
    /// a single-service gateway; an empty set for a shared one (see [`Gateway::model`]).
    pub fn backends(&self) -> &EndpointSet {
        match &self.shared.single {
            Some(m) => &m.state.backends,
            None => &self.shared.no_backends,
        }
    }

    /// The demand counters of a single-service gateway's model. For a shared gateway, a hub
    /// counting every request admitted for any model (no lease, no peers; each model's own is
    /// [`Model::demand`]).
    pub fn demand(&self) -> &DemandHub {
        &self.shared.admitted
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Reports the sleeping tier's engine sleeps and wake-ups on the LLMService (Events and
    /// `status.lastWake`) through `reporter` (single-service; no effect without a tier, or
    /// once the background work started). A shared gateway's models report through their
    /// [`BackendSource`].
    pub fn report_to(&self, reporter: crate::sleep::ServiceReporter) {
        if let Some(m) = &self.shared.single {
            m.state.report_to(reporter);
        }
    }

    /// Starts every model's background work (the lease expiry, the sleeping tier when on, a
    /// shared gateway's backend discovery), the idle connection eviction and API key reloads;
    /// they stop when the runtime does. Models added later start as they are added.
    pub fn spawn_background(&self, key_reload_interval: Duration) {
        self.shared.routes.start();
        let shared = Arc::downgrade(&self.shared);
        tokio::spawn(async move {
            // Idle backend connections of every pool are closed from here, so the HTTP workers
            // keep no timer of their own (see `timer`).
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(shared) = shared.upgrade() else {
                    return;
                };
                let pools = shared
                    .pools
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                for pool in pools {
                    pool.evict_idle();
                }
            }
        });
        tokio::spawn(self.shared.keys.clone().watch(key_reload_interval));
    }

    /// The client port's routes: the probes ([`CLIENT_PATHS`]), a `404` for the admin paths,
    /// everything else proxied. A [`ClientAddr`] request extension, when present, is appended
    /// to `X-Forwarded-For`.
    pub fn router(&self) -> Router {
        let [healthz, readyz_path] = CLIENT_PATHS;
        let elsewhere = || async { admin_port_only() };
        let mut router = Router::new()
            .route(healthz, get(|| async { "ok" }))
            .route(readyz_path, get(readyz))
            .route("/hearth/queue/{*rest}", get(elsewhere));
        for path in ADMIN_PATHS {
            router = router.route(path, get(elsewhere));
        }
        router
            .method_not_allowed_fallback(own_endpoints_are_read_only)
            .fallback(
                |State(shared): State<Arc<Shared>>, req: axum::extract::Request| async move {
                    if names_admin_path(req.uri().path()) {
                        return admin_port_only();
                    }
                    let peer_ip = req
                        .extensions()
                        .get::<ClientAddr>()
                        .and_then(|a| proxy::peer_ip_value(a.0));
                    proxy::proxy(shared, req, peer_ip).await
                },
            )
            .with_state(self.shared.clone())
    }

    /// The admin port's routes ([`ADMIN_PATHS`] and the `/hearth/queue/...` forms), each
    /// request let in by `auth` ([`crate::admin::require`]); any other path is `404`.
    pub fn admin_router(&self, auth: crate::admin::AdminAuth) -> Router {
        let [
            queue_path,
            local_demand_path,
            metrics_path,
            usage_path,
            metering_path,
            adapter_failures_path,
        ] = ADMIN_PATHS;
        Router::new()
            .route(queue_path, get(queue))
            .route(QUEUE_LOCAL_PATH, get(queue_local))
            .route("/hearth/queue/{namespace}/{service}", get(queue_service))
            .route(
                "/hearth/queue/{namespace}/{service}/local",
                get(queue_service_local),
            )
            .route(local_demand_path, get(local_demand))
            .route(metrics_path, get(metrics))
            .route(usage_path, get(quota_usage))
            .route(metering_path, get(metering))
            .route(adapter_failures_path, get(adapter_failures))
            .method_not_allowed_fallback(own_endpoints_are_read_only)
            .route_layer(axum::middleware::from_fn_with_state(
                auth,
                crate::admin::require,
            ))
            .with_state(self.shared.clone())
    }

    /// The KEDA ExternalScaler gRPC service of this replica.
    pub fn scaler(&self) -> Scaler {
        Scaler::new(
            self.shared.routes.clone(),
            self.shared.metrics.clone(),
            self.shared.cfg.metric_name.clone(),
        )
    }

    /// Starts draining: readiness turns 503 and new requests get 503; in-flight requests go on.
    pub fn start_drain(&self) {
        self.shared.draining.store(true, Ordering::SeqCst);
    }

    /// Whether [`Gateway::start_drain`] was called.
    pub fn is_draining(&self) -> bool {
        self.shared.is_draining()
    }

    /// Drains: refuses new requests, waits until in-flight ones finish or the drain timeout
    /// passes, then tells the servers to stop. Returns the requests still pending.
    pub async fn drain(&self) -> u64 {
        self.start_drain();
        let left = self
            .shared
            .admitted
            .wait_idle(self.shared.cfg.drain_timeout)
            .await;
        self.shared.stop_tx.send_replace(true);
        left
    }

    /// Resolves once [`Gateway::drain`] has finished (or [`Gateway::stop`] was called).
    pub fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.shared.stop_tx.subscribe();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    /// Stops the servers now, without waiting for in-flight requests.
    pub fn stop(&self) {
        self.shared.stop_tx.send_replace(true);
    }

    /// Serves HTTP/1.1 on `listener` until [`Gateway::stopped`], then closes idle connections
    /// and gives busy ones one second to finish.
    ///
    /// # Errors
    /// None in practice: accept errors (e.g. out of file descriptors) are logged and retried.
    pub async fn serve_http(&self, listener: TcpListener) -> std::io::Result<()> {
        self.serve_router(listener, self.router(), true).await
    }

    /// Serves the admin port ([`Gateway::admin_router`]) on `listener` as
    /// [`Gateway::serve_http`] serves the client port, every request checked by `auth`.
    ///
    /// # Errors
    /// None in practice (see [`Gateway::serve_http`]).
    pub async fn serve_admin(
        &self,
        listener: TcpListener,
        auth: crate::admin::AdminAuth,
    ) -> std::io::Result<()> {
        self.serve_router(listener, self.admin_router(auth), false)
            .await
    }

    /// The accept loop of both ports: `router` answers its own paths; with `proxy`, every other
    /// path goes straight to the proxy.
    async fn serve_router(
        &self,
        listener: TcpListener,
        router: Router,
        proxy: bool,
    ) -> std::io::Result<()> {
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(self.shared.timer.clone())
            .header_read_timeout(self.shared.cfg.header_read_timeout)
            .keep_alive(true);
        let stopped = self.stopped();
        tokio::pin!(stopped);
        loop {
            let (stream, peer) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                },
                _ = &mut stopped => break,
            };
            let _ = stream.set_nodelay(true);
            let router = router.clone();
            let shared = self.shared.clone();
            let peer_ip = proxy::peer_ip_value(peer);
            // Proxied requests go straight to the proxy; the router (and its per-request body
            // boxing and route matching) serves only the gateway's own endpoints.
            let svc =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    if !proxy || is_own_path(req.uri().path()) {
                        let mut r = router.clone();
                        Either::Left(r.call(req))
                    } else {
                        let shared = shared.clone();
                        let peer_ip = peer_ip.clone();
                        // Boxed: hyper keeps room for the service's future for the whole
                        // connection, and the proxy's is ~2 KiB; a held stream outlives it.
                        Either::Right(Box::pin(async move {
                            Ok::<_, Infallible>(proxy::proxy(shared, req, peer_ip).await)
                        }))
                    }
                });
            let conn = builder.serve_connection(TokioIo::new(stream), svc);
            // Spawned as it is: wrapping it in `async move { conn.await }` would store the
            // connection future twice in the task (~1 KiB more per connection).
            drop(tokio::spawn(graceful.watch(conn)));
        }
        drop(listener);
        tokio::select! {
            _ = graceful.shutdown() => {}
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
        Ok(())
    }

    /// Serves HTTP/1.1 on `addr` with `workers` threads, each running a single-threaded tokio
    /// runtime with its own `SO_REUSEPORT` listener and its own backend connection pool (the
    /// kernel spreads connections over the listeners): a request, its backend connection and
    /// its response stay on one thread, as in nginx's worker model. Returns once every listener
    /// is bound; the threads run until [`Gateway::stopped`].
    ///
    /// # Errors
    /// The bind error of any listener, naming the address: e.g. the port is in use, also by
    /// another process's `SO_REUSEPORT` listeners.
    pub fn serve_http_workers(
        &self,
        addr: SocketAddr,
        workers: usize,
    ) -> std::io::Result<Vec<std::thread::JoinHandle<()>>> {
        // One plain bind first. With SO_REUSEPORT alone, a port another process already serves
        // would be shared with it, the kernel splitting connections between the two; this
        // fails instead. It also makes port 0 one port for every worker.
        let addr = hearth_net::bind(addr, hearth_net::ListenOptions::default())?.addr;
        let mut handles = Vec::new();
        for i in 0..workers.max(1) {
            let (tx, rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
            let gw = self.clone();
            let handle = std::thread::Builder::new()
                .name(format!("http-worker-{i}"))
                .spawn(move || {
                    let rt = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt,
                        Err(e) => {
                            let _ = tx.send(Err(e));
                            return;
                        }
                    };
                    rt.block_on(async move {
                        let listener = match reuseport_listener(addr) {
                            Ok(l) => l,
                            Err(e) => {
                                let _ = tx.send(Err(e));
                                return;
                            }
                        };
                        let pool = UpstreamPool::new(
                            gw.shared.cfg.connect_timeout,
                            gw.shared.cfg.backend_idle_timeout,
                        );
                        gw.shared
                            .pools
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .push(pool.clone());
                        proxy::install_worker_pool(pool);
                        let _ = tx.send(Ok(()));
                        let _ = gw.serve_http(listener).await;
                    });
                })?;
            match rx.recv() {
                Ok(Ok(())) => handles.push(handle),
                Ok(Err(e)) => return Err(e),
                Err(_) => return Err(std::io::Error::other("HTTP worker thread died at start")),
            }
        }
        Ok(handles)
    }

    /// Serves the ExternalScaler gRPC service on `listener` until [`Gateway::stopped`], with
    /// HTTP/2 keepalive PINGs every [`GatewayConfig::scaler_keepalive`].
    ///
    /// # Errors
    /// The transport error of the gRPC server.
    pub async fn serve_grpc(&self, listener: TcpListener) -> Result<(), tonic::transport::Error> {
        let incoming =
            tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
        self.grpc_server()
            .serve_with_incoming_shutdown(incoming, self.stopped())
            .await
    }

    /// [`Gateway::serve_grpc`] over mutual TLS: only clients whose certificate `tls`'s CA
    /// bundle signed get past the handshake (see [`crate::scaler_tls`]).
    ///
    /// # Errors
    /// The transport error of the gRPC server.
    pub async fn serve_grpc_tls(
        &self,
        listener: TcpListener,
        tls: std::sync::Arc<crate::scaler_tls::ScalerTls>,
    ) -> Result<(), tonic::transport::Error> {
        self.grpc_server()
            .serve_with_incoming_shutdown(tls.incoming(listener), self.stopped())
            .await
    }

    fn grpc_server(&self) -> tonic::transport::server::Router {
        let keepalive = self.shared.cfg.scaler_keepalive;
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(keepalive))
            .http2_keepalive_timeout(Some(keepalive))
            .add_service(crate::scaler::server(self.scaler()))
    }
}

/// A listener on `addr` with `SO_REUSEPORT`, backlog 4096 (`[::]` is dual-stack, see
/// `hearth_net`).
fn reuseport_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    hearth_net::listen(
        addr,
        hearth_net::ListenOptions {
            reuse_port: true,
            backlog: 4096,
        },
    )
}

/// A gateway serving on loopback ports in background tasks: for tests and benchmarks.
#[derive(Debug)]
pub struct RunningGateway {
    /// The replica.
    pub gateway: Gateway,
    /// HTTP address (the client port).
    pub http: SocketAddr,
    /// The admin port's address.
    pub admin: SocketAddr,
    /// ExternalScaler gRPC address.
    pub grpc: SocketAddr,
}

impl RunningGateway {
    /// `http://<http addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// `http://<admin addr>`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// `http://<grpc addr>`, for a tonic client.
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

/// Starts `gateway` on ephemeral ports of `ip` (HTTP, admin and gRPC) with its background
/// tasks; the admin port is open ([`crate::admin::AdminAuth::open`]).
///
/// # Errors
/// Bind errors.
pub async fn spawn(gateway: Gateway, ip: std::net::IpAddr) -> std::io::Result<RunningGateway> {
    spawn_with_admin(gateway, ip, crate::admin::AdminAuth::open()).await
}

/// [`spawn`], with the admin port checked by `auth`.
///
/// # Errors
/// Bind errors.
pub async fn spawn_with_admin(
    gateway: Gateway,
    ip: std::net::IpAddr,
    auth: crate::admin::AdminAuth,
) -> std::io::Result<RunningGateway> {
    let http_l = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let admin_l = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let grpc_l = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let http = http_l.local_addr()?;
    let admin = admin_l.local_addr()?;
    let grpc = grpc_l.local_addr()?;
    gateway.spawn_background(Duration::from_secs(1));
    let g = gateway.clone();
    tokio::spawn(async move { g.serve_http(http_l).await });
    let g = gateway.clone();
    tokio::spawn(async move { g.serve_admin(admin_l, auth).await });
    let g = gateway.clone();
    tokio::spawn(async move {
        if let Err(e) = g.serve_grpc(grpc_l).await {
            tracing::error!(error = %e, "gRPC server failed");
        }
    });
    Ok(RunningGateway {
        gateway,
        http,
        admin,
        grpc,
    })
}

/// The client port's `404` for an admin path (`code: admin_port`), naming the admin port.
fn admin_port_only() -> Response {
    crate::openai::error_response(
        StatusCode::NOT_FOUND,
        "this path is served on the gateway's admin port (--admin-listen, port name admin), not the client port",
        "invalid_request_error",
        Some("admin_port"),
    )
}

/// `405` for a method other than GET on the gateway's own endpoints (axum's would have an
/// empty body).
async fn own_endpoints_are_read_only() -> Response {
    let mut resp = crate::openai::error_response(
        StatusCode::METHOD_NOT_ALLOWED,
        "the gateway's own endpoints answer GET only",
        "invalid_request_error",
        Some("method_not_allowed"),
    );
    resp.headers_mut()
        .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
    resp
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    if shared.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
    } else {
        "ok".into_response()
    }
}

#[derive(Deserialize)]
struct QueueQuery {
    #[serde(default)]
    scope: Option<String>,
    #[serde(default)]
    service: Option<String>,
}

/// A `/hearth/queue` error: `status` and `{"error": message}`.
fn queue_error(status: StatusCode, message: String) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}

async fn queue(State(shared): State<Arc<Shared>>, Query(q): Query<QueueQuery>) -> Response {
    queue_answer(&shared, q.service.as_deref(), q.scope.as_deref())
}

async fn queue_local(State(shared): State<Arc<Shared>>, Query(q): Query<QueueQuery>) -> Response {
    queue_answer(&shared, q.service.as_deref(), Some("local"))
}

async fn queue_service(
    State(shared): State<Arc<Shared>>,
    Path((namespace, service)): Path<(String, String)>,
    Query(q): Query<QueueQuery>,
) -> Response {
    queue_answer(
        &shared,
        Some(&format!("{namespace}/{service}")),
        q.scope.as_deref(),
    )
}

async fn queue_service_local(
    State(shared): State<Arc<Shared>>,
    Path((namespace, service)): Path<(String, String)>,
) -> Response {
    queue_answer(
        &shared,
        Some(&format!("{namespace}/{service}")),
        Some("local"),
    )
}

/// `{"pending": N}` of model `service` (`<namespace>/<name>`; `None`: the only one of a
/// single-service gateway) in `scope` (`total`, the default, or `local`).
fn queue_answer(shared: &Shared, service: Option<&str>, scope: Option<&str>) -> Response {
    let model = match shared.routes.select(service) {
        Ok(m) => m,
        Err(SelectError::Missing) => {
            return queue_error(
                StatusCode::BAD_REQUEST,
                "missing service: this gateway serves several models; ask for one with /hearth/queue/<namespace>/<name> of its LLMService".to_owned(),
            );
        }
        Err(SelectError::Unknown(service)) => {
            return queue_error(
                StatusCode::NOT_FOUND,
                format!(
                    "service {service:?} is not served by this gateway (not in its route table)"
                ),
            );
        }
    };
    let state = model.demand_state();
    let value = match scope {
        None | Some("total") => state.total(),
        Some("local") => {
            let idle = model.state.demand.idle().as_secs_f64();
            return axum::Json(serde_json::json!({"pending": state.local(), "idleSeconds": idle}))
                .into_response();
        }
        Some(other) => {
            return queue_error(
                StatusCode::BAD_REQUEST,
                format!("unknown scope {other:?}: use scope=total (default) or scope=local"),
            );
        }
    };
    match value {
        Ok(n) => axum::Json(serde_json::json!({"pending": n})).into_response(),
        Err(e) => queue_error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

async fn local_demand(State(shared): State<Arc<Shared>>) -> Response {
    let stop = shared.stop_tx.subscribe();
    match &shared.single {
        Some(model) => peers::local_demand_stream(model.state.demand.subscribe(), stop),
        None => peers::demand_stream(
            crate::routes::TableFeed::new(shared.routes.clone()),
            shared.admitted.instance(),
            stop,
        ),
    }
}

/// `/hearth/quota-usage`: this replica's usage so far, per tenant ([`crate::quota`]).
async fn quota_usage(State(shared): State<Arc<Shared>>) -> Response {
    let report = crate::quota::UsageReport {
        instance: format!("{:016x}", shared.admitted.instance()),
        tenants: shared.quotas.usage(),
    };
    axum::Json(report).into_response()
}

/// [`hearth_crds::metering::METERING_PATH`]: per service, its tenants' counts and its
/// discovered endpoints, each with whether it serves and its busy time here;
/// `?service=<namespace>/<name>` answers for that service only.
async fn metering(
    State(shared): State<Arc<Shared>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    use hearth_crds::metering::{EndpointMetering, MeteringReport, ServiceMetering};
    let only = query.as_deref().and_then(|q| {
        q.split('&')
            .find_map(|kv| kv.strip_prefix("service="))
            .map(|v| v.replace("%2F", "/").replace("%2f", "/"))
    });
    let now = std::time::Instant::now();
    let services = shared
        .routes
        .load()
        .models()
        .iter()
        .filter(|m| {
            only.as_deref()
                .is_none_or(|o| &**m.state.metrics.service() == o)
        })
        .map(|m| {
            let service = m.state.metrics.service();
            let serving = m.backends().snapshot();
            let endpoints = m
                .state
                .discovered()
                .snapshot()
                .iter()
                .map(|e| {
                    let awake = serving.iter().find(|s| s.authority() == e.authority());
                    EndpointMetering {
                        address: e.authority().to_string(),
                        serving: awake.is_some(),
                        busy_seconds: awake.map_or(0.0, |s| s.busy(now).as_secs_f64()),
                    }
                })
                .collect();
            ServiceMetering {
                service: service.to_string(),
                tenants: shared.metrics.metering(service),
                endpoints,
            }
        })
        .collect();
    axum::Json(MeteringReport {
        instance: format!("{:016x}", shared.admitted.instance()),
        services,
    })
    .into_response()
}

#[derive(Deserialize)]
struct FailuresQuery {
    #[serde(default)]
    service: Option<String>,
}

/// [`hearth_crds::llmadapter::ADAPTER_FAILURES_PATH`]: the failed adapter loads of every
/// model (`?service=<namespace>/<name>`: of that one; `404` with `{"error"}` for a service
/// this gateway does not serve), sorted by service, adapter and engine. A single-service
/// gateway leaves `service` empty.
async fn adapter_failures(
    State(shared): State<Arc<Shared>>,
    Query(q): Query<FailuresQuery>,
) -> Response {
    use hearth_crds::llmadapter::AdapterFailures;
    let models = match q.service.as_deref() {
        None => shared.routes.load().models().to_vec(),
        Some(service) => match shared.routes.select(Some(service)) {
            Ok(m) => vec![m],
            Err(_) => {
                return queue_error(
                    StatusCode::NOT_FOUND,
                    format!(
                        "service {service:?} is not served by this gateway (not in its route table)"
                    ),
                );
            }
        },
    };
    let mut failures = Vec::new();
    for m in models {
        let service = if shared.single.is_some() {
            String::new()
        } else {
            m.key().to_owned()
        };
        failures.extend(m.adapters().failures().into_iter().map(|mut f| {
            f.service.clone_from(&service);
            f
        }));
    }
    failures.sort_by(|a, b| {
        (&a.service, &a.adapter, &a.engine).cmp(&(&b.service, &b.adapter, &b.engine))
    });
    axum::Json(AdapterFailures { failures }).into_response()
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let models: Vec<ScrapeModel> = shared
        .routes
        .load()
        .models()
        .iter()
        .map(|m| {
            let state = m.demand_state();
            ScrapeModel {
                service: m.state.metrics.service().clone(),
                pending: state.pending(),
                local: state.local(),
                total: state.total().ok(),
                endpoints: m.backends().snapshot().len(),
            }
        })
        .collect();
    let m = &shared.metrics;
    m.request_body_bytes
        .set(i64::try_from(shared.budget.held()).unwrap_or(i64::MAX));
    let mut resp = m.encode_scrape(&models).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

#[cfg(test)]
mod path_tests {
    use super::*;

    #[test]
    fn admin_paths_are_recognised_in_disguise_and_others_are_not() {
        for (path, admin) in [
            ("/metrics", true),
            ("/metrics/", true),
            ("//metrics", true),
            ("/%6Detrics", true),
            ("/%6detrics", true),
            ("/./metrics", true),
            ("/x/../metrics", true),
            ("/metrics%2F", true),
            ("/hearth//queue", true),
            ("/hearth/%71ueue", true),
            ("/hearth/queue/", true),
            ("/hearth/queue%2F..%2F..%2Fhearth%2Fmetering", true),
            ("/v1/chat/completions", false),
            ("/v1/models/", false),
            ("/v1/metrics", false),
            ("/metricsx", false),
            ("/%zz/metrics", false),
            ("/health", false),
            ("/", false),
        ] {
            assert_eq!(names_admin_path(path), admin, "{path}");
        }
    }
}

//! One gateway replica: shared state, the HTTP router and server loop, drain.
//!
//! HTTP endpoints of the gateway itself (everything else is proxied to the backend):
//!
//! | endpoint | answer |
//! |---|---|
//! | `GET /healthz` | `200` while the process runs (liveness) |
//! | `GET /readyz` | `200`, or `503` once draining (readiness) |
//! | `GET /hearth/queue` | `{"pending": N}`: total demand over all replicas (KEDA `metrics-api`); `?scope=local` for this replica only (with KEDA's `aggregateFromKubeServiceEndpoints`); `503` with an error while the total is unknown |
//! | `GET /hearth/local-demand` | internal: newline-delimited `{"demand": N}` on every change of this replica's demand, for peer replicas |
//! | `GET /metrics` | Prometheus text |

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
    extract::{Query, State},
    http::{HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::get,
};
use futures::future::Either;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::{net::TcpListener, sync::watch};
use tower_service::Service;

use crate::{
    apikeys::ApiKeys,
    config::GatewayConfig,
    demand::{DemandHub, Lease},
    endpoints::EndpointSet,
    metrics::Metrics,
    peers,
    proxy::{self, ClientAddr},
    scaler::Scaler,
    timer::CoarseTimer,
    upstream::UpstreamPool,
};

/// The paths the gateway answers itself (see the module table); every other path is proxied.
pub const OWN_PATHS: [&str; 5] = [
    "/healthz",
    "/readyz",
    "/hearth/queue",
    "/hearth/local-demand",
    "/metrics",
];

/// State shared by all handlers of one replica.
#[derive(Debug)]
pub struct Shared {
    pub(crate) cfg: GatewayConfig,
    pub(crate) backends: EndpointSet,
    pub(crate) demand: DemandHub,
    pub(crate) lease: Lease,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) keys: ApiKeys,
    pub(crate) pool: UpstreamPool,
    /// The sleeping tier's handle, when it is on.
    pub(crate) sleep: Option<crate::sleep::SleepTier>,
    /// The sleeping tier's task, until [`Gateway::spawn_background`] starts it.
    sleep_task: std::sync::Mutex<Option<crate::sleep::SleepTask>>,
    /// Request-body bytes held (see [`crate::budget`]).
    pub(crate) budget: crate::budget::BodyBudget,
    /// The `Via` this replica adds (see [`proxy::Via`]).
    pub(crate) via: proxy::Via,
    /// Every backend connection pool of this replica: the shared one and one per HTTP worker.
    pools: std::sync::Mutex<Vec<UpstreamPool>>,
    /// hyper's connection timeouts (see [`CoarseTimer`]).
    pub(crate) timer: CoarseTimer,
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

impl Gateway {
    /// A replica forwarding to `backends` (with the sleeping tier on, to the awake engines among
    /// them), checking `keys`. Background work (the activation
    /// lease, key reloads) starts with [`Gateway::spawn_background`].
    ///
    /// # Errors
    /// The thread of the header-read timer could not start.
    pub fn new(cfg: GatewayConfig, backends: EndpointSet, keys: ApiKeys) -> std::io::Result<Self> {
        let metrics = Arc::new(Metrics::new());
        let demand = DemandHub::new(cfg.max_queue, cfg.aggregate_peers)
            .with_activation_counter(metrics.activation_events.clone())
            .with_demand_to_ready(metrics.demand_to_ready());
        let lease = Lease::new(demand.clone(), cfg.activation_timeout, cfg.activation_grace);
        let pool = UpstreamPool::new(cfg.connect_timeout, cfg.backend_idle_timeout);
        let timer = CoarseTimer::new()?;
        let budget = crate::budget::BodyBudget::new(cfg.body_memory_limit);
        let via = proxy::Via::new(demand.instance());
        // With the sleeping tier, requests go to the awake engines among those discovered.
        let (backends, sleep, sleep_task) = match cfg.sleep.clone() {
            Some(sleep_cfg) => {
                let serving = EndpointSet::new();
                let (task, tier) = crate::sleep::SleepTask::new(
                    sleep_cfg,
                    pool.clone(),
                    backends,
                    serving.clone(),
                    demand.clone(),
                    metrics.clone(),
                );
                (serving, Some(tier), Some(task))
            }
            None => (backends, None, None),
        };
        Ok(Self {
            shared: Arc::new(Shared {
                cfg,
                backends,
                demand,
                lease,
                metrics,
                keys,
                pools: std::sync::Mutex::new(vec![pool.clone()]),
                budget,
                via,
                pool,
                sleep,
                sleep_task: std::sync::Mutex::new(sleep_task),
                timer,
                draining: AtomicBool::new(false),
                stop_tx: watch::channel(false).0,
            }),
        })
    }

    /// The settings.
    pub fn config(&self) -> &GatewayConfig {
        &self.shared.cfg
    }

    /// The backend endpoints requests go to (with the sleeping tier on, the awake engines).
    pub fn backends(&self) -> &EndpointSet {
        &self.shared.backends
    }

    /// The demand counters.
    pub fn demand(&self) -> &DemandHub {
        &self.shared.demand
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.shared.metrics
    }

    /// Reports the sleeping tier's engine sleeps and wake-ups on the LLMService (Events and
    /// `status.lastWake`) through `reporter` (no effect without a tier, or once the background
    /// work started).
    pub fn report_to(&self, reporter: crate::sleep::ServiceReporter) {
        if let Some(task) = self
            .shared
            .sleep_task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            task.report_to(reporter);
        }
    }

    /// Starts the lease expiry, the sleeping tier (when on) and API key reloads; they stop when
    /// the runtime does.
    pub fn spawn_background(&self, key_reload_interval: Duration) {
        tokio::spawn(self.shared.lease.clone().run(self.shared.backends.clone()));
        let sleep_task = self
            .shared
            .sleep_task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = sleep_task {
            tokio::spawn(task.run());
        }
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

    /// The HTTP routes: the gateway's own endpoints ([`OWN_PATHS`]), everything else proxied.
    /// A [`ClientAddr`] request extension, when present, is appended to `X-Forwarded-For`.
    pub fn router(&self) -> Router {
        let [
            healthz,
            readyz_path,
            queue_path,
            local_demand_path,
            metrics_path,
        ] = OWN_PATHS;
        Router::new()
            .route(healthz, get(|| async { "ok" }))
            .route(readyz_path, get(readyz))
            .route(queue_path, get(queue))
            .route(local_demand_path, get(local_demand))
            .route(metrics_path, get(metrics))
            // The gateway's own endpoints are read-only; axum's 405 would have an empty body.
            .method_not_allowed_fallback(|| async {
                let mut resp = crate::openai::error_response(
                    StatusCode::METHOD_NOT_ALLOWED,
                    "the gateway's own endpoints answer GET only",
                    "invalid_request_error",
                    Some("method_not_allowed"),
                );
                resp.headers_mut()
                    .insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
                resp
            })
            .fallback(
                |State(shared): State<Arc<Shared>>, req: axum::extract::Request| {
                    let peer_ip = req
                        .extensions()
                        .get::<ClientAddr>()
                        .and_then(|a| proxy::peer_ip_value(a.0));
                    proxy::proxy(shared, req, peer_ip)
                },
            )
            .with_state(self.shared.clone())
    }

    /// The KEDA ExternalScaler gRPC service of this replica.
    pub fn scaler(&self) -> Scaler {
        Scaler::new(
            self.shared.demand.clone(),
            self.shared.metrics.clone(),
            self.shared.cfg.metric_name.clone(),
            self.shared.cfg.metric_target,
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
            .demand
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
        let router = self.router();
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
                    if OWN_PATHS.contains(&req.uri().path()) {
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
        let keepalive = self.shared.cfg.scaler_keepalive;
        tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(keepalive))
            .http2_keepalive_timeout(Some(keepalive))
            .add_service(crate::scaler::server(self.scaler()))
            .serve_with_incoming_shutdown(incoming, self.stopped())
            .await
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
    /// HTTP address.
    pub http: SocketAddr,
    /// ExternalScaler gRPC address.
    pub grpc: SocketAddr,
}

impl RunningGateway {
    /// `http://<http addr>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.http)
    }

    /// `http://<grpc addr>`, for a tonic client.
    pub fn grpc_url(&self) -> String {
        format!("http://{}", self.grpc)
    }
}

/// Starts `gateway` on ephemeral ports of `ip` (HTTP and gRPC) with its background tasks.
///
/// # Errors
/// Bind errors.
pub async fn spawn(gateway: Gateway, ip: std::net::IpAddr) -> std::io::Result<RunningGateway> {
    let http_l = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let grpc_l = TcpListener::bind(SocketAddr::new(ip, 0)).await?;
    let http = http_l.local_addr()?;
    let grpc = grpc_l.local_addr()?;
    gateway.spawn_background(Duration::from_secs(1));
    let g = gateway.clone();
    tokio::spawn(async move { g.serve_http(http_l).await });
    let g = gateway.clone();
    tokio::spawn(async move {
        if let Err(e) = g.serve_grpc(grpc_l).await {
            tracing::error!(error = %e, "gRPC server failed");
        }
    });
    Ok(RunningGateway {
        gateway,
        http,
        grpc,
    })
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
}

async fn queue(State(shared): State<Arc<Shared>>, Query(q): Query<QueueQuery>) -> Response {
    let state = shared.demand.state();
    let value = match q.scope.as_deref() {
        None | Some("total") => state.total(),
        Some("local") => Ok(state.local()),
        Some(other) => {
            let body = serde_json::json!({"error": format!("unknown scope {other:?}: use scope=total (default) or scope=local")});
            return (StatusCode::BAD_REQUEST, axum::Json(body)).into_response();
        }
    };
    match value {
        Ok(n) => axum::Json(serde_json::json!({"pending": n})).into_response(),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(serde_json::json!({"error": e.to_string()})),
        )
            .into_response(),
    }
}

async fn local_demand(State(shared): State<Arc<Shared>>) -> Response {
    let stop = shared.stop_tx.subscribe();
    peers::local_demand_stream(shared.demand.subscribe(), stop)
}

async fn metrics(State(shared): State<Arc<Shared>>) -> Response {
    let state = shared.demand.state();
    let m = &shared.metrics;
    m.pending.set(state.pending() as i64);
    m.demand.set(state.local() as i64);
    m.backend_endpoints
        .set(shared.backends.snapshot().len() as i64);
    m.request_body_bytes
        .set(i64::try_from(shared.budget.held()).unwrap_or(i64::MAX));
    // The total is capped at i64::MAX (see `demand`).
    let total = state
        .total()
        .ok()
        .map(|t| i64::try_from(t).unwrap_or(i64::MAX));
    let mut resp = m.encode_with_total(total).into_response();
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
    );
    resp
}

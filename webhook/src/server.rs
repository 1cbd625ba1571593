//! The HTTPS server: an axum router (`/validate`, `/mutate`, `/healthz`, `/readyz`,
//! `/metrics`) served over rustls with bounds on everything a client controls.
//!
//! Bounds: request bodies over [`Limits::max_body`] get 413; a body not received within
//! [`Limits::body_timeout`] gets 408; a TLS handshake must finish within
//! [`Limits::handshake_timeout`] and HTTP/1 headers within [`Limits::header_timeout`] or the
//! connection is closed; at most [`Limits::max_connections`] connections are served at once
//! (more wait in the accept queue). None of these panics or blocks other connections.
//!
//! Reviews are answered on Tokio's blocking pool, at most [`Limits::max_evaluations`] at once
//! (the rest wait for a slot without holding a thread): a policy that spends its whole CEL
//! budget takes a blocking thread, never an async worker, so other admissions, probes and
//! scrapes on the same workers are not delayed by it.
//!
//! Shutdown drains before it closes: the listener is dropped (new connections are refused),
//! then for up to [`Limits::drain_timeout`] every HTTP/1.1 answer carries `Connection: close`
//! so each client retires its pooled connection after its next answer instead of meeting a
//! connection closed under a request it is sending (the apiserver does not resend a
//! non-idempotent POST); HTTP/2 clients get a GOAWAY. What is still open after the window is
//! closed once its request in flight is answered.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hearth_crds::InferenceRuntime;
use hearth_net::tls_server::{self, ServeLimits};
use http_body_util::{BodyExt, Limited};
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, watch};

use crate::Snapshot;
use crate::admission::{Answer, Endpoint, Review, ReviewError};
use crate::metrics::{ErrorLabels, Metrics, ReviewLabels, RuntimeReadLabels};
use crate::readthrough::{Read, RuntimeReads};

/// Bounds on what one client may cost the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Largest accepted request body, in bytes. An AdmissionReview carries the object and the
    /// old object; the apiserver caps each at 3 MiB (`--max-request-bytes`), so 8 MiB fits
    /// both with room for the envelope.
    pub max_body: usize,
    /// Time allowed to receive a whole body once headers are in.
    pub body_timeout: Duration,
    /// Time allowed for a TLS handshake.
    pub handshake_timeout: Duration,
    /// Time allowed for HTTP/1 request headers, counted from the end of the previous answer on
    /// a kept-alive connection (hyper starts it when it waits for a request head), so it is
    /// also how long an idle pooled connection stays open.
    pub header_timeout: Duration,
    /// Connections served at once.
    pub max_connections: usize,
    /// On shutdown, how long connections may stay open while each is closed after its next
    /// answer; connections still idle after it are closed.
    pub drain_timeout: Duration,
    /// Reviews evaluated at once on the blocking pool (policy evaluation is CPU-bound; more
    /// than the cores only adds latency). Others wait for a slot.
    pub max_evaluations: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_body: 8 << 20,
            // The apiserver's webhook timeout is at most 30 s and ours 10 s.
            body_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            // Longer than the apiserver's idle pooled connections live (client-go's
            // IdleConnTimeout, 90 s): the apiserver then always closes an idle connection
            // first. Closing it from this side races the apiserver's next review on it, and
            // a POST that was written is not retried (Go's transport): the admission fails.
            header_timeout: Duration::from_secs(120),
            max_connections: 1024,
            // The chart's terminationGracePeriodSeconds (30) covers the preStop sleep (5), this
            // and the last requests' body timeout.
            drain_timeout: Duration::from_secs(10),
            max_evaluations: std::thread::available_parallelism()
                .map_or(2, |n| n.get())
                .max(2),
        }
    }
}

/// Shared state of the handlers.
#[derive(Clone)]
pub struct AppState {
    /// The policies and runtimes reviews are answered with; swapped whole on change.
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// True once the first snapshot from the cluster is in (or at once without a cluster).
    pub ready: Arc<AtomicBool>,
    /// Request bounds.
    pub limits: Limits,
    /// The check in front of `/metrics` (TokenReview + SubjectAccessReview); `None`: anyone
    /// may scrape (`--metrics-secure=false`, and in-process tests).
    pub metrics_auth: Option<hearth_net::secure_metrics::MetricsAuth>,
    /// Slots for reviews evaluated at once ([`Limits::max_evaluations`]).
    pub evaluations: Arc<Semaphore>,
    /// Where a review reads an InferenceRuntime it names that the snapshot lacks (see
    /// [`read_named_runtime`]); `None` offline and in in-process tests.
    pub runtimes: Option<Arc<RuntimeReads>>,
}

impl AppState {
    /// State serving `snapshot`, ready at once.
    pub fn new(snapshot: Snapshot, limits: Limits) -> Self {
        Self {
            snapshot: Arc::new(ArcSwap::from_pointee(snapshot)),
            metrics: Arc::new(Metrics::new()),
            ready: Arc::new(AtomicBool::new(true)),
            limits,
            metrics_auth: None,
            evaluations: Arc::new(Semaphore::new(limits.max_evaluations.max(1))),
            runtimes: None,
        }
    }
}

/// A request that could not be answered with an AdmissionReview; rendered as a JSON error
/// with a 4xx status. The apiserver treats it as a webhook failure (its `failurePolicy`).
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The body was not a usable AdmissionReview.
    #[error(transparent)]
    Review(#[from] ReviewError),
    /// The body exceeded the limit.
    #[error("the request body exceeds {0} bytes")]
    TooLarge(usize),
    /// The body did not arrive in time.
    #[error("the request body was not received within {0:?}")]
    Timeout(Duration),
    /// The body could not be read.
    #[error("reading the request body: {0}")]
    Body(String),
    /// Not JSON.
    #[error("Content-Type {0:?} is not application/json")]
    ContentType(String),
    /// The evaluation did not complete (it panicked, or the server is shutting down).
    #[error("the review could not be evaluated: {0}")]
    Internal(String),
}

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            Self::Review(_) | Self::Body(_) => StatusCode::BAD_REQUEST,
            Self::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Timeout(_) => StatusCode::REQUEST_TIMEOUT,
            Self::ContentType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A short label for metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Review(ReviewError::WrongVersion { .. }) => "version",
            Self::Review(_) | Self::Body(_) => "malformed",
            Self::TooLarge(_) => "too_large",
            Self::Timeout(_) => "timeout",
            Self::ContentType(_) => "content_type",
            Self::Internal(_) => "internal",
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = serde_json::json!({ "code": status.as_u16(), "message": self.to_string() });
        (status, axum::Json(body)).into_response()
    }
}

/// The webhook's routes. `/metrics` needs a bearer token allowed to get it when
/// [`AppState::metrics_auth`] is set; the probes never do.
pub fn router(state: AppState) -> Router {
    let scrape = match &state.metrics_auth {
        Some(auth) => get(metrics).route_layer(axum::middleware::from_fn_with_state(
            auth.clone(),
            hearth_net::secure_metrics::require,
        )),
        None => get(metrics),
    };
    Router::new()
        .route(
            Endpoint::Validate.path(),
            post(|s, h, b| review(Endpoint::Validate, s, h, b)),
        )
        .route(
            Endpoint::Mutate.path(),
            post(|s, h, b| review(Endpoint::Mutate, s, h, b)),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", scrape)
        .with_state(state)
}

async fn readyz(State(s): State<AppState>) -> Response {
    if s.ready.load(Ordering::Acquire) {
        "ok".into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "waiting for the first list of ServingPolicies and InferenceRuntimes",
        )
            .into_response()
    }
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

async fn review(
    endpoint: Endpoint,
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match review_inner(endpoint, &s, &headers, body).await {
        Ok(r) => r,
        Err(e) => {
            s.metrics
                .errors
                .get_or_create(&ErrorLabels {
                    endpoint: endpoint.as_str(),
                    reason: e.reason(),
                })
                .inc();
            tracing::debug!(endpoint = endpoint.as_str(), error = %e, "request refused");
            e.into_response()
        }
    }
}

async fn review_inner(
    endpoint: Endpoint,
    s: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    if let Some(ct) = headers.get(header::CONTENT_TYPE) {
        let ct = ct.to_str().unwrap_or_default();
        let mime = ct.split(';').next().unwrap_or_default().trim();
        if !mime.eq_ignore_ascii_case("application/json") {
            return Err(ApiError::ContentType(ct.to_owned()));
        }
    }
    let limit = s.limits.max_body;
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
        && len > limit
    {
        return Err(ApiError::TooLarge(limit));
    }
    let collected =
        tokio::time::timeout(s.limits.body_timeout, Limited::new(body, limit).collect())
            .await
            .map_err(|_| ApiError::Timeout(s.limits.body_timeout))?
            .map_err(|e| {
                if e.is::<http_body_util::LengthLimitError>() {
                    ApiError::TooLarge(limit)
                } else {
                    ApiError::Body(e.to_string())
                }
            })?;
    let bytes = collected.to_bytes();
    let started = Instant::now();
    // Parsing takes time in proportion to the body (up to `max_body`), CEL evaluation up to its
    // budget: both on the blocking pool under a slot of `max_evaluations`. A review naming a
    // runtime the snapshot lacks gives its slot up for the read ([`read_named_runtime`]) and is
    // answered under a second one.
    let snapshot = s.snapshot.load_full();
    let reads = s.runtimes.is_some();
    let permit = evaluation_slot(s).await?;
    let first = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        let review = Review::parse(endpoint, &bytes)?;
        Ok::<_, ReviewError>(match review.named_runtime() {
            Some(name) if reads && !snapshot.runtimes.contains_key(name) => {
                First::NeedsRuntime(Box::new(review))
            }
            _ => First::Answered(Box::new(review.answer(&snapshot))),
        })
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))??;
    let answer = match first {
        First::Answered(answer) => *answer,
        First::NeedsRuntime(review) => {
            let runtime = read_named_runtime(s, &review).await;
            let snapshot = s.snapshot.load_full();
            let permit = evaluation_slot(s).await?;
            tokio::task::spawn_blocking(move || {
                let _permit = permit;
                match runtime {
                    // Unless the watch has caught up meanwhile.
                    Some(rt)
                        if review
                            .named_runtime()
                            .is_some_and(|n| !snapshot.runtimes.contains_key(n)) =>
                    {
                        review.answer(&snapshot.with_runtime(rt))
                    }
                    _ => review.answer(&snapshot),
                }
            })
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?
        }
    };
    let out = serde_json::to_vec(&answer.review).map_err(|e| ApiError::Body(e.to_string()))?;
    s.metrics.duration.observe(started.elapsed().as_secs_f64());
    s.metrics
        .reviews
        .get_or_create(&ReviewLabels {
            endpoint: endpoint.as_str(),
            kind: answer.kind,
            outcome: answer.outcome.as_str(),
        })
        .inc();
    Ok(([(header::CONTENT_TYPE, "application/json")], out).into_response())
}

/// A slot of [`Limits::max_evaluations`].
async fn evaluation_slot(s: &AppState) -> Result<tokio::sync::OwnedSemaphorePermit, ApiError> {
    s.evaluations
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))
}

/// What the first slot of a review ends with.
enum First {
    /// Answered from the snapshot.
    Answered(Box<Answer>),
    /// Names a runtime the snapshot lacks: to be read, then answered.
    NeedsRuntime(Box<Review>),
}

/// The InferenceRuntime `review` names ([`Review::named_runtime`]), read from the apiserver
/// because the snapshot lacks it (a runtime created a moment before the object; see
/// [`crate::readthrough`] for why and the bounds); `None` when it was not read or not found.
/// Counts the outcome in `hearth_webhook_runtime_reads_total{result}`.
pub async fn read_named_runtime(s: &AppState, review: &Review) -> Option<InferenceRuntime> {
    let (Some(reads), Some(name)) = (&s.runtimes, review.named_runtime()) else {
        return None;
    };
    let read = reads.read(name).await;
    s.metrics
        .runtime_reads
        .get_or_create(&RuntimeReadLabels {
            result: read.result(),
        })
        .inc();
    match read {
        Read::Found(runtime) => {
            tracing::info!(runtime = %name, "InferenceRuntime not in the watch's snapshot yet: read from the apiserver");
            Some(*runtime)
        }
        Read::NotRead(_) => None,
    }
}

/// Serves `app` over TLS on `listener` until `shutdown` turns true, then drains: refuses new
/// connections, closes each open one after its next answer (for up to
/// [`Limits::drain_timeout`]), and returns once the last request in flight is answered. The
/// accept loop is [`hearth_net::tls_server::serve`], with the bounds of `limits`.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Router,
    limits: Limits,
    mut shutdown: watch::Receiver<bool>,
) {
    let bounds = ServeLimits {
        max_connections: limits.max_connections,
        handshake_timeout: limits.handshake_timeout,
        header_timeout: limits.header_timeout,
        drain_timeout: limits.drain_timeout,
        last_request_timeout: limits.body_timeout + Duration::from_secs(5),
    };
    let stop = async move {
        while !*shutdown.borrow_and_update() {
            if shutdown.changed().await.is_err() {
                break;
            }
        }
    };
    tls_server::serve(listener, tls, app, bounds, stop).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// client-go's `IdleConnTimeout` for the apiserver's webhook client: the apiserver must close
    /// an idle pooled connection before this server does.
    const APISERVER_IDLE_CONN_TIMEOUT: Duration = Duration::from_secs(90);

    #[test]
    fn idle_connections_outlive_the_apiservers_pool() {
        assert!(Limits::default().header_timeout > APISERVER_IDLE_CONN_TIMEOUT);
    }
}

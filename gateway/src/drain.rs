//! The backend drain a backend pod's `preStop` hook runs: it waits exactly as long as the
//! in-flight work, not a fixed sleep.
//!
//! It reads vLLM's Prometheus endpoint and returns once `vllm:num_requests_running` and
//! `vllm:num_requests_waiting` are both 0 (summed over all label sets) and have stayed 0 for a
//! settle time, or when the timeout passes. The settle time covers requests that a gateway
//! routed just before it saw the pod terminating (the endpoint update takes a moment to
//! propagate). A backend that refuses connections has nothing in flight, so that ends the wait
//! at once.
//!
//! Two ways to run it:
//! - `hearth-gateway drain --url http://127.0.0.1:8000/metrics --timeout 2m`: one drain, for an
//!   `exec` preStop in an image that ships the binary;
//! - `hearth-gateway drain --listen [::]:8099 …`: a native sidecar (KEP-753) serving
//!   `GET /drain`, which answers when one drain ends, for an `httpGet` preStop on the model
//!   container. It needs nothing in the runtime image; this is what the built-in serving
//!   defaults inject. The kubelet waits for the answer (bounded by the grace period), and stops
//!   the sidecar only after the model container has exited.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::{Client, connect::HttpConnector};

/// vLLM's gauge of requests in model execution batches.
pub const RUNNING: &str = "vllm:num_requests_running";
/// vLLM's gauge of requests waiting to be processed.
pub const WAITING: &str = "vllm:num_requests_waiting";

/// How a drain ended.
#[derive(Debug, Clone, PartialEq)]
pub enum DrainOutcome {
    /// The backend reported no running and no waiting request.
    Idle {
        /// Time spent waiting.
        waited: Duration,
    },
    /// The backend refused the connection: nothing can be in flight.
    Gone {
        /// Time spent waiting.
        waited: Duration,
    },
    /// The timeout passed first.
    TimedOut {
        /// Last running count seen, if any.
        running: Option<f64>,
        /// Last waiting count seen, if any.
        waiting: Option<f64>,
    },
}

/// Sums the samples of `name` in Prometheus text exposition `text`; `None` when absent.
pub fn sum_metric(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let rest = match rest.as_bytes().first() {
            Some(b'{') => match close_labels(rest) {
                Some(i) => &rest[i + 1..],
                None => continue,
            },
            Some(b' ' | b'\t') => rest,
            _ => continue, // a longer metric name sharing the prefix
        };
        let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        *found.get_or_insert(0.0) += v;
    }
    found
}

/// Index of the `}` closing the label set that starts at `s[0] == '{'`, skipping quoted values.
fn close_labels(s: &str) -> Option<usize> {
    let mut in_quotes = false;
    let mut escaped = false;
    for (i, c) in s.char_indices().skip(1) {
        match c {
            _ if escaped => escaped = false,
            '\\' if in_quotes => escaped = true,
            '"' => in_quotes = !in_quotes,
            '}' if !in_quotes => return Some(i),
            _ => {}
        }
    }
    None
}

/// How to drain: where vLLM's metrics are and how long to wait.
#[derive(Debug, Clone)]
pub struct DrainSpec {
    /// The backend's Prometheus endpoint (vLLM's `/metrics`).
    pub url: http::Uri,
    /// Upper bound on the whole wait (the LLMService's `drainTimeout`).
    pub timeout: Duration,
    /// Time between two reads of the metrics.
    pub interval: Duration,
    /// How long the backend must stay idle before the drain ends.
    pub settle: Duration,
    /// The gauge of requests being generated ([`RUNNING`] for vLLM; the runtime's
    /// `metrics.running`).
    pub running_metric: String,
    /// The gauge of requests waiting ([`WAITING`] for vLLM; the runtime's `metrics.queueDepth`).
    pub waiting_metric: String,
}

/// Polls the metrics every `spec.interval` until the backend has been idle for `spec.settle`
/// or refuses connections, or `spec.timeout` passes.
///
/// The metrics are read at least once, even with a zero timeout, and each read (connect,
/// head and body) is bounded by the time left (at most 5 s). When the timeout passes while
/// the backend was idle at the last read, the drain ends as [`DrainOutcome::Idle`]: the
/// timeout cut the settle window short. Only a refused connection means the backend is gone; a
/// connect timeout, an error status or an unreadable body leave the drain waiting.
pub async fn wait_backend_idle(spec: &DrainSpec) -> DrainOutcome {
    let DrainSpec {
        url,
        timeout,
        interval,
        settle,
        running_metric,
        waiting_metric,
    } = spec;
    let start = Instant::now();
    let deadline = start + *timeout;
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    let client: Client<_, Empty<Bytes>> =
        Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
    let (mut running, mut waiting) = (None, None);
    // When the backend was first seen idle in the current idle stretch.
    let mut idle_since: Option<Instant> = None;
    // The first read gets at least 1 s, even with a zero timeout.
    let mut budget = (*timeout).clamp(Duration::from_secs(1), Duration::from_secs(5));
    // The same warning every `interval` would flood the log: each distinct one is logged once.
    let mut warned: Option<String> = None;
    let mut warn = |why: String| {
        if warned.as_deref() != Some(why.as_str()) {
            tracing::warn!(%url, "{why}");
            warned = Some(why);
        }
    };
    loop {
        match read_metrics(&client, url, budget, running_metric, waiting_metric).await {
            Reading::Refused => {
                return DrainOutcome::Gone {
                    waited: start.elapsed(),
                };
            }
            Reading::Counts {
                running: r,
                waiting: w,
            } => {
                (running, waiting) = (r, w);
                if r == Some(0.0) && w.unwrap_or(0.0) == 0.0 {
                    let since = *idle_since.get_or_insert_with(Instant::now);
                    if since.elapsed() >= *settle {
                        return DrainOutcome::Idle {
                            waited: start.elapsed(),
                        };
                    }
                } else {
                    idle_since = None;
                    if r.is_none() {
                        warn(format!(
                            "the metrics do not contain {running_metric}: the drain cannot tell \
                             whether requests are in flight, so it waits for the timeout"
                        ));
                    }
                }
            }
            Reading::Failed(why) => {
                idle_since = None;
                warn(why);
            }
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return match idle_since {
                Some(_) => DrainOutcome::Idle {
                    waited: start.elapsed(),
                },
                None => DrainOutcome::TimedOut { running, waiting },
            };
        }
        tokio::time::sleep((*interval).min(left)).await;
        budget = deadline
            .saturating_duration_since(Instant::now())
            .clamp(Duration::from_millis(100), Duration::from_secs(5));
    }
}

/// One read of the metrics endpoint.
enum Reading {
    /// vLLM's gauges (each `None` when absent).
    Counts {
        running: Option<f64>,
        waiting: Option<f64>,
    },
    /// The connection was refused: nothing listens, so nothing is in flight.
    Refused,
    /// Anything else; the message says what.
    Failed(String),
}

/// Reads `url` once, connect, head and body within `budget`.
async fn read_metrics(
    client: &Client<HttpConnector, Empty<Bytes>>,
    url: &http::Uri,
    budget: Duration,
    running_metric: &str,
    waiting_metric: &str,
) -> Reading {
    let read = async {
        let resp = match client.get(url.clone()).await {
            Ok(resp) => resp,
            Err(e) if refused(&e) => return Reading::Refused,
            Err(e) => return Reading::Failed(format!("reading metrics failed: {e}")),
        };
        if !resp.status().is_success() {
            return Reading::Failed(format!("metrics endpoint answered {}", resp.status()));
        }
        match Limited::new(resp.into_body(), 16 * 1024 * 1024)
            .collect()
            .await
        {
            Ok(body) => {
                let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
                Reading::Counts {
                    running: sum_metric(&text, running_metric),
                    waiting: sum_metric(&text, waiting_metric),
                }
            }
            Err(e) => Reading::Failed(format!("reading the metrics body failed: {e}")),
        }
    };
    tokio::time::timeout(budget, read)
        .await
        .unwrap_or_else(|_| Reading::Failed(format!("metrics not read within {budget:?}")))
}

/// Whether a client error is a refused connection (as opposed to a connect timeout, an
/// unsupported scheme or a failure after connecting).
fn refused(e: &hyper_util::client::legacy::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return io.kind() == std::io::ErrorKind::ConnectionRefused;
        }
        source = err.source();
    }
    false
}

/// A gauge for messages: its value, or `unknown` when it was not read.
fn gauge(v: Option<f64>) -> String {
    v.map_or_else(|| "unknown".to_owned(), |v| v.to_string())
}

impl DrainOutcome {
    /// Logs the outcome (info when the backend is idle or gone, a warning on timeout).
    pub fn log(&self) {
        match self {
            DrainOutcome::Idle { waited } => {
                tracing::info!(waited_ms = waited.as_millis() as u64, "backend idle")
            }
            DrainOutcome::Gone { waited } => tracing::info!(
                waited_ms = waited.as_millis() as u64,
                "backend not listening"
            ),
            DrainOutcome::TimedOut { running, waiting } => tracing::warn!(
                running = %gauge(*running),
                waiting = %gauge(*waiting),
                "drain timeout passed with requests in flight"
            ),
        }
    }
}

/// Serves the drain for an `httpGet` preStop hook on `listener` until `shutdown` completes
/// (drains still running then are dropped):
/// `GET /drain` runs one drain ([`wait_backend_idle`]) and answers when it ends, `200` when the
/// backend is idle or gone, `503` when the timeout passed with requests in flight (the kubelet
/// then records a `FailedPreStopHook` event, and terminates the container as it would anyway);
/// `GET /healthz` answers `200`.
///
/// # Errors
/// When serving fails (the listener's accept loop).
pub async fn serve_drain(
    listener: tokio::net::TcpListener,
    spec: DrainSpec,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::{Router, extract::State, http::StatusCode, routing::get};
    use std::sync::Arc;

    async fn drain(State(spec): State<Arc<DrainSpec>>) -> (StatusCode, String) {
        let outcome = wait_backend_idle(&spec).await;
        outcome.log();
        match outcome {
            DrainOutcome::Idle { waited } => (
                StatusCode::OK,
                format!("backend idle after {:.1}s\n", waited.as_secs_f64()),
            ),
            DrainOutcome::Gone { waited } => (
                StatusCode::OK,
                format!("backend not listening after {:.1}s\n", waited.as_secs_f64()),
            ),
            DrainOutcome::TimedOut {
                running: None,
                waiting: _,
            } => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "drain timeout of {:?} passed without reading {} from {}\n",
                    spec.timeout, spec.running_metric, spec.url
                ),
            ),
            DrainOutcome::TimedOut { running, waiting } => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!(
                    "drain timeout of {:?} passed with requests in flight (running {}, waiting {})\n",
                    spec.timeout,
                    gauge(running),
                    gauge(waiting),
                ),
            ),
        }
    }

    let app = Router::new()
        .route("/drain", get(drain))
        .route("/healthz", get(|| async { "ok\n" }))
        .with_state(Arc::new(spec));
    // No graceful shutdown: a native sidecar is stopped after the model container has exited,
    // when no hook is waiting any more; a drain still running then has nobody to answer.
    tokio::select! {
        served = axum::serve(listener, app) => served,
        () = shutdown => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_samples_over_label_sets() {
        let text = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="a"} 2.0
vllm:num_requests_running{engine="1",model_name="we}ird \"x\""} 1.0 1700000000000
vllm:num_requests_running_extra 100
vllm:num_requests_waiting 0
"#;
        assert_eq!(sum_metric(text, RUNNING), Some(3.0));
        assert_eq!(sum_metric(text, WAITING), Some(0.0));
        assert_eq!(sum_metric(text, "vllm:kv_cache_usage_perc"), None);
    }
}

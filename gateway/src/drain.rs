//! The backend drain used by a backend pod's `preStop` hook
//! (`hearth-gateway drain --url http://127.0.0.1:8000/metrics --timeout 20s`).
//!
//! It reads vLLM's Prometheus endpoint and returns as soon as `vllm:num_requests_running` and
//! `vllm:num_requests_waiting` are both 0 (summed over all label sets), or when the timeout
//! passes: a preStop that waits exactly as long as the in-flight work, not a fixed sleep.
//! A backend that refuses connections has nothing in flight, so that also ends the wait.

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

/// Polls `url` (a vLLM `/metrics` endpoint) every `interval` until the backend is idle or gone,
/// or `timeout` passes.
pub async fn wait_backend_idle(
    url: &http::Uri,
    timeout: Duration,
    interval: Duration,
) -> DrainOutcome {
    let start = Instant::now();
    let mut connector = HttpConnector::new();
    connector.set_connect_timeout(Some(Duration::from_secs(2)));
    let client: Client<_, Empty<Bytes>> =
        Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
    let (mut running, mut waiting) = (None, None);
    loop {
        let left = timeout.saturating_sub(start.elapsed());
        if left.is_zero() {
            return DrainOutcome::TimedOut { running, waiting };
        }
        match tokio::time::timeout(left.min(Duration::from_secs(5)), client.get(url.clone())).await
        {
            Ok(Ok(resp)) if resp.status().is_success() => {
                let body = Limited::new(resp.into_body(), 16 * 1024 * 1024)
                    .collect()
                    .await;
                if let Ok(body) = body {
                    let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
                    running = sum_metric(&text, RUNNING);
                    waiting = sum_metric(&text, WAITING);
                    if running == Some(0.0) && waiting.unwrap_or(0.0) == 0.0 {
                        return DrainOutcome::Idle {
                            waited: start.elapsed(),
                        };
                    }
                    if running.is_none() {
                        tracing::warn!(%url, "the metrics do not contain {RUNNING}; waiting for the timeout");
                    }
                }
            }
            Ok(Ok(resp)) => {
                tracing::warn!(%url, status = %resp.status(), "metrics endpoint answered an error")
            }
            Ok(Err(e)) if e.is_connect() => {
                return DrainOutcome::Gone {
                    waited: start.elapsed(),
                };
            }
            Ok(Err(e)) => tracing::warn!(%url, error = %e, "reading metrics failed"),
            Err(_) => tracing::warn!(%url, "metrics endpoint did not answer in time"),
        }
        let left = timeout.saturating_sub(start.elapsed());
        tokio::time::sleep(interval.min(left)).await;
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

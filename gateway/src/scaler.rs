//! The KEDA ExternalScaler gRPC service (`externalscaler.ExternalScaler`).
//!
//! - `IsActive`: `true` while total demand is positive (local demand alone is enough to say
//!   true); an `UNAVAILABLE` error when there is no local demand and the total is unknown.
//! - `StreamIsActive` (trigger type `external-push`): sends the current activity at connect,
//!   then a message on every change of it, pushed from the demand channel (no polling).
//! - `GetMetricSpec`: one metric, the configured name, target `targetSizeFloat` (and the
//!   deprecated integer `targetSize`), overridable by the trigger metadata key `targetSize`.
//! - `GetMetrics`: the total demand in both `metricValue` and `metricValueFloat`. The metric
//!   name is matched case-insensitively (KEDA lower-cases metric names) and with or without
//!   KEDA's `s<N>-` trigger-index prefix; an `UNAVAILABLE` error, never 0, when the total is
//!   unknown.

use std::{pin::Pin, sync::Arc};

use futures::Stream;
use tonic::{Request, Response, Status};

use crate::{
    demand::{BUSY_RECHECK, DemandHub},
    metrics::Metrics,
};

/// Code generated from `proto/externalscaler.proto`.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("externalscaler");
}

use pb::{
    GetMetricSpecResponse, GetMetricsRequest, GetMetricsResponse, IsActiveResponse, MetricSpec,
    MetricValue, ScaledObjectRef,
    external_scaler_server::{ExternalScaler, ExternalScalerServer},
};

/// The scaler of one gateway replica.
#[derive(Debug, Clone)]
pub struct Scaler {
    demand: DemandHub,
    metrics: Arc<Metrics>,
    metric_name: String,
    target: f64,
}

/// Wraps `scaler` in the generated tonic server.
pub fn server(scaler: Scaler) -> ExternalScalerServer<Scaler> {
    ExternalScalerServer::new(scaler)
}

impl Scaler {
    /// A scaler reading `demand`, serving `metric_name` with target `target` per replica.
    pub fn new(demand: DemandHub, metrics: Arc<Metrics>, metric_name: String, target: f64) -> Self {
        Self {
            demand,
            metrics,
            metric_name,
            target,
        }
    }

    fn matches(&self, requested: &str) -> bool {
        let name = self.metric_name.as_str();
        if requested.eq_ignore_ascii_case(name) {
            return true;
        }
        // KEDA prefixes metric names with the trigger index ("s0-<name>").
        requested
            .strip_prefix(['s', 'S'])
            .and_then(|r| r.split_once('-'))
            .is_some_and(|(idx, rest)| {
                !idx.is_empty()
                    && idx.bytes().all(|b| b.is_ascii_digit())
                    && rest.eq_ignore_ascii_case(name)
            })
    }
}

/// A `StreamIsActive` stream; decrements `hearth_gateway_scaler_streams` when KEDA goes away.
struct StreamGauge(Arc<Metrics>);

impl Drop for StreamGauge {
    fn drop(&mut self) {
        self.0.scaler_streams.dec();
    }
}

/// At most 128 characters of `s`, for echoing client input in an error: gRPC carries the
/// message in a header, and an oversized one makes the client drop the whole connection
/// (KEDA's push stream on it included).
fn clip(s: &str) -> String {
    const MAX: usize = 128;
    match s.char_indices().nth(MAX) {
        None => format!("{s:?}"),
        Some((i, _)) => format!("{:?}... ({} bytes)", &s[..i], s.len()),
    }
}

fn unknown(e: impl std::fmt::Display) -> Status {
    Status::unavailable(format!(
        "{e}; the gateway will not report a demand it cannot see (check the peer gateway replicas)"
    ))
}

#[tonic::async_trait]
impl ExternalScaler for Scaler {
    async fn is_active(
        &self,
        _request: Request<ScaledObjectRef>,
    ) -> Result<Response<IsActiveResponse>, Status> {
        let state = self.demand.state();
        match state.active() {
            Some(result) => Ok(Response::new(IsActiveResponse { result })),
            None => Err(unknown(
                state
                    .total()
                    .err()
                    .map_or_else(String::new, |e| e.to_string()),
            )),
        }
    }

    type StreamIsActiveStream =
        Pin<Box<dyn Stream<Item = Result<IsActiveResponse, Status>> + Send + 'static>>;

    async fn stream_is_active(
        &self,
        _request: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        self.metrics.scaler_streams.inc();
        let guard = StreamGauge(self.metrics.clone());
        let rx = self.demand.subscribe();
        // State: receiver, last value sent, gauge guard (dropped with the stream). After `true`
        // the stream looks again every BUSY_RECHECK instead of waking on each change, so
        // requests do not wake it; `true` after `false` is pushed at once.
        let stream = futures::stream::unfold(
            (rx, None::<bool>, guard),
            |(mut rx, last, guard)| async move {
                loop {
                    let active = rx.borrow_and_update().active();
                    if let Some(a) = active
                        && last != Some(a)
                    {
                        return Some((Ok(IsActiveResponse { result: a }), (rx, Some(a), guard)));
                    }
                    if last == Some(true) {
                        tokio::time::sleep(BUSY_RECHECK).await;
                        if rx.has_changed().is_err() {
                            return None;
                        }
                    } else if rx.changed().await.is_err() {
                        return None;
                    }
                }
            },
        );
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_metric_spec(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let target = match request.get_ref().scaler_metadata.get("targetSize") {
            None => self.target,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(t) if t.is_finite() && t > 0.0 => t,
                _ => {
                    return Err(Status::invalid_argument(format!(
                        "trigger metadata targetSize must be a positive number, got {}",
                        clip(v)
                    )));
                }
            },
        };
        Ok(Response::new(GetMetricSpecResponse {
            metric_specs: vec![MetricSpec {
                metric_name: self.metric_name.clone(),
                target_size: (target.round() as i64).max(1),
                target_size_float: target,
            }],
        }))
    }

    async fn get_metrics(
        &self,
        request: Request<GetMetricsRequest>,
    ) -> Result<Response<GetMetricsResponse>, Status> {
        let requested = request.get_ref().metric_name.as_str();
        if !self.matches(requested) {
            return Err(Status::not_found(format!(
                "unknown metric name {}: this scaler serves {:?} (from GetMetricSpec)",
                clip(requested),
                self.metric_name
            )));
        }
        let total = self.demand.state().total().map_err(unknown)?;
        Ok(Response::new(GetMetricsResponse {
            metric_values: vec![MetricValue {
                metric_name: self.metric_name.clone(),
                // The total is capped at i64::MAX; saturate anyway rather than go negative.
                metric_value: i64::try_from(total).unwrap_or(i64::MAX),
                metric_value_float: total as f64,
            }],
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_names_match_case_insensitively_and_with_index_prefix() {
        let s = Scaler::new(
            DemandHub::new(1, false),
            Arc::new(Metrics::new()),
            "hearth_Queue_Depth".into(),
            1.0,
        );
        assert!(s.matches("hearth_queue_depth"));
        assert!(s.matches("HEARTH_QUEUE_DEPTH"));
        assert!(s.matches("s0-hearth_queue_depth"));
        assert!(s.matches("S12-hearth_queue_depth"));
        assert!(!s.matches("s-hearth_queue_depth"));
        assert!(!s.matches("sx-hearth_queue_depth"));
        assert!(!s.matches("other"));
    }
}

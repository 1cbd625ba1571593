//! The KEDA ExternalScaler gRPC service (`externalscaler.ExternalScaler`).
//!
//! Every call names its model by the ScaledObject's trigger metadata key [`SERVICE_KEY`]
//! (`service: <namespace>/<name>` of the LLMService). A shared gateway needs it:
//! `INVALID_ARGUMENT` naming the key without it, `NOT_FOUND` for a service not in its route
//! table (but see `StreamIsActive`). A single-service gateway serves its model without it,
//! and answers `NOT_FOUND` for another service than its own (`--service-key`) when it knows
//! its own.
//!
//! - `IsActive`: `true` while the model's total demand is positive (local demand alone is
//!   enough to say true); an `UNAVAILABLE` error when there is no local demand and the total is
//!   unknown.
//! - `StreamIsActive` (trigger type `external-push`): one stream per ScaledObject, following
//!   its model: the current activity at connect, then a message on every change of it, pushed
//!   from the model's demand channel (no polling). A service not in the route table (a
//!   ScaledObject may subscribe before its model enters the table, or after it left) is not an
//!   error: the stream says `false` and follows the model from the moment it enters.
//! - `GetMetricSpec`: one metric, the configured name, target `targetSizeFloat` (and the
//!   deprecated integer `targetSize`) = the model's metric target, overridable by the trigger
//!   metadata key `targetSize`.
//! - `GetMetrics`: the model's total demand in both `metricValue` and `metricValueFloat`. The
//!   metric name is matched case-insensitively (KEDA lower-cases metric names) and with or
//!   without KEDA's `s<N>-` trigger-index prefix; an `UNAVAILABLE` error, never 0, when the
//!   total is unknown.

use std::{
    pin::Pin,
    sync::{Arc, Weak},
};

use futures::Stream;
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::{
    demand::{BUSY_RECHECK, DemandState},
    metrics::Metrics,
    model::{Model, ModelState},
    routes::{Routes, SelectError},
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

/// The trigger metadata key naming the model: `<namespace>/<name>` of its LLMService.
pub const SERVICE_KEY: &str = "service";

/// The scaler of one gateway replica.
#[derive(Debug, Clone)]
pub struct Scaler {
    routes: Arc<Routes>,
    metrics: Arc<Metrics>,
    metric_name: String,
}

/// Wraps `scaler` in the generated tonic server.
pub fn server(scaler: Scaler) -> ExternalScalerServer<Scaler> {
    ExternalScalerServer::new(scaler)
}

impl Scaler {
    /// A scaler reading the demand of the models of `routes`, serving `metric_name`.
    pub(crate) fn new(routes: Arc<Routes>, metrics: Arc<Metrics>, metric_name: String) -> Self {
        Self {
            routes,
            metrics,
            metric_name,
        }
    }

    /// The `service` a ScaledObject names, if any.
    fn service(so: Option<&ScaledObjectRef>) -> Option<&str> {
        so.and_then(|so| so.scaler_metadata.get(SERVICE_KEY))
            .map(String::as_str)
    }

    /// The model `so` names.
    fn select(&self, so: Option<&ScaledObjectRef>) -> Result<Arc<Model>, Status> {
        self.routes
            .select(Self::service(so))
            .map_err(|e| select_error(&e, so))
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

/// The status for a model that cannot be selected for `so`.
fn select_error(e: &SelectError, so: Option<&ScaledObjectRef>) -> Status {
    let scaled_object = so.map_or_else(String::new, |so| {
        format!(" (ScaledObject {}/{})", clip(&so.namespace), clip(&so.name))
    });
    match e {
        SelectError::Missing => Status::invalid_argument(format!(
            "trigger metadata {SERVICE_KEY:?} is required by a shared gateway: set it to <namespace>/<name> of the LLMService{scaled_object}"
        )),
        SelectError::Unknown(service) => Status::not_found(format!(
            "service {} is not served by this gateway (not in its route table){scaled_object}",
            clip(service)
        )),
    }
}

/// A `StreamIsActive` stream: follows the model of `key` through route table changes.
struct Follow {
    routes: Arc<Routes>,
    key: Option<String>,
    tables: watch::Receiver<u64>,
    /// The model's state followed, and its demand.
    model: Option<(Weak<ModelState>, watch::Receiver<DemandState>)>,
    last: Option<bool>,
    _gauge: StreamGauge,
}

impl Follow {
    /// Follows the model the table now has for the key (from the start, or a new state).
    fn resolve(&mut self) {
        self.tables.mark_unchanged();
        match self.routes.select(self.key.as_deref()) {
            Ok(m) => {
                let same = self
                    .model
                    .as_ref()
                    .is_some_and(|(w, _)| std::ptr::eq(w.as_ptr(), Arc::as_ptr(&m.state)));
                if !same {
                    self.model = Some((Arc::downgrade(&m.state), m.state.demand.subscribe()));
                }
            }
            Err(_) => self.model = None,
        }
    }

    /// The next activity to send; `None` when the gateway is gone.
    async fn next(&mut self) -> Option<bool> {
        loop {
            let active = match &mut self.model {
                Some((_, rx)) => rx.borrow_and_update().active(),
                // Not in the table: no demand the gateway could see.
                None => Some(false),
            };
            if let Some(a) = active
                && self.last != Some(a)
            {
                self.last = Some(a);
                return Some(a);
            }
            // After `true`, look again every BUSY_RECHECK instead of waking on each change,
            // so requests do not wake the stream; `true` after `false` is pushed at once.
            let busy = self.last == Some(true);
            let Follow { tables, model, .. } = self;
            let demand = async {
                match model {
                    Some((_, rx)) if !busy => rx.changed().await.is_ok(),
                    Some((_, rx)) => {
                        tokio::time::sleep(BUSY_RECHECK).await;
                        rx.has_changed().is_ok()
                    }
                    None => std::future::pending().await,
                }
            };
            let table_changed = tokio::select! {
                live = demand => !live,
                r = tables.changed() => {
                    if r.is_err() {
                        return None;
                    }
                    true
                }
            };
            if table_changed {
                // A new table, or the model's state is gone (it left the table): look the
                // model up again.
                self.resolve();
            }
        }
    }
}

#[tonic::async_trait]
impl ExternalScaler for Scaler {
    async fn is_active(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<IsActiveResponse>, Status> {
        let state = self.select(Some(request.get_ref()))?.demand_state();
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
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<Self::StreamIsActiveStream>, Status> {
        let so = request.get_ref();
        let key = Self::service(Some(so)).map(str::to_owned);
        match self.routes.select(key.as_deref()) {
            // Not yet in the table: followed from the moment it enters.
            Ok(_) | Err(SelectError::Unknown(_)) if self.routes.shared => {}
            Ok(_) => {}
            Err(e) => return Err(select_error(&e, Some(so))),
        }
        self.metrics.scaler_streams.inc();
        let mut follow = Follow {
            routes: self.routes.clone(),
            key,
            tables: self.routes.subscribe(),
            model: None,
            last: None,
            _gauge: StreamGauge(self.metrics.clone()),
        };
        follow.resolve();
        let stream = futures::stream::unfold(follow, |mut follow| async move {
            let a = follow.next().await?;
            Some((Ok(IsActiveResponse { result: a }), follow))
        });
        Ok(Response::new(Box::pin(stream)))
    }

    async fn get_metric_spec(
        &self,
        request: Request<ScaledObjectRef>,
    ) -> Result<Response<GetMetricSpecResponse>, Status> {
        let model = self.select(Some(request.get_ref()))?;
        let target = match request.get_ref().scaler_metadata.get("targetSize") {
            None => model.cfg.metric_target,
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
        let model = self.select(request.get_ref().scaled_object_ref.as_ref())?;
        let total = model.demand_state().total().map_err(unknown)?;
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
    use std::collections::HashMap;

    use hearth_crds::llmendpoint::{ModelRoute, RouteTable};

    use super::*;
    use crate::{EndpointSet, Gateway, GatewayConfig, apikeys::ApiKeys, routes::default_route};

    fn so(service: Option<&str>) -> ScaledObjectRef {
        ScaledObjectRef {
            name: "so".into(),
            namespace: "ns".into(),
            scaler_metadata: service
                .map(|s| HashMap::from([(SERVICE_KEY.to_owned(), s.to_owned())]))
                .unwrap_or_default(),
        }
    }

    /// A shared gateway serving `ns/a` (metric target 2) and `ns/b` (target 3).
    fn shared() -> Gateway {
        let gw = Gateway::new_shared(
            GatewayConfig::default(),
            ApiKeys::disabled(),
            Arc::new(|_: &ModelRoute, _: &EndpointSet| {}),
        )
        .unwrap();
        gw.apply_routes(&RouteTable {
            models: vec![
                ModelRoute {
                    metric_target: 2.0,
                    ..default_route("ns", "a", "a")
                },
                ModelRoute {
                    metric_target: 3.0,
                    ..default_route("ns", "b", "b")
                },
            ],
        })
        .unwrap();
        gw
    }

    #[test]
    fn metric_names_match_case_insensitively_and_with_index_prefix() {
        let cfg = GatewayConfig {
            metric_name: "hearth_Queue_Depth".into(),
            ..Default::default()
        };
        let s = Gateway::new(cfg, EndpointSet::new(), ApiKeys::disabled())
            .unwrap()
            .scaler();
        assert!(s.matches("hearth_queue_depth"));
        assert!(s.matches("HEARTH_QUEUE_DEPTH"));
        assert!(s.matches("s0-hearth_queue_depth"));
        assert!(s.matches("S12-hearth_queue_depth"));
        assert!(!s.matches("s-hearth_queue_depth"));
        assert!(!s.matches("sx-hearth_queue_depth"));
        assert!(!s.matches("other"));
    }

    #[tokio::test]
    async fn a_shared_gateway_answers_for_the_service_named() {
        let gw = shared();
        let s = gw.scaler();
        let a = gw.model("ns/a").unwrap();
        let _slot = a.demand().try_admit().unwrap();
        let active = |service| {
            let s = s.clone();
            async move {
                s.is_active(Request::new(so(service)))
                    .await
                    .map(|r| r.into_inner().result)
            }
        };
        assert!(active(Some("ns/a")).await.unwrap());
        assert!(!active(Some("ns/b")).await.unwrap());
        let e = active(None).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert!(e.message().contains("\"service\""), "{}", e.message());
        let e = active(Some("ns/zzz")).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(e.message().contains("ns/zzz"), "{}", e.message());

        let metrics = |service| {
            let s = s.clone();
            async move {
                s.get_metrics(Request::new(GetMetricsRequest {
                    scaled_object_ref: Some(so(service)),
                    metric_name: "s0-hearth_queue_depth".into(),
                }))
                .await
                .map(|r| r.into_inner().metric_values[0].metric_value)
            }
        };
        assert_eq!(metrics(Some("ns/a")).await.unwrap(), 1);
        assert_eq!(metrics(Some("ns/b")).await.unwrap(), 0);
        assert_eq!(
            metrics(None).await.unwrap_err().code(),
            tonic::Code::InvalidArgument
        );

        let target = |service| {
            let s = s.clone();
            async move {
                s.get_metric_spec(Request::new(so(service)))
                    .await
                    .map(|r| r.into_inner().metric_specs[0].target_size_float)
            }
        };
        assert_eq!(target(Some("ns/a")).await.unwrap(), 2.0);
        assert_eq!(target(Some("ns/b")).await.unwrap(), 3.0);
        assert_eq!(
            target(Some("ns/c")).await.unwrap_err().code(),
            tonic::Code::NotFound
        );
    }

    #[tokio::test]
    async fn a_stream_waits_for_its_model_to_enter_the_table_and_follows_it_out() {
        use futures::StreamExt;
        let gw = shared();
        let s = gw.scaler();
        let e = s
            .stream_is_active(Request::new(so(None)))
            .await
            .err()
            .unwrap();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let mut stream = s
            .stream_is_active(Request::new(so(Some("ns/c"))))
            .await
            .unwrap()
            .into_inner();
        async fn next(stream: &mut <Scaler as ExternalScaler>::StreamIsActiveStream) -> bool {
            tokio::time::timeout(std::time::Duration::from_secs(5), stream.next())
                .await
                .unwrap()
                .unwrap()
                .unwrap()
                .result
        }
        assert!(!next(&mut stream).await, "not in the table: no demand");
        let mut table = RouteTable {
            models: vec![default_route("ns", "c", "c")],
        };
        gw.apply_routes(&table).unwrap();
        let slot = gw.model("ns/c").unwrap().demand().try_admit().unwrap();
        assert!(
            next(&mut stream).await,
            "followed from the moment it entered"
        );
        // It leaves the table while its request is in flight: the gateway no longer serves
        // it for KEDA.
        table.models.clear();
        gw.apply_routes(&table).unwrap();
        assert!(!next(&mut stream).await);
        drop(slot);
    }

    #[tokio::test]
    async fn a_single_service_gateway_checks_the_service_only_when_it_knows_its_own() {
        let keyed = GatewayConfig {
            service_key: Some("team/qwen".into()),
            ..Default::default()
        };
        let s = Gateway::new(keyed, EndpointSet::new(), ApiKeys::disabled())
            .unwrap()
            .scaler();
        for (service, ok) in [
            (None, true),
            (Some("team/qwen"), true),
            (Some("team/phi"), false),
        ] {
            let r = s.is_active(Request::new(so(service))).await;
            assert_eq!(r.is_ok(), ok, "{service:?}");
        }
        let s = Gateway::new(
            GatewayConfig::default(),
            EndpointSet::new(),
            ApiKeys::disabled(),
        )
        .unwrap()
        .scaler();
        assert!(s.is_active(Request::new(so(Some("any/one")))).await.is_ok());
    }
}

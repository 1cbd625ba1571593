//! Prometheus metrics of the controller (prometheus-client, OpenMetrics text on `/metrics`).

use std::{
    sync::Arc,
    task::{Context as TaskContext, Poll},
    time::Duration,
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

/// Label of the error counter: the error's metric label (see [`crate::Error::metric_label`]).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Short error class, e.g. `kube_api`, `render`.
    pub reason: String,
}

/// Label of `hearth_activation_phase_seconds`: the phase of an activation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// `scale_decision`, `waiting_for_devices`, `scheduled`, `image_pull`,
    /// `containers_started`, `model_ready`, `total` (see [`crate::activation`]).
    pub phase: &'static str,
}

/// Labels of `hearth_accelerator_seconds_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UsageLabel {
    /// `<namespace>/<name>` of the LLMService.
    pub service: String,
    /// The tenant charged.
    pub tenant: String,
    /// `coldStart`, `serving`, `idle`, `sleeping` or `warmWindow`.
    pub phase: &'static str,
}

/// Label of `hearth_device_handovers_total`: the extended resource handed over.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabel {
    /// The resource's name, as the runtime and the device plugin name it (`nvidia.com/gpu`).
    pub resource: String,
}

/// Buckets of `hearth_activation_phase_seconds`: 1 ms doubling to about 35 min, for phases from
/// a scheduling decision to a large model's load.
pub fn activation_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.001, 2.0, 22)
}

/// The controller's metrics.
#[derive(Clone)]
pub struct Metrics {
    /// `hearth_controller_reconciles_total`: reconciles started.
    pub reconciles: Counter,
    /// `hearth_controller_reconcile_errors_total{reason}`: reconciles that returned an error.
    pub errors: Family<ErrorLabels, Counter>,
    /// `hearth_controller_reconcile_duration_seconds`: reconcile wall time.
    pub duration: Histogram,
    /// `hearth_controller_kube_requests_total`: HTTP requests sent to the apiserver.
    pub kube_requests: Counter,
    /// `hearth_controller_writes_total`: create/apply/status writes issued.
    pub writes: Counter,
    /// `hearth_activation_phase_seconds{phase}`: one observation per phase of each recorded
    /// activation (0→1), seconds.
    pub activation_phases: Family<PhaseLabel, Histogram>,
    /// `hearth_device_handovers_total{resource}`: services taken to zero so that a waiting
    /// service's backend gets their devices (one per victim, see [`crate::handover`]).
    pub device_handovers: Family<ResourceLabel, Counter>,
    /// `hearth_accelerator_seconds_total{service,tenant,phase}`: the backend pods' device-seconds
    /// as the meter charges them (see [`crate::metering`]); resets with the process, unlike
    /// `status.usage`.
    pub accelerator_seconds: Family<UsageLabel, Counter<f64, std::sync::atomic::AtomicU64>>,
    registry: Arc<Registry>,
    /// Metrics under their own names (no `hearth_controller` prefix): the libraries'
    /// `hearth_policy_native_fallbacks_total{reason}` (see [`hearth_policies::fallback`]) and
    /// `hearth_activation_phase_seconds`.
    libraries: Arc<Registry>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric in a fresh registry.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("hearth_controller");
        let reconciles = Counter::default();
        let errors = Family::<ErrorLabels, Counter>::default();
        let duration = Histogram::new([
            0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ]);
        let kube_requests = Counter::default();
        let writes = Counter::default();
        registry.register("reconciles", "Reconciles started", reconciles.clone());
        registry.register(
            "reconcile_errors",
            "Reconciles that failed, by error reason",
            errors.clone(),
        );
        registry.register(
            "reconcile_duration_seconds",
            "Reconcile duration in seconds",
            duration.clone(),
        );
        registry.register(
            "kube_requests",
            "HTTP requests sent to the Kubernetes apiserver",
            kube_requests.clone(),
        );
        registry.register(
            "writes",
            "Create, apply and status writes sent to the apiserver",
            writes.clone(),
        );
        let activation_phases = Family::<PhaseLabel, Histogram>::new_with_constructor(
            new_activation_histogram as fn() -> Histogram,
        );
        let device_handovers = Family::<ResourceLabel, Counter>::default();
        let accelerator_seconds = Family::default();
        let mut libraries = Registry::default();
        libraries.register(
            "hearth_accelerator_seconds",
            "Device-seconds of backend pods (extended-resource units times seconds scheduled), by service, tenant and phase",
            accelerator_seconds.clone(),
        );
        libraries.register(
            "hearth_device_handovers",
            "Services taken to zero to hand their accelerators to a waiting service, by resource",
            device_handovers.clone(),
        );
        libraries.register_collector(Box::new(hearth_policies::fallback::Collector));
        // Shared with the gateway, which observes its own phases under the same name.
        libraries.register(
            "hearth_activation_phase_seconds",
            "Phases of activations (0 to 1 backend replicas), in seconds",
            activation_phases.clone(),
        );
        Self {
            reconciles,
            errors,
            duration,
            kube_requests,
            writes,
            activation_phases,
            device_handovers,
            accelerator_seconds,
            registry: Arc::new(registry),
            libraries: Arc::new(libraries),
        }
    }

    /// Records one finished reconcile.
    pub fn observe(&self, elapsed: Duration, error: Option<&str>) {
        self.duration.observe(elapsed.as_secs_f64());
        if let Some(reason) = error {
            self.errors
                .get_or_create(&ErrorLabels {
                    reason: reason.to_owned(),
                })
                .inc();
        }
    }

    /// Records the phases of one activation: `(phase, seconds)`.
    pub fn activation(&self, phases: &[(&'static str, f64)]) {
        for (phase, secs) in phases {
            self.activation_phases
                .get_or_create(&PhaseLabel { phase })
                .observe(*secs);
        }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry);
        let _ = encode_registry(&mut out, &self.libraries);
        let _ = encode_eof(&mut out);
        out
    }

    /// A tower layer counting every request a kube `Client` sends.
    pub fn request_counter(&self) -> CountLayer {
        CountLayer(self.kube_requests.clone())
    }
}

fn new_activation_histogram() -> Histogram {
    Histogram::new(activation_buckets())
}

/// Counts requests through a service (see [`Metrics::request_counter`]).
#[derive(Clone)]
pub struct CountLayer(Counter);

impl<S> tower::Layer<S> for CountLayer {
    type Service = CountService<S>;
    fn layer(&self, inner: S) -> Self::Service {
        CountService {
            inner,
            counter: self.0.clone(),
        }
    }
}

/// The service made by [`CountLayer`].
#[derive(Clone)]
pub struct CountService<S> {
    inner: S,
    counter: Counter,
}

impl<S, R> tower::Service<R> for CountService<S>
where
    S: tower::Service<R>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut TaskContext<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: R) -> Self::Future {
        self.counter.inc();
        self.inner.call(req)
    }
}

/// How `/metrics` is served.
pub enum Serving {
    /// Plain HTTP, no authentication (`--metrics-secure=false`: local runs and benchmarks).
    Plain,
    /// HTTPS with this configuration, and every scrape authenticated and authorized
    /// (`hearth_net::secure_metrics`); `/healthz` and `/readyz` stay open for the kubelet.
    Secure {
        /// The server's certificate.
        tls: Arc<rustls::ServerConfig>,
        /// The check in front of `/metrics`.
        auth: hearth_net::secure_metrics::MetricsAuth,
    },
}

/// Serves `/metrics` (OpenMetrics text), `/healthz` and `/readyz` on `listener` until the
/// process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Metrics,
    serving: Serving,
) -> std::io::Result<()> {
    use axum::{Router, http::header, routing::get};
    let scrape = get(move || {
        let m = metrics.clone();
        async move {
            (
                [(
                    header::CONTENT_TYPE,
                    "application/openmetrics-text; version=1.0.0; charset=utf-8",
                )],
                m.encode(),
            )
        }
    });
    let scrape = match &serving {
        Serving::Plain => scrape,
        Serving::Secure { auth, .. } => scrape.route_layer(axum::middleware::from_fn_with_state(
            auth.clone(),
            hearth_net::secure_metrics::require,
        )),
    };
    let app = Router::new()
        .route("/metrics", scrape)
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }));
    match serving {
        Serving::Plain => axum::serve(listener, app).await,
        Serving::Secure { tls, .. } => {
            hearth_net::secure_metrics::serve_tls(listener, tls, app).await;
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Metrics;

    #[test]
    fn exports_the_policy_engine_fallbacks() {
        let text = Metrics::new().encode();
        assert!(
            text.contains("# TYPE hearth_controller_reconciles counter"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE hearth_policy_native_fallbacks counter"),
            "{text}"
        );
        for reason in ["panic", "unsupported"] {
            let line = format!("hearth_policy_native_fallbacks_total{{reason=\"{reason}\"}} ");
            assert!(text.contains(&line), "{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn activation_phases_are_one_histogram_by_phase_without_the_prefix() {
        let m = Metrics::new();
        m.activation(&[("scheduled", 0.5), ("total", 34.2)]);
        let text = m.encode();
        assert!(
            text.contains("# TYPE hearth_activation_phase_seconds histogram"),
            "{text}"
        );
        assert!(
            text.contains("hearth_activation_phase_seconds_count{phase=\"total\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "hearth_activation_phase_seconds_bucket{le=\"0.001\",phase=\"scheduled\"} 0"
            ),
            "{text}"
        );
        // The largest bucket is above 20 minutes.
        assert!(super::activation_buckets().last().unwrap() > 1200.0);
    }
}

//! The `hearth-gateway` command line: every flag has an environment variable, durations are
//! written the Kubernetes/Go way (`"5m"`, `"10s"`, `"150ms"`). `docs/gateway.md` lists them.

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::{Args, Parser, Subcommand};
use hearth_crds::duration::parse_duration;
use http::uri::Authority;

use crate::{
    config::{ColdStartMode, GatewayConfig},
    sleep::{EngineCall, SleepConfig},
};

/// A flag value that makes no sense; the message names the flag and says what to write.
#[derive(Debug, thiserror::Error)]
#[error("{flag}: {message}")]
pub struct CliError {
    /// The flag, e.g. `--max-queue`.
    pub flag: &'static str,
    /// What is wrong and how to fix it.
    pub message: String,
}

fn err(flag: &'static str, message: impl Into<String>) -> CliError {
    CliError {
        flag,
        message: message.into(),
    }
}

/// Parses a Go-style duration for clap.
pub fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

/// Parses a plain-HTTP URL with a host (`http://127.0.0.1:8000/metrics`): the drain reads the
/// engine's metrics on the pod's loopback; any other scheme could never be read.
pub fn http_url(s: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") || uri.host().is_none() {
        return Err(format!(
            "{s:?} must be an http:// URL with a host, such as http://127.0.0.1:8000/metrics"
        ));
    }
    Ok(uri)
}

/// Parses a byte size: an integer, optionally with a Kubernetes quantity suffix
/// (`Ki`, `Mi`, `Gi`, or `k`, `M`, `G`).
pub fn byte_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("invalid size {s:?}: write bytes like \"1048576\" or \"8Mi\""))?;
    let mult: usize = match unit {
        "" => 1,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => {
            return Err(format!(
                "invalid size unit {unit:?} in {s:?}: use Ki, Mi, Gi, k, M or G"
            ));
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}

/// Whether `name` is a Kubernetes object name (a DNS-1123 subdomain, as a ConfigMap's is).
fn is_object_name(name: &str) -> bool {
    let ok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    let bytes = name.as_bytes();
    (1..=253).contains(&bytes.len())
        && bytes.first().copied().is_some_and(ok)
        && bytes.last().copied().is_some_and(ok)
        && bytes.iter().all(|&c| ok(c) || c == b'-' || c == b'.')
}

/// Hearth's gateway: an OpenAI-compatible scale-to-zero proxy in front of a model backend, and
/// a KEDA external scaler.
#[derive(Debug, Parser)]
#[command(
    name = "hearth-gateway",
    version = hearth_net::version!(),
    args_conflicts_with_subcommands = true
)]
pub struct Cli {
    /// A helper command instead of serving.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Serving options (the default command).
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// Helper commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// For a backend pod's preStop hook: return once the backend's metrics have reported no
    /// running and no waiting request for the settle time, or it refuses connections, or the
    /// timeout passes (exit status 0 either way). With `--listen`, serve `GET /drain` instead,
    /// for an `httpGet` hook from a native sidecar.
    Drain(DrainArgs),
}

/// `hearth-gateway drain`.
#[derive(Debug, Args)]
pub struct DrainArgs {
    /// The backend's Prometheus endpoint.
    #[arg(
        long,
        env = "HEARTH_DRAIN_URL",
        default_value = "http://127.0.0.1:8000/metrics",
        value_parser = http_url
    )]
    pub url: http::Uri,
    /// Upper bound on the wait (the LLMService's drainTimeout).
    #[arg(long, env = "HEARTH_DRAIN_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub timeout: Duration,
    /// Time between two reads of the metrics.
    #[arg(long, env = "HEARTH_DRAIN_INTERVAL", default_value = "250ms", value_parser = duration)]
    pub interval: Duration,
    /// How long the backend must report no running and no waiting request before the drain
    /// ends: covers requests a gateway routed before it saw the pod terminating.
    #[arg(long, env = "HEARTH_DRAIN_SETTLE", default_value = "2s", value_parser = duration)]
    pub settle: Duration,
    /// Serve the drain instead of running it once: `GET /drain` runs one drain and answers
    /// when it ends (an `httpGet` preStop hook on the model container, with this process as a
    /// native sidecar). `GET /healthz` answers 200. `[::]:<port>` is every address, IPv4 and
    /// IPv6 (IPv4 only on a host without IPv6).
    #[arg(long, env = "HEARTH_DRAIN_LISTEN", value_parser = hearth_net::parse_listen)]
    pub listen: Option<std::net::SocketAddr>,
    /// The gauge of requests being generated (the InferenceRuntime's `metrics.running`).
    #[arg(long, env = "HEARTH_DRAIN_RUNNING_METRIC", default_value = crate::drain::RUNNING)]
    pub running_metric: String,
    /// The gauge of requests waiting (the InferenceRuntime's `metrics.queueDepth`).
    #[arg(long, env = "HEARTH_DRAIN_WAITING_METRIC", default_value = crate::drain::WAITING)]
    pub waiting_metric: String,
}

impl DrainArgs {
    /// The drain these flags describe.
    pub fn spec(&self) -> crate::drain::DrainSpec {
        crate::drain::DrainSpec {
            url: self.url.clone(),
            timeout: self.timeout,
            interval: self.interval,
            settle: self.settle,
            running_metric: self.running_metric.clone(),
            waiting_metric: self.waiting_metric.clone(),
        }
    }
}

/// `hearth-gateway` (serve).
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// HTTP listen address of clients: the OpenAI API, /healthz, /readyz. `[::]` is every
    /// address, IPv4 and IPv6 (IPv4 only on a host without IPv6).
    #[arg(long, env = "HEARTH_LISTEN", default_value = "[::]:8080", value_parser = hearth_net::parse_listen)]
    pub listen: SocketAddr,
    /// HTTP listen address of the admin endpoints: /hearth/queue..., /hearth/local-demand,
    /// /metrics, /hearth/quota-usage, /hearth/metering, /hearth/adapter-failures.
    #[arg(long, env = "HEARTH_ADMIN_LISTEN", default_value = "[::]:9091", value_parser = hearth_net::parse_listen)]
    pub admin_listen: SocketAddr,
    /// Bearer tokens of the admin port: a directory with `token` (this gateway's own, sent to
    /// its peers) and `authorized.json` (digests of the other callers' tokens with their
    /// scopes), re-read every 10s. Absent: the admin port is open to anyone who reaches it.
    #[arg(long, env = "HEARTH_ADMIN_AUTH_DIR")]
    pub admin_auth_dir: Option<PathBuf>,
    /// KEDA ExternalScaler gRPC listen address.
    #[arg(
        long,
        env = "HEARTH_SCALER_LISTEN",
        default_value = "[::]:9090",
        value_parser = hearth_net::parse_listen
    )]
    pub scaler_listen: SocketAddr,
    /// Mutual TLS on the ExternalScaler port: a directory with `ca.crt` (the bundle client
    /// certificates must chain to), `tls.crt` and `tls.key` (the gateway's certificate), re-read
    /// every 10s. Absent: plain gRPC.
    #[arg(long, env = "HEARTH_SCALER_TLS_DIR")]
    pub scaler_tls_dir: Option<PathBuf>,
    /// With --scaler-tls-dir: the DNS name a client certificate must be valid for (its
    /// subjectAltName), besides chaining to the bundle; the controller's is
    /// `keda.<service>-scaler.<namespace>`. Absent: any client certificate the bundle signed.
    #[arg(long, env = "HEARTH_SCALER_CLIENT_NAME", requires = "scaler_tls_dir")]
    pub scaler_client_name: Option<String>,
    /// Namespace of the backend and gateway Services (and of the routes ConfigMap).
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    pub namespace: String,
    /// Shared mode: serve every model of the route table in this ConfigMap (in --namespace,
    /// key routes.json, written by the controller for an LLMEndpoint), routed by the request's
    /// `model`. Each model's queue bound, cold start, timeouts, metric target and sleeping tier
    /// come from its route, so the per-service flags are refused with it.
    #[arg(
        long,
        env = "HEARTH_ROUTES_CONFIGMAP",
        value_name = "NAME",
        conflicts_with_all = [
            "backend_service", "backend_url", "served_model_name", "model_alias", "backend_port",
            "backend_port_name", "max_queue", "cold_start", "heartbeat_interval",
            "activation_timeout", "metric_target", "sleep_after", "sleep_level", "sleep_path",
            "is_sleeping_path", "wake_up_calls", "llmservice", "llmservice_uid", "service_key",
            "adapters_configmap",
        ]
    )]
    pub routes_configmap: Option<String>,
    /// Single-service mode: serve the LoRA adapters of the adapter table in this ConfigMap (in
    /// --namespace, key adapters.json, written by the controller as `<service>-adapters`), each
    /// routed to the model by its own name and loaded into the engines on demand. Needs
    /// --served-model-name (the adapters' base model).
    #[arg(
        long,
        env = "HEARTH_ADAPTERS_CONFIGMAP",
        value_name = "NAME",
        requires = "served_model_name"
    )]
    pub adapters_configmap: Option<String>,
    /// The served LLMService as NAMESPACE/NAME: the `service` label of the metrics, and the
    /// service KEDA's `service` parameter must name when it gives one (default: --namespace
    /// and --llmservice, joined by a slash, when --llmservice is set).
    #[arg(long, env = "HEARTH_SERVICE_KEY", value_name = "NAMESPACE/NAME")]
    pub service_key: Option<String>,
    /// Backend Service whose EndpointSlices list the ready backend pods.
    #[arg(long, env = "HEARTH_BACKEND_SERVICE")]
    pub backend_service: Option<String>,
    /// Backend Service port, used for the fallback URL http://<service>.<namespace>.svc:<port>.
    #[arg(long, env = "HEARTH_BACKEND_PORT", default_value_t = 8000)]
    pub backend_port: u16,
    /// Name of the backend Service port in the EndpointSlices (default: the only port, or "http").
    #[arg(long, env = "HEARTH_BACKEND_PORT_NAME")]
    pub backend_port_name: Option<String>,
    /// Backend URL used when EndpointSlices may not be watched (RBAC), or alone without
    /// --backend-service (a fixed backend, always considered ready).
    #[arg(long, env = "HEARTH_BACKEND_URL")]
    pub backend_url: Option<http::Uri>,
    /// Model name(s) clients use; enables answering /v1/models while cold and 404 for other names.
    #[arg(
        long = "served-model-name",
        env = "HEARTH_SERVED_MODEL_NAME",
        value_delimiter = ','
    )]
    pub served_model_name: Vec<String>,
    /// More names clients may send in `model` (the LLMService's `spec.model.aliases`, such as
    /// the hub id): answered like --served-model-name, cold or warm, and forwarded with `model`
    /// set to the first --served-model-name, the name the engine serves.
    #[arg(
        long = "model-alias",
        env = "HEARTH_MODEL_ALIAS",
        value_delimiter = ',',
        requires = "served_model_name"
    )]
    pub model_alias: Vec<String>,
    /// Requests admitted at once (held + in flight); beyond it, 429 with Retry-After.
    #[arg(long, env = "HEARTH_MAX_QUEUE", default_value_t = 1000)]
    pub max_queue: u64,
    /// Cold start: keepalive (hold; SSE heartbeats for streams) or reject (503 + Retry-After).
    #[arg(
        long,
        env = "HEARTH_COLD_START",
        value_enum,
        default_value = "keepalive"
    )]
    pub cold_start: ColdStartMode,
    /// Interval of SSE comment lines while a streaming request is held.
    #[arg(long, env = "HEARTH_HEARTBEAT_INTERVAL", default_value = "5s", value_parser = duration)]
    pub heartbeat_interval: Duration,
    /// How long a request may wait for a ready backend.
    #[arg(long, env = "HEARTH_ACTIVATION_TIMEOUT", default_value = "5m", value_parser = duration)]
    pub activation_timeout: Duration,
    /// How long demand stays raised after a backend turned ready (the activation lease).
    #[arg(long, env = "HEARTH_ACTIVATION_GRACE", default_value = "10s", value_parser = duration)]
    pub activation_grace: Duration,
    /// After SIGTERM, how long in-flight requests may take before the gateway exits.
    #[arg(long, env = "HEARTH_DRAIN_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub drain_timeout: Duration,
    /// Largest request body, in bytes (suffixes Ki, Mi, Gi, k, M, G); larger gets 413.
    #[arg(long, env = "HEARTH_BODY_LIMIT", default_value = "8Mi", value_parser = byte_size)]
    pub body_limit: usize,
    /// Request-body bytes held at once (being read, or kept while the model starts); past it a
    /// request gets 503. At least --body-limit. Default: 256Mi, or half the container's memory
    /// limit (cgroup) when that is lower.
    #[arg(long, env = "HEARTH_BODY_MEMORY_LIMIT", value_parser = byte_size)]
    pub body_memory_limit: Option<usize>,
    /// Retry-After sent with 429 and 503.
    #[arg(long, env = "HEARTH_RETRY_AFTER", default_value = "5s", value_parser = duration)]
    pub retry_after: Duration,
    /// File of accepted API keys, one per line (a mounted Secret); absent: no authentication.
    #[arg(long, env = "HEARTH_API_KEY_FILE")]
    pub api_key_file: Option<PathBuf>,
    /// A tenant: `name=<dns-label>,key-file=<path>[,priority=<int>][,requests-per-minute=<n>][,tokens-per-minute=<n>]`.
    /// Its keys (one per line, a mounted Secret) name it; requests are dispatched by its
    /// priority band, fairly inside a band, and within its quotas. Repeatable; `name=default`
    /// (no key file needed) sets the band and quotas of requests without a tenant of their own.
    #[arg(long = "tenant", value_name = "SPEC", value_parser = crate::tenants::Tenant::parse)]
    pub tenants: Vec<crate::tenants::Tenant>,
    /// Requests in flight per ready backend replica; the rest wait in the gateway, dispatched
    /// by priority band and fair share. Match the engine's batch size (vLLM's --max-num-seqs).
    #[arg(long, env = "HEARTH_CONTAINER_CONCURRENCY", default_value_t = crate::fair::DEFAULT_CONTAINER_CONCURRENCY, value_parser = clap::value_parser!(u32).range(1..))]
    pub container_concurrency: u32,
    /// How often the API key file is re-read.
    #[arg(long, env = "HEARTH_API_KEY_RELOAD_INTERVAL", default_value = "10s", value_parser = duration)]
    pub api_key_reload_interval: Duration,
    /// Service whose EndpointSlices list the peer replicas' admin ports; enables demand
    /// aggregation.
    #[arg(long, env = "HEARTH_PEER_SERVICE")]
    pub peer_service: Option<String>,
    /// The LLMService this gateway serves (in --namespace). With --backend-service its `Ready`
    /// condition is followed: an activation failure answers held requests at once (needs list
    /// and watch on llmservices). The sleeping tier reports engines put to sleep and woken as
    /// Events on it, and the last wake in its status.lastWake (needs events.k8s.io create and
    /// patch, and patch on llmservices/status).
    #[arg(long, env = "HEARTH_LLMSERVICE")]
    pub llmservice: Option<String>,
    /// The LLMService's UID, which `kubectl describe` matches Events on.
    #[arg(long, env = "HEARTH_LLMSERVICE_UID", requires = "llmservice")]
    pub llmservice_uid: Option<String>,
    /// Name of the peer Service's admin port in the EndpointSlices (default: the only port, or
    /// "http").
    #[arg(long, env = "HEARTH_PEER_PORT_NAME")]
    pub peer_port_name: Option<String>,
    /// This pod's IPs, to leave itself out of the peers: every address, so a dual-stack pod is
    /// recognised in either family (downward API status.podIPs, comma-separated).
    #[arg(
        long = "pod-ip",
        env = "POD_IPS",
        value_name = "IP[,IP]",
        value_delimiter = ','
    )]
    pub pod_ips: Vec<std::net::IpAddr>,
    /// Metric name served to KEDA (GetMetricSpec/GetMetrics).
    #[arg(long, env = "HEARTH_METRIC_NAME", default_value = "hearth_queue_depth")]
    pub metric_name: String,
    /// Target demand per backend replica (targetSizeFloat), unless the trigger sets targetSize.
    #[arg(long, env = "HEARTH_METRIC_TARGET", default_value_t = 1.0)]
    pub metric_target: f64,
    /// HTTP worker threads, each with its own listener (SO_REUSEPORT) and backend pool
    /// (default: one per CPU).
    #[arg(long, env = "HEARTH_HTTP_WORKERS")]
    pub http_workers: Option<usize>,
    /// Timeout for connecting to a backend endpoint.
    #[arg(long, env = "HEARTH_CONNECT_TIMEOUT", default_value = "5s", value_parser = duration)]
    pub connect_timeout: Duration,
    /// Time a client has to send a request's header section, and the most a keep-alive client
    /// connection may sit idle between requests.
    #[arg(long, env = "HEARTH_HEADER_READ_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub header_read_timeout: Duration,
    /// Time a client has to send a request's body after its header section (408 after it).
    #[arg(long, env = "HEARTH_BODY_READ_TIMEOUT", default_value = "60s", value_parser = duration)]
    pub body_read_timeout: Duration,
    /// How long an unused backend connection is kept for reuse; below the backend's keep-alive
    /// timeout (vLLM: 5s).
    #[arg(long, env = "HEARTH_BACKEND_IDLE_TIMEOUT", default_value = "4s", value_parser = duration)]
    pub backend_idle_timeout: Duration,
    /// HTTP/2 PING interval on ExternalScaler connections; one unanswered for as long closes
    /// the connection (a KEDA connection that died without closing).
    #[arg(long, env = "HEARTH_SCALER_KEEPALIVE", default_value = "30s", value_parser = duration)]
    pub scaler_keepalive: Duration,
    /// Turns the sleeping tier on: once the demand summed over every gateway replica has been
    /// 0 this long, the backend engines are put to sleep; demand wakes them (absent: never).
    #[arg(long, env = "HEARTH_SLEEP_AFTER", value_parser = duration)]
    pub sleep_after: Option<Duration>,
    /// Sleep level sent to the engine: 1 (weights offloaded to CPU memory) or 2 (dropped).
    #[arg(long, env = "HEARTH_SLEEP_LEVEL", default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=2))]
    pub sleep_level: u8,
    /// The engine's sleep call: POST <path>?level=<level>.
    #[arg(long, env = "HEARTH_SLEEP_PATH", default_value = "/sleep")]
    pub sleep_path: String,
    /// The engine's sleep state: GET <path> answers {"is_sleeping": bool}.
    #[arg(long, env = "HEARTH_IS_SLEEPING_PATH", default_value = "/is_sleeping")]
    pub is_sleeping_path: String,
    /// One call of the wake-up, in order, repeated: `PATH` (POST without a body) or
    /// `PATH JSON` (POST with that JSON body). Default: /wake_up.
    #[arg(long = "wake-up-call", value_name = "PATH [JSON]")]
    pub wake_up_calls: Vec<String>,
}

impl ServeArgs {
    /// The settings, checked.
    ///
    /// # Errors
    /// A [`CliError`] naming the flag when a value makes no sense.
    pub fn gateway_config(&self) -> Result<GatewayConfig, CliError> {
        self.gateway_config_in(crate::budget::container_memory_limit())
    }

    /// [`Self::gateway_config`] in a container limited to `container_memory` bytes.
    fn gateway_config_in(&self, container_memory: Option<u64>) -> Result<GatewayConfig, CliError> {
        if self.http_workers == Some(0) {
            return Err(err("--http-workers", "must be at least 1"));
        }
        if self.max_queue == 0 {
            return Err(err("--max-queue", "must be at least 1"));
        }
        if self.heartbeat_interval.is_zero() {
            return Err(err("--heartbeat-interval", "must be positive, like \"5s\""));
        }
        if self.activation_timeout.is_zero() {
            return Err(err("--activation-timeout", "must be positive, like \"5m\""));
        }
        if self.header_read_timeout < Duration::from_secs(1) {
            return Err(err(
                "--header-read-timeout",
                "must be at least 1s (it is enforced to within a second), like \"30s\"",
            ));
        }
        if self.body_read_timeout < Duration::from_secs(1) {
            return Err(err(
                "--body-read-timeout",
                "must be at least 1s (it is enforced to within a second), like \"60s\"",
            ));
        }
        if self.backend_idle_timeout.is_zero() {
            return Err(err(
                "--backend-idle-timeout",
                "must be positive and below the backend's keep-alive timeout, like \"4s\"",
            ));
        }
        if self.scaler_keepalive < Duration::from_secs(1) {
            return Err(err(
                "--scaler-keepalive",
                "must be at least 1s, like \"30s\"",
            ));
        }
        if self.body_limit == 0 {
            return Err(err("--body-limit", "must be positive, like \"8Mi\""));
        }
        let body_memory_limit = match self.body_memory_limit {
            Some(n) if n < self.body_limit => {
                return Err(err(
                    "--body-memory-limit",
                    format!(
                        "must be at least --body-limit ({} bytes), or a request of the largest accepted size could never be read",
                        self.body_limit
                    ),
                ));
            }
            Some(n) => {
                if let Some(limit) = container_memory.filter(|l| n as u64 >= *l) {
                    tracing::warn!(
                        body_memory_limit = n,
                        container_memory_limit = limit,
                        "--body-memory-limit is not below the container's memory limit: held request bodies can get the replica OOM-killed"
                    );
                }
                n
            }
            None => {
                let n = crate::budget::default_limit(container_memory);
                if n < self.body_limit {
                    let body_limit = self.body_limit;
                    let message = if n == crate::budget::DEFAULT_LIMIT {
                        format!(
                            "defaults to {n} bytes, below --body-limit ({body_limit} bytes); set --body-memory-limit to at least --body-limit, or lower --body-limit"
                        )
                    } else {
                        format!(
                            "defaults to half the container's memory limit ({n} bytes here), below --body-limit ({body_limit} bytes); raise the memory limit, lower --body-limit, or set --body-memory-limit"
                        )
                    };
                    return Err(err("--body-memory-limit", message));
                }
                n
            }
        };
        if self.api_key_reload_interval < crate::apikeys::MIN_RELOAD_INTERVAL {
            return Err(err(
                "--api-key-reload-interval",
                "must be at least 100ms, like \"10s\"",
            ));
        }
        if !(self.metric_target.is_finite() && self.metric_target > 0.0) {
            return Err(err("--metric-target", "must be a positive number, like 1"));
        }
        if self.metric_name.trim().is_empty() {
            return Err(err("--metric-name", "must not be empty"));
        }
        if self.served_model_name.iter().any(|n| n.trim().is_empty()) {
            return Err(err("--served-model-name", "names must not be empty"));
        }
        for alias in &self.model_alias {
            if alias.trim().is_empty() {
                return Err(err("--model-alias", "names must not be empty"));
            }
            if self.served_model_name.contains(alias) {
                return Err(err(
                    "--model-alias",
                    format!(
                        "{alias:?} is a --served-model-name already; leave it out of the aliases"
                    ),
                ));
            }
        }
        if self.peer_service.is_some() && self.pod_ips.is_empty() {
            return Err(err(
                "--pod-ip",
                "required with --peer-service so the replica leaves itself out of its peers (set env POD_IPS from the downward API status.podIPs)",
            ));
        }
        if let Some(name) = &self.routes_configmap
            && !is_object_name(name)
        {
            return Err(err(
                "--routes-configmap",
                format!("{name:?} is not a ConfigMap name, like \"models-routes\""),
            ));
        }
        if let Some(name) = &self.adapters_configmap
            && !is_object_name(name)
        {
            return Err(err(
                "--adapters-configmap",
                format!("{name:?} is not a ConfigMap name, like \"qwen-chat-adapters\""),
            ));
        }
        if self.routes_configmap.is_none()
            && self.backend_service.is_none()
            && self.backend_url.is_none()
        {
            return Err(err(
                "--backend-service",
                "set --backend-service (EndpointSlice discovery) or --backend-url (a fixed backend), or --routes-configmap (a shared gateway)",
            ));
        }
        self.fallback_authority()?;
        let sleep = self.sleep_config()?;
        let tenants =
            crate::tenants::Tenants::new(self.tenants.clone()).map_err(|e| err("--tenant", e))?;
        Ok(GatewayConfig {
            service_key: self.service_key()?,
            served_model_names: self.served_model_name.clone(),
            model_aliases: self.model_alias.clone(),
            max_queue: self.max_queue,
            container_concurrency: self.container_concurrency,
            tenants,
            cold_start: self.cold_start,
            heartbeat_interval: self.heartbeat_interval,
            activation_timeout: self.activation_timeout,
            activation_grace: self.activation_grace,
            drain_timeout: self.drain_timeout,
            body_limit: self.body_limit,
            body_memory_limit,
            retry_after: self.retry_after,
            metric_name: self.metric_name.clone(),
            metric_target: self.metric_target,
            aggregate_peers: self.peer_service.is_some(),
            connect_timeout: self.connect_timeout,
            header_read_timeout: self.header_read_timeout,
            body_read_timeout: self.body_read_timeout,
            backend_idle_timeout: self.backend_idle_timeout,
            scaler_keepalive: self.scaler_keepalive,
            sleep,
        })
    }

    /// The single-service gateway's key: `--service-key`, else `<--namespace>/<--llmservice>`.
    fn service_key(&self) -> Result<Option<String>, CliError> {
        let key = match (&self.service_key, &self.llmservice) {
            (Some(key), _) => key.clone(),
            (None, Some(service)) => format!("{}/{service}", self.namespace),
            (None, None) => return Ok(None),
        };
        match key.split_once('/') {
            Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
                Ok(Some(key))
            }
            _ => Err(err(
                "--service-key",
                format!(
                    "{key:?} must be <namespace>/<name> of the LLMService, like \"team-a/qwen-chat\""
                ),
            )),
        }
    }

    /// The sleeping tier's settings, when `--sleep-after` is set.
    fn sleep_config(&self) -> Result<Option<SleepConfig>, CliError> {
        let Some(after) = self.sleep_after else {
            return Ok(None);
        };
        if after.is_zero() {
            return Err(err("--sleep-after", "must be positive, like \"5m\""));
        }
        for (flag, path) in [
            ("--sleep-path", &self.sleep_path),
            ("--is-sleeping-path", &self.is_sleeping_path),
        ] {
            if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
                return Err(err(
                    flag,
                    format!("{path:?} must be an absolute path, like \"/sleep\""),
                ));
            }
        }
        let calls: &[String] = if self.wake_up_calls.is_empty() {
            &[String::from("/wake_up")]
        } else {
            &self.wake_up_calls
        };
        let wake_up = calls
            .iter()
            .map(|c| {
                c.parse::<EngineCall>()
                    .map_err(|e| err("--wake-up-call", e))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Some(SleepConfig {
            level: self.sleep_level,
            after,
            sleep_path: self.sleep_path.clone(),
            is_sleeping_path: self.is_sleeping_path.clone(),
            wake_up,
            // A wake-up may reload the weights; a held request waits no longer than this.
            call_timeout: self.activation_timeout,
        }))
    }

    /// `host:port` of the fallback backend: `--backend-url`, else the backend Service's DNS name.
    ///
    /// # Errors
    /// When `--backend-url` is not an `http://host[:port]` URL.
    pub fn fallback_authority(&self) -> Result<Option<Authority>, CliError> {
        if let Some(url) = &self.backend_url {
            if url.scheme_str() != Some("http") {
                return Err(err(
                    "--backend-url",
                    format!("{url} must be an http:// URL (the backend speaks plain HTTP)"),
                ));
            }
            if url.path() != "/" && !url.path().is_empty() {
                return Err(err(
                    "--backend-url",
                    format!("{url} must have no path; request paths are passed through"),
                ));
            }
            let Some(auth) = url.authority() else {
                return Err(err("--backend-url", format!("{url} has no host")));
            };
            let auth = if auth.port().is_some() {
                auth.clone()
            } else {
                format!("{}:80", auth.host())
                    .parse()
                    .map_err(|e| err("--backend-url", format!("{e}")))?
            };
            return Ok(Some(auth));
        }
        match &self.backend_service {
            Some(svc) => format!("{svc}.{}.svc:{}", self.namespace, self.backend_port)
                .parse()
                .map(Some)
                .map_err(|e| {
                    err(
                        "--backend-service",
                        format!("{svc:?} is not a valid DNS name: {e}"),
                    )
                }),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("hearth-gateway").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn cli_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn serve_flags_build_a_config() {
        let cli = parse(&[
            "--backend-service=stub-svc",
            "--namespace=hearth-e2e",
            "--cold-start=reject",
            "--heartbeat-interval=2s",
            "--activation-timeout=2m",
            "--body-limit=1Mi",
            "--served-model-name=stub-svc",
        ]);
        assert!(cli.command.is_none());
        let cfg = cli.serve.gateway_config().unwrap();
        assert_eq!(cfg.cold_start, ColdStartMode::Reject);
        assert_eq!(cfg.heartbeat_interval, Duration::from_secs(2));
        assert_eq!(cfg.activation_timeout, Duration::from_secs(120));
        assert_eq!(cfg.body_limit, 1 << 20);
        assert_eq!(
            cli.serve.fallback_authority().unwrap().unwrap().as_str(),
            "stub-svc.hearth-e2e.svc:8000"
        );
    }

    #[test]
    fn sleep_flags_build_the_sleeping_tier() {
        let off = parse(&["--backend-service=svc"])
            .serve
            .gateway_config()
            .unwrap();
        assert_eq!(off.sleep, None);
        let cli = parse(&[
            "--backend-service=svc",
            "--activation-timeout=2m",
            "--sleep-after=90s",
            "--sleep-level=2",
            "--wake-up-call=/wake_up?tags=weights",
            r#"--wake-up-call=/collective_rpc {"method":"reload_weights"}"#,
            "--wake-up-call=/wake_up?tags=kv_cache",
        ]);
        let sleep = cli.serve.gateway_config().unwrap().sleep.unwrap();
        assert_eq!(sleep.after, Duration::from_secs(90));
        assert_eq!(sleep.level, 2);
        assert_eq!(sleep.sleep_path, "/sleep");
        assert_eq!(sleep.is_sleeping_path, "/is_sleeping");
        assert_eq!(sleep.call_timeout, Duration::from_secs(120));
        let calls: Vec<String> = sleep.wake_up.iter().map(ToString::to_string).collect();
        assert_eq!(
            calls,
            [
                "/wake_up?tags=weights",
                r#"/collective_rpc {"method":"reload_weights"}"#,
                "/wake_up?tags=kv_cache"
            ]
        );
        let default = parse(&["--backend-service=svc", "--sleep-after=1m"]);
        let calls = default
            .serve
            .gateway_config()
            .unwrap()
            .sleep
            .unwrap()
            .wake_up;
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].path_and_query.as_str(), "/wake_up");
    }

    #[test]
    fn bad_sleep_flags_name_the_flag() {
        for (args, flag) in [
            (&["--sleep-after=0s"][..], "--sleep-after"),
            (
                &["--sleep-after=1m", "--sleep-path=sleep"][..],
                "--sleep-path",
            ),
            (
                &["--sleep-after=1m", "--is-sleeping-path=is sleeping"][..],
                "--is-sleeping-path",
            ),
            (
                &["--sleep-after=1m", "--wake-up-call=/wake_up {oops"][..],
                "--wake-up-call",
            ),
        ] {
            let mut all = vec!["--backend-service=svc"];
            all.extend_from_slice(args);
            let e = parse(&all).serve.gateway_config().unwrap_err();
            assert!(e.to_string().starts_with(flag), "{args:?}: {e}");
        }
        assert!(
            Cli::try_parse_from(["hearth-gateway", "--sleep-level=3"]).is_err(),
            "levels are 1 and 2"
        );
    }

    #[test]
    fn drain_subcommand_parses() {
        let cli = parse(&[
            "drain",
            "--url",
            "http://127.0.0.1:8000/metrics",
            "--timeout",
            "2m",
        ]);
        let Some(Command::Drain(d)) = cli.command else {
            panic!("expected drain")
        };
        assert_eq!(d.timeout, Duration::from_secs(120));
    }

    #[test]
    fn bad_values_name_the_flag() {
        let e = Cli::try_parse_from(["hearth-gateway", "--heartbeat-interval=5"]).unwrap_err();
        assert!(e.to_string().contains("--heartbeat-interval"), "{e}");
        let cli = parse(&["--backend-url=https://x:1"]);
        let e = cli.serve.gateway_config().unwrap_err();
        assert_eq!(e.flag, "--backend-url");
        let cli = parse(&[]);
        assert_eq!(
            cli.serve.gateway_config().unwrap_err().flag,
            "--backend-service"
        );
        let cli = parse(&["--backend-url=http://x:1", "--peer-service=gw"]);
        assert_eq!(cli.serve.gateway_config().unwrap_err().flag, "--pod-ip");
        let cli = parse(&[
            "--backend-url=http://x:1",
            "--body-limit=8Mi",
            "--body-memory-limit=1Mi",
        ]);
        assert_eq!(
            cli.serve.gateway_config().unwrap_err().flag,
            "--body-memory-limit"
        );
        let cli = parse(&["--backend-url=http://x:1", "--body-limit=8Mi"]);
        let e = cli.serve.gateway_config_in(Some(12 << 20)).unwrap_err();
        assert_eq!(e.flag, "--body-memory-limit");
        assert!(e.message.contains("raise the memory limit"), "{e}");
        let cli = parse(&["--backend-url=http://x:1", "--body-limit=300Mi"]);
        let e = cli.serve.gateway_config_in(None).unwrap_err();
        assert_eq!(e.flag, "--body-memory-limit");
        assert!(
            !e.message.contains("container"),
            "no container limit here: {e}"
        );
        let cli = parse(&["--backend-url=http://x:1", "--max-queue=0"]);
        assert_eq!(cli.serve.gateway_config().unwrap_err().flag, "--max-queue");
    }

    #[test]
    fn the_body_memory_limit_follows_the_container_unless_given() {
        let cli = parse(&["--backend-url=http://x:1"]);
        let cfg = |c: &Cli, mem| c.serve.gateway_config_in(mem).unwrap().body_memory_limit;
        assert_eq!(cfg(&cli, None), 256 << 20);
        assert_eq!(cfg(&cli, Some(128 << 20)), 64 << 20);
        let cli = parse(&["--backend-url=http://x:1", "--body-memory-limit=200Mi"]);
        assert_eq!(
            cfg(&cli, Some(128 << 20)),
            200 << 20,
            "given: kept, with a warning"
        );
    }

    #[test]
    fn pod_ip_takes_every_address_of_a_dual_stack_pod() {
        let cli = parse(&["--backend-url=http://x:1", "--pod-ip=10.0.0.7,fd00::7"]);
        let want: Vec<std::net::IpAddr> =
            vec!["10.0.0.7".parse().unwrap(), "fd00::7".parse().unwrap()];
        assert_eq!(cli.serve.pod_ips, want);
        let e = Cli::try_parse_from(["hearth-gateway", "--pod-ip=10.0.0.7,pod-a"]).unwrap_err();
        assert!(e.to_string().contains("--pod-ip"), "{e}");
    }

    #[test]
    fn the_routes_configmap_makes_a_shared_gateway_and_refuses_per_service_flags() {
        let cli = parse(&["--routes-configmap=models-routes", "--namespace=ai"]);
        assert_eq!(cli.serve.routes_configmap.as_deref(), Some("models-routes"));
        let cfg = cli.serve.gateway_config().unwrap();
        assert_eq!(cfg.service_key, None);
        for flag in [
            "--backend-service=svc",
            "--backend-url=http://x:1",
            "--served-model-name=m",
            "--max-queue=5",
            "--cold-start=reject",
            "--activation-timeout=1m",
            "--sleep-after=5m",
            "--service-key=ns/a",
        ] {
            let e = Cli::try_parse_from(["hearth-gateway", "--routes-configmap=r", flag])
                .unwrap_err()
                .to_string();
            let name = flag.split('=').next().unwrap();
            assert!(
                e.contains("--routes-configmap") && e.contains(name),
                "{flag}: {e}"
            );
        }
        let e = parse(&["--routes-configmap=a/b"])
            .serve
            .gateway_config()
            .unwrap_err();
        assert_eq!(e.flag, "--routes-configmap");
    }

    #[test]
    fn the_adapters_configmap_needs_a_served_model_and_a_configmap_name() {
        let args = [
            "--backend-service=qwen-chat-backend",
            "--served-model-name=qwen-chat",
            "--adapters-configmap=qwen-chat-adapters",
        ];
        let cli = parse(&args);
        assert_eq!(
            cli.serve.adapters_configmap.as_deref(),
            Some("qwen-chat-adapters")
        );
        assert!(cli.serve.gateway_config().is_ok());
        let e = Cli::try_parse_from([
            "hearth-gateway",
            "--backend-service=s",
            "--adapters-configmap=a",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--served-model-name"), "{e}");
        let e = Cli::try_parse_from([
            "hearth-gateway",
            "--routes-configmap=r",
            "--adapters-configmap=a",
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("--routes-configmap"), "{e}");
        let e = parse(&[
            "--backend-service=s",
            "--served-model-name=m",
            "--adapters-configmap=Bad_Name",
        ])
        .serve
        .gateway_config()
        .unwrap_err();
        assert_eq!(e.flag, "--adapters-configmap");
    }

    #[test]
    fn the_service_key_is_given_or_derived_from_the_llmservice() {
        let key = |args: &[&str]| {
            let mut all = vec!["--backend-url=http://x:1"];
            all.extend_from_slice(args);
            parse(&all).serve.gateway_config().map(|c| c.service_key)
        };
        assert_eq!(key(&[]).unwrap(), None);
        assert_eq!(
            key(&["--namespace=team-a", "--llmservice=qwen"]).unwrap(),
            Some("team-a/qwen".to_owned())
        );
        assert_eq!(
            key(&["--service-key=team-b/phi", "--llmservice=qwen"]).unwrap(),
            Some("team-b/phi".to_owned())
        );
        for bad in ["phi", "/phi", "a/", "a/b/c"] {
            let e = key(&[&format!("--service-key={bad}")]).unwrap_err();
            assert_eq!(e.flag, "--service-key", "{bad}");
        }
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(byte_size("10").unwrap(), 10);
        assert_eq!(byte_size("8Mi").unwrap(), 8 << 20);
        assert_eq!(byte_size("2k").unwrap(), 2000);
        assert!(byte_size("8MB").unwrap_err().contains("Ki, Mi"));
        assert!(byte_size("x").is_err());
    }
}

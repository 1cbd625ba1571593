//! `hearth-controller`: `run` reconciles LLMServices in a cluster; `render` prints the children
//! of one LLMService offline, like `helm template`.

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::ExitCode,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand};
use futures::FutureExt as _;
use hearth_controller::{
    leader::{self, LeaseConfig},
    metrics::{Metrics, Serving},
    prepull::PrePullConfig,
    reconcile::RunConfig,
    render::{self, RenderConfig, default_gateway_image},
};
use hearth_crds::{InferenceRuntime, LLMService};
use hearth_net::process::{self, LogFormat, Setup, Signals};
use kube::{Client, Config, client::ClientBuilder};

/// `leaseDurationSeconds` of the leader-election Lease: how long a holder that stopped without
/// releasing it (killed, partitioned) keeps it. client-go's default.
const LEASE_DURATION: Duration = Duration::from_secs(15);
/// How often the holder renews the Lease and a standby tries to take it.
const LEASE_RENEW_INTERVAL: Duration = Duration::from_secs(2);

#[derive(Parser)]
#[command(
    name = "hearth-controller",
    version = hearth_net::version!(),
    about = "Reconciles Hearth LLMServices into workloads, Services and KEDA objects"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the controller against the cluster of the current kubeconfig (or in-cluster config).
    Run(Box<RunArgs>),
    /// Print the children of one LLMService as YAML, without a cluster.
    Render(Box<RenderArgs>),
}

#[derive(Args)]
struct ImageArgs {
    /// Image of the hearth-gateway binary, run by each service's gateway Deployment.
    #[arg(long, env = "HEARTH_GATEWAY_IMAGE", default_value_t = default_gateway_image())]
    gateway_image: String,
    /// Image of the backend drain sidecar (`hearth-gateway drain --listen`) in LLMService
    /// backends; default: the gateway image. Pin it to keep a Hearth upgrade from changing the
    /// backend pod template (which rolls every model); empty: no sidecar, a `sleep` preStop.
    #[arg(long, env = "HEARTH_DRAIN_IMAGE")]
    drain_image: Option<String>,
    /// Resources of each service's gateway container, as a Kubernetes ResourceRequirements in
    /// JSON; default: requests cpu 50m and memory 64Mi, limit memory 512Mi.
    #[arg(long, env = "HEARTH_GATEWAY_RESOURCES")]
    gateway_resources: Option<String>,
    /// Node directory used by `cache.strategy: HostPath`.
    #[arg(
        long,
        env = "HEARTH_HOST_PATH_ROOT",
        default_value = "/var/lib/hearth/models"
    )]
    host_path_root: String,
    /// NetworkPolicies on the gateway and backend pods of every LLMService and LLMEndpoint
    /// (`N-gateway`, `N-backend`), as JSON: `{"clientsFrom": [peer], "metricsFrom": [peer],
    /// "kedaNamespace": "keda", "controllerNamespace": "...", "controllerPodLabels": {...}}`
    /// (peers as in a NetworkPolicy; the chart writes it from `networkPolicy.models`); unset:
    /// none, and those written before are deleted.
    #[arg(long, env = "HEARTH_MODEL_NETWORK_POLICIES", value_parser = render::ModelNetworkPolicies::parse)]
    model_network_policies: Option<render::ModelNetworkPolicies>,
    /// Model sources for the whole cluster, as JSON: `{"env": [{"name": "HF_ENDPOINT", "value":
    /// "https://hf-mirror.example"}], "caBundle": {"configMap": "corp-ca", "key": "ca.crt"}}`:
    /// variables (a hub mirror, a proxy) for every engine, prewarm Job and adapter fetch Job,
    /// and a CA bundle ConfigMap of that name in each model namespace they trust (the chart
    /// writes it from `modelSources`); unset: none.
    #[arg(long, env = "HEARTH_MODEL_SOURCES", value_parser = render::ModelSources::parse)]
    model_sources: Option<render::ModelSources>,
}

impl ImageArgs {
    fn render_config(&self) -> anyhow::Result<RenderConfig> {
        let drain_image = match &self.drain_image {
            None => Some(self.gateway_image.clone()),
            Some(i) if i.is_empty() => None,
            Some(i) => Some(i.clone()),
        };
        hearth_policies::PolicySettings {
            drain_image: drain_image.clone(),
        }
        .validate()
        .map_err(|e| anyhow::anyhow!("--drain-image: {e}"))?;
        let gateway_resources = match &self.gateway_resources {
            Some(json) => render::parse_gateway_resources(json)
                .map_err(|e| anyhow::anyhow!("--gateway-resources: {e}"))?,
            None => render::default_gateway_resources(),
        };
        Ok(RenderConfig {
            gateway_image: self.gateway_image.clone(),
            gateway_resources,
            drain_image,
            host_path_root: self.host_path_root.clone(),
            network_policies: self.model_network_policies.clone(),
            model_sources: self.model_sources.clone().unwrap_or_default(),
            ..RenderConfig::builtin()?
        })
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    images: ImageArgs,
    /// Watch only this namespace (default: all namespaces).
    #[arg(long, env = "HEARTH_WATCH_NAMESPACE")]
    namespace: Option<String>,
    /// Address of the /metrics, /healthz and /readyz endpoint. `[::]` is every address, IPv4
    /// and IPv6 (IPv4 only on a host without IPv6).
    #[arg(
        long,
        env = "HEARTH_METRICS_ADDR",
        default_value = "[::]:8080",
        value_parser = hearth_net::parse_listen
    )]
    metrics_addr: SocketAddr,
    /// Serve /metrics over HTTPS and only to scrapers whose bearer token the apiserver
    /// authenticates (TokenReview) and authorizes for GET /metrics (SubjectAccessReview).
    /// `false`: plain HTTP to anyone. /healthz and /readyz never need a token.
    #[arg(long, env = "HEARTH_METRICS_SECURE", default_value_t = true, action = clap::ArgAction::Set)]
    metrics_secure: bool,
    /// PEM certificate chain of the metrics server (such as a mounted Secret's tls.crt);
    /// without it a self-signed certificate is made at start.
    #[arg(long, requires = "metrics_key_file")]
    metrics_cert_file: Option<PathBuf>,
    /// PEM private key of --metrics-cert-file.
    #[arg(long, requires = "metrics_cert_file")]
    metrics_key_file: Option<PathBuf>,
    /// Without --metrics-cert-file and with the scaler CA (--scaler-tls): issue the metrics
    /// server's certificate from that CA, and publish the CA (`ca.crt`) in this ConfigMap of
    /// the controller's namespace, for scrapers to verify the server with (the chart's
    /// ServiceMonitor); empty: a self-signed certificate, published nowhere.
    #[arg(long, env = "HEARTH_METRICS_CA_CONFIGMAP", default_value = "")]
    metrics_ca_configmap: String,
    /// Take a coordination.k8s.io Lease before reconciling, so only one replica works.
    #[arg(long, env = "HEARTH_LEADER_ELECT", default_value_t = true, action = clap::ArgAction::Set)]
    leader_elect: bool,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "hearth-system")]
    leader_election_namespace: String,
    /// Name of the leader-election Lease.
    #[arg(long, default_value = "hearth-controller")]
    leader_election_name: String,
    /// Periodic resync of every LLMService, in seconds.
    #[arg(long, default_value_t = 300)]
    resync_seconds: u64,
    /// Reconciles running at once.
    #[arg(long, default_value_t = 16)]
    concurrency: u16,
    /// Log as JSON lines.
    #[arg(long, env = "HEARTH_LOG_JSON", default_value_t = false)]
    log_json: bool,
    /// Render backends with the cluster's ServingPolicies after the built-ins, as the webhook
    /// evaluates them (needs list/watch on servingpolicies); false: the built-ins only.
    #[arg(long, env = "HEARTH_CLUSTER_POLICIES", default_value_t = true, action = clap::ArgAction::Set)]
    cluster_policies: bool,
    /// Background policy scans: the workloads that already run (Deployments and StatefulSets
    /// annotated for Hearth) evaluated against the ServingPolicies at start, when a policy
    /// changes and every --policy-scan-interval; results in Policy Reports
    /// (wgpolicyk8s.io/v1alpha2, when its CRD is installed) and each policy's `status.scan`.
    /// Needs --cluster-policies.
    #[arg(long, env = "HEARTH_POLICY_SCAN", default_value_t = true, action = clap::ArgAction::Set)]
    policy_scan: bool,
    /// Time between periodic policy scans; 0s: only at start and on policy changes.
    #[arg(long, env = "HEARTH_POLICY_SCAN_INTERVAL", default_value = "1h", value_parser = go_duration)]
    policy_scan_interval: Duration,
    /// Workloads a policy scan evaluates per second, at most (its pace: the controller's CPU
    /// stays with its reconciles, and the apiserver is not flooded with report writes).
    #[arg(long, env = "HEARTH_POLICY_SCAN_RATE", default_value_t = 200, value_parser = clap::value_parser!(u32).range(1..))]
    policy_scan_rate: u32,
    /// Export each ServingPolicy the apiserver can run to a ValidatingAdmissionPolicy and/or
    /// MutatingAdmissionPolicy (with bindings), so it holds without the webhook, which then
    /// stops evaluating it; each policy's `status.export` says where it runs or why it cannot.
    /// Needs --cluster-policies and RBAC on those kinds.
    #[arg(long, env = "HEARTH_POLICY_EXPORT", default_value_t = false, action = clap::ArgAction::Set)]
    policy_export: bool,
    /// Time between export passes without a change (a pass also runs when a policy or an
    /// InferenceRuntime changes).
    #[arg(long, env = "HEARTH_POLICY_EXPORT_INTERVAL", default_value = "5m", value_parser = go_duration)]
    policy_export_interval: Duration,
    /// Export only the ServingPolicies this label selector selects (`team=ml,tier!=dev`);
    /// empty: all.
    #[arg(long, env = "HEARTH_POLICY_EXPORT_SELECTOR", default_value = "")]
    policy_export_selector: String,
    /// Device handover: a cold service whose backend pod cannot be scheduled for lack of its
    /// accelerator may take an idle service's (lower or equal `spec.scaling.priority`, past its
    /// `minResidency`, no request in flight) to zero through KEDA's pause; false: services
    /// wait for devices to free by themselves.
    #[arg(long, env = "HEARTH_DEVICE_HANDOVER", default_value_t = true, action = clap::ArgAction::Set)]
    device_handover: bool,
    /// Mutual TLS between KEDA and a push-mode service's own gateway: the controller issues the
    /// gateway's certificate and KEDA's from its scaler CA (Secrets `N-scaler-tls` and
    /// `N-scaler-client-tls`, TriggerAuthentication `N-scaler`); false: plain gRPC.
    #[arg(long, env = "HEARTH_SCALER_TLS", default_value_t = true, action = clap::ArgAction::Set)]
    scaler_tls: bool,
    /// Lifetime of the ExternalScaler certificates (issued again two thirds into it; at least
    /// 1h).
    #[arg(long, env = "HEARTH_SCALER_CERT_VALIDITY", default_value = "2160h", value_parser = go_duration)]
    scaler_cert_validity: Duration,
    /// Lifetime of the scaler CA, made when the keys Secret (--admin-keys-secret) has none
    /// (fields `scaler-ca.crt`, `scaler-ca.key`, `scaler-ca.not-after`); at least twice
    /// --scaler-cert-validity.
    #[arg(long, env = "HEARTH_SCALER_CA_VALIDITY", default_value = "87600h", value_parser = go_duration)]
    scaler_ca_validity: Duration,
    /// Bearer tokens on the gateways' admin ports: each gateway gets its admin Secret
    /// (`N-gateway-admin`), KEDA's `metrics-api` triggers authenticate through the
    /// ClusterTriggerAuthentication --gateway-admin-trigger-auth; false: admin ports open to
    /// anyone who reaches them.
    #[arg(long, env = "HEARTH_GATEWAY_ADMIN_AUTH", default_value_t = true, action = clap::ArgAction::Set)]
    gateway_admin_auth: bool,
    /// The Secret in the controller's namespace (--leader-election-namespace, POD_NAMESPACE)
    /// holding the controller's keys: the one every admin token derives from (`admin-key`,
    /// with --gateway-admin-auth) and the scaler CA (with --scaler-tls); a missing or empty
    /// one is written anew (RBAC: get and update on this name, create on Secrets).
    #[arg(
        long,
        env = "HEARTH_ADMIN_KEYS_SECRET",
        default_value = "hearth-controller-keys"
    )]
    admin_keys_secret: String,
    /// `NAMESPACE/NAME` of the Secret the controller writes KEDA's admin token into (key
    /// `token`): KEDA's namespace, read by the ClusterTriggerAuthentication; empty: not written.
    #[arg(
        long,
        env = "HEARTH_KEDA_TOKEN_SECRET",
        default_value = "keda/hearth-gateway-keda"
    )]
    keda_token_secret: String,
    /// `[NAMESPACE/]NAME` of the Secret the controller writes the scrapers' admin token into
    /// (key `token`, read by the chart's PodMonitor; namespace default: the controller's);
    /// empty: not written.
    #[arg(
        long,
        env = "HEARTH_METRICS_TOKEN_SECRET",
        default_value = "hearth-gateway-metrics"
    )]
    metrics_token_secret: String,
    /// `NAMESPACE/NAME` of the Secret (in KEDA's namespace, made empty by the chart) the
    /// controller writes KEDA's client certificate for every LLMEndpoint's shared gateway into
    /// (`ca.crt`, `tls.crt`, `tls.key`; kept in --admin-keys-secret), read by the
    /// ClusterTriggerAuthentication --shared-scaler-trigger-auth; with --scaler-tls. Empty: the
    /// shared gateways serve the ExternalScaler in plain gRPC.
    #[arg(
        long,
        env = "HEARTH_KEDA_SCALER_SECRET",
        default_value = "keda/hearth-scaler-keda"
    )]
    keda_scaler_secret: String,
    /// Name of the ClusterTriggerAuthentication the push triggers of models on shared gateways
    /// use (mutual TLS, see --keda-scaler-secret).
    #[arg(long, env = "HEARTH_SHARED_SCALER_TRIGGER_AUTH", default_value = hearth_controller::render::DEFAULT_SHARED_SCALER_TRIGGER_AUTH)]
    shared_scaler_trigger_auth: String,
    /// Name of the ClusterTriggerAuthentication KEDA's `metrics-api` triggers use.
    #[arg(long, env = "HEARTH_GATEWAY_ADMIN_TRIGGER_AUTH", default_value = hearth_controller::render::DEFAULT_ADMIN_TRIGGER_AUTH)]
    gateway_admin_trigger_auth: String,
    /// Namespace of the DaemonSets that pre-pull the images of runtimes with `spec.prePull`
    /// (the controller's own, which the chart sets); unset or empty: no pre-pull (and
    /// `prePull` has no effect).
    #[arg(long, env = "HEARTH_PRE_PULL_NAMESPACE")]
    pre_pull_namespace: Option<String>,
    /// Image of the container that holds each pre-pull pod once the runtime's image is pulled.
    #[arg(
        long,
        env = "HEARTH_PAUSE_IMAGE",
        default_value = "registry.k8s.io/pause:3.10"
    )]
    pause_image: String,
}

#[derive(Args)]
struct RenderArgs {
    #[command(flatten)]
    images: ImageArgs,
    /// The LLMService manifest (YAML).
    #[arg(short = 'f', long = "filename")]
    file: PathBuf,
    /// The InferenceRuntime manifest it uses (YAML).
    #[arg(long)]
    runtime: PathBuf,
    /// Namespace for a manifest that names none.
    #[arg(short, long, default_value = "default")]
    namespace: String,
    /// Platform ServingPolicy manifests (files or directories) to render with after the
    /// built-ins, as the controller does with the cluster's; repeatable.
    #[arg(long = "policy")]
    policies: Vec<PathBuf>,
    /// LLMAdapter manifests (a multi-document YAML file) on the service: each is checked by
    /// the rule the controller accepts adapters by; an adapter not accepted is an error naming
    /// why, an accepted one is rendered.
    #[arg(long = "adapters")]
    adapters: Option<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Render(args) => process::exit_code(render(*args)),
        Command::Run(args) => {
            let setup = Setup {
                log_format: if args.log_json {
                    LogFormat::Json
                } else {
                    LogFormat::Text
                },
                default_filter: "info,kube=warn",
            };
            process::main(setup, run(*args))
        }
    }
}

fn render(args: RenderArgs) -> anyhow::Result<()> {
    let read = |p: &PathBuf| {
        std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))
    };
    let mut service: LLMService = serde_yaml::from_str(&read(&args.file)?)
        .with_context(|| format!("{} is not an LLMService", args.file.display()))?;
    let runtime: InferenceRuntime = serde_yaml::from_str(&read(&args.runtime)?)
        .with_context(|| format!("{} is not an InferenceRuntime", args.runtime.display()))?;
    if service.metadata.namespace.is_none() {
        service.metadata.namespace = Some(args.namespace.clone());
    }
    let resolved = hearth_controller::resolve_runtime(&service, [&runtime])?;
    let mut cfg = args.images.render_config()?;
    if !args.policies.is_empty() {
        let mut bundle = hearth_policies::manifest::Bundle::default();
        for p in &args.policies {
            hearth_policies::manifest::read_path(p, &mut bundle)
                .with_context(|| format!("--policy {}", p.display()))?;
        }
        let mut last_good = hearth_policies::cluster::LastGood::default();
        let listed: Vec<Arc<hearth_crds::ServingPolicy>> =
            bundle.policies.into_iter().map(Arc::new).collect();
        for st in last_good.update(&listed) {
            if let Some(e) = st.error {
                bail!("--policy: {e}");
            }
        }
        cfg.engine = hearth_controller::policy::Engine::new(
            &last_good.evaluation_order(cfg.engine.policies()),
        )?;
    }
    let mut adapters: Vec<hearth_crds::LLMAdapter> = Vec::new();
    if let Some(path) = &args.adapters {
        for doc in serde_yaml::Deserializer::from_str(&read(path)?) {
            let mut a: hearth_crds::LLMAdapter = serde::Deserialize::deserialize(doc)
                .with_context(|| format!("--adapters {}: not an LLMAdapter", path.display()))?;
            if a.metadata.namespace.is_none() {
                a.metadata.namespace = service.metadata.namespace.clone();
            }
            adapters.push(a);
        }
    }
    for a in &adapters {
        let findings = hearth_crds::rules::adapters::check_llmadapter_among(
            a,
            Some(&service),
            Some(resolved.runtime),
            &adapters,
            &[],
            &|_, _| None,
            &|_| None,
        );
        if let Some(e) = findings.first_error() {
            bail!(
                "LLMAdapter {}: {e}",
                a.metadata.name.as_deref().unwrap_or_default()
            );
        }
    }
    adapters.sort_by(|a, b| a.served_name().cmp(b.served_name()));
    let children = hearth_controller::render::render_with_adapters(
        &service,
        resolved.runtime,
        &cfg,
        true,
        &hearth_controller::render::Placement::Own,
        &hearth_controller::render::ServiceAdapters {
            accepted: adapters,
            fetches: Default::default(),
        },
    )?;
    print!("{}", children.to_yaml()?);
    Ok(())
}

/// Logs the apiserver's version, and what an older one than Hearth supports lacks
/// ([`hearth_controller::versions::OLDEST_KUBERNETES`]; the chart refuses to install there).
/// A `/version` that cannot be read is logged and not fatal: every later call says more.
async fn check_kubernetes_version(client: &Client) {
    use hearth_controller::versions::{OLDEST_KUBERNETES, Version};
    let info = match client.apiserver_version().await {
        Ok(info) => info,
        Err(e) => {
            tracing::warn!(error = %e, "reading the apiserver's /version");
            return;
        }
    };
    match info.git_version.parse::<Version>() {
        Ok(v) if v < OLDEST_KUBERNETES => tracing::error!(
            kubernetes = %info.git_version,
            "Kubernetes {v} is older than {OLDEST_KUBERNETES}, the oldest Hearth supports: the webhooks' matchConditions (GA in 1.30), the backends' drain sidecar (native sidecars) and the sleep preStop action may be refused or ignored; upgrade the cluster (docs/versioning.md)"
        ),
        Ok(_) => tracing::info!(kubernetes = %info.git_version, "Kubernetes version"),
        Err(e) => {
            tracing::warn!(kubernetes = %info.git_version, error = %e, "unrecognised Kubernetes version")
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    let mut signals = Signals::install()?;
    let metrics = Metrics::new();
    let config = Config::infer()
        .await
        .context("loading kubeconfig or in-cluster config")?;
    let client: Client = ClientBuilder::try_from(config)?
        .with_layer(&metrics.request_counter())
        .build();
    // Flags and keys before /readyz is served: a controller that cannot start never looks
    // ready, so a rollout keeps the running one.
    if args.scaler_cert_validity < Duration::from_secs(3600) {
        bail!(
            "--scaler-cert-validity ({:?}) must be at least 1h: certificates are issued again two thirds into it",
            args.scaler_cert_validity
        );
    }
    if args.scaler_tls && args.scaler_ca_validity < 2 * args.scaler_cert_validity {
        bail!(
            "--scaler-ca-validity ({:?}) must be at least twice --scaler-cert-validity ({:?}): certificates never outlive their CA",
            args.scaler_ca_validity,
            args.scaler_cert_validity
        );
    }
    check_kubernetes_version(&client).await;
    let ns = &args.leader_election_namespace;
    let keda_scaler_secret = secret_ref(&args.keda_scaler_secret, ns)
        .context("--keda-scaler-secret")?
        .filter(|_| args.scaler_tls);
    if keda_scaler_secret.is_some() && args.shared_scaler_trigger_auth.is_empty() {
        bail!(
            "--shared-scaler-trigger-auth is empty: name the ClusterTriggerAuthentication that hands --keda-scaler-secret to KEDA, or set --keda-scaler-secret= to serve the shared gateways in plain gRPC"
        );
    }
    let keys = hearth_controller::keys::load_or_init(
        client.clone(),
        ns,
        &args.admin_keys_secret,
        hearth_controller::keys::Wanted {
            admin: args.gateway_admin_auth,
            scaler_ca: args.scaler_tls.then_some(args.scaler_ca_validity),
            scaler_ca_min_left: args.scaler_cert_validity,
            shared_client: keda_scaler_secret
                .is_some()
                .then_some(args.scaler_cert_validity),
            // At start the CA is made when missing and replaced when ending.
            keep_ca: false,
        },
    )
    .await
    .context("--admin-keys-secret")?;

    let listener = hearth_net::listen(args.metrics_addr, hearth_net::ListenOptions::default())
        .context("--metrics-addr")?;
    let serving = metrics_serving(&args, &client, keys.scaler_ca.as_ref())?;
    tracing::info!(
        addr = %listener.local_addr()?,
        secure = args.metrics_secure,
        "serving /metrics"
    );
    tokio::spawn(hearth_controller::metrics::serve(
        listener,
        metrics.clone(),
        serving,
    ));

    let identity = format!(
        "{}-{}",
        std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "hearth-controller".into()),
        std::process::id()
    );
    let (lost_tx, lost_rx) = tokio::sync::oneshot::channel::<()>();
    let leadership = if args.leader_elect {
        let campaign = leader::acquire(
            client.clone(),
            LeaseConfig {
                name: args.leader_election_name.clone(),
                namespace: args.leader_election_namespace.clone(),
                identity: identity.clone(),
                lease_duration: LEASE_DURATION,
                renew_interval: LEASE_RENEW_INTERVAL,
            },
        );
        // A standby stops at once on SIGTERM: it holds nothing.
        let leadership = tokio::select! {
            l = campaign => l?,
            _ = signals.recv() => return Ok(()),
        };
        let mut holding = leadership.holding();
        tokio::spawn(async move {
            while holding.changed().await.is_ok() && *holding.borrow() {}
            let _ = lost_tx.send(());
        });
        Some(leadership)
    } else {
        // Never lost: keep the sender alive for the life of the process.
        std::mem::forget(lost_tx);
        None
    };
    let lost = Arc::new(AtomicBool::new(false));
    let shutdown = {
        let lost = lost.clone();
        async move {
            tokio::select! {
                _ = signals.recv() => {}
                _ = lost_rx => lost.store(true, Ordering::SeqCst),
            }
        }
    };
    let admin_tokens = if let Some(tokens) = keys.admin {
        let keda = secret_ref(&args.keda_token_secret, ns).context("--keda-token-secret")?;
        let metrics =
            secret_ref(&args.metrics_token_secret, ns).context("--metrics-token-secret")?;
        tokio::spawn(hearth_controller::admin_tokens::publish(
            client.clone(),
            tokens.clone(),
            keda,
            metrics,
            Duration::from_secs(args.resync_seconds.max(60)),
        ));
        Some(tokens)
    } else {
        None
    };
    let cfg = RunConfig {
        render: {
            let mut render = args.images.render_config()?;
            render.scaler_tls = args.scaler_tls;
            render.admin_auth = args
                .gateway_admin_auth
                .then(|| args.gateway_admin_trigger_auth.clone());
            render.shared_scaler_auth = keda_scaler_secret
                .is_some()
                .then(|| args.shared_scaler_trigger_auth.clone());
            render
        },
        shared_client_home: keda_scaler_secret.map(|keda| {
            hearth_controller::scaler_tls::SharedClientHome {
                keys: (ns.clone(), args.admin_keys_secret.clone()),
                keda,
                ca_validity: args.scaler_ca_validity,
                every: Duration::from_secs(args.resync_seconds.max(60)),
            }
        }),
        admin_tokens,
        namespace: args.namespace,
        requeue: Duration::from_secs(args.resync_seconds),
        concurrency: args.concurrency,
        instance: identity,
        cluster_policies: args.cluster_policies,
        policy_scan: (args.cluster_policies && args.policy_scan).then_some(
            hearth_controller::scan::ScanConfig {
                interval: args.policy_scan_interval,
                rate: args.policy_scan_rate,
            },
        ),
        policy_export: (args.cluster_policies && args.policy_export).then(|| {
            hearth_controller::export::ExportConfig {
                own_namespace: args.leader_election_namespace.clone(),
                interval: args.policy_export_interval.max(Duration::from_secs(10)),
                selector: Some(args.policy_export_selector.clone()).filter(|s| !s.is_empty()),
            }
        }),
        device_handover: args.device_handover,
        scaler_tls: hearth_controller::scaler_tls::ScalerTlsConfig {
            cert_validity: args.scaler_cert_validity,
            ca: keys.scaler_ca,
            shared_client: keys.shared_client,
        },
    };
    // Both loops stop on the same signal (or lost lease).
    let shutdown = shutdown.boxed().shared();
    let pre_pull = args
        .pre_pull_namespace
        .filter(|n| !n.is_empty())
        .map(|namespace| {
            tokio::spawn(hearth_controller::prepull::run(
                client.clone(),
                PrePullConfig {
                    namespace,
                    pause_image: args.pause_image,
                },
                shutdown.clone(),
            ))
        });
    let ran = hearth_controller::run(client, cfg, metrics, shutdown).await;
    if let Some(task) = pre_pull {
        if ran.is_err() {
            task.abort();
        }
        let _ = task.await;
    }
    if lost.load(Ordering::SeqCst) {
        bail!("lost the leader-election lease; exiting so a restart campaigns again");
    }
    // Reconciles have stopped: hand the Lease over now instead of letting a standby wait out
    // LEASE_DURATION.
    if let Some(leadership) = leadership {
        match tokio::time::timeout(LEASE_RENEW_INTERVAL, leadership.release()).await {
            Ok(Ok(true)) => tracing::info!("released the leader-election lease"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not release the lease; it expires on its own")
            }
            Err(_) => tracing::warn!("releasing the lease timed out; it expires on its own"),
        }
    }
    ran?;
    Ok(())
}

/// `[NAMESPACE/]NAME` with `default_ns`; `None` when empty.
fn secret_ref(v: &str, default_ns: &str) -> anyhow::Result<Option<(String, String)>> {
    if v.is_empty() {
        return Ok(None);
    }
    let (ns, name) = v.split_once('/').unwrap_or((default_ns, v));
    if ns.is_empty() || name.is_empty() || name.contains('/') {
        bail!("{v:?} must be NAME or NAMESPACE/NAME");
    }
    Ok(Some((ns.to_owned(), name.to_owned())))
}

/// How /metrics is served (see `--metrics-secure`).
fn metrics_serving(
    args: &RunArgs,
    client: &Client,
    ca: Option<&hearth_net::pki::Issued>,
) -> anyhow::Result<Serving> {
    use hearth_net::secure_metrics;
    if !args.metrics_secure {
        return Ok(Serving::Plain);
    }
    let ns = &args.leader_election_namespace;
    let names = [
        "hearth-controller-metrics".to_owned(),
        format!("hearth-controller-metrics.{ns}.svc"),
        format!("hearth-controller-metrics.{ns}.svc.cluster.local"),
        "localhost".to_owned(),
    ];
    let tls = match (&args.metrics_cert_file, &args.metrics_key_file, ca) {
        (Some(cert), Some(key), _) => secure_metrics::load_pem(cert, key)
            .context("--metrics-cert-file / --metrics-key-file")?,
        // From the scaler CA, valid as long as it (a new CA restarts the controller), and the
        // CA published for the scrapers: every replica's certificate verifies against it.
        (_, _, Some(ca)) if !args.metrics_ca_configmap.is_empty() => {
            let leaf = hearth_controller::scaler_tls::issue_leaf(
                ca,
                hearth_net::pki::Usage::Server,
                &names,
                Duration::from_secs(100 * 365 * 86_400),
            )
            .context("the metrics certificate")?;
            let tls = secure_metrics::from_pem(leaf.cert.as_bytes(), leaf.key.as_bytes())
                .context("the metrics certificate")?;
            // In the background, retried: the chart's ConfigMap may come after this pod.
            tokio::spawn(publish_metrics_ca(
                client.clone(),
                ns.clone(),
                args.metrics_ca_configmap.clone(),
                ca.cert.clone(),
            ));
            tls
        }
        _ => secure_metrics::self_signed(&names).context("the metrics certificate")?,
    };
    Ok(Serving::Secure {
        tls,
        auth: secure_metrics::MetricsAuth::kube(client.clone()),
    })
}

/// Writes Hearth's CA certificate `ca_pem` as `ca.crt` of ConfigMap `name` in `namespace`
/// (server-side apply), where scrapers read it to verify the metrics server; a refusal (the
/// ConfigMap not made yet, RBAC) is logged and tried again every 10 s, and once written it is
/// applied again every 10 minutes (a `helm upgrade --force` or a GitOps replace empties it).
async fn publish_metrics_ca(client: Client, namespace: String, name: String, ca_pem: String) {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{Api, Patch, PatchParams};
    let cm = serde_json::json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
        "data": {"ca.crt": ca_pem},
    });
    let api = Api::<ConfigMap>::namespaced(client, &namespace);
    let params = PatchParams::apply(hearth_crds::wellknown::FIELD_MANAGER).force();
    loop {
        let wait = match api.patch(&name, &params, &Patch::Apply(&cm)).await {
            Ok(_) => Duration::from_secs(600),
            Err(e) => {
                tracing::warn!(
                    configmap = %format!("{namespace}/{name}"),
                    error = %e,
                    "publishing the metrics certificate's CA (--metrics-ca-configmap); trying again in 10s"
                );
                Duration::from_secs(10)
            }
        };
        tokio::time::sleep(wait).await;
    }
}

/// Parses a Go-style duration (`"2160h"`) for clap.
fn go_duration(s: &str) -> Result<Duration, String> {
    hearth_crds::duration::parse_duration(s).map_err(|e| e.to_string())
}

//! `hearth-webhook`: the admission webhook server, and `hearth-webhook configurations` to print
//! the webhook configurations it expects to be registered with.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use hearth_crds::parse_duration;
use hearth_net::process::{self, LogFormat, Setup, Signals};
use hearth_policies::PolicySettings;
use hearth_webhook::registration::{Registration, Target};
use hearth_webhook::selfmanaged::{SelfManaged, SelfManagedConfig};
use hearth_webhook::tls::{CertFiles, CertStore};
use hearth_webhook::{AppState, Limits, Snapshot, router, serve, watch};

#[derive(Parser)]
#[command(version = hearth_net::version!(), about = "Hearth's admission webhook")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    serve: ServeArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Print the Mutating- and ValidatingWebhookConfiguration as YAML.
    Configurations(ConfigArgs),
}

#[derive(Args)]
struct ServeArgs {
    /// Address to serve HTTPS on. `[::]` is every address, IPv4 and IPv6 (IPv4 only on a host
    /// without IPv6).
    #[arg(
        long,
        env = "HEARTH_WEBHOOK_LISTEN",
        default_value = "[::]:8443",
        value_parser = hearth_net::parse_listen
    )]
    listen: SocketAddr,
    /// PEM certificate chain to serve (cert-manager's tls.crt); reloaded when it changes.
    #[arg(long, requires = "tls_key_file", conflicts_with = "self_managed")]
    tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, requires = "tls_cert_file")]
    tls_key_file: Option<PathBuf>,
    /// How often to check the certificate files for changes (Go duration).
    #[arg(long, default_value = "10s", value_parser = duration)]
    tls_reload_interval: Duration,
    /// Generate and rotate the CA and serving certificate, keep them in a Secret, and publish
    /// the CA as caBundle of the webhook configurations.
    #[arg(long)]
    self_managed: bool,
    /// The webhook's namespace (for the Secret and the service DNS names).
    #[arg(long, env = "POD_NAMESPACE", default_value = "hearth-system")]
    namespace: String,
    /// Secret holding the self-managed certificates.
    #[arg(long, default_value = "hearth-webhook-tls")]
    secret_name: String,
    /// Service name the apiserver calls; its DNS names go into the serving certificate.
    #[arg(long, default_value = "hearth-webhook")]
    service_name: String,
    /// Extra subject alternative names (DNS names or IP addresses), comma separated.
    #[arg(long, value_delimiter = ',')]
    extra_san: Vec<String>,
    /// Name of the webhook configurations whose caBundle is kept current.
    #[arg(long, default_value = "hearth")]
    webhook_configuration: String,
    /// Lifetime of each self-managed serving certificate (Go duration).
    #[arg(long, default_value = "2160h", value_parser = duration)]
    cert_validity: Duration,
    /// Lifetime of the self-managed CA (Go duration).
    #[arg(long, default_value = "87600h", value_parser = duration)]
    ca_validity: Duration,
    /// Files or directories of ServingPolicy manifests to evaluate before the cluster's
    /// ServingPolicies instead of the built-ins embedded in the binary (`policies/builtin`).
    /// Repeatable.
    #[arg(long = "builtin-policies", value_name = "PATH")]
    builtin_policies: Vec<PathBuf>,
    /// Largest accepted request body, in bytes.
    #[arg(long, default_value_t = Limits::default().max_body)]
    max_body_bytes: usize,
    /// Image of the backend drain sidecar (the hearth-gateway image), bound as
    /// `settings.drainImage`: the built-in serving defaults then drain through it instead of
    /// a fixed `sleep` preStop. Unset: the `sleep` fallback.
    #[arg(long, env = "HEARTH_DRAIN_IMAGE")]
    drain_image: Option<String>,
    /// Serve /metrics only to scrapers whose bearer token the apiserver authenticates
    /// (TokenReview) and authorizes for GET /metrics (SubjectAccessReview). `false`: to anyone.
    /// The admission paths and the probes never need a token.
    #[arg(long, env = "HEARTH_METRICS_SECURE", default_value_t = true, action = clap::ArgAction::Set)]
    metrics_secure: bool,
}

#[derive(Args)]
struct ConfigArgs {
    /// Hearth's namespace (skipped by the webhooks; home of the Service).
    #[arg(long, default_value = "hearth-system")]
    namespace: String,
    /// Base URL instead of a Service, such as https://127.0.0.1:8443.
    #[arg(long)]
    url: Option<String>,
    /// PEM CA bundle to embed as caBundle.
    #[arg(long)]
    ca_bundle_file: Option<PathBuf>,
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Configurations(args)) = cli.command {
        return process::exit_code(print_configurations(args));
    }
    let setup = Setup {
        log_format: LogFormat::Json,
        default_filter: "info",
    };
    process::main(setup, run(cli.serve))
}

fn print_configurations(args: ConfigArgs) -> Result<()> {
    let mut reg = Registration::in_cluster(&args.namespace);
    if let Some(url) = args.url {
        reg.target = Target::Url(url);
    }
    if let Some(f) = args.ca_bundle_file {
        reg.ca_bundle =
            Some(std::fs::read(&f).with_context(|| format!("reading {}", f.display()))?);
    }
    print!(
        "{}---\n{}",
        serde_yaml::to_string(&reg.mutating())?,
        serde_yaml::to_string(&reg.validating())?
    );
    Ok(())
}

async fn run(args: ServeArgs) -> Result<()> {
    // Flags first: a bad value is reported before anything is contacted.
    let settings = PolicySettings {
        drain_image: args.drain_image.clone().filter(|i| !i.is_empty()),
    };
    settings
        .validate()
        .map_err(|e| anyhow::anyhow!("--drain-image: {e}"))?;
    let mut signals = Signals::install()?;
    let client = kube::Client::try_default()
        .await
        .context("connecting to the Kubernetes API (in-cluster config or KUBECONFIG)")?;
    let (shutdown_tx, shutdown) = tokio::sync::watch::channel(false);
    let limits = Limits {
        max_body: args.max_body_bytes,
        ..Limits::default()
    };
    let mut state = AppState::new(Snapshot::default().with_settings(&settings), limits);
    state.ready = Arc::new(AtomicBool::new(false));
    state.runtimes = Some(Arc::new(hearth_webhook::readthrough::RuntimeReads::new(
        kube::Api::all(client.clone()),
    )));
    if args.metrics_secure {
        state.metrics_auth = Some(hearth_net::secure_metrics::MetricsAuth::kube(
            client.clone(),
        ));
    }

    let store = match (&args.tls_cert_file, &args.tls_key_file, args.self_managed) {
        (Some(cert), Some(key), false) => {
            let files = CertFiles {
                cert: cert.clone(),
                key: key.clone(),
            };
            let store = CertStore::new(files.load().context("loading the serving certificate")?);
            tokio::spawn(files.watch(
                store.clone(),
                args.tls_reload_interval,
                state.metrics.clone(),
                shutdown.clone(),
            ));
            store
        }
        (None, None, true) => {
            let ns = &args.namespace;
            let svc = &args.service_name;
            let mut sans = vec![
                format!("{svc}.{ns}.svc"),
                format!("{svc}.{ns}.svc.cluster.local"),
                format!("{svc}.{ns}"),
                svc.clone(),
            ];
            sans.extend(args.extra_san.iter().cloned());
            let sm = SelfManaged::new(
                client.clone(),
                SelfManagedConfig {
                    namespace: ns.clone(),
                    secret_name: args.secret_name.clone(),
                    sans,
                    cert_validity: args.cert_validity,
                    ca_validity: args.ca_validity,
                    webhook_configuration: args.webhook_configuration.clone(),
                    ca_propagation: Duration::from_secs(10),
                },
            );
            sm.start(
                Duration::from_secs(60),
                state.metrics.clone(),
                shutdown.clone(),
            )
            .await?
        }
        _ => bail!("choose one TLS mode: --tls-cert-file with --tls-key-file, or --self-managed"),
    };

    let mut bundle = hearth_policies::manifest::Bundle::default();
    for p in &args.builtin_policies {
        hearth_policies::manifest::read_path(p, &mut bundle)
            .with_context(|| format!("reading --builtin-policies {}", p.display()))?;
    }
    if args.builtin_policies.is_empty() {
        bundle.policies = hearth_policies::builtin::policies()?;
    }
    let (_, errors) = hearth_policies::PolicySet::compile(&bundle.policies);
    if !errors.is_empty() {
        let msgs: Vec<String> = errors.iter().map(ToString::to_string).collect();
        bail!("--builtin-policies do not compile: {}", msgs.join("; "));
    }
    tracing::info!(count = bundle.policies.len(), "built-in policies loaded");
    tokio::spawn(watch::run(
        client,
        state.clone(),
        bundle.policies.into(),
        shutdown.clone(),
    ));
    let listener = hearth_net::listen(args.listen, hearth_net::ListenOptions::default())
        .context("--listen")?;
    tracing::info!(listen = %args.listen, "serving admission reviews");
    let tls = store.server_config()?;
    let server = tokio::spawn(serve(listener, tls, router(state), limits, shutdown));
    signals.recv().await;
    let _ = shutdown_tx.send(true);
    server.await?;
    Ok(())
}

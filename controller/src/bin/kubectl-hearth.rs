//! `kubectl hearth`: a kubectl plugin (any `kubectl-<name>` binary on the PATH is one) for
//! Hearth's users.
//!
//! `kubectl hearth usage [SERVICE] [-n NAMESPACE | -A] [--since 1h] [--until 10m]` prints the
//! accelerator-seconds of LLMServices by tenant and phase for a time window, from their
//! ledgers (the ConfigMaps `<service>-usage` the controller's meter writes; no Prometheus
//! needed). Without `--since` it prints everything since metering began.

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use hearth_controller::metering;
use k8s_openapi::jiff::Timestamp;
use kube::Client;

#[derive(Parser)]
#[command(name = "kubectl hearth", version = hearth_net::version!(), about = "Hearth for its users")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Accelerator-seconds of LLMServices by tenant and phase, for a time window.
    Usage(UsageArgs),
}

#[derive(clap::Args)]
struct UsageArgs {
    /// One LLMService; all of the namespace when left out.
    service: Option<String>,
    /// The namespace (default: the kubeconfig context's).
    #[arg(short, long)]
    namespace: Option<String>,
    /// Every namespace.
    #[arg(short = 'A', long)]
    all_namespaces: bool,
    /// The window starts this long ago (Go duration: `90m`, `2h`, `24h`); default: when metering
    /// began. Windows are read from per-minute buckets for the last 2 hours and per-hour
    /// buckets for 7 days, so a start is rounded to the bucket it falls in.
    #[arg(long)]
    since: Option<String>,
    /// The window ends this long ago (default: now).
    #[arg(long)]
    until: Option<String>,
    /// Print JSON (`[{namespace, service, tenant, phases...}]`) instead of a table.
    #[arg(short, long)]
    output: Option<String>,
}

fn ago(flag: &str, value: Option<&str>, now_ms: i64) -> anyhow::Result<Option<i64>> {
    let Some(v) = value else { return Ok(None) };
    let d = hearth_crds::parse_duration(v)
        .map_err(|e| anyhow::anyhow!("--{flag} {v:?}: {e}; write a duration such as 90m or 24h"))?;
    Ok(Some(
        now_ms - i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
    ))
}

async fn usage(args: UsageArgs) -> anyhow::Result<()> {
    if let Some(o) = args.output.as_deref().filter(|o| *o != "json") {
        bail!("--output {o:?}: only json is supported (default: a table)");
    }
    let client = Client::try_default()
        .await
        .context("no Kubernetes configuration (KUBECONFIG, ~/.kube/config or in-cluster)")?;
    let now_ms = Timestamp::now().as_millisecond();
    let from = ago("since", args.since.as_deref(), now_ms)?.unwrap_or(i64::MIN);
    let to = ago("until", args.until.as_deref(), now_ms)?.unwrap_or(i64::MAX);
    if from >= to {
        bail!("--since must reach further back than --until");
    }
    let namespace = (!args.all_namespaces).then(|| {
        args.namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_owned())
    });
    let ledgers =
        metering::read_ledgers(&client, namespace.as_deref(), args.service.as_deref()).await?;
    let out = metering::usage_rows(&ledgers, from, to);
    if args.output.as_deref() == Some("json") {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    if out.is_empty() {
        if let Some(s) = &args.service {
            bail!(
                "no usage ledger for LLMService {s:?}: the controller writes one once a backend pod of it is scheduled"
            );
        }
        println!("No usage recorded.");
        return Ok(());
    }
    print!("{}", metering::usage_table(&out));
    Ok(())
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    match Cli::parse().command {
        Command::Usage(args) => usage(args).await,
    }
}

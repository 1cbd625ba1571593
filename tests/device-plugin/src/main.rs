//! `hearth-fake-device-plugin`: a test-only Kubernetes device plugin. It advertises fake
//! accelerators to a real kubelet through the v1beta1 device-plugin gRPC API, so that pods
//! requesting them are admitted and see which fake devices they got. See the library docs.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::Result;
use clap::{CommandFactory, Parser, error::ErrorKind};
use hearth_fake_device_plugin::{Config, ResourceSpec, run};
use tokio::signal::unix::{SignalKind, signal};

#[derive(Parser)]
#[command(
    version,
    about = "Test-only device plugin: advertises fake accelerators to the kubelet (never shipped)"
)]
struct Cli {
    /// The kubelet's device-plugin socket directory (the kubelet listens on DIR/kubelet.sock)
    #[arg(
        long,
        value_name = "DIR",
        default_value = "/var/lib/kubelet/device-plugins"
    )]
    device_plugin_dir: PathBuf,
    /// `NAME=COUNT:ENV`: advertise COUNT fake devices of extended resource NAME; a container
    /// given some gets ENV set to their IDs, comma-separated. IDs are NAME's last segment,
    /// lowercased, `-` and 0, 1, … (nvidia.com/gpu: gpu-0, gpu-1). Repeatable, e.g.
    /// `--resource nvidia.com/gpu=2:NVIDIA_VISIBLE_DEVICES`
    #[arg(long = "resource", value_name = "NAME=COUNT:ENV", required = true)]
    resources: Vec<ResourceSpec>,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let cli = Cli::parse();
    let config = Config::new(cli.device_plugin_dir, cli.resources);
    if let Err(e) = config.validate() {
        Cli::command().error(ErrorKind::ValueValidation, e).exit();
    }
    // Install the handlers before serving, so an early SIGTERM still cleans up.
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let shutdown = async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM"),
            _ = int.recv() => tracing::info!("SIGINT"),
        }
    };
    run(config, shutdown).await?;
    Ok(())
}

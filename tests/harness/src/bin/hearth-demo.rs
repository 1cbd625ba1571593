//! `hearth-demo`, run by `tests/demo` (`make demo`) on a cluster from `tests/cluster/up`: runs
//! the demo of [`hearth_e2e_harness::demo`] (Hearth installed with its Helm chart, the
//! quickstart runtime and model of `examples/quickstart/` applied once per KEDA scaler mode, a
//! cold streaming request in each) and prints each mode's timeline, a table of both and a `curl`
//! line that works from this host. The end-to-end suite `tests/e2e/tests/demo.rs` runs the same
//! steps and checks what they measured.

use anyhow::{Context, Result};
use hearth_e2e_harness::demo;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

#[tokio::main]
async fn main() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kubeconfig = std::path::PathBuf::from(
        std::env::var_os("KUBECONFIG").context("KUBECONFIG is unset: run through tests/demo")?,
    );
    let kc = Kubeconfig::read_from(&kubeconfig)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    let client = Client::try_from(config)?;
    let report = demo::run(&client, &kubeconfig, |mode| {
        print!("{}", mode.timeline_text());
    })
    .await?;
    print!("{}", report.summary_text());
    Ok(())
}

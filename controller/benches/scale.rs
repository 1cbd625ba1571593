//! Scale benchmark: N LLMServices created at once, then the controller binary started against
//! the local control plane (`tests/cluster/up`); measured until every service reports the
//! current `observedGeneration` and phase `ScaledToZero` (children applied, status written).
//!
//! Prints one table row per size: wall time, controller peak RSS (`VmHWM`), apiserver requests
//! the controller issued (its `hearth_controller_kube_requests_total`), writes, and the per-
//! service cost as a ratio to the smallest size in the same run (the baseline).
//!
//! `cargo bench -p hearth-controller --bench scale` (sizes: `HEARTH_BENCH_SIZES`, default
//! `50,500`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::exit)]

use std::{
    net::TcpListener,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, bail};
use futures::{StreamExt, TryStreamExt, stream};
use hearth_crds::{InferenceRuntime, LLMService, LLMServicePhase};
use hearth_test_support::{Cluster, Observed, TestNamespace, wait_until};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, ResourceExt,
    api::{ListParams, Patch, PatchParams, PostParams},
};

const MANAGER: &str = "hearth-controller-bench";

struct Row {
    n: usize,
    seconds: f64,
    peak_rss_mib: f64,
    requests: f64,
    writes: f64,
    reconciles: f64,
}

/// The controller process; killed (SIGKILL, by its own PID) if still running when dropped.
struct Controller {
    child: Child,
    metrics_url: String,
}

impl Drop for Controller {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Controller {
    fn start(cluster: &Cluster, namespace: &str) -> Result<Self> {
        // A free loopback port for /metrics.
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(env!("CARGO_BIN_EXE_hearth-controller"))
            .args(["run", "--leader-elect=false", "--namespace", namespace])
            .arg(format!("--metrics-addr=127.0.0.1:{port}"))
            // Read over plain HTTP below, without a token.
            .arg("--metrics-secure=false")
            .env("KUBECONFIG", cluster.kubeconfig())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting hearth-controller")?;
        Ok(Self {
            child,
            metrics_url: format!("127.0.0.1:{port}"),
        })
    }

    fn peak_rss_mib(&self) -> Result<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .context("no VmHWM in /proc/<pid>/status")?;
        Ok(kib / 1024.0)
    }

    /// Reads one counter from the controller's /metrics over plain HTTP/1.0.
    fn metric(&self, name: &str) -> Result<f64> {
        use std::io::{Read, Write};
        let mut conn = std::net::TcpStream::connect(&self.metrics_url)?;
        conn.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
        let mut body = String::new();
        conn.read_to_string(&mut body)?;
        body.lines()
            .find_map(|l| {
                l.strip_prefix(name)
                    .and_then(|rest| rest.trim().parse().ok())
            })
            .with_context(|| format!("metric {name} not found"))
    }
}

/// One upstream example file.
fn upstream(file: &str) -> PathBuf {
    hearth_test_support::upstream_file(file)
}

async fn run_size(cluster: &Cluster, n: usize, template: &LLMService) -> Result<Row> {
    let ns: TestNamespace = cluster.namespace("bench-scale").await?;
    let api: Api<LLMService> = ns.api();
    stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            let mut svc = template.clone();
            svc.metadata.name = Some(format!("svc-{i:04}"));
            svc.metadata.namespace = Some(ns.name().to_owned());
            async move { api.create(&PostParams::default(), &svc).await }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;

    let start = Instant::now();
    let controller = Controller::start(cluster, ns.name())?;
    wait_until(
        format!("{n} LLMServices ScaledToZero"),
        Duration::from_secs(600),
        || async {
            let list = api.list(&ListParams::default()).await?;
            let done = list
                .items
                .iter()
                .filter(|s| {
                    let st = s.status.as_ref();
                    st.and_then(|x| x.observed_generation) == s.metadata.generation
                        && st.and_then(|x| x.phase) == Some(LLMServicePhase::ScaledToZero)
                })
                .count();
            Ok(if done == n {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{done}/{n} done"))
            })
        },
    )
    .await?;
    let seconds = start.elapsed().as_secs_f64();
    let row = Row {
        n,
        seconds,
        peak_rss_mib: controller.peak_rss_mib()?,
        requests: controller.metric("hearth_controller_kube_requests_total")?,
        writes: controller.metric("hearth_controller_writes_total")?,
        reconciles: controller.metric("hearth_controller_reconciles_total")?,
    };
    drop(controller);
    // Wait for the namespace's pods to go before the next size needs the node capacity.
    drop(ns);
    Ok(row)
}

#[tokio::main]
async fn main() -> Result<()> {
    // `cargo bench` passes `--bench`; nothing else is accepted.
    let sizes: Vec<usize> = std::env::var("HEARTH_BENCH_SIZES")
        .unwrap_or_else(|_| "50,500".to_owned())
        .split(',')
        .map(|s| s.trim().parse())
        .collect::<Result<_, _>>()
        .context("HEARTH_BENCH_SIZES must be comma-separated integers, like 50,500")?;
    if sizes.is_empty() {
        bail!("HEARTH_BENCH_SIZES is empty");
    }
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (_, crd) in hearth_crds::crds() {
        crds.patch(
            &crd.name_any(),
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await?;
    }
    let runtime: InferenceRuntime = serde_yaml::from_str(&std::fs::read_to_string(upstream(
        "stub-inferenceruntime.yaml",
    ))?)?;
    let runtimes: Api<InferenceRuntime> = Api::all(client.clone());
    runtimes
        .patch(
            &runtime.name_any(),
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&runtime),
        )
        .await?;
    let template: LLMService =
        serde_yaml::from_str(&std::fs::read_to_string(upstream("stub-llmservice.yaml"))?)?;

    let mut rows = Vec::new();
    for n in sizes {
        eprintln!("running {n} LLMServices...");
        rows.push(run_size(&cluster, n, &template).await?);
    }
    let base = &rows[0];
    let per = |r: &Row, v: f64| v / r.n as f64;
    println!(
        "| LLMServices | time (s) | time/svc (ms) | ratio | peak RSS (MiB) | apiserver requests | requests/svc | ratio | writes | reconciles |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.1} | {:.1} | {:.2} | {:.1} | {:.0} | {:.1} | {:.2} | {:.0} | {:.0} |",
            r.n,
            r.seconds,
            per(r, r.seconds) * 1000.0,
            per(r, r.seconds) / per(base, base.seconds),
            r.peak_rss_mib,
            r.requests,
            per(r, r.requests),
            per(r, r.requests) / per(base, base.requests),
            r.writes,
            r.reconciles,
        );
    }
    Ok(())
}

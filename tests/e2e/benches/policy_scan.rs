//! Background policy scan benchmark (docs/policies.md, "Reports on what already runs"): N
//! Deployments annotated for Hearth (default 10,000; paused, no replicas, so no ReplicaSet or
//! pod) in one namespace of the local cluster, Hearth installed with its chart, the PolicyReport
//! CRD installed. A ServingPolicy matching them is created; the chart-installed controller scans
//! them and writes one PolicyReport each.
//!
//! Prints two tables: the scan (seconds from the policy's creation to its `status.scan`
//! counting every Deployment, workloads a second, its warn and wouldMutate counts, the controller's resident
//! memory before and its peak during, from `/proc/<pid>/status` of its process on the real
//! node), and admission (server dry-run creates of an annotated Deployment through the
//! apiserver and Hearth's webhook, one at a time: p50 and p99 without a scan, then during it,
//! and their ratio to the run's own baseline).
//!
//! `cargo bench -p hearth-e2e --bench policy_scan` on a running cluster (`tests/cluster/up`,
//! images built; `HEARTH_BENCH_DEPLOYMENTS` changes N).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::exit)]

use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use futures::{StreamExt, TryStreamExt, stream};
use hearth_crds::ServingPolicy;
use hearth_e2e_harness::stack;
use hearth_test_support::{Cluster, Observed, create_with_warnings, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

/// An annotated Deployment `name`: paused, no replicas.
fn deployment(name: &str) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"serving.hearth.dev/runtime": "vllm-stub"}},
        "spec": {"replicas": 0, "paused": true, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}},
                              "spec": {"containers": [{"name": "vllm", "image": "hearth.dev/vllm-stub:e2e"}]}}},
    }))?)
}

/// The PID of the `hearth-controller run` process on this machine (the chart's controller pod
/// on the real node).
fn controller_pid() -> Result<u32> {
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let is_controller = args
            .first()
            .is_some_and(|a| a.ends_with(b"hearth-controller"))
            && args.get(1).is_some_and(|a| *a == b"run");
        if is_controller {
            return Ok(pid);
        }
    }
    bail!("no hearth-controller process: is Hearth installed on the real node?")
}

/// `VmRSS` and `VmHWM` of `pid`, in MiB.
fn memory_mib(pid: u32) -> Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> Result<f64> {
        let kib: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))?;
        Ok(kib / 1024.0)
    };
    Ok((field("VmRSS:")?, field("VmHWM:")?))
}

/// Latencies of server dry-run creates of an annotated Deployment, one at a time, until `stop`
/// says so (at least `min` of them).
async fn admissions(
    client: &kube::Client,
    ns: &str,
    min: usize,
    stop: impl Fn() -> bool,
) -> Result<Vec<Duration>> {
    let probe = deployment("probe")?;
    let mut got = Vec::new();
    while got.len() < min || !stop() {
        let t = Instant::now();
        create_with_warnings(client, ns, &probe, true).await?;
        got.push(t.elapsed());
    }
    Ok(got)
}

/// The `q` quantile of `d`, in milliseconds.
fn quantile_ms(d: &mut [Duration], q: f64) -> f64 {
    d.sort_unstable();
    let i = ((d.len() as f64 - 1.0) * q).round() as usize;
    d.get(i).map_or(0.0, |x| x.as_secs_f64() * 1000.0)
}

#[tokio::main]
async fn main() -> Result<()> {
    let n: usize = std::env::var("HEARTH_BENCH_DEPLOYMENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    stack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    stack::install_stub_runtime(&client).await?;
    hearth_test_support::install_policy_report_crd(&client).await?;
    let ns = cluster.namespace("bench-scan").await?;
    let deployments: Api<Deployment> = ns.api();
    let created = Instant::now();
    stream::iter(0..n)
        .map(|i| {
            let api = deployments.clone();
            async move {
                api.create(&PostParams::default(), &deployment(&format!("llm-{i:05}"))?)
                    .await?;
                Ok::<_, anyhow::Error>(())
            }
        })
        .buffer_unordered(16)
        .try_collect::<Vec<_>>()
        .await?;
    eprintln!(
        "{n} Deployments created in {:.1}s",
        created.elapsed().as_secs_f64()
    );
    let pid = controller_pid()?;
    // Let the controller settle after the creates (its member watch sees each).
    tokio::time::sleep(Duration::from_secs(10)).await;

    // Admission without a scan.
    let mut without = admissions(&client, ns.name(), 200, || true).await?;

    // The policy arrives: the controller scans every Deployment.
    let (rss_before, _) = memory_mib(pid)?;
    let policies: Api<ServingPolicy> = Api::all(client.clone());
    let name = format!("{}-team", ns.name());
    let policy: ServingPolicy = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
        "metadata": {"name": name},
        "spec": {
            "matchConditions": [{"name": "this-bench",
                "expression": format!("object.metadata.namespace == {:?}", ns.name())}],
            "validationActions": ["Warn"],
            "validations": [{"expression": "has(object.metadata.labels) && 'team' in object.metadata.labels",
                             "message": "every workload names its team"}],
            "mutationActions": ["Audit"],
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                "Object{metadata: Object.metadata{annotations: {'example.com/reviewed': 'true'}}}"}}],
        },
    }))?;
    let started = Instant::now();
    policies
        .patch(
            &name,
            &PatchParams::apply("hearth-bench").force(),
            &Patch::Apply(&policy),
        )
        .await?;
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peak = std::sync::Arc::new(std::sync::Mutex::new(rss_before));
    let sampler = {
        let (done, peak) = (done.clone(), peak.clone());
        tokio::spawn(async move {
            while !done.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok((rss, _)) = memory_mib(pid) {
                    let mut p = peak.lock().unwrap();
                    *p = p.max(rss);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
    };
    let watcher = {
        let (policies, name, done) = (policies.clone(), name.clone(), done.clone());
        tokio::spawn(async move {
            let scan = wait_until(
                format!("the scan of {n} Deployments"),
                Duration::from_secs(1800),
                || async {
                    let p = policies.get(&name).await?;
                    Ok(match p.status.and_then(|s| s.scan) {
                        Some(s)
                            if s.observed_generation == p.metadata.generation
                                && s.resources == n as i64 =>
                        {
                            Observed::Ready(s)
                        }
                        other => Observed::NotYet(format!("{other:?}")),
                    })
                },
            )
            .await;
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            scan.map(|s| (s, started.elapsed()))
        })
    };
    let mut during = admissions(&client, ns.name(), 20, || {
        done.load(std::sync::atomic::Ordering::Relaxed)
    })
    .await?;
    let (scan, took) = watcher.await??;
    sampler.await?;
    let peak = *peak.lock().unwrap();
    let (_, hwm) = memory_mib(pid)?;

    println!();
    println!(
        "| Deployments | scan (s) | workloads/s | warn | wouldMutate | controller RSS before (MiB) | peak during (MiB) | VmHWM (MiB) |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {n} | {:.1} | {:.0} | {} | {} | {rss_before:.1} | {peak:.1} | {hwm:.1} |",
        took.as_secs_f64(),
        n as f64 / took.as_secs_f64(),
        scan.warn,
        scan.would_mutate,
    );
    let (p50, p99) = (
        quantile_ms(&mut without, 0.5),
        quantile_ms(&mut without, 0.99),
    );
    let (d50, d99) = (
        quantile_ms(&mut during, 0.5),
        quantile_ms(&mut during, 0.99),
    );
    println!();
    println!(
        "| admission (server dry-run create) | requests | p50 (ms) | p99 (ms) | p99 / baseline |"
    );
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| without a scan (baseline) | {} | {p50:.1} | {p99:.1} | 1.00 |",
        without.len()
    );
    println!(
        "| during the scan | {} | {d50:.1} | {d99:.1} | {:.2} |",
        during.len(),
        d99 / p99.max(f64::EPSILON)
    );
    let _ = policies.delete(&name, &DeleteParams::default()).await;
    Ok(())
}

//! The fault suite: a steady mixed load (streaming and non-streaming chat completions through
//! the stub service's gateway, admissions of opted-in and unrelated Deployments, edits of the
//! LLMService) against the chart-installed Hearth, one fault at a time, each with its expected
//! outcome asserted and a report row (admitted / completed / failed by status / lost / admissions
//! refused / recovery seconds) printed as a table. Every operation ends in exactly one outcome
//! (`hearth_e2e_harness::faults`); lost means no answer within a generous deadline, and must be
//! 0 in every row. Recovery windows and what sets them: docs/operations.md.
//!
//! The faults act on shared parts of the cluster (the release's controller and webhook, KEDA,
//! the real node's kubelet and containerd, kube-apiserver and etcd), so the tests take one lock
//! and run one after another, and they are `#[ignore]`d so that no other run picks them up:
//! `make test` (tests/run-tests) runs them last, alone, after every other suite. On their own:
//! `tests/run-tests -p hearth-e2e --test faults -- --ignored --nocapture`
//! (or `cargo test -p hearth-e2e --test faults -- --ignored --nocapture` on a running cluster).

mod stack;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hearth_e2e_harness::faults::{self, Kind, Ledger, Load, LoadConfig, Outcome, Record, Row};
use hearth_e2e_harness::stack::{RELEASE_NAMESPACE, ScalerMode};
use hearth_e2e_harness::{admin, client};
use hearth_test_support::{Cluster, Observed, TestNamespace, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use stack::SERVICE;

/// One fault at a time across the file's tests (they share the release and KEDA).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// An operation unanswered this long is lost (the longest stream is 80 tokens, 12 s).
const DEADLINE: Duration = Duration::from_secs(120);
/// Tokens of each load request (150 ms each in the stub runtime).
const LOAD_TOKENS: u32 = 4;
/// Tokens of a stream pinned to one gateway replica: 12 s, long enough to span the fault.
const PINNED_TOKENS: u32 = 80;

fn print_rows(title: &str, rows: &[Row]) {
    eprintln!("\n{title}\n{}", faults::table(rows));
}

fn failures(records: &[Record]) -> String {
    records
        .iter()
        .filter(|r| r.outcome != Outcome::Completed)
        .take(8)
        .map(|r| format!("{:?} {} {:?}: {}", r.kind, r.tag, r.outcome, r.detail))
        .collect::<Vec<_>>()
        .join("\n  ")
}

/// Waits until kube-controller-manager and kube-scheduler act on new objects again after a
/// control-plane restart: a new namespace gets its default ServiceAccount (up to 4 tries of
/// 30 s), then a new one-replica Deployment there gets a pod bound to a node (up to 3 min:
/// the Deployment, ReplicaSet and Pod watches come back on their own backoffs). Returns the
/// namespace; dropping it deletes the probe.
async fn cluster_whole(cluster: &Cluster) -> Result<TestNamespace> {
    let mut tries = 0;
    let ns = loop {
        match cluster.namespace("e2e-fault-cp-after").await {
            Ok(ns) => break ns,
            Err(e) if tries < 3 => {
                tries += 1;
                eprintln!("{e:#}; trying again");
            }
            Err(e) => {
                return Err(e.context(
                    "kube-controller-manager made no ServiceAccount for 2 minutes after the control-plane restart",
                ));
            }
        }
    };
    let mut probe = faults::load_deployment("whole", None);
    probe["spec"]["replicas"] = json!(1);
    hearth_e2e_harness::stack::apply(&ns.client(), probe, Some(ns.name())).await?;
    ns.wait_for_pods(
        "a pod of a Deployment created after the restart, bound to a node (kube-controller-manager's Deployment and ReplicaSet controllers, then kube-scheduler)",
        "app=whole",
        Duration::from_secs(180),
        |pods| {
            pods.iter()
                .any(|p| p.spec.as_ref().is_some_and(|s| s.node_name.is_some()))
        },
    )
    .await?;
    Ok(ns)
}

/// The Ready gateway pods of the namespace, not terminating, with an IP: (name, IP, pod).
async fn ready_gateways(api: &Api<Pod>) -> Result<Vec<(String, String, Pod)>> {
    Ok(api
        .list(&ListParams::default().labels("app.kubernetes.io/component=gateway"))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && hearth_test_support::pod_ready(p))
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            Some((p.name_any(), ip, p))
        })
        .collect())
}

async fn wait_gateways(api: &Api<Pod>, n: usize) -> Result<Vec<(String, String, Pod)>> {
    wait_until(
        format!("{n} Ready gateway replicas"),
        Duration::from_secs(120),
        || async {
            let pods = ready_gateways(api).await?;
            Ok(if pods.len() == n {
                Observed::Ready(pods)
            } else {
                Observed::NotYet(format!(
                    "{:?}",
                    pods.iter().map(|p| &p.0).collect::<Vec<_>>()
                ))
            })
        },
    )
    .await
}

fn pod_url(ip: &str) -> String {
    if ip.contains(':') {
        format!("http://[{ip}]:8080")
    } else {
        format!("http://{ip}:8080")
    }
}

/// `/hearth/queue` of one replica's admin port, with the gateway's own `token`: `Some(total)`,
/// or None while the total is unknown (503) or the replica does not answer.
async fn queue_total(ip: &str, token: &str, scope: &str) -> Option<i64> {
    let (status, body) = admin::get(
        &format!("{}/hearth/queue{scope}", admin::url(ip)),
        token,
        Duration::from_secs(3),
    )
    .await
    .ok()?;
    if status != 200 {
        return None;
    }
    serde_json::from_str::<Value>(&body).ok()?["pending"].as_i64()
}

/// KEDA's external metric of the service through the apiserver (the HPA's view), or None.
async fn keda_metric(client: &Client, ns: &str, metric: &str) -> Option<i64> {
    let path = format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{ns}/{metric}?labelSelector=scaledobject.keda.sh%2Fname%3D{SERVICE}"
    );
    let req = http::Request::get(path.as_str()).body(Vec::new()).ok()?;
    let body = tokio::time::timeout(Duration::from_secs(5), client.request_text(req))
        .await
        .ok()?
        .ok()?;
    let v: Value = serde_json::from_str(&body).ok()?;
    v["items"][0]["value"].as_str()?.parse().ok()
}

async fn scaled_object_metric(d: &stack::Deployed) -> Result<String> {
    let api =
        d.ns.dynamic_api("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects");
    wait_until(
        "the ScaledObject's status.externalMetricNames",
        Duration::from_secs(60),
        || async {
            let so = api.get(SERVICE).await?;
            Ok(match so.data["status"]["externalMetricNames"][0].as_str() {
                Some(m) => Observed::Ready(m.to_owned()),
                None => Observed::NotYet(format!("status {}", so.data["status"])),
            })
        },
    )
    .await
}

/// One request through the Service that must complete (wakes the backend, proves recovery).
async fn served(ledger: &Ledger, url: &str, timeout: Duration) -> Result<Instant> {
    let start = Instant::now();
    loop {
        let o = faults::chat_once(ledger, url, SERVICE, true, LOAD_TOKENS, DEADLINE, "probe").await;
        if o == Outcome::Completed {
            return Ok(Instant::now());
        }
        if start.elapsed() > timeout {
            bail!("no request through {url} completed within {timeout:?}: last {o:?}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The stub service with one backend at most (`spec.scaling.max: 1`).
fn max_one(svc: &mut Value) {
    svc["spec"]["scaling"]["max"] = json!(1);
}

/// The stub service's `spec.scaling.activationTimeout` (2m, the upstream manifest's).
const ACTIVATION_TIMEOUT: Duration = Duration::from_secs(120);

/// A held cold request is lost after this long (`activationTimeout` 2m, plus slack).
const COLD_DEADLINE: Duration = Duration::from_secs(240);

/// How long after the control plane is back a warm request may still find the node without
/// the Service's rule (see the control-plane fault).
const OUTAGE_GRACE: Duration = Duration::from_secs(10);

/// How soon after a short control-plane outage an LLMService edit is carried out: one retry of
/// a watch's backoff (0.8 s doubling up to 30 s, each with up to as much again of jitter), see
/// docs/operations.md.
const SHORT_OUTAGE_CONVERGENCE: Duration = Duration::from_secs(60);

/// Sends one chat completion per entry of `streams` (streaming or not) through `url` at once,
/// each recorded in `ledger` with `tag`; the handles give their outcomes.
fn spawn_chats(
    ledger: &Ledger,
    url: &str,
    streams: &[bool],
    tokens: u32,
    deadline: Duration,
    tag: &'static str,
) -> Vec<tokio::task::JoinHandle<Outcome>> {
    streams
        .iter()
        .map(|&stream| {
            let (ledger, url) = (ledger.clone(), url.to_owned());
            tokio::spawn(async move {
                faults::chat_once(&ledger, &url, SERVICE, stream, tokens, deadline, tag).await
            })
        })
        .collect()
}

/// Merge-patches the service's LLMService spec.
async fn patch_service(d: &stack::Deployed, spec: Value) -> Result<()> {
    d.ns.dynamic_api(
        "serving.hearth.dev",
        "v1alpha1",
        "LLMService",
        "llmservices",
    )
    .patch(
        SERVICE,
        &PatchParams::default(),
        &Patch::Merge(json!({ "spec": spec })),
    )
    .await?;
    Ok(())
}

/// An edit only a working controller carries out: `spec.scaling.scaleDownStabilization` set to
/// `secs`, whose ScaledObject's `cooldownPeriod` follows; [`wait_cooldown`] sees it done.
async fn edit_stabilization(d: &stack::Deployed, secs: u32) -> Result<()> {
    patch_service(
        d,
        json!({"scaling": {"scaleDownStabilization": format!("{secs}s")}}),
    )
    .await
}

/// Waits until the service's ScaledObject has `cooldownPeriod: secs` (the controller carried
/// out [`edit_stabilization`]).
async fn wait_cooldown(d: &stack::Deployed, secs: u32, timeout: Duration) -> Result<()> {
    let so =
        d.ns.dynamic_api("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects");
    wait_until(
        format!("the edit carried out (ScaledObject cooldownPeriod {secs})"),
        timeout,
        || async {
            let o = so.get(SERVICE).await?;
            Ok(if o.data["spec"]["cooldownPeriod"] == secs {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!(
                    "cooldownPeriod {}",
                    o.data["spec"]["cooldownPeriod"]
                ))
            })
        },
    )
    .await
}

fn load_config(d: &stack::Deployed, chat_workers: usize, admissions: bool) -> LoadConfig {
    LoadConfig {
        url: Some(d.url.clone()),
        model: SERVICE.to_owned(),
        chat_workers,
        tokens: LOAD_TOKENS,
        deadline: DEADLINE,
        admissions: admissions.then(|| (d.cluster.client(), d.ns.name().to_owned())),
        edit: admissions.then(|| SERVICE.to_owned()),
        runtime: "vllm-stub".to_owned(),
    }
}

// --- (a) a gateway replica deleted, then SIGKILLed, mid-stream -----------------------------

/// A sample of the demand signal while streams are pinned to the surviving replica: the value
/// (None: unknown) and how many pinned streams were in flight on the survivor the whole time.
#[derive(Debug)]
struct DemandSample {
    at: f64,
    source: &'static str,
    value: Option<i64>,
    floor: usize,
}

async fn gateway_fault(
    d: &stack::Deployed,
    kill: bool,
    load: &Ledger,
    metric: &str,
) -> Result<(Row, Vec<DemandSample>)> {
    let fault = if kill {
        "gateway container SIGKILLed mid-stream (1 of 2)"
    } else {
        "gateway pod deleted mid-stream (1 of 2)"
    };
    let pods_api = d.ns.api::<Pod>();
    let pods = wait_gateways(&pods_api, 2).await?;
    let (victim, survivor) = (&pods[0], &pods[1]);
    let token = admin::token(&d.cluster.client(), d.ns.name(), SERVICE).await?;
    let start = Instant::now();
    let pinned = Ledger::default();
    let on_survivor = Arc::new(AtomicUsize::new(0));
    let mut streams = Vec::new();
    for (tag, ip) in [
        ("victim", &victim.1),
        ("victim", &victim.1),
        ("survivor", &survivor.1),
        ("survivor", &survivor.1),
    ] {
        let (ledger, base, count) = (pinned.clone(), pod_url(ip), on_survivor.clone());
        if tag == "survivor" {
            count.fetch_add(1, Ordering::SeqCst);
        }
        streams.push(tokio::spawn(async move {
            let o = faults::chat_once(&ledger, &base, SERVICE, true, PINNED_TOKENS, DEADLINE, tag)
                .await;
            if tag == "survivor" {
                count.fetch_sub(1, Ordering::SeqCst);
            }
            o
        }));
    }
    // Every pinned stream admitted: each replica counts its two locally.
    wait_until(
        "two pinned streams in flight on each replica",
        Duration::from_secs(30),
        || async {
            let v = queue_total(&victim.1, &token, "?scope=local").await;
            let s = queue_total(&survivor.1, &token, "?scope=local").await;
            Ok(if v >= Some(2) && s >= Some(2) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("local demand: victim {v:?}, survivor {s:?}"))
            })
        },
    )
    .await?;
    // The demand signal, sampled until recovery: the survivor's /hearth/queue (poll's view)
    // and KEDA's external metric (the push stream, through the apiserver).
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let sampler = {
        let (ip, token, count, client, ns, metric) = (
            survivor.1.clone(),
            token.clone(),
            on_survivor.clone(),
            d.cluster.client(),
            d.ns.name().to_owned(),
            metric.to_owned(),
        );
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while !*stop_rx.borrow() {
                let value = queue_total(&ip, &token, "").await;
                samples.push(DemandSample {
                    at: start.elapsed().as_secs_f64(),
                    source: "survivor /hearth/queue",
                    value,
                    floor: count.load(Ordering::SeqCst),
                });
                let value = keda_metric(&client, &ns, &metric).await;
                samples.push(DemandSample {
                    at: start.elapsed().as_secs_f64(),
                    source: "KEDA external metric",
                    value,
                    floor: count.load(Ordering::SeqCst),
                });
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            samples
        })
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let fault_at = Instant::now();
    if kill {
        let pids = faults::kill_container(&victim.2, "gateway")?;
        eprintln!("SIGKILLed gateway {} (PIDs {pids:?})", victim.0);
    } else {
        pods_api.delete(&victim.0, &DeleteParams::default()).await?;
        eprintln!("deleted gateway pod {}", victim.0);
    }
    let mut outcomes = Vec::new();
    for s in streams {
        outcomes.push(s.await?);
    }
    let pinned_records = pinned.records();
    // Recovered: two Ready replicas again and a request through the Service served.
    wait_gateways(&pods_api, 2).await?;
    let recovered_at = served(load, &d.url, Duration::from_secs(60)).await?;
    let _ = stop_tx.send(true);
    let samples = sampler.await?;

    for r in &pinned_records {
        ensure!(
            r.outcome != Outcome::Lost,
            "{fault}: a {} stream was never answered",
            r.tag
        );
        if r.tag == "survivor" || !kill {
            ensure!(
                r.outcome == Outcome::Completed,
                "{fault}: a stream on the {} replica did not finish: {:?} {}",
                r.tag,
                r.outcome,
                r.detail
            );
        } else {
            // Killed: fails fast with an error, never hangs.
            ensure!(
                matches!(r.outcome, Outcome::Failed(_)),
                "{fault}: a stream on the killed replica ended {:?} (the kill came after it?)",
                r.outcome
            );
            let after = r.ended.saturating_duration_since(fault_at);
            ensure!(
                after < Duration::from_secs(10),
                "{fault}: a stream on the killed replica took {after:?} to fail"
            );
        }
    }
    // Never silently low: a known total is at least the pinned streams still on the survivor.
    let low: Vec<&DemandSample> = samples
        .iter()
        .filter(|s| s.value.is_some_and(|v| v < s.floor as i64))
        .collect();
    ensure!(
        low.is_empty(),
        "{fault}: the demand signal read lower than the streams in flight: {low:?}"
    );
    let mut records = pinned_records;
    records.extend(
        load.records()
            .into_iter()
            .filter(|r| r.sent >= start && r.sent < recovered_at),
    );
    let lost: Vec<&Record> = records
        .iter()
        .filter(|r| r.outcome == Outcome::Lost)
        .collect();
    ensure!(lost.is_empty(), "{fault}: lost {lost:?}");
    for r in records
        .iter()
        .filter(|r| r.tag == "load" || r.tag == "probe")
    {
        if let Outcome::Failed(class) = &r.outcome {
            ensure!(
                kill,
                "{fault}: a load request failed ({class}) although the pod was deleted gracefully: {}",
                r.detail
            );
            let from = r.sent.max(fault_at);
            ensure!(
                r.ended.saturating_duration_since(from) < Duration::from_secs(10),
                "{fault}: a load request failed only after {:?}: {class} {}",
                r.ended.saturating_duration_since(from),
                r.detail
            );
        }
    }
    let row = Row::from_records(fault, &records, Some(recovered_at - fault_at));
    Ok((row, samples))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fault suite: disrupts the shared cluster; tests/run-tests runs it last, alone"]
async fn gateway_replica_deleted_then_killed_mid_stream() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let d = stack::deploy("e2e-fault-gw", ScalerMode::Push, |svc| {
        svc["spec"]["endpoint"]["replicas"] = json!(2);
        svc["spec"]["scaling"]["max"] = json!(1);
    })
    .await?;
    let warm = Ledger::default();
    served(&warm, &d.url, Duration::from_secs(150)).await?;
    let metric = scaled_object_metric(&d).await?;
    let load = Load::start(load_config(&d, 2, false));
    let mut rows = Vec::new();
    let mut notes = Vec::new();
    for kill in [false, true] {
        let (row, samples) = gateway_fault(&d, kill, &load.ledger, &metric).await?;
        let unknown: Vec<String> = samples
            .iter()
            .filter(|s| s.value.is_none())
            .map(|s| format!("{} at {:.1}s", s.source, s.at))
            .collect();
        notes.push(format!(
            "{}: {} demand samples, none below the streams in flight; {} unknown (503 or no answer): {}",
            row.fault,
            samples.len(),
            unknown.len(),
            unknown.join(", ")
        ));
        rows.push(row);
    }
    let ledger = load.stop().await;
    let all = ledger.records();
    rows.push(Row::from_records("the whole run (load only)", &all, None));
    print_rows("faults: gateway replicas", &rows);
    eprintln!("{}", notes.join("\n"));
    ensure!(
        all.iter().all(|r| r.outcome != Outcome::Lost),
        "lost requests:\n  {}",
        failures(&all)
    );
    Ok(())
}

// --- (b) the active controller deleted (two replicas) ----------------------------------------

async fn controller_pods(client: &Client) -> Result<Vec<Pod>> {
    Ok(Api::<Pod>::namespaced(client.clone(), RELEASE_NAMESPACE)
        .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .collect())
}

async fn lease_holder(client: &Client) -> Result<String> {
    let lease = Api::<Lease>::namespaced(client.clone(), RELEASE_NAMESPACE)
        .get("hearth-controller")
        .await?;
    Ok(lease
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default())
}

/// The service's children by kind and name, with their UIDs (the load's Deployments left out).
async fn children(d: &stack::Deployed) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for dep in
        d.ns.api::<Deployment>()
            .list(&ListParams::default())
            .await?
            .items
    {
        let name = dep.name_any();
        if !name.starts_with("opted-") && !name.starts_with("plain-") {
            out.push((format!("Deployment/{name}"), dep.uid().unwrap_or_default()));
        }
    }
    for svc in
        d.ns.api::<Service>()
            .list(&ListParams::default())
            .await?
            .items
    {
        out.push((
            format!("Service/{}", svc.name_any()),
            svc.uid().unwrap_or_default(),
        ));
    }
    let so =
        d.ns.dynamic_api("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects");
    for o in so.list(&ListParams::default()).await?.items {
        out.push((
            format!("ScaledObject/{}", o.name_any()),
            o.uid().unwrap_or_default(),
        ));
    }
    out.sort();
    Ok(out)
}

/// Backend pods: (name, uid, restarts).
async fn backend_state(d: &stack::Deployed) -> Result<Vec<(String, String, i32)>> {
    let mut v: Vec<_> = d
        .backend_pods()
        .await?
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let restarts = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map(|cs| cs.iter().map(|c| c.restart_count).sum())
                .unwrap_or(0);
            (p.name_any(), p.uid().unwrap_or_default(), restarts)
        })
        .collect();
    v.sort();
    Ok(v)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fault suite: disrupts the shared cluster; tests/run-tests runs it last, alone"]
async fn active_controller_deleted_standby_takes_over() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let d = stack::deploy("e2e-fault-ctl", ScalerMode::Poll, max_one).await?;
    let client = d.cluster.client();
    let replicas =
        faults::ScaledDeployment::scale(&d.cluster, RELEASE_NAMESPACE, "hearth-controller", 2)
            .await?;
    let ready_two = || async {
        let pods = controller_pods(&client).await?;
        let ready = pods
            .iter()
            .filter(|p| hearth_test_support::pod_ready(p))
            .count();
        Ok(if pods.len() == 2 && ready == 2 {
            Observed::Ready(pods)
        } else {
            Observed::NotYet(hearth_test_support::describe_pods(&pods))
        })
    };
    wait_until(
        "two Ready controller replicas",
        Duration::from_secs(120),
        ready_two,
    )
    .await?;
    let warm = Ledger::default();
    served(&warm, &d.url, Duration::from_secs(150)).await?;
    let load = Load::start(load_config(&d, 2, true));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let before_children = children(&d).await?;
    let before_backend = backend_state(&d).await?;
    ensure!(!before_backend.is_empty(), "the backend is not running");
    let holder = lease_holder(&client).await?;
    let pods = controller_pods(&client).await?;
    let active = pods
        .iter()
        .map(|p| p.name_any())
        .find(|n| holder.starts_with(&format!("{n}-")))
        .with_context(|| format!("no controller pod holds the lease ({holder})"))?;

    let start = Instant::now();
    let fault_at = Instant::now();
    Api::<Pod>::namespaced(client.clone(), RELEASE_NAMESPACE)
        .delete(&active, &DeleteParams::default())
        .await?;
    edit_stabilization(&d, 16).await?;
    let new_holder = wait_until(
        "another controller replica holding the lease",
        Duration::from_secs(60),
        || async {
            let h = lease_holder(&client).await?;
            Ok(if h != holder && !h.is_empty() {
                Observed::Ready(h)
            } else {
                Observed::NotYet(h)
            })
        },
    )
    .await?;
    let takeover = fault_at.elapsed();
    wait_cooldown(&d, 16, Duration::from_secs(60)).await?;
    let recovery = fault_at.elapsed();
    // Let the new leader's first full reconcile pass settle before comparing.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let ledger = load.stop().await;
    let after_children = children(&d).await?;
    let after_backend = backend_state(&d).await?;
    wait_until(
        "two Ready controller replicas again",
        Duration::from_secs(120),
        ready_two,
    )
    .await?;
    replicas.restore().await?;

    let records: Vec<Record> = ledger
        .records()
        .into_iter()
        .filter(|r| r.sent >= start)
        .collect();
    let row = Row::from_records(
        "active controller pod deleted (1 of 2)",
        &records,
        Some(recovery),
    );
    print_rows("faults: controller", std::slice::from_ref(&row));
    eprintln!(
        "lease {holder} → {new_holder} after {:.1}s; edit carried out after {:.1}s",
        takeover.as_secs_f64(),
        recovery.as_secs_f64()
    );
    // The deleted holder releases the Lease on SIGTERM: the standby takes it at its next
    // attempt (every 2 s), not after the 15 s a killed holder's Lease runs.
    ensure!(
        takeover <= Duration::from_secs(10),
        "takeover took {takeover:?}: the stopping holder did not release the Lease (a renew period is 2 s)"
    );
    ensure!(
        before_children == after_children,
        "children changed across the takeover:\n before {before_children:?}\n after  {after_children:?}"
    );
    ensure!(
        before_backend == after_backend,
        "backend pods touched across the takeover:\n before {before_backend:?}\n after  {after_backend:?}"
    );
    ensure!(
        records.iter().all(|r| r.outcome == Outcome::Completed),
        "operations failed while the controller changed hands:\n  {}",
        failures(&records)
    );
    Ok(())
}

// --- (c) the webhook pods killed while Deployments are created --------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fault suite: disrupts the shared cluster; tests/run-tests runs it last, alone"]
async fn webhook_pods_killed_only_opted_in_admissions_refused_until_back() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let d = stack::deploy("e2e-fault-wh", ScalerMode::Poll, max_one).await?;
    let client = d.cluster.client();
    let pods_api = Api::<Pod>::namespaced(client.clone(), RELEASE_NAMESPACE);
    let lp = ListParams::default().labels("app.kubernetes.io/component=webhook");
    let load = Load::start(load_config(&d, 1, true));
    tokio::time::sleep(Duration::from_secs(5)).await;
    let start = Instant::now();
    let before: Vec<String> = pods_api
        .list(&lp)
        .await?
        .items
        .iter()
        .map(|p| p.name_any())
        .collect();
    ensure!(!before.is_empty(), "no webhook pod");
    let fault_at = Instant::now();
    for name in &before {
        pods_api
            .delete(
                name,
                &DeleteParams {
                    grace_period_seconds: Some(0),
                    ..DeleteParams::default()
                },
            )
            .await?;
    }
    eprintln!("deleted webhook pods {before:?} with grace period 0");
    wait_until(
        "a new webhook pod Ready",
        Duration::from_secs(120),
        || async {
            let pods = pods_api.list(&lp).await?.items;
            Ok(
                if pods
                    .iter()
                    .any(|p| !before.contains(&p.name_any()) && hearth_test_support::pod_ready(p))
                {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(hearth_test_support::describe_pods(&pods))
                },
            )
        },
    )
    .await?;
    let ready_at = Instant::now();
    // Admissions succeed again: an opted-in Deployment and an LLMService edit after the replica
    // came back (the apiserver reaches it once kube-proxy has its endpoint).
    wait_until(
        "opted-in admissions and LLMService edits served again",
        Duration::from_secs(60),
        || async {
            let ok = |k: Kind| {
                load.ledger
                    .sent_between(k, ready_at, Instant::now())
                    .iter()
                    .any(|r| r.outcome == Outcome::Completed)
            };
            Ok(if ok(Kind::OptedIn) && ok(Kind::Edit) {
                Observed::Ready(())
            } else {
                Observed::NotYet("not yet".into())
            })
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(10)).await;
    let ledger = load.stop().await;
    let records: Vec<Record> = ledger
        .records()
        .into_iter()
        .filter(|r| r.sent >= start)
        .collect();
    let last_refusal = records
        .iter()
        .filter(|r| !r.kind.is_request() && r.outcome != Outcome::Completed)
        .map(|r| r.ended)
        .max();
    let recovery = last_refusal.map_or(Duration::ZERO, |t| t.saturating_duration_since(fault_at));
    let row = Row::from_records(
        "webhook pods deleted (2 of 2, grace 0)",
        &records,
        Some(recovery),
    );
    print_rows("faults: webhook", std::slice::from_ref(&row));
    eprintln!(
        "a new webhook replica Ready {:.1}s after the deletion; last refusal {:.1}s after it",
        (ready_at - fault_at).as_secs_f64(),
        recovery.as_secs_f64()
    );
    for r in &records {
        match (r.kind, &r.outcome) {
            (_, Outcome::Completed) => {}
            (_, Outcome::Lost) => bail!("{:?} {} lost", r.kind, r.tag),
            (Kind::Unrelated, o) => {
                bail!(
                    "an unrelated Deployment {} was refused: {o:?} {}",
                    r.tag,
                    r.detail
                )
            }
            (Kind::Stream | Kind::Chat, o) => {
                bail!("a chat request failed: {o:?} {}", r.detail)
            }
            (Kind::OptedIn | Kind::Edit, Outcome::Failed(class)) => {
                ensure!(
                    class == "webhook refused",
                    "{:?} {} refused for another reason: {class} {}",
                    r.kind,
                    r.tag,
                    r.detail
                );
                ensure!(
                    r.ended >= fault_at && r.sent <= ready_at + Duration::from_secs(15),
                    "{:?} {} refused {:.1}s after the deletion, the webhook Ready after {:.1}s: {}",
                    r.kind,
                    r.tag,
                    (r.sent - fault_at).as_secs_f64(),
                    (ready_at - fault_at).as_secs_f64(),
                    r.detail
                );
            }
        }
    }
    let unrelated = records.iter().filter(|r| r.kind == Kind::Unrelated).count();
    ensure!(
        unrelated > 0,
        "no unrelated Deployment was created during the fault"
    );
    Ok(())
}

// --- (d) KEDA's operator down while a cold request arrives ------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fault suite: disrupts the shared cluster; tests/run-tests runs it last, alone"]
async fn keda_operator_down_while_a_cold_request_arrives() -> Result<()> {
    const DOWN: Duration = Duration::from_secs(20);
    let _serial = SERIAL.lock().await;
    let d = stack::deploy("e2e-fault-keda", ScalerMode::Poll, max_one).await?;
    let client = d.cluster.client();
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), "keda");
    let keda = deployments.get("keda-operator").await?;
    let selector = keda
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.clone())
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let keda_pods = Api::<Pod>::namespaced(client.clone(), "keda");
    let op = faults::ScaledDeployment::scale(&d.cluster, "keda", "keda-operator", 0).await?;
    let down_at = Instant::now();
    wait_until("no KEDA operator pod", Duration::from_secs(90), || async {
        let pods = keda_pods
            .list(&ListParams::default().labels(&selector))
            .await?
            .items;
        Ok(if pods.is_empty() {
            Observed::Ready(())
        } else {
            Observed::NotYet(hearth_test_support::describe_pods(&pods))
        })
    })
    .await?;
    // Cold requests, streaming and not, while nothing can scale the backend.
    let ledger = Ledger::default();
    let t0 = Instant::now();
    let requests = spawn_chats(
        &ledger,
        &d.url,
        &[true, false],
        LOAD_TOKENS,
        COLD_DEADLINE,
        "cold",
    );
    tokio::time::sleep(DOWN).await;
    ensure!(
        requests.iter().all(|r| !r.is_finished()),
        "a cold request ended while KEDA was down: {:?}",
        ledger.records()
    );
    ensure!(
        d.timeline.max_desired() == 0,
        "the backend scaled while KEDA's operator was down ({})",
        d.timeline_text(t0)
    );
    op.restore().await?;
    let back_at = Instant::now();
    for r in requests {
        r.await?;
    }
    let records = ledger.records();
    let answered = records.iter().map(|r| r.ended).max().unwrap_or(back_at);
    let recovery = answered.saturating_duration_since(back_at);
    let row = Row::from_records(
        "KEDA operator down while cold requests arrive",
        &records,
        Some(recovery),
    );
    print_rows("faults: KEDA", std::slice::from_ref(&row));
    eprintln!(
        "KEDA operator down {:.1}s (cold requests held {:.1}s of it); answered {:.1}s after KEDA was scaled back; timeline: {}",
        (back_at - down_at).as_secs_f64(),
        (back_at - t0).as_secs_f64(),
        recovery.as_secs_f64(),
        d.timeline_text(t0)
    );
    ensure!(
        records.iter().all(|r| r.outcome == Outcome::Completed),
        "cold requests not served once KEDA was back (activationTimeout 2m):\n  {}",
        failures(&records)
    );
    ensure!(
        recovery <= Duration::from_secs(90),
        "held requests answered {recovery:?} after KEDA came back"
    );
    Ok(())
}

// --- (e) the kubelet and containerd restarted -------------------------------------------------

/// Every pod of the namespaces, not terminating: (namespace/name, uid, restarts per container).
async fn pod_states(client: &Client, namespaces: &[&str]) -> Result<Vec<(String, String, i32)>> {
    let mut out = Vec::new();
    for ns in namespaces {
        for p in Api::<Pod>::namespaced(client.clone(), ns)
            .list(&ListParams::default())
            .await?
            .items
        {
            if p.metadata.deletion_timestamp.is_some() {
                continue;
            }
            let restarts = p
                .status
                .as_ref()
                .and_then(|s| s.container_statuses.as_ref())
                .map(|cs| cs.iter().map(|c| c.restart_count).sum())
                .unwrap_or(0);
            out.push((
                format!("{ns}/{}", p.name_any()),
                p.uid().unwrap_or_default(),
                restarts,
            ));
        }
    }
    out.sort();
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fault suite: disrupts the shared cluster; tests/run-tests runs it last, alone"]
async fn kubelet_and_containerd_restarted_running_pods_keep_serving() -> Result<()> {
    let _serial = SERIAL.lock().await;
    let d = stack::deploy("e2e-fault-node", ScalerMode::Poll, max_one).await?;
    let client = d.cluster.client();
    let warm = Ledger::default();
    served(&warm, &d.url, Duration::from_secs(150)).await?;
    let load = Load::start(load_config(&d, 2, true));
    tokio::time::sleep(Duration::from_secs(3)).await;
    let namespaces = [d.ns.name(), RELEASE_NAMESPACE, "keda"];
    let before = pod_states(&client, &namespaces).await?;
    // Two long streams that span the restart.
    let pinned = Ledger::default();
    let streams = spawn_chats(
        &pinned,
        &d.url,
        &[true; 2],
        PINNED_TOKENS,
        DEADLINE,
        "pinned",
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Instant::now();
    let log = faults::restart_components(&["containerd", "kubelet"], false).await?;
    let restarted = start.elapsed();
    eprintln!("{}", log.trim_end());
    // Recovered: the daemons serve again (the script waited for that) and a request is served
    // while the long streams still run.
    let recovered_at = served(&load.ledger, &d.url, Duration::from_secs(60)).await?;
    for s in streams {
        s.await?;
    }
    // A while of load with the new kubelet: its probes and status sync run again.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let ledger = load.stop().await;
    let after = pod_states(&client, &namespaces).await?;

    let mut records = pinned.records();
    records.extend(ledger.records().into_iter().filter(|r| r.sent >= start));
    let row = Row::from_records(
        "kubelet and containerd restarted (SIGTERM)",
        &records,
        Some(recovered_at - start),
    );
    print_rows("faults: node daemons", std::slice::from_ref(&row));
    eprintln!(
        "containerd and the kubelet stopped, started and serving again after {:.1}s",
        restarted.as_secs_f64()
    );
    ensure!(
        before == after,
        "pods replaced or containers restarted across the restart:\n before {before:?}\n after  {after:?}"
    );
    ensure!(
        records.iter().all(|r| r.outcome == Outcome::Completed),
        "operations failed while the node's daemons restarted:\n  {}",
        failures(&records)
    );
    Ok(())
}

// --- (f) kube-apiserver and etcd restarted ------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fault suite: disrupts the shared cluster; tests/run-tests runs it last, alone"]
async fn apiserver_and_etcd_restarted_controller_and_gateways_reconverge() -> Result<()> {
    let _serial = SERIAL.lock().await;
    // A warm service under load, and a cold one that gets requests while the apiserver is gone.
    let warm_svc = stack::deploy("e2e-fault-cp-warm", ScalerMode::Poll, max_one).await?;
    let cold_svc = stack::deploy("e2e-fault-cp-cold", ScalerMode::Push, max_one).await?;
    let client = warm_svc.cluster.client();
    let warm = Ledger::default();
    served(&warm, &warm_svc.url, Duration::from_secs(150)).await?;
    let load = Load::start(load_config(&warm_svc, 2, true));
    tokio::time::sleep(Duration::from_secs(3)).await;

    let start = Instant::now();
    let restart = tokio::spawn(faults::restart_components(
        &["etcd", "kube-apiserver"],
        false,
    ));
    // Cold requests once the apiserver is gone (its stop takes a moment).
    wait_until("kube-apiserver down", Duration::from_secs(30), || async {
        let probe = http::Request::get("/readyz").body(Vec::new())?;
        let up = tokio::time::timeout(
            Duration::from_secs(1),
            warm_svc.cluster.client().request_text(probe),
        )
        .await
        .is_ok_and(|r| r.is_ok());
        Ok(if up {
            Observed::NotYet("still ready".into())
        } else {
            Observed::Ready(())
        })
    })
    .await?;
    let down_at = Instant::now();
    let cold = Ledger::default();
    let requests = spawn_chats(
        &cold,
        &cold_svc.url,
        &[true, false],
        LOAD_TOKENS,
        COLD_DEADLINE,
        "cold",
    );
    let log = restart.await??;
    let back_at = Instant::now();
    eprintln!("{}", log.trim_end());
    for r in requests {
        r.await?;
    }
    let cold_answered = cold
        .records()
        .iter()
        .map(|r| r.ended)
        .max()
        .unwrap_or(back_at);
    // The controller converges: an edit made now is carried out (by the same leader, or by the
    // restarted one if it gave up its lease while the apiserver was gone).
    edit_stabilization(&cold_svc, 17).await?;
    wait_cooldown(&cold_svc, 17, Duration::from_secs(90)).await?;
    let converged_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(5)).await;

    // A short outage: both SIGKILLed and back within seconds, so the controller keeps its Lease
    // (no restart) and must re-open its watches on their own backoff. It once slept behind
    // kube-runtime's shared trigger backoff instead and left edits undone for minutes.
    let controller_restarts = || async {
        let mut v: Vec<(String, i32)> = controller_pods(&client)
            .await?
            .iter()
            .map(|p| {
                let restarts = p
                    .status
                    .iter()
                    .flat_map(|s| s.container_statuses.iter().flatten())
                    .map(|c| c.restart_count)
                    .sum();
                (p.name_any(), restarts)
            })
            .collect();
        v.sort();
        anyhow::Ok(v)
    };
    let controllers_before = controller_restarts().await?;
    let kill_start = Instant::now();
    let kill_log = faults::restart_components(&["etcd", "kube-apiserver"], true).await?;
    let kill_back = Instant::now();
    eprintln!("{}", kill_log.trim_end());
    edit_stabilization(&cold_svc, 18).await?;
    wait_cooldown(&cold_svc, 18, SHORT_OUTAGE_CONVERGENCE).await?;
    let kill_converged = Instant::now();
    let controllers_after = controller_restarts().await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ledger = load.stop().await;
    // kube-controller-manager and kube-scheduler re-watch on client-go's backoff, each
    // resource on its own (up to 30 s, plus as much again of jitter), and meanwhile act on
    // nothing new: a namespace created right after the restart got no default ServiceAccount
    // for over 30 s, and once a ServiceAccount was made a new Deployment still got no pod for
    // over a minute. The next test needs a whole cluster, so wait for one here.
    let whole = cluster_whole(&warm_svc.cluster).await?;
    eprintln!(
        "the cluster was whole again (a new namespace's ServiceAccount, and a new Deployment's pod scheduled) {:.1}s after the apiserver was back from the kill",
        kill_back.elapsed().as_secs_f64()
    );
    drop(whole);

    let mut records = cold.records();
    records.extend(
        ledger
            .records()
            .into_iter()
            .filter(|r| r.sent >= start && r.sent < kill_start),
    );
    let short: Vec<_> = ledger
        .records()
        .into_iter()
        .filter(|r| r.sent >= kill_start)
        .collect();
    let rows = [
        Row::from_records(
            "kube-apiserver and etcd restarted (SIGTERM)",
            &records,
            Some(converged_at - start),
        ),
        Row::from_records(
            "kube-apiserver and etcd killed (SIGKILL, back within seconds)",
            &short,
            Some(kill_converged - kill_start),
        ),
    ];
    print_rows("faults: control plane", &rows);
    eprintln!(
        "short outage: the apiserver serving again {:.1}s after the kill; the edit made then carried out {:.1}s later; controller pods (name, restarts) {controllers_before:?} -> {controllers_after:?}",
        (kill_back - kill_start).as_secs_f64(),
        (kill_converged - kill_back).as_secs_f64(),
    );
    ensure!(
        controllers_before == controllers_after,
        "a controller restarted or was replaced in an outage of seconds (its Lease lasts 15 s): {controllers_before:?} -> {controllers_after:?}"
    );
    records.extend(short);
    let keda_restarts: i32 = Api::<Pod>::namespaced(client.clone(), "keda")
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .flat_map(|p| {
            p.status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
        })
        .map(|c| c.restart_count)
        .sum();
    eprintln!(
        "apiserver unready {:.1}s after the restart began, serving again after {:.1}s; cold requests ended {:.1}s after it was back; an edit carried out {:.1}s after it was back; KEDA's containers have restarted {keda_restarts} times in all; the cold service's timeline: {}",
        (down_at - start).as_secs_f64(),
        (back_at - start).as_secs_f64(),
        cold_answered
            .saturating_duration_since(back_at)
            .as_secs_f64(),
        (converged_at - back_at).as_secs_f64(),
        cold_svc.timeline_text(start)
    );
    let outages = [(start, back_at), (kill_start, kill_back)];
    for r in &records {
        match (&r.outcome, r.kind.is_request()) {
            (Outcome::Completed, _) => {}
            (Outcome::Lost, _) => bail!("{:?} {} lost: {}", r.kind, r.tag, r.detail),
            // A held cold request waits for KEDA to scale the backend. KEDA's operator loses
            // its own lease in a long outage and exits, and the kubelet restarts it after its
            // crash-loop back-off, which grows with each restart (80 s from the fourth on): the
            // request may then end, as configured, with the activation-timeout error, never
            // sooner and never silently.
            (Outcome::Failed(class), true) if r.tag == "cold" => ensure!(
                r.detail.contains("activation timeout") && r.ended - r.sent >= ACTIVATION_TIMEOUT,
                "held cold request failed ({class}) after {:.1}s, not with the activation-timeout error after {ACTIVATION_TIMEOUT:?}: {}",
                (r.ended - r.sent).as_secs_f64(),
                r.detail
            ),
            // Chat never needs the apiserver: warm requests go through kube-proxy's rules and
            // the gateway's endpoint set. One exception, seen once in five runs (two requests):
            // "Network is unreachable" while the control plane restarted, the node briefly
            // without a rule for the Service's ClusterIP. The client is told at once; the
            // failure is reported in the row and, inside the outage, not a test failure.
            (Outcome::Failed(class), true)
                if r.detail.contains("Network is unreachable")
                    && outages
                        .iter()
                        .any(|&(from, to)| r.sent >= from && r.sent <= to + OUTAGE_GRACE) =>
            {
                eprintln!(
                    "{:?} {} failed ({class}) {:.1}s after the fault began: {}",
                    r.kind,
                    r.tag,
                    (r.sent - start).as_secs_f64(),
                    r.detail
                );
            }
            (Outcome::Failed(class), true) => {
                bail!("{:?} {} failed ({class}): {}", r.kind, r.tag, r.detail)
            }
            // Admissions need the apiserver: refused only while it was gone.
            (Outcome::Failed(_), false) => ensure!(
                outages
                    .iter()
                    .any(|&(from, to)| r.sent <= to && r.ended >= from),
                "{:?} refused while the apiserver was serving: {}",
                r.kind,
                r.detail
            ),
        }
    }
    ensure!(
        cold.records().len() == 2,
        "the cold requests were not all recorded"
    );
    Ok(())
}

// --- (g) a backend OOM-killed mid-stream ----------------------------------------------------

/// `vllm:num_requests_running` of a backend pod (its stub's /metrics), or None.
async fn backend_running(ip: &str) -> Option<f64> {
    let base = if ip.contains(':') {
        format!("http://[{ip}]:8000")
    } else {
        format!("http://{ip}:8000")
    };
    let (status, body) = client::get(&format!("{base}/metrics"), Duration::from_secs(3))
        .await
        .ok()?;
    if status != 200 {
        return None;
    }
    body.lines()
        .find(|l| l.starts_with("vllm:num_requests_running"))?
        .rsplit(' ')
        .next()?
        .parse()
        .ok()
}

/// The last termination reason of the backend container of a pod (`OOMKilled`, ...).
fn last_termination(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|c| c.name != "hearth-drain")?
        .last_state
        .as_ref()?
        .terminated
        .as_ref()?
        .reason
        .clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "fault suite: disrupts the shared cluster; tests/run-tests runs it last, alone"]
async fn backend_oom_killed_mid_stream_error_event_and_rerouted() -> Result<()> {
    // How long after the test saw the kill the gateway may still send to the killed backend.
    const KILL_SEEN_WITHIN: Duration = Duration::from_millis(250);
    let _serial = SERIAL.lock().await;
    // Two backends, always (min 2): one is OOM-killed, the other takes the traffic. The stub
    // manifest's `resources.memory: 128Mi` is the container's limit.
    let d = stack::deploy("e2e-fault-oom", ScalerMode::Poll, |_| {}).await?;
    // Raised after the deploy, which waits for ScaledToZero.
    patch_service(&d, json!({"scaling": {"min": 2, "max": 2}})).await?;
    let pods_api = d.ns.api::<Pod>();
    let ready_backends = || async {
        let pods: Vec<Pod> = d
            .backend_pods()
            .await?
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let ready = pods
            .iter()
            .filter(|p| hearth_test_support::pod_ready(p))
            .count();
        Ok(if pods.len() == 2 && ready == 2 {
            Observed::Ready(pods)
        } else {
            Observed::NotYet(hearth_test_support::describe_pods(&pods))
        })
    };
    let backends = wait_until(
        "two Ready backends",
        Duration::from_secs(150),
        ready_backends,
    )
    .await?;
    let warm = Ledger::default();
    served(&warm, &d.url, Duration::from_secs(60)).await?;
    let load = Load::start(load_config(&d, 2, false));
    // Long streams through the gateway: least-outstanding balancing spreads them over both.
    let pinned = Ledger::default();
    let streams = spawn_chats(&pinned, &d.url, &[true; 4], PINNED_TOKENS, DEADLINE, "long");
    let victim = backends[0].clone();
    let victim_ip = victim
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the victim backend has no IP")?;
    wait_until(
        "a long stream generating on the victim backend",
        Duration::from_secs(30),
        || async {
            let n = backend_running(&victim_ip).await;
            Ok(if n.is_some_and(|n| n >= 1.0) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("vllm:num_requests_running {n:?}"))
            })
        },
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let start = Instant::now();
    // The stub allocates until the kernel's OOM killer ends it at the container's limit.
    let oom_url = if victim_ip.contains(':') {
        format!("http://[{victim_ip}]:8000/stub/oom")
    } else {
        format!("http://{victim_ip}:8000/stub/oom")
    };
    let oom = client::post(&oom_url, Duration::from_secs(30)).await;
    let killed_at = Instant::now();
    ensure!(
        oom.is_err(),
        "the backend answered /stub/oom instead of being OOM-killed: {oom:?}"
    );
    eprintln!(
        "OOM-killed backend {} ({victim_ip}) after {:.2}s of allocation",
        victim.name_any(),
        (killed_at - start).as_secs_f64()
    );
    for s in streams {
        s.await?;
    }
    let long = pinned.records();
    // Recovered: the killed container restarted (OOMKilled) and both backends Ready.
    let victim_name = victim.name_any();
    let reason = wait_until(
        "the OOM-killed backend restarted and Ready",
        Duration::from_secs(120),
        || async {
            let p = pods_api.get(&victim_name).await?;
            let reason = last_termination(&p);
            Ok(if reason.is_some() && hearth_test_support::pod_ready(&p) {
                Observed::Ready(reason)
            } else {
                Observed::NotYet(format!(
                    "last termination {reason:?}, ready {}",
                    hearth_test_support::pod_ready(&p)
                ))
            })
        },
    )
    .await?;
    let recovered_at = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ledger = load.stop().await;

    let mut records = long.clone();
    records.extend(ledger.records().into_iter().filter(|r| r.sent >= start));
    let row = Row::from_records(
        "backend OOM-killed mid-stream (1 of 2)",
        &records,
        Some(recovered_at - killed_at),
    );
    print_rows("faults: backend", std::slice::from_ref(&row));
    ensure!(
        reason.as_deref() == Some("OOMKilled"),
        "the backend's container ended {reason:?}, not OOMKilled"
    );
    let cut: Vec<&Record> = long
        .iter()
        .filter(|r| r.outcome != Outcome::Completed)
        .collect();
    ensure!(
        !cut.is_empty(),
        "no long stream was on the killed backend: {long:?}"
    );
    for r in &records {
        match &r.outcome {
            Outcome::Completed => {}
            Outcome::Lost => bail!("{:?} {} lost: {}", r.kind, r.tag, r.detail),
            Outcome::Failed(class) => {
                // In flight on the killed backend: a stream ends with an error event, a plain
                // request with 502, at once; requests sent after the kill go to the other.
                // The test sees the kill when its own connection to the backend is reset; the
                // gateway learns it from its connections, a moment later: a request it sends in
                // that moment on a kept-alive connection to the victim fails as one in flight
                // (it never sends a POST twice: gateway/src/upstream.rs), hence KILL_SEEN_WITHIN.
                // "Network is unreachable" here means the node had no rule for the gateway
                // Service's ClusterIP: kube-proxy's log says why (a resync, a restart).
                ensure!(
                    r.sent < killed_at + KILL_SEEN_WITHIN,
                    "{:?} {} sent {:.1}s after the kill failed ({class}): {}\nthe real node's kube-proxy, last lines:\n{}",
                    r.kind,
                    r.tag,
                    r.sent.saturating_duration_since(killed_at).as_secs_f64(),
                    r.detail,
                    log_tail(&d.cluster, "kube-proxy.log", 40)
                );
                let expected = if r.kind == Kind::Stream {
                    "error event"
                } else {
                    "502"
                };
                ensure!(
                    class == expected,
                    "{:?} {} on the killed backend ended {class}, not {expected}: {}",
                    r.kind,
                    r.tag,
                    r.detail
                );
                ensure!(
                    r.ended.saturating_duration_since(killed_at) < Duration::from_secs(5),
                    "{:?} {} failed only {:.1}s after the kill",
                    r.kind,
                    r.tag,
                    r.ended.saturating_duration_since(killed_at).as_secs_f64()
                );
            }
        }
    }
    eprintln!(
        "long streams: {} completed, {} ended with an error event; the killed backend was Ready again {:.1}s after the kill",
        long.iter()
            .filter(|r| r.outcome == Outcome::Completed)
            .count(),
        cut.len(),
        (recovered_at - killed_at).as_secs_f64()
    );
    Ok(())
}

/// The last `lines` lines of the local cluster's log `file` (its state dir's `logs/`), or why
/// they could not be read.
fn log_tail(cluster: &Cluster, file: &str, lines: usize) -> String {
    let path = cluster
        .kubeconfig()
        .parent()
        .unwrap_or(std::path::Path::new("."))
        .join("logs")
        .join(file);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("({}: {e})", path.display()),
    }
}

//! Replicas limited by devices, not by `scaling.max`: the upstream stub service with
//! `scaling.max: 6` under a load that asks for 6 replicas gets only as many Ready backends as the
//! real node's device plugin has `hearth.dev/fake-gpu` (4); the others stay Pending, reported by
//! the scheduler as `Insufficient hearth.dev/fake-gpu`. Every request is still answered (the
//! gateway queues for the replicas that exist), and idle → 0. This file runs alone: it needs all
//! 4 devices.

mod stack;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::ScalerMode;
use hearth_test_support::{Observed, describe_pods, wait_until};
use k8s_openapi::api::core::v1::Pod;
use serde_json::Value;

use stack::SERVICE;

/// The node's `hearth.dev/fake-gpu` (tests/cluster/up starts the device plugin with 4).
const DEVICES: i32 = 4;
/// Concurrent streaming clients: pending 6 at target 1 asks for `scaling.max` = 6 replicas.
const CLIENTS: usize = 6;

fn insufficient_devices(p: &Pod) -> bool {
    hearth_test_support::unschedulable_message(p)
        .is_some_and(|m| m.contains("Insufficient hearth.dev/fake-gpu"))
}

/// `hearth.dev/fake-gpu` requested by pods bound to a node and not finished, outside `ns`.
async fn devices_used_elsewhere(client: &kube::Client, ns: &str) -> Result<i32> {
    let pods: kube::Api<Pod> = kube::Api::all(client.clone());
    let mut used = 0;
    for p in pods.list(&Default::default()).await?.items {
        let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
        let Some(spec) = p.spec.as_ref() else {
            continue;
        };
        if p.metadata.namespace.as_deref() == Some(ns)
            || spec.node_name.is_none()
            || matches!(phase, Some("Succeeded" | "Failed"))
        {
            continue;
        }
        for c in &spec.containers {
            if let Some(q) = c
                .resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get("hearth.dev/fake-gpu"))
            {
                used += q.0.parse::<i32>().unwrap_or(0);
            }
        }
    }
    Ok(used)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_beyond_the_nodes_devices_stay_pending_and_no_request_is_lost() -> Result<()> {
    let d = stack::deploy("e2e-devices", ScalerMode::Push, |o| {
        o["spec"]["scaling"]["max"] = Value::from(6);
    })
    .await?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..CLIENTS {
        let (url, stop) = (d.url.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut traces = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                traces.push(
                    client::chat_with(&url, SERVICE, true, Some(40), Duration::from_secs(240))
                        .await,
                );
            }
            traces
        }));
    }
    // KEDA asks for more than the node can hold; the devices bound what runs.
    let observed = wait_until(
        "more replicas desired than devices, the extra pods Pending for lack of hearth.dev/fake-gpu, the rest Ready",
        Duration::from_secs(240),
        || async {
            let pods = d.backend_pods().await?;
            let pending = pods.iter().filter(|p| insufficient_devices(p)).count();
            // Devices held by other namespaces' pods (a suite before this one may still be
            // terminating its backends) are not ours to fill.
            let free = DEVICES - devices_used_elsewhere(&d.cluster.client(), d.ns.name()).await?;
            let last = d.timeline.last();
            Ok(match last {
                Some(s) if s.desired > DEVICES && pending > 0 && s.ready >= free => {
                    Observed::Ready((s, pending, describe_pods(&pods)))
                }
                _ => Observed::NotYet(format!("{last:?}; {}", describe_pods(&pods))),
            })
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let mut load = Vec::new();
    for w in workers {
        load.extend(w.await?);
    }
    let (sample, pending, pods) =
        observed.with_context(|| d.timeline_text(std::time::Instant::now()))?;
    ensure!(
        sample.ready + pending as i32 <= sample.desired,
        "more pods than desired: {sample:?}, {pending} pending"
    );
    ensure!(
        d.timeline.max_ready() <= DEVICES,
        "{} ready replicas on a node with {DEVICES} devices",
        d.timeline.max_ready()
    );
    ensure!(!load.is_empty(), "no load request was sent");
    for t in &load {
        let t = t
            .as_ref()
            .map_err(|e| anyhow::anyhow!("load request failed: {e}"))?;
        let tokens = t.tokens(None);
        ensure!(
            t.status == 200 && t.complete() && tokens == 40,
            "load request lost: status {}, {tokens} tokens, last events {:?}",
            t.status,
            t.events.iter().rev().take(3).collect::<Vec<_>>()
        );
    }
    d.wait_zero(Duration::from_secs(240)).await?;
    println!(
        "{} requests answered; desired {} with {} Ready and {pending} Pending for lack of devices (max Ready {}); pods: {pods}",
        load.len(),
        sample.desired,
        sample.ready,
        d.timeline.max_ready()
    );
    Ok(())
}

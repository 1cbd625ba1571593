//! Cold-start behaviours beyond keepalive, on the upstream stub service:
//! - `coldStart.mode: reject`: a cold request gets a fast `503` with `Retry-After`, and the model
//!   still wakes, so the retry succeeds;
//! - a runtime requesting a resource no node has: the backend pod stays Pending and held
//!   requests end at `activationTimeout` (a streaming one with an SSE `error` event after its
//!   heartbeats, a plain one with `503`).

mod stack;

use std::time::Duration;

use anyhow::{Result, ensure};
use hearth_e2e_harness::client::{self, Event};
use hearth_e2e_harness::stack::{self as hstack, ScalerMode};
use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use serde_json::Value;

use stack::SERVICE;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_mode_answers_503_with_retry_after_and_still_wakes() -> Result<()> {
    // The one change to the upstream manifest: the cold-start mode under test.
    let d = stack::deploy("e2e-reject", ScalerMode::Poll, |o| {
        o["spec"]["endpoint"]["coldStart"]["mode"] = Value::from("reject");
    })
    .await?;
    let t = client::chat(&d.url, SERVICE, false, Duration::from_secs(30)).await?;
    ensure!(
        t.status == 503,
        "cold request in reject mode answered {}",
        t.status
    );
    let retry = t.retry_after.clone();
    ensure!(retry.is_some(), "503 without Retry-After");
    // Fast: answered before any backend was ready (the gateway did not hold it).
    let ready = d.timeline.first_after(t.sent, |s| s.ready >= 1);
    ensure!(
        ready.is_none_or(|r| t.end < r),
        "the 503 came after a backend was ready"
    );
    // The model still wakes: retry as told until served.
    let wait = Duration::from_secs(retry.as_deref().and_then(|r| r.parse().ok()).unwrap_or(1));
    let mut tries = 0;
    let served = loop {
        tokio::time::sleep(wait).await;
        tries += 1;
        let t = client::chat(&d.url, SERVICE, true, Duration::from_secs(60)).await?;
        if t.status == 200 {
            break t;
        }
        ensure!(
            t.status == 503 && tries < 120,
            "retry {tries} answered {}",
            t.status
        );
    };
    ensure!(
        served.complete(),
        "served stream incomplete: {:?}",
        served.events
    );
    ensure!(
        d.timeline.first_after(t.sent, |s| s.desired >= 1).is_some(),
        "never scaled 0 → 1"
    );
    println!(
        "reject: 503 Retry-After {retry:?}, served after {tries} retries; timeline {}",
        d.timeline_text(t.sent)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unschedulable_runtime_times_out_held_requests() -> Result<()> {
    let cluster = hearth_test_support::Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    // A copy of the upstream stub runtime whose accelerator no node advertises.
    let mut rt = hstack::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    let name = format!("vllm-stub-absent-{}", std::process::id());
    rt["metadata"]["name"] = Value::from(name.clone());
    rt["spec"]["accelerator"]["resourceName"] = Value::from("hearth.dev/absent-accelerator");
    hstack::apply(&client, rt, None).await?;
    let runtimes = hstack::inference_runtimes(&client);
    let result = async {
        let d = stack::deploy("e2e-absent", ScalerMode::Poll, |o| {
            o["spec"]["runtime"]["name"] = Value::from(name.clone());
            o["spec"]["scaling"]["activationTimeout"] = Value::from("20s");
        })
        .await?;
        let (s, p) = tokio::join!(
            client::chat(&d.url, SERVICE, true, Duration::from_secs(90)),
            client::chat(&d.url, SERVICE, false, Duration::from_secs(90)),
        );
        let (s, p) = (s?, p?);
        ensure!(s.status == 200, "held stream answered {}", s.status);
        ensure!(
            s.heartbeats() >= 1,
            "no heartbeat while held: {:?}",
            s.events
        );
        let err = s.events.iter().find_map(|(_, e)| match e {
            Event::Error(m) => Some(m.clone()),
            _ => None,
        });
        ensure!(
            err.as_deref()
                .is_some_and(|m| m.contains("activation timeout")),
            "held stream did not end with an activation-timeout error event: {:?}",
            s.events
        );
        ensure!(
            s.text().is_empty(),
            "tokens from a backend that cannot schedule"
        );
        ensure!(
            p.status == 503,
            "held plain request answered {} ({})",
            p.status,
            p.body
        );
        ensure!(
            p.body.contains("activation timeout"),
            "503 body does not name the activation timeout: {}",
            p.body
        );
        // Held for activationTimeout (20 s) as specified, not failed early.
        ensure!(
            p.end - p.sent >= Duration::from_secs(20),
            "plain request ended after {:?}",
            p.end - p.sent
        );
        // The backend pod exists and is unschedulable.
        let pods: Vec<Pod> = d.backend_pods().await?;
        let unschedulable = pods.iter().any(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.status == "False"
                            && c.reason.as_deref() == Some("Unschedulable")
                    })
                })
        });
        ensure!(
            unschedulable,
            "no Unschedulable backend pod: {}",
            hearth_test_support::describe_pods(&pods)
        );
        println!(
            "absent accelerator: stream error {:?} after {} heartbeats; plain 503 after {:.1}s",
            err,
            s.heartbeats(),
            (p.end - p.sent).as_secs_f64()
        );
        Ok(())
    }
    .await;
    let _ = runtimes.delete(&name, &DeleteParams::default()).await;
    result
}

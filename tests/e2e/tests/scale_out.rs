//! Sustained load above target scales the upstream stub service 1 → N, bounded by its
//! `scaling.max` (2) and the real node's fake GPUs (4 × `hearth.dev/fake-gpu`, served by its
//! device plugin and allocated by the kubelet; the two tests of this file together use all 4); then idle → N → 0 while in-flight streams
//! complete (the backend's preStop drain), with no request lost. Both scaler modes.

mod stack;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::ScalerMode;
use hearth_test_support::{Observed, wait_until};

use stack::SERVICE;

/// Concurrent clients of the load phase: pending demand 4 at target 1 asks for 4 replicas,
/// above `scaling.max`.
const CLIENTS: usize = 4;
/// Tokens per load request (150 ms each in the stub runtime): 3 s streams.
const LOAD_TOKENS: u32 = 20;

async fn load_then_idle(mode: ScalerMode) -> Result<()> {
    let d = stack::deploy(&format!("e2e-out-{}", mode.annotation()), mode, |_| {}).await?;
    let stop = Arc::new(AtomicBool::new(false));
    let mut workers = Vec::new();
    for _ in 0..CLIENTS {
        let (url, stop) = (d.url.clone(), stop.clone());
        workers.push(tokio::spawn(async move {
            let mut traces = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let t = client::chat_with(
                    &url,
                    SERVICE,
                    true,
                    Some(LOAD_TOKENS),
                    Duration::from_secs(180),
                )
                .await;
                traces.push(t);
            }
            traces
        }));
    }
    // 1 → N: both replicas ready under load.
    let reached = wait_until(
        "2 ready backend replicas under load",
        Duration::from_secs(180),
        || async {
            let last = d.timeline.last();
            Ok(match last {
                Some(s) if s.ready >= 2 => Observed::Ready(()),
                _ => Observed::NotYet(format!("{last:?}")),
            })
        },
    )
    .await;
    // Keep the load a little longer at N, then two long streams stay in flight while the
    // load stops: A ends first, so demand falls to 1 and a replica is removed while B runs.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let url = d.url.clone();
    let long_a = tokio::spawn(async move {
        client::chat_with(&url, SERVICE, true, Some(60), Duration::from_secs(180)).await
    });
    let url = d.url.clone();
    let long_b = tokio::spawn(async move {
        client::chat_with(&url, SERVICE, true, Some(250), Duration::from_secs(180)).await
    });
    stop.store(true, Ordering::Relaxed);
    let mut load = Vec::new();
    for w in workers {
        load.extend(w.await?);
    }
    reached.with_context(|| d.timeline_text(std::time::Instant::now()))?;

    ensure!(!load.is_empty(), "no load request was sent");
    for t in &load {
        let t = t
            .as_ref()
            .map_err(|e| anyhow::anyhow!("load request failed: {e}"))?;
        ensure!(
            t.status == 200 && t.complete(),
            "load request lost: status {}, events {:?}",
            t.status,
            t.events
        );
        ensure!(
            t.tokens(None) == LOAD_TOKENS as usize,
            "load request got {} of {LOAD_TOKENS} tokens",
            t.tokens(None)
        );
    }
    let a = long_a.await??;
    let b = long_b.await??;
    for (t, n) in [(&a, 60), (&b, 250)] {
        ensure!(
            t.status == 200 && t.complete(),
            "in-flight stream lost during scale-down: status {}, last events {:?}",
            t.status,
            t.events.iter().rev().take(3).collect::<Vec<_>>()
        );
        ensure!(
            t.tokens(None) == n,
            "in-flight stream got {} of {n} tokens",
            t.tokens(None)
        );
    }
    // N never above max (2), which also keeps it within the 4 fake GPUs shared by both tests.
    ensure!(
        d.timeline.max_desired() == 2,
        "max desired replicas {} (want exactly scaling.max = 2)",
        d.timeline.max_desired()
    );
    ensure!(
        d.timeline.max_ready() == 2,
        "max ready replicas {}",
        d.timeline.max_ready()
    );

    // Idle → 0.
    d.wait_zero(Duration::from_secs(240)).await?;
    let t0 = load
        .iter()
        .filter_map(|t| t.as_ref().ok())
        .map(|t| t.sent)
        .min()
        .unwrap_or_else(std::time::Instant::now);
    println!(
        "[{}] {} load requests, 2 long streams (60 and 250 tokens) completed; timeline: {}",
        mode.annotation(),
        load.len(),
        d.timeline_text(t0)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_load_scales_out_then_drains_to_zero() -> Result<()> {
    load_then_idle(ScalerMode::Poll).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_mode_load_scales_out_then_drains_to_zero() -> Result<()> {
    load_then_idle(ScalerMode::Push).await
}

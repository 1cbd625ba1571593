//! The whole loop of the upstream stub service on the local cluster, in both scaler modes:
//! apply → ScaledToZero with no backend pod; a cold streaming chat completion → SSE heartbeats
//! while the backend goes 0 → 1 → tokens → 200; then idle → back to 0, the idle pod leaving
//! as soon as its drain sidecar sees the engine idle (not after the whole `drainTimeout`).
//! Hearth is installed with its chart and every pod runs on the real node of `tests/cluster/up`
//! (needs root); see docs/e2e.md.

mod stack;

use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use hearth_e2e_harness::client::{self, Event};
use hearth_e2e_harness::stack::ScalerMode;

use stack::{SERVICE, TOKENS};

async fn cold_start_then_back_to_zero(mode: ScalerMode) -> Result<()> {
    let d = stack::deploy(&format!("e2e-zero-{}", mode.annotation()), mode, |_| {}).await?;
    // apply → ScaledToZero, and no backend pod exists.
    ensure!(
        d.backend_pods().await?.is_empty(),
        "a backend pod exists while ScaledToZero"
    );

    let trace = client::chat(&d.url, SERVICE, true, Duration::from_secs(150)).await?;
    let t0 = trace.sent;
    let tl = d.timeline_text(t0);
    ensure!(
        trace.status == 200,
        "cold stream answered {} ({tl})",
        trace.status
    );
    ensure!(
        trace.complete(),
        "cold stream did not end with [DONE]: {:?} ({tl})",
        trace.events
    );
    let tokens = trace.tokens(None);
    ensure!(tokens == TOKENS, "{tokens} tokens, the stub sends {TOKENS}");
    let first_token = trace.first_token().expect("complete stream has tokens");
    let heartbeats_before = trace
        .events
        .iter()
        .take_while(|(_, e)| *e == Event::Heartbeat)
        .count();
    ensure!(
        heartbeats_before >= 1,
        "no SSE heartbeat before the first token: {:?}",
        trace.events
    );
    // 0 → 1 happened after the request and the backend was ready before the first token.
    let scaled = d.timeline.first_after(t0, |s| s.desired >= 1);
    let ready = d.timeline.first_after(t0, |s| s.ready >= 1);
    ensure!(scaled.is_some(), "the backend never scaled 0 → 1 ({tl})");
    ensure!(
        ready.is_some_and(|r| r <= first_token),
        "first token before any ready backend ({tl})"
    );
    ensure!(
        d.timeline.max_desired() == 1,
        "one request at target 1 scaled to {} replicas ({tl})",
        d.timeline.max_desired()
    );

    // Idle → 0.
    d.wait_zero(Duration::from_secs(180)).await?;
    let gone = Instant::now();
    d.wait_phase("ScaledToZero", Duration::from_secs(60))
        .await?;
    let back = Instant::now();
    // The idle pod's preStop (an httpGet to the hearth-drain sidecar) ends after the drain's
    // settle time (2 s), not after the service's drainTimeout (20 s) as a `sleep` would.
    let zeroed = ready
        .and_then(|r| d.timeline.first_after(r, |s| s.desired == 0))
        .unwrap_or(gone);
    let termination = gone.saturating_duration_since(zeroed);
    ensure!(
        termination < Duration::from_secs(15),
        "the idle backend pod took {termination:?} to go after scale-down (drainTimeout is 20s: was the preStop a fixed wait?) ({})",
        d.timeline_text(t0)
    );
    println!(
        "[{}] sent 0.00s, scaled 0→1 {:.2}s, ready {:.2}s, first token {:.2}s, last token {:.2}s, {} heartbeats, idle pod gone {:.1}s after scale-down, back to 0 by {:.1}s; timeline: {}",
        mode.annotation(),
        scaled.map(|s| (s - t0).as_secs_f64()).unwrap_or_default(),
        ready.map(|s| (s - t0).as_secs_f64()).unwrap_or_default(),
        (first_token - t0).as_secs_f64(),
        (trace.last_token().unwrap_or(first_token) - t0).as_secs_f64(),
        heartbeats_before,
        termination.as_secs_f64(),
        (back - t0).as_secs_f64(),
        d.timeline_text(t0),
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_cold_start_then_back_to_zero() -> Result<()> {
    cold_start_then_back_to_zero(ScalerMode::Poll).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_mode_cold_start_then_back_to_zero() -> Result<()> {
    cold_start_then_back_to_zero(ScalerMode::Push).await
}

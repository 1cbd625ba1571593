//! Warm windows on the real node (`spec.scaling.warmWindows`, poll mode): the upstream stub
//! service deployed without a window is at zero; a daily window that is open now (UTC, opened
//! two minutes ago, closing in 30 minutes, `replicas: 1`) brings the backend 0 → 1 without any
//! request and keeps it there past the scale-down stabilization; the window moved to one that
//! opens in an hour takes it back to 0. The ScaledObject carries each window as a KEDA `cron`
//! trigger after the demand trigger, and KEDA keeps the demand metric first in
//! `status.externalMetricNames`. See docs/e2e.md.

mod stack;

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::stack::{self as harness, ScalerMode};
use hearth_test_support::{Observed, wait_until};
use serde_json::{Value, json};

use stack::SERVICE;

/// The current minute of the UTC day (0..1440).
fn utc_minute_of_day() -> Result<i64> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    Ok(i64::try_from(secs / 60 % 1440)?)
}

/// A daily cron expression (UTC) for `offset` minutes from `now` (a minute of the day),
/// wrapping around midnight.
fn daily_at(now: i64, offset: i64) -> String {
    let m = (now + offset).rem_euclid(1440);
    format!("{} {} * * *", m % 60, m / 60)
}

/// A daily UTC window from `open` to `close` minutes from now, keeping one replica.
fn window(open: i64, close: i64) -> Result<Value> {
    let now = utc_minute_of_day()?;
    Ok(json!({
        "timezone": "UTC",
        "start": daily_at(now, open),
        "end": daily_at(now, close),
        "replicas": 1,
    }))
}

/// Applies the stub service (as `stack::deploy` applied it) with `windows`.
async fn apply_windows(d: &stack::Deployed, windows: Value) -> Result<()> {
    let mut obj = harness::stub_service(d.ns.name(), ScalerMode::Poll)?;
    obj["spec"]["scaling"]["warmWindows"] = windows;
    harness::apply(&d.cluster.client(), obj, None)
        .await
        .context("applying the stub service with its warm windows")?;
    Ok(())
}

/// Waits until the ScaledObject's triggers are the demand trigger followed by `windows` as
/// `cron` triggers, and KEDA has reconciled it (one external metric per trigger, the demand
/// metric first).
async fn wait_triggers(d: &stack::Deployed, windows: &[Value]) -> Result<Value> {
    let scaled_objects =
        d.ns.dynamic_api("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects");
    let want: Vec<Value> = windows
        .iter()
        .map(|w| {
            json!({"type": "cron", "metadata": {
                "timezone": w["timezone"],
                "start": w["start"],
                "end": w["end"],
                "desiredReplicas": w["replicas"].to_string(),
            }})
        })
        .collect();
    wait_until(
        format!("ScaledObject {SERVICE} with the metrics-api trigger and {} cron triggers, reconciled by KEDA", want.len()),
        Duration::from_secs(60),
        || async {
            let so = scaled_objects.get(SERVICE).await?;
            let triggers = so.data["spec"]["triggers"].as_array().cloned().unwrap_or_default();
            let names: Vec<String> = so.data["status"]["externalMetricNames"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|n| n.as_str().map(str::to_owned))
                .collect();
            let triggers_ok = triggers.first().is_some_and(|t| t["type"] == "metrics-api")
                && triggers[1..] == want[..];
            let names_ok = names.len() == triggers.len()
                && names.first().is_some_and(|n| n.starts_with("s0-") && !n.contains("cron"))
                && names[1..]
                    .iter()
                    .enumerate()
                    .all(|(i, n)| n.starts_with(&format!("s{}-cron-", i + 1)));
            Ok(if triggers_ok && names_ok {
                Observed::Ready(so.data)
            } else {
                Observed::NotYet(format!(
                    "triggers {}, externalMetricNames {names:?}",
                    so.data["spec"]["triggers"]
                ))
            })
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_keeps_a_replica_warm_without_requests_and_zero_returns_after_it() -> Result<()> {
    let d = stack::deploy("e2e-warm", ScalerMode::Poll, |_| {}).await?;
    // No window: at zero, one trigger.
    ensure!(
        d.backend_pods().await?.is_empty(),
        "a backend pod exists while ScaledToZero"
    );
    wait_triggers(&d, &[]).await?;

    // A window open now: 0 → 1 with no request sent.
    let open = window(-2, 30)?;
    let t_open = Instant::now();
    apply_windows(&d, json!([open.clone()])).await?;
    let so = wait_triggers(&d, std::slice::from_ref(&open)).await?;
    ensure!(
        so["spec"]["minReplicaCount"] == 0,
        "a window changed minReplicaCount: {}",
        so["spec"]
    );
    d.wait_phase("Ready", Duration::from_secs(120)).await?;
    let tl = || d.timeline_text(t_open);
    let scaled = d
        .timeline
        .first_after(t_open, |s| s.desired >= 1)
        .with_context(|| format!("Ready without a scale-up? ({})", tl()))?;
    ensure!(
        scaled.saturating_duration_since(t_open) < Duration::from_secs(60),
        "the open window scaled the backend 0 → 1 only after {:?} ({})",
        scaled.saturating_duration_since(t_open),
        tl()
    );
    // Held by the window, not by demand: still 1 well past the 15 s scale-down stabilization.
    tokio::time::sleep(Duration::from_secs(40)).await;
    let last = d.timeline.last();
    ensure!(
        last.is_some_and(|s| s.desired == 1 && s.ready == 1),
        "the window did not keep one replica ({})",
        tl()
    );
    ensure!(
        d.timeline.first_after(scaled, |s| s.desired == 0).is_none(),
        "the backend went to 0 while the window was open ({})",
        tl()
    );
    ensure!(
        d.timeline.max_desired() == 1,
        "a window of replicas 1 scaled to {} ({})",
        d.timeline.max_desired(),
        tl()
    );

    // The window moved to one that opens in an hour: closed now, back to 0.
    let closed = window(60, 90)?;
    let t_close = Instant::now();
    apply_windows(&d, json!([closed.clone()])).await?;
    wait_triggers(&d, std::slice::from_ref(&closed)).await?;
    // KEDA scales to zero `cooldownPeriod` (15 s) after a trigger was last active, here the
    // cron trigger until the edit; the slack covers KEDA's poll and the pod's drain.
    d.wait_zero(Duration::from_secs(120)).await?;
    d.wait_phase("ScaledToZero", Duration::from_secs(60))
        .await?;
    let zeroed = d
        .timeline
        .first_after(t_close, |s| s.desired == 0)
        .unwrap_or_else(Instant::now);
    println!(
        "window opened 0.00s, scaled 0→1 {:.2}s; window closed {:.2}s, back to 0 {:.2}s; timeline: {}",
        scaled.saturating_duration_since(t_open).as_secs_f64(),
        t_close.saturating_duration_since(t_open).as_secs_f64(),
        zeroed.saturating_duration_since(t_open).as_secs_f64(),
        tl()
    );
    Ok(())
}

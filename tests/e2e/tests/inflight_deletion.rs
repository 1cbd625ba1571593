//! Deleting the backend pod that serves an in-flight stream: the pod is found by asking each
//! backend pod's own `/metrics` which one is generating (`vllm:num_requests_running`), not by
//! picking "a replica". Its preStop drain (the `hearth-drain` sidecar) holds the termination
//! until the engine is idle, so the stream still ends `200` with every token and `[DONE]`, and
//! the pod goes right after, well inside its grace period.

mod stack;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::ScalerMode;
use hearth_test_support::{Observed, wait_until};
use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;

use stack::SERVICE;

/// Tokens of the stream (150 ms each in the stub runtime): about 15 s.
const STREAM_TOKENS: u32 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_pod_serving_a_stream_loses_no_token() -> Result<()> {
    let d = stack::deploy("e2e-inflight", ScalerMode::Poll, |_| {}).await?;
    let url = d.url.clone();
    let stream = tokio::spawn(async move {
        client::chat_with(
            &url,
            SERVICE,
            true,
            Some(STREAM_TOKENS),
            Duration::from_secs(240),
        )
        .await
    });

    // The pod generating the stream: the one whose engine reports a running request.
    let serving: Pod = wait_until(
        "the backend pod serving the stream",
        Duration::from_secs(150),
        || async {
            let pods = d.backend_pods().await?;
            let mut seen = Vec::new();
            for p in pods {
                let Some(ip) = p.status.as_ref().and_then(|s| s.pod_ip.clone()) else {
                    continue;
                };
                let metrics =
                    client::get(&format!("http://{ip}:8000/metrics"), Duration::from_secs(5)).await;
                let running = metrics
                    .ok()
                    .and_then(|(_, text)| client::metric_value(&text, "vllm:num_requests_running"))
                    .unwrap_or(0.0);
                seen.push(format!(
                    "{} {ip}: {running} running",
                    p.metadata.name.as_deref().unwrap_or("?")
                ));
                if running >= 1.0 {
                    return Ok(Observed::Ready(p));
                }
            }
            Ok(Observed::NotYet(seen.join("; ")))
        },
    )
    .await?;
    let name = serving.metadata.name.clone().context("pod name")?;
    let deleted = Instant::now();
    d.ns.api::<Pod>()
        .delete(&name, &DeleteParams::default())
        .await?;

    let trace = stream.await??;
    // Right after the stream's end the pod still exists: its termination waited for the stream
    // (the drain then settles for a moment before the preStop returns).
    let pods = d.ns.api::<Pod>();
    let held = pods.get_opt(&name).await?.is_some();
    let tokens = trace.tokens(None);
    ensure!(
        trace.status == 200 && trace.complete(),
        "the stream served by the deleted pod {name}: status {}, last events {:?}",
        trace.status,
        trace.events.iter().rev().take(3).collect::<Vec<_>>()
    );
    ensure!(
        tokens == STREAM_TOKENS as usize,
        "the stream got {tokens} of {STREAM_TOKENS} tokens"
    );
    let after_delete = trace.tokens(Some(deleted));
    ensure!(
        after_delete > 0,
        "no token arrived after the deletion: the stream ended before it, so nothing was tested"
    );

    ensure!(
        held,
        "pod {name} was gone when the stream it served ended: its termination did not wait"
    );
    // The pod goes once the drain sees the engine idle, before the grace period (30 s from
    // the deletion) could have forced it.
    wait_until(
        format!("pod {name} gone"),
        Duration::from_secs(60),
        || async {
            Ok(match pods.get_opt(&name).await? {
                None => Observed::Ready(()),
                Some(p) => Observed::NotYet(hearth_test_support::describe_pods(&[p])),
            })
        },
    )
    .await?;
    let gone = Instant::now();
    println!(
        "deleted {name} while it streamed: {after_delete} of {tokens} tokens arrived after the deletion, the stream ended {:.1}s after it (200, [DONE]), the pod was gone {:.1}s after it",
        (trace.end - deleted).as_secs_f64(),
        (gone - deleted).as_secs_f64()
    );
    Ok(())
}

//! The upstream suite's own manifests (`../shared/examples/upstream/`), applied unchanged on a
//! chart-installed Hearth:
//! - the stub runtime and service (namespace `hearth-e2e`, as written) are served for real: the
//!   stub image runs on the real node and a cold chat completion is answered with every token;
//! - the NVIDIA A10 and Ascend 910B3 runtimes and services are accepted and reconciled (a
//!   phase is reported; their caches wait for a storage class this cluster does not have).

mod stack;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack as hstack;
use hearth_test_support::{Cluster, Observed, upstream_file, wait_until};
use kube::Client;

/// Waits for an LLMService's phase.
async fn wait_phase(client: &Client, ns: &str, name: &str, want: &str) -> Result<()> {
    wait_until(
        format!("LLMService {ns}/{name} phase {want}"),
        Duration::from_secs(120),
        || async {
            let p = hstack::phase(client, ns, name).await?;
            Ok(if p.as_deref() == Some(want) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("phase {p:?}"))
            })
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_manifests_apply_unchanged_and_the_stub_serves_for_real() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    // The upstream stub service names its namespace; the guard deletes it at the end.
    let service = hstack::first_manifest(&upstream_file("stub-llmservice.yaml"))?;
    let ns_name = service["metadata"]["namespace"]
        .as_str()
        .context("the upstream stub service names no namespace")?
        .to_string();
    let ns = cluster.namespace_named(&ns_name).await?;
    for file in [
        "stub-inferenceruntime.yaml",
        "stub-llmservice.yaml",
        "nvidia-a10-inferenceruntime.yaml",
        "ascend-910b3-inferenceruntime.yaml",
    ] {
        hstack::apply_file(&client, &upstream_file(file), None).await?;
    }
    // The accelerator examples name no namespace: into this test's.
    for file in ["nvidia-a10-llmservice.yaml", "ascend-910b3-llmservice.yaml"] {
        hstack::apply_file(&client, &upstream_file(file), Some(ns.name())).await?;
    }
    let stub = service["metadata"]["name"]
        .as_str()
        .context("no service name")?;
    wait_phase(&client, ns.name(), stub, "ScaledToZero").await?;
    let mut phases = Vec::new();
    for file in ["nvidia-a10-llmservice.yaml", "ascend-910b3-llmservice.yaml"] {
        let obj = hstack::first_manifest(&upstream_file(file))?;
        let name = obj["metadata"]["name"].as_str().context("no name")?;
        let phase = wait_until(
            format!("LLMService {}/{name} reconciled (a phase)", ns.name()),
            Duration::from_secs(60),
            || async {
                Ok(match hstack::phase(&client, ns.name(), name).await? {
                    Some(p) => Observed::Ready(p),
                    None => Observed::NotYet("no phase yet".into()),
                })
            },
        )
        .await?;
        phases.push(format!("{name}: {phase}"));
    }

    let url = hstack::service_url(&client, ns.name(), stub).await?;
    wait_until(
        "a ready gateway endpoint",
        Duration::from_secs(90),
        || async {
            let pods = ns
                .api::<k8s_openapi::api::core::v1::Pod>()
                .list(&kube::api::ListParams::default().labels(hstack::GATEWAY_PODS))
                .await?
                .items;
            let ready = pods.iter().any(hearth_test_support::pod_ready);
            Ok(if ready {
                Observed::Ready(())
            } else {
                Observed::NotYet(hearth_test_support::describe_pods(&pods))
            })
        },
    )
    .await?;
    ensure!(
        hstack::wait_reachable(&url, Duration::from_secs(60)).await,
        "{url} never accepted a connection"
    );
    let trace = client::chat(&url, stub, true, Duration::from_secs(180)).await?;
    ensure!(
        trace.status == 200 && trace.complete(),
        "cold stream to the upstream stub service: status {}, events {:?}",
        trace.status,
        trace.events
    );
    let tokens = trace.tokens(None);
    ensure!(
        tokens == stack::TOKENS,
        "{tokens} tokens, the stub sends {}",
        stack::TOKENS
    );
    // The pod that answered is the stub image on the real node.
    let real = hearth_test_support::RealNode::load()?;
    let pods = ns
        .api::<k8s_openapi::api::core::v1::Pod>()
        .list(&kube::api::ListParams::default().labels(&hstack::backend_pods(stub)))
        .await?
        .items;
    ensure!(
        pods.iter().any(|p| {
            p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(real.name.as_str())
                && p.spec.as_ref().is_some_and(|s| {
                    s.containers
                        .iter()
                        .any(|c| c.image.as_deref() == Some("hearth.dev/vllm-stub:e2e"))
                })
        }),
        "no stub backend pod on {}: {}",
        real.name,
        hearth_test_support::describe_pods(&pods)
    );
    println!(
        "upstream stub service: first token {:.2}s after the cold request; {}",
        trace
            .first_token()
            .map(|t| (t - trace.sent).as_secs_f64())
            .unwrap_or_default(),
        phases.join(", ")
    );
    Ok(())
}

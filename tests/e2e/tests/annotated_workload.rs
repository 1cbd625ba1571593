//! An annotated plain Deployment (no LLMService), admitted through the chart-installed
//! `hearth-webhook`: the built-in ServingPolicies resolve the upstream stub runtime and inject
//! its accelerator request (`hearth.dev/fake-gpu`), probes and the `hearth-drain` native sidecar
//! with its preStop hook. The pod then runs for real on the real node: the kubelet allocates a
//! fake GPU from the node's device plugin, starts the sidecar before the model container, and on
//! deletion the preStop drain ends as soon as the idle engine lets it. Uses 1 of the node's 4
//! `hearth.dev/fake-gpu`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::stack;
use hearth_test_support::{Cluster, Observed, describe_pods, pod_ready, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotated_deployment_is_mutated_and_runs_with_its_fake_gpu_and_drain_sidecar() -> Result<()>
{
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    stack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    stack::install_stub_runtime(&client).await?;
    let ns = cluster.namespace("e2e-annotated").await?;
    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "plain-llm", "annotations": {"serving.hearth.dev/runtime": "vllm-stub"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "plain-llm"}},
            "template": {
                "metadata": {"labels": {"app": "plain-llm"}},
                "spec": {"containers": [{
                    "name": "vllm",
                    "image": "hearth.dev/vllm-stub:e2e",
                    "args": ["--model=/models/stub", "--served-model-name=plain-llm"],
                    "ports": [{"name": "http", "containerPort": 8000}],
                }]},
            },
        },
    }))?;
    let api: Api<Deployment> = ns.api();
    let created = api.create(&PostParams::default(), &deploy).await?;
    let pod_spec = created
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("no pod spec")?;
    let c = &pod_spec.containers[0];
    let gpus = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("hearth.dev/fake-gpu"))
        .map(|q| q.0.clone());
    ensure!(
        gpus.as_deref() == Some("1"),
        "not mutated: hearth.dev/fake-gpu limit {gpus:?} (container {c:?})"
    );
    let sidecar = pod_spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "hearth-drain")
        .context("no hearth-drain sidecar")?;
    ensure!(
        sidecar.restart_policy.as_deref() == Some("Always"),
        "hearth-drain is not a native sidecar: {sidecar:?}"
    );
    let hook = c
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|p| p.http_get.as_ref());
    ensure!(
        hook.is_some_and(|h| h.path.as_deref() == Some("/drain")),
        "preStop is not the drain sidecar's GET /drain: {:?}",
        c.lifecycle
    );

    // The pod runs on the real node: scheduled against the device plugin's capacity, the
    // sidecar started first, the model container Ready through the injected probe.
    let pods = ns
        .wait_for_pods(
            "the annotated Deployment's pod Ready",
            "app=plain-llm",
            Duration::from_secs(120),
            |p| p.len() == 1 && pod_ready(&p[0]),
        )
        .await?;
    let pod = &pods[0];
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let real = hearth_test_support::RealNode::load()?;
    ensure!(
        node == real.name,
        "the pod runs on {node}, not the real node {}",
        real.name
    );
    let status = pod.status.as_ref().context("no pod status")?;
    let drain = status
        .init_container_statuses
        .iter()
        .flatten()
        .find(|s| s.name == "hearth-drain")
        .context("no status of hearth-drain")?;
    ensure!(
        drain.started == Some(true) && drain.state.as_ref().is_some_and(|s| s.running.is_some()),
        "hearth-drain is not running: {drain:?}"
    );
    println!("annotated Deployment: {}", describe_pods(&pods));

    // Deleting it: the preStop drain returns once the idle engine has settled, so the pod goes
    // well before terminationGracePeriodSeconds (30 s).
    let name = pod.metadata.name.clone().context("pod name")?;
    let start = Instant::now();
    ns.api::<Pod>()
        .delete(&name, &DeleteParams::default())
        .await?;
    let pods: Api<Pod> = ns.api();
    wait_until(
        format!("pod {name} gone"),
        Duration::from_secs(40),
        || async {
            Ok(match pods.get_opt(&name).await? {
                None => Observed::Ready(()),
                Some(p) => Observed::NotYet(describe_pods(&[p])),
            })
        },
    )
    .await?;
    let took = start.elapsed();
    ensure!(
        took < Duration::from_secs(20),
        "the idle pod took {took:?} to go: was the preStop a fixed wait?"
    );
    let left = ns.api::<Pod>().list(&ListParams::default()).await?.items;
    println!(
        "idle annotated pod gone {:.1}s after its deletion; pods now: {}",
        took.as_secs_f64(),
        describe_pods(&left)
    );
    Ok(())
}

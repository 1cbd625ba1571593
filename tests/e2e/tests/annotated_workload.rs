//! An annotated plain Deployment (no LLMService): the `hearth-webhook` binary, registered by
//! URL for this test's namespace only, mutates it with the built-in ServingPolicies (the
//! accelerator request and node selection of the upstream A10 runtime), and its pods schedule
//! onto the fake GPU nodes. Uses 2 of the 4 `nvidia.com/gpu`; the only suite here requesting them.

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_pod_runner::stack;
use hearth_test_support::{Cluster, Observed, describe_pods, wait_until};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::{Value, json};

/// The webhook's `--drain-image` (kwok plays these pods, so it is never pulled).
const DRAIN_IMAGE: &str = "registry.example/hearth-gateway:e2e";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotated_deployment_is_mutated_and_schedules_on_gpu_nodes() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    stack::install(&client).await?;
    for obj in
        stack::read_manifests(&stack::upstream_dir().join("nvidia-a10-inferenceruntime.yaml"))?
    {
        stack::apply(&client, obj, None).await?;
    }
    let ns = cluster.namespace("e2e-annotated").await?;
    let config = format!("hearth-e2e-{}", ns.name());
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        l.local_addr()?.port()
    };
    let listen = format!("127.0.0.1:{port}");
    let logs = cluster
        .kubeconfig()
        .parent()
        .context("state dir")?
        .join("logs");
    std::fs::create_dir_all(&logs)?;
    let log = std::fs::File::create(logs.join(format!("webhook-{}.log", ns.name())))?;
    let bin = stack::binary("hearth-webhook")?;
    // The product's registration, scoped to this namespace and to workloads only, so no other
    // test's objects ever reach this short-lived webhook.
    let out = std::process::Command::new(&bin)
        .args([
            "configurations",
            &format!("--namespace={}", ns.name()),
            &format!("--url=https://{listen}"),
        ])
        .output()?;
    ensure!(
        out.status.success(),
        "hearth-webhook configurations: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut objs = Vec::new();
    let docs = stack::parse_manifests(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| anyhow::anyhow!("hearth-webhook configurations output: {e}"))?;
    for mut v in docs {
        v["metadata"]["name"] = json!(config);
        let hooks: Vec<Value> = v["webhooks"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .filter(|w| w["rules"].to_string().contains("deployments"))
            .map(|mut w| {
                w["namespaceSelector"] =
                    json!({"matchLabels": {"kubernetes.io/metadata.name": ns.name()}});
                w
            })
            .collect();
        v["webhooks"] = json!(hooks);
        objs.push(v);
    }
    let mutating: Api<MutatingWebhookConfiguration> = Api::all(client.clone());
    let validating: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let result = async {
        for o in objs {
            stack::apply(&client, o, None).await?;
        }
        // Started after its registration exists: the self-managed webhook publishes its CA
        // into the configuration at start.
        let _webhook = tokio::process::Command::new(&bin)
            .args([
                &format!("--listen={listen}"),
                "--self-managed",
                &format!("--namespace={}", ns.name()),
                "--extra-san=127.0.0.1",
                &format!("--webhook-configuration={config}"),
                &format!("--drain-image={DRAIN_IMAGE}"),
            ])
            .env("KUBECONFIG", cluster.kubeconfig())
            .stdout(log.try_clone()?)
            .stderr(log)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .spawn()?;
        let deploy: Deployment = serde_json::from_value(json!({
            "metadata": {"name": "plain-llm", "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10"}},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": "plain-llm"}},
                "template": {
                    "metadata": {"labels": {"app": "plain-llm"}},
                    "spec": {"containers": [{
                        "name": "vllm",
                        "image": "vllm/vllm-openai:v0.25.1",
                        "args": ["Qwen/Qwen2.5-7B-Instruct", "--port=8000"],
                        "ports": [{"name": "http", "containerPort": 8000}],
                    }]},
                },
            },
        }))?;
        let api: Api<Deployment> = ns.api();
        // Until the apiserver trusts the self-managed caBundle the webhook call fails (and the
        // registration's failurePolicy Fail denies); retry until admitted.
        let created = wait_until("the Deployment admitted through hearth-webhook", Duration::from_secs(60), || {
            let (api, deploy) = (api.clone(), deploy.clone());
            async move {
                Ok(match api.create(&PostParams::default(), &deploy).await {
                    Ok(d) => Observed::Ready(d),
                    Err(e) => Observed::NotYet(e.to_string()),
                })
            }
        })
        .await?;
        let c = &created.spec.as_ref().context("spec")?.template.spec.as_ref().context("pod spec")?.containers[0];
        let gpus = c
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .and_then(|l| l.get("nvidia.com/gpu"))
            .map(|q| q.0.clone());
        ensure!(gpus.as_deref() == Some("1"), "not mutated: nvidia.com/gpu limit {gpus:?} (container {c:?})");
        // The runtime asks for a preStop drain: the drain sidecar on --drain-image and the
        // model container's httpGet hook to it.
        let pod_spec = created.spec.as_ref().context("spec")?.template.spec.as_ref().context("pod spec")?;
        let sidecar = pod_spec
            .init_containers
            .iter()
            .flatten()
            .find(|c| c.name == "hearth-drain");
        ensure!(
            sidecar.is_some_and(|s| s.image.as_deref() == Some(DRAIN_IMAGE) && s.restart_policy.as_deref() == Some("Always")),
            "no native drain sidecar on {DRAIN_IMAGE}: {:?}",
            pod_spec.init_containers
        );
        let hook = c.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref()).and_then(|p| p.http_get.as_ref());
        ensure!(
            hook.is_some_and(|h| h.path.as_deref() == Some("/drain")),
            "preStop is not the drain sidecar's GET /drain: {:?}",
            c.lifecycle
        );
        let pods = ns
            .wait_for_pods("2 Running pods of the annotated Deployment", "app=plain-llm", Duration::from_secs(60), |p| {
                p.len() == 2 && p.iter().all(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
            })
            .await?;
        let nodes: Api<Node> = Api::all(client.clone());
        for p in &pods {
            let node = p.spec.as_ref().and_then(|s| s.node_name.clone()).context("unscheduled")?;
            let labels = nodes.get(&node).await?.metadata.labels.unwrap_or_default();
            ensure!(
                labels.get("nvidia.com/gpu.product").map(String::as_str) == Some("NVIDIA-A10"),
                "pod on {node}, not an A10 node: {}",
                describe_pods(&pods)
            );
        }
        let all: Vec<Pod> = ns.api::<Pod>().list(&ListParams::default()).await?.items;
        println!("annotated Deployment: {}", describe_pods(&all));
        Ok(())
    }
    .await;
    let _ = mutating.delete(&config, &DeleteParams::default()).await;
    let _ = validating.delete(&config, &DeleteParams::default()).await;
    result
}

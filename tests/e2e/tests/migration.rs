//! Upstream Hearth v0.3.0 behaviour on a chart-installed Hearth (`docs/migration.md`):
//! - an upstream-shaped LLMService (no `cache` block, a `huggingface://` model, templated
//!   `argsOverride`, a `"0"` duration) renders upstream's children: the backend Deployment named
//!   after the service with upstream's selector, `managed-by: hearth`, a 50Gi `N-cache` claim,
//!   gateway pods without the `serving.hearth.dev/llmservice` label, the backend Service on
//!   port 80;
//! - two runtimes of one vendor and one priority are refused as ambiguous;
//! - replacing upstream: with the controller stopped, a running backend Deployment shaped like
//!   upstream's (its `serving` container, another field manager) is adopted when the controller
//!   comes back: still one Deployment, only Hearth's container, never two backend pods at once,
//!   and the model answers through the gateway.

mod stack;

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack as hstack;
use hearth_test_support::{Cluster, Observed, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, Resource, ResourceExt};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

fn labels_of(meta: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta) -> Value {
    serde_json::to_value(meta.labels.clone().unwrap_or_default()).unwrap_or_default()
}

/// Waits for a condition of LLMService `name` with `status` and `reason`.
async fn wait_condition(
    client: &Client,
    ns: &str,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
) -> Result<String> {
    let api: Api<hearth_crds::LLMService> = Api::namespaced(client.clone(), ns);
    wait_until(
        format!("LLMService {ns}/{name} {type_}={status} ({reason})"),
        WAIT,
        || async {
            let svc = api.get(name).await?;
            let conds = svc.status.map(|s| s.conditions).unwrap_or_default();
            Ok(
                match conds
                    .iter()
                    .find(|c| c.type_ == type_ && c.status == status && c.reason == reason)
                {
                    Some(c) => Observed::Ready(c.message.clone()),
                    None => Observed::NotYet(format!("{conds:?}")),
                },
            )
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_shaped_services_render_upstreams_children_and_are_adopted() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    hstack::install_stub_runtime(&client).await?;
    let ns = cluster.namespace("migration").await?;
    let n = ns.name().to_owned();

    // 1. An upstream-shaped service renders upstream's children.
    hstack::apply(
        &client,
        json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "shaped", "namespace": n},
            "spec": {
                "model": {"source": {"uri": "huggingface://hearth/stub-model"}},
                "runtime": {"name": "vllm-stub", "argsOverride": ["--tag={{ .Service.Namespace }}/{{ .Service.Name }}"]},
                "resources": {"accelerators": 1},
                "scaling": {"min": 0, "max": 1, "target": 1, "scaleDownStabilization": "0"}
            }
        }),
        None,
    )
    .await?;
    let deployments: Api<Deployment> = ns.api();
    let backend = wait_until("backend Deployment shaped", WAIT, || async {
        Ok(match deployments.get_opt("shaped").await? {
            Some(d) => Observed::Ready(d),
            None => Observed::NotYet("absent".into()),
        })
    })
    .await?;
    let spec = backend.spec.clone().context("no spec")?;
    ensure!(
        serde_json::to_value(&spec.selector.match_labels)?
            == json!({"app.kubernetes.io/name": "shaped", "app.kubernetes.io/managed-by": "hearth", "serving.hearth.dev/llmservice": "shaped"}),
        "backend selector {:?}",
        spec.selector
    );
    ensure!(
        labels_of(&backend.metadata)["app.kubernetes.io/managed-by"] == "hearth",
        "backend labels {:?}",
        backend.metadata.labels
    );
    let args = spec
        .template
        .spec
        .as_ref()
        .context("no pod spec")?
        .containers[0]
        .args
        .clone()
        .unwrap_or_default();
    ensure!(
        args.contains(&format!("--tag={n}/shaped"))
            && args.contains(&"--model=hearth/stub-model".to_owned()),
        "argsOverride and huggingface:// not rendered: {args:?}"
    );
    let claims: Api<PersistentVolumeClaim> = ns.api();
    let claim = wait_until("cache claim shaped-cache", WAIT, || async {
        Ok(match claims.get_opt("shaped-cache").await? {
            Some(c) => Observed::Ready(c),
            None => Observed::NotYet("absent".into()),
        })
    })
    .await?;
    let size = claim
        .spec
        .and_then(|s| s.resources)
        .and_then(|r| r.requests)
        .and_then(|r| r.get("storage").cloned())
        .context("claim without a size")?;
    ensure!(size.0 == "50Gi", "default cache size {}", size.0);
    // The gateway comes after its admin Secret in the same reconcile: waited for, not assumed.
    let gateway = wait_until("gateway Deployment shaped-gateway", WAIT, || async {
        Ok(match deployments.get_opt("shaped-gateway").await? {
            Some(d) => Observed::Ready(d),
            None => Observed::NotYet("absent".into()),
        })
    })
    .await?;
    let pod_labels = labels_of(
        gateway
            .spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .context("no gateway pod metadata")?,
    );
    ensure!(
        pod_labels.get("serving.hearth.dev/llmservice").is_none()
            && pod_labels["serving.hearth.dev/gateway"] == "shaped"
            && pod_labels["app.kubernetes.io/managed-by"] == "hearth",
        "gateway pod labels {pod_labels}"
    );
    let backend_service: Service = ns.api().get("shaped-backend").await?;
    let port = backend_service
        .spec
        .and_then(|s| s.ports)
        .and_then(|p| p.first().map(|p| p.port));
    ensure!(port == Some(80), "backend Service port {port:?}");

    // 2. Equal-priority runtimes of one vendor are ambiguous.
    let runtimes: Api<hearth_crds::InferenceRuntime> = Api::all(client.clone());
    let tie = |name: &str| {
        json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "InferenceRuntime",
            "metadata": {"name": name},
            "spec": {"vendor": "tievendor", "priority": 7, "container": {"image": "hearth.dev/vllm-stub:e2e", "port": {"name": "http", "containerPort": 8000}},
                     "accelerator": {"resourceName": "hearth.dev/fake-gpu"}}
        })
    };
    let tied = ["migration-tie-a", "migration-tie-b"];
    for t in tied {
        hstack::apply(&client, tie(t), None).await?;
    }
    let outcome = async {
        hstack::apply(
            &client,
            json!({
                "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
                "metadata": {"name": "tied", "namespace": n},
                "spec": {"model": {"source": {"uri": "hf://hearth/stub-model"}},
                         "runtime": {"selector": {"vendor": ["tievendor"]}},
                         "cache": {"strategy": "None"}}
            }),
            None,
        )
        .await?;
        let message = wait_condition(
            &client,
            &n,
            "tied",
            "RuntimeResolved",
            "False",
            "AmbiguousRuntime",
        )
        .await?;
        ensure!(
            message.contains("migration-tie-a") && message.contains("migration-tie-b"),
            "{message}"
        );
        Ok(())
    }
    .await;
    for t in tied {
        let _ = runtimes.delete(t, &DeleteParams::default()).await;
    }
    outcome?;

    // 3. Adoption of an upstream backend, with the controller stopped meanwhile.
    let controllers: Api<Deployment> = Api::namespaced(client.clone(), "hearth-system");
    let scale = |replicas: i32| {
        let controllers = controllers.clone();
        async move {
            controllers
                .patch_scale(
                    "hearth-controller",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": replicas}})),
                )
                .await
        }
    };
    scale(0).await?;
    let result = adopt_upstream_backend(&client, &cluster, &n, scale(1)).await;
    // Whatever happened, the controller runs again for the suites after this one.
    let restored = scale(1).await;
    result?;
    restored?;
    Ok(())
}

async fn adopt_upstream_backend(
    client: &Client,
    cluster: &Cluster,
    n: &str,
    start_controller: impl std::future::Future<
        Output = kube::Result<k8s_openapi::api::autoscaling::v1::Scale>,
    >,
) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), n);
    let controller_pods: Api<Pod> = Api::namespaced(client.clone(), "hearth-system");
    wait_until("the controller stopped", WAIT, || async {
        let left = controller_pods
            .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
            .await?
            .items;
        Ok(if left.is_empty() {
            Observed::Ready(())
        } else {
            Observed::NotYet(hearth_test_support::describe_pods(&left))
        })
    })
    .await?;
    let service = hstack::apply(
        client,
        json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "legacy", "namespace": n},
            "spec": {"model": {"source": {"uri": "hf://hearth/stub-model"}},
                     "runtime": {"name": "vllm-stub"},
                     "resources": {"accelerators": 1},
                     "scaling": {"min": 1, "max": 1, "target": 1, "drainTimeout": "5s"},
                     "cache": {"strategy": "None"}}
        }),
        None,
    )
    .await?;
    let owner = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
        "name": "legacy", "uid": service.uid().context("no uid")?,
        "controller": true, "blockOwnerDeletion": true
    });
    let selector = json!({"app.kubernetes.io/name": "legacy", "app.kubernetes.io/managed-by": "hearth", "serving.hearth.dev/llmservice": "legacy"});
    let mut pod_labels = selector.clone();
    pod_labels["serving.hearth.dev/runtime"] = json!("vllm-stub");
    let real = hearth_test_support::RealNode::load()?;
    // As upstream's controller writes it: a plain create by another field manager.
    let upstream: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "legacy", "namespace": n, "labels": pod_labels, "ownerReferences": [owner]},
        "spec": {
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": real.name},
                    "containers": [{
                        "name": "serving", "image": "hearth.dev/vllm-stub:e2e",
                        "args": ["--model=hearth/stub-model", "--served-model-name=legacy"],
                        "env": [{"name": "STUB_TOKEN_COUNT", "value": "5"}, {"name": "UPSTREAM_ONLY", "value": "1"}],
                        "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                        "resources": {"limits": {"hearth.dev/fake-gpu": "1"}},
                        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}}
                    }]
                }
            }
        }
    }))?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), n);
    deployments
        .create(
            &PostParams {
                field_manager: Some("hearth-upstream".into()),
                ..Default::default()
            },
            &upstream,
        )
        .await?;
    let backend_pods = ListParams::default().labels("serving.hearth.dev/llmservice=legacy");
    wait_until("the upstream backend pod Ready", WAIT, || async {
        let items = pods.list(&backend_pods).await?.items;
        Ok(if items.iter().any(hearth_test_support::pod_ready) {
            Observed::Ready(())
        } else {
            Observed::NotYet(hearth_test_support::describe_pods(&items))
        })
    })
    .await?;

    start_controller.await?;
    // Until the adopted Deployment serves with Hearth's container: never two backend pods
    // holding a device at once.
    let most = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let adopted = wait_until(
        "the backend adopted and Ready",
        Duration::from_secs(180),
        || {
            let pods = pods.clone();
            let deployments = deployments.clone();
            let backend_pods = backend_pods.clone();
            let most = most.clone();
            async move {
                let items = pods.list(&backend_pods).await?.items;
                let holding = items
                    .iter()
                    .filter(|p| {
                        p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                            && p.meta().deletion_timestamp.is_none()
                    })
                    .count();
                most.fetch_max(holding, std::sync::atomic::Ordering::Relaxed);
                let d = deployments.get("legacy").await?;
                let names: Vec<String> = d
                    .spec
                    .as_ref()
                    .and_then(|s| s.template.spec.as_ref())
                    .map(|s| s.containers.iter().map(|c| c.name.clone()).collect())
                    .unwrap_or_default();
                let ours = labels_of(&d.metadata)
                    .get("app.kubernetes.io/instance")
                    .is_some();
                let ready = d.status.as_ref().and_then(|s| s.updated_replicas) == Some(1)
                    && d.status.as_ref().and_then(|s| s.ready_replicas) == Some(1)
                    && d.status.as_ref().and_then(|s| s.replicas) == Some(1);
                Ok(if ours && names == ["vllm"] && ready {
                    Observed::Ready(d)
                } else {
                    Observed::NotYet(format!(
                        "containers {names:?}, adopted {ours}, ready {ready}: {}",
                        hearth_test_support::describe_pods(&items)
                    ))
                })
            }
        },
    )
    .await?;
    let most = most.load(std::sync::atomic::Ordering::Relaxed);
    ensure!(
        most <= 1,
        "{most} backend pods ran at once during the adoption"
    );
    let env: Vec<String> = adopted
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers[0].env.as_ref())
        .map(|e| e.iter().map(|v| v.name.clone()).collect())
        .unwrap_or_default();
    ensure!(
        !env.contains(&"UPSTREAM_ONLY".to_owned()),
        "upstream's environment survived the adoption: {env:?}"
    );
    let managers: Vec<String> = adopted
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| m.manager.as_deref() == Some("hearth-upstream"))
        .map(|m| serde_json::to_string(&m.fields_v1).unwrap_or_default())
        .collect();
    if managers.iter().any(|f| f.contains("f:template")) {
        bail!("the upstream manager still owns the pod template: {managers:?}");
    }
    let all = deployments
        .list(&ListParams::default().labels("serving.hearth.dev/llmservice=legacy"))
        .await?
        .items;
    ensure!(
        all.len() == 1,
        "Deployments of legacy: {:?}",
        all.iter().map(|d| d.name_any()).collect::<Vec<_>>()
    );
    // The model answers through Hearth's gateway.
    // The same reconcile applies the gateway Service after the adopted Deployment.
    let url = stack::wait_service_url(client, n, "legacy").await?;
    ensure!(
        hstack::wait_reachable(&url, Duration::from_secs(90)).await,
        "{url} never accepted a connection"
    );
    let trace = client::chat(&url, "legacy", true, Duration::from_secs(120)).await?;
    ensure!(
        trace.status == 200 && trace.complete() && trace.tokens(None) == stack::TOKENS,
        "chat after the adoption: status {}, events {:?}",
        trace.status,
        trace.events
    );
    let _ = cluster;
    Ok(())
}

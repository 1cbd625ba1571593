//! Runtime image pre-pull on the real node (`InferenceRuntime.spec.prePull`): a runtime like
//! the upstream stub's, pinned to the real node by its `accelerator.nodeSelector`, with
//! `prePull: true` gets a DaemonSet in Hearth's namespace whose pod runs the runtime's image as
//! an init container on that node (and nowhere else: kwok's nodes do not match) and then holds
//! the cluster's pause image; the runtime's `ImagePrePulled` condition turns True (`Pulled`).
//! `prePull: false` removes the DaemonSet and the condition. The runtime's image is the stub's
//! under a reference of the test's own in the cluster's registry, which no node has: the
//! kubelet pulls it for real (its `Pulled` Event says "Successfully pulled"), as for any init
//! container. See docs/controller.md, "Runtime image pre-pull".

mod stack;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::stack::{self as harness, RELEASE_NAMESPACE};
use hearth_test_support::{Cluster, Observed, RealNode, describe_pods, wait_until};
use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, DynamicObject, ListParams};
use serde_json::{Value, json};

fn runtimes(client: &kube::Client) -> Api<DynamicObject> {
    harness::inference_runtimes(client)
}

/// Deletes the test's runtime (and so, by its owner reference, the DaemonSet) when dropped.
struct RuntimeGuard {
    cluster: Cluster,
    name: String,
}

impl Drop for RuntimeGuard {
    fn drop(&mut self) {
        if let Ok(mut kubectl) = self.cluster.kubectl() {
            let _ = kubectl
                .args([
                    "delete",
                    "--ignore-not-found",
                    "--wait=false",
                    "inferenceruntime",
                    &self.name,
                ])
                .output();
        }
    }
}

/// The upstream stub runtime renamed to `name`, on the real node only, with `prePull`, its
/// image `image`.
fn runtime(name: &str, node: &str, image: &str, pre_pull: bool) -> Result<Value> {
    let mut rt = harness::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    rt["metadata"] = json!({"name": name});
    rt["spec"]["container"]["image"] = json!(image);
    rt["spec"]["accelerator"]["nodeSelector"] = json!({"kubernetes.io/hostname": node});
    rt["spec"]["prePull"] = json!(pre_pull);
    Ok(rt)
}

/// The runtime's `ImagePrePulled` condition, if any.
async fn condition(client: &kube::Client, name: &str) -> Result<Option<Value>> {
    let rt = runtimes(client).get(name).await?;
    Ok(rt.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "ImagePrePulled")
        .cloned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pre_pull_runs_the_runtime_image_on_its_nodes_and_goes_away_when_turned_off() -> Result<()>
{
    let t0 = Instant::now();
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    harness::ensure_hearth(&client, cluster.kubeconfig()).await?;
    let node = RealNode::load()?;
    let name = format!(
        "e2e-pre-pull-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)?
            .as_millis()
            % 1_000_000
    );
    let _guard = RuntimeGuard {
        cluster: cluster.clone(),
        name: name.clone(),
    };
    // The stub under a tag no node has pulled yet.
    let registry = stack::registry::Registry::load()?;
    let reference = format!(
        "e2e-pre-pull/vllm-stub:{}",
        stack::registry::Registry::fresh_tag("run")
    );
    registry.copy("vllm-stub:e2e", &reference).await?;
    let image = format!("{}/{reference}", registry.host);
    harness::apply(&client, runtime(&name, &node.name, &image, true)?, None).await?;

    let ds_name = format!("hearth-pre-pull-{name}");
    let daemon_sets: Api<DaemonSet> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let selector = format!("serving.hearth.dev/inferenceruntime={name}");
    let cond = wait_until(
        format!("InferenceRuntime {name} ImagePrePulled=True"),
        Duration::from_secs(120),
        || async {
            let c = condition(&client, &name).await?;
            Ok(match c {
                Some(c) if c["status"] == "True" => Observed::Ready(c),
                other => {
                    let list = pods
                        .list(&ListParams::default().labels(&selector))
                        .await?
                        .items;
                    Observed::NotYet(format!("{other:?}\n{}", describe_pods(&list)))
                }
            })
        },
    )
    .await?;
    let pulled = t0.elapsed().as_secs_f64();
    ensure!(cond["reason"] == "Pulled", "{cond}");
    ensure!(
        cond["message"]
            .as_str()
            .is_some_and(|m| m.contains("all 1 node(s)") && m.contains(&image)),
        "{cond}"
    );

    let ds = daemon_sets.get(&ds_name).await?;
    let owner = ds
        .metadata
        .owner_references
        .clone()
        .unwrap_or_default()
        .into_iter()
        .next()
        .context("the DaemonSet has no owner")?;
    ensure!(
        owner.kind == "InferenceRuntime" && owner.name == name,
        "owner {owner:?}"
    );
    let list = pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items;
    ensure!(list.len() == 1, "pre-pull pods: {}", describe_pods(&list));
    let pod = &list[0];
    let spec = pod.spec.clone().context("pod spec")?;
    ensure!(
        spec.node_name.as_deref() == Some(node.name.as_str()),
        "the pre-pull pod is on {:?}, not the real node",
        spec.node_name
    );
    let init = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.clone())
        .unwrap_or_default();
    let ran = init.iter().find(|c| c.name == "pull").and_then(|c| {
        c.state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .map(|t| t.exit_code)
    });
    ensure!(
        ran == Some(0) && init[0].image.contains("vllm-stub"),
        "the runtime image did not run to completion as the init container: {init:?}"
    );
    // A real pull: the kubelet's Pulled Event on the pre-pull pod.
    let events: Api<k8s_openapi::api::core::v1::Event> =
        Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    // Events are written asynchronously: waited for.
    let said: Vec<String> = wait_until(
        format!("a Pulled Event on {pod_name} saying {image} was pulled"),
        Duration::from_secs(30),
        || async {
            let said: Vec<String> = events
                .list(
                    &ListParams::default()
                        .fields(&format!("involvedObject.name={pod_name},reason=Pulled")),
                )
                .await?
                .items
                .into_iter()
                .filter_map(|e| e.message)
                .collect();
            Ok(
                if said
                    .iter()
                    .any(|m| m.contains("Successfully pulled") && m.contains(&image))
                {
                    Observed::Ready(said)
                } else {
                    Observed::NotYet(format!("{said:?}"))
                },
            )
        },
    )
    .await?;
    println!(
        "[pre-pull] {image} pulled from the registry ({}) on {} (pod {}), condition True after {pulled:.1}s: {}",
        said.join("; "),
        node.name,
        pod.metadata.name.clone().unwrap_or_default(),
        cond["message"]
    );

    // Off: the DaemonSet and the condition go.
    harness::apply(&client, runtime(&name, &node.name, &image, false)?, None).await?;
    wait_until(
        format!("DaemonSet {ds_name} deleted and the condition removed"),
        Duration::from_secs(60),
        || async {
            let ds = daemon_sets.get_opt(&ds_name).await?;
            let c = condition(&client, &name).await?;
            Ok(if ds.is_none() && c.is_none() {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!(
                    "DaemonSet present: {}, condition {c:?}",
                    ds.is_some()
                ))
            })
        },
    )
    .await?;
    runtimes(&client)
        .delete(&name, &DeleteParams::default())
        .await?;
    Ok(())
}

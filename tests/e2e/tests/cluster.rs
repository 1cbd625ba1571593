//! The local control plane of `tests/cluster/` is a real cluster: the scheduler honours the
//! fake nodes' accelerator capacity and taints (tolerated through ExtendedResourceToleration),
//! kwok runs the pods placed on them, and KEDA, running in the cluster, scales a Deployment on
//! the real node through the aggregated external metrics API.
//!
//! Needs a running cluster: `tests/cluster/up`, or run everything with `tests/run-tests`.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_test_support::{Cluster, MetricServer, Observed, RealNode, describe_pods, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::Api;
use kube::api::{DynamicObject, PostParams};
use serde_json::json;

/// Generous bounds: the cluster shares 2 cores with the test build.
const SCHEDULE_TIMEOUT: Duration = Duration::from_secs(60);
const KEDA_TIMEOUT: Duration = Duration::from_secs(90);

fn phase(pod: &Pod) -> &str {
    pod.status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or("")
}

fn node_name(pod: &Pod) -> &str {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.as_deref())
        .unwrap_or("")
}

fn unschedulable(pod: &Pod) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .into_iter()
        .flatten()
        .any(|c| {
            c.type_ == "PodScheduled"
                && c.status == "False"
                && c.reason.as_deref() == Some("Unschedulable")
        })
}

/// A Deployment of `replicas` pods with `pod` as their spec.
fn deployment(name: &str, replicas: i32, pod: serde_json::Value) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": { "name": name },
        "spec": {
            "replicas": replicas,
            "selector": { "matchLabels": { "app": name } },
            "template": {
                "metadata": { "labels": { "app": name } },
                "spec": pod,
            },
        },
    }))?)
}

#[tokio::test]
async fn gpu_capacity_bounds_scheduling_to_four_of_five_replicas() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let ns = cluster.namespace("gpu-capacity").await?;
    let deployments: Api<Deployment> = ns.api();
    deployments
        .create(
            &PostParams::default(),
            &deployment(
                "burst",
                5,
                // The A10 product label, as the upstream A10 runtime selects: the fake A10
                // nodes, not the real node (whose device plugin serves nvidia.com/gpu too). The
                // pods tolerate the GPU nodes' nvidia.com/gpu taint through the apiserver's
                // ExtendedResourceToleration plugin, as in a production GPU pool.
                json!({
                    "nodeSelector": { "nvidia.com/gpu.product": "NVIDIA-A10" },
                    "containers": [{
                        "name": "main",
                        "image": "example.invalid/workload:1",
                        "resources": { "limits": { "nvidia.com/gpu": "1" } },
                    }],
                }),
            )?,
        )
        .await?;

    // Two GPU nodes with two GPUs each: four pods fit, the fifth cannot be placed.
    let pods = ns
        .wait_for_pods(
            "4 of 5 one-GPU pods Running and 1 Pending as unschedulable",
            "app=burst",
            SCHEDULE_TIMEOUT,
            |pods| {
                pods.len() == 5
                    && pods.iter().filter(|p| phase(p) == "Running").count() == 4
                    && pods
                        .iter()
                        .filter(|p| phase(p) == "Pending" && unschedulable(p))
                        .count()
                        == 1
            },
        )
        .await?;

    let mut per_node = BTreeMap::new();
    for pod in pods.iter().filter(|p| phase(p) == "Running") {
        *per_node.entry(node_name(pod).to_string()).or_insert(0) += 1;
    }
    let expected = BTreeMap::from([("kwok-gpu-0".to_string(), 2), ("kwok-gpu-1".to_string(), 2)]);
    ensure!(
        per_node == expected,
        "running pods per node: {per_node:?}, expected {expected:?}; pods: {}",
        describe_pods(&pods)
    );
    let pending = pods
        .iter()
        .find(|p| phase(p) == "Pending")
        .context("the pending pod vanished")?;
    let why = describe_pods(std::slice::from_ref(pending));
    ensure!(
        why.contains("Insufficient nvidia.com/gpu"),
        "the pending pod should be unschedulable for lack of GPUs: {why}"
    );
    Ok(())
}

#[tokio::test]
async fn fake_nodes_advertise_their_accelerators() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let nodes: Api<Node> = Api::all(cluster.client());
    let list = nodes
        .list(&kube::api::ListParams::default().labels("type=kwok"))
        .await?
        .items;
    let by_name: BTreeMap<String, Node> = list
        .into_iter()
        .map(|n| (n.metadata.name.clone().unwrap_or_default(), n))
        .collect();
    let capacity = |node: &str, resource: &str| -> Option<String> {
        by_name[node]
            .status
            .as_ref()?
            .capacity
            .as_ref()?
            .get(resource)
            .map(|q| q.0.clone())
    };
    let label = |node: &str, key: &str| -> Option<String> {
        by_name[node].metadata.labels.as_ref()?.get(key).cloned()
    };
    for required in ["kwok-gpu-0", "kwok-gpu-1", "kwok-ascend-0", "kwok-cpu-0"] {
        ensure!(
            by_name.contains_key(required),
            "node {required} is missing; nodes: {:?}",
            by_name.keys().collect::<Vec<_>>()
        );
    }
    for gpu in ["kwok-gpu-0", "kwok-gpu-1"] {
        ensure!(
            capacity(gpu, "nvidia.com/gpu").as_deref() == Some("2"),
            "{gpu} GPUs"
        );
        ensure!(
            label(gpu, "nvidia.com/gpu.product").as_deref() == Some("NVIDIA-A10"),
            "{gpu} product label"
        );
    }
    ensure!(capacity("kwok-ascend-0", "huawei.com/Ascend910").as_deref() == Some("8"));
    ensure!(label("kwok-ascend-0", "accelerator").as_deref() == Some("huawei-Ascend910"));
    let cpu_extended: Vec<_> = by_name["kwok-cpu-0"]
        .status
        .as_ref()
        .and_then(|s| s.capacity.as_ref())
        .into_iter()
        .flat_map(|c| c.keys())
        .filter(|k| k.contains('/'))
        .collect();
    ensure!(
        cpu_extended.is_empty(),
        "kwok-cpu-0 advertises {cpu_extended:?}"
    );

    // Each node has its own loopback InternalIP and is kept Ready by kwok.
    let mut ips = Vec::new();
    for (name, node) in &by_name {
        let status = node.status.as_ref().context("node without status")?;
        let ip = status
            .addresses
            .iter()
            .flatten()
            .find(|a| a.type_ == "InternalIP")
            .map(|a| a.address.clone())
            .with_context(|| format!("{name} has no InternalIP"))?;
        ensure!(
            ip.starts_with("127."),
            "{name} InternalIP {ip} is not loopback"
        );
        ips.push(ip);
        let ready = status
            .conditions
            .iter()
            .flatten()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        ensure!(ready, "{name} is not Ready: {:?}", status.conditions);
    }
    let count = ips.len();
    ips.sort();
    ips.dedup();
    ensure!(ips.len() == count, "nodes share InternalIPs: {ips:?}");

    // An Ascend workload lands on the Ascend node and gets an address from its pod CIDR.
    let ns = cluster.namespace("ascend").await?;
    let pods: Api<Pod> = ns.api();
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": { "name": "npu", "labels": { "app": "npu" } },
        "spec": {
            "nodeSelector": {
                "accelerator": "huawei-Ascend910",
                "serving.hearth.dev/ascend-product": "ascend-910b3",
            },
            "containers": [{
                "name": "main",
                "image": "example.invalid/workload:1",
                "resources": { "limits": { "huawei.com/Ascend910": "8" } },
            }],
        },
    }))?;
    pods.create(&PostParams::default(), &pod).await?;
    let running = ns
        .wait_for_pods("the Ascend pod Running", "app=npu", SCHEDULE_TIMEOUT, |p| {
            p.len() == 1 && phase(&p[0]) == "Running"
        })
        .await?;
    ensure!(node_name(&running[0]) == "kwok-ascend-0");
    let pod_cidr = by_name["kwok-ascend-0"]
        .spec
        .as_ref()
        .and_then(|s| s.pod_cidr.clone())
        .context("kwok-ascend-0 has no podCIDR")?;
    let pod_ip = running[0]
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the Ascend pod has no IP")?;
    let prefix = pod_cidr.trim_end_matches(".0/24");
    ensure!(
        pod_ip.starts_with(&format!("{prefix}.")),
        "pod IP {pod_ip} is outside the node's podCIDR {pod_cidr}"
    );
    Ok(())
}

#[tokio::test]
async fn external_metrics_api_answers_through_the_apiserver() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let path = "/apis/external.metrics.k8s.io/v1beta1";
    let request = http::Request::get(path).body(Vec::new())?;
    let body = cluster.client().request_text(request).await?;
    let list: serde_json::Value = serde_json::from_str(&body)?;
    ensure!(
        list["groupVersion"] == "external.metrics.k8s.io/v1beta1",
        "unexpected answer from {path}: {body}"
    );

    let output = cluster.kubectl()?.args(["get", "--raw", path]).output()?;
    ensure!(
        output.status.success(),
        "kubectl get --raw {path} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let list: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    ensure!(list["kind"] == "APIResourceList", "kubectl answered {list}");
    Ok(())
}

#[tokio::test]
async fn keda_scales_a_deployment_from_zero_to_one_and_back() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let ns = cluster.namespace("keda-scale").await?;
    // KEDA's pods poll the metric on the host end of the real node's link.
    let node = RealNode::load()?;
    let metric = MetricServer::start(&node.host_ip, 0).await?;

    // A real pod on the real node, so "ready" is the kubelet's word.
    let deployments: Api<Deployment> = ns.api();
    let worker = node.place(json!({
        "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": "main",
            "image": node.tools_image,
            "command": ["sleep", "3600"],
        }],
    }));
    deployments
        .create(&PostParams::default(), &deployment("worker", 0, worker)?)
        .await?;
    let scaled_objects = ns.dynamic_api("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects");
    let scaled_object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": { "name": "worker" },
        "spec": {
            "scaleTargetRef": { "name": "worker" },
            "pollingInterval": 1,
            "cooldownPeriod": 1,
            "minReplicaCount": 0,
            "maxReplicaCount": 3,
            "triggers": [{
                "type": "metrics-api",
                "metadata": {
                    "url": metric.url(),
                    "format": "json",
                    "valueLocation": "value",
                    "targetValue": "5",
                    "activationTargetValue": "0",
                },
            }],
        },
    }))?;
    scaled_objects
        .create(&PostParams::default(), &scaled_object)
        .await?;

    let metric_name = wait_until(
        "ScaledObject worker Ready, with its external metric named",
        KEDA_TIMEOUT,
        || async {
            let so = scaled_objects.get("worker").await?;
            let status = &so.data["status"];
            let ready = status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True");
            Ok(match status["externalMetricNames"][0].as_str() {
                Some(name) if ready => Observed::Ready(name.to_string()),
                _ => Observed::NotYet(format!("status {status}")),
            })
        },
    )
    .await?;

    let replicas = |d: &Deployment| {
        (
            d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(-1),
            d.status
                .as_ref()
                .and_then(|s| s.ready_replicas)
                .unwrap_or(0),
        )
    };

    // Demand rises: 3 against a target of 5 per replica asks for exactly one replica.
    metric.set(3);
    wait_until("Deployment worker scaled 0 -> 1 and ready", KEDA_TIMEOUT, || async {
        let d = deployments.get("worker").await?;
        Ok(match replicas(&d) {
            (1, 1) => Observed::Ready(()),
            (spec, ready) => Observed::NotYet(format!(
                "spec.replicas={spec} readyReplicas={ready}; metric server answered {} requests",
                metric.requests()
            )),
        })
    })
    .await?;
    ns.wait_for_pods(
        "one worker pod Running",
        "app=worker",
        SCHEDULE_TIMEOUT,
        |p| p.len() == 1 && phase(&p[0]) == "Running",
    )
    .await?;

    // The same number, read through the apiserver's aggregation layer, the adapter and the
    // operator's metrics gRPC service: the path the HPA controller takes.
    let path = format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{}/{metric_name}?labelSelector=scaledobject.keda.sh%2Fname%3Dworker",
        ns.name()
    );
    let client = cluster.client();
    wait_until(
        format!("external metric {metric_name} = 3 via {path}"),
        KEDA_TIMEOUT,
        || async {
            let body = client
                .request_text(http::Request::get(path.as_str()).body(Vec::new())?)
                .await?;
            let value: serde_json::Value = serde_json::from_str(&body)?;
            Ok(if value["items"][0]["value"] == "3" {
                Observed::Ready(())
            } else {
                Observed::NotYet(body)
            })
        },
    )
    .await?;

    // Demand falls to zero: after the 1 s cooldown KEDA scales the Deployment back to zero.
    metric.set(0);
    wait_until("Deployment worker scaled 1 -> 0", KEDA_TIMEOUT, || async {
        let d = deployments.get("worker").await?;
        Ok(match replicas(&d) {
            (0, 0) => Observed::Ready(()),
            (spec, ready) => {
                Observed::NotYet(format!("spec.replicas={spec} readyReplicas={ready}"))
            }
        })
    })
    .await?;
    ns.wait_for_pods("no worker pods left", "app=worker", SCHEDULE_TIMEOUT, |p| {
        p.is_empty()
    })
    .await?;
    Ok(())
}

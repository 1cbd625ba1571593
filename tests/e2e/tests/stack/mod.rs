//! Shared by the end-to-end suites: the upstream stub service deployed in a fresh namespace,
//! reconciled by the chart-installed `hearth-controller` (installed once per cluster by the
//! harness), its gateway and backend pods running on the real node, reached through its
//! Service's ClusterIP as an in-cluster client would.

#![allow(dead_code)] // Each suite uses a different part.

pub mod registry;
pub mod scaler_tls;
pub mod volumes;

use std::time::{Duration, SystemTime};

use anyhow::{Context, Result};
use hearth_e2e_harness::stack::{self, ScalerMode};
use hearth_e2e_harness::timeline::Timeline;
use hearth_test_support::{Cluster, Observed, TestNamespace, wait_until};
use k8s_openapi::api::apps::v1::{Deployment, ReplicaSet};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::ResourceExt;
use kube::api::ListParams;
use serde_json::Value;

/// The upstream stub service's name and served model name.
pub const SERVICE: &str = "stub-svc";
/// Its backend Deployment.
pub const BACKEND: &str = "stub-svc";
/// Label selector of its backend pods.
pub fn backend_selector() -> String {
    stack::backend_pods(SERVICE)
}
/// The stub runtime's STUB_TOKEN_COUNT.
pub const TOKENS: usize = 5;

/// One deployed stub service.
pub struct Deployed {
    pub timeline: Timeline,
    pub cluster: Cluster,
    /// `http://<ClusterIP of stub-svc>:80` (the gateway).
    pub url: String,
    // Last: dropping it deletes the namespace.
    pub ns: TestNamespace,
}

/// Installs Hearth (once per cluster) and the stub runtime, makes a namespace, applies the
/// upstream stub service (with `edit` applied to the object) and waits for phase ScaledToZero
/// with a Ready gateway behind the Service.
pub async fn deploy(
    prefix: &str,
    mode: ScalerMode,
    edit: impl FnOnce(&mut Value),
) -> Result<Deployed> {
    deploy_with(prefix, mode, Vec::new(), edit).await
}

/// [`deploy`], applying `before` (namespaced objects such as a Secret the service names) in
/// the new namespace first.
pub async fn deploy_with(
    prefix: &str,
    mode: ScalerMode,
    before: Vec<Value>,
    edit: impl FnOnce(&mut Value),
) -> Result<Deployed> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    stack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    stack::install_stub_runtime(&client).await?;
    let ns = cluster.namespace(prefix).await?;
    for mut o in before {
        o["metadata"]["namespace"] = Value::String(ns.name().to_owned());
        stack::apply(&client, o, None).await?;
    }
    let mut obj = stack::stub_service(ns.name(), mode)?;
    edit(&mut obj);
    stack::apply(&client, obj, None).await?;
    let timeline = Timeline::start(client.clone(), ns.name(), BACKEND);
    let url = wait_service_url(&client, ns.name(), SERVICE).await?;
    let d = Deployed {
        timeline,
        url,
        cluster,
        ns,
    };
    d.wait_phase("ScaledToZero", Duration::from_secs(120))
        .await?;
    d.wait_gateway_ready().await?;
    d.wait_gateway_endpoint().await?;
    Ok(d)
}

/// One Secret per tenant, `<tenant>-keys` with its key under `api-keys`, as the tenants'
/// `apiKeySecretRef` names them (for [`deploy_with`]).
pub fn key_secrets(keys: &[(&str, &str)]) -> Vec<Value> {
    keys.iter()
        .map(|(tenant, key)| {
            serde_json::json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": format!("{tenant}-keys")},
                "stringData": {"api-keys": format!("{key}\n")},
            })
        })
        .collect()
}

/// The URL of the gateway Service of LLMService `name`, once the controller has made it.
pub async fn wait_service_url(client: &kube::Client, ns: &str, name: &str) -> Result<String> {
    wait_until(
        format!("Service {ns}/{name} with a ClusterIP"),
        Duration::from_secs(60),
        || async {
            Ok(match stack::service_url(client, ns, name).await {
                Ok(url) => Observed::Ready(url),
                Err(e) => Observed::NotYet(e.to_string()),
            })
        },
    )
    .await
    .context("the controller never made the gateway Service")
}

impl Deployed {
    /// Waits for the LLMService phase.
    pub async fn wait_phase(&self, want: &str, timeout: Duration) -> Result<()> {
        let client = self.cluster.client();
        let ns = self.ns.name().to_string();
        wait_until(
            format!("LLMService {ns}/{SERVICE} phase {want}"),
            timeout,
            || {
                let client = client.clone();
                let ns = ns.clone();
                async move {
                    let p = stack::phase(&client, &ns, SERVICE).await?;
                    Ok(if p.as_deref() == Some(want) {
                        Observed::Ready(())
                    } else {
                        Observed::NotYet(format!("phase {p:?}"))
                    })
                }
            },
        )
        .await
    }

    /// Waits until a gateway pod is Ready; on a timeout the error also gives the conditions
    /// of the gateway's Deployment and ReplicaSets (who did not make the pod, and why).
    pub async fn wait_gateway_ready(&self) -> Result<()> {
        let selector = "app.kubernetes.io/component=gateway";
        let waited = self
            .ns
            .wait_for_pods(
                "a Ready gateway pod",
                selector,
                Duration::from_secs(60),
                |pods| pods.iter().any(hearth_test_support::pod_ready),
            )
            .await;
        match waited {
            Ok(_) => Ok(()),
            Err(e) => {
                let workloads = self.describe_workloads(selector).await;
                Err(e.context(workloads))
            }
        }
    }

    /// The conditions and replica counts of the namespace's Deployments and ReplicaSets
    /// matching `selector`, one line each (or why they could not be listed).
    async fn describe_workloads(&self, selector: &str) -> String {
        let lp = ListParams::default().labels(selector);
        let mut lines = Vec::new();
        match self.ns.api::<Deployment>().list(&lp).await {
            Ok(list) => lines.extend(
                list.items
                    .iter()
                    .map(|d| describe_workload("Deployment", d)),
            ),
            Err(e) => lines.push(format!("Deployments: {e}")),
        }
        match self.ns.api::<ReplicaSet>().list(&lp).await {
            Ok(list) => lines.extend(
                list.items
                    .iter()
                    .map(|r| describe_workload("ReplicaSet", r)),
            ),
            Err(e) => lines.push(format!("ReplicaSets: {e}")),
        }
        if lines.is_empty() {
            lines.push("no Deployment or ReplicaSet of the gateway".to_string());
        }
        lines.join("\n")
    }

    /// Waits until the gateway Service's EndpointSlice lists a ready endpoint and its ClusterIP
    /// accepts a connection from the host (kube-proxy programs the endpoint a moment later).
    pub async fn wait_gateway_endpoint(&self) -> Result<()> {
        let api = self.ns.api::<EndpointSlice>();
        let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={SERVICE}"));
        wait_until(
            "a ready endpoint of the gateway Service",
            Duration::from_secs(60),
            || async {
                let slices = api.list(&lp).await?.items;
                let ready = slices
                    .iter()
                    .flat_map(|s| &s.endpoints)
                    .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false));
                Ok(if ready {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(format!(
                        "{} EndpointSlices without a ready endpoint",
                        slices.len()
                    ))
                })
            },
        )
        .await?;
        // kube-proxy programs the endpoint a moment after the EndpointSlice says it is ready;
        // until then a connection to the ClusterIP is refused.
        anyhow::ensure!(
            stack::wait_reachable(&self.url, Duration::from_secs(60)).await,
            "{} (Service {}/{SERVICE}) never accepted a connection: kube-proxy on the real node did not program it (see its log in the cluster's logs/)",
            self.url,
            self.ns.name()
        );
        Ok(())
    }

    /// The backend pods now.
    pub async fn backend_pods(&self) -> Result<Vec<Pod>> {
        Ok(self
            .ns
            .api::<Pod>()
            .list(&ListParams::default().labels(&backend_selector()))
            .await?
            .items)
    }

    /// When the first backend pod now listed turned Ready: the earliest `lastTransitionTime`
    /// of a `Ready=True` condition (whole seconds, truncated). The kubelet writes it as the
    /// readiness probe passes, before the EndpointSlice lists the pod, so before any gateway
    /// can send it a request. The Deployment's `readyReplicas` (the [`Timeline`]) comes later,
    /// after the ReplicaSet and Deployment controllers have each caught up, seconds later on a
    /// busy node. `None` while no backend pod is Ready.
    pub async fn backend_ready_at(&self) -> Result<Option<SystemTime>> {
        Ok(self
            .backend_pods()
            .await?
            .iter()
            .filter_map(|p| p.status.as_ref()?.conditions.as_ref())
            .flatten()
            .filter(|c| c.type_ == "Ready" && c.status == "True")
            .filter_map(|c| c.last_transition_time.as_ref())
            .map(|t| SystemTime::from(t.0))
            .min())
    }

    /// `GET http://<pod IP>:8000/is_sleeping` of the only backend pod, and that pod.
    pub async fn engine_sleeping(&self) -> Result<(bool, Pod)> {
        let pods = self.backend_pods().await?;
        let [pod] = pods.as_slice() else {
            anyhow::bail!("{} backend pods, expected 1", pods.len());
        };
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .context("the backend pod has no IP")?;
        let (status, body) = hearth_e2e_harness::client::get(
            &format!("http://{ip}:8000/is_sleeping"),
            Duration::from_secs(5),
        )
        .await?;
        anyhow::ensure!(status == 200, "GET /is_sleeping answered {status}: {body}");
        let v: Value = serde_json::from_str(&body)?;
        let sleeping = v["is_sleeping"]
            .as_bool()
            .with_context(|| format!("GET /is_sleeping answered {body}"))?;
        Ok((sleeping, pod.clone()))
    }

    /// Waits until the only backend pod's engine is `asleep` (or awake), and gives the pod.
    pub async fn wait_engine(&self, asleep: bool, timeout: Duration) -> Result<Pod> {
        wait_until(
            format!(
                "the backend engine {}",
                if asleep { "asleep" } else { "awake" }
            ),
            timeout,
            || async {
                Ok(match self.engine_sleeping().await {
                    Ok((s, pod)) if s == asleep => Observed::Ready(pod),
                    Ok((s, _)) => Observed::NotYet(format!("is_sleeping {s}")),
                    Err(e) => Observed::NotYet(e.to_string()),
                })
            },
        )
        .await
    }

    /// Waits until the backend has no replica and no pod left.
    pub async fn wait_zero(&self, timeout: Duration) -> Result<()> {
        wait_until(
            "backend back at 0 replicas with no pod",
            timeout,
            || async {
                let pods = self.backend_pods().await?;
                let last = self.timeline.last();
                Ok(match last {
                    Some(s) if s.desired == 0 && s.ready == 0 && pods.is_empty() => {
                        Observed::Ready(())
                    }
                    _ => Observed::NotYet(format!("{last:?}, {} backend pods", pods.len())),
                })
            },
        )
        .await
    }

    /// The timeline as text (seconds from `t0`), for failure messages and the test output.
    pub fn timeline_text(&self, t0: std::time::Instant) -> String {
        self.timeline
            .samples()
            .iter()
            .map(|s| {
                format!(
                    "{:+.2}s desired={} ready={}",
                    s.at.saturating_duration_since(t0).as_secs_f64()
                        - t0.saturating_duration_since(s.at).as_secs_f64(),
                    s.desired,
                    s.ready
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }
}

/// `<kind> <name>: replicas N, ready N; type=status message; ...` of a workload's status.
fn describe_workload(kind: &str, workload: &(impl serde::Serialize + ResourceExt)) -> String {
    let status = serde_json::to_value(workload)
        .map(|v| v["status"].clone())
        .unwrap_or_default();
    let conditions: Vec<String> = status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            format!(
                "{}={} {}",
                c["type"].as_str().unwrap_or_default(),
                c["status"].as_str().unwrap_or_default(),
                c["message"].as_str().unwrap_or_default()
            )
        })
        .collect();
    format!(
        "{kind} {}: replicas {}, ready {}; {}",
        workload.name_any(),
        status["replicas"],
        status["readyReplicas"],
        conditions.join("; ")
    )
}

/// Waits until the LLMService's `Ready` reason passes `ok`.
pub async fn wait_ready_reason(
    services: &kube::Api<kube::api::DynamicObject>,
    ok: impl Fn(&str) -> bool,
    timeout: Duration,
) -> Result<()> {
    wait_until("the LLMService's Ready reason", timeout, || async {
        let svc = services.get(SERVICE).await?;
        let reason = svc.data["status"]["conditions"]
            .as_array()
            .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
            .and_then(|c| c["reason"].as_str())
            .unwrap_or_default()
            .to_owned();
        Ok(if ok(&reason) {
            Observed::Ready(())
        } else {
            Observed::NotYet(reason)
        })
    })
    .await
}

/// Waits up to 10 s for a Warning Event of `reason` on the stub LLMService in `events`'
/// namespace (the controller writes it right after the status).
pub async fn wait_warning_event(
    events: &kube::Api<k8s_openapi::api::core::v1::Event>,
    reason: &str,
) -> Result<()> {
    let told = ListParams::default().fields(&format!(
        "involvedObject.name={SERVICE},involvedObject.kind=LLMService,reason={reason},type=Warning"
    ));
    wait_until(
        format!("a {reason} Warning Event on the LLMService"),
        Duration::from_secs(10),
        || async {
            let n = events.list(&told).await?.items.len();
            Ok(if n > 0 {
                Observed::Ready(())
            } else {
                Observed::NotYet("none yet".to_owned())
            })
        },
    )
    .await
}

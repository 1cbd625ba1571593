//! The device handover's reads and writes; the decisions are [`crate::handover`]'s.
//!
//! Run by every service reconcile ([`step`]):
//!
//! - **As a victim:** a ScaledObject carrying [`HANDOVER_ANNOTATION`] keeps it (and KEDA's
//!   `paused-replicas: "0"`) until the backend is at zero replicas with no pod left (its
//!   preStop drain has run), then both annotations are removed and KEDA autoscales the service
//!   again. A record older than the drain timeout plus [`STUCK_MARGIN`] is removed whatever
//!   the pods do, so a controller restart or a pod stuck terminating never leaves a service
//!   paused for good; the reconcile of every service at start does the recovery.
//! - **As a waiter:** a cold service (no ready replica) whose backend pod the scheduler refuses
//!   for lack of its accelerator looks for victims: the other services' backend pods (the pod
//!   cache), the nodes they run on (read now) with every pod bound there (listed by field
//!   selector), and, for the candidates the static rules leave, their demand at every gateway
//!   replica (`GET /hearth/queue[/<ns>/<name>]/local`, concurrently, 2 s each; any replica
//!   that does not answer makes the demand unknown, and no handover takes that service).
//!   Decisions are taken one at a time (a lock), and a service already handing over to this
//!   one makes it wait rather than take a second victim.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use bytes::Bytes;
use futures::future::join_all;
use hearth_crds::{LLMService, wellknown::LLMSERVICE_LABEL};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::{
    client::legacy::{Client as HttpClient, connect::HttpConnector},
    rt::TokioExecutor,
};
use k8s_openapi::{
    api::core::v1::{Node, Pod},
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams},
    runtime::events::EventType,
};
use serde::Deserialize;

use super::{Context, View, publish_about};
use crate::{
    handover::{
        self, Capacity, Decision, Demand, FIELD_MANAGER, HANDOVER_ANNOTATION, Holder,
        KEDA_PAUSED_REPLICAS_ANNOTATION, Record,
    },
    metrics::ResourceLabel,
    names,
    reconcile::desired::Membership,
    render::Placement,
    status::BackendState,
};

/// How soon a waiting service looks again (residencies pass, demand ends).
pub const WAITING_RECHECK: Duration = Duration::from_secs(2);

/// How soon a victim looks again whether its pods are gone.
pub const RESTORE_RECHECK: Duration = Duration::from_secs(1);

/// Beyond the victim's `drainTimeout`, how old a handover record may grow before it is removed
/// whatever the victim's pods do (termination grace, KEDA's reaction, a kubelet that is slow).
pub const STUCK_MARGIN: Duration = Duration::from_secs(90);

/// Each gateway replica's answer is awaited this long.
const DEMAND_TIMEOUT: Duration = Duration::from_secs(2);

/// The handover's settings and shared state, part of the reconcile [`Context`].
pub struct Handover {
    /// `--device-handover`: whether a waiting service may take another's devices. Records are
    /// restored either way.
    pub enabled: bool,
    http: HttpClient<HttpConnector, Empty<Bytes>>,
    /// `Authorization` of every call to a gateway's admin port (the controller's admin
    /// token), when the admin ports check tokens.
    authorization: Option<http::HeaderValue>,
    /// One decision at a time.
    lock: tokio::sync::Mutex<()>,
    /// The records this process wrote in the last [`RECENT`], by victim (`<ns>/<name>`): the
    /// ScaledObject cache may not hold a record yet when the waiter's next reconcile comes
    /// (its pod changes at once), and a waiter must not take a second victim for one device.
    recent: std::sync::Mutex<BTreeMap<String, (Record, std::time::Instant)>>,
}

/// How long a record written by this process counts though the cache does not show it yet.
const RECENT: Duration = Duration::from_secs(30);

impl Handover {
    /// Handover on or off; `authorization` is sent to the gateways' admin ports.
    pub fn new(enabled: bool, authorization: Option<http::HeaderValue>) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(DEMAND_TIMEOUT));
        Self {
            enabled,
            http: HttpClient::builder(TokioExecutor::new()).build(connector),
            authorization,
            lock: tokio::sync::Mutex::new(()),
            recent: std::sync::Mutex::new(BTreeMap::new()),
        }
    }

    /// The record this process wrote on `victim` within [`RECENT`], if any.
    fn recent(&self, victim: &str) -> Option<Record> {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent.retain(|_, (_, at)| at.elapsed() < RECENT);
        recent.get(victim).map(|(r, _)| r.clone())
    }

    /// Remembers that this process wrote `record` on `victim`.
    fn wrote(&self, victim: &str, record: &Record) {
        self.recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(
                victim.to_owned(),
                (record.clone(), std::time::Instant::now()),
            );
    }

    /// Forgets the record on `victim` (removed).
    fn removed(&self, victim: &str) {
        self.recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(victim);
    }
}

/// What the step found for the service's status and requeue.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Appended to the `Ready=False WaitingForDevices` message: what the handover does.
    pub note: Option<String>,
    /// Reconcile again this soon.
    pub requeue: Option<Duration>,
}

/// The handover's part of one reconcile of `svc` (see the module docs).
pub async fn step(ctx: &Context, svc: &LLMService, view: &View) -> Outcome {
    let restore = restore(ctx, svc, view).await;
    let mut out = if ctx.handover.enabled {
        wait(ctx, svc, view).await
    } else {
        Outcome::default()
    };
    out.requeue = match (out.requeue, restore) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    out
}

/// `<namespace>/<name>` of a service.
fn key_of(svc: &LLMService) -> String {
    format!("{}/{}", svc.namespace().unwrap_or_default(), svc.name_any())
}

/// The record on a ScaledObject, if any (an unreadable one is a record with no fields known).
fn record_of(so: &kube::api::DynamicObject) -> Option<Option<Record>> {
    so.annotations()
        .get(HANDOVER_ANNOTATION)
        .map(|raw| serde_json::from_str(raw).ok())
}

/// Whether a record is older than `svc`'s drain timeout plus [`STUCK_MARGIN`] (or unreadable).
fn stale(record: Option<&Record>, svc: &LLMService, now: Timestamp) -> bool {
    let drain = svc.spec.scaling.drain_timeout.get().unwrap_or_default();
    let Some(since) = record.and_then(|r| r.since.parse::<Timestamp>().ok()) else {
        return true;
    };
    Duration::try_from(now.duration_since(since)).is_ok_and(|age| age > drain + STUCK_MARGIN)
}

/// Removes `svc`'s own handover record once its pods are gone (or it is stale); `Some` while
/// it must look again.
async fn restore(ctx: &Context, svc: &LLMService, view: &View) -> Option<Duration> {
    let so = view.scaled_object.as_ref()?;
    let record = record_of(so)?;
    let at_zero = view
        .backend
        .as_ref()
        .and_then(|d| d.spec.as_ref())
        .and_then(|s| s.replicas)
        == Some(0);
    let gone = at_zero && view.backend_pods.is_empty();
    let stuck = stale(record.as_ref(), svc, Timestamp::now());
    if !gone && !stuck {
        return Some(RESTORE_RECHECK);
    }
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &svc.namespace().unwrap_or_default(),
        &ctx.render.keda_api,
    );
    let patch = serde_json::json!({"metadata": {"annotations": {
        HANDOVER_ANNOTATION: null,
        KEDA_PAUSED_REPLICAS_ANNOTATION: null,
    }}});
    match api
        .patch(&so.name_any(), &patch_params(), &Patch::Merge(&patch))
        .await
    {
        Ok(_) => {
            ctx.handover.removed(&key_of(svc));
            let to = record.as_ref().map_or("another service", |r| r.to.as_str());
            let note = if gone {
                format!(
                    "autoscaling restored: the backend's devices went to {to}; the next request wakes it as usual"
                )
            } else {
                format!(
                    "autoscaling restored although backend pods remain after the drain timeout and {}s (handover to {to})",
                    STUCK_MARGIN.as_secs()
                )
            };
            tracing::info!(to, gone, "device handover record removed");
            let type_ = if gone {
                EventType::Normal
            } else {
                EventType::Warning
            };
            // Related: the service the devices went to, so repeated handovers to others keep
            // their own notes (see `publish_about`).
            let related = record.as_ref().and_then(|r| {
                let (namespace, name) = r.to.split_once('/')?;
                Some(k8s_openapi::api::core::v1::ObjectReference {
                    api_version: Some("serving.hearth.dev/v1alpha1".to_owned()),
                    kind: Some("LLMService".to_owned()),
                    namespace: Some(namespace.to_owned()),
                    name: Some(name.to_owned()),
                    ..Default::default()
                })
            });
            publish_about(ctx, svc, type_, "DeviceHandoverDone", note, related).await;
            None
        }
        Err(e) => {
            tracing::warn!(error = %e, "removing a device handover record failed");
            Some(RESTORE_RECHECK)
        }
    }
}

/// The waiter's part: decide and act (see the module docs).
async fn wait(ctx: &Context, svc: &LLMService, view: &View) -> Outcome {
    let Some((pod, waiting)) = view
        .backend_pods
        .iter()
        .find_map(|p| handover::waiting_for(p).map(|w| (p.clone(), w)))
    else {
        return Outcome::default();
    };
    if BackendState::of(view.backend.as_deref()).ready > 0 {
        // A scale-out, not a cold start: it waits as any pod does.
        return Outcome::default();
    }
    let _one_at_a_time = ctx.handover.lock.lock().await;
    let me = key_of(svc);
    let priority = svc.spec.scaling.priority;
    let now = Timestamp::now();

    // The other services' backend pods, by service.
    let mut by_service: BTreeMap<(String, String), Vec<Arc<Pod>>> = BTreeMap::new();
    for p in ctx.pods.state() {
        if let (Some(ns), Some(name)) = (p.namespace(), p.labels().get(LLMSERVICE_LABEL)) {
            by_service.entry((ns, name.clone())).or_default().push(p);
        }
    }
    let mut holders = Vec::new();
    let mut services = BTreeMap::new();
    let mut to_me = Vec::new();
    let mut others_claims = Vec::new();
    for ((ns, name), pods) in by_service {
        let key = format!("{ns}/{name}");
        if key == me {
            continue;
        }
        let Some(other) = ctx.llmservice(&ns, &name) else {
            continue;
        };
        let record = ctx
            .keda
            .get(&ns, &names::scaled_object(&name))
            .and_then(|so| record_of(&so))
            .or_else(|| ctx.handover.recent(&key).map(Some));
        if let Some(r) = &record {
            if r.as_ref().is_some_and(|r| r.to == me) && !stale(r.as_ref(), &other, now) {
                to_me.push(key.clone());
            } else {
                others_claims.push((ns.clone(), name.clone()));
            }
        }
        let live: Vec<&Arc<Pod>> = pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .collect();
        let held: Vec<(String, BTreeMap<String, i64>)> = live
            .iter()
            .filter_map(|p| {
                let node = p.spec.as_ref()?.node_name.clone()?;
                let req: BTreeMap<String, i64> = handover::requests(p)
                    .into_iter()
                    .filter(|(r, n)| *n > 0 && waiting.need.contains_key(r))
                    .collect();
                (!req.is_empty()).then_some((node, req))
            })
            .collect();
        if held.is_empty() {
            continue;
        }
        let ready: Option<Vec<Timestamp>> = live
            .iter()
            .map(|p| crate::activation::ready_since(p))
            .collect();
        let resident = ready
            .and_then(|r| r.into_iter().max())
            .and_then(|t| Duration::try_from(now.duration_since(t)).ok());
        holders.push(Holder {
            key: key.clone(),
            priority: other.spec.scaling.priority,
            pin: handover::pin(&other, now.as_second()),
            resident,
            min_residency: other
                .spec
                .scaling
                .min_residency
                .get()
                .unwrap_or(Duration::from_secs(120)),
            demand: None,
            handing_over: record.is_some(),
            pods: held,
        });
        services.insert(key, other);
    }
    if !to_me.is_empty() {
        return Outcome {
            note: Some(format!(
                "devices are being handed over from {} (their drain runs first)",
                to_me.join(", ")
            )),
            requeue: Some(WAITING_RECHECK),
        };
    }

    // Demand of the candidates the static rules leave, concurrently.
    let asks = holders
        .iter()
        .enumerate()
        .filter(|(_, h)| handover::ruled_out(h, priority).is_none())
        .map(|(i, h)| {
            let other = services[&h.key].clone();
            async move { (i, demand_of(ctx, &other).await) }
        });
    for (i, d) in join_all(asks).await {
        holders[i].demand = Some(d);
    }

    let mut nodes: Vec<String> = holders
        .iter()
        .flat_map(|h| h.pods.iter().map(|(n, _)| n.clone()))
        .collect();
    nodes.sort();
    nodes.dedup();
    let mut capacities = Vec::new();
    for node in &nodes {
        match capacity(ctx, &pod, node, &others_claims).await {
            Ok(c) => capacities.push(c),
            Err(e) => {
                tracing::warn!(error = %e, node, "reading a node for a device handover failed")
            }
        }
    }

    let decision = handover::choose(&waiting.need, priority, &capacities, &holders);
    let note = match decision {
        Decision::HandOver { node, victims } => {
            let mut taken = Vec::new();
            for v in &victims {
                let Some(other) = services.get(v) else {
                    continue;
                };
                let record = Record {
                    to: me.clone(),
                    node: node.clone(),
                    since: now.to_string(),
                };
                match pause(ctx, other, &record).await {
                    Ok(()) => {
                        ctx.handover.wrote(v, &record);
                        let holder = holders.iter().find(|h| &h.key == v);
                        let idle = holder
                            .and_then(|h| h.demand.as_ref())
                            .and_then(|d| d.as_ref().ok())
                            .map(|d| hearth_crds::go_duration(round(d.idle)))
                            .unwrap_or_default();
                        let what = devices(&waiting.need);
                        for r in waiting.need.keys() {
                            ctx.metrics
                                .device_handovers
                                .get_or_create(&ResourceLabel {
                                    resource: r.clone(),
                                })
                                .inc();
                        }
                        let about = Some(pod.object_ref(&()));
                        publish_about(
                            ctx,
                            other,
                            EventType::Normal,
                            "DeviceHandover",
                            format!(
                                "scaled to zero to hand {what} on node {node} to {me} (priority {priority}; this service: priority {}, idle {idle}); autoscaling resumes once its pod is gone",
                                other.spec.scaling.priority
                            ),
                            about.clone(),
                        )
                        .await;
                        publish_about(
                            ctx,
                            svc,
                            EventType::Normal,
                            "DeviceHandover",
                            format!(
                                "taking {what} on node {node} from {v} (priority {}, idle {idle}): backend pod {} could not be scheduled ({})",
                                other.spec.scaling.priority, waiting.pod, waiting.message
                            ),
                            about,
                        )
                        .await;
                        tracing::info!(from = %v, to = %me, node, "device handover started");
                        taken.push(v.clone());
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, victim = %v, "pausing a device handover victim failed")
                    }
                }
            }
            if taken.is_empty() {
                "no device handover: pausing the chosen services failed (see the controller's log)"
                    .to_owned()
            } else {
                format!(
                    "handing devices over from {} on node {node} (their drain runs first)",
                    taken.join(", ")
                )
            }
        }
        Decision::Wait(why) => why,
        Decision::NotPossible(why) => format!("no device handover: {why}"),
    };
    Outcome {
        note: Some(note),
        requeue: Some(WAITING_RECHECK),
    }
}

/// `1 hearth.dev/fake-gpu`, `2 nvidia.com/gpu and 1 example.com/nic`.
fn devices(need: &BTreeMap<String, i64>) -> String {
    need.iter()
        .map(|(r, n)| format!("{n} {r}"))
        .collect::<Vec<_>>()
        .join(" and ")
}

/// Whole seconds, for messages.
fn round(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs())
}

/// A merge patch's parameters under [`FIELD_MANAGER`].
fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..Default::default()
    }
}

/// Sets KEDA's `paused-replicas: "0"` and the handover record on `victim`'s ScaledObject
/// (merge patch under [`FIELD_MANAGER`]: the controller's applies leave both alone).
async fn pause(ctx: &Context, victim: &LLMService, record: &Record) -> Result<(), kube::Error> {
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        &victim.namespace().unwrap_or_default(),
        &ctx.render.keda_api,
    );
    let patch = serde_json::json!({"metadata": {"annotations": {
        KEDA_PAUSED_REPLICAS_ANNOTATION: "0",
        HANDOVER_ANNOTATION: serde_json::to_string(record).unwrap_or_default(),
    }}});
    api.patch(
        &names::scaled_object(&victim.name_any()),
        &patch_params(),
        &Patch::Merge(&patch),
    )
    .await
    .map(|_| ())
}

/// Node `node` read now, with every pod bound to it. The terminating pods of services handing
/// over to someone else (`claimed`: namespace and service) are not counted as freeing for
/// this pod.
async fn capacity(
    ctx: &Context,
    waiting: &Pod,
    node: &str,
    claimed: &[(String, String)],
) -> Result<Capacity, kube::Error> {
    let n = Api::<Node>::all(ctx.client.clone()).get(node).await?;
    let pods = Api::<Pod>::all(ctx.client.clone())
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    Ok(Capacity::of(waiting, &n, &pods.items, |p| {
        let ns = p.namespace().unwrap_or_default();
        p.labels()
            .get(LLMSERVICE_LABEL)
            .is_some_and(|s| claimed.iter().any(|(cn, cs)| *cn == ns && cs == s))
    }))
}

/// One gateway replica's `/hearth/queue/.../local` answer.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LocalDemand {
    pending: u64,
    #[serde(default)]
    idle_seconds: Option<f64>,
}

/// The replicas of the gateway that serves `svc` (its own, or its LLMEndpoint's).
pub(super) struct GatewayPods {
    /// Every pod that may hold requests (running or starting, Ready or draining), by IP.
    pub ips: Vec<String>,
    /// Their admin port.
    pub port: i32,
    /// The service's key at that gateway: empty on its own, `<ns>/<name>` on a shared one.
    pub key: String,
}

/// The pods of the gateway that serves `svc`; `Err` says why they are not known.
pub(super) async fn gateway_pods(ctx: &Context, svc: &LLMService) -> Result<GatewayPods, String> {
    let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
    let membership = ctx.membership(svc);
    let (gw_ns, gw, key) = match Membership::placement(membership.as_ref()) {
        Placement::Own => (ns.clone(), names::gateway(&name), String::new()),
        Placement::Shared(g) => (
            g.namespace.clone(),
            names::gateway(&g.endpoint),
            format!("{ns}/{name}"),
        ),
    };
    let deployment = ctx
        .deployment(&gw_ns, &gw)
        .ok_or_else(|| format!("gateway Deployment {gw_ns}/{gw} not found"))?;
    let spec = deployment.spec.as_ref().ok_or("gateway without spec")?;
    let selector = spec
        .selector
        .match_labels
        .iter()
        .flatten()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",");
    let port = spec
        .template
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .and_then(|c| c.ports.as_ref())
        .and_then(|ports| {
            ports
                .iter()
                .find(|p| p.name.as_deref() == Some(hearth_crds::admin::PORT_NAME))
        })
        .map_or(hearth_crds::admin::PORT, |p| p.container_port);
    let pods = Api::<Pod>::namespaced(ctx.client.clone(), &gw_ns)
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(|e| format!("listing the gateway pods: {e}"))?;
    let ips: Vec<String> = pods
        .items
        .iter()
        .filter(|p| {
            !matches!(
                p.status.as_ref().and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            )
        })
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect();
    if ips.is_empty() {
        return Err(format!("no gateway pod of {gw_ns}/{gw} has an address"));
    }
    Ok(GatewayPods { ips, port, key })
}

/// The demand for `svc` summed over every replica of the gateway that serves it (its own, or
/// its LLMEndpoint's), with the shortest idle time; `Err` says why it is not known.
async fn demand_of(ctx: &Context, svc: &LLMService) -> Result<Demand, String> {
    let (_, answers) = ask_gateways::<LocalDemand>(
        ctx,
        svc,
        |key| {
            if key.is_empty() {
                "/hearth/queue/local".to_owned()
            } else {
                format!("/hearth/queue/{key}/local")
            }
        },
        4096,
    )
    .await?;
    let mut sum = Demand {
        pending: 0,
        idle: Duration::MAX,
    };
    for (ip, a) in answers {
        let a = a.map_err(|e| format!("gateway {ip}: {e}"))?;
        sum.pending = sum.pending.saturating_add(a.pending);
        let idle = Duration::try_from_secs_f64(a.idle_seconds.unwrap_or(0.0)).unwrap_or_default();
        sum.idle = sum.idle.min(idle);
    }
    Ok(sum)
}

/// Asks every replica of the gateway serving `svc` (its own, or its LLMEndpoint's) at once for
/// `GET path(key)` as JSON, at most `limit` bytes each; `key` is the service's at that gateway
/// ([`GatewayPods::key`]). Returns that key and each replica's IP with its answer; `Err` says
/// why the replicas are not known.
pub(super) async fn ask_gateways<T: serde::de::DeserializeOwned>(
    ctx: &Context,
    svc: &LLMService,
    path: impl Fn(&str) -> String,
    limit: usize,
) -> Result<(String, Vec<(String, Result<T, String>)>), String> {
    let gw = gateway_pods(ctx, svc).await?;
    let path = path(&gw.key);
    let answers = join_all(
        gw.ips
            .iter()
            .map(|ip| get_json::<T>(ctx, ip, gw.port, &path, limit)),
    )
    .await;
    Ok((gw.key, gw.ips.into_iter().zip(answers).collect()))
}

/// `path`, with `?service=<key>` on a shared gateway (`key` not empty).
pub(super) fn for_service(path: &str, key: &str) -> String {
    if key.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?service={key}")
    }
}

/// `GET http://<ip>:<port><path>` as JSON (with the controller's admin token), bounded by [`DEMAND_TIMEOUT`] and `limit` bytes.
pub(super) async fn get_json<T: serde::de::DeserializeOwned>(
    ctx: &Context,
    ip: &str,
    port: i32,
    path: &str,
    limit: usize,
) -> Result<T, String> {
    let host = if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    };
    let mut req = http::Request::get(format!("http://{host}{path}"));
    if let Some(v) = &ctx.handover.authorization {
        req = req.header(http::header::AUTHORIZATION, v.clone());
    }
    let req = req.body(Empty::<Bytes>::new()).map_err(|e| e.to_string())?;
    let call = async {
        let resp = ctx
            .handover
            .http
            .request(req)
            .await
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), limit)
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        if !status.is_success() {
            return Err(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body)
                    .chars()
                    .take(200)
                    .collect::<String>()
            ));
        }
        serde_json::from_slice::<T>(&body).map_err(|e| e.to_string())
    };
    tokio::time::timeout(DEMAND_TIMEOUT, call)
        .await
        .map_err(|_| format!("no answer within {}s", DEMAND_TIMEOUT.as_secs()))?
}

//! Device handover: when a cold service's backend pod cannot be scheduled because no node has
//! its accelerator free, and idle services hold that accelerator, one of them is taken to zero
//! so the waiting pod can run. Pure functions; `reconcile::handover` reads the caches, asks
//! the gateways for demand and writes the result.
//!
//! - **Detection** ([`waiting_for`]): the scheduler's own verdict on the pod, its
//!   `PodScheduled=False` condition with reason `Unschedulable` and `Insufficient <resource>` in
//!   its message, for an extended resource the pod requests (any name outside `kubernetes.io/`
//!   with a domain prefix: `nvidia.com/gpu`, `huawei.com/Ascend910`, `hearth.dev/fake-gpu`).
//! - **Where** ([`node_fit`], [`Capacity`]): a node holding a candidate's pod, where the
//!   waiting pod's node selector, required node affinity and tolerations allow it, and where
//!   the devices the candidates free cover what is missing (allocatable less what its pods
//!   request).
//! - **Who** ([`ineligible`], [`choose`]): a service whose backend holds that resource on such
//!   a node, not already handing over, not pinned (`scaling.min` above 0 or a warm window open,
//!   [`pin`]), with a priority not above the waiting one's, every backend replica Ready for at
//!   least its `scaling.minResidency`, its demand known at every gateway replica and zero (no
//!   request in flight or held, no activation lease). Among them: lowest priority, then least
//!   recently used (the longest idle), then name.
//!
//! The victim goes to zero through KEDA's `autoscaling.keda.sh/paused-replicas: "0"`
//! annotation (KEDA scales the target to that count and stops autoscaling it until the
//! annotation is removed), set with [`HANDOVER_ANNOTATION`] under its own field manager; once
//! the victim's pods are gone both are removed and KEDA autoscales it again.

use std::{cmp::Reverse, collections::BTreeMap, time::Duration};

use hearth_crds::{LLMService, cron};
use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, Pod, Taint, Toleration};
use serde::{Deserialize, Serialize};

/// On a victim's ScaledObject while it is handed over: a JSON [`Record`].
pub const HANDOVER_ANNOTATION: &str = "serving.hearth.dev/handover";

/// KEDA's annotation that scales the target to the given count and pauses autoscaling
/// (KEDA docs, "Pausing autoscaling"; `autoscaling.keda.sh/paused: "true"` would keep the
/// current count).
pub const KEDA_PAUSED_REPLICAS_ANNOTATION: &str = "autoscaling.keda.sh/paused-replicas";

/// The field manager of the handover's annotations: the controller's own server-side applies
/// of the ScaledObject never own (so never remove) them.
pub const FIELD_MANAGER: &str = "hearth-handover";

/// What [`HANDOVER_ANNOTATION`] records on the victim's ScaledObject.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// The waiting service, `<namespace>/<name>`.
    pub to: String,
    /// The node whose devices are handed over.
    pub node: String,
    /// When the handover started, RFC 3339.
    pub since: String,
}

/// Whether `name` is an extended resource (Kubernetes' `IsExtendedResourceName`): a domain
/// prefix other than `kubernetes.io/`, and not a quota's `requests.` form.
pub fn is_extended(name: &str) -> bool {
    name.contains('/')
        && !name.starts_with("kubernetes.io/")
        && !name.contains(".kubernetes.io/")
        && !name.starts_with("requests.")
}

/// The extended resources `pod` requests, summed over its containers (a container's request,
/// else its limit, which is what Kubernetes defaults the request of an extended resource to).
/// Extended resources are whole numbers; a value that is not one is left out.
pub fn requests(pod: &Pod) -> BTreeMap<String, i64> {
    let mut sum = BTreeMap::new();
    let Some(spec) = &pod.spec else { return sum };
    for c in &spec.containers {
        let Some(r) = &c.resources else { continue };
        let mut own: BTreeMap<&String, i64> = BTreeMap::new();
        for source in [&r.limits, &r.requests].into_iter().flatten() {
            for (name, q) in source {
                if let Ok(n) = q.0.trim().parse::<i64>()
                    && is_extended(name)
                {
                    own.insert(name, n);
                }
            }
        }
        for (name, n) in own {
            *sum.entry(name.clone()).or_insert(0) += n;
        }
    }
    sum
}

/// A backend pod the scheduler cannot place for lack of accelerators.
#[derive(Clone, Debug, PartialEq)]
pub struct Waiting {
    /// The pod's name.
    pub pod: String,
    /// The resources the scheduler found insufficient, with the pod's request of each.
    pub need: BTreeMap<String, i64>,
    /// The scheduler's message (`0/1 nodes are available: 1 Insufficient nvidia.com/gpu. ...`).
    pub message: String,
}

/// The scheduler's verdict that no node has `pod`'s accelerator free: pending, not being
/// deleted, `PodScheduled=False` reason `Unschedulable`, and `Insufficient <r>` in the message
/// for an extended resource `r` the pod requests. `None` for any other state (a pod waiting
/// for CPU, memory or a node selector nothing matches is not something a handover fixes).
pub fn waiting_for(pod: &Pod) -> Option<Waiting> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    if status.phase.as_deref() != Some("Pending") {
        return None;
    }
    let cond = status
        .conditions
        .iter()
        .flatten()
        .find(|c| c.type_ == "PodScheduled")?;
    if cond.status != "False" || cond.reason.as_deref() != Some("Unschedulable") {
        return None;
    }
    let message = cond.message.clone().unwrap_or_default();
    let requested = requests(pod);
    let need: BTreeMap<String, i64> = requested
        .into_iter()
        .filter(|(name, n)| *n > 0 && message.contains(&format!("Insufficient {name}")))
        .collect();
    if need.is_empty() {
        return None;
    }
    Some(Waiting {
        pod: pod.metadata.name.clone().unwrap_or_default(),
        need,
        message,
    })
}

/// Why the waiting `pod` could not run on `node` whatever its devices: cordoned, a node
/// selector or required node affinity term it does not match, or a `NoSchedule`/`NoExecute`
/// taint the pod does not tolerate. `Ok` when it could.
pub fn node_fit(pod: &Pod, node: &Node) -> Result<(), String> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let spec = node.spec.as_ref();
    if spec.and_then(|s| s.unschedulable).unwrap_or(false) {
        return Err(format!("node {name} is cordoned"));
    }
    let Some(pod_spec) = &pod.spec else {
        return Ok(());
    };
    for (k, v) in pod_spec.node_selector.iter().flatten() {
        if labels.get(k) != Some(v) {
            return Err(format!("node {name} lacks the pod's nodeSelector {k}={v}"));
        }
    }
    if let Some(required) = pod_spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        })
    {
        // Terms are ORed, the requirements of a term ANDed (Kubernetes' NodeSelector).
        let any = required.node_selector_terms.iter().any(|term| {
            term.match_expressions
                .iter()
                .flatten()
                .all(|r| requirement(r, labels.get(&r.key)))
                && term
                    .match_fields
                    .iter()
                    .flatten()
                    .all(|r| r.key != "metadata.name" || requirement(r, Some(&name.to_owned())))
        });
        if !any {
            return Err(format!(
                "node {name} matches none of the pod's required node affinity terms"
            ));
        }
    }
    let tolerations = pod_spec.tolerations.as_deref().unwrap_or_default();
    for taint in spec.and_then(|s| s.taints.as_deref()).unwrap_or_default() {
        if (taint.effect == "NoSchedule" || taint.effect == "NoExecute")
            && !tolerations.iter().any(|t| tolerates(t, taint))
        {
            return Err(format!(
                "node {name} has taint {}={}:{} the pod does not tolerate",
                taint.key,
                taint.value.as_deref().unwrap_or_default(),
                taint.effect
            ));
        }
    }
    Ok(())
}

/// A node selector requirement against a label's value (`None`: no such label).
fn requirement(r: &NodeSelectorRequirement, value: Option<&String>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => {
            matches!((value.and_then(|v| number(v)), values.first().and_then(|v| number(v))), (Some(a), Some(b)) if a > b)
        }
        "Lt" => {
            matches!((value.and_then(|v| number(v)), values.first().and_then(|v| number(v))), (Some(a), Some(b)) if a < b)
        }
        _ => false,
    }
}

/// Whether toleration `t` tolerates `taint` (Kubernetes' `Toleration.ToleratesTaint`).
fn tolerates(t: &Toleration, taint: &Taint) -> bool {
    if t.effect
        .as_deref()
        .is_some_and(|e| !e.is_empty() && e != taint.effect)
    {
        return false;
    }
    let key = t.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match t.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" => {
            t.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default()
        }
        _ => false,
    }
}

/// A node's accelerators as the scheduler counts them.
#[derive(Clone, Debug, PartialEq)]
pub struct Capacity {
    /// The node's name.
    pub node: String,
    /// [`node_fit`] of the waiting pod.
    pub fit: Result<(), String>,
    /// Allocatable less what its running and pending pods request, per extended resource.
    pub free: BTreeMap<String, i64>,
    /// What pods being deleted still request: free once they are gone (those another waiting
    /// pod's handover freed are left out).
    pub freeing: BTreeMap<String, i64>,
}

impl Capacity {
    /// The capacity of `node` for `waiting`, given the pods bound to it (`pods`: those whose
    /// `spec.nodeName` is the node; finished ones are left out). A terminating pod for which
    /// `claimed` is true frees its devices for another waiting pod, not this one.
    pub fn of<'a>(
        waiting: &Pod,
        node: &Node,
        pods: impl IntoIterator<Item = &'a Pod>,
        claimed: impl Fn(&Pod) -> bool,
    ) -> Self {
        let mut free: BTreeMap<String, i64> = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .into_iter()
            .flatten()
            .filter(|(name, _)| is_extended(name))
            .filter_map(|(name, q)| Some((name.clone(), q.0.trim().parse::<i64>().ok()?)))
            .collect();
        let mut freeing = BTreeMap::new();
        for pod in pods {
            let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
            if matches!(phase, Some("Succeeded" | "Failed")) {
                continue;
            }
            for (name, n) in requests(pod) {
                *free.entry(name.clone()).or_insert(0) -= n;
                if pod.metadata.deletion_timestamp.is_some() && !claimed(pod) {
                    *freeing.entry(name).or_insert(0) += n;
                }
            }
        }
        Self {
            node: node.metadata.name.clone().unwrap_or_default(),
            fit: node_fit(waiting, node),
            free,
            freeing,
        }
    }
}

/// Demand for a service at its gateways, summed over every replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Demand {
    /// Requests in flight or held, plus 1 for each replica holding an activation lease.
    pub pending: u64,
    /// Since the last request finished at any replica (the shortest idle time reported).
    pub idle: Duration,
}

/// A service whose backend holds accelerators: a handover candidate.
#[derive(Clone, Debug, PartialEq)]
pub struct Holder {
    /// `<namespace>/<name>`.
    pub key: String,
    /// `spec.scaling.priority`.
    pub priority: i32,
    /// Why it may not be scaled down ([`pin`]).
    pub pin: Option<String>,
    /// Since its most recently Ready backend pod turned Ready; `None` while one is not Ready.
    pub resident: Option<Duration>,
    /// `spec.scaling.minResidency`.
    pub min_residency: Duration,
    /// Demand at its gateways; `Err` says why it is not known. `None`: not asked (the static
    /// checks ruled it out first).
    pub demand: Option<Result<Demand, String>>,
    /// It is already being taken to zero by a handover.
    pub handing_over: bool,
    /// Its backend pods not being deleted: the node each runs on and what it requests.
    pub pods: Vec<(String, BTreeMap<String, i64>)>,
}

/// Why `holder` cannot give its devices to a service of priority `priority`, from what needs
/// no gateway (`holder.demand` unread): already handing over, pinned, a higher priority, or
/// resident for less than its minimum. `None`: its demand decides ([`ineligible`]).
pub fn ruled_out(holder: &Holder, priority: i32) -> Option<String> {
    if holder.handing_over {
        return Some("is already handing its devices over".to_owned());
    }
    if let Some(pin) = &holder.pin {
        return Some(format!("is pinned ({pin})"));
    }
    if holder.priority > priority {
        return Some(format!("has priority {} above {priority}", holder.priority));
    }
    match holder.resident {
        None => Some("has a backend replica that is not Ready yet".to_owned()),
        Some(r) if r < holder.min_residency => Some(format!(
            "has served less than its minResidency {}",
            secs(holder.min_residency)
        )),
        Some(_) => None,
    }
}

/// Why `holder` cannot give its devices away ([`ruled_out`], then its demand: unknown, or a
/// request in flight or held). `None`: it is a victim. The reasons name no counts or times
/// that move while nothing changes, so the condition that carries them is not rewritten on
/// every look.
pub fn ineligible(holder: &Holder, priority: i32) -> Option<String> {
    if let Some(why) = ruled_out(holder, priority) {
        return Some(why);
    }
    match &holder.demand {
        None => Some("its demand was not asked for".to_owned()),
        Some(Err(e)) => Some(format!("its demand is unknown ({e})")),
        Some(Ok(d)) if d.pending > 0 => {
            Some("is serving (a request in flight or held at its gateway)".to_owned())
        }
        Some(Ok(_)) => None,
    }
}

/// What [`choose`] decided.
#[derive(Clone, Debug, PartialEq)]
pub enum Decision {
    /// Devices are free already, or being freed, on a node where the pod fits: the scheduler
    /// places it once it retries.
    Wait(String),
    /// Take `victims` to zero to free devices on `node`.
    HandOver {
        /// The node the devices are freed on.
        node: String,
        /// Keys of the services to take to zero, in the order chosen.
        victims: Vec<String>,
    },
    /// No handover can free the devices; why, for the service's condition.
    NotPossible(String),
}

/// Picks the victims for a pod of priority `priority` needing `need` (see the module docs):
/// on each node where the pod fits, the eligible holders with pods there, lowest priority
/// then longest idle then name, taken until the devices they free cover what the node lacks;
/// of the nodes where that works, the one whose victims have the lowest highest priority, then
/// the fewest victims, then the longest shortest idle time, then the node name.
pub fn choose(
    need: &BTreeMap<String, i64>,
    priority: i32,
    nodes: &[Capacity],
    holders: &[Holder],
) -> Decision {
    let mut why_not: Vec<String> = Vec::new();
    let mut eligible: Vec<&Holder> = Vec::new();
    for h in holders {
        match ineligible(h, priority) {
            Some(why) => why_not.push(format!("{} {why}", h.key)),
            None => eligible.push(h),
        }
    }
    let idle = |h: &Holder| {
        h.demand
            .as_ref()
            .and_then(|d| d.as_ref().ok())
            .map_or(Duration::ZERO, |d| d.idle)
    };
    eligible.sort_by_key(|h| (h.priority, Reverse(idle(h)), h.key.clone()));

    type Cost = (i32, usize, Reverse<Duration>, String);
    let mut best: Option<(Cost, String, Vec<String>)> = None;
    for cap in nodes {
        if let Err(e) = &cap.fit {
            why_not.push(e.clone());
            continue;
        }
        let short: BTreeMap<&String, i64> = need
            .iter()
            .map(|(r, n)| {
                let have = cap.free.get(r).copied().unwrap_or(0)
                    + cap.freeing.get(r).copied().unwrap_or(0);
                (r, n - have)
            })
            .collect();
        if short.values().all(|s| *s <= 0) {
            return Decision::Wait(if cap.freeing.values().any(|n| *n > 0) {
                format!("devices are being freed on node {}", cap.node)
            } else {
                format!(
                    "node {} has the devices free; the scheduler places the pod when it retries",
                    cap.node
                )
            });
        }
        let mut left = short.clone();
        let mut victims: Vec<&Holder> = Vec::new();
        for h in &eligible {
            let mut frees = false;
            for (node, req) in &h.pods {
                if node != &cap.node {
                    continue;
                }
                for (r, n) in req {
                    if let Some(l) = left.get_mut(r)
                        && *n > 0
                    {
                        *l -= n;
                        frees = true;
                    }
                }
            }
            if frees {
                victims.push(h);
            }
            if left.values().all(|l| *l <= 0) {
                break;
            }
        }
        if left.values().any(|l| *l > 0) {
            why_not.push(format!(
                "node {}: the eligible services there free too few devices",
                cap.node
            ));
            continue;
        }
        let cost: Cost = (
            victims.iter().map(|h| h.priority).max().unwrap_or(i32::MIN),
            victims.len(),
            Reverse(victims.iter().map(|h| idle(h)).min().unwrap_or_default()),
            cap.node.clone(),
        );
        if best.as_ref().is_none_or(|(c, _, _)| cost < *c) {
            best = Some((
                cost,
                cap.node.clone(),
                victims.iter().map(|h| h.key.clone()).collect(),
            ));
        }
    }
    match best {
        Some((_, node, victims)) => Decision::HandOver { node, victims },
        None => {
            if nodes.is_empty() {
                why_not.push("no node holds these devices for another service".to_owned());
            }
            why_not.dedup();
            Decision::NotPossible(why_not.join("; "))
        }
    }
}

/// Why `svc` may not be taken to zero at `unix_seconds`: `scaling.min` above 0, or a warm
/// window open (as KEDA's cron scaler decides, [`cron::open_at`]). A window that does not
/// parse pins nothing (the rules refuse it).
pub fn pin(svc: &LLMService, unix_seconds: i64) -> Option<String> {
    let scaling = &svc.spec.scaling;
    if scaling.min > 0 {
        return Some(format!("spec.scaling.min is {}", scaling.min));
    }
    open_warm_window(svc, unix_seconds).map(|i| format!("spec.scaling.warmWindows[{i}] is open"))
}

/// The index of a warm window of `svc` open at `unix_seconds` (as KEDA's cron scaler decides,
/// [`cron::open_at`]); a window that does not parse is never open (the rules refuse it).
pub fn open_warm_window(svc: &LLMService, unix_seconds: i64) -> Option<usize> {
    svc.spec.scaling.warm_windows.iter().position(|w| {
        let (Ok(start), Ok(end)) = (cron::parse(&w.start), cron::parse(&w.end)) else {
            return false;
        };
        cron::open_at(&start, &end, &w.timezone, unix_seconds) == Some(true)
    })
}

/// A duration for messages, as Go prints it (`12.3s`, `2m0s`).
fn secs(d: Duration) -> String {
    hearth_crds::go_duration(d)
}

#[cfg(test)]
mod tests;

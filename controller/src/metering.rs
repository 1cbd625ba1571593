//! Accelerator-seconds: the backend pods' device time of each LLMService, shared among its
//! tenants and phases so that the parts add up to the whole (docs/tenants.md, "The bill").
//!
//! Pure functions on a [`Ledger`]; the reconciler's meter (`reconcile::metering`) feeds it the
//! backend pods and the gateway replicas' [`hearth_crds::metering`] reports every
//! [`TICK`], keeps it in the ConfigMap `<service>-usage` and writes `status.usage`.
//!
//! A pod's device time runs from its `PodScheduled` transition until it is gone from the API,
//! times the extended resources it requests (`nvidia.com/gpu: 2` counts 2). Each tick shares
//! each pod's part of the tick:
//!
//! | phase | when | charged to |
//! |---|---|---|
//! | `coldStart` | scheduled, not yet Ready | the tenants whose requests waited cold since the last time an engine served (by count), else those served in the tick (by tokens), else the owner |
//! | `serving` | Ready and awake, a request in flight (the gateways' busy time of the pod's address, summed over replicas, at most the tick) | the tenants served in the tick, by tokens (else by requests, else the owner) |
//! | `sleeping` | Ready, asleep: every gateway replica that discovered it has it out of its serving set (sleeping tier) | the owner |
//! | `warmWindow` | Ready, awake, no request in flight, a warm window open | the owner |
//! | `idle` | Ready, awake, no request in flight | the owner |
//!
//! The owner is `spec.owner`, else the namespace. Counts from a gateway replica are
//! cumulative per instance; a new instance (a restart) counts from 0, a smaller value is a
//! reset. Tokens served by a replica after its last report and before it stopped are lost to
//! the shares, not to the sum.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use hearth_crds::metering::MeteringReport;
use serde::{Deserialize, Serialize};

/// How often the meter charges the pods' time.
pub const TICK: Duration = Duration::from_secs(5);
/// Per-minute buckets are kept this long, then rolled into hours.
pub const MINUTES_KEPT: i64 = 2 * 60 * 60 * 1000;
/// Per-hour buckets are kept this long.
pub const HOURS_KEPT: i64 = 7 * 24 * 60 * 60 * 1000;

const MINUTE: i64 = 60 * 1000;
const HOUR: i64 = 60 * MINUTE;

/// The phases of device time, in their order in tables.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// Scheduled, not yet Ready.
    ColdStart,
    /// Ready and a request in flight.
    Serving,
    /// Ready, no request, no warm window.
    Idle,
    /// The engine asleep (sleeping tier).
    Sleeping,
    /// Ready, no request, inside a warm window.
    WarmWindow,
}

impl Phase {
    /// Every phase.
    pub const ALL: [Phase; 5] = [
        Phase::ColdStart,
        Phase::Serving,
        Phase::Idle,
        Phase::Sleeping,
        Phase::WarmWindow,
    ];

    /// The API's name: `coldStart`, `serving`, `idle`, `sleeping`, `warmWindow`.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::ColdStart => "coldStart",
            Phase::Serving => "serving",
            Phase::Idle => "idle",
            Phase::Sleeping => "sleeping",
            Phase::WarmWindow => "warmWindow",
        }
    }
}

/// Device-seconds per phase.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PhaseSeconds {
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cold_start: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub serving: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub idle: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub sleeping: f64,
    #[serde(default, skip_serializing_if = "is_zero")]
    pub warm_window: f64,
}

fn is_zero(x: &f64) -> bool {
    *x == 0.0
}

impl PhaseSeconds {
    /// The seconds of `phase`.
    pub fn get(&self, phase: Phase) -> f64 {
        match phase {
            Phase::ColdStart => self.cold_start,
            Phase::Serving => self.serving,
            Phase::Idle => self.idle,
            Phase::Sleeping => self.sleeping,
            Phase::WarmWindow => self.warm_window,
        }
    }

    fn slot(&mut self, phase: Phase) -> &mut f64 {
        match phase {
            Phase::ColdStart => &mut self.cold_start,
            Phase::Serving => &mut self.serving,
            Phase::Idle => &mut self.idle,
            Phase::Sleeping => &mut self.sleeping,
            Phase::WarmWindow => &mut self.warm_window,
        }
    }

    /// Adds `other`, phase by phase.
    pub fn add(&mut self, other: &PhaseSeconds) {
        for p in Phase::ALL {
            *self.slot(p) += other.get(p);
        }
    }

    /// Every phase summed.
    pub fn total(&self) -> f64 {
        Phase::ALL.iter().map(|p| self.get(*p)).sum()
    }
}

/// Device-seconds by tenant and phase.
pub type Charges = BTreeMap<String, PhaseSeconds>;

/// Adds `from` into `into`.
pub fn add_charges(into: &mut Charges, from: &Charges) {
    for (tenant, secs) in from {
        into.entry(tenant.clone()).or_default().add(secs);
    }
}

/// Every tenant's seconds summed, by phase.
pub fn by_phase(c: &Charges) -> PhaseSeconds {
    let mut all = PhaseSeconds::default();
    for secs in c.values() {
        all.add(secs);
    }
    all
}

/// The sum of every tenant's and phase's seconds.
pub fn charges_total(c: &Charges) -> f64 {
    c.values().map(PhaseSeconds::total).sum()
}

/// The charges of the buckets starting in `[from_ms, to_ms)`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bucket {
    /// Start of the minute (or hour), Unix milliseconds.
    pub start_ms: i64,
    /// What was charged in it (at the end of each tick).
    pub charges: Charges,
}

/// A backend pod as the ledger keeps it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PodRecord {
    /// Its UID.
    pub uid: String,
    /// Its name.
    pub name: String,
    /// Extended-resource units it requests (summed over resources and containers).
    pub devices: u32,
    /// `PodScheduled` true since, Unix milliseconds.
    pub scheduled_ms: i64,
    /// First seen Ready since, Unix milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_ms: Option<i64>,
}

/// A gateway replica's counts for this service at its last report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayCounts {
    /// `tenant → [requests, tokens, coldRequests]`.
    pub tenants: BTreeMap<String, [u64; 3]>,
    /// `address → busySeconds`.
    pub busy: BTreeMap<String, f64>,
}

/// What the meter keeps for one service (the ConfigMap `<service>-usage`, key
/// [`LEDGER_KEY`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Ledger {
    /// When metering began, Unix milliseconds.
    pub since_ms: i64,
    /// Charged up to, Unix milliseconds.
    pub at_ms: i64,
    /// Every charge since `since_ms`.
    pub totals: Charges,
    /// Per-minute charges of the last [`MINUTES_KEPT`].
    pub minutes: Vec<Bucket>,
    /// Per-hour charges of the last [`HOURS_KEPT`] before the minutes.
    pub hours: Vec<Bucket>,
    /// The backend pods alive at `at_ms`.
    pub pods: Vec<PodRecord>,
    /// The last counts of each gateway replica (by instance) that reports the service.
    pub gateways: BTreeMap<String, GatewayCounts>,
    /// Cold requests per tenant since an engine last served: who waits for the cold start
    /// under way.
    pub cold: BTreeMap<String, u64>,
}

/// The ConfigMap key of the [`Ledger`].
pub const LEDGER_KEY: &str = "ledger.json";

/// A backend pod now.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PodNow {
    pub uid: String,
    pub name: String,
    pub devices: u32,
    /// `PodScheduled` true since; `None`: not scheduled (no device yet).
    pub scheduled_ms: Option<i64>,
    /// `Ready` true since, while Ready.
    pub ready_ms: Option<i64>,
    /// Its IP.
    pub ip: Option<String>,
}

/// What the meter sees at one tick.
#[derive(Clone, Debug, Default)]
pub struct Observation {
    /// Now, Unix milliseconds.
    pub now_ms: i64,
    /// The service's backend pods in the API now.
    pub pods: Vec<PodNow>,
    /// When pods seen gone from the API went, by UID (the watch's deletions).
    pub gone_ms: BTreeMap<String, i64>,
    /// The gateway replicas' reports of this service; `None` when they could not be read
    /// (the tick's time is then shared as if nothing was served).
    pub gateways: Option<Vec<(String, hearth_crds::metering::ServiceMetering)>>,
    /// A warm window is open.
    pub warm_window: bool,
    /// The tenant charged for time nobody's requests used.
    pub owner: String,
}

/// A ledger starting at `now_ms`.
pub fn new_ledger(now_ms: i64) -> Ledger {
    Ledger {
        since_ms: now_ms,
        at_ms: now_ms,
        ..Ledger::default()
    }
}

/// Each report's entry for `service` (its key at that gateway; empty: the service's own
/// gateway, whose only entry is taken whatever its key): `(instance, counts)`.
pub fn reports_of(
    reports: &[MeteringReport],
    service: &str,
) -> Vec<(String, hearth_crds::metering::ServiceMetering)> {
    reports
        .iter()
        .filter_map(|r| {
            r.services
                .iter()
                .find(|s| s.service == service || (service.is_empty() && r.services.len() == 1))
                .map(|s| (r.instance.clone(), s.clone()))
        })
        .collect()
}

/// `a − b` of a cumulative count; a smaller `a` is a reset (counted from 0).
fn delta<T: PartialOrd + std::ops::Sub<Output = T> + Copy>(a: T, b: Option<T>) -> T {
    match b {
        Some(b) if a >= b => a - b,
        _ => a,
    }
}

/// The host of `host:port` or `[v6]:port`.
fn host_of(address: &str) -> &str {
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h);
    host.trim_start_matches('[').trim_end_matches(']')
}

/// What the gateways' reports say over one tick.
#[derive(Default)]
struct Activity {
    tokens: BTreeMap<String, f64>,
    requests: BTreeMap<String, f64>,
    cold: BTreeMap<String, u64>,
    /// Busy seconds per host.
    busy: BTreeMap<String, f64>,
    /// Hosts some replica reported: `(reported by any, serving at any)`.
    seen: BTreeMap<String, (bool, bool)>,
}

/// Takes the gateways' counts into the ledger and returns their deltas.
fn activity(ledger: &mut Ledger, obs: &Observation) -> Activity {
    let mut act = Activity::default();
    let Some(reports) = &obs.gateways else {
        return act;
    };
    let mut next = BTreeMap::new();
    for (instance, s) in reports {
        let prev = ledger.gateways.get(instance);
        let mut counts = GatewayCounts::default();
        for t in &s.tenants {
            let before = prev.and_then(|p| p.tenants.get(&t.tenant));
            let now = [t.requests, t.tokens, t.cold_requests];
            let d = |i: usize| delta(now[i], before.map(|b| b[i]));
            *act.requests.entry(t.tenant.clone()).or_default() += d(0) as f64;
            *act.tokens.entry(t.tenant.clone()).or_default() += d(1) as f64;
            let cold = d(2);
            if cold > 0 {
                *act.cold.entry(t.tenant.clone()).or_default() += cold;
            }
            counts.tenants.insert(t.tenant.clone(), now);
        }
        for e in &s.endpoints {
            let host = host_of(&e.address).to_owned();
            let seen = act.seen.entry(host.clone()).or_insert((false, false));
            seen.0 = true;
            seen.1 |= e.serving;
            if e.serving {
                let busy = e.busy_seconds.max(0.0);
                let before = prev.and_then(|p| p.busy.get(&e.address)).copied();
                *act.busy.entry(host).or_default() += delta(busy, before);
                counts.busy.insert(e.address.clone(), busy);
            }
        }
        next.insert(instance.clone(), counts);
    }
    ledger.gateways = next;
    act
}

/// Shares `seconds` by `weights` (positive ones), else gives them all to `owner`.
fn share(
    out: &mut Charges,
    phase: Phase,
    seconds: f64,
    weights: &BTreeMap<String, f64>,
    owner: &str,
) {
    if seconds <= 0.0 {
        return;
    }
    let sum: f64 = weights.values().filter(|w| **w > 0.0).sum();
    if sum <= 0.0 {
        *out.entry(owner.to_owned()).or_default().slot(phase) += seconds;
        return;
    }
    for (tenant, w) in weights.iter().filter(|(_, w)| **w > 0.0) {
        *out.entry(tenant.clone()).or_default().slot(phase) += seconds * w / sum;
    }
}

/// The overlap of `[a0, a1)` and `[b0, b1)`, in seconds.
fn overlap(a0: i64, a1: i64, b0: i64, b1: i64) -> f64 {
    let (from, to) = (a0.max(b0), a1.min(b1));
    if to > from {
        (to - from) as f64 / 1000.0
    } else {
        0.0
    }
}

/// Charges the time from `ledger.at_ms` to `obs.now_ms` and moves the ledger there; returns
/// the tick's charges. A pod new to the ledger is charged from its scheduling; one gone is
/// charged until it went (the watch's deletion time, else now); their sum is the pods'
/// device-seconds of the tick.
pub fn advance(ledger: &mut Ledger, obs: &Observation) -> Charges {
    let (t0, t1) = (ledger.at_ms, obs.now_ms.max(ledger.at_ms));
    let act = activity(ledger, obs);
    for (tenant, n) in &act.cold {
        *ledger.cold.entry(tenant.clone()).or_default() += n;
    }
    let tokens = if act.tokens.values().any(|t| *t > 0.0) {
        &act.tokens
    } else {
        &act.requests
    };
    let cold: BTreeMap<String, f64> = if ledger.cold.is_empty() {
        tokens.clone()
    } else {
        ledger
            .cold
            .iter()
            .map(|(t, n)| (t.clone(), *n as f64))
            .collect()
    };

    let known: BTreeMap<String, PodRecord> =
        ledger.pods.drain(..).map(|p| (p.uid.clone(), p)).collect();
    let mut alive = Vec::new();
    let mut out = Charges::new();
    let mut served = false;
    let charge = |rec: &PodRecord, from: i64, to: i64, ip: Option<&str>, out: &mut Charges| {
        if to <= from || rec.devices == 0 {
            return;
        }
        let devices = f64::from(rec.devices);
        let ready_from = rec.ready_ms.unwrap_or(i64::MAX);
        let cold_s = overlap(from, to, rec.scheduled_ms, ready_from);
        let ready_s = (to - from) as f64 / 1000.0 - cold_s;
        share(out, Phase::ColdStart, devices * cold_s, &cold, &obs.owner);
        if ready_s <= 0.0 {
            return;
        }
        let host = ip.unwrap_or_default();
        let busy = act.busy.get(host).copied().unwrap_or(0.0).min(ready_s);
        let asleep = act
            .seen
            .get(host)
            .is_some_and(|(seen, serving)| *seen && !serving);
        share(out, Phase::Serving, devices * busy, tokens, &obs.owner);
        let rest = ready_s - busy;
        let phase = if asleep {
            Phase::Sleeping
        } else if obs.warm_window {
            Phase::WarmWindow
        } else {
            Phase::Idle
        };
        share(out, phase, devices * rest, &BTreeMap::new(), &obs.owner);
    };
    let mut present = BTreeSet::new();
    for p in &obs.pods {
        let Some(scheduled) = p.scheduled_ms else {
            continue;
        };
        present.insert(p.uid.clone());
        let before = known.get(&p.uid);
        let rec = PodRecord {
            uid: p.uid.clone(),
            name: p.name.clone(),
            devices: p.devices,
            scheduled_ms: scheduled,
            ready_ms: before.and_then(|b| b.ready_ms).or(p.ready_ms),
        };
        let from = if before.is_some() { t0 } else { scheduled };
        charge(&rec, from.max(scheduled), t1, p.ip.as_deref(), &mut out);
        let awake = p.ready_ms.is_some()
            && p.ip
                .as_deref()
                .is_none_or(|ip| act.seen.get(ip).is_none_or(|(_, serving)| *serving));
        served |= awake;
        alive.push(rec);
    }
    for (uid, rec) in &known {
        if present.contains(uid) {
            continue;
        }
        let gone = obs.gone_ms.get(uid).copied().unwrap_or(t1).clamp(t0, t1);
        charge(rec, t0.max(rec.scheduled_ms), gone, None, &mut out);
    }
    if served {
        ledger.cold.clear();
    }
    ledger.pods = alive;
    ledger.at_ms = t1;
    book(ledger, &out, t1);
    out
}

/// Adds `charges` to the totals and the bucket of `at_ms`; rolls minutes older than
/// [`MINUTES_KEPT`] into hours and drops hours older than [`HOURS_KEPT`].
fn book(ledger: &mut Ledger, charges: &Charges, at_ms: i64) {
    if charges.is_empty() {
        return;
    }
    add_charges(&mut ledger.totals, charges);
    let minute = at_ms - at_ms.rem_euclid(MINUTE);
    match ledger.minutes.last_mut() {
        Some(b) if b.start_ms == minute => add_charges(&mut b.charges, charges),
        _ => ledger.minutes.push(Bucket {
            start_ms: minute,
            charges: charges.clone(),
        }),
    }
    while ledger
        .minutes
        .first()
        .is_some_and(|b| b.start_ms < at_ms - MINUTES_KEPT)
    {
        let old = ledger.minutes.remove(0);
        let hour = old.start_ms - old.start_ms.rem_euclid(HOUR);
        match ledger.hours.last_mut() {
            Some(b) if b.start_ms == hour => add_charges(&mut b.charges, &old.charges),
            _ => ledger.hours.push(Bucket {
                start_ms: hour,
                charges: old.charges,
            }),
        }
    }
    ledger.hours.retain(|b| b.start_ms >= at_ms - HOURS_KEPT);
}

/// The charges of `[from_ms, to_ms)` from the buckets (a bucket counts when it starts in the
/// window: minutes for the last two hours, hours before, nothing before seven days), or the
/// totals when `from_ms` is at or before `since_ms` and `to_ms` at or after `at_ms`.
pub fn window(ledger: &Ledger, from_ms: i64, to_ms: i64) -> Charges {
    if from_ms <= ledger.since_ms && to_ms > ledger.at_ms {
        return ledger.totals.clone();
    }
    let mut out = Charges::new();
    for b in ledger.hours.iter().chain(&ledger.minutes) {
        if b.start_ms >= from_ms && b.start_ms < to_ms {
            add_charges(&mut out, &b.charges);
        }
    }
    out
}

/// The extended-resource units `pod` requests: [`crate::handover::requests`] summed.
pub fn devices(pod: &k8s_openapi::api::core::v1::Pod) -> u32 {
    let sum: i64 = crate::handover::requests(pod).values().sum();
    u32::try_from(sum.max(0)).unwrap_or(u32::MAX)
}

/// One line of `kubectl hearth usage`: a tenant's device-seconds of one service in a window.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct UsageRow {
    pub namespace: String,
    pub service: String,
    pub tenant: String,
    pub cold_start: f64,
    pub serving: f64,
    pub idle: f64,
    pub sleeping: f64,
    pub warm_window: f64,
    pub total: f64,
}

/// The rows of `[from_ms, to_ms)` ([`window`]) of `(namespace, service, ledger)`s, in their
/// order, tenants sorted.
pub fn usage_rows(ledgers: &[(String, String, Ledger)], from_ms: i64, to_ms: i64) -> Vec<UsageRow> {
    let mut out = Vec::new();
    for (ns, service, ledger) in ledgers {
        for (tenant, s) in window(ledger, from_ms, to_ms) {
            out.push(UsageRow {
                namespace: ns.clone(),
                service: service.clone(),
                tenant,
                cold_start: s.get(Phase::ColdStart),
                serving: s.get(Phase::Serving),
                idle: s.get(Phase::Idle),
                sleeping: s.get(Phase::Sleeping),
                warm_window: s.get(Phase::WarmWindow),
                total: s.total(),
            });
        }
    }
    out
}

/// `rows` as `kubectl hearth usage` prints them: a header, one line each (seconds with one
/// decimal), a unit note.
pub fn usage_table(rows: &[UsageRow]) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let line = |out: &mut String, c: [&str; 9]| {
        let _ = writeln!(
            out,
            "{:<16} {:<24} {:<16} {:>11} {:>11} {:>11} {:>11} {:>11} {:>11}",
            c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8]
        );
    };
    line(
        &mut out,
        [
            "NAMESPACE",
            "SERVICE",
            "TENANT",
            "COLD-START",
            "SERVING",
            "IDLE",
            "SLEEPING",
            "WARM-WINDOW",
            "TOTAL",
        ],
    );
    for r in rows {
        let n = [
            r.cold_start,
            r.serving,
            r.idle,
            r.sleeping,
            r.warm_window,
            r.total,
        ]
        .map(|s| format!("{s:.1}"));
        line(
            &mut out,
            [
                &r.namespace,
                &r.service,
                &r.tenant,
                &n[0],
                &n[1],
                &n[2],
                &n[3],
                &n[4],
                &n[5],
            ],
        );
    }
    out.push_str("(accelerator-seconds: extended-resource units times seconds)\n");
    out
}

/// The `app.kubernetes.io/component` of the ledger ConfigMaps.
pub const LEDGER_COMPONENT: &str = "accelerator-usage";

/// The ledgers of `namespace` (every namespace: `None`), of one `service` or all, as
/// `(namespace, service, ledger)`.
///
/// # Errors
/// The list failed, or a ledger does not parse (naming its ConfigMap).
pub async fn read_ledgers(
    client: &kube::Client,
    namespace: Option<&str>,
    service: Option<&str>,
) -> anyhow::Result<Vec<(String, String, Ledger)>> {
    use anyhow::Context as _;
    use kube::ResourceExt;
    let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> = match namespace {
        Some(ns) => kube::Api::namespaced(client.clone(), ns),
        None => kube::Api::all(client.clone()),
    };
    let label = hearth_crds::wellknown::LLMSERVICE_LABEL;
    let mut selector = format!("app.kubernetes.io/component={LEDGER_COMPONENT}");
    if let Some(s) = service {
        selector.push_str(&format!(",{label}={s}"));
    }
    let list = api
        .list(&kube::api::ListParams::default().labels(&selector))
        .await
        .with_context(|| format!("listing the usage ledgers (ConfigMaps labelled {selector})"))?;
    let mut out = Vec::new();
    for cm in &list.items {
        let Some(json) = cm.data.as_ref().and_then(|d| d.get(LEDGER_KEY)) else {
            continue;
        };
        let ledger: Ledger = serde_json::from_str(json)
            .with_context(|| format!("the ledger in ConfigMap {} does not parse", cm.name_any()))?;
        let service = cm
            .labels()
            .get(label)
            .cloned()
            .unwrap_or_else(|| cm.name_any());
        out.push((cm.namespace().unwrap_or_default(), service, ledger));
    }
    Ok(out)
}

#[cfg(test)]
mod tests;

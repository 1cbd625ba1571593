//! The timeline of an activation: a backend pod that turned Ready while its service had no ready
//! backend replica (a 0→1), split into phases from the pod, its kubelet Events and KEDA's.
//!
//! Pure functions; the reconciler (`reconcile::record_activation`) reads the pod cache, lists
//! the Events and writes the result as `status.lastActivation`, the `Activated` Event and
//! `hearth_activation_phase_seconds`.
//!
//! | phase | from | to |
//! |---|---|---|
//! | `scaleDecision` | KEDA's `KEDAScaleTargetActivated` Event on the ScaledObject | pod `creationTimestamp` |
//! | `waitingForDevices` | the scheduler's first `FailedScheduling` Event naming `Insufficient <r>` for an extended resource the pod requests | `PodScheduled` `lastTransitionTime` (absent when never refused so) |
//! | `scheduled` | pod `creationTimestamp` | `PodScheduled` condition `lastTransitionTime`, less `waitingForDevices` |
//! | `imagePull` | kubelet `Pulling` Event of the model container | its `Pulled` Event (the duration it states), 0 when the image was present |
//! | `containersStarted` | scheduled + image pull | the model container's `state.running.startedAt` |
//! | `modelReady` | `startedAt` | `Ready` condition `lastTransitionTime` |
//! | `total` | the scale decision (else pod creation) | `Ready` |
//!
//! Clock skew: the timestamps come from the apiserver, the scheduler, KEDA and the node's
//! kubelet. A phase that comes out negative is 0 (`scaleDecision` is 0 when KEDA's Event falls
//! inside the pod's creation second, which the whole-second timestamp truncates, and left out
//! when it is later), so the phases may then add up to more than `total`. Kubernetes timestamps have whole seconds; only
//! the image pull (the duration the kubelet writes into its `Pulled` message) and KEDA's Event
//! time (`eventTime`, microseconds) are finer.

use std::time::Duration;

use hearth_crds::{Activation, ActivationPhases, go_duration};
use k8s_openapi::{
    api::core::v1::{Event, Pod},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};

/// The reason of the Event KEDA records on a ScaledObject when it scales its target up from
/// zero (`eventreason.KEDAScaleTargetActivated` in KEDA's `pkg/eventreason`).
pub const KEDA_ACTIVATED: &str = "KEDAScaleTargetActivated";

/// How recently a pod must have turned Ready to count as an activation when the service's
/// status already reported a ready replica: the Deployment's ready count can reach the cache
/// before the pod's readiness does (two watches), and the status written meanwhile says 1.
pub const RECENT: Duration = Duration::from_secs(60);

/// The phases of one activation (see the module docs). Durations are never negative.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// The pod's name.
    pub pod: String,
    /// The pod's UID: the key that records an activation once.
    pub pod_uid: String,
    /// The node the pod was scheduled to.
    pub node: Option<String>,
    /// The scale decision when known, else the pod's creation.
    pub start: Timestamp,
    /// The pod's `Ready` transition.
    pub ready: Timestamp,
    /// `Some(true)`: the image was on the node; `Some(false)`: pulled; `None`: no kubelet Event.
    pub image_present: Option<bool>,
    /// KEDA's scale-up until the pod was created; `None` when unknown or negative.
    pub scale_decision: Option<Duration>,
    /// The scheduler's first verdict that no node had the pod's accelerator free until it
    /// was scheduled ([`waiting_for_devices`]); `None` when it never said so.
    pub waiting_for_devices: Option<Duration>,
    /// Created until scheduled, less `waiting_for_devices`.
    pub scheduled: Duration,
    /// The image pull; `None` when no kubelet Event says.
    pub image_pull: Option<Duration>,
    /// Scheduled and pulled until the model container started.
    pub containers_started: Duration,
    /// The model container started until the pod turned Ready.
    pub model_ready: Duration,
    /// `start` until `ready`.
    pub total: Duration,
}

/// `to − from`, or `None` when negative.
fn between(from: Timestamp, to: Timestamp) -> Option<Duration> {
    Duration::try_from(to.duration_since(from)).ok()
}

/// The `scaleDecision` phase: from KEDA's activation Event (`since`, microseconds) to the pod's
/// creation (`created`, whole seconds, truncated). An Event inside the pod's creation second
/// came before the pod as far as anyone can tell (the Deployment and ReplicaSet controllers
/// take milliseconds): 0. One later than that is skewed or belongs to something else: `None`.
fn scale_decision(since: Timestamp, created: Timestamp) -> Option<Duration> {
    match between(since, created) {
        Some(d) => Some(d),
        None => between(created, since)
            .filter(|ahead| *ahead < Duration::from_secs(1))
            .map(|_| Duration::ZERO),
    }
}

/// `to − from`, 0 when negative (clock skew).
fn clamped(from: Timestamp, to: Timestamp) -> Duration {
    between(from, to).unwrap_or(Duration::ZERO)
}

/// When the pod's condition `type_` turned `True`, if it is `True`.
pub fn condition_true_since(pod: &Pod, type_: &str) -> Option<Timestamp> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_ && c.status == "True")?
        .last_transition_time
        .as_ref()
        .map(|t| t.0)
}

/// When the pod turned Ready, if it is Ready and not being deleted.
pub fn ready_since(pod: &Pod) -> Option<Timestamp> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    condition_true_since(pod, "Ready")
}

/// The model container: the pod's first container (the rendered backend puts the serving
/// container first; policies add sidecars as init containers or after it).
fn main_container(pod: &Pod) -> Option<&str> {
    pod.spec
        .as_ref()?
        .containers
        .first()
        .map(|c| c.name.as_str())
}

/// The earliest time an Event says it happened: `eventTime` (events.k8s.io), else
/// `firstTimestamp` (core/v1), else its creation.
fn first_seen(e: &Event) -> Option<Timestamp> {
    e.event_time
        .as_ref()
        .map(|t| t.0)
        .or_else(|| e.first_timestamp.as_ref().map(|t| t.0))
        .or_else(|| e.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// The latest time an Event (or its series) says it happened.
fn last_seen(e: &Event) -> Option<Timestamp> {
    [
        e.series
            .as_ref()
            .and_then(|s| s.last_observed_time.as_ref())
            .map(|t| t.0),
        e.last_timestamp.as_ref().map(|t| t.0),
        first_seen(e),
    ]
    .into_iter()
    .flatten()
    .max()
}

/// The pull duration the kubelet writes into a `Pulled` message: `Successfully pulled image
/// "x" in 1.2s (3.4s including waiting). Image size: ...` gives 3.4 s (the wait for other pulls
/// is part of this pod's start), and older kubelets' `... in 1.2s` gives 1.2 s.
pub fn pulled_duration(message: &str) -> Option<Duration> {
    if let Some(end) = message.find(" including waiting)") {
        let start = message[..end].rfind('(')? + 1;
        return hearth_crds::parse_duration(&message[start..end]).ok();
    }
    let (_, after) = message.rsplit_once("\" in ")?;
    let token = after
        .split_whitespace()
        .next()?
        .trim_end_matches([',', '.']);
    hearth_crds::parse_duration(token).ok()
}

/// What the kubelet's Events say about the model container's image: `(present, pull)`.
fn image_pull(events: &[Event], container: &str) -> (Option<bool>, Option<Duration>) {
    let field_path = format!("spec.containers{{{container}}}");
    let mut of_container: Vec<&Event> = events
        .iter()
        .filter(|e| e.involved_object.field_path.as_deref() == Some(field_path.as_str()))
        .collect();
    of_container.sort_by_key(|e| first_seen(e));
    let reason = |r: &str| {
        of_container
            .iter()
            .find(|e| e.reason.as_deref() == Some(r))
            .copied()
    };
    let Some(pulled) = reason("Pulled") else {
        return (None, None);
    };
    let message = pulled.message.as_deref().unwrap_or_default();
    if message.contains("already present on machine") {
        return (Some(true), Some(Duration::ZERO));
    }
    if let Some(d) = pulled_duration(message) {
        return (Some(false), Some(d));
    }
    let from_events = reason("Pulling")
        .and_then(first_seen)
        .zip(first_seen(pulled))
        .map(|(from, to)| clamped(from, to));
    (Some(false), from_events)
}

/// When the scheduler first said no node had `pod`'s accelerator free: the earliest
/// `FailedScheduling` Event on the pod whose message names `Insufficient <r>` for an extended
/// resource `r` the pod requests (the same verdict [`crate::handover::waiting_for`] reads from
/// the pod's condition, which its scheduling overwrites).
pub fn devices_refused_at(pod: &Pod, events: &[Event]) -> Option<Timestamp> {
    let requested = crate::handover::requests(pod);
    events
        .iter()
        .filter(|e| e.reason.as_deref() == Some("FailedScheduling"))
        .filter(|e| {
            let m = e.message.as_deref().unwrap_or_default();
            requested
                .keys()
                .any(|r| m.contains(&format!("Insufficient {r}")))
        })
        .filter_map(first_seen)
        .min()
}

/// The timeline of `pod` turning Ready, with its kubelet `events` (core/v1, listed by
/// `involvedObject.uid`) and the time KEDA scaled its Deployment up
/// (`scaled_object_active_since`, see [`scaler_activated_at`]). `None` while the pod is not
/// Ready, is being deleted, or lacks its creation time, its `PodScheduled` condition or its
/// model container's start.
pub fn timeline(
    pod: &Pod,
    events: &[Event],
    scaled_object_active_since: Option<Timestamp>,
) -> Option<Timeline> {
    let created = pod.metadata.creation_timestamp.as_ref()?.0;
    let ready = ready_since(pod)?;
    let scheduled_at = condition_true_since(pod, "PodScheduled")?;
    let container = main_container(pod)?;
    let started = pod
        .status
        .as_ref()?
        .container_statuses
        .as_ref()?
        .iter()
        .find(|s| s.name == container)?
        .state
        .as_ref()?
        .running
        .as_ref()?
        .started_at
        .as_ref()?
        .0;
    let (image_present, image_pull) = image_pull(events, container);
    let scale_decision =
        scaled_object_active_since.and_then(|since| scale_decision(since, created));
    let start = match (scale_decision, scaled_object_active_since) {
        (Some(_), Some(since)) => since.min(created),
        _ => created,
    };
    let waiting_for_devices =
        devices_refused_at(pod, events).map(|since| clamped(since, scheduled_at));
    Some(Timeline {
        pod: pod.metadata.name.clone().unwrap_or_default(),
        pod_uid: pod.metadata.uid.clone().unwrap_or_default(),
        node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        start,
        ready,
        image_present,
        scale_decision,
        waiting_for_devices,
        scheduled: clamped(created, scheduled_at)
            .saturating_sub(waiting_for_devices.unwrap_or(Duration::ZERO)),
        image_pull,
        containers_started: clamped(scheduled_at, started)
            .saturating_sub(image_pull.unwrap_or(Duration::ZERO)),
        model_ready: clamped(started, ready),
        total: clamped(start, ready),
    })
}

/// When KEDA last scaled the service's Deployment up from zero, from the ScaledObject's
/// [`KEDA_ACTIVATED`] Events: the latest, if it is after `after` (the previous activation's
/// Ready time; an older one belongs to an earlier activation, or KEDA's recorder has not
/// written this one's series yet).
pub fn scaler_activated_at(events: &[Event], after: Option<Timestamp>) -> Option<Timestamp> {
    events
        .iter()
        .filter(|e| e.reason.as_deref() == Some(KEDA_ACTIVATED))
        .filter_map(last_seen)
        .max()
        .filter(|t| after.is_none_or(|a| *t > a))
}

/// The pod whose readiness is an activation still to record, among the service's backend
/// `pods` (from the cache): the Ready pod, not being deleted, that turned Ready first, when
///
/// - it is not the pod of `last` (an activation is recorded once per pod UID),
/// - it turned Ready after `last` did, and
/// - the service had no ready replica before it: the status written last said 0
///   (`replicas_before`), or it turned Ready less than [`RECENT`] before `now` (the Deployment's
///   ready count raced ahead of the pod's readiness into the caches).
///
/// A pod that turned Ready while another one was Ready is never the first, so scaling 1→2 or a
/// rolling update of a service with ready replicas records nothing.
pub fn activated<'a>(
    pods: impl IntoIterator<Item = &'a Pod>,
    last: Option<&Activation>,
    replicas_before: i32,
    now: Timestamp,
) -> Option<&'a Pod> {
    let (pod, ready) = pods
        .into_iter()
        .filter_map(|p| ready_since(p).map(|r| (p, r)))
        .min_by(|(a, ra), (b, rb)| {
            ra.cmp(rb)
                .then_with(|| a.metadata.name.cmp(&b.metadata.name))
        })?;
    if let Some(last) = last
        && (pod.metadata.uid.as_deref() == Some(last.pod_uid.as_str())
            || ready <= last.ready_time.0)
    {
        return None;
    }
    let recent = between(ready, now).is_none_or(|age| age < RECENT);
    (replicas_before == 0 || recent).then_some(pod)
}

/// Seconds with one decimal, for Event notes: `"34.2s"`.
fn short(d: Duration) -> String {
    format!("{:.1}s", d.as_secs_f64())
}

impl Timeline {
    /// `status.lastActivation`.
    pub fn to_status(&self) -> Activation {
        Activation {
            start_time: Time(self.start),
            ready_time: Time(self.ready),
            pod: self.pod.clone(),
            pod_uid: self.pod_uid.clone(),
            node: self.node.clone(),
            image_present: self.image_present,
            phases: ActivationPhases {
                scale_decision: self.scale_decision.map(go_duration),
                waiting_for_devices: self.waiting_for_devices.map(go_duration),
                scheduled: go_duration(self.scheduled),
                image_pull: self.image_pull.map(go_duration),
                containers_started: go_duration(self.containers_started),
                model_ready: go_duration(self.model_ready),
                total: go_duration(self.total),
            },
        }
    }

    /// `(phase, seconds)` for `hearth_activation_phase_seconds`: every known phase and `total`.
    pub fn phases(&self) -> Vec<(&'static str, f64)> {
        [
            ("scale_decision", self.scale_decision),
            ("waiting_for_devices", self.waiting_for_devices),
            ("scheduled", Some(self.scheduled)),
            ("image_pull", self.image_pull),
            ("containers_started", Some(self.containers_started)),
            ("model_ready", Some(self.model_ready)),
            ("total", Some(self.total)),
        ]
        .into_iter()
        .filter_map(|(name, d)| d.map(|d| (name, d.as_secs_f64())))
        .collect()
    }

    /// The note of the `Activated` Event: `0→1 in 34.2s: scale decision 0.3s, scheduled 0.1s,
    /// image present, containers started 1.2s, model ready 32.6s (pod NAME on node NODE)`.
    pub fn note(&self) -> String {
        let mut parts = Vec::new();
        if let Some(d) = self.scale_decision {
            parts.push(format!("scale decision {}", short(d)));
        }
        if let Some(d) = self.waiting_for_devices {
            parts.push(format!("waiting for devices {}", short(d)));
        }
        parts.push(format!("scheduled {}", short(self.scheduled)));
        match (self.image_present, self.image_pull) {
            (Some(true), _) => parts.push("image present".to_owned()),
            (_, Some(d)) => parts.push(format!("image pull {}", short(d))),
            _ => {}
        }
        parts.push(format!(
            "containers started {}",
            short(self.containers_started)
        ));
        parts.push(format!("model ready {}", short(self.model_ready)));
        let node = self
            .node
            .as_deref()
            .map(|n| format!(" on node {n}"))
            .unwrap_or_default();
        format!(
            "0→1 in {}: {} (pod {}{node})",
            short(self.total),
            parts.join(", "),
            self.pod
        )
    }
}

#[cfg(test)]
mod tests;

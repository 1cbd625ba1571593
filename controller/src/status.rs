//! Status: phase, conditions and replicas of an `LLMService`, computed from what the controller
//! observed. Pure functions, so the rules are unit-tested without a cluster.
//!
//! Condition semantics follow the Kubernetes API conventions (`metav1.Condition`): a
//! `lastTransitionTime` changes only when `status` changes, so an unchanged world produces a
//! byte-identical status and no write.

use hearth_crds::{
    LLMServicePhase, LLMServiceStatus,
    rules::{Finding, Findings},
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        batch::v1::Job,
        core::v1::{PersistentVolumeClaim, Pod},
    },
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
};
use kube::api::DynamicObject;

/// `Ready`: the service can take requests (a backend is ready, or it is scaled to zero with a
/// working gateway and autoscaler to wake it).
pub const READY: &str = "Ready";
/// `RuntimeResolved`: an InferenceRuntime was selected.
pub const RUNTIME_RESOLVED: &str = "RuntimeResolved";
/// `AutoscalingReady`: the KEDA ScaledObject exists and KEDA reports it Ready.
pub const AUTOSCALING_READY: &str = "AutoscalingReady";
/// `CacheReady`: the model cache is usable.
pub const CACHE_READY: &str = "CacheReady";
/// `Prewarmed`: the prewarm Job has downloaded the weights into the cache.
pub const PREWARMED: &str = "Prewarmed";
/// `Validated`: the spec passes the rules it is rendered by (`hearth_crds::rules`, the ones the
/// admission webhook applies). `True` with reason [`VALID`], or with a warning's reason (the
/// service is rendered; the message lists the warnings); `False` with the first error's reason
/// (nothing is rendered).
pub const VALIDATED: &str = "Validated";
/// `EndpointAccepted`: with `spec.endpoint.sharedEndpointRef`, whether the LLMEndpoint accepts
/// the service (reasons: [`hearth_crds::llmendpoint::AttachReason`]).
pub const ENDPOINT_ACCEPTED: &str = hearth_crds::llmendpoint::CONDITION_ENDPOINT_ACCEPTED;
/// `NetworkPolicyReady`: with the models' NetworkPolicies on (`--model-network-policies`),
/// whether the apiserver took them; absent when they are off.
pub const NETWORK_POLICY_READY: &str = "NetworkPolicyReady";
/// The `Validated=True` reason of a spec without findings.
pub const VALID: &str = "Valid";
/// `Ready=False` reason (and phase) while a backend pod waits for its accelerator; the device
/// handover's outcome is appended to the message (`crate::reconcile::handover`).
pub const WAITING_FOR_DEVICES: &str = "WaitingForDevices";

fn joined<'a>(findings: impl Iterator<Item = &'a Finding>) -> String {
    findings
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

/// `Validated` from the rule findings.
pub fn validated(findings: &Findings) -> Cond {
    if let Some(first) = findings.first_error() {
        return Cond::new(
            VALIDATED,
            Some(false),
            first.reason.as_str(),
            joined(findings.errors()),
        );
    }
    match findings.warnings().next() {
        Some(first) => Cond::new(
            VALIDATED,
            Some(true),
            first.reason.as_str(),
            format!("rendered, with warnings: {}", joined(findings.warnings())),
        ),
        None => Cond::new(
            VALIDATED,
            Some(true),
            VALID,
            "the spec passes the rules it is rendered by",
        ),
    }
}

/// The `False` conditions of rule errors, which keep the service from being rendered: cache
/// errors under `CacheReady` (reason `StrategyNotImplemented`), the others
/// under `Ready` with the first one's reason; `Ready=False` `CacheNotReady` when only the cache
/// is wrong.
pub fn rule_errors(findings: &Findings) -> Vec<Cond> {
    let is_cache = |f: &&Finding| f.reason.condition_type() == CACHE_READY;
    let mut conds = Vec::new();
    let cache: Vec<&Finding> = findings.errors().filter(is_cache).collect();
    if let Some(first) = cache.first() {
        conds.push(Cond::new(
            CACHE_READY,
            Some(false),
            first.reason.as_str(),
            joined(cache.iter().copied()),
        ));
    }
    let other: Vec<&Finding> = findings.errors().filter(|f| !is_cache(f)).collect();
    conds.push(match other.first() {
        Some(first) => Cond::new(
            READY,
            Some(false),
            first.reason.as_str(),
            joined(other.iter().copied()),
        ),
        None => Cond::new(
            READY,
            Some(false),
            "CacheNotReady",
            "see the CacheReady condition",
        ),
    });
    conds
}

/// A condition before timestamps: what the reconciler decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cond {
    /// Condition type.
    pub type_: &'static str,
    /// `"True"`, `"False"` or `"Unknown"`.
    pub status: &'static str,
    /// PascalCase reason.
    pub reason: String,
    /// Human message saying what to do when not True.
    pub message: String,
}

impl Cond {
    /// Builds a condition.
    pub fn new(
        type_: &'static str,
        ok: Option<bool>,
        reason: &str,
        message: impl Into<String>,
    ) -> Self {
        Self {
            type_,
            status: match ok {
                Some(true) => "True",
                Some(false) => "False",
                None => "Unknown",
            },
            reason: reason.to_owned(),
            message: message.into(),
        }
    }

    /// Whether the condition is True.
    pub fn is_true(&self) -> bool {
        self.status == "True"
    }
}

/// Turns decided conditions into `metav1.Condition`s, keeping `lastTransitionTime` from
/// `previous` when the status did not change. Output order is the order of `conds`.
pub fn merge_conditions(
    previous: &[Condition],
    conds: &[Cond],
    generation: Option<i64>,
    now: &Time,
) -> Vec<Condition> {
    conds
        .iter()
        .map(|c| {
            let last = previous
                .iter()
                .find(|p| p.type_ == c.type_ && p.status == c.status)
                .map(|p| p.last_transition_time.clone())
                .unwrap_or_else(|| now.clone());
            Condition {
                type_: c.type_.to_owned(),
                status: c.status.to_owned(),
                reason: c.reason.clone(),
                message: c.message.clone(),
                observed_generation: generation,
                last_transition_time: last,
            }
        })
        .collect()
}

/// The backend's replica picture from its Deployment (and its pods, [`BackendState::with_pods`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendState {
    /// Whether the Deployment exists.
    pub exists: bool,
    /// `spec.replicas` (what KEDA asked for).
    pub desired: i32,
    /// `status.readyReplicas`.
    pub ready: i32,
    /// What the Deployment says keeps pods from coming up ([`deployment_failure`]).
    pub stuck: Option<Failure>,
    /// A backend pod that cannot come up, from [`pod_failure`].
    pub failing: Option<Failure>,
    /// A backend pod the scheduler cannot place for lack of its accelerator
    /// ([`crate::handover::waiting_for`]): `pod P: <the scheduler's message>`.
    pub waiting_for_devices: Option<String>,
    /// The Deployment's current template has no pod yet: its controller has not observed the
    /// latest spec (`status.observedGeneration` below `metadata.generation`), or none of its
    /// pods has the template (`status.updatedReplicas` 0 while it has pods, unless paused).
    /// The pods there are an earlier template's, about to be replaced: what keeps them from
    /// coming up is no longer the answer (a corrected runtime is not answered with the old
    /// failure). A change of it triggers a reconcile (the Deployment watch's filter).
    pub template_pending: bool,
    /// The ReplicaSet of the current template, as the Deployment controller names it in the
    /// `Progressing` condition (`ReplicaSet "N-<hash>" is progressing.`, `... has successfully
    /// progressed.`, `Created new replica set "..."`, ...); `None` when it names none (paused).
    /// Only its pods are diagnosed: the pod cache may still hold an older template's pod
    /// after the Deployment's status already counts the new one.
    pub current_replica_set: Option<String>,
}

/// Why a backend cannot come up: one of [`hearth_crds::ACTIVATION_FAILED_REASONS`], which
/// becomes `Ready=False` with that reason, phase `Degraded`, a Warning Event, and
/// `status.lastActivationFailure`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Failure {
    /// The `Ready` reason.
    pub reason: &'static str,
    /// The pod it was read from; `None` when from the Deployment.
    pub pod: Option<String>,
    /// The activation phase it stopped in (`crate::activation`'s names).
    pub phase: &'static str,
    /// What the kubelet, the scheduler or the Deployment said, and what to change.
    pub message: String,
}

impl Failure {
    /// The record in `status.lastActivationFailure`: `previous` when it is about the same pod
    /// and reason (its time kept), else a new one at `now`.
    pub fn record(
        &self,
        previous: Option<&hearth_crds::ActivationFailure>,
        now: &Time,
    ) -> hearth_crds::ActivationFailure {
        if let Some(p) = previous
            && p.pod == self.pod
            && p.reason == self.reason
        {
            return p.clone();
        }
        hearth_crds::ActivationFailure {
            time: now.clone(),
            pod: self.pod.clone(),
            phase: self.phase.to_owned(),
            reason: self.reason.to_owned(),
            message: self.message.chars().take(1024).collect(),
        }
    }
}

/// Waiting reasons of a container whose image cannot be had (`kubelet/images`' errors).
const IMAGE_WAITING_REASONS: &[&str] = &[
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "ErrImageNeverPull",
];

/// Waiting reasons of a container the runtime cannot create or start without a change to the
/// pod (`kubelet/container`'s `ErrCreateContainer`, `ErrRunContainer`, ...): `BackendFailing`.
/// `ContainerCreating` and `PodInitializing` are progress, not failures.
const CREATE_WAITING_REASONS: &[&str] = &[
    "CreateContainerError",
    "CreateContainerConfigError",
    "RunContainerError",
];

/// The kubelet's waiting reason between the restarts of a container that keeps ending.
const CRASH_LOOP_BACK_OFF: &str = "CrashLoopBackOff";

/// A kubelet or scheduler message bounded to about 300 characters: a whole runtime error chain
/// can be long, and its root cause (`401 Unauthorized`, `not found`) is at its end, so a longer
/// one keeps its first 140 and last 150 characters around ` … `.
fn bounded(message: &str) -> String {
    const HEAD: usize = 140;
    const TAIL: usize = 150;
    let n = message.chars().count();
    if n <= HEAD + TAIL + 10 {
        return message.to_owned();
    }
    let head: String = message.chars().take(HEAD).collect();
    let tail: String = message.chars().skip(n - TAIL).collect();
    format!("{head} … {tail}")
}

/// Why `pod` cannot come up (see [`hearth_crds::ACTIVATION_FAILED_REASONS`]), checked in the
/// order of its life: the scheduler's `Unschedulable` (other than for the accelerator, which a
/// device handover may free: [`crate::handover::waiting_for`]), then each container (init
/// containers first) restarting after its last run ended, or waiting for a reason it will not
/// get past. A pod being deleted or Ready is not failing.
pub fn pod_failure(pod: &Pod) -> Option<Failure> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let conditions = status.conditions.iter().flatten();
    let mut ready = false;
    for c in conditions {
        if c.type_ == "Ready" && c.status == "True" {
            ready = true;
        }
        if c.type_ == "PodScheduled"
            && c.status == "False"
            && c.reason.as_deref() == Some("Unschedulable")
            && crate::handover::waiting_for(pod).is_none()
        {
            let said = bounded(c.message.as_deref().unwrap_or_default());
            return Some(Failure {
                reason: "Unschedulable",
                pod: Some(pod_name.clone()),
                phase: "scheduled",
                message: format!(
                    "pod {pod_name}: {said} (the runtime's nodeSelector, tolerations and affinity, and the service's resources, must fit a node)"
                ),
            });
        }
    }
    if ready {
        return None;
    }
    let statuses = status
        .init_container_statuses
        .iter()
        .flatten()
        .chain(status.container_statuses.iter().flatten());
    for c in statuses {
        let waiting = c.state.as_ref().and_then(|s| s.waiting.as_ref());
        let waiting_reason = waiting.and_then(|w| w.reason.as_deref());
        let running = c.state.as_ref().is_some_and(|s| s.running.is_some());
        let restarting = waiting_reason == Some(CRASH_LOOP_BACK_OFF)
            || (running && !c.ready && c.restart_count >= 2);
        let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
        if restarting && let Some(t) = last {
            let ended = t.reason.as_deref().unwrap_or("Error");
            let (reason, hint) = match (ended, t.exit_code) {
                ("OOMKilled", _) => (
                    "OOMKilled",
                    "the container passed its memory limit: raise the service's spec.resources.memory, or lower the engine's memory use",
                ),
                (_, 137 | 143) => (
                    "RepeatedTermination",
                    "the container was killed, not exited: a failing startup or liveness probe (the runtime's health), or a signal from the node; see kubectl describe pod",
                ),
                _ => (
                    "CrashLoopBackOff",
                    "the container exited by itself: kubectl logs --previous shows why",
                ),
            };
            let said = t
                .message
                .as_deref()
                .map(|m| format!(": {}", bounded(m.trim())))
                .unwrap_or_default();
            return Some(Failure {
                reason,
                pod: Some(pod_name.clone()),
                phase: "modelReady",
                message: format!(
                    "pod {pod_name}, container {}: restarted {} times, last ended {ended} (exit code {}){said}; {hint}",
                    c.name, c.restart_count, t.exit_code
                ),
            });
        }
        let Some(waiting_reason) = waiting_reason else {
            continue;
        };
        let (reason, phase) = if IMAGE_WAITING_REASONS.contains(&waiting_reason) {
            ("ImagePullFailed", "imagePull")
        } else if CREATE_WAITING_REASONS.contains(&waiting_reason) {
            ("BackendFailing", "containersStarted")
        } else if waiting_reason == CRASH_LOOP_BACK_OFF {
            ("CrashLoopBackOff", "modelReady")
        } else {
            continue;
        };
        let said = bounded(
            waiting
                .and_then(|w| w.message.as_deref())
                .unwrap_or_default(),
        );
        return Some(Failure {
            reason,
            pod: Some(pod_name.clone()),
            phase,
            message: format!(
                "pod {pod_name}, container {}: {waiting_reason}: {said} (kubectl describe pod shows the kubelet's Events)",
                c.name
            ),
        });
    }
    None
}

/// The kubelet's Event reason for a failed image pull (`events.FailedToPullImage`; also used
/// for other container errors, told apart by the message).
pub const PULL_FAILED_EVENT_REASON: &str = "Failed";

/// The pod UID and message of a kubelet Warning Event saying an image pull failed (`reason:
/// Failed`, `Failed to pull image "...": ...`). The kubelet sends it at once, while the pod's
/// status says `ErrImagePull` only after its pod worker's back-off (about 10 s): the Event makes
/// the diagnosis that much sooner ([`pull_failed`]).
pub fn pull_failure_event(e: &k8s_openapi::api::core::v1::Event) -> Option<(String, String)> {
    let o = &e.involved_object;
    if e.type_.as_deref() != Some("Warning")
        || e.reason.as_deref() != Some(PULL_FAILED_EVENT_REASON)
        || o.kind.as_deref() != Some("Pod")
    {
        return None;
    }
    let message = e.message.as_deref()?;
    if !message.starts_with("Failed to pull image") {
        return None;
    }
    Some((o.uid.clone()?, message.to_owned()))
}

/// `ImagePullFailed` for `pod` from the kubelet's Event `message` ([`pull_failure_event`])
/// while its status does not say so yet: no container of it is running, it is not Ready and
/// not being deleted. A pull that succeeds on a retry starts the container, which ends it.
pub fn pull_failed(pod: &Pod, message: &str) -> Option<Failure> {
    if pod.metadata.deletion_timestamp.is_some() {
        return None;
    }
    let status = pod.status.as_ref()?;
    let running = status
        .container_statuses
        .iter()
        .flatten()
        .any(|c| c.ready || c.state.as_ref().is_some_and(|s| s.running.is_some()));
    if running {
        return None;
    }
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    Some(Failure {
        reason: "ImagePullFailed",
        pod: Some(pod_name.clone()),
        phase: "imagePull",
        message: format!(
            "pod {pod_name}: {} (the kubelet's Event; the runtime's container.image, or the pull secret)",
            bounded(message)
        ),
    })
}

/// `FailedCreate` when Deployment `d` says `ReplicaFailure=True`: the apiserver refused its
/// ReplicaSet's pods (a namespace's Pod Security level, a ResourceQuota, a LimitRange or an
/// admission webhook), with the refusal's message; `what` names the pods ("the backend's").
fn replica_failure(d: &Deployment, what: &str) -> Option<Failure> {
    let c = deployment_condition(d, "ReplicaFailure").filter(|c| c.status == "True")?;
    let said = bounded(c.message.as_deref().unwrap_or_default());
    Some(Failure {
        reason: "FailedCreate",
        pod: None,
        phase: "scaleDecision",
        message: format!(
            "{what} pods cannot be created: {said} (a namespace's Pod Security level, a ResourceQuota, a LimitRange or an admission webhook refuses them; see docs/operations.md)"
        ),
    })
}

/// What the backend Deployment says keeps its pods from coming up: `ReplicaFailure=True`
/// (`FailedCreate`, [`replica_failure`]) or `Progressing=False` (`ProgressDeadlineExceeded`).
pub fn deployment_failure(d: &Deployment) -> Option<Failure> {
    if let Some(f) = replica_failure(d, "the backend's") {
        return Some(f);
    }
    let conditions = d.status.as_ref()?.conditions.as_ref()?;
    conditions
        .iter()
        .find(|c| c.type_ == "Progressing" && c.status == "False")
        .map(|c| Failure {
            reason: "ProgressDeadlineExceeded",
            pod: None,
            phase: "modelReady",
            message: format!(
                "backend pods are not becoming ready within the Deployment's progress deadline: {} (kubectl describe on the backend Deployment's pods says why)",
                bounded(c.message.as_deref().unwrap_or_default())
            ),
        })
}

impl BackendState {
    /// Reads a backend Deployment.
    pub fn of(deployment: Option<&Deployment>) -> Self {
        let Some(d) = deployment else {
            return Self::default();
        };
        let status = d.status.as_ref();
        let unobserved = matches!(
            (d.metadata.generation, status.and_then(|s| s.observed_generation)),
            (Some(g), Some(o)) if o < g
        );
        let pods = status.and_then(|s| s.replicas).unwrap_or(0);
        let updated = status.and_then(|s| s.updated_replicas).unwrap_or(0);
        // A paused Deployment makes no pod of a new template: its pods are the answer.
        let paused = d.spec.as_ref().and_then(|s| s.paused).unwrap_or(false);
        Self {
            exists: true,
            desired: d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1),
            ready: status.and_then(|s| s.ready_replicas).unwrap_or(0),
            stuck: deployment_failure(d),
            failing: None,
            waiting_for_devices: None,
            template_pending: unobserved || (pods > 0 && updated == 0 && !paused),
            current_replica_set: current_replica_set(d),
        }
    }

    /// Adds why the newest of the backend's `pods` not being deleted cannot come up
    /// ([`pod_failure`], else an image pull the kubelet's Event in `pulls` (pod UID → message)
    /// says failed, [`pull_failed`]): it is the current attempt (during a rollout it has the
    /// current template, and older pods wait for it); none while the current template has no
    /// pod yet ([`BackendState::template_pending`]). And the first pod waiting for devices
    /// ([`crate::handover::waiting_for`]).
    pub fn with_pods<'a>(
        mut self,
        pods: impl IntoIterator<Item = &'a Pod>,
        pulls: &std::collections::HashMap<String, String>,
    ) -> Self {
        let pods: Vec<&Pod> = pods.into_iter().collect();
        let current = |p: &Pod| {
            self.current_replica_set.as_deref().is_none_or(|rs| {
                p.metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.kind == "ReplicaSet" && o.name == rs)
            })
        };
        let newest = pods
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && current(p))
            .max_by(|a, b| {
                a.metadata
                    .creation_timestamp
                    .cmp(&b.metadata.creation_timestamp)
            });
        self.failing = newest.filter(|_| !self.template_pending).and_then(|p| {
            pod_failure(p).or_else(|| {
                let uid = p.metadata.uid.as_deref()?;
                pull_failed(p, pulls.get(uid)?)
            })
        });
        self.waiting_for_devices = pods.iter().find_map(|p| {
            crate::handover::waiting_for(p).map(|w| format!("pod {}: {}", w.pod, w.message))
        });
        self
    }

    /// Why no replica comes up, when none is ready: what the Deployment says, else the first
    /// failing pod's. The same precedence as [`phase_and_ready`].
    pub fn failure(&self) -> Option<&Failure> {
        if self.ready > 0 {
            return None;
        }
        self.stuck.as_ref().or(self.failing.as_ref())
    }
}

/// The ReplicaSet the Deployment controller names in `d`'s `Progressing` condition: the one of
/// its current template (the controller's `Created new replica set %q`, `Found new replica set
/// %q`, `ReplicaSet %q is progressing.`, `ReplicaSet %q has successfully progressed.`,
/// `ReplicaSet %q has timed out progressing.`).
fn current_replica_set(d: &Deployment) -> Option<String> {
    let c = deployment_condition(d, "Progressing")?;
    let reason = c.reason.as_deref()?;
    if !matches!(
        reason,
        "NewReplicaSetCreated"
            | "FoundNewReplicaSet"
            | "ReplicaSetUpdated"
            | "NewReplicaSetAvailable"
            | "ProgressDeadlineExceeded"
    ) {
        return None;
    }
    let message = c.message.as_deref()?;
    let (_, rest) = message.split_once('"')?;
    let (name, _) = rest.split_once('"')?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// The condition `type_` of Deployment `d`'s status.
fn deployment_condition<'a>(
    d: &'a Deployment,
    type_: &str,
) -> Option<&'a k8s_openapi::api::apps::v1::DeploymentCondition> {
    d.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == type_)
}

/// Ready replicas of the gateway Deployment.
pub fn gateway_ready(deployment: Option<&Deployment>) -> i32 {
    deployment
        .and_then(|d| d.status.as_ref())
        .and_then(|s| s.ready_replicas)
        .unwrap_or(0)
}

/// The gateway's picture from its Deployment (a service's own, or its endpoint's).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GatewayState {
    /// `status.readyReplicas`.
    pub ready: i32,
    /// Its pods refused by admission (`FailedCreate`, see [`replica_failure`]).
    pub stuck: Option<Failure>,
}

impl GatewayState {
    /// Reads the gateway Deployment.
    pub fn of(deployment: Option<&Deployment>) -> Self {
        Self {
            ready: gateway_ready(deployment),
            stuck: deployment.and_then(|d| replica_failure(d, "the gateway's")),
        }
    }

    /// A gateway with `ready` ready replicas and nothing refused.
    pub fn ready(ready: i32) -> Self {
        Self { ready, stuck: None }
    }
}

/// `AutoscalingReady` from KEDA's presence and the ScaledObject's own `Ready` condition.
pub fn autoscaling(keda_installed: bool, scaled_object: Option<&DynamicObject>) -> Cond {
    if !keda_installed {
        return Cond::new(
            AUTOSCALING_READY,
            Some(false),
            "KEDANotInstalled",
            "KEDA is not installed (its ScaledObject CRD is missing): install KEDA >= 2.17 (docs/versioning.md); the ScaledObject is created as soon as the CRD appears, without a restart",
        );
    }
    let Some(so) = scaled_object else {
        return Cond::new(
            AUTOSCALING_READY,
            None,
            "ScaledObjectPending",
            "the KEDA ScaledObject is being created",
        );
    };
    let ready = so.data["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"));
    match ready {
        Some(c) if c["status"] == "True" => Cond::new(
            AUTOSCALING_READY,
            Some(true),
            "ScaledObjectReady",
            "KEDA reports the ScaledObject Ready",
        ),
        Some(c) if c["status"] == "False" => Cond::new(
            AUTOSCALING_READY,
            Some(false),
            "ScaledObjectNotReady",
            format!(
                "KEDA reports the ScaledObject not Ready: {} ({})",
                c["message"].as_str().unwrap_or(""),
                c["reason"].as_str().unwrap_or("")
            ),
        ),
        _ => Cond::new(
            AUTOSCALING_READY,
            None,
            "ScaledObjectPending",
            "waiting for KEDA to report on the ScaledObject",
        ),
    }
}

/// Adds to a poll-mode service's `AutoscalingReady` message what an older KEDA changes: without
/// endpoint aggregation ([`crate::versions::KEDA_ENDPOINT_AGGREGATION`]) its trigger asks one
/// gateway replica for the demand summed over its peers. Nothing for a KEDA that aggregates.
pub fn note_keda_version(cond: &mut Cond, keda: &crate::versions::KedaVersion) {
    let Some(v) = keda.get().filter(|_| !keda.aggregates_endpoints()) else {
        return;
    };
    cond.message = format!(
        "{}; KEDA {v} cannot sum a trigger over the gateway's replicas (aggregateFromKubeServiceEndpoints needs KEDA >= {}): the poll trigger asks one replica for the demand summed over its peers; upgrade KEDA, or use push mode (serving.hearth.dev/scaler: push)",
        cond.message,
        crate::versions::KEDA_ENDPOINT_AGGREGATION
    );
}

/// `CacheReady` for a NodeLocalPVC or SharedPVC claim.
pub fn cache_claim(claim: Option<&PersistentVolumeClaim>, name: &str) -> Cond {
    match claim
        .and_then(|c| c.status.as_ref())
        .and_then(|s| s.phase.as_deref())
    {
        Some("Bound") => Cond::new(
            CACHE_READY,
            Some(true),
            "Bound",
            format!("PersistentVolumeClaim {name} is Bound"),
        ),
        Some("Lost") => Cond::new(
            CACHE_READY,
            Some(false),
            "ClaimLost",
            format!(
                "PersistentVolumeClaim {name} lost its volume: delete the claim so it is recreated"
            ),
        ),
        // WaitForFirstConsumer classes bind when the first pod (prewarm or backend) schedules.
        _ => Cond::new(
            CACHE_READY,
            Some(false),
            "Pending",
            format!(
                "PersistentVolumeClaim {name} is not bound yet (node-local classes bind when the first pod is scheduled)"
            ),
        ),
    }
}

/// `Prewarmed` from the prewarm Job.
pub fn prewarm(job: Option<&Job>, name: &str) -> Cond {
    let Some(job) = job.filter(|j| j.status.is_some()) else {
        return Cond::new(
            PREWARMED,
            Some(false),
            "Downloading",
            format!("prewarm Job {name} is starting"),
        );
    };
    match job_state(job) {
        JobState::Succeeded => Cond::new(
            PREWARMED,
            Some(true),
            "Downloaded",
            format!("prewarm Job {name} downloaded the model into the cache"),
        ),
        JobState::Failed(why) => Cond::new(
            PREWARMED,
            Some(false),
            "PrewarmFailed",
            format!(
                "prewarm Job {name} failed ({why}): see `kubectl logs job/{name}`, fix the cause (source, credentials, disk) and delete the Job to retry"
            ),
        ),
        JobState::Running => Cond::new(
            PREWARMED,
            Some(false),
            "Downloading",
            format!("prewarm Job {name} is downloading the model"),
        ),
    }
}

/// Where a Job is: running (or not started), succeeded (a pod completed), or failed (its
/// `Failed` condition, with the condition's message or reason).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobState {
    /// Not finished yet.
    Running,
    /// `status.succeeded` > 0.
    Succeeded,
    /// The `Failed` condition is `True`: its message (or reason).
    Failed(String),
}

/// The [`JobState`] of `job` from its status.
pub fn job_state(job: &Job) -> JobState {
    let Some(status) = job.status.as_ref() else {
        return JobState::Running;
    };
    if status.succeeded.unwrap_or(0) > 0 {
        return JobState::Succeeded;
    }
    let failed = status.conditions.as_ref().and_then(|cs| {
        cs.iter()
            .find(|c| c.type_ == "Failed" && c.status == "True")
    });
    match failed {
        Some(c) => JobState::Failed(
            c.message
                .as_deref()
                .unwrap_or(c.reason.as_deref().unwrap_or("no reason"))
                .to_owned(),
        ),
        None => JobState::Running,
    }
}

/// Phase and `Ready` from the backend, gateway and the other conditions.
pub fn phase_and_ready(
    backend: BackendState,
    gateway: &GatewayState,
    others: &[Cond],
) -> (LLMServicePhase, Cond) {
    let gateway_ready = gateway.ready;
    let failed = |t: &str, r: &str| others.iter().any(|c| c.type_ == t && c.reason == r);
    let autoscaling_ok = others
        .iter()
        .any(|c| c.type_ == AUTOSCALING_READY && c.is_true());
    if failed(PREWARMED, "PrewarmFailed") {
        return (
            LLMServicePhase::Degraded,
            Cond::new(
                READY,
                Some(false),
                "PrewarmFailed",
                "the prewarm Job failed; see the Prewarmed condition",
            ),
        );
    }
    if !backend.exists {
        return (
            LLMServicePhase::Pending,
            Cond::new(
                READY,
                Some(false),
                "Creating",
                "the backend Deployment is being created",
            ),
        );
    }
    // No gateway can come up: nothing reaches the model, whatever the backend does.
    if let Some(f) = gateway.stuck.as_ref().filter(|_| gateway_ready == 0) {
        return (
            LLMServicePhase::Degraded,
            Cond::new(READY, Some(false), f.reason, f.message.clone()),
        );
    }
    if backend.ready > 0 {
        let ready = if gateway_ready > 0 {
            Cond::new(
                READY,
                Some(true),
                "BackendReady",
                format!("{} backend replica(s) ready", backend.ready),
            )
        } else {
            Cond::new(
                READY,
                Some(false),
                "GatewayNotReady",
                "no gateway replica is ready yet",
            )
        };
        return (LLMServicePhase::Ready, ready);
    }
    if let Some(f) = backend.failure() {
        return (
            LLMServicePhase::Degraded,
            Cond::new(READY, Some(false), f.reason, f.message.clone()),
        );
    }
    if backend.desired == 0 {
        let ready = if gateway_ready == 0 {
            Cond::new(
                READY,
                Some(false),
                "GatewayNotReady",
                "no gateway replica is ready yet",
            )
        } else if !autoscaling_ok {
            Cond::new(
                READY,
                Some(false),
                "AutoscalingNotReady",
                "scaled to zero, and nothing can wake the backend until autoscaling is ready; see AutoscalingReady",
            )
        } else {
            Cond::new(
                READY,
                Some(true),
                "ScaledToZero",
                "no backend replica runs; the next request starts one",
            )
        };
        return (LLMServicePhase::ScaledToZero, ready);
    }
    if let Some(why) = &backend.waiting_for_devices {
        return (
            LLMServicePhase::WaitingForDevices,
            Cond::new(
                READY,
                Some(false),
                WAITING_FOR_DEVICES,
                format!("the scheduler finds no node with the accelerator free ({why})"),
            ),
        );
    }
    (
        LLMServicePhase::Loading,
        Cond::new(
            READY,
            Some(false),
            "BackendLoading",
            "a backend replica is starting and loading the model",
        ),
    )
}

/// Whether the controller's part of two statuses differs: everything but `lastWake`, which the
/// gateway writes under its own field manager, and `usage`, the meter's (timestamps of
/// unchanged conditions are already preserved by [`merge_conditions`]).
pub fn differs(current: Option<&LLMServiceStatus>, desired: &LLMServiceStatus) -> bool {
    let Some(current) = current else {
        return true;
    };
    let ours = |s: &LLMServiceStatus| LLMServiceStatus {
        last_wake: None,
        usage: None,
        ..s.clone()
    };
    ours(current) != ours(desired)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: i64) -> Time {
        Time(k8s_openapi::jiff::Timestamp::from_second(secs).unwrap())
    }

    #[test]
    fn the_gateways_last_wake_is_not_a_difference() {
        let desired = LLMServiceStatus {
            replicas: Some(1),
            ..Default::default()
        };
        let current = LLMServiceStatus {
            last_wake: Some(hearth_crds::Wake {
                start_time: t(10),
                ready_time: t(11),
                endpoint: "198.18.0.7:8000".to_owned(),
                level: 1,
                gateway: None,
                phases: Default::default(),
            }),
            ..desired.clone()
        };
        assert!(!differs(Some(&current), &desired));
        assert!(differs(None, &desired));
        let fewer = LLMServiceStatus {
            replicas: Some(0),
            ..current
        };
        assert!(differs(Some(&fewer), &desired));
    }

    #[test]
    fn transition_time_moves_only_on_status_change() {
        // Ready set to `ready` (with `reason` and `message`) at `secs`, over `previous`.
        let ready_at = |previous: &[Condition], ready, reason, message, secs| {
            let cond = Cond::new(READY, Some(ready), reason, message);
            merge_conditions(previous, &[cond], Some(1), &t(secs))
        };
        let first = ready_at(&[], false, "Creating", "x", 10);
        let same = ready_at(&first, false, "BackendLoading", "y", 20);
        assert_eq!(same[0].last_transition_time, t(10));
        let flipped = ready_at(&same, true, "BackendReady", "z", 30);
        assert_eq!(flipped[0].last_transition_time, t(30));
    }

    fn autoscaling_ok() -> Vec<Cond> {
        vec![Cond::new(
            AUTOSCALING_READY,
            Some(true),
            "ScaledObjectReady",
            "",
        )]
    }

    /// A backend pod whose model container waits with `reason`.
    fn waiting_pod(reason: &str) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "m-0"},
            "status": {"containerStatuses": [{
                "name": "vllm", "image": "x", "imageID": "", "ready": false, "restartCount": 0,
                "state": {"waiting": {"reason": reason, "message": "failed to mkdir \"\""}},
            }]},
        }))
        .unwrap()
    }

    #[test]
    fn phases() {
        let b = |exists, desired, ready| BackendState {
            exists,
            desired,
            ready,
            ..Default::default()
        };
        assert_eq!(
            phase_and_ready(b(false, 0, 0), &GatewayState::ready(1), &[]).0,
            LLMServicePhase::Pending
        );
        let (p, r) = phase_and_ready(b(true, 0, 0), &GatewayState::ready(1), &autoscaling_ok());
        assert_eq!((p, r.is_true()), (LLMServicePhase::ScaledToZero, true));
        let (p, r) = phase_and_ready(b(true, 0, 0), &GatewayState::ready(1), &[]);
        assert_eq!(
            (p, r.reason.as_str()),
            (LLMServicePhase::ScaledToZero, "AutoscalingNotReady")
        );
        assert_eq!(
            phase_and_ready(b(true, 1, 0), &GatewayState::ready(1), &[]).0,
            LLMServicePhase::Loading
        );
        let (p, r) = phase_and_ready(b(true, 1, 1), &GatewayState::ready(1), &[]);
        assert_eq!((p, r.is_true()), (LLMServicePhase::Ready, true));
        let deadline: Deployment = serde_json::from_value(serde_json::json!({
            "spec": {"replicas": 1},
            "status": {"conditions": [{"type": "Progressing", "status": "False",
                "reason": "ProgressDeadlineExceeded",
                "message": "ReplicaSet \"m-1\" has timed out progressing."}]},
        }))
        .unwrap();
        let (p, r) = phase_and_ready(
            BackendState::of(Some(&deadline)),
            &GatewayState::ready(1),
            &[],
        );
        assert_eq!(
            (p, r.reason.as_str()),
            (LLMServicePhase::Degraded, "ProgressDeadlineExceeded")
        );
        let failing =
            b(true, 1, 0).with_pods([&waiting_pod("CreateContainerError")], &Default::default());
        let (p, r) = phase_and_ready(failing, &GatewayState::ready(1), &autoscaling_ok());
        assert_eq!(
            (p, r.reason.as_str(), r.message.as_str()),
            (
                LLMServicePhase::Degraded,
                "BackendFailing",
                "pod m-0, container vllm: CreateContainerError: failed to mkdir \"\" (kubectl describe pod shows the kubelet's Events)"
            )
        );
        let creating =
            b(true, 1, 0).with_pods([&waiting_pod("ContainerCreating")], &Default::default());
        assert_eq!(
            phase_and_ready(creating, &GatewayState::ready(1), &[]).0,
            LLMServicePhase::Loading
        );
        let unschedulable: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "m-1"},
            "spec": {"containers": [{"name": "vllm",
                "resources": {"limits": {"hearth.dev/fake-gpu": "1"}}}]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled",
                "status": "False", "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient hearth.dev/fake-gpu."}]},
        }))
        .unwrap();
        let waiting = b(true, 1, 0).with_pods([&unschedulable], &Default::default());
        let (p, r) = phase_and_ready(waiting, &GatewayState::ready(1), &autoscaling_ok());
        assert_eq!(
            (p, r.reason.as_str(), r.message.as_str()),
            (
                LLMServicePhase::WaitingForDevices,
                WAITING_FOR_DEVICES,
                "the scheduler finds no node with the accelerator free (pod m-1: 0/1 nodes are available: 1 Insufficient hearth.dev/fake-gpu.)"
            )
        );
        let refused: Deployment = serde_json::from_value(serde_json::json!({
            "spec": {"replicas": 1},
            "status": {"conditions": [{"type": "ReplicaFailure", "status": "True",
                "reason": "FailedCreate",
                "message": "pods \"m-1-x\" is forbidden: violates PodSecurity \"restricted:latest\": runAsNonRoot != true"}]},
        }))
        .unwrap();
        let (p, r) = phase_and_ready(
            BackendState::of(Some(&refused)),
            &GatewayState::ready(1),
            &[],
        );
        assert_eq!(
            (p, r.reason.as_str()),
            (LLMServicePhase::Degraded, "FailedCreate")
        );
        assert!(r.message.contains("violates PodSecurity"), "{}", r.message);
        // An older KEDA is named on a poll service's AutoscalingReady; a current one is not.
        let mut c = Cond::new(
            AUTOSCALING_READY,
            Some(true),
            "ScaledObjectReady",
            "KEDA reports the ScaledObject Ready",
        );
        crate::status::note_keda_version(
            &mut c,
            &crate::versions::KedaVersion::known(Some(crate::versions::Version::new(2, 20, 2))),
        );
        assert_eq!(c.message, "KEDA reports the ScaledObject Ready");
        crate::status::note_keda_version(
            &mut c,
            &crate::versions::KedaVersion::known(Some(crate::versions::Version::new(2, 17, 0))),
        );
        assert!(
            c.message.contains("KEDA 2.17.0 cannot sum") && c.message.contains(">= 2.19.0"),
            "{}",
            c.message
        );
        // The gateway's pods refused: nothing reaches the model, even with a backend ready.
        let gateway = GatewayState::of(Some(&refused));
        assert_eq!(gateway.ready, 0);
        let (p, r) = phase_and_ready(b(true, 1, 1), &gateway, &autoscaling_ok());
        assert_eq!(
            (p, r.reason.as_str()),
            (LLMServicePhase::Degraded, "FailedCreate")
        );
        assert!(
            r.message.starts_with("the gateway's pods cannot be created: pods \"m-1-x\" is forbidden: violates PodSecurity"),
            "{}",
            r.message
        );
        // Once a replica runs (a later pod refused by a quota, say), it serves.
        let serving = GatewayState {
            ready: 1,
            ..gateway
        };
        assert_eq!(
            phase_and_ready(b(true, 1, 1), &serving, &autoscaling_ok()).0,
            LLMServicePhase::Ready
        );
        let failed = [Cond::new(PREWARMED, Some(false), "PrewarmFailed", "")];
        assert_eq!(
            phase_and_ready(b(true, 0, 0), &GatewayState::ready(1), &failed).0,
            LLMServicePhase::Degraded
        );
    }

    /// A backend pod from its `status`.
    fn pod_with(status: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "m-0"},
            "spec": {"containers": [{"name": "vllm",
                "resources": {"limits": {"hearth.dev/fake-gpu": "1"}}}]},
            "status": status,
        }))
        .unwrap()
    }

    /// A container status: `state`, `lastState`, restarts.
    fn container(
        state: serde_json::Value,
        last: serde_json::Value,
        restarts: i32,
    ) -> serde_json::Value {
        serde_json::json!({"containerStatuses": [{"name": "vllm", "image": "x", "imageID": "",
            "ready": false, "restartCount": restarts, "state": state, "lastState": last}]})
    }

    #[test]
    fn each_way_a_pod_fails_to_come_up_has_its_reason_and_phase() {
        let crash_wait = serde_json::json!({"waiting": {"reason": "CrashLoopBackOff",
            "message": "back-off 10s restarting failed container=vllm"}});
        let running = serde_json::json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}});
        let ended = |reason: &str, code: i32| {
            serde_json::json!({"terminated": {"reason": reason, "exitCode": code,
                "message": "CUDA out of memory"}})
        };
        let none = serde_json::json!({});
        // What the case is, the pod, the reason and phase wanted.
        type Case = (&'static str, Pod, Option<(&'static str, &'static str)>);
        let cases: &[Case] = &[
            (
                "node selector",
                pod_with(serde_json::json!({"phase": "Pending", "conditions": [{
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."}]})),
                Some(("Unschedulable", "scheduled")),
            ),
            (
                "no accelerator free: a handover's business",
                pod_with(serde_json::json!({"phase": "Pending", "conditions": [{
                    "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                    "message": "0/1 nodes are available: 1 Insufficient hearth.dev/fake-gpu."}]})),
                None,
            ),
            (
                "image pull",
                pod_with(container(
                    serde_json::json!({"waiting": {"reason": "ErrImagePull",
                    "message": "connection refused"}}),
                    none.clone(),
                    0,
                )),
                Some(("ImagePullFailed", "imagePull")),
            ),
            (
                "back-off pulling",
                pod_with(container(
                    serde_json::json!({"waiting": {"reason": "ImagePullBackOff"}}),
                    none.clone(),
                    0,
                )),
                Some(("ImagePullFailed", "imagePull")),
            ),
            (
                "create error",
                pod_with(container(
                    serde_json::json!({"waiting": {"reason": "CreateContainerConfigError"}}),
                    none.clone(),
                    0,
                )),
                Some(("BackendFailing", "containersStarted")),
            ),
            (
                "crash loop",
                pod_with(container(crash_wait.clone(), ended("Error", 1), 2)),
                Some(("CrashLoopBackOff", "modelReady")),
            ),
            (
                "OOM, backing off",
                pod_with(container(crash_wait.clone(), ended("OOMKilled", 137), 1)),
                Some(("OOMKilled", "modelReady")),
            ),
            (
                "OOM, running again after two",
                pod_with(container(running.clone(), ended("OOMKilled", 137), 2)),
                Some(("OOMKilled", "modelReady")),
            ),
            (
                "OOM once, running again: not yet",
                pod_with(container(running.clone(), ended("OOMKilled", 137), 1)),
                None,
            ),
            (
                "killed by a probe",
                pod_with(container(crash_wait.clone(), ended("Error", 137), 3)),
                Some(("RepeatedTermination", "modelReady")),
            ),
            (
                "starting",
                pod_with(container(running, none.clone(), 0)),
                None,
            ),
            (
                "creating",
                pod_with(container(
                    serde_json::json!({"waiting": {"reason": "ContainerCreating"}}),
                    none,
                    0,
                )),
                None,
            ),
        ];
        for (what, pod, want) in cases {
            let got = pod_failure(pod);
            assert_eq!(
                got.as_ref().map(|f| (f.reason, f.phase)),
                *want,
                "{what}: {got:?}"
            );
            if let Some(f) = got {
                assert!(f.message.starts_with("pod m-0"), "{what}: {}", f.message);
            }
        }
        let mut deleted = pod_with(container(crash_wait, ended("Error", 1), 2));
        deleted.metadata.deletion_timestamp = Some(t(1));
        assert_eq!(pod_failure(&deleted), None, "a pod being deleted");
    }

    #[test]
    fn a_long_runtime_error_keeps_its_start_and_its_root_cause() {
        let chain = format!(
            "Failed to pull image \"r/x:1\": {}: pulling from host r failed with status code [manifests 1]: 401 Unauthorized",
            "failed to resolve reference \"r/x:1\": ".repeat(8)
        );
        let b = bounded(&chain);
        assert!(b.starts_with("Failed to pull image \"r/x:1\""), "{b}");
        assert!(b.ends_with("401 Unauthorized"), "{b}");
        assert!(b.contains(" … ") && b.chars().count() <= 300, "{b}");
        assert_eq!(bounded("short: not found"), "short: not found");
        // Characters, not bytes: no panic inside a multi-byte character.
        let wide = "é".repeat(400);
        assert_eq!(bounded(&wide).chars().count(), 140 + 3 + 150);
    }

    #[test]
    fn the_kubelets_pull_failure_event_diagnoses_a_pod_still_initializing() {
        let event: k8s_openapi::api::core::v1::Event = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "e"},
            "involvedObject": {"kind": "Pod", "name": "m-0", "uid": "u0"},
            "type": "Warning", "reason": "Failed",
            "message": "Failed to pull image \"r/x:1\": connection refused",
        }))
        .unwrap();
        let (uid, message) = pull_failure_event(&event).unwrap();
        assert_eq!(uid, "u0");
        let mut other = event.clone();
        other.message = Some("Error: CreateContainerConfigError".to_owned());
        assert_eq!(pull_failure_event(&other), None);
        let mut pod = pod_with(container(
            serde_json::json!({"waiting": {"reason": "PodInitializing"}}),
            serde_json::json!({}),
            0,
        ));
        pod.metadata.uid = Some(uid.clone());
        let pulls = std::collections::HashMap::from([(uid, message)]);
        let b = BackendState {
            exists: true,
            desired: 1,
            ..Default::default()
        };
        let failing = b.clone().with_pods([&pod], &pulls).failing.unwrap();
        assert_eq!(
            (failing.reason, failing.phase),
            ("ImagePullFailed", "imagePull")
        );
        assert!(
            failing.message.contains("connection refused"),
            "{}",
            failing.message
        );
        // Pulled on a retry: running, no failure.
        let mut started = pod_with(container(
            serde_json::json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}}),
            serde_json::json!({}),
            0,
        ));
        started.metadata.uid = pod.metadata.uid.clone();
        assert_eq!(b.with_pods([&started], &pulls).failing, None);
    }

    #[test]
    fn the_newest_pod_is_the_one_diagnosed() {
        let mut old = pod_with(container(
            serde_json::json!({"waiting": {"reason": "ErrImagePull"}}),
            serde_json::json!({}),
            0,
        ));
        old.metadata.creation_timestamp = Some(t(1));
        let mut new = pod_with(container(
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            serde_json::json!({"terminated": {"reason": "Error", "exitCode": 2}}),
            1,
        ));
        new.metadata.creation_timestamp = Some(t(5));
        let b = BackendState::default().with_pods([&old, &new], &Default::default());
        assert_eq!(b.failing.map(|f| f.reason), Some("CrashLoopBackOff"));
        // The newest starting: an old failing pod waits for it, nothing is failing.
        let mut starting = pod_with(container(
            serde_json::json!({"waiting": {"reason": "ContainerCreating"}}),
            serde_json::json!({}),
            0,
        ));
        starting.metadata.creation_timestamp = Some(t(9));
        let b = BackendState::default().with_pods([&old, &new, &starting], &Default::default());
        assert_eq!(b.failing, None);
    }

    #[test]
    fn pods_of_an_earlier_template_are_not_diagnosed() {
        let crashing = pod_with(container(
            serde_json::json!({"waiting": {"reason": "CrashLoopBackOff"}}),
            serde_json::json!({"terminated": {"reason": "OOMKilled", "exitCode": 137}}),
            1,
        ));
        let deployment = |generation: i64, observed: i64, updated: i32| -> Deployment {
            serde_json::from_value(serde_json::json!({
                "metadata": {"generation": generation},
                "spec": {"replicas": 1},
                "status": {"observedGeneration": observed, "replicas": 1,
                           "updatedReplicas": updated},
            }))
            .unwrap()
        };
        let diagnosed = |d: &Deployment| {
            BackendState::of(Some(d))
                .with_pods([&crashing], &Default::default())
                .failing
                .map(|f| f.reason)
        };
        // The pod has the current template: its failure is the answer.
        assert_eq!(diagnosed(&deployment(3, 3, 1)), Some("OOMKilled"));
        // The runtime was corrected: the Deployment's controller has not seen it yet, then no
        // pod has the new template; the old pod's failure is not the answer meanwhile.
        assert_eq!(diagnosed(&deployment(4, 3, 1)), None);
        assert_eq!(diagnosed(&deployment(4, 4, 0)), None);
        // Paused, no pod of a new template comes: the old pods' failure is the answer.
        let mut paused = deployment(4, 4, 0);
        paused.spec.as_mut().unwrap().paused = Some(true);
        assert_eq!(diagnosed(&paused), Some("OOMKilled"));
        // The Deployment counts a pod of the new ReplicaSet that the pod cache has not seen
        // yet, while it still holds the old one: only the named ReplicaSet's pods count.
        let mut crashing = crashing.clone();
        crashing.metadata.owner_references = Some(vec![
            serde_json::from_value(serde_json::json!({
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "m-old", "uid": "u"
            }))
            .unwrap(),
        ]);
        let mut rolled = deployment(5, 5, 1);
        rolled.status.as_mut().unwrap().conditions = Some(vec![
            serde_json::from_value(serde_json::json!({
                "type": "Progressing", "status": "True", "reason": "ReplicaSetUpdated",
                "message": "ReplicaSet \"m-new\" is progressing."
            }))
            .unwrap(),
        ]);
        let with = |d: &Deployment, p: &Pod| {
            BackendState::of(Some(d))
                .with_pods([p], &Default::default())
                .failing
                .map(|f| f.reason)
        };
        assert_eq!(
            BackendState::of(Some(&rolled))
                .current_replica_set
                .as_deref(),
            Some("m-new")
        );
        assert_eq!(with(&rolled, &crashing), None);
        let mut current = crashing.clone();
        current.metadata.owner_references.as_mut().unwrap()[0].name = "m-new".to_owned();
        assert_eq!(with(&rolled, &current), Some("OOMKilled"));
    }

    #[test]
    fn a_failure_record_keeps_its_time_while_pod_and_reason_stay() {
        let f = Failure {
            reason: "ImagePullFailed",
            pod: Some("m-0".to_owned()),
            phase: "imagePull",
            message: "m".to_owned(),
        };
        let first = f.record(None, &t(1));
        assert_eq!(f.record(Some(&first), &t(9)).time, t(1));
        let other = Failure {
            pod: Some("m-1".to_owned()),
            ..f
        };
        assert_eq!(other.record(Some(&first), &t(9)).time, t(9));
    }

    #[test]
    fn keda_absent_is_reported_not_errored() {
        let c = autoscaling(false, None);
        assert_eq!((c.status, c.reason.as_str()), ("False", "KEDANotInstalled"));
        let so: DynamicObject = serde_json::from_value(serde_json::json!({
            "apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject",
            "metadata": {"name": "s"},
            "status": {"conditions": [{"type": "Ready", "status": "True"}]}
        }))
        .unwrap();
        assert!(autoscaling(true, Some(&so)).is_true());
    }
}

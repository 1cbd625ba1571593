//! The second half of a plan: what the spec asks for ([`Desired`]) against what the watch
//! caches hold ([`View`]) decides every write, every condition and the phase. Pure: no API
//! call, so each branch is a table test (`plan/tests.rs`); [`super::execute()`] sends the writes.
//!
//! Per child, in apply order (dependencies first):
//! - **apply** when the cache does not already hold everything the controller sets
//!   ([`diff::contains`]); nothing when it does;
//! - **adopt**, then apply, when the cached child was written by another manager
//!   ([`adopt::foreign`]);
//! - create-once children (cache claim, prewarm Job) are never replaced: a changed
//!   [`TEMPLATE_HASH_ANNOTATION`] is reported `ReplaceRequired`, naming what to delete;
//! - the backend Deployment is **created** (not applied) the first time, after **deleting** an
//!   earlier version's `N-backend` Deployment when this service controls it;
//! - a gateway Deployment whose selector differs is **replaced** (deleted, then applied) when
//!   this service controls it; the scaler Service is **deleted** in poll mode, likewise.

use std::collections::HashMap;
use std::sync::Arc;

use hearth_crds::{
    LLMService, LLMServicePhase, LLMServiceStatus,
    llmservice::CacheStrategy,
    wellknown::{KEDA_PAUSED_ANNOTATION, PREWARM_WAIT_ANNOTATION},
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        batch::v1::Job,
        core::v1::{ConfigMap, PersistentVolumeClaim, Pod, Service, ServiceAccount},
        networking::v1::NetworkPolicy,
        policy::v1::PodDisruptionBudget,
        rbac::v1::{Role, RoleBinding},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};
use kube::{Resource, ResourceExt, api::DynamicObject, core::Status};
use serde::Serialize;

use super::{
    desired::Desired,
    write::{Kind, Object, Target, Write},
};
use crate::{
    adopt,
    attach::{EndpointKey, endpoint_url},
    diff,
    model::{self, ModelSource},
    names,
    render::{Placement, RenderConfig, TEMPLATE_HASH_ANNOTATION},
    status::{self, BackendState, Cond},
    upgrade,
};

#[cfg(test)]
mod tests;

/// What the watch caches hold of one service's children (`managedFields` stripped), read once
/// per reconcile; `None` where a child is not there.
#[derive(Clone, Debug, Default)]
pub struct View {
    /// ServiceAccount `N-gateway`.
    pub service_account: Option<Arc<ServiceAccount>>,
    /// Role `N-gateway`.
    pub role: Option<Arc<Role>>,
    /// RoleBinding `N-gateway`.
    pub role_binding: Option<Arc<RoleBinding>>,
    /// PersistentVolumeClaim `N-cache`.
    pub claim: Option<Arc<PersistentVolumeClaim>>,
    /// Job `N-prewarm`.
    pub job: Option<Arc<Job>>,
    /// The hub adapters' fetch Jobs (label `app.kubernetes.io/component: adapter-fetch`).
    pub adapter_fetch_jobs: Vec<Arc<Job>>,
    /// Service `N-backend`.
    pub backend_service: Option<Arc<Service>>,
    /// Service `N` (the gateway's).
    pub gateway_service: Option<Arc<Service>>,
    /// Service `N-scaler`.
    pub scaler_service: Option<Arc<Service>>,
    /// Service `N-gateway-admin`.
    pub admin_service: Option<Arc<Service>>,
    /// Deployment `N` (the backend).
    pub backend: Option<Arc<Deployment>>,
    /// Deployment `N-backend`: an earlier version's backend.
    pub legacy_backend: Option<Arc<Deployment>>,
    /// Deployment `N-gateway`.
    pub gateway: Option<Arc<Deployment>>,
    /// PodDisruptionBudget `N-gateway`.
    pub gateway_pdb: Option<Arc<PodDisruptionBudget>>,
    /// NetworkPolicy `N-gateway`.
    pub gateway_network_policy: Option<Arc<NetworkPolicy>>,
    /// NetworkPolicy `N-backend`.
    pub backend_network_policy: Option<Arc<NetworkPolicy>>,
    /// ConfigMap `N-adapters`.
    pub adapters_config_map: Option<Arc<ConfigMap>>,
    /// The gateway Deployment of the LLMEndpoint the service is attached to (read only then).
    pub endpoint_gateway: Option<Arc<Deployment>>,
    /// Whether KEDA's ScaledObject CRD is installed and established.
    pub keda_installed: bool,
    /// ScaledObject `N` (read only when KEDA is installed).
    pub scaled_object: Option<Arc<DynamicObject>>,
    /// The service's backend pods (label `serving.hearth.dev/llmservice`), from the pod cache.
    pub backend_pods: Vec<Arc<Pod>>,
    /// Image pulls of those pods the kubelet's Events say failed, pod UID → message
    /// ([`status::pull_failure_event`]).
    pub pull_failures: HashMap<String, String>,
}

/// What one reconcile does: the writes, in order, and the status they lead to.
#[derive(Debug)]
pub struct Plan {
    /// The writes, in order; the executor stops at the first that fails.
    pub writes: Vec<Write>,
    /// `status.phase`.
    pub phase: LLMServicePhase,
    /// `status.resolvedRuntime`.
    pub resolved_runtime: Option<String>,
    /// `status.replicas`: ready backend replicas.
    pub replicas: i32,
    /// The conditions, in their stable order (see [`CONDITION_ORDER`]).
    pub conds: Vec<Cond>,
    /// `status.endpointURL`: the service's own gateway Service, or its endpoint's.
    pub endpoint_url: String,
    /// What `Ready` and the phase are derived from once children are written.
    readiness: Option<Readiness>,
}

/// The inputs of `Ready` and the phase besides the other conditions.
#[derive(Clone, Debug)]
struct Readiness {
    backend: BackendState,
    /// The prewarm Job a `SharedPVC` backend at zero waits for (see [`wait_for_prewarm`]).
    waits_for: Option<String>,
    gateway_state: status::GatewayState,
    gateway: String,
    /// Key and Secret of `spec.endpoint.apiKeySecretRef`.
    api_key: Option<(String, String)>,
    /// The endpoint whose shared gateway serves the service, `namespace/name`.
    endpoint: Option<String>,
}

/// The order conditions are reported in (`EndpointAccepted`, with a `sharedEndpointRef`, after
/// them).
pub const CONDITION_ORDER: [&str; 6] = [
    status::READY,
    status::RUNTIME_RESOLVED,
    status::AUTOSCALING_READY,
    status::CACHE_READY,
    status::PREWARMED,
    status::VALIDATED,
];

impl Plan {
    /// The condition of `type_`, if decided.
    pub fn condition(&self, type_: &str) -> Option<&Cond> {
        self.conds.iter().find(|c| c.type_ == type_)
    }

    /// Replaces the condition of `cond`'s type (what a write's outcome says, see [`recovery`])
    /// and derives `Ready` and the phase again.
    pub fn set_condition(&mut self, cond: Cond) {
        self.conds.retain(|c| c.type_ != cond.type_);
        self.conds.push(cond);
        self.settle();
    }

    /// The status to write: this plan's, with `lastTransitionTime` kept from `svc`'s current
    /// conditions where their status did not change, `now` elsewhere.
    pub fn status(&self, svc: &LLMService, now: &Time) -> LLMServiceStatus {
        let previous = svc
            .status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default();
        LLMServiceStatus {
            phase: Some(self.phase),
            resolved_runtime: self.resolved_runtime.clone(),
            replicas: Some(self.replicas),
            endpoint_url: Some(self.endpoint_url.clone()),
            observed_generation: svc.metadata.generation,
            conditions: status::merge_conditions(
                previous,
                &self.conds,
                svc.metadata.generation,
                now,
            ),
            // The record of the last activation is kept until the reconciler records the next
            // one (`crate::activation`).
            last_activation: svc.status.as_ref().and_then(|s| s.last_activation.clone()),
            last_activation_failure: self.activation_failure(svc, now),
            // The gateway's and the meter's, under their own field managers: never sent, so
            // never taken over.
            last_wake: None,
            usage: None,
        }
    }

    /// `status.lastActivationFailure`: a new record when `Ready` reports a backend failure
    /// ([`status::Failure::record`]), else the last one kept.
    fn activation_failure(
        &self,
        svc: &LLMService,
        now: &Time,
    ) -> Option<hearth_crds::ActivationFailure> {
        let previous = svc
            .status
            .as_ref()
            .and_then(|s| s.last_activation_failure.as_ref());
        let reported = self.condition(status::READY).map(|c| c.reason.as_str());
        match self.readiness.as_ref().and_then(|r| r.backend.failure()) {
            Some(f) if reported == Some(f.reason) => Some(f.record(previous, now)),
            _ => previous.cloned(),
        }
    }

    /// Derives `Ready`, the phase and the replicas from the backend, the gateway and the other
    /// conditions (when children are written), and puts the conditions in their order.
    fn settle(&mut self) {
        if let Some(r) = &self.readiness {
            self.conds.retain(|c| c.type_ != status::READY);
            let (phase, mut ready) =
                status::phase_and_ready(r.backend.clone(), &r.gateway_state, &self.conds);
            // KEDA paused by the controller may report its ScaledObject not Ready: the wait is
            // what the user needs to know (a gateway not ready is a fault of its own).
            if phase == LLMServicePhase::ScaledToZero
                && ready.reason != "GatewayNotReady"
                && let Some(job) = &r.waits_for
            {
                ready = Cond::new(
                    status::READY,
                    Some(false),
                    "WaitingForPrewarm",
                    format!(
                        "the backend stays at zero until prewarm Job {job} has filled the shared cache (cache.strategy SharedPVC, mounted read-only); requests are held meanwhile, up to spec.scaling.activationTimeout, and served once it has"
                    ),
                );
            }
            if ready.reason == "GatewayNotReady"
                && let Some(endpoint) = &r.endpoint
            {
                ready.message = format!(
                    "{}: the service is served by the shared gateway of LLMEndpoint {endpoint} (Deployment {}); see the endpoint's Ready condition",
                    ready.message, r.gateway
                );
            }
            if ready.reason == "GatewayNotReady"
                && let Some((key, secret)) = &r.api_key
            {
                // The controller may not read Secrets; say where to look when it is the likely
                // cause.
                ready.message = format!(
                    "{}; the gateway mounts the API keys from key {key:?} of Secret {secret:?}: until both exist its pods wait in ContainerCreating (FailedMount events on the pods of Deployment {})",
                    ready.message, r.gateway
                );
            }
            self.phase = phase;
            self.replicas = r.backend.ready;
            self.conds.push(ready);
        }
        self.conds.sort_by_key(|c| {
            CONDITION_ORDER
                .iter()
                .position(|t| *t == c.type_)
                .unwrap_or(CONDITION_ORDER.len())
        });
    }
}

/// Decides every write for `svc` from what its spec asks for and what the caches hold;
/// `cfg` gives the drain image (kept on running backends, see [`upgrade`]) and the HostPath
/// root (reported in `CacheReady`).
pub fn plan(svc: &LLMService, desired: Desired, view: &View, cfg: &RenderConfig) -> Plan {
    let Desired {
        phase,
        resolved_runtime,
        mut conds,
        children,
        placement,
    } = desired;
    let name = svc.name_any();
    let shared = match &placement {
        Placement::Own => None,
        Placement::Shared(g) => Some(g),
    };
    let endpoint_url = match shared {
        None => format!(
            "http://{}.{}.svc/v1",
            names::gateway_service(&name),
            svc.namespace().unwrap_or_default()
        ),
        Some(g) => endpoint_url(&EndpointKey {
            namespace: g.namespace.clone(),
            name: g.endpoint.clone(),
        }),
    };
    let mut plan = Plan {
        writes: Vec::new(),
        phase,
        resolved_runtime,
        replicas: 0,
        conds: Vec::new(),
        endpoint_url,
        readiness: None,
    };
    let Some(children) = children else {
        plan.conds = conds;
        plan.settle();
        return plan;
    };
    let writes = &mut plan.writes;
    // What an attached service no longer has of its own: deleted once its ScaledObject asks the
    // endpoint's gateway (the last apply).
    let mut prune = Vec::new();

    if let Some(sa) = children.gateway_service_account {
        apply_cached(writes, sa, view.service_account.as_deref());
    }
    apply_cached(writes, children.gateway_role, view.role.as_deref());
    apply_cached(
        writes,
        children.gateway_role_binding,
        view.role_binding.as_deref(),
    );

    // Cache.
    let source = model::parse_source(&svc.spec.model).ok();
    match (&source, children.cache_claim) {
        (Some(ModelSource::Pvc { claim, .. }), _) => conds.push(Cond::new(
            status::CACHE_READY,
            Some(true),
            "PreStaged",
            format!("weights are read from PersistentVolumeClaim {claim}, mounted read-only"),
        )),
        (Some(ModelSource::Oci { reference }), _) => conds.push(Cond::new(
            status::CACHE_READY,
            Some(true),
            "ImageVolume",
            format!(
                "weights are read from image {reference}, which the kubelet pulls and mounts read-only as an image volume"
            ),
        )),
        (_, Some(claim)) => {
            let claim_name = names::cache_claim(&name);
            let mut existing = view.claim.as_deref();
            if existing.is_some_and(|c| adopt::foreign(&c.metadata)) {
                // An upstream installation's cache: keep it and its contents.
                writes.push(Write::Adopt(Target::new(
                    Kind::PersistentVolumeClaim,
                    &claim_name,
                )));
                existing = None;
            }
            if replace_needed(existing.map(|c| &c.metadata), &claim.metadata) {
                conds.push(Cond::new(
                    status::CACHE_READY,
                    Some(false),
                    "ReplaceRequired",
                    format!(
                        "spec.cache.storageClassName changed (or spec.cache.strategy, between NodeLocalPVC and SharedPVC, changed the access mode), and a claim's storage class and access modes cannot change: delete PersistentVolumeClaim {claim_name} (after scaling the backend to zero) to recreate it"
                    ),
                ));
            } else {
                if !existing.is_some_and(|c| diff::contains(c, &claim)) {
                    // The apiserver may refuse it: see `recovery`.
                    writes.push(Write::Apply(claim.into()));
                }
                conds.push(status::cache_claim(existing, &claim_name));
            }
        }
        _ => conds.push(match svc.spec.cache.strategy {
            CacheStrategy::HostPath => Cond::new(
                status::CACHE_READY,
                Some(true),
                "HostPath",
                format!(
                    "weights are cached on each node under {}",
                    cfg.host_path_root
                ),
            ),
            _ => Cond::new(
                status::CACHE_READY,
                Some(true),
                "NoCache",
                "cache.strategy is None: each backend pod downloads the model",
            ),
        }),
    }

    // Prewarm.
    let job_name = names::prewarm_job(&name);
    match (children.prewarm_job, view.job.as_deref()) {
        (Some(job), None) => {
            writes.push(Write::Apply(job.into()));
            conds.push(status::prewarm(None, &job_name));
        }
        (Some(job), Some(current))
            if !adopt::foreign(&current.metadata)
                && replace_needed(Some(&current.metadata), &job.metadata) =>
        {
            conds.push(Cond::new(
                status::PREWARMED,
                Some(false),
                "ReplaceRequired",
                format!(
                    "the model source or runtime changed after prewarm Job {job_name} was created, and a Job cannot change: delete Job {job_name} to prewarm again"
                ),
            ));
        }
        // A Job is create-once: nothing to apply once it exists (an upstream installation's
        // included; its template cannot change).
        (Some(_), Some(current)) => conds.push(status::prewarm(Some(current), &job_name)),
        (None, _) => {
            let (reason, message) = match (&source, svc.spec.cache.prewarm, svc.spec.cache.strategy)
            {
                (_, false, _) => ("NotRequested", "cache.prewarm is false".to_owned()),
                (Some(ModelSource::Pvc { .. }), true, _) => (
                    "NotApplicable",
                    "pvc:// weights are pre-staged; there is nothing to download".to_owned(),
                ),
                (Some(ModelSource::Oci { .. }), true, _) => (
                    "NotApplicable",
                    "oci:// weights come with their image; the kubelet pulls it".to_owned(),
                ),
                (_, true, strategy) => (
                    "NoCache",
                    format!(
                        "cache.prewarm needs a cache to fill, but cache.strategy is {strategy:?}: use NodeLocalPVC, SharedPVC or HostPath"
                    ),
                ),
            };
            conds.push(Cond::new(status::PREWARMED, Some(false), reason, message));
        }
    }

    // The hub adapters' fetch Jobs: create-once (one whose template changed, with the
    // runtime's image, keeps what it fetched); one whose adapter went is deleted.
    for job in &children.adapter_fetch_jobs {
        let name = job.metadata.name.as_deref().unwrap_or_default();
        if !view
            .adapter_fetch_jobs
            .iter()
            .any(|j| j.metadata.name.as_deref() == Some(name))
        {
            writes.push(Write::Apply(job.clone().into()));
        }
    }
    for current in &view.adapter_fetch_jobs {
        let name = current.metadata.name.as_deref().unwrap_or_default();
        if !children
            .adapter_fetch_jobs
            .iter()
            .any(|j| j.metadata.name.as_deref() == Some(name))
        {
            delete_if_owned(
                writes,
                Target::new(Kind::Job, name),
                Some(current.as_ref()),
                svc,
            );
        }
    }

    let waits_for = wait_for_prewarm(svc, &conds, view.backend.as_deref());

    // The adapter table, before the gateway that reads it.
    apply_or_delete(
        writes,
        children.adapters_config_map,
        Target::new(Kind::ConfigMap, names::adapters(&name)),
        view.adapters_config_map.as_deref(),
        svc,
    );

    // Backend: its NetworkPolicy first, so no pod runs unguarded.
    if children.backend_network_policy.is_some() {
        conds.push(Cond::new(
            status::NETWORK_POLICY_READY,
            Some(true),
            "Applied",
            "the gateway's and the backend's NetworkPolicies are written (--model-network-policies)",
        ));
    }
    apply_or_delete(
        writes,
        children.backend_network_policy,
        Target::new(Kind::NetworkPolicy, names::backend_service(&name)),
        view.backend_network_policy.as_deref(),
        svc,
    );
    apply_cached(
        writes,
        children.backend_service,
        view.backend_service.as_deref(),
    );
    match view.backend.as_deref() {
        Some(live) => {
            let mut backend = children.backend;
            if has_pods(live)
                && upgrade::keep_live_template(&mut backend, live, cfg.drain_image.as_deref())
            {
                // Applied when the backend is next at zero, or with its next template change.
                tracing::info!(deployment = %live.name_any(), namespace = %live.namespace().unwrap_or_default(), new_image = ?cfg.drain_image, "keeping the running pods' template (drain sidecar image, fields new in this release), so this upgrade does not restart them");
                // What the live pods run is kept as it was applied: containment alone decides,
                // its applied hash (another release's desired object) stays.
                apply_contained(writes, backend, Some(live));
            } else {
                apply_cached(writes, backend, Some(live));
            }
        }
        None => {
            // An earlier version of this controller named the backend `<name>-backend`: remove
            // it first, so two backends never hold accelerators at once.
            delete_if_owned(
                writes,
                Target::new(Kind::Deployment, names::legacy_backend(&name)),
                view.legacy_backend.as_deref(),
                svc,
            );
            let mut backend = children.backend;
            if waits_for.is_some()
                && let Some(spec) = backend.spec.as_mut()
            {
                spec.replicas = Some(0);
            }
            writes.push(Write::Create(Box::new(backend)));
        }
    }

    // Gateway.
    match children.gateway {
        Some(gateway) => {
            apply_or_delete(
                writes,
                children.gateway_network_policy,
                Target::new(Kind::NetworkPolicy, names::gateway(&name)),
                view.gateway_network_policy.as_deref(),
                svc,
            );
            if let Some(s) = children.gateway_service {
                apply_cached(writes, s, view.gateway_service.as_deref());
            }
            if let Some(s) = children.admin_service {
                apply_cached(writes, s, view.admin_service.as_deref());
            }
            apply_or_delete(
                writes,
                children.scaler_service,
                Target::new(Kind::Service, names::scaler_service(&name)),
                view.scaler_service.as_deref(),
                svc,
            );
            // A Deployment's selector is immutable: a gateway an earlier version of this
            // controller wrote with other selector labels is replaced (it holds no state).
            if let Some(live) = view.gateway.as_deref()
                && live.spec.as_ref().map(|s| &s.selector)
                    != gateway.spec.as_ref().map(|s| &s.selector)
            {
                delete_if_owned(
                    writes,
                    Target::new(Kind::Deployment, names::gateway(&name)),
                    Some(live),
                    svc,
                );
            }
            apply_cached(writes, gateway, view.gateway.as_deref());
            if let Some(pdb) = children.gateway_pdb {
                apply_cached(writes, pdb, view.gateway_pdb.as_deref());
            }
        }
        None => {
            // Attached: the endpoint's gateway serves the model; the service's own goes.
            let gateway = names::gateway(&name);
            delete_if_owned(
                &mut prune,
                Target::new(Kind::Deployment, &gateway),
                view.gateway.as_deref(),
                svc,
            );
            delete_if_owned(
                &mut prune,
                Target::new(Kind::PodDisruptionBudget, &gateway),
                view.gateway_pdb.as_deref(),
                svc,
            );
            delete_if_owned(
                &mut prune,
                Target::new(Kind::NetworkPolicy, &gateway),
                view.gateway_network_policy.as_deref(),
                svc,
            );
            delete_if_owned(
                &mut prune,
                Target::new(Kind::Service, names::gateway_service(&name)),
                view.gateway_service.as_deref(),
                svc,
            );
            delete_if_owned(
                &mut prune,
                Target::new(Kind::Service, names::scaler_service(&name)),
                view.scaler_service.as_deref(),
                svc,
            );
            delete_if_owned(
                &mut prune,
                Target::new(Kind::Service, names::gateway_admin(&name)),
                view.admin_service.as_deref(),
                svc,
            );
            delete_if_owned(
                &mut prune,
                Target::new(Kind::ServiceAccount, &gateway),
                view.service_account.as_deref(),
                svc,
            );
        }
    }

    // Autoscaling.
    conds.push(if view.keda_installed {
        let cached = view.scaled_object.as_deref();
        let mut scaled_object = children.scaled_object;
        if let Some(job) = &waits_for {
            let annotations = scaled_object
                .metadata
                .annotations
                .get_or_insert_with(Default::default);
            annotations.insert(KEDA_PAUSED_ANNOTATION.to_owned(), "true".to_owned());
            annotations.insert(PREWARM_WAIT_ANNOTATION.to_owned(), job.clone());
        }
        let paused_here = cached
            .and_then(|c| c.metadata.annotations.as_ref())
            .is_some_and(|a| a.contains_key(PREWARM_WAIT_ANNOTATION));
        // KEDA's CRD may go away before the apply: see `recovery`.
        if waits_for.is_none() && paused_here {
            // The apply without them removes both annotations (the controller's own fields).
            writes.push(Write::Apply(Object::from(scaled_object)));
        } else {
            apply_cached(writes, scaled_object, cached);
        }
        let mut autoscaling = status::autoscaling(true, cached);
        if hearth_crds::rules::scaler_mode(svc)
            .is_ok_and(|m| m == hearth_crds::rules::ScalerMode::Poll)
        {
            status::note_keda_version(&mut autoscaling, &cfg.keda_version);
        }
        autoscaling
    } else {
        status::autoscaling(false, None)
    });
    writes.extend(prune);

    let backend = match BackendState::of(view.backend.as_deref()) {
        b if b.exists => b.with_pods(
            view.backend_pods.iter().map(AsRef::as_ref),
            &view.pull_failures,
        ),
        // Created by this plan: what is created.
        _ => BackendState {
            exists: true,
            desired: if waits_for.is_some() {
                0
            } else {
                svc.spec.scaling.min
            },
            ..Default::default()
        },
    };
    plan.readiness = Some(match shared {
        None => Readiness {
            backend,
            waits_for,
            gateway_state: status::GatewayState::of(view.gateway.as_deref()),
            gateway: names::gateway(&name),
            api_key: svc
                .spec
                .endpoint
                .api_key_secret_ref
                .as_ref()
                .map(|r| (r.key.clone(), r.name.clone())),
            endpoint: None,
        },
        Some(g) => Readiness {
            backend,
            waits_for,
            gateway_state: status::GatewayState::of(view.endpoint_gateway.as_deref()),
            gateway: names::gateway(&g.endpoint),
            api_key: None,
            endpoint: Some(format!("{}/{}", g.namespace, g.endpoint)),
        },
    });
    plan.conds = conds;
    plan.settle();
    plan
}

/// Apply `desired` unless the cached child already holds everything it sets (an unchanged child
/// costs no request at all); adopt it first when another manager wrote it. `desired` carries
/// the hash of itself ([`diff::APPLIED_HASH_ANNOTATION`]), so a field it no longer sets makes
/// the cached child differ too.
pub(super) fn apply_cached<K>(writes: &mut Vec<Write>, mut desired: K, cached: Option<&K>)
where
    K: Resource + Serialize,
    Object: From<K>,
{
    diff::stamp(&mut desired);
    apply_contained(writes, desired, cached);
}

/// [`apply_cached`] without the applied hash: apply `desired` unless `cached` contains it.
fn apply_contained<K>(writes: &mut Vec<Write>, desired: K, cached: Option<&K>)
where
    K: Resource + Serialize,
    Object: From<K>,
{
    let adopt = match cached {
        Some(c) if adopt::foreign(c.meta()) => true,
        Some(c) if diff::contains(c, &desired) => return,
        _ => false,
    };
    let object = Object::from(desired);
    if adopt {
        writes.push(Write::Adopt(object.target()));
    }
    writes.push(Write::Apply(object));
}

/// Apply `desired` ([`apply_cached`]), or without it delete `target` ([`delete_if_owned`]): an
/// optional child that comes and goes with a setting.
pub(super) fn apply_or_delete<K, O>(
    writes: &mut Vec<Write>,
    desired: Option<K>,
    target: Target,
    cached: Option<&K>,
    owner: &O,
) where
    K: Resource + Serialize,
    Object: From<K>,
    O: Resource,
{
    match desired {
        Some(d) => apply_cached(writes, d, cached),
        None => delete_if_owned(writes, target, cached, owner),
    }
}

/// Delete `target` if the cache holds it (`cached`) and `owner` controls it (the cache answers "is it there?";
/// only an actual deletion costs a request).
pub(super) fn delete_if_owned<K: Resource, O: Resource>(
    writes: &mut Vec<Write>,
    target: Target,
    cached: Option<&K>,
    owner: &O,
) {
    let Some(obj) = cached else { return };
    let owned = obj
        .meta()
        .owner_references
        .iter()
        .flatten()
        .any(|r| Some(&r.uid) == owner.meta().uid.as_ref());
    if owned {
        writes.push(Write::Delete(target));
    }
}

/// The prewarm Job a `SharedPVC` backend waits for, when it must: the backends mount the shared
/// cache read-only and offline, so one started before the Job filled it fails (and is
/// restarted with a growing back-off). While the Job has not succeeded (the `Prewarmed`
/// condition in `conds` is not True) and the backend is at zero (or not created yet), the
/// backend is created with 0 replicas and KEDA is paused on the ScaledObject
/// ([`KEDA_PAUSED_ANNOTATION`], at the current count: a running backend is never scaled down
/// by it), so requests are held, not sent to a failing engine. A backend with replicas is left
/// alone (a Job deleted and run again must not take a serving model down).
fn wait_for_prewarm(
    svc: &LLMService,
    conds: &[Cond],
    backend: Option<&Deployment>,
) -> Option<String> {
    if svc.spec.cache.strategy != CacheStrategy::SharedPVC {
        return None;
    }
    if conds
        .iter()
        .any(|c| c.type_ == status::PREWARMED && c.is_true())
    {
        return None;
    }
    if backend.is_some_and(has_pods) {
        return None;
    }
    Some(names::prewarm_job(&svc.name_any()))
}

/// Whether a Deployment wants or still has pods: a template change would restart them. At
/// zero replicas it costs nothing, so Hearth's own image updates are applied then (see
/// [`upgrade::keep_live_template`]).
fn has_pods(d: &Deployment) -> bool {
    d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1) > 0
        || d.status.as_ref().and_then(|s| s.replicas).unwrap_or(0) > 0
}

/// Whether a create-once child must be replaced: it exists with a different template hash.
fn replace_needed(existing: Option<&ObjectMeta>, desired: &ObjectMeta) -> bool {
    let hash = |m: &ObjectMeta| {
        m.annotations
            .as_ref()
            .and_then(|a| a.get(TEMPLATE_HASH_ANNOTATION))
            .cloned()
    };
    existing.is_some_and(|e| hash(e) != hash(desired))
}

/// What a write's API error means.
#[derive(Debug, PartialEq)]
pub enum Recovery<'a> {
    /// The reconcile fails with it (retried with backoff, see [`super::error_policy`]).
    Fail,
    /// Nothing: what the write wanted is already so (a deletion of something gone).
    Done,
    /// The write is reported as this condition, which replaces the planned one
    /// ([`Plan::set_condition`]); the reconcile goes on.
    Report(Cond),
    /// The backend exists although the cache did not hold it (a controller just started): read
    /// it and write what [`after_conflict`] says instead.
    ReadBackend(&'a Deployment),
}

/// How the executor goes on after `write` failed with the API error `e`.
pub fn recovery<'a>(write: &'a Write, e: &Status) -> Recovery<'a> {
    match (write, e.code) {
        (Write::Apply(Object::PersistentVolumeClaim(claim)), 422) => Recovery::Report(Cond::new(
            status::CACHE_READY,
            Some(false),
            "ReplaceRequired",
            format!(
                "the apiserver rejected the cache claim change ({}): a claim can only grow; delete PersistentVolumeClaim {} to recreate it smaller",
                e.message,
                claim.name_any()
            ),
        )),
        // KEDA's CRD went away between the check and the apply.
        (Write::Apply(Object::ScaledObject(_)), 404) => {
            Recovery::Report(status::autoscaling(false, None))
        }
        // A policy the apiserver refuses (a value of --model-network-policies that its checks
        // missed) is reported; the service's other children are still written.
        (Write::Apply(Object::NetworkPolicy(p)), 422) => Recovery::Report(Cond::new(
            status::NETWORK_POLICY_READY,
            Some(false),
            "Refused",
            format!(
                "the apiserver refused NetworkPolicy {}: {}; it is made from the controller's --model-network-policies (chart values networkPolicy.models and networkPolicy.metricsFrom): fix the value there",
                p.name_any(),
                e.message
            ),
        )),
        (Write::Create(backend), 409) => Recovery::ReadBackend(backend),
        (Write::Delete(_), 404) => Recovery::Done,
        _ => Recovery::Fail,
    }
}

/// The writes for a backend whose create met an existing Deployment, `live`: apply without
/// `spec.replicas` (its owner keeps it), adopting it first when another manager wrote it, and
/// keeping the running pods' drain image as for any backend with pods.
pub fn after_conflict(
    desired: &Deployment,
    live: &Deployment,
    drain_image: Option<&str>,
) -> Vec<Write> {
    let mut backend = desired.clone();
    if let Some(spec) = backend.spec.as_mut() {
        spec.replicas = None;
    }
    let mut writes = Vec::new();
    if adopt::foreign(&live.metadata) {
        writes.push(Write::Adopt(Target::new(
            Kind::Deployment,
            backend.name_any(),
        )));
    }
    if has_pods(live) {
        upgrade::keep_live_template(&mut backend, live, drain_image);
    }
    writes.push(Write::Apply(backend.into()));
    writes
}

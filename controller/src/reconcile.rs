//! The `LLMService` reconciler (kube-runtime `Controller`, shaped like kube-rs controller-rs):
//! `reconcile(obj, ctx) -> Result<Action, Error>`, errors carry a metric label, children and
//! status are written with server-side apply under one field manager.
//!
//! Rules that keep it boring:
//! - The backend Deployment is created once with `spec.replicas = scaling.min` (a plain create,
//!   so that field stays with the create entry of `managedFields`); every later apply leaves
//!   `replicas` out, so KEDA, the HPA or a user owns it and the controller never fights them.
//! - Server-side apply of unchanged content changes nothing, and status is written only when it
//!   differs, so an idle service makes no writes that change a `resourceVersion`.
//! - Bad input is not an error loop: it is a condition with a reason and a fix, and the object
//!   is requeued slowly; only API failures are errors (retried with backoff).
//! - KEDA missing is a condition too; the `scaledobjects.keda.sh` CRD is watched, and every
//!   service is reconciled when it appears.

use std::{
    collections::HashMap,
    fmt::Debug,
    future::Future,
    hash::{Hash, Hasher},
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{StreamExt, channel::mpsc};
use hearth_crds::{
    InferenceRuntime, LLMService, LLMServicePhase, LLMServiceStatus,
    llmservice::CacheStrategy,
    rules,
    wellknown::{FIELD_MANAGER, LLMSERVICE_LABEL},
};
use k8s_openapi::{
    NamespaceResourceScope,
    api::{
        apps::v1::Deployment,
        batch::v1::Job,
        core::v1::{PersistentVolumeClaim, Service, ServiceAccount},
        policy::v1::PodDisruptionBudget,
        rbac::v1::{Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::Time,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DynamicObject, Patch, PatchParams, PostParams},
    runtime::{
        Controller, WatchStreamExt,
        controller::{Action, Config as ControllerConfig},
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde::{Serialize, de::DeserializeOwned};
use tracing::{Instrument, info_span};

use crate::{
    adopt, diff, labels,
    metrics::Metrics,
    model::{self, ModelSource},
    names, policy,
    render::{self, Children, RenderConfig, TEMPLATE_HASH_ANNOTATION},
    resolve::{ResolveError, resolve_runtime},
    status::{self, Cond},
    upgrade,
};

/// The name of the CRD of `api`, whose presence means KEDA is installed
/// (`scaledobjects.keda.sh`).
pub fn crd_name(api: &kube::api::ApiResource) -> String {
    format!("{}.{}", api.plural, api.group)
}

/// A reconcile failure: API errors only (bad specs become conditions, not errors).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A Kubernetes API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done, e.g. `apply Deployment ns/x-backend`.
        action: String,
        /// The API error.
        source: kube::Error,
    },
    /// An object could not be serialized.
    #[error("serializing {0}")]
    Serialize(String),
}

impl Error {
    /// The `reason` label of `hearth_controller_reconcile_errors_total`.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube {
                source: kube::Error::Api(e),
                ..
            } if e.code == 409 => "conflict",
            Error::Kube {
                source: kube::Error::Api(e),
                ..
            } if e.code == 422 => "invalid",
            Error::Kube {
                source: kube::Error::Api(e),
                ..
            } if e.code == 403 => "forbidden",
            Error::Kube { .. } => "kube_api",
            Error::Serialize(_) => "serialize",
        }
    }
}

/// KEDA's presence and, once present, a cache of ScaledObjects.
pub struct KedaState {
    api: kube::api::ApiResource,
    installed: AtomicBool,
    store: RwLock<Option<Store<DynamicObject>>>,
}

impl KedaState {
    /// Whether the ScaledObject CRD is installed and established.
    pub fn installed(&self) -> bool {
        self.installed.load(Ordering::SeqCst)
    }

    fn get(&self, namespace: &str, name: &str) -> Option<Arc<DynamicObject>> {
        let guard = self.store.read().ok()?;
        let store = guard.as_ref()?;
        store.get(&ObjectRef::new_with(name, self.api.clone()).within(namespace))
    }
}

/// Settings of a controller run.
#[derive(Clone, Debug)]
pub struct RunConfig {
    /// Images and paths for rendering.
    pub render: RenderConfig,
    /// Watch only this namespace (all namespaces when `None`).
    pub namespace: Option<String>,
    /// Periodic resync of every service.
    pub requeue: Duration,
    /// Reconciles running at once.
    pub concurrency: u16,
    /// `reportingInstance` of Events.
    pub instance: String,
    /// Render backends with the cluster's ServingPolicies too (after `render.engine`'s, the
    /// built-ins), as the webhook evaluates them; `false`: only `render.engine`'s.
    pub cluster_policies: bool,
}

impl RunConfig {
    /// Defaults (all namespaces, 5-minute resync, 16 reconciles at once) with `render`.
    pub fn new(render: RenderConfig) -> Self {
        Self {
            render,
            namespace: None,
            requeue: Duration::from_secs(300),
            concurrency: 16,
            instance: "hearth-controller".to_owned(),
            cluster_policies: true,
        }
    }
}

/// What every reconcile shares.
pub struct Context {
    /// The API client.
    pub client: Client,
    /// Rendering settings.
    pub render: RenderConfig,
    /// Metrics.
    pub metrics: Metrics,
    /// Resync period.
    pub requeue: Duration,
    runtimes: Store<InferenceRuntime>,
    deployments: Store<Deployment>,
    claims: Store<PersistentVolumeClaim>,
    jobs: Store<Job>,
    services: Store<Service>,
    service_accounts: Store<ServiceAccount>,
    roles: Store<Role>,
    role_bindings: Store<RoleBinding>,
    pdbs: Store<PodDisruptionBudget>,
    keda: Arc<KedaState>,
    recorder: Recorder,
    policies: Option<policy::ClusterEngine>,
}

impl Context {
    /// Whether every cache the reconciler reads holds its first complete list. Before that, a
    /// child missing from a cache may exist: a create would meet it, and an apply would skip
    /// its adoption ([`adopt::foreign`]) and merge beside another manager's fields.
    fn caches_synced(&self) -> bool {
        use futures::FutureExt;
        fn synced<K: kube::Resource + Clone>(s: &Store<K>) -> bool
        where
            K::DynamicType: Eq + std::hash::Hash + Clone,
        {
            s.wait_until_ready().now_or_never().is_some()
        }
        synced(&self.runtimes)
            && synced(&self.deployments)
            && synced(&self.claims)
            && synced(&self.jobs)
            && synced(&self.services)
            && synced(&self.service_accounts)
            && synced(&self.roles)
            && synced(&self.role_bindings)
            && synced(&self.pdbs)
    }

    /// The render settings with the policies as they are now.
    fn render_config(&self) -> std::borrow::Cow<'_, RenderConfig> {
        match &self.policies {
            Some(p) => {
                let mut cfg = self.render.clone();
                cfg.engine = p.current();
                std::borrow::Cow::Owned(cfg)
            }
            None => std::borrow::Cow::Borrowed(&self.render),
        }
    }
}

fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}

fn get_in<K>(store: &Store<K>, namespace: &str, name: &str) -> Option<Arc<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    store.get(&ObjectRef::new(name).within(namespace))
}

/// Server-side apply of one namespaced child, forced (this controller is the owner of what it
/// sets). Unchanged content is a no-op in the apiserver.
async fn apply<K>(ctx: &Context, namespace: &str, obj: &K) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Serialize
        + DeserializeOwned
        + Clone
        + Debug,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), namespace);
    ctx.metrics.writes.inc();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
    .map_err(kube_err(format!(
        "apply {} {namespace}/{name}",
        K::kind(&())
    )))?;
    Ok(())
}

/// [`apply`] unless the watch cache already holds everything `obj` sets (see [`crate::diff`]):
/// an unchanged child costs no request at all.
async fn apply_cached<K>(
    ctx: &Context,
    namespace: &str,
    obj: &K,
    store: &Store<K>,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Serialize
        + DeserializeOwned
        + Clone
        + Debug
        + 'static,
{
    let name = obj.meta().name.clone().unwrap_or_default();
    let cached = get_in(store, namespace, &name);
    match cached {
        Some(c) if adopt::foreign(c.meta()) => adopt_child::<K>(ctx, namespace, &name).await?,
        Some(c) if diff::contains(c.as_ref(), obj) => return Ok(()),
        _ => {}
    }
    apply(ctx, namespace, obj).await
}

/// [`adopt::adopt`] for a child of kind `K`.
async fn adopt_child<K>(ctx: &Context, namespace: &str, name: &str) -> Result<(), Error>
where
    K: Resource<DynamicType = ()>,
{
    let resource = kube::api::ApiResource::erase::<K>(&());
    ctx.metrics.writes.inc();
    adopt::adopt(&ctx.client, &resource, namespace, name)
        .await
        .map_err(kube_err(format!(
            "adopt {} {namespace}/{name}",
            K::kind(&())
        )))?;
    Ok(())
}

/// How soon a reconcile that found the caches still listing runs again.
const CACHE_SYNC_RETRY: Duration = Duration::from_millis(500);

/// Reconciles one `LLMService`.
pub async fn reconcile(svc: Arc<LLMService>, ctx: Arc<Context>) -> Result<Action, Error> {
    let span = info_span!("reconcile", llmservice = %svc.name_any(), namespace = %svc.namespace().unwrap_or_default());
    async move {
        ctx.metrics.reconciles.inc();
        let start = Instant::now();
        let result = reconcile_inner(&svc, &ctx).await;
        ctx.metrics.observe(
            start.elapsed(),
            result.as_ref().err().map(Error::metric_label),
        );
        if let Err(e) = &result {
            tracing::warn!(error = %e, "reconcile failed");
            publish(
                &ctx,
                &svc,
                EventType::Warning,
                "ReconcileFailed",
                e.to_string(),
            )
            .await;
        }
        result
    }
    .instrument(span)
    .await
}

/// Requeue after a failure: exponential-ish by error class, never a hot loop.
pub fn error_policy(_svc: Arc<LLMService>, error: &Error, _ctx: Arc<Context>) -> Action {
    match error.metric_label() {
        "conflict" => Action::requeue(Duration::from_secs(1)),
        _ => Action::requeue(Duration::from_secs(15)),
    }
}

async fn publish(ctx: &Context, svc: &LLMService, type_: EventType, reason: &str, note: String) {
    let ev = KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &svc.object_ref(&())).await {
        tracing::debug!(error = %e, "publishing event failed");
    }
}

/// What a reconcile decides before it touches the cluster: the rules both the controller and
/// the admission webhook apply (`hearth_crds::rules::check_llmservice`), runtime resolution and
/// rendering. Pure, so its agreement with the webhook is tested without a cluster
/// (`tests/rules_agreement.rs`).
#[derive(Debug)]
pub struct Plan {
    /// The phase when nothing is rendered (`Degraded` for a spec error, `Pending` without a
    /// runtime); once children are applied their state decides it.
    pub phase: LLMServicePhase,
    /// The resolved runtime's name.
    pub resolved_runtime: Option<String>,
    /// The conditions decided so far: `Validated`, `RuntimeResolved`, and when nothing is
    /// rendered the `False` conditions saying why.
    pub conds: Vec<Cond>,
    /// The children to apply; `None` when the service cannot be rendered.
    pub children: Option<Children>,
}

/// Decides what to do with `svc` given the cluster's `runtimes`; `create_backend` as for
/// [`render::render`].
pub fn plan<'a>(
    svc: &LLMService,
    runtimes: impl IntoIterator<Item = &'a InferenceRuntime>,
    cfg: &RenderConfig,
    create_backend: bool,
) -> Plan {
    let resolved = resolve_runtime(svc, runtimes);
    let findings = rules::check_llmservice(svc, resolved.as_ref().ok().map(|r| r.runtime));
    let mut plan = Plan {
        phase: LLMServicePhase::Pending,
        resolved_runtime: None,
        conds: vec![status::validated(&findings)],
        children: None,
    };
    let resolved = match resolved {
        Err(e) => {
            plan.conds.push(Cond::new(
                status::RUNTIME_RESOLVED,
                Some(false),
                e.reason(),
                e.to_string(),
            ));
            if !findings.blocks_rendering() {
                plan.conds.push(not_ready_for(&e));
                return plan;
            }
            None
        }
        Ok(resolved) => {
            plan.resolved_runtime = Some(resolved.runtime.name_any());
            plan.conds.push(Cond::new(
                status::RUNTIME_RESOLVED,
                Some(true),
                resolved.reason,
                resolved.message.clone(),
            ));
            Some(resolved)
        }
    };
    // A spec error is reported whether or not there is a runtime: it is what to fix.
    if findings.blocks_rendering() {
        plan.phase = LLMServicePhase::Degraded;
        plan.conds.extend(status::rule_errors(&findings));
        return plan;
    }
    let Some(resolved) = resolved else {
        return plan;
    };
    match render::render(svc, resolved.runtime, cfg, create_backend) {
        Err(e) => {
            let (type_, reason) = e.condition();
            plan.phase = LLMServicePhase::Degraded;
            if type_ == status::CACHE_READY {
                plan.conds.push(Cond::new(
                    status::CACHE_READY,
                    Some(false),
                    reason,
                    e.to_string(),
                ));
                plan.conds.push(Cond::new(
                    status::READY,
                    Some(false),
                    "CacheNotReady",
                    "see the CacheReady condition",
                ));
            } else {
                plan.conds
                    .push(Cond::new(status::READY, Some(false), reason, e.to_string()));
            }
        }
        Ok(children) => plan.children = Some(children),
    }
    plan
}

async fn reconcile_inner(svc: &LLMService, ctx: &Context) -> Result<Action, Error> {
    if !ctx.caches_synced() {
        // The watches that fill them run beside the reconciles; this is the first second or so
        // after a start (or a regained lease).
        return Ok(Action::requeue(CACHE_SYNC_RETRY));
    }
    let name = svc.name_any();
    let namespace = svc.namespace().unwrap_or_default();
    let runtimes = ctx.runtimes.state();
    let backend_exists = get_in(&ctx.deployments, &namespace, &names::backend(&name)).is_some();
    let Plan {
        mut phase,
        resolved_runtime: resolved_name,
        mut conds,
        children,
    } = plan(
        svc,
        runtimes.iter().map(|r| r.as_ref()),
        &ctx.render_config(),
        !backend_exists,
    );
    let mut replicas = 0;
    if let Some(children) = children {
        let (p, r, mut others) =
            apply_children(svc, ctx, &namespace, children, backend_exists).await?;
        phase = p;
        replicas = r.0;
        conds.push(r.1);
        conds.append(&mut others);
    }

    // Stable condition order: Ready, RuntimeResolved, AutoscalingReady, CacheReady, Prewarmed,
    // Validated.
    let order = [
        status::READY,
        status::RUNTIME_RESOLVED,
        status::AUTOSCALING_READY,
        status::CACHE_READY,
        status::PREWARMED,
        status::VALIDATED,
    ];
    conds.sort_by_key(|c| {
        order
            .iter()
            .position(|t| *t == c.type_)
            .unwrap_or(order.len())
    });
    let previous = svc.status.clone().unwrap_or_default();
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let desired = LLMServiceStatus {
        phase: Some(phase),
        resolved_runtime: resolved_name,
        replicas: Some(replicas),
        endpoint_url: Some(format!(
            "http://{}.{namespace}.svc/v1",
            names::gateway_service(&name)
        )),
        observed_generation: svc.metadata.generation,
        conditions: status::merge_conditions(
            &previous.conditions,
            &conds,
            svc.metadata.generation,
            &now,
        ),
    };
    if status::differs(svc.status.as_ref(), &desired) {
        let api: Api<LLMService> = Api::namespaced(ctx.client.clone(), &namespace);
        let patch = serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMService",
            "status": desired,
        });
        ctx.metrics.writes.inc();
        api.patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(kube_err(format!(
            "apply status of LLMService {namespace}/{name}"
        )))?;
        emit_transitions(ctx, svc, &previous, &desired).await;
    }
    Ok(Action::requeue(ctx.requeue))
}

fn not_ready_for(e: &ResolveError) -> Cond {
    Cond::new(
        status::READY,
        Some(false),
        "RuntimeNotResolved",
        format!("no runtime: {e}"),
    )
}

/// Condition reasons that are the normal state of a service just created.
const EXPECTED_AT_START: &[&str] = &[
    "Creating",
    "GatewayNotReady",
    "BackendLoading",
    "AutoscalingNotReady",
    "ScaledObjectPending",
    "NotRequested",
    "NotApplicable",
    "Pending",
    "Downloading",
];

/// Events on phase changes and on conditions changing status or reason.
async fn emit_transitions(
    ctx: &Context,
    svc: &LLMService,
    old: &LLMServiceStatus,
    new: &LLMServiceStatus,
) {
    if old.phase != new.phase
        && let Some(phase) = new.phase
    {
        let from = old
            .phase
            .map(|p| format!("{p:?}"))
            .unwrap_or_else(|| "none".to_owned());
        publish(
            ctx,
            svc,
            EventType::Normal,
            &format!("{phase:?}"),
            format!("phase {from} -> {phase:?}"),
        )
        .await;
    }
    for c in &new.conditions {
        let before = old.conditions.iter().find(|o| o.type_ == c.type_);
        if before.is_some_and(|b| b.status == c.status && b.reason == c.reason) {
            continue;
        }
        // A first status says what is expected of a new service (creating, scaled to zero,
        // waiting on KEDA); only something the user should act on is worth an Event then.
        // Rule warnings (`Validated=True` with a reason other than `Valid`) are worth one.
        let warns = c.type_ == status::VALIDATED && c.reason != status::VALID;
        if before.is_none()
            && !warns
            && (c.status == "True" || EXPECTED_AT_START.contains(&c.reason.as_str()))
        {
            continue;
        }
        let type_ = if warns || c.status == "False" && c.type_ != status::PREWARMED {
            EventType::Warning
        } else {
            EventType::Normal
        };
        publish(
            ctx,
            svc,
            type_,
            &c.reason,
            format!("{}={}: {}", c.type_, c.status, c.message),
        )
        .await;
    }
}

type Applied = (LLMServicePhase, (i32, Cond), Vec<Cond>);

async fn apply_children(
    svc: &LLMService,
    ctx: &Context,
    namespace: &str,
    children: Children,
    backend_exists: bool,
) -> Result<Applied, Error> {
    let name = svc.name_any();
    let mut conds = Vec::new();

    apply_cached(
        ctx,
        namespace,
        &children.gateway_service_account,
        &ctx.service_accounts,
    )
    .await?;
    apply_cached(ctx, namespace, &children.gateway_role, &ctx.roles).await?;
    apply_cached(
        ctx,
        namespace,
        &children.gateway_role_binding,
        &ctx.role_bindings,
    )
    .await?;

    // Cache.
    let source = model::parse_source(&svc.spec.model).ok();
    match (&source, &children.cache_claim) {
        (Some(ModelSource::Pvc { claim, .. }), _) => conds.push(Cond::new(
            status::CACHE_READY,
            Some(true),
            "PreStaged",
            format!("weights are read from PersistentVolumeClaim {claim}, mounted read-only"),
        )),
        (_, Some(claim)) => {
            let claim_name = names::cache_claim(&name);
            let mut existing = get_in(&ctx.claims, namespace, &claim_name);
            if existing
                .as_deref()
                .is_some_and(|c| adopt::foreign(&c.metadata))
            {
                // An upstream installation's cache: keep it and its contents.
                adopt_child::<PersistentVolumeClaim>(ctx, namespace, &claim_name).await?;
                existing = None;
            }
            match replace_needed(existing.as_deref().map(|c| &c.metadata), &claim.metadata) {
                true => conds.push(Cond::new(
                    status::CACHE_READY,
                    Some(false),
                    "ReplaceRequired",
                    format!(
                        "spec.cache.storageClassName changed, and a claim's storage class cannot change: delete PersistentVolumeClaim {claim_name} (after scaling the backend to zero) to recreate it"
                    ),
                )),
                false if existing.as_deref().is_some_and(|c| diff::contains(c, claim)) => {
                    conds.push(status::cache_claim(existing.as_deref(), &claim_name))
                }
                false => match apply(ctx, namespace, claim).await {
                    Err(Error::Kube { source: kube::Error::Api(e), .. }) if e.code == 422 => conds.push(Cond::new(
                        status::CACHE_READY,
                        Some(false),
                        "ReplaceRequired",
                        format!(
                            "the apiserver rejected the cache claim change ({}): a claim can only grow; delete PersistentVolumeClaim {claim_name} to recreate it smaller",
                            e.message
                        ),
                    )),
                    Err(e) => return Err(e),
                    Ok(()) => conds.push(status::cache_claim(existing.as_deref(), &claim_name)),
                },
            }
        }
        _ => conds.push(match svc.spec.cache.strategy {
            CacheStrategy::HostPath => Cond::new(
                status::CACHE_READY,
                Some(true),
                "HostPath",
                format!(
                    "weights are cached on each node under {}",
                    ctx.render.host_path_root
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
    match &children.prewarm_job {
        Some(job) => {
            let existing = get_in(&ctx.jobs, namespace, &job_name);
            match existing {
                None => {
                    apply(ctx, namespace, job).await?;
                    conds.push(status::prewarm(None, &job_name));
                }
                Some(current)
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
                ))
                }
                // A Job is create-once: nothing to apply once it exists (an upstream
                // installation's included; its template cannot change).
                Some(current) => conds.push(status::prewarm(Some(&current), &job_name)),
            }
        }
        None => {
            let (reason, message) = match (&source, svc.spec.cache.prewarm, svc.spec.cache.strategy)
            {
                (_, false, _) => ("NotRequested", "cache.prewarm is false".to_owned()),
                (Some(ModelSource::Pvc { .. }), true, _) => (
                    "NotApplicable",
                    "pvc:// weights are pre-staged; there is nothing to download".to_owned(),
                ),
                (_, true, strategy) => (
                    "NoCache",
                    format!(
                        "cache.prewarm needs a cache to fill, but cache.strategy is {strategy:?}: use NodeLocalPVC or HostPath"
                    ),
                ),
            };
            conds.push(Cond::new(status::PREWARMED, Some(false), reason, message));
        }
    }

    // Backend.
    apply_cached(ctx, namespace, &children.backend_service, &ctx.services).await?;
    let backend_name = names::backend(&name);
    if backend_exists {
        let mut backend = children.backend;
        if let (Some(image), Some(live)) = (
            &ctx.render.drain_image,
            get_in(&ctx.deployments, namespace, &backend_name),
        ) && has_pods(&live)
            && upgrade::keep_live_images(&mut backend, &live, image)
        {
            // Applied when the backend is next at zero, or with its next template change.
            tracing::info!(deployment = %backend_name, %namespace, new_image = %image, "keeping the running pods' drain sidecar image, so this upgrade does not restart them");
        }
        apply_cached(ctx, namespace, &backend, &ctx.deployments).await?;
    } else {
        // An earlier version of this controller named the backend `<name>-backend`: remove it
        // first, so two backends never hold accelerators at once.
        delete_if_owned(
            ctx,
            namespace,
            &names::legacy_backend(&name),
            svc,
            &ctx.deployments,
        )
        .await?;
        // A plain create: `spec.replicas` stays with the create entry of managedFields, so the
        // later applies (which leave it out) never reset it.
        let api: Api<Deployment> = Api::namespaced(ctx.client.clone(), namespace);
        ctx.metrics.writes.inc();
        let pp = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..Default::default()
        };
        match api.create(&pp, &children.backend).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 409 => {
                // The cache was behind (a controller just started): it exists. Apply without
                // replicas, keeping the running pods' drain image as above.
                let mut backend = children.backend.clone();
                if let Some(spec) = backend.spec.as_mut() {
                    spec.replicas = None;
                }
                let live = api.get(&backend_name).await.map_err(kube_err(format!(
                    "get Deployment {namespace}/{backend_name}"
                )))?;
                if adopt::foreign(&live.metadata) {
                    adopt_child::<Deployment>(ctx, namespace, &backend_name).await?;
                }
                if let Some(image) = &ctx.render.drain_image
                    && has_pods(&live)
                {
                    upgrade::keep_live_images(&mut backend, &live, image);
                }
                apply(ctx, namespace, &backend).await?;
            }
            Err(e) => {
                return Err(kube_err(format!(
                    "create Deployment {namespace}/{backend_name}"
                ))(e));
            }
        }
    }

    // Gateway.
    apply_cached(ctx, namespace, &children.gateway_service, &ctx.services).await?;
    if let Some(s) = &children.scaler_service {
        apply_cached(ctx, namespace, s, &ctx.services).await?;
    } else {
        delete_if_owned(
            ctx,
            namespace,
            &names::scaler_service(&name),
            svc,
            &ctx.services,
        )
        .await?;
    }
    // A Deployment's selector is immutable: a gateway an earlier version of this controller
    // wrote with other selector labels is replaced (it holds no state).
    let gateway_name = names::gateway(&name);
    if let Some(live) = get_in(&ctx.deployments, namespace, &gateway_name)
        && live.spec.as_ref().map(|s| &s.selector)
            != children.gateway.spec.as_ref().map(|s| &s.selector)
    {
        delete_if_owned(ctx, namespace, &gateway_name, svc, &ctx.deployments).await?;
    }
    apply_cached(ctx, namespace, &children.gateway, &ctx.deployments).await?;
    apply_cached(ctx, namespace, &children.gateway_pdb, &ctx.pdbs).await?;

    // Autoscaling.
    let keda = if ctx.keda.installed() {
        let so_name = names::scaled_object(&name);
        let cached = ctx.keda.get(namespace, &so_name);
        if cached
            .as_deref()
            .is_some_and(|c| diff::contains(c, &children.scaled_object))
        {
            status::autoscaling(true, cached.as_deref())
        } else {
            if cached
                .as_deref()
                .is_some_and(|c| adopt::foreign(&c.metadata))
            {
                ctx.metrics.writes.inc();
                adopt::adopt(&ctx.client, &ctx.render.keda_api, namespace, &so_name)
                    .await
                    .map_err(kube_err(format!(
                        "adopt ScaledObject {namespace}/{so_name}"
                    )))?;
            }
            let api: Api<DynamicObject> =
                Api::namespaced_with(ctx.client.clone(), namespace, &ctx.render.keda_api);
            ctx.metrics.writes.inc();
            match api
                .patch(
                    &so_name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(&children.scaled_object),
                )
                .await
            {
                Ok(_) => status::autoscaling(true, cached.as_deref()),
                // The CRD went away between the check and the apply.
                Err(kube::Error::Api(e)) if e.code == 404 => status::autoscaling(false, None),
                Err(e) => {
                    return Err(kube_err(format!(
                        "apply ScaledObject {namespace}/{so_name}"
                    ))(e));
                }
            }
        }
    } else {
        status::autoscaling(false, None)
    };
    conds.push(keda);

    let backend =
        status::BackendState::of(get_in(&ctx.deployments, namespace, &backend_name).as_deref());
    let backend = if backend.exists {
        backend
    } else {
        // Just created: what was created.
        status::BackendState {
            exists: true,
            desired: svc.spec.scaling.min,
            ready: 0,
            stuck: false,
        }
    };
    let gateway_ready = status::gateway_ready(
        get_in(&ctx.deployments, namespace, &names::gateway(&name)).as_deref(),
    );
    let (phase, mut ready) = status::phase_and_ready(backend, gateway_ready, &conds);
    if ready.reason == "GatewayNotReady"
        && let Some(r) = &svc.spec.endpoint.api_key_secret_ref
    {
        // The controller may not read Secrets; say where to look when it is the likely cause.
        ready.message = format!(
            "{}; the gateway mounts the API keys from key {:?} of Secret {:?}: until both exist its pods wait in ContainerCreating (FailedMount events on the pods of Deployment {})",
            ready.message,
            r.key,
            r.name,
            names::gateway(&name)
        );
    }
    Ok((phase, (backend.ready, ready), conds))
}

/// Whether a Deployment wants or still has pods: a template change would restart them. At
/// zero replicas it costs nothing, so Hearth's own image updates are applied then (see
/// [`upgrade::keep_live_images`]).
fn has_pods(d: &Deployment) -> bool {
    d.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1) > 0
        || d.status.as_ref().and_then(|s| s.replicas).unwrap_or(0) > 0
}

/// Whether a create-once child must be replaced: it exists with a different template hash.
fn replace_needed(
    existing: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta>,
    desired: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
) -> bool {
    let hash = |m: &k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta| {
        m.annotations
            .as_ref()
            .and_then(|a| a.get(TEMPLATE_HASH_ANNOTATION))
            .cloned()
    };
    existing.is_some_and(|e| hash(e) != hash(desired))
}

/// Deletes a child that is no longer wanted (for example the scaler Service after switching back
/// to poll mode), only if this service controls it.
async fn delete_if_owned<K>(
    ctx: &Context,
    namespace: &str,
    name: &str,
    owner: &LLMService,
    cache: &Store<K>,
) -> Result<(), Error>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Serialize
        + DeserializeOwned
        + Clone
        + Debug
        + 'static,
{
    // The watch cache answers "is it there?"; only an actual deletion costs a request.
    let owned = get_in(cache, namespace, name).is_some_and(|o| {
        o.meta()
            .owner_references
            .iter()
            .flatten()
            .any(|r| Some(&r.uid) == owner.metadata.uid.as_ref())
    });
    let api: Api<K> = Api::namespaced(ctx.client.clone(), namespace);
    if owned {
        ctx.metrics.writes.inc();
        match api.delete(name, &Default::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(kube_err(format!(
                    "delete {} {namespace}/{name}",
                    K::kind(&())
                ))(e));
            }
        }
    }
    Ok(())
}

fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    client: Client,
    cfg: RunConfig,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), Error> {
    let ns = cfg.namespace.as_deref();
    let managed = watcher::Config::default().labels(&labels::managed_selector());

    let (runtimes, runtime_writer) = reflector::store::<InferenceRuntime>();
    let runtime_stream = watcher(
        Api::<InferenceRuntime>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|r| r.metadata.managed_fields = None)
    .reflect(runtime_writer)
    .touched_objects();
    // Children whose status feeds ours trigger a reconcile only when what we read changes
    // (see `relevant`): KEDA, kwok and the Deployment controller update status often.
    let (deployments, dep_stream) =
        cached_watch_filtered::<Deployment>(&client, ns, &managed, |d| {
            let b = status::BackendState::of(Some(d));
            relevant(d, &(b.desired, b.ready, b.stuck))
        });
    let (claims, claim_stream) =
        cached_watch_filtered::<PersistentVolumeClaim>(&client, ns, &managed, |c| {
            relevant(
                c,
                &(
                    c.status.as_ref().and_then(|s| s.phase.clone()),
                    c.spec
                        .as_ref()
                        .and_then(|s| s.resources.clone())
                        .map(|r| serde_json::to_string(&r).unwrap_or_default()),
                ),
            )
        });
    let (jobs, job_stream) = cached_watch_filtered::<Job>(&client, ns, &managed, |j| {
        relevant(j, &status::prewarm(Some(j), "").reason)
    });
    let (services_store, services_stream) = cached_watch::<Service>(&client, ns, &managed);
    let (sa_store, sa_stream) = cached_watch::<ServiceAccount>(&client, ns, &managed);
    let (roles_store, roles_stream) = cached_watch::<Role>(&client, ns, &managed);
    let (rb_store, rb_stream) = cached_watch::<RoleBinding>(&client, ns, &managed);
    let (pdb_store, pdb_stream) =
        cached_watch_filtered::<PodDisruptionBudget>(&client, ns, &managed, |p| relevant(p, &()));

    let keda = Arc::new(KedaState {
        api: cfg.render.keda_api.clone(),
        installed: AtomicBool::new(false),
        store: RwLock::new(None),
    });
    let crd_api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crd_name(&keda.api);
    let initial = crd_api
        .get_opt(&crd)
        .await
        .map_err(kube_err(format!("get CustomResourceDefinition {crd}")))?;
    keda.installed
        .store(initial.as_ref().is_some_and(established), Ordering::SeqCst);
    let (all_tx, all_rx) = mpsc::unbounded::<()>();
    let (one_tx, one_rx) = mpsc::unbounded::<ObjectRef<LLMService>>();
    tokio::spawn(watch_keda(
        client.clone(),
        ns.map(str::to_owned),
        keda.clone(),
        all_tx.clone(),
        one_tx,
    ));

    let policies = if cfg.cluster_policies {
        Some(watch_policies(client.clone(), &cfg.render.engine, all_tx.clone()).await)
    } else {
        None
    };

    let ctx = Arc::new(Context {
        client: client.clone(),
        render: cfg.render.clone(),
        metrics,
        requeue: cfg.requeue,
        runtimes,
        deployments,
        claims,
        jobs,
        services: services_store,
        service_accounts: sa_store,
        roles: roles_store,
        role_bindings: rb_store,
        pdbs: pdb_store,
        keda,
        policies,
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.to_owned(),
                instance: Some(cfg.instance.clone()),
            },
        ),
    });

    // The services' own cache, without managedFields (most of each object's size).
    let (service_store, service_writer) = reflector::store::<LLMService>();
    let service_stream = watcher(
        scoped::<LLMService>(&client, ns),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|s| s.metadata.managed_fields = None)
    .reflect(service_writer)
    .applied_objects();
    // No debounce: kube-runtime's is trailing-edge (each new trigger restarts the wait), so an
    // LLMService edited, or with a child changing, more often than the debounce period was
    // never reconciled while that went on (a gateway kept its old image through a Hearth
    // upgrade while the service was edited several times a second). The scheduler already
    // merges triggers for an object that is queued or being reconciled into one more run.
    let controller = Controller::for_stream(service_stream, service_store)
        .with_config(ControllerConfig::default().concurrency(cfg.concurrency));
    let service_store = controller.store();
    controller
        .owns_stream(dep_stream)
        .owns_stream(claim_stream)
        .owns_stream(job_stream)
        .owns_stream(services_stream)
        .owns_stream(sa_stream)
        .owns_stream(roles_stream)
        .owns_stream(rb_stream)
        .owns_stream(pdb_stream)
        .watches_stream(runtime_stream, move |rt: InferenceRuntime| {
            let rt_name = rt.name_any();
            service_store
                .state()
                .into_iter()
                .filter(|s| uses_runtime(s, &rt_name, &rt.spec.vendor))
                .map(|s| ObjectRef::from_obj(s.as_ref()))
                .collect::<Vec<_>>()
        })
        .reconcile_all_on(all_rx)
        .reconcile_on(one_rx)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "controller event");
            }
        })
        .await;
    Ok(())
}

/// Watches the cluster's ServingPolicies and keeps a [`policy::ClusterEngine`] of `base`'s
/// policies (the built-ins) and theirs, built like the webhook's set. Returns once the first
/// complete list is in, so no backend is rendered without the platform's policies (and then
/// re-rendered, restarting its pods). Every change (debounced by [`policy::DEBOUNCE`]) that
/// changes the set reconciles every service through `all_tx`.
async fn watch_policies(
    client: Client,
    base: &policy::Engine,
    all_tx: mpsc::UnboundedSender<()>,
) -> policy::ClusterEngine {
    use hearth_crds::ServingPolicy;
    let engine = policy::ClusterEngine::new(base.clone());
    let builtins: Arc<[ServingPolicy]> = base.policies().into();
    let (store, writer) = reflector::store::<ServingPolicy>();
    let changed = Arc::new(tokio::sync::Notify::new());
    let notify = changed.clone();
    let stream = watcher(
        Api::<ServingPolicy>::all(client),
        watcher::Config::default(),
    )
    .default_backoff()
    .modify(|p| p.metadata.managed_fields = None)
    .reflect(writer)
    .touched_objects();
    tokio::spawn(async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            if let Err(e) = ev {
                tracing::warn!(error = %e, "watching ServingPolicies; retrying (backends are rendered with the last list)");
            }
            notify.notify_one();
        }
    });
    tracing::info!("waiting for the list of ServingPolicies");
    let _ = store.wait_until_ready().await;
    let mut last_good = hearth_policies::cluster::LastGood::default();
    engine.rebuild(&builtins, &mut last_good, &store.state());
    tracing::info!(policies = ?engine.current().names(), "rendering backends with these ServingPolicies");
    let task_engine = engine.clone();
    tokio::spawn(async move {
        loop {
            changed.notified().await;
            tokio::time::sleep(policy::DEBOUNCE).await;
            if task_engine.rebuild(&builtins, &mut last_good, &store.state()) {
                tracing::info!(policies = ?task_engine.current().names(), "ServingPolicies changed; reconciling every service");
                if all_tx.unbounded_send(()).is_err() {
                    break;
                }
            }
        }
    });
    engine
}

/// Whether a runtime change may concern a service: it pins the runtime, selects its vendor, or
/// currently resolves to it.
fn uses_runtime(svc: &LLMService, rt_name: &str, vendor: &str) -> bool {
    let sel = &svc.spec.runtime;
    sel.name.as_deref() == Some(rt_name)
        || sel
            .selector
            .as_ref()
            .is_some_and(|s| s.vendor.iter().any(|v| v == vendor))
        || svc
            .status
            .as_ref()
            .and_then(|s| s.resolved_runtime.as_deref())
            == Some(rt_name)
}

/// A cache of managed children of kind `K` (without `managedFields`) and the stream that feeds
/// it, for `owns_stream`.
fn cached_watch<K>(
    client: &Client,
    namespace: Option<&str>,
    selector: &watcher::Config,
) -> (
    Store<K>,
    impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + DeserializeOwned
        + Clone
        + Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store::<K>();
    let stream = watcher(scoped::<K>(client, namespace), selector.clone())
        .default_backoff()
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .reflect(writer)
        .touched_objects();
    (store, stream)
}

/// A hash of what a reconcile reads from a child: its generation (spec changes), the metadata
/// the controller sets (labels, annotations, owner references) and `extra` from its status.
fn relevant<K: Resource, X: Hash>(obj: &K, extra: &X) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let meta = obj.meta();
    meta.generation.hash(&mut h);
    meta.labels.hash(&mut h);
    meta.annotations.hash(&mut h);
    for o in meta.owner_references.iter().flatten() {
        (&o.uid, o.controller).hash(&mut h);
    }
    extra.hash(&mut h);
    h.finish()
}

/// Like [`cached_watch`], but an update passes only when `relevant` changes; deletions always
/// pass (a deleted child must be recreated).
fn cached_watch_filtered<K>(
    client: &Client,
    namespace: Option<&str>,
    selector: &watcher::Config,
    relevant: impl Fn(&K) -> u64 + Send + 'static,
) -> (
    Store<K>,
    impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
)
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + DeserializeOwned
        + Clone
        + Debug
        + Send
        + Sync
        + 'static,
{
    let (store, writer) = reflector::store::<K>();
    let mut seen: HashMap<(Option<String>, String), u64> = HashMap::new();
    let stream = watcher(scoped::<K>(client, namespace), selector.clone())
        .default_backoff()
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .reflect(writer)
        .filter_map(move |event| {
            let out = match event {
                Ok(watcher::Event::Delete(o)) => {
                    seen.remove(&(o.namespace(), o.name_any()));
                    Some(Ok(o))
                }
                Ok(watcher::Event::Apply(o)) | Ok(watcher::Event::InitApply(o)) => {
                    let h = relevant(&o);
                    match seen.insert((o.namespace(), o.name_any()), h) {
                        Some(old) if old == h => None,
                        _ => Some(Ok(o)),
                    }
                }
                Ok(watcher::Event::Init) | Ok(watcher::Event::InitDone) => None,
                Err(e) => Some(Err(e)),
            };
            futures::future::ready(out)
        });
    (store, stream)
}

fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

/// Watches the ScaledObject CRD; when it becomes established, starts the ScaledObject cache
/// and reconciles every service; ScaledObject changes reconcile their owner.
async fn watch_keda(
    client: Client,
    namespace: Option<String>,
    keda: Arc<KedaState>,
    all_tx: mpsc::UnboundedSender<()>,
    one_tx: mpsc::UnboundedSender<ObjectRef<LLMService>>,
) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let cfg = watcher::Config::default().fields(&format!("metadata.name={}", crd_name(&keda.api)));
    let mut events = watcher(crds, cfg).default_backoff().boxed();
    let mut cache_started = false;
    while let Some(event) = events.next().await {
        let now_installed = match event {
            Ok(watcher::Event::Apply(crd)) | Ok(watcher::Event::InitApply(crd)) => {
                established(&crd)
            }
            Ok(watcher::Event::Delete(_)) => false,
            Ok(watcher::Event::Init) | Ok(watcher::Event::InitDone) => continue,
            Err(e) => {
                tracing::debug!(error = %e, "watching the KEDA CRD");
                continue;
            }
        };
        if now_installed && !cache_started {
            cache_started = true;
            let writer = reflector::store::Writer::new(keda.api.clone());
            let store = writer.as_reader();
            if let Ok(mut guard) = keda.store.write() {
                *guard = Some(store);
            }
            let ar = keda.api.clone();
            let api: Api<DynamicObject> = match &namespace {
                Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
                None => Api::all_with(client.clone(), &ar),
            };
            let tx = one_tx.clone();
            let managed = watcher::Config::default().labels(&labels::managed_selector());
            tokio::spawn(async move {
                let mut stream = watcher(api, managed)
                    .default_backoff()
                    .modify(|o: &mut DynamicObject| o.metadata.managed_fields = None)
                    .reflect(writer)
                    .boxed();
                // KEDA rewrites status often; only a change of what we read triggers, and a
                // deletion (the ScaledObject must be recreated).
                let mut seen: HashMap<(Option<String>, String), u64> = HashMap::new();
                while let Some(event) = stream.next().await {
                    let obj = match event {
                        Ok(watcher::Event::Delete(obj)) => {
                            seen.remove(&(obj.namespace(), obj.name_any()));
                            obj
                        }
                        Ok(watcher::Event::Apply(obj)) | Ok(watcher::Event::InitApply(obj)) => {
                            let ready = status::autoscaling(true, Some(&obj));
                            let h = relevant(&obj, &(ready.status, ready.reason, ready.message));
                            if seen.insert((obj.namespace(), obj.name_any()), h) == Some(h) {
                                continue;
                            }
                            obj
                        }
                        _ => continue,
                    };
                    let owner = obj.labels().get(LLMSERVICE_LABEL).cloned();
                    if let (Some(owner), Some(ns)) = (owner, obj.namespace()) {
                        let _ = tx.unbounded_send(ObjectRef::new(&owner).within(&ns));
                    }
                }
            });
        }
        if keda.installed.swap(now_installed, Ordering::SeqCst) != now_installed {
            tracing::info!(installed = now_installed, "KEDA ScaledObject CRD changed");
            let _ = all_tx.unbounded_send(());
        }
    }
}

//! The `LLMService` reconciler (kube-runtime `Controller`, shaped like kube-rs controller-rs):
//! `reconcile(obj, ctx) -> Result<Action, Error>`, children and status written with server-side
//! apply under one field manager. A reconcile is a plan and its execution:
//!
//! 1. [`desired()`] (`desired.rs`): the rules, runtime resolution and rendering: what the spec
//!    asks for;
//! 2. [`plan()`] (`plan.rs`): that against one [`View`] of the watch caches: every write
//!    (apply, adopt, create, replace, delete-if-owned, or nothing), every condition and the
//!    phase. Both steps are pure;
//! 3. [`execute()`] (`execute.rs`): the writes as API calls, in order, and the API's answers as
//!    conditions ([`recovery`]); then the status, when it differs, with a newly recorded
//!    activation (`crate::activation`: a backend pod's 0→1, from the pod cache and its Events).
//!
//! `watch.rs` holds the watches that fill the caches and trigger reconciles.
//!
//! A second controller in the same process reconciles `LLMEndpoint`s (`endpoint.rs`): their
//! shared gateways and routing tables; a third, plain Deployments that join one with the
//! `serving.hearth.dev/endpoint` annotation (`member.rs`): their Service, member RBAC and
//! ScaledObject. All decide attachment with the same pure function over the same caches
//! ([`crate::attach`]); the watch mapping between them is in [`run`].
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
    collections::{BTreeMap, HashMap},
    future::Future,
    sync::{
        Arc, RwLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{StreamExt, channel::mpsc};
use hearth_crds::{
    InferenceRuntime, LLMAdapter, LLMEndpoint, LLMService, LLMServiceStatus,
    llmendpoint::{FromNamespaces, MemberKind, routes_config_map},
    wellknown::{FIELD_MANAGER, LLMSERVICE_LABEL},
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        batch::v1::Job,
        core::v1::{
            ConfigMap, Event as CoreEvent, Namespace, PersistentVolumeClaim, Pod, Service,
            ServiceAccount,
        },
        networking::v1::NetworkPolicy,
        policy::v1::PodDisruptionBudget,
        rbac::v1::{Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::Time,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DynamicObject, ListParams, PartialObjectMeta},
    runtime::{
        Controller, WatchStreamExt,
        controller::{Action, Config as ControllerConfig},
        events::{Event as KubeEvent, EventType, Recorder, Reporter},
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};

use tracing::{Instrument, info_span};

use crate::{
    activation::{self, Timeline},
    attach::{Attachment, EndpointKey, attach, deployment_endpoint_key, endpoint_key},
    labels,
    metrics::Metrics,
    names, policy,
    render::{Placement, RenderConfig, SharedGateway},
    status,
};

mod adapter;
mod desired;
mod endpoint;
mod execute;
mod handover;
mod member;
mod metering;
mod plan;
#[cfg(test)]
mod tests;
mod watch;
mod write;

pub use desired::{Desired, Membership, desired};
pub use endpoint::{
    ACCEPTED, EndpointPlan, EndpointView, HOLD_RETRY, held_routes, plan_endpoint, route_table,
};
pub use execute::execute;
pub use member::{
    MemberDecision, MemberOutcome, MemberState, MemberView, decide_member, member_runtime,
    member_serving, plan_member,
};
pub use plan::{CONDITION_ORDER, Plan, Recovery, View, after_conflict, plan, recovery};
pub use write::{Kind, Object, Target, Write};

pub(crate) use watch::scoped;
use watch::{
    cached_watch, established, relevant, tap_endpoint_owners, tap_member_owners, uses_runtime,
    watch_keda, watch_policies, without_errors,
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
    /// Rendering on the blocking pool did not finish (it panicked, or the runtime is
    /// shutting down).
    #[error("rendering the desired objects: {0}")]
    Render(String),
    /// The ExternalScaler's certificates could not be made or written (`crate::scaler_tls`).
    #[error("ExternalScaler certificates: {0}")]
    Certificate(String),
}

impl Error {
    /// The HTTP status of the API's answer, when the apiserver answered.
    fn api_code(&self) -> Option<u16> {
        match self {
            Error::Kube {
                source: kube::Error::Api(e),
                ..
            } => Some(e.code),
            Error::Kube { .. } | Error::Serialize(_) | Error::Render(_) | Error::Certificate(_) => {
                None
            }
        }
    }

    /// The `reason` label of `hearth_controller_reconcile_errors_total`.
    pub fn metric_label(&self) -> &'static str {
        match (self, self.api_code()) {
            (Error::Kube { .. }, Some(409)) => "conflict",
            (Error::Kube { .. }, Some(422)) => "invalid",
            (Error::Kube { .. }, Some(403)) => "forbidden",
            (Error::Kube { .. }, _) => "kube_api",
            (Error::Serialize(_), _) => "serialize",
            (Error::Render(_), _) => "render",
            (Error::Certificate(_), _) => "certificate",
        }
    }

    /// How long to wait before the failed reconcile runs again: [`CONFLICT_RETRY`] after a 409
    /// (someone wrote the object between our read and our write: the next try will likely
    /// pass), [`ERROR_RETRY`] after anything else. Never a hot loop.
    pub fn backoff(&self) -> Duration {
        match self {
            Error::Kube {
                source: kube::Error::Api(e),
                ..
            } if e.code == 409 => CONFLICT_RETRY,
            Error::Kube { .. } | Error::Serialize(_) | Error::Render(_) | Error::Certificate(_) => {
                ERROR_RETRY
            }
        }
    }
}

/// Requeue delay after a conflict (409).
pub const CONFLICT_RETRY: Duration = Duration::from_secs(1);
/// Requeue delay after any other error.
pub const ERROR_RETRY: Duration = Duration::from_secs(15);

/// KEDA's presence and, once present, a cache of ScaledObjects.
pub struct KedaState {
    api: kube::api::ApiResource,
    installed: AtomicBool,
    /// Its version, from the CRD's label; the render reads the same handle.
    version: crate::versions::KedaVersion,
    store: RwLock<Option<Store<DynamicObject>>>,
}

impl KedaState {
    /// Whether the ScaledObject CRD is installed and established.
    pub fn installed(&self) -> bool {
        self.installed.load(Ordering::SeqCst)
    }

    /// Records KEDA's version from its CRD `crd` ([`crate::versions::keda_version_of`]);
    /// whether what KEDA can do changed (the ScaledObjects are then rendered again).
    fn learn_version(&self, crd: &CustomResourceDefinition) -> bool {
        let version = crate::versions::keda_version_of(crd);
        if version != self.version.get() {
            match version {
                Some(v) if v < crate::versions::OLDEST_KEDA => tracing::error!(
                    keda = %v,
                    "KEDA is older than {}, the oldest Hearth is tested with; upgrade KEDA (docs/versioning.md)",
                    crate::versions::OLDEST_KEDA
                ),
                Some(v) if v < crate::versions::KEDA_ENDPOINT_AGGREGATION => tracing::warn!(
                    keda = %v,
                    "KEDA is older than {}: poll triggers ask one gateway replica for the demand summed over its peers, instead of KEDA summing every replica's (aggregateFromKubeServiceEndpoints); upgrade KEDA to {} or later",
                    crate::versions::KEDA_ENDPOINT_AGGREGATION,
                    crate::versions::KEDA_ENDPOINT_AGGREGATION
                ),
                Some(v) => tracing::info!(keda = %v, "KEDA version"),
                None => tracing::info!(
                    "KEDA's CRD carries no release version label (app.kubernetes.io/version): assuming a current KEDA"
                ),
            }
        }
        self.version.set(version)
    }

    fn get(&self, namespace: &str, name: &str) -> Option<Arc<DynamicObject>> {
        let guard = self.store.read().ok()?;
        let store = guard.as_ref()?;
        store.get(&ObjectRef::new_with(name, self.api.clone()).within(namespace))
    }

    /// The ScaledObject `namespace/name` read from the apiserver, for when the cache does not
    /// hold it: just created, or the cache's watch is still starting on a CRD that has just
    /// appeared (a list or watch refused while the apiserver readies its storage is retried
    /// with backoff). `None` when it does not exist.
    ///
    /// # Errors
    /// [`Error::Kube`] when the read fails.
    async fn read(
        &self,
        client: &kube::Client,
        namespace: &str,
        name: &str,
    ) -> Result<Option<Arc<DynamicObject>>, Error> {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &self.api);
        let found = api
            .get_opt(name)
            .await
            .map_err(kube_err(format!("get ScaledObject {namespace}/{name}")))?;
        Ok(found.map(|mut o| {
            o.metadata.managed_fields = None;
            Arc::new(o)
        }))
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
    /// Device handover (`crate::handover`): a cold service whose backend waits for its
    /// accelerator may take an idle service's. `false` only stops new handovers.
    pub device_handover: bool,
    /// The ExternalScaler certificates' CA and lifetime (`crate::scaler_tls`; on with
    /// `render.scaler_tls`).
    pub scaler_tls: crate::scaler_tls::ScalerTlsConfig,
    /// The admin tokens (`crate::admin_tokens`); required with `render.admin_auth`, whose
    /// gateways need their admin Secrets.
    pub admin_tokens: Option<crate::admin_tokens::AdminTokens>,
    /// Where KEDA's client certificate for the shared gateways is kept and published
    /// ([`crate::scaler_tls::maintain_shared`], with `render.shared_scaler_auth`); `None`: held
    /// in memory only (tests).
    pub shared_client_home: Option<crate::scaler_tls::SharedClientHome>,
    /// Background scans of the workloads that already run against the ServingPolicies
    /// (`crate::scan`; with `cluster_policies`); `None`: no scans.
    pub policy_scan: Option<crate::scan::ScanConfig>,
    /// The export of ServingPolicies to ValidatingAdmissionPolicy and MutatingAdmissionPolicy
    /// (`crate::export`; with `cluster_policies`); `None`: not exported.
    pub policy_export: Option<crate::export::ExportConfig>,
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
            device_handover: true,
            scaler_tls: crate::scaler_tls::ScalerTlsConfig::default(),
            admin_tokens: None,
            shared_client_home: None,
            policy_scan: None,
            policy_export: None,
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
    /// The gateways' and backends' NetworkPolicies.
    network_policies: Store<NetworkPolicy>,
    /// Backend pods ([`labels::backend_pod_selector`]): activations are read from them.
    pods: Store<Pod>,
    /// The image pulls the kubelet's Events say failed, by pod UID ([`PullFailures`]).
    pull_failures: Arc<PullFailures>,
    /// Endpoints' routing tables.
    config_maps: Store<ConfigMap>,
    /// The LLMEndpoints.
    endpoints: Store<LLMEndpoint>,
    /// The LLMServices (the services' controller's own cache).
    llmservices: Store<LLMService>,
    /// The namespaces' labels (an endpoint's `allowedServices` selector reads them).
    namespaces: Store<PartialObjectMeta<Namespace>>,
    /// The LLMAdapters (the adapters' controller's own cache).
    adapters: Store<LLMAdapter>,
    /// Reconciles a service now (its endpoint decided something its status does not say yet).
    service_tx: mpsc::UnboundedSender<ObjectRef<LLMService>>,
    /// The Deployments that join an endpoint (the `serving.hearth.dev/endpoint` annotation),
    /// lean ([`watch::lean_member`]); no other Deployment of the cluster is kept.
    members: Store<Deployment>,
    /// Reconciles a member Deployment now.
    member_tx: mpsc::UnboundedSender<ObjectRef<Deployment>>,
    /// Removes the objects of a Deployment that left ([`member::sweep`]).
    sweep_tx: mpsc::UnboundedSender<member::Sweep>,
    /// What each member's last reconcile acted on (its Events are sent on changes), by
    /// namespace and name.
    member_states: std::sync::Mutex<HashMap<(String, String), MemberState>>,
    keda: Arc<KedaState>,
    recorder: Recorder,
    policies: Option<policy::ClusterEngine>,
    /// The device handover's settings and lock.
    handover: handover::Handover,
    /// Lifetime of the ExternalScaler certificates.
    pub scaler_tls: crate::scaler_tls::ScalerTlsConfig,
    /// The TriggerAuthentications applied ([`crate::scaler_tls::Applied`]).
    trigger_auths: crate::scaler_tls::Applied,
    /// The ExternalScaler certificates this process issued ([`crate::scaler_tls::Records`]).
    pub(crate) scaler_records: crate::scaler_tls::Records,
    /// KEDA's client certificate for the shared gateways, when they use mutual TLS
    /// ([`crate::scaler_tls::maintain_shared`] renews it).
    shared_client: std::sync::RwLock<Option<crate::scaler_tls::SharedClient>>,
    /// The admin tokens, when the gateways' admin ports check them.
    pub(crate) admin_tokens: Option<crate::admin_tokens::AdminTokens>,
    /// The gateways' admin Secrets written ([`crate::admin_tokens::step`]).
    pub(crate) admin_secrets: crate::scaler_tls::Applied,
}

impl Context {
    /// Whether KEDA's ScaledObject CRD is installed and established.
    pub(crate) fn keda_installed(&self) -> bool {
        self.keda.installed()
    }

    /// Whether the TriggerAuthentication of service `ns/name` is to be applied for `digest`
    /// (changed, or not applied for a resync period).
    pub(crate) fn trigger_auth_stale(&self, ns: &str, name: &str, digest: &str) -> bool {
        self.trigger_auths.stale(ns, name, digest, self.requeue)
    }

    /// Records the TriggerAuthentication of service `ns/name` as applied with `digest`.
    pub(crate) fn trigger_auth_applied(&self, ns: &str, name: &str, digest: String) {
        self.trigger_auths.record(ns, name, digest);
    }

    /// KEDA's client certificate for the shared gateways, when they use mutual TLS.
    pub(crate) fn shared_client(&self) -> Option<crate::scaler_tls::SharedClient> {
        self.shared_client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Its digest, the `tlsDigest` of push triggers on shared gateways.
    pub(crate) fn shared_client_digest(&self) -> Option<String> {
        self.shared_client
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|c| c.record.digest())
    }

    /// Replaces it (a renewal).
    pub(crate) fn set_shared_client(&self, client: crate::scaler_tls::SharedClient) {
        *self
            .shared_client
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(client);
    }

    /// Forgets the TriggerAuthentication of service `ns/name` (deleted).
    pub(crate) fn trigger_auth_forget(&self, ns: &str, name: &str) {
        self.trigger_auths.forget(ns, name);
    }

    /// Whether every cache the reconciler reads holds its first complete list. Before that, a
    /// child missing from a cache may exist: a create would meet it, and an apply would skip
    /// its adoption ([`crate::adopt::foreign`]) and merge beside another manager's fields.
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
            && synced(&self.network_policies)
            && synced(&self.pods)
            && synced(&self.config_maps)
            && synced(&self.endpoints)
            && synced(&self.llmservices)
            && synced(&self.namespaces)
            && synced(&self.members)
            && synced(&self.adapters)
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

    /// Which services and Deployments the endpoint `key` accepts (and those that reference
    /// it), from the caches; `current`, the service being reconciled, in place of its cached
    /// version.
    fn attachment(
        &self,
        key: &EndpointKey,
        current: Option<&LLMService>,
    ) -> (Attachment, Vec<Arc<LLMService>>, Vec<Arc<Deployment>>) {
        let ep = get_in(&self.endpoints, &key.namespace, &key.name);
        let same = |s: &LLMService, c: &LLMService| {
            s.namespace() == c.namespace() && s.name_any() == c.name_any()
        };
        let mut members: Vec<Arc<LLMService>> = self
            .llmservices
            .state()
            .into_iter()
            .filter(|s| endpoint_key(s).as_ref() == Some(key))
            .filter(|s| current.is_none_or(|c| !same(s, c)))
            .collect();
        if let Some(c) = current
            && endpoint_key(c).as_ref() == Some(key)
        {
            members.push(Arc::new(c.clone()));
        }
        let deployments: Vec<Arc<Deployment>> = self
            .members
            .state()
            .into_iter()
            .filter(|d| deployment_endpoint_key(d).as_ref() == Some(key))
            .collect();
        let labels: BTreeMap<String, BTreeMap<String, String>> = members
            .iter()
            .filter_map(|s| s.namespace())
            .chain(deployments.iter().filter_map(|d| d.namespace()))
            .filter_map(|ns| {
                let n = self.namespaces.get(&ObjectRef::new(&ns))?;
                Some((ns, n.metadata.labels.clone().unwrap_or_default()))
            })
            .collect();
        let a = attach(
            key,
            ep.as_deref(),
            members.iter().map(AsRef::as_ref),
            deployments.iter().map(AsRef::as_ref),
            &labels,
        );
        (a, members, deployments)
    }

    /// The LLMAdapters accepted on `svc` (by [`adapter::base_adapters`], the rule of the
    /// adapters' own status), sorted by served name.
    fn accepted_adapters(&self, svc: &LLMService) -> crate::render::ServiceAdapters {
        let mut accepted: Vec<LLMAdapter> = adapter::base_adapters(self, svc)
            .into_iter()
            .filter(|(a, f)| {
                a.metadata.deletion_timestamp.is_none() && adapter::accepted(f).is_true()
            })
            .map(|(a, _)| a)
            .collect();
        accepted.sort_by(|a, b| a.served_name().cmp(b.served_name()));
        let fetches = self
            .adapter_fetch_jobs(&svc.namespace().unwrap_or_default(), &svc.name_any())
            .into_iter()
            .map(|j| (j.name_any(), status::job_state(&j)))
            .collect();
        crate::render::ServiceAdapters { accepted, fetches }
    }

    /// The hub adapters' fetch Jobs of service `name` in `namespace`, from the cache.
    fn adapter_fetch_jobs(&self, namespace: &str, name: &str) -> Vec<Arc<Job>> {
        self.jobs
            .state()
            .into_iter()
            .filter(|j| {
                let l = j.labels();
                j.namespace().as_deref() == Some(namespace)
                    && l.get(LLMSERVICE_LABEL).map(String::as_str) == Some(name)
                    && l.get(hearth_crds::wellknown::COMPONENT_LABEL)
                        .map(String::as_str)
                        == Some(crate::labels::Component::AdapterFetch.as_str())
            })
            .collect()
    }

    /// The endpoint `key`, from the cache.
    fn endpoint(&self, key: &EndpointKey) -> Option<Arc<LLMEndpoint>> {
        get_in(&self.endpoints, &key.namespace, &key.name)
    }

    /// What the caches hold of the objects of the member Deployment `name`.
    fn member_view(&self, namespace: &str, name: &str) -> member::MemberView {
        let child = names::member(name);
        let keda_installed = self.keda.installed();
        member::MemberView {
            service: get_in(&self.services, namespace, &child),
            role: get_in(&self.roles, namespace, &child),
            role_binding: get_in(&self.role_bindings, namespace, &child),
            keda_installed,
            scaled_object: keda_installed
                .then(|| self.keda.get(namespace, &child))
                .flatten(),
        }
    }

    /// Records what the member `namespace/name` acted on, and sends its Events when it changed.
    async fn set_member_state(
        &self,
        namespace: &str,
        name: &str,
        state: MemberState,
        reference: &k8s_openapi::api::core::v1::ObjectReference,
    ) {
        let events = {
            let Ok(mut states) = self.member_states.lock() else {
                return;
            };
            let key = (namespace.to_owned(), name.to_owned());
            let events = member::events(states.get(&key), &state);
            states.insert(key, state);
            events
        };
        for (type_, reason, note) in events {
            member::publish(self, reference, type_, &reason, note).await;
        }
    }

    /// Forgets the member `namespace/name` (it left).
    fn forget_member(&self, namespace: &str, name: &str) {
        if let Ok(mut states) = self.member_states.lock() {
            states.remove(&(namespace.to_owned(), name.to_owned()));
        }
    }

    /// Whether the member `namespace/name`'s last reconcile acted on something else than
    /// `verdict` (and, accepted, `gateway`): its reconcile has not seen the change yet.
    fn member_stale(
        &self,
        namespace: &str,
        name: &str,
        verdict: &crate::attach::Verdict,
        gateway: Option<&SharedGateway>,
    ) -> bool {
        self.member_states.lock().is_ok_and(|states| {
            !states
                .get(&(namespace.to_owned(), name.to_owned()))
                .is_some_and(|s| s.agrees(verdict, gateway))
        })
    }

    /// Reconciles the member Deployments `deployments` now.
    fn reconcile_members<'a>(&self, deployments: impl IntoIterator<Item = &'a Arc<Deployment>>) {
        for d in deployments {
            let _ = self
                .member_tx
                .unbounded_send(ObjectRef::from_obj(d.as_ref()));
        }
    }

    /// What the endpoint `svc` references decided about it; `None` without a reference.
    fn membership(&self, svc: &LLMService) -> Option<Membership> {
        let key = endpoint_key(svc)?;
        let (attachment, _, _) = self.attachment(&key, Some(svc));
        let verdict = attachment
            .verdict(&svc.namespace().unwrap_or_default(), &svc.name_any())?
            .clone();
        let gateway = if verdict.accepted() {
            get_in(&self.endpoints, &key.namespace, &key.name).map(|ep| SharedGateway::of(&ep))
        } else {
            None
        };
        Some(Membership { verdict, gateway })
    }

    /// Reconciles `services` now (through the services' controller).
    fn reconcile_services<'a>(&self, services: impl IntoIterator<Item = &'a Arc<LLMService>>) {
        for s in services {
            let _ = self
                .service_tx
                .unbounded_send(ObjectRef::from_obj(s.as_ref()));
        }
    }

    fn deployment(&self, namespace: &str, name: &str) -> Option<Arc<Deployment>> {
        get_in(&self.deployments, namespace, name)
    }

    fn llmservice(&self, namespace: &str, name: &str) -> Option<Arc<LLMService>> {
        get_in(&self.llmservices, namespace, name)
    }

    /// What the caches hold of the children of the endpoint `key`.
    fn endpoint_view(&self, key: &EndpointKey) -> EndpointView {
        let (ns, name) = (key.namespace.as_str(), key.name.as_str());
        EndpointView {
            service_account: get_in(&self.service_accounts, ns, &names::gateway(name)),
            role: get_in(&self.roles, ns, &names::gateway(name)),
            role_binding: get_in(&self.role_bindings, ns, &names::gateway(name)),
            routes: get_in(&self.config_maps, ns, &routes_config_map(name)),
            gateway_service: get_in(&self.services, ns, &names::gateway_service(name)),
            scaler_service: get_in(&self.services, ns, &names::scaler_service(name)),
            admin_service: get_in(&self.services, ns, &names::gateway_admin(name)),
            gateway: get_in(&self.deployments, ns, &names::gateway(name)),
            gateway_pdb: get_in(&self.pdbs, ns, &names::gateway(name)),
            gateway_network_policy: get_in(&self.network_policies, ns, &names::gateway(name)),
        }
    }

    /// What the caches hold of the children of the service `name` in `namespace` (and, when it
    /// is attached, of its endpoint's gateway).
    fn view(&self, namespace: &str, name: &str, placement: &Placement) -> View {
        let keda_installed = self.keda.installed();
        let backend_pods: Vec<Arc<Pod>> = self
            .pods
            .state()
            .into_iter()
            .filter(|p| {
                p.namespace().as_deref() == Some(namespace)
                    && p.labels().get(LLMSERVICE_LABEL).map(String::as_str) == Some(name)
            })
            .collect();
        let pull_failures = self.pull_failures.of(&backend_pods);
        View {
            endpoint_gateway: match placement {
                Placement::Own => None,
                Placement::Shared(g) => get_in(
                    &self.deployments,
                    &g.namespace,
                    &names::gateway(&g.endpoint),
                ),
            },
            service_account: get_in(&self.service_accounts, namespace, &names::gateway(name)),
            role: get_in(&self.roles, namespace, &names::gateway(name)),
            role_binding: get_in(&self.role_bindings, namespace, &names::gateway(name)),
            claim: get_in(&self.claims, namespace, &names::cache_claim(name)),
            job: get_in(&self.jobs, namespace, &names::prewarm_job(name)),
            adapter_fetch_jobs: self.adapter_fetch_jobs(namespace, name),
            backend_service: get_in(&self.services, namespace, &names::backend_service(name)),
            gateway_service: get_in(&self.services, namespace, &names::gateway_service(name)),
            scaler_service: get_in(&self.services, namespace, &names::scaler_service(name)),
            admin_service: get_in(&self.services, namespace, &names::gateway_admin(name)),
            backend: get_in(&self.deployments, namespace, &names::backend(name)),
            legacy_backend: get_in(&self.deployments, namespace, &names::legacy_backend(name)),
            gateway: get_in(&self.deployments, namespace, &names::gateway(name)),
            gateway_pdb: get_in(&self.pdbs, namespace, &names::gateway(name)),
            gateway_network_policy: get_in(
                &self.network_policies,
                namespace,
                &names::gateway(name),
            ),
            backend_network_policy: get_in(
                &self.network_policies,
                namespace,
                &names::backend_service(name),
            ),
            adapters_config_map: get_in(&self.config_maps, namespace, &names::adapters(name)),
            keda_installed,
            scaled_object: keda_installed
                .then(|| self.keda.get(namespace, &names::scaled_object(name)))
                .flatten(),
            backend_pods,
            pull_failures,
        }
    }
}

/// Wraps a kube error with what was being done (`apply Deployment ns/x`).
pub(crate) fn kube_err(action: impl Into<String>) -> impl FnOnce(kube::Error) -> Error {
    let action = action.into();
    move |source| Error::Kube { action, source }
}

fn get_in<K>(store: &Store<K>, namespace: &str, name: &str) -> Option<Arc<K>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    store.get(&ObjectRef::new(name).within(namespace))
}

/// How soon a reconcile that found the caches still listing runs again.
pub(crate) const CACHE_SYNC_RETRY: Duration = Duration::from_millis(500);
/// Requeue delay while the ScaledObject cache does not hold a service's ScaledObject (it was
/// read from the apiserver instead).
const KEDA_CACHE_RECHECK: Duration = Duration::from_secs(5);

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

/// Requeue after a failure, by error type (see [`Error::backoff`]).
pub fn error_policy(_svc: Arc<LLMService>, error: &Error, _ctx: Arc<Context>) -> Action {
    Action::requeue(error.backoff())
}

async fn publish(ctx: &Context, svc: &LLMService, type_: EventType, reason: &str, note: String) {
    publish_about(ctx, svc, type_, reason, note, None).await;
}

/// [`publish`] with the Event's `related` object. kube-runtime's Recorder folds Events of one
/// type, reason and related object on one service within six minutes into a series that keeps
/// the first note; Events whose note is the record of one occurrence (an activation, a device
/// handover) name the pod they are about, so each keeps its own note.
async fn publish_about(
    ctx: &Context,
    svc: &LLMService,
    type_: EventType,
    reason: &str,
    note: String,
    related: Option<k8s_openapi::api::core::v1::ObjectReference>,
) {
    let ev = KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".to_owned(),
        secondary: related,
    };
    if let Err(e) = ctx.recorder.publish(&ev, &svc.object_ref(&())).await {
        tracing::debug!(error = %e, "publishing event failed");
    }
}

/// At most this many renders run at once on the blocking pool ([`off_workers`]): one per CPU.
static RENDERS: std::sync::LazyLock<Arc<tokio::sync::Semaphore>> = std::sync::LazyLock::new(|| {
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    Arc::new(tokio::sync::Semaphore::new(cpus))
});

/// Runs `render` on tokio's blocking pool, at most one per CPU at once ([`RENDERS`]): it
/// evaluates the cluster's ServingPolicies, whose CEL is CPU-bound and may run up to its cost
/// budget, and must not hold up the async workers that serve the watches, the leader lease
/// and the other reconciles (as the webhook evaluates admissions).
///
/// # Errors
/// [`Error::Render`] when the render panicked or the runtime is shutting down.
async fn off_workers<T: Send + 'static>(
    render: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Error> {
    let permit = RENDERS
        .clone()
        .acquire_owned()
        .await
        .map_err(|e| Error::Render(e.to_string()))?;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        render()
    })
    .await
    .map_err(|e| Error::Render(e.to_string()))
}

async fn reconcile_inner(svc: &LLMService, ctx: &Context) -> Result<Action, Error> {
    if !ctx.caches_synced() {
        // The watches that fill them run beside the reconciles; this is the first second or so
        // after a start (or a regained lease).
        return Ok(Action::requeue(CACHE_SYNC_RETRY));
    }
    let namespace = svc.namespace().unwrap_or_default();
    let membership = ctx.membership(svc);
    let placement = Membership::placement(membership.as_ref());
    let mut view = ctx.view(&namespace, &svc.name_any(), &placement);
    let keda_cache_behind = view.keda_installed && view.scaled_object.is_none();
    if keda_cache_behind {
        // Not in the cache (yet): what the apiserver holds decides whether to create it and
        // what AutoscalingReady says, so neither waits on the cache's watch.
        view.scaled_object = ctx
            .keda
            .read(
                &ctx.client,
                &namespace,
                &names::scaled_object(&svc.name_any()),
            )
            .await?;
    }
    let runtimes = ctx.runtimes.state();
    let adapters = ctx.accepted_adapters(svc);
    let desired = {
        let (svc, cfg, create_backend) = (
            svc.clone(),
            ctx.render_config().into_owned(),
            view.backend.is_none(),
        );
        let membership = membership.clone();
        off_workers(move || {
            desired(
                &svc,
                runtimes.iter().map(|r| r.as_ref()),
                &cfg,
                create_backend,
                membership.as_ref(),
                &adapters,
            )
        })
        .await?
    };
    let mut desired = desired;
    crate::scaler_tls::step(ctx, svc, &view, &mut desired).await?;
    if desired
        .children
        .as_ref()
        .is_some_and(|c| c.gateway.is_some())
    {
        crate::admin_tokens::step(ctx, svc).await?;
    }
    // What ServingPolicies report on the backend (`spec.mutationActions` Warn or Audit), and
    // what its cached copy says they reported last.
    let reports = desired
        .children
        .as_ref()
        .map(|c| crate::policy::reports_of(&c.backend));
    let reported = view
        .backend
        .as_deref()
        .map(crate::policy::reports_of)
        .unwrap_or_default();
    let mut plan = plan(svc, desired, &view, &ctx.render);
    execute(ctx, &namespace, &mut plan).await?;
    if let Some(reports) = reports.filter(|r| !r.is_empty() && *r != reported) {
        publish_about(
            ctx,
            svc,
            EventType::Normal,
            "PolicyReport",
            format!(
                "on backend {}: {}",
                names::backend(&svc.name_any()),
                reports.join("; ")
            ),
            None,
        )
        .await;
    }
    let handover = handover::step(ctx, svc, &view).await;

    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let mut status = plan.status(svc, &now);
    if let Some(note) = &handover.note
        && let Some(ready) = status
            .conditions
            .iter_mut()
            .find(|c| c.type_ == status::READY && c.reason == status::WAITING_FOR_DEVICES)
    {
        ready.message = format!("{}; {note}", ready.message);
    }
    let activated = record_activation(ctx, svc, &namespace, &view).await;
    if let Some(t) = &activated {
        status.last_activation = Some(t.to_status());
    }
    if status::differs(svc.status.as_ref(), &status) {
        execute::write_status(ctx, svc, &status).await?;
        let previous = svc.status.clone().unwrap_or_default();
        emit_transitions(ctx, svc, &previous, &status).await;
        // Once written, the status is the record: the next reconcile finds this pod in it.
        if let Some(t) = activated {
            ctx.metrics.activation(&t.phases());
            tracing::info!(pod = %t.pod, total = ?t.total, "activation recorded");
            let pod = k8s_openapi::api::core::v1::ObjectReference {
                api_version: Some("v1".to_owned()),
                kind: Some("Pod".to_owned()),
                name: Some(t.pod.clone()),
                namespace: Some(namespace.clone()),
                uid: Some(t.pod_uid.clone()),
                ..Default::default()
            };
            publish_about(
                ctx,
                svc,
                EventType::Normal,
                "Activated",
                t.note(),
                Some(pod),
            )
            .await;
        }
    }
    // KEDA's report on the ScaledObject comes by the cache's watch; while the cache does not
    // hold it, looked at again soon, so AutoscalingReady does not wait for the resync.
    let requeue = [
        handover.requeue,
        keda_cache_behind.then_some(KEDA_CACHE_RECHECK),
    ]
    .into_iter()
    .flatten()
    .fold(ctx.requeue, Duration::min);
    Ok(Action::requeue(requeue))
}

/// The timeline of a backend pod of `svc` whose readiness is an activation not recorded yet
/// (see [`activation::activated`]): the pod from the cache, its Events and KEDA's listed now
/// (no Event watch). An Event list that fails leaves the phases it would give unknown.
async fn record_activation(
    ctx: &Context,
    svc: &LLMService,
    namespace: &str,
    view: &View,
) -> Option<Timeline> {
    let previous = svc.status.as_ref();
    let last = previous.and_then(|s| s.last_activation.as_ref());
    let replicas_before = previous.and_then(|s| s.replicas).unwrap_or(0);
    let pod = activation::activated(
        view.backend_pods.iter().map(AsRef::as_ref),
        last,
        replicas_before,
        k8s_openapi::jiff::Timestamp::now(),
    )?;
    let uid = pod.metadata.uid.as_deref()?;
    let events: Api<CoreEvent> = Api::namespaced(ctx.client.clone(), namespace);
    let pod_events = list_events(&events, &format!("involvedObject.uid={uid}")).await;
    let scaler_since = match view.scaled_object.as_ref().and_then(|so| so.uid()) {
        Some(so_uid) => {
            let keda_events = list_events(
                &events,
                &format!(
                    "involvedObject.uid={so_uid},reason={}",
                    activation::KEDA_ACTIVATED
                ),
            )
            .await;
            activation::scaler_activated_at(&keda_events, last.map(|l| l.ready_time.0))
        }
        None => None,
    };
    activation::timeline(pod, &pod_events, scaler_since)
}

/// The core/v1 Events matching `fields`; none (logged) when the list fails.
async fn list_events(api: &Api<CoreEvent>, fields: &str) -> Vec<CoreEvent> {
    match api.list(&ListParams::default().fields(fields)).await {
        Ok(list) => list.items,
        Err(e) => {
            tracing::warn!(error = %e, fields, "listing Events for an activation timeline failed");
            Vec::new()
        }
    }
}

/// Image pulls the kubelet's Warning Events said failed, by pod UID: the message and when it
/// came. Bounded: entries older than [`PULL_FAILURE_TTL`] go on each insert, and at most
/// [`PULL_FAILURES_MAX`] are kept (the oldest go first).
#[derive(Debug, Default)]
pub struct PullFailures(std::sync::Mutex<HashMap<String, (String, Instant)>>);

/// How long a pull failure is kept (a pod that still waits has a newer Event by then).
const PULL_FAILURE_TTL: Duration = Duration::from_secs(15 * 60);
/// At most this many pull failures are kept.
const PULL_FAILURES_MAX: usize = 4096;

impl PullFailures {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, Instant)>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records the failure `message` of pod `uid`, now.
    pub fn insert(&self, uid: String, message: String) {
        let mut map = self.lock();
        map.retain(|_, (_, at)| at.elapsed() < PULL_FAILURE_TTL);
        while map.len() >= PULL_FAILURES_MAX {
            let Some(oldest) = map
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| k.clone())
            else {
                break;
            };
            map.remove(&oldest);
        }
        map.insert(uid, (message, Instant::now()));
    }

    /// The failures of `pods`, pod UID → message.
    pub fn of(&self, pods: &[Arc<Pod>]) -> HashMap<String, String> {
        let map = self.lock();
        pods.iter()
            .filter_map(|p| {
                let uid = p.metadata.uid.as_deref()?;
                map.get(uid).map(|(m, _)| (uid.to_owned(), m.clone()))
            })
            .collect()
    }
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

/// `False` reasons that are progress, not trouble: their Events are Normal (a backend loading
/// at every activation is no warning).
const PROGRESS: &[&str] = &[
    "Creating",
    "BackendLoading",
    "ScaledObjectPending",
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
        let trouble = c.status == "False"
            && c.type_ != status::PREWARMED
            && !PROGRESS.contains(&c.reason.as_str());
        let type_ = if warns || trouble {
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

/// Runs the controllers (LLMServices and LLMEndpoints) until `shutdown` resolves.
pub async fn run(
    client: Client,
    cfg: RunConfig,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + Sync + 'static,
) -> Result<(), Error> {
    let ns = cfg.namespace.as_deref();
    let managed = watcher::Config::default().labels(&labels::managed_selector());

    let (runtimes, runtime_writer) = reflector::store::<InferenceRuntime>();
    let runtime_stream = without_errors(
        "InferenceRuntime",
        watcher(
            Api::<InferenceRuntime>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(|r| r.metadata.managed_fields = None)
        .reflect(runtime_writer)
        .touched_objects(),
    );
    // Endpoints are reconciled when one of their children changes: the child watches are the
    // services' (`owns_stream`), and report endpoint-owned children here.
    let (endpoint_tx, endpoint_rx) = mpsc::unbounded::<ObjectRef<LLMEndpoint>>();
    // Deployments joined to an endpoint: their cache (members only), the channel that
    // reconciles one, and the sweeper's, which removes the objects of one that left. The child
    // watches report the objects rendered for them.
    let (member_store, member_writer) = reflector::store::<Deployment>();
    let (member_tx, member_rx) = mpsc::unbounded::<ObjectRef<Deployment>>();
    let (sweep_tx, sweep_rx) = mpsc::unbounded::<member::Sweep>();
    let member_channels = watch::MemberChannels {
        store: member_store.clone(),
        member_tx: member_tx.clone(),
        sweep_tx: sweep_tx.clone(),
    };

    // Children whose status feeds ours trigger a reconcile only when what we read changes
    // (see `relevant`): KEDA, kwok and the Deployment controller update status often.
    let (deployments, dep_stream) = cached_watch::<Deployment>(
        &client,
        ns,
        &managed,
        Some(|d| {
            let b = status::BackendState::of(Some(d));
            relevant(
                d,
                &(
                    b.desired,
                    b.ready,
                    b.stuck,
                    // Its pods' failures count again once it is over: a reconcile then.
                    b.template_pending,
                    b.current_replica_set,
                    d.status.as_ref().and_then(|s| s.available_replicas),
                ),
            )
        }),
    );
    let dep_stream = tap_endpoint_owners(dep_stream, endpoint_tx.clone());
    let (claims, claim_stream) = cached_watch::<PersistentVolumeClaim>(
        &client,
        ns,
        &managed,
        Some(|c| {
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
        }),
    );
    let (jobs, job_stream) = cached_watch::<Job>(
        &client,
        ns,
        &managed,
        Some(|j| relevant(j, &status::prewarm(Some(j), "").reason)),
    );
    let (services_store, services_stream) = cached_watch::<Service>(&client, ns, &managed, None);
    let services_stream = tap_member_owners(
        tap_endpoint_owners(services_stream, endpoint_tx.clone()),
        member_store.clone(),
        member_tx.clone(),
        sweep_tx.clone(),
    );
    let (sa_store, sa_stream) = cached_watch::<ServiceAccount>(&client, ns, &managed, None);
    let sa_stream = tap_endpoint_owners(sa_stream, endpoint_tx.clone());
    let (roles_store, roles_stream) = cached_watch::<Role>(&client, ns, &managed, None);
    let roles_stream = tap_member_owners(
        tap_endpoint_owners(roles_stream, endpoint_tx.clone()),
        member_store.clone(),
        member_tx.clone(),
        sweep_tx.clone(),
    );
    let (rb_store, rb_stream) = cached_watch::<RoleBinding>(&client, ns, &managed, None);
    let rb_stream = tap_member_owners(
        tap_endpoint_owners(rb_stream, endpoint_tx.clone()),
        member_store.clone(),
        member_tx.clone(),
        sweep_tx.clone(),
    );
    let (pdb_store, pdb_stream) =
        cached_watch::<PodDisruptionBudget>(&client, ns, &managed, Some(|p| relevant(p, &())));
    let pdb_stream = tap_endpoint_owners(pdb_stream, endpoint_tx.clone());
    let (np_store, np_stream) = cached_watch::<NetworkPolicy>(&client, ns, &managed, None);
    let np_stream = tap_endpoint_owners(np_stream, endpoint_tx.clone());
    let (cm_store, cm_stream) = cached_watch::<ConfigMap>(&client, ns, &managed, None);
    // Backend pods trigger their service's reconcile when they turn Ready (or stop being so):
    // that is when an activation is recorded; and when a pod starts or stops failing to come
    // up (`Ready=False` with a reason of `hearth_crds::ACTIVATION_FAILED_REASONS`).
    let backend_pods = watcher::Config::default().labels(&labels::backend_pod_selector());
    let (pods_store, pods_stream) = cached_watch::<Pod>(
        &client,
        ns,
        &backend_pods,
        Some(|p| {
            relevant(
                p,
                &(
                    activation::ready_since(p),
                    status::pod_failure(p),
                    crate::handover::waiting_for(p).map(|w| w.need),
                    p.metadata.deletion_timestamp.is_some(),
                ),
            )
        }),
    );

    // The kubelet's Warning Events of failed image pulls (only those are kept, by pod UID): a
    // pod's status says `ErrImagePull` only after the kubelet's back-off, its Event at once.
    let pull_failures: Arc<PullFailures> = Arc::default();
    let pull_stream = {
        let events: Api<CoreEvent> = match ns {
            Some(n) => Api::namespaced(client.clone(), n),
            None => Api::all(client.clone()),
        };
        let fields = format!(
            "type=Warning,involvedObject.kind=Pod,reason={}",
            status::PULL_FAILED_EVENT_REASON
        );
        let pulls = pull_failures.clone();
        watcher(events, watcher::Config::default().fields(&fields))
            .default_backoff()
            .touched_objects()
            .filter_map(move |r| {
                let kept = match r {
                    Ok(e) => status::pull_failure_event(&e).map(|(uid, message)| {
                        pulls.insert(uid, message);
                        Ok(e)
                    }),
                    Err(e) => Some(Err(e)),
                };
                std::future::ready(kept)
            })
    };
    let pods_of_events = pods_store.clone();

    // The meter learns when each backend pod went from the same watch.
    let gone: metering::GoneLog = Arc::default();
    let pods_stream = metering::tap_gone(pods_stream, pods_store.clone(), gone.clone());

    let keda = Arc::new(KedaState {
        api: cfg.render.keda_api.clone(),
        installed: AtomicBool::new(false),
        version: cfg.render.keda_version.clone(),
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
    if let Some(crd) = &initial {
        keda.learn_version(crd);
    }
    let (all_tx, all_rx) = mpsc::unbounded::<()>();
    let (one_tx, one_rx) = mpsc::unbounded::<ObjectRef<LLMService>>();
    tokio::spawn(watch_keda(
        client.clone(),
        ns.map(str::to_owned),
        keda.clone(),
        all_tx.clone(),
        one_tx,
        member_channels,
    ));

    let policies = if cfg.cluster_policies {
        Some(watch_policies(client.clone(), &cfg.render.engine, all_tx.clone()).await)
    } else {
        None
    };

    // The services' and the endpoints' own caches, without managedFields (most of each
    // object's size), and the namespaces' labels (metadata only).
    let (service_store, service_writer) = reflector::store::<LLMService>();
    let (endpoint_store, endpoint_writer) = reflector::store::<LLMEndpoint>();
    let (namespace_store, namespace_writer) = reflector::store::<PartialObjectMeta<Namespace>>();
    let (service_tx, service_rx) = mpsc::unbounded::<ObjectRef<LLMService>>();
    let (adapter_store, mut adapter_writer) = reflector::store::<LLMAdapter>();
    let (adapter_tx, adapter_rx) = mpsc::unbounded::<ObjectRef<LLMAdapter>>();
    let adapter_sibling_tx = adapter_tx.clone();
    // A cluster whose CRDs predate LLMAdapter (the chart's crds/ not applied before an
    // upgrade) has no adapters: an empty cache, synced at once, and no adapter controller, so
    // services are still reconciled.
    let adapters_served = !matches!(
        Api::<LLMAdapter>::all(client.clone())
            .list_metadata(&ListParams::default().limit(1))
            .await,
        Err(kube::Error::Api(e)) if e.code == 404
    );
    if !adapters_served {
        tracing::warn!(
            "the LLMAdapter CRD is not installed: apply charts/hearth/crds/ and restart the controller to serve adapters"
        );
        adapter_writer.apply_watcher_event(&watcher::Event::Init);
        adapter_writer.apply_watcher_event(&watcher::Event::InitDone);
    }

    let mut scaler_tls = cfg.scaler_tls.clone();
    if cfg.render.scaler_tls && scaler_tls.ca.is_none() {
        scaler_tls.ca = Some(
            hearth_net::pki::generate_ca(
                crate::keys::SCALER_CA_NAME,
                crate::scaler_tls::DEFAULT_CA_VALIDITY,
            )
            .map_err(|e| Error::Certificate(e.to_string()))?,
        );
        tracing::warn!(
            "no scaler CA given: made one for this process only (a restart issues every push-mode service's certificates again)"
        );
    }
    let shared_client = match (&scaler_tls.shared_client, &scaler_tls.ca) {
        _ if !cfg.render.shared_scaler_tls() => None,
        (Some(c), _) => Some(c.clone()),
        (None, Some(ca)) => Some(
            crate::scaler_tls::SharedClient::issue(ca, scaler_tls.cert_validity)
                .map_err(|e| Error::Certificate(e.to_string()))?,
        ),
        (None, None) => None,
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
        network_policies: np_store,
        pods: pods_store,
        pull_failures,
        config_maps: cm_store,
        endpoints: endpoint_store.clone(),
        llmservices: service_store.clone(),
        namespaces: namespace_store,
        adapters: adapter_store.clone(),
        service_tx: service_tx.clone(),
        members: member_store.clone(),
        member_tx: member_tx.clone(),
        sweep_tx: sweep_tx.clone(),
        member_states: std::sync::Mutex::new(HashMap::new()),
        keda,
        policies,
        handover: handover::Handover::new(
            cfg.device_handover,
            cfg.admin_tokens
                .as_ref()
                .map(crate::admin_tokens::AdminTokens::controller_authorization),
        ),
        scaler_tls,
        trigger_auths: crate::scaler_tls::Applied::default(),
        scaler_records: crate::scaler_tls::Records::default(),
        shared_client: std::sync::RwLock::new(shared_client),
        admin_tokens: cfg.admin_tokens.clone(),
        admin_secrets: crate::scaler_tls::Applied::default(),
        recorder: Recorder::new(
            client.clone(),
            Reporter {
                controller: FIELD_MANAGER.to_owned(),
                instance: Some(cfg.instance.clone()),
            },
        ),
    });

    // A service's change (created, edited, deleted) may change what its endpoint accepts: the
    // endpoint it references now, and the one whose status lists it (where it was before its
    // reference changed) are reconciled; they reconcile the services whose verdict changed.
    // Its adapters are reconciled too (their base changed).
    let service_stream = {
        let endpoints = endpoint_store.clone();
        let endpoint_tx = endpoint_tx.clone();
        let adapters = adapter_store.clone();
        without_errors(
            "LLMService",
            watcher(
                scoped::<LLMService>(&client, ns),
                watcher::Config::default(),
            )
            .default_backoff()
            .modify(|s| s.metadata.managed_fields = None)
            .reflect(service_writer)
            .filter_map(move |event| {
                let applied = match event {
                    Ok(watcher::Event::Apply(s)) | Ok(watcher::Event::InitApply(s)) => {
                        endpoints_of(&s, &endpoints, &endpoint_tx);
                        adapter::adapters_of(&s, &adapters, &adapter_tx);
                        Some(Ok(s))
                    }
                    Ok(watcher::Event::Delete(s)) => {
                        endpoints_of(&s, &endpoints, &endpoint_tx);
                        adapter::adapters_of(&s, &adapters, &adapter_tx);
                        None
                    }
                    Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
                    Err(e) => Some(Err(e)),
                };
                futures::future::ready(applied)
            }),
        )
    };
    // An endpoint deleted is reconciled no more: its services are, at once (they run their own
    // gateways again). Its other changes reach them through its reconcile.
    let endpoint_stream = {
        let services = service_store.clone();
        let service_tx = service_tx.clone();
        let members = member_store.clone();
        let member_tx = member_tx.clone();
        without_errors(
            "LLMEndpoint",
            watcher(
                scoped::<LLMEndpoint>(&client, ns),
                watcher::Config::default(),
            )
            .default_backoff()
            .modify(|e| e.metadata.managed_fields = None)
            .reflect(endpoint_writer)
            .filter_map(move |event| {
                let applied = match event {
                    Ok(watcher::Event::Apply(e)) | Ok(watcher::Event::InitApply(e)) => Some(Ok(e)),
                    Ok(watcher::Event::Delete(e)) => {
                        let key = EndpointKey::of(&e);
                        for s in services.state() {
                            if endpoint_key(&s).as_ref() == Some(&key) {
                                let _ = service_tx.unbounded_send(ObjectRef::from_obj(s.as_ref()));
                            }
                        }
                        // Its Deployments leave too (their ScaledObjects go).
                        for d in members.state() {
                            if deployment_endpoint_key(&d).as_ref() == Some(&key) {
                                let _ = member_tx.unbounded_send(ObjectRef::from_obj(d.as_ref()));
                            }
                        }
                        None
                    }
                    Ok(watcher::Event::Init | watcher::Event::InitDone) => None,
                    Err(e) => Some(Err(e)),
                };
                futures::future::ready(applied)
            }),
        )
    };
    // Every Deployment is watched (an annotation cannot be selected on), but only those that
    // join an endpoint are kept, lean (`watch::member_events`); a member's change reconciles it
    // and the endpoints it concerns (the one it names, those whose status lists it); one that
    // left is swept and its former endpoints reconciled.
    let member_stream = {
        let endpoints = endpoint_store.clone();
        let endpoint_tx = endpoint_tx.clone();
        let sweep_tx = sweep_tx.clone();
        let mut triggers = watch::MemberTriggers::new();
        watcher(scoped::<Deployment>(&client, ns), watcher::Config::default())
            .default_backoff()
            .filter_map(|event| {
                futures::future::ready(match event {
                    Ok(e) => watch::member_events(e).map(Ok),
                    Err(e) => Some(Err(e)),
                })
            })
            .reflect(member_writer)
            .filter_map(move |event| {
                futures::future::ready(match event {
                    Ok(e) => {
                        let change = triggers.pass(e);
                        for d in &change.left {
                            endpoints_of_deployment(d, &endpoints, &endpoint_tx);
                            let _ = sweep_tx.unbounded_send(member::Sweep {
                                namespace: d.namespace().unwrap_or_default(),
                                name: d.name_any(),
                            });
                        }
                        change.reconcile.map(|d| {
                            endpoints_of_deployment(&d, &endpoints, &endpoint_tx);
                            Ok(d)
                        })
                    }
                    Err(e) => {
                        tracing::warn!(kind = "Deployment", error = %e, "watch of joined Deployments failed; retrying with backoff");
                        None
                    }
                })
            })
    };
    // A namespace's labels decide whether endpoints with a selector admit its services.
    let namespace_stream = {
        let endpoints = endpoint_store.clone();
        let api: Api<PartialObjectMeta<Namespace>> = Api::all(client.clone());
        let cfg = match ns {
            Some(ns) => watcher::Config::default().fields(&format!("metadata.name={ns}")),
            None => watcher::Config::default(),
        };
        let mut churn =
            watch::Churn::new(Some(|n: &PartialObjectMeta<Namespace>| relevant(n, &())));
        watcher(api, cfg)
            .default_backoff()
            .modify(|n| n.metadata.managed_fields = None)
            .reflect(namespace_writer)
            .filter_map(move |event| {
                futures::future::ready(match event {
                    Ok(e) => churn.pass(e),
                    Err(e) => {
                        tracing::warn!(kind = "Namespace", error = %e, "watch failed; retrying with backoff");
                        None
                    }
                })
            })
            .flat_map(move |_| {
                let selecting: Vec<ObjectRef<LLMEndpoint>> = endpoints
                    .state()
                    .iter()
                    .filter(|e| e.spec.allowed_services.namespaces.from == FromNamespaces::Selector)
                    .map(|e| ObjectRef::from_obj(e.as_ref()))
                    .collect();
                futures::stream::iter(selecting)
            })
    };

    // No debounce: kube-runtime's is trailing-edge (each new trigger restarts the wait), so an
    // LLMService edited, or with a child changing, more often than the debounce period was
    // never reconciled while that went on (a gateway kept its old image through a Hearth
    // upgrade while the service was edited several times a second). The scheduler already
    // merges triggers for an object that is queued or being reconciled into one more run.
    let controller = Controller::for_stream(service_stream, service_store)
        .with_config(ControllerConfig::default().concurrency(cfg.concurrency));
    let service_store = controller.store();
    let shutdown = futures::FutureExt::shared(futures::FutureExt::boxed(shutdown));
    let services = controller
        .owns_stream(dep_stream)
        .owns_stream(claim_stream)
        .owns_stream(tap_fetch_jobs(
            job_stream,
            ctx.llmservices.clone(),
            endpoint_tx.clone(),
        ))
        .owns_stream(services_stream)
        .owns_stream(sa_stream)
        .owns_stream(roles_stream)
        .owns_stream(rb_stream)
        .owns_stream(pdb_stream)
        .owns_stream(np_stream)
        .watches_stream(pods_stream, |pod: Pod| {
            let service = pod.labels().get(LLMSERVICE_LABEL)?.clone();
            Some(ObjectRef::<LLMService>::new(&service).within(&pod.namespace()?))
        })
        .watches_stream(pull_stream, move |e: CoreEvent| {
            let o = &e.involved_object;
            let pod = pods_of_events
                .get(&ObjectRef::<Pod>::new(o.name.as_deref()?).within(o.namespace.as_deref()?))?;
            let service = pod.labels().get(LLMSERVICE_LABEL)?.clone();
            Some(ObjectRef::<LLMService>::new(&service).within(&pod.namespace()?))
        })
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
        .reconcile_on(service_rx)
        .graceful_shutdown_on(shutdown.clone())
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "controller event");
            }
        });
    let endpoints = Controller::for_stream(endpoint_stream, endpoint_store)
        .with_config(ControllerConfig::default().concurrency(cfg.concurrency))
        .owns_stream(cm_stream)
        .reconcile_on(endpoint_rx)
        .reconcile_on(namespace_stream)
        .graceful_shutdown_on(shutdown.clone())
        .run(
            endpoint::reconcile_endpoint,
            endpoint::endpoint_error_policy,
            ctx.clone(),
        )
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "endpoint controller event");
            }
        });
    let members = Controller::for_stream(member_stream, member_store)
        .with_config(ControllerConfig::default().concurrency(cfg.concurrency))
        .reconcile_on(member_rx)
        .graceful_shutdown_on(shutdown.clone())
        .run(
            member::reconcile_member,
            member::member_error_policy,
            ctx.clone(),
        )
        .for_each(|res| async move {
            if let Err(e) = res {
                tracing::debug!(error = %e, "member controller event");
            }
        });
    let adapter_service_tx = service_tx.clone();
    let adapter_endpoint_tx = endpoint_tx.clone();
    let adapter_services = ctx.llmservices.clone();
    let adapter_siblings = adapter_store.clone();
    let adapter_stream = without_errors(
        "LLMAdapter",
        watcher(
            scoped::<LLMAdapter>(&client, ns),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(|a| a.metadata.managed_fields = None)
        .reflect(adapter_writer)
        .touched_objects()
        .map(move |a| {
            // An adapter's change (created, edited, deleted) changes what its base renders, and
            // the route of the endpoint the base joins.
            if let Ok(a) = &a {
                // Its siblings' acceptance may change with it (a place or a name freed), and
                // that of the adapters of the other bases on its base's endpoint (names are
                // decided there over every base).
                let endpoint_of = |ns: &str, name: &str| {
                    adapter_services
                        .get(&ObjectRef::<LLMService>::new(name).within(ns))
                        .as_deref()
                        .and_then(endpoint_key)
                };
                let own_endpoint = endpoint_of(a.service_namespace(), &a.spec.service_ref.name);
                for s in adapter_siblings.state() {
                    let sibling = s.service_namespace() == a.service_namespace()
                        && s.spec.service_ref.name == a.spec.service_ref.name;
                    let same_object = s.metadata.namespace == a.metadata.namespace
                        && s.metadata.name == a.metadata.name;
                    let rival = !sibling
                        && own_endpoint.is_some()
                        && endpoint_of(s.service_namespace(), &s.spec.service_ref.name)
                            == own_endpoint;
                    if (sibling || rival) && !same_object {
                        let _ = adapter_sibling_tx.unbounded_send(ObjectRef::from_obj(s.as_ref()));
                    }
                }
                let base = ObjectRef::<LLMService>::new(&a.spec.service_ref.name)
                    .within(a.service_namespace());
                if let Some(key) = adapter_services
                    .get(&base)
                    .as_deref()
                    .and_then(endpoint_key)
                {
                    let _ = adapter_endpoint_tx.unbounded_send(endpoint::endpoint_ref(&key));
                }
                let _ = adapter_service_tx.unbounded_send(base);
            }
            a
        }),
    );
    let adapter_ctx = ctx.clone();
    let adapter_shutdown = shutdown.clone();
    let adapters = async move {
        if !adapters_served {
            return;
        }
        Controller::for_stream(adapter_stream, adapter_store)
            .with_config(ControllerConfig::default().concurrency(cfg.concurrency))
            .reconcile_on(adapter_rx)
            .graceful_shutdown_on(adapter_shutdown)
            .run(
                adapter::reconcile_adapter,
                adapter::adapter_error_policy,
                adapter_ctx,
            )
            .for_each(|res| async move {
                if let Err(e) = res {
                    tracing::debug!(error = %e, "adapter controller event");
                }
            })
            .await;
    };
    let meter = tokio::spawn(metering::run(ctx.clone(), gone));
    let scanner = match (&cfg.policy_scan, &ctx.policies) {
        (Some(scan), Some(engine)) => Some(tokio::spawn(crate::scan::run(
            crate::scan::Scanner {
                client: ctx.client.clone(),
                namespace: cfg.namespace.clone(),
                engine: engine.clone(),
                settings: ctx.render.policy_settings().to_value(),
                cfg: scan.clone(),
            },
            shutdown.clone(),
        ))),
        _ => None,
    };
    let exporter = match (&cfg.policy_export, &ctx.policies) {
        (Some(export), Some(engine)) => Some(tokio::spawn(crate::export::run(
            ctx.client.clone(),
            export.clone(),
            engine.clone(),
            shutdown.clone(),
        ))),
        _ => None,
    };
    let adapter_observer = tokio::spawn(adapter::observe(ctx.clone()));
    // KEDA's certificate for the shared gateways as the keys Secret holds it now (a standby
    // promoted later may have loaded one since renewed), published before any reconcile stamps
    // its digest.
    let shared_client = match (&cfg.shared_client_home, ctx.shared_client()) {
        (Some(home), Some(_)) => {
            crate::scaler_tls::refresh_shared(&ctx, home).await?;
            Some(tokio::spawn(crate::scaler_tls::maintain_shared(
                ctx.clone(),
                home.clone(),
            )))
        }
        _ => None,
    };
    let sweeper = tokio::spawn(member::sweep(ctx, sweep_rx));
    let controllers = futures::future::join4(services, endpoints, members, adapters);
    // The controllers run until shutdown; a scaler CA replaced under this process stops them
    // with its error (the restart loads it).
    let stopped = match shared_client {
        Some(mut task) => {
            tokio::select! {
                _ = controllers => {
                    task.abort();
                    Ok(())
                }
                ended = &mut task => match ended {
                    Ok(e) => Err(e),
                    Err(e) => Err(Error::Certificate(format!(
                        "the shared scaler client's task ended: {e}"
                    ))),
                },
            }
        }
        None => {
            controllers.await;
            Ok(())
        }
    };
    sweeper.abort();
    meter.abort();
    adapter_observer.abort();
    if let Some(scanner) = scanner {
        scanner.abort();
    }
    if let Some(exporter) = exporter {
        exporter.abort();
    }
    stopped
}

/// `stream` (the Jobs' watch) with the endpoint of each hub adapter fetch Job's service
/// reported on `tx`: an attached service's adapter routes are its endpoint's, so the endpoint
/// renders them again when a fetch finishes or fails.
fn tap_fetch_jobs<S>(
    stream: S,
    services: Store<LLMService>,
    tx: mpsc::UnboundedSender<ObjectRef<LLMEndpoint>>,
) -> impl futures::Stream<Item = Result<Job, watcher::Error>> + Send + 'static
where
    S: futures::Stream<Item = Result<Job, watcher::Error>> + Send + 'static,
{
    stream.map(move |item| {
        if let Ok(j) = &item
            && j.labels()
                .get(hearth_crds::wellknown::COMPONENT_LABEL)
                .map(String::as_str)
                == Some(crate::labels::Component::AdapterFetch.as_str())
            && let (Some(ns), Some(name)) = (j.namespace(), j.labels().get(LLMSERVICE_LABEL))
            && let Some(key) = get_in(&services, &ns, name)
                .as_deref()
                .and_then(endpoint_key)
        {
            let _ = tx.unbounded_send(endpoint::endpoint_ref(&key));
        }
        item
    })
}

/// Reconciles the endpoints a change of `svc` may concern: the one it references, and any
/// whose status lists it.
fn endpoints_of(
    svc: &LLMService,
    endpoints: &Store<LLMEndpoint>,
    endpoint_tx: &mpsc::UnboundedSender<ObjectRef<LLMEndpoint>>,
) {
    let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
    let mut refs: Vec<ObjectRef<LLMEndpoint>> = endpoint_key(svc)
        .map(|k| endpoint::endpoint_ref(&k))
        .into_iter()
        .collect();
    for ep in endpoints.state() {
        if endpoint::listing(&ep, MemberKind::LLMService, &ns, &name) {
            refs.push(ObjectRef::from_obj(ep.as_ref()));
        }
    }
    for r in refs {
        let _ = endpoint_tx.unbounded_send(r);
    }
}

/// Reconciles the endpoints a change of the Deployment `d` may concern: the one its
/// annotation names, and any whose status lists it.
fn endpoints_of_deployment(
    d: &Deployment,
    endpoints: &Store<LLMEndpoint>,
    endpoint_tx: &mpsc::UnboundedSender<ObjectRef<LLMEndpoint>>,
) {
    let (ns, name) = (d.namespace().unwrap_or_default(), d.name_any());
    let mut refs: Vec<ObjectRef<LLMEndpoint>> = deployment_endpoint_key(d)
        .map(|k| endpoint::endpoint_ref(&k))
        .into_iter()
        .collect();
    for ep in endpoints.state() {
        if endpoint::listing(&ep, MemberKind::Deployment, &ns, &name) {
            refs.push(ObjectRef::from_obj(ep.as_ref()));
        }
    }
    for r in refs {
        let _ = endpoint_tx.unbounded_send(r);
    }
}

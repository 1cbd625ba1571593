//! The watches that feed the reconciler: the caches of the children (one builder, with the
//! churn filter), the ServingPolicies, KEDA's CRD and ScaledObjects, and the Deployments that
//! join an endpoint (every Deployment watched, only those with the annotation kept, lean:
//! [`member_events`], [`MemberTriggers`]).

use std::{
    collections::{HashMap, HashSet},
    fmt::Debug,
    hash::{Hash, Hasher},
    sync::{Arc, atomic::Ordering},
};

use futures::{StreamExt, channel::mpsc};
use hearth_crds::{
    LLMEndpoint, LLMService,
    wellknown::{DEPLOYMENT_LABEL, ENDPOINT_ANNOTATION, LLMSERVICE_LABEL},
};
use k8s_openapi::{
    NamespaceResourceScope,
    api::{
        apps::v1::Deployment,
        core::v1::{Container, PodSpec, PodTemplateSpec},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::DynamicObject,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;

use super::{KedaState, crd_name};
use crate::{labels, policy, status};

pub(crate) fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = NamespaceResourceScope>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Watches the cluster's ServingPolicies and keeps a [`policy::ClusterEngine`] of `base`'s
/// policies (the built-ins) and theirs, built like the webhook's set. Returns once the first
/// complete list is in, so no backend is rendered without the platform's policies (and then
/// re-rendered, restarting its pods). Every change (debounced by [`policy::DEBOUNCE`]) that
/// changes the set reconciles every service through `all_tx`.
pub(super) async fn watch_policies(
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
pub(super) fn uses_runtime(svc: &LLMService, rt_name: &str, vendor: &str) -> bool {
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
/// it, for `owns_stream`. With `relevant`, an update triggers a reconcile only when
/// `relevant` of the object changes (see [`Churn`]); without, every change does.
pub(super) fn cached_watch<K>(
    client: &Client,
    namespace: Option<&str>,
    selector: &watcher::Config,
    relevant: Option<fn(&K) -> u64>,
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
    let mut churn = Churn::new(relevant);
    let stream = watcher(scoped::<K>(client, namespace), selector.clone())
        .default_backoff()
        .modify(|o: &mut K| o.meta_mut().managed_fields = None)
        .reflect(writer)
        .filter_map(move |event| futures::future::ready(event.map(|e| churn.pass(e)).transpose()));
    (store, without_errors(K::kind(&()), stream))
}

/// A trigger watch for the `Controller` with its errors logged (as warnings naming `kind`) and
/// dropped, so that none reaches the Controller.
///
/// kube-runtime's `Controller` merges every trigger stream (the services' own watch and each
/// `owns_stream`/`watches_stream`) into one behind a single backoff (`trigger_backoff`: 0.8 s
/// doubling to 30 s, reset only after 120 s without an error), and while it sleeps no watch is
/// polled. An apiserver restart fails a dozen watches at once: the merged stream then slept for
/// minutes, no watch re-opened and LLMService edits went unreconciled (docs/operations.md, the
/// control-plane restart). Each watch here already retries with a backoff of its own
/// (`default_backoff`), so its errors need only be seen in the log.
pub(super) fn without_errors<K, S>(
    kind: impl std::fmt::Display + Send + 'static,
    stream: S,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Send + 'static,
    S: futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
{
    stream.filter_map(move |item| {
        futures::future::ready(match item {
            Ok(obj) => Some(Ok(obj)),
            Err(e) => {
                tracing::warn!(%kind, error = %e, "watch failed; retrying with backoff");
                None
            }
        })
    })
}

/// `stream` (a child watch of the services' controller) with every object an `LLMEndpoint`
/// controls reported on `tx`, so the endpoint's controller reconciles it too: one watch per
/// kind serves both controllers.
pub(super) fn tap_endpoint_owners<K, S>(
    stream: S,
    tx: mpsc::UnboundedSender<ObjectRef<LLMEndpoint>>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource + Send + 'static,
    S: futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
{
    let api_version = LLMEndpoint::api_version(&()).into_owned();
    let kind = LLMEndpoint::kind(&()).into_owned();
    stream.map(move |item| {
        if let Ok(o) = &item
            && let Some(ns) = o.namespace()
        {
            for r in o.meta().owner_references.iter().flatten() {
                if r.controller == Some(true) && r.kind == kind && r.api_version == api_version {
                    let _ = tx.unbounded_send(ObjectRef::new(&r.name).within(&ns));
                }
            }
        }
        item
    })
}

/// The churn filter of a watch: which events trigger a reconcile. Deletions always do (a
/// deleted child must be recreated), and so does every apply when there is no `relevant`
/// function; with one, an apply does only when `relevant` of the object differs from the last
/// seen value. KEDA, kwok and the Deployment controller rewrite status often: only what the
/// reconciler reads counts.
pub(super) struct Churn<K> {
    relevant: Option<fn(&K) -> u64>,
    seen: HashMap<(Option<String>, String), u64>,
}

impl<K: Resource> Churn<K> {
    /// A filter on `relevant` (none: every event passes).
    pub(super) fn new(relevant: Option<fn(&K) -> u64>) -> Self {
        Self {
            relevant,
            seen: HashMap::new(),
        }
    }

    /// The object of `event` when it should trigger a reconcile.
    pub(super) fn pass(&mut self, event: watcher::Event<K>) -> Option<K> {
        match event {
            watcher::Event::Delete(o) => {
                self.seen.remove(&(o.namespace(), o.name_any()));
                Some(o)
            }
            watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
                let Some(relevant) = self.relevant else {
                    return Some(o);
                };
                let h = relevant(&o);
                match self.seen.insert((o.namespace(), o.name_any()), h) {
                    Some(old) if old == h => None,
                    _ => Some(o),
                }
            }
            watcher::Event::Init | watcher::Event::InitDone => None,
        }
    }
}

/// A hash of what a reconcile reads from a child: its generation (spec changes), the metadata
/// the controller sets (labels, annotations, owner references) and `extra` from its status.
pub(super) fn relevant<K: Resource, X: Hash>(obj: &K, extra: &X) -> u64 {
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

pub(super) fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

/// Where the objects rendered for member Deployments are reported (see [`tap_member_owners`]).
#[derive(Clone)]
pub(super) struct MemberChannels {
    /// The members' cache.
    pub store: Store<Deployment>,
    /// Reconciles a member.
    pub member_tx: mpsc::UnboundedSender<ObjectRef<Deployment>>,
    /// Sweeps a Deployment that left.
    pub sweep_tx: mpsc::UnboundedSender<super::member::Sweep>,
}

/// Watches the ScaledObject CRD; when it becomes established, starts the ScaledObject cache
/// and reconciles every service (and member Deployment); ScaledObject changes reconcile their
/// owner (an LLMService, or the member Deployment of [`DEPLOYMENT_LABEL`]).
pub(super) async fn watch_keda(
    client: Client,
    namespace: Option<String>,
    keda: Arc<KedaState>,
    all_tx: mpsc::UnboundedSender<()>,
    one_tx: mpsc::UnboundedSender<ObjectRef<LLMService>>,
    members: MemberChannels,
) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let cfg = watcher::Config::default().fields(&format!("metadata.name={}", crd_name(&keda.api)));
    let mut events = watcher(crds, cfg).default_backoff().boxed();
    let mut cache_started = false;
    while let Some(event) = events.next().await {
        let mut version_changed = false;
        let now_installed = match event {
            Ok(watcher::Event::Apply(crd)) | Ok(watcher::Event::InitApply(crd)) => {
                version_changed = keda.learn_version(&crd);
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
            let members = members.clone();
            let managed = watcher::Config::default().labels(&labels::managed_selector());
            tokio::spawn(async move {
                let mut stream = watcher(api, managed)
                    .default_backoff()
                    .modify(|o: &mut DynamicObject| o.metadata.managed_fields = None)
                    .reflect(writer)
                    .boxed();
                // KEDA rewrites status often; only a change of what we read triggers, and a
                // deletion (the ScaledObject must be recreated).
                let what_we_read: fn(&DynamicObject) -> u64 = |o| {
                    let ready = status::autoscaling(true, Some(o));
                    relevant(o, &(ready.status, ready.reason, ready.message))
                };
                let mut churn = Churn::new(Some(what_we_read));
                while let Some(event) = stream.next().await {
                    let event = match event {
                        Ok(e) => e,
                        Err(e) => {
                            tracing::warn!(error = %e, "watching ScaledObjects (retried with backoff)");
                            continue;
                        }
                    };
                    let Some(obj) = churn.pass(event) else {
                        continue;
                    };
                    let owner = obj.labels().get(LLMSERVICE_LABEL).cloned();
                    if let (Some(owner), Some(ns)) = (owner, obj.namespace()) {
                        let _ = tx.unbounded_send(ObjectRef::new(&owner).within(&ns));
                    }
                    report_member_owner(
                        &obj.metadata,
                        &members.store,
                        &members.member_tx,
                        &members.sweep_tx,
                    );
                }
            });
        }
        if keda.installed.swap(now_installed, Ordering::SeqCst) != now_installed || version_changed
        {
            tracing::info!(installed = now_installed, "KEDA ScaledObject CRD changed");
            let _ = all_tx.unbounded_send(());
            for d in members.store.state() {
                let _ = members
                    .member_tx
                    .unbounded_send(ObjectRef::from_obj(d.as_ref()));
            }
        }
    }
}

/// Whether a Deployment asks to join an endpoint (it carries the endpoint annotation, valid or
/// not: its reconcile reports a bad one).
pub(super) fn is_member(d: &Deployment) -> bool {
    d.annotations().contains_key(ENDPOINT_ANNOTATION)
}

/// What the members' cache keeps of a Deployment that joins an endpoint: its metadata (without
/// `managedFields` and `kubectl`'s last-applied copy), its selector and, of its pod template,
/// the containers' names, ports, command and args (which container and port serve the model,
/// and under which name); no status. A Deployment that does not join is not kept at all
/// ([`member_events`]).
pub(super) fn lean_member(d: &mut Deployment) {
    d.metadata.managed_fields = None;
    if let Some(a) = d.metadata.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
    }
    d.status = None;
    if let Some(spec) = d.spec.as_mut() {
        let containers = spec
            .template
            .spec
            .as_ref()
            .map(|p| {
                p.containers
                    .iter()
                    .map(|c| Container {
                        name: c.name.clone(),
                        ports: c.ports.clone(),
                        command: c.command.clone(),
                        args: c.args.clone(),
                        ..Default::default()
                    })
                    .collect()
            })
            .unwrap_or_default();
        spec.template = PodTemplateSpec {
            metadata: None,
            spec: Some(PodSpec {
                containers,
                ..Default::default()
            }),
        };
        spec.strategy = None;
    }
}

/// The watch events of every Deployment as the members' cache takes them: a Deployment that
/// joins an endpoint is kept (lean); any other is dropped, or, as an update, turned into its
/// deletion (so one whose annotation was removed leaves the cache at once, and nothing else of
/// the cluster's Deployments is held).
pub(super) fn member_events(
    event: watcher::Event<Deployment>,
) -> Option<watcher::Event<Deployment>> {
    use watcher::Event;
    let skeleton = |d: Deployment| Deployment {
        metadata: ObjectMeta {
            name: d.metadata.name,
            namespace: d.metadata.namespace,
            uid: d.metadata.uid,
            annotations: d
                .metadata
                .annotations
                .filter(|a| a.contains_key(ENDPOINT_ANNOTATION)),
            ..Default::default()
        },
        ..Default::default()
    };
    match event {
        Event::Apply(mut d) if is_member(&d) => {
            lean_member(&mut d);
            Some(Event::Apply(d))
        }
        Event::InitApply(mut d) if is_member(&d) => {
            lean_member(&mut d);
            Some(Event::InitApply(d))
        }
        Event::Apply(d) | Event::Delete(d) => Some(Event::Delete(skeleton(d))),
        Event::InitApply(_) => None,
        Event::Init => Some(Event::Init),
        Event::InitDone => Some(Event::InitDone),
    }
}

/// What a member's reconcile reads of it: a change of anything else (its replicas, which KEDA
/// sets, its status) triggers nothing.
pub(super) fn member_relevant(d: &Deployment) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let meta = &d.metadata;
    meta.annotations.hash(&mut h);
    meta.labels.hash(&mut h);
    meta.uid.hash(&mut h);
    meta.deletion_timestamp.is_some().hash(&mut h);
    for o in meta.owner_references.iter().flatten() {
        (&o.uid, &o.kind, &o.name, o.controller).hash(&mut h);
    }
    if let Some(spec) = &d.spec {
        serde_json::to_string(&spec.selector)
            .unwrap_or_default()
            .hash(&mut h);
        serde_json::to_string(&spec.template)
            .unwrap_or_default()
            .hash(&mut h);
    }
    h.finish()
}

/// Which member Deployment events trigger what, after the members' cache took them: a member
/// whose relevant content changed ([`member_relevant`]) is reconciled (returned), and its
/// endpoints too ([`MemberTriggers::endpoints`]); one that left (its annotation removed, or
/// deleted; or, after a re-list, missing) is swept ([`super::member::sweep`]) and its former
/// endpoints reconciled. Non-members pass through the cache as deletions of what it does not
/// hold: nothing.
pub(super) struct MemberTriggers {
    /// Members seen, with their relevant hash.
    seen: HashMap<(String, String), u64>,
    /// The members listed since the last `Init` (a re-list), until `InitDone`.
    listing: Option<HashSet<(String, String)>>,
}

/// What one member event asks for.
#[derive(Debug, Default)]
pub(super) struct MemberChange {
    /// The member to reconcile (changed).
    pub reconcile: Option<Deployment>,
    /// Members that left: namespace, name, and their last annotations (where they were).
    pub left: Vec<Deployment>,
}

impl MemberTriggers {
    pub(super) fn new() -> Self {
        Self {
            seen: HashMap::new(),
            listing: None,
        }
    }

    pub(super) fn pass(&mut self, event: watcher::Event<Deployment>) -> MemberChange {
        use watcher::Event;
        let key = |d: &Deployment| (d.namespace().unwrap_or_default(), d.name_any());
        let mut out = MemberChange::default();
        match event {
            Event::Apply(d) | Event::InitApply(d) => {
                let k = key(&d);
                if let Some(l) = self.listing.as_mut() {
                    l.insert(k.clone());
                }
                let h = member_relevant(&d);
                if self.seen.insert(k, h) != Some(h) {
                    out.reconcile = Some(d);
                }
            }
            Event::Delete(d) => {
                if self.seen.remove(&key(&d)).is_some() {
                    out.left.push(d);
                }
            }
            Event::Init => self.listing = Some(HashSet::new()),
            Event::InitDone => {
                if let Some(listed) = self.listing.take() {
                    let gone: Vec<(String, String)> = self
                        .seen
                        .keys()
                        .filter(|k| !listed.contains(*k))
                        .cloned()
                        .collect();
                    for (namespace, name) in gone {
                        self.seen.remove(&(namespace.clone(), name.clone()));
                        out.left.push(Deployment {
                            metadata: ObjectMeta {
                                name: Some(name),
                                namespace: Some(namespace),
                                ..Default::default()
                            },
                            ..Default::default()
                        });
                    }
                }
            }
        }
        out
    }
}

/// `stream` (a child watch) with every object rendered for a member Deployment (label
/// [`DEPLOYMENT_LABEL`], controlled by a Deployment of that name) reported on `member_tx` while
/// the Deployment is a member (in `members`), else on `sweep_tx` (it left: its objects go).
pub(super) fn tap_member_owners<K, S>(
    stream: S,
    members: Store<Deployment>,
    member_tx: mpsc::UnboundedSender<ObjectRef<Deployment>>,
    sweep_tx: mpsc::UnboundedSender<super::member::Sweep>,
) -> impl futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource + Send + 'static,
    S: futures::Stream<Item = Result<K, watcher::Error>> + Send + 'static,
{
    stream.map(move |item| {
        if let Ok(o) = &item {
            report_member_owner(o.meta(), &members, &member_tx, &sweep_tx);
        }
        item
    })
}

/// The member Deployment an object was rendered for, reported as [`tap_member_owners`] says.
pub(super) fn report_member_owner(
    meta: &ObjectMeta,
    members: &Store<Deployment>,
    member_tx: &mpsc::UnboundedSender<ObjectRef<Deployment>>,
    sweep_tx: &mpsc::UnboundedSender<super::member::Sweep>,
) {
    let (Some(name), Some(ns)) = (
        meta.labels.as_ref().and_then(|l| l.get(DEPLOYMENT_LABEL)),
        meta.namespace.as_ref(),
    ) else {
        return;
    };
    let owned = meta.owner_references.iter().flatten().any(|r| {
        r.controller == Some(true)
            && r.kind == "Deployment"
            && r.api_version == "apps/v1"
            && &r.name == name
    });
    if !owned {
        return;
    }
    let r = ObjectRef::<Deployment>::new(name).within(ns);
    if members.get(&r).is_some() {
        let _ = member_tx.unbounded_send(r);
    } else {
        let _ = sweep_tx.unbounded_send(super::member::Sweep {
            namespace: ns.clone(),
            name: name.clone(),
        });
    }
}

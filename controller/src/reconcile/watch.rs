//! The watches that feed the reconciler: the caches of the children (one builder, with the
//! churn filter), the ServingPolicies, and KEDA's CRD and ScaledObjects.

use std::{
    collections::HashMap,
    fmt::Debug,
    hash::{Hash, Hasher},
    sync::{Arc, atomic::Ordering},
};

use futures::{StreamExt, channel::mpsc};
use hearth_crds::{LLMService, wellknown::LLMSERVICE_LABEL};
use k8s_openapi::{
    NamespaceResourceScope,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
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

pub(super) fn scoped<K>(client: &Client, namespace: Option<&str>) -> Api<K>
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

/// Watches the ScaledObject CRD; when it becomes established, starts the ScaledObject cache
/// and reconciles every service; ScaledObject changes reconcile their owner.
pub(super) async fn watch_keda(
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
                let what_we_read: fn(&DynamicObject) -> u64 = |o| {
                    let ready = status::autoscaling(true, Some(o));
                    relevant(o, &(ready.status, ready.reason, ready.message))
                };
                let mut churn = Churn::new(Some(what_we_read));
                while let Some(event) = stream.next().await {
                    let Some(obj) = event.ok().and_then(|e| churn.pass(e)) else {
                        continue;
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

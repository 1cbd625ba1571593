//! Policies and runtimes from the cluster: kube-runtime reflectors on `ServingPolicy` and
//! `InferenceRuntime`, and a task that rebuilds the [`Snapshot`] whenever either changes and
//! swaps it in atomically (reviews in flight keep the snapshot they loaded). Namespaces,
//! LLMServices, LLMAdapters and LLMEndpoints are reflected too; reviews read their stores
//! directly (an LLMAdapter is checked against its base, its siblings and the base's endpoint).
//!
//! A policy that fails to compile is logged, counted (`hearth_webhook_policy_compile_errors`),
//! and reported as `Ready=False` on its status (server-side apply, field manager
//! `hearth-webhook`); its last good version keeps serving. A policy that compiles gets
//! `Ready=True`. Changes arriving together are batched for [`DEBOUNCE`], well inside the 2 s
//! in which a new policy must take effect.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures::StreamExt;
use hearth_crds::{InferenceRuntime, LLMAdapter, LLMEndpoint, LLMService, ServingPolicy};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{Notify, watch};

use crate::exported::Exported;
use crate::server::AppState;
use hearth_policies::cluster::LastGood;

use crate::workload::{ServingStores, Snapshot};

/// Field manager of the status conditions the webhook writes.
pub const FIELD_MANAGER: &str = "hearth-webhook";

/// How long to gather changes before one rebuild.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// Runs the reflectors and the rebuild loop until `shutdown`. Every snapshot evaluates
/// `builtins` first, then the cluster's ServingPolicies by name (see [`evaluation_order`]). `state.ready` turns true after
/// the first snapshot built from complete lists.
pub async fn run(
    client: Client,
    state: AppState,
    builtins: Arc<[ServingPolicy]>,
    mut shutdown: watch::Receiver<bool>,
) {
    let changed = Arc::new(Notify::new());
    let (runtimes, rt_task) = reflect::<InferenceRuntime>(client.clone(), changed.clone());
    let (policies, pol_task) = reflect::<ServingPolicy>(client.clone(), changed.clone());
    // Namespace changes do not need a rebuild: reviews read the store directly.
    let (namespaces, ns_task) = reflect::<Namespace>(client.clone(), Arc::new(Notify::new()));
    // Nor do the objects an LLMAdapter is checked against.
    let (services, svc_task) = reflect::<LLMService>(client.clone(), Arc::new(Notify::new()));
    // A cluster whose CRDs predate LLMAdapter (the chart's crds/ not applied before an
    // upgrade) has none to check: an empty store, so the webhook still becomes ready.
    let (adapters, ad_task) = if served::<LLMAdapter>(&client).await {
        let (store, task) = reflect::<LLMAdapter>(client.clone(), Arc::new(Notify::new()));
        (
            store,
            Box::pin(task) as std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
        )
    } else {
        tracing::warn!(
            "the LLMAdapter CRD is not installed: apply charts/hearth/crds/ and restart the webhook to check adapters"
        );
        empty::<LLMAdapter>()
    };
    let (endpoints, ep_task) = reflect::<LLMEndpoint>(client.clone(), Arc::new(Notify::new()));
    let serving = ServingStores {
        services,
        adapters,
        endpoints,
    };
    let tasks = [
        tokio::spawn(rt_task),
        tokio::spawn(pol_task),
        tokio::spawn(ns_task),
        tokio::spawn(svc_task),
        tokio::spawn(ad_task),
        tokio::spawn(ep_task),
    ];
    // What the apiserver runs itself (the controller's export mode): watched only for the
    // kinds it serves; none when discovery fails (every policy is then evaluated here).
    let exported = Exported::default();
    let export_tasks = match hearth_crds::admission_apis::discover(&client).await {
        Ok(apis) => crate::exported::watch(&client, &apis, &exported, &changed),
        Err(e) => {
            tracing::warn!(error = %e, "could not discover the admission policy APIs; exported ServingPolicies are evaluated here too");
            Vec::new()
        }
    };
    let abort = || {
        tasks
            .iter()
            .chain(&export_tasks)
            .for_each(tokio::task::JoinHandle::abort)
    };

    let ready = async {
        let _ = runtimes.wait_until_ready().await;
        let _ = policies.wait_until_ready().await;
        let _ = namespaces.wait_until_ready().await;
        let _ = serving.services.wait_until_ready().await;
        let _ = serving.adapters.wait_until_ready().await;
        let _ = serving.endpoints.wait_until_ready().await;
    };
    tokio::select! {
        _ = ready => {}
        _ = shutdown.changed() => { abort(); return; }
    }
    // Last good compilation of each policy, by name, with the generation it came from.
    let mut last_good = LastGood::default();
    // Conditions already written, so an unchanged policy is not patched on every rebuild.
    let mut reported: BTreeMap<String, (i64, Option<String>, bool)> = BTreeMap::new();
    loop {
        rebuild(
            &client,
            &state,
            (&runtimes, &policies, &namespaces, &exported),
            &serving,
            &builtins,
            &mut last_good,
            &mut reported,
        )
        .await;

        state.ready.store(true, Ordering::Release);
        tokio::select! {
            _ = changed.notified() => tokio::time::sleep(DEBOUNCE).await,
            _ = shutdown.changed() => break,
        }
    }
    abort();
}

/// Whether the apiserver serves `K` (its CRD is installed): not when listing it is a 404.
async fn served<K>(client: &Client) -> bool
where
    K: kube::Resource<DynamicType = ()> + Clone + std::fmt::Debug + serde::de::DeserializeOwned,
{
    let api: Api<K> = Api::all(client.clone());
    !matches!(
        api.list_metadata(&kube::api::ListParams::default().limit(1)).await,
        Err(kube::Error::Api(e)) if e.code == 404
    )
}

/// An empty store, ready at once, with a task that does nothing (for a kind not served).
fn empty<K>() -> (
    Store<K>,
    std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + 'static>>,
)
where
    K: kube::Resource<DynamicType = ()> + Clone + 'static,
{
    let (reader, mut writer) = reflector::store::<K>();
    writer.apply_watcher_event(&watcher::Event::Init);
    writer.apply_watcher_event(&watcher::Event::InitDone);
    (reader, Box::pin(async {}))
}

fn reflect<K>(
    client: Client,
    changed: Arc<Notify>,
) -> (
    Store<K>,
    impl std::future::Future<Output = ()> + Send + 'static,
)
where
    K: kube::Resource<DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + Sync
        + 'static,
{
    let api: Api<K> = Api::all(client);
    let (reader, writer) = reflector::store();
    let stream = watcher(api, watcher::Config::default())
        .default_backoff()
        .reflect(writer)
        .touched_objects();
    let task = async move {
        let mut stream = std::pin::pin!(stream);
        while let Some(ev) = stream.next().await {
            if let Err(e) = ev {
                tracing::warn!(kind = K::kind(&()).as_ref(), error = %e, "watch error; retrying");
            }
            changed.notify_one();
        }
    };
    (reader, task)
}

async fn rebuild(
    client: &Client,
    state: &AppState,
    (runtimes, policies, namespaces, exported): (
        &Store<InferenceRuntime>,
        &Store<ServingPolicy>,
        &Store<Namespace>,
        &Exported,
    ),
    serving: &ServingStores,
    builtins: &[ServingPolicy],
    last_good: &mut LastGood,
    reported: &mut BTreeMap<String, (i64, Option<String>, bool)>,
) {
    let rts: BTreeMap<String, Arc<InferenceRuntime>> = runtimes
        .state()
        .into_iter()
        .map(|rt| (rt.name_any(), rt))
        .collect();
    let pols = policies.state();
    let present: std::collections::BTreeSet<String> = pols.iter().map(|p| p.name_any()).collect();
    reported.retain(|name, _| present.contains(name));

    // The condition each policy should show: compiled, or the compile error. A policy that
    // failed before at this generation is not recompiled, counted or logged again.
    let mut desired: Vec<(Arc<ServingPolicy>, Option<String>)> = Vec::new();
    for st in last_good.update(&pols) {
        if st.fresh
            && let Some(e) = &st.error
        {
            let name = st.policy.name_any();
            let generation = st.policy.metadata.generation.unwrap_or_default();
            state
                .metrics
                .policy_errors
                .get_or_create(&crate::metrics::PolicyLabels {
                    policy: name.clone(),
                })
                .inc();
            tracing::warn!(policy = %name, generation, error = %e, "ServingPolicy does not compile; its last good version (if any) keeps serving");
        }
        desired.push((st.policy, st.error));
    }
    // Policies the apiserver runs as exported are left out (see `crate::exported`).
    let digest = hearth_policies::export::runtimes_digest(rts.values().map(|r| &**r));
    let present = |kind, name: &str| exported.get(kind, name);
    let (outside, all): (Vec<ServingPolicy>, Vec<ServingPolicy>) = last_good
        .evaluation_order(builtins)
        .into_iter()
        .partition(|p| hearth_policies::export::is_exported(p, &digest, &present));
    let outside: std::collections::BTreeSet<String> =
        outside.iter().map(ResourceExt::name_any).collect();
    state.metrics.exported.set(outside.len() as i64);
    let mut snapshot = Snapshot::new(rts, &all, Some(namespaces.clone()));
    snapshot.settings = state.snapshot.load().settings.clone();
    snapshot.serving = Some(serving.clone());
    state
        .metrics
        .policies
        .set(last_good.compiled().len() as i64);
    state.metrics.runtimes.set(snapshot.runtimes.len() as i64);
    state.metrics.rebuilds.inc();
    state.snapshot.store(Arc::new(snapshot));
    // Status writes come after the swap, so enforcement never waits on the API.
    for (p, error) in desired {
        let exported = error.is_none() && outside.contains(&p.name_any());
        report(client, reported, &p, error, exported).await;
    }
}

/// The policies a snapshot evaluates, in order (shared with the controller, see
/// `hearth_policies::cluster`).
pub use hearth_policies::cluster::evaluation_order;

/// Sets the policy's `Ready` condition unless it already says the same for this generation.
async fn report(
    client: &Client,
    reported: &mut BTreeMap<String, (i64, Option<String>, bool)>,
    p: &ServingPolicy,
    error: Option<String>,
    exported: bool,
) {
    let name = p.name_any();
    let generation = p.metadata.generation.unwrap_or_default();
    let key = (generation, error.clone(), exported);
    if reported.get(&name) == Some(&key) {
        return;
    }
    let existing = p
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    let (status, reason, message) = match &error {
        None if exported => (
            "True",
            "Exported",
            "every expression compiled; the apiserver enforces the policy as exported (status.export), so this webhook does not evaluate it".to_owned(),
        ),
        None => (
            "True",
            "Compiled",
            "every expression compiled; the policy is enforced".to_owned(),
        ),
        Some(e) => (
            "False",
            "CompileError",
            format!("{e}; the last good version, if any, keeps serving"),
        ),
    };
    // Keep lastTransitionTime when the status does not change, as conditions require.
    let transition = existing
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    let cond = Condition {
        type_: "Ready".to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: Some(generation),
        last_transition_time: transition,
    };
    let patch = serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "ServingPolicy",
        "status": { "observedGeneration": generation, "conditions": [cond] },
    });
    let api: Api<ServingPolicy> = Api::all(client.clone());
    match api
        .patch_status(
            &name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        Ok(_) => {
            reported.insert(name, key);
        }
        Err(e) => {
            tracing::warn!(policy = %name, error = %e, "could not write the ServingPolicy's Ready condition");
        }
    }
}

//! Policies and runtimes from the cluster: kube-runtime reflectors on `ServingPolicy` and
//! `InferenceRuntime`, and a task that rebuilds the [`Snapshot`] whenever either changes and
//! swaps it in atomically (reviews in flight keep the snapshot they loaded).
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
use hearth_crds::{InferenceRuntime, ServingPolicy};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{Patch, PatchParams};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::sync::{Notify, watch};

use crate::server::AppState;
use crate::workload::{Compiled, Snapshot};

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
    let rt_task = tokio::spawn(rt_task);
    let pol_task = tokio::spawn(pol_task);
    let ns_task = tokio::spawn(ns_task);

    let ready = async {
        let _ = runtimes.wait_until_ready().await;
        let _ = policies.wait_until_ready().await;
        let _ = namespaces.wait_until_ready().await;
    };
    tokio::select! {
        _ = ready => {}
        _ = shutdown.changed() => { rt_task.abort(); pol_task.abort(); ns_task.abort(); return; }
    }
    // Last good compilation of each policy, by name, with the generation it came from.
    let mut last_good: BTreeMap<String, Compiled> = BTreeMap::new();
    // Conditions already written, so an unchanged policy is not patched on every rebuild.
    let mut reported: BTreeMap<String, (i64, Option<String>)> = BTreeMap::new();
    loop {
        rebuild(
            &client,
            &state,
            (&runtimes, &policies, &namespaces),
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
    rt_task.abort();
    pol_task.abort();
    ns_task.abort();
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
    (runtimes, policies, namespaces): (
        &Store<InferenceRuntime>,
        &Store<ServingPolicy>,
        &Store<Namespace>,
    ),
    builtins: &[ServingPolicy],
    last_good: &mut BTreeMap<String, Compiled>,
    reported: &mut BTreeMap<String, (i64, Option<String>)>,
) {
    let rts: BTreeMap<String, Arc<InferenceRuntime>> = runtimes
        .state()
        .into_iter()
        .map(|rt| (rt.name_any(), rt))
        .collect();
    let pols = policies.state();
    let present: std::collections::BTreeSet<String> = pols.iter().map(|p| p.name_any()).collect();
    last_good.retain(|name, _| present.contains(name));
    reported.retain(|name, _| present.contains(name));

    // The condition each policy should show: compiled, or the compile error.
    let mut desired: Vec<(Arc<ServingPolicy>, Option<String>)> = Vec::new();
    for p in &pols {
        let name = p.name_any();
        let generation = p.metadata.generation.unwrap_or_default();
        let same = |uid: &Option<String>, g: i64| g == generation && *uid == p.metadata.uid;
        if last_good
            .get(&name)
            .is_some_and(|c| same(&c.uid, c.generation))
        {
            desired.push((p.clone(), None));
            continue;
        }
        if let Some((_, Some(e))) = reported.get(&name).filter(|(g, _)| *g == generation) {
            // Failed before at this generation: do not recompile, count or log it again.
            desired.push((p.clone(), Some(e.clone())));
            continue;
        }
        match Compiled::compile(p) {
            Ok(c) => {
                last_good.insert(name, c);
                desired.push((p.clone(), None));
            }
            Err(e) => {
                state
                    .metrics
                    .policy_errors
                    .get_or_create(&crate::metrics::PolicyLabels {
                        policy: name.clone(),
                    })
                    .inc();
                tracing::warn!(policy = %name, generation, error = %e, "ServingPolicy does not compile; its last good version (if any) keeps serving");
                desired.push((p.clone(), Some(e)));
            }
        }
    }
    let all = evaluation_order(builtins, last_good);
    let mut snapshot = Snapshot::new(rts, &all, Some(namespaces.clone()));
    snapshot.settings = state.snapshot.load().settings.clone();
    state.metrics.policies.set(last_good.len() as i64);
    state.metrics.runtimes.set(snapshot.runtimes.len() as i64);
    state.metrics.rebuilds.inc();
    state.snapshot.store(Arc::new(snapshot));
    // Status writes come after the swap, so enforcement never waits on the API.
    for (p, error) in desired {
        report(client, reported, &p, error).await;
    }
}

/// The policies a snapshot evaluates, in order: the built-ins first, then the platform
/// policies by name. A cluster ServingPolicy named like a built-in (the chart installs the
/// built-ins as objects, so platform teams can read and edit them) replaces it in its place, so
/// an edit takes effect and nothing runs twice; deleting it restores the embedded default.
pub fn evaluation_order(
    builtins: &[ServingPolicy],
    cluster: &BTreeMap<String, Compiled>,
) -> Vec<ServingPolicy> {
    let builtin_names: std::collections::BTreeSet<String> =
        builtins.iter().map(|b| b.name_any()).collect();
    builtins
        .iter()
        .map(|b| {
            cluster
                .get(&b.name_any())
                .map_or_else(|| b.clone(), |c| (*c.policy).clone())
        })
        .chain(
            cluster
                .iter()
                .filter(|(name, _)| !builtin_names.contains(*name))
                .map(|(_, c)| (*c.policy).clone()),
        )
        .collect()
}

/// Sets the policy's `Ready` condition unless it already says the same for this generation.
async fn report(
    client: &Client,
    reported: &mut BTreeMap<String, (i64, Option<String>)>,
    p: &ServingPolicy,
    error: Option<String>,
) {
    let name = p.name_any();
    let generation = p.metadata.generation.unwrap_or_default();
    let key = (generation, error.clone());
    if reported.get(&name) == Some(&key) {
        return;
    }
    let existing = p
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    let (status, reason, message) = match &error {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str, expression: &str) -> ServingPolicy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "ServingPolicy",
            "metadata": {"name": name},
            "spec": {"validations": [{"expression": expression}]},
        }))
        .unwrap()
    }

    fn compiled(p: ServingPolicy) -> (String, Compiled) {
        (p.name_any(), Compiled::compile(&p).unwrap())
    }

    #[test]
    fn a_cluster_copy_of_a_builtin_replaces_it_in_place() {
        let builtins = [named("hearth-a", "true"), named("hearth-b", "true")];
        let cluster: BTreeMap<String, Compiled> = [
            compiled(named("zz-platform", "true")),
            compiled(named("hearth-b", "false")),
            compiled(named("aa-platform", "true")),
        ]
        .into_iter()
        .collect();
        let order = evaluation_order(&builtins, &cluster);
        let names: Vec<String> = order.iter().map(|p| p.name_any()).collect();
        assert_eq!(
            names,
            ["hearth-a", "hearth-b", "aa-platform", "zz-platform"]
        );
        assert_eq!(
            order[1].spec.validations[0].expression, "false",
            "the cluster's edit"
        );
        assert_eq!(order[0].spec.validations[0].expression, "true");
    }

    #[test]
    fn without_cluster_copies_the_embedded_builtins_run() {
        let builtins = [named("hearth-a", "true")];
        let order = evaluation_order(&builtins, &BTreeMap::new());
        assert_eq!(order.len(), 1);
        assert_eq!(order[0].name_any(), "hearth-a");
    }
}

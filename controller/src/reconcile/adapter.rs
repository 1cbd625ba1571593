//! The `LLMAdapter` status, in two parts with two field managers:
//!
//! - The reconciler: whether an adapter is accepted on its base, by the rule the admission
//!   webhook applies (`hearth_crds::rules::adapters::check_llmadapter_among`): `Accepted`,
//!   `servedName`, `observedGeneration`, under the controller's field manager. An adapter is
//!   reconciled when it changes, when its base LLMService changes (the services' watch reports
//!   it, [`adapters_of`]), and every resync period (its base's runtime, endpoint and namespace
//!   labels change rarely and are read then).
//! - The observer ([`observe`], every [`OBSERVE_EVERY`]): where each adapter is loaded, as the
//!   engines say: each ready backend pod of a base with adapters is asked `GET /v1/models` once
//!   per round, and each adapter's `loadedReplicas`, `loadedOn` and `Loaded` condition follow
//!   the entries with a `parent` there, under the field manager [`OBSERVER_FIELD_MANAGER`].
//!   Nothing is assumed from what the gateway asked for. The gateway replicas' failed loads
//!   ([`ADAPTER_FAILURES_PATH`]) are read in the same round: an adapter no engine has, whose
//!   load an engine refused, is `Loaded=False` with reason `LoadFailed` and the engine's
//!   message; a hub adapter not fetched yet is `Fetching` (or `FetchFailed`, with its Job's).

use std::{collections::BTreeMap, sync::Arc};

use futures::channel::mpsc;
use hearth_crds::{
    LLMAdapter, LLMService,
    llmadapter::{ADAPTER_FAILURES_PATH, AdapterFailures, AdapterLoadFailure, LLMAdapterStatus},
    rules::{self, Findings, Reason},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{
    ResourceExt,
    runtime::{
        controller::Action,
        reflector::{ObjectRef, Store},
    },
};

use super::{CACHE_SYNC_RETRY, Context, Error, get_in};
use crate::{
    attach::endpoint_key,
    resolve::resolve_runtime,
    status::{self, Cond},
};

/// `Accepted`: the adapter's base exists and admits it, the base's runtime serves adapters
/// within its limits, and the adapter's name is free on the base's gateway.
pub const ACCEPTED: &str = "Accepted";

/// The `Accepted` condition of `findings` (from [`rules::adapters::check_llmadapter_among`]):
/// `False` with the first error's reason and message, or with a missing base's or runtime's
/// (warnings at admission, but nothing serves the adapter until they exist); else `True`.
pub fn accepted(findings: &Findings) -> Cond {
    let blocking = findings.first_error().or_else(|| {
        findings.warnings().find(|w| {
            matches!(
                w.reason,
                Reason::ServiceNotFound | Reason::RuntimeNotResolved
            )
        })
    });
    match blocking {
        Some(f) => Cond::new(ACCEPTED, Some(false), f.reason.as_str(), f.to_string()),
        None => Cond::new(
            ACCEPTED,
            Some(true),
            "Accepted",
            "the base serves the adapter",
        ),
    }
}

/// The part of `adapter`'s status the reconciler owns given `findings`: `observedGeneration`,
/// `servedName` and `Accepted` (keeping `lastTransitionTime` where its status did not change).
pub fn adapter_status(adapter: &LLMAdapter, findings: &Findings, now: &Time) -> LLMAdapterStatus {
    let previous = adapter.status.clone().unwrap_or_default();
    LLMAdapterStatus {
        observed_generation: adapter.metadata.generation,
        served_name: Some(adapter.served_name().to_owned()),
        conditions: status::merge_conditions(
            &previous.conditions,
            &[accepted(findings)],
            adapter.metadata.generation,
            now,
        ),
        ..Default::default()
    }
}

/// Whether `current` says something else than the reconciler's part `desired`.
fn reconciled_differs(current: Option<&LLMAdapterStatus>, desired: &LLMAdapterStatus) -> bool {
    let Some(c) = current else { return true };
    c.observed_generation != desired.observed_generation
        || c.served_name != desired.served_name
        || desired
            .conditions
            .iter()
            .any(|d| !c.conditions.iter().any(|x| x == d))
}

/// The findings about `adapter` in the controller's caches.
pub(super) fn findings(adapter: &LLMAdapter, ctx: &Context) -> Findings {
    let adapters = ctx.adapters.state();
    let base = get_in(
        &ctx.llmservices,
        adapter.service_namespace(),
        &adapter.spec.service_ref.name,
    );
    let (runtime, endpoint_models) = base_context(ctx, base.as_deref());
    let runtimes = ctx.runtimes.state();
    let runtime = runtime.and_then(|name| runtimes.iter().find(|r| r.name_any() == name));
    rules::adapters::check_llmadapter_among(
        adapter,
        base.as_deref(),
        runtime.map(AsRef::as_ref),
        adapters.iter().map(AsRef::as_ref),
        &endpoint_models,
        &|ns, name| other_base(ctx, ns, name),
        &|ns| labels_of(ctx, ns),
    )
}

/// An LLMService and its resolved runtime, from the caches (the endpoint's other bases, for
/// [`rules::adapters::endpoint_bases`]).
fn other_base(
    ctx: &Context,
    ns: &str,
    name: &str,
) -> Option<(LLMService, Option<hearth_crds::InferenceRuntime>)> {
    let svc = get_in(&ctx.llmservices, ns, name)?;
    let runtimes = ctx.runtimes.state();
    let rt = resolve_runtime(&svc, runtimes.iter().map(AsRef::as_ref))
        .ok()
        .map(|r| r.runtime.clone());
    Some((LLMService::clone(&svc), rt))
}

/// The adapters of `svc` decided oldest first by the rule, with their findings
/// (`rules::adapters::check_base_adapters`): one pass for every adapter of the base.
pub(super) fn base_adapters(ctx: &Context, svc: &LLMService) -> Vec<(LLMAdapter, Findings)> {
    let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
    let all = ctx.adapters.state();
    let adapters: Vec<&LLMAdapter> = all
        .iter()
        .map(AsRef::as_ref)
        .filter(|a| a.service_namespace() == ns && a.spec.service_ref.name == name)
        .collect();
    if adapters.is_empty() {
        return Vec::new();
    }
    let (runtime, endpoint_models) = base_context(ctx, Some(svc));
    let runtimes = ctx.runtimes.state();
    let runtime = runtime.and_then(|name| runtimes.iter().find(|r| r.name_any() == name));
    let others = rules::adapters::endpoint_bases(
        svc,
        all.iter().map(AsRef::as_ref),
        &endpoint_models,
        &|ns, name| other_base(ctx, ns, name),
    );
    rules::adapters::check_base_adapters(
        Some(svc),
        runtime.map(AsRef::as_ref),
        adapters,
        &endpoint_models,
        &others,
        &|ns| labels_of(ctx, ns),
    )
    .into_iter()
    .map(|(a, f)| (a.clone(), f))
    .collect()
}

/// The name of `base`'s resolved runtime and the `status.models` of the endpoint it joins.
fn base_context(
    ctx: &Context,
    base: Option<&LLMService>,
) -> (Option<String>, Vec<hearth_crds::llmendpoint::EndpointModel>) {
    let runtimes = ctx.runtimes.state();
    let runtime = base.and_then(|svc| {
        resolve_runtime(svc, runtimes.iter().map(AsRef::as_ref))
            .ok()
            .map(|r| r.runtime.name_any())
    });
    let endpoint_models = base
        .and_then(endpoint_key)
        .and_then(|k| ctx.endpoint(&k))
        .and_then(|ep| ep.status.as_ref().map(|s| s.models.clone()))
        .unwrap_or_default();
    (runtime, endpoint_models)
}

/// The labels of namespace `ns`, from the cache.
fn labels_of(ctx: &Context, ns: &str) -> Option<BTreeMap<String, String>> {
    ctx.namespaces
        .get(&ObjectRef::new(ns))
        .map(|n| n.metadata.labels.clone().unwrap_or_default())
}

/// Reconciles one adapter: its `Accepted` condition.
///
/// # Errors
/// The status write's.
pub async fn reconcile_adapter(
    adapter: Arc<LLMAdapter>,
    ctx: Arc<Context>,
) -> Result<Action, Error> {
    if !ctx.caches_synced() {
        return Ok(Action::requeue(CACHE_SYNC_RETRY));
    }
    if adapter.metadata.deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let findings = findings(&adapter, &ctx);
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let status = adapter_status(&adapter, &findings, &now);
    if reconciled_differs(adapter.status.as_ref(), &status) {
        super::execute::write_status(&ctx, adapter.as_ref(), &status).await?;
    }
    Ok(Action::requeue(ctx.requeue))
}

/// Retries a failed reconcile with the error's backoff.
pub fn adapter_error_policy(_a: Arc<LLMAdapter>, error: &Error, _ctx: Arc<Context>) -> Action {
    Action::requeue(error.backoff())
}

/// Reconciles the adapters whose base is `svc` (it changed, or went).
pub(super) fn adapters_of(
    svc: &LLMService,
    adapters: &Store<LLMAdapter>,
    adapter_tx: &mpsc::UnboundedSender<ObjectRef<LLMAdapter>>,
) {
    let (ns, name) = (svc.namespace().unwrap_or_default(), svc.name_any());
    for a in adapters.state() {
        if a.service_namespace() == ns && a.spec.service_ref.name == name {
            let _ = adapter_tx.unbounded_send(ObjectRef::from_obj(a.as_ref()));
        }
    }
}

/// How often the observer asks the engines what they have loaded.
pub const OBSERVE_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// The field manager of the engine-reported part of an adapter's status.
pub const OBSERVER_FIELD_MANAGER: &str = "hearth-adapters";

/// `Loaded`: at least one of the base's ready engines lists the adapter.
pub const LOADED: &str = "Loaded";

/// An OpenAI model list as vLLM answers `GET /v1/models`: adapters have a `parent`.
#[derive(Debug, serde::Deserialize)]
pub struct ModelList {
    /// The models.
    #[serde(default)]
    pub data: Vec<ModelEntry>,
}

/// One entry of a [`ModelList`].
#[derive(Debug, serde::Deserialize)]
pub struct ModelEntry {
    /// The model's (or adapter's) name.
    pub id: String,
    /// The base model's name, for an adapter.
    #[serde(default)]
    pub parent: Option<String>,
}

/// The engine-reported part of an adapter's status: the pods of `engines` (pod name and its
/// engine's `/v1/models`, `None` when it did not answer) that list `served` as an adapter, and
/// the gateways' `failures` to load it (each with the pod of the engine that refused, when it
/// is one of `engines`): while no engine has it, the latest failure makes `Loaded` `False` with
/// reason `LoadFailed` and the engine's message.
pub fn loaded_status(
    served: &str,
    engines: &[(String, Option<&ModelList>)],
    failures: &[(Option<String>, &AdapterLoadFailure)],
    previous: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    generation: Option<i64>,
    now: &Time,
) -> LLMAdapterStatus {
    let mut on: Vec<String> = engines
        .iter()
        .filter(|(_, list)| {
            list.is_some_and(|l| l.data.iter().any(|m| m.id == served && m.parent.is_some()))
        })
        .map(|(pod, _)| pod.clone())
        .collect();
    on.sort();
    let loaded = on.len();
    // The CRD keeps at most 64 names; the count is whole.
    on.truncate(64);
    let answered = engines.iter().filter(|(_, l)| l.is_some()).count();
    // The latest failure (RFC 3339 times of one format sort as times). Its time is not in the
    // message, so a failure that repeats does not rewrite the status.
    let latest = failures.iter().max_by(|a, b| a.1.time.cmp(&b.1.time));
    let failed_on = |(pod, f): &(Option<String>, &AdapterLoadFailure)| {
        let engine = pod.as_deref().unwrap_or(f.engine.as_str());
        let status = match f.status {
            0 => "did not answer".to_owned(),
            s => format!("answered {s}"),
        };
        format!("engine {engine} {status}: {}", f.message)
    };
    let cond = if loaded > 0 {
        let mut message = format!("loaded on {loaded} of {} ready engines", engines.len());
        if let Some(f) = latest {
            message.push_str(&format!("; loading it failed on another: {}", failed_on(f)));
        }
        Cond::new(LOADED, Some(true), "Loaded", message)
    } else if let Some(f) = latest {
        let more = match failures.len() {
            1 => String::new(),
            n => format!(" ({} more failed loads reported)", n - 1),
        };
        Cond::new(
            LOADED,
            Some(false),
            "LoadFailed",
            format!(
                "the engine refused to load it: {}{more}; requests for it get this error until \
                 the cause (the adapter's files, its rank, the runtime's limits) is fixed",
                failed_on(f)
            ),
        )
    } else if engines.is_empty() {
        Cond::new(
            LOADED,
            Some(false),
            "NoReadyEngine",
            "the base has no ready engine (at zero, or starting); the gateway loads the adapter \
             when a request for it wakes one",
        )
    } else {
        Cond::new(
            LOADED,
            Some(false),
            "NotLoaded",
            format!(
                "none of the {} ready engines lists it ({answered} answered /v1/models); the \
                 gateway loads it on its first request",
                engines.len()
            ),
        )
    };
    LLMAdapterStatus {
        loaded_replicas: Some(i32::try_from(loaded).unwrap_or(i32::MAX)),
        loaded_on: on,
        conditions: status::merge_conditions(previous, &[cond], generation, now),
        ..Default::default()
    }
}

/// The failed loads every replica of the gateway serving `svc` reports
/// ([`ADAPTER_FAILURES_PATH`]); a replica that does not answer is left out (logged).
async fn gateway_failures(ctx: &Context, svc: &LLMService) -> Vec<AdapterLoadFailure> {
    let answers = match super::handover::ask_gateways::<AdapterFailures>(
        ctx,
        svc,
        |key| super::handover::for_service(ADAPTER_FAILURES_PATH, key),
        1 << 20,
    )
    .await
    {
        Ok((_, a)) => a,
        Err(e) => {
            tracing::debug!(llmservice = %svc.name_any(), error = %e, "no gateway to ask for adapter load failures");
            return Vec::new();
        }
    };
    let mut out = Vec::new();
    for (ip, a) in answers {
        match a {
            Ok(r) => out.extend(r.failures),
            Err(e) => {
                tracing::debug!(llmservice = %svc.name_any(), gateway = %ip, error = %e, "reading a gateway's adapter load failures");
            }
        }
    }
    out
}

/// The `Loaded` condition's reason and message while a hub adapter is not fetched yet (its
/// fetch Job running or failed; `None` once fetched, or for another source).
fn fetch_pending(
    ctx: &Context,
    svc: &LLMService,
    a: &LLMAdapter,
) -> Option<(&'static str, String)> {
    let job = crate::render::fetch_job_name(&svc.name_any(), a)?;
    let state = get_in(&ctx.jobs, &svc.namespace().unwrap_or_default(), &job)
        .map(|j| status::job_state(&j));
    let message = crate::render::fetch_pending(&job, state.as_ref())?;
    let reason = match state {
        Some(status::JobState::Failed(_)) => "FetchFailed",
        _ => "Fetching",
    };
    Some((reason, format!("the engines cannot load it yet: {message}")))
}

/// Whether `current` says something else than the observer's part `desired`.
fn observed_differs(current: Option<&LLMAdapterStatus>, desired: &LLMAdapterStatus) -> bool {
    let Some(c) = current else { return true };
    c.loaded_replicas != desired.loaded_replicas
        || c.loaded_on != desired.loaded_on
        || desired.conditions.iter().any(|d| {
            !c.conditions.iter().any(|x| {
                x.type_ == d.type_
                    && x.status == d.status
                    && x.reason == d.reason
                    && x.message == d.message
            })
        })
}

/// The observer: every [`OBSERVE_EVERY`], each base with adapters has its ready engines asked
/// for their `/v1/models` (at once, each bounded), and each of its adapters' engine-reported
/// status is written where it changed. Runs until the task is dropped.
pub(super) async fn observe(ctx: Arc<Context>) {
    let mut tick = tokio::time::interval(OBSERVE_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !ctx.caches_synced() {
            continue;
        }
        let mut by_base: BTreeMap<(String, String), Vec<Arc<LLMAdapter>>> = BTreeMap::new();
        for a in ctx.adapters.state() {
            by_base
                .entry((
                    a.service_namespace().to_owned(),
                    a.spec.service_ref.name.clone(),
                ))
                .or_default()
                .push(a);
        }
        if by_base.is_empty() {
            continue;
        }
        let mut pods = super::metering::backend_pods(&ctx);
        let runtimes = ctx.runtimes.state();
        for ((ns, name), adapters) in by_base {
            let Some(svc) = get_in(&ctx.llmservices, &ns, &name) else {
                continue;
            };
            let Ok(resolved) = resolve_runtime(&svc, runtimes.iter().map(AsRef::as_ref)) else {
                continue;
            };
            let port = resolved.runtime.spec.container.port.container_port;
            let ready: Vec<(String, String)> = pods
                .remove(&(ns.clone(), name.clone()))
                .unwrap_or_default()
                .into_iter()
                .filter(|p| p.ready_ms.is_some())
                .filter_map(|p| Some((p.name, p.ip?)))
                .collect();
            let lists: Vec<Result<ModelList, String>> =
                futures::future::join_all(ready.iter().map(|(_, ip)| {
                    super::handover::get_json::<ModelList>(&ctx, ip, port, "/v1/models", 1 << 20)
                }))
                .await;
            for ((pod, _), r) in ready.iter().zip(&lists) {
                if let Err(e) = r {
                    tracing::debug!(pod = %pod, namespace = %ns, error = %e, "reading the engine's /v1/models");
                }
            }
            let engines: Vec<(String, Option<&ModelList>)> = ready
                .iter()
                .zip(&lists)
                .map(|((pod, _), r)| (pod.clone(), r.as_ref().ok()))
                .collect();
            // The gateways' failed loads, each with the pod of the engine that refused.
            let failures = gateway_failures(&ctx, &svc).await;
            let pod_of = |engine: &str| {
                let ip = engine
                    .rsplit_once(':')
                    .map_or(engine, |(h, _)| h)
                    .trim_start_matches('[')
                    .trim_end_matches(']');
                ready
                    .iter()
                    .find(|(_, pod_ip)| pod_ip == ip)
                    .map(|(pod, _)| pod.clone())
            };
            let failures_of = |a: &LLMAdapter| -> Vec<(Option<String>, &AdapterLoadFailure)> {
                let key = format!("{}/{}", a.namespace().unwrap_or_default(), a.name_any());
                failures
                    .iter()
                    .filter(|f| f.adapter == key)
                    .map(|f| (pod_of(&f.engine), f))
                    .collect()
            };
            let now = Time(k8s_openapi::jiff::Timestamp::now());
            // Only an accepted adapter the engines can read is looked for in their lists (a
            // refused one may share its name with the one that is served).
            let accepted_now: std::collections::BTreeSet<(Option<String>, String)> =
                base_adapters(&ctx, &svc)
                    .into_iter()
                    .filter(|(_, f)| accepted(f).is_true())
                    .map(|(a, _)| (a.namespace(), a.name_any()))
                    .collect();
            for a in adapters {
                let previous = a
                    .status
                    .as_ref()
                    .map(|s| s.conditions.clone())
                    .unwrap_or_default();
                let why_not = if !accepted_now.contains(&(a.namespace(), a.name_any())) {
                    Some((
                        "NotAccepted",
                        "not accepted on its base (see the Accepted condition): no engine \
                         loads it"
                            .to_owned(),
                    ))
                } else {
                    crate::render::unserved(&a)
                        .map(|m| ("NotServed", m))
                        .or_else(|| fetch_pending(&ctx, &svc, &a))
                };
                let desired = match why_not {
                    Some((reason, message)) => LLMAdapterStatus {
                        loaded_replicas: Some(0),
                        conditions: status::merge_conditions(
                            &previous,
                            &[Cond::new(LOADED, Some(false), reason, message)],
                            a.metadata.generation,
                            &now,
                        ),
                        ..Default::default()
                    },
                    None => loaded_status(
                        a.served_name(),
                        &engines,
                        &failures_of(&a),
                        &previous,
                        a.metadata.generation,
                        &now,
                    ),
                };
                if observed_differs(a.status.as_ref(), &desired)
                    && let Err(e) = write_observed(&ctx, &a, &desired).await
                {
                    tracing::warn!(adapter = %format!("{ns}/{}", a.name_any()), error = %e, "writing the adapter's loaded status");
                }
            }
        }
    }
}

/// Applies the observer's part `status` of `a` under [`OBSERVER_FIELD_MANAGER`].
async fn write_observed(
    ctx: &Context,
    a: &LLMAdapter,
    status: &LLMAdapterStatus,
) -> Result<(), kube::Error> {
    use kube::{
        Api, Resource,
        api::{Patch, PatchParams},
    };
    let patch = serde_json::json!({
        "apiVersion": LLMAdapter::api_version(&()),
        "kind": LLMAdapter::kind(&()),
        "status": status,
    });
    ctx.metrics.writes.inc();
    Api::<LLMAdapter>::namespaced(ctx.client.clone(), &a.namespace().unwrap_or_default())
        .patch_status(
            &a.name_any(),
            &PatchParams::apply(OBSERVER_FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map(|_| ())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn adapter() -> LLMAdapter {
        serde_yaml::from_str(
            "apiVersion: serving.hearth.dev/v1alpha1\nkind: LLMAdapter\nmetadata: {name: sql, namespace: team-a, generation: 3}\nspec: {serviceRef: {name: qwen}, source: {uri: 'hf://acme/sql'}}\n",
        )
        .unwrap()
    }

    #[test]
    fn a_missing_base_is_not_accepted_though_admission_only_warned() {
        let a = adapter();
        let f =
            rules::adapters::check_llmadapter_among(&a, None, None, [], &[], &|_, _| None, &|_| {
                None
            });
        assert!(!f.blocks_rendering());
        let c = accepted(&f);
        assert_eq!((c.status, c.reason.as_str()), ("False", "ServiceNotFound"));
        assert!(
            c.message
                .starts_with("spec.serviceRef: LLMService team-a/qwen")
        );
    }

    #[test]
    fn the_reconciler_owns_acceptance_and_keeps_its_transition_time() {
        let mut a = adapter();
        let t0 = Time("2026-12-01T00:00:00Z".parse().unwrap());
        let f =
            rules::adapters::check_llmadapter_among(&a, None, None, [], &[], &|_, _| None, &|_| {
                None
            });
        let first = adapter_status(&a, &f, &t0);
        assert_eq!(first.served_name.as_deref(), Some("sql"));
        assert_eq!(first.observed_generation, Some(3));
        assert_eq!(
            first.loaded_replicas, None,
            "the observer's part is not sent"
        );
        assert!(reconciled_differs(None, &first));
        a.status = Some(LLMAdapterStatus {
            loaded_replicas: Some(1),
            loaded_on: vec!["qwen-0".into()],
            ..first.clone()
        });
        let later = Time("2026-12-02T00:00:00Z".parse().unwrap());
        let again = adapter_status(&a, &f, &later);
        assert_eq!(again.conditions[0].last_transition_time, t0);
        assert!(!reconciled_differs(a.status.as_ref(), &again));
    }

    fn list(entries: &[(&str, Option<&str>)]) -> ModelList {
        ModelList {
            data: entries
                .iter()
                .map(|(id, parent)| ModelEntry {
                    id: (*id).to_owned(),
                    parent: parent.map(str::to_owned),
                })
                .collect(),
        }
    }

    #[test]
    fn loaded_is_what_the_engines_list_as_adapters() {
        let now = Time("2026-12-01T00:00:00Z".parse().unwrap());
        let with = list(&[("qwen", None), ("sql", Some("qwen"))]);
        let without = list(&[("qwen", None), ("chat", Some("qwen"))]);
        // A base model of the same name is not the adapter.
        let base_named_sql = list(&[("sql", None)]);
        let engines = [
            ("qwen-b".to_owned(), Some(&with)),
            ("qwen-a".to_owned(), Some(&with)),
            ("qwen-c".to_owned(), Some(&without)),
            ("qwen-d".to_owned(), Some(&base_named_sql)),
            ("qwen-e".to_owned(), None),
        ];
        let s = loaded_status("sql", &engines, &[], &[], Some(1), &now);
        assert_eq!(s.loaded_on, ["qwen-a", "qwen-b"]);
        assert_eq!(s.loaded_replicas, Some(2));
        let c = &s.conditions[0];
        assert_eq!(
            (c.type_.as_str(), c.status.as_str(), c.reason.as_str()),
            (LOADED, "True", "Loaded")
        );
        assert_eq!(c.message, "loaded on 2 of 5 ready engines");

        let s = loaded_status("legal", &engines, &[], &s.conditions, Some(1), &now);
        assert_eq!(s.loaded_replicas, Some(0));
        assert_eq!(s.conditions[0].reason, "NotLoaded");
        assert!(
            s.conditions[0].message.contains("4 answered"),
            "{}",
            s.conditions[0].message
        );

        let s = loaded_status("sql", &[], &[], &[], Some(1), &now);
        assert_eq!(s.conditions[0].reason, "NoReadyEngine");
        assert!(observed_differs(None, &s));
        let current = LLMAdapterStatus {
            served_name: Some("sql".into()),
            ..s.clone()
        };
        assert!(!observed_differs(Some(&current), &s));
    }

    #[test]
    fn a_refused_load_is_the_condition_while_no_engine_has_it() {
        let now = Time("2026-12-01T00:00:00Z".parse().unwrap());
        let without = list(&[("qwen", None)]);
        let with = list(&[("qwen", None), ("sql", Some("qwen"))]);
        let refused = AdapterLoadFailure {
            adapter: "team-a/sql".into(),
            name: "sql".into(),
            engine: "198.18.0.7:8000".into(),
            status: 400,
            message: "LoRA rank 64 is greater than max_lora_rank 16.".into(),
            time: "2026-12-01T00:00:01Z".into(),
            ..Default::default()
        };
        let older = AdapterLoadFailure {
            time: "2026-11-30T23:59:00Z".into(),
            message: "earlier".into(),
            ..refused.clone()
        };
        let engines = [("qwen-a".to_owned(), Some(&without))];
        let failures = [(None, &older), (Some("qwen-a".to_owned()), &refused)];
        let s = loaded_status("sql", &engines, &failures, &[], Some(1), &now);
        let c = &s.conditions[0];
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "LoadFailed")
        );
        assert!(
            c.message.starts_with(
                "the engine refused to load it: engine qwen-a answered 400: LoRA rank 64 is greater than max_lora_rank 16. (1 more failed loads reported)"
            ),
            "{}",
            c.message
        );
        // Loaded elsewhere: Loaded, the failure said beside it.
        let engines = [
            ("qwen-a".to_owned(), Some(&without)),
            ("qwen-b".to_owned(), Some(&with)),
        ];
        let s = loaded_status("sql", &engines, &failures[1..], &[], Some(1), &now);
        let c = &s.conditions[0];
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", "Loaded"));
        assert!(
            c.message.contains("failed on another: engine qwen-a"),
            "{}",
            c.message
        );
        // An engine that did not answer.
        let gone = AdapterLoadFailure {
            status: 0,
            message: "connection refused".into(),
            ..refused.clone()
        };
        let s = loaded_status("sql", &[], &[(None, &gone)], &[], Some(1), &now);
        assert!(
            s.conditions[0]
                .message
                .contains("engine 198.18.0.7:8000 did not answer"),
            "{}",
            s.conditions[0].message
        );
    }
}

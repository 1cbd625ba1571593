//! The `LLMAdapter` reconciler: whether an adapter is accepted on its base, by the rule the
//! admission webhook applies (`hearth_crds::rules::adapters::check_llmadapter_among`), written
//! to its status (`Accepted`, `servedName`, `observedGeneration`) by server-side apply under
//! the controller's field manager.
//!
//! An adapter is reconciled when it changes, when its base LLMService changes (the services'
//! watch reports it, [`adapters_of`]), and every resync period (its base's runtime, endpoint
//! and namespace labels change rarely and are read then).

use std::{collections::BTreeMap, sync::Arc};

use futures::channel::mpsc;
use hearth_crds::{
    LLMAdapter, LLMService,
    llmadapter::LLMAdapterStatus,
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

/// The status `adapter` should have given `findings`, keeping `lastTransitionTime` where the
/// condition's status did not change. The engine-reported fields (`loadedReplicas`,
/// `loadedOn`) are kept as they are.
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
        ..previous
    }
}

/// The findings about `adapter` in the controller's caches.
pub(super) fn findings(adapter: &LLMAdapter, ctx: &Context) -> Findings {
    let base = get_in(
        &ctx.llmservices,
        adapter.service_namespace(),
        &adapter.spec.service_ref.name,
    );
    let runtimes = ctx.runtimes.state();
    let runtime = base.as_deref().and_then(|svc| {
        resolve_runtime(svc, runtimes.iter().map(AsRef::as_ref))
            .ok()
            .map(|r| r.runtime)
    });
    let endpoint_models = base
        .as_deref()
        .and_then(endpoint_key)
        .and_then(|k| ctx.endpoint(&k))
        .and_then(|ep| ep.status.as_ref().map(|s| s.models.clone()))
        .unwrap_or_default();
    let labels: Option<BTreeMap<String, String>> = adapter
        .namespace()
        .and_then(|ns| ctx.namespaces.get(&ObjectRef::new(&ns)))
        .map(|n| n.metadata.labels.clone().unwrap_or_default());
    let adapters = ctx.adapters.state();
    rules::adapters::check_llmadapter_among(
        adapter,
        base.as_deref(),
        runtime,
        adapters.iter().map(AsRef::as_ref),
        &endpoint_models,
        labels.as_ref(),
    )
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
    if adapter.status.as_ref() != Some(&status) {
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
        let f = rules::adapters::check_llmadapter_among(&a, None, None, [], &[], None);
        assert!(!f.blocks_rendering());
        let c = accepted(&f);
        assert_eq!((c.status, c.reason.as_str()), ("False", "ServiceNotFound"));
        assert!(
            c.message
                .starts_with("spec.serviceRef: LLMService team-a/qwen")
        );
    }

    #[test]
    fn the_status_keeps_what_the_engines_report_and_the_transition_time() {
        let mut a = adapter();
        let t0 = Time("2026-12-01T00:00:00Z".parse().unwrap());
        let f = rules::adapters::check_llmadapter_among(&a, None, None, [], &[], None);
        let first = adapter_status(&a, &f, &t0);
        assert_eq!(first.served_name.as_deref(), Some("sql"));
        assert_eq!(first.observed_generation, Some(3));
        a.status = Some(LLMAdapterStatus {
            loaded_replicas: 1,
            loaded_on: vec!["qwen-backend-0".into()],
            ..first.clone()
        });
        let later = Time("2026-12-02T00:00:00Z".parse().unwrap());
        let again = adapter_status(&a, &f, &later);
        assert_eq!(again.loaded_on, ["qwen-backend-0"]);
        assert_eq!(again.conditions[0].last_transition_time, t0);
    }
}

//! The export mode (`--policy-export`, off by default): each cluster ServingPolicy the
//! apiserver can run is applied as the ValidatingAdmissionPolicy and/or MutatingAdmissionPolicy
//! (with bindings) that `hearth_policies::export` makes of it, so it holds even while Hearth's
//! webhook is away; the webhook stops evaluating it while those objects are in place.
//!
//! **API versions** by discovery, on every pass: ValidatingAdmissionPolicy `v1`;
//! MutatingAdmissionPolicy `v1` when served (1.36), else `v1beta1` (1.34 and 1.35 with its
//! feature gate and runtime-config), else none: a policy with mutations is then not exported
//! and its reason says so. Which CEL the apiserver accepts follows its minor version.
//!
//! **When.** When the controller starts leading, when the set of policies changes, when an
//! InferenceRuntime changes (the vendor table the exported match condition holds), and every
//! [`ExportConfig::interval`] (which also puts back an exported object someone deleted).
//!
//! **What it writes.** Objects named after the policy, labelled
//! `serving.hearth.dev/exported-from`, owned by the policy (deleting it deletes them), applied
//! server-side as [`FIELD_MANAGER`] in phases ([`SETTLE`] apart: a new policy object, its
//! binding, the binding marked [`ENFORCED`], after which the webhook stops evaluating the
//! policy). Exported objects of a policy that is gone, unselected, no longer exportable or no
//! longer compiling in Hearth are deleted; a failed apply keeps what still holds the same
//! version. An object of the same name that no ServingPolicy owns is never touched: the
//! policy's export fails, saying so. Each policy's `status.export` (objects, or the reasons)
//! and condition `Exported` (`Exported`, `Pending`, `NotExportable`, `ApplyFailed` with the
//! apiserver's message: it type-checks what Hearth does not; `NotSelected`) are written when
//! they change.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::{Future, StreamExt};
use hearth_crds::admission_apis::{AdmissionApis, discover};
use hearth_crds::servingpolicy::{ExportReason, ExportStatus, ExportedObject};
use hearth_crds::{InferenceRuntime, ServingPolicy};
use hearth_policies::export::{self, ENFORCED, EXPORTED_AT, EXPORTED_FROM, Kind, Reason, Target};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, predicates, watcher};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

use crate::policy::ClusterEngine;
use crate::reconcile::{Error, kube_err};

/// Field manager of the exported objects and of `status.export`.
pub const FIELD_MANAGER: &str = "hearth-policy-export";

/// The condition type on a ServingPolicy.
pub const CONDITION: &str = "Exported";

/// How long to gather changes before a pass.
const DEBOUNCE: Duration = Duration::from_secs(1);
/// The first wait after a failed pass (doubling up to `interval`).
const RETRY_FIRST: Duration = Duration::from_secs(5);

/// The export mode's settings.
#[derive(Clone, Debug)]
pub struct ExportConfig {
    /// Hearth's namespace: skipped by the bindings, as by the webhook.
    pub own_namespace: String,
    /// Time between passes without a change.
    pub interval: Duration,
    /// Export only the ServingPolicies this label selector selects (`None`: all); the exported
    /// objects of the others are deleted.
    pub selector: Option<String>,
}

/// What a pass did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Pass {
    /// Policies exported.
    pub exported: usize,
    /// Policies that cannot be exported.
    pub not_exportable: usize,
    /// Policies whose objects the apiserver refused.
    pub failed: usize,
    /// Stale exported objects deleted.
    pub deleted: usize,
    /// Whether an export waits for [`SETTLE`] (the next pass comes after it).
    pub pending: bool,
}

/// What the export of one policy came to.
enum Outcome {
    /// Applied; `pending` while the apiserver is given [`SETTLE`] to load a new policy or
    /// binding (the webhook evaluates the policy too until its bindings are [`ENFORCED`]).
    Exported {
        objects: Vec<ExportedObject>,
        pending: bool,
    },
    NotExportable(Vec<Reason>),
    Failed(String),
    /// Left out by `--policy-export-selector`.
    NotSelected,
}

/// How long the apiserver is given to load an exported policy before its binding is applied,
/// and a binding before the webhook stops evaluating the policy: the apiserver reads them (and
/// the InferenceRuntimes, its params) through informers, which a moment after a write may not
/// have them yet.
pub const SETTLE: Duration = Duration::from_secs(5);

/// An exported object found at the start of a pass.
#[derive(Debug, Clone)]
struct Existing {
    /// The policy of its `serving.hearth.dev/exported-from` label.
    from: String,
    /// Whether a ServingPolicy owns it (the export mode's; one applied by hand from
    /// `hearth-policy export` is not, and is never changed or deleted).
    owned: bool,
    annotations: BTreeMap<String, String>,
}

impl Existing {
    /// How long ago it was first applied for the export it holds.
    fn age(&self, now: Timestamp) -> Option<Duration> {
        let at: Timestamp = self.annotations.get(EXPORTED_AT)?.parse().ok()?;
        Duration::try_from(now.duration_since(at)).ok()
    }
}

/// One pass: every selected cluster ServingPolicy that compiles exported (or its reasons
/// recorded), stale objects deleted.
///
/// # Errors
///
/// Discovery or a list failed; a single policy's failure is its status, not an error.
pub async fn export_once(client: &Client, cfg: &ExportConfig) -> Result<Pass, Error> {
    let apis = discover(client)
        .await
        .map_err(kube_err("discover admissionregistration.k8s.io"))?;
    let target = Target::served(
        apis.minor,
        apis.validating_v1,
        apis.mutating_v1,
        apis.mutating_v1beta1,
    );
    let runtimes = Api::<InferenceRuntime>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(kube_err("list InferenceRuntimes"))?
        .items;
    let digest = export::runtimes_digest(&runtimes);
    let policy_api = Api::<ServingPolicy>::all(client.clone());
    let policies = policy_api
        .list(&ListParams::default())
        .await
        .map_err(kube_err("list ServingPolicies"))?
        .items;
    let selected: BTreeSet<String> = match &cfg.selector {
        None => policies.iter().map(ResourceExt::name_any).collect(),
        Some(selector) => policy_api
            .list_metadata(&ListParams::default().labels(selector))
            .await
            .map_err(kube_err("list ServingPolicies by --policy-export-selector"))?
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect(),
    };
    let mut existing: BTreeMap<(Kind, String), Existing> = BTreeMap::new();
    for kind in Kind::ALL {
        let Some(ar) = kind.api_resource(&apis) else {
            continue;
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
        let list = api
            .list_metadata(&ListParams::default().labels(EXPORTED_FROM))
            .await
            .map_err(kube_err(format!("list {}", kind.plural())))?;
        for o in list.items {
            let owned = o.owner_references().iter().any(|r| {
                r.kind == "ServingPolicy" && r.api_version.starts_with("serving.hearth.dev/")
            });
            existing.insert(
                (kind, o.name_any()),
                Existing {
                    from: o.labels().get(EXPORTED_FROM).cloned().unwrap_or_default(),
                    owned,
                    annotations: o.annotations().clone(),
                },
            );
        }
    }
    let skip = export::skipped_namespaces(&cfg.own_namespace);
    let mut keep: BTreeSet<(Kind, String)> = BTreeSet::new();
    let mut pass = Pass::default();
    let now = Timestamp::now();
    for p in &policies {
        let name = p.name_any();
        let outcome = if !selected.contains(&name) {
            Outcome::NotSelected
        } else if let Err(e) = hearth_policies::cluster::Compiled::compile(p) {
            // The webhook evaluates its last good version: exporting this one would enforce
            // two versions at once.
            Outcome::NotExportable(vec![Reason {
                field: "spec".to_owned(),
                construct: "compile error".to_owned(),
                message: e,
            }])
        } else {
            match export::export(p, &runtimes, &target, &skip) {
                Err(reasons) => Outcome::NotExportable(reasons),
                Ok(objects) => apply_all(client, &apis, p, &digest, objects, &existing, now).await,
            }
        };
        match &outcome {
            Outcome::Exported { objects, pending } => {
                pass.exported += 1;
                pass.pending |= *pending;
                for o in objects {
                    if let Some(k) = Kind::from_name(&o.kind) {
                        keep.insert((k, o.name.clone()));
                    }
                }
            }
            Outcome::Failed(_) => {
                pass.failed += 1;
                // A failure (a timeout, a refused new version) leaves in place what still
                // holds this very version.
                for (k, e) in &existing {
                    if e.from == name && export::of_this_export(&e.annotations, p, &digest) {
                        keep.insert(k.clone());
                    }
                }
            }
            Outcome::NotExportable(_) => pass.not_exportable += 1,
            Outcome::NotSelected => {}
        }
        write_status(client, p, outcome).await;
    }
    for ((kind, name), _) in existing
        .iter()
        .filter(|(k, e)| e.owned && !keep.contains(*k))
    {
        let Some(ar) = kind.api_resource(&apis) else {
            continue;
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => pass.deleted += 1,
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(kube_err(format!("delete {} {name}", kind.as_str()))(e));
            }
        }
    }
    Ok(pass)
}

/// Applies one policy's objects in phases: a new policy object first; its binding once the
/// policy object has existed for [`SETTLE`] (a binding already there is updated at once); the
/// binding marked [`ENFORCED`] once it has existed for [`SETTLE`] with this export. The first
/// refusal fails the policy.
async fn apply_all(
    client: &Client,
    apis: &AdmissionApis,
    policy: &ServingPolicy,
    digest: &str,
    objects: Vec<Value>,
    existing: &BTreeMap<(Kind, String), Existing>,
    now: Timestamp,
) -> Outcome {
    let name = policy.name_any();
    let mut applied = Vec::new();
    let mut pending = false;
    for mut o in objects {
        let (Some(kind), Some(object_name)) = (
            o["kind"].as_str().and_then(Kind::from_name),
            o["metadata"]["name"].as_str().map(str::to_owned),
        ) else {
            return Outcome::Failed("an exported object has no kind or name".to_owned());
        };
        let Some(ar) = kind.api_resource(apis) else {
            return Outcome::Failed(format!("the apiserver does not serve {}", kind.as_str()));
        };
        let api: Api<DynamicObject> = Api::all_with(client.clone(), &ar);
        let found = existing.get(&(kind, object_name.clone()));
        match found {
            Some(e) if e.from == name && e.owned => {}
            Some(e) if e.from != name => {
                return Outcome::Failed(format!(
                    "{} {object_name} was exported from ServingPolicy {}; rename one of the policies",
                    kind.as_str(),
                    e.from
                ));
            }
            Some(_) => {
                return Outcome::Failed(format!(
                    "a {} named {object_name} exists that the export mode did not apply (no owner); delete it or rename the ServingPolicy",
                    kind.as_str()
                ));
            }
            None => match api.get_metadata_opt(&object_name).await {
                Ok(None) => {}
                Ok(Some(_)) => {
                    return Outcome::Failed(format!(
                        "a {} named {object_name} exists that Hearth did not export; rename the ServingPolicy or that object",
                        kind.as_str()
                    ));
                }
                Err(e) => {
                    return Outcome::Failed(format!(
                        "reading {} {object_name}: {e}",
                        kind.as_str()
                    ));
                }
            },
        }
        // The same export as before keeps its time.
        let same = found.filter(|e| export::of_this_export(&e.annotations, policy, digest));
        let at = same
            .and_then(|e| e.annotations.get(EXPORTED_AT).cloned())
            .unwrap_or_else(|| now.to_string());
        let settled =
            |e: Option<&Existing>| e.and_then(|e| e.age(now)).is_some_and(|a| a >= SETTLE);
        if kind.is_binding() {
            let policy_object = existing
                .get(&(kind.policy_kind(), object_name.clone()))
                .filter(|e| e.from == name);
            if found.is_none() && !settled(policy_object) {
                // Not yet: the apiserver is given time to load the policy first.
                pending = true;
                continue;
            }
            if settled(same) {
                o["metadata"]["annotations"][ENFORCED] = json!("true");
            } else {
                pending = true;
            }
        }
        o["metadata"]["annotations"][EXPORTED_AT] = json!(at);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        if let Err(e) = api.patch(&object_name, &params, &Patch::Apply(&o)).await {
            let message = match e {
                kube::Error::Api(s) => s.message,
                e => e.to_string(),
            };
            return Outcome::Failed(format!(
                "the apiserver refused {} {object_name}: {message}",
                kind.as_str()
            ));
        }
        applied.push(ExportedObject {
            api_version: ar.api_version.clone(),
            kind: kind.as_str().to_owned(),
            name: object_name,
        });
    }
    Outcome::Exported {
        objects: applied,
        pending,
    }
}

/// The condition and `status.export` of `outcome`.
fn status_of(
    generation: i64,
    outcome: Outcome,
) -> (Option<ExportStatus>, &'static str, &'static str, String) {
    let mut export = ExportStatus {
        observed_generation: Some(generation),
        ..ExportStatus::default()
    };
    let (status, reason, message) = match outcome {
        Outcome::Exported { objects, pending } => {
            let names = objects
                .iter()
                .map(|o| format!("{} {}", o.kind, o.name))
                .collect::<Vec<_>>()
                .join(", ");
            export.objects = objects;
            if pending {
                (
                    "False",
                    "Pending",
                    format!(
                        "exported as {names} so far; the apiserver is given {}s to load each before Hearth's webhook stops evaluating the policy",
                        SETTLE.as_secs()
                    ),
                )
            } else {
                (
                    "True",
                    "Exported",
                    format!(
                        "the apiserver runs this policy as {names}; Hearth's webhook does not evaluate it while they exist"
                    ),
                )
            }
        }
        Outcome::NotSelected => (
            "False",
            "NotSelected",
            "not exported: --policy-export-selector does not select it; Hearth's webhook evaluates it".to_owned(),
        ),
        Outcome::NotExportable(reasons) => {
            let message = format!(
                "not exported; Hearth's webhook evaluates it: {}",
                reasons
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join("; ")
            );
            export.reasons = reasons
                .into_iter()
                .map(|r| ExportReason {
                    field: r.field,
                    construct: r.construct,
                    message: r.message,
                })
                .collect();
            ("False", "NotExportable", message)
        }
        Outcome::Failed(m) => (
            "False",
            "ApplyFailed",
            format!("not exported; Hearth's webhook evaluates it: {m}"),
        ),
    };
    let export = (reason != "NotSelected").then_some(export);
    (export, status, reason, message)
}

/// Writes `status.export` and the `Exported` condition unless they say this already.
async fn write_status(client: &Client, p: &ServingPolicy, outcome: Outcome) {
    let generation = p.metadata.generation.unwrap_or_default();
    let (export, status, reason, message) = status_of(generation, outcome);
    let current = p.status.as_ref();
    let existing = current.and_then(|s| s.conditions.iter().find(|c| c.type_ == CONDITION));
    // A policy never exported says nothing about not being selected.
    if export.is_none() && existing.is_none() {
        return;
    }
    let same = current.and_then(|s| s.export.as_ref()) == export.as_ref()
        && existing.is_some_and(|c| {
            c.status == status
                && c.reason == reason
                && c.message == message
                && c.observed_generation == Some(generation)
        });
    if same {
        return;
    }
    let transition = existing
        .filter(|c| c.status == status)
        .map(|c| c.last_transition_time.clone())
        .unwrap_or_else(|| Time(k8s_openapi::jiff::Timestamp::now()));
    let cond = Condition {
        type_: CONDITION.to_owned(),
        status: status.to_owned(),
        reason: reason.to_owned(),
        message,
        observed_generation: Some(generation),
        last_transition_time: transition,
    };
    // Applied without `export` (not selected), the field this manager owned goes.
    let mut status = json!({ "conditions": [cond] });
    if let Some(export) = export {
        status["export"] = json!(export);
    }
    let patch = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "ServingPolicy",
        "status": status,
    });
    let api: Api<ServingPolicy> = Api::all(client.clone());
    if let Err(e) = api
        .patch_status(
            &p.name_any(),
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
    {
        tracing::warn!(policy = %p.name_any(), error = %e, "could not write the ServingPolicy's export status");
    }
}

/// Runs passes until `shutdown`: at start, on policy and runtime changes, and every
/// `cfg.interval`; a failed pass is tried again after 5 s, doubling up to the interval.
pub async fn run(
    client: Client,
    cfg: ExportConfig,
    engine: ClusterEngine,
    shutdown: impl Future<Output = ()>,
) {
    let mut policies = engine.subscribe();
    policies.borrow_and_update();
    // Spec changes only (a status write, such as the pre-pull's, changes no vendor or priority).
    let runtime_changes = watcher(
        Api::<InferenceRuntime>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .touched_objects()
    .predicate_filter(predicates::generation, Default::default());
    let passes = async {
        let mut runtime_changes = std::pin::pin!(runtime_changes);
        let mut retry = RETRY_FIRST;
        loop {
            let wait = match export_once(&client, &cfg).await {
                Ok(pass) => {
                    tracing::info!(
                        exported = pass.exported,
                        not_exportable = pass.not_exportable,
                        failed = pass.failed,
                        deleted = pass.deleted,
                        pending = pass.pending,
                        "policy export done"
                    );
                    retry = RETRY_FIRST;
                    if pass.pending { SETTLE } else { cfg.interval }
                }
                Err(e) => {
                    let wait = retry.min(cfg.interval);
                    tracing::warn!(error = %e, retry_seconds = wait.as_secs(), "policy export failed; trying again");
                    retry = (retry * 2).min(cfg.interval);
                    wait
                }
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                changed = policies.changed() => {
                    if changed.is_err() {
                        return;
                    }
                }
                Some(Ok(_)) = runtime_changes.next() => {}
            }
            tokio::time::sleep(DEBOUNCE).await;
            // Changes gathered during the debounce are in this pass.
            policies.borrow_and_update();
            while let Some(Some(_)) = futures::FutureExt::now_or_never(runtime_changes.next()) {}
        }
    };
    tokio::select! {
        () = passes => {}
        () = shutdown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conditions_say_what_the_export_came_to() {
        let objects = vec![ExportedObject {
            api_version: "admissionregistration.k8s.io/v1".to_owned(),
            kind: "ValidatingAdmissionPolicy".to_owned(),
            name: "p".to_owned(),
        }];
        let (export, status, reason, message) = status_of(
            3,
            Outcome::Exported {
                objects: objects.clone(),
                pending: false,
            },
        );
        assert_eq!((status, reason), ("True", "Exported"));
        let export = export.unwrap();
        assert_eq!(export.objects, objects);
        assert_eq!(export.observed_generation, Some(3));
        assert!(message.contains("ValidatingAdmissionPolicy p"), "{message}");
        let (_, status, reason, _) = status_of(
            3,
            Outcome::Exported {
                objects,
                pending: true,
            },
        );
        assert_eq!((status, reason), ("False", "Pending"));
        let (export, status, reason, _) = status_of(3, Outcome::NotSelected);
        assert_eq!((status, reason), ("False", "NotSelected"));
        assert!(export.is_none(), "status.export is removed");
        let (export, status, reason, message) = status_of(
            3,
            Outcome::NotExportable(vec![Reason {
                field: "spec.variables[0].expression".to_owned(),
                construct: "service".to_owned(),
                message: "no such variable".to_owned(),
            }]),
        );
        assert_eq!((status, reason), ("False", "NotExportable"));
        assert_eq!(export.unwrap().reasons[0].construct, "service");
        assert!(
            message.contains("spec.variables[0].expression: service"),
            "{message}"
        );
        let (_, status, reason, _) = status_of(3, Outcome::Failed("refused".to_owned()));
        assert_eq!((status, reason), ("False", "ApplyFailed"));
    }
}

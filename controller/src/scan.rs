//! Background scans: the ServingPolicies evaluated against the workloads that already run, with
//! the results written as Policy Reports and counted on each policy's `status.scan`.
//!
//! **What is scanned.** Deployments and StatefulSets that opted in to Hearth (the runtime or
//! vendor annotation or label, [`Selection::from_object`]), in the watched namespace or every
//! namespace, each evaluated as admission would if it were created now
//! ([`hearth_policies::report::results`]): the resolved InferenceRuntime as `params`, the
//! namespace (its metadata) as `namespaceObject`, no user. The runtimes and namespaces are read
//! at the start of each scan (the runtimes listed; the namespaces listed as metadata, or the
//! watched one read). A workload whose runtime does not
//! resolve is counted as unresolved and not reported (admission would refuse it; an earlier
//! report of it is deleted). Backends rendered from LLMServices are not scanned: every render
//! runs the policies' mutations on them and reports those of policies with `Warn` or `Audit` on
//! the backend itself (`serving.hearth.dev/policy-reports`, `crate::policy::apply`).
//!
//! **When.** Once when the controller starts leading, when the set of policies changes
//! (created, edited, deleted; after [`SCAN_DEBOUNCE`]), and every [`ScanConfig::interval`].
//!
//! **Bounded.** Workloads are listed a page of [`PAGE`] at a time (the memory held is one page,
//! the digests of the reports and the UIDs of the workloads evaluated), evaluated on the blocking pool at most
//! [`ScanConfig::rate`] per second, and a report is written only when its results changed
//! (their digest is kept on the report, [`DIGEST_ANNOTATION`]).
//!
//! **Reports.** The Policy Reports API `wgpolicyk8s.io/v1alpha2` ([`REPORT_API_VERSION`]), the
//! version Kyverno writes by default and Policy Reporter, Trivy's adapter and other consumers
//! read; `openreports.io/v1alpha1`, its successor, is still opt-in in Kyverno. One namespaced
//! `PolicyReport` per workload, named [`report_name`] (`hearth-<uid>`), its `scope` the
//! workload, owned by it (deleted with it); source `hearth`, one result per rule of each
//! matched policy (`validations`, `mutations`; see `hearth_policies::report`). A report whose
//! workload no longer matches any policy is deleted. Without the PolicyReport CRD (or without
//! its `v1alpha2` served) the counts are still written, each scan's log line says
//! `reports=false`, and the CRD is looked for every [`CRD_RECHECK`]: a scan starts when it
//! appears.
//!
//! **Retries.** A scan that fails (a list refused, the apiserver away) is tried again after
//! [`RETRY_FIRST`], doubling up to [`RETRY_MAX`]. A list whose continue token expired during a
//! long, paced scan (`410 Gone`) starts that kind's list again, skipping the workloads already
//! evaluated.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use futures::Future;
use hearth_crds::{InferenceRuntime, ServingPolicy};
use hearth_policies::report::{Counts, PolicyResult, results};
use hearth_policies::{EvalInput, PolicySet, RequestInfo, Selection, resolve_runtime};
use k8s_openapi::api::apps::v1::{Deployment, StatefulSet};
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
};
use kube::core::PartialObjectMeta;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::policy::ClusterEngine;
use crate::reconcile::{Error, kube_err};

/// The Policy Reports API Hearth writes.
pub const REPORT_API_VERSION: &str = "wgpolicyk8s.io/v1alpha2";
/// Its CRD; without it no report is written.
pub const REPORT_CRD: &str = "policyreports.wgpolicyk8s.io";
/// The `source` of Hearth's results.
pub const SOURCE: &str = "hearth";
/// The label that marks the reports Hearth writes (`app.kubernetes.io/managed-by`).
pub const MANAGED_BY: (&str, &str) = ("app.kubernetes.io/managed-by", "hearth-controller");
/// The annotation on a report holding the digest of its results (timestamps aside).
pub const DIGEST_ANNOTATION: &str = "serving.hearth.dev/results-digest";
/// The field manager of the reports and of ServingPolicies' `status.scan`.
pub const FIELD_MANAGER: &str = "hearth-controller-scan";
/// Workloads listed per page.
pub const PAGE: u32 = 500;
/// How long the set of policies must stay unchanged before a scan starts.
pub const SCAN_DEBOUNCE: Duration = Duration::from_secs(2);
/// How often the PolicyReport CRD is looked for while reports are off.
pub const CRD_RECHECK: Duration = Duration::from_secs(60);
/// The first wait before a failed scan is tried again.
pub const RETRY_FIRST: Duration = Duration::from_secs(30);
/// The longest wait between tries of a failing scan.
pub const RETRY_MAX: Duration = Duration::from_secs(600);
/// The most of a would-mutate patch a result's `patch` property holds (bytes of JSON).
pub const PATCH_PROPERTY_LIMIT: usize = 4096;

/// How the background scan runs.
#[derive(Clone, Debug)]
pub struct ScanConfig {
    /// Time between periodic scans; zero: only at start and on policy changes.
    pub interval: Duration,
    /// Workloads evaluated per second, at most (at least 1).
    pub rate: u32,
}

impl Default for ScanConfig {
    /// Every hour, 200 workloads a second.
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(3600),
            rate: 200,
        }
    }
}

/// What one scan did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScanSummary {
    /// Workloads listed (every Deployment and StatefulSet in scope).
    pub listed: u64,
    /// Workloads that opted in and were evaluated.
    pub evaluated: u64,
    /// Opted-in workloads whose runtime did not resolve (not reported).
    pub unresolved: u64,
    /// Reports written (new or changed).
    pub written: u64,
    /// Reports already up to date.
    pub unchanged: u64,
    /// Reports deleted (their workload is gone from scope or matches no policy).
    pub deleted: u64,
    /// Reports whose write or deletion the apiserver refused (the first logged; the next scan
    /// tries again).
    pub failed: u64,
    /// Whether the PolicyReport CRD is installed (reports were written).
    pub reports: bool,
    /// Per cluster policy (by name): the workloads it matched and its counts.
    pub policies: BTreeMap<String, (u64, Counts)>,
}

/// `hearth-<uid>`: the report of the workload with `uid`.
pub fn report_name(uid: &str) -> String {
    format!("hearth-{uid}")
}

/// The API resource of `PolicyReport`.
pub fn report_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("wgpolicyk8s.io", "v1alpha2", "PolicyReport"),
        "policyreports",
    )
}

/// The digest of `results` (the first 128 bits of their SHA-256, hex): what decides whether a
/// report is written again.
pub fn digest(results: &[PolicyResult]) -> String {
    let bytes = serde_json::to_vec(results).unwrap_or_default();
    let d = ring::digest::digest(&ring::digest::SHA256, &bytes);
    d.as_ref()[..16]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The PolicyReport of `workload` (a Deployment or StatefulSet as JSON, with its `uid`) for
/// `results`, found at `now`: scope and owner the workload, a summary, one result per entry.
/// A would-mutate result carries the patch (JSON, at most [`PATCH_PROPERTY_LIMIT`] bytes,
/// else left out and said so) in its `patch` property.
pub fn policy_report(workload: &Value, results: &[PolicyResult], now: SystemTime) -> Value {
    let meta = &workload["metadata"];
    let uid = meta["uid"].as_str().unwrap_or_default();
    let reference = json!({
        "apiVersion": workload["apiVersion"],
        "kind": workload["kind"],
        "name": meta["name"],
        "namespace": meta["namespace"],
        "uid": uid,
    });
    let since = now.duration_since(UNIX_EPOCH).unwrap_or_default();
    let timestamp = json!({"seconds": since.as_secs(), "nanos": 0});
    let mut summary = json!({"pass": 0, "fail": 0, "warn": 0, "error": 0, "skip": 0});
    let entries: Vec<Value> = results
        .iter()
        .map(|r| {
            let key = r.result.as_str();
            summary[key] = json!(summary[key].as_u64().unwrap_or(0) + 1);
            let mut properties = serde_json::Map::new();
            if let Some(patch) = &r.would_mutate {
                properties.insert("outcome".into(), json!("would-mutate"));
                let text = serde_json::to_string(patch).unwrap_or_default();
                properties.insert(
                    "patch".into(),
                    if text.len() <= PATCH_PROPERTY_LIMIT {
                        json!(text)
                    } else {
                        json!(format!(
                            "({} bytes, over {PATCH_PROPERTY_LIMIT}: see the message for its paths)",
                            text.len()
                        ))
                    },
                );
            }
            let mut entry = json!({
                "source": SOURCE,
                "policy": r.policy,
                "rule": r.rule.as_str(),
                "category": "ServingPolicy",
                "result": key,
                "scored": true,
                "timestamp": timestamp,
            });
            if !r.message.is_empty() {
                entry["message"] = json!(r.message);
            }
            if !properties.is_empty() {
                entry["properties"] = Value::Object(properties);
            }
            entry
        })
        .collect();
    json!({
        "apiVersion": REPORT_API_VERSION,
        "kind": "PolicyReport",
        "metadata": {
            "name": report_name(uid),
            "namespace": meta["namespace"],
            "labels": {MANAGED_BY.0: MANAGED_BY.1},
            "annotations": {DIGEST_ANNOTATION: digest(results)},
            "ownerReferences": [{
                "apiVersion": workload["apiVersion"],
                "kind": workload["kind"],
                "name": meta["name"],
                "uid": uid,
            }],
        },
        "scope": reference,
        "summary": summary,
        "results": entries,
    })
}

/// What the scans read and write with, and how they run.
pub struct Scanner {
    /// The API client.
    pub client: Client,
    /// Scan only this namespace (all when `None`).
    pub namespace: Option<String>,
    /// The policies (their changes trigger a scan).
    pub engine: ClusterEngine,
    /// `settings` (`crate::render::RenderConfig::policy_settings`).
    pub settings: Value,
    /// Interval and pace.
    pub cfg: ScanConfig,
}

/// What a scan evaluates one workload with, besides the policies.
pub struct Inputs<'a> {
    /// The cluster's InferenceRuntimes.
    pub runtimes: &'a [InferenceRuntime],
    /// Each namespace as `namespaceObject` sees it (its metadata), by name.
    pub namespaces: &'a HashMap<String, Value>,
    /// `settings`.
    pub settings: &'a Value,
}

/// The results of `object` (a workload as JSON): `None` when it did not opt in, `Some(Err)`
/// when its runtime does not resolve. Only an opted-in workload is copied (into the input).
pub fn evaluate(
    set: &PolicySet,
    inputs: &Inputs<'_>,
    object: &Value,
) -> Option<Result<Vec<PolicyResult>, String>> {
    let selection = Selection::from_object(object)?;
    let runtime = match resolve_runtime(inputs.runtimes, &selection) {
        Ok(rt) => rt,
        Err(e) => return Some(Err(e.to_string())),
    };
    let namespace_object = object["metadata"]["namespace"]
        .as_str()
        .and_then(|ns| inputs.namespaces.get(ns))
        .cloned();
    let request = RequestInfo::for_object(object, hearth_crds::servingpolicy::Operation::Create);
    let input = EvalInput {
        namespace_object,
        ..EvalInput::for_workload(request, object.clone(), runtime, inputs.settings.clone())
    };
    Some(Ok(results(set, &input)))
}

/// Keeps evaluations under `rate` per second from `start`.
struct Pace {
    start: Instant,
    done: u64,
    rate: u32,
}

impl Pace {
    fn new(rate: u32) -> Self {
        Self {
            start: Instant::now(),
            done: 0,
            rate: rate.max(1),
        }
    }

    /// Counts `n` more and sleeps until they are due. Time spent elsewhere (lists, writes)
    /// earns no credit: when behind, the schedule restarts from now, so no burst follows a
    /// stall.
    async fn step(&mut self, n: usize) {
        let now = Instant::now();
        let spent = Duration::from_secs_f64(self.done as f64 / f64::from(self.rate));
        if self.start + spent < now {
            self.start = now - spent;
        }
        self.done += n as u64;
        let due = self.start + Duration::from_secs_f64(self.done as f64 / f64::from(self.rate));
        tokio::time::sleep_until(due.into()).await;
    }
}

/// One page of `api`'s objects from `token` on, as JSON (without `managedFields`), and the
/// token of the next page (`None` after the last).
async fn list_page<K>(
    api: &Api<K>,
    what: &str,
    token: Option<&str>,
) -> Result<(Vec<Value>, Option<String>), Error>
where
    K: Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let mut lp = ListParams::default().limit(PAGE);
    if let Some(t) = token {
        lp = lp.continue_token(t);
    }
    let page = api
        .list(&lp)
        .await
        .map_err(kube_err(format!("list {what}")))?;
    let next = page.metadata.continue_.clone().filter(|t| !t.is_empty());
    let objects = page
        .items
        .into_iter()
        .filter_map(|mut o| {
            o.meta_mut().managed_fields = None;
            serde_json::to_value(o).ok()
        })
        .collect();
    Ok((objects, next))
}

/// What a scan carries from page to page.
struct Scan<'a> {
    set: PolicySet,
    runtimes: Arc<[InferenceRuntime]>,
    namespaces: Arc<HashMap<String, Value>>,
    settings: Arc<Value>,
    client: &'a Client,
    existing: HashMap<(String, String), String>,
    kept: HashSet<(String, String)>,
    pace: Pace,
    chunk: usize,
    summary: ScanSummary,
    /// The UIDs of the workloads already evaluated (a list started again after `410 Gone`
    /// skips them).
    seen: HashSet<String>,
}

impl Scan<'_> {
    /// Evaluates one page of workloads (on the blocking pool, `chunk` at a time, paced) and
    /// writes the reports that changed.
    async fn page(&mut self, objects: Vec<Value>) -> Result<(), Error> {
        let objects: Vec<Value> = objects
            .into_iter()
            .filter(|o| {
                let uid = o["metadata"]["uid"].as_str().unwrap_or_default();
                self.seen.insert(uid.to_owned())
            })
            .collect();
        self.summary.listed += objects.len() as u64;
        let mut objects = objects.into_iter().peekable();
        while objects.peek().is_some() {
            let batch: Vec<Value> = objects.by_ref().take(self.chunk).collect();
            let (set, runtimes, settings, namespaces) = (
                self.set.clone(),
                self.runtimes.clone(),
                self.settings.clone(),
                self.namespaces.clone(),
            );
            let evaluated = tokio::task::spawn_blocking(move || {
                let inputs = Inputs {
                    runtimes: &runtimes,
                    namespaces: &namespaces,
                    settings: &settings,
                };
                batch
                    .into_iter()
                    .filter_map(|o| {
                        let r = evaluate(&set, &inputs, &o)?;
                        Some((o, r))
                    })
                    .collect::<Vec<_>>()
            })
            .await
            .map_err(|e| Error::Render(format!("policy scan: {e}")))?;
            self.pace.step(evaluated.len()).await;
            for (object, outcome) in evaluated {
                let Ok(results) = outcome else {
                    self.summary.unresolved += 1;
                    continue;
                };
                self.summary.evaluated += 1;
                record(&mut self.summary, &results);
                if results.is_empty() || !self.summary.reports {
                    continue;
                }
                let report = policy_report(&object, &results, SystemTime::now());
                let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                let key = (
                    text(&report["metadata"]["namespace"]),
                    text(&report["metadata"]["name"]),
                );
                let fresh = text(&report["metadata"]["annotations"][DIGEST_ANNOTATION]);
                if self.existing.get(&key) == Some(&fresh) {
                    self.summary.unchanged += 1;
                } else {
                    match write_report(self.client, &key.0, &key.1, &report).await {
                        Ok(()) => self.summary.written += 1,
                        // One refused write (a namespace being deleted, a quota on objects)
                        // does not stop the scan; the next scan writes it again.
                        // The first of a scan is logged, the rest counted (a namespace being
                        // deleted refuses every report in it).
                        Err(e) => {
                            if self.summary.failed == 0 {
                                tracing::warn!(error = %e, "policy scan: a report was not written (the scan's log line counts the rest as failed)");
                            }
                            self.summary.failed += 1;
                        }
                    }
                }
                self.kept.insert(key);
            }
        }
        Ok(())
    }
}

/// One scan of every workload in `namespace` (all when `None`) with `engine`'s current set.
///
/// # Errors
/// [`Error::Kube`] when a list or a status write fails; what was written stays, the next scan
/// starts over. A report the apiserver refuses is logged and counted
/// ([`ScanSummary::failed`]), and the scan goes on.
pub async fn scan_once(scanner: &Scanner, written: &mut Written) -> Result<ScanSummary, Error> {
    let Scanner {
        client,
        namespace,
        engine,
        settings,
        cfg,
    } = scanner;
    let namespace = namespace.as_deref();
    let engine = engine.current();
    let set = engine.policy_set().clone();
    // Read for each scan, not from the reconcilers' caches: a scan needs them whole, and
    // there are few runtimes and, listed as metadata, small namespaces.
    let runtimes: Arc<[InferenceRuntime]> = Api::<InferenceRuntime>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(kube_err("list InferenceRuntimes"))?
        .items
        .into_iter()
        .map(|mut r| {
            r.metadata.managed_fields = None;
            r
        })
        .collect();
    let namespaces = Arc::new(namespace_objects(client, namespace).await?);
    let mut summary = ScanSummary {
        reports: report_crd_installed(client).await?,
        ..ScanSummary::default()
    };
    let cluster_policies: Vec<&ServingPolicy> = engine
        .policies()
        .iter()
        .filter(|p| p.metadata.uid.is_some())
        .collect();
    for p in &cluster_policies {
        summary
            .policies
            .insert(p.name_any(), (0, Counts::default()));
    }
    let reports: Api<DynamicObject> = match namespace {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &report_resource()),
        None => Api::all_with(client.clone(), &report_resource()),
    };
    // The reports written before, by namespace and name, with their digests.
    let mut existing: HashMap<(String, String), String> = HashMap::new();
    if summary.reports {
        let managed = ListParams::default().labels(&format!("{}={}", MANAGED_BY.0, MANAGED_BY.1));
        each_metadata(&reports, managed, "PolicyReports", |r| {
            let digest = r
                .annotations()
                .get(DIGEST_ANNOTATION)
                .cloned()
                .unwrap_or_default();
            existing.insert((r.namespace().unwrap_or_default(), r.name_any()), digest);
        })
        .await?;
    }
    let mut scan = Scan {
        set,
        runtimes,
        namespaces,
        settings: Arc::new(settings.clone()),
        client,
        existing,
        kept: HashSet::new(),
        pace: Pace::new(cfg.rate),
        chunk: (cfg.rate as usize / 10).max(1),
        summary,
        seen: HashSet::new(),
    };
    let deployments: Api<Deployment> = crate::reconcile::scoped(client, namespace);
    let statefulsets: Api<StatefulSet> = crate::reconcile::scoped(client, namespace);
    for kind in ["Deployments", "StatefulSets"] {
        let mut token: Option<String> = None;
        loop {
            let listed = if kind == "Deployments" {
                list_page(&deployments, kind, token.as_deref()).await
            } else {
                list_page(&statefulsets, kind, token.as_deref()).await
            };
            let (objects, next) = match listed {
                Ok(page) => page,
                // The continue token expired (etcd compacted past it during a long scan): list
                // again from the start; the workloads already evaluated are skipped.
                Err(Error::Kube {
                    source: kube::Error::Api(e),
                    ..
                }) if e.code == 410 && token.is_some() => {
                    token = None;
                    continue;
                }
                Err(e) => return Err(e),
            };
            scan.page(objects).await?;
            token = next;
            if token.is_none() {
                break;
            }
        }
    }
    let Scan {
        existing,
        kept,
        mut summary,
        ..
    } = scan;
    for (ns, name) in existing.keys().filter(|k| !kept.contains(*k)) {
        let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &report_resource());
        match api.delete(name, &DeleteParams::default()).await {
            Ok(_) => summary.deleted += 1,
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                if summary.failed == 0 {
                    tracing::warn!(error = %kube_err(format!("delete PolicyReport {ns}/{name}"))(e), "policy scan: a stale report was not deleted (the scan's log line counts the rest as failed)");
                }
                summary.failed += 1;
            }
        }
    }
    write_counts(client, &cluster_policies, &summary, written).await?;
    Ok(summary)
}

/// Adds one workload's results to the per-policy counts.
fn record(summary: &mut ScanSummary, results: &[PolicyResult]) {
    let mut matched: Vec<&str> = Vec::new();
    for r in results {
        if let Some((resources, counts)) = summary.policies.get_mut(&r.policy) {
            counts.add(r);
            if !matched.contains(&r.policy.as_str()) {
                matched.push(&r.policy);
                *resources += 1;
            }
        }
    }
}

/// Each namespace in scope (`namespace`, or all, a page at a time) as `namespaceObject` sees
/// it: `apiVersion`, `kind` and its metadata, by name.
async fn namespace_objects(
    client: &Client,
    namespace: Option<&str>,
) -> Result<HashMap<String, Value>, Error> {
    let api: Api<Namespace> = Api::all(client.clone());
    let as_object = |mut m: PartialObjectMeta<Namespace>| {
        m.metadata.managed_fields = None;
        let name = m.name_any();
        let object = json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": serde_json::to_value(&m.metadata).unwrap_or_default(),
        });
        (name, object)
    };
    if let Some(ns) = namespace {
        let found = api
            .get_metadata_opt(ns)
            .await
            .map_err(kube_err(format!("get Namespace {ns}")))?;
        return Ok(found.into_iter().map(as_object).collect());
    }
    let mut all = HashMap::new();
    each_metadata(&api, ListParams::default(), "Namespaces", |m| {
        let (name, object) = as_object(m);
        all.insert(name, object);
    })
    .await?;
    Ok(all)
}

/// Hands each object of `api` that `lp` selects, as metadata, to `each`, listing a page of
/// [`PAGE`] at a time (what is held is one page).
async fn each_metadata<K>(
    api: &Api<K>,
    lp: ListParams,
    what: &str,
    mut each: impl FnMut(PartialObjectMeta<K>),
) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let mut token: Option<String> = None;
    loop {
        let mut page_params = lp.clone().limit(PAGE);
        if let Some(t) = &token {
            page_params = page_params.continue_token(t);
        }
        let page = api
            .list_metadata(&page_params)
            .await
            .map_err(kube_err(format!("list {what}")))?;
        page.items.into_iter().for_each(&mut each);
        token = page.metadata.continue_.filter(|t| !t.is_empty());
        if token.is_none() {
            return Ok(());
        }
    }
}

/// Whether the PolicyReport CRD is installed and serves `v1alpha2`.
pub async fn report_crd_installed(client: &Client) -> Result<bool, Error> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    match crds.get_opt(REPORT_CRD).await {
        Ok(found) => Ok(found.is_some_and(|crd| {
            crd.spec
                .versions
                .iter()
                .any(|v| v.name == "v1alpha2" && v.served)
        })),
        // Not allowed to read it: the chart grants it; without, reports are off.
        Err(kube::Error::Api(e)) if e.code == 403 => Ok(false),
        Err(e) => Err(kube_err(format!(
            "get CustomResourceDefinition {REPORT_CRD}"
        ))(e)),
    }
}

async fn write_report(
    client: &Client,
    namespace: &str,
    name: &str,
    report: &Value,
) -> Result<(), Error> {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &report_resource());
    api.patch(
        name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(report),
    )
    .await
    .map_err(kube_err(format!("apply PolicyReport {namespace}/{name}")))?;
    Ok(())
}

/// What was last written on each policy's `status.scan`, by name: its UID and generation,
/// and the counts. A scan that finds the same leaves the status alone (no write, so no update
/// event for every watcher of ServingPolicies).
pub type Written = HashMap<String, (Option<String>, Option<i64>, u64, Counts)>;

/// Server-side applies `status.scan` of every cluster policy whose counts (or generation)
/// changed since `written`.
async fn write_counts(
    client: &Client,
    policies: &[&ServingPolicy],
    summary: &ScanSummary,
    written: &mut Written,
) -> Result<(), Error> {
    let api: Api<ServingPolicy> = Api::all(client.clone());
    let now =
        k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
    let int = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    for p in policies {
        let name = p.name_any();
        let (resources, c) = summary.policies.get(&name).cloned().unwrap_or_default();
        let key = (p.metadata.uid.clone(), p.metadata.generation, resources, c);
        if written.get(&name) == Some(&key) {
            continue;
        }
        let status = hearth_crds::servingpolicy::ScanStatus {
            observed_generation: p.metadata.generation,
            last_scan_time: Some(now.clone()),
            resources: int(resources),
            pass: int(c.pass),
            fail: int(c.fail),
            warn: int(c.warn),
            error: int(c.error),
            would_mutate: int(c.would_mutate),
        };
        let patch = json!({
            "apiVersion": ServingPolicy::api_version(&()),
            "kind": ServingPolicy::kind(&()),
            "status": {"scan": status},
        });
        match api
            .patch_status(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
        {
            Ok(_) => {
                written.insert(name, key);
            }
            // Deleted since the set was built.
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(kube_err(format!("apply status of ServingPolicy {name}"))(e)),
        }
    }
    Ok(())
}

/// Scans at start, on every change of `engine`'s set (after [`SCAN_DEBOUNCE`]) and every
/// `cfg.interval`, until `shutdown`. Errors are logged; the next trigger scans again.
pub async fn run(scanner: Scanner, shutdown: impl Future<Output = ()>) {
    let Scanner {
        client,
        engine,
        cfg,
        ..
    } = &scanner;
    let mut changes = engine.subscribe();
    changes.borrow_and_update();
    let mut written = Written::new();
    let scans = async {
        let mut retry = RETRY_FIRST;
        loop {
            let started = Instant::now();
            let scanned = scan_once(&scanner, &mut written).await;
            // What ends the wait for the next scan besides a policy change and the interval.
            let (next_try, reports) = match &scanned {
                Ok(s) => {
                    tracing::info!(
                        seconds = started.elapsed().as_secs_f64(),
                        listed = s.listed,
                        evaluated = s.evaluated,
                        unresolved = s.unresolved,
                        written = s.written,
                        unchanged = s.unchanged,
                        deleted = s.deleted,
                        failed = s.failed,
                        reports = s.reports,
                        "policy scan done"
                    );
                    retry = RETRY_FIRST;
                    (None, s.reports)
                }
                Err(e) => {
                    tracing::warn!(error = %e, retry_seconds = retry.as_secs(), "policy scan failed; trying again");
                    let wait = retry;
                    retry = (retry * 2).min(RETRY_MAX);
                    (Some(wait), true)
                }
            };
            let periodic = async {
                if cfg.interval.is_zero() {
                    futures::future::pending::<()>().await
                } else {
                    tokio::time::sleep(cfg.interval).await
                }
            };
            let again = async {
                match next_try {
                    Some(wait) => tokio::time::sleep(wait).await,
                    None => futures::future::pending::<()>().await,
                }
            };
            // Without the PolicyReport CRD: look for it now and then, and scan once it is here.
            let crd_arrives = async {
                if reports {
                    return futures::future::pending::<()>().await;
                }
                loop {
                    tokio::time::sleep(CRD_RECHECK).await;
                    if report_crd_installed(client).await.unwrap_or(false) {
                        return;
                    }
                }
            };
            tokio::select! {
                changed = changes.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    // Until the set stays unchanged for SCAN_DEBOUNCE.
                    loop {
                        changes.borrow_and_update();
                        match tokio::time::timeout(SCAN_DEBOUNCE, changes.changed()).await {
                            Err(_) => break,
                            Ok(Err(_)) => return,
                            Ok(Ok(())) => {}
                        }
                    }
                }
                _ = periodic => {}
                _ = again => {}
                _ = crd_arrives => {}
            }
        }
    };
    tokio::select! {
        _ = scans => {}
        _ = shutdown => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_policies::report::{Rule, Verdict};

    fn policy(name: &str, spec: Value) -> ServingPolicy {
        serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
            "metadata": {"name": name, "uid": format!("uid-{name}")}, "spec": spec,
        }))
        .expect("a ServingPolicy")
    }

    fn runtime() -> InferenceRuntime {
        serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "InferenceRuntime",
            "metadata": {"name": "rt"},
            "spec": {"vendor": "nvidia", "container": {"image": "vllm/vllm-openai:v0.25.1"},
                     "accelerator": {"resourceName": "nvidia.com/gpu"}},
        }))
        .expect("an InferenceRuntime")
    }

    fn workload(annotations: Value) -> Value {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "llm", "namespace": "team-a", "uid": "u-1",
                         "annotations": annotations},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "llm"}},
                     "template": {"metadata": {"labels": {"app": "llm"}},
                                  "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}},
        })
    }

    fn namespaces(labels: Value) -> HashMap<String, Value> {
        HashMap::from([(
            "team-a".to_owned(),
            json!({"apiVersion": "v1", "kind": "Namespace",
                   "metadata": {"name": "team-a", "labels": labels}}),
        )])
    }

    fn set(policies: &[ServingPolicy]) -> PolicySet {
        let (set, errors) = PolicySet::compile(policies);
        assert!(errors.is_empty(), "{errors:?}");
        set
    }

    #[test]
    fn only_opted_in_workloads_are_evaluated_and_an_unknown_runtime_is_unresolved() {
        let set = set(&[policy(
            "p",
            json!({"validations": [{"expression": "true"}]}),
        )]);
        let rts = [runtime()];
        let inputs = Inputs {
            runtimes: &rts,
            namespaces: &namespaces(json!({})),
            settings: &json!({}),
        };
        assert!(evaluate(&set, &inputs, &workload(json!({}))).is_none());
        let pinned = json!({"serving.hearth.dev/runtime": "rt"});
        let got = evaluate(&set, &inputs, &workload(pinned)).and_then(Result::ok);
        assert_eq!(
            got.map(|r| r.iter().map(|r| (r.rule, r.result)).collect::<Vec<_>>()),
            Some(vec![(Rule::Validations, Verdict::Pass)])
        );
        let unknown = json!({"serving.hearth.dev/runtime": "nope"});
        assert!(matches!(
            evaluate(&set, &inputs, &workload(unknown)),
            Some(Err(_))
        ));
    }

    #[test]
    fn policies_see_the_runtime_as_params_and_the_namespace() {
        let set = set(&[policy(
            "tier",
            json!({
                "validations": [
                    {"expression": "params.metadata.name == 'rt'", "message": "params"},
                    {"expression": "namespaceObject.metadata.labels['tier'] == 'gold'", "message": "not gold"},
                ]
            }),
        )]);
        let rts = [runtime()];
        let pinned = || workload(json!({"serving.hearth.dev/runtime": "rt"}));
        for (labels, want) in [
            (json!({"tier": "gold"}), Verdict::Pass),
            (json!({"tier": "bronze"}), Verdict::Fail),
        ] {
            let ns = namespaces(labels);
            let inputs = Inputs {
                runtimes: &rts,
                namespaces: &ns,
                settings: &json!({}),
            };
            let got = evaluate(&set, &inputs, &pinned())
                .and_then(Result::ok)
                .unwrap_or_default();
            assert_eq!(got.len(), 1, "{got:?}");
            assert_eq!(got[0].result, want, "{got:?}");
        }
    }

    fn result(policy: &str, rule: Rule, result: Verdict, message: &str) -> PolicyResult {
        PolicyResult {
            policy: policy.into(),
            rule,
            result,
            would_mutate: None,
            message: message.into(),
        }
    }

    #[test]
    fn a_report_is_scoped_to_and_owned_by_its_workload() {
        let patch = serde_json::from_value(
            json!([{"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}]),
        )
        .expect("a patch");
        let results = vec![
            result("p", Rule::Validations, Verdict::Fail, "no"),
            PolicyResult {
                would_mutate: Some(patch),
                ..result("p", Rule::Mutations, Verdict::Warn, "would change")
            },
            result("q", Rule::Validations, Verdict::Pass, ""),
        ];
        let at = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let w = workload(json!({}));
        let r = policy_report(&w, &results, at);
        assert_eq!(r["apiVersion"], "wgpolicyk8s.io/v1alpha2");
        assert_eq!(r["metadata"]["name"], "hearth-u-1");
        assert_eq!(r["metadata"]["namespace"], "team-a");
        assert_eq!(
            r["metadata"]["ownerReferences"],
            json!([{"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm", "uid": "u-1"}])
        );
        assert_eq!(
            r["scope"],
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "name": "llm", "namespace": "team-a", "uid": "u-1"})
        );
        assert_eq!(
            r["summary"],
            json!({"pass": 1, "fail": 1, "warn": 1, "error": 0, "skip": 0})
        );
        assert_eq!(r["results"][0]["source"], "hearth");
        assert_eq!(r["results"][0]["rule"], "validations");
        assert_eq!(r["results"][0]["message"], "no");
        assert_eq!(
            r["results"][0]["timestamp"],
            json!({"seconds": 1_700_000_000u64, "nanos": 0})
        );
        assert_eq!(r["results"][1]["properties"]["outcome"], "would-mutate");
        assert!(
            r["results"][1]["properties"]["patch"]
                .as_str()
                .is_some_and(|p| p.contains("/metadata/labels"))
        );
        assert!(r["results"][2].get("message").is_none());
        // The digest follows the results, not the time they were found.
        let later = policy_report(&w, &results, at + Duration::from_secs(60));
        assert_eq!(
            later["metadata"]["annotations"],
            r["metadata"]["annotations"]
        );
        let changed = policy_report(&w, &results[..2], at);
        assert_ne!(
            changed["metadata"]["annotations"],
            r["metadata"]["annotations"]
        );
    }

    #[test]
    fn an_oversized_patch_is_left_out_of_the_properties() {
        let big = "x".repeat(PATCH_PROPERTY_LIMIT);
        let patch = serde_json::from_value(
            json!([{"op": "add", "path": "/metadata/annotations/a", "value": big}]),
        )
        .expect("a patch");
        let results = vec![PolicyResult {
            would_mutate: Some(patch),
            ..result("p", Rule::Mutations, Verdict::Warn, "would change")
        }];
        let r = policy_report(&workload(json!({})), &results, UNIX_EPOCH);
        let text = r["results"][0]["properties"]["patch"]
            .as_str()
            .unwrap_or_default();
        assert!(text.contains("bytes, over 4096"), "{text}");
    }

    #[test]
    fn counts_are_per_cluster_policy_and_resources_count_workloads() {
        let mut summary = ScanSummary::default();
        summary.policies.insert("p".into(), (0, Counts::default()));
        let results = vec![
            result("p", Rule::Validations, Verdict::Warn, "w"),
            result("p", Rule::Mutations, Verdict::Pass, ""),
            // A built-in: not a cluster object, not counted.
            result(
                "hearth-serving-defaults",
                Rule::Mutations,
                Verdict::Pass,
                "",
            ),
        ];
        record(&mut summary, &results);
        record(&mut summary, &results[..1]);
        let (resources, counts) = summary.policies["p"];
        assert_eq!(resources, 2);
        assert_eq!(
            counts,
            Counts {
                pass: 1,
                warn: 2,
                ..Counts::default()
            }
        );
        assert_eq!(summary.policies.len(), 1);
    }
}

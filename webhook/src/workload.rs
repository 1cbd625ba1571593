//! Workloads that opted in to Hearth: Deployments, StatefulSets and Pods carrying
//! `serving.hearth.dev/runtime: <name>` or `serving.hearth.dev/vendor: a,b` (annotation or
//! label). The runtime is resolved by `hearth-policies` (the rule the controller uses too), then
//! the compiled built-in and platform policies run with it bound as `params`:
//!
//! - `/mutate` answers with the policies' JSON Patch (empty on a second pass: the built-ins are
//!   idempotent, so reinvocation changes nothing) and denies what the validations deny, so the
//!   user hears about it at once.
//! - `/validate` re-runs the validations on the object as it will be stored (after every
//!   mutating webhook) and returns warnings (`Warn`) and audit annotations (`Audit`,
//!   `auditAnnotations`), under keys the apiserver records ([`audit_key`]), and the reports
//!   of report-only mutations (`spec.mutationActions` without `Patch`).
//! - `/mutate` also returns the reports (`Warn`, `Audit`) of the mutations it applied.
//!
//! A Deployment that joins an `LLMEndpoint` (`serving.hearth.dev/endpoint`) also goes through
//! `hearth_crds::rules::check_deployment` and `check_member_serving`, the rules the controller
//! joins it by ([`member_findings`]): errors are denied on both paths, warnings returned on
//! `/validate`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use hearth_crds::rules::{self, Severity};
use hearth_crds::servingpolicy::MutationAction;
use hearth_crds::servingpolicy::{Operation as PolicyOperation, StatusReason};
use hearth_crds::wellknown::{ENDPOINT_ANNOTATION, RUNTIME_ANNOTATION, VENDOR_ANNOTATION};
use hearth_crds::{InferenceRuntime, ServingPolicy};
use hearth_policies::{
    EvalInput, GroupVersionKind, GroupVersionResource, MUTATION_REPORT, MutationReport, PolicySet,
    PolicySettings, RequestInfo, Selection, UserInfo, VALIDATION_FAILURE, resolve_runtime,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Namespace;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, Operation};
use kube::core::{DynamicObject, Status};
use kube::runtime::reflector::{ObjectRef, Store};

use crate::admission::{Endpoint, Outcome, deny, with_warnings};
use crate::validate::{Finding, Findings, Runtimes};

pub use hearth_policies::cluster::Compiled;

/// What reviews are answered with: the cluster's runtimes and the compiled policies, replaced
/// as a whole when either changes (an `Arc` swap; reviews in flight keep theirs).
#[derive(Clone, Debug)]
pub struct Snapshot {
    /// InferenceRuntimes by name.
    pub runtimes: Runtimes,
    runtime_list: Vec<InferenceRuntime>,
    /// Built-in policies, then the platform policies (last good version of each), compiled.
    pub policies: PolicySet,
    /// Namespaces, for policies' `namespaceSelector` and `namespaceObject`; `None` offline.
    pub namespaces: Option<Store<Namespace>>,
    /// The installation's settings policies see as `settings` (fixed for the process: each
    /// rebuild keeps them, see [`Snapshot::with_settings`]).
    pub settings: Arc<serde_json::Value>,
    /// Services, adapters and endpoints, which an `LLMAdapter` is checked against; `None`
    /// offline.
    pub serving: Option<ServingStores>,
}

/// The serving objects reviews read directly from the reflectors' stores (no rebuild when
/// they change).
#[derive(Clone, Debug)]
pub struct ServingStores {
    /// LLMServices.
    pub services: Store<hearth_crds::LLMService>,
    /// LLMAdapters.
    pub adapters: Store<hearth_crds::LLMAdapter>,
    /// LLMEndpoints.
    pub endpoints: Store<hearth_crds::LLMEndpoint>,
}

impl Default for Snapshot {
    fn default() -> Self {
        Self::new(Runtimes::new(), &[], None)
    }
}

impl Snapshot {
    /// Compiles `policies` in order — the built-ins first, then the platform policies (each of
    /// which already compiled on its own, see [`Compiled::compile`]) — over `runtimes`.
    pub fn new(
        runtimes: Runtimes,
        policies: &[ServingPolicy],
        namespaces: Option<Store<Namespace>>,
    ) -> Self {
        let (policies, errors) = PolicySet::compile(policies);
        for e in errors {
            // Platform policies were compiled one by one before; a broken built-in (a
            // packaging error) is left out and logged.
            tracing::error!(error = %e, "policy left out of the set");
        }
        Self {
            runtime_list: list_of(&runtimes),
            runtimes,
            policies,
            namespaces,
            settings: Arc::new(PolicySettings::default().to_value()),
            serving: None,
        }
    }

    /// The same snapshot with `settings` bound as `settings`.
    pub fn with_settings(mut self, settings: &PolicySettings) -> Self {
        self.settings = Arc::new(settings.to_value());
        self
    }

    /// A snapshot of `runtimes` and `policies` (in evaluation order), without a cluster.
    pub fn offline(
        runtimes: impl IntoIterator<Item = InferenceRuntime>,
        policies: &[ServingPolicy],
    ) -> Self {
        let runtimes = runtimes
            .into_iter()
            .map(|rt| (rt.metadata.name.clone().unwrap_or_default(), Arc::new(rt)))
            .collect();
        Self::new(runtimes, policies, None)
    }

    /// A snapshot of `runtimes` without policies.
    pub fn with_runtimes(runtimes: impl IntoIterator<Item = InferenceRuntime>) -> Self {
        Self::offline(runtimes, &[])
    }

    /// The runtimes as a slice, in name order.
    pub fn runtime_list(&self) -> &[InferenceRuntime] {
        &self.runtime_list
    }

    /// A copy with `runtime` added (or replacing the one of its name): for a review naming a
    /// runtime the apiserver has and the watch has not delivered yet (`server`'s read-through).
    pub fn with_runtime(&self, runtime: InferenceRuntime) -> Self {
        let mut next = self.clone();
        let name = runtime.metadata.name.clone().unwrap_or_default();
        next.runtimes.insert(name, Arc::new(runtime));
        next.runtime_list = list_of(&next.runtimes);
        next
    }
}

/// The runtimes of `runtimes` in name order, for [`Snapshot::runtime_list`].
fn list_of(runtimes: &Runtimes) -> Vec<InferenceRuntime> {
    runtimes.values().map(|r| (**r).clone()).collect()
}

fn selection_field(sel: &Selection, object: &DynamicObject) -> String {
    let key = match sel {
        Selection::Pinned(_) => RUNTIME_ANNOTATION,
        Selection::Vendors(_) => VENDOR_ANNOTATION,
    };
    let in_annotations = object
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key(key));
    let map = if in_annotations {
        "annotations"
    } else {
        "labels"
    };
    format!("metadata.{map}[{key:?}]")
}

fn request_info(req: &AdmissionRequest<DynamicObject>) -> RequestInfo {
    RequestInfo {
        operation: match req.operation {
            Operation::Create => PolicyOperation::Create,
            Operation::Update => PolicyOperation::Update,
            Operation::Delete => PolicyOperation::Delete,
            Operation::Connect => PolicyOperation::Connect,
        },
        kind: GroupVersionKind {
            group: req.kind.group.clone(),
            version: req.kind.version.clone(),
            kind: req.kind.kind.clone(),
        },
        resource: GroupVersionResource {
            group: req.resource.group.clone(),
            version: req.resource.version.clone(),
            resource: req.resource.resource.clone(),
        },
        sub_resource: req.sub_resource.clone().unwrap_or_default(),
        name: req.name.clone(),
        namespace: req.namespace.clone().unwrap_or_default(),
        user_info: UserInfo {
            username: req.user_info.username.clone().unwrap_or_default(),
            uid: req.user_info.uid.clone().unwrap_or_default(),
            groups: req.user_info.groups.clone().unwrap_or_default(),
            extra: req
                .user_info
                .extra
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect::<BTreeMap<_, _>>(),
        },
        dry_run: req.dry_run,
    }
}

/// HTTP code of a `metav1.StatusReason`.
fn reason_code(r: StatusReason) -> (u16, &'static str) {
    match r {
        StatusReason::Unauthorized => (401, "Unauthorized"),
        StatusReason::Forbidden => (403, "Forbidden"),
        StatusReason::Invalid => (422, "Invalid"),
        StatusReason::RequestEntityTooLarge => (413, "RequestEntityTooLarge"),
    }
}

/// Answers a review of a Deployment, StatefulSet or Pod.
pub(crate) fn review(
    endpoint: Endpoint,
    req: &AdmissionRequest<DynamicObject>,
    object: &DynamicObject,
    snapshot: &Snapshot,
    base: AdmissionResponse,
) -> (AdmissionResponse, Outcome) {
    let object_json = match serde_json::to_value(object) {
        Ok(v) => v,
        Err(e) => {
            let f = Finding {
                field: "object".to_owned(),
                message: e.to_string(),
            };
            return (deny(base, vec![f]), Outcome::Denied);
        }
    };
    // Not opted in: the matchConditions normally keep these away.
    let Some(selection) = Selection::from_object(&object_json) else {
        return (base, Outcome::Skipped);
    };
    let runtime = match resolve_runtime(snapshot.runtime_list(), &selection) {
        Ok(rt) => rt,
        Err(e) => {
            let f = Finding {
                field: selection_field(&selection, object),
                message: e.to_string(),
            };
            return (deny(base, vec![f]), Outcome::Denied);
        }
    };
    // Joining an LLMEndpoint (`serving.hearth.dev/endpoint`): the rules the controller joins
    // the Deployment by; an error denies it here (the controller would keep it off the
    // endpoint), a warning is an admission warning.
    let member = member_findings(&object_json, runtime);
    if !member.denials.is_empty() {
        return (deny(base, member.denials), Outcome::Denied);
    }
    let namespace_object = match (&snapshot.namespaces, &req.namespace) {
        (Some(store), Some(ns)) => store
            .get(&ObjectRef::new(ns))
            .and_then(|n| serde_json::to_value(&*n).ok()),
        _ => None,
    };
    let input = EvalInput {
        old_object: req
            .old_object
            .as_ref()
            .and_then(|o| serde_json::to_value(o).ok()),
        namespace_object,
        ..EvalInput::for_workload(
            request_info(req),
            object_json,
            runtime,
            (*snapshot.settings).clone(),
        )
    };
    let out = snapshot.policies.evaluate(&input);
    if !out.allowed() {
        let mut resp = base;
        resp.allowed = false;
        let (code, reason) = out
            .denials
            .first()
            .map_or((403, "Forbidden"), |d| reason_code(d.reason));
        resp.result = Status::failure(&out.rejection_messages().join("; "), reason).with_code(code);
        return (resp, Outcome::Denied);
    }
    match endpoint {
        Endpoint::Mutate => {
            // What the mutations applied here changed (`Warn`, `Audit`); report-only ones
            // change nothing, so `/validate`, which sees the same object, reports them.
            let applied: Vec<&MutationReport> =
                out.mutation_reports.iter().filter(|r| r.applied).collect();
            let warnings = applied
                .iter()
                .filter(|r| r.has(MutationAction::Warn))
                .map(|r| r.warning())
                .collect();
            let mut base = with_warnings(base, warnings);
            if let Some(v) = MutationReport::audit_annotation(applied.iter().copied()) {
                insert_audit(&mut base.audit_annotations, MUTATION_REPORT, v);
            }
            if out.patch.0.is_empty() {
                return (base, Outcome::Allowed);
            }
            match base.clone().with_patch(out.patch) {
                Ok(resp) => (resp, Outcome::Patched),
                Err(e) => {
                    let f = Finding {
                        field: "patch".to_owned(),
                        message: e.to_string(),
                    };
                    (deny(base, vec![f]), Outcome::Denied)
                }
            }
        }
        Endpoint::Validate => {
            let mut warnings = out.warnings;
            if let Some(o) = &input.object {
                warnings.extend(device_access_warnings(o));
            }
            warnings.extend(member.warnings.iter().map(ToString::to_string));
            // Mutations applied by `/mutate` were reported there; here only the report-only
            // ones (a non-idempotent mutation would otherwise be reported twice).
            let applied: Vec<String> = out
                .mutation_reports
                .iter()
                .filter(|r| r.applied)
                .map(MutationReport::warning)
                .collect();
            warnings.retain(|w| !applied.contains(w));
            let mut resp = with_warnings(base, warnings);
            let mut audit = out.audit_annotations;
            audit.remove(MUTATION_REPORT);
            if let Some(v) =
                MutationReport::audit_annotation(out.mutation_reports.iter().filter(|r| !r.applied))
            {
                audit.insert(MUTATION_REPORT.to_owned(), v);
            }
            for (k, v) in audit {
                insert_audit(&mut resp.audit_annotations, &k, v);
            }
            (resp, Outcome::Allowed)
        }
    }
}

/// The key under which the webhook returns the engine's audit annotation `key`. The apiserver
/// records a webhook's audit annotation as `<webhook name>/<key>` and drops one whose key holds
/// a `/` or is not a qualified name's name part ([`is_name_part`]):
/// `validation.policy.admission.k8s.io/validation_failure` becomes `validation_failure`,
/// [`MUTATION_REPORT`] `mutation_report`, and a policy's `<policy>/<key>` `<policy>.<key>`;
/// when that is not a valid name part (over 63 characters, other characters), the key's first
/// valid characters and an FNV-1a hash of the whole key ([`hashed_audit_key`]).
pub fn audit_key(key: &str) -> String {
    if key == VALIDATION_FAILURE {
        return "validation_failure".to_owned();
    }
    if key == MUTATION_REPORT {
        return "mutation_report".to_owned();
    }
    let plain = key.replacen('/', ".", 1);
    if is_name_part(&plain) {
        plain
    } else {
        hashed_audit_key(key)
    }
}

/// `<head>-<hash>`: at most 54 characters of `key` (each outside `[A-Za-z0-9_.-]` as `-`,
/// trimmed to start and end alphanumeric; `key` when none is left) and the 8 hex digits of the
/// 32-bit FNV-1a hash of all of `key`: a valid name part of at most 63 characters for any input.
pub fn hashed_audit_key(key: &str) -> String {
    let hash = key.bytes().fold(0x811c_9dc5_u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    let head: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(54)
        .collect();
    let head = head.trim_matches(|c: char| !c.is_ascii_alphanumeric());
    format!("{}-{hash:08x}", if head.is_empty() { "key" } else { head })
}

/// Whether `s` is the name part of a qualified name (k8s.io/apimachinery `IsQualifiedName`): 1
/// to 63 characters of `[A-Za-z0-9_.-]`, alphanumeric at both ends.
pub fn is_name_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(c))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Adds the engine's audit annotation `key` to a response's, under [`audit_key`]; a key taken
/// already (two engine keys mapping to one) gets [`hashed_audit_key`], so none is lost.
fn insert_audit(annotations: &mut HashMap<String, String>, key: &str, value: String) {
    let mut k = audit_key(key);
    if annotations.contains_key(&k) {
        k = hashed_audit_key(key);
    }
    annotations.insert(k, value);
}

/// The findings of `hearth_crds::rules` about a workload joining an `LLMEndpoint` with the
/// `serving.hearth.dev/endpoint` annotation: for a Deployment, `check_deployment` and, when it
/// joins, `check_member_serving` with its resolved `runtime` (which container and port serve the
/// model); for another kind a warning that only Deployments join.
pub fn member_findings(object: &serde_json::Value, runtime: &InferenceRuntime) -> Findings {
    let mut out = Findings::default();
    // Most workloads carry none of these: nothing to decode.
    let annotations = &object["metadata"]["annotations"];
    if !std::iter::once(ENDPOINT_ANNOTATION)
        .chain(rules::MEMBER_ANNOTATIONS)
        .any(|k| annotations.get(k).is_some())
    {
        return out;
    }
    let findings = if object["kind"] == "Deployment" {
        let Ok(d) = serde_json::from_value::<Deployment>(object.clone()) else {
            return out;
        };
        let check = rules::check_deployment(&d);
        let mut findings = check.findings;
        if let Some(member) = &check.member {
            findings
                .0
                .extend(rules::check_member_serving(&d, member, Some(runtime)).1);
        }
        findings
    } else {
        let meta = serde_json::from_value(object["metadata"].clone()).unwrap_or_default();
        let kind = object["kind"].as_str().unwrap_or_default();
        rules::Findings(
            rules::endpoint_annotation_ignored(kind, &meta)
                .into_iter()
                .collect(),
        )
    };
    for f in findings {
        let finding = Finding {
            field: f.field,
            message: f.message,
        };
        match f.severity {
            Severity::Error => out.denials.push(finding),
            Severity::Warning => out.warnings.push(finding),
        }
    }
    out
}

/// Whether a hostPath gives access to the node's devices: `/dev`, anything below it, or an
/// ancestor of it (`/`), compared after removing `.`, `..` and repeated slashes.
fn reaches_dev(path: &str) -> bool {
    let parts = hearth_crds::path::segments(path);
    parts.is_empty() || parts[0] == "dev"
}

/// Admission warnings for an opted-in workload whose pod holds a container that can reach
/// devices beyond what it requests through the device plugin: a `privileged` container (every
/// device of the node), or one mounting a hostPath volume of `/dev` (or below it, or `/`).
/// Each names the container and its field path. Warnings, not denials: device plugins and
/// monitoring agents do this on purpose, and the platform can deny it with a ServingPolicy.
pub fn device_access_warnings(object: &serde_json::Value) -> Vec<String> {
    let (pod, prefix) = if object["kind"] == "Pod" {
        (&object["spec"], "spec")
    } else {
        (&object["spec"]["template"]["spec"], "spec.template.spec")
    };
    let host_dev_volumes: BTreeMap<&str, &str> = pod["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| Some((v["name"].as_str()?, v["hostPath"]["path"].as_str()?)))
        .filter(|(_, path)| reaches_dev(path))
        .collect();
    let mut out = Vec::new();
    for list in ["initContainers", "containers", "ephemeralContainers"] {
        for (i, c) in pod[list].as_array().into_iter().flatten().enumerate() {
            let name = c["name"].as_str().unwrap_or("");
            let field = format!("{prefix}.{list}[{i}]");
            if c["securityContext"]["privileged"] == serde_json::Value::Bool(true) {
                out.push(format!(
                    "container {name:?} ({field}) is privileged: it can reach every device of the node, not only the accelerators this workload requests; drop privileged unless it must manage devices"
                ));
            }
            for m in c["volumeMounts"].as_array().into_iter().flatten() {
                let Some(vol) = m["name"].as_str() else {
                    continue;
                };
                if let Some(path) = host_dev_volumes.get(vol) {
                    out.push(format!(
                        "container {name:?} ({field}) mounts hostPath {path:?} (volume {vol:?}): it can reach the node's devices, not only the accelerators this workload requests; remove the mount and request devices through the device plugin"
                    ));
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;
    use serde_json::json;

    #[rstest]
    #[case::validation_failure(VALIDATION_FAILURE, "validation_failure")]
    #[case::mutation_report(MUTATION_REPORT, "mutation_report")]
    #[case::policy_key("internal-registry/images", "internal-registry.images")]
    #[case::own_key("skipped", "skipped")]
    #[case::long_policy(
        "platform.example.com.a-very-long-policy-name-that-goes-on-and-on/images",
        "platform.example.com.a-very-long-policy-name-that-goes-00000000"
    )]
    #[case::long_key(
        "p/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa_",
        "p-aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa-00000000"
    )]
    #[case::non_ascii("p/éé", "p-00000000")]
    #[case::slash_in_key("p/a/b", "p-a-b-00000000")]
    #[case::nothing_valid("é/é", "key-00000000")]
    #[case::empty("", "key-00000000")]
    fn audit_keys_are_what_the_apiserver_records(#[case] key: &str, #[case] want: &str) {
        let got = audit_key(key);
        assert!(is_name_part(&got), "{got}");
        // The hash of a hashed key is checked against an independent FNV-1a below.
        let (head, want_head) = (got.rsplit_once('-'), want.rsplit_once('-'));
        if want.ends_with("-00000000") {
            assert_eq!(head.map(|h| h.0), want_head.map(|h| h.0), "{got}");
            assert_eq!(got, hashed_audit_key(key));
        } else {
            assert_eq!(got, want);
        }
    }

    #[test]
    fn hashed_keys_are_fnv1a_of_the_whole_key() {
        // FNV-1a 32 of "platform.example.com.a-very-long-policy-name-that-goes-on-and-on/images",
        // computed apart from this code.
        let key = "platform.example.com.a-very-long-policy-name-that-goes-on-and-on/images";
        assert!(hashed_audit_key(key).ends_with(&format!("-{:08x}", fnv_reference(key))));
    }

    /// FNV-1a 32 as its specification writes it.
    fn fnv_reference(s: &str) -> u32 {
        let mut h: u32 = 2_166_136_261;
        for b in s.bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(16_777_619);
        }
        h
    }

    #[test]
    fn colliding_keys_are_both_kept() {
        let mut annotations = HashMap::new();
        insert_audit(&mut annotations, "a.b/c", "one".to_owned());
        insert_audit(&mut annotations, "a/b.c", "two".to_owned());
        assert_eq!(annotations.len(), 2, "{annotations:?}");
        assert!(
            annotations.keys().all(|k| is_name_part(k)),
            "{annotations:?}"
        );
        assert_eq!(annotations["a.b.c"], "one");
    }

    #[test]
    fn dev_paths_are_recognised_after_normalising() {
        for p in [
            "/dev",
            "/dev/",
            "//dev",
            "/dev/nvidia0",
            "/./dev/../dev/shm",
            "/",
            "/x/../",
        ] {
            assert!(reaches_dev(p), "{p}");
        }
        for p in ["/devices", "/var/dev", "/opt", "/dev/../var"] {
            assert!(!reaches_dev(p), "{p}");
        }
    }

    #[test]
    fn privileged_and_dev_mounting_containers_are_named() {
        let d = json!({
            "kind": "Deployment",
            "spec": {"template": {"spec": {
                "volumes": [
                    {"name": "devices", "hostPath": {"path": "/dev"}},
                    {"name": "models", "hostPath": {"path": "/var/lib/models"}},
                ],
                "initContainers": [{"name": "setup", "securityContext": {"privileged": true}}],
                "containers": [
                    {"name": "vllm", "volumeMounts": [{"name": "models", "mountPath": "/models"}],
                     "securityContext": {"privileged": false}},
                    {"name": "agent", "volumeMounts": [{"name": "devices", "mountPath": "/host/dev"}]},
                ],
            }}}
        });
        let w = device_access_warnings(&d);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].starts_with(
                "container \"setup\" (spec.template.spec.initContainers[0]) is privileged"
            ),
            "{}",
            w[0]
        );
        assert!(
            w[1].starts_with(
                "container \"agent\" (spec.template.spec.containers[1]) mounts hostPath \"/dev\""
            ),
            "{}",
            w[1]
        );
        let pod = json!({"kind": "Pod", "spec": {"containers": [{"name": "vllm"}]}});
        assert!(device_access_warnings(&pod).is_empty());
    }
}

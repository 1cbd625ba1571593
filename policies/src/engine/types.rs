//! The engine's public data: what a request gives policies, and what an evaluation returns.

use std::collections::BTreeMap;

use hearth_crds::servingpolicy::{FailurePolicy, MutationAction, Operation, StatusReason};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::compile::ExprError;

/// A policy that did not load, and why. The rest of the set still loads.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ServingPolicy {policy}: {field}{}: {error}", .error.position.map(|(l, c)| format!(" (line {l}, column {c})")).unwrap_or_default())]
pub struct PolicyLoadError {
    /// The policy's `metadata.name`.
    pub policy: String,
    /// The field holding the bad expression: `spec.validations[2].expression`.
    pub field: String,
    /// What is wrong, with the position in the expression.
    pub error: ExprError,
}

/// Group/version/kind of the object in a request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupVersionKind {
    /// API group, empty for core.
    pub group: String,
    /// API version.
    pub version: String,
    /// Kind.
    pub kind: String,
}

/// Group/version/resource of a request.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupVersionResource {
    /// API group, empty for core.
    pub group: String,
    /// API version.
    pub version: String,
    /// Plural resource name (`deployments`).
    pub resource: String,
}

/// The requesting user (`authentication.k8s.io/v1` `UserInfo`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct UserInfo {
    /// Username.
    #[serde(default)]
    pub username: String,
    /// UID.
    #[serde(default)]
    pub uid: String,
    /// Groups.
    #[serde(default)]
    pub groups: Vec<String>,
    /// Extra attributes.
    #[serde(default)]
    pub extra: BTreeMap<String, Vec<String>>,
}

/// The admission request as CEL's `request` variable sees it (the fields of
/// `admission.k8s.io/v1` `AdmissionRequest` that policies read).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestInfo {
    /// CREATE, UPDATE, DELETE or CONNECT.
    pub operation: Operation,
    /// Kind of the object.
    pub kind: GroupVersionKind,
    /// Resource being requested.
    pub resource: GroupVersionResource,
    /// Subresource (`status`, `scale`), empty for the main resource.
    #[serde(default)]
    pub sub_resource: String,
    /// Object name (may be empty on CREATE with generateName).
    #[serde(default)]
    pub name: String,
    /// Namespace, empty for cluster-scoped objects.
    #[serde(default)]
    pub namespace: String,
    /// The requesting user.
    #[serde(default)]
    pub user_info: UserInfo,
    /// Whether the request is a dry run.
    #[serde(default)]
    pub dry_run: bool,
}

impl RequestInfo {
    /// A request for `object` (its apiVersion, kind, name and namespace), for offline use and
    /// for the controller's render path. The resource is the lower-case plural of the kind
    /// (`Deployment` → `deployments`, `Policy` → `policies`).
    pub fn for_object(object: &Value, operation: Operation) -> Self {
        let s = |p: &str| {
            object
                .pointer(p)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        let api_version = s("/apiVersion");
        let (group, version) = match api_version.split_once('/') {
            Some((g, v)) => (g.to_owned(), v.to_owned()),
            None => (String::new(), api_version.clone()),
        };
        let kind = s("/kind");
        let lower = kind.to_lowercase();
        let resource = if let Some(stem) = lower.strip_suffix('y') {
            format!("{stem}ies")
        } else if lower.ends_with('s') {
            format!("{lower}es")
        } else {
            format!("{lower}s")
        };
        RequestInfo {
            operation,
            kind: GroupVersionKind {
                group: group.clone(),
                version: version.clone(),
                kind,
            },
            resource: GroupVersionResource {
                group,
                version,
                resource,
            },
            sub_resource: String::new(),
            name: s("/metadata/name"),
            namespace: s("/metadata/namespace"),
            user_info: UserInfo::default(),
            dry_run: false,
        }
    }
}

/// What one evaluation looks at. `object` is absent on DELETE, `old_object` on CREATE.
#[derive(Debug, Clone)]
pub struct EvalInput {
    /// The request (`request`).
    pub request: RequestInfo,
    /// The object being admitted (`object`).
    pub object: Option<Value>,
    /// The object before the update (`oldObject`).
    pub old_object: Option<Value>,
    /// The namespace of a namespaced object (`namespaceObject`).
    pub namespace_object: Option<Value>,
    /// The resolved InferenceRuntime as JSON (`params`), `null` when none applies.
    pub params: Option<Value>,
    /// The owning LLMService as JSON (`service`) when rendering one.
    pub service: Option<Value>,
    /// The installation's settings (`settings`, see [`PolicySettings`]); `{}` when `None`.
    pub settings: Option<Value>,
}

/// What the Hearth installation tells policies, bound as `settings` (a JSON object, camelCase
/// fields; a field not configured is absent, so policies test it with `has()`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PolicySettings {
    /// Image of the backend drain sidecar (`hearth-gateway drain --listen …`): the built-in
    /// serving defaults add it to workloads whose runtime asks for a preStop drain, so the
    /// drain ends as soon as the engine is idle. Without it they fall back to a `sleep` hook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain_image: Option<String>,
}

impl PolicySettings {
    /// Checks the values: `drainImage`, when set, is a non-empty image reference without
    /// whitespace (a Kubernetes container image may have none).
    ///
    /// # Errors
    /// A message naming the field and what to write instead.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(image) = &self.drain_image
            && (image.is_empty() || image.chars().any(char::is_whitespace))
        {
            return Err(format!(
                "drainImage {image:?} is not an image reference: give one without spaces \
                 (registry/repository:tag), or leave drainImage out for the sleep preStop"
            ));
        }
        Ok(())
    }

    /// The settings as the JSON object policies see.
    pub fn to_value(&self) -> Value {
        serde_json::to_value(self).unwrap_or_else(|_| Value::Object(Default::default()))
    }
}

impl EvalInput {
    /// An input for `object` with the request derived from it.
    pub fn for_object(object: Value, operation: Operation) -> Self {
        EvalInput {
            request: RequestInfo::for_object(&object, operation),
            object: Some(object),
            old_object: None,
            namespace_object: None,
            params: None,
            service: None,
            settings: None,
        }
    }

    /// The input of a workload that opted in to Hearth (a Deployment, StatefulSet or Pod with
    /// the runtime or vendor annotation), as the webhook's reviews and the controller's
    /// background scans evaluate it: `runtime`, the one its annotations resolve to, as
    /// `params`; no `service`; the installation's `settings`.
    pub fn for_workload(
        request: RequestInfo,
        object: Value,
        runtime: &hearth_crds::InferenceRuntime,
        settings: Value,
    ) -> Self {
        EvalInput {
            request,
            object: Some(object),
            old_object: None,
            namespace_object: None,
            params: Some(crate::manifest::runtime_params(runtime)),
            service: None,
            settings: Some(settings),
        }
    }
}

/// A failed `Deny` validation (or a `Fail` policy's error turned into a rejection).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Denial {
    /// The policy.
    pub policy: String,
    /// The message for the user.
    pub message: String,
    /// The `metav1.StatusReason` (Forbidden unless the validation says otherwise).
    pub reason: StatusReason,
}

/// What kind of evaluation error happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ErrorKind {
    /// The expression failed (missing field, wrong type, no such overload).
    Evaluation,
    /// A bound of [`Limits`](crate::Limits) was exceeded.
    BoundExceeded,
    /// The expression returned the wrong type (a validation not returning bool, a mutation
    /// not returning a list of JSONPatch or an object).
    WrongType,
    /// A mutation could not be applied (bad JSON Patch path, kind changed).
    Patch,
}

/// An expression that failed to evaluate. Not a denial: `failurePolicy` decides.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EvalError {
    /// The policy.
    pub policy: String,
    /// The field of the expression (`spec.mutations[0].applyConfiguration.expression`).
    pub field: String,
    /// The expression source.
    pub expression: String,
    /// What went wrong.
    pub message: String,
    /// The kind of failure.
    pub kind: ErrorKind,
    /// The policy's failurePolicy: `Fail` rejected the request, `Ignore` skipped the policy.
    pub failure_policy: FailurePolicy,
    /// Which part of the policy was running: its mutations, or its validations (with the
    /// audit annotations). Match conditions and variables run in both.
    pub phase: Phase,
}

/// The part of a policy an [`EvalError`] happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Phase {
    /// `matchConditions`, `variables` and `mutations`, when the mutations ran.
    Mutation,
    /// `matchConditions`, `variables`, `validations` and `auditAnnotations`.
    Validation,
}

/// The result of evaluating a policy set against one request.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Outcome {
    /// Failed `Deny` validations.
    pub denials: Vec<Denial>,
    /// Admission warnings (failed `Warn` validations).
    pub warnings: Vec<String>,
    /// Audit annotations: `<policy>/<key>` from auditAnnotations, and
    /// `validation.policy.admission.k8s.io/validation_failure` for `Audit` validations.
    pub audit_annotations: BTreeMap<String, String>,
    /// RFC 6902 operations that turn the request's object into `patched_object`.
    pub patch: json_patch::Patch,
    /// The object after all mutations (the input object when nothing changed).
    pub patched_object: Option<Value>,
    /// Evaluation errors, with the failurePolicy that handled them.
    pub errors: Vec<EvalError>,
    /// Names of the policies that matched the request.
    pub matched: Vec<String>,
    /// What the mutations of policies with `Warn` or `Audit` in `spec.mutationActions` changed,
    /// or, without `Patch`, would have changed (report-only): the applied policies' reports in
    /// policy order, then the reinvocation round's (a policy may appear twice), then the
    /// report-only policies'; nothing for a policy whose mutations left the object as it was.
    pub mutation_reports: Vec<MutationReport>,
    /// Every failed validation of the matched policies, whatever its `validationActions` (the
    /// admission outcome above sorts them into denials, warnings and audit annotations): what
    /// a Policy Report records ([`crate::report`]).
    pub validation_failures: Vec<ValidationFailure>,
    /// Policies with mutations, matched by `matchConstraints`, whose `matchConditions` were false
    /// when their mutations were to run: the mutations did not run.
    pub mutations_unmatched: Vec<String>,
    /// Policies with validations, matched by `matchConstraints`, whose `matchConditions` were
    /// false on the object the validations saw (the object as it will be stored).
    pub validations_unmatched: Vec<String>,
}

/// One failed validation: its policy, its message, and how the policy enforces it
/// (`spec.validationActions`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ValidationFailure {
    /// The policy's `metadata.name`.
    pub policy: String,
    /// The message (`messageExpression`, `message`, or the failed expression).
    pub message: String,
    /// The policy's `spec.validationActions`; `Deny` among them: the request is rejected.
    pub actions: Vec<hearth_crds::servingpolicy::ValidationAction>,
}

/// What one policy's mutations did to a request's object, for `spec.mutationActions` `Warn`
/// and `Audit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MutationReport {
    /// The policy's `metadata.name`.
    pub policy: String,
    /// RFC 6902 operations from the object as the policy found it to the object its
    /// mutations made.
    pub patch: json_patch::Patch,
    /// Whether the patch was applied (`Patch` among the policy's mutationActions); `false`:
    /// report-only, the object was left as it was.
    pub applied: bool,
    /// The policy's `spec.mutationActions`.
    #[serde(skip)]
    pub actions: Vec<MutationAction>,
}

/// Operations a [`MutationReport::warning`] names before it only counts the rest.
const WARNING_PATHS: usize = 8;

/// The operations of `patch` for people: `add /a, replace /b`, at most eight (their values
/// left out: they can be long), then `and N more`.
pub fn patch_paths(patch: &json_patch::Patch) -> String {
    use json_patch::PatchOperation as Op;
    let mut paths: Vec<String> = patch
        .0
        .iter()
        .take(WARNING_PATHS)
        .map(|op| {
            let verb = match op {
                Op::Add(_) => "add",
                Op::Remove(_) => "remove",
                Op::Replace(_) => "replace",
                Op::Move(_) => "move",
                Op::Copy(_) => "copy",
                Op::Test(_) => "test",
            };
            format!("{verb} {}", op.path())
        })
        .collect();
    if patch.0.len() > WARNING_PATHS {
        paths.push(format!("and {} more", patch.0.len() - WARNING_PATHS));
    }
    paths.join(", ")
}

impl MutationReport {
    /// The admission warning for `Warn`: `ServingPolicy '<name>' changed the object: add /a,
    /// replace /b` (or `would change the object (report-only, not applied)`), naming at most
    /// eight operations (their values left out: they can be long) and counting the rest.
    pub fn warning(&self) -> String {
        format!(
            "ServingPolicy '{}' {}: {}",
            self.policy,
            if self.applied {
                "changed the object"
            } else {
                "would change the object (report-only, not applied)"
            },
            patch_paths(&self.patch)
        )
    }

    /// Whether the policy's mutationActions include `action`.
    pub fn has(&self, action: MutationAction) -> bool {
        self.actions.contains(&action)
    }

    /// The value of the audit annotation [`MUTATION_REPORT`](crate::MUTATION_REPORT) for the
    /// reports of `reports` whose policy audits (`Audit`): a JSON list of
    /// `{"policy", "patch", "applied"}`; `None` when no report audits.
    pub fn audit_annotation<'a>(reports: impl IntoIterator<Item = &'a Self>) -> Option<String> {
        let audited: Vec<&Self> = reports
            .into_iter()
            .filter(|r| r.has(MutationAction::Audit))
            .collect();
        (!audited.is_empty()).then(|| serde_json::to_string(&audited).unwrap_or_default())
    }
}

impl Outcome {
    /// Whether the request is admitted: no denial and no error of a `Fail` policy.
    pub fn allowed(&self) -> bool {
        self.denials.is_empty()
            && self
                .errors
                .iter()
                .all(|e| e.failure_policy == FailurePolicy::Ignore)
    }

    /// Every reason the request is rejected, one line each: denials, then `Fail` errors.
    pub fn rejection_messages(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .denials
            .iter()
            .map(|d| {
                format!(
                    "ServingPolicy '{}' denied the request: {}",
                    d.policy, d.message
                )
            })
            .collect();
        out.extend(
            self.errors
                .iter()
                .filter(|e| e.failure_policy == FailurePolicy::Fail)
                .map(|e| {
                    format!(
                        "ServingPolicy '{}' failed to evaluate {} ({}): {}",
                        e.policy, e.field, e.expression, e.message
                    )
                }),
        );
        out
    }
}

/// The render path's result: the mutated object and the patch from the input.
#[derive(Debug, Clone)]
pub struct Mutated {
    /// The object after all mutations.
    pub object: Value,
    /// RFC 6902 operations from the input object to `object` (empty when nothing changed).
    pub patch: json_patch::Patch,
    /// Errors of `Ignore` policies (skipped).
    pub ignored: Vec<EvalError>,
    /// What report-only (and reported) mutations changed or would have changed
    /// ([`Outcome::mutation_reports`]).
    pub reports: Vec<MutationReport>,
}

/// Why [`PolicySet::mutate`](crate::PolicySet::mutate) failed: a `Fail` policy could not be
/// evaluated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(|e| format!("ServingPolicy '{}' {}: {}", e.policy, e.field, e.message)).collect::<Vec<_>>().join("; "))]
pub struct MutateError(pub Vec<EvalError>);

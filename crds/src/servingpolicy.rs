//! `ServingPolicy`: a platform team's CEL policy that validates and mutates serving workloads.
//!
//! Field names follow Kubernetes `ValidatingAdmissionPolicy` (admissionregistration.k8s.io/v1,
//! KEP-3488) and `MutatingAdmissionPolicy` (v1beta1, KEP-3962), so expressions written for the
//! apiserver work here. One object carries both halves and the binding's `validationActions`,
//! because a ServingPolicy needs no separate binding: its `params` is always the
//! `InferenceRuntime` resolved for the workload, and `service` the owning `LLMService` when
//! there is one.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// spec is the desired state of a ServingPolicy.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "serving.hearth.dev",
    version = "v1alpha1",
    kind = "ServingPolicy",
    plural = "servingpolicies",
    singular = "servingpolicy",
    shortname = "srvpol",
    category = "hearth",
    status = "ServingPolicyStatus",
    printcolumn = r#"{"name":"Failure Policy","type":"string","jsonPath":".spec.failurePolicy"}"#,
    printcolumn = r#"{"name":"Actions","type":"string","jsonPath":".spec.validationActions"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    doc = "ServingPolicy is a cluster-scoped CEL policy that validates and mutates serving workloads, with the resolved InferenceRuntime bound as params."
)]
#[serde(rename_all = "camelCase")]
pub struct ServingPolicySpec {
    /// failurePolicy says what happens when an expression fails to evaluate (or exceeds a
    /// cost bound): Fail rejects the request, Ignore skips this policy. Defaults to Fail.
    #[serde(default)]
    pub failure_policy: FailurePolicy,

    /// matchConstraints says which requests the policy looks at. Omitted: every workload that
    /// Hearth handles (annotated Deployments, StatefulSets and Pods, and rendered backends).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_constraints: Option<MatchResources>,

    /// matchConditions must all evaluate to true for the policy to apply, evaluated in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub match_conditions: Vec<MatchCondition>,

    /// variables are named expressions evaluated once per request, in order; later ones may use
    /// earlier ones as `variables.<name>`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub variables: Vec<Variable>,

    /// validations are checks that must evaluate to true.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub validations: Vec<Validation>,

    /// validationActions says how a failed validation is enforced: Deny, Warn, Audit (Deny and
    /// Warn are exclusive). Defaults to [Deny].
    #[serde(default = "default_validation_actions")]
    #[schemars(length(min = 1, max = 2))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub validation_actions: Vec<ValidationAction>,

    /// auditAnnotations are added to the admission response's audit annotations.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub audit_annotations: Vec<AuditAnnotation>,

    /// mutations change the object, applied in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub mutations: Vec<Mutation>,

    /// reinvocationPolicy: IfNeeded runs the policy again when a later mutation changed the
    /// object (as MutatingAdmissionPolicy does); Never runs it once. Defaults to Never.
    #[serde(default)]
    pub reinvocation_policy: ReinvocationPolicy,

    /// mutationActions says what the policy's mutations do, the way validationActions does for
    /// its validations: Patch changes the object; Warn returns the paths they change (or would
    /// change) as an admission warning; Audit records their JSON Patch in an audit annotation
    /// (`<webhook>/mutation_report` in the apiserver's audit log). Without Patch the mutations
    /// are report-only: evaluated and reported, nothing is patched (the rendered backends
    /// included), and an evaluation error enforces nothing. Defaults to [Patch].
    #[serde(default = "default_mutation_actions")]
    #[schemars(length(min = 1, max = 3))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub mutation_actions: Vec<MutationAction>,
}

fn default_validation_actions() -> Vec<ValidationAction> {
    vec![ValidationAction::Deny]
}

fn default_mutation_actions() -> Vec<MutationAction> {
    vec![MutationAction::Patch]
}

/// What happens when a policy fails to evaluate.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum FailurePolicy {
    /// The request is rejected.
    #[default]
    Fail,
    /// The policy is skipped.
    Ignore,
}

/// Reinvocation of mutations (as in MutatingAdmissionPolicy).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum ReinvocationPolicy {
    /// Run once.
    #[default]
    Never,
    /// Run again if later mutations changed the object.
    IfNeeded,
}

/// How a failed validation is enforced.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum ValidationAction {
    /// Reject the request.
    Deny,
    /// Return the message as an admission warning.
    Warn,
    /// Record the failure in the audit annotations.
    Audit,
}

/// What a policy's mutations do (`spec.mutationActions`).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum MutationAction {
    /// Apply the mutations to the object.
    Patch,
    /// Return the paths the mutations change as an admission warning.
    Warn,
    /// Record the mutations' JSON Patch in the audit annotations.
    Audit,
}

/// Which requests a policy looks at; the shape of `admissionregistration.k8s.io/v1`
/// `MatchResources`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MatchResources {
    /// namespaceSelector matches the namespace of a namespaced object by its labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,

    /// objectSelector matches the object (or old object) by its labels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_selector: Option<LabelSelector>,

    /// resourceRules the request must match (any of them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub resource_rules: Vec<NamedRuleWithOperations>,

    /// excludeResourceRules the request must not match (any of them).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub exclude_resource_rules: Vec<NamedRuleWithOperations>,

    /// matchPolicy: Exact or Equivalent (another version of the same resource). Defaults to
    /// Equivalent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub match_policy: Option<MatchPolicy>,
}

/// How a request's group/version is compared with a rule.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum MatchPolicy {
    /// Only the listed group/version/resource.
    Exact,
    /// Any version of the listed resource.
    Equivalent,
}

/// A resource rule with operations and optional names.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamedRuleWithOperations {
    /// apiGroups ("" is core, "*" is all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 253)))]
    pub api_groups: Vec<String>,

    /// apiVersions ("*" is all).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 63)))]
    pub api_versions: Vec<String>,

    /// resources ("deployments", "pods/status", "*", "*/scale").
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), inner(length(max = 253)))]
    pub resources: Vec<String>,

    /// resourceNames limits the rule to objects with these names; empty is all.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64), inner(length(max = 253)))]
    pub resource_names: Vec<String>,

    /// operations: CREATE, UPDATE, DELETE, CONNECT, or "*".
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 5))]
    pub operations: Vec<Operation>,

    /// scope: "Cluster", "Namespaced" or "*" (default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 16))]
    pub scope: Option<String>,
}

/// An admission operation.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum Operation {
    /// Object creation.
    #[serde(rename = "CREATE")]
    Create,
    /// Object update.
    #[serde(rename = "UPDATE")]
    Update,
    /// Object deletion.
    #[serde(rename = "DELETE")]
    Delete,
    /// Connect (exec, attach, proxy).
    #[serde(rename = "CONNECT")]
    Connect,
    /// Any operation.
    #[serde(rename = "*")]
    All,
}

/// A named CEL condition; all must be true for the policy to apply.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MatchCondition {
    /// name identifies the condition in errors; a qualified name.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// expression must evaluate to a bool.
    #[schemars(length(min = 1, max = 5120))]
    pub expression: String,
}

/// A named CEL expression evaluated once per request.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Variable {
    /// name is how later expressions refer to it: `variables.<name>`.
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-zA-Z_][a-zA-Z0-9_]*$")
    )]
    pub name: String,
    /// expression computes the value.
    #[schemars(length(min = 1, max = 5120))]
    pub expression: String,
}

/// A validation expression and its message.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Validation {
    /// expression must evaluate to true for the request to pass.
    #[schemars(length(min = 1, max = 5120))]
    pub expression: String,

    /// message is shown when the expression is false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024))]
    pub message: Option<String>,

    /// messageExpression computes the message (a string); it wins over message when it
    /// evaluates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 5120))]
    pub message_expression: Option<String>,

    /// reason is the machine-readable reason in the response status: Unauthorized, Forbidden
    /// (default), Invalid or RequestEntityTooLarge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<StatusReason>,
}

/// `metav1.StatusReason` values a validation may return.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum StatusReason {
    /// HTTP 401.
    Unauthorized,
    /// HTTP 403.
    Forbidden,
    /// HTTP 422.
    Invalid,
    /// HTTP 413.
    RequestEntityTooLarge,
}

/// An audit annotation computed by CEL.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuditAnnotation {
    /// key, combined with the policy name as `<policy>/<key>`.
    #[schemars(length(min = 1, max = 63))]
    pub key: String,
    /// valueExpression computes the value (a string, or null to omit it).
    #[schemars(length(min = 1, max = 5120))]
    pub value_expression: String,
}

/// One mutation, the shape of `MutatingAdmissionPolicy`'s `Mutation`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "self.patchType != 'JSONPatch' || has(self.jsonPatch)",
        "message": "patchType JSONPatch needs jsonPatch.expression"
    },
    {
        "rule": "self.patchType != 'ApplyConfiguration' || has(self.applyConfiguration)",
        "message": "patchType ApplyConfiguration needs applyConfiguration.expression"
    }
]))]
pub struct Mutation {
    /// patchType: JSONPatch (the expression returns a list of JSONPatch operations) or
    /// ApplyConfiguration (the expression returns a partial object merged into the object).
    pub patch_type: PatchType,

    /// jsonPatch holds the expression for patchType JSONPatch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json_patch: Option<ExpressionHolder>,

    /// applyConfiguration holds the expression for patchType ApplyConfiguration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub apply_configuration: Option<ExpressionHolder>,
}

/// The two mutation patch types of MutatingAdmissionPolicy.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum PatchType {
    /// RFC 6902 operations built by CEL (`JSONPatch{op: ..., path: ..., value: ...}`).
    #[serde(rename = "JSONPatch")]
    JsonPatch,
    /// A partial object built by CEL (`Object{spec: Object.spec{...}}`), merged in.
    ApplyConfiguration,
}

/// A CEL expression.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExpressionHolder {
    /// expression is the CEL source.
    #[schemars(length(min = 1, max = 10240))]
    pub expression: String,
}

/// status is the observed state of a ServingPolicy.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ServingPolicyStatus {
    /// observedGeneration is the metadata.generation the conditions describe.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// conditions: Ready is True when every expression compiled and the policy is enforced.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,

    /// scan is what the last background scan found: this policy evaluated against the
    /// workloads that already run (Deployments and StatefulSets annotated for Hearth), as
    /// admission would if each were created now. Up to one result per rule (validations,
    /// mutations) per matched workload; each workload's results are in a Policy Report
    /// (wgpolicyk8s.io/v1alpha2 PolicyReport `hearth-<workload uid>` in its namespace).
    /// Written by the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scan: Option<ScanStatus>,

    /// export is where the apiserver runs this policy, written by the controller when its
    /// export mode is on (`--policy-export`): the ValidatingAdmissionPolicy and
    /// MutatingAdmissionPolicy objects (with their bindings) it was exported to, or why it
    /// cannot be. The condition Exported says the same. While the objects listed here are in
    /// place, Hearth's webhook does not evaluate the policy (its Ready condition then has the
    /// reason Exported).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub export: Option<ExportStatus>,
}

/// Where the apiserver runs a ServingPolicy (`status.export`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExportStatus {
    /// observedGeneration is the metadata.generation of the policy this export describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// objects are the exported objects (cluster-scoped, named after the policy).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub objects: Vec<ExportedObject>,
    /// reasons say why the policy is not exported, one per field and construct.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub reasons: Vec<ExportReason>,
}

/// One exported object.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExportedObject {
    /// apiVersion, such as admissionregistration.k8s.io/v1beta1.
    pub api_version: String,
    /// kind: ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
    /// MutatingAdmissionPolicy or MutatingAdmissionPolicyBinding.
    pub kind: String,
    /// name of the object.
    pub name: String,
}

/// Why a ServingPolicy cannot be exported.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ExportReason {
    /// field is the path of the field in the ServingPolicy, such as
    /// spec.variables[3].expression.
    pub field: String,
    /// construct is what the apiserver cannot run there: a variable (service), a function
    /// (cel.bind), an action (Warn).
    pub construct: String,
    /// message says why, and what to write instead.
    pub message: String,
}

/// The counts of a background scan for one ServingPolicy (`status.scan`).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ScanStatus {
    /// observedGeneration is the metadata.generation of the policy the scan evaluated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// lastScanTime is when a scan last wrote these counts (at its end). A scan that finds the
    /// same counts for the same generation as the controller last wrote leaves them, and this
    /// time, as they are (a new leader writes them once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_scan_time: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// resources is how many workloads the policy gave a result for (matched, and its
    /// matchConditions true where a rule ran).
    #[serde(default)]
    pub resources: i64,
    /// pass counts the results with nothing to report.
    #[serde(default)]
    pub pass: i64,
    /// fail counts the validations results that failed a denying validation (Deny in
    /// validationActions): admission would reject the workload now.
    #[serde(default)]
    pub fail: i64,
    /// warn counts the validations results that failed a validation the policy only warns
    /// or audits.
    #[serde(default)]
    pub warn: i64,
    /// error counts the results whose expressions did not evaluate (or whose mutation did not
    /// apply).
    #[serde(default)]
    pub error: i64,
    /// wouldMutate counts the mutations results whose mutations would change the workload
    /// (applied at its next admission, or reported only).
    #[serde(default)]
    pub would_mutate: i64,
}

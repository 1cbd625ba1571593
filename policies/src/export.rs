//! Export of ServingPolicies to the apiserver's own admission policies: a policy the apiserver
//! can run becomes a `ValidatingAdmissionPolicy` (validations, audit annotations) and/or a
//! `MutatingAdmissionPolicy` (mutations), each with its binding, so it holds without Hearth's
//! webhook. `hearth-policy export` prints them; the controller's export mode applies them and
//! the webhook stops evaluating a policy while its exported objects are in place
//! ([`is_exported`]).
//!
//! What an exported policy keeps of Hearth's semantics:
//!
//! - **Scope**: the workload webhook's: apps/v1 Deployments and StatefulSets and v1 Pods on
//!   CREATE and UPDATE, outside the skipped namespaces ([`skipped_namespaces`]); a policy's own
//!   `matchConstraints` narrow it further (operations other than CREATE and UPDATE are dropped:
//!   the webhook never receives them).
//! - **`params`**: the InferenceRuntime as `paramKind`. The binding's `paramRef` selects every
//!   runtime and the match condition `hearth-runtime` ([`resolution_expression`]) keeps only the
//!   one Hearth resolves for the workload: a pinned name (annotation or label
//!   `serving.hearth.dev/runtime`) as it is at admission; a vendor list
//!   (`serving.hearth.dev/vendor`) by the runtimes as they were at export time (the controller
//!   exports again when they change; [`EXPORTED_RUNTIMES`] records which table an object holds).
//!   `params` is the runtime as stored, which the CRD's defaults fill in as Hearth does.
//! - **Order**: the apiserver runs MutatingAdmissionPolicies before mutating webhooks, so an
//!   exported policy's mutations run before those of the policies that stay in the webhook
//!   (Hearth runs its policies built-ins first, then by name).
//!
//! Not exported, each with a [`Reason`] naming the field and construct: expressions that read
//! `service` or `settings` (the apiserver has no such variables), functions and constructs the
//! apiserver's admission CEL lacks or gains only in a later version ([`required_minor`]),
//! `jsonpatch` outside mutations, report-only or reported mutations (`mutationActions` other
//! than `[Patch]`: MutatingAdmissionPolicy has no such action), and what the target apiserver
//! does not serve ([`Target`]).

use std::collections::BTreeMap;

pub use hearth_crds::admission_apis::Kind;
use hearth_crds::servingpolicy::{
    MutationAction, Operation, PatchType, ServingPolicy, ServingPolicySpec, StatusReason,
    ValidationAction,
};
use hearth_crds::{InferenceRuntime, wellknown};
use serde_json::{Value, json};

use crate::compile::used;

/// Label on every exported object: the ServingPolicy it was exported from.
pub const EXPORTED_FROM: &str = "serving.hearth.dev/exported-from";
/// Annotation: `metadata.uid` of the exported ServingPolicy (absent when exported offline).
pub const EXPORTED_UID: &str = "serving.hearth.dev/exported-uid";
/// Annotation: `metadata.generation` of the exported ServingPolicy.
pub const EXPORTED_GENERATION: &str = "serving.hearth.dev/exported-generation";
/// Annotation: the digest of the runtime table the `hearth-runtime` match condition holds
/// ([`runtimes_digest`]).
pub const EXPORTED_RUNTIMES: &str = "serving.hearth.dev/exported-runtimes";

/// Annotation: when this object was first applied for its policy's current generation and
/// runtime table (RFC 3339), written by the controller's export mode.
pub const EXPORTED_AT: &str = "serving.hearth.dev/exported-at";
/// Annotation on a binding: `"true"` once the controller's export mode has let the apiserver
/// load it (its policy and it existed for a settle period); until then Hearth's webhook keeps
/// evaluating the policy too ([`is_exported`]).
pub const ENFORCED: &str = "serving.hearth.dev/enforced";

/// The match condition that keeps the workload webhook's scope.
pub const SCOPE_CONDITION: &str = "hearth-workload";
/// The match condition that keeps the runtime Hearth resolves.
pub const RUNTIME_CONDITION: &str = "hearth-runtime";

/// The most match conditions an admission policy may have (the apiserver's limit).
const MAX_MATCH_CONDITIONS: usize = 64;

/// Which API version of `admissionregistration.k8s.io` an exported kind uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiVersion {
    /// `admissionregistration.k8s.io/v1`.
    V1,
    /// `admissionregistration.k8s.io/v1beta1`.
    V1beta1,
}

impl ApiVersion {
    /// The `apiVersion` string.
    pub fn as_str(self) -> &'static str {
        match self {
            ApiVersion::V1 => "admissionregistration.k8s.io/v1",
            ApiVersion::V1beta1 => "admissionregistration.k8s.io/v1beta1",
        }
    }
}

/// The apiserver an export is for: its minor version (which CEL it accepts in new
/// expressions) and the API versions it serves, `None` for a kind it does not serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    /// Kubernetes minor version (`35` for 1.35).
    pub minor: u32,
    /// ValidatingAdmissionPolicy: `v1` from 1.30.
    pub validating: Option<ApiVersion>,
    /// MutatingAdmissionPolicy: `v1` from 1.36; `v1beta1` on 1.34 and 1.35 when the apiserver
    /// runs with `--feature-gates=MutatingAdmissionPolicy=true` and
    /// `--runtime-config=admissionregistration.k8s.io/v1beta1=true`.
    pub mutating: Option<ApiVersion>,
}

impl Target {
    /// What a Kubernetes 1.`minor` apiserver serves by version (MutatingAdmissionPolicy
    /// `v1beta1` assumed enabled on 1.34 and 1.35).
    pub fn for_kubernetes(minor: u32) -> Self {
        Target {
            minor,
            validating: (minor >= 30).then_some(ApiVersion::V1),
            mutating: match minor {
                36.. => Some(ApiVersion::V1),
                34 | 35 => Some(ApiVersion::V1beta1),
                _ => None,
            },
        }
    }

    /// The target of an apiserver found by discovery: `minor`, and the resources it serves in
    /// each version (the newest served version of each kind is used).
    pub fn served(
        minor: u32,
        validating_v1: bool,
        mutating_v1: bool,
        mutating_v1beta1: bool,
    ) -> Self {
        Target {
            minor,
            validating: validating_v1.then_some(ApiVersion::V1),
            mutating: if mutating_v1 {
                Some(ApiVersion::V1)
            } else {
                mutating_v1beta1.then_some(ApiVersion::V1beta1)
            },
        }
    }
}

/// Why a policy (or part of it) cannot be exported.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reason {
    /// The field, as a path into the ServingPolicy (`spec.variables[3].expression`).
    pub field: String,
    /// The construct: a function (`cel.bind`), a variable (`service`), a value.
    pub construct: String,
    /// Why the apiserver cannot run it, and what to do instead.
    pub message: String,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}: {}", self.field, self.construct, self.message)
    }
}

/// Which apiserver kinds a policy needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Needs {
    /// A ValidatingAdmissionPolicy and its binding (validations or audit annotations).
    pub validating: bool,
    /// A MutatingAdmissionPolicy and its binding (mutations).
    pub mutating: bool,
}

/// The kinds `spec` needs.
pub fn needs(spec: &ServingPolicySpec) -> Needs {
    Needs {
        validating: !spec.validations.is_empty() || !spec.audit_annotations.is_empty(),
        mutating: !spec.mutations.is_empty(),
    }
}

/// The kinds `needs` asks for, in apply order.
pub fn kinds(needs: Needs) -> impl Iterator<Item = Kind> {
    Kind::ALL.into_iter().filter(move |k| {
        if k.is_mutating() {
            needs.mutating
        } else {
            needs.validating
        }
    })
}

/// The namespaces the workload webhook (and so an exported policy's bindings) skips:
/// `kube-system` and Hearth's own namespace.
pub fn skipped_namespaces(own_namespace: &str) -> Vec<String> {
    let mut skip = vec!["kube-system".to_owned()];
    if own_namespace != "kube-system" {
        skip.push(own_namespace.to_owned());
    }
    skip
}

/// The Kubernetes minor version from which the apiserver accepts `function` (as
/// [`crate::compile::Used::functions`] names it) in a new admission policy expression, `None`
/// when no version up to 1.36 does, with the reason. Versions are the CEL environment's
/// `IntroducedVersion` (k8s.io/apiserver `pkg/cel/environment/base.go`) plus one: an
/// apiserver accepts new expressions at its compatibility version, one below its own.
pub fn required_minor(function: &str) -> Result<u32, &'static str> {
    const NEVER: &[(&str, &str)] = &[
        (
            "cel.bind",
            "the apiserver's admission CEL has no cel.bind: compute the value in a policy variable",
        ),
        (
            "base64.encode",
            "the apiserver's admission CEL has no base64 library",
        ),
        (
            "base64.decode",
            "the apiserver's admission CEL has no base64 library",
        ),
        (
            "isIPv4",
            "not in the Kubernetes IP library: use ip(s).family() == 4",
        ),
        (
            "isIPv6",
            "not in the Kubernetes IP library: use ip(s).family() == 6",
        ),
        (
            "isCIDRv4",
            "not in the Kubernetes CIDR library: use cidr(s).ip().family() == 4",
        ),
        (
            "isCIDRv6",
            "not in the Kubernetes CIDR library: use cidr(s).ip().family() == 6",
        ),
        (
            "max(…)",
            "the apiserver has list.max() only, not the variadic max(a, b)",
        ),
        (
            "min(…)",
            "the apiserver has list.min() only, not the variadic min(a, b)",
        ),
    ];
    if let Some((_, why)) = NEVER.iter().find(|(n, _)| *n == function) {
        return Err(why);
    }
    if function.starts_with("math.") {
        return Err("the apiserver's admission CEL has no math library");
    }
    Ok(match function {
        "format" | "strings.quote" | "sets.contains" | "sets.equivalent" | "sets.intersects" => 30,
        "ip"
        | "isIP"
        | "cidr"
        | "isCIDR"
        | "containsIP"
        | "containsCIDR"
        | "masked"
        | "prefixLength"
        | "family"
        | "isUnspecified"
        | "isLoopback"
        | "isLinkLocalMulticast"
        | "isLinkLocalUnicast"
        | "isGlobalUnicast"
        | "ip.isCanonical" => 31,
        "format.named" | "validate" => 32,
        f if f.starts_with("format.") => 32,
        f if f.ends_with("(k, v, …)") => 33,
        "semver" | "isSemver" | "major" | "minor" | "patch" => 34,
        // `first` and `last` came with the cel-go of 1.33; Hearth asks for 1.34 to be safe.
        "first" | "last" => 34,
        "lists.range" | "slice" | "flatten" | "distinct" | "sort" | "reverse" => 35,
        _ => 30,
    })
}

/// The digest (16 hex digits) of the runtime table in [`resolution_expression`]: an exported
/// object whose [`EXPORTED_RUNTIMES`] differs resolves vendors by an older table.
pub fn runtimes_digest<'a>(runtimes: impl IntoIterator<Item = &'a InferenceRuntime>) -> String {
    let text = resolution_expression(runtimes);
    let hash = text.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{hash:016x}")
}

fn quote(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".to_owned())
}

/// The CEL condition that `params` is the runtime Hearth resolves for `object` (the rule of
/// [`crate::resolve_runtime`]): the pinned name (`serving.hearth.dev/runtime`, annotation before
/// label, blank ignored) when there is one; else the vendor list (`serving.hearth.dev/vendor`)
/// resolved by the table of `runtimes`: the first listed vendor that has runtimes, its runtime
/// of highest priority (an empty list: the highest of all), none on a tie. Uses only what every
/// apiserver with ValidatingAdmissionPolicy v1 has (no `cel.bind`).
pub fn resolution_expression<'a>(
    runtimes: impl IntoIterator<Item = &'a InferenceRuntime>,
) -> String {
    let runtimes: Vec<&InferenceRuntime> = runtimes.into_iter().collect();
    let name = |r: &InferenceRuntime| r.metadata.name.clone().unwrap_or_default();
    // The unique runtime of highest priority among `rs`, or "" on a tie.
    let winner = |rs: Vec<&InferenceRuntime>| -> String {
        let Some(best) = rs.iter().map(|r| r.spec.priority).max() else {
            return String::new();
        };
        let mut top: Vec<String> = rs
            .iter()
            .filter(|r| r.spec.priority == best)
            .map(|r| name(r))
            .collect();
        top.sort();
        top.dedup();
        if top.len() == 1 {
            top.remove(0)
        } else {
            String::new()
        }
    };
    let mut vendors: BTreeMap<&str, Vec<&InferenceRuntime>> = BTreeMap::new();
    for r in &runtimes {
        vendors.entry(r.spec.vendor.as_str()).or_default().push(r);
    }
    let table = vendors
        .iter()
        .map(|(v, rs)| format!("{}: {}", quote(v), quote(&winner(rs.clone()))))
        .collect::<Vec<_>>()
        .join(", ");
    let overall = quote(&winner(runtimes.clone()));
    let find = |key: &str| {
        let k = quote(key);
        let at = |m: &str| {
            format!(
                "has(object.metadata.{m}) && {k} in object.metadata.{m} && object.metadata.{m}[{k}].trim() != ''"
            )
        };
        format!(
            "({} ? object.metadata.annotations[{k}].trim() : {} ? object.metadata.labels[{k}].trim() : '')",
            at("annotations"),
            at("labels")
        )
    };
    let pin = find(wellknown::RUNTIME_ANNOTATION);
    let vendor = find(wellknown::VENDOR_ANNOTATION);
    let prefs = format!("{vendor}.split(',').map(v, v.trim()).filter(v, v != '')");
    format!(
        "{pin} != '' ? params.metadata.name == {pin} : {vendor} != '' && params.metadata.name == \
         (size({prefs}) == 0 ? {overall} : {prefs}.exists(v, v in {{{table}}}) ? \
         {{{table}}}[{prefs}.filter(v, v in {{{table}}})[0]] : '')"
    )
}

/// The condition that keeps the workload webhook's scope: the main resource of apps
/// Deployments and StatefulSets and core Pods, on CREATE and UPDATE.
pub fn scope_expression() -> &'static str {
    "(!has(request.subResource) || request.subResource == '') && (request.operation == 'CREATE' || request.operation == 'UPDATE') && \
     ((request.resource.group == 'apps' && (request.resource.resource == 'deployments' || \
     request.resource.resource == 'statefulsets')) || (request.resource.group == '' && \
     request.resource.resource == 'pods'))"
}

/// Every expression of `spec` with its field path, in spec order.
fn expressions(spec: &ServingPolicySpec) -> Vec<(String, &str, bool)> {
    let mut out: Vec<(String, &str, bool)> = Vec::new();
    for (i, c) in spec.match_conditions.iter().enumerate() {
        out.push((
            format!("spec.matchConditions[{i}].expression"),
            &c.expression,
            false,
        ));
    }
    for (i, v) in spec.variables.iter().enumerate() {
        out.push((
            format!("spec.variables[{i}].expression"),
            &v.expression,
            false,
        ));
    }
    for (i, v) in spec.validations.iter().enumerate() {
        out.push((
            format!("spec.validations[{i}].expression"),
            &v.expression,
            false,
        ));
        if let Some(m) = &v.message_expression {
            out.push((format!("spec.validations[{i}].messageExpression"), m, false));
        }
    }
    for (i, a) in spec.audit_annotations.iter().enumerate() {
        out.push((
            format!("spec.auditAnnotations[{i}].valueExpression"),
            &a.value_expression,
            false,
        ));
    }
    for (i, m) in spec.mutations.iter().enumerate() {
        let (field, holder) = match m.patch_type {
            PatchType::JsonPatch => ("jsonPatch", &m.json_patch),
            PatchType::ApplyConfiguration => ("applyConfiguration", &m.apply_configuration),
        };
        if let Some(h) = holder {
            out.push((
                format!("spec.mutations[{i}].{field}.expression"),
                &h.expression,
                true,
            ));
        }
    }
    out
}

/// Why `spec` cannot be exported to `target`; empty when it can.
pub fn reasons(spec: &ServingPolicySpec, target: &Target) -> Vec<Reason> {
    let mut out = Vec::new();
    let need = needs(spec);
    let reason = |field: &str, construct: &str, message: String| Reason {
        field: field.to_owned(),
        construct: construct.to_owned(),
        message,
    };
    if !need.validating && !need.mutating {
        out.push(reason(
            "spec",
            "no validations, audit annotations or mutations",
            "the policy does nothing the apiserver could run".to_owned(),
        ));
    }
    if need.validating && target.validating.is_none() {
        out.push(reason(
            "spec.validations",
            "ValidatingAdmissionPolicy",
            format!(
                "Kubernetes 1.{} does not serve ValidatingAdmissionPolicy v1 (1.30 and later do)",
                target.minor
            ),
        ));
    }
    if need.mutating {
        if target.mutating.is_none() {
            out.push(reason(
                "spec.mutations",
                "MutatingAdmissionPolicy",
                "the apiserver serves no MutatingAdmissionPolicy API: v1 from Kubernetes 1.36; v1beta1 on 1.34 and 1.35 with --feature-gates=MutatingAdmissionPolicy=true and --runtime-config=admissionregistration.k8s.io/v1beta1=true".to_owned(),
            ));
        }
        let actions = &spec.mutation_actions;
        if !(actions.is_empty() || actions.as_slice() == [MutationAction::Patch]) {
            let names: Vec<String> = actions
                .iter()
                .filter(|a| **a != MutationAction::Patch)
                .map(|a| format!("{a:?}"))
                .collect();
            out.push(reason(
                "spec.mutationActions",
                &names.join(", "),
                "MutatingAdmissionPolicy only patches: it cannot report its mutations (Warn, Audit) or only report them; keep the policy in Hearth's webhook, or set mutationActions to [Patch]".to_owned(),
            ));
        }
    }
    out.extend(apiserver_names(spec));
    for (i, c) in spec.match_conditions.iter().enumerate() {
        if c.name == SCOPE_CONDITION || c.name == RUNTIME_CONDITION {
            out.push(reason(
                &format!("spec.matchConditions[{i}].name"),
                &c.name,
                "the export adds a match condition of this name: rename this one".to_owned(),
            ));
        }
    }
    if spec.match_conditions.len() + 2 > MAX_MATCH_CONDITIONS {
        out.push(reason(
            "spec.matchConditions",
            &format!("{} conditions", spec.match_conditions.len()),
            format!(
                "the export adds {SCOPE_CONDITION} and {RUNTIME_CONDITION}, and the apiserver allows {MAX_MATCH_CONDITIONS}: merge some conditions"
            ),
        ));
    }
    if let Some(mc) = &spec.match_constraints
        && !mc.resource_rules.is_empty()
        && mc
            .resource_rules
            .iter()
            .all(|r| clip_operations(&r.operations).is_empty())
    {
        out.push(reason(
            "spec.matchConstraints.resourceRules",
            "operations",
            "no rule matches CREATE or UPDATE, the only operations Hearth's webhook receives"
                .to_owned(),
        ));
    }
    for (field, source, in_mutation) in expressions(spec) {
        let used = match used(source) {
            Ok(u) => u,
            Err(e) => {
                out.push(reason(&field, "syntax", e.to_string()));
                continue;
            }
        };
        for root in &used.roots {
            let message = match root.as_str() {
                "service" => {
                    "the owning LLMService exists only when Hearth's controller renders a backend; the apiserver has no such variable"
                }
                "settings" => "Hearth's installation settings are not a variable the apiserver has",
                _ => continue,
            };
            out.push(reason(&field, root, message.to_owned()));
        }
        if used.escaped_field {
            out.push(reason(
                &field,
                "backtick-quoted field name",
                "the apiserver's CEL does not read backtick-quoted names: write m['content-type']"
                    .to_owned(),
            ));
        }
        for f in &used.functions {
            if f == "jsonpatch.escapeKey" {
                if !in_mutation {
                    out.push(reason(
                        &field,
                        f,
                        "the apiserver offers jsonpatch only in a MutatingAdmissionPolicy's mutations: compute the path in the mutation".to_owned(),
                    ));
                }
                continue;
            }
            match required_minor(f) {
                Err(why) => out.push(reason(&field, f, why.to_owned())),
                Ok(min) if min > target.minor => out.push(reason(
                    &field,
                    f,
                    format!(
                        "the apiserver accepts it in new expressions from Kubernetes 1.{min}; this one is 1.{}",
                        target.minor
                    ),
                )),
                Ok(_) => {}
            }
        }
    }
    out
}

/// CEL's reserved words, which a variable name may not be (the apiserver's check).
const CEL_RESERVED: &[&str] = &[
    "true",
    "false",
    "null",
    "in",
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "function",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
];

/// What the apiserver's validation of ValidatingAdmissionPolicy and MutatingAdmissionPolicy
/// refuses and a ServingPolicy allows (k8s.io/kubernetes
/// `pkg/apis/admissionregistration/validation`): match condition names that are not qualified
/// names or repeat, variable names that are not CEL identifiers, messages with line breaks,
/// audit annotation keys that are not a qualified name's name part.
fn apiserver_names(spec: &ServingPolicySpec) -> Vec<Reason> {
    let mut out = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for (i, c) in spec.match_conditions.iter().enumerate() {
        let field = format!("spec.matchConditions[{i}].name");
        if let Err(e) = hearth_crds::naming::check_qualified_name(&c.name) {
            out.push(Reason {
                field,
                construct: c.name.clone(),
                message: format!(
                    "the apiserver wants a qualified name (like runtime-resolved); this one {e}"
                ),
            });
        } else if !seen.insert(c.name.as_str()) {
            out.push(Reason {
                field,
                construct: c.name.clone(),
                message: "the apiserver wants each match condition named once: rename one"
                    .to_owned(),
            });
        }
    }
    for (i, v) in spec.variables.iter().enumerate() {
        let identifier = v
            .name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && v.name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !identifier || CEL_RESERVED.contains(&v.name.as_str()) {
            out.push(Reason {
                field: format!("spec.variables[{i}].name"),
                construct: v.name.clone(),
                message: "the apiserver wants a CEL identifier that is not a reserved word (letters, digits and _, like modelContainer)".to_owned(),
            });
        }
    }
    for (i, v) in spec.validations.iter().enumerate() {
        if v.message
            .as_deref()
            .is_some_and(|m| m.contains(['\n', '\r']))
        {
            out.push(Reason {
                field: format!("spec.validations[{i}].message"),
                construct: "line break".to_owned(),
                message: "the apiserver refuses a message with line breaks: write it on one line (YAML `>-` folds lines)".to_owned(),
            });
        }
    }
    for (i, a) in spec.audit_annotations.iter().enumerate() {
        if a.key.contains('/') || hearth_crds::naming::check_qualified_name(&a.key).is_err() {
            out.push(Reason {
                field: format!("spec.auditAnnotations[{i}].key"),
                construct: a.key.clone(),
                message: "the apiserver wants a qualified name's name part (up to 63 of letters, digits, '-', '_', '.', alphanumeric at both ends)".to_owned(),
            });
        }
    }
    out
}

fn clip_operations(ops: &[Operation]) -> Vec<&'static str> {
    let has = |o: Operation| ops.contains(&o) || ops.contains(&Operation::All);
    let mut out = Vec::new();
    if has(Operation::Create) {
        out.push("CREATE");
    }
    if has(Operation::Update) {
        out.push("UPDATE");
    }
    out
}

/// `matchConstraints` of an exported policy: the policy's own with operations clipped to
/// CREATE and UPDATE (rules left with none dropped), or, when it has no rules, the workload
/// webhook's.
fn match_constraints(spec: &ServingPolicySpec) -> Value {
    let mut mc = spec
        .match_constraints
        .as_ref()
        .and_then(|m| serde_json::to_value(m).ok())
        .unwrap_or_else(|| json!({}));
    let rules = spec
        .match_constraints
        .as_ref()
        .map(|m| &m.resource_rules[..])
        .unwrap_or_default();
    let clipped: Vec<Value> = if rules.is_empty() {
        vec![
            json!({"apiGroups": ["apps"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["deployments", "statefulsets"]}),
            json!({"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}),
        ]
    } else {
        rules
            .iter()
            .filter_map(|r| {
                let ops = clip_operations(&r.operations);
                if ops.is_empty() {
                    return None;
                }
                let mut v = serde_json::to_value(r).ok()?;
                v["operations"] = json!(ops);
                Some(v)
            })
            .collect()
    };
    mc["resourceRules"] = json!(clipped);
    if mc.get("matchPolicy").is_none() {
        mc["matchPolicy"] = json!("Equivalent");
    }
    mc
}

/// The objects `policy` exports to (in apply order: each policy before its binding), or why it
/// cannot be exported. `runtimes` are the cluster's InferenceRuntimes (the vendor table of
/// [`resolution_expression`]); the bindings skip `skip_namespaces` ([`skipped_namespaces`]).
/// Objects carry the policy's name, the [`EXPORTED_FROM`] label, the `EXPORTED_*` annotations
/// and, when the policy has a `uid`, an owner reference to it (deleting the policy deletes
/// them).
pub fn export(
    policy: &ServingPolicy,
    runtimes: &[InferenceRuntime],
    target: &Target,
    skip_namespaces: &[String],
) -> Result<Vec<Value>, Vec<Reason>> {
    let spec = &policy.spec;
    let name = policy.metadata.name.clone().unwrap_or_default();
    let mut why = reasons(spec, target);
    if !hearth_crds::naming::is_dns1123_subdomain(&name) {
        why.push(Reason {
            field: "metadata.name".to_owned(),
            construct: name.clone(),
            message: "the exported objects are named after the policy, and the apiserver wants a DNS subdomain (lower case, digits, '-' and '.')".to_owned(),
        });
    } else if name.len() > 63 {
        why.push(Reason {
            field: "metadata.name".to_owned(),
            construct: format!("{} characters", name.len()),
            message: format!(
                "the exported objects carry the name in the label {EXPORTED_FROM}, whose values are at most 63 characters: shorten the name"
            ),
        });
    }
    if !why.is_empty() {
        return Err(why);
    }
    let mut annotations = serde_json::Map::new();
    if let Some(uid) = &policy.metadata.uid {
        annotations.insert(EXPORTED_UID.to_owned(), json!(uid));
    }
    annotations.insert(
        EXPORTED_GENERATION.to_owned(),
        json!(policy.metadata.generation.unwrap_or_default().to_string()),
    );
    annotations.insert(
        EXPORTED_RUNTIMES.to_owned(),
        json!(runtimes_digest(runtimes)),
    );
    let mut metadata = json!({
        "name": name,
        "labels": {
            EXPORTED_FROM: name,
            "app.kubernetes.io/managed-by": wellknown::MANAGED_BY,
        },
        "annotations": annotations,
    });
    if let Some(uid) = &policy.metadata.uid {
        metadata["ownerReferences"] = json!([{
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "ServingPolicy",
            "name": name,
            "uid": uid,
        }]);
    }
    let mut conditions = vec![
        json!({"name": SCOPE_CONDITION, "expression": scope_expression()}),
        json!({"name": RUNTIME_CONDITION, "expression": resolution_expression(runtimes)}),
    ];
    conditions.extend(spec.match_conditions.iter().map(|c| json!(c)));
    let common = json!({
        "failurePolicy": spec.failure_policy,
        "paramKind": {"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "InferenceRuntime"},
        "matchConstraints": match_constraints(spec),
        "matchConditions": conditions,
        "variables": spec.variables,
    });
    let binding = json!({
        "policyName": name,
        "paramRef": {"selector": {}, "parameterNotFoundAction": "Allow"},
        "matchResources": {
            "namespaceSelector": {"matchExpressions": [{
                "key": "kubernetes.io/metadata.name",
                "operator": "NotIn",
                "values": skip_namespaces,
            }]},
        },
    });
    let object = |kind: Kind, version: ApiVersion, spec: Value| {
        json!({
            "apiVersion": version.as_str(),
            "kind": kind.as_str(),
            "metadata": metadata,
            "spec": spec,
        })
    };
    let need = needs(spec);
    let mut out = Vec::new();
    if let (true, Some(v)) = (need.validating, target.validating) {
        let mut s = common.clone();
        s["validations"] = json!(
            spec.validations
                .iter()
                .map(|val| {
                    let mut o = json!(val);
                    // Hearth's default reason; the apiserver's would be Invalid.
                    if val.reason.is_none() {
                        o["reason"] = json!(StatusReason::Forbidden);
                    }
                    o
                })
                .collect::<Vec<_>>()
        );
        s["auditAnnotations"] = json!(spec.audit_annotations);
        let mut b = binding.clone();
        b["validationActions"] = if spec.validation_actions.is_empty() {
            json!([ValidationAction::Deny])
        } else {
            json!(spec.validation_actions)
        };
        out.push(object(Kind::ValidatingAdmissionPolicy, v, s));
        out.push(object(Kind::ValidatingAdmissionPolicyBinding, v, b));
    }
    if let (true, Some(v)) = (need.mutating, target.mutating) {
        let mut s = common;
        s["mutations"] = json!(spec.mutations);
        s["reinvocationPolicy"] = json!(spec.reinvocation_policy);
        out.push(object(Kind::MutatingAdmissionPolicy, v, s));
        out.push(object(Kind::MutatingAdmissionPolicyBinding, v, binding));
    }
    Ok(out)
}

/// The metadata the webhook sees of one exported object: its annotations.
pub type Present<'a> = &'a dyn Fn(Kind, &str) -> Option<BTreeMap<String, String>>;

/// Whether the apiserver runs `policy` as exported for `runtimes`: every kind it
/// [`needs`] is `present` under its name, exported from this very policy (uid, when the policy
/// has one, and generation) with the current runtime table ([`of_this_export`]), its bindings
/// marked [`ENFORCED`]. The webhook skips such a policy; when one object goes (or the policy or
/// the runtimes change), it evaluates the policy again.
pub fn is_exported(policy: &ServingPolicy, runtimes_digest: &str, present: Present<'_>) -> bool {
    let name = policy.metadata.name.clone().unwrap_or_default();
    let need = needs(&policy.spec);
    if !need.validating && !need.mutating {
        return false;
    }
    kinds(need).all(|kind| {
        present(kind, &name).is_some_and(|a| {
            of_this_export(&a, policy, runtimes_digest)
                && (!kind.is_binding() || a.get(ENFORCED).map(String::as_str) == Some("true"))
        })
    })
}

/// Whether an exported object's `annotations` say it holds `policy` as it is now (uid, when the
/// policy has one, and generation) with the runtime table `runtimes_digest`.
pub fn of_this_export(
    annotations: &BTreeMap<String, String>,
    policy: &ServingPolicy,
    runtimes_digest: &str,
) -> bool {
    let generation = policy.metadata.generation.unwrap_or_default().to_string();
    annotations.get(EXPORTED_GENERATION) == Some(&generation)
        && annotations.get(EXPORTED_RUNTIMES).map(String::as_str) == Some(runtimes_digest)
        && policy
            .metadata
            .uid
            .as_ref()
            .is_none_or(|uid| annotations.get(EXPORTED_UID) == Some(uid))
}

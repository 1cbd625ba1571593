//! The policy set: compile once, evaluate many.

use std::{
    collections::{BTreeMap, HashMap},
    panic::{AssertUnwindSafe, catch_unwind},
    sync::Arc,
};

use hearth_crds::servingpolicy::{
    FailurePolicy, MatchResources, Operation, PatchType, ReinvocationPolicy, ServingPolicy,
    StatusReason, ValidationAction,
};
use kube_cel::cel::{Context, Value as CelValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::{
    compile::{CompiledExpr, ExprError, compile_expr, variable_ident},
    guard,
    limits::Limits,
    matching, merge,
    value::{cel_to_json, json_to_cel},
};

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
    /// A bound of [`Limits`] was exceeded.
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
}

/// Why [`PolicySet::mutate`] failed: a `Fail` policy could not be evaluated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.iter().map(|e| format!("ServingPolicy '{}' {}: {}", e.policy, e.field, e.message)).collect::<Vec<_>>().join("; "))]
pub struct MutateError(pub Vec<EvalError>);

struct Named {
    name: String,
    field: String,
    expr: CompiledExpr,
}

struct CompiledValidation {
    field: String,
    expr: CompiledExpr,
    message: Option<String>,
    message_expr: Option<(String, CompiledExpr)>,
    reason: StatusReason,
}

struct CompiledMutation {
    field: String,
    patch_type: PatchType,
    expr: CompiledExpr,
}

struct CompiledPolicy {
    name: String,
    failure_policy: FailurePolicy,
    match_constraints: Option<MatchResources>,
    match_conditions: Vec<Named>,
    variables: Vec<Named>,
    validations: Vec<CompiledValidation>,
    actions: Vec<ValidationAction>,
    audit_annotations: Vec<Named>,
    mutations: Vec<CompiledMutation>,
    reinvocation: ReinvocationPolicy,
}

struct Inner {
    policies: Vec<CompiledPolicy>,
    limits: Limits,
}

/// A compiled, immutable set of ServingPolicies. Cloning is an `Arc` bump, so a reloaded set
/// can be swapped in atomically (for example behind an `ArcSwap` or `RwLock<PolicySet>`) while
/// requests keep evaluating the old one. `Send + Sync`.
#[derive(Clone)]
pub struct PolicySet {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PolicySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicySet")
            .field("policies", &self.names())
            .finish()
    }
}

fn compile_policy(p: &ServingPolicy, limits: &Limits) -> Result<CompiledPolicy, PolicyLoadError> {
    let name = p.metadata.name.clone().unwrap_or_default();
    let spec = &p.spec;
    let err = |field: String, error: ExprError| PolicyLoadError {
        policy: name.clone(),
        field,
        error,
    };
    let mut declared: Vec<String> = Vec::new();
    let mut variables = Vec::new();
    for (i, v) in spec.variables.iter().enumerate() {
        let field = format!("spec.variables[{i}].expression");
        let expr =
            compile_expr(&v.expression, limits, &declared).map_err(|e| err(field.clone(), e))?;
        declared.push(v.name.clone());
        variables.push(Named {
            name: v.name.clone(),
            field,
            expr,
        });
    }
    if spec.match_conditions.len() > 64 {
        return Err(err(
            "spec.matchConditions".into(),
            ExprError {
                message: "at most 64 matchConditions are allowed".into(),
                position: None,
            },
        ));
    }
    // matchConditions run before variables (as in the apiserver), so they cannot use them.
    let named = |list: &mut Vec<Named>,
                 items: Vec<(String, String, &str)>,
                 vars: &[String]|
     -> Result<(), PolicyLoadError> {
        for (n, field, src) in items {
            let expr = compile_expr(src, limits, vars).map_err(|e| err(field.clone(), e))?;
            list.push(Named {
                name: n,
                field,
                expr,
            });
        }
        Ok(())
    };
    let mut match_conditions = Vec::new();
    named(
        &mut match_conditions,
        spec.match_conditions
            .iter()
            .enumerate()
            .map(|(i, c)| {
                (
                    c.name.clone(),
                    format!("spec.matchConditions[{i}].expression"),
                    c.expression.as_str(),
                )
            })
            .collect(),
        &[],
    )?;
    let mut audit_annotations = Vec::new();
    named(
        &mut audit_annotations,
        spec.audit_annotations
            .iter()
            .enumerate()
            .map(|(i, a)| {
                (
                    a.key.clone(),
                    format!("spec.auditAnnotations[{i}].valueExpression"),
                    a.value_expression.as_str(),
                )
            })
            .collect(),
        &declared,
    )?;
    let mut validations = Vec::new();
    for (i, v) in spec.validations.iter().enumerate() {
        let field = format!("spec.validations[{i}].expression");
        let expr =
            compile_expr(&v.expression, limits, &declared).map_err(|e| err(field.clone(), e))?;
        let message_expr = match &v.message_expression {
            Some(src) => {
                let f = format!("spec.validations[{i}].messageExpression");
                Some((
                    f.clone(),
                    compile_expr(src, limits, &declared).map_err(|e| err(f, e))?,
                ))
            }
            None => None,
        };
        validations.push(CompiledValidation {
            field,
            expr,
            message: v.message.clone(),
            message_expr,
            reason: v.reason.unwrap_or(StatusReason::Forbidden),
        });
    }
    if spec.validation_actions.contains(&ValidationAction::Deny)
        && spec.validation_actions.contains(&ValidationAction::Warn)
    {
        return Err(err(
            "spec.validationActions".into(),
            ExprError {
                message: "Deny and Warn are exclusive: pick one (Audit combines with either)"
                    .into(),
                position: None,
            },
        ));
    }
    let mut mutations = Vec::new();
    for (i, m) in spec.mutations.iter().enumerate() {
        let (holder, sub) = match m.patch_type {
            PatchType::JsonPatch => (&m.json_patch, "jsonPatch"),
            PatchType::ApplyConfiguration => (&m.apply_configuration, "applyConfiguration"),
        };
        let field = format!("spec.mutations[{i}].{sub}.expression");
        let Some(holder) = holder else {
            return Err(err(
                field,
                ExprError {
                    message: format!("patchType {:?} needs {sub}.expression", m.patch_type),
                    position: None,
                },
            ));
        };
        let expr = compile_expr(&holder.expression, limits, &declared)
            .map_err(|e| err(field.clone(), e))?;
        mutations.push(CompiledMutation {
            field,
            patch_type: m.patch_type,
            expr,
        });
    }
    Ok(CompiledPolicy {
        name,
        failure_policy: spec.failure_policy,
        match_constraints: spec.match_constraints.clone(),
        match_conditions,
        variables,
        validations,
        actions: spec.validation_actions.clone(),
        audit_annotations,
        mutations,
        reinvocation: spec.reinvocation_policy,
    })
}

/// The CEL activation of one policy evaluation.
struct Activation {
    object: CelValue,
    old_object: CelValue,
    request: CelValue,
    namespace_object: CelValue,
    params: CelValue,
    service: CelValue,
}

fn opt_to_cel(v: Option<&Value>) -> CelValue {
    v.map_or(CelValue::Null, |v| {
        stacker::maybe_grow(256 * 1024, 4 << 20, || json_to_cel(v))
    })
}

enum ExprFailure {
    Error(String, ErrorKind),
}

/// Stack the interpreter may use for one request: it recurses per tree level, tens of KiB per
/// level in debug builds. Threads with less headroom (2 MiB test and Tokio threads) evaluate on
/// a fresh segment.
const STACK_RED_ZONE: usize = 6 << 20;
const STACK_SIZE: usize = 16 << 20;

fn with_stack<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(STACK_RED_ZONE, STACK_SIZE, f)
}

fn run(ctx: &Context, expr: &CompiledExpr) -> Result<CelValue, ExprFailure> {
    guard::start_expression();
    match catch_unwind(AssertUnwindSafe(|| CelValue::resolve(&expr.expr, ctx))) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => {
            let kind = if guard::exceeded() {
                ErrorKind::BoundExceeded
            } else {
                ErrorKind::Evaluation
            };
            Err(ExprFailure::Error(e.to_string(), kind))
        }
        Err(_) => Err(ExprFailure::Error(
            "the CEL interpreter cannot evaluate this expression (internal panic)".into(),
            ErrorKind::Evaluation,
        )),
    }
}

/// The context holding the request's fixed variables, over the thread's base context. Values
/// are converted into the interpreter's representation once per request.
fn request_context<'b>(base: &'b Context<'static>, act: &Activation) -> Context<'b> {
    let mut ctx = base.new_inner_scope();
    ctx.add_variable_from_value("oldObject", act.old_object.clone());
    ctx.add_variable_from_value("request", act.request.clone());
    ctx.add_variable_from_value("namespaceObject", act.namespace_object.clone());
    ctx.add_variable_from_value("params", act.params.clone());
    ctx.add_variable_from_value("service", act.service.clone());
    ctx
}

/// The context binding `object` over the request context; rebuilt when a mutation changes it.
fn object_context<'b>(request: &'b Context<'b>, act: &Activation) -> Context<'b> {
    let mut ctx = request.new_inner_scope();
    ctx.add_variable_from_value("object", act.object.clone());
    ctx
}

/// Per-policy evaluation state: which variables failed for the current object.
struct PolicyRun<'p> {
    policy: &'p CompiledPolicy,
    var_errors: HashMap<String, (String, ErrorKind)>,
}

impl<'p> PolicyRun<'p> {
    fn new(policy: &'p CompiledPolicy) -> Self {
        PolicyRun {
            policy,
            var_errors: HashMap::new(),
        }
    }

    /// Evaluates the variables in order into `ctx`. A failing variable fails only the
    /// expressions that use it (the apiserver evaluates variables lazily).
    fn compute_variables(&mut self, ctx: &mut Context) {
        self.var_errors.clear();
        for v in &self.policy.variables {
            let result = match self.failed_dependency(&v.expr) {
                Some(failure) => Err(failure),
                None => run(ctx, &v.expr),
            };
            match result {
                Ok(val) => ctx.add_variable_from_value(variable_ident(&v.name), val),
                Err(ExprFailure::Error(m, k)) => {
                    self.var_errors.insert(v.name.clone(), (m, k));
                }
            }
        }
    }

    fn failed_dependency(&self, expr: &CompiledExpr) -> Option<ExprFailure> {
        let dep = expr
            .uses_variables
            .iter()
            .find(|d| self.var_errors.contains_key(*d))?;
        let (m, k) = &self.var_errors[dep];
        Some(ExprFailure::Error(
            format!("variables.{dep} failed: {m}"),
            *k,
        ))
    }

    fn eval(&self, ctx: &Context, expr: &CompiledExpr) -> Result<CelValue, ExprFailure> {
        match self.failed_dependency(expr) {
            Some(f) => Err(f),
            None => run(ctx, expr),
        }
    }

    fn error(
        &self,
        field: &str,
        expr: &CompiledExpr,
        message: String,
        kind: ErrorKind,
    ) -> EvalError {
        EvalError {
            policy: self.policy.name.clone(),
            field: field.to_owned(),
            expression: expr.source.clone(),
            message,
            kind,
            failure_policy: self.policy.failure_policy,
        }
    }

    /// Runs matchConditions: Ok(true) when all hold.
    fn conditions(&self, ctx: &Context) -> Result<bool, EvalError> {
        for c in &self.policy.match_conditions {
            match self.eval(ctx, &c.expr) {
                Ok(CelValue::Bool(true)) => {}
                Ok(CelValue::Bool(false)) => return Ok(false),
                Ok(other) => {
                    return Err(self.error(
                        &c.field,
                        &c.expr,
                        format!(
                            "matchCondition '{}' must return bool, got {other:?}",
                            c.name
                        ),
                        ErrorKind::WrongType,
                    ));
                }
                Err(ExprFailure::Error(m, k)) => return Err(self.error(&c.field, &c.expr, m, k)),
            }
        }
        Ok(true)
    }
}

fn cel_string(v: &CelValue) -> Option<String> {
    match v {
        CelValue::String(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

impl PolicySet {
    /// Compiles `policies` with [`Limits::default`]. Policies with a bad expression are left
    /// out and reported; the rest form the set.
    pub fn compile(policies: &[ServingPolicy]) -> (PolicySet, Vec<PolicyLoadError>) {
        Self::compile_with_limits(policies, Limits::default())
    }

    /// Compiles `policies` under `limits`.
    pub fn compile_with_limits(
        policies: &[ServingPolicy],
        limits: Limits,
    ) -> (PolicySet, Vec<PolicyLoadError>) {
        let mut ok = Vec::new();
        let mut errors = Vec::new();
        for p in policies {
            match compile_policy(p, &limits) {
                Ok(c) => ok.push(c),
                Err(e) => errors.push(e),
            }
        }
        (
            PolicySet {
                inner: Arc::new(Inner {
                    policies: ok,
                    limits,
                }),
            },
            errors,
        )
    }

    /// Names of the compiled policies, in evaluation order.
    pub fn names(&self) -> Vec<&str> {
        self.inner
            .policies
            .iter()
            .map(|p| p.name.as_str())
            .collect()
    }

    /// The limits this set enforces.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Evaluates an admission request: mutations first (in policy order, with reinvocation),
    /// then validations and audit annotations against the mutated object.
    pub fn evaluate(&self, input: &EvalInput) -> Outcome {
        let _budget = guard::Budget::enter(&self.inner.limits);
        with_stack(|| guard::with_base(|base| self.evaluate_in(base, input, true)))
    }

    /// The controller's render path: runs only the mutations over `input.object` and returns
    /// the mutated object. Idempotent for the built-in policies: a second pass yields an empty
    /// patch. Errors when a `Fail` policy cannot be evaluated.
    pub fn mutate(&self, input: &EvalInput) -> Result<Mutated, MutateError> {
        let _budget = guard::Budget::enter(&self.inner.limits);
        let out = with_stack(|| guard::with_base(|base| self.evaluate_in(base, input, false)));
        let (fail, ignored): (Vec<_>, Vec<_>) = out
            .errors
            .into_iter()
            .partition(|e| e.failure_policy == FailurePolicy::Fail);
        if !fail.is_empty() {
            return Err(MutateError(fail));
        }
        Ok(Mutated {
            object: out.patched_object.unwrap_or(Value::Null),
            patch: out.patch,
            ignored,
        })
    }

    fn evaluate_in(&self, base: &Context<'static>, input: &EvalInput, validate: bool) -> Outcome {
        let mut out = Outcome::default();
        let request_json = serde_json::to_value(&input.request).unwrap_or(Value::Null);
        let mut act = Activation {
            object: opt_to_cel(input.object.as_ref()),
            old_object: opt_to_cel(input.old_object.as_ref()),
            request: json_to_cel(&request_json),
            namespace_object: opt_to_cel(input.namespace_object.as_ref()),
            params: opt_to_cel(input.params.as_ref()),
            service: opt_to_cel(input.service.as_ref()),
        };
        let mut object = input.object.clone();
        let matched: Vec<&CompiledPolicy> = self
            .inner
            .policies
            .iter()
            .filter(|p| {
                matching::matches(
                    p.match_constraints.as_ref(),
                    &input.request,
                    input.object.as_ref(),
                    input.old_object.as_ref(),
                    input.namespace_object.as_ref(),
                )
            })
            .collect();
        out.matched = matched.iter().map(|p| p.name.clone()).collect();

        // Mutations, then one reinvocation round for IfNeeded policies whose output a later
        // policy changed (MutatingAdmissionPolicy semantics).
        let rctx = request_context(base, &act);
        if object.is_some() {
            let mut after: Vec<Option<Value>> = vec![None; matched.len()];
            for (i, p) in matched.iter().enumerate() {
                if p.mutations.is_empty() {
                    continue;
                }
                self.mutate_policy(&rctx, p, &mut act, &mut object, &mut out);
                if p.reinvocation == ReinvocationPolicy::IfNeeded {
                    after[i] = object.clone();
                }
            }
            for (i, p) in matched.iter().enumerate() {
                if p.reinvocation == ReinvocationPolicy::IfNeeded
                    && after[i].is_some()
                    && after[i] != object
                {
                    self.mutate_policy(&rctx, p, &mut act, &mut object, &mut out);
                }
            }
        }

        if validate {
            let actx = object_context(&rctx, &act);
            for p in &matched {
                self.validate_policy(&actx, p, &mut out);
            }
        }
        if let (Some(orig), Some(new)) = (&input.object, &object) {
            out.patch = json_patch::diff(orig, new);
        }
        out.patched_object = object;
        out
    }

    fn mutate_policy(
        &self,
        rctx: &Context,
        p: &CompiledPolicy,
        act: &mut Activation,
        object: &mut Option<Value>,
        out: &mut Outcome,
    ) {
        let mut run = PolicyRun::new(p);
        let mut next_mutation = 0;
        let mut first = true;
        // Contexts are rebuilt only when a mutation changed the object.
        'object: while next_mutation < p.mutations.len() {
            let actx = object_context(rctx, act);
            let mut pctx = actx.new_inner_scope();
            if first {
                first = false;
                match run.conditions(&pctx) {
                    Ok(true) => {}
                    Ok(false) => return,
                    Err(e) => {
                        out.errors.push(e);
                        return;
                    }
                }
            }
            run.compute_variables(&mut pctx);
            while let Some(m) = p.mutations.get(next_mutation) {
                next_mutation += 1;
                let Some(current) = object.as_ref() else {
                    return;
                };
                let result = match run.eval(&pctx, &m.expr) {
                    Ok(v) => v,
                    Err(ExprFailure::Error(msg, kind)) => {
                        out.errors.push(run.error(&m.field, &m.expr, msg, kind));
                        return;
                    }
                };
                let produced = match cel_to_json(&result) {
                    Ok(j) => j,
                    Err(msg) => {
                        out.errors
                            .push(run.error(&m.field, &m.expr, msg, ErrorKind::WrongType));
                        return;
                    }
                };
                // Nothing to apply: skip copying and comparing the object.
                let empty = match &produced {
                    Value::Array(a) => a.is_empty() && m.patch_type == PatchType::JsonPatch,
                    Value::Object(o) => {
                        o.is_empty() && m.patch_type == PatchType::ApplyConfiguration
                    }
                    _ => false,
                };
                if empty {
                    continue;
                }
                let next = match m.patch_type {
                    PatchType::JsonPatch => apply_json_patch(current, produced),
                    PatchType::ApplyConfiguration => apply_configuration(current, &produced),
                };
                match next {
                    Ok(next) if &next != current => {
                        act.object = opt_to_cel(Some(&next));
                        *object = Some(next);
                        continue 'object;
                    }
                    Ok(_) => {}
                    Err((msg, kind)) => {
                        out.errors.push(run.error(&m.field, &m.expr, msg, kind));
                        return;
                    }
                }
            }
        }
    }

    fn validate_policy(&self, actx: &Context, p: &CompiledPolicy, out: &mut Outcome) {
        if p.validations.is_empty() && p.audit_annotations.is_empty() {
            return;
        }
        let mut run = PolicyRun::new(p);
        let mut pctx = actx.new_inner_scope();
        match run.conditions(&pctx) {
            Ok(true) => {}
            Ok(false) => return,
            Err(e) => {
                out.errors.push(e);
                return;
            }
        }
        run.compute_variables(&mut pctx);
        let mut audit_failures = Vec::new();
        for (i, v) in p.validations.iter().enumerate() {
            let passed = match run.eval(&pctx, &v.expr) {
                Ok(CelValue::Bool(b)) => b,
                Ok(other) => {
                    out.errors.push(run.error(
                        &v.field,
                        &v.expr,
                        format!("validation must return bool, got {other:?}"),
                        ErrorKind::WrongType,
                    ));
                    continue;
                }
                Err(ExprFailure::Error(m, k)) => {
                    out.errors.push(run.error(&v.field, &v.expr, m, k));
                    continue;
                }
            };
            if passed {
                continue;
            }
            let message = v
                .message_expr
                .as_ref()
                .and_then(|(_, me)| run.eval(&pctx, me).ok())
                .and_then(|m| cel_string(&m))
                .filter(|m| !m.trim().is_empty())
                .or_else(|| v.message.clone())
                .unwrap_or_else(|| format!("failed expression: {}", v.expr.source));
            for action in &p.actions {
                match action {
                    ValidationAction::Deny => out.denials.push(Denial {
                        policy: p.name.clone(),
                        message: message.clone(),
                        reason: v.reason,
                    }),
                    ValidationAction::Warn => out.warnings.push(format!(
                        "Validation failed for ServingPolicy '{}': {message}",
                        p.name
                    )),
                    ValidationAction::Audit => audit_failures.push(serde_json::json!({
                        "message": message,
                        "policy": p.name,
                        "expressionIndex": i,
                        "validationActions": p.actions,
                    })),
                }
            }
        }
        if !audit_failures.is_empty() {
            let key = "validation.policy.admission.k8s.io/validation_failure".to_owned();
            let mut all: Vec<Value> = out
                .audit_annotations
                .get(&key)
                .and_then(|s| serde_json::from_str(s).ok())
                .unwrap_or_default();
            all.extend(audit_failures);
            out.audit_annotations
                .insert(key, Value::Array(all).to_string());
        }
        for a in &p.audit_annotations {
            match run.eval(&pctx, &a.expr) {
                Ok(CelValue::String(s)) if !s.is_empty() => {
                    out.audit_annotations
                        .insert(format!("{}/{}", p.name, a.name), s.as_str().to_owned());
                }
                Ok(CelValue::String(_)) | Ok(CelValue::Null) => {}
                Ok(other) => out.errors.push(run.error(
                    &a.field,
                    &a.expr,
                    format!("valueExpression must return a string or null, got {other:?}"),
                    ErrorKind::WrongType,
                )),
                Err(ExprFailure::Error(m, k)) => {
                    out.errors.push(run.error(&a.field, &a.expr, m, k))
                }
            }
        }
    }
}

/// Applies CEL-built JSON Patch operations (RFC 6902, atomically): a list of
/// `{op, path, value?, from?}` maps, as `JSONPatch{...}` builds them.
fn apply_json_patch(current: &Value, ops: Value) -> Result<Value, (String, ErrorKind)> {
    let list = match ops {
        Value::Array(a) => a,
        other => {
            return Err((
                format!(
                    "a JSONPatch mutation must return a list of JSONPatch operations, got {other}"
                ),
                ErrorKind::WrongType,
            ));
        }
    };
    let patch: json_patch::Patch = serde_json::from_value(Value::Array(list)).map_err(|e| {
        (
            format!("invalid JSONPatch operation: {e}"),
            ErrorKind::WrongType,
        )
    })?;
    let mut next = current.clone();
    json_patch::patch(&mut next, &patch)
        .map_err(|e| (format!("JSON Patch does not apply: {e}"), ErrorKind::Patch))?;
    keep_identity(current, &next)?;
    Ok(next)
}

fn apply_configuration(current: &Value, partial: &Value) -> Result<Value, (String, ErrorKind)> {
    if !partial.is_object() {
        return Err((
            format!(
                "an ApplyConfiguration mutation must return an object (Object{{...}}), got {partial}"
            ),
            ErrorKind::WrongType,
        ));
    }
    let mut next = current.clone();
    merge::apply(&mut next, partial);
    keep_identity(current, &next)?;
    Ok(next)
}

/// Mutations may not change what the object is (MutatingAdmissionPolicy forbids it too).
fn keep_identity(before: &Value, after: &Value) -> Result<(), (String, ErrorKind)> {
    for p in [
        "/apiVersion",
        "/kind",
        "/metadata/name",
        "/metadata/namespace",
    ] {
        if before.pointer(p) != after.pointer(p) {
            return Err((format!("a mutation may not change {p}"), ErrorKind::Patch));
        }
    }
    Ok(())
}

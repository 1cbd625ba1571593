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
    matching, merge, native,
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
    /// Every expression has a native program.
    native: bool,
    /// Root variables the native programs read (see [`native::REQUEST_ROOT`]).
    roots: u8,
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
    /// Whether native-capable policies run natively (see [`crate::native`]).
    native: bool,
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
    let exprs: Vec<&CompiledExpr> =
        match_conditions
            .iter()
            .chain(&variables)
            .chain(&audit_annotations)
            .map(|n| &n.expr)
            .chain(validations.iter().flat_map(|v| {
                std::iter::once(&v.expr).chain(v.message_expr.as_ref().map(|(_, e)| e))
            }))
            .chain(mutations.iter().map(|m| &m.expr))
            .collect();
    let native = exprs.iter().all(|e| e.native.is_some());
    let roots = exprs
        .iter()
        .filter_map(|e| e.native.as_ref())
        .fold(0, |acc, p| acc | p.roots);
    Ok(CompiledPolicy {
        native,
        roots,
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

/// The request's roots other than `object`, as JSON. Each evaluator reads them its own way:
/// the native one in place, the interpreter after conversion (once per request, on first use).
struct Fixed<'i> {
    old_object: Option<&'i Value>,
    request_info: &'i RequestInfo,
    /// `request` as JSON, serialized on first use.
    request: std::cell::OnceCell<Value>,
    namespace_object: Option<&'i Value>,
    params: Option<&'i Value>,
    service: Option<&'i Value>,
    settings: &'i Value,
}

impl Fixed<'_> {
    fn request(&self) -> &Value {
        self.request
            .get_or_init(|| serde_json::to_value(self.request_info).unwrap_or(Value::Null))
    }

    /// The native environment of policy `p` with `object` bound. Roots the policy never
    /// reads stay null.
    fn native_env<'a>(
        &'a self,
        p: &'a CompiledPolicy,
        object: Option<&'a Value>,
    ) -> native::Env<'a> {
        let v = |o: Option<&'a Value>| o.map_or(native::Val::Null, native::from_json);
        let request = if p.roots & native::REQUEST_ROOT != 0 {
            native::from_json(self.request())
        } else {
            native::Val::Null
        };
        native::Env::new(
            [
                v(object),
                v(self.old_object),
                request,
                v(self.namespace_object),
                v(self.params),
                v(self.service),
                native::from_json(self.settings),
            ],
            p.variables
                .iter()
                .filter_map(|v| Some((v.name.as_str(), v.expr.native.as_deref()?))),
        )
    }
}

/// `settings` when the installation gave none.
static EMPTY_SETTINGS: std::sync::LazyLock<Value> =
    std::sync::LazyLock::new(|| Value::Object(serde_json::Map::new()));

fn opt_to_cel(v: Option<&Value>) -> CelValue {
    v.map_or(CelValue::Null, |v| {
        stacker::maybe_grow(256 * 1024, 4 << 20, || json_to_cel(v))
    })
}

pub(crate) enum ExprFailure {
    Error(String, ErrorKind),
}

/// The native evaluator could not answer: evaluate the policy with the interpreter.
struct Fallback;

thread_local! {
    static FALLBACKS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

fn count_fallback() {
    FALLBACKS.set(FALLBACKS.get() + 1);
}

/// What an expression returned, as far as the engine looks at it.
enum Got {
    Bool(bool),
    Str(String),
    Null,
    /// Any other value, rendered (as JSON where it has that form) for a wrong-type message.
    Other(String),
}

type Evaluated<T> = Result<Result<T, ExprFailure>, Fallback>;

/// One policy's expressions evaluated against one object: by the interpreter or natively.
trait Evaluator<'p> {
    /// Evaluates a matchCondition, validation, message or audit annotation.
    fn eval(&mut self, e: &'p CompiledExpr) -> Evaluated<Got>;
    /// Evaluates a mutation to its JSON result.
    fn eval_json(&mut self, e: &'p CompiledExpr) -> Evaluated<Value>;
    /// Binds policy variable `index` for later expressions (a failure is kept and reported by
    /// the expressions that reach it).
    fn define(&mut self, index: usize, v: &'p Named) -> Result<(), Fallback>;
}

/// Stack the interpreter may use for one request: it recurses per tree level, tens of KiB per
/// level in debug builds. Threads with less headroom (2 MiB test and Tokio threads) evaluate on
/// a fresh segment.
const STACK_RED_ZONE: usize = 6 << 20;
const STACK_SIZE: usize = 16 << 20;

pub(crate) fn with_stack<R>(f: impl FnOnce() -> R) -> R {
    stacker::maybe_grow(STACK_RED_ZONE, STACK_SIZE, f)
}

pub(crate) fn run(ctx: &Context, expr: &CompiledExpr) -> Result<CelValue, ExprFailure> {
    guard::start_expression();
    match catch_unwind(AssertUnwindSafe(|| CelValue::resolve(&expr.expr, ctx))) {
        // A bound stops the expression even where `||`, `&&` or a comprehension absorbed the
        // error (as cel-go's cost limit does).
        Ok(Ok(_)) if guard::exceeded() => Err(ExprFailure::Error(
            kube_cel::cel::ExecutionError::function_error("bounds", guard::last_bound())
                .to_string(),
            ErrorKind::BoundExceeded,
        )),
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

/// The interpreter's context holding the request's fixed variables, over the thread's base
/// context.
fn request_context<'b>(base: &'b Context<'static>, f: &Fixed) -> Context<'b> {
    let mut ctx = base.new_inner_scope();
    ctx.add_variable_from_value("oldObject", opt_to_cel(f.old_object));
    ctx.add_variable_from_value("request", json_to_cel(f.request()));
    ctx.add_variable_from_value("namespaceObject", opt_to_cel(f.namespace_object));
    ctx.add_variable_from_value("params", opt_to_cel(f.params));
    ctx.add_variable_from_value("service", opt_to_cel(f.service));
    ctx.add_variable_from_value("settings", json_to_cel(f.settings));
    ctx
}

/// The interpreter evaluating one policy: `object` and the policy variables over the request
/// context. Variables are evaluated in order; a failed one is left unbound, so an expression
/// that reaches it fails with its error, and one that does not is unaffected.
struct CelEval<'c> {
    ctx: Context<'c>,
    /// Failed variables by context identifier: (name, message, kind).
    failed: HashMap<String, (String, String, ErrorKind)>,
}

impl<'c> CelEval<'c> {
    fn new(request: &'c Context<'c>, object: Option<&Value>) -> Self {
        let mut ctx = request.new_inner_scope();
        ctx.add_variable_from_value("object", opt_to_cel(object));
        CelEval {
            ctx,
            failed: HashMap::new(),
        }
    }

    /// A scope over this one for another policy's variables.
    fn scope(&self) -> CelEval<'_> {
        CelEval {
            ctx: self.ctx.new_inner_scope(),
            failed: HashMap::new(),
        }
    }

    fn run(&self, e: &CompiledExpr) -> Result<CelValue, ExprFailure> {
        run(&self.ctx, e).map_err(|ExprFailure::Error(m, k)| {
            // The unbound variable is named in the error, or, as an argument of a function
            // call, the interpreter only says an argument is missing.
            let reached = m
                .strip_prefix("Undeclared reference to '")
                .and_then(|r| r.strip_suffix('\''))
                .and_then(|ident| self.failed.get(ident))
                .or_else(|| {
                    (m == kube_cel::cel::ExecutionError::MissingArgumentOrTarget.to_string())
                        .then(|| {
                            e.uses_variables
                                .iter()
                                .find_map(|n| self.failed.get(&variable_ident(n)))
                        })
                        .flatten()
                });
            match reached {
                Some((name, message, kind)) => {
                    ExprFailure::Error(format!("variables.{name} failed: {message}"), *kind)
                }
                None => ExprFailure::Error(m, k),
            }
        })
    }
}

impl<'p> Evaluator<'p> for CelEval<'_> {
    fn eval(&mut self, e: &'p CompiledExpr) -> Evaluated<Got> {
        Ok(self.run(e).map(|v| match v {
            CelValue::Bool(b) => Got::Bool(b),
            CelValue::String(s) => Got::Str(s.as_str().to_owned()),
            CelValue::Null => Got::Null,
            other => Got::Other(
                cel_to_json(&other).map_or_else(|_| format!("{other:?}"), |j| j.to_string()),
            ),
        }))
    }

    fn eval_json(&mut self, e: &'p CompiledExpr) -> Evaluated<Value> {
        Ok(self
            .run(e)
            .and_then(|v| cel_to_json(&v).map_err(|m| ExprFailure::Error(m, ErrorKind::WrongType))))
    }

    fn define(&mut self, _index: usize, v: &'p Named) -> Result<(), Fallback> {
        let ident = variable_ident(&v.name);
        match self.run(&v.expr) {
            Ok(val) => self.ctx.add_variable_from_value(ident, val),
            Err(ExprFailure::Error(m, k)) => {
                self.failed.insert(ident, (v.name.clone(), m, k));
            }
        }
        Ok(())
    }
}

/// The native evaluator over one policy; falls back on anything it does not answer.
struct NativeEval<'a> {
    env: native::Env<'a>,
}

impl<'a> NativeEval<'a> {
    fn run(&mut self, e: &'a CompiledExpr) -> Evaluated<native::Val<'a>> {
        let program = e.native.as_deref().ok_or(Fallback)?;
        // A defect in the native evaluator must not take the request down: the interpreter
        // evaluates the policy instead.
        let env = &mut self.env;
        let result = catch_unwind(AssertUnwindSafe(|| env.run(program)))
            .unwrap_or(Err(native::Failure::Fallback));
        match result {
            Ok(v) => Ok(Ok(v)),
            Err(native::Failure::Bound(m)) => {
                Ok(Err(ExprFailure::Error(m, ErrorKind::BoundExceeded)))
            }
            Err(native::Failure::Fallback) => Err(Fallback),
        }
    }
}

impl<'p: 'a, 'a> Evaluator<'p> for NativeEval<'a> {
    fn eval(&mut self, e: &'p CompiledExpr) -> Evaluated<Got> {
        Ok(match self.run(e)? {
            Ok(native::Val::Bool(b)) => Ok(Got::Bool(b)),
            Ok(native::Val::Null) => Ok(Got::Null),
            Ok(v @ native::Val::Str(_)) => match v.to_json() {
                Ok(Value::String(s)) => Ok(Got::Str(s)),
                _ => return Err(Fallback),
            },
            // The interpreter words the wrong-type error.
            Ok(_) => return Err(Fallback),
            Err(f) => Err(f),
        })
    }

    fn eval_json(&mut self, e: &'p CompiledExpr) -> Evaluated<Value> {
        Ok(match self.run(e)? {
            Ok(v) => Ok(v.to_json().map_err(|_| Fallback)?),
            Err(f) => Err(f),
        })
    }

    /// Native variables are evaluated on first use (see [`native::Env`]).
    fn define(&mut self, _index: usize, v: &'p Named) -> Result<(), Fallback> {
        v.expr.native.as_ref().ok_or(Fallback)?;
        Ok(())
    }
}

/// One policy's evaluation against one object.
struct PolicyRun<'p> {
    policy: &'p CompiledPolicy,
}

impl<'p> PolicyRun<'p> {
    fn new(policy: &'p CompiledPolicy) -> Self {
        PolicyRun { policy }
    }

    /// Binds the variables in order. A failing variable fails only the expressions that reach
    /// it when they run, as with the apiserver's lazily evaluated variables.
    fn compute_variables<E: Evaluator<'p>>(&mut self, ev: &mut E) -> Result<(), Fallback> {
        for (i, v) in self.policy.variables.iter().enumerate() {
            ev.define(i, v)?;
        }
        Ok(())
    }

    fn eval<E: Evaluator<'p>>(&self, ev: &mut E, expr: &'p CompiledExpr) -> Evaluated<Got> {
        ev.eval(expr)
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
    fn conditions<E: Evaluator<'p>>(
        &self,
        ev: &mut E,
    ) -> Result<Result<bool, EvalError>, Fallback> {
        for c in &self.policy.match_conditions {
            match self.eval(ev, &c.expr)? {
                Ok(Got::Bool(true)) => {}
                Ok(Got::Bool(false)) => return Ok(Ok(false)),
                Ok(other) => {
                    return Ok(Err(self.error(
                        &c.field,
                        &c.expr,
                        format!(
                            "matchCondition '{}' must return bool, got {}",
                            c.name,
                            other.describe()
                        ),
                        ErrorKind::WrongType,
                    )));
                }
                Err(ExprFailure::Error(m, k)) => {
                    return Ok(Err(self.error(&c.field, &c.expr, m, k)));
                }
            }
        }
        Ok(Ok(true))
    }

    /// One pass of the mutations from `*next` over `current`: stops at the first one with
    /// something to apply (the caller applies it and calls again), or at a failure.
    fn mutation_pass<E: Evaluator<'p>>(
        &mut self,
        ev: &mut E,
        next: &mut usize,
        first: bool,
    ) -> Result<Pass<'p>, Fallback> {
        if first {
            match self.conditions(ev)? {
                Ok(true) => {}
                Ok(false) => return Ok(Pass::Done),
                Err(e) => return Ok(Pass::Failed(e)),
            }
        }
        self.compute_variables(ev)?;
        let p = self.policy;
        while let Some(m) = p.mutations.get(*next) {
            *next += 1;
            let produced = ev.eval_json(&m.expr)?;
            let produced = match produced {
                Ok(v) => v,
                Err(ExprFailure::Error(msg, kind)) => {
                    return Ok(Pass::Failed(self.error(&m.field, &m.expr, msg, kind)));
                }
            };
            // Nothing to apply: the object and the variables stay as they are.
            let empty = match &produced {
                Value::Array(a) => a.is_empty() && m.patch_type == PatchType::JsonPatch,
                Value::Object(o) => o.is_empty() && m.patch_type == PatchType::ApplyConfiguration,
                _ => false,
            };
            if !empty {
                return Ok(Pass::Apply(m, produced));
            }
        }
        Ok(Pass::Done)
    }

    /// Validations and audit annotations of the policy, into `out`.
    fn validate<E: Evaluator<'p>>(
        &mut self,
        ev: &mut E,
        out: &mut Outcome,
    ) -> Result<(), Fallback> {
        let p = self.policy;
        match self.conditions(ev)? {
            Ok(true) => {}
            Ok(false) => return Ok(()),
            Err(e) => {
                out.errors.push(e);
                return Ok(());
            }
        }
        self.compute_variables(ev)?;
        let mut audit_failures = Vec::new();
        for (i, v) in p.validations.iter().enumerate() {
            let passed = match self.eval(ev, &v.expr)? {
                Ok(Got::Bool(b)) => b,
                Ok(other) => {
                    out.errors.push(self.error(
                        &v.field,
                        &v.expr,
                        format!("validation must return bool, got {}", other.describe()),
                        ErrorKind::WrongType,
                    ));
                    continue;
                }
                Err(ExprFailure::Error(m, k)) => {
                    out.errors.push(self.error(&v.field, &v.expr, m, k));
                    continue;
                }
            };
            if passed {
                continue;
            }
            let from_expression = match &v.message_expr {
                Some((_, me)) => match self.eval(ev, me)? {
                    Ok(Got::Str(m)) if !m.trim().is_empty() => Some(m),
                    _ => None,
                },
                None => None,
            };
            let message = from_expression
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
            out.audit_annotations.insert(
                VALIDATION_FAILURE.to_owned(),
                Value::Array(audit_failures).to_string(),
            );
        }
        for a in &p.audit_annotations {
            match self.eval(ev, &a.expr)? {
                Ok(Got::Str(s)) if !s.is_empty() => {
                    out.audit_annotations
                        .insert(format!("{}/{}", p.name, a.name), s);
                }
                Ok(Got::Str(_)) | Ok(Got::Null) => {}
                Ok(other) => out.errors.push(self.error(
                    &a.field,
                    &a.expr,
                    format!(
                        "valueExpression must return a string or null, got {}",
                        other.describe()
                    ),
                    ErrorKind::WrongType,
                )),
                Err(ExprFailure::Error(m, k)) => {
                    out.errors.push(self.error(&a.field, &a.expr, m, k))
                }
            }
        }
        Ok(())
    }
}

impl Got {
    /// The value as JSON (stable key order), or the interpreter's rendering when it has none.
    fn describe(&self) -> String {
        match self {
            Got::Bool(b) => b.to_string(),
            Got::Str(s) => Value::String(s.clone()).to_string(),
            Got::Null => "null".into(),
            Got::Other(s) => s.clone(),
        }
    }
}

/// How a pass of a policy's mutations ended.
enum Pass<'p> {
    /// Nothing (more) to apply.
    Done,
    /// A mutation's result to apply; then rebind the object and continue.
    Apply(&'p CompiledMutation, Value),
    /// A mutation failed: the policy stops here, keeping the changes made so far.
    Failed(EvalError),
}

/// The audit annotation collecting failed `Audit` validations (KEP-3488).
const VALIDATION_FAILURE: &str = "validation.policy.admission.k8s.io/validation_failure";

/// Adds one policy's validation results to the request's outcome. Failed `Audit` validations
/// of all policies are collected in one JSON list.
fn merge(out: &mut Outcome, local: Outcome) {
    out.denials.extend(local.denials);
    out.warnings.extend(local.warnings);
    out.errors.extend(local.errors);
    for (k, v) in local.audit_annotations {
        if k == VALIDATION_FAILURE
            && let Some(previous) = out.audit_annotations.get(&k)
        {
            let mut all: Vec<Value> = serde_json::from_str(previous).unwrap_or_default();
            all.extend(serde_json::from_str::<Vec<Value>>(&v).unwrap_or_default());
            out.audit_annotations
                .insert(k, Value::Array(all).to_string());
        } else {
            out.audit_annotations.insert(k, v);
        }
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
                native: true,
            },
            errors,
        )
    }

    /// The same set evaluated by the `cel` interpreter only, without the native evaluator.
    /// Outcomes are the same (the differential tests compare them); for comparisons and
    /// benchmarks.
    pub fn interpreted(&self) -> PolicySet {
        PolicySet {
            inner: self.inner.clone(),
            native: false,
        }
    }

    /// Names of the compiled policies, in evaluation order.
    pub fn names(&self) -> Vec<&str> {
        self.inner
            .policies
            .iter()
            .map(|p| p.name.as_str())
            .collect()
    }

    /// Names of the policies the native evaluator runs (the rest use the interpreter
    /// throughout, see [`crate::native`]).
    pub fn native_policies(&self) -> Vec<&str> {
        self.inner
            .policies
            .iter()
            .filter(|p| p.native)
            .map(|p| p.name.as_str())
            .collect()
    }

    /// How many times, on this thread, a policy the native evaluator runs was handed to the
    /// interpreter instead (an evaluation error, or a value it does not handle). For tests and
    /// benchmarks: well-formed workloads under the shipped policies cause none.
    pub fn native_fallbacks() -> u64 {
        FALLBACKS.get()
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
        let fixed = Fixed {
            old_object: input.old_object.as_ref(),
            request_info: &input.request,
            request: std::cell::OnceCell::new(),
            namespace_object: input.namespace_object.as_ref(),
            params: input.params.as_ref(),
            service: input.service.as_ref(),
            settings: input.settings.as_ref().unwrap_or(&EMPTY_SETTINGS),
        };
        // The interpreter's request context, built only when a policy needs it.
        let cel = std::cell::OnceCell::new();
        let rctx = || cel.get_or_init(|| request_context(base, &fixed));
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
        let mut changed = false;
        if let Some(obj) = object.as_mut() {
            let mut after: Vec<Option<Value>> = vec![None; matched.len()];
            for (i, p) in matched.iter().enumerate() {
                if p.mutations.is_empty() {
                    continue;
                }
                changed |= self.mutate_policy(&rctx, &fixed, p, obj, &mut out);
                if p.reinvocation == ReinvocationPolicy::IfNeeded {
                    after[i] = Some(obj.clone());
                }
            }
            for (i, p) in matched.iter().enumerate() {
                if p.reinvocation == ReinvocationPolicy::IfNeeded
                    && after[i].as_ref().is_some_and(|a| a != obj)
                {
                    changed |= self.mutate_policy(&rctx, &fixed, p, obj, &mut out);
                }
            }
        }

        if validate {
            let mut interpreted: Option<CelEval> = None;
            for p in &matched {
                if p.validations.is_empty() && p.audit_annotations.is_empty() {
                    continue;
                }
                let mut local = Outcome::default();
                let budget = guard::request_left();
                let native = self.native && p.native && {
                    let mut ev = NativeEval {
                        env: fixed.native_env(p, object.as_ref()),
                    };
                    PolicyRun::new(p).validate(&mut ev, &mut local).is_ok()
                };
                if !native {
                    if self.native && p.native {
                        count_fallback();
                        guard::refund_request(budget);
                    }
                    local = Outcome::default();
                    let ev =
                        interpreted.get_or_insert_with(|| CelEval::new(rctx(), object.as_ref()));
                    // Each policy's variables in a scope of their own.
                    let mut scoped = ev.scope();
                    let _ = PolicyRun::new(p).validate(&mut scoped, &mut local);
                }
                merge(&mut out, local);
            }
        }
        if changed && let (Some(orig), Some(new)) = (&input.object, &object) {
            out.patch = json_patch::diff(orig, new);
        }
        out.patched_object = object;
        out
    }

    /// Runs one policy's mutations over `object`, natively when it can, else with the
    /// interpreter from the same starting object. Returns whether the object changed.
    fn mutate_policy<'c>(
        &self,
        rctx: &impl Fn() -> &'c Context<'c>,
        fixed: &Fixed,
        p: &CompiledPolicy,
        object: &mut Value,
        out: &mut Outcome,
    ) -> bool {
        if self.native && p.native {
            // A fallback after an applied mutation restarts from the original object; with one
            // mutation nothing is applied before the last evaluation, so no copy is needed.
            let backup = (p.mutations.len() > 1).then(|| object.clone());
            let budget = guard::request_left();
            let result = mutate_passes(p, object, |run, current, next, first| {
                let mut ev = NativeEval {
                    env: fixed.native_env(p, Some(current)),
                };
                run.mutation_pass(&mut ev, next, first)
            });
            match result {
                Ok((changed, error)) => {
                    out.errors.extend(error);
                    return changed;
                }
                Err(Fallback) => {
                    count_fallback();
                    guard::refund_request(budget);
                    if let Some(b) = backup {
                        *object = b;
                    }
                }
            }
        }
        let request = rctx();
        let (changed, error) = mutate_passes(p, object, |run, current, next, first| {
            let mut ev = CelEval::new(request, Some(current));
            run.mutation_pass(&mut ev, next, first)
        })
        .unwrap_or((false, None));
        out.errors.extend(error);
        changed
    }
}

/// Runs a policy's mutation passes over `object`, applying each result in place, until none
/// is left: returns whether anything was applied and the error that stopped the policy.
fn mutate_passes<'p>(
    p: &'p CompiledPolicy,
    object: &mut Value,
    mut pass: impl FnMut(&mut PolicyRun<'p>, &Value, &mut usize, bool) -> Result<Pass<'p>, Fallback>,
) -> Result<(bool, Option<EvalError>), Fallback> {
    let mut run = PolicyRun::new(p);
    let mut changed = false;
    let mut next = 0;
    let mut first = true;
    while next < p.mutations.len() {
        match pass(&mut run, object, &mut next, first)? {
            Pass::Done => break,
            Pass::Apply(m, produced) => {
                if let Err((msg, kind)) = apply_mutation(object, m.patch_type, produced) {
                    return Ok((changed, Some(run.error(&m.field, &m.expr, msg, kind))));
                }
                changed = true;
            }
            Pass::Failed(e) => return Ok((changed, Some(e))),
        }
        first = false;
    }
    Ok((changed, None))
}

/// The fields a mutation may not change (MutatingAdmissionPolicy forbids it too).
const IDENTITY: [&str; 4] = [
    "/apiVersion",
    "/kind",
    "/metadata/name",
    "/metadata/namespace",
];

/// Whether writing at JSON pointer `path` can change an identity field.
fn touches_identity(path: &str) -> bool {
    IDENTITY.iter().any(|id| {
        id.strip_prefix(path)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    })
}

/// Applies one mutation's result to `object` in place. On error `object` is unchanged.
fn apply_mutation(
    object: &mut Value,
    patch_type: PatchType,
    produced: Value,
) -> Result<(), (String, ErrorKind)> {
    // Results that may touch the identity are applied to a copy and checked; the rest in place
    // (JSON Patch application is atomic, the merge cannot fail).
    match patch_type {
        PatchType::JsonPatch => {
            let patch = json_patch_of(produced)?;
            let risky = patch.iter().any(|op| {
                use json_patch::PatchOperation::*;
                match op {
                    Move(m) => {
                        touches_identity(m.from.as_str()) || touches_identity(m.path.as_str())
                    }
                    Add(o) => touches_identity(o.path.as_str()),
                    Remove(o) => touches_identity(o.path.as_str()),
                    Replace(o) => touches_identity(o.path.as_str()),
                    Copy(o) => touches_identity(o.path.as_str()),
                    Test(_) => false,
                }
            });
            if risky {
                let next = apply_json_patch(object, patch)?;
                *object = next;
            } else {
                json_patch::patch(object, &patch)
                    .map_err(|e| (format!("JSON Patch does not apply: {e}"), ErrorKind::Patch))?;
            }
        }
        PatchType::ApplyConfiguration => {
            let risky = produced.get("apiVersion").is_some()
                || produced.get("kind").is_some()
                || produced.get("metadata").is_some_and(|m| {
                    !m.is_object() || m.get("name").is_some() || m.get("namespace").is_some()
                });
            if risky {
                let next = apply_configuration(object, &produced)?;
                *object = next;
            } else {
                if !produced.is_object() {
                    return Err(wrong_apply_configuration(&produced));
                }
                merge::apply(object, &produced);
            }
        }
    }
    Ok(())
}

/// The RFC 6902 operations of a JSONPatch mutation's result: a list of
/// `{op, path, value?, from?}` maps, as `JSONPatch{...}` builds them.
fn json_patch_of(ops: Value) -> Result<json_patch::Patch, (String, ErrorKind)> {
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
    Ok(json_patch::Patch(
        list.into_iter()
            .map(patch_operation)
            .collect::<Result<_, _>>()
            .map_err(|e| {
                (
                    format!("invalid JSONPatch operation: {e}"),
                    ErrorKind::WrongType,
                )
            })?,
    ))
}

/// Applies a JSON Patch (atomically) to a copy of `current` and checks the identity.
fn apply_json_patch(
    current: &Value,
    patch: json_patch::Patch,
) -> Result<Value, (String, ErrorKind)> {
    let mut next = current.clone();
    json_patch::patch(&mut next, &patch)
        .map_err(|e| (format!("JSON Patch does not apply: {e}"), ErrorKind::Patch))?;
    keep_identity(current, &next)?;
    Ok(next)
}

/// One RFC 6902 operation from the map `JSONPatch{op, path, value?, from?}` builds.
fn patch_operation(op: Value) -> Result<json_patch::PatchOperation, String> {
    use json_patch::{jsonptr::PointerBuf, *};
    let Value::Object(mut m) = op else {
        return Err(format!("expected a JSONPatch object, got {op}"));
    };
    fn pointer(m: &mut serde_json::Map<String, Value>, field: &str) -> Result<PointerBuf, String> {
        match m.remove(field) {
            Some(Value::String(s)) => PointerBuf::parse(s).map_err(|e| format!("{field}: {e}")),
            Some(other) => Err(format!("{field} must be a string, got {other}")),
            None => Err(format!("missing field `{field}`")),
        }
    }
    let name = match m.remove("op") {
        Some(Value::String(s)) => s,
        _ => return Err("missing field `op`".into()),
    };
    let path = pointer(&mut m, "path")?;
    let from = (name == "move" || name == "copy")
        .then(|| pointer(&mut m, "from"))
        .transpose()?;
    let mut value = || m.remove("value").ok_or("missing field `value`");
    Ok(match (name.as_str(), from) {
        ("add", _) => PatchOperation::Add(AddOperation {
            path,
            value: value()?,
        }),
        ("remove", _) => PatchOperation::Remove(RemoveOperation { path }),
        ("replace", _) => PatchOperation::Replace(ReplaceOperation {
            path,
            value: value()?,
        }),
        ("test", _) => PatchOperation::Test(TestOperation {
            path,
            value: value()?,
        }),
        ("move", Some(from)) => PatchOperation::Move(MoveOperation { from, path }),
        ("copy", Some(from)) => PatchOperation::Copy(CopyOperation { from, path }),
        (other, _) => {
            return Err(format!(
                "unknown op `{other}`, expected one of add, remove, replace, move, copy, test"
            ));
        }
    })
}

fn wrong_apply_configuration(partial: &Value) -> (String, ErrorKind) {
    (
        format!(
            "an ApplyConfiguration mutation must return an object (Object{{...}}), got {partial}"
        ),
        ErrorKind::WrongType,
    )
}

fn apply_configuration(current: &Value, partial: &Value) -> Result<Value, (String, ErrorKind)> {
    if !partial.is_object() {
        return Err(wrong_apply_configuration(partial));
    }
    let mut next = current.clone();
    merge::apply(&mut next, partial);
    keep_identity(current, &next)?;
    Ok(next)
}

/// Mutations may not change what the object is (MutatingAdmissionPolicy forbids it too).
fn keep_identity(before: &Value, after: &Value) -> Result<(), (String, ErrorKind)> {
    for p in IDENTITY {
        if before.pointer(p) != after.pointer(p) {
            return Err((format!("a mutation may not change {p}"), ErrorKind::Patch));
        }
    }
    Ok(())
}

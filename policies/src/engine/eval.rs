//! Evaluating one policy against one object, by the native evaluator or by the interpreter.

use std::{
    collections::HashMap,
    panic::{AssertUnwindSafe, catch_unwind},
};

use hearth_crds::servingpolicy::{FailurePolicy, PatchType, ValidationAction};
use kube_cel::cel::{Context, Value as CelValue};
use serde_json::Value;

use crate::{
    compile::{CompiledExpr, variable_ident},
    fallback, guard, native,
    value::{cel_to_json, json_to_cel},
};

use super::compile::{CompiledMutation, CompiledPolicy, Named};
use super::types::{Denial, ErrorKind, EvalError, Outcome, Phase, RequestInfo, ValidationFailure};

/// The request's roots other than `object`, as JSON. Each evaluator reads them its own way:
/// the native one in place, the interpreter after conversion (once per request, on first use).
pub(super) struct Fixed<'i> {
    pub(super) old_object: Option<&'i Value>,
    pub(super) request_info: &'i RequestInfo,
    /// `request` as JSON, serialized on first use.
    pub(super) request: std::cell::OnceCell<Value>,
    pub(super) namespace_object: Option<&'i Value>,
    pub(super) params: Option<&'i Value>,
    pub(super) service: Option<&'i Value>,
    pub(super) settings: &'i Value,
}

impl Fixed<'_> {
    pub(super) fn request(&self) -> &Value {
        self.request
            .get_or_init(|| serde_json::to_value(self.request_info).unwrap_or(Value::Null))
    }

    /// The native environment of policy `p` with `object` bound. Roots the policy never
    /// reads stay null.
    pub(super) fn native_env<'a>(
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
pub(super) static EMPTY_SETTINGS: std::sync::LazyLock<Value> =
    std::sync::LazyLock::new(|| Value::Object(serde_json::Map::new()));

pub(super) fn opt_to_cel(v: Option<&Value>) -> CelValue {
    v.map_or(CelValue::Null, |v| {
        stacker::maybe_grow(256 * 1024, 4 << 20, || json_to_cel(v))
    })
}

pub(crate) enum ExprFailure {
    Error(String, ErrorKind),
}

/// The native evaluator could not answer: evaluate the policy with the interpreter.
pub(super) struct Fallback {
    /// Why it could not.
    pub(super) reason: fallback::Reason,
    /// The source of the expression it stopped at.
    pub(super) expression: String,
}

impl Fallback {
    fn unsupported(e: &CompiledExpr) -> Self {
        Fallback {
            reason: fallback::Reason::Unsupported,
            expression: e.source.clone(),
        }
    }

    /// Records the fallback of policy `policy` (see [`crate::fallback`]).
    pub(super) fn record(&self, policy: &str) {
        fallback::record(policy, &self.expression, self.reason);
    }
}

/// What an expression returned, as far as the engine looks at it.
pub(super) enum Got {
    Bool(bool),
    Str(String),
    Null,
    /// Any other value, rendered (as JSON where it has that form) for a wrong-type message.
    Other(String),
}

pub(super) type Evaluated<T> = Result<Result<T, ExprFailure>, Fallback>;

/// One policy's expressions evaluated against one object: by the interpreter or natively.
pub(super) trait Evaluator<'p> {
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
pub(super) const STACK_RED_ZONE: usize = 6 << 20;
pub(super) const STACK_SIZE: usize = 16 << 20;

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
pub(super) fn request_context<'b>(base: &'b Context<'static>, f: &Fixed) -> Context<'b> {
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
pub(super) struct CelEval<'c> {
    pub(super) ctx: Context<'c>,
    /// Failed variables by context identifier: (name, message, kind).
    pub(super) failed: HashMap<String, (String, String, ErrorKind)>,
}

impl<'c> CelEval<'c> {
    pub(super) fn new(request: &'c Context<'c>, object: Option<&Value>) -> Self {
        let mut ctx = request.new_inner_scope();
        ctx.add_variable_from_value("object", opt_to_cel(object));
        CelEval {
            ctx,
            failed: HashMap::new(),
        }
    }

    /// A scope over this one for another policy's variables.
    pub(super) fn scope(&self) -> CelEval<'_> {
        CelEval {
            ctx: self.ctx.new_inner_scope(),
            failed: HashMap::new(),
        }
    }

    pub(super) fn run(&self, e: &CompiledExpr) -> Result<CelValue, ExprFailure> {
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
pub(super) struct NativeEval<'a> {
    pub(super) env: native::Env<'a>,
}

impl<'a> NativeEval<'a> {
    pub(super) fn run(&mut self, e: &'a CompiledExpr) -> Evaluated<native::Val<'a>> {
        let program = e
            .native
            .as_deref()
            .ok_or_else(|| Fallback::unsupported(e))?;
        // A defect in the native evaluator must not take the request down: the interpreter
        // evaluates the policy instead.
        let env = &mut self.env;
        let result = catch_unwind(AssertUnwindSafe(|| env.run(program))).map_err(|_| Fallback {
            reason: fallback::Reason::Panic,
            expression: e.source.clone(),
        })?;
        match result {
            Ok(v) => Ok(Ok(v)),
            Err(native::Failure::Bound(m)) => {
                Ok(Err(ExprFailure::Error(m, ErrorKind::BoundExceeded)))
            }
            Err(native::Failure::Fallback) => Err(Fallback::unsupported(e)),
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
                _ => return Err(Fallback::unsupported(e)),
            },
            // The interpreter words the wrong-type error.
            Ok(_) => return Err(Fallback::unsupported(e)),
            Err(f) => Err(f),
        })
    }

    fn eval_json(&mut self, e: &'p CompiledExpr) -> Evaluated<Value> {
        Ok(match self.run(e)? {
            Ok(v) => Ok(v.to_json().map_err(|_| Fallback::unsupported(e))?),
            Err(f) => Err(f),
        })
    }

    /// Native variables are evaluated on first use (see [`native::Env`]).
    fn define(&mut self, _index: usize, v: &'p Named) -> Result<(), Fallback> {
        v.expr
            .native
            .as_ref()
            .ok_or_else(|| Fallback::unsupported(&v.expr))?;
        Ok(())
    }
}

/// One policy's evaluation against one object.
pub(super) struct PolicyRun<'p> {
    pub(super) policy: &'p CompiledPolicy,
    /// The part of the policy this run is for (the phase of its errors).
    phase: Phase,
}

impl<'p> PolicyRun<'p> {
    pub(super) fn new(policy: &'p CompiledPolicy, phase: Phase) -> Self {
        PolicyRun { policy, phase }
    }

    /// Binds the variables in order. A failing variable fails only the expressions that reach
    /// it when they run, as with the apiserver's lazily evaluated variables.
    pub(super) fn compute_variables<E: Evaluator<'p>>(
        &mut self,
        ev: &mut E,
    ) -> Result<(), Fallback> {
        for (i, v) in self.policy.variables.iter().enumerate() {
            ev.define(i, v)?;
        }
        Ok(())
    }

    pub(super) fn eval<E: Evaluator<'p>>(
        &self,
        ev: &mut E,
        expr: &'p CompiledExpr,
    ) -> Evaluated<Got> {
        ev.eval(expr)
    }

    pub(super) fn error(
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
            phase: self.phase,
        }
    }

    /// Runs matchConditions: Ok(true) when all hold.
    pub(super) fn conditions<E: Evaluator<'p>>(
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
    pub(super) fn mutation_pass<E: Evaluator<'p>>(
        &mut self,
        ev: &mut E,
        next: &mut usize,
        first: bool,
    ) -> Result<Pass<'p>, Fallback> {
        if first {
            match self.conditions(ev)? {
                Ok(true) => {}
                Ok(false) => return Ok(Pass::Unmatched),
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
    pub(super) fn validate<E: Evaluator<'p>>(
        &mut self,
        ev: &mut E,
        out: &mut Outcome,
    ) -> Result<(), Fallback> {
        let p = self.policy;
        match self.conditions(ev)? {
            Ok(true) => {}
            Ok(false) => {
                out.validations_unmatched.push(p.name.clone());
                return Ok(());
            }
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
            out.validation_failures.push(ValidationFailure {
                policy: p.name.clone(),
                message: message.clone(),
                actions: p.actions.clone(),
            });
            for action in &p.actions {
                match action {
                    ValidationAction::Deny => out.denials.push(Denial {
                        policy: p.name.clone(),
                        message: message.clone(),
                        reason: v.reason,
                    }),
                    ValidationAction::Warn => {
                        out.warnings.push(validation_warning(&p.name, &message))
                    }
                    ValidationAction::Audit => audit_failures.push(serde_json::json!({
                        "message": message,
                        "policy": p.name,
                        "expressionIndex": i,
                        "validationActions": p.actions,
                    })),
                }
            }
        }
        append_validation_failures(&mut out.audit_annotations, audit_failures);
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
    pub(super) fn describe(&self) -> String {
        match self {
            Got::Bool(b) => b.to_string(),
            Got::Str(s) => Value::String(s.clone()).to_string(),
            Got::Null => "null".into(),
            Got::Other(s) => s.clone(),
        }
    }
}

/// How a pass of a policy's mutations ended.
pub(super) enum Pass<'p> {
    /// Nothing (more) to apply.
    Done,
    /// The policy's `matchConditions` are false: its mutations do not run.
    Unmatched,
    /// A mutation's result to apply; then rebind the object and continue.
    Apply(&'p CompiledMutation, Value),
    /// A mutation failed: the policy stops here, keeping the changes made so far.
    Failed(EvalError),
}

/// The audit annotation collecting failed `Audit` validations (KEP-3488).
pub const VALIDATION_FAILURE: &str = "validation.policy.admission.k8s.io/validation_failure";

/// Handles the evaluation errors of one policy's validation phase (matchConditions, variables,
/// validations, auditAnnotations) as ValidatingAdmissionPolicy does: with `failurePolicy: Fail`
/// they are enforced by the policy's `validationActions` — rejected with `Deny` (the error stays
/// a `Fail` error), an admission warning with `Warn`, an entry in the validation-failure audit
/// annotation with `Audit`; without `Deny` the error itself is kept as ignored. `Ignore` errors
/// stay ignored.
pub(super) fn errors_by_actions(p: &CompiledPolicy, local: &mut Outcome) {
    let deny = p.actions.contains(&ValidationAction::Deny);
    let mut audited = Vec::new();
    for e in local
        .errors
        .iter_mut()
        .filter(|e| e.failure_policy == FailurePolicy::Fail)
    {
        if !deny {
            e.failure_policy = FailurePolicy::Ignore;
        }
        let message = format!("{}: {}", e.field, e.message);
        if p.actions.contains(&ValidationAction::Warn) {
            local.warnings.push(validation_warning(&p.name, &message));
        }
        if p.actions.contains(&ValidationAction::Audit) {
            audited.push(serde_json::json!({
                "message": message,
                "policy": p.name,
                "validationActions": p.actions,
            }));
        }
    }
    append_validation_failures(&mut local.audit_annotations, audited);
}

/// The admission warning of a failed `Warn` validation (as ValidatingAdmissionPolicy words it).
fn validation_warning(policy: &str, message: &str) -> String {
    format!("Validation failed for ServingPolicy '{policy}': {message}")
}

/// Appends `failures` to the JSON list of [`VALIDATION_FAILURE`] in `annotations` (made when
/// absent; nothing when `failures` is empty).
fn append_validation_failures(
    annotations: &mut std::collections::BTreeMap<String, String>,
    failures: Vec<Value>,
) {
    if failures.is_empty() {
        return;
    }
    let mut all: Vec<Value> = annotations
        .get(VALIDATION_FAILURE)
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default();
    all.extend(failures);
    annotations.insert(VALIDATION_FAILURE.to_owned(), Value::Array(all).to_string());
}

/// Adds one policy's validation results to the request's outcome. Failed `Audit` validations
/// of all policies are collected in one JSON list.
pub(super) fn merge(out: &mut Outcome, local: Outcome) {
    out.denials.extend(local.denials);
    out.warnings.extend(local.warnings);
    out.validation_failures.extend(local.validation_failures);
    out.validations_unmatched
        .extend(local.validations_unmatched);
    out.errors.extend(local.errors);
    for (k, v) in local.audit_annotations {
        if k == VALIDATION_FAILURE {
            let failures = serde_json::from_str(&v).unwrap_or_default();
            append_validation_failures(&mut out.audit_annotations, failures);
        } else {
            out.audit_annotations.insert(k, v);
        }
    }
}

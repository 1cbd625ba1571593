//! The policy set: compile once, evaluate many.
//!
//! [`PolicySet`] is here; `types` holds the data of its API, `compile` turns one
//! ServingPolicy into its compiled form, `eval` evaluates one policy against one object (by the
//! native evaluator or the interpreter) and `patch` applies a mutation's result.

mod compile;
mod eval;
mod patch;
mod types;

use std::sync::Arc;

use hearth_crds::servingpolicy::{
    FailurePolicy, MutationAction, ReinvocationPolicy, ServingPolicy,
};
use kube_cel::cel::Context;
use serde_json::Value;

use crate::{guard, limits::Limits, matching};

pub use eval::VALIDATION_FAILURE;
pub(crate) use eval::{ExprFailure, run, with_stack};
pub use types::{
    Denial, ErrorKind, EvalError, EvalInput, GroupVersionKind, GroupVersionResource, MutateError,
    Mutated, MutationReport, Outcome, Phase, PolicyLoadError, PolicySettings, RequestInfo,
    UserInfo, ValidationFailure, patch_paths,
};

use compile::{CompiledPolicy, compile_policy};
use eval::{
    CelEval, EMPTY_SETTINGS, Fixed, NativeEval, PolicyRun, errors_by_actions, merge,
    request_context,
};
use patch::mutate_passes;

/// The audit annotation listing the mutations of policies with `Audit` in
/// `spec.mutationActions`: a JSON list of [`MutationReport`]s.
pub const MUTATION_REPORT: &str = "mutation.serving.hearth.dev/report";

/// What [`PolicySet::evaluate_in`] runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// An admission request: mutations, then validations.
    Admit,
    /// The controller's render: mutations only.
    Render,
    /// A background scan: as `Admit`, every policy's mutations reported.
    Report,
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
        crate::fallback::on_thread()
    }

    /// The limits this set enforces.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Evaluates an admission request: mutations first (in policy order, with reinvocation),
    /// then validations and audit annotations against the mutated object.
    pub fn evaluate(&self, input: &EvalInput) -> Outcome {
        let _budget = guard::Budget::enter(&self.inner.limits);
        with_stack(|| guard::with_base(|base| self.evaluate_in(base, input, Mode::Admit)))
    }

    /// What a background scan records for an object that already exists ([`crate::report`]):
    /// [`PolicySet::evaluate`], except that every matched policy's mutations are reported
    /// (a [`MutationReport`] for each policy that would change the object, applied or not),
    /// whatever its `spec.mutationActions`.
    pub fn evaluate_for_report(&self, input: &EvalInput) -> Outcome {
        let _budget = guard::Budget::enter(&self.inner.limits);
        with_stack(|| guard::with_base(|base| self.evaluate_in(base, input, Mode::Report)))
    }

    /// The compiled policies' shapes, by name: whether each has validations and mutations.
    pub(crate) fn rules_of(&self, name: &str) -> Option<(bool, bool)> {
        self.inner
            .policies
            .iter()
            .find(|p| p.name == name)
            .map(|p| (!p.validations.is_empty(), !p.mutations.is_empty()))
    }

    /// The controller's render path: runs only the mutations over `input.object` and returns
    /// the mutated object. Idempotent for the built-in policies: a second pass yields an empty
    /// patch. Errors when a `Fail` policy cannot be evaluated.
    pub fn mutate(&self, input: &EvalInput) -> Result<Mutated, MutateError> {
        let _budget = guard::Budget::enter(&self.inner.limits);
        let out =
            with_stack(|| guard::with_base(|base| self.evaluate_in(base, input, Mode::Render)));
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
            reports: out.mutation_reports,
        })
    }

    fn evaluate_in(&self, base: &Context<'static>, input: &EvalInput, mode: Mode) -> Outcome {
        let report_all = mode == Mode::Report;
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
                if p.mutations.is_empty() || !p.patches() {
                    continue;
                }
                changed |= self.mutate_reported(&rctx, &fixed, p, obj, report_all, &mut out);
                if p.reinvocation == ReinvocationPolicy::IfNeeded {
                    after[i] = Some(obj.clone());
                }
            }
            for (i, p) in matched.iter().enumerate() {
                if p.reinvocation == ReinvocationPolicy::IfNeeded
                    && after[i].as_ref().is_some_and(|a| a != obj)
                {
                    changed |= self.mutate_reported(&rctx, &fixed, p, obj, report_all, &mut out);
                }
            }
            // Report-only policies last, on the object every applied mutation made (the object
            // as it will be stored, which a validating webhook sees too), and outside the
            // request's cost budget: what they report must not decide what is enforced.
            for p in matched
                .iter()
                .filter(|p| !p.mutations.is_empty() && !p.patches())
            {
                let left = guard::request_left();
                self.mutate_reported(&rctx, &fixed, p, obj, report_all, &mut out);
                guard::refund_request(left);
            }
        }
        if let Some(v) = MutationReport::audit_annotation(&out.mutation_reports) {
            out.audit_annotations.insert(MUTATION_REPORT.to_owned(), v);
        }

        if mode != Mode::Render {
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
                    match PolicyRun::new(p, Phase::Validation).validate(&mut ev, &mut local) {
                        Ok(()) => true,
                        Err(fallback) => {
                            fallback.record(&p.name);
                            guard::refund_request(budget);
                            false
                        }
                    }
                };
                if !native {
                    local = Outcome::default();
                    let ev =
                        interpreted.get_or_insert_with(|| CelEval::new(rctx(), object.as_ref()));
                    // Each policy's variables in a scope of their own.
                    let mut scoped = ev.scope();
                    let _ = PolicyRun::new(p, Phase::Validation).validate(&mut scoped, &mut local);
                }
                errors_by_actions(p, &mut local);
                merge(&mut out, local);
            }
        }
        if changed && let (Some(orig), Some(new)) = (&input.object, &object) {
            out.patch = json_patch::diff(orig, new);
        }
        out.patched_object = object;
        out
    }

    /// Runs one policy's mutations as its `spec.mutationActions` say: applied to `object`
    /// (`Patch`), reported (a [`MutationReport`]; `Warn`: the paths as an admission warning,
    /// `Audit`: the JSON Patch in the [`MUTATION_REPORT`] audit annotation, written once the
    /// mutations are done), or both. Report-only
    /// (no `Patch`): evaluated on a copy, `object` is left as it was. `report_all` reports
    /// every policy's mutations (a background scan). Returns whether `object` changed.
    fn mutate_reported<'c>(
        &self,
        rctx: &impl Fn() -> &'c Context<'c>,
        fixed: &Fixed,
        p: &CompiledPolicy,
        object: &mut Value,
        report_all: bool,
        out: &mut Outcome,
    ) -> bool {
        if !report_all && !p.reports_mutations() && p.patches() {
            return self.mutate_policy(rctx, fixed, p, object, out);
        }
        let mut after = object.clone();
        let errors_before = out.errors.len();
        let changed = self.mutate_policy(rctx, fixed, p, &mut after, out);
        if !p.patches() {
            // Report-only enforces nothing: an evaluation error is recorded as ignored.
            for e in &mut out.errors[errors_before..] {
                e.failure_policy = FailurePolicy::Ignore;
            }
        }
        if !changed {
            return false;
        }
        let report = MutationReport {
            policy: p.name.clone(),
            patch: json_patch::diff(object, &after),
            applied: p.patches(),
            actions: p.mutation_actions.clone(),
        };
        if report.patch.0.is_empty() {
            return false;
        }
        if report.has(MutationAction::Warn) {
            out.warnings.push(report.warning());
        }
        out.mutation_reports.push(report);
        if p.patches() {
            *object = after;
            true
        } else {
            false
        }
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
                Ok((changed, error, matched)) => {
                    out.errors.extend(error);
                    if !matched {
                        out.mutations_unmatched.push(p.name.clone());
                    }
                    return changed;
                }
                Err(fallback) => {
                    fallback.record(&p.name);
                    guard::refund_request(budget);
                    if let Some(b) = backup {
                        *object = b;
                    }
                }
            }
        }
        let request = rctx();
        let (changed, error, matched) = mutate_passes(p, object, |run, current, next, first| {
            let mut ev = CelEval::new(request, Some(current));
            run.mutation_pass(&mut ev, next, first)
        })
        .unwrap_or((false, None, true));
        out.errors.extend(error);
        if !matched {
            out.mutations_unmatched.push(p.name.clone());
        }
        changed
    }
}

//! Policy results for objects that already exist: what a background scan records in the
//! Policy Reports API (`wgpolicyk8s.io/v1alpha2`, the `results` of a `PolicyReport`).
//!
//! [`results`] evaluates an object as admission would if it were created now
//! ([`PolicySet::evaluate_for_report`]) and gives each matched policy up to two results, one per
//! rule: `validations` (when the policy has validations) and `mutations` (when it has
//! mutations). A rule whose policy does not match the object gives none: its
//! `matchConstraints`, or its `matchConditions` where that rule ran (the mutations see the
//! object as the mutations before them left it, the validations the object as it would be
//! stored). An error of the match conditions or variables is the result of the rule that was
//! running.
//!
//! | rule | result | when |
//! |---|---|---|
//! | validations | `fail` | a validation failed and the policy denies (`Deny` in `validationActions`) |
//! | validations | `warn` | a validation failed and the policy only warns or audits |
//! | validations | `error` | an expression of the policy's validations, audit annotations, match conditions or variables did not evaluate (this wins over failed validations) |
//! | validations | `pass` | none of these |
//! | mutations | `warn`, [`PolicyResult::would_mutate`] | the mutations would change the object (applied or report-only) |
//! | mutations | `error` | a mutation did not evaluate or apply |
//! | mutations | `pass` | the object is already as the mutations make it |

use serde::Serialize;

use crate::engine::{EvalInput, Phase, PolicySet, patch_paths};
use hearth_crds::servingpolicy::ValidationAction;

/// A rule of a policy, as a Policy Report's `rule`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Rule {
    /// `spec.validations` (with `matchConditions` and `variables`).
    Validations,
    /// `spec.mutations`.
    Mutations,
}

impl Rule {
    /// `validations` or `mutations`.
    pub fn as_str(self) -> &'static str {
        match self {
            Rule::Validations => "validations",
            Rule::Mutations => "mutations",
        }
    }
}

/// A Policy Report result (`pass`, `fail`, `warn`, `error`; the API's `skip` is not used).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Nothing to report.
    Pass,
    /// A denying validation failed.
    Fail,
    /// A warning or audit validation failed, or the mutations would change the object.
    Warn,
    /// An expression did not evaluate.
    Error,
}

impl Verdict {
    /// `pass`, `fail`, `warn` or `error`.
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "fail",
            Verdict::Warn => "warn",
            Verdict::Error => "error",
        }
    }
}

/// One policy's result for one rule on one object.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyResult {
    /// The policy's `metadata.name`.
    pub policy: String,
    /// The rule.
    pub rule: Rule,
    /// The result.
    pub result: Verdict,
    /// What the mutations would change (RFC 6902, from the object as the mutations before this
    /// policy's left it; a reinvoked policy's passes joined); `Some` only for a `mutations`
    /// result of `warn`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub would_mutate: Option<json_patch::Patch>,
    /// For people: the failed validations' messages, the error, or the changed paths; empty on
    /// `pass`.
    pub message: String,
}

/// The results of every policy of `set` that matches `input` (see the module's table), in
/// policy order, `validations` before `mutations`.
pub fn results(set: &PolicySet, input: &EvalInput) -> Vec<PolicyResult> {
    let out = set.evaluate_for_report(input);
    let mut results = Vec::new();
    for policy in &out.matched {
        let Some((validates, mutates)) = set.rules_of(policy) else {
            continue;
        };
        let errors = |phase: Phase| -> Vec<&crate::EvalError> {
            out.errors
                .iter()
                .filter(|e| &e.policy == policy && e.phase == phase)
                .collect()
        };
        let describe = |errors: &[&crate::EvalError]| {
            errors
                .iter()
                .map(|e| format!("{}: {}", e.field, e.message))
                .collect::<Vec<_>>()
                .join("; ")
        };
        if validates && !out.validations_unmatched.contains(policy) {
            let errors = errors(Phase::Validation);
            let failures: Vec<_> = out
                .validation_failures
                .iter()
                .filter(|f| &f.policy == policy)
                .collect();
            let (result, message) = if !errors.is_empty() {
                (Verdict::Error, describe(&errors))
            } else if failures.is_empty() {
                (Verdict::Pass, String::new())
            } else {
                let denies = failures
                    .iter()
                    .any(|f| f.actions.contains(&ValidationAction::Deny));
                let message = failures
                    .iter()
                    .map(|f| f.message.as_str())
                    .collect::<Vec<_>>()
                    .join("; ");
                (if denies { Verdict::Fail } else { Verdict::Warn }, message)
            };
            results.push(PolicyResult {
                policy: policy.clone(),
                rule: Rule::Validations,
                result,
                would_mutate: None,
                message,
            });
        }
        if mutates {
            let errors = errors(Phase::Mutation);
            let patch: Vec<json_patch::PatchOperation> = out
                .mutation_reports
                .iter()
                .filter(|r| &r.policy == policy)
                .flat_map(|r| r.patch.0.iter().cloned())
                .collect();
            let (result, would_mutate, message) = if !errors.is_empty() {
                (Verdict::Error, None, describe(&errors))
            } else if !patch.is_empty() {
                let patch = json_patch::Patch(patch);
                let message = format!("would change the object: {}", patch_paths(&patch));
                (Verdict::Warn, Some(patch), message)
            } else if out.mutations_unmatched.contains(policy) {
                // Its matchConditions kept its mutations from running.
                continue;
            } else {
                (Verdict::Pass, None, String::new())
            };
            results.push(PolicyResult {
                policy: policy.clone(),
                rule: Rule::Mutations,
                result,
                would_mutate,
                message,
            });
        }
    }
    results
}

/// Counts of results, as a ServingPolicy's `status.scan` gives them: `would_mutate` counts the
/// `mutations` results of `warn`, which `warn` does not (a Policy Report's `summary.warn`
/// counts both).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Counts {
    /// `pass` results.
    pub pass: u64,
    /// `fail` results.
    pub fail: u64,
    /// `warn` results of validations.
    pub warn: u64,
    /// `error` results.
    pub error: u64,
    /// `mutations` results that would change the object.
    pub would_mutate: u64,
}

impl Counts {
    /// Adds one result.
    pub fn add(&mut self, r: &PolicyResult) {
        match r.result {
            Verdict::Pass => self.pass += 1,
            Verdict::Fail => self.fail += 1,
            Verdict::Warn if r.would_mutate.is_some() => self.would_mutate += 1,
            Verdict::Warn => self.warn += 1,
            Verdict::Error => self.error += 1,
        }
    }
}

//! Policy results of objects that already exist (`hearth_policies::report`): one result per
//! rule of each matched policy, as a background scan writes them in a Policy Report.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use hearth_crds::servingpolicy::Operation;
use hearth_policies::EvalInput;
use hearth_policies::report::{Counts, PolicyResult, Rule, Verdict, results};
use rstest::rstest;
use serde_json::{Value, json};

fn scan(policies: Vec<hearth_crds::ServingPolicy>, object: Value) -> Vec<PolicyResult> {
    results(
        &set(policies),
        &EvalInput::for_object(object, Operation::Create),
    )
}

/// The (rule, result) pairs of `results`.
fn verdicts(results: &[PolicyResult]) -> Vec<(&str, Rule, Verdict)> {
    results
        .iter()
        .map(|r| (r.policy.as_str(), r.rule, r.result))
        .collect()
}

const ANNOTATE: &str =
    "Object{metadata: Object.metadata{annotations: {'example.com/reviewed': 'true'}}}";

#[rstest]
#[case::denying_validation_fails(json!({"validations": [{"expression": "object.spec.replicas <= 0", "message": "no replicas"}]}), Verdict::Fail, "no replicas")]
#[case::warning_validation_warns(json!({"validationActions": ["Warn"], "validations": [{"expression": "false", "message": "careful"}]}), Verdict::Warn, "careful")]
#[case::audited_validation_warns(json!({"validationActions": ["Audit"], "validations": [{"expression": "false", "message": "noted"}]}), Verdict::Warn, "noted")]
#[case::deny_and_audit_fails(json!({"validationActions": ["Deny", "Audit"], "validations": [{"expression": "false", "message": "both"}]}), Verdict::Fail, "both")]
#[case::passing_validation_passes(json!({"validations": [{"expression": "true"}]}), Verdict::Pass, "")]
#[case::evaluation_error_is_an_error(json!({"failurePolicy": "Ignore", "validations": [{"expression": "object.spec.nope == 1"}]}), Verdict::Error, "spec.validations[0].expression")]
#[case::fail_policy_error_is_an_error_too(json!({"validations": [{"expression": "object.spec.nope == 1"}]}), Verdict::Error, "spec.validations[0].expression")]
#[case::variable_error_is_the_validations_error(json!({"failurePolicy": "Ignore", "variables": [{"name": "v", "expression": "object.spec.nope"}], "validations": [{"expression": "variables.v == 1"}]}), Verdict::Error, "variables.v failed")]
fn validations(#[case] spec: Value, #[case] want: Verdict, #[case] message: &str) {
    let got = scan(vec![policy("p", spec)], deployment());
    assert_eq!(verdicts(&got), [("p", Rule::Validations, want)], "{got:?}");
    assert!(
        got[0].message.contains(message),
        "{:?} lacks {message:?}",
        got[0].message
    );
    assert!(got[0].would_mutate.is_none());
}

#[rstest]
#[case::applied(json!(["Patch"]))]
#[case::applied_and_warned(json!(["Patch", "Warn"]))]
#[case::report_only(json!(["Audit"]))]
fn mutations_that_would_change_the_object(#[case] actions: Value) {
    let p = policy(
        "annotate",
        json!({"mutationActions": actions, "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": ANNOTATE}}]}),
    );
    let got = scan(vec![p.clone()], deployment());
    assert_eq!(
        verdicts(&got),
        [("annotate", Rule::Mutations, Verdict::Warn)]
    );
    let patch = serde_json::to_value(got[0].would_mutate.as_ref().unwrap()).unwrap();
    assert_eq!(
        patch,
        json!([{"op": "add", "path": "/metadata/annotations/example.com~1reviewed", "value": "true"}])
    );
    assert_eq!(
        got[0].message,
        "would change the object: add /metadata/annotations/example.com~1reviewed"
    );
    // An object already as the policy makes it passes.
    let mut done = deployment();
    done["metadata"]["annotations"]["example.com/reviewed"] = json!("true");
    assert_eq!(
        verdicts(&scan(vec![p], done)),
        [("annotate", Rule::Mutations, Verdict::Pass)]
    );
}

#[test]
fn a_failed_mutation_is_an_error() {
    let p = policy(
        "broken",
        json!({"failurePolicy": "Ignore", "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression":
            "[JSONPatch{op: 'add', path: '/spec/nope/deeper', value: 1}]"}}]}),
    );
    let got = scan(vec![p], deployment());
    assert_eq!(
        verdicts(&got),
        [("broken", Rule::Mutations, Verdict::Error)]
    );
    assert!(got[0].message.starts_with("spec.mutations[0]"), "{got:?}");
}

#[test]
fn both_rules_in_policy_order_and_unmatched_policies_give_none() {
    let both = policy(
        "both",
        json!({
            "validations": [{"expression": "has(object.metadata.annotations) && 'example.com/reviewed' in object.metadata.annotations", "message": "not reviewed"}],
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": ANNOTATE}}]
        }),
    );
    let elsewhere = policy(
        "elsewhere",
        json!({
            "matchConditions": [{"name": "other-namespace", "expression": "object.metadata.namespace == 'team-b'"}],
            "validations": [{"expression": "false"}]
        }),
    );
    let mutating_elsewhere = policy(
        "mutating-elsewhere",
        json!({
            "matchConditions": [{"name": "other-namespace", "expression": "object.metadata.namespace == 'team-b'"}],
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": ANNOTATE}}]
        }),
    );
    let passing = policy("passing", json!({"validations": [{"expression": "true"}]}));
    let got = scan(
        vec![both, elsewhere, mutating_elsewhere, passing],
        deployment(),
    );
    // Admission validates the mutated object, and so does the scan: the object as it would be
    // stored if created now passes, and the mutation that gets it there is reported.
    assert_eq!(
        verdicts(&got),
        [
            ("both", Rule::Validations, Verdict::Pass),
            ("both", Rule::Mutations, Verdict::Warn),
            ("passing", Rule::Validations, Verdict::Pass),
        ]
    );
    let mut counts = Counts::default();
    got.iter().for_each(|r| counts.add(r));
    assert_eq!(
        counts,
        Counts {
            pass: 2,
            would_mutate: 1,
            ..Counts::default()
        }
    );
}

#[test]
fn counts_keep_would_mutate_apart_from_warn() {
    let warn = policy(
        "warn",
        json!({"validationActions": ["Warn"], "validations": [{"expression": "false"}]}),
    );
    let deny = policy("deny", json!({"validations": [{"expression": "false"}]}));
    let got = scan(vec![warn, deny], deployment());
    let mut counts = Counts::default();
    got.iter().for_each(|r| counts.add(r));
    assert_eq!(
        counts,
        Counts {
            fail: 1,
            warn: 1,
            ..Counts::default()
        }
    );
    assert_eq!(
        serde_json::to_value(counts).unwrap(),
        json!({"pass": 0, "fail": 1, "warn": 1, "error": 0, "wouldMutate": 0})
    );
}

#[test]
fn a_mutation_guarded_by_its_own_condition_is_reported_and_skipped_once_done() {
    // MutatingAdmissionPolicy's usual guard: mutate only while the change is missing.
    let guarded = policy(
        "guarded",
        json!({
            "matchConditions": [{"name": "not-yet", "expression":
                "!has(object.metadata.annotations) || !('example.com/reviewed' in object.metadata.annotations)"}],
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": ANNOTATE}}]
        }),
    );
    assert_eq!(
        verdicts(&scan(vec![guarded.clone()], deployment())),
        [("guarded", Rule::Mutations, Verdict::Warn)]
    );
    let mut done = deployment();
    done["metadata"]["annotations"]["example.com/reviewed"] = json!("true");
    assert_eq!(verdicts(&scan(vec![guarded], done)), []);
}

#[test]
fn a_condition_error_is_the_result_of_each_rule_that_ran() {
    let p = policy(
        "both",
        json!({
            "failurePolicy": "Ignore",
            "matchConditions": [{"name": "broken", "expression": "object.spec.nope == 1"}],
            "validations": [{"expression": "true"}],
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": ANNOTATE}}]
        }),
    );
    let got = scan(vec![p], deployment());
    assert_eq!(
        verdicts(&got),
        [
            ("both", Rule::Validations, Verdict::Error),
            ("both", Rule::Mutations, Verdict::Error),
        ]
    );
    assert!(
        got.iter()
            .all(|r| r.message.contains("spec.matchConditions[0]")),
        "{got:?}"
    );
}

//! Adversarial policies: every bound ends as a load error or an evaluation error handled by
//! failurePolicy, and the set keeps serving afterwards. Each case runs in milliseconds; none
//! asserts on time.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use hearth_policies::{ErrorKind, Limits, PolicySet};
use serde_json::{Value, json};

fn load_error(expression: &str) -> String {
    let (set, errors) = PolicySet::compile(&[policy(
        "adv",
        json!({"validations": [{"expression": expression}]}),
    )]);
    assert!(set.names().is_empty(), "{expression:.80} loaded");
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].field, "spec.validations[0].expression");
    errors[0].to_string()
}

/// Evaluates one validation under failurePolicy Fail and returns the single error's kind.
fn eval_error(variables: Value, expression: &str) -> (ErrorKind, String) {
    let s = set(vec![policy(
        "adv",
        json!({
            "variables": variables,
            "validations": [{"expression": expression}]
        }),
    )]);
    let out = eval(&s, deployment());
    assert!(!out.allowed(), "a Fail policy's error rejects");
    assert_eq!(out.errors.len(), 1, "{:?}", out.errors);
    // The set keeps serving.
    let healthy = set(vec![policy(
        "ok",
        json!({"validations": [{"expression": "object.spec.replicas == 1"}]}),
    )]);
    assert!(eval(&healthy, deployment()).allowed());
    (out.errors[0].kind, out.errors[0].message.clone())
}

#[test]
fn deep_bracket_nesting_is_rejected_at_load() {
    let e = load_error(&format!("{}1{}", "(".repeat(2000), ")".repeat(2000)));
    assert!(e.contains("nests brackets"), "{e}");
    let e = load_error(&format!("{}1{}", "[".repeat(40), "]".repeat(40)));
    assert!(e.contains("nests brackets"), "{e}");
}

#[test]
fn long_operator_chains_are_rejected_at_load() {
    let e = load_error(&vec!["1"; 4000].join("+"));
    assert!(
        e.contains("levels deep") || e.contains("syntax error"),
        "{e}"
    );
    let e = load_error(&format!("object{} == 1", ".a".repeat(3000)));
    assert!(
        e.contains("levels deep") || e.contains("syntax error"),
        "{e}"
    );
}

#[test]
fn oversized_expression_is_rejected_at_load() {
    let e = load_error(&format!("'{}' == ''", "a".repeat(20_000)));
    assert!(e.contains("bytes"), "{e}");
}

#[test]
fn comprehension_nesting_is_rejected_at_load() {
    let e = load_error("[1].all(a, [1].all(b, [1].all(c, [1].all(d, true))))");
    assert!(e.contains("comprehensions nest"), "{e}");
}

#[test]
fn deep_but_allowed_expression_evaluates_on_a_small_stack() {
    // 90 levels deep; the test thread has a 2 MiB stack.
    let s = set(vec![policy(
        "deep",
        json!({"validations": [{"expression": format!("{} == 90", vec!["1"; 90].join(" + "))}]}),
    )]);
    let out = eval(&s, deployment());
    assert!(out.allowed(), "{:?}", out.errors);
}

#[test]
fn exponential_nested_map_exceeds_the_cost_budget() {
    let (kind, msg) = eval_error(
        json!([]),
        "lists.range(100).map(a, lists.range(100).map(b, lists.range(100).map(c, a + b + c))).size() > 0",
    );
    assert_eq!(kind, ErrorKind::BoundExceeded, "{msg}");
    assert!(msg.contains("budget"), "{msg}");
}

#[test]
fn huge_lists_are_refused_before_they_are_built() {
    let (kind, msg) = eval_error(json!([]), "lists.range(100000000).size() > 0");
    assert_eq!(kind, ErrorKind::BoundExceeded);
    assert!(msg.contains("list of 100000000 elements"), "{msg}");
}

#[test]
fn string_doubling_hits_the_string_limit() {
    let mut vars = vec![json!({"name": "s0", "expression": "'0123456789abcdef'"})];
    for i in 1..40 {
        vars.push(json!({"name": format!("s{i}"), "expression": format!("variables.s{0} + variables.s{0}", i - 1)}));
    }
    let (kind, msg) = eval_error(Value::Array(vars), "size(variables.s39) > 0");
    // The variable that crossed 1 MiB failed; the validation reports it.
    assert_eq!(kind, ErrorKind::BoundExceeded);
    assert!(msg.contains("exceeds the limit"), "{msg}");
}

#[test]
fn join_replace_and_format_amplification_are_refused() {
    // 16 bytes doubled 12 times: a 64 KiB string.
    let mut vars = vec![json!({"name": "s0", "expression": "'0123456789abcdef'"})];
    for i in 1..=12 {
        vars.push(json!({"name": format!("s{i}"), "expression": format!("variables.s{0} + variables.s{0}", i - 1)}));
    }
    vars.push(json!({"name": "big", "expression": "variables.s12"}));
    let big = Value::Array(vars);
    let (kind, msg) = eval_error(
        big.clone(),
        "size(lists.range(400).map(i, variables.big).join('')) > 0",
    );
    assert_eq!(kind, ErrorKind::BoundExceeded, "{msg}");
    let (kind, msg) = eval_error(
        big.clone(),
        "size(variables.big.replace('', variables.big)) > 0",
    );
    assert_eq!(kind, ErrorKind::BoundExceeded, "{msg}");
    let (kind, msg) = eval_error(
        big,
        "size('%s'.format([lists.range(400).map(i, variables.big)])) > 0",
    );
    assert_eq!(kind, ErrorKind::BoundExceeded, "{msg}");
}

#[test]
fn the_request_budget_spans_policies() {
    // Each policy stays under the per-expression budget; together they exceed the request's.
    let policies: Vec<_> = (0..20)
        .map(|i| {
            policy(
                &format!("p{i}"),
                json!({
                    "failurePolicy": "Ignore",
                    "validations": [{"expression": "lists.range(2000).all(x, x >= 0)"}]
                }),
            )
        })
        .collect();
    // A small request budget keeps the test quick; the mechanism is the same at any size.
    let limits = Limits {
        max_request_cost: 30_000,
        ..Limits::default()
    };
    let (s, errors) = PolicySet::compile_with_limits(&policies, limits);
    assert!(errors.is_empty());
    let out = eval(&s, deployment());
    assert!(out.allowed(), "Ignore policies never reject");
    assert!(!out.errors.is_empty());
    assert!(
        out.errors
            .iter()
            .all(|e| e.kind == ErrorKind::BoundExceeded)
    );
    assert!(
        out.errors
            .iter()
            .any(|e| e.message.contains("request cost budget")),
        "{:?}",
        out.errors
    );
}

#[test]
fn realistic_comprehensions_fit_the_budget() {
    let mut d = deployment();
    let env: Vec<Value> = (0..200)
        .map(|i| json!({"name": format!("E{i}"), "value": "v"}))
        .collect();
    d["spec"]["template"]["spec"]["containers"][0]["env"] = Value::Array(env);
    let s = set(vec![policy(
        "env",
        json!({"validations": [{"expression":
        "object.spec.template.spec.containers.all(c, !has(c.env) || c.env.all(e, e.name.matches('^[A-Z0-9_]+$')))"}]}),
    )]);
    let out = eval(&s, d);
    assert!(out.allowed(), "{:?}", out.errors);
}

/// Lists that share one big list, built cheaply, cost what copying or comparing them costs.
#[test]
fn shared_values_are_charged_when_copied_or_compared() {
    let vars = json!([
        {"name": "l", "expression": "lists.range(3000)"},
        {"name": "ll", "expression": "lists.range(3000).map(i, variables.l)"},
        {"name": "l2", "expression": "lists.range(3000).map(i, variables.l)"},
    ]);
    // As a mutation's value (copied into the object).
    let s = set(vec![policy(
        "copy",
        json!({"variables": vars, "mutations": [{"patchType": "JSONPatch", "jsonPatch": {
            "expression": "[JSONPatch{op: 'add', path: '/metadata/labels/x', value: variables.ll}]"}}]}),
    )]);
    let out = eval(&s, deployment());
    assert_eq!(out.errors.len(), 1, "{:?}", out.errors);
    assert_eq!(out.errors[0].kind, ErrorKind::BoundExceeded);
    // Compared again and again.
    let (kind, _) = eval_error(
        vars.clone(),
        "lists.range(50).all(i, variables.ll == variables.l2)",
    );
    assert_eq!(kind, ErrorKind::BoundExceeded);
    // On the interpreter, copying the accumulator counts its nested size.
    let s = set(vec![policy(
        "nested",
        json!({"variables": [{"name": "l", "expression": "lists.range(1000)"}],
               "validations": [{"expression": "lists.range(300).map(i, variables.l).size() > 0"}]}),
    )])
    .interpreted();
    let out = eval(&s, deployment());
    assert_eq!(out.errors.len(), 1, "{:?}", out.errors);
    assert_eq!(out.errors[0].kind, ErrorKind::BoundExceeded);
}

#[test]
fn functions_that_grow_strings_are_bounded() {
    let mut vars = vec![json!({"name": "s0", "expression": "'////////////////'"})];
    for i in 1..=16 {
        vars.push(json!({"name": format!("s{i}"), "expression": format!("variables.s{0} + variables.s{0}", i - 1)}));
    }
    // 1 MiB of '/': escaping doubles it past the string limit.
    let (kind, msg) = eval_error(
        Value::Array(vars),
        "size(jsonpatch.escapeKey(variables.s16)) > 0",
    );
    assert_eq!(kind, ErrorKind::BoundExceeded, "{msg}");
}

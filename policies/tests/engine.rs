//! Semantics of validation, variables, match constraints, mutations and load errors.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::*;
use hearth_crds::servingpolicy::{FailurePolicy, Operation};
use hearth_policies::{ErrorKind, EvalInput, PolicySet};
use serde_json::json;

#[test]
fn validation_denies_with_message_and_message_expression() {
    let s = set(vec![policy(
        "replicas",
        json!({
            "validations": [
                {"expression": "object.spec.replicas <= 1", "message": "static"},
                {"expression": "object.spec.replicas <= 2",
                 "messageExpression": "'replicas is ' + string(object.spec.replicas)", "reason": "Invalid"},
                {"expression": "object.spec.replicas <= 3"}
            ]
        }),
    )]);
    let mut d = deployment();
    d["spec"]["replicas"] = json!(5);
    let out = eval(&s, d);
    assert!(!out.allowed());
    let msgs: Vec<_> = out.denials.iter().map(|d| d.message.as_str()).collect();
    assert_eq!(
        msgs,
        [
            "static",
            "replicas is 5",
            "failed expression: object.spec.replicas <= 3"
        ]
    );
    assert_eq!(
        out.denials[1].reason,
        hearth_crds::servingpolicy::StatusReason::Invalid
    );
    assert!(out.errors.is_empty());
    assert!(eval(&s, deployment()).allowed());
}

#[test]
fn warn_and_audit_actions() {
    let s = set(vec![policy(
        "p",
        json!({
            "validationActions": ["Warn", "Audit"],
            "validations": [{"expression": "false", "message": "careful"}],
            "auditAnnotations": [{"key": "replicas", "valueExpression": "string(object.spec.replicas)"},
                                 {"key": "none", "valueExpression": "null"}]
        }),
    )]);
    let out = eval(&s, deployment());
    assert!(out.allowed());
    assert_eq!(
        out.warnings,
        ["Validation failed for ServingPolicy 'p': careful"]
    );
    assert_eq!(
        out.audit_annotations.get("p/replicas").map(String::as_str),
        Some("1")
    );
    assert!(!out.audit_annotations.contains_key("p/none"));
    let failure = &out.audit_annotations["validation.policy.admission.k8s.io/validation_failure"];
    assert!(failure.contains("careful"), "{failure}");
}

#[test]
fn variables_are_ordered_and_lazy_on_error() {
    let s = set(vec![policy(
        "v",
        json!({
            "variables": [
                {"name": "name", "expression": "object.metadata.name"},
                {"name": "upper", "expression": "variables.name.upperAscii()"},
                {"name": "broken", "expression": "object.spec.nope.deeper"}
            ],
            "validations": [
                {"expression": "variables.upper == 'LLM'", "message": "upper"},
                {"expression": "variables.broken == 1", "message": "never"}
            ]
        }),
    )]);
    let out = eval(&s, deployment());
    assert!(out.denials.is_empty(), "{:?}", out.denials);
    assert_eq!(out.errors.len(), 1);
    assert_eq!(out.errors[0].field, "spec.validations[1].expression");
    assert!(
        out.errors[0].message.contains("variables.broken failed"),
        "{}",
        out.errors[0].message
    );
    assert!(!out.allowed(), "failurePolicy Fail rejects");
}

#[test]
fn failure_policy_ignore_skips() {
    let s = set(vec![policy(
        "i",
        json!({
            "failurePolicy": "Ignore",
            "validations": [{"expression": "object.spec.missing == 1"}]
        }),
    )]);
    let out = eval(&s, deployment());
    assert!(out.allowed());
    assert_eq!(out.errors.len(), 1);
    assert_eq!(out.errors[0].failure_policy, FailurePolicy::Ignore);
    assert_eq!(out.errors[0].kind, ErrorKind::Evaluation);
}

#[test]
fn match_constraints_and_conditions() {
    let s = set(vec![policy(
        "m",
        json!({
            "matchConstraints": {
                "resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments"], "operations": ["UPDATE"]}],
                "namespaceSelector": {"matchLabels": {"tier": "gold"}},
                "objectSelector": {"matchExpressions": [{"key": "app", "operator": "In", "values": ["llm"]}]}
            },
            "matchConditions": [{"name": "not-system", "expression": "request.userInfo.username != 'system:admin'"}],
            "validations": [{"expression": "false", "message": "matched"}]
        }),
    )]);
    let mut input = EvalInput::for_object(deployment(), Operation::Update);
    input.old_object = Some(deployment());
    input.namespace_object =
        Some(json!({"metadata": {"name": "team-a", "labels": {"tier": "gold"}}}));
    assert_eq!(s.evaluate(&input).denials.len(), 1);
    // Wrong operation.
    let mut create = input.clone();
    create.request.operation = Operation::Create;
    assert!(s.evaluate(&create).denials.is_empty());
    // Namespace label missing.
    let mut ns = input.clone();
    ns.namespace_object = Some(json!({"metadata": {"name": "team-a"}}));
    assert!(s.evaluate(&ns).denials.is_empty());
    // matchCondition false.
    let mut admin = input.clone();
    admin.request.user_info.username = "system:admin".into();
    assert!(s.evaluate(&admin).denials.is_empty());
    // Object selector fails on both object and old object.
    let mut other = input.clone();
    other.object.as_mut().unwrap()["metadata"]["labels"]["app"] = json!("web");
    other.old_object = other.object.clone();
    assert!(s.evaluate(&other).denials.is_empty());
}

#[test]
fn default_match_is_hearth_workloads() {
    let s = set(vec![policy(
        "d",
        json!({"validations": [{"expression": "false"}]}),
    )]);
    assert_eq!(eval(&s, deployment()).denials.len(), 1);
    let cm = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}});
    assert!(eval(&s, cm).denials.is_empty());
}

#[test]
fn json_patch_mutation_with_struct_syntax_and_escaping() {
    let s = set(vec![policy(
        "jp",
        json!({
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": r#"[
            JSONPatch{op: "add", path: "/metadata/annotations/" + jsonpatch.escapeKey("a/b~c"), value: "x"},
            JSONPatch{op: "replace", path: "/spec/replicas", value: 3}
        ]"#}}]
        }),
    )]);
    let out = eval(&s, deployment());
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let obj = out.patched_object.unwrap();
    assert_eq!(obj["metadata"]["annotations"]["a/b~c"], "x");
    assert_eq!(obj["spec"]["replicas"], 3);
    let ops = serde_json::to_value(&out.patch).unwrap();
    assert!(
        ops.to_string().contains("/metadata/annotations/a~1b~0c"),
        "{ops}"
    );
}

#[test]
fn json_patch_on_missing_parent_is_an_error_not_a_string() {
    let s = set(vec![policy(
        "jp",
        json!({
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression":
                "[JSONPatch{op: 'add', path: '/spec/template/spec/nodeSelector/a', value: 'b'}]"}}]
        }),
    )]);
    let out = eval(&s, deployment());
    assert_eq!(out.errors.len(), 1);
    assert_eq!(out.errors[0].kind, ErrorKind::Patch);
    assert!(out.patch.0.is_empty());
}

#[test]
fn apply_configuration_merges_containers_by_name() {
    let s = set(vec![policy(
        "ac",
        json!({
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": r#"
            Object{spec: Object.spec{template: Object.spec.template{spec: Object.spec.template.spec{
              containers: [Object.spec.template.spec.containers{name: "vllm", resources: {"limits": {"nvidia.com/gpu": 1}}}],
              nodeSelector: {"gpu": "a10"}
            }}}}"#}}]
        }),
    )]);
    let out = eval(&s, deployment());
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    let obj = out.patched_object.unwrap();
    let c = &obj["spec"]["template"]["spec"]["containers"];
    assert_eq!(c.as_array().unwrap().len(), 1);
    assert_eq!(c[0]["image"], "vllm/vllm-openai:v0.25.1");
    assert_eq!(c[0]["resources"]["limits"]["nvidia.com/gpu"], 1);
    // Idempotent.
    let again = eval(&s, obj);
    assert!(again.patch.0.is_empty(), "{:?}", again.patch);
}

#[test]
fn mutations_see_previous_mutations_and_reinvocation() {
    let s = set(vec![
        policy(
            "first",
            json!({
                "reinvocationPolicy": "IfNeeded",
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "has(object.metadata.annotations) && 'second' in object.metadata.annotations ? Object{metadata: Object.metadata{annotations: {'first-saw-second': 'yes'}}} : Object{}"}}]
            }),
        ),
        policy(
            "second",
            json!({
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "Object{metadata: Object.metadata{annotations: {'second': 'done'}}}"}}]
            }),
        ),
    ]);
    let out = eval(&s, deployment());
    let obj = out.patched_object.unwrap();
    assert_eq!(obj["metadata"]["annotations"]["second"], "done");
    assert_eq!(obj["metadata"]["annotations"]["first-saw-second"], "yes");
}

/// A mutation adding one annotation, with `spec.mutationActions` `actions`.
fn annotating(name: &str, actions: serde_json::Value) -> hearth_crds::ServingPolicy {
    policy(
        name,
        json!({
            "mutationActions": actions,
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                "Object{metadata: Object.metadata{annotations: {'example.com/reviewed': 'true'}}}"}}]
        }),
    )
}

#[test]
fn report_only_mutations_are_reported_not_applied() {
    let s = set(vec![annotating("defaults", json!(["Warn", "Audit"]))]);
    let out = eval(&s, deployment());
    assert!(out.allowed());
    assert!(out.patch.0.is_empty(), "{:?}", out.patch);
    assert_eq!(out.patched_object, Some(deployment()));
    assert_eq!(
        out.warnings,
        [
            "ServingPolicy 'defaults' would change the object (report-only, not applied): add /metadata/annotations/example.com~1reviewed"
        ]
    );
    let report: serde_json::Value =
        serde_json::from_str(&out.audit_annotations[hearth_policies::MUTATION_REPORT]).unwrap();
    assert_eq!(
        report,
        json!([{"policy": "defaults", "applied": false, "patch": [
            {"op": "add", "path": "/metadata/annotations/example.com~1reviewed", "value": "true"}
        ]}])
    );
    assert_eq!(out.mutation_reports.len(), 1);
    // The render path applies nothing either, and hands the report on.
    let mutated = s
        .mutate(&EvalInput::for_object(deployment(), Operation::Create))
        .unwrap();
    assert_eq!(mutated.object, deployment());
    assert!(mutated.patch.0.is_empty());
    assert_eq!(mutated.reports.len(), 1);
    assert!(!mutated.reports[0].applied);
}

#[test]
fn applied_mutations_can_be_reported_too() {
    let s = set(vec![annotating(
        "defaults",
        json!(["Patch", "Warn", "Audit"]),
    )]);
    let out = eval(&s, deployment());
    assert_eq!(
        out.patched_object.unwrap()["metadata"]["annotations"]["example.com/reviewed"],
        "true"
    );
    assert!(!out.patch.0.is_empty());
    assert_eq!(
        out.warnings,
        [
            "ServingPolicy 'defaults' changed the object: add /metadata/annotations/example.com~1reviewed"
        ]
    );
    assert!(out.mutation_reports[0].applied);
    assert!(out.audit_annotations[hearth_policies::MUTATION_REPORT].contains("\"applied\":true"));
    // Patch alone reports nothing; a mutation that changes nothing is not reported.
    let quiet = set(vec![annotating("defaults", json!(["Patch"]))]);
    let out = eval(&quiet, deployment());
    assert!(out.warnings.is_empty() && out.mutation_reports.is_empty());
    assert!(
        !out.audit_annotations
            .contains_key(hearth_policies::MUTATION_REPORT)
    );
    let done = eval(&s, eval(&quiet, deployment()).patched_object.unwrap());
    assert!(done.mutation_reports.is_empty() && done.warnings.is_empty());
}

#[test]
fn report_only_enforces_no_failure_and_triggers_no_reinvocation() {
    let s = set(vec![
        policy(
            "first",
            json!({
                "reinvocationPolicy": "IfNeeded",
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "has(object.metadata.annotations) && 'example.com/reviewed' in object.metadata.annotations ? Object{metadata: Object.metadata{annotations: {'first-saw-it': 'yes'}}} : Object{}"}}]
            }),
        ),
        annotating("later", json!(["Audit"])),
        policy(
            "broken",
            json!({
                "failurePolicy": "Fail",
                "mutationActions": ["Audit"],
                "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression":
                    "[JSONPatch{op: 'add', path: '/spec/nope/deeper', value: 1}]"}}]
            }),
        ),
    ]);
    let out = eval(&s, deployment());
    // The report-only policy's error is recorded as ignored: nothing is enforced.
    assert!(out.allowed(), "{:?}", out.errors);
    assert_eq!(out.errors.len(), 1);
    assert_eq!(out.errors[0].policy, "broken");
    assert_eq!(out.errors[0].failure_policy, FailurePolicy::Ignore);
    // `later` changed nothing, so `first` saw nothing to react to.
    assert_eq!(out.patched_object, Some(deployment()));
    assert_eq!(out.mutation_reports.len(), 1);
    assert_eq!(out.mutation_reports[0].policy, "later");
}

#[test]
fn report_only_policies_see_the_object_every_applied_mutation_made() {
    let history = |name: &str, limit: u32, actions: serde_json::Value| {
        policy(
            name,
            json!({
                "mutationActions": actions,
                "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": format!(
                    "has(object.spec.revisionHistoryLimit) ? [] : [JSONPatch{{op: 'add', path: '/spec/revisionHistoryLimit', value: {limit}}}]"
                )}}]
            }),
        )
    };
    // The report-only policy comes first, but is evaluated after the applied one: on the object
    // as it will be stored, where it has nothing left to change.
    let s = set(vec![
        history("report", 3, json!(["Warn"])),
        history("apply", 5, json!(["Patch"])),
    ]);
    let out = eval(&s, deployment());
    assert_eq!(
        out.patched_object.unwrap()["spec"]["revisionHistoryLimit"],
        5
    );
    assert!(
        out.mutation_reports.is_empty(),
        "{:?}",
        out.mutation_reports
    );
    assert!(out.warnings.is_empty(), "{:?}", out.warnings);
}

#[test]
fn reinvoked_mutations_are_reported_again() {
    let s = set(vec![
        policy(
            "first",
            json!({
                "reinvocationPolicy": "IfNeeded",
                "mutationActions": ["Patch", "Warn"],
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "has(object.metadata.annotations) && 'second' in object.metadata.annotations ? Object{metadata: Object.metadata{annotations: {'first-saw-second': 'yes'}}} : Object{metadata: Object.metadata{annotations: {'first': 'ran'}}}"}}]
            }),
        ),
        policy(
            "second",
            json!({"mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                "Object{metadata: Object.metadata{annotations: {'second': 'done'}}}"}}]}),
        ),
    ]);
    let out = eval(&s, deployment());
    let reports: Vec<String> = out.mutation_reports.iter().map(|r| r.warning()).collect();
    assert_eq!(
        reports,
        [
            "ServingPolicy 'first' changed the object: add /metadata/annotations/first",
            "ServingPolicy 'first' changed the object: add /metadata/annotations/first-saw-second"
        ]
    );
    assert_eq!(out.warnings, reports);
}

#[test]
fn errors_of_a_fail_policy_are_enforced_by_its_validation_actions() {
    // validationActions, then: allowed, warnings, audited.
    for (actions, allowed, warnings, audited) in [
        (json!(["Deny"]), false, 0, false),
        (json!(["Deny", "Audit"]), false, 0, true),
        (json!(["Warn"]), true, 1, false),
        (json!(["Audit"]), true, 0, true),
        (json!(["Warn", "Audit"]), true, 1, true),
    ] {
        let s = set(vec![policy(
            "broken",
            json!({
                "failurePolicy": "Fail",
                "validationActions": actions,
                "validations": [{"expression": "object.spec.nope.deeper == 1"}]
            }),
        )]);
        let out = eval(&s, deployment());
        assert_eq!(out.allowed(), allowed, "{actions}: {:?}", out.errors);
        assert_eq!(out.errors.len(), 1, "{actions}");
        assert_eq!(
            out.warnings.len(),
            warnings,
            "{actions}: {:?}",
            out.warnings
        );
        let failure = out
            .audit_annotations
            .get("validation.policy.admission.k8s.io/validation_failure");
        assert_eq!(failure.is_some(), audited, "{actions}: {failure:?}");
        if let Some(f) = failure {
            assert!(f.contains("spec.validations[0].expression"), "{f}");
        }
    }
}

#[test]
fn mutation_actions_may_not_be_empty() {
    let p = policy("empty", json!({"mutationActions": []}));
    let (_, errors) = PolicySet::compile(&[p]);
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].field, "spec.mutationActions");
}

#[test]
fn mutation_may_not_change_identity() {
    let s = set(vec![policy(
        "id",
        json!({
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": "Object{kind: 'Pod'}"}}]
        }),
    )]);
    let out = eval(&s, deployment());
    assert_eq!(out.errors[0].kind, ErrorKind::Patch);
}

#[test]
fn load_errors_name_policy_field_and_position() {
    let bad = vec![
        policy(
            "syntax",
            json!({"validations": [{"expression": "true"}, {"expression": "true"}, {"expression": "object.("}]}),
        ),
        policy(
            "map-entry",
            json!({"validations": [{"expression": "{'a': 1}.transformMapEntry(k, v, {k: v}) == {'a': 1}"}]}),
        ),
        policy(
            "authz",
            json!({"validations": [{"expression": "authorizer.group('').resource('x').check('get').allowed()"}]}),
        ),
        policy(
            "unknown-fn",
            json!({"validations": [{"expression": "object.metadata.name.frobnicate()"}]}),
        ),
        policy(
            "undeclared-var",
            json!({"variables": [{"name": "a", "expression": "variables.b"}, {"name": "b", "expression": "1"}]}),
        ),
        policy("ok", json!({"validations": [{"expression": "true"}]})),
    ];
    let (set, errors) = PolicySet::compile(&bad);
    assert_eq!(set.names(), ["ok"]);
    let by = |p: &str| {
        errors
            .iter()
            .find(|e| e.policy == p)
            .unwrap_or_else(|| panic!("no error for {p}"))
    };
    let e = by("syntax");
    assert_eq!(e.field, "spec.validations[2].expression");
    assert!(e.error.position.is_some(), "{e}");
    assert!(
        by("map-entry").to_string().contains("transformMapEntry"),
        "{}",
        by("map-entry")
    );
    assert!(by("authz").error.message.contains("authorizer"));
    let uf = by("unknown-fn");
    assert!(uf.error.message.contains("frobnicate"));
    assert_eq!(uf.error.position, Some((1, 22)));
    assert!(by("undeclared-var").error.message.contains("variables.b"));
    assert!(
        by("undeclared-var")
            .to_string()
            .contains("spec.variables[0].expression")
    );
}

#[test]
fn kubernetes_libraries_are_available() {
    let s = set(vec![policy(
        "libs",
        json!({"validations": [
            {"expression": "quantity('1Gi').isGreaterThan(quantity('512Mi'))", "message": "quantity"},
            {"expression": "'a,b'.split(',').size() == 2", "message": "strings"},
            {"expression": "isURL('https://x.io/a') && url('https://x.io/a').getHost() == 'x.io'", "message": "urls"},
            {"expression": "sets.contains([1, 2], [1])", "message": "sets"},
            {"expression": "'abc'.matches('^a') && 'abc'.find('b') == 'b'", "message": "regex"},
            {"expression": "[3, 1].sort() == [1, 3] && lists.range(3) == [0, 1, 2]", "message": "lists"},
            {"expression": "isSemver('1.2.3') && semver('1.2.3').major() == 1", "message": "semver"},
            {"expression": "ip('10.0.0.1').family() == 4 && cidr('10.0.0.0/8').containsIP(ip('10.1.2.3'))", "message": "ip"},
            {"expression": "math.greatest(1, 5) == 5", "message": "math"},
            {"expression": "'%s-%d'.format(['a', 1]) == 'a-1'", "message": "format"},
            {"expression": "duration('2m') == duration('120s')", "message": "duration"},
            {"expression": "optional.none().orValue(7) == 7 && optional.of(1).hasValue()", "message": "optional"},
            {"expression": "cel.bind(n, object.metadata.name, n + n == 'llmllm')", "message": "bind"},
            {"expression": "object.metadata.labels.all(k, v, k.size() > 0 && v.size() > 0)", "message": "two-variable all"},
            {"expression": "[10, 20].transformList(i, x, i * x) == [0, 20]", "message": "transformList"},
            {"expression": "{'a': 1}.transformMap(k, v, v + 1) == {'a': 2}", "message": "transformMap"},
            {"expression": "1 == 1.0 && 2u == 2 && 1 < 2u && 'é'.size() == 1 && dyn(3) == 3.0", "message": "numbers and sizes"}
        ]}),
    )]);
    let out = eval(&s, deployment());
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert!(out.denials.is_empty(), "{:?}", out.denials);
}

#[test]
fn delete_has_no_object() {
    let s = set(vec![policy(
        "del",
        json!({
            "matchConstraints": {"resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments"], "operations": ["DELETE"]}]},
            "validations": [{"expression": "object == null && oldObject.metadata.name == 'llm'", "message": "x"}]
        }),
    )]);
    let mut input = EvalInput::for_object(deployment(), Operation::Delete);
    input.old_object = input.object.take();
    let out = s.evaluate(&input);
    assert!(out.allowed(), "{:?} {:?}", out.denials, out.errors);
    assert!(out.patched_object.is_none());
}

#[test]
fn policy_set_is_send_sync_and_cheap_to_clone() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<PolicySet>();
    let s = set(vec![policy(
        "p",
        json!({"validations": [{"expression": "true"}]}),
    )]);
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || eval(&s, deployment()).allowed())
        })
        .collect();
    for h in handles {
        assert!(h.join().unwrap());
    }
}

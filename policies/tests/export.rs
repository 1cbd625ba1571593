//! Export of ServingPolicies to ValidatingAdmissionPolicy / MutatingAdmissionPolicy
//! (`hearth_policies::export`): which policies export, why the others do not, and that the
//! runtime condition picks the runtime `resolve_runtime` picks. The apiserver's side of the
//! comparison is `tests/e2e/tests/policy_export.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use common::*;
use hearth_crds::InferenceRuntime;
use hearth_policies::export::{self, Kind, Target};
use hearth_policies::expression::{Expression, Path as EvalPath};
use hearth_policies::manifest::{self, Bundle};
use hearth_policies::value::json_to_cel;
use hearth_policies::{Selection, resolve_runtime};
use rstest::rstest;
use serde_json::{Value, json};

fn bundle(dirs: &[&str]) -> Bundle {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut b = Bundle::default();
    for d in dirs {
        manifest::read_path(&root.join(d), &mut b).unwrap();
    }
    b
}

fn constructs(reasons: &[export::Reason]) -> BTreeSet<&str> {
    reasons.iter().map(|r| r.construct.as_str()).collect()
}

/// (apiVersion, kind) of each exported object, or the constructs that stop the export.
type Exported = Result<Vec<(String, String)>, BTreeSet<String>>;

/// Every built-in and example policy: what it exports to on Kubernetes 1.35 (MutatingAdmission
/// Policy v1beta1), or the constructs that keep it in the webhook.
#[test]
fn builtins_and_examples_export_or_say_why() {
    let b = bundle(&[
        "policies/builtin",
        "examples/ascend",
        "examples/cambricon",
        "examples/hami",
    ]);
    let target = Target::for_kubernetes(35);
    let skip = export::skipped_namespaces("hearth-system");
    let mut got: BTreeMap<String, Exported> = BTreeMap::new();
    for p in &b.policies {
        let name = p.metadata.name.clone().unwrap();
        let out = export::export(p, &b.runtimes, &target, &skip)
            .map(|objects| {
                objects
                    .iter()
                    .map(|o| {
                        (
                            o["apiVersion"].as_str().unwrap().to_owned(),
                            o["kind"].as_str().unwrap().to_owned(),
                        )
                    })
                    .collect()
            })
            .map_err(|r| constructs(&r).into_iter().map(str::to_owned).collect());
        got.insert(name, out);
    }
    let vap = || {
        Ok(vec![
            (
                "admissionregistration.k8s.io/v1".to_owned(),
                "ValidatingAdmissionPolicy".to_owned(),
            ),
            (
                "admissionregistration.k8s.io/v1".to_owned(),
                "ValidatingAdmissionPolicyBinding".to_owned(),
            ),
        ])
    };
    let map = Ok(vec![
        (
            "admissionregistration.k8s.io/v1beta1".to_owned(),
            "MutatingAdmissionPolicy".to_owned(),
        ),
        (
            "admissionregistration.k8s.io/v1beta1".to_owned(),
            "MutatingAdmissionPolicyBinding".to_owned(),
        ),
    ]);
    let not = |c: &[&str]| Err(c.iter().map(|s| (*s).to_owned()).collect::<BTreeSet<_>>());
    let want = BTreeMap::from([
        ("hearth-model-container".to_owned(), vap()),
        ("hearth-model-port-name".to_owned(), vap()),
        (
            "hearth-serving-defaults".to_owned(),
            not(&["service", "settings", "math.greatest"]),
        ),
        ("hearth-ascend-host-driver".to_owned(), map),
        ("ascend-device-count".to_owned(), vap()),
        ("internal-registry".to_owned(), vap()),
        ("hami-fraction".to_owned(), not(&["service"])),
    ]);
    assert_eq!(got, want);
}

#[test]
fn an_export_keeps_the_webhooks_scope_actions_and_reason() {
    let b = bundle(&["policies/builtin", "examples/cambricon"]);
    let p = b
        .policies
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some("hearth-model-port-name"))
        .unwrap();
    let objects = export::export(
        p,
        &b.runtimes,
        &Target::for_kubernetes(35),
        &export::skipped_namespaces("hearth-system"),
    )
    .unwrap();
    let (policy, binding) = (&objects[0], &objects[1]);
    assert_eq!(policy["metadata"]["name"], "hearth-model-port-name");
    assert_eq!(
        policy["metadata"]["labels"][export::EXPORTED_FROM],
        "hearth-model-port-name"
    );
    assert_eq!(
        policy["spec"]["paramKind"],
        json!({"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "InferenceRuntime"})
    );
    let conditions: Vec<&str> = policy["spec"]["matchConditions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        conditions,
        [
            export::SCOPE_CONDITION,
            export::RUNTIME_CONDITION,
            "runtime-resolved"
        ]
    );
    let rules = &policy["spec"]["matchConstraints"]["resourceRules"];
    assert_eq!(
        rules[0]["resources"],
        json!(["deployments", "statefulsets"])
    );
    assert_eq!(rules[1]["resources"], json!(["pods"]));
    assert_eq!(rules[0]["operations"], json!(["CREATE", "UPDATE"]));
    // Hearth's default reason is Forbidden; the apiserver's would be Invalid.
    assert_eq!(policy["spec"]["validations"][0]["reason"], "Forbidden");
    assert_eq!(binding["spec"]["validationActions"], json!(["Warn"]));
    assert_eq!(
        binding["spec"]["paramRef"],
        json!({"selector": {}, "parameterNotFoundAction": "Allow"})
    );
    assert_eq!(
        binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][0]["values"],
        json!(["kube-system", "hearth-system"])
    );
    // Offline (no uid): no owner reference.
    assert!(policy["metadata"].get("ownerReferences").is_none());
}

#[rstest]
#[case::service("service != null", 35, "service")]
#[case::settings("has(settings.drainImage)", 35, "settings")]
#[case::bind("cel.bind(x, object.a, x == 1)", 35, "cel.bind")]
#[case::base64("base64.encode(b'a') != ''", 35, "base64.encode")]
#[case::math("math.abs(-1) == 1", 35, "math.abs")]
#[case::variadic_max("max(1, 2) == 2", 35, "max(…)")]
#[case::ipv4("isIPv4('1.2.3.4')", 35, "isIPv4")]
#[case::backticks("object.metadata.`name` != ''", 35, "backtick-quoted field name")]
#[case::two_variable("object.metadata.labels.all(k, v, v != '')", 32, "all(k, v, …)")]
#[case::lists_range("lists.range(2).size() == 2", 34, "lists.range")]
#[case::semver("isSemver('1.2.3')", 33, "isSemver")]
#[case::jsonpatch_outside_mutations("jsonpatch.escapeKey('a/b') != ''", 35, "jsonpatch.escapeKey")]
fn a_construct_the_apiserver_lacks_names_the_field(
    #[case] expression: &str,
    #[case] minor: u32,
    #[case] construct: &str,
) {
    let p = policy(
        "p",
        json!({"validations": [{"expression": "true"}, {"expression": expression}]}),
    );
    let reasons = export::reasons(&p.spec, &Target::for_kubernetes(minor));
    let r = reasons
        .iter()
        .find(|r| r.construct == construct)
        .unwrap_or_else(|| panic!("no reason names {construct}: {reasons:?}"));
    assert_eq!(r.field, "spec.validations[1].expression");
    assert!(!r.message.is_empty());
    // The version that has it exports it.
    if ![
        "service",
        "settings",
        "jsonpatch.escapeKey",
        "backtick-quoted field name",
    ]
    .contains(&construct)
        && export::required_minor(construct).is_ok()
    {
        assert!(export::reasons(&p.spec, &Target::for_kubernetes(36)).is_empty());
    }
}

#[test]
fn mutations_need_patch_only_and_a_served_mutating_api() {
    let patch = json!({"patchType": "JSONPatch", "jsonPatch": {"expression":
        "[JSONPatch{op: 'add', path: '/metadata/labels', value: {}}]"}});
    let p = policy(
        "p",
        json!({"mutations": [patch], "mutationActions": ["Audit"]}),
    );
    let reasons = export::reasons(&p.spec, &Target::for_kubernetes(35));
    assert_eq!(constructs(&reasons), BTreeSet::from(["Audit"]));
    assert_eq!(reasons[0].field, "spec.mutationActions");
    let p = policy("p", json!({"mutations": [patch]}));
    assert!(export::reasons(&p.spec, &Target::for_kubernetes(35)).is_empty());
    let reasons = export::reasons(&p.spec, &Target::for_kubernetes(33));
    assert_eq!(
        constructs(&reasons),
        BTreeSet::from(["MutatingAdmissionPolicy"])
    );
    let no_map = Target {
        mutating: None,
        ..Target::for_kubernetes(35)
    };
    assert!(!export::reasons(&p.spec, &no_map).is_empty());
    // jsonpatch in a mutation is the apiserver's.
    let p = policy(
        "p",
        json!({"mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression":
            "[JSONPatch{op: 'add', path: '/metadata/labels/' + jsonpatch.escapeKey('a/b'), value: 'x'}]"}}]}),
    );
    assert!(export::reasons(&p.spec, &Target::for_kubernetes(35)).is_empty());
}

#[test]
fn operations_are_clipped_to_those_the_webhook_receives() {
    let p = policy(
        "p",
        json!({
            "matchConstraints": {"resourceRules": [
                {"apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments"], "operations": ["*"]},
                {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "operations": ["DELETE"]}
            ]},
            "validations": [{"expression": "true"}]
        }),
    );
    let objects = export::export(&p, &[], &Target::for_kubernetes(35), &[]).unwrap();
    assert_eq!(
        objects[0]["spec"]["matchConstraints"]["resourceRules"],
        json!([{"apiGroups": ["apps"], "apiVersions": ["v1"], "resources": ["deployments"], "operations": ["CREATE", "UPDATE"]}])
    );
    let p = policy(
        "p",
        json!({
            "matchConstraints": {"resourceRules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "resources": ["pods"], "operations": ["DELETE"]}
            ]},
            "validations": [{"expression": "true"}]
        }),
    );
    let reasons = export::reasons(&p.spec, &Target::for_kubernetes(35));
    assert_eq!(reasons[0].field, "spec.matchConstraints.resourceRules");
}

fn runtime(name: &str, vendor: &str, priority: i32) -> InferenceRuntime {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "InferenceRuntime",
        "metadata": {"name": name},
        "spec": {"vendor": vendor, "priority": priority,
                 "container": {"image": "img"}, "accelerator": {"resourceName": "x/y"}}
    }))
    .unwrap()
}

/// The `hearth-runtime` condition, evaluated by Hearth's CEL against every runtime, is true for
/// exactly the runtime `resolve_runtime` picks (none when it refuses), across pins, vendor lists,
/// ties and blanks, in annotations and labels.
#[test]
fn the_runtime_condition_picks_the_runtime_hearth_resolves() {
    let runtimes = vec![
        runtime("cuda-a", "nvidia", 10),
        runtime("cuda-b", "nvidia", 5),
        runtime("npu-1", "ascend", 7),
        runtime("npu-2", "ascend", 7),
        runtime("mlu", "cambricon", 1),
        runtime("odd", "odd \"vendor\"", 50),
    ];
    let expr = export::resolution_expression(&runtimes);
    let compiled = Expression::compile(&expr, &["object".to_owned(), "params".to_owned()])
        .unwrap_or_else(|e| panic!("{e}: {expr}"));
    let meta = |m: Value| json!({"kind": "Deployment", "metadata": m});
    let objects = [
        meta(json!({"annotations": {"serving.hearth.dev/runtime": "cuda-b"}})),
        meta(json!({"labels": {"serving.hearth.dev/runtime": " mlu "}})),
        meta(json!({"annotations": {"serving.hearth.dev/runtime": "  "},
                    "labels": {"serving.hearth.dev/runtime": "npu-1"}})),
        meta(json!({"annotations": {"serving.hearth.dev/runtime": "missing"}})),
        meta(json!({"annotations": {"serving.hearth.dev/vendor": "nvidia"}})),
        meta(json!({"annotations": {"serving.hearth.dev/vendor": "ascend,nvidia"}})),
        meta(json!({"annotations": {"serving.hearth.dev/vendor": "intel, cambricon ,nvidia"}})),
        meta(json!({"labels": {"serving.hearth.dev/vendor": "intel"}})),
        meta(json!({"annotations": {"serving.hearth.dev/vendor": ","}})),
        meta(json!({"annotations": {"serving.hearth.dev/vendor": "odd \"vendor\""}})),
        meta(
            json!({"annotations": {"serving.hearth.dev/vendor": "nvidia",
                                    "serving.hearth.dev/runtime": "mlu"}}),
        ),
        meta(json!({"annotations": {"other": "x"}})),
        meta(json!({})),
    ];
    let mut resolved = 0;
    for object in &objects {
        let want = Selection::from_object(object)
            .and_then(|s| resolve_runtime(&runtimes, &s).ok())
            .and_then(|r| r.metadata.name.clone());
        resolved += usize::from(want.is_some());
        let got: Vec<String> = runtimes
            .iter()
            .filter(|r| {
                let params = serde_json::to_value(r).unwrap();
                let out = compiled.evaluate(
                    &[json_to_cel(object), json_to_cel(&params)],
                    EvalPath::Engine,
                );
                match out.result {
                    Ok(kube_cel::cel::Value::Bool(b)) => b,
                    other => panic!("{object}: {other:?}"),
                }
            })
            .map(|r| r.metadata.name.clone().unwrap())
            .collect();
        assert_eq!(got, want.into_iter().collect::<Vec<_>>(), "{object}");
    }
    assert!(resolved >= 7, "only {resolved} objects resolved");
    // The table is part of what an exported object records.
    let fewer = &runtimes[..3];
    assert_ne!(
        export::runtimes_digest(&runtimes),
        export::runtimes_digest(fewer)
    );
    let reordered: Vec<InferenceRuntime> = runtimes.iter().rev().cloned().collect();
    assert_eq!(
        export::runtimes_digest(&runtimes),
        export::runtimes_digest(&reordered)
    );
}

#[test]
fn a_policy_counts_as_exported_only_with_all_its_objects_of_this_generation() {
    let mut p = policy(
        "p",
        json!({"validations": [{"expression": "true"}],
               "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": "[]"}}]}),
    );
    p.metadata.uid = Some("u1".to_owned());
    p.metadata.generation = Some(2);
    let runtimes = vec![runtime("cuda-a", "nvidia", 1)];
    let digest = export::runtimes_digest(&runtimes);
    let objects = export::export(&p, &runtimes, &Target::for_kubernetes(35), &[]).unwrap();
    assert_eq!(
        objects[0]["metadata"]["ownerReferences"][0]["uid"],
        json!("u1")
    );
    let stored = |enforced: bool| -> BTreeMap<(Kind, String), BTreeMap<String, String>> {
        objects
            .iter()
            .map(|o| {
                let kind = Kind::from_name(o["kind"].as_str().unwrap()).unwrap();
                let mut a: BTreeMap<String, String> =
                    serde_json::from_value(o["metadata"]["annotations"].clone()).unwrap();
                if enforced && kind.is_binding() {
                    a.insert(export::ENFORCED.to_owned(), "true".to_owned());
                }
                (
                    (kind, o["metadata"]["name"].as_str().unwrap().to_owned()),
                    a,
                )
            })
            .collect()
    };
    let (enforced, loaded) = (stored(true), stored(false));
    let all = |k: Kind, n: &str| enforced.get(&(k, n.to_owned())).cloned();
    assert!(export::is_exported(&p, &digest, &all));
    // Not before the export mode marks the bindings enforced.
    let not_yet = |k: Kind, n: &str| loaded.get(&(k, n.to_owned())).cloned();
    assert!(!export::is_exported(&p, &digest, &not_yet));
    let no_binding = |k: Kind, n: &str| {
        (k != Kind::MutatingAdmissionPolicyBinding)
            .then(|| all(k, n))
            .flatten()
    };
    assert!(!export::is_exported(&p, &digest, &no_binding));
    assert!(!export::is_exported(&p, "0000000000000000", &all));
    p.metadata.generation = Some(3);
    assert!(!export::is_exported(&p, &digest, &all));
    p.metadata.generation = Some(2);
    p.metadata.uid = Some("u2".to_owned());
    assert!(!export::is_exported(&p, &digest, &all));
}

#[test]
fn names_the_export_cannot_carry_are_reasons() {
    let long = "p".repeat(64);
    let p = policy(&long, json!({"validations": [{"expression": "true"}]}));
    let reasons = export::export(&p, &[], &Target::for_kubernetes(35), &[]).unwrap_err();
    assert_eq!(reasons[0].field, "metadata.name");
    let p = policy(
        "p",
        json!({"matchConditions": [{"name": "hearth-runtime", "expression": "true"}],
               "validations": [{"expression": "true"}]}),
    );
    let reasons = export::reasons(&p.spec, &Target::for_kubernetes(35));
    assert_eq!(reasons[0].field, "spec.matchConditions[0].name");
}

/// What the apiserver's validation refuses and a ServingPolicy allows is a reason, not an
/// object the apiserver would reject.
#[rstest]
#[case::message_line_break(json!({"validations": [{"expression": "true", "message": "a\nb"}]}), "spec.validations[0].message")]
#[case::condition_name(json!({"matchConditions": [{"name": "Bad Name!", "expression": "true"}], "validations": [{"expression": "true"}]}), "spec.matchConditions[0].name")]
#[case::condition_twice(json!({"matchConditions": [{"name": "a", "expression": "true"}, {"name": "a", "expression": "true"}], "validations": [{"expression": "true"}]}), "spec.matchConditions[1].name")]
#[case::reserved_variable(json!({"variables": [{"name": "namespace", "expression": "1"}], "validations": [{"expression": "true"}]}), "spec.variables[0].name")]
#[case::audit_key(json!({"validations": [{"expression": "true"}], "auditAnnotations": [{"key": "a/b", "valueExpression": "'x'"}]}), "spec.auditAnnotations[0].key")]
fn what_the_apiserver_refuses_is_a_reason(#[case] spec: Value, #[case] field: &str) {
    let p = policy("p", spec);
    let reasons = export::reasons(&p.spec, &Target::for_kubernetes(35));
    assert!(
        reasons.iter().any(|r| r.field == field),
        "no reason for {field}: {reasons:?}"
    );
    let upper = policy("Upper", json!({"validations": [{"expression": "true"}]}));
    let reasons = export::export(&upper, &[], &Target::for_kubernetes(35), &[]).unwrap_err();
    assert_eq!(reasons[0].field, "metadata.name");
}

//! Property tests: the engine's JSON Patch applies (with json-patch, the version kube uses) to
//! the input and yields the patched object; keys with `/` and `~` are escaped (RFC 6901);
//! parents are created as objects or arrays; no `replace` of a missing path; no `/-` append
//! to a missing array; mutation is idempotent.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;

use common::*;
use hearth_crds::servingpolicy::Operation;
use hearth_policies::{EvalInput, PolicySet, manifest, merge};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

/// Checks the structural rules on a patch against the document it applies to, op by op.
fn assert_well_formed(original: &Value, patch: &json_patch::Patch) {
    let mut doc = original.clone();
    for op in &patch.0 {
        let text = serde_json::to_value(op).unwrap();
        let path = text["path"].as_str().unwrap().to_owned();
        if let Some(v) = text.get("value") {
            assert_ne!(
                v,
                &json!("{}"),
                "a parent was created as the string \"{{}}\": {text}"
            );
        }
        match op {
            json_patch::PatchOperation::Replace(_) => {
                assert!(
                    doc.pointer(&path).is_some(),
                    "replace of missing path {path}"
                );
            }
            json_patch::PatchOperation::Add(_) => {
                let parent = &path[..path.rfind('/').unwrap()];
                assert!(
                    doc.pointer(parent).is_some(),
                    "add under missing parent {path}"
                );
                if path.ends_with("/-") {
                    assert!(
                        doc.pointer(parent).is_some_and(Value::is_array),
                        "/- on a missing array: {path}"
                    );
                }
            }
            _ => {}
        }
        json_patch::patch(&mut doc, std::slice::from_ref(op)).unwrap();
    }
}

fn key() -> impl Strategy<Value = String> {
    prop::string::string_regex("[a-z~/.]{1,8}").unwrap()
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<i32>().prop_map(|i| json!(i)),
        "[a-z]{0,6}".prop_map(Value::String),
        any::<bool>().prop_map(Value::Bool),
    ]
}

fn json_tree() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

fn annotate_policy() -> PolicySet {
    set(vec![policy(
        "annotate",
        json!({
            "mutations": [{"patchType": "JSONPatch", "jsonPatch": {"expression": r#"
            (has(object.metadata.annotations) ? [] :
              [JSONPatch{op: "add", path: "/metadata/annotations", value: {}}]) +
            params.keys.map(k, JSONPatch{op: "add",
              path: "/metadata/annotations/" + jsonpatch.escapeKey(k), value: params.value})"#}}]
        }),
    )])
}

fn builtins() -> &'static (PolicySet, Vec<hearth_crds::InferenceRuntime>) {
    static SET: std::sync::OnceLock<(PolicySet, Vec<hearth_crds::InferenceRuntime>)> =
        std::sync::OnceLock::new();
    SET.get_or_init(load_builtins)
}

fn load_builtins() -> (PolicySet, Vec<hearth_crds::InferenceRuntime>) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("builtin");
    let mut b = manifest::Bundle::default();
    manifest::read_path(&root, &mut b).unwrap();
    manifest::read_path(&root.join("tests/runtimes"), &mut b).unwrap();
    let (set, errors) = PolicySet::compile(&b.policies);
    assert!(errors.is_empty(), "{errors:?}");
    (set, b.runtimes)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn diff_patch_rebuilds_the_target(a in json_tree(), b in json_tree()) {
        let (a, b) = (json!({"root": a}), json!({"root": b}));
        let patch = json_patch::diff(&a, &b);
        assert_well_formed(&a, &patch);
        let mut doc = a.clone();
        json_patch::patch(&mut doc, &patch).unwrap();
        prop_assert_eq!(doc, b);
    }

    #[test]
    fn escaped_keys_land_where_expected(keys in prop::collection::btree_set(key(), 1..6),
                                        existing in prop::option::of(prop::collection::btree_map(key(), "[a-z]{1,4}", 0..3))) {
        let s = annotate_policy();
        let mut obj = deployment();
        match &existing {
            Some(m) => obj["metadata"]["annotations"] = json!(m),
            None => { obj["metadata"].as_object_mut().unwrap().remove("annotations"); }
        }
        let mut input = EvalInput::for_object(obj.clone(), Operation::Create);
        input.params = Some(json!({"keys": keys, "value": "v"}));
        let out = s.evaluate(&input);
        prop_assert!(out.errors.is_empty(), "{:?}", out.errors);
        let patched = out.patched_object.clone().unwrap();
        for k in &keys {
            prop_assert_eq!(&patched["metadata"]["annotations"][k], &json!("v"));
        }
        if let Some(m) = &existing {
            for (k, v) in m {
                if !keys.contains(k) {
                    prop_assert_eq!(&patched["metadata"]["annotations"][k], &json!(v));
                }
            }
        }
        assert_well_formed(&obj, &out.patch);
        let mut doc = obj.clone();
        json_patch::patch(&mut doc, &out.patch).unwrap();
        prop_assert_eq!(&doc, &patched);
        // Idempotent.
        input.object = Some(patched);
        prop_assert!(s.evaluate(&input).patch.0.is_empty());
    }

    #[test]
    fn apply_configuration_merge_is_idempotent_and_keeps_patch_leaves(t in json_tree(), p in json_tree()) {
        let (mut t, p) = (json!({"spec": t}), json!({"spec": p}));
        merge::apply(&mut t, &p);
        let once = t.clone();
        merge::apply(&mut t, &p);
        prop_assert_eq!(&t, &once);
        if let (Some(pv), Some(tv)) = (p.pointer("/spec"), t.pointer("/spec"))
            && !pv.is_object() && !pv.is_null()
        {
            prop_assert_eq!(pv, tv);
        }
    }

}

proptest! {
    // Each case runs the whole built-in set twice.
    #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

    #[test]
    fn builtins_are_idempotent_and_patch_correctly(
        names in prop::collection::btree_set("(vllm|engine|sidecar|proxy)", 1..4),
        named in any::<bool>(),
        ports in any::<bool>(),
        probes in any::<bool>(),
        selector in any::<bool>(),
        volumes in any::<bool>(),
        vendor in prop::sample::select(vec!["vllm-nvidia-a10", "vllm-ascend"]),
        kind in prop::sample::select(vec!["Deployment", "Pod"]),
    ) {
        let (set, runtimes) = builtins();
        let names: Vec<String> = names.into_iter().collect();
        let containers: Vec<Value> = names.iter().enumerate().map(|(i, n)| {
            let mut c = json!({"name": n, "image": "img"});
            if ports && i == 0 { c["ports"] = json!([{"name": "http", "containerPort": 8000}]); }
            if probes { c["readinessProbe"] = json!({"tcpSocket": {"port": 8000}}); }
            if volumes { c["volumeMounts"] = json!([{"name": "data", "mountPath": "/data"}]); }
            c
        }).collect();
        let mut pod = json!({"containers": containers});
        if selector { pod["nodeSelector"] = json!({"zone": "a"}); }
        if volumes { pod["volumes"] = json!([{"name": "data", "emptyDir": {}}]); }
        let mut annotations = json!({"serving.hearth.dev/runtime": vendor});
        if named { annotations["serving.hearth.dev/container"] = json!(names.last().unwrap()); }
        let obj = if kind == "Pod" {
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "namespace": "n", "annotations": annotations}, "spec": pod})
        } else {
            json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "n", "annotations": annotations},
                   "spec": {"selector": {}, "template": {"spec": pod}}})
        };
        let rt = runtimes.iter().find(|r| r.metadata.name.as_deref() == Some(vendor)).unwrap();
        let mut input = EvalInput::for_object(obj.clone(), Operation::Create);
        input.params = Some(manifest::runtime_params(rt));
        let out = set.evaluate(&input);
        prop_assert!(out.errors.is_empty(), "{:?}", out.errors);
        let patched = out.patched_object.clone().unwrap();
        assert_well_formed(&obj, &out.patch);
        let mut doc = obj.clone();
        json_patch::patch(&mut doc, &out.patch).unwrap();
        prop_assert_eq!(&doc, &patched);
        // Every container except the model container is untouched.
        let model = if named {
            names.last().unwrap().clone()
        } else if names.iter().any(|n| n == "vllm") {
            "vllm".to_owned()
        } else if ports || names.len() == 1 {
            names[0].clone()
        } else {
            String::new()
        };
        let spec = if kind == "Pod" { &patched["spec"] } else { &patched["spec"]["template"]["spec"] };
        for (i, c) in spec["containers"].as_array().unwrap().iter().enumerate() {
            let orig = &obj.pointer(if kind == "Pod" { "/spec/containers" } else { "/spec/template/spec/containers" }).unwrap()[i];
            if c["name"] != json!(model) {
                prop_assert_eq!(c, orig);
            } else {
                let res = rt.spec.accelerator.resource_name.as_str();
                prop_assert_eq!(&c["resources"]["limits"][res], &json!("1"));
                prop_assert!(c["startupProbe"].is_object() && c["livenessProbe"].is_object());
                if probes { prop_assert_eq!(&c["readinessProbe"], &json!({"tcpSocket": {"port": 8000}})); }
            }
        }
        prop_assert_eq!(out.allowed(), !model.is_empty(), "{:?}", out.denials);
        // A second pass over the patched object changes nothing.
        let mut again = input.clone();
        again.object = Some(patched.clone());
        let second = set.mutate(&again).unwrap();
        prop_assert!(second.patch.0.is_empty(), "second pass patched {:?}", second.patch);
        prop_assert_eq!(second.object, patched);
    }
}

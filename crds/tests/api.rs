//! The API contract: generated CRDs are fresh, the public Hearth examples round-trip through
//! the types, and the CRDs' CEL rules accept good objects and reject bad ones with their
//! messages (evaluated offline with kube-cel's validator, as the apiserver would).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::{Path, PathBuf};

use hearth_crds::{InferenceRuntime, LLMService, ServingPolicy};
use kube::CustomResourceExt;
use serde_json::Value;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The shared upstream examples live beside the repository (`../shared/examples/upstream`);
/// `HEARTH_UPSTREAM_EXAMPLES` points elsewhere. Panics when the directory is missing, naming
/// where it looked and how to provide it.
fn upstream_dir() -> PathBuf {
    let from_env = std::env::var_os("HEARTH_UPSTREAM_EXAMPLES");
    let source = if from_env.is_some() {
        "HEARTH_UPSTREAM_EXAMPLES names it"
    } else {
        "HEARTH_UPSTREAM_EXAMPLES is unset, so the default beside the checkout was used"
    };
    let dir = from_env
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("../shared/examples/upstream"));
    assert!(
        dir.is_dir(),
        "upstream examples not found at {} ({source}): put the public Hearth example manifests \
         at ../shared/examples/upstream beside the checkout, or set HEARTH_UPSTREAM_EXAMPLES to \
         a directory holding them",
        dir.display()
    );
    dir
}

fn upstream(kind: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(upstream_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    entries.sort();
    for path in entries {
        let text = std::fs::read_to_string(&path).unwrap();
        let value: Value = serde_yaml::from_str(&text).unwrap();
        if value["kind"] == kind {
            out.push((
                path.file_name().unwrap().to_string_lossy().into_owned(),
                value,
            ));
        }
    }
    assert!(
        !out.is_empty(),
        "no upstream {kind} examples in {}: it must hold the public Hearth example manifests \
         (../shared/examples/upstream beside the checkout, or HEARTH_UPSTREAM_EXAMPLES)",
        upstream_dir().display()
    );
    out
}

/// Every leaf of `input` is present, equal, in `output` (defaults may add fields; none may go).
fn assert_superset(input: &Value, output: &Value, path: &str) {
    match (input, output) {
        (Value::Object(a), Value::Object(b)) => {
            for (k, v) in a {
                let o = b
                    .get(k)
                    .unwrap_or_else(|| panic!("field {path}.{k} was lost in the round trip"));
                assert_superset(v, o, &format!("{path}.{k}"));
            }
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "list {path} changed length");
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert_superset(x, y, &format!("{path}[{i}]"));
            }
        }
        _ => assert_eq!(input, output, "value at {path} changed"),
    }
}

#[test]
fn checked_in_crds_are_fresh() {
    for (file, crd) in hearth_crds::crds() {
        let path = repo_root().join("crds").join(file);
        let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
        let generated = hearth_crds::crd_yaml(&crd).unwrap();
        assert!(
            checked_in == generated,
            "crds/{file} is stale: run `cargo run -p hearth-crds --example crdgen` and commit the result"
        );
    }
}

#[test]
fn crds_have_names_categories_and_status() {
    for (_, crd) in hearth_crds::crds() {
        let names = &crd.spec.names;
        assert_eq!(crd.spec.group, "serving.hearth.dev");
        assert_eq!(
            names.categories.as_deref(),
            Some(&["hearth".to_owned()][..])
        );
        assert!(names.short_names.as_ref().is_some_and(|s| !s.is_empty()));
        let version = &crd.spec.versions[0];
        assert_eq!(version.name, "v1alpha1");
        assert!(version.subresources.as_ref().unwrap().status.is_some());
    }
    assert_eq!(LLMService::crd().spec.scope, "Namespaced");
    assert_eq!(InferenceRuntime::crd().spec.scope, "Cluster");
    assert_eq!(ServingPolicy::crd().spec.scope, "Cluster");
}

#[test]
fn printer_columns_match_upstream() {
    let columns = |crd: k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition| {
        crd.spec.versions[0]
            .additional_printer_columns
            .clone()
            .unwrap()
            .into_iter()
            .map(|c| (c.name, c.json_path, c.priority.unwrap_or(0)))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        columns(LLMService::crd()),
        [
            ("Phase".into(), ".status.phase".into(), 0),
            ("Runtime".into(), ".status.resolvedRuntime".into(), 0),
            ("Replicas".into(), ".status.replicas".into(), 0),
            ("Age".into(), ".metadata.creationTimestamp".into(), 0),
            // A Hearth extension, shown by `kubectl get -o wide` only.
            (
                "Last Activation".into(),
                ".status.lastActivation.phases.total".into(),
                1
            ),
        ]
    );
    assert_eq!(
        columns(InferenceRuntime::crd()),
        [
            ("Family".into(), ".spec.family".into(), 0),
            ("Vendor".into(), ".spec.vendor".into(), 0),
            ("Image".into(), ".spec.container.image".into(), 1),
            ("Age".into(), ".metadata.creationTimestamp".into(), 0),
        ]
    );
}

/// Every upstream example of `kind` deserializes as `K` and serializes back to a superset of
/// itself.
fn assert_upstream_round_trips<K: serde::de::DeserializeOwned + serde::Serialize>(kind: &str) {
    for (file, input) in upstream(kind) {
        let typed: K = serde_json::from_value(input.clone())
            .unwrap_or_else(|e| panic!("{file} does not deserialize: {e}"));
        let output = serde_json::to_value(&typed).unwrap();
        assert_superset(&input, &output, &file);
    }
}

#[test]
fn upstream_llmservices_round_trip() {
    assert_upstream_round_trips::<LLMService>("LLMService");
}

#[test]
fn upstream_runtimes_round_trip() {
    assert_upstream_round_trips::<InferenceRuntime>("InferenceRuntime");
}

#[test]
fn defaults_match_upstream() {
    let svc: LLMService = serde_json::from_value(serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "m"},
        "spec": {"model": {"source": {"uri": "hf://a/b"}}}
    }))
    .unwrap();
    let s = &svc.spec;
    assert_eq!(s.resources.accelerators, 1);
    assert_eq!((s.scaling.min, s.scaling.max, s.scaling.target), (0, 1, 10));
    assert_eq!(
        s.scaling.metric,
        hearth_crds::llmservice::ScalingMetric::QueueDepth
    );
    assert_eq!(s.scaling.activation_timeout.as_str(), "5m");
    assert_eq!(s.scaling.scale_down_stabilization.as_str(), "5m");
    assert_eq!(s.scaling.drain_timeout.as_str(), "2m");
    assert_eq!(
        s.cache.strategy,
        hearth_crds::llmservice::CacheStrategy::NodeLocalPVC
    );
    assert_eq!(
        s.endpoint.cold_start.mode,
        hearth_crds::llmservice::ColdStartMode::Keepalive
    );
    assert_eq!(s.endpoint.cold_start.heartbeat_interval.as_str(), "10s");
    assert!(s.endpoint.openai_compatible);

    let rt: InferenceRuntime = serde_json::from_value(serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": "r"},
        "spec": {"vendor": "cambricon", "container": {"image": "i"},
                 "accelerator": {"resourceName": "cambricon.com/mlu"},
                 "metrics": {}}
    }))
    .unwrap();
    assert_eq!(
        rt.spec.family,
        hearth_crds::inferenceruntime::RuntimeFamily::Vllm
    );
    assert_eq!(rt.spec.container.port.name, "http");
    assert_eq!(rt.spec.container.port.container_port, 8000);
    assert_eq!(rt.spec.metrics.unwrap().path, "/metrics");
}

fn schema_of(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
) -> Value {
    serde_json::to_value(
        crd.spec.versions[0]
            .schema
            .as_ref()
            .unwrap()
            .open_api_v3_schema
            .as_ref()
            .unwrap(),
    )
    .unwrap()
}

/// The messages of the CEL rules an object breaks, evaluated as the apiserver would (defaults
/// applied first).
fn cel_errors(
    crd: &k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    object: &Value,
) -> Vec<String> {
    match kube_cel::Validator::new().validate(&schema_of(crd), object, None) {
        Ok(()) => Vec::new(),
        Err(errors) => errors
            .into_vec()
            .into_iter()
            .map(|e| format!("{}: {}", e.field_path, e.message))
            .collect(),
    }
}

#[test]
fn upstream_examples_pass_the_crd_rules() {
    for (file, obj) in upstream("LLMService") {
        assert_eq!(
            cel_errors(&LLMService::crd(), &obj),
            Vec::<String>::new(),
            "{file}"
        );
    }
    for (file, obj) in upstream("InferenceRuntime") {
        assert_eq!(
            cel_errors(&InferenceRuntime::crd(), &obj),
            Vec::<String>::new(),
            "{file}"
        );
    }
}

fn service_with(scaling: Value) -> Value {
    serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "bad", "namespace": "default"},
        "spec": {"model": {"source": {"uri": "hf://a/b"}}, "scaling": scaling}
    })
}

#[rstest::rstest]
#[case(serde_json::json!({"min": 3, "max": 1}), "scaling.min must not exceed scaling.max")]
#[case(serde_json::json!({"scaleDownStabilization": "2h"}), "scaleDownStabilization must be at most 1h")]
#[case(serde_json::json!({"scaleDownStabilization": "1.5s"}), "scaleDownStabilization must be whole seconds")]
#[case(serde_json::json!({"scaleDownStabilization": "1500ms"}), "scaleDownStabilization must be whole seconds")]
#[case(serde_json::json!({"max": 2, "warmWindows": [
    {"timezone": "UTC", "start": "0 8 * * *", "end": "0 18 * * *", "replicas": 1},
    {"timezone": "UTC", "start": "0 9 * * *", "end": "0 17 * * *", "replicas": 3}
]}), "scaling.warmWindows[].replicas must not exceed scaling.max")]
#[case(serde_json::json!({"warmWindows": [{"timezone": "UTC", "start": "0 8 * * *", "end": "0 18 * * *", "replicas": 2}]}), "scaling.warmWindows[].replicas must not exceed scaling.max")]
#[case(serde_json::json!({"warmWindows": [{"timezone": "UTC", "start": "0 8 * * *", "end": "0 8 * * *", "replicas": 1}]}), "start and end must differ")]
fn bad_scaling_is_rejected_with_the_rules_message(#[case] scaling: Value, #[case] message: &str) {
    let errors = cel_errors(&LLMService::crd(), &service_with(scaling));
    assert!(
        errors.iter().any(|e| e.contains(message)),
        "expected an error containing {message:?}, got {errors:?}"
    );
}

#[rstest::rstest]
#[case(serde_json::json!({"min": 1, "max": 1}))]
#[case(serde_json::json!({"min": 0, "max": 4, "scaleDownStabilization": "1h"}))]
#[case(serde_json::json!({"scaleDownStabilization": "90s"}))]
#[case(serde_json::json!({}))]
#[case(serde_json::json!({"max": 3, "warmWindows": [
    {"timezone": "Europe/Berlin", "start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI", "replicas": 3},
    {"timezone": "UTC", "start": "0 22 * * *", "end": "0 6 * * *", "replicas": 1}
]}))]
#[case(serde_json::json!({"warmWindows": []}))]
fn good_scaling_is_accepted(#[case] scaling: Value) {
    assert_eq!(
        cel_errors(&LLMService::crd(), &service_with(scaling)),
        Vec::<String>::new()
    );
}

#[test]
fn empty_fraction_and_missing_model_are_rejected() {
    let mut svc = service_with(serde_json::json!({}));
    svc["spec"]["resources"] = serde_json::json!({"fraction": {}});
    let errors = cel_errors(&LLMService::crd(), &svc);
    assert!(
        errors.iter().any(|e| e.contains("fraction must request")),
        "{errors:?}"
    );

    svc["spec"]["resources"] = serde_json::json!({"fraction": {"memory": "8Gi"}});
    assert_eq!(cel_errors(&LLMService::crd(), &svc), Vec::<String>::new());

    svc["spec"]["model"] = serde_json::json!({});
    let errors = cel_errors(&LLMService::crd(), &svc);
    assert!(
        errors.iter().any(|e| e.contains("set model.source.uri")),
        "{errors:?}"
    );
}

#[test]
fn mutation_needs_its_expression() {
    let policy = serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "ServingPolicy",
        "metadata": {"name": "p"},
        "spec": {"mutations": [{"patchType": "JSONPatch"}]}
    });
    let errors = cel_errors(&ServingPolicy::crd(), &policy);
    assert!(
        errors
            .iter()
            .any(|e| e.contains("needs jsonPatch.expression")),
        "{errors:?}"
    );
}

/// Every string or list a CEL rule reads (`self`, or `self.<field>`) is bounded, so the
/// apiserver's cost estimator accepts the rule (KEP-2876: unbounded inputs make the estimated
/// cost exceed the per-rule limit).
#[test]
fn rule_inputs_are_bounded() {
    fn check_bounded(schema: &Value, path: &str) {
        match schema.get("type").and_then(Value::as_str) {
            Some("string") if schema.get("enum").is_none() => assert!(
                schema.get("maxLength").is_some(),
                "{path}: a string a CEL rule reads needs maxLength"
            ),
            Some("array") => assert!(
                schema.get("maxItems").is_some(),
                "{path}: a list a CEL rule reads needs maxItems"
            ),
            _ => {}
        }
    }
    fn walk(schema: &Value, path: &str, rules_seen: &mut usize) {
        if let Some(rules) = schema
            .get("x-kubernetes-validations")
            .and_then(Value::as_array)
        {
            for rule in rules {
                *rules_seen += 1;
                let text = rule["rule"].as_str().unwrap();
                check_bounded(schema, path);
                if let Some(props) = schema.get("properties").and_then(Value::as_object) {
                    for (name, prop) in props {
                        if text.contains(&format!("self.{name}")) {
                            check_bounded(prop, &format!("{path}.{name}"));
                        }
                    }
                }
            }
        }
        if let Some(props) = schema.get("properties").and_then(Value::as_object) {
            for (k, v) in props {
                walk(v, &format!("{path}.{k}"), rules_seen);
            }
        }
        if let Some(items) = schema.get("items") {
            walk(items, &format!("{path}[]"), rules_seen);
        }
    }
    let mut rules_seen = 0;
    for (file, crd) in hearth_crds::crds() {
        walk(&schema_of(&crd), file, &mut rules_seen);
    }
    assert!(
        rules_seen >= 9,
        "expected the CRDs' CEL rules, found {rules_seen}"
    );
}

/// The schema's bound on `warmWindows` is the one the rules apply.
#[test]
fn warm_windows_bound_matches_the_rules() {
    let schema = schema_of(&LLMService::crd());
    let windows =
        &schema["properties"]["spec"]["properties"]["scaling"]["properties"]["warmWindows"];
    assert_eq!(
        windows["maxItems"].as_u64(),
        Some(hearth_crds::rules::MAX_WARM_WINDOWS as u64)
    );
    assert_eq!(
        windows["items"]["required"],
        serde_json::json!(["end", "replicas", "start", "timezone"])
    );
}

/// The schema's range of `priority` is the one the rules apply, and its default is 0; a
/// missing `minResidency` defaults to 2m.
#[test]
fn priority_bounds_match_the_rules() {
    let schema = schema_of(&LLMService::crd());
    let scaling = &schema["properties"]["spec"]["properties"]["scaling"]["properties"];
    assert_eq!(
        scaling["priority"]["minimum"].as_f64(),
        Some(f64::from(hearth_crds::rules::MIN_PRIORITY))
    );
    assert_eq!(
        scaling["priority"]["maximum"].as_f64(),
        Some(f64::from(hearth_crds::rules::MAX_PRIORITY))
    );
    assert_eq!(scaling["priority"]["default"], serde_json::json!(0));
    assert_eq!(scaling["minResidency"]["default"], serde_json::json!("2m"));
}

fn endpoint_with(spec: Value) -> Value {
    serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "shared", "namespace": "default"},
        "spec": spec
    })
}

/// The CRD's CEL rule on `allowedServices.namespaces` and `hearth_crds::rules::check_llmendpoint`
/// (which the webhook and the controller apply) accept and refuse the same endpoints.
#[rstest::rstest]
#[case(serde_json::json!({}), true)]
#[case(serde_json::json!({"allowedServices": {"namespaces": {"from": "Same"}}}), true)]
#[case(serde_json::json!({"allowedServices": {"namespaces": {"from": "All"}}}), true)]
#[case(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchLabels": {"team": "ml"}}}}}), true)]
#[case(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {}}}}), true)]
#[case(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector"}}}), false)]
#[case(serde_json::json!({"allowedServices": {"namespaces": {"selector": {"matchLabels": {"team": "ml"}}}}}), false)]
#[case(serde_json::json!({"allowedServices": {"namespaces": {"from": "All", "selector": {}}}}), false)]
fn endpoint_namespaces_rule_agrees_with_the_rules_module(#[case] spec: Value, #[case] ok: bool) {
    use hearth_crds::LLMEndpoint;
    let object = endpoint_with(spec);
    let cel = cel_errors(&LLMEndpoint::crd(), &object);
    let typed: LLMEndpoint = serde_json::from_value(object.clone()).unwrap();
    let findings = hearth_crds::rules::check_llmendpoint(&typed);
    assert_eq!(cel.is_empty(), ok, "CRD: {cel:?} for {object}");
    assert_eq!(
        !findings.blocks_rendering(),
        ok,
        "rules: {findings} for {object}"
    );
    if !ok {
        assert!(
            cel.iter().any(|e| e.contains("namespaces.selector exactly when namespaces.from is Selector")),
            "{cel:?}"
        );
        assert!(
            findings
                .errors()
                .all(|e| e.field == "spec.allowedServices.namespaces.selector"),
            "{findings}"
        );
    }
}

/// The schema's bounds on an endpoint's replicas are the ones the rules apply.
#[test]
fn endpoint_replicas_bounds_match_the_rules() {
    use hearth_crds::LLMEndpoint;
    let schema = schema_of(&LLMEndpoint::crd());
    let replicas = &schema["properties"]["spec"]["properties"]["replicas"];
    assert_eq!(replicas["minimum"].as_f64(), Some(1.0));
    assert_eq!(
        replicas["maximum"].as_f64(),
        Some(f64::from(hearth_crds::rules::MAX_GATEWAY_REPLICAS))
    );
    let r#ref = &schema_of(&LLMService::crd())["properties"]["spec"]["properties"]["endpoint"]["properties"]
        ["sharedEndpointRef"]["properties"];
    assert_eq!(r#ref["name"]["maxLength"].as_u64(), Some(63));
    assert_eq!(r#ref["namespace"]["maxLength"].as_u64(), Some(63));
}

/// The schema's bounds on tenants are the rules': the band's range, at most 100 (a list map by
/// name, so names are unique), `containerConcurrency` in 1..=100000.
#[test]
fn tenant_bounds_match_the_rules() {
    use hearth_crds::LLMEndpoint;
    let schema = schema_of(&LLMService::crd());
    let endpoint = &schema["properties"]["spec"]["properties"]["endpoint"]["properties"];
    let ep_schema = schema_of(&LLMEndpoint::crd());
    for tenants in [
        &endpoint["tenants"],
        &ep_schema["properties"]["spec"]["properties"]["tenants"],
    ] {
        assert_eq!(tenants["maxItems"].as_u64(), Some(100));
        assert_eq!(tenants["x-kubernetes-list-type"], "map");
        assert_eq!(
            tenants["x-kubernetes-list-map-keys"],
            serde_json::json!(["name"])
        );
        let priority = &tenants["items"]["properties"]["priority"];
        assert_eq!(
            priority["minimum"].as_f64(),
            Some(f64::from(hearth_crds::rules::MIN_PRIORITY))
        );
        assert_eq!(
            priority["maximum"].as_f64(),
            Some(f64::from(hearth_crds::rules::MAX_PRIORITY))
        );
    }
    assert_eq!(
        endpoint["containerConcurrency"]["maximum"].as_f64(),
        Some(f64::from(hearth_crds::rules::MAX_CONTAINER_CONCURRENCY))
    );
}

/// The CRD's rule on a tenant's keys and `hearth_crds::rules::check_llmservice` accept and
/// refuse the same tenants.
#[rstest::rstest]
#[case(serde_json::json!([{"name": "team-a", "apiKeySecretRef": {"name": "a-keys"}}]), true)]
#[case(serde_json::json!([{"name": "default", "requestsPerMinute": 60}]), true)]
#[case(serde_json::json!([{"name": "team-a", "priority": 10}]), false)]
fn tenant_keys_rule_agrees_with_the_rules_module(#[case] tenants: Value, #[case] ok: bool) {
    let object = serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "m", "namespace": "default"},
        "spec": {"model": {"source": {"uri": "hf://a/b"}}, "endpoint": {"tenants": tenants}}
    });
    let cel = cel_errors(&LLMService::crd(), &object);
    let typed: LLMService = serde_json::from_value(object.clone()).unwrap();
    let findings = hearth_crds::rules::check_llmservice(&typed, None);
    assert_eq!(cel.is_empty(), ok, "CRD: {cel:?}");
    assert_eq!(findings.errors().next().is_none(), ok, "rules: {findings}");
    if !ok {
        assert!(
            findings
                .errors()
                .all(|e| e.field == "spec.endpoint.tenants[0].apiKeySecretRef"),
            "{findings}"
        );
    }
}

/// `spec.owner`'s schema (a DNS label: at most 63, the label pattern) and
/// `hearth_crds::rules::check_llmservice` accept and refuse the same names.
#[rstest::rstest]
#[case("ml-platform", true)]
#[case("a", true)]
#[case("Team", false)]
#[case("-x", false)]
#[case("x_y", false)]
#[case(&"a".repeat(64), false)]
fn owner_schema_agrees_with_the_rules(#[case] owner: &str, #[case] ok: bool) {
    let schema = schema_of(&LLMService::crd());
    let field = &schema["properties"]["spec"]["properties"]["owner"];
    assert_eq!(field["maxLength"].as_u64(), Some(63));
    assert_eq!(field["pattern"], "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$");
    assert_eq!(hearth_crds::naming::is_dns1123_label(owner), ok);
    let mut svc: LLMService = serde_yaml::from_str(
        "apiVersion: serving.hearth.dev/v1alpha1\nkind: LLMService\nmetadata: {name: s, namespace: ns}\nspec:\n  model: {source: {uri: hf://org/m}}\n  runtime: {name: vllm}\n  resources: {accelerators: 1}\n",
    )
    .unwrap();
    svc.spec.owner = Some(owner.to_owned());
    let findings = hearth_crds::rules::check_llmservice(&svc, None);
    assert_eq!(
        findings.errors().any(|f| f.field == "spec.owner"),
        !ok,
        "{owner:?}: {findings:?}"
    );
}

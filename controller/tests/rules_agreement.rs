//! One case table, two paths: every case goes through the admission webhook's validation
//! (`hearth_webhook::handle` on `/validate`, as the apiserver sends it) and through the
//! controller's plan (`reconcile::desired`: rules, runtime resolution, render, conditions), and
//! both must give the case's verdict:
//!
//! | verdict | webhook | controller |
//! |---|---|---|
//! | `Rendered` | allowed, no warning | children rendered, `Validated=True` `Valid` |
//! | `Warned(field)` | allowed, a warning naming `field` | children rendered, `Validated=True` with a warning reason naming `field` |
//! | `Refused(field, type, reason)` | denied, a cause on `field` | nothing rendered, `type=False` with `reason`, `Validated=False`, phase `Degraded` |
//! | `WaitsForRuntime(field)` | allowed, a warning naming `field` | nothing rendered, `RuntimeResolved=False`, phase `Pending` |
//! | `WaitsForPolicy` | allowed, no warning | nothing rendered, `Ready=False` `PolicyFailed`, phase `Degraded` |
//!
//! A second table does the same for plain Deployments joining an `LLMEndpoint` (the
//! `serving.hearth.dev/endpoint` annotation): the webhook's review of the Deployment against the
//! controller's `attach` and `reconcile::decide_member` (joined, joined with a warning naming
//! the field, or denied ⇔ `InvalidMember` with nothing rendered).
//!
//! `WaitsForRuntime` and `WaitsForPolicy` are the deliberate differences (docs/webhook.md): a
//! runtime that does not exist yet is a warning at admission, so unordered applies (GitOps,
//! `kubectl apply -f dir/`) do not fail, and the controller waits for it; a fraction on a
//! sharing runtime is admitted and rendered by the platform's ServingPolicies, which only the
//! controller's render can tell (here, with the built-ins only, none does).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use hearth_controller::{
    RenderConfig,
    attach::{EndpointKey, attach},
    reconcile::{Desired, MemberDecision, MemberOutcome, MemberView, decide_member, desired},
    status::{self, Cond},
};
use hearth_crds::{InferenceRuntime, LLMEndpoint, LLMService, LLMServicePhase};
use hearth_webhook::{Endpoint, Snapshot, handle};
use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;
use rstest::rstest;
use serde_json::{Value, json};

#[derive(Debug, Clone, Copy)]
enum Verdict {
    Rendered,
    Warned(&'static str),
    Refused(&'static str, &'static str, &'static str),
    WaitsForRuntime(&'static str),
    WaitsForPolicy,
}
use Joining::*;
use Verdict::*;

fn runtime(name: &str, vendor: &str, sharing: bool, args: Value) -> InferenceRuntime {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": name},
        "spec": {
            "vendor": vendor,
            "container": {
                "image": "vllm/vllm-openai:v0.8.5",
                "args": args,
                "port": {"name": "http", "containerPort": 8000},
            },
            "accelerator": {
                "resourceName": "nvidia.com/gpu",
                "sharing": {"supported": sharing},
            },
        }
    }))
    .expect("a valid InferenceRuntime")
}

fn runtimes() -> Vec<InferenceRuntime> {
    let args = json!([
        "--model={{ .Model.Path }}",
        "--served-model-name={{ .Service.Name }}"
    ]);
    vec![
        runtime("gpu", "nvidia", false, args.clone()),
        runtime("slices", "hami", true, args),
        // Go trim markers trim the adjacent white space.
        // (Another vendor: two nvidia runtimes of one priority would be an ambiguous choice.)
        runtime(
            "trim",
            "example",
            false,
            json!([
                "--model= {{- .Model.Path }}",
                "--served-model-name=\n{{- .Service.Name -}}\n"
            ]),
        ),
        // Only possible past a webhook outage: the runtime webhook denies it.
        runtime(
            "broken",
            "broken",
            false,
            json!(["--model={{ .Model.Name }}"]),
        ),
    ]
}

fn service(name: &str, patch: Value) -> Value {
    let mut svc = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": "team-a", "uid": "0b6c7c53-5d1d-4f0e-9c1a-1c2b3d4e5f60"},
        "spec": {
            "model": {"source": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}},
            "runtime": {"name": "gpu"},
            "cache": {"size": "30Gi"},
        }
    });
    hearth_test_support::merge_json(&mut svc, patch);
    svc
}

/// The webhook's answer: allowed, the warnings, the denied fields.
fn admit(svc: &Value) -> (bool, Vec<String>, Vec<String>) {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "serving.hearth.dev", "version": "v1alpha1", "kind": "LLMService"},
            "resource": {"group": "serving.hearth.dev", "version": "v1alpha1", "resource": "llmservices"},
            "name": svc["metadata"]["name"],
            "namespace": "team-a",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": svc,
            "oldObject": null,
        }
    });
    let snapshot = Snapshot::with_runtimes(runtimes());
    let answer = handle(Endpoint::Validate, review.to_string().as_bytes(), &snapshot)
        .expect("an AdmissionReview answer");
    let v = serde_json::to_value(&answer.review).unwrap();
    let r = &v["response"];
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect()
    };
    let causes = r["status"]["details"]["causes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["field"].as_str().map(str::to_owned))
        .collect();
    (r["allowed"] == true, strings(&r["warnings"]), causes)
}

fn reconcile_plan(svc: &Value) -> Desired {
    let svc: LLMService = serde_json::from_value(svc.clone()).expect("a decodable LLMService");
    let cfg = RenderConfig::builtin().expect("the built-in policies compile");
    desired(&svc, &runtimes(), &cfg, true, None, &Default::default())
}

fn cond<'a>(plan: &'a Desired, type_: &str) -> &'a Cond {
    plan.conds
        .iter()
        .find(|c| c.type_ == type_)
        .unwrap_or_else(|| panic!("no {type_} condition in {:?}", plan.conds))
}

fn check(svc: Value, verdict: Verdict) {
    let (allowed, warnings, denied) = admit(&svc);
    let plan = reconcile_plan(&svc);
    let validated = cond(&plan, status::VALIDATED);
    let ctx = format!(
        "{verdict:?}\nwebhook: allowed {allowed}, warnings {warnings:?}, denied {denied:?}\ncontroller: {:?}",
        plan.conds
    );
    let warned = |field: &str| {
        warnings
            .iter()
            .any(|w| w.starts_with(&format!("{field}: ")))
    };
    match verdict {
        Rendered => {
            assert!(allowed && warnings.is_empty(), "{ctx}");
            assert!(plan.children.is_some(), "{ctx}");
            assert_eq!(
                (validated.status, validated.reason.as_str()),
                ("True", status::VALID),
                "{ctx}"
            );
        }
        Warned(field) => {
            assert!(allowed && warned(field), "{ctx}");
            assert!(plan.children.is_some(), "{ctx}");
            assert_eq!(validated.status, "True", "{ctx}");
            assert_ne!(validated.reason, status::VALID, "{ctx}");
            assert!(validated.message.contains(&format!("{field}: ")), "{ctx}");
        }
        Refused(field, type_, reason) => {
            assert!(!allowed && denied.iter().any(|d| d == field), "{ctx}");
            assert!(plan.children.is_none(), "{ctx}");
            assert_eq!(plan.phase, LLMServicePhase::Degraded, "{ctx}");
            let c = cond(&plan, type_);
            assert_eq!((c.status, c.reason.as_str()), ("False", reason), "{ctx}");
            assert!(c.message.contains(&format!("{field}: ")), "{ctx}");
            assert_eq!(validated.status, "False", "{ctx}");
        }
        WaitsForPolicy => {
            assert!(allowed && warnings.is_empty(), "{ctx}");
            assert!(plan.children.is_none(), "{ctx}");
            assert_eq!(plan.phase, LLMServicePhase::Degraded, "{ctx}");
            let ready = cond(&plan, status::READY);
            assert_eq!(
                (ready.status, ready.reason.as_str()),
                ("False", "PolicyFailed"),
                "{ctx}"
            );
            assert!(ready.message.contains("spec.resources.fraction: "), "{ctx}");
        }
        WaitsForRuntime(field) => {
            assert!(allowed && warned(field), "{ctx}");
            assert!(plan.children.is_none(), "{ctx}");
            assert_eq!(plan.phase, LLMServicePhase::Pending, "{ctx}");
            assert_eq!(
                cond(&plan, status::RUNTIME_RESOLVED).status,
                "False",
                "{ctx}"
            );
            assert_eq!(validated.status, "True", "{ctx}");
        }
    }
}

const SCALER: &str = "serving.hearth.dev/scaler";

#[rstest]
// Rendered as written.
#[case::plain(json!({}), Rendered)]
#[case::push_scaler(json!({"metadata": {"annotations": {SCALER: "push"}}}), Rendered)]
#[case::go_trim_markers(json!({"spec": {"runtime": {"name": "trim"}}}), Rendered)]
#[case::pvc_model_needs_no_cache_size(json!({"spec": {"model": {"source": {"uri": "pvc://weights/qwen"}}, "cache": {"size": null}}}), Rendered)]
#[case::hostpath_needs_no_size(json!({"spec": {"cache": {"strategy": "HostPath", "size": null}}}), Rendered)]
#[case::vendor_selection(json!({"spec": {"runtime": {"name": null, "selector": {"vendor": ["cambricon", "nvidia"]}}}}), Rendered)]
#[case::quantities(json!({"spec": {"resources": {"cpu": "500m", "memory": "16Gi"}}}), Rendered)]
// No cache size: upstream's 50Gi default.
#[case::cache_size_default(json!({"spec": {"cache": {"size": null}}}), Rendered)]
#[case::args_override_template(json!({"spec": {"runtime": {"argsOverride": ["--tag={{ .Service.Name }}"]}}}), Rendered)]
#[case::warm_window(json!({"spec": {"scaling": {"max": 2, "warmWindows": [{"timezone": "Europe/Berlin", "start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI", "replicas": 2}]}}}), Rendered)]
// Rendered, with a warning.
#[case::size_ignored(json!({"spec": {"cache": {"strategy": "HostPath"}}}), Warned("spec.cache.size"))]
#[case::prewarm_ignored(json!({"spec": {"cache": {"strategy": "None", "size": null, "prewarm": true}}}), Warned("spec.cache.prewarm"))]
#[case::prewarm_pvc(json!({"spec": {"model": {"source": {"uri": "pvc://weights"}}, "cache": {"prewarm": true}}}), Warned("spec.cache.prewarm"))]
#[case::selector_ignored(json!({"spec": {"runtime": {"selector": {"vendor": ["nvidia"]}}}}), Warned("spec.runtime.selector"))]
#[case::duplicate_vendor(json!({"spec": {"runtime": {"name": null, "selector": {"vendor": ["nvidia", "nvidia"]}}}}), Warned("spec.runtime.selector.vendor[1]"))]
#[case::openai(json!({"spec": {"endpoint": {"openAICompatible": false}}}), Warned("spec.endpoint.openAICompatible"))]
#[case::warm_window_at_min(json!({"spec": {"scaling": {"min": 1, "warmWindows": [{"timezone": "UTC", "start": "0 8 * * *", "end": "0 18 * * *", "replicas": 1}]}}}), Warned("spec.scaling.warmWindows[0].replicas"))]
// Refused by both.
#[case::baked_image(json!({"spec": {"cache": {"strategy": "BakedImage"}}}), Refused("spec.cache.strategy", "CacheReady", "StrategyNotImplemented"))]
#[case::shared_pvc_without_prewarm(json!({"spec": {"cache": {"strategy": "SharedPVC"}}}), Refused("spec.cache.prewarm", "Ready", "InvalidSpec"))]
#[case::shared_pvc_modelscope(json!({"spec": {"model": {"source": {"uri": "modelscope://Qwen/Qwen2.5-0.5B-Instruct"}}, "cache": {"strategy": "SharedPVC", "prewarm": true}}}), Refused("spec.cache.strategy", "Ready", "InvalidSpec"))]
#[case::baked_image_with_pvc_model(json!({"spec": {"model": {"source": {"uri": "pvc://weights"}}, "cache": {"strategy": "BakedImage"}}}), Refused("spec.cache.strategy", "CacheReady", "StrategyNotImplemented"))]
#[case::bad_args_override(json!({"spec": {"runtime": {"argsOverride": ["--tag={{ .Service.Uid }}"]}}}), Refused("spec.runtime.argsOverride[0]", "Ready", "InvalidSpec"))]
#[case::aliases(json!({"spec": {"model": {"aliases": ["Qwen/Qwen2.5-0.5B-Instruct", "qwen:0.5b"]}}}), Rendered)]
#[case::alias_of_its_own_name(json!({"spec": {"model": {"aliases": ["qwen"]}}}), Warned("spec.model.aliases[0]"))]
#[case::alias_with_a_comma(json!({"spec": {"model": {"aliases": ["qwen-7b", "a,b"]}}}), Refused("spec.model.aliases[1]", "Ready", "InvalidSpec"))]
#[case::alias_with_a_space(json!({"spec": {"model": {"aliases": ["Qwen 2.5"]}}}), Refused("spec.model.aliases[0]", "Ready", "InvalidSpec"))]
#[case::bad_cache_size(json!({"spec": {"cache": {"size": "30GB"}}}), Refused("spec.cache.size", "Ready", "InvalidSpec"))]
#[case::bad_storage_class(json!({"spec": {"cache": {"storageClassName": "Local_SSD"}}}), Refused("spec.cache.storageClassName", "Ready", "InvalidSpec"))]
#[case::catalog(json!({"spec": {"model": {"catalogRef": "qwen"}}}), Refused("spec.model.catalogRef", "Ready", "CatalogNotImplemented"))]
#[case::catalog_only(json!({"spec": {"model": {"catalogRef": "qwen", "source": null}}}), Refused("spec.model.catalogRef", "Ready", "CatalogNotImplemented"))]
#[case::uri(json!({"spec": {"model": {"source": {"uri": "pvc://weights/../../etc"}}}}), Refused("spec.model.source.uri", "Ready", "InvalidModelSource"))]
#[case::secret_ref(json!({"spec": {"model": {"source": {"secretRef": {"name": "HF_TOKEN"}}}}}), Refused("spec.model.source.secretRef.name", "Ready", "InvalidSpec"))]
#[case::fraction_without_sharing(json!({"spec": {"resources": {"fraction": {"cores": 50}}}}), Refused("spec.resources.fraction", "Ready", "FractionNotSupported"))]
#[case::fraction_with_sharing(json!({"spec": {"runtime": {"name": "slices"}, "resources": {"fraction": {"memory": "8Gi"}}}}), WaitsForPolicy)]
#[case::kv_cache_metric(json!({"spec": {"scaling": {"metric": "kvCacheUtil"}}}), Refused("spec.scaling.metric", "Ready", "MetricNotImplemented"))]
#[case::cpu(json!({"spec": {"resources": {"cpu": "lots"}}}), Refused("spec.resources.cpu", "Ready", "InvalidSpec"))]
#[case::negative_memory(json!({"spec": {"resources": {"memory": "-1Gi"}}}), Refused("spec.resources.memory", "Ready", "InvalidSpec"))]
#[case::duration(json!({"spec": {"scaling": {"drainTimeout": "2 minutes"}}}), Refused("spec.scaling.drainTimeout", "Ready", "InvalidSpec"))]
#[case::min_residency(json!({"spec": {"scaling": {"minResidency": "two minutes"}}}), Refused("spec.scaling.minResidency", "Ready", "InvalidSpec"))]
#[case::priority(json!({"spec": {"scaling": {"priority": 5000}}}), Refused("spec.scaling.priority", "Ready", "InvalidSpec"))]
#[case::warm_window_zone(json!({"spec": {"scaling": {"warmWindows": [{"timezone": "Berlin", "start": "0 8 * * *", "end": "0 18 * * *", "replicas": 1}]}}}), Refused("spec.scaling.warmWindows[0].timezone", "Ready", "InvalidSpec"))]
#[case::warm_window_cron(json!({"spec": {"scaling": {"warmWindows": [{"timezone": "UTC", "start": "0 0 8 * * *", "end": "0 18 * * *", "replicas": 1}]}}}), Refused("spec.scaling.warmWindows[0].start", "Ready", "InvalidSpec"))]
#[case::warm_window_above_max(json!({"spec": {"scaling": {"max": 1, "warmWindows": [{"timezone": "UTC", "start": "0 8 * * *", "end": "0 18 * * *", "replicas": 2}]}}}), Refused("spec.scaling.warmWindows[0].replicas", "Ready", "InvalidSpec"))]
#[case::vendor_name(json!({"spec": {"runtime": {"name": null, "selector": {"vendor": ["NVIDIA", "nvidia"]}}}}), Refused("spec.runtime.selector.vendor[0]", "Ready", "InvalidSpec"))]
#[case::pull_secret(json!({"spec": {"imagePullSecrets": [{"name": "Bad_Name"}]}}), Refused("spec.imagePullSecrets[0].name", "Ready", "InvalidSpec"))]
#[case::scaler(json!({"metadata": {"annotations": {SCALER: "sideways"}}}), Refused("metadata.annotations[\"serving.hearth.dev/scaler\"]", "Ready", "InvalidSpec"))]
#[case::runtime_template(json!({"spec": {"runtime": {"name": "broken"}}}), Refused("spec.runtime", "Ready", "InvalidRuntimeTemplate"))]
// A spec error is reported without a runtime too.
#[case::error_without_runtime(json!({"spec": {"runtime": {"name": "nowhere"}, "cache": {"strategy": "BakedImage"}}}), Refused("spec.cache.strategy", "CacheReady", "StrategyNotImplemented"))]
#[case::fraction_without_runtime(json!({"spec": {"runtime": {"name": "nowhere"}, "resources": {"fraction": {"cores": 10}}}}), WaitsForRuntime("spec.runtime.name"))]
// The documented difference: admitted with a warning, the controller waits.
#[case::missing_runtime(json!({"spec": {"runtime": {"name": "nowhere"}}}), WaitsForRuntime("spec.runtime.name"))]
#[case::unmatched_vendor(json!({"spec": {"runtime": {"name": null, "selector": {"vendor": ["cambricon"]}}}}), WaitsForRuntime("spec.runtime.selector.vendor"))]
fn webhook_and_controller_agree(#[case] patch: Value, #[case] verdict: Verdict) {
    check(service("qwen", patch), verdict);
}

/// The service name becomes the gateway Service's name and the prefix of the others.
#[rstest]
#[case::longest("a".repeat(55), Rendered)]
#[case::too_long("a".repeat(56), Refused("metadata.name", "Ready", "InvalidSpec"))]
#[case::digit_first("7b-chat".to_owned(), Refused("metadata.name", "Ready", "InvalidSpec"))]
#[case::dotted("qwen.v1".to_owned(), Refused("metadata.name", "Ready", "InvalidSpec"))]
fn names_agree(#[case] name: String, #[case] verdict: Verdict) {
    check(service(&name, json!({})), verdict);
}

#[test]
fn trim_markers_render_as_go_renders_them() {
    let plan = reconcile_plan(&service(
        "qwen",
        json!({"spec": {"runtime": {"name": "trim"}}}),
    ));
    let children = plan.children.expect("rendered");
    let pod = children.backend.spec.unwrap().template.spec.unwrap();
    let args = pod.containers[0].args.clone().unwrap();
    assert_eq!(
        args[..2],
        [
            "--model=Qwen/Qwen2.5-0.5B-Instruct",
            "--served-model-name=qwen"
        ]
    );
}

#[test]
fn the_name_limit_is_the_child_names_limit() {
    assert_eq!(
        hearth_crds::rules::MAX_NAME_LEN,
        hearth_controller::names::MAX_SERVICE_NAME_LEN
    );
}

// Plain Deployments joining an endpoint: the webhook's review of the Deployment (the workload
// path) and the controller's decision (`attach`, then `reconcile::decide_member`) agree.

/// How a Deployment with the endpoint annotation fares on both paths.
#[derive(Debug, Clone, Copy)]
enum Joining {
    /// Admitted without a warning; accepted and its objects rendered.
    Joins,
    /// Admitted with a warning naming the field; accepted, rendered, the warning in its Event.
    JoinsWarned(&'static str),
    /// Denied with a cause on the field; `InvalidMember`, nothing rendered, the note naming the
    /// field.
    NotJoined(&'static str),
}

fn member_deployment(name: &str, patch: Value) -> Value {
    let mut d = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": name, "namespace": "team-a", "uid": "dep-uid",
            "annotations": {
                "serving.hearth.dev/runtime": "gpu",
                "serving.hearth.dev/endpoint": "shared",
                "serving.hearth.dev/model": "qwen",
            },
        },
        "spec": {
            "selector": {"matchLabels": {"app": "qwen"}},
            "template": {
                "metadata": {"labels": {"app": "qwen"}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.5",
                    "args": ["--served-model-name=qwen"],
                    "ports": [{"name": "http", "containerPort": 8000}]}]},
            },
        },
    });
    hearth_test_support::merge_json(&mut d, patch);
    if let Some(a) = d["metadata"]["annotations"].as_object_mut() {
        a.retain(|_, v| !v.is_null());
    }
    d
}

fn admit_deployment(d: &Value) -> (bool, Vec<String>, Vec<String>) {
    let review = json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800003",
            "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
            "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
            "name": d["metadata"]["name"],
            "namespace": "team-a",
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": d,
            "oldObject": null,
        }
    });
    let snapshot = Snapshot::with_runtimes(runtimes());
    let answer = handle(Endpoint::Validate, review.to_string().as_bytes(), &snapshot)
        .expect("an AdmissionReview answer");
    let v = serde_json::to_value(&answer.review).unwrap();
    let r = &v["response"];
    let warnings = r["warnings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect();
    let causes = r["status"]["details"]["causes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["field"].as_str().map(str::to_owned))
        .collect();
    (r["allowed"] == true, warnings, causes)
}

fn decide(d: &Value) -> MemberOutcome {
    let d: Deployment = serde_json::from_value(d.clone()).expect("a decodable Deployment");
    let ep: LLMEndpoint = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "shared", "namespace": "team-a", "uid": "ep-uid"},
        "spec": {},
    }))
    .unwrap();
    let key = EndpointKey::of(&ep);
    let a = attach(
        &key,
        Some(&ep),
        std::iter::empty(),
        [&d],
        &Default::default(),
    );
    let verdict = a.deployment_verdict("team-a", &d.name_any());
    let view = MemberView {
        keda_installed: true,
        ..Default::default()
    };
    let cfg = RenderConfig::builtin().expect("the built-in policies compile");
    decide_member(&d, verdict, Some(&ep), &runtimes(), &view, &cfg)
}

#[rstest]
#[case::plain(json!({}), Joins)]
#[case::every_annotation(json!({"metadata": {"annotations": {
    "serving.hearth.dev/min-replicas": "1", "serving.hearth.dev/max-replicas": "3",
    "serving.hearth.dev/target": "5", "serving.hearth.dev/activation-timeout": "90s",
    "serving.hearth.dev/cold-start": "reject", "serving.hearth.dev/scaler": "push",
}}}), Joins)]
#[case::no_model(json!({"metadata": {"annotations": {"serving.hearth.dev/model": null}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/model\"]"))]
#[case::bad_endpoint(json!({"metadata": {"annotations": {"serving.hearth.dev/endpoint": "Shared"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/endpoint\"]"))]
#[case::bad_min(json!({"metadata": {"annotations": {"serving.hearth.dev/min-replicas": "x"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/min-replicas\"]"))]
#[case::min_above_max(json!({"metadata": {"annotations": {"serving.hearth.dev/min-replicas": "2"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/min-replicas\"]"))]
#[case::bad_target(json!({"metadata": {"annotations": {"serving.hearth.dev/target": "0"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/target\"]"))]
#[case::bad_timeout(json!({"metadata": {"annotations": {"serving.hearth.dev/activation-timeout": "-5m"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/activation-timeout\"]"))]
#[case::bad_cold_start(json!({"metadata": {"annotations": {"serving.hearth.dev/cold-start": "Reject"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/cold-start\"]"))]
#[case::bad_scaler(json!({"metadata": {"annotations": {"serving.hearth.dev/scaler": "both"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/scaler\"]"))]
#[case::no_match_labels(json!({"spec": {"selector": {"matchLabels": null, "matchExpressions": [{"key": "app", "operator": "Exists"}]}}}), NotJoined("spec.selector.matchLabels"))]
#[case::an_unknown_container(json!({"metadata": {"annotations": {"serving.hearth.dev/container": "engine"}}}), NotJoined("metadata.annotations[\"serving.hearth.dev/container\"]"))]
#[case::an_llmservices_backend(json!({"metadata": {"ownerReferences": [{"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService", "name": "qwen", "uid": "u", "controller": true}]}}), NotJoined("metadata.annotations[\"serving.hearth.dev/endpoint\"]"))]
#[case::served_under_another_name(json!({"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.5", "args": ["--served-model-name=other"], "ports": [{"name": "http", "containerPort": 8000}]}]}}}}), JoinsWarned("metadata.annotations[\"serving.hearth.dev/model\"]"))]
#[case::expressions_beside_labels(json!({"spec": {"selector": {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}}}), JoinsWarned("spec.selector.matchExpressions"))]
// No port declared: the runtime's (the built-in serving defaults add it at admission).
#[case::no_port_the_runtimes(json!({"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.5", "args": ["--served-model-name=qwen"]}]}}}}), Joins)]
fn deployments_joining_agree(#[case] patch: Value, #[case] joining: Joining) {
    check_joining(member_deployment("vllm-qwen", patch), joining);
}

#[rstest]
#[case::longest("a".repeat(56), Joins)]
#[case::too_long("a".repeat(57), NotJoined("metadata.name"))]
#[case::dotted("vllm.qwen".to_owned(), NotJoined("metadata.name"))]
#[case::digit_first("7b".to_owned(), NotJoined("metadata.name"))]
fn deployment_names_agree(#[case] name: String, #[case] joining: Joining) {
    check_joining(member_deployment(&name, json!({})), joining);
}

fn check_joining(d: Value, joining: Joining) {
    let (allowed, warnings, denied) = admit_deployment(&d);
    let out = decide(&d);
    let joined = matches!(out.decision, MemberDecision::Join(_));
    match joining {
        Joins => {
            assert!(
                allowed && warnings.is_empty(),
                "webhook: {warnings:?} {denied:?}"
            );
            assert!(
                joined && out.state.warnings.is_empty(),
                "controller: {:?}",
                out.state
            );
            assert_eq!(out.state.reason, "Accepted");
        }
        JoinsWarned(field) => {
            assert!(allowed, "webhook denied {denied:?}");
            assert!(
                warnings
                    .iter()
                    .any(|w| w.starts_with(&format!("{field}: "))),
                "webhook warnings {warnings:?}"
            );
            assert!(joined, "controller: {:?}", out.state);
            assert!(
                out.state
                    .warnings
                    .iter()
                    .any(|w| w.starts_with(&format!("{field}: "))),
                "controller warnings {:?}",
                out.state.warnings
            );
        }
        NotJoined(field) => {
            assert!(!allowed, "webhook allowed, warnings {warnings:?}");
            assert_eq!(
                denied.first().map(String::as_str),
                Some(field),
                "{denied:?}"
            );
            assert!(!joined, "controller joined");
            assert_eq!(out.state.reason, "InvalidMember", "{:?}", out.state);
            assert!(out.state.note.contains(field), "{}", out.state.note);
        }
    }
}

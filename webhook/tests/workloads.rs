//! Opted-in workloads through the router in-process: runtime resolution, the built-in and
//! platform policies' patch (applied with json-patch, then re-reviewed: the second patch is
//! empty), denials, warnings and audit annotations.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::review::{admission_review, post_review};
use hearth_crds::{InferenceRuntime, ServingPolicy};
use hearth_webhook::{AppState, Limits, Snapshot, router};
use serde_json::{Value, json};

/// The upstream InferenceRuntime examples; fails naming where it looked and how to provide them
/// when they are missing.
fn upstream_runtimes() -> Vec<InferenceRuntime> {
    hearth_test_support::upstream_examples("InferenceRuntime")
        .into_iter()
        .map(|v| serde_json::from_value(v).unwrap())
        .collect()
}

fn policy(name: &str, spec: Value) -> ServingPolicy {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "ServingPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .unwrap()
}

/// Platform policies of the kind a team writes: a team label from the runtime's vendor, a
/// warning, an audit annotation, and a denial.
fn platform() -> Vec<ServingPolicy> {
    vec![
        policy(
            "vendor-label",
            json!({"mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                "Object{metadata: Object.metadata{labels: {'platform.example.com/vendor': params.spec.vendor}}}"}}]}),
        ),
        policy(
            "replicas-warning",
            json!({"validationActions": ["Warn"],
                   "validations": [{"expression": "!has(object.spec.replicas) || object.spec.replicas <= 4",
                                    "message": "more than 4 replicas of a model needs a capacity review"}]}),
        ),
        policy(
            "audit-runtime",
            json!({"auditAnnotations": [{"key": "runtime", "valueExpression": "params.metadata.name"}]}),
        ),
        policy(
            "no-latest",
            json!({"validations": [{"expression":
                "object.kind != 'Deployment' || object.spec.template.spec.containers.all(c, !c.image.endsWith(':latest'))",
                "message": "pin the serving image to a version, not :latest", "reason": "Invalid"}]}),
        ),
    ]
}

/// The built-ins, then the platform policies: the order the webhook evaluates them in.
fn all_policies() -> Vec<ServingPolicy> {
    let mut all = hearth_policies::builtin::policies().unwrap();
    all.extend(platform());
    all
}

fn app() -> axum::Router {
    router(AppState::new(
        Snapshot::offline(upstream_runtimes(), &all_policies()),
        Limits::default(),
    ))
}

fn deployment(annotations: Value, image: &str, replicas: i64) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "team-a", "annotations": annotations},
        "spec": {"replicas": replicas, "selector": {"matchLabels": {"app": "qwen"}},
                 "template": {"metadata": {"labels": {"app": "qwen"}},
                              "spec": {"containers": [{"name": "vllm", "image": image,
                                                       "args": ["Qwen/Qwen2.5-7B-Instruct"]}]}}}
    })
}

fn review(object: &Value, operation: &str) -> Value {
    admission_review(object["kind"].as_str().unwrap(), object.clone(), operation)
}

async fn post(path: &str, review: &Value) -> Value {
    post_review(app(), path, review).await
}

/// Applies the response's patch to `object`; `None` when the response has no patch.
fn apply(object: &Value, response: &Value) -> Option<Value> {
    // kube-core encodes the patch bytes as a JSON array of numbers, which the apiserver's
    // decoder accepts for a []byte as well as base64.
    let patch = response["response"]["patch"].as_array()?;
    assert_eq!(response["response"]["patchType"], "JSONPatch");
    let bytes: Vec<u8> = patch.iter().map(|b| b.as_u64().unwrap() as u8).collect();
    let patch: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
    assert!(!patch.0.is_empty(), "an empty patch must be left out");
    let mut out = object.clone();
    json_patch::patch(&mut out, &patch).unwrap();
    Some(out)
}

/// `object` as `app` mutates it: a CREATE on /mutate, which must be allowed with a patch.
async fn mutate(app: axum::Router, object: &Value) -> Value {
    let v = post_review(app, "/mutate", &review(object, "CREATE")).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    apply(object, &v).expect("a patch")
}

/// Reinvocation and re-apply: `mutated`, reviewed again on a fresh `app()` as a CREATE and as
/// an UPDATE, is allowed with no patch (it needs nothing more).
async fn assert_second_pass_changes_nothing(app: impl Fn() -> axum::Router, mutated: &Value) {
    for op in ["CREATE", "UPDATE"] {
        let again = post_review(app(), "/mutate", &review(mutated, op)).await;
        assert_eq!(again["response"]["allowed"], true);
        assert!(
            apply(mutated, &again).is_none(),
            "{op}: second patch {again}"
        );
    }
}

/// What the built-ins give a Deployment on `vllm-nvidia-a10`: the accelerator request,
/// model-load-aware probes, the preStop drain with a grace period covering it, scheduling.
fn assert_builtins_applied(d: &Value) {
    let pod = &d["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["name"], "vllm");
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "1", "{d}");
    assert_eq!(c["startupProbe"]["failureThreshold"], 120, "{d}");
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/health", "{d}");
    assert!(c["livenessProbe"].is_object(), "{d}");
    assert!(c["lifecycle"]["preStop"].is_object(), "{d}");
    assert!(
        pod["terminationGracePeriodSeconds"].as_i64().unwrap() >= 120,
        "{d}"
    );
    assert_eq!(
        pod["nodeSelector"]["nvidia.com/gpu.product"], "NVIDIA-A10",
        "{d}"
    );
}

#[tokio::test]
async fn annotated_deployment_is_mutated_and_a_second_pass_changes_nothing() {
    // By vendor, the two nvidia runtimes of priority 100 (the A10 and the stub) are a tie:
    // refused, naming both, until the workload pins one.
    let dep = deployment(
        json!({"serving.hearth.dev/vendor": "cambricon, nvidia"}),
        "vllm/vllm-openai:v0.25.1",
        1,
    );
    let v = post("/mutate", &review(&dep, "CREATE")).await;
    assert_eq!(v["response"]["allowed"], false, "{v}");
    let message = v["response"]["status"]["message"]
        .as_str()
        .unwrap_or_default();
    assert!(
        message.contains("[vllm-nvidia-a10, vllm-stub] are equally preferred"),
        "{v}"
    );
    for annotations in [json!({"serving.hearth.dev/runtime": "vllm-nvidia-a10"})] {
        let dep = deployment(annotations.clone(), "vllm/vllm-openai:v0.25.1", 1);
        let mutated = mutate(app(), &dep).await;
        assert_builtins_applied(&mutated);
        assert_eq!(
            mutated["metadata"]["labels"]["platform.example.com/vendor"], "nvidia",
            "{annotations}: {mutated}"
        );
        assert_second_pass_changes_nothing(app, &mutated).await;
    }
}

/// `--drain-image` (as `settings.drainImage`): the built-in drain becomes the native sidecar and
/// an httpGet preStop to it, and a second pass still changes nothing.
#[tokio::test]
async fn with_a_drain_image_the_drain_is_a_sidecar_and_a_second_pass_changes_nothing() {
    let image = "registry.example/hearth-gateway:v1";
    let app = || {
        let settings = hearth_policies::PolicySettings {
            drain_image: Some(image.into()),
        };
        router(AppState::new(
            Snapshot::offline(upstream_runtimes(), &all_policies()).with_settings(&settings),
            Limits::default(),
        ))
    };
    let dep = deployment(
        json!({"serving.hearth.dev/runtime": "vllm-nvidia-a10", "serving.hearth.dev/drain-timeout": "90s"}),
        "vllm/vllm-openai:v0.25.1",
        1,
    );
    let mutated = mutate(app(), &dep).await;
    assert_builtins_applied(&mutated);
    let pod = &mutated["spec"]["template"]["spec"];
    assert_eq!(
        pod["containers"][0]["lifecycle"]["preStop"],
        json!({"httpGet": {"path": "/drain", "port": 8099}}),
        "{mutated}"
    );
    let sidecar = &pod["initContainers"][0];
    assert_eq!(sidecar["name"], "hearth-drain", "{mutated}");
    assert_eq!(sidecar["image"], image);
    assert_eq!(sidecar["restartPolicy"], "Always");
    assert_eq!(
        sidecar["args"],
        json!([
            "drain",
            "--listen=[::]:8099",
            "--url=http://127.0.0.1:8000/metrics",
            "--timeout=90s",
            "--running-metric=vllm:num_requests_running",
            "--waiting-metric=vllm:num_requests_waiting"
        ])
    );
    assert_second_pass_changes_nothing(app, &mutated).await;
}

#[tokio::test]
async fn validate_returns_warnings_and_audit_annotations() {
    let dep = deployment(
        json!({"serving.hearth.dev/runtime": "vllm-ascend"}),
        "quay.io/ascend/vllm-ascend:v0.21.0rc1",
        8,
    );
    let v = post("/validate", &review(&dep, "CREATE")).await;
    let r = &v["response"];
    assert_eq!(r["allowed"], true, "{v}");
    assert!(
        r["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w.as_str().unwrap().contains("capacity review")),
        "{r}"
    );
    // The policy's `<policy>/<key>`, under a key the apiserver records (no second `/`).
    assert_eq!(
        r["auditAnnotations"]["audit-runtime.runtime"], "vllm-ascend",
        "{r}"
    );
    // The mutating endpoint does not repeat them.
    let m = post("/mutate", &review(&dep, "CREATE")).await;
    assert!(m["response"].get("warnings").is_none());
}

#[tokio::test]
async fn platform_denials_carry_their_reason_on_both_endpoints() {
    let dep = deployment(
        json!({"serving.hearth.dev/runtime": "vllm-nvidia-a10"}),
        "vllm/vllm-openai:latest",
        1,
    );
    for path in ["/mutate", "/validate"] {
        let v = post(path, &review(&dep, "CREATE")).await;
        let r = &v["response"];
        assert_eq!(r["allowed"], false, "{v}");
        assert_eq!(r["status"]["code"], 422);
        assert!(
            r["status"]["message"]
                .as_str()
                .unwrap()
                .contains("ServingPolicy 'no-latest' denied the request: pin the serving image"),
            "{r}"
        );
        assert!(r.get("patch").is_none());
    }
}

#[tokio::test]
async fn unresolvable_selection_is_denied_naming_the_annotation() {
    for (annotations, field, message) in [
        (
            json!({"serving.hearth.dev/runtime": "vllm-nowhere"}),
            "metadata.annotations[\"serving.hearth.dev/runtime\"]",
            "\"vllm-nowhere\" does not exist",
        ),
        (
            json!({"serving.hearth.dev/vendor": "cambricon"}),
            "metadata.annotations[\"serving.hearth.dev/vendor\"]",
            "no InferenceRuntime has vendor cambricon",
        ),
    ] {
        let dep = deployment(annotations, "vllm/vllm-openai:v0.25.1", 1);
        let v = post("/mutate", &review(&dep, "CREATE")).await;
        let msg = v["response"]["status"]["message"].as_str().unwrap();
        assert_eq!(v["response"]["allowed"], false);
        assert!(msg.starts_with(field), "{msg}");
        assert!(msg.contains(message), "{msg}");
    }
}

#[tokio::test]
async fn labelled_pods_are_handled_like_annotated_ones() {
    let pod = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "p", "namespace": "team-a",
                     "labels": {"serving.hearth.dev/runtime": "vllm-stub"}},
        "spec": {"containers": [{"name": "vllm", "image": "hearth.dev/vllm-stub:e2e"}]}
    });
    let v = post("/mutate", &review(&pod, "CREATE")).await;
    let mutated = apply(&pod, &v).expect("a patch");
    assert_eq!(
        mutated["metadata"]["labels"]["platform.example.com/vendor"],
        "nvidia"
    );
}

/// A policy that spends its whole request budget (ten validations of ~97,000 cost units each,
/// about 1M) is evaluated on the blocking pool: on a runtime with a single async worker, a
/// cheap admission sent while it runs is answered before it finishes, in about the time it
/// takes alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 1)]
async fn an_expensive_policy_does_not_delay_a_concurrent_cheap_admission() {
    use std::time::{Duration, Instant};
    let mut policies = all_policies();
    let heavy: Vec<Value> = (0..10)
        .map(|_| json!({"expression": "lists.range(220).all(i, lists.range(220).all(j, i + j >= 0))"}))
        .collect();
    policies.push(policy(
        "expensive",
        json!({"matchConditions": [{"name": "only-expensive",
                                    "expression": "object.metadata.name == 'expensive'"}],
               "validations": heavy}),
    ));
    let app = router(AppState::new(
        Snapshot::offline(upstream_runtimes(), &policies),
        Limits {
            max_evaluations: 4,
            ..Limits::default()
        },
    ));
    let cheap = deployment(
        json!({"serving.hearth.dev/runtime": "vllm-nvidia-a10"}),
        "vllm/vllm-openai:v0.25.1",
        1,
    );
    let mut expensive = cheap.clone();
    expensive["metadata"]["name"] = json!("expensive");
    let (cheap, expensive) = (review(&cheap, "CREATE"), review(&expensive, "CREATE"));
    let timed = |app: axum::Router, r: Value| async move {
        let t = Instant::now();
        post_review(app, "/validate", &r).await;
        t.elapsed()
    };
    // Requests run as tasks, on the runtime's only worker (the test body itself runs on the
    // test thread). Each alone first (the cheap one twice: the first builds thread-local state).
    let run = |r: &Value| tokio::spawn(timed(app.clone(), r.clone()));
    run(&cheap).await.unwrap();
    let cheap_alone = run(&cheap).await.unwrap();
    let expensive_alone = run(&expensive).await.unwrap();
    assert!(
        expensive_alone > cheap_alone * 20,
        "the expensive policy must dominate: {expensive_alone:?} vs {cheap_alone:?}"
    );
    // Together: the expensive one starts, then the cheap one is sent while it evaluates.
    let slow = run(&expensive);
    tokio::time::sleep((expensive_alone / 10).min(Duration::from_millis(50))).await;
    // Timed from here: with evaluation on the worker the task would not even start.
    let sent = Instant::now();
    run(&cheap).await.unwrap();
    let cheap_concurrent = sent.elapsed();
    let slow_still_running = !slow.is_finished();
    let slow_took = slow.await.unwrap();
    println!(
        "cheap alone {cheap_alone:?}, next to the expensive one {cheap_concurrent:?} ({:.1}×); \
         expensive alone {expensive_alone:?}, next to the cheap one {slow_took:?}",
        cheap_concurrent.as_secs_f64() / cheap_alone.as_secs_f64()
    );
    assert!(
        slow_still_running,
        "the cheap admission ({cheap_concurrent:?}) waited for the expensive one ({slow_took:?})"
    );
}

/// A Deployment pinned to `vllm-nvidia-a10` joining the endpoint `platform/shared` with model
/// `qwen` and the extra `annotations`.
fn joining(annotations: Value) -> Value {
    let mut a = json!({
        "serving.hearth.dev/runtime": "vllm-nvidia-a10",
        "serving.hearth.dev/endpoint": "platform/shared",
        "serving.hearth.dev/model": "Qwen/Qwen2.5-7B-Instruct",
    });
    hearth_test_support::merge_json(&mut a, annotations);
    // `null`: without that annotation.
    a.as_object_mut().unwrap().retain(|_, v| !v.is_null());
    deployment(a, "vllm/vllm-openai:v0.25.1", 1)
}

#[tokio::test]
async fn a_deployment_joining_an_endpoint_is_mutated_as_any_and_replicas_are_left_to_keda() {
    let dep = joining(json!({}));
    let v = post("/mutate", &review(&dep, "CREATE")).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    // KEDA owns spec.replicas once the Deployment joins: no mutation touches it.
    let bytes: Vec<u8> = v["response"]["patch"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b.as_u64().unwrap() as u8)
        .collect();
    let patch: Value = serde_json::from_slice(&bytes).unwrap();
    assert!(
        patch
            .as_array()
            .unwrap()
            .iter()
            .all(|op| !op["path"].as_str().unwrap().starts_with("/spec/replicas")),
        "{patch}"
    );
    let mutated = mutate(app(), &dep).await;
    assert_builtins_applied(&mutated);
    assert_eq!(mutated["spec"]["replicas"], 1);
    assert_second_pass_changes_nothing(app, &mutated).await;
    // The stored object: no warning of Hearth's own (the container serves under its model path
    // positionally, which the rules do not guess at).
    let v = post("/validate", &review(&mutated, "CREATE")).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    let warnings = v["response"]["warnings"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert!(
        warnings
            .iter()
            .all(|w| !w.as_str().unwrap().contains("serving.hearth.dev/")),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn a_bad_member_annotation_is_denied_naming_it_and_the_fix() {
    for (annotations, field, fix) in [
        (
            json!({"serving.hearth.dev/model": null}),
            "metadata.annotations[\"serving.hearth.dev/model\"]",
            "is required with serving.hearth.dev/endpoint: set it to the name the engine serves the model under",
        ),
        (
            json!({"serving.hearth.dev/max-replicas": "many"}),
            "metadata.annotations[\"serving.hearth.dev/max-replicas\"]",
            "\"many\" is not a whole number of at least 1",
        ),
        (
            json!({"serving.hearth.dev/endpoint": "team/a/b"}),
            "metadata.annotations[\"serving.hearth.dev/endpoint\"]",
            "write <name> (an LLMEndpoint of the Deployment's namespace) or <namespace>/<name>",
        ),
        (
            json!({"serving.hearth.dev/cold-start": "wait"}),
            "metadata.annotations[\"serving.hearth.dev/cold-start\"]",
            "use keepalive (hold the request while the model starts) or reject",
        ),
    ] {
        let dep = joining(annotations.clone());
        for path in ["/mutate", "/validate"] {
            for op in ["CREATE", "UPDATE"] {
                let v = post(path, &review(&dep, op)).await;
                assert_eq!(
                    v["response"]["allowed"], false,
                    "{path} {op} {annotations}: {v}"
                );
                assert_eq!(v["response"]["status"]["code"], 422, "{v}");
                let causes = v["response"]["status"]["details"]["causes"]
                    .as_array()
                    .unwrap();
                assert_eq!(causes[0]["field"], field, "{v}");
                assert!(
                    causes[0]["message"].as_str().unwrap().contains(fix),
                    "{annotations}: {v}"
                );
            }
        }
    }
}

#[tokio::test]
async fn member_warnings_are_admission_warnings() {
    // Served under another name than the model annotation says.
    let mut dep = joining(json!({"serving.hearth.dev/model": "qwen"}));
    dep["spec"]["template"]["spec"]["containers"][0]["args"] = json!([
        "--model=Qwen/Qwen2.5-7B-Instruct",
        "--served-model-name=qwen-7b"
    ]);
    let v = post("/validate", &review(&dep, "CREATE")).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    let warnings: Vec<String> = v["response"]["warnings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w.as_str().unwrap().to_owned())
        .collect();
    assert!(
        warnings.iter().any(|w| w.starts_with(
            "metadata.annotations[\"serving.hearth.dev/model\"]: is \"qwen\", but container \"vllm\" serves the model as \"qwen-7b\""
        )),
        "{warnings:?}"
    );
    // Member annotations without the endpoint do nothing.
    let dep = deployment(
        json!({"serving.hearth.dev/runtime": "vllm-nvidia-a10", "serving.hearth.dev/min-replicas": "1"}),
        "vllm/vllm-openai:v0.25.1",
        1,
    );
    let v = post("/validate", &review(&dep, "CREATE")).await;
    assert!(
        v["response"]["warnings"].as_array().unwrap().iter().any(|w| w
            .as_str()
            .unwrap()
            .starts_with("metadata.annotations[\"serving.hearth.dev/min-replicas\"]: has no effect without serving.hearth.dev/endpoint")),
        "{v}"
    );
    // Only Deployments join.
    let mut sts = joining(json!({}));
    sts["kind"] = json!("StatefulSet");
    let v = post("/validate", &review(&sts, "CREATE")).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    assert!(
        v["response"]["warnings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w
                .as_str()
                .unwrap()
                .contains("has no effect on a StatefulSet: only Deployments join an LLMEndpoint")),
        "{v}"
    );
}

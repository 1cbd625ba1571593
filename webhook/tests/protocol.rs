//! The admission protocol and the LLMService/LLMEndpoint/InferenceRuntime checks, through the axum router
//! in-process (no TLS, no cluster): table-driven, one review per case.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use common::review::{admission_review, post_raw, post_review};
use hearth_crds::InferenceRuntime;
use hearth_webhook::{AppState, Limits, Snapshot, router};
use rstest::rstest;
use serde_json::{Value, json};
use tower::ServiceExt;

fn upstream(kind: &str) -> Vec<Value> {
    hearth_test_support::upstream_examples(kind)
}

fn snapshot() -> Snapshot {
    Snapshot::with_runtimes(
        upstream("InferenceRuntime")
            .into_iter()
            .map(|v| serde_json::from_value::<InferenceRuntime>(v).unwrap()),
    )
}

fn app_with(limits: Limits) -> axum::Router {
    router(AppState::new(snapshot(), limits))
}

fn app() -> axum::Router {
    app_with(Limits::default())
}

fn review(kind: &str, object: Value) -> Value {
    admission_review(kind, object, "CREATE")
}

async fn post(path: &str, review: &Value) -> Value {
    post_review(app(), path, review).await
}

fn llmservice(spec: Value) -> Value {
    let mut base = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "svc", "namespace": "team-a"},
        "spec": {
            "model": {"source": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}},
            "runtime": {"name": "vllm-nvidia-a10"},
            "cache": {"size": "30Gi"},
        }
    });
    hearth_test_support::merge_json(&mut base["spec"], spec);
    base
}

/// Validates `object` of `kind` and checks it is denied with a message naming `field` (as
/// `field: `) and containing `message`; returns the answer.
async fn assert_denied(kind: &str, object: Value, field: &str, message: &str) -> Value {
    let v = post("/validate", &review(kind, object)).await;
    let r = &v["response"];
    assert_eq!(r["allowed"], false, "{v}");
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("{field}: ")), "{field} in {msg}");
    assert!(msg.contains(message), "{message:?} in {msg}");
    v
}

#[tokio::test]
async fn upstream_examples_are_accepted_without_warnings() {
    let mut n = 0;
    for (kind, objects) in [
        ("InferenceRuntime", upstream("InferenceRuntime")),
        ("LLMService", upstream("LLMService")),
    ] {
        for obj in objects {
            let v = post("/validate", &review(kind, obj.clone())).await;
            assert_eq!(
                v["response"]["allowed"], true,
                "{}: {v}",
                obj["metadata"]["name"]
            );
            assert!(v["response"].get("warnings").is_none(), "{v}");
            n += 1;
        }
    }
    assert_eq!(n, 6);
}

#[rstest]
#[case::traversal(json!({"model": {"source": {"uri": "pvc://weights/../../etc"}}}), "spec.model.source.uri", "'..' segment")]
#[case::absolute(json!({"model": {"source": {"uri": "pvc://weights//etc/passwd"}}}), "spec.model.source.uri", "is absolute")]
#[case::encoded(json!({"model": {"source": {"uri": "pvc://weights/%2e%2e/x"}}}), "spec.model.source.uri", "'%' escape")]
#[case::scheme(json!({"model": {"source": {"uri": "s3://bucket/qwen"}}}), "spec.model.source.uri", "unsupported scheme \"s3\"")]
#[case::no_scheme(json!({"model": {"source": {"uri": "Qwen/Qwen2.5"}}}), "spec.model.source.uri", "write hf://Qwen/Qwen2.5")]
#[case::repo(json!({"model": {"source": {"uri": "hf://a/b/c"}}}), "spec.model.source.uri", "<org>/<name>")]
#[case::catalog(json!({"model": {"catalogRef": "qwen"}}), "spec.model.catalogRef", "not supported")]
#[case::fraction(json!({"resources": {"fraction": {"cores": 50}}}), "spec.resources.fraction", "does not support fractional devices")]
#[case::kv_metric(json!({"scaling": {"metric": "kvCacheUtil"}}), "spec.scaling.metric", "use queueDepth")]
#[case::shared_pvc_without_prewarm(json!({"cache": {"strategy": "SharedPVC"}}), "spec.cache.prewarm", "must be true with strategy SharedPVC")]
#[case::baked(json!({"cache": {"strategy": "BakedImage"}}), "spec.cache.strategy", "reserved")]
#[case::vendor(json!({"runtime": {"name": null, "selector": {"vendor": ["NVIDIA"]}}}), "spec.runtime.selector.vendor[0]", "not a vendor name")]
#[case::pull_secret(json!({"imagePullSecrets": [{"name": "Bad_Name"}]}), "spec.imagePullSecrets[0].name", "not a valid object name")]
#[case::shape(json!({"resources": {"accelerators": "two"}}), "spec.resources.accelerators", "invalid type")]
#[tokio::test]
async fn invalid_llmservices_are_denied(
    #[case] spec: Value,
    #[case] field: &str,
    #[case] message: &str,
) {
    let v = assert_denied("LLMService", llmservice(spec), field, message).await;
    let r = &v["response"];
    assert_eq!(r["status"]["code"], 422);
    let causes = r["status"]["details"]["causes"].as_array().unwrap();
    assert!(causes.iter().any(|c| c["field"] == field), "{causes:?}");
}

#[rstest]
#[case::missing_runtime(json!({"runtime": {"name": "vllm-nowhere"}}), "spec.runtime.name: InferenceRuntime \"vllm-nowhere\" does not exist; available: [vllm-ascend, vllm-nvidia-a10, vllm-stub]")]
#[case::no_vendor(json!({"runtime": {"name": null, "selector": {"vendor": ["cambricon"]}}}), "no InferenceRuntime has vendor cambricon; runtimes exist for [ascend, nvidia]")]
#[case::pinned_and_selector(json!({"runtime": {"selector": {"vendor": ["nvidia"]}}}), "spec.runtime.selector: is ignored")]
#[case::prewarm_none(json!({"cache": {"strategy": "None", "prewarm": true}}), "spec.cache.prewarm: is ignored with strategy None")]
#[case::openai(json!({"endpoint": {"openAICompatible": false}}), "spec.endpoint.openAICompatible")]
#[tokio::test]
async fn questionable_llmservices_are_allowed_with_warnings(
    #[case] spec: Value,
    #[case] warning: &str,
) {
    let v = post("/validate", &review("LLMService", llmservice(spec))).await;
    let r = &v["response"];
    assert_eq!(r["allowed"], true, "{v}");
    let warnings = r["warnings"].as_array().expect("warnings");
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().unwrap().contains(warning)),
        "{warning:?} in {warnings:?}"
    );
}

fn llmendpoint(spec: Value) -> Value {
    json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "shared", "namespace": "team-a"},
        "spec": spec,
    })
}

#[rstest]
#[case::same(json!({}))]
#[case::all(json!({"allowedServices": {"namespaces": {"from": "All"}}, "replicas": 2, "apiKeySecretRef": {"name": "keys"}}))]
#[case::selector(json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "team", "operator": "In", "values": ["ml"]}]}}}}))]
#[tokio::test]
async fn valid_llmendpoints_are_allowed(#[case] spec: Value) {
    let v = post("/validate", &review("LLMEndpoint", llmendpoint(spec))).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    assert!(v["response"].get("warnings").is_none(), "{v}");
}

#[rstest]
#[case::selector_missing(json!({"allowedServices": {"namespaces": {"from": "Selector"}}}), "spec.allowedServices.namespaces.selector", "is required with from: Selector")]
#[case::selector_ignored(json!({"allowedServices": {"namespaces": {"from": "All", "selector": {}}}}), "spec.allowedServices.namespaces.selector", "only used with from: Selector")]
#[case::operator(json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "team", "operator": "in", "values": ["ml"]}]}}}}), "spec.allowedServices.namespaces.selector.matchExpressions[0].operator", "use In, NotIn, Exists or DoesNotExist")]
#[case::values(json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "team", "operator": "NotIn"}]}}}}), "spec.allowedServices.namespaces.selector.matchExpressions[0].values", "must not be empty")]
#[case::replicas(json!({"replicas": 0}), "spec.replicas", "between 1 and 20")]
#[case::shape(json!({"allowedServices": {"namespaces": {"from": "Everyone"}}}), "spec.allowedServices.namespaces.from", "unknown variant")]
#[tokio::test]
async fn invalid_llmendpoints_are_denied(
    #[case] spec: Value,
    #[case] field: &str,
    #[case] message: &str,
) {
    let v = assert_denied("LLMEndpoint", llmendpoint(spec), field, message).await;
    let causes = v["response"]["status"]["details"]["causes"]
        .as_array()
        .unwrap();
    assert!(causes.iter().any(|c| c["field"] == field), "{causes:?}");
}

#[rstest]
#[case::replicas(json!({"replicas": 2}), "spec.endpoint.replicas: applies only while the service has its own gateway")]
#[case::api_keys(json!({"apiKeySecretRef": {"name": "keys"}}), "spec.endpoint.apiKeySecretRef: applies only while the service has its own gateway")]
#[tokio::test]
async fn own_gateway_fields_next_to_a_shared_endpoint_are_warnings(
    #[case] endpoint: Value,
    #[case] warning: &str,
) {
    let mut spec = json!({"endpoint": {"sharedEndpointRef": {"name": "shared"}}});
    hearth_test_support::merge_json(&mut spec["endpoint"], endpoint);
    let v = post("/validate", &review("LLMService", llmservice(spec))).await;
    let r = &v["response"];
    assert_eq!(r["allowed"], true, "{v}");
    let warnings = r["warnings"].as_array().expect("warnings");
    assert!(
        warnings
            .iter()
            .any(|w| w.as_str().unwrap().starts_with(warning)),
        "{warning:?} in {warnings:?}"
    );
    // A reference alone is no finding.
    let plain = llmservice(
        json!({"endpoint": {"sharedEndpointRef": {"name": "shared", "namespace": "platform"}}}),
    );
    let v = post("/validate", &review("LLMService", plain)).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    assert!(v["response"].get("warnings").is_none(), "{v}");
}

#[tokio::test]
async fn vendor_selection_resolves_to_the_preferred_vendor() {
    // ascend first: vllm-ascend has no sharing, so a fraction is refused for it.
    let v = post(
        "/validate",
        &review(
            "LLMService",
            llmservice(json!({
                "runtime": {"name": null, "selector": {"vendor": ["cambricon", "ascend", "nvidia"]}},
                "resources": {"fraction": {"memory": "8Gi"}},
            })),
        ),
    )
    .await;
    let msg = v["response"]["status"]["message"].as_str().unwrap();
    assert!(msg.contains("InferenceRuntime \"vllm-ascend\""), "{msg}");
}

fn runtime(patch: Value) -> Value {
    let mut rt = upstream("InferenceRuntime")
        .into_iter()
        .find(|r| r["metadata"]["name"] == "vllm-nvidia-a10")
        .unwrap();
    hearth_test_support::merge_json(&mut rt, patch);
    rt
}

#[rstest]
#[case::template(json!({"spec": {"container": {"args": ["{{ .Model.Name }}"]}}}), "spec.container.args[0]", "unknown template")]
#[case::unclosed(json!({"spec": {"container": {"args": ["{{ .Model.Path"]}}}), "spec.container.args[0]", "without a closing")]
#[case::env_template(json!({"spec": {"container": {"env": [{"name": "X", "value": "{{ .Secret }}"}]}}}), "spec.container.env[0].value", "unknown template")]
#[case::resource(json!({"spec": {"accelerator": {"resourceName": "gpu"}}}), "spec.accelerator.resourceName", "no domain prefix")]
#[case::native(json!({"spec": {"accelerator": {"resourceName": "kubernetes.io/gpu"}}}), "spec.accelerator.resourceName", "reserved for native")]
#[case::port_name(json!({"spec": {"container": {"port": {"name": "HTTP"}}}}), "spec.container.port.name", "not a valid port name")]
#[case::probe_port(json!({"spec": {"health": {"readiness": {"httpGet": {"path": "/health", "port": "metrics"}}}}}), "spec.health.readiness", "probes port \"metrics\"")]
#[case::node_selector(json!({"spec": {"accelerator": {"nodeSelector": {"bad key!": "x"}}}}), "spec.accelerator.nodeSelector[\"bad key!\"]", "the key")]
#[tokio::test]
async fn invalid_runtimes_are_denied(
    #[case] patch: Value,
    #[case] field: &str,
    #[case] message: &str,
) {
    assert_denied("InferenceRuntime", runtime(patch), field, message).await;
}

#[tokio::test]
async fn go_trim_markers_are_admitted_as_the_controller_renders_them() {
    let rt = runtime(
        json!({"spec": {"container": {"args": ["--served-model-name= {{- .Service.Name -}}", "{{- .Model.Path }}"]}}}),
    );
    let v = post("/validate", &review("InferenceRuntime", rt)).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
    // Without the space Go reads `-.Model.Path` as a number: not a trim marker, denied.
    let rt = runtime(json!({"spec": {"container": {"args": ["{{-.Model.Path}}"]}}}));
    let v = post("/validate", &review("InferenceRuntime", rt)).await;
    assert_eq!(v["response"]["allowed"], false, "{v}");
    let msg = v["response"]["status"]["message"].as_str().unwrap();
    assert!(msg.contains("trim marker needs white space"), "{msg}");
}

#[tokio::test]
async fn delete_with_null_object_is_allowed() {
    let old = llmservice(json!({}));
    let mut r = review("LLMService", Value::Null);
    r["request"]["operation"] = json!("DELETE");
    r["request"]["oldObject"] = old;
    for path in ["/validate", "/mutate"] {
        let v = post(path, &r).await;
        assert_eq!(v["response"]["allowed"], true, "{v}");
    }
}

#[tokio::test]
async fn dry_run_gets_the_same_answer() {
    for spec in [
        json!({}),
        json!({"scaling": {"metric": "kvCacheUtil"}}),
        json!({"runtime": {"name": "nope"}}),
    ] {
        let wet = review("LLMService", llmservice(spec));
        let mut dry = wet.clone();
        dry["request"]["dryRun"] = json!(true);
        assert_eq!(post("/validate", &wet).await, post("/validate", &dry).await);
    }
}

#[tokio::test]
async fn status_subresource_updates_are_not_checked() {
    let mut r = review(
        "LLMService",
        llmservice(json!({"scaling": {"metric": "kvCacheUtil"}})),
    );
    r["request"]["operation"] = json!("UPDATE");
    r["request"]["subResource"] = json!("status");
    let v = post("/validate", &r).await;
    assert_eq!(v["response"]["allowed"], true, "{v}");
}

#[tokio::test]
async fn unhandled_kinds_pass_unchanged_with_an_audit_note() {
    let secret = json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}});
    for path in ["/validate", "/mutate"] {
        let v = post(path, &review("Secret", secret.clone())).await;
        let r = &v["response"];
        assert_eq!(r["allowed"], true);
        assert!(r.get("patch").is_none());
        assert!(
            r["auditAnnotations"]["skipped"]
                .as_str()
                .unwrap()
                .contains("/Secret is not handled"),
            "{r}"
        );
    }
}

#[tokio::test]
async fn unannotated_workloads_pass_unchanged() {
    let dep = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "team-a"},
        "spec": {"selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "web", "image": "nginx"}]}}}
    });
    let v = post("/mutate", &review("Deployment", dep)).await;
    assert_eq!(v["response"]["allowed"], true);
    assert!(v["response"].get("patch").is_none());
}

#[tokio::test]
async fn a_workload_container_reaching_devices_it_did_not_request_is_warned_about() {
    let rt = upstream("InferenceRuntime")[0]["metadata"]["name"]
        .as_str()
        .unwrap()
        .to_owned();
    let dep = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "team-a",
                     "annotations": {"serving.hearth.dev/runtime": rt}},
        "spec": {"selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {
                                  "volumes": [{"name": "host-dev", "hostPath": {"path": "/dev/"}}],
                                  "containers": [
                                      {"name": "vllm", "image": "vllm"},
                                      {"name": "exporter", "image": "x",
                                       "volumeMounts": [{"name": "host-dev", "mountPath": "/dev"}]},
                                      {"name": "debug", "image": "y",
                                       "securityContext": {"privileged": true}},
                                  ]}}}
    });
    let v = post("/validate", &review("Deployment", dep)).await;
    let r = &v["response"];
    assert_eq!(r["allowed"], true, "{r}");
    let warnings: Vec<&str> = r["warnings"]
        .as_array()
        .expect("warnings")
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("container \"exporter\"") && w.contains("hostPath \"/dev/\"")),
        "{warnings:?}"
    );
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("container \"debug\"") && w.contains("privileged")),
        "{warnings:?}"
    );
    assert!(
        !warnings.iter().any(|w| w.contains("\"vllm\"")),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn workload_naming_a_missing_runtime_is_denied() {
    let dep = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "web", "namespace": "team-a",
                     "annotations": {"serving.hearth.dev/runtime": "vllm-nowhere"}},
        "spec": {"selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm"}]}}}
    });
    let v = post("/mutate", &review("Deployment", dep)).await;
    let r = &v["response"];
    assert_eq!(r["allowed"], false);
    assert!(
        r["status"]["message"]
            .as_str()
            .unwrap()
            .contains("InferenceRuntime \"vllm-nowhere\" does not exist"),
        "{r}"
    );
}

#[rstest]
#[case::not_json(b"{\"apiVersion\":".to_vec(), StatusCode::BAD_REQUEST, "not a valid AdmissionReview")]
#[case::not_utf8(not_utf8(), StatusCode::BAD_REQUEST, "not UTF-8")]
#[case::not_a_review(b"[1,2,3]".to_vec(), StatusCode::BAD_REQUEST, "not a valid AdmissionReview")]
#[case::no_request(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#.to_vec(), StatusCode::BAD_REQUEST, "has no request")]
#[case::v1beta1(serde_json::to_vec(&{let mut r = review("Secret", json!({"metadata": {"name": "s"}})); r["apiVersion"] = json!("admission.k8s.io/v1beta1"); r}).unwrap(), StatusCode::BAD_REQUEST, "admissionReviewVersions: [v1]")]
#[case::wrong_kind(serde_json::to_vec(&{let mut r = review("Secret", json!({"metadata": {"name": "s"}})); r["kind"] = json!("Pod"); r}).unwrap(), StatusCode::BAD_REQUEST, "answers only admission.k8s.io/v1 AdmissionReview")]
#[case::no_uid(serde_json::to_vec(&{let mut r = review("Secret", json!({"metadata": {"name": "s"}})); r["request"]["uid"] = json!(""); r}).unwrap(), StatusCode::BAD_REQUEST, "no uid")]
#[case::object_not_object(serde_json::to_vec(&{let mut r = review("Secret", json!({"metadata": {"name": "s"}})); r["request"]["object"] = json!(7); r}).unwrap(), StatusCode::BAD_REQUEST, "not a valid AdmissionReview")]
#[tokio::test]
async fn malformed_bodies_get_clean_errors(
    #[case] body: Vec<u8>,
    #[case] status: StatusCode,
    #[case] message: &str,
) {
    for path in ["/validate", "/mutate"] {
        let (got, v) = post_raw(app(), path, Body::from(body.clone())).await;
        assert_eq!(got, status, "{v}");
        assert!(v["message"].as_str().unwrap().contains(message), "{v}");
    }
}

/// A review whose ignored field holds bytes that are not UTF-8 (found by the fuzzer: serde_json
/// skips ignored strings unchecked).
fn not_utf8() -> Vec<u8> {
    let marker = "NOT-UTF8-MARKER";
    let body = review(
        "Secret",
        json!({"metadata": {"name": "s", "ignored": marker}}),
    )
    .to_string();
    let at = body.find(marker).unwrap();
    let mut bytes = body.as_bytes()[..at].to_vec();
    bytes.extend([0xfe, 0xff]);
    bytes.extend(&body.as_bytes()[at + marker.len()..]);
    bytes
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let limits = Limits {
        max_body: 1024,
        ..Limits::default()
    };
    let mut obj = llmservice(json!({}));
    obj["metadata"]["annotations"] = json!({"pad": "x".repeat(4096)});
    let body = review("LLMService", obj).to_string();
    // With and without a Content-Length (a streamed body is cut at the limit).
    let (status, v) = post_raw(app_with(limits), "/validate", Body::from(body.clone())).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    let stream = futures::stream::iter(
        body.into_bytes()
            .chunks(100)
            .map(|c| Ok::<_, std::io::Error>(c.to_vec()))
            .collect::<Vec<_>>(),
    );
    let (status, v) = post_raw(app_with(limits), "/validate", Body::from_stream(stream)).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{v}");
    assert!(v["message"].as_str().unwrap().contains("1024 bytes"));
}

#[tokio::test]
async fn a_body_that_never_ends_gets_408() {
    let limits = Limits {
        body_timeout: Duration::from_millis(200),
        ..Limits::default()
    };
    let stream = futures::stream::iter([Ok::<_, std::io::Error>(b"{\"apiVersion\"".to_vec())])
        .chain(futures::stream::pending());
    let (status, v) = post_raw(app_with(limits), "/validate", Body::from_stream(stream)).await;
    assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "{v}");
}

#[tokio::test]
async fn non_json_content_type_gets_415() {
    let req = Request::post("/validate")
        .header("content-type", "application/yaml")
        .body(Body::from("apiVersion: v1"))
        .unwrap();
    let resp = app().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
}

#[tokio::test]
async fn metrics_count_reviews_and_errors() {
    let state = AppState::new(snapshot(), Limits::default());
    let app = router(state.clone());
    let ok = review("LLMService", llmservice(json!({})));
    post_raw(app.clone(), "/validate", Body::from(ok.to_string())).await;
    post_raw(app.clone(), "/validate", Body::from("nope")).await;
    let text = state.metrics.encode();
    assert!(
        text.contains(r#"hearth_webhook_reviews_total{endpoint="validate",kind="LLMService",outcome="allowed"} 1"#),
        "{text}"
    );
    assert!(
        text.contains(
            r#"hearth_webhook_request_errors_total{endpoint="validate",reason="malformed"} 1"#
        ),
        "{text}"
    );
    let resp = app
        .oneshot(Request::get("/metrics").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

use futures::StreamExt as _;

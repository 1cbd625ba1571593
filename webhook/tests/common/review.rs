//! AdmissionReviews as the apiserver sends them, and posting them to the router in-process.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

/// The group, version and resource the apiserver names `kind` by in a review.
pub fn resource_of(kind: &str) -> (&'static str, &'static str, &'static str) {
    match kind {
        "LLMService" => ("serving.hearth.dev", "v1alpha1", "llmservices"),
        "LLMEndpoint" => ("serving.hearth.dev", "v1alpha1", "llmendpoints"),
        "LLMAdapter" => ("serving.hearth.dev", "v1alpha1", "llmadapters"),
        "InferenceRuntime" => ("serving.hearth.dev", "v1alpha1", "inferenceruntimes"),
        "Deployment" => ("apps", "v1", "deployments"),
        "StatefulSet" => ("apps", "v1", "statefulsets"),
        "Pod" => ("", "v1", "pods"),
        "Secret" => ("", "v1", "secrets"),
        "ConfigMap" => ("", "v1", "configmaps"),
        other => panic!("no resource for {other}"),
    }
}

/// An `admission.k8s.io/v1` AdmissionReview asking to `operation` (CREATE, UPDATE, ...)
/// `object` of `kind` in namespace team-a, as user alice. An UPDATE carries the object as its
/// old object too; an object without a name (a DELETE's null) is reviewed under the name "x".
pub fn admission_review(kind: &str, object: Value, operation: &str) -> Value {
    let (group, version, resource) = resource_of(kind);
    let old = if operation == "UPDATE" {
        object.clone()
    } else {
        Value::Null
    };
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "name": object["metadata"]["name"].as_str().unwrap_or("x"),
            "namespace": "team-a",
            "operation": operation,
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": old,
            "dryRun": false,
        }
    })
}

/// Posts `body` to `path` on `app` and returns the status and the JSON answer.
pub async fn post_raw(app: axum::Router, path: &str, body: Body) -> (StatusCode, Value) {
    let req = Request::post(path)
        .header("content-type", "application/json")
        .body(body)
        .unwrap();
    let resp = app.oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|e| panic!("response is not JSON ({e}): {bytes:?}"));
    (status, v)
}

/// Posts `review` to `path` on `app`, checks the protocol invariants every answer keeps (200,
/// an `admission.k8s.io/v1` AdmissionReview, the uid echoed, a patchType only with a patch)
/// and returns the answer.
pub async fn post_review(app: axum::Router, path: &str, review: &Value) -> Value {
    let (status, v) = post_raw(app, path, Body::from(review.to_string())).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(v["kind"], "AdmissionReview");
    assert_eq!(v["response"]["uid"], review["request"]["uid"]);
    let r = &v["response"];
    assert_eq!(
        r.get("patchType").is_some(),
        r.get("patch").is_some(),
        "patchType only with a patch: {r}"
    );
    v
}

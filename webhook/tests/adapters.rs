//! `LLMAdapter` admission through the axum router in-process: the adapter is checked against
//! its base, the base's runtime and other adapters, the base's shared endpoint and the
//! adapter's namespace, read from reflector stores filled here as the watches would fill them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use common::review::{admission_review, post_review};
use hearth_crds::{InferenceRuntime, LLMAdapter, LLMEndpoint, LLMService};
use hearth_webhook::{AppState, Limits, ServingStores, Snapshot, router};
use k8s_openapi::api::core::v1::Namespace;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use rstest::rstest;
use serde_json::{Value, json};

/// A store holding `objects`, as a reflector fills it.
fn store<K>(objects: Vec<Value>) -> Store<K>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + 'static,
{
    let (reader, mut writer) = reflector::store::<K>();
    writer.apply_watcher_event(&watcher::Event::Init);
    for o in objects {
        writer.apply_watcher_event(&watcher::Event::InitApply(
            serde_json::from_value::<K>(o).unwrap(),
        ));
    }
    writer.apply_watcher_event(&watcher::Event::InitDone);
    reader
}

fn runtime(name: &str, adapters: Value) -> Value {
    let mut rt = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": name},
        "spec": {
            "vendor": "nvidia",
            "container": {"image": "vllm/vllm-openai:v0.25.1", "args": ["{{ .Model.Path }}"]},
            "accelerator": {"resourceName": "nvidia.com/gpu"},
        }
    });
    if !adapters.is_null() {
        rt["spec"]["adapters"] = adapters;
    }
    rt
}

fn service(name: &str, runtime: &str, extra: Value) -> Value {
    let mut svc = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {
            "model": {"source": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}},
            "runtime": {"name": runtime},
        }
    });
    hearth_test_support::merge_json(&mut svc["spec"], extra);
    svc
}

fn adapter(name: &str, spec: Value) -> Value {
    let mut a = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"serviceRef": {"name": "qwen"}, "source": {"uri": "hf://acme/qwen-sql-lora"}},
    });
    hearth_test_support::merge_json(&mut a["spec"], spec);
    a
}

/// The cluster the reviews see: runtime `lora` (maxRank 32, maxAdapters 2) and `plain` (no
/// adapters); in team-a the base `qwen` on `lora` (on the shared endpoint `shared`, whose other
/// model is `llama`, of team-c, with its adapter `docs`), `mistral` on `plain`, and the adapter
/// `sql` (created earlier) on `qwen`; namespace team-b labelled `adapters: qwen`.
fn app() -> axum::Router {
    let runtimes = [
        runtime("lora", json!({"maxRank": 32, "maxAdapters": 2})),
        runtime("plain", Value::Null),
    ]
    .map(|v| serde_json::from_value::<InferenceRuntime>(v).unwrap());
    let mut snapshot = Snapshot::with_runtimes(runtimes);
    let mut sql = adapter("sql", json!({}));
    sql["metadata"]["creationTimestamp"] = json!("2026-12-01T00:00:00Z");
    let endpoint = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "shared", "namespace": "team-a"},
        "spec": {},
        "status": {"models": [
            {"name": "qwen", "namespace": "team-a", "service": "qwen"},
            {"name": "llama", "namespace": "team-c", "service": "llama"},
        ]},
    });
    // The endpoint's other base, llama in team-c, with its adapter `docs`.
    let mut llama = service(
        "llama",
        "lora",
        json!({"endpoint": {"sharedEndpointRef": {"name": "shared", "namespace": "team-a"}}}),
    );
    llama["metadata"]["namespace"] = json!("team-c");
    let mut docs = adapter("docs", json!({"serviceRef": {"name": "llama"}}));
    docs["metadata"]["namespace"] = json!("team-c");
    docs["metadata"]["creationTimestamp"] = json!("2026-12-01T00:00:00Z");
    snapshot.serving = Some(ServingStores {
        services: store::<LLMService>(vec![
            service(
                "qwen",
                "lora",
                json!({"endpoint": {"sharedEndpointRef": {"name": "shared"}}}),
            ),
            service("mistral", "plain", json!({})),
            llama,
        ]),
        adapters: store::<LLMAdapter>(vec![sql, docs]),
        endpoints: store::<LLMEndpoint>(vec![endpoint]),
    });
    snapshot.namespaces = Some(store::<Namespace>(vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-a"}}),
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-b", "labels": {"adapters": "qwen"}}}),
    ]));
    router(AppState::new(snapshot, Limits::default()))
}

async fn validate(object: Value, operation: &str) -> Value {
    let v = post_review(
        app(),
        "/validate",
        &admission_review("LLMAdapter", object, operation),
    )
    .await;
    v["response"].clone()
}

#[rstest]
#[case::within_limits("CREATE", adapter("chat", json!({"rank": 32})))]
#[case::existing_one_updated("UPDATE", adapter("sql", json!({"rank": 8})))]
#[case::own_served_name("CREATE", adapter("chat", json!({"servedName": "acme/qwen-chat:v2"})))]
#[tokio::test]
async fn adapters_within_their_runtime_s_limits_are_allowed(
    #[case] operation: &str,
    #[case] object: Value,
) {
    let r = validate(object, operation).await;
    assert_eq!(r["allowed"], true, "{r}");
    assert!(r.get("warnings").is_none(), "{r}");
}

#[rstest]
#[case::rank(adapter("chat", json!({"rank": 64})), "spec.rank", "64 is above 32, the highest rank InferenceRuntime lora accepts")]
#[case::name_of_a_sibling(adapter("sql-v2", json!({"servedName": "sql"})), "spec.servedName", "taken by LLMAdapter team-a/sql")]
#[case::name_of_the_base(adapter("qwen", json!({})), "metadata.name", "taken by LLMService team-a/qwen")]
#[case::name_on_the_endpoint(adapter("chat", json!({"servedName": "llama"})), "spec.servedName", "LLMService team-c/llama (on the same LLMEndpoint)")]
#[case::name_of_an_adapter_on_the_endpoint(adapter("chat", json!({"servedName": "docs"})), "spec.servedName", "taken by LLMAdapter team-c/docs of LLMService team-c/llama (on the same LLMEndpoint)")]
#[case::runtime_without_adapters(adapter("chat", json!({"serviceRef": {"name": "mistral"}})), "spec.serviceRef", "InferenceRuntime plain, which does not serve adapters")]
#[case::other_namespace(json!({"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMAdapter", "metadata": {"name": "chat", "namespace": "team-b"}, "spec": {"serviceRef": {"name": "qwen", "namespace": "team-a"}, "source": {"uri": "hf://acme/x"}}}), "spec.serviceRef", "admits adapters of its own namespace only")]
#[case::source(adapter("chat", json!({"source": {"uri": "s3://bucket/lora"}})), "spec.source.uri", "")]
#[case::claim_of_another_namespace(json!({"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMAdapter", "metadata": {"name": "chat", "namespace": "team-b"}, "spec": {"serviceRef": {"name": "qwen", "namespace": "team-a"}, "source": {"uri": "pvc://lora/chat"}}}), "spec.source.uri", "a pvc:// adapter must be in its base's namespace")]
#[tokio::test]
async fn adapters_breaking_a_rule_are_denied_naming_the_field(
    #[case] object: Value,
    #[case] field: &str,
    #[case] message: &str,
) {
    let r = validate(object, "CREATE").await;
    assert_eq!(r["allowed"], false, "{r}");
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(msg.contains(&format!("{field}: ")), "{field} in {msg}");
    assert!(msg.contains(message), "{message:?} in {msg}");
    let causes = r["status"]["details"]["causes"].as_array().unwrap();
    assert!(causes.iter().any(|c| c["field"] == field), "{causes:?}");
}

#[tokio::test]
async fn the_runtime_s_max_adapters_counts_the_older_ones() {
    // maxAdapters 2 and `sql` exists: a second is allowed, and once it exists a third is not.
    let first = validate(adapter("chat", json!({})), "CREATE").await;
    assert_eq!(first["allowed"], true, "{first}");
    let mut chat = adapter("chat", json!({}));
    chat["metadata"]["creationTimestamp"] = json!("2026-12-02T00:00:00Z");
    // A cluster where both exist.
    let runtimes = [runtime("lora", json!({"maxRank": 32, "maxAdapters": 2}))]
        .map(|v| serde_json::from_value::<InferenceRuntime>(v).unwrap());
    let mut snapshot = Snapshot::with_runtimes(runtimes);
    let mut sql = adapter("sql", json!({}));
    sql["metadata"]["creationTimestamp"] = json!("2026-12-01T00:00:00Z");
    snapshot.serving = Some(ServingStores {
        services: store::<LLMService>(vec![service("qwen", "lora", json!({}))]),
        adapters: store::<LLMAdapter>(vec![sql, chat]),
        endpoints: store::<LLMEndpoint>(vec![]),
    });
    let app = router(AppState::new(snapshot, Limits::default()));
    let v = post_review(
        app,
        "/validate",
        &admission_review("LLMAdapter", adapter("third", json!({})), "CREATE"),
    )
    .await;
    let r = &v["response"];
    assert_eq!(r["allowed"], false, "{r}");
    let msg = r["status"]["message"].as_str().unwrap();
    assert!(
        msg.contains("has 2 adapters already") && msg.contains("maxAdapters: 2"),
        "{msg}"
    );
}

#[tokio::test]
async fn a_base_that_does_not_exist_yet_is_a_warning() {
    let r = validate(
        adapter("chat", json!({"serviceRef": {"name": "later"}})),
        "CREATE",
    )
    .await;
    assert_eq!(r["allowed"], true, "{r}");
    let warnings = r["warnings"].as_array().expect("warnings");
    assert!(
        warnings[0]
            .as_str()
            .unwrap()
            .contains("LLMService team-a/later does not exist (yet)"),
        "{warnings:?}"
    );
}

#[tokio::test]
async fn a_base_admitting_a_namespace_by_selector_admits_its_adapters() {
    // Not the default `Same`: the adapters of namespaces labelled adapters=qwen.
    let runtimes = [runtime("lora", json!({}))]
        .map(|v| serde_json::from_value::<InferenceRuntime>(v).unwrap());
    let mut snapshot = Snapshot::with_runtimes(runtimes);
    snapshot.serving = Some(ServingStores {
        services: store::<LLMService>(vec![service(
            "qwen",
            "lora",
            json!({"allowedAdapters": {"namespaces": {"from": "Selector", "selector": {"matchLabels": {"adapters": "qwen"}}}}}),
        )]),
        adapters: store::<LLMAdapter>(vec![]),
        endpoints: store::<LLMEndpoint>(vec![]),
    });
    snapshot.namespaces = Some(store::<Namespace>(vec![
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-b", "labels": {"adapters": "qwen"}}}),
        json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team-c"}}),
    ]));
    let app = router(AppState::new(snapshot, Limits::default()));
    for (ns, allowed) in [("team-b", true), ("team-c", false)] {
        let object = json!({"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMAdapter",
            "metadata": {"name": "chat", "namespace": ns},
            "spec": {"serviceRef": {"name": "qwen", "namespace": "team-a"}, "source": {"uri": "hf://acme/x"}}});
        let mut review = admission_review("LLMAdapter", object, "CREATE");
        review["request"]["namespace"] = json!(ns);
        let v = post_review(app.clone(), "/validate", &review).await;
        assert_eq!(v["response"]["allowed"], allowed, "{ns}: {v}");
    }
}

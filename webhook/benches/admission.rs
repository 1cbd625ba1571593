//! AdmissionReviews/s and latency over HTTPS on loopback, the server on one core (a
//! current_thread runtime on its own thread), next to the in-process handler as baseline.
//!
//! `cargo bench -p hearth-webhook --bench admission [-- SECONDS [CONNECTIONS]]`
//!
//! Each case is measured twice in the same run: `handle()` called in a loop (no HTTP, no TLS),
//! and the same bodies over HTTPS with keep-alive connections. The table prints both and their
//! ratio, so the cost of the transport is read off the same machine at the same moment.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::exit)]

#[path = "../tests/common/mod.rs"]
mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::HttpsClient;
use common::review::admission_review;
use hearth_crds::{InferenceRuntime, ServingPolicy};
use hearth_webhook::selfmanaged::{generate_ca, issue};
use hearth_webhook::tls::{CertStore, certified_key};
use hearth_webhook::{AppState, Endpoint, Limits, Snapshot, handle, router, serve};
use serde_json::{Value, json};

fn upstream(kind: &str) -> Vec<Value> {
    hearth_test_support::upstream_examples(kind)
}

/// The body of a CREATE review of `object`.
fn review(object: Value) -> Bytes {
    let kind = object["kind"].as_str().unwrap().to_owned();
    Bytes::from(admission_review(&kind, object, "CREATE").to_string())
}

struct Case {
    name: &'static str,
    endpoint: Endpoint,
    body: Bytes,
}

fn cases() -> Vec<Case> {
    let svc = upstream("LLMService")
        .into_iter()
        .find(|s| s["metadata"]["name"] == "qwen2-5-7b-a10")
        .unwrap();
    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "team-a", "labels": {"team": "search"},
                     "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10"}},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "qwen"}},
                 "template": {"metadata": {"labels": {"app": "qwen"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1",
                                                       "args": ["Qwen/Qwen2.5-7B-Instruct"],
                                                       "resources": {"requests": {"memory": "32Gi"}}}]}}}
    });
    vec![
        Case {
            name: "validate LLMService",
            endpoint: Endpoint::Validate,
            body: review(svc),
        },
        Case {
            name: "mutate Deployment",
            endpoint: Endpoint::Mutate,
            body: review(deployment.clone()),
        },
        Case {
            name: "validate Deployment",
            endpoint: Endpoint::Validate,
            body: review(deployment),
        },
    ]
}

/// The twenty platform policies of `benches/platform-policies.yaml`.
fn platform() -> Vec<ServingPolicy> {
    let mut bundle = hearth_policies::manifest::Bundle::default();
    let path =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/platform-policies.yaml");
    hearth_policies::manifest::read_path(&path, &mut bundle).unwrap();
    assert_eq!(bundle.policies.len(), 20);
    bundle.policies
}

fn snapshot(policies: &[ServingPolicy]) -> Snapshot {
    let (_, errors) = hearth_policies::PolicySet::compile(policies);
    assert!(errors.is_empty(), "{errors:?}");
    Snapshot::offline(
        upstream("InferenceRuntime")
            .into_iter()
            .map(|v| serde_json::from_value::<InferenceRuntime>(v).unwrap()),
        policies,
    )
}

struct Stats {
    per_sec: f64,
    p50: Duration,
    p99: Duration,
}

fn stats(mut lat: Vec<Duration>, elapsed: Duration) -> Stats {
    lat.sort_unstable();
    let at = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    Stats {
        per_sec: lat.len() as f64 / elapsed.as_secs_f64(),
        p50: at(0.50),
        p99: at(0.99),
    }
}

fn in_process(case: &Case, snap: &Snapshot, secs: f64) -> Stats {
    let mut lat = Vec::new();
    let start = Instant::now();
    while start.elapsed().as_secs_f64() < secs {
        let t = Instant::now();
        let a = handle(case.endpoint, &case.body, snap).unwrap();
        std::hint::black_box(serde_json::to_vec(&a.review).unwrap());
        lat.push(t.elapsed());
    }
    stats(lat, start.elapsed())
}

fn over_https(case: &Case, client: &HttpsClient, conns: usize, secs: f64) -> Stats {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs_f64(secs);
        let start = Instant::now();
        let tasks: Vec<_> = (0..conns)
            .map(|_| {
                let client = client.clone();
                let body = case.body.clone();
                let path = case.endpoint.path();
                tokio::spawn(async move {
                    let mut conn = client.connect().await.unwrap();
                    let mut lat = Vec::new();
                    while Instant::now() < deadline {
                        let t = Instant::now();
                        let (status, _) = conn.post(path, body.clone()).await.unwrap();
                        assert_eq!(status, 200);
                        lat.push(t.elapsed());
                    }
                    lat
                })
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await.unwrap());
        }
        stats(all, start.elapsed())
    })
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let secs: f64 = args.first().and_then(|s| s.parse().ok()).unwrap_or(3.0);
    let conns: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(4);
    let _ = rustls::crypto::ring::default_provider().install_default();

    let (ca, ca_key, ca_not_after) = generate_ca(Duration::from_secs(3600)).unwrap();
    let (cert, key, _) = issue(
        &ca_key,
        ca_not_after,
        &["127.0.0.1".to_owned()],
        Duration::from_secs(3600),
    )
    .unwrap();
    let store = CertStore::new(certified_key(cert.as_bytes(), key.as_bytes()).unwrap());
    let builtins = hearth_policies::builtin::policies().unwrap();
    let all: Vec<ServingPolicy> = builtins.iter().cloned().chain(platform()).collect();
    let snap = snapshot(&all);
    let limits = Limits::default();
    let app = router(AppState::new(snap.clone(), limits));

    // The server: one thread, one current_thread runtime, so it uses at most one core.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let tls = store.server_config().unwrap();
    let (_stop, stop_rx) = tokio::sync::watch::channel(false);
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                serve(listener, tls, app, limits, stop_rx).await;
            });
    });
    let client = HttpsClient::new(&ca, addr);
    let client = Arc::new(client);

    println!(
        "hearth-webhook admission benchmark: {secs} s per row, {conns} keep-alive HTTPS connections, server on one core, {} policies (built-ins + 20 platform)",
        snap.policies.names().len()
    );
    println!(
        "{:<24} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12} {:>10}",
        "case",
        "in-proc/s",
        "in-proc p50",
        "in-proc p99",
        "HTTPS/s",
        "HTTPS p50",
        "HTTPS p99",
        "HTTPS/in"
    );
    for case in cases() {
        // Every case is admitted; the mutating one with a patch.
        let answer = handle(case.endpoint, &case.body, &snap).unwrap();
        let resp = answer.review.response.as_ref().unwrap();
        assert!(resp.allowed, "{}: {:?}", case.name, resp.result);
        assert_eq!(
            resp.patch.is_some(),
            case.endpoint == Endpoint::Mutate,
            "{}",
            case.name
        );
        // Warm up both paths.
        in_process(&case, &snap, 0.2);
        over_https(&case, &client, conns, 0.3);
        let base = in_process(&case, &snap, secs);
        let net = over_https(&case, &client, conns, secs);
        println!(
            "{:<24} {:>12.0} {:>12.1?} {:>12.1?} {:>12.0} {:>12.1?} {:>12.1?} {:>10.3}",
            case.name,
            base.per_sec,
            base.p50,
            base.p99,
            net.per_sec,
            net.p50,
            net.p99,
            net.per_sec / base.per_sec
        );
    }

    // Where the time goes: the mutate case in-process against subsets of the policy set.
    println!();
    println!("in-process mutate Deployment by policy set ({secs} s per row)");
    println!(
        "{:<32} {:>10} {:>12} {:>12} {:>12}",
        "policies", "count", "reviews/s", "p50", "p99"
    );
    let mutate = cases()
        .into_iter()
        .find(|c| c.name == "mutate Deployment")
        .unwrap();
    for (name, set) in [
        ("none", Vec::new()),
        ("built-ins", builtins.clone()),
        ("20 platform", platform()),
        ("built-ins + 20 platform", all.clone()),
    ] {
        let snap = snapshot(&set);
        in_process(&mutate, &snap, 0.2);
        let st = in_process(&mutate, &snap, secs);
        println!(
            "{:<32} {:>10} {:>12.0} {:>12.1?} {:>12.1?}",
            name,
            set.len(),
            st.per_sec,
            st.p50,
            st.p99
        );
    }
}

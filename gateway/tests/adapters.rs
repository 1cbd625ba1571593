//! LoRA adapters through the gateway against the real stub (LoRA on, runtime loading on, adapter
//! directories in a temp dir): each adapter answers its requests, loads on demand, the least
//! recently used is unloaded past `maxLoaded`, concurrent first requests share one load, a load
//! failure reaches the client and is reported at `/hearth/adapter-failures` until a load
//! succeeds, an adapter the engine lost is loaded again, an unavailable adapter is answered at
//! once, a cold request for an adapter is held, table changes apply at once, a rediscovered or
//! woken engine is read again, and a shared gateway routes adapters by their route table.
//! State is awaited by polling with a deadline.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use common::{shared::*, *};
use hearth_crds::llmadapter::{
    ADAPTER_FAILURES_PATH, AdapterFailures, AdapterLoadFailure, AdapterRoute, AdapterTable,
};
use hearth_crds::llmendpoint::{ModelRoute, RouteTable};
use hearth_gateway::{
    ColdStartMode, EndpointSet, GatewayConfig, Model, RunningGateway,
    sleep::{EngineCall, SleepConfig},
};
use hyper::StatusCode;
use serde_json::{Value, json};
use vllm_stub::{LoraConfig, RunningStub, SleepState, StubConfig};

/// The stub's model path (`stub_config`): the adapters' base.
const BASE: &str = "/models/stub";

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!(
            "hearth-gateway-adapters-{name}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }

    /// A PEFT LoRA adapter directory `<dir>/<name>` of rank 8 for the stub's model.
    fn adapter(&self, name: &str) -> PathBuf {
        let dir = self.0.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("adapter_config.json"),
            json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                "target_modules": ["q_proj", "v_proj"], "bias": "none",
                "base_model_name_or_path": BASE})
            .to_string(),
        )
        .unwrap();
        std::fs::write(dir.join("adapter_model.safetensors"), b"not really tensors").unwrap();
        dir
    }

    /// A path where no adapter is.
    fn missing(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A stub serving `name` with LoRA on and runtime loading, each load taking `load_delay`.
async fn lora_stub(name: &str, load_delay: Duration) -> RunningStub {
    let cfg = StubConfig {
        served_model_names: vec![name.into()],
        lora: LoraConfig {
            enable: true,
            runtime_updating: true,
            max_loras: 4,
            max_cpu_loras: Some(8),
            load_delay,
            ..LoraConfig::default()
        },
        ..stub_config()
    };
    vllm_stub::spawn(cfg, localhost()).await.unwrap()
}

fn table(max_loaded: u32, adapters: &[(&str, &Path)]) -> AdapterTable {
    AdapterTable {
        load_path: "/v1/load_lora_adapter".into(),
        unload_path: "/v1/unload_lora_adapter".into(),
        max_loaded,
        adapters: adapters
            .iter()
            .map(|(name, path)| AdapterRoute {
                name: (*name).into(),
                path: path.to_str().unwrap().into(),
                adapter: format!("ns/{name}"),
                unavailable: None,
            })
            .collect(),
    }
}

/// The test config of a single-service gateway serving `stub-svc`.
fn single_config() -> GatewayConfig {
    GatewayConfig {
        served_model_names: vec!["stub-svc".into()],
        ..config()
    }
}

/// A single-service gateway in front of `backends` serving the adapters of `t`.
async fn single(backends: EndpointSet, t: &AdapterTable) -> RunningGateway {
    let gw = gateway(single_config(), backends).await;
    gw.gateway.apply_adapters(t).unwrap();
    gw
}

fn the_model(gw: &RunningGateway) -> std::sync::Arc<Model> {
    gw.gateway.models().remove(0)
}

/// A chat request for `model`: status and JSON body.
async fn ask(c: &HttpClient, gw: &RunningGateway, model: &str) -> (StatusCode, Value) {
    let (status, _, body) = send_full(c, chat_req(&gw.url(), &chat_for(model, false))).await;
    let v = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
    (status, v)
}

/// Asserts that `model`'s adapter answered `v`.
fn answered_by(v: &Value, adapter: &str) {
    assert_eq!(v["model"], adapter, "{v}");
    let text = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.starts_with(&format!("[adapter {adapter}] ")), "{v}");
}

/// The adapters the stub has registered, sorted.
fn stub_adapters(stub: &RunningStub) -> Vec<String> {
    let mut names: Vec<String> = stub
        .state
        .lora_adapters()
        .into_iter()
        .map(|a| a.name)
        .collect();
    names.sort();
    names
}

/// Polls `check` until it holds, for at most 10 s.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "never {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn loads(text: &str, adapter: &str, outcome: &str) -> f64 {
    let sample = format!(
        "hearth_gateway_adapter_loads_total{{model=\"stub-svc\",adapter=\"{adapter}\",outcome=\"{outcome}\"}}"
    );
    metric(text, &sample).unwrap_or(0.0)
}

fn reloads(text: &str, adapter: &str) -> f64 {
    let sample =
        format!("hearth_gateway_adapter_reloads_total{{model=\"stub-svc\",adapter=\"{adapter}\"}}");
    metric(text, &sample).unwrap_or(0.0)
}

/// The gateway's failed adapter loads (`query`: `?service=...` or empty).
async fn failures(c: &HttpClient, gw: &RunningGateway, query: &str) -> Vec<AdapterLoadFailure> {
    let url = format!("{}{ADAPTER_FAILURES_PATH}{query}", gw.admin_url());
    let (status, body) = get(c, &url).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let report: AdapterFailures = serde_json::from_slice(&body)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&body)));
    report.failures
}

/// Polls the gateway's failed loads until `check` holds, for at most 10 s.
async fn eventually_failures(
    c: &HttpClient,
    gw: &RunningGateway,
    what: &str,
    check: impl Fn(&[AdapterLoadFailure]) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = failures(c, gw, "").await;
        if check(&now) {
            return;
        }
        assert!(Instant::now() < deadline, "never {what}: {now:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Asks the stub directly to unload adapter `name` (as another gateway replica would).
async fn unload_on_stub(c: &HttpClient, stub: &RunningStub, name: &str) {
    let req = post_req(
        &format!("{}/v1/unload_lora_adapter", stub.url()),
        &json!({"lora_name": name}),
        &[],
    );
    let (status, _, body) = send_full(c, req).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
}

fn unloads(text: &str, adapter: &str) -> f64 {
    let sample =
        format!("hearth_gateway_adapter_unloads_total{{model=\"stub-svc\",adapter=\"{adapter}\"}}");
    metric(text, &sample).unwrap_or(0.0)
}

#[tokio::test]
async fn each_adapter_answers_its_requests_and_the_base_model_its_own() {
    let dir = TempDir::new("answers");
    let (a, b, c) = (dir.adapter("a"), dir.adapter("b"), dir.adapter("c"));
    let stub = lora_stub("stub-svc", Duration::from_millis(10)).await;
    let gw = single(
        EndpointSet::fixed([authority(&stub)]),
        &table(3, &[("a", &a), ("b", &b), ("c", &c)]),
    )
    .await;
    let client = client();
    for name in ["a", "b", "c", "a"] {
        let (status, v) = ask(&client, &gw, name).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        answered_by(&v, name);
    }
    let (status, v) = ask(&client, &gw, "stub-svc").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["model"], "stub-svc");
    assert!(
        !v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("[adapter")
    );
    // A stream, through the gateway, answered by the adapter.
    let (status, _, body) = send_full(&client, chat_req(&gw.url(), &chat_for("b", true))).await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    assert!(events.last().unwrap().contains("[DONE]"), "{events:?}");
    let first: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["model"], "b");
    assert!(
        first["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap()
            .starts_with("[adapter b] ")
    );

    // Each adapter was loaded once, on demand.
    assert_eq!(stub.state.lora_loads(), 3);
    assert_eq!(stub_adapters(&stub), ["a", "b", "c"]);
    let text = gateway_metrics(&client, &gw).await;
    for name in ["a", "b", "c"] {
        assert_eq!(loads(&text, name, "loaded"), 1.0, "{name}: {text}");
    }
    assert!(
        metric(
            &text,
            "hearth_gateway_adapter_load_duration_seconds_count{model=\"stub-svc\"}"
        ) == Some(3.0),
        "{text}"
    );
}

#[tokio::test]
async fn past_max_loaded_the_least_recently_used_adapter_is_unloaded() {
    let dir = TempDir::new("lru");
    let (a, b, c) = (dir.adapter("a"), dir.adapter("b"), dir.adapter("c"));
    let stub = lora_stub("stub-svc", Duration::ZERO).await;
    let gw = single(
        EndpointSet::fixed([authority(&stub)]),
        &table(2, &[("a", &a), ("b", &b), ("c", &c)]),
    )
    .await;
    let client = client();
    let model = the_model(&gw);
    // (request, what the engine has after it)
    let steps: [(&str, &[&str]); 6] = [
        ("a", &["a"]),
        ("b", &["a", "b"]),
        ("c", &["b", "c"]),
        ("a", &["a", "c"]),
        ("c", &["a", "c"]),
        ("b", &["b", "c"]),
    ];
    for (name, after) in steps {
        let (status, v) = ask(&client, &gw, name).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        answered_by(&v, name);
        assert_eq!(stub_adapters(&stub), after, "after {name}");
        let mut known = model.adapters().loaded(&authority(&stub));
        known.sort();
        assert_eq!(known, after, "the gateway's view after {name}");
    }
    assert_eq!(stub.state.lora_loads(), 5, "a, b, c, a, b");
    let text = gateway_metrics(&client, &gw).await;
    assert_eq!(unloads(&text, "a"), 2.0, "{text}");
    assert_eq!(unloads(&text, "b"), 1.0, "{text}");
    assert_eq!(unloads(&text, "c"), 0.0, "{text}");

    // The gateway's /v1/models lists the adapters after the model, loaded where the stub says.
    let (status, v) = json(&client, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(status, StatusCode::OK);
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["stub-svc", "a", "b", "c"]);
    let on_stub = stub_adapters(&stub);
    for entry in &data[1..] {
        let id = entry["id"].as_str().unwrap();
        assert_eq!(entry["object"], "model");
        assert_eq!(entry["parent"], "stub-svc");
        assert_eq!(entry["root"], dir.0.join(id).to_str().unwrap());
        assert_eq!(entry["hearth"]["adapter"], format!("ns/{id}"));
        let loaded = usize::from(on_stub.iter().any(|n| n == id));
        assert_eq!(entry["hearth"]["loadedReplicas"], loaded, "{entry}");
    }
    // The stub's own list agrees.
    let (_, stub_list) = json(&client, &format!("{}/v1/models", stub.url())).await;
    let mut stub_ids: Vec<&str> = stub_list["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| !m["parent"].is_null())
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    stub_ids.sort();
    assert_eq!(stub_ids, on_stub);
}

#[tokio::test]
async fn concurrent_first_requests_for_one_adapter_share_one_load() {
    let dir = TempDir::new("single-flight");
    let a = dir.adapter("a");
    let stub = lora_stub("stub-svc", Duration::from_secs(1)).await;
    let gw = single(
        EndpointSet::fixed([authority(&stub)]),
        &table(2, &[("a", &a)]),
    )
    .await;
    let client = client();
    let mut asks = Vec::new();
    for _ in 0..4 {
        let (client, req) = (client.clone(), chat_req(&gw.url(), &chat_for("a", false)));
        asks.push(tokio::spawn(async move { send_full(&client, req).await }));
    }
    // All four are in the gateway while the first load is under way.
    wait_demand(&gw, |s| s.pending() == 4).await;
    assert_eq!(stub.state.lora_loads(), 0, "the load takes a second");
    for ask in asks {
        let (status, _, body) = ask.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        answered_by(&serde_json::from_slice(&body).unwrap(), "a");
    }
    assert_eq!(stub.state.lora_loads(), 1);
    let text = gateway_metrics(&client, &gw).await;
    assert_eq!(loads(&text, "a", "loaded"), 1.0, "{text}");
}

#[tokio::test]
async fn a_load_failure_reaches_the_client_and_the_next_request_loads_again() {
    let dir = TempDir::new("failure");
    let good = dir.adapter("good");
    let bad = dir.missing("bad");
    let stub = lora_stub("stub-svc", Duration::ZERO).await;
    let gw = single(
        EndpointSet::fixed([authority(&stub)]),
        &table(2, &[("bad", &bad), ("good", &good)]),
    )
    .await;
    let client = client();
    for attempt in 1..=2 {
        let (status, v) = ask(&client, &gw, "bad").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
        let e = &v["error"];
        assert_eq!(e["type"], "NotFoundError", "{v}");
        assert_eq!(e["code"], "adapter_load_failed");
        assert_eq!(e["param"], "model");
        let msg = e["message"].as_str().unwrap();
        assert!(
            msg.starts_with("The adapter `bad` could not be loaded: ")
                && msg.contains("No adapter found for")
                && msg.contains(bad.to_str().unwrap()),
            "{msg}"
        );
        let text = gateway_metrics(&client, &gw).await;
        assert_eq!(loads(&text, "bad", "failed"), f64::from(attempt), "{text}");
        // A good adapter works right after.
        let (status, v) = ask(&client, &gw, "good").await;
        assert_eq!(status, StatusCode::OK, "{v}");
        answered_by(&v, "good");
    }
    // A warm stream gets the same answer: nothing was streamed yet.
    let (status, _, body) = send_full(&client, chat_req(&gw.url(), &chat_for("bad", true))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(String::from_utf8_lossy(&body).contains("adapter_load_failed"));

    // The adapter's files arrive: the next request loads it (nothing was remembered).
    dir.adapter("bad");
    let (status, v) = ask(&client, &gw, "bad").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "bad");
}

#[tokio::test]
async fn an_adapter_request_with_no_engine_ready_is_held_until_one_appears() {
    let dir = TempDir::new("cold");
    let a = dir.adapter("a");
    let backends = EndpointSet::new();
    let gw = single(backends.clone(), &table(2, &[("a", &a)])).await;
    let client = client();
    // A stream: heartbeats while held, then the adapter's answer.
    let mut resp = send(&client, chat_req(&gw.url(), &chat_for("a", true))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let first = next_chunk(resp.body_mut()).await.unwrap();
    assert_eq!(first, hearth_gateway::proxy::HEARTBEAT);
    // And a plain request, held silently.
    let plain = {
        let (client, req) = (client.clone(), chat_req(&gw.url(), &chat_for("a", false)));
        tokio::spawn(async move { send_full(&client, req).await })
    };
    wait_demand(&gw, |s| s.pending() == 2).await;
    let stub = lora_stub("stub-svc", Duration::from_millis(20)).await;
    backends.replace([authority(&stub)]);

    let (status, _, body) = plain.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    answered_by(&serde_json::from_slice(&body).unwrap(), "a");
    let mut rest = Vec::new();
    while let Some(chunk) = next_chunk(resp.body_mut()).await {
        rest.extend_from_slice(&chunk);
    }
    let events: Vec<String> = sse_events(&rest)
        .into_iter()
        .filter(|e| !e.starts_with(':'))
        .collect();
    assert!(events.last().unwrap().contains("[DONE]"), "{events:?}");
    let first: Value = serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(first["model"], "a");
    assert!(
        first["choices"][0]["delta"]["content"]
            .as_str()
            .unwrap()
            .starts_with("[adapter a] ")
    );
    assert_eq!(stub.state.lora_loads(), 1, "one load for both");

    // With the base's cold start `reject`, an adapter request is rejected as the base's is.
    let cfg = GatewayConfig {
        cold_start: ColdStartMode::Reject,
        ..single_config()
    };
    let rejecting = gateway(cfg, EndpointSet::new()).await;
    rejecting
        .gateway
        .apply_adapters(&table(2, &[("a", &a)]))
        .unwrap();
    let (status, v) = ask(&client, &rejecting, "a").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(v["error"]["code"], "cold_reject");
    // And a name that is neither the model nor an adapter is refused without waking anything.
    let (status, v) = ask(&client, &rejecting, "nope").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
}

#[tokio::test]
async fn a_table_change_applies_without_a_restart() {
    let dir = TempDir::new("changes");
    let (a, b) = (dir.adapter("a"), dir.adapter("b"));
    let stub = lora_stub("stub-svc", Duration::ZERO).await;
    let gw = single(
        EndpointSet::fixed([authority(&stub)]),
        &table(2, &[("a", &a)]),
    )
    .await;
    let client = client();
    // Not in the table: forwarded as it is, and the engine does not know it.
    let (status, v) = ask(&client, &gw, "b").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(stub.state.lora_loads(), 0);

    let applied = gw
        .gateway
        .apply_adapters(&table(2, &[("a", &a), ("b", &b), ("stub-svc", &a)]))
        .unwrap();
    assert_eq!(applied.adapters, ["a", "b"]);
    assert_eq!(applied.left_out, ["stub-svc"], "the model wins");
    let (status, v) = ask(&client, &gw, "b").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "b");
    let (status, v) = ask(&client, &gw, "stub-svc").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["model"], "stub-svc");

    // A table that does not parse, or is out of range, changes nothing and is counted.
    let e = gw
        .gateway
        .apply_adapters_json("{\"maxLoaded\": 2}")
        .unwrap_err();
    assert!(e.path().is_some(), "{e}");
    let e = gw
        .gateway
        .apply_adapters(&table(0, &[("a", &a)]))
        .unwrap_err();
    assert_eq!(e.path(), Some("maxLoaded"));
    let text = gateway_metrics(&client, &gw).await;
    assert_eq!(
        metric(&text, "hearth_gateway_adapter_table_errors_total"),
        Some(2.0)
    );
    let (status, _) = ask(&client, &gw, "b").await;
    assert_eq!(status, StatusCode::OK);

    // b leaves the table: it is unloaded from the engine, which then refuses it.
    gw.gateway
        .apply_adapters_json(&serde_json::to_string(&table(2, &[("a", &a)])).unwrap())
        .unwrap();
    eventually("b unloaded", || stub_adapters(&stub).is_empty()).await;
    let (status, _) = ask(&client, &gw, "b").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK);
    answered_by(&v, "a");
    // a's files move (its source changed, same name): the engine unloads the old ones, and the
    // next request loads the new path.
    let path_of = |name: &str| {
        stub.state
            .lora_adapters()
            .into_iter()
            .find(|x| x.name == name)
            .map(|x| x.path)
    };
    let (old_path, new_path) = (a.to_string_lossy(), b.to_string_lossy());
    assert_eq!(path_of("a").as_deref(), Some(&*old_path));
    gw.gateway.apply_adapters(&table(2, &[("a", &b)])).unwrap();
    eventually("the old a unloaded", || path_of("a").is_none()).await;
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "a");
    assert_eq!(path_of("a").as_deref(), Some(&*new_path));
    // No table at all (the ConfigMap deleted): no adapters.
    gw.gateway.clear_adapters();
    eventually("a unloaded", || stub_adapters(&stub).is_empty()).await;
    let (status, _) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (_, v) = json(&client, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(
        v["data"].as_array().unwrap().len(),
        1,
        "the engine's list: {v}"
    );
}

#[tokio::test]
async fn an_engine_that_comes_back_is_read_again() {
    let dir = TempDir::new("reread");
    let (a, b) = (dir.adapter("a"), dir.adapter("b"));
    let stub = lora_stub("stub-svc", Duration::ZERO).await;
    let auth = authority(&stub);
    let backends = EndpointSet::fixed([auth.clone()]);
    let gw = single(backends.clone(), &table(2, &[("a", &a), ("b", &b)])).await;
    let client = client();
    let model = the_model(&gw);
    let (status, _) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(model.adapters().loaded(&auth), ["a"]);
    // Behind the gateway's back (a restart, another replica): a is gone, b is there.
    let c = client.clone();
    let call = |path: &str, body: Value| {
        let req = post_req(&format!("{}{path}", stub.url()), &body, &[]);
        let c = c.clone();
        async move { send_full(&c, req).await.0 }
    };
    assert_eq!(
        call("/v1/unload_lora_adapter", json!({"lora_name": "a"})).await,
        StatusCode::OK
    );
    assert_eq!(
        call(
            "/v1/load_lora_adapter",
            json!({"lora_name": "b", "lora_path": b})
        )
        .await,
        StatusCode::OK
    );
    // The engine leaves the serving set and comes back (not ready for a moment, or asleep and
    // woken): it is read again.
    backends.replace([]);
    backends.replace([auth.clone()]);
    eventually("the engine's adapters read again", || {
        model.adapters().loaded(&auth) == ["b"]
    })
    .await;
    let loads_before = stub.state.lora_loads();
    let (status, v) = ask(&client, &gw, "b").await;
    assert_eq!(status, StatusCode::OK);
    answered_by(&v, "b");
    assert_eq!(stub.state.lora_loads(), loads_before, "b was there");
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK);
    answered_by(&v, "a");
    assert_eq!(stub.state.lora_loads(), loads_before + 1, "a loaded again");
}

#[tokio::test]
async fn an_adapter_request_wakes_a_sleeping_engine_whose_adapters_are_read_again() {
    let dir = TempDir::new("sleep");
    let a = dir.adapter("a");
    let cfg = StubConfig {
        enable_sleep_mode: true,
        dev_mode: true,
        sleep_delay: Duration::from_millis(20),
        wake_delay: Duration::from_millis(100),
        served_model_names: vec!["stub-svc".into()],
        lora: LoraConfig {
            enable: true,
            runtime_updating: true,
            max_cpu_loras: Some(4),
            ..LoraConfig::default()
        },
        ..stub_config()
    };
    let stub = vllm_stub::spawn(cfg, localhost()).await.unwrap();
    let auth = authority(&stub);
    let gw_cfg = GatewayConfig {
        sleep: Some(SleepConfig {
            level: 1,
            after: Duration::from_millis(300),
            sleep_path: "/sleep".into(),
            is_sleeping_path: "/is_sleeping".into(),
            wake_up: vec!["/wake_up".parse::<EngineCall>().unwrap()],
            call_timeout: Duration::from_secs(10),
        }),
        ..single_config()
    };
    let gw = gateway(gw_cfg, EndpointSet::fixed([auth.clone()])).await;
    gw.gateway.apply_adapters(&table(2, &[("a", &a)])).unwrap();
    let client = client();
    let model = the_model(&gw);
    // The tier finds the engine awake first.
    eventually("the engine serving", || model.backends().is_ready()).await;
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "a");
    assert_eq!(stub.state.lora_loads(), 1);

    // Idle: put to sleep; the engine leaves the serving set and its adapters are forgotten.
    let mut sleep = stub.state.subscribe_sleep();
    tokio::time::timeout(
        Duration::from_secs(10),
        sleep.wait_for(|s| matches!(s, SleepState::Asleep(_))),
    )
    .await
    .unwrap()
    .unwrap();
    eventually("the engine left", || !model.backends().is_ready()).await;
    eventually("its adapters forgotten", || {
        model.adapters().loaded(&auth).is_empty()
    })
    .await;

    // An adapter request wakes it (held meanwhile); the woken engine still has the adapter
    // (level 1 keeps it), which its /v1/models says: no second load.
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "a");
    assert_eq!(stub.state.lora_loads(), 1, "read again, not loaded again");
    assert_eq!(model.adapters().loaded(&auth), ["a"]);
    let text = gateway_metrics(&client, &gw).await;
    assert_eq!(loads(&text, "a", "loaded"), 1.0, "{text}");
}

#[tokio::test]
async fn a_shared_gateway_routes_adapters_by_its_route_table() {
    let dir = TempDir::new("shared");
    let (x, y, z) = (dir.adapter("x"), dir.adapter("y"), dir.adapter("z"));
    let base = lora_stub("base", Duration::ZERO).await;
    let other = stub_named("other").await;
    let with = |adapters: &[(&str, &Path)]| ModelRoute {
        adapters: Some(table(2, adapters)),
        ..route("base")
    };
    let gw = shared_gateway(
        config(),
        vec![with(&[("other", &x), ("x", &x), ("y", &y)]), route("other")],
        [
            ("base".to_owned(), vec![authority(&base)]),
            ("other".to_owned(), vec![authority(&other)]),
        ]
        .into_iter()
        .collect(),
    )
    .await;
    let client = client();
    let (status, v) = ask(&client, &gw, "x").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "x");
    assert_eq!(base.state.lora_loads(), 1);
    // The model `other` wins over base's adapter of that name.
    let before = other.state.received();
    let (status, v) = ask(&client, &gw, "other").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["model"], "other");
    assert_eq!(other.state.received(), before + 1);
    // An adapter of the table's but not of this model's: unknown.
    let (status, _) = ask(&client, &gw, "z").await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (_, v) = json(&client, &format!("{}/v1/models", gw.url())).await;
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["base", "x", "y", "other"]);
    assert_eq!(data[1]["parent"], "base");
    assert_eq!(data[1]["root"], x.to_str().unwrap());
    assert_eq!(data[1]["hearth"]["service"], "ns/base");
    assert_eq!(data[1]["hearth"]["loadedReplicas"], 1);
    assert_eq!(data[2]["hearth"]["loadedReplicas"], 0);
    let (status, v) = json(&client, &format!("{}/v1/models/y", gw.url())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["id"], "y");
    assert_eq!(v["parent"], "base");

    // A route table update adds z, without a restart and without a new state for base.
    let state_before = gw.gateway.model("ns/base").unwrap();
    gw.gateway
        .apply_routes(&RouteTable {
            models: vec![with(&[("x", &x), ("y", &y), ("z", &z)]), route("other")],
        })
        .unwrap();
    assert!(
        gw.gateway
            .model("ns/base")
            .unwrap()
            .same_state(&state_before)
    );
    let (status, v) = ask(&client, &gw, "z").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "z");
    // A bad adapter table refuses the whole route table; the last good one stays.
    let mut bad = with(&[("x", &x)]);
    if let Some(t) = bad.adapters.as_mut() {
        t.max_loaded = 0;
    }
    let e = gw
        .gateway
        .apply_routes(&RouteTable {
            models: vec![bad, route("other")],
        })
        .unwrap_err();
    assert_eq!(e.path(), Some("models[0].adapters.maxLoaded"), "{e}");
    let (status, _) = ask(&client, &gw, "z").await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn failed_loads_are_reported_until_a_load_succeeds() {
    let dir = TempDir::new("reported");
    let good = dir.adapter("good");
    let (bad, other) = (dir.missing("bad"), dir.missing("other"));
    let stub = lora_stub("stub-svc", Duration::ZERO).await;
    let auth = authority(&stub);
    let backends = EndpointSet::fixed([auth.clone()]);
    let gw = single(
        backends.clone(),
        &table(4, &[("bad", &bad), ("good", &good), ("other", &other)]),
    )
    .await;
    let client = client();
    assert_eq!(failures(&client, &gw, "").await, []);
    let (status, _) = ask(&client, &gw, "good").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        failures(&client, &gw, "").await,
        [],
        "a load that succeeded"
    );

    // A refused load: the engine's status and its own message, the engine, the time.
    let (status, v) = ask(&client, &gw, "bad").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let first = failures(&client, &gw, "").await;
    assert_eq!(first.len(), 1, "{first:?}");
    let f = &first[0];
    assert_eq!(
        (
            f.service.as_str(),
            f.adapter.as_str(),
            f.name.as_str(),
            f.engine.as_str(),
            f.status
        ),
        ("", "ns/bad", "bad", auth.as_str(), 404),
        "{f:?}"
    );
    assert!(
        f.message.contains("No adapter found for") && f.message.contains(bad.to_str().unwrap()),
        "{f:?}"
    );
    assert!(
        !f.message.starts_with("The adapter"),
        "the engine's message: {f:?}"
    );
    let client_message = v["error"]["message"].as_str().unwrap();
    assert!(client_message.ends_with(&f.message), "{client_message}");
    let at: k8s_openapi::jiff::Timestamp = f.time.parse().unwrap();
    assert!(f.time.ends_with('Z'), "UTC: {}", f.time);
    assert!(
        k8s_openapi::jiff::Timestamp::now()
            .duration_since(at)
            .as_secs()
            < 60
    );
    // The service is left out of a single-service gateway's JSON.
    let (_, raw) = json(
        &client,
        &format!("{}{ADAPTER_FAILURES_PATH}", gw.admin_url()),
    )
    .await;
    assert!(raw["failures"][0].get("service").is_none(), "{raw}");

    // Failing again keeps one entry per adapter and engine; another adapter has its own, in
    // order.
    let (status, _) = ask(&client, &gw, "bad").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = ask(&client, &gw, "other").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let now = failures(&client, &gw, "").await;
    let names: Vec<&str> = now.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["bad", "other"], "{now:?}");
    assert!(now[0].time >= first[0].time);

    // bad's files arrive: its next load succeeds and its entry goes.
    dir.adapter("bad");
    let (status, v) = ask(&client, &gw, "bad").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let now = failures(&client, &gw, "").await;
    let names: Vec<&str> = now.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["other"]);

    // other's path changes: its entry (of the old path) goes.
    let moved = dir.missing("other-moved");
    let t = table(4, &[("bad", &bad), ("good", &good), ("other", &moved)]);
    gw.gateway.apply_adapters(&t).unwrap();
    eventually_failures(&client, &gw, "the old path's failure gone", |f| {
        f.is_empty()
    })
    .await;
    // It fails on its new path, then leaves the table: its entry goes.
    let (status, _) = ask(&client, &gw, "other").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(failures(&client, &gw, "").await.len(), 1);
    gw.gateway
        .apply_adapters(&table(4, &[("bad", &bad), ("good", &good)]))
        .unwrap();
    eventually_failures(&client, &gw, "the failure of an adapter that left", |f| {
        f.is_empty()
    })
    .await;

    // The engine leaves the serving set: its entries go.
    gw.gateway
        .apply_adapters(&table(
            4,
            &[("bad", &bad), ("good", &good), ("other", &moved)],
        ))
        .unwrap();
    let (status, _) = ask(&client, &gw, "other").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(failures(&client, &gw, "").await.len(), 1);
    backends.replace([]);
    eventually_failures(&client, &gw, "the failure of an engine that left", |f| {
        f.is_empty()
    })
    .await;
}

#[tokio::test]
async fn a_shared_gateway_reports_each_models_failed_loads() {
    let dir = TempDir::new("shared-failures");
    let (x, y) = (dir.missing("x"), dir.adapter("y"));
    let base = lora_stub("base", Duration::ZERO).await;
    let other = lora_stub("other", Duration::ZERO).await;
    let with = |name: &str, adapters: &[(&str, &Path)]| ModelRoute {
        adapters: Some(table(2, adapters)),
        ..route(name)
    };
    let gw = shared_gateway(
        config(),
        vec![with("base", &[("x", &x)]), with("other", &[("y", &y)])],
        [
            ("base".to_owned(), vec![authority(&base)]),
            ("other".to_owned(), vec![authority(&other)]),
        ]
        .into_iter()
        .collect(),
    )
    .await;
    let client = client();
    let (status, _) = ask(&client, &gw, "x").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _) = ask(&client, &gw, "y").await;
    assert_eq!(status, StatusCode::OK);
    let all = failures(&client, &gw, "").await;
    assert_eq!(all.len(), 1, "{all:?}");
    assert_eq!(
        (
            all[0].service.as_str(),
            all[0].name.as_str(),
            all[0].engine.as_str()
        ),
        ("ns/base", "x", authority(&base).as_str())
    );
    assert_eq!(failures(&client, &gw, "?service=ns/base").await, all);
    assert_eq!(failures(&client, &gw, "?service=ns%2Fbase").await, all);
    assert_eq!(failures(&client, &gw, "?service=ns/other").await, []);
    let (status, v) = json(
        &client,
        &format!("{}{ADAPTER_FAILURES_PATH}?service=ns/nope", gw.admin_url()),
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert!(v["error"].as_str().unwrap().contains("ns/nope"), "{v}");
}

#[tokio::test]
async fn an_adapter_the_engine_lost_is_loaded_again_and_the_request_sent_once_more() {
    let dir = TempDir::new("lost");
    let a = dir.adapter("a");
    let stub = lora_stub("stub-svc", Duration::from_millis(200)).await;
    let gw = single(
        EndpointSet::fixed([authority(&stub)]),
        &table(2, &[("a", &a)]),
    )
    .await;
    let client = client();
    let model = the_model(&gw);
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(stub.state.lora_loads(), 1);

    // Another replica unloads it; this one still thinks the engine has it.
    unload_on_stub(&client, &stub, "a").await;
    assert_eq!(model.adapters().loaded(&authority(&stub)), ["a"]);
    let received = stub.state.received();
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "a");
    assert_eq!(stub_adapters(&stub), ["a"], "loaded again");
    assert_eq!(stub.state.lora_loads(), 2);
    assert_eq!(
        stub.state.received(),
        received + 2,
        "the 404, then the answer"
    );
    let text = gateway_metrics(&client, &gw).await;
    assert_eq!(reloads(&text, "a"), 1.0, "{text}");
    assert_eq!(loads(&text, "a", "loaded"), 2.0, "{text}");

    // Lost again, and several requests find it so at once: one load for all (a stream too).
    unload_on_stub(&client, &stub, "a").await;
    let mut asks = Vec::new();
    for i in 0..4 {
        let (client, req) = (client.clone(), chat_req(&gw.url(), &chat_for("a", i == 0)));
        asks.push(tokio::spawn(async move { send_full(&client, req).await }));
    }
    for (i, ask) in asks.into_iter().enumerate() {
        let (status, _, body) = ask.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        if i == 0 {
            let events = sse_events(&body);
            let first: Value =
                serde_json::from_str(events[0].strip_prefix("data: ").unwrap()).unwrap();
            assert_eq!(first["model"], "a");
        } else {
            answered_by(&serde_json::from_slice(&body).unwrap(), "a");
        }
    }
    assert_eq!(stub.state.lora_loads(), 3, "one more load, shared");
    assert_eq!(stub_adapters(&stub), ["a"]);

    // Another 404 of the engine's is relayed as it is: nothing is loaded again.
    let before = reloads(&gateway_metrics(&client, &gw).await, "a");
    assert!(before >= 2.0);
    let req = post_req(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat_for("a", false),
        &[("x-stub-status", "404")],
    );
    let (status, _, body) = send_full(&client, req).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let v: Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "StubError", "{v}");
    assert_eq!(stub.state.lora_loads(), 3);
    let text = gateway_metrics(&client, &gw).await;
    assert_eq!(reloads(&text, "a"), before, "{text}");
}

/// A fake engine that loads any adapter and then answers every request `404` "does not
/// exist", as an engine that keeps losing its adapters would: the number of loads and of
/// requests it got.
async fn forgetful_engine() -> (
    http::uri::Authority,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };
    let (loads, asks) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let (l, a) = (loads.clone(), asks.clone());
    let app = axum::Router::new()
        .route(
            "/v1/models",
            axum::routing::get(|| async {
                axum::Json(json!({"object": "list", "data": [{"id": "stub-svc", "parent": null}]}))
            }),
        )
        .route(
            "/v1/load_lora_adapter",
            axum::routing::post(move || {
                l.fetch_add(1, Ordering::SeqCst);
                async { "Success" }
            }),
        )
        .route(
            "/v1/chat/completions",
            axum::routing::post(move |body: axum::body::Bytes| {
                a.fetch_add(1, Ordering::SeqCst);
                async move {
                    let model = serde_json::from_slice::<Value>(&body).unwrap()["model"].clone();
                    let message = format!("The model `{}` does not exist.", model.as_str().unwrap());
                    (
                        StatusCode::NOT_FOUND,
                        axum::Json(json!({"error": {"message": message, "type": "NotFoundError", "param": null, "code": 404}})),
                    )
                }
            }),
        );
    let listener = tokio::net::TcpListener::bind(localhost()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr.to_string().parse().unwrap(), loads, asks)
}

#[tokio::test]
async fn an_engine_that_says_so_twice_is_answered_with_its_404() {
    use std::sync::atomic::Ordering;
    let dir = TempDir::new("lost-twice");
    let a = dir.adapter("a");
    let (engine, loads, asks) = forgetful_engine().await;
    let gw = single(EndpointSet::fixed([engine]), &table(2, &[("a", &a)])).await;
    let client = client();
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    assert_eq!(
        v["error"]["message"], "The model `a` does not exist.",
        "{v}"
    );
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert_eq!(
        loads.load(Ordering::SeqCst),
        2,
        "loaded, then loaded again once"
    );
    assert_eq!(asks.load(Ordering::SeqCst), 2, "sent, then sent once more");
    let text = gateway_metrics(&client, &gw).await;
    assert_eq!(reloads(&text, "a"), 1.0, "{text}");
}

#[tokio::test]
async fn an_unavailable_adapter_is_answered_at_once_without_a_load_or_a_wake() {
    let dir = TempDir::new("unavailable");
    let (a, b) = (dir.adapter("a"), dir.adapter("b"));
    let fetching = |name: &str, path: &Path| AdapterRoute {
        unavailable: Some("its files are still being fetched into the model cache".into()),
        ..table(2, &[(name, path)]).adapters.remove(0)
    };
    let mut t = table(2, &[("b", &b)]);
    t.adapters.insert(0, fetching("a", &a));
    let client = client();
    let check_answer = |status: StatusCode, headers: &http::HeaderMap, body: &[u8]| {
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(headers[http::header::RETRY_AFTER], "3", "--retry-after");
        let v: Value = serde_json::from_slice(body).unwrap();
        let e = &v["error"];
        assert_eq!(e["type"], "server_error", "{v}");
        assert_eq!(e["code"], "adapter_unavailable");
        assert_eq!(e["param"], "model");
        assert_eq!(
            e["message"],
            "The adapter `a` cannot be loaded yet: its files are still being fetched into the model cache"
        );
    };

    // At zero: answered at once, no demand raised, no lease, nothing to wake.
    let cold = single(EndpointSet::new(), &t).await;
    for stream in [false, true] {
        let (status, headers, body) =
            send_full(&client, chat_req(&cold.url(), &chat_for("a", stream))).await;
        check_answer(status, &headers, &body);
    }
    let state = cold.gateway.demand().state();
    assert_eq!((state.pending(), state.lease()), (0, false), "{state:?}");
    let text = gateway_metrics(&client, &cold).await;
    assert_eq!(
        metric(&text, "hearth_gateway_activation_events_total"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "hearth_gateway_rejections_total{reason=\"adapter_unavailable\"}"
        ),
        Some(2.0),
        "{text}"
    );

    // Warm: the engine gets nothing, no load is tried; the other adapter is served.
    let stub = lora_stub("stub-svc", Duration::ZERO).await;
    let gw = single(EndpointSet::fixed([authority(&stub)]), &t).await;
    let (status, headers, body) =
        send_full(&client, chat_req(&gw.url(), &chat_for("a", false))).await;
    check_answer(status, &headers, &body);
    assert_eq!((stub.state.received(), stub.state.lora_loads()), (0, 0));
    let (status, v) = ask(&client, &gw, "b").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "b");

    // /v1/models lists it, with its state and why.
    let (_, v) = json(&client, &format!("{}/v1/models", gw.url())).await;
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["stub-svc", "a", "b"]);
    assert_eq!(data[1]["hearth"]["state"], "unavailable", "{v}");
    assert_eq!(
        data[1]["hearth"]["unavailable"],
        "its files are still being fetched into the model cache"
    );
    assert_eq!(data[2]["hearth"]["state"], "loaded", "{v}");
    assert!(data[2]["hearth"].get("unavailable").is_none(), "{v}");

    // Its files arrive: the route says nothing, and the next request loads it.
    gw.gateway
        .apply_adapters(&table(2, &[("a", &a), ("b", &b)]))
        .unwrap();
    let (_, v) = json(&client, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(v["data"][1]["hearth"]["state"], "available", "{v}");
    let (status, v) = ask(&client, &gw, "a").await;
    assert_eq!(status, StatusCode::OK, "{v}");
    answered_by(&v, "a");

    // An empty message is refused with the table.
    let mut empty = table(2, &[("a", &a)]);
    empty.adapters[0].unavailable = Some(String::new());
    let e = gw.gateway.apply_adapters(&empty).unwrap_err();
    assert_eq!(e.path(), Some("adapters[0].unavailable"), "{e}");

    // A shared gateway answers the same, counted in the base model's series.
    let shared = shared_gateway(
        config(),
        vec![ModelRoute {
            adapters: Some(t.clone()),
            ..route("base")
        }],
        [("base".to_owned(), vec![])].into_iter().collect(),
    )
    .await;
    let (status, headers, body) =
        send_full(&client, chat_req(&shared.url(), &chat_for("a", false))).await;
    check_answer(status, &headers, &body);
    let state = shared.gateway.model("ns/base").unwrap().demand().state();
    assert_eq!((state.pending(), state.lease()), (0, false), "{state:?}");
    let text = gateway_metrics(&client, &shared).await;
    assert_eq!(
        metric(
            &text,
            "hearth_gateway_rejections_total{service=\"ns/base\",reason=\"adapter_unavailable\"}"
        ),
        Some(1.0),
        "{text}"
    );
    let (_, v) = json(&client, &format!("{}/v1/models/a", shared.url())).await;
    assert_eq!(v["hearth"]["state"], "unavailable", "{v}");
    assert_eq!(v["hearth"]["loadedReplicas"], 0, "{v}");
}

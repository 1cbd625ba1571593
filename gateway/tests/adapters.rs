//! LoRA adapters through the gateway against the real stub (LoRA on, runtime loading on, adapter
//! directories in a temp dir): each adapter answers its requests, loads on demand, the least
//! recently used is unloaded past `maxLoaded`, concurrent first requests share one load, a load
//! failure reaches the client and is not remembered, a cold request for an adapter is held,
//! table changes apply at once, a rediscovered or woken engine is read again, and a shared
//! gateway routes adapters by their route table. State is awaited by polling with a deadline.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use common::{shared::*, *};
use hearth_crds::llmadapter::{AdapterRoute, AdapterTable};
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

//! vLLM's LoRA adapters on the stub, against a real HTTP client: the runtime load and unload
//! routes and their errors, `/v1/models`, requests answered by an adapter, the CPU cache's LRU
//! evictions and the batch slots, the load delay, the filesystem resolver, sleep mode; and the
//! binary's flags. Adapter directories are made in temp dirs; delays are asserted as lower bounds
//! only, and state is awaited by polling with a deadline.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::{Value, json};
use vllm_stub::{LoraConfig, LoraModule, RunningStub, SleepLevel, SleepState, StubConfig, spawn};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A response: status, content type, body.
struct Answer {
    status: StatusCode,
    content_type: Option<String>,
    body: Bytes,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&self.body)))
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// The OpenAI error's (status, type, message).
    fn err(&self) -> (StatusCode, String, String) {
        let v = self.json();
        assert_eq!(v["error"]["code"], self.status.as_u16(), "{v}");
        (
            self.status,
            v["error"]["type"].as_str().unwrap().to_owned(),
            v["error"]["message"].as_str().unwrap().to_owned(),
        )
    }
}

async fn send(c: &HttpClient, method: &str, url: &str, content_type: &str, body: &str) -> Answer {
    let req = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", content_type)
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status();
    let content_type = resp
        .headers()
        .get("content-type")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        content_type,
        body,
    }
}

async fn post(c: &HttpClient, url: &str, body: Value) -> Answer {
    send(c, "POST", url, "application/json", &body.to_string()).await
}

async fn get(c: &HttpClient, url: &str) -> Answer {
    send(c, "GET", url, "application/json", "").await
}

async fn load(c: &HttpClient, stub: &RunningStub, name: &str, path: &Path) -> Answer {
    post(
        c,
        &format!("{}/v1/load_lora_adapter", stub.url()),
        json!({"lora_name": name, "lora_path": path}),
    )
    .await
}

async fn unload(c: &HttpClient, stub: &RunningStub, body: Value) -> Answer {
    post(c, &format!("{}/v1/unload_lora_adapter", stub.url()), body).await
}

async fn chat(c: &HttpClient, stub: &RunningStub, model: &str) -> Answer {
    post(
        c,
        &format!("{}/v1/chat/completions", stub.url()),
        json!({"model": model, "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await
}

async fn metrics(c: &HttpClient, stub: &RunningStub) -> String {
    let a = get(c, &format!("{}/metrics", stub.url())).await;
    assert_eq!(a.status, StatusCode::OK);
    a.text()
}

/// The value of the sample `name{labels}` in `text`.
fn sample(text: &str, name_and_labels: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name_and_labels} ")))
        .map(str::to_owned)
}

const LABELS: &str = "engine=\"0\",model_name=\"stub-svc\"";

fn counter(text: &str, name: &str) -> u64 {
    sample(text, &format!("{name}{{{LABELS}}}"))
        .unwrap_or_else(|| panic!("no {name} in {text}"))
        .parse()
        .unwrap()
}

/// The `vllm:lora_requests_info` samples: (max_lora, running, waiting, value).
fn lora_info(text: &str) -> Vec<(String, String, String, f64)> {
    text.lines()
        .filter_map(|l| l.strip_prefix("vllm:lora_requests_info{"))
        .map(|l| {
            let (labels, value) = l.split_once("} ").unwrap();
            let get = |k: &str| {
                labels
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(&format!("{k}=\"")))
                    .map(|v| v.trim_end_matches('"').to_owned())
                    .unwrap_or_default()
            };
            (
                get("max_lora"),
                get("running_lora_adapters"),
                get("waiting_lora_adapters"),
                value.parse().unwrap(),
            )
        })
        .collect()
}

/// The newest `vllm:lora_requests_info` label set: (running, waiting).
fn lora_info_now(text: &str) -> (String, String) {
    let newest = lora_info(text)
        .into_iter()
        .max_by(|a, b| a.3.total_cmp(&b.3))
        .unwrap_or_else(|| panic!("no vllm:lora_requests_info in {text}"));
    (newest.1, newest.2)
}

/// Polls `check` until it holds, for at most 10 s.
async fn eventually(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "never {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!("vllm-stub-lora-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Self(d)
    }

    /// A PEFT LoRA adapter directory `<dir>/<name>` of rank `r` for `base`.
    fn adapter(&self, name: &str, r: u32, base: &str) -> PathBuf {
        let dir = self.0.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("adapter_config.json"),
            json!({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                "target_modules": ["q_proj", "v_proj"], "bias": "none",
                "base_model_name_or_path": base})
            .to_string(),
        )
        .unwrap();
        std::fs::write(dir.join("adapter_model.safetensors"), b"not really tensors").unwrap();
        dir
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const BASE: &str = "/models/stub";

/// LoRA on with the runtime routes, as `--enable-lora` with
/// `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`.
fn cfg(lora: LoraConfig) -> StubConfig {
    StubConfig {
        model: BASE.into(),
        served_model_names: vec!["stub-svc".into()],
        token_count: 3,
        token_delay: Duration::from_millis(1),
        lora,
        ..StubConfig::default()
    }
}

fn lora_on() -> LoraConfig {
    LoraConfig {
        enable: true,
        runtime_updating: true,
        ..LoraConfig::default()
    }
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

#[tokio::test]
async fn load_and_unload_with_vllms_errors() {
    let dir = TempDir::new("errors");
    let sql = dir.adapter("sql", 8, BASE);
    let stub = spawn(cfg(lora_on()), localhost()).await.unwrap();
    let c = client();

    let a = load(&c, &stub, "sql", &sql).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.text(), "Success: LoRA adapter 'sql' added successfully.");
    assert_eq!(a.content_type, None, "a bare body, as vLLM's");
    assert_eq!(stub.state.lora_loads(), 1);
    assert_eq!(stub.state.lora_adapters()[0].rank, 8);

    // Loaded twice.
    assert_eq!(
        load(&c, &stub, "sql", &sql).await.err(),
        (
            StatusCode::BAD_REQUEST,
            "InvalidUserInput".into(),
            "The lora adapter 'sql' has already been loaded. If you want to load the adapter \
             in place, set 'load_inplace' to True."
                .into()
        )
    );
    // In place, it is read again.
    let a = post(
        &c,
        &format!("{}/v1/load_lora_adapter", stub.url()),
        json!({"lora_name": "sql", "lora_path": sql, "load_inplace": true}),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(stub.state.lora_loads(), 2);
    assert_eq!(stub.state.lora_adapters().len(), 1);

    // Empty name or path.
    assert_eq!(
        post(
            &c,
            &format!("{}/v1/load_lora_adapter", stub.url()),
            json!({"lora_name": "", "lora_path": sql}),
        )
        .await
        .err(),
        (
            StatusCode::BAD_REQUEST,
            "InvalidUserInput".into(),
            "Both 'lora_name' and 'lora_path' must be provided.".into()
        )
    );
    // A field missing: the request's validation names it.
    let a = post(
        &c,
        &format!("{}/v1/load_lora_adapter", stub.url()),
        json!({"lora_name": "x"}),
    )
    .await;
    let (status, kind, message) = a.err();
    assert_eq!(
        (status, kind.as_str()),
        (StatusCode::BAD_REQUEST, "Bad Request")
    );
    assert!(
        message.contains("'loc': ('body', 'lora_path')"),
        "{message}"
    );
    assert!(message.contains("Field required"), "{message}");
    assert_eq!(a.json()["error"]["param"], "body.lora_path");
    // Not JSON.
    let a = send(
        &c,
        "POST",
        &format!("{}/v1/load_lora_adapter", stub.url()),
        "text/plain",
        "lora_name=x",
    )
    .await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert!(
        a.text().contains("Only 'application/json' is allowed"),
        "{}",
        a.text()
    );

    // No adapter at the path.
    let missing = dir.0.join("missing");
    assert_eq!(
        load(&c, &stub, "gone", &missing).await.err(),
        (
            StatusCode::NOT_FOUND,
            "NotFoundError".into(),
            format!(
                "Call to add_lora method failed: Loading lora gone failed: No adapter found for {}",
                missing.display()
            )
        )
    );
    // A directory with no adapter_config.json is no adapter either.
    let empty = dir.0.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    assert_eq!(
        load(&c, &stub, "empty", &empty).await.status,
        StatusCode::NOT_FOUND
    );
    // A config but no weights.
    let bare = dir.adapter("bare", 8, BASE);
    std::fs::remove_file(bare.join("adapter_model.safetensors")).unwrap();
    assert_eq!(
        load(&c, &stub, "bare", &bare).await.err(),
        (
            StatusCode::BAD_REQUEST,
            "BadRequestError".into(),
            format!(
                "Call to add_lora method failed: {} doesn't contain tensors",
                bare.display()
            )
        )
    );
    // A rank above --max-lora-rank (16).
    let big = dir.adapter("big", 32, BASE);
    assert_eq!(
        load(&c, &stub, "big", &big).await.err(),
        (
            StatusCode::BAD_REQUEST,
            "BadRequestError".into(),
            "Call to add_lora method failed: LoRA rank 32 is greater than max_lora_rank 16.".into()
        )
    );
    assert_eq!(stub.state.lora_loads(), 2, "failed loads load nothing");
    let names: Vec<String> = stub
        .state
        .lora_adapters()
        .into_iter()
        .map(|a| a.name)
        .collect();
    assert_eq!(names, ["sql"]);

    // Unload.
    let a = unload(&c, &stub, json!({"lora_name": "sql"})).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(
        a.text(),
        "Success: LoRA adapter 'sql' removed successfully."
    );
    assert!(stub.state.lora_adapters().is_empty());
    assert_eq!(
        unload(&c, &stub, json!({"lora_name": "sql"})).await.err(),
        (
            StatusCode::NOT_FOUND,
            "NotFoundError".into(),
            "The lora adapter 'sql' cannot be found.".into()
        )
    );
    assert_eq!(
        unload(&c, &stub, json!({"lora_name": ""})).await.err(),
        (
            StatusCode::BAD_REQUEST,
            "InvalidUserInput".into(),
            "'lora_name' needs to be provided to unload a LoRA adapter.".into()
        )
    );
    let a = unload(&c, &stub, json!({})).await;
    assert_eq!(a.status, StatusCode::BAD_REQUEST);
    assert_eq!(a.json()["error"]["param"], "body.lora_name");
    // Unloaded, the name is an unknown model again.
    assert_eq!(
        chat(&c, &stub, "sql").await.err(),
        (
            StatusCode::NOT_FOUND,
            "NotFoundError".into(),
            "The model `sql` does not exist.".into()
        )
    );
    // Loaded again: a new registration, read from disk again.
    assert_eq!(load(&c, &stub, "sql", &sql).await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_loads(), 3);
    assert_eq!(chat(&c, &stub, "sql").await.status, StatusCode::OK);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn models_list_adapters_with_parent_and_root() {
    let dir = TempDir::new("models");
    let a = dir.adapter("a", 8, BASE);
    let b = dir.adapter("b", 8, BASE);
    let rt = dir.adapter("rt", 16, BASE);
    let stub = spawn(
        StubConfig {
            served_model_names: vec!["stub-svc".into(), "stub-alias".into()],
            ..cfg(LoraConfig {
                max_cpu_loras: Some(4),
                modules: vec![
                    LoraModule {
                        name: "a".into(),
                        path: a.to_str().unwrap().into(),
                        base_model_name: None,
                    },
                    LoraModule {
                        name: "b".into(),
                        path: b.to_str().unwrap().into(),
                        base_model_name: Some("stub-alias".into()),
                    },
                ],
                ..lora_on()
            })
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    assert_eq!(stub.state.lora_loads(), 2, "static adapters load at start");
    assert_eq!(load(&c, &stub, "rt", &rt).await.status, StatusCode::OK);

    let v = get(&c, &format!("{}/v1/models", stub.url())).await.json();
    assert_eq!(v["object"], "list");
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["stub-svc", "stub-alias", "a", "b", "rt"]);
    for base in &data[..2] {
        assert_eq!(base["root"], BASE);
        assert_eq!(base["parent"], Value::Null);
        assert_eq!(base["max_model_len"], 4096);
    }
    let card = |i: usize| &data[i];
    assert_eq!(card(2)["root"], a.to_str().unwrap());
    assert_eq!(card(2)["parent"], "stub-svc", "the first served name");
    assert_eq!(card(3)["root"], b.to_str().unwrap());
    assert_eq!(
        card(3)["parent"],
        "stub-alias",
        "base_model_name, a served name"
    );
    assert_eq!(card(4)["root"], rt.to_str().unwrap());
    assert_eq!(card(4)["parent"], "stub-svc");
    for m in &data[2..] {
        assert_eq!(m["object"], "model");
        assert_eq!(m["owned_by"], "vllm");
        assert_eq!(m["max_model_len"], Value::Null);
    }
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn adapter_answers_streaming_and_not() {
    let dir = TempDir::new("answers");
    let sql = dir.adapter("sql", 8, BASE);
    let stub = spawn(cfg(lora_on()), localhost()).await.unwrap();
    let c = client();
    assert_eq!(load(&c, &stub, "sql", &sql).await.status, StatusCode::OK);

    let v = chat(&c, &stub, "sql").await.json();
    assert_eq!(v["model"], "sql");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(content, "[adapter sql] Hearth keeps the ");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    // The base model's text names no adapter.
    let v = chat(&c, &stub, "stub-svc").await.json();
    assert_eq!(v["model"], "stub-svc");
    assert_eq!(v["choices"][0]["message"]["content"], "Hearth keeps the ");

    let v = post(
        &c,
        &format!("{}/v1/completions", stub.url()),
        json!({"model": "sql", "prompt": "Once"}),
    )
    .await
    .json();
    assert_eq!(v["model"], "sql");
    assert!(
        v["choices"][0]["text"]
            .as_str()
            .unwrap()
            .starts_with("[adapter sql] ")
    );

    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"model": "sql", "stream": true, "messages": [{"role": "user", "content": "hi"}]}),
        ),
        (
            "/v1/completions",
            json!({"model": "sql", "stream": true, "prompt": "Once"}),
        ),
    ] {
        let a = post(&c, &format!("{}{path}", stub.url()), body).await;
        assert_eq!(a.status, StatusCode::OK);
        let events: Vec<Value> = a
            .text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        assert_eq!(events.len(), 4, "3 tokens and the finish chunk: {events:?}");
        assert!(events.iter().all(|e| e["model"] == "sql"), "{events:?}");
        let text: String = events
            .iter()
            .map(|e| {
                let choice = &e["choices"][0];
                choice["delta"]["content"]
                    .as_str()
                    .or(choice["text"].as_str())
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect();
        assert_eq!(text, "[adapter sql] Hearth keeps the ", "{path}");
    }
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn cpu_cache_evicts_the_least_recently_used() {
    let dir = TempDir::new("lru");
    let stub = spawn(
        cfg(LoraConfig {
            max_cpu_loras: Some(2),
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    for name in ["a", "b", "c"] {
        let path = dir.adapter(name, 8, BASE);
        assert_eq!(load(&c, &stub, name, &path).await.status, StatusCode::OK);
    }
    // Registration is not bounded by --max-cpu-loras; the cache is.
    assert_eq!(stub.state.lora_adapters().len(), 3);
    assert_eq!(stub.state.lora_cached(), ["b", "c"]);
    let m = metrics(&c, &stub).await;
    assert_eq!(counter(&m, "stub_lora_adapter_loads_total"), 3);
    assert_eq!(counter(&m, "stub_lora_adapter_evictions_total"), 1);

    // `a` fell out: its request loads it again and evicts `b`, the least recently used.
    assert_eq!(chat(&c, &stub, "a").await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_cached(), ["c", "a"]);
    let m = metrics(&c, &stub).await;
    assert_eq!(counter(&m, "stub_lora_adapter_loads_total"), 4);
    assert_eq!(counter(&m, "stub_lora_adapter_evictions_total"), 2);

    // Cached adapters are only touched: `c` becomes the most recently used.
    assert_eq!(chat(&c, &stub, "c").await.status, StatusCode::OK);
    assert_eq!(chat(&c, &stub, "a").await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_cached(), ["c", "a"]);
    assert_eq!(chat(&c, &stub, "c").await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_cached(), ["a", "c"]);
    assert_eq!(
        (stub.state.lora_loads(), stub.state.lora_evictions()),
        (4, 2)
    );

    // `b` now evicts `a`.
    assert_eq!(chat(&c, &stub, "b").await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_cached(), ["c", "b"]);
    assert_eq!(
        (stub.state.lora_loads(), stub.state.lora_evictions()),
        (5, 3)
    );
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn load_delay_on_load_and_on_reload() {
    let delay = Duration::from_millis(300);
    let dir = TempDir::new("delay");
    let stub = spawn(
        cfg(LoraConfig {
            load_delay: delay,
            max_cpu_loras: Some(1),
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let (a, b) = (dir.adapter("a", 8, BASE), dir.adapter("b", 8, BASE));

    let start = Instant::now();
    assert_eq!(load(&c, &stub, "a", &a).await.status, StatusCode::OK);
    assert!(start.elapsed() >= delay, "load took {:?}", start.elapsed());
    // A failing load fails before the delay's end: it loads nothing.
    let start = Instant::now();
    assert_eq!(
        load(&c, &stub, "x", &dir.0.join("x")).await.status,
        StatusCode::NOT_FOUND
    );
    let failed = start.elapsed();

    assert_eq!(load(&c, &stub, "b", &b).await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_cached(), ["b"]);
    // `a` was evicted: its request pays the load again.
    let start = Instant::now();
    assert_eq!(chat(&c, &stub, "a").await.status, StatusCode::OK);
    assert!(
        start.elapsed() >= delay,
        "reload took {:?}",
        start.elapsed()
    );
    assert_eq!(
        (stub.state.lora_loads(), stub.state.lora_evictions()),
        (3, 2)
    );
    assert!(failed < delay, "a failed load took {failed:?}");
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn max_loras_bounds_adapters_generating_at_once() {
    let dir = TempDir::new("slots");
    let stub = spawn(
        cfg(LoraConfig {
            max_cpu_loras: Some(2),
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    for name in ["a", "b"] {
        let path = dir.adapter(name, 8, BASE);
        assert_eq!(load(&c, &stub, name, &path).await.status, StatusCode::OK);
    }
    let m = metrics(&c, &stub).await;
    assert_eq!(lora_info_now(&m), (String::new(), String::new()));
    assert!(
        lora_info(&m).iter().all(|s| s.0 == "1"),
        "max_lora=\"1\": {m}"
    );

    let url = format!("{}/v1/chat/completions", stub.url());
    let slow = |model: &str| {
        json!({"model": model, "max_tokens": 40, "stub_token_delay": "50ms",
            "messages": [{"role": "user", "content": "x"}]})
    };
    let mut rx = stub.state.subscribe_received();
    let (c1, u1, b1) = (c.clone(), url.clone(), slow("a"));
    let first = tokio::spawn(async move { post(&c1, &u1, b1).await });
    rx.wait_for(|n| *n >= 1).await.unwrap();
    let state = stub.state.clone();
    eventually("`a` generating", || state.lora_running() == ["a"]).await;
    let (c2, u2, b2) = (c.clone(), url.clone(), slow("b"));
    let second = tokio::spawn(async move { post(&c2, &u2, b2).await });
    // A second request for `a` joins the batch; `b` waits for `a`'s slot.
    let (c3, u3, b3) = (c.clone(), url.clone(), slow("a"));
    let third = tokio::spawn(async move { post(&c3, &u3, b3).await });
    rx.wait_for(|n| *n >= 3).await.unwrap();
    eventually("two requests running, one waiting", || {
        stub.state.running() == 2 && stub.state.waiting() == 1
    })
    .await;
    let m = metrics(&c, &stub).await;
    assert_eq!(lora_info_now(&m), ("a".into(), "b".into()), "{m}");
    assert_eq!(
        sample(&m, &format!("vllm:num_requests_waiting{{{LABELS}}}")).as_deref(),
        Some("1.0")
    );
    assert_eq!(stub.state.lora_running(), ["a"]);

    for r in [first, third] {
        let a = r.await.unwrap();
        assert_eq!(a.json()["model"], "a");
    }
    // `a` is done: `b` generates.
    let state = stub.state.clone();
    eventually("`b` generating", || state.lora_running() == ["b"]).await;
    assert_eq!(second.await.unwrap().json()["model"], "b");
    let m = metrics(&c, &stub).await;
    assert_eq!(lora_info_now(&m), (String::new(), String::new()));
    // The label sets seen stay, with their last time, as vLLM's gauge keeps them.
    let seen: Vec<(String, String)> = lora_info(&m).into_iter().map(|s| (s.1, s.2)).collect();
    assert!(seen.contains(&("a".into(), "b".into())), "{seen:?}");
    assert!(seen.contains(&("b".into(), String::new())), "{seen:?}");
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn resolver_loads_an_unknown_adapter_on_first_use() {
    let cache = TempDir::new("resolver");
    let fin = cache.adapter("fin", 8, BASE);
    cache.adapter("other-base", 8, "/models/other");
    cache.adapter("big", 64, BASE);
    let stub = spawn(
        cfg(LoraConfig {
            resolver_cache_dir: Some(cache.0.clone()),
            load_delay: Duration::from_millis(50),
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    assert!(stub.state.lora_adapters().is_empty());

    let start = Instant::now();
    let a = chat(&c, &stub, "fin").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert!(start.elapsed() >= Duration::from_millis(50));
    let v = a.json();
    assert_eq!(v["model"], "fin");
    assert!(
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .starts_with("[adapter fin] ")
    );
    assert_eq!(stub.state.lora_loads(), 1);
    // Registered: listed, and not loaded again.
    let v = get(&c, &format!("{}/v1/models", stub.url())).await.json();
    let card = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["id"] == "fin")
        .cloned()
        .unwrap();
    assert_eq!(card["root"], fin.to_str().unwrap());
    assert_eq!(card["parent"], "stub-svc");
    assert_eq!(chat(&c, &stub, "fin").await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_loads(), 1);

    // Another base model's adapter, or no directory: an unknown model.
    for model in ["other-base", "nothing-here"] {
        assert_eq!(
            chat(&c, &stub, model).await.err(),
            (
                StatusCode::NOT_FOUND,
                "NotFoundError".into(),
                format!("The model `{model}` does not exist.")
            )
        );
    }
    // Found, but the engine refuses it.
    assert_eq!(
        chat(&c, &stub, "big").await.err(),
        (
            StatusCode::BAD_REQUEST,
            "BadRequestError".into(),
            "LoRA adapter 'big' was found but could not be loaded: Call to add_lora method \
             failed: LoRA rank 64 is greater than max_lora_rank 16."
                .into()
        )
    );
    assert_eq!(stub.state.lora_loads(), 1);
    stub.shutdown().await.unwrap();

    // vLLM asks its resolvers only with VLLM_ALLOW_RUNTIME_LORA_UPDATING.
    let stub = spawn(
        cfg(LoraConfig {
            resolver_cache_dir: Some(cache.0.clone()),
            runtime_updating: false,
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .unwrap();
    assert_eq!(chat(&c, &stub, "fin").await.status, StatusCode::NOT_FOUND);
    assert_eq!(stub.state.lora_loads(), 0);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn runtime_routes_only_with_runtime_updating() {
    let dir = TempDir::new("routes");
    let sql = dir.adapter("sql", 8, BASE);
    let c = client();
    // LoRA on, runtime updating off: the routes do not exist; static adapters still serve.
    let stub = spawn(
        cfg(LoraConfig {
            runtime_updating: false,
            modules: vec![LoraModule {
                name: "sql".into(),
                path: sql.to_str().unwrap().into(),
                base_model_name: None,
            }],
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .unwrap();
    assert_eq!(
        load(&c, &stub, "x", &sql).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        unload(&c, &stub, json!({"lora_name": "sql"})).await.status,
        StatusCode::NOT_FOUND
    );
    assert_eq!(stub.state.lora_adapters().len(), 1);
    assert_eq!(chat(&c, &stub, "sql").await.json()["model"], "sql");
    stub.shutdown().await.unwrap();

    // LoRA off: no routes, no LoRA series, and adapters are unknown models.
    let stub = spawn(cfg(LoraConfig::default()), localhost())
        .await
        .unwrap();
    assert_eq!(
        load(&c, &stub, "x", &sql).await.status,
        StatusCode::NOT_FOUND
    );
    let m = metrics(&c, &stub).await;
    assert!(!m.contains("lora"), "{m}");
    assert_eq!(chat(&c, &stub, "sql").await.status, StatusCode::NOT_FOUND);
    stub.shutdown().await.unwrap();

    // Runtime updating without --enable-lora: the routes exist, and the engine refuses loads.
    let stub = spawn(
        cfg(LoraConfig {
            enable: false,
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .unwrap();
    assert_eq!(
        load(&c, &stub, "sql", &sql).await.err(),
        (
            StatusCode::BAD_REQUEST,
            "BadRequestError".into(),
            "Call to add_lora method failed: LoRA is not enabled. Use --enable-lora to enable \
             LoRA."
                .into()
        )
    );
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn static_adapter_that_cannot_load_fails_the_start() {
    let dir = TempDir::new("static");
    let big = dir.adapter("big", 32, BASE);
    let err = spawn(
        cfg(LoraConfig {
            modules: vec![LoraModule {
                name: "big".into(),
                path: big.to_str().unwrap().into(),
                base_model_name: None,
            }],
            ..lora_on()
        }),
        localhost(),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(
        err.to_string()
            .contains("LoRA rank 32 is greater than max_lora_rank 16."),
        "{err}"
    );
}

#[tokio::test]
async fn sleep_refuses_loads_and_level_2_empties_the_cache() {
    let dir = TempDir::new("sleep");
    let (a, b) = (dir.adapter("a", 8, BASE), dir.adapter("b", 8, BASE));
    let stub = spawn(
        StubConfig {
            enable_sleep_mode: true,
            dev_mode: true,
            ..cfg(lora_on())
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    assert_eq!(load(&c, &stub, "a", &a).await.status, StatusCode::OK);
    assert_eq!(load(&c, &stub, "b", &b).await.status, StatusCode::OK);
    assert_eq!(
        post(&c, &format!("{}/sleep?level=2", stub.url()), json!({}))
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        stub.state.sleep_state(),
        SleepState::Asleep(SleepLevel::Discard)
    );
    let (status, kind, message) = load(&c, &stub, "c", &a).await.err();
    assert_eq!(
        (status, kind.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, "ServiceUnavailableError")
    );
    assert!(message.contains("the engine is sleeping"), "{message}");
    // Unloading only changes the registry: it works asleep.
    assert_eq!(
        unload(&c, &stub, json!({"lora_name": "b"})).await.status,
        StatusCode::OK
    );
    assert_eq!(
        post(&c, &format!("{}/wake_up", stub.url()), json!({}))
            .await
            .status,
        StatusCode::OK
    );
    assert!(
        stub.state.lora_cached().is_empty(),
        "the weights were loaded again"
    );
    let loads = stub.state.lora_loads();
    assert_eq!(chat(&c, &stub, "a").await.status, StatusCode::OK);
    assert_eq!(stub.state.lora_loads(), loads + 1);
    assert_eq!(stub.state.lora_cached(), ["a"]);
    stub.shutdown().await.unwrap();
}

/// The binary, with `args` and `envs`; `(exit success, stderr + stdout)` once it ends.
fn run_to_end(args: &[&str], envs: &[(&str, &str)]) -> (bool, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vllm-stub"));
    cmd.args(["--model=/models/stub", "--host=127.0.0.1", "--port=0"])
        .args(args)
        .env_remove("VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        .env_remove("VLLM_PLUGINS")
        .env_remove("VLLM_LORA_RESOLVER_CACHE_DIR")
        .stdin(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout)
        ),
    )
}

#[test]
fn process_refuses_what_vllm_refuses_at_start() {
    let dir = TempDir::new("process-refuses");
    let sql = dir.adapter("sql", 16, BASE);
    let module = format!("sql={}", sql.display());
    for (args, envs, want) in [
        (
            vec![
                "--enable-lora",
                "--lora-modules",
                &module,
                "--max-lora-rank",
                "8",
            ],
            vec![],
            "LoRA rank 16 is greater than max_lora_rank 8.",
        ),
        (
            vec!["--lora-modules", &module],
            vec![],
            "LoRA is not enabled. Use --enable-lora to enable LoRA.",
        ),
        (
            vec!["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "1"],
            vec![],
            "max_cpu_loras (1) must be >= max_loras (2)",
        ),
        (
            vec!["--enable-lora", "--max-lora-rank", "48"],
            vec![],
            "invalid choice: 48",
        ),
        (
            vec!["--enable-lora", "--lora-modules", "sql"],
            vec![],
            "Invalid JSON format for --lora-modules: sql",
        ),
        (
            vec!["--enable-lora"],
            vec![("VLLM_LORA_RESOLVER_CACHE_DIR", "/nonexistent/lora-cache")],
            "VLLM_LORA_RESOLVER_CACHE_DIR must be set to a valid directory",
        ),
    ] {
        let (ok, out) = run_to_end(&args, &envs);
        assert!(!ok, "{args:?} started");
        assert!(out.contains(want), "{args:?}: no {want:?} in {out}");
    }
}

#[tokio::test]
async fn process_serves_static_and_runtime_adapters() {
    let dir = TempDir::new("process-serves");
    let sql = dir.adapter("sql", 8, BASE);
    let fin = dir.adapter("fin", 8, BASE);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let json_module =
        json!({"name": "sql", "path": sql, "base_model_name": "stub-svc"}).to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vllm-stub"))
        .args([
            "--model=/models/stub",
            "--served-model-name=stub-svc",
            "--host=127.0.0.1",
            &format!("--port={port}"),
            "--enable-lora",
            "--max-loras=1",
            "--max-cpu-loras=2",
            "--lora-modules",
            &json_module,
        ])
        .env("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
        .env("VLLM_PLUGINS", "lora_filesystem_resolver")
        .env("VLLM_LORA_RESOLVER_CACHE_DIR", &dir.0)
        .env("STUB_LORA_LOAD_DELAY", "200ms")
        .env("STUB_TOKEN_DELAY", "1ms")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut std::process::Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _kill = Kill(&mut child);
    let c = client();
    let base = format!("http://127.0.0.1:{port}");
    // Not ready before the static adapter is loaded (200 ms).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let req = Request::get(format!("{base}/health"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        if let Ok(r) = c.request(req).await
            && r.status() == StatusCode::OK
        {
            break;
        }
        assert!(Instant::now() < deadline, "never healthy");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let models = get(&c, &format!("{base}/v1/models")).await.json();
    let ids: Vec<&str> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["stub-svc", "sql"]);
    // The resolver, through the binary's environment.
    let a = post(
        &c,
        &format!("{base}/v1/chat/completions"),
        json!({"model": "fin", "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    assert_eq!(a.json()["model"], "fin");
    let a = post(
        &c,
        &format!("{base}/v1/load_lora_adapter"),
        json!({"lora_name": "again", "lora_path": fin}),
    )
    .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.text());
    let m = get(&c, &format!("{base}/metrics")).await.text();
    assert_eq!(counter(&m, "stub_lora_adapter_loads_total"), 3);
    assert_eq!(counter(&m, "stub_lora_adapter_evictions_total"), 1);
    assert!(m.contains("vllm:lora_requests_info{max_lora=\"1\","), "{m}");
}

//! The stub against real HTTP clients: in-process on an ephemeral port, and as a process for
//! startup delay and SIGTERM.

use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use vllm_stub::{StubConfig, spawn};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn post(
    c: &HttpClient,
    url: &str,
    body: serde_json::Value,
    headers: &[(&str, &str)],
) -> (StatusCode, Bytes) {
    let mut req = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = c
        .request(req.body(Full::new(Bytes::from(body.to_string()))).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

async fn get(c: &HttpClient, url: &str) -> (StatusCode, Bytes) {
    let resp = c
        .request(Request::get(url).body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

fn cfg() -> StubConfig {
    StubConfig {
        model: "/models/stub".into(),
        served_model_names: vec!["stub-svc".into()],
        token_count: 5,
        token_delay: Duration::from_millis(1),
        ..StubConfig::default()
    }
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// The `data:` payloads of an SSE body.
fn events(body: &[u8]) -> Vec<String> {
    std::str::from_utf8(body)
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(|e| {
            e.strip_prefix("data: ")
                .expect("every event is one data line")
                .to_owned()
        })
        .collect()
}

#[tokio::test]
async fn chat_completion_streaming_and_not() {
    let stub = spawn(cfg(), localhost()).await.unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", stub.url());
    let (status, body) = post(
        &c,
        &url,
        serde_json::json!({"model": "stub-svc", "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");

    let (status, body) = post(
        &c,
        &url,
        serde_json::json!({"model": "stub-svc", "stream": true, "max_tokens": 3,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": "hi"}]}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let ev = events(&body);
    // 3 tokens, the finish chunk, the usage chunk, [DONE].
    assert_eq!(ev.len(), 6, "{ev:?}");
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let first: serde_json::Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let finish: serde_json::Value = serde_json::from_str(&ev[3]).unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "length");
    let usage: serde_json::Value = serde_json::from_str(&ev[4]).unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 3);
    assert_eq!(stub.state.running(), 0);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn completions_models_and_errors() {
    let stub = spawn(cfg(), localhost()).await.unwrap();
    let c = client();
    let (status, body) = post(
        &c,
        &format!("{}/v1/completions", stub.url()),
        serde_json::json!({"model": "stub-svc", "prompt": "Once", "stream": true}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let ev = events(&body);
    assert_eq!(ev.len(), 7, "5 tokens, finish, [DONE]: {ev:?}");
    let chunk: serde_json::Value = serde_json::from_str(&ev[0]).unwrap();
    assert_eq!(chunk["object"], "text_completion");

    let (status, body) = get(&c, &format!("{}/v1/models", stub.url())).await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["data"][0]["id"], "stub-svc");
    assert_eq!(v["data"][0]["root"], "/models/stub");

    let (status, body) = post(
        &c,
        &format!("{}/v1/chat/completions", stub.url()),
        serde_json::json!({"model": "other", "messages": [{"role": "user", "content": "x"}]}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(v["error"]["message"].as_str().unwrap().contains("`other`"));

    let (status, body) = post(
        &c,
        &format!("{}/v1/chat/completions", stub.url()),
        serde_json::json!({"model": "stub-svc", "messages": [{"role": "user", "content": "x"}]}),
        &[("x-stub-token-delay", "fast")],
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&body).contains("x-stub-token-delay"));

    let (status, _) = post(
        &c,
        &format!("{}/v1/chat/completions", stub.url()),
        serde_json::json!({"model": "stub-svc", "messages": [{"role": "user", "content": "x"}]}),
        &[("x-stub-status", "500")],
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);

    let (status, _) = post(
        &c,
        &format!("{}/v1/chat/completions", stub.url()),
        serde_json::json!({"model": "stub-svc"}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "messages are required");
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn metrics_count_running_and_waiting() {
    let stub = spawn(
        StubConfig {
            max_num_seqs: 1,
            ..cfg()
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let url = format!("{}/v1/chat/completions", stub.url());
    let body = serde_json::json!({"model": "stub-svc", "stub_token_delay": "200ms", "max_tokens": 50,
        "messages": [{"role": "user", "content": "x"}]});
    let (c1, c2, u1, u2, b1, b2) = (
        c.clone(),
        c.clone(),
        url.clone(),
        url.clone(),
        body.clone(),
        body,
    );
    let r1 = tokio::spawn(async move { post(&c1, &u1, b1, &[]).await });
    let mut rx = stub.state.subscribe_received();
    rx.wait_for(|n| *n >= 1).await.unwrap();
    let r2 = tokio::spawn(async move { post(&c2, &u2, b2, &[]).await });
    rx.wait_for(|n| *n >= 2).await.unwrap();
    // Both arrived: one generates, one waits for the single slot.
    let metrics = loop {
        let (_, m) = get(&c, &format!("{}/metrics", stub.url())).await;
        let m = String::from_utf8(m.to_vec()).unwrap();
        if m.contains("vllm:num_requests_waiting{engine=\"0\",model_name=\"stub-svc\"} 1.0") {
            break m;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(
        metrics.contains("vllm:num_requests_running{engine=\"0\",model_name=\"stub-svc\"} 1.0"),
        "{metrics}"
    );
    assert!(metrics.contains("# TYPE vllm:kv_cache_usage_perc gauge"));
    // Dropping the clients' requests cancels them: the gauges return to 0.
    r1.abort();
    r2.abort();
    let _ = (r1.await, r2.await);
    loop {
        if stub.state.running() == 0 && stub.state.waiting() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stub.shutdown().await.unwrap();
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_process(port: u16, envs: &[(&str, &str)]) -> Child {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vllm-stub"));
    cmd.args([
        "--model=/models/stub",
        "--served-model-name=stub-svc",
        "--host=127.0.0.1",
        &format!("--port={port}"),
    ])
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    Child(cmd.spawn().unwrap())
}

async fn wait_listening(c: &HttpClient, url: &str) -> StatusCode {
    loop {
        if let Ok(resp) = c
            .request(Request::get(url).body(Full::new(Bytes::new())).unwrap())
            .await
        {
            return resp.status();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn process_health_waits_for_startup_delay() {
    let port = free_port();
    let _child = start_process(port, &[("STUB_STARTUP_DELAY", "1s")]);
    let c = client();
    let health = format!("http://127.0.0.1:{port}/health");
    assert_eq!(
        wait_listening(&c, &health).await,
        StatusCode::SERVICE_UNAVAILABLE
    );
    loop {
        let (s, _) = get(&c, &health).await;
        if s == StatusCode::OK {
            break;
        }
        assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn process_sigterm_finishes_in_flight_stream_then_exits() {
    let port = free_port();
    let mut child = start_process(
        port,
        &[("STUB_TOKEN_COUNT", "10"), ("STUB_TOKEN_DELAY", "50ms")],
    );
    let c = client();
    let base = format!("http://127.0.0.1:{port}");
    assert_eq!(
        wait_listening(&c, &format!("{base}/health")).await,
        StatusCode::OK
    );
    let req = Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(
            serde_json::json!({"model": "stub-svc", "stream": true,
                "messages": [{"role": "user", "content": "x"}]})
            .to_string(),
        )))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "));
    let status = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let rest = body.collect().await.unwrap().to_bytes();
    assert!(
        rest.ends_with(b"data: [DONE]\n\n"),
        "the stream finished after SIGTERM"
    );
    let code = tokio::task::spawn_blocking(move || child.0.wait().unwrap())
        .await
        .unwrap();
    assert!(code.success(), "exit status {code:?}");
    // Nothing listens any more.
    assert!(
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
    );
}

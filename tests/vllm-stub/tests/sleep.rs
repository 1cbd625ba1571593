//! vLLM's sleep mode on the stub (`POST /sleep`, `POST /wake_up[?tags=]`, `GET /is_sleeping`,
//! `POST /collective_rpc` `reload_weights`), against a
//! real HTTP client: in-process on an ephemeral port, and as a process for its flag and
//! environment. Delays are asserted as lower bounds only.

use std::{
    net::SocketAddr,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use vllm_stub::{RunningStub, SleepLevel, SleepState, StubConfig, spawn};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn send(c: &HttpClient, method: &str, url: &str, body: &str) -> (StatusCode, Bytes) {
    let req = Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_owned())))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status();
    (status, resp.into_body().collect().await.unwrap().to_bytes())
}

fn json(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body).unwrap()
}

/// Sleep mode on, as `--enable-sleep-mode` with `VLLM_SERVER_DEV_MODE=1`.
fn cfg() -> StubConfig {
    StubConfig {
        model: "/models/stub".into(),
        served_model_names: vec!["stub-svc".into()],
        token_count: 3,
        token_delay: Duration::from_millis(1),
        enable_sleep_mode: true,
        dev_mode: true,
        ..StubConfig::default()
    }
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

async fn chat(c: &HttpClient, stub: &RunningStub) -> (StatusCode, Bytes) {
    let body = serde_json::json!({"model": "stub-svc",
        "messages": [{"role": "user", "content": "hi"}]});
    send(
        c,
        "POST",
        &format!("{}/v1/chat/completions", stub.url()),
        &body.to_string(),
    )
    .await
}

async fn completion_stream(c: &HttpClient, stub: &RunningStub) -> (StatusCode, Bytes) {
    let body = serde_json::json!({"model": "stub-svc", "prompt": "Once", "stream": true});
    send(
        c,
        "POST",
        &format!("{}/v1/completions", stub.url()),
        &body.to_string(),
    )
    .await
}

async fn is_sleeping(c: &HttpClient, base: &str) -> bool {
    let (status, body) = send(c, "GET", &format!("{base}/is_sleeping"), "").await;
    assert_eq!(status, StatusCode::OK);
    let v = json(&body);
    assert_eq!(v.as_object().map(|o| o.len()), Some(1), "{v}");
    v["is_sleeping"].as_bool().unwrap()
}

/// `POST <path>`, its status and how long it took.
async fn timed_post(c: &HttpClient, url: &str) -> (StatusCode, Duration) {
    let start = Instant::now();
    let (status, _) = send(c, "POST", url, "").await;
    (status, start.elapsed())
}

/// The `vllm:engine_sleep_state` samples: (awake, weights_offloaded, discard_all).
async fn sleep_gauge(c: &HttpClient, stub: &RunningStub) -> (String, String, String) {
    let (status, body) = send(c, "GET", &format!("{}/metrics", stub.url()), "").await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(body.to_vec()).unwrap();
    assert!(
        text.contains("# TYPE vllm:engine_sleep_state gauge"),
        "{text}"
    );
    let sample = |state: &str| {
        let prefix = format!(
            "vllm:engine_sleep_state{{engine=\"0\",model_name=\"stub-svc\",sleep_state=\"{state}\"}} "
        );
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .unwrap_or_else(|| panic!("no {prefix}in {text}"))
            .to_owned()
    };
    (
        sample("awake"),
        sample("weights_offloaded"),
        sample("discard_all"),
    )
}

fn gauge(awake: &str, offloaded: &str, discarded: &str) -> (String, String, String) {
    (awake.into(), offloaded.into(), discarded.into())
}

async fn wait_for_state(stub: &RunningStub, want: SleepState) {
    let mut rx = stub.state.subscribe_sleep();
    tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|s| *s == want))
        .await
        .unwrap_or_else(|_| panic!("never {want:?}"))
        .unwrap();
}

fn assert_refused_as_sleeping(status: StatusCode, body: &[u8]) {
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let v = json(body);
    assert_eq!(v["error"]["type"], "ServiceUnavailableError", "{v}");
    assert_eq!(v["error"]["code"], 503);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("the engine is sleeping"),
        "{v}"
    );
}

#[tokio::test]
async fn sleep_routes_absent_without_both_flags() {
    let c = client();
    for (enable_sleep_mode, dev_mode) in [(false, false), (true, false), (false, true)] {
        let stub = spawn(
            StubConfig {
                enable_sleep_mode,
                dev_mode,
                ..cfg()
            },
            localhost(),
        )
        .await
        .unwrap();
        let base = stub.url();
        for (method, path) in [
            ("POST", "/sleep"),
            ("POST", "/sleep?level=2"),
            ("POST", "/wake_up"),
            ("GET", "/is_sleeping"),
            ("POST", "/collective_rpc"),
        ] {
            let (status, _) = send(&c, method, &format!("{base}{path}"), "").await;
            assert_eq!(
                status,
                StatusCode::NOT_FOUND,
                "{method} {path} with enable_sleep_mode={enable_sleep_mode}, dev_mode={dev_mode}"
            );
        }
        assert_eq!(chat(&c, &stub).await.0, StatusCode::OK);
        // vLLM exports its sleep gauge whether or not sleep mode is on.
        assert_eq!(sleep_gauge(&c, &stub).await, gauge("1.0", "0.0", "0.0"));
        stub.shutdown().await.unwrap();
    }
}

#[tokio::test]
async fn sleep_level_1_then_wake_up() {
    let sleep_delay = Duration::from_millis(150);
    let wake_delay = Duration::from_millis(200);
    let stub = spawn(
        StubConfig {
            sleep_delay,
            wake_delay,
            // Only level 2 waits for the load again.
            startup_delay: Duration::ZERO,
            ..cfg()
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let base = stub.url();
    assert!(!is_sleeping(&c, &base).await);
    assert_eq!(sleep_gauge(&c, &stub).await, gauge("1.0", "0.0", "0.0"));

    // No level: level 1.
    let (status, took) = timed_post(&c, &format!("{base}/sleep")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(took >= sleep_delay, "slept in {took:?}");
    assert_eq!(
        stub.state.sleep_state(),
        SleepState::Asleep(SleepLevel::Offload)
    );
    assert!(is_sleeping(&c, &base).await);
    assert_eq!(sleep_gauge(&c, &stub).await, gauge("0.0", "1.0", "0.0"));

    // Asleep: completions refused, the server alive.
    let (status, body) = chat(&c, &stub).await;
    assert_refused_as_sleeping(status, &body);
    assert!(
        json(&body)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("level 1")
    );
    let (status, body) = completion_stream(&c, &stub).await;
    assert_refused_as_sleeping(status, &body);
    assert_eq!(
        send(&c, "GET", &format!("{base}/health"), "").await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&c, "GET", &format!("{base}/v1/models"), "").await.0,
        StatusCode::OK
    );

    let (status, took) = timed_post(&c, &format!("{base}/wake_up")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(took >= wake_delay, "woke in {took:?}");
    assert!(!is_sleeping(&c, &base).await);
    assert_eq!(stub.state.wake_ups(), 1);
    assert_eq!(sleep_gauge(&c, &stub).await, gauge("1.0", "0.0", "0.0"));
    let (status, body) = chat(&c, &stub).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(completion_stream(&c, &stub).await.0, StatusCode::OK);

    // Waking an awake engine: 200, nothing happens.
    let (status, _) = timed_post(&c, &format!("{base}/wake_up")).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stub.state.wake_ups(), 1);
    assert_eq!(stub.state.sleep_state(), SleepState::Awake);
    stub.shutdown().await.unwrap();
}

/// The text of a chat completion's answer.
fn content(body: &[u8]) -> String {
    json(body)["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// `POST /collective_rpc` with `method`: its status and JSON body.
async fn rpc(c: &HttpClient, base: &str, method: &str) -> (StatusCode, serde_json::Value) {
    let (status, body) = send(
        c,
        "POST",
        &format!("{base}/collective_rpc"),
        &serde_json::json!({"method": method}).to_string(),
    )
    .await;
    (status, json(&body))
}

/// Level 2 as vLLM documents it: `tags=weights`, `reload_weights`, `tags=kv_cache`. Woken
/// without the reload the engine answers noise, as vLLM's does with dropped weights.
#[tokio::test]
async fn level_2_wakes_by_tags_and_answers_noise_until_the_weights_are_reloaded() {
    let startup_delay = Duration::from_millis(300);
    let wake_delay = Duration::from_millis(100);
    let stub = spawn(
        StubConfig {
            startup_delay,
            wake_delay,
            ..cfg()
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let base = stub.url();
    while !stub.state.is_ready() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, body) = chat(&c, &stub).await;
    assert_eq!(status, StatusCode::OK);
    let words = content(&body);
    assert!(!words.contains(vllm_stub::STALE_WEIGHTS_TOKEN), "{words}");

    assert_eq!(
        timed_post(&c, &format!("{base}/sleep?level=2")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        stub.state.sleep_state(),
        SleepState::Asleep(SleepLevel::Discard)
    );
    assert_eq!(sleep_gauge(&c, &stub).await, gauge("0.0", "0.0", "1.0"));
    // The weights sleep: nothing to reload into.
    let (status, v) = rpc(&c, &base, "reload_weights").await;
    assert_eq!(status, StatusCode::CONFLICT, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("tags=weights"),
        "{v}"
    );

    // 1. The weights' memory.
    let (status, took) = timed_post(&c, &format!("{base}/wake_up?tags=weights")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(took >= wake_delay, "woke the weights in {took:?}");
    let kv_only = vllm_stub::Tags::parse(["kv_cache"]).unwrap();
    let partly = SleepState::PartlyAwake {
        level: SleepLevel::Discard,
        asleep: kv_only,
    };
    assert_eq!(stub.state.sleep_state(), partly);
    assert!(is_sleeping(&c, &base).await);
    let (status, body) = chat(&c, &stub).await;
    assert_refused_as_sleeping(status, &body);
    assert!(
        json(&body)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("kv_cache still asleep"),
        "{}",
        String::from_utf8_lossy(&body)
    );
    // A tag that is awake already, an unknown one, and a sleep while partly awake: nothing.
    for path in [
        "/wake_up?tags=weights",
        "/wake_up?tags=kv",
        "/sleep?level=1",
    ] {
        assert_eq!(
            timed_post(&c, &format!("{base}{path}")).await.0,
            StatusCode::OK,
            "{path}"
        );
        assert_eq!(stub.state.sleep_state(), partly, "{path}");
    }
    // 2. Their values, loaded again.
    let t = Instant::now();
    let (status, v) = rpc(&c, &base, "reload_weights").await;
    assert_eq!(
        (status, v.clone()),
        (StatusCode::OK, serde_json::json!({"results": [null]}))
    );
    assert!(
        t.elapsed() >= startup_delay,
        "reloaded in {:?}",
        t.elapsed()
    );
    assert!(!stub.state.weights_stale());
    let (status, v) = rpc(&c, &base, "save_sharded_state").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["param"], "method", "{v}");
    // 3. The KV cache: awake.
    assert_eq!(
        timed_post(&c, &format!("{base}/wake_up?tags=kv_cache"))
            .await
            .0,
        StatusCode::OK
    );
    assert!(!is_sleeping(&c, &base).await);
    assert_eq!(stub.state.wake_ups(), 1);
    let (status, body) = chat(&c, &stub).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        content(&body),
        words,
        "the reloaded engine answers as before"
    );

    // A whole wake-up after level 2, without the reload: awake at once (no load), and noise.
    assert_eq!(
        timed_post(&c, &format!("{base}/sleep?level=2")).await.0,
        StatusCode::OK
    );
    let (status, took) = timed_post(&c, &format!("{base}/wake_up")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        took >= wake_delay && took < wake_delay + startup_delay,
        "woke in {took:?}"
    );
    assert_eq!(stub.state.sleep_state(), SleepState::Awake);
    assert!(stub.state.weights_stale());
    let (status, body) = chat(&c, &stub).await;
    assert_eq!(status, StatusCode::OK);
    let noise = content(&body);
    assert!(
        !noise.is_empty() && noise.chars().all(|ch| ch == '\u{fffd}'),
        "{noise:?}"
    );
    // Reloaded while awake: as before.
    assert_eq!(rpc(&c, &base, "reload_weights").await.0, StatusCode::OK);
    assert_eq!(content(&chat(&c, &stub).await.1), words);

    // Asleep at level 1, a level-2 sleep drops the offloaded weights.
    assert_eq!(
        timed_post(&c, &format!("{base}/sleep?level=1")).await.0,
        StatusCode::OK
    );
    assert!(!stub.state.weights_stale());
    assert_eq!(
        timed_post(&c, &format!("{base}/sleep?level=2")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        stub.state.sleep_state(),
        SleepState::Asleep(SleepLevel::Discard)
    );
    assert!(stub.state.weights_stale());
    // A shallower sleep does not bring them back.
    assert_eq!(
        timed_post(&c, &format!("{base}/sleep")).await.0,
        StatusCode::OK
    );
    assert_eq!(
        stub.state.sleep_state(),
        SleepState::Asleep(SleepLevel::Discard)
    );
    assert_eq!(
        timed_post(&c, &format!("{base}/wake_up")).await.0,
        StatusCode::OK
    );
    assert_eq!(stub.state.wake_ups(), 3);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn requests_refused_while_falling_asleep_and_waking_up() {
    let stub = spawn(
        StubConfig {
            // Long enough for the requests below to arrive in between.
            sleep_delay: Duration::from_secs(1),
            wake_delay: Duration::from_secs(1),
            ..cfg()
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let base = stub.url();

    let (c2, url) = (c.clone(), format!("{base}/sleep?level=1"));
    let sleeping = tokio::spawn(async move { send(&c2, "POST", &url, "").await.0 });
    wait_for_state(&stub, SleepState::FallingAsleep(SleepLevel::Offload)).await;
    assert!(is_sleeping(&c, &base).await);
    let (status, body) = chat(&c, &stub).await;
    assert_refused_as_sleeping(status, &body);
    assert!(
        json(&body)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("falling asleep")
    );
    let (status, body) = completion_stream(&c, &stub).await;
    assert_refused_as_sleeping(status, &body);
    assert_eq!(sleeping.await.unwrap(), StatusCode::OK);

    let (c2, url) = (c.clone(), format!("{base}/wake_up"));
    let waking = tokio::spawn(async move { send(&c2, "POST", &url, "").await.0 });
    wait_for_state(&stub, SleepState::WakingUp(SleepLevel::Offload)).await;
    assert!(is_sleeping(&c, &base).await);
    let (status, body) = chat(&c, &stub).await;
    assert_refused_as_sleeping(status, &body);
    assert!(
        json(&body)["error"]["message"]
            .as_str()
            .unwrap()
            .contains("waking up")
    );
    // The server stays alive throughout.
    assert_eq!(
        send(&c, "GET", &format!("{base}/health"), "").await.0,
        StatusCode::OK
    );
    assert_eq!(waking.await.unwrap(), StatusCode::OK);
    assert_eq!(chat(&c, &stub).await.0, StatusCode::OK);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn in_flight_requests_finish_and_waiting_ones_are_refused_once_asleep() {
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
    let body = serde_json::json!({"model": "stub-svc", "stub_token_delay": "50ms",
        "max_tokens": 40, "messages": [{"role": "user", "content": "x"}]})
    .to_string();
    let (c1, u1, b1) = (c.clone(), url.clone(), body.clone());
    let running = tokio::spawn(async move { send(&c1, "POST", &u1, &b1).await });
    while stub.state.running() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (c2, u2) = (c.clone(), url);
    let waiting = tokio::spawn(async move { send(&c2, "POST", &u2, &body).await });
    while stub.state.waiting() == 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(
        timed_post(&c, &format!("{}/sleep", stub.url())).await.0,
        StatusCode::OK
    );
    let (status, body) = running.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    assert_eq!(json(&body)["usage"]["completion_tokens"], 40);
    let (status, body) = waiting.await.unwrap();
    assert_refused_as_sleeping(status, &body);
    assert_eq!((stub.state.running(), stub.state.waiting()), (0, 0));
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn a_sleep_whose_client_leaves_still_completes() {
    let stub = spawn(
        StubConfig {
            sleep_delay: Duration::from_secs(1),
            ..cfg()
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let (c2, url) = (c.clone(), format!("{}/sleep?level=2", stub.url()));
    let sleeping = tokio::spawn(async move { send(&c2, "POST", &url, "").await.0 });
    wait_for_state(&stub, SleepState::FallingAsleep(SleepLevel::Discard)).await;
    sleeping.abort();
    let _ = sleeping.await;
    wait_for_state(&stub, SleepState::Asleep(SleepLevel::Discard)).await;
    assert!(is_sleeping(&c, &stub.url()).await);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn bad_level_is_a_400_naming_the_parameter() {
    let stub = spawn(cfg(), localhost()).await.unwrap();
    let c = client();
    let base = stub.url();
    for query in [
        "level=3",
        "level=0",
        "level=abc",
        "level=",
        "level",
        "level=1.0",
    ] {
        let (status, body) = send(&c, "POST", &format!("{base}/sleep?{query}"), "").await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}");
        let v = json(&body);
        assert_eq!(v["error"]["type"], "BadRequestError", "{v}");
        assert_eq!(v["error"]["param"], "level", "{v}");
        assert_eq!(v["error"]["code"], 400, "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("`level`") && message.contains("1 (") && message.contains("2 ("),
            "{message}"
        );
    }
    assert_eq!(stub.state.sleep_state(), SleepState::Awake);
    assert!(!is_sleeping(&c, &base).await);
    assert_eq!(chat(&c, &stub).await.0, StatusCode::OK);

    // A partial wake-up of an awake engine does nothing, as vLLM's.
    let (status, _) = send(&c, "POST", &format!("{base}/wake_up?tags=weights"), "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stub.state.sleep_state(), SleepState::Awake);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn sleep_routes_answer_503_until_the_model_is_loaded() {
    let stub = spawn(
        StubConfig {
            await_model: true,
            ..cfg()
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let base = stub.url();
    for (method, path) in [
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("GET", "/is_sleeping"),
        ("POST", "/collective_rpc"),
    ] {
        let (status, _) = send(&c, method, &format!("{base}{path}"), "").await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{method} {path}");
    }
    assert_eq!(stub.state.sleep_state(), SleepState::Awake);
    stub.state.model_loaded();
    assert!(!is_sleeping(&c, &base).await);
    stub.shutdown().await.unwrap();
}

#[tokio::test]
async fn concurrent_wake_ups_share_one_wake() {
    let wake_delay = Duration::from_millis(300);
    let stub = spawn(
        StubConfig {
            wake_delay,
            ..cfg()
        },
        localhost(),
    )
    .await
    .unwrap();
    let c = client();
    let base = stub.url();
    assert_eq!(
        timed_post(&c, &format!("{base}/sleep")).await.0,
        StatusCode::OK
    );
    let start = Instant::now();
    let wake = |c: &HttpClient| {
        let (c, url, state) = (c.clone(), format!("{base}/wake_up"), stub.state.clone());
        // Each answer comes once the engine is awake, a wake delay after the first request.
        tokio::spawn(async move {
            let status = send(&c, "POST", &url, "").await.0;
            (status, state.sleep_state(), start.elapsed())
        })
    };
    let mut wakes = vec![wake(&c)];
    wait_for_state(&stub, SleepState::WakingUp(SleepLevel::Offload)).await;
    // Three more while the first one is under way.
    wakes.extend((0..3).map(|_| wake(&c)));
    for w in wakes {
        let (status, state, took) = w.await.unwrap();
        assert_eq!(status, StatusCode::OK);
        assert_eq!(
            state,
            SleepState::Awake,
            "answered before the engine was awake"
        );
        assert!(took >= wake_delay, "answered after {took:?}");
    }
    assert_eq!(stub.state.wake_ups(), 1, "one wake-up for four requests");
    assert_eq!(stub.state.sleep_state(), SleepState::Awake);
    assert!(!is_sleeping(&c, &base).await);
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

fn stub_command(port: u16, args: &[&str], envs: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_vllm-stub"));
    cmd.args([
        "--model=/models/stub",
        "--served-model-name=stub-svc",
        "--host=127.0.0.1",
        &format!("--port={port}"),
    ])
    .args(args)
    .env_remove("VLLM_SERVER_DEV_MODE")
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd
}

async fn wait_healthy(c: &HttpClient, base: &str) {
    loop {
        let req = Request::get(format!("{base}/health"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        if let Ok(resp) = c.request(req).await
            && resp.status() == StatusCode::OK
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn process_flag_and_env_enable_sleep_mode() {
    let c = client();
    let wake_delay = Duration::from_millis(150);

    let port = free_port();
    let _child = Child(
        stub_command(
            port,
            &["--enable-sleep-mode"],
            &[("VLLM_SERVER_DEV_MODE", "1"), ("STUB_WAKE_DELAY", "150ms")],
        )
        .spawn()
        .unwrap(),
    );
    let base = format!("http://127.0.0.1:{port}");
    wait_healthy(&c, &base).await;
    assert!(!is_sleeping(&c, &base).await);
    assert_eq!(
        timed_post(&c, &format!("{base}/sleep?level=1")).await.0,
        StatusCode::OK
    );
    assert!(is_sleeping(&c, &base).await);
    let (status, took) = timed_post(&c, &format!("{base}/wake_up")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(took >= wake_delay, "woke in {took:?}");
    assert!(!is_sleeping(&c, &base).await);

    // The flag without the environment, and the environment without the flag: no routes.
    for (args, envs) in [
        (&["--enable-sleep-mode"][..], &[][..]),
        (
            &["--enable-sleep-mode"][..],
            &[("VLLM_SERVER_DEV_MODE", "0")][..],
        ),
        (&[][..], &[("VLLM_SERVER_DEV_MODE", "1")][..]),
    ] {
        let port = free_port();
        let _child = Child(stub_command(port, args, envs).spawn().unwrap());
        let base = format!("http://127.0.0.1:{port}");
        wait_healthy(&c, &base).await;
        let (status, _) = send(&c, "GET", &format!("{base}/is_sleeping"), "").await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{args:?} {envs:?}");
    }

    // vLLM reads VLLM_SERVER_DEV_MODE as an integer and fails on anything else.
    let out = stub_command(
        free_port(),
        &["--enable-sleep-mode"],
        &[("VLLM_SERVER_DEV_MODE", "yes")],
    )
    .stderr(Stdio::piped())
    .output()
    .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("VLLM_SERVER_DEV_MODE"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

//! The sleeping tier against the vllm-stub's sleep mode (vLLM's `/sleep`, `/wake_up`,
//! `/is_sleeping`): idle engines are put to sleep, demand wakes them, held requests are answered.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use hearth_gateway::{
    ColdStartMode, EndpointSet, GatewayConfig, RunningGateway,
    sleep::{EngineCall, SleepConfig},
};
use hyper::StatusCode;
use vllm_stub::{RunningStub, SleepState, StubConfig};

const WAKE_DELAY: Duration = Duration::from_millis(400);

async fn sleepy_stub() -> RunningStub {
    let cfg = StubConfig {
        enable_sleep_mode: true,
        dev_mode: true,
        sleep_delay: Duration::from_millis(50),
        wake_delay: WAKE_DELAY,
        ..stub_config()
    };
    vllm_stub::spawn(cfg, localhost()).await.unwrap()
}

fn sleep_config(after: Duration) -> GatewayConfig {
    GatewayConfig {
        sleep: Some(SleepConfig {
            level: 1,
            after,
            sleep_path: "/sleep".into(),
            is_sleeping_path: "/is_sleeping".into(),
            wake_up: vec!["/wake_up".parse::<EngineCall>().unwrap()],
            call_timeout: Duration::from_secs(10),
        }),
        ..config()
    }
}

async fn wait_stub(stub: &RunningStub, pred: impl Fn(SleepState) -> bool) {
    let mut rx = stub.state.subscribe_sleep();
    tokio::time::timeout(Duration::from_secs(10), rx.wait_for(|s| pred(*s)))
        .await
        .expect("the stub's sleep state did not change in 10s")
        .unwrap();
}

/// Waits until the gateway's metrics show `sample` at `value`.
async fn wait_metric(c: &HttpClient, g: &RunningGateway, sample: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let text = gateway_metrics(c, g).await;
        if metric(&text, sample) == Some(value) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{sample} did not reach {value} in 10s:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A sleepy stub and a gateway with the sleeping tier in front of it.
async fn stub_and_gateway(after: Duration) -> (RunningStub, RunningGateway, HttpClient) {
    let stub = sleepy_stub().await;
    let g = gateway(sleep_config(after), EndpointSet::fixed([authority(&stub)])).await;
    (stub, g, client())
}

/// Puts the stub to sleep at `level` directly, as another gateway replica would.
async fn put_to_sleep(c: &HttpClient, stub: &RunningStub, level: u8) {
    let url = format!("{}/sleep?level={level}", stub.url());
    let (status, _, _) = send_full(c, post_req(&url, &serde_json::json!({}), &[])).await;
    assert_eq!(status, StatusCode::OK);
}

/// `hearth_gateway_engine_calls_total{call,result}` in a metrics text.
fn engine_calls(text: &str, call: &str, result: &str) -> Option<f64> {
    metric(
        text,
        &format!(r#"hearth_gateway_engine_calls_total{{call="{call}",result="{result}"}}"#),
    )
}

async fn chat_ok(c: &HttpClient, g: &RunningGateway) -> Duration {
    let started = Instant::now();
    let (status, _, body) = send_full(c, chat_req(&g.url(), &chat(false))).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    started.elapsed()
}

#[tokio::test]
async fn an_idle_engine_is_put_to_sleep_and_a_request_wakes_it() {
    let (stub, g, c) = stub_and_gateway(Duration::from_millis(300)).await;
    // Awake at first: served at once.
    assert!(chat_ok(&c, &g).await < WAKE_DELAY);
    wait_stub(&stub, |s| {
        s == SleepState::Asleep(vllm_stub::SleepLevel::Offload)
    })
    .await;
    wait_metric(&c, &g, "hearth_gateway_backends_sleeping", 1.0).await;
    assert!(
        !g.gateway.backends().is_ready(),
        "a sleeping engine serves nothing"
    );

    // A request while it sleeps is held until the engine is awake, then answered.
    let took = chat_ok(&c, &g).await;
    assert!(
        took >= WAKE_DELAY,
        "answered after {took:?}, before the wake-up"
    );
    assert!(!stub.state.is_sleeping());
    let text = gateway_metrics(&c, &g).await;
    assert_eq!(engine_calls(&text, "wake_up", "ok"), Some(1.0));
    assert_eq!(engine_calls(&text, "sleep", "ok"), Some(1.0));
    let wake = metric(
        &text,
        r#"hearth_activation_phase_seconds_sum{phase="wake_up"}"#,
    )
    .unwrap();
    assert!(wake >= WAKE_DELAY.as_secs_f64(), "wake_up phase {wake}s");
    assert_eq!(metric(&text, "hearth_gateway_backends_sleeping"), Some(0.0));

    // Idle again: asleep again.
    wait_stub(&stub, SleepState::is_sleeping).await;
}

#[tokio::test]
async fn a_stream_held_while_the_engine_wakes_gets_heartbeats_then_tokens() {
    let (stub, g, c) = stub_and_gateway(Duration::from_millis(100)).await;
    wait_stub(&stub, |s| {
        s == SleepState::Asleep(vllm_stub::SleepLevel::Offload)
    })
    .await;
    let (status, _, body) = send_full(&c, chat_req(&g.url(), &chat(true))).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    assert!(text.starts_with(':'), "heartbeat comments first: {text}");
    let events = sse_events(&body);
    assert_eq!(
        events.last().map(|e| e.trim()),
        Some("data: [DONE]"),
        "{text}"
    );
}

#[tokio::test]
async fn an_engine_put_to_sleep_by_another_replica_is_woken_not_relayed() {
    // This replica would not put it to sleep for an hour.
    let (stub, g, c) = stub_and_gateway(Duration::from_secs(3600)).await;
    assert!(chat_ok(&c, &g).await < WAKE_DELAY);
    // Another replica (here: the test) puts it to sleep.
    put_to_sleep(&c, &stub, 1).await;
    // The engine's 503 is not relayed: the request waits for the wake-up.
    let took = chat_ok(&c, &g).await;
    assert!(took >= WAKE_DELAY, "answered after {took:?}");
    assert!(!stub.state.is_sleeping());
}

#[tokio::test]
async fn a_warm_stream_that_finds_the_engine_asleep_gets_heartbeats_while_it_wakes() {
    // The wake-up takes 400 ms; heartbeats are every 50 ms.
    let (stub, g, c) = stub_and_gateway(Duration::from_secs(3600)).await;
    assert!(chat_ok(&c, &g).await < WAKE_DELAY);
    put_to_sleep(&c, &stub, 1).await;
    // This replica still takes the engine as awake: the stream is sent warm, meets the 503,
    // and is held from there as a cold one.
    assert!(g.gateway.backends().is_ready());
    let (status, _, body) = send_full(&c, chat_req(&g.url(), &chat(true))).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.starts_with(':'),
        "heartbeat comments while the engine wakes: {text}"
    );
    let events = sse_events(&body);
    assert_eq!(
        events.last().map(|e| e.trim()),
        Some("data: [DONE]"),
        "{text}"
    );
    assert!(!stub.state.is_sleeping());
}

#[tokio::test]
async fn in_reject_mode_a_warm_request_that_finds_the_engine_asleep_is_rejected_and_wakes_it() {
    let stub = sleepy_stub().await;
    let cfg = GatewayConfig {
        cold_start: ColdStartMode::Reject,
        ..sleep_config(Duration::from_secs(3600))
    };
    let g = gateway(cfg, EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    assert!(chat_ok(&c, &g).await < WAKE_DELAY);
    put_to_sleep(&c, &stub, 1).await;
    let (status, headers, body) = send_full(&c, chat_req(&g.url(), &chat(false))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "3");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "cold_reject", "{v}");
    // The rejected request still woke the engine: the retry is served.
    wait_stub(&stub, |s| !s.is_sleeping()).await;
    wait_metric(&c, &g, "hearth_gateway_backends_sleeping", 0.0).await;
    assert!(chat_ok(&c, &g).await < WAKE_DELAY);
}

#[tokio::test]
async fn a_warm_request_for_another_model_that_finds_the_engine_asleep_is_refused_at_once() {
    let stub = sleepy_stub().await;
    let cfg = GatewayConfig {
        served_model_names: vec!["stub-svc".into()],
        ..sleep_config(Duration::from_secs(3600))
    };
    let g = gateway(cfg, EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    assert!(chat_ok(&c, &g).await < WAKE_DELAY);
    put_to_sleep(&c, &stub, 1).await;
    // Sent warm; the engine's 503 makes it cold, and a cold request's model is checked: it is
    // not held through the wake-up for the engine to refuse it.
    let mut other = chat(false);
    other["model"] = "other".into();
    let started = Instant::now();
    let (status, _, body) = send_full(&c, chat_req(&g.url(), &other)).await;
    let took = started.elapsed();
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(took < WAKE_DELAY, "answered after {took:?}");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        v["error"]["message"], "The model `other` does not exist.",
        "{v}"
    );
    let text = gateway_metrics(&c, &g).await;
    assert_eq!(
        metric(
            &text,
            r#"hearth_gateway_rejections_total{reason="unknown_model"}"#
        ),
        Some(1.0),
        "{text}"
    );
    // The served model is served, once the engine is awake.
    chat_ok(&c, &g).await;
    assert!(!stub.state.is_sleeping());
}

#[tokio::test]
async fn a_gateway_started_while_the_engine_sleeps_wakes_it_first() {
    let stub = sleepy_stub().await;
    let c = client();
    put_to_sleep(&c, &stub, 2).await;
    let g = gateway(
        sleep_config(Duration::from_secs(3600)),
        EndpointSet::fixed([authority(&stub)]),
    )
    .await;
    wait_metric(&c, &g, "hearth_gateway_backends_sleeping", 1.0).await;
    assert!(chat_ok(&c, &g).await >= WAKE_DELAY);
    let text = gateway_metrics(&c, &g).await;
    assert_eq!(engine_calls(&text, "wake_up", "ok"), Some(1.0));
}

#[tokio::test]
async fn an_engine_without_sleep_routes_keeps_serving() {
    // Started without --enable-sleep-mode: /is_sleeping and /sleep are 404.
    let stub = vllm_stub::spawn(stub_config(), localhost()).await.unwrap();
    let g = gateway(
        sleep_config(Duration::from_millis(100)),
        EndpointSet::fixed([authority(&stub)]),
    )
    .await;
    let c = client();
    wait_metric(
        &c,
        &g,
        r#"hearth_gateway_engine_calls_total{call="sleep",result="error"}"#,
        1.0,
    )
    .await;
    assert!(chat_ok(&c, &g).await < Duration::from_secs(1));
    assert!(g.gateway.backends().is_ready());
}

//! The request path through a real gateway to a real vllm-stub, in process on loopback.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use hearth_gateway::{ColdStartMode, EndpointSet, GatewayConfig, apikeys::ApiKeys};
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};

/// A chunk's JSON with the per-request fields (`id`, `created`) blanked, to compare streams.
fn normalize(events: &[String]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            let data = e.strip_prefix("data: ").unwrap_or(e);
            match serde_json::from_str::<serde_json::Value>(data) {
                Ok(mut v) => {
                    v["id"] = serde_json::Value::Null;
                    v["created"] = serde_json::Value::Null;
                    v.to_string()
                }
                Err(_) => data.to_owned(),
            }
        })
        .collect()
}

#[tokio::test]
async fn warm_requests_pass_through() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();

    let (status, headers, body) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers["content-type"], "application/json");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");

    // Streaming: the same events as straight from the stub, chunk by chunk.
    let direct = send_full(&c, chat_req(&stub.url(), &chat(true))).await.2;
    let resp = send(&c, chat_req(&gw.url(), &chat(true))).await;
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let mut body = resp.into_body();
    let mut chunks = Vec::new();
    while let Some(c) = next_chunk(&mut body).await {
        chunks.push(c);
    }
    assert!(
        chunks.len() >= 5,
        "tokens arrive as separate chunks: {}",
        chunks.len()
    );
    let all: Vec<u8> = chunks.concat();
    assert_eq!(
        normalize(&sse_events(&all)),
        normalize(&sse_events(&direct))
    );
    assert!(all.ends_with(b"data: [DONE]\n\n"));

    // /v1/models is forwarded while warm.
    let (status, v) = json(&c, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["data"][0]["root"], "/models/stub");

    wait_demand(&gw, |s| s.pending() == 0).await;
    let (_, q) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(q, serde_json::json!({"pending": 0}));
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_requests_total{code=\"200\"}"),
        Some(3.0),
        "{m}"
    );
}

#[tokio::test]
async fn cold_streaming_request_gets_heartbeats_then_the_stream() {
    let stub = stub().await;
    let backends = EndpointSet::new();
    let gw = gateway(config(), backends.clone()).await;
    let c = client();
    let resp = send(&c, chat_req(&gw.url(), &chat(true))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()["content-type"],
        "text/event-stream; charset=utf-8"
    );
    let mut body = resp.into_body();
    // At least two comment lines (one at once, then one per heartbeat interval).
    for _ in 0..2 {
        let c = next_chunk(&mut body).await.unwrap();
        assert!(c.starts_with(b": "), "{c:?}");
    }
    let (_, q) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(q["pending"], 1);
    backends.replace([authority(&stub)]);
    let mut rest = Vec::new();
    while let Some(c) = next_chunk(&mut body).await {
        rest.extend_from_slice(&c);
    }
    let events = sse_events(&rest);
    let data: Vec<&String> = events.iter().filter(|e| e.starts_with("data: ")).collect();
    assert_eq!(data.len(), 7, "5 tokens, finish, [DONE]: {events:?}");
    assert!(rest.ends_with(b"data: [DONE]\n\n"));
    wait_demand(&gw, |s| s.pending() == 0).await;
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_activation_wait_seconds_count"),
        Some(1.0),
        "{m}"
    );
    // The lease raised by the cold request until the endpoint turned ready: once.
    assert_eq!(
        metric(
            &m,
            "hearth_activation_phase_seconds_count{phase=\"demand_to_ready\"}"
        ),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn cold_non_streaming_request_is_held_then_forwarded_whole() {
    let stub = stub().await;
    let backends = EndpointSet::new();
    let gw = gateway(config(), backends.clone()).await;
    let c = client();
    let payload = "x".repeat(100_000);
    let req = Request::post(format!("{}/stub/echo", gw.url()))
        .header("content-type", "text/plain")
        .body(Full::new(Bytes::from(payload.clone())))
        .unwrap();
    let pending = tokio::spawn({
        let c = c.clone();
        async move { send_full(&c, req).await }
    });
    wait_demand(&gw, |s| s.pending() == 1 && s.lease()).await;
    assert_eq!(stub.state.received(), 0);
    backends.replace([authority(&stub)]);
    let (status, _, body) = pending.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["body_len"], 100_000);
    assert_eq!(v["body"].as_str().unwrap(), payload);
    // The lease ends a grace period after the backend turned ready.
    wait_demand(&gw, |s| s.local() == 0).await;
}

#[tokio::test]
async fn reject_mode_answers_503_and_still_raises_demand() {
    let backends = EndpointSet::new();
    let gw = gateway(
        GatewayConfig {
            cold_start: ColdStartMode::Reject,
            activation_timeout: Duration::from_secs(600),
            ..config()
        },
        backends,
    )
    .await;
    let c = client();
    let (status, headers, body) = send_full(&c, chat_req(&gw.url(), &chat(true))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["retry-after"], "3");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "cold_reject");
    // The client is gone but the activation lease keeps demand at 1.
    let (_, q) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(q["pending"], 1);
    let st = gw.gateway.demand().state();
    assert_eq!((st.pending(), st.lease()), (0, true));
}

#[tokio::test]
async fn activation_timeout_ends_a_committed_stream_with_an_error_event_and_otherwise_503() {
    let gw = gateway(
        GatewayConfig {
            activation_timeout: Duration::from_millis(300),
            ..config()
        },
        EndpointSet::new(),
    )
    .await;
    let c = client();
    let (status, _, body) = send_full(&c, chat_req(&gw.url(), &chat(true))).await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    let last = events.last().unwrap();
    assert!(last.starts_with("event: error\ndata: "), "{events:?}");
    let err: serde_json::Value =
        serde_json::from_str(last.strip_prefix("event: error\ndata: ").unwrap()).unwrap();
    assert_eq!(err["error"]["code"], "activation_timeout");
    assert!(
        events[..events.len() - 1]
            .iter()
            .all(|e| e.starts_with(": "))
    );

    let (status, headers, body) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(headers.contains_key("retry-after"));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "activation_timeout");
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_rejections_total{reason=\"activation_timeout\"}"
        ),
        Some(2.0),
        "{m}"
    );
}

#[tokio::test]
async fn an_activation_failure_answers_the_held_request_at_once_then_a_fixed_backend_serves() {
    let stub = stub().await;
    let backends = EndpointSet::new();
    let gw = gateway(
        GatewayConfig {
            activation_timeout: Duration::from_secs(600),
            ..config()
        },
        backends.clone(),
    )
    .await;
    let c = client();
    let (c2, req) = (c.clone(), chat_req(&gw.url(), &chat(false)));
    let held = tokio::spawn(async move { send_full(&c2, req).await });
    wait_demand(&gw, |s| s.pending() == 1).await;
    let why = "CrashLoopBackOff: pod chat-1, container vllm: restarted 2 times";
    backends.set_failure(Some(why));
    let (status, headers, body) = held.await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(!headers.contains_key("retry-after"), "{headers:?}");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "activation_failed");
    assert_eq!(v["error"]["type"], "server_error");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains(why), "{message}");
    // While it lasts, a new request is answered at once too.
    let (status, _, _) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    // Fixed: the reason cleared, the next request is held and served.
    backends.set_failure(None);
    let (c2, req) = (c.clone(), chat_req(&gw.url(), &chat(false)));
    let next = tokio::spawn(async move { send_full(&c2, req).await });
    wait_demand(&gw, |s| s.pending() == 1).await;
    backends.replace([authority(&stub)]);
    let (status, _, _) = next.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_rejections_total{reason=\"activation_failed\"}"
        ),
        Some(2.0),
        "{m}"
    );
}

#[tokio::test]
async fn a_client_leaving_a_held_request_frees_its_slot_and_counts_as_canceled() {
    let gw = gateway(config(), EndpointSet::new()).await;
    let c = client();
    for stream in [false, true] {
        let req = chat_req(&gw.url(), &chat(stream));
        let c2 = c.clone();
        let task = tokio::spawn(async move {
            let resp = send(&c2, req).await;
            // Keep reading until aborted.
            let _ = resp.into_body().collect().await;
        });
        wait_demand(&gw, |s| s.pending() == 1).await;
        task.abort();
        let _ = task.await;
        wait_demand(&gw, |s| s.pending() == 0).await;
    }
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_requests_canceled_total"),
        Some(2.0),
        "{m}"
    );
    assert!(!m.contains("code=\"503\""), "a cancel is not a 5xx: {m}");
    assert!(
        !m.contains("activation_timeout"),
        "a cancel is not a timeout: {m}"
    );
}

#[tokio::test]
async fn a_client_leaving_mid_stream_cancels_the_backend_request() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    let mut body = chat(true);
    body["stub_token_delay"] = "100ms".into();
    body["max_tokens"] = 1000.into();
    let resp = send(&c, chat_req(&gw.url(), &body)).await;
    let mut b = resp.into_body();
    assert!(next_chunk(&mut b).await.unwrap().starts_with(b"data: "));
    assert_eq!(stub.state.running(), 1);
    drop(b);
    wait_demand(&gw, |s| s.pending() == 0).await;
    while stub.state.running() != 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_requests_canceled_total"),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn max_queue_bounds_admission_with_429() {
    let gw = gateway(
        GatewayConfig {
            max_queue: 2,
            ..config()
        },
        EndpointSet::new(),
    )
    .await;
    let c = client();
    let mut held = Vec::new();
    for _ in 0..2 {
        let req = chat_req(&gw.url(), &chat(false));
        let c2 = c.clone();
        held.push(tokio::spawn(async move { send_full(&c2, req).await }));
    }
    wait_demand(&gw, |s| s.pending() == 2).await;
    let (status, headers, body) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(headers["retry-after"], "3");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["code"], "queue_full");
    for h in held {
        h.abort();
    }
}

#[tokio::test]
async fn bodies_over_the_limit_get_413() {
    let stub = stub().await;
    let gw = gateway(
        GatewayConfig {
            body_limit: 1024,
            ..config()
        },
        EndpointSet::fixed([authority(&stub)]),
    )
    .await;
    let c = client();
    // Declared length over the limit.
    let req = Request::post(format!("{}/stub/echo", gw.url()))
        .body(Full::new(Bytes::from(vec![b'a'; 2048])))
        .unwrap();
    let (status, _, body) = send_full(&c, req).await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(String::from_utf8_lossy(&body).contains("--body-limit"));
    // Chunked (no length) over the limit.
    let chunks = futures::stream::iter((0..4).map(|_| {
        Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(Bytes::from(vec![b'b'; 400])))
    }));
    let req = Request::post(format!("{}/stub/echo", gw.url()))
        .body(http_body_util::StreamBody::new(chunks))
        .unwrap();
    let chunked: hyper_util::client::legacy::Client<_, _> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build_http();
    let resp = chunked.request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::PAYLOAD_TOO_LARGE);
    // Exactly at the limit passes.
    let req = Request::post(format!("{}/stub/echo", gw.url()))
        .body(Full::new(Bytes::from(vec![b'a'; 1024])))
        .unwrap();
    let (status, _, body) = send_full(&c, req).await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["body_len"], 1024);
    assert_eq!(
        gw.gateway.demand().state().local(),
        0,
        "413s never raise demand"
    );
}

#[tokio::test]
async fn hop_by_hop_headers_are_dropped_and_end_to_end_ones_kept() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    let req = Request::post(format!("{}/stub/echo?x=1&y=%20", gw.url()))
        .header("authorization", "Bearer sk-test")
        .header("connection", "x-drop-me")
        .header("x-drop-me", "1")
        .header("keep-alive", "timeout=5")
        .header("te", "trailers")
        .header("upgrade", "h2c")
        .header("x-custom", "kept")
        .header("x-forwarded-for", "203.0.113.9")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let (status, _, body) = send_full(&c, req).await;
    assert_eq!(status, StatusCode::OK);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["uri"], "/stub/echo?x=1&y=%20");
    let headers: Vec<(String, String)> = v["headers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| {
            (
                h[0].as_str().unwrap().to_owned(),
                h[1].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    let get = |k: &str| {
        headers
            .iter()
            .find(|(n, _)| n == k)
            .map(|(_, v)| v.as_str())
    };
    assert_eq!(get("authorization"), Some("Bearer sk-test"));
    assert_eq!(get("x-custom"), Some("kept"));
    assert_eq!(get("content-length"), Some("2"));
    let via = get("via").unwrap_or_default();
    assert!(via.starts_with("1.1 hearth-gateway ("), "{via}");
    assert_eq!(get("x-forwarded-for"), Some("203.0.113.9, 127.0.0.1"));
    assert_eq!(get("x-forwarded-host"), Some(gw.http.to_string().as_str()));
    for gone in ["x-drop-me", "keep-alive", "te", "upgrade"] {
        assert_eq!(get(gone), None, "{gone} must not be forwarded");
    }
    assert_eq!(get("connection"), None);
}

#[tokio::test]
async fn backend_errors_are_passed_through() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    let (status, _, body) = send_full(
        &c,
        post_req(
            &format!("{}/v1/chat/completions", gw.url()),
            &chat(false),
            &[("x-stub-status", "500")],
        ),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "StubError");
}

#[tokio::test]
async fn cold_stream_carries_a_backend_error_as_an_error_event() {
    let stub = stub().await;
    let backends = EndpointSet::new();
    let gw = gateway(config(), backends.clone()).await;
    let c = client();
    let req = post_req(
        &format!("{}/v1/chat/completions", gw.url()),
        &chat(true),
        &[("x-stub-status", "503")],
    );
    let task = tokio::spawn({
        let c = c.clone();
        async move { send_full(&c, req).await }
    });
    wait_demand(&gw, |s| s.pending() == 1).await;
    backends.replace([authority(&stub)]);
    let (status, _, body) = task.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    let last = events.last().unwrap();
    assert!(last.starts_with("event: error\n"), "{events:?}");
    assert!(last.contains("503"), "{last}");
}

#[tokio::test]
async fn a_backend_dying_mid_stream_ends_a_warm_stream_with_an_error_event() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    let mut body = chat(true);
    body["max_tokens"] = 10.into();
    let (status, _, body) = send_full(
        &c,
        post_req(
            &format!("{}/v1/chat/completions", gw.url()),
            &body,
            &[("x-stub-abort-after", "3")],
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    // Tokens that came (the stub's last write before it cut the connection may not have been
    // flushed), then the error that ends the stream, and no [DONE].
    assert!((2..=4).contains(&events.len()), "{events:?}");
    assert!(!events.iter().any(|e| e.contains("[DONE]")), "{events:?}");
    let last = events.last().unwrap();
    assert!(last.starts_with("event: error\n"), "{events:?}");
    assert!(last.contains("bad_gateway"), "{last}");
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_upstream_errors_total{kind=\"stream\"}"),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn an_endpoint_that_refused_a_connection_is_skipped_while_another_is_ready() {
    let stub = stub().await;
    let dead: http::uri::Authority = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string().parse().unwrap()
    };
    let gw = gateway(
        config(),
        EndpointSet::fixed([dead.clone(), authority(&stub)]),
    )
    .await;
    let c = client();
    for _ in 0..8 {
        let (status, _, _) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
        assert_eq!(status, StatusCode::OK);
    }
    // One refusal ejects the dead endpoint; the other requests never try it.
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_upstream_errors_total{kind=\"connect\"}"),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn api_keys_are_checked_and_passed_through() {
    let stub = stub().await;
    let dir = std::env::temp_dir().join(format!("hearth-gw-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("keys");
    std::fs::write(&path, "sk-good\n").unwrap();
    let gw = gateway_with_keys(
        config(),
        EndpointSet::fixed([authority(&stub)]),
        ApiKeys::load(&path).unwrap(),
    )
    .await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let (status, headers, body) = send_full(&c, post_req(&url, &chat(false), &[])).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(headers["www-authenticate"], "Bearer");
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["code"], "invalid_api_key");
    let (status, _, _) = send_full(
        &c,
        post_req(&url, &chat(false), &[("authorization", "Bearer sk-bad")]),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = send_full(
        &c,
        post_req(&url, &chat(false), &[("authorization", "Bearer sk-good")]),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    // Rotating the Secret: the reload task (1 s in tests) picks up the new key.
    std::fs::write(&path, "sk-new\n").unwrap();
    loop {
        let (status, _, _) = send_full(
            &c,
            post_req(&url, &chat(false), &[("authorization", "Bearer sk-new")]),
        )
        .await;
        if status == StatusCode::OK {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, _, _) = send_full(
        &c,
        post_req(&url, &chat(false), &[("authorization", "Bearer sk-good")]),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(
        gw.gateway.demand().state().local(),
        0,
        "401s never raise demand"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn served_model_names_answer_models_cold_and_refuse_other_models() {
    let gw = gateway(
        GatewayConfig {
            served_model_names: vec!["stub-svc".into()],
            ..config()
        },
        EndpointSet::new(),
    )
    .await;
    let c = client();
    let (status, v) = json(&c, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["data"][0]["id"], "stub-svc");
    let mut body = chat(false);
    body["model"] = "gpt-4".into();
    let (status, _, b) = send_full(&c, chat_req(&gw.url(), &body)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert_eq!(v["error"]["message"], "The model `gpt-4` does not exist.");
    let st = gw.gateway.demand().state();
    assert_eq!((st.local(), st.lease()), (0, false), "no demand raised");
}

#[tokio::test]
async fn least_outstanding_requests_spreads_load() {
    let (s1, s2) = (stub().await, stub().await);
    let gw = gateway(
        config(),
        EndpointSet::fixed([authority(&s1), authority(&s2)]),
    )
    .await;
    let c = client();
    let mut body = chat(true);
    body["stub_token_delay"] = "50ms".into();
    body["max_tokens"] = 1000.into();
    let mut streams = Vec::new();
    for _ in 0..6 {
        let resp = send(&c, chat_req(&gw.url(), &body)).await;
        let mut b = resp.into_body();
        next_chunk(&mut b).await.unwrap();
        streams.push(b);
    }
    assert_eq!((s1.state.running(), s2.state.running()), (3, 3));
    // Finish two on whichever stub: the next requests go to the less loaded one.
    drop(streams.drain(..2));
    while s1.state.running() + s2.state.running() != 4 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let (r1, r2) = (s1.state.running(), s2.state.running());
    let diff = r1.abs_diff(r2);
    for _ in 0..diff / 2 {
        let resp = send(&c, chat_req(&gw.url(), &body)).await;
        let mut b = resp.into_body();
        next_chunk(&mut b).await.unwrap();
        streams.push(b);
    }
    assert_eq!(s1.state.running(), s2.state.running());
}

#[tokio::test]
async fn a_refused_endpoint_is_retried_until_a_working_one_appears() {
    let stub = stub().await;
    // A port nothing listens on.
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let backends = EndpointSet::fixed([dead.to_string().parse().unwrap()]);
    let gw = gateway(config(), backends.clone()).await;
    let c = client();
    let req = chat_req(&gw.url(), &chat(false));
    let task = tokio::spawn({
        let c = c.clone();
        async move { send_full(&c, req).await }
    });
    wait_demand(&gw, |s| s.pending() == 1).await;
    backends.replace([authority(&stub)]);
    let (status, _, _) = task.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let m = gateway_metrics(&c, &gw).await;
    assert!(
        metric(&m, "hearth_gateway_upstream_errors_total{kind=\"connect\"}").unwrap_or(0.0) >= 1.0,
        "{m}"
    );
}

#[tokio::test]
async fn drain_refuses_new_requests_and_lets_streams_finish() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    let mut body = chat(true);
    body["stub_token_delay"] = "20ms".into();
    body["max_tokens"] = 20.into();
    let resp = send(&c, chat_req(&gw.url(), &body)).await;
    let mut stream = resp.into_body();
    next_chunk(&mut stream).await.unwrap();
    let g = gw.gateway.clone();
    let drained = tokio::spawn(async move { g.drain().await });
    while !gw.gateway.is_draining() {
        tokio::task::yield_now().await;
    }
    let (status, _) = get(&c, &format!("{}/readyz", gw.url())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, headers, _) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers["connection"], "close");
    let rest = stream.collect().await.unwrap().to_bytes();
    assert!(rest.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(
        drained.await.unwrap(),
        0,
        "drain ended with nothing pending"
    );
}

#[tokio::test]
async fn terminating_endpoints_stop_receiving_requests_at_once() {
    let (s1, s2) = (stub().await, stub().await);
    let backends = EndpointSet::fixed([authority(&s1), authority(&s2)]);
    let gw = gateway(config(), backends.clone()).await;
    let c = client();
    backends.replace([authority(&s2)]);
    for _ in 0..4 {
        let (status, _, _) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
        assert_eq!(status, StatusCode::OK);
    }
    assert_eq!((s1.state.received(), s2.state.received()), (0, 4));
}

#[tokio::test]
async fn bursts_of_tokens_are_relayed_unchanged_warm_and_cold() {
    let stub = stub().await;
    let backends = EndpointSet::new();
    let gw = gateway(config(), backends.clone()).await;
    let c = client();
    // No delay between tokens: chunks arrive faster than they are written out, so the relay
    // joins them; the events must be exactly the backend's.
    let mut req = chat(true);
    req["max_tokens"] = 64.into();
    req["stub_token_delay"] = "0s".into();
    let url = |base: String| format!("{base}/v1/chat/completions");
    let direct = send_full(&c, post_req(&url(stub.url()), &req, &[])).await.2;
    let direct = normalize(&sse_events(&direct));
    assert_eq!(direct.len(), 66, "64 tokens, finish, [DONE]");

    // Cold: held with heartbeats, then forwarded.
    let resp = send(&c, post_req(&url(gw.url()), &req, &[])).await;
    let mut body = resp.into_body();
    let first = next_chunk(&mut body).await.unwrap();
    assert!(first.starts_with(b": "), "{first:?}");
    backends.replace([authority(&stub)]);
    let mut rest = Vec::new();
    while let Some(c) = next_chunk(&mut body).await {
        rest.extend_from_slice(&c);
    }
    let cold: Vec<String> = normalize(&sse_events(&rest))
        .into_iter()
        .filter(|e| !e.starts_with(": "))
        .collect();
    assert_eq!(cold, direct);

    // Warm, several times over one pooled connection.
    for _ in 0..5 {
        let warm = send_full(&c, post_req(&url(gw.url()), &req, &[])).await.2;
        assert!(warm.ends_with(b"data: [DONE]\n\n"));
        assert_eq!(normalize(&sse_events(&warm)), direct);
    }
    wait_demand(&gw, |s| s.pending() == 0).await;
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_requests_total{code=\"200\"}"),
        Some(6.0),
        "{m}"
    );
}

/// A client that never finishes its header section, or idles on a keep-alive connection, is
/// disconnected after the header-read timeout (enforced by the gateway's coarse timer).
#[tokio::test]
async fn slow_and_idle_clients_are_disconnected_after_the_header_read_timeout() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let stub = stub().await;
    let gw = gateway(
        GatewayConfig {
            header_read_timeout: Duration::from_secs(1),
            ..config()
        },
        EndpointSet::fixed([authority(&stub)]),
    )
    .await;
    // Half a header section, then nothing.
    let mut slow = tokio::net::TcpStream::connect(gw.http).await.unwrap();
    slow.write_all(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n")
        .await
        .unwrap();
    // A complete request, then an idle keep-alive connection.
    let mut idle = tokio::net::TcpStream::connect(gw.http).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n")
        .await
        .unwrap();
    let start = std::time::Instant::now();
    for (name, conn) in [("slow", &mut slow), ("idle", &mut idle)] {
        let mut buf = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut buf)).await;
        assert!(closed.is_ok(), "{name}: still open after 5 s");
        if name == "idle" {
            assert!(buf.starts_with(b"HTTP/1.1 200"), "{name}: {buf:?}");
        }
    }
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_millis(900),
        "closed too early: {waited:?}"
    );
}

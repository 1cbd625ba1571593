//! Adversarial tests of the gateway's backend connection handling: backends that close, reset,
//! answer without bodies, send trailers; clients that leave, crowd, or trickle their headers.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::{raw::*, *};
use hearth_gateway::{EndpointSet, GatewayConfig, RunningGateway};
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
    time::timeout,
};

const T: Duration = Duration::from_secs(10);

async fn gw_for(raw: &Raw, cfg: GatewayConfig) -> RunningGateway {
    gateway(cfg, EndpointSet::fixed([raw.authority()])).await
}

fn get_req(url: &str) -> Request<Full<Bytes>> {
    Request::get(url).body(Full::new(Bytes::new())).unwrap()
}

/// Sends and reads the whole body, failing on a hang.
async fn full(c: &HttpClient, req: Request<Full<Bytes>>) -> (StatusCode, http::HeaderMap, Bytes) {
    timeout(T, send_full(c, req)).await.expect("request hung")
}

/// Sends `n` requests made by `req(i)`, `pause(i)` after the previous one, and asserts that
/// every one was answered `200`, naming the first three that were not.
async fn all_ok(
    c: &HttpClient,
    n: u64,
    pause: impl Fn(u64) -> Duration,
    req: impl Fn(u64) -> Request<Full<Bytes>>,
) {
    let mut failures = Vec::new();
    for i in 0..n {
        tokio::time::sleep(pause(i)).await;
        let (s, _, b) = full(c, req(i)).await;
        if s != StatusCode::OK {
            failures.push((i, s, String::from_utf8_lossy(&b).into_owned()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {n} failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(3)]
    );
}

// ---- Backends that close their side ----

#[tokio::test]
async fn connection_close_response_then_next_request_succeeds() {
    let raw = raw_backend(|i, _| Reply::Close(ok(&format!("r{i}"), "Connection: close\r\n"))).await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    for i in 0..30 {
        let (s, h, b) = full(&c, get_req(&format!("{}/x", gw.url()))).await;
        assert_eq!(s, StatusCode::OK, "request {i}: {b:?}");
        assert_eq!(b, format!("r{i}"), "request {i}");
        assert!(
            h.get("connection").is_none(),
            "hop-by-hop Connection leaked: {h:?}"
        );
    }
    assert_eq!(raw.count(), 30, "each request reached the backend once");
}

#[tokio::test]
async fn backend_closes_after_each_response_without_connection_close() {
    let raw = raw_backend(|i, _| Reply::Close(ok(&format!("r{i}"), ""))).await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    all_ok(
        &c,
        100,
        |_| Duration::ZERO,
        |_| post_req(&format!("{}/v1/completions", gw.url()), &chat(false), &[]),
    )
    .await;
    assert_eq!(raw.count(), 100, "no POST sent twice");
}

#[tokio::test]
async fn backend_resets_after_each_response() {
    let raw = raw_backend(|i, _| Reply::Reset(ok(&format!("r{i}"), ""))).await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    all_ok(
        &c,
        100,
        |_| Duration::ZERO,
        |_| get_req(&format!("{}/x", gw.url())),
    )
    .await;
}

/// The backend's idle timeout races the gateway's reuse (GET: resent when the reused connection
/// closes under it): the backend closes a kept-alive
/// connection 30 ms after its response; the gateway's requests arrive around that moment.
#[tokio::test]
async fn backend_idle_close_race() {
    let raw =
        raw_backend(|i, _| Reply::CloseAfter(ok(&format!("r{i}"), ""), Duration::from_millis(30)))
            .await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    // 25..35 ms between requests.
    let pause = |i: u64| Duration::from_millis(25 + (i * 7) % 11);
    all_ok(&c, 150, pause, |i| get_req(&format!("{}/x?{i}", gw.url()))).await;
}

// ---- the backend dies mid-body ----

#[tokio::test]
async fn backend_closes_mid_body() {
    for reset in [false, true] {
        let raw = raw_backend(move |i, _| {
            if i % 2 == 0 {
                let b = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789".to_vec();
                if reset {
                    Reply::Reset(b)
                } else {
                    Reply::Close(b)
                }
            } else {
                Reply::Keep(ok("fine", ""))
            }
        })
        .await;
        let gw = gw_for(&raw, config()).await;
        let c = client();
        for round in 0..10 {
            let resp = timeout(T, c.request(get_req(&format!("{}/x", gw.url()))))
                .await
                .expect("head hung");
            // An error before the head (the gateway gave up on the connection) is acceptable.
            if let Ok(resp) = resp {
                assert_eq!(resp.status(), StatusCode::OK);
                let r = timeout(T, resp.into_body().collect())
                    .await
                    .expect("body hung");
                assert!(
                    r.is_err(),
                    "reset={reset} round {round}: truncated body read as complete: {:?}",
                    r.map(|c| c.to_bytes())
                );
            }
            let (s, _, b) = full(&c, get_req(&format!("{}/y", gw.url()))).await;
            assert_eq!(
                s,
                StatusCode::OK,
                "reset={reset} round {round}: next request: {b:?}"
            );
            assert_eq!(b, "fine");
        }
    }
}

/// Backend reads the request and closes without answering: 502, and the POST was not resent.
#[tokio::test]
async fn request_read_then_closed_is_not_resent() {
    let raw = raw_backend(|i, _| {
        if i == 0 {
            Reply::Keep(ok("first", ""))
        } else {
            Reply::Close(Vec::new())
        }
    })
    .await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    let (s, _, _) = full(
        &c,
        post_req(&format!("{}/v1/completions", gw.url()), &chat(false), &[]),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    let (s, _, b) = full(
        &c,
        post_req(&format!("{}/v1/completions", gw.url()), &chat(false), &[]),
    )
    .await;
    assert_eq!(s, StatusCode::BAD_GATEWAY, "{b:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        raw.count(),
        2,
        "the second POST reached the backend exactly once"
    );
}

// ---- responses without a body ----

#[tokio::test]
async fn bodiless_responses_reuse_the_connection() {
    let raw = raw_backend(|_, head| {
        let line = head.lines().next().unwrap_or_default().to_owned();
        let b = if line.starts_with("HEAD ") {
            b"HTTP/1.1 200 OK\r\nContent-Length: 12345\r\nContent-Type: text/plain\r\n\r\n".to_vec()
        } else if line.contains("/204") {
            b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n".to_vec()
        } else if line.contains("/304") {
            b"HTTP/1.1 304 Not Modified\r\nETag: \"e\"\r\nContent-Length: 999\r\n\r\n".to_vec()
        } else if line.contains("/empty") {
            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n".to_vec()
        } else {
            ok("body", "")
        };
        Reply::Keep(b)
    })
    .await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    for round in 0..5 {
        let (s, h, b) = full(
            &c,
            Request::head(format!("{}/h", gw.url()))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
        assert_eq!(s, StatusCode::OK, "round {round}");
        assert!(b.is_empty());
        assert_eq!(
            h.get("content-length").map(|v| v.to_str().unwrap()),
            Some("12345"),
            "HEAD keeps the length: {h:?}"
        );
        let (s, _, b) = full(&c, get_req(&format!("{}/204", gw.url()))).await;
        assert_eq!(s, StatusCode::NO_CONTENT);
        assert!(b.is_empty());
        let (s, _, b) = full(&c, get_req(&format!("{}/304", gw.url()))).await;
        assert_eq!(s, StatusCode::NOT_MODIFIED);
        assert!(b.is_empty());
        let (s, _, b) = full(&c, get_req(&format!("{}/empty", gw.url()))).await;
        assert_eq!(s, StatusCode::OK);
        assert!(b.is_empty());
        let (s, _, b) = full(&c, get_req(&format!("{}/x", gw.url()))).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(b, "body");
    }
    assert_eq!(raw.count(), 25);
    assert_eq!(
        raw.conns(),
        1,
        "sequential bodiless exchanges share one backend connection"
    );
}

// ---- chunked, trailers, SSE ----

#[tokio::test]
async fn chunked_with_trailers_passes_bytes_and_reuses() {
    let raw = raw_backend(|_, _| {
        Reply::Pieces(
            vec![
                b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\nTrailer: x-checksum\r\n\r\n".to_vec(),
                b"5\r\nhello\r\n".to_vec(),
                b"6\r\n world\r\n".to_vec(),
                b"0\r\nx-checksum: abc\r\n\r\n".to_vec(),
            ],
            Duration::from_millis(5),
        )
    })
    .await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    for i in 0..5 {
        let (s, _, b) = full(&c, get_req(&format!("{}/t", gw.url()))).await;
        assert_eq!(s, StatusCode::OK, "{i}");
        assert_eq!(b, "hello world", "{i}");
    }
    // with TE: trailers the trailers may be relayed
    let (s, _, b) = full(
        &c,
        Request::get(format!("{}/t", gw.url()))
            .header("te", "trailers")
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(b, "hello world");
    assert_eq!(raw.count(), 6);
    let m = gateway_metrics(&c, &gw).await;
    let canceled = metric(&m, "hearth_gateway_requests_canceled_total").unwrap_or(0.0);
    let conns = raw.conns();
    assert!(
        canceled == 0.0 && conns == 1,
        "complete trailer responses: {canceled} counted as canceled, {conns} backend connections for 6 sequential requests (want 0 and 1)"
    );
}

#[tokio::test]
async fn chunked_sse_bytes_unchanged() {
    let events: Vec<String> = (0..40)
        .map(|i| format!("data: {{\"n\":{i}}}\n\n"))
        .collect();
    let expected: String = events.concat() + "data: [DONE]\n\n";
    let ev = events.clone();
    let raw = raw_backend(move |_, _| {
        let mut pieces = vec![b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec()];
        for e in ev.iter().chain(std::iter::once(&"data: [DONE]\n\n".to_owned())) {
            pieces.push(format!("{:x}\r\n{e}\r\n", e.len()).into_bytes());
        }
        pieces.push(b"0\r\n\r\n".to_vec());
        Reply::Pieces(pieces, Duration::from_millis(1))
    })
    .await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    for i in 0..5 {
        let (s, h, b) = full(&c, chat_req(&gw.url(), &chat(true))).await;
        assert_eq!(s, StatusCode::OK);
        assert_eq!(h["content-type"], "text/event-stream");
        assert_eq!(String::from_utf8_lossy(&b), expected, "round {i}");
    }
    assert_eq!(raw.conns(), 1);
}

// ---- clients that leave mid-stream ----

#[tokio::test]
async fn fifty_client_disconnects_mid_stream() {
    let stub = long_stub(Duration::from_millis(10)).await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    for i in 0..50 {
        // A fresh client each time, so the client connection is really closed.
        let c = client();
        let resp = timeout(T, c.request(chat_req(&gw.url(), &chat(true))))
            .await
            .expect("hung")
            .unwrap();
        assert_eq!(resp.status(), StatusCode::OK, "{i}");
        let mut body = resp.into_body();
        timeout(T, next_chunk(&mut body))
            .await
            .expect("first chunk hung")
            .expect("no chunk");
        drop(body);
        drop(c);
    }
    let start = Instant::now();
    while stub.state.running() > 0 && start.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(stub.state.running(), 0, "backend saw every cancellation");
    let c = client();
    let mut short = chat(false);
    short["max_tokens"] = serde_json::json!(5);
    for i in 0..10 {
        let (s, _, b) = full(&c, chat_req(&gw.url(), &short)).await;
        assert_eq!(s, StatusCode::OK, "after disconnects {i}: {b:?}");
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["object"], "chat.completion");
    }
    assert_eq!(stub.state.received(), 60);
}

/// Same with a raw streaming backend: count connections; a cancelled stream must not be reused.
#[tokio::test]
async fn disconnect_mid_stream_raw_backend_no_broken_reuse() {
    let raw = raw_backend(|_, head| {
        if head.contains("/slow") {
            let mut pieces = vec![b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec()];
            for _ in 0..200 {
                pieces.push(b"8\r\ndata: x\n\r\n".to_vec());
            }
            pieces.push(b"0\r\n\r\n".to_vec());
            Reply::Pieces(pieces, Duration::from_millis(10))
        } else {
            Reply::Keep(ok("fine", ""))
        }
    })
    .await;
    let gw = gw_for(&raw, config()).await;
    for i in 0..20 {
        let c = client();
        let resp = timeout(T, c.request(get_req(&format!("{}/slow", gw.url()))))
            .await
            .expect("hung")
            .unwrap();
        let mut body = resp.into_body();
        timeout(T, next_chunk(&mut body))
            .await
            .expect("chunk hung")
            .expect("no chunk");
        drop(body);
        drop(c);
        // the next request must not land on the half-read connection
        let c = client();
        let (s, _, b) = full(&c, get_req(&format!("{}/ok", gw.url()))).await;
        assert_eq!(s, StatusCode::OK, "{i}");
        assert_eq!(b, "fine", "{i}: got bytes of the abandoned stream?");
    }
}

// ---- concurrency ----

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_hundred_concurrent_then_sequential() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    let mut tasks = Vec::new();
    for i in 0..200 {
        let (c, url) = (c.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let (s, _, b) = full(&c, post_req(&url, &chat(i % 2 == 0), &[])).await;
            (s, b)
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        let (s, b) = t.await.unwrap();
        assert_eq!(s, StatusCode::OK, "{i}: {b:?}");
        if i % 2 == 0 {
            assert!(b.ends_with(b"data: [DONE]\n\n"), "{i}");
        }
    }
    for i in 0..50 {
        let (s, _, b) = full(&c, post_req(&url, &chat(false), &[])).await;
        assert_eq!(s, StatusCode::OK, "seq {i}: {b:?}");
    }
    assert_eq!(stub.state.received(), 250);
}

// ---- hop-by-hop fields ----

/// Sends raw bytes to the gateway and reads one response (head + Content-Length/close body).
async fn raw_exchange(addr: SocketAddr, req: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(req).await.unwrap();
    let mut buf = Vec::new();
    let r = timeout(T, async {
        let mut tmp = [0u8; 4096];
        loop {
            if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                if let Some(len) = head.lines().find_map(|l| {
                    l.strip_prefix("content-length:")
                        .map(|v| v.trim().parse::<usize>().unwrap())
                }) && buf.len() >= end + 4 + len
                {
                    return;
                }
            }
            let n = s.read(&mut tmp).await.unwrap_or(0);
            if n == 0 {
                return;
            }
            buf.extend_from_slice(&tmp[..n]);
        }
    })
    .await;
    r.expect("raw exchange hung");
    String::from_utf8_lossy(&buf).into_owned()
}

#[tokio::test]
async fn hop_by_hop_fields_do_not_reach_the_backend() {
    let raw = raw_backend(|_, _| {
        Reply::Keep(ok(
            "hi",
            "Connection: x-internal, keep-alive\r\nX-Internal: secret\r\nKeep-Alive: timeout=5\r\nProxy-Connection: keep-alive\r\nX-End: kept\r\n",
        ))
    })
    .await;
    let gw = gw_for(&raw, config()).await;
    let resp = raw_exchange(
        gw.http,
        b"GET /v1/models HTTP/1.1\r\nHost: gw.example\r\nConnection: x-secret, keep-alive\r\nConnection: X-Other\r\nx-secret: 1\r\nx-other: 2\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nUpgrade: foo\r\nProxy-Connection: keep-alive\r\nAuthorization: Bearer k\r\nX-Forwarded-For: 1.2.3.4\r\nX-End: e2e\r\n\r\n",
    )
    .await;
    let lower = resp.to_lowercase();
    assert!(lower.starts_with("http/1.1 200"), "{resp}");
    assert!(lower.ends_with("\r\n\r\nhi"), "{resp}");
    for bad in ["x-internal", "keep-alive:", "proxy-connection"] {
        assert!(!lower.contains(bad), "response leaked {bad}: {resp}");
    }
    assert!(lower.contains("x-end: kept"), "{resp}");

    let (head, _) = raw.reqs.lock().unwrap()[0].clone();
    let h = head.to_lowercase();
    let names: Vec<&str> = h
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':').map(|(k, _)| k.trim()))
        .collect();
    for bad in [
        "connection",
        "x-secret",
        "x-other",
        "keep-alive",
        "te",
        "upgrade",
        "proxy-connection",
    ] {
        assert!(!names.contains(&bad), "backend got {bad}: {head}");
    }
    assert!(h.contains("\r\nauthorization: bearer k"), "{head}");
    assert!(h.contains("\r\nx-end: e2e"), "{head}");
    assert!(
        h.contains("\r\nx-forwarded-for: 1.2.3.4, 127.0.0.1"),
        "{head}"
    );
    assert!(h.contains("\r\nx-forwarded-host: gw.example"), "{head}");
    assert!(h.contains(&format!("\r\nhost: {}", raw.addr)), "{head}");
    assert_eq!(names.iter().filter(|n| **n == "host").count(), 1, "{head}");
}

// ---- header-read timeout ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slowloris_is_cut_off_and_others_are_served() {
    let stub = stub().await;
    let gw = gateway(
        GatewayConfig {
            header_read_timeout: Duration::from_secs(1),
            ..config()
        },
        EndpointSet::fixed([authority(&stub)]),
    )
    .await;
    let addr = gw.http;
    let slow = tokio::spawn(async move {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let start = Instant::now();
        let req = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n";
        for b in req.iter().cycle().take(200) {
            if s.write_all(&[*b]).await.is_err() {
                return start.elapsed();
            }
            // A closed peer shows as EOF or an error on read.
            let mut tmp = [0u8; 1024];
            match timeout(Duration::from_millis(200), s.read(&mut tmp)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return start.elapsed(),
                Ok(Ok(_)) => return start.elapsed(), // got a response (e.g. 408): also cut off
                Err(_) => {}
            }
        }
        start.elapsed()
    });
    let idle = tokio::spawn(async move {
        // A connection that sends nothing at all.
        let mut s = TcpStream::connect(addr).await.unwrap();
        let start = Instant::now();
        let mut tmp = [0u8; 64];
        let _ = timeout(Duration::from_secs(10), s.read(&mut tmp)).await;
        start.elapsed()
    });
    let c = client();
    let url = format!("{}/v1/chat/completions", gw.url());
    for i in 0..20 {
        let t = Instant::now();
        let (s, _, _) = full(&c, post_req(&url, &chat(false), &[])).await;
        assert_eq!(s, StatusCode::OK, "{i}");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "normal client slowed: {:?}",
            t.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let took = slow.await.unwrap();
    assert!(
        took >= Duration::from_millis(900) && took <= Duration::from_millis(3200),
        "slowloris cut off after {took:?}"
    );
    let took = idle.await.unwrap();
    assert!(
        took <= Duration::from_millis(3200),
        "silent connection cut off after {took:?}"
    );
    // The normal client's keep-alive connection, idle now: a new request still works.
    let (s, _, _) = full(&c, post_req(&url, &chat(false), &[])).await;
    assert_eq!(s, StatusCode::OK);
}

/// A request whose header section is complete but whose body trickles: not the header timeout;
/// the request should still succeed (or at least not hang forever).
#[tokio::test]
async fn slow_body_after_complete_headers() {
    let stub = stub().await;
    let gw = gateway(
        GatewayConfig {
            header_read_timeout: Duration::from_secs(1),
            ..config()
        },
        EndpointSet::fixed([authority(&stub)]),
    )
    .await;
    let body = chat(false).to_string();
    let mut s = TcpStream::connect(gw.http).await.unwrap();
    s.write_all(
        format!("POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n", body.len()).as_bytes(),
    )
    .await
    .unwrap();
    for chunk in body.as_bytes().chunks(body.len() / 6 + 1) {
        tokio::time::sleep(Duration::from_millis(400)).await;
        s.write_all(chunk).await.unwrap();
    }
    let mut buf = Vec::new();
    let _ = timeout(T, async {
        let mut tmp = [0u8; 4096];
        loop {
            let n = s.read(&mut tmp).await.unwrap_or(0);
            if n == 0 {
                return;
            }
            buf.extend_from_slice(&tmp[..n]);
            if buf.windows(15).any(|w| w == b"chat.completion") {
                return;
            }
        }
    })
    .await;
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
}

// ---- other ----

/// 50 POSTs with unique bodies against a backend closing after each response and a backend
/// with an idle-close race: no body reaches the backend twice.
#[tokio::test]
async fn no_post_sent_twice() {
    let raw = raw_backend(|i, _| {
        if i % 3 == 0 {
            Reply::Close(ok("c", ""))
        } else {
            Reply::CloseAfter(ok("k", ""), Duration::from_millis(5))
        }
    })
    .await;
    // A POST is never resent, so the gateway must stop reusing a connection before the
    // backend's idle timeout (5 ms here) closes it.
    let gw = gw_for(
        &raw,
        GatewayConfig {
            backend_idle_timeout: Duration::from_millis(2),
            ..config()
        },
    )
    .await;
    let c = client();
    let mut statuses = Vec::new();
    for i in 0..60u64 {
        tokio::time::sleep(Duration::from_millis(i % 8)).await;
        let (s, _, _) = full(
            &c,
            post_req(
                &format!("{}/v1/completions", gw.url()),
                &serde_json::json!({"id": i}),
                &[],
            ),
        )
        .await;
        statuses.push(s);
    }
    let bodies: Vec<Vec<u8>> = raw
        .reqs
        .lock()
        .unwrap()
        .iter()
        .map(|(_, b)| b.clone())
        .collect();
    let mut sorted = bodies.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(
        sorted.len(),
        bodies.len(),
        "some POST reached the backend twice"
    );
    let bad = statuses.iter().filter(|s| **s != StatusCode::OK).count();
    assert_eq!(bad, 0, "{bad} of 60 failed: {statuses:?}");
}

/// A slow reader on the client side while the backend sends a large body: nothing hangs and the
/// bytes arrive whole.
#[tokio::test]
async fn large_body_slow_client() {
    let big: String = (0..200_000)
        .map(|i| char::from(b'a' + (i % 26) as u8))
        .collect();
    let b2 = big.clone();
    let raw = raw_backend(move |_, _| Reply::Keep(ok(&b2, ""))).await;
    let gw = gw_for(&raw, config()).await;
    let c = client();
    for _ in 0..3 {
        let resp = timeout(T, c.request(get_req(&format!("{}/big", gw.url()))))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            resp.headers()["content-length"],
            big.len().to_string().as_str()
        );
        let mut body = resp.into_body();
        let mut got = Vec::new();
        while let Some(f) = timeout(T, body.frame()).await.expect("hung") {
            got.extend_from_slice(&f.unwrap().into_data().unwrap());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert_eq!(got.len(), big.len());
        assert!(got == big.as_bytes());
    }
    assert_eq!(raw.conns(), 1);
}

/// The client leaves while the gateway still waits for the backend's response head (a long
/// non-streaming completion): the backend must see the cancellation, and later requests work.
#[tokio::test]
async fn client_leaves_before_response_head() {
    let stub = long_stub(Duration::from_millis(10)).await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    for _ in 0..10 {
        let c = client();
        let r = timeout(
            Duration::from_millis(150),
            c.request(chat_req(&gw.url(), &chat(false))),
        )
        .await;
        assert!(r.is_err(), "a 10 s completion answered in 150 ms?");
        drop(c);
    }
    let start = Instant::now();
    while stub.state.running() > 0 && start.elapsed() < Duration::from_secs(3) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        stub.state.running(),
        0,
        "backend still generating for clients that left"
    );
    let mut short = chat(false);
    short["max_tokens"] = serde_json::json!(3);
    let c = client();
    for i in 0..5 {
        let (s, _, b) = full(&c, chat_req(&gw.url(), &short)).await;
        assert_eq!(s, StatusCode::OK, "{i}: {b:?}");
    }
}

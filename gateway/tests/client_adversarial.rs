//! Adversarial tests of the client side: exact bytes a client (or a load balancer in front)
//! can send, and what reaches the backend. Framing (RFC 9112), the fields a gateway owns
//! (`Host`, `X-Forwarded-*`, `Via`, `Expect`), methods it must not forward, and request bodies
//! that arrive slowly, in pieces or broken.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{raw::*, *};
use hearth_gateway::{EndpointSet, GatewayConfig, RunningGateway};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

/// A raw backend answering `200 ok` to everything, keeping its connections.
async fn echo_backend() -> Raw {
    raw_backend(|_, _| Reply::Keep(ok("ok", ""))).await
}

async fn gw(raw: &Raw, cfg: GatewayConfig) -> RunningGateway {
    gateway(cfg, EndpointSet::fixed([raw.authority()])).await
}

/// Writes `req` as it is and reads until the gateway closes the connection (every request
/// here ends with `Connection: close`, or is one the gateway answers by closing).
async fn exchange(g: &RunningGateway, req: &[u8]) -> String {
    let mut s = TcpStream::connect(g.http).await.unwrap();
    s.write_all(req).await.unwrap();
    let mut out = Vec::new();
    within(10, "the gateway's answer", s.read_to_end(&mut out))
        .await
        .unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

/// The head the backend received for its request `i`, lowercased.
fn received(raw: &Raw, i: usize) -> String {
    raw.reqs.lock().unwrap()[i].0.to_ascii_lowercase()
}

/// Whether `head` has the field line `line` (lowercase).
fn has_line(head: &str, line: &str) -> bool {
    head.lines().any(|l| l == line)
}

#[tokio::test]
async fn connect_and_trace_are_refused_with_allow() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    for req in [
        "CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n",
        "TRACE /v1/models HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer secret\r\n\r\n",
    ] {
        let resp = exchange(&g, req.as_bytes()).await;
        assert!(resp.starts_with("HTTP/1.1 405"), "{req:?}: {resp}");
        let lower = resp.to_ascii_lowercase();
        assert!(lower.contains("allow: get, head, post"), "{resp}");
        assert!(lower.contains("connection: close"), "{resp}");
        assert!(resp.contains(r#""code":"method_not_allowed""#), "{resp}");
        assert!(
            !resp.contains("secret"),
            "TRACE must not echo credentials: {resp}"
        );
    }
    assert_eq!(raw.count(), 0, "nothing may reach the backend");
}

#[tokio::test]
async fn host_follows_rfc_9112() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    for (req, why) in [
        ("GET /v1/models HTTP/1.1\r\n\r\n", "no Host"),
        (
            "GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
            "two Host lines",
        ),
        (
            "GET /v1/models HTTP/1.1\r\nHost: user:pw@a\r\n\r\n",
            "user info",
        ),
        ("GET /v1/models HTTP/1.1\r\nHost: a/b\r\n\r\n", "a path"),
        (
            "GET /v1/models HTTP/1.1\r\nHost: a:1:2\r\n\r\n",
            "two ports",
        ),
        (
            "GET /v1/models HTTP/1.1\r\nHost: ::1\r\n\r\n",
            "an unbracketed IPv6 address",
        ),
        (
            "GET http://user:secret@x.example/v1/models HTTP/1.1\r\nHost: x.example\r\n\r\n",
            "user info in the target",
        ),
    ] {
        let resp = exchange(&g, req.as_bytes()).await;
        assert!(resp.starts_with("HTTP/1.1 400"), "{why}: {resp}");
        assert!(
            resp.contains("Host") || resp.contains("user info"),
            "{why}: the error names the field: {resp}"
        );
        assert!(!resp.contains("secret"), "{resp}");
    }
    assert_eq!(raw.count(), 0);
    // What real clients send is accepted: an empty Host (a target without an authority, RFC
    // 9112 §3.2), IP literals with a zone, percent-encoding, a trailing dot, an empty port.
    for host in [
        "",
        "[::1]:8080",
        "[fe80::1%25eth0]",
        "ex%41mple.com",
        "svc.ns.svc.cluster.local.",
        "A.Example:8080",
        "a:",
    ] {
        let req = format!("GET /v1/models HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let resp = exchange(&g, req.as_bytes()).await;
        assert!(resp.starts_with("HTTP/1.1 200"), "Host {host:?}: {resp}");
    }
    let empty = received(&raw, 0);
    assert!(
        !empty.contains("x-forwarded-host"),
        "an empty Host is no host: {empty}"
    );
    // HTTP/1.0 needs no Host: forwarded, with Via naming the client's version.
    let resp = exchange(&g, b"GET /v1/models HTTP/1.0\r\n\r\n").await;
    assert!(
        resp.starts_with("HTTP/1.0 200") || resp.starts_with("HTTP/1.1 200"),
        "{resp}"
    );
    let head = received(&raw, raw.count() - 1);
    assert!(head.contains("via: 1.0 hearth-gateway"), "{head}");
    assert!(!head.contains("x-forwarded-host"), "{head}");
}

#[tokio::test]
async fn a_transfer_coding_other_than_chunked_is_not_implemented() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    let resp = exchange(
        &g,
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 501"), "{resp}");
    assert!(resp.contains("unsupported_transfer_coding"), "{resp}");
    assert_eq!(raw.count(), 0, "a still-encoded body must not be forwarded");
    // Empty list elements are ignored (RFC 9110 §5.6.1.2): this is chunked.
    let resp = exchange(
        &g,
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: ,chunked\r\nConnection: close\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert_eq!(raw.reqs.lock().unwrap()[0].1, b"hi");
}

#[tokio::test]
async fn two_authorization_lines_are_refused() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    let resp = exchange(
        &g,
        b"GET /v1/models HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer k1\r\nAuthorization: Bearer k2\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(resp.contains("Authorization"), "{resp}");
    assert_eq!(raw.count(), 0);
}

#[tokio::test]
async fn forwarded_fields_are_the_gateways_view() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    let resp = exchange(
        &g,
        b"POST http://target.example/v1/completions HTTP/1.1\r\nHost: a\r\n\
          X-Forwarded-For: 6.6.6.6\r\nX-Forwarded-For: 203.0.113.7\r\n\
          X-Forwarded-Host: evil.example\r\nProxy-Authorization: Basic eDp5\r\n\
          Expect: 100-continue\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    .await;
    assert!(resp.contains("HTTP/1.1 200"), "{resp}");
    let head = received(&raw, 0);
    assert!(head.starts_with("post /v1/completions http/1.1"), "{head}");
    // Every line the client sent, in order, then the client (RFC 9110 §5.3).
    assert!(
        has_line(&head, "x-forwarded-for: 6.6.6.6, 203.0.113.7, 127.0.0.1"),
        "{head}"
    );
    // The absolute-form target's authority wins over Host (RFC 9112 §3.2.2).
    assert!(
        has_line(&head, "x-forwarded-host: target.example"),
        "{head}"
    );
    assert!(!head.contains("evil.example"), "{head}");
    assert!(!head.contains("proxy-authorization"), "{head}");
    assert!(
        !head.contains("expect:"),
        "the gateway met the expectation: {head}"
    );
    assert!(head.contains("via: 1.1 hearth-gateway"), "{head}");

    // An empty POST still says how long its body is (RFC 9110 §8.6).
    exchange(
        &g,
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    let head = received(&raw, 1);
    assert!(has_line(&head, "content-length: 0"), "{head}");
}

#[tokio::test]
async fn a_stalled_body_gets_408_and_the_connection_closes() {
    let raw = echo_backend().await;
    let cfg = GatewayConfig {
        body_read_timeout: Duration::from_secs(1),
        ..config()
    };
    let g = gw(&raw, cfg).await;
    let started = Instant::now();
    let resp = exchange(
        &g,
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{\"model\":",
    )
    .await;
    let took = started.elapsed();
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("connection: close"),
        "{resp}"
    );
    assert!(resp.contains("--body-read-timeout"), "{resp}");
    // One second, enforced to within one more.
    assert!(
        took >= Duration::from_secs(1) && took < Duration::from_secs(4),
        "{took:?}"
    );
    assert_eq!(raw.count(), 0);
    let m = gateway_metrics(&client(), &g).await;
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_rejections_total{reason=\"body_timeout\"}"
        ),
        Some(1.0),
        "{m}"
    );
}

#[tokio::test]
async fn a_body_of_tiny_chunks_arrives_whole() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    let n = 20_000;
    let mut req = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n".to_vec();
    for _ in 0..n {
        req.extend_from_slice(b"1\r\nx\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let resp = exchange(&g, &req).await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    let (head, body) = raw.reqs.lock().unwrap()[0].clone();
    assert!(
        has_line(&head.to_ascii_lowercase(), &format!("content-length: {n}")),
        "{head}"
    );
    assert_eq!(body, vec![b'x'; n]);
}

#[tokio::test]
async fn a_broken_chunk_is_a_400_not_a_cancellation() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    let resp = exchange(
        &g,
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert_eq!(raw.count(), 0);
    let m = gateway_metrics(&client(), &g).await;
    assert_eq!(
        metric(&m, "hearth_gateway_requests_total{code=\"400\"}"),
        Some(1.0),
        "{m}"
    );
    assert_eq!(
        metric(&m, "hearth_gateway_requests_canceled_total"),
        Some(0.0),
        "{m}"
    );
}

#[tokio::test]
async fn head_is_never_held_as_a_stream_while_cold() {
    let cfg = GatewayConfig {
        served_model_names: vec!["m".to_owned()],
        activation_timeout: Duration::from_secs(1),
        ..config()
    };
    let g = gateway(cfg, EndpointSet::new()).await;
    // The model list is answered locally, for HEAD as for GET, and raises no demand.
    let resp = exchange(
        &g,
        b"HEAD /v1/models HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert_eq!(g.gateway.demand().state().local(), 0);
    // A HEAD with a streaming body is not a stream: held silently, then the timeout's 503.
    let resp = exchange(
        &g,
        b"HEAD /v1/chat/completions HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n\
          Content-Length: 27\r\nConnection: close\r\n\r\n{\"model\":\"m\",\"stream\":true}",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    assert!(!resp.contains("text/event-stream"), "{resp}");
}

#[tokio::test]
async fn bodies_past_the_memory_limit_are_refused_not_buffered() {
    let cfg = GatewayConfig {
        body_limit: 1000,
        body_memory_limit: 2000,
        ..config()
    };
    let g = gateway(cfg, EndpointSet::new()).await;
    let req = |close: &str| {
        format!(
            "POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Type: text/plain\r\n\
             Content-Length: 1000\r\n{close}\r\n{}",
            "x".repeat(1000)
        )
    };
    // Two cold requests held, their bodies kept: the limit is reached.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(g.http).await.unwrap();
        s.write_all(req("").as_bytes()).await.unwrap();
        held.push(s);
    }
    within(
        10,
        "two requests held",
        wait_demand(&g, |s| s.pending() == 2),
    )
    .await;
    let resp = exchange(&g, req("Connection: close\r\n").as_bytes()).await;
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    assert!(resp.to_ascii_lowercase().contains("retry-after:"), "{resp}");
    assert!(resp.contains("--body-memory-limit"), "{resp}");
    let c = client();
    let m = gateway_metrics(&c, &g).await;
    assert_eq!(
        metric(&m, "hearth_gateway_request_body_bytes"),
        Some(2000.0),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_rejections_total{reason=\"body_memory\"}"
        ),
        Some(1.0),
        "{m}"
    );
    // A client that leaves gives its bytes back; the next request is held again.
    drop(held.pop());
    within(10, "the left request's bytes given back", async {
        loop {
            let m = gateway_metrics(&c, &g).await;
            if metric(&m, "hearth_gateway_request_body_bytes") == Some(1000.0) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let mut s = TcpStream::connect(g.http).await.unwrap();
    s.write_all(req("").as_bytes()).await.unwrap();
    within(10, "held again", wait_demand(&g, |s| s.pending() == 2)).await;
}

#[tokio::test]
async fn a_wrong_method_on_an_own_endpoint_gets_an_openai_error() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    let resp = exchange(
        &g,
        b"POST /hearth/queue HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 405"), "{resp}");
    assert!(
        resp.to_ascii_lowercase().contains("allow: get, head"),
        "{resp}"
    );
    assert!(resp.contains(r#""code":"method_not_allowed""#), "{resp}");
    assert_eq!(raw.count(), 0);
}

#[tokio::test]
async fn a_declared_length_counts_against_the_budget_before_it_arrives() {
    let cfg = GatewayConfig {
        body_limit: 1000,
        body_memory_limit: 1500,
        ..config()
    };
    let g = gateway(cfg, EndpointSet::new()).await;
    // One upload declared at 1000 bytes has sent one byte and waits.
    let mut first = TcpStream::connect(g.http).await.unwrap();
    first
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\nx")
        .await
        .unwrap();
    let c = client();
    within(10, "the first upload's bytes taken", async {
        while metric(
            &gateway_metrics(&c, &g).await,
            "hearth_gateway_request_body_bytes",
        ) != Some(1000.0)
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // A second of the same size does not fit, though only one byte of the first is here.
    let resp = exchange(
        &g,
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\nConnection: close\r\n\r\nx",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    assert!(resp.contains("body_memory"), "{resp}");
    drop(first);
}

#[tokio::test]
async fn a_body_that_completes_after_the_drain_began_is_not_admitted() {
    let raw = echo_backend().await;
    let g = gw(&raw, config()).await;
    let mut s = TcpStream::connect(g.http).await.unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    g.gateway.start_drain();
    s.write_all(b"}").await.unwrap();
    let mut out = Vec::new();
    within(10, "the answer", s.read_to_end(&mut out))
        .await
        .unwrap();
    let resp = String::from_utf8_lossy(&out);
    assert!(resp.starts_with("HTTP/1.1 503"), "{resp}");
    assert!(resp.contains("draining"), "{resp}");
    assert_eq!(raw.count(), 0);
    assert_eq!(g.gateway.demand().state().pending(), 0);
}

#[tokio::test]
async fn a_request_that_comes_back_to_the_gateway_is_a_loop_not_a_queue() {
    let g = gateway(config(), EndpointSet::new()).await;
    // A backend that leads back to the gateway itself.
    g.gateway
        .backends()
        .replace([g.http.to_string().parse().unwrap()]);
    let resp = exchange(
        &g,
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    )
    .await;
    assert!(resp.starts_with("HTTP/1.1 508"), "{resp}");
    assert!(resp.contains("loop_detected"), "{resp}");
    assert_eq!(g.gateway.demand().state().pending(), 0);
    let m = gateway_metrics(&client(), &g).await;
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_rejections_total{reason=\"loop_detected\"}"
        ),
        Some(1.0),
        "one hop refused, the other forwarded: {m}"
    );
}

//! The backend connection pool against the real vllm-stub: reuse, a backend that closed its
//! side, a client that leaves mid-stream, idle expiry, connect errors. The response body drives
//! its connection (no task of its own) and returns it to the pool when read to its end.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use hearth_gateway::upstream::UpstreamBody;
use hearth_gateway::upstream::UpstreamPool;
use http::{Request, header};
use http_body_util::{BodyExt, Full};

fn pool(idle: Duration) -> UpstreamPool {
    UpstreamPool::new(Duration::from_secs(2), idle)
}

fn request(authority: &http::uri::Authority, body: serde_json::Value) -> Request<Full<Bytes>> {
    Request::post("/v1/chat/completions")
        .header(header::HOST, authority.as_str())
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

/// One exchange, read to its end (which returns the connection to the pool).
async fn exchange(pool: &UpstreamPool, a: &http::uri::Authority) -> Bytes {
    let resp = pool.send(a, request(a, chat(false))).await.unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    resp.into_body().collect().await.unwrap().to_bytes()
}

#[tokio::test]
async fn sequential_exchanges_share_one_connection() {
    let stub = stub().await;
    let a = authority(&stub);
    let pool = pool(Duration::from_secs(60));
    for _ in 0..5 {
        let body = exchange(&pool, &a).await;
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["object"], "chat.completion");
    }
    assert_eq!(pool.idle_count(&a), 1, "one connection, reused");
    assert_eq!(stub.state.received(), 5);
}

#[tokio::test]
async fn concurrent_exchanges_get_a_connection_each() {
    let stub = stub().await;
    let a = authority(&stub);
    let pool = pool(Duration::from_secs(60));
    let r1 = pool.send(&a, request(&a, chat(true))).await.unwrap();
    let r2 = pool.send(&a, request(&a, chat(true))).await.unwrap();
    assert_eq!(pool.idle_count(&a), 0, "both connections are in use");
    let (b1, b2) = tokio::join!(r1.into_body().collect(), r2.into_body().collect());
    assert!(b1.unwrap().to_bytes().ends_with(b"data: [DONE]\n\n"));
    assert!(b2.unwrap().to_bytes().ends_with(b"data: [DONE]\n\n"));
    assert_eq!(
        pool.idle_count(&a),
        2,
        "both came back once read to the end"
    );
}

#[tokio::test]
async fn a_backend_restarted_on_the_same_address_is_reached_without_an_error() {
    let stub = stub().await;
    let addr = stub.addr;
    let a = authority(&stub);
    let pool = pool(Duration::from_secs(60));
    exchange(&pool, &a).await;
    assert_eq!(pool.idle_count(&a), 1);
    // The backend goes away (closing the idle connection) and comes back on the same port.
    stub.shutdown().await.unwrap();
    let again = vllm_stub::spawn(stub_config(), addr).await.unwrap();
    exchange(&pool, &a).await;
    assert_eq!(again.state.received(), 1);
    assert_eq!(pool.idle_count(&a), 1, "the closed connection was dropped");
}

#[tokio::test]
async fn a_connection_dropped_mid_stream_is_closed_and_the_generation_canceled() {
    let stub = long_stub(Duration::from_millis(20)).await;
    let a = authority(&stub);
    let pool = pool(Duration::from_secs(60));
    let resp = pool.send(&a, request(&a, chat(true))).await.unwrap();
    let mut body: UpstreamBody = resp.into_body();
    let first = body.frame().await.unwrap().unwrap();
    assert!(first.is_data());
    assert_eq!(stub.state.running(), 1);
    drop(body);
    assert_eq!(pool.idle_count(&a), 0, "not returned to the pool");
    for _ in 0..200 {
        if stub.state.running() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        stub.state.running(),
        0,
        "the backend saw the connection close"
    );
}

#[tokio::test]
async fn idle_connections_expire() {
    let stub = stub().await;
    let a = authority(&stub);
    let pool = pool(Duration::from_millis(50));
    exchange(&pool, &a).await;
    assert_eq!(pool.idle_count(&a), 1);
    tokio::time::sleep(Duration::from_millis(80)).await;
    pool.evict_idle();
    assert_eq!(pool.idle_count(&a), 0);
    // An expired connection that was not evicted yet is not used either.
    exchange(&pool, &a).await;
    tokio::time::sleep(Duration::from_millis(80)).await;
    exchange(&pool, &a).await;
    assert_eq!(pool.idle_count(&a), 1);
}

#[tokio::test]
async fn a_refused_connection_is_a_connect_error() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let a: http::uri::Authority = format!("127.0.0.1:{port}").parse().unwrap();
    let err = pool(Duration::from_secs(60))
        .send(&a, request(&a, chat(false)))
        .await
        .unwrap_err();
    assert!(err.is_connect(), "{err}");
    assert!(err.to_string().contains(&a.to_string()), "{err}");
}

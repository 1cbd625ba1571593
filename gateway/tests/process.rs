//! The `hearth-gateway` binary as a process: SIGTERM drain, and the backend `drain` command
//! (once, and served to an `httpGet` preStop hook).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    process::{Command, Stdio},
    time::Duration,
};

use common::*;
use http_body_util::BodyExt;
use hyper::StatusCode;

#[tokio::test]
async fn sigterm_turns_readiness_off_and_lets_streams_finish() {
    let stub = stub().await;
    let Spawned { child, http, .. } = spawn_gateway_at(
        "127.0.0.1",
        &[
            format!("--backend-url={}", stub.url()),
            "--drain-timeout=30s".into(),
        ],
    );
    let c = client();
    let base = format!("http://127.0.0.1:{http}");
    wait_status(&c, &format!("{base}/readyz"), StatusCode::OK).await;
    let mut body = chat(true);
    body["stub_token_delay"] = "30ms".into();
    body["max_tokens"] = 20.into();
    let resp = send(
        &c,
        post_req(&format!("{base}/v1/chat/completions"), &body, &[]),
    )
    .await;
    let mut stream = resp.into_body();
    next_chunk(&mut stream).await.unwrap();
    sigterm(&child);
    // Readiness turns 503 while the stream goes on (the listener stays open during drain).
    loop {
        let (s, _) = get(&c, &format!("{base}/readyz")).await;
        if s == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let rest = stream.collect().await.unwrap().to_bytes();
    assert!(
        rest.ends_with(b"data: [DONE]\n\n"),
        "in-flight stream finished"
    );
    let status = exit_within(child, 60).await;
    assert!(status.success(), "{status:?}");
}

#[tokio::test]
async fn drain_command_returns_when_the_backend_is_idle() {
    let stub = stub().await;
    let c = client();
    let in_flight = slow_request(&c, &stub, "50ms", 10);
    let mut rx = stub.state.subscribe_received();
    rx.wait_for(|n| *n == 1).await.unwrap();
    assert_eq!(stub.state.running(), 1);
    let url = format!("{}/metrics", stub.url());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_hearth-gateway"))
            .args([
                "drain",
                "--url",
                &url,
                "--timeout",
                "60s",
                "--interval",
                "20ms",
                "--settle",
                "100ms",
            ])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(out.status.success());
    // The command returned only once the request had finished generating.
    assert_eq!(stub.state.running(), 0);
    let log = String::from_utf8_lossy(&out.stdout);
    assert!(log.contains("backend idle"), "{log}");
    assert_eq!(in_flight.await.unwrap().0, StatusCode::OK);

    // A backend that is not listening has nothing in flight: the command returns at once.
    let dead = free_port();
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-gateway"))
        .args([
            "drain",
            "--url",
            &format!("http://127.0.0.1:{dead}/metrics"),
            "--timeout",
            "60s",
        ])
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("not listening"));
}

/// `drain --listen`: the native-sidecar form an `httpGet` preStop hook calls. `GET /drain`
/// answers only once the in-flight request has finished and the backend stayed idle for the
/// settle time; with a timeout shorter than the work it answers 503 naming what is in flight.
#[tokio::test]
async fn drain_sidecar_answers_when_the_backend_is_idle() {
    let stub = stub().await;
    let c = client();
    let sidecar = |timeout: &str| {
        let port = free_port();
        let child = Child(
            Command::new(env!("CARGO_BIN_EXE_hearth-gateway"))
                .args([
                    "drain",
                    &format!("--listen=127.0.0.1:{port}"),
                    &format!("--url={}/metrics", stub.url()),
                    &format!("--timeout={timeout}"),
                    "--interval=20ms",
                    "--settle=300ms",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap(),
        );
        (child, format!("http://127.0.0.1:{port}"))
    };
    let (child, base) = sidecar("60s");
    wait_status(&c, &format!("{base}/healthz"), StatusCode::OK).await;

    let in_flight = slow_request(&c, &stub, "50ms", 10);
    let mut rx = stub.state.subscribe_received();
    rx.wait_for(|n| *n == 1).await.unwrap();
    let asked = std::time::Instant::now();
    let (status, text) = get(&c, &format!("{base}/drain")).await;
    let waited = asked.elapsed();
    assert_eq!(status, StatusCode::OK, "{text:?}");
    assert!(
        String::from_utf8_lossy(&text).contains("backend idle"),
        "{text:?}"
    );
    // The request had finished (about 0.5 s of tokens), then 0.3 s of quiet.
    assert_eq!(stub.state.running(), 0);
    assert_eq!(in_flight.await.unwrap().0, StatusCode::OK);
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    assert!(waited < Duration::from_secs(10), "{waited:?}");

    // A second call (the kubelet may deliver a hook more than once) on an idle backend ends
    // after the settle time alone.
    let asked = std::time::Instant::now();
    let (status, _) = get(&c, &format!("{base}/drain")).await;
    assert_eq!(status, StatusCode::OK);
    assert!(asked.elapsed() < Duration::from_secs(5));

    // SIGTERM (the kubelet stops a native sidecar after the model container exited) ends it.
    sigterm(&child);
    let status = exit_within(child, 60).await;
    assert!(status.success(), "{status:?}");

    // Work longer than the timeout: 503 naming what is still running.
    let (_child, base) = sidecar("300ms");
    wait_status(&c, &format!("{base}/healthz"), StatusCode::OK).await;
    let long = slow_request(&c, &stub, "100ms", 30);
    rx.wait_for(|n| *n == 2).await.unwrap();
    let (status, text) = get(&c, &format!("{base}/drain")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text:?}");
    assert!(
        String::from_utf8_lossy(&text).contains("running 1"),
        "{text:?}"
    );
    long.abort();
}

/// A non-streaming completion taking `tokens` × `token_delay` on the stub, sent in the
/// background.
fn slow_request(
    c: &HttpClient,
    stub: &vllm_stub::RunningStub,
    token_delay: &str,
    tokens: u64,
) -> tokio::task::JoinHandle<(StatusCode, http::HeaderMap, bytes::Bytes)> {
    let mut body = chat(false);
    body["stub_token_delay"] = token_delay.into();
    body["max_tokens"] = tokens.into();
    let req = chat_req(&stub.url(), &body);
    let c = c.clone();
    tokio::spawn(async move { send_full(&c, req).await })
}

#[test]
fn bad_flags_fail_with_the_flag_named() {
    let err = refused(&["--backend-url=http://127.0.0.1:1", "--max-queue=0"]);
    assert!(err.contains("--max-queue"), "{err}");
    let err = refused(&["--activation-timeout=soon"]);
    assert!(err.contains("--activation-timeout"), "{err}");
    // The drain reads metrics over plain HTTP on the pod's loopback: another scheme is refused
    // at start, not taken for a backend that is gone.
    let err = refused(&["drain", "--url=https://127.0.0.1:8000/metrics"]);
    assert!(err.contains("--url") && err.contains("http://"), "{err}");
    // A listen address names valid forms; `:<port>` is every address.
    let err = refused(&[
        "--backend-url=http://127.0.0.1:1",
        "--listen=localhost:8080",
    ]);
    assert!(
        err.contains("--listen") && err.contains("\":8080\""),
        "{err}"
    );
}

/// A second gateway on a port the first one serves fails at start, naming the flag and the
/// address once, instead of sharing the port through `SO_REUSEPORT`.
#[tokio::test]
async fn a_port_another_gateway_serves_is_refused_not_shared() {
    let stub = stub().await;
    let backend = format!("--backend-url={}", stub.url());
    let (_first, base, _) = spawn_gateway(std::slice::from_ref(&backend));
    wait_status(&client(), &format!("{base}/readyz"), StatusCode::OK).await;
    let port = base.rsplit(':').next().unwrap();
    let err = refused(&[
        format!("--listen=127.0.0.1:{port}"),
        format!("--scaler-listen=127.0.0.1:{}", free_port()),
        format!("--admin-listen=127.0.0.1:{}", free_port()),
        backend,
    ]);
    assert!(err.contains("--listen") && err.contains("in use"), "{err}");
    assert_eq!(
        err.matches(&format!("binding 127.0.0.1:{port}")).count(),
        1,
        "{err}"
    );
}

/// `[::]` (the default `--listen` and `--scaler-listen`) serves IPv4 and IPv6 clients alike, and
/// an IPv4 client is forwarded as IPv4 in `X-Forwarded-For`, not as `::ffff:127.0.0.1`.
#[tokio::test]
async fn unspecified_ipv6_listens_dual_stack() {
    let backend = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let backend_addr = backend.local_addr().unwrap();
    let (tx, mut forwarded_for) = tokio::sync::mpsc::unbounded_channel::<String>();
    accept_each(backend, move |_, mut s| {
        let tx = tx.clone();
        async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut head = Vec::new();
            let mut b = [0u8; 4096];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut b).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => head.extend_from_slice(&b[..n]),
                }
            }
            let head = String::from_utf8_lossy(&head).to_lowercase();
            let xff = head
                .lines()
                .find_map(|l| l.strip_prefix("x-forwarded-for: "))
                .unwrap_or("")
                .to_string();
            let _ = tx.send(xff);
            let _ = s
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
                .await;
        }
    });
    let Spawned {
        child: _child,
        http,
        grpc,
        ..
    } = spawn_gateway_at("[::]", &[format!("--backend-url=http://{backend_addr}")]);
    let c = client();
    for (host, client_ip) in [("127.0.0.1", "127.0.0.1"), ("[::1]", "::1")] {
        let base = format!("http://{host}:{http}");
        wait_status(&c, &format!("{base}/readyz"), StatusCode::OK).await;
        let (status, _, _) = send_full(&c, chat_req(&base, &chat(false))).await;
        assert_eq!(status, StatusCode::OK, "through {base}");
        assert_eq!(
            forwarded_for.recv().await.unwrap(),
            client_ip,
            "through {base}"
        );
        tokio::net::TcpStream::connect(format!("{host}:{grpc}"))
            .await
            .unwrap_or_else(|e| panic!("gRPC port through {host}: {e}"));
    }
}

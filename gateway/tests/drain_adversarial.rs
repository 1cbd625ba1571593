//! The backend drain (`hearth-gateway drain`) against hostile metrics endpoints: bodies that
//! stall or trickle, handshakes that never complete, values that flip or lie. Every drain is
//! bounded by its timeout, and only a refused connection counts as a backend that is gone. Also:
//! flag values, and the `--listen` server under concurrency and SIGTERM.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Parser;
use common::read_head;
use hearth_gateway::{
    cli::{Cli, Command},
    drain::{DrainOutcome, DrainSpec, serve_drain, wait_backend_idle},
};
use tokio::{
    io::AsyncWriteExt,
    net::{TcpListener, TcpStream},
    time::timeout,
};

/// A raw metrics server: `f(i, stream)` handles request `i` (counted over all connections)
/// on its connection after its head was read; returning `None` closes the connection.
async fn raw_metrics<F, Fut>(f: F) -> (SocketAddr, Arc<AtomicUsize>)
where
    F: Fn(usize, TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Option<TcpStream>> + Send,
{
    let l = TcpListener::bind(common::localhost()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let n = Arc::new(AtomicUsize::new(0));
    let f = Arc::new(f);
    let count = n.clone();
    common::accept_each(l, move |_, mut s| {
        let (f, count) = (f.clone(), count.clone());
        async move {
            loop {
                if read_head(&mut s).await.is_none() {
                    return;
                }
                let i = count.fetch_add(1, Ordering::SeqCst);
                match f(i, s).await {
                    Some(back) => s = back,
                    None => return,
                }
            }
        }
    });
    (addr, n)
}

/// A metrics server that answers every request with `running` and `waiting`.
async fn fixed_metrics(running: u32, waiting: u32) -> (SocketAddr, Arc<AtomicUsize>) {
    raw_metrics(move |_, mut s| async move {
        s.write_all(&ok_response(&metrics_body(running, waiting)))
            .await
            .ok()?;
        Some(s)
    })
    .await
}

/// vLLM's two gauges, as its `/metrics` shows them.
fn metrics_body(running: u32, waiting: u32) -> String {
    format!(
        "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\"}} {running}.0\n\
         vllm:num_requests_waiting{{model_name=\"m\"}} {waiting}.0\n"
    )
}

/// A `200` with `body` and its Content-Length.
fn ok_response(body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// A drain of `http://{addr}/metrics`, polled every 50 ms.
fn spec(addr: SocketAddr, timeout: Duration, settle: Duration) -> DrainSpec {
    DrainSpec {
        running_metric: hearth_gateway::drain::RUNNING.into(),
        waiting_metric: hearth_gateway::drain::WAITING.into(),
        url: format!("http://{addr}/metrics").parse().unwrap(),
        timeout,
        interval: Duration::from_millis(50),
        settle,
    }
}

/// The drain timeout bounds reading the metrics body, not just its head: an endpoint that sends
/// its head and then stalls the body cannot keep the drain (and the pod's termination) waiting.
#[tokio::test]
async fn metrics_body_that_stalls_is_bounded_by_the_timeout() {
    let (addr, _) = raw_metrics(|_, mut s| async move {
        // Promise 100 bytes, send 10, then hold the connection open.
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nvllm:num_r")
            .await;
        tokio::time::sleep(Duration::from_secs(3600)).await;
        None
    })
    .await;
    let start = Instant::now();
    let out = timeout(
        Duration::from_secs(6),
        wait_backend_idle(&spec(addr, Duration::from_secs(1), Duration::ZERO)),
    )
    .await;
    assert!(
        out.is_ok(),
        "drain with --timeout 1s did not end within {:?} (metrics body stalled)",
        start.elapsed()
    );
}

/// A metrics body trickled one byte every 100 ms, never ending, is bounded by the timeout too.
#[tokio::test]
async fn metrics_body_that_trickles_is_bounded_by_the_timeout() {
    let (addr, _) = raw_metrics(|_, mut s| async move {
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            .await;
        loop {
            if s.write_all(b"1\r\n#\r\n").await.is_err() {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let out = timeout(
        Duration::from_secs(6),
        wait_backend_idle(&spec(addr, Duration::from_secs(1), Duration::ZERO)),
    )
    .await;
    assert!(
        out.is_ok(),
        "drain with --timeout 1s did not return within 6s"
    );
}

/// A metrics endpoint that does not complete the TCP handshake (accept queue full on an
/// overloaded engine, or a filtered port) is not a backend that is gone: it may have requests
/// in flight, so the drain keeps waiting.
#[tokio::test]
async fn connect_timeout_is_not_gone() {
    // A listener with backlog 0 that never accepts: fill its accept queue, then SYNs are dropped.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = sock.local_addr().unwrap();
    let _listener = sock.listen(0).unwrap();
    let mut fillers = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) = timeout(Duration::from_millis(300), TcpStream::connect(addr)).await {
            fillers.push(s);
        }
    }
    let out = timeout(
        Duration::from_secs(10),
        wait_backend_idle(&spec(addr, Duration::from_secs(5), Duration::ZERO)),
    )
    .await
    .expect("the drain did not end within 10s");
    assert!(
        !matches!(out, DrainOutcome::Gone { .. }),
        "a backend whose port does not complete the handshake was reported gone: {out:?}"
    );
}

/// An `https://` URL, which the drain cannot read (the CLI refuses it), is not taken for a
/// backend that is gone: that would end the drain of a busy backend without a single read.
#[tokio::test]
async fn https_url_error_is_not_gone() {
    let (addr, hits) = fixed_metrics(3, 1).await;
    let mut sp = spec(addr, Duration::from_secs(2), Duration::ZERO);
    sp.url = format!("https://{addr}/metrics").parse().unwrap();
    let out = wait_backend_idle(&sp).await;
    assert!(
        !matches!(out, DrainOutcome::Gone { .. }),
        "an https URL made the drain report the backend gone: {out:?} ({} metric reads)",
        hits.load(Ordering::SeqCst)
    );
}

/// A zero timeout (`--timeout=0s`, or a `drain-timeout: 0s` annotation) still reads the
/// metrics once: a backend that is gone ends the drain as gone, not as timed out with requests
/// in flight. See also `policies/tests/drain_sidecar.rs`.
#[tokio::test]
async fn zero_timeout_still_reads_once_and_sees_the_backend_gone() {
    let l = TcpListener::bind(common::localhost()).await.unwrap();
    let addr = l.local_addr().unwrap();
    drop(l); // refused
    let out = wait_backend_idle(&spec(addr, Duration::ZERO, Duration::ZERO)).await;
    assert!(
        matches!(out, DrainOutcome::Gone { .. }),
        "timeout 0 on a gone backend: {out:?}"
    );
}

/// A settle time longer than the timeout (the default 2 s settle with a 1 s drain timeout) still
/// ends an idle backend's drain as idle, not as timed out with requests in flight.
#[tokio::test]
async fn idle_backend_is_idle_when_the_settle_outlasts_the_timeout() {
    let (addr, _) = fixed_metrics(0, 0).await;
    let out = wait_backend_idle(&spec(addr, Duration::from_secs(1), Duration::from_secs(2))).await;
    assert!(
        matches!(out, DrainOutcome::Idle { .. }),
        "an idle backend, timeout 1s, settle 2s (the default): {out:?}"
    );
}

/// A backend that flips between busy and idle restarts the settle window each time it is busy.
#[tokio::test]
async fn flipping_backend_restarts_the_settle_window() {
    let (addr, _) = raw_metrics(|i, mut s| async move {
        // idle, busy, idle, busy, ... for the first 20 reads, then idle.
        let running = if i < 20 && i % 2 == 1 { 1 } else { 0 };
        s.write_all(&ok_response(&metrics_body(running, 0)))
            .await
            .ok()?;
        Some(s)
    })
    .await;
    let start = Instant::now();
    let out = wait_backend_idle(&spec(
        addr,
        Duration::from_secs(10),
        Duration::from_millis(300),
    ))
    .await;
    // 20 reads 50 ms apart = ~1 s of flipping before a stable idle stretch.
    assert!(matches!(out, DrainOutcome::Idle { .. }), "{out:?}");
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "{:?}",
        start.elapsed()
    );
}

/// 500s, garbage, missing gauges and a 100 MB body are not idle: the drain times out.
#[tokio::test]
async fn errors_garbage_missing_gauges_and_huge_bodies_are_not_idle() {
    let (addr, _) = raw_metrics(|i, mut s| async move {
        match i % 4 {
            0 => {
                s.write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n")
                    .await
                    .ok()?;
                Some(s)
            }
            1 => {
                s.write_all(&ok_response(
                    "\u{0}\u{1}garbage {{{{ vllm:num_requests_running\n",
                ))
                .await
                .ok()?;
                Some(s)
            }
            2 => {
                s.write_all(&ok_response("vllm:num_requests_waiting 0\nother 1\n"))
                    .await
                    .ok()?;
                Some(s)
            }
            _ => {
                let n = 100 * 1024 * 1024;
                s.write_all(format!("HTTP/1.1 200 OK\r\nContent-Length: {n}\r\n\r\n").as_bytes())
                    .await
                    .ok()?;
                let chunk = vec![b'#'; 1 << 20];
                for _ in 0..100 {
                    s.write_all(&chunk).await.ok()?;
                }
                Some(s)
            }
        }
    })
    .await;
    let out = timeout(
        Duration::from_secs(10),
        wait_backend_idle(&spec(addr, Duration::from_secs(2), Duration::ZERO)),
    )
    .await
    .expect("the drain did not end within 10s");
    assert!(matches!(out, DrainOutcome::TimedOut { .. }), "{out:?}");
}

/// A NaN gauge is not idle.
#[tokio::test]
async fn nan_gauges_are_not_idle() {
    let (addr, _) = raw_metrics(|_, mut s| async move {
        s.write_all(&ok_response(
            "vllm:num_requests_running NaN\nvllm:num_requests_waiting 0\n",
        ))
        .await
        .ok()?;
        Some(s)
    })
    .await;
    let out = wait_backend_idle(&spec(addr, Duration::from_millis(500), Duration::ZERO)).await;
    assert!(matches!(out, DrainOutcome::TimedOut { .. }), "{out:?}");
}

/// An in-process `--listen` server; returns its address and the sender that stops it.
async fn serve(spec: DrainSpec) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let l = TcpListener::bind(common::localhost()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_drain(l, spec, async move {
        let _ = rx.await;
    }));
    (addr, tx)
}

/// 100 concurrent `GET /drain` against an idle backend all answer 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_concurrent_drains() {
    let (maddr, _) = fixed_metrics(0, 0).await;
    let (addr, _stop) = serve(spec(
        maddr,
        Duration::from_secs(10),
        Duration::from_millis(200),
    ))
    .await;
    let c = common::client();
    let mut tasks = Vec::new();
    for _ in 0..100 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            common::get(&c, &format!("http://{addr}/drain")).await
        }));
    }
    for t in tasks {
        let (s, b) = timeout(Duration::from_secs(15), t).await.unwrap().unwrap();
        assert_eq!(s, 200, "{b:?}");
    }
}

/// SIGTERM while a `GET /drain` is in progress ends `drain --listen` promptly, without waiting
/// out the drain: the kubelet stops the sidecar only after the model container, when no hook
/// is waiting any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_drain_exits_promptly() {
    let (maddr, _) = fixed_metrics(1, 0).await;
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-gateway"))
        .args([
            "drain",
            &format!("--listen=127.0.0.1:{port}"),
            &format!("--url=http://{maddr}/metrics"),
            "--timeout=20s",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    // Wait until it listens.
    let t0 = Instant::now();
    loop {
        if let Ok(Ok(_)) = timeout(Duration::from_millis(200), TcpStream::connect(addr)).await {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "sidecar did not listen"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let c = common::client();
    let drain = tokio::spawn(async move { common::get(&c, &format!("http://{addr}/drain")).await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    sigterm(child.id());
    let start = Instant::now();
    let exited = loop {
        if child.try_wait().unwrap().is_some() {
            break true;
        }
        if start.elapsed() >= Duration::from_secs(5) {
            let _ = child.kill();
            let _ = child.wait();
            break false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    drain.abort();
    assert!(
        exited,
        "hearth-gateway drain --listen had not exited {:?} after SIGTERM (a /drain was in progress)",
        start.elapsed()
    );
}

/// Sends SIGTERM to process `pid`.
fn sigterm(pid: u32) {
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .unwrap();
}

/// The CLI rejects negative durations (as the policy denies a negative drain-timeout annotation,
/// see `policies/tests/drain_sidecar.rs`) and accepts `--timeout=0s` and `--interval=0s`.
#[test]
fn flag_values() {
    let parse = |args: &[&str]| {
        let mut v = vec!["hearth-gateway", "drain"];
        v.extend_from_slice(args);
        Cli::try_parse_from(v).map(|c| match c.command {
            Some(Command::Drain(d)) => (d.timeout, d.interval, d.settle),
            None => panic!("not drain"),
        })
    };
    assert!(
        parse(&["--settle=-1s"]).is_err(),
        "negative settle accepted"
    );
    assert!(
        parse(&["--timeout=-5s"]).is_err(),
        "negative timeout accepted"
    );
    assert_eq!(parse(&["--timeout=0s"]).unwrap().0, Duration::ZERO);
    assert_eq!(parse(&["--interval=0s"]).unwrap().1, Duration::ZERO);
}

/// `--listen` on a port in use fails with an error (exit status non-zero).
#[tokio::test]
async fn listen_on_used_port_fails() {
    let l = TcpListener::bind(common::localhost()).await.unwrap();
    let addr = l.local_addr().unwrap();
    // `refused` asserts the non-zero exit status.
    tokio::task::spawn_blocking(move || {
        common::refused(&["drain", &format!("--listen={addr}"), "--timeout=1s"])
    })
    .await
    .unwrap();
    drop(l);
}

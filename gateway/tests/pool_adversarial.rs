//! The backend connection pool (`UpstreamPool`, `UpstreamBody`) under hostile backends: early
//! answers to large uploads, informational responses, stray bytes on idle connections,
//! restarts, and bodies dropped mid-stream. A connection is pooled only when it can take the
//! next request at once.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use common::read_head;
use hearth_gateway::upstream::UpstreamPool;
use http::uri::Authority;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpListener,
    time::timeout,
};

/// A pool with a 2 s connect timeout and a 30 s idle timeout.
fn pool() -> UpstreamPool {
    UpstreamPool::new(Duration::from_secs(2), Duration::from_secs(30))
}

/// A bodiless `GET /x` to `auth`.
fn get_req(auth: &Authority) -> Request<Full<Bytes>> {
    Request::get("/x")
        .header("host", auth.as_str())
        .body(Full::new(Bytes::new()))
        .unwrap()
}

/// A listener on a free local port, its address and authority.
async fn listen() -> (TcpListener, SocketAddr, Authority) {
    let l = TcpListener::bind(common::localhost()).await.unwrap();
    let addr = l.local_addr().unwrap();
    (l, addr, addr.to_string().parse().unwrap())
}

/// A backend that answers early (413) and stops reading a large request body leaves a
/// connection that is closed, not pooled: the next request gets a fresh connection and its
/// answer, instead of waiting on a body write the backend will never read.
#[tokio::test]
async fn an_early_answer_to_a_large_post_is_not_pooled() {
    let (l, _addr, auth) = listen().await;
    let conns = Arc::new(AtomicUsize::new(0));
    let c2 = conns.clone();
    common::accept_each(l, move |i, mut s| {
        c2.fetch_add(1, Ordering::SeqCst);
        async move {
            if read_head(&mut s).await.is_none() {
                return;
            }
            if i == 0 {
                // Early answer; never read the body, keep the connection open.
                let _ = s
                    .write_all(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n")
                    .await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
            } else {
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
                tokio::time::sleep(Duration::from_secs(3600)).await;
            }
        }
    });
    let p = pool();
    let big = Bytes::from(vec![b'x'; 8 * 1024 * 1024]);
    let req = Request::post("/v1/completions")
        .header("host", auth.as_str())
        .header("content-type", "application/json")
        .body(Full::new(big))
        .unwrap();
    let resp = timeout(Duration::from_secs(5), p.send(&auth, req))
        .await
        .expect("early response not delivered")
        .unwrap();
    assert_eq!(resp.status(), 413);
    let _ = timeout(Duration::from_secs(5), resp.into_body().collect())
        .await
        .expect("the 413 body did not end within 5s");
    let second = timeout(Duration::from_secs(5), p.send(&auth, get_req(&auth))).await;
    assert!(
        second.is_ok(),
        "the next request was not answered within 5s (idle {}, connections made {})",
        p.idle_count(&auth),
        conns.load(Ordering::SeqCst)
    );
    assert_eq!(second.unwrap().unwrap().status(), 200);
}

/// 1xx informational responses (100 Continue, 103 Early Hints) before the final answer are
/// skipped, and the connection is reused afterwards: one connection for five requests.
#[tokio::test]
async fn informational_responses_then_reuse() {
    let (l, _addr, auth) = listen().await;
    let conns = Arc::new(AtomicUsize::new(0));
    let c2 = conns.clone();
    common::accept_each(l, move |_, mut s| {
        c2.fetch_add(1, Ordering::SeqCst);
        async move {
            while read_head(&mut s).await.is_some() {
                let _ = s
                    .write_all(
                        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>; rel=preload\r\n\r\n",
                    )
                    .await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
            }
        }
    });
    let p = pool();
    for _ in 0..5 {
        let resp = timeout(Duration::from_secs(5), p.send(&auth, get_req(&auth)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(resp.status(), 200);
        let b = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(&b[..], b"ok");
    }
    assert_eq!(conns.load(Ordering::SeqCst), 1);
}

/// A body dropped mid-stream closes its connection promptly (the backend sees EOF, which is how
/// vLLM stops generating) and the pool does not keep it; a body read to its end returns it.
#[tokio::test]
async fn dropped_body_closes_and_complete_body_returns() {
    let (l, _addr, auth) = listen().await;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<std::time::Instant>();
    common::accept_each(l, move |i, mut s| {
        let tx = tx.clone();
        let first = i == 0;
        async move {
            while read_head(&mut s).await.is_some() {
                if first {
                    let _ = s
                        .write_all(
                            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
                        )
                        .await;
                    // Wait for the gateway to close.
                    let mut b = [0u8; 16];
                    let _ = s.read(&mut b).await;
                    let _ = tx.send(std::time::Instant::now());
                    return;
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
            }
        }
    });
    let p = pool();
    let resp = p.send(&auth, get_req(&auth)).await.unwrap();
    let mut body = resp.into_body();
    let f = body.frame().await.unwrap().unwrap();
    assert_eq!(f.into_data().unwrap(), "abc");
    let dropped = std::time::Instant::now();
    drop(body);
    let seen = timeout(Duration::from_secs(2), rx.recv())
        .await
        .expect("backend did not see the close")
        .unwrap();
    assert!(seen.duration_since(dropped) < Duration::from_millis(500));
    assert_eq!(p.idle_count(&auth), 0);
    let resp = p.send(&auth, get_req(&auth)).await.unwrap();
    resp.into_body().collect().await.unwrap();
    assert_eq!(p.idle_count(&auth), 1);
}

/// A stray extra response the backend sends after a 204 (bytes on an idle connection) is not
/// taken as the answer to the next request.
#[tokio::test]
async fn stray_bytes_on_idle_connection_do_not_answer_the_next_request() {
    let (l, _addr, auth) = listen().await;
    common::accept_each(l, |i, mut s| async move {
        // Connections numbered from 1, so the stray body is 5 bytes for the first nine.
        let conn = i + 1;
        while read_head(&mut s).await.is_some() {
            let _ = s.write_all(b"HTTP/1.1 204 No Content\r\n\r\n").await;
            tokio::time::sleep(Duration::from_millis(30)).await;
            let _ = s
                .write_all(
                    format!("HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nSTAL{conn}").as_bytes(),
                )
                .await;
        }
    });
    let p = pool();
    let resp = p.send(&auth, get_req(&auth)).await.unwrap();
    assert_eq!(resp.status(), 204);
    drop(resp);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let resp = timeout(Duration::from_secs(5), p.send(&auth, get_req(&auth)))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        resp.status(),
        204,
        "the stale response answered the next request"
    );
}

/// A backend restarting on the same port leaves the pool with idle connections the old process
/// closed: GETs still go through, on fresh connections.
#[tokio::test]
async fn backend_restart_with_idle_connections() {
    let (l, addr, auth) = listen().await;
    let serve = |l: TcpListener, tasks: Arc<std::sync::Mutex<Vec<tokio::task::AbortHandle>>>| {
        tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    return;
                };
                let h = tokio::spawn(async move {
                    while read_head(&mut s).await.is_some() {
                        if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                            .await
                            .is_err()
                        {
                            return;
                        }
                    }
                });
                tasks.lock().unwrap().push(h.abort_handle());
            }
        })
    };
    let old = Arc::new(std::sync::Mutex::new(Vec::new()));
    let h = serve(l, old.clone());
    let p = pool();
    let mut inflight = Vec::new();
    for _ in 0..20 {
        let (p, auth) = (p.clone(), auth.clone());
        inflight.push(tokio::spawn(async move {
            let r = p.send(&auth, get_req(&auth)).await.unwrap();
            r.into_body().collect().await.unwrap();
        }));
    }
    for t in inflight {
        t.await.unwrap();
    }
    assert!(p.idle_count(&auth) > 1);
    // The old process dies: listener and every connection closed.
    h.abort();
    for t in old.lock().unwrap().drain(..) {
        t.abort();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let l2 = loop {
        match TcpListener::bind(addr).await {
            Ok(l) => break l,
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let _h2 = serve(l2, Arc::default());
    for _ in 0..20 {
        let r = timeout(Duration::from_secs(5), p.send(&auth, get_req(&auth)))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r.status(), 200);
        r.into_body().collect().await.unwrap();
    }
}

/// A response with many and large header fields (one of 60 KiB), within hyper's limits, passes.
#[tokio::test]
async fn large_response_headers() {
    let (l, _addr, auth) = listen().await;
    tokio::spawn(async move {
        let Ok((mut s, _)) = l.accept().await else {
            return;
        };
        while read_head(&mut s).await.is_some() {
            let mut head = String::from("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n");
            head.push_str(&format!("X-Big: {}\r\n", "a".repeat(60 * 1024)));
            for i in 0..50 {
                head.push_str(&format!("X-H{i}: v\r\n"));
            }
            head.push_str("\r\nok");
            let _ = s.write_all(head.as_bytes()).await;
        }
    });
    let p = pool();
    let r = timeout(Duration::from_secs(5), p.send(&auth, get_req(&auth)))
        .await
        .unwrap();
    let r = r.expect("60 KiB header field rejected");
    assert_eq!(r.status(), 200);
}

/// End to end through the gateway: after a 4 MiB POST the backend answers early with 413, the
/// next request to the same backend is answered.
#[tokio::test]
async fn after_an_early_answer_to_a_large_post_the_next_request_is_answered() {
    let (l, _addr, auth) = listen().await;
    common::accept_each(l, |i, mut s| async move {
        if read_head(&mut s).await.is_none() {
            return;
        }
        let reply: &[u8] = if i == 0 {
            b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 0\r\n\r\n"
        } else {
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        };
        let _ = s.write_all(reply).await;
        tokio::time::sleep(Duration::from_secs(3600)).await;
    });
    let g = common::gateway(
        common::config(),
        hearth_gateway::EndpointSet::fixed([auth.clone()]),
    )
    .await;
    let c = common::client();
    let big = Bytes::from(vec![b'x'; 4 * 1024 * 1024]);
    let req = Request::post(format!("{}/v1/completions", g.url()))
        .header("content-type", "application/json")
        .body(Full::new(big))
        .unwrap();
    let (s, _, _) = timeout(Duration::from_secs(10), common::send_full(&c, req))
        .await
        .expect("the POST was not answered within 10s");
    assert_eq!(s, 413);
    let (s, _) = timeout(
        Duration::from_secs(10),
        common::get(&c, &format!("{}/v1/models", g.url())),
    )
    .await
    .expect("the GET after the early 413 was not answered within 10s");
    assert_eq!(s, 200);
}

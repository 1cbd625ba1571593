//! The HTTPS server on loopback: reviews over TLS, certificate rotation and file reload under a
//! loop of requests (none may fail), clients that stall, and the drain on shutdown.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::HttpsClient;
use common::review::admission_review;
use hearth_webhook::selfmanaged::{generate_ca, issue};
use hearth_webhook::tls::{CertFiles, CertStore, certified_key};
use hearth_webhook::{AppState, Limits, Snapshot, router, serve};
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

struct Ca {
    cert: String,
    key: String,
    not_after: time::OffsetDateTime,
}

fn ca() -> Ca {
    let (cert, key, not_after) = generate_ca(Duration::from_secs(3600)).unwrap();
    Ca {
        cert,
        key,
        not_after,
    }
}

fn leaf(ca: &Ca) -> (String, String) {
    let (c, k, _) = issue(
        &ca.key,
        ca.not_after,
        &["127.0.0.1".to_owned()],
        Duration::from_secs(600),
    )
    .unwrap();
    (c, k)
}

struct Server {
    addr: std::net::SocketAddr,
    store: Arc<CertStore>,
    shutdown: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

async fn start(ca: &Ca, limits: Limits) -> Server {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (c, k) = leaf(ca);
    let store = CertStore::new(certified_key(c.as_bytes(), k.as_bytes()).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = watch::channel(false);
    let app = router(AppState::new(Snapshot::default(), limits));
    let task = tokio::spawn(serve(
        listener,
        store.server_config().unwrap(),
        app,
        limits,
        rx,
    ));
    Server {
        addr,
        store,
        shutdown: tx,
        task,
    }
}

fn review_body(uid: &str) -> Bytes {
    let object = json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}});
    let mut review = admission_review("ConfigMap", object, "CREATE");
    review["request"]["uid"] = json!(uid);
    Bytes::from(review.to_string())
}

/// Runs `n` reviews, each on a fresh connection (a fresh handshake), and returns the number of
/// distinct leaf certificates seen and the failures.
async fn request_loop(client: HttpsClient, stop: watch::Receiver<bool>) -> (usize, Vec<String>) {
    let mut leaves: Vec<CertificateDer<'static>> = Vec::new();
    let mut failures = Vec::new();
    let mut i = 0u64;
    while !*stop.borrow() {
        i += 1;
        let uid = format!("uid-{i}");
        match client.connect().await {
            Ok(mut conn) => {
                if !leaves.contains(&conn.leaf) {
                    leaves.push(conn.leaf.clone());
                }
                // Two requests per connection: one right after the handshake, one later.
                for _ in 0..2 {
                    match conn.post("/mutate", review_body(&uid)).await {
                        Ok((200, body)) => {
                            let v: Value = serde_json::from_slice(&body).unwrap();
                            if v["response"]["uid"] != uid.as_str() {
                                failures.push(format!("{uid}: wrong uid in {v}"));
                            }
                        }
                        Ok((s, body)) => failures.push(format!("{uid}: status {s}: {body:?}")),
                        Err(e) => failures.push(format!("{uid}: {e}")),
                    }
                }
            }
            Err(e) => failures.push(format!("{uid}: connect: {e}")),
        }
    }
    (leaves.len(), failures)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotation_under_a_request_loop_loses_nothing() {
    let ca = ca();
    let server = start(&ca, Limits::default()).await;
    let client = HttpsClient::new(&ca.cert, server.addr);
    let (stop_tx, stop_rx) = watch::channel(false);
    let loops: Vec<_> = (0..4)
        .map(|_| tokio::spawn(request_loop(client.clone(), stop_rx.clone())))
        .collect();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let (c, k) = leaf(&ca);
        server
            .store
            .swap(certified_key(c.as_bytes(), k.as_bytes()).unwrap());
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop_tx.send(true).unwrap();
    let mut seen = 0;
    for l in loops {
        let (leaves, failures) = l.await.unwrap();
        assert!(failures.is_empty(), "{failures:#?}");
        seen = seen.max(leaves);
    }
    assert!(
        seen >= 2,
        "the loop saw only {seen} certificate(s); rotation was not observed"
    );
    server.shutdown.send(true).unwrap();
    server.task.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cert_files_are_reloaded_and_broken_pairs_skipped() {
    let ca = ca();
    let dir = std::env::temp_dir().join(format!("hearth-webhook-tls-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let files = CertFiles {
        cert: dir.join("tls.crt"),
        key: dir.join("tls.key"),
    };
    let (c1, k1) = leaf(&ca);
    std::fs::write(&files.cert, &c1).unwrap();
    std::fs::write(&files.key, &k1).unwrap();

    let server = start(&ca, Limits::default()).await;
    server.store.swap(files.load().unwrap());
    let (_tx, rx) = watch::channel(false);
    let metrics = Arc::new(hearth_webhook::metrics::Metrics::new());
    tokio::spawn(files.clone().watch(
        server.store.clone(),
        Duration::from_millis(20),
        metrics.clone(),
        rx,
    ));
    let client = HttpsClient::new(&ca.cert, server.addr);
    let first = CertificateDer::from_pem_slice(c1.as_bytes()).unwrap();
    assert_eq!(client.connect().await.unwrap().leaf, first);

    // A half-written rotation (new cert, old key) is skipped: the old pair keeps serving.
    let (c2, k2) = leaf(&ca);
    std::fs::write(&files.cert, &c2).unwrap();
    wait_for(|| metrics.cert_reload_errors.get() > 0).await;
    assert_eq!(client.connect().await.unwrap().leaf, first);

    // Completing it swaps the served certificate.
    std::fs::write(&files.key, &k2).unwrap();
    let second = CertificateDer::from_pem_slice(c2.as_bytes()).unwrap();
    wait_for(|| metrics.cert_reloads.get() > 0).await;
    let mut conn = client.connect().await.unwrap();
    assert_eq!(conn.leaf, second);
    let (status, _) = conn.post("/validate", review_body("u")).await.unwrap();
    assert_eq!(status, 200);
    std::fs::remove_dir_all(&dir).ok();
}

async fn wait_for(cond: impl Fn() -> bool) {
    for _ in 0..500 {
        if cond() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("condition not met within 5 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_clients_are_cut_off_without_hurting_others() {
    let ca = ca();
    let limits = Limits {
        handshake_timeout: Duration::from_millis(300),
        header_timeout: Duration::from_millis(300),
        ..Limits::default()
    };
    let server = start(&ca, limits).await;
    // A client that connects and says nothing.
    let mut silent = TcpStream::connect(server.addr).await.unwrap();
    // A client that starts a TLS handshake with garbage.
    let mut garbage = TcpStream::connect(server.addr).await.unwrap();
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    // A client that completes TLS, then sends half a header and stalls.
    let client = HttpsClient::new(&ca.cert, server.addr);
    let tls_cfg = {
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(ca.cert.as_bytes()).unwrap())
            .unwrap();
        rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth()
    };
    let tcp = TcpStream::connect(server.addr).await.unwrap();
    let mut slow = tokio_rustls::TlsConnector::from(Arc::new(tls_cfg))
        .connect(
            rustls::pki_types::ServerName::IpAddress(server.addr.ip().into()),
            tcp,
        )
        .await
        .unwrap();
    slow.write_all(b"POST /validate HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();

    // Meanwhile, normal traffic is served.
    let mut conn = client.connect().await.unwrap();
    let (status, _) = conn.post("/validate", review_body("u")).await.unwrap();
    assert_eq!(status, 200);

    // All three stalled connections are closed by the server: reading reaches EOF (after a TLS
    // alert for the garbage) or an error, instead of hanging.
    for (name, stream) in [("silent", &mut silent), ("garbage", &mut garbage)] {
        let mut out = Vec::new();
        let res = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut out)).await;
        assert!(res.is_ok(), "{name} connection was not closed");
    }
    let mut out = Vec::new();
    let res = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut out)).await;
    assert!(res.is_ok(), "the stalled header was not cut off");
    server.shutdown.send(true).unwrap();
}

/// On shutdown a pooled keep-alive connection is not closed under the client: the listener
/// refuses new connections, the next request on an open connection is answered with
/// `Connection: close` and the connection then ends, and an idle one is closed after the drain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_pooled_connections_then_closes_them() {
    let ca = ca();
    let limits = Limits {
        drain_timeout: Duration::from_millis(1500),
        ..Limits::default()
    };
    let server = start(&ca, limits).await;
    let client = HttpsClient::new(&ca.cert, server.addr);
    let mut busy = client.connect().await.unwrap();
    let first = busy.send("/validate", review_body("before")).await.unwrap();
    assert_eq!(first.status(), 200);
    assert!(first.headers().get("connection").is_none(), "{first:?}");
    let mut idle = client.connect().await.unwrap();
    assert_eq!(
        idle.post("/validate", review_body("idle")).await.unwrap().0,
        200
    );

    let started = std::time::Instant::now();
    server.shutdown.send(true).unwrap();
    // New connections are refused at once.
    let mut refused = false;
    for _ in 0..100 {
        if TcpStream::connect(server.addr).await.is_err() {
            refused = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(refused, "the listener still accepts after shutdown");
    // The pooled connection gets its answer, marked as the connection's last.
    let last = busy.send("/validate", review_body("during")).await.unwrap();
    assert_eq!(last.status(), 200);
    assert_eq!(last.headers()["connection"], "close");
    let v: Value = serde_json::from_slice(last.body()).unwrap();
    assert_eq!(v["response"]["uid"], "during");
    assert!(
        closed_soon(&busy.sender).await,
        "the connection answered with Connection: close stays open"
    );
    // The idle connection is closed after the drain, and serve returns.
    tokio::time::timeout(Duration::from_secs(10), server.task)
        .await
        .expect("serve did not return after the drain")
        .unwrap();
    let drained = started.elapsed();
    assert!(
        drained >= Duration::from_millis(1400),
        "closed before the drain ended: {drained:?}"
    );
    assert!(
        closed_soon(&idle.sender).await,
        "the idle connection is still open 2 s after serve returned"
    );
}

/// Whether the client side sees its connection closed within 2 s (its connection task reads
/// the end of the stream on its own schedule).
async fn closed_soon<B>(sender: &hyper::client::conn::http1::SendRequest<B>) -> bool {
    for _ in 0..200 {
        if sender.is_closed() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

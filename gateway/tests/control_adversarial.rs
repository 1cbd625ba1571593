//! Adversarial tests of the gateway's control plane: the KEDA ExternalScaler (odd metric names,
//! hundreds of push streams, flapping demand), demand aggregation over misbehaving peer
//! replicas (down, silent, garbage, huge numbers, itself), API keys reloaded from a mounted
//! Secret (symlink swaps, emptied, BOM, invalid UTF-8, deleted), the binary's SIGTERM drain, and
//! `/hearth/queue` + `/metrics` under concurrency.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    future::Future,
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicI64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use common::*;
use hearth_gateway::{
    EndpointSet, GatewayConfig, RunningGateway,
    apikeys::{ApiKeys, AuthOutcome},
    peers::PeerSet,
    scaler::pb::{
        GetMetricsRequest, ScaledObjectRef, external_scaler_client::ExternalScalerClient,
    },
};
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};
use tonic::{Code, transport::Channel};

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

const METRIC: &str = "hearth_queue_depth";

fn aggregated() -> GatewayConfig {
    GatewayConfig {
        aggregate_peers: true,
        ..config()
    }
}

/// Starts a cold request in the background (it is held: no backend).
fn hold(c: &HttpClient, g: &RunningGateway, stream: bool) -> tokio::task::JoinHandle<()> {
    let req = chat_req(&g.url(), &chat(stream));
    let c = c.clone();
    tokio::spawn(async move {
        let resp = send(&c, req).await;
        let _ = resp.into_body().collect().await;
    })
}

/// Reads push messages until none arrives for `quiet`; returns the last one (or `last`).
async fn last_pushed(
    s: &mut tonic::Streaming<hearth_gateway::scaler::pb::IsActiveResponse>,
    mut last: Option<bool>,
    quiet: Duration,
) -> Option<bool> {
    loop {
        match tokio::time::timeout(quiet, s.message()).await {
            Ok(Ok(Some(m))) => last = Some(m.result),
            Ok(other) => panic!("push stream ended: {other:?}"),
            Err(_) => return last,
        }
    }
}

/// Waits until `hearth_gateway_scaler_streams` is `n`.
async fn wait_streams_gauge(c: &HttpClient, g: &RunningGateway, n: f64) {
    within(10, "scaler streams gauge", async {
        loop {
            let m = gateway_metrics(c, g).await;
            if metric(&m, "hearth_gateway_scaler_streams") == Some(n) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

/// A raw TCP "peer gateway": for every connection, reads the request head and runs
/// `f(connection index, stream)`. Returns its `host:port`.
async fn raw_peer<F, Fut>(f: F) -> String
where
    F: Fn(usize, TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let l = TcpListener::bind(localhost()).await.unwrap();
    let addr = l.local_addr().unwrap();
    let f = Arc::new(f);
    accept_each(l, move |i, mut s| {
        let f = f.clone();
        async move {
            if read_head(&mut s).await.is_some() {
                f(i, s).await;
            }
        }
    });
    addr.to_string()
}

/// A `200` NDJSON head whose body runs until the connection closes.
const NDJSON_HEAD: &[u8] =
    b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\nconnection: close\r\n\r\n";

/// A raw peer that sends `body` after the head and then holds the connection open.
async fn raw_peer_sending(head: &'static [u8], body: Vec<u8>) -> String {
    let body = Arc::new(body);
    raw_peer(move |_, mut s| {
        let body = body.clone();
        async move {
            let _ = s.write_all(head).await;
            let _ = s.write_all(&body).await;
            let mut sink = [0u8; 64];
            while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
        }
    })
    .await
}

/// Asserts that the total demand stays unknown for `d` (checked on every change).
async fn assert_total_stays_unknown(g: &RunningGateway, d: Duration, why: &str) {
    let mut rx = g.gateway.demand().subscribe();
    let end = tokio::time::Instant::now() + d;
    loop {
        let total = rx.borrow_and_update().total();
        assert!(total.is_err(), "{why}: total became known: {total:?}");
        if tokio::time::timeout_at(end, rx.changed()).await.is_err() {
            return;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The ExternalScaler
// ---------------------------------------------------------------------------------------------

/// Odd metric names get `NOT_FOUND` naming the served metric (never a panic, never a value);
/// KEDA's forms (any ASCII case, `s<N>-` prefix) match. A request without a ScaledObjectRef, or
/// with empty metadata, is served.
#[tokio::test]
async fn get_metrics_answers_odd_names_with_not_found_naming_the_served_metric() {
    let gw = gateway(config(), EndpointSet::new()).await;
    let mut k = scaler_client(&gw).await;
    let long = "x".repeat(64 * 1024);
    let odd = [
        "",
        " ",
        " hearth_queue_depth",
        "hearth_queue_depth ",
        "hearth_queue_depth\n",
        "hearth_queue_depth\0",
        "hearth_queue_depthé",
        "hearth_queue_dépth",
        "ſ0-hearth_queue_depth",
        "s-hearth_queue_depth",
        "s0-",
        "s0",
        "s",
        "s0-s0-hearth_queue_depth",
        "s٣-hearth_queue_depth",
        "s0_hearth_queue_depth",
        "hearth-queue-depth",
        "🔥",
        long.as_str(),
    ];
    for name in odd {
        let e = k.get_metrics(metrics_req(name)).await.unwrap_err();
        assert_eq!(e.code(), Code::NotFound, "{name:?}: {e:?}");
        assert!(e.message().contains(METRIC), "{name:?}: {}", e.message());
    }
    for name in [
        "hearth_queue_depth",
        "HEARTH_QUEUE_DEPTH",
        "Hearth_Queue_Depth",
        "s0-hearth_queue_depth",
        "S17-HEARTH_QUEUE_DEPTH",
    ] {
        let m = k.get_metrics(metrics_req(name)).await.unwrap().into_inner();
        assert_eq!(m.metric_values.len(), 1, "{name:?}");
        assert_eq!(m.metric_values[0].metric_name, METRIC);
        assert_eq!(m.metric_values[0].metric_value, 0);
    }
    // No ScaledObjectRef at all, and an all-empty one.
    let m = k
        .get_metrics(GetMetricsRequest {
            scaled_object_ref: None,
            metric_name: METRIC.into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 0);
    let empty = ScaledObjectRef::default();
    assert!(
        !k.is_active(empty.clone())
            .await
            .unwrap()
            .into_inner()
            .result
    );
    let spec = k.get_metric_spec(empty.clone()).await.unwrap().into_inner();
    assert_eq!(spec.metric_specs[0].metric_name, METRIC);
    assert_eq!(spec.metric_specs[0].target_size_float, 1.0);
    let mut s = k.stream_is_active(empty).await.unwrap().into_inner();
    assert_eq!(s.message().await.unwrap().map(|m| m.result), Some(false));
}

/// `targetSize` metadata that is not a positive finite number is `INVALID_ARGUMENT` naming the
/// key; surrounding whitespace is accepted; the integer target is never 0.
#[tokio::test]
async fn get_metric_spec_rejects_every_non_positive_or_non_finite_target_size() {
    let gw = gateway(config(), EndpointSet::new()).await;
    let mut k = scaler_client(&gw).await;
    for v in [
        "", " ", "0", "-0", "-1", "NaN", "nan", "inf", "-inf", "1e999", "abc", "٣", "1,5", "0x10",
    ] {
        let e = k
            .get_metric_spec(so_ref(&[("targetSize", v)]))
            .await
            .unwrap_err();
        assert_eq!(e.code(), Code::InvalidArgument, "{v:?}");
        assert!(e.message().contains("targetSize"), "{v:?}: {}", e.message());
    }
    for (v, float, int) in [
        (" 2 ", 2.0, 2),
        ("0.0001", 0.0001, 1),
        ("1e6", 1e6, 1_000_000),
        ("2.5", 2.5, 3),
    ] {
        let spec = k
            .get_metric_spec(so_ref(&[("targetSize", v)]))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(spec.metric_specs[0].target_size_float, float, "{v:?}");
        assert_eq!(spec.metric_specs[0].target_size, int, "{v:?}");
    }
}

/// Hundreds of `StreamIsActive` streams (many on one HTTP/2 connection, many on their own) all
/// get the state at connect and every change; clients that vanish free their stream, and the
/// gauge follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hundreds_of_push_streams_all_see_changes_and_vanished_clients_are_released() {
    let gw = gateway(config(), EndpointSet::new()).await;
    let c = client();
    let shared = scaler_client(&gw).await;
    let mut on_shared = Vec::new();
    for _ in 0..250 {
        let mut k = shared.clone();
        on_shared.push(k.stream_is_active(so_ref(&[])).await.unwrap().into_inner());
    }
    let mut own = Vec::new();
    for _ in 0..50 {
        let mut k = scaler_client(&gw).await;
        let s = k.stream_is_active(so_ref(&[])).await.unwrap().into_inner();
        own.push((k, s));
    }
    wait_streams_gauge(&c, &gw, 300.0).await;
    within(20, "state at connect", async {
        for s in on_shared.iter_mut().chain(own.iter_mut().map(|(_, s)| s)) {
            assert_eq!(s.message().await.unwrap().map(|m| m.result), Some(false));
        }
    })
    .await;

    let slot = gw.gateway.demand().try_admit().unwrap();
    within(20, "active pushed to every stream", async {
        for s in on_shared.iter_mut().chain(own.iter_mut().map(|(_, s)| s)) {
            assert_eq!(s.message().await.unwrap().map(|m| m.result), Some(true));
        }
    })
    .await;

    // Half the streams on the shared connection are dropped; the 50 own-connection clients
    // vanish with their connection.
    on_shared.truncate(125);
    drop(own);
    wait_streams_gauge(&c, &gw, 125.0).await;
    // A client that opens a TCP connection, sends half a preface and leaves.
    for _ in 0..20 {
        let mut t = TcpStream::connect(gw.grpc).await.unwrap();
        t.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    }
    drop(slot);
    within(20, "inactive pushed to the remaining streams", async {
        for s in on_shared.iter_mut() {
            assert_eq!(s.message().await.unwrap().map(|m| m.result), Some(false));
        }
    })
    .await;
    drop(on_shared);
    drop(shared);
    wait_streams_gauge(&c, &gw, 0.0).await;
    // Still serving.
    let mut k = scaler_client(&gw).await;
    assert!(!k.is_active(so_ref(&[])).await.unwrap().into_inner().result);
}

/// Demand flapping 0 → 1 → 0 thousands of times from two threads: the last value pushed on
/// every stream equals the real final state, whichever it is, round after round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_streams_always_end_on_the_real_state_after_demand_flaps() {
    let gw = gateway(config(), EndpointSet::new()).await;
    let mut streams = Vec::new();
    for _ in 0..8 {
        let mut k = scaler_client(&gw).await;
        streams.push(k.stream_is_active(so_ref(&[])).await.unwrap().into_inner());
    }
    let mut last = vec![None; streams.len()];
    let hub = gw.gateway.demand().clone();
    for round in 0..12 {
        let flappers: Vec<_> = (0..2)
            .map(|t| {
                let hub = hub.clone();
                tokio::spawn(async move {
                    for i in 0..2000 {
                        let a = hub.try_admit();
                        if (i + t) % 13 == 0 {
                            tokio::task::yield_now().await;
                        }
                        drop(a);
                    }
                })
            })
            .collect();
        for f in flappers {
            f.await.unwrap();
        }
        let keep = (round % 2 == 0).then(|| hub.try_admit().unwrap());
        let want = hub.state().active();
        assert_eq!(want, Some(keep.is_some()));
        for (s, l) in streams.iter_mut().zip(last.iter_mut()) {
            *l = last_pushed(s, *l, Duration::from_millis(150)).await;
            assert_eq!(
                *l, want,
                "round {round}: last push differs from the real state"
            );
        }
        drop(keep);
    }
}

/// While the total demand is unknown (aggregation on, peers not discovered), `GetMetrics` and
/// (without local demand) `IsActive` are `UNAVAILABLE`, the push stream sends nothing, and
/// `/hearth/queue` is 503: never a 0. Local demand alone makes `IsActive` and the stream true,
/// while `GetMetrics` stays an error.
#[tokio::test]
async fn unknown_demand_is_an_error_everywhere_and_never_zero() {
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let mut k = scaler_client(&gw).await;
    let c = client();
    let e = k.get_metrics(metrics_req(METRIC)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let e = k.is_active(so_ref(&[])).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    let mut s = k.stream_is_active(so_ref(&[])).await.unwrap().into_inner();
    assert!(
        tokio::time::timeout(Duration::from_millis(300), s.message())
            .await
            .is_err(),
        "a push stream must not report an unknown state"
    );
    let (status, v) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    assert!(v["error"].is_string() && v.get("pending").is_none(), "{v}");
    let m = gateway_metrics(&c, &gw).await;
    assert!(!m.contains("hearth_gateway_demand_total "), "{m}");

    let held = hold(&c, &gw, false);
    assert_eq!(
        within(5, "push on local demand", s.message())
            .await
            .unwrap()
            .map(|m| m.result),
        Some(true)
    );
    assert!(k.is_active(so_ref(&[])).await.unwrap().into_inner().result);
    let e = k.get_metrics(metrics_req(METRIC)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    let (status, _) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let (status, v) = json(&c, &format!("{}/hearth/queue?scope=local", gw.admin_url())).await;
    assert_eq!((status, v["pending"].as_u64()), (StatusCode::OK, Some(1)));
    held.abort();
}

// ---------------------------------------------------------------------------------------------
// 2. Demand aggregation over peers
// ---------------------------------------------------------------------------------------------

/// A peer that is down (refuses connections) or never answers (accepts, sends nothing) keeps
/// the total unknown, and nothing the gateway serves waits for it.
#[tokio::test]
async fn down_or_silent_peers_make_the_total_unknown_and_nothing_waits_on_them() {
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let peers = PeerSet::new(gw.gateway.demand().clone());
    let down = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let silent = raw_peer(|_, s| async move {
        tokio::time::sleep(Duration::from_secs(120)).await;
        drop(s);
    })
    .await;
    // An unroutable address (TEST-NET-1): the connect itself hangs.
    peers.update(vec![down.clone(), silent.clone(), "192.0.2.1:8080".into()]);
    let c = client();
    let mut k = scaler_client(&gw).await;
    assert_total_stays_unknown(&gw, Duration::from_millis(800), "down/silent peers").await;
    let started = Instant::now();
    let (status, v) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    let e = k.get_metrics(metrics_req(METRIC)).await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert!(e.message().contains("peer"), "{}", e.message());
    let _ = gateway_metrics(&c, &gw).await;
    assert!(started.elapsed() < Duration::from_secs(1));
}

/// Peers answering garbage, wrong types, negative or fractional numbers, numbers beyond what a
/// replica can hold, or an error status, are unknown: the total never becomes known from them.
#[tokio::test]
async fn peers_answering_garbage_or_impossible_numbers_stay_unknown() {
    let bodies: [&[u8]; 12] = [
        b"not json\n",
        b"<html><body>502 Bad Gateway</body></html>\n",
        b"{\"demand\":-1}\n",
        b"{\"demand\":1.5}\n",
        b"{\"demand\":\"3\"}\n",
        b"{\"demand\":null}\n",
        b"{}\n",
        b"[1]\n",
        b"{\"demand\":18446744073709551616}\n",
        b"{\"demand\":18446744073709551615}\n",
        b"{\"demand\":9223372036854775808}\n",
        b"\xff\xfe\n",
    ];
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let peers = PeerSet::new(gw.gateway.demand().clone());
    let mut list = Vec::new();
    for b in bodies {
        list.push(raw_peer_sending(NDJSON_HEAD, b.to_vec()).await);
    }
    // A valid line with an error status, and a response that is not HTTP.
    list.push(
        raw_peer_sending(
            b"HTTP/1.1 500 Internal Server Error\r\nconnection: close\r\n\r\n",
            b"{\"demand\":0}\n".to_vec(),
        )
        .await,
    );
    list.push(raw_peer_sending(b"SSH-2.0-OpenSSH_9.6\r\n", Vec::new()).await);
    for peer in &list {
        peers.update(vec![peer.clone()]);
        assert_total_stays_unknown(&gw, Duration::from_millis(250), peer).await;
    }
    // All at once, for several reconnect cycles.
    peers.update(list);
    assert_total_stays_unknown(&gw, Duration::from_millis(800), "all garbage peers").await;
}

/// Peers reporting huge (but individually valid) demands: the total saturates instead of
/// wrapping around to a small number, and KEDA never sees a negative value.
#[tokio::test]
async fn huge_peer_demands_saturate_instead_of_wrapping() {
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let peers = PeerSet::new(gw.gateway.demand().clone());
    let max = i64::MAX;
    let a = raw_peer_sending(NDJSON_HEAD, format!("{{\"demand\":{max}}}\n").into_bytes()).await;
    let b = raw_peer_sending(NDJSON_HEAD, format!("{{\"demand\":{max}}}\n").into_bytes()).await;
    peers.update(vec![a, b]);
    let _slot = gw.gateway.demand().try_admit().unwrap();
    within(5, "peers known", wait_demand(&gw, |s| s.total().is_ok())).await;
    let total = gw.gateway.demand().state().total().unwrap();
    assert!(total >= i64::MAX as u64, "{total}");
    let mut k = scaler_client(&gw).await;
    let m = k
        .get_metrics(metrics_req(METRIC))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, i64::MAX);
    assert!(m.metric_values[0].metric_value_float > 9e18);
    assert!(k.is_active(so_ref(&[])).await.unwrap().into_inner().result);
    let c = client();
    let (status, v) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(status, StatusCode::OK);
    assert!(v["pending"].as_u64().unwrap() >= i64::MAX as u64, "{v}");
    let text = gateway_metrics(&c, &gw).await;
    let t = metric(&text, "hearth_gateway_demand_total").unwrap();
    assert!(t > 9e18, "{text}");
}

/// A peer that keeps sending bytes without ever ending a line is cut off after a bounded
/// amount, not buffered without bound; it is then unknown.
#[tokio::test]
async fn a_peer_sending_an_endless_line_is_cut_off() {
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let peers = PeerSet::new(gw.gateway.demand().clone());
    let written = Arc::new(AtomicUsize::new(0));
    let (cut_tx, mut cut_rx) = tokio::sync::mpsc::unbounded_channel::<bool>();
    let peer = {
        let written = written.clone();
        raw_peer(move |i, mut s| {
            let written = written.clone();
            let cut_tx = cut_tx.clone();
            async move {
                if i > 0 {
                    // Reconnections: hold, send nothing.
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    return;
                }
                let _ = s.write_all(NDJSON_HEAD).await;
                let _ = s.write_all(b"{\"demand\":1}\n").await;
                let chunk = vec![b' '; 64 * 1024];
                let limit = 64 * 1024 * 1024;
                while written.load(Ordering::Relaxed) < limit {
                    if s.write_all(&chunk).await.is_err() {
                        let _ = cut_tx.send(true);
                        return;
                    }
                    written.fetch_add(chunk.len(), Ordering::Relaxed);
                }
                let _ = cut_tx.send(false);
            }
        })
        .await
    };
    peers.update(vec![peer]);
    let cut = within(20, "endless line", cut_rx.recv()).await.unwrap();
    let n = written.load(Ordering::Relaxed);
    assert!(
        cut,
        "the gateway read {n} bytes of one line without cutting the peer off"
    );
    // Socket buffers on both sides account for a few MiB after the gateway stopped reading.
    assert!(n < 24 * 1024 * 1024, "{n} bytes accepted before the cut");
    within(
        5,
        "peer unknown after the cut",
        wait_demand(&gw, |s| s.total().is_err()),
    )
    .await;
}

/// A burst of many lines in one read is handled in linear time, and the last value wins.
#[tokio::test]
async fn a_burst_of_many_demand_lines_is_processed_quickly() {
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let peers = PeerSet::new(gw.gateway.demand().clone());
    let mut body = b"{\"demand\":1}\n".repeat(400_000);
    body.extend_from_slice(b"{\"demand\":7}\n");
    let peer = raw_peer_sending(NDJSON_HEAD, body).await;
    peers.update(vec![peer]);
    within(
        5,
        "5 MiB of demand lines",
        wait_demand(&gw, |s| s.total() == Ok(7)),
    )
    .await;
}

/// A peer that sends one valid line and then only trickles bytes (never another full line) is
/// not alive: after the silence limit its value is unknown, however many bytes trickle in.
#[tokio::test]
async fn a_peer_trickling_bytes_without_a_full_line_becomes_unknown() {
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let silence = Duration::from_millis(700);
    let peers = PeerSet::with_silence(gw.gateway.demand().clone(), silence);
    let peer = raw_peer(|i, mut s| async move {
        if i > 0 {
            tokio::time::sleep(Duration::from_secs(60)).await;
            return;
        }
        let _ = s.write_all(NDJSON_HEAD).await;
        let _ = s.write_all(b"{\"demand\":2}\n").await;
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            if s.write_all(b" ").await.is_err() {
                return;
            }
        }
    })
    .await;
    peers.update(vec![peer]);
    within(5, "peer known", wait_demand(&gw, |s| s.total() == Ok(2))).await;
    let known_at = Instant::now();
    within(
        5,
        "trickling peer unknown",
        wait_demand(&gw, |s| s.total().is_err()),
    )
    .await;
    assert!(
        known_at.elapsed() >= silence / 2,
        "{:?}",
        known_at.elapsed()
    );
}

/// A replica that finds itself in its own peer list (a missing or wrong `--pod-ip`, a second
/// address of the same pod) does not count its own demand twice.
#[tokio::test]
async fn a_replica_listed_as_its_own_peer_is_not_counted_twice() {
    let a = gateway(aggregated(), EndpointSet::new()).await;
    let b = gateway(aggregated(), EndpointSet::new()).await;
    let peers_a = PeerSet::new(a.gateway.demand().clone());
    let peers_b = PeerSet::new(b.gateway.demand().clone());
    peers_a.update(vec![a.admin.to_string(), b.admin.to_string()]);
    peers_b.update(vec![a.admin.to_string()]);
    within(5, "peers known", wait_demand(&a, |s| s.total().is_ok())).await;
    let c = client();
    let h1 = hold(&c, &a, false);
    let h2 = hold(&c, &b, true);
    within(
        5,
        "demand seen",
        wait_demand(&a, |s| s.pending() == 1 && s.total().is_ok_and(|t| t >= 2)),
    )
    .await;
    // Give a self-subscription time to report (it would make it 3).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(a.gateway.demand().state().total(), Ok(2));
    let mut k = scaler_client(&a).await;
    let m = k
        .get_metrics(metrics_req(METRIC))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 2);
    h1.abort();
    h2.abort();
}

/// A peer list that flaps hundreds of times settles on the last list: removed peers stop
/// counting, re-added ones start unknown, and no subscription outlives its peer's removal (the
/// peer sees exactly one connection in the end).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flapping_peer_lists_settle_and_leak_no_subscriptions() {
    let gw = gateway(aggregated(), EndpointSet::new()).await;
    let peers = PeerSet::new(gw.gateway.demand().clone());
    let open = Arc::new(AtomicI64::new(0));
    let counting = |value: u64| {
        let open = open.clone();
        raw_peer(move |_, mut s| {
            let open = open.clone();
            async move {
                open.fetch_add(1, Ordering::SeqCst);
                let _ = s.write_all(NDJSON_HEAD).await;
                let _ = s
                    .write_all(format!("{{\"demand\":{value}}}\n").as_bytes())
                    .await;
                // Until the gateway closes the connection.
                let mut sink = [0u8; 64];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                open.fetch_sub(1, Ordering::SeqCst);
            }
        })
    };
    let p = counting(3).await;
    let q = raw_peer_sending(NDJSON_HEAD, b"{\"demand\":4}\n".to_vec()).await;
    let lists = [
        vec![p.clone()],
        vec![],
        vec![q.clone(), p.clone()],
        vec![q.clone()],
    ];
    for i in 0..400 {
        peers.update(lists[i % lists.len()].clone());
        if i % 5 == 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    peers.update(vec![q.clone()]);
    within(
        5,
        "settled on [q]",
        wait_demand(&gw, |s| s.total() == Ok(4)),
    )
    .await;
    within(5, "p connections closed", async {
        while open.load(Ordering::SeqCst) != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    peers.update(vec![p.clone(), q.clone()]);
    within(5, "p and q", wait_demand(&gw, |s| s.total() == Ok(7))).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(open.load(Ordering::SeqCst), 1, "one subscription to p");
    peers.update(Vec::new());
    within(5, "no peers", wait_demand(&gw, |s| s.total() == Ok(0))).await;
}

/// A replica's `/hearth/local-demand` repeats its value every keepalive period even while its
/// state keeps changing without its local demand changing (its peers' values flap): otherwise
/// an idle replica in a busy cluster goes silent and its peers count it as unknown.
#[tokio::test]
async fn local_demand_keepalive_is_not_starved_by_changes_elsewhere() {
    let a = gateway(aggregated(), EndpointSet::new()).await;
    let hub = a.gateway.demand().clone();
    hub.set_peers(["192.0.2.7:8080".to_string()]);
    let flapper = tokio::spawn(async move {
        for i in 0u64.. {
            hub.set_peer_value("192.0.2.7:8080", Some(i % 2));
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });
    let c = client();
    let req = Request::get(format!("{}/hearth/local-demand", a.admin_url()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = send(&c, req).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let instance = resp.headers()[hearth_gateway::peers::INSTANCE_HEADER]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(instance.len(), 16, "{instance}");
    let mut body = resp.into_body();
    let mut times = Vec::new();
    let end = tokio::time::Instant::now() + Duration::from_millis(6500);
    while let Ok(Some(chunk)) = tokio::time::timeout_at(end, next_chunk(&mut body)).await {
        for l in std::str::from_utf8(&chunk).unwrap().lines() {
            assert_eq!(l, "{\"demand\":0}");
            times.push(Instant::now());
        }
    }
    flapper.abort();
    assert!(
        times.len() >= 2,
        "only {} demand line(s) in 6.5 s: the keepalive was starved",
        times.len()
    );
    let gap = times.windows(2).map(|w| w[1] - w[0]).max().unwrap();
    assert!(gap < Duration::from_secs(6), "{gap:?}");
}

// ---------------------------------------------------------------------------------------------
// 3. API keys from a mounted Secret
// ---------------------------------------------------------------------------------------------

/// A fresh temporary directory for one test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("hearth-ctl-adv-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A Secret volume as the kubelet writes it: `<dir>/<key> -> ..data/<key>`,
/// `..data -> ..<timestamp>`; returns the path of the key file.
fn secret_volume(dir: &Path, content: &[u8]) -> PathBuf {
    let ts = dir.join("..2026_11_30_11_00_00.000000001");
    std::fs::create_dir_all(&ts).unwrap();
    std::fs::write(ts.join("api-keys"), content).unwrap();
    std::os::unix::fs::symlink("..2026_11_30_11_00_00.000000001", dir.join("..data")).unwrap();
    std::os::unix::fs::symlink("..data/api-keys", dir.join("api-keys")).unwrap();
    dir.join("api-keys")
}

/// The kubelet's atomic update: a new timestamped directory, `..data` swapped by a rename, the
/// old directory removed.
fn secret_swap(dir: &Path, n: u32, content: &[u8]) {
    let name = format!("..2026_11_30_11_00_{n:02}.00000000{n}");
    let ts = dir.join(&name);
    std::fs::create_dir_all(&ts).unwrap();
    std::fs::write(ts.join("api-keys"), content).unwrap();
    let old = std::fs::read_link(dir.join("..data")).unwrap();
    std::os::unix::fs::symlink(&name, dir.join("..data_tmp")).unwrap();
    std::fs::rename(dir.join("..data_tmp"), dir.join("..data")).unwrap();
    std::fs::remove_dir_all(dir.join(old)).unwrap();
}

/// The status of `GET /v1/models` with `Authorization: Bearer <key>` (forwarded to the stub
/// when allowed).
async fn status_with_key(c: &HttpClient, g: &RunningGateway, key: &str) -> StatusCode {
    let req = Request::get(format!("{}/v1/models", g.url()))
        .header("authorization", format!("Bearer {key}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    send_full(c, req).await.0
}

/// Polls until `key` gets `want` (reloads run every second in tests).
async fn wait_key(c: &HttpClient, g: &RunningGateway, key: &str, want: StatusCode) {
    within(10, &format!("key {key:?} -> {want}"), async {
        while status_with_key(c, g, key).await != want {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

async fn keyed_gateway(path: &Path) -> (RunningGateway, ApiKeys, vllm_stub::RunningStub) {
    let stub = stub().await;
    let keys = ApiKeys::load(path).unwrap();
    let gw = gateway_with_keys(
        config(),
        EndpointSet::fixed([authority(&stub)]),
        keys.clone(),
    )
    .await;
    (gw, keys, stub)
}

/// Reloading follows the kubelet's `..data` symlink swap: the new keys are accepted and the
/// old ones refused, with no restart.
#[tokio::test]
async fn api_keys_reload_through_a_secret_symlink_swap() {
    let dir = temp_dir("swap");
    let path = secret_volume(&dir, b"sk-old\n");
    let (gw, _keys, _stub) = keyed_gateway(&path).await;
    let c = client();
    assert_eq!(status_with_key(&c, &gw, "sk-old").await, StatusCode::OK);
    assert_eq!(
        status_with_key(&c, &gw, "sk-new").await,
        StatusCode::UNAUTHORIZED
    );
    secret_swap(&dir, 2, b"sk-new\nsk-other\n");
    wait_key(&c, &gw, "sk-new", StatusCode::OK).await;
    assert_eq!(
        status_with_key(&c, &gw, "sk-old").await,
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(status_with_key(&c, &gw, "sk-other").await, StatusCode::OK);
    secret_swap(&dir, 3, b"sk-third\n");
    wait_key(&c, &gw, "sk-third", StatusCode::OK).await;
    assert_eq!(
        status_with_key(&c, &gw, "sk-new").await,
        StatusCode::UNAUTHORIZED
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An emptied key file (or one with only comments and blank lines) is an error on reload that
/// keeps the last good keys, not a silent lockout of every client; nor does it open the door.
#[tokio::test]
async fn an_emptied_key_file_keeps_the_last_good_keys() {
    let dir = temp_dir("empty");
    let path = secret_volume(&dir, b"sk-a\n");
    let (gw, keys, _stub) = keyed_gateway(&path).await;
    let c = client();
    for (n, empty) in [(2u32, &b""[..]), (3, b"\n\n# rotated\r\n   \n")] {
        secret_swap(&dir, n, empty);
        let err = keys.reload().unwrap_err().to_string();
        assert!(err.contains("api-keys") && err.contains("no key"), "{err}");
        // The background reload sees the same file: give it two rounds.
        tokio::time::sleep(Duration::from_millis(2200)).await;
        assert_eq!(status_with_key(&c, &gw, "sk-a").await, StatusCode::OK);
        assert_eq!(
            status_with_key(&c, &gw, "anything").await,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(status_with_key(&c, &gw, "").await, StatusCode::UNAUTHORIZED);
    }
    secret_swap(&dir, 4, b"sk-b\n");
    wait_key(&c, &gw, "sk-b", StatusCode::OK).await;
    assert_eq!(
        status_with_key(&c, &gw, "sk-a").await,
        StatusCode::UNAUTHORIZED
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// CRLF line endings, a UTF-8 byte order mark (files saved by Windows editors), blank lines,
/// comments and surrounding whitespace: every real key works, comments are not keys.
#[tokio::test]
async fn key_files_with_bom_crlf_comments_and_blank_lines_parse() {
    let dir = temp_dir("bom");
    let path = dir.join("keys");
    std::fs::write(
        &path,
        "\u{feff}sk-bom\r\n\r\n# sk-commented\r\n  sk-two  \r\n\tsk-tab\t\r\n".as_bytes(),
    )
    .unwrap();
    let (gw, _keys, _stub) = keyed_gateway(&path).await;
    let c = client();
    for key in ["sk-bom", "sk-two", "sk-tab"] {
        assert_eq!(status_with_key(&c, &gw, key).await, StatusCode::OK, "{key}");
    }
    for key in ["# sk-commented", "sk-commented", "\u{feff}sk-bom"] {
        let req = Request::get(format!("{}/v1/models", gw.url()))
            .header("authorization", format!("Bearer {key}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        assert_eq!(
            send_full(&c, req).await.0,
            StatusCode::UNAUTHORIZED,
            "{key}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A key file that turns into invalid UTF-8, or is deleted, is a reload error naming the flag
/// that keeps the last good keys; once it is back, its keys take over.
#[tokio::test]
async fn unreadable_or_deleted_key_files_keep_the_last_good_keys_until_fixed() {
    let dir = temp_dir("invalid");
    let path = dir.join("keys");
    std::fs::write(&path, b"sk-a\n").unwrap();
    let (gw, keys, _stub) = keyed_gateway(&path).await;
    let c = client();

    std::fs::write(&path, b"sk-\xff\xfe\nsk-b\n").unwrap();
    let err = keys.reload().unwrap_err().to_string();
    assert!(err.contains("--api-key-file"), "{err}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(status_with_key(&c, &gw, "sk-a").await, StatusCode::OK);
    assert_eq!(
        status_with_key(&c, &gw, "sk-b").await,
        StatusCode::UNAUTHORIZED
    );

    std::fs::remove_file(&path).unwrap();
    let err = keys.reload().unwrap_err().to_string();
    assert!(err.contains("--api-key-file"), "{err}");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(status_with_key(&c, &gw, "sk-a").await, StatusCode::OK);

    std::fs::write(&path, b"sk-c\n").unwrap();
    wait_key(&c, &gw, "sk-c", StatusCode::OK).await;
    assert_eq!(
        status_with_key(&c, &gw, "sk-a").await,
        StatusCode::UNAUTHORIZED
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A very large key file (200 000 keys, ~5 MB) loads and reloads; any of its keys works.
#[tokio::test]
async fn a_very_large_key_file_loads_and_reloads() {
    let dir = temp_dir("large");
    let path = dir.join("keys");
    let content: String = (0..200_000).map(|i| format!("sk-{i:020}\n")).collect();
    std::fs::write(&path, &content).unwrap();
    let (gw, keys, _stub) = keyed_gateway(&path).await;
    let c = client();
    assert_eq!(
        status_with_key(&c, &gw, &format!("sk-{:020}", 199_999)).await,
        StatusCode::OK
    );
    assert_eq!(
        status_with_key(&c, &gw, "sk-00000000000000200000").await,
        StatusCode::UNAUTHORIZED
    );
    assert!(!keys.reload().unwrap(), "same content: no change");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Every refused credential gets `401`, `WWW-Authenticate: Bearer` and an OpenAI error body,
/// counts as `unauthorized`, and raises no demand (a cold backend is not woken).
#[tokio::test]
async fn unauthorized_requests_get_openai_errors_and_raise_no_demand() {
    let dir = temp_dir("401");
    let path = dir.join("keys");
    std::fs::write(&path, b"sk-a\n").unwrap();
    let gw = gateway_with_keys(config(), EndpointSet::new(), ApiKeys::load(&path).unwrap()).await;
    let c = client();
    let bad: [Option<&[u8]>; 9] = [
        None,
        Some(b"Bearer"),
        Some(b"Bearer "),
        Some(b"Bearer    "),
        Some(b"Basic sk-a"),
        Some(b"Bearer sk-b"),
        Some(b"Bearer sk-a2"),
        Some(b"Bearer sk-\xff"),
        Some(b"sk-a"),
    ];
    for auth in bad {
        let mut req = Request::post(format!("{}/v1/chat/completions", gw.url()))
            .header("content-type", "application/json");
        if let Some(a) = auth {
            req = req.header("authorization", http::HeaderValue::from_bytes(a).unwrap());
        }
        let req = req
            .body(Full::new(Bytes::from(chat(false).to_string())))
            .unwrap();
        let (status, headers, body) = send_full(&c, req).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{auth:?}");
        assert_eq!(headers["www-authenticate"], "Bearer", "{auth:?}");
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with("application/json")
        );
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert_eq!(e["type"], "invalid_request_error", "{v}");
        assert_eq!(e["code"], "invalid_api_key", "{v}");
        assert!(e.get("param").is_some_and(|p| p.is_null()), "{v}");
    }
    let s = gw.gateway.demand().state();
    assert_eq!((s.pending(), s.lease()), (0, false), "401s raised demand");
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_rejections_total{reason=\"unauthorized\"}"
        ),
        Some(bad.len() as f64),
        "{m}"
    );
    // The admin port takes no API key: it has tokens of its own (crate::admin).
    let (status, _) = get(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(status, StatusCode::OK);
    // The client port does not serve it, key or no key.
    let (status, _) = get(&c, &format!("{}/hearth/queue", gw.url())).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--api-key-reload-interval` under 100 ms is refused at start, naming the flag; the library's
/// `ApiKeys::watch` raises a shorter interval to the minimum instead of letting tokio's
/// interval panic and end reloads for good.
#[tokio::test]
async fn a_zero_reload_interval_is_refused_by_the_binary_and_raised_by_the_library() {
    let err = refused(&[
        "--backend-url=http://127.0.0.1:1",
        "--api-key-reload-interval=0s",
    ]);
    assert!(err.contains("--api-key-reload-interval"), "{err}");

    let dir = temp_dir("zero-interval");
    let path = secret_volume(&dir, b"sk-old\n");
    let keys = ApiKeys::load(&path).unwrap();
    let watcher = tokio::spawn(keys.clone().watch(Duration::ZERO));
    secret_swap(&dir, 2, b"sk-new\n");
    within(5, "new key loaded", async {
        while !matches!(keys.check(Some(b"Bearer sk-new")), AuthOutcome::Allowed(_)) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(!watcher.is_finished(), "the reload task is still running");
    watcher.abort();
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// 4. SIGTERM drain of the binary
// ---------------------------------------------------------------------------------------------

/// `/hearth/queue?scope=local` of the binary (at its admin port's `admin`), waited on until
/// `pending` is `n`.
async fn wait_local_pending(c: &HttpClient, admin: &str, n: u64) {
    within(10, &format!("local demand {n}"), async {
        loop {
            let (_, v) = json(c, &format!("{admin}/hearth/queue?scope=local")).await;
            if v["pending"].as_u64() == Some(n) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// After SIGTERM: readiness 503, a new request gets 503 + `Connection: close`, the in-flight
/// stream goes on; a second SIGTERM exits promptly (status 0) without waiting for it.
#[tokio::test]
async fn a_second_sigterm_exits_promptly_with_a_stream_in_flight() {
    let stub = long_stub(Duration::from_millis(20)).await;
    let (child, base, admin) = spawn_gateway(&[
        format!("--backend-url={}", stub.url()),
        "--drain-timeout=60s".into(),
    ]);
    let c = client();
    wait_status(&c, &format!("{base}/readyz"), StatusCode::OK).await;
    let resp = send(&c, chat_req(&base, &chat(true))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut body = resp.into_body();
    next_chunk(&mut body).await.unwrap();

    sigterm(&child);
    wait_status(
        &c,
        &format!("{base}/readyz"),
        StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    let (status, headers, b) = send_full(&c, chat_req(&base, &chat(false))).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{b:?}");
    assert_eq!(headers["connection"], "close");
    assert!(headers.contains_key("retry-after"));
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
    assert!(v["error"]["message"].is_string(), "{v}");
    // The stream still flows during the drain.
    within(5, "stream during drain", next_chunk(&mut body))
        .await
        .unwrap();
    wait_local_pending(&c, &admin, 1).await;

    let asked = Instant::now();
    sigterm(&child);
    let status = exit_within(child, 10).await;
    assert!(status.success(), "{status:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
}

/// SIGTERM while requests are held for a backend that is not there yet: they stay held through
/// the drain and are answered once the backend comes up; then the process exits 0.
#[tokio::test]
async fn sigterm_while_requests_are_held_cold_lets_them_finish_when_the_backend_arrives() {
    let port = free_port();
    let (child, base, admin) = spawn_gateway(&[
        format!("--backend-url=http://127.0.0.1:{port}"),
        "--drain-timeout=30s".into(),
        "--activation-timeout=30s".into(),
    ]);
    let c = client();
    wait_status(&c, &format!("{base}/readyz"), StatusCode::OK).await;
    let plain = {
        let (c, req) = (c.clone(), chat_req(&base, &chat(false)));
        tokio::spawn(async move { send_full(&c, req).await })
    };
    let streaming = {
        let (c, req) = (c.clone(), chat_req(&base, &chat(true)));
        tokio::spawn(async move { send_full(&c, req).await })
    };
    wait_local_pending(&c, &admin, 2).await;

    sigterm(&child);
    wait_status(
        &c,
        &format!("{base}/readyz"),
        StatusCode::SERVICE_UNAVAILABLE,
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _stub = vllm_stub::spawn(stub_config(), format!("127.0.0.1:{port}").parse().unwrap())
        .await
        .unwrap();
    let (s1, _, b1) = within(10, "held request", plain).await.unwrap();
    assert_eq!(s1, StatusCode::OK, "{b1:?}");
    let (s2, _, b2) = within(10, "held stream", streaming).await.unwrap();
    assert_eq!(s2, StatusCode::OK);
    assert!(b2.ends_with(b"data: [DONE]\n\n"), "{b2:?}");
    let status = exit_within(child, 10).await;
    assert!(status.success(), "{status:?}");
}

/// A request held past `--drain-timeout` does not keep the process alive: it exits 0 soon
/// after the timeout, and the held client gets an answer or a closed connection (no hang).
#[tokio::test]
async fn the_drain_timeout_bounds_a_request_held_cold() {
    let port = free_port();
    let (child, base, admin) = spawn_gateway(&[
        format!("--backend-url=http://127.0.0.1:{port}"),
        "--drain-timeout=1s".into(),
        "--activation-timeout=60s".into(),
    ]);
    let c = client();
    wait_status(&c, &format!("{base}/readyz"), StatusCode::OK).await;
    let held = {
        let req = chat_req(&base, &chat(true));
        let c = c.clone();
        tokio::spawn(async move {
            if let Ok(r) = c.request(req).await {
                let _ = r.into_body().collect().await;
            }
        })
    };
    wait_local_pending(&c, &admin, 1).await;
    let asked = Instant::now();
    sigterm(&child);
    let status = exit_within(child, 10).await;
    assert!(status.success(), "{status:?}");
    let took = asked.elapsed();
    assert!(took >= Duration::from_millis(900), "{took:?}");
    assert!(took < Duration::from_secs(6), "{took:?}");
    within(5, "held client released", held).await.unwrap();
}

/// An open KEDA push stream neither blocks SIGTERM's drain nor keeps the process alive: the
/// gateway exits 0 within a few seconds and the stream ends (KEDA reconnects elsewhere).
#[tokio::test]
async fn an_open_keda_push_stream_does_not_hold_the_process_after_sigterm() {
    let stub = stub().await;
    let Spawned {
        child, http, grpc, ..
    } = spawn_gateway_at(
        "127.0.0.1",
        &[
            format!("--backend-url={}", stub.url()),
            "--drain-timeout=30s".into(),
        ],
    );
    let c = client();
    wait_status(
        &c,
        &format!("http://127.0.0.1:{http}/readyz"),
        StatusCode::OK,
    )
    .await;
    let ch = within(10, "gRPC connect", async {
        loop {
            if let Ok(ch) = Channel::from_shared(format!("http://127.0.0.1:{grpc}"))
                .unwrap()
                .connect()
                .await
            {
                return ch;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let mut k = ExternalScalerClient::new(ch);
    let mut s = k.stream_is_active(so_ref(&[])).await.unwrap().into_inner();
    assert_eq!(s.message().await.unwrap().map(|m| m.result), Some(false));
    let asked = Instant::now();
    sigterm(&child);
    let status = exit_within(child, 10).await;
    assert!(status.success(), "{status:?}");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "{:?}",
        asked.elapsed()
    );
    let end = within(5, "push stream ends", s.message()).await;
    assert!(!matches!(end, Ok(Some(_))), "{end:?}");
}

// ---------------------------------------------------------------------------------------------
// 5. /hearth/queue and /metrics under concurrency
// ---------------------------------------------------------------------------------------------

/// Every `hearth_gateway_*` sample in a scrape is non-negative.
fn assert_no_negative_samples(text: &str) {
    for l in text.lines().filter(|l| l.starts_with("hearth_gateway_")) {
        let v: f64 = l.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(v >= 0.0, "negative sample: {l}");
    }
}

/// 100 clients race for 40 slots while `/hearth/queue` and `/metrics` are scraped: pending
/// never exceeds the bound nor goes negative; once every client has vanished, pending is 0 and
/// the counters add up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_returns_to_zero_and_counters_add_up_after_clients_vanish() {
    let cfg = GatewayConfig {
        max_queue: 40,
        ..config()
    };
    let gw = gateway(cfg, EndpointSet::new()).await;
    let c = client();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let scraper = {
        let (c, stop, base) = (c.clone(), stop.clone(), gw.admin_url());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                let (status, v) = json(&c, &format!("{base}/hearth/queue?scope=local")).await;
                assert_eq!(status, StatusCode::OK);
                let p = v["pending"]
                    .as_u64()
                    .expect("pending is a non-negative integer");
                assert!(p <= 40, "{v}");
                let (_, m) = get(&c, &format!("{base}/metrics")).await;
                assert_no_negative_samples(std::str::from_utf8(&m).unwrap());
                n += 1;
            }
            n
        })
    };
    let statuses = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut clients = Vec::new();
    for i in 0..100 {
        let req = chat_req(&gw.url(), &chat(i % 2 == 0));
        let (c, statuses) = (c.clone(), statuses.clone());
        clients.push(tokio::spawn(async move {
            let resp = send(&c, req).await;
            statuses.lock().unwrap().push(resp.status());
            let _ = resp.into_body().collect().await;
        }));
    }
    within(10, "40 admitted", async {
        loop {
            let n429 = statuses
                .lock()
                .unwrap()
                .iter()
                .filter(|s| **s == StatusCode::TOO_MANY_REQUESTS)
                .count();
            if gw.gateway.demand().state().pending() == 40 && n429 == 60 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    for t in &clients {
        t.abort();
    }
    within(
        10,
        "pending back to 0",
        wait_demand(&gw, |s| s.pending() == 0),
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    assert!(scraper.await.unwrap() > 0);
    let m = gateway_metrics(&c, &gw).await;
    assert_no_negative_samples(&m);
    assert_eq!(metric(&m, "hearth_gateway_pending"), Some(0.0), "{m}");
    assert_eq!(
        metric(&m, "hearth_gateway_rejections_total{reason=\"queue_full\"}"),
        Some(60.0),
        "{m}"
    );
    within(5, "canceled counted", async {
        loop {
            let m = gateway_metrics(&c, &gw).await;
            if metric(&m, "hearth_gateway_requests_canceled_total") == Some(40.0) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // The lease still holds the replica's demand at 1 (the model was asked for).
    let (_, v) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(v["pending"], 1, "{v}");
}

/// Warm streams whose clients vanish mid-stream free their slots and the backend's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pending_returns_to_zero_after_warm_streams_are_abandoned() {
    let stub = long_stub(Duration::from_millis(10)).await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let c = client();
    let mut bodies = Vec::new();
    for _ in 0..30 {
        let resp = send(&c, chat_req(&gw.url(), &chat(true))).await;
        assert_eq!(resp.status(), StatusCode::OK);
        let mut b = resp.into_body();
        next_chunk(&mut b).await.unwrap();
        bodies.push(b);
    }
    assert_eq!(gw.gateway.demand().state().pending(), 30);
    drop(bodies);
    within(
        10,
        "pending back to 0",
        wait_demand(&gw, |s| s.pending() == 0),
    )
    .await;
    within(10, "backend stopped generating", async {
        while stub.state.running() != 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let (_, v) = json(&c, &format!("{}/hearth/queue", gw.admin_url())).await;
    assert_eq!(v["pending"], 0, "{v}");
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(metric(&m, "hearth_gateway_pending"), Some(0.0));
    assert_no_negative_samples(&m);
}

/// Concurrent scrapes of a replica whose total demand is known all show
/// `hearth_gateway_demand_total`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_scrapes_always_show_a_known_total() {
    let gw = gateway(config(), EndpointSet::new()).await;
    let missing = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (url, missing) = (gw.admin_url(), missing.clone());
        tasks.push(tokio::spawn(async move {
            let c = client();
            for _ in 0..1500 {
                let (_, m) = get(&c, &format!("{url}/metrics")).await;
                let m = String::from_utf8(m.to_vec()).unwrap();
                if metric(&m, "hearth_gateway_demand_total").is_none() {
                    missing.fetch_add(1, Ordering::Relaxed);
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        missing.load(Ordering::Relaxed),
        0,
        "scrapes without demand_total"
    );
}

/// `Metrics::encode_with_total`, which the scrape above uses: concurrent encodes with a known
/// total all show it, and it is absent while unknown.
#[test]
fn encode_with_total_shows_a_known_total_to_every_concurrent_scrape() {
    let m = Arc::new(hearth_gateway::metrics::Metrics::new());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let m = m.clone();
            std::thread::spawn(move || {
                (0..2000)
                    .filter(|_| {
                        !m.encode_with_total(Some(3))
                            .contains("\nhearth_gateway_demand_total 3\n")
                    })
                    .count()
            })
        })
        .collect();
    let missing: usize = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert_eq!(missing, 0);
    let text = m.encode_with_total(None);
    assert!(!text.contains("hearth_gateway_demand_total "), "{text}");
}

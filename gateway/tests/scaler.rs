//! The KEDA ExternalScaler service through a real tonic client, and demand aggregation over
//! gateway replicas.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use common::*;
use hearth_gateway::{EndpointSet, GatewayConfig, RunningGateway, peers::PeerSet};
use hyper::StatusCode;
use tonic::Code;

#[tokio::test]
async fn is_active_metric_spec_and_metrics() {
    let backends = EndpointSet::new();
    let gw = gateway(config(), backends.clone()).await;
    let mut k = scaler_client(&gw).await;

    assert!(!k.is_active(so_ref(&[])).await.unwrap().into_inner().result);

    let spec = k.get_metric_spec(so_ref(&[])).await.unwrap().into_inner();
    assert_eq!(spec.metric_specs.len(), 1);
    assert_eq!(spec.metric_specs[0].metric_name, "hearth_queue_depth");
    assert_eq!(spec.metric_specs[0].target_size, 1);
    assert_eq!(spec.metric_specs[0].target_size_float, 1.0);
    let spec = k
        .get_metric_spec(so_ref(&[("targetSize", "2.5")]))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(spec.metric_specs[0].target_size_float, 2.5);
    let e = k
        .get_metric_spec(so_ref(&[("targetSize", "-1")]))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("targetSize"), "{}", e.message());

    let m = k
        .get_metrics(metrics_req("hearth_queue_depth"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 0);
    assert_eq!(m.metric_values[0].metric_value_float, 0.0);
    let e = k.get_metrics(metrics_req("queue")).await.unwrap_err();
    assert_eq!(e.code(), Code::NotFound);
    assert!(e.message().contains("hearth_queue_depth"));

    // Two held requests: active, value 2 under any casing of the name.
    let c = client();
    let mut held = Vec::new();
    for _ in 0..2 {
        let req = chat_req(&gw.url(), &chat(false));
        let c2 = c.clone();
        held.push(tokio::spawn(async move { send_full(&c2, req).await }));
    }
    wait_demand(&gw, |s| s.pending() == 2).await;
    assert!(k.is_active(so_ref(&[])).await.unwrap().into_inner().result);
    for name in ["HEARTH_QUEUE_DEPTH", "s0-hearth_queue_depth"] {
        let m = k.get_metrics(metrics_req(name)).await.unwrap().into_inner();
        assert_eq!(m.metric_values[0].metric_name, "hearth_queue_depth");
        assert_eq!(m.metric_values[0].metric_value, 2);
        assert_eq!(m.metric_values[0].metric_value_float, 2.0);
    }
    for h in held {
        h.abort();
    }
}

#[tokio::test]
async fn stream_is_active_pushes_at_connect_and_on_every_change() {
    let stub = stub().await;
    let backends = EndpointSet::new();
    let gw = gateway(config(), backends.clone()).await;
    let mut k = scaler_client(&gw).await;
    let mut stream = k.stream_is_active(so_ref(&[])).await.unwrap().into_inner();
    assert!(
        !stream.message().await.unwrap().unwrap().result,
        "state at connect"
    );

    let c = client();
    let m = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(&m, "hearth_gateway_scaler_streams"),
        Some(1.0),
        "{m}"
    );

    let req = chat_req(&gw.url(), &chat(false));
    let task = tokio::spawn({
        let c = c.clone();
        async move { send_full(&c, req).await }
    });
    assert!(
        stream.message().await.unwrap().unwrap().result,
        "first cold request"
    );
    backends.replace([authority(&stub)]);
    assert_eq!(task.await.unwrap().0, StatusCode::OK);
    // Request done and the lease's grace passed: inactive again.
    assert!(!stream.message().await.unwrap().unwrap().result);
    drop(stream);
    wait_metric_zero(&c, &gw).await;
}

async fn wait_metric_zero(c: &HttpClient, gw: &RunningGateway) {
    loop {
        let m = gateway_metrics(c, gw).await;
        if metric(&m, "hearth_gateway_scaler_streams") == Some(0.0) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn aggregated() -> GatewayConfig {
    GatewayConfig {
        aggregate_peers: true,
        ..config()
    }
}

#[tokio::test]
async fn demand_is_aggregated_over_replicas_and_unknown_when_a_peer_is_lost() {
    let a = gateway(aggregated(), EndpointSet::new()).await;
    let b = gateway(aggregated(), EndpointSet::new()).await;
    let peers_a = PeerSet::new(a.gateway.demand().clone());
    let peers_b = PeerSet::new(b.gateway.demand().clone());
    let mut k = scaler_client(&a).await;
    let c = client();

    // Before the peer list is known, the total is an error, not 0.
    let e = k
        .get_metrics(metrics_req("hearth_queue_depth"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    let (status, v) = json(&c, &format!("{}/hearth/queue", a.admin_url())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(v["error"].as_str().unwrap().contains("peer"));

    peers_a.update(vec![b.admin.to_string()]);
    peers_b.update(vec![a.admin.to_string()]);
    wait_demand(&a, |s| s.total().is_ok()).await;
    let mut stream = k.stream_is_active(so_ref(&[])).await.unwrap().into_inner();
    assert!(!stream.message().await.unwrap().unwrap().result);

    // A cold request on B: A's push stream turns active, A's metrics see it.
    let req = chat_req(&b.url(), &chat(false));
    let held = tokio::spawn({
        let c = c.clone();
        async move { send_full(&c, req).await }
    });
    assert!(stream.message().await.unwrap().unwrap().result);
    wait_demand(&a, |s| s.total() == Ok(1)).await;
    let m = k
        .get_metrics(metrics_req("hearth_queue_depth"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 1);
    let (_, v) = json(&c, &format!("{}/hearth/queue", a.admin_url())).await;
    assert_eq!(v["pending"], 1);
    let (_, v) = json(&c, &format!("{}/hearth/queue?scope=local", a.admin_url())).await;
    assert_eq!(v["pending"], 0);
    // The path form the controller renders (KEDA's endpoint aggregation drops a query).
    let (_, v) = json(&c, &format!("{}/hearth/queue/local", a.admin_url())).await;
    assert_eq!(v["pending"], 0);
    let (_, v) = json(&c, &format!("{}/hearth/queue", b.admin_url())).await;
    assert_eq!(v["pending"], 1);

    // B goes away: A reports an error instead of a low number.
    held.abort();
    b.gateway.stop();
    wait_demand(&a, |s| s.total().is_err()).await;
    let e = k
        .get_metrics(metrics_req("hearth_queue_depth"))
        .await
        .unwrap_err();
    assert_eq!(e.code(), Code::Unavailable);
    assert!(
        e.message().contains(&b.admin.to_string()),
        "{}",
        e.message()
    );
    // Removing B from the peers (its endpoint left the Service) makes the total known again.
    peers_a.update(Vec::new());
    let m = k
        .get_metrics(metrics_req("hearth_queue_depth"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 0);
}

/// Warm requests one after another flip demand between 0 and 1 on every request. The push
/// stream and a peer's demand stream report that at most about every `BUSY_RECHECK` instead of
/// twice per request (each report a wake-up in the request's path), and still end on the real
/// state; the rise from idle is pushed at once.
#[tokio::test]
async fn sequential_warm_requests_are_reported_coarsely_and_end_on_the_real_state() {
    let stub = stub().await;
    let gw = gateway(config(), EndpointSet::fixed([authority(&stub)])).await;
    let mut k = scaler_client(&gw).await;
    let mut stream = k.stream_is_active(so_ref(&[])).await.unwrap().into_inner();
    assert!(!stream.message().await.unwrap().unwrap().result);
    let c = client();
    let get = hyper::Request::get(format!("{}/hearth/local-demand", gw.admin_url()))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let mut peer_view = send(&c, get).await.into_body();
    assert_eq!(
        next_chunk(&mut peer_view).await.unwrap(),
        "{\"demand\":0}\n"
    );

    // The first request after idle is pushed at once, before it is answered.
    let mut body = chat(false);
    body["stub_token_delay"] = "200ms".into();
    let slow = tokio::spawn({
        let c = c.clone();
        let req = chat_req(&gw.url(), &body);
        async move { send_full(&c, req).await }
    });
    let pushed = within(1, "push of the rise", stream.message()).await;
    assert!(pushed.unwrap().unwrap().result);
    assert!(
        !slow.is_finished(),
        "pushed while the request was in flight"
    );
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);

    // Both streams are read as they go: every report counted, and the last one kept.
    let pushes = Arc::new((AtomicUsize::new(0), AtomicBool::new(true)));
    let p = pushes.clone();
    tokio::spawn(async move {
        while let Ok(Some(m)) = stream.message().await {
            p.0.fetch_add(1, Ordering::SeqCst);
            p.1.store(m.result, Ordering::SeqCst);
        }
    });
    let lines = Arc::new((AtomicUsize::new(0), AtomicBool::new(false)));
    let l = lines.clone();
    tokio::spawn(async move {
        while let Some(chunk) = next_chunk(&mut peer_view).await {
            l.0.fetch_add(
                chunk.iter().filter(|b| **b == b'\n').count(),
                Ordering::SeqCst,
            );
            l.1.store(!chunk.ends_with(b"{\"demand\":0}\n"), Ordering::SeqCst);
        }
    });
    // The slow request has been answered: both report idle before the next requests.
    let idle = |s: &Arc<(AtomicUsize, AtomicBool)>| !s.1.load(Ordering::SeqCst);
    within(2, "idle reported", async {
        while !(idle(&pushes) && idle(&lines)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let before = (
        pushes.0.load(Ordering::SeqCst),
        lines.0.load(Ordering::SeqCst),
    );
    let requests = 300;
    for _ in 0..requests {
        let (status, _, _) = send_full(&c, chat_req(&gw.url(), &chat(false))).await;
        assert_eq!(status, StatusCode::OK);
    }
    // Both settle on the real state, idle, soon after the last request.
    within(2, "idle reported after the requests", async {
        while !(idle(&pushes) && idle(&lines)) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let pushed = pushes.0.load(Ordering::SeqCst) - before.0;
    let lined = lines.0.load(Ordering::SeqCst) - before.1;
    assert!(
        pushed >= 2 && pushed < requests / 4 && lined < requests / 4,
        "{pushed} pushes and {lined} peer lines for {requests} requests"
    );
}

/// A KEDA connection that goes silent without closing (its node lost) is closed by the
/// gateway's HTTP/2 keepalive, releasing its push stream, instead of being held until TCP gives
/// up. The connection runs through a relay that stops forwarding, keeping both sockets open.
#[tokio::test]
async fn a_silent_scaler_connection_is_closed_by_keepalive() {
    let gw = gateway(
        GatewayConfig {
            scaler_keepalive: Duration::from_millis(300),
            ..config()
        },
        EndpointSet::new(),
    )
    .await;
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let (freeze, frozen) = tokio::sync::watch::channel(false);
    let target = gw.grpc;
    tokio::spawn(async move {
        let (mut client, _) = relay.accept().await.unwrap();
        let mut server = tokio::net::TcpStream::connect(target).await.unwrap();
        let mut frozen = frozen;
        tokio::select! {
            _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
            _ = frozen.wait_for(|f| *f) => {}
        }
        // Silent from here on, both sockets open.
        std::future::pending::<()>().await;
        drop((client, server));
    });
    let ch = tonic::transport::Channel::from_shared(format!("http://{relay_addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut k = hearth_gateway::scaler::pb::external_scaler_client::ExternalScalerClient::new(ch);
    let mut stream = k.stream_is_active(so_ref(&[])).await.unwrap().into_inner();
    assert!(!stream.message().await.unwrap().unwrap().result);
    let c = client();
    let streams = |c: HttpClient, gw_metrics: String| async move {
        let (_, m) = get(&c, &gw_metrics).await;
        metric(
            &String::from_utf8_lossy(&m),
            "hearth_gateway_scaler_streams",
        )
    };
    let url = format!("{}/metrics", gw.admin_url());
    // Alive and answering PINGs: the stream stays for several keepalive rounds.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(streams(c.clone(), url.clone()).await, Some(1.0));
    freeze.send_replace(true);
    within(5, "the silent connection's stream released", async {
        while streams(c.clone(), url.clone()).await != Some(0.0) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

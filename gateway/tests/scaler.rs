//! The KEDA ExternalScaler service through a real tonic client, and demand aggregation over
//! gateway replicas.

mod common;

use std::time::Duration;

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
    let (status, v) = json(&c, &format!("{}/hearth/queue", a.url())).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(v["error"].as_str().unwrap().contains("peer"));

    peers_a.update(vec![b.http.to_string()]);
    peers_b.update(vec![a.http.to_string()]);
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
    let (_, v) = json(&c, &format!("{}/hearth/queue", a.url())).await;
    assert_eq!(v["pending"], 1);
    let (_, v) = json(&c, &format!("{}/hearth/queue?scope=local", a.url())).await;
    assert_eq!(v["pending"], 0);
    let (_, v) = json(&c, &format!("{}/hearth/queue", b.url())).await;
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
    assert!(e.message().contains(&b.http.to_string()), "{}", e.message());
    // Removing B from the peers (its endpoint left the Service) makes the total known again.
    peers_a.update(Vec::new());
    let m = k
        .get_metrics(metrics_req("hearth_queue_depth"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 0);
}

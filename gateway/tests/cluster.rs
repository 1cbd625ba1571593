//! Discovery against the local control plane of `tests/cluster/` (start it with
//! `tests/cluster/up`, or run `tests/run-tests`): the real EndpointSlice watch feeding a real
//! gateway, and the RBAC-forbidden fallback signal.

mod common;

use std::time::Duration;

use common::*;
use hearth_gateway::{
    EndpointSet,
    discovery::{DiscoveryError, SliceSource, watch_endpoints},
};
use hearth_test_support::Cluster;
use hyper::StatusCode;
use k8s_openapi::api::{core::v1::ServiceAccount, discovery::v1::EndpointSlice};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};

/// A slice for Service `service` with one endpoint at `127.0.0.1:<port>`, managed by the test
/// (so the EndpointSlice controller leaves it alone).
fn slice(name: &str, service: &str, port: u16, ready: bool, terminating: bool) -> EndpointSlice {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/service-name": service,
                "endpointslice.kubernetes.io/managed-by": "hearth-gateway-tests",
            },
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
        "endpoints": [{
            "addresses": ["127.0.0.1"],
            "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
        }],
    }))
    .unwrap()
}

#[tokio::test]
async fn endpointslice_watch_forwards_a_held_request_when_the_backend_turns_ready() {
    let cluster = Cluster::connect().await.unwrap();
    let ns = cluster.namespace("gw-discovery").await.unwrap();
    let slices: Api<EndpointSlice> = ns.api();
    let stub = stub().await;
    let port = stub.addr.port();
    slices
        .create(&PostParams::default(), &slice("backend-a", "backend", port, false, false))
        .await
        .unwrap();

    let backends = EndpointSet::new();
    let feed = backends.clone();
    let source = SliceSource {
        namespace: ns.name().to_owned(),
        service: "backend".into(),
        port_name: None,
    };
    let watch = tokio::spawn(watch_endpoints(ns.client(), source, move |eps| feed.replace(eps)));
    let gw = gateway(config(), backends.clone()).await;
    let c = client();

    // Not ready: the request is held.
    let req = post_req(&format!("{}/v1/chat/completions", gw.url()), &chat(false), &[]);
    let held = tokio::spawn({
        let c = c.clone();
        async move { send_full(&c, req).await }
    });
    wait_demand(&gw, |s| s.pending() == 1).await;
    assert!(!backends.is_ready());

    // The kubelet marks the pod ready: the watch delivers it and the request goes through.
    let pp = PatchParams::default();
    slices
        .patch("backend-a", &pp, &Patch::Merge(slice("backend-a", "backend", port, true, false)))
        .await
        .unwrap();
    let (status, _, _) = held.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(stub.state.received(), 1);

    // Terminating: out of the set at once, so new requests are cold again.
    slices
        .patch("backend-a", &pp, &Patch::Merge(slice("backend-a", "backend", port, true, true)))
        .await
        .unwrap();
    let mut rx = backends.subscribe();
    rx.wait_for(|e| e.is_empty()).await.unwrap();

    // A second slice of the same Service adds its endpoints; deleting it removes them.
    slices
        .create(&PostParams::default(), &slice("backend-b", "backend", port, true, false))
        .await
        .unwrap();
    rx.wait_for(|e| e.len() == 1).await.unwrap();
    slices.delete("backend-b", &Default::default()).await.unwrap();
    rx.wait_for(|e| e.is_empty()).await.unwrap();
    watch.abort();
}

#[tokio::test]
async fn a_forbidden_watch_is_reported_so_the_gateway_can_fall_back() {
    let cluster = Cluster::connect().await.unwrap();
    let ns = cluster.namespace("gw-forbidden").await.unwrap();
    let accounts: Api<ServiceAccount> = ns.api();
    let sa: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "no-rbac"}})).unwrap();
    accounts.create(&PostParams::default(), &sa).await.unwrap();

    // The admin kubeconfig, impersonating a service account that has no RBAC at all.
    let kubeconfig = Kubeconfig::read_from(cluster.kubeconfig()).unwrap();
    let mut cfg = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .unwrap();
    cfg.auth_info.impersonate = Some(format!("system:serviceaccount:{}:no-rbac", ns.name()));
    let client = kube::Client::try_from(cfg).unwrap();
    let source = SliceSource {
        namespace: ns.name().to_owned(),
        service: "backend".into(),
        port_name: None,
    };
    let err = tokio::time::timeout(
        Duration::from_secs(60),
        watch_endpoints(client, source, |_| panic!("no endpoints may be seen")),
    )
    .await
    .expect("the watch must give up on 403 instead of retrying forever");
    assert!(matches!(err, DiscoveryError::Forbidden { .. }), "{err}");
    assert!(err.to_string().contains("endpointslices"), "{err}");
}

//! Discovery against the local control plane of `tests/cluster/` (start it with
//! `tests/cluster/up`, or run `tests/run-tests`): the real EndpointSlice watch feeding a real
//! endpoint set, and the RBAC-forbidden fallback signal.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use hearth_gateway::{
    EndpointSet,
    discovery::{DiscoveryError, SliceSource, watch_endpoints},
};
use hearth_test_support::Cluster;
use k8s_openapi::api::{core::v1::ServiceAccount, discovery::v1::EndpointSlice};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
    config::{KubeConfigOptions, Kubeconfig},
};

/// A slice for Service `service` with one endpoint at `<ip>:8000`, managed by the test (so the
/// EndpointSlice controller leaves it alone). The API refuses loopback addresses in
/// EndpointSlices, so these are TEST-NET-1 addresses (RFC 5737) that are never dialed: the
/// forwarding itself is tested in process (`tests/proxy.rs`, through an [`EndpointSet`] as the
/// watch feeds it), this test proves what the watch delivers; no gateway runs on these sets so
/// nothing ever dials them.
fn slice(name: &str, service: &str, ip: &str, ready: bool, terminating: bool) -> EndpointSlice {
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
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [{
            "addresses": [ip],
            "conditions": {"ready": ready, "serving": ready, "terminating": terminating},
        }],
    }))
    .unwrap()
}

fn authorities(set: &hearth_gateway::endpoints::Endpoints) -> Vec<String> {
    set.iter().map(|e| e.authority().to_string()).collect()
}

#[tokio::test]
async fn endpointslice_watch_tracks_ready_non_terminating_endpoints() {
    let cluster = Cluster::connect().await.unwrap();
    let ns = cluster.namespace("gw-discovery").await.unwrap();
    let slices: Api<EndpointSlice> = ns.api();
    slices
        .create(
            &PostParams::default(),
            &slice("backend-a", "backend", "192.0.2.10", false, false),
        )
        .await
        .unwrap();
    // A slice of another Service in the same namespace is never picked up.
    slices
        .create(
            &PostParams::default(),
            &slice("other-a", "other", "192.0.2.99", true, false),
        )
        .await
        .unwrap();

    let backends = EndpointSet::new();
    let feed = backends.clone();
    let source = SliceSource {
        namespace: ns.name().to_owned(),
        service: "backend".into(),
        port_name: None,
    };
    let updates = Arc::new(AtomicUsize::new(0));
    let counted = updates.clone();
    let watch = tokio::spawn(watch_endpoints(ns.client(), source, move |eps| {
        counted.fetch_add(1, Ordering::SeqCst);
        feed.replace(eps);
    }));
    let mut rx = backends.subscribe();
    // The initial list is delivered, with the not-ready endpoint left out.
    while updates.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!backends.is_ready());

    // The kubelet marks the pod ready: the watch delivers it.
    let pp = PatchParams::default();
    slices
        .patch(
            "backend-a",
            &pp,
            &Patch::Merge(slice("backend-a", "backend", "192.0.2.10", true, false)),
        )
        .await
        .unwrap();
    rx.wait_for(|e| authorities(e) == ["192.0.2.10:8000"])
        .await
        .unwrap();

    // Terminating: out of the set at once.
    slices
        .patch(
            "backend-a",
            &pp,
            &Patch::Merge(slice("backend-a", "backend", "192.0.2.10", true, true)),
        )
        .await
        .unwrap();
    rx.wait_for(|e| e.is_empty()).await.unwrap();

    // A second slice of the same Service adds its endpoints; deleting it removes them.
    slices
        .create(
            &PostParams::default(),
            &slice("backend-b", "backend", "192.0.2.11", true, false),
        )
        .await
        .unwrap();
    rx.wait_for(|e| authorities(e) == ["192.0.2.11:8000"])
        .await
        .unwrap();
    slices
        .delete("backend-b", &Default::default())
        .await
        .unwrap();
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

//! The admin port with the controller's tokens: each caller's token opens its own paths, the
//! client port serves none of them, and peer replicas' demand reports carry the gateway's own
//! token (a replica without it cannot read its peer's demand, so the total stays unknown
//! instead of silently low).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use hearth_crds::admin::{
    AUTHORIZED_KEY, AuthorizedToken, AuthorizedTokens, Scope, TOKEN_KEY, digest_hex,
};
use hearth_gateway::{
    EndpointSet, Gateway, GatewayConfig, RunningGateway, admin::AdminAuth, apikeys::ApiKeys,
    peers::PeerSet,
};
use http_body_util::Full;
use hyper::{Request, StatusCode};

/// Writes an admin Secret's two files into `dir`.
fn write_secret(dir: &Path, own: &str) {
    std::fs::write(dir.join(TOKEN_KEY), own).unwrap();
    let tokens = [
        ("controller", "ctl-token", Scope::Admin),
        ("keda", "keda-token", Scope::Scaler),
        ("prometheus", "prom-token", Scope::Metrics),
    ]
    .into_iter()
    .map(|(name, t, scope)| AuthorizedToken {
        name: name.to_owned(),
        sha256: digest_hex(t),
        scope,
    })
    .collect();
    std::fs::write(
        dir.join(AUTHORIZED_KEY),
        serde_json::to_string(&AuthorizedTokens { tokens }).unwrap(),
    )
    .unwrap();
}

async fn authenticated(cfg: GatewayConfig, dir: &Path) -> (RunningGateway, AdminAuth) {
    let auth = AdminAuth::load(dir).unwrap();
    let g = hearth_gateway::spawn_with_admin(
        Gateway::new(cfg, EndpointSet::new(), ApiKeys::disabled()).unwrap(),
        "127.0.0.1".parse().unwrap(),
        auth.clone(),
    )
    .await
    .unwrap();
    (g, auth)
}

async fn get_as(c: &HttpClient, url: &str, token: Option<&str>) -> (StatusCode, String, String) {
    let mut req = Request::get(url);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let (status, headers, body) = send_full(c, req.body(Full::new(Bytes::new())).unwrap()).await;
    let www = headers
        .get("www-authenticate")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (status, www, String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn each_token_opens_its_own_paths_and_the_client_port_serves_none() {
    let dir = tempfile::tempdir().unwrap();
    write_secret(dir.path(), "own-token");
    let (g, _) = authenticated(config(), dir.path()).await;
    let c = client();
    let admin = g.admin_url();
    let table: &[(&str, Option<&str>, StatusCode)] = &[
        ("/metrics", None, StatusCode::UNAUTHORIZED),
        ("/hearth/queue", None, StatusCode::UNAUTHORIZED),
        ("/hearth/local-demand", None, StatusCode::UNAUTHORIZED),
        (
            "/hearth/metering",
            Some("not-a-token"),
            StatusCode::UNAUTHORIZED,
        ),
        ("/metrics", Some("prom-token"), StatusCode::OK),
        ("/hearth/queue", Some("prom-token"), StatusCode::FORBIDDEN),
        ("/hearth/queue/local", Some("keda-token"), StatusCode::OK),
        (
            "/hearth/queue?scope=local",
            Some("keda-token"),
            StatusCode::OK,
        ),
        ("/metrics", Some("keda-token"), StatusCode::FORBIDDEN),
        (
            "/hearth/metering",
            Some("keda-token"),
            StatusCode::FORBIDDEN,
        ),
        ("/hearth/metering", Some("ctl-token"), StatusCode::OK),
        (
            "/hearth/adapter-failures",
            Some("ctl-token"),
            StatusCode::OK,
        ),
        ("/hearth/queue/local", Some("ctl-token"), StatusCode::OK),
        ("/hearth/quota-usage", Some("own-token"), StatusCode::OK),
        ("/metrics", Some("own-token"), StatusCode::OK),
    ];
    for (path, token, want) in table {
        let (status, www, body) = get_as(&c, &format!("{admin}{path}"), *token).await;
        assert_eq!(status, *want, "{path} with {token:?}: {body}");
        if *want == StatusCode::UNAUTHORIZED {
            assert!(www.starts_with("Bearer"), "{path}: {www:?}");
            assert!(body.contains("Authorization: Bearer"), "{body}");
        }
        if *want == StatusCode::FORBIDDEN {
            assert!(body.contains("does not open"), "{body}");
        }
    }
    // The client port answers the admin paths 404 naming the admin port, token or not, and
    // never proxies them to the backend.
    for path in [
        "/metrics",
        "/hearth/queue",
        "/hearth/queue/local",
        "/hearth/metering",
        // As an engine that normalizes paths would read them.
        "/metrics/",
        "//metrics",
        "/%6Detrics",
        "/v1/../metrics",
        "/hearth/queue/",
    ] {
        let (status, _, body) = get_as(&c, &format!("{}{path}", g.url()), Some("ctl-token")).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
        assert!(body.contains("admin port"), "{body}");
    }
    let (status, _, _) = get_as(&c, &format!("{}/readyz", g.url()), None).await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn peers_report_demand_with_the_gateway_token_and_a_replica_without_it_is_refused() {
    let cfg = || GatewayConfig {
        aggregate_peers: true,
        ..config()
    };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_secret(da.path(), "shared-token");
    write_secret(db.path(), "shared-token");
    let (a, auth_a) = authenticated(cfg(), da.path()).await;
    let (b, auth_b) = authenticated(cfg(), db.path()).await;
    let peers_a = PeerSet::new(a.gateway.demand().clone()).authenticated(auth_a.clone());
    let peers_b = PeerSet::new(b.gateway.demand().clone()).authenticated(auth_b.clone());
    peers_a.update(vec![b.admin.to_string()]);
    peers_b.update(vec![a.admin.to_string()]);
    wait_demand(&a, |s| s.total().is_ok()).await;

    // A cold request on B is in A's total.
    let c = client();
    let req = chat_req(&b.url(), &chat(false));
    let held = tokio::spawn({
        let c = c.clone();
        async move { send_full(&c, req).await }
    });
    wait_demand(&a, |s| s.total() == Ok(1)).await;

    // A third replica that lacks the token cannot subscribe to B: its total stays unknown.
    let dc = tempfile::tempdir().unwrap();
    write_secret(dc.path(), "another-token");
    let (x, auth_x) = authenticated(cfg(), dc.path()).await;
    let peers_x = PeerSet::new(x.gateway.demand().clone()).authenticated(auth_x);
    peers_x.update(vec![b.admin.to_string()]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let total = x.gateway.demand().state().total();
    assert!(
        total
            .as_ref()
            .is_err_and(|e| e.0.contains(&b.admin.to_string())),
        "{total:?}"
    );
    // Nor can one that sends no token at all.
    let peers_open = PeerSet::new(x.gateway.demand().clone());
    peers_open.update(vec![b.admin.to_string()]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(x.gateway.demand().state().total().is_err());

    // A rotated token (the Secret rewritten on both) takes over without a restart: the old
    // one is refused, the new one sent.
    write_secret(da.path(), "rotated-token");
    write_secret(db.path(), "rotated-token");
    assert!(auth_a.reload().unwrap());
    assert!(auth_b.reload().unwrap());
    assert_eq!(auth_a.own_token().as_deref(), Some("rotated-token"));
    let queue = format!("{}/hearth/queue", b.admin_url());
    let (status, _, _) = get_as(&c, &queue, Some("shared-token")).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, _, _) = get_as(&c, &queue, Some("rotated-token")).await;
    assert_eq!(status, StatusCode::OK);
    held.abort();
}

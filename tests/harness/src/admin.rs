//! A gateway's admin port (demand, `/metrics`, metering), reached as the gateway's own replicas
//! reach it: the pod's IP on port [`hearth_crds::admin::PORT`], with the gateway's own token
//! from its admin Secret `<owner>-gateway-admin` (docs/gateway.md, "Admin port").

use std::time::Duration;

use anyhow::{Context, Result};
use hearth_crds::admin::{PORT, TOKEN_KEY};
use k8s_openapi::api::core::v1::Secret;
use kube::{Api, Client};

use crate::client::{self, ChatError};

/// The gateway's own token: key `token` of the Secret `<owner>-gateway-admin` in `namespace`
/// (`owner`: the LLMService with its own gateway, or the LLMEndpoint), waited for up to 60 s
/// (the controller writes it before the gateway Deployment).
///
/// # Errors
/// The Secret or its key did not appear.
pub async fn token(client: &Client, namespace: &str, owner: &str) -> Result<String> {
    let name = format!("{owner}-gateway-admin");
    let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(t) = api
            .get_opt(&name)
            .await
            .with_context(|| format!("reading Secret {namespace}/{name}"))?
            .and_then(|s| s.data)
            .and_then(|d| d.get(TOKEN_KEY).cloned())
        {
            return String::from_utf8(t.0).context("the admin token is not UTF-8");
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the controller did not write Secret {namespace}/{name} within 60s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `http://<ip>:<admin port>` (brackets for IPv6).
pub fn url(ip: &str) -> String {
    if ip.contains(':') {
        format!("http://[{ip}]:{PORT}")
    } else {
        format!("http://{ip}:{PORT}")
    }
}

/// GETs `url` with `Authorization: Bearer <token>`: the status and the body.
///
/// # Errors
/// The request failed or took longer than `timeout`.
pub async fn get(url: &str, token: &str, timeout: Duration) -> Result<(u16, String), ChatError> {
    let bearer = format!("Bearer {token}");
    client::get_with_headers(url, &[("authorization", bearer.as_str())], timeout).await
}

/// The IPs of the running gateway pods of `owner` (label `serving.hearth.dev/gateway`).
///
/// # Errors
/// The API's.
pub async fn pod_ips(client: &Client, namespace: &str, owner: &str) -> Result<Vec<String>> {
    use k8s_openapi::api::core::v1::Pod;
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods
        .list(
            &kube::api::ListParams::default()
                .labels(&format!("serving.hearth.dev/gateway={owner}")),
        )
        .await
        .with_context(|| format!("listing the gateway pods of {namespace}/{owner}"))?;
    Ok(list
        .items
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running"))
        .filter_map(|p| p.status.as_ref()?.pod_ip.clone())
        .collect())
}

/// `GET <path>` of the admin port of one running gateway pod of `owner`, with the gateway's
/// own token: the status and the body.
///
/// # Errors
/// No running pod, the token's Secret missing, the request failed.
pub async fn get_owner(
    client: &Client,
    namespace: &str,
    owner: &str,
    path: &str,
    timeout: Duration,
) -> Result<(u16, String)> {
    let token = token(client, namespace, owner).await?;
    let ip = pod_ips(client, namespace, owner)
        .await?
        .into_iter()
        .next()
        .with_context(|| format!("no running gateway pod of {namespace}/{owner}"))?;
    Ok(get(&format!("{}{path}", url(&ip)), &token, timeout).await?)
}

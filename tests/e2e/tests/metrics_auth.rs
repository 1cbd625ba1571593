//! The controller's and the webhook's `/metrics` of the installed release, scraped from the
//! host through their Services (the host routes the Service range into the real node) as
//! Prometheus would, with the apiserver's real TokenReview and SubjectAccessReview behind them:
//!
//! - no token, or a token the apiserver does not know: `401`;
//! - the token of a ServiceAccount not bound to `hearth-metrics-reader`: `403`;
//! - the token of one bound to it (TokenRequest, as the kubelet mounts them): `200` and the
//!   component's metrics;
//! - `/healthz` needs no token.
//!
//! Installs the release with `tests/cluster/install-hearth` unless it is there (the harness's
//! `ensure_hearth`). Needs a cluster with its real node and Hearth's images (`build/images`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::stack::{ensure_hearth, wait_reachable};
use hearth_test_support::{Cluster, Observed, wait_until};
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Service, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::Api;
use kube::api::PostParams;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use serde_json::json;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

const RELEASE_NAMESPACE: &str = "hearth-system";
const READER_ROLE: &str = "hearth-metrics-reader";

/// Accepts any server certificate: the controller's is self-signed, made at its start, and
/// what this suite checks is who may scrape, not the certificate.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `GET https://<addr><path>` with an optional bearer token: the status and the body.
async fn get(addr: &str, path: &str, token: Option<&str>) -> Result<(u16, String)> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
        .with_no_client_auth();
    get_with(addr, path, token, config, "hearth.invalid").await
}

/// [`get`] verifying the server's certificate against `ca_pem` for the name `server_name`, as
/// the chart's ServiceMonitor does.
async fn get_verified(
    addr: &str,
    path: &str,
    ca_pem: &str,
    server_name: &str,
) -> Result<(u16, String)> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    get_with(addr, path, None, config, server_name).await
}

async fn get_with(
    addr: &str,
    path: &str,
    token: Option<&str>,
    config: rustls::ClientConfig,
    server_name: &str,
) -> Result<(u16, String)> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let work = async {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let mut tls = connector
            .connect(ServerName::try_from(server_name)?.to_owned(), tcp)
            .await?;
        let auth = token
            .map(|t| format!("Authorization: Bearer {t}\r\n"))
            .unwrap_or_default();
        tls.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
        let mut raw = Vec::new();
        // A server may close without TLS close_notify; what was read is the answer.
        let _ = tls.read_to_end(&mut raw).await;
        let text = String::from_utf8_lossy(&raw).into_owned();
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .with_context(|| format!("no HTTP status in {text:?}"))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        anyhow::Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(15), work)
        .await
        .with_context(|| format!("GET https://{addr}{path} timed out"))?
        .with_context(|| format!("GET https://{addr}{path}"))
}

/// `<ClusterIP>:<port>` of a Service's first port.
async fn service_addr(client: &kube::Client, name: &str) -> Result<String> {
    let svc = Api::<Service>::namespaced(client.clone(), RELEASE_NAMESPACE)
        .get(name)
        .await
        .with_context(|| format!("Service {RELEASE_NAMESPACE}/{name}"))?;
    let spec = svc.spec.unwrap_or_default();
    let ip = spec.cluster_ip.context("no ClusterIP")?;
    let port = spec
        .ports
        .unwrap_or_default()
        .first()
        .map(|p| p.port)
        .context("no port")?;
    Ok(if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    })
}

/// A token of `namespace/name` from the TokenRequest API (ten minutes, the apiserver's
/// audience).
async fn token(client: &kube::Client, namespace: &str, name: &str) -> Result<String> {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    sas.create(
        &PostParams::default(),
        &serde_json::from_value(json!({"metadata": {"name": name}}))?,
    )
    .await
    .with_context(|| format!("creating ServiceAccount {namespace}/{name}"))?;
    let request = TokenRequest {
        spec: TokenRequestSpec {
            expiration_seconds: Some(600),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = sas
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .with_context(|| format!("TokenRequest for {namespace}/{name}"))?;
    Ok(answer.status.context("TokenRequest without status")?.token)
}

/// Deletes the ClusterRoleBinding on drop (the namespace takes the rest), with kubectl: the
/// test's kube client cannot be driven from `drop` on the test's own runtime.
struct Binding(std::process::Command);

impl Drop for Binding {
    fn drop(&mut self) {
        let _ = self.0.output();
    }
}

#[tokio::test]
async fn metrics_need_a_token_allowed_to_get_them() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    ensure_hearth(&client, cluster.kubeconfig()).await?;
    let ns = cluster.namespace("metrics-auth").await?;

    let reader = token(&client, ns.name(), "reader").await?;
    let stranger = token(&client, ns.name(), "stranger").await?;
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    let binding_name = format!("{}-metrics-reader", ns.name());
    bindings
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": binding_name},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                            "name": READER_ROLE},
                "subjects": [{"kind": "ServiceAccount", "name": "reader",
                              "namespace": ns.name()}],
            }))?,
        )
        .await
        .context("binding the reader to hearth-metrics-reader")?;
    let mut delete = cluster.kubectl()?;
    delete.args([
        "delete",
        "clusterrolebinding",
        &binding_name,
        "--ignore-not-found",
        "--wait=false",
    ]);
    let _binding = Binding(delete);

    let mut table = Vec::new();
    for (service, metric) in [
        (
            "hearth-controller-metrics",
            "hearth_controller_reconciles_total",
        ),
        ("hearth-webhook", "hearth_webhook_policies"),
    ] {
        let addr = service_addr(&client, service).await?;
        ensure!(
            wait_reachable(&format!("https://{addr}"), Duration::from_secs(30)).await,
            "{service} ({addr}) is not reachable from the host"
        );
        let (status, _) = get(&addr, "/healthz", None).await?;
        ensure!(
            status == 200,
            "{service} /healthz without a token: {status}"
        );
        let (status, _) = get(&addr, "/metrics", None).await?;
        ensure!(
            status == 401,
            "{service} /metrics without a token: {status}"
        );
        let (status, _) = get(&addr, "/metrics", Some("not-a-token")).await?;
        ensure!(
            status == 401,
            "{service} /metrics with a bad token: {status}"
        );
        let (status, _) = get(&addr, "/metrics", Some(&stranger)).await?;
        ensure!(
            status == 403,
            "{service} /metrics with an unbound ServiceAccount's token: {status}"
        );
        // The authorizer sees the new binding through an informer: wait for it.
        let body = wait_until(
            format!("{service} serves /metrics to the bound reader"),
            Duration::from_secs(60),
            || async {
                let (status, body) = get(&addr, "/metrics", Some(&reader)).await?;
                Ok(if status == 200 {
                    Observed::Ready(body)
                } else {
                    Observed::NotYet(format!("status {status}"))
                })
            },
        )
        .await?;
        ensure!(
            body.contains(metric),
            "{service} /metrics lacks {metric}: {body}"
        );
        // Still refused after the reader got in (answers are cached per token).
        let (status, _) = get(&addr, "/metrics", Some(&stranger)).await?;
        ensure!(
            status == 403,
            "{service} /metrics, stranger again: {status}"
        );
        table.push(format!(
            "{service:<26} {addr:<22} none 401, bad 401, unbound 403, bound 200 ({metric})"
        ));
    }
    // The controller's certificate verifies against the CA it publishes (the chart's
    // ServiceMonitor scrapes that way), for the metrics Service's name and no other.
    let ca =
        Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client.clone(), RELEASE_NAMESPACE)
            .get("hearth-controller-metrics-ca")
            .await
            .context("ConfigMap hearth-controller-metrics-ca")?
            .data
            .and_then(|d| d.get("ca.crt").cloned())
            .context("no ca.crt in ConfigMap hearth-controller-metrics-ca")?;
    let addr = service_addr(&client, "hearth-controller-metrics").await?;
    let name = format!("hearth-controller-metrics.{RELEASE_NAMESPACE}.svc");
    let (status, _) = get_verified(&addr, "/healthz", &ca, &name).await?;
    ensure!(
        status == 200,
        "verified /healthz of the controller: {status}"
    );
    ensure!(
        get_verified(&addr, "/healthz", &ca, "hearth-webhook.hearth-system.svc")
            .await
            .is_err(),
        "the controller's certificate verified for another name"
    );
    table.push(format!(
        "hearth-controller-metrics  {addr:<22} certificate verified against ConfigMap hearth-controller-metrics-ca for {name}"
    ));
    eprintln!("{}", table.join("\n"));
    Ok(())
}

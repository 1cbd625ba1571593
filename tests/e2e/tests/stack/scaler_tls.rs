//! Probes of a gateway's ExternalScaler over mutual TLS, from the host, as KEDA connects: the
//! push suite (a service's own gateway) and the shared endpoint suite (an LLMEndpoint's).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use hearth_test_support::{Observed, TestNamespace, wait_until};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Api;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The annotation recording the ExternalScaler certificates' issuance.
pub const RECORD: &str = hearth_controller::scaler_tls::RECORD_ANNOTATION;

/// The models' NetworkPolicies (the cluster installs Hearth with `networkPolicy.models`) admit
/// only KEDA's namespace on the scaler port of gateway `gateway` (the `serving.hearth.dev/
/// gateway` label: a service's or an endpoint's name); a suite probing it from the host adds a
/// policy of its own in `ns` admitting the host's address there (policies add up), and waits
/// until a TCP connection to `addr` gets through.
pub async fn open_scaler_port_to_the_host(
    ns: &TestNamespace,
    gateway: &str,
    addr: &str,
) -> Result<()> {
    let node = hearth_test_support::RealNode::load()?;
    let policy: NetworkPolicy = serde_json::from_value(serde_json::json!({
        "metadata": {"name": format!("e2e-host-to-{gateway}-scaler")},
        "spec": {
            "podSelector": {"matchLabels": {"serving.hearth.dev/gateway": gateway}},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{"ipBlock": {"cidr": format!("{}/32", node.host_ip)}}],
                "ports": [{"protocol": "TCP", "port": 9090}],
            }],
        },
    }))?;
    ns.api::<NetworkPolicy>()
        .create(&kube::api::PostParams::default(), &policy)
        .await?;
    wait_until(
        format!("the host to reach the scaler port {addr}"),
        Duration::from_secs(30),
        || async {
            Ok(
                match tokio::time::timeout(
                    Duration::from_secs(2),
                    tokio::net::TcpStream::connect(addr),
                )
                .await
                {
                    Ok(Ok(_)) => Observed::Ready(()),
                    other => Observed::NotYet(format!("{other:?}")),
                },
            )
        },
    )
    .await
}

/// A client certificate for DNS name `name`, signed by Hearth's scaler CA with the key the test
/// reads from the controller's keys Secret: what a stranger holding the CA's signature but not
/// the right name would present.
pub async fn signed_by_the_scaler_ca(
    client: &kube::Client,
    name: &str,
    like: &Material,
) -> Result<Material> {
    let keys = Api::<Secret>::namespaced(client.clone(), "hearth-system")
        .get("hearth-controller-keys")
        .await?;
    let field = |k: &str| -> Result<String> {
        let v = keys
            .data
            .as_ref()
            .and_then(|d| d.get(k))
            .with_context(|| format!("hearth-controller-keys has no {k}"))?;
        Ok(String::from_utf8(v.0.clone())?)
    };
    let ca_not_after = time::OffsetDateTime::parse(
        field("scaler-ca.not-after")?.trim(),
        &time::format_description::well_known::Rfc3339,
    )?;
    let issued = hearth_net::pki::issue(
        "hearth-scaler-ca",
        &field("scaler-ca.key")?,
        ca_not_after,
        hearth_net::pki::Usage::Client,
        "keda",
        &[name.to_owned()],
        Duration::from_secs(3600),
    )?;
    Ok(Material {
        cert: issued.cert,
        key: issued.key,
        ..like.clone()
    })
}

/// KEDA's TLS material, as its (Cluster)TriggerAuthentication reads it from a Secret.
#[derive(Clone)]
pub struct Material {
    /// `ca.crt`: the bundle the gateway's certificate is checked against.
    pub ca: String,
    /// `tls.crt`.
    pub cert: String,
    /// `tls.key`.
    pub key: String,
}

impl Material {
    /// Reads `ca.crt`, `tls.crt` and `tls.key` of Secret `name`.
    pub async fn read(secrets: &Api<Secret>, name: &str) -> Result<Self> {
        let s = secrets.get(name).await?;
        let data = s.data.unwrap_or_default();
        let field = |k: &str| -> Result<String> {
            let v = data
                .get(k)
                .with_context(|| format!("Secret {name} has no {k}"))?;
            Ok(String::from_utf8(v.0.clone())?)
        };
        Ok(Self {
            ca: field("ca.crt")?,
            cert: field("tls.crt")?,
            key: field("tls.key")?,
        })
    }

    /// Whether a TLS connection checking `host` against the CA bundle, with the client
    /// certificate when `identify`, gets an HTTP/2 SETTINGS frame back: the gateway took the
    /// connection (with TLS 1.3 a refused client certificate shows only after the handshake).
    pub async fn probe(&self, addr: &str, host: &str, identify: bool) -> Result<bool> {
        match self.connect(addr, host, identify).await? {
            Some(tls) => h2_settings(tls).await,
            None => Ok(false),
        }
    }

    /// A TLS connection (ALPN `h2`) to `addr` checking `host` against the CA bundle, with the
    /// client certificate when `identify`; `None` when the handshake fails within 5 s.
    pub async fn connect(
        &self,
        addr: &str,
        host: &str,
        identify: bool,
    ) -> Result<Option<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>> {
        use rustls::pki_types::pem::PemObject;
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(self.ca.as_bytes()) {
            roots.add(c?)?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
        let mut config = if identify {
            let chain = CertificateDer::pem_slice_iter(self.cert.as_bytes())
                .collect::<Result<Vec<_>, _>>()?;
            builder
                .with_client_auth_cert(chain, PrivateKeyDer::from_pem_slice(self.key.as_bytes())?)?
        } else {
            builder.with_no_client_auth()
        };
        config.alpn_protocols = vec![b"h2".to_vec()];
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = ServerName::try_from(host.to_owned())?;
        Ok(
            tokio::time::timeout(Duration::from_secs(5), connector.connect(name, tcp))
                .await
                .ok()
                .and_then(Result::ok),
        )
    }
}

/// Sends the HTTP/2 preface and an empty SETTINGS frame on `io`; whether a SETTINGS frame
/// comes back within 5 s.
async fn h2_settings(mut io: impl AsyncRead + AsyncWrite + Unpin) -> Result<bool> {
    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0";
    if io.write_all(PREFACE).await.is_err() {
        return Ok(false);
    }
    let mut header = [0u8; 9];
    match tokio::time::timeout(Duration::from_secs(5), io.read_exact(&mut header)).await {
        Ok(Ok(_)) => Ok(header[3] == 0x4),
        _ => Ok(false),
    }
}

/// Whether plain-text HTTP/2 to `addr` gets a SETTINGS frame back.
pub async fn plain_h2(addr: &str) -> Result<bool> {
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    h2_settings(tcp).await
}

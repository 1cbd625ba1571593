//! The ExternalScaler over mutual TLS (`--scaler-tls-dir`, `--scaler-client-name`) through a
//! real tonic client: the client certificate of the directory's CA for the expected name gets
//! in; none, one another CA signed, or one of the same CA for another name (another service's)
//! is refused in the handshake; a renewal from the same CA and a rotation of the files to a new
//! CA are served without a restart.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::{path::Path, sync::Arc, time::Duration};

use common::*;
use hearth_gateway::{EndpointSet, Gateway, apikeys::ApiKeys, scaler_tls::ScalerTls};
use hearth_net::pki::{self, Issued, Usage};
use tokio::net::TcpListener;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};

const DAY: Duration = Duration::from_secs(86_400);
const HOST: &str = "chat-scaler.team-a.svc";
/// The name KEDA's certificate for this service carries (the controller's
/// `keda.<service>-scaler.<namespace>`).
const CLIENT: &str = "keda.chat-scaler.team-a";

struct Ca {
    name: String,
    ca: Issued,
    server: Issued,
    client: Issued,
}

impl Ca {
    /// A certificate of this CA for `usage` and `sans`.
    fn leaf(&self, usage: Usage, sans: &[&str]) -> Issued {
        let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
        pki::issue(
            &self.name,
            &self.ca.key,
            self.ca.not_after,
            usage,
            "keda",
            &sans,
            DAY,
        )
        .unwrap()
    }
}

fn ca(name: &str) -> Ca {
    let ca = pki::generate_ca(name, DAY).unwrap();
    let mut c = Ca {
        name: name.to_owned(),
        server: ca.clone(),
        client: ca.clone(),
        ca,
    };
    c.server = c.leaf(Usage::Server, &[HOST]);
    c.client = c.leaf(Usage::Client, &[CLIENT]);
    c
}

fn write(dir: &Path, c: &Ca) {
    std::fs::write(dir.join("ca.crt"), &c.ca.cert).unwrap();
    std::fs::write(dir.join("tls.crt"), &c.server.cert).unwrap();
    std::fs::write(dir.join("tls.key"), &c.server.key).unwrap();
}

async fn connect(
    addr: std::net::SocketAddr,
    trust: &Ca,
    identity: Option<&Issued>,
) -> Result<bool, String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&trust.ca.cert))
        .domain_name(HOST);
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(&id.cert, &id.key));
    }
    let ch = Channel::from_shared(format!("https://{addr}"))
        .unwrap()
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
        .map_err(|e| format!("{e:?}"))?;
    let mut k = hearth_gateway::scaler::pb::external_scaler_client::ExternalScalerClient::new(ch);
    k.is_active(so_ref(&[]))
        .await
        .map(|r| r.into_inner().result)
        .map_err(|e| format!("{e:?}"))
}

#[tokio::test]
async fn only_a_client_certificate_of_the_bundle_gets_in_and_a_rotation_needs_no_restart() {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let dir = tempfile::tempdir().unwrap();
    let first = ca("first-ca");
    write(dir.path(), &first);
    let tls = ScalerTls::load(dir.path(), Some(CLIENT)).unwrap();
    let gw = Gateway::new(config(), EndpointSet::new(), ApiKeys::disabled()).unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let serving = gw.clone();
    let tls2 = Arc::clone(&tls);
    tokio::spawn(async move { serving.serve_grpc_tls(l, tls2).await });

    assert_eq!(connect(addr, &first, Some(&first.client)).await, Ok(false));
    // No client certificate, or the server's own (serverAuth only): refused.
    connect(addr, &first, None).await.unwrap_err();
    connect(addr, &first, Some(&first.server))
        .await
        .unwrap_err();
    let other = ca("other-ca");
    connect(addr, &first, Some(&other.client))
        .await
        .unwrap_err();
    // The same CA, but another service's name, or none: refused.
    for sans in [&["keda.other-scaler.team-a"][..], &[]] {
        let stranger = first.leaf(Usage::Client, sans);
        connect(addr, &first, Some(&stranger))
            .await
            .expect_err("a client certificate for another name got in");
    }
    // A renewal from the same CA: the new client certificate gets in while the gateway still
    // serves its previous files (no reload needed), and after they are replaced too.
    let renewed = first.leaf(Usage::Client, &[CLIENT]);
    assert_eq!(connect(addr, &first, Some(&renewed)).await, Ok(false));
    let renewed_server = first.leaf(Usage::Server, &[HOST]);
    std::fs::write(dir.path().join("tls.crt"), &renewed_server.cert).unwrap();
    std::fs::write(dir.path().join("tls.key"), &renewed_server.key).unwrap();
    assert!(tls.reload().unwrap());
    assert_eq!(connect(addr, &first, Some(&renewed)).await, Ok(false));
    assert_eq!(connect(addr, &first, Some(&first.client)).await, Ok(false));
    // Plain text gets no gRPC answer either.
    let plain = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await;
    if let Ok(ch) = plain {
        let mut k =
            hearth_gateway::scaler::pb::external_scaler_client::ExternalScalerClient::new(ch);
        k.is_active(so_ref(&[])).await.unwrap_err();
    }

    // Unchanged files: nothing to reload. A broken write keeps the previous configuration.
    assert!(!tls.reload().unwrap());
    std::fs::write(dir.path().join("tls.key"), "half written").unwrap();
    tls.reload().unwrap_err();
    assert_eq!(connect(addr, &first, Some(&first.client)).await, Ok(false));

    // A new CA: the old client certificate is refused, the new one gets in, same process.
    let second = ca("second-ca");
    write(dir.path(), &second);
    assert!(tls.reload().unwrap());
    assert_eq!(
        connect(addr, &second, Some(&second.client)).await,
        Ok(false)
    );
    connect(addr, &first, Some(&first.client))
        .await
        .unwrap_err();
    gw.stop();
}

#[test]
fn a_missing_file_or_a_bad_client_name_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let err = ScalerTls::load(dir.path(), None).unwrap_err().to_string();
    assert!(err.contains("ca.crt"), "{err}");
    assert!(err.contains(&dir.path().display().to_string()), "{err}");
    write(dir.path(), &ca("some-ca"));
    let err = ScalerTls::load(dir.path(), Some("not a name"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("--scaler-client-name \"not a name\""), "{err}");
}

//! Shared by the webhook's tests and the benchmark: an HTTPS client for the webhook on loopback,
//! and AdmissionReviews posted to the router in-process ([`review`]).

#![allow(dead_code)]

pub mod review;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;

/// A client that trusts one CA bundle and speaks HTTP/1.1 to `addr`.
#[derive(Clone)]
pub struct HttpsClient {
    connector: TlsConnector,
    addr: SocketAddr,
}

/// One open connection, and the leaf certificate the server presented on it.
pub struct Conn {
    pub sender: http1::SendRequest<Full<Bytes>>,
    pub leaf: CertificateDer<'static>,
}

impl HttpsClient {
    pub fn new(ca_bundle_pem: &str, addr: SocketAddr) -> Self {
        let mut roots = rustls::RootCertStore::empty();
        for c in CertificateDer::pem_slice_iter(ca_bundle_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        // Full handshakes only, so every connection shows the certificate served now.
        let mut cfg = cfg;
        cfg.resumption = rustls::client::Resumption::disabled();
        Self {
            connector: TlsConnector::from(Arc::new(cfg)),
            addr,
        }
    }

    pub async fn connect(&self) -> Result<Conn, String> {
        let tcp = TcpStream::connect(self.addr)
            .await
            .map_err(|e| e.to_string())?;
        tcp.set_nodelay(true).ok();
        let name = ServerName::IpAddress(self.addr.ip().into());
        let tls = self
            .connector
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        let leaf = tls.get_ref().1.peer_certificates().unwrap()[0]
            .clone()
            .into_owned();
        let (sender, conn) = http1::handshake(TokioIo::new(tls))
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        Ok(Conn { sender, leaf })
    }
}

impl Conn {
    /// Posts `body` to `path` and returns the status and body.
    pub async fn post(&mut self, path: &str, body: Bytes) -> Result<(u16, Bytes), String> {
        let resp = self.send(path, body).await?;
        Ok((resp.status().as_u16(), resp.into_body()))
    }

    /// Posts `body` to `path` and returns the whole answer.
    pub async fn send(&mut self, path: &str, body: Bytes) -> Result<http::Response<Bytes>, String> {
        let req = http::Request::post(path)
            .header("host", "127.0.0.1")
            .header("content-type", "application/json")
            .body(Full::new(body))
            .unwrap();
        self.sender.ready().await.map_err(|e| e.to_string())?;
        let resp = self
            .sender
            .send_request(req)
            .await
            .map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(http::Response::from_parts(parts, body))
    }
}

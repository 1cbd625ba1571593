//! Mutual TLS on the ExternalScaler port (`--scaler-tls-dir`): KEDA connects with the client
//! certificate of its TriggerAuthentication, and a connection without a certificate that the
//! directory's CA bundle signed for client authentication, valid for the name
//! `--scaler-client-name` when given, is refused in the handshake.
//!
//! The directory is a mounted Secret (`ca.crt`, `tls.crt`, `tls.key`; the controller's
//! `<service>-scaler-tls`). It is re-read every [`RELOAD_INTERVAL`]; when its content changed and
//! parses, later handshakes use the new certificate and trust the new bundle, and connections
//! already open keep theirs, so a rotation restarts nothing. A half-written or broken update is
//! logged and the previous configuration keeps serving.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures::Stream;
use hearth_net::pki::{self, PkiError};
use rustls::RootCertStore;
use rustls::ServerConfig;
use rustls::client::danger::HandshakeSignatureValid;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, mpsc};
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

/// How often the directory is re-read.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);
/// Time a client has to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshakes in progress at once; more connections wait in the accept queue.
pub const MAX_HANDSHAKES: usize = 64;

/// The CA bundle client certificates must chain to.
pub const CA_FILE: &str = "ca.crt";
/// The gateway's certificate chain, leaf first.
pub const CERT_FILE: &str = "tls.crt";
/// The gateway's private key.
pub const KEY_FILE: &str = "tls.key";

/// Why the directory's files do not make a TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum ScalerTlsError {
    /// A file is missing, a PEM block is broken, or the key does not fit the certificate.
    #[error("{dir}: {source}")]
    Pki {
        /// The directory.
        dir: PathBuf,
        /// What is wrong.
        source: PkiError,
    },
    /// rustls refused the CA bundle or the configuration.
    #[error("{dir}: {message}")]
    Rustls {
        /// The directory.
        dir: PathBuf,
        /// rustls' words.
        message: String,
    },
}

/// The ExternalScaler's TLS configuration, swapped whenever the mounted files change.
#[derive(Debug)]
pub struct ScalerTls {
    dir: PathBuf,
    /// The DNS name client certificates must be valid for.
    client_name: Option<ServerName<'static>>,
    current: ArcSwap<ServerConfig>,
    /// The files' content the current configuration was made from.
    seen: std::sync::Mutex<Vec<u8>>,
}

impl ScalerTls {
    /// Reads `dir` (`ca.crt`, `tls.crt`, `tls.key`); client certificates must also be valid
    /// for the DNS name `client_name` when given.
    ///
    /// # Errors
    /// [`ScalerTlsError`] naming the directory and the file or PEM that is wrong, or a
    /// `client_name` that is not a DNS name.
    pub fn load(dir: &Path, client_name: Option<&str>) -> Result<Arc<Self>, ScalerTlsError> {
        let client_name = client_name
            .map(|n| {
                ServerName::try_from(n.to_owned()).map_err(|e| ScalerTlsError::Rustls {
                    dir: dir.to_owned(),
                    message: format!("--scaler-client-name {n:?}: {e}"),
                })
            })
            .transpose()?;
        let content = read_all(dir)?;
        let config = server_config(dir, &content, client_name.as_ref())?;
        Ok(Arc::new(Self {
            dir: dir.to_owned(),
            client_name,
            current: ArcSwap::from_pointee(config),
            seen: std::sync::Mutex::new(content.concat()),
        }))
    }

    /// Re-reads the files; `Ok(true)` when they changed and now serve.
    ///
    /// # Errors
    /// What is wrong with the new files; the previous configuration stays.
    pub fn reload(&self) -> Result<bool, ScalerTlsError> {
        let content = read_all(&self.dir)?;
        let joined = content.concat();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if *seen == joined {
            return Ok(false);
        }
        let config = server_config(&self.dir, &content, self.client_name.as_ref())?;
        self.current.store(Arc::new(config));
        *seen = joined;
        Ok(true)
    }

    /// Reloads every [`RELOAD_INTERVAL`] until the task is dropped.
    pub async fn watch(self: Arc<Self>) {
        let changed = format!(
            "ExternalScaler certificate and CA bundle reloaded from {}",
            self.dir.display()
        );
        crate::reload::every(
            RELOAD_INTERVAL,
            &changed,
            "ExternalScaler TLS files changed but do not load; still serving the previous ones",
            || self.reload(),
        )
        .await;
    }

    /// The connections of `listener` once their handshake succeeded, for tonic's
    /// `serve_with_incoming`. Each handshake runs in a task of its own, at most
    /// [`MAX_HANDSHAKES`] at once, and must finish within [`HANDSHAKE_TIMEOUT`]; a failed one
    /// (no client certificate, one the bundle did not sign, plain text) closes its connection
    /// and is logged at debug level. Ends when the stream is dropped.
    pub fn incoming(
        self: Arc<Self>,
        listener: TcpListener,
    ) -> impl Stream<Item = Result<TlsStream<TcpStream>, io::Error>> + Send + 'static {
        let (tx, rx) = mpsc::channel(MAX_HANDSHAKES);
        let permits = Arc::new(Semaphore::new(MAX_HANDSHAKES));
        tokio::spawn(async move {
            loop {
                let Ok(permit) = permits.clone().acquire_owned().await else {
                    return;
                };
                let (tcp, peer) = tokio::select! {
                    accepted = listener.accept() => match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            tracing::warn!(error = %e, "ExternalScaler accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    },
                    () = tx.closed() => return,
                };
                let _ = tcp.set_nodelay(true);
                let acceptor = TlsAcceptor::from(self.current.load_full());
                let tx = tx.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(stream)) => {
                            let _ = tx.send(Ok(stream)).await;
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "ExternalScaler TLS handshake refused");
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "ExternalScaler TLS handshake timed out");
                        }
                    }
                });
            }
        });
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) })
    }
}

fn read_all(dir: &Path) -> Result<[Vec<u8>; 3], ScalerTlsError> {
    let read = |file: &str| {
        let path = dir.join(file);
        std::fs::read(&path).map_err(|source| ScalerTlsError::Pki {
            dir: dir.to_owned(),
            source: PkiError::Read { path, source },
        })
    };
    Ok([read(CA_FILE)?, read(CERT_FILE)?, read(KEY_FILE)?])
}

fn server_config(
    dir: &Path,
    [ca, cert, key]: &[Vec<u8>; 3],
    client_name: Option<&ServerName<'static>>,
) -> Result<ServerConfig, ScalerTlsError> {
    let pki_err = |source| ScalerTlsError::Pki {
        dir: dir.to_owned(),
        source,
    };
    let rustls_err = |e: &dyn std::fmt::Display| ScalerTlsError::Rustls {
        dir: dir.to_owned(),
        message: e.to_string(),
    };
    let mut roots = RootCertStore::empty();
    for c in pki::certificates(ca).map_err(pki_err)? {
        roots.add(c).map_err(|e| rustls_err(&e))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut verifier =
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone())
            .build()
            .map_err(|e| rustls_err(&e))?;
    if let Some(name) = client_name {
        verifier = Arc::new(NamedClient {
            inner: verifier,
            name: name.clone(),
        });
    }
    let key = pki::certified_key(cert, key).map_err(pki_err)?;
    let mut cfg = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| rustls_err(&e))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(key)));
    // gRPC is HTTP/2 only.
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(cfg)
}

/// A client verifier that also wants the end-entity certificate valid for `name` (a
/// subjectAltName, as a server name is checked): one CA signs the certificates of KEDA for
/// every service, so the name says which service's scaler it may ask.
#[derive(Debug)]
struct NamedClient {
    inner: Arc<dyn ClientCertVerifier>,
    name: ServerName<'static>,
}

impl ClientCertVerifier for NamedClient {
    fn offer_client_auth(&self) -> bool {
        self.inner.offer_client_auth()
    }

    fn client_auth_mandatory(&self) -> bool {
        self.inner.client_auth_mandatory()
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        self.inner.root_hint_subjects()
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let verified = self
            .inner
            .verify_client_cert(end_entity, intermediates, now)?;
        webpki::EndEntityCert::try_from(end_entity)
            .and_then(|cert| cert.verify_is_valid_for_subject_name(&self.name))
            .map_err(|e| {
                rustls::Error::InvalidCertificate(rustls::CertificateError::Other(
                    rustls::OtherError(Arc::new(e)),
                ))
            })?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

//! The serving certificate: a rustls [`ResolvesServerCert`] whose key can be swapped at any
//! time, and a cheap poller that reloads cert-manager style files when they change.
//!
//! Swapping is one atomic pointer store ([`ArcSwap`]): a handshake in flight keeps the key it
//! already resolved, and every later handshake gets the new one, so a rotation never fails a
//! request. A file pair that does not parse, or whose key does not match the certificate (a
//! half-written rotation), is logged and skipped; the last good key keeps serving and the next
//! poll tries again.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// Why a certificate and key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: io::Error,
    },
    /// The certificate PEM holds no `CERTIFICATE` block or is malformed.
    #[error("the certificate PEM has no valid CERTIFICATE block: {0}")]
    Certificate(String),
    /// The key PEM holds no private key or is malformed.
    #[error("the key PEM has no valid PRIVATE KEY block: {0}")]
    Key(String),
    /// rustls refused the key, or the key does not belong to the certificate.
    #[error("the private key does not fit the certificate: {0}")]
    Mismatch(rustls::Error),
    /// Certificate generation failed.
    #[error("generating a certificate: {0}")]
    Generate(#[from] rcgen::Error),
}

/// Parses a PEM certificate chain (leaf first) and a PEM private key (PKCS#8, PKCS#1 or SEC1)
/// into a rustls key, checking that they belong together.
pub fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Certificate(e.to_string()))?;
    if chain.is_empty() {
        return Err(TlsError::Certificate("no certificate found".to_owned()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| TlsError::Key(e.to_string()))?;
    let provider = rustls::crypto::ring::default_provider();
    let ck = CertifiedKey::from_der(chain, key, &provider).map_err(TlsError::Mismatch)?;
    Ok(ck)
}

/// The current serving key, swappable while the server runs.
#[derive(Debug)]
pub struct CertStore {
    current: ArcSwap<CertifiedKey>,
}

impl CertStore {
    /// A store serving `key` until [`CertStore::swap`] replaces it.
    pub fn new(key: CertifiedKey) -> Arc<Self> {
        Arc::new(Self {
            current: ArcSwap::from_pointee(key),
        })
    }

    /// Serves `key` for every handshake from now on.
    pub fn swap(&self, key: CertifiedKey) {
        self.current.store(Arc::new(key));
    }

    /// The leaf certificate currently served (DER).
    pub fn leaf(&self) -> CertificateDer<'static> {
        self.current.load().cert[0].clone()
    }

    /// A rustls server config resolving through this store, offering HTTP/2 and HTTP/1.1 by
    /// ALPN. Uses the ring provider (the project's only one).
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<ServerConfig>, rustls::Error> {
        let mut cfg =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_cert_resolver(self.clone());
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(cfg))
    }
}

impl ResolvesServerCert for CertStore {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

/// A certificate and key file pair (cert-manager's `tls.crt` and `tls.key`).
#[derive(Clone, Debug)]
pub struct CertFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key.
    pub key: PathBuf,
}

impl CertFiles {
    /// Reads and parses both files.
    pub fn load(&self) -> Result<CertifiedKey, TlsError> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|source| TlsError::Read {
                path: p.to_owned(),
                source,
            })
        };
        certified_key(&read(&self.cert)?, &read(&self.key)?)
    }

    /// Modification time and length of both files: two `stat` calls, the whole cost of a poll.
    /// Kubernetes updates Secret volumes by swapping a symlink, which changes both.
    fn stamp(&self) -> Option<[(SystemTime, u64); 2]> {
        let one = |p: &Path| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.modified().ok()?, m.len()))
        };
        Some([one(&self.cert)?, one(&self.key)?])
    }

    /// Polls the files every `interval` until `shutdown` turns true, swapping the store's key
    /// whenever they change and parse. Runs as a task; each poll is two `stat` calls.
    pub async fn watch(
        self,
        store: Arc<CertStore>,
        interval: Duration,
        metrics: Arc<Metrics>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        let mut seen = self.stamp();
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.changed() => return,
            }
            if *shutdown.borrow() {
                return;
            }
            let now = self.stamp();
            if now == seen {
                continue;
            }
            match self.load() {
                Ok(key) => {
                    store.swap(key);
                    seen = now;
                    metrics.cert_reloads.inc();
                    tracing::info!(cert = %self.cert.display(), "serving certificate reloaded");
                }
                // Keep `seen` so the next poll retries: the writer may not be done yet.
                Err(e) => {
                    metrics.cert_reload_errors.inc();
                    tracing::warn!(cert = %self.cert.display(), error = %e, "certificate files changed but could not be loaded; still serving the previous certificate");
                }
            }
        }
    }
}

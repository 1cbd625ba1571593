//! The serving certificate: a rustls [`ResolvesServerCert`] whose key can be swapped at any
//! time, and a cheap poller that reloads cert-manager style files when they change.
//!
//! Swapping is one atomic pointer store ([`ArcSwap`]): a handshake in flight keeps the key it
//! already resolved, and every later handshake gets the new one, so a rotation never fails a
//! request. A file pair that does not parse, or whose key does not match the certificate (a
//! half-written rotation), is logged and skipped; the last good key keeps serving and the next
//! poll tries again.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::ServerConfig;
use rustls::pki_types::CertificateDer;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;
use tokio::sync::watch;

use crate::metrics::Metrics;

/// Why a certificate and key could not be loaded (shared with the controller's certificates).
pub use hearth_net::pki::PkiError as TlsError;
/// Parses a PEM certificate chain and private key into a rustls key (`hearth_net::pki`).
pub use hearth_net::pki::certified_key;

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

//! Self-managed TLS: a CA and a serving certificate made with rcgen, kept in a Secret in the
//! webhook's namespace, the CA published as `caBundle` in the webhook configurations, and the
//! serving certificate rotated before it expires.
//!
//! Rotation keeps the CA, so the `caBundle` the apiserver trusts stays valid and no request
//! fails: the new leaf is swapped into the [`CertStore`] and later handshakes use it. When the
//! CA itself nears its end, a new CA is made, the bundle published as old + new, and the new
//! CA's leaf served only after `ca_propagation` has let the apiserver pick up the bundle.
//!
//! Several replicas share the Secret: updates carry its `resourceVersion`, a conflict means
//! another replica rotated first, and every replica re-reads the Secret on each check.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use hearth_net::pki;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{ObjectMeta, PostParams};
use kube::{Api, Client};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tokio::sync::watch;

use crate::metrics::Metrics;
use crate::tls::{CertStore, TlsError, certified_key};

/// Annotation holding the serving certificate's `notAfter` (RFC 3339), so expiry is known
/// without an X.509 parser.
pub const CERT_NOT_AFTER_ANNOTATION: &str = "serving.hearth.dev/cert-not-after";
/// Annotation holding the current CA's `notAfter` (RFC 3339).
pub const CA_NOT_AFTER_ANNOTATION: &str = "serving.hearth.dev/ca-not-after";

const CA_COMMON_NAME: &str = "hearth-webhook-ca";

/// Errors of self-managed TLS.
#[derive(Debug, thiserror::Error)]
pub enum SelfManagedError {
    /// Generating or loading a certificate failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// A Kubernetes API call failed.
    #[error("{action}: {source}")]
    Kube {
        /// What was being done.
        action: String,
        /// The client error.
        source: kube::Error,
    },
    /// The Secret exists but lacks a field or holds garbage.
    #[error(
        "Secret {namespace}/{name} is not a Hearth webhook certificate Secret: {why}; delete it and the webhook makes a new one"
    )]
    BadSecret {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// What is wrong.
        why: String,
    },
}

/// What the self-managed TLS needs to know.
#[derive(Clone, Debug)]
pub struct SelfManagedConfig {
    /// Namespace of the Secret (the webhook's own).
    pub namespace: String,
    /// Name of the Secret.
    pub secret_name: String,
    /// Subject alternative names of the serving certificate: DNS names
    /// (`hearth-webhook.hearth-system.svc`) and IP addresses (`127.0.0.1`).
    pub sans: Vec<String>,
    /// Lifetime of each serving certificate.
    pub cert_validity: Duration,
    /// Lifetime of the CA.
    pub ca_validity: Duration,
    /// Names of the MutatingWebhookConfiguration and ValidatingWebhookConfiguration whose
    /// `caBundle` is kept current (either may be absent from the cluster).
    pub webhook_configuration: String,
    /// Wait between publishing a new CA and serving a certificate it signed.
    pub ca_propagation: Duration,
}

/// One generation of TLS material, as stored in the Secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Material {
    /// CA certificate (PEM) that signs the serving certificate.
    pub ca_cert: String,
    /// CA private key (PEM).
    pub ca_key: String,
    /// Every CA the apiserver should trust (PEM, concatenated): the current one, plus the
    /// previous one while a CA rotation is under way.
    pub ca_bundle: String,
    /// Serving certificate (PEM).
    pub cert: String,
    /// Serving key (PEM).
    pub key: String,
    /// When the serving certificate expires.
    pub cert_not_after: OffsetDateTime,
    /// When the CA expires.
    pub ca_not_after: OffsetDateTime,
}

/// Makes a new CA valid for `validity`. Returns (certificate PEM, key PEM, notAfter).
pub fn generate_ca(validity: Duration) -> Result<(String, String, OffsetDateTime), TlsError> {
    let ca = pki::generate_ca(CA_COMMON_NAME, validity)?;
    Ok((ca.cert, ca.key, ca.not_after))
}

/// Issues a serving certificate for `sans`, valid for `validity`, signed by the CA. Returns
/// (certificate PEM, key PEM, notAfter).
pub fn issue(
    ca_key_pem: &str,
    ca_not_after: OffsetDateTime,
    sans: &[String],
    validity: Duration,
) -> Result<(String, String, OffsetDateTime), TlsError> {
    let leaf = pki::issue(
        CA_COMMON_NAME,
        ca_key_pem,
        ca_not_after,
        pki::Usage::Server,
        "hearth-webhook",
        sans,
        validity,
    )?;
    Ok((leaf.cert, leaf.key, leaf.not_after))
}

impl Material {
    /// A fresh CA and serving certificate.
    pub fn generate(cfg: &SelfManagedConfig) -> Result<Self, TlsError> {
        let (ca_cert, ca_key, ca_not_after) = generate_ca(cfg.ca_validity)?;
        let (cert, key, cert_not_after) =
            issue(&ca_key, ca_not_after, &cfg.sans, cfg.cert_validity)?;
        Ok(Self {
            ca_bundle: ca_cert.clone(),
            ca_cert,
            ca_key,
            cert,
            key,
            cert_not_after,
            ca_not_after,
        })
    }

    /// When this material should be renewed: two thirds into the serving certificate's
    /// lifetime, the same margin cert-manager uses by default.
    fn renew_at(&self, cfg: &SelfManagedConfig) -> OffsetDateTime {
        self.cert_not_after - cfg.cert_validity / 3
    }

    /// Whether the CA is too close to its end to sign another full-length certificate.
    fn ca_expiring(&self, cfg: &SelfManagedConfig) -> bool {
        self.ca_not_after - cfg.cert_validity * 2 <= OffsetDateTime::now_utc()
    }

    /// The next generation: a new leaf from the same CA, or a new CA (published alongside the
    /// old one) and its leaf.
    fn renewed(&self, cfg: &SelfManagedConfig) -> Result<Self, TlsError> {
        if self.ca_expiring(cfg) {
            let mut next = Self::generate(cfg)?;
            next.ca_bundle = format!("{}{}", next.ca_cert, self.ca_cert);
            return Ok(next);
        }
        let (cert, key, cert_not_after) = issue(
            &self.ca_key,
            self.ca_not_after,
            &cfg.sans,
            cfg.cert_validity,
        )?;
        Ok(Self {
            ca_cert: self.ca_cert.clone(),
            ca_key: self.ca_key.clone(),
            ca_bundle: self.ca_cert.clone(),
            cert,
            key,
            cert_not_after,
            ca_not_after: self.ca_not_after,
        })
    }

    fn to_secret(&self, cfg: &SelfManagedConfig, resource_version: Option<String>) -> Secret {
        let b = |s: &str| ByteString(s.as_bytes().to_vec());
        let ts = |t: OffsetDateTime| t.format(&Rfc3339).unwrap_or_default();
        Secret {
            metadata: ObjectMeta {
                name: Some(cfg.secret_name.clone()),
                namespace: Some(cfg.namespace.clone()),
                resource_version,
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "hearth-webhook".to_owned(),
                )])),
                annotations: Some(BTreeMap::from([
                    (
                        CERT_NOT_AFTER_ANNOTATION.to_owned(),
                        ts(self.cert_not_after),
                    ),
                    (CA_NOT_AFTER_ANNOTATION.to_owned(), ts(self.ca_not_after)),
                    (SANS_ANNOTATION.to_owned(), cfg.sans.join(",")),
                ])),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/tls".to_owned()),
            data: Some(BTreeMap::from([
                ("tls.crt".to_owned(), b(&self.cert)),
                ("tls.key".to_owned(), b(&self.key)),
                ("ca.crt".to_owned(), b(&self.ca_bundle)),
                ("ca-signing.crt".to_owned(), b(&self.ca_cert)),
                ("ca-signing.key".to_owned(), b(&self.ca_key)),
            ])),
            ..Secret::default()
        }
    }

    fn from_secret(s: &Secret) -> Result<Self, String> {
        let data = s.data.as_ref().ok_or("it has no data")?;
        let field = |k: &str| {
            data.get(k)
                .map(|v| String::from_utf8_lossy(&v.0).into_owned())
                .ok_or_else(|| format!("it has no {k}"))
        };
        let ann = |k: &str| {
            s.metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get(k))
                .ok_or_else(|| format!("annotation {k} is missing"))
                .and_then(|v| {
                    OffsetDateTime::parse(v, &Rfc3339)
                        .map_err(|e| format!("annotation {k} is not RFC 3339: {e}"))
                })
        };
        Ok(Self {
            ca_cert: field("ca-signing.crt")?,
            ca_key: field("ca-signing.key")?,
            ca_bundle: field("ca.crt")?,
            cert: field("tls.crt")?,
            key: field("tls.key")?,
            cert_not_after: ann(CERT_NOT_AFTER_ANNOTATION)?,
            ca_not_after: ann(CA_NOT_AFTER_ANNOTATION)?,
        })
    }
}

/// Self-managed TLS against one cluster.
#[derive(Clone)]
pub struct SelfManaged {
    client: Client,
    cfg: SelfManagedConfig,
}

impl SelfManaged {
    /// Self-managed TLS using `client`.
    pub fn new(client: Client, cfg: SelfManagedConfig) -> Self {
        Self { client, cfg }
    }

    fn secrets(&self) -> Api<Secret> {
        Api::namespaced(self.client.clone(), &self.cfg.namespace)
    }

    fn kube_err(&self, action: &str) -> impl FnOnce(kube::Error) -> SelfManagedError {
        let action = format!(
            "{action} Secret {}/{}",
            self.cfg.namespace, self.cfg.secret_name
        );
        move |source| SelfManagedError::Kube { action, source }
    }

    /// Reads the Secret, creating it or renewing what it holds when needed, and returns the
    /// material to serve now. Safe to run in several replicas at once.
    pub async fn ensure(&self) -> Result<Material, SelfManagedError> {
        loop {
            let existing = self
                .secrets()
                .get_opt(&self.cfg.secret_name)
                .await
                .map_err(self.kube_err("reading"))?;
            let Some(secret) = existing else {
                let fresh = Material::generate(&self.cfg)?;
                match self
                    .secrets()
                    .create(&PostParams::default(), &fresh.to_secret(&self.cfg, None))
                    .await
                {
                    Ok(_) => return Ok(fresh),
                    // Another replica created it first: use theirs.
                    Err(kube::Error::Api(e)) if e.code == 409 => continue,
                    Err(e) => return Err(self.kube_err("creating")(e)),
                }
            };
            let current =
                Material::from_secret(&secret).map_err(|why| SelfManagedError::BadSecret {
                    namespace: self.cfg.namespace.clone(),
                    name: self.cfg.secret_name.clone(),
                    why,
                })?;
            // A Secret made for other SANs (flags changed) is renewed at once.
            let stale = current.renew_at(&self.cfg) <= OffsetDateTime::now_utc()
                || self.sans_changed(&secret);
            if !stale {
                return Ok(current);
            }
            let next = current.renewed(&self.cfg)?;
            let secret_next = next.to_secret(&self.cfg, secret.metadata.resource_version.clone());
            match self
                .secrets()
                .replace(&self.cfg.secret_name, &PostParams::default(), &secret_next)
                .await
            {
                Ok(_) => return Ok(next),
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(self.kube_err("updating")(e)),
            }
        }
    }

    fn sans_changed(&self, secret: &Secret) -> bool {
        secret
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(SANS_ANNOTATION))
            .is_some_and(|s| *s != self.cfg.sans.join(","))
    }

    /// Writes `ca_bundle` into every webhook of the Mutating- and ValidatingWebhookConfiguration
    /// named in the config. A configuration that does not exist is skipped (the chart may
    /// install only one); conflicts are retried.
    pub async fn publish_ca_bundle(&self, ca_bundle: &str) -> Result<(), SelfManagedError> {
        let name = &self.cfg.webhook_configuration;
        let bundle = ByteString(ca_bundle.as_bytes().to_vec());
        set_ca_bundle::<MutatingWebhookConfiguration>(&self.client, name, &bundle).await?;
        set_ca_bundle::<ValidatingWebhookConfiguration>(&self.client, name, &bundle).await
    }

    /// Start-up: ensures the Secret, publishes the CA bundle and returns a store serving the
    /// current certificate, plus the material it serves.
    pub async fn bootstrap(&self) -> Result<(Arc<CertStore>, Material), SelfManagedError> {
        let m = self.ensure().await?;
        self.publish_ca_bundle(&m.ca_bundle).await?;
        let store = CertStore::new(certified_key(m.cert.as_bytes(), m.key.as_bytes())?);
        Ok((store, m))
    }

    /// [`Self::bootstrap`], then [`Self::run`] spawned on the Tokio runtime: returns the store
    /// serving the current certificate, kept fresh in the background until `shutdown`.
    pub async fn start(
        self,
        recheck: Duration,
        metrics: Arc<Metrics>,
        shutdown: watch::Receiver<bool>,
    ) -> Result<Arc<CertStore>, SelfManagedError> {
        let (store, material) = self.bootstrap().await?;
        tokio::spawn(self.run(store.clone(), material, recheck, metrics, shutdown));
        Ok(store)
    }

    /// Keeps the served certificate fresh until `shutdown`: sleeps until the renewal point (at
    /// most `recheck`, to notice a rotation by another replica), renews through [`Self::ensure`],
    /// publishes the bundle, and swaps the store. Errors are logged and retried after
    /// `recheck`; the current certificate keeps serving meanwhile.
    pub async fn run(
        self,
        store: Arc<CertStore>,
        mut served: Material,
        recheck: Duration,
        metrics: Arc<Metrics>,
        mut shutdown: watch::Receiver<bool>,
    ) {
        loop {
            let until_renew = (served.renew_at(&self.cfg) - OffsetDateTime::now_utc())
                .try_into()
                .unwrap_or(Duration::ZERO);
            tokio::select! {
                _ = tokio::time::sleep(until_renew.min(recheck)) => {}
                _ = shutdown.changed() => return,
            }
            if *shutdown.borrow() {
                return;
            }
            let next = match self.ensure().await {
                Ok(m) => m,
                Err(e) => {
                    metrics.cert_reload_errors.inc();
                    tracing::warn!(error = %e, "certificate renewal failed; still serving the previous certificate");
                    continue;
                }
            };
            if next == served {
                continue;
            }
            if next.ca_bundle != served.ca_bundle {
                if let Err(e) = self.publish_ca_bundle(&next.ca_bundle).await {
                    metrics.cert_reload_errors.inc();
                    tracing::warn!(error = %e, "publishing the new CA bundle failed; will retry");
                    continue;
                }
                if next.ca_cert != served.ca_cert {
                    tokio::time::sleep(self.cfg.ca_propagation).await;
                }
            }
            match certified_key(next.cert.as_bytes(), next.key.as_bytes()) {
                Ok(key) => {
                    store.swap(key);
                    metrics.cert_reloads.inc();
                    tracing::info!(not_after = %next.cert_not_after, "serving certificate rotated");
                    served = next;
                }
                Err(e) => {
                    metrics.cert_reload_errors.inc();
                    tracing::warn!(error = %e, "renewed certificate did not load; still serving the previous one");
                }
            }
        }
    }
}

/// Annotation recording the SANs the serving certificate was issued for.
pub const SANS_ANNOTATION: &str = "serving.hearth.dev/cert-sans";

/// A webhook configuration kind: its webhooks each carry a `clientConfig`.
trait WebhookConfiguration:
    kube::Resource<DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + serde::Serialize
{
    /// The `clientConfig` of every webhook, in order.
    fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig>;
}

/// The Mutating and the Validating kind have the same `webhooks[*].clientConfig` shape but no
/// common trait in k8s-openapi: one body serves both.
macro_rules! webhook_configuration {
    ($($kind:ty),+) => {$(
        impl WebhookConfiguration for $kind {
            fn client_configs(&mut self) -> Vec<&mut WebhookClientConfig> {
                self.webhooks
                    .iter_mut()
                    .flatten()
                    .map(|w| &mut w.client_config)
                    .collect()
            }
        }
    )+};
}

webhook_configuration!(MutatingWebhookConfiguration, ValidatingWebhookConfiguration);

/// Sets `bundle` as the caBundle of every webhook in the configuration `name` of kind `K`:
/// skipped when the configuration does not exist or already carries it; a conflicting write is
/// retried, at most five times in all.
async fn set_ca_bundle<K: WebhookConfiguration>(
    client: &Client,
    name: &str,
    bundle: &ByteString,
) -> Result<(), SelfManagedError> {
    let api: Api<K> = Api::all(client.clone());
    let err = |source| SelfManagedError::Kube {
        action: format!("patching caBundle of {} {name}", K::kind(&())),
        source,
    };
    for _ in 0..5 {
        let Some(mut config) = api.get_opt(name).await.map_err(err)? else {
            return Ok(());
        };
        let mut changed = false;
        for c in config.client_configs() {
            if c.ca_bundle.as_ref() != Some(bundle) {
                c.ca_bundle = Some(bundle.clone());
                changed = true;
            }
        }
        if !changed {
            return Ok(());
        }
        match api.replace(name, &PostParams::default(), &config).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(err(e)),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SelfManagedConfig {
        SelfManagedConfig {
            namespace: "hearth-system".into(),
            secret_name: "hearth-webhook-tls".into(),
            sans: vec![
                "hearth-webhook.hearth-system.svc".into(),
                "127.0.0.1".into(),
            ],
            cert_validity: Duration::from_secs(3600),
            ca_validity: Duration::from_secs(3 * 3600),
            webhook_configuration: "hearth".into(),
            ca_propagation: Duration::ZERO,
        }
    }

    #[test]
    fn client_configs_reach_every_webhook_of_both_kinds() {
        let reg = crate::registration::Registration::in_cluster("hearth-system");
        let (mut v, mut m) = (reg.validating(), reg.mutating());
        let bundle = ByteString(b"CA".to_vec());
        let configs: Vec<_> = v
            .client_configs()
            .into_iter()
            .chain(m.client_configs())
            .collect();
        assert_eq!(configs.len(), 5 + 1);
        for c in configs {
            c.ca_bundle = Some(bundle.clone());
        }
        let written = v.webhooks.iter().flatten().map(|w| &w.client_config);
        let written = written.chain(m.webhooks.iter().flatten().map(|w| &w.client_config));
        assert!(
            written
                .map(|c| c.ca_bundle.as_ref())
                .all(|b| b == Some(&bundle))
        );
    }

    #[test]
    fn generated_material_loads_into_rustls() {
        let m = Material::generate(&cfg()).unwrap();
        certified_key(m.cert.as_bytes(), m.key.as_bytes()).unwrap();
        assert_eq!(m.ca_bundle, m.ca_cert);
        assert!(m.cert_not_after <= m.ca_not_after);
    }

    #[test]
    fn secret_round_trips() {
        let c = cfg();
        let m = Material::generate(&c).unwrap();
        let s = m.to_secret(&c, None);
        let back = Material::from_secret(&s).unwrap();
        // RFC 3339 keeps sub-second precision, so the times survive exactly.
        assert_eq!(back, m);
    }

    #[test]
    fn renewal_keeps_the_ca_until_it_nears_its_end() {
        let c = cfg();
        let m = Material::generate(&c).unwrap();
        let next = m.renewed(&c).unwrap();
        assert_eq!(next.ca_cert, m.ca_cert);
        assert_ne!(next.cert, m.cert);

        // A CA with less than two leaf lifetimes left is replaced, the old one still trusted.
        let short = SelfManagedConfig {
            ca_validity: Duration::from_secs(3600),
            ..c
        };
        let m = Material::generate(&short).unwrap();
        let next = m.renewed(&short).unwrap();
        assert_ne!(next.ca_cert, m.ca_cert);
        assert_eq!(next.ca_bundle, format!("{}{}", next.ca_cert, m.ca_cert));
    }

    #[test]
    fn mismatched_key_is_refused() {
        let m1 = Material::generate(&cfg()).unwrap();
        let m2 = Material::generate(&cfg()).unwrap();
        let err = certified_key(m1.cert.as_bytes(), m2.key.as_bytes()).unwrap_err();
        assert!(matches!(err, TlsError::Mismatch(_)), "{err}");
    }
}

//! Mutual TLS between KEDA and a push-mode service's own gateway: the controller issues the
//! certificates, and never reads a Secret.
//!
//! For service `N` (namespace `ns`) it writes two `kubernetes.io/tls` Secrets, owned by the
//! LLMService:
//! - `N-scaler-tls`: the gateway's serving certificate (`tls.crt`, `tls.key`, for `N-scaler`,
//!   `N-scaler.ns`, `N-scaler.ns.svc` and `N-scaler.ns.svc.cluster.local`) and the bundle it
//!   trusts (`ca.crt`); the gateway mounts it and re-reads it (`hearth-gateway
//!   --scaler-tls-dir`).
//! - `N-scaler-client-tls`: KEDA's client certificate (`clientAuth`, for the DNS name
//!   [`names::scaler_client`], `keda.N-scaler.ns`) and the same `ca.crt` to check the gateway
//!   with; the TriggerAuthentication `N-scaler` hands the three keys to KEDA's ExternalScaler
//!   (`caCert`, `tlsClientCert`, `tlsClientKey`).
//!
//! Both are signed by the controller's scaler CA, one long-lived CA kept in its keys Secret
//! ([`crate::keys`]). A renewal signs new certificates with the same CA, so neither side's trust
//! bundle changes: KEDA connects with its new certificate at once, while the gateway still
//! serves its previous one until the kubelet refreshes the mounted Secret (about a minute), and
//! every combination verifies. No connection waits. Because one CA signs every service's
//! certificates, the gateway also checks the name in KEDA's certificate
//! (`hearth-gateway --scaler-client-name`): a client certificate of another service is refused.
//! When the CA itself changes (a new keys Secret), the bundle holds the new CA and the previous
//! one, as it did for the generation before, and the gateway trusts KEDA's new certificate only
//! once the kubelet has refreshed its files. Certificates are issued again two thirds into
//! their life (cert-manager's default).
//!
//! What was issued last is recorded on the gateway Deployment, in the annotation
//! [`RECORD_ANNOTATION`] (the CA certificate and the expiry, nothing secret), which the
//! controller already caches; so the controller needs only create, patch and delete on Secrets.
//! Removing the annotation re-issues everything.
//!
//! KEDA caches a scaler, with its TLS material, by the ScaledObject's generation: a digest of
//! the issuance (its CA and expiry) goes into the trigger's metadata ([`render::TLS_DIGEST_KEY`]),
//! so a new certificate changes the ScaledObject and KEDA connects with it.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use hearth_crds::{LLMService, wellknown::FIELD_MANAGER};
use hearth_net::pki::{self, Issued, PkiError, Usage};
use k8s_openapi::{
    ByteString,
    api::{apps::v1::Deployment, core::v1::Secret},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, DynamicObject, Patch, PatchParams},
};
use serde::{Deserialize, Serialize};
use time::{OffsetDateTime, format_description::well_known::Rfc3339};

use crate::{
    keys::SCALER_CA_NAME,
    labels::{self, Component},
    names,
    reconcile::{Context, Desired, Error, View, kube_err},
    render,
};

/// Annotation on the gateway Deployment recording the last issuance ([`Record`], JSON).
pub const RECORD_ANNOTATION: &str = "serving.hearth.dev/scaler-tls";

/// The ExternalScaler certificates' CA and lifetime.
#[derive(Clone, Debug)]
pub struct ScalerTlsConfig {
    /// Lifetime of the two certificates (`hearth-controller --scaler-cert-validity`); issued
    /// again after two thirds.
    pub cert_validity: Duration,
    /// The CA that signs them ([`crate::keys`]); `None`: the controller makes one when it
    /// starts, kept in memory only (tests; `hearth-controller run` always loads it).
    pub ca: Option<Issued>,
}

impl Default for ScalerTlsConfig {
    /// 90 days, no CA.
    fn default() -> Self {
        Self {
            cert_validity: Duration::from_secs(90 * 86_400),
            ca: None,
        }
    }
}

/// Default lifetime of the scaler CA made when the keys Secret has none
/// (`hearth-controller --scaler-ca-validity`): 10 years.
pub const DEFAULT_CA_VALIDITY: Duration = Duration::from_secs(10 * 365 * 86_400);

/// The last issuance, as recorded on the gateway Deployment: public facts only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Record {
    /// The CA certificate (PEM): kept in the next bundle.
    pub ca: String,
    /// When the certificates expire (RFC 3339).
    pub not_after: String,
}

impl Record {
    /// Reads the record of a gateway Deployment; `None` without one or when it does not parse.
    pub fn of(gateway: &Deployment) -> Option<Self> {
        let v = gateway.annotations().get(RECORD_ANNOTATION)?;
        serde_json::from_str(v).ok()
    }

    /// Whether to issue again at `now`, signing with `ca`: when another CA signed them, when
    /// the expiry does not parse, or two thirds into the certificates' life, unless they
    /// already end with the CA (certificates never outlive it, so issuing again would give
    /// the same expiry: the controller replaces a CA that close to its end when it starts).
    pub fn due(&self, cfg: &ScalerTlsConfig, ca: &Issued, now: OffsetDateTime) -> bool {
        self.ca != ca.cert
            || OffsetDateTime::parse(&self.not_after, &Rfc3339).map_or(true, |t| {
                t - cfg.cert_validity / 3 <= now && t + Duration::from_secs(60) < ca.not_after
            })
    }

    /// SHA-256 of the CA and the expiry, the first 16 hex digits: what changes with each
    /// issuance, when KEDA must read its Secret again.
    pub fn digest(&self) -> String {
        digest(&[&self.ca, &self.not_after])
    }

    fn annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// One issuance: the CA's two certificates, and the bundle both sides trust.
#[derive(Clone, Debug)]
pub struct Material {
    /// The CA certificate (PEM).
    pub ca: String,
    /// The CA, then the one that signed the previous certificates when it was another.
    pub bundle: String,
    /// The gateway's serving certificate.
    pub server: Issued,
    /// KEDA's client certificate.
    pub client: Issued,
}

impl Material {
    /// Issues from `ca` the gateway's certificate for `sans` and KEDA's for `client_name`,
    /// trusting `previous_ca` (PEM) besides when another CA signed the previous ones.
    ///
    /// # Errors
    /// Certificate generation failed (a key that does not parse, a name that is not DNS).
    pub fn issue(
        ca: &Issued,
        previous_ca: Option<&str>,
        sans: &[String],
        client_name: &str,
        cfg: &ScalerTlsConfig,
    ) -> Result<Self, PkiError> {
        let leaf = |usage, sans: &[String]| {
            pki::issue(
                SCALER_CA_NAME,
                &ca.key,
                ca.not_after,
                usage,
                SCALER_CA_NAME,
                sans,
                cfg.cert_validity,
            )
        };
        let server = leaf(Usage::Server, sans)?;
        let client = leaf(Usage::Client, &[client_name.to_owned()])?;
        let bundle = match previous_ca {
            Some(p) if p != ca.cert => format!("{}{p}", ca.cert),
            _ => ca.cert.clone(),
        };
        Ok(Self {
            ca: ca.cert.clone(),
            bundle,
            server,
            client,
        })
    }

    /// What is recorded of it.
    pub fn record(&self) -> Record {
        Record {
            ca: self.ca.clone(),
            not_after: self
                .server
                .not_after
                .min(self.client.not_after)
                .format(&Rfc3339)
                .unwrap_or_default(),
        }
    }
}

/// SHA-256 of `parts` in order, the first 16 hex digits.
pub fn digest(parts: &[&str]) -> String {
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    for p in parts {
        ctx.update(p.as_bytes());
    }
    ctx.finish()
        .as_ref()
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The DNS names the gateway's ExternalScaler Service answers to.
pub fn scaler_sans(service: &str, namespace: &str) -> Vec<String> {
    let svc = names::scaler_service(service);
    vec![
        svc.clone(),
        format!("{svc}.{namespace}"),
        format!("{svc}.{namespace}.svc"),
        format!("{svc}.{namespace}.svc.cluster.local"),
    ]
}

/// A `kubernetes.io/tls` Secret of service `service`: `ca.crt` = `bundle`, and `leaf`.
pub fn secret(
    name: String,
    namespace: &str,
    service: &str,
    owner: Option<OwnerReference>,
    bundle: &str,
    leaf: &Issued,
) -> Secret {
    let data = BTreeMap::from([
        ("ca.crt".to_owned(), bundle),
        ("tls.crt".to_owned(), leaf.cert.as_str()),
        ("tls.key".to_owned(), leaf.key.as_str()),
    ]);
    Secret {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels::labels(service, Component::Autoscaler)),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k, ByteString(v.as_bytes().to_vec())))
                .collect(),
        ),
        ..Default::default()
    }
}

/// Server-side apply of `desired`, not forced: a Secret of that name whose keys another
/// manager wrote (someone else's) is a conflict, left alone and reported.
async fn write(ctx: &Context, namespace: &str, desired: Secret) -> Result<(), Error> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    let name = desired.name_any();
    match api
        .patch(
            &name,
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(&desired),
        )
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Err(Error::Certificate(format!(
            "Secret {namespace}/{name} holds keys another manager wrote, so it is not Hearth's: \
             rename or delete it, Hearth keeps the ExternalScaler's certificates under this name"
        ))),
        Err(e) => Err(kube_err(format!("apply Secret {namespace}/{name}"))(e)),
    }
}

/// The reconcile step: when the rendered children of `svc` hold a TriggerAuthentication (push
/// mode, own gateway, TLS on), issues the certificates when there are none or they are due
/// (recorded on the gateway Deployment of `view`, or in this process' memory when the cache is
/// behind its write), records them on the desired gateway Deployment, puts the CA's digest into
/// the ScaledObject's trigger, and applies the TriggerAuthentication (when KEDA is installed: at
/// most once per resync period unless the digest changed). When they hold none and the live
/// gateway has a record, removes the Secrets and the TriggerAuthentication. Takes the
/// TriggerAuthentication out of `desired`.
///
/// # Errors
/// API failures, a Secret of that name that is not Hearth's ([`Error::Certificate`]), or a
/// certificate that could not be generated.
pub async fn step(
    ctx: &Context,
    svc: &LLMService,
    view: &View,
    desired: &mut Desired,
) -> Result<(), Error> {
    let namespace = svc.namespace().unwrap_or_default();
    let name = svc.name_any();
    let Some(children) = desired.children.as_mut() else {
        return Ok(());
    };
    let cached = view.gateway.as_deref().and_then(Record::of);
    let Some(trigger_auth) = children.trigger_authentication.take() else {
        if cached.is_some() {
            remove(ctx, &namespace, &name).await?;
        }
        return Ok(());
    };
    let now = OffsetDateTime::now_utc();
    let cfg = &ctx.scaler_tls;
    let ca = cfg.ca.as_ref().ok_or_else(|| {
        Error::Certificate("the controller has no scaler CA (see its start-up log)".to_owned())
    })?;
    if ca.not_after <= now {
        return Err(Error::Certificate(format!(
            "the scaler CA expired at {}: restart the controller, which makes a new one",
            ca.not_after.format(&Rfc3339).unwrap_or_default()
        )));
    }
    let record = match ctx.scaler_records.newest(&namespace, &name, cached) {
        Some(r) if !r.due(cfg, ca, now) => r,
        previous => {
            let m = Material::issue(
                ca,
                previous.as_ref().map(|r| r.ca.as_str()),
                &scaler_sans(&name, &namespace),
                &names::scaler_client(&name, &namespace),
                cfg,
            )
            .map_err(|e| Error::Certificate(e.to_string()))?;
            let owner = svc.controller_owner_ref(&());
            let server = secret(
                names::scaler_tls(&name),
                &namespace,
                &name,
                owner.clone(),
                &m.bundle,
                &m.server,
            );
            let client = secret(
                names::scaler_client_tls(&name),
                &namespace,
                &name,
                owner,
                &m.bundle,
                &m.client,
            );
            write(ctx, &namespace, server).await?;
            write(ctx, &namespace, client).await?;
            let record = m.record();
            ctx.scaler_records
                .remember(&namespace, &name, record.clone());
            tracing::info!(service = %name, %namespace, not_after = %record.not_after, "ExternalScaler certificates issued");
            record
        }
    };
    if let Some(g) = children.gateway.as_mut() {
        g.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(RECORD_ANNOTATION.to_owned(), record.annotation());
    }
    let digest = record.digest();
    render::set_tls_digest(&mut children.scaled_object, &digest);
    if ctx.keda_installed() && ctx.trigger_auth_stale(&namespace, &name, &digest) {
        apply_trigger_auth(ctx, &namespace, &trigger_auth).await?;
        ctx.trigger_auth_applied(&namespace, &name, digest);
    }
    Ok(())
}

async fn apply_trigger_auth(
    ctx: &Context,
    namespace: &str,
    obj: &DynamicObject,
) -> Result<(), Error> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        ctx.client.clone(),
        namespace,
        &render::trigger_authentication_resource(),
    );
    let name = obj.name_any();
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(obj),
    )
    .await
    .map(drop)
    .map_err(kube_err(format!(
        "apply TriggerAuthentication {namespace}/{name}"
    )))
}

/// Deletes the TriggerAuthentication and the two Secrets of service `name`, once it no longer
/// needs them (poll mode, attached to an endpoint); gone already is done.
async fn remove(ctx: &Context, namespace: &str, name: &str) -> Result<(), Error> {
    async fn delete<K>(api: Api<K>, what: &str, namespace: &str, n: &str) -> Result<(), Error>
    where
        K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        match api.delete(n, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(kube_err(format!("delete {what} {namespace}/{n}"))(e)),
        }
    }
    if ctx.keda_installed() {
        let api: Api<DynamicObject> = Api::namespaced_with(
            ctx.client.clone(),
            namespace,
            &render::trigger_authentication_resource(),
        );
        delete(
            api,
            "TriggerAuthentication",
            namespace,
            &names::scaler_service(name),
        )
        .await?;
    }
    ctx.trigger_auth_forget(namespace, name);
    ctx.scaler_records.forget(namespace, name);
    for n in [names::scaler_tls(name), names::scaler_client_tls(name)] {
        let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
        delete(api, "Secret", namespace, &n).await?;
    }
    Ok(())
}

type Key = (String, String);

/// Memory of objects written but not watched (the TriggerAuthentications, the gateways' admin
/// Secrets), by namespace and name: the digest of what was written and when, so an unchanged
/// one is written again only once per resync period.
#[derive(Debug, Default)]
pub struct Applied(std::sync::Mutex<HashMap<Key, (String, Instant)>>);

impl Applied {
    /// Whether the TriggerAuthentication of `ns/name` should be applied for `digest`.
    pub fn stale(&self, ns: &str, name: &str, digest: &str, every: Duration) -> bool {
        let m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(&(ns.to_owned(), name.to_owned())) {
            Some((d, at)) => d != digest || at.elapsed() >= every,
            None => true,
        }
    }

    /// Records an apply.
    pub fn record(&self, ns: &str, name: &str, digest: String) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.insert((ns.to_owned(), name.to_owned()), (digest, Instant::now()));
    }

    /// Forgets `ns/name` (deleted).
    pub fn forget(&self, ns: &str, name: &str) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(&(ns.to_owned(), name.to_owned()));
    }
}

/// The issuances of this process, by namespace and service: until the gateway Deployment's
/// cache shows the record written with it, the next reconcile must not issue again.
#[derive(Debug, Default)]
pub struct Records(std::sync::Mutex<HashMap<Key, Record>>);

impl Records {
    /// The newer of `cached` (the gateway Deployment's) and this process' last issuance for
    /// `ns/name` (by expiry); the remembered one is dropped once the cache has caught up.
    pub fn newest(&self, ns: &str, name: &str, cached: Option<Record>) -> Option<Record> {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let key = (ns.to_owned(), name.to_owned());
        let expiry = |r: &Record| OffsetDateTime::parse(&r.not_after, &Rfc3339).ok();
        match (m.get(&key), cached) {
            (Some(mine), Some(c)) if expiry(&c) >= expiry(mine) => {
                m.remove(&key);
                Some(c)
            }
            (Some(mine), _) => Some(mine.clone()),
            (None, c) => c,
        }
    }

    /// Remembers an issuance.
    pub fn remember(&self, ns: &str, name: &str, record: Record) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.insert((ns.to_owned(), name.to_owned()), record);
    }

    /// Forgets `ns/name`.
    pub fn forget(&self, ns: &str, name: &str) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        m.remove(&(ns.to_owned(), name.to_owned()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ScalerTlsConfig {
        ScalerTlsConfig {
            cert_validity: Duration::from_secs(3 * 86_400),
            ca: Some(ca()),
        }
    }

    fn ca() -> Issued {
        pki::generate_ca(SCALER_CA_NAME, Duration::from_secs(30 * 86_400)).unwrap()
    }

    fn sans() -> Vec<String> {
        scaler_sans("chat", "team-a")
    }

    fn issue(ca: &Issued, previous: Option<&str>) -> Material {
        let client = names::scaler_client("chat", "team-a");
        Material::issue(ca, previous, &sans(), &client, &cfg()).unwrap()
    }

    #[test]
    fn renewals_keep_the_ca_and_a_new_ca_is_trusted_beside_the_previous_one() {
        let ca = ca();
        let first = issue(&ca, None);
        assert_eq!(first.bundle, ca.cert);
        pki::certified_key(first.server.cert.as_bytes(), first.server.key.as_bytes()).unwrap();
        pki::certified_key(first.client.cert.as_bytes(), first.client.key.as_bytes()).unwrap();
        let r1 = first.record();
        // A renewal: the same CA, the same bundle, new certificates, a new digest for KEDA.
        let second = issue(&ca, Some(&r1.ca));
        assert_eq!(second.bundle, ca.cert);
        assert_ne!(second.client.cert, first.client.cert);
        std::thread::sleep(Duration::from_millis(1100));
        assert_ne!(issue(&ca, Some(&r1.ca)).record().digest(), r1.digest());
        // Another CA: the previous one stays trusted.
        let other = self::ca();
        let third = issue(&other, Some(&r1.ca));
        assert_eq!(third.bundle, format!("{}{}", other.cert, ca.cert));
        assert!(r1.due(&cfg(), &other, OffsetDateTime::now_utc()));
    }

    #[test]
    fn a_record_is_due_two_thirds_into_its_life_and_round_trips_on_the_deployment() {
        let ca = ca();
        let m = issue(&ca, None);
        let r = m.record();
        let now = OffsetDateTime::now_utc();
        assert!(!r.due(&cfg(), &ca, now));
        assert!(r.due(&cfg(), &ca, now + Duration::from_secs(2 * 86_400 + 60)));
        // Certificates that end with their CA are not issued again (the same expiry would
        // come out), however late it is.
        let ending = pki::generate_ca(SCALER_CA_NAME, Duration::from_secs(86_400)).unwrap();
        let capped = issue(&ending, None).record();
        assert!(!capped.due(&cfg(), &ending, now + Duration::from_secs(80_000)));
        let mut d = Deployment::default();
        d.metadata.annotations = Some(BTreeMap::from([(
            RECORD_ANNOTATION.to_owned(),
            r.annotation(),
        )]));
        assert_eq!(Record::of(&d), Some(r.clone()));
        let broken = Record {
            not_after: "soon".into(),
            ..r
        };
        assert!(broken.due(&cfg(), &ca, now));
    }

    #[test]
    fn this_process_issuance_counts_until_the_cache_catches_up() {
        let records = Records::default();
        let old = Record {
            ca: "old".into(),
            not_after: "2027-01-01T00:00:00Z".into(),
        };
        let new = Record {
            ca: "new".into(),
            not_after: "2027-03-01T00:00:00Z".into(),
        };
        assert_eq!(
            records.newest("ns", "chat", Some(old.clone())),
            Some(old.clone())
        );
        records.remember("ns", "chat", new.clone());
        assert_eq!(records.newest("ns", "chat", Some(old)), Some(new.clone()));
        assert_eq!(records.newest("ns", "chat", None), Some(new.clone()));
        assert_eq!(records.newest("ns", "chat", Some(new.clone())), Some(new));
        assert_eq!(records.newest("ns", "chat", None), None);
    }

    #[test]
    fn the_secrets_hold_the_bundle_and_one_leaf_each() {
        let m = issue(&ca(), None);
        let s = secret(
            "chat-scaler-tls".into(),
            "team-a",
            "chat",
            None,
            &m.bundle,
            &m.server,
        );
        let data = s.data.unwrap();
        assert_eq!(data.len(), 3);
        assert_eq!(data["ca.crt"].0, m.bundle.as_bytes());
        assert_eq!(data["tls.key"].0, m.server.key.as_bytes());
        assert_eq!(s.type_.as_deref(), Some("kubernetes.io/tls"));
    }

    #[test]
    fn an_unchanged_trigger_authentication_is_applied_once_per_period() {
        let a = Applied::default();
        assert!(a.stale("ns", "chat", "d1", Duration::from_secs(300)));
        a.record("ns", "chat", "d1".into());
        assert!(!a.stale("ns", "chat", "d1", Duration::from_secs(300)));
        assert!(a.stale("ns", "chat", "d2", Duration::from_secs(300)));
        assert!(a.stale("ns", "chat", "d1", Duration::ZERO));
        a.forget("ns", "chat");
        assert!(a.stale("ns", "chat", "d1", Duration::from_secs(300)));
    }
}

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
//!
//! An `LLMEndpoint`'s shared gateway serves the ExternalScaler of models in many namespaces
//! (attached LLMServices, joined Deployments). Its serving certificate is issued the same way
//! ([`endpoint_step`]: Secret `<ep>-scaler-tls`, owned by the endpoint, recorded on its gateway
//! Deployment), but KEDA has one client certificate for every shared gateway, [`SharedClient`]
//! for the name [`names::SHARED_SCALER_CLIENT`]: kept in the controller's keys Secret, issued
//! again there two thirds into its life, and published to KEDA's namespace ([`maintain_shared`])
//! where the chart's ClusterTriggerAuthentication hands it to every push trigger on a shared
//! gateway (`authenticationRef` of kind `ClusterTriggerAuthentication`, and its digest as
//! `tlsDigest`, [`stamp_shared`]). No tenant can read it: it never lives in a model's namespace.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use hearth_crds::{LLMEndpoint, LLMService, wellknown::FIELD_MANAGER};
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
    /// KEDA's client certificate for the shared gateways, as loaded ([`crate::keys`]); `None`:
    /// issued from the CA in memory when shared gateways use mutual TLS.
    pub shared_client: Option<SharedClient>,
}

impl Default for ScalerTlsConfig {
    /// 90 days, no CA.
    fn default() -> Self {
        Self {
            cert_validity: Duration::from_secs(90 * 86_400),
            ca: None,
            shared_client: None,
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

    /// Whether to issue again at `now`, signing with `ca`, certificates valid for
    /// `cert_validity`: when another CA signed them, when the expiry does not parse, or two
    /// thirds into their life, unless they already end with the CA (certificates never outlive
    /// it, so issuing again would give the same expiry: the controller replaces a CA that
    /// close to its end when it starts).
    pub fn due(&self, cert_validity: Duration, ca: &Issued, now: OffsetDateTime) -> bool {
        self.ca != ca.cert
            || OffsetDateTime::parse(&self.not_after, &Rfc3339).map_or(true, |t| {
                t - cert_validity / 3 <= now && t + Duration::from_secs(60) < ca.not_after
            })
    }

    /// The record of certificates signed by the CA whose certificate (PEM) is `ca` that expire
    /// at `not_after`.
    pub fn new(ca: &str, not_after: OffsetDateTime) -> Self {
        Self {
            ca: ca.to_owned(),
            not_after: not_after.format(&Rfc3339).unwrap_or_default(),
        }
    }

    /// SHA-256 of the CA and the expiry, the first 16 hex digits: what changes with each
    /// issuance, when KEDA must read its Secret again.
    pub fn digest(&self) -> String {
        digest(&[&self.ca, &self.not_after])
    }

    fn annotation(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Records it on `gateway` (the desired gateway Deployment), [`RECORD_ANNOTATION`].
    pub fn annotate(&self, gateway: &mut Deployment) {
        gateway
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(RECORD_ANNOTATION.to_owned(), self.annotation());
    }
}

/// A certificate for `sans` and `usage` from Hearth's CA `ca` (the keys Secret's), valid for
/// `validity`, never past the CA: the gateways' and KEDA's, and the controller's metrics
/// server's (`hearth-controller run`).
///
/// # Errors
/// Certificate generation failed (a CA key that does not parse, a name that is not DNS).
pub fn issue_leaf(
    ca: &Issued,
    usage: Usage,
    sans: &[String],
    validity: Duration,
) -> Result<Issued, PkiError> {
    pki::issue(
        SCALER_CA_NAME,
        &ca.key,
        ca.not_after,
        usage,
        SCALER_CA_NAME,
        sans,
        validity,
    )
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
    /// KEDA's client certificate for this gateway alone (a service's own gateway); `None` for
    /// a shared gateway, which KEDA reaches with its [`SharedClient`].
    pub client: Option<Issued>,
}

impl Material {
    /// Issues from `ca` the gateway's certificate for `sans` and, with `client_name`, KEDA's
    /// for that name, trusting `previous_ca` (PEM) besides when another CA signed the previous
    /// ones.
    ///
    /// # Errors
    /// Certificate generation failed (a key that does not parse, a name that is not DNS).
    pub fn issue(
        ca: &Issued,
        previous_ca: Option<&str>,
        sans: &[String],
        client_name: Option<&str>,
        cfg: &ScalerTlsConfig,
    ) -> Result<Self, PkiError> {
        let server = issue_leaf(ca, Usage::Server, sans, cfg.cert_validity)?;
        let client = client_name
            .map(|n| issue_leaf(ca, Usage::Client, &[n.to_owned()], cfg.cert_validity))
            .transpose()?;
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
        let not_after = self.client.as_ref().map_or(self.server.not_after, |c| {
            c.not_after.min(self.server.not_after)
        });
        Record::new(&self.ca, not_after)
    }
}

/// KEDA's client certificate for the ExternalScaler of every `LLMEndpoint`'s gateway, for the
/// DNS name [`names::SHARED_SCALER_CLIENT`] (the name those gateways check,
/// `hearth-gateway --scaler-client-name`); kept in the controller's keys Secret
/// ([`crate::keys`]) and published to KEDA's namespace ([`maintain_shared`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedClient {
    /// The certificate, its key and expiry.
    pub leaf: Issued,
    /// The CA that signed it (which KEDA checks the gateways' certificates against) and the
    /// expiry: [`Record::due`] says when to issue it again, [`Record::digest`] goes into the
    /// push triggers on shared gateways.
    pub record: Record,
}

impl SharedClient {
    /// Issues it from `ca`, valid for `validity` (never past the CA).
    ///
    /// # Errors
    /// Certificate generation failed (a CA key that does not parse).
    pub fn issue(ca: &Issued, validity: Duration) -> Result<Self, PkiError> {
        let leaf = issue_leaf(
            ca,
            Usage::Client,
            &[names::SHARED_SCALER_CLIENT.to_owned()],
            validity,
        )?;
        let record = Record::new(&ca.cert, leaf.not_after);
        Ok(Self { leaf, record })
    }

    /// The data of KEDA's Secret (`ca.crt`, `tls.crt`, `tls.key`), which the
    /// ClusterTriggerAuthentication hands to the triggers as `caCert`, `tlsClientCert`,
    /// `tlsClientKey`.
    pub fn secret_data(&self) -> BTreeMap<String, ByteString> {
        tls_data(&self.record.ca, &self.leaf)
    }
}

/// The data of a `kubernetes.io/tls` Secret as KEDA's `external-push` scaler and the gateway
/// read it: `ca.crt` = `bundle`, `tls.crt` and `tls.key` of `leaf`.
fn tls_data(bundle: &str, leaf: &Issued) -> BTreeMap<String, ByteString> {
    [
        ("ca.crt", bundle),
        ("tls.crt", &leaf.cert),
        ("tls.key", &leaf.key),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), ByteString(v.as_bytes().to_vec())))
    .collect()
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

/// A `kubernetes.io/tls` Secret labelled `labels`: `ca.crt` = `bundle`, and `leaf`.
pub fn secret(
    name: String,
    namespace: &str,
    labels: BTreeMap<String, String>,
    owner: Option<OwnerReference>,
    bundle: &str,
    leaf: &Issued,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(tls_data(bundle, leaf)),
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
/// TriggerAuthentication out of `desired`. A push trigger on a shared gateway gets the
/// [`SharedClient`]'s digest ([`stamp_shared`]).
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
    stamp_shared(ctx, &mut children.scaled_object);
    let cached = view.gateway.as_deref().and_then(Record::of);
    let Some(trigger_auth) = children.trigger_authentication.take() else {
        if cached.is_some() {
            remove(ctx, &namespace, &name, true).await;
        }
        return Ok(());
    };
    let client_name = names::scaler_client(&name, &namespace);
    let owner = (
        svc.controller_owner_ref(&()),
        labels::labels(&name, Component::Autoscaler),
    );
    let record = issue_when_due(ctx, &namespace, &name, owner, cached, Some(&client_name)).await?;
    if let Some(g) = children.gateway.as_mut() {
        record.annotate(g);
    }
    let digest = record.digest();
    render::set_tls_digest(&mut children.scaled_object, &digest);
    if ctx.keda_installed() && ctx.trigger_auth_stale(&namespace, &name, &digest) {
        apply_trigger_auth(ctx, &namespace, &trigger_auth).await?;
        ctx.trigger_auth_applied(&namespace, &name, digest);
    }
    Ok(())
}

/// The reconcile step of an `LLMEndpoint` (before its gateway is planned): with mutual TLS on
/// shared gateways (`on`: [`crate::render::RenderConfig::shared_scaler_tls`]), issues its
/// gateway's serving certificate when there is none or it is due (Secret `<ep>-scaler-tls`,
/// owned by the endpoint) and returns the record for the desired gateway Deployment
/// ([`Record::annotate`]); off, removes that Secret when the live gateway (`live`) has a record.
///
/// # Errors
/// As [`step`].
pub async fn endpoint_step(
    ctx: &Context,
    ep: &LLMEndpoint,
    live: Option<&Deployment>,
    on: bool,
) -> Result<Option<Record>, Error> {
    let namespace = ep.namespace().unwrap_or_default();
    let name = ep.name_any();
    let cached = live.and_then(Record::of);
    if !on {
        if cached.is_some() {
            remove(ctx, &namespace, &name, false).await;
        }
        return Ok(None);
    }
    let mut labels = labels::labels(&name, Component::Gateway);
    labels.insert(labels::ENDPOINT_LABEL.to_owned(), name.clone());
    let owner = (ep.controller_owner_ref(&()), labels);
    issue_when_due(ctx, &namespace, &name, owner, cached, None)
        .await
        .map(Some)
}

/// Sets the [`SharedClient`]'s digest as the `tlsDigest` of a rendered ScaledObject whose push
/// trigger authenticates with the shared ClusterTriggerAuthentication (a model on a shared
/// gateway), so KEDA reads the client Secret again after each renewal; others are left alone.
pub fn stamp_shared(ctx: &Context, scaled_object: &mut DynamicObject) {
    let shared = scaled_object
        .data
        .pointer("/spec/triggers/0/authenticationRef/kind")
        .and_then(|k| k.as_str())
        == Some("ClusterTriggerAuthentication")
        && scaled_object
            .data
            .pointer("/spec/triggers/0/type")
            .and_then(|t| t.as_str())
            == Some("external-push");
    if let Some(digest) = shared.then(|| ctx.shared_client_digest()).flatten() {
        render::set_tls_digest(scaled_object, &digest);
    }
}

/// Issues gateway `name`'s certificates (a service's own, or an endpoint's) when there are none
/// or they are due: the serving one into `N-scaler-tls` and, with `client_name`, KEDA's into
/// `N-scaler-client-tls`, both with `owner`'s reference and labels; returns what is issued now (the record the
/// newest of `cached` and this process' memory holds when nothing is due).
async fn issue_when_due(
    ctx: &Context,
    namespace: &str,
    name: &str,
    owner: (Option<OwnerReference>, BTreeMap<String, String>),
    cached: Option<Record>,
    client_name: Option<&str>,
) -> Result<Record, Error> {
    let (owner, labels) = owner;
    let now = OffsetDateTime::now_utc();
    let cfg = &ctx.scaler_tls;
    let ca = usable_ca(cfg, now)?;
    match ctx.scaler_records.newest(namespace, name, cached) {
        Some(r) if !r.due(cfg.cert_validity, ca, now) => Ok(r),
        previous => {
            let m = Material::issue(
                ca,
                previous.as_ref().map(|r| r.ca.as_str()),
                &scaler_sans(name, namespace),
                client_name,
                cfg,
            )
            .map_err(|e| Error::Certificate(e.to_string()))?;
            let server = secret(
                names::scaler_tls(name),
                namespace,
                labels.clone(),
                owner.clone(),
                &m.bundle,
                &m.server,
            );
            write(ctx, namespace, server).await?;
            if let Some(c) = &m.client {
                let client = secret(
                    names::scaler_client_tls(name),
                    namespace,
                    labels,
                    owner,
                    &m.bundle,
                    c,
                );
                write(ctx, namespace, client).await?;
            }
            let record = m.record();
            ctx.scaler_records.remember(namespace, name, record.clone());
            tracing::info!(gateway = %name, %namespace, not_after = %record.not_after, "ExternalScaler certificates issued");
            Ok(record)
        }
    }
}

/// The scaler CA, unless missing or expired at `now`.
fn usable_ca(cfg: &ScalerTlsConfig, now: OffsetDateTime) -> Result<&Issued, Error> {
    let ca = cfg.ca.as_ref().ok_or_else(|| {
        Error::Certificate("the controller has no scaler CA (see its start-up log)".to_owned())
    })?;
    if ca.not_after <= now {
        return Err(Error::Certificate(format!(
            "the scaler CA expired at {}: restart the controller, which makes a new one",
            ca.not_after.format(&Rfc3339).unwrap_or_default()
        )));
    }
    Ok(ca)
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

/// Deletes the Secrets of gateway `name` once it no longer needs them (a service in poll mode
/// or attached to an endpoint, mutual TLS turned off), and with `own` (a service's own gateway)
/// its TriggerAuthentication and KEDA's Secret; gone already is done. Best effort: a failure
/// (RBAC taken away with the chart value that granted it) is logged and not retried, since
/// the gateway written next no longer carries the record that asked for it; the objects stay
/// until their owner is deleted.
async fn remove(ctx: &Context, namespace: &str, name: &str, own: bool) {
    async fn delete<K>(api: Api<K>, what: &str, namespace: &str, n: &str)
    where
        K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    {
        match api.delete(n, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                tracing::warn!(error = %e, "{what} {namespace}/{n} is no longer used and could not be deleted; it stays until its owner is deleted")
            }
        }
    }
    if own && ctx.keda_installed() {
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
        .await;
    }
    ctx.trigger_auth_forget(namespace, name);
    ctx.scaler_records.forget(namespace, name);
    let mut secrets = vec![names::scaler_tls(name)];
    if own {
        secrets.push(names::scaler_client_tls(name));
    }
    for n in secrets {
        let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
        delete(api, "Secret", namespace, &n).await;
    }
}

/// Where [`maintain_shared`] keeps and publishes the [`SharedClient`].
#[derive(Clone, Debug)]
pub struct SharedClientHome {
    /// The controller's keys Secret (`--admin-keys-secret`), `(namespace, name)`.
    pub keys: (String, String),
    /// KEDA's Secret (`--keda-scaler-secret`, made empty by the chart in KEDA's namespace),
    /// `(namespace, name)`.
    pub keda: (String, String),
    /// The life of a CA made when the keys Secret has lost its own (`--scaler-ca-validity`).
    pub ca_validity: Duration,
    /// How often the certificate is checked and copied (the resync period, at least a
    /// minute, in `hearth-controller run`).
    pub every: Duration,
}

/// Keeps KEDA's [`SharedClient`] current: [`refresh_shared`] every [`SharedClientHome::every`]
/// (at least a second), from the first period on ([`crate::run`] refreshes it once before any
/// reconcile). Returns only when the keys Secret's CA is no longer the one this process signs
/// with ([`Error::Certificate`]): `run` then stops with that error, so the restart loads it.
pub async fn maintain_shared(ctx: std::sync::Arc<Context>, home: SharedClientHome) -> Error {
    let mut tick = tokio::time::interval(home.every.max(Duration::from_secs(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // The first tick is now: refreshed already.
    tick.tick().await;
    loop {
        tick.tick().await;
        if let Err(e) = refresh_shared(&ctx, &home).await {
            return e;
        }
    }
}

/// Reads KEDA's [`SharedClient`] from the keys Secret, issuing it again there when due
/// ([`crate::keys::load_or_init`], which takes another replica's renewal instead of making a
/// second, and never makes a CA while running), writes it into KEDA's Secret (a merge patch,
/// never a create: a Secret that is gone, the release being uninstalled, stays gone; one
/// edited away comes back), and only then hands a new one to the reconciles
/// ([`Context::set_shared_client`]), which stamp its digest on the push triggers at their next
/// run: KEDA never reconnects before its Secret holds the certificate. Nothing is written when
/// the keys cannot be read or written (logged, naming the Secret, and retried at the next
/// period).
///
/// # Errors
/// [`Error::Certificate`] when the keys Secret's CA is no longer the one this process signs
/// with (another replica replaced a CA near its end when it started): only a restart loads it.
pub async fn refresh_shared(ctx: &Context, home: &SharedClientHome) -> Result<(), Error> {
    let (keys_ns, keys_name) = &home.keys;
    let keys_secret = format!("{keys_ns}/{keys_name}");
    let wanted = crate::keys::Wanted {
        scaler_ca: Some(home.ca_validity),
        scaler_ca_min_left: Duration::ZERO,
        shared_client: Some(ctx.scaler_tls.cert_validity),
        keep_ca: true,
        ..Default::default()
    };
    let loaded = match crate::keys::load_or_init(ctx.client.clone(), keys_ns, keys_name, wanted)
        .await
    {
        Ok(keys) => match (keys.scaler_ca, keys.shared_client) {
            (Some(ca), Some(client)) if Some(&ca) == ctx.scaler_tls.ca.as_ref() => client,
            _ => {
                return Err(Error::Certificate(format!(
                    "the scaler CA in Secret {keys_secret} is no longer the one this controller signs with (another replica replaced it): restarting to load it"
                )));
            }
        },
        Err(e) => {
            tracing::error!(error = %e, "KEDA's client certificate for the shared gateways could not be read or renewed");
            return Ok(());
        }
    };
    let (ns, name) = &home.keda;
    let patch = serde_json::json!({ "data": loaded.secret_data() });
    if let Err(e) = Api::<Secret>::namespaced(ctx.client.clone(), ns)
        .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
    {
        tracing::error!(secret = %format!("{ns}/{name}"), error = %e, "KEDA's client certificate for the shared gateways could not be written, so their ExternalScalers refuse KEDA (the chart makes this Secret; check it exists and the controller's RBAC)");
        return Ok(());
    }
    if ctx.shared_client().as_ref() != Some(&loaded) {
        tracing::info!(not_after = %loaded.record.not_after, "KEDA's client certificate for the shared gateways renewed");
        ctx.set_shared_client(loaded);
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
            shared_client: None,
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
        Material::issue(ca, previous, &sans(), Some(&client), &cfg()).unwrap()
    }

    #[test]
    fn renewals_keep_the_ca_and_a_new_ca_is_trusted_beside_the_previous_one() {
        let ca = ca();
        let first = issue(&ca, None);
        assert_eq!(first.bundle, ca.cert);
        pki::certified_key(first.server.cert.as_bytes(), first.server.key.as_bytes()).unwrap();
        let client = first.client.clone().unwrap();
        pki::certified_key(client.cert.as_bytes(), client.key.as_bytes()).unwrap();
        let r1 = first.record();
        // A renewal: the same CA, the same bundle, new certificates, a new digest for KEDA.
        let second = issue(&ca, Some(&r1.ca));
        assert_eq!(second.bundle, ca.cert);
        assert_ne!(second.client.unwrap().cert, client.cert);
        std::thread::sleep(Duration::from_millis(1100));
        assert_ne!(issue(&ca, Some(&r1.ca)).record().digest(), r1.digest());
        // Another CA: the previous one stays trusted.
        let other = self::ca();
        let third = issue(&other, Some(&r1.ca));
        assert_eq!(third.bundle, format!("{}{}", other.cert, ca.cert));
        assert!(r1.due(cfg().cert_validity, &other, OffsetDateTime::now_utc()));
    }

    #[test]
    fn a_record_is_due_two_thirds_into_its_life_and_round_trips_on_the_deployment() {
        let ca = ca();
        let m = issue(&ca, None);
        let r = m.record();
        let now = OffsetDateTime::now_utc();
        assert!(!r.due(cfg().cert_validity, &ca, now));
        assert!(r.due(
            cfg().cert_validity,
            &ca,
            now + Duration::from_secs(2 * 86_400 + 60)
        ));
        // Certificates that end with their CA are not issued again (the same expiry would
        // come out), however late it is.
        let ending = pki::generate_ca(SCALER_CA_NAME, Duration::from_secs(86_400)).unwrap();
        let capped = issue(&ending, None).record();
        assert!(!capped.due(
            cfg().cert_validity,
            &ending,
            now + Duration::from_secs(80_000)
        ));
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
        assert!(broken.due(cfg().cert_validity, &ca, now));
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
            labels::labels("chat", Component::Autoscaler),
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

//! Mutual TLS between KEDA and a push-mode service's own gateway: the controller is the
//! certificate authority of each such service, and keeps its certificates current.
//!
//! For service `N` (namespace `ns`) it keeps two Secrets, both owned by the LLMService:
//! - `N-scaler-tls` (`kubernetes.io/tls`): the service's own CA (`ca-signing.crt`,
//!   `ca-signing.key`), the bundle trusted (`ca.crt`: the CA, plus the previous one while a CA
//!   rotation is under way) and the gateway's serving certificate (`tls.crt`, `tls.key`, for
//!   `N-scaler`, `N-scaler.ns`, `N-scaler.ns.svc` and `N-scaler.ns.svc.cluster.local`). The
//!   gateway mounts `ca.crt`, `tls.crt` and `tls.key` only, and re-reads them
//!   (`hearth-gateway --scaler-tls-dir`).
//! - `N-scaler-client-tls` (`kubernetes.io/tls`): KEDA's client certificate (`clientAuth`),
//!   signed by that CA, and the same `ca.crt` to check the gateway with; the TriggerAuthentication
//!   `N-scaler` hands the three keys to KEDA's ExternalScaler (`caCert`, `tlsClientCert`,
//!   `tlsClientKey`).
//!
//! One CA per service: a certificate of one service's Secrets is worth nothing at another's
//! gateway. Certificates are renewed two thirds into their life (cert-manager's default); a CA
//! that could not sign another full-length certificate is replaced, with the old one kept in
//! the bundle for that generation, so neither side ever distrusts the other during a rotation.
//! Deleting `N-scaler-tls` re-keys the service from a new CA: KEDA is refused until the kubelet
//! has refreshed the gateway's files (its sync period, about a minute), then reconnects.
//!
//! KEDA caches a scaler, with its TLS material, by the ScaledObject's generation; the digest of
//! the client Secret is put into the trigger's metadata ([`render::TLS_DIGEST_KEY`]), so a new
//! certificate changes the ScaledObject and KEDA connects with it.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use hearth_crds::{LLMService, wellknown::FIELD_MANAGER};
use hearth_net::pki::{self, Issued, PkiError, Usage};
use k8s_openapi::{
    ByteString,
    api::core::v1::Secret,
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams},
};
use time::{OffsetDateTime, format_description::well_known::Rfc3339};

use crate::{
    labels::{self, Component},
    names,
    reconcile::{Context, Desired, Error, kube_err},
    render,
};

/// Annotation with a certificate's `notAfter` (RFC 3339), so renewal needs no X.509 parser.
pub const CERT_NOT_AFTER_ANNOTATION: &str = "serving.hearth.dev/cert-not-after";
/// Annotation with the signing CA's `notAfter` (RFC 3339).
pub const CA_NOT_AFTER_ANNOTATION: &str = "serving.hearth.dev/ca-not-after";
/// Annotation with the serving certificate's subject alternative names, comma-separated.
pub const SANS_ANNOTATION: &str = "serving.hearth.dev/sans";
/// Annotation on the client Secret with the digest of the CA that signed it.
pub const ISSUER_ANNOTATION: &str = "serving.hearth.dev/issuer-digest";

/// Common name of every service's ExternalScaler CA.
const CA_NAME: &str = "hearth-scaler-ca";
/// Common name of KEDA's client certificates.
const CLIENT_NAME: &str = "keda-operator";

/// Lifetimes of the certificates (`hearth-controller --scaler-cert-validity`,
/// `--scaler-ca-validity`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScalerTlsConfig {
    /// Lifetime of the gateway's and KEDA's certificates; renewed after two thirds.
    pub cert_validity: Duration,
    /// Lifetime of each service's CA; replaced once it cannot sign two more certificates.
    pub ca_validity: Duration,
}

impl Default for ScalerTlsConfig {
    /// 90 days for the certificates, 10 years for the CA.
    fn default() -> Self {
        Self {
            cert_validity: Duration::from_secs(90 * 86_400),
            ca_validity: Duration::from_secs(3650 * 86_400),
        }
    }
}

/// The content of `N-scaler-tls`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayMaterial {
    /// The CA signing now.
    pub ca: Issued,
    /// What both sides trust (PEM): the CA, and the previous one during a rotation.
    pub bundle: String,
    /// The gateway's serving certificate.
    pub server: Issued,
    /// Its subject alternative names.
    pub sans: Vec<String>,
}

/// The content of `N-scaler-client-tls`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientMaterial {
    /// What KEDA checks the gateway with (the gateway Secret's bundle).
    pub bundle: String,
    /// KEDA's client certificate.
    pub client: Issued,
    /// [`digest`] of the CA certificate that signed it.
    pub issuer: String,
}

impl ClientMaterial {
    /// SHA-256 of the bundle and the certificate, the first 16 hex digits: what changes when
    /// KEDA must read the Secret again.
    pub fn digest(&self) -> String {
        digest(&[&self.bundle, &self.client.cert])
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

fn renew_due(not_after: OffsetDateTime, validity: Duration, now: OffsetDateTime) -> bool {
    not_after - validity / 3 <= now
}

fn issue_server(ca: &Issued, sans: &[String], cfg: &ScalerTlsConfig) -> Result<Issued, PkiError> {
    pki::issue(
        CA_NAME,
        &ca.key,
        ca.not_after,
        Usage::Server,
        CA_NAME,
        sans,
        cfg.cert_validity,
    )
}

/// What `N-scaler-tls` should hold given what it holds (`existing`, `None` when it is absent or
/// unreadable), and whether that is new. Kept as is while its CA can sign another full-length
/// certificate, its certificate is not due for renewal and its names are `sans`.
///
/// # Errors
/// Certificate generation failed.
pub fn gateway_material(
    existing: Option<GatewayMaterial>,
    sans: &[String],
    cfg: &ScalerTlsConfig,
    now: OffsetDateTime,
) -> Result<(GatewayMaterial, bool), PkiError> {
    let fresh = |previous: Option<&GatewayMaterial>| -> Result<GatewayMaterial, PkiError> {
        let ca = pki::generate_ca(CA_NAME, cfg.ca_validity)?;
        let server = issue_server(&ca, sans, cfg)?;
        let bundle = match previous {
            Some(p) => format!("{}{}", ca.cert, p.ca.cert),
            None => ca.cert.clone(),
        };
        Ok(GatewayMaterial {
            ca,
            bundle,
            server,
            sans: sans.to_vec(),
        })
    };
    let Some(m) = existing else {
        return Ok((fresh(None)?, true));
    };
    if m.ca.not_after - cfg.cert_validity * 2 <= now {
        return Ok((fresh(Some(&m))?, true));
    }
    if m.sans != sans || renew_due(m.server.not_after, cfg.cert_validity, now) {
        let server = issue_server(&m.ca, sans, cfg)?;
        return Ok((
            GatewayMaterial {
                bundle: m.ca.cert.clone(),
                server,
                sans: sans.to_vec(),
                ca: m.ca,
            },
            true,
        ));
    }
    Ok((m, false))
}

/// What `N-scaler-client-tls` should hold given the gateway's material and what it holds, and
/// whether that is new: kept while the current CA signed it, it has the gateway's bundle and
/// it is not due for renewal.
///
/// # Errors
/// Certificate generation failed.
pub fn client_material(
    existing: Option<ClientMaterial>,
    gateway: &GatewayMaterial,
    cfg: &ScalerTlsConfig,
    now: OffsetDateTime,
) -> Result<(ClientMaterial, bool), PkiError> {
    let issuer = digest(&[&gateway.ca.cert]);
    if let Some(m) = existing
        && m.issuer == issuer
        && m.bundle == gateway.bundle
        && !renew_due(m.client.not_after, cfg.cert_validity, now)
    {
        return Ok((m, false));
    }
    let client = pki::issue(
        CA_NAME,
        &gateway.ca.key,
        gateway.ca.not_after,
        Usage::Client,
        CLIENT_NAME,
        &[],
        cfg.cert_validity,
    )?;
    Ok((
        ClientMaterial {
            bundle: gateway.bundle.clone(),
            client,
            issuer,
        },
        true,
    ))
}

fn ts(t: OffsetDateTime) -> String {
    t.format(&Rfc3339).unwrap_or_default()
}

fn annotation(s: &Secret, key: &str) -> Option<String> {
    s.metadata.annotations.as_ref()?.get(key).cloned()
}

fn time_annotation(s: &Secret, key: &str) -> Option<OffsetDateTime> {
    OffsetDateTime::parse(&annotation(s, key)?, &Rfc3339).ok()
}

fn field(s: &Secret, key: &str) -> Option<String> {
    let v = s.data.as_ref()?.get(key)?;
    String::from_utf8(v.0.clone()).ok()
}

impl GatewayMaterial {
    /// Reads a Secret this module wrote; `None` when anything is missing (it is then replaced).
    pub fn from_secret(s: &Secret) -> Option<Self> {
        let ca_not_after = time_annotation(s, CA_NOT_AFTER_ANNOTATION)?;
        Some(Self {
            ca: Issued {
                cert: field(s, "ca-signing.crt")?,
                key: field(s, "ca-signing.key")?,
                not_after: ca_not_after,
            },
            bundle: field(s, "ca.crt")?,
            server: Issued {
                cert: field(s, "tls.crt")?,
                key: field(s, "tls.key")?,
                not_after: time_annotation(s, CERT_NOT_AFTER_ANNOTATION)?,
            },
            sans: annotation(s, SANS_ANNOTATION)?
                .split(',')
                .map(str::to_owned)
                .collect(),
        })
    }

    fn data(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("ca.crt".to_owned(), self.bundle.clone()),
            ("ca-signing.crt".to_owned(), self.ca.cert.clone()),
            ("ca-signing.key".to_owned(), self.ca.key.clone()),
            ("tls.crt".to_owned(), self.server.cert.clone()),
            ("tls.key".to_owned(), self.server.key.clone()),
        ])
    }

    fn annotations(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                CERT_NOT_AFTER_ANNOTATION.to_owned(),
                ts(self.server.not_after),
            ),
            (CA_NOT_AFTER_ANNOTATION.to_owned(), ts(self.ca.not_after)),
            (SANS_ANNOTATION.to_owned(), self.sans.join(",")),
        ])
    }
}

impl ClientMaterial {
    /// Reads a Secret this module wrote; `None` when anything is missing (it is then replaced).
    pub fn from_secret(s: &Secret) -> Option<Self> {
        Some(Self {
            bundle: field(s, "ca.crt")?,
            client: Issued {
                cert: field(s, "tls.crt")?,
                key: field(s, "tls.key")?,
                not_after: time_annotation(s, CERT_NOT_AFTER_ANNOTATION)?,
            },
            issuer: annotation(s, ISSUER_ANNOTATION)?,
        })
    }

    fn data(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            ("ca.crt".to_owned(), self.bundle.clone()),
            ("tls.crt".to_owned(), self.client.cert.clone()),
            ("tls.key".to_owned(), self.client.key.clone()),
        ])
    }

    fn annotations(&self) -> BTreeMap<String, String> {
        BTreeMap::from([
            (
                CERT_NOT_AFTER_ANNOTATION.to_owned(),
                ts(self.client.not_after),
            ),
            (ISSUER_ANNOTATION.to_owned(), self.issuer.clone()),
        ])
    }
}

/// A `kubernetes.io/tls` Secret of service `service` with `data` and `annotations`.
fn secret(
    name: String,
    namespace: &str,
    service: &str,
    owner: Option<OwnerReference>,
    data: BTreeMap<String, String>,
    annotations: BTreeMap<String, String>,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(name),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels::labels(service, Component::Autoscaler)),
            annotations: Some(annotations),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(
            data.into_iter()
                .map(|(k, v)| (k, ByteString(v.into_bytes())))
                .collect(),
        ),
        ..Default::default()
    }
}

/// Whether `s` is controlled by `svc` (its controller owner reference has `svc`'s UID).
fn owned_by(s: &Secret, svc: &LLMService) -> bool {
    let uid = svc.meta().uid.as_deref();
    s.owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && Some(o.uid.as_str()) == uid)
}

/// Writes `desired`: a plain create when the cache has no Secret of that name (a Secret someone
/// else made under it is left alone, and the conflict reported), server-side apply of the
/// controller's own otherwise.
async fn write(
    ctx: &Context,
    namespace: &str,
    desired: Secret,
    cached: Option<&Secret>,
) -> Result<(), Error> {
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    let name = desired.name_any();
    match cached {
        None => match api.create(&PostParams::default(), &desired).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 409 => Err(Error::Certificate(format!(
                "Secret {namespace}/{name} exists and is not Hearth's: rename or delete it, \
                 Hearth keeps the ExternalScaler's certificates under this name"
            ))),
            Err(e) => Err(kube_err(format!("create Secret {namespace}/{name}"))(e)),
        },
        Some(_) => api
            .patch(
                &name,
                &PatchParams::apply(FIELD_MANAGER).force(),
                &Patch::Apply(&desired),
            )
            .await
            .map(drop)
            .map_err(kube_err(format!("apply Secret {namespace}/{name}"))),
    }
}

/// The reconcile step: when the rendered children of `svc` hold a TriggerAuthentication (push
/// mode, own gateway, TLS on), makes its Secrets current, puts the client digest into the
/// ScaledObject's trigger, and applies the TriggerAuthentication (when KEDA is installed: at
/// most once per resync period unless the digest changed). When they hold none, removes what
/// an earlier render of the service made. Takes the TriggerAuthentication out of `desired`.
///
/// # Errors
/// API failures, a Secret of that name that is not Hearth's ([`Error::Certificate`]), or a
/// certificate that could not be generated.
pub async fn step(ctx: &Context, svc: &LLMService, desired: &mut Desired) -> Result<(), Error> {
    let namespace = svc.namespace().unwrap_or_default();
    let name = svc.name_any();
    let Some(children) = desired.children.as_mut() else {
        return Ok(());
    };
    let gateway_name = names::scaler_tls(&name);
    let client_name = names::scaler_client_tls(&name);
    let cached_gateway = ctx.secret(&namespace, &gateway_name);
    let cached_client = ctx.secret(&namespace, &client_name);
    let Some(trigger_auth) = children.trigger_authentication.take() else {
        return remove(ctx, svc, &namespace, &[cached_gateway, cached_client]).await;
    };
    let now = OffsetDateTime::now_utc();
    let cfg = ctx.scaler_tls;
    let sans = scaler_sans(&name, &namespace);
    let owner = svc.controller_owner_ref(&());
    let cert_err = |e: PkiError| Error::Certificate(e.to_string());

    let (gateway, new) = gateway_material(
        cached_gateway
            .as_deref()
            .and_then(GatewayMaterial::from_secret),
        &sans,
        &cfg,
        now,
    )
    .map_err(cert_err)?;
    if new {
        let s = secret(
            gateway_name,
            &namespace,
            &name,
            owner.clone(),
            gateway.data(),
            gateway.annotations(),
        );
        write(ctx, &namespace, s, cached_gateway.as_deref()).await?;
        tracing::info!(service = %name, %namespace, "ExternalScaler CA and serving certificate issued");
    }
    let (client, new) = client_material(
        cached_client
            .as_deref()
            .and_then(ClientMaterial::from_secret),
        &gateway,
        &cfg,
        now,
    )
    .map_err(cert_err)?;
    if new {
        let s = secret(
            client_name,
            &namespace,
            &name,
            owner,
            client.data(),
            client.annotations(),
        );
        write(ctx, &namespace, s, cached_client.as_deref()).await?;
        tracing::info!(service = %name, %namespace, "KEDA's ExternalScaler client certificate issued");
    }
    let digest = client.digest();
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

/// Deletes the TriggerAuthentication and Secrets an earlier render made, once the service no
/// longer needs them (poll mode, attached to an endpoint, TLS off); only those it controls.
async fn remove(
    ctx: &Context,
    svc: &LLMService,
    namespace: &str,
    cached: &[Option<std::sync::Arc<Secret>>],
) -> Result<(), Error> {
    let owned: Vec<_> = cached
        .iter()
        .flatten()
        .filter(|s| owned_by(s, svc))
        .collect();
    if owned.is_empty() {
        return Ok(());
    }
    let name = svc.name_any();
    if ctx.keda_installed() {
        let api: Api<DynamicObject> = Api::namespaced_with(
            ctx.client.clone(),
            namespace,
            &render::trigger_authentication_resource(),
        );
        let ta = names::scaler_service(&name);
        match api.delete(&ta, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => {
                return Err(kube_err(format!(
                    "delete TriggerAuthentication {namespace}/{ta}"
                ))(e));
            }
        }
        ctx.trigger_auth_forget(namespace, &name);
    }
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), namespace);
    for s in owned {
        let n = s.name_any();
        match api.delete(&n, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 => {}
            Err(e) => return Err(kube_err(format!("delete Secret {namespace}/{n}"))(e)),
        }
    }
    Ok(())
}

/// Memory of the TriggerAuthentications applied, by namespace and service: the digest and
/// when, so an unchanged one is applied again only once per resync period (it is not watched).
#[derive(Debug, Default)]
pub struct Applied(
    std::sync::Mutex<std::collections::HashMap<(String, String), (String, Instant)>>,
);

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

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ScalerTlsConfig {
        ScalerTlsConfig {
            cert_validity: Duration::from_secs(3 * 86_400),
            ca_validity: Duration::from_secs(30 * 86_400),
        }
    }

    fn sans() -> Vec<String> {
        scaler_sans("chat", "team-a")
    }

    #[test]
    fn material_is_kept_until_renewal_then_reissued_from_the_same_ca() {
        let now = OffsetDateTime::now_utc();
        let (gw, new) = gateway_material(None, &sans(), &cfg(), now).unwrap();
        assert!(new);
        assert_eq!(gw.bundle, gw.ca.cert);
        let (client, new) = client_material(None, &gw, &cfg(), now).unwrap();
        assert!(new);

        // Read back from the Secrets it is written as: nothing to do.
        let gs = secret(
            "a".into(),
            "team-a",
            "chat",
            None,
            gw.data(),
            gw.annotations(),
        );
        let cs = secret(
            "b".into(),
            "team-a",
            "chat",
            None,
            client.data(),
            client.annotations(),
        );
        let gw2 = GatewayMaterial::from_secret(&gs).unwrap();
        let client2 = ClientMaterial::from_secret(&cs).unwrap();
        assert_eq!(gw2, gw);
        assert_eq!(client2, client);
        let (same, new) = gateway_material(Some(gw2), &sans(), &cfg(), now).unwrap();
        assert!(!new);
        let (_, new) = client_material(Some(client2.clone()), &same, &cfg(), now).unwrap();
        assert!(!new);

        // Two thirds into its life: new leaves, same CA, a new digest for KEDA.
        let later = now + Duration::from_secs(2 * 86_400 + 60);
        let (renewed, new) = gateway_material(Some(same.clone()), &sans(), &cfg(), later).unwrap();
        assert!(new);
        assert_eq!(renewed.ca, same.ca);
        assert_ne!(renewed.server, same.server);
        let (c3, new) = client_material(Some(client2.clone()), &renewed, &cfg(), later).unwrap();
        assert!(new);
        assert_ne!(c3.digest(), client2.digest());

        // Other names: a new serving certificate at once.
        let other = scaler_sans("chat", "team-b");
        let (moved, new) = gateway_material(Some(same), &other, &cfg(), now).unwrap();
        assert!(new);
        assert_eq!(moved.sans, other);
    }

    #[test]
    fn a_ca_near_its_end_is_replaced_and_the_old_one_stays_trusted_for_a_generation() {
        let now = OffsetDateTime::now_utc();
        let (gw, _) = gateway_material(None, &sans(), &cfg(), now).unwrap();
        let (client, _) = client_material(None, &gw, &cfg(), now).unwrap();
        let late = now + Duration::from_secs(25 * 86_400);
        let (next, new) = gateway_material(Some(gw.clone()), &sans(), &cfg(), late).unwrap();
        assert!(new);
        assert_ne!(next.ca, gw.ca);
        assert_eq!(next.bundle, format!("{}{}", next.ca.cert, gw.ca.cert));
        // The client certificate of the old CA is replaced by one of the new.
        let (c2, new) = client_material(Some(client), &next, &cfg(), late).unwrap();
        assert!(new);
        assert_eq!(c2.issuer, digest(&[&next.ca.cert]));
        assert_eq!(c2.bundle, next.bundle);
    }

    #[test]
    fn a_secret_missing_a_field_reads_as_none_and_is_replaced() {
        let s = Secret::default();
        assert!(GatewayMaterial::from_secret(&s).is_none());
        assert!(ClientMaterial::from_secret(&s).is_none());
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

//! The bearer tokens of the gateways' admin ports ([`hearth_crds::admin`]), all derived from
//! one key the controller keeps.
//!
//! The key: 32 random bytes in the controller's keys Secret (`crate::keys`, field
//! `admin-key`).
//!
//! Each token is HMAC-SHA256(key, label) in hex (64 digits):
//! - `controller`: the controller's own, held in memory only ([`Scope::Admin`] at every
//!   gateway: demand for the device handover, metering, failed adapter loads);
//! - `keda`: KEDA's ([`Scope::Scaler`]), written to the Secret of `--keda-token-secret`, which
//!   the chart's ClusterTriggerAuthentication hands to every `metrics-api` trigger;
//! - `prometheus`: the scrapers' ([`Scope::Metrics`]), written to the Secret of
//!   `--metrics-token-secret`, which the chart's PodMonitor sends;
//! - `gateway/<uid>`: one gateway's own, for its owner's UID (the LLMService or LLMEndpoint),
//!   which its replicas send each other.
//!
//! Each gateway gets the Secret `<gateway>-admin` ([`gateway_secret`]): its own token and the
//! digests of the other three, never the tokens themselves. A new key (delete the key Secret's
//! data and restart the controller) changes every token; the gateways read their Secrets again
//! within the kubelet's volume refresh (about a minute).

use std::collections::BTreeMap;

use hearth_crds::admin::{
    AUTHORIZED_KEY, AuthorizedToken, AuthorizedTokens, Scope, TOKEN_KEY, digest_hex,
};
use hearth_crds::wellknown::FIELD_MANAGER;
use k8s_openapi::{
    ByteString,
    api::core::v1::Secret,
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
};

use crate::{
    labels::{self, Component},
    names,
    reconcile::{Context, Error, kube_err},
};

/// The tokens of one key.
#[derive(Clone)]
pub struct AdminTokens {
    key: ring::hmac::Key,
    /// [`AdminTokens::authorized`] as the JSON of every gateway's admin Secret: fixed by the
    /// key, so made once.
    authorized_json: String,
}

impl std::fmt::Debug for AdminTokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminTokens(..)")
    }
}

impl AdminTokens {
    /// The tokens of `key`.
    pub fn from_key(key: &[u8]) -> Self {
        let mut tokens = Self {
            key: ring::hmac::Key::new(ring::hmac::HMAC_SHA256, key),
            authorized_json: String::new(),
        };
        tokens.authorized_json = serde_json::to_string(&tokens.authorized()).unwrap_or_default();
        tokens
    }

    fn token(&self, label: &str) -> String {
        ring::hmac::sign(&self.key, label.as_bytes())
            .as_ref()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// The controller's own token.
    pub fn controller(&self) -> String {
        self.token("controller")
    }

    /// KEDA's token.
    pub fn keda(&self) -> String {
        self.token("keda")
    }

    /// The scrapers' token.
    pub fn metrics(&self) -> String {
        self.token("prometheus")
    }

    /// The own token of the gateway whose owner (LLMService or LLMEndpoint) has UID `uid`.
    pub fn gateway(&self, uid: &str) -> String {
        self.token(&format!("gateway/{uid}"))
    }

    /// What every gateway accepts besides its own token.
    pub fn authorized(&self) -> AuthorizedTokens {
        let entry = |name: &str, token: String, scope| AuthorizedToken {
            name: name.to_owned(),
            sha256: digest_hex(&token),
            scope,
        };
        AuthorizedTokens {
            tokens: vec![
                entry("controller", self.controller(), Scope::Admin),
                entry("keda", self.keda(), Scope::Scaler),
                entry("prometheus", self.metrics(), Scope::Metrics),
            ],
        }
    }

    /// `Authorization: Bearer <controller token>`.
    pub fn controller_authorization(&self) -> http::HeaderValue {
        http::HeaderValue::from_str(&format!("Bearer {}", self.controller()))
            .unwrap_or_else(|_| http::HeaderValue::from_static(""))
    }
}

/// The admin Secret `secret_name` of the gateway whose owner has UID `owner_uid`: its own token
/// ([`TOKEN_KEY`]) and [`AdminTokens::authorized`] ([`AUTHORIZED_KEY`]).
pub fn gateway_secret(
    tokens: &AdminTokens,
    secret_name: String,
    namespace: &str,
    labels: BTreeMap<String, String>,
    owner: Option<OwnerReference>,
    owner_uid: &str,
) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(secret_name),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels),
            owner_references: owner.map(|o| vec![o]),
            ..Default::default()
        },
        type_: Some("Opaque".to_owned()),
        data: Some(BTreeMap::from([
            (
                TOKEN_KEY.to_owned(),
                ByteString(tokens.gateway(owner_uid).into_bytes()),
            ),
            (
                AUTHORIZED_KEY.to_owned(),
                ByteString(tokens.authorized_json.clone().into_bytes()),
            ),
        ])),
        ..Default::default()
    }
}

/// Server-side apply of `secret`, not forced: a Secret of that name whose keys another manager
/// wrote is not overwritten (the API's conflict is the error).
async fn patch(client: Client, secret: &Secret) -> Result<(), kube::Error> {
    let namespace = secret.namespace().unwrap_or_default();
    Api::<Secret>::namespaced(client, &namespace)
        .patch(
            &secret.name_any(),
            &PatchParams::apply(FIELD_MANAGER),
            &Patch::Apply(secret),
        )
        .await
        .map(drop)
}

/// Writes KEDA's and the scrapers' tokens into their Secrets (each `Some((namespace, name))`,
/// made empty by the chart) now and then every `every`, so a token edited away comes back.
/// A merge patch, never a create: a Secret that is gone (the release being uninstalled) stays
/// gone. Failures are logged, naming the Secret, and retried.
pub async fn publish(
    client: Client,
    tokens: AdminTokens,
    keda: Option<(String, String)>,
    metrics: Option<(String, String)>,
    every: std::time::Duration,
) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for (target, token, whose) in [
            (&keda, tokens.keda(), "KEDA's metrics-api triggers"),
            (&metrics, tokens.metrics(), "the gateways' scrapers"),
        ] {
            let Some((ns, name)) = target else {
                continue;
            };
            let patch = serde_json::json!({"data": {"token": ByteString(token.into_bytes())}});
            let written = Api::<Secret>::namespaced(client.clone(), ns)
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await;
            if let Err(e) = written {
                tracing::error!(secret = %format!("{ns}/{name}"), error = %e, "the admin token of {whose} could not be written, so the gateways refuse them (the chart makes this Secret; check it exists and the controller's RBAC)");
            }
        }
    }
}

/// The reconcile step of an owner of a gateway (an LLMService with its own gateway, an
/// LLMEndpoint): writes the gateway's admin Secret `<name>-gateway-admin`, owned by `owner`,
/// when admin tokens are on; at most once per resync period unless its content changed (it is
/// not watched: the controller does not read Secrets).
///
/// # Errors
/// The API's, naming the Secret.
pub(crate) async fn step<K>(ctx: &Context, owner: &K) -> Result<(), Error>
where
    K: kube::Resource<DynamicType = ()>,
{
    let Some(tokens) = &ctx.admin_tokens else {
        return Ok(());
    };
    let namespace = owner.namespace().unwrap_or_default();
    let name = owner.name_any();
    let uid = owner.uid().unwrap_or_default();
    let secret_name = names::gateway_admin(&name);
    // The content follows from the UID and the key (whose digests the JSON holds).
    let digest = crate::scaler_tls::digest(&[&uid, &tokens.authorized_json]);
    if !ctx
        .admin_secrets
        .stale(&namespace, &secret_name, &digest, ctx.requeue)
    {
        return Ok(());
    }
    let secret = gateway_secret(
        tokens,
        secret_name.clone(),
        &namespace,
        labels::labels(&name, Component::Gateway),
        owner.controller_owner_ref(&()),
        &uid,
    );
    patch(ctx.client.clone(), &secret)
        .await
        .map_err(kube_err(format!(
            "apply the gateway's admin Secret {namespace}/{secret_name}"
        )))?;
    ctx.admin_secrets.record(&namespace, &secret_name, digest);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_stable_distinct_and_only_digests_reach_a_gateway() {
        let t = AdminTokens::from_key(&[7u8; 32]);
        let again = AdminTokens::from_key(&[7u8; 32]);
        assert_eq!(t.controller(), again.controller());
        assert_eq!(t.controller().len(), 64);
        let all = [
            t.controller(),
            t.keda(),
            t.metrics(),
            t.gateway("uid-a"),
            t.gateway("uid-b"),
        ];
        for (i, a) in all.iter().enumerate() {
            for b in &all[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert_ne!(
            AdminTokens::from_key(&[8u8; 32]).controller(),
            t.controller()
        );
        let s = gateway_secret(
            &t,
            "m-gateway-admin".into(),
            "ns",
            BTreeMap::new(),
            None,
            "uid-a",
        );
        let data = s.data.unwrap();
        assert_eq!(data[TOKEN_KEY].0, t.gateway("uid-a").into_bytes());
        let authorized = String::from_utf8(data[AUTHORIZED_KEY].0.clone()).unwrap();
        for secret in [t.controller(), t.keda(), t.metrics()] {
            assert!(!authorized.contains(&secret), "{authorized}");
            assert!(authorized.contains(&digest_hex(&secret)), "{authorized}");
        }
        let parsed: AuthorizedTokens = serde_json::from_str(&authorized).unwrap();
        let scopes: Vec<_> = parsed.tokens.iter().map(|t| t.scope).collect();
        assert_eq!(scopes, [Scope::Admin, Scope::Scaler, Scope::Metrics]);
    }
}

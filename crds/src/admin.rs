//! A gateway's admin port: what is served there, who may call what, and the files the
//! controller writes for it (the gateway reads them, both ends use this module).
//!
//! The admin endpoints (`/metrics`, `/hearth/queue...`, `/hearth/local-demand`,
//! `/hearth/quota-usage`, `/hearth/metering`, `/hearth/adapter-failures`) are served on their
//! own port, [`PORT_NAME`] ([`PORT`]), which the client Service does not expose. Each request
//! carries `Authorization: Bearer <token>`; the gateway compares the token's SHA-256 digest
//! ([`digest_hex`]) with the digests it was given, in constant time, and each token has a
//! [`Scope`] that says which paths it opens.
//!
//! The controller writes the Secret `<gateway>-admin` that the gateway mounts:
//! - [`TOKEN_KEY`]: the gateway's own token ([`Scope::Admin`] at this gateway only), which its
//!   replicas send each other for demand reports and shared quotas;
//! - [`AUTHORIZED_KEY`]: [`AuthorizedTokens`] as JSON: the digests of the tokens other callers
//!   hold (the controller's, KEDA's, Prometheus'), never the tokens themselves, so reading the
//!   Secret in a model's namespace gives access to that gateway only.

use serde::{Deserialize, Serialize};

/// Name of the gateway container's admin port, and of its Service's port.
pub const PORT_NAME: &str = "admin";
/// The admin port's number in the gateway pods the controller renders.
pub const PORT: i32 = 9091;
/// Key of the gateway's own token in its admin Secret.
pub const TOKEN_KEY: &str = "token";
/// Key of the [`AuthorizedTokens`] JSON in its admin Secret.
pub const AUTHORIZED_KEY: &str = "authorized.json";

/// What a token opens on the admin port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Scope {
    /// Every admin path: the gateway's own replicas and the controller (demand for the device
    /// handover, metering, failed adapter loads).
    Admin,
    /// The demand KEDA's `metrics-api` trigger polls: `/hearth/queue` and `/hearth/queue/...`.
    Scaler,
    /// The Prometheus text at `/metrics`.
    Metrics,
}

impl Scope {
    /// Whether a token of this scope may `GET` `path` (the path alone, without its query).
    pub fn allows(self, path: &str) -> bool {
        match self {
            Self::Admin => true,
            Self::Scaler => is_queue_path(path),
            Self::Metrics => path == "/metrics",
        }
    }
}

/// Whether `path` is a demand path: `/hearth/queue` or one of its `/hearth/queue/...` forms
/// (local, per model).
pub fn is_queue_path(path: &str) -> bool {
    path == "/hearth/queue" || path.starts_with("/hearth/queue/")
}

/// One caller's token, as the gateway knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizedToken {
    /// Who holds it (`controller`, `keda`, `prometheus`): logged with refusals, never secret.
    pub name: String,
    /// [`digest_hex`] of the token: 64 lowercase hex digits.
    pub sha256: String,
    /// What it opens.
    pub scope: Scope,
}

/// The content of [`AUTHORIZED_KEY`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AuthorizedTokens {
    /// Every accepted token other than the gateway's own.
    pub tokens: Vec<AuthorizedToken>,
}

/// The SHA-256 digest of `token` in lowercase hex (64 digits): what [`AuthorizedToken::sha256`]
/// holds.
pub fn digest_hex(token: &str) -> String {
    let d = ring::digest::digest(&ring::digest::SHA256, token.as_bytes());
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_open_their_paths_only() {
        for (scope, path, allowed) in [
            (Scope::Admin, "/hearth/metering", true),
            (Scope::Admin, "/metrics", true),
            (Scope::Scaler, "/hearth/queue", true),
            (Scope::Scaler, "/hearth/queue/local", true),
            (Scope::Scaler, "/hearth/queue/ns/m/local", true),
            (Scope::Scaler, "/hearth/queues", false),
            (Scope::Scaler, "/hearth/local-demand", false),
            (Scope::Scaler, "/metrics", false),
            (Scope::Metrics, "/metrics", true),
            (Scope::Metrics, "/metrics/x", false),
            (Scope::Metrics, "/hearth/queue", false),
        ] {
            assert_eq!(scope.allows(path), allowed, "{scope:?} {path}");
        }
    }

    #[test]
    fn the_digest_is_sha256_in_lowercase_hex() {
        assert_eq!(
            digest_hex("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        let json = serde_json::to_string(&AuthorizedTokens {
            tokens: vec![AuthorizedToken {
                name: "keda".into(),
                sha256: digest_hex("t"),
                scope: Scope::Scaler,
            }],
        })
        .unwrap();
        assert!(json.contains(r#""scope":"scaler""#), "{json}");
    }
}

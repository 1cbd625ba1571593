//! The controller's own keys, kept in one Secret of its namespace (`--admin-keys-secret`,
//! default `hearth-controller-keys`), the one Secret it reads (the chart grants `get` and
//! `update` on that name only):
//!
//! - `admin-key`: 32 random bytes every gateway admin token derives from
//!   ([`crate::admin_tokens`]);
//! - `scaler-ca.crt`, `scaler-ca.key`, `scaler-ca.not-after`: the CA that signs the
//!   ExternalScaler's certificates of every push-mode service ([`crate::scaler_tls`]), PEM and
//!   its expiry (RFC 3339). One long-lived CA, so renewing a service's certificates changes no
//!   trust bundle and no connection waits for the kubelet to refresh a mounted file.
//! - `scaler-shared-client.crt`, `scaler-shared-client.key`, `scaler-shared-client.record`:
//!   KEDA's client certificate for the shared gateways' ExternalScalers
//!   ([`crate::scaler_tls::SharedClient`]), PEM, and its [`crate::scaler_tls::Record`] (JSON:
//!   the CA that signed it and its expiry). Issued again two thirds into its life, or when the
//!   CA changed.
//!
//! The first controller to start without a field it needs writes it, with the
//! resourceVersion it read, so two replicas starting at once agree. Deleting a field (and
//! restarting the controller) makes a new one.

use std::{collections::BTreeMap, time::Duration};

use hearth_net::pki::{self, Issued};
use k8s_openapi::{
    ByteString, api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Api, Client, api::PostParams};
use time::{OffsetDateTime, format_description::well_known::Rfc3339};

use crate::{
    admin_tokens::AdminTokens,
    scaler_tls::{Record, SharedClient},
};

/// The admin key's data key.
pub const ADMIN_KEY_FIELD: &str = "admin-key";
/// The scaler CA's certificate (PEM).
pub const SCALER_CA_CERT_FIELD: &str = "scaler-ca.crt";
/// The scaler CA's private key (PEM).
pub const SCALER_CA_KEY_FIELD: &str = "scaler-ca.key";
/// When the scaler CA expires (RFC 3339).
pub const SCALER_CA_NOT_AFTER_FIELD: &str = "scaler-ca.not-after";
/// KEDA's client certificate for the shared gateways (PEM).
pub const SHARED_CLIENT_CERT_FIELD: &str = "scaler-shared-client.crt";
/// Its private key (PEM).
pub const SHARED_CLIENT_KEY_FIELD: &str = "scaler-shared-client.key";
/// Its record (JSON: the signing CA and the expiry).
pub const SHARED_CLIENT_RECORD_FIELD: &str = "scaler-shared-client.record";
/// Common name of the scaler CA.
pub const SCALER_CA_NAME: &str = "hearth-scaler-ca";
/// Bytes of a new admin key.
const KEY_LEN: usize = 32;

/// Why the keys could not be loaded or made.
#[derive(Debug, thiserror::Error)]
pub enum KeysError {
    /// The API refused or failed.
    #[error("{what}: {source}")]
    Api {
        /// What was being done, naming the Secret.
        what: String,
        /// The error.
        source: kube::Error,
    },
    /// The admin key in the Secret is too short to be one this controller wrote.
    #[error(
        "Secret {secret} holds a {len}-byte {ADMIN_KEY_FIELD}; it must be at least 32 random bytes (delete the key from the Secret and restart the controller to make a new one)"
    )]
    ShortKey {
        /// `<namespace>/<name>`.
        secret: String,
        /// Its length.
        len: usize,
    },
    /// The scaler CA's fields do not make a CA.
    #[error(
        "Secret {secret}: the scaler CA ({SCALER_CA_CERT_FIELD}, {SCALER_CA_KEY_FIELD}, {SCALER_CA_NOT_AFTER_FIELD}) {problem}; delete the three fields and restart the controller to make a new CA (every push-mode service's certificates are issued again)"
    )]
    BadCa {
        /// `<namespace>/<name>`.
        secret: String,
        /// What is wrong.
        problem: String,
    },
    /// KEDA's client certificate for the shared gateways does not load.
    #[error(
        "Secret {secret}: KEDA's client certificate for the shared gateways ({SHARED_CLIENT_CERT_FIELD}, {SHARED_CLIENT_KEY_FIELD}, {SHARED_CLIENT_RECORD_FIELD}) {problem}; delete the three fields and restart the controller to issue a new one"
    )]
    BadSharedClient {
        /// `<namespace>/<name>`.
        secret: String,
        /// What is wrong.
        problem: String,
    },
    /// Every write met another writer's.
    #[error(
        "Secret {secret} changed under every attempt to write the keys; check what else writes it"
    )]
    Conflicts {
        /// `<namespace>/<name>`.
        secret: String,
    },
    /// No randomness, or the CA could not be generated.
    #[error("making a key failed: {0}")]
    Generate(String),
}

/// Which keys to load (and make when missing).
#[derive(Clone, Copy, Debug, Default)]
pub struct Wanted {
    /// The admin key (`--gateway-admin-auth`).
    pub admin: bool,
    /// The scaler CA, made valid for this long when missing (`--scaler-tls`).
    pub scaler_ca: Option<Duration>,
    /// A scaler CA with less life left than this is replaced by a new one (the certificates'
    /// lifetime, `--scaler-cert-validity`: they never outlive their CA).
    pub scaler_ca_min_left: Duration,
    /// KEDA's client certificate for the shared gateways, issued from the scaler CA for this
    /// long (`--scaler-cert-validity`) when missing, signed by another CA, or two thirds into
    /// its life ([`crate::scaler_tls::Record::due`]); needs `scaler_ca`.
    pub shared_client: Option<Duration>,
    /// Never make or replace the scaler CA (a running controller signs with the CA it loaded):
    /// a missing one is an error, an ending one is kept.
    pub keep_ca: bool,
}

/// The keys loaded.
#[derive(Clone, Debug, Default)]
pub struct ControllerKeys {
    /// The admin tokens, when wanted.
    pub admin: Option<AdminTokens>,
    /// The scaler CA (certificate, key, expiry), when wanted.
    pub scaler_ca: Option<Issued>,
    /// KEDA's client certificate for the shared gateways, when wanted.
    pub shared_client: Option<SharedClient>,
}

/// Loads the [`Wanted`] keys from Secret `name` in `namespace`, writing those that are missing
/// (and the Secret when it is missing); with nothing wanted, reads nothing.
///
/// # Errors
/// [`KeysError`]: the API (RBAC: `get`, `update` on that Secret, `create` on Secrets), a key
/// that is too short, a CA that does not parse, no randomness.
pub async fn load_or_init(
    client: Client,
    namespace: &str,
    name: &str,
    wanted: Wanted,
) -> Result<ControllerKeys, KeysError> {
    if !wanted.admin && wanted.scaler_ca.is_none() {
        return Ok(ControllerKeys::default());
    }
    let api: Api<Secret> = Api::namespaced(client, namespace);
    let secret = format!("{namespace}/{name}");
    let api_err = |what: &str| {
        let what = format!("{what} Secret {secret}");
        move |source| KeysError::Api { what, source }
    };
    // A conflict means another replica wrote first: read again and take its keys.
    for _ in 0..5 {
        let live = api.get_opt(name).await.map_err(api_err("reading"))?;
        let mut data = live
            .as_ref()
            .and_then(|s| s.data.clone())
            .unwrap_or_default();
        let added = add_missing(&mut data, wanted)?;
        if added.is_empty() {
            return parse(&data, wanted, &secret);
        }
        let written = match live {
            Some(mut s) => {
                s.data = Some(data.clone());
                api.replace(name, &PostParams::default(), &s).await
            }
            None => {
                let s = Secret {
                    metadata: ObjectMeta {
                        name: Some(name.to_owned()),
                        namespace: Some(namespace.to_owned()),
                        ..Default::default()
                    },
                    data: Some(data.clone()),
                    ..Default::default()
                };
                api.create(&PostParams::default(), &s).await
            }
        };
        match written {
            Ok(_) => {
                tracing::info!(%secret, fields = ?added, "new controller keys written");
                return parse(&data, wanted, &secret);
            }
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            Err(e) => return Err(api_err("writing")(e)),
        }
    }
    Err(KeysError::Conflicts { secret })
}

/// Makes the wanted fields `data` lacks (a field present but empty counts as missing); returns
/// their names.
fn add_missing(
    data: &mut BTreeMap<String, ByteString>,
    wanted: Wanted,
) -> Result<Vec<&'static str>, KeysError> {
    let missing =
        |data: &BTreeMap<String, ByteString>, f: &str| data.get(f).is_none_or(|v| v.0.is_empty());
    let mut added = Vec::new();
    if wanted.admin && missing(data, ADMIN_KEY_FIELD) {
        let mut key = [0u8; KEY_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut key)
            .map_err(|_| KeysError::Generate("the system random generator failed".into()))?;
        data.insert(ADMIN_KEY_FIELD.to_owned(), ByteString(key.to_vec()));
        added.push(ADMIN_KEY_FIELD);
    }
    // A CA too close to its end for a certificate's full life is made anew.
    let ending = data
        .get(SCALER_CA_NOT_AFTER_FIELD)
        .and_then(|v| std::str::from_utf8(&v.0).ok())
        .and_then(|t| OffsetDateTime::parse(t.trim(), &Rfc3339).ok())
        .is_some_and(|t| t - wanted.scaler_ca_min_left <= OffsetDateTime::now_utc());
    if let Some(validity) = wanted.scaler_ca
        && !wanted.keep_ca
        && ([
            SCALER_CA_CERT_FIELD,
            SCALER_CA_KEY_FIELD,
            SCALER_CA_NOT_AFTER_FIELD,
        ]
        .iter()
        .any(|f| missing(data, f))
            || ending)
    {
        if ending {
            tracing::warn!(
                "the scaler CA expires within --scaler-cert-validity: a new CA is made, and every push-mode service's certificates are issued again from it"
            );
        }
        let ca = pki::generate_ca(SCALER_CA_NAME, validity)
            .map_err(|e| KeysError::Generate(e.to_string()))?;
        let not_after = ca
            .not_after
            .format(&Rfc3339)
            .map_err(|e| KeysError::Generate(e.to_string()))?;
        for (field, value) in [
            (SCALER_CA_CERT_FIELD, ca.cert),
            (SCALER_CA_KEY_FIELD, ca.key),
            (SCALER_CA_NOT_AFTER_FIELD, not_after),
        ] {
            data.insert(field.to_owned(), ByteString(value.into_bytes()));
        }
        added.push(SCALER_CA_CERT_FIELD);
    }
    if let (Some(validity), Some(_)) = (wanted.shared_client, wanted.scaler_ca) {
        // A CA that does not load is parse()'s to report.
        if let Ok(ca) = ca_of(data) {
            let due = added.contains(&SCALER_CA_CERT_FIELD)
                || shared_client_of(data).is_none_or(|c| {
                    c.record.due(validity, &ca, OffsetDateTime::now_utc())
                        || [SHARED_CLIENT_CERT_FIELD, SHARED_CLIENT_KEY_FIELD]
                            .iter()
                            .any(|f| missing(data, f))
                });
            if due {
                let c = SharedClient::issue(&ca, validity)
                    .map_err(|e| KeysError::Generate(e.to_string()))?;
                let record = serde_json::to_string(&c.record)
                    .map_err(|e| KeysError::Generate(e.to_string()))?;
                for (field, value) in [
                    (SHARED_CLIENT_CERT_FIELD, c.leaf.cert),
                    (SHARED_CLIENT_KEY_FIELD, c.leaf.key),
                    (SHARED_CLIENT_RECORD_FIELD, record),
                ] {
                    data.insert(field.to_owned(), ByteString(value.into_bytes()));
                }
                added.push(SHARED_CLIENT_CERT_FIELD);
            }
        }
    }
    Ok(added)
}

fn text(data: &BTreeMap<String, ByteString>, field: &str) -> String {
    data.get(field)
        .map(|v| String::from_utf8_lossy(&v.0).into_owned())
        .unwrap_or_default()
}

/// The scaler CA of `data`, or what is wrong with it.
fn ca_of(data: &BTreeMap<String, ByteString>) -> Result<Issued, String> {
    let ca = Issued {
        cert: text(data, SCALER_CA_CERT_FIELD),
        key: text(data, SCALER_CA_KEY_FIELD),
        not_after: OffsetDateTime::parse(text(data, SCALER_CA_NOT_AFTER_FIELD).trim(), &Rfc3339)
            .map_err(|e| format!("has an expiry that is not RFC 3339: {e}"))?,
    };
    pki::certified_key(ca.cert.as_bytes(), ca.key.as_bytes())
        .map_err(|e| format!("does not load: {e}"))?;
    Ok(ca)
}

/// KEDA's client certificate for the shared gateways in `data`, when its record parses.
fn shared_client_of(data: &BTreeMap<String, ByteString>) -> Option<SharedClient> {
    let record: Record = serde_json::from_str(&text(data, SHARED_CLIENT_RECORD_FIELD)).ok()?;
    let not_after = OffsetDateTime::parse(&record.not_after, &Rfc3339).ok()?;
    Some(SharedClient {
        leaf: Issued {
            cert: text(data, SHARED_CLIENT_CERT_FIELD),
            key: text(data, SHARED_CLIENT_KEY_FIELD),
            not_after,
        },
        record,
    })
}

fn parse(
    data: &BTreeMap<String, ByteString>,
    wanted: Wanted,
    secret: &str,
) -> Result<ControllerKeys, KeysError> {
    let mut keys = ControllerKeys::default();
    if wanted.admin {
        let key = data
            .get(ADMIN_KEY_FIELD)
            .map(|k| k.0.as_slice())
            .unwrap_or_default();
        if key.len() < KEY_LEN {
            return Err(KeysError::ShortKey {
                secret: secret.to_owned(),
                len: key.len(),
            });
        }
        keys.admin = Some(AdminTokens::from_key(key));
    }
    if wanted.scaler_ca.is_some() {
        let bad = |problem: String| KeysError::BadCa {
            secret: secret.to_owned(),
            problem,
        };
        let ca = ca_of(data).map_err(bad)?;
        if ca.not_after <= OffsetDateTime::now_utc() {
            return Err(bad(format!(
                "expired at {}",
                text(data, SCALER_CA_NOT_AFTER_FIELD)
            )));
        }
        if wanted.shared_client.is_some() {
            let bad = |problem: &str| KeysError::BadSharedClient {
                secret: secret.to_owned(),
                problem: problem.to_owned(),
            };
            let client =
                shared_client_of(data).ok_or_else(|| bad("has a record that does not parse"))?;
            pki::certified_key(client.leaf.cert.as_bytes(), client.leaf.key.as_bytes())
                .map_err(|e| bad(&format!("does not load: {e}")))?;
            keys.shared_client = Some(client);
        }
        keys.scaler_ca = Some(ca);
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn missing_fields_are_made_and_present_ones_kept() {
        let both = Wanted {
            admin: true,
            scaler_ca: Some(DAY),
            scaler_ca_min_left: Duration::from_secs(3600),
            shared_client: None,
            keep_ca: false,
        };
        let mut data = BTreeMap::new();
        assert_eq!(
            add_missing(&mut data, both).unwrap(),
            [ADMIN_KEY_FIELD, SCALER_CA_CERT_FIELD]
        );
        let keys = parse(&data, both, "ns/keys").unwrap();
        assert!(keys.admin.is_some());
        let ca = keys.scaler_ca.unwrap();
        assert!(ca.not_after > OffsetDateTime::now_utc() + DAY / 2);
        // Nothing more to make: the same keys again.
        let before = data.clone();
        assert!(add_missing(&mut data, both).unwrap().is_empty());
        assert_eq!(data, before);
        // An emptied field is made again, the other kept.
        data.insert(SCALER_CA_KEY_FIELD.into(), ByteString(Vec::new()));
        assert_eq!(
            add_missing(&mut data, both).unwrap(),
            [SCALER_CA_CERT_FIELD]
        );
        assert_eq!(data[ADMIN_KEY_FIELD], before[ADMIN_KEY_FIELD]);
        assert_ne!(data[SCALER_CA_CERT_FIELD], before[SCALER_CA_CERT_FIELD]);
        // A CA with less than the minimum left is replaced, the admin key kept.
        let soon = (OffsetDateTime::now_utc() + Duration::from_secs(1800))
            .format(&Rfc3339)
            .unwrap();
        data.insert(
            SCALER_CA_NOT_AFTER_FIELD.into(),
            ByteString(soon.into_bytes()),
        );
        let before = data.clone();
        assert_eq!(
            add_missing(&mut data, both).unwrap(),
            [SCALER_CA_CERT_FIELD]
        );
        assert_ne!(data[SCALER_CA_CERT_FIELD], before[SCALER_CA_CERT_FIELD]);
        assert_eq!(data[ADMIN_KEY_FIELD], before[ADMIN_KEY_FIELD]);
        // Only what is wanted.
        let mut only_admin = BTreeMap::new();
        add_missing(
            &mut only_admin,
            Wanted {
                admin: true,
                ..Wanted::default()
            },
        )
        .unwrap();
        assert_eq!(only_admin.keys().collect::<Vec<_>>(), [ADMIN_KEY_FIELD]);
    }

    #[test]
    fn keda_shared_client_is_issued_with_the_ca_and_again_when_due_or_the_ca_changes() {
        let wanted = Wanted {
            scaler_ca: Some(10 * DAY),
            scaler_ca_min_left: DAY,
            shared_client: Some(3 * DAY),
            ..Wanted::default()
        };
        let mut data = BTreeMap::new();
        assert_eq!(
            add_missing(&mut data, wanted).unwrap(),
            [SCALER_CA_CERT_FIELD, SHARED_CLIENT_CERT_FIELD]
        );
        let keys = parse(&data, wanted, "ns/keys").unwrap();
        let ca = keys.scaler_ca.unwrap();
        let first = keys.shared_client.unwrap();
        assert_eq!(first.record.ca, ca.cert);
        assert_eq!(first.secret_data()["ca.crt"].0, ca.cert.as_bytes());
        // Not due: nothing is made, a restart loads the same certificate.
        assert!(add_missing(&mut data, wanted).unwrap().is_empty());
        assert_eq!(
            parse(&data, wanted, "ns/keys").unwrap().shared_client,
            Some(first.clone())
        );
        // Two thirds into its life: issued again from the same CA.
        let mut late = first.record.clone();
        late.not_after = (OffsetDateTime::now_utc() + DAY / 2)
            .format(&Rfc3339)
            .unwrap();
        data.insert(
            SHARED_CLIENT_RECORD_FIELD.into(),
            ByteString(serde_json::to_vec(&late).unwrap()),
        );
        assert_eq!(
            add_missing(&mut data, wanted).unwrap(),
            [SHARED_CLIENT_CERT_FIELD]
        );
        let second = parse(&data, wanted, "ns/keys")
            .unwrap()
            .shared_client
            .unwrap();
        assert_ne!(second.leaf.cert, first.leaf.cert);
        assert_eq!(second.record.ca, ca.cert);
        // A new CA: a new client certificate signed by it.
        data.remove(SCALER_CA_KEY_FIELD);
        assert_eq!(
            add_missing(&mut data, wanted).unwrap(),
            [SCALER_CA_CERT_FIELD, SHARED_CLIENT_CERT_FIELD]
        );
        let keys = parse(&data, wanted, "ns/keys").unwrap();
        assert_eq!(
            keys.shared_client.unwrap().record.ca,
            keys.scaler_ca.unwrap().cert
        );
        // While running, the CA is never made: a missing one is an error, and nothing is made.
        let running = Wanted {
            keep_ca: true,
            ..wanted
        };
        let mut lost = data.clone();
        lost.remove(SCALER_CA_KEY_FIELD);
        assert!(add_missing(&mut lost, running).unwrap().is_empty());
        assert!(parse(&lost, running, "ns/keys").is_err());
        // A record that does not parse is made again; a certificate that does not load is
        // reported with the fix.
        data.insert(SHARED_CLIENT_RECORD_FIELD.into(), ByteString(b"{".to_vec()));
        assert_eq!(
            add_missing(&mut data, wanted).unwrap(),
            [SHARED_CLIENT_CERT_FIELD]
        );
        data.insert(
            SHARED_CLIENT_CERT_FIELD.into(),
            ByteString(b"not a certificate".to_vec()),
        );
        let e = parse(&data, wanted, "ns/keys").unwrap_err().to_string();
        assert!(
            e.starts_with("Secret ns/keys: KEDA's client certificate"),
            "{e}"
        );
        assert!(e.contains("delete the three fields and restart"), "{e}");
    }

    #[test]
    fn bad_keys_name_the_secret_the_field_and_the_fix() {
        let ca_only = Wanted {
            scaler_ca: Some(DAY),
            ..Wanted::default()
        };
        let mut data = BTreeMap::new();
        add_missing(&mut data, ca_only).unwrap();
        let mut broken = data.clone();
        broken.insert(
            SCALER_CA_KEY_FIELD.into(),
            ByteString(b"not a key".to_vec()),
        );
        let e = parse(&broken, ca_only, "ns/keys").unwrap_err().to_string();
        assert!(e.starts_with("Secret ns/keys: the scaler CA"), "{e}");
        assert!(e.contains("does not load"), "{e}");
        assert!(e.contains("delete the three fields and restart"), "{e}");
        let mut expired = data.clone();
        expired.insert(
            SCALER_CA_NOT_AFTER_FIELD.into(),
            ByteString(b"2020-01-01T00:00:00Z".to_vec()),
        );
        let e = parse(&expired, ca_only, "ns/keys").unwrap_err().to_string();
        assert!(e.contains("expired at 2020-01-01T00:00:00Z"), "{e}");
        let mut short = BTreeMap::new();
        short.insert(ADMIN_KEY_FIELD.into(), ByteString(vec![1; 8]));
        let e = parse(
            &short,
            Wanted {
                admin: true,
                ..Wanted::default()
            },
            "ns/keys",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("8-byte admin-key"), "{e}");
    }
}

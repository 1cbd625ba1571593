//! Hearth's own certificate authority work, made with rcgen: a CA, the leaves it signs (a
//! server's, for its DNS names and IP addresses; a client's, for mutual TLS), and PEM pairs
//! read into rustls. The webhook's self-managed serving certificate and the controller's
//! ExternalScaler certificates (KEDA ↔ gateway mutual TLS) are both made here.
//!
//! Every certificate is backdated by [`BACKDATE`] (clock skew between the issuer and the
//! peers), and a leaf never outlives its CA.

use std::net::IpAddr;
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::sign::CertifiedKey;
use time::OffsetDateTime;

/// How far back every certificate's `notBefore` is set: absorbs clock skew between the issuer
/// and the peers that check it.
pub const BACKDATE: time::Duration = time::Duration::minutes(5);

/// Why a certificate could not be made or loaded.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    /// A file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The I/O error.
        source: std::io::Error,
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

/// What a leaf certificate is for: its extended key usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Usage {
    /// `serverAuth`: a TLS server, named by its subject alternative names.
    Server,
    /// `clientAuth`: a TLS client presenting it for mutual TLS.
    Client,
}

/// A PEM certificate, its PEM private key and its `notAfter`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Issued {
    /// Certificate (PEM).
    pub cert: String,
    /// Private key (PKCS#8 PEM).
    pub key: String,
    /// When it expires.
    pub not_after: OffsetDateTime,
}

fn ca_params(common_name: &str, not_after: OffsetDateTime) -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p.not_before = OffsetDateTime::now_utc() - BACKDATE;
    p.not_after = not_after;
    p
}

fn after(d: Duration) -> OffsetDateTime {
    OffsetDateTime::now_utc() + d
}

/// Makes a new CA named `common_name`, valid for `validity`, that signs leaves only (path
/// length 0).
///
/// # Errors
/// [`PkiError::Generate`] when rcgen fails.
pub fn generate_ca(common_name: &str, validity: Duration) -> Result<Issued, PkiError> {
    let key = KeyPair::generate()?;
    let not_after = after(validity);
    let cert = ca_params(common_name, not_after).self_signed(&key)?;
    Ok(Issued {
        cert: cert.pem(),
        key: key.serialize_pem(),
        not_after,
    })
}

/// Issues a leaf for `usage`, signed by the CA named `ca_name` whose key is `ca_key_pem` and
/// which expires at `ca_not_after`. `sans` are DNS names or IP addresses; the first is also the
/// common name (`common_name` when there is none). The leaf is valid for `validity`, but never
/// past its CA.
///
/// # Errors
/// [`PkiError::Generate`] for a key that does not parse or a SAN that is not a DNS name.
pub fn issue(
    ca_name: &str,
    ca_key_pem: &str,
    ca_not_after: OffsetDateTime,
    usage: Usage,
    common_name: &str,
    sans: &[String],
    validity: Duration,
) -> Result<Issued, PkiError> {
    let ca_key = KeyPair::from_pem(ca_key_pem)?;
    // The issuer needs only the CA's name, key usages and key, all reproducible.
    let issuer = Issuer::new(ca_params(ca_name, ca_not_after), ca_key);
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(
        DnType::CommonName,
        sans.first().map_or(common_name, String::as_str),
    );
    p.distinguished_name = dn;
    p.subject_alt_names = sans
        .iter()
        .map(|s| match s.parse::<IpAddr>() {
            Ok(ip) => Ok(SanType::IpAddress(ip)),
            Err(_) => s.clone().try_into().map(SanType::DnsName),
        })
        .collect::<Result<_, rcgen::Error>>()?;
    p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    p.extended_key_usages = vec![match usage {
        Usage::Server => ExtendedKeyUsagePurpose::ServerAuth,
        Usage::Client => ExtendedKeyUsagePurpose::ClientAuth,
    }];
    p.use_authority_key_identifier_extension = true;
    p.not_before = OffsetDateTime::now_utc() - BACKDATE;
    p.not_after = after(validity).min(ca_not_after);
    let key = KeyPair::generate()?;
    let cert = p.signed_by(&key, &issuer)?;
    Ok(Issued {
        cert: cert.pem(),
        key: key.serialize_pem(),
        not_after: p.not_after,
    })
}

/// Parses a PEM certificate chain (leaf first) and a PEM private key (PKCS#8, PKCS#1 or SEC1)
/// into a rustls key, checking that they belong together.
///
/// # Errors
/// [`PkiError::Certificate`], [`PkiError::Key`] or [`PkiError::Mismatch`].
pub fn certified_key(cert_pem: &[u8], key_pem: &[u8]) -> Result<CertifiedKey, PkiError> {
    let chain = certificates(cert_pem)?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| PkiError::Key(e.to_string()))?;
    let provider = rustls::crypto::ring::default_provider();
    CertifiedKey::from_der(chain, key, &provider).map_err(PkiError::Mismatch)
}

/// Every certificate of a PEM bundle, in order; at least one.
///
/// # Errors
/// [`PkiError::Certificate`] when a block is malformed or there is none.
pub fn certificates(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, PkiError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| PkiError::Certificate(e.to_string()))?;
    if certs.is_empty() {
        return Err(PkiError::Certificate("no certificate found".to_owned()));
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leaf_carries_its_usage_and_never_outlives_its_ca() {
        let ca = generate_ca("test-ca", Duration::from_secs(3600)).unwrap();
        for usage in [Usage::Server, Usage::Client] {
            let leaf = issue(
                "test-ca",
                &ca.key,
                ca.not_after,
                usage,
                "client",
                &["a.example".to_owned(), "198.18.0.1".to_owned()],
                Duration::from_secs(7200),
            )
            .unwrap();
            assert_eq!(leaf.not_after, ca.not_after);
            certified_key(leaf.cert.as_bytes(), leaf.key.as_bytes()).unwrap();
        }
    }

    #[test]
    fn a_bundle_without_a_certificate_is_refused() {
        let err = certificates(b"not pem").unwrap_err();
        assert!(matches!(err, PkiError::Certificate(_)), "{err}");
    }
}

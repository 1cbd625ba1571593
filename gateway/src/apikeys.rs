//! Optional API keys, read from files (mounted Secret keys) and reloaded when they change; each
//! file's keys belong to one tenant ([`crate::tenants`]): `--api-key-file`'s to the default
//! tenant, each `--tenant`'s `key-file` to that tenant.
//!
//! A file holds one key per line (LF or CRLF; a leading UTF-8 byte order mark is ignored);
//! blank lines and lines starting with `#` are skipped, and surrounding whitespace is trimmed.
//! Clients send `Authorization: Bearer <key>` (the OpenAI API's scheme). A Secret volume is
//! updated by the kubelet through an atomic symlink swap, so the file is re-read every reload
//! interval and swapped in when its content changed.
//!
//! A reload that cannot be used keeps the last good keys and is logged as a warning: a file
//! that cannot be read (missing, not UTF-8), and a file that now holds no key at all (an
//! emptied Secret would otherwise lock every client out with nothing but 401s to show for it).
//! Nothing ever turns authentication off once it is on. A key listed for two tenants is
//! refused the same way (at start: an error; on reload: the last good keys stay), since the
//! gateway could not tell whose requests it carries.
//!
//! A presented key is checked in constant time: its SHA-256 digest is compared with the digest
//! of every accepted key ([`subtle::ConstantTimeEq`]), all of them every time, so neither the
//! time taken nor where a comparison stopped tells a client how close its guess was (a hash
//! map lookup would, through the early exit of its string comparison).

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use crate::{fair::TenantId, tenants::Tenants};

/// The shortest reload interval used; a shorter `--api-key-reload-interval` (such as `0s`) is
/// raised to it.
pub const MIN_RELOAD_INTERVAL: Duration = Duration::from_millis(100);

/// Why the key file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ApiKeyError {
    /// The file could not be read.
    #[error("reading API key file {path}: {source} (check --api-key-file and the Secret mount)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A reload found no key in the file; the previous keys stay in force.
    #[error(
        "API key file {path} holds no key; keeping the previous keys (put at least one key in the Secret behind --api-key-file)"
    )]
    NoKeys {
        /// The file.
        path: PathBuf,
    },
    /// The same key is listed for two tenants; the previous keys stay in force.
    #[error(
        "an API key is listed for both tenant {first} and tenant {second}; keeping the previous keys (remove it from one of their Secrets)"
    )]
    SharedKey {
        /// One tenant.
        first: String,
        /// The other.
        second: String,
    },
}

/// The set of accepted keys, or `None` when authentication is off.
#[derive(Debug, Clone, Default)]
pub struct ApiKeys {
    inner: Option<Arc<KeysInner>>,
}

#[derive(Debug)]
struct KeysInner {
    /// Each key file, the tenant its keys belong to, and the tenant's name (for errors).
    sources: Vec<(PathBuf, TenantId, String)>,
    keys: RwLock<Arc<KeyTable>>,
    /// Each source's last good keys: a file that cannot be used keeps its own.
    files: std::sync::Mutex<Vec<HashSet<String>>>,
}

/// The accepted keys: by key (to tell a change), and as SHA-256 digests with their tenant (what
/// a request is checked against).
#[derive(Debug, Default)]
struct KeyTable {
    by_key: HashMap<String, TenantId>,
    digests: Vec<(Digest, TenantId)>,
}

/// A SHA-256 digest.
pub(crate) type Digest = [u8; 32];

pub(crate) fn digest(key: &str) -> Digest {
    let mut out = [0u8; 32];
    out.copy_from_slice(ring::digest::digest(&ring::digest::SHA256, key.as_bytes()).as_ref());
    out
}

impl KeyTable {
    fn new(by_key: HashMap<String, TenantId>) -> Self {
        let digests = by_key.iter().map(|(k, t)| (digest(k), *t)).collect();
        Self { by_key, digests }
    }

    /// The tenant of `token`: compares its digest with every key's, in constant time, and
    /// without stopping at a match.
    fn tenant(&self, token: &str) -> Option<TenantId> {
        use subtle::{Choice, ConditionallySelectable, ConstantTimeEq};
        let presented = digest(token);
        let mut any = Choice::from(0);
        let mut tenant: TenantId = 0;
        for (d, t) in &self.digests {
            let hit = presented.ct_eq(d);
            // Keys are unique, so at most one digest matches.
            tenant.conditional_assign(t, hit);
            any |= hit;
        }
        bool::from(any).then_some(tenant)
    }
}

/// The outcome of checking a request's credentials.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthOutcome {
    /// Authentication is off (the default tenant, 0), or the key is accepted: its tenant.
    Allowed(TenantId),
    /// No `Authorization: Bearer` header.
    Missing,
    /// A key that is not in the file.
    Invalid,
}

/// Parses the key file's content.
pub fn parse_keys(content: &str) -> HashSet<String> {
    // Editors on Windows start UTF-8 files with a byte order mark; it is not part of a key.
    let content = content.strip_prefix('\u{feff}').unwrap_or(content);
    content
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

impl ApiKeys {
    /// Authentication off: every request is allowed.
    pub fn disabled() -> Self {
        Self { inner: None }
    }

    /// Loads keys from `path`, all of the default tenant.
    ///
    /// # Errors
    /// [`ApiKeyError::Read`] when the file cannot be read.
    pub fn load(path: &Path) -> Result<Self, ApiKeyError> {
        Self::load_tenants(Some(path), &Tenants::default())
    }

    /// Loads the default tenant's keys from `default` (if any) and each tenant's from its
    /// `key_file`; authentication is off when there is no file at all, and on (every request
    /// needs a key) as soon as there is one.
    ///
    /// # Errors
    /// [`ApiKeyError::Read`] when a file cannot be read, [`ApiKeyError::SharedKey`] when a key
    /// is listed for two tenants.
    pub fn load_tenants(default: Option<&Path>, tenants: &Tenants) -> Result<Self, ApiKeyError> {
        let mut sources: Vec<_> = default
            .map(|d| (d.to_owned(), 0, tenants.get(0).name.to_string()))
            .into_iter()
            .collect();
        for (id, t) in tenants.iter() {
            if let Some(f) = &t.key_file {
                sources.push((f.clone(), id, t.name.to_string()));
            }
        }
        if sources.is_empty() {
            return Ok(Self::disabled());
        }
        let files = sources
            .iter()
            .map(|(path, _, _)| read(path))
            .collect::<Result<Vec<_>, _>>()?;
        let (keys, conflict, _) = combine(&sources, &files, None);
        if let Some(e) = conflict {
            return Err(e);
        }
        if keys.is_empty() {
            tracing::warn!("the API key files hold no key: every request will get 401");
        }
        Ok(Self {
            inner: Some(Arc::new(KeysInner {
                sources,
                keys: RwLock::new(Arc::new(KeyTable::new(keys))),
                files: std::sync::Mutex::new(files),
            })),
        })
    }

    /// Whether keys are checked.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Checks an `Authorization` header value.
    pub fn check(&self, authorization: Option<&[u8]>) -> AuthOutcome {
        let Some(inner) = &self.inner else {
            return AuthOutcome::Allowed(0);
        };
        let Some(token) = authorization
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(bearer)
        else {
            return AuthOutcome::Missing;
        };
        let keys = inner.keys.read().unwrap_or_else(|e| e.into_inner()).clone();
        match keys.tenant(token) {
            Some(tenant) => AuthOutcome::Allowed(tenant),
            None => AuthOutcome::Invalid,
        }
    }

    /// Re-reads the files now, each on its own: a file that cannot be read, one that now
    /// holds no key, and one whose new keys include another tenant's keep their previous keys,
    /// while the others' changes apply.
    ///
    /// # Errors
    /// The first file's [`ApiKeyError::Read`], [`ApiKeyError::NoKeys`] or
    /// [`ApiKeyError::SharedKey`]; the changes of the other files are applied all the same.
    pub fn reload(&self) -> Result<bool, ApiKeyError> {
        let Some(inner) = &self.inner else {
            return Ok(false);
        };
        let mut files = inner.files.lock().unwrap_or_else(|e| e.into_inner());
        let mut first_error = None;
        let mut next = files.clone();
        for (i, (path, _, _)) in inner.sources.iter().enumerate() {
            match read(path) {
                Ok(set) if set.is_empty() && !files[i].is_empty() => {
                    first_error.get_or_insert(ApiKeyError::NoKeys { path: path.clone() });
                }
                Ok(set) => next[i] = set,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        let (keys, conflict, kept) = combine(&inner.sources, &next, Some(&files));
        if let Some(e) = conflict {
            first_error.get_or_insert(e);
        }
        for i in kept {
            next[i] = files[i].clone();
        }
        *files = next;
        let mut cur = inner.keys.write().unwrap_or_else(|e| e.into_inner());
        let changed = cur.by_key != keys;
        if changed {
            *cur = Arc::new(KeyTable::new(keys));
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(changed),
        }
    }

    /// Reloads every `interval` (at least [`MIN_RELOAD_INTERVAL`]) until the task is dropped.
    pub async fn watch(self, interval: Duration) {
        if self.inner.is_none() {
            return;
        }
        // `tokio::time::interval` panics on zero, which would end reloads for good with
        // nothing but a panic message on stderr.
        let interval = if interval < MIN_RELOAD_INTERVAL {
            tracing::warn!(
                requested_ms = interval.as_millis() as u64,
                used_ms = MIN_RELOAD_INTERVAL.as_millis() as u64,
                "--api-key-reload-interval is below the minimum; using the minimum"
            );
            MIN_RELOAD_INTERVAL
        } else {
            interval
        };
        crate::reload::every(
            interval,
            "API keys reloaded",
            "keeping the previous API keys",
            || self.reload(),
        )
        .await;
    }
}

/// The token of `Bearer <token>` (scheme case-insensitive, RFC 9110 §11.1).
pub(crate) fn bearer(v: &str) -> Option<&str> {
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// The keys of `files` (one set per source of `sources`), each with its source's tenant. A
/// source whose keys include a key of an earlier source's other tenant gets its keys of
/// `previous` instead (when given; a key still shared stays the earlier tenant's) and the
/// conflict is returned, with the indices of the sources that kept their previous keys.
fn combine(
    sources: &[(PathBuf, TenantId, String)],
    files: &[HashSet<String>],
    previous: Option<&[HashSet<String>]>,
) -> (HashMap<String, TenantId>, Option<ApiKeyError>, Vec<usize>) {
    let mut keys: HashMap<String, TenantId> = HashMap::new();
    let mut conflict = None;
    let mut kept = Vec::new();
    for (i, ((_, id, name), set)) in sources.iter().zip(files).enumerate() {
        let clash = set
            .iter()
            .find_map(|k| keys.get(k).filter(|other| **other != *id).copied());
        let set = match clash {
            None => set,
            Some(other) => {
                let first = sources
                    .iter()
                    .find(|s| s.1 == other)
                    .map_or_else(String::new, |s| s.2.clone());
                conflict.get_or_insert(ApiKeyError::SharedKey {
                    first,
                    second: name.clone(),
                });
                kept.push(i);
                match previous.and_then(|p| p.get(i)) {
                    Some(prev) => prev,
                    None => continue,
                }
            }
        };
        for k in set {
            keys.entry(k.clone()).or_insert(*id);
        }
    }
    (keys, conflict, kept)
}

fn read(path: &Path) -> Result<HashSet<String>, ApiKeyError> {
    std::fs::read_to_string(path)
        .map(|c| parse_keys(&c))
        .map_err(|source| ApiKeyError::Read {
            path: path.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines_and_comments() {
        let k = parse_keys("# keys\n sk-one \n\nsk-two\r\n#sk-three\n");
        assert_eq!(k.len(), 2);
        assert!(k.contains("sk-one") && k.contains("sk-two"));
    }

    #[test]
    fn checks_bearer_tokens_and_reloads() {
        let dir = std::env::temp_dir().join(format!("hearth-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys");
        std::fs::write(&path, "sk-a\n").unwrap();
        let keys = ApiKeys::load(&path).unwrap();
        assert_eq!(keys.check(Some(b"Bearer sk-a")), AuthOutcome::Allowed(0));
        assert_eq!(keys.check(Some(b"bearer  sk-a ")), AuthOutcome::Allowed(0));
        assert_eq!(keys.check(Some(b"Bearer sk-b")), AuthOutcome::Invalid);
        assert_eq!(keys.check(Some(b"Basic sk-a")), AuthOutcome::Missing);
        assert_eq!(keys.check(None), AuthOutcome::Missing);
        assert!(!keys.reload().unwrap());
        std::fs::write(&path, "sk-b\n").unwrap();
        assert!(keys.reload().unwrap());
        assert_eq!(keys.check(Some(b"Bearer sk-a")), AuthOutcome::Invalid);
        assert_eq!(keys.check(Some(b"Bearer sk-b")), AuthOutcome::Allowed(0));
        std::fs::remove_file(&path).unwrap();
        let err = keys.reload().unwrap_err().to_string();
        assert!(err.contains("--api-key-file"), "{err}");
        // The previous keys stay in force.
        assert_eq!(keys.check(Some(b"Bearer sk-b")), AuthOutcome::Allowed(0));
        assert_eq!(
            ApiKeys::disabled().check(None),
            AuthOutcome::Allowed(0),
            "no key file: authentication is off"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn each_tenants_keys_name_it_and_a_shared_key_is_refused() {
        let dir = std::env::temp_dir().join(format!("hearth-tenant-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (legacy, a) = (dir.join("legacy"), dir.join("a"));
        std::fs::write(&legacy, "sk-old\n").unwrap();
        std::fs::write(&a, "sk-a1\nsk-a2\n").unwrap();
        let tenants = Tenants::new(vec![
            crate::tenants::Tenant::parse(&format!("name=team-a,key-file={}", a.display()))
                .unwrap(),
        ])
        .unwrap();
        let keys = ApiKeys::load_tenants(Some(&legacy), &tenants).unwrap();
        assert_eq!(keys.check(Some(b"Bearer sk-old")), AuthOutcome::Allowed(0));
        assert_eq!(keys.check(Some(b"Bearer sk-a2")), AuthOutcome::Allowed(1));
        // Rotation: team-a's Secret now also lists the default tenant's key.
        std::fs::write(&a, "sk-a1\nsk-old\n").unwrap();
        let err = keys.reload().unwrap_err().to_string();
        assert!(
            err.contains("tenant default") && err.contains("tenant team-a"),
            "{err}"
        );
        assert_eq!(keys.check(Some(b"Bearer sk-a2")), AuthOutcome::Allowed(1));
        assert!(ApiKeys::load_tenants(Some(&legacy), &tenants).is_err());
        // The other file's rotation applies meanwhile; an emptied file keeps its keys.
        std::fs::write(&legacy, "sk-new\n").unwrap();
        std::fs::write(&a, "").unwrap();
        assert!(keys.reload().is_err());
        assert_eq!(keys.check(Some(b"Bearer sk-new")), AuthOutcome::Allowed(0));
        assert_eq!(keys.check(Some(b"Bearer sk-old")), AuthOutcome::Invalid);
        assert_eq!(keys.check(Some(b"Bearer sk-a2")), AuthOutcome::Allowed(1));
        // Tenants without keys at all: authentication stays off.
        assert!(
            !ApiKeys::load_tenants(None, &Tenants::default())
                .unwrap()
                .enabled()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_key_table_matches_whole_keys_only_and_names_their_tenant() {
        let table = KeyTable::new(HashMap::from([
            ("sk-team-a-0001".to_owned(), 3),
            ("sk-team-a-0002".to_owned(), 4),
            ("x".to_owned(), 0),
        ]));
        for (token, want) in [
            ("sk-team-a-0001", Some(3)),
            ("sk-team-a-0002", Some(4)),
            ("x", Some(0)),
            // A prefix, an extension and a one-byte change of a key are all no key.
            ("sk-team-a-000", None),
            ("sk-team-a-00011", None),
            ("sk-team-a-0003", None),
            ("", None),
        ] {
            assert_eq!(table.tenant(token), want, "{token:?}");
        }
        assert_eq!(KeyTable::default().tenant("x"), None);
    }
}

//! Who may call the admin port (`--admin-listen`): bearer tokens with a scope
//! ([`hearth_crds::admin`]).
//!
//! With `--admin-auth-dir`, the directory holds the files of the gateway's admin Secret:
//! `token` (the gateway's own token, [`Scope::Admin`]; sent to peer replicas) and
//! `authorized.json` (the digests of the controller's, KEDA's and Prometheus' tokens with their
//! scopes). A request without `Authorization: Bearer` or with a token none of them matches is
//! `401`; a known token outside its scope is `403`. The presented token's SHA-256 digest is
//! compared with every accepted digest in constant time, without stopping at a match (as API
//! keys are, [`crate::apikeys`]).
//!
//! The files are re-read every [`RELOAD_INTERVAL`] (a Secret volume changes by an atomic
//! symlink swap); files that do not load keep the previous table and are logged. A token is
//! checked when a request arrives: a long-lived `/hearth/local-demand` stream opened with a
//! token that is then rotated away goes on until it ends (the peer reconnects with the new
//! one). A token must be printable ASCII; a digest listed twice, more than
//! [`MAX_AUTHORIZED`] entries or a file over [`MAX_FILE_BYTES`] do not load. Without
//! `--admin-auth-dir` the admin port is open to anyone who reaches it, which the gateway logs
//! at start: the controller always sets it.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use axum::{
    extract::{Request, State},
    http::{HeaderValue, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use hearth_crds::admin::{AUTHORIZED_KEY, AuthorizedTokens, Scope, TOKEN_KEY};

use crate::apikeys::{Digest, bearer, digest};

/// How often the directory is re-read.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);
/// Largest file read from the directory (the controller's are about 500 bytes).
pub const MAX_FILE_BYTES: u64 = 64 * 1024;
/// Most entries in `authorized.json` (the controller writes 3).
pub const MAX_AUTHORIZED: usize = 64;

/// Why the directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum AdminAuthError {
    /// A file could not be read (or is larger than [`MAX_FILE_BYTES`]).
    #[error("reading {path}: {error} (check --admin-auth-dir and the admin Secret's mount)")]
    Read {
        /// The file.
        path: PathBuf,
        /// What went wrong (the I/O error, or the size).
        error: String,
    },
    /// `token` is empty.
    #[error("{path} holds no token (the admin Secret's key `token` must not be empty)")]
    EmptyToken {
        /// The file.
        path: PathBuf,
    },
    /// `token` holds a character an HTTP header cannot carry as is (the token is sent to the
    /// peer replicas in `Authorization`).
    #[error(
        "{path} holds a token with a character outside printable ASCII (0x21-0x7E); the controller writes 64 hex digits"
    )]
    TokenCharacters {
        /// The file.
        path: PathBuf,
    },
    /// `authorized.json` is not [`AuthorizedTokens`], or a digest is not 64 hex digits.
    #[error(
        "{path}: {reason} (the admin Secret's key `authorized.json` is written by the controller)"
    )]
    Authorized {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
}

/// A caller the admin port let in: the gateway's own replica or a named holder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// `gateway` for the gateway's own token, else the [`hearth_crds::admin::AuthorizedToken`]'s
    /// name.
    pub name: String,
    /// Its scope.
    pub scope: Scope,
}

/// Why a request was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No bearer token, or one that matches no accepted digest: `401`.
    Unauthenticated,
    /// A known token whose scope does not open the path: `403`, naming the holder.
    Forbidden(String),
}

#[derive(Debug, Default)]
struct Table {
    /// The gateway's own token, and `Bearer <token>` for its calls to peers.
    own: Option<(String, HeaderValue)>,
    entries: Vec<(Digest, Caller)>,
}

impl Table {
    fn caller(&self, token: &str) -> Option<Caller> {
        use subtle::ConstantTimeEq;
        let presented = digest(token);
        let mut found = None;
        // Every digest is compared, whatever matched before.
        for (d, caller) in &self.entries {
            if bool::from(presented.ct_eq(d)) && found.is_none() {
                found = Some(caller.clone());
            }
        }
        found
    }
}

/// The admin port's credentials: open (no directory) or the directory's tokens.
#[derive(Debug, Clone, Default)]
pub struct AdminAuth {
    inner: Option<Arc<Inner>>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    table: RwLock<Arc<Table>>,
    seen: std::sync::Mutex<(String, String)>,
}

impl Inner {
    /// The tokens loaded last (a reload swaps the whole table; a poisoned lock still holds one).
    fn snapshot(&self) -> Arc<Table> {
        self.table.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl AdminAuth {
    /// No authentication: every caller gets every admin path.
    pub fn open() -> Self {
        Self { inner: None }
    }

    /// Reads `dir`'s `token` and `authorized.json`.
    ///
    /// # Errors
    /// [`AdminAuthError`] naming the file and what is wrong.
    pub fn load(dir: &Path) -> Result<Self, AdminAuthError> {
        let (token, authorized) = read(dir)?;
        let table = table(dir, &token, &authorized)?;
        Ok(Self {
            inner: Some(Arc::new(Inner {
                dir: dir.to_owned(),
                table: RwLock::new(Arc::new(table)),
                seen: std::sync::Mutex::new((token, authorized)),
            })),
        })
    }

    /// Whether callers must present a token.
    pub fn enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// The gateway's own token (to call its peers), when authentication is on.
    pub fn own_token(&self) -> Option<String> {
        let inner = self.inner.as_ref()?;
        let table = inner.snapshot();
        table.own.as_ref().map(|(t, _)| t.clone())
    }

    /// `Authorization: Bearer <own token>` for calls to peers, when authentication is on.
    pub fn authorization(&self) -> Option<HeaderValue> {
        let inner = self.inner.as_ref()?;
        let table = inner.snapshot();
        table.own.as_ref().map(|(_, h)| h.clone())
    }

    /// Checks an `Authorization` header value for a `GET` of `path`.
    ///
    /// # Errors
    /// [`Refusal`]: who is refused and why.
    pub fn check(&self, authorization: Option<&[u8]>, path: &str) -> Result<Caller, Refusal> {
        let Some(inner) = &self.inner else {
            return Ok(Caller {
                name: "anyone".to_owned(),
                scope: Scope::Admin,
            });
        };
        let token = authorization
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(bearer)
            .ok_or(Refusal::Unauthenticated)?;
        let table = inner.snapshot();
        let caller = table.caller(token).ok_or(Refusal::Unauthenticated)?;
        if caller.scope.allows(path) {
            Ok(caller)
        } else {
            Err(Refusal::Forbidden(caller.name))
        }
    }

    /// Re-reads the directory; `Ok(true)` when its content changed and is now in force.
    ///
    /// # Errors
    /// What is wrong with the new files; the previous table stays.
    pub fn reload(&self) -> Result<bool, AdminAuthError> {
        let Some(inner) = &self.inner else {
            return Ok(false);
        };
        let (token, authorized) = read(&inner.dir)?;
        let mut seen = inner.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.0 == token && seen.1 == authorized {
            return Ok(false);
        }
        let table = table(&inner.dir, &token, &authorized)?;
        *inner.table.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(table);
        *seen = (token, authorized);
        Ok(true)
    }

    /// Reloads every [`RELOAD_INTERVAL`] until the task is dropped.
    pub async fn watch(self) {
        let Some(inner) = self.inner.clone() else {
            return;
        };
        let changed = format!("admin tokens reloaded from {}", inner.dir.display());
        crate::reload::every(
            RELOAD_INTERVAL,
            &changed,
            "admin token files changed but do not load; the previous tokens stay in force",
            || self.reload(),
        )
        .await;
    }
}

fn read(dir: &Path) -> Result<(String, String), AdminAuthError> {
    let file = |key: &str| {
        let path = dir.join(key);
        let fail = |error: String| AdminAuthError::Read {
            path: path.clone(),
            error,
        };
        let len = std::fs::metadata(&path)
            .map_err(|e| fail(e.to_string()))?
            .len();
        if len > MAX_FILE_BYTES {
            return Err(fail(format!(
                "{len} bytes, more than the {MAX_FILE_BYTES} a token file may hold"
            )));
        }
        std::fs::read_to_string(&path).map_err(|e| fail(e.to_string()))
    };
    Ok((file(TOKEN_KEY)?, file(AUTHORIZED_KEY)?))
}

fn table(dir: &Path, token: &str, authorized: &str) -> Result<Table, AdminAuthError> {
    let own = token.trim();
    if own.is_empty() {
        return Err(AdminAuthError::EmptyToken {
            path: dir.join(TOKEN_KEY),
        });
    }
    let unsendable = || AdminAuthError::TokenCharacters {
        path: dir.join(TOKEN_KEY),
    };
    if !own.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(unsendable());
    }
    let header = HeaderValue::from_str(&format!("Bearer {own}")).map_err(|_| unsendable())?;
    let wrong = |reason: String| AdminAuthError::Authorized {
        path: dir.join(AUTHORIZED_KEY),
        reason,
    };
    let parsed: AuthorizedTokens =
        serde_json::from_str(authorized).map_err(|e| wrong(e.to_string()))?;
    if parsed.tokens.len() > MAX_AUTHORIZED {
        return Err(wrong(format!(
            "{} tokens, more than {MAX_AUTHORIZED}",
            parsed.tokens.len()
        )));
    }
    let mut entries = vec![(
        digest(own),
        Caller {
            name: "gateway".to_owned(),
            scope: Scope::Admin,
        },
    )];
    for (i, t) in parsed.tokens.into_iter().enumerate() {
        let d = parse_digest(&t.sha256).ok_or_else(|| {
            wrong(format!(
                "tokens[{i}].sha256 must be 64 hex digits (SHA-256), got {:?}",
                t.sha256
            ))
        })?;
        // One scope per token: a digest listed twice (or the gateway's own) is ambiguous.
        if let Some((_, other)) = entries.iter().find(|(e, _)| *e == d) {
            return Err(wrong(format!(
                "tokens[{i}] ({}) has the digest of {} listed before it: list each token once",
                t.name, other.name
            )));
        }
        entries.push((
            d,
            Caller {
                name: t.name,
                scope: t.scope,
            },
        ));
    }
    Ok(Table {
        own: Some((own.to_owned(), header)),
        entries,
    })
}

fn parse_digest(hex: &str) -> Option<Digest> {
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Axum middleware for the admin router: lets a request through when [`AdminAuth::check`]
/// does, else `401` (with `WWW-Authenticate: Bearer`) or `403`, each with `{"error": ...}`
/// naming the fix.
pub async fn require(State(auth): State<AdminAuth>, req: Request, next: Next) -> Response {
    let authorization = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    match auth.check(authorization, req.uri().path()) {
        Ok(_) => next.run(req).await,
        Err(Refusal::Unauthenticated) => {
            let mut resp = refusal(
                StatusCode::UNAUTHORIZED,
                "the admin port needs Authorization: Bearer with a token the controller issued (the gateway's admin Secret, or the chart's scrape and KEDA token Secrets)".to_owned(),
            );
            resp.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"hearth-gateway-admin\""),
            );
            resp
        }
        Err(Refusal::Forbidden(name)) => refusal(
            StatusCode::FORBIDDEN,
            format!(
                "the token of {name} does not open {}: each token opens its own paths (docs/gateway.md, admin port)",
                req.uri().path()
            ),
        ),
    }
}

fn refusal(status: StatusCode, message: String) -> Response {
    (status, axum::Json(serde_json::json!({ "error": message }))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_crds::admin::{AuthorizedToken, digest_hex};

    fn dir_with(token: &str, tokens: &[(&str, &str, Scope)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), token, tokens);
        dir
    }

    fn write(dir: &Path, token: &str, tokens: &[(&str, &str, Scope)]) {
        std::fs::write(dir.join(TOKEN_KEY), token).unwrap();
        let a = AuthorizedTokens {
            tokens: tokens
                .iter()
                .map(|(name, t, scope)| AuthorizedToken {
                    name: (*name).to_owned(),
                    sha256: digest_hex(t),
                    scope: *scope,
                })
                .collect(),
        };
        std::fs::write(dir.join(AUTHORIZED_KEY), serde_json::to_string(&a).unwrap()).unwrap();
    }

    fn bearer_of(t: &str) -> Vec<u8> {
        format!("Bearer {t}").into_bytes()
    }

    #[test]
    fn each_token_opens_its_scope_and_nothing_else() {
        let dir = dir_with(
            "own\n",
            &[
                ("controller", "ctl", Scope::Admin),
                ("keda", "kd", Scope::Scaler),
                ("prometheus", "prom", Scope::Metrics),
            ],
        );
        let auth = AdminAuth::load(dir.path()).unwrap();
        assert_eq!(auth.own_token().as_deref(), Some("own"));
        let check = |t: Option<&str>, path: &str| {
            auth.check(t.map(bearer_of).as_deref(), path)
                .map(|c| c.name)
        };
        assert_eq!(
            check(Some("own"), "/hearth/local-demand"),
            Ok("gateway".into())
        );
        assert_eq!(
            check(Some("ctl"), "/hearth/metering"),
            Ok("controller".into())
        );
        assert_eq!(check(Some("kd"), "/hearth/queue/local"), Ok("keda".into()));
        assert_eq!(
            check(Some("kd"), "/metrics"),
            Err(Refusal::Forbidden("keda".into()))
        );
        assert_eq!(check(Some("prom"), "/metrics"), Ok("prometheus".into()));
        assert_eq!(
            check(Some("prom"), "/hearth/queue"),
            Err(Refusal::Forbidden("prometheus".into()))
        );
        assert_eq!(check(None, "/metrics"), Err(Refusal::Unauthenticated));
        assert_eq!(
            check(Some("guess"), "/metrics"),
            Err(Refusal::Unauthenticated)
        );
        assert_eq!(
            auth.check(Some(b"Basic b3du"), "/metrics"),
            Err(Refusal::Unauthenticated)
        );
    }

    #[test]
    fn a_reload_swaps_tokens_and_a_broken_write_keeps_the_last_good_ones() {
        let dir = dir_with("one", &[("keda", "kd1", Scope::Scaler)]);
        let auth = AdminAuth::load(dir.path()).unwrap();
        assert!(!auth.reload().unwrap());
        write(dir.path(), "two", &[("keda", "kd2", Scope::Scaler)]);
        assert!(auth.reload().unwrap());
        assert!(auth.check(Some(&bearer_of("one")), "/metrics").is_err());
        assert!(auth.check(Some(&bearer_of("two")), "/metrics").is_ok());
        assert!(auth.check(Some(&bearer_of("kd2")), "/hearth/queue").is_ok());
        std::fs::write(dir.path().join(AUTHORIZED_KEY), "{not json").unwrap();
        let e = auth.reload().unwrap_err().to_string();
        assert!(e.contains("authorized.json"), "{e}");
        assert!(auth.check(Some(&bearer_of("kd2")), "/hearth/queue").is_ok());
        std::fs::write(dir.path().join(TOKEN_KEY), " \n").unwrap();
        assert!(auth.reload().unwrap_err().to_string().contains("no token"));
        assert_eq!(auth.own_token().as_deref(), Some("two"));
    }

    #[test]
    fn a_bad_digest_and_a_missing_file_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = AdminAuth::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("token") && e.contains("--admin-auth-dir"), "{e}");
        std::fs::write(dir.path().join(TOKEN_KEY), "t").unwrap();
        std::fs::write(
            dir.path().join(AUTHORIZED_KEY),
            r#"{"tokens":[{"name":"x","sha256":"abc","scope":"admin"}]}"#,
        )
        .unwrap();
        let e = AdminAuth::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("tokens[0].sha256 must be 64 hex digits"), "{e}");
    }

    #[test]
    fn ambiguous_or_unsendable_files_do_not_load() {
        let dir = tempfile::tempdir().unwrap();
        let load = |token: &str, authorized: &str| {
            std::fs::write(dir.path().join(TOKEN_KEY), token).unwrap();
            std::fs::write(dir.path().join(AUTHORIZED_KEY), authorized).unwrap();
            AdminAuth::load(dir.path())
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let entry = |name: &str, sha: &str, scope: &str| {
            format!(r#"{{"name":"{name}","sha256":"{sha}","scope":"{scope}"}}"#)
        };
        let list = |entries: &[String]| format!(r#"{{"tokens":[{}]}}"#, entries.join(","));
        let d = digest_hex("t");
        assert!(load("own", &list(&[entry("a", &d, "metrics")])).is_ok());
        let e = load(
            "own",
            &list(&[entry("a", &d, "metrics"), entry("b", &d, "admin")]),
        )
        .unwrap_err();
        assert!(e.contains("tokens[1] (b) has the digest of a"), "{e}");
        let e = load("own", &list(&[entry("x", &digest_hex("own"), "metrics")])).unwrap_err();
        assert!(e.contains("has the digest of gateway"), "{e}");
        let plus = format!("+{}", &d[1..]);
        let e = load("own", &list(&[entry("a", &plus, "metrics")])).unwrap_err();
        assert!(e.contains("64 hex digits"), "{e}");
        for token in ["line1\nline2", "t\u{f6}ken", "to\u{a0}k"] {
            let e = load(token, &list(&[])).unwrap_err();
            assert!(e.contains("printable ASCII"), "{token:?}: {e}");
        }
        let many: Vec<String> = (0..=MAX_AUTHORIZED)
            .map(|i| entry("x", &digest_hex(&i.to_string()), "metrics"))
            .collect();
        assert!(load("own", &list(&many)).unwrap_err().contains("more than"));
        let e = load("own", &" ".repeat(MAX_FILE_BYTES as usize + 1)).unwrap_err();
        assert!(e.contains("bytes, more than"), "{e}");
    }

    #[test]
    fn open_lets_everyone_in_and_sends_no_token() {
        let auth = AdminAuth::open();
        assert!(!auth.enabled());
        assert!(auth.check(None, "/hearth/metering").is_ok());
        assert!(auth.authorization().is_none());
    }
}

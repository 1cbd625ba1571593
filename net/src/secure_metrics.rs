//! Authenticated and authorized `/metrics` for the controller and the webhook, as
//! controller-runtime's secure metrics serving (`filters.WithAuthenticationAndAuthorization`)
//! does it:
//!
//! 1. the scraper sends `Authorization: Bearer <token>` (Prometheus: its ServiceAccount token);
//! 2. the token is checked with a `TokenReview` (authentication.k8s.io/v1): no token or a token
//!    the apiserver does not authenticate is `401 Unauthorized`;
//! 3. the user it names is checked with a `SubjectAccessReview` (authorization.k8s.io/v1) for
//!    the non-resource URL of the request (`/metrics`) and verb `get`: not allowed is
//!    `403 Forbidden` (grant it with the chart's `hearth-metrics-reader` ClusterRole);
//! 4. an API error is `500` and is not cached.
//!
//! Both answers are cached for a short time in bounded caches (the token is kept only as its
//! SHA-256), so a scrape every 30 s costs no API call: allowed answers for
//! [`CacheConfig::allowed_ttl`], refusals for [`CacheConfig::denied_ttl`].
//!
//! [`require`] is an axum middleware to put in front of the `/metrics` route only (health and
//! readiness probes stay open). [`serve_tls`] serves a router over HTTPS; [`self_signed`] makes
//! the certificate controller-runtime makes when it is given none, [`load_pem`] reads one from
//! files.

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::hash::Hash;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// The verb every scrape is authorized for, as controller-runtime asks it (a GET of a
/// non-resource URL).
pub const VERB: &str = "get";

/// A user the apiserver authenticated, as a `TokenReview` returns it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct User {
    /// `username`, such as `system:serviceaccount:monitoring:prometheus`.
    pub name: String,
    /// `uid`.
    pub uid: String,
    /// `groups`.
    pub groups: Vec<String>,
    /// `extra`.
    pub extra: BTreeMap<String, Vec<String>>,
}

/// A review could not be made (the apiserver unreachable, an error answer).
#[derive(Debug)]
pub struct ReviewError(pub String);

impl std::fmt::Display for ReviewError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReviewError {}

/// A boxed review future.
pub type Review<'a, T> = Pin<Box<dyn Future<Output = Result<T, ReviewError>> + Send + 'a>>;

/// Who answers the two questions: the apiserver ([`KubeReviewer`]), or a fake in tests.
pub trait Reviewer: Send + Sync + 'static {
    /// The user a bearer token belongs to; `None` when it is not authenticated.
    fn authenticate<'a>(&'a self, token: &'a str) -> Review<'a, Option<User>>;
    /// Whether `user` may `verb` the non-resource URL `path`.
    fn authorize<'a>(&'a self, user: &'a User, path: &'a str, verb: &'a str) -> Review<'a, bool>;
}

/// The apiserver's answers: a `TokenReview`, then a `SubjectAccessReview` (RBAC: `create` on
/// `tokenreviews.authentication.k8s.io` and `subjectaccessreviews.authorization.k8s.io`).
#[derive(Clone)]
pub struct KubeReviewer {
    client: kube::Client,
}

impl KubeReviewer {
    /// Reviews with `client`'s identity.
    pub fn new(client: kube::Client) -> Self {
        Self { client }
    }
}

impl Reviewer for KubeReviewer {
    fn authenticate<'a>(&'a self, token: &'a str) -> Review<'a, Option<User>> {
        Box::pin(async move {
            let review = TokenReview {
                spec: TokenReviewSpec {
                    token: Some(token.to_owned()),
                    audiences: None,
                },
                ..Default::default()
            };
            let api: Api<TokenReview> = Api::all(self.client.clone());
            let answer = api
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| ReviewError(format!("TokenReview: {e}")))?;
            let status = answer.status.unwrap_or_default();
            if status.authenticated != Some(true) {
                return Ok(None);
            }
            let user = status.user.unwrap_or_default();
            Ok(Some(User {
                name: user.username.unwrap_or_default(),
                uid: user.uid.unwrap_or_default(),
                groups: user.groups.unwrap_or_default(),
                extra: user.extra.unwrap_or_default(),
            }))
        })
    }

    fn authorize<'a>(&'a self, user: &'a User, path: &'a str, verb: &'a str) -> Review<'a, bool> {
        Box::pin(async move {
            let review = SubjectAccessReview {
                spec: SubjectAccessReviewSpec {
                    user: Some(user.name.clone()),
                    uid: (!user.uid.is_empty()).then(|| user.uid.clone()),
                    groups: Some(user.groups.clone()),
                    extra: (!user.extra.is_empty()).then(|| user.extra.clone()),
                    non_resource_attributes: Some(NonResourceAttributes {
                        path: Some(path.to_owned()),
                        verb: Some(verb.to_owned()),
                    }),
                    ..Default::default()
                },
                ..Default::default()
            };
            let api: Api<SubjectAccessReview> = Api::all(self.client.clone());
            let answer = api
                .create(&PostParams::default(), &review)
                .await
                .map_err(|e| ReviewError(format!("SubjectAccessReview: {e}")))?;
            Ok(answer.status.is_some_and(|s| s.allowed))
        })
    }
}

/// How long answers are kept, and how many.
#[derive(Clone, Copy, Debug)]
pub struct CacheConfig {
    /// An authenticated token and an allowed user are trusted this long (revoking a token or
    /// a binding takes effect within it).
    pub allowed_ttl: Duration,
    /// A refused token or user is refused this long without asking again.
    pub denied_ttl: Duration,
    /// Entries per cache (tokens, users); the one closest to expiry makes room.
    pub max_entries: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            allowed_ttl: Duration::from_secs(60),
            denied_ttl: Duration::from_secs(10),
            max_entries: 1024,
        }
    }
}

/// A bounded map whose entries expire.
struct TtlCache<K, V> {
    entries: HashMap<K, (V, Instant)>,
    max: usize,
}

impl<K: Hash + Eq + Clone, V: Clone> TtlCache<K, V> {
    fn new(max: usize) -> Self {
        Self {
            entries: HashMap::new(),
            max: max.max(1),
        }
    }

    fn get(&mut self, key: &K, now: Instant) -> Option<V> {
        match self.entries.get(key) {
            Some((v, until)) if *until > now => Some(v.clone()),
            Some(_) => {
                self.entries.remove(key);
                None
            }
            None => None,
        }
    }

    fn insert(&mut self, key: K, value: V, until: Instant, now: Instant) {
        if self.entries.len() >= self.max && !self.entries.contains_key(&key) {
            self.entries.retain(|_, (_, u)| *u > now);
            if self.entries.len() >= self.max
                && let Some(first) = self
                    .entries
                    .iter()
                    .min_by_key(|(_, (_, u))| *u)
                    .map(|(k, _)| k.clone())
            {
                self.entries.remove(&first);
            }
        }
        self.entries.insert(key, (value, until));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Why a scrape is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No bearer token, or one the apiserver does not authenticate: `401`.
    Unauthenticated,
    /// The user may not get the URL: `403`.
    Forbidden(String),
    /// A review failed: `500`.
    Error(String),
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Unauthenticated => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                "Unauthorized\n",
            )
                .into_response(),
            Refusal::Forbidden(_) => (StatusCode::FORBIDDEN, "Forbidden\n").into_response(),
            Refusal::Error(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "Internal Server Error\n").into_response()
            }
        }
    }
}

type TokenKey = [u8; 32];
type UserKey = (User, String);

struct Inner {
    reviewer: Arc<dyn Reviewer>,
    config: CacheConfig,
    tokens: Mutex<TtlCache<TokenKey, Option<User>>>,
    decisions: Mutex<TtlCache<UserKey, bool>>,
}

/// Checks scrapes (see the module documentation); cheap to clone.
#[derive(Clone)]
pub struct MetricsAuth {
    inner: Arc<Inner>,
}

impl MetricsAuth {
    /// Checks with `reviewer`, caching as `config` says.
    pub fn new(reviewer: Arc<dyn Reviewer>, config: CacheConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                reviewer,
                config,
                tokens: Mutex::new(TtlCache::new(config.max_entries)),
                decisions: Mutex::new(TtlCache::new(config.max_entries)),
            }),
        }
    }

    /// Checks with the apiserver through `client`, with the default caches.
    pub fn kube(client: kube::Client) -> Self {
        Self::new(Arc::new(KubeReviewer::new(client)), CacheConfig::default())
    }

    fn ttl(&self, allowed: bool) -> Duration {
        if allowed {
            self.inner.config.allowed_ttl
        } else {
            self.inner.config.denied_ttl
        }
    }

    /// Whether a request with `headers` may get `path`: the user it is made by, or why not.
    pub async fn check(&self, headers: &HeaderMap, path: &str) -> Result<User, Refusal> {
        let token = bearer_token(headers).ok_or(Refusal::Unauthenticated)?;
        let key: TokenKey = ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
            .as_ref()
            .try_into()
            .map_err(|_| Refusal::Error("digest length".into()))?;
        let cached = lock(&self.inner.tokens).get(&key, Instant::now());
        let user = match cached {
            Some(u) => u,
            None => {
                let u = self
                    .inner
                    .reviewer
                    .authenticate(token)
                    .await
                    .map_err(|e| Refusal::Error(e.to_string()))?;
                let now = Instant::now();
                let until = now + self.ttl(u.is_some());
                lock(&self.inner.tokens).insert(key, u.clone(), until, now);
                u
            }
        }
        .ok_or(Refusal::Unauthenticated)?;
        let ukey = (user.clone(), path.to_owned());
        let cached = lock(&self.inner.decisions).get(&ukey, Instant::now());
        let allowed = match cached {
            Some(a) => a,
            None => {
                let a = self
                    .inner
                    .reviewer
                    .authorize(&user, path, VERB)
                    .await
                    .map_err(|e| Refusal::Error(e.to_string()))?;
                let now = Instant::now();
                let until = now + self.ttl(a);
                lock(&self.inner.decisions).insert(ukey, a, until, now);
                a
            }
        };
        if allowed {
            Ok(user)
        } else {
            Err(Refusal::Forbidden(user.name))
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The token of an `Authorization: Bearer <token>` header (scheme case-insensitive).
fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// axum middleware: lets a request through only when [`MetricsAuth::check`] allows it. Put it
/// on the `/metrics` route alone:
/// `get(handler).route_layer(axum::middleware::from_fn_with_state(auth, require))`.
pub async fn require(State(auth): State<MetricsAuth>, req: Request, next: Next) -> Response {
    let path = req.uri().path().to_owned();
    match auth.check(req.headers(), &path).await {
        Ok(_) => next.run(req).await,
        Err(refusal) => {
            match &refusal {
                Refusal::Error(e) => {
                    tracing::warn!(error = %e, path, "reviewing a scrape failed");
                }
                Refusal::Forbidden(user) => {
                    tracing::debug!(user, path, "scrape forbidden");
                }
                Refusal::Unauthenticated => tracing::debug!(path, "scrape unauthenticated"),
            }
            refusal.into_response()
        }
    }
}

/// Why a serving certificate could not be made or read.
#[derive(Debug)]
pub struct CertError(pub String);

impl std::fmt::Display for CertError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for CertError {}

/// A server configuration with a fresh self-signed certificate (ECDSA P-256) for `names`, as
/// controller-runtime makes when it is given no certificate: the traffic is encrypted, and a
/// scraper that does not pin the certificate skips verifying it.
pub fn self_signed(names: &[String]) -> Result<Arc<ServerConfig>, CertError> {
    let generated = rcgen::generate_simple_self_signed(names.to_vec())
        .map_err(|e| CertError(format!("generating a self-signed certificate: {e}")))?;
    config(
        generated.cert.pem().as_bytes(),
        generated.signing_key.serialize_pem().as_bytes(),
    )
}

/// A server configuration with the PEM certificate chain and key in `cert` and `key` (such as
/// a `kubernetes.io/tls` Secret's `tls.crt` and `tls.key`), read once.
pub fn load_pem(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, CertError> {
    let read =
        |p: &Path| std::fs::read(p).map_err(|e| CertError(format!("reading {}: {e}", p.display())));
    config(&read(cert)?, &read(key)?)
}

/// A server configuration with the PEM certificate chain `cert_pem` (leaf first) and PEM key
/// `key_pem` (such as a certificate the controller issues from its own CA).
///
/// # Errors
/// [`CertError`] naming what does not parse or fit.
pub fn from_pem(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, CertError> {
    config(cert_pem, key_pem)
}

fn config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, CertError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| CertError(format!("the certificate PEM: {e}")))?;
    if chain.is_empty() {
        return Err(CertError("the certificate PEM holds no certificate".into()));
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| CertError(format!("the key PEM: {e}")))?;
    let mut config =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| CertError(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| CertError(format!("the key does not fit the certificate: {e}")))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Serves `app` over TLS on `listener` until the process ends, with
/// [`crate::tls_server::serve`]'s default bounds: a TLS handshake must finish within 10 s, an idle
/// scraper connection is kept 6 minutes (longer than Prometheus keeps it), and at most 256
/// connections are served at once.
pub async fn serve_tls(listener: tokio::net::TcpListener, tls: Arc<ServerConfig>, app: Router) {
    let limits = crate::tls_server::ServeLimits::default();
    crate::tls_server::serve(listener, tls, app, limits, std::future::pending()).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Tokens `good` (user `reader`, allowed) and `other` (user `stranger`, not allowed); any
    /// other token is not authenticated. Counts the reviews made.
    #[derive(Default)]
    struct Fake {
        authentications: AtomicUsize,
        authorizations: AtomicUsize,
        fail: bool,
    }

    impl Reviewer for Fake {
        fn authenticate<'a>(&'a self, token: &'a str) -> Review<'a, Option<User>> {
            self.authentications.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                if self.fail {
                    return Err(ReviewError("apiserver down".into()));
                }
                Ok(match token {
                    "good" => Some(User {
                        name: "reader".into(),
                        ..Default::default()
                    }),
                    "other" => Some(User {
                        name: "stranger".into(),
                        ..Default::default()
                    }),
                    _ => None,
                })
            })
        }

        fn authorize<'a>(
            &'a self,
            user: &'a User,
            path: &'a str,
            verb: &'a str,
        ) -> Review<'a, bool> {
            self.authorizations.fetch_add(1, Ordering::SeqCst);
            Box::pin(
                async move { Ok(user.name == "reader" && path == "/metrics" && verb == "get") },
            )
        }
    }

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, a.parse().unwrap());
        }
        h
    }

    fn auth(fake: Arc<Fake>, config: CacheConfig) -> MetricsAuth {
        MetricsAuth::new(fake, config)
    }

    #[tokio::test]
    async fn table() {
        let cases: [(&str, Option<&str>, Result<&str, Refusal>); 7] = [
            ("no header", None, Err(Refusal::Unauthenticated)),
            (
                "not bearer",
                Some("Basic Z29vZA=="),
                Err(Refusal::Unauthenticated),
            ),
            (
                "empty token",
                Some("Bearer "),
                Err(Refusal::Unauthenticated),
            ),
            (
                "bad token",
                Some("Bearer nope"),
                Err(Refusal::Unauthenticated),
            ),
            (
                "not allowed",
                Some("Bearer other"),
                Err(Refusal::Forbidden("stranger".into())),
            ),
            ("allowed", Some("Bearer good"), Ok("reader")),
            ("scheme in lower case", Some("bearer good"), Ok("reader")),
        ];
        for (what, header, want) in cases {
            let a = auth(Arc::new(Fake::default()), CacheConfig::default());
            let got = a.check(&headers(header), "/metrics").await;
            let got = got.as_ref().map(|u| u.name.as_str());
            assert_eq!(got, want.as_ref().map(|s| *s), "{what}");
        }
        // Another path is another question.
        let a = auth(Arc::new(Fake::default()), CacheConfig::default());
        assert!(matches!(
            a.check(&headers(Some("Bearer good")), "/debug").await,
            Err(Refusal::Forbidden(_))
        ));
    }

    #[tokio::test]
    async fn refusals_render_401_403_500() {
        assert_eq!(
            Refusal::Unauthenticated.into_response().status(),
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            Refusal::Forbidden("x".into()).into_response().status(),
            StatusCode::FORBIDDEN
        );
        let fake = Arc::new(Fake {
            fail: true,
            ..Default::default()
        });
        let a = auth(fake.clone(), CacheConfig::default());
        let got = a.check(&headers(Some("Bearer good")), "/metrics").await;
        assert!(matches!(got, Err(Refusal::Error(_))), "{got:?}");
        assert_eq!(
            got.unwrap_err().into_response().status(),
            StatusCode::INTERNAL_SERVER_ERROR
        );
        // Errors are not cached.
        let _ = a.check(&headers(Some("Bearer good")), "/metrics").await;
        assert_eq!(fake.authentications.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn answers_are_cached_until_they_expire() {
        let fake = Arc::new(Fake::default());
        let a = auth(
            fake.clone(),
            CacheConfig {
                allowed_ttl: Duration::from_millis(300),
                denied_ttl: Duration::from_millis(300),
                max_entries: 16,
            },
        );
        for _ in 0..5 {
            assert!(
                a.check(&headers(Some("Bearer good")), "/metrics")
                    .await
                    .is_ok()
            );
            assert!(
                a.check(&headers(Some("Bearer other")), "/metrics")
                    .await
                    .is_err()
            );
            assert!(
                a.check(&headers(Some("Bearer nope")), "/metrics")
                    .await
                    .is_err()
            );
        }
        // One TokenReview per token, one SubjectAccessReview per authenticated user.
        assert_eq!(fake.authentications.load(Ordering::SeqCst), 3);
        assert_eq!(fake.authorizations.load(Ordering::SeqCst), 2);
        tokio::time::sleep(Duration::from_millis(350)).await;
        assert!(
            a.check(&headers(Some("Bearer good")), "/metrics")
                .await
                .is_ok()
        );
        assert_eq!(fake.authentications.load(Ordering::SeqCst), 4);
        assert_eq!(fake.authorizations.load(Ordering::SeqCst), 3);
    }

    #[test]
    fn caches_are_bounded() {
        let mut c = TtlCache::new(3);
        let now = Instant::now();
        for i in 0..10u32 {
            c.insert(i, i, now + Duration::from_secs(u64::from(i) + 1), now);
        }
        assert_eq!(c.len(), 3);
        // The entries closest to expiry made room.
        assert_eq!(c.get(&9, now), Some(9));
        assert_eq!(c.get(&0, now), None);
        // Expired entries are not served.
        assert_eq!(c.get(&9, now + Duration::from_secs(60)), None);
    }

    #[tokio::test]
    async fn only_the_protected_route_needs_a_token() {
        use axum::body::Body;
        use axum::routing::get;
        use tower::ServiceExt as _;
        let a = auth(Arc::new(Fake::default()), CacheConfig::default());
        let app = Router::new()
            .route(
                "/metrics",
                get(|| async { "m" }).route_layer(axum::middleware::from_fn_with_state(a, require)),
            )
            .route("/healthz", get(|| async { "ok" }));
        let status = |uri: &'static str, token: Option<&'static str>| {
            let app = app.clone();
            async move {
                let mut req = axum::http::Request::get(uri);
                if let Some(t) = token {
                    req = req.header(header::AUTHORIZATION, format!("Bearer {t}"));
                }
                app.oneshot(req.body(Body::empty()).unwrap())
                    .await
                    .unwrap()
                    .status()
            }
        };
        assert_eq!(status("/healthz", None).await, StatusCode::OK);
        assert_eq!(status("/metrics", None).await, StatusCode::UNAUTHORIZED);
        assert_eq!(
            status("/metrics", Some("other")).await,
            StatusCode::FORBIDDEN
        );
        assert_eq!(status("/metrics", Some("good")).await, StatusCode::OK);
    }

    #[test]
    fn self_signed_config_is_made() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let cfg = self_signed(&["hearth-controller-metrics.hearth-system.svc".into()]).unwrap();
        assert!(cfg.alpn_protocols.contains(&b"h2".to_vec()));
    }
}

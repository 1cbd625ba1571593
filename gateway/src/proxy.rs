//! The request path: admission, cold-start hold or reject, forwarding and streaming.
//!
//! Order of checks for a proxied request: draining (503) → method and framing (405, 400, 501;
//! see [`refusal`]) → API key (401) → body size and read timeout (413, 408) → admission
//! (`maxQueue`, 429) → a ready endpoint? forward : cold start. A cold request's body is also
//! checked for its model name (404, only with served model names) before admission, so a
//! misdirected request never raises demand and never wakes a model; a ready backend answers
//! that check itself (vLLM's `404 The model ... does not exist`), so a warm request is
//! forwarded without parsing its body.

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::{Duration, Instant},
};

use axum::{
    body::Body,
    http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode, Uri, header},
    response::Response,
};
use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};

use crate::{
    apikeys::AuthOutcome,
    config::ColdStartMode,
    demand::Admission,
    endpoints::EndpointGuard,
    gateway::Shared,
    metrics::Metrics,
    openai::{RequestHints, error_response, sse_error_event, with_retry_after},
    upstream::{UpstreamBody, UpstreamPool},
};

thread_local! {
    /// The backend connection pool of an HTTP worker thread
    /// ([`crate::Gateway::serve_http_workers`]): each worker keeps its own, so a request and its
    /// backend connection are served by the same thread, without cross-thread wake-ups.
    static WORKER_POOL: std::cell::RefCell<Option<UpstreamPool>> = const { std::cell::RefCell::new(None) };
}

/// Gives the current thread its own backend connection pool (see [`WORKER_POOL`]).
pub(crate) fn install_worker_pool(pool: UpstreamPool) {
    WORKER_POOL.with(|c| *c.borrow_mut() = Some(pool));
}

impl Shared {
    /// The current worker thread's backend connection pool, or the shared one.
    fn upstream(&self) -> UpstreamPool {
        WORKER_POOL
            .with(|c| c.borrow().clone())
            .unwrap_or_else(|| self.pool.clone())
    }
}

/// The client's address, set per connection by the server loop.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub std::net::SocketAddr);

/// The SSE comment sent while a streaming request is held (RFC-compliant SSE clients ignore
/// lines starting with `:`).
pub const HEARTBEAT: &[u8] = b": hearth: waiting for a backend to become ready\n\n";

/// Counts a request once, when it finishes: by status code, or as canceled when dropped first.
struct Tracker {
    metrics: Arc<Metrics>,
    code: Option<u16>,
}

impl Tracker {
    fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            code: None,
        }
    }

    fn finish(&mut self, code: u16) {
        self.code = Some(code);
    }
}

impl Drop for Tracker {
    fn drop(&mut self) {
        match self.code {
            Some(code) => self.metrics.finished(code),
            None => {
                self.metrics.canceled.inc();
            }
        }
    }
}

/// Finishes `tracker` with `resp`'s status and returns it.
fn done(mut tracker: Tracker, resp: Response) -> Response {
    tracker.finish(resp.status().as_u16());
    resp
}

fn reject(
    shared: &Shared,
    tracker: Tracker,
    reason: &'static str,
    status: StatusCode,
    message: &str,
    kind: &str,
    retry: bool,
) -> Response {
    shared.metrics.rejected(reason);
    let resp = error_response(status, message, kind, Some(reason));
    let resp = if retry {
        with_retry_after(resp, shared.cfg.retry_after)
    } else {
        resp
    };
    done(tracker, resp)
}

/// Hop-by-hop header fields (RFC 9110 §7.6.1), removed in both directions together with any
/// field named in `Connection`. Names, not strings: removing by `&str` parses and classifies
/// the string on every call.
/// `Proxy-Authenticate` and `Proxy-Authorization` are for the proxy next to the client, never
/// the backend (RFC 9110 §11.7).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("proxy-connection"),
    HeaderName::from_static("keep-alive"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");

/// Removes hop-by-hop fields from `headers` (RFC 9110 §7.6.1).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Most messages carry none: one pass over the names costs less than a lookup per field
    // (a field named in `Connection` implies `Connection` itself).
    if !headers.keys().any(|k| HOP_BY_HOP.contains(k)) {
        return;
    }
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// What a forwarded request holds on the backend until its response ends: the endpoint's
/// outstanding-request count.
struct BackendUse {
    _ep: EndpointGuard,
}

/// Whether the request got past the hold, and how.
enum HoldError {
    /// No endpoint became ready before the activation deadline.
    Timeout,
    /// The backend could not be reached or failed before answering.
    Upstream(String),
}

/// The parts of a request to re-send on each attempt.
struct Outgoing {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
    body: Bytes,
    /// The body's bytes in the replica's [`crate::budget::BodyBudget`], until the request is
    /// done with.
    _held: crate::budget::Reservation,
}

impl Outgoing {
    /// Copies the body and the header values out of hyper's read buffer. hyper hands them out
    /// as slices of its 8 KiB per-connection buffer, so a held request would otherwise keep
    /// that buffer alive and make hyper allocate a second one for the same connection.
    ///
    /// The header map is rebuilt at its exact size on the way: a held request keeps it for as
    /// long as the hold lasts, and the warm path leaves room in it for the added fields.
    fn detach(&mut self) {
        self.body = Bytes::copy_from_slice(&self.body);
        let headers = std::mem::take(&mut self.headers);
        let mut compact = HeaderMap::with_capacity(headers.len());
        let mut name: Option<HeaderName> = None;
        // A name is given with its first value only; the values after it share it.
        for (next, value) in headers {
            if next.is_some() {
                name = next;
            }
            let Some(name) = &name else { continue };
            let mut owned =
                HeaderValue::from_bytes(value.as_bytes()).unwrap_or_else(|_| value.clone());
            owned.set_sensitive(value.is_sensitive());
            compact.append(name.clone(), owned);
        }
        self.headers = compact;
    }
}

impl Shared {
    fn build_upstream(
        &self,
        out: &Outgoing,
        ep: &EndpointGuard,
    ) -> Result<hyper::Request<Full<Bytes>>, String> {
        let authority = ep.endpoint().authority();
        let uri = Uri::try_from(out.path_and_query.as_str())
            .map_err(|e| format!("building the backend request target: {e}"))?;
        let host = HeaderValue::from_str(authority.as_str())
            .map_err(|e| format!("building the backend Host field: {e}"))?;
        let mut req = hyper::Request::new(Full::new(out.body.clone()));
        *req.method_mut() = out.method.clone();
        *req.uri_mut() = uri;
        *req.headers_mut() = out.headers.clone();
        req.headers_mut().insert(header::HOST, host);
        if out.body.is_empty() && matches!(out.method, Method::POST | Method::PUT | Method::PATCH) {
            // hyper leaves it out for an empty body; a server may then answer 411 (RFC 9110 §8.6).
            req.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from_static("0"));
        }
        Ok(req)
    }

    /// Sends `out` to a ready endpoint, waiting for one until `deadline` and retrying when a
    /// connection cannot be established (the request was not sent, so it is safe to resend).
    async fn forward(
        &self,
        out: &Outgoing,
        deadline: Instant,
        arrival: Instant,
        cold: bool,
    ) -> Result<(hyper::Response<UpstreamBody>, BackendUse), HoldError> {
        let mut backoff = Duration::from_millis(20);
        loop {
            let ep = self
                .acquire_endpoint(deadline)
                .await
                .ok_or(HoldError::Timeout)?;
            let req = self.build_upstream(out, &ep).map_err(HoldError::Upstream)?;
            let sent = Instant::now();
            match self.upstream().send(ep.endpoint().authority(), req).await {
                Ok(resp) => {
                    self.metrics
                        .upstream_latency
                        .observe(sent.elapsed().as_secs_f64());
                    if cold {
                        self.metrics
                            .activation_wait
                            .observe(sent.duration_since(arrival).as_secs_f64());
                        self.lease.ready_seen();
                    }
                    return Ok((resp, BackendUse { _ep: ep }));
                }
                Err(e) if e.is_connect() => {
                    self.metrics.upstream_error("connect");
                    tracing::debug!(endpoint = %ep.endpoint().authority(), error = %e, "backend refused the connection; retrying");
                    drop(ep);
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(HoldError::Timeout);
                    }
                    tokio::time::sleep(backoff.min(deadline - now)).await;
                    backoff = (backoff * 2).min(Duration::from_millis(500));
                }
                Err(e) => {
                    self.metrics.upstream_error("request");
                    // The backend's address is for the logs, not for clients.
                    tracing::warn!(endpoint = %ep.endpoint().authority(), error = %e, "backend request failed");
                    return Err(HoldError::Upstream(format!("the backend failed: {e}")));
                }
            }
        }
    }

    /// The least-loaded ready endpoint, waiting for the set to change until `deadline`.
    async fn acquire_endpoint(&self, deadline: Instant) -> Option<EndpointGuard> {
        // The warm path: no watch receiver to make and drop (dropping the last one wakes the
        // sender's waiters).
        if let Some(ep) = self.backends.pick() {
            return Some(ep);
        }
        // Subscribed before looking again, so a change in between is not missed.
        let mut rx = self.backends.subscribe();
        loop {
            rx.borrow_and_update();
            if let Some(ep) = self.backends.pick() {
                return Some(ep);
            }
            tokio::select! {
                r = rx.changed() => r.ok()?,
                _ = tokio::time::sleep_until(deadline.into()) => return None,
            }
        }
    }
}

/// The response to `GET /v1/models` while no backend is ready: the served model names, in the
/// OpenAI `list` shape, so clients can discover the model without waking it.
fn models_list(names: &[String]) -> Response {
    let data: Vec<serde_json::Value> = names
        .iter()
        .map(
            |n| serde_json::json!({"id": n, "object": "model", "created": 0, "owned_by": "hearth"}),
        )
        .collect();
    let mut resp = Response::new(Body::from(
        serde_json::json!({"object": "list", "data": data}).to_string(),
    ));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Every request that is not one of the gateway's own endpoints; `peer_ip` is the client's
/// address (see [`peer_ip_value`]), for `X-Forwarded-For`.
/// The `Via` field value a replica adds to forwarded requests (RFC 9110 §7.6.3):
/// `1.1 hearth-gateway (<instance>)`, the comment naming the replica (its random
/// [`crate::demand::DemandHub::instance`]). A request that already carries it has come back to
/// the replica that forwarded it: a backend that leads back to the gateway. Such a request is
/// answered `508` instead of being forwarded again until `maxQueue` fills (§7.6.3: an
/// intermediary must not forward a message to itself unprotected from a loop).
#[derive(Debug)]
pub struct Via {
    http10: HeaderValue,
    http11: HeaderValue,
    token: Vec<u8>,
}

impl Via {
    /// The values of the replica `instance`.
    pub fn new(instance: u64) -> Self {
        let token = format!("hearth-gateway ({instance:016x})");
        let value = |v: &str| {
            HeaderValue::from_str(&format!("{v} {token}"))
                .unwrap_or_else(|_| HeaderValue::from_static("1.1 hearth-gateway"))
        };
        Self {
            http10: value("1.0"),
            http11: value("1.1"),
            token: token.into_bytes(),
        }
    }

    /// The value for a request received with `version`.
    fn value(&self, version: http::Version) -> HeaderValue {
        if version == http::Version::HTTP_10 {
            self.http10.clone()
        } else {
            self.http11.clone()
        }
    }

    /// Whether `headers` show the request already passed through this replica.
    fn seen_in(&self, headers: &HeaderMap) -> bool {
        headers.get_all(header::VIA).iter().any(|v| {
            v.as_bytes()
                .windows(self.token.len())
                .any(|w| w == self.token.as_slice())
        })
    }
}

/// Marks `resp` as the connection's last (`Connection: close`, RFC 9112 §9.6): hyper closes the
/// connection once it is written.
fn close_after(resp: &mut Response) {
    resp.headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
}

/// The answer to a request that arrives while the gateway drains: `503`, retry elsewhere, and
/// the connection closes.
fn draining(shared: &Shared, tracker: Tracker) -> Response {
    let mut resp = reject(
        shared,
        tracker,
        "draining",
        StatusCode::SERVICE_UNAVAILABLE,
        "the gateway is shutting down; retry the request",
        "server_error",
        true,
    );
    close_after(&mut resp);
    resp
}

/// Methods the gateway forwards, for `Allow` (RFC 9110 §10.2.1).
const ALLOWED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// Why a request is refused before anything else is done with it: status, metric reason, and
/// the message naming what to change.
type Refusal = (StatusCode, &'static str, String);

/// A request the gateway must not forward, or must answer `400` by its framing rules:
/// - `CONNECT` (a tunnel) and `TRACE` (echoes credentials back): `405`;
/// - an HTTP/1.1 request without `Host`, or any with several `Host` lines or an invalid one:
///   `400` (RFC 9112 §3.2 makes both a MUST);
/// - a `Transfer-Encoding` other than `chunked`: `501` (RFC 9112 §6.1); the body would reach the
///   backend still encoded, with nothing saying so;
/// - several `Authorization` lines: `400`; the gateway and the backend might each read another.
fn refusal(parts: &http::request::Parts) -> Option<Refusal> {
    if matches!(parts.method, Method::CONNECT | Method::TRACE) {
        return Some((
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            format!(
                "{} is not supported: the gateway forwards HTTP API requests ({ALLOWED_METHODS})",
                parts.method
            ),
        ));
    }
    if parts
        .uri
        .authority()
        .is_some_and(|a| a.as_str().contains('@'))
    {
        return Some((
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the request target carries user info (user@host), which must not be sent (RFC 9110 §4.2.4)".to_owned(),
        ));
    }
    let mut hosts = parts.headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (None, _) if parts.version == http::Version::HTTP_11 => {
            return Some((
                StatusCode::BAD_REQUEST,
                "bad_request",
                "an HTTP/1.1 request must have a Host field (RFC 9112 §3.2)".to_owned(),
            ));
        }
        (Some(_), Some(_)) => {
            return Some((
                StatusCode::BAD_REQUEST,
                "bad_request",
                "the request has more than one Host field line (RFC 9112 §3.2)".to_owned(),
            ));
        }
        (Some(host), None) if !valid_host(host.as_bytes()) => {
            return Some((
                StatusCode::BAD_REQUEST,
                "bad_request",
                "the Host field is not a host with an optional port (RFC 9112 §3.2)".to_owned(),
            ));
        }
        _ => {}
    }
    if let Some(te) = parts.headers.get(header::TRANSFER_ENCODING)
        && parts
            .headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            // Empty list elements are ignored (RFC 9110 §5.6.1.2).
            .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"chunked"))
    {
        return Some((
            StatusCode::NOT_IMPLEMENTED,
            "unsupported_transfer_coding",
            format!(
                "Transfer-Encoding {:?} is not supported: send the body with chunked or a Content-Length, uncompressed (RFC 9112 §6.1)",
                String::from_utf8_lossy(te.as_bytes())
            ),
        ));
    }
    if parts
        .headers
        .get_all(header::AUTHORIZATION)
        .iter()
        .nth(1)
        .is_some()
    {
        return Some((
            StatusCode::BAD_REQUEST,
            "bad_request",
            "the request has more than one Authorization field line; send one".to_owned(),
        ));
    }
    None
}

/// Whether `host` is a `Host` field value: `uri-host [ ":" port ]` (RFC 9112 §3.2, RFC 3986
/// §3.2.2), or empty (a target without an authority). No user info, path or other delimiters;
/// a reg-name may be percent-encoded, an IP literal is bracketed (`[fe80::1%25eth0]`).
fn valid_host(host: &[u8]) -> bool {
    let (name, port) = match host.strip_prefix(b"[") {
        Some(rest) => {
            let Some(end) = rest.iter().position(|b| *b == b']') else {
                return false;
            };
            let literal = &rest[..end];
            if literal.is_empty()
                || !literal
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || b":.%-_~".contains(b))
            {
                return false;
            }
            (None, &rest[end + 1..])
        }
        None => match host.iter().rposition(|b| *b == b':') {
            Some(i) => (Some(&host[..i]), &host[i..]),
            None => (Some(host), &host[host.len()..]),
        },
    };
    let reg_name_ok = name.is_none_or(|n| {
        n.iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=".contains(b))
    });
    let port_ok = port.is_empty()
        || port
            .strip_prefix(b":")
            .is_some_and(|p| p.iter().all(u8::is_ascii_digit));
    reg_name_ok && port_ok
}

/// Why a request body was not read whole.
enum BodyError {
    /// Over the gateway's limit.
    TooLarge,
    /// The replica already holds `--body-memory-limit` bytes of bodies.
    OverBudget,
    /// Not complete within the body read timeout.
    Timeout,
    /// The client closed or reset the connection first.
    Gone,
    /// Broken framing (a bad chunk, say).
    Malformed(String),
}

/// Reads a request body whole into one buffer, at most `limit` bytes, within `timeout` of the
/// first wait for more, its bytes taken from `budget` as they arrive.
///
/// One buffer, not one entry per frame: a body sent as many tiny chunks would otherwise cost
/// far more memory than its bytes, and pin hyper's read buffers. A body that arrives in one
/// frame (the usual small request) is kept as it is, and one that is complete without waiting
/// arms no timer.
async fn read_body<B>(
    body: B,
    declared: Option<u64>,
    limit: usize,
    budget: &crate::budget::BodyBudget,
    timer: &crate::timer::CoarseTimer,
    timeout: Duration,
) -> Result<(Bytes, crate::budget::Reservation), BodyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use hyper::rt::Timer as _;
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut rest: Option<BytesMut> = None;
    let mut len = 0usize;
    let mut held = budget.reservation();
    // A declared length is taken from the budget at once, as the buffer is allocated at that
    // size; bytes past what was taken (a chunked body) are taken as they arrive.
    let mut taken = declared.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    if !budget.reserve(&mut held, taken) {
        return Err(BodyError::OverBudget);
    }
    let mut deadline: Option<Pin<Box<dyn hyper::rt::Sleep>>> = None;
    std::future::poll_fn(|cx| {
        loop {
            match body.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: not forwarded
                    };
                    len += data.len();
                    if len > limit {
                        return Poll::Ready(Err(BodyError::TooLarge));
                    }
                    if len > taken {
                        if !budget.reserve(&mut held, len - taken) {
                            return Poll::Ready(Err(BodyError::OverBudget));
                        }
                        taken = len;
                    }
                    match (&mut first, &mut rest) {
                        (None, None) => first = Some(data),
                        (Some(f), None) => {
                            let cap = declared.map_or(len, |n| n as usize).clamp(len, limit);
                            let mut buf = BytesMut::with_capacity(cap);
                            buf.extend_from_slice(f);
                            buf.extend_from_slice(&data);
                            first = None;
                            rest = Some(buf);
                        }
                        (_, Some(buf)) => buf.extend_from_slice(&data),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                    return Poll::Ready(Err(body_read_error(&*e)));
                }
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => {
                    let sleep = deadline.get_or_insert_with(|| timer.sleep(timeout));
                    return match sleep.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Err(BodyError::Timeout)),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
    })
    .await?;
    let body = match (first, rest) {
        (_, Some(buf)) => buf.freeze(),
        (Some(f), None) => f,
        (None, None) => Bytes::new(),
    };
    Ok((body, held))
}

/// Tells a client that left (closed or reset mid-body) from a body that is broken.
fn body_read_error(e: &(dyn std::error::Error + 'static)) -> BodyError {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let mut source = Some(e);
    while let Some(err) = source {
        if err
            .downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_incomplete_message() || h.is_closed() || h.is_canceled())
            || err.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    ConnectionReset | BrokenPipe | ConnectionAborted | UnexpectedEof
                )
            })
        {
            return BodyError::Gone;
        }
        source = err.source();
    }
    BodyError::Malformed(e.to_string())
}

pub(crate) async fn proxy<B>(
    shared: Arc<Shared>,
    req: Request<B>,
    peer_ip: Option<HeaderValue>,
) -> Response
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let arrival = Instant::now();
    let tracker = Tracker::new(shared.metrics.clone());
    if shared.is_draining() {
        return draining(&shared, tracker);
    }
    let (mut parts, body) = req.into_parts();
    if let Some((status, reason, message)) = refusal(&parts) {
        let mut resp = reject(
            &shared,
            tracker,
            reason,
            status,
            &message,
            "invalid_request_error",
            false,
        );
        if status == StatusCode::METHOD_NOT_ALLOWED {
            resp.headers_mut()
                .insert(header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS));
        }
        // The rest of the request's framing is not to be trusted.
        close_after(&mut resp);
        return resp;
    }
    if shared.via.seen_in(&parts.headers) {
        return reject(
            &shared,
            tracker,
            "loop_detected",
            StatusCode::LOOP_DETECTED,
            "this request already passed through this gateway (Via): its backend leads back to the gateway; check --backend-url or --backend-service",
            "server_error",
            false,
        );
    }
    match shared.keys.check(
        parts
            .headers
            .get(header::AUTHORIZATION)
            .map(|v| v.as_bytes()),
    ) {
        AuthOutcome::Allowed => {}
        outcome => {
            let message = if outcome == AuthOutcome::Missing {
                "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
            } else {
                "Incorrect API key provided."
            };
            shared.metrics.rejected("unauthorized");
            let mut resp = error_response(
                StatusCode::UNAUTHORIZED,
                message,
                "invalid_request_error",
                Some("invalid_api_key"),
            );
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            return done(tracker, resp);
        }
    }

    if matches!(parts.method, Method::GET | Method::HEAD)
        && parts.uri.path() == "/v1/models"
        && !shared.cfg.served_model_names.is_empty()
        && !shared.backends.is_ready()
    {
        return done(tracker, models_list(&shared.cfg.served_model_names));
    }

    // The body, whole and bounded: it is kept to be forwarded after activation.
    let limit = shared.cfg.body_limit;
    let declared = parts
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let too_large = || {
        format!(
            "the request body is larger than the gateway's limit of {limit} bytes (--body-limit)"
        )
    };
    if declared.is_some_and(|n| n > limit as u64) {
        let msg = too_large();
        return reject(
            &shared,
            tracker,
            "body_too_large",
            StatusCode::PAYLOAD_TOO_LARGE,
            &msg,
            "invalid_request_error",
            false,
        );
    }
    let timeout = shared.cfg.body_read_timeout;
    let read = read_body(
        body,
        declared,
        limit,
        &shared.budget,
        &shared.timer,
        timeout,
    );
    let (body, held) = match read.await {
        Ok(read) => read,
        Err(BodyError::OverBudget) => {
            let msg = format!(
                "the request bodies the gateway holds would pass its limit of {} bytes (--body-memory-limit); retry later",
                shared.budget.limit()
            );
            return reject(
                &shared,
                tracker,
                "body_memory",
                StatusCode::SERVICE_UNAVAILABLE,
                &msg,
                "server_error",
                true,
            );
        }
        Err(BodyError::TooLarge) => {
            let msg = too_large();
            return reject(
                &shared,
                tracker,
                "body_too_large",
                StatusCode::PAYLOAD_TOO_LARGE,
                &msg,
                "invalid_request_error",
                false,
            );
        }
        Err(BodyError::Timeout) => {
            let msg =
                format!("the request body did not arrive within {timeout:?} (--body-read-timeout)");
            let mut resp = reject(
                &shared,
                tracker,
                "body_timeout",
                StatusCode::REQUEST_TIMEOUT,
                &msg,
                "invalid_request_error",
                false,
            );
            // RFC 9110 §15.5.9: the rest of the body is not coming, or not worth waiting for.
            close_after(&mut resp);
            return resp;
        }
        Err(BodyError::Gone) => {
            // The tracker counts it as canceled; nobody reads the answer.
            drop(tracker);
            return error_response(
                StatusCode::BAD_REQUEST,
                "the request body could not be read",
                "invalid_request_error",
                None,
            );
        }
        Err(BodyError::Malformed(e)) => {
            tracing::debug!(error = %e, "malformed request body");
            return reject(
                &shared,
                tracker,
                "bad_request",
                StatusCode::BAD_REQUEST,
                &format!("the request body could not be read: {e}"),
                "invalid_request_error",
                false,
            );
        }
    };

    let cold = !shared.backends.is_ready();
    let hints = if cold {
        RequestHints::from_request(&parts.method, &parts.headers, &body)
    } else {
        RequestHints::default()
    };
    if let Some(model) = &hints.model
        && !shared.cfg.served_model_names.is_empty()
        && !shared.cfg.served_model_names.iter().any(|n| n == model)
    {
        let msg = format!("The model `{model}` does not exist.");
        return reject(
            &shared,
            tracker,
            "unknown_model",
            StatusCode::NOT_FOUND,
            &msg,
            "invalid_request_error",
            false,
        );
    }

    // Draining may have begun while the body arrived: nothing new is admitted after it.
    if shared.is_draining() {
        return draining(&shared, tracker);
    }
    let Some(slot) = shared.demand.try_admit() else {
        let msg = format!(
            "the gateway already holds {} requests (maxQueue); retry later",
            shared.cfg.max_queue
        );
        return reject(
            &shared,
            tracker,
            "queue_full",
            StatusCode::TOO_MANY_REQUESTS,
            &msg,
            "rate_limit_error",
            true,
        );
    };

    let target_host = match parts.uri.authority() {
        Some(a) => HeaderValue::from_str(a.as_str()).ok(),
        None => parts
            .headers
            .get(header::HOST)
            .filter(|h| !h.is_empty())
            .cloned(),
    };
    let mut out = Outgoing {
        method: parts.method.clone(),
        path_and_query: parts
            .uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
        headers: forward_headers(
            std::mem::take(&mut parts.headers),
            shared.via.value(parts.version),
            target_host,
            peer_ip.as_ref(),
        ),
        body,
        _held: held,
    };
    // Not kept across the wait below: it may point into hyper's read buffer.
    drop(parts);
    let deadline = arrival + shared.cfg.activation_timeout;
    if cold {
        shared.lease.raise();
        out.detach();
        match shared.cfg.cold_start {
            ColdStartMode::Reject => {
                drop(slot);
                return reject(
                    &shared,
                    tracker,
                    "cold_reject",
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the model is starting; retry the request",
                    "server_error",
                    true,
                );
            }
            ColdStartMode::Keepalive if hints.stream => {
                return hold_streaming(shared, out, slot, tracker, arrival, deadline);
            }
            ColdStartMode::Keepalive => {}
        }
    }

    match shared.forward(&out, deadline, arrival, cold).await {
        Ok((resp, backend)) => relay(&shared, resp, backend, slot, tracker, arrival),
        Err(HoldError::Timeout) => {
            drop(slot);
            let msg = format!(
                "no backend became ready within the activation timeout ({:?}); retry the request",
                shared.cfg.activation_timeout
            );
            reject(
                &shared,
                tracker,
                "activation_timeout",
                StatusCode::SERVICE_UNAVAILABLE,
                &msg,
                "server_error",
                true,
            )
        }
        Err(HoldError::Upstream(msg)) => done(
            tracker,
            error_response(StatusCode::BAD_GATEWAY, &msg, "server_error", None),
        ),
    }
}

/// The headers sent to the backend: the client's `headers`, minus hop-by-hop fields and
/// `Expect` (the gateway has read the body already), with `Content-Length` recomputed from the
/// buffered body and:
/// - `via`, this replica's `Via` for the client's protocol version (RFC 9110 §7.6.3);
/// - `X-Forwarded-For`: every line the client sent, joined in order (RFC 9110 §5.3), then the
///   client's address `peer_ip`;
/// - `X-Forwarded-Host`: the host the client asked for, `target_host` (the absolute-form
///   target's authority, else `Host`, RFC 9112 §3.2.2), replacing any the client sent;
/// - `X-Forwarded-Proto: http`.
///
/// `Authorization` is passed through.
fn forward_headers(
    mut h: HeaderMap,
    via: HeaderValue,
    target_host: Option<HeaderValue>,
    peer_ip: Option<&HeaderValue>,
) -> HeaderMap {
    strip_hop_by_hop(&mut h);
    h.reserve(4);
    h.remove(header::CONTENT_LENGTH);
    h.remove(header::EXPECT);
    h.remove(header::HOST);
    match target_host {
        Some(host) => h.insert(X_FORWARDED_HOST, host),
        None => h.remove(X_FORWARDED_HOST),
    };
    h.append(header::VIA, via);
    if let Some(ip) = peer_ip {
        let mut lines = h.get_all(&X_FORWARDED_FOR).iter().peekable();
        let v = if lines.peek().is_none() {
            Some(ip.clone())
        } else {
            let mut v = Vec::with_capacity(64);
            for line in lines {
                v.extend_from_slice(line.as_bytes());
                v.extend_from_slice(b", ");
            }
            v.extend_from_slice(ip.as_bytes());
            HeaderValue::from_bytes(&v).ok()
        };
        if let Some(v) = v {
            h.insert(X_FORWARDED_FOR, v);
        }
    }
    h.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    h
}

/// The client's IP address as a header value, for `X-Forwarded-For`: made once per connection.
/// An IPv4 client of the dual-stack listener (`::ffff:10.0.0.7`) is written as IPv4.
pub(crate) fn peer_ip_value(peer: SocketAddr) -> Option<HeaderValue> {
    HeaderValue::from_str(&peer.ip().to_canonical().to_string()).ok()
}

/// Turns the backend's response into ours: status and end-to-end headers unchanged, body
/// passed through as it arrives (see [`Relay`]).
fn relay(
    shared: &Arc<Shared>,
    resp: hyper::Response<UpstreamBody>,
    backend: BackendUse,
    slot: Admission,
    tracker: Tracker,
    arrival: Instant,
) -> Response {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // Time to first token is measured for streams, known by the answer's media type.
    let stream = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let relay = Relay::new(
        shared,
        body,
        tracker,
        parts.status.as_u16(),
        (slot, backend),
        stream.then_some(arrival),
        false,
    );
    Response::from_parts(parts, Body::new(relay))
}

/// At most this many bytes of already-arrived backend chunks are joined into one write.
const COALESCE_MAX: usize = 16 * 1024;

/// The backend's body on its way to the client; it holds the admission slot and the endpoint's
/// outstanding count until the last frame, and records the outcome.
///
/// Chunks that have already arrived are joined into one frame, so a burst of SSE events costs
/// one write to the client instead of one per event. Polling [`UpstreamBody`] drives the
/// backend connection in this task, so when it has nothing more to give, nothing more has
/// reached the gateway: what was collected goes out at once. A chunk is never held back for
/// data that has not arrived, and the bytes are unchanged.
struct Relay {
    inner: UpstreamBody,
    tracker: Option<Tracker>,
    code: u16,
    held: Option<(Admission, BackendUse)>,
    /// Arrival time of a streaming request whose first token is not yet counted.
    ttft: Option<Instant>,
    metrics: Arc<Metrics>,
    /// Data taken from `inner` and not yet returned.
    acc: Acc,
    /// A non-data outcome of `inner` that came after `acc`'s data, returned next.
    stash: Option<Option<Result<Frame<Bytes>, hyper::Error>>>,
    /// The `200` of a held stream is already committed: a backend failure becomes an SSE
    /// `error` event and the end of the stream, trailers are dropped.
    committed: bool,
}

/// Collected chunks: none, one (passed on without a copy), or several joined.
enum Acc {
    Empty,
    One(Bytes),
    Many(BytesMut),
}

impl Acc {
    fn len(&self) -> usize {
        match self {
            Acc::Empty => 0,
            Acc::One(b) => b.len(),
            Acc::Many(b) => b.len(),
        }
    }

    fn push(&mut self, data: Bytes) {
        *self = match std::mem::replace(self, Acc::Empty) {
            Acc::Empty => Acc::One(data),
            Acc::One(first) => {
                let len = first.len() + data.len();
                let mut joined = BytesMut::with_capacity((len * 8).min(COALESCE_MAX).max(len));
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&data);
                Acc::Many(joined)
            }
            Acc::Many(mut joined) => {
                joined.extend_from_slice(&data);
                Acc::Many(joined)
            }
        };
    }

    fn take(&mut self) -> Option<Bytes> {
        match std::mem::replace(self, Acc::Empty) {
            Acc::Empty => None,
            Acc::One(b) => Some(b),
            Acc::Many(b) => Some(b.freeze()),
        }
    }
}

impl Relay {
    fn new(
        shared: &Shared,
        inner: UpstreamBody,
        tracker: Tracker,
        code: u16,
        held: (Admission, BackendUse),
        ttft: Option<Instant>,
        committed: bool,
    ) -> Self {
        let mut relay = Self {
            inner,
            tracker: Some(tracker),
            code,
            held: Some(held),
            ttft,
            metrics: shared.metrics.clone(),
            acc: Acc::Empty,
            stash: None,
            committed,
        };
        if relay.inner.is_end_stream() {
            relay.complete();
        }
        relay
    }

    /// Records the outcome and lets go of the slot and the endpoint. (The backend connection
    /// is [`UpstreamBody`]'s: it returns to its pool once the body was read to its end.)
    fn complete(&mut self) {
        if let Some(mut t) = self.tracker.take() {
            t.finish(self.code);
        }
        self.held = None;
    }

    /// What `inner` ended with (`None`: the end; `Some(Err)`: a failure), after the data
    /// collected before it.
    fn end(
        &mut self,
        outcome: Option<Result<Frame<Bytes>, hyper::Error>>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let outcome = match outcome {
            Some(Err(e)) => {
                self.metrics.upstream_error("stream");
                self.complete();
                if self.committed {
                    let msg = format!("the backend stream failed: {e}");
                    self.acc
                        .push(sse_error_event(&msg, "server_error", Some("bad_gateway")));
                    None
                } else {
                    Some(Err(e))
                }
            }
            // A committed stream carries data only.
            Some(Ok(_)) if self.committed => {
                self.complete();
                None
            }
            None => {
                self.complete();
                None
            }
            // Trailers are the last part of a message (RFC 9112 §7.1.2), and hyper does not
            // ask for the end after them.
            Some(Ok(trailers)) => {
                self.complete();
                Some(Ok(trailers))
            }
        };
        match self.acc.take() {
            Some(data) => {
                self.stash = Some(outcome);
                Poll::Ready(Some(Ok(Frame::data(data))))
            }
            None => Poll::Ready(outcome),
        }
    }
}

impl HttpBody for Relay {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        if let Some(outcome) = this.stash.take() {
            return Poll::Ready(outcome);
        }
        loop {
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if let Some(start) = this.ttft.take() {
                            this.metrics.ttft.observe(start.elapsed().as_secs_f64());
                        }
                        if this.inner.is_end_stream() {
                            this.complete();
                        }
                        if !data.is_empty() {
                            this.acc.push(data);
                        }
                        if (this.inner.is_end_stream() || this.acc.len() >= COALESCE_MAX)
                            && let Some(data) = this.acc.take()
                        {
                            return Poll::Ready(Some(Ok(Frame::data(data))));
                        }
                    }
                    Err(frame) => return this.end(Some(Ok(frame))),
                },
                Poll::Ready(Some(Err(e))) => return this.end(Some(Err(e))),
                Poll::Ready(None) => return this.end(None),
                Poll::Pending => {
                    return match this.acc.take() {
                        Some(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                        None => Poll::Pending,
                    };
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.stash.is_none() && matches!(self.acc, Acc::Empty) && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.stash.is_none() && matches!(self.acc, Acc::Empty) && !self.committed {
            self.inner.size_hint()
        } else {
            SizeHint::default()
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if self.inner.is_end_stream() {
            self.complete();
        }
        // Otherwise the tracker drops unfinished: the client left, counted as canceled, and
        // dropping `inner` closes the backend connection, which cancels the generation.
    }
}

/// The forwarding of a held request, boxed: it is only polled, never moved.
type Forwarding = Pin<
    Box<dyn Future<Output = Result<(hyper::Response<UpstreamBody>, BackendUse), HoldError>> + Send>,
>;

/// Keepalive cold start for a streaming request: `200` with `text/event-stream` now, comment
/// lines every heartbeat interval, then the backend's stream bytes unchanged; on activation
/// timeout or backend failure an `event: error` event, then the end of the stream.
///
/// The hold runs inside the response body ([`HeldStream`]), not in a task of its own: a held
/// connection costs one task, and a client that leaves drops the body, which ends the hold.
fn hold_streaming(
    shared: Arc<Shared>,
    out: Outgoing,
    slot: Admission,
    tracker: Tracker,
    arrival: Instant,
    deadline: Instant,
) -> Response {
    let body = HeldStream {
        state: HeldState::Start,
        shared,
        slot: Some(slot),
        tracker: Some(tracker),
        arrival,
        out: Some(out),
        deadline,
    };
    let mut resp = Response::new(Body::new(body));
    // hyper keeps the response's header map for the connection's next request: keep it small.
    *resp.headers_mut() = HeaderMap::with_capacity(2);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

/// The body of a held streaming request (see [`hold_streaming`]).
struct HeldStream {
    state: HeldState,
    shared: Arc<Shared>,
    slot: Option<Admission>,
    /// Dropped unfinished when the client leaves: counted as canceled.
    tracker: Option<Tracker>,
    arrival: Instant,
    /// The request, until forwarding starts.
    out: Option<Outgoing>,
    /// The activation deadline.
    deadline: Instant,
}

enum HeldState {
    /// Nothing sent yet: the first heartbeat goes out at once.
    Start,
    /// Waiting for a ready backend (`ready`), then for its answer (`forward`), sending a
    /// heartbeat on every tick. The forwarding future (~1 KiB) is only made once an endpoint
    /// is ready; until then a held stream keeps just the small wait on the endpoint set.
    Waiting {
        ready: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
        forward: Option<Forwarding>,
        heartbeat: Pin<Box<tokio::time::Sleep>>,
    },
    /// The backend answered with an error status; its body is read for the message.
    Failed {
        status: StatusCode,
        body: Pin<Box<dyn Future<Output = Bytes> + Send>>,
    },
    /// The backend's stream, passed through.
    Streaming(Box<Relay>),
    Done,
}

impl HeldStream {
    /// Ends the stream with an SSE `error` event.
    fn fail(
        &mut self,
        message: &str,
        code: &str,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        self.state = HeldState::Done;
        self.slot = None;
        if let Some(mut t) = self.tracker.take() {
            t.finish(200);
        }
        Poll::Ready(Some(Ok(Frame::data(sse_error_event(
            message,
            "server_error",
            Some(code),
        )))))
    }
}

impl HttpBody for HeldStream {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = &mut *self;
        loop {
            match &mut this.state {
                HeldState::Start => {
                    let mut rx = this.shared.backends.subscribe();
                    let ready: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
                        let _ = rx.wait_for(|eps| !eps.is_empty()).await;
                    });
                    let next = tokio::time::Instant::now() + this.shared.cfg.heartbeat_interval;
                    this.state = HeldState::Waiting {
                        ready: Some(ready),
                        forward: None,
                        heartbeat: Box::pin(tokio::time::sleep_until(
                            next.min(this.deadline.into()),
                        )),
                    };
                    return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(HEARTBEAT)))));
                }
                HeldState::Waiting {
                    ready,
                    forward,
                    heartbeat,
                } => {
                    if let Some(r) = ready
                        && r.as_mut().poll(cx).is_ready()
                    {
                        *ready = None;
                    }
                    if ready.is_none() && forward.is_none() {
                        let Some(out) = this.out.take() else {
                            this.state = HeldState::Done;
                            continue;
                        };
                        let (shared, arrival, deadline) =
                            (this.shared.clone(), this.arrival, this.deadline);
                        *forward = Some(Box::pin(async move {
                            shared.forward(&out, deadline, arrival, true).await
                        }));
                    }
                    let polled = match forward {
                        Some(f) => f.as_mut().poll(cx),
                        None => Poll::Pending,
                    };
                    let result = match polled {
                        Poll::Ready(r) => r,
                        Poll::Pending => {
                            if heartbeat.as_mut().poll(cx).is_pending() {
                                return Poll::Pending;
                            }
                            let now = tokio::time::Instant::now();
                            // Still no ready endpoint at the deadline (once forwarding,
                            // `forward` keeps the deadline itself).
                            if forward.is_none() && now >= this.deadline.into() {
                                Err(HoldError::Timeout)
                            } else {
                                // On schedule, unless the body was not polled for a while.
                                let hb = this.shared.cfg.heartbeat_interval;
                                let mut next = (heartbeat.deadline() + hb).max(now);
                                if forward.is_none() {
                                    next = next.min(this.deadline.into());
                                }
                                heartbeat.as_mut().reset(next);
                                return Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(
                                    HEARTBEAT,
                                )))));
                            }
                        }
                    };
                    match result {
                        Ok((resp, backend)) => {
                            let status = resp.status();
                            let body = resp.into_body();
                            if status.is_success() {
                                let (Some(slot), Some(tracker)) =
                                    (this.slot.take(), this.tracker.take())
                                else {
                                    this.state = HeldState::Done;
                                    continue;
                                };
                                let relay = Relay::new(
                                    &this.shared,
                                    body,
                                    tracker,
                                    200,
                                    (slot, backend),
                                    Some(this.arrival),
                                    true,
                                );
                                this.state = HeldState::Streaming(Box::new(relay));
                            } else {
                                // The 200 is committed: the backend's error goes inside the
                                // stream.
                                let body = Box::pin(async move {
                                    let _backend = backend;
                                    Limited::new(body, 64 * 1024)
                                        .collect()
                                        .await
                                        .map(|c| c.to_bytes())
                                        .unwrap_or_default()
                                });
                                this.state = HeldState::Failed { status, body };
                            }
                        }
                        Err(HoldError::Timeout) => {
                            this.shared.metrics.rejected("activation_timeout");
                            let msg = format!(
                                "no backend became ready within the activation timeout ({:?}); retry the request",
                                this.shared.cfg.activation_timeout
                            );
                            return this.fail(&msg, "activation_timeout");
                        }
                        Err(HoldError::Upstream(msg)) => return this.fail(&msg, "bad_gateway"),
                    }
                }
                HeldState::Failed { status, body } => {
                    let bytes = std::task::ready!(body.as_mut().poll(cx));
                    let status = *status;
                    let msg = serde_json::from_slice::<serde_json::Value>(&bytes)
                        .ok()
                        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
                        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
                    let msg = format!("backend answered {status}: {msg}");
                    return this.fail(&msg, status.as_str());
                }
                HeldState::Streaming(relay) => return Pin::new(&mut **relay).poll_frame(cx),
                HeldState::Done => return Poll::Ready(None),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.state {
            HeldState::Streaming(relay) => relay.is_end_stream(),
            HeldState::Done => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame's bytes that count how many frames are still alive.
    struct Counted(Arc<std::sync::atomic::AtomicUsize>, [u8; 1]);

    impl AsRef<[u8]> for Counted {
        fn as_ref(&self) -> &[u8] {
            &self.1
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    type Frames = http_body_util::StreamBody<
        futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>,
    >;

    /// A body of `n` one-byte frames, and the count of frames still alive.
    fn frames(n: usize) -> (Frames, Arc<std::sync::atomic::AtomicUsize>) {
        let live = Arc::new(std::sync::atomic::AtomicUsize::new(n));
        let frames: Vec<_> = (0..n)
            .map(|_| {
                Ok(Frame::data(Bytes::from_owner(Counted(
                    live.clone(),
                    [b'x'],
                ))))
            })
            .collect();
        (
            http_body_util::StreamBody::new(futures::stream::iter(frames)),
            live,
        )
    }

    #[tokio::test]
    async fn a_body_of_many_frames_is_one_buffer_and_keeps_no_frame() {
        let timer = crate::timer::CoarseTimer::new().unwrap();
        let budget = crate::budget::BodyBudget::new(1 << 20);
        let (body, live) = frames(10_000);
        let out = read_body(body, None, 1 << 20, &budget, &timer, Duration::from_secs(5))
            .await
            .unwrap_or_else(|_| panic!("read failed"));
        let (out, held) = out;
        assert_eq!(out.len(), 10_000);
        assert_eq!(budget.held(), 10_000);
        // Each frame was copied and released: a body of tiny chunks costs its bytes, not a
        // buffer (or a list entry) per chunk.
        assert_eq!(live.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(held);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_body_in_one_frame_is_not_copied_and_the_limit_holds() {
        let timer = crate::timer::CoarseTimer::new().unwrap();
        let budget = crate::budget::BodyBudget::new(1 << 20);
        let data = Bytes::from_static(b"{\"model\":\"m\"}");
        let body = Full::new(data.clone());
        let out = read_body(
            body,
            Some(13),
            1 << 20,
            &budget,
            &timer,
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|_| panic!("read failed"));
        assert_eq!(out.0.as_ptr(), data.as_ptr());
        let (body, _) = frames(11);
        assert!(matches!(
            read_body(body, None, 10, &budget, &timer, Duration::from_secs(5)).await,
            Err(BodyError::TooLarge)
        ));
    }

    #[test]
    fn detach_keeps_every_field_value_in_order_and_sensitivity() {
        let mut h = HeaderMap::with_capacity(64);
        h.append("x-a", HeaderValue::from_static("1"));
        h.append("x-b", HeaderValue::from_static("2"));
        h.append("x-a", HeaderValue::from_static("3"));
        let mut auth = HeaderValue::from_static("Bearer k");
        auth.set_sensitive(true);
        h.insert(header::AUTHORIZATION, auth);
        let mut out = Outgoing {
            method: Method::POST,
            path_and_query: "/v1/completions".into(),
            headers: h,
            body: Bytes::from_static(b"{}"),
            _held: crate::budget::BodyBudget::new(1).reservation(),
        };
        out.detach();
        let a: Vec<_> = out.headers.get_all("x-a").iter().collect();
        assert_eq!(a, ["1", "3"]);
        assert_eq!(out.headers["x-b"], "2");
        assert!(out.headers[header::AUTHORIZATION].is_sensitive());
        assert_eq!(out.headers.len(), 4);
        assert!(out.headers.capacity() < 64, "rebuilt at its size");
        assert_eq!(out.body, "{}");
    }

    #[test]
    fn strips_hop_by_hop_and_connection_named_fields() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, X-Secret"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert(
            header::TRANSFER_ENCODING,
            HeaderValue::from_static("chunked"),
        );
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        h.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer k"));
        h.insert("x-end-to-end", HeaderValue::from_static("kept"));
        strip_hop_by_hop(&mut h);
        let left: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(left.len(), 2, "{left:?}");
        assert_eq!(h[header::AUTHORIZATION], "Bearer k");
        assert_eq!(h["x-end-to-end"], "kept");
    }
}

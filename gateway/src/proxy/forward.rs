//! Forwarding: the request as it is sent to a backend ([`Outgoing`]), the wait for a ready
//! endpoint, and the send with its retries while no connection can be established.

use std::{
    sync::Arc,
    time::{Duration, Instant},
};

use axum::http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use bytes::Bytes;
use http_body_util::Full;

use super::headers::{Via, forward_headers};
use crate::{
    adapters::{AdapterError, AdapterUse, Caller, LoadFailure, Target},
    endpoints::{EndpointGuard, EndpointSet, Preference},
    fair::{Claim, Entry},
    gateway::Shared,
    model::Model,
    upstream::{UpstreamBody, UpstreamError, UpstreamPool},
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

/// What a forwarded request holds on the backend until its response ends: the endpoint's
/// outstanding-request count, and its place in flight with the meter of its tokens.
pub(super) struct BackendUse {
    _ep: EndpointGuard,
    /// The request's adapter, held on the endpoint's engine (not unloaded while in use).
    _adapter: Option<AdapterUse>,
    pub(super) meter: super::meter::Meter,
    /// How long the request waited in the fair queue for its place in flight.
    pub(super) queued: Duration,
}

/// Why a request was not answered.
pub(super) enum HoldError {
    /// No endpoint became ready before the activation deadline.
    Timeout,
    /// The backend could not be reached or failed before answering.
    Upstream(String),
    /// The request's adapter could not be loaded into the engine.
    Adapter(AdapterError),
    /// No endpoint is ready and none will come: the service's activation failure
    /// ([`crate::diagnosis`]), `<reason>: <message>`.
    Failed(Arc<str>),
}

/// Why a request sent warm was not answered.
pub(super) enum WarmError {
    /// As for a cold request.
    Hold(HoldError),
    /// The engine it was sent to is asleep (sleeping tier: another gateway replica put it to
    /// sleep). Nothing was relayed; the caller handles the request as a cold arrival from here,
    /// so the service's cold-start mode applies (reject, or hold with heartbeats for a stream).
    Asleep,
}

impl From<HoldError> for WarmError {
    fn from(e: HoldError) -> Self {
        Self::Hold(e)
    }
}

/// How [`forward`] treats a request by how it arrived: [`Cold`] (no backend was ready;
/// it waits through an engine's wake-up and its wait is an activation) or [`Warm`].
pub(super) trait Arrival {
    /// What forwarding fails with.
    type Error: From<HoldError>;
    /// Whether the request arrived cold.
    const COLD: bool;
    /// What a request that finds its engine asleep fails with; `None`: it waits for the wake-up.
    fn asleep() -> Option<Self::Error>;
}

/// A request that arrived while no backend was ready ([`Arrival`]).
pub(super) enum Cold {}

/// A request that arrived while a backend was ready ([`Arrival`]).
pub(super) enum Warm {}

impl Arrival for Cold {
    type Error = HoldError;
    const COLD: bool = true;
    fn asleep() -> Option<HoldError> {
        None
    }
}

impl Arrival for Warm {
    type Error = WarmError;
    const COLD: bool = false;
    fn asleep() -> Option<WarmError> {
        Some(WarmError::Asleep)
    }
}

/// Who a request is dispatched for, and what it is estimated to cost.
#[derive(Debug, Clone)]
pub(super) struct Dispatch {
    /// Its tenant and band.
    pub(super) claim: Claim,
    /// The tenant's name (metric label).
    pub(super) tenant: Arc<str>,
    /// The prompt's estimate: body bytes / 4.
    pub(super) prompt_tokens: u64,
    /// What its tenant's token quota was charged at admission (none without one); given back
    /// unless the meter settles it to the answer's usage.
    pub(super) quota: Option<Arc<crate::quota::Charge>>,
}

impl Default for Dispatch {
    fn default() -> Self {
        Self {
            claim: Claim {
                tenant: 0,
                priority: 0,
            },
            tenant: Arc::from(crate::tenants::DEFAULT_TENANT),
            prompt_tokens: 0,
            quota: None,
        }
    }
}

/// The parts of a request to re-send on each attempt.
pub(super) struct Outgoing {
    method: Method,
    path_and_query: String,
    headers: HeaderMap,
    body: Bytes,
    /// Who it is dispatched for.
    pub(super) dispatch: Dispatch,
    /// The adapter it calls, loaded into the engine it is sent to before it is sent.
    pub(super) adapter: Option<Target>,
    /// The body's bytes in the replica's [`crate::budget::BodyBudget`], until the request is
    /// done with.
    _held: crate::budget::Reservation,
}

impl Outgoing {
    /// The request to send for the client's `parts` and its read `body` (its bytes `held` in
    /// the body budget): method and target unchanged, the headers as [`forward_headers`] makes
    /// them, with this replica's `via` and the client's address `peer_ip`. The header map is
    /// taken out of `parts`.
    pub(super) fn new(
        parts: &mut http::request::Parts,
        body: Bytes,
        held: crate::budget::Reservation,
        via: &Via,
        peer_ip: Option<&HeaderValue>,
    ) -> Self {
        let target_host = match parts.uri.authority() {
            Some(a) => HeaderValue::from_str(a.as_str()).ok(),
            None => parts
                .headers
                .get(header::HOST)
                .filter(|h| !h.is_empty())
                .cloned(),
        };
        Self {
            method: parts.method.clone(),
            path_and_query: parts
                .uri
                .path_and_query()
                .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned()),
            headers: forward_headers(
                std::mem::take(&mut parts.headers),
                via.value(parts.version),
                target_host,
                peer_ip,
            ),
            body,
            dispatch: Dispatch::default(),
            adapter: None,
            _held: held,
        }
    }

    /// What the body says of the request (its `model`, whether it streams), read as a cold
    /// arrival's is.
    pub(super) fn hints(&self) -> crate::openai::RequestHints {
        crate::openai::RequestHints::from_request(&self.method, &self.headers, &self.body)
    }

    /// Copies the body and the header values out of hyper's read buffer. hyper hands them out
    /// as slices of its 8 KiB per-connection buffer, so a held request would otherwise keep
    /// that buffer alive and make hyper allocate a second one for the same connection.
    ///
    /// The header map is rebuilt at its exact size on the way: a held request keeps it for as
    /// long as the hold lasts, and the warm path leaves room in it for the added fields.
    pub(super) fn detach(&mut self) {
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

/// The request to send for `out` to the endpoint `ep`.
fn build_upstream(
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

/// Sends `out` to a ready endpoint of `model` once the model's fair queue gives it a place in
/// flight ([`crate::fair`]; waiting for it, warm or cold, counts as the activation's wait too),
/// waiting for an endpoint until `deadline` and retrying
/// when a connection cannot be established (the request was not sent, so it is safe to
/// resend). An adapter request whose engine answers `404` "does not exist" (another replica
/// unloaded the adapter) gets the adapter loaded again and is sent once more to that engine
/// (the body is kept for it, as for the retries). An endpoint that refused the connection or
/// failed the request is ejected ([`EndpointGuard::eject`]): the retry and the next requests go
/// to another ready one.
/// With the sleeping tier, a `503` from an engine that says it is asleep is not relayed:
/// the tier wakes it on demand, and a [`Cold`] request waits for an awake engine (see
/// [`crate::sleep`]), while a [`Warm`] one fails with [`WarmError::Asleep`].
pub(super) async fn forward<A: Arrival>(
    shared: &Shared,
    model: &Model,
    out: &Outgoing,
    deadline: Instant,
    arrival: Instant,
) -> Result<(hyper::Response<UpstreamBody>, BackendUse), A::Error> {
    let state = &model.state;
    let metrics = &state.metrics;
    let d = &out.dispatch;
    let entered = Instant::now();
    let permit = match state.fair.enter(d.claim, d.prompt_tokens as f64) {
        Entry::Dispatched(p) => p,
        Entry::Queued(ticket) => ticket.wait(deadline).await.ok_or(HoldError::Timeout)?,
    };
    let queued = entered.elapsed();
    metrics.dispatched(&d.tenant, queued.as_secs_f64());
    let mut backoff = Duration::from_millis(20);
    // An adapter request prefers an engine that has its adapter, while it has room.
    let bound = state.fair.per_endpoint();
    let has_adapter = |a: &http::uri::Authority| {
        out.adapter
            .as_ref()
            .is_some_and(|t| state.adapters.has(a, &t.adapter.name))
    };
    let prefer: Preference<'_> = out.adapter.as_ref().map(|_| (&has_adapter as _, bound));
    // Whether the request was sent once more after its engine said it lost the adapter.
    let mut resent = false;
    'endpoint: loop {
        let ep = acquire_endpoint(&state.backends, deadline, prefer)
            .await
            .ok_or(HoldError::Timeout)?;
        let mut adapter = match &out.adapter {
            None => None,
            Some(target) => match hold_adapter::<A>(shared, model, target, &ep, deadline).await? {
                Some(held) => Some(held),
                None => {
                    drop(ep);
                    pause(&mut backoff, deadline).await?;
                    continue;
                }
            },
        };
        let (answer, sent) = 'send: loop {
            let req = build_upstream(out, &ep).map_err(HoldError::Upstream)?;
            let sent = Instant::now();
            let answer = shared.upstream().send(ep.endpoint().authority(), req).await;
            let answer = match (answer, out.adapter.as_ref(), adapter.take()) {
                (Ok(resp), Some(target), Some(held))
                    if resp.status() == StatusCode::NOT_FOUND && !resent =>
                {
                    match lost_adapter(resp).await {
                        Ok(Err(resp)) => {
                            adapter = Some(held);
                            Ok(resp)
                        }
                        Err(e) => Err(UpstreamError::Request(e)),
                        Ok(Ok(())) => {
                            resent = true;
                            match reload::<A>(shared, model, target, &ep, held, deadline).await? {
                                Some(held) => {
                                    adapter = Some(held);
                                    continue 'send;
                                }
                                None => {
                                    drop(ep);
                                    pause(&mut backoff, deadline).await?;
                                    continue 'endpoint;
                                }
                            }
                        }
                    }
                }
                (answer, _, held) => {
                    adapter = held;
                    answer
                }
            };
            break (answer, sent);
        };
        match answer {
            Ok(resp)
                if resp.status() == StatusCode::SERVICE_UNAVAILABLE
                    && found_asleep(model, &ep).await =>
            {
                // Put to sleep by another gateway replica: the demand wakes it (the
                // tier stops sending it requests); the request is a cold one from here.
                tracing::debug!(endpoint = %ep.endpoint().authority(), "backend asleep; the request waits for its wake-up");
                drop((resp, ep, adapter));
                if let Some(e) = A::asleep() {
                    return Err(e);
                }
                state.lease.raise();
                pause(&mut backoff, deadline).await?;
            }
            Ok(resp) => {
                metrics.upstream_latency(sent.elapsed().as_secs_f64());
                if A::COLD {
                    metrics.activation_wait(sent.duration_since(arrival).as_secs_f64());
                    state.lease.ready_seen();
                }
                // Metered from here: a request that never got an answer costs its tenant no
                // tokens (its quota estimate is given back when its charge drops).
                let meter = super::meter::Meter::new(permit, d.clone(), metrics.clone());
                return Ok((
                    resp,
                    BackendUse {
                        _ep: ep,
                        _adapter: adapter,
                        meter,
                        queued,
                    },
                ));
            }
            Err(e) if e.is_connect() => {
                metrics.upstream_error("connect");
                tracing::debug!(endpoint = %ep.endpoint().authority(), error = %e, "backend refused the connection; retrying");
                // Another ready endpoint, if any, gets the retry (and the next requests).
                ep.eject();
                drop((ep, adapter));
                pause(&mut backoff, deadline).await?;
            }
            Err(e) => {
                metrics.upstream_error("request");
                ep.eject();
                // The backend's address is for the logs, not for clients.
                tracing::warn!(service = %model.cfg.key, endpoint = %ep.endpoint().authority(), error = %e, "backend request failed");
                return Err(HoldError::Upstream(format!("the backend failed: {e}")).into());
            }
        }
    }
}

/// [`forward`] for a cold request, ended early with [`HoldError::Failed`] when the model's
/// activation failure is reported (or already is) while no endpoint is ready
/// ([`EndpointSet::failed`] on its discovered endpoints).
pub(super) async fn cold(
    shared: &Shared,
    model: &Model,
    out: &Outgoing,
    deadline: Instant,
    arrival: Instant,
) -> Result<(hyper::Response<UpstreamBody>, BackendUse), HoldError> {
    tokio::select! {
        biased;
        sent = forward::<Cold>(shared, model, out, deadline, arrival) => sent,
        why = model.discovered().failed() => Err(HoldError::Failed(why)),
    }
}

/// Sleeps `backoff` (no later than `deadline`) before the next attempt, and doubles it (at
/// most 500 ms).
///
/// # Errors
/// [`HoldError::Timeout`] when the deadline has passed.
async fn pause(backoff: &mut Duration, deadline: Instant) -> Result<(), HoldError> {
    let now = Instant::now();
    if now >= deadline {
        return Err(HoldError::Timeout);
    }
    tokio::time::sleep((*backoff).min(deadline - now)).await;
    *backoff = (*backoff * 2).min(Duration::from_millis(500));
    Ok(())
}

/// Loads `target`'s adapter into the engine of `ep` (unless it has it) and holds it there
/// for the request: `None` when the request may try again, on another engine or after a
/// wake-up ([`load_failed`]).
///
/// # Errors
/// [`HoldError::Timeout`] at `deadline`, or the answer to the request ([`load_failed`]).
async fn hold_adapter<A: Arrival>(
    shared: &Shared,
    model: &Model,
    target: &Target,
    ep: &EndpointGuard,
    deadline: Instant,
) -> Result<Option<AdapterUse>, A::Error> {
    match load_adapter(shared, model, target, ep, deadline).await {
        None => Err(HoldError::Timeout.into()),
        Some(Ok(held)) => Ok(Some(held)),
        Some(Err(failure)) => {
            load_failed::<A>(model, ep, target, failure).await?;
            Ok(None)
        }
    }
}

/// The engine of `ep` said it does not have `held`'s adapter (another replica unloaded it):
/// drops it from the engine's slots, counts and logs it, and loads it again (sharing the load
/// with the other requests that found it lost) as [`hold_adapter`] does.
///
/// # Errors
/// As [`hold_adapter`].
async fn reload<A: Arrival>(
    shared: &Shared,
    model: &Model,
    target: &Target,
    ep: &EndpointGuard,
    held: AdapterUse,
    deadline: Instant,
) -> Result<Option<AdapterUse>, A::Error> {
    tracing::info!(service = %model.cfg.key, adapter = %held.name(), engine = %held.engine(), "the engine no longer has the adapter; loading it again");
    let name = Arc::from(model.name().unwrap_or_default());
    model.state.metrics.adapter_reload(&name, held.name());
    held.lost();
    hold_adapter::<A>(shared, model, target, ep, deadline).await
}

/// After `failure` to load `target`'s adapter into the engine of `ep`: `Ok` when the request
/// may try again (a connection refused: the endpoint is ejected; an engine found asleep: a
/// cold request waits for its wake-up).
///
/// # Errors
/// The answer to the request: the adapter's error, or [`WarmError::Asleep`] for a warm
/// request that found its engine asleep.
async fn load_failed<A: Arrival>(
    model: &Model,
    ep: &EndpointGuard,
    target: &Target,
    failure: LoadFailure,
) -> Result<(), A::Error> {
    let metrics = &model.state.metrics;
    match failure {
        LoadFailure::Connect(e) => {
            metrics.upstream_error("connect");
            tracing::debug!(endpoint = %ep.endpoint().authority(), error = %e, "backend refused the connection of an adapter load; retrying");
            ep.eject();
            Ok(())
        }
        // The engine sleeps (another replica put it to sleep): as for a request's `503`.
        f if f.status() == Some(StatusCode::SERVICE_UNAVAILABLE)
            && found_asleep(model, ep).await =>
        {
            if let Some(e) = A::asleep() {
                return Err(e);
            }
            model.state.lease.raise();
            Ok(())
        }
        f => {
            if matches!(f, LoadFailure::Broken(_)) {
                metrics.upstream_error("request");
                ep.eject();
            }
            let name = &target.adapter.name;
            Err(HoldError::Adapter(AdapterError::new(name, &f)).into())
        }
    }
}

/// Largest part of a `404` answer to an adapter request read to see whether the engine lost
/// the adapter, in bytes (vLLM's error is about 150).
const LOST_PEEK_LIMIT: usize = 16 * 1024;

/// How long reading that part may take.
const LOST_PEEK_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether `resp`, a `404` to an adapter request, says the engine does not have the adapter
/// ([`crate::adapters::engine_lost`]): `Ok(Ok(()))`, the answer read and dropped; else the
/// answer to relay, unchanged (`Ok(Err(resp))`).
///
/// # Errors
/// Its body failed.
async fn lost_adapter(
    resp: hyper::Response<UpstreamBody>,
) -> Result<Result<(), hyper::Response<UpstreamBody>>, hyper::Error> {
    let (parts, mut body) = resp.into_parts();
    let seen = body.peek(LOST_PEEK_LIMIT, LOST_PEEK_TIMEOUT).await?;
    if crate::adapters::engine_lost(&seen) {
        Ok(Ok(()))
    } else {
        Ok(Err(hyper::Response::from_parts(parts, body)))
    }
}

/// Loads `target`'s adapter into the engine of `ep` (unless it has it) and holds it there for
/// the request, waiting no later than `deadline` (`None` when it passed first).
async fn load_adapter(
    shared: &Shared,
    model: &Model,
    target: &Target,
    ep: &EndpointGuard,
    deadline: Instant,
) -> Option<Result<AdapterUse, LoadFailure>> {
    let caller = Caller {
        pool: shared.upstream(),
        metrics: model.state.metrics.clone(),
        model: Arc::from(model.name().unwrap_or_default()),
        timeout: model.cfg.activation_timeout,
    };
    let acquire = model.state.adapters.acquire(target, ep.shared(), &caller);
    tokio::time::timeout_at(deadline.into(), acquire).await.ok()
}

/// Whether `ep`, which answered `503`, is an engine of `model` asleep (sleeping tier only).
async fn found_asleep(model: &Model, ep: &EndpointGuard) -> bool {
    match &model.state.sleep {
        Some(tier) => tier.confirm_asleep(ep.endpoint().authority()).await,
        None => false,
    }
}

/// The least-loaded ready endpoint of `backends` (with `prefer`, a preferred one with room
/// first), waiting for the set to change until `deadline`.
async fn acquire_endpoint(
    backends: &EndpointSet,
    deadline: Instant,
    prefer: Preference<'_>,
) -> Option<EndpointGuard> {
    let pick = || match prefer {
        None => backends.pick(),
        Some((p, bound)) => backends.pick_preferring(p, bound),
    };
    // The warm path: no watch receiver to make and drop (dropping the last one wakes the
    // sender's waiters).
    if let Some(ep) = pick() {
        return Some(ep);
    }
    // Subscribed before looking again, so a change in between is not missed.
    let mut rx = backends.subscribe();
    loop {
        rx.borrow_and_update();
        if let Some(ep) = pick() {
            return Some(ep);
        }
        tokio::select! {
            r = rx.changed() => r.ok()?,
            _ = tokio::time::sleep_until(deadline.into()) => return None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            dispatch: Dispatch::default(),
            adapter: None,
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

    fn request(uri: &str) -> http::request::Parts {
        let (parts, ()) = http::Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(header::HOST, "gw:8000")
            .header(header::CONTENT_LENGTH, "0")
            .body(())
            .unwrap()
            .into_parts();
        parts
    }

    #[test]
    fn the_outgoing_request_keeps_method_and_target() {
        let budget = crate::budget::BodyBudget::new(1);
        let via = Via::new(1);
        let mut parts = request("/v1/completions?x=1");
        let ip = HeaderValue::from_static("10.0.0.7");
        let out = Outgoing::new(
            &mut parts,
            Bytes::new(),
            budget.reservation(),
            &via,
            Some(&ip),
        );
        assert_eq!(out.method, Method::POST);
        assert_eq!(out.path_and_query, "/v1/completions?x=1");
        assert_eq!(out.headers["x-forwarded-host"], "gw:8000");
        assert_eq!(out.headers["x-forwarded-for"], "10.0.0.7");
        assert!(parts.headers.is_empty(), "the headers were taken");
        // An absolute-form target names the host the client asked for.
        let mut parts = request("http://model.example:8000");
        let out = Outgoing::new(&mut parts, Bytes::new(), budget.reservation(), &via, None);
        assert_eq!(out.path_and_query, "/");
        assert_eq!(out.headers["x-forwarded-host"], "model.example:8000");
    }

    #[tokio::test]
    async fn the_backend_request_names_the_endpoint_and_an_empty_posts_length() {
        let authority: http::uri::Authority = "10.1.2.3:8000".parse().unwrap();
        let shared = super::super::test_shared(
            crate::GatewayConfig::default(),
            crate::EndpointSet::fixed([authority]),
        );
        let via = Via::new(1);
        let mut parts = request("/v1/completions");
        let out = Outgoing::new(
            &mut parts,
            Bytes::new(),
            shared.budget.reservation(),
            &via,
            None,
        );
        let model = super::super::the_model(&shared);
        let ep = acquire_endpoint(model.backends(), Instant::now(), None)
            .await
            .unwrap();
        let req = build_upstream(&out, &ep).unwrap();
        assert_eq!(req.uri(), "/v1/completions");
        assert_eq!(req.headers()[header::HOST], "10.1.2.3:8000");
        assert_eq!(req.headers()[header::CONTENT_LENGTH], "0");
    }

    #[tokio::test]
    async fn without_a_ready_endpoint_forwarding_ends_at_the_deadline() {
        let shared =
            super::super::test_shared(crate::GatewayConfig::default(), crate::EndpointSet::new());
        let via = Via::new(1);
        let mut parts = request("/v1/completions");
        let out = Outgoing::new(
            &mut parts,
            Bytes::new(),
            shared.budget.reservation(),
            &via,
            None,
        );
        let start = Instant::now();
        let model = super::super::the_model(&shared);
        let result = forward::<Cold>(
            &shared,
            &model,
            &out,
            start + Duration::from_millis(50),
            start,
        )
        .await;
        assert!(matches!(result, Err(HoldError::Timeout)));
        assert!(start.elapsed() >= Duration::from_millis(50));
    }

    #[tokio::test]
    async fn a_waiting_request_takes_the_endpoint_that_turns_ready() {
        let backends = crate::EndpointSet::new();
        let later = backends.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            later.replace(["10.1.2.3:8000".parse().unwrap()]);
        });
        let ep = acquire_endpoint(&backends, Instant::now() + Duration::from_secs(5), None)
            .await
            .unwrap();
        assert_eq!(ep.endpoint().authority(), "10.1.2.3:8000");
    }
}

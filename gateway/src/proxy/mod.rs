//! The request path: admission, cold-start hold or reject, forwarding and streaming.
//!
//! `proxy` is a sequence of steps, each in a module of its own; a step that refuses the
//! request gives a [`Rejection`], answered in one place (`refuse`):
//!
//! 1. `edge`: draining (503) → method and framing (405, 400, 501) → a loop back to this
//!    replica (508) → API key (401); and the gateway's own answers to `GET /v1/models`
//!    (a single-service gateway's while cold, a shared gateway's always);
//! 2. `body`: the body read whole, bounded in size, read time and memory (413, 408, 503);
//! 3. `route`: the request's model. A single-service gateway has one; a shared gateway reads
//!    the body's `model` and looks it up in its route table (400 without one, 404 for a model
//!    it does not serve). A request that calls a model by one of its aliases is forwarded with
//!    `model` set to the model's served name. A LoRA adapter's name leads to its base model, and the adapter is
//!    loaded into the engine the request is sent to, on demand ([`crate::adapters`]); a
//!    single-service gateway reads the body's `model` only when its model has adapters. An
//!    adapter its engines cannot load yet (its route's `unavailable`) is answered `503` here,
//!    before admission;
//! 4. `admit`: a cold request's model (404, only with served model names), draining again,
//!    the tenant's quotas (429 `rate_limit_exceeded`), a slot of the model's `maxQueue` (429);
//! 5. a ready endpoint of the model? forward (`forward`, once the model's fair queue gives the
//!    request a place in flight: [`crate::fair`]) : cold start, which rejects (503),
//!    holds a stream with heartbeats (`hold`), or waits silently until the model's activation
//!    timeout (503); a warm request that finds the engine asleep (sleeping tier) is cold from
//!    there;
//! 6. `relay`: the backend's answer passed through as it arrives, its tokens counted by the
//!    request's `meter` for the tenant's fair share, quota and metrics.
//!
//! Steps 1, 2 and the replica-wide parts of 4 (draining) are the replica's; from step 3 on,
//! everything is the model's ([`crate::model`]): its queue, lease, endpoints, cold-start
//! settings and metric series. A shared gateway's models each behave as a single-service
//! gateway would, through these same steps.
//!
//! A cold request's body is checked for its model name before admission, so a misdirected
//! request never raises demand and never wakes a model; a ready backend answers that check
//! itself (vLLM's `404 The model ... does not exist`), so a single-service gateway forwards a
//! warm request without parsing its body (unless its model has adapters or aliases). A shared gateway parses every body (it routes by it)
//! and forwards the bytes unchanged.

mod admit;
mod body;
mod edge;
mod forward;
mod headers;
mod hold;
mod meter;
mod relay;
mod route;

use std::{sync::Arc, time::Instant};

use axum::{
    http::{HeaderValue, Request},
    response::Response,
};
use bytes::Bytes;
use http_body::Body as HttpBody;

pub(crate) use forward::install_worker_pool;
pub(crate) use headers::peer_ip_value;
pub use headers::{Via, strip_hop_by_hop};
pub use hold::HEARTBEAT;

use crate::{
    config::ColdStartMode,
    gateway::Shared,
    metrics::ModelMetrics,
    reject::{self, Rejection},
};

/// The client's address, set per connection by the server loop.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub std::net::SocketAddr);

/// Counts a request once, when it finishes: by status code, or as canceled when dropped first,
/// in its model's series (the unrouted ones until it has a model).
struct Tracker {
    metrics: Arc<ModelMetrics>,
    code: Option<u16>,
}

impl Tracker {
    fn new(metrics: Arc<ModelMetrics>) -> Self {
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
            None => self.metrics.canceled(),
        }
    }
}

/// Finishes `tracker` with `resp`'s status and returns it.
fn done(mut tracker: Tracker, resp: Response) -> Response {
    tracker.finish(resp.status().as_u16());
    resp
}

/// Answers a refused request: counts the rejection by its reason and the request by its
/// status, in the tracker's series.
fn refuse(shared: &Shared, tracker: Tracker, rejection: Rejection) -> Response {
    tracker.metrics.rejected(rejection.kind().label());
    done(tracker, rejection.into_response(shared.cfg.retry_after))
}

/// `resp` with OpenAI's `x-ratelimit-*` headers of `tenant`'s quotas (none without one).
fn with_quota_headers(
    shared: &Shared,
    tenant: crate::fair::TenantId,
    mut resp: Response,
) -> Response {
    if shared.quotas.limited(tenant) {
        shared.quotas.write_headers(tenant, resp.headers_mut());
    }
    resp
}

/// Every request that is not one of the gateway's own endpoints; `peer_ip` is the client's
/// address (see [`peer_ip_value`]), for `X-Forwarded-For`.
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
    let mut tracker = Tracker::new(shared.unrouted.clone());
    let (mut parts, body) = req.into_parts();
    let tenant = match edge::check(&shared, &parts) {
        Ok(tenant) => tenant,
        Err(rejection) => return refuse(&shared, tracker, rejection),
    };
    match edge::own_answer(&shared, &parts) {
        Some(Ok(resp)) => return done(tracker, resp),
        Some(Err(rejection)) => return refuse(&shared, tracker, rejection),
        None => {}
    }

    // The body, whole and bounded: it is kept to be forwarded after activation.
    let (body, held) = match body::read(&shared, &parts.headers, body).await {
        Ok(read) => read,
        Err(body::Unread::Refused(rejection)) => return refuse(&shared, tracker, rejection),
        Err(body::Unread::Gone) => {
            // The tracker counts it as canceled; nobody reads the answer.
            drop(tracker);
            return reject::body_unread();
        }
    };

    let route::Routed {
        model,
        hints,
        adapter,
    } = match route::route(&shared, &parts, &body) {
        Ok(routed) => routed,
        Err(rejection) => return refuse(&shared, tracker, rejection),
    };
    if shared.single.is_none() {
        tracker.metrics = model.state.metrics.clone();
    }
    // A request calling the model by an alias is forwarded under its served name.
    let body = route::renamed(&model, hints.as_ref(), &body).unwrap_or(body);
    if let Err(rejection) = route::available(adapter.as_ref()) {
        return refuse(&shared, tracker, rejection);
    }
    let cold = !model.state.backends.is_ready();
    let admit::Admitted {
        slot,
        mut stream,
        dispatch,
    } = match admit::admit(&shared, &model, &parts, &body, hints, cold, tenant) {
        Ok(admitted) => admitted,
        Err(rejection) => return refuse(&shared, tracker, rejection),
    };
    let mut out = forward::Outgoing::new(&mut parts, body, held, &shared.via, peer_ip.as_ref());
    out.dispatch = dispatch;
    out.adapter = adapter;
    // Not kept across the wait below: it may point into hyper's read buffer.
    drop(parts);

    let deadline = arrival + model.cfg.activation_timeout;
    let mut cold = cold;
    let mut metered_cold = false;
    let sent = loop {
        if cold {
            if !metered_cold {
                metered_cold = true;
                let name = &shared.cfg.tenants.get(tenant).name;
                model.state.metrics.cold_request(name);
            }
            model.state.lease.raise();
            out.detach();
            match model.cfg.cold_start {
                ColdStartMode::Reject => {
                    drop(slot);
                    return refuse(&shared, tracker, Rejection::ColdReject);
                }
                ColdStartMode::Keepalive if stream => {
                    let resp = hold::hold_streaming(
                        shared.clone(),
                        model,
                        out,
                        slot,
                        tracker,
                        arrival,
                        deadline,
                    );
                    return with_quota_headers(&shared, tenant, resp);
                }
                ColdStartMode::Keepalive => {}
            }
        }
        if cold {
            break forward::cold(&shared, &model, &out, deadline, arrival).await;
        }
        match forward::forward::<forward::Warm>(&shared, &model, &out, deadline, arrival).await {
            Ok(sent) => break Ok(sent),
            Err(forward::WarmError::Hold(e)) => break Err(e),
            // Sent warm to an engine another replica had put to sleep: cold from here, so the
            // cold-start mode applies (a rejection, or a held stream's heartbeats).
            Err(forward::WarmError::Asleep) => {
                // A warm request's body was not parsed: it is now, as a cold arrival's is,
                // for the served model and whether it streams (which decides its hold).
                let hints = out.hints();
                if let Err(rejection) = admit::serves(&model, &hints) {
                    drop(slot);
                    return refuse(&shared, tracker, rejection);
                }
                stream = hints.stream;
                cold = true;
            }
        }
    };
    match sent {
        Ok((resp, backend)) => with_quota_headers(
            &shared,
            tenant,
            relay::relay(resp, backend, slot, tracker, arrival, cold),
        ),
        Err(forward::HoldError::Timeout) => {
            drop(slot);
            let timeout = model.cfg.activation_timeout;
            refuse(&shared, tracker, Rejection::ActivationTimeout { timeout })
        }
        Err(forward::HoldError::Upstream(msg)) => done(tracker, reject::bad_gateway(&msg)),
        Err(forward::HoldError::Adapter(e)) => done(tracker, e.response()),
        Err(forward::HoldError::Failed(why)) => {
            drop(slot);
            let service = model.key().to_owned();
            refuse(
                &shared,
                tracker,
                Rejection::ActivationFailed { service, why },
            )
        }
    }
}

/// A replica for the steps' unit tests, with API keys off.
#[cfg(test)]
fn test_gateway(cfg: crate::GatewayConfig, backends: crate::EndpointSet) -> crate::Gateway {
    crate::Gateway::new(cfg, backends, crate::apikeys::ApiKeys::disabled()).unwrap()
}

/// The state of a [`test_gateway`].
#[cfg(test)]
fn test_shared(cfg: crate::GatewayConfig, backends: crate::EndpointSet) -> Arc<Shared> {
    test_gateway(cfg, backends).shared().clone()
}

/// The model of a single-service replica's state.
#[cfg(test)]
fn the_model(shared: &Shared) -> Arc<crate::model::Model> {
    match &shared.single {
        Some(m) => m.clone(),
        None => panic!("a shared gateway"),
    }
}

/// A shared replica with API keys off serving `names` (model `n` of service `ns/n`, queue
/// bound 2, no backend).
#[cfg(test)]
fn test_shared_gateway(names: &[&str]) -> crate::Gateway {
    let gw = crate::Gateway::new_shared(
        crate::GatewayConfig::default(),
        crate::apikeys::ApiKeys::disabled(),
        Arc::new(|_: &hearth_crds::llmendpoint::ModelRoute, _: &crate::EndpointSet| {}),
    )
    .unwrap();
    let models = names
        .iter()
        .map(|n| hearth_crds::llmendpoint::ModelRoute {
            max_queue: 2,
            ..crate::routes::default_route("ns", n, n)
        })
        .collect();
    gw.apply_routes(&hearth_crds::llmendpoint::RouteTable { models })
        .unwrap();
    gw
}

/// A backend on loopback that answers one request with `response`, written at once, then
/// keeps the connection open.
#[cfg(test)]
async fn test_backend(response: &'static [u8]) -> http::uri::Authority {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = conn.read(&mut buf).await.unwrap();
            if n == 0 {
                return;
            }
            head.extend_from_slice(&buf[..n]);
        }
        conn.write_all(response).await.unwrap();
        let _ = conn.read(&mut buf).await;
    });
    addr.to_string().parse().unwrap()
}

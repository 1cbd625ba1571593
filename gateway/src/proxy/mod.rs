//! The request path: admission, cold-start hold or reject, forwarding and streaming.
//!
//! `proxy` is a sequence of steps, each in a module of its own; a step that refuses the
//! request gives a [`Rejection`], answered in one place (`refuse`):
//!
//! 1. `edge`: draining (503) → method and framing (405, 400, 501) → a loop back to this
//!    replica (508) → API key (401); and `GET /v1/models` answered while cold;
//! 2. `body`: the body read whole, bounded in size, read time and memory (413, 408, 503);
//! 3. `admit`: a cold request's model (404, only with served model names), draining again,
//!    a `maxQueue` slot (429);
//! 4. a ready endpoint? forward (`forward`) : cold start, which rejects (503), holds a
//!    stream with heartbeats (`hold`), or waits silently until the activation timeout (503);
//!    a warm request that finds the engine asleep (sleeping tier) is cold from there;
//! 5. `relay`: the backend's answer passed through as it arrives.
//!
//! A cold request's body is checked for its model name before admission, so a misdirected
//! request never raises demand and never wakes a model; a ready backend answers that check
//! itself (vLLM's `404 The model ... does not exist`), so a warm request is forwarded without
//! parsing its body.

mod admit;
mod body;
mod edge;
mod forward;
mod headers;
mod hold;
mod relay;

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
    metrics::Metrics,
    reject::{self, Rejection},
};

/// The client's address, set per connection by the server loop.
#[derive(Debug, Clone, Copy)]
pub struct ClientAddr(pub std::net::SocketAddr);

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

/// Answers a refused request: counts the rejection by its reason and the request by its
/// status.
fn refuse(shared: &Shared, tracker: Tracker, rejection: Rejection) -> Response {
    shared.metrics.rejected(rejection.kind().label());
    done(tracker, rejection.into_response(shared.cfg.retry_after))
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
    let tracker = Tracker::new(shared.metrics.clone());
    let (mut parts, body) = req.into_parts();
    if let Err(rejection) = edge::check(&shared, &parts) {
        return refuse(&shared, tracker, rejection);
    }
    if let Some(resp) = edge::cold_models_list(&shared, &parts) {
        return done(tracker, resp);
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

    let cold = !shared.backends.is_ready();
    let admit::Admitted { slot, mut stream } = match admit::admit(&shared, &parts, &body, cold) {
        Ok(admitted) => admitted,
        Err(rejection) => return refuse(&shared, tracker, rejection),
    };
    let mut out = forward::Outgoing::new(&mut parts, body, held, &shared.via, peer_ip.as_ref());
    // Not kept across the wait below: it may point into hyper's read buffer.
    drop(parts);

    let deadline = arrival + shared.cfg.activation_timeout;
    let mut cold = cold;
    let sent = loop {
        if cold {
            shared.lease.raise();
            out.detach();
            match shared.cfg.cold_start {
                ColdStartMode::Reject => {
                    drop(slot);
                    return refuse(&shared, tracker, Rejection::ColdReject);
                }
                ColdStartMode::Keepalive if stream => {
                    return hold::hold_streaming(shared, out, slot, tracker, arrival, deadline);
                }
                ColdStartMode::Keepalive => {}
            }
        }
        if cold {
            break shared
                .forward::<forward::Cold>(&out, deadline, arrival)
                .await;
        }
        match shared
            .forward::<forward::Warm>(&out, deadline, arrival)
            .await
        {
            Ok(sent) => break Ok(sent),
            Err(forward::WarmError::Hold(e)) => break Err(e),
            // Sent warm to an engine another replica had put to sleep: cold from here, so the
            // cold-start mode applies (a rejection, or a held stream's heartbeats).
            Err(forward::WarmError::Asleep) => {
                // A warm request's body was not parsed: it is now, as a cold arrival's is,
                // for the served model and whether it streams (which decides its hold).
                let hints = out.hints();
                if let Err(rejection) = admit::serves(&shared, &hints) {
                    drop(slot);
                    return refuse(&shared, tracker, rejection);
                }
                stream = hints.stream;
                cold = true;
            }
        }
    };
    match sent {
        Ok((resp, backend)) => relay::relay(&shared, resp, backend, slot, tracker, arrival, cold),
        Err(forward::HoldError::Timeout) => {
            drop(slot);
            let timeout = shared.cfg.activation_timeout;
            refuse(&shared, tracker, Rejection::ActivationTimeout { timeout })
        }
        Err(forward::HoldError::Upstream(msg)) => done(tracker, reject::bad_gateway(&msg)),
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

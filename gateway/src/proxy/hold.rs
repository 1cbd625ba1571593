//! The hold step of a cold streaming request (`--cold-start=keepalive`, `"stream": true`):
//! `200` and SSE heartbeats at once, the request forwarded the moment an endpoint turns ready,
//! then the backend's stream through a [`Relay`]. The hold runs inside the response body
//! ([`HeldStream`]).

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use axum::{
    body::Body,
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::Response,
};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use http_body_util::{BodyExt, Limited};

use super::{
    Tracker,
    admit::Slot,
    forward::{BackendUse, HoldError, Outgoing},
    relay::Relay,
};
use crate::{
    gateway::Shared,
    model::Model,
    reject::{Rejection, stream_failure},
    upstream::UpstreamBody,
};

/// The SSE comment sent while a streaming request is held (RFC-compliant SSE clients ignore
/// lines starting with `:`).
pub const HEARTBEAT: &[u8] = b": hearth: waiting for a backend to become ready\n\n";

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
pub(super) fn hold_streaming(
    shared: Arc<Shared>,
    model: Arc<Model>,
    out: Outgoing,
    slot: Slot,
    tracker: Tracker,
    arrival: Instant,
    deadline: Instant,
) -> Response {
    let body = HeldStream {
        state: HeldState::Start,
        shared,
        model,
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
    /// The model it is held for: kept, with its endpoint watch, until the hold ends.
    model: Arc<Model>,
    slot: Option<Slot>,
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
    /// Waiting for a ready backend or an activation failure (`ready`), then for its answer
    /// (`forward`), sending a heartbeat on every tick. The forwarding future (~1 KiB) is only made once an endpoint
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
    /// Ends the stream with the SSE `error` event `event`.
    fn fail(&mut self, event: Bytes) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        self.state = HeldState::Done;
        self.slot = None;
        if let Some(mut t) = self.tracker.take() {
            t.finish(200);
        }
        Poll::Ready(Some(Ok(Frame::data(event))))
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
                    let mut rx = this.model.state.backends.subscribe();
                    let model = this.model.clone();
                    // Forwarding starts once an endpoint is ready, or to answer with the
                    // activation failure reported meanwhile.
                    let ready: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(async move {
                        tokio::select! {
                            _ = rx.wait_for(|eps| !eps.is_empty()) => {}
                            _ = model.discovered().failed() => {}
                        }
                    });
                    let next = tokio::time::Instant::now() + this.model.cfg.heartbeat_interval;
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
                        let (shared, model, arrival, deadline) = (
                            this.shared.clone(),
                            this.model.clone(),
                            this.arrival,
                            this.deadline,
                        );
                        *forward = Some(Box::pin(async move {
                            super::forward::cold(&shared, &model, &out, deadline, arrival).await
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
                                let hb = this.model.cfg.heartbeat_interval;
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
                                    body,
                                    tracker,
                                    200,
                                    (slot, backend),
                                    Some(this.arrival),
                                    true,
                                )
                                .first_byte_since(Some(this.arrival));
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
                            let timeout = Rejection::ActivationTimeout {
                                timeout: this.model.cfg.activation_timeout,
                            };
                            this.model.state.metrics.rejected(timeout.kind().label());
                            return this.fail(timeout.sse_event());
                        }
                        Err(HoldError::Upstream(msg)) => {
                            return this.fail(stream_failure(&msg, "bad_gateway"));
                        }
                        Err(HoldError::Adapter(e)) => return this.fail(e.sse_event()),
                        Err(HoldError::Failed(why)) => {
                            let failed = Rejection::ActivationFailed {
                                service: this.model.key().to_owned(),
                                why,
                            };
                            this.model.state.metrics.rejected(failed.kind().label());
                            return this.fail(failed.sse_event());
                        }
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
                    return this.fail(stream_failure(&msg, status.as_str()));
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
    use std::time::Duration;

    use super::*;

    /// A held stream for `GET /` on a replica whose backends are `backends`.
    fn held(backends: crate::EndpointSet) -> (Response, Arc<Shared>) {
        let cfg = crate::GatewayConfig {
            heartbeat_interval: Duration::from_millis(20),
            activation_timeout: Duration::from_millis(110),
            ..Default::default()
        };
        let shared = super::super::test_shared(cfg, backends);
        let model = super::super::the_model(&shared);
        let (mut parts, ()) = http::Request::builder()
            .uri("/")
            .header(header::HOST, "gw")
            .body(())
            .unwrap()
            .into_parts();
        let mut out = Outgoing::new(
            &mut parts,
            Bytes::new(),
            shared.budget.reservation(),
            &shared.via,
            None,
        );
        out.detach();
        let slot = Slot::of(&model).unwrap();
        let tracker = Tracker::new(model.state.metrics.clone());
        let arrival = Instant::now();
        let deadline = arrival + model.cfg.activation_timeout;
        let resp = hold_streaming(shared.clone(), model, out, slot, tracker, arrival, deadline);
        (resp, shared)
    }

    /// The body's data frames, to its end.
    async fn frames(resp: Response) -> Vec<Bytes> {
        let mut body = resp.into_body();
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            frames.push(frame.unwrap().into_data().unwrap());
        }
        frames
    }

    /// The OpenAI error in an SSE `error` event.
    fn error_of(event: &[u8]) -> serde_json::Value {
        let text = std::str::from_utf8(event).unwrap();
        let data = text.strip_prefix("event: error\ndata: ").unwrap();
        serde_json::from_str(data.trim_end()).unwrap()
    }

    #[tokio::test]
    async fn heartbeats_until_the_activation_timeout_then_one_error_event() {
        let (resp, shared) = held(crate::EndpointSet::new());
        assert_eq!(resp.status(), 200);
        assert_eq!(
            resp.headers()[header::CONTENT_TYPE],
            "text/event-stream; charset=utf-8"
        );
        let frames = frames(resp).await;
        let (last, beats) = frames.split_last().unwrap();
        assert!(beats.len() >= 3, "{} heartbeats", beats.len());
        assert!(beats.iter().all(|b| b == HEARTBEAT));
        let error = error_of(last);
        assert_eq!(error["error"]["code"], "activation_timeout");
        assert_eq!(error["error"]["type"], "server_error");
        let model = super::super::the_model(&shared);
        assert_eq!(model.state.metrics.rejected_count("activation_timeout"), 1);
        assert_eq!(model.demand().state().pending(), 0);
    }

    #[tokio::test]
    async fn an_activation_failure_ends_the_hold_before_the_timeout() {
        let backends = crate::EndpointSet::new();
        let (resp, shared) = held(backends.clone());
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, HEARTBEAT);
        backends.set_failure(Some("ImagePullFailed: pod m-1: ErrImagePull"));
        let mut rest = Vec::new();
        while let Some(frame) = body.frame().await {
            rest.push(frame.unwrap().into_data().unwrap());
        }
        let error = error_of(rest.last().unwrap());
        assert_eq!(error["error"]["code"], "activation_failed");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("ImagePullFailed: pod m-1"), "{message}");
        let model = super::super::the_model(&shared);
        assert_eq!(model.state.metrics.rejected_count("activation_failed"), 1);
        assert_eq!(model.state.metrics.rejected_count("activation_timeout"), 0);
    }

    #[tokio::test]
    async fn a_client_that_leaves_ends_the_hold() {
        let (resp, shared) = held(crate::EndpointSet::new());
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, HEARTBEAT);
        let model = super::super::the_model(&shared);
        assert_eq!(model.demand().state().pending(), 1);
        drop(body);
        assert_eq!(model.state.metrics.canceled_count(), 1);
        assert_eq!(model.demand().state().pending(), 0);
    }

    #[tokio::test]
    async fn the_stream_follows_the_first_heartbeat_once_a_backend_is_ready() {
        let backends = crate::EndpointSet::new();
        let (resp, _shared) = held(backends.clone());
        let authority = super::super::test_backend(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 9\r\n\r\ndata: 1\n\n",
        )
        .await;
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, HEARTBEAT);
        backends.replace([authority]);
        let mut rest = Vec::new();
        while let Some(frame) = body.frame().await {
            rest.push(frame.unwrap().into_data().unwrap());
        }
        assert_eq!(rest.last().map(|b| &b[..]), Some(&b"data: 1\n\n"[..]));
        assert!(rest[..rest.len() - 1].iter().all(|b| b == HEARTBEAT));
    }

    #[tokio::test]
    async fn a_backend_error_status_ends_the_stream_with_its_message() {
        let backends = crate::EndpointSet::new();
        backends.replace([super::super::test_backend(
            b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 31\r\n\r\n{\"error\": {\"message\": \"boom\"}}\n",
        )
        .await]);
        let (resp, _shared) = held(backends);
        let frames = frames(resp).await;
        assert_eq!(frames.len(), 2, "{frames:?}");
        assert_eq!(frames[0], HEARTBEAT);
        let error = error_of(&frames[1]);
        assert_eq!(error["error"]["code"], "500");
        assert_eq!(
            error["error"]["message"],
            "backend answered 500 Internal Server Error: boom"
        );
    }
}

//! The relay step: the backend's response passed to the client as it arrives, bytes
//! unchanged, with the request's accounting (status, time to first token, the tokens its
//! meter counts, the admission slot, the place in flight and the endpoint's outstanding count
//! held until the last frame).

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Instant,
};

use axum::{body::Body, http::header, response::Response};
use bytes::{Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame, SizeHint};

use super::{Tracker, admit::Slot, forward::BackendUse, headers::strip_hop_by_hop};
use crate::{metrics::ModelMetrics, reject::stream_failure, upstream::UpstreamBody};

/// Turns the backend's response into ours: status and end-to-end headers unchanged, body
/// passed through as it arrives (see [`Relay`]).
pub(super) fn relay(
    resp: hyper::Response<UpstreamBody>,
    backend: BackendUse,
    slot: Slot,
    tracker: Tracker,
    arrival: Instant,
    cold: bool,
) -> Response {
    let (mut parts, body) = resp.into_parts();
    strip_hop_by_hop(&mut parts.headers);
    // The fair queue's wait, as W3C Server Timing (after the backend's own entries, if any).
    if let Ok(v) = header::HeaderValue::from_str(&format!(
        "queue;dur={:.1}",
        backend.queued.as_secs_f64() * 1000.0
    )) {
        parts.headers.append(SERVER_TIMING, v);
    }
    // Time to first token is measured for streams, known by the answer's media type.
    let stream = parts
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    // A `200` event stream is committed once its head is sent: a backend that dies mid-stream
    // ends it with an SSE `error` event the client's SDK raises, not a cut connection.
    let committed = stream && parts.status == axum::http::StatusCode::OK;
    let relay = Relay::new(
        body,
        tracker,
        parts.status.as_u16(),
        (slot, backend),
        stream.then_some(arrival),
        committed,
    )
    .first_byte_since(cold.then_some(arrival));
    Response::from_parts(parts, Body::new(relay))
}

/// `Server-Timing` (W3C Server Timing): the answer carries `queue;dur=<ms>`, the time the
/// request waited in its model's fair queue.
pub(super) const SERVER_TIMING: header::HeaderName =
    header::HeaderName::from_static("server-timing");

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
pub(super) struct Relay {
    inner: UpstreamBody,
    tracker: Option<Tracker>,
    code: u16,
    held: Option<(Slot, BackendUse)>,
    /// Arrival time of a streaming request whose first token is not yet counted.
    ttft: Option<Instant>,
    /// Arrival time of a cold request (held for an activation or a wake-up) whose first
    /// forwarded byte is not yet counted (`hearth_activation_phase_seconds{phase="first_byte"}`).
    first_byte: Option<Instant>,
    /// The request's model's series.
    metrics: Arc<ModelMetrics>,
    /// Data taken from `inner` and not yet returned.
    acc: Acc,
    /// A non-data outcome of `inner` that came after `acc`'s data, returned next.
    stash: Option<Option<Result<Frame<Bytes>, hyper::Error>>>,
    /// The `200` of an event stream is committed (a held one's from its first heartbeat, a
    /// relayed one's with the backend's head): a backend failure becomes an SSE `error` event
    /// and the end of the stream, trailers are dropped.
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
    pub(super) fn new(
        inner: UpstreamBody,
        tracker: Tracker,
        code: u16,
        held: (Slot, BackendUse),
        ttft: Option<Instant>,
        committed: bool,
    ) -> Self {
        let metrics = tracker.metrics.clone();
        let mut relay = Self {
            inner,
            tracker: Some(tracker),
            code,
            held: Some(held),
            ttft,
            first_byte: None,
            metrics,
            acc: Acc::Empty,
            stash: None,
            committed,
        };
        if relay.inner.is_end_stream() {
            relay.complete();
        }
        relay
    }

    /// Counts the time from `arrival` (a cold request's) until the first byte of the answer is
    /// forwarded, as the activation phase `first_byte`; `None` counts nothing.
    pub(super) fn first_byte_since(mut self, arrival: Option<Instant>) -> Self {
        self.first_byte = arrival;
        self
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
                    self.acc.push(stream_failure(&msg, "bad_gateway"));
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
                            this.metrics.ttft(start.elapsed().as_secs_f64());
                        }
                        if let Some(start) = this.first_byte.take() {
                            this.metrics
                                .observe_phase("first_byte", start.elapsed().as_secs_f64());
                        }
                        if let Some((_, backend)) = &mut this.held {
                            backend.meter.observe(&data);
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use http_body_util::BodyExt;

    use super::{
        super::forward::{Outgoing, Warm},
        *,
    };
    use crate::gateway::Shared;

    #[test]
    fn one_chunk_passes_on_uncopied_and_several_are_joined() {
        let mut acc = Acc::Empty;
        let first = Bytes::from_static(b"data: 1\n\n");
        acc.push(first.clone());
        let taken = acc.take().unwrap();
        assert_eq!(taken.as_ptr(), first.as_ptr());
        assert!(acc.take().is_none());
        acc.push(first);
        acc.push(Bytes::from_static(b"data: 2\n\n"));
        acc.push(Bytes::from_static(b"data: 3\n\n"));
        assert_eq!(acc.len(), 27);
        assert_eq!(acc.take().unwrap(), "data: 1\n\ndata: 2\n\ndata: 3\n\n");
    }

    /// The relay of the backend's answer to one `GET /`, and the replica.
    async fn relayed(response: &'static [u8]) -> (Response, Arc<Shared>) {
        relayed_as(response, false).await
    }

    /// [`relayed`], for a request that arrived `cold` (held for an activation).
    async fn relayed_as(response: &'static [u8], cold: bool) -> (Response, Arc<Shared>) {
        let authority = super::super::test_backend(response).await;
        let shared = super::super::test_shared(
            crate::GatewayConfig::default(),
            crate::EndpointSet::fixed([authority]),
        );
        let (mut parts, ()) = http::Request::builder()
            .uri("/")
            .header(header::HOST, "gw")
            .body(())
            .unwrap()
            .into_parts();
        let out = Outgoing::new(
            &mut parts,
            Bytes::new(),
            shared.budget.reservation(),
            &shared.via,
            None,
        );
        let arrival = Instant::now();
        let deadline = arrival + Duration::from_secs(5);
        let model = super::super::the_model(&shared);
        let Ok((resp, backend)) =
            super::super::forward::forward::<Warm>(&shared, &model, &out, deadline, arrival).await
        else {
            panic!("not forwarded")
        };
        let slot = Slot::of(&model).unwrap();
        let tracker = Tracker::new(model.state.metrics.clone());
        (relay(resp, backend, slot, tracker, arrival, cold), shared)
    }

    /// The exposition after relaying one JSON answer to a request that arrived `cold` or not.
    async fn metrics_after_answer(cold: bool) -> String {
        let (resp, shared) = relayed_as(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
            cold,
        )
        .await;
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "{}");
        shared.metrics.encode()
    }

    #[tokio::test]
    async fn a_cold_request_counts_its_first_forwarded_byte_as_an_activation_phase() {
        let text = metrics_after_answer(true).await;
        assert!(
            text.contains("hearth_activation_phase_seconds_count{phase=\"first_byte\"} 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_warm_request_counts_no_first_byte_phase() {
        let text = metrics_after_answer(false).await;
        assert!(!text.contains("phase=\"first_byte\""), "{text}");
    }

    fn count(shared: &Shared, code: u16) -> u64 {
        super::super::the_model(shared)
            .state
            .metrics
            .finished_count(code)
    }

    #[tokio::test]
    async fn arrived_chunks_go_out_as_one_write_and_the_request_is_counted() {
        let (resp, shared) = relayed(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: keep-alive, x-hop\r\nx-hop: 1\r\ntransfer-encoding: chunked\r\n\r\n\
              9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n9\r\ndata: 3\n\n\r\n0\r\n\r\n",
        )
        .await;
        assert_eq!(resp.status(), 200);
        assert!(
            !resp.headers().contains_key("x-hop"),
            "hop-by-hop fields removed"
        );
        let model = super::super::the_model(&shared);
        assert_eq!(model.demand().state().pending(), 1);
        let mut body = resp.into_body();
        let mut frames = Vec::new();
        while let Some(frame) = body.frame().await {
            frames.push(frame.unwrap().into_data().unwrap());
        }
        assert_eq!(frames, ["data: 1\n\ndata: 2\n\ndata: 3\n\n"]);
        assert_eq!(count(&shared, 200), 1);
        assert_eq!(
            model.demand().state().pending(),
            0,
            "the slot is given back"
        );
        let text = shared.metrics.encode();
        assert!(
            text.contains("hearth_gateway_time_to_first_token_seconds_count 1"),
            "{text}"
        );
    }

    #[tokio::test]
    async fn a_client_that_leaves_mid_stream_is_counted_as_canceled() {
        let (resp, shared) = relayed(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n",
        )
        .await;
        let mut body = resp.into_body();
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "data: 1\n\n");
        drop(body);
        let model = super::super::the_model(&shared);
        assert_eq!(model.state.metrics.canceled_count(), 1);
        assert_eq!(count(&shared, 200), 0);
        assert_eq!(model.demand().state().pending(), 0);
    }
}

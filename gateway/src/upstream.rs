//! Connections to backends: HTTP/1.1 over TCP, kept alive in one idle pool per endpoint.
//!
//! Each HTTP worker thread has its own pool, and a connection has no task of its own: the
//! request that uses it drives its I/O, first while sending and waiting for the response
//! head ([`UpstreamPool::send`]), then from the response body ([`UpstreamBody`]). A request,
//! its backend exchange and its response are therefore served by one task on one thread,
//! without wake-ups between tasks.
//!
//! A connection goes back to the pool when its response body has been read to its end and it
//! can take the next request at once; one dropped earlier (the client left mid-stream) closes,
//! which is how vLLM learns to stop generating. (A backend may answer before reading a large
//! request body and then stop reading: that connection is closed, never pooled.) A request that an idle connection could not take (the backend had closed it)
//! is resent on another connection. One that was sent is resent only when its method is
//! idempotent and the reused connection closed before any answer (RFC 9112 §9.3.1, RFC 9110
//! §9.2.2): this pool never sends a `POST` twice. (The proxy sends a request once more when
//! the engine answered `404` for a LoRA adapter it had lost, before anything reached the
//! client: `crate::adapters`.)

use std::{
    collections::{HashMap, VecDeque},
    future::{Future, poll_fn},
    pin::{Pin, pin},
    sync::{Arc, Mutex},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use bytes::{Bytes, BytesMut};
use http::{Method, Request, Response, uri::Authority};
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::Full;
use hyper::{
    body::Incoming,
    client::conn::{TrySendError, http1},
};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

/// Idle connections kept per endpoint; more are closed when they come back.
const MAX_IDLE_PER_ENDPOINT: usize = 1024;

/// Why a request did not get a response head from the backend.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// No connection could be made (refused, unreachable, DNS, or the connect timeout): the
    /// request was not sent, so it may be sent again.
    #[error("connecting to {authority}: {source}")]
    Connect {
        /// The endpoint.
        authority: Authority,
        /// The cause.
        source: std::io::Error,
    },
    /// The exchange failed after the request may have been sent.
    #[error("{0}")]
    Request(#[from] hyper::Error),
}

impl UpstreamError {
    /// Whether no connection was made (see [`UpstreamError::Connect`]).
    pub fn is_connect(&self) -> bool {
        matches!(self, UpstreamError::Connect { .. })
    }
}

/// Methods a client may retry on its own (RFC 9110 §9.2.2).
fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Whether `e` says the connection closed under a request before any answer came: the backend
/// closed it (end of stream) or reset it, as one does at the end of its keep-alive timeout.
fn closed_before_answer(e: &hyper::Error) -> bool {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
    e.is_incomplete_message()
        || std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<std::io::Error>())
            .is_some_and(|io| matches!(io.kind(), ConnectionReset | BrokenPipe | ConnectionAborted))
}

fn copy(req: &Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    let mut c = Request::new(req.body().clone());
    *c.method_mut() = req.method().clone();
    *c.uri_mut() = req.uri().clone();
    *c.version_mut() = req.version();
    *c.headers_mut() = req.headers().clone();
    c
}

/// hyper's state machine for one connection: it reads, writes and parses when polled.
type Driver = http1::Connection<TokioIo<TcpStream>, Full<Bytes>>;

/// One backend connection: hyper's handle to send on it and the state machine that whoever
/// uses the connection drives.
struct Conn {
    sender: http1::SendRequest<Full<Bytes>>,
    /// `None` once the connection has ended.
    driver: Option<Driver>,
}

impl Conn {
    /// Moves the connection's I/O along as far as it can go without waiting; `false` once the
    /// connection has ended (closed by either side, or failed).
    fn drive(&mut self, cx: &mut Context<'_>) -> bool {
        let Some(driver) = self.driver.as_mut() else {
            return false;
        };
        match Pin::new(driver).poll(cx) {
            Poll::Pending => true,
            Poll::Ready(r) => {
                if let Err(e) = r {
                    tracing::debug!(error = %e, "backend connection ended");
                }
                self.driver = None;
                false
            }
        }
    }

    /// Whether the connection can take a request now, without waiting: it has not ended and
    /// hyper is done with the previous exchange. One still writing a request body the backend
    /// stopped reading (it answered early, say `413`, and kept the connection open) is not: it
    /// might never be, so it must not be pooled or reused.
    fn is_ready(&mut self) -> bool {
        let mut cx = Context::from_waker(Waker::noop());
        // hyper's connection asks for the next request once it is polled in its idle state.
        self.drive(&mut cx) && matches!(self.sender.poll_ready(&mut cx), Poll::Ready(Ok(())))
    }

    /// Sends `req` and waits for the response head, driving the connection meanwhile.
    async fn exchange(
        &mut self,
        req: Request<Full<Bytes>>,
    ) -> Result<Response<Incoming>, TrySendError<Request<Full<Bytes>>>> {
        let mut answer = pin!(self.sender.try_send_request(req));
        poll_fn(|cx| {
            self.drive(cx);
            answer.as_mut().poll(cx)
        })
        .await
    }
}

struct Idle {
    conn: Conn,
    since: Instant,
}

struct Inner {
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<HashMap<Authority, Vec<Idle>>>,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamPool")
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish_non_exhaustive()
    }
}

/// A pool of keep-alive HTTP/1.1 connections to backends, by endpoint authority. Cheap to
/// clone (shared).
#[derive(Debug, Clone)]
pub struct UpstreamPool {
    inner: Arc<Inner>,
}

/// A backend's response body. Polling it drives the connection it arrives on; once it has
/// been read to its end (the last data frame, trailers, or an empty body) the connection goes
/// back to its pool. Dropped before that, it closes the connection.
pub struct UpstreamBody {
    inner: Incoming,
    /// The connection, until it is returned or closed.
    conn: Option<Conn>,
    authority: Authority,
    pool: UpstreamPool,
    /// Frames [`UpstreamBody::peek`] read, given before the rest.
    front: VecDeque<Frame<Bytes>>,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("authority", &self.authority)
            .field("open", &self.conn.is_some())
            .finish_non_exhaustive()
    }
}

impl UpstreamBody {
    fn release(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.put(self.authority.clone(), conn);
        }
    }

    /// Reads the body's first `limit` bytes or so (all of it when shorter: an error answer),
    /// waiting at most `timeout`, to look at them. What was read stays in the body and is
    /// given first when it is polled next: the body passes on unchanged.
    ///
    /// # Errors
    /// The body failed (the connection broke); the body is not to be used any more.
    pub async fn peek(&mut self, limit: usize, timeout: Duration) -> Result<Bytes, hyper::Error> {
        let mut seen = BytesMut::new();
        let read = async {
            while seen.len() < limit && !self.inner.is_end_stream() {
                let Some(frame) = poll_fn(|cx| self.poll_inner(cx)).await else {
                    break;
                };
                let frame = frame?;
                if let Some(data) = frame.data_ref() {
                    seen.extend_from_slice(data);
                }
                let last = frame.is_trailers();
                self.front.push_back(frame);
                if last {
                    break;
                }
            }
            Ok(())
        };
        if let Ok(Err(e)) = tokio::time::timeout(timeout, read).await {
            return Err(e);
        }
        Ok(seen.freeze())
    }

    /// Polls the backend's body itself (not the frames [`UpstreamBody::peek`] kept), driving
    /// its connection, and gives the connection back once the body has ended.
    fn poll_inner(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self;
        // What the connection has already read reaches `inner` first.
        if let Some(conn) = this.conn.as_mut() {
            conn.drive(cx);
        }
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Err(_))) => this.conn = None,
            Poll::Ready(None) => this.release(),
            // Trailers are the last part of a message (RFC 9112 §7.1.2).
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() || this.inner.is_end_stream() => {
                this.release()
            }
            _ => {}
        }
        polled
    }
}

impl HttpBody for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        match self.front.pop_front() {
            Some(frame) => Poll::Ready(Some(Ok(frame))),
            None => self.poll_inner(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.front.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let front: u64 = self
            .front
            .iter()
            .filter_map(Frame::data_ref)
            .map(|d| d.len() as u64)
            .sum();
        if front == 0 {
            return inner;
        }
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower() + front);
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper + front);
        }
        hint
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        if self.inner.is_end_stream() {
            self.release();
        }
    }
}

impl UpstreamPool {
    /// A pool whose connections give up connecting after `connect_timeout` and close after
    /// `idle_timeout` unused (see [`UpstreamPool::evict_idle`]).
    pub fn new(connect_timeout: Duration, idle_timeout: Duration) -> Self {
        Self {
            inner: Arc::new(Inner {
                connect_timeout,
                idle_timeout,
                idle: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Sends `req` (origin-form target, `Host` set) to `authority` on an idle connection or a
    /// new one, and returns the response head; its body carries the connection (see
    /// [`UpstreamBody`]).
    ///
    /// # Errors
    /// [`UpstreamError::Connect`] when no connection could be made; [`UpstreamError::Request`]
    /// when the exchange failed (the backend may have seen the request).
    pub async fn send(
        &self,
        authority: &Authority,
        mut req: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, UpstreamError> {
        while let Some(mut conn) = self.take_idle(authority) {
            // A copy to resend if the backend closes this connection under the request.
            let again = is_idempotent(req.method()).then(|| copy(&req));
            match conn.exchange(req).await {
                Ok(resp) => return Ok(self.response(authority, resp, conn)),
                Err(mut e) => match (e.take_message(), again) {
                    // Not sent: the connection was closing. Try the next one.
                    (Some(back), _) => req = back,
                    (None, Some(copy)) if closed_before_answer(e.error()) => req = copy,
                    (None, _) => return Err(UpstreamError::Request(e.into_error())),
                },
            }
        }
        let mut conn = self.connect(authority).await?;
        let resp = conn.exchange(req).await.map_err(TrySendError::into_error)?;
        Ok(self.response(authority, resp, conn))
    }

    fn response(
        &self,
        authority: &Authority,
        resp: Response<Incoming>,
        conn: Conn,
    ) -> Response<UpstreamBody> {
        resp.map(|inner| {
            let mut body = UpstreamBody {
                inner,
                conn: Some(conn),
                authority: authority.clone(),
                pool: self.clone(),
                front: VecDeque::new(),
            };
            if body.inner.is_end_stream() {
                body.release();
            }
            body
        })
    }

    fn take_idle(&self, authority: &Authority) -> Option<Conn> {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(authority)?;
        // Most recently used first: it is the least likely to have been closed by the backend.
        let now = Instant::now();
        while let Some(mut c) = list.pop() {
            if now.duration_since(c.since) < self.inner.idle_timeout && c.conn.is_ready() {
                return Some(c.conn);
            }
        }
        None
    }

    fn put(&self, authority: Authority, mut conn: Conn) {
        if !conn.is_ready() {
            return;
        }
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(authority).or_default();
        if list.len() < MAX_IDLE_PER_ENDPOINT {
            list.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    async fn connect(&self, authority: &Authority) -> Result<Conn, UpstreamError> {
        let err = |source| UpstreamError::Connect {
            authority: authority.clone(),
            source,
        };
        let port = authority.port_u16().unwrap_or(80);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let stream =
            tokio::time::timeout(self.inner.connect_timeout, TcpStream::connect((host, port)))
                .await
                .map_err(|_| {
                    err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("no connection within {:?}", self.inner.connect_timeout),
                    ))
                })?
                .map_err(err)?;
        stream.set_nodelay(true).map_err(err)?;
        let (sender, driver) = http1::handshake(TokioIo::new(stream)).await?;
        Ok(Conn {
            sender,
            driver: Some(driver),
        })
    }

    /// Closes connections idle for longer than the idle timeout or already closed by the
    /// backend, and forgets endpoints with none left. The gateway calls it every second from its
    /// main runtime, for every pool.
    pub fn evict_idle(&self) {
        let now = Instant::now();
        let timeout = self.inner.idle_timeout;
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|_, list| {
            list.retain_mut(|c| now.duration_since(c.since) < timeout && c.conn.is_ready());
            !list.is_empty()
        });
    }

    /// Idle connections to `authority` (for tests and metrics).
    pub fn idle_count(&self, authority: &Authority) -> usize {
        let idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.get(authority).map_or(0, Vec::len)
    }
}

//! Connections to backends: HTTP/1.1 over TCP, kept alive in one idle pool per endpoint.
//!
//! Each HTTP worker thread has its own pool, so a request, its backend connection and its
//! response are served by one thread. A connection is checked out for one exchange and comes
//! back only when the response body has been read to its end ([`PooledConn::release`]); one
//! dropped earlier (the client left mid-stream) closes, which is how vLLM learns to stop
//! generating. A request that an idle connection could not take (the backend had closed it)
//! is resent on another connection. One that was sent is resent only when its method is
//! idempotent and the reused connection closed before any answer (RFC 9112 §9.3.1, RFC 9110
//! §9.2.2): a `POST` reaches the backend at most once.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use bytes::Bytes;
use http::{Method, Request, Response, uri::Authority};
use http_body_util::Full;
use hyper::{body::Incoming, client::conn::http1::SendRequest};
use hyper_util::rt::TokioIo;

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

fn copy(req: &Request<Full<Bytes>>) -> Request<Full<Bytes>> {
    let mut c = Request::new(req.body().clone());
    *c.method_mut() = req.method().clone();
    *c.uri_mut() = req.uri().clone();
    *c.version_mut() = req.version();
    *c.headers_mut() = req.headers().clone();
    c
}

struct Idle {
    sender: SendRequest<Full<Bytes>>,
    since: Instant,
}

#[derive(Debug)]
struct Inner {
    connect_timeout: Duration,
    idle_timeout: Duration,
    idle: Mutex<HashMap<Authority, Vec<Idle>>>,
}

impl std::fmt::Debug for Idle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idle").field("since", &self.since).finish()
    }
}

/// A pool of keep-alive HTTP/1.1 connections to backends, by endpoint authority. Cheap to
/// clone (shared).
#[derive(Debug, Clone)]
pub struct UpstreamPool {
    inner: Arc<Inner>,
}

/// A connection checked out for one exchange. [`PooledConn::release`] returns it once the
/// response has been read whole; dropping it instead closes the connection.
#[derive(Debug)]
pub struct PooledConn {
    sender: SendRequest<Full<Bytes>>,
    authority: Authority,
    pool: UpstreamPool,
}

impl PooledConn {
    /// Returns the connection to its pool (after the response body ended).
    pub fn release(self) {
        if !self.sender.is_closed() {
            self.pool.put(self.authority, self.sender);
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
    /// new one, and returns the response head with the connection it arrived on.
    ///
    /// # Errors
    /// [`UpstreamError::Connect`] when no connection could be made; [`UpstreamError::Request`]
    /// when the exchange failed (the backend may have seen the request).
    pub async fn send(
        &self,
        authority: &Authority,
        mut req: Request<Full<Bytes>>,
    ) -> Result<(Response<Incoming>, PooledConn), UpstreamError> {
        while let Some(mut sender) = self.take_idle(authority) {
            if sender.ready().await.is_err() {
                continue;
            }
            // A copy to resend if the backend closes this connection under the request.
            let again = is_idempotent(req.method()).then(|| copy(&req));
            match sender.try_send_request(req).await {
                Ok(resp) => return Ok((resp, self.conn(authority, sender))),
                Err(mut e) => match (e.take_message(), again) {
                    // Not sent: the connection was closing. Try the next one.
                    (Some(back), _) => req = back,
                    (None, Some(copy)) if e.error().is_incomplete_message() => req = copy,
                    (None, _) => return Err(UpstreamError::Request(e.into_error())),
                },
            }
        }
        let mut sender = self.connect(authority).await?;
        let resp = sender.send_request(req).await?;
        Ok((resp, self.conn(authority, sender)))
    }

    fn conn(&self, authority: &Authority, sender: SendRequest<Full<Bytes>>) -> PooledConn {
        PooledConn {
            sender,
            authority: authority.clone(),
            pool: self.clone(),
        }
    }

    fn take_idle(&self, authority: &Authority) -> Option<SendRequest<Full<Bytes>>> {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(authority)?;
        // Most recently used first: it is the least likely to have been closed by the backend.
        let now = Instant::now();
        while let Some(c) = list.pop() {
            if !c.sender.is_closed() && now.duration_since(c.since) < self.inner.idle_timeout {
                return Some(c.sender);
            }
        }
        None
    }

    fn put(&self, authority: Authority, sender: SendRequest<Full<Bytes>>) {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.entry(authority).or_default();
        if list.len() < MAX_IDLE_PER_ENDPOINT {
            list.push(Idle {
                sender,
                since: Instant::now(),
            });
        }
    }

    async fn connect(
        &self,
        authority: &Authority,
    ) -> Result<SendRequest<Full<Bytes>>, UpstreamError> {
        let err = |source| UpstreamError::Connect {
            authority: authority.clone(),
            source,
        };
        let port = authority.port_u16().unwrap_or(80);
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        let stream = tokio::time::timeout(
            self.inner.connect_timeout,
            tokio::net::TcpStream::connect((host, port)),
        )
        .await
        .map_err(|_| {
            err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no connection within {:?}", self.inner.connect_timeout),
            ))
        })?
        .map_err(err)?;
        stream.set_nodelay(true).map_err(err)?;
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        let peer = authority.clone();
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(endpoint = %peer, error = %e, "backend connection ended");
            }
        });
        Ok(sender)
    }

    /// Closes connections idle for longer than the idle timeout or already closed by the
    /// backend, and forgets endpoints with none left. The gateway calls it every second from its
    /// main runtime, for every pool.
    pub fn evict_idle(&self) {
        let now = Instant::now();
        let timeout = self.inner.idle_timeout;
        let mut idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.retain(|_, list| {
            list.retain(|c| !c.sender.is_closed() && now.duration_since(c.since) < timeout);
            !list.is_empty()
        });
    }

    /// Idle connections to `authority` (for tests and metrics).
    pub fn idle_count(&self, authority: &Authority) -> usize {
        let idle = self.inner.idle.lock().unwrap_or_else(|e| e.into_inner());
        idle.get(authority).map_or(0, Vec::len)
    }
}

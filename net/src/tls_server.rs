//! The HTTPS accept loop of Hearth's TLS servers (the webhook's admission server, the
//! controller's and the webhook's authenticated `/metrics`): rustls in front of an axum
//! router, HTTP/1.1 and HTTP/2 by ALPN, every client-controlled wait bounded, and a graceful
//! drain on shutdown.
//!
//! Bounds ([`ServeLimits`]): a TLS handshake must finish within `handshake_timeout` and
//! HTTP/1 request headers arrive within `header_timeout`, or the connection is closed; at
//! most `max_connections` connections are served at once (more wait in the accept queue); a
//! failing `accept(2)` (`EMFILE`) backs off 50 ms instead of spinning.
//!
//! Shutdown drains before it closes: the listener is dropped (new connections are refused),
//! then for up to `drain_timeout` every HTTP/1.1 answer carries `Connection: close`, so each
//! client retires its pooled connection after its next answer instead of meeting a connection
//! closed under a request it is sending (the apiserver does not resend a non-idempotent POST);
//! HTTP/2 clients get a GOAWAY. What is still open after the window is closed once its request
//! in flight is answered, waiting at most `last_request_timeout`.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::http::{HeaderValue, header};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use rustls::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;

/// The bounds of [`serve`]; durations are wall-clock.
#[derive(Debug, Clone, Copy)]
pub struct ServeLimits {
    /// Connections served at once (at least 1).
    pub max_connections: usize,
    /// Time allowed for a TLS handshake.
    pub handshake_timeout: Duration,
    /// Time allowed for HTTP/1 request headers, also between requests on a kept-alive
    /// connection (hyper's `header_read_timeout`): it is how long an idle pooled connection
    /// stays open, so it must outlast the clients' own idle timeout (client-go's 90 s,
    /// Prometheus' 5 min) or a client's request can meet the close.
    pub header_timeout: Duration,
    /// On shutdown, how long open connections are closed after their next answer before the
    /// rest are closed.
    pub drain_timeout: Duration,
    /// After the drain, how long the requests still in flight may take.
    pub last_request_timeout: Duration,
}

impl Default for ServeLimits {
    /// 256 connections, 10 s for a handshake, 360 s for headers (idle connections included),
    /// a 10 s drain, 15 s for the last requests.
    fn default() -> Self {
        Self {
            max_connections: 256,
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(360),
            drain_timeout: Duration::from_secs(10),
            last_request_timeout: Duration::from_secs(15),
        }
    }
}

/// Serves `app` over TLS on `listener` until `shutdown` completes, then drains (see the module
/// documentation) and returns once the last connection is closed or the bounds pass.
pub async fn serve(
    listener: TcpListener,
    tls: Arc<ServerConfig>,
    app: Router,
    limits: ServeLimits,
    shutdown: impl Future<Output = ()>,
) {
    let acceptor = TlsAcceptor::from(tls);
    let graceful = GracefulShutdown::new();
    let max_connections = limits.max_connections.clamp(1, u32::MAX as usize);
    let permits = Arc::new(Semaphore::new(max_connections));
    let draining = Arc::new(AtomicBool::new(false));
    let app = app.layer(axum::middleware::from_fn({
        let draining = draining.clone();
        move |req: axum::extract::Request, next: axum::middleware::Next| {
            let draining = draining.clone();
            async move {
                let http1 = req.version() < axum::http::Version::HTTP_2;
                let mut res = next.run(req).await;
                if http1 && draining.load(Ordering::Relaxed) {
                    res.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                res
            }
        }
    }));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout);
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)))
        .keep_alive_timeout(Duration::from_secs(10))
        .max_concurrent_streams(256);
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let permit = tokio::select! {
            p = permits.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            () = &mut shutdown => break,
        };
        let (tcp, peer): (_, SocketAddr) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let app = app.clone();
        let builder = builder.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let tls =
                match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, error = %e, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            let conn = builder.serve_connection(TokioIo::new(tls), TowerToHyperService::new(app));
            if let Err(e) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    // Refuse new connections, then let open ones retire after their next answer.
    drop(listener);
    draining.store(true, Ordering::Relaxed);
    let open = max_connections - permits.available_permits();
    tracing::info!(open, drain = ?limits.drain_timeout, "draining connections");
    let all = u32::try_from(max_connections).unwrap_or(u32::MAX);
    let drained = tokio::time::timeout(limits.drain_timeout, permits.acquire_many(all)).await;
    if drained.is_err() {
        let open = max_connections - permits.available_permits();
        tracing::info!(open, "closing connections still open after the drain");
    }
    // Close what is left once its request in flight is answered, bounded.
    let _ = tokio::time::timeout(limits.last_request_timeout, graceful.shutdown()).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_connections_outlive_client_go_and_prometheus_pools() {
        // client-go's IdleConnTimeout (90 s) and Prometheus' scrape client (5 min).
        assert!(ServeLimits::default().header_timeout > Duration::from_secs(300));
    }
}

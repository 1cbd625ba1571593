//! A tiny HTTP/1.1 server that answers every GET with `{"value": <n>}`: the endpoint a KEDA
//! `metrics-api` trigger polls (`valueLocation: value`). KEDA runs in the cluster, so the server
//! binds the host end of the real node's link, which pods reach.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// Largest request head read before answering.
const MAX_REQUEST_HEAD: usize = 16 * 1024;

/// Serves a number that the test changes with [`MetricServer::set`]. Stops when dropped.
pub struct MetricServer {
    addr: SocketAddr,
    value: Arc<AtomicU64>,
    requests: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl MetricServer {
    /// Binds `ip` (an address of this host; pods reach the node's host IP) on a free port and
    /// serves `initial` until changed.
    pub async fn start(ip: &str, initial: u64) -> Result<Self> {
        let listener = TcpListener::bind((ip, 0))
            .await
            .with_context(|| format!("binding the metric server on {ip}"))?;
        let addr = listener.local_addr()?;
        let value = Arc::new(AtomicU64::new(initial));
        let requests = Arc::new(AtomicU64::new(0));
        let (v, r) = (value.clone(), requests.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (v, r) = (v.clone(), r.clone());
                tokio::spawn(async move {
                    // A client that hangs up early is no concern of the test.
                    let _ = serve(stream, &v, &r).await;
                });
            }
        });
        Ok(Self {
            addr,
            value,
            requests,
            task,
        })
    }

    /// The URL to put in the trigger's `url`.
    pub fn url(&self) -> String {
        format!("http://{}/metric", self.addr)
    }

    /// Changes the value served from the next request on.
    pub fn set(&self, value: u64) {
        self.value.store(value, Ordering::SeqCst);
    }

    /// How many requests were received so far.
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::SeqCst)
    }
}

impl Drop for MetricServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads an HTTP/1 request head (up to the blank line) of at most 16 KiB; `None` when the client
/// hangs up first or sends more.
pub(crate) async fn read_request_head(stream: &mut TcpStream) -> Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf).await?;
        if n == 0 || head.len() + n > MAX_REQUEST_HEAD {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
    }
    Ok(Some(head))
}

async fn serve(mut stream: TcpStream, value: &AtomicU64, requests: &AtomicU64) -> Result<()> {
    if read_request_head(&mut stream).await?.is_none() {
        return Ok(());
    }
    requests.fetch_add(1, Ordering::SeqCst);
    let body = format!("{{\"value\": {}}}", value.load(Ordering::SeqCst));
    let response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn get(server: &MetricServer) -> String {
        let mut stream = TcpStream::connect(server.addr).await.unwrap();
        stream
            .write_all(b"GET /metric HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        stream.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn serves_the_current_value() {
        let server = MetricServer::start("127.0.0.1", 3).await.unwrap();
        assert!(get(&server).await.ends_with("\r\n\r\n{\"value\": 3}"));
        server.set(0);
        let response = get(&server).await;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.ends_with("{\"value\": 0}"), "{response}");
        assert_eq!(server.requests(), 2);
        assert!(server.url().starts_with("http://127.0.0.1:"));
    }
}

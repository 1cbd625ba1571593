//! A raw HTTP/1.1 backend for adversarial tests: it records the exact request heads and bodies
//! it receives and answers what the test says, byte for byte.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    time::timeout,
};

use super::accept_each;

/// What a raw backend does after reading one request.
pub enum Reply {
    /// Write the bytes, keep the connection for the next request.
    Keep(Vec<u8>),
    /// Write the bytes, then close (FIN).
    Close(Vec<u8>),
    /// Write the bytes, then reset (RST).
    Reset(Vec<u8>),
    /// Write the bytes, then close after the delay (an idle timeout on the backend).
    CloseAfter(Vec<u8>, Duration),
    /// Write the pieces with a pause between them, keep the connection.
    Pieces(Vec<Vec<u8>>, Duration),
}

/// A request as a raw backend read it: head (request line and fields) and body.
pub type Received = (String, Vec<u8>);

#[derive(Clone)]
pub struct Raw {
    pub addr: SocketAddr,
    pub conns: Arc<AtomicUsize>,
    /// Request heads (request line + fields) and bodies, in arrival order.
    pub reqs: Arc<Mutex<Vec<Received>>>,
}

impl Raw {
    pub fn authority(&self) -> http::uri::Authority {
        self.addr.to_string().parse().unwrap()
    }
    pub fn count(&self) -> usize {
        self.reqs.lock().unwrap().len()
    }
    pub fn conns(&self) -> usize {
        self.conns.load(Ordering::SeqCst)
    }
}

/// Reads one request (head + Content-Length body). None on EOF.
pub async fn read_request(s: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let len = head
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.trim()
                        .eq_ignore_ascii_case("content-length")
                        .then(|| v.trim().parse::<usize>().ok())?
                })
                .unwrap_or(0);
            let start = end + 4;
            while buf.len() < start + len {
                let mut tmp = [0u8; 8192];
                let n = s.read(&mut tmp).await.ok()?;
                if n == 0 {
                    return None;
                }
                buf.extend_from_slice(&tmp[..n]);
            }
            let body = buf[start..start + len].to_vec();
            buf.drain(..start + len);
            return Some((head, body));
        }
        let mut tmp = [0u8; 8192];
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

pub async fn raw_backend<F>(f: F) -> Raw
where
    F: Fn(usize, &str) -> Reply + Send + Sync + 'static,
{
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let raw = Raw {
        addr: l.local_addr().unwrap(),
        conns: Arc::default(),
        reqs: Arc::default(),
    };
    let f = Arc::new(f);
    let r = raw.clone();
    accept_each(l, move |_, mut s| {
        r.conns.fetch_add(1, Ordering::SeqCst);
        let (f, r) = (f.clone(), r.clone());
        async move {
            let mut buf = Vec::new();
            let mut idle: Option<Duration> = None;
            loop {
                let next = match idle.take() {
                    // A real keep-alive timeout: a request arriving in time is served.
                    Some(d) => match timeout(d, read_request(&mut s, &mut buf)).await {
                        Ok(r) => r,
                        Err(_) => return,
                    },
                    None => read_request(&mut s, &mut buf).await,
                };
                let Some((head, body)) = next else { return };
                let i = {
                    let mut reqs = r.reqs.lock().unwrap();
                    reqs.push((head.clone(), body));
                    reqs.len() - 1
                };
                match f(i, &head) {
                    Reply::Keep(b) => {
                        if s.write_all(&b).await.is_err() {
                            return;
                        }
                    }
                    Reply::Close(b) => {
                        let _ = s.write_all(&b).await;
                        let _ = s.shutdown().await;
                        return;
                    }
                    Reply::Reset(b) => {
                        let _ = s.write_all(&b).await;
                        let _ = s.set_zero_linger();
                        return;
                    }
                    Reply::CloseAfter(b, d) => {
                        if s.write_all(&b).await.is_err() {
                            return;
                        }
                        idle = Some(d);
                    }
                    Reply::Pieces(pieces, d) => {
                        for p in pieces {
                            if s.write_all(&p).await.is_err() {
                                return;
                            }
                            tokio::time::sleep(d).await;
                        }
                    }
                }
            }
        }
    });
    raw
}

pub fn ok(body: &str, extra: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n{extra}\r\n{body}",
        body.len()
    )
    .into_bytes()
}

//! The body step: the request body read whole and bounded, in size (`--body-limit`), read
//! time (`--body-read-timeout`) and the replica's memory for bodies (`--body-memory-limit`),
//! so it can be forwarded whole after activation.

use std::{pin::Pin, task::Poll, time::Duration};

use axum::http::{HeaderMap, header};
use bytes::{Bytes, BytesMut};
use http_body::Body as HttpBody;

use crate::{budget::Reservation, gateway::Shared, reject::Rejection};

/// Why the body step gives no body.
pub(super) enum Unread {
    /// The gateway refuses the request.
    Refused(Rejection),
    /// The client closed or reset the connection first: nobody reads an answer, and the
    /// request counts as canceled.
    Gone,
}

/// Reads `body` whole, its size taken from `headers` (`Content-Length`) when declared: a
/// declared size over `--body-limit` is refused before anything is read.
pub(super) async fn read<B>(
    shared: &Shared,
    headers: &HeaderMap,
    body: B,
) -> Result<(Bytes, Reservation), Unread>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limit = shared.cfg.body_limit;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let read = if declared.is_some_and(|n| n > limit as u64) {
        Err(BodyError::TooLarge)
    } else {
        read_body(
            body,
            declared,
            limit,
            &shared.budget,
            &shared.timer,
            shared.cfg.body_read_timeout,
        )
        .await
    };
    read.map_err(|e| e.unread(shared))
}

/// Why a request body was not read whole.
enum BodyError {
    /// Over the gateway's limit.
    TooLarge,
    /// The replica already holds `--body-memory-limit` bytes of bodies.
    OverBudget,
    /// Not complete within the body read timeout.
    Timeout,
    /// The client closed or reset the connection first.
    Gone,
    /// Broken framing (a bad chunk, say).
    Malformed(String),
}

impl BodyError {
    /// What the request gets for it.
    fn unread(self, shared: &Shared) -> Unread {
        Unread::Refused(match self {
            BodyError::TooLarge => Rejection::BodyTooLarge {
                limit: shared.cfg.body_limit,
            },
            BodyError::OverBudget => Rejection::BodyMemory {
                limit: shared.budget.limit(),
            },
            BodyError::Timeout => Rejection::BodyTimeout {
                timeout: shared.cfg.body_read_timeout,
            },
            BodyError::Malformed(error) => {
                tracing::debug!(%error, "malformed request body");
                Rejection::MalformedBody { error }
            }
            BodyError::Gone => return Unread::Gone,
        })
    }
}

/// Reads a request body whole into one buffer, at most `limit` bytes, within `timeout` of the
/// first wait for more, its bytes taken from `budget` as they arrive.
///
/// One buffer, not one entry per frame: a body sent as many tiny chunks would otherwise cost
/// far more memory than its bytes, and pin hyper's read buffers. A body that arrives in one
/// frame (the usual small request) is kept as it is, and one that is complete without waiting
/// arms no timer.
async fn read_body<B>(
    body: B,
    declared: Option<u64>,
    limit: usize,
    budget: &crate::budget::BodyBudget,
    timer: &crate::timer::CoarseTimer,
    timeout: Duration,
) -> Result<(Bytes, Reservation), BodyError>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    use hyper::rt::Timer as _;
    let mut body = std::pin::pin!(body);
    let mut first: Option<Bytes> = None;
    let mut rest: Option<BytesMut> = None;
    let mut len = 0usize;
    let mut held = budget.reservation();
    // A declared length is taken from the budget at once, as the buffer is allocated at that
    // size; bytes past what was taken (a chunked body) are taken as they arrive.
    let mut taken = declared.map_or(0, |n| usize::try_from(n).unwrap_or(usize::MAX));
    if !budget.reserve(&mut held, taken) {
        return Err(BodyError::OverBudget);
    }
    let mut deadline: Option<Pin<Box<dyn hyper::rt::Sleep>>> = None;
    std::future::poll_fn(|cx| {
        loop {
            match body.as_mut().poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let Ok(data) = frame.into_data() else {
                        continue; // trailers: not forwarded
                    };
                    len += data.len();
                    if len > limit {
                        return Poll::Ready(Err(BodyError::TooLarge));
                    }
                    if len > taken {
                        if !budget.reserve(&mut held, len - taken) {
                            return Poll::Ready(Err(BodyError::OverBudget));
                        }
                        taken = len;
                    }
                    match (&mut first, &mut rest) {
                        (None, None) => first = Some(data),
                        (Some(f), None) => {
                            let cap = declared.map_or(len, |n| n as usize).clamp(len, limit);
                            let mut buf = BytesMut::with_capacity(cap);
                            buf.extend_from_slice(f);
                            buf.extend_from_slice(&data);
                            first = None;
                            rest = Some(buf);
                        }
                        (_, Some(buf)) => buf.extend_from_slice(&data),
                    }
                }
                Poll::Ready(Some(Err(e))) => {
                    let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                    return Poll::Ready(Err(body_read_error(&*e)));
                }
                Poll::Ready(None) => return Poll::Ready(Ok(())),
                Poll::Pending => {
                    let sleep = deadline.get_or_insert_with(|| timer.sleep(timeout));
                    return match sleep.as_mut().poll(cx) {
                        Poll::Ready(()) => Poll::Ready(Err(BodyError::Timeout)),
                        Poll::Pending => Poll::Pending,
                    };
                }
            }
        }
    })
    .await?;
    let body = match (first, rest) {
        (_, Some(buf)) => buf.freeze(),
        (Some(f), None) => f,
        (None, None) => Bytes::new(),
    };
    Ok((body, held))
}

/// Tells a client that left (closed or reset mid-body) from a body that is broken.
fn body_read_error(e: &(dyn std::error::Error + 'static)) -> BodyError {
    use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset, UnexpectedEof};
    let mut source = Some(e);
    while let Some(err) = source {
        if err
            .downcast_ref::<hyper::Error>()
            .is_some_and(|h| h.is_incomplete_message() || h.is_closed() || h.is_canceled())
            || err.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    ConnectionReset | BrokenPipe | ConnectionAborted | UnexpectedEof
                )
            })
        {
            return BodyError::Gone;
        }
        source = err.source();
    }
    BodyError::Malformed(e.to_string())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http_body::Frame;
    use http_body_util::Full;

    use super::*;

    /// A frame's bytes that count how many frames are still alive.
    struct Counted(Arc<std::sync::atomic::AtomicUsize>, [u8; 1]);

    impl AsRef<[u8]> for Counted {
        fn as_ref(&self) -> &[u8] {
            &self.1
        }
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// A body of the frames given.
    type Frames = http_body_util::StreamBody<
        futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, std::io::Error>>>,
    >;

    /// A body of `n` one-byte frames, and the count of frames still alive.
    fn frames(n: usize) -> (Frames, Arc<std::sync::atomic::AtomicUsize>) {
        let live = Arc::new(std::sync::atomic::AtomicUsize::new(n));
        let frames: Vec<_> = (0..n)
            .map(|_| {
                Ok(Frame::data(Bytes::from_owner(Counted(
                    live.clone(),
                    [b'x'],
                ))))
            })
            .collect();
        (
            http_body_util::StreamBody::new(futures::stream::iter(frames)),
            live,
        )
    }

    #[tokio::test]
    async fn a_body_of_many_frames_is_one_buffer_and_keeps_no_frame() {
        let timer = crate::timer::CoarseTimer::new().unwrap();
        let budget = crate::budget::BodyBudget::new(1 << 20);
        let (body, live) = frames(10_000);
        let out = read_body(body, None, 1 << 20, &budget, &timer, Duration::from_secs(5))
            .await
            .unwrap_or_else(|_| panic!("read failed"));
        let (out, held) = out;
        assert_eq!(out.len(), 10_000);
        assert_eq!(budget.held(), 10_000);
        // Each frame was copied and released: a body of tiny chunks costs its bytes, not a
        // buffer (or a list entry) per chunk.
        assert_eq!(live.load(std::sync::atomic::Ordering::SeqCst), 0);
        drop(held);
        assert_eq!(budget.held(), 0);
    }

    #[tokio::test]
    async fn a_body_in_one_frame_is_not_copied_and_the_limit_holds() {
        let timer = crate::timer::CoarseTimer::new().unwrap();
        let budget = crate::budget::BodyBudget::new(1 << 20);
        let data = Bytes::from_static(b"{\"model\":\"m\"}");
        let body = Full::new(data.clone());
        let out = read_body(
            body,
            Some(13),
            1 << 20,
            &budget,
            &timer,
            Duration::from_secs(5),
        )
        .await
        .unwrap_or_else(|_| panic!("read failed"));
        assert_eq!(out.0.as_ptr(), data.as_ptr());
        let (body, _) = frames(11);
        assert!(matches!(
            read_body(body, None, 10, &budget, &timer, Duration::from_secs(5)).await,
            Err(BodyError::TooLarge)
        ));
    }

    /// What the body step gives `body` sent with `content_length`, under `cfg`.
    async fn step<B>(
        cfg: crate::GatewayConfig,
        content_length: Option<u64>,
        body: B,
    ) -> (Result<(Bytes, Reservation), Unread>, Arc<Shared>)
    where
        B: HttpBody<Data = Bytes>,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let shared = super::super::test_shared(cfg, crate::EndpointSet::new());
        let mut headers = HeaderMap::new();
        if let Some(n) = content_length {
            headers.insert(header::CONTENT_LENGTH, n.into());
        }
        (read(&shared, &headers, body).await, shared)
    }

    fn refused(r: Result<(Bytes, Reservation), Unread>) -> Rejection {
        match r {
            Err(Unread::Refused(r)) => r,
            Ok(_) => panic!("read"),
            Err(Unread::Gone) => panic!("gone"),
        }
    }

    /// A body that fails with `e` after one chunk.
    fn failing(e: std::io::Error) -> Frames {
        http_body_util::StreamBody::new(futures::stream::iter(vec![
            Ok(Frame::data(Bytes::from_static(b"{"))),
            Err(e),
        ]))
    }

    fn config(body_limit: usize, body_memory_limit: usize) -> crate::GatewayConfig {
        crate::GatewayConfig {
            body_limit,
            body_memory_limit,
            body_read_timeout: Duration::ZERO,
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn a_body_is_read_whole_and_held_in_the_budget() {
        let (r, shared) = step(
            config(100, 100),
            Some(2),
            Full::new(Bytes::from_static(b"{}")),
        )
        .await;
        let Ok((body, held)) = r else {
            panic!("not read")
        };
        assert_eq!(body, "{}");
        assert_eq!(shared.budget.held(), 2);
        drop(held);
        assert_eq!(shared.budget.held(), 0);
    }

    #[tokio::test]
    async fn a_declared_size_over_the_limit_is_refused_before_reading() {
        let (r, shared) = step(
            config(10, 100),
            Some(11),
            Full::new(Bytes::from_static(b"x")),
        )
        .await;
        assert_eq!(refused(r), Rejection::BodyTooLarge { limit: 10 });
        assert_eq!(shared.budget.held(), 0);
        // The same answer when the size shows only while reading.
        let (r, _) = step(
            config(10, 100),
            None,
            Full::new(Bytes::from(vec![b'x'; 11])),
        )
        .await;
        assert_eq!(refused(r), Rejection::BodyTooLarge { limit: 10 });
    }

    #[tokio::test]
    async fn bodies_past_the_memory_limit_are_refused() {
        let (r, shared) = step(
            config(100, 4),
            Some(5),
            Full::new(Bytes::from_static(b"12345")),
        )
        .await;
        assert_eq!(refused(r), Rejection::BodyMemory { limit: 4 });
        assert_eq!(shared.budget.held(), 0);
        let (r, _) = step(
            config(100, 4),
            None,
            Full::new(Bytes::from_static(b"12345")),
        )
        .await;
        assert_eq!(refused(r), Rejection::BodyMemory { limit: 4 });
    }

    #[tokio::test]
    async fn a_body_that_stalls_is_refused_at_the_read_timeout() {
        let stalled = http_body_util::StreamBody::new(futures::stream::pending::<
            Result<Frame<Bytes>, std::io::Error>,
        >());
        let (r, shared) = step(config(100, 100), Some(10), stalled).await;
        assert_eq!(
            refused(r),
            Rejection::BodyTimeout {
                timeout: Duration::ZERO
            }
        );
        assert_eq!(shared.budget.held(), 0);
    }

    #[tokio::test]
    async fn a_client_that_leaves_is_gone_and_a_broken_body_is_refused() {
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let (r, shared) = step(config(100, 100), None, failing(reset)).await;
        assert!(matches!(r, Err(Unread::Gone)));
        assert_eq!(shared.budget.held(), 0);
        let (r, _) = step(
            config(100, 100),
            None,
            failing(std::io::Error::other("bad chunk")),
        )
        .await;
        assert_eq!(
            refused(r),
            Rejection::MalformedBody {
                error: "bad chunk".into()
            }
        );
    }
}

//! An OpenAI chat client for the suites: sends a (streaming) chat completion and records, with
//! the time of arrival, each SSE heartbeat comment, token, error event and the end.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::json;

/// What arrived on a response, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// An SSE comment line (`: ...`): the gateway's keepalive while the backend wakes.
    Heartbeat,
    /// The content of one `chat.completion.chunk` delta.
    Token(String),
    /// An `event: error` (or a chunk with an `error` object), with its message.
    Error(String),
    /// `data: [DONE]`.
    Done,
}

/// One request's outcome.
#[derive(Clone, Debug)]
pub struct Trace {
    pub sent: Instant,
    /// When the status line and headers arrived.
    pub head: Instant,
    pub status: u16,
    /// The `Retry-After` header, if any.
    pub retry_after: Option<String>,
    pub events: Vec<(Instant, Event)>,
    /// The whole body of a non-streaming answer (empty for streams).
    pub body: String,
    /// When the body ended.
    pub end: Instant,
}

impl Trace {
    /// The tokens, concatenated.
    pub fn text(&self) -> String {
        self.events
            .iter()
            .filter_map(|(_, e)| match e {
                Event::Token(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }
    /// How many heartbeats came before the first token.
    pub fn heartbeats(&self) -> usize {
        self.events
            .iter()
            .filter(|(_, e)| *e == Event::Heartbeat)
            .count()
    }
    /// Arrival of the first token.
    pub fn first_token(&self) -> Option<Instant> {
        self.events
            .iter()
            .find(|(_, e)| matches!(e, Event::Token(_)))
            .map(|(t, _)| *t)
    }
    /// Arrival of the last token.
    pub fn last_token(&self) -> Option<Instant> {
        self.events
            .iter()
            .rev()
            .find(|(_, e)| matches!(e, Event::Token(_)))
            .map(|(t, _)| *t)
    }
    /// Whether the stream ended with `data: [DONE]` and no error event.
    pub fn complete(&self) -> bool {
        self.events.last().map(|(_, e)| e) == Some(&Event::Done)
            && !self
                .events
                .iter()
                .any(|(_, e)| matches!(e, Event::Error(_)))
    }
}

/// Errors of [`chat`].
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("request to {url} failed: {source:?}")]
    Request {
        url: String,
        source: hyper_util::client::legacy::Error,
    },
    #[error("reading the response body of {url} failed: {source}")]
    Body { url: String, source: hyper::Error },
    #[error("no complete response from {url} within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// Posts a chat completion for `model` to `base` (like `http://stub-svc.ns.svc`) and records
/// the answer; `stream` asks for SSE. The whole exchange is bounded by `timeout`.
pub async fn chat(
    base: &str,
    model: &str,
    stream: bool,
    timeout: Duration,
) -> Result<Trace, ChatError> {
    chat_with(base, model, stream, None, timeout).await
}

/// [`chat`] with OpenAI's `max_tokens` (the stub generates exactly that many tokens).
pub async fn chat_with(
    base: &str,
    model: &str,
    stream: bool,
    max_tokens: Option<u32>,
    timeout: Duration,
) -> Result<Trace, ChatError> {
    let url = format!("{}/v1/chat/completions", base.trim_end_matches('/'));
    let mut body = json!({
        "model": model,
        "stream": stream,
        "messages": [{"role": "user", "content": "Say hello."}],
    });
    if let Some(n) = max_tokens {
        body["max_tokens"] = json!(n);
    }
    let req = http::Request::post(&url)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .map_err(|e| ChatError::Invalid(e.to_string()))?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let sent = Instant::now();
    let work = async {
        let resp = client
            .request(req)
            .await
            .map_err(|source| ChatError::Request {
                url: url.clone(),
                source,
            })?;
        let head = Instant::now();
        let status = resp.status().as_u16();
        let retry_after = resp
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let mut body = resp.into_body();
        let mut events = Vec::new();
        let mut pending = String::new();
        let mut whole = String::new();
        let mut sse_event = String::new();
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|source| ChatError::Body {
                url: url.clone(),
                source,
            })?;
            let Some(data) = frame.data_ref() else {
                continue;
            };
            let now = Instant::now();
            let text = String::from_utf8_lossy(data);
            if !stream {
                whole.push_str(&text);
                continue;
            }
            pending.push_str(&text);
            while let Some(i) = pending.find('\n') {
                let line = pending[..i].trim_end_matches('\r').to_string();
                pending.drain(..=i);
                if line.starts_with(':') {
                    events.push((now, Event::Heartbeat));
                } else if let Some(ev) = line.strip_prefix("event:") {
                    sse_event = ev.trim().to_string();
                } else if let Some(d) = line.strip_prefix("data:") {
                    let d = d.trim();
                    if d == "[DONE]" {
                        events.push((now, Event::Done));
                        continue;
                    }
                    let v: serde_json::Value = serde_json::from_str(d).unwrap_or_default();
                    if sse_event == "error" || v.get("error").is_some() {
                        let msg = v["error"]["message"].as_str().unwrap_or(d).to_string();
                        events.push((now, Event::Error(msg)));
                    } else if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
                        events.push((now, Event::Token(t.to_string())));
                    }
                } else if line.is_empty() {
                    sse_event.clear();
                }
            }
        }
        Ok(Trace {
            sent,
            head,
            status,
            retry_after,
            events,
            body: whole,
            end: Instant::now(),
        })
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ChatError::Timeout {
            url: url.clone(),
            timeout,
        })?
}

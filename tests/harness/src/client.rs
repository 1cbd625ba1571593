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
    /// The response's header fields.
    pub headers: http::HeaderMap,
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
    /// How many tokens arrived (after `since`, when given).
    pub fn tokens(&self, since: Option<Instant>) -> usize {
        self.events
            .iter()
            .filter(|(at, e)| matches!(e, Event::Token(_)) && since.is_none_or(|s| *at > s))
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
    chat_with_headers(base, model, stream, max_tokens, &[], timeout).await
}

/// [`chat_with`] with extra request headers (`Authorization`, say).
pub async fn chat_with_headers(
    base: &str,
    model: &str,
    stream: bool,
    max_tokens: Option<u32>,
    headers: &[(&str, &str)],
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
    let mut req = http::Request::post(&url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
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
        let headers = resp.headers().clone();
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
            headers,
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

/// GETs `url` and returns the status and body (for `/metrics` and `/health` of pods, which the
/// host reaches at their pod IPs through its route into the node).
pub async fn get(url: &str, timeout: Duration) -> Result<(u16, String), ChatError> {
    get_with_headers(url, &[], timeout).await
}

/// [`get`] with extra request headers.
pub async fn get_with_headers(
    url: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<(u16, String), ChatError> {
    send(http::Method::GET, url, headers, timeout).await
}

/// POSTs an empty body to `url` and returns the status and body (the stub's `/stub/oom`).
pub async fn post(url: &str, timeout: Duration) -> Result<(u16, String), ChatError> {
    send(http::Method::POST, url, &[], timeout).await
}

async fn send(
    method: http::Method,
    url: &str,
    headers: &[(&str, &str)],
    timeout: Duration,
) -> Result<(u16, String), ChatError> {
    let mut req = http::Request::builder().method(method).uri(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(Bytes::new()))
        .map_err(|e| ChatError::Invalid(e.to_string()))?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let work = async {
        let resp = client
            .request(req)
            .await
            .map_err(|source| ChatError::Request {
                url: url.to_string(),
                source,
            })?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|source| ChatError::Body {
                url: url.to_string(),
                source,
            })?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| ChatError::Timeout {
            url: url.to_string(),
            timeout,
        })?
}

/// The value of a Prometheus gauge or counter without labels (or the sum over its label sets)
/// in a text exposition; None when absent.
pub fn metric_value(text: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let series_name = series.split('{').next().unwrap_or(series);
        if series_name == name
            && let Ok(v) = value.parse::<f64>()
        {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::metric_value;

    #[test]
    fn metric_value_sums_label_sets_and_skips_comments() {
        let text = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{model_name=\"a\"} 1\n\
                    vllm:num_requests_running{model_name=\"b\"} 2\n\
                    \n\
                    vllm:num_requests_waiting 0\n";
        assert_eq!(metric_value(text, "vllm:num_requests_running"), Some(3.0));
        assert_eq!(metric_value(text, "vllm:num_requests_waiting"), Some(0.0));
        assert_eq!(metric_value(text, "vllm:kv_cache_usage_perc"), None);
    }
}

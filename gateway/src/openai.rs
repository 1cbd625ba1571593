//! OpenAI-style error responses and the few request fields the gateway reads.
//!
//! Errors follow the OpenAI API's error object: `{"error": {"message", "type", "param",
//! "code"}}`, so OpenAI SDKs surface the gateway's own refusals the same way as the model's.

use axum::{
    body::Body,
    http::{HeaderValue, StatusCode, header},
    response::Response,
};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;

/// The JSON bytes of an OpenAI error object.
pub fn error_json(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    Bytes::from(
        json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
            .to_string(),
    )
}

/// A complete error response with an OpenAI error body.
pub fn error_response(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response {
    let mut resp = Response::new(Body::from(error_json(message, kind, code)));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// Adds `Retry-After: <seconds>` (RFC 9110 §10.2.3), at least one second.
pub fn with_retry_after(mut resp: Response, after: std::time::Duration) -> Response {
    let secs = after.as_secs_f64().ceil().max(1.0) as u64;
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(secs));
    resp
}

/// The SSE event a committed stream ends with when the gateway itself fails it:
/// `event: error` and a `data:` line holding an OpenAI error object (OpenAI SDKs raise an
/// `APIError` for either form).
pub fn sse_error_event(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    let body = error_json(message, kind, code);
    let mut out = Vec::with_capacity(body.len() + 24);
    out.extend_from_slice(b"event: error\ndata: ");
    out.extend_from_slice(&body);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The request fields that change how the gateway handles a cold request: `stream` (hold with
/// SSE heartbeats or silently) and `model` (checked against the served model names before
/// waking a backend).
#[derive(Debug, Default)]
pub struct RequestHints {
    /// OpenAI's `stream`: the response is a `text/event-stream` of chunks.
    pub stream: bool,
    /// OpenAI's `model`.
    pub model: Option<String>,
}

impl RequestHints {
    /// Reads the hints from a JSON body; a body that is not a JSON object yields the defaults
    /// (the backend then answers with its own validation error).
    pub fn from_body(body: &[u8]) -> Self {
        /// Borrowed where the JSON allows it; any other field is skipped unparsed.
        #[derive(Deserialize)]
        struct Loose<'a> {
            #[serde(default, borrow)]
            stream: Option<&'a serde_json::value::RawValue>,
            #[serde(default, borrow)]
            model: Option<&'a serde_json::value::RawValue>,
        }
        match serde_json::from_slice::<Loose<'_>>(body) {
            Ok(l) => Self {
                stream: l.stream.is_some_and(|v| v.get() == "true"),
                model: l
                    .model
                    .and_then(|v| serde_json::from_str::<String>(v.get()).ok()),
            },
            Err(_) => Self::default(),
        }
    }

    /// The hints of a request: read from the body when it is declared JSON, or is a `POST`
    /// body starting with `{` (clients that omit `Content-Type`); the defaults otherwise.
    pub fn from_request(method: &http::Method, headers: &http::HeaderMap, body: &[u8]) -> Self {
        let is_json = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim_start().starts_with("application/json"));
        if is_json || (method == http::Method::POST && body.first() == Some(&b'{')) {
            Self::from_body(body)
        } else {
            Self::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_read_stream_and_model() {
        let h = RequestHints::from_body(br#"{"model":"m","stream":true,"messages":[]}"#);
        assert!(h.stream);
        assert_eq!(h.model.as_deref(), Some("m"));
    }

    #[test]
    fn hints_tolerate_other_shapes() {
        let h = RequestHints::from_body(br#"{"model":3,"stream":"yes"}"#);
        assert!(!h.stream);
        assert_eq!(h.model, None);
        let h = RequestHints::from_body(b"not json");
        assert!(!h.stream);
        let h = RequestHints::from_body(b"[1,2]");
        assert!(!h.stream);
    }

    #[test]
    fn error_event_is_one_sse_event() {
        let ev = sse_error_event("timed out", "server_error", Some("activation_timeout"));
        let s = std::str::from_utf8(&ev).unwrap();
        assert!(s.starts_with("event: error\ndata: {"));
        assert!(s.ends_with("}\n\n"));
        let data: serde_json::Value =
            serde_json::from_str(s.trim_end().strip_prefix("event: error\ndata: ").unwrap())
                .unwrap();
        assert_eq!(data["error"]["code"], "activation_timeout");
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let r = with_retry_after(
            error_response(StatusCode::SERVICE_UNAVAILABLE, "x", "server_error", None),
            std::time::Duration::from_millis(1500),
        );
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        let r = with_retry_after(
            error_response(StatusCode::SERVICE_UNAVAILABLE, "x", "server_error", None),
            std::time::Duration::ZERO,
        );
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
    }
}

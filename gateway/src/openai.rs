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
use serde_json::json;

/// The JSON bytes of an OpenAI error object (`param: null`).
pub fn error_json(message: &str, kind: &str, code: Option<&str>) -> Bytes {
    error_json_param(message, kind, None, code)
}

/// The JSON bytes of an OpenAI error object naming the request field at fault in `param`.
pub fn error_json_param(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Bytes {
    Bytes::from(
        json!({"error": {"message": message, "type": kind, "param": param, "code": code}})
            .to_string(),
    )
}

/// A complete error response with an OpenAI error body (`param: null`).
pub fn error_response(
    status: StatusCode,
    message: &str,
    kind: &str,
    code: Option<&str>,
) -> Response {
    error_response_param(status, message, kind, None, code)
}

/// A complete error response with an OpenAI error body naming the field at fault in `param`.
pub fn error_response_param(
    status: StatusCode,
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Response {
    let mut resp = Response::new(Body::from(error_json_param(message, kind, param, code)));
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
    sse_error_event_param(message, kind, None, code)
}

/// [`sse_error_event`] naming the request field at fault in `param`.
pub fn sse_error_event_param(
    message: &str,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Bytes {
    let body = error_json_param(message, kind, param, code);
    let mut out = Vec::with_capacity(body.len() + 24);
    out.extend_from_slice(b"event: error\ndata: ");
    out.extend_from_slice(&body);
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// The request fields that change how the gateway handles a cold request: `stream` (hold with
/// SSE heartbeats or silently) and `model` (checked against the served model names before
/// waking a backend).
///
/// They are read as vLLM's OpenAI server (FastAPI and pydantic) reads them, so the gateway and
/// the model agree: a body without `Content-Type`, or with a JSON media type (`application/json`,
/// `application/*+json`, any case), is JSON; a byte order mark and white space may precede it;
/// of a repeated key the last one counts; `stream` is a pydantic bool (`true`, `1`, `"yes"`,
/// `"on"`, ...). Only `POST`, `PUT` and `PATCH` bodies count. Not matched: Python's `NaN` and
/// `Infinity` literals and UTF-16/32 bodies, which Python's `json` reads and JSON (RFC 8259)
/// does not allow; such a body gets the defaults.
#[derive(Debug, Default)]
pub struct RequestHints {
    /// OpenAI's `stream`: the response is a `text/event-stream` of chunks.
    pub stream: bool,
    /// OpenAI's `model`.
    pub model: Option<String>,
    /// OpenAI's `max_completion_tokens`, else `max_tokens`: the completion tokens asked for.
    pub max_tokens: Option<u64>,
}

impl RequestHints {
    /// Reads the hints from a JSON body; a body that is not a JSON object yields the defaults
    /// (the backend then answers with its own validation error).
    pub fn from_body(body: &[u8]) -> Self {
        let body = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
        // Values borrowed, so the messages are not copied; a later key replaces an earlier one,
        // as in Python's `json`.
        let Ok(fields) = serde_json::from_slice::<
            std::collections::HashMap<std::borrow::Cow<'_, str>, &serde_json::value::RawValue>,
        >(body) else {
            return Self::default();
        };
        Self {
            stream: fields.get("stream").is_some_and(|v| lax_true(v.get())),
            model: fields
                .get("model")
                .and_then(|v| serde_json::from_str::<String>(v.get()).ok()),
            max_tokens: ["max_completion_tokens", "max_tokens"]
                .iter()
                .find_map(|k| fields.get(*k).and_then(|v| v.get().parse::<u64>().ok())),
        }
    }

    /// The hints of a request: read from the body of a `POST`, `PUT` or `PATCH` that is JSON as
    /// FastAPI decides (no `Content-Type`, or a JSON media type); the defaults otherwise.
    pub fn from_request(method: &http::Method, headers: &http::HeaderMap, body: &[u8]) -> Self {
        if !matches!(
            *method,
            http::Method::POST | http::Method::PUT | http::Method::PATCH
        ) {
            return Self::default();
        }
        // An empty value is read as no value, as FastAPI does (`if not content_type`).
        let content_type = headers
            .get(header::CONTENT_TYPE)
            .filter(|v| !v.as_bytes().trim_ascii().is_empty());
        let is_json = content_type.is_none_or(|v| {
            let media = v
                .as_bytes()
                .split(|b| *b == b';')
                .next()
                .unwrap_or_default();
            let media = String::from_utf8_lossy(media.trim_ascii()).to_ascii_lowercase();
            media
                .strip_prefix("application/")
                .is_some_and(|sub| sub == "json" || sub.ends_with("+json"))
        });
        if is_json {
            Self::from_body(body)
        } else {
            Self::default()
        }
    }
}

/// `body` (a JSON object) with its `model` set to `name`: the bytes of the value vLLM reads (the
/// last `model` key, as [`RequestHints::from_body`] reads it) replaced by `name` as a JSON
/// string, everything else unchanged. `None` when the body has no string `model` (then
/// nothing is renamed and the engine answers as it would).
///
/// Used for a model's aliases (`spec.model.aliases`): the engine serves only the service's
/// name, so a request naming an alias is forwarded under that name, as the Gateway API
/// inference extension rewrites a request's model.
pub fn with_model(body: &[u8], name: &str) -> Option<Bytes> {
    let start = body.strip_prefix(b"\xEF\xBB\xBF").unwrap_or(body);
    let fields = serde_json::from_slice::<
        std::collections::HashMap<std::borrow::Cow<'_, str>, &serde_json::value::RawValue>,
    >(start)
    .ok()?;
    let raw = fields.get("model")?.get();
    serde_json::from_str::<String>(raw).ok()?;
    // The raw value borrows from `body`: its offset is where the old value starts.
    let at = (raw.as_ptr() as usize).checked_sub(body.as_ptr() as usize)?;
    let end = at.checked_add(raw.len()).filter(|e| *e <= body.len())?;
    let quoted = serde_json::to_vec(name).ok()?;
    let mut out = Vec::with_capacity(body.len() - raw.len() + quoted.len());
    out.extend_from_slice(&body[..at]);
    out.extend_from_slice(&quoted);
    out.extend_from_slice(&body[end..]);
    Some(out.into())
}

/// Whether a JSON value is true as a pydantic (v2, lax) `bool` reads it: `true`, `1`, `1.0`,
/// or one of the strings `1`, `on`, `t`, `true`, `y`, `yes` in any case.
fn lax_true(raw: &str) -> bool {
    match serde_json::from_str::<serde_json::Value>(raw) {
        Ok(serde_json::Value::Bool(b)) => b,
        Ok(serde_json::Value::Number(n)) => n.as_f64() == Some(1.0),
        Ok(serde_json::Value::String(s)) => matches!(
            s.to_ascii_lowercase().as_str(),
            "1" | "on" | "t" | "true" | "y" | "yes"
        ),
        _ => false,
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
    fn hints_are_read_as_vllm_reads_them() {
        // (body, stream, model) as FastAPI + pydantic see them.
        for (body, stream, model) in [
            (&br#"{"stream":false,"stream":true}"#[..], true, None),
            (br#"{"model":"m","model":"other"}"#, false, Some("other")),
            (br#"{"stream":"true"}"#, true, None),
            (br#"{"stream":"YES"}"#, true, None),
            (br#"{"stream":1}"#, true, None),
            (br#"{"stream":0}"#, false, None),
            (br#"{"stream":"no"}"#, false, None),
            (br#"{"stream":null}"#, false, None),
            (
                b"\xEF\xBB\xBF{\"stream\":true,\"model\":\"m\"}",
                true,
                Some("m"),
            ),
            (b" \n\t{\"stream\":true}", true, None),
            (br#"{"model":"other"} x"#, false, None),
        ] {
            let h = RequestHints::from_body(body);
            let shown = String::from_utf8_lossy(body);
            assert_eq!(h.stream, stream, "{shown}");
            assert_eq!(h.model.as_deref(), model, "{shown}");
        }
    }

    #[test]
    fn with_model_replaces_the_value_vllm_reads_and_nothing_else() {
        for (body, out) in [
            (
                &br#"{"model":"Qwen/Qwen2.5","messages":[{"role":"user","content":"model"}]}"#[..],
                Some(&br#"{"model":"chat","messages":[{"role":"user","content":"model"}]}"#[..]),
            ),
            // The last key is the one vLLM reads.
            (
                br#"{"model":"a", "model" : "b" ,"stream":true}"#,
                Some(br#"{"model":"a", "model" : "chat" ,"stream":true}"#),
            ),
            (
                b"\xEF\xBB\xBF{\"model\":\"a\"}",
                Some(b"\xEF\xBB\xBF{\"model\":\"chat\"}"),
            ),
            (br#"{"model":"\u0061"}"#, Some(br#"{"model":"chat"}"#)),
            (br#"{"model":3}"#, None),
            (br#"{"messages":[]}"#, None),
            (b"not json", None),
            (br#"["model"]"#, None),
        ] {
            let got = with_model(body, "chat");
            assert_eq!(got.as_deref(), out, "{}", String::from_utf8_lossy(body));
        }
        let quoted = with_model(br#"{"model":"a"}"#, "x\"y").unwrap();
        assert_eq!(
            RequestHints::from_body(&quoted).model.as_deref(),
            Some("x\"y")
        );
    }

    #[test]
    fn a_json_body_is_what_fastapi_reads_as_json() {
        let body = br#"{"stream":true}"#;
        let post = http::Method::POST;
        let with = |ct: Option<&str>| {
            let mut h = http::HeaderMap::new();
            if let Some(ct) = ct {
                h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            }
            RequestHints::from_request(&post, &h, body).stream
        };
        assert!(with(None));
        assert!(with(Some("")), "an empty Content-Type is no Content-Type");
        assert!(with(Some("application/json")));
        assert!(with(Some(" Application/JSON; charset=utf-8")));
        assert!(with(Some("application/vnd.api+json")));
        assert!(!with(Some("text/plain")));
        assert!(!with(Some("application/x-www-form-urlencoded")));
        let h = http::HeaderMap::new();
        assert!(!RequestHints::from_request(&http::Method::HEAD, &h, body).stream);
        assert!(!RequestHints::from_request(&http::Method::GET, &h, body).stream);
    }

    #[test]
    fn hints_tolerate_other_shapes() {
        let h = RequestHints::from_body(br#"{"model":3,"stream":"maybe"}"#);
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

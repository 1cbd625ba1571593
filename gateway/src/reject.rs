//! The gateway's own refusals: one [`Rejection`] per way the gateway answers a proxied request
//! itself instead of forwarding it, and the one conversion to the OpenAI error response
//! ([`Rejection::into_response`]).
//!
//! The answer's shape belongs to the rejection's [`RejectionKind`]: status, OpenAI error
//! `type` and `code`, the `hearth_gateway_rejections_total{reason}` label, `Retry-After`,
//! `Connection: close` and any other header. The variant's fields give the message. The table
//! "Rejections" in `docs/gateway.md` lists the same facts; a test holds the two equal.
//!
//! Two answers are not rejections (not counted in `hearth_gateway_rejections_total`): a backend
//! failure ([`bad_gateway`], [`stream_failure`]) and a body the client stopped sending
//! ([`body_unread`]).

use std::time::Duration;

use axum::{
    http::{HeaderName, HeaderValue, Method, StatusCode, header},
    response::Response,
};
use bytes::Bytes;

use crate::openai::{
    error_response, error_response_param, sse_error_event, sse_error_event_param, with_retry_after,
};

/// Methods the gateway forwards, for `Allow` (RFC 9110 §10.2.1).
pub const ALLOWED_METHODS: &str = "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS";

/// Declares [`RejectionKind`] and its [`RejectionKind::ALL`] and [`RejectionKind::label`] from
/// one list, so no kind can be left out of either.
macro_rules! kinds {
    ($($(#[doc = $doc:literal])* $kind:ident => $label:literal,)*) => {
        /// What a [`Rejection`] is, without its details: the facts of its answer.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum RejectionKind {
            $($(#[doc = $doc])* $kind,)*
        }

        impl RejectionKind {
            /// Every kind, in the order of the request path.
            pub const ALL: &'static [RejectionKind] = &[$(RejectionKind::$kind,)*];

            /// The `reason` label of `hearth_gateway_rejections_total`. Two kinds share
            /// `bad_request` (a refused header section, a broken body).
            pub const fn label(self) -> &'static str {
                match self {
                    $(RejectionKind::$kind => $label,)*
                }
            }
        }
    };
}

kinds! {
    /// The gateway drains (after SIGTERM).
    Draining => "draining",
    /// `CONNECT` or `TRACE`.
    MethodNotAllowed => "method_not_allowed",
    /// A header section the gateway must not forward (see [`BadRequest`]).
    BadRequest => "bad_request",
    /// A `Transfer-Encoding` other than `chunked`.
    UnsupportedTransferCoding => "unsupported_transfer_coding",
    /// The request already passed through this replica (`Via`).
    LoopDetected => "loop_detected",
    /// No API key, or one that is not in the key file.
    Unauthorized => "unauthorized",
    /// A body over `--body-limit`.
    BodyTooLarge => "body_too_large",
    /// The bodies held would pass `--body-memory-limit`.
    BodyMemory => "body_memory",
    /// The body did not arrive within `--body-read-timeout`.
    BodyTimeout => "body_timeout",
    /// The body's framing is broken (a bad chunk, say).
    MalformedBody => "bad_request",
    /// Shared mode: the request names no `model` to route it by.
    ModelRequired => "model_required",
    /// The request names a model that is not served (a single-service gateway checks a cold
    /// request only; a shared one every request).
    UnknownModel => "unknown_model",
    /// The request names a LoRA adapter its engines cannot load yet (its route's
    /// `unavailable`: its files are still being fetched, or the fetch failed).
    AdapterUnavailable => "adapter_unavailable",
    /// The tenant's requests per minute are used up (see [`crate::quota`]).
    RequestsRateLimited => "rate_limit_exceeded",
    /// The tenant's tokens per minute are used up (see [`crate::quota`]).
    TokensRateLimited => "rate_limit_exceeded",
    /// `--max-queue` requests are admitted already.
    QueueFull => "queue_full",
    /// No ready backend, and `--cold-start=reject`.
    ColdReject => "cold_reject",
    /// No backend became ready within `--activation-timeout`.
    ActivationTimeout => "activation_timeout",
    /// No backend is ready and none can come up without a change: the service's
    /// activation failure ([`crate::diagnosis`]).
    ActivationFailed => "activation_failed",
}

impl RejectionKind {
    /// The HTTP status of the answer.
    pub const fn status(self) -> StatusCode {
        match self {
            Self::Draining
            | Self::BodyMemory
            | Self::AdapterUnavailable
            | Self::ColdReject
            | Self::ActivationTimeout
            | Self::ActivationFailed => StatusCode::SERVICE_UNAVAILABLE,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::BadRequest | Self::MalformedBody | Self::ModelRequired => StatusCode::BAD_REQUEST,
            Self::UnsupportedTransferCoding => StatusCode::NOT_IMPLEMENTED,
            Self::LoopDetected => StatusCode::LOOP_DETECTED,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::UnknownModel => StatusCode::NOT_FOUND,
            Self::QueueFull | Self::RequestsRateLimited | Self::TokensRateLimited => {
                StatusCode::TOO_MANY_REQUESTS
            }
        }
    }

    /// The OpenAI error `type`: `server_error` when the gateway cannot serve the request now,
    /// `rate_limit_error` when it holds too many, OpenAI's `requests` or `tokens` when a
    /// tenant's quota is used up, `invalid_request_error` when the request is at fault.
    pub const fn error_type(self) -> &'static str {
        match self {
            Self::Draining
            | Self::LoopDetected
            | Self::BodyMemory
            | Self::AdapterUnavailable
            | Self::ColdReject
            | Self::ActivationTimeout
            | Self::ActivationFailed => "server_error",
            Self::QueueFull => "rate_limit_error",
            Self::RequestsRateLimited => "requests",
            Self::TokensRateLimited => "tokens",
            Self::MethodNotAllowed
            | Self::BadRequest
            | Self::UnsupportedTransferCoding
            | Self::Unauthorized
            | Self::BodyTooLarge
            | Self::BodyTimeout
            | Self::MalformedBody
            | Self::ModelRequired
            | Self::UnknownModel => "invalid_request_error",
        }
    }

    /// The OpenAI error `code`: the metric label, except OpenAI's own `invalid_api_key` and
    /// `model_not_found`.
    pub const fn code(self) -> &'static str {
        match self {
            Self::Unauthorized => "invalid_api_key",
            Self::UnknownModel => "model_not_found",
            other => other.label(),
        }
    }

    /// The OpenAI error `param`: the request field at fault, `model` for the kinds about it,
    /// else none (`null`).
    pub const fn param(self) -> Option<&'static str> {
        match self {
            Self::ModelRequired | Self::UnknownModel | Self::AdapterUnavailable => Some("model"),
            _ => None,
        }
    }

    /// Whether the answer carries `Retry-After` (`--retry-after`): the same request may succeed
    /// later, or on another replica.
    pub const fn retries(self) -> bool {
        matches!(
            self,
            Self::Draining
                | Self::BodyMemory
                | Self::AdapterUnavailable
                | Self::QueueFull
                | Self::RequestsRateLimited
                | Self::TokensRateLimited
                | Self::ColdReject
                | Self::ActivationTimeout
        )
    }

    /// Whether the answer closes the connection (`Connection: close`, RFC 9112 §9.6): the
    /// gateway drains, the rest of the request's framing is not to be trusted, or the rest of
    /// the body is not coming (RFC 9110 §15.5.9).
    pub const fn closes(self) -> bool {
        matches!(
            self,
            Self::Draining
                | Self::MethodNotAllowed
                | Self::BadRequest
                | Self::UnsupportedTransferCoding
                | Self::BodyTimeout
        )
    }

    /// A header field the answer carries besides `Content-Type`, `Retry-After` and
    /// `Connection`: `Allow` with a `405` (RFC 9110 §15.5.6), `WWW-Authenticate: Bearer` with a
    /// `401` (RFC 9110 §11.6.1).
    pub fn header(self) -> Option<(HeaderName, HeaderValue)> {
        match self {
            Self::MethodNotAllowed => {
                Some((header::ALLOW, HeaderValue::from_static(ALLOWED_METHODS)))
            }
            Self::Unauthorized => {
                Some((header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer")))
            }
            _ => None,
        }
    }
}

/// Why a header section is refused with `400` (RFC 9112 §3.2, RFC 9110 §4.2.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BadRequest {
    /// The target carries user info (`http://user:pw@host/…`).
    UserInfo,
    /// An HTTP/1.1 request without `Host`.
    MissingHost,
    /// Several `Host` lines.
    ManyHosts,
    /// A `Host` that is not `host[:port]`.
    InvalidHost,
    /// Several `Authorization` lines: the gateway and the backend might each read another.
    ManyAuthorizations,
}

impl BadRequest {
    fn message(self) -> &'static str {
        match self {
            Self::UserInfo => {
                "the request target carries user info (user@host), which must not be sent (RFC 9110 §4.2.4)"
            }
            Self::MissingHost => "an HTTP/1.1 request must have a Host field (RFC 9112 §3.2)",
            Self::ManyHosts => "the request has more than one Host field line (RFC 9112 §3.2)",
            Self::InvalidHost => {
                "the Host field is not a host with an optional port (RFC 9112 §3.2)"
            }
            Self::ManyAuthorizations => {
                "the request has more than one Authorization field line; send one"
            }
        }
    }
}

/// A request the gateway answers itself with an OpenAI error, counted in
/// `hearth_gateway_rejections_total`: one variant per [`RejectionKind`], holding what the
/// message names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rejection {
    /// See [`RejectionKind::Draining`].
    Draining,
    /// See [`RejectionKind::MethodNotAllowed`].
    MethodNotAllowed {
        /// The method refused.
        method: Method,
    },
    /// See [`RejectionKind::BadRequest`].
    BadRequest(BadRequest),
    /// See [`RejectionKind::UnsupportedTransferCoding`].
    UnsupportedTransferCoding {
        /// The `Transfer-Encoding` value, as sent.
        coding: String,
    },
    /// See [`RejectionKind::LoopDetected`].
    LoopDetected,
    /// See [`RejectionKind::Unauthorized`].
    Unauthorized {
        /// No key at all (rather than a wrong one).
        missing: bool,
    },
    /// See [`RejectionKind::BodyTooLarge`].
    BodyTooLarge {
        /// `--body-limit`, in bytes.
        limit: usize,
    },
    /// See [`RejectionKind::BodyMemory`].
    BodyMemory {
        /// `--body-memory-limit`, in bytes.
        limit: usize,
    },
    /// See [`RejectionKind::BodyTimeout`].
    BodyTimeout {
        /// `--body-read-timeout`.
        timeout: Duration,
    },
    /// See [`RejectionKind::MalformedBody`].
    MalformedBody {
        /// What hyper found wrong.
        error: String,
    },
    /// See [`RejectionKind::ModelRequired`].
    ModelRequired,
    /// See [`RejectionKind::UnknownModel`].
    UnknownModel {
        /// The request's `model`.
        model: String,
    },
    /// See [`RejectionKind::AdapterUnavailable`].
    AdapterUnavailable {
        /// The adapter's name (the request's `model`).
        adapter: String,
        /// Why it cannot be loaded yet (its route's `unavailable`).
        reason: String,
    },
    /// See [`RejectionKind::RequestsRateLimited`] and [`RejectionKind::TokensRateLimited`].
    RateLimited(Box<crate::quota::Limited>),
    /// See [`RejectionKind::QueueFull`].
    QueueFull {
        /// `--max-queue`.
        max_queue: u64,
    },
    /// See [`RejectionKind::ColdReject`].
    ColdReject,
    /// See [`RejectionKind::ActivationTimeout`].
    ActivationTimeout {
        /// `--activation-timeout`.
        timeout: Duration,
    },
    /// See [`RejectionKind::ActivationFailed`].
    ActivationFailed {
        /// The model's key, `<namespace>/<service>`.
        service: String,
        /// `<reason>: <message>` of the service's `Ready` condition.
        why: std::sync::Arc<str>,
    },
}

impl Rejection {
    /// The rejection's kind: the facts of its answer.
    pub const fn kind(&self) -> RejectionKind {
        match self {
            Self::Draining => RejectionKind::Draining,
            Self::MethodNotAllowed { .. } => RejectionKind::MethodNotAllowed,
            Self::BadRequest(_) => RejectionKind::BadRequest,
            Self::UnsupportedTransferCoding { .. } => RejectionKind::UnsupportedTransferCoding,
            Self::LoopDetected => RejectionKind::LoopDetected,
            Self::Unauthorized { .. } => RejectionKind::Unauthorized,
            Self::BodyTooLarge { .. } => RejectionKind::BodyTooLarge,
            Self::BodyMemory { .. } => RejectionKind::BodyMemory,
            Self::BodyTimeout { .. } => RejectionKind::BodyTimeout,
            Self::MalformedBody { .. } => RejectionKind::MalformedBody,
            Self::ModelRequired => RejectionKind::ModelRequired,
            Self::UnknownModel { .. } => RejectionKind::UnknownModel,
            Self::AdapterUnavailable { .. } => RejectionKind::AdapterUnavailable,
            Self::RateLimited(l) => match l.limit {
                crate::quota::Limit::Requests => RejectionKind::RequestsRateLimited,
                crate::quota::Limit::Tokens => RejectionKind::TokensRateLimited,
            },
            Self::QueueFull { .. } => RejectionKind::QueueFull,
            Self::ColdReject => RejectionKind::ColdReject,
            Self::ActivationTimeout { .. } => RejectionKind::ActivationTimeout,
            Self::ActivationFailed { .. } => RejectionKind::ActivationFailed,
        }
    }

    /// The error `message`: what happened and what to change. The API key messages are
    /// OpenAI's own.
    pub fn message(&self) -> String {
        match self {
            Self::Draining => "the gateway is shutting down; retry the request".to_owned(),
            Self::MethodNotAllowed { method } => format!(
                "{method} is not supported: the gateway forwards HTTP API requests ({ALLOWED_METHODS})"
            ),
            Self::BadRequest(why) => why.message().to_owned(),
            Self::UnsupportedTransferCoding { coding } => format!(
                "Transfer-Encoding {coding:?} is not supported: send the body with chunked or a Content-Length, uncompressed (RFC 9112 §6.1)"
            ),
            Self::LoopDetected => "this request already passed through this gateway (Via): its backend leads back to the gateway; check --backend-url or --backend-service".to_owned(),
            Self::Unauthorized { missing: true } => "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).".to_owned(),
            Self::Unauthorized { missing: false } => "Incorrect API key provided.".to_owned(),
            Self::BodyTooLarge { limit } => format!(
                "the request body is larger than the gateway's limit of {limit} bytes (--body-limit)"
            ),
            Self::BodyMemory { limit } => format!(
                "the request bodies the gateway holds would pass its limit of {limit} bytes (--body-memory-limit); retry later"
            ),
            Self::BodyTimeout { timeout } => format!(
                "the request body did not arrive within {timeout:?} (--body-read-timeout)"
            ),
            Self::MalformedBody { error } => format!("the request body could not be read: {error}"),
            Self::ModelRequired => "the request names no `model`: this endpoint serves several models and routes each request by the `model` field of its JSON body (GET /v1/models lists them)".to_owned(),
            Self::UnknownModel { model } => format!("The model `{model}` does not exist."),
            Self::AdapterUnavailable { adapter, reason } => {
                format!("The adapter `{adapter}` cannot be loaded yet: {reason}")
            }
            Self::RateLimited(l) => format!(
                "Rate limit reached for tenant {} on {} per min ({}): Limit {}, Requested {}. Please try again in {}.",
                l.tenant,
                l.limit.word(),
                match l.limit {
                    crate::quota::Limit::Requests => "RPM",
                    crate::quota::Limit::Tokens => "TPM",
                },
                l.per_minute,
                l.requested,
                crate::quota::openai_duration(l.retry_after),
            ),
            Self::QueueFull { max_queue } => format!(
                "the gateway already holds {max_queue} requests (maxQueue); retry later"
            ),
            Self::ColdReject => "the model is starting; retry the request".to_owned(),
            Self::ActivationTimeout { timeout } => format!(
                "no backend became ready within the activation timeout ({timeout:?}); retry the request"
            ),
            Self::ActivationFailed { service, why } => format!(
                "the backend of {service} cannot come up ({why}); fix the LLMService or its InferenceRuntime, then retry"
            ),
        }
    }

    /// The answer: the kind's status and headers, and an OpenAI error body
    /// (`{"error": {"message", "type", "param": null, "code"}}`); `retry_after` is
    /// `--retry-after`, sent (rounded up to whole seconds) when the kind [retries](RejectionKind::retries);
    /// a quota's refusal sends its own wait instead, and OpenAI's `x-ratelimit-*` headers.
    pub fn into_response(self, retry_after: Duration) -> Response {
        let kind = self.kind();
        let (retry_after, extra) = match &self {
            Self::RateLimited(l) => (l.retry_after, Some(l.headers.clone())),
            _ => (retry_after, None),
        };
        let resp = error_response_param(
            kind.status(),
            &self.message(),
            kind.error_type(),
            kind.param(),
            Some(kind.code()),
        );
        let mut resp = if kind.retries() {
            with_retry_after(resp, retry_after)
        } else {
            resp
        };
        if let Some((name, value)) = kind.header() {
            resp.headers_mut().insert(name, value);
        }
        if kind.closes() {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        if let Some(extra) = extra {
            resp.headers_mut().extend(extra);
        }
        resp
    }

    /// The rejection as the SSE `error` event that ends a stream whose `200` is already sent
    /// (see [`sse_error_event`]).
    pub fn sse_event(&self) -> Bytes {
        let kind = self.kind();
        sse_error_event_param(
            &self.message(),
            kind.error_type(),
            kind.param(),
            Some(kind.code()),
        )
    }
}

/// The `502` of a backend that failed before answering: `message` names the failure, not the
/// backend's address.
pub fn bad_gateway(message: &str) -> Response {
    error_response(StatusCode::BAD_GATEWAY, message, "server_error", None)
}

/// The SSE `error` event that ends a committed stream when the backend fails: `code` is
/// `bad_gateway`, or the backend's error status.
pub fn stream_failure(message: &str, code: &str) -> Bytes {
    sse_error_event(message, "server_error", Some(code))
}

/// The answer to a request whose client left mid-body: nobody reads it, the request counts as
/// canceled.
pub fn body_unread() -> Response {
    error_response(
        StatusCode::BAD_REQUEST,
        "the request body could not be read",
        "invalid_request_error",
        None,
    )
}

#[cfg(test)]
mod tests;

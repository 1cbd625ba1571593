use super::*;

/// One rejection of every kind (the match makes a new kind a compile error here).
fn one_of_each() -> Vec<Rejection> {
    let all = vec![
        Rejection::Draining,
        Rejection::MethodNotAllowed {
            method: Method::TRACE,
        },
        Rejection::BadRequest(BadRequest::ManyHosts),
        Rejection::UnsupportedTransferCoding {
            coding: "gzip, chunked".into(),
        },
        Rejection::LoopDetected,
        Rejection::Unauthorized { missing: true },
        Rejection::BodyTooLarge { limit: 10 },
        Rejection::BodyMemory { limit: 20 },
        Rejection::BodyTimeout {
            timeout: Duration::from_millis(1500),
        },
        Rejection::MalformedBody {
            error: "bad chunk".into(),
        },
        Rejection::ModelRequired,
        Rejection::UnknownModel { model: "m".into() },
        Rejection::AdapterUnavailable {
            adapter: "sql".into(),
            reason: "its files are being fetched".into(),
        },
        Rejection::RateLimited(Box::new(limited(crate::quota::Limit::Requests))),
        Rejection::RateLimited(Box::new(limited(crate::quota::Limit::Tokens))),
        Rejection::QueueFull { max_queue: 3 },
        Rejection::ColdReject,
        Rejection::ActivationTimeout {
            timeout: Duration::from_secs(2),
        },
        Rejection::ActivationFailed {
            service: "a/chat".into(),
            why: "ImagePullFailed: pod chat-1, container vllm: ErrImagePull: not found".into(),
        },
    ];
    for r in &all {
        match r {
            Rejection::Draining
            | Rejection::MethodNotAllowed { .. }
            | Rejection::BadRequest(_)
            | Rejection::UnsupportedTransferCoding { .. }
            | Rejection::LoopDetected
            | Rejection::Unauthorized { .. }
            | Rejection::BodyTooLarge { .. }
            | Rejection::BodyMemory { .. }
            | Rejection::BodyTimeout { .. }
            | Rejection::MalformedBody { .. }
            | Rejection::ModelRequired
            | Rejection::UnknownModel { .. }
            | Rejection::AdapterUnavailable { .. }
            | Rejection::RateLimited(_)
            | Rejection::QueueFull { .. }
            | Rejection::ColdReject
            | Rejection::ActivationTimeout { .. }
            | Rejection::ActivationFailed { .. } => {}
        }
    }
    all
}

/// A quota's refusal: 60 per minute, retry in 2.5 s (as `--retry-after` in these tests).
fn limited(limit: crate::quota::Limit) -> crate::quota::Limited {
    crate::quota::Limited {
        tenant: "team-a".into(),
        limit,
        per_minute: 60,
        requested: 1,
        retry_after: Duration::from_millis(2500),
        headers: axum::http::HeaderMap::new(),
    }
}

async fn body_json(resp: Response) -> serde_json::Value {
    use http_body_util::BodyExt;
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    serde_json::from_slice(&bytes).unwrap_or_default()
}

#[test]
fn every_kind_has_a_rejection_and_they_are_in_path_order() {
    let kinds: Vec<RejectionKind> = one_of_each().iter().map(Rejection::kind).collect();
    assert_eq!(kinds, RejectionKind::ALL);
}

#[tokio::test]
async fn the_answer_is_an_openai_error_shaped_by_the_kind() {
    for r in one_of_each() {
        let kind = r.kind();
        let message = r.message();
        let resp = r.into_response(Duration::from_millis(2500));
        assert_eq!(resp.status(), kind.status(), "{kind:?}");
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
        assert_eq!(
            resp.headers()
                .get(header::RETRY_AFTER)
                .map(|v| v.as_bytes()),
            kind.retries().then_some(&b"3"[..]),
            "{kind:?}"
        );
        assert_eq!(
            resp.headers().get(header::CONNECTION).map(|v| v.as_bytes()),
            kind.closes().then_some(&b"close"[..]),
            "{kind:?}"
        );
        if let Some((name, value)) = kind.header() {
            assert_eq!(resp.headers()[name], value, "{kind:?}");
        }
        let json = body_json(resp).await;
        assert_eq!(
            json,
            serde_json::json!({"error": {
                "message": message,
                "type": kind.error_type(),
                "param": kind.param(),
                "code": kind.code(),
            }}),
            "{kind:?}"
        );
    }
}

#[test]
fn messages_name_what_to_change() {
    let msg = |r: Rejection| r.message();
    assert_eq!(
        msg(Rejection::MethodNotAllowed {
            method: Method::CONNECT
        }),
        "CONNECT is not supported: the gateway forwards HTTP API requests (GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS)"
    );
    assert_eq!(
        msg(Rejection::UnsupportedTransferCoding {
            coding: "gzip".into()
        }),
        "Transfer-Encoding \"gzip\" is not supported: send the body with chunked or a Content-Length, uncompressed (RFC 9112 §6.1)"
    );
    assert_eq!(
        msg(Rejection::BodyTimeout {
            timeout: Duration::from_millis(1500)
        }),
        "the request body did not arrive within 1.5s (--body-read-timeout)"
    );
    assert_eq!(
        msg(Rejection::Unauthorized { missing: false }),
        "Incorrect API key provided."
    );
    assert_eq!(
        msg(Rejection::AdapterUnavailable {
            adapter: "sql".into(),
            reason: "its files are being fetched".into()
        }),
        "The adapter `sql` cannot be loaded yet: its files are being fetched"
    );
    assert_eq!(
        msg(Rejection::QueueFull { max_queue: 3 }),
        "the gateway already holds 3 requests (maxQueue); retry later"
    );
}

#[test]
fn the_two_bad_request_kinds_differ_only_in_closing() {
    let (framing, body) = (RejectionKind::BadRequest, RejectionKind::MalformedBody);
    assert_eq!(framing.label(), body.label());
    assert_eq!(framing.status(), body.status());
    assert!(framing.closes() && !body.closes());
}

#[test]
fn a_stream_ends_with_the_same_error() {
    let r = Rejection::ActivationTimeout {
        timeout: Duration::from_secs(2),
    };
    let ev = r.sse_event();
    let s = String::from_utf8_lossy(&ev);
    let data = s
        .trim_end()
        .strip_prefix("event: error\ndata: ")
        .unwrap_or_default();
    let json: serde_json::Value = serde_json::from_str(data).unwrap_or_default();
    assert_eq!(json["error"]["code"], "activation_timeout");
    assert_eq!(json["error"]["type"], "server_error");
    assert_eq!(json["error"]["message"], r.message());
}

/// A documented rejection: reason, status, type, code, Retry-After, Connection: close, header.
type Row = (String, u16, String, String, bool, bool, Option<String>);

fn row(kind: RejectionKind) -> Row {
    (
        kind.label().to_owned(),
        kind.status().as_u16(),
        kind.error_type().to_owned(),
        kind.code().to_owned(),
        kind.retries(),
        kind.closes(),
        kind.header().map(|(name, _)| name.as_str().to_owned()),
    )
}

fn yes_no(cell: &str) -> bool {
    match cell {
        "yes" => true,
        "no" => false,
        other => panic!("a yes/no cell holds {other:?}"),
    }
}

/// The rows of the table under `### Rejections` in `docs/gateway.md`.
fn documented_rows(doc: &str) -> Vec<Row> {
    let mut lines = doc
        .lines()
        .skip_while(|l| l.trim() != "### Rejections")
        .skip(1)
        .skip_while(|l| !l.starts_with('|'));
    let head: Vec<String> = cells(lines.next().unwrap_or_default());
    assert_eq!(
        head,
        [
            "reason",
            "status",
            "type",
            "code",
            "Retry-After",
            "Connection: close",
            "header",
            "when"
        ],
        "the table's columns"
    );
    lines
        .skip(1) // |---|
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let c = cells(l);
            assert_eq!(c.len(), 8, "{l}");
            let header = c[6]
                .split(':')
                .next()
                .filter(|h| !h.is_empty())
                .map(str::to_ascii_lowercase);
            (
                c[0].clone(),
                c[1].parse().unwrap_or_else(|_| panic!("status in {l}")),
                c[2].clone(),
                c[3].clone(),
                yes_no(&c[4]),
                yes_no(&c[5]),
                header,
            )
        })
        .collect()
}

/// A table line's cells, trimmed and without backticks.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|').trim_end_matches('|');
    inner
        .split('|')
        .map(|c| c.trim().replace('`', ""))
        .collect()
}

/// The backticked names in the line that starts with `prefix`.
fn listed_reasons(doc: &str, prefix: &str) -> Vec<String> {
    let line = doc
        .lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix}"));
    let mut reasons: Vec<String> = line[prefix.len()..]
        .split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    reasons.sort();
    reasons.dedup();
    reasons
}

const GATEWAY_DOC: &str = include_str!("../../../docs/gateway.md");

#[test]
fn the_documented_rejections_are_the_kinds() {
    let mut documented = documented_rows(GATEWAY_DOC);
    let mut kinds: Vec<Row> = RejectionKind::ALL.iter().map(|k| row(*k)).collect();
    documented.sort();
    kinds.sort();
    let undocumented: Vec<_> = kinds.iter().filter(|k| !documented.contains(k)).collect();
    let unknown: Vec<_> = documented.iter().filter(|d| !kinds.contains(d)).collect();
    assert!(
        undocumented.is_empty() && unknown.is_empty(),
        "docs/gateway.md \"Rejections\" differs from RejectionKind:\n  not documented: {undocumented:?}\n  documented, not a kind: {unknown:?}"
    );
    assert_eq!(documented, kinds, "each kind documented once");
}

#[test]
fn the_metric_tables_list_every_reason() {
    let mut labels: Vec<String> = RejectionKind::ALL
        .iter()
        .map(|k| k.label().to_owned())
        .collect();
    labels.sort();
    labels.dedup();
    let prefix = "| `hearth_gateway_rejections_total{reason}` |";
    assert_eq!(
        listed_reasons(GATEWAY_DOC, prefix),
        labels,
        "docs/gateway.md"
    );
    let metrics_rs = include_str!("../metrics.rs");
    assert_eq!(
        listed_reasons(metrics_rs, &format!("//! {prefix}")),
        labels,
        "src/metrics.rs"
    );
}

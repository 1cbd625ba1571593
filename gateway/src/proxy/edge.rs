//! The edge step: what is refused from the header section alone, before the body is read,
//! in order: draining, framing and method ([`framing`]), a loop back to this replica (`Via`),
//! the API key. Also the one answer the gateway gives in place of a cold backend:
//! `GET /v1/models` ([`cold_models_list`]).

use axum::{
    body::Body,
    http::{HeaderMap, HeaderValue, Method, header, request::Parts},
    response::Response,
};

use crate::{
    apikeys::{ApiKeys, AuthOutcome},
    fair::TenantId,
    gateway::Shared,
    reject::{BadRequest, Rejection},
};

/// The edge checks of a request with head `parts`; the tenant its API key names (the default
/// one while keys are off).
pub(super) fn check(shared: &Shared, parts: &Parts) -> Result<TenantId, Rejection> {
    if shared.is_draining() {
        return Err(Rejection::Draining);
    }
    framing(parts)?;
    if shared.via.seen_in(&parts.headers) {
        return Err(Rejection::LoopDetected);
    }
    authorize(&shared.keys, &parts.headers)
}

/// A request the gateway must not forward, or must answer `400` by its framing rules:
/// - `CONNECT` (a tunnel) and `TRACE` (echoes credentials back): `405`;
/// - a target with user info (RFC 9110 §4.2.4): `400`;
/// - an HTTP/1.1 request without `Host`, or any with several `Host` lines or an invalid one:
///   `400` (RFC 9112 §3.2 makes both a MUST);
/// - a `Transfer-Encoding` other than `chunked`: `501` (RFC 9112 §6.1); the body would reach the
///   backend still encoded, with nothing saying so;
/// - several `Authorization` lines: `400`; the gateway and the backend might each read another.
pub(super) fn framing(parts: &Parts) -> Result<(), Rejection> {
    if matches!(parts.method, Method::CONNECT | Method::TRACE) {
        return Err(Rejection::MethodNotAllowed {
            method: parts.method.clone(),
        });
    }
    if parts
        .uri
        .authority()
        .is_some_and(|a| a.as_str().contains('@'))
    {
        return Err(Rejection::BadRequest(BadRequest::UserInfo));
    }
    let mut hosts = parts.headers.get_all(header::HOST).iter();
    match (hosts.next(), hosts.next()) {
        (None, _) if parts.version == http::Version::HTTP_11 => {
            return Err(Rejection::BadRequest(BadRequest::MissingHost));
        }
        (Some(_), Some(_)) => return Err(Rejection::BadRequest(BadRequest::ManyHosts)),
        (Some(host), None) if !valid_host(host.as_bytes()) => {
            return Err(Rejection::BadRequest(BadRequest::InvalidHost));
        }
        _ => {}
    }
    if let Some(te) = parts.headers.get(header::TRANSFER_ENCODING)
        && parts
            .headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .flat_map(|v| v.as_bytes().split(|b| *b == b','))
            .map(<[u8]>::trim_ascii)
            // Empty list elements are ignored (RFC 9110 §5.6.1.2).
            .any(|coding| !coding.is_empty() && !coding.eq_ignore_ascii_case(b"chunked"))
    {
        return Err(Rejection::UnsupportedTransferCoding {
            coding: String::from_utf8_lossy(te.as_bytes()).into_owned(),
        });
    }
    if parts
        .headers
        .get_all(header::AUTHORIZATION)
        .iter()
        .nth(1)
        .is_some()
    {
        return Err(Rejection::BadRequest(BadRequest::ManyAuthorizations));
    }
    Ok(())
}

/// Whether `host` is a `Host` field value: `uri-host [ ":" port ]` (RFC 9112 §3.2, RFC 3986
/// §3.2.2), or empty (a target without an authority). No user info, path or other delimiters;
/// a reg-name may be percent-encoded, an IP literal is bracketed (`[fe80::1%25eth0]`).
fn valid_host(host: &[u8]) -> bool {
    let (name, port) = match host.strip_prefix(b"[") {
        Some(rest) => {
            let Some(end) = rest.iter().position(|b| *b == b']') else {
                return false;
            };
            let literal = &rest[..end];
            if literal.is_empty()
                || !literal
                    .iter()
                    .all(|b| b.is_ascii_alphanumeric() || b":.%-_~".contains(b))
            {
                return false;
            }
            (None, &rest[end + 1..])
        }
        None => match host.iter().rposition(|b| *b == b':') {
            Some(i) => (Some(&host[..i]), &host[i..]),
            None => (Some(host), &host[host.len()..]),
        },
    };
    let reg_name_ok = name.is_none_or(|n| {
        n.iter()
            .all(|b| b.is_ascii_alphanumeric() || b"-._~%!$&'()*+,;=".contains(b))
    });
    let port_ok = port.is_empty()
        || port
            .strip_prefix(b":")
            .is_some_and(|p| p.iter().all(u8::is_ascii_digit));
    reg_name_ok && port_ok
}

/// The API key check (`Authorization: Bearer <key>`; see [`crate::apikeys`]): the key's tenant.
pub(super) fn authorize(keys: &ApiKeys, headers: &HeaderMap) -> Result<TenantId, Rejection> {
    match keys.check(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes())) {
        AuthOutcome::Allowed(tenant) => Ok(tenant),
        outcome => Err(Rejection::Unauthorized {
            missing: outcome == AuthOutcome::Missing,
        }),
    }
}

/// The gateway's own answer to `GET` (or `HEAD`) `/v1/models`, if it gives one:
/// - a single-service gateway whose model has LoRA adapters, always: its served names and
///   then its adapters with Hearth's fields ([`crate::model::ModelList::single`]); the engine
///   lists only the adapters it has loaded;
/// - a single-service gateway, while no backend is ready and served model names are known:
///   the names, so clients can discover the model without waking it (a ready backend answers
///   itself);
/// - a shared gateway, always: every model of its route table, each followed by its adapters,
///   with Hearth's fields ([`crate::model::ModelList`]), and `GET /v1/models/{id}` one of
///   them, or [`Rejection::UnknownModel`].
pub(super) fn own_answer(shared: &Shared, parts: &Parts) -> Option<Result<Response, Rejection>> {
    if !matches!(parts.method, Method::GET | Method::HEAD) {
        return None;
    }
    let path = parts.uri.path();
    let Some(model) = &shared.single else {
        let table = shared.routes.load();
        if path == "/v1/models" {
            let list = crate::model::ModelList::of(table.models());
            return Some(Ok(json_response(serde_json::to_vec(&list))));
        }
        let id = path.strip_prefix("/v1/models/")?;
        let id = percent_decode(id);
        let entry = table.by_name(&id).and_then(|m| {
            m.entry_for(&id)
                .map(|e| json_response(serde_json::to_vec(&e)))
        });
        return Some(entry.ok_or(Rejection::UnknownModel { model: id }));
    };
    let names = &model.cfg.served_model_names;
    // With adapters or aliases the gateway lists them, warm too: the engine knows neither.
    if path == "/v1/models"
        && !names.is_empty()
        && !(model.state.adapters.is_empty() && model.cfg.aliases.is_empty())
    {
        let list = crate::model::ModelList::single(model);
        return Some(Ok(json_response(serde_json::to_vec(&list))));
    }
    (path == "/v1/models" && !names.is_empty() && !model.state.backends.is_ready())
        .then(|| Ok(models_list(names)))
}

/// `%XX` escapes of a path segment decoded (a model name may hold `/` or `:`); bytes that do
/// not decode to UTF-8 are replaced.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                let v = hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0);
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A `200` with `body` as `application/json` (a `500` in the impossible case that it could not
/// be serialized).
fn json_response(body: Result<Vec<u8>, serde_json::Error>) -> Response {
    let mut resp = match body {
        Ok(body) => Response::new(Body::from(body)),
        Err(e) => {
            return crate::openai::error_response(
                http::StatusCode::INTERNAL_SERVER_ERROR,
                &format!("listing the models failed: {e}"),
                "server_error",
                None,
            );
        }
    };
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

/// The response to `GET /v1/models` while no backend is ready: the served model names, in the
/// OpenAI `list` shape, so clients can discover the model without waking it.
fn models_list(names: &[String]) -> Response {
    let data: Vec<serde_json::Value> = names
        .iter()
        .map(
            |n| serde_json::json!({"id": n, "object": "model", "created": 0, "owned_by": "hearth"}),
        )
        .collect();
    json_response(serde_json::to_vec(
        &serde_json::json!({"object": "list", "data": data}),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The head of a request built by `f`.
    fn head(f: impl FnOnce(http::request::Builder) -> http::request::Builder) -> Parts {
        let (parts, ()) = f(http::Request::builder().header(header::HOST, "gw"))
            .body(())
            .unwrap()
            .into_parts();
        parts
    }

    #[test]
    fn framing_refuses_what_must_not_be_forwarded() {
        let refused =
            |f: fn(http::request::Builder) -> http::request::Builder| framing(&head(f)).err();
        assert_eq!(
            refused(|b| b.method(Method::TRACE)),
            Some(Rejection::MethodNotAllowed {
                method: Method::TRACE
            })
        );
        assert_eq!(
            refused(|b| b.uri("http://user:pw@gw/v1/models")),
            Some(Rejection::BadRequest(BadRequest::UserInfo))
        );
        assert_eq!(
            refused(|b| b.header(header::HOST, "other")),
            Some(Rejection::BadRequest(BadRequest::ManyHosts))
        );
        assert_eq!(
            refused(|b| b.header(header::TRANSFER_ENCODING, "gzip, chunked")),
            Some(Rejection::UnsupportedTransferCoding {
                coding: "gzip, chunked".into()
            })
        );
        assert_eq!(
            refused(|b| b
                .header(header::AUTHORIZATION, "Bearer a")
                .header(header::AUTHORIZATION, "Bearer b")),
            Some(Rejection::BadRequest(BadRequest::ManyAuthorizations))
        );
        assert_eq!(
            refused(|b| b.header(header::TRANSFER_ENCODING, "chunked, , Chunked")),
            None
        );
        assert_eq!(
            refused(|b| b.method(Method::POST).uri("/v1/completions")),
            None
        );
    }

    #[test]
    fn framing_checks_the_host_field() {
        let no_host = |version| {
            let (mut parts, ()) = http::Request::builder()
                .version(version)
                .body(())
                .unwrap()
                .into_parts();
            parts.headers.clear();
            framing(&parts).err()
        };
        assert_eq!(
            no_host(http::Version::HTTP_11),
            Some(Rejection::BadRequest(BadRequest::MissingHost))
        );
        assert_eq!(no_host(http::Version::HTTP_10), None);
        let mut parts = head(|b| b);
        parts
            .headers
            .insert(header::HOST, HeaderValue::from_static("gw/path"));
        assert_eq!(
            framing(&parts).err(),
            Some(Rejection::BadRequest(BadRequest::InvalidHost))
        );
    }

    #[test]
    fn a_host_is_a_name_or_literal_and_an_optional_port() {
        for ok in [
            &b""[..],
            b"gw",
            b"gw:8000",
            b"10.0.0.1:80",
            b"[::1]:8000",
            b"[fe80::1%25eth0]",
            b"caf%C3%A9.example",
        ] {
            assert!(valid_host(ok), "{}", String::from_utf8_lossy(ok));
        }
        for bad in [
            &b"user@gw"[..],
            b"gw/path",
            b"gw:80a",
            b"[::1",
            b"[]",
            b"gw:8000:1]",
            b"g w",
        ] {
            assert!(!valid_host(bad), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn the_key_is_checked_only_when_keys_are_on() {
        let headers = HeaderMap::new();
        assert_eq!(authorize(&ApiKeys::disabled(), &headers), Ok(0));
        let dir = std::env::temp_dir().join(format!("hearth-edge-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("keys");
        std::fs::write(&path, "sk-a\n").unwrap();
        let keys = ApiKeys::load(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            authorize(&keys, &headers),
            Err(Rejection::Unauthorized { missing: true })
        );
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sk-b"),
        );
        assert_eq!(
            authorize(&keys, &headers),
            Err(Rejection::Unauthorized { missing: false })
        );
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer sk-a"),
        );
        assert_eq!(authorize(&keys, &headers), Ok(0));
    }

    #[test]
    fn the_edge_refuses_in_order_draining_framing_loop() {
        let gw =
            super::super::test_gateway(crate::GatewayConfig::default(), crate::EndpointSet::new());
        let shared = gw.shared().clone();
        let via = shared.via.value(http::Version::HTTP_11);
        let looped = head(|b| b.method(Method::TRACE).header(header::VIA, via));
        assert_eq!(
            check(&shared, &looped),
            Err(Rejection::MethodNotAllowed {
                method: Method::TRACE
            })
        );
        let mut looped = looped;
        looped.method = Method::POST;
        assert_eq!(check(&shared, &looped), Err(Rejection::LoopDetected));
        assert_eq!(check(&shared, &head(|b| b)), Ok(0));
        gw.start_drain();
        assert_eq!(check(&shared, &looped), Err(Rejection::Draining));
    }

    #[tokio::test]
    async fn a_cold_gateway_lists_its_served_models() {
        use http_body_util::BodyExt;
        let backends = crate::EndpointSet::new();
        let cfg = crate::GatewayConfig {
            served_model_names: vec!["m".into()],
            ..Default::default()
        };
        let shared = super::super::test_shared(cfg, backends.clone());
        let get = head(|b| b.uri("/v1/models"));
        let Some(Ok(resp)) = own_answer(&shared, &get) else {
            panic!("not answered while cold")
        };
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["object"], "list");
        assert_eq!(json["data"][0]["id"], "m");
        assert!(own_answer(&shared, &head(|b| b.method(Method::POST).uri("/v1/models"))).is_none());
        backends.replace(["10.1.2.3:8000".parse().unwrap()]);
        assert!(
            own_answer(&shared, &get).is_none(),
            "a ready backend answers"
        );
        let shared =
            super::super::test_shared(crate::GatewayConfig::default(), crate::EndpointSet::new());
        assert!(
            own_answer(&shared, &get).is_none(),
            "no served names: forwarded"
        );
    }

    #[test]
    fn a_shared_gateway_lists_every_model_with_its_state() {
        use hearth_crds::llmendpoint::{ModelRoute, RouteTable, SleepRoute};
        let gw = crate::Gateway::new_shared(
            crate::GatewayConfig::default(),
            ApiKeys::disabled(),
            std::sync::Arc::new(|_: &ModelRoute, _: &crate::EndpointSet| {}),
        )
        .unwrap();
        let route = |s: &str| crate::routes::default_route("ns", s, s);
        gw.apply_routes(&RouteTable {
            models: vec![
                route("ready"),
                route("activating"),
                ModelRoute {
                    sleep: Some(SleepRoute {
                        after: hearth_crds::Duration::new("5m"),
                        level: 1,
                        sleep_path: "/sleep".into(),
                        is_sleeping_path: "/is_sleeping".into(),
                        wake_up: Vec::new(),
                    }),
                    ..route("sleeping")
                },
                ModelRoute {
                    last_activation: Some(hearth_crds::Duration::new("34.2s")),
                    ..route("zero")
                },
                ModelRoute {
                    model: "org/m:1".into(),
                    ..route("slashed")
                },
            ],
        })
        .unwrap();
        let model = |k: &str| gw.model(k).unwrap();
        model("ns/ready").discovered().replace([
            "10.0.0.1:8000".parse().unwrap(),
            "10.0.0.2:8000".parse().unwrap(),
        ]);
        model("ns/activating").state.lease.raise();
        // Engines discovered, none known awake: the sleeping tier's.
        model("ns/sleeping")
            .discovered()
            .replace(["10.0.0.3:8000".parse().unwrap()]);
        let shared = gw.shared().clone();
        let answer = |path: &str| {
            let parts = head(|b| b.uri(path));
            match own_answer(&shared, &parts) {
                Some(Ok(resp)) => {
                    let body = futures::executor::block_on(http_body_util::BodyExt::collect(
                        resp.into_body(),
                    ))
                    .unwrap()
                    .to_bytes();
                    Ok(serde_json::from_slice::<serde_json::Value>(&body).unwrap())
                }
                Some(Err(r)) => Err(r),
                None => panic!("{path}: not answered"),
            }
        };
        let list = answer("/v1/models").unwrap();
        assert_eq!(list["object"], "list");
        let data = list["data"].as_array().unwrap();
        let ids: Vec<&str> = data.iter().map(|e| e["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["activating", "org/m:1", "ready", "sleeping", "zero"]);
        let entry = |id: &str| data.iter().find(|e| e["id"] == id).unwrap().clone();
        let ready = entry("ready");
        assert_eq!(ready["object"], "model");
        assert_eq!(ready["owned_by"], "hearth");
        assert!(ready["created"].as_u64().unwrap() > 1_700_000_000);
        assert_eq!(
            ready["hearth"],
            serde_json::json!({"service": "ns/ready", "state": "ready", "readyReplicas": 2, "expectedWaitSeconds": null})
        );
        assert_eq!(entry("activating")["hearth"]["state"], "activating");
        assert_eq!(entry("sleeping")["hearth"]["state"], "sleeping");
        assert_eq!(entry("sleeping")["hearth"]["readyReplicas"], 0);
        assert_eq!(entry("zero")["hearth"]["state"], "zero");
        assert_eq!(entry("zero")["hearth"]["expectedWaitSeconds"], 34.2);
        // One entry; its id percent-decoded or not.
        assert_eq!(answer("/v1/models/zero").unwrap(), entry("zero"));
        assert_eq!(answer("/v1/models/org%2Fm%3A1").unwrap()["id"], "org/m:1");
        assert_eq!(answer("/v1/models/org/m:1").unwrap()["id"], "org/m:1");
        assert_eq!(
            answer("/v1/models/nope").err(),
            Some(Rejection::UnknownModel {
                model: "nope".into()
            })
        );
        // Other paths are not the gateway's to answer.
        assert!(own_answer(&shared, &head(|b| b.uri("/v1/completions"))).is_none());
        assert!(own_answer(&shared, &head(|b| b.method(Method::POST).uri("/v1/models"))).is_none());
    }
}

//! The route step: which model a request is for, and which of its LoRA adapters, if any. A
//! single-service gateway has one model, and reads nothing unless the model has adapters or
//! aliases (then the body's `model` says whether the request is for an adapter, or calls the
//! model by an alias: such a body is forwarded with the model's served name, [`renamed`]). A shared gateway reads the body's
//! `model` (as vLLM would, see [`RequestHints`]) and looks it up in its route table,
//! lock-free, where an adapter's name leads to its base model: a request without one gets
//! `400` ([`Rejection::ModelRequired`]), one naming a model not in the table `404`
//! ([`Rejection::UnknownModel`], OpenAI's `model_not_found`). Both are answered at once and
//! raise no demand anywhere; so is a request for an adapter its engines cannot load yet
//! ([`available`]).

use std::sync::Arc;

use axum::http::request::Parts;

use crate::{
    adapters::Target, gateway::Shared, model::Model, openai::RequestHints, reject::Rejection,
};

/// A request's model, and what its body says when it was read for it.
pub(super) struct Routed {
    /// The model the request is for (an adapter's base model).
    pub(super) model: Arc<Model>,
    /// The body's hints, when the route step read them (shared mode, or a model with
    /// adapters); a single-service gateway reads a cold request's body at admission only.
    pub(super) hints: Option<RequestHints>,
    /// The adapter the body's `model` names, if it names one.
    pub(super) adapter: Option<Target>,
}

/// The adapter of `model` that `hints` name (a model's own names and aliases are never an
/// adapter's).
fn adapter(model: &Model, hints: &RequestHints) -> Option<Target> {
    let name = hints.model.as_deref()?;
    if model.answers_to(name) {
        return None;
    }
    model.state.adapters.target(name)
}

/// The body to forward for a request routed to `model` whose body says `hints`: when it calls
/// the model by one of its aliases, `body` with `model` set to the model's served name (the
/// engine serves only that, see [`crate::openai::with_model`]); otherwise `None`, and `body`
/// goes as it came.
pub(super) fn renamed(
    model: &Model,
    hints: Option<&RequestHints>,
    body: &[u8],
) -> Option<bytes::Bytes> {
    let to = model.renamed_from(hints?.model.as_deref()?)?;
    crate::openai::with_model(body, to)
}

/// Refuses a request for an adapter whose route says its engines cannot load it yet
/// ([`Rejection::AdapterUnavailable`], `503` with `Retry-After`): checked before admission,
/// so it tries no load, raises no demand and wakes no engine.
pub(super) fn available(adapter: Option<&Target>) -> Result<(), Rejection> {
    match adapter.and_then(|t| Some((t, t.adapter.unavailable.as_ref()?))) {
        Some((t, reason)) => Err(Rejection::AdapterUnavailable {
            adapter: t.adapter.name.to_string(),
            reason: reason.clone(),
        }),
        None => Ok(()),
    }
}

/// The model of the request with head `parts` and read `body`.
pub(super) fn route(shared: &Shared, parts: &Parts, body: &[u8]) -> Result<Routed, Rejection> {
    if let Some(model) = &shared.single {
        // Without adapters or aliases a warm request is forwarded unread (the engine checks
        // `model`).
        if model.state.adapters.is_empty() && model.cfg.aliases.is_empty() {
            return Ok(Routed {
                model: model.clone(),
                hints: None,
                adapter: None,
            });
        }
        let hints = RequestHints::from_request(&parts.method, &parts.headers, body);
        return Ok(Routed {
            model: model.clone(),
            adapter: adapter(model, &hints),
            hints: Some(hints),
        });
    }
    let hints = RequestHints::from_request(&parts.method, &parts.headers, body);
    let Some(name) = &hints.model else {
        return Err(Rejection::ModelRequired);
    };
    let Some(model) = shared.routes.load().by_name(name).cloned() else {
        return Err(Rejection::UnknownModel {
            model: name.clone(),
        });
    };
    Ok(Routed {
        adapter: adapter(&model, &hints),
        model,
        hints: Some(hints),
    })
}

#[cfg(test)]
mod tests {
    use axum::http::{Method, header};

    use super::*;

    fn head(method: Method, content_type: Option<&str>) -> Parts {
        let mut b = http::Request::builder()
            .method(method)
            .uri("/v1/chat/completions");
        if let Some(ct) = content_type {
            b = b.header(header::CONTENT_TYPE, ct);
        }
        b.body(()).unwrap().into_parts().0
    }

    #[test]
    fn a_shared_gateway_routes_by_model_and_refuses_the_rest() {
        let gw = super::super::test_shared_gateway(&["a", "b"]);
        let shared = gw.shared().clone();
        let post = head(Method::POST, Some("application/json"));
        let routed = route(&shared, &post, br#"{"model":"b","stream":true}"#)
            .unwrap_or_else(|_| panic!("not routed"));
        assert_eq!(routed.model.key(), "ns/b");
        assert!(routed.hints.is_some_and(|h| h.stream));
        assert_eq!(
            route(&shared, &post, br#"{"model":"x"}"#).err(),
            Some(Rejection::UnknownModel { model: "x".into() })
        );
        for (parts, body) in [
            (post.clone(), &br#"{"messages":[]}"#[..]),
            (post.clone(), b"not json"),
            (post.clone(), br#"{"model":3}"#),
            (head(Method::POST, Some("text/plain")), br#"{"model":"a"}"#),
            (head(Method::GET, None), b""),
        ] {
            assert_eq!(
                route(&shared, &parts, body).err(),
                Some(Rejection::ModelRequired),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        // Nothing was admitted anywhere.
        for m in gw.models() {
            assert_eq!(m.demand().state().local(), 0);
        }
    }

    #[test]
    fn an_alias_routes_to_its_model_and_is_forwarded_under_the_served_name() {
        let post = head(Method::POST, Some("application/json"));
        // A single-service gateway with an alias reads the body, and renames only the alias.
        let single = super::super::test_shared(
            crate::GatewayConfig {
                served_model_names: vec!["chat".into()],
                model_aliases: vec!["Qwen/Qwen2.5".into()],
                ..Default::default()
            },
            crate::EndpointSet::new(),
        );
        let body = br#"{"model":"Qwen/Qwen2.5","stream":true}"#;
        let routed = route(&single, &post, body).unwrap_or_else(|_| panic!("not routed"));
        assert!(routed.adapter.is_none());
        let sent = renamed(&routed.model, routed.hints.as_ref(), body);
        assert_eq!(
            sent.as_deref(),
            Some(&br#"{"model":"chat","stream":true}"#[..])
        );
        let own = br#"{"model":"chat"}"#;
        let routed = route(&single, &post, own).unwrap_or_else(|_| panic!("not routed"));
        assert_eq!(renamed(&routed.model, routed.hints.as_ref(), own), None);
        assert_eq!(
            super::super::admit::serves(&routed.model, &RequestHints::from_body(body)),
            Ok(())
        );

        // A shared gateway routes an alias to its model; the alias of one model is no other's.
        let gw = super::super::test_shared_gateway(&[]);
        let mut a = crate::routes::default_route("ns", "a", "a");
        a.aliases = vec!["org/a".into()];
        let b = crate::routes::default_route("ns", "b", "b");
        gw.apply_routes(&hearth_crds::llmendpoint::RouteTable { models: vec![a, b] })
            .unwrap();
        let shared = gw.shared().clone();
        let body = br#"{"model":"org/a"}"#;
        let routed = route(&shared, &post, body).unwrap_or_else(|_| panic!("not routed"));
        assert_eq!(routed.model.key(), "ns/a");
        assert_eq!(
            renamed(&routed.model, routed.hints.as_ref(), body).as_deref(),
            Some(&br#"{"model":"a"}"#[..])
        );
        let routed =
            route(&shared, &post, br#"{"model":"b"}"#).unwrap_or_else(|_| panic!("not routed"));
        assert_eq!(routed.model.key(), "ns/b");
        assert_eq!(
            route(&shared, &post, br#"{"model":"org/b"}"#).err(),
            Some(Rejection::UnknownModel {
                model: "org/b".into()
            })
        );
    }

    #[test]
    fn a_single_service_gateway_reads_nothing() {
        let shared =
            super::super::test_shared(crate::GatewayConfig::default(), crate::EndpointSet::new());
        let routed = route(&shared, &head(Method::POST, None), br#"{"model":"x"}"#)
            .unwrap_or_else(|_| panic!("not routed"));
        assert!(routed.hints.is_none());
    }
}

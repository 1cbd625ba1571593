//! The admission step: once the body is read, a cold request's model is checked against the
//! served model names, draining is checked again, and the request takes one of `--max-queue`
//! slots. A request refused here never raises demand, so it never wakes a model.

use axum::http::request::Parts;

use crate::{demand::Admission, gateway::Shared, openai::RequestHints, reject::Rejection};

/// An admitted request: its slot, and whether a cold one asked for a stream (`"stream": true`),
/// which decides how it is held.
pub(super) struct Admitted {
    /// The request's place in `--max-queue`, given back when dropped.
    pub(super) slot: Admission,
    /// Read from the body of a cold request only; a warm one is forwarded unparsed.
    pub(super) stream: bool,
}

/// Admits the request with head `parts` and read `body`; `cold`: no backend is ready.
///
/// Only a cold request's body is parsed: a ready backend checks `model` itself (vLLM's
/// `404 The model ... does not exist`).
pub(super) fn admit(
    shared: &Shared,
    parts: &Parts,
    body: &[u8],
    cold: bool,
) -> Result<Admitted, Rejection> {
    let hints = if cold {
        RequestHints::from_request(&parts.method, &parts.headers, body)
    } else {
        RequestHints::default()
    };
    serves(shared, &hints)?;
    // Draining may have begun while the body arrived: nothing new is admitted after it.
    if shared.is_draining() {
        return Err(Rejection::Draining);
    }
    let slot = shared.demand.try_admit().ok_or(Rejection::QueueFull {
        max_queue: shared.cfg.max_queue,
    })?;
    Ok(Admitted {
        slot,
        stream: hints.stream,
    })
}

/// Whether the replica serves the model `hints` names (any, when it names none or the served
/// model names are not configured); else [`Rejection::UnknownModel`], answered `404` as vLLM
/// does. Checked for a request that is or turns cold: a ready engine checks it itself.
pub(super) fn serves(shared: &Shared, hints: &RequestHints) -> Result<(), Rejection> {
    let served = &shared.cfg.served_model_names;
    match &hints.model {
        Some(model) if !served.is_empty() && !served.contains(model) => {
            Err(Rejection::UnknownModel {
                model: model.clone(),
            })
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use axum::http::Method;

    use super::*;

    fn post() -> Parts {
        let (parts, ()) = http::Request::builder()
            .method(Method::POST)
            .uri("/v1/completions")
            .body(())
            .unwrap()
            .into_parts();
        parts
    }

    fn served(names: &[&str], max_queue: u64) -> crate::GatewayConfig {
        crate::GatewayConfig {
            served_model_names: names.iter().map(|n| (*n).to_owned()).collect(),
            max_queue,
            ..Default::default()
        }
    }

    #[test]
    fn a_cold_request_for_another_model_is_refused_before_it_raises_demand() {
        let shared = super::super::test_shared(served(&["m"], 10), crate::EndpointSet::new());
        let body = br#"{"model":"other","stream":true}"#;
        assert_eq!(
            admit(&shared, &post(), body, true).err(),
            Some(Rejection::UnknownModel {
                model: "other".into()
            })
        );
        assert_eq!(shared.demand.state().pending(), 0);
        // Warm: the backend answers it; the body is not parsed.
        let warm = admit(&shared, &post(), body, false).unwrap_or_else(|_| panic!("refused"));
        assert!(!warm.stream);
        assert_eq!(shared.demand.state().pending(), 1);
    }

    #[test]
    fn a_cold_request_tells_whether_it_streams() {
        let shared = super::super::test_shared(served(&["m"], 10), crate::EndpointSet::new());
        let a = admit(&shared, &post(), br#"{"model":"m","stream":true}"#, true);
        assert!(a.is_ok_and(|a| a.stream));
        // No served names: any model is forwarded.
        let shared = super::super::test_shared(served(&[], 10), crate::EndpointSet::new());
        let a = admit(&shared, &post(), br#"{"model":"x"}"#, true);
        assert!(a.is_ok_and(|a| !a.stream));
    }

    #[test]
    fn admission_stops_at_max_queue_and_while_draining() {
        let gw = super::super::test_gateway(served(&[], 1), crate::EndpointSet::new());
        let shared = gw.shared().clone();
        let first = admit(&shared, &post(), b"", false).unwrap_or_else(|_| panic!("refused"));
        assert_eq!(
            admit(&shared, &post(), b"", false).err(),
            Some(Rejection::QueueFull { max_queue: 1 })
        );
        drop(first);
        gw.start_drain();
        assert_eq!(
            admit(&shared, &post(), b"", false).err(),
            Some(Rejection::Draining)
        );
    }
}

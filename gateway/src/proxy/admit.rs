//! The admission step: once the body is read and the model known, a cold request's model is
//! checked against the served model names, draining is checked again, the tenant's quotas are
//! charged ([`crate::quota`]), and the request takes one of its model's `maxQueue` slots. A
//! request refused here never raises demand, so it never wakes a model.

use axum::http::request::Parts;

use super::forward::Dispatch;
use crate::{
    demand::Admission,
    fair::{Claim, TenantId},
    gateway::Shared,
    model::Model,
    openai::RequestHints,
    reject::Rejection,
};

/// A request's place in its model's queue (and, in shared mode, in the replica's count of
/// admitted requests, for drain); given back when dropped.
pub(super) struct Slot {
    _model: Admission,
    _replica: Option<Admission>,
}

impl Slot {
    /// A slot of `model`'s queue, for the steps' unit tests.
    #[cfg(test)]
    pub(super) fn of(model: &Model) -> Option<Self> {
        Some(Self {
            _model: model.state.demand.try_admit()?,
            _replica: None,
        })
    }
}

/// An admitted request: its slot, and whether a cold one asked for a stream (`"stream": true`),
/// which decides how it is held.
pub(super) struct Admitted {
    /// The request's place in `--max-queue`, given back when dropped.
    pub(super) slot: Slot,
    /// Read from the body of a cold request, or of any request a shared gateway routed; a
    /// single-service gateway forwards a warm one unparsed (unless its tenant has a quota).
    pub(super) stream: bool,
    /// Who it is dispatched for, and its estimated cost.
    pub(super) dispatch: Dispatch,
}

/// Admits the request of `tenant` with head `parts` and read `body` for `model`; `hints` are
/// the body's when the route step read them; `cold`: no backend of the model is ready.
///
/// Only a cold request's body is parsed here: a ready backend checks `model` itself (vLLM's
/// `404 The model ... does not exist`).
pub(super) fn admit(
    shared: &Shared,
    model: &Model,
    parts: &Parts,
    body: &[u8],
    hints: Option<RequestHints>,
    cold: bool,
    tenant: TenantId,
) -> Result<Admitted, Rejection> {
    let limited = shared.quotas.limited(tenant);
    let hints = match hints {
        Some(hints) => hints,
        None if cold || limited => RequestHints::from_request(&parts.method, &parts.headers, body),
        None => RequestHints::default(),
    };
    serves(model, &hints)?;
    // Draining may have begun while the body arrived: nothing new is admitted after it.
    if shared.is_draining() {
        return Err(Rejection::Draining);
    }
    let prompt_tokens = body.len() as u64 / 4;
    let quota = if limited {
        let estimate = prompt_tokens + hints.max_tokens.unwrap_or(0);
        shared
            .quotas
            .admit(tenant, estimate, std::time::Instant::now())
            .map_err(Rejection::RateLimited)?;
        // Given back if the request goes no further (queue full, cold reject, timeout, ...).
        Some(std::sync::Arc::new(crate::quota::Charge::new(
            shared.quotas.clone(),
            tenant,
            estimate,
        )))
    } else {
        None
    };
    let t = shared.cfg.tenants.get(tenant);
    let dispatch = Dispatch {
        claim: Claim {
            tenant,
            priority: t.priority,
        },
        tenant: t.name.clone(),
        prompt_tokens,
        quota,
    };
    let slot = model.state.demand.try_admit().ok_or(Rejection::QueueFull {
        max_queue: model.cfg.max_queue,
    })?;
    // A single-service gateway's model hub is the replica's count already.
    let replica = match shared.single {
        Some(_) => None,
        None => shared.admitted.try_admit(),
    };
    Ok(Admitted {
        slot: Slot {
            _model: slot,
            _replica: replica,
        },
        stream: hints.stream,
        dispatch,
    })
}

/// Whether `model` serves the model `hints` names (any, when it names none or the served
/// model names are not configured), under one of its names or aliases, or as one of its
/// adapters; else
/// [`Rejection::UnknownModel`], answered `404` as vLLM does. Checked for a request that is or
/// turns cold: a ready engine checks it itself.
pub(super) fn serves(model: &Model, hints: &RequestHints) -> Result<(), Rejection> {
    let served = &model.cfg.served_model_names;
    match &hints.model {
        Some(name)
            if !served.is_empty()
                && !model.answers_to(name)
                && model.state.adapters.catalog().get(name).is_none() =>
        {
            Err(Rejection::UnknownModel {
                model: name.clone(),
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
        let model = super::super::the_model(&shared);
        let body = br#"{"model":"other","stream":true}"#;
        assert_eq!(
            admit(&shared, &model, &post(), body, None, true, 0).err(),
            Some(Rejection::UnknownModel {
                model: "other".into()
            })
        );
        assert_eq!(model.demand().state().pending(), 0);
        // Warm: the backend answers it; the body is not parsed.
        let warm = admit(&shared, &model, &post(), body, None, false, 0)
            .unwrap_or_else(|_| panic!("refused"));
        assert!(!warm.stream);
        assert_eq!(model.demand().state().pending(), 1);
    }

    #[test]
    fn a_cold_request_tells_whether_it_streams() {
        let shared = super::super::test_shared(served(&["m"], 10), crate::EndpointSet::new());
        let model = super::super::the_model(&shared);
        let a = admit(
            &shared,
            &model,
            &post(),
            br#"{"model":"m","stream":true}"#,
            None,
            true,
            0,
        );
        assert!(a.is_ok_and(|a| a.stream));
        // No served names: any model is forwarded.
        let shared = super::super::test_shared(served(&[], 10), crate::EndpointSet::new());
        let model = super::super::the_model(&shared);
        let a = admit(&shared, &model, &post(), br#"{"model":"x"}"#, None, true, 0);
        assert!(a.is_ok_and(|a| !a.stream));
    }

    #[test]
    fn admission_stops_at_max_queue_and_while_draining() {
        let gw = super::super::test_gateway(served(&[], 1), crate::EndpointSet::new());
        let shared = gw.shared().clone();
        let model = super::super::the_model(&shared);
        let first = admit(&shared, &model, &post(), b"", None, false, 0)
            .unwrap_or_else(|_| panic!("refused"));
        assert_eq!(
            admit(&shared, &model, &post(), b"", None, false, 0).err(),
            Some(Rejection::QueueFull { max_queue: 1 })
        );
        drop(first);
        gw.start_drain();
        assert_eq!(
            admit(&shared, &model, &post(), b"", None, false, 0).err(),
            Some(Rejection::Draining)
        );
    }

    #[test]
    fn each_model_of_a_shared_gateway_has_its_own_queue() {
        let gw = super::super::test_shared_gateway(&["a", "b"]);
        let shared = gw.shared().clone();
        let (a, b) = (
            gw.model("ns/a").unwrap_or_else(|| panic!("no a")),
            gw.model("ns/b").unwrap_or_else(|| panic!("no b")),
        );
        // `a` full (its maxQueue is 2): 429 for `a` only.
        let held: Vec<_> = (0..2)
            .map(|_| {
                admit(&shared, &a, &post(), b"", None, true, 0)
                    .unwrap_or_else(|_| panic!("refused"))
            })
            .collect();
        assert_eq!(
            admit(&shared, &a, &post(), b"", None, true, 0).err(),
            Some(Rejection::QueueFull { max_queue: 2 })
        );
        let other = admit(&shared, &b, &post(), b"", None, true, 0)
            .unwrap_or_else(|_| panic!("b refused while a is full"));
        assert_eq!(a.demand().state().pending(), 2);
        assert_eq!(b.demand().state().pending(), 1);
        // The replica counts every admitted request, for drain.
        assert_eq!(gw.demand().state().pending(), 3);
        drop((held, other));
        assert_eq!(gw.demand().state().pending(), 0);
    }
}

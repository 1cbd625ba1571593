//! The first half of a plan: what the spec asks for, before the cluster is looked at. The rules
//! both the controller and the admission webhook apply (`hearth_crds::rules::check_llmservice`),
//! runtime resolution and rendering. Pure, so its agreement with the webhook is tested without a
//! cluster (`tests/rules_agreement.rs`).

use hearth_crds::{InferenceRuntime, LLMService, LLMServicePhase, rules};
use kube::ResourceExt;

use crate::{
    attach::Verdict,
    render::{self, Children, Placement, RenderConfig, SharedGateway},
    resolve::{ResolveError, resolve_runtime},
    status::{self, Cond},
};

/// What the LLMEndpoint a service references decided about it (see [`crate::attach`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Membership {
    /// Accepted or why not: the service's `EndpointAccepted` condition.
    pub verdict: Verdict,
    /// The endpoint's shared gateway, when accepted: then the service renders none of its own.
    pub gateway: Option<SharedGateway>,
}

impl Membership {
    /// Where the service's gateway is.
    pub fn placement(membership: Option<&Membership>) -> Placement {
        match membership.and_then(|m| m.gateway.clone()) {
            Some(g) => Placement::Shared(g),
            None => Placement::Own,
        }
    }

    /// The service's `EndpointAccepted` condition.
    pub fn condition(&self) -> Cond {
        Cond::new(
            status::ENDPOINT_ACCEPTED,
            Some(self.gateway.is_some()),
            self.verdict.reason.as_str(),
            self.verdict.message.clone(),
        )
    }
}

/// What the spec asks for: the conditions the rules and runtime resolution decide, and the
/// rendered children (none when the service cannot be rendered). [`super::plan()`] turns it into
/// writes against what the caches hold.
#[derive(Debug)]
pub struct Desired {
    /// The phase when nothing is rendered (`Degraded` for a spec error, `Pending` without a
    /// runtime); once children are applied their state decides it.
    pub phase: LLMServicePhase,
    /// The resolved runtime's name.
    pub resolved_runtime: Option<String>,
    /// The conditions decided so far: `Validated`, `RuntimeResolved`, and when nothing is
    /// rendered the `False` conditions saying why.
    pub conds: Vec<Cond>,
    /// The children to apply; `None` when the service cannot be rendered.
    pub children: Option<Children>,
    /// Where the service's gateway is: its own, or its endpoint's.
    pub placement: Placement,
}

/// Decides what `svc` asks for given the cluster's `runtimes` and, with a
/// `sharedEndpointRef`, what its endpoint decided (`membership`: `None` without a reference);
/// `create_backend` as for [`render::render`]; `adapters` are its accepted LLMAdapters and
/// their fetch Jobs.
pub fn desired<'a>(
    svc: &LLMService,
    runtimes: impl IntoIterator<Item = &'a InferenceRuntime>,
    cfg: &RenderConfig,
    create_backend: bool,
    membership: Option<&Membership>,
    adapters: &render::ServiceAdapters,
) -> Desired {
    let resolved = resolve_runtime(svc, runtimes);
    let findings = rules::check_llmservice(svc, resolved.as_ref().ok().map(|r| r.runtime));
    let mut out = Desired {
        phase: LLMServicePhase::Pending,
        resolved_runtime: None,
        conds: vec![status::validated(&findings)],
        children: None,
        placement: Membership::placement(membership),
    };
    if let Some(m) = membership {
        out.conds.push(m.condition());
    }
    let resolved = match resolved {
        Err(e) => {
            out.conds.push(Cond::new(
                status::RUNTIME_RESOLVED,
                Some(false),
                e.reason(),
                e.to_string(),
            ));
            if !findings.blocks_rendering() {
                out.conds.push(not_ready_for(&e));
                return out;
            }
            None
        }
        Ok(resolved) => {
            out.resolved_runtime = Some(resolved.runtime.name_any());
            out.conds.push(Cond::new(
                status::RUNTIME_RESOLVED,
                Some(true),
                resolved.reason,
                resolved.message.clone(),
            ));
            Some(resolved)
        }
    };
    // A spec error is reported whether or not there is a runtime: it is what to fix.
    if findings.blocks_rendering() {
        out.phase = LLMServicePhase::Degraded;
        out.conds.extend(status::rule_errors(&findings));
        return out;
    }
    let Some(resolved) = resolved else {
        return out;
    };
    match render::render_with_adapters(
        svc,
        resolved.runtime,
        cfg,
        create_backend,
        &out.placement,
        adapters,
    ) {
        Err(e) => {
            let (type_, reason) = e.condition();
            out.phase = LLMServicePhase::Degraded;
            if type_ == status::CACHE_READY {
                out.conds.push(Cond::new(
                    status::CACHE_READY,
                    Some(false),
                    reason,
                    e.to_string(),
                ));
                out.conds.push(Cond::new(
                    status::READY,
                    Some(false),
                    "CacheNotReady",
                    "see the CacheReady condition",
                ));
            } else {
                out.conds
                    .push(Cond::new(status::READY, Some(false), reason, e.to_string()));
            }
        }
        Ok(children) => out.children = Some(children),
    }
    out
}

fn not_ready_for(e: &ResolveError) -> Cond {
    Cond::new(
        status::READY,
        Some(false),
        "RuntimeNotResolved",
        format!("no runtime: {e}"),
    )
}

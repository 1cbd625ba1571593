//! The first half of a plan: what the spec asks for, before the cluster is looked at. The rules
//! both the controller and the admission webhook apply (`hearth_crds::rules::check_llmservice`),
//! runtime resolution and rendering. Pure, so its agreement with the webhook is tested without a
//! cluster (`tests/rules_agreement.rs`).

use hearth_crds::{InferenceRuntime, LLMService, LLMServicePhase, rules};
use kube::ResourceExt;

use crate::{
    render::{self, Children, RenderConfig},
    resolve::{ResolveError, resolve_runtime},
    status::{self, Cond},
};

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
}

/// Decides what `svc` asks for given the cluster's `runtimes`; `create_backend` as for
/// [`render::render`].
pub fn desired<'a>(
    svc: &LLMService,
    runtimes: impl IntoIterator<Item = &'a InferenceRuntime>,
    cfg: &RenderConfig,
    create_backend: bool,
) -> Desired {
    let resolved = resolve_runtime(svc, runtimes);
    let findings = rules::check_llmservice(svc, resolved.as_ref().ok().map(|r| r.runtime));
    let mut out = Desired {
        phase: LLMServicePhase::Pending,
        resolved_runtime: None,
        conds: vec![status::validated(&findings)],
        children: None,
    };
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
    match render::render(svc, resolved.runtime, cfg, create_backend) {
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

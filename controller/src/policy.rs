//! The policy step of backend rendering: the plain Deployment skeleton that [`mod@crate::render`]
//! builds goes through Hearth's policy engine (`hearth-policies`) in-process — the built-in
//! `ServingPolicy` mutations of `policies/builtin/*.yaml` with the resolved InferenceRuntime as
//! `params` and the LLMService as `service`: accelerator request, model-load-aware probes,
//! preStop drain and grace period, scheduler, nodeSelector, tolerations, queue, shared memory.
//! The same policies run in the admission webhook, so a backend rendered here and a plain
//! Deployment annotated for a runtime get the same treatment, and the controller never depends
//! on the webhook being up.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use hearth_crds::wellknown::POLICY_REPORTS_ANNOTATION;
use hearth_crds::{InferenceRuntime, LLMService, ServingPolicy, servingpolicy::Operation};
use hearth_policies::{
    EvalInput, MutateError, Mutated, MutationReport, PolicySet, PolicySettings,
    manifest::runtime_params,
};
use k8s_openapi::api::apps::v1::Deployment;

/// Why the policy step could not complete the backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// An embedded built-in policy did not parse or compile (a build defect, reported).
    #[error("built-in ServingPolicies: {0}")]
    Builtin(String),
    /// `fraction` with a sharing runtime, but no policy changes the backend for it: the built-ins
    /// render no fractions, a platform policy (like `examples/hami/fraction-policy.yaml`) must.
    #[error(
        "spec.resources.fraction: no ServingPolicy renders fractional devices for this backend (the built-ins do not; install a platform policy such as examples/hami/fraction-policy.yaml), so it would get whole devices; request whole devices (remove fraction) or add such a policy"
    )]
    FractionNotRendered,
    /// A `Fail` policy could not be evaluated.
    #[error("rendering the backend through the ServingPolicies failed: {0}")]
    Mutate(#[from] MutateError),
    /// The mutated object is not a Deployment any more (a policy bug), or did not serialize.
    #[error("the ServingPolicies produced an invalid Deployment: {0}")]
    Invalid(String),
}

/// The compiled policies the backend is rendered with. Cheap to clone (an `Arc` inside).
#[derive(Clone)]
pub struct Engine {
    set: PolicySet,
    names: Arc<[String]>,
    sources: Arc<[ServingPolicy]>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("policies", &self.names)
            .finish()
    }
}

/// The built-in ServingPolicies embedded in `hearth-policies`, in evaluation order.
pub fn builtin_policies() -> Result<Vec<ServingPolicy>, PolicyError> {
    hearth_policies::builtin::policies().map_err(|e| PolicyError::Builtin(e.to_string()))
}

impl Engine {
    /// Compiles `policies`; any that fails to compile is an error (the controller must not
    /// render with a silently smaller set).
    pub fn new(policies: &[ServingPolicy]) -> Result<Self, PolicyError> {
        let (set, errors) = PolicySet::compile(policies);
        if !errors.is_empty() {
            let msgs: Vec<String> = errors.iter().map(|e| e.to_string()).collect();
            return Err(PolicyError::Builtin(msgs.join("; ")));
        }
        let names = set.names().into_iter().map(str::to_owned).collect();
        Ok(Self {
            set,
            names,
            sources: policies.into(),
        })
    }

    /// The built-in policies.
    pub fn builtin() -> Result<Self, PolicyError> {
        Self::new(&builtin_policies()?)
    }

    /// Names of the compiled policies.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The policies, in evaluation order.
    pub fn policies(&self) -> &[ServingPolicy] {
        &self.sources
    }

    /// The compiled set.
    pub fn policy_set(&self) -> &PolicySet {
        &self.set
    }
}

/// The engine the controller renders with: the built-ins and the cluster's ServingPolicies
/// (the set the webhook evaluates, built the same way by `hearth_policies::cluster`), replaced
/// as a whole when a policy changes. Each replacement counts up a generation that
/// [`ClusterEngine::subscribe`] announces (the background scan's trigger, `crate::scan`).
#[derive(Clone, Debug)]
pub struct ClusterEngine {
    engine: Arc<RwLock<Engine>>,
    generation: Arc<tokio::sync::watch::Sender<u64>>,
}

impl ClusterEngine {
    /// Starts with `engine` (the built-ins) until the first list of the cluster's policies.
    pub fn new(engine: Engine) -> Self {
        Self {
            engine: Arc::new(RwLock::new(engine)),
            generation: Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// The current engine.
    pub fn current(&self) -> Engine {
        match self.engine.read() {
            Ok(e) => e.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    /// A receiver that sees every replacement of the engine (a generation, counting up).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.generation.subscribe()
    }

    fn set(&self, engine: Engine) {
        match self.engine.write() {
            Ok(mut e) => *e = engine,
            Err(poisoned) => *poisoned.into_inner() = engine,
        }
        self.generation.send_modify(|g| *g += 1);
    }

    /// Rebuilds the engine from `builtins` and the cluster's policies (each compiled on its own;
    /// a broken edit keeps its last good version and is logged once). Returns whether the set
    /// of policies changed.
    pub fn rebuild(
        &self,
        builtins: &[ServingPolicy],
        last_good: &mut hearth_policies::cluster::LastGood,
        cluster: &[Arc<ServingPolicy>],
    ) -> bool {
        for st in last_good.update(cluster) {
            if st.fresh
                && let Some(e) = &st.error
            {
                tracing::warn!(policy = ?st.policy.metadata.name, error = %e, "ServingPolicy does not compile; backends are rendered with its last good version, if any");
            }
        }
        let order = last_good.evaluation_order(builtins);
        let (set, errors) = PolicySet::compile(&order);
        for e in errors {
            tracing::error!(error = %e, "policy left out of the set");
        }
        let names: Arc<[String]> = set.names().into_iter().map(str::to_owned).collect();
        let changed = {
            let current = self.current();
            // Same names in the same order and every one the same version as before.
            let key = |p: &ServingPolicy| {
                (
                    p.metadata.name.clone(),
                    p.metadata.uid.clone(),
                    p.metadata.generation,
                    p.spec.clone(),
                )
            };
            current.names != names || !current.sources.iter().map(key).eq(order.iter().map(key))
        };
        if changed {
            self.set(Engine {
                set,
                names,
                sources: order.into(),
            });
        }
        changed
    }
}

/// How long to gather ServingPolicy changes before one rebuild.
pub const DEBOUNCE: Duration = Duration::from_millis(100);

/// Runs the mutations over the backend Deployment of `service` with `runtime` as `params` and
/// `settings` as `settings`. The Deployment comes back with
/// [`POLICY_REPORTS_ANNOTATION`] on its metadata when a policy reports its mutations
/// (`spec.mutationActions` `Warn` or `Audit`; report-only ones change nothing else).
///
/// A `fraction` is refused unless the runtime shares devices and some policy renders it: the
/// backend is rendered once more without the fraction, and when both come out the same no
/// policy acted on it (the pod would silently get whole devices).
pub fn apply(
    engine: &Engine,
    deployment: Deployment,
    service: &LLMService,
    runtime: &InferenceRuntime,
    settings: &PolicySettings,
) -> Result<Deployment, PolicyError> {
    let mutated = if service.spec.resources.fraction.is_some() {
        // A runtime without sharing is refused before rendering (`hearth_crds::rules`).
        let mut whole = service.clone();
        whole.spec.resources.fraction = None;
        let with = mutate(engine, &deployment, service, runtime, settings)?;
        let without = mutate(engine, &deployment, &whole, runtime, settings)?;
        if with.object == without.object {
            return Err(PolicyError::FractionNotRendered);
        }
        with
    } else {
        mutate(engine, &deployment, service, runtime, settings)?
    };
    let mut backend: Deployment =
        serde_json::from_value(mutated.object).map_err(|e| PolicyError::Invalid(e.to_string()))?;
    if !mutated.reports.is_empty() {
        let warnings: Vec<String> = mutated
            .reports
            .iter()
            .map(MutationReport::warning)
            .collect();
        backend.metadata.annotations.get_or_insert_default().insert(
            POLICY_REPORTS_ANNOTATION.to_owned(),
            serde_json::to_string(&warnings).map_err(|e| PolicyError::Invalid(e.to_string()))?,
        );
    }
    Ok(backend)
}

/// The reports on a rendered backend ([`POLICY_REPORTS_ANNOTATION`]); empty when it has none
/// (or an unreadable one).
pub fn reports_of(backend: &Deployment) -> Vec<String> {
    backend
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(POLICY_REPORTS_ANNOTATION))
        .and_then(|v| serde_json::from_str(v).ok())
        .unwrap_or_default()
}

fn mutate(
    engine: &Engine,
    deployment: &Deployment,
    service: &LLMService,
    runtime: &InferenceRuntime,
    settings: &PolicySettings,
) -> Result<Mutated, PolicyError> {
    let object =
        serde_json::to_value(deployment).map_err(|e| PolicyError::Invalid(e.to_string()))?;
    let input = EvalInput {
        params: Some(runtime_params(runtime)),
        service: Some(
            serde_json::to_value(service).map_err(|e| PolicyError::Invalid(e.to_string()))?,
        ),
        settings: Some(settings.to_value()),
        ..EvalInput::for_object(object, Operation::Create)
    };
    Ok(engine.set.mutate(&input)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_compile() {
        let engine = Engine::builtin().unwrap();
        assert!(
            engine
                .names()
                .iter()
                .any(|n| n == "hearth-serving-defaults"),
            "{:?}",
            engine.names()
        );
    }
}

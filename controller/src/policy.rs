//! The policy step of backend rendering: the plain Deployment skeleton that [`crate::render`]
//! builds goes through Hearth's policy engine (`hearth-policies`) in-process — the built-in
//! `ServingPolicy` mutations of `policies/builtin/*.yaml` with the resolved InferenceRuntime as
//! `params` and the LLMService as `service`: accelerator request, model-load-aware probes,
//! preStop drain and grace period, scheduler, nodeSelector, tolerations, queue, shared memory.
//! The same policies run in the admission webhook, so a backend rendered here and a plain
//! Deployment annotated for a runtime get the same treatment, and the controller never depends
//! on the webhook being up.

use std::sync::Arc;

use hearth_crds::{InferenceRuntime, LLMService, ServingPolicy, servingpolicy::Operation};
use hearth_policies::{
    EvalInput, MutateError, PolicySet, PolicySettings, manifest::runtime_params,
};
use k8s_openapi::api::apps::v1::Deployment;

/// Why the policy step could not complete the backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// An embedded built-in policy did not parse or compile (a build defect, reported).
    #[error("built-in ServingPolicies: {0}")]
    Builtin(String),
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
        Ok(Self { set, names })
    }

    /// The built-in policies.
    pub fn builtin() -> Result<Self, PolicyError> {
        Self::new(&builtin_policies()?)
    }

    /// Names of the compiled policies.
    pub fn names(&self) -> &[String] {
        &self.names
    }
}

/// Runs the mutations over the backend Deployment of `service` with `runtime` as `params` and
/// `settings` as `settings`.
pub fn apply(
    engine: &Engine,
    deployment: Deployment,
    service: &LLMService,
    runtime: &InferenceRuntime,
    settings: &PolicySettings,
) -> Result<Deployment, PolicyError> {
    let object =
        serde_json::to_value(&deployment).map_err(|e| PolicyError::Invalid(e.to_string()))?;
    let input = EvalInput {
        params: Some(runtime_params(runtime)),
        service: Some(
            serde_json::to_value(service).map_err(|e| PolicyError::Invalid(e.to_string()))?,
        ),
        settings: Some(settings.to_value()),
        ..EvalInput::for_object(object, Operation::Create)
    };
    let mutated = engine.set.mutate(&input)?;
    serde_json::from_value(mutated.object).map_err(|e| PolicyError::Invalid(e.to_string()))
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

//! The policy step of backend rendering: runtime specifics (accelerator request, model-load-aware
//! probes, preStop drain and grace period, scheduler, nodeSelector, tolerations, queue) laid onto
//! the plain Deployment skeleton that [`crate::render`] builds.
//!
//! Everything vendor-specific goes through [`apply`], the one seam where the policy engine crate
//! (`hearth-policies`, running the built-in `ServingPolicy` mutations in-process) plugs in. Until
//! it is a dependency of this crate, [`apply`] performs the same default behaviours directly from
//! the `InferenceRuntime` fields, so rendered backends are complete and schedulable.

use std::collections::BTreeMap;

use hearth_crds::{InferenceRuntime, LLMService, wellknown::VOLCANO_QUEUE_ANNOTATION};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{ExecAction, Lifecycle, LifecycleHandler},
    },
    apimachinery::pkg::api::resource::Quantity,
};

/// Name of the serving container in the backend pod; the policy step finds it by this name.
pub const SERVING_CONTAINER: &str = "server";

/// Extra grace beyond the drain window, for the engine's own shutdown after the drain.
const GRACE_MARGIN_SECONDS: i64 = 15;

/// Why the policy step could not complete the backend.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyError {
    /// The skeleton has no serving container (a bug in the renderer, reported rather than panicking).
    #[error("backend Deployment has no container named {SERVING_CONTAINER:?}")]
    NoServingContainer,
    /// `fraction` with a runtime that does not share devices.
    #[error(
        "spec.resources.fraction: InferenceRuntime {0} does not support device sharing (spec.accelerator.sharing.supported is false); remove fraction or pick a runtime that shares devices"
    )]
    SharingUnsupported(String),
    /// `fraction` with a sharing runtime: the per-vendor fraction resources come from
    /// `ServingPolicy` mutations, which this build does not run yet.
    #[error(
        "spec.resources.fraction: fractional devices are rendered by sharing policies that this controller build does not include; request whole devices (remove fraction)"
    )]
    FractionNeedsPolicyEngine,
    /// A duration field did not parse.
    #[error("{field}: {source}")]
    Duration {
        /// The field path.
        field: &'static str,
        /// The parse error.
        source: hearth_crds::DurationError,
    },
}

/// Applies the runtime's mutations to the backend Deployment of `service`.
pub fn apply(
    mut deployment: Deployment,
    service: &LLMService,
    runtime: &InferenceRuntime,
) -> Result<Deployment, PolicyError> {
    let rt = &runtime.spec;
    let runtime_name = runtime.metadata.name.clone().unwrap_or_default();
    if service.spec.resources.fraction.is_some() {
        return Err(if rt.accelerator.sharing.supported {
            PolicyError::FractionNeedsPolicyEngine
        } else {
            PolicyError::SharingUnsupported(runtime_name)
        });
    }
    let drain =
        service
            .spec
            .scaling
            .drain_timeout
            .get()
            .map_err(|source| PolicyError::Duration {
                field: "spec.scaling.drainTimeout",
                source,
            })?;
    let drain_secs = i64::try_from(drain.as_secs()).unwrap_or(i64::MAX / 2)
        + i64::from(drain.subsec_nanos() > 0);

    let spec = deployment.spec.get_or_insert_with(Default::default);
    let template = &mut spec.template;
    let pod = template.spec.get_or_insert_with(Default::default);

    // Scheduling: the runtime's nodeSelector, tolerations, scheduler and queue.
    if !rt.accelerator.node_selector.is_empty() {
        pod.node_selector
            .get_or_insert_with(BTreeMap::new)
            .extend(rt.accelerator.node_selector.clone());
    }
    if !rt.accelerator.tolerations.is_empty() {
        pod.tolerations
            .get_or_insert_with(Vec::new)
            .extend(rt.accelerator.tolerations.iter().cloned());
    }
    if let Some(name) = rt
        .accelerator
        .scheduler
        .name
        .as_deref()
        .filter(|n| !n.is_empty())
    {
        pod.scheduler_name = Some(name.to_owned());
    }
    if let Some(queue) = rt
        .accelerator
        .scheduler
        .queue
        .as_deref()
        .filter(|q| !q.is_empty())
    {
        template
            .metadata
            .get_or_insert_with(Default::default)
            .annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(VOLCANO_QUEUE_ANNOTATION.to_owned(), queue.to_owned());
    }

    // Grace period: the runtime's base, widened so the drain fits.
    let base = rt.lifecycle.termination_grace_period_seconds.unwrap_or(30);
    if rt.lifecycle.pre_stop_drain {
        pod.termination_grace_period_seconds = Some(base.max(drain_secs + GRACE_MARGIN_SECONDS));
    } else {
        pod.termination_grace_period_seconds = Some(base);
    }

    let container = pod
        .containers
        .iter_mut()
        .find(|c| c.name == SERVING_CONTAINER)
        .ok_or(PolicyError::NoServingContainer)?;

    // Accelerator: whole devices as an extended resource (limits only; requests default to it).
    container
        .resources
        .get_or_insert_with(Default::default)
        .limits
        .get_or_insert_with(BTreeMap::new)
        .insert(
            rt.accelerator.resource_name.clone(),
            Quantity(service.spec.resources.accelerators.to_string()),
        );

    container.readiness_probe = rt.health.readiness.clone();
    container.liveness_probe = rt.health.liveness.clone();
    container.startup_probe = rt.health.startup.clone();

    if rt.lifecycle.pre_stop_drain {
        container.lifecycle = Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                exec: Some(ExecAction {
                    command: Some(vec![
                        "python3".to_owned(),
                        "-c".to_owned(),
                        drain_script(rt.container.port.container_port, drain_secs),
                    ]),
                }),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    Ok(deployment)
}

/// The preStop drain: poll the engine's Prometheus metrics on localhost until no request is
/// running or waiting, bounded by the drain timeout. vLLM and its forks export
/// `vllm:num_requests_running` / `vllm:num_requests_waiting`; if the metrics cannot be read the
/// hook ends at once rather than holding the pod for nothing. Python because every vLLM image
/// ships it (curl is not guaranteed).
fn drain_script(port: i32, timeout_secs: i64) -> String {
    format!(
        "import time,urllib.request\n\
         end=time.time()+{timeout_secs}\n\
         while time.time()<end:\n\
         \x20try:\n\
         \x20 body=urllib.request.urlopen('http://127.0.0.1:{port}/metrics',timeout=2).read().decode()\n\
         \x20except Exception:\n\
         \x20 break\n\
         \x20busy=sum(float(l.rsplit(' ',1)[1]) for l in body.splitlines() if l.startswith(('vllm:num_requests_running','vllm:num_requests_waiting')))\n\
         \x20if busy<=0:\n\
         \x20 break\n\
         \x20time.sleep(1)\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drain_script_is_bounded_and_targets_the_port() {
        let s = drain_script(8000, 60);
        assert!(s.contains("end=time.time()+60"));
        assert!(s.contains("http://127.0.0.1:8000/metrics"));
    }
}

//! Activation failures: the controller diagnoses a backend that cannot come up (unschedulable,
//! image pull, crash loop, OOM kill, repeated termination, progress deadline, pods refused) as
//! the LLMService's `Ready=False` with a reason of [`hearth_crds::ACTIVATION_FAILED_REASONS`].
//! The gateway follows that one object and sets the failure on the model's discovered
//! [`EndpointSet`]: requests held for the model are then answered at once with the reason
//! (`activation_failed`, see [`crate::reject`]) instead of after `activationTimeout`, and new
//! ones too while the failure lasts. Once the service or its runtime is fixed the controller
//! clears the reason and requests are held (and served) again; nothing is recreated.
//!
//! RBAC: `list` and `watch` on `llmservices` in the service's namespace (`resourceNames` may
//! name the one service: the watch selects it by `metadata.name`). Watch errors are logged and
//! retried with kube's backoff; the failure last seen stays meanwhile.

use hearth_crds::{ACTIVATION_FAILED_REASONS, LLMService};

use crate::endpoints::EndpointSet;

/// The activation failure `svc`'s status reports: `"<reason>: <message>"` of its `Ready`
/// condition when `False` with a reason of [`ACTIVATION_FAILED_REASONS`]; `None` otherwise.
pub fn failure_of(svc: &LLMService) -> Option<String> {
    let ready = svc
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")?;
    (ready.status == "False" && ACTIVATION_FAILED_REASONS.contains(&ready.reason.as_str()))
        .then(|| format!("{}: {}", ready.reason, ready.message))
}

/// Follows the LLMService `name` in `namespace` and sets its activation failure
/// ([`failure_of`]) on `discovered`, until the task is dropped. A service that does not exist
/// (or is deleted) has none.
pub async fn follow(
    client: kube::Client,
    namespace: String,
    name: String,
    discovered: EndpointSet,
) {
    let followed = crate::configmap::Followed {
        what: "LLMService",
        nothing: "no activation failure is known",
        rbac: "list/watch on llmservices",
        kept: "activation failures wait for the activation timeout meanwhile, the failure last seen stays",
    };
    crate::configmap::follow(client, &namespace, &name, followed, |service, change| {
        let failure = match change {
            crate::configmap::Change::Object(svc) => failure_of(svc),
            crate::configmap::Change::Missing => None,
        };
        if failure.is_some() && discovered.failure().is_none() && !discovered.is_ready() {
            tracing::warn!(%service, failure = failure.as_deref().unwrap_or_default(), "the backend cannot come up: held requests are answered with the reason");
        }
        discovered.set_failure(failure.as_deref());
    })
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_ready(status: &str, reason: &str) -> LLMService {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "a"},
            "spec": {"model": {"uri": "hf://org/m"}},
            "status": {"conditions": [{"type": "Ready", "status": status, "reason": reason,
                "message": "pod chat-1, container vllm: ErrImagePull: not found",
                "lastTransitionTime": "2026-01-01T00:00:00Z"}]},
        }))
        .unwrap()
    }

    #[test]
    fn only_a_false_ready_with_a_failure_reason_is_a_failure() {
        assert_eq!(
            failure_of(&with_ready("False", "ImagePullFailed")).as_deref(),
            Some("ImagePullFailed: pod chat-1, container vllm: ErrImagePull: not found")
        );
        for (status, reason) in [
            ("False", "BackendLoading"),
            ("False", "WaitingForDevices"),
            ("True", "ScaledToZero"),
        ] {
            assert_eq!(failure_of(&with_ready(status, reason)), None, "{reason}");
        }
    }

    #[tokio::test]
    async fn a_failure_ends_the_wait_only_while_no_endpoint_is_ready() {
        let set = EndpointSet::new();
        set.set_failure(Some("OOMKilled: m"));
        assert_eq!(&*set.failed().await, "OOMKilled: m");
        set.replace(["10.0.0.1:8000".parse().unwrap()]);
        assert_eq!(set.failure(), None);
        let waiting = tokio::spawn({
            let set = set.clone();
            async move { set.failed().await }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        set.replace([]);
        assert_eq!(&*waiting.await.unwrap(), "OOMKilled: m");
        set.set_failure(None);
        let pending = tokio::time::timeout(std::time::Duration::from_millis(50), set.failed());
        assert!(pending.await.is_err(), "no failure, no answer");
    }
}

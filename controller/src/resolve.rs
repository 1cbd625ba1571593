//! Runtime resolution, through the policy engine's rule (`hearth_policies::resolve`, shared with
//! the admission webhook): `spec.runtime.name` pins one `InferenceRuntime`; otherwise
//! `spec.runtime.selector.vendor` in preference order (an empty list accepts any vendor), then
//! higher `priority`; equally preferred runtimes are refused (`AmbiguousRuntime`). This module adds what the controller needs around it: runtimes
//! being deleted are never picked, and the outcome becomes a `RuntimeResolved` condition reason
//! and a message naming the field to change.

use hearth_crds::{InferenceRuntime, LLMService};
use hearth_policies::{Selection, resolve::ResolveError as RuleError};
use kube::ResourceExt;

/// The chosen runtime and why, for the `RuntimeResolved` condition.
#[derive(Debug, Clone)]
pub struct Resolved<'a> {
    /// The runtime.
    pub runtime: &'a InferenceRuntime,
    /// `Pinned` or `SelectedByVendor`.
    pub reason: &'static str,
    /// A human sentence naming the runtime and the rule that chose it.
    pub message: String,
}

/// Why no runtime was resolved. [`ResolveError::reason`] is the condition reason; the message
/// says what the user can do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// `spec.runtime.name` names no InferenceRuntime.
    #[error("spec.runtime.name: {0}")]
    NotFound(String),
    /// No runtime has any of the listed vendors.
    #[error("spec.runtime.selector.vendor: {0}")]
    NoVendorMatch(String),
    /// Several runtimes are equally preferred.
    #[error("spec.runtime: {0}")]
    Ambiguous(String),
    /// The cluster has no InferenceRuntime at all.
    #[error(
        "no InferenceRuntime exists: create one (kubectl apply -f an InferenceRuntime manifest)"
    )]
    NoRuntimes,
}

impl ResolveError {
    /// The `RuntimeResolved=False` condition reason.
    pub fn reason(&self) -> &'static str {
        match self {
            ResolveError::NotFound(_) => "RuntimeNotFound",
            ResolveError::NoVendorMatch(_) => "NoRuntimeForVendor",
            ResolveError::NoRuntimes => "NoRuntimes",
            ResolveError::Ambiguous(_) => "AmbiguousRuntime",
        }
    }
}

/// Resolves the runtime of `service` among `runtimes` (the cluster's InferenceRuntimes).
pub fn resolve_runtime<'a>(
    service: &LLMService,
    runtimes: impl IntoIterator<Item = &'a InferenceRuntime>,
) -> Result<Resolved<'a>, ResolveError> {
    let live: Vec<&InferenceRuntime> = runtimes
        .into_iter()
        .filter(|r| r.metadata.deletion_timestamp.is_none())
        .collect();
    let selection = Selection::from_service(service);
    if live.is_empty() && !matches!(selection, Selection::Pinned(_)) {
        return Err(ResolveError::NoRuntimes);
    }
    let owned: Vec<InferenceRuntime> = live.iter().map(|r| (*r).clone()).collect();
    let chosen = hearth_policies::resolve_runtime(&owned, &selection).map_err(|e| match e {
        RuleError::NotFound { .. } => ResolveError::NotFound(e.to_string()),
        RuleError::NoVendorMatch { .. } => ResolveError::NoVendorMatch(e.to_string()),
        RuleError::Ambiguous { .. } => ResolveError::Ambiguous(e.to_string()),
    })?;
    let index = owned
        .iter()
        .position(|r| std::ptr::eq(r, chosen))
        .ok_or_else(|| ResolveError::NotFound(chosen.name_any()))?;
    let runtime = live[index];
    Ok(match selection {
        Selection::Pinned(name) => Resolved {
            runtime,
            reason: "Pinned",
            message: format!("InferenceRuntime {name} pinned by spec.runtime.name"),
        },
        Selection::Vendors(vendors) => Resolved {
            runtime,
            reason: "SelectedByVendor",
            message: format!(
                "InferenceRuntime {} selected by spec.runtime.selector.vendor [{}]: vendor {}, priority {}",
                runtime.name_any(),
                vendors.join(", "),
                runtime.spec.vendor,
                runtime.spec.priority
            ),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use hearth_crds::llmservice::{RuntimeSelection, RuntimeSelector};

    fn runtime(name: &str, vendor: &str, priority: i32) -> InferenceRuntime {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "InferenceRuntime",
            "metadata": {"name": name},
            "spec": {
                "vendor": vendor,
                "priority": priority,
                "container": {"image": "x"},
                "accelerator": {"resourceName": "r"}
            }
        }))
        .unwrap()
    }

    fn service(selection: RuntimeSelection) -> LLMService {
        let mut svc: LLMService = serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "s", "namespace": "n"},
            "spec": {"model": {"source": {"uri": "hf://a/b"}}}
        }))
        .unwrap();
        svc.spec.runtime = selection;
        svc
    }

    fn by_vendor(vendors: &[&str]) -> RuntimeSelection {
        RuntimeSelection {
            selector: Some(RuntimeSelector {
                vendor: vendors.iter().map(|v| v.to_string()).collect(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn pinned_name_wins_over_selector() {
        let rts = [runtime("a", "nvidia", 1), runtime("b", "ascend", 100)];
        let mut sel = by_vendor(&["ascend"]);
        sel.name = Some("a".into());
        let r = resolve_runtime(&service(sel), &rts).unwrap();
        assert_eq!(r.runtime.name_any(), "a");
        assert_eq!(r.reason, "Pinned");
    }

    #[test]
    fn vendor_order_then_priority_and_ties_are_refused() {
        let rts = [
            runtime("n-low", "nvidia", 1),
            runtime("a-z", "ascend", 60),
            runtime("a-b", "ascend", 50),
            runtime("a-low", "ascend", 10),
        ];
        let r = resolve_runtime(
            &service(by_vendor(&["cambricon", "ascend", "nvidia"])),
            &rts,
        )
        .unwrap();
        assert_eq!(r.runtime.name_any(), "a-z");
        assert_eq!(r.reason, "SelectedByVendor");
        let r = resolve_runtime(&service(by_vendor(&["nvidia", "ascend"])), &rts).unwrap();
        assert_eq!(r.runtime.name_any(), "n-low");
        // Two Ascend profiles of one priority: the service must pin one.
        let rts = [
            runtime("a-910b", "ascend", 100),
            runtime("a-310p", "ascend", 100),
        ];
        let e = resolve_runtime(&service(by_vendor(&["ascend"])), &rts).unwrap_err();
        assert_eq!(e.reason(), "AmbiguousRuntime");
        assert!(e.to_string().contains("[a-310p, a-910b]"), "{e}");
        assert!(e.to_string().contains("pin one by name"), "{e}");
    }

    #[test]
    fn failures_have_actionable_reasons() {
        let rts = [runtime("a", "nvidia", 1)];
        let pinned = RuntimeSelection {
            name: Some("missing".into()),
            ..Default::default()
        };
        let e = resolve_runtime(&service(pinned), &rts).unwrap_err();
        assert_eq!(e.reason(), "RuntimeNotFound");
        assert!(e.to_string().starts_with("spec.runtime.name: "), "{e}");
        assert!(e.to_string().contains("\"missing\""), "{e}");
        let e = resolve_runtime(&service(by_vendor(&["hygon"])), &rts).unwrap_err();
        assert_eq!(e.reason(), "NoRuntimeForVendor");
        assert!(
            e.to_string().starts_with("spec.runtime.selector.vendor: "),
            "{e}"
        );
        let e = resolve_runtime(&service(RuntimeSelection::default()), &[]).unwrap_err();
        assert_eq!(e, ResolveError::NoRuntimes);
    }

    #[test]
    fn no_selector_accepts_any_vendor() {
        let rts = [runtime("a", "nvidia", 1), runtime("b", "ascend", 7)];
        let r = resolve_runtime(&service(RuntimeSelection::default()), &rts).unwrap();
        assert_eq!(r.runtime.name_any(), "b");
    }

    #[test]
    fn deleting_runtimes_are_skipped() {
        let mut gone = runtime("a", "nvidia", 100);
        gone.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ));
        let rts = [gone, runtime("b", "nvidia", 1)];
        let r = resolve_runtime(&service(by_vendor(&["nvidia"])), &rts).unwrap();
        assert_eq!(r.runtime.name_any(), "b");
    }
}

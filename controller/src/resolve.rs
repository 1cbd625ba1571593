//! Runtime resolution: `spec.runtime.name` pins one `InferenceRuntime`; otherwise
//! `spec.runtime.selector.vendor` is walked in preference order, and among the runtimes of the
//! first vendor that has any, the highest `priority` wins, then the lexically smallest name (so
//! the choice is stable). Runtimes being deleted are never picked.

use hearth_crds::{InferenceRuntime, LLMService};
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

/// Why no runtime was resolved. Each variant's `reason()` is the condition reason; the message
/// says what the user can do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// `spec.runtime.name` names no InferenceRuntime.
    #[error(
        "spec.runtime.name: InferenceRuntime {0:?} not found; create it or name an existing one (kubectl get inferenceruntimes)"
    )]
    NotFound(String),
    /// No runtime has any of the listed vendors.
    #[error(
        "spec.runtime.selector.vendor: no InferenceRuntime for vendor(s) {0}; create one or add a vendor that has one (kubectl get inferenceruntimes)"
    )]
    NoVendorMatch(String),
    /// Neither a name nor a vendor selector.
    #[error(
        "spec.runtime: set runtime.name or runtime.selector.vendor to choose an InferenceRuntime"
    )]
    NothingSelected,
}

impl ResolveError {
    /// The `RuntimeResolved=False` condition reason.
    pub fn reason(&self) -> &'static str {
        match self {
            ResolveError::NotFound(_) => "RuntimeNotFound",
            ResolveError::NoVendorMatch(_) => "NoRuntimeForVendor",
            ResolveError::NothingSelected => "NoRuntimeSelected",
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
    let selection = &service.spec.runtime;
    if let Some(name) = selection.name.as_deref().filter(|n| !n.is_empty()) {
        return live
            .into_iter()
            .find(|r| r.name_any() == name)
            .map(|runtime| Resolved {
                runtime,
                reason: "Pinned",
                message: format!("InferenceRuntime {name} pinned by spec.runtime.name"),
            })
            .ok_or_else(|| ResolveError::NotFound(name.to_owned()));
    }
    let vendors = selection
        .selector
        .as_ref()
        .map(|s| s.vendor.as_slice())
        .unwrap_or_default();
    if vendors.is_empty() {
        return Err(ResolveError::NothingSelected);
    }
    for vendor in vendors {
        let best = live
            .iter()
            .filter(|r| &r.spec.vendor == vendor)
            .min_by(|a, b| {
                b.spec
                    .priority
                    .cmp(&a.spec.priority)
                    .then_with(|| a.name_any().cmp(&b.name_any()))
            });
        if let Some(runtime) = best {
            return Ok(Resolved {
                runtime,
                reason: "SelectedByVendor",
                message: format!(
                    "InferenceRuntime {} selected: vendor {vendor} (preference {} of {}), priority {}",
                    runtime.name_any(),
                    vendors.iter().position(|v| v == vendor).unwrap_or(0) + 1,
                    vendors.len(),
                    runtime.spec.priority
                ),
            });
        }
    }
    Err(ResolveError::NoVendorMatch(vendors.join(", ")))
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
    fn vendor_order_then_priority_then_name() {
        let rts = [
            runtime("n-low", "nvidia", 1),
            runtime("a-z", "ascend", 50),
            runtime("a-b", "ascend", 50),
            runtime("a-low", "ascend", 10),
        ];
        let r = resolve_runtime(
            &service(by_vendor(&["cambricon", "ascend", "nvidia"])),
            &rts,
        )
        .unwrap();
        assert_eq!(r.runtime.name_any(), "a-b");
        assert_eq!(r.reason, "SelectedByVendor");
        let r = resolve_runtime(&service(by_vendor(&["nvidia", "ascend"])), &rts).unwrap();
        assert_eq!(r.runtime.name_any(), "n-low");
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
        assert!(e.to_string().contains("\"missing\""));
        let e = resolve_runtime(&service(by_vendor(&["hygon"])), &rts).unwrap_err();
        assert_eq!(
            e.reason(),
            "NoVendorMatch".replace("NoVendorMatch", "NoRuntimeForVendor")
        );
        let e = resolve_runtime(&service(RuntimeSelection::default()), &rts).unwrap_err();
        assert_eq!(e, ResolveError::NothingSelected);
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

//! Labels on every child: the Kubernetes recommended `app.kubernetes.io/*` set plus
//! `serving.hearth.dev/llmservice`.

use std::collections::BTreeMap;

use hearth_crds::wellknown::{COMPONENT_LABEL, FIELD_MANAGER, LLMSERVICE_LABEL};

/// `app.kubernetes.io/name`: the application, the same for every Hearth child.
pub const NAME_LABEL: &str = "app.kubernetes.io/name";
/// `app.kubernetes.io/instance`: the `LLMService` name.
pub const INSTANCE_LABEL: &str = "app.kubernetes.io/instance";
/// `app.kubernetes.io/part-of`.
pub const PART_OF_LABEL: &str = "app.kubernetes.io/part-of";
/// `app.kubernetes.io/managed-by`: the controller's watches select on it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";

/// The label selector matching every object this controller manages.
pub fn managed_selector() -> String {
    format!("{MANAGED_BY_LABEL}={FIELD_MANAGER}")
}

/// A child's role, the value of `app.kubernetes.io/component`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Component {
    /// The inference backend (vLLM).
    Backend,
    /// The scale-to-zero gateway.
    Gateway,
    /// The model cache claim.
    Cache,
    /// The prewarm Job.
    Prewarm,
    /// The KEDA ScaledObject.
    Autoscaler,
}

impl Component {
    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::Backend => "backend",
            Component::Gateway => "gateway",
            Component::Cache => "cache",
            Component::Prewarm => "prewarm",
            Component::Autoscaler => "autoscaler",
        }
    }
}

/// The full label set of a child of `service` with role `component`.
pub fn labels(service: &str, component: Component) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME_LABEL.to_owned(), "hearth".to_owned()),
        (INSTANCE_LABEL.to_owned(), service.to_owned()),
        (COMPONENT_LABEL.to_owned(), component.as_str().to_owned()),
        (PART_OF_LABEL.to_owned(), "hearth".to_owned()),
        (MANAGED_BY_LABEL.to_owned(), FIELD_MANAGER.to_owned()),
        (LLMSERVICE_LABEL.to_owned(), service.to_owned()),
    ])
}

/// The pod selector of a Deployment or Service: the two labels that never change (selectors of
/// a Deployment are immutable, so they stay minimal).
pub fn selector(service: &str, component: Component) -> BTreeMap<String, String> {
    BTreeMap::from([
        (LLMSERVICE_LABEL.to_owned(), service.to_owned()),
        (COMPONENT_LABEL.to_owned(), component.as_str().to_owned()),
    ])
}

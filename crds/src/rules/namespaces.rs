//! Which namespaces an object admits others from (Gateway API's `allowedRoutes.namespaces`):
//! an LLMEndpoint's `spec.allowedServices` and an LLMService's `spec.allowedAdapters`, and the
//! label selector match they use (the one home of both, for the controller, the webhook and
//! the policy engine).

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use crate::llmendpoint::{FromNamespaces, ServiceNamespaces};

/// Whether labels satisfy a `metav1.LabelSelector` (`matchLabels`, and `matchExpressions`
/// with `In`, `NotIn`, `Exists`, `DoesNotExist`; another operator matches nothing). An empty
/// selector matches everything. `get` reads one label.
pub fn selector_matches<'a>(sel: &LabelSelector, get: impl Fn(&str) -> Option<&'a str>) -> bool {
    if let Some(ml) = &sel.match_labels
        && !ml.iter().all(|(k, v)| get(k) == Some(v.as_str()))
    {
        return false;
    }
    sel.match_expressions.iter().flatten().all(|e| {
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" => get(&e.key).is_some_and(|v| values.iter().any(|x| x == v)),
            "NotIn" => get(&e.key).is_none_or(|v| !values.iter().any(|x| x == v)),
            "Exists" => get(&e.key).is_some(),
            "DoesNotExist" => get(&e.key).is_none(),
            _ => false,
        }
    })
}

/// Why `namespaces` (an `allowedServices`/`allowedAdapters` list of an object in namespace
/// `own`) does not admit an object of namespace `namespace` whose labels are `labels` (absent:
/// the namespace is unknown).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotAdmitted {
    /// `from: Same` and another namespace.
    OtherNamespace,
    /// `from: Selector` and labels that do not match (or no selector, or no namespace).
    SelectorMismatch {
        /// The selector as JSON, `(none)` without one.
        selector: String,
    },
}

/// Whether `namespaces`, on an object in namespace `own`, admits namespace `namespace` with
/// `labels` (Gateway API's `allowedRoutes.namespaces`).
///
/// # Errors
/// [`NotAdmitted`] saying why not.
pub fn namespace_admits(
    namespaces: &ServiceNamespaces,
    own: &str,
    namespace: &str,
    labels: Option<&BTreeMap<String, String>>,
) -> Result<(), NotAdmitted> {
    match namespaces.from {
        FromNamespaces::All => Ok(()),
        FromNamespaces::Same if namespace == own => Ok(()),
        FromNamespaces::Same => Err(NotAdmitted::OtherNamespace),
        FromNamespaces::Selector => {
            let matched = match (&namespaces.selector, labels) {
                (Some(sel), Some(l)) => selector_matches(sel, |k| l.get(k).map(String::as_str)),
                _ => false,
            };
            if matched {
                Ok(())
            } else {
                Err(NotAdmitted::SelectorMismatch {
                    selector: namespaces
                        .selector
                        .as_ref()
                        .and_then(|s| serde_json::to_string(s).ok())
                        .unwrap_or_else(|| "(none)".to_owned()),
                })
            }
        }
    }
}

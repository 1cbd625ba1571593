//! Labels on every child: upstream Hearth's selector labels (`app.kubernetes.io/name`,
//! `app.kubernetes.io/managed-by: hearth`, `serving.hearth.dev/llmservice` or
//! `serving.hearth.dev/gateway`), so an upstream installation's Deployments can be adopted in
//! place (a Deployment's selector is immutable), plus the rest of the Kubernetes recommended
//! `app.kubernetes.io/*` set.

use std::collections::BTreeMap;

use hearth_crds::wellknown::{
    COMPONENT_LABEL, DEPLOYMENT_LABEL, FIELD_MANAGER, GATEWAY_LABEL, LLMSERVICE_LABEL, MANAGED_BY,
};

use crate::names;

/// `app.kubernetes.io/name`: the child's application name, as upstream Hearth writes it: the
/// `LLMService` name for the model's objects, `<name>-gateway` for the gateway's,
/// `<name>-prewarm` for the prewarm Job's (so its pods never match the backend's selector).
pub const NAME_LABEL: &str = "app.kubernetes.io/name";
/// `app.kubernetes.io/instance`: the `LLMService` name.
pub const INSTANCE_LABEL: &str = "app.kubernetes.io/instance";
/// `app.kubernetes.io/part-of`.
pub const PART_OF_LABEL: &str = "app.kubernetes.io/part-of";
/// `app.kubernetes.io/managed-by`: the controller's watches select on it.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
/// `serving.hearth.dev/llmendpoint`: on every child of an `LLMEndpoint` (its shared gateway's
/// objects and pods, its routing table), naming the endpoint, beside the gateway labels a
/// service of that name would carry.
pub const ENDPOINT_LABEL: &str = "serving.hearth.dev/llmendpoint";

/// The label selector of the controller's watches: every object it manages, an upstream Hearth
/// installation's children (which it adopts), and those of earlier versions of this controller
/// (`managed-by: hearth-controller`, relabelled by its next apply).
pub fn managed_selector() -> String {
    format!("{MANAGED_BY_LABEL} in ({MANAGED_BY},{FIELD_MANAGER})")
}

/// The label selector of the backend pods' watch: the pods of the backend Deployments this
/// controller renders (`managed-by: hearth`, `component: backend`, with the service's name in
/// `serving.hearth.dev/llmservice`); prewarm and gateway pods are left out.
pub fn backend_pod_selector() -> String {
    format!(
        "{MANAGED_BY_LABEL}={MANAGED_BY},{COMPONENT_LABEL}={},{LLMSERVICE_LABEL}",
        Component::Backend.as_str()
    )
}

/// The labels of the objects rendered for a plain Deployment `deployment` joined to an
/// `LLMEndpoint` (see [`crate::names::member`]): `app.kubernetes.io/{name,instance}: <deployment>`,
/// `managed-by: hearth` (the controller's watches select on it), `component: member`,
/// `part-of: hearth` and `serving.hearth.dev/deployment: <deployment>`. Never
/// `serving.hearth.dev/llmservice`: no LLMService owns them.
pub fn member_labels(deployment: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME_LABEL.to_owned(), deployment.to_owned()),
        (INSTANCE_LABEL.to_owned(), deployment.to_owned()),
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
        (COMPONENT_LABEL.to_owned(), MEMBER_COMPONENT.to_owned()),
        (PART_OF_LABEL.to_owned(), "hearth".to_owned()),
        (DEPLOYMENT_LABEL.to_owned(), deployment.to_owned()),
    ])
}

/// `app.kubernetes.io/component` of the objects rendered for a Deployment joined to an
/// endpoint.
pub const MEMBER_COMPONENT: &str = "member";

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
    /// A Job fetching a hub adapter into the model cache (named like the prewarm Job, so its
    /// pods match no Service).
    AdapterFetch,
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
            Component::AdapterFetch => "adapter-fetch",
            Component::Autoscaler => "autoscaler",
        }
    }
}

/// `app.kubernetes.io/name` of a child of `service` with role `component`.
fn app_name(service: &str, component: Component) -> String {
    match component {
        Component::Gateway => names::gateway(service),
        Component::Prewarm | Component::AdapterFetch => names::prewarm_job(service),
        _ => service.to_owned(),
    }
}

/// The full label set of a child of `service` with role `component`: the selector labels of
/// [`selector`] plus instance, component and part-of. Gateway objects carry
/// `serving.hearth.dev/gateway`; the others `serving.hearth.dev/llmservice`.
pub fn labels(service: &str, component: Component) -> BTreeMap<String, String> {
    let mut l = selector(service, component);
    l.insert(INSTANCE_LABEL.to_owned(), service.to_owned());
    l.insert(COMPONENT_LABEL.to_owned(), component.as_str().to_owned());
    l.insert(PART_OF_LABEL.to_owned(), "hearth".to_owned());
    l
}

/// The pod selector of a Deployment or Service, exactly upstream Hearth's (selectors of a
/// Deployment are immutable, so these are what lets an upstream Deployment be adopted):
/// `{app.kubernetes.io/name, app.kubernetes.io/managed-by: hearth}` plus
/// `serving.hearth.dev/llmservice: <service>` (model) or `serving.hearth.dev/gateway: <service>`
/// (gateway).
pub fn selector(service: &str, component: Component) -> BTreeMap<String, String> {
    let owner_label = match component {
        Component::Gateway => GATEWAY_LABEL,
        _ => LLMSERVICE_LABEL,
    };
    BTreeMap::from([
        (NAME_LABEL.to_owned(), app_name(service, component)),
        (MANAGED_BY_LABEL.to_owned(), MANAGED_BY.to_owned()),
        (owner_label.to_owned(), service.to_owned()),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selectors_are_upstreams_and_pods_match_only_their_own() {
        let backend = selector("m", Component::Backend);
        assert_eq!(
            backend,
            BTreeMap::from([
                (NAME_LABEL.to_owned(), "m".to_owned()),
                (MANAGED_BY_LABEL.to_owned(), "hearth".to_owned()),
                (LLMSERVICE_LABEL.to_owned(), "m".to_owned()),
            ])
        );
        let gateway = selector("m", Component::Gateway);
        assert_eq!(gateway[NAME_LABEL], "m-gateway");
        assert_eq!(gateway[GATEWAY_LABEL], "m");
        let matches = |sel: &BTreeMap<String, String>, l: &BTreeMap<String, String>| {
            sel.iter().all(|(k, v)| l.get(k) == Some(v))
        };
        for c in [
            Component::Backend,
            Component::Gateway,
            Component::Prewarm,
            Component::Cache,
            Component::Autoscaler,
        ] {
            let l = labels("m", c);
            assert_eq!(l[MANAGED_BY_LABEL], "hearth");
            assert_eq!(
                matches(&backend, &l),
                c == Component::Backend || c == Component::Cache || c == Component::Autoscaler,
                "{c:?}"
            );
            assert_eq!(matches(&gateway, &l), c == Component::Gateway, "{c:?}");
            assert_eq!(
                l.contains_key(LLMSERVICE_LABEL),
                c != Component::Gateway,
                "{c:?}"
            );
        }
    }
}

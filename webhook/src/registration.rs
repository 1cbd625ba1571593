//! The Mutating- and ValidatingWebhookConfiguration the webhook is registered with. One
//! function builds both, for the integration tests (URL client config) and the Helm chart
//! (Service client config); `docs/webhook.md` explains each choice.
//!
//! - `sideEffects: None`, `admissionReviewVersions: [v1]`, `timeoutSeconds` ≤ 10.
//! - `failurePolicy: Fail` for Hearth's own kinds, and for workloads that opted in with the
//!   annotation: serving them without their accelerator settings would be silently wrong.
//! - A namespace selector that skips `kube-system` and Hearth's own namespace (so the webhook
//!   can never block its own recovery).
//! - `matchConditions` (GA in Kubernetes 1.30) so that only workloads carrying
//!   `serving.hearth.dev/runtime` or `serving.hearth.dev/vendor` (annotation or label) reach the
//!   workload webhooks: an outage never blocks an unrelated Deployment.

use std::collections::BTreeMap;

use hearth_crds::wellknown::{RUNTIME_ANNOTATION, VENDOR_ANNOTATION};
use hearth_crds::{GROUP, VERSION};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MutatingWebhook, MutatingWebhookConfiguration, RuleWithOperations,
    ServiceReference, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::api::ObjectMeta;

use crate::admission::Endpoint;

/// The apiserver's limit is 30 s; ours is lower so a stuck webhook fails fast.
pub const MAX_TIMEOUT_SECONDS: i32 = 10;

/// Where the apiserver sends reviews.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A Service in the cluster (`https://<name>.<namespace>.svc:<port><path>`).
    Service {
        /// Service namespace.
        namespace: String,
        /// Service name.
        name: String,
        /// Service port.
        port: i32,
    },
    /// A base URL such as `https://127.0.0.1:8443`; the endpoint path is appended.
    Url(String),
}

/// Everything the configurations depend on.
#[derive(Clone, Debug)]
pub struct Registration {
    /// Name of both configurations (`hearth`).
    pub name: String,
    /// Where the webhook listens.
    pub target: Target,
    /// PEM CA bundle the apiserver verifies the serving certificate with; `None` when
    /// something else injects it (cert-manager's CA injector, or self-managed TLS at start).
    pub ca_bundle: Option<Vec<u8>>,
    /// Hearth's own namespace, never sent to the webhook.
    pub own_namespace: String,
    /// Request timeout, clamped to 1..=[`MAX_TIMEOUT_SECONDS`].
    pub timeout_seconds: i32,
    /// Extra labels a namespace must carry for its objects to reach the webhooks (empty: every
    /// namespace but the skipped ones). Lets a test or a tenant scope an installation.
    pub namespace_match_labels: BTreeMap<String, String>,
    /// Object selector of the InferenceRuntime webhook (none by default). The namespace
    /// selector does not apply to cluster-scoped objects, so this is how a test scopes them.
    pub cluster_object_selector: Option<LabelSelector>,
}

impl Registration {
    /// Defaults for the chart: name `hearth`, Service `hearth-webhook:443` in `namespace`.
    pub fn in_cluster(namespace: &str) -> Self {
        Self {
            name: "hearth".to_owned(),
            target: Target::Service {
                namespace: namespace.to_owned(),
                name: "hearth-webhook".to_owned(),
                port: 443,
            },
            ca_bundle: None,
            own_namespace: namespace.to_owned(),
            timeout_seconds: 5,
            namespace_match_labels: BTreeMap::new(),
            cluster_object_selector: None,
        }
    }

    fn client_config(&self, endpoint: Endpoint) -> WebhookClientConfig {
        let (service, url) = match &self.target {
            Target::Service {
                namespace,
                name,
                port,
            } => (
                Some(ServiceReference {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    path: Some(endpoint.path().to_owned()),
                    port: Some(*port),
                }),
                None,
            ),
            Target::Url(base) => (
                None,
                Some(format!("{}{}", base.trim_end_matches('/'), endpoint.path())),
            ),
        };
        WebhookClientConfig {
            ca_bundle: self.ca_bundle.clone().map(ByteString),
            service,
            url,
        }
    }

    fn namespace_selector(&self) -> LabelSelector {
        // The namespaces an exported ServingPolicy's bindings skip too.
        let skip = hearth_policies::export::skipped_namespaces(&self.own_namespace);
        LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement {
                key: "kubernetes.io/metadata.name".to_owned(),
                operator: "NotIn".to_owned(),
                values: Some(skip),
            }]),
            match_labels: (!self.namespace_match_labels.is_empty())
                .then(|| self.namespace_match_labels.clone()),
        }
    }

    fn timeout(&self) -> Option<i32> {
        Some(self.timeout_seconds.clamp(1, MAX_TIMEOUT_SECONDS))
    }

    fn meta(&self) -> ObjectMeta {
        ObjectMeta {
            name: Some(self.name.clone()),
            labels: Some(BTreeMap::from([(
                "app.kubernetes.io/name".to_owned(),
                "hearth".to_owned(),
            )])),
            ..ObjectMeta::default()
        }
    }

    /// Validating webhooks: LLMServices and LLMEndpoints (namespaced), InferenceRuntimes
    /// (cluster-scoped; the namespace selector does not apply to them) and annotated workloads.
    pub fn validating(&self) -> ValidatingWebhookConfiguration {
        let hook = |name: &str,
                    rules: Vec<RuleWithOperations>,
                    conditions,
                    object_selector: Option<LabelSelector>| ValidatingWebhook {
            name: format!("{name}.{GROUP}"),
            admission_review_versions: vec!["v1".to_owned()],
            client_config: self.client_config(Endpoint::Validate),
            failure_policy: Some("Fail".to_owned()),
            match_policy: Some("Equivalent".to_owned()),
            match_conditions: conditions,
            namespace_selector: Some(self.namespace_selector()),
            object_selector,
            rules: Some(rules),
            side_effects: "None".to_owned(),
            timeout_seconds: self.timeout(),
        };
        ValidatingWebhookConfiguration {
            metadata: self.meta(),
            webhooks: Some(vec![
                hook(
                    "llmservices.validate",
                    vec![rule(GROUP, VERSION, "llmservices", "Namespaced")],
                    None,
                    None,
                ),
                hook(
                    "llmendpoints.validate",
                    vec![rule(GROUP, VERSION, "llmendpoints", "Namespaced")],
                    None,
                    None,
                ),
                hook(
                    "llmadapters.validate",
                    vec![rule(GROUP, VERSION, "llmadapters", "Namespaced")],
                    None,
                    None,
                ),
                hook(
                    "inferenceruntimes.validate",
                    vec![rule(GROUP, VERSION, "inferenceruntimes", "Cluster")],
                    None,
                    self.cluster_object_selector.clone(),
                ),
                hook(
                    "workloads.validate",
                    workload_rules(),
                    Some(opted_in()),
                    None,
                ),
            ]),
        }
    }

    /// The mutating webhook for annotated workloads. `reinvocationPolicy: IfNeeded`: if a
    /// later webhook changes the object, ours runs again (its patch is idempotent).
    pub fn mutating(&self) -> MutatingWebhookConfiguration {
        MutatingWebhookConfiguration {
            metadata: self.meta(),
            webhooks: Some(vec![MutatingWebhook {
                name: format!("workloads.mutate.{GROUP}"),
                admission_review_versions: vec!["v1".to_owned()],
                client_config: self.client_config(Endpoint::Mutate),
                failure_policy: Some("Fail".to_owned()),
                match_policy: Some("Equivalent".to_owned()),
                match_conditions: Some(opted_in()),
                namespace_selector: Some(self.namespace_selector()),
                object_selector: None,
                reinvocation_policy: Some("IfNeeded".to_owned()),
                rules: Some(workload_rules()),
                side_effects: "None".to_owned(),
                timeout_seconds: self.timeout(),
            }]),
        }
    }
}

fn rule(group: &str, version: &str, resource: &str, scope: &str) -> RuleWithOperations {
    RuleWithOperations {
        api_groups: Some(vec![group.to_owned()]),
        api_versions: Some(vec![version.to_owned()]),
        operations: Some(vec!["CREATE".to_owned(), "UPDATE".to_owned()]),
        resources: Some(vec![resource.to_owned()]),
        scope: Some(scope.to_owned()),
    }
}

fn workload_rules() -> Vec<RuleWithOperations> {
    vec![
        RuleWithOperations {
            resources: Some(vec!["deployments".to_owned(), "statefulsets".to_owned()]),
            ..rule("apps", "v1", "", "Namespaced")
        },
        rule("", "v1", "pods", "Namespaced"),
    ]
}

/// The CEL condition a workload must meet to reach the workload webhooks: one of Hearth's keys
/// as an annotation or a label.
pub fn opted_in_expression() -> String {
    let has = |field: &str| {
        format!(
            "(has(object.metadata.{field}) && ('{RUNTIME_ANNOTATION}' in object.metadata.{field} || '{VENDOR_ANNOTATION}' in object.metadata.{field}))"
        )
    };
    format!("{} || {}", has("annotations"), has("labels"))
}

fn opted_in() -> Vec<MatchCondition> {
    vec![MatchCondition {
        name: "hearth-opted-in".to_owned(),
        expression: opted_in_expression(),
    }]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg() -> Registration {
        Registration {
            ca_bundle: Some(b"PEM".to_vec()),
            ..Registration::in_cluster("hearth-system")
        }
    }

    #[test]
    fn every_webhook_meets_the_rules() {
        let r = reg();
        let v = r.validating();
        let m = r.mutating();
        let vh = v.webhooks.unwrap();
        let mh = m.webhooks.unwrap();
        assert_eq!(vh.len(), 5);
        assert_eq!(mh.len(), 1);
        let common = vh
            .iter()
            .map(|w| {
                (
                    &w.side_effects,
                    &w.admission_review_versions,
                    w.timeout_seconds,
                    &w.failure_policy,
                    &w.namespace_selector,
                )
            })
            .chain(mh.iter().map(|w| {
                (
                    &w.side_effects,
                    &w.admission_review_versions,
                    w.timeout_seconds,
                    &w.failure_policy,
                    &w.namespace_selector,
                )
            }));
        for (side, versions, timeout, failure, ns) in common {
            assert_eq!(side, "None");
            assert_eq!(versions, &vec!["v1".to_owned()]);
            assert!(timeout.is_some_and(|t| t <= MAX_TIMEOUT_SECONDS));
            assert_eq!(failure.as_deref(), Some("Fail"));
            let values = ns.as_ref().unwrap().match_expressions.as_ref().unwrap()[0]
                .values
                .clone()
                .unwrap();
            assert_eq!(values, vec!["kube-system", "hearth-system"]);
        }
        // Only workloads carry matchConditions; Hearth's kinds always reach the webhook.
        assert!(vh[0].match_conditions.is_none());
        assert!(vh[1].match_conditions.is_none());
        assert!(vh[2].match_conditions.is_none());
        assert!(vh[4].match_conditions.is_some());
        assert!(mh[0].match_conditions.is_some());
    }

    #[test]
    fn url_target_appends_the_path() {
        let r = Registration {
            target: Target::Url("https://127.0.0.1:9443/".to_owned()),
            ..reg()
        };
        let w = &r.mutating().webhooks.unwrap()[0];
        assert_eq!(
            w.client_config.url.as_deref(),
            Some("https://127.0.0.1:9443/mutate")
        );
        assert!(w.client_config.service.is_none());
    }

    #[test]
    fn timeout_is_clamped() {
        let r = Registration {
            timeout_seconds: 30,
            ..reg()
        };
        assert_eq!(
            r.validating().webhooks.unwrap()[0].timeout_seconds,
            Some(10)
        );
    }
}

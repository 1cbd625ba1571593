//! The data plane's NetworkPolicies (opt-in: chart value `networkPolicy.models.enabled`, flag
//! `--model-network-policies`): ingress rules for the pods the controller renders, so only the
//! traffic Hearth needs reaches them.
//!
//! - `N-gateway` selects a gateway's pods (a service's own, or an `LLMEndpoint`'s):
//!   - the client port (`http`) from [`ModelNetworkPolicies::clients_from`] (empty: any source);
//!   - the admin port from the gateway's own replicas (their demand reports to each other), KEDA's
//!     namespace (the `metrics-api` trigger), the controller (device handover, metering, adapter
//!     failures) and [`ModelNetworkPolicies::metrics_from`] (empty: any source; the port asks
//!     every caller for a bearer token anyway);
//!   - the ExternalScaler port (`grpc-scaler`) from KEDA's namespace.
//! - `N-backend` selects a service's backend pods: the runtime's port from the gateway that
//!   serves the model (its own, or the endpoint's, in the endpoint's namespace), the controller
//!   (LoRA adapters' `GET /v1/models`) and, when listed, [`ModelNetworkPolicies::metrics_from`]
//!   (the engine's own `/metrics`). Nothing else reaches an engine.
//!
//! Traffic from the pod's own node (the kubelet's probes) is admitted by common implementations
//! (Calico, Cilium, kube-router) whatever the policy says. Egress is left open: a gateway
//! reaches the apiserver and its backends, a backend its model hub.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::networking::v1::{
        NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
        NetworkPolicySpec,
    },
    apimachinery::pkg::{
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};
use serde::{Deserialize, Serialize};

use super::{Ctx, Placement, RenderConfig, gateway::Gateway};
use crate::{
    labels::{self, Component},
    names,
};
use hearth_crds::{naming, rules};

/// The namespace label every namespace carries (Kubernetes sets it from the name).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";

/// Who may reach the data plane, as the controller's flag `--model-network-policies` carries it
/// (JSON, camelCase; the chart writes it from `networkPolicy`). Peers are NetworkPolicy peers
/// (`podSelector`, `namespaceSelector`, `ipBlock`), as in any NetworkPolicy.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelNetworkPolicies {
    /// Who may call the gateways' client port (the OpenAI API): an ingress controller's
    /// namespace, the clients' namespaces. Empty: any source.
    #[serde(default)]
    pub clients_from: Vec<NetworkPolicyPeer>,
    /// Who scrapes metrics (Prometheus): the gateways' admin port (empty: any source) and the
    /// engines' port (empty: nobody beyond the gateway and the controller).
    #[serde(default)]
    pub metrics_from: Vec<NetworkPolicyPeer>,
    /// KEDA's namespace: its operator polls the admin port and calls the ExternalScaler.
    pub keda_namespace: String,
    /// The controller's namespace.
    pub controller_namespace: String,
    /// Labels that select the controller's pods in [`Self::controller_namespace`].
    pub controller_pod_labels: BTreeMap<String, String>,
}

impl ModelNetworkPolicies {
    /// Parses the flag's JSON.
    ///
    /// # Errors
    /// Not JSON of this shape (the message names the field), or an empty
    /// `kedaNamespace`, `controllerNamespace` or `controllerPodLabels` (a peer that selects
    /// nothing, or every pod of the namespace).
    pub fn parse(json: &str) -> Result<Self, String> {
        let p: Self = serde_json::from_str(json).map_err(|e| {
            format!("--model-network-policies: {e}; expected {{\"clientsFrom\": [NetworkPolicyPeer], \"metricsFrom\": [...], \"kedaNamespace\": \"keda\", \"controllerNamespace\": \"...\", \"controllerPodLabels\": {{...}}}}")
        })?;
        let err = |e: String| format!("--model-network-policies: {e}");
        for (field, ns) in [
            ("kedaNamespace", &p.keda_namespace),
            ("controllerNamespace", &p.controller_namespace),
        ] {
            if !naming::is_dns1123_label(ns) {
                return Err(err(format!(
                    "{field} {ns:?} is not a namespace name (a DNS-1123 label: lowercase letters, digits, '-'); the chart fills it from its release and gateway.adminAuth.kedaNamespace"
                )));
            }
        }
        if p.controller_pod_labels.is_empty() {
            return Err(err(
                "controllerPodLabels is empty; set it (the chart fills it from its release)".into(),
            ));
        }
        check_selector(
            "controllerPodLabels",
            &match_labels(p.controller_pod_labels.clone()),
        )
        .map_err(err)?;
        for (field, peers) in [
            ("clientsFrom", &p.clients_from),
            ("metricsFrom", &p.metrics_from),
        ] {
            for (i, peer) in peers.iter().enumerate() {
                check_peer(&format!("{field}[{i}]"), peer).map_err(err)?;
            }
        }
        Ok(p)
    }

    fn keda(&self) -> NetworkPolicyPeer {
        namespace_peer(&self.keda_namespace, None)
    }

    fn controller(&self) -> NetworkPolicyPeer {
        namespace_peer(
            &self.controller_namespace,
            Some(self.controller_pod_labels.clone()),
        )
    }
}

/// What the apiserver's NetworkPolicy validation asks of a peer, checked before any policy is
/// written (a policy it refuses would stop every reconcile): one of `podSelector`,
/// `namespaceSelector` (together allowed) or `ipBlock` alone (field names of unknown spelling
/// are dropped when parsed, leaving an empty peer); selectors of valid label keys and values,
/// and expressions whose operator and values go together; a CIDR in `ipBlock.cidr` and each
/// `except` a strict subset of it.
fn check_peer(at: &str, peer: &NetworkPolicyPeer) -> Result<(), String> {
    for (field, selector) in [
        ("podSelector", &peer.pod_selector),
        ("namespaceSelector", &peer.namespace_selector),
    ] {
        if let Some(s) = selector {
            check_selector(&format!("{at}.{field}"), s)?;
        }
    }
    let selects = peer.pod_selector.is_some() || peer.namespace_selector.is_some();
    match &peer.ip_block {
        None if !selects => Err(format!(
            "{at}: a peer needs podSelector, namespaceSelector or ipBlock (check the field names)"
        )),
        None => Ok(()),
        Some(_) if selects => Err(format!(
            "{at}: ipBlock cannot be combined with podSelector or namespaceSelector"
        )),
        Some(b) => {
            let not_cidr = |field: &str, c: &str| {
                format!(
                    "{at}: {field} {c:?} is not a CIDR (such as 198.51.100.0/24 or 2001:db8::/32)"
                )
            };
            let block = cidr(&b.cidr).ok_or_else(|| not_cidr("ipBlock.cidr", &b.cidr))?;
            for e in b.except.iter().flatten() {
                let inner = cidr(e).ok_or_else(|| not_cidr("ipBlock.except", e))?;
                if !block.strictly_contains(&inner) {
                    return Err(format!(
                        "{at}: ipBlock.except {e:?} is not a strict subset of ipBlock.cidr {:?}",
                        b.cidr
                    ));
                }
            }
            Ok(())
        }
    }
}

/// A label selector as the apiserver validates one ([`rules::check_label_selector`]): the first
/// error, naming its field under `at`.
fn check_selector(at: &str, s: &LabelSelector) -> Result<(), String> {
    match rules::check_label_selector(at, s).first_error() {
        Some(e) => Err(e.to_string()),
        None => Ok(()),
    }
}

/// An address block: the address as bits, its width (32 or 128) and the prefix length.
#[derive(Clone, Copy, Debug)]
struct Cidr {
    bits: u128,
    width: u8,
    len: u8,
}

impl Cidr {
    /// Whether `inner` lies inside this block, of the same family, with a longer prefix.
    fn strictly_contains(&self, inner: &Cidr) -> bool {
        let mask = match self.len {
            0 => 0,
            l => u128::MAX << (u32::from(self.width) - u32::from(l)),
        };
        self.width == inner.width && inner.len > self.len && inner.bits & mask == self.bits & mask
    }
}

/// `<IP address>/<prefix length>` with a prefix the address family allows.
fn cidr(s: &str) -> Option<Cidr> {
    let (ip, len) = s.split_once('/')?;
    let len = len.parse::<u8>().ok()?;
    let (bits, width) = match ip.parse::<std::net::IpAddr>().ok()? {
        std::net::IpAddr::V4(v4) => (u128::from(u32::from(v4)), 32),
        std::net::IpAddr::V6(v6) => (u128::from(v6), 128),
    };
    (len <= width).then_some(Cidr { bits, width, len })
}

/// Pods matching `pods` (all when `None`) in the namespace `namespace`.
fn namespace_peer(namespace: &str, pods: Option<BTreeMap<String, String>>) -> NetworkPolicyPeer {
    NetworkPolicyPeer {
        namespace_selector: Some(match_labels(BTreeMap::from([(
            NAMESPACE_NAME_LABEL.to_owned(),
            namespace.to_owned(),
        )]))),
        pod_selector: pods.map(match_labels),
        ..Default::default()
    }
}

fn match_labels(labels: BTreeMap<String, String>) -> LabelSelector {
    LabelSelector {
        match_labels: Some(labels),
        ..Default::default()
    }
}

/// One ingress rule: TCP `port` from `from` (`None`: any source).
fn rule(port: i32, from: Option<Vec<NetworkPolicyPeer>>) -> NetworkPolicyIngressRule {
    NetworkPolicyIngressRule {
        from,
        ports: Some(vec![NetworkPolicyPort {
            port: Some(IntOrString::Int(port)),
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        }]),
    }
}

/// `Some(peers)`, or `None` (any source) when `peers` is empty.
fn listed(peers: &[NetworkPolicyPeer]) -> Option<Vec<NetworkPolicyPeer>> {
    (!peers.is_empty()).then(|| peers.to_vec())
}

fn ingress_policy(
    metadata: ObjectMeta,
    pods: BTreeMap<String, String>,
    ingress: Vec<NetworkPolicyIngressRule>,
) -> NetworkPolicy {
    NetworkPolicy {
        metadata,
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(match_labels(pods)),
            policy_types: Some(vec!["Ingress".to_owned()]),
            ingress: Some(ingress),
            ..Default::default()
        }),
    }
}

/// `N-gateway` for the gateway `g` (see the module doc); `None` unless
/// [`RenderConfig::network_policies`].
pub(super) fn gateway_network_policy(g: &Gateway<'_>, cfg: &RenderConfig) -> Option<NetworkPolicy> {
    let p = cfg.network_policies.as_ref()?;
    let replicas = NetworkPolicyPeer {
        pod_selector: Some(match_labels(labels::selector(g.name, Component::Gateway))),
        ..Default::default()
    };
    let admin_from = (!p.metrics_from.is_empty()).then(|| {
        let mut from = vec![replicas, p.keda(), p.controller()];
        from.extend(p.metrics_from.iter().cloned());
        from
    });
    Some(ingress_policy(
        g.meta(names::gateway(g.name)),
        labels::selector(g.name, Component::Gateway),
        vec![
            rule(cfg.gateway_port, listed(&p.clients_from)),
            rule(cfg.admin_port, admin_from),
            rule(cfg.scaler_port, Some(vec![p.keda()])),
        ],
    ))
}

/// `N-backend` for the backend pods of the service being rendered, served by the gateway of
/// its placement (its own, or its endpoint's); see the module doc. `None` unless
/// [`RenderConfig::network_policies`].
pub(super) fn backend_network_policy(ctx: &Ctx<'_>) -> Option<NetworkPolicy> {
    let p = ctx.cfg.network_policies.as_ref()?;
    let (gateway, namespace) = match ctx.placement {
        Placement::Own => (ctx.name.as_str(), ctx.namespace.as_str()),
        Placement::Shared(s) => (s.endpoint.as_str(), s.namespace.as_str()),
    };
    let gateway_pods = labels::selector(gateway, Component::Gateway);
    let gateway_peer = if namespace == ctx.namespace {
        NetworkPolicyPeer {
            pod_selector: Some(match_labels(gateway_pods)),
            ..Default::default()
        }
    } else {
        namespace_peer(namespace, Some(gateway_pods))
    };
    let mut from = vec![gateway_peer, p.controller()];
    from.extend(p.metrics_from.iter().cloned());
    Some(ingress_policy(
        ctx.meta(names::backend_service(&ctx.name), Component::Backend),
        labels::selector(&ctx.name, Component::Backend),
        vec![rule(ctx.rt.spec.container.port.container_port, Some(from))],
    ))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::render::{
        RenderConfig, SharedGateway, render, render_endpoint, render_placed,
        tests::{llm_endpoint, service_and_runtime},
    };

    fn enabled(metrics_from: serde_json::Value) -> RenderConfig {
        let mut cfg = RenderConfig::builtin().unwrap();
        cfg.network_policies = Some(
            ModelNetworkPolicies::parse(
                &json!({
                    "clientsFrom": [{"namespaceSelector": {"matchLabels": {"team": "a"}}}],
                    "metricsFrom": metrics_from,
                    "kedaNamespace": "keda",
                    "controllerNamespace": "hearth-system",
                    "controllerPodLabels": {"app.kubernetes.io/name": "hearth"},
                })
                .to_string(),
            )
            .unwrap(),
        );
        cfg
    }

    /// `(port, from)` of each ingress rule, `from` as JSON (`null`: any source).
    fn rules(p: &NetworkPolicy) -> Vec<(i32, serde_json::Value)> {
        p.spec
            .as_ref()
            .unwrap()
            .ingress
            .iter()
            .flatten()
            .map(|r| {
                let port = match &r.ports.as_ref().unwrap()[0].port {
                    Some(IntOrString::Int(p)) => *p,
                    other => panic!("port {other:?}"),
                };
                (port, serde_json::to_value(&r.from).unwrap())
            })
            .collect()
    }

    fn keda() -> serde_json::Value {
        json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}})
    }

    fn controller() -> serde_json::Value {
        json!({
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "hearth-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "hearth"}},
        })
    }

    fn gateway_pods(name: &str) -> serde_json::Value {
        json!({"matchLabels": {
            "app.kubernetes.io/managed-by": "hearth",
            "app.kubernetes.io/name": format!("{name}-gateway"),
            "serving.hearth.dev/gateway": name,
        }})
    }

    #[test]
    fn off_by_default() {
        let (svc, rt) = service_and_runtime(json!({}));
        let c = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
        assert!(c.gateway_network_policy.is_none() && c.backend_network_policy.is_none());
    }

    #[test]
    fn a_services_gateway_and_backend_admit_only_their_peers() {
        let (svc, rt) = service_and_runtime(json!({}));
        let scraper = json!({"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}});
        let c = render(&svc, &rt, &enabled(json!([scraper])), true).unwrap();
        let gateway = c.gateway_network_policy.unwrap();
        assert_eq!(gateway.metadata.name.as_deref(), Some("chat-gateway"));
        assert_eq!(
            serde_json::to_value(&gateway.spec.as_ref().unwrap().pod_selector).unwrap(),
            gateway_pods("chat")
        );
        assert_eq!(
            rules(&gateway),
            [
                (
                    8080,
                    json!([{"namespaceSelector": {"matchLabels": {"team": "a"}}}])
                ),
                (
                    9091,
                    json!([{"podSelector": gateway_pods("chat")}, keda(), controller(), scraper])
                ),
                (9090, json!([keda()])),
            ]
        );
        let backend = c.backend_network_policy.unwrap();
        assert_eq!(backend.metadata.name.as_deref(), Some("chat-backend"));
        assert_eq!(
            rules(&backend),
            [(
                rt.spec.container.port.container_port,
                json!([{"podSelector": gateway_pods("chat")}, controller(), scraper])
            )]
        );
        assert_eq!(
            backend.spec.unwrap().policy_types,
            Some(vec!["Ingress".to_owned()])
        );
    }

    #[test]
    fn without_scrapers_the_admin_port_is_open_and_engines_are_not() {
        let (svc, rt) = service_and_runtime(json!({}));
        let c = render(&svc, &rt, &enabled(json!([])), true).unwrap();
        assert_eq!(
            rules(&c.gateway_network_policy.unwrap())[1],
            (9091, json!(null))
        );
        assert_eq!(
            rules(&c.backend_network_policy.unwrap())[0].1,
            json!([{"podSelector": gateway_pods("chat")}, controller()])
        );
    }

    #[test]
    fn an_attached_backend_admits_its_endpoints_gateway_across_namespaces() {
        let (svc, rt) = service_and_runtime(json!({}));
        let cfg = enabled(json!([]));
        let other = Placement::Shared(SharedGateway {
            endpoint: "shared".to_owned(),
            namespace: "platform".to_owned(),
            peers: false,
        });
        let c = render_placed(&svc, &rt, &cfg, true, &other).unwrap();
        assert!(c.gateway_network_policy.is_none());
        assert_eq!(
            rules(&c.backend_network_policy.unwrap())[0].1[0],
            json!({
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "platform"}},
                "podSelector": gateway_pods("shared"),
            })
        );
        let same = Placement::Shared(SharedGateway {
            endpoint: "shared".to_owned(),
            namespace: "team-a".to_owned(),
            peers: false,
        });
        let c = render_placed(&svc, &rt, &cfg, true, &same).unwrap();
        assert_eq!(
            rules(&c.backend_network_policy.unwrap())[0].1[0],
            json!({"podSelector": gateway_pods("shared")})
        );
    }

    #[test]
    fn an_endpoints_gateway_gets_the_gateway_policy() {
        let ep = llm_endpoint(json!({}), json!({}));
        let c = render_endpoint(&ep, &Default::default(), false, &enabled(json!([]))).unwrap();
        let p = c.gateway_network_policy.unwrap();
        assert_eq!(p.metadata.name.as_deref(), Some("shared-gateway"));
        assert_eq!(p.metadata.namespace.as_deref(), Some("platform"));
        assert_eq!(rules(&p)[1].0, 9091);
        assert_eq!(rules(&p)[2], (9090, json!([keda()])));
    }

    #[test]
    fn a_bad_flag_names_the_field() {
        for (json, want) in [
            ("{", "--model-network-policies: EOF"),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientFrom":[]}"#,
                "unknown field `clientFrom`",
            ),
            (
                r#"{"kedaNamespace":"","controllerNamespace":"h","controllerPodLabels":{"a":"b"}}"#,
                "kedaNamespace \"\" is not a namespace name",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{}}"#,
                "controllerPodLabels is empty",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerPodLabels":{"a":"b"}}"#,
                "missing field `controllerNamespace`",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"podSelector":"x"}]}"#,
                "clientsFrom",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"metricsFrom":[{"namespaceSelectr":{}}]}"#,
                "metricsFrom[0]: a peer needs podSelector, namespaceSelector or ipBlock",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"ipBlock":{"cidr":"10.0.0.0/8"}},{"ipBlock":{"cidr":"198.51.100.7"}}]}"#,
                "clientsFrom[1]: ipBlock.cidr \"198.51.100.7\" is not a CIDR",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"ipBlock":{"cidr":"198.51.100.0/24","except":["198.51.100.0/33"]}}]}"#,
                "ipBlock.except \"198.51.100.0/33\" is not a CIDR",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"ipBlock":{"cidr":"2001:db8::/32"},"podSelector":{}}]}"#,
                "ipBlock cannot be combined",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"ipBlock":{"cidr":"10.0.0.0/8","except":["192.168.0.0/16"]}}]}"#,
                "ipBlock.except \"192.168.0.0/16\" is not a strict subset of ipBlock.cidr \"10.0.0.0/8\"",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"ipBlock":{"cidr":"10.0.0.0/8","except":["2001:db8::/32"]}}]}"#,
                "not a strict subset",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"ipBlock":{"cidr":"10.0.0.0/8","except":["10.0.0.0/8"]}}]}"#,
                "not a strict subset",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"namespaceSelector":{"matchLabels":{"bad key!":"x"}}}]}"#,
                "clientsFrom[0].namespaceSelector.matchLabels[\"bad key!\"]: the key",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"podSelector":{"matchLabels":{"a":"not ok"}}}]}"#,
                "value \"not ok\" is not a label value",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"metricsFrom":[{"podSelector":{"matchExpressions":[{"key":"a","operator":"Bogus"}]}}]}"#,
                "metricsFrom[0].podSelector.matchExpressions[0].operator: \"Bogus\" is not an operator",
            ),
            (
                r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"metricsFrom":[{"podSelector":{"matchExpressions":[{"key":"a","operator":"In"}]}}]}"#,
                "matchExpressions[0].values: must not be empty with operator In",
            ),
            (
                r#"{"kedaNamespace":"KEDA NS","controllerNamespace":"h","controllerPodLabels":{"a":"b"}}"#,
                "kedaNamespace \"KEDA NS\" is not a namespace name",
            ),
        ] {
            let e = ModelNetworkPolicies::parse(json).unwrap_err();
            assert!(e.contains(want), "{json}: {e}");
        }
        let ok = r#"{"kedaNamespace":"keda","controllerNamespace":"h","controllerPodLabels":{"a":"b"},"clientsFrom":[{"ipBlock":{"cidr":"2001:db8::/32","except":["2001:db8:1::/48"]}},{"namespaceSelector":{},"podSelector":{"matchLabels":{"a":"b"},"matchExpressions":[{"key":"example.com/tier","operator":"Exists"}]}},{"ipBlock":{"cidr":"0.0.0.0/0","except":["198.51.100.0/24"]}}]}"#;
        assert_eq!(
            ModelNetworkPolicies::parse(ok).unwrap().clients_from.len(),
            3
        );
    }
}

//! An `LLMEndpoint`'s shared gateway, rendered by the same code as a service's own
//! (`gateway.rs`: Deployment, security context, API keys, PodDisruptionBudget, Services), with
//! the routing table as data: ConfigMap `<endpoint>-routes` holds the [`RouteTable`] of the
//! services the endpoint accepts, and the gateway reads it (`--routes-configmap`), so no model's
//! setting is in the pod template and a service joining or leaving never rolls the gateway.

use std::collections::BTreeMap;

use hearth_crds::{
    LLMEndpoint,
    llmendpoint::{ROUTES_KEY, RouteTable, routes_config_map},
    llmservice::ScalingSpec,
    rules::{self, Findings},
};
use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{ConfigMap, Service, ServiceAccount},
    networking::v1::NetworkPolicy,
    policy::v1::PodDisruptionBudget,
    rbac::v1::{Role, RoleBinding},
};
use kube::{Resource, ResourceExt};
use serde::Serialize;

use super::{
    RenderConfig, RenderError, ScalerMode,
    gateway::{
        Gateway, Routing, admin_service, endpoint_rbac, gateway_deployment, gateway_pdb,
        gateway_service, gateway_service_account, scaler_service,
    },
    network::gateway_network_policy,
};
use crate::labels::ENDPOINT_LABEL;

/// Every child of one `LLMEndpoint`, in its namespace.
#[derive(Clone, Debug)]
pub struct EndpointChildren {
    /// Identity of the gateway pods, `<ep>-gateway`.
    pub service_account: ServiceAccount,
    /// EndpointSlices (peers) and ConfigMaps (the routing table) in the endpoint's namespace.
    pub role: Role,
    /// Binds the Role to the ServiceAccount.
    pub role_binding: RoleBinding,
    /// The routing table, `<ep>-routes`.
    pub routes: ConfigMap,
    /// Client Service `<ep>`: port 80 → the gateway's `http`.
    pub gateway_service: Service,
    /// ExternalScaler Service `<ep>-scaler` (the endpoint's push mode, or a service in push
    /// mode attached).
    pub scaler_service: Option<Service>,
    /// The gateway's admin Service `<ep>-gateway-admin` (headless).
    pub admin_service: Service,
    /// Gateway Deployment `<ep>-gateway`.
    pub gateway: Deployment,
    /// Keeps all but one gateway replica up through voluntary disruptions.
    pub gateway_pdb: PodDisruptionBudget,
    /// NetworkPolicy `<ep>-gateway` on the gateway pods (`super::network`); `None` without
    /// [`RenderConfig::network_policies`].
    pub gateway_network_policy: Option<NetworkPolicy>,
}

impl EndpointChildren {
    /// All children as JSON, in apply order (dependencies first).
    pub fn to_values(&self) -> Result<Vec<serde_json::Value>, serde_json::Error> {
        fn v<T: Serialize>(t: &T) -> Result<serde_json::Value, serde_json::Error> {
            serde_json::to_value(t)
        }
        let mut out = vec![
            v(&self.service_account)?,
            v(&self.role)?,
            v(&self.role_binding)?,
            v(&self.routes)?,
        ];
        if let Some(p) = &self.gateway_network_policy {
            out.push(v(p)?);
        }
        out.push(v(&self.gateway_service)?);
        out.push(v(&self.admin_service)?);
        if let Some(s) = &self.scaler_service {
            out.push(v(s)?);
        }
        out.push(v(&self.gateway)?);
        out.push(v(&self.gateway_pdb)?);
        Ok(out)
    }
}

/// Whether the replicas of `ep`'s gateway sum their demand over each other (`--peer-service`):
/// with more than one replica (KEDA's poll and the sleeping tier need the total), and in the
/// endpoint's push mode (its `serving.hearth.dev/scaler` annotation: whichever replica KEDA's
/// gRPC connection lands on answers the total), as a service's own gateway in push mode.
/// Nothing per model decides it: a service joining never rolls the gateway.
pub(super) fn endpoint_peers(ep: &LLMEndpoint) -> bool {
    let push = rules::scaler_mode_of(&ep.metadata) == Ok(ScalerMode::Push);
    endpoint_replicas(ep) > 1 || push
}

fn endpoint_replicas(ep: &LLMEndpoint) -> i32 {
    ep.spec.replicas.unwrap_or(1).max(1)
}

/// Renders the shared gateway of `ep` with the routing table `routes` (the accepted services'
/// [`super::model_route`]s, sorted by model). Each attached service asks for its demand in its
/// own scaler mode, so the gateway always serves KEDA's ExternalScaler (`--scaler-listen`, port
/// `grpc-scaler`: nothing a joining service could change in the pod template); its Service
/// `<ep>-scaler` is rendered in the endpoint's push mode or when `push_services` (an attached
/// service in push mode).
///
/// # Errors
/// The endpoint breaks the rules (`hearth_crds::rules::check_llmendpoint`, errors only), has
/// no namespace, or the table does not serialize.
pub fn render_endpoint(
    ep: &LLMEndpoint,
    routes: &RouteTable,
    push_services: bool,
    cfg: &RenderConfig,
) -> Result<EndpointChildren, RenderError> {
    let mut findings = rules::check_llmendpoint(ep);
    if findings.blocks_rendering() {
        findings.0.retain(rules::Finding::is_error);
        return Err(RenderError::Rules(findings));
    }
    let name = ep.name_any();
    let namespace = ep.namespace().ok_or(RenderError::NoNamespace)?;
    let scaler =
        rules::scaler_mode_of(&ep.metadata).map_err(|f| RenderError::Rules(Findings(vec![f])))?;
    // Every replica drains in flight requests of any model for as long as a service's gateway
    // does by default: no model's drainTimeout is in the pod template.
    let drain_timeout = ScalingSpec::default().drain_timeout;
    let g = Gateway {
        name: &name,
        namespace: &namespace,
        owner: ep.controller_owner_ref(&()),
        extra_labels: BTreeMap::from([(ENDPOINT_LABEL.to_owned(), name.clone())]),
        replicas: endpoint_replicas(ep),
        api_key: ep.spec.api_key_secret_ref.as_ref(),
        tenants: &ep.spec.tenants,
        // The ExternalScaler port and flag, whatever the mode (see above).
        scaler: ScalerMode::Push,
        // KEDA's one client certificate for every shared gateway (`crate::scaler_tls`).
        scaler_client: cfg
            .shared_scaler_tls()
            .then(|| crate::names::SHARED_SCALER_CLIENT.to_owned()),
        peers: endpoint_peers(ep),
        pull_secrets: None,
        drain_timeout: &drain_timeout,
        routing: Routing::Table(routes_config_map(&name)),
    };
    let (role, role_binding) = endpoint_rbac(&g);
    let table =
        serde_json::to_string_pretty(routes).map_err(|e| RenderError::Serialize(e.to_string()))?;
    Ok(EndpointChildren {
        service_account: gateway_service_account(&g),
        role,
        role_binding,
        routes: ConfigMap {
            metadata: g.meta(routes_config_map(&name)),
            data: Some(BTreeMap::from([(ROUTES_KEY.to_owned(), table)])),
            ..Default::default()
        },
        gateway_service: gateway_service(&g),
        admin_service: admin_service(&g, cfg),
        scaler_service: (scaler == ScalerMode::Push || push_services)
            .then(|| scaler_service(&g, cfg)),
        gateway: gateway_deployment(&g, cfg)?,
        gateway_pdb: gateway_pdb(&g),
        gateway_network_policy: gateway_network_policy(&g, cfg),
    })
}

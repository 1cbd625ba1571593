//! A plain Deployment joined to an `LLMEndpoint` (its `serving.hearth.dev/endpoint` annotation,
//! checked by `hearth_crds::rules::check_deployment`, and accepted by the endpoint): what the
//! controller renders for it, in its namespace, owned by it (so the garbage collector removes
//! them with it), all named `<deployment>-hearth` ([`names::member`]) and labelled
//! [`labels::member_labels`]:
//!
//! - a ClusterIP Service selecting the Deployment's `spec.selector.matchLabels` on the engine's
//!   port ([`MemberPort`]), whose EndpointSlices the endpoint's gateway watches;
//! - a Role and RoleBinding letting the endpoint gateway's ServiceAccount (`<ep>-gateway` in the
//!   endpoint's namespace) read those EndpointSlices: the member Role an attached LLMService
//!   grants ([`member_rules`]), without the sleeping tier;
//! - a KEDA ScaledObject targeting the Deployment, its demand trigger pointed at the shared
//!   gateway exactly as an attached LLMService's (`keda.rs`, key `<namespace>/<deployment>`),
//!   min and max from the annotations, and `advanced.restoreToOriginalReplicaCount: true`, so
//!   that deleting it (the Deployment leaves the endpoint) gives the Deployment back the
//!   replicas it had. KEDA owns `spec.replicas` meanwhile; the controller never writes it.
//!
//! [`member_route`] is the model's entry in the endpoint's routing table.

use hearth_crds::{
    llmendpoint::ModelRoute,
    rules::{DeploymentMember, MemberPort, ScalerMode},
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Service, ServicePort, ServiceSpec},
        rbac::v1::{Role, RoleBinding},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{Resource, ResourceExt, api::DynamicObject};
use serde::Serialize;

use super::{
    BACKEND_SERVICE_PORT, RenderConfig, RenderError, SharedGateway,
    gateway::{member_rules, queue_bound, role_binding},
    keda::{Demand, Scaling, scaled_object_of},
};
use crate::{labels, names};

/// Everything rendered for one Deployment joined to an endpoint, in its namespace.
#[derive(Clone, Debug)]
pub struct MemberChildren {
    /// The engines' Service, `<deployment>-hearth`.
    pub service: Service,
    /// EndpointSlices read access for the endpoint's gateway.
    pub role: Role,
    /// Binds the Role to the endpoint gateway's ServiceAccount.
    pub role_binding: RoleBinding,
    /// Scales the Deployment on the shared gateway's demand for the model.
    pub scaled_object: DynamicObject,
}

impl MemberChildren {
    /// All of them as JSON, in apply order (the ScaledObject last: it scales the Deployment once
    /// the gateway can find its pods).
    pub fn to_values(&self) -> Result<Vec<serde_json::Value>, serde_json::Error> {
        fn v<T: Serialize>(t: &T) -> Result<serde_json::Value, serde_json::Error> {
            serde_json::to_value(t)
        }
        Ok(vec![
            v(&self.role)?,
            v(&self.role_binding)?,
            v(&self.service)?,
            v(&self.scaled_object)?,
        ])
    }
}

fn meta(d: &Deployment, namespace: &str) -> ObjectMeta {
    let name = d.name_any();
    ObjectMeta {
        name: Some(names::member(&name)),
        namespace: Some(namespace.to_owned()),
        labels: Some(labels::member_labels(&name)),
        owner_references: d.controller_owner_ref(&()).map(|o| vec![o]),
        ..Default::default()
    }
}

/// Renders what `d` (asking for `member`, serving on `port`) needs on the shared gateway
/// `shared` of the endpoint that accepted it.
///
/// # Errors
/// `d` has no namespace, or a duration does not parse (the rules rule that out).
pub fn render_member(
    d: &Deployment,
    member: &DeploymentMember,
    port: &MemberPort,
    shared: &SharedGateway,
    cfg: &RenderConfig,
) -> Result<MemberChildren, RenderError> {
    let namespace = d.namespace().ok_or(RenderError::NoNamespace)?;
    let name = d.name_any();
    let selector = d
        .spec
        .as_ref()
        .and_then(|s| s.selector.match_labels.clone())
        .unwrap_or_default();
    let service = Service {
        metadata: meta(d, &namespace),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            selector: Some(selector),
            ports: Some(vec![ServicePort {
                name: Some(port.name.clone()),
                port: BACKEND_SERVICE_PORT,
                target_port: Some(port.target.clone()),
                protocol: Some("TCP".to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    let role = Role {
        metadata: meta(d, &namespace),
        rules: Some(member_rules(None, false)),
    };
    let role_binding = role_binding(
        meta(d, &namespace),
        names::member(&name),
        names::gateway(&shared.endpoint),
        &shared.namespace,
    );
    let scaling = member.scaling();
    let scaled_object = scaled_object_of(
        &Scaling {
            metadata: meta(d, &namespace),
            target: name.clone(),
            spec: &scaling,
            scaler: member.scaler,
            // Push: the gateway's replicas are peers, as a service's own gateway in push mode.
            demand: Demand::shared(
                shared,
                format!("{namespace}/{name}"),
                member.scaler == ScalerMode::Push,
                cfg,
            ),
            restore_to_original: true,
        },
        cfg,
    )?;
    Ok(MemberChildren {
        service,
        role,
        role_binding,
        scaled_object,
    })
}

/// The route of `d` (asking for `member`, serving on `port`) in the routing table of the
/// endpoint that accepted it: the settings an attached LLMService's route holds, from the
/// annotations (an LLMService's defaults for the rest); no sleeping tier.
///
/// # Errors
/// `d` has no namespace.
pub fn member_route(
    d: &Deployment,
    member: &DeploymentMember,
    port: &MemberPort,
) -> Result<ModelRoute, RenderError> {
    let name = d.name_any();
    let scaling = member.scaling();
    let cold = member.cold_start();
    Ok(ModelRoute {
        model: member.model.clone(),
        aliases: Vec::new(),
        namespace: d.namespace().ok_or(RenderError::NoNamespace)?,
        service: name.clone(),
        uid: None,
        backend_service: names::member(&name),
        backend_port_name: port.name.clone(),
        max_queue: u64::try_from(queue_bound(&scaling)).unwrap_or(100),
        cold_start: cold.mode,
        heartbeat_interval: cold.heartbeat_interval,
        activation_timeout: scaling.activation_timeout,
        metric_target: f64::from(scaling.target),
        last_activation: None,
        sleep: None,
        container_concurrency: None,
        adapters: None,
    })
}

//! The gateway: its Deployment (flags, replicas, security, API keys), the client-facing and
//! scaler Services, its ServiceAccount, Role and RoleBinding, its PodDisruptionBudget, and the
//! gateway container's resources (`--gateway-resources`).

use std::collections::BTreeMap;

use hearth_crds::{
    Duration, InferenceRuntime, LLMService,
    llmendpoint::{ModelRoute, SleepRoute, WakeUpCall},
    llmservice::{ApiKeySecretRef, ColdStartMode, TenantSpec},
    quantity::{compare_quantities, is_quantity},
    rules::SleepTier,
};
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec},
        core::v1::{
            Capabilities, Container, ContainerPort, EnvVar, EnvVarSource, HTTPGetAction, KeyToPath,
            Lifecycle, LifecycleHandler, LocalObjectReference, ObjectFieldSelector,
            PodSecurityContext, PodSpec, PodTemplateSpec, Probe, ProjectedVolumeSource,
            ResourceRequirements, SeccompProfile, SecretProjection, SecretVolumeSource,
            SecurityContext, Service, ServiceAccount, ServicePort, ServiceSpec, SleepAction,
            TopologySpreadConstraint, Volume, VolumeMount, VolumeProjection,
        },
        policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec},
        rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject},
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use kube::ResourceExt;

use super::{BACKEND_SERVICE_PORT, Ctx, RenderConfig, RenderError, ScalerMode, duration_secs};
use crate::{
    labels::{self, Component},
    names,
};

/// The gateway container's default resources: requests `cpu: 50m`, `memory: 64Mi`; limit
/// `memory: 512Mi`. The limit keeps the pod admissible where a policy or a `ResourceQuota` on
/// `limits.memory` requires one, and the gateway bounds the request bodies it holds to half of it
/// (`--body-memory-limit`, 256 MiB here); the rest covers ~9 KiB per open connection. No CPU
/// limit: throttling a proxy adds latency to every request.
pub fn default_gateway_resources() -> ResourceRequirements {
    let q = |v: &str| Quantity(v.to_owned());
    ResourceRequirements {
        requests: Some(BTreeMap::from([
            ("cpu".to_owned(), q("50m")),
            ("memory".to_owned(), q("64Mi")),
        ])),
        limits: Some(BTreeMap::from([("memory".to_owned(), q("512Mi"))])),
        ..Default::default()
    }
}

/// The least memory limit a gateway container may have: the gateway keeps half of it for request
/// bodies, which must hold one body of `--body-limit` (8 MiB; the controller sets no other).
const GATEWAY_MIN_MEMORY_LIMIT: &str = "16Mi";

/// Gateway container resources from JSON, a Kubernetes `ResourceRequirements` such as
/// `{"requests":{"cpu":"50m","memory":"64Mi"},"limits":{"memory":"512Mi"}}`.
///
/// # Errors
/// A message naming the field, so that a value the apiserver would refuse for every gateway
/// Deployment stops the controller at start instead:
/// - not JSON, not a `ResourceRequirements`, a field other than `requests` and `limits`;
/// - a resource other than `cpu`, `memory` and `ephemeral-storage` (the gateway uses no device);
/// - a value that is not a non-negative quantity (apimachinery's `ParseQuantity` syntax);
/// - a request above its limit, or a memory limit below 16Mi (compared
///   when both are in the plain form, `500m` or `1.5Gi`).
pub fn parse_gateway_resources(json: &str) -> Result<ResourceRequirements, String> {
    use std::cmp::Ordering::{Greater, Less};
    let value: serde_json::Value =
        serde_json::from_str(json).map_err(|e| format!("not JSON: {e}"))?;
    let serde_json::Value::Object(fields) = &value else {
        return Err("must be a JSON object with requests and limits".to_owned());
    };
    if let Some(other) = fields.keys().find(|k| *k != "requests" && *k != "limits") {
        return Err(format!(
            "unknown field {other:?}: only requests and limits are set on the gateway"
        ));
    }
    let r: ResourceRequirements = serde_json::from_value(value).map_err(|e| {
        format!("not a ResourceRequirements ({e}), like {{\"limits\":{{\"memory\":\"512Mi\"}}}}")
    })?;
    for (kind, list) in [("requests", &r.requests), ("limits", &r.limits)] {
        for (name, Quantity(v)) in list.iter().flatten() {
            if !matches!(name.as_str(), "cpu" | "memory" | "ephemeral-storage") {
                return Err(format!(
                    "{kind}.{name}: the gateway takes cpu, memory and ephemeral-storage only"
                ));
            }
            if v.starts_with('-') {
                return Err(format!("{kind}.{name}: {v:?} must not be negative"));
            }
            if !is_quantity(v) {
                return Err(format!(
                    "{kind}.{name}: {v:?} is not a quantity; write it like \"500m\", \"256Mi\" or \"1.5\""
                ));
            }
        }
    }
    let limit_of = |name: &str| r.limits.as_ref().and_then(|l| l.get(name));
    for (name, Quantity(request)) in r.requests.iter().flatten() {
        if let Some(Quantity(limit)) = limit_of(name)
            && compare_quantities(request, limit) == Some(Greater)
        {
            return Err(format!(
                "requests.{name} ({request}) is above limits.{name} ({limit}); a request must not exceed its limit"
            ));
        }
    }
    if let Some(Quantity(limit)) = limit_of("memory")
        && compare_quantities(limit, GATEWAY_MIN_MEMORY_LIMIT) == Some(Less)
    {
        return Err(format!(
            "limits.memory ({limit}) is below {GATEWAY_MIN_MEMORY_LIMIT}: the gateway keeps half its memory limit for request bodies of up to 8Mi each"
        ));
    }
    Ok(r)
}

/// One gateway, a service's own or an `LLMEndpoint`'s shared one: what its objects are rendered
/// from, so both are rendered by the same code. Names are those of a service `N`: Deployment,
/// ServiceAccount, Role, RoleBinding and PodDisruptionBudget `N-gateway`, client Service `N`,
/// scaler Service `N-scaler`.
pub(super) struct Gateway<'a> {
    /// `N`: the service's or the endpoint's name.
    pub name: &'a str,
    /// Namespace of every object.
    pub namespace: &'a str,
    /// The controller owner reference (the LLMService or the LLMEndpoint).
    pub owner: Option<OwnerReference>,
    /// Labels beyond those of [`labels::labels`] (the endpoint's label).
    pub extra_labels: BTreeMap<String, String>,
    /// Gateway replicas.
    pub replicas: i32,
    /// The Secret key with the API keys clients must send.
    pub api_key: Option<&'a ApiKeySecretRef>,
    /// The tenants: `--tenant` flags, and their key Secrets projected into one volume.
    pub tenants: &'a [TenantSpec],
    /// How KEDA learns the demand: push adds the ExternalScaler port and Service.
    pub scaler: ScalerMode,
    /// Push mode over mutual TLS, with the DNS name KEDA's client certificate must carry
    /// (`--scaler-client-name`: [`names::scaler_client`] for a service's own gateway,
    /// [`names::SHARED_SCALER_CLIENT`] for a shared one): the Secret `N-scaler-tls` mounted at
    /// [`SCALER_TLS_DIR`], `--scaler-tls-dir`. `None`: plain gRPC.
    pub scaler_client: Option<String>,
    /// Whether the replicas sum their demand over each other (`--peer-service`).
    pub peers: bool,
    /// `imagePullSecrets` of the pods.
    pub pull_secrets: Option<Vec<LocalObjectReference>>,
    /// `--drain-timeout`, and the grace period it needs.
    pub drain_timeout: &'a Duration,
    /// What the gateway routes.
    pub routing: Routing,
}

/// What a gateway routes, as flags of `hearth-gateway` (docs/gateway.md).
pub(super) enum Routing {
    /// One model (a service's own gateway): its flags, in the order the gateway has always been
    /// given them around the shared ones.
    Model {
        /// After `--listen`: the backend, the model name and the cold-start settings.
        before_drain: Vec<String>,
        /// After `--drain-timeout`.
        after_drain: Vec<String>,
        /// After `--peer-service`: the sleeping tier.
        after_peers: Vec<String>,
    },
    /// A shared gateway: every model's settings are in the routing table of this ConfigMap
    /// (`--routes-configmap`), so none is in the pod template and a service joining or leaving
    /// never rolls the gateway.
    Table(String),
}

impl Gateway<'_> {
    pub(super) fn meta(&self, name: String) -> ObjectMeta {
        let mut l = labels::labels(self.name, Component::Gateway);
        l.extend(self.extra_labels.clone());
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.to_owned()),
            labels: Some(l),
            owner_references: self.owner.clone().map(|o| vec![o]),
            ..Default::default()
        }
    }

    fn selector(&self) -> BTreeMap<String, String> {
        labels::selector(self.name, Component::Gateway)
    }

    /// A Service `name` in front of the gateway pods: one TCP `port` forwarding to the pods'
    /// port named `port_name`.
    fn service(&self, name: String, port_name: &str, port: i32) -> Service {
        Service {
            metadata: self.meta(name),
            spec: Some(ServiceSpec {
                selector: Some(self.selector()),
                ports: Some(vec![ServicePort {
                    name: Some(port_name.to_owned()),
                    port,
                    target_port: Some(IntOrString::String(port_name.to_owned())),
                    protocol: Some("TCP".to_owned()),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            ..Default::default()
        }
    }
}

/// The client Service `N`: port 80 → the gateway's `http` port.
pub(super) fn gateway_service(g: &Gateway<'_>) -> Service {
    g.service(names::gateway_service(g.name), "http", 80)
}

/// The admin Service `N-gateway-admin`: headless, port `admin` → the pods' admin port. Not a
/// client's way in (the client Service `N` exposes `http` only): KEDA's `metrics-api` trigger
/// lists its EndpointSlices to poll each replica, and the replicas find their peers in them.
pub(super) fn admin_service(g: &Gateway<'_>, cfg: &RenderConfig) -> Service {
    let mut service = g.service(
        names::gateway_admin(g.name),
        hearth_crds::admin::PORT_NAME,
        cfg.admin_port,
    );
    if let Some(spec) = service.spec.as_mut() {
        spec.cluster_ip = Some("None".to_owned());
    }
    service
}

/// The ExternalScaler Service `N-scaler` (push mode).
pub(super) fn scaler_service(g: &Gateway<'_>, cfg: &RenderConfig) -> Service {
    let name = names::scaler_service(g.name);
    let mut service = g.service(name, "grpc-scaler", cfg.scaler_port);
    if let Some(spec) = service.spec.as_mut() {
        spec.type_ = Some("ClusterIP".to_owned());
    }
    service
}

/// The gateway pods' identity, `N-gateway`.
pub(super) fn gateway_service_account(g: &Gateway<'_>) -> ServiceAccount {
    ServiceAccount {
        metadata: g.meta(names::gateway(g.name)),
        ..Default::default()
    }
}

/// What a gateway may do in the namespace of a model it serves: read the EndpointSlices (of
/// the model's backend Service, and for peers of its own Service); for the LLMService
/// `service`, follow that one object (its `Ready` condition says when a backend cannot come
/// up: `hearth_gateway::diagnosis`), and with the sleeping tier (`sleeping`) record Events and
/// its `status.lastWake` (server-side apply on this one object). The Role of a service's own
/// gateway, the member Role an attached service (or a joined Deployment, with no LLMService)
/// grants an endpoint's shared gateway, and the first rule of the shared gateway's own Role.
/// The controller's ClusterRole must hold every right granted here (RBAC escalation
/// prevention): `tests/e2e/tests/chart.rs` reads this function's literals.
pub(super) fn member_rules(service: Option<&str>, sleeping: bool) -> Vec<PolicyRule> {
    let mut rules = vec![PolicyRule {
        api_groups: Some(vec!["discovery.k8s.io".to_owned()]),
        resources: Some(vec!["endpointslices".to_owned()]),
        verbs: vec!["get".to_owned(), "list".to_owned(), "watch".to_owned()],
        ..Default::default()
    }];
    let Some(service) = service else {
        return rules;
    };
    let group = <LLMService as kube::Resource>::group(&()).into_owned();
    rules.push(PolicyRule {
        api_groups: Some(vec![group.clone()]),
        resources: Some(vec!["llmservices".to_owned()]),
        resource_names: Some(vec![service.to_owned()]),
        verbs: vec!["list".to_owned(), "watch".to_owned()],
        ..Default::default()
    });
    if sleeping {
        rules.push(PolicyRule {
            api_groups: Some(vec!["events.k8s.io".to_owned()]),
            resources: Some(vec!["events".to_owned()]),
            verbs: vec!["create".to_owned(), "patch".to_owned()],
            ..Default::default()
        });
        rules.push(PolicyRule {
            api_groups: Some(vec![group]),
            resources: Some(vec!["llmservices/status".to_owned()]),
            resource_names: Some(vec![service.to_owned()]),
            verbs: vec!["patch".to_owned()],
            ..Default::default()
        });
    }
    rules
}

/// The Role `N-gateway` in the service's namespace: for its own gateway, or (bound to the
/// endpoint's ServiceAccount) for the shared gateway of the endpoint it is attached to. With
/// `adapters` (its own gateway reads the ConfigMap `N-adapters`), the right to read that one
/// ConfigMap too.
pub(super) fn gateway_role(ctx: &Ctx<'_>, adapters: bool) -> Role {
    let mut rules = member_rules(Some(&ctx.name), ctx.sleep_tier().is_some());
    if adapters {
        rules.push(PolicyRule {
            api_groups: Some(vec![String::new()]),
            resources: Some(vec!["configmaps".to_owned()]),
            resource_names: Some(vec![names::adapters(&ctx.name)]),
            verbs: vec!["get".to_owned(), "list".to_owned(), "watch".to_owned()],
            ..Default::default()
        });
    }
    Role {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        rules: Some(rules),
    }
}

/// The RoleBinding `N-gateway` of `ctx`'s service: its Role to the ServiceAccount
/// `account` in `account_namespace` (its own gateway's, or an endpoint's).
pub(super) fn gateway_role_binding(
    ctx: &Ctx<'_>,
    account: String,
    account_namespace: &str,
) -> RoleBinding {
    role_binding(
        ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        names::gateway(&ctx.name),
        account,
        account_namespace,
    )
}

/// The RoleBinding `metadata` of Role `role` to the ServiceAccount `account` of
/// `account_namespace`.
pub(super) fn role_binding(
    metadata: ObjectMeta,
    role: String,
    account: String,
    account_namespace: &str,
) -> RoleBinding {
    RoleBinding {
        metadata,
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".to_owned(),
            kind: "Role".to_owned(),
            name: role,
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: account,
            namespace: Some(account_namespace.to_owned()),
            ..Default::default()
        }]),
    }
}

/// The shared gateway's Role and RoleBinding in the endpoint's namespace: EndpointSlices (its
/// peers) and ConfigMaps (its routing table). What it may do in each attached service's
/// namespace is that service's member Role ([`gateway_role`]).
pub(super) fn endpoint_rbac(g: &Gateway<'_>) -> (Role, RoleBinding) {
    let name = names::gateway(g.name);
    let role = Role {
        metadata: g.meta(name.clone()),
        rules: Some(
            member_rules(None, false)
                .into_iter()
                .chain([PolicyRule {
                    api_groups: Some(vec![String::new()]),
                    resources: Some(vec!["configmaps".to_owned()]),
                    verbs: vec!["get".to_owned(), "list".to_owned(), "watch".to_owned()],
                    ..Default::default()
                }])
                .collect(),
        ),
    };
    let binding = role_binding(g.meta(name.clone()), name.clone(), name, g.namespace);
    (role, binding)
}

/// The gateway queue bound: enough for every replica at its target, ten times over, and never
/// below 100 (the API has no field for it yet).
pub fn max_queue(service: &LLMService) -> i64 {
    queue_bound(&service.spec.scaling)
}

/// [`max_queue`] of a scaling spec (an LLMService's, or a joined Deployment's annotations).
pub(super) fn queue_bound(s: &hearth_crds::llmservice::ScalingSpec) -> i64 {
    (i64::from(s.target) * i64::from(s.max) * 10).max(100)
}

fn http_probe(path: &str, period: i32) -> Probe {
    Probe {
        http_get: Some(HTTPGetAction {
            path: Some(path.to_owned()),
            port: IntOrString::String("http".to_owned()),
            ..Default::default()
        }),
        period_seconds: Some(period),
        ..Default::default()
    }
}

/// Seconds a terminating gateway keeps serving before it is signalled (its preStop `sleep`):
/// the window in which its endpoint leaves every node's Service rules (kube-proxy syncs at most
/// once a second by default, later under load). Without it a rollout of the gateway (a Hearth
/// upgrade re-renders its image) refuses the connections kube-proxy still sends to the old pod.
pub const GATEWAY_SHUTDOWN_DELAY_SECONDS: i64 = 5;

fn cold_start_mode(mode: ColdStartMode) -> &'static str {
    match mode {
        ColdStartMode::Keepalive => "keepalive",
        ColdStartMode::Reject => "reject",
    }
}

/// The sleeping tier of `svc` on its runtime as a shared gateway's routing table holds it, and
/// as [`sleep_args`] turns it into a per-service gateway's flags.
pub(super) fn sleep_route(svc: &LLMService, tier: &SleepTier<'_>) -> Option<SleepRoute> {
    let sleep = svc.spec.scaling.sleep.as_ref()?;
    Some(SleepRoute {
        after: sleep.after.clone(),
        level: tier.level,
        sleep_path: tier.mode.sleep_path.clone(),
        is_sleeping_path: tier.mode.is_sleeping_path.clone(),
        wake_up: tier
            .wake_up
            .iter()
            .map(|c| WakeUpCall {
                path: c.path.clone(),
                body: c.body.clone(),
            })
            .collect(),
    })
}

/// The `--sleep-*` and `--wake-up-call` flags of a sleeping tier.
fn sleep_args(route: &SleepRoute) -> Vec<String> {
    let mut args = vec![
        format!("--sleep-after={}", route.after),
        format!("--sleep-level={}", route.level),
        format!("--sleep-path={}", route.sleep_path),
        format!("--is-sleeping-path={}", route.is_sleeping_path),
    ];
    for call in &route.wake_up {
        args.push(match &call.body {
            Some(body) => format!("--wake-up-call={} {body}", call.path),
            None => format!("--wake-up-call={}", call.path),
        });
    }
    args
}

/// Checks the durations a gateway is given for `ctx`'s service (the flags, or its route).
fn check_model_durations(svc: &LLMService) -> Result<(), RenderError> {
    let s = &svc.spec.scaling;
    duration_secs(&s.activation_timeout, "spec.scaling.activationTimeout")?;
    duration_secs(
        &svc.spec.endpoint.cold_start.heartbeat_interval,
        "spec.endpoint.coldStart.heartbeatInterval",
    )?;
    Ok(())
}

/// The service's own gateway, with its model's flags; with `adapters`, it reads the adapter
/// table from the ConfigMap `N-adapters` (`--adapters-configmap`).
pub(super) fn own_gateway<'a>(
    ctx: &'a Ctx<'_>,
    adapters: bool,
) -> Result<Gateway<'a>, RenderError> {
    let svc = ctx.svc;
    let s = &svc.spec.scaling;
    let cold = &svc.spec.endpoint.cold_start;
    check_model_durations(svc)?;
    let backend_port = &ctx.rt.spec.container.port;
    let mut before_drain = vec![
        format!("--backend-service={}", names::backend_service(&ctx.name)),
        format!("--backend-port={BACKEND_SERVICE_PORT}"),
        format!("--backend-port-name={}", backend_port.name),
        // The runtime templates serve the model under the service name.
        format!("--served-model-name={}", ctx.name),
        // The `service` label of its metrics, as a shared gateway labels each model's.
        format!("--service-key={}/{}", ctx.namespace, ctx.name),
        format!("--max-queue={}", max_queue(svc)),
        format!("--cold-start={}", cold_start_mode(cold.mode)),
        format!("--heartbeat-interval={}", cold.heartbeat_interval),
        format!("--activation-timeout={}", s.activation_timeout),
    ];
    // The names clients may use besides the service's; forwarded under the service's name.
    let aliases = hearth_crds::rules::served_aliases(svc);
    if !aliases.is_empty() {
        before_drain.push(format!("--model-alias={}", aliases.join(",")));
    }
    let mut after_peers = Vec::new();
    if let Some(route) = ctx.sleep_tier().and_then(|t| sleep_route(svc, &t)) {
        after_peers = sleep_args(&route);
    }
    // Its activation failures (and the sleeping tier's reports) are on the LLMService.
    after_peers.push(format!("--llmservice={}", ctx.name));
    if let Some(uid) = &svc.metadata.uid {
        after_peers.push(format!("--llmservice-uid={uid}"));
    }
    if adapters {
        after_peers.push(format!(
            "--adapters-configmap={}",
            names::adapters(&ctx.name)
        ));
    }
    Ok(Gateway {
        name: &ctx.name,
        namespace: &ctx.namespace,
        owner: ctx.owner.clone(),
        extra_labels: BTreeMap::new(),
        replicas: gateway_replicas(svc),
        api_key: svc.spec.endpoint.api_key_secret_ref.as_ref(),
        tenants: &svc.spec.endpoint.tenants,
        scaler: ctx.scaler,
        scaler_client: (ctx.scaler == ScalerMode::Push && ctx.cfg.scaler_tls)
            .then(|| names::scaler_client(&ctx.name, &ctx.namespace)),
        peers: ctx.gateway_peers(),
        pull_secrets: ctx.pull_secrets(),
        drain_timeout: &s.drain_timeout,
        routing: Routing::Model {
            before_drain,
            after_drain: std::iter::once(format!("--metric-target={}", s.target))
                .chain(
                    hearth_crds::rules::container_concurrency(svc, Some(ctx.rt))
                        .map(|c| format!("--container-concurrency={c}")),
                )
                .collect(),
            after_peers,
        },
    })
}

/// The route of `svc` (accepted by a shared endpoint, served by `rt`) in the endpoint's routing
/// table: the settings its own gateway takes as flags, and the adapter table of its accepted
/// `adapters` (sorted by served name) that its own gateway reads from a ConfigMap.
pub fn model_route(
    svc: &LLMService,
    rt: &InferenceRuntime,
    adapters: &super::ServiceAdapters,
) -> Result<ModelRoute, RenderError> {
    check_model_durations(svc)?;
    let name = svc.name_any();
    let s = &svc.spec.scaling;
    let cold = &svc.spec.endpoint.cold_start;
    let tier = hearth_crds::rules::sleep_tier(svc, Some(rt)).ok().flatten();
    Ok(ModelRoute {
        // The runtime templates serve the model under the service name.
        model: name.clone(),
        aliases: hearth_crds::rules::served_aliases(svc),
        namespace: svc.namespace().ok_or(RenderError::NoNamespace)?,
        service: name.clone(),
        uid: svc.metadata.uid.clone(),
        backend_service: names::backend_service(&name),
        backend_port_name: rt.spec.container.port.name.clone(),
        max_queue: u64::try_from(max_queue(svc)).unwrap_or(100),
        cold_start: cold.mode,
        heartbeat_interval: cold.heartbeat_interval.clone(),
        activation_timeout: s.activation_timeout.clone(),
        metric_target: f64::from(s.target),
        last_activation: svc
            .status
            .as_ref()
            .and_then(|st| st.last_activation.as_ref())
            .map(|a| Duration::new(a.phases.total.clone())),
        sleep: tier.and_then(|t| sleep_route(svc, &t)),
        container_concurrency: hearth_crds::rules::container_concurrency(svc, Some(rt)),
        adapters: super::adapters::rendered(rt, &name, adapters).map(|a| a.table),
    })
}

/// The gateway Deployment `N-gateway`: `hearth-gateway` with its flags, replicas spread over
/// nodes, the restricted security context and the API key file.
pub(super) fn gateway_deployment(
    g: &Gateway<'_>,
    cfg: &RenderConfig,
) -> Result<Deployment, RenderError> {
    let drain = duration_secs(g.drain_timeout, "spec.scaling.drainTimeout")?;
    // Flags of `hearth-gateway` (docs/gateway.md); the namespace comes from POD_NAMESPACE.
    let mut args = vec![format!("--listen=[::]:{}", cfg.gateway_port)];
    match &g.routing {
        Routing::Model { before_drain, .. } => args.extend(before_drain.iter().cloned()),
        Routing::Table(config_map) => args.push(format!("--routes-configmap={config_map}")),
    }
    args.push(format!("--drain-timeout={}", g.drain_timeout));
    if let Routing::Model { after_drain, .. } = &g.routing {
        args.extend(after_drain.iter().cloned());
    }
    let mut ports = vec![ContainerPort {
        name: Some("http".to_owned()),
        container_port: cfg.gateway_port,
        protocol: Some("TCP".to_owned()),
        ..Default::default()
    }];
    if g.scaler == ScalerMode::Push {
        args.push(format!("--scaler-listen=[::]:{}", cfg.scaler_port));
        ports.push(ContainerPort {
            name: Some("grpc-scaler".to_owned()),
            container_port: cfg.scaler_port,
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        });
    }
    args.push(format!("--admin-listen=[::]:{}", cfg.admin_port));
    ports.push(ContainerPort {
        name: Some(hearth_crds::admin::PORT_NAME.to_owned()),
        container_port: cfg.admin_port,
        protocol: Some("TCP".to_owned()),
        ..Default::default()
    });
    if g.peers {
        args.push(format!("--peer-service={}", names::gateway_admin(g.name)));
    }
    if let Routing::Model { after_peers, .. } = &g.routing {
        args.extend(after_peers.iter().cloned());
    }
    let field_env = |name: &str, path: &str| EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: path.to_owned(),
                api_version: None,
            }),
            ..Default::default()
        }),
    };
    let container = Container {
        name: "gateway".to_owned(),
        image: Some(cfg.gateway_image.clone()),
        args: Some(args),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_IPS", "status.podIPs"),
        ]),
        ports: Some(ports),
        readiness_probe: Some(http_probe("/readyz", 5)),
        liveness_probe: Some(http_probe("/healthz", 10)),
        resources: Some(cfg.gateway_resources.clone()),
        // Keeps serving while its endpoint is withdrawn; SIGTERM (the drain) comes after.
        lifecycle: Some(Lifecycle {
            pre_stop: Some(LifecycleHandler {
                sleep: Some(SleepAction {
                    seconds: GATEWAY_SHUTDOWN_DELAY_SECONDS,
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut pod_labels = labels::labels(g.name, Component::Gateway);
    pod_labels.extend(g.extra_labels.clone());
    let d = Deployment {
        metadata: g.meta(names::gateway(g.name)),
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(g.selector()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(pod_labels),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(names::gateway(g.name)),
                    containers: vec![container],
                    image_pull_secrets: g.pull_secrets.clone(),
                    // The shutdown delay, then held and streaming requests finish within
                    // the drain window.
                    termination_grace_period_seconds: Some(
                        i64::try_from(drain).unwrap_or(i64::MAX / 2)
                            + GATEWAY_SHUTDOWN_DELAY_SECONDS
                            + 5,
                    ),
                    enable_service_links: Some(false),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    };
    Ok(gateway_extensions(g, cfg, d))
}

/// Gateway replicas of a service's own gateway: `spec.endpoint.replicas`, default 1.
pub fn gateway_replicas(service: &LLMService) -> i32 {
    service.spec.endpoint.replicas.unwrap_or(1).max(1)
}

/// UID and GID the gateway runs as: the image's `USER 65532:65532` (distroless "nonroot"),
/// stated in the pod so `runAsNonRoot` can be checked without reading the image.
pub const GATEWAY_UID: i64 = 65532;

/// Directory the API key Secret is mounted at, and the file (the Secret key's projection) the
/// gateway reads with `--api-key-file`.
pub const API_KEY_DIR: &str = "/etc/hearth/api-keys";
/// Directory the ExternalScaler's TLS Secret (`ca.crt`, `tls.crt`, `tls.key` of `N-scaler-tls`)
/// is mounted at, read with `--scaler-tls-dir`.
pub const SCALER_TLS_DIR: &str = "/etc/hearth/scaler-tls";
/// Directory the gateway's admin Secret (`token`, `authorized.json` of `N-gateway-admin`) is
/// mounted at, read with `--admin-auth-dir`.
pub const ADMIN_AUTH_DIR: &str = "/etc/hearth/admin";
/// File name of the API keys under [`API_KEY_DIR`].
pub const API_KEY_FILE: &str = "keys";
/// Directory the tenants' key Secrets are projected into, one file per tenant (its name).
pub const TENANT_KEY_DIR: &str = "/etc/hearth/tenants";

/// The `--tenant` flag of `t`, whose keys (if any) are the file `<TENANT_KEY_DIR>/<name>`.
pub fn tenant_flag(t: &TenantSpec) -> String {
    let mut flag = format!("--tenant=name={}", t.name);
    if t.api_key_secret_ref.is_some() {
        flag.push_str(&format!(",key-file={TENANT_KEY_DIR}/{}", t.name));
    }
    if t.priority != 0 {
        flag.push_str(&format!(",priority={}", t.priority));
    }
    if let Some(n) = t.requests_per_minute {
        flag.push_str(&format!(",requests-per-minute={n}"));
    }
    if let Some(n) = t.tokens_per_minute {
        flag.push_str(&format!(",tokens-per-minute={n}"));
    }
    flag
}

/// Pod Security `restricted` for the gateway pod: non-root, RuntimeDefault seccomp, no
/// privilege escalation, no capabilities, read-only root filesystem (the gateway writes no file).
fn gateway_security(pod: &mut PodSpec) {
    pod.security_context = Some(PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(GATEWAY_UID),
        run_as_group: Some(GATEWAY_UID),
        // Group owner of the mounted API key file, which is then readable by the group only.
        fs_group: Some(GATEWAY_UID),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            localhost_profile: None,
        }),
        ..Default::default()
    });
    for c in &mut pod.containers {
        c.security_context = Some(SecurityContext {
            allow_privilege_escalation: Some(false),
            capabilities: Some(Capabilities {
                drop: Some(vec!["ALL".to_owned()]),
                add: None,
            }),
            read_only_root_filesystem: Some(true),
            run_as_non_root: Some(true),
            ..Default::default()
        });
    }
}

/// What the gateway Deployment gets beyond its flags: its replicas spread over nodes, the
/// restricted security context, the peer port name, and the API key Secret mounted as a file
/// for `--api-key-file`.
///
/// The Secret is a volume, never `subPath` (the kubelet does not update those) and never env:
/// editing the Secret rotates the keys in every replica without a restart (the kubelet swaps
/// the file, the gateway re-reads it). The volume is not optional, so a missing Secret or key
/// keeps the pods in `ContainerCreating` with a `FailedMount` event naming it, rather than
/// starting a gateway without authentication.
fn gateway_extensions(g: &Gateway<'_>, cfg: &RenderConfig, mut d: Deployment) -> Deployment {
    let Some(spec) = d.spec.as_mut() else {
        return d;
    };
    spec.replicas = Some(g.replicas);
    let Some(pod) = spec.template.spec.as_mut() else {
        return d;
    };
    pod.topology_spread_constraints = Some(vec![TopologySpreadConstraint {
        max_skew: 1,
        topology_key: "kubernetes.io/hostname".to_owned(),
        when_unsatisfiable: "ScheduleAnyway".to_owned(),
        label_selector: Some(LabelSelector {
            match_labels: Some(g.selector()),
            ..Default::default()
        }),
        // Only the pods of the same rollout count, so a rollout does not skew the spread.
        match_label_keys: Some(vec!["pod-template-hash".to_owned()]),
        ..Default::default()
    }]);
    gateway_security(pod);
    if let Some(r) = g.api_key {
        pod.volumes.get_or_insert_with(Vec::new).push(Volume {
            name: "api-keys".to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(r.name.clone()),
                items: Some(vec![KeyToPath {
                    key: r.key.clone(),
                    path: API_KEY_FILE.to_owned(),
                    mode: None,
                }]),
                default_mode: Some(0o440),
                optional: Some(false),
            }),
            ..Default::default()
        });
    }
    // Each tenant's key Secret, projected into one volume (not optional, as the API keys'),
    // one file per tenant; a projected volume is updated in place as a Secret volume is.
    let tenant_sources: Vec<VolumeProjection> = g
        .tenants
        .iter()
        .filter_map(|t| {
            let r = t.api_key_secret_ref.as_ref()?;
            Some(VolumeProjection {
                secret: Some(SecretProjection {
                    name: r.name.clone(),
                    items: Some(vec![KeyToPath {
                        key: r.key.clone(),
                        path: t.name.clone(),
                        mode: None,
                    }]),
                    optional: Some(false),
                }),
                ..Default::default()
            })
        })
        .collect();
    if !tenant_sources.is_empty() {
        pod.volumes.get_or_insert_with(Vec::new).push(Volume {
            name: "tenant-keys".to_owned(),
            projected: Some(ProjectedVolumeSource {
                sources: Some(tenant_sources),
                default_mode: Some(0o440),
            }),
            ..Default::default()
        });
    }
    if g.scaler_client.is_some() {
        // Only what the gateway serves with: the CA's signing key stays in the Secret.
        let item = |key: &str| KeyToPath {
            key: key.to_owned(),
            path: key.to_owned(),
            mode: None,
        };
        pod.volumes.get_or_insert_with(Vec::new).push(Volume {
            name: "scaler-tls".to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(names::scaler_tls(g.name)),
                items: Some(vec![item("ca.crt"), item("tls.crt"), item("tls.key")]),
                default_mode: Some(0o440),
                optional: Some(false),
            }),
            ..Default::default()
        });
    }
    if cfg.admin_auth.is_some() {
        // Not optional: without its tokens the gateway would not start (it refuses an
        // --admin-auth-dir it cannot read), and an open admin port is never the fallback.
        pod.volumes.get_or_insert_with(Vec::new).push(Volume {
            name: "admin-auth".to_owned(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(names::gateway_admin(g.name)),
                default_mode: Some(0o440),
                optional: Some(false),
                ..Default::default()
            }),
            ..Default::default()
        });
    }
    if let Some(c) = pod.containers.first_mut() {
        let args = c.args.get_or_insert_with(Vec::new);
        if cfg.admin_auth.is_some() {
            args.push(format!("--admin-auth-dir={ADMIN_AUTH_DIR}"));
            c.volume_mounts
                .get_or_insert_with(Vec::new)
                .push(VolumeMount {
                    name: "admin-auth".to_owned(),
                    mount_path: ADMIN_AUTH_DIR.to_owned(),
                    read_only: Some(true),
                    ..Default::default()
                });
        }
        if let Some(client) = &g.scaler_client {
            args.push(format!("--scaler-tls-dir={SCALER_TLS_DIR}"));
            args.push(format!("--scaler-client-name={client}"));
            c.volume_mounts
                .get_or_insert_with(Vec::new)
                .push(VolumeMount {
                    name: "scaler-tls".to_owned(),
                    mount_path: SCALER_TLS_DIR.to_owned(),
                    read_only: Some(true),
                    ..Default::default()
                });
        }
        if g.peers {
            args.push(format!(
                "--peer-port-name={}",
                hearth_crds::admin::PORT_NAME
            ));
        }
        args.extend(g.tenants.iter().map(tenant_flag));
        if g.tenants.iter().any(|t| t.api_key_secret_ref.is_some()) {
            c.volume_mounts
                .get_or_insert_with(Vec::new)
                .push(VolumeMount {
                    name: "tenant-keys".to_owned(),
                    mount_path: TENANT_KEY_DIR.to_owned(),
                    read_only: Some(true),
                    ..Default::default()
                });
        }
        if g.api_key.is_some() {
            args.push(format!("--api-key-file={API_KEY_DIR}/{API_KEY_FILE}"));
            c.volume_mounts
                .get_or_insert_with(Vec::new)
                .push(VolumeMount {
                    name: "api-keys".to_owned(),
                    mount_path: API_KEY_DIR.to_owned(),
                    read_only: Some(true),
                    ..Default::default()
                });
        }
    }
    d
}

/// The gateway's PodDisruptionBudget: at most one replica down at a time through voluntary
/// disruptions, so with two or more replicas a node drain never takes the endpoint away, and
/// with one it never blocks a drain.
pub(super) fn gateway_pdb(g: &Gateway<'_>) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: g.meta(names::gateway(g.name)),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(g.selector()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

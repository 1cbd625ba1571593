//! Rendering: one `LLMService` plus its resolved `InferenceRuntime` → the children, as plain
//! objects, with no cluster access (so `hearth-controller render` and golden tests see exactly
//! what the reconciler applies).
//!
//! [`render`] builds every child from one shared context, one file per part:
//! - `backend.rs`: the backend Deployment and Service. The Deployment is built in two steps: a
//!   plain skeleton (image, rendered args/env templates, ports, cache mounts, cpu/memory), then
//!   [`crate::policy::apply`] lays the runtime specifics on it;
//! - `gateway.rs`: the gateway Deployment, its Services, ServiceAccount, Role, RoleBinding and
//!   PodDisruptionBudget, and the gateway container's resources;
//! - `cache.rs`: the cache volume, the NodeLocalPVC or SharedPVC claim and the prewarm Job (create-once, with
//!   a [`TEMPLATE_HASH_ANNOTATION`]);
//! - `keda.rs`: the KEDA ScaledObject;
//! - `endpoint.rs`: an `LLMEndpoint`'s shared gateway ([`render_endpoint`]), from the same
//!   gateway code as a service's own, and its routing table;
//! - `member.rs`: what a plain Deployment joined to an endpoint needs ([`render_member`]: its
//!   Service, member Role and RoleBinding, ScaledObject) and its route ([`member_route`]).
//!
//! A service accepted by an `LLMEndpoint` ([`Placement::Shared`]) renders no gateway of its own:
//! its Role and RoleBinding `N-gateway` grant the endpoint's gateway what its own would have in
//! its namespace, and its ScaledObject asks the endpoint's gateway for its demand.

use hearth_crds::{
    InferenceRuntime, LLMService,
    llmservice::CacheStrategy,
    rules::{self, Findings},
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        batch::v1::Job,
        core::v1::{
            ConfigMap, EnvFromSource, PersistentVolumeClaim, ResourceRequirements, SecretEnvSource,
            Service, ServiceAccount, ServicePort, ServiceSpec,
        },
        networking::v1::NetworkPolicy,
        policy::v1::PodDisruptionBudget,
        rbac::v1::{Role, RoleBinding},
    },
    apimachinery::pkg::{
        apis::meta::v1::{ObjectMeta, OwnerReference},
        util::intstr::IntOrString,
    },
};
use kube::{
    Resource, ResourceExt,
    api::{ApiResource, DynamicObject},
};
use serde::Serialize;

use crate::{
    labels::{self, Component},
    model::{self, ModelSource},
    names, policy, template,
};

mod adapters;
mod backend;
mod cache;
mod endpoint;
mod gateway;
mod keda;
mod member;
pub mod network;
pub mod sources;
#[cfg(test)]
mod tests;

use self::{
    backend::{backend_service, backend_skeleton, set_backend_security},
    cache::{cache_claim, prewarm_job},
    gateway::{
        admin_service, gateway_deployment, gateway_pdb, gateway_role, gateway_role_binding,
        gateway_service, gateway_service_account, own_gateway, scaler_service,
    },
    keda::scaled_object,
    network::{backend_network_policy, gateway_network_policy},
};
pub use adapters::{
    ADAPTERS_CACHE_DIR, ADAPTERS_MOUNT_ROOT, RenderedAdapters, ServiceAdapters, fetch_job_name,
    fetch_pending, unserved,
};
pub use backend::{BACKEND_SERVICE_PORT, default_backend_security_context, serving_container};
pub use endpoint::{EndpointChildren, render_endpoint};
pub use gateway::{
    API_KEY_DIR, API_KEY_FILE, GATEWAY_SHUTDOWN_DELAY_SECONDS, GATEWAY_UID,
    default_gateway_resources, gateway_replicas, max_queue, model_route, parse_gateway_resources,
};
pub use keda::{
    TLS_DIGEST_KEY, scaled_object_resource, set_tls_digest, trigger_authentication_resource,
};
pub use member::{MemberChildren, member_route, render_member};
pub use network::ModelNetworkPolicies;
pub use sources::ModelSources;

/// Annotation on create-once children (cache claim, prewarm Job) recording a hash of the
/// fields that cannot change after creation, so a changed spec is detected and reported.
pub const TEMPLATE_HASH_ANNOTATION: &str = "serving.hearth.dev/template-hash";

/// Settings that do not come from the `LLMService`: Hearth's own images and node paths.
#[derive(Clone, Debug)]
pub struct RenderConfig {
    /// Image running `hearth-gateway`.
    pub gateway_image: String,
    /// Resources of each gateway container (see [`default_gateway_resources`]).
    pub gateway_resources: ResourceRequirements,
    /// Image of the backend drain sidecar, bound as the policies' `settings.drainImage`;
    /// `None`: no sidecar (the built-in drain falls back to a `sleep` preStop).
    pub drain_image: Option<String>,
    /// Node directory for `cache.strategy: HostPath` (shared by services on a node; the cache
    /// layout is keyed by repository, so sharing is safe).
    pub host_path_root: String,
    /// The gateway's HTTP port (OpenAI API and `GET /hearth/queue`).
    pub gateway_port: i32,
    /// The gateway's KEDA ExternalScaler gRPC port (push mode).
    pub scaler_port: i32,
    /// The ScaledObject API: KEDA's `keda.sh/v1alpha1` (see [`scaled_object_resource`]). Its
    /// CRD, `<plural>.<group>`, is what the controller watches to learn whether KEDA is installed.
    pub keda_api: ApiResource,
    /// The ServingPolicies the backend is rendered through.
    pub engine: policy::Engine,
    /// Mutual TLS between KEDA and a push-mode service's own gateway: the gateway serves the
    /// ExternalScaler with the Secret `N-scaler-tls`, and KEDA connects through the
    /// TriggerAuthentication `N-scaler` (see `crate::scaler_tls`). `false`: plain gRPC.
    pub scaler_tls: bool,
    /// With `scaler_tls`, mutual TLS on the `LLMEndpoint`s' shared gateways too: each serves
    /// the ExternalScaler with the Secret `<ep>-scaler-tls` and takes only KEDA's shared client
    /// certificate (`crate::names::SHARED_SCALER_CLIENT`), and the push trigger of every model
    /// on a shared gateway connects through the ClusterTriggerAuthentication of this name
    /// (`caCert`, `tlsClientCert`, `tlsClientKey` from a Secret in KEDA's namespace). `None`:
    /// shared gateways serve it in plain gRPC.
    pub shared_scaler_auth: Option<String>,
    /// The gateway's admin port ([`hearth_crds::admin::PORT`]): demand, metrics, metering.
    pub admin_port: i32,
    /// Bearer tokens on the gateways' admin ports: each gateway mounts its admin Secret
    /// (`N-gateway-admin`, written by `crate::admin_tokens`) for `--admin-auth-dir`, and
    /// KEDA's `metrics-api` trigger authenticates through the ClusterTriggerAuthentication of
    /// this name (`bearer`). `None`: admin ports open, triggers without authentication.
    pub admin_auth: Option<String>,
    /// The data plane's NetworkPolicies (`N-gateway`, `N-backend`; see [`network`]); `None`:
    /// none are written (and those written before are deleted).
    pub network_policies: Option<ModelNetworkPolicies>,
    /// Model sources for the whole cluster (`--model-sources`): a hub mirror, a proxy, a CA
    /// bundle, for every engine and every Job that fetches weights ([`sources`]).
    pub model_sources: ModelSources,
    /// KEDA's version as the controller found it ([`crate::versions`]): an older KEDA gets the
    /// poll trigger it can run.
    pub keda_version: crate::versions::KedaVersion,
}

impl RenderConfig {
    /// Defaults with the built-in ServingPolicies. Errors only if an embedded policy does not
    /// compile, which this crate's tests rule out.
    pub fn builtin() -> Result<Self, policy::PolicyError> {
        Ok(Self {
            gateway_image: default_gateway_image(),
            gateway_resources: default_gateway_resources(),
            drain_image: Some(default_gateway_image()),
            host_path_root: "/var/lib/hearth/models".to_owned(),
            gateway_port: 8080,
            scaler_port: 9090,
            keda_api: scaled_object_resource(),
            engine: policy::Engine::builtin()?,
            scaler_tls: true,
            shared_scaler_auth: Some(DEFAULT_SHARED_SCALER_TRIGGER_AUTH.to_owned()),
            admin_port: hearth_crds::admin::PORT,
            admin_auth: Some(DEFAULT_ADMIN_TRIGGER_AUTH.to_owned()),
            network_policies: None,
            model_sources: ModelSources::default(),
            keda_version: crate::versions::KedaVersion::default(),
        })
    }
}

impl RenderConfig {
    /// Whether the shared gateways serve the ExternalScaler over mutual TLS: `scaler_tls` and
    /// [`RenderConfig::shared_scaler_auth`].
    pub fn shared_scaler_tls(&self) -> bool {
        self.scaler_tls && self.shared_scaler_auth.is_some()
    }

    /// What the backend's policies see as `settings`.
    pub fn policy_settings(&self) -> hearth_policies::PolicySettings {
        hearth_policies::PolicySettings {
            drain_image: self.drain_image.clone(),
        }
    }
}

/// The ClusterTriggerAuthentication the chart installs for KEDA's `metrics-api` triggers
/// (`token` from the Secret of KEDA's token, in KEDA's namespace).
pub const DEFAULT_ADMIN_TRIGGER_AUTH: &str = "hearth-gateway-admin";

/// The ClusterTriggerAuthentication the chart installs for the push triggers of models on shared
/// gateways (KEDA's client certificate from a Secret in KEDA's namespace).
pub const DEFAULT_SHARED_SCALER_TRIGGER_AUTH: &str = "hearth-scaler";

/// The default gateway image: Hearth's registry, tagged with this controller's version.
pub fn default_gateway_image() -> String {
    format!(
        "ghcr.io/hearth-rs/hearth-gateway:v{}",
        env!("CARGO_PKG_VERSION")
    )
}

/// How KEDA learns the gateway's demand (`serving.hearth.dev/scaler` annotation).
pub use hearth_crds::rules::ScalerMode;

/// Where a service's gateway is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Placement {
    /// Its own gateway (no `sharedEndpointRef`, or the endpoint does not accept it): as
    /// upstream Hearth renders it.
    #[default]
    Own,
    /// Attached to an `LLMEndpoint`, whose shared gateway serves the model.
    Shared(SharedGateway),
}

/// The shared gateway of the `LLMEndpoint` a service is attached to: what the service's
/// member RBAC, ScaledObject and status point at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedGateway {
    /// The endpoint's name (its client Service; its gateway's objects are `<name>-gateway`).
    pub endpoint: String,
    /// The endpoint's namespace.
    pub namespace: String,
    /// Whether the endpoint's gateway replicas sum their demand over each other (more than one
    /// replica, or the endpoint's push mode): KEDA's poll then asks each for its local demand.
    pub peers: bool,
}

impl SharedGateway {
    /// The shared gateway of `ep`.
    pub fn of(ep: &hearth_crds::LLMEndpoint) -> Self {
        Self {
            endpoint: ep.name_any(),
            namespace: ep.namespace().unwrap_or_default(),
            peers: endpoint::endpoint_peers(ep),
        }
    }
}

/// Every child of one `LLMService`.
#[derive(Clone, Debug)]
pub struct Children {
    /// Identity of the gateway pods; `None` when attached to an endpoint.
    pub gateway_service_account: Option<ServiceAccount>,
    /// EndpointSlice read access for the gateway (its own, or the endpoint's when attached).
    pub gateway_role: Role,
    /// Binds the Role to the gateway's ServiceAccount (the endpoint's when attached).
    pub gateway_role_binding: RoleBinding,
    /// NodeLocalPVC or SharedPVC cache claim (create-once).
    pub cache_claim: Option<PersistentVolumeClaim>,
    /// Prewarm Job (create-once).
    pub prewarm_job: Option<Job>,
    /// The hub adapters' fetch Jobs (create-once), sorted by name.
    pub adapter_fetch_jobs: Vec<Job>,
    /// Backend Service, watched by the gateway through its EndpointSlices.
    pub backend_service: Service,
    /// Backend Deployment; `spec.replicas` is set only for creation (see [`render`]).
    pub backend: Deployment,
    /// Client-facing gateway Service; `None` when attached.
    pub gateway_service: Option<Service>,
    /// ExternalScaler Service (push mode only; `None` when attached).
    pub scaler_service: Option<Service>,
    /// The gateway's admin Service `N-gateway-admin` (headless); `None` when attached.
    pub admin_service: Option<Service>,
    /// Gateway Deployment; `None` when attached.
    pub gateway: Option<Deployment>,
    /// Keeps all but one gateway replica up through voluntary disruptions (node drains);
    /// `None` when attached.
    pub gateway_pdb: Option<PodDisruptionBudget>,
    /// KEDA ScaledObject.
    pub scaled_object: DynamicObject,
    /// KEDA TriggerAuthentication `N-scaler`: the ExternalScaler's mutual TLS (push mode, own
    /// gateway, [`RenderConfig::scaler_tls`]); written with its Secrets by
    /// `crate::scaler_tls`, not by the plan.
    pub trigger_authentication: Option<DynamicObject>,
    /// ConfigMap `N-adapters`: the adapters the service's own gateway routes and loads; `None`
    /// without adapters, or when attached (the endpoint's route table carries them).
    pub adapters_config_map: Option<ConfigMap>,
    /// NetworkPolicy `N-gateway` on the service's own gateway pods ([`network`]); `None` when
    /// attached or without [`RenderConfig::network_policies`].
    pub gateway_network_policy: Option<NetworkPolicy>,
    /// NetworkPolicy `N-backend` on the backend pods ([`network`]); `None` without
    /// [`RenderConfig::network_policies`].
    pub backend_network_policy: Option<NetworkPolicy>,
}

impl Children {
    /// All children as JSON, in apply order (dependencies first).
    pub fn to_values(&self) -> Result<Vec<serde_json::Value>, serde_json::Error> {
        fn v<T: Serialize>(t: &T) -> Result<serde_json::Value, serde_json::Error> {
            serde_json::to_value(t)
        }
        let mut out = Vec::new();
        if let Some(sa) = &self.gateway_service_account {
            out.push(v(sa)?);
        }
        out.push(v(&self.gateway_role)?);
        out.push(v(&self.gateway_role_binding)?);
        if let Some(c) = &self.cache_claim {
            out.push(v(c)?);
        }
        if let Some(j) = &self.prewarm_job {
            out.push(v(j)?);
        }
        for j in &self.adapter_fetch_jobs {
            out.push(v(j)?);
        }
        if let Some(c) = &self.adapters_config_map {
            out.push(v(c)?);
        }
        if let Some(p) = &self.backend_network_policy {
            out.push(v(p)?);
        }
        out.push(v(&self.backend_service)?);
        out.push(v(&self.backend)?);
        if let Some(p) = &self.gateway_network_policy {
            out.push(v(p)?);
        }
        if let Some(s) = &self.gateway_service {
            out.push(v(s)?);
        }
        if let Some(s) = &self.admin_service {
            out.push(v(s)?);
        }
        if let Some(s) = &self.scaler_service {
            out.push(v(s)?);
        }
        if let Some(g) = &self.gateway {
            out.push(v(g)?);
        }
        if let Some(p) = &self.gateway_pdb {
            out.push(v(p)?);
        }
        if let Some(t) = &self.trigger_authentication {
            out.push(v(t)?);
        }
        out.push(v(&self.scaled_object)?);
        Ok(out)
    }

    /// All children as a multi-document YAML stream, like `helm template`.
    pub fn to_yaml(&self) -> Result<String, RenderError> {
        let mut out = String::new();
        for value in self
            .to_values()
            .map_err(|e| RenderError::Serialize(e.to_string()))?
        {
            out.push_str("---\n");
            out.push_str(
                &serde_yaml::to_string(&value)
                    .map_err(|e| RenderError::Serialize(e.to_string()))?,
            );
        }
        Ok(out)
    }
}

/// Why an `LLMService` could not be rendered. Each names the field and the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RenderError {
    /// The service breaks the rules it is rendered by (`hearth_crds::rules`, shared with the
    /// admission webhook); only errors, each naming the field and the fix.
    #[error("{0}")]
    Rules(Findings),
    /// A bad or unsupported model source.
    #[error(transparent)]
    Model(#[from] model::ModelError),
    /// A runtime template did not render.
    #[error("InferenceRuntime {runtime}: {source}")]
    Template {
        /// The runtime name.
        runtime: String,
        /// The template error (names the field).
        source: template::TemplateError,
    },
    /// A duration field did not parse.
    #[error("{field}: {source}")]
    Duration {
        /// The field path.
        field: &'static str,
        /// The parse error.
        source: hearth_crds::DurationError,
    },
    /// A cache strategy reserved in the API but not implemented.
    #[error(
        "spec.cache.strategy: {0:?} is not implemented yet; use NodeLocalPVC, SharedPVC, HostPath or None"
    )]
    CacheNotImplemented(CacheStrategy),
    /// The object has no namespace (rendering needs one; `render` defaults it to `default`).
    #[error("metadata.namespace is required")]
    NoNamespace,
    /// The policy step failed.
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
    /// Serialization of a rendered object failed.
    #[error("serializing rendered objects: {0}")]
    Serialize(String),
}

impl RenderError {
    /// The condition this error is reported under and its reason: cache problems under
    /// `CacheReady`, everything else under `Ready`.
    pub fn condition(&self) -> (&'static str, &'static str) {
        match self {
            RenderError::Rules(findings) => findings
                .first_error()
                .map(|f| (f.reason.condition_type(), f.reason.as_str()))
                .unwrap_or(("Ready", "InvalidSpec")),
            RenderError::CacheNotImplemented(_) => ("CacheReady", "StrategyNotImplemented"),
            RenderError::Model(model::ModelError::CatalogNotImplemented) => {
                ("Ready", "CatalogNotImplemented")
            }
            RenderError::Model(_) => ("Ready", "InvalidModelSource"),
            RenderError::Template { .. } => ("Ready", "InvalidRuntimeTemplate"),
            RenderError::Policy(_) => ("Ready", "PolicyFailed"),
            _ => ("Ready", "InvalidSpec"),
        }
    }
}

/// Inputs shared by the child renderers.
struct Ctx<'a> {
    svc: &'a LLMService,
    rt: &'a InferenceRuntime,
    cfg: &'a RenderConfig,
    name: String,
    namespace: String,
    owner: Option<OwnerReference>,
    source: ModelSource,
    scaler: ScalerMode,
    placement: &'a Placement,
    /// The service's accepted adapters and their fetch Jobs.
    adapters: &'a ServiceAdapters,
}

impl<'a> Ctx<'a> {
    /// The sleeping tier this service runs, if any (`hearth_crds::rules::sleep_tier`: a tier
    /// with no effect is a warning there, and renders nothing here).
    fn sleep_tier(&self) -> Option<hearth_crds::rules::SleepTier<'a>> {
        hearth_crds::rules::sleep_tier(self.svc, Some(self.rt))
            .ok()
            .flatten()
    }

    /// Whether the gateway replicas sum their demand over each other (`--peer-service`): in
    /// push mode, where each replica serves KEDA the total, with the sleeping tier, which
    /// puts engines to sleep only when no replica has demand, and with more than one replica
    /// when KEDA cannot sum over them itself (before 2.19: its poll asks one replica).
    fn gateway_peers(&self) -> bool {
        let replicas = self.svc.spec.endpoint.replicas.unwrap_or(1);
        self.scaler == ScalerMode::Push
            || self.sleep_tier().is_some()
            || (replicas > 1 && !self.cfg.keda_version.aggregates_endpoints())
    }
}

impl Ctx<'_> {
    /// A Service `name` in front of `component`'s pods of this LLMService: one TCP `port`
    /// forwarding to the pods' port named `port_name`.
    fn service(&self, name: String, component: Component, port_name: &str, port: i32) -> Service {
        Service {
            metadata: self.meta(name, component),
            spec: Some(ServiceSpec {
                selector: Some(labels::selector(&self.name, component)),
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

    fn meta(&self, name: String, component: Component) -> ObjectMeta {
        ObjectMeta {
            name: Some(name),
            namespace: Some(self.namespace.clone()),
            labels: Some(labels::labels(&self.name, component)),
            owner_references: self.owner.clone().map(|o| vec![o]),
            ..Default::default()
        }
    }

    fn pull_secrets(&self) -> Option<Vec<k8s_openapi::api::core::v1::LocalObjectReference>> {
        let s = &self.svc.spec.image_pull_secrets;
        (!s.is_empty()).then(|| s.clone())
    }

    fn secret_env(&self) -> Option<Vec<EnvFromSource>> {
        let secret = self.svc.spec.model.source.as_ref()?.secret_ref.as_ref()?;
        Some(vec![EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: secret.name.clone(),
                optional: None,
            }),
            ..Default::default()
        }])
    }
}

/// Renders every child. `create_backend` says whether the backend Deployment is being created:
/// only then is `spec.replicas` set (to `scaling.min`, so `min: 0` starts no pod); afterwards it
/// is left out so KEDA (or a user) owns it. The service's own gateway ([`Placement::Own`]); see
/// [`render_placed`].
pub fn render(
    service: &LLMService,
    runtime: &InferenceRuntime,
    cfg: &RenderConfig,
    create_backend: bool,
) -> Result<Children, RenderError> {
    render_placed(service, runtime, cfg, create_backend, &Placement::Own)
}

/// [`render`] with the service's gateway where `placement` says: its own, or an endpoint's
/// shared gateway (then no gateway Deployment, Services, ServiceAccount or
/// PodDisruptionBudget of its own).
pub fn render_placed(
    service: &LLMService,
    runtime: &InferenceRuntime,
    cfg: &RenderConfig,
    create_backend: bool,
    placement: &Placement,
) -> Result<Children, RenderError> {
    render_with_adapters(
        service,
        runtime,
        cfg,
        create_backend,
        placement,
        &ServiceAdapters::default(),
    )
}

/// [`render_placed`] with the service's accepted `adapters`: the engine's adapter flags,
/// environment and volumes, the hub adapters' fetch Jobs, and the gateway's adapter table (see
/// [`adapters`]).
pub fn render_with_adapters(
    service: &LLMService,
    runtime: &InferenceRuntime,
    cfg: &RenderConfig,
    create_backend: bool,
    placement: &Placement,
    adapters: &ServiceAdapters,
) -> Result<Children, RenderError> {
    // The rules the admission webhook applies too: nothing is rendered while one is broken.
    let mut findings = rules::check_llmservice(service, Some(runtime));
    if findings.blocks_rendering() {
        findings.0.retain(rules::Finding::is_error);
        return Err(RenderError::Rules(findings));
    }
    let name = service.name_any();
    let namespace = service.namespace().ok_or(RenderError::NoNamespace)?;
    let scaler = rules::scaler_mode(service).map_err(|f| RenderError::Rules(Findings(vec![f])))?;
    let ctx = Ctx {
        svc: service,
        rt: runtime,
        cfg,
        name,
        namespace,
        owner: service.controller_owner_ref(&()),
        source: model::parse_source(&service.spec.model)?,
        scaler,
        placement,
        adapters,
    };
    let volume = ctx.cache_volume()?;
    let rendered_adapters = ctx.adapters();

    let mut skeleton = backend_skeleton(
        &ctx,
        volume.clone(),
        rendered_adapters.as_ref(),
        create_backend,
    )?;
    set_backend_security(&mut skeleton, runtime);
    let backend = policy::apply(
        &cfg.engine,
        skeleton,
        service,
        runtime,
        &cfg.policy_settings(),
    )?;
    let backend = crate::upgrade::mark(backend, cfg.drain_image.as_deref());
    // The service's own gateway follows the adapter table whenever its runtime serves
    // adapters (a missing ConfigMap is an empty table), so adding the first adapter or removing
    // the last does not roll the gateway.
    let follows_adapters = runtime.spec.adapters.is_some();
    let own = match placement {
        Placement::Own => Some(own_gateway(&ctx, follows_adapters)?),
        Placement::Shared(_) => None,
    };
    let adapters_config_map = match (placement, &rendered_adapters) {
        (Placement::Own, Some(a)) => Some(ctx.adapters_config_map(&a.table)?),
        _ => None,
    };
    let role_binding = match placement {
        Placement::Own => gateway_role_binding(&ctx, names::gateway(&ctx.name), &ctx.namespace),
        Placement::Shared(shared) => {
            gateway_role_binding(&ctx, names::gateway(&shared.endpoint), &shared.namespace)
        }
    };
    Ok(Children {
        gateway_service_account: own.as_ref().map(gateway_service_account),
        gateway_role: gateway_role(
            &ctx,
            follows_adapters && matches!(placement, Placement::Own),
        ),
        gateway_role_binding: role_binding,
        cache_claim: cache_claim(&ctx),
        adapter_fetch_jobs: ctx.adapter_fetch_jobs(volume.as_ref()),
        prewarm_job: prewarm_job(&ctx, volume),
        backend_service: backend_service(&ctx),
        backend,
        gateway_service: own.as_ref().map(gateway_service),
        admin_service: own.as_ref().map(|g| admin_service(g, cfg)),
        scaler_service: own
            .as_ref()
            .filter(|g| g.scaler == ScalerMode::Push)
            .map(|g| scaler_service(g, cfg)),
        gateway: own
            .as_ref()
            .map(|g| gateway_deployment(g, cfg))
            .transpose()?,
        gateway_pdb: own.as_ref().map(gateway_pdb),
        gateway_network_policy: own.as_ref().and_then(|g| gateway_network_policy(g, cfg)),
        backend_network_policy: backend_network_policy(&ctx),
        scaled_object: scaled_object(&ctx)?,
        trigger_authentication: (matches!(placement, Placement::Own)
            && scaler == ScalerMode::Push
            && cfg.scaler_tls)
            .then(|| keda::trigger_authentication(&ctx)),
        adapters_config_map,
    })
}

fn duration_secs(d: &hearth_crds::Duration, field: &'static str) -> Result<u64, RenderError> {
    let v = d
        .get()
        .map_err(|source| RenderError::Duration { field, source })?;
    Ok(v.as_secs() + u64::from(v.subsec_nanos() > 0))
}

//! Rendering: one `LLMService` plus its resolved `InferenceRuntime` → the children, as plain
//! objects, with no cluster access (so `hearth-controller render` and golden tests see exactly
//! what the reconciler applies).
//!
//! The backend is built in two steps: [`backend_skeleton`] makes a plain Deployment (image,
//! rendered args/env templates, ports, cache mounts, cpu/memory), then [`crate::policy::apply`]
//! lays the runtime specifics on it.

use std::collections::BTreeMap;

use hearth_crds::{
    InferenceRuntime, LLMService,
    llmservice::{CacheStrategy, ColdStartMode},
    quantity::{compare_quantities, is_quantity},
    rules::{self, Findings},
};
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec, DeploymentStrategy, RollingUpdateDeployment},
        batch::v1::{Job, JobSpec},
        core::v1::{
            Capabilities, Container, ContainerPort, EnvFromSource, EnvVar, EnvVarSource,
            HTTPGetAction, HostPathVolumeSource, KeyToPath, Lifecycle, LifecycleHandler,
            ObjectFieldSelector, PersistentVolumeClaim, PersistentVolumeClaimSpec,
            PersistentVolumeClaimVolumeSource, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
            ResourceRequirements, SeccompProfile, SecretEnvSource, SecretVolumeSource,
            SecurityContext, Service, ServiceAccount, ServicePort, ServiceSpec, SleepAction,
            TopologySpreadConstraint, Volume, VolumeMount, VolumeResourceRequirements,
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
use kube::{
    Resource, ResourceExt,
    api::{ApiResource, DynamicObject},
};
use serde::Serialize;
use serde_json::json;

use crate::{
    labels::{self, Component},
    model::{self, CACHE_MOUNT_PATH, HF_HOME, MODELSCOPE_CACHE, ModelSource},
    names, policy,
    template::{self, TemplateValues},
};

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
        })
    }
}

impl RenderConfig {
    /// What the backend's policies see as `settings`.
    pub fn policy_settings(&self) -> hearth_policies::PolicySettings {
        hearth_policies::PolicySettings {
            drain_image: self.drain_image.clone(),
        }
    }
}

/// The default gateway image: Hearth's registry, tagged with this controller's version.
pub fn default_gateway_image() -> String {
    format!(
        "ghcr.io/hearth-rs/hearth-gateway:v{}",
        env!("CARGO_PKG_VERSION")
    )
}

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

/// How KEDA learns the gateway's demand (`serving.hearth.dev/scaler` annotation).
pub use hearth_crds::rules::ScalerMode;

/// The KEDA `ScaledObject` API (keda.sh/v1alpha1), the default of [`RenderConfig::keda_api`].
pub fn scaled_object_resource() -> ApiResource {
    ApiResource {
        group: "keda.sh".to_owned(),
        version: "v1alpha1".to_owned(),
        api_version: "keda.sh/v1alpha1".to_owned(),
        kind: "ScaledObject".to_owned(),
        plural: "scaledobjects".to_owned(),
    }
}

/// Every child of one `LLMService`.
#[derive(Clone, Debug)]
pub struct Children {
    /// Identity of the gateway pods.
    pub gateway_service_account: ServiceAccount,
    /// EndpointSlice read access for the gateway.
    pub gateway_role: Role,
    /// Binds the Role to the ServiceAccount.
    pub gateway_role_binding: RoleBinding,
    /// NodeLocalPVC cache claim (create-once).
    pub cache_claim: Option<PersistentVolumeClaim>,
    /// Prewarm Job (create-once).
    pub prewarm_job: Option<Job>,
    /// Backend Service, watched by the gateway through its EndpointSlices.
    pub backend_service: Service,
    /// Backend Deployment; `spec.replicas` is set only for creation (see [`render`]).
    pub backend: Deployment,
    /// Client-facing gateway Service.
    pub gateway_service: Service,
    /// ExternalScaler Service (push mode only).
    pub scaler_service: Option<Service>,
    /// Gateway Deployment.
    pub gateway: Deployment,
    /// Keeps all but one gateway replica up through voluntary disruptions (node drains).
    pub gateway_pdb: PodDisruptionBudget,
    /// KEDA ScaledObject.
    pub scaled_object: DynamicObject,
}

impl Children {
    /// All children as JSON, in apply order (dependencies first).
    pub fn to_values(&self) -> Result<Vec<serde_json::Value>, serde_json::Error> {
        fn v<T: Serialize>(t: &T) -> Result<serde_json::Value, serde_json::Error> {
            serde_json::to_value(t)
        }
        let mut out = vec![
            v(&self.gateway_service_account)?,
            v(&self.gateway_role)?,
            v(&self.gateway_role_binding)?,
        ];
        if let Some(c) = &self.cache_claim {
            out.push(v(c)?);
        }
        if let Some(j) = &self.prewarm_job {
            out.push(v(j)?);
        }
        out.push(v(&self.backend_service)?);
        out.push(v(&self.backend)?);
        out.push(v(&self.gateway_service)?);
        if let Some(s) = &self.scaler_service {
            out.push(v(s)?);
        }
        out.push(v(&self.gateway)?);
        out.push(v(&self.gateway_pdb)?);
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
        "spec.cache.strategy: {0:?} is not implemented yet; use NodeLocalPVC, HostPath or None"
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
}

impl Ctx<'_> {
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

    /// The cache volume and whether the prewarm/engine env should point into it.
    fn cache_volume(&self) -> Result<Option<Volume>, RenderError> {
        if let ModelSource::Pvc { claim, .. } = &self.source {
            return Ok(Some(Volume {
                name: "model".to_owned(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: claim.clone(),
                    read_only: Some(true),
                }),
                ..Default::default()
            }));
        }
        match self.svc.spec.cache.strategy {
            CacheStrategy::NodeLocalPVC => Ok(Some(Volume {
                name: "model-cache".to_owned(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: names::cache_claim(&self.name),
                    read_only: None,
                }),
                ..Default::default()
            })),
            CacheStrategy::HostPath => Ok(Some(Volume {
                name: "model-cache".to_owned(),
                host_path: Some(HostPathVolumeSource {
                    path: self.cfg.host_path_root.clone(),
                    type_: Some("DirectoryOrCreate".to_owned()),
                }),
                ..Default::default()
            })),
            CacheStrategy::None => Ok(None),
            other => Err(RenderError::CacheNotImplemented(other)),
        }
    }

    /// `.Model.Path` (see the table in [`crate::model`]).
    fn model_path(&self) -> String {
        match &self.source {
            ModelSource::HuggingFace { repo } | ModelSource::ModelScope { repo } => repo.clone(),
            ModelSource::Pvc { subpath: None, .. } => CACHE_MOUNT_PATH.to_owned(),
            ModelSource::Pvc {
                subpath: Some(subpath),
                ..
            } => format!("{CACHE_MOUNT_PATH}/{subpath}"),
        }
    }

    /// The hub environment shared by the engine and the prewarm Job.
    fn cache_env(&self, cached: bool) -> Vec<EnvVar> {
        let var = |name: &str, value: &str| EnvVar {
            name: name.to_owned(),
            value: Some(value.to_owned()),
            value_from: None,
        };
        match &self.source {
            ModelSource::HuggingFace { .. } if cached => vec![var("HF_HOME", HF_HOME)],
            ModelSource::ModelScope { .. } if cached => vec![
                var("VLLM_USE_MODELSCOPE", "True"),
                var("MODELSCOPE_CACHE", MODELSCOPE_CACHE),
            ],
            ModelSource::ModelScope { .. } => vec![var("VLLM_USE_MODELSCOPE", "True")],
            _ => Vec::new(),
        }
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
/// is left out so KEDA (or a user) owns it.
pub fn render(
    service: &LLMService,
    runtime: &InferenceRuntime,
    cfg: &RenderConfig,
    create_backend: bool,
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
    };
    let volume = ctx.cache_volume()?;

    let mut skeleton = backend_skeleton(&ctx, volume.clone(), create_backend)?;
    set_backend_security(&mut skeleton, runtime);
    let backend = policy::apply(
        &cfg.engine,
        skeleton,
        service,
        runtime,
        &cfg.policy_settings(),
    )?;
    let backend = crate::upgrade::mark(backend, cfg.drain_image.as_deref());
    Ok(Children {
        gateway_service_account: ServiceAccount {
            metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
            ..Default::default()
        },
        gateway_role: gateway_role(&ctx),
        gateway_role_binding: gateway_role_binding(&ctx),
        cache_claim: cache_claim(&ctx),
        prewarm_job: prewarm_job(&ctx, volume),
        backend_service: backend_service(&ctx),
        backend,
        gateway_service: gateway_service(&ctx),
        scaler_service: (ctx.scaler == ScalerMode::Push).then(|| scaler_service(&ctx)),
        gateway: gateway_extensions(&ctx, gateway_deployment(&ctx)?),
        gateway_pdb: gateway_pdb(&ctx),
        scaled_object: scaled_object(&ctx)?,
    })
}

fn duration_secs(d: &hearth_crds::Duration, field: &'static str) -> Result<u64, RenderError> {
    let v = d
        .get()
        .map_err(|source| RenderError::Duration { field, source })?;
    Ok(v.as_secs() + u64::from(v.subsec_nanos() > 0))
}

/// The serving container's name: the runtime family (`vllm`), which is how the built-in
/// policies find the model container.
pub fn serving_container(runtime: &InferenceRuntime) -> String {
    match serde_json::to_value(runtime.spec.family) {
        Ok(serde_json::Value::String(s)) => s,
        _ => "server".to_owned(),
    }
}

/// The plain backend Deployment before the policy step.
fn backend_skeleton(
    ctx: &Ctx<'_>,
    volume: Option<Volume>,
    create: bool,
) -> Result<Deployment, RenderError> {
    let rt = &ctx.rt.spec;
    let runtime_name = ctx.rt.name_any();
    let model_path = ctx.model_path();
    let values = TemplateValues {
        model_path: &model_path,
        service_name: &ctx.name,
        service_namespace: &ctx.namespace,
    };
    let terr = |source| RenderError::Template {
        runtime: runtime_name.clone(),
        source,
    };
    let mut args = rt
        .container
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| template::render(a, &values, &format!("spec.container.args[{i}]")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(terr)?;
    // argsOverride entries are templates too, rendered with the same values (as upstream).
    for (i, a) in ctx.svc.spec.runtime.args_override.iter().enumerate() {
        args.push(
            template::render(a, &values, &format!("spec.runtime.argsOverride[{i}]")).map_err(
                |source| RenderError::Template {
                    runtime: runtime_name.clone(),
                    source,
                },
            )?,
        );
    }

    let cached = volume.is_some() && !matches!(ctx.source, ModelSource::Pvc { .. });
    let mut env = Vec::with_capacity(rt.container.env.len() + 2);
    for (i, e) in rt.container.env.iter().enumerate() {
        let mut e = e.clone();
        if let Some(v) = &e.value {
            e.value = Some(
                template::render(v, &values, &format!("spec.container.env[{i}].value"))
                    .map_err(terr)?,
            );
        }
        env.push(e);
    }
    for e in ctx.cache_env(cached) {
        if !env.iter().any(|x| x.name == e.name) {
            env.push(e);
        }
    }

    let mut requests = BTreeMap::new();
    let mut limits = BTreeMap::new();
    if let Some(cpu) = &ctx.svc.spec.resources.cpu {
        requests.insert("cpu".to_owned(), cpu.clone());
    }
    if let Some(mem) = &ctx.svc.spec.resources.memory {
        // Memory is request and limit: an engine over its request is the first OOM victim.
        requests.insert("memory".to_owned(), mem.clone());
        limits.insert("memory".to_owned(), mem.clone());
    }
    let mount = volume.as_ref().map(|v| VolumeMount {
        name: v.name.clone(),
        mount_path: CACHE_MOUNT_PATH.to_owned(),
        read_only: matches!(ctx.source, ModelSource::Pvc { .. }).then_some(true),
        ..Default::default()
    });

    let container = Container {
        name: serving_container(ctx.rt),
        image: Some(rt.container.image.clone()),
        args: (!args.is_empty()).then_some(args),
        env: (!env.is_empty()).then_some(env),
        env_from: ctx.secret_env(),
        ports: Some(vec![ContainerPort {
            name: Some(rt.container.port.name.clone()),
            container_port: rt.container.port.container_port,
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        }]),
        resources: Some(ResourceRequirements {
            requests: (!requests.is_empty()).then_some(requests),
            limits: (!limits.is_empty()).then_some(limits),
            ..Default::default()
        }),
        volume_mounts: mount.map(|m| vec![m]),
        ..Default::default()
    };
    let selector = labels::selector(&ctx.name, Component::Backend);
    Ok(Deployment {
        metadata: ctx.meta(names::backend(&ctx.name), Component::Backend),
        spec: Some(DeploymentSpec {
            replicas: create.then_some(ctx.svc.spec.scaling.min),
            selector: LabelSelector {
                match_labels: Some(selector),
                ..Default::default()
            },
            // A template change replaces each pod in place (old one first): a surge pod would
            // need a second set of accelerators, which a cluster sized for the model lacks, so
            // the rollout would wait forever. The gateway holds requests meanwhile.
            strategy: Some(DeploymentStrategy {
                type_: Some("RollingUpdate".to_owned()),
                rolling_update: Some(RollingUpdateDeployment {
                    max_surge: Some(IntOrString::Int(0)),
                    max_unavailable: Some(IntOrString::Int(1)),
                }),
            }),
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels::labels(&ctx.name, Component::Backend)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    containers: vec![container],
                    volumes: volume.map(|v| vec![v]),
                    image_pull_secrets: ctx.pull_secrets(),
                    enable_service_links: Some(false),
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    })
}

/// The backend Service's port (upstream Hearth's); it targets the runtime's named port.
pub const BACKEND_SERVICE_PORT: i32 = 80;

fn backend_service(ctx: &Ctx<'_>) -> Service {
    let port = &ctx.rt.spec.container.port;
    Service {
        metadata: ctx.meta(names::backend_service(&ctx.name), Component::Backend),
        spec: Some(ServiceSpec {
            selector: Some(labels::selector(&ctx.name, Component::Backend)),
            ports: Some(vec![ServicePort {
                name: Some(port.name.clone()),
                // Port 80 as upstream Hearth (clients of http://N-backend keep working); the
                // gateway reads the pods' own port from the EndpointSlices.
                port: BACKEND_SERVICE_PORT,
                target_port: Some(IntOrString::String(port.name.clone())),
                protocol: Some("TCP".to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn gateway_service(ctx: &Ctx<'_>) -> Service {
    Service {
        metadata: ctx.meta(names::gateway_service(&ctx.name), Component::Gateway),
        spec: Some(ServiceSpec {
            selector: Some(labels::selector(&ctx.name, Component::Gateway)),
            ports: Some(vec![ServicePort {
                name: Some("http".to_owned()),
                port: 80,
                target_port: Some(IntOrString::String("http".to_owned())),
                protocol: Some("TCP".to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn scaler_service(ctx: &Ctx<'_>) -> Service {
    Service {
        metadata: ctx.meta(names::scaler_service(&ctx.name), Component::Gateway),
        spec: Some(ServiceSpec {
            type_: Some("ClusterIP".to_owned()),
            selector: Some(labels::selector(&ctx.name, Component::Gateway)),
            ports: Some(vec![ServicePort {
                name: Some("grpc-scaler".to_owned()),
                port: ctx.cfg.scaler_port,
                target_port: Some(IntOrString::String("grpc-scaler".to_owned())),
                protocol: Some("TCP".to_owned()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn gateway_role(ctx: &Ctx<'_>) -> Role {
    Role {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        rules: Some(vec![PolicyRule {
            api_groups: Some(vec!["discovery.k8s.io".to_owned()]),
            resources: Some(vec!["endpointslices".to_owned()]),
            verbs: vec!["get".to_owned(), "list".to_owned(), "watch".to_owned()],
            ..Default::default()
        }]),
    }
}

fn gateway_role_binding(ctx: &Ctx<'_>) -> RoleBinding {
    RoleBinding {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        role_ref: RoleRef {
            api_group: "rbac.authorization.k8s.io".to_owned(),
            kind: "Role".to_owned(),
            name: names::gateway(&ctx.name),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".to_owned(),
            name: names::gateway(&ctx.name),
            namespace: Some(ctx.namespace.clone()),
            ..Default::default()
        }]),
    }
}

/// The gateway queue bound: enough for every replica at its target, ten times over, and never
/// below 100 (the API has no field for it yet).
pub fn max_queue(service: &LLMService) -> i64 {
    let s = &service.spec.scaling;
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

fn gateway_deployment(ctx: &Ctx<'_>) -> Result<Deployment, RenderError> {
    let s = &ctx.svc.spec.scaling;
    let cold = &ctx.svc.spec.endpoint.cold_start;
    let drain = duration_secs(&s.drain_timeout, "spec.scaling.drainTimeout")?;
    duration_secs(&s.activation_timeout, "spec.scaling.activationTimeout")?;
    duration_secs(
        &cold.heartbeat_interval,
        "spec.endpoint.coldStart.heartbeatInterval",
    )?;
    let backend_port = &ctx.rt.spec.container.port;
    // Flags of `hearth-gateway` (docs/gateway.md); the namespace comes from POD_NAMESPACE.
    let mut args = vec![
        format!("--listen=[::]:{}", ctx.cfg.gateway_port),
        format!("--backend-service={}", names::backend_service(&ctx.name)),
        format!("--backend-port={BACKEND_SERVICE_PORT}"),
        format!("--backend-port-name={}", backend_port.name),
        // The runtime templates serve the model under the service name.
        format!("--served-model-name={}", ctx.name),
        format!("--max-queue={}", max_queue(ctx.svc)),
        format!(
            "--cold-start={}",
            match cold.mode {
                ColdStartMode::Keepalive => "keepalive",
                ColdStartMode::Reject => "reject",
            }
        ),
        format!("--heartbeat-interval={}", cold.heartbeat_interval),
        format!("--activation-timeout={}", s.activation_timeout),
        format!("--drain-timeout={}", s.drain_timeout),
        format!("--metric-target={}", s.target),
    ];
    let mut ports = vec![ContainerPort {
        name: Some("http".to_owned()),
        container_port: ctx.cfg.gateway_port,
        protocol: Some("TCP".to_owned()),
        ..Default::default()
    }];
    if ctx.scaler == ScalerMode::Push {
        args.push(format!("--scaler-listen=[::]:{}", ctx.cfg.scaler_port));
        args.push(format!(
            "--peer-service={}",
            names::gateway_service(&ctx.name)
        ));
        ports.push(ContainerPort {
            name: Some("grpc-scaler".to_owned()),
            container_port: ctx.cfg.scaler_port,
            protocol: Some("TCP".to_owned()),
            ..Default::default()
        });
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
        image: Some(ctx.cfg.gateway_image.clone()),
        args: Some(args),
        env: Some(vec![
            field_env("POD_NAME", "metadata.name"),
            field_env("POD_NAMESPACE", "metadata.namespace"),
            field_env("POD_IPS", "status.podIPs"),
        ]),
        ports: Some(ports),
        readiness_probe: Some(http_probe("/readyz", 5)),
        liveness_probe: Some(http_probe("/healthz", 10)),
        resources: Some(ctx.cfg.gateway_resources.clone()),
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
    Ok(Deployment {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        spec: Some(DeploymentSpec {
            replicas: Some(1),
            selector: LabelSelector {
                match_labels: Some(labels::selector(&ctx.name, Component::Gateway)),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels::labels(&ctx.name, Component::Gateway)),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    service_account_name: Some(names::gateway(&ctx.name)),
                    containers: vec![container],
                    image_pull_secrets: ctx.pull_secrets(),
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
    })
}

/// Gateway replicas: `spec.endpoint.replicas`, default 1.
pub fn gateway_replicas(service: &LLMService) -> i32 {
    service.spec.endpoint.replicas.unwrap_or(1).max(1)
}

/// UID and GID the gateway runs as: the image's `USER 65532:65532` (distroless "nonroot"),
/// stated in the pod so `runAsNonRoot` can be checked without reading the image.
pub const GATEWAY_UID: i64 = 65532;

/// Directory the API key Secret is mounted at, and the file (the Secret key's projection) the
/// gateway reads with `--api-key-file`.
pub const API_KEY_DIR: &str = "/etc/hearth/api-keys";
/// File name of the API keys under [`API_KEY_DIR`].
pub const API_KEY_FILE: &str = "keys";

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

/// What the gateway Deployment gets beyond its flags: `spec.endpoint.replicas` spread over
/// nodes, the restricted security context, the push-mode peer port name, and the API key
/// Secret (`spec.endpoint.apiKeySecretRef`) mounted as a file for `--api-key-file`.
///
/// The Secret is a volume, never `subPath` (the kubelet does not update those) and never env:
/// editing the Secret rotates the keys in every replica without a restart (the kubelet swaps
/// the file, the gateway re-reads it). The volume is not optional, so a missing Secret or key
/// keeps the pods in `ContainerCreating` with a `FailedMount` event naming it, rather than
/// starting a gateway without authentication.
fn gateway_extensions(ctx: &Ctx<'_>, mut d: Deployment) -> Deployment {
    let replicas = gateway_replicas(ctx.svc);
    let Some(spec) = d.spec.as_mut() else {
        return d;
    };
    spec.replicas = Some(replicas);
    let Some(pod) = spec.template.spec.as_mut() else {
        return d;
    };
    pod.topology_spread_constraints = Some(vec![TopologySpreadConstraint {
        max_skew: 1,
        topology_key: "kubernetes.io/hostname".to_owned(),
        when_unsatisfiable: "ScheduleAnyway".to_owned(),
        label_selector: Some(LabelSelector {
            match_labels: Some(labels::selector(&ctx.name, Component::Gateway)),
            ..Default::default()
        }),
        // Only the pods of the same rollout count, so a rollout does not skew the spread.
        match_label_keys: Some(vec!["pod-template-hash".to_owned()]),
        ..Default::default()
    }]);
    gateway_security(pod);
    let key_ref = ctx.svc.spec.endpoint.api_key_secret_ref.as_ref();
    if let Some(r) = key_ref {
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
    if let Some(c) = pod.containers.first_mut() {
        let args = c.args.get_or_insert_with(Vec::new);
        if ctx.scaler == ScalerMode::Push {
            args.push("--peer-port-name=http".to_owned());
        }
        if key_ref.is_some() {
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
fn gateway_pdb(ctx: &Ctx<'_>) -> PodDisruptionBudget {
    PodDisruptionBudget {
        metadata: ctx.meta(names::gateway(&ctx.name), Component::Gateway),
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some(labels::selector(&ctx.name, Component::Gateway)),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The serving container's default security context: as much of Pod Security `restricted` as
/// upstream engine images allow. No privilege escalation, every capability dropped, the
/// RuntimeDefault seccomp profile; not `runAsNonRoot` (vLLM's images run as root) and not a
/// read-only root filesystem (vLLM, torch and triton write caches under the home directory and
/// `/tmp`). Devices come from the device plugin, which needs no capability.
pub fn default_backend_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".to_owned()]),
            add: None,
        }),
        seccomp_profile: Some(SeccompProfile {
            type_: "RuntimeDefault".to_owned(),
            localhost_profile: None,
        }),
        ..Default::default()
    }
}

/// Sets the serving container's security context: the runtime's
/// `spec.container.securityContext` when it has one (it replaces the default whole), else
/// [`default_backend_security_context`].
fn set_backend_security(backend: &mut Deployment, runtime: &InferenceRuntime) {
    let sc = runtime
        .spec
        .container
        .security_context
        .clone()
        .unwrap_or_else(default_backend_security_context);
    let name = serving_container(runtime);
    if let Some(c) = backend
        .spec
        .as_mut()
        .and_then(|s| s.template.spec.as_mut())
        .and_then(|p| p.containers.iter_mut().find(|c| c.name == name))
    {
        c.security_context = Some(sc);
    }
}

/// FNV-1a over the JSON of the immutable part: stable across builds (unlike `std`'s hasher).
fn stable_hash(value: &impl Serialize) -> String {
    let bytes = serde_json::to_vec(value).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

fn with_hash(mut meta: ObjectMeta, hash: String) -> ObjectMeta {
    meta.annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(TEMPLATE_HASH_ANNOTATION.to_owned(), hash);
    meta
}

fn cache_claim(ctx: &Ctx<'_>) -> Option<PersistentVolumeClaim> {
    let cache = &ctx.svc.spec.cache;
    if cache.strategy != CacheStrategy::NodeLocalPVC
        || matches!(ctx.source, ModelSource::Pvc { .. })
    {
        return None;
    }
    let size = rules::cache_claim_size(cache);
    let spec = PersistentVolumeClaimSpec {
        access_modes: Some(vec!["ReadWriteOnce".to_owned()]),
        resources: Some(VolumeResourceRequirements {
            requests: Some(BTreeMap::from([("storage".to_owned(), size)])),
            ..Default::default()
        }),
        storage_class_name: cache.storage_class_name.clone(),
        ..Default::default()
    };
    // Only the storage class is immutable; size may grow (volume expansion).
    let hash = stable_hash(&cache.storage_class_name);
    Some(PersistentVolumeClaim {
        metadata: with_hash(
            ctx.meta(names::cache_claim(&ctx.name), Component::Cache),
            hash,
        ),
        spec: Some(spec),
        ..Default::default()
    })
}

/// The download program run by the prewarm Job: the hub library vLLM itself uses, so the cache
/// layout is the one the engine reads.
fn prewarm_program(source: &ModelSource) -> Option<String> {
    match source {
        ModelSource::HuggingFace { repo } => Some(format!(
            "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id={repo:?}))\n"
        )),
        ModelSource::ModelScope { repo } => Some(format!(
            "from modelscope import snapshot_download\nprint(snapshot_download({repo:?}))\n"
        )),
        ModelSource::Pvc { .. } => None,
    }
}

/// The prewarm container's environment: the engine's hub cache variables, and
/// `TORCH_DEVICE_BACKEND_AUTOLOAD=0` (as upstream): the Job only downloads files and has no
/// device, and vendor images would otherwise load their device backend (and fail without the
/// host driver) when the hub library imports torch.
fn prewarm_env(ctx: &Ctx<'_>) -> Vec<EnvVar> {
    let mut env = ctx.cache_env(true);
    env.push(EnvVar {
        name: "TORCH_DEVICE_BACKEND_AUTOLOAD".to_owned(),
        value: Some("0".to_owned()),
        value_from: None,
    });
    env
}

fn prewarm_job(ctx: &Ctx<'_>, volume: Option<Volume>) -> Option<Job> {
    let cache = &ctx.svc.spec.cache;
    let volume = volume?;
    if !cache.prewarm
        || !matches!(
            cache.strategy,
            CacheStrategy::NodeLocalPVC | CacheStrategy::HostPath
        )
    {
        return None;
    }
    let program = prewarm_program(&ctx.source)?;
    let acc = &ctx.rt.spec.accelerator;
    let mut pod_meta = ObjectMeta {
        labels: Some(labels::labels(&ctx.name, Component::Prewarm)),
        ..Default::default()
    };
    if let Some(queue) = acc.scheduler.queue.as_deref().filter(|q| !q.is_empty()) {
        pod_meta.annotations = Some(BTreeMap::from([(
            hearth_crds::wellknown::VOLCANO_QUEUE_ANNOTATION.to_owned(),
            queue.to_owned(),
        )]));
    }
    let template = PodTemplateSpec {
        metadata: Some(pod_meta),
        spec: Some(PodSpec {
            restart_policy: Some("OnFailure".to_owned()),
            containers: vec![Container {
                name: "prewarm".to_owned(),
                image: Some(ctx.rt.spec.container.image.clone()),
                command: Some(vec!["python3".to_owned(), "-c".to_owned(), program]),
                env: Some(prewarm_env(ctx)),
                env_from: ctx.secret_env(),
                volume_mounts: Some(vec![VolumeMount {
                    name: volume.name.clone(),
                    mount_path: CACHE_MOUNT_PATH.to_owned(),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            volumes: Some(vec![volume]),
            node_selector: (!acc.node_selector.is_empty()).then(|| acc.node_selector.clone()),
            tolerations: (!acc.tolerations.is_empty()).then(|| acc.tolerations.clone()),
            scheduler_name: acc.scheduler.name.clone().filter(|n| !n.is_empty()),
            image_pull_secrets: ctx.pull_secrets(),
            enable_service_links: Some(false),
            ..Default::default()
        }),
    };
    let hash = stable_hash(&template);
    Some(Job {
        metadata: with_hash(
            ctx.meta(names::prewarm_job(&ctx.name), Component::Prewarm),
            hash,
        ),
        spec: Some(JobSpec {
            backoff_limit: Some(4),
            template,
            ..Default::default()
        }),
        ..Default::default()
    })
}

fn scaled_object(ctx: &Ctx<'_>) -> Result<DynamicObject, RenderError> {
    let s = &ctx.svc.spec.scaling;
    let stabilization = duration_secs(
        &s.scale_down_stabilization,
        "spec.scaling.scaleDownStabilization",
    )?;
    let activation = duration_secs(&s.activation_timeout, "spec.scaling.activationTimeout")?;
    let trigger = match ctx.scaler {
        // KEDA resolves `<service>.<namespace>` from the host and polls each endpoint on the
        // URL's port, which must therefore be the gateway's container port (KEDA >= 2.18).
        ScalerMode::Poll => json!({
            "type": "metrics-api",
            "metricType": "AverageValue",
            "metadata": {
                "url": format!(
                    "http://{}.{}.svc:{}/hearth/queue",
                    names::gateway_service(&ctx.name),
                    ctx.namespace,
                    ctx.cfg.gateway_port
                ),
                "format": "json",
                "valueLocation": "pending",
                "targetValue": s.target.to_string(),
                "aggregateFromKubeServiceEndpoints": "true",
                "aggregationType": "sum",
            }
        }),
        ScalerMode::Push => json!({
            "type": "external-push",
            "metricType": "AverageValue",
            "metadata": {
                "scalerAddress": format!(
                    "{}.{}.svc:{}",
                    names::scaler_service(&ctx.name),
                    ctx.namespace,
                    ctx.cfg.scaler_port
                ),
                // The gateway's ExternalScaler reads the per-replica target from `targetSize`.
                "targetSize": s.target.to_string(),
            }
        }),
    };
    let mut obj = DynamicObject::new(&names::scaled_object(&ctx.name), &ctx.cfg.keda_api);
    obj.metadata = ctx.meta(names::scaled_object(&ctx.name), Component::Autoscaler);
    obj.data = json!({
        "spec": {
            "scaleTargetRef": {
                "apiVersion": "apps/v1",
                "kind": "Deployment",
                "name": names::backend(&ctx.name),
            },
            "minReplicaCount": s.min,
            "maxReplicaCount": s.max,
            // Activation (0 -> 1) is decided by KEDA's own poll; keep cold starts short.
            "pollingInterval": 5,
            "cooldownPeriod": stabilization,
            // A fresh service is loading its model: do not scale it to zero before it could
            // have served (the activation timeout bounds a load).
            "initialCooldownPeriod": activation,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleDown": {"stabilizationWindowSeconds": stabilization}
                    }
                }
            },
            "triggers": [trigger],
        }
    });
    Ok(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gateway_resources_from_json_name_the_bad_field() {
        let r = parse_gateway_resources(
            r#"{"requests":{"cpu":"100m","memory":"128Mi"},"limits":{"memory":"1Gi"}}"#,
        )
        .unwrap();
        assert_eq!(r.limits.unwrap()["memory"], Quantity("1Gi".to_owned()));
        assert_eq!(
            parse_gateway_resources("{}").unwrap(),
            ResourceRequirements::default()
        );
        let e = parse_gateway_resources(r#"{"limits":{"memory":"512MB"}}"#).unwrap_err();
        assert!(
            e.starts_with("limits.memory: \"512MB\" is not a quantity"),
            "{e}"
        );
        let e = parse_gateway_resources(r#"{"limit":{"memory":"1Gi"}}"#).unwrap_err();
        assert!(e.contains("unknown field \"limit\""), "{e}");
        let e = parse_gateway_resources(r#"{"limits":"512Mi"}"#).unwrap_err();
        assert!(e.contains("not a ResourceRequirements"), "{e}");
        assert!(
            parse_gateway_resources("512Mi")
                .unwrap_err()
                .contains("not JSON")
        );
        assert!(parse_gateway_resources("[]").is_err());
        let e =
            parse_gateway_resources(r#"{"requests":{"memory":"1Gi"},"limits":{"memory":"512Mi"}}"#)
                .unwrap_err();
        assert!(
            e.starts_with("requests.memory (1Gi) is above limits.memory (512Mi)"),
            "{e}"
        );
        assert!(
            parse_gateway_resources(r#"{"requests":{"cpu":"1"},"limits":{"cpu":"1000m"}}"#).is_ok()
        );
        for (json, want) in [
            (
                r#"{"requests":{"memory":"-64Mi"}}"#,
                "requests.memory: \"-64Mi\" must not be negative",
            ),
            (
                r#"{"requests":{"foo":"1"}}"#,
                "requests.foo: the gateway takes cpu",
            ),
            (
                r#"{"limits":{"nvidia.com/gpu":"1"}}"#,
                "limits.nvidia.com/gpu: the gateway takes",
            ),
            (
                r#"{"limits":{"memory":"15Mi"}}"#,
                "limits.memory (15Mi) is below 16Mi",
            ),
            (
                r#"{"limits":{"memory":"1e99999999999999999999"}}"#,
                "is not a quantity",
            ),
        ] {
            let e = parse_gateway_resources(json).unwrap_err();
            assert!(e.contains(want), "{json}: {e}");
        }
        assert!(parse_gateway_resources(r#"{"limits":{"memory":"16Mi"}}"#).is_ok());
    }

    fn service_and_runtime(endpoint: serde_json::Value) -> (LLMService, InferenceRuntime) {
        let svc = serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1"},
            "spec": {
                "model": {"source": {"uri": "hf://org/model"}},
                "runtime": {"name": "rt"},
                "cache": {"strategy": "None"},
                "endpoint": endpoint,
            }
        }))
        .unwrap();
        let rt = serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "InferenceRuntime",
            "metadata": {"name": "rt"},
            "spec": {
                "vendor": "nvidia",
                "container": {"image": "example.com/vllm:1", "port": {"name": "http", "containerPort": 8000}},
                "accelerator": {"resourceName": "nvidia.com/gpu"},
            }
        }))
        .unwrap();
        (svc, rt)
    }

    fn pod(d: &Deployment) -> &PodSpec {
        d.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
    }

    #[test]
    fn api_keys_are_a_mounted_file_never_a_value() {
        let (svc, rt) = service_and_runtime(json!({
            "replicas": 3,
            "apiKeySecretRef": {"name": "keys"},
        }));
        let children = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
        let gw = &children.gateway;
        assert_eq!(gw.spec.as_ref().unwrap().replicas, Some(3));
        let p = pod(gw);
        let vol = p
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .find(|v| v.name == "api-keys")
            .unwrap();
        let secret = vol.secret.as_ref().unwrap();
        assert_eq!(secret.secret_name.as_deref(), Some("keys"));
        assert_eq!(
            secret.items.as_ref().unwrap()[0].key,
            "api-keys",
            "the default key"
        );
        assert_eq!(secret.optional, Some(false));
        let c = &p.containers[0];
        let mount = &c.volume_mounts.as_ref().unwrap()[0];
        assert!(mount.sub_path.is_none(), "subPath mounts are never updated");
        assert!(
            c.args
                .as_ref()
                .unwrap()
                .contains(&format!("--api-key-file={API_KEY_DIR}/{API_KEY_FILE}"))
        );
        assert!(c.env.iter().flatten().all(|e| {
            e.value_from
                .as_ref()
                .is_none_or(|v| v.secret_key_ref.is_none())
        }));
        assert!(c.env_from.is_none());
        let sc = c.security_context.as_ref().unwrap();
        assert_eq!(sc.read_only_root_filesystem, Some(true));
        assert_eq!(
            p.security_context.as_ref().unwrap().run_as_non_root,
            Some(true)
        );
        assert_eq!(
            children.gateway_pdb.spec.as_ref().unwrap().max_unavailable,
            Some(IntOrString::Int(1))
        );
        // No key reference, no volume and no flag.
        let (svc, rt) = service_and_runtime(json!({}));
        let children = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
        let p = pod(&children.gateway);
        assert!(p.volumes.is_none());
        assert!(
            !p.containers[0]
                .args
                .as_ref()
                .unwrap()
                .iter()
                .any(|a| a.starts_with("--api-key-file"))
        );
        assert_eq!(children.gateway.spec.as_ref().unwrap().replicas, Some(1));
    }

    #[test]
    fn the_runtime_security_context_replaces_the_backend_default() {
        let (svc, mut rt) = service_and_runtime(json!({}));
        let cfg = RenderConfig::builtin().unwrap();
        let backend = render(&svc, &rt, &cfg, true).unwrap().backend;
        let c = pod(&backend)
            .containers
            .iter()
            .find(|c| c.name == "vllm")
            .unwrap();
        assert_eq!(c.security_context, Some(default_backend_security_context()));
        let hardened = SecurityContext {
            run_as_non_root: Some(true),
            read_only_root_filesystem: Some(true),
            ..default_backend_security_context()
        };
        rt.spec.container.security_context = Some(hardened.clone());
        let backend = render(&svc, &rt, &cfg, true).unwrap().backend;
        let c = pod(&backend)
            .containers
            .iter()
            .find(|c| c.name == "vllm")
            .unwrap();
        assert_eq!(c.security_context, Some(hardened));
    }

    #[test]
    fn the_default_gateway_resources_parse_back() {
        let json = serde_json::to_string(&default_gateway_resources()).unwrap();
        assert_eq!(
            parse_gateway_resources(&json).unwrap(),
            default_gateway_resources()
        );
    }
}

//! Whether an `LLMService` can be rendered with an `InferenceRuntime`: the one function both the
//! admission webhook and the controller apply, so a service the webhook admits is one the
//! controller renders, and one it denies is one the controller refuses.
//!
//! [`check_llmadapter`] (in [`adapters`]) is the same for an `LLMAdapter` on its base.
//!
//! [`check_llmendpoint`] is the same for an `LLMEndpoint` (a shared gateway for many services),
//! and [`check_deployment`] (with [`check_member_serving`]) for a plain `Deployment` that joins
//! one with the `serving.hearth.dev/endpoint` annotation.
//!
//! [`check_llmservice`] returns typed [`Finding`]s: the field, a message that names the fix, a
//! [`Severity`] and a [`Reason`].
//!
//! - The webhook denies on an [`Severity::Error`] and returns a [`Severity::Warning`] as an
//!   admission warning.
//! - The controller renders nothing while there is an error, and reports it as a `False`
//!   condition ([`Reason::condition_type`]: `Ready` or `CacheReady`, with [`Reason::as_str`] as
//!   reason); warnings go into its `Validated` condition, and the service is rendered.
//!
//! Runtime resolution is not a finding: it is `hearth_policies::resolve_runtime` (pinned name,
//! vendor preference, priority, name), and the callers treat a missing runtime differently on
//! purpose (a warning at admission, `RuntimeResolved=False` in the controller; see
//! docs/webhook.md). With `runtime: None` the checks that need the runtime are skipped.

use std::{collections::BTreeMap, fmt};

pub mod adapters;
pub mod namespaces;
pub use adapters::{AdapterContext, TakenNames, check_llmadapter};
pub use namespaces::{NotAdmitted, namespace_admits, selector_matches};

use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Container, ContainerPort},
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};

use crate::{
    InferenceRuntime, LLMEndpoint, LLMService, cron,
    duration::Duration,
    inferenceruntime::{RuntimeEngineCall, RuntimeSleepMode},
    llmendpoint::{EndpointReference, FromNamespaces},
    llmservice::{
        CacheSpec, CacheStrategy, ColdStartMode, ColdStartSpec, ScalingMetric, ScalingSpec,
        TenantSpec,
    },
    model_uri::{ModelUri, parse_model_uri},
    naming::{
        check_qualified_name, is_dns1035_label, is_dns1123_label, is_dns1123_subdomain,
        is_label_value,
    },
    quantity::{is_negative, is_quantity},
    template,
    wellknown::{
        ACTIVATION_TIMEOUT_ANNOTATION, COLD_START_ANNOTATION, CONTAINER_ANNOTATION,
        DEFAULT_MEMBER_MAX_REPLICAS, DEFAULT_MEMBER_MIN_REPLICAS, ENDPOINT_ANNOTATION,
        MAX_REPLICAS_ANNOTATION, MIN_REPLICAS_ANNOTATION, MODEL_ANNOTATION, RUNTIME_ANNOTATION,
        SCALER_ANNOTATION, TARGET_ANNOTATION,
    },
};

/// Longest `LLMService` name whose children all get valid names: Service names are RFC 1035
/// labels (at most 63 characters) and the longest Service suffix is `-backend`.
pub const MAX_NAME_LEN: usize = 63 - "-backend".len();

/// Most `spec.scaling.warmWindows` of one service (the CRD's `maxItems`): each is one KEDA
/// trigger, polled every `pollingInterval`.
pub const MAX_WARM_WINDOWS: usize = 10;

/// The lowest `spec.scaling.priority` (the CRD's `minimum`).
pub const MIN_PRIORITY: i32 = -1000;

/// The highest `spec.scaling.priority` (the CRD's `maximum`).
pub const MAX_PRIORITY: i32 = 1000;

/// Whether a finding blocks rendering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Severity {
    /// The service cannot be rendered: denied at admission, a `False` condition in the
    /// controller.
    Error,
    /// The service is rendered, but something in it has no effect or looks wrong.
    Warning,
}

/// Why: the reason of the controller's condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    /// `spec.model.catalogRef`: catalogs are not implemented.
    CatalogNotImplemented,
    /// `spec.model.source.uri` missing or not a supported URI.
    InvalidModelSource,
    /// The runtime's `args`/`env` templates do not parse.
    InvalidRuntimeTemplate,
    /// A name, quantity, duration or annotation that the children could not carry.
    InvalidSpec,
    /// `spec.scaling.metric: kvCacheUtil` is reserved.
    MetricNotImplemented,
    /// `spec.resources.fraction` with a runtime without device sharing.
    FractionNotSupported,
    /// `spec.cache.strategy: BakedImage` is reserved.
    StrategyNotImplemented,
    /// A field that has no effect in this combination (a warning).
    FieldIgnored,
    /// A vendor listed twice (a warning).
    DuplicateVendor,
    /// An adapter's base `LLMService` does not exist.
    ServiceNotFound,
    /// An adapter's base has no resolved runtime yet (a warning).
    RuntimeNotResolved,
    /// An adapter's base does not admit the adapter's namespace (`spec.allowedAdapters`).
    NotAllowedByService,
    /// An adapter's base runs on a runtime without `spec.adapters`.
    AdaptersNotSupported,
    /// An adapter's `spec.rank` is above the runtime's `spec.adapters.maxRank`.
    RankTooHigh,
    /// The base has the runtime's `spec.adapters.maxAdapters` adapters already.
    TooManyAdapters,
    /// An adapter's model name is taken on the same gateway.
    ModelNameConflict,
    /// A hub adapter (`hf://`, `modelscope://`) on a base without a model cache to fetch it
    /// into (a `pvc://` or `oci://` model, or `spec.cache.strategy: None`).
    NoModelCache,
    /// A `pvc://` adapter, or one with a `secretRef`, in another namespace than its base's (the
    /// claim or Secret would be the base namespace's).
    SourceNotInNamespace,
}

impl Reason {
    /// The condition reason, `CacheSizeRequired`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::CatalogNotImplemented => "CatalogNotImplemented",
            Reason::InvalidModelSource => "InvalidModelSource",
            Reason::InvalidRuntimeTemplate => "InvalidRuntimeTemplate",
            Reason::InvalidSpec => "InvalidSpec",
            Reason::MetricNotImplemented => "MetricNotImplemented",
            Reason::FractionNotSupported => "FractionNotSupported",
            Reason::StrategyNotImplemented => "StrategyNotImplemented",
            Reason::FieldIgnored => "FieldIgnored",
            Reason::DuplicateVendor => "DuplicateVendor",
            Reason::ServiceNotFound => "ServiceNotFound",
            Reason::RuntimeNotResolved => "RuntimeNotResolved",
            Reason::NotAllowedByService => "NotAllowedByService",
            Reason::AdaptersNotSupported => "AdaptersNotSupported",
            Reason::RankTooHigh => "RankTooHigh",
            Reason::TooManyAdapters => "TooManyAdapters",
            Reason::ModelNameConflict => "ModelNameConflict",
            Reason::NoModelCache => "NoModelCache",
            Reason::SourceNotInNamespace => "SourceNotInNamespace",
        }
    }

    /// The status condition an error with this reason is reported under: `CacheReady` for the
    /// cache, `Accepted` for an adapter's base, `Ready` for everything else.
    pub fn condition_type(self) -> &'static str {
        match self {
            Reason::StrategyNotImplemented => "CacheReady",
            Reason::ServiceNotFound
            | Reason::RuntimeNotResolved
            | Reason::NotAllowedByService
            | Reason::AdaptersNotSupported
            | Reason::RankTooHigh
            | Reason::TooManyAdapters
            | Reason::ModelNameConflict
            | Reason::NoModelCache
            | Reason::SourceNotInNamespace => "Accepted",
            _ => "Ready",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One problem: the field, what is wrong and how to fix it, how bad, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// JSON path of the field in the `LLMService`, `spec.resources.fraction`.
    pub field: String,
    /// What is wrong and how to fix it (without the field).
    pub message: String,
    /// Error or warning.
    pub severity: Severity,
    /// The condition reason.
    pub reason: Reason,
}

impl Finding {
    fn new(severity: Severity, reason: Reason, field: impl Into<String>, message: String) -> Self {
        Self {
            field: field.into(),
            message,
            severity,
            reason,
        }
    }

    /// Whether it blocks rendering.
    pub fn is_error(&self) -> bool {
        self.severity == Severity::Error
    }
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// Every finding about one service, in field order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Findings(pub Vec<Finding>);

impl Findings {
    fn error(&mut self, reason: Reason, field: impl Into<String>, message: impl Into<String>) {
        self.0
            .push(Finding::new(Severity::Error, reason, field, message.into()));
    }

    fn warn(&mut self, reason: Reason, field: impl Into<String>, message: impl Into<String>) {
        self.0.push(Finding::new(
            Severity::Warning,
            reason,
            field,
            message.into(),
        ));
    }

    /// The errors.
    pub fn errors(&self) -> impl Iterator<Item = &Finding> {
        self.0.iter().filter(|f| f.is_error())
    }

    /// The warnings.
    pub fn warnings(&self) -> impl Iterator<Item = &Finding> {
        self.0.iter().filter(|f| !f.is_error())
    }

    /// Whether an error keeps the service from being rendered.
    pub fn blocks_rendering(&self) -> bool {
        self.0.iter().any(Finding::is_error)
    }

    /// The first error, whose reason the controller reports.
    pub fn first_error(&self) -> Option<&Finding> {
        self.errors().next()
    }

    /// Whether there is no finding at all.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for Findings {
    /// The findings as one line, `field: message; field: message`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, finding) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{finding}")?;
        }
        Ok(())
    }
}

impl IntoIterator for Findings {
    type Item = Finding;
    type IntoIter = std::vec::IntoIter<Finding>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.into_iter()
    }
}

/// How KEDA learns the gateway's demand ([`SCALER_ANNOTATION`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalerMode {
    /// `metrics-api` trigger polling `GET /hearth/queue` on every gateway endpoint, summed.
    Poll,
    /// `external-push` trigger to the gateway's ExternalScaler gRPC port.
    Push,
}

/// The scaler mode of `svc`: its [`SCALER_ANNOTATION`], `poll` when absent or empty.
pub fn scaler_mode(svc: &LLMService) -> Result<ScalerMode, Finding> {
    scaler_mode_of(&svc.metadata)
}

/// The scaler mode an object's metadata asks for with [`SCALER_ANNOTATION`] (an `LLMService`,
/// or an `LLMEndpoint`, whose mode its attached services follow), `poll` when absent or empty.
pub fn scaler_mode_of(metadata: &ObjectMeta) -> Result<ScalerMode, Finding> {
    match metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(SCALER_ANNOTATION))
        .map(String::as_str)
    {
        None | Some("") | Some("poll") => Ok(ScalerMode::Poll),
        Some("push") => Ok(ScalerMode::Push),
        Some(other) => Err(Finding::new(
            Severity::Error,
            Reason::InvalidSpec,
            format!("metadata.annotations[{SCALER_ANNOTATION:?}]"),
            format!("{other:?} is not a scaler mode; use poll or push (or remove the annotation)"),
        )),
    }
}

/// `spec.cache.strategy: SharedPVC`: the backends mount the claim read-only and read the hub
/// cache offline (`HF_HUB_OFFLINE=1`), so only the prewarm Job can fill it (`prewarm: true`),
/// and only for `hf://` models: ModelScope's library has no offline mode and writes to its cache
/// while resolving a model.
fn shared_pvc(f: &mut Findings, cache: &CacheSpec, model: Option<&ModelUri>) {
    if !cache.prewarm {
        f.error(
            Reason::InvalidSpec,
            "spec.cache.prewarm",
            "must be true with strategy SharedPVC: the claim is filled only by the prewarm Job and mounted read-only by the backends; set prewarm: true",
        );
    }
    if matches!(model, Some(ModelUri::ModelScope { .. })) {
        f.error(
            Reason::InvalidSpec,
            "spec.cache.strategy",
            "SharedPVC serves hf:// models (read offline from a read-only claim); ModelScope writes to its cache while loading: use NodeLocalPVC or HostPath for modelscope:// models",
        );
    }
}

/// The size of the NodeLocalPVC cache claim: `spec.cache.size`, else upstream Hearth's default
/// [`crate::llmservice::DEFAULT_CACHE_SIZE`] (50Gi).
pub fn cache_claim_size(cache: &CacheSpec) -> Quantity {
    cache.size_or_default()
}

/// Most names in `spec.model.aliases` (the CRD's `maxItems`).
pub const MAX_MODEL_ALIASES: usize = 16;
/// Longest name in `spec.model.aliases` (the CRD's `maxLength`).
pub const MAX_MODEL_ALIAS_LEN: usize = 256;

/// The aliases a service's gateway answers to (`spec.model.aliases`): each once, without the
/// service's own name (see [`model_aliases`] for the checks).
pub fn served_aliases(svc: &LLMService) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for a in &svc.spec.model.aliases {
        if svc.metadata.name.as_deref() != Some(a.as_str()) && !out.contains(a) {
            out.push(a.clone());
        }
    }
    out
}

/// `spec.model.aliases`: at most [`MAX_MODEL_ALIASES`] names of 1 to [`MAX_MODEL_ALIAS_LEN`]
/// characters without whitespace or commas (the gateway takes them as one comma-separated
/// flag), each once (the CRD's `pattern` and list type `set`); an alias that is the service's
/// own name is a warning (it is answered to anyway).
fn model_aliases(f: &mut Findings, svc: &LLMService) {
    let aliases = &svc.spec.model.aliases;
    if aliases.len() > MAX_MODEL_ALIASES {
        f.error(
            Reason::InvalidSpec,
            "spec.model.aliases",
            format!(
                "has {} names, more than {MAX_MODEL_ALIASES}; keep the names clients use",
                aliases.len()
            ),
        );
    }
    for (i, alias) in aliases.iter().enumerate() {
        let field = format!("spec.model.aliases[{i}]");
        // In characters, as the CRD's maxLength counts; whitespace as RE2's `\s` (ASCII).
        if alias.is_empty() || alias.chars().count() > MAX_MODEL_ALIAS_LEN {
            f.error(
                Reason::InvalidSpec,
                &field,
                format!("must be 1 to {MAX_MODEL_ALIAS_LEN} characters"),
            );
        } else if alias.chars().any(|c| c.is_ascii_whitespace() || c == ',') {
            f.error(
                Reason::InvalidSpec,
                &field,
                format!(
                    "{alias:?} holds whitespace or a comma; use the model name clients send, like \"Qwen/Qwen2.5-0.5B-Instruct\""
                ),
            );
        } else if aliases[..i].contains(alias) {
            f.error(
                Reason::InvalidSpec,
                &field,
                format!("{alias:?} is listed twice; remove one"),
            );
        } else if svc.metadata.name.as_deref() == Some(alias.as_str()) {
            f.warn(
                Reason::FieldIgnored,
                &field,
                format!("{alias:?} is the service's name, which clients may use anyway; remove it"),
            );
        }
    }
}

/// Checks whether `svc` can be rendered with `runtime` (its resolved `InferenceRuntime`, or
/// `None` when it has none yet: then the runtime's own checks are skipped).
pub fn check_llmservice(svc: &LLMService, runtime: Option<&InferenceRuntime>) -> Findings {
    let mut f = Findings::default();
    let spec = &svc.spec;

    // Names: the gateway Service is named after the service, the others add a suffix.
    if let Some(name) = svc.metadata.name.as_deref().filter(|n| !n.is_empty()) {
        if name.len() > MAX_NAME_LEN {
            f.error(
                Reason::InvalidSpec,
                "metadata.name",
                format!(
                    "{name:?} is longer than {MAX_NAME_LEN} characters; child Service names \
                     (<name>-backend) must fit 63; choose a shorter name"
                ),
            );
        } else if !is_dns1035_label(name) {
            f.error(
                Reason::InvalidSpec,
                "metadata.name",
                format!(
                    "{name:?} cannot name the service's children: the gateway Service takes this \
                     name, and Service names are lowercase letters, digits and '-', starting with \
                     a letter and ending alphanumeric (no '.'); rename the LLMService"
                ),
            );
        }
    }
    if let Err(e) = scaler_mode(svc) {
        f.0.push(e);
    }

    // Model.
    if spec.model.catalog_ref.is_some() {
        f.error(
            Reason::CatalogNotImplemented,
            "spec.model.catalogRef",
            "catalog resolution is not supported; remove catalogRef and set spec.model.source.uri \
             (for example hf://Qwen/Qwen2.5-0.5B-Instruct)",
        );
    }
    let model = match &spec.model.source {
        None => {
            if spec.model.catalog_ref.is_none() {
                f.error(
                    Reason::InvalidModelSource,
                    "spec.model.source.uri",
                    "is required; set it (for example hf://Qwen/Qwen2.5-0.5B-Instruct)",
                );
            }
            None
        }
        Some(src) => match parse_model_uri(&src.uri) {
            Ok(uri) => Some(uri),
            Err(e) => {
                f.error(
                    Reason::InvalidModelSource,
                    "spec.model.source.uri",
                    e.to_string(),
                );
                None
            }
        },
    };
    let staged_model = model.as_ref().is_some_and(ModelUri::is_staged);
    if let Some(secret) = spec
        .model
        .source
        .as_ref()
        .and_then(|s| s.secret_ref.as_ref())
    {
        object_name(&mut f, "spec.model.source.secretRef.name", &secret.name);
    }

    model_aliases(&mut f, svc);

    // Runtime selection.
    let sel = &spec.runtime;
    if sel.name.as_deref().is_some_and(|n| !n.is_empty())
        && sel.selector.as_ref().is_some_and(|s| !s.vendor.is_empty())
    {
        f.warn(
            Reason::FieldIgnored,
            "spec.runtime.selector",
            "is ignored because spec.runtime.name pins a runtime; remove one of them",
        );
    }
    if let Some(name) = sel.name.as_deref().filter(|n| !n.is_empty()) {
        object_name(&mut f, "spec.runtime.name", name);
    }
    if let Some(s) = &sel.selector {
        for (i, v) in s.vendor.iter().enumerate() {
            let field = format!("spec.runtime.selector.vendor[{i}]");
            if !is_dns1123_label(v) {
                f.error(
                    Reason::InvalidSpec,
                    field,
                    format!(
                        "{v:?} is not a vendor name; vendors are lowercase DNS labels such as \
                         nvidia or ascend"
                    ),
                );
            } else if s.vendor[..i].contains(v) {
                f.warn(
                    Reason::DuplicateVendor,
                    field,
                    format!("{v:?} is listed twice; remove the duplicate"),
                );
            }
        }
    }

    // Resources.
    let r = &spec.resources;
    for (field, q) in [
        ("spec.resources.cpu", &r.cpu),
        ("spec.resources.memory", &r.memory),
    ] {
        if let Some(q) = q {
            quantity(&mut f, field, q, "500m, 4 or 16Gi");
        }
    }
    // A fraction on a sharing runtime is rendered by the platform's ServingPolicies (the
    // built-ins render none); the controller refuses it when no policy acts on it
    // (`PolicyFailed`), which only rendering can tell.
    if r.fraction.is_some()
        && let Some(rt) = runtime
        && !rt.spec.accelerator.sharing.supported
    {
        f.error(
            Reason::FractionNotSupported,
            "spec.resources.fraction",
            format!(
                "InferenceRuntime {:?} (resource {}) does not support fractional devices \
                 (its spec.accelerator.sharing.supported is false); remove fraction to \
                 request whole devices",
                rt.metadata.name.as_deref().unwrap_or_default(),
                rt.spec.accelerator.resource_name
            ),
        );
    }

    // Scaling.
    if spec.scaling.min > spec.scaling.max {
        f.error(
            Reason::InvalidSpec,
            "spec.scaling.min",
            format!(
                "{} exceeds scaling.max ({}); lower min or raise max",
                spec.scaling.min, spec.scaling.max
            ),
        );
    }
    if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&spec.scaling.priority) {
        f.error(
            Reason::InvalidSpec,
            "spec.scaling.priority",
            format!(
                "{} is out of range; write a value from {MIN_PRIORITY} to {MAX_PRIORITY} (higher wins a device handover)",
                spec.scaling.priority
            ),
        );
    }
    if spec.scaling.metric == ScalingMetric::KvCacheUtil {
        f.error(
            Reason::MetricNotImplemented,
            "spec.scaling.metric",
            "kvCacheUtil is reserved and not wired to the autoscaler; use queueDepth",
        );
    }
    for (field, d) in [
        (
            "spec.scaling.activationTimeout",
            &spec.scaling.activation_timeout,
        ),
        (
            "spec.scaling.scaleDownStabilization",
            &spec.scaling.scale_down_stabilization,
        ),
        ("spec.scaling.drainTimeout", &spec.scaling.drain_timeout),
        ("spec.scaling.minResidency", &spec.scaling.min_residency),
        (
            "spec.endpoint.coldStart.heartbeatInterval",
            &spec.endpoint.cold_start.heartbeat_interval,
        ),
    ] {
        if let Err(e) = d.get() {
            f.error(
                Reason::InvalidSpec,
                field,
                format!("{e}; write a duration such as 90s, 5m or 1h30m"),
            );
        }
    }

    warm_windows(&mut f, &spec.scaling);
    if let Err(finding) = sleep_tier(svc, runtime) {
        f.0.push(finding);
    }

    // Cache.
    let cache = &spec.cache;
    match cache.strategy {
        CacheStrategy::BakedImage => f.error(
            Reason::StrategyNotImplemented,
            "spec.cache.strategy",
            format!(
                "{:?} is reserved and not implemented; use NodeLocalPVC, SharedPVC, HostPath or None",
                cache.strategy
            ),
        ),
        CacheStrategy::NodeLocalPVC | CacheStrategy::SharedPVC => {
            if cache.strategy == CacheStrategy::SharedPVC && !staged_model {
                shared_pvc(&mut f, cache, model.as_ref());
            }
            if let Some(size) = &cache.size {
                quantity(&mut f, "spec.cache.size", size, "30Gi");
            }
            if let Some(class) = &cache.storage_class_name {
                object_name(&mut f, "spec.cache.storageClassName", class);
            }
        }
        CacheStrategy::HostPath | CacheStrategy::None => {
            for (field, set) in [
                ("spec.cache.size", cache.size.is_some()),
                (
                    "spec.cache.storageClassName",
                    cache.storage_class_name.is_some(),
                ),
            ] {
                if set {
                    f.warn(
                        Reason::FieldIgnored,
                        field,
                        format!("is ignored with strategy {:?}; remove it", cache.strategy),
                    );
                }
            }
        }
    }
    if cache.prewarm && cache.strategy == CacheStrategy::None {
        f.warn(
            Reason::FieldIgnored,
            "spec.cache.prewarm",
            "is ignored with strategy None (there is no cache to fill); remove it or pick a cache strategy",
        );
    } else if cache.prewarm && staged_model {
        f.warn(
            Reason::FieldIgnored,
            "spec.cache.prewarm",
            "is ignored for pvc:// and oci:// models, whose weights are already staged; remove it",
        );
    }

    // Endpoint and pods.
    if !spec.endpoint.openai_compatible {
        f.warn(
            Reason::FieldIgnored,
            "spec.endpoint.openAICompatible",
            "false has no effect: the gateway always serves the OpenAI-compatible API",
        );
    }
    for (i, s) in spec.image_pull_secrets.iter().enumerate() {
        object_name(&mut f, &format!("spec.imagePullSecrets[{i}].name"), &s.name);
    }
    if let Some(r) = &spec.endpoint.shared_endpoint_ref {
        shared_endpoint_ref(&mut f, r, &spec.endpoint);
    }
    tenants(&mut f, "spec.endpoint.tenants", &spec.endpoint.tenants);
    if let Some(owner) = &spec.owner
        && !is_dns1123_label(owner)
    {
        f.error(
            Reason::InvalidSpec,
            "spec.owner",
            format!(
                "{owner:?} is not a DNS label (lowercase letters, digits and '-', at most 63); \
                 name the owning team as its tenants are named, or leave it out to charge the \
                 namespace"
            ),
        );
    }
    if let Some(c) = spec.endpoint.container_concurrency
        && !(1..=MAX_CONTAINER_CONCURRENCY).contains(&c)
    {
        f.error(
            Reason::InvalidSpec,
            "spec.endpoint.containerConcurrency",
            format!(
                "{c} is not between 1 and {MAX_CONTAINER_CONCURRENCY}; set the requests one \
                 backend replica serves at once (vLLM's --max-num-seqs), or remove it"
            ),
        );
    }

    // argsOverride entries are rendered as templates too (as upstream).
    for (i, arg) in spec.runtime.args_override.iter().enumerate() {
        let field = format!("spec.runtime.argsOverride[{i}]");
        if let Err(e) = template::parse(arg, &field) {
            f.error(Reason::InvalidSpec, field, e.problem().to_string());
        }
    }

    // The runtime's templates, which render this service's arguments.
    if let Some(rt) = runtime {
        let rt_name = rt.metadata.name.as_deref().unwrap_or_default();
        for (field, text) in template::runtime_templates(&rt.spec) {
            if let Err(e) = template::parse(text, &field) {
                f.error(
                    Reason::InvalidRuntimeTemplate,
                    "spec.runtime",
                    format!(
                        "InferenceRuntime {rt_name:?} cannot render this service: {e}; fix the \
                         runtime or choose another"
                    ),
                );
            }
        }
    }
    f
}

/// The sleeping tier a service runs: `spec.scaling.sleep` on a runtime whose `spec.sleepMode`
/// supports its level.
#[derive(Clone, Debug, PartialEq)]
pub struct SleepTier<'a> {
    /// Idle time before the engines are put to sleep.
    pub after: std::time::Duration,
    /// The engine's sleep level, 1 or 2.
    pub level: i32,
    /// The runtime's sleep mode: the engine's extra args and env, the sleep and state paths.
    pub mode: &'a RuntimeSleepMode,
    /// The wake-up calls of `level`, in order (one `POST /wake_up` when the runtime lists none).
    pub wake_up: Vec<RuntimeEngineCall>,
}

/// `spec.scaling.sleep` of `svc` with its runtime: `Ok(None)` when the service does not sleep,
/// or sleeps with no effect (no runtime yet, or the runtime cannot sleep at that level: a
/// [`Severity::Warning`] then). The webhook and the controller's checks and the render all
/// take the tier from here.
///
/// # Errors
/// A finding on `spec.scaling.sleep`: an error for an `after` that is not a positive duration,
/// a warning ([`Reason::FieldIgnored`]) when the tier has no effect.
pub fn sleep_tier<'a>(
    svc: &LLMService,
    runtime: Option<&'a InferenceRuntime>,
) -> Result<Option<SleepTier<'a>>, Finding> {
    let scaling = &svc.spec.scaling;
    let Some(sleep) = &scaling.sleep else {
        return Ok(None);
    };
    let ignored = |field: &str, message: String| {
        Finding::new(Severity::Warning, Reason::FieldIgnored, field, message)
    };
    let after = match sleep.after.get() {
        Ok(after) if !after.is_zero() => after,
        Ok(_) => {
            return Err(Finding::new(
                Severity::Error,
                Reason::InvalidSpec,
                "spec.scaling.sleep.after",
                "must be positive; write how long the service must be idle before its engines \
                 sleep, such as 2m"
                    .into(),
            ));
        }
        Err(e) => {
            return Err(Finding::new(
                Severity::Error,
                Reason::InvalidSpec,
                "spec.scaling.sleep.after",
                format!("{e}; write a duration such as 90s, 5m or 1h30m"),
            ));
        }
    };
    let Some(rt) = runtime else {
        return Ok(None);
    };
    let rt_name = rt.metadata.name.as_deref().unwrap_or_default();
    let Some(mode) = &rt.spec.sleep_mode else {
        return Err(ignored(
            "spec.scaling.sleep",
            format!(
                "has no effect: runtime {rt_name:?} declares no sleep mode (spec.sleepMode), so \
                 the service scales to zero without sleeping; use a runtime whose engine can \
                 sleep, or remove scaling.sleep"
            ),
        ));
    };
    let Some(level) = mode.levels.iter().find(|l| l.level == sleep.level) else {
        let levels: Vec<String> = mode.levels.iter().map(|l| l.level.to_string()).collect();
        return Err(ignored(
            "spec.scaling.sleep.level",
            format!(
                "has no effect: runtime {rt_name:?} supports sleep level {} only \
                 (spec.sleepMode.levels); set one of them",
                levels.join(" and ")
            ),
        ));
    };
    let zero_first = scaling.min == 0
        && scaling.warm_windows.is_empty()
        && scaling
            .scale_down_stabilization
            .get()
            .is_ok_and(|zero| after >= zero);
    if zero_first {
        return Err(ignored(
            "spec.scaling.sleep.after",
            format!(
                "has no effect: the service scales to zero after scaleDownStabilization ({}), \
                 before it would sleep; make after shorter, or raise min to keep sleeping \
                 replicas",
                scaling.scale_down_stabilization
            ),
        ));
    }
    for (i, call) in level.wake_up.iter().enumerate() {
        let bad_path = call
            .path
            .contains(|c: char| c.is_ascii_control() || "<>`\"{}|\\^".contains(c));
        let bad_body = call
            .body
            .as_deref()
            .is_some_and(|b| serde_json::from_str::<serde_json::Value>(b).is_err());
        if bad_path || bad_body {
            let what = if bad_path { "path" } else { "body" };
            return Err(ignored(
                "spec.scaling.sleep.level",
                format!(
                    "has no effect: runtime {rt_name:?} has a wake-up call the gateway cannot \
                     send (spec.sleepMode.levels[{}].wakeUp[{i}].{what}: a path without \
                     spaces, quotes or <>`{{}}|\\^, a body that is JSON); fix the runtime",
                    mode.levels
                        .iter()
                        .position(|l| l.level == sleep.level)
                        .unwrap_or(0)
                ),
            ));
        }
    }
    let wake_up = if level.wake_up.is_empty() {
        vec![RuntimeEngineCall {
            path: "/wake_up".into(),
            body: None,
        }]
    } else {
        level.wake_up.clone()
    };
    Ok(Some(SleepTier {
        after,
        level: sleep.level,
        mode,
        wake_up,
    }))
}

/// `spec.scaling.warmWindows`: what KEDA's `cron` scaler needs to run each window as written
/// (a time zone it can load, five-field cron expressions its parser accepts, start and end
/// apart, `desiredReplicas` of at least 1), and a minimum within `scaling.max`. A window at or
/// below `scaling.min` is a warning: it changes nothing.
fn warm_windows(f: &mut Findings, s: &ScalingSpec) {
    if s.warm_windows.len() > MAX_WARM_WINDOWS {
        f.error(
            Reason::InvalidSpec,
            "spec.scaling.warmWindows",
            format!(
                "has {} windows, at most {MAX_WARM_WINDOWS} are allowed; merge windows (a cron \
                 field takes lists and ranges, such as MON-FRI or 8,13)",
                s.warm_windows.len()
            ),
        );
    }
    for (i, w) in s.warm_windows.iter().enumerate() {
        let field = |name: &str| format!("spec.scaling.warmWindows[{i}].{name}");
        if w.timezone.parse::<chrono_tz::Tz>().is_err() {
            f.error(
                Reason::InvalidSpec,
                field("timezone"),
                format!(
                    "{:?} is not an IANA time zone name; write one such as Europe/Berlin, \
                     America/New_York or UTC (names are case-sensitive)",
                    w.timezone
                ),
            );
        }
        let mut schedule = |name: &str, expr: &str| match cron::parse(expr) {
            Ok(s) => Some(s),
            Err(e) => {
                f.error(
                    Reason::InvalidSpec,
                    field(name),
                    format!("{expr:?} is not a schedule KEDA's cron scaler runs: {e}"),
                );
                None
            }
        };
        let start = schedule("start", &w.start);
        let end = schedule("end", &w.end);
        if let (Some(start), Some(end)) = (start, end)
            && let Some(problem) = cron::window_problem(&start, &end)
        {
            f.error(
                Reason::InvalidSpec,
                field("end"),
                format!(
                    "start {:?} and end {:?} do not make a window KEDA runs as written: {problem}",
                    w.start, w.end
                ),
            );
        }
        if w.replicas < 1 {
            f.error(
                Reason::InvalidSpec,
                field("replicas"),
                format!(
                    "{} keeps nothing warm; set 1 or more (a window is the minimum while it is \
                     open), or remove the window",
                    w.replicas
                ),
            );
        } else if w.replicas > s.max {
            f.error(
                Reason::InvalidSpec,
                field("replicas"),
                format!(
                    "{} exceeds scaling.max ({}); lower replicas or raise max",
                    w.replicas, s.max
                ),
            );
        } else if w.replicas <= s.min {
            f.warn(
                Reason::FieldIgnored,
                field("replicas"),
                format!(
                    "{} is not above scaling.min ({}), so the window changes nothing; raise \
                     replicas or remove the window",
                    w.replicas, s.min
                ),
            );
        }
    }
}

/// `spec.endpoint.sharedEndpointRef`: a reference the CRD's patterns admit (checked here too,
/// so the rules and the schema agree), and the gateway fields that apply only while the
/// service has a gateway of its own.
fn shared_endpoint_ref(
    f: &mut Findings,
    r: &crate::llmendpoint::EndpointReference,
    endpoint: &crate::llmservice::EndpointSpec,
) {
    if r.name.len() > 63 || !is_dns1035_label(&r.name) {
        f.error(
            Reason::InvalidSpec,
            "spec.endpoint.sharedEndpointRef.name",
            format!(
                "{:?} is not an LLMEndpoint name (lowercase letters, digits and '-', starting \
                 with a letter, at most 63)",
                r.name
            ),
        );
    }
    if let Some(ns) = &r.namespace
        && !is_dns1123_label(ns)
    {
        f.error(
            Reason::InvalidSpec,
            "spec.endpoint.sharedEndpointRef.namespace",
            format!(
                "{ns:?} is not a namespace name (lowercase letters, digits and '-', at most 63); \
                 remove it to use the service's own namespace"
            ),
        );
    }
    for (field, set) in [
        ("spec.endpoint.replicas", endpoint.replicas.is_some()),
        (
            "spec.endpoint.apiKeySecretRef",
            endpoint.api_key_secret_ref.is_some(),
        ),
        ("spec.endpoint.tenants", !endpoint.tenants.is_empty()),
    ] {
        if set {
            f.warn(
                Reason::FieldIgnored,
                field,
                "applies only while the service has its own gateway: once the LLMEndpoint \
                 named by spec.endpoint.sharedEndpointRef accepts the service, the endpoint's \
                 spec.replicas, spec.apiKeySecretRef and spec.tenants apply instead; remove it, \
                 or keep it for when the service is not accepted",
            );
        }
    }
}

/// Most gateway replicas of an `LLMEndpoint` (and of a service's own gateway): the CRD's
/// `maximum`.
pub const MAX_GATEWAY_REPLICAS: i32 = 20;

/// Longest `LLMEndpoint` name whose children all get valid names: the client Service takes the
/// name itself (an RFC 1035 label), the Deployment's pods carry `<name>-gateway` as a label
/// value (at most 63).
pub const MAX_ENDPOINT_NAME_LEN: usize = 63 - "-gateway".len();

/// Checks whether `ep` can be rendered: the one function the admission webhook and the
/// controller apply to an `LLMEndpoint` (errors deny it at admission, and in the controller
/// make its `Accepted` condition False with nothing rendered). The CRD's own checks
/// (`allowedServices.namespaces`: a selector exactly with `from: Selector`; `replicas` 1–20) are
/// repeated here so both agree; what the schema cannot say (a label selector's shape, the name
/// of the objects it renders, the scaler annotation) is only here.
pub fn check_llmendpoint(ep: &LLMEndpoint) -> Findings {
    let mut f = Findings::default();
    if let Some(name) = ep.metadata.name.as_deref().filter(|n| !n.is_empty()) {
        if name.len() > MAX_ENDPOINT_NAME_LEN {
            f.error(
                Reason::InvalidSpec,
                "metadata.name",
                format!(
                    "{name:?} is longer than {MAX_ENDPOINT_NAME_LEN} characters; the gateway's \
                     pods carry <name>-gateway as a label value, which must fit 63; choose a \
                     shorter name"
                ),
            );
        } else if !is_dns1035_label(name) {
            f.error(
                Reason::InvalidSpec,
                "metadata.name",
                format!(
                    "{name:?} cannot name the endpoint's children: its client Service takes this \
                     name, and Service names are lowercase letters, digits and '-', starting with \
                     a letter and ending alphanumeric (no '.'); rename the LLMEndpoint"
                ),
            );
        }
    }
    if let Err(e) = scaler_mode_of(&ep.metadata) {
        f.0.push(e);
    }
    if let Some(r) = ep.spec.replicas
        && !(1..=MAX_GATEWAY_REPLICAS).contains(&r)
    {
        f.error(
            Reason::InvalidSpec,
            "spec.replicas",
            format!("{r} is not between 1 and {MAX_GATEWAY_REPLICAS}; set the number of gateway replicas in that range"),
        );
    }
    let ns = &ep.spec.allowed_services.namespaces;
    let field = "spec.allowedServices.namespaces.selector";
    match (ns.from, &ns.selector) {
        (FromNamespaces::Selector, None) => f.error(
            Reason::InvalidSpec,
            field,
            "is required with from: Selector; set a label selector of the namespaces whose \
             services may join (for example matchLabels: {hearth.dev/shared-endpoint: \"true\"})",
        ),
        (FromNamespaces::Selector, Some(sel)) => label_selector(&mut f, field, sel),
        (from, Some(_)) => f.error(
            Reason::InvalidSpec,
            field,
            format!(
                "is only used with from: Selector, and from is {from:?}; remove the selector or \
                 set from: Selector"
            ),
        ),
        (_, None) => {}
    }
    tenants(&mut f, "spec.tenants", &ep.spec.tenants);
    f
}

/// Largest `containerConcurrency`: the CRD's `maximum`.
pub const MAX_CONTAINER_CONCURRENCY: i32 = 100_000;

/// The tenant whose settings apply to requests without a tenant of their own.
pub const DEFAULT_TENANT: &str = "default";

/// A gateway's tenants at `field`: names unique DNS labels, keys required except for the
/// [`DEFAULT_TENANT`], priority in [`MIN_PRIORITY`]..=[`MAX_PRIORITY`], quotas positive.
fn tenants(f: &mut Findings, field: &str, tenants: &[TenantSpec]) {
    for (i, t) in tenants.iter().enumerate() {
        let at = format!("{field}[{i}]");
        if !is_dns1123_label(&t.name) {
            f.error(
                Reason::InvalidSpec,
                format!("{at}.name"),
                format!(
                    "{:?} is not a DNS label (lowercase letters, digits and '-', at most 63); \
                     rename the tenant",
                    t.name
                ),
            );
        }
        if tenants[..i].iter().any(|o| o.name == t.name) {
            f.error(
                Reason::InvalidSpec,
                format!("{at}.name"),
                format!("tenant {:?} is listed twice; merge the two entries", t.name),
            );
        }
        match &t.api_key_secret_ref {
            None if t.name != DEFAULT_TENANT => f.error(
                Reason::InvalidSpec,
                format!("{at}.apiKeySecretRef"),
                "is required: a tenant is known by its API keys; name the Secret key holding \
                 them (only the tenant \"default\" may go without)",
            ),
            Some(r) => object_name(f, &format!("{at}.apiKeySecretRef.name"), &r.name),
            None => {}
        }
        if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&t.priority) {
            f.error(
                Reason::InvalidSpec,
                format!("{at}.priority"),
                format!(
                    "{} is not between {MIN_PRIORITY} and {MAX_PRIORITY}; set the tenant's band \
                     in that range (higher is served first)",
                    t.priority
                ),
            );
        }
        for (name, v) in [
            ("requestsPerMinute", t.requests_per_minute),
            ("tokensPerMinute", t.tokens_per_minute),
        ] {
            if let Some(v) = v
                && v < 1
            {
                f.error(
                    Reason::InvalidSpec,
                    format!("{at}.{name}"),
                    format!(
                        "{v} is not positive; set a quota of at least 1, or remove it for none"
                    ),
                );
            }
        }
    }
}

/// The requests a backend replica of `svc` (served by `rt`) is sent at once:
/// `spec.endpoint.containerConcurrency`, else the engine's `--max-num-seqs` in the runtime's
/// arguments or `spec.runtime.argsOverride` (the last one, as argparse reads them), else
/// `None` (the gateway's default, 256: vLLM's).
pub fn container_concurrency(svc: &LLMService, rt: Option<&InferenceRuntime>) -> Option<u32> {
    if let Some(c) = svc.spec.endpoint.container_concurrency {
        return u32::try_from(c).ok().filter(|c| *c > 0);
    }
    let args = rt
        .into_iter()
        .flat_map(|rt| rt.spec.container.args.iter())
        .chain(svc.spec.runtime.args_override.iter());
    let mut found = None;
    let mut next_is_value = false;
    for a in args {
        if next_is_value {
            found = a.trim().parse::<u32>().ok().filter(|c| *c > 0).or(found);
            next_is_value = false;
        } else if a == "--max-num-seqs" {
            next_is_value = true;
        } else if let Some(v) = a.strip_prefix("--max-num-seqs=") {
            found = v.trim().parse::<u32>().ok().filter(|c| *c > 0).or(found);
        }
    }
    found
}

/// The findings of [`label_selector`] for `sel` at `field`, for a selector that comes from a
/// flag rather than an object (the controller's `--model-network-policies`).
pub fn check_label_selector(field: &str, sel: &LabelSelector) -> Findings {
    let mut f = Findings::default();
    label_selector(&mut f, field, sel);
    f
}

/// A `metav1.LabelSelector` the apiserver's `LabelSelectorAsSelector` accepts: qualified label
/// keys, label values, the four operators, values exactly with `In` and `NotIn`.
fn label_selector(f: &mut Findings, field: &str, sel: &LabelSelector) {
    for (k, v) in sel.match_labels.iter().flatten() {
        let at = format!("{field}.matchLabels[{k:?}]");
        if let Err(why) = check_qualified_name(k) {
            f.error(Reason::InvalidSpec, &at, format!("the key {why}"));
        }
        if !is_label_value(v) {
            f.error(
                Reason::InvalidSpec,
                at,
                format!(
                    "the value {v:?} is not a label value: at most 63 letters, digits, '-', '_' \
                     and '.', starting and ending alphanumeric"
                ),
            );
        }
    }
    for (i, e) in sel.match_expressions.iter().flatten().enumerate() {
        let at = |name: &str| format!("{field}.matchExpressions[{i}].{name}");
        if let Err(why) = check_qualified_name(&e.key) {
            f.error(
                Reason::InvalidSpec,
                at("key"),
                format!("{:?}: the key {why}", e.key),
            );
        }
        let values = e.values.as_deref().unwrap_or_default();
        match e.operator.as_str() {
            "In" | "NotIn" if values.is_empty() => f.error(
                Reason::InvalidSpec,
                at("values"),
                format!(
                    "must not be empty with operator {}; list the label values",
                    e.operator
                ),
            ),
            "In" | "NotIn" => {
                for (j, v) in values.iter().enumerate() {
                    if !is_label_value(v) {
                        f.error(
                            Reason::InvalidSpec,
                            format!("{field}.matchExpressions[{i}].values[{j}]"),
                            format!("{v:?} is not a label value"),
                        );
                    }
                }
            }
            "Exists" | "DoesNotExist" if !values.is_empty() => f.error(
                Reason::InvalidSpec,
                at("values"),
                format!("must be empty with operator {}; remove them", e.operator),
            ),
            "Exists" | "DoesNotExist" => {}
            other => f.error(
                Reason::InvalidSpec,
                at("operator"),
                format!("{other:?} is not an operator; use In, NotIn, Exists or DoesNotExist"),
            ),
        }
    }
}

/// Longest name of a Deployment that joins an endpoint: its Service `<name>-hearth` (the
/// gateway finds the engines through its EndpointSlices) must be an RFC 1035 label of at most
/// 63 characters.
pub const MAX_MEMBER_NAME_LEN: usize = 63 - "-hearth".len();

/// Longest model name of [`MODEL_ANNOTATION`].
pub const MAX_MODEL_NAME_LEN: usize = 256;

/// The annotations of a Deployment that joins an endpoint, besides [`ENDPOINT_ANNOTATION`] (and
/// the scaler annotation, which LLMServices read too): without the endpoint annotation each is
/// ignored (a warning).
pub const MEMBER_ANNOTATIONS: [&str; 6] = [
    MODEL_ANNOTATION,
    MIN_REPLICAS_ANNOTATION,
    MAX_REPLICAS_ANNOTATION,
    TARGET_ANNOTATION,
    ACTIVATION_TIMEOUT_ANNOTATION,
    COLD_START_ANNOTATION,
];

/// What a Deployment with [`ENDPOINT_ANNOTATION`] asks for, from its annotations, defaults
/// filled in (an LLMService's defaults, see [`crate::wellknown`]).
#[derive(Clone, Debug, PartialEq)]
pub struct DeploymentMember {
    /// The endpoint, its namespace `None` for the Deployment's own.
    pub endpoint: EndpointReference,
    /// The model name clients send ([`MODEL_ANNOTATION`]).
    pub model: String,
    /// How KEDA reads the demand ([`SCALER_ANNOTATION`]).
    pub scaler: ScalerMode,
    /// [`MIN_REPLICAS_ANNOTATION`].
    pub min_replicas: i32,
    /// [`MAX_REPLICAS_ANNOTATION`].
    pub max_replicas: i32,
    /// [`TARGET_ANNOTATION`].
    pub target: i32,
    /// [`ACTIVATION_TIMEOUT_ANNOTATION`].
    pub activation_timeout: Duration,
    /// [`COLD_START_ANNOTATION`].
    pub cold_start: ColdStartMode,
}

impl DeploymentMember {
    /// The scaling an LLMService with these settings has: `min`, `max`, `target` and
    /// `activationTimeout` from the annotations, the rest (`scaleDownStabilization`, ...) the
    /// LLMService defaults.
    pub fn scaling(&self) -> ScalingSpec {
        ScalingSpec {
            min: self.min_replicas,
            max: self.max_replicas,
            target: self.target,
            activation_timeout: self.activation_timeout.clone(),
            ..ScalingSpec::default()
        }
    }

    /// The cold-start settings: the mode from [`COLD_START_ANNOTATION`], the heartbeat interval
    /// the LLMService default.
    pub fn cold_start(&self) -> ColdStartSpec {
        ColdStartSpec {
            mode: self.cold_start,
            ..ColdStartSpec::default()
        }
    }
}

/// The outcome of [`check_deployment`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MemberCheck {
    /// What the Deployment asks for, when it joins an endpoint and no finding is an error.
    pub member: Option<DeploymentMember>,
    /// Every finding, in field order; fields are paths in the Deployment
    /// (`metadata.annotations["serving.hearth.dev/model"]`).
    pub findings: Findings,
}

fn annotation_field(key: &str) -> String {
    format!("metadata.annotations[{key:?}]")
}

fn annotation<'a>(meta: &'a ObjectMeta, key: &str) -> Option<&'a str> {
    meta.annotations
        .as_ref()
        .and_then(|a| a.get(key))
        .map(String::as_str)
}

/// The endpoint a Deployment joins ([`ENDPOINT_ANNOTATION`]: `<name>` or `<namespace>/<name>`);
/// `None` without the annotation, the finding when it is not a reference.
pub fn deployment_endpoint(meta: &ObjectMeta) -> Option<Result<EndpointReference, Finding>> {
    let value = annotation(meta, ENDPOINT_ANNOTATION)?;
    let bad = |why: String| {
        Some(Err(Finding::new(
            Severity::Error,
            Reason::InvalidSpec,
            annotation_field(ENDPOINT_ANNOTATION),
            format!(
                "{value:?} {why}; write <name> (an LLMEndpoint of the Deployment's namespace) or \
                 <namespace>/<name>, or remove the annotation to leave the endpoint"
            ),
        )))
    };
    let (namespace, name) = match value.split_once('/') {
        Some((ns, name)) => (Some(ns), name),
        None => (None, value),
    };
    if name.len() > 63 || !is_dns1035_label(name) {
        return bad(
            "does not name an LLMEndpoint (lowercase letters, digits and '-', starting with a \
             letter, at most 63)"
                .to_owned(),
        );
    }
    if let Some(ns) = namespace
        && !is_dns1123_label(ns)
    {
        return bad(format!(
            "names the namespace {ns:?}, which is not a namespace name (lowercase letters, \
             digits and '-', at most 63)"
        ));
    }
    Some(Ok(EndpointReference {
        name: name.to_owned(),
        namespace: namespace.map(str::to_owned),
    }))
}

/// A whole number of an annotation, at least `min`; `default` when absent.
fn int_annotation(f: &mut Findings, meta: &ObjectMeta, key: &str, min: i32, default: i32) -> i32 {
    let Some(v) = annotation(meta, key) else {
        return default;
    };
    match v.trim().parse::<i32>() {
        Ok(n) if n >= min => n,
        _ => {
            f.error(
                Reason::InvalidSpec,
                annotation_field(key),
                format!(
                    "{v:?} is not a whole number of at least {min}; write one like \"{}\", or \
                     remove the annotation for the default ({default})",
                    default.max(min)
                ),
            );
            default
        }
    }
}

/// Checks whether a Deployment can join the endpoint its [`ENDPOINT_ANNOTATION`] names: the one
/// function the admission webhook (errors deny the Deployment, warnings are admission
/// warnings) and the controller (errors keep it off the endpoint: `InvalidMember` in the
/// endpoint's `status.conflicts`, and an Event on the Deployment) apply. Without the annotation
/// the Deployment joins nothing, and the other member annotations are warnings.
///
/// What needs the Deployment's runtime (which container and port serve the model) is
/// [`check_member_serving`].
pub fn check_deployment(d: &Deployment) -> MemberCheck {
    let mut f = Findings::default();
    let meta = &d.metadata;
    let Some(endpoint) = deployment_endpoint(meta) else {
        for key in MEMBER_ANNOTATIONS {
            if annotation(meta, key).is_some() {
                f.warn(
                    Reason::FieldIgnored,
                    annotation_field(key),
                    format!(
                        "has no effect without {ENDPOINT_ANNOTATION}: add it to join an \
                         LLMEndpoint, or remove this annotation"
                    ),
                );
            }
        }
        return MemberCheck {
            member: None,
            findings: f,
        };
    };
    let endpoint = endpoint.map_err(|e| f.0.push(e)).ok();

    if let Some(name) = meta.name.as_deref().filter(|n| !n.is_empty())
        && (name.len() > MAX_MEMBER_NAME_LEN || !is_dns1035_label(name))
    {
        f.error(
            Reason::InvalidSpec,
            "metadata.name",
            format!(
                "{name:?} cannot join an endpoint: the Service <name>-hearth that the endpoint's \
                 gateway finds its pods through must be an RFC 1035 label (lowercase letters, \
                 digits and '-', starting with a letter, no '.'), so the name must be one of at \
                 most {MAX_MEMBER_NAME_LEN} characters; rename the Deployment, or remove \
                 {ENDPOINT_ANNOTATION}"
            ),
        );
    }
    if let Some(owner) = meta.owner_references.iter().flatten().find(|o| {
        o.controller == Some(true)
            && o.kind == "LLMService"
            && o.api_version.starts_with(crate::GROUP)
    }) {
        f.error(
            Reason::InvalidSpec,
            annotation_field(ENDPOINT_ANNOTATION),
            format!(
                "this Deployment is the backend of LLMService {:?}, which joins an endpoint \
                 with its spec.endpoint.sharedEndpointRef; remove the annotation here",
                owner.name
            ),
        );
    }

    let model = match annotation(meta, MODEL_ANNOTATION) {
        None => {
            f.error(
                Reason::InvalidSpec,
                annotation_field(MODEL_ANNOTATION),
                format!(
                    "is required with {ENDPOINT_ANNOTATION}: set it to the name the engine \
                     serves the model under (vLLM's --served-model-name), which clients send as \
                     \"model\"; the gateway forwards requests unchanged"
                ),
            );
            None
        }
        Some(m)
            if m.is_empty()
                || m.len() > MAX_MODEL_NAME_LEN
                || m.trim() != m
                || m.chars().any(|c| c.is_whitespace() || c.is_control()) =>
        {
            f.error(
                Reason::InvalidSpec,
                annotation_field(MODEL_ANNOTATION),
                format!(
                    "{m:?} is not a model name: write the engine's --served-model-name, 1 to \
                     {MAX_MODEL_NAME_LEN} characters without white space or control characters"
                ),
            );
            None
        }
        Some(m) => Some(m.to_owned()),
    };
    let scaler = scaler_mode_of(meta).unwrap_or_else(|e| {
        f.0.push(e);
        ScalerMode::Poll
    });
    let min = int_annotation(
        &mut f,
        meta,
        MIN_REPLICAS_ANNOTATION,
        0,
        DEFAULT_MEMBER_MIN_REPLICAS,
    );
    let max = int_annotation(
        &mut f,
        meta,
        MAX_REPLICAS_ANNOTATION,
        1,
        DEFAULT_MEMBER_MAX_REPLICAS,
    );
    if min > max {
        f.error(
            Reason::InvalidSpec,
            annotation_field(MIN_REPLICAS_ANNOTATION),
            format!(
                "{min} is above the most replicas ({MAX_REPLICAS_ANNOTATION}: {max}); lower it \
                 or raise {MAX_REPLICAS_ANNOTATION}"
            ),
        );
    }
    let defaults = ScalingSpec::default();
    let target = int_annotation(&mut f, meta, TARGET_ANNOTATION, 1, defaults.target);
    let activation_timeout = match annotation(meta, ACTIVATION_TIMEOUT_ANNOTATION) {
        None => defaults.activation_timeout,
        Some(v) => match Duration::new(v.trim()).get() {
            Ok(d) if !d.is_zero() => Duration::new(v.trim()),
            Ok(_) => {
                f.error(
                    Reason::InvalidSpec,
                    annotation_field(ACTIVATION_TIMEOUT_ANNOTATION),
                    format!("{v:?} must be positive; write a duration like \"5m\" or \"90s\""),
                );
                defaults.activation_timeout
            }
            Err(e) => {
                f.error(
                    Reason::InvalidSpec,
                    annotation_field(ACTIVATION_TIMEOUT_ANNOTATION),
                    format!("{e}; write a duration like \"5m\" or \"90s\""),
                );
                defaults.activation_timeout
            }
        },
    };
    let cold_start = match annotation(meta, COLD_START_ANNOTATION).map(str::trim) {
        None => ColdStartMode::default(),
        Some("keepalive") => ColdStartMode::Keepalive,
        Some("reject") => ColdStartMode::Reject,
        Some(other) => {
            f.error(
                Reason::InvalidSpec,
                annotation_field(COLD_START_ANNOTATION),
                format!(
                    "{other:?} is not a cold-start mode; use keepalive (hold the request while \
                     the model starts) or reject (503 with Retry-After), or remove the \
                     annotation for keepalive"
                ),
            );
            ColdStartMode::default()
        }
    };

    let selector = d.spec.as_ref().map(|s| &s.selector);
    if selector
        .and_then(|s| s.match_labels.as_ref())
        .is_none_or(BTreeMap::is_empty)
    {
        f.error(
            Reason::InvalidSpec,
            "spec.selector.matchLabels",
            "is empty: the Service <name>-hearth that the endpoint's gateway finds the pods \
             through selects them by labels; select the Deployment's pods with matchLabels",
        );
    } else if selector
        .and_then(|s| s.match_expressions.as_ref())
        .is_some_and(|e| !e.is_empty())
    {
        f.warn(
            Reason::FieldIgnored,
            "spec.selector.matchExpressions",
            "the Service <name>-hearth selects pods by spec.selector.matchLabels only: pods of \
             other workloads with those labels would receive this model's requests too; make \
             matchLabels select only this Deployment's pods",
        );
    }

    let member = match (endpoint, model) {
        (Some(endpoint), Some(model)) if !f.blocks_rendering() => Some(DeploymentMember {
            endpoint,
            model,
            scaler,
            min_replicas: min,
            max_replicas: max,
            target,
            activation_timeout,
            cold_start,
        }),
        _ => None,
    };
    MemberCheck {
        member,
        findings: f,
    }
}

/// The port of a Deployment's engine that the Service `<name>-hearth` forwards to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberPort {
    /// The model container's name.
    pub container: String,
    /// The Service port's name, which the gateway finds the engines' port by in the
    /// EndpointSlices: the container port's name, else the runtime's port name, else `http`.
    pub name: String,
    /// The container port: by name when it has one, else by number.
    pub target: IntOrString,
}

/// Which container of `d` serves the model, as the built-in policy `hearth-model-container`
/// chooses it: the one named by [`CONTAINER_ANNOTATION`], else the one named like the runtime's
/// family, else the one exposing the runtime's port, else the only one.
fn model_container<'a>(
    d: &'a Deployment,
    runtime: Option<&InferenceRuntime>,
) -> Result<&'a Container, Finding> {
    let containers: &[Container] = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| p.containers.as_slice())
        .unwrap_or_default();
    let names = || {
        containers
            .iter()
            .map(|c| c.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(named) = annotation(&d.metadata, CONTAINER_ANNOTATION) {
        return containers.iter().find(|c| c.name == named).ok_or_else(|| {
            Finding::new(
                Severity::Error,
                Reason::InvalidSpec,
                annotation_field(CONTAINER_ANNOTATION),
                format!(
                    "names {named:?}, which is not one of the containers [{}]; name the \
                     container that serves the model",
                    names()
                ),
            )
        });
    }
    if let Some(rt) = runtime {
        let family = serde_json::to_value(rt.spec.family)
            .ok()
            .and_then(|v| v.as_str().map(str::to_owned))
            .unwrap_or_default();
        let port = rt.spec.container.port.container_port;
        if let Some(c) = containers.iter().find(|c| c.name == family).or_else(|| {
            containers
                .iter()
                .find(|c| c.ports.iter().flatten().any(|p| p.container_port == port))
        }) {
            return Ok(c);
        }
    }
    match containers {
        [only] => Ok(only),
        _ => Err(Finding::new(
            Severity::Error,
            Reason::InvalidSpec,
            annotation_field(CONTAINER_ANNOTATION),
            format!(
                "cannot tell which of the containers [{}] serves the model: annotate the \
                 Deployment with {CONTAINER_ANNOTATION}: <name>",
                names()
            ),
        )),
    }
}

/// The names a container's engine serves the model under, when its command line says:
/// `--served-model-name` (`=value` or the values that follow it), else `--model`.
fn served_model_names(c: &Container) -> Option<Vec<String>> {
    let words: Vec<&str> = c
        .command
        .iter()
        .flatten()
        .chain(c.args.iter().flatten())
        .flat_map(|w| w.split_whitespace())
        .collect();
    for flag in ["--served-model-name", "--model"] {
        for (i, w) in words.iter().enumerate() {
            if let Some(v) = w.strip_prefix(flag).and_then(|r| r.strip_prefix('=')) {
                return Some(vec![v.to_owned()]);
            }
            if *w == flag {
                let values: Vec<String> = words[i + 1..]
                    .iter()
                    .take_while(|v| !v.starts_with("--"))
                    .map(|v| (*v).to_owned())
                    .collect();
                if !values.is_empty() {
                    // vLLM's --model takes one value; --served-model-name one or more.
                    let n = if flag == "--model" { 1 } else { values.len() };
                    return Some(values.into_iter().take(n).collect());
                }
            }
        }
    }
    None
}

/// What needs the runtime of a Deployment that joins an endpoint (`member`, from
/// [`check_deployment`]; `runtime`, the one its `serving.hearth.dev/runtime` or `vendor`
/// resolves to, `None` when it names none): the container and port that serve the model (an
/// error when there is none), and a warning when the container's command line serves the model
/// under another name than [`MODEL_ANNOTATION`].
pub fn check_member_serving(
    d: &Deployment,
    member: &DeploymentMember,
    runtime: Option<&InferenceRuntime>,
) -> (Option<MemberPort>, Findings) {
    let mut f = Findings::default();
    let container = match model_container(d, runtime) {
        Ok(c) => c,
        Err(e) => {
            f.0.push(e);
            return (None, f);
        }
    };
    let ports: &[ContainerPort] = container.ports.as_deref().unwrap_or_default();
    let by_runtime = runtime.and_then(|rt| {
        let want = &rt.spec.container.port;
        ports
            .iter()
            .find(|p| p.name.as_deref() == Some(want.name.as_str()))
            .or_else(|| {
                ports
                    .iter()
                    .find(|p| p.container_port == want.container_port)
            })
    });
    let port = by_runtime
        .or(ports.first())
        .map(|p| MemberPort {
            container: container.name.clone(),
            name: p
                .name
                .clone()
                .or_else(|| runtime.map(|rt| rt.spec.container.port.name.clone()))
                .unwrap_or_else(|| "http".to_owned()),
            target: match &p.name {
                Some(n) => IntOrString::String(n.clone()),
                None => IntOrString::Int(p.container_port),
            },
        })
        // No port yet: the built-in policy `hearth-serving-defaults` adds the runtime's to the
        // model container at admission.
        .or_else(|| {
            runtime.map(|rt| MemberPort {
                container: container.name.clone(),
                name: rt.spec.container.port.name.clone(),
                target: IntOrString::String(rt.spec.container.port.name.clone()),
            })
        });
    if port.is_none() {
        f.error(
            Reason::InvalidSpec,
            format!("spec.template.spec.containers[{:?}].ports", container.name),
            format!(
                "container {:?} serves the model but declares no port: the endpoint's gateway \
                 finds the engines by the port of the Service <name>-hearth; add the engine's \
                 port (name: http, containerPort: 8000), or name an InferenceRuntime with \
                 {RUNTIME_ANNOTATION}",
                container.name
            ),
        );
    }
    if let Some(served) = served_model_names(container)
        && !served.contains(&member.model)
    {
        f.warn(
            Reason::FieldIgnored,
            annotation_field(MODEL_ANNOTATION),
            format!(
                "is {:?}, but container {:?} serves the model as {:?} (its command line): \
                 clients send the annotation's name and the gateway forwards it unchanged, so \
                 the engine would answer 404; make them equal (--served-model-name)",
                member.model,
                container.name,
                served.join(" ")
            ),
        );
    }
    (port, f)
}

/// A warning for a workload other than a Deployment (a StatefulSet, a Pod) carrying
/// [`ENDPOINT_ANNOTATION`]: only Deployments join endpoints.
pub fn endpoint_annotation_ignored(kind: &str, meta: &ObjectMeta) -> Option<Finding> {
    (kind != "Deployment" && annotation(meta, ENDPOINT_ANNOTATION).is_some()).then(|| {
        Finding::new(
            Severity::Warning,
            Reason::FieldIgnored,
            annotation_field(ENDPOINT_ANNOTATION),
            format!(
                "has no effect on a {kind}: only Deployments join an LLMEndpoint (KEDA scales \
                 them to zero); remove it, or serve the model from a Deployment"
            ),
        )
    })
}

fn object_name(f: &mut Findings, field: &str, name: &str) {
    if !is_dns1123_subdomain(name) {
        f.error(
            Reason::InvalidSpec,
            field,
            format!(
                "{name:?} is not a valid object name (lowercase letters, digits, '-' and '.', \
                 starting and ending alphanumeric, at most 253)"
            ),
        );
    }
}

fn quantity(f: &mut Findings, field: &str, q: &Quantity, example: &str) {
    let v = q.0.as_str();
    if !is_quantity(v) {
        f.error(
            Reason::InvalidSpec,
            field,
            format!("{v:?} is not a quantity; write it like {example}"),
        );
    } else if is_negative(v) {
        f.error(
            Reason::InvalidSpec,
            field,
            format!("{v:?} is negative; write an amount like {example}"),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn service(patch: serde_json::Value) -> LLMService {
        let mut v = serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMService",
            "metadata": {"name": "qwen", "namespace": "ml"},
            "spec": {"model": {"source": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}}, "cache": {"size": "30Gi"}}
        });
        if let (Some(spec), serde_json::Value::Object(p)) = (v["spec"].as_object_mut(), patch) {
            spec.extend(p);
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn a_plain_service_has_no_finding() {
        assert!(check_llmservice(&service(serde_json::json!({})), None).is_empty());
    }

    #[test]
    fn errors_block_and_carry_their_condition() {
        let f = check_llmservice(
            &service(
                serde_json::json!({"cache": {"strategy": "BakedImage"}, "endpoint": {"openAICompatible": false}}),
            ),
            None,
        );
        assert!(f.blocks_rendering());
        let e = f.first_error().unwrap();
        assert_eq!(e.reason, Reason::StrategyNotImplemented);
        assert_eq!(e.reason.condition_type(), "CacheReady");
        assert_eq!(f.warnings().count(), 1);
        assert!(
            f.to_string()
                .starts_with("spec.cache.strategy: BakedImage is reserved"),
            "{f}"
        );
    }

    #[test]
    fn a_shared_pvc_needs_the_prewarm_and_an_hf_model() {
        let ok = service(serde_json::json!({"cache": {"strategy": "SharedPVC", "prewarm": true}}));
        assert!(check_llmservice(&ok, None).is_empty());
        let f = check_llmservice(
            &service(serde_json::json!({"cache": {"strategy": "SharedPVC"}})),
            None,
        );
        assert!(
            f.to_string()
                .starts_with("spec.cache.prewarm: must be true with strategy SharedPVC"),
            "{f}"
        );
        let f = check_llmservice(
            &service(serde_json::json!({
                "model": {"source": {"uri": "modelscope://Qwen/Qwen2.5-0.5B-Instruct"}},
                "cache": {"strategy": "SharedPVC", "prewarm": true},
            })),
            None,
        );
        assert!(f.blocks_rendering());
        assert!(
            f.to_string()
                .starts_with("spec.cache.strategy: SharedPVC serves hf:// models"),
            "{f}"
        );
        // A pvc:// model brings its own claim: the cache is not used, as for NodeLocalPVC.
        let pvc = service(serde_json::json!({
            "model": {"source": {"uri": "pvc://weights/qwen"}},
            "cache": {"strategy": "SharedPVC"},
        }));
        assert!(!check_llmservice(&pvc, None).blocks_rendering());
    }

    #[test]
    fn scaler_modes() {
        let mut svc = service(serde_json::json!({}));
        assert_eq!(scaler_mode(&svc), Ok(ScalerMode::Poll));
        for (value, want) in [
            ("", Some(ScalerMode::Poll)),
            ("push", Some(ScalerMode::Push)),
            ("Push", None),
        ] {
            svc.metadata.annotations =
                Some([(SCALER_ANNOTATION.to_owned(), value.to_owned())].into());
            assert_eq!(scaler_mode(&svc).ok(), want, "{value:?}");
        }
    }

    fn windows(windows: serde_json::Value) -> LLMService {
        service(serde_json::json!({"scaling": {"min": 0, "max": 3, "warmWindows": windows}}))
    }

    fn window(tz: &str, start: &str, end: &str, replicas: i32) -> serde_json::Value {
        serde_json::json!({"timezone": tz, "start": start, "end": end, "replicas": replicas})
    }

    #[test]
    fn min_above_max_is_an_error_naming_min() {
        let svc = service(serde_json::json!({"scaling": {"min": 3, "max": 2}}));
        let f = check_llmservice(&svc, None);
        assert!(
            f.to_string().contains("spec.scaling.min")
                && f.to_string().contains("exceeds scaling.max (2)"),
            "{f}"
        );
    }

    #[rstest::rstest]
    #[case::business_hours(window("Europe/Berlin", "0 8 * * MON-FRI", "0 18 * * MON-FRI", 1))]
    #[case::over_midnight(window("Asia/Shanghai", "30 22 * * *", "0 6 * * *", 3))]
    #[case::utc(window("UTC", "0 9 * * 1-5", "0 17 * * 1-5", 2))]
    #[case::legacy_zone_name(window("US/Eastern", "0 9 * * *", "0 17 * * *", 1))]
    #[case::two_a_day(window("UTC", "0 8,13 * * *", "0 12,18 * * *", 1))]
    #[case::weeknights(window("UTC", "0 22 * * MON-FRI", "0 6 * * TUE-SAT", 1))]
    #[case::month_end(window("UTC", "0 0 1 * *", "0 0 2 * *", 1))]
    fn good_warm_windows_have_no_finding(#[case] w: serde_json::Value) {
        let f = check_llmservice(&windows(serde_json::json!([w])), None);
        assert!(f.is_empty(), "{f}");
    }

    #[rstest::rstest]
    #[case::unknown_zone(
        window("Mars/Olympus", "0 8 * * *", "0 18 * * *", 1),
        "timezone",
        "is not an IANA time zone name"
    )]
    #[case::zone_case(
        window("europe/berlin", "0 8 * * *", "0 18 * * *", 1),
        "timezone",
        "case-sensitive"
    )]
    #[case::go_local(
        window("Local", "0 8 * * *", "0 18 * * *", 1),
        "timezone",
        "is not an IANA time zone name"
    )]
    #[case::empty_zone(
        window("", "0 8 * * *", "0 18 * * *", 1),
        "timezone",
        "is not an IANA time zone name"
    )]
    #[case::seconds_field(
        window("UTC", "0 0 8 * * *", "0 18 * * *", 1),
        "start",
        "it has 6 fields"
    )]
    #[case::descriptor(window("UTC", "0 8 * * *", "@midnight", 1), "end", "descriptors")]
    #[case::tz_prefix(
        window("UTC", "CRON_TZ=UTC 0 8 * * *", "0 18 * * *", 1),
        "start",
        "TZ= or CRON_TZ="
    )]
    #[case::sunday_seven(window("UTC", "0 8 * * 1-7", "0 18 * * *", 1), "start", "Sunday is 0")]
    #[case::same_text(
        window("UTC", "0 8 * * *", "0 8 * * *", 1),
        "end",
        "both fire at Sat 2000-01-01 08:00"
    )]
    #[case::same_schedule(
        window("UTC", "0 8 * * 1-5", "00 08 * * MON-FRI", 1),
        "end",
        "both fire at"
    )]
    #[case::every_day_is_every_weekday(
        window("UTC", "0 8 * * *", "0 8 * * 0-6", 1),
        "end",
        "both fire at"
    )]
    #[case::weekday_start_daily_end(
        window("UTC", "0 8 * * MON-FRI", "0 18 * * *", 1),
        "end",
        "end fires at Sat 2000-01-01 18:00 and again at Sun 2000-01-02 18:00"
    )]
    #[case::two_starts_one_end(
        window("UTC", "0 8,9 * * *", "0 18 * * *", 1),
        "end",
        "start fires at Sat 2000-01-01 08:00 and again at Sat 2000-01-01 09:00"
    )]
    #[case::monthly_start_daily_end(
        window("UTC", "0 8 1 * *", "0 18 * * *", 1),
        "end",
        "end fires at"
    )]
    #[case::zero_replicas(
        window("UTC", "0 8 * * *", "0 18 * * *", 0),
        "replicas",
        "keeps nothing warm"
    )]
    #[case::above_max(
        window("UTC", "0 8 * * *", "0 18 * * *", 4),
        "replicas",
        "exceeds scaling.max (3)"
    )]
    fn bad_warm_windows_are_errors_naming_the_field(
        #[case] w: serde_json::Value,
        #[case] field: &str,
        #[case] message: &str,
    ) {
        let ok = window("UTC", "0 8 * * *", "0 18 * * *", 1);
        let f = check_llmservice(&windows(serde_json::json!([ok, w])), None);
        let e = f.first_error().unwrap_or_else(|| panic!("no error: {f}"));
        assert_eq!(
            e.field,
            format!("spec.scaling.warmWindows[1].{field}"),
            "{f}"
        );
        assert_eq!(e.reason, Reason::InvalidSpec);
        assert!(e.message.contains(message), "{f}");
        assert_eq!(f.errors().count(), 1, "{f}");
    }

    #[test]
    fn a_window_at_or_below_min_is_a_warning() {
        let mut svc = windows(serde_json::json!([window(
            "UTC",
            "0 8 * * *",
            "0 18 * * *",
            2
        )]));
        svc.spec.scaling.min = 2;
        let f = check_llmservice(&svc, None);
        assert!(!f.blocks_rendering(), "{f}");
        let w = f.warnings().next().unwrap();
        assert_eq!(
            (w.field.as_str(), w.reason),
            ("spec.scaling.warmWindows[0].replicas", Reason::FieldIgnored)
        );
    }

    #[test]
    fn at_most_ten_windows() {
        let w = window("UTC", "0 8 * * *", "0 18 * * *", 1);
        let f = check_llmservice(
            &windows(serde_json::Value::Array(vec![w; MAX_WARM_WINDOWS + 1])),
            None,
        );
        assert_eq!(
            f.first_error().map(|e| e.field.as_str()),
            Some("spec.scaling.warmWindows")
        );
    }

    #[test]
    fn never_panics_on_odd_names() {
        for name in [
            "ü".repeat(40),
            "a".repeat(300),
            "-".to_owned(),
            "é".to_owned(),
        ] {
            let mut svc = service(serde_json::json!({}));
            svc.metadata.name = Some(name.clone());
            let f = check_llmservice(&svc, None);
            assert_eq!(
                f.first_error().map(|e| e.field.as_str()),
                Some("metadata.name"),
                "{name}"
            );
        }
    }
    fn sleepy_runtime(levels: serde_json::Value) -> InferenceRuntime {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "InferenceRuntime",
            "metadata": {"name": "vllm"},
            "spec": {
                "vendor": "nvidia",
                "container": {"image": "vllm/vllm-openai:v0.11.0"},
                "accelerator": {"resourceName": "nvidia.com/gpu"},
                "sleepMode": {"levels": levels, "args": ["--enable-sleep-mode"]}
            }
        }))
        .unwrap()
    }

    fn sleeping(scaling: serde_json::Value) -> LLMService {
        service(serde_json::json!({ "scaling": scaling }))
    }

    #[test]
    fn a_supported_sleep_level_gives_the_tier_with_its_wake_up() {
        let rt = sleepy_runtime(serde_json::json!([
            {"level": 1},
            {"level": 2, "wakeUp": [
                {"path": "/wake_up?tags=weights"},
                {"path": "/collective_rpc", "body": "{\"method\":\"reload_weights\"}"},
                {"path": "/wake_up?tags=kv_cache"}
            ]}
        ]));
        let svc = sleeping(serde_json::json!({"sleep": {"after": "2m"}}));
        let tier = sleep_tier(&svc, Some(&rt)).unwrap().unwrap();
        assert_eq!(tier.after, std::time::Duration::from_secs(120));
        assert_eq!(tier.level, 1);
        assert_eq!(tier.mode.sleep_path, "/sleep");
        assert_eq!(tier.mode.is_sleeping_path, "/is_sleeping");
        let paths: Vec<&str> = tier.wake_up.iter().map(|c| c.path.as_str()).collect();
        assert_eq!(paths, ["/wake_up"]);
        let svc = sleeping(serde_json::json!({"sleep": {"after": "2m", "level": 2}}));
        let tier = sleep_tier(&svc, Some(&rt)).unwrap().unwrap();
        assert_eq!(tier.wake_up.len(), 3);
        assert!(check_llmservice(&svc, Some(&rt)).is_empty());
        // No sleep asked, or no runtime yet: no tier, no finding.
        assert_eq!(
            sleep_tier(&service(serde_json::json!({})), Some(&rt)),
            Ok(None)
        );
        assert_eq!(sleep_tier(&svc, None), Ok(None));
    }

    #[rstest::rstest]
    #[case::zero(serde_json::json!({"sleep": {"after": "0s"}}), "spec.scaling.sleep.after", Severity::Error, "must be positive")]
    #[case::not_a_duration(serde_json::json!({"sleep": {"after": "soon"}}), "spec.scaling.sleep.after", Severity::Error, "write a duration")]
    #[case::level_unsupported(serde_json::json!({"sleep": {"after": "2m", "level": 2}}), "spec.scaling.sleep.level", Severity::Warning, "supports sleep level 1 only")]
    #[case::zero_first(serde_json::json!({"sleep": {"after": "5m"}}), "spec.scaling.sleep.after", Severity::Warning, "scales to zero after scaleDownStabilization (5m)")]
    #[case::zero_first_longer(serde_json::json!({"scaleDownStabilization": "60s", "sleep": {"after": "2m"}}), "spec.scaling.sleep.after", Severity::Warning, "before it would sleep")]
    fn sleep_findings_name_the_field(
        #[case] scaling: serde_json::Value,
        #[case] field: &str,
        #[case] severity: Severity,
        #[case] message: &str,
    ) {
        let rt = sleepy_runtime(serde_json::json!([{"level": 1}]));
        let svc = sleeping(scaling);
        let finding = sleep_tier(&svc, Some(&rt)).unwrap_err();
        assert_eq!(finding.field, field);
        assert_eq!(finding.severity, severity);
        assert!(finding.message.contains(message), "{finding}");
        assert!(check_llmservice(&svc, Some(&rt)).0.contains(&finding));
    }

    #[test]
    fn sleep_with_min_above_zero_or_warm_windows_is_kept() {
        let rt = sleepy_runtime(serde_json::json!([{"level": 1}]));
        let svc = sleeping(serde_json::json!({"min": 1, "max": 2, "sleep": {"after": "10m"}}));
        assert!(sleep_tier(&svc, Some(&rt)).unwrap().is_some());
        let svc = sleeping(
            serde_json::json!({"min": 0, "max": 2, "sleep": {"after": "10m"},
            "warmWindows": [{"timezone": "UTC", "start": "0 8 * * *", "end": "0 18 * * *", "replicas": 1}]}),
        );
        assert!(sleep_tier(&svc, Some(&rt)).unwrap().is_some());
    }

    #[test]
    fn a_runtime_without_sleep_mode_makes_sleep_a_warning() {
        let mut rt = sleepy_runtime(serde_json::json!([{"level": 1}]));
        rt.spec.sleep_mode = None;
        let svc = sleeping(serde_json::json!({"sleep": {"after": "2m"}}));
        let finding = sleep_tier(&svc, Some(&rt)).unwrap_err();
        assert_eq!(finding.field, "spec.scaling.sleep");
        assert_eq!(finding.reason, Reason::FieldIgnored);
        assert!(
            finding.message.contains("declares no sleep mode"),
            "{finding}"
        );
        assert!(!check_llmservice(&svc, Some(&rt)).blocks_rendering());
    }

    #[test]
    fn a_wake_up_the_gateway_cannot_send_makes_sleep_a_warning() {
        for call in [
            serde_json::json!({"path": "/collective_rpc", "body": "{method: reload_weights}"}),
            serde_json::json!({"path": "/a<b>"}),
        ] {
            let rt = sleepy_runtime(serde_json::json!([{"level": 1, "wakeUp": [call]}]));
            let svc = sleeping(serde_json::json!({"sleep": {"after": "2m"}}));
            let finding = sleep_tier(&svc, Some(&rt)).unwrap_err();
            assert_eq!(finding.reason, Reason::FieldIgnored);
            assert!(finding.message.contains("wakeUp[0]"), "{finding}");
        }
    }

    #[rstest::rstest]
    #[case::bad_name(serde_json::json!([{"name": "Team_A", "apiKeySecretRef": {"name": "k"}}]), "spec.tenants[0].name", "DNS label")]
    #[case::twice(serde_json::json!([{"name": "a", "apiKeySecretRef": {"name": "k"}}, {"name": "a", "apiKeySecretRef": {"name": "j"}}]), "spec.tenants[1].name", "listed twice")]
    #[case::no_keys(serde_json::json!([{"name": "a"}]), "spec.tenants[0].apiKeySecretRef", "is required")]
    #[case::band(serde_json::json!([{"name": "a", "apiKeySecretRef": {"name": "k"}, "priority": 1001}]), "spec.tenants[0].priority", "between -1000 and 1000")]
    #[case::quota(serde_json::json!([{"name": "default", "tokensPerMinute": 0}]), "spec.tenants[0].tokensPerMinute", "not positive")]
    fn a_bad_tenant_names_its_field(
        #[case] tenants: serde_json::Value,
        #[case] field: &str,
        #[case] says: &str,
    ) {
        let f = check_llmendpoint(&endpoint(serde_json::json!({"tenants": tenants})));
        let e = f.errors().next().unwrap_or_else(|| panic!("accepted: {f}"));
        assert_eq!(e.field, field, "{f}");
        assert!(e.message.contains(says), "{f}");
    }

    #[test]
    fn container_concurrency_is_the_field_else_the_engines_max_num_seqs() {
        let mut svc = sleeping(serde_json::json!({}));
        assert_eq!(container_concurrency(&svc, None), None);
        svc.spec.runtime.args_override = vec!["--max-num-seqs".into(), "64".into()];
        assert_eq!(container_concurrency(&svc, None), Some(64));
        svc.spec
            .runtime
            .args_override
            .push("--max-num-seqs=32".into());
        assert_eq!(container_concurrency(&svc, None), Some(32));
        svc.spec.endpoint.container_concurrency = Some(8);
        assert_eq!(container_concurrency(&svc, None), Some(8));
    }

    fn endpoint(patch: serde_json::Value) -> LLMEndpoint {
        let mut v = serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMEndpoint",
            "metadata": {"name": "shared", "namespace": "ml"},
            "spec": {}
        });
        if let (Some(spec), serde_json::Value::Object(p)) = (v["spec"].as_object_mut(), patch) {
            spec.extend(p);
        }
        serde_json::from_value(v).unwrap()
    }

    #[rstest::rstest]
    #[case::defaults(serde_json::json!({}))]
    #[case::all(serde_json::json!({"allowedServices": {"namespaces": {"from": "All"}}, "replicas": 3}))]
    #[case::selector(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {
        "matchLabels": {"team": "ml"},
        "matchExpressions": [
            {"key": "env", "operator": "In", "values": ["prod", "staging"]},
            {"key": "example.com/tier", "operator": "NotIn", "values": ["test"]},
            {"key": "hearth", "operator": "Exists"},
            {"key": "legacy", "operator": "DoesNotExist", "values": []},
        ]}}}}))]
    #[case::empty_selector_selects_all(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {}}}}))]
    fn good_endpoints_have_no_finding(#[case] spec: serde_json::Value) {
        let f = check_llmendpoint(&endpoint(spec));
        assert!(f.is_empty(), "{f}");
    }

    #[rstest::rstest]
    #[case::selector_missing(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector"}}}), "spec.allowedServices.namespaces.selector", "is required with from: Selector")]
    #[case::selector_without_from(serde_json::json!({"allowedServices": {"namespaces": {"selector": {"matchLabels": {"a": "b"}}}}}), "spec.allowedServices.namespaces.selector", "only used with from: Selector, and from is Same")]
    #[case::bad_operator(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["b"]}]}}}}), "spec.allowedServices.namespaces.selector.matchExpressions[0].operator", "use In, NotIn, Exists or DoesNotExist")]
    #[case::in_without_values(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}}}), "spec.allowedServices.namespaces.selector.matchExpressions[0].values", "must not be empty with operator In")]
    #[case::exists_with_values(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["b"]}]}}}}), "spec.allowedServices.namespaces.selector.matchExpressions[0].values", "must be empty with operator Exists")]
    #[case::bad_key(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchLabels": {"bad key": "b"}}}}}), "spec.allowedServices.namespaces.selector.matchLabels[\"bad key\"]", "the key")]
    #[case::bad_value(serde_json::json!({"allowedServices": {"namespaces": {"from": "Selector", "selector": {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["no spaces"]}]}}}}), "spec.allowedServices.namespaces.selector.matchExpressions[0].values[0]", "is not a label value")]
    #[case::replicas_zero(serde_json::json!({"replicas": 0}), "spec.replicas", "between 1 and 20")]
    #[case::replicas_many(serde_json::json!({"replicas": 21}), "spec.replicas", "between 1 and 20")]
    fn bad_endpoints_are_errors_naming_the_field(
        #[case] spec: serde_json::Value,
        #[case] field: &str,
        #[case] message: &str,
    ) {
        let f = check_llmendpoint(&endpoint(spec));
        let e = f.first_error().unwrap_or_else(|| panic!("no error: {f}"));
        assert_eq!(e.field, field, "{f}");
        assert!(e.message.contains(message), "{f}");
        assert_eq!(f.errors().count(), 1, "{f}");
    }

    #[test]
    fn endpoint_names_and_scaler_annotation() {
        let mut ep = endpoint(serde_json::json!({}));
        ep.metadata.name = Some("a".repeat(MAX_ENDPOINT_NAME_LEN + 1));
        let f = check_llmendpoint(&ep);
        assert_eq!(
            f.first_error().map(|e| e.field.as_str()),
            Some("metadata.name")
        );
        ep.metadata.name = Some("1st".to_owned());
        assert!(check_llmendpoint(&ep).to_string().contains("cannot name"));
        ep.metadata.name = Some("a".repeat(MAX_ENDPOINT_NAME_LEN));
        assert!(check_llmendpoint(&ep).is_empty());
        ep.metadata.annotations = Some([(SCALER_ANNOTATION.to_owned(), "Push".to_owned())].into());
        assert!(check_llmendpoint(&ep).blocks_rendering());
        ep.metadata.annotations = Some([(SCALER_ANNOTATION.to_owned(), "push".to_owned())].into());
        assert_eq!(scaler_mode_of(&ep.metadata), Ok(ScalerMode::Push));
    }

    #[test]
    fn a_shared_endpoint_ref_warns_about_own_gateway_fields() {
        let svc =
            service(serde_json::json!({"endpoint": {"sharedEndpointRef": {"name": "shared"}}}));
        assert!(check_llmservice(&svc, None).is_empty());
        let svc = service(serde_json::json!({"endpoint": {
            "sharedEndpointRef": {"name": "shared", "namespace": "platform"},
            "replicas": 2,
            "apiKeySecretRef": {"name": "keys"},
        }}));
        let f = check_llmservice(&svc, None);
        assert!(!f.blocks_rendering(), "{f}");
        let fields: Vec<_> = f.warnings().map(|w| (w.field.as_str(), w.reason)).collect();
        assert_eq!(
            fields,
            [
                ("spec.endpoint.replicas", Reason::FieldIgnored),
                ("spec.endpoint.apiKeySecretRef", Reason::FieldIgnored)
            ]
        );
        assert!(
            f.warnings().all(|w| w
                .message
                .starts_with("applies only while the service has its own gateway")),
            "{f}"
        );
        // Without a reference they are the service's own gateway's: no warning.
        let svc = service(serde_json::json!({"endpoint": {"replicas": 2}}));
        assert!(check_llmservice(&svc, None).is_empty());
        let svc = service(
            serde_json::json!({"endpoint": {"sharedEndpointRef": {"name": "Shared", "namespace": "-x"}}}),
        );
        let errors: Vec<_> = check_llmservice(&svc, None)
            .errors()
            .map(|e| e.field.clone())
            .collect();
        assert_eq!(
            errors,
            [
                "spec.endpoint.sharedEndpointRef.name",
                "spec.endpoint.sharedEndpointRef.namespace"
            ]
        );
    }

    /// A Deployment `team-a/vllm-qwen` with `annotations` and one container `vllm` serving on
    /// port `http` 8000 under `--served-model-name qwen`, with `patch` merged.
    fn deployment(annotations: serde_json::Value, patch: serde_json::Value) -> Deployment {
        let mut d = serde_json::json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": "vllm-qwen", "namespace": "team-a", "annotations": annotations},
            "spec": {
                "selector": {"matchLabels": {"app": "qwen"}},
                "template": {
                    "metadata": {"labels": {"app": "qwen"}},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.5",
                        "args": ["--model", "Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen"],
                        "ports": [{"name": "http", "containerPort": 8000}]}]},
                },
            },
        });
        merge(&mut d, patch);
        serde_json::from_value(d).unwrap()
    }

    fn merge(a: &mut serde_json::Value, b: serde_json::Value) {
        match (a, b) {
            (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
                for (k, v) in b {
                    if v.is_null() {
                        a.remove(&k);
                    } else {
                        merge(a.entry(k).or_insert(serde_json::Value::Null), v);
                    }
                }
            }
            (a, b) => *a = b,
        }
    }

    fn joining(extra: serde_json::Value) -> serde_json::Value {
        let mut a = serde_json::json!({
            "serving.hearth.dev/endpoint": "platform/shared",
            "serving.hearth.dev/model": "qwen",
        });
        merge(&mut a, extra);
        a
    }

    #[test]
    fn a_joining_deployment_gets_the_llmservice_defaults() {
        let c = check_deployment(&deployment(
            joining(serde_json::json!({})),
            serde_json::json!({}),
        ));
        assert!(c.findings.is_empty(), "{}", c.findings);
        let m = c.member.unwrap();
        assert_eq!(
            m,
            DeploymentMember {
                endpoint: EndpointReference {
                    name: "shared".into(),
                    namespace: Some("platform".into())
                },
                model: "qwen".into(),
                scaler: ScalerMode::Poll,
                min_replicas: 0,
                max_replicas: 1,
                target: 10,
                activation_timeout: Duration::new("5m"),
                cold_start: ColdStartMode::Keepalive,
            }
        );
        let s = m.scaling();
        let d = ScalingSpec::default();
        assert_eq!(
            (
                s.min,
                s.max,
                s.target,
                &s.activation_timeout,
                &s.scale_down_stabilization
            ),
            (
                d.min,
                d.max,
                d.target,
                &d.activation_timeout,
                &d.scale_down_stabilization
            )
        );
        assert_eq!(m.cold_start(), ColdStartSpec::default());
        // Every annotation set.
        let c = check_deployment(&deployment(
            serde_json::json!({
                "serving.hearth.dev/endpoint": "shared",
                "serving.hearth.dev/model": "Qwen/Qwen2.5-7B-Instruct",
                "serving.hearth.dev/scaler": "push",
                "serving.hearth.dev/min-replicas": "1",
                "serving.hearth.dev/max-replicas": "3",
                "serving.hearth.dev/target": "4",
                "serving.hearth.dev/activation-timeout": "90s",
                "serving.hearth.dev/cold-start": "reject",
            }),
            serde_json::json!({}),
        ));
        let m = c.member.unwrap();
        assert_eq!(m.endpoint.namespace, None);
        assert_eq!(
            (
                m.scaler,
                m.min_replicas,
                m.max_replicas,
                m.target,
                m.activation_timeout.as_str(),
                m.cold_start
            ),
            (ScalerMode::Push, 1, 3, 4, "90s", ColdStartMode::Reject)
        );
    }

    #[rstest::rstest]
    #[case::no_model(serde_json::json!({"serving.hearth.dev/model": null}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/model\"]", "is required with serving.hearth.dev/endpoint: set it to the name the engine serves the model under")]
    #[case::empty_model(serde_json::json!({"serving.hearth.dev/model": ""}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/model\"]", "\"\" is not a model name")]
    #[case::spaced_model(serde_json::json!({"serving.hearth.dev/model": "qwen 7b"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/model\"]", "\"qwen 7b\" is not a model name")]
    #[case::bad_endpoint(serde_json::json!({"serving.hearth.dev/endpoint": "Platform/shared"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/endpoint\"]", "\"Platform/shared\" names the namespace \"Platform\", which is not a namespace name")]
    #[case::endpoint_name(serde_json::json!({"serving.hearth.dev/endpoint": "9shared"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/endpoint\"]", "\"9shared\" does not name an LLMEndpoint")]
    #[case::negative_min(serde_json::json!({"serving.hearth.dev/min-replicas": "-1"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/min-replicas\"]", "\"-1\" is not a whole number of at least 0; write one like \"0\", or remove the annotation for the default (0)")]
    #[case::zero_max(serde_json::json!({"serving.hearth.dev/max-replicas": "0"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/max-replicas\"]", "\"0\" is not a whole number of at least 1")]
    #[case::min_above_max(serde_json::json!({"serving.hearth.dev/min-replicas": "2"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/min-replicas\"]", "2 is above the most replicas (serving.hearth.dev/max-replicas: 1); lower it or raise serving.hearth.dev/max-replicas")]
    #[case::target(serde_json::json!({"serving.hearth.dev/target": "ten"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/target\"]", "\"ten\" is not a whole number of at least 1")]
    #[case::timeout(serde_json::json!({"serving.hearth.dev/activation-timeout": "5 minutes"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/activation-timeout\"]", "write a duration like \"5m\" or \"90s\"")]
    #[case::zero_timeout(serde_json::json!({"serving.hearth.dev/activation-timeout": "0s"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/activation-timeout\"]", "\"0s\" must be positive")]
    #[case::cold_start(serde_json::json!({"serving.hearth.dev/cold-start": "Hold"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/cold-start\"]", "\"Hold\" is not a cold-start mode; use keepalive")]
    #[case::scaler(serde_json::json!({"serving.hearth.dev/scaler": "pull"}), serde_json::json!({}), "metadata.annotations[\"serving.hearth.dev/scaler\"]", "\"pull\" is not a scaler mode")]
    #[case::name(serde_json::json!({}), serde_json::json!({"metadata": {"name": "vllm.qwen"}}), "metadata.name", "\"vllm.qwen\" cannot join an endpoint: the Service <name>-hearth")]
    #[case::long_name(serde_json::json!({}), serde_json::json!({"metadata": {"name": "a".repeat(57)}}), "metadata.name", "must be one of at most 56 characters")]
    #[case::no_match_labels(serde_json::json!({}), serde_json::json!({"spec": {"selector": {"matchLabels": null, "matchExpressions": [{"key": "app", "operator": "Exists"}]}}}), "spec.selector.matchLabels", "is empty")]
    #[case::an_llmservices_backend(serde_json::json!({}), serde_json::json!({"metadata": {"ownerReferences": [{"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService", "name": "qwen", "uid": "u", "controller": true}]}}), "metadata.annotations[\"serving.hearth.dev/endpoint\"]", "this Deployment is the backend of LLMService \"qwen\", which joins an endpoint with its spec.endpoint.sharedEndpointRef")]
    fn a_bad_value_names_the_annotation_and_the_fix(
        #[case] annotations: serde_json::Value,
        #[case] patch: serde_json::Value,
        #[case] field: &str,
        #[case] message: &str,
    ) {
        let c = check_deployment(&deployment(joining(annotations), patch));
        assert!(c.member.is_none());
        let e = c.findings.first_error().unwrap();
        assert_eq!(
            (e.field.as_str(), e.reason),
            (field, Reason::InvalidSpec),
            "{}",
            c.findings
        );
        assert!(e.message.contains(message), "{}", e.message);
        assert_eq!(c.findings.errors().count(), 1, "{}", c.findings);
    }

    #[test]
    fn member_annotations_without_the_endpoint_and_loose_selectors_are_warnings() {
        let c = check_deployment(&deployment(
            serde_json::json!({"serving.hearth.dev/model": "qwen", "serving.hearth.dev/max-replicas": "2"}),
            serde_json::json!({}),
        ));
        assert!(c.member.is_none());
        let w: Vec<&str> = c.findings.warnings().map(|f| f.field.as_str()).collect();
        assert_eq!(
            w,
            [
                "metadata.annotations[\"serving.hearth.dev/model\"]",
                "metadata.annotations[\"serving.hearth.dev/max-replicas\"]"
            ]
        );
        assert!(!c.findings.blocks_rendering());
        // Nothing Hearth reads: nothing said.
        let c = check_deployment(&deployment(serde_json::json!({}), serde_json::json!({})));
        assert_eq!(c, MemberCheck::default());
        // matchExpressions next to matchLabels: the Service selects by the labels only.
        let c = check_deployment(&deployment(
            joining(serde_json::json!({})),
            serde_json::json!({"spec": {"selector": {"matchExpressions": [{"key": "tier", "operator": "Exists"}]}}}),
        ));
        assert!(c.member.is_some());
        let w: Vec<&str> = c.findings.warnings().map(|f| f.field.as_str()).collect();
        assert_eq!(w, ["spec.selector.matchExpressions"]);
        // Only Deployments join.
        let meta: ObjectMeta = serde_json::from_value(
            serde_json::json!({"annotations": {"serving.hearth.dev/endpoint": "shared"}}),
        )
        .unwrap();
        assert!(endpoint_annotation_ignored("Deployment", &meta).is_none());
        let w = endpoint_annotation_ignored("StatefulSet", &meta).unwrap();
        assert!(
            w.message
                .starts_with("has no effect on a StatefulSet: only Deployments join"),
            "{w}"
        );
    }

    fn runtime(port_name: &str, port: i32) -> InferenceRuntime {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "InferenceRuntime",
            "metadata": {"name": "rt"},
            "spec": {"vendor": "nvidia",
                     "container": {"image": "vllm", "port": {"name": port_name, "containerPort": port}},
                     "accelerator": {"resourceName": "nvidia.com/gpu"}},
        }))
        .unwrap()
    }

    #[test]
    fn the_serving_container_port_and_name_are_checked() {
        let member = |d: &Deployment| check_deployment(d).member.unwrap();
        let plain = deployment(joining(serde_json::json!({})), serde_json::json!({}));
        let (port, f) = check_member_serving(&plain, &member(&plain), None);
        assert!(f.is_empty(), "{f}");
        assert_eq!(
            port.unwrap(),
            MemberPort {
                container: "vllm".into(),
                name: "http".into(),
                target: IntOrString::String("http".into())
            }
        );
        // The runtime's port by name, else by number (named as the container names it).
        let two_ports = deployment(
            joining(serde_json::json!({})),
            serde_json::json!({"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "vllm",
                "ports": [{"name": "metrics", "containerPort": 9100}, {"containerPort": 8000}]}]}}}}),
        );
        let (port, _) =
            check_member_serving(&two_ports, &member(&two_ports), Some(&runtime("api", 8000)));
        assert_eq!(
            port.unwrap(),
            MemberPort {
                container: "vllm".into(),
                name: "api".into(),
                target: IntOrString::Int(8000)
            }
        );
        let (port, _) = check_member_serving(&two_ports, &member(&two_ports), None);
        assert_eq!(port.unwrap().name, "metrics");
        // No port: an error naming the container and the port to add.
        let none = deployment(
            joining(serde_json::json!({})),
            serde_json::json!({"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "vllm", "ports": null}]}}}}),
        );
        let (port, f) = check_member_serving(&none, &member(&none), None);
        assert!(port.is_none());
        assert_eq!(
            f.first_error().unwrap().to_string(),
            "spec.template.spec.containers[\"vllm\"].ports: container \"vllm\" serves the model but declares no port: the endpoint's gateway finds the engines by the port of the Service <name>-hearth; add the engine's port (name: http, containerPort: 8000), or name an InferenceRuntime with serving.hearth.dev/runtime"
        );
        // With a runtime, its port: the built-in serving defaults add it at admission.
        let (port, f) = check_member_serving(&none, &member(&none), Some(&runtime("api", 8000)));
        assert!(f.is_empty(), "{f}");
        assert_eq!(
            port.unwrap(),
            MemberPort {
                container: "vllm".into(),
                name: "api".into(),
                target: IntOrString::String("api".into())
            }
        );
        // The container annotation names one that is not there.
        let named = deployment(
            joining(serde_json::json!({"serving.hearth.dev/container": "engine"})),
            serde_json::json!({}),
        );
        let (_, f) = check_member_serving(&named, &member(&named), None);
        assert_eq!(
            f.first_error().unwrap().field,
            "metadata.annotations[\"serving.hearth.dev/container\"]"
        );
        // Served under another name: a warning naming both.
        for (args, warns) in [
            (
                serde_json::json!(["--served-model-name", "qwen", "qwen-chat"]),
                false,
            ),
            (serde_json::json!(["--served-model-name=qwen"]), false),
            (serde_json::json!(["--served-model-name=other"]), true),
            (serde_json::json!(["--model", "qwen"]), false),
            (
                serde_json::json!(["--model=Qwen/Qwen2.5-7B-Instruct"]),
                true,
            ),
            (serde_json::json!(["Qwen/Qwen2.5-7B-Instruct"]), false),
        ] {
            let d = deployment(
                joining(serde_json::json!({})),
                serde_json::json!({"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "vllm",
                    "args": args, "ports": [{"name": "http", "containerPort": 8000}]}]}}}}),
            );
            let (port, f) = check_member_serving(&d, &member(&d), None);
            assert!(port.is_some());
            assert_eq!(f.warnings().count(), usize::from(warns), "{args}: {f}");
            if warns {
                let w = f.warnings().next().unwrap();
                assert_eq!(
                    w.field,
                    "metadata.annotations[\"serving.hearth.dev/model\"]"
                );
                assert!(
                    w.message.contains("make them equal (--served-model-name)"),
                    "{w}"
                );
            }
        }
    }
}

//! Whether an `LLMService` can be rendered with an `InferenceRuntime`: the one function both the
//! admission webhook and the controller apply, so a service the webhook admits is one the
//! controller renders, and one it denies is one the controller refuses.
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

use std::fmt;

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::{
    InferenceRuntime, LLMService, cron,
    inferenceruntime::{RuntimeEngineCall, RuntimeSleepMode},
    llmservice::{CacheSpec, CacheStrategy, ScalingMetric, ScalingSpec},
    model_uri::{ModelUri, parse_model_uri},
    naming::{is_dns1035_label, is_dns1123_label, is_dns1123_subdomain},
    quantity::{is_negative, is_quantity},
    template,
    wellknown::SCALER_ANNOTATION,
};

/// Longest `LLMService` name whose children all get valid names: Service names are RFC 1035
/// labels (at most 63 characters) and the longest Service suffix is `-backend`.
pub const MAX_NAME_LEN: usize = 63 - "-backend".len();

/// Most `spec.scaling.warmWindows` of one service (the CRD's `maxItems`): each is one KEDA
/// trigger, polled every `pollingInterval`.
pub const MAX_WARM_WINDOWS: usize = 10;

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
        }
    }

    /// The status condition an error with this reason is reported under: `CacheReady` for the
    /// cache, `Ready` for everything else.
    pub fn condition_type(self) -> &'static str {
        match self {
            Reason::StrategyNotImplemented => "CacheReady",
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
    match svc
        .metadata
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
}

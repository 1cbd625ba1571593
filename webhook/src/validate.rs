//! Validation of `LLMService` and `InferenceRuntime` beyond the CRD schema: the checks that need
//! the cluster's runtimes or are too awkward for CEL (URI safety, templates, name grammars).
//!
//! Every finding names the field (`spec.resources.fraction`) and says how to fix it. Denials
//! reject the request; warnings are returned as admission warnings (`kubectl` prints them).
//!
//! A runtime that does not exist (yet) is a warning, not a denial: GitOps tools and
//! `kubectl apply -f dir/` do not order cluster-scoped runtimes before the services that use
//! them, and the controller already reports `RuntimeResolved=False` until the runtime appears.
//! Rejecting would make such applies fail at random. Checks that depend on the runtime (sharing
//! before `fraction`) run once it exists.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use hearth_crds::inferenceruntime::InferenceRuntime;
use hearth_crds::llmservice::{CacheStrategy, LLMService, ScalingMetric};
use k8s_openapi::api::core::v1::Probe;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use hearth_policies::{ResolveError, Selection, resolve_runtime};

use hearth_crds::model_uri::{ModelUri, is_dns1123_subdomain, parse_model_uri};

/// The cluster's `InferenceRuntime`s by name, as the reflector last saw them.
pub type Runtimes = BTreeMap<String, Arc<InferenceRuntime>>;

/// The template placeholders runtime `args` and `env` values may use (the public Hearth API).
pub const TEMPLATE_FIELDS: [&str; 3] = [".Model.Path", ".Service.Name", ".Service.Namespace"];

/// One problem with an object: the field path and what to do about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    /// JSON path of the field, `spec.resources.fraction`.
    pub field: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.field, self.message)
    }
}

/// The outcome of validating one object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// Problems that reject the request.
    pub denials: Vec<Finding>,
    /// Problems reported as admission warnings.
    pub warnings: Vec<Finding>,
}

impl Findings {
    fn deny(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.denials.push(Finding {
            field: field.into(),
            message: message.into(),
        });
    }

    fn warn(&mut self, field: impl Into<String>, message: impl Into<String>) {
        self.warnings.push(Finding {
            field: field.into(),
            message: message.into(),
        });
    }
}

/// Validates an `LLMService` against the cluster's runtimes.
pub fn llmservice(svc: &LLMService, runtimes: &[InferenceRuntime]) -> Findings {
    let mut f = Findings::default();
    let spec = &svc.spec;

    // Model.
    if spec.model.catalog_ref.is_some() {
        f.deny(
            "spec.model.catalogRef",
            "catalog resolution is not supported; remove catalogRef and set spec.model.source.uri \
             (for example hf://Qwen/Qwen2.5-0.5B-Instruct)",
        );
    }
    let model = match &spec.model.source {
        None => {
            if spec.model.catalog_ref.is_none() {
                f.deny(
                    "spec.model.source.uri",
                    "is required; set it (for example hf://Qwen/Qwen2.5-0.5B-Instruct)",
                );
            }
            None
        }
        Some(src) => match parse_model_uri(&src.uri) {
            Ok(uri) => Some(uri),
            Err(e) => {
                f.deny("spec.model.source.uri", e.to_string());
                None
            }
        },
    };
    if let Some(secret) = spec
        .model
        .source
        .as_ref()
        .and_then(|s| s.secret_ref.as_ref())
    {
        check_object_name(&mut f, "spec.model.source.secretRef.name", &secret.name);
    }

    // Runtime.
    let sel = &spec.runtime;
    if sel.name.as_deref().is_some_and(|n| !n.is_empty())
        && sel.selector.as_ref().is_some_and(|s| !s.vendor.is_empty())
    {
        f.warn(
            "spec.runtime.selector",
            "is ignored because spec.runtime.name pins a runtime; remove one of them",
        );
    }
    if let Some(name) = sel.name.as_deref().filter(|n| !n.is_empty()) {
        check_object_name(&mut f, "spec.runtime.name", name);
    }
    if let Some(s) = &sel.selector {
        for (i, v) in s.vendor.iter().enumerate() {
            if !is_dns1123_label(v) {
                f.deny(
                    format!("spec.runtime.selector.vendor[{i}]"),
                    format!(
                        "{v:?} is not a vendor name; vendors are lowercase DNS labels such as nvidia or ascend"
                    ),
                );
            } else if s.vendor[..i].contains(v) {
                f.warn(
                    format!("spec.runtime.selector.vendor[{i}]"),
                    format!("{v:?} is listed twice; remove the duplicate"),
                );
            }
        }
    }
    // The controller's rule (hearth-policies), so admission and reconcile agree.
    let resolution = resolve_runtime(runtimes, &Selection::from_service(svc));
    if let Err(e) = &resolution {
        let field = match e {
            ResolveError::NotFound { .. } => "spec.runtime.name",
            ResolveError::NoVendorMatch { .. } | ResolveError::Ambiguous { .. } => {
                "spec.runtime.selector.vendor"
            }
        };
        f.warn(
            field,
            format!("{e}; until then the service stays Pending (RuntimeResolved=False)"),
        );
    }

    // Resources.
    if spec.resources.fraction.is_some() {
        match resolution {
            Ok(rt) if !rt.spec.accelerator.sharing.supported => f.deny(
                "spec.resources.fraction",
                format!(
                    "InferenceRuntime {:?} (resource {}) does not support fractional devices \
                     (its spec.accelerator.sharing.supported is false); remove fraction to request \
                     whole devices, or choose a runtime with sharing support",
                    rt.metadata.name.as_deref().unwrap_or_default(),
                    rt.spec.accelerator.resource_name
                ),
            ),
            Ok(_) => {}
            Err(_) => f.warn(
                "spec.resources.fraction",
                "cannot be checked until the runtime exists; it needs a runtime with \
                 spec.accelerator.sharing.supported: true",
            ),
        }
    }

    // Scaling.
    if spec.scaling.metric == ScalingMetric::KvCacheUtil {
        f.deny(
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
            f.deny(
                field,
                format!("{e}; write a duration such as 90s, 5m or 1h30m"),
            );
        }
    }

    // Cache.
    let cache = &spec.cache;
    match cache.strategy {
        CacheStrategy::SharedPVC | CacheStrategy::BakedImage => f.deny(
            "spec.cache.strategy",
            format!(
                "{:?} is reserved and not implemented; use NodeLocalPVC, HostPath or None",
                cache.strategy
            ),
        ),
        CacheStrategy::NodeLocalPVC => {}
        CacheStrategy::HostPath | CacheStrategy::None => {
            if cache.size.is_some() {
                f.warn(
                    "spec.cache.size",
                    format!("is ignored with strategy {:?}; remove it", cache.strategy),
                );
            }
            if cache.storage_class_name.is_some() {
                f.warn(
                    "spec.cache.storageClassName",
                    format!("is ignored with strategy {:?}; remove it", cache.strategy),
                );
            }
        }
    }
    if cache.prewarm && cache.strategy == CacheStrategy::None {
        f.warn(
            "spec.cache.prewarm",
            "is ignored with strategy None (there is no cache to fill); remove it or pick a cache strategy",
        );
    }
    if cache.prewarm && matches!(model, Some(ModelUri::Pvc { .. })) {
        f.warn(
            "spec.cache.prewarm",
            "is ignored for pvc:// models, whose weights are already staged; remove it",
        );
    }

    // Endpoint and pods.
    if !spec.endpoint.openai_compatible {
        f.warn(
            "spec.endpoint.openAICompatible",
            "false has no effect: the gateway always serves the OpenAI-compatible API",
        );
    }
    for (i, s) in spec.image_pull_secrets.iter().enumerate() {
        check_object_name(&mut f, &format!("spec.imagePullSecrets[{i}].name"), &s.name);
    }
    f
}

/// Validates an `InferenceRuntime` on its own.
pub fn inference_runtime(rt: &InferenceRuntime) -> Findings {
    let mut f = Findings::default();
    let spec = &rt.spec;
    let c = &spec.container;

    for (i, a) in c.args.iter().enumerate() {
        check_template(&mut f, &format!("spec.container.args[{i}]"), a);
    }
    for (i, e) in c.env.iter().enumerate() {
        if let Some(v) = &e.value {
            check_template(&mut f, &format!("spec.container.env[{i}].value"), v);
        }
    }
    if !is_iana_svc_name(&c.port.name) {
        f.deny(
            "spec.container.port.name",
            format!(
                "{:?} is not a valid port name: at most 15 lowercase letters, digits and '-', with \
                 at least one letter, no leading, trailing or double '-' (for example http)",
                c.port.name
            ),
        );
    }

    let acc = &spec.accelerator;
    if let Err(why) = check_extended_resource(&acc.resource_name) {
        f.deny(
            "spec.accelerator.resourceName",
            format!(
                "{:?} {why}; write the device plugin's resource as <domain>/<name>, for example \
                 nvidia.com/gpu or huawei.com/Ascend910",
                acc.resource_name
            ),
        );
    }
    for (k, v) in &acc.node_selector {
        if let Err(why) = check_qualified_name(k) {
            f.deny(
                format!("spec.accelerator.nodeSelector[{k:?}]"),
                format!("the key {why}; use a label key such as nvidia.com/gpu.product"),
            );
        }
        if !is_label_value(v) {
            f.deny(
                format!("spec.accelerator.nodeSelector[{k:?}]"),
                format!(
                    "the value {v:?} is not a label value: at most 63 letters, digits, '-', '_' \
                     and '.', starting and ending alphanumeric"
                ),
            );
        }
    }
    if acc.scheduler.queue.is_some() && acc.scheduler.name.as_deref().is_none_or(str::is_empty) {
        f.warn(
            "spec.accelerator.scheduler.queue",
            "has no effect on the default scheduler; set spec.accelerator.scheduler.name (for example volcano)",
        );
    }

    for (name, probe) in [
        ("readiness", &spec.health.readiness),
        ("liveness", &spec.health.liveness),
        ("startup", &spec.health.startup),
    ] {
        if let Some(p) = probe {
            check_probe(&mut f, &format!("spec.health.{name}"), p, &c.port.name);
        }
    }
    if let Some(m) = &spec.metrics
        && m.port != c.port.name
    {
        f.warn(
            "spec.metrics.port",
            format!(
                "{:?} is not the container's port ({:?}); metrics are scraped from a named port of \
                 the serving container",
                m.port, c.port.name
            ),
        );
    }
    f
}

fn check_probe(f: &mut Findings, field: &str, p: &Probe, port_name: &str) {
    let handlers = [
        p.http_get.is_some(),
        p.tcp_socket.is_some(),
        p.grpc.is_some(),
        p.exec.is_some(),
    ]
    .into_iter()
    .filter(|h| *h)
    .count();
    if handlers != 1 {
        f.deny(
            field,
            "must set exactly one of httpGet, tcpSocket, grpc or exec (for vLLM: httpGet /health on port http)",
        );
    }
    let port = p
        .http_get
        .as_ref()
        .map(|h| &h.port)
        .or(p.tcp_socket.as_ref().map(|t| &t.port));
    if let Some(IntOrString::String(named)) = port
        && named != port_name
    {
        f.deny(
            field,
            format!(
                "probes port {named:?}, but the serving container's only named port is \
                 {port_name:?}; use {port_name:?} or a port number"
            ),
        );
    }
}

/// `{{ ... }}` placeholders must be one of [`TEMPLATE_FIELDS`]; the controller renders exactly
/// those and would otherwise pass the braces to the engine verbatim.
fn check_template(f: &mut Findings, field: &str, s: &str) {
    let mut rest = s;
    while let Some(start) = rest.find("{{") {
        let after = &rest[start + 2..];
        let Some(end) = after.find("}}") else {
            f.deny(
                field,
                format!("{s:?} opens '{{{{' without a closing '}}}}'"),
            );
            return;
        };
        let inner = after[..end].trim();
        if !TEMPLATE_FIELDS.contains(&inner) {
            f.deny(
                field,
                format!(
                    "unknown template {{{{ {inner} }}}}; the supported ones are {{{{ .Model.Path }}}}, \
                     {{{{ .Service.Name }}}} and {{{{ .Service.Namespace }}}}"
                ),
            );
        }
        rest = &after[end + 2..];
    }
}

fn check_object_name(f: &mut Findings, field: &str, name: &str) {
    if !is_dns1123_subdomain(name) {
        f.deny(
            field,
            format!(
                "{name:?} is not a valid object name (lowercase letters, digits, '-' and '.', \
                 starting and ending alphanumeric, at most 253)"
            ),
        );
    }
}

fn is_dns1123_label(s: &str) -> bool {
    is_dns1123_subdomain(s) && !s.contains('.') && s.len() <= 63
}

/// `IsValidPortName` of k8s.io/apimachinery (IANA service name, RFC 6335).
fn is_iana_svc_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 15
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b.iter().any(u8::is_ascii_lowercase)
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
        && !s.contains("--")
}

/// `IsQualifiedName` of k8s.io/apimachinery: `[prefix/]name`, prefix a DNS subdomain, name at
/// most 63 of `[A-Za-z0-9._-]` starting and ending alphanumeric.
fn check_qualified_name(s: &str) -> Result<(), &'static str> {
    let (prefix, name) = match s.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, s),
    };
    if let Some(p) = prefix
        && !is_dns1123_subdomain(p)
    {
        return Err("has a prefix that is not a DNS subdomain");
    }
    let b = name.as_bytes();
    if b.is_empty() || b.len() > 63 {
        return Err("must have a name part of 1 to 63 characters");
    }
    if !b
        .iter()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        || !b[0].is_ascii_alphanumeric()
        || !b[b.len() - 1].is_ascii_alphanumeric()
    {
        return Err("has a name part that is not alphanumeric with '-', '_' or '.' inside");
    }
    Ok(())
}

/// Extended resources are domain-qualified names outside `kubernetes.io`
/// (`IsExtendedResourceName` of k8s.io/kubernetes `pkg/apis/core/helper`).
fn check_extended_resource(s: &str) -> Result<(), &'static str> {
    let Some((prefix, _)) = s.split_once('/') else {
        return Err("has no domain prefix");
    };
    if prefix == "kubernetes.io" || prefix.ends_with(".kubernetes.io") {
        return Err("is in the kubernetes.io namespace, which is reserved for native resources");
    }
    check_qualified_name(s)
}

fn is_label_value(s: &str) -> bool {
    s.is_empty() || check_qualified_name(s).is_ok() && !s.contains('/')
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("http", true)]
    #[case("h2c-8000", true)]
    #[case("8000", false)]
    #[case("HTTP", false)]
    #[case("a--b", false)]
    #[case("-http", false)]
    #[case("sixteen-chars-xx", false)]
    fn port_names(#[case] name: &str, #[case] ok: bool) {
        assert_eq!(is_iana_svc_name(name), ok, "{name}");
    }

    #[rstest]
    #[case("nvidia.com/gpu", true)]
    #[case("huawei.com/Ascend910", true)]
    #[case("gpu", false)]
    #[case("kubernetes.io/gpu", false)]
    #[case("nvidia.com/", false)]
    #[case("Nvidia.com/gpu", false)]
    fn extended_resources(#[case] name: &str, #[case] ok: bool) {
        assert_eq!(check_extended_resource(name).is_ok(), ok, "{name}");
    }

    #[rstest]
    #[case("{{ .Model.Path }}", 0)]
    #[case("--served-model-name={{ .Service.Name }}", 0)]
    #[case("{{.Service.Namespace}}-x-{{ .Model.Path }}", 0)]
    #[case("{{ .Model.Name }}", 1)]
    #[case("{{ .Model.Path", 1)]
    #[case("no templates", 0)]
    fn templates(#[case] arg: &str, #[case] denials: usize) {
        let mut f = Findings::default();
        check_template(&mut f, "spec.container.args[0]", arg);
        assert_eq!(f.denials.len(), denials, "{arg}: {:?}", f.denials);
    }
}

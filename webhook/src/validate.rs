//! Validation of `LLMService`, `LLMEndpoint` and `InferenceRuntime` beyond the CRD schema: the
//! checks that need the cluster's runtimes or are too awkward for CEL (URI safety, templates,
//! name grammars, label selectors).
//!
//! An `LLMService` goes through `hearth_crds::rules::check_llmservice`, the rules the controller
//! renders by, so what is admitted is rendered and what the controller would refuse is denied;
//! an `LLMEndpoint` through `hearth_crds::rules::check_llmendpoint`, likewise; an `LLMAdapter`
//! through `hearth_crds::rules::adapters::check_llmadapter_among` with its base, siblings and
//! endpoint from the snapshot's stores.
//! Runtime templates are checked with the parser the controller renders with
//! (`hearth_crds::template`), names with `hearth_crds::naming`.
//!
//! Every finding names the field (`spec.resources.fraction`) and says how to fix it. Denials
//! reject the request; warnings are returned as admission warnings (`kubectl` prints them).
//!
//! A runtime that does not exist (yet) is a warning, not a denial: GitOps tools and
//! `kubectl apply -f dir/` do not order cluster-scoped runtimes before the services that use
//! them, and the controller already reports `RuntimeResolved=False` until the runtime appears.
//! Rejecting would make such applies fail at random. Checks that depend on the runtime (its
//! sharing support, its templates) run once it exists.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use hearth_crds::inferenceruntime::InferenceRuntime;
use hearth_crds::llmadapter::LLMAdapter;
use hearth_crds::llmendpoint::LLMEndpoint;
use hearth_crds::llmservice::LLMService;
use hearth_crds::naming::{
    check_extended_resource, check_qualified_name, is_iana_svc_name, is_label_value,
};
use hearth_crds::rules::{self, Severity};
use hearth_crds::template;
use k8s_openapi::api::core::v1::Probe;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::runtime::reflector::ObjectRef;

use crate::workload::Snapshot;

use hearth_policies::{ResolveError, Selection, resolve_runtime};

/// The cluster's `InferenceRuntime`s by name, as the reflector last saw them.
pub type Runtimes = BTreeMap<String, Arc<InferenceRuntime>>;

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

/// Validates an `LLMService` against the cluster's runtimes: the runtime is resolved with the
/// controller's rule (`hearth_policies::resolve_runtime`), then the service goes through the
/// rules the controller renders by (`hearth_crds::rules::check_llmservice`): its errors are
/// denials, its warnings admission warnings. A runtime that is not there (yet) is a warning.
pub fn llmservice(svc: &LLMService, runtimes: &[InferenceRuntime]) -> Findings {
    let mut f = Findings::default();
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
    for finding in rules::check_llmservice(svc, resolution.ok()) {
        match finding.severity {
            Severity::Error => f.deny(finding.field, finding.message),
            Severity::Warning => f.warn(finding.field, finding.message),
        }
    }
    f
}

/// Validates an `LLMEndpoint`: the rules the controller renders its shared gateway by
/// (`hearth_crds::rules::check_llmendpoint`): errors are denials, warnings admission warnings.
pub fn llmendpoint(ep: &LLMEndpoint) -> Findings {
    let mut f = Findings::default();
    for finding in rules::check_llmendpoint(ep) {
        match finding.severity {
            Severity::Error => f.deny(finding.field, finding.message),
            Severity::Warning => f.warn(finding.field, finding.message),
        }
    }
    f
}

/// Validates an `LLMAdapter` against the cluster as the snapshot sees it: its base service,
/// the base's runtime (resolved with the controller's rule), the other adapters, the shared
/// endpoint the base joins and the namespaces' labels, through
/// `hearth_crds::rules::adapters::check_llmadapter_among`, the rule the controller accepts
/// adapters by. A base that does not exist (yet) is a warning.
///
/// - A new adapter (`old` is `None`: a CREATE) is judged the youngest, whatever
///   creationTimestamp the apiserver gave it, so it never displaces one already there.
/// - An update that leaves the spec as it was (labels, annotations, finalizers), or of an
///   adapter being deleted, is never denied: its findings are warnings (the controller reports
///   them in `Accepted`), so a change elsewhere cannot make the object impossible to edit or
///   to finish deleting.
pub fn llmadapter(adapter: &LLMAdapter, old: Option<&LLMAdapter>, snapshot: &Snapshot) -> Findings {
    let mut adapter = adapter.clone();
    if old.is_none() {
        adapter.metadata.creation_timestamp = None;
    }
    let adapter = &adapter;
    let lenient = adapter.metadata.deletion_timestamp.is_some()
        || old.is_some_and(|o| o.spec == adapter.spec);
    let base_ref = ObjectRef::<LLMService>::new(&adapter.spec.service_ref.name)
        .within(adapter.service_namespace());
    let stores = snapshot.serving.as_ref();
    let service = stores.and_then(|s| s.services.get(&base_ref));
    let runtime = service.as_ref().and_then(|svc| {
        resolve_runtime(snapshot.runtime_list(), &Selection::from_service(svc)).ok()
    });
    let adapters = stores.map(|s| s.adapters.state()).unwrap_or_default();
    let endpoint_models = service
        .as_ref()
        .and_then(|svc| {
            svc.spec
                .endpoint
                .shared_endpoint_ref
                .as_ref()
                .map(|r| (svc, r))
        })
        .and_then(|(svc, r)| {
            let ep_ns = r
                .namespace
                .as_deref()
                .or(svc.metadata.namespace.as_deref())
                .unwrap_or_default();
            stores?
                .endpoints
                .get(&ObjectRef::new(&r.name).within(ep_ns))
        })
        .and_then(|ep| ep.status.as_ref().map(|st| st.models.clone()))
        .unwrap_or_default();
    let labels_of = |ns: &str| {
        snapshot
            .namespaces
            .as_ref()
            .and_then(|store| store.get(&ObjectRef::new(ns)))
            .map(|n| n.metadata.labels.clone().unwrap_or_default())
    };
    let other_base = |ns: &str, name: &str| {
        let svc = stores?.services.get(&ObjectRef::new(name).within(ns))?;
        let rt = resolve_runtime(snapshot.runtime_list(), &Selection::from_service(&svc))
            .ok()
            .cloned();
        Some((LLMService::clone(&svc), rt))
    };
    let mut f = Findings::default();
    for finding in rules::adapters::check_llmadapter_among(
        adapter,
        service.as_deref(),
        runtime,
        adapters.iter().map(|a| &**a),
        &endpoint_models,
        &other_base,
        &labels_of,
    ) {
        match finding.severity {
            Severity::Error if !lenient => f.deny(finding.field, finding.message),
            _ => f.warn(finding.field, finding.message),
        }
    }
    f
}

/// Validates an `InferenceRuntime` on its own.
pub fn inference_runtime(rt: &InferenceRuntime) -> Findings {
    let mut f = Findings::default();
    let spec = &rt.spec;
    let c = &spec.container;

    // The parser the controller renders with.
    for (field, text) in template::runtime_templates(spec) {
        if let Err(e) = template::parse(text, &field) {
            f.deny(field, e.problem());
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

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("{{ .Model.Path }}", 0)]
    #[case("--served-model-name={{ .Service.Name }}", 0)]
    #[case("{{.Service.Namespace}}-x-{{ .Model.Path }}", 0)]
    #[case("{{- .Service.Name -}}", 0)]
    #[case("{{ .Model.Name }}", 1)]
    #[case("{{ .Model.Path", 1)]
    #[case("{{-.Model.Path}}", 1)]
    #[case("no templates", 0)]
    fn templates(#[case] arg: &str, #[case] denials: usize) {
        let mut rt: InferenceRuntime = serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "InferenceRuntime",
            "metadata": {"name": "r"},
            "spec": {
                "vendor": "nvidia",
                "container": {"image": "x"},
                "accelerator": {"resourceName": "nvidia.com/gpu"}
            }
        }))
        .unwrap();
        rt.spec.container.args = vec![arg.to_owned()];
        let f = inference_runtime(&rt);
        assert_eq!(f.denials.len(), denials, "{arg}: {:?}", f.denials);
    }
}

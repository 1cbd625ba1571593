//! Whether an `LLMAdapter` can be served on its base: the one function ([`check_llmadapter`])
//! the admission webhook and the controller apply. The webhook denies on an error and returns
//! warnings; the controller reports the first error as `Accepted=False` with its reason.
//!
//! An adapter is checked alone (its source, names and rank) and against what exists: the base
//! service (which may not exist yet: a warning at admission, so one `kubectl apply` of both
//! works in any order, and `Accepted=False` with `ServiceNotFound` until it does), whether the
//! base admits the adapter's namespace, the base's runtime (adapters at all, `maxRank`,
//! `maxAdapters`), and every other model a client could name on the same gateway.
//!
//! Between adapters that contend (one name, or more adapters than `maxAdapters`), the older one
//! (by `metadata.creationTimestamp`, then namespace and name, as Gateway API orders routes)
//! wins, and only accepted ones contend: a base's adapters are decided oldest first, each
//! against those before it that were accepted ([`check_base_adapters`]), so an adapter refused
//! for its own fault (another namespace not admitted, a rank too high) takes no place and no
//! name. At admission a new adapter is the youngest (the webhook reviews a CREATE without its
//! creationTimestamp).

use std::collections::BTreeMap;

use super::namespaces::{NotAdmitted, namespace_admits};
use super::{Findings, Reason, object_name};
use crate::{
    InferenceRuntime, LLMAdapter, LLMService, llmendpoint::EndpointModel,
    model_uri::parse_model_uri, naming::is_dns1123_label,
};

/// Longest `spec.servedName` (the CRD's `maxLength`).
pub const MAX_SERVED_NAME_LEN: usize = 253;

/// Whether `s` can be an adapter's `spec.servedName`: 1 to [`MAX_SERVED_NAME_LEN`] letters,
/// digits, `.`, `_`, `:`, `/` and `-`, starting and ending alphanumeric (the CRD's pattern).
pub fn is_served_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_SERVED_NAME_LEN
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || b"._:/-".contains(c))
}

/// The model names already routed on the gateway an adapter would be served by: the `model`
/// clients send → what serves it, for the message (`LLMService team-a/qwen`,
/// `LLMAdapter team-a/sql`).
pub type TakenNames = BTreeMap<String, String>;

/// What an adapter is checked against. Absent parts skip the checks that need them.
#[derive(Clone, Debug, Default)]
pub struct AdapterContext<'a> {
    /// The base service, when it exists.
    pub service: Option<&'a LLMService>,
    /// The base's resolved runtime, when there is one.
    pub runtime: Option<&'a InferenceRuntime>,
    /// The labels of the adapter's namespace, when known (for `from: Selector`).
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
    /// The base's other adapters that come first and were accepted (older; at admission,
    /// all the accepted ones).
    pub older_siblings: usize,
    /// Every other model name on the same gateway that comes first: the base's own, its older
    /// accepted adapters', and on a shared endpoint its other models' (see [`taken_names`]).
    pub taken: Option<&'a TakenNames>,
}

/// Checks `adapter` in `ctx`: errors deny it at admission and keep it from being loaded;
/// warnings are admission warnings. A missing base is a warning with
/// [`Reason::ServiceNotFound`] (the controller reports it as not accepted).
pub fn check_llmadapter(adapter: &LLMAdapter, ctx: &AdapterContext<'_>) -> Findings {
    let mut f = Findings::default();
    let spec = &adapter.spec;

    // Alone.
    match parse_model_uri(&spec.source.uri) {
        Ok(_) => {}
        Err(e) => f.error(Reason::InvalidModelSource, "spec.source.uri", e.to_string()),
    }
    if let Some(secret) = &spec.source.secret_ref {
        object_name(&mut f, "spec.source.secretRef.name", &secret.name);
    }
    let served = adapter.served_name();
    let name_field = name_field(adapter);
    if !is_served_name(served) {
        f.error(
            Reason::InvalidSpec,
            name_field,
            format!(
                "{served:?} cannot be a model name: at most {MAX_SERVED_NAME_LEN} letters, digits, \
                 '.', '_', ':', '/' and '-', starting and ending alphanumeric; set \
                 spec.servedName"
            ),
        );
    }
    if !is_dns1123_label(&spec.service_ref.name) {
        f.error(
            Reason::InvalidSpec,
            "spec.serviceRef.name",
            format!(
                "{:?} is not an LLMService name (a DNS label); name the base service",
                spec.service_ref.name
            ),
        );
    }
    if let Some(ns) = &spec.service_ref.namespace
        && !is_dns1123_label(ns)
    {
        f.error(
            Reason::InvalidSpec,
            "spec.serviceRef.namespace",
            format!("{ns:?} is not a namespace name (a DNS label); fix or remove it"),
        );
    }
    if let Some(rank) = spec.rank
        && !(1..=512).contains(&rank)
    {
        f.error(
            Reason::InvalidSpec,
            "spec.rank",
            format!("{rank} is not a LoRA rank between 1 and 512; set the adapter's `r`"),
        );
    }

    // Against the base.
    let base = format!("{}/{}", adapter.service_namespace(), spec.service_ref.name);
    let Some(svc) = ctx.service else {
        f.warn(
            Reason::ServiceNotFound,
            "spec.serviceRef",
            format!("LLMService {base} does not exist (yet); the adapter is served once it does"),
        );
        return f;
    };
    let own = adapter.metadata.namespace.as_deref().unwrap_or_default();
    let svc_ns = svc.metadata.namespace.as_deref().unwrap_or_default();
    if let Err(why) = namespace_admits(
        &svc.spec.allowed_adapters.namespaces,
        svc_ns,
        own,
        ctx.namespace_labels,
    ) {
        let fix = match why {
            NotAdmitted::OtherNamespace => format!(
                "LLMService {base} admits adapters of its own namespace only \
                 (spec.allowedAdapters.namespaces.from: Same); its owner can set from: All, or \
                 from: Selector with a selector matching namespace {own}"
            ),
            NotAdmitted::SelectorMismatch { selector } => format!(
                "the labels of namespace {own} do not match spec.allowedAdapters.namespaces.selector \
                 of LLMService {base} ({selector}): label the namespace to match it, or ask the \
                 service's owner to change the selector"
            ),
        };
        f.error(Reason::NotAllowedByService, "spec.serviceRef", fix);
    }
    source_on_base(&mut f, adapter, svc, &base);
    let Some(rt) = ctx.runtime else {
        f.warn(
            Reason::RuntimeNotResolved,
            "spec.serviceRef",
            format!(
                "LLMService {base} has no runtime yet, so the adapter's limits are not checked; \
                 they are once it has"
            ),
        );
        return f;
    };
    let rt_name = rt.metadata.name.as_deref().unwrap_or_default();
    let Some(limits) = &rt.spec.adapters else {
        f.error(
            Reason::AdaptersNotSupported,
            "spec.serviceRef",
            format!(
                "LLMService {base} runs on InferenceRuntime {rt_name}, which does not serve \
                 adapters (no spec.adapters); choose a base on a runtime that does, or add \
                 spec.adapters to the runtime"
            ),
        );
        return f;
    };
    if let Some(rank) = spec.rank
        && rank > limits.max_rank
    {
        f.error(
            Reason::RankTooHigh,
            "spec.rank",
            format!(
                "{rank} is above {}, the highest rank InferenceRuntime {rt_name} accepts \
                 (spec.adapters.maxRank); use an adapter of a lower rank, or a runtime with a \
                 higher maxRank",
                limits.max_rank
            ),
        );
    }
    let max = usize::try_from(limits.max_adapters).unwrap_or(0);
    if ctx.older_siblings >= max {
        f.error(
            Reason::TooManyAdapters,
            "spec.serviceRef",
            format!(
                "LLMService {base} has {} adapters already, the most InferenceRuntime {rt_name} \
                 allows (spec.adapters.maxAdapters: {max}); delete one, or serve this one on \
                 another base",
                ctx.older_siblings
            ),
        );
    }
    if let Some(by) = ctx.taken.and_then(|t| t.get(served)) {
        f.error(
            Reason::ModelNameConflict,
            name_field,
            format!(
                "the model name {served:?} is taken by {} on the same gateway; set \
                 spec.servedName to another name",
                by
            ),
        );
    }
    f
}

/// Whether the base can read `adapter`'s files: a hub adapter is fetched into the base's model
/// cache, so the base needs one (a hub model with `spec.cache.strategy` NodeLocalPVC, SharedPVC
/// or HostPath); a `pvc://` adapter's claim is mounted by the base's pods, and a `secretRef` is
/// read by the fetch Job in the base's namespace, so such an adapter must be in the base's
/// namespace (one of another namespace would otherwise name a claim or Secret its own team
/// cannot read).
fn source_on_base(f: &mut Findings, adapter: &LLMAdapter, svc: &LLMService, base: &str) {
    use crate::{llmservice::CacheStrategy, model_uri::ModelUri};
    let own = adapter.metadata.namespace.as_deref().unwrap_or_default();
    let svc_ns = svc.metadata.namespace.as_deref().unwrap_or_default();
    let same_namespace = own == svc_ns;
    let Ok(source) = parse_model_uri(&adapter.spec.source.uri) else {
        return;
    };
    match source {
        ModelUri::HuggingFace { .. } | ModelUri::ModelScope { .. } => {
            let base_uri = svc
                .spec
                .model
                .source
                .as_ref()
                .map_or("", |s| s.uri.as_str());
            let base_staged = parse_model_uri(base_uri).is_ok_and(|m| m.is_staged());
            let strategy = svc.spec.cache.strategy;
            let cached = matches!(
                strategy,
                CacheStrategy::NodeLocalPVC | CacheStrategy::SharedPVC | CacheStrategy::HostPath
            );
            if base_staged || !cached {
                let why = if base_staged {
                    format!("its model is {base_uri} (read as it is, no model cache)")
                } else {
                    format!("its spec.cache.strategy is {strategy:?}")
                };
                f.error(
                    Reason::NoModelCache,
                    "spec.source.uri",
                    format!(
                        "a hub adapter is fetched into its base's model cache, and LLMService \
                         {base} has none: {why}; stage the adapter on a PersistentVolumeClaim \
                         (pvc://<claim>/<dir>) or in an image (oci://), or give the base a hub \
                         model with cache.strategy NodeLocalPVC, SharedPVC or HostPath"
                    ),
                );
            }
        }
        ModelUri::Pvc { claim, .. } if !same_namespace => f.error(
            Reason::SourceNotInNamespace,
            "spec.source.uri",
            format!(
                "claim {claim:?} would be mounted by the pods of LLMService {base}, in namespace \
                 {svc_ns}, not {own}: a pvc:// adapter must be in its base's namespace; create it \
                 there, or publish the adapter on a hub (hf://, modelscope://) or as an image \
                 (oci://)"
            ),
        ),
        _ => {}
    }
    if let Some(secret) = adapter
        .spec
        .source
        .secret_ref
        .as_ref()
        .filter(|_| !same_namespace)
    {
        f.error(
            Reason::SourceNotInNamespace,
            "spec.source.secretRef",
            format!(
                "Secret {:?} would be read in namespace {svc_ns}, the base's, not {own}: an \
                 adapter with a secretRef must be in its base's namespace; create it there, or \
                 publish the adapter where it needs no credentials",
                secret.name
            ),
        );
    }
}

/// Looks up another base on the same endpoint by namespace and name: the LLMService and its
/// resolved runtime, when they exist.
pub type BaseLookup<'a> = &'a dyn Fn(&str, &str) -> Option<(LLMService, Option<InferenceRuntime>)>;

/// Checks `adapter` among the cluster's objects: `service` its base and `runtime` the base's
/// resolved runtime (when they exist), `adapters` every adapter the caller knows (the base's
/// are picked out, and those of the other bases on the base's shared endpoint; `adapter`
/// itself, by namespace and name, is replaced by the one given), `endpoint_models` the
/// `status.models` of the shared endpoint the base joins (empty without one), `other_base`
/// the endpoint's other LLMServices ([`BaseLookup`]), and `labels_of` a namespace's labels
/// (for `from: Selector`; `None` when unknown). The webhook and the controller both call
/// this, so what is admitted is what is accepted.
pub fn check_llmadapter_among<'a>(
    adapter: &'a LLMAdapter,
    service: Option<&LLMService>,
    runtime: Option<&InferenceRuntime>,
    adapters: impl IntoIterator<Item = &'a LLMAdapter>,
    endpoint_models: &[EndpointModel],
    other_base: BaseLookup<'_>,
    labels_of: &dyn Fn(&str) -> Option<BTreeMap<String, String>>,
) -> Findings {
    let key = |a: &LLMAdapter| (a.metadata.namespace.clone(), a.metadata.name.clone());
    let own = key(adapter);
    let base = base_of(adapter);
    let others: Vec<&LLMAdapter> = adapters.into_iter().filter(|a| key(a) != own).collect();
    let other_bases = service
        .map(|svc| endpoint_bases(svc, others.iter().copied(), endpoint_models, other_base))
        .unwrap_or_default();
    let siblings = others
        .into_iter()
        .filter(|a| base_of(a) == base)
        .filter(|a| comes_before(a, adapter))
        .chain(std::iter::once(adapter));
    check_base_adapters(
        service,
        runtime,
        siblings,
        endpoint_models,
        &other_bases,
        labels_of,
    )
    .pop()
    .map(|(_, f)| f)
    .unwrap_or_default()
}

/// Another LLMService on the shared endpoint a base joins, with its adapters: what the base's
/// adapters contend with for names beyond their own base.
#[derive(Clone, Debug)]
pub struct OtherBase<'a> {
    /// The LLMService.
    pub service: LLMService,
    /// Its resolved runtime, when it has one.
    pub runtime: Option<InferenceRuntime>,
    /// Its adapters.
    pub adapters: Vec<&'a LLMAdapter>,
}

/// The other LLMServices on the shared endpoint `svc` joins (its `endpoint_models`) that have
/// adapters among `adapters`, looked up with `other_base`. Empty without an endpoint.
pub fn endpoint_bases<'a>(
    svc: &LLMService,
    adapters: impl IntoIterator<Item = &'a LLMAdapter>,
    endpoint_models: &[EndpointModel],
    other_base: BaseLookup<'_>,
) -> Vec<OtherBase<'a>> {
    let own = (
        svc.metadata.namespace.clone().unwrap_or_default(),
        svc.metadata.name.clone().unwrap_or_default(),
    );
    let bases: Vec<(String, String)> = endpoint_models
        .iter()
        .filter(|m| {
            m.kind
                .is_none_or(|k| k == crate::llmendpoint::MemberKind::LLMService)
        })
        .map(|m| (m.namespace.clone(), m.service.clone()))
        .filter(|b| *b != own)
        .collect();
    if bases.is_empty() {
        return Vec::new();
    }
    let mut by_base: BTreeMap<(String, String), Vec<&'a LLMAdapter>> = BTreeMap::new();
    for a in adapters {
        let b = base_of(a);
        if bases.contains(&b) {
            by_base.entry(b).or_default().push(a);
        }
    }
    by_base
        .into_iter()
        .filter_map(|((ns, name), adapters)| {
            let (service, runtime) = other_base(&ns, &name)?;
            Some(OtherBase {
                service,
                runtime,
                adapters,
            })
        })
        .collect()
}

/// `(namespace, name)` of `a`'s base service.
fn base_of(a: &LLMAdapter) -> (String, String) {
    (
        a.service_namespace().to_owned(),
        a.spec.service_ref.name.clone(),
    )
}

/// The findings of each of one base's `adapters`, decided oldest first ([`comes_before`])
/// together with the adapters of `others`, the other bases on the shared endpoint the base
/// joins ([`endpoint_bases`]): each adapter against its own base, that base's runtime,
/// `endpoint_models`, the older adapters of its base that were accepted (no error, with a
/// runtime), which take a place of its `maxAdapters`, and the older accepted adapters of any of
/// these bases, which take their names. So every base on an endpoint is decided by the same
/// single pass, and a name goes to the oldest accepted adapter. Returned: the base's adapters,
/// oldest first. `labels_of` as for [`check_llmadapter_among`]. O(n log n + n·b) in the
/// adapters n and the bases b.
pub fn check_base_adapters<'a>(
    service: Option<&LLMService>,
    runtime: Option<&InferenceRuntime>,
    adapters: impl IntoIterator<Item = &'a LLMAdapter>,
    endpoint_models: &[EndpointModel],
    others: &[OtherBase<'a>],
    labels_of: &dyn Fn(&str) -> Option<BTreeMap<String, String>>,
) -> Vec<(&'a LLMAdapter, Findings)> {
    // Base 0 is this one; 1.. the others.
    let mut bases: Vec<(Option<&LLMService>, Option<&InferenceRuntime>)> = vec![(service, runtime)];
    bases.extend(
        others
            .iter()
            .map(|o| (Some(&o.service), o.runtime.as_ref())),
    );
    let mut ordered: Vec<(usize, &'a LLMAdapter)> = adapters.into_iter().map(|a| (0, a)).collect();
    for (i, o) in others.iter().enumerate() {
        ordered.extend(o.adapters.iter().map(|a| (i + 1, *a)));
    }
    ordered.sort_by(|(_, a), (_, b)| order_key(a).cmp(&order_key(b)));
    // Each base's names: its model's and the endpoint's, then every accepted adapter's.
    let mut taken: Vec<Option<TakenNames>> = bases
        .iter()
        .map(|(svc, _)| svc.map(|svc| taken_names(svc, [], endpoint_models)))
        .collect();
    let mut accepted = vec![0usize; bases.len()];
    let mut out = Vec::new();
    for (i, a) in ordered {
        let (svc, rt) = bases[i];
        let labels = labels_of(a.metadata.namespace.as_deref().unwrap_or_default());
        let f = check_llmadapter(
            a,
            &AdapterContext {
                service: svc,
                runtime: rt,
                namespace_labels: labels.as_ref(),
                older_siblings: accepted[i],
                taken: taken[i].as_ref(),
            },
        );
        if svc.is_some() && rt.is_some() && !f.blocks_rendering() {
            accepted[i] += 1;
            for (j, names) in taken.iter_mut().enumerate() {
                if let Some(names) = names {
                    let by = if j == i {
                        adapter_label(a)
                    } else {
                        format!(
                            "{} of LLMService {}/{} (on the same LLMEndpoint)",
                            adapter_label(a),
                            a.service_namespace(),
                            a.spec.service_ref.name
                        )
                    };
                    names.entry(a.served_name().to_owned()).or_insert(by);
                }
            }
        }
        if i == 0 {
            out.push((a, f));
        }
    }
    out
}

/// The field `a`'s served name comes from: `spec.servedName`, else `metadata.name`.
fn name_field(a: &LLMAdapter) -> &'static str {
    if a.spec.served_name.is_some() {
        "spec.servedName"
    } else {
        "metadata.name"
    }
}

/// `LLMAdapter <namespace>/<name>`.
fn adapter_label(a: &LLMAdapter) -> String {
    format!(
        "LLMAdapter {}/{}",
        a.metadata.namespace.as_deref().unwrap_or_default(),
        a.metadata.name.as_deref().unwrap_or_default()
    )
}

/// The model names on base `svc`'s gateway that come before an adapter: the base's own name,
/// each of `adapters` (the base's accepted others that come first) by its served name, and,
/// when the base joins a shared endpoint, the endpoint's other models (its `status.models`).
/// A name taken twice keeps its first owner.
pub fn taken_names<'a>(
    svc: &LLMService,
    adapters: impl IntoIterator<Item = &'a LLMAdapter>,
    endpoint_models: &[EndpointModel],
) -> TakenNames {
    let ns = svc.metadata.namespace.as_deref().unwrap_or_default();
    let name = svc.metadata.name.as_deref().unwrap_or_default();
    let mut out = TakenNames::new();
    out.insert(name.to_owned(), format!("LLMService {ns}/{name}"));
    for m in endpoint_models
        .iter()
        .filter(|m| !(m.namespace == ns && m.service == name && m.kind.is_none()))
    {
        out.entry(m.name.clone()).or_insert_with(|| {
            format!(
                "{} {}/{} (on the same LLMEndpoint)",
                m.kind.unwrap_or_default().as_str(),
                m.namespace,
                m.service
            )
        });
    }
    for a in adapters {
        out.entry(a.served_name().to_owned())
            .or_insert_with(|| adapter_label(a));
    }
    out
}

/// Whether adapter `a` comes before `b` among contenders: older `creationTimestamp` first (an
/// adapter not yet created, at admission, last), then namespace and name.
pub fn comes_before(a: &LLMAdapter, b: &LLMAdapter) -> bool {
    order_key(a) < order_key(b)
}

/// The contention order's key: created (an adapter not created yet last), creationTimestamp,
/// namespace, name.
fn order_key(
    x: &LLMAdapter,
) -> (
    bool,
    Option<k8s_openapi::jiff::Timestamp>,
    Option<&str>,
    Option<&str>,
) {
    (
        x.metadata.creation_timestamp.is_none(),
        x.metadata.creation_timestamp.as_ref().map(|t| t.0),
        x.metadata.namespace.as_deref(),
        x.metadata.name.as_deref(),
    )
}

#[cfg(test)]
mod tests;

//! Which `LLMService`s an `LLMEndpoint` accepts: Gateway API's attachment rules for routes and
//! Gateways, as one pure function ([`attach`]) that both reconcilers call on the same caches, so
//! the endpoint's routes and status and each service's `EndpointAccepted` condition always agree.
//!
//! - A service joins by reference (`spec.endpoint.sharedEndpointRef`, like a route's
//!   `parentRefs`); the reference's namespace defaults to the service's ([`endpoint_key`]).
//! - The endpoint says which namespaces may join (`spec.allowedServices.namespaces`, like a
//!   listener's `allowedRoutes`): `Same` (its own namespace, the default), `All`, or `Selector`
//!   (namespaces whose labels match the label selector): `hearth_crds::rules::namespace_admits`,
//!   the rule an LLMService's `spec.allowedAdapters` uses too, with the one label-selector
//!   matcher of Hearth (`hearth_crds::rules::selector_matches`).
//!   An endpoint whose spec breaks the rules (`hearth_crds::rules::check_llmendpoint`) admits
//!   no one.
//! - A service's model name is its served model name, the service's name (the runtime templates
//!   serve under it). Two admitted services claiming one name: the older keeps it
//!   (`metadata.creationTimestamp`, then namespace/name, as Gateway API resolves conflicting
//!   routes); the newer gets `ModelNameConflict` naming the holder. A service being deleted holds
//!   no name (so its successor is accepted at once) and is not routed.
//! - A plain Deployment joins by reference too, with annotations
//!   (`serving.hearth.dev/endpoint`, `serving.hearth.dev/model`, ...), checked by
//!   `hearth_crds::rules::check_deployment`: its model name is its `serving.hearth.dev/model`,
//!   claimed under the same rules as a service's (the older object keeps a name, whatever its
//!   kind); one whose annotations (or name, owner, selector) break the rules holds no name and
//!   gets `InvalidMember` with the rule's message, and so does one named like a live LLMService
//!   of its namespace on the endpoint (`<namespace>/<name>` is the model's one key for KEDA and
//!   the gateway, which refuses a route table repeating one).

use std::collections::BTreeMap;

use hearth_crds::{
    LLMEndpoint, LLMService,
    llmendpoint::{AttachReason, EndpointConflict, EndpointModel, MemberKind},
    rules,
    wellknown::MODEL_ANNOTATION,
};
use k8s_openapi::api::apps::v1::Deployment;
use kube::ResourceExt;

use crate::names;

/// An endpoint by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointKey {
    /// The endpoint's namespace.
    pub namespace: String,
    /// The endpoint's name.
    pub name: String,
}

impl EndpointKey {
    /// The key of `ep`.
    pub fn of(ep: &LLMEndpoint) -> Self {
        Self {
            namespace: ep.namespace().unwrap_or_default(),
            name: ep.name_any(),
        }
    }
}

impl std::fmt::Display for EndpointKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The endpoint `svc` references, its namespace defaulted to the service's; `None` without a
/// `sharedEndpointRef`.
pub fn endpoint_key(svc: &LLMService) -> Option<EndpointKey> {
    let r = svc.spec.endpoint.shared_endpoint_ref.as_ref()?;
    Some(EndpointKey {
        namespace: r
            .namespace
            .clone()
            .unwrap_or_else(|| svc.namespace().unwrap_or_default()),
        name: r.name.clone(),
    })
}

/// The endpoint a Deployment joins (its `serving.hearth.dev/endpoint` annotation, the
/// namespace defaulted to the Deployment's); `None` without the annotation or when it is not a
/// reference (`hearth_crds::rules::deployment_endpoint` says why).
pub fn deployment_endpoint_key(d: &Deployment) -> Option<EndpointKey> {
    let r = rules::deployment_endpoint(&d.metadata)?.ok()?;
    Some(EndpointKey {
        namespace: r
            .namespace
            .unwrap_or_else(|| d.namespace().unwrap_or_default()),
        name: r.name,
    })
}

/// A service (or Deployment) by namespace and name.
pub type ServiceKey = (String, String);

/// Whether a service is attached, and why (the reason and message of its `EndpointAccepted`
/// condition).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Why.
    pub reason: AttachReason,
    /// What it means and, when not accepted, the fix or the holder of the model name.
    pub message: String,
}

impl Verdict {
    /// Whether the endpoint's gateway serves the service (it renders no gateway of its own).
    pub fn accepted(&self) -> bool {
        self.reason == AttachReason::Accepted
    }
}

/// The outcome of [`attach`] for one endpoint.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attachment {
    /// One verdict per service that references the endpoint.
    pub verdicts: BTreeMap<ServiceKey, Verdict>,
    /// One verdict per Deployment that references the endpoint (its
    /// `serving.hearth.dev/endpoint` annotation).
    pub deployment_verdicts: BTreeMap<ServiceKey, Verdict>,
    /// The models the endpoint routes, sorted by name: the accepted services and Deployments
    /// not being deleted (`kind: Deployment` for these).
    pub models: Vec<EndpointModel>,
    /// The services and Deployments that reference the endpoint and were not accepted by it
    /// (an endpoint that does not exist has no status to list them in: none then), sorted by
    /// namespace and name.
    pub conflicts: Vec<EndpointConflict>,
    /// The aliases (`spec.model.aliases`) each accepted service is routed by: those no name
    /// and no older alias on the endpoint holds.
    pub aliases: BTreeMap<ServiceKey, Vec<String>>,
}

impl Attachment {
    /// The aliases the endpoint routes to the service `namespace/name` (none when it is not
    /// accepted).
    pub fn aliases_of(&self, namespace: &str, name: &str) -> &[String] {
        self.aliases
            .get(&(namespace.to_owned(), name.to_owned()))
            .map_or(&[], Vec::as_slice)
    }

    /// The verdict on the service `namespace/name`, if it references the endpoint.
    pub fn verdict(&self, namespace: &str, name: &str) -> Option<&Verdict> {
        self.verdicts.get(&(namespace.to_owned(), name.to_owned()))
    }

    /// The verdict on the Deployment `namespace/name`, if it references the endpoint.
    pub fn deployment_verdict(&self, namespace: &str, name: &str) -> Option<&Verdict> {
        self.deployment_verdicts
            .get(&(namespace.to_owned(), name.to_owned()))
    }

    fn insert(&mut self, c: &Claimant, verdict: Verdict) {
        let key = (c.namespace.clone(), c.name.clone());
        match c.kind {
            MemberKind::LLMService => self.verdicts.insert(key, verdict),
            MemberKind::Deployment => self.deployment_verdicts.insert(key, verdict),
        };
    }
}

/// The OpenAI base URL clients call for every model of endpoint `key` (`http://<ep>.<ns>.svc/v1`,
/// as a service's own `status.endpointURL`): its client Service.
pub fn endpoint_url(key: &EndpointKey) -> String {
    format!(
        "http://{}.{}.svc/v1",
        names::gateway_service(&key.name),
        key.namespace
    )
}

/// One object claiming a model name on an endpoint: an LLMService or a Deployment.
struct Claimant {
    kind: MemberKind,
    namespace: String,
    name: String,
    created: Option<k8s_openapi::jiff::Timestamp>,
    deleting: bool,
    /// The model name it claims, or (a Deployment whose annotations cannot join) why not.
    model: Result<String, String>,
    /// The other names it claims (an LLMService's `spec.model.aliases`).
    aliases: Vec<String>,
    /// The model it asked for, as the endpoint's `status.conflicts` lists it.
    asked: String,
}

impl Claimant {
    fn service(s: &LLMService) -> Self {
        Self {
            kind: MemberKind::LLMService,
            namespace: s.namespace().unwrap_or_default(),
            name: s.name_any(),
            created: s.metadata.creation_timestamp.as_ref().map(|t| t.0),
            deleting: s.metadata.deletion_timestamp.is_some(),
            model: Ok(s.name_any()),
            aliases: rules::served_aliases(s),
            asked: s.name_any(),
        }
    }

    fn deployment(d: &Deployment) -> Self {
        let check = rules::check_deployment(d);
        let asked = d
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(MODEL_ANNOTATION))
            .cloned()
            .unwrap_or_default();
        Self {
            kind: MemberKind::Deployment,
            namespace: d.namespace().unwrap_or_default(),
            name: d.name_any(),
            created: d.metadata.creation_timestamp.as_ref().map(|t| t.0),
            deleting: d.metadata.deletion_timestamp.is_some(),
            model: match check.member {
                Some(m) => Ok(m.model),
                None => Err(format!(
                    "the Deployment cannot join: {}; meanwhile Hearth neither routes nor scales it",
                    rules::Findings(check.findings.errors().cloned().collect())
                )),
            },
            aliases: Vec::new(),
            asked,
        }
    }

    /// What goes on while it is not accepted.
    fn meanwhile(&self) -> &'static str {
        match self.kind {
            MemberKind::LLMService => "meanwhile the service runs its own gateway",
            MemberKind::Deployment => "meanwhile Hearth neither routes nor scales the Deployment",
        }
    }
}

/// Decides, for the endpoint `key` (`endpoint`: the object, `None` when it does not exist), which
/// of `services` and `deployments` it accepts. Only those whose reference resolves to `key` are
/// considered (a service's `sharedEndpointRef`, a Deployment's
/// `serving.hearth.dev/endpoint` annotation); `namespace_labels` holds the labels of their
/// namespaces (a namespace missing from it matches no selector). Services and Deployments claim
/// model names under one rule: the older keeps the name, whatever its kind.
pub fn attach<'a, 'b>(
    key: &EndpointKey,
    endpoint: Option<&LLMEndpoint>,
    services: impl IntoIterator<Item = &'a LLMService>,
    deployments: impl IntoIterator<Item = &'b Deployment>,
    namespace_labels: &BTreeMap<String, BTreeMap<String, String>>,
) -> Attachment {
    let mut members: Vec<Claimant> = services
        .into_iter()
        .filter(|s| endpoint_key(s).as_ref() == Some(key))
        .map(Claimant::service)
        .chain(
            deployments
                .into_iter()
                .filter(|d| deployment_endpoint_key(d).as_ref() == Some(key))
                .map(Claimant::deployment),
        )
        .collect();
    // Oldest first: the order in which model names are claimed.
    members.sort_by(|a, b| {
        (
            a.created.is_none(),
            a.created,
            &a.namespace,
            &a.name,
            a.kind,
        )
            .cmp(&(
                b.created.is_none(),
                b.created,
                &b.namespace,
                &b.name,
                b.kind,
            ))
    });
    let mut out = Attachment::default();
    let endpoint = endpoint.filter(|e| e.metadata.deletion_timestamp.is_none());
    let Some(ep) = endpoint else {
        for c in members {
            let fix = match c.kind {
                MemberKind::LLMService => "fix or remove spec.endpoint.sharedEndpointRef",
                MemberKind::Deployment => {
                    "fix or remove the serving.hearth.dev/endpoint annotation"
                }
            };
            let verdict = Verdict {
                reason: AttachReason::EndpointNotFound,
                message: format!(
                    "LLMEndpoint {key} does not exist (or is being deleted): create it, or {fix}; {}",
                    c.meanwhile()
                ),
            };
            out.insert(&c, verdict);
        }
        return out;
    };
    let invalid = rules::check_llmendpoint(ep);
    // The model names held so far: model -> the holder.
    let mut holders: BTreeMap<String, (MemberKind, String, String)> = BTreeMap::new();
    // Deleting claimants are decided after every live one has claimed its name.
    let (live, deleting): (Vec<Claimant>, Vec<Claimant>) =
        members.into_iter().partition(|c| !c.deleting);
    // `<namespace>/<name>` is the one key KEDA and the gateway know a model by (one route per
    // key): a Deployment cannot join under the name of a live LLMService of its namespace on the
    // endpoint (that name is the service's backend Deployment's).
    let service_keys: std::collections::BTreeSet<(&str, &str)> = live
        .iter()
        .filter(|c| c.kind == MemberKind::LLMService)
        .map(|c| (c.namespace.as_str(), c.name.as_str()))
        .collect();
    let key_taken = |c: &Claimant| {
        c.kind == MemberKind::Deployment
            && service_keys.contains(&(c.namespace.as_str(), c.name.as_str()))
    };
    for c in live.iter().chain(&deleting) {
        let verdict = match &c.model {
            Err(why) => Verdict {
                reason: AttachReason::InvalidMember,
                message: why.clone(),
            },
            Ok(model) => match admits(key, ep, &invalid, &c.namespace, namespace_labels) {
                Err(message) => Verdict {
                    reason: AttachReason::NotAllowedByEndpoint,
                    message: format!("{message}; {}", c.meanwhile()),
                },
                Ok(()) if key_taken(c) => Verdict {
                    reason: AttachReason::InvalidMember,
                    message: format!(
                        "the Deployment cannot join: LLMService {ns}/{name} on LLMEndpoint {key} has its name (the service's backend Deployment is named like it, and {ns}/{name} is the key KEDA and the gateway know one model by): join with a Deployment of another name, or take the service off the endpoint; {}",
                        c.meanwhile(),
                        ns = c.namespace,
                        name = c.name,
                    ),
                },
                Ok(()) => match holders.get(model) {
                    Some((hkind, hns, hname)) => {
                        let fix = match c.kind {
                            MemberKind::LLMService => {
                                "rename this service (its name is its model name)"
                            }
                            MemberKind::Deployment => {
                                "change this Deployment's serving.hearth.dev/model (and its engine's --served-model-name)"
                            }
                        };
                        let meanwhile = match c.kind {
                            MemberKind::LLMService => "meanwhile this service runs its own gateway",
                            MemberKind::Deployment => {
                                "meanwhile Hearth neither routes nor scales this Deployment"
                            }
                        };
                        Verdict {
                            reason: AttachReason::ModelNameConflict,
                            message: format!(
                                "model name {model:?} is already served on LLMEndpoint {key} by the older {hkind} {hns}/{hname}: {fix} or take one of the two off the endpoint; {meanwhile}"
                            ),
                        }
                    }
                    None => {
                        if !c.deleting {
                            holders.insert(
                                model.clone(),
                                (c.kind, c.namespace.clone(), c.name.clone()),
                            );
                            out.models.push(EndpointModel {
                                name: model.clone(),
                                namespace: c.namespace.clone(),
                                service: c.name.clone(),
                                kind: kind_field(c.kind),
                            });
                        }
                        Verdict {
                            reason: AttachReason::Accepted,
                            message: format!(
                                "LLMEndpoint {key} serves model {model:?} at {}",
                                endpoint_url(key)
                            ),
                        }
                    }
                },
            },
        };
        if !verdict.accepted() && !c.deleting {
            out.conflicts.push(EndpointConflict {
                namespace: c.namespace.clone(),
                service: c.name.clone(),
                model: c.asked.clone(),
                reason: verdict.reason.as_str().to_owned(),
                message: verdict.message.clone(),
                kind: kind_field(c.kind),
            });
        }
        out.insert(c, verdict);
    }
    // Aliases after every name: an alias never takes a name, nor another service's older
    // alias; one that is taken is left out of the routes (the service stays accepted, and its
    // verdict says which), so adding an alias can never evict a model from the endpoint.
    for c in live.iter().filter(|c| !c.aliases.is_empty()) {
        let key_of = (c.namespace.clone(), c.name.clone());
        if !out.verdicts.get(&key_of).is_some_and(Verdict::accepted) {
            continue;
        }
        let mut kept = Vec::new();
        let mut left_out = Vec::new();
        for a in &c.aliases {
            match holders.get(a) {
                Some((hkind, hns, hname)) => {
                    left_out.push(format!("{a:?} (served by {hkind} {hns}/{hname})"));
                }
                None => {
                    holders.insert(a.clone(), (c.kind, c.namespace.clone(), c.name.clone()));
                    kept.push(a.clone());
                }
            }
        }
        if !left_out.is_empty()
            && let Some(v) = out.verdicts.get_mut(&key_of)
        {
            v.message = format!(
                "{}; spec.model.aliases left out, their names being taken on the endpoint: {} (remove them, or rename one of the two)",
                v.message,
                left_out.join(", ")
            );
        }
        if !kept.is_empty() {
            out.aliases.insert(key_of, kept);
        }
    }
    out.models.sort_by(|a, b| {
        (&a.name, &a.namespace, &a.service, a.kind).cmp(&(
            &b.name,
            &b.namespace,
            &b.service,
            b.kind,
        ))
    });
    out.conflicts.sort_by(|a, b| {
        (&a.namespace, &a.service, a.kind).cmp(&(&b.namespace, &b.service, b.kind))
    });
    out
}

/// The `kind` of a `status.models[]`/`status.conflicts[]` entry: absent for an LLMService (the
/// default, so endpoints' status from before Deployments could join stays as it was).
pub fn kind_field(kind: MemberKind) -> Option<MemberKind> {
    (kind == MemberKind::Deployment).then_some(kind)
}

/// Whether endpoint `ep` admits services of `namespace`; the reason why not, naming the fix.
fn admits(
    key: &EndpointKey,
    ep: &LLMEndpoint,
    invalid: &rules::Findings,
    namespace: &str,
    namespace_labels: &BTreeMap<String, BTreeMap<String, String>>,
) -> Result<(), String> {
    if invalid.blocks_rendering() {
        return Err(format!(
            "LLMEndpoint {key} is not Accepted (its spec breaks the rules: {}): fix the endpoint",
            rules::Findings(invalid.errors().cloned().collect())
        ));
    }
    let allowed = &ep.spec.allowed_services.namespaces;
    match rules::namespace_admits(
        allowed,
        &key.namespace,
        namespace,
        namespace_labels.get(namespace),
    ) {
        Ok(()) => Ok(()),
        Err(rules::NotAdmitted::OtherNamespace) => Err(format!(
            "LLMEndpoint {key} admits services of its own namespace {} only (spec.allowedServices.namespaces.from: Same): on the endpoint set from: All, or from: Selector with a selector matching namespace {namespace}",
            key.namespace
        )),
        Err(rules::NotAdmitted::SelectorMismatch { selector }) => Err(format!(
            "the labels of namespace {namespace} do not match spec.allowedServices.namespaces.selector of LLMEndpoint {key} ({selector}): label the namespace to match it, or change the endpoint's selector"
        )),
    }
}

#[cfg(test)]
mod tests;

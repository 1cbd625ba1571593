//! Plain Deployments joined to an `LLMEndpoint` (the `serving.hearth.dev/endpoint` annotation):
//! a third controller in the process, shaped like the others (a pure decision and plan, then
//! its writes by server-side apply under the one field manager).
//!
//! 1. [`decide_member`]: the Deployment's annotations (`hearth_crds::rules::check_deployment`),
//!    its endpoint's verdict on it ([`crate::attach::attach`], the call the endpoint's reconcile
//!    makes), its runtime and port (`rules::check_member_serving`), and when accepted its
//!    children ([`crate::render::render_member`]);
//! 2. [`plan_member`]: those against what the caches hold ([`MemberView`]): apply what differs,
//!    or, when the Deployment does not join (any more), delete what of its children it controls,
//!    the ScaledObject first (KEDA then gives the Deployment back the replicas it had:
//!    `restoreToOriginalReplicaCount`);
//! 3. an Event on the Deployment whenever the outcome changes (accepted, or why not, naming the
//!    annotation and the fix).
//!
//! A Deployment whose annotation was removed is no longer in the members' cache (only members
//! are kept), so the controller cannot reconcile it: [`sweep`] removes its children instead,
//! from the same plan. The endpoint's reconcile routes the model and lists it in its status; it
//! reconciles the members whose verdict (or gateway) differs from what their last reconcile
//! acted on.

use std::sync::Arc;

use futures::{StreamExt, channel::mpsc};
use hearth_crds::{
    InferenceRuntime, LLMEndpoint,
    llmendpoint::AttachReason,
    rules::{self, DeploymentMember, MemberPort},
    wellknown::ENDPOINT_ANNOTATION,
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{ObjectReference, Service},
        rbac::v1::{Role, RoleBinding},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Resource, ResourceExt,
    api::DynamicObject,
    runtime::{
        controller::Action,
        events::{Event as KubeEvent, EventType},
        reflector::ObjectRef,
    },
};
use tracing::{Instrument, info_span};

use super::{
    CACHE_SYNC_RETRY, Context, ERROR_RETRY, Error, kube_err,
    plan::apply_cached,
    write::{Kind, Object, Target, Write},
};
use crate::{
    attach::{Verdict, deployment_endpoint_key},
    names,
    render::{MemberChildren, RenderConfig, SharedGateway, render_member},
};

/// What the caches hold of a joined Deployment's children (`None` where one is not there).
#[derive(Clone, Debug, Default)]
pub struct MemberView {
    /// Service `<name>-hearth`.
    pub service: Option<Arc<Service>>,
    /// Role `<name>-hearth`.
    pub role: Option<Arc<Role>>,
    /// RoleBinding `<name>-hearth`.
    pub role_binding: Option<Arc<RoleBinding>>,
    /// Whether KEDA's ScaledObject CRD is installed and established.
    pub keda_installed: bool,
    /// ScaledObject `<name>-hearth` (read only when KEDA is installed).
    pub scaled_object: Option<Arc<DynamicObject>>,
}

impl MemberView {
    /// Leaves out the objects whose UID `gone` says was deleted already.
    fn forget(&mut self, gone: impl Fn(&str) -> bool) {
        let is_gone = |m: &ObjectMeta| m.uid.as_deref().is_some_and(&gone);
        if self
            .service
            .as_deref()
            .is_some_and(|o| is_gone(&o.metadata))
        {
            self.service = None;
        }
        if self.role.as_deref().is_some_and(|o| is_gone(&o.metadata)) {
            self.role = None;
        }
        if self
            .role_binding
            .as_deref()
            .is_some_and(|o| is_gone(&o.metadata))
        {
            self.role_binding = None;
        }
        if self
            .scaled_object
            .as_deref()
            .is_some_and(|o| is_gone(&o.metadata))
        {
            self.scaled_object = None;
        }
    }

    /// The UIDs of the objects it holds.
    fn uids(&self) -> Vec<String> {
        self.metas()
            .into_iter()
            .filter_map(|(_, m)| m?.uid.clone())
            .collect()
    }

    fn metas(&self) -> [(&'static str, Option<&ObjectMeta>); 4] {
        [
            ("Service", self.service.as_deref().map(|o| &o.metadata)),
            ("Role", self.role.as_deref().map(|o| &o.metadata)),
            (
                "RoleBinding",
                self.role_binding.as_deref().map(|o| &o.metadata),
            ),
            (
                "ScaledObject",
                self.scaled_object.as_deref().map(|o| &o.metadata),
            ),
        ]
    }
}

/// What a joined Deployment's reconcile does with its children.
#[derive(Clone, Debug)]
pub enum MemberDecision {
    /// Accepted, and renderable: these children.
    Join(Box<MemberChildren>),
    /// Not (or no longer) on an endpoint: the children it controls go.
    Leave,
    /// Accepted, but another object controls one of the names (`<name>-hearth`): nothing is
    /// written.
    Blocked,
}

/// The outcome of [`decide_member`]: what to do, and what to tell (the Deployment's Event).
#[derive(Clone, Debug)]
pub struct MemberOutcome {
    /// The children, or leaving.
    pub decision: MemberDecision,
    /// What the Deployment's Event says; the endpoint compares it with its own verdict.
    pub state: MemberState,
}

/// What a member's reconcile last acted on, and its Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberState {
    /// The endpoint's verdict acted on (reason and message); `None` when the annotation names
    /// no endpoint.
    pub verdict: Option<(String, String)>,
    /// The shared gateway of the endpoint that accepted it.
    pub gateway: Option<SharedGateway>,
    /// The Event's reason: the verdict's, or why an accepted Deployment is not served.
    pub reason: String,
    /// The Event's note.
    pub note: String,
    /// Rule warnings (`field: message`), a Warning Event of their own.
    pub warnings: Vec<String>,
}

impl MemberState {
    fn new(verdict: Option<&Verdict>, reason: &str, note: impl Into<String>) -> Self {
        Self {
            verdict: verdict.map(|v| (v.reason.as_str().to_owned(), v.message.clone())),
            gateway: None,
            reason: reason.to_owned(),
            note: note.into(),
            warnings: Vec::new(),
        }
    }

    /// Whether it acted on what an endpoint decides now: `verdict`, and when accepted its
    /// `gateway`.
    pub fn agrees(&self, verdict: &Verdict, gateway: Option<&SharedGateway>) -> bool {
        self.verdict.as_ref().is_some_and(|(reason, message)| {
            reason == verdict.reason.as_str() && *message == verdict.message
        }) && (!verdict.accepted() || self.gateway.as_ref() == gateway)
    }
}

/// The runtime a Deployment names (`serving.hearth.dev/runtime` or `vendor`, as annotation or
/// label), resolved by the webhook's rule; `None` when it names none or it does not resolve.
pub fn member_runtime<'a>(
    d: &Deployment,
    runtimes: &'a [InferenceRuntime],
) -> Option<&'a InferenceRuntime> {
    let object = serde_json::to_value(d).ok()?;
    let selection = hearth_policies::Selection::from_object(&object)?;
    hearth_policies::resolve_runtime(runtimes, &selection).ok()
}

/// What an accepted Deployment serves: its member settings and port, or why it cannot be
/// served (the rules' errors as one line).
pub fn member_serving(
    d: &Deployment,
    runtimes: &[InferenceRuntime],
) -> Result<(DeploymentMember, MemberPort, rules::Findings), String> {
    let check = rules::check_deployment(d);
    let Some(member) = check.member else {
        return Err(rules::Findings(check.findings.errors().cloned().collect()).to_string());
    };
    let (port, serving) = rules::check_member_serving(d, &member, member_runtime(d, runtimes));
    let mut findings = check.findings;
    findings.0.extend(serving.0);
    match port {
        Some(port) if !findings.blocks_rendering() => Ok((member, port, findings)),
        _ => Err(rules::Findings(findings.errors().cloned().collect()).to_string()),
    }
}

/// The first child of `d` that another object controls, as `Kind name (controlled by Kind
/// name)`.
pub fn name_in_use(d: &Deployment, view: &MemberView) -> Option<String> {
    let uid = d.metadata.uid.as_deref();
    view.metas().into_iter().find_map(|(kind, meta)| {
        let meta = meta?;
        let owner = meta
            .owner_references
            .iter()
            .flatten()
            .find(|r| r.controller == Some(true) && Some(r.uid.as_str()) != uid)?;
        Some(format!(
            "{kind} {} (controlled by {} {})",
            meta.name.as_deref().unwrap_or_default(),
            owner.kind,
            owner.name
        ))
    })
}

/// Decides what the Deployment `d` (in the members' cache: it has the endpoint annotation)
/// needs: `verdict` is its endpoint's verdict on it (`None`: the annotation does not name an
/// endpoint), `endpoint` the endpoint when it exists, `runtimes` the cluster's.
pub fn decide_member(
    d: &Deployment,
    verdict: Option<&Verdict>,
    endpoint: Option<&LLMEndpoint>,
    runtimes: &[InferenceRuntime],
    view: &MemberView,
    cfg: &RenderConfig,
) -> MemberOutcome {
    let leave = |state| MemberOutcome {
        decision: MemberDecision::Leave,
        state,
    };
    let check = rules::check_deployment(d);
    let warnings = |f: &rules::Findings| f.warnings().map(ToString::to_string).collect::<Vec<_>>();
    let Some(verdict) = verdict else {
        // The annotation is not an endpoint reference: the rules say why.
        let mut state = MemberState::new(
            None,
            AttachReason::InvalidMember.as_str(),
            format!(
                "the Deployment cannot join an endpoint: {}; Hearth neither routes nor scales it",
                rules::Findings(check.findings.errors().cloned().collect())
            ),
        );
        state.warnings = warnings(&check.findings);
        return leave(state);
    };
    let mut state = MemberState::new(
        Some(verdict),
        verdict.reason.as_str(),
        verdict.message.clone(),
    );
    state.warnings = warnings(&check.findings);
    let Some(ep) = endpoint.filter(|_| verdict.accepted()) else {
        return leave(state);
    };
    let gateway = SharedGateway::of(ep);
    state.gateway = Some(gateway.clone());
    let (member, port, findings) = match member_serving(d, runtimes) {
        Ok(s) => s,
        Err(why) => {
            state.reason = AttachReason::InvalidMember.as_str().to_owned();
            state.note = format!(
                "accepted by LLMEndpoint {}/{}, but the Deployment cannot be served: {why}; Hearth neither routes nor scales it",
                gateway.namespace, gateway.endpoint
            );
            return leave(state);
        }
    };
    state.warnings = warnings(&findings);
    if let Some(taken) = name_in_use(d, view) {
        state.reason = "NameInUse".to_owned();
        state.note = format!(
            "{taken} has a name this Deployment's objects take (<name>-hearth): rename the Deployment or that object; meanwhile Hearth neither routes nor scales the Deployment"
        );
        return MemberOutcome {
            decision: MemberDecision::Blocked,
            state,
        };
    }
    match render_member(d, &member, &port, &gateway, cfg) {
        Ok(children) => {
            let name = names::member(&d.name_any());
            state.note = format!(
                "{}; KEDA scales the Deployment between {} and {} replicas on the model's demand (ScaledObject {name}), and the gateway reaches its pods through Service {name} (port {})",
                state.note, member.min_replicas, member.max_replicas, port.name
            );
            MemberOutcome {
                decision: MemberDecision::Join(Box::new(children)),
                state,
            }
        }
        Err(e) => {
            state.reason = AttachReason::InvalidMember.as_str().to_owned();
            state.note = format!("the Deployment cannot be rendered: {e}");
            leave(state)
        }
    }
}

/// Whether `meta` is controlled by the Deployment `deployment` (by name: a Deployment that is
/// gone has no UID to compare).
fn controlled_by(meta: &ObjectMeta, deployment: &str) -> bool {
    meta.owner_references.iter().flatten().any(|r| {
        r.controller == Some(true)
            && r.kind == "Deployment"
            && r.api_version == "apps/v1"
            && r.name == deployment
    })
}

/// The writes for the Deployment `deployment` (in its namespace): apply what the cache does
/// not hold yet (Role, RoleBinding, Service, then the ScaledObject, which scales it once the
/// gateway can find its pods: nothing without KEDA), or delete what of its children it
/// controls (the ScaledObject first: KEDA restores the replicas the Deployment had).
pub fn plan_member(deployment: &str, decision: &MemberDecision, view: &MemberView) -> Vec<Write> {
    let mut w = Vec::new();
    match decision {
        MemberDecision::Join(c) => {
            let c = c.as_ref().clone();
            apply_cached(&mut w, c.role, view.role.as_deref());
            apply_cached(&mut w, c.role_binding, view.role_binding.as_deref());
            apply_cached(&mut w, c.service, view.service.as_deref());
            if view.keda_installed {
                apply_cached(&mut w, c.scaled_object, view.scaled_object.as_deref());
            }
        }
        MemberDecision::Blocked => {}
        MemberDecision::Leave => {
            let name = names::member(deployment);
            for (kind, meta) in [
                (
                    Kind::ScaledObject,
                    view.scaled_object.as_deref().map(|o| &o.metadata),
                ),
                (Kind::Service, view.service.as_deref().map(|o| &o.metadata)),
                (
                    Kind::RoleBinding,
                    view.role_binding.as_deref().map(|o| &o.metadata),
                ),
                (Kind::Role, view.role.as_deref().map(|o| &o.metadata)),
            ] {
                if meta.is_some_and(|m| controlled_by(m, deployment)) {
                    w.push(Write::Delete(Target::new(kind, &name)));
                }
            }
        }
    }
    w
}

/// Reconciles one Deployment of the members' cache.
pub async fn reconcile_member(d: Arc<Deployment>, ctx: Arc<Context>) -> Result<Action, Error> {
    let span = info_span!("reconcile", deployment = %d.name_any(), namespace = %d.namespace().unwrap_or_default());
    async move {
        ctx.metrics.reconciles.inc();
        let start = std::time::Instant::now();
        let result = reconcile_member_inner(&d, &ctx).await;
        ctx.metrics.observe(
            start.elapsed(),
            result.as_ref().err().map(Error::metric_label),
        );
        if let Err(e) = &result {
            tracing::warn!(error = %e, "reconcile failed");
            publish(
                &ctx,
                &d.object_ref(&()),
                EventType::Warning,
                "ReconcileFailed",
                e.to_string(),
            )
            .await;
        }
        result
    }
    .instrument(span)
    .await
}

/// Requeue after a failure, by error type (see [`Error::backoff`]).
pub fn member_error_policy(_d: Arc<Deployment>, error: &Error, _ctx: Arc<Context>) -> Action {
    Action::requeue(error.backoff())
}

async fn reconcile_member_inner(d: &Deployment, ctx: &Context) -> Result<Action, Error> {
    if !ctx.caches_synced() {
        return Ok(Action::requeue(CACHE_SYNC_RETRY));
    }
    let namespace = d.namespace().unwrap_or_default();
    let name = d.name_any();
    let (verdict, endpoint) = match deployment_endpoint_key(d) {
        None => (None, None),
        Some(key) => {
            let (attachment, _, _) = ctx.attachment(&key, None);
            (
                attachment.deployment_verdict(&namespace, &name).cloned(),
                ctx.endpoint(&key),
            )
        }
    };
    let runtimes: Vec<InferenceRuntime> = ctx
        .runtimes
        .state()
        .iter()
        .filter(|r| r.metadata.deletion_timestamp.is_none())
        .map(|r| r.as_ref().clone())
        .collect();
    let view = ctx.member_view(&namespace, &name);
    let mut outcome = decide_member(
        d,
        verdict.as_ref(),
        endpoint.as_deref(),
        &runtimes,
        &view,
        &ctx.render_config(),
    );
    if let MemberDecision::Join(children) = &mut outcome.decision {
        crate::scaler_tls::stamp_shared(ctx, &mut children.scaled_object);
    }
    for write in plan_member(&name, &outcome.decision, &view) {
        send(ctx, &namespace, &write).await?;
    }
    let mut state = outcome.state;
    if !view.keda_installed && matches!(outcome.decision, MemberDecision::Join(_)) {
        state.reason = "KEDANotInstalled".to_owned();
        state.note = format!(
            "{}; but KEDA is not installed (no scaledobjects.keda.sh CRD): the Deployment keeps its replicas until it is",
            state.note
        );
    }
    ctx.set_member_state(&namespace, &name, state, &d.object_ref(&()))
        .await;
    Ok(Action::requeue(ctx.requeue))
}

/// One write; a deletion of something gone is done.
async fn send(ctx: &Context, namespace: &str, write: &Write) -> Result<(), Error> {
    match super::execute::send(ctx, namespace, write).await {
        Ok(()) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 404 && matches!(write, Write::Delete(_)) => Ok(()),
        // KEDA's CRD went away between the check and the apply: the next reconcile sees it.
        Err(kube::Error::Api(s))
            if s.code == 404 && matches!(write, Write::Apply(Object::ScaledObject(_))) =>
        {
            Ok(())
        }
        Err(e) => Err(kube_err(write.action(namespace))(e)),
    }
}

/// An Event on the Deployment `reference`.
pub(super) async fn publish(
    ctx: &Context,
    reference: &ObjectReference,
    type_: EventType,
    reason: &str,
    note: String,
) {
    let ev = KubeEvent {
        type_,
        reason: reason.to_owned(),
        note: Some(note.chars().take(1000).collect()),
        action: "Reconcile".to_owned(),
        secondary: None,
    };
    if let Err(e) = ctx.recorder.publish(&ev, reference).await {
        tracing::debug!(error = %e, "publishing event failed");
    }
}

/// The Events of a member whose state changed from `old` to `new`: the outcome (Normal when
/// accepted and served, else a Warning with its reason) and, when they changed, the rule
/// warnings.
pub fn events(old: Option<&MemberState>, new: &MemberState) -> Vec<(EventType, String, String)> {
    let mut out = Vec::new();
    if old.is_none_or(|o| (&o.reason, &o.note) != (&new.reason, &new.note)) {
        let type_ = if new.reason == AttachReason::Accepted.as_str() {
            EventType::Normal
        } else {
            EventType::Warning
        };
        out.push((type_, new.reason.clone(), new.note.clone()));
    }
    if !new.warnings.is_empty() && old.is_none_or(|o| o.warnings != new.warnings) {
        out.push((
            EventType::Warning,
            "MemberWarning".to_owned(),
            new.warnings.join("; "),
        ));
    }
    out
}

/// What [`sweep`] is asked to look at: a Deployment that may have left (its annotation removed,
/// or it is gone), by namespace and name.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Sweep {
    /// The Deployment's namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// Removes the children of Deployments that are not members (any more): their annotation was
/// removed (the members' cache no longer holds them, so no reconcile runs for them), or their
/// children are left from before a restart. A Deployment that is a member again is reconciled
/// instead; the objects of one that is gone are left to the garbage collector. Runs until `rx`
/// closes.
pub(super) async fn sweep(ctx: Arc<Context>, mut rx: mpsc::UnboundedReceiver<Sweep>) {
    // Objects deleted a moment ago (by UID): the caches may still hold them (and each child's
    // change sends a request here), which is not a reason to delete them again.
    let mut recent: std::collections::HashMap<String, std::time::Instant> =
        std::collections::HashMap::new();
    while let Some(s) = rx.next().await {
        // A child seen before the members' cache is complete may belong to a member.
        while !ctx.caches_synced() {
            tokio::time::sleep(CACHE_SYNC_RETRY).await;
        }
        recent.retain(|_, at| at.elapsed() < SWEEP_SETTLE);
        let member = ObjectRef::<Deployment>::new(&s.name).within(&s.namespace);
        if ctx.members.get(&member).is_some() {
            let _ = ctx.member_tx.unbounded_send(member);
            continue;
        }
        let mut view = ctx.member_view(&s.namespace, &s.name);
        view.forget(|uid| recent.contains_key(uid));
        let writes = plan_member(&s.name, &MemberDecision::Leave, &view);
        if writes.is_empty() {
            ctx.forget_member(&s.namespace, &s.name);
            continue;
        }
        let span = info_span!("sweep", deployment = %s.name, namespace = %s.namespace);
        let now = std::time::Instant::now();
        let uids = view.uids();
        match sweep_one(&ctx, &s, &writes).instrument(span.clone()).await {
            Ok(Some(d)) => {
                recent.extend(uids.into_iter().map(|u| (u, now)));
                ctx.forget_member(&s.namespace, &s.name);
                tracing::info!(parent: &span, writes = writes.len(), "the Deployment left its endpoint; its objects are removed");
                publish(
                    &ctx,
                    &d.object_ref(&()),
                    EventType::Normal,
                    "LeftEndpoint",
                    format!(
                        "without the serving.hearth.dev/endpoint annotation the Deployment left its LLMEndpoint: {} removed (KEDA gives the Deployment back the replicas it had before it joined)",
                        writes
                            .iter()
                            .map(|w| {
                                let (_, t) = w.parts();
                                format!("{} {}", t.kind.as_str(), t.name)
                            })
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                )
                .await;
            }
            // Gone, or a member again: nothing here.
            Ok(None) => {
                ctx.forget_member(&s.namespace, &s.name);
            }
            Err(e) => {
                tracing::warn!(parent: &span, error = %e, "removing a joined Deployment's objects failed; retrying");
                let tx = ctx.sweep_tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(ERROR_RETRY).await;
                    let _ = tx.unbounded_send(s);
                });
            }
        }
    }
}

/// How long the sweeper takes an object it deleted for gone, though a cache still holds it.
const SWEEP_SETTLE: std::time::Duration = std::time::Duration::from_secs(30);

/// Sweeps the objects of `s` with `writes`, once the API says the Deployment exists without
/// the endpoint annotation (returned); `None` when it is gone (the garbage collector removes
/// its objects) or joins again (then it is reconciled).
async fn sweep_one(
    ctx: &Context,
    s: &Sweep,
    writes: &[Write],
) -> Result<Option<Deployment>, Error> {
    let api: kube::Api<Deployment> = kube::Api::namespaced(ctx.client.clone(), &s.namespace);
    let live = api.get_opt(&s.name).await.map_err(kube_err(format!(
        "get Deployment {}/{}",
        s.namespace, s.name
    )))?;
    let Some(d) = live else {
        return Ok(None);
    };
    if d.annotations().contains_key(ENDPOINT_ANNOTATION) {
        let _ = ctx.member_tx.unbounded_send(ObjectRef::from_obj(&d));
        return Ok(None);
    }
    for write in writes {
        send(ctx, &s.namespace, write).await?;
    }
    Ok(Some(d))
}

#[cfg(test)]
mod tests;

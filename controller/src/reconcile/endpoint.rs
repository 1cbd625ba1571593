//! The `LLMEndpoint` reconciler: the endpoint's shared gateway and routing table, and its
//! status. Shaped like the services' (a pure plan, then its writes by server-side apply under
//! the one field manager, then the status when it differs):
//!
//! 1. [`crate::attach::attach`] over the caches decides which services the endpoint accepts
//!    (the same call each service's reconcile makes for its `EndpointAccepted` condition);
//! 2. each accepted service's route ([`crate::render::model_route`], with its resolved
//!    runtime), each accepted Deployment's ([`crate::render::member_route`]), plus the routes
//!    [`held_routes`] keeps for services leaving until their own gateway is up, make the
//!    [`RouteTable`];
//! 3. [`plan_endpoint`] renders the children ([`crate::render::render_endpoint`]) and decides
//!    the writes against the caches ([`EndpointView`]) and the conditions `Accepted` and
//!    `Ready`;
//! 4. the services whose verdict differs from what their status says, and every accepted one
//!    when the gateway's readiness changed, are reconciled at once (the services' controller's
//!    `reconcile_on` channel); so are the Deployments whose verdict (or gateway) differs from
//!    what their last reconcile acted on (the members' controller's).

use std::{collections::BTreeSet, sync::Arc, time::Instant};

use hearth_crds::{
    InferenceRuntime, LLMEndpoint, LLMEndpointStatus, LLMService,
    llmendpoint::{EndpointConflict, EndpointModel, MemberKind, ModelRoute, RouteTable},
    rules,
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{ConfigMap, Service, ServiceAccount},
        networking::v1::NetworkPolicy,
        policy::v1::PodDisruptionBudget,
        rbac::v1::{Role, RoleBinding},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
};
use kube::{
    ResourceExt,
    runtime::{controller::Action, reflector::ObjectRef},
};
use tracing::{Instrument, info_span};

use super::{
    CACHE_SYNC_RETRY, Context, Error, kube_err, member,
    plan::{apply_cached, apply_or_delete},
    write::{Kind, Target, Write},
};
use crate::{
    attach::{Attachment, EndpointKey, Verdict, endpoint_key, endpoint_url},
    names,
    render::{
        RenderConfig, RenderError, SharedGateway, member_route, model_route, render_endpoint,
    },
    resolve::resolve_runtime,
    status::{self, Cond},
};

/// `Accepted`: the endpoint's spec passes its rules and its children can be written.
pub const ACCEPTED: &str = "Accepted";

/// How soon an endpoint that holds a leaving service's route looks again.
pub const HOLD_RETRY: std::time::Duration = std::time::Duration::from_secs(2);

/// What the caches hold of one endpoint's children (`None` where one is not there).
#[derive(Clone, Debug, Default)]
pub struct EndpointView {
    /// ServiceAccount `<ep>-gateway`.
    pub service_account: Option<Arc<ServiceAccount>>,
    /// Role `<ep>-gateway`.
    pub role: Option<Arc<Role>>,
    /// RoleBinding `<ep>-gateway`.
    pub role_binding: Option<Arc<RoleBinding>>,
    /// ConfigMap `<ep>-routes`.
    pub routes: Option<Arc<ConfigMap>>,
    /// Service `<ep>`.
    pub gateway_service: Option<Arc<Service>>,
    /// Service `<ep>-scaler`.
    pub scaler_service: Option<Arc<Service>>,
    /// Service `<ep>-gateway-admin`.
    pub admin_service: Option<Arc<Service>>,
    /// Deployment `<ep>-gateway`.
    pub gateway: Option<Arc<Deployment>>,
    /// PodDisruptionBudget `<ep>-gateway`.
    pub gateway_pdb: Option<Arc<PodDisruptionBudget>>,
    /// NetworkPolicy `<ep>-gateway`.
    pub gateway_network_policy: Option<Arc<NetworkPolicy>>,
}

/// What one endpoint reconcile does: the writes, in order, and the status.
#[derive(Debug)]
pub struct EndpointPlan {
    /// The writes, in order.
    pub writes: Vec<Write>,
    /// `Accepted` and `Ready`.
    pub conds: Vec<Cond>,
    /// `status.models`: what the gateway routes, sorted by name.
    pub models: Vec<EndpointModel>,
    /// `status.conflicts`.
    pub conflicts: Vec<EndpointConflict>,
}

impl EndpointPlan {
    /// The condition of `type_`.
    pub fn condition(&self, type_: &str) -> Option<&Cond> {
        self.conds.iter().find(|c| c.type_ == type_)
    }

    /// The status to write, with `lastTransitionTime` kept where a condition's status did not
    /// change.
    pub fn status(&self, ep: &LLMEndpoint, now: &Time) -> LLMEndpointStatus {
        let previous = ep
            .status
            .as_ref()
            .map(|s| s.conditions.as_slice())
            .unwrap_or_default();
        LLMEndpointStatus {
            endpoint_url: Some(endpoint_url(&EndpointKey::of(ep))),
            observed_generation: ep.metadata.generation,
            attached_services: i32::try_from(self.models.len()).unwrap_or(i32::MAX),
            models: self.models.clone(),
            conflicts: self.conflicts.clone(),
            conditions: status::merge_conditions(
                previous,
                &self.conds,
                ep.metadata.generation,
                now,
            ),
        }
    }
}

/// What an endpoint's gateway routes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EndpointRoutes {
    /// The routing table: the accepted services' routes and the held ones.
    pub table: RouteTable,
    /// The models routed for services leaving ([`held_routes`]).
    pub held: Vec<EndpointModel>,
    /// Whether an accepted service asks for its demand by push (its scaler annotation): the
    /// endpoint then renders its scaler Service.
    pub push_services: bool,
}

/// The routing table of `routes`: sorted by model, one route per model name and per service
/// key (`<namespace>/<service>`), the first of `routes` keeping each. [`crate::attach`]
/// resolved conflicts and a held route never shares a name with an accepted one, but a held
/// service and a Deployment of the same namespace and name accepted meanwhile share a key, and
/// the gateway refuses a whole table that repeats one (its last good table would stay).
pub fn route_table(routes: Vec<ModelRoute>) -> RouteTable {
    let mut names = BTreeSet::new();
    let mut keys = BTreeSet::new();
    let mut routes: Vec<ModelRoute> = routes
        .into_iter()
        .filter(|r| {
            let key = r.key();
            if names.contains(&r.model) || keys.contains(&key) {
                return false;
            }
            names.insert(r.model.clone());
            keys.insert(key);
            true
        })
        .collect();
    routes.sort_by(|a, b| (&a.model, &a.namespace).cmp(&(&b.model, &b.namespace)));
    RouteTable { models: routes }
}

/// The models `ep` routed before (its `status.models`) for services (not Deployments) it no
/// longer accepts, kept
/// while the service leaving has no available gateway of its own yet, so clients of the model
/// are served through the change: the service still exists and is not being deleted
/// (`service`), its own gateway has no ready replica (`own_gateway_ready`), no other endpoint
/// accepts it now (`accepted_elsewhere`: it then renders no gateway of its own to wait for, and
/// that endpoint routes it), and no accepted service claims the model name now.
pub fn held_routes<'a>(
    ep: &LLMEndpoint,
    attachment: &Attachment,
    service: impl Fn(&str, &str) -> Option<&'a LLMService>,
    own_gateway_ready: impl Fn(&str, &str) -> bool,
    accepted_elsewhere: impl Fn(&LLMService) -> bool,
) -> Vec<EndpointModel> {
    let is_service = |m: &&EndpointModel| MemberKind::of(m.kind) == MemberKind::LLMService;
    let accepted: BTreeSet<(&str, &str)> = attachment
        .models
        .iter()
        .filter(is_service)
        .map(|m| (m.namespace.as_str(), m.service.as_str()))
        .collect();
    let names: BTreeSet<&str> = attachment.models.iter().map(|m| m.name.as_str()).collect();
    let previous = ep
        .status
        .as_ref()
        .map(|s| s.models.as_slice())
        .unwrap_or_default();
    // A Deployment leaving has no gateway of its own to wait for: its route goes at once.
    previous
        .iter()
        .filter(is_service)
        .filter(|m| !accepted.contains(&(m.namespace.as_str(), m.service.as_str())))
        .filter(|m| !names.contains(m.name.as_str()))
        .filter(|m| {
            service(&m.namespace, &m.service)
                .is_some_and(|s| s.metadata.deletion_timestamp.is_none() && !accepted_elsewhere(s))
        })
        .filter(|m| !own_gateway_ready(&m.namespace, &m.service))
        .cloned()
        .collect()
}

/// The children of `ep` controlled by another object (a service of the same name renders the
/// same names): the first one as `Kind name (controlled by Kind name)`.
fn name_in_use(ep: &LLMEndpoint, view: &EndpointView) -> Option<String> {
    let uid = ep.metadata.uid.as_deref();
    let others: [(&str, Option<&ObjectMeta>); 9] = [
        (
            "ServiceAccount",
            view.service_account.as_deref().map(|o| &o.metadata),
        ),
        ("Role", view.role.as_deref().map(|o| &o.metadata)),
        (
            "RoleBinding",
            view.role_binding.as_deref().map(|o| &o.metadata),
        ),
        ("ConfigMap", view.routes.as_deref().map(|o| &o.metadata)),
        (
            "Service",
            view.gateway_service.as_deref().map(|o| &o.metadata),
        ),
        (
            "Service",
            view.scaler_service.as_deref().map(|o| &o.metadata),
        ),
        (
            "Service",
            view.admin_service.as_deref().map(|o| &o.metadata),
        ),
        ("Deployment", view.gateway.as_deref().map(|o| &o.metadata)),
        (
            "PodDisruptionBudget",
            view.gateway_pdb.as_deref().map(|o| &o.metadata),
        ),
    ];
    others.iter().find_map(|(kind, meta)| {
        let meta = (*meta)?;
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

/// Decides every write of `ep` and its conditions: its children rendered with `routes`, against
/// what the caches hold (`view`); `attachment` holds the verdicts, and with the held routes what
/// the gateway routes (`status.models`). `scaler_record`: the ExternalScaler certificates'
/// issuance, recorded on the gateway Deployment (`crate::scaler_tls::endpoint_step`).
pub fn plan_endpoint(
    ep: &LLMEndpoint,
    attachment: &Attachment,
    routes: &EndpointRoutes,
    view: &EndpointView,
    cfg: &RenderConfig,
    scaler_record: Option<&crate::scaler_tls::Record>,
) -> EndpointPlan {
    let mut models = attachment.models.clone();
    models.extend(routes.held.iter().cloned());
    models.sort_by(|a, b| (&a.name, &a.namespace).cmp(&(&b.name, &b.namespace)));
    let mut plan = EndpointPlan {
        writes: Vec::new(),
        conds: Vec::new(),
        models,
        conflicts: attachment.conflicts.clone(),
    };
    let not_ready = |message: &str| {
        Cond::new(
            status::READY,
            Some(false),
            "NotAccepted",
            format!("nothing is rendered: {message}"),
        )
    };
    let mut children = match render_endpoint(ep, &routes.table, routes.push_services, cfg) {
        Ok(c) => c,
        Err(e) => {
            let reason = match &e {
                RenderError::Rules(f) => f
                    .first_error()
                    .map(|f| f.reason.as_str())
                    .unwrap_or("InvalidSpec"),
                _ => "InvalidSpec",
            };
            plan.conds = vec![
                Cond::new(ACCEPTED, Some(false), reason, e.to_string()),
                not_ready("see the Accepted condition"),
            ];
            return plan;
        }
    };
    if let Some(taken) = name_in_use(ep, view) {
        let message = format!(
            "{taken} has a name this endpoint's children take (<name>, <name>-gateway, <name>-gateway-admin, <name>-scaler, <name>-routes): an LLMEndpoint cannot share its name with an LLMService in its namespace; rename one of them"
        );
        plan.conds = vec![
            Cond::new(ACCEPTED, Some(false), "NameInUse", message),
            not_ready("see the Accepted condition"),
        ];
        return plan;
    }
    if let Some(r) = scaler_record {
        r.annotate(&mut children.gateway);
    }
    let w = &mut plan.writes;
    apply_cached(w, children.service_account, view.service_account.as_deref());
    apply_cached(w, children.role, view.role.as_deref());
    apply_cached(w, children.role_binding, view.role_binding.as_deref());
    // The table before the gateway that reads it.
    apply_cached(w, children.routes, view.routes.as_deref());
    let name = ep.name_any();
    apply_or_delete(
        w,
        children.gateway_network_policy,
        Target::new(Kind::NetworkPolicy, names::gateway(&name)),
        view.gateway_network_policy.as_deref(),
        ep,
    );
    apply_cached(w, children.gateway_service, view.gateway_service.as_deref());
    apply_cached(w, children.admin_service, view.admin_service.as_deref());
    apply_or_delete(
        w,
        children.scaler_service,
        Target::new(Kind::Service, names::scaler_service(&name)),
        view.scaler_service.as_deref(),
        ep,
    );
    apply_cached(w, children.gateway, view.gateway.as_deref());
    apply_cached(w, children.gateway_pdb, view.gateway_pdb.as_deref());

    let warnings = rules::check_llmendpoint(ep);
    let n = plan.models.len();
    plan.conds.push(match warnings.warnings().next() {
        Some(first) => Cond::new(
            ACCEPTED,
            Some(true),
            first.reason.as_str(),
            format!("{n} model(s) routed, with warnings: {warnings}"),
        ),
        None => Cond::new(
            ACCEPTED,
            Some(true),
            "Accepted",
            format!("{n} model(s) routed"),
        ),
    });
    let available = view
        .gateway
        .as_deref()
        .and_then(|d| d.status.as_ref())
        .and_then(|s| s.available_replicas)
        .unwrap_or(0);
    let gateway = names::gateway(&name);
    plan.conds.push(if available > 0 {
        Cond::new(
            status::READY,
            Some(true),
            "GatewayAvailable",
            format!("{available} replica(s) of Deployment {gateway} available"),
        )
    } else {
        let mut message = format!("no replica of Deployment {gateway} is available yet");
        if let Some(r) = &ep.spec.api_key_secret_ref {
            message = format!(
                "{message}; the gateway mounts the API keys from key {:?} of Secret {:?}: until both exist its pods wait in ContainerCreating (FailedMount events on its pods)",
                r.key, r.name
            );
        }
        Cond::new(status::READY, Some(false), "GatewayNotReady", message)
    });
    plan
}

/// Reconciles one `LLMEndpoint`.
pub async fn reconcile_endpoint(ep: Arc<LLMEndpoint>, ctx: Arc<Context>) -> Result<Action, Error> {
    let span = info_span!("reconcile", llmendpoint = %ep.name_any(), namespace = %ep.namespace().unwrap_or_default());
    async move {
        ctx.metrics.reconciles.inc();
        let start = Instant::now();
        let result = reconcile_endpoint_inner(&ep, &ctx).await;
        ctx.metrics.observe(
            start.elapsed(),
            result.as_ref().err().map(Error::metric_label),
        );
        if let Err(e) = &result {
            tracing::warn!(error = %e, "reconcile failed");
        }
        result
    }
    .instrument(span)
    .await
}

/// Requeue after a failure, by error type (see [`Error::backoff`]).
pub fn endpoint_error_policy(_ep: Arc<LLMEndpoint>, error: &Error, _ctx: Arc<Context>) -> Action {
    Action::requeue(error.backoff())
}

async fn reconcile_endpoint_inner(ep: &LLMEndpoint, ctx: &Context) -> Result<Action, Error> {
    if !ctx.caches_synced() {
        return Ok(Action::requeue(CACHE_SYNC_RETRY));
    }
    let key = EndpointKey::of(ep);
    let (attachment, members, deployments) = ctx.attachment(&key, None);
    if ep.metadata.deletion_timestamp.is_some() {
        // Its services leave (they render their own gateways again), and its Deployments (their
        // ScaledObjects go: KEDA gives them their replicas back); the garbage collector
        // removes its children.
        ctx.reconcile_services(members.iter().filter(|s| stale(s, &attachment)));
        ctx.reconcile_members(deployments.iter());
        return Ok(Action::await_change());
    }
    let runtimes = ctx.runtimes.state();
    let route = |svc: &LLMService| -> Option<ModelRoute> {
        let resolved = resolve_runtime(svc, runtimes.iter().map(|r| r.as_ref())).ok()?;
        if rules::check_llmservice(svc, Some(resolved.runtime)).blocks_rendering() {
            return None;
        }
        let mut r = model_route(svc, resolved.runtime, &ctx.accepted_adapters(svc)).ok()?;
        // Only the aliases the attachment gave it (none for a service held while it leaves):
        // the gateway refuses a table where two routes share a name.
        let aliases = attachment.aliases_of(&r.namespace, &r.service);
        r.aliases.retain(|a| aliases.contains(a));
        Some(r)
    };
    // The services it routed before, wherever their reference points now.
    let routed_before: Vec<Arc<LLMService>> = ep
        .status
        .iter()
        .flat_map(|s| &s.models)
        .filter(|m| MemberKind::of(m.kind) == MemberKind::LLMService)
        .filter_map(|m| ctx.llmservice(&m.namespace, &m.service))
        .collect();
    let held = held_routes(
        ep,
        &attachment,
        |ns, name| {
            routed_before
                .iter()
                .find(|s| s.namespace().as_deref() == Some(ns) && s.name_any() == name)
                .map(AsRef::as_ref)
        },
        |ns, name| status::gateway_ready(ctx.deployment(ns, &names::gateway(name)).as_deref()) > 0,
        |svc| {
            endpoint_key(svc)
                .filter(|k| *k != key)
                .is_some_and(|other| {
                    ctx.attachment(&other, None)
                        .0
                        .verdict(&svc.namespace().unwrap_or_default(), &svc.name_any())
                        .is_some_and(Verdict::accepted)
                })
        },
    );
    let held_services: Vec<Arc<LLMService>> = held
        .iter()
        .filter_map(|m| ctx.llmservice(&m.namespace, &m.service))
        .collect();
    // Accepted services that cannot be rendered (no runtime, a rule error) hold their name but
    // are not routed until they can.
    let accepted: Vec<&Arc<LLMService>> = attachment
        .models
        .iter()
        .filter(|m| MemberKind::of(m.kind) == MemberKind::LLMService)
        .filter_map(|m| {
            members.iter().find(|s| {
                s.namespace().as_deref() == Some(m.namespace.as_str()) && s.name_any() == m.service
            })
        })
        .collect();
    // Accepted Deployments that can be served (their runtime's port found, no rule error) and
    // whose objects' names are theirs; the others hold their name but are not routed, and
    // their reconcile says why in an Event.
    let runtime_list: Vec<InferenceRuntime> = runtimes
        .iter()
        .filter(|r| r.metadata.deletion_timestamp.is_none())
        .map(|r| r.as_ref().clone())
        .collect();
    let served: Vec<ModelRoute> = attachment
        .models
        .iter()
        .filter(|m| MemberKind::of(m.kind) == MemberKind::Deployment)
        .filter_map(|m| {
            deployments.iter().find(|d| {
                d.namespace().as_deref() == Some(m.namespace.as_str()) && d.name_any() == m.service
            })
        })
        .filter(|d| {
            let view = ctx.member_view(&d.namespace().unwrap_or_default(), &d.name_any());
            member::name_in_use(d, &view).is_none()
        })
        .filter_map(|d| {
            let (member, port, _) = member::member_serving(d, &runtime_list).ok()?;
            member_route(d, &member, &port).ok()
        })
        .collect();
    let push_deployments = attachment
        .models
        .iter()
        .filter(|m| MemberKind::of(m.kind) == MemberKind::Deployment)
        .filter_map(|m| {
            deployments.iter().find(|d| {
                d.namespace().as_deref() == Some(m.namespace.as_str()) && d.name_any() == m.service
            })
        })
        .any(|d| rules::scaler_mode_of(&d.metadata) == Ok(rules::ScalerMode::Push));
    let routes = EndpointRoutes {
        table: route_table(
            accepted
                .iter()
                .copied()
                .chain(held_services.iter())
                .filter_map(|s| route(s))
                .chain(served)
                .collect(),
        ),
        held,
        push_services: push_deployments
            || accepted
                .iter()
                .any(|s| rules::scaler_mode(s) == Ok(rules::ScalerMode::Push)),
    };
    let view = ctx.endpoint_view(&key);
    let cfg = ctx.render_config();
    // Before the gateway Deployment that mounts it, which carries its record; only for a
    // gateway this endpoint renders and controls (a service of the same name keeps its own
    // certificates, and an endpoint that renders nothing gets none).
    let renders =
        !rules::check_llmendpoint(ep).blocks_rendering() && name_in_use(ep, &view).is_none();
    let scaler_record = if renders {
        crate::scaler_tls::endpoint_step(ctx, ep, view.gateway.as_deref(), cfg.shared_scaler_tls())
            .await?
    } else {
        None
    };
    let mut plan = plan_endpoint(
        ep,
        &attachment,
        &routes,
        &view,
        &cfg,
        scaler_record.as_ref(),
    );
    let namespace = key.namespace.as_str();
    if !plan.writes.is_empty() {
        // Before the gateway Deployment that mounts it.
        crate::admin_tokens::step(ctx, ep).await?;
    }
    for write in std::mem::take(&mut plan.writes) {
        if let Err(e) = super::execute::send(ctx, namespace, &write).await {
            match (&write, &e) {
                (Write::Delete(_), kube::Error::Api(s)) if s.code == 404 => {}
                _ => return Err(kube_err(write.action(namespace))(e)),
            }
        }
    }
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    let status = plan.status(ep, &now);
    let was_ready = ep
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == status::READY))
        .map(|c| c.status.clone());
    if ep.status.as_ref() != Some(&status) {
        super::execute::write_status(ctx, ep, &status).await?;
    }
    let is_ready = plan.condition(status::READY).map(|c| c.status.to_owned());
    // The services whose verdict changed; and, when the gateway's readiness changed, every
    // accepted one (their Ready follows it).
    let readiness_changed = was_ready != is_ready;
    ctx.reconcile_services(members.iter().filter(|s| {
        stale(s, &attachment)
            || (readiness_changed
                && attachment
                    .verdict(&s.namespace().unwrap_or_default(), &s.name_any())
                    .is_some_and(|v| v.accepted()))
    }));
    // The Deployments whose verdict (or, accepted, the gateway their objects point at) is not
    // what their last reconcile acted on.
    let gateway = SharedGateway::of(ep);
    ctx.reconcile_members(deployments.iter().filter(|d| {
        let (ns, name) = (d.namespace().unwrap_or_default(), d.name_any());
        attachment
            .deployment_verdict(&ns, &name)
            .is_some_and(|v| ctx.member_stale(&ns, &name, v, v.accepted().then_some(&gateway)))
    }));
    Ok(Action::requeue(if routes.held.is_empty() {
        ctx.requeue
    } else {
        HOLD_RETRY
    }))
}

/// Whether `svc`'s `EndpointAccepted` condition says something else than its verdict in
/// `attachment` (its reconcile has not seen the change yet).
fn stale(svc: &Arc<LLMService>, attachment: &Attachment) -> bool {
    let Some(v) = attachment.verdict(&svc.namespace().unwrap_or_default(), &svc.name_any()) else {
        return false;
    };
    let current = svc.status.as_ref().and_then(|s| {
        s.conditions
            .iter()
            .find(|c| c.type_ == status::ENDPOINT_ACCEPTED)
    });
    !current.is_some_and(|c| {
        c.reason == v.reason.as_str()
            && c.message == v.message
            && (c.status == "True") == v.accepted()
    })
}

/// The endpoints whose status lists the object of `kind` `namespace/name` (as a model or a
/// conflict): where it was, when its reference changed.
pub(super) fn listing(ep: &LLMEndpoint, kind: MemberKind, namespace: &str, name: &str) -> bool {
    ep.status.as_ref().is_some_and(|s| {
        s.models.iter().any(|m| {
            MemberKind::of(m.kind) == kind && m.namespace == namespace && m.service == name
        }) || s.conflicts.iter().any(|c| {
            MemberKind::of(c.kind) == kind && c.namespace == namespace && c.service == name
        })
    })
}

/// An `ObjectRef` to the endpoint `key`.
pub(super) fn endpoint_ref(key: &EndpointKey) -> ObjectRef<LLMEndpoint> {
    ObjectRef::new(&key.name).within(&key.namespace)
}

#[cfg(test)]
mod tests;

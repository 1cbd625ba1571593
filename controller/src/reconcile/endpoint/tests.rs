//! Table tests of [`plan_endpoint`] and [`held_routes`]: an endpoint, the caches of its
//! children, and the writes and conditions they lead to.

use std::collections::BTreeMap;

use hearth_crds::llmendpoint::{AttachReason, EndpointModel};
use k8s_openapi::{
    api::apps::v1::DeploymentStatus, apimachinery::pkg::apis::meta::v1::OwnerReference,
};
use rstest::rstest;
use serde_json::{Value, json};

use super::*;
use crate::attach::Verdict;

fn endpoint(patch: Value) -> LLMEndpoint {
    let mut ep = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "shared", "namespace": "platform", "uid": "ep-uid", "generation": 3},
        "spec": {"allowedServices": {"namespaces": {"from": "All"}}},
    });
    hearth_test_support::merge_json(&mut ep, patch);
    serde_json::from_value(ep).unwrap()
}

fn cfg() -> RenderConfig {
    RenderConfig::builtin().unwrap()
}

fn model(ns: &str, name: &str) -> EndpointModel {
    EndpointModel {
        name: name.to_owned(),
        namespace: ns.to_owned(),
        service: name.to_owned(),
        kind: None,
    }
}

/// Two services accepted, one refused.
fn attachment() -> Attachment {
    let verdict = |reason| Verdict {
        reason,
        message: String::new(),
    };
    Attachment {
        verdicts: BTreeMap::from([
            (
                ("team-a".into(), "chat".into()),
                verdict(AttachReason::Accepted),
            ),
            (
                ("team-b".into(), "code".into()),
                verdict(AttachReason::Accepted),
            ),
            (
                ("team-c".into(), "chat".into()),
                verdict(AttachReason::ModelNameConflict),
            ),
        ]),
        models: vec![model("team-a", "chat"), model("team-b", "code")],
        conflicts: vec![EndpointConflict {
            namespace: "team-c".into(),
            service: "chat".into(),
            model: "chat".into(),
            reason: "ModelNameConflict".into(),
            message: "held by team-a/chat".into(),
            kind: None,
        }],
        deployment_verdicts: BTreeMap::new(),
        aliases: BTreeMap::new(),
    }
}

fn table(models: &[&str]) -> RouteTable {
    route_table(
        models
            .iter()
            .map(|m| {
                serde_json::from_value(json!({
                    "model": m, "namespace": "team-a", "service": m,
                    "backendService": format!("{m}-backend"), "backendPortName": "http",
                    "maxQueue": 100, "heartbeatInterval": "10s", "activationTimeout": "5m",
                    "metricTarget": 10.0,
                }))
                .unwrap()
            })
            .collect(),
    )
}

/// The caches once everything `ep` asks for with `routes` was applied.
fn steady(ep: &LLMEndpoint, routes: &RouteTable) -> EndpointView {
    let c = crate::render::render_endpoint(ep, routes, false, &cfg()).unwrap();
    EndpointView {
        service_account: Some(Arc::new(crate::diff::stamped(c.service_account))),
        role: Some(Arc::new(crate::diff::stamped(c.role))),
        role_binding: Some(Arc::new(crate::diff::stamped(c.role_binding))),
        routes: Some(Arc::new(crate::diff::stamped(c.routes))),
        gateway_service: Some(Arc::new(crate::diff::stamped(c.gateway_service))),
        scaler_service: c.scaler_service.map(|o| Arc::new(crate::diff::stamped(o))),
        admin_service: Some(Arc::new(crate::diff::stamped(c.admin_service))),
        gateway: Some(Arc::new(crate::diff::stamped(c.gateway))),
        gateway_pdb: Some(Arc::new(crate::diff::stamped(c.gateway_pdb))),
        gateway_network_policy: c
            .gateway_network_policy
            .map(|o| Arc::new(crate::diff::stamped(o))),
    }
}

fn of(table: RouteTable) -> EndpointRoutes {
    EndpointRoutes {
        table,
        ..Default::default()
    }
}

fn writes(plan: &EndpointPlan) -> Vec<String> {
    plan.writes.iter().map(ToString::to_string).collect()
}

fn cond<'a>(plan: &'a EndpointPlan, type_: &str) -> (&'static str, &'a str) {
    let c = plan
        .condition(type_)
        .unwrap_or_else(|| panic!("no {type_} in {:?}", plan.conds));
    (c.status, c.reason.as_str())
}

const PUSH: &str = "serving.hearth.dev/scaler";

#[rstest]
#[case::steady_state_writes_nothing(json!({}), |_: &mut EndpointView| {}, &["chat"], &[])]
#[case::a_new_endpoint_gets_everything(json!({}), |v: &mut EndpointView| *v = EndpointView::default(), &["chat"], &[
    "apply ServiceAccount shared-gateway",
    "apply Role shared-gateway",
    "apply RoleBinding shared-gateway",
    "apply ConfigMap shared-routes",
    "apply Service shared",
    "apply Service shared-gateway-admin",
    "apply Deployment shared-gateway",
    "apply PodDisruptionBudget shared-gateway",
])]
#[case::a_push_endpoint_gets_its_scaler_service(json!({"metadata": {"annotations": {PUSH: "push"}}}), |v: &mut EndpointView| v.scaler_service = None, &["chat"], &[
    "apply Service shared-scaler",
])]
// A service joining changes the table only: the gateway is not rolled.
#[case::a_service_joining_writes_only_the_table(json!({}), |v: &mut EndpointView| {
    *v = steady(&endpoint(json!({})), &table(&[]));
}, &["chat"], &["apply ConfigMap shared-routes"])]
#[case::more_replicas_roll_the_gateway(json!({"spec": {"replicas": 2}}), |v: &mut EndpointView| {
    *v = steady(&endpoint(json!({})), &table(&["chat"]));
}, &["chat"], &["apply Deployment shared-gateway"])]
#[case::its_scaler_service_goes_in_poll_mode(json!({}), |v: &mut EndpointView| {
    v.scaler_service = v.gateway_service.clone();
}, &["chat"], &["delete Service shared-scaler"])]
fn writes_per_case(
    #[case] patch: Value,
    #[case] edit: fn(&mut EndpointView),
    #[case] models: &[&str],
    #[case] want: &[&str],
) {
    let ep = endpoint(patch);
    let routes = table(models);
    let mut view = steady(&ep, &routes);
    edit(&mut view);
    let plan = plan_endpoint(&ep, &attachment(), &of(routes), &view, &cfg(), None);
    assert_eq!(writes(&plan), want);
    assert_eq!(cond(&plan, ACCEPTED), ("True", "Accepted"));
}

#[test]
fn an_endpoint_breaking_the_rules_is_not_accepted_and_writes_nothing() {
    let ep = endpoint(json!({"spec": {"allowedServices": {"namespaces": {"from": "Selector"}}}}));
    let plan = plan_endpoint(
        &ep,
        &attachment(),
        &of(table(&[])),
        &EndpointView::default(),
        &cfg(),
        None,
    );
    assert!(plan.writes.is_empty());
    assert_eq!(cond(&plan, ACCEPTED), ("False", "InvalidSpec"));
    assert_eq!(cond(&plan, status::READY), ("False", "NotAccepted"));
    let msg = &plan.condition(ACCEPTED).unwrap().message;
    assert!(
        msg.contains("spec.allowedServices.namespaces.selector"),
        "{msg}"
    );
}

#[test]
fn an_endpoint_named_like_a_service_of_its_namespace_takes_none_of_its_children() {
    let ep = endpoint(json!({}));
    let routes = table(&["chat"]);
    let mut view = steady(&ep, &routes);
    let mut s = Service::clone(view.gateway_service.as_deref().unwrap());
    s.metadata.owner_references = Some(vec![OwnerReference {
        api_version: "serving.hearth.dev/v1alpha1".into(),
        kind: "LLMService".into(),
        name: "shared".into(),
        uid: "svc-uid".into(),
        controller: Some(true),
        block_owner_deletion: None,
    }]);
    view.gateway_service = Some(Arc::new(s));
    let plan = plan_endpoint(&ep, &attachment(), &of(routes.clone()), &view, &cfg(), None);
    assert!(plan.writes.is_empty(), "{:?}", writes(&plan));
    assert_eq!(cond(&plan, ACCEPTED), ("False", "NameInUse"));
    let msg = &plan.condition(ACCEPTED).unwrap().message;
    assert!(
        msg.starts_with("Service shared (controlled by LLMService shared) has a name this endpoint's children take"),
        "{msg}"
    );
}

#[test]
fn ready_is_an_available_gateway_replica_and_the_status_lists_models_and_conflicts() {
    let ep = endpoint(json!({"spec": {"apiKeySecretRef": {"name": "keys"}}}));
    let routes = table(&["chat", "code"]);
    let mut view = steady(&ep, &routes);
    let plan = plan_endpoint(&ep, &attachment(), &of(routes.clone()), &view, &cfg(), None);
    assert_eq!(cond(&plan, status::READY), ("False", "GatewayNotReady"));
    assert!(
        plan.condition(status::READY)
            .unwrap()
            .message
            .contains("key \"api-keys\" of Secret \"keys\"")
    );
    let mut d = Deployment::clone(view.gateway.as_deref().unwrap());
    d.status = Some(DeploymentStatus {
        available_replicas: Some(1),
        ..Default::default()
    });
    view.gateway = Some(Arc::new(d));
    let plan = plan_endpoint(&ep, &attachment(), &of(routes.clone()), &view, &cfg(), None);
    assert_eq!(cond(&plan, status::READY), ("True", "GatewayAvailable"));
    let now = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let st = plan.status(&ep, &now);
    assert_eq!(
        st.endpoint_url.as_deref(),
        Some("http://shared.platform.svc/v1")
    );
    assert_eq!(st.observed_generation, Some(3));
    assert_eq!(st.attached_services, 2);
    assert_eq!(st.models, attachment().models);
    assert_eq!(st.conflicts, attachment().conflicts);
    let types: Vec<_> = st.conditions.iter().map(|c| c.type_.as_str()).collect();
    assert_eq!(types, [ACCEPTED, status::READY]);
    // A held route is routed and listed.
    let held = EndpointRoutes {
        held: vec![model("team-d", "old")],
        ..of(routes)
    };
    let plan = plan_endpoint(&ep, &attachment(), &held, &view, &cfg(), None);
    let names: Vec<_> = plan.models.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["chat", "code", "old"]);
}

fn service(ns: &str, name: &str, deleting: bool) -> LLMService {
    let mut meta = json!({"name": name, "namespace": ns});
    if deleting {
        meta["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
    }
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
        "metadata": meta,
        "spec": {"model": {"source": {"uri": "hf://org/model"}}},
    }))
    .unwrap()
}

/// The routes `held_routes` keeps when the endpoint routed `previous` before, accepts
/// `attachment()` now, the services `existing` exist (`!` suffix: being deleted) and those in
/// `ready` have their own gateway ready.
#[rstest]
#[case::nothing_left(&["team-a/chat"], &["team-a/chat"], &[], &[])]
#[case::a_leaving_service_is_held_until_its_own_gateway_is_ready(&["team-a/chat", "team-d/old"], &["team-d/old"], &[], &["team-d/old"])]
#[case::released_once_its_own_gateway_is_ready(&["team-d/old"], &["team-d/old"], &["team-d/old"], &[])]
#[case::released_when_the_service_is_gone(&["team-d/old"], &[], &[], &[])]
#[case::released_when_the_service_is_being_deleted(&["team-d/old"], &["team-d/old!"], &[], &[])]
// The name is someone else's now (the older holder left and the next one took it): not held.
#[case::released_when_its_name_is_taken(&["team-d/chat"], &["team-d/chat"], &[], &[])]
// A Deployment has no gateway of its own to wait for (`dep:`: a `kind: Deployment` entry; an
// LLMService of that name exists, not ready: not the Deployment's business).
#[case::a_leaving_deployment_is_never_held(&["dep:team-d/old"], &["team-d/old"], &[], &[])]
fn routes_held_for_leaving_services(
    #[case] previous: &[&str],
    #[case] existing: &[&str],
    #[case] ready: &[&str],
    #[case] want: &[&str],
) {
    let split = |s: &str| {
        let (ns, name) = s
            .trim_start_matches("dep:")
            .trim_end_matches('!')
            .split_once('/')
            .unwrap();
        (ns.to_owned(), name.to_owned())
    };
    let mut ep = endpoint(json!({}));
    ep.status = Some(LLMEndpointStatus {
        models: previous
            .iter()
            .map(|p| {
                let (ns, name) = split(p);
                EndpointModel {
                    kind: p
                        .starts_with("dep:")
                        .then_some(hearth_crds::llmendpoint::MemberKind::Deployment),
                    ..model(&ns, &name)
                }
            })
            .collect(),
        ..Default::default()
    });
    let services: Vec<LLMService> = existing
        .iter()
        .map(|e| {
            let (ns, name) = split(e);
            service(&ns, &name, e.ends_with('!'))
        })
        .collect();
    let held = held_routes(
        &ep,
        &attachment(),
        |ns, name| {
            services
                .iter()
                .find(|s| s.namespace().as_deref() == Some(ns) && s.name_any() == name)
        },
        |ns, name| ready.contains(&format!("{ns}/{name}").as_str()),
        |_| false,
    );
    let got: Vec<String> = held
        .iter()
        .map(|m| format!("{}/{}", m.namespace, m.service))
        .collect();
    assert_eq!(got, want);
}

#[test]
fn a_push_service_attached_gets_the_scaler_service_without_rolling_the_gateway() {
    let ep = endpoint(json!({}));
    let routes = table(&["chat"]);
    let view = steady(&ep, &routes);
    let push = EndpointRoutes {
        push_services: true,
        ..of(routes)
    };
    let plan = plan_endpoint(&ep, &attachment(), &push, &view, &cfg(), None);
    assert_eq!(writes(&plan), ["apply Service shared-scaler"]);
}

/// Two routes of one key (a service leaving, held, and a Deployment of the same namespace and
/// name accepted meanwhile) would make every gateway replica refuse the whole table
/// (`models[i].service: ... one entry per service`): the table keeps the first of each key and
/// of each model name, in the order given (accepted services, held ones, Deployments).
#[test]
fn a_route_table_has_one_entry_per_key_and_per_model() {
    let route = |model: &str, service: &str| -> ModelRoute {
        serde_json::from_value(json!({
            "model": model, "namespace": "team-a", "service": service,
            "backendService": format!("{service}-backend"), "backendPortName": "http",
            "maxQueue": 100, "heartbeatInterval": "10s", "activationTimeout": "5m",
            "metricTarget": 10.0,
        }))
        .unwrap()
    };
    let t = route_table(vec![
        route("chat", "chat"),
        route("code", "code"),
        route("chat-large", "chat"),
        route("code", "other"),
    ]);
    let got: Vec<(&str, &str)> = t
        .models
        .iter()
        .map(|r| (r.model.as_str(), r.service.as_str()))
        .collect();
    assert_eq!(got, [("chat", "chat"), ("code", "code")]);
}

/// A service that moved to another endpoint which accepts it gets no gateway of its own to
/// wait for: the endpoint it left releases its route at once, instead of holding (and
/// requeueing every HOLD_RETRY) for good.
#[test]
fn a_service_accepted_by_another_endpoint_is_not_held() {
    let mut ep = endpoint(json!({}));
    ep.status = Some(LLMEndpointStatus {
        models: vec![model("team-d", "old"), model("team-d", "moved")],
        ..Default::default()
    });
    let services = [
        service("team-d", "old", false),
        service("team-d", "moved", false),
    ];
    let held = held_routes(
        &ep,
        &attachment(),
        |ns, name| {
            services
                .iter()
                .find(|s| s.namespace().as_deref() == Some(ns) && s.name_any() == name)
        },
        |_, _| false,
        |s| s.name_any() == "moved",
    );
    let got: Vec<&str> = held.iter().map(|m| m.service.as_str()).collect();
    assert_eq!(got, ["old"]);
}

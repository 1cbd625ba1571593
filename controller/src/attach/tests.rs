//! Table tests of [`attach`]: an endpoint (or none), the services referencing it and their
//! namespaces' labels, and per case every service's reason, the models and the conflicts.

use rstest::rstest;
use serde_json::{Value, json};

use super::*;
use hearth_crds::llmendpoint::{FromNamespaces, MemberKind};

/// A service `ns/name` created at second `created`, referencing `ep_ref` (`name` or
/// `namespace/name`, `-`: no reference); `deleting` when it has a deletionTimestamp.
fn svc(ns: &str, name: &str, created: i64, ep_ref: &str, deleting: bool) -> LLMService {
    let reference = match ep_ref.split_once('/') {
        _ if ep_ref == "-" => Value::Null,
        Some((n, e)) => json!({"name": e, "namespace": n}),
        None => json!({"name": ep_ref}),
    };
    let ts = |s: i64| {
        k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + s)
            .unwrap()
            .to_string()
    };
    let mut meta = json!({
        "name": name, "namespace": ns, "uid": format!("{ns}-{name}"),
        "creationTimestamp": ts(created),
    });
    if deleting {
        meta["deletionTimestamp"] = json!(ts(1000));
    }
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": meta,
        "spec": {
            "model": {"source": {"uri": "hf://org/model"}},
            "endpoint": {"sharedEndpointRef": reference},
        }
    }))
    .unwrap()
}

fn live(ns: &str, name: &str, created: i64, ep_ref: &str) -> LLMService {
    svc(ns, name, created, ep_ref, false)
}

/// The endpoint `platform/shared` with `allowedServices.namespaces` = `namespaces`.
fn endpoint(namespaces: Value) -> Option<LLMEndpoint> {
    Some(
        serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMEndpoint",
            "metadata": {"name": "shared", "namespace": "platform", "uid": "ep"},
            "spec": {"allowedServices": {"namespaces": namespaces}},
        }))
        .unwrap(),
    )
}

fn selector(sel: Value) -> Option<LLMEndpoint> {
    endpoint(json!({"from": "Selector", "selector": sel}))
}

fn key() -> EndpointKey {
    EndpointKey {
        namespace: "platform".to_owned(),
        name: "shared".to_owned(),
    }
}

/// Labels of the namespaces of the tables.
fn namespaces() -> BTreeMap<String, BTreeMap<String, String>> {
    let ns = |name: &str, labels: &[(&str, &str)]| {
        let mut l: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        l.insert("kubernetes.io/metadata.name".to_owned(), name.to_owned());
        (name.to_owned(), l)
    };
    BTreeMap::from([
        ns("platform", &[("hearth.dev/shared", "true")]),
        ns("team-a", &[("hearth.dev/shared", "true"), ("env", "prod")]),
        ns("team-b", &[("env", "staging")]),
        ns("team-c", &[]),
    ])
}

/// No Deployment.
const NONE: &[Deployment] = &[];

const OK: &str = "Accepted";
const NOT_FOUND: &str = "EndpointNotFound";
const NOT_ALLOWED: &str = "NotAllowedByEndpoint";
const TAKEN: &str = "ModelNameConflict";

#[rstest]
#[case::no_endpoint(
    None,
    vec![live("platform", "chat", 1, "shared"), live("team-a", "code", 2, "platform/shared")],
    &[("platform/chat", NOT_FOUND), ("team-a/code", NOT_FOUND)],
)]
#[case::same_admits_its_own_namespace_only(
    endpoint(json!({"from": "Same"})),
    vec![live("platform", "chat", 1, "shared"), live("team-a", "code", 2, "platform/shared")],
    &[("platform/chat", OK), ("team-a/code", NOT_ALLOWED)],
)]
#[case::same_is_the_default(
    endpoint(json!({})),
    vec![live("platform", "chat", 1, "shared"), live("team-a", "code", 2, "platform/shared")],
    &[("platform/chat", OK), ("team-a/code", NOT_ALLOWED)],
)]
#[case::the_reference_defaults_to_the_services_namespace(
    endpoint(json!({"from": "All"})),
    // team-a/shared is another endpoint: not this one's business.
    vec![live("team-a", "chat", 1, "shared"), live("team-b", "code", 2, "platform/shared"), live("platform", "free", 3, "-")],
    &[("team-b/code", OK)],
)]
#[case::all_admits_every_namespace(
    endpoint(json!({"from": "All"})),
    vec![live("team-a", "chat", 1, "platform/shared"), live("team-c", "code", 2, "platform/shared")],
    &[("team-a/chat", OK), ("team-c/code", OK)],
)]
#[case::selector_match_labels(
    selector(json!({"matchLabels": {"hearth.dev/shared": "true"}})),
    vec![live("team-a", "chat", 1, "platform/shared"), live("team-b", "code", 2, "platform/shared"), live("platform", "own", 3, "shared")],
    &[("platform/own", OK), ("team-a/chat", OK), ("team-b/code", NOT_ALLOWED)],
)]
#[case::selector_in(
    selector(json!({"matchExpressions": [{"key": "env", "operator": "In", "values": ["prod", "staging"]}]})),
    vec![live("team-a", "a", 1, "platform/shared"), live("team-b", "b", 2, "platform/shared"), live("team-c", "c", 3, "platform/shared")],
    &[("team-a/a", OK), ("team-b/b", OK), ("team-c/c", NOT_ALLOWED)],
)]
#[case::selector_not_in(
    selector(json!({"matchExpressions": [{"key": "env", "operator": "NotIn", "values": ["staging"]}]})),
    vec![live("team-a", "a", 1, "platform/shared"), live("team-b", "b", 2, "platform/shared"), live("team-c", "c", 3, "platform/shared")],
    &[("team-a/a", OK), ("team-b/b", NOT_ALLOWED), ("team-c/c", OK)],
)]
#[case::selector_exists(
    selector(json!({"matchExpressions": [{"key": "env", "operator": "Exists"}]})),
    vec![live("team-a", "a", 1, "platform/shared"), live("team-c", "c", 3, "platform/shared")],
    &[("team-a/a", OK), ("team-c/c", NOT_ALLOWED)],
)]
#[case::selector_does_not_exist(
    selector(json!({"matchExpressions": [{"key": "env", "operator": "DoesNotExist"}]})),
    vec![live("team-a", "a", 1, "platform/shared"), live("team-c", "c", 3, "platform/shared")],
    &[("team-a/a", NOT_ALLOWED), ("team-c/c", OK)],
)]
#[case::selector_labels_and_expressions_are_anded(
    selector(json!({"matchLabels": {"hearth.dev/shared": "true"}, "matchExpressions": [{"key": "env", "operator": "In", "values": ["prod"]}]})),
    vec![live("team-a", "a", 1, "platform/shared"), live("platform", "p", 2, "shared")],
    &[("platform/p", NOT_ALLOWED), ("team-a/a", OK)],
)]
#[case::an_empty_selector_selects_every_namespace(
    selector(json!({})),
    vec![live("team-b", "b", 1, "platform/shared"), live("team-c", "c", 2, "platform/shared")],
    &[("team-b/b", OK), ("team-c/c", OK)],
)]
#[case::an_unknown_namespace_matches_no_selector(
    selector(json!({})),
    vec![live("team-z", "z", 1, "platform/shared")],
    &[("team-z/z", NOT_ALLOWED)],
)]
#[case::an_invalid_endpoint_admits_no_one(
    endpoint(json!({"from": "Selector"})),
    vec![live("platform", "chat", 1, "shared")],
    &[("platform/chat", NOT_ALLOWED)],
)]
#[case::the_older_service_keeps_the_model_name(
    endpoint(json!({"from": "All"})),
    vec![live("team-b", "chat", 5, "platform/shared"), live("team-a", "chat", 9, "platform/shared")],
    &[("team-a/chat", TAKEN), ("team-b/chat", OK)],
)]
#[case::same_age_the_namespace_then_the_name_decides(
    endpoint(json!({"from": "All"})),
    vec![live("team-b", "chat", 5, "platform/shared"), live("team-a", "chat", 5, "platform/shared")],
    &[("team-a/chat", OK), ("team-b/chat", TAKEN)],
)]
#[case::a_service_not_admitted_holds_no_name(
    endpoint(json!({"from": "Same"})),
    vec![live("team-a", "chat", 1, "platform/shared"), live("platform", "chat", 9, "shared")],
    &[("platform/chat", OK), ("team-a/chat", NOT_ALLOWED)],
)]
#[case::a_service_being_deleted_holds_no_name(
    endpoint(json!({"from": "All"})),
    vec![svc("team-a", "chat", 1, "platform/shared", true), live("team-b", "chat", 9, "platform/shared")],
    &[("team-a/chat", TAKEN), ("team-b/chat", OK)],
)]
#[case::a_service_being_deleted_alone_stays_accepted_but_unrouted(
    endpoint(json!({"from": "All"})),
    vec![svc("team-a", "chat", 1, "platform/shared", true)],
    &[("team-a/chat", OK)],
)]
fn reasons_per_service(
    #[case] ep: Option<LLMEndpoint>,
    #[case] services: Vec<LLMService>,
    #[case] want: &[(&str, &str)],
) {
    let a = attach(&key(), ep.as_ref(), &services, NONE, &namespaces());
    let got: Vec<(String, &str)> = a
        .verdicts
        .iter()
        .map(|((ns, name), v)| (format!("{ns}/{name}"), v.reason.as_str()))
        .collect();
    let want: Vec<(String, &str)> = want.iter().map(|(s, r)| ((*s).to_owned(), *r)).collect();
    assert_eq!(got, want);
    // Models are the accepted services not being deleted; conflicts the others, when the
    // endpoint exists.
    let accepted_live = |(ns, name): &(String, String)| {
        services.iter().any(|s| {
            s.namespace().as_deref() == Some(ns.as_str())
                && s.name_any() == *name
                && s.metadata.deletion_timestamp.is_none()
        })
    };
    let routed: Vec<String> = a
        .models
        .iter()
        .map(|m| format!("{}/{}", m.namespace, m.service))
        .collect();
    let mut want_routed: Vec<(String, String)> = a
        .verdicts
        .iter()
        .filter(|(k, v)| v.accepted() && accepted_live(k))
        .map(|(k, _)| k.clone())
        .collect();
    want_routed.sort_by(|a, b| (&a.1, &a.0).cmp(&(&b.1, &b.0)));
    assert_eq!(
        routed,
        want_routed
            .iter()
            .map(|(ns, n)| format!("{ns}/{n}"))
            .collect::<Vec<_>>()
    );
    let conflicts: Vec<String> = a
        .conflicts
        .iter()
        .map(|c| format!("{}/{}", c.namespace, c.service))
        .collect();
    let want_conflicts: Vec<String> = if ep.is_some() {
        a.verdicts
            .iter()
            .filter(|(k, v)| !v.accepted() && accepted_live(k))
            .map(|((ns, n), _)| format!("{ns}/{n}"))
            .collect()
    } else {
        Vec::new()
    };
    assert_eq!(conflicts, want_conflicts);
}

#[test]
fn messages_name_the_fix_and_the_holder() {
    let ep = endpoint(json!({"from": "Same"}));
    let services = [
        live("platform", "chat", 1, "shared"),
        live("platform", "code", 2, "shared"),
        live("team-a", "chat", 3, "platform/shared"),
    ];
    let mut ep_all = ep.clone().unwrap();
    ep_all.spec.allowed_services.namespaces.from = FromNamespaces::All;
    let a = attach(&key(), Some(&ep_all), &services, NONE, &namespaces());
    let taken = a.verdict("team-a", "chat").unwrap();
    assert_eq!(
        taken.message,
        "model name \"chat\" is already served on LLMEndpoint platform/shared by the older LLMService platform/chat: rename this service (its name is its model name) or take one of the two off the endpoint; meanwhile this service runs its own gateway"
    );
    assert_eq!(
        a.verdict("platform", "chat").unwrap().message,
        "LLMEndpoint platform/shared serves model \"chat\" at http://shared.platform.svc/v1"
    );
    assert_eq!(
        a.models,
        vec![
            EndpointModel {
                name: "chat".into(),
                namespace: "platform".into(),
                service: "chat".into(),
                kind: None,
            },
            EndpointModel {
                name: "code".into(),
                namespace: "platform".into(),
                service: "code".into(),
                kind: None,
            },
        ]
    );
    assert_eq!(
        a.conflicts,
        vec![EndpointConflict {
            namespace: "team-a".into(),
            service: "chat".into(),
            model: "chat".into(),
            reason: "ModelNameConflict".into(),
            message: taken.message.clone(),
            kind: None,
        }]
    );

    let a = attach(&key(), ep.as_ref(), &services, NONE, &namespaces());
    let not_allowed = &a.verdict("team-a", "chat").unwrap().message;
    assert!(
        not_allowed.contains("admits services of its own namespace platform only")
            && not_allowed.contains(
                "set from: All, or from: Selector with a selector matching namespace team-a"
            ),
        "{not_allowed}"
    );
    let a = attach(&key(), None, &services, NONE, &namespaces());
    let missing = &a.verdict("platform", "chat").unwrap().message;
    assert!(
        missing.starts_with("LLMEndpoint platform/shared does not exist"),
        "{missing}"
    );
    // Being deleted is as good as gone: its services run their own gateways again.
    let mut deleting = ep_all.clone();
    deleting.metadata.deletion_timestamp = services[2].metadata.creation_timestamp.clone();
    let a = attach(&key(), Some(&deleting), &services, NONE, &namespaces());
    assert!(
        a.verdicts
            .values()
            .all(|v| v.reason == AttachReason::EndpointNotFound)
    );
    assert!(a.models.is_empty() && a.conflicts.is_empty());
}

#[test]
fn references_resolve_in_the_services_namespace_by_default() {
    assert_eq!(endpoint_key(&live("team-a", "x", 1, "-")), None);
    assert_eq!(
        endpoint_key(&live("team-a", "x", 1, "shared")),
        Some(EndpointKey {
            namespace: "team-a".into(),
            name: "shared".into()
        })
    );
    assert_eq!(
        endpoint_key(&live("team-a", "x", 1, "platform/shared")),
        Some(key())
    );
    assert_eq!(endpoint_url(&key()), "http://shared.platform.svc/v1");
}

/// A Deployment `ns/name` created at second `created` with `annotations` (and, unless they say
/// otherwise, a selector and one container serving on port `http`); `deleting` when it has a
/// deletionTimestamp.
fn dep(ns: &str, name: &str, created: i64, annotations: Value, deleting: bool) -> Deployment {
    let ts = |s: i64| {
        k8s_openapi::jiff::Timestamp::from_second(1_700_000_000 + s)
            .unwrap()
            .to_string()
    };
    let mut meta = json!({
        "name": name, "namespace": ns, "uid": format!("dep-{ns}-{name}"),
        "creationTimestamp": ts(created), "annotations": annotations,
    });
    if deleting {
        meta["deletionTimestamp"] = json!(ts(1000));
    }
    serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta,
        "spec": {
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.5",
                                         "ports": [{"name": "http", "containerPort": 8000}]}]},
            },
        },
    }))
    .unwrap()
}

/// A live Deployment joining `ep_ref` with model `model`.
fn joined(ns: &str, name: &str, created: i64, ep_ref: &str, model: &str) -> Deployment {
    dep(
        ns,
        name,
        created,
        json!({"serving.hearth.dev/endpoint": ep_ref, "serving.hearth.dev/model": model}),
        false,
    )
}

const INVALID: &str = "InvalidMember";

/// Every verdict as `svc ns/name` or `dep ns/name` with its reason, sorted.
fn all_verdicts(a: &Attachment) -> Vec<(String, &'static str)> {
    let mut out: Vec<(String, &'static str)> = a
        .verdicts
        .iter()
        .map(|((ns, n), v)| (format!("svc {ns}/{n}"), v.reason.as_str()))
        .chain(
            a.deployment_verdicts
                .iter()
                .map(|((ns, n), v)| (format!("dep {ns}/{n}"), v.reason.as_str())),
        )
        .collect();
    out.sort();
    out
}

#[rstest]
#[case::a_deployment_of_the_endpoints_namespace_joins(
    endpoint(json!({})),
    vec![],
    vec![joined("platform", "vllm-qwen", 1, "shared", "Qwen/Qwen2.5-7B-Instruct")],
    &[("dep platform/vllm-qwen", OK)],
    &["Qwen/Qwen2.5-7B-Instruct=dep platform/vllm-qwen"],
)]
#[case::the_same_namespace_rule_applies_to_deployments(
    endpoint(json!({"from": "Same"})),
    vec![],
    vec![joined("team-a", "vllm-qwen", 1, "platform/shared", "qwen")],
    &[("dep team-a/vllm-qwen", NOT_ALLOWED)],
    &[],
)]
#[case::a_selector_admits_deployments_as_services(
    selector(json!({"matchLabels": {"hearth.dev/shared": "true"}})),
    vec![],
    vec![joined("team-a", "a", 1, "platform/shared", "a"), joined("team-b", "b", 2, "platform/shared", "b")],
    &[("dep team-a/a", OK), ("dep team-b/b", NOT_ALLOWED)],
    &["a=dep team-a/a"],
)]
#[case::an_older_service_keeps_the_name_over_a_deployment(
    endpoint(json!({"from": "All"})),
    vec![live("team-a", "chat", 1, "platform/shared")],
    vec![joined("team-b", "vllm", 2, "platform/shared", "chat")],
    &[("dep team-b/vllm", TAKEN), ("svc team-a/chat", OK)],
    &["chat=svc team-a/chat"],
)]
#[case::an_older_deployment_keeps_the_name_over_a_service(
    endpoint(json!({"from": "All"})),
    vec![live("team-a", "chat", 2, "platform/shared")],
    vec![joined("team-b", "vllm", 1, "platform/shared", "chat")],
    &[("dep team-b/vllm", OK), ("svc team-a/chat", TAKEN)],
    &["chat=dep team-b/vllm"],
)]
#[case::the_older_of_two_deployments_keeps_the_name(
    endpoint(json!({"from": "All"})),
    vec![],
    vec![joined("team-b", "new", 7, "platform/shared", "chat"), joined("team-a", "old", 3, "platform/shared", "chat")],
    &[("dep team-a/old", OK), ("dep team-b/new", TAKEN)],
    &["chat=dep team-a/old"],
)]
// `team-a/chat` is the model's key for KEDA (`?service=`, trigger metadata `service`) and the
// gateway's one entry per service: a Deployment named like an LLMService of its namespace on
// the endpoint (that name is the service's backend Deployment's) cannot join, whichever is older.
#[case::a_deployment_named_like_a_service_of_its_namespace_cannot_join(
    endpoint(json!({"from": "All"})),
    vec![live("team-a", "chat", 2, "platform/shared")],
    vec![joined("team-a", "chat", 1, "platform/shared", "chat-large")],
    &[("dep team-a/chat", INVALID), ("svc team-a/chat", OK)],
    &["chat=svc team-a/chat"],
)]
#[case::a_deployment_named_like_a_service_being_deleted_joins(
    endpoint(json!({"from": "All"})),
    vec![svc("team-a", "chat", 1, "platform/shared", true)],
    vec![joined("team-a", "chat", 2, "platform/shared", "chat-large")],
    &[("dep team-a/chat", OK), ("svc team-a/chat", OK)],
    &["chat-large=dep team-a/chat"],
)]
#[case::without_the_model_annotation_a_deployment_holds_no_name(
    endpoint(json!({"from": "All"})),
    vec![live("team-a", "chat", 2, "platform/shared")],
    vec![dep("team-b", "vllm", 1, json!({"serving.hearth.dev/endpoint": "platform/shared"}), false)],
    &[("dep team-b/vllm", INVALID), ("svc team-a/chat", OK)],
    &["chat=svc team-a/chat"],
)]
#[case::bad_scaling_annotations_are_invalid(
    endpoint(json!({"from": "All"})),
    vec![],
    vec![
        dep("team-a", "a", 1, json!({"serving.hearth.dev/endpoint": "platform/shared", "serving.hearth.dev/model": "a", "serving.hearth.dev/min-replicas": "-1"}), false),
        dep("team-a", "b", 2, json!({"serving.hearth.dev/endpoint": "platform/shared", "serving.hearth.dev/model": "b", "serving.hearth.dev/min-replicas": "3", "serving.hearth.dev/max-replicas": "2"}), false),
        dep("team-a", "c", 3, json!({"serving.hearth.dev/endpoint": "platform/shared", "serving.hearth.dev/model": "c", "serving.hearth.dev/cold-start": "hold"}), false),
        dep("team-a", "d", 4, json!({"serving.hearth.dev/endpoint": "platform/shared", "serving.hearth.dev/model": "d", "serving.hearth.dev/activation-timeout": "soon"}), false),
        dep("team-a", "e", 5, json!({"serving.hearth.dev/endpoint": "platform/shared", "serving.hearth.dev/model": "e", "serving.hearth.dev/scaler": "pull"}), false),
        dep("team-a", "f", 6, json!({"serving.hearth.dev/endpoint": "platform/shared", "serving.hearth.dev/model": "f", "serving.hearth.dev/min-replicas": "1", "serving.hearth.dev/max-replicas": "4", "serving.hearth.dev/scaler": "push", "serving.hearth.dev/target": "2", "serving.hearth.dev/activation-timeout": "10m", "serving.hearth.dev/cold-start": "reject"}), false),
    ],
    &[("dep team-a/a", INVALID), ("dep team-a/b", INVALID), ("dep team-a/c", INVALID), ("dep team-a/d", INVALID), ("dep team-a/e", INVALID), ("dep team-a/f", OK)],
    &["f=dep team-a/f"],
)]
#[case::other_endpoints_and_malformed_references_are_not_claimants(
    endpoint(json!({"from": "All"})),
    vec![],
    vec![
        joined("team-a", "other", 1, "shared", "x"),
        joined("team-a", "malformed", 2, "platform/shared/x", "y"),
        joined("team-a", "empty", 3, "", "z"),
        dep("platform", "plain", 4, json!({"serving.hearth.dev/model": "p"}), false),
    ],
    &[],
    &[],
)]
#[case::a_deployment_being_deleted_holds_no_name(
    endpoint(json!({"from": "All"})),
    vec![live("team-b", "chat", 9, "platform/shared")],
    vec![dep("team-a", "vllm", 1, json!({"serving.hearth.dev/endpoint": "platform/shared", "serving.hearth.dev/model": "chat"}), true)],
    &[("dep team-a/vllm", TAKEN), ("svc team-b/chat", OK)],
    &["chat=svc team-b/chat"],
)]
#[case::no_endpoint(
    None,
    vec![live("team-a", "chat", 1, "platform/shared")],
    vec![joined("team-a", "vllm", 2, "platform/shared", "code")],
    &[("dep team-a/vllm", NOT_FOUND), ("svc team-a/chat", NOT_FOUND)],
    &[],
)]
fn reasons_across_kinds(
    #[case] ep: Option<LLMEndpoint>,
    #[case] services: Vec<LLMService>,
    #[case] deployments: Vec<Deployment>,
    #[case] want: &[(&str, &str)],
    #[case] routed: &[&str],
) {
    let a = attach(&key(), ep.as_ref(), &services, &deployments, &namespaces());
    let want: Vec<(String, &str)> = want.iter().map(|(s, r)| ((*s).to_owned(), *r)).collect();
    assert_eq!(all_verdicts(&a), want);
    let got_routed: Vec<String> = a
        .models
        .iter()
        .map(|m| {
            let kind = match MemberKind::of(m.kind) {
                MemberKind::LLMService => "svc",
                MemberKind::Deployment => "dep",
            };
            format!("{}={kind} {}/{}", m.name, m.namespace, m.service)
        })
        .collect();
    assert_eq!(got_routed, routed);
    // Services keep `kind` absent (their entries read as before); Deployments say it.
    for m in &a.models {
        assert_ne!(m.kind, Some(MemberKind::LLMService));
    }
    // Every live claimant not accepted is a conflict, with its kind, when the endpoint exists.
    let mut conflicts: Vec<String> = a
        .conflicts
        .iter()
        .map(|c| {
            let kind = match MemberKind::of(c.kind) {
                MemberKind::LLMService => "svc",
                MemberKind::Deployment => "dep",
            };
            format!("{kind} {}/{}", c.namespace, c.service)
        })
        .collect();
    conflicts.sort();
    let deleting = |label: &str| {
        deployments.iter().any(|d| {
            format!("dep {}/{}", d.namespace().unwrap_or_default(), d.name_any()) == label
                && d.metadata.deletion_timestamp.is_some()
        })
    };
    let want_conflicts: Vec<String> = if ep.is_some() {
        want.iter()
            .filter(|(label, r)| *r != OK && !deleting(label))
            .map(|(label, _)| label.clone())
            .collect()
    } else {
        Vec::new()
    };
    assert_eq!(conflicts, want_conflicts);
}

#[test]
fn deployment_messages_name_the_annotation_and_the_fix() {
    let mut ep = endpoint(json!({"from": "All"})).unwrap();
    let services = [live("team-a", "chat", 1, "platform/shared")];
    let deployments = [
        joined("team-b", "vllm", 2, "platform/shared", "chat"),
        dep(
            "team-b",
            "nomodel",
            3,
            json!({"serving.hearth.dev/endpoint": "platform/shared"}),
            false,
        ),
        joined(
            "team-b",
            "fine",
            4,
            "platform/shared",
            "Qwen/Qwen2.5-7B-Instruct",
        ),
    ];
    let a = attach(&key(), Some(&ep), &services, &deployments, &namespaces());
    assert_eq!(
        a.deployment_verdict("team-b", "vllm").unwrap().message,
        "model name \"chat\" is already served on LLMEndpoint platform/shared by the older LLMService team-a/chat: change this Deployment's serving.hearth.dev/model (and its engine's --served-model-name) or take one of the two off the endpoint; meanwhile Hearth neither routes nor scales this Deployment"
    );
    let invalid = &a.deployment_verdict("team-b", "nomodel").unwrap().message;
    assert!(
        invalid.starts_with(
            "the Deployment cannot join: metadata.annotations[\"serving.hearth.dev/model\"]: is required with serving.hearth.dev/endpoint"
        ),
        "{invalid}"
    );
    assert_eq!(
        a.deployment_verdict("team-b", "fine").unwrap().message,
        "LLMEndpoint platform/shared serves model \"Qwen/Qwen2.5-7B-Instruct\" at http://shared.platform.svc/v1"
    );
    // The conflicts say the kind, the model asked for (none when missing) and the reason.
    let c: Vec<(&str, &str, &str, Option<MemberKind>)> = a
        .conflicts
        .iter()
        .map(|c| {
            (
                c.service.as_str(),
                c.model.as_str(),
                c.reason.as_str(),
                c.kind,
            )
        })
        .collect();
    assert_eq!(
        c,
        [
            ("nomodel", "", "InvalidMember", Some(MemberKind::Deployment)),
            (
                "vllm",
                "chat",
                "ModelNameConflict",
                Some(MemberKind::Deployment)
            ),
        ]
    );
    // A service losing its name to an older Deployment is told which.
    let older = [joined("team-b", "vllm", 0, "platform/shared", "chat")];
    let a = attach(&key(), Some(&ep), &services, &older, &namespaces());
    assert_eq!(
        a.verdict("team-a", "chat").unwrap().message,
        "model name \"chat\" is already served on LLMEndpoint platform/shared by the older Deployment team-b/vllm: rename this service (its name is its model name) or take one of the two off the endpoint; meanwhile this service runs its own gateway"
    );
    // A Deployment named like a service of its namespace on the endpoint: the fix.
    let named_like = [joined("team-a", "chat", 0, "platform/shared", "chat-large")];
    let a = attach(&key(), Some(&ep), &services, &named_like, &namespaces());
    assert_eq!(
        a.deployment_verdict("team-a", "chat").unwrap().message,
        "the Deployment cannot join: LLMService team-a/chat on LLMEndpoint platform/shared has its name (the service's backend Deployment is named like it, and team-a/chat is the key KEDA and the gateway know one model by): join with a Deployment of another name, or take the service off the endpoint; meanwhile Hearth neither routes nor scales the Deployment"
    );
    // Not admitted, missing endpoint: the Deployment's fix, and what goes on meanwhile.
    ep.spec.allowed_services.namespaces.from = FromNamespaces::Same;
    let a = attach(&key(), Some(&ep), &services, &deployments, &namespaces());
    let not_allowed = &a.deployment_verdict("team-b", "fine").unwrap().message;
    assert!(
        not_allowed.ends_with(
            "selector matching namespace team-b; meanwhile Hearth neither routes nor scales the Deployment"
        ),
        "{not_allowed}"
    );
    let a = attach(&key(), None, &services, &deployments, &namespaces());
    assert_eq!(
        a.deployment_verdict("team-b", "fine").unwrap().message,
        "LLMEndpoint platform/shared does not exist (or is being deleted): create it, or fix or remove the serving.hearth.dev/endpoint annotation; meanwhile Hearth neither routes nor scales the Deployment"
    );
}

#[test]
fn a_deployments_reference_resolves_in_its_namespace_by_default() {
    let d = |ep: &str| joined("team-a", "x", 1, ep, "m");
    assert_eq!(
        deployment_endpoint_key(&d("shared")),
        Some(EndpointKey {
            namespace: "team-a".into(),
            name: "shared".into()
        })
    );
    assert_eq!(deployment_endpoint_key(&d("platform/shared")), Some(key()));
    for bad in [
        "",
        "/shared",
        "platform/",
        "a/b/c",
        "Shared",
        "platform/9shared",
    ] {
        assert_eq!(deployment_endpoint_key(&d(bad)), None, "{bad:?}");
    }
    let plain = dep("team-a", "x", 1, json!({}), false);
    assert_eq!(deployment_endpoint_key(&plain), None);
}

#[test]
fn aliases_never_take_a_name_and_a_taken_one_is_left_out() {
    let ep = endpoint(json!({"from": "All"})).unwrap();
    let with_aliases = |mut s: LLMService, aliases: &[&str]| {
        s.spec.model.aliases = aliases.iter().map(|a| (*a).to_owned()).collect();
        s
    };
    let services = [
        // The oldest asks for a newer service's name, a newer Deployment's model, and one
        // that is free.
        with_aliases(
            live("team-a", "chat", 1, "platform/shared"),
            &["code", "org/llama", "org/chat"],
        ),
        live("team-b", "code", 2, "platform/shared"),
        // A newer one asks for the older one's alias.
        with_aliases(live("team-d", "sql", 4, "platform/shared"), &["org/chat"]),
    ];
    let deployments = [joined("team-e", "vllm", 5, "platform/shared", "org/llama")];
    let a = attach(&key(), Some(&ep), &services, &deployments, &namespaces());
    // Every model keeps its own name; only aliases lose.
    for (ns, name) in [("team-a", "chat"), ("team-b", "code"), ("team-d", "sql")] {
        assert!(a.verdict(ns, name).unwrap().accepted(), "{ns}/{name}");
    }
    assert!(a.deployment_verdict("team-e", "vllm").unwrap().accepted());
    assert_eq!(a.aliases_of("team-a", "chat"), ["org/chat"]);
    assert!(a.aliases_of("team-d", "sql").is_empty());
    let chat = &a.verdict("team-a", "chat").unwrap().message;
    assert!(
        chat.ends_with("spec.model.aliases left out, their names being taken on the endpoint: \"code\" (served by LLMService team-b/code), \"org/llama\" (served by Deployment team-e/vllm) (remove them, or rename one of the two)"),
        "{chat}"
    );
    let sql = &a.verdict("team-d", "sql").unwrap().message;
    assert!(
        sql.contains("\"org/chat\" (served by LLMService team-a/chat)"),
        "{sql}"
    );
}

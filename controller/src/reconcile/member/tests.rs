//! Table tests of [`decide_member`] and [`plan_member`]: a joined Deployment, its endpoint's
//! verdict, the caches of its objects, and the writes and Event they lead to.

use hearth_crds::llmendpoint::AttachReason;
use rstest::rstest;
use serde_json::{Value, json};

use super::*;

fn deployment(patch: Value) -> Deployment {
    let mut d = json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {
            "name": "vllm-qwen", "namespace": "team-a", "uid": "dep-uid",
            "annotations": {
                "serving.hearth.dev/endpoint": "platform/shared",
                "serving.hearth.dev/model": "qwen",
            },
        },
        "spec": {
            "selector": {"matchLabels": {"app": "qwen"}},
            "template": {
                "metadata": {"labels": {"app": "qwen"}},
                "spec": {"containers": [{
                    "name": "vllm", "image": "vllm/vllm-openai:v0.8.5",
                    "args": ["--model=Qwen/Qwen2.5-7B-Instruct", "--served-model-name", "qwen"],
                    "ports": [{"name": "http", "containerPort": 8000}],
                }]},
            },
        },
    });
    hearth_test_support::merge_json(&mut d, patch);
    serde_json::from_value(d).unwrap()
}

fn endpoint() -> LLMEndpoint {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "shared", "namespace": "platform", "uid": "ep-uid"},
        "spec": {"allowedServices": {"namespaces": {"from": "All"}}},
    }))
    .unwrap()
}

fn verdict(reason: AttachReason) -> Verdict {
    Verdict {
        reason,
        message: format!("{reason:?} here"),
    }
}

fn cfg() -> RenderConfig {
    RenderConfig::builtin().unwrap()
}

/// The objects rendered for the default Deployment, as the caches hold them once applied.
fn steady() -> MemberView {
    let d = deployment(json!({}));
    let out = decide_member(
        &d,
        Some(&verdict(AttachReason::Accepted)),
        Some(&endpoint()),
        &[],
        &MemberView::default(),
        &cfg(),
    );
    let MemberDecision::Join(c) = out.decision else {
        panic!("not joined: {:?}", out.state);
    };
    MemberView {
        service: Some(Arc::new(crate::diff::stamped(c.service))),
        role: Some(Arc::new(crate::diff::stamped(c.role))),
        role_binding: Some(Arc::new(crate::diff::stamped(c.role_binding))),
        keda_installed: true,
        scaled_object: Some(Arc::new(crate::diff::stamped(c.scaled_object))),
    }
}

fn writes(w: &[Write]) -> Vec<String> {
    w.iter().map(ToString::to_string).collect()
}

/// `view` with each object's controller changed to `kind/name/uid`.
fn controlled_by(mut view: MemberView, kind: &str, name: &str, uid: &str) -> MemberView {
    let owner = json!([{"apiVersion": if kind == "Deployment" {"apps/v1"} else {"serving.hearth.dev/v1alpha1"},
                        "kind": kind, "name": name, "uid": uid, "controller": true}]);
    let set = |meta: &mut ObjectMeta| {
        meta.owner_references = Some(serde_json::from_value(owner.clone()).unwrap());
    };
    let mut s = view.service.take().map(|o| o.as_ref().clone()).unwrap();
    set(&mut s.metadata);
    view.service = Some(Arc::new(s));
    let mut r = view.role.take().map(|o| o.as_ref().clone()).unwrap();
    set(&mut r.metadata);
    view.role = Some(Arc::new(r));
    let mut b = view
        .role_binding
        .take()
        .map(|o| o.as_ref().clone())
        .unwrap();
    set(&mut b.metadata);
    view.role_binding = Some(Arc::new(b));
    let mut o = view
        .scaled_object
        .take()
        .map(|o| o.as_ref().clone())
        .unwrap();
    set(&mut o.metadata);
    view.scaled_object = Some(Arc::new(o));
    view
}

const ALL: [&str; 4] = [
    "apply Role vllm-qwen-hearth",
    "apply RoleBinding vllm-qwen-hearth",
    "apply Service vllm-qwen-hearth",
    "apply ScaledObject vllm-qwen-hearth",
];
const GONE: [&str; 4] = [
    "delete ScaledObject vllm-qwen-hearth",
    "delete Service vllm-qwen-hearth",
    "delete RoleBinding vllm-qwen-hearth",
    "delete Role vllm-qwen-hearth",
];

#[rstest]
#[case::accepted_and_new(json!({}), Some(AttachReason::Accepted), MemberView { keda_installed: true, ..Default::default() }, &ALL[..], "Accepted")]
#[case::accepted_and_steady(json!({}), Some(AttachReason::Accepted), steady(), &[][..], "Accepted")]
#[case::accepted_without_keda(json!({}), Some(AttachReason::Accepted), MemberView::default(), &ALL[..3], "Accepted")]
#[case::a_changed_annotation_is_applied(
    json!({"metadata": {"annotations": {"serving.hearth.dev/max-replicas": "3"}}}),
    Some(AttachReason::Accepted), steady(), &["apply ScaledObject vllm-qwen-hearth"][..], "Accepted",
)]
#[case::a_changed_selector_is_applied(
    json!({"spec": {"selector": {"matchLabels": {"app": "qwen", "tier": "gpu"}}}}),
    Some(AttachReason::Accepted), steady(), &["apply Service vllm-qwen-hearth"][..], "Accepted",
)]
// Leaving: the ScaledObject first (KEDA restores the replicas), then the rest.
#[case::its_name_taken(json!({}), Some(AttachReason::ModelNameConflict), steady(), &GONE[..], "ModelNameConflict")]
#[case::not_admitted(json!({}), Some(AttachReason::NotAllowedByEndpoint), steady(), &GONE[..], "NotAllowedByEndpoint")]
#[case::no_endpoint_and_nothing_to_remove(json!({}), Some(AttachReason::EndpointNotFound), MemberView { keda_installed: true, ..Default::default() }, &[][..], "EndpointNotFound")]
#[case::invalid(json!({}), Some(AttachReason::InvalidMember), steady(), &GONE[..], "InvalidMember")]
#[case::not_a_reference(
    json!({"metadata": {"annotations": {"serving.hearth.dev/endpoint": "a/b/c"}}}),
    None, steady(), &GONE[..], "InvalidMember",
)]
// Accepted, but no port to find the engines by: not served, and nothing of it kept.
#[case::accepted_without_a_port(
    json!({"spec": {"template": {"spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.5"}]}}}}),
    Some(AttachReason::Accepted), steady(), &GONE[..], "InvalidMember",
)]
// Objects of that name that another object controls are neither written nor removed.
#[case::accepted_but_a_name_is_taken(
    json!({}), Some(AttachReason::Accepted), controlled_by(steady(), "LLMService", "vllm-qwen-hearth", "svc-uid"), &[][..], "NameInUse",
)]
#[case::leaving_keeps_another_deployments_objects(
    json!({}), Some(AttachReason::ModelNameConflict), controlled_by(steady(), "Deployment", "other", "other-uid"), &[][..], "ModelNameConflict",
)]
fn writes_per_case(
    #[case] patch: Value,
    #[case] reason: Option<AttachReason>,
    #[case] view: MemberView,
    #[case] want: &[&str],
    #[case] event_reason: &str,
) {
    let d = deployment(patch);
    let v = reason.map(verdict);
    let out = decide_member(&d, v.as_ref(), Some(&endpoint()), &[], &view, &cfg());
    assert_eq!(
        writes(&plan_member("vllm-qwen", &out.decision, &view)),
        want,
        "{:?}",
        out.state
    );
    assert_eq!(out.state.reason, event_reason, "{:?}", out.state);
}

#[test]
fn the_state_says_what_to_fix_and_agrees_with_the_endpoints_verdict() {
    let ep = endpoint();
    let accepted = verdict(AttachReason::Accepted);
    let d = deployment(json!({}));
    let out = decide_member(&d, Some(&accepted), Some(&ep), &[], &steady(), &cfg());
    assert_eq!(
        out.state.note,
        "Accepted here; KEDA scales the Deployment between 0 and 1 replicas on the model's demand (ScaledObject vllm-qwen-hearth), and the gateway reaches its pods through Service vllm-qwen-hearth (port http)"
    );
    let gateway = SharedGateway::of(&ep);
    assert!(out.state.agrees(&accepted, Some(&gateway)));
    // The endpoint's replicas became peers: its gateway changed, the member is stale.
    let mut two = ep.clone();
    two.spec.replicas = Some(2);
    assert!(!out.state.agrees(&accepted, Some(&SharedGateway::of(&two))));
    assert!(
        !out.state
            .agrees(&verdict(AttachReason::ModelNameConflict), None)
    );
    // Not accepted: the verdict is all that counts.
    let taken = verdict(AttachReason::ModelNameConflict);
    let out = decide_member(&d, Some(&taken), Some(&ep), &[], &steady(), &cfg());
    assert!(out.state.agrees(&taken, None));
    assert_eq!(out.state.note, "ModelNameConflict here");

    // A malformed reference names the annotation and the fix.
    let bad =
        deployment(json!({"metadata": {"annotations": {"serving.hearth.dev/endpoint": "Shared"}}}));
    let out = decide_member(&bad, None, None, &[], &MemberView::default(), &cfg());
    assert!(
        out.state.note.starts_with(
            "the Deployment cannot join an endpoint: metadata.annotations[\"serving.hearth.dev/endpoint\"]: \"Shared\" does not name an LLMEndpoint"
        ),
        "{}",
        out.state.note
    );
    // A served name other than the model annotation is a warning, the Deployment still joins.
    let other =
        deployment(json!({"metadata": {"annotations": {"serving.hearth.dev/model": "qwen-7b"}}}));
    let out = decide_member(
        &other,
        Some(&accepted),
        Some(&ep),
        &[],
        &MemberView::default(),
        &cfg(),
    );
    assert!(matches!(out.decision, MemberDecision::Join(_)));
    assert_eq!(out.state.warnings.len(), 1, "{:?}", out.state.warnings);
    assert!(
        out.state.warnings[0].contains("but container \"vllm\" serves the model as \"qwen\""),
        "{:?}",
        out.state.warnings
    );
}

#[test]
fn events_follow_changes_only() {
    let accepted = MemberState {
        verdict: Some(("Accepted".into(), "m".into())),
        gateway: None,
        reason: "Accepted".into(),
        note: "served".into(),
        warnings: vec![],
    };
    let e = events(None, &accepted);
    assert_eq!(e.len(), 1);
    assert_eq!((e[0].0, e[0].1.as_str()), (EventType::Normal, "Accepted"));
    assert!(events(Some(&accepted), &accepted).is_empty());
    let taken = MemberState {
        reason: "ModelNameConflict".into(),
        note: "taken".into(),
        warnings: vec!["spec.selector.matchExpressions: ...".into()],
        ..accepted.clone()
    };
    let e = events(Some(&accepted), &taken);
    assert_eq!(
        e.iter()
            .map(|(t, r, _)| (*t, r.as_str()))
            .collect::<Vec<_>>(),
        [
            (EventType::Warning, "ModelNameConflict"),
            (EventType::Warning, "MemberWarning")
        ]
    );
    assert!(events(Some(&taken), &taken).is_empty());
}

#[test]
fn the_runtime_picks_the_container_and_port() {
    let rt: InferenceRuntime = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": "vllm-a10"},
        "spec": {
            "vendor": "nvidia",
            "container": {"image": "vllm/vllm-openai:v0.8.5", "port": {"name": "api", "containerPort": 9000}},
            "accelerator": {"resourceName": "nvidia.com/gpu"},
        }
    }))
    .unwrap();
    // Two containers: the runtime's port picks the engine; its port by the runtime's number.
    let d = deployment(json!({
        "metadata": {"annotations": {"serving.hearth.dev/runtime": "vllm-a10"}},
        "spec": {"template": {"spec": {"containers": [
            {"name": "proxy", "image": "envoy", "ports": [{"name": "http", "containerPort": 8080}]},
            {"name": "engine", "image": "vllm", "ports": [{"containerPort": 9000}],
             "args": ["--served-model-name=qwen"]},
        ]}}},
    }));
    let rts = [rt];
    assert!(member_runtime(&d, &rts).is_some());
    let (member, port, findings) = member_serving(&d, &rts).unwrap();
    assert_eq!(member.model, "qwen");
    assert!(findings.is_empty(), "{findings}");
    assert_eq!(
        port,
        MemberPort {
            container: "engine".into(),
            name: "api".into(),
            target: k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(9000),
        }
    );
    // Without the runtime two containers are ambiguous: the annotation to add is named.
    let why = member_serving(&d, &[]).unwrap_err();
    assert!(
        why.contains("annotate the Deployment with serving.hearth.dev/container: <name>"),
        "{why}"
    );
}

#[test]
fn the_sweeper_does_not_delete_twice_what_a_cache_still_holds() {
    // Leaving, every object the Deployment controls goes; objects deleted a moment ago (by UID)
    // are not deleted again, a new one of the same name is.
    let mut view = steady();
    let mut service = view.service.take().map(|o| o.as_ref().clone()).unwrap();
    service.metadata.uid = Some("svc-1".into());
    view.service = Some(Arc::new(service));
    let mut so = view
        .scaled_object
        .take()
        .map(|o| o.as_ref().clone())
        .unwrap();
    so.metadata.uid = Some("so-1".into());
    view.scaled_object = Some(Arc::new(so));
    assert_eq!(view.uids(), ["svc-1", "so-1"]);
    view.forget(|uid| uid == "so-1" || uid == "svc-0");
    assert_eq!(
        writes(&plan_member("vllm-qwen", &MemberDecision::Leave, &view)),
        [
            "delete Service vllm-qwen-hearth",
            "delete RoleBinding vllm-qwen-hearth",
            "delete Role vllm-qwen-hearth"
        ]
    );
}

//! Table tests of [`plan`]: one service, the caches as the controller last left them (the steady
//! state), and per case an edit of that view and the writes and conditions it must lead to.

use std::collections::BTreeMap;

use hearth_crds::InferenceRuntime;
use hearth_crds::wellknown::DRAIN_IMAGE_ANNOTATION;
use k8s_openapi::api::apps::v1::DeploymentStatus;
use rstest::rstest;
use serde_json::{Value, json};

use super::*;
use crate::{labels::INSTANCE_LABEL, reconcile::desired::desired, render::render};

fn service(patch: Value) -> LLMService {
    let mut svc = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1", "generation": 2},
        "spec": {
            "model": {"source": {"uri": "hf://org/model"}},
            "runtime": {"name": "rt"},
            "cache": {"size": "30Gi"},
        }
    });
    hearth_test_support::merge_json(&mut svc, patch);
    serde_json::from_value(svc).unwrap()
}

fn runtime() -> InferenceRuntime {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": "rt"},
        "spec": {
            "vendor": "nvidia",
            "container": {
                "image": "example.com/vllm:1",
                "args": ["--model={{ .Model.Path }}"],
                "port": {"name": "http", "containerPort": 8000},
            },
            "accelerator": {"resourceName": "nvidia.com/gpu"},
            // The built-in policies add the drain sidecar (see `upgrade`).
            "lifecycle": {"preStopDrain": true},
        }
    }))
    .unwrap()
}

fn cfg() -> RenderConfig {
    RenderConfig::builtin().unwrap()
}

/// The caches after the controller applied everything `svc` asks for, with KEDA installed.
fn steady(svc: &LLMService) -> View {
    steady_with(svc, &cfg())
}

/// [`steady`] with the children rendered with `cfg`.
fn steady_with(svc: &LLMService, cfg: &RenderConfig) -> View {
    let c = render(svc, &runtime(), cfg, false).unwrap();
    View {
        service_account: c
            .gateway_service_account
            .map(|o| Arc::new(crate::diff::stamped(o))),
        role: Some(Arc::new(crate::diff::stamped(c.gateway_role))),
        role_binding: Some(Arc::new(crate::diff::stamped(c.gateway_role_binding))),
        claim: c.cache_claim.map(|o| Arc::new(crate::diff::stamped(o))),
        job: c.prewarm_job.map(|o| Arc::new(crate::diff::stamped(o))),
        adapter_fetch_jobs: c
            .adapter_fetch_jobs
            .into_iter()
            .map(|o| Arc::new(crate::diff::stamped(o)))
            .collect(),
        backend_service: Some(Arc::new(crate::diff::stamped(c.backend_service))),
        gateway_service: c.gateway_service.map(|o| Arc::new(crate::diff::stamped(o))),
        scaler_service: c.scaler_service.map(|o| Arc::new(crate::diff::stamped(o))),
        admin_service: c.admin_service.map(|o| Arc::new(crate::diff::stamped(o))),
        backend: Some(Arc::new(crate::diff::stamped(c.backend))),
        legacy_backend: None,
        gateway: c.gateway.map(|o| Arc::new(crate::diff::stamped(o))),
        gateway_pdb: c.gateway_pdb.map(|o| Arc::new(crate::diff::stamped(o))),
        gateway_network_policy: c
            .gateway_network_policy
            .map(|o| Arc::new(crate::diff::stamped(o))),
        backend_network_policy: c
            .backend_network_policy
            .map(|o| Arc::new(crate::diff::stamped(o))),
        adapters_config_map: c
            .adapters_config_map
            .map(|o| Arc::new(crate::diff::stamped(o))),
        endpoint_gateway: None,
        keda_installed: true,
        scaled_object: Some(Arc::new(crate::diff::stamped(c.scaled_object))),
        backend_pods: Vec::new(),
        pull_failures: Default::default(),
    }
}

/// `plan` as a reconcile runs it.
fn plan_with(svc: &LLMService, view: &View, cfg: &RenderConfig) -> Plan {
    let desired = desired(
        svc,
        [&runtime()],
        cfg,
        view.backend.is_none(),
        None,
        &Default::default(),
    );
    plan(svc, desired, view, cfg)
}

fn planned(svc: &LLMService, view: &View) -> Plan {
    plan_with(svc, view, &cfg())
}

fn writes(plan: &Plan) -> Vec<String> {
    plan.writes.iter().map(ToString::to_string).collect()
}

fn cond<'a>(plan: &'a Plan, type_: &str) -> &'a Cond {
    plan.condition(type_)
        .unwrap_or_else(|| panic!("no {type_} in {:?}", plan.conds))
}

/// `o` as another manager (upstream Hearth) wrote it: without `app.kubernetes.io/instance`.
fn foreign<K: Resource + Clone>(o: &Option<Arc<K>>) -> Option<Arc<K>> {
    let mut o = K::clone(o.as_deref().unwrap());
    o.meta_mut().labels.as_mut().unwrap().remove(INSTANCE_LABEL);
    Some(Arc::new(o))
}

/// `o` controlled by another object.
fn not_owned<K: Resource + Clone>(o: Option<Arc<K>>) -> Option<Arc<K>> {
    let mut o = K::clone(o.as_deref().unwrap());
    for r in o.meta_mut().owner_references.iter_mut().flatten() {
        r.uid = "someone-else".to_owned();
    }
    Some(Arc::new(o))
}

/// `o` created from another template (its template hash differs).
fn other_template<K: Resource + Clone>(o: &Option<Arc<K>>) -> Option<Arc<K>> {
    let mut o = K::clone(o.as_deref().unwrap());
    o.meta_mut()
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(TEMPLATE_HASH_ANNOTATION.to_owned(), "0000".to_owned());
    Some(Arc::new(o))
}

/// The gateway as an earlier version wrote it: another selector.
fn old_gateway(view: &View) -> Option<Arc<Deployment>> {
    let mut d = Deployment::clone(view.gateway.as_deref().unwrap());
    let spec = d.spec.as_mut().unwrap();
    spec.selector.match_labels = Some(BTreeMap::from([("app".to_owned(), "chat".to_owned())]));
    Some(Arc::new(d))
}

const PUSH: &str = "serving.hearth.dev/scaler";

#[rstest]
#[case::steady_state_writes_nothing(json!({}), |_: &mut View| {}, &[])]
#[case::a_new_service_gets_everything(json!({}), |v: &mut View| *v = View { keda_installed: true, ..View::default() }, &[
    "apply ServiceAccount chat-gateway",
    "apply Role chat-gateway",
    "apply RoleBinding chat-gateway",
    "apply PersistentVolumeClaim chat-cache",
    "apply Service chat-backend",
    "create Deployment chat",
    "apply Service chat",
    "apply Service chat-gateway-admin",
    "apply Deployment chat-gateway",
    "apply PodDisruptionBudget chat-gateway",
    "apply ScaledObject chat",
])]
#[case::a_push_service_gets_the_scaler_service_and_a_prewarm(
    json!({"metadata": {"annotations": {PUSH: "push"}}, "spec": {"cache": {"prewarm": true}}}),
    |v: &mut View| { v.scaler_service = None; v.job = None; },
    &["apply Job chat-prewarm", "apply Service chat-scaler"],
)]
#[case::a_changed_child_is_applied(json!({}), |v: &mut View| {
    let mut s = Service::clone(v.gateway_service.as_deref().unwrap());
    s.metadata.labels.as_mut().unwrap().insert(INSTANCE_LABEL.to_owned(), "other".to_owned());
    v.gateway_service = Some(Arc::new(s));
}, &["apply Service chat"])]
#[case::a_deleted_child_is_applied(json!({}), |v: &mut View| v.gateway_pdb = None, &["apply PodDisruptionBudget chat-gateway"])]
// Adoption: another manager's child is adopted, then applied.
#[case::adopts_a_foreign_backend(json!({}), |v: &mut View| v.backend = foreign(&v.backend), &["adopt Deployment chat", "apply Deployment chat"])]
#[case::adopts_a_foreign_gateway_service(json!({}), |v: &mut View| v.gateway_service = foreign(&v.gateway_service), &["adopt Service chat", "apply Service chat"])]
#[case::adopts_a_foreign_cache_claim(json!({}), |v: &mut View| v.claim = foreign(&v.claim), &["adopt PersistentVolumeClaim chat-cache", "apply PersistentVolumeClaim chat-cache"])]
#[case::adopts_a_foreign_scaled_object(json!({}), |v: &mut View| v.scaled_object = foreign(&v.scaled_object), &["adopt ScaledObject chat", "apply ScaledObject chat"])]
#[case::adopts_the_gateway_rbac(json!({}), |v: &mut View| { v.role = foreign(&v.role); v.role_binding = foreign(&v.role_binding); }, &[
    "adopt Role chat-gateway", "apply Role chat-gateway", "adopt RoleBinding chat-gateway", "apply RoleBinding chat-gateway",
])]
// A foreign prewarm Job is create-once like ours: left as it is, whatever its template.
#[case::leaves_a_foreign_job(json!({"spec": {"cache": {"prewarm": true}}}), |v: &mut View| v.job = foreign(&other_template(&v.job)), &[])]
// Delete-if-owned.
#[case::deletes_the_legacy_backend_it_owns(json!({}), |v: &mut View| {
    v.legacy_backend = v.backend.take();
}, &["delete Deployment chat-backend", "create Deployment chat"])]
#[case::keeps_a_legacy_backend_it_does_not_own(json!({}), |v: &mut View| {
    v.legacy_backend = not_owned(v.backend.take());
}, &["create Deployment chat"])]
#[case::deletes_its_scaler_service_in_poll_mode(json!({}), |v: &mut View| {
    v.scaler_service = v.backend_service.clone();
}, &["delete Service chat-scaler"])]
#[case::keeps_a_scaler_service_it_does_not_own(json!({}), |v: &mut View| {
    v.scaler_service = not_owned(v.backend_service.clone());
}, &[])]
#[case::replaces_its_gateway_with_another_selector(json!({}), |v: &mut View| v.gateway = old_gateway(v), &[
    "delete Deployment chat-gateway", "apply Deployment chat-gateway",
])]
#[case::applies_over_a_gateway_it_does_not_own(json!({}), |v: &mut View| v.gateway = not_owned(old_gateway(v)), &["apply Deployment chat-gateway"])]
// Create-once children.
#[case::never_reapplies_its_job(json!({"spec": {"cache": {"prewarm": true}}}), |v: &mut View| {
    let mut j = Job::clone(v.job.as_deref().unwrap());
    j.metadata.labels.as_mut().unwrap().insert("extra".to_owned(), "x".to_owned());
    j.spec.as_mut().unwrap().backoff_limit = Some(1);
    v.job = Some(Arc::new(j));
}, &[])]
#[case::keda_missing_applies_no_scaled_object(json!({}), |v: &mut View| { v.keda_installed = false; v.scaled_object = None; }, &[])]
fn writes_per_case(#[case] patch: Value, #[case] edit: fn(&mut View), #[case] want: &[&str]) {
    let svc = service(patch);
    let mut view = steady(&svc);
    edit(&mut view);
    assert_eq!(writes(&planned(&svc, &view)), want);
}

#[test]
fn a_new_backend_is_created_with_replicas_and_an_existing_one_applied_without() {
    let svc = service(json!({"spec": {"scaling": {"min": 2, "max": 2}}}));
    let plan = planned(&svc, &View::default());
    let created = plan.writes.iter().find_map(|w| match w {
        Write::Create(d) => Some(d),
        _ => None,
    });
    assert_eq!(created.unwrap().spec.as_ref().unwrap().replicas, Some(2));

    let mut view = steady(&svc);
    let mut live = Deployment::clone(view.backend.as_deref().unwrap());
    live.spec
        .as_mut()
        .unwrap()
        .template
        .spec
        .as_mut()
        .unwrap()
        .containers[0]
        .image = Some("example.com/vllm:0".to_owned());
    view.backend = Some(Arc::new(live));
    let plan = planned(&svc, &view);
    let [Write::Apply(Object::Deployment(d))] = plan.writes.as_slice() else {
        panic!("{:?}", writes(&plan));
    };
    assert_eq!(d.spec.as_ref().unwrap().replicas, None);
}

/// The ScaledObject a plan applies, if any.
/// The data plane's NetworkPolicies come with the setting, before the pods they guard, and go
/// with it; a service that joins an endpoint drops its gateway's.
#[test]
fn network_policies_follow_the_setting() {
    let svc = service(json!({}));
    let mut on = cfg();
    on.network_policies = Some(
        crate::render::ModelNetworkPolicies::parse(
            r#"{"kedaNamespace":"keda","controllerNamespace":"hearth-system","controllerPodLabels":{"app.kubernetes.io/name":"hearth"}}"#,
        )
        .unwrap(),
    );
    let p = plan_with(&svc, &steady(&svc), &on);
    assert!(cond(&p, status::NETWORK_POLICY_READY).is_true());
    assert!(
        planned(&svc, &steady(&svc))
            .condition(status::NETWORK_POLICY_READY)
            .is_none()
    );
    // A policy the apiserver refuses is reported, and does not stop the reconcile.
    let refused = recovery(
        &p.writes[0],
        &Status {
            code: 422,
            message: "spec.ingress[0].from[0].ipBlock.except[0]: Invalid value".into(),
            ..Status::default()
        },
    );
    let Recovery::Report(c) = refused else {
        panic!("{refused:?}")
    };
    assert_eq!(c.type_, status::NETWORK_POLICY_READY);
    assert!(
        c.message
            .contains("NetworkPolicy chat-backend: spec.ingress[0]"),
        "{}",
        c.message
    );
    let w = writes(&p);
    assert_eq!(
        w,
        [
            "apply NetworkPolicy chat-backend",
            "apply NetworkPolicy chat-gateway"
        ]
    );
    // Each before what it guards.
    let all = writes(&plan_with(
        &svc,
        &View {
            keda_installed: true,
            ..View::default()
        },
        &on,
    ));
    let at = |w: &str| all.iter().position(|x| x == w).unwrap();
    assert!(at("apply NetworkPolicy chat-backend") < at("create Deployment chat"));
    assert!(at("apply NetworkPolicy chat-gateway") < at("apply Deployment chat-gateway"));

    // Steady with the setting on: nothing; switched off: both deleted.
    let view = steady_with(&svc, &on);
    assert!(writes(&plan_with(&svc, &view, &on)).is_empty());
    assert_eq!(
        writes(&plan_with(&svc, &view, &cfg())),
        [
            "delete NetworkPolicy chat-backend",
            "delete NetworkPolicy chat-gateway"
        ]
    );
    // Another manager's policy of that name is left alone.
    let foreign_view = View {
        backend_network_policy: not_owned(view.backend_network_policy.clone()),
        gateway_network_policy: None,
        ..view
    };
    assert!(writes(&plan_with(&svc, &foreign_view, &cfg())).is_empty());
}

fn applied_scaled_object(plan: &Plan) -> Option<&DynamicObject> {
    plan.writes.iter().find_map(|w| match w {
        Write::Apply(Object::ScaledObject(so)) => Some(&**so),
        _ => None,
    })
}

fn paused(so: &DynamicObject) -> Option<&str> {
    so.metadata
        .annotations
        .as_ref()?
        .get(KEDA_PAUSED_ANNOTATION)
        .map(String::as_str)
}

fn job_succeeded(view: &mut View) {
    let mut job = Job::clone(view.job.as_deref().unwrap());
    job.status = Some(k8s_openapi::api::batch::v1::JobStatus {
        succeeded: Some(1),
        ..Default::default()
    });
    view.job = Some(Arc::new(job));
}

#[test]
fn a_shared_cache_backend_waits_at_zero_for_its_prewarm() {
    let svc = service(json!({"spec": {
        "cache": {"strategy": "SharedPVC", "prewarm": true},
        "scaling": {"min": 1, "max": 2},
    }}));
    // Just created: the backend is created at 0 (not min 1) and KEDA paused.
    let fresh = View {
        keda_installed: true,
        ..View::default()
    };
    let plan = planned(&svc, &fresh);
    let created = plan.writes.iter().find_map(|w| match w {
        Write::Create(d) => Some(d),
        _ => None,
    });
    assert_eq!(created.unwrap().spec.as_ref().unwrap().replicas, Some(0));
    assert_eq!(paused(applied_scaled_object(&plan).unwrap()), Some("true"));

    // At zero while the Job downloads: paused, Ready=False WaitingForPrewarm.
    let mut view = steady(&svc);
    view.backend = with_status(&view.backend, 0, 0);
    view.gateway = with_status(&view.gateway, 1, 1);
    // Whether or not KEDA calls the paused ScaledObject Ready.
    let plan = planned(&svc, &view);
    assert_eq!(cond(&plan, status::READY).reason, "WaitingForPrewarm");
    scaled_object_ready(&mut view);
    let plan = planned(&svc, &view);
    assert_eq!(paused(applied_scaled_object(&plan).unwrap()), Some("true"));
    assert_eq!(plan.phase, LLMServicePhase::ScaledToZero);
    let ready = cond(&plan, status::READY);
    assert_eq!(
        (ready.status, ready.reason.as_str()),
        ("False", "WaitingForPrewarm")
    );
    assert!(ready.message.contains("chat-prewarm"), "{}", ready.message);

    // Once it succeeded: KEDA resumes (the annotation is no longer applied), Ready=True.
    let mut done = view.clone();
    job_succeeded(&mut done);
    let mut paused_so = DynamicObject::clone(done.scaled_object.as_deref().unwrap());
    let annotations = paused_so
        .metadata
        .annotations
        .get_or_insert_with(BTreeMap::new);
    annotations.insert(KEDA_PAUSED_ANNOTATION.to_owned(), "true".to_owned());
    annotations.insert(
        PREWARM_WAIT_ANNOTATION.to_owned(),
        "chat-prewarm".to_owned(),
    );
    done.scaled_object = Some(Arc::new(paused_so));
    let plan = planned(&svc, &done);
    assert_eq!(applied_scaled_object(&plan).and_then(paused), None);
    assert!(
        applied_scaled_object(&plan).is_some(),
        "{:?}",
        writes(&plan)
    );
    assert!(cond(&plan, status::READY).is_true());
    // A pause set by hand (no Hearth annotation) is another manager's: no write.
    let mut by_hand = DynamicObject::clone(done.scaled_object.as_deref().unwrap());
    by_hand
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .remove(PREWARM_WAIT_ANNOTATION);
    done.scaled_object = Some(Arc::new(by_hand));
    assert!(applied_scaled_object(&planned(&svc, &done)).is_none());

    // A backend with replicas is never paused, even while a Job runs again.
    let mut running = view.clone();
    running.backend = with_status(&view.backend, 1, 1);
    let plan = planned(&svc, &running);
    assert_eq!(applied_scaled_object(&plan).and_then(paused), None);
    assert_eq!(plan.phase, LLMServicePhase::Ready);

    // Other strategies never wait.
    let svc = service(json!({"spec": {"cache": {"strategy": "NodeLocalPVC", "prewarm": true}}}));
    let plan = planned(&svc, &fresh);
    assert!(applied_scaled_object(&plan).is_some_and(|so| paused(so).is_none()));
}

/// The plan for `service(patch)` when `edit` makes a live child's template differ from the
/// desired one: nothing is written, and the condition `type_` is False with ReplaceRequired and
/// a message holding every part of `message`.
fn replace_required(patch: Value, edit: fn(&mut View), type_: &str, message: &[&str]) -> Plan {
    let svc = service(patch);
    let mut view = steady(&svc);
    edit(&mut view);
    let plan = planned(&svc, &view);
    assert_eq!(writes(&plan), Vec::<String>::new());
    let c = cond(&plan, type_);
    assert_eq!((c.status, c.reason.as_str()), ("False", "ReplaceRequired"));
    assert!(message.iter().all(|m| c.message.contains(m)), "{c:?}");
    plan
}

#[test]
fn replace_required_when_the_claims_storage_class_changed() {
    replace_required(
        json!({"spec": {"cache": {"storageClassName": "fast"}}}),
        |v| v.claim = other_template(&v.claim),
        status::CACHE_READY,
        &[
            "storageClassName changed",
            "delete PersistentVolumeClaim chat-cache",
        ],
    );
}

#[test]
fn replace_required_when_the_apiserver_refuses_a_smaller_claim() {
    let svc = service(json!({"spec": {"cache": {"size": "10Gi"}}}));
    let mut view = steady(&service(json!({})));
    view.backend = steady(&svc).backend;
    let mut plan = planned(&svc, &view);
    assert_eq!(writes(&plan), ["apply PersistentVolumeClaim chat-cache"]);
    let refused = Status {
        code: 422,
        message:
            "spec.resources.requests.storage: Forbidden: field can not be less than previous value"
                .to_owned(),
        ..Status::default()
    };
    let Recovery::Report(c) = recovery(&plan.writes[0], &refused) else {
        panic!("a 422 on the claim is a condition");
    };
    assert_eq!(
        (c.type_, c.status, c.reason.as_str()),
        (status::CACHE_READY, "False", "ReplaceRequired")
    );
    assert!(
        c.message.contains("can not be less than previous value")
            && c.message
                .contains("a claim can only grow; delete PersistentVolumeClaim chat-cache"),
        "{c:?}"
    );
    plan.set_condition(c.clone());
    assert_eq!(cond(&plan, status::CACHE_READY), &c);
    assert_eq!(plan.conds.len(), 6, "{:?}", plan.conds);
}

#[test]
fn replace_required_when_the_prewarm_template_changed() {
    let plan = replace_required(
        json!({"spec": {"cache": {"prewarm": true}}}),
        |v| v.job = other_template(&v.job),
        status::PREWARMED,
        &["delete Job chat-prewarm"],
    );
    // Not a Ready=False of its own: the backend does not wait for a prewarm.
    assert_ne!(cond(&plan, status::READY).reason, "ReplaceRequired");
}

#[test]
fn conditions_of_the_cache_and_prewarm_per_source_and_strategy() {
    for (patch, cache, prewarm) in [
        (json!({}), "Pending", "NotRequested"),
        (
            json!({"spec": {"cache": {"strategy": "HostPath", "size": null}}}),
            "HostPath",
            "NotRequested",
        ),
        (
            json!({"spec": {"cache": {"strategy": "None", "size": null}}}),
            "NoCache",
            "NotRequested",
        ),
        (
            json!({"spec": {"cache": {"strategy": "None", "size": null, "prewarm": true}}}),
            "NoCache",
            "NoCache",
        ),
        (
            json!({"spec": {"model": {"source": {"uri": "pvc://weights"}}, "cache": {"size": null, "prewarm": true}}}),
            "PreStaged",
            "NotApplicable",
        ),
        (
            json!({"spec": {"cache": {"prewarm": true}}}),
            "Pending",
            "Downloading",
        ),
    ] {
        let svc = service(patch.clone());
        let plan = planned(&svc, &steady(&svc));
        assert_eq!(
            (
                cond(&plan, status::CACHE_READY).reason.as_str(),
                cond(&plan, status::PREWARMED).reason.as_str()
            ),
            (cache, prewarm),
            "{patch}"
        );
    }
    let svc = service(json!({"spec": {"cache": {"strategy": "HostPath", "size": null}}}));
    let plan = planned(&svc, &steady(&svc));
    assert!(
        cond(&plan, status::CACHE_READY)
            .message
            .ends_with("under /var/lib/hearth/models")
    );
}

#[test]
fn a_bound_claim_is_ready_and_an_adopted_one_reported_pending() {
    let svc = service(json!({}));
    let mut view = steady(&svc);
    let mut claim = PersistentVolumeClaim::clone(view.claim.as_deref().unwrap());
    claim.status = Some(k8s_openapi::api::core::v1::PersistentVolumeClaimStatus {
        phase: Some("Bound".to_owned()),
        ..Default::default()
    });
    view.claim = Some(Arc::new(claim));
    assert!(cond(&planned(&svc, &view), status::CACHE_READY).is_true());
    view.claim = foreign(&view.claim);
    let c = cond(&planned(&svc, &view), status::CACHE_READY).clone();
    assert_eq!(c.reason, "Pending");
}

#[test]
fn nothing_is_written_for_a_service_that_cannot_be_rendered() {
    let svc = service(json!({"spec": {"cache": {"strategy": "SharedPVC"}}}));
    let plan = planned(&svc, &View::default());
    assert!(plan.writes.is_empty());
    assert_eq!(plan.phase, LLMServicePhase::Degraded);
    assert_eq!(plan.replicas, 0);
    let svc = service(json!({"spec": {"runtime": {"name": "nowhere"}}}));
    let plan = planned(&svc, &View::default());
    assert!(plan.writes.is_empty());
    assert_eq!(plan.phase, LLMServicePhase::Pending);
    assert_eq!(plan.resolved_runtime, None);
    assert_eq!(cond(&plan, status::READY).reason, "RuntimeNotResolved");
}

fn with_status(d: &Option<Arc<Deployment>>, replicas: i32, ready: i32) -> Option<Arc<Deployment>> {
    let mut d = Deployment::clone(d.as_deref().unwrap());
    d.spec.as_mut().unwrap().replicas = Some(replicas);
    d.status = Some(DeploymentStatus {
        replicas: Some(replicas),
        ready_replicas: Some(ready),
        ..Default::default()
    });
    Some(Arc::new(d))
}

fn scaled_object_ready(view: &mut View) {
    let mut so = DynamicObject::clone(view.scaled_object.as_deref().unwrap());
    so.data["status"] = json!({"conditions": [{"type": "Ready", "status": "True"}]});
    view.scaled_object = Some(Arc::new(so));
}

#[test]
fn phase_and_ready_come_from_the_cached_backend_and_gateway() {
    let svc = service(json!({}));
    // Just created: what is created (scaling.min = 0), nothing ready yet.
    let plan = planned(&svc, &View::default());
    assert_eq!(plan.phase, LLMServicePhase::ScaledToZero);
    assert_eq!(cond(&plan, status::READY).reason, "GatewayNotReady");

    let mut view = steady(&svc);
    view.backend = with_status(&view.backend, 1, 0);
    assert_eq!(planned(&svc, &view).phase, LLMServicePhase::Loading);
    view.backend = with_status(&view.backend, 2, 2);
    view.gateway = with_status(&view.gateway, 1, 1);
    let plan = planned(&svc, &view);
    assert_eq!(
        (
            plan.phase,
            plan.replicas,
            cond(&plan, status::READY).is_true()
        ),
        (LLMServicePhase::Ready, 2, true)
    );

    // At zero, Ready needs autoscaling: a ScaledObject KEDA reports Ready.
    view.backend = with_status(&view.backend, 0, 0);
    let plan = planned(&svc, &view);
    assert_eq!(cond(&plan, status::READY).reason, "AutoscalingNotReady");
    scaled_object_ready(&mut view);
    let mut plan = planned(&svc, &view);
    assert_eq!(
        (plan.phase, cond(&plan, status::READY).reason.as_str()),
        (LLMServicePhase::ScaledToZero, "ScaledToZero")
    );
    // ... and the apply meeting a CRD gone since is reported, and Ready follows.
    plan.writes = vec![Write::Apply(
        DynamicObject::clone(view.scaled_object.as_deref().unwrap()).into(),
    )];
    let gone = Status {
        code: 404,
        ..Status::default()
    };
    let Recovery::Report(c) = recovery(&plan.writes[0], &gone) else {
        panic!("a 404 on the ScaledObject is a condition");
    };
    plan.set_condition(c);
    assert_eq!(
        cond(&plan, status::AUTOSCALING_READY).reason,
        "KEDANotInstalled"
    );
    assert_eq!(cond(&plan, status::READY).reason, "AutoscalingNotReady");
}

#[test]
fn a_gateway_not_ready_names_the_api_key_secret() {
    let svc = service(json!({"spec": {"endpoint": {"apiKeySecretRef": {"name": "keys"}}}}));
    let mut view = steady(&svc);
    view.backend = with_status(&view.backend, 0, 0);
    let plan = planned(&svc, &view);
    let ready = cond(&plan, status::READY);
    assert_eq!(ready.reason, "GatewayNotReady");
    assert!(
        ready.message.ends_with(
            "the gateway mounts the API keys from key \"api-keys\" of Secret \"keys\": until both exist its pods wait in ContainerCreating (FailedMount events on the pods of Deployment chat-gateway)"
        ),
        "{ready:?}"
    );
}

#[test]
fn conditions_come_in_their_order_and_the_status_from_the_plan() {
    let svc = service(json!({}));
    let plan = planned(&svc, &steady(&svc));
    let types: Vec<_> = plan.conds.iter().map(|c| c.type_).collect();
    assert_eq!(types, CONDITION_ORDER);
    let now = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let st = plan.status(&svc, &now);
    assert_eq!(
        st.endpoint_url.as_deref(),
        Some("http://chat.team-a.svc/v1")
    );
    assert_eq!(st.resolved_runtime.as_deref(), Some("rt"));
    assert_eq!(st.observed_generation, Some(2));
    assert_eq!(st.conditions.len(), 6);
    assert!(st.conditions.iter().all(|c| c.last_transition_time == now));
}

#[test]
fn api_errors_a_plan_expects() {
    let svc = service(json!({}));
    let plan = planned(
        &svc,
        &View {
            keda_installed: true,
            ..View::default()
        },
    );
    let status = |code| Status {
        code,
        ..Status::default()
    };
    let by_name = |s: &str| {
        plan.writes
            .iter()
            .find(|w| w.to_string() == s)
            .unwrap_or_else(|| panic!("no {s}"))
    };
    let create = by_name("create Deployment chat");
    assert!(matches!(
        recovery(create, &status(409)),
        Recovery::ReadBackend(d) if d.metadata.name.as_deref() == Some("chat")
    ));
    assert_eq!(recovery(create, &status(422)), Recovery::Fail);
    let delete = Write::Delete(Target::new(Kind::Service, "chat-scaler"));
    assert_eq!(recovery(&delete, &status(404)), Recovery::Done);
    assert_eq!(recovery(&delete, &status(403)), Recovery::Fail);
    for other in [
        "apply Deployment chat-gateway",
        "apply Service chat",
        "apply ScaledObject chat",
    ] {
        assert_eq!(
            recovery(by_name(other), &status(409)),
            Recovery::Fail,
            "{other}"
        );
    }
    assert_eq!(
        recovery(by_name("apply Deployment chat-gateway"), &status(404)),
        Recovery::Fail
    );
    assert_eq!(
        recovery(
            by_name("apply PersistentVolumeClaim chat-cache"),
            &status(500)
        ),
        Recovery::Fail
    );
    assert_eq!(
        by_name("apply PersistentVolumeClaim chat-cache").action("team-a"),
        "apply PersistentVolumeClaim team-a/chat-cache"
    );
}

/// A backend rendered with the drain sidecar image `image` and, as a live object, running it
/// with `replicas`.
fn backend_with_drain_image(svc: &LLMService, image: &str, replicas: i32) -> Deployment {
    let mut cfg = cfg();
    cfg.drain_image = Some(image.to_owned());
    let mut d = render(svc, &runtime(), &cfg, true).unwrap().backend;
    d.spec.as_mut().unwrap().replicas = Some(replicas);
    d
}

fn pod_template(d: &Deployment) -> Value {
    serde_json::to_value(&d.spec.as_ref().unwrap().template).unwrap()
}

#[test]
fn a_create_that_met_a_backend_adopts_it_and_applies_without_replicas() {
    let svc = service(json!({"spec": {"scaling": {"min": 1}}}));
    let desired = backend_with_drain_image(&svc, "example.com/drain:2", 1);
    assert_ne!(
        recorded_image(&desired),
        None,
        "the policies add the drain sidecar"
    );

    // Ours, at zero: the new drain image is taken.
    let live = backend_with_drain_image(&svc, "example.com/drain:1", 0);
    let ws = after_conflict(&desired, &live, Some("example.com/drain:2"));
    let [Write::Apply(Object::Deployment(d))] = ws.as_slice() else {
        panic!("{ws:?}");
    };
    assert_eq!(d.spec.as_ref().unwrap().replicas, None);
    assert_eq!(pod_template(d), pod_template(&desired));

    // Running pods keep the drain image they run.
    let live = backend_with_drain_image(&svc, "example.com/drain:1", 1);
    let ws = after_conflict(&desired, &live, Some("example.com/drain:2"));
    let [Write::Apply(Object::Deployment(d))] = ws.as_slice() else {
        panic!("{ws:?}");
    };
    assert_eq!(pod_template(d), pod_template(&live));

    // Another manager's: adopted first.
    let mut upstream = live.clone();
    upstream
        .metadata
        .labels
        .as_mut()
        .unwrap()
        .remove(INSTANCE_LABEL);
    let ws = after_conflict(&desired, &upstream, Some("example.com/drain:2"));
    assert_eq!(
        ws.iter().map(ToString::to_string).collect::<Vec<_>>(),
        ["adopt Deployment chat", "apply Deployment chat"]
    );
}

fn recorded_image(d: &Deployment) -> Option<&String> {
    d.metadata.annotations.as_ref()?.get(DRAIN_IMAGE_ANNOTATION)
}

#[test]
fn a_running_backend_keeps_its_drain_image_through_an_upgrade() {
    let svc = service(json!({}));
    let mut view = steady(&svc);
    // Applied by the release before (its hash on it; the replicas are KEDA's).
    let mut applied = backend_with_drain_image(&svc, "example.com/drain:1", 1);
    applied.spec.as_mut().unwrap().replicas = None;
    let mut old = crate::diff::stamped(applied);
    old.spec.as_mut().unwrap().replicas = Some(1);
    view.backend = Some(Arc::new(old.clone()));
    let mut new = cfg();
    new.drain_image = Some("example.com/drain:2".to_owned());
    let plan = plan_with(&svc, &view, &new);
    // The live pod template and its recorded image are kept: nothing to apply.
    assert!(
        !writes(&plan).iter().any(|w| w.ends_with("Deployment chat")),
        "{:?}",
        writes(&plan)
    );
    // At zero, the new image is applied.
    view.backend = Some(Arc::new(backend_with_drain_image(
        &svc,
        "example.com/drain:1",
        0,
    )));
    let plan = plan_with(&svc, &view, &new);
    let applied = plan.writes.iter().find_map(|w| match w {
        Write::Apply(Object::Deployment(d)) if d.metadata.name.as_deref() == Some("chat") => {
            Some(d)
        }
        _ => None,
    });
    assert_eq!(
        recorded_image(applied.expect("the backend is applied")).map(String::as_str),
        Some("example.com/drain:2")
    );
}

// Shared endpoints: a service accepted by an LLMEndpoint has no gateway of its own; one that
// leaves gets it back.

use crate::{
    attach::Verdict,
    reconcile::desired::Membership,
    render::{Placement, ScalerMode, SharedGateway, render_placed},
};
use hearth_crds::llmendpoint::AttachReason;

fn shared_gateway(scaler: ScalerMode) -> SharedGateway {
    SharedGateway {
        endpoint: "shared".to_owned(),
        namespace: "platform".to_owned(),
        peers: scaler == ScalerMode::Push,
    }
}

fn accepted(scaler: ScalerMode) -> Membership {
    Membership {
        verdict: Verdict {
            reason: AttachReason::Accepted,
            message: "LLMEndpoint platform/shared serves model \"chat\"".to_owned(),
        },
        gateway: Some(shared_gateway(scaler)),
    }
}

fn refused(reason: AttachReason) -> Membership {
    Membership {
        verdict: Verdict {
            reason,
            message: "why".to_owned(),
        },
        gateway: None,
    }
}

/// The caches after the controller applied everything `svc` asks for while attached.
fn steady_attached(svc: &LLMService, scaler: ScalerMode) -> View {
    let c = render_placed(
        svc,
        &runtime(),
        &cfg(),
        false,
        &Placement::Shared(shared_gateway(scaler)),
    )
    .unwrap();
    View {
        role: Some(Arc::new(crate::diff::stamped(c.gateway_role))),
        role_binding: Some(Arc::new(crate::diff::stamped(c.gateway_role_binding))),
        claim: c.cache_claim.map(|o| Arc::new(crate::diff::stamped(o))),
        backend_service: Some(Arc::new(crate::diff::stamped(c.backend_service))),
        backend: Some(Arc::new(crate::diff::stamped(c.backend))),
        keda_installed: true,
        scaled_object: Some(Arc::new(crate::diff::stamped(c.scaled_object))),
        ..View::default()
    }
}

fn planned_member(svc: &LLMService, view: &View, membership: Option<&Membership>) -> Plan {
    let desired = desired(
        svc,
        [&runtime()],
        &cfg(),
        view.backend.is_none(),
        membership,
        &Default::default(),
    );
    plan(svc, desired, view, &cfg())
}

fn member(patch: Value) -> LLMService {
    let mut svc = service(
        json!({"spec": {"endpoint": {"sharedEndpointRef": {"name": "shared", "namespace": "platform"}}}}),
    );
    let mut v = serde_json::to_value(&svc).unwrap();
    hearth_test_support::merge_json(&mut v, patch);
    svc = serde_json::from_value(v).unwrap();
    svc
}

#[rstest]
// Joining: the member RoleBinding and the ScaledObject point at the endpoint; then the own
// gateway goes (Deployment first, its ServiceAccount last).
#[case::joining_prunes_its_own_gateway(json!({}), ScalerMode::Poll, false, &[
    "apply RoleBinding chat-gateway",
    "apply ScaledObject chat",
    "delete Deployment chat-gateway",
    "delete PodDisruptionBudget chat-gateway",
    "delete Service chat",
    "delete Service chat-gateway-admin",
    "delete ServiceAccount chat-gateway",
])]
#[case::joining_in_push_mode_prunes_the_scaler_service_too(json!({"metadata": {"annotations": {PUSH: "push"}}}), ScalerMode::Push, false, &[
    "apply RoleBinding chat-gateway",
    "apply ScaledObject chat",
    "delete Deployment chat-gateway",
    "delete PodDisruptionBudget chat-gateway",
    "delete Service chat",
    "delete Service chat-scaler",
    "delete Service chat-gateway-admin",
    "delete ServiceAccount chat-gateway",
])]
// Children another object controls are left alone.
#[case::joining_keeps_what_it_does_not_own(json!({}), ScalerMode::Poll, true, &[
    "apply RoleBinding chat-gateway",
    "apply ScaledObject chat",
])]
fn an_accepted_service_prunes_its_own_gateway(
    #[case] patch: Value,
    #[case] scaler: ScalerMode,
    #[case] foreign_owner: bool,
    #[case] want: &[&str],
) {
    let svc = member(patch);
    let mut view = steady(&svc);
    if foreign_owner {
        view.gateway = not_owned(view.gateway.clone());
        view.gateway_pdb = not_owned(view.gateway_pdb.clone());
        view.gateway_service = not_owned(view.gateway_service.clone());
        view.admin_service = not_owned(view.admin_service.clone());
        view.service_account = not_owned(view.service_account.clone());
    }
    let plan = planned_member(&svc, &view, Some(&accepted(scaler)));
    assert_eq!(writes(&plan), want);
    // Once pruned, nothing more to do.
    assert_eq!(
        writes(&planned_member(
            &svc,
            &steady_attached(&svc, scaler),
            Some(&accepted(scaler))
        )),
        Vec::<String>::new()
    );
}

#[rstest]
#[case::endpoint_deleted(Some(AttachReason::EndpointNotFound))]
#[case::namespace_no_longer_allowed(Some(AttachReason::NotAllowedByEndpoint))]
#[case::model_name_taken(Some(AttachReason::ModelNameConflict))]
#[case::reference_removed(None)]
fn a_service_leaving_gets_its_own_gateway_back_before_its_scaled_object_moves(
    #[case] reason: Option<AttachReason>,
) {
    let svc = member(json!({}));
    let view = steady_attached(&svc, ScalerMode::Poll);
    let membership = reason.map(refused);
    let svc = match reason {
        Some(_) => svc,
        None => service(json!({})),
    };
    let plan = planned_member(&svc, &view, membership.as_ref());
    assert_eq!(
        writes(&plan),
        [
            "apply ServiceAccount chat-gateway",
            "apply RoleBinding chat-gateway",
            "apply Service chat",
            "apply Service chat-gateway-admin",
            "apply Deployment chat-gateway",
            "apply PodDisruptionBudget chat-gateway",
            "apply ScaledObject chat",
        ]
    );
    // What it applies is exactly what a service without a reference renders.
    let own = render(&svc, &runtime(), &cfg(), false).unwrap();
    let rb = plan.writes.iter().find_map(|w| match w {
        Write::Apply(Object::RoleBinding(rb)) => Some(rb),
        _ => None,
    });
    assert_eq!(
        rb.map(|rb| &**rb),
        Some(&crate::diff::stamped(own.gateway_role_binding))
    );
    assert_eq!(
        applied_scaled_object(&plan).map(|so| &so.data),
        Some(&own.scaled_object.data)
    );
    let st = plan.status(&svc, &Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    assert_eq!(
        st.endpoint_url.as_deref(),
        Some("http://chat.team-a.svc/v1")
    );
    let accepted = plan.condition(status::ENDPOINT_ACCEPTED);
    match reason {
        Some(r) => {
            let c = accepted.unwrap();
            assert_eq!((c.status, c.reason.as_str()), ("False", r.as_str()));
        }
        None => assert!(accepted.is_none()),
    }
}

#[test]
fn an_attached_services_status_is_the_endpoints() {
    let svc = member(json!({}));
    let mut view = steady_attached(&svc, ScalerMode::Poll);
    view.backend = with_status(&view.backend, 0, 0);
    scaled_object_ready(&mut view);
    let m = accepted(ScalerMode::Poll);
    let plan = planned_member(&svc, &view, Some(&m));
    let ready = cond(&plan, status::READY);
    assert_eq!(ready.reason, "GatewayNotReady");
    assert!(
        ready
            .message
            .contains("shared gateway of LLMEndpoint platform/shared (Deployment shared-gateway)"),
        "{ready:?}"
    );
    let c = cond(&plan, status::ENDPOINT_ACCEPTED);
    assert_eq!((c.status, c.reason.as_str()), ("True", "Accepted"));
    assert_eq!(
        plan.conds.last().map(|c| c.type_),
        Some(status::ENDPOINT_ACCEPTED)
    );
    // The endpoint's gateway ready: the service is (scaled to zero, ready to wake).
    let gw = Deployment {
        status: Some(DeploymentStatus {
            ready_replicas: Some(1),
            ..Default::default()
        }),
        ..Default::default()
    };
    view.endpoint_gateway = Some(Arc::new(gw));
    let plan = planned_member(&svc, &view, Some(&m));
    assert_eq!(
        (plan.phase, cond(&plan, status::READY).reason.as_str()),
        (LLMServicePhase::ScaledToZero, "ScaledToZero")
    );
    let st = plan.status(&svc, &Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    assert_eq!(
        st.endpoint_url.as_deref(),
        Some("http://shared.platform.svc/v1")
    );
}

/// A hub adapter's fetch Job is created once, left as it is while its adapter stays, and
/// deleted (it is the service's) when the adapter goes.
#[test]
fn hub_adapter_fetch_jobs_are_created_once_and_deleted_with_their_adapter() {
    let svc = service(json!({}));
    let mut rt = runtime();
    rt.spec.adapters = Some(serde_json::from_value(json!({})).unwrap());
    let adapter: hearth_crds::LLMAdapter = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": "sql", "namespace": "team-a"},
        "spec": {"serviceRef": {"name": "chat"}, "source": {"uri": "hf://acme/sql-lora"}},
    }))
    .unwrap();
    let job = crate::render::fetch_job_name("chat", &adapter).unwrap();
    let with = crate::render::ServiceAdapters {
        accepted: vec![adapter],
        fetches: BTreeMap::new(),
    };
    let planned_with = |view: &View, adapters: &crate::render::ServiceAdapters| {
        let d = desired(&svc, [&rt], &cfg(), view.backend.is_none(), None, adapters);
        writes(&plan(&svc, d, view, &cfg()))
    };
    let mut view = steady(&svc);
    let w = planned_with(&view, &with);
    assert!(w.contains(&format!("apply Job {job}")), "{w:?}");
    // Created: nothing more to write for it, whatever its template now.
    let children =
        crate::render::render_with_adapters(&svc, &rt, &cfg(), false, &Placement::Own, &with)
            .unwrap();
    let mut current = children.adapter_fetch_jobs[0].clone();
    current
        .metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(TEMPLATE_HASH_ANNOTATION.to_owned(), "older".to_owned());
    view.adapter_fetch_jobs = vec![Arc::new(current)];
    let w = planned_with(&view, &with);
    assert!(!w.iter().any(|w| w.contains(&job)), "{w:?}");
    // The adapter went: its Job goes.
    let w = planned_with(&view, &crate::render::ServiceAdapters::default());
    assert!(w.contains(&format!("delete Job {job}")), "{w:?}");
}

#[test]
fn a_field_the_controller_no_longer_sets_is_applied_again() {
    let svc = service(json!({}));
    let desired = render(&svc, &runtime(), &cfg(), false).unwrap().backend;
    // What the last apply set: a node selector key the runtime has since dropped.
    let mut before = desired.clone();
    let pod = before
        .spec
        .as_mut()
        .unwrap()
        .template
        .spec
        .as_mut()
        .unwrap();
    pod.node_selector
        .get_or_insert_with(Default::default)
        .insert("example.com/gone".to_owned(), "true".to_owned());
    let cached = crate::diff::stamped(before);
    assert!(
        crate::diff::contains(&cached, &desired),
        "containment alone sees nothing to apply"
    );
    let mut writes = Vec::new();
    super::apply_cached(&mut writes, desired.clone(), Some(&cached));
    assert_eq!(
        writes.iter().map(ToString::to_string).collect::<Vec<_>>(),
        ["apply Deployment chat"]
    );
    // Applied: the same desired again writes nothing.
    let mut writes = Vec::new();
    super::apply_cached(
        &mut writes,
        desired.clone(),
        Some(&crate::diff::stamped(desired)),
    );
    assert!(writes.is_empty());
}

use hearth_crds::{InferenceRuntime, LLMService};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{PodSpec, ResourceRequirements, SecurityContext},
    },
    apimachinery::pkg::{api::resource::Quantity, util::intstr::IntOrString},
};
use serde_json::json;

use super::*;

#[test]
fn gateway_resources_from_json_name_the_bad_field() {
    let r = parse_gateway_resources(
        r#"{"requests":{"cpu":"100m","memory":"128Mi"},"limits":{"memory":"1Gi"}}"#,
    )
    .unwrap();
    assert_eq!(r.limits.unwrap()["memory"], Quantity("1Gi".to_owned()));
    assert_eq!(
        parse_gateway_resources("{}").unwrap(),
        ResourceRequirements::default()
    );
    let e = parse_gateway_resources(r#"{"limits":{"memory":"512MB"}}"#).unwrap_err();
    assert!(
        e.starts_with("limits.memory: \"512MB\" is not a quantity"),
        "{e}"
    );
    let e = parse_gateway_resources(r#"{"limit":{"memory":"1Gi"}}"#).unwrap_err();
    assert!(e.contains("unknown field \"limit\""), "{e}");
    let e = parse_gateway_resources(r#"{"limits":"512Mi"}"#).unwrap_err();
    assert!(e.contains("not a ResourceRequirements"), "{e}");
    assert!(
        parse_gateway_resources("512Mi")
            .unwrap_err()
            .contains("not JSON")
    );
    assert!(parse_gateway_resources("[]").is_err());
    let e = parse_gateway_resources(r#"{"requests":{"memory":"1Gi"},"limits":{"memory":"512Mi"}}"#)
        .unwrap_err();
    assert!(
        e.starts_with("requests.memory (1Gi) is above limits.memory (512Mi)"),
        "{e}"
    );
    assert!(
        parse_gateway_resources(r#"{"requests":{"cpu":"1"},"limits":{"cpu":"1000m"}}"#).is_ok()
    );
    for (json, want) in [
        (
            r#"{"requests":{"memory":"-64Mi"}}"#,
            "requests.memory: \"-64Mi\" must not be negative",
        ),
        (
            r#"{"requests":{"foo":"1"}}"#,
            "requests.foo: the gateway takes cpu",
        ),
        (
            r#"{"limits":{"nvidia.com/gpu":"1"}}"#,
            "limits.nvidia.com/gpu: the gateway takes",
        ),
        (
            r#"{"limits":{"memory":"15Mi"}}"#,
            "limits.memory (15Mi) is below 16Mi",
        ),
        (
            r#"{"limits":{"memory":"1e99999999999999999999"}}"#,
            "is not a quantity",
        ),
    ] {
        let e = parse_gateway_resources(json).unwrap_err();
        assert!(e.contains(want), "{json}: {e}");
    }
    assert!(parse_gateway_resources(r#"{"limits":{"memory":"16Mi"}}"#).is_ok());
}

fn service_and_runtime(endpoint: serde_json::Value) -> (LLMService, InferenceRuntime) {
    let svc = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "u1"},
        "spec": {
            "model": {"source": {"uri": "hf://org/model"}},
            "runtime": {"name": "rt"},
            "cache": {"strategy": "None"},
            "endpoint": endpoint,
        }
    }))
    .unwrap();
    let rt = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": "rt"},
        "spec": {
            "vendor": "nvidia",
            "container": {"image": "example.com/vllm:1", "port": {"name": "http", "containerPort": 8000}},
            "accelerator": {"resourceName": "nvidia.com/gpu"},
        }
    }))
    .unwrap();
    (svc, rt)
}

fn pod(d: &Deployment) -> &PodSpec {
    d.spec.as_ref().unwrap().template.spec.as_ref().unwrap()
}

#[test]
fn api_keys_are_a_mounted_file_never_a_value() {
    let (svc, rt) = service_and_runtime(json!({
        "replicas": 3,
        "apiKeySecretRef": {"name": "keys"},
    }));
    let children = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    let gw = &children.gateway;
    assert_eq!(gw.spec.as_ref().unwrap().replicas, Some(3));
    let p = pod(gw);
    let vol = p
        .volumes
        .as_ref()
        .unwrap()
        .iter()
        .find(|v| v.name == "api-keys")
        .unwrap();
    let secret = vol.secret.as_ref().unwrap();
    assert_eq!(secret.secret_name.as_deref(), Some("keys"));
    assert_eq!(
        secret.items.as_ref().unwrap()[0].key,
        "api-keys",
        "the default key"
    );
    assert_eq!(secret.optional, Some(false));
    let c = &p.containers[0];
    let mount = &c.volume_mounts.as_ref().unwrap()[0];
    assert!(mount.sub_path.is_none(), "subPath mounts are never updated");
    assert!(
        c.args
            .as_ref()
            .unwrap()
            .contains(&format!("--api-key-file={API_KEY_DIR}/{API_KEY_FILE}"))
    );
    assert!(c.env.iter().flatten().all(|e| {
        e.value_from
            .as_ref()
            .is_none_or(|v| v.secret_key_ref.is_none())
    }));
    assert!(c.env_from.is_none());
    let sc = c.security_context.as_ref().unwrap();
    assert_eq!(sc.read_only_root_filesystem, Some(true));
    assert_eq!(
        p.security_context.as_ref().unwrap().run_as_non_root,
        Some(true)
    );
    assert_eq!(
        children.gateway_pdb.spec.as_ref().unwrap().max_unavailable,
        Some(IntOrString::Int(1))
    );
    // No key reference, no volume and no flag.
    let (svc, rt) = service_and_runtime(json!({}));
    let children = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    let p = pod(&children.gateway);
    assert!(p.volumes.is_none());
    assert!(
        !p.containers[0]
            .args
            .as_ref()
            .unwrap()
            .iter()
            .any(|a| a.starts_with("--api-key-file"))
    );
    assert_eq!(children.gateway.spec.as_ref().unwrap().replicas, Some(1));
}

#[test]
fn the_runtime_security_context_replaces_the_backend_default() {
    let (svc, mut rt) = service_and_runtime(json!({}));
    let cfg = RenderConfig::builtin().unwrap();
    // The security context of the rendered vllm container.
    let rendered = |rt: &InferenceRuntime| {
        let backend = render(&svc, rt, &cfg, true).unwrap().backend;
        let c = pod(&backend).containers.iter().find(|c| c.name == "vllm");
        c.unwrap().security_context.clone()
    };
    assert_eq!(rendered(&rt), Some(default_backend_security_context()));
    let hardened = SecurityContext {
        run_as_non_root: Some(true),
        read_only_root_filesystem: Some(true),
        ..default_backend_security_context()
    };
    rt.spec.container.security_context = Some(hardened.clone());
    assert_eq!(rendered(&rt), Some(hardened));
}

#[test]
fn the_default_gateway_resources_parse_back() {
    let json = serde_json::to_string(&default_gateway_resources()).unwrap();
    assert_eq!(
        parse_gateway_resources(&json).unwrap(),
        default_gateway_resources()
    );
}

/// Sets the scaler annotation to `push`.
fn annotate_push(svc: &mut LLMService) {
    svc.metadata.annotations = Some(
        [(
            hearth_crds::wellknown::SCALER_ANNOTATION.to_owned(),
            "push".to_owned(),
        )]
        .into(),
    );
}

/// The ScaledObject of the test service with `scaling` and, for push, the scaler annotation.
fn scaled_object_with(scaling: serde_json::Value, push: bool) -> serde_json::Value {
    let (mut svc, rt) = service_and_runtime(json!({}));
    svc.spec.scaling = serde_json::from_value(scaling).unwrap();
    if push {
        annotate_push(&mut svc);
    }
    let cfg = RenderConfig::builtin().unwrap();
    render(&svc, &rt, &cfg, true).unwrap().scaled_object.data
}

#[rstest::rstest]
#[case::none(json!({"min": 0, "max": 2}), false, json!([]))]
#[case::poll_one(
    json!({"min": 0, "max": 2, "warmWindows": [
        {"timezone": "Europe/Berlin", "start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI", "replicas": 1}
    ]}),
    false,
    json!([{"type": "cron", "metadata": {"timezone": "Europe/Berlin", "start": "0 8 * * MON-FRI", "end": "0 18 * * MON-FRI", "desiredReplicas": "1"}}])
)]
#[case::push_two_in_order(
    json!({"min": 1, "max": 4, "warmWindows": [
        {"timezone": "UTC", "start": "0 9 * * *", "end": "0 17 * * *", "replicas": 4},
        {"timezone": "Asia/Shanghai", "start": "30 22 * * *", "end": "0 6 * * *", "replicas": 2}
    ]}),
    true,
    json!([
        {"type": "cron", "metadata": {"timezone": "UTC", "start": "0 9 * * *", "end": "0 17 * * *", "desiredReplicas": "4"}},
        {"type": "cron", "metadata": {"timezone": "Asia/Shanghai", "start": "30 22 * * *", "end": "0 6 * * *", "desiredReplicas": "2"}}
    ])
)]
fn warm_windows_are_cron_triggers_after_the_demand_trigger(
    #[case] scaling: serde_json::Value,
    #[case] push: bool,
    #[case] windows: serde_json::Value,
) {
    let so = scaled_object_with(scaling.clone(), push);
    let spec = &so["spec"];
    let triggers = spec["triggers"].as_array().unwrap();
    // The demand trigger first, whatever the windows (KEDA names metrics by trigger index).
    assert_eq!(
        triggers[0]["type"],
        if push { "external-push" } else { "metrics-api" }
    );
    assert_eq!(json!(triggers[1..]), windows);
    // A window sets no floor of its own: outside it the service may still go to zero.
    assert_eq!(spec["minReplicaCount"], scaling["min"]);
    assert_eq!(spec["maxReplicaCount"], scaling["max"]);
    assert!(spec.get("idleReplicaCount").is_none());
}

#[test]
fn warm_windows_leave_the_rest_of_the_scaled_object_unchanged() {
    let without = scaled_object_with(json!({"min": 0, "max": 2}), false);
    let mut with = scaled_object_with(
        json!({"min": 0, "max": 2, "warmWindows": [
            {"timezone": "UTC", "start": "0 8 * * *", "end": "0 18 * * *", "replicas": 2}
        ]}),
        false,
    );
    with["spec"]["triggers"].as_array_mut().unwrap().truncate(1);
    assert_eq!(with, without);
}

/// The test service with `scaling`, on the test runtime with vLLM's sleep mode (levels 1 and 2).
fn sleepy(scaling: serde_json::Value, push: bool) -> Children {
    let (mut svc, mut rt) = service_and_runtime(json!({}));
    svc.spec.scaling = serde_json::from_value(scaling).unwrap();
    if push {
        annotate_push(&mut svc);
    }
    rt.spec.sleep_mode = Some(
        serde_json::from_value(json!({
            "args": ["--enable-sleep-mode"],
            "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}],
            "levels": [
                {"level": 1},
                {"level": 2, "wakeUp": [
                    {"path": "/wake_up?tags=weights"},
                    {"path": "/collective_rpc", "body": "{\"method\":\"reload_weights\"}"},
                    {"path": "/wake_up?tags=kv_cache"}
                ]}
            ]
        }))
        .unwrap(),
    );
    render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap()
}

fn container_args(d: &Deployment) -> Vec<String> {
    pod(d).containers[0].args.clone().unwrap_or_default()
}

#[rstest::rstest]
#[case::poll(false)]
#[case::push(true)]
fn sleep_turns_on_the_engines_sleep_mode_and_the_gateways_tier(#[case] push: bool) {
    let c = sleepy(json!({"min": 0, "max": 2, "sleep": {"after": "2m"}}), push);
    let backend = &pod(&c.backend).containers[0];
    assert!(container_args(&c.backend).contains(&"--enable-sleep-mode".to_owned()));
    let env = backend.env.clone().unwrap_or_default();
    assert!(
        env.iter()
            .any(|e| e.name == "VLLM_SERVER_DEV_MODE" && e.value.as_deref() == Some("1"))
    );
    let args = container_args(&c.gateway);
    for want in [
        "--sleep-after=2m",
        "--sleep-level=1",
        "--sleep-path=/sleep",
        "--is-sleeping-path=/is_sleeping",
        "--wake-up-call=/wake_up",
        "--peer-service=chat",
        "--peer-port-name=http",
    ] {
        assert!(args.contains(&want.to_owned()), "{want} not in {args:?}");
    }
    // Poll mode: with peers each replica must serve KEDA its own demand, which KEDA sums.
    let url = &c.scaled_object.data["spec"]["triggers"][0]["metadata"]["url"];
    if !push {
        assert_eq!(url, "http://chat.team-a.svc:8080/hearth/queue?scope=local");
    }
}

#[test]
fn sleep_level_two_wakes_with_the_runtimes_calls_in_order() {
    let c = sleepy(
        json!({"min": 1, "max": 2, "sleep": {"after": "10m", "level": 2}}),
        true,
    );
    let calls: Vec<String> = container_args(&c.gateway)
        .into_iter()
        .filter(|a| a.starts_with("--wake-up-call="))
        .collect();
    assert_eq!(
        calls,
        [
            "--wake-up-call=/wake_up?tags=weights",
            "--wake-up-call=/collective_rpc {\"method\":\"reload_weights\"}",
            "--wake-up-call=/wake_up?tags=kv_cache",
        ]
    );
    assert!(container_args(&c.gateway).contains(&"--sleep-level=2".to_owned()));
}

#[test]
fn sleep_without_effect_renders_as_without_sleep() {
    let plain = sleepy(json!({"min": 0, "max": 2}), false);
    // Scales to zero (5m) before it would sleep (10m): a warning, and nothing rendered.
    let late = sleepy(
        json!({"min": 0, "max": 2, "sleep": {"after": "10m"}}),
        false,
    );
    assert_eq!(late.gateway, plain.gateway);
    assert_eq!(late.backend, plain.backend);
    assert_eq!(late.scaled_object.data, plain.scaled_object.data);
    assert!(!container_args(&plain.backend).contains(&"--enable-sleep-mode".to_owned()));
    // A runtime without sleep mode: the same.
    let (mut svc, rt) = service_and_runtime(json!({}));
    svc.spec.scaling = serde_json::from_value(json!({"min": 0, "max": 2})).unwrap();
    let without = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    svc.spec.scaling =
        serde_json::from_value(json!({"min": 0, "max": 2, "sleep": {"after": "1m"}})).unwrap();
    let with = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    assert_eq!(with.gateway, without.gateway);
    assert_eq!(with.backend, without.backend);
}

/// An `oci://` model: an image volume mounted read-only at `/models`, which is `.Model.Path`;
/// no cache claim and no prewarm Job, whatever `cache` says.
#[test]
fn an_oci_model_is_an_image_volume_mounted_read_only() {
    let (mut svc, rt) = service_and_runtime(json!({}));
    svc.spec.model.source.as_mut().unwrap().uri =
        "oci://registry.example.com/models/qwen2.5-7b:v1".to_owned();
    svc.spec.cache =
        serde_json::from_value(json!({"strategy": "NodeLocalPVC", "prewarm": true})).unwrap();
    let c = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    assert!(c.cache_claim.is_none() && c.prewarm_job.is_none());
    let spec = pod(&c.backend);
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "model")
        .unwrap();
    let image = volume.image.as_ref().unwrap();
    assert_eq!(
        (image.reference.as_deref(), image.pull_policy.as_deref()),
        (
            Some("registry.example.com/models/qwen2.5-7b:v1"),
            Some("IfNotPresent")
        )
    );
    let engine = &spec.containers[0];
    let mount = engine
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "model")
        .unwrap();
    assert_eq!(
        (mount.mount_path.as_str(), mount.read_only),
        ("/models", Some(true))
    );
    assert!(
        !engine
            .env
            .iter()
            .flatten()
            .any(|e| e.name == "HF_HOME" || e.name == "HF_HUB_OFFLINE"),
        "no hub cache environment for an image: {:?}",
        engine.env
    );
}

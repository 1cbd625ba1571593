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

pub(super) fn service_and_runtime(endpoint: serde_json::Value) -> (LLMService, InferenceRuntime) {
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
fn tenants_are_flags_and_their_keys_one_projected_volume() {
    let (svc, rt) = service_and_runtime(json!({
        "containerConcurrency": 16,
        "tenants": [
            {"name": "team-a", "apiKeySecretRef": {"name": "a-keys"}, "priority": 10, "requestsPerMinute": 600},
            {"name": "team-b", "apiKeySecretRef": {"name": "b-keys", "key": "k"}, "tokensPerMinute": 90000},
            {"name": "default", "priority": -5},
        ],
    }));
    let children = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    let p = pod(children.gateway.as_ref().unwrap());
    let args = p.containers[0].args.as_ref().unwrap();
    for flag in [
        "--tenant=name=team-a,key-file=/etc/hearth/tenants/team-a,priority=10,requests-per-minute=600",
        "--tenant=name=team-b,key-file=/etc/hearth/tenants/team-b,tokens-per-minute=90000",
        "--tenant=name=default,priority=-5",
        "--container-concurrency=16",
    ] {
        assert!(args.iter().any(|a| a == flag), "{flag} in {args:?}");
    }
    let vol = p
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "tenant-keys")
        .unwrap();
    let sources = vol.projected.as_ref().unwrap().sources.as_ref().unwrap();
    let files: Vec<_> = sources
        .iter()
        .map(|s| {
            let secret = s.secret.as_ref().unwrap();
            let item = &secret.items.as_ref().unwrap()[0];
            assert_eq!(secret.optional, Some(false));
            (secret.name.as_str(), item.key.as_str(), item.path.as_str())
        })
        .collect();
    assert_eq!(
        files,
        [("a-keys", "api-keys", "team-a"), ("b-keys", "k", "team-b")]
    );
    let mount = p.containers[0]
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == "tenant-keys")
        .unwrap();
    assert_eq!(mount.mount_path, "/etc/hearth/tenants");
    assert!(mount.sub_path.is_none(), "subPath mounts are never updated");
}

#[test]
fn api_keys_are_a_mounted_file_never_a_value() {
    let (svc, rt) = service_and_runtime(json!({
        "replicas": 3,
        "apiKeySecretRef": {"name": "keys"},
    }));
    let children = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    let gw = children.gateway.as_ref().unwrap();
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
        children
            .gateway_pdb
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .max_unavailable,
        Some(IntOrString::Int(1))
    );
    // No key reference, no API key volume and no flag: the admin tokens' Secret only.
    let (svc, rt) = service_and_runtime(json!({}));
    let children = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    let p = pod(children.gateway.as_ref().unwrap());
    let volumes: Vec<_> = p
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    assert_eq!(volumes, ["admin-auth"]);
    assert!(
        !p.containers[0]
            .args
            .as_ref()
            .unwrap()
            .iter()
            .any(|a| a.starts_with("--api-key-file"))
    );
    assert_eq!(
        children
            .gateway
            .as_ref()
            .unwrap()
            .spec
            .as_ref()
            .unwrap()
            .replicas,
        Some(1)
    );
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

/// A report-only ServingPolicy (`mutationActions` without `Patch`) changes nothing on the
/// backend but its report annotation; with `Patch` the same policy changes the pod template.
#[test]
fn report_only_policies_leave_the_backend_and_say_what_they_would_change() {
    let (svc, rt) = service_and_runtime(json!({}));
    let with_policy = |actions: serde_json::Value| {
        let mut policies = crate::policy::builtin_policies().unwrap();
        policies.push(
            serde_json::from_value(json!({
                "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
                "metadata": {"name": "team-label"},
                "spec": {"mutationActions": actions, "mutations": [{
                    "patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "Object{spec: Object.spec{template: Object.spec.template{metadata: Object.spec.template.metadata{labels: {'example.com/team': 'ml'}}}}}"}}]}
            }))
            .unwrap(),
        );
        RenderConfig {
            engine: crate::policy::Engine::new(&policies).unwrap(),
            ..RenderConfig::builtin().unwrap()
        }
    };
    let plain = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true)
        .unwrap()
        .backend;
    let reported = render(&svc, &rt, &with_policy(json!(["Warn"])), true)
        .unwrap()
        .backend;
    assert_eq!(
        reported.spec, plain.spec,
        "a report-only policy changed the backend"
    );
    assert!(crate::policy::reports_of(&plain).is_empty());
    assert_eq!(
        crate::policy::reports_of(&reported),
        [
            "ServingPolicy 'team-label' would change the object (report-only, not applied): add /spec/template/metadata/labels/example.com~1team"
        ]
    );
    let applied = render(&svc, &rt, &with_policy(json!(["Patch", "Audit"])), true)
        .unwrap()
        .backend;
    let labels = applied
        .spec
        .as_ref()
        .unwrap()
        .template
        .metadata
        .as_ref()
        .unwrap()
        .labels
        .as_ref()
        .unwrap();
    assert_eq!(
        labels.get("example.com/team").map(String::as_str),
        Some("ml")
    );
    assert_eq!(
        crate::policy::reports_of(&applied),
        [
            "ServingPolicy 'team-label' changed the object: add /spec/template/metadata/labels/example.com~1team"
        ]
    );
}

/// No service account token where nothing calls the apiserver: the backend's pods and the
/// prewarm Job's. The gateway watches its ConfigMaps and writes Events, so it keeps one.
#[test]
fn only_pods_that_call_the_apiserver_get_a_service_account_token() {
    let (mut svc, rt) = service_and_runtime(json!({}));
    svc.spec.cache =
        serde_json::from_value(json!({"strategy": "SharedPVC", "prewarm": true})).unwrap();
    let c = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    assert_eq!(pod(&c.backend).automount_service_account_token, Some(false));
    let job = c.prewarm_job.expect("a prewarm Job");
    let job_pod = job.spec.unwrap().template.spec.unwrap();
    assert_eq!(job_pod.automount_service_account_token, Some(false));
    let gateway = c.gateway.expect("the service's own gateway");
    assert_ne!(pod(&gateway).automount_service_account_token, Some(false));
}

/// Model sources: the runtime's download settings and the cluster's reach the prewarm Job as
/// well as the engine, the cluster's CA bundle is mounted in both, and the Job's template hash
/// does not change with them (a finished Job is not `ReplaceRequired` for a new mirror).
#[test]
fn model_sources_reach_the_prewarm_job_and_the_engine() {
    let (mut svc, mut rt) = service_and_runtime(json!({}));
    svc.spec.cache =
        serde_json::from_value(json!({"strategy": "SharedPVC", "prewarm": true})).unwrap();
    svc.spec.model.source.as_mut().unwrap().secret_ref =
        Some(serde_json::from_value(json!({"name": "hub-token"})).unwrap());
    let plain = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    rt.spec.container.env = serde_json::from_value(json!([
        {"name": "HF_ENDPOINT", "value": "http://mirror.{{ .Service.Namespace }}.svc"},
        {"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
    ]))
    .unwrap();
    let cfg = RenderConfig {
        model_sources: crate::render::ModelSources::parse(
            r#"{"env": [{"name": "HF_ENDPOINT", "value": "http://cluster-mirror"}, {"name": "HTTPS_PROXY", "value": "http://proxy:3128"}], "caBundle": {"configMap": "corp-ca", "key": "bundle.pem"}}"#,
        )
        .unwrap(),
        ..RenderConfig::builtin().unwrap()
    };
    let c = render(&svc, &rt, &cfg, true).unwrap();
    let env_of = |p: &k8s_openapi::api::core::v1::PodSpec| -> Vec<(String, String)> {
        p.containers[0]
            .env
            .iter()
            .flatten()
            .map(|e| (e.name.clone(), e.value.clone().unwrap_or_default()))
            .collect()
    };
    let job = c.prewarm_job.as_ref().expect("a prewarm Job");
    let job_pod = job.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let job_env = env_of(job_pod);
    let ns = svc.metadata.namespace.clone().unwrap();
    for (name, value) in [
        ("HF_ENDPOINT", format!("http://mirror.{ns}.svc")),
        ("HTTPS_PROXY", "http://proxy:3128".to_owned()),
        (
            "SSL_CERT_FILE",
            "/etc/hearth/model-source-ca/ca.crt".to_owned(),
        ),
        (
            "REQUESTS_CA_BUNDLE",
            "/etc/hearth/model-source-ca/ca.crt".to_owned(),
        ),
    ] {
        let got: Vec<&String> = job_env
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| v)
            .collect();
        assert_eq!(got, [&value], "{name} on the Job: {job_env:?}");
    }
    assert!(
        !job_env.iter().any(|(n, _)| n == "VLLM_LOGGING_LEVEL"),
        "{job_env:?}"
    );
    // The service's Secret stays envFrom, on both.
    assert!(job_pod.containers[0].env_from.is_some());
    let ca = job_pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == "model-source-ca")
        .expect("the CA volume on the Job");
    let cm = ca.config_map.as_ref().unwrap();
    assert_eq!((cm.name.as_str(), cm.optional), ("corp-ca", Some(true)));
    assert_eq!(cm.items.as_ref().unwrap()[0].key, "bundle.pem");
    let hash = |j: &k8s_openapi::api::batch::v1::Job| {
        j.metadata.annotations.as_ref().unwrap()[crate::render::TEMPLATE_HASH_ANNOTATION].clone()
    };
    assert_eq!(hash(job), hash(plain.prewarm_job.as_ref().unwrap()));
    // The engine: the runtime's own HF_ENDPOINT, the cluster's proxy and CA, mounted.
    let backend = pod(&c.backend);
    let engine_env = env_of(backend);
    assert!(engine_env.contains(&("HF_ENDPOINT".to_owned(), format!("http://mirror.{ns}.svc"))));
    assert!(engine_env.contains(&("HTTPS_PROXY".to_owned(), "http://proxy:3128".to_owned())));
    assert!(engine_env.iter().any(|(n, _)| n == "SSL_CERT_FILE"));
    assert!(
        backend.containers[0]
            .volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/etc/hearth/model-source-ca" && m.read_only == Some(true))
    );
    // Without settings nothing changes.
    let plain_env = env_of(pod(&plain.backend));
    assert!(
        !plain_env
            .iter()
            .any(|(n, _)| n == "HTTPS_PROXY" || n == "SSL_CERT_FILE")
    );
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
    let args = container_args(c.gateway.as_ref().unwrap());
    for want in [
        "--sleep-after=2m",
        "--sleep-level=1",
        "--sleep-path=/sleep",
        "--is-sleeping-path=/is_sleeping",
        "--wake-up-call=/wake_up",
        "--peer-service=chat-gateway-admin",
        "--peer-port-name=admin",
    ] {
        assert!(args.contains(&want.to_owned()), "{want} not in {args:?}");
    }
    // Poll mode: with peers each replica must serve KEDA its own demand, which KEDA sums.
    let url = &c.scaled_object.data["spec"]["triggers"][0]["metadata"]["url"];
    if !push {
        assert_eq!(
            url,
            "http://chat-gateway-admin.team-a.svc:9091/hearth/queue/local"
        );
    }
}

#[test]
fn sleep_level_two_wakes_with_the_runtimes_calls_in_order() {
    let c = sleepy(
        json!({"min": 1, "max": 2, "sleep": {"after": "10m", "level": 2}}),
        true,
    );
    let calls: Vec<String> = container_args(c.gateway.as_ref().unwrap())
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
    assert!(container_args(c.gateway.as_ref().unwrap()).contains(&"--sleep-level=2".to_owned()));
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

// Shared endpoints: a service attached to an LLMEndpoint, and the endpoint's shared gateway.

fn vllm_sleep_mode() -> hearth_crds::inferenceruntime::RuntimeSleepMode {
    serde_json::from_value(json!({
        "args": ["--enable-sleep-mode"],
        "levels": [{"level": 1}, {"level": 2, "wakeUp": [
            {"path": "/wake_up?tags=weights"},
            {"path": "/collective_rpc", "body": "{\"method\":\"reload_weights\"}"}
        ]}]
    }))
    .unwrap()
}

fn shared(peers: bool) -> Placement {
    Placement::Shared(SharedGateway {
        endpoint: "shared".to_owned(),
        namespace: "platform".to_owned(),
        peers,
    })
}

/// The ScaledObject's demand trigger (`triggers[0]`).
fn demand_trigger(c: &Children) -> serde_json::Value {
    c.scaled_object.data["spec"]["triggers"][0].clone()
}

#[rstest::rstest]
#[case::poll(shared(false), false, false, json!({
    "type": "metrics-api", "metricType": "AverageValue",
    "metadata": {
        "url": "http://shared-gateway-admin.platform.svc:9091/hearth/queue/team-a/chat",
        "format": "json", "valueLocation": "pending", "targetValue": "10",
        "aggregateFromKubeServiceEndpoints": "true", "aggregationType": "sum",
        "authModes": "bearer",
    },
    "authenticationRef": {"name": "hearth-gateway-admin", "kind": "ClusterTriggerAuthentication"}
}))]
#[case::poll_with_peers(shared(true), false, false, json!({
    "type": "metrics-api", "metricType": "AverageValue",
    "metadata": {
        "url": "http://shared-gateway-admin.platform.svc:9091/hearth/queue/team-a/chat/local",
        "format": "json", "valueLocation": "pending", "targetValue": "10",
        "aggregateFromKubeServiceEndpoints": "true", "aggregationType": "sum",
        "authModes": "bearer",
    },
    "authenticationRef": {"name": "hearth-gateway-admin", "kind": "ClusterTriggerAuthentication"}
}))]
// As today: the sleeping tier's replicas are peers, so the poll asks for the local demand.
#[case::poll_sleeping(shared(false), false, true, json!({
    "type": "metrics-api", "metricType": "AverageValue",
    "metadata": {
        "url": "http://shared-gateway-admin.platform.svc:9091/hearth/queue/team-a/chat/local",
        "format": "json", "valueLocation": "pending", "targetValue": "10",
        "aggregateFromKubeServiceEndpoints": "true", "aggregationType": "sum",
        "authModes": "bearer",
    },
    "authenticationRef": {"name": "hearth-gateway-admin", "kind": "ClusterTriggerAuthentication"}
}))]
// The service's own scaler mode: one endpoint serves services of both.
#[case::push(shared(false), true, false, json!({
    "type": "external-push", "metricType": "AverageValue",
    "metadata": {
        "scalerAddress": "shared-scaler.platform.svc:9090",
        "targetSize": "10",
        "service": "team-a/chat",
    },
    // KEDA's one client certificate for the shared gateways, from KEDA's namespace.
    "authenticationRef": {"name": "hearth-scaler", "kind": "ClusterTriggerAuthentication"}
}))]
fn an_attached_service_asks_the_endpoints_gateway_for_its_demand(
    #[case] placement: Placement,
    #[case] push: bool,
    #[case] sleeping: bool,
    #[case] trigger: serde_json::Value,
) {
    let (mut svc, mut rt) = service_and_runtime(json!({}));
    if push {
        annotate_push(&mut svc);
    }
    if sleeping {
        rt.spec.sleep_mode = Some(vllm_sleep_mode());
        svc.spec.scaling =
            serde_json::from_value(json!({"min": 1, "max": 2, "sleep": {"after": "2m"}})).unwrap();
    }
    let cfg = RenderConfig::builtin().unwrap();
    let c = render_placed(&svc, &rt, &cfg, true, &placement).unwrap();
    assert_eq!(demand_trigger(&c), trigger);
    // The rest of the ScaledObject is the service's own.
    let own = render(&svc, &rt, &cfg, true).unwrap();
    let mut so = c.scaled_object.data.clone();
    so["spec"]["triggers"][0] = demand_trigger(&own);
    assert_eq!(so, own.scaled_object.data);
}

/// KEDA older than 2.19 cannot sum over the endpoints: the poll trigger asks one replica of
/// the headless admin Service for its peers' total (and before 2.18 reads only `authMode`);
/// push is the same on every KEDA.
#[test]
fn an_older_keda_polls_one_replica_for_the_total() {
    use crate::versions::{KedaVersion, Version};
    let (svc, rt) = service_and_runtime(json!({}));
    let old = RenderConfig {
        keda_version: KedaVersion::known(Some(Version::new(2, 17, 0))),
        ..RenderConfig::builtin().unwrap()
    };
    let c = render_placed(&svc, &rt, &old, true, &shared(true)).unwrap();
    assert_eq!(
        demand_trigger(&c)["metadata"],
        json!({
            "url": "http://shared-gateway-admin.platform.svc:9091/hearth/queue/team-a/chat",
            "format": "json", "valueLocation": "pending", "targetValue": "10",
            "authMode": "bearer",
        })
    );
    let between = RenderConfig {
        keda_version: KedaVersion::known(Some(Version::new(2, 18, 3))),
        ..RenderConfig::builtin().unwrap()
    };
    let c = render_placed(&svc, &rt, &between, true, &shared(true)).unwrap();
    assert_eq!(demand_trigger(&c)["metadata"]["authModes"], "bearer");
    assert!(
        demand_trigger(&c)["metadata"]
            .get("aggregateFromKubeServiceEndpoints")
            .is_none()
    );
    let current = RenderConfig {
        keda_version: KedaVersion::known(Some(Version::new(2, 20, 2))),
        ..RenderConfig::builtin().unwrap()
    };
    let c = render_placed(&svc, &rt, &current, true, &shared(true)).unwrap();
    assert_eq!(
        demand_trigger(&c)["metadata"]["aggregateFromKubeServiceEndpoints"],
        "true"
    );
    let mut push = svc.clone();
    annotate_push(&mut push);
    assert_eq!(
        demand_trigger(&render(&push, &rt, &old, true).unwrap()),
        demand_trigger(&render(&push, &rt, &current, true).unwrap())
    );
    // A service's own two gateway replicas in poll mode: peers when KEDA asks one of them.
    let mut two = svc.clone();
    two.spec.endpoint.replicas = Some(2);
    let peers = |cfg: &RenderConfig| {
        container_args(
            render(&two, &rt, cfg, true)
                .unwrap()
                .gateway
                .as_ref()
                .unwrap(),
        )
        .iter()
        .any(|a| a.starts_with("--peer-service"))
    };
    assert!(peers(&old) && !peers(&current));
}

#[test]
fn an_attached_service_renders_member_rbac_and_no_gateway_of_its_own() {
    let (mut svc, mut rt) = service_and_runtime(json!({}));
    let cfg = RenderConfig::builtin().unwrap();
    annotate_push(&mut svc);
    let placement = shared(true);
    let c = render_placed(&svc, &rt, &cfg, true, &placement).unwrap();
    assert!(c.gateway_service_account.is_none());
    assert!(c.gateway.is_none() && c.gateway_pdb.is_none());
    assert!(c.gateway_service.is_none() && c.scaler_service.is_none());
    let kinds: Vec<String> = c
        .to_values()
        .unwrap()
        .iter()
        .map(|v| {
            format!(
                "{} {}",
                v["kind"].as_str().unwrap(),
                v["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    assert_eq!(
        kinds,
        [
            "Role chat-gateway",
            "RoleBinding chat-gateway",
            "Service chat-backend",
            "Deployment chat",
            "ScaledObject chat"
        ]
    );
    // The member Role is what the service's own gateway gets, bound to the endpoint's account.
    let own = render(&svc, &rt, &cfg, true).unwrap();
    assert_eq!(c.gateway_role, own.gateway_role);
    assert_eq!(c.backend, own.backend);
    let rb = serde_json::to_value(&c.gateway_role_binding).unwrap();
    assert_eq!(rb["metadata"]["namespace"], "team-a");
    assert_eq!(
        rb["roleRef"],
        json!({"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "chat-gateway"})
    );
    assert_eq!(
        rb["subjects"],
        json!([{"kind": "ServiceAccount", "name": "shared-gateway", "namespace": "platform"}])
    );
    let rules = serde_json::to_value(&c.gateway_role.rules).unwrap();
    assert_eq!(
        rules,
        json!([
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["serving.hearth.dev"], "resources": ["llmservices"], "resourceNames": ["chat"], "verbs": ["list", "watch"]},
        ])
    );
    // With a sleeping tier: the Events and the status.lastWake patch too.
    rt.spec.sleep_mode = Some(vllm_sleep_mode());
    svc.spec.scaling =
        serde_json::from_value(json!({"min": 1, "max": 2, "sleep": {"after": "2m"}})).unwrap();
    let c = render_placed(&svc, &rt, &cfg, true, &placement).unwrap();
    let rules = serde_json::to_value(&c.gateway_role.rules).unwrap();
    assert_eq!(
        rules,
        json!([
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["serving.hearth.dev"], "resources": ["llmservices"], "resourceNames": ["chat"], "verbs": ["list", "watch"]},
            {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["create", "patch"]},
            {"apiGroups": ["serving.hearth.dev"], "resources": ["llmservices/status"], "resourceNames": ["chat"], "verbs": ["patch"]},
        ])
    );
}

pub(super) fn llm_endpoint(
    metadata: serde_json::Value,
    spec: serde_json::Value,
) -> hearth_crds::LLMEndpoint {
    let mut meta = json!({"name": "shared", "namespace": "platform", "uid": "ep-uid"});
    hearth_test_support::merge_json(&mut meta, metadata);
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": meta,
        "spec": spec,
    }))
    .unwrap()
}

/// A route of the test service with `patch` on it, on the test runtime with sleep mode.
fn route_of(patch: serde_json::Value) -> hearth_crds::llmendpoint::ModelRoute {
    let (svc, mut rt) = service_and_runtime(json!({}));
    let mut v = serde_json::to_value(&svc).unwrap();
    hearth_test_support::merge_json(&mut v, patch);
    let svc: LLMService = serde_json::from_value(v).unwrap();
    rt.spec.sleep_mode = Some(vllm_sleep_mode());
    model_route(&svc, &rt, &Default::default()).unwrap()
}

#[test]
fn a_routes_table_entry_holds_what_the_services_own_gateway_takes_as_flags() {
    let route = route_of(json!({
        "spec": {
            "scaling": {"min": 1, "max": 3, "target": 4, "activationTimeout": "90s",
                        "sleep": {"after": "3m", "level": 2}},
            "endpoint": {"coldStart": {"mode": "reject", "heartbeatInterval": "5s"}},
        },
        "status": {"lastActivation": {
            "startTime": "2025-01-01T00:00:00Z", "readyTime": "2025-01-01T00:00:42Z",
            "pod": "chat-0", "podUID": "p",
            "phases": {"scheduled": "1s", "containersStarted": "1s", "modelReady": "40s", "total": "42s"},
        }},
    }));
    assert_eq!(
        serde_json::to_value(&route).unwrap(),
        json!({
            "model": "chat",
            "namespace": "team-a",
            "service": "chat",
            "uid": "u1",
            "backendService": "chat-backend",
            "backendPortName": "http",
            "maxQueue": 120,
            "coldStart": "reject",
            "heartbeatInterval": "5s",
            "activationTimeout": "90s",
            "metricTarget": 4.0,
            "lastActivation": "42s",
            "sleep": {
                "after": "3m", "level": 2, "sleepPath": "/sleep", "isSleepingPath": "/is_sleeping",
                "wakeUp": [
                    {"path": "/wake_up?tags=weights"},
                    {"path": "/collective_rpc", "body": "{\"method\":\"reload_weights\"}"}
                ]
            },
        })
    );
    assert_eq!(route.key(), "team-a/chat");
    // The same service with its own gateway: the same values as flags.
    let (mut svc, mut rt) =
        service_and_runtime(json!({"coldStart": {"mode": "reject", "heartbeatInterval": "5s"}}));
    svc.spec.scaling = serde_json::from_value(
        json!({"min": 1, "max": 3, "target": 4, "activationTimeout": "90s",
        "sleep": {"after": "3m", "level": 2}}),
    )
    .unwrap();
    rt.spec.sleep_mode = Some(vllm_sleep_mode());
    let own = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    let args = container_args(own.gateway.as_ref().unwrap());
    for flag in [
        "--backend-service=chat-backend",
        "--backend-port-name=http",
        "--served-model-name=chat",
        "--max-queue=120",
        "--cold-start=reject",
        "--heartbeat-interval=5s",
        "--activation-timeout=90s",
        "--metric-target=4",
        "--sleep-after=3m",
        "--sleep-level=2",
        "--sleep-path=/sleep",
        "--is-sleeping-path=/is_sleeping",
        "--wake-up-call=/wake_up?tags=weights",
        "--wake-up-call=/collective_rpc {\"method\":\"reload_weights\"}",
        "--llmservice=chat",
        "--llmservice-uid=u1",
    ] {
        assert!(args.contains(&flag.to_owned()), "{flag} not in {args:?}");
    }
    assert!(
        !args.iter().any(|a| a.starts_with("--model-alias")),
        "{args:?}"
    );
    // Aliases: one flag, and the route's list; the service's own name is left out.
    let aliases =
        json!({"spec": {"model": {"aliases": ["Qwen/Qwen2.5-0.5B-Instruct", "chat", "qwen"]}}});
    assert_eq!(
        route_of(aliases.clone()).aliases,
        ["Qwen/Qwen2.5-0.5B-Instruct", "qwen"]
    );
    let mut v = serde_json::to_value(&svc).unwrap();
    hearth_test_support::merge_json(&mut v, aliases);
    let svc: LLMService = serde_json::from_value(v).unwrap();
    let own = render(&svc, &rt, &RenderConfig::builtin().unwrap(), true).unwrap();
    let args = container_args(own.gateway.as_ref().unwrap());
    assert!(
        args.contains(&"--model-alias=Qwen/Qwen2.5-0.5B-Instruct,qwen".to_owned()),
        "{args:?}"
    );
    // Without a sleeping tier or an activation yet: neither in the route.
    let plain = route_of(json!({}));
    assert_eq!((plain.sleep, plain.last_activation), (None, None));
    assert_eq!(plain.max_queue, 100);
}

#[rstest::rstest]
#[case::one_replica(json!({}), json!({}), false, &[
    "--listen=[::]:8080",
    "--routes-configmap=shared-routes",
    "--drain-timeout=2m",
    "--scaler-listen=[::]:9090",
    "--admin-listen=[::]:9091",
    "--admin-auth-dir=/etc/hearth/admin",
    "--scaler-tls-dir=/etc/hearth/scaler-tls",
    "--scaler-client-name=keda.llmendpoints.serving.hearth.dev",
][..], false)]
// A service in push mode attached: the scaler Service, and the same pod template.
#[case::a_push_service_attached(json!({}), json!({}), true, &[
    "--listen=[::]:8080",
    "--routes-configmap=shared-routes",
    "--drain-timeout=2m",
    "--scaler-listen=[::]:9090",
    "--admin-listen=[::]:9091",
    "--admin-auth-dir=/etc/hearth/admin",
    "--scaler-tls-dir=/etc/hearth/scaler-tls",
    "--scaler-client-name=keda.llmendpoints.serving.hearth.dev",
][..], true)]
#[case::replicas_are_peers(json!({}), json!({"replicas": 2}), false, &[
    "--listen=[::]:8080",
    "--routes-configmap=shared-routes",
    "--drain-timeout=2m",
    "--scaler-listen=[::]:9090",
    "--admin-listen=[::]:9091",
    "--peer-service=shared-gateway-admin",
    "--admin-auth-dir=/etc/hearth/admin",
    "--scaler-tls-dir=/etc/hearth/scaler-tls",
    "--scaler-client-name=keda.llmendpoints.serving.hearth.dev",
    "--peer-port-name=admin",
][..], false)]
#[case::push_with_api_keys(json!({"annotations": {"serving.hearth.dev/scaler": "push"}}), json!({"replicas": 3, "apiKeySecretRef": {"name": "keys"}}), false, &[
    "--listen=[::]:8080",
    "--routes-configmap=shared-routes",
    "--drain-timeout=2m",
    "--scaler-listen=[::]:9090",
    "--admin-listen=[::]:9091",
    "--peer-service=shared-gateway-admin",
    "--admin-auth-dir=/etc/hearth/admin",
    "--scaler-tls-dir=/etc/hearth/scaler-tls",
    "--scaler-client-name=keda.llmendpoints.serving.hearth.dev",
    "--peer-port-name=admin",
    "--api-key-file=/etc/hearth/api-keys/keys",
][..], true)]
fn the_shared_gateway_takes_its_routes_from_the_config_map(
    #[case] metadata: serde_json::Value,
    #[case] spec: serde_json::Value,
    #[case] push_services: bool,
    #[case] args: &[&str],
    #[case] push: bool,
) {
    let ep = llm_endpoint(metadata, spec.clone());
    let mut cfg = RenderConfig::builtin().unwrap();
    cfg.gateway_resources = parse_gateway_resources(r#"{"requests":{"cpu":"10m"}}"#).unwrap();
    let table = hearth_crds::llmendpoint::RouteTable {
        models: vec![route_of(json!({}))],
    };
    let c = render_endpoint(&ep, &table, push_services, &cfg).unwrap();
    let names: Vec<String> = c
        .to_values()
        .unwrap()
        .iter()
        .map(|v| {
            format!(
                "{} {}",
                v["kind"].as_str().unwrap(),
                v["metadata"]["name"].as_str().unwrap()
            )
        })
        .collect();
    let mut want = vec![
        "ServiceAccount shared-gateway",
        "Role shared-gateway",
        "RoleBinding shared-gateway",
        "ConfigMap shared-routes",
        "Service shared",
        "Service shared-gateway-admin",
    ];
    if push {
        want.push("Service shared-scaler");
    }
    want.extend([
        "Deployment shared-gateway",
        "PodDisruptionBudget shared-gateway",
    ]);
    assert_eq!(names, want);
    // Every object in the endpoint's namespace, controlled by it, labelled with it.
    for v in c.to_values().unwrap() {
        assert_eq!(v["metadata"]["namespace"], "platform", "{v}");
        assert_eq!(
            v["metadata"]["ownerReferences"],
            json!([{"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMEndpoint", "name": "shared", "uid": "ep-uid", "controller": true}]),
            "{v}"
        );
        assert_eq!(
            v["metadata"]["labels"]["serving.hearth.dev/llmendpoint"],
            "shared"
        );
        assert_eq!(
            v["metadata"]["labels"]["serving.hearth.dev/gateway"],
            "shared"
        );
    }
    let d = &c.gateway;
    assert_eq!(container_args(d), args);
    let replicas = spec["replicas"].as_i64().map(|r| r as i32).unwrap_or(1);
    assert_eq!(d.spec.as_ref().unwrap().replicas, Some(replicas));
    let p = pod(d);
    assert_eq!(p.service_account_name.as_deref(), Some("shared-gateway"));
    assert_eq!(p.termination_grace_period_seconds, Some(130));
    assert_eq!(
        p.security_context.as_ref().unwrap().run_as_non_root,
        Some(true)
    );
    let container = &p.containers[0];
    assert_eq!(container.resources.as_ref(), Some(&cfg.gateway_resources));
    let sc = container.security_context.as_ref().unwrap();
    assert_eq!(
        (sc.read_only_root_filesystem, sc.allow_privilege_escalation),
        (Some(true), Some(false))
    );
    let ports: Vec<_> = container
        .ports
        .iter()
        .flatten()
        .map(|p| p.name.clone().unwrap())
        .collect();
    assert_eq!(ports, ["http", "grpc-scaler", "admin"]);
    // The ExternalScaler's serving certificate, the endpoint's Secret; without the shared
    // ClusterTriggerAuthentication, plain gRPC and no Secret.
    let scaler_secret = |p: &k8s_openapi::api::core::v1::PodSpec| {
        p.volumes
            .iter()
            .flatten()
            .find(|v| v.name == "scaler-tls")
            .and_then(|v| v.secret.as_ref()?.secret_name.clone())
    };
    assert_eq!(scaler_secret(p).as_deref(), Some("shared-scaler-tls"));
    let plain_cfg = RenderConfig {
        shared_scaler_auth: None,
        ..cfg.clone()
    };
    let plain = render_endpoint(&ep, &table, push_services, &plain_cfg).unwrap();
    assert_eq!(scaler_secret(pod(&plain.gateway)), None);
    assert!(
        !container_args(&plain.gateway)
            .iter()
            .any(|a| a.starts_with("--scaler-tls-dir") || a.starts_with("--scaler-client-name")),
        "{:?}",
        container_args(&plain.gateway)
    );
    assert_eq!(
        p.volumes.iter().flatten().any(|v| v.name == "api-keys"),
        spec.get("apiKeySecretRef").is_some(),
        "the API key Secret is the endpoint's"
    );
    let service = serde_json::to_value(&c.gateway_service).unwrap();
    assert_eq!(
        service["spec"]["ports"],
        json!([{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}])
    );
    // The admin port is not the client Service's: a headless Service of its own.
    let admin = serde_json::to_value(&c.admin_service).unwrap();
    assert_eq!(admin["metadata"]["name"], "shared-gateway-admin");
    assert_eq!(admin["spec"]["clusterIP"], "None");
    assert_eq!(
        admin["spec"]["ports"],
        json!([{"name": "admin", "port": 9091, "targetPort": "admin", "protocol": "TCP"}])
    );
    assert_eq!(
        service["spec"]["selector"],
        json!({"app.kubernetes.io/name": "shared-gateway", "app.kubernetes.io/managed-by": "hearth", "serving.hearth.dev/gateway": "shared"})
    );
    assert_eq!(
        serde_json::to_value(&c.gateway_pdb.spec).unwrap()["maxUnavailable"],
        1
    );
    assert_eq!(
        serde_json::to_value(&c.role.rules).unwrap(),
        json!([
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]},
        ])
    );
    assert_eq!(
        serde_json::to_value(&c.role_binding.subjects).unwrap(),
        json!([{"kind": "ServiceAccount", "name": "shared-gateway", "namespace": "platform"}])
    );
    // The routing table, as JSON under routes.json.
    let data = c.routes.data.as_ref().unwrap();
    assert_eq!(data.len(), 1);
    let back: hearth_crds::llmendpoint::RouteTable =
        serde_json::from_str(&data[hearth_crds::llmendpoint::ROUTES_KEY]).unwrap();
    assert_eq!(back, table);
}

#[test]
fn a_service_joining_never_rolls_the_shared_gateway() {
    let ep = llm_endpoint(json!({}), json!({"replicas": 2}));
    let cfg = RenderConfig::builtin().unwrap();
    let empty = render_endpoint(&ep, &Default::default(), false, &cfg).unwrap();
    let table = hearth_crds::llmendpoint::RouteTable {
        models: vec![route_of(
            json!({"spec": {"scaling": {"drainTimeout": "10m"}}}),
        )],
    };
    let one = render_endpoint(&ep, &table, true, &cfg).unwrap();
    assert_eq!(one.gateway, empty.gateway);
    assert!(one.scaler_service.is_some() && empty.scaler_service.is_none());
    assert_ne!(one.routes, empty.routes);
}

#[test]
fn an_endpoint_breaking_the_rules_renders_nothing() {
    let ep = llm_endpoint(
        json!({}),
        json!({"allowedServices": {"namespaces": {"from": "Selector"}}}),
    );
    let e = render_endpoint(
        &ep,
        &Default::default(),
        false,
        &RenderConfig::builtin().unwrap(),
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("spec.allowedServices.namespaces.selector: is required"),
        "{e}"
    );
}

// Plain Deployments joined to an endpoint.

/// A Deployment `team-a/chat` joining `platform/shared` with model `Qwen/Qwen2.5-7B-Instruct`
/// and the extra `annotations`.
fn joined_deployment(annotations: serde_json::Value) -> Deployment {
    let mut a = json!({
        "serving.hearth.dev/endpoint": "platform/shared",
        "serving.hearth.dev/model": "Qwen/Qwen2.5-7B-Instruct",
    });
    hearth_test_support::merge_json(&mut a, annotations);
    serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "dep-uid", "annotations": a},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "qwen", "tier": "gpu"}},
            "template": {
                "metadata": {"labels": {"app": "qwen", "tier": "gpu"}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.8.5",
                                         "ports": [{"name": "http", "containerPort": 8000}]}]},
            },
        },
    }))
    .unwrap()
}

/// What `d` renders on the shared gateway `placement` (a [`Placement::Shared`]).
fn member_children(d: &Deployment, placement: &Placement) -> MemberChildren {
    let Placement::Shared(shared) = placement else {
        panic!("a shared placement");
    };
    let member = hearth_crds::rules::check_deployment(d).member.unwrap();
    let (port, findings) = hearth_crds::rules::check_member_serving(d, &member, None);
    assert!(!findings.blocks_rendering(), "{findings}");
    render_member(
        d,
        &member,
        &port.unwrap(),
        shared,
        &RenderConfig::builtin().unwrap(),
    )
    .unwrap()
}

#[test]
fn a_joined_deployment_renders_its_service_member_rbac_and_scaled_object() {
    let d = joined_deployment(json!({}));
    let c = member_children(&d, &shared(false));
    // Controlled by the Deployment (no blockOwnerDeletion: that would need the right to update
    // the Deployment's finalizers).
    let owner = json!([{"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat",
                        "uid": "dep-uid", "controller": true}]);
    let labels = json!({
        "app.kubernetes.io/name": "chat", "app.kubernetes.io/instance": "chat",
        "app.kubernetes.io/managed-by": "hearth", "app.kubernetes.io/component": "member",
        "app.kubernetes.io/part-of": "hearth", "serving.hearth.dev/deployment": "chat",
    });
    let meta = json!({"name": "chat-hearth", "namespace": "team-a", "labels": labels,
                      "ownerReferences": owner});
    assert_eq!(
        serde_json::to_value(&c.service).unwrap(),
        json!({
            "apiVersion": "v1", "kind": "Service",
            "metadata": meta,
            "spec": {
                "type": "ClusterIP",
                "selector": {"app": "qwen", "tier": "gpu"},
                "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
            },
        })
    );
    // The member Role an attached service grants (no sleeping tier), bound to the endpoint's
    // gateway.
    assert_eq!(
        serde_json::to_value(&c.role).unwrap(),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": meta,
            "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                       "verbs": ["get", "list", "watch"]}],
        })
    );
    assert_eq!(
        serde_json::to_value(&c.role_binding).unwrap(),
        json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "chat-hearth"},
            "subjects": [{"kind": "ServiceAccount", "name": "shared-gateway", "namespace": "platform"}],
        })
    );
    let so = serde_json::to_value(&c.scaled_object).unwrap();
    assert_eq!(so["apiVersion"], "keda.sh/v1alpha1");
    assert_eq!(so["kind"], "ScaledObject");
    assert_eq!(so["metadata"], meta);
    assert_eq!(
        so["spec"],
        json!({
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "chat"},
            "minReplicaCount": 0,
            "maxReplicaCount": 1,
            "pollingInterval": 5,
            "cooldownPeriod": 300,
            "initialCooldownPeriod": 300,
            "advanced": {
                "horizontalPodAutoscalerConfig": {"behavior": {"scaleDown": {"stabilizationWindowSeconds": 300}}},
                "restoreToOriginalReplicaCount": true,
            },
            "triggers": [{
                "type": "metrics-api", "metricType": "AverageValue",
                "metadata": {
                    "url": "http://shared-gateway-admin.platform.svc:9091/hearth/queue/team-a/chat",
                    "format": "json", "valueLocation": "pending", "targetValue": "10",
                    "aggregateFromKubeServiceEndpoints": "true", "aggregationType": "sum",
                    "authModes": "bearer",
                },
                "authenticationRef": {"name": "hearth-gateway-admin", "kind": "ClusterTriggerAuthentication"},
            }],
        })
    );
    // The apply order: RBAC and Service before the ScaledObject that scales the Deployment.
    let kinds: Vec<String> = c
        .to_values()
        .unwrap()
        .iter()
        .map(|v| v["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, ["Role", "RoleBinding", "Service", "ScaledObject"]);
    // An unnamed container port: the Service port is named like the runtime's (or http), and
    // forwards to the number.
    let mut unnamed = d.clone();
    let pod = unnamed
        .spec
        .as_mut()
        .unwrap()
        .template
        .spec
        .as_mut()
        .unwrap();
    pod.containers[0].ports.as_mut().unwrap()[0].name = None;
    let c = member_children(&unnamed, &shared(false));
    assert_eq!(
        serde_json::to_value(&c.service.spec.unwrap().ports).unwrap(),
        json!([{"name": "http", "port": 80, "targetPort": 8000, "protocol": "TCP"}])
    );
}

#[rstest::rstest]
#[case::poll(shared(false), json!({}))]
#[case::poll_with_peers(shared(true), json!({}))]
#[case::push(shared(false), json!({"serving.hearth.dev/scaler": "push"}))]
#[case::push_with_peers(shared(true), json!({"serving.hearth.dev/scaler": "push"}))]
fn a_joined_deployment_asks_for_its_demand_as_an_attached_service_does(
    #[case] placement: Placement,
    #[case] annotations: serde_json::Value,
) {
    let d = joined_deployment(annotations.clone());
    let c = member_children(&d, &placement);
    // An LLMService `team-a/chat` attached to the same endpoint, in the same scaler mode.
    let (mut svc, rt) = service_and_runtime(json!({}));
    if !annotations.as_object().unwrap().is_empty() {
        annotate_push(&mut svc);
    }
    let attached = render_placed(
        &svc,
        &rt,
        &RenderConfig::builtin().unwrap(),
        true,
        &placement,
    )
    .unwrap();
    assert_eq!(
        c.scaled_object.data["spec"]["triggers"],
        json!([demand_trigger(&attached)])
    );
}

#[test]
fn a_joined_deployments_annotations_set_its_bounds_and_route() {
    let d = joined_deployment(json!({
        "serving.hearth.dev/min-replicas": "1",
        "serving.hearth.dev/max-replicas": "4",
        "serving.hearth.dev/target": "3",
        "serving.hearth.dev/activation-timeout": "10m",
        "serving.hearth.dev/cold-start": "reject",
    }));
    let c = member_children(&d, &shared(false));
    let spec = &c.scaled_object.data["spec"];
    assert_eq!(
        (
            &spec["minReplicaCount"],
            &spec["maxReplicaCount"],
            &spec["initialCooldownPeriod"]
        ),
        (&json!(1), &json!(4), &json!(600))
    );
    assert_eq!(spec["triggers"][0]["metadata"]["targetValue"], "3");
    let member = hearth_crds::rules::check_deployment(&d).member.unwrap();
    let (port, _) = hearth_crds::rules::check_member_serving(&d, &member, None);
    let route = member_route(&d, &member, &port.unwrap()).unwrap();
    assert_eq!(
        serde_json::to_value(&route).unwrap(),
        json!({
            "model": "Qwen/Qwen2.5-7B-Instruct",
            "namespace": "team-a",
            "service": "chat",
            "backendService": "chat-hearth",
            "backendPortName": "http",
            "maxQueue": 120,
            "coldStart": "reject",
            "heartbeatInterval": "10s",
            "activationTimeout": "10m",
            "metricTarget": 3.0,
        })
    );
    assert_eq!(route.key(), "team-a/chat");
    // The defaults are an LLMService's.
    let d = joined_deployment(json!({}));
    let member = hearth_crds::rules::check_deployment(&d).member.unwrap();
    let (port, _) = hearth_crds::rules::check_member_serving(&d, &member, None);
    let route = member_route(&d, &member, &port.unwrap()).unwrap();
    let (svc, rt) = service_and_runtime(json!({}));
    let svc_route = model_route(&svc, &rt, &Default::default()).unwrap();
    assert_eq!(
        (
            route.max_queue,
            route.cold_start,
            &route.heartbeat_interval,
            &route.activation_timeout,
            route.metric_target
        ),
        (
            svc_route.max_queue,
            svc_route.cold_start,
            &svc_route.heartbeat_interval,
            &svc_route.activation_timeout,
            svc_route.metric_target
        )
    );
}

/// A sleeping service with adapters: the gateway gets both its sleeping tier and its adapter
/// table (neither flag list replaces the other), the engine both sets of arguments.
#[test]
fn adapters_beside_the_sleeping_tier_keep_both_flags() {
    let (mut svc, mut rt) = service_and_runtime(json!({}));
    svc.spec.scaling =
        serde_json::from_value(json!({"min": 0, "max": 2, "sleep": {"after": "2m"}})).unwrap();
    rt.spec.sleep_mode = Some(vllm_sleep_mode());
    rt.spec.adapters =
        Some(serde_json::from_value(json!({"args": ["--enable-lora"], "maxLoaded": 2})).unwrap());
    let adapter: hearth_crds::LLMAdapter = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": "sql", "namespace": "team-a"},
        "spec": {"serviceRef": {"name": "chat"}, "source": {"uri": "pvc://lora/sql"}},
    }))
    .unwrap();
    let c = super::render_with_adapters(
        &svc,
        &rt,
        &RenderConfig::builtin().unwrap(),
        true,
        &Placement::Own,
        &super::ServiceAdapters {
            accepted: vec![adapter],
            fetches: Default::default(),
        },
    )
    .unwrap();
    let args = container_args(c.gateway.as_ref().unwrap());
    for want in ["--sleep-after=2m", "--adapters-configmap=chat-adapters"] {
        assert!(args.contains(&want.to_owned()), "{want} not in {args:?}");
    }
    let engine = container_args(&c.backend);
    assert!(engine.contains(&"--enable-lora".to_owned()), "{engine:?}");
    assert!(
        engine.contains(&"--enable-sleep-mode".to_owned()),
        "{engine:?}"
    );
    let table: hearth_crds::llmadapter::AdapterTable =
        serde_json::from_str(&c.adapters_config_map.unwrap().data.unwrap()["adapters.json"])
            .unwrap();
    assert_eq!(table.adapters[0].path, "/adapters/pvc/lora/sql");
    assert_eq!(table.max_loaded, 2);
}

fn lora(name: &str, uri: &str) -> hearth_crds::LLMAdapter {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name, "namespace": "team-a"},
        "spec": {"serviceRef": {"name": "chat"}, "source": {"uri": uri}},
    }))
    .unwrap()
}

/// Hub adapters: one fetch Job per source into the model cache the engines mount already (no
/// volume added), their routes unavailable until the Job has succeeded, the Job's failure said.
#[test]
fn hub_adapters_are_fetched_into_the_model_cache_before_they_are_loaded() {
    let (mut svc, mut rt) = service_and_runtime(json!({}));
    svc.spec.cache =
        serde_json::from_value(json!({"strategy": "SharedPVC", "prewarm": true})).unwrap();
    rt.spec.adapters = Some(serde_json::from_value(json!({"args": ["--enable-lora"]})).unwrap());
    let accepted = vec![
        lora("finance", "hf://acme/finance-lora"),
        // The same source twice: one Job.
        lora("finance-b", "hf://acme/finance-lora"),
        lora("legal", "modelscope://acme/legal-lora"),
        lora("sql", "pvc://lora/sql"),
    ];
    let render = |fetches: std::collections::BTreeMap<String, crate::status::JobState>| {
        super::render_with_adapters(
            &svc,
            &rt,
            &RenderConfig::builtin().unwrap(),
            true,
            &Placement::Own,
            &super::ServiceAdapters {
                accepted: accepted.clone(),
                fetches,
            },
        )
        .unwrap()
    };
    let table = |c: &super::Children| -> hearth_crds::llmadapter::AdapterTable {
        serde_json::from_str(
            &c.adapters_config_map
                .as_ref()
                .unwrap()
                .data
                .as_ref()
                .unwrap()["adapters.json"],
        )
        .unwrap()
    };
    let c = render(std::collections::BTreeMap::new());
    let jobs: Vec<&str> = c
        .adapter_fetch_jobs
        .iter()
        .map(|j| j.metadata.name.as_deref().unwrap())
        .collect();
    let finance = super::fetch_job_name("chat", &accepted[0]).unwrap();
    let legal = super::fetch_job_name("chat", &accepted[2]).unwrap();
    // hf:// and huggingface:// are one source; another Secret is another Job.
    let mut alias = lora("x", "huggingface://acme/finance-lora");
    assert_eq!(super::fetch_job_name("chat", &alias).unwrap(), finance);
    alias.spec.source.secret_ref = Some(k8s_openapi::api::core::v1::LocalObjectReference {
        name: "token".into(),
    });
    assert_ne!(super::fetch_job_name("chat", &alias).unwrap(), finance);
    assert_eq!(super::fetch_job_name("chat", &accepted[3]), None);
    let mut want = vec![finance.as_str(), legal.as_str()];
    want.sort_unstable();
    assert_eq!(jobs, want);
    for j in &c.adapter_fetch_jobs {
        let pod = j.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
        let claim = pod.volumes.as_ref().unwrap()[0]
            .persistent_volume_claim
            .as_ref()
            .unwrap();
        assert_eq!(
            (claim.claim_name.as_str(), claim.read_only),
            ("chat-cache", None),
            "the Job writes the shared cache"
        );
        let labels = j.metadata.labels.as_ref().unwrap();
        assert_eq!(labels["app.kubernetes.io/component"], "adapter-fetch");
        let program = &pod.containers[0].command.as_ref().unwrap()[2];
        assert!(
            program.contains("local_dir=\"/models/adapters/"),
            "{program}"
        );
    }
    // The engines' volumes: the cache, the one claim and shared memory; no volume for the
    // hub adapters.
    let volumes: Vec<String> = c
        .backend
        .spec
        .as_ref()
        .unwrap()
        .template
        .spec
        .as_ref()
        .unwrap()
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.clone())
        .collect();
    assert_eq!(volumes.len(), 3, "{volumes:?}");
    let t = table(&c);
    let route = |t: &hearth_crds::llmadapter::AdapterTable, n: &str| {
        t.adapters.iter().find(|r| r.name == n).unwrap().clone()
    };
    assert_eq!(
        route(&t, "finance").path,
        "/models/adapters/hf/acme/finance-lora"
    );
    assert_eq!(
        route(&t, "legal").path,
        "/models/adapters/modelscope/acme/legal-lora"
    );
    assert!(route(&t, "finance").unavailable.unwrap().contains(&format!(
        "being fetched into the model cache (Job {finance})"
    )));
    assert_eq!(route(&t, "sql").unavailable, None);
    // Fetched: loadable; failed: the Job's message.
    let c = render(std::collections::BTreeMap::from([
        (finance.clone(), crate::status::JobState::Succeeded),
        (
            legal.clone(),
            crate::status::JobState::Failed("BackoffLimitExceeded".into()),
        ),
    ]));
    let t = table(&c);
    assert_eq!(route(&t, "finance").unavailable, None);
    assert_eq!(route(&t, "finance-b").unavailable, None);
    let failed = route(&t, "legal").unavailable.unwrap();
    assert!(
        failed.contains("failed (Job")
            && failed.contains("BackoffLimitExceeded")
            && failed.contains("delete the Job"),
        "{failed}"
    );
}

#[test]
fn fetch_job_names_fit_a_label_value() {
    let long = "a".repeat(crate::names::MAX_SERVICE_NAME_LEN);
    let name = crate::names::adapter_fetch_job(&long, "hf://acme/x-lora");
    assert!(name.len() <= 63, "{name}");
    assert!(
        name.ends_with(&name[name.len() - 16..]) && name.contains("-adapter-"),
        "{name}"
    );
    assert_ne!(
        name,
        crate::names::adapter_fetch_job(&long, "hf://acme/y-lora")
    );
    assert_eq!(
        crate::names::adapter_fetch_job("chat", "hf://acme/x-lora").len(),
        "chat-adapter-".len() + 16
    );
    assert!(super::ADAPTERS_CACHE_DIR.starts_with(crate::model::CACHE_MOUNT_PATH));
}

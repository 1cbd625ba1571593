//! Golden render tests: `hearth-controller render -f SERVICE --runtime RUNTIME` on the upstream
//! examples (unchanged) and on our own inputs under `tests/golden/inputs`, compared byte for
//! byte with `tests/golden/<case>.yaml`. `HEARTH_UPDATE_GOLDEN=1` rewrites the expected files
//! (review the diff before committing).
//!
//! Ownership (docs/gitops.md): every golden case is rendered once more with a UID on its
//! LLMService, as the reconciler renders it, and every child must carry
//! `app.kubernetes.io/instance` and exactly one owner reference, the LLMService's controller
//! reference. Argo CD's label tracking keys on that label and takes only objects without owner
//! references as an application's own (to compare and prune), so no child may be left without
//! one. The children rendered outside `render` (an attached service's, an LLMEndpoint's, a joined
//! Deployment's) are checked the same way by `every_other_rendered_child_is_controlled`.
//!
//! `example_runtimes_pass_the_webhook_and_render_as_their_comments_say` renders the upstream
//! NVIDIA service on each runtime of `examples/runtimes/` and holds each runtime's comment
//! header to the Pod Security level its rendered backend needs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use hearth_controller::labels::INSTANCE_LABEL;
use serde_json::{Value, json};

fn here() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// One upstream example file.
fn upstream(file: &str) -> PathBuf {
    hearth_test_support::upstream_file(file)
}

fn input(file: &str) -> PathBuf {
    here().join("tests/golden/inputs").join(file)
}

fn render(service: &Path, runtime: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_hearth-controller"))
        .arg("render")
        .arg("-f")
        .arg(service)
        .arg("--runtime")
        .arg(runtime)
        .args(["--gateway-image", "ghcr.io/hearth-rs/hearth-gateway:golden"])
        .args(extra)
        .output()
        .expect("running hearth-controller render")
}

fn check(case: &str, service: PathBuf, runtime: PathBuf, extra: &[&str]) {
    check_owned(case, &service, &runtime, extra);
    let out = render(&service, &runtime, extra);
    assert!(
        out.status.success(),
        "{case}: render failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got = String::from_utf8(out.stdout).expect("render prints UTF-8");
    let golden = here().join("tests/golden").join(format!("{case}.yaml"));
    if std::env::var_os("HEARTH_UPDATE_GOLDEN").is_some() {
        std::fs::write(&golden, &got).expect("writing golden file");
        return;
    }
    let want = std::fs::read_to_string(&golden).unwrap_or_else(|e| {
        panic!(
            "{}: {e}; run with HEARTH_UPDATE_GOLDEN=1 to create it",
            golden.display()
        )
    });
    if got != want {
        let line = got
            .lines()
            .zip(want.lines())
            .position(|(g, w)| g != w)
            .unwrap_or_else(|| got.lines().count().min(want.lines().count()));
        panic!(
            "{case}: rendered output differs from {} at line {}:\n  got:  {:?}\n  want: {:?}\nrun with HEARTH_UPDATE_GOLDEN=1 to accept",
            golden.display(),
            line + 1,
            got.lines().nth(line),
            want.lines().nth(line)
        );
    }
}

/// The UID the ownership check gives each LLMService (offline renders have none, so their
/// children carry no owner reference; the reconciler's always have one).
const OWNER_UID: &str = "0d4c5a3e-1f2b-4c6d-8e9f-a0b1c2d3e4f5";

/// The documents of a multi-document YAML stream, as JSON.
fn documents(yaml: &str) -> Vec<Value> {
    serde_yaml::Deserializer::from_str(yaml)
        .map(|de| serde::Deserialize::deserialize(de).expect("a YAML document"))
        .filter(|v: &Value| !v.is_null())
        .collect()
}

/// Each of `docs` carries `app.kubernetes.io/instance: <instance>` and exactly one owner
/// reference: `owner` (apiVersion, kind, name, uid) as its controller.
fn assert_controlled(what: &str, docs: &[Value], instance: &str, owner: &Value) {
    assert!(!docs.is_empty(), "{what}: nothing rendered");
    for d in docs {
        let id = format!(
            "{what}: {} {}",
            d["kind"].as_str().unwrap_or("?"),
            d["metadata"]["name"].as_str().unwrap_or("?")
        );
        assert_eq!(
            d["metadata"]["labels"][INSTANCE_LABEL], instance,
            "{id} lacks {INSTANCE_LABEL}: {instance}"
        );
        let refs = d["metadata"]["ownerReferences"].as_array();
        let controlled = refs.is_some_and(|refs| {
            refs.len() == 1
                && refs[0]["controller"] == true
                && ["apiVersion", "kind", "name", "uid"]
                    .iter()
                    .all(|k| refs[0][k] == owner[k])
        });
        assert!(
            controlled,
            "{id}: not controlled by exactly {owner} (ownerReferences {}), so Argo CD's label tracking would take it for an application's own object and prune it",
            d["metadata"]["ownerReferences"]
        );
    }
}

/// [`check`]'s render again, with [`OWNER_UID`] on the LLMService: every child is controlled by
/// it (see the module documentation).
fn check_owned(case: &str, service: &Path, runtime: &Path, extra: &[&str]) {
    let mut svc: Value = serde_yaml::from_str(&std::fs::read_to_string(service).unwrap()).unwrap();
    svc["metadata"]["uid"] = json!(OWNER_UID);
    let dir = std::env::temp_dir().join(format!("hearth-golden-owned-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let copy = dir.join(format!("{case}.yaml"));
    std::fs::write(&copy, serde_yaml::to_string(&svc).unwrap()).unwrap();
    let out = render(&copy, runtime, extra);
    let _ = std::fs::remove_file(&copy);
    assert!(
        out.status.success(),
        "{case} with a UID: render failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let name = svc["metadata"]["name"].as_str().unwrap();
    let owner = json!({"apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
                       "name": name, "uid": OWNER_UID});
    let docs = documents(&String::from_utf8(out.stdout).unwrap());
    assert_controlled(case, &docs, name, &owner);
}

#[test]
fn upstream_nvidia_a10() {
    check(
        "nvidia-a10",
        upstream("nvidia-a10-llmservice.yaml"),
        upstream("nvidia-a10-inferenceruntime.yaml"),
        &["-n", "ml"],
    );
}

#[test]
fn upstream_ascend_910b3() {
    check(
        "ascend-910b3",
        upstream("ascend-910b3-llmservice.yaml"),
        upstream("ascend-910b3-inferenceruntime.yaml"),
        &["-n", "ml"],
    );
}

/// The upstream NVIDIA example on a runtime with `spec.adapters`, with four LLMAdapters (one
/// from a hub).
#[test]
fn nvidia_a10_with_adapters() {
    check(
        "nvidia-a10-adapters",
        upstream("nvidia-a10-llmservice.yaml"),
        input("nvidia-a10-lora-inferenceruntime.yaml"),
        &[
            "-n",
            "ml",
            "--adapters",
            input("nvidia-a10-adapters.yaml").to_str().unwrap(),
        ],
    );
}

/// The upstream Ascend example on a runtime with `spec.adapters`, with three LLMAdapters.
#[test]
fn ascend_910b3_with_adapters() {
    check(
        "ascend-910b3-adapters",
        upstream("ascend-910b3-llmservice.yaml"),
        input("ascend-910b3-lora-inferenceruntime.yaml"),
        &[
            "-n",
            "ml",
            "--adapters",
            input("ascend-910b3-adapters.yaml").to_str().unwrap(),
        ],
    );
}

#[test]
fn upstream_stub() {
    check(
        "stub",
        upstream("stub-llmservice.yaml"),
        upstream("stub-inferenceruntime.yaml"),
        &[],
    );
}

#[test]
fn hostpath_hf_push_mode_with_secrets() {
    check(
        "hostpath-hf-push",
        input("hostpath-hf-secret-llmservice.yaml"),
        input("volcano-inferenceruntime.yaml"),
        &[],
    );
}

#[test]
fn gateway_replicas_and_api_keys_push_mode() {
    check(
        "gateway-replicas-apikey",
        input("gateway-replicas-apikey-llmservice.yaml"),
        upstream("stub-inferenceruntime.yaml"),
        &[],
    );
}

/// The data plane's NetworkPolicies, with the flag as the chart writes it: clients from one
/// namespace, scrapers from another.
#[test]
fn network_policies_push_mode() {
    check(
        "network-policies",
        input("gateway-replicas-apikey-llmservice.yaml"),
        upstream("stub-inferenceruntime.yaml"),
        &[
            "--model-network-policies",
            r#"{"clientsFrom":[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"ingress"}}}],"controllerNamespace":"hearth-system","controllerPodLabels":{"app.kubernetes.io/component":"controller","app.kubernetes.io/instance":"hearth","app.kubernetes.io/name":"hearth"},"kedaNamespace":"keda","metricsFrom":[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]}"#,
        ],
    );
}

#[test]
fn prestaged_pvc() {
    check(
        "pvc",
        input("pvc-llmservice.yaml"),
        upstream("nvidia-a10-inferenceruntime.yaml"),
        &[],
    );
}

fn example(file: &str) -> PathBuf {
    here().join("../examples").join(file)
}

/// Warm windows: one KEDA `cron` trigger per window, after the demand trigger.
#[test]
fn warm_windows_example() {
    check(
        "warm-windows",
        example("warm-windows/llmservice.yaml"),
        example("quickstart/runtime.yaml"),
        &[],
    );
}

/// The sleeping tier: the runtime's sleep-mode args and env on the engine, the tier's flags
/// and peers on the gateway, the poll URL per replica.
#[test]
fn sleeping_tier_example() {
    check(
        "sleeping-tier",
        example("sleeping-tier/llmservice.yaml"),
        example("quickstart/runtime.yaml"),
        &[],
    );
}

/// A shared cache: a ReadWriteMany claim the prewarm Job writes and the backends mount
/// read-only, reading the snapshot offline.
#[test]
fn shared_cache_example() {
    check(
        "shared-cache",
        example("shared-cache/llmservice.yaml"),
        example("quickstart/runtime.yaml"),
        &[],
    );
}

#[test]
fn hami_fraction_rendered_by_the_platform_policy() {
    let policy = example("hami/fraction-policy.yaml");
    check(
        "hami-fraction",
        input("hami-fraction-llmservice.yaml"),
        example("hami/runtime.yaml"),
        &["--policy", policy.to_str().unwrap()],
    );
}

/// Renders and checks that the render fails with `message` on stderr: a clear error, not a
/// panic.
fn assert_refused(service: &Path, runtime: &Path, message: &str) {
    let out = render(service, runtime, &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stderr.contains(message), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// A copy of the upstream example `file` in `dir`, with `from` replaced by `to`.
fn edited_upstream(dir: &Path, file: &str, from: &str, to: &str) -> PathBuf {
    let path = dir.join(file);
    let original = std::fs::read_to_string(upstream(file)).unwrap();
    std::fs::write(&path, original.replace(from, to)).unwrap();
    path
}

#[test]
fn a_fraction_no_policy_renders_is_refused() {
    assert_refused(
        &input("hami-fraction-llmservice.yaml"),
        &example("hami/runtime.yaml"),
        "spec.resources.fraction: no ServingPolicy renders fractional devices",
    );
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    let dir = std::env::temp_dir().join(format!("hearth-golden-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let runtime = edited_upstream(
        &dir,
        "stub-inferenceruntime.yaml",
        "{{ .Model.Path }}",
        "{{ .Model.Name }}",
    );
    assert_refused(
        &upstream("stub-llmservice.yaml"),
        &runtime,
        "spec.container.args[0]: unknown template reference {{ .Model.Name }}",
    );
    let service = edited_upstream(
        &dir,
        "stub-llmservice.yaml",
        "strategy: None",
        "strategy: BakedImage",
    );
    assert_refused(
        &service,
        &upstream("stub-inferenceruntime.yaml"),
        "spec.cache.strategy: BakedImage is reserved and not implemented",
    );
    let service = edited_upstream(
        &dir,
        "stub-llmservice.yaml",
        "strategy: None",
        "strategy: SharedPVC",
    );
    assert_refused(
        &service,
        &upstream("stub-inferenceruntime.yaml"),
        "spec.cache.prewarm: must be true with strategy SharedPVC",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The `--model-network-policies` of the golden case `network-policies`.
const NETWORK_POLICIES: &str = r#"{"clientsFrom":[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"ingress"}}}],"controllerNamespace":"hearth-system","controllerPodLabels":{"app.kubernetes.io/component":"controller","app.kubernetes.io/instance":"hearth","app.kubernetes.io/name":"hearth"},"kedaNamespace":"keda","metricsFrom":[{"namespaceSelector":{"matchLabels":{"kubernetes.io/metadata.name":"monitoring"}}}]}"#;

/// An owner reference's identifying fields.
fn owner(api_version: &str, kind: &str, name: &str, uid: &str) -> Value {
    json!({"apiVersion": api_version, "kind": kind, "name": name, "uid": uid})
}

/// The children the reconcilers render outside `hearth-controller render`, with everything on
/// (the ExternalScaler's mutual TLS, the models' NetworkPolicies): a push-mode service's own
/// gateway (its TriggerAuthentication), the same service attached to an LLMEndpoint in another
/// namespace (its Role and RoleBinding let that endpoint's gateway read its EndpointSlices: the
/// binding names a ServiceAccount of the other namespace but lives in the service's), the
/// endpoint's shared gateway, and a plain Deployment joined to the endpoint. Each child is
/// controlled by the object it was rendered for, as in [`check_owned`].
#[test]
fn every_other_rendered_child_is_controlled() {
    use hearth_controller::render::{self, Placement, RenderConfig, SharedGateway};
    use hearth_crds::{InferenceRuntime, LLMEndpoint, LLMService, llmendpoint::RouteTable};
    use k8s_openapi::api::apps::v1::Deployment;

    let mut cfg = RenderConfig::builtin().unwrap();
    cfg.scaler_tls = true;
    cfg.network_policies = Some(render::ModelNetworkPolicies::parse(NETWORK_POLICIES).unwrap());
    let read = |p: PathBuf| std::fs::read_to_string(p).unwrap();
    let runtime: InferenceRuntime =
        serde_yaml::from_str(&read(upstream("stub-inferenceruntime.yaml"))).unwrap();
    let mut svc: LLMService =
        serde_yaml::from_str(&read(upstream("stub-llmservice.yaml"))).unwrap();
    svc.metadata.uid = Some("svc-uid".to_owned());
    svc.metadata.annotations = Some(
        [("serving.hearth.dev/scaler".to_owned(), "push".to_owned())]
            .into_iter()
            .collect(),
    );
    let name = svc.metadata.name.clone().unwrap();
    let namespace = svc.metadata.namespace.clone().unwrap();
    let svc_owner = owner(
        "serving.hearth.dev/v1alpha1",
        "LLMService",
        &name,
        "svc-uid",
    );

    let own = render::render(&svc, &runtime, &cfg, true).unwrap();
    assert!(own.trigger_authentication.is_some(), "push mode with TLS");
    assert!(own.backend_network_policy.is_some() && own.gateway_network_policy.is_some());
    assert_controlled("own gateway", &own.to_values().unwrap(), &name, &svc_owner);

    let shared = SharedGateway {
        endpoint: "models".to_owned(),
        namespace: "ai-platform".to_owned(),
        peers: true,
    };
    let attached = render::render_placed(
        &svc,
        &runtime,
        &cfg,
        true,
        &Placement::Shared(shared.clone()),
    )
    .unwrap();
    let docs = attached.to_values().unwrap();
    let binding = docs
        .iter()
        .find(|d| d["kind"] == "RoleBinding")
        .expect("an attached service's RoleBinding");
    assert_eq!(binding["metadata"]["namespace"], namespace.as_str());
    assert_eq!(binding["subjects"][0]["namespace"], "ai-platform");
    assert_controlled("attached to an endpoint", &docs, &name, &svc_owner);

    let ep: LLMEndpoint = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMEndpoint",
        "metadata": {"name": "models", "namespace": "ai-platform", "uid": "ep-uid",
                     "annotations": {"serving.hearth.dev/scaler": "push"}},
        "spec": {"replicas": 2},
    }))
    .unwrap();
    let table = RouteTable {
        models: vec![render::model_route(&svc, &runtime, &Default::default()).unwrap()],
    };
    let endpoint = render::render_endpoint(&ep, &table, true, &cfg).unwrap();
    assert!(endpoint.scaler_service.is_some() && endpoint.gateway_network_policy.is_some());
    assert_controlled(
        "LLMEndpoint",
        &endpoint.to_values().unwrap(),
        "models",
        &owner(
            "serving.hearth.dev/v1alpha1",
            "LLMEndpoint",
            "models",
            "ep-uid",
        ),
    );

    let d: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "chat", "namespace": "team-a", "uid": "dep-uid", "annotations": {
            "serving.hearth.dev/endpoint": "ai-platform/models",
            "serving.hearth.dev/model": "Qwen/Qwen2.5-7B-Instruct",
        }},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "qwen"}},
            "template": {
                "metadata": {"labels": {"app": "qwen"}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1",
                                         "ports": [{"name": "http", "containerPort": 8000}]}]},
            },
        },
    }))
    .unwrap();
    let member = hearth_crds::rules::check_deployment(&d).member.unwrap();
    let (port, findings) = hearth_crds::rules::check_member_serving(&d, &member, None);
    assert!(!findings.blocks_rendering(), "{findings}");
    let joined = render::render_member(&d, &member, &port.unwrap(), &shared, &cfg).unwrap();
    assert_controlled(
        "joined Deployment",
        &joined.to_values().unwrap(),
        "chat",
        &owner("apps/v1", "Deployment", "chat", "dep-uid"),
    );
}

/// The Pod Security level a runtime's backend pods need, from the rendered pod spec: a
/// hostPath volume needs `privileged`; a container that may run as root (no `runAsNonRoot` on
/// it or the pod) `baseline`; else `restricted` (the other checks of "restricted" are those of
/// the backend's default security context, which a runtime's own may drop: not judged here).
fn pod_security_level(pod: &Value) -> &'static str {
    let volumes = pod["volumes"].as_array().cloned().unwrap_or_default();
    if volumes.iter().any(|v| v.get("hostPath").is_some()) {
        return "privileged";
    }
    let pod_non_root = pod["securityContext"]["runAsNonRoot"] == true;
    let all_non_root = pod["containers"]
        .as_array()
        .into_iter()
        .chain(pod["initContainers"].as_array())
        .flatten()
        .all(|c| pod_non_root || c["securityContext"]["runAsNonRoot"] == true);
    if all_non_root {
        "restricted"
    } else {
        "baseline"
    }
}

/// Every runtime of `examples/runtimes/` passes the admission webhook's checks, renders an
/// LLMService (the upstream NVIDIA example pinned to it) through the built-in policies with
/// its device, node selector and tolerations on the backend, and its comment header names the
/// device plugin, who sets the node labels it selects, and the Pod Security level its backend
/// pods need, which is the level the rendered pod needs; the gateway's pod needs "restricted".
#[test]
fn example_runtimes_pass_the_webhook_and_render_as_their_comments_say() {
    use hearth_crds::{InferenceRuntime, LLMService};

    let dir = here().join("../examples/runtimes");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.extension().is_some_and(|e| e == "yaml")
                && p.file_name().unwrap() != "hearth-test.yaml"
        })
        .collect();
    files.sort();
    assert!(files.len() >= 7, "{files:?}");
    let svc_text = std::fs::read_to_string(upstream("nvidia-a10-llmservice.yaml")).unwrap();
    let cfg = hearth_controller::RenderConfig::builtin().unwrap();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let what = f.file_name().unwrap().to_string_lossy().into_owned();
        let rt: InferenceRuntime = serde_yaml::from_str(&text).unwrap();
        let checked = hearth_webhook::validate::inference_runtime(&rt);
        assert!(
            checked.denials.is_empty() && checked.warnings.is_empty(),
            "{what}: the webhook says {:?} {:?}",
            checked
                .denials
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>(),
            checked
                .warnings
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
        );
        let mut svc: LLMService = serde_yaml::from_str(&svc_text).unwrap();
        svc.metadata.namespace = Some("ml".to_owned());
        svc.spec.runtime.name = rt.metadata.name.clone();
        let children = hearth_controller::render(&svc, &rt, &cfg, true)
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let backend = serde_json::to_value(&children.backend).unwrap();
        let pod = &backend["spec"]["template"]["spec"];
        let acc = &rt.spec.accelerator;
        assert_eq!(
            pod["containers"][0]["resources"]["limits"][&acc.resource_name], "1",
            "{what}: {pod}"
        );
        assert_eq!(pod["nodeSelector"], json!(acc.node_selector), "{what}");
        for t in &acc.tolerations {
            let t = serde_json::to_value(t).unwrap();
            assert!(
                pod["tolerations"].as_array().unwrap().contains(&t),
                "{what}: {t} not among {}",
                pod["tolerations"]
            );
        }
        let header: String = text
            .lines()
            .take_while(|l| l.starts_with('#'))
            .collect::<Vec<_>>()
            .join("\n");
        for part in ["# Device plugin:", "# Node labels:"] {
            assert!(header.contains(part), "{what}: no {part:?} in its comment");
        }
        let level = header
            .split("# Pod Security: ")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .unwrap_or_else(|| panic!("{what}: no \"# Pod Security: <level>\" in its comment"));
        assert_eq!(
            level,
            pod_security_level(pod),
            "{what}: the comment's Pod Security level is not what the rendered backend needs"
        );
        let gateway = serde_json::to_value(children.gateway.as_ref().unwrap()).unwrap();
        assert_eq!(
            pod_security_level(&gateway["spec"]["template"]["spec"]),
            "restricted",
            "{what}: the gateway's pod"
        );
    }
}

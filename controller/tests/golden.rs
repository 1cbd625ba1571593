//! Golden render tests: `hearth-controller render -f SERVICE --runtime RUNTIME` on the upstream
//! examples (unchanged) and on our own inputs under `tests/golden/inputs`, compared byte for
//! byte with `tests/golden/<case>.yaml`. `HEARTH_UPDATE_GOLDEN=1` rewrites the expected files
//! (review the diff before committing).
//!
//! `example_runtimes_pass_the_webhook_and_render_as_their_comments_say` renders the upstream
//! NVIDIA service on each runtime of `examples/runtimes/` and holds each runtime's comment
//! header to the Pod Security level its rendered backend needs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    path::{Path, PathBuf},
    process::Command,
};

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

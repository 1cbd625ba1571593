//! The drain sidecar the built-in serving defaults inject (`settings.drainImage`): it takes a
//! port and a name no other container of the pod uses, stays off hostNetwork pods, passes the
//! drain timeout on as written, and a second pass leaves it alone. Also the `settings` root.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use hearth_crds::{InferenceRuntime, servingpolicy::Operation};
use hearth_policies::{EvalInput, Outcome, PolicySet, PolicySettings, manifest};
use serde_json::{Value, json};

const IMAGE: &str = "registry.example/hearth-gateway:v1";

/// The built-in policies, compiled.
fn builtin() -> PolicySet {
    common::set(hearth_policies::builtin::policies().unwrap())
}

/// The params of the built-in NVIDIA A10 runtime.
fn params() -> Value {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/builtin/tests/runtimes/nvidia-a10-inferenceruntime.yaml"
    ))
    .unwrap();
    let rt: InferenceRuntime = serde_yaml::from_str(&text).unwrap();
    manifest::runtime_params(&rt)
}

/// A CREATE of `object` with the runtime's params and `settings`.
fn input(object: Value, settings: Option<Value>) -> EvalInput {
    let mut i = EvalInput::for_object(object, Operation::Create);
    i.params = Some(params());
    i.settings = settings;
    i
}

/// Settings that name the drain image.
fn with_image() -> Option<Value> {
    Some(
        PolicySettings {
            drain_image: Some(IMAGE.into()),
        }
        .to_value(),
    )
}

/// Evaluates `object`, failing on evaluation errors.
fn eval_on(set: &PolicySet, object: Value, settings: Option<Value>) -> Outcome {
    let out = set.evaluate(&input(object, settings));
    assert!(out.errors.is_empty(), "errors: {:?}", out.errors);
    out
}

/// A Deployment with the pod spec `pod` and the Deployment's `annotations`.
fn deployment(pod: Value, annotations: Value) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "llm", "namespace": "team-a", "annotations": annotations},
        "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "llm"}},
                 "template": {"metadata": {"labels": {"app": "llm"}}, "spec": pod}}
    })
}

/// A Deployment of one plain vLLM container, with the Deployment's `annotations`.
fn plain_deployment(annotations: Value) -> Value {
    deployment(json!({"containers": [vllm(json!({}))]}), annotations)
}

/// A vLLM container with port 8000, `extra` fields merged in.
fn vllm(extra: Value) -> Value {
    let mut c = json!({"name": "vllm", "image": "vllm/vllm-openai:v0.25.1",
                       "ports": [{"name": "http", "containerPort": 8000}]});
    if let (Some(c), Some(e)) = (c.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            c.insert(k.clone(), v.clone());
        }
    }
    c
}

/// The pod spec of a Pod or of a workload's template.
fn pod_spec(obj: &Value) -> &Value {
    if obj["kind"] == "Pod" {
        &obj["spec"]
    } else {
        &obj["spec"]["template"]["spec"]
    }
}

/// The object after the patch.
fn patched(out: &Outcome) -> Value {
    out.patched_object.clone().expect("patched object")
}

/// The pod's init containers and containers.
fn all_containers(pod: &Value) -> Vec<&Value> {
    let mut v: Vec<&Value> = Vec::new();
    for key in ["initContainers", "containers"] {
        if let Some(cs) = pod[key].as_array() {
            v.extend(cs.iter());
        }
    }
    v
}

/// The args of the `hearth-drain` init container; empty when there is none.
fn sidecar_args(pod: &Value) -> Vec<String> {
    pod["initContainers"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["name"] == "hearth-drain"))
        .map(|c| {
            c["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// The sidecar listens on a port no other container of the pod declares: a second listener on
/// 8099 could not bind, and a native sidecar that never starts blocks the pod's containers.
#[test]
fn sidecar_port_avoids_a_port_another_container_declares() {
    let set = builtin();
    let pod = json!({"containers": [
        vllm(json!({"ports": [{"name": "http", "containerPort": 8000},
                              {"name": "admin", "containerPort": 8099}]}))
    ]});
    let out = eval_on(&set, deployment(pod, json!({})), with_image());
    let obj = patched(&out);
    let users: Vec<String> = all_containers(pod_spec(&obj))
        .into_iter()
        .filter(|c| {
            c["ports"]
                .as_array()
                .is_some_and(|ps| ps.iter().any(|p| p["containerPort"] == 8099))
        })
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect();
    assert!(
        users.len() <= 1,
        "containers listening on 8099 in one pod: {users:?}"
    );
}

/// The drain-timeout annotation reaches the sidecar's `--timeout` as written, sub-second and
/// zero values included (not truncated to whole seconds); a negative one is denied. See
/// `gateway/tests/drain_adversarial.rs` for what the drain does with a zero timeout.
#[test]
fn drain_timeout_annotation_reaches_the_sidecar_as_written() {
    let set = builtin();
    let neg = set.evaluate(&input(
        plain_deployment(json!({"serving.hearth.dev/drain-timeout": "-5s"})),
        with_image(),
    ));
    assert!(!neg.allowed(), "negative drain timeout admitted");
    for text in ["500ms", "0s"] {
        let out = eval_on(
            &set,
            plain_deployment(json!({"serving.hearth.dev/drain-timeout": text})),
            with_image(),
        );
        let args = sidecar_args(pod_spec(&patched(&out)));
        let timeout = args
            .iter()
            .find_map(|a| a.strip_prefix("--timeout="))
            .map(str::to_owned);
        let ok = timeout.as_deref() == Some(text);
        assert!(
            ok,
            "annotation drain-timeout: {text} -> sidecar --timeout={timeout:?} (allowed: {}, warnings {:?})",
            out.allowed(),
            out.warnings
        );
    }
}

/// A pod with a regular container named `hearth-drain` gets no init container of that name:
/// names must be unique across containers and initContainers, or the API server rejects it.
#[test]
fn container_names_stay_unique_beside_a_regular_hearth_drain() {
    let set = builtin();
    let pod = json!({"containers": [
        vllm(json!({})),
        {"name": "hearth-drain", "image": "busybox"}
    ]});
    let out = eval_on(&set, deployment(pod, json!({})), with_image());
    let obj = patched(&out);
    let names: Vec<&str> = all_containers(pod_spec(&obj))
        .into_iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    let mut dedup = names.clone();
    dedup.sort_unstable();
    dedup.dedup();
    assert_eq!(
        dedup.len(),
        names.len(),
        "duplicate container names: {names:?}"
    );
}

/// A hostNetwork pod gets no drain sidecar: its port would be the node's, shared by every such
/// pod there and reachable on the node's address.
#[test]
fn host_network_pod_gets_no_sidecar() {
    let set = builtin();
    let pod = json!({"hostNetwork": true, "containers": [vllm(json!({}))]});
    let out = eval_on(&set, deployment(pod, json!({})), with_image());
    let obj = patched(&out);
    assert!(
        sidecar_args(pod_spec(&obj)).is_empty(),
        "a hostNetwork pod got the drain sidecar: {:?}",
        sidecar_args(pod_spec(&obj))
    );
}

/// Resources for the idempotency and native-vs-interpreted checks.
fn cases() -> Vec<(&'static str, Value)> {
    let pod = |spec: Value| {
        json!({"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "p", "namespace": "team-a",
                            "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10"}},
               "spec": spec})
    };
    let sts = |spec: Value| {
        json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
               "metadata": {"name": "s", "namespace": "team-a"},
               "spec": {"serviceName": "s", "selector": {"matchLabels": {"app": "s"}},
                        "template": {"metadata": {"labels": {"app": "s"}}, "spec": spec}}})
    };
    vec![
        ("pod plain", pod(json!({"containers": [vllm(json!({}))]}))),
        (
            "pod lifecycle {}",
            pod(json!({"containers": [vllm(json!({"lifecycle": {}}))]})),
        ),
        (
            "deployment postStart only",
            deployment(
                json!({"containers": [vllm(json!({"lifecycle": {"postStart": {"exec": {"command": ["true"]}}}}))]}),
                json!({}),
            ),
        ),
        (
            "sts existing hearth-drain init container",
            sts(
                json!({"initContainers": [{"name": "hearth-drain", "image": "x", "restartPolicy": "Always"}],
                       "containers": [vllm(json!({}))]}),
            ),
        ),
        (
            "deployment port 8099",
            deployment(
                json!({"containers": [vllm(json!({"ports": [{"name": "http", "containerPort": 8099}]}))]}),
                json!({}),
            ),
        ),
        (
            "deployment empty initContainers",
            deployment(
                json!({"initContainers": [], "containers": [vllm(json!({}))]}),
                json!({}),
            ),
        ),
        (
            "sts metrics port unnamed",
            sts(json!({"containers": [vllm(json!({"ports": [{"containerPort": 8000}]}))]})),
        ),
        (
            "deployment regular container hearth-drain",
            deployment(
                json!({"containers": [vllm(json!({})), {"name": "hearth-drain", "image": "busybox"}]}),
                json!({}),
            ),
        ),
    ]
}

/// A second pass over the mutated object produces an empty patch, for Pods, Deployments and
/// StatefulSets, with and without the drain image.
#[test]
fn second_pass_is_empty() {
    let set = builtin();
    for settings in [None, with_image(), Some(json!({"drainImage": ""}))] {
        for (name, obj) in cases() {
            let first = eval_on(&set, obj, settings.clone());
            let again = eval_on(&set, patched(&first), settings.clone());
            assert!(
                again.patch.0.is_empty(),
                "{name} ({settings:?}): second pass patch {:?}",
                again.patch
            );
        }
    }
}

/// The native evaluator and the interpreter agree on these cases.
#[test]
fn native_and_interpreted_agree() {
    let set = builtin();
    let interp = set.interpreted();
    for settings in [
        None,
        with_image(),
        Some(json!({"drainImage": ""})),
        Some(json!({})),
    ] {
        for (name, obj) in cases() {
            let a = set.evaluate(&input(obj.clone(), settings.clone()));
            let b = interp.evaluate(&input(obj, settings.clone()));
            assert_eq!(a.patched_object, b.patched_object, "{name} {settings:?}");
            assert_eq!(a.errors.len(), b.errors.len(), "{name} {settings:?}");
        }
    }
}

/// An empty drain image means the sleep hook and no sidecar; `PolicySettings` rejects unknown
/// fields and wrong types.
#[test]
fn settings_values() {
    let set = builtin();
    let out = eval_on(
        &set,
        plain_deployment(json!({})),
        Some(json!({"drainImage": ""})),
    );
    let obj = patched(&out);
    let pod = pod_spec(&obj);
    assert!(pod["initContainers"].is_null());
    assert!(pod["containers"][0]["lifecycle"]["preStop"]["sleep"].is_object());
    assert!(serde_yaml::from_str::<PolicySettings>("drainImage: x\nother: 1\n").is_err());
    assert!(serde_yaml::from_str::<PolicySettings>("drainImage: [1]\n").is_err());
}

/// A drain timeout of 0 without a drain image adds no hook at all: a `sleep` of 0 seconds is
/// refused by API servers before 1.33 (PodLifecycleSleepActionAllowZero).
#[test]
fn zero_drain_timeout_without_a_drain_image_adds_no_hook() {
    let set = builtin();
    let out = eval_on(
        &set,
        plain_deployment(json!({"serving.hearth.dev/drain-timeout": "0s"})),
        None,
    );
    let obj = patched(&out);
    let c = &pod_spec(&obj)["containers"][0];
    assert!(c["lifecycle"]["preStop"].is_null(), "{c}");
    assert!(pod_spec(&obj)["initContainers"].is_null());
}

/// The runtime's metric names reach the sidecar; without them it reads vLLM's defaults.
#[test]
fn the_runtimes_metric_names_reach_the_sidecar() {
    let set = builtin();
    let out = eval_on(&set, plain_deployment(json!({})), with_image());
    let args = sidecar_args(pod_spec(&patched(&out)));
    let running = params()["spec"]["metrics"]["running"]
        .as_str()
        .map(str::to_owned);
    assert!(
        running.is_some(),
        "the A10 runtime declares metrics.running"
    );
    assert_eq!(
        args.iter()
            .find_map(|a| a.strip_prefix("--running-metric=")),
        running.as_deref(),
        "{args:?}"
    );
}

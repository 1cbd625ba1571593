#![allow(clippy::unwrap_used)]

use k8s_openapi::api::apps::v1::DaemonSetStatus;
use serde_json::json;

use super::*;

fn runtime(pre_pull: bool) -> InferenceRuntime {
    serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": "vllm-a10", "uid": "rt-uid"},
        "spec": {
            "vendor": "nvidia",
            "container": {"image": "vllm/vllm-openai:v0.11.0", "port": {"name": "http", "containerPort": 8000}},
            "accelerator": {
                "resourceName": "nvidia.com/gpu",
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A10"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
            "prePull": pre_pull,
        }
    }))
    .unwrap()
}

fn cfg() -> PrePullConfig {
    PrePullConfig {
        namespace: "hearth-system".to_owned(),
        pause_image: "registry.k8s.io/pause:3.10".to_owned(),
    }
}

#[test]
fn no_daemon_set_without_pre_pull() {
    assert!(daemon_set(&runtime(false), &cfg()).is_none());
}

#[test]
fn the_daemon_set_runs_the_image_on_the_runtimes_nodes_and_holds_a_pause() {
    let ds = daemon_set(&runtime(true), &cfg()).unwrap();
    assert_eq!(
        ds.metadata.name.as_deref(),
        Some("hearth-pre-pull-vllm-a10")
    );
    assert_eq!(ds.metadata.namespace.as_deref(), Some("hearth-system"));
    let owner = &ds.metadata.owner_references.as_ref().unwrap()[0];
    assert_eq!(
        (owner.kind.as_str(), owner.name.as_str(), owner.controller),
        ("InferenceRuntime", "vllm-a10", Some(true))
    );
    let spec = ds.spec.unwrap();
    let pod = spec.template.spec.unwrap();
    let init = &pod.init_containers.unwrap()[0];
    assert_eq!(init.image.as_deref(), Some("vllm/vllm-openai:v0.11.0"));
    assert_eq!(
        init.command.as_deref(),
        Some(&["python3".to_owned(), "-c".to_owned(), String::new()][..])
    );
    assert_eq!(
        pod.containers[0].image.as_deref(),
        Some("registry.k8s.io/pause:3.10")
    );
    assert_eq!(
        pod.node_selector.unwrap()["nvidia.com/gpu.product"],
        "NVIDIA-A10"
    );
    assert_eq!(
        pod.tolerations.unwrap()[0].key.as_deref(),
        Some("nvidia.com/gpu")
    );
    // No accelerator: the pods must fit beside the backends.
    for c in pod.containers.iter().chain(init_containers(&ds_again())) {
        let r = c.resources.as_ref().unwrap();
        assert!(
            r.requests
                .as_ref()
                .unwrap()
                .keys()
                .all(|k| k == "cpu" || k == "memory")
        );
    }
    let selector = spec.selector.match_labels.unwrap();
    let labels = spec.template.metadata.unwrap().labels.unwrap();
    assert!(selector.iter().all(|(k, v)| labels.get(k) == Some(v)));
}

fn ds_again() -> DaemonSet {
    daemon_set(&runtime(true), &cfg()).unwrap()
}

fn init_containers(ds: &DaemonSet) -> impl Iterator<Item = &Container> {
    ds.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.init_containers.as_ref())
        .into_iter()
        .flatten()
}

#[test]
fn long_runtime_names_get_a_hashed_daemon_set_name() {
    let long = "a".repeat(100);
    let n = names::pre_pull(&long);
    assert!(n.len() <= 63, "{n}");
    assert_eq!(n, names::pre_pull(&long), "stable");
    assert_ne!(n, names::pre_pull(&"b".repeat(100)));
    assert_eq!(names::pre_pull("short"), "hearth-pre-pull-short");
}

fn with_status(
    generation: i64,
    observed: i64,
    desired: i32,
    ready: i32,
    updated: i32,
) -> DaemonSet {
    let mut ds = ds_again();
    ds.metadata.generation = Some(generation);
    ds.status = Some(DaemonSetStatus {
        observed_generation: Some(observed),
        desired_number_scheduled: desired,
        number_ready: ready,
        updated_number_scheduled: Some(updated),
        current_number_scheduled: desired,
        number_misscheduled: 0,
        ..Default::default()
    });
    ds
}

#[test]
fn the_condition_follows_the_daemon_sets_status() {
    let now = Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH);
    let c = |ds: Option<&DaemonSet>| {
        let c = condition("img:1", ds, now.clone());
        (c.status, c.reason, c.message)
    };
    assert_eq!(c(None).1, "Pulling");
    let all = c(Some(&with_status(2, 2, 3, 3, 3)));
    assert_eq!(
        all,
        (
            "True".to_owned(),
            "Pulled".to_owned(),
            "img:1 is present on all 3 node(s) the runtime schedules to".to_owned()
        )
    );
    let some = c(Some(&with_status(2, 2, 3, 1, 3)));
    assert_eq!((some.0.as_str(), some.1.as_str()), ("False", "Pulling"));
    assert!(some.2.contains("on 1 of 3 node(s)"), "{}", some.2);
    // A new image: the DaemonSet controller has not seen it yet.
    assert_eq!(c(Some(&with_status(3, 2, 3, 3, 3))).1, "Pulling");
    assert_eq!(c(Some(&with_status(3, 3, 3, 3, 1))).1, "Pulling");
    assert_eq!(c(Some(&with_status(1, 1, 0, 0, 0))).1, "NoNodes");
}

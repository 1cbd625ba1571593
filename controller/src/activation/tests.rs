use super::*;
use rstest::rstest;
use serde_json::{Value, json};

/// `2026-01-01T00:00:00Z` plus `secs`.
fn at(secs: f64) -> String {
    let base = 1_767_225_600_i64;
    let ts = Timestamp::from_second(base).unwrap()
        + k8s_openapi::jiff::SignedDuration::from_secs_f64(secs);
    ts.to_string()
}

fn ts(secs: f64) -> Timestamp {
    at(secs).parse().unwrap()
}

/// A backend pod created at 0 s: scheduled at `scheduled`, its `vllm` container started at
/// `started`, Ready at `ready` (`None`: not Ready yet).
fn pod(uid: &str, scheduled: Option<f64>, started: f64, ready: Option<f64>) -> Pod {
    let mut conditions = vec![];
    if let Some(s) = scheduled {
        conditions
            .push(json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": at(s)}));
    }
    conditions.push(match ready {
        Some(r) => json!({"type": "Ready", "status": "True", "lastTransitionTime": at(r)}),
        None => json!({"type": "Ready", "status": "False", "lastTransitionTime": at(started)}),
    });
    serde_json::from_value(json!({
        "metadata": {"name": format!("m-{uid}"), "uid": uid, "creationTimestamp": at(0.0)},
        "spec": {
            "nodeName": "node-1",
            "initContainers": [{"name": "hearth-drain", "restartPolicy": "Always"}],
            "containers": [{"name": "vllm"}, {"name": "log-shipper"}],
        },
        "status": {
            "conditions": conditions,
            "containerStatuses": [{
                "name": "vllm", "image": "vllm", "imageID": "", "ready": ready.is_some(),
                "restartCount": 0,
                "state": {"running": {"startedAt": at(started)}},
            }],
        },
    }))
    .unwrap()
}

fn event(reason: &str, container: &str, message: &str, first: f64) -> Event {
    serde_json::from_value(json!({
        "metadata": {"name": format!("e-{reason}-{first}")},
        "involvedObject": {"kind": "Pod", "fieldPath": format!("spec.containers{{{container}}}")},
        "reason": reason,
        "message": message,
        "firstTimestamp": at(first),
        "lastTimestamp": at(first),
    }))
    .unwrap()
}

fn present() -> Vec<Event> {
    vec![
        event(
            "Pulled",
            "hearth-drain",
            "Successfully pulled image \"gw\" in 9s (9s including waiting)",
            2.0,
        ),
        event(
            "Pulled",
            "vllm",
            "Container image \"vllm/vllm-openai:v0.11\" already present on machine",
            3.0,
        ),
        event("Created", "vllm", "Created container: vllm", 3.0),
        event("Started", "vllm", "Started container vllm", 4.0),
    ]
}

fn pulled() -> Vec<Event> {
    vec![
        event(
            "Pulling",
            "vllm",
            "Pulling image \"vllm/vllm-openai:v0.11\"",
            2.0,
        ),
        event(
            "Pulled",
            "vllm",
            "Successfully pulled image \"vllm/vllm-openai:v0.11\" in 1.1s (2.4s including waiting). Image size: 9000000000 bytes.",
            4.0,
        ),
    ]
}

fn phases(t: &Timeline) -> Value {
    serde_json::to_value(t.to_status().phases).unwrap()
}

#[rstest]
#[case::image_present(present(), Some(-0.5), json!({
    "scaleDecision": "500ms", "scheduled": "1s", "imagePull": "0s",
    "containersStarted": "3s", "modelReady": "30s", "total": "34.5s"}), Some(true))]
#[case::image_pulled(pulled(), None, json!({
    "scheduled": "1s", "imagePull": "2.4s",
    "containersStarted": "600ms", "modelReady": "30s", "total": "34s"}), Some(false))]
#[case::no_kubelet_events(vec![], None, json!({
    "scheduled": "1s", "containersStarted": "3s", "modelReady": "30s", "total": "34s"}), None)]
// KEDA's Event inside the pod's creation second (truncated to 0 s): the pod cannot have come
// first, the decision took less than the timestamps show.
#[case::scale_decision_in_the_creation_second(present(), Some(0.4), json!({
    "scaleDecision": "0s", "scheduled": "1s", "imagePull": "0s",
    "containersStarted": "3s", "modelReady": "30s", "total": "34s"}), Some(true))]
// KEDA's clock ahead of the apiserver's: the scale decision is left out, not negative.
#[case::scale_decision_after_creation(present(), Some(2.0), json!({
    "scheduled": "1s", "imagePull": "0s",
    "containersStarted": "3s", "modelReady": "30s", "total": "34s"}), Some(true))]
fn phases_from_pod_and_events(
    #[case] events: Vec<Event>,
    #[case] keda: Option<f64>,
    #[case] want: Value,
    #[case] image_present: Option<bool>,
) {
    let p = pod("a", Some(1.0), 4.0, Some(34.0));
    let t = timeline(&p, &events, keda.map(ts)).unwrap();
    assert_eq!(phases(&t), want);
    assert_eq!(t.image_present, image_present);
    assert_eq!(t.pod, "m-a");
    assert_eq!(t.node.as_deref(), Some("node-1"));
    assert_eq!(t.ready, ts(34.0));
}

#[test]
fn the_wait_for_devices_is_a_phase_of_its_own() {
    // Scheduled at 9 s; the scheduler refused it for its accelerator from 0.25 s (twice), and
    // once for CPU before that, which is no wait for devices.
    let mut p = pod("a", Some(9.0), 12.0, Some(42.0));
    p.spec.as_mut().unwrap().containers[0].resources = Some(
        serde_json::from_value(json!({"limits": {"hearth.dev/fake-gpu": "1", "cpu": "1"}}))
            .unwrap(),
    );
    let refused = |msg: &str, first: f64| {
        let mut e = event("FailedScheduling", "", msg, first);
        e.involved_object.field_path = None;
        e
    };
    let mut events = present();
    events.push(refused("0/1 nodes are available: 1 Insufficient cpu.", 0.1));
    events.push(refused(
        "0/1 nodes are available: 1 Insufficient hearth.dev/fake-gpu. preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.",
        0.25,
    ));
    events.push(refused(
        "0/1 nodes are available: 1 Insufficient hearth.dev/fake-gpu.",
        3.0,
    ));
    let t = timeline(&p, &events, None).unwrap();
    assert_eq!(
        phases(&t),
        json!({"waitingForDevices": "8.75s", "scheduled": "250ms", "imagePull": "0s",
            "containersStarted": "3s", "modelReady": "30s", "total": "42s"})
    );
    assert!(
        t.note().contains("waiting for devices 8.8s"),
        "{}",
        t.note()
    );
    assert!(t.phases().contains(&("waiting_for_devices", 8.75)));
}

#[test]
fn a_pulled_image_without_a_stated_duration_is_timed_by_its_events() {
    let events = vec![
        event("Pulling", "vllm", "Pulling image \"x\"", 2.0),
        event("Pulled", "vllm", "Successfully pulled image \"x\"", 12.0),
    ];
    let t = timeline(&pod("a", Some(1.0), 14.0, Some(44.0)), &events, None).unwrap();
    assert_eq!(t.image_pull, Some(Duration::from_secs(10)));
    assert_eq!(t.containers_started, Duration::from_secs(3));
}

#[rstest]
#[case::not_ready(pod("a", Some(1.0), 4.0, None))]
#[case::not_scheduled(pod("a", None, 4.0, Some(34.0)))]
fn no_timeline_before_the_pod_is_ready_and_scheduled(#[case] p: Pod) {
    assert_eq!(timeline(&p, &present(), None), None);
}

#[test]
fn a_deleting_pod_has_no_timeline() {
    let mut p = pod("a", Some(1.0), 4.0, Some(34.0));
    p.metadata.deletion_timestamp = Some(Time(ts(40.0)));
    assert_eq!(timeline(&p, &present(), None), None);
}

/// The node's clock behind the control plane's: the container "started" before it was
/// scheduled. That phase is 0, the others are measured as they are.
#[test]
fn clock_skew_makes_a_phase_zero_not_negative() {
    let t = timeline(&pod("a", Some(5.0), 3.0, Some(33.0)), &present(), None).unwrap();
    assert_eq!(t.scheduled, Duration::from_secs(5));
    assert_eq!(t.containers_started, Duration::ZERO);
    assert_eq!(t.model_ready, Duration::from_secs(30));
    assert_eq!(t.total, Duration::from_secs(33));
}

#[rstest]
#[case(
    "Successfully pulled image \"a\" in 1.2s (3.4s including waiting). Image size: 5 bytes.",
    Some(3400)
)]
#[case(
    "Successfully pulled image \"a\" in 1m2.5s (1m2.5s including waiting)",
    Some(62_500)
)]
#[case("Successfully pulled image \"a\" in 812.3ms", Some(812))]
#[case("Successfully pulled image \"a\" in 2.016514354s.", Some(2017))]
#[case("Container image \"a\" already present on machine", None)]
fn pull_durations_are_read_from_the_kubelets_message(#[case] msg: &str, #[case] ms: Option<u64>) {
    let got = pulled_duration(msg).map(|d| (d.as_nanos() + 500_000) / 1_000_000);
    assert_eq!(got, ms.map(u128::from));
}

#[test]
fn the_note_reads_like_the_timeline() {
    let t = timeline(
        &pod("a", Some(1.0), 4.0, Some(34.0)),
        &present(),
        Some(ts(-0.3)),
    )
    .unwrap();
    assert_eq!(
        t.note(),
        "0→1 in 34.3s: scale decision 0.3s, scheduled 1.0s, image present, containers started 3.0s, model ready 30.0s (pod m-a on node node-1)"
    );
    let names: Vec<&str> = t.phases().iter().map(|(n, _)| *n).collect();
    assert_eq!(
        names,
        [
            "scale_decision",
            "scheduled",
            "image_pull",
            "containers_started",
            "model_ready",
            "total"
        ]
    );
    let pulled = timeline(&pod("a", Some(1.0), 4.0, Some(34.0)), &pulled(), None).unwrap();
    assert!(
        pulled.note().contains("image pull 2.4s"),
        "{}",
        pulled.note()
    );
}

fn keda_event(first: f64, series_last: Option<f64>) -> Event {
    let mut e = json!({
        "metadata": {"name": "so.1"},
        "involvedObject": {"kind": "ScaledObject"},
        "reason": KEDA_ACTIVATED,
        "message": "Scaled apps/v1.Deployment ns/m from 0 to 1",
        "eventTime": at(first),
    });
    if let Some(l) = series_last {
        e["series"] = json!({"count": 2, "lastObservedTime": at(l)});
    }
    serde_json::from_value(e).unwrap()
}

#[test]
fn the_scale_decision_is_kedas_latest_activation_after_the_previous_one() {
    assert_eq!(
        scaler_activated_at(&[keda_event(-1.0, None)], None),
        Some(ts(-1.0))
    );
    // A series: its last observation.
    assert_eq!(
        scaler_activated_at(&[keda_event(-600.0, Some(-1.0))], Some(ts(-300.0))),
        Some(ts(-1.0))
    );
    // Only an Event of the previous activation (a series KEDA has not updated yet): unknown.
    assert_eq!(
        scaler_activated_at(&[keda_event(-600.0, None)], Some(ts(-300.0))),
        None
    );
    assert_eq!(scaler_activated_at(&[], None), None);
}

fn recorded(p: &Pod) -> Activation {
    timeline(p, &present(), None).unwrap().to_status()
}

#[test]
fn an_activation_is_the_first_ready_pod_and_is_recorded_once() {
    let now = ts(40.0);
    let a = pod("a", Some(1.0), 4.0, Some(34.0));
    let b = pod("b", Some(1.0), 4.0, Some(36.0));
    let loading = pod("c", Some(1.0), 4.0, None);
    // 0→1: the first ready pod.
    assert_eq!(activated([&loading, &b, &a], None, 0, now), Some(&a));
    // Nothing ready yet.
    assert_eq!(activated([&loading], None, 0, now), None);
    // Recorded: not again, and not the second pod of a 0→2 either.
    let last = recorded(&a);
    assert_eq!(activated([&a, &b], Some(&last), 0, now), None);
    assert_eq!(activated([&a], Some(&last), 1, ts(4000.0)), None);
    // The status already said 1 (Deployment ahead of the pod cache): still recorded while
    // recent, not when the pod has been ready for long (a controller upgrade meeting a
    // running service).
    assert_eq!(activated([&a], None, 1, now), Some(&a));
    assert_eq!(activated([&a], None, 1, ts(4000.0)), None);
}

#[test]
fn the_next_zero_to_one_is_a_new_activation_but_one_to_two_is_not() {
    let a = pod("a", Some(1.0), 4.0, Some(34.0));
    let last = recorded(&a);
    // Scaled to zero, a (deleted) gone; later d turns ready.
    let d = pod("d", Some(1.0), 4.0, Some(900.0));
    assert_eq!(activated([&d], Some(&last), 0, ts(901.0)), Some(&d));
    // a still ready and terminating while d turns ready: a no longer counts.
    let mut leaving = a.clone();
    leaving.metadata.deletion_timestamp = Some(Time(ts(800.0)));
    assert_eq!(
        activated([&leaving, &d], Some(&last), 0, ts(901.0)),
        Some(&d)
    );
    // 1→2: a is ready, so d is not first.
    assert_eq!(activated([&a, &d], Some(&last), 1, ts(901.0)), None);
    // A pod that turned Ready before the recorded one cannot be a later activation.
    let older = pod("e", Some(1.0), 4.0, Some(20.0));
    assert_eq!(activated([&older], Some(&last), 0, ts(40.0)), None);
}

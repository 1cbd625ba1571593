use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::{
    api::core::v1::{
        Affinity, Container, Node, NodeAffinity, NodeSelector, NodeSelectorRequirement,
        NodeSelectorTerm, NodeSpec, NodeStatus, Pod, PodCondition, PodSpec, PodStatus,
        ResourceRequirements, Taint, Toleration,
    },
    apimachinery::pkg::{api::resource::Quantity, apis::meta::v1::Time},
};
use kube::api::ObjectMeta;
use rstest::rstest;

use super::*;

const GPU: &str = "hearth.dev/fake-gpu";

fn pod(name: &str, gpus: i64) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            containers: vec![Container {
                name: "vllm".to_owned(),
                resources: Some(ResourceRequirements {
                    limits: Some(BTreeMap::from([
                        (GPU.to_owned(), Quantity(gpus.to_string())),
                        ("cpu".to_owned(), Quantity("1".to_owned())),
                    ])),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".to_owned()),
            ..Default::default()
        }),
    }
}

fn unschedulable(mut p: Pod, message: &str) -> Pod {
    p.status = Some(PodStatus {
        phase: Some("Pending".to_owned()),
        conditions: Some(vec![PodCondition {
            type_: "PodScheduled".to_owned(),
            status: "False".to_owned(),
            reason: Some("Unschedulable".to_owned()),
            message: Some(message.to_owned()),
            ..Default::default()
        }]),
        ..Default::default()
    });
    p
}

const NO_GPU: &str = "0/1 nodes are available: 1 Insufficient hearth.dev/fake-gpu. preemption: 0/1 nodes are available: 1 No preemption victims found for incoming pod.";

#[test]
fn the_schedulers_verdict_on_an_extended_resource_is_a_wait_for_devices() {
    let w = waiting_for(&unschedulable(pod("p", 2), NO_GPU)).unwrap();
    assert_eq!(w.need, BTreeMap::from([(GPU.to_owned(), 2)]));
    assert_eq!(w.pod, "p");
    assert!(w.message.contains("Insufficient hearth.dev/fake-gpu"));
}

#[rstest]
#[case::cpu_only("0/1 nodes are available: 1 Insufficient cpu.")]
#[case::selector("0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector.")]
#[case::another_accelerator("0/1 nodes are available: 1 Insufficient nvidia.com/gpu.")]
fn other_verdicts_are_not(#[case] message: &str) {
    assert_eq!(waiting_for(&unschedulable(pod("p", 1), message)), None);
}

#[test]
fn a_scheduled_or_deleted_pod_does_not_wait() {
    assert_eq!(waiting_for(&pod("p", 1)), None);
    let mut deleted = unschedulable(pod("p", 1), NO_GPU);
    deleted.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    assert_eq!(waiting_for(&deleted), None);
}

#[rstest]
#[case("nvidia.com/gpu", true)]
#[case("huawei.com/Ascend910", true)]
#[case("hearth.dev/fake-gpu", true)]
#[case("cpu", false)]
#[case("memory", false)]
#[case("hugepages-2Mi", false)]
#[case("kubernetes.io/something", false)]
#[case("requests.nvidia.com/gpu", false)]
fn extended_resources_are_kubernetes_own_definition(#[case] name: &str, #[case] extended: bool) {
    assert_eq!(is_extended(name), extended);
}

fn node(name: &str, gpus: i64) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(BTreeMap::from([("pool".to_owned(), "a10".to_owned())])),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            allocatable: Some(BTreeMap::from([
                (GPU.to_owned(), Quantity(gpus.to_string())),
                ("cpu".to_owned(), Quantity("8".to_owned())),
            ])),
            ..Default::default()
        }),
    }
}

fn taint(key: &str, effect: &str) -> Taint {
    Taint {
        key: key.to_owned(),
        value: Some("true".to_owned()),
        effect: effect.to_owned(),
        time_added: None,
    }
}

fn affinity(key: &str, operator: &str, values: &[&str]) -> Affinity {
    Affinity {
        node_affinity: Some(NodeAffinity {
            required_during_scheduling_ignored_during_execution: Some(NodeSelector {
                node_selector_terms: vec![NodeSelectorTerm {
                    match_expressions: Some(vec![NodeSelectorRequirement {
                        key: key.to_owned(),
                        operator: operator.to_owned(),
                        values: Some(values.iter().map(|v| (*v).to_owned()).collect()),
                    }]),
                    match_fields: None,
                }],
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[rstest]
#[case::plain(|_: &mut PodSpec, _: &mut Node| {}, None)]
#[case::selector_matches(|p: &mut PodSpec, _: &mut Node| { p.node_selector = Some(BTreeMap::from([("pool".to_owned(), "a10".to_owned())])); }, None)]
#[case::selector_differs(|p: &mut PodSpec, _: &mut Node| { p.node_selector = Some(BTreeMap::from([("pool".to_owned(), "h100".to_owned())])); }, Some("nodeSelector pool=h100"))]
#[case::affinity_in(|p: &mut PodSpec, _: &mut Node| { p.affinity = Some(affinity("pool", "In", &["a10", "l4"])); }, None)]
#[case::affinity_not_in(|p: &mut PodSpec, _: &mut Node| { p.affinity = Some(affinity("pool", "NotIn", &["a10"])); }, Some("node affinity"))]
#[case::affinity_exists(|p: &mut PodSpec, _: &mut Node| { p.affinity = Some(affinity("zone", "Exists", &[])); }, Some("node affinity"))]
#[case::taint_untolerated(|_: &mut PodSpec, n: &mut Node| { n.spec.as_mut().unwrap().taints = Some(vec![taint("gpu", "NoSchedule")]); }, Some("taint gpu=true:NoSchedule"))]
#[case::taint_prefer_is_no_bar(|_: &mut PodSpec, n: &mut Node| { n.spec.as_mut().unwrap().taints = Some(vec![taint("gpu", "PreferNoSchedule")]); }, None)]
#[case::taint_tolerated_exists(|p: &mut PodSpec, n: &mut Node| {
    n.spec.as_mut().unwrap().taints = Some(vec![taint("gpu", "NoSchedule")]);
    p.tolerations = Some(vec![Toleration { key: Some("gpu".to_owned()), operator: Some("Exists".to_owned()), ..Default::default() }]);
}, None)]
#[case::taint_tolerated_equal(|p: &mut PodSpec, n: &mut Node| {
    n.spec.as_mut().unwrap().taints = Some(vec![taint("gpu", "NoExecute")]);
    p.tolerations = Some(vec![Toleration { key: Some("gpu".to_owned()), value: Some("true".to_owned()), effect: Some("NoExecute".to_owned()), ..Default::default() }]);
}, None)]
#[case::taint_other_value(|p: &mut PodSpec, n: &mut Node| {
    n.spec.as_mut().unwrap().taints = Some(vec![taint("gpu", "NoSchedule")]);
    p.tolerations = Some(vec![Toleration { key: Some("gpu".to_owned()), value: Some("false".to_owned()), ..Default::default() }]);
}, Some("does not tolerate"))]
#[case::cordoned(|_: &mut PodSpec, n: &mut Node| { n.spec.as_mut().unwrap().unschedulable = Some(true); }, Some("cordoned"))]
fn the_waiting_pod_fits_a_node_as_the_scheduler_decides(
    #[case] change: fn(&mut PodSpec, &mut Node),
    #[case] refused: Option<&str>,
) {
    let mut p = pod("p", 1);
    let mut n = node("n1", 4);
    change(p.spec.as_mut().unwrap(), &mut n);
    match (node_fit(&p, &n), refused) {
        (Ok(()), None) => {}
        (Err(e), Some(part)) => assert!(e.contains(part), "{e}"),
        (got, want) => panic!("got {got:?}, want a refusal naming {want:?}"),
    }
}

#[test]
fn capacity_counts_requests_and_what_terminating_pods_free() {
    let waiting = pod("w", 1);
    let mut going = pod("going", 1);
    going.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
    let mut done = pod("done", 1);
    done.status.as_mut().unwrap().phase = Some("Succeeded".to_owned());
    let pods = [pod("a", 2), going, done];
    let cap = Capacity::of(&waiting, &node("n1", 4), &pods, |_| false);
    assert_eq!(cap.free, BTreeMap::from([(GPU.to_owned(), 1)]));
    assert_eq!(cap.freeing, BTreeMap::from([(GPU.to_owned(), 1)]));
    assert_eq!(cap.fit, Ok(()));
    // Freed for another waiting pod: still requested, not freeing for this one.
    let claimed = Capacity::of(&waiting, &node("n1", 4), &pods, |p| {
        p.metadata.name.as_deref() == Some("going")
    });
    assert_eq!(claimed.free, BTreeMap::from([(GPU.to_owned(), 1)]));
    assert_eq!(claimed.freeing.get(GPU), None);
}

const MIN: Duration = Duration::from_secs(60);

/// An idle holder of one device on `node`: priority 0, resident 10 minutes, idle `idle_s`.
fn holder(key: &str, node: &str, idle_s: u64) -> Holder {
    Holder {
        key: key.to_owned(),
        priority: 0,
        pin: None,
        resident: Some(Duration::from_secs(600)),
        min_residency: MIN,
        demand: Some(Ok(Demand {
            pending: 0,
            idle: Duration::from_secs(idle_s),
        })),
        handing_over: false,
        pods: vec![(node.to_owned(), BTreeMap::from([(GPU.to_owned(), 1)]))],
    }
}

fn full(node: &str) -> Capacity {
    Capacity {
        node: node.to_owned(),
        fit: Ok(()),
        free: BTreeMap::from([(GPU.to_owned(), 0)]),
        freeing: BTreeMap::new(),
    }
}

fn need(n: i64) -> BTreeMap<String, i64> {
    BTreeMap::from([(GPU.to_owned(), n)])
}

#[rstest]
#[case::eligible(|_: &mut Holder| {}, None)]
#[case::handing_over(|h: &mut Holder| h.handing_over = true, Some("already handing"))]
#[case::pinned(|h: &mut Holder| h.pin = Some("spec.scaling.min is 1".to_owned()), Some("pinned (spec.scaling.min is 1)"))]
#[case::higher_priority(|h: &mut Holder| h.priority = 6, Some("priority 6 above 5"))]
#[case::equal_priority_idle(|h: &mut Holder| h.priority = 5, None)]
#[case::loading(|h: &mut Holder| h.resident = None, Some("not Ready"))]
#[case::young(|h: &mut Holder| h.resident = Some(Duration::from_secs(30)), Some("served less than its minResidency 1m0s"))]
#[case::residency_just_met(|h: &mut Holder| h.resident = Some(MIN), None)]
#[case::demand_unknown(|h: &mut Holder| h.demand = Some(Err("gateway 198.18.0.9 did not answer".to_owned())), Some("demand is unknown"))]
#[case::demand_not_asked(|h: &mut Holder| h.demand = None, Some("not asked"))]
#[case::serving(|h: &mut Holder| h.demand = Some(Ok(Demand { pending: 1, idle: Duration::ZERO })), Some("is serving (a request in flight"))]
#[case::serving_at_low_priority(|h: &mut Holder| { h.priority = -10; h.demand = Some(Ok(Demand { pending: 2, idle: Duration::ZERO })); }, Some("is serving"))]
fn who_may_hand_over(#[case] change: fn(&mut Holder), #[case] why: Option<&str>) {
    let mut h = holder("ns/a", "n1", 100);
    change(&mut h);
    match (ineligible(&h, 5), why) {
        (None, None) => {}
        (Some(e), Some(part)) => assert!(e.contains(part), "{e}"),
        (got, want) => panic!("got {got:?}, want {want:?}"),
    }
}

fn victims(d: &Decision) -> Vec<&str> {
    match d {
        Decision::HandOver { victims, .. } => victims.iter().map(String::as_str).collect(),
        other => panic!("no handover: {other:?}"),
    }
}

#[test]
fn the_least_recently_used_goes_first_among_equals() {
    let holders = [
        holder("ns/recent", "n1", 10),
        holder("ns/oldest", "n1", 900),
        holder("ns/middle", "n1", 300),
    ];
    assert_eq!(
        victims(&choose(&need(1), 0, &[full("n1")], &holders)),
        ["ns/oldest"]
    );
}

#[test]
fn the_lowest_priority_goes_first_whatever_its_recency() {
    let mut low = holder("ns/low", "n1", 1);
    low.priority = -5;
    let holders = [holder("ns/idle-long", "n1", 900), low];
    assert_eq!(
        victims(&choose(&need(1), 0, &[full("n1")], &holders)),
        ["ns/low"]
    );
}

#[test]
fn a_busy_model_is_never_chosen() {
    let mut busy = holder("ns/busy", "n1", 0);
    busy.priority = -100;
    busy.demand = Some(Ok(Demand {
        pending: 1,
        idle: Duration::ZERO,
    }));
    let holders = [busy, holder("ns/idle", "n1", 5)];
    assert_eq!(
        victims(&choose(&need(1), 0, &[full("n1")], &holders)),
        ["ns/idle"]
    );
    let only_busy = [holders[0].clone()];
    match choose(&need(1), 0, &[full("n1")], &only_busy) {
        Decision::NotPossible(why) => assert!(why.contains("ns/busy is serving"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn two_devices_take_two_victims_on_one_node() {
    let holders = [
        holder("ns/a", "n1", 100),
        holder("ns/b", "n2", 500),
        holder("ns/c", "n1", 200),
    ];
    let d = choose(&need(2), 0, &[full("n1"), full("n2")], &holders);
    assert_eq!(
        d,
        Decision::HandOver {
            node: "n1".to_owned(),
            victims: vec!["ns/c".to_owned(), "ns/a".to_owned()]
        }
    );
}

#[test]
fn a_node_the_pod_does_not_fit_gives_nothing() {
    let mut tainted = full("n1");
    tainted.fit = Err("node n1 has taint gpu=true:NoSchedule the pod does not tolerate".to_owned());
    let holders = [holder("ns/a", "n1", 900), holder("ns/b", "n2", 5)];
    assert_eq!(
        victims(&choose(
            &need(1),
            0,
            &[tainted.clone(), full("n2")],
            &holders
        )),
        ["ns/b"]
    );
    match choose(&need(1), 0, &[tainted], &holders[..1]) {
        Decision::NotPossible(why) => assert!(why.contains("taint"), "{why}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn the_node_with_the_cheapest_victims_wins() {
    let mut high = holder("ns/high", "n1", 900);
    high.priority = 3;
    let holders = [high, holder("ns/low", "n2", 5)];
    assert_eq!(
        victims(&choose(&need(1), 5, &[full("n1"), full("n2")], &holders)),
        ["ns/low"]
    );
}

#[test]
fn devices_being_freed_or_free_mean_waiting() {
    let mut freeing = full("n1");
    freeing.freeing.insert(GPU.to_owned(), 1);
    let holders = [holder("ns/a", "n1", 900)];
    assert!(matches!(
        choose(&need(1), 0, &[freeing], &holders),
        Decision::Wait(m) if m.contains("being freed")
    ));
    let mut free = full("n1");
    free.free.insert(GPU.to_owned(), 1);
    assert!(matches!(
        choose(&need(1), 0, &[free], &holders),
        Decision::Wait(m) if m.contains("free")
    ));
}

#[test]
fn too_few_eligible_devices_say_why() {
    let mut young = holder("ns/young", "n1", 0);
    young.resident = Some(Duration::from_secs(5));
    let holders = [holder("ns/a", "n1", 900), young];
    match choose(&need(2), 0, &[full("n1")], &holders) {
        Decision::NotPossible(why) => {
            assert!(why.contains("ns/young has served less than"), "{why}");
            assert!(why.contains("too few devices"), "{why}");
        }
        other => panic!("{other:?}"),
    }
}

fn service(min: i32, windows: &[(&str, &str)]) -> LLMService {
    let mut svc: LLMService = serde_json::from_value(serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMService",
        "metadata": {"name": "m"},
        "spec": {"model": {"source": {"uri": "hf://a/b"}}},
    }))
    .unwrap();
    svc.spec.scaling.min = min;
    svc.spec.scaling.warm_windows = windows
        .iter()
        .map(|(start, end)| hearth_crds::llmservice::WarmWindow {
            timezone: "UTC".to_owned(),
            start: (*start).to_owned(),
            end: (*end).to_owned(),
            replicas: 1,
        })
        .collect();
    svc
}

#[test]
fn scaling_min_and_an_open_window_pin() {
    // 2026-12-07 (a Monday) 09:00 UTC.
    let monday_9 = 1_796_634_000;
    assert_eq!(pin(&service(0, &[]), monday_9), None);
    assert_eq!(
        pin(&service(1, &[]), monday_9).as_deref(),
        Some("spec.scaling.min is 1")
    );
    let business = [("0 8 * * MON-FRI", "0 18 * * MON-FRI")];
    assert_eq!(
        pin(&service(0, &business), monday_9).as_deref(),
        Some("spec.scaling.warmWindows[0] is open")
    );
    assert_eq!(pin(&service(0, &business), monday_9 + 10 * 3600), None);
}

use hearth_crds::metering::{EndpointMetering, MeteringReport, ServiceMetering, TenantMetering};

use super::*;

const S: i64 = 1000;

fn pod(uid: &str, devices: u32, scheduled: i64, ready: Option<i64>) -> PodNow {
    PodNow {
        uid: uid.to_owned(),
        name: uid.to_owned(),
        devices,
        scheduled_ms: Some(scheduled),
        ready_ms: ready,
        ip: Some(format!("198.18.0.{}", uid.len())),
    }
}

fn tenant(name: &str, requests: u64, tokens: u64, cold: u64) -> TenantMetering {
    TenantMetering {
        tenant: name.to_owned(),
        requests,
        tokens,
        cold_requests: cold,
    }
}

fn report(
    instance: &str,
    tenants: Vec<TenantMetering>,
    endpoints: Vec<(&str, bool, f64)>,
) -> (String, ServiceMetering) {
    (
        instance.to_owned(),
        ServiceMetering {
            service: String::new(),
            tenants,
            endpoints: endpoints
                .into_iter()
                .map(|(a, serving, busy)| EndpointMetering {
                    address: a.to_owned(),
                    serving,
                    busy_seconds: busy,
                })
                .collect(),
        },
    )
}

fn obs(now: i64, pods: Vec<PodNow>, gateways: Vec<(String, ServiceMetering)>) -> Observation {
    Observation {
        now_ms: now,
        pods,
        gone_ms: BTreeMap::new(),
        gateways: Some(gateways),
        warm_window: false,
        owner: "platform".to_owned(),
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-6
}

#[test]
fn a_cold_start_is_charged_to_who_waited_and_serving_by_tokens() {
    let mut l = new_ledger(0);
    // Tenant a arrives cold; the pod is scheduled at 2 s.
    advance(
        &mut l,
        &obs(
            S,
            vec![],
            vec![report("g1", vec![tenant("a", 0, 0, 1)], vec![])],
        ),
    );
    assert_eq!(l.cold.get("a"), Some(&1));
    // Scheduled at 2 s, Ready at 8 s; 1 device.
    let c = advance(
        &mut l,
        &obs(
            10 * S,
            vec![pod("p", 1, 2 * S, Some(8 * S))],
            vec![report(
                "g1",
                vec![tenant("a", 1, 30, 1), tenant("b", 1, 10, 0)],
                vec![("198.18.0.1:8000", true, 1.0)],
            )],
        ),
    );
    // 6 s cold to a; 2 s ready: 1 s serving by tokens (a 3/4, b 1/4), 1 s idle to the owner.
    assert!(close(c["a"].cold_start, 6.0));
    assert!(close(c["a"].serving, 0.75));
    assert!(close(c["b"].serving, 0.25));
    assert!(close(c["platform"].idle, 1.0));
    assert!(close(charges_total(&c), 8.0));
    // An engine served: the cold start's waiters are settled.
    assert!(l.cold.is_empty());
}

#[test]
fn nobody_waiting_charges_the_owner_and_devices_multiply() {
    let mut l = new_ledger(0);
    let c = advance(&mut l, &obs(10 * S, vec![pod("p", 2, 0, None)], vec![]));
    assert!(close(c["platform"].cold_start, 20.0));
    assert_eq!(c.len(), 1);
}

#[test]
fn sleeping_and_warm_windows_are_the_owners() {
    let mut l = new_ledger(0);
    advance(&mut l, &obs(0, vec![pod("p", 1, 0, Some(0))], vec![]));
    // Every replica that discovered it has it out of its serving set: asleep.
    let asleep = vec![
        report("g1", vec![], vec![("198.18.0.1:8000", false, 0.0)]),
        report("g2", vec![], vec![("198.18.0.1:8000", false, 0.0)]),
    ];
    let c = advance(&mut l, &obs(5 * S, vec![pod("p", 1, 0, Some(0))], asleep));
    assert!(close(c["platform"].sleeping, 5.0));
    // One replica woke it: awake; no request, a window open.
    let mut o = obs(
        10 * S,
        vec![pod("p", 1, 0, Some(0))],
        vec![
            report("g1", vec![], vec![("198.18.0.1:8000", true, 0.0)]),
            report("g2", vec![], vec![("198.18.0.1:8000", false, 0.0)]),
        ],
    );
    o.warm_window = true;
    let c = advance(&mut l, &o);
    assert!(close(c["platform"].warm_window, 5.0));
}

#[test]
fn a_gone_pod_is_charged_until_it_went_and_forgotten() {
    let mut l = new_ledger(0);
    advance(&mut l, &obs(5 * S, vec![pod("p", 1, 0, Some(0))], vec![]));
    let mut o = obs(10 * S, vec![], vec![]);
    o.gone_ms.insert("p".to_owned(), 7 * S);
    let c = advance(&mut l, &o);
    assert!(close(charges_total(&c), 2.0));
    assert!(l.pods.is_empty());
    assert!(close(charges_total(&l.totals), 7.0));
    // Gone without a recorded time: charged until now.
    advance(
        &mut l,
        &obs(15 * S, vec![pod("q", 1, 14 * S, None)], vec![]),
    );
    let c = advance(&mut l, &obs(20 * S, vec![], vec![]));
    assert!(close(charges_total(&c), 5.0));
}

#[test]
fn a_gateway_restart_counts_from_zero_and_a_smaller_count_is_a_reset() {
    let mut l = new_ledger(0);
    let p = || vec![pod("p", 1, 0, Some(0))];
    let ep = |busy| vec![("198.18.0.1:8000", true, busy)];
    advance(
        &mut l,
        &obs(
            5 * S,
            p(),
            vec![report("g1", vec![tenant("a", 5, 500, 0)], ep(5.0))],
        ),
    );
    // Same instance: only the difference (b's 100 tokens and a's 0) counts.
    let c = advance(
        &mut l,
        &obs(
            10 * S,
            p(),
            vec![report(
                "g1",
                vec![tenant("a", 5, 500, 0), tenant("b", 1, 100, 0)],
                ep(7.0),
            )],
        ),
    );
    assert!(close(c["b"].serving, 2.0));
    assert!(!c.contains_key("a"));
    // A new instance (restart): its counts are all new.
    let c = advance(
        &mut l,
        &obs(
            15 * S,
            p(),
            vec![report("g2", vec![tenant("a", 1, 40, 0)], ep(1.0))],
        ),
    );
    assert!(close(c["a"].serving, 1.0));
    assert!(l.gateways.contains_key("g2") && !l.gateways.contains_key("g1"));
    // Busy time is at most the tick.
    let c = advance(
        &mut l,
        &obs(
            20 * S,
            p(),
            vec![report("g2", vec![tenant("a", 2, 80, 0)], ep(60.0))],
        ),
    );
    assert!(close(c["a"].serving, 5.0));
}

#[test]
fn unreadable_gateways_leave_the_sum_whole() {
    let mut l = new_ledger(0);
    let mut o = obs(10 * S, vec![pod("p", 1, 0, Some(4 * S))], vec![]);
    o.gateways = None;
    let c = advance(&mut l, &o);
    assert!(close(c["platform"].cold_start, 4.0));
    assert!(close(c["platform"].idle, 6.0));
}

#[test]
fn a_pod_new_to_the_ledger_counts_from_its_scheduling() {
    // The controller was down while the pod started: the gap is charged on its return.
    let mut l = new_ledger(0);
    l.at_ms = 100 * S;
    let c = advance(
        &mut l,
        &obs(130 * S, vec![pod("p", 1, 90 * S, Some(110 * S))], vec![]),
    );
    assert!(close(c["platform"].cold_start, 20.0));
    assert!(close(c["platform"].idle, 20.0));
}

#[test]
fn windows_read_the_buckets_and_old_minutes_roll_into_hours() {
    let mut l = new_ledger(0);
    let p = || vec![pod("p", 1, 0, Some(0))];
    let mut t = 0;
    // Three hours, a tick a minute.
    while t < 3 * HOUR {
        t += MINUTE;
        advance(&mut l, &obs(t, p(), vec![]));
    }
    assert!(l.minutes.len() <= 121, "{}", l.minutes.len());
    assert!(!l.hours.is_empty());
    assert!(close(charges_total(&l.totals), 3.0 * 3600.0));
    // The last hour: 60 minute buckets of 60 s.
    assert!(close(
        charges_total(&window(&l, t - HOUR + 1, t + 1)),
        3600.0
    ));
    // Everything: the totals.
    assert!(close(charges_total(&window(&l, 0, i64::MAX)), 3.0 * 3600.0));
    // Buckets cover all but what the totals add (none here).
    let all: f64 = l
        .hours
        .iter()
        .chain(&l.minutes)
        .map(|b| charges_total(&b.charges))
        .sum();
    assert!(close(all, 3.0 * 3600.0));
    // The ledger survives its JSON form.
    let back: Ledger = serde_json::from_str(&serde_json::to_string(&l).unwrap()).unwrap();
    assert_eq!(back, l);
}

#[test]
fn an_own_gateways_only_entry_is_the_service_whatever_its_key() {
    let r = |key: &str| MeteringReport {
        instance: "g1".to_owned(),
        services: vec![ServiceMetering {
            service: key.to_owned(),
            ..ServiceMetering::default()
        }],
    };
    assert_eq!(reports_of(&[r("ns/a")], "").len(), 1);
    assert_eq!(reports_of(&[r("")], "").len(), 1);
    // A shared gateway's entries are picked by key.
    assert_eq!(reports_of(&[r("ns/a")], "ns/b").len(), 0);
    assert_eq!(reports_of(&[r("ns/b")], "ns/b").len(), 1);
}

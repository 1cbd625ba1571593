use std::time::Duration;

use super::*;

fn ready(n: usize) -> EndpointSet {
    EndpointSet::fixed((0..n).map(|i| format!("10.0.0.{i}:8000").parse().unwrap()))
}

fn claim(tenant: TenantId, priority: i32) -> Claim {
    Claim { tenant, priority }
}

fn dispatched(e: Entry) -> Permit {
    match e {
        Entry::Dispatched(p) => p,
        Entry::Queued(_) => panic!("queued"),
    }
}

fn queued(e: Entry) -> Ticket {
    match e {
        Entry::Queued(t) => t,
        Entry::Dispatched(_) => panic!("dispatched"),
    }
}

/// The tenants of the waiters, in the order they are dispatched one by one.
async fn order(q: &Arc<FairQueue>, tickets: Vec<Ticket>, first: Permit, tokens: f64) -> Vec<u32> {
    let mut pending: Vec<_> = tickets
        .into_iter()
        .map(|t| Box::pin(t.wait(far())))
        .collect();
    let mut out = Vec::new();
    let mut running = first;
    while !pending.is_empty() {
        drop(running);
        let (permit, i, _) = futures::future::select_all(pending.iter_mut()).await;
        drop(pending.remove(i));
        let permit = permit.expect("dispatched");
        permit.charge(tokens);
        out.push(permit.claim().tenant);
        running = permit;
    }
    assert_eq!(q.counts(), (0, 1));
    out
}

fn far() -> Instant {
    Instant::now() + Duration::from_secs(30)
}

#[test]
fn in_flight_is_bounded_by_the_concurrency_of_each_ready_replica() {
    let q = FairQueue::new(2, ready(2));
    let held: Vec<_> = (0..4)
        .map(|_| dispatched(q.enter(claim(0, 0), 1.0)))
        .collect();
    let waiting = queued(q.enter(claim(0, 0), 1.0));
    assert_eq!(q.counts(), (1, 4));
    drop(held);
    // The waiter took one of the freed places.
    assert_eq!(q.counts(), (0, 1));
    drop(waiting);
    assert_eq!(q.counts(), (0, 0));
}

#[tokio::test]
async fn a_higher_band_goes_first_whatever_came_before() {
    let q = FairQueue::new(1, ready(1));
    let first = dispatched(q.enter(claim(0, 0), 0.0));
    let low: Vec<_> = (0..3).map(|_| queued(q.enter(claim(0, 0), 0.0))).collect();
    let high = queued(q.enter(claim(1, 10), 0.0));
    let mut tickets = vec![high];
    tickets.extend(low);
    let got = order(&q, tickets, first, 1.0).await;
    assert_eq!(got, [1, 0, 0, 0]);
}

#[tokio::test]
async fn inside_a_band_the_tenant_served_fewer_tokens_goes_next() {
    let q = FairQueue::new(1, ready(1));
    let first = dispatched(q.enter(claim(0, 0), 0.0));
    // Tenant 0 queues ten, tenant 1 two after them: they alternate once both wait.
    let mut tickets: Vec<_> = (0..10).map(|_| queued(q.enter(claim(0, 0), 0.0))).collect();
    tickets.extend((0..2).map(|_| queued(q.enter(claim(1, 0), 0.0))));
    let got = order(&q, tickets, first, 100.0).await;
    let ones: Vec<_> = got
        .iter()
        .enumerate()
        .filter(|(_, t)| **t == 1)
        .map(|(i, _)| i)
        .collect();
    assert!(
        ones[1] <= 4,
        "tenant 1 was not kept behind tenant 0: {got:?}"
    );
}

#[test]
fn a_tenant_back_from_idle_is_lifted_to_the_waiting_tenants_counter() {
    let q = FairQueue::new(1, ready(1));
    let first = dispatched(q.enter(claim(0, 0), 0.0));
    first.charge(1000.0);
    let a = queued(q.enter(claim(0, 0), 0.0));
    // Tenant 1 never ran: it starts where tenant 0 stands, not at 0.
    let b = queued(q.enter(claim(1, 0), 0.0));
    assert_eq!(q.counter(1), q.counter(0));
    drop((a, b, first));
}

#[tokio::test]
async fn cold_requests_wait_until_a_replica_turns_ready() {
    let backends = EndpointSet::new();
    let q = FairQueue::new(1, backends.clone());
    let t = queued(q.enter(claim(0, 0), 0.0));
    let later = backends.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(20)).await;
        later.replace(["10.0.0.1:8000".parse().unwrap()]);
    });
    let permit = t.wait(far()).await.expect("dispatched once ready");
    assert_eq!(q.counts(), (0, 1));
    drop(permit);
    assert_eq!(q.counts(), (0, 0));
}

#[tokio::test]
async fn a_waiter_past_its_deadline_or_gone_gives_its_place_back() {
    let q = FairQueue::new(1, ready(1));
    let first = dispatched(q.enter(claim(0, 0), 0.0));
    let t = queued(q.enter(claim(0, 0), 0.0));
    assert!(
        t.wait(Instant::now() + Duration::from_millis(10))
            .await
            .is_none()
    );
    assert_eq!(q.counts(), (0, 1));
    // Dispatched while nobody received it: the permit frees its place again.
    let t = queued(q.enter(claim(0, 0), 0.0));
    drop(first);
    assert_eq!(q.counts(), (0, 1));
    drop(t);
    assert_eq!(q.counts(), (0, 0));
    // The next one is dispatched at once.
    let again = dispatched(q.enter(claim(0, 0), 0.0));
    drop(again);
}

#[test]
fn gateway_replicas_share_the_bound() {
    let gateways = Arc::new(AtomicUsize::new(2));
    let q = FairQueue::with_tenants(3, ready(1), gateways.clone(), false);
    // 3 per engine over 2 gateways: 2 here (rounded up).
    let held: Vec<_> = (0..2)
        .map(|_| dispatched(q.enter(claim(0, 0), 0.0)))
        .collect();
    let t = queued(q.enter(claim(0, 0), 0.0));
    gateways.store(1, std::sync::atomic::Ordering::Relaxed);
    q.refresh();
    assert_eq!(q.counts(), (0, 3));
    drop((held, t));
}

#[tokio::test]
async fn with_several_tenants_one_keeps_off_the_headroom() {
    let q = FairQueue::with_tenants(4, ready(1), Arc::new(AtomicUsize::new(1)), true);
    // Tenant 0 floods: 3 of the 4 places (headroom 1), the rest wait.
    let held: Vec<_> = (0..3)
        .map(|_| dispatched(q.enter(claim(0, 0), 0.0)))
        .collect();
    let flood: Vec<_> = (0..10).map(|_| queued(q.enter(claim(0, 0), 0.0))).collect();
    assert_eq!(q.counts(), (10, 3));
    // Tenant 1 is served at once, ahead of the flood's backlog.
    let t = queued(q.enter(claim(1, 0), 0.0));
    let p = t.wait(far()).await.expect("dispatched at once");
    assert_eq!(q.counts(), (10, 4));
    drop((p, held, flood));
    // Alone in the table, a tenant may take every place.
    let q = FairQueue::new(4, ready(1));
    let all: Vec<_> = (0..4)
        .map(|_| dispatched(q.enter(claim(0, 0), 0.0)))
        .collect();
    drop(all);
}

#[test]
fn a_burst_behind_a_flood_shares_the_places_it_frees() {
    let q = FairQueue::new(4, ready(1));
    let mut running: std::collections::VecDeque<Permit> = (0..4)
        .map(|_| dispatched(q.enter(claim(0, 0), 10.0)))
        .collect();
    let mut waiting: Vec<(u32, Ticket)> = (0..20)
        .map(|_| (0, queued(q.enter(claim(0, 0), 10.0))))
        .collect();
    waiting.extend((0..5).map(|_| (1, queued(q.enter(claim(1, 0), 10.0)))));
    let mut order = Vec::new();
    while order.len() < 10 {
        // A token streams on every request in flight, then the oldest one ends.
        for p in &running {
            p.charge(1.0);
        }
        drop(running.pop_front());
        let mut i = 0;
        while i < waiting.len() {
            if let Ok(p) = waiting[i].1.rx.try_recv() {
                order.push(waiting[i].0);
                running.push_back(p);
                waiting.remove(i);
            } else {
                i += 1;
            }
        }
    }
    // Both backlogged: tenant 1 is never kept behind more than one of tenant 0's.
    let b_last = order.iter().rposition(|t| *t == 1).unwrap();
    assert!(b_last <= 9, "tenant 1 kept behind the flood: {order:?}");
    assert!(
        order.windows(3).all(|w| w.contains(&1)),
        "tenant 1 waited through two dispatches in a row: {order:?}"
    );
}

#[tokio::test]
async fn a_replica_turning_ready_before_the_wait_starts_is_seen() {
    let set = EndpointSet::new();
    let q = FairQueue::new(1, set.clone());
    let t = queued(q.enter(claim(0, 0), 1.0));
    set.replace(["10.0.0.1:8000".parse().unwrap()]);
    let p = t.wait(Instant::now() + Duration::from_millis(300)).await;
    assert!(p.is_some(), "dispatched once the replica is seen");
}

#[test]
fn small_bounds_keep_no_headroom() {
    assert_eq!(
        (headroom(2), headroom(3), headroom(4), headroom(256)),
        (0, 0, 1, 16)
    );
    let q = FairQueue::with_tenants(2, ready(1), Arc::new(AtomicUsize::new(1)), true);
    let both: Vec<_> = (0..2)
        .map(|_| dispatched(q.enter(claim(0, 0), 0.0)))
        .collect();
    drop(both);
}

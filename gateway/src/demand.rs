//! Demand: how many requests want a backend, here and on the peer gateway replicas.
//!
//! - **pending**: requests admitted by this replica and not finished (held for a cold backend,
//!   or in flight to a warm one). Bounded by `maxQueue`: admission beyond it is refused.
//! - **local demand**: `pending`, or at least 1 while the activation lease is held (a cold
//!   request arrived and the backend has not been ready for the grace period since, nor has
//!   the activation timeout passed), so a client that got a 503 still wakes the model.
//! - **total demand**: local demand plus every peer replica's local demand. When aggregation is
//!   on and a peer's value is not known (not yet received, connection lost, discovery
//!   forbidden), the total is *unknown* and readers get a [`DemandUnknown`] error rather than a
//!   silently low number.
//!
//! The total is capped at `i64::MAX` (saturating), so every reader (KEDA's int64 metric value,
//! the Prometheus gauge) can hold it and huge peer values never wrap around to a low number.
//!
//! All of it lives in one `tokio::sync::watch` channel, so KEDA's push stream, the peers'
//! subscriptions and drain wait on changes instead of polling.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use prometheus_client::metrics::histogram::Histogram;
use tokio::{
    sync::{Notify, watch},
    time::Instant,
};

use crate::endpoints::EndpointSet;

/// Why the total demand is not known.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("total demand unknown: {0}")]
pub struct DemandUnknown(pub String);

/// Peer bookkeeping, present when demand is aggregated over gateway replicas.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Peers {
    /// The peer list has been discovered at least once.
    synced: bool,
    /// Discovery itself fails (e.g. RBAC forbids the watch).
    discovery_error: Option<String>,
    /// Each peer's last local demand; `None` while unknown.
    values: BTreeMap<String, Option<u64>>,
}

/// How often a subscriber that has reported demand looks again, instead of waking on every
/// change: at low concurrency pending flips between 0 and 1 on every request, and a wake-up per
/// change costs each request a cross-thread wake-up (measured +28 µs p50 with a KEDA push
/// stream open). The rise from no demand still wakes a subscriber at once; changes while busy
/// are seen within this interval.
pub const BUSY_RECHECK: Duration = Duration::from_millis(100);

/// The demand state, as seen through [`DemandHub::subscribe`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DemandState {
    /// Identifies this replica to its peers (see [`crate::peers::INSTANCE_HEADER`]).
    instance: u64,
    pending: u64,
    max_queue: u64,
    lease: bool,
    peers: Option<Peers>,
}

impl DemandState {
    /// A random identifier of the replica, the same for its whole life.
    pub fn instance(&self) -> u64 {
        self.instance
    }

    /// Requests admitted by this replica and not finished.
    pub fn pending(&self) -> u64 {
        self.pending
    }

    /// Requests admitted at once at most (the model's `maxQueue`).
    pub fn max_queue(&self) -> u64 {
        self.max_queue
    }

    /// Whether the activation lease is held.
    pub fn lease(&self) -> bool {
        self.lease
    }

    /// This replica's demand: `pending`, at least 1 while the lease is held.
    pub fn local(&self) -> u64 {
        self.pending.max(u64::from(self.lease))
    }

    /// Local demand plus every peer's (at most `i64::MAX`), or why that sum is unknown.
    pub fn total(&self) -> Result<u64, DemandUnknown> {
        const CAP: u64 = i64::MAX as u64;
        let local = self.local().min(CAP);
        let Some(peers) = &self.peers else {
            return Ok(local);
        };
        if let Some(e) = &peers.discovery_error {
            return Err(DemandUnknown(format!("peer discovery failed: {e}")));
        }
        if !peers.synced {
            return Err(DemandUnknown(
                "peer gateway replicas not discovered yet".into(),
            ));
        }
        let mut sum = local;
        for (peer, v) in &peers.values {
            match v {
                Some(v) => sum = sum.saturating_add(*v).min(CAP),
                None => {
                    return Err(DemandUnknown(format!(
                        "no current demand from peer gateway {peer}"
                    )));
                }
            }
        }
        Ok(sum)
    }

    /// Whether there is any demand: `Some(true)` as soon as local demand is positive even if a
    /// peer is unknown, `None` when nothing local and the total is unknown.
    pub fn active(&self) -> Option<bool> {
        if self.local() > 0 {
            return Some(true);
        }
        self.total().ok().map(|t| t > 0)
    }
}

/// Shared demand counters of one gateway replica.
#[derive(Debug, Clone)]
pub struct DemandHub {
    tx: Arc<watch::Sender<DemandState>>,
    /// Incremented on every rise of this replica's demand from 0
    /// (`hearth_gateway_activation_events_total`).
    activations: prometheus_client::metrics::counter::Counter,
    /// Observes the lease's raise until a ready backend was seen, in seconds
    /// (`hearth_activation_phase_seconds{phase="demand_to_ready"}`).
    demand_to_ready: Histogram,
    /// Bumped on every rise of this hub's demand from 0 (see [`DemandHub::with_rises`]).
    rises: Option<Arc<watch::Sender<u64>>>,
    /// When the last admitted request finished (the hub's creation before the first).
    last_done: Arc<Mutex<Instant>>,
}

impl DemandHub {
    /// A hub admitting at most `max_queue` requests at once; `aggregate` turns on peer
    /// aggregation (total unknown until the peer list is set).
    pub fn new(max_queue: u64, aggregate: bool) -> Self {
        Self::with_instance(random_instance(), max_queue, aggregate)
    }

    /// [`DemandHub::new`] for the replica `instance` (every model of a shared gateway has a hub
    /// of its own, all naming the replica's instance).
    pub fn with_instance(instance: u64, max_queue: u64, aggregate: bool) -> Self {
        let state = DemandState {
            instance,
            pending: 0,
            max_queue,
            lease: false,
            peers: aggregate.then(Peers::default),
        };
        Self {
            tx: Arc::new(watch::channel(state).0),
            activations: Default::default(),
            demand_to_ready: Histogram::new(std::iter::empty()),
            rises: None,
            last_done: Arc::new(Mutex::new(Instant::now())),
        }
    }

    /// How long this replica has had no demand: zero while a request is admitted or the
    /// activation lease is held, else since the last admitted request finished (or since the
    /// hub was made). What the device handover ranks idle models by.
    pub fn idle(&self) -> Duration {
        if self.state().local() > 0 {
            return Duration::ZERO;
        }
        lock(&self.last_done).elapsed()
    }

    /// Bumps `rises` on every rise of this hub's demand from 0: a shared gateway's demand
    /// stream to its peers wakes on any model's rise at once without following every hub.
    pub fn with_rises(mut self, rises: Arc<watch::Sender<u64>>) -> Self {
        self.rises = Some(rises);
        self
    }

    /// Changes how many requests may be admitted at once (a route table that changed the
    /// model's `maxQueue`); requests already admitted stay.
    pub fn set_max_queue(&self, max_queue: u64) {
        self.tx.send_if_modified(|s| {
            let changed = s.max_queue != max_queue;
            s.max_queue = max_queue;
            changed
        });
    }

    /// A rise from 0: counted, and announced to [`DemandHub::with_rises`].
    fn rose(&self) {
        self.activations.inc();
        if let Some(rises) = &self.rises {
            rises.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Observes, on `histogram`, each activation lease's time from its raise until a ready
    /// backend was seen (see [`Lease`]), in seconds.
    pub fn with_demand_to_ready(mut self, histogram: Histogram) -> Self {
        self.demand_to_ready = histogram;
        self
    }

    /// Counts each rise of this replica's demand from 0 (a request arriving to an idle
    /// replica, or the activation lease raised with nothing pending) on `counter`.
    pub fn with_activation_counter(
        mut self,
        counter: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        self.activations = counter;
        self
    }

    /// Admits one request if fewer than `max_queue` are pending; the slot frees on drop.
    pub fn try_admit(&self) -> Option<Admission> {
        let mut admitted = false;
        let mut rose = false;
        self.tx.send_if_modified(|s| {
            if s.pending < s.max_queue {
                rose = s.local() == 0;
                s.pending += 1;
                admitted = true;
            }
            admitted
        });
        if rose {
            self.rose();
        }
        admitted.then(|| Admission { hub: self.clone() })
    }

    /// Sets or clears the activation lease.
    pub fn set_lease(&self, on: bool) {
        let mut rose = false;
        self.tx.send_if_modified(|s| {
            let changed = s.lease != on;
            rose = on && s.local() == 0;
            s.lease = on;
            changed
        });
        if rose {
            self.rose();
        }
    }

    /// This replica's random identifier (see [`DemandState::instance`]).
    pub fn instance(&self) -> u64 {
        self.tx.borrow().instance
    }

    /// This replica's demand now (see [`DemandState::local`]), without copying the state.
    pub fn local(&self) -> u64 {
        self.tx.borrow().local()
    }

    /// The current state.
    pub fn state(&self) -> DemandState {
        self.tx.borrow().clone()
    }

    /// A receiver woken on every change.
    pub fn subscribe(&self) -> watch::Receiver<DemandState> {
        self.tx.subscribe()
    }

    /// Replaces the peer list (peers keep their last values; new ones start unknown) and marks
    /// discovery as working.
    pub fn set_peers(&self, peers: impl IntoIterator<Item = String>) {
        let peers: Vec<String> = peers.into_iter().collect();
        self.tx.send_if_modified(|s| {
            let Some(p) = &mut s.peers else { return false };
            let before = p.clone();
            let mut next = BTreeMap::new();
            for peer in peers {
                let v = p.values.get(&peer).copied().flatten();
                next.insert(peer, v);
            }
            p.values = next;
            p.synced = true;
            p.discovery_error = None;
            *p != before
        });
    }

    /// Records a peer's local demand (`None`: unknown now). Ignored for peers not in the list.
    pub fn set_peer_value(&self, peer: &str, value: Option<u64>) {
        self.tx.send_if_modified(|s| {
            let Some(p) = &mut s.peers else { return false };
            match p.values.get_mut(peer) {
                Some(v) if *v != value => {
                    *v = value;
                    true
                }
                _ => false,
            }
        });
    }

    /// Records that peer discovery fails, making the total unknown until it works again.
    pub fn set_peer_discovery_error(&self, error: String) {
        self.tx.send_if_modified(|s| {
            let Some(p) = &mut s.peers else { return false };
            let changed = p.discovery_error.as_ref() != Some(&error);
            p.discovery_error = Some(error);
            changed
        });
    }

    /// Waits until nothing is pending on this replica, or `timeout` passes; returns the
    /// pending count left.
    pub async fn wait_idle(&self, timeout: Duration) -> u64 {
        let mut rx = self.subscribe();
        let _ = tokio::time::timeout(timeout, rx.wait_for(|s| s.pending == 0)).await;
        self.state().pending
    }
}

/// A random replica instance (see [`DemandState::instance`]): std's `RandomState` is seeded
/// from the OS and differs on every call.
pub(crate) fn random_instance() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.finish()
}

/// Locks `m`, taking over a lock whose holder panicked (the values stay consistent).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// One admitted request; dropping it frees the slot and lowers demand.
#[derive(Debug)]
pub struct Admission {
    hub: DemandHub,
}

impl Drop for Admission {
    fn drop(&mut self) {
        *lock(&self.hub.last_done) = Instant::now();
        self.hub
            .tx
            .send_modify(|s| s.pending = s.pending.saturating_sub(1));
    }
}

/// The activation lease: raised by every cold request, held until the backend has been ready
/// for `grace`, or until `activation_timeout` after the last cold request.
///
/// The time from its raise (with no lease held) until a ready backend is first seen (the
/// endpoint watch, or a held request reaching one) is observed on the hub's
/// [`DemandHub::with_demand_to_ready`] histogram, once per raise; a lease that expires without a
/// ready backend observes nothing.
#[derive(Debug, Clone)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

#[derive(Debug)]
struct LeaseInner {
    hub: DemandHub,
    timeout: Mutex<Duration>,
    grace: Duration,
    deadline: Mutex<Option<Instant>>,
    /// When the lease was raised, until a ready backend is seen or it expires.
    raised_at: Mutex<Option<Instant>>,
    /// The last raise-to-ready time observed.
    last_activation: Mutex<Option<Duration>>,
    notify: Notify,
}

impl Lease {
    /// A lease over `hub`, held at most `activation_timeout` after the last cold request and
    /// `grace` after the backend was seen ready; call [`Lease::run`] in a task to let it expire.
    pub fn new(hub: DemandHub, activation_timeout: Duration, grace: Duration) -> Self {
        Self {
            inner: Arc::new(LeaseInner {
                hub,
                timeout: Mutex::new(activation_timeout),
                grace,
                deadline: Mutex::new(None),
                raised_at: Mutex::new(None),
                last_activation: Mutex::new(None),
                notify: Notify::new(),
            }),
        }
    }

    /// A cold request arrived: raise demand now, until a backend is ready or the activation
    /// timeout passes.
    pub fn raise(&self) {
        let now = Instant::now();
        let until = now + *lock(&self.inner.timeout);
        self.raised_at().get_or_insert(now);
        {
            let mut d = self
                .inner
                .deadline
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            *d = Some(d.map_or(until, |cur| cur.max(until)));
        }
        self.inner.hub.set_lease(true);
        self.inner.notify.notify_one();
    }

    /// A held request reached a backend: the lease ends `grace` from now at the latest. This
    /// catches a backend that was ready only briefly, which the endpoint watch may coalesce away.
    pub fn ready_seen(&self) {
        self.observe_ready();
        let until = Instant::now() + self.inner.grace;
        let mut d = self
            .inner
            .deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(cur) = *d
            && until < cur
        {
            *d = Some(until);
            drop(d);
            self.inner.notify.notify_one();
        }
    }

    fn raised_at(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.inner
            .raised_at
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// A ready backend was seen: observes the time since the raise, once.
    fn observe_ready(&self) {
        let raised = self.raised_at().take();
        if let Some(raised) = raised {
            let took = raised.elapsed();
            self.inner.hub.demand_to_ready.observe(took.as_secs_f64());
            *lock(&self.inner.last_activation) = Some(took);
        }
    }

    /// The last activation this lease saw: from its raise until a ready backend was seen;
    /// `None` before the first.
    pub fn last_activation(&self) -> Option<Duration> {
        *lock(&self.inner.last_activation)
    }

    /// Changes the activation timeout of later raises (a route table that changed the model's
    /// `activationTimeout`).
    pub fn set_timeout(&self, activation_timeout: Duration) {
        *lock(&self.inner.timeout) = activation_timeout;
    }

    fn deadline(&self) -> Option<Instant> {
        *self
            .inner
            .deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Clears the lease if its deadline is still `expected` (not extended meanwhile).
    fn expire(&self, expected: Instant) -> bool {
        let mut d = self
            .inner
            .deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if *d == Some(expected) {
            *d = None;
            *self.raised_at() = None;
            self.inner.hub.set_lease(false);
            true
        } else {
            false
        }
    }

    /// Expires the lease: at its deadline, or `grace` after `endpoints` turned ready.
    pub async fn run(self, endpoints: EndpointSet) {
        let grace = self.inner.grace;
        let mut ready_rx = endpoints.subscribe();
        loop {
            let Some(deadline) = self.deadline() else {
                self.inner.notify.notified().await;
                continue;
            };
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => {
                    self.expire(deadline);
                }
                ok = async { ready_rx.wait_for(|e| !e.is_empty()).await.is_ok() } => {
                    if !ok {
                        return;
                    }
                    self.observe_ready();
                    // Ready: keep the lease for the grace period, then drop it unless a new
                    // cold request extended it meanwhile.
                    tokio::time::sleep(grace).await;
                    let cur = self.deadline();
                    if let Some(cur) = cur
                        && (cur == deadline || endpoints.is_ready())
                    {
                        self.expire(cur);
                    }
                }
                _ = self.inner.notify.notified() => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admission_is_bounded_and_frees_on_drop() {
        let hub = DemandHub::new(2, false);
        let a = hub.try_admit().unwrap();
        let b = hub.try_admit().unwrap();
        assert!(hub.try_admit().is_none());
        assert_eq!(hub.state().pending(), 2);
        drop(a);
        assert_eq!(hub.state().pending(), 1);
        let _c = hub.try_admit().unwrap();
        drop(b);
        assert_eq!(hub.state().total(), Ok(1));
    }

    #[tokio::test(start_paused = true)]
    async fn idle_is_zero_while_busy_and_counts_from_the_last_request() {
        let hub = DemandHub::new(8, false);
        tokio::time::advance(Duration::from_secs(5)).await;
        assert_eq!(hub.idle(), Duration::from_secs(5));
        let a = hub.try_admit().unwrap();
        tokio::time::advance(Duration::from_secs(3)).await;
        assert_eq!(hub.idle(), Duration::ZERO);
        drop(a);
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(hub.idle(), Duration::from_secs(2));
        hub.set_lease(true);
        assert_eq!(hub.idle(), Duration::ZERO);
    }

    #[test]
    fn lease_counts_as_one() {
        let hub = DemandHub::new(8, false);
        hub.set_lease(true);
        assert_eq!(hub.state().local(), 1);
        let _a = hub.try_admit().unwrap();
        let _b = hub.try_admit().unwrap();
        assert_eq!(hub.state().local(), 2);
    }

    #[test]
    fn aggregation_is_unknown_until_every_peer_reports() {
        let hub = DemandHub::new(8, true);
        assert!(hub.state().total().is_err());
        assert_eq!(hub.state().active(), None);
        hub.set_peers(["10.0.0.2:8080".to_string(), "10.0.0.3:8080".to_string()]);
        let err = hub.state().total().unwrap_err();
        assert!(err.0.contains("10.0.0.2:8080"), "{err}");
        hub.set_peer_value("10.0.0.2:8080", Some(3));
        hub.set_peer_value("10.0.0.3:8080", Some(0));
        assert_eq!(hub.state().total(), Ok(3));
        assert_eq!(hub.state().active(), Some(true));
        let _a = hub.try_admit().unwrap();
        assert_eq!(hub.state().total(), Ok(4));
        // A peer going silent makes the total unknown, but local demand still says "active".
        hub.set_peer_value("10.0.0.3:8080", None);
        assert!(hub.state().total().is_err());
        assert_eq!(hub.state().active(), Some(true));
        // A removed peer no longer counts.
        hub.set_peers(["10.0.0.2:8080".to_string()]);
        assert_eq!(hub.state().total(), Ok(4));
        hub.set_peer_discovery_error("forbidden".into());
        assert!(hub.state().total().unwrap_err().0.contains("forbidden"));
    }

    #[tokio::test(start_paused = true)]
    async fn lease_expires_after_timeout_without_backend() {
        let hub = DemandHub::new(8, false);
        let endpoints = EndpointSet::new();
        let lease = Lease::new(hub.clone(), Duration::from_secs(60), Duration::from_secs(5));
        tokio::spawn(lease.clone().run(endpoints));
        lease.raise();
        assert!(hub.state().lease());
        let mut rx = hub.subscribe();
        let start = tokio::time::Instant::now();
        rx.wait_for(|s| !s.lease()).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(60));
    }

    #[tokio::test(start_paused = true)]
    async fn lease_ends_grace_after_ready() {
        let hub = DemandHub::new(8, false);
        let endpoints = EndpointSet::new();
        let lease = Lease::new(hub.clone(), Duration::from_secs(60), Duration::from_secs(5));
        tokio::spawn(lease.clone().run(endpoints.clone()));
        lease.raise();
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(hub.state().lease());
        endpoints.replace(["127.0.0.1:1".parse().unwrap()]);
        let start = tokio::time::Instant::now();
        let mut rx = hub.subscribe();
        rx.wait_for(|s| !s.lease()).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn a_forwarded_held_request_ends_the_lease_even_if_readiness_was_brief() {
        let hub = DemandHub::new(8, false);
        let endpoints = EndpointSet::new();
        let lease = Lease::new(hub.clone(), Duration::from_secs(60), Duration::from_secs(5));
        tokio::spawn(lease.clone().run(endpoints.clone()));
        lease.raise();
        // Ready and gone again before the lease task looked: the watch shows only "empty".
        endpoints.replace(["127.0.0.1:1".parse().unwrap()]);
        endpoints.replace(Vec::new());
        lease.ready_seen();
        let start = tokio::time::Instant::now();
        let mut rx = hub.subscribe();
        rx.wait_for(|s| !s.lease()).await.unwrap();
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    fn demand_to_ready(hub: DemandHub) -> (DemandHub, Histogram) {
        let h = Histogram::new([1.0, 10.0, 30.0, 120.0]);
        (hub.with_demand_to_ready(h.clone()), h)
    }

    /// `(count, sum)` of a histogram, read from its text exposition.
    fn count_and_sum(h: &Histogram) -> (u64, f64) {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register("h", "", h.clone());
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        let value = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<f64>().ok())
                .unwrap()
        };
        (value("h_count ") as u64, value("h_sum "))
    }

    #[tokio::test(start_paused = true)]
    async fn demand_to_ready_is_observed_once_per_raise_from_the_first_cold_request() {
        let (hub, h) = demand_to_ready(DemandHub::new(8, false));
        let endpoints = EndpointSet::new();
        let lease = Lease::new(hub.clone(), Duration::from_secs(60), Duration::from_secs(5));
        tokio::spawn(lease.clone().run(endpoints.clone()));
        lease.raise();
        tokio::time::sleep(Duration::from_secs(10)).await;
        // A second cold request while the backend starts: the first raise still counts.
        lease.raise();
        tokio::time::sleep(Duration::from_secs(20)).await;
        endpoints.replace(["127.0.0.1:1".parse().unwrap()]);
        tokio::time::sleep(Duration::from_millis(1)).await;
        // The held requests reaching the backend observe nothing more.
        lease.ready_seen();
        lease.ready_seen();
        let mut rx = hub.subscribe();
        rx.wait_for(|s| !s.lease()).await.unwrap();
        assert_eq!(count_and_sum(&h), (1, 30.0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_request_reaching_a_backend_first_observes_demand_to_ready() {
        let (hub, h) = demand_to_ready(DemandHub::new(8, false));
        let lease = Lease::new(hub.clone(), Duration::from_secs(60), Duration::from_secs(5));
        tokio::spawn(lease.clone().run(EndpointSet::new()));
        lease.raise();
        tokio::time::sleep(Duration::from_secs(3)).await;
        lease.ready_seen();
        assert_eq!(count_and_sum(&h), (1, 3.0));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_that_expires_without_a_backend_observes_nothing() {
        let (hub, h) = demand_to_ready(DemandHub::new(8, false));
        let endpoints = EndpointSet::new();
        let lease = Lease::new(hub.clone(), Duration::from_secs(60), Duration::from_secs(5));
        tokio::spawn(lease.clone().run(endpoints.clone()));
        lease.raise();
        let mut rx = hub.subscribe();
        rx.wait_for(|s| !s.lease()).await.unwrap();
        // The next raise starts its own measurement.
        lease.raise();
        tokio::time::sleep(Duration::from_secs(2)).await;
        endpoints.replace(["127.0.0.1:1".parse().unwrap()]);
        rx.wait_for(|s| !s.lease()).await.unwrap();
        assert_eq!(count_and_sum(&h), (1, 2.0));
    }

    #[test]
    fn activations_count_each_rise_from_zero() {
        let counter = prometheus_client::metrics::counter::Counter::<u64>::default();
        let hub = DemandHub::new(8, false).with_activation_counter(counter.clone());
        let a = hub.try_admit().unwrap();
        let b = hub.try_admit().unwrap();
        assert_eq!(
            counter.get(),
            1,
            "a second request while busy is no new activation"
        );
        hub.set_lease(true);
        drop((a, b));
        assert_eq!(counter.get(), 1, "the lease held while requests finish");
        hub.set_lease(false);
        hub.set_lease(true);
        assert_eq!(counter.get(), 2, "the lease raised on an idle replica");
        hub.set_lease(false);
        let _c = hub.try_admit().unwrap();
        assert_eq!(counter.get(), 3);
    }
}

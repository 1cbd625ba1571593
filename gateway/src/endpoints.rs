//! The set of backend endpoints requests may go to, and least-outstanding-requests balancing.
//!
//! An [`EndpointSet`] is fed by whoever knows the endpoints: the EndpointSlice watch in
//! production ([`crate::discovery`]), a fixed list in tests or with `--backend-url`. Readers
//! either pick an endpoint now ([`EndpointSet::pick`]) or wait for the set to change
//! ([`EndpointSet::subscribe`]), which is how a held request is forwarded the moment a backend
//! turns ready: no polling loop.
//!
//! Passive health checking: an endpoint that refused a connection or failed a request is
//! ejected ([`EndpointGuard::eject`]) and skipped by picks for [`EJECTION`], while another
//! endpoint is ready. That covers the seconds between a backend dying (OOM kill, crash) and
//! its EndpointSlice turning it not-ready, like Envoy's outlier detection on
//! consecutive connect failures.

use std::{
    sync::{
        Arc, Mutex, OnceLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use http::uri::Authority;
use tokio::sync::watch;

/// How long an endpoint that failed a connection or a request is skipped by picks (while
/// another endpoint is ready): about one readiness-probe period, after which the EndpointSlice
/// says whether it is really gone.
pub const EJECTION: Duration = Duration::from_secs(5);

/// Milliseconds since the first call in this process (the clock of ejections).
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let ms = EPOCH.get_or_init(Instant::now).elapsed().as_millis();
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// One backend endpoint: its `host:port`, the requests outstanding on it through this
/// gateway replica, and until when it is ejected.
#[derive(Debug)]
pub struct Endpoint {
    authority: Authority,
    outstanding: AtomicUsize,
    /// [`now_ms`] until which picks skip it; 0 when never ejected.
    ejected_until: AtomicU64,
    /// How long it has had a request outstanding (metering).
    busy: Mutex<Busy>,
}

/// The time an endpoint had at least one request outstanding: `total` closed periods, and
/// the open one since `since`.
#[derive(Debug, Default)]
struct Busy {
    total: Duration,
    since: Option<Instant>,
}

impl Endpoint {
    /// `host:port` requests are sent to.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// Requests sent to this endpoint whose responses have not finished.
    pub fn outstanding(&self) -> usize {
        self.outstanding.load(Ordering::Relaxed)
    }

    /// Whether it is ejected now (see [`EndpointGuard::eject`]).
    pub fn is_ejected(&self) -> bool {
        self.ejected_until.load(Ordering::Relaxed) > now_ms()
    }

    /// How long, up to `now`, it has had at least one request outstanding since it joined
    /// the set ([`crate::metering`]).
    pub fn busy(&self, now: Instant) -> Duration {
        let busy = lock(&self.busy);
        busy.total
            + busy
                .since
                .map_or(Duration::ZERO, |s| now.saturating_duration_since(s))
    }

    fn new(authority: Authority) -> Self {
        Self {
            authority,
            outstanding: AtomicUsize::new(0),
            ejected_until: AtomicU64::new(0),
            busy: Mutex::new(Busy::default()),
        }
    }

    /// A request became outstanding: `before` were.
    fn started(&self, before: usize) {
        if before == 0 {
            let mut busy = lock(&self.busy);
            if busy.since.is_none() {
                busy.since = Some(Instant::now());
            }
        }
    }

    /// A request finished: `before` were outstanding. The busy period ends only if none is
    /// outstanding once the lock is held (a request may have started in between).
    fn finished(&self, before: usize) {
        if before == 1 {
            let mut busy = lock(&self.busy);
            if self.outstanding() == 0
                && let Some(since) = busy.since.take()
            {
                busy.total += since.elapsed();
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A snapshot of the ready endpoints.
pub type Endpoints = Arc<[Arc<Endpoint>]>;

/// The ready endpoints, shared between the feeder and the request handlers.
#[derive(Debug, Clone)]
pub struct EndpointSet {
    tx: Arc<watch::Sender<Endpoints>>,
    rotor: Arc<AtomicUsize>,
    /// Why no endpoint will come without a change, as its feeder learned it (the service's
    /// activation failure, [`crate::diagnosis`]).
    failure: Arc<watch::Sender<Option<Arc<str>>>>,
}

impl Default for EndpointSet {
    fn default() -> Self {
        Self::new()
    }
}

impl EndpointSet {
    /// An empty set: every request is cold until [`EndpointSet::replace`] adds an endpoint.
    pub fn new() -> Self {
        Self {
            tx: Arc::new(watch::channel(Endpoints::from(Vec::new())).0),
            rotor: Arc::new(AtomicUsize::new(0)),
            failure: Arc::new(watch::channel(None).0),
        }
    }

    /// A set holding `authorities` (`host:port` each).
    pub fn fixed(authorities: impl IntoIterator<Item = Authority>) -> Self {
        let set = Self::new();
        set.replace(authorities);
        set
    }

    /// Replaces the ready endpoints. Endpoints present before and after keep their outstanding
    /// counts; subscribers are woken only when the set of authorities changed.
    pub fn replace(&self, authorities: impl IntoIterator<Item = Authority>) {
        let mut wanted: Vec<Authority> = authorities.into_iter().collect();
        wanted.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        wanted.dedup();
        self.tx.send_if_modified(|cur| {
            if cur.len() == wanted.len() && cur.iter().zip(&wanted).all(|(e, a)| e.authority == *a)
            {
                return false;
            }
            let next: Vec<Arc<Endpoint>> = wanted
                .iter()
                .map(|a| {
                    cur.iter()
                        .find(|e| e.authority == *a)
                        .cloned()
                        .unwrap_or_else(|| Arc::new(Endpoint::new(a.clone())))
                })
                .collect();
            *cur = next.into();
            true
        });
    }

    /// Says why no endpoint will become ready without a change (`Some`), or that none is known
    /// (`None`); waiters of [`EndpointSet::failed`] are woken when it changes.
    pub fn set_failure(&self, why: Option<&str>) {
        self.failure.send_if_modified(|cur| {
            if cur.as_deref() == why {
                return false;
            }
            *cur = why.map(Arc::from);
            true
        });
    }

    /// Why no endpoint will become ready, while none is: what [`EndpointSet::set_failure`]
    /// said last.
    pub fn failure(&self) -> Option<Arc<str>> {
        if self.is_ready() {
            return None;
        }
        self.failure.borrow().clone()
    }

    /// Resolves with the failure once one is set while no endpoint is ready (at once when that
    /// is so now); never while an endpoint is ready.
    pub async fn failed(&self) -> Arc<str> {
        let mut ready = self.tx.subscribe();
        let mut failure = self.failure.subscribe();
        loop {
            ready.borrow_and_update();
            failure.borrow_and_update();
            if let Some(why) = self.failure() {
                return why;
            }
            // Both senders live as long as `self`: neither `changed` can fail meanwhile.
            tokio::select! {
                _ = ready.changed() => {}
                _ = failure.changed() => {}
            }
        }
    }

    /// The ready endpoints now.
    pub fn snapshot(&self) -> Endpoints {
        self.tx.borrow().clone()
    }

    /// Whether at least one endpoint is ready.
    pub fn is_ready(&self) -> bool {
        !self.tx.borrow().is_empty()
    }

    /// How many endpoints are ready.
    pub fn len(&self) -> usize {
        self.tx.borrow().len()
    }

    /// Whether no endpoint is ready.
    pub fn is_empty(&self) -> bool {
        self.tx.borrow().is_empty()
    }

    /// A receiver woken on every change of the set.
    pub fn subscribe(&self) -> watch::Receiver<Endpoints> {
        self.tx.subscribe()
    }

    /// The ready endpoint with the fewest outstanding requests (ties rotate), skipping ejected
    /// ones unless every endpoint is ejected, counted as outstanding until the returned guard
    /// drops; `None` when no endpoint is ready.
    pub fn pick(&self) -> Option<EndpointGuard> {
        let snap = self.tx.borrow().clone();
        pick_from(&snap, &self.rotor, None)
    }

    /// [`EndpointSet::pick`], preferring the endpoints `prefer` names while they have fewer
    /// than `bound` requests outstanding (affinity: an engine that already has what the request
    /// needs, as long as it has room); otherwise the usual choice.
    pub fn pick_preferring(
        &self,
        prefer: &(dyn Fn(&Authority) -> bool + Sync),
        bound: usize,
    ) -> Option<EndpointGuard> {
        let snap = self.tx.borrow().clone();
        pick_from(&snap, &self.rotor, Some((prefer, bound)))
    }
}

/// A pick's preference: the endpoints the function names come first while they have fewer
/// requests outstanding than the bound (see [`EndpointSet::pick_preferring`]).
pub type Preference<'a> = Option<(&'a (dyn Fn(&Authority) -> bool + Sync), usize)>;

/// How an endpoint ranks in a pick: lowest first. A healthy endpoint beats any ejected one; a
/// preferred one with room beats the others; then fewer outstanding requests.
fn rank(ejected: bool, preferred_with_room: bool, outstanding: usize) -> (bool, bool, usize) {
    (ejected, !preferred_with_room, outstanding)
}

/// Least outstanding requests over `snap`, starting the scan at a rotating offset so equal
/// endpoints share load; ejected endpoints only when no other is left; with `prefer`, its
/// endpoints first while they have fewer than its bound outstanding.
fn pick_from(
    snap: &Endpoints,
    rotor: &AtomicUsize,
    prefer: Preference<'_>,
) -> Option<EndpointGuard> {
    let n = snap.len();
    if n == 0 {
        return None;
    }
    let start = rotor.fetch_add(1, Ordering::Relaxed) % n;
    let now = now_ms();
    let rank = |e: &Endpoint| {
        let outstanding = e.outstanding();
        let preferred = prefer.is_some_and(|(p, bound)| outstanding < bound && p(&e.authority));
        rank(
            e.ejected_until.load(Ordering::Relaxed) > now,
            preferred,
            outstanding,
        )
    };
    let mut best = &snap[start];
    let mut best_rank = rank(best);
    for i in 1..n {
        let e = &snap[(start + i) % n];
        let r = rank(e);
        if r < best_rank {
            best = e;
            best_rank = r;
        }
    }
    best.started(best.outstanding.fetch_add(1, Ordering::Relaxed));
    Some(EndpointGuard {
        endpoint: best.clone(),
    })
}

/// An outstanding request on an endpoint; the count drops with the guard.
#[derive(Debug)]
pub struct EndpointGuard {
    endpoint: Arc<Endpoint>,
}

impl EndpointGuard {
    /// The endpoint picked.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The endpoint picked, shared: its identity (an endpoint that leaves the set and comes
    /// back is another one).
    pub(crate) fn shared(&self) -> &Arc<Endpoint> {
        &self.endpoint
    }

    /// Takes the endpoint out of picks for [`EJECTION`] (while another is ready): it refused a
    /// connection or failed a request.
    pub fn eject(&self) {
        let until = now_ms().saturating_add(u64::try_from(EJECTION.as_millis()).unwrap_or(0));
        self.endpoint
            .ejected_until
            .fetch_max(until, Ordering::Relaxed);
    }
}

impl Drop for EndpointGuard {
    fn drop(&mut self) {
        let before = self.endpoint.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.endpoint.finished(before);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Authority {
        s.parse().unwrap()
    }

    #[test]
    fn busy_time_runs_while_any_request_is_outstanding() {
        let set = EndpointSet::fixed([a("198.18.0.1:8000")]);
        let e = set.snapshot()[0].clone();
        let later = |ms| Instant::now() + Duration::from_millis(ms);
        assert_eq!(e.busy(later(50)), Duration::ZERO);
        let first = set.pick().unwrap();
        let second = set.pick().unwrap();
        // Open: it runs up to the time asked about.
        assert!(e.busy(later(30)) >= Duration::from_millis(30));
        drop(first);
        // One is still outstanding: the period goes on.
        assert!(e.busy(later(60)) >= Duration::from_millis(60));
        drop(second);
        // Closed: later times add nothing.
        let closed = e.busy(Instant::now());
        assert_eq!(e.busy(later(1000)), closed);
        // Kept while the endpoint stays in the set.
        set.replace([a("198.18.0.1:8000"), a("198.18.0.2:8000")]);
        assert_eq!(set.snapshot()[0].busy(later(1000)), closed);
    }

    #[test]
    fn ranks_healthy_then_preferred_with_room_then_least_outstanding() {
        // (ejected, preferred with room, outstanding), best first.
        let ordered = [
            (false, true, 9),
            (false, false, 0),
            (false, false, 1),
            (true, true, 0),
            (true, false, 0),
        ];
        for pair in ordered.windows(2) {
            let (a, b) = (pair[0], pair[1]);
            assert!(
                rank(a.0, a.1, a.2) < rank(b.0, b.1, b.2),
                "{a:?} before {b:?}"
            );
        }
    }

    #[test]
    fn a_preferred_endpoint_is_picked_while_it_has_room() {
        let set = EndpointSet::fixed([a("10.0.0.1:8000"), a("10.0.0.2:8000")]);
        let has = a("10.0.0.2:8000");
        let prefer = |x: &Authority| *x == has;
        // (requests already outstanding on it, bound, picked)
        let cases = [
            (0, 2, "10.0.0.2:8000"),
            (1, 2, "10.0.0.2:8000"),
            (2, 2, "10.0.0.1:8000"),
        ];
        for (outstanding, bound, want) in cases {
            let held: Vec<_> = (0..outstanding)
                .map(|_| set.pick_preferring(&prefer, usize::MAX).unwrap())
                .collect();
            assert!(held.iter().all(|g| *g.endpoint().authority() == has));
            let g = set.pick_preferring(&prefer, bound).unwrap();
            assert_eq!(
                g.endpoint().authority().as_str(),
                want,
                "{outstanding} outstanding, bound {bound}"
            );
        }
        // Without a preference: the least outstanding.
        let held = set.pick_preferring(&prefer, 8).unwrap();
        assert_eq!(*held.endpoint().authority(), has);
        assert_ne!(*set.pick().unwrap().endpoint().authority(), has);
        // An ejected preferred endpoint is skipped.
        drop(held);
        set.pick_preferring(&prefer, 8).unwrap().eject();
        assert_ne!(
            *set.pick_preferring(&prefer, 8)
                .unwrap()
                .endpoint()
                .authority(),
            has
        );
    }

    #[test]
    fn empty_set_picks_nothing() {
        assert!(EndpointSet::new().pick().is_none());
    }

    #[test]
    fn picks_least_outstanding() {
        let set = EndpointSet::fixed([a("10.0.0.1:8000"), a("10.0.0.2:8000")]);
        let g1 = set.pick().unwrap();
        let g2 = set.pick().unwrap();
        assert_ne!(g1.endpoint().authority(), g2.endpoint().authority());
        // Free the second one: the next pick must be it, whatever the rotation says.
        let free = g2.endpoint().authority().clone();
        drop(g2);
        for _ in 0..4 {
            let g = set.pick().unwrap();
            assert_eq!(g.endpoint().authority(), &free);
        }
    }

    #[test]
    fn replace_keeps_counts_and_wakes_only_on_change() {
        let set = EndpointSet::fixed([a("10.0.0.1:8000")]);
        let mut rx = set.subscribe();
        rx.mark_unchanged();
        let g = set.pick().unwrap();
        set.replace([a("10.0.0.1:8000")]);
        assert!(!rx.has_changed().unwrap());
        set.replace([a("10.0.0.2:8000"), a("10.0.0.1:8000")]);
        assert!(rx.has_changed().unwrap());
        let snap = set.snapshot();
        let kept = snap
            .iter()
            .find(|e| e.authority().as_str() == "10.0.0.1:8000")
            .unwrap();
        assert_eq!(kept.outstanding(), 1);
        drop(g);
        assert_eq!(kept.outstanding(), 0);
        set.replace(Vec::new());
        assert!(!set.is_ready());
    }

    #[test]
    fn ejected_endpoint_is_skipped_while_another_is_ready() {
        let set = EndpointSet::fixed([a("10.0.0.1:8000"), a("10.0.0.2:8000")]);
        let bad = set.pick().unwrap();
        let dead = bad.endpoint().authority().clone();
        bad.eject();
        drop(bad);
        // The ejected endpoint has no outstanding request, yet every pick goes elsewhere,
        // however many are outstanding there.
        let held: Vec<_> = (0..6).map(|_| set.pick().unwrap()).collect();
        assert!(held.iter().all(|g| g.endpoint().authority() != &dead));
        assert!(
            set.snapshot()
                .iter()
                .any(|e| e.authority() == &dead && e.is_ejected())
        );
        // The EndpointSlice still lists it: a replace keeps the ejection.
        set.replace([a("10.0.0.2:8000"), a("10.0.0.1:8000")]);
        assert_ne!(set.pick().unwrap().endpoint().authority(), &dead);
    }

    #[test]
    fn an_ejected_endpoint_is_still_picked_when_it_is_the_only_one() {
        let set = EndpointSet::fixed([a("10.0.0.1:8000")]);
        set.pick().unwrap().eject();
        let g = set.pick().expect("the only endpoint, ejected or not");
        assert!(g.endpoint().is_ejected());
    }
}

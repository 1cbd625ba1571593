//! The set of backend endpoints requests may go to, and least-outstanding-requests balancing.
//!
//! An [`EndpointSet`] is fed by whoever knows the endpoints: the EndpointSlice watch in
//! production ([`crate::discovery`]), a fixed list in tests or with `--backend-url`. Readers
//! either pick an endpoint now ([`EndpointSet::pick`]) or wait for the set to change
//! ([`EndpointSet::subscribe`]), which is how a held request is forwarded the moment a backend
//! turns ready: no polling loop.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

use http::uri::Authority;
use tokio::sync::watch;

/// One backend endpoint: its `host:port` and the requests outstanding on it through this
/// gateway replica.
#[derive(Debug)]
pub struct Endpoint {
    authority: Authority,
    outstanding: AtomicUsize,
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
}

/// A snapshot of the ready endpoints.
pub type Endpoints = Arc<[Arc<Endpoint>]>;

/// The ready endpoints, shared between the feeder and the request handlers.
#[derive(Debug, Clone)]
pub struct EndpointSet {
    tx: Arc<watch::Sender<Endpoints>>,
    rotor: Arc<AtomicUsize>,
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
                        .unwrap_or_else(|| {
                            Arc::new(Endpoint {
                                authority: a.clone(),
                                outstanding: AtomicUsize::new(0),
                            })
                        })
                })
                .collect();
            *cur = next.into();
            true
        });
    }

    /// The ready endpoints now.
    pub fn snapshot(&self) -> Endpoints {
        self.tx.borrow().clone()
    }

    /// Whether at least one endpoint is ready.
    pub fn is_ready(&self) -> bool {
        !self.tx.borrow().is_empty()
    }

    /// A receiver woken on every change of the set.
    pub fn subscribe(&self) -> watch::Receiver<Endpoints> {
        self.tx.subscribe()
    }

    /// The ready endpoint with the fewest outstanding requests (ties rotate), counted as
    /// outstanding until the returned guard drops; `None` when no endpoint is ready.
    pub fn pick(&self) -> Option<EndpointGuard> {
        let snap = self.tx.borrow().clone();
        pick_from(&snap, &self.rotor)
    }
}

/// Least outstanding requests over `snap`, starting the scan at a rotating offset so equal
/// endpoints share load.
fn pick_from(snap: &Endpoints, rotor: &AtomicUsize) -> Option<EndpointGuard> {
    let n = snap.len();
    if n == 0 {
        return None;
    }
    let start = rotor.fetch_add(1, Ordering::Relaxed) % n;
    let mut best = &snap[start];
    let mut best_load = best.outstanding();
    for i in 1..n {
        let e = &snap[(start + i) % n];
        let load = e.outstanding();
        if load < best_load {
            best = e;
            best_load = load;
        }
    }
    best.outstanding.fetch_add(1, Ordering::Relaxed);
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
}

impl Drop for EndpointGuard {
    fn drop(&mut self) {
        self.endpoint.outstanding.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Authority {
        s.parse().unwrap()
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
}

//! Fair dispatch: a model's requests in flight are bounded per ready backend replica
//! (`containerConcurrency`), and the rest wait here, warm or cold, to be dispatched by strict
//! priority band first and, inside a band, by fair share of the tokens served.
//!
//! Fair share is the virtual token counter of Sheng et al., "Fairness in Serving Large
//! Language Models" (OSDI 2024): each tenant's counter grows by the tokens served to it (the
//! prompt's estimate at dispatch, each streamed event while it streams, corrected to the
//! response's `usage` at the end, see [`Permit::charge`]), and the backlogged tenant with the
//! lowest counter goes next. A tenant that starts waiting again is lifted to the lowest counter
//! of the tenants waiting in its band (or, when none waits, to the counter of the last tenant
//! dispatched there), so time spent idle is not saved up as credit against the others.
//!
//! The bound is `containerConcurrency` × ready replicas of the model, read at every dispatch,
//! divided among the gateway's replicas (rounded up): each replica knows its peers (see
//! [`crate::peers`]), and the engine behind them all must not be sent more than it batches.
//!
//! **Headroom.** Dispatch does not preempt: a request that finds every place taken waits for
//! one to end, however few tokens its tenant was served. So where there are several tenants,
//! no one tenant holds more than the bound less its headroom, 1/16 of it rounded up, none
//! below 4 places ([`headroom`]): a request of another tenant then finds a place at once, as it would if it
//! were alone. The engine batches the headroom's few sequences less while one tenant has it
//! to itself (a decoding engine's throughput barely changes near its batch limit).
//! A waiter gives its place back when dropped (its client left, or its activation deadline
//! passed); a dispatched [`Permit`] is held until the response's last byte and dispatches the
//! next waiter when dropped.
//!
//! Cost: one uncontended mutex per dispatch and per release; choosing the next waiter scans
//! the backlogged tenants of the top band (`O(tenants)`), not the waiters.

use std::{
    cmp::Reverse,
    collections::{BTreeMap, HashMap, VecDeque},
    sync::{
        Arc, Mutex, MutexGuard,
        atomic::{AtomicUsize, Ordering},
    },
    time::Instant,
};

use tokio::sync::oneshot;

use crate::endpoints::EndpointSet;

/// A tenant's index in the replica's [`crate::tenants::Tenants`] table.
pub type TenantId = u32;

/// vLLM's default `--max-num-seqs`: the sequences one engine batches at once. Beyond it the
/// engine queues requests first come, first served, so the gateway holds them instead, where
/// they can be ordered fairly.
pub const DEFAULT_CONTAINER_CONCURRENCY: u32 = 256;

/// One model's bound on requests in flight and its queue of the others.
#[derive(Debug)]
pub struct FairQueue {
    /// Requests in flight per ready backend replica.
    per_replica: u32,
    /// The model's ready endpoints: the bound is `per_replica` × their number.
    backends: EndpointSet,
    /// Gateway replicas sharing the bound (this one and its peers; at least 1).
    gateways: Arc<AtomicUsize>,
    /// Whether requests may come from several tenants: then one tenant keeps off the headroom.
    tenants: bool,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    in_flight: u64,
    /// In flight per tenant.
    in_flight_of: HashMap<TenantId, u64>,
    queued: usize,
    next_id: u64,
    /// Bands with waiters, highest priority first.
    bands: BTreeMap<Reverse<i32>, Band>,
    /// Tokens served (virtual), per tenant.
    counters: HashMap<TenantId, f64>,
    /// Per band, the counter of the tenant dispatched last there.
    last: HashMap<i32, f64>,
}

#[derive(Debug, Default)]
struct Band {
    /// The band's backlogged tenants and their waiters, oldest first.
    tenants: HashMap<TenantId, VecDeque<Waiter>>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    tx: oneshot::Sender<Permit>,
    /// The prompt's estimate, charged at dispatch.
    prompt_tokens: f64,
}

/// A tenant and its band, as a request is dispatched for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim {
    /// The tenant.
    pub tenant: TenantId,
    /// Its priority band: higher is dispatched first.
    pub priority: i32,
}

/// What [`FairQueue::enter`] gives: a permit at once, or a place in the queue.
#[derive(Debug)]
pub enum Entry {
    /// Dispatched.
    Dispatched(Permit),
    /// Waiting; await [`Ticket::wait`].
    Queued(Ticket),
}

impl FairQueue {
    /// A queue for the model whose ready endpoints are `backends`, with `per_replica` requests
    /// in flight per ready endpoint (at least 1).
    pub fn new(per_replica: u32, backends: EndpointSet) -> Arc<Self> {
        Self::with_tenants(per_replica, backends, Arc::new(AtomicUsize::new(1)), false)
    }

    /// [`FairQueue::new`], the bound shared with the other gateway replicas (`gateways` holds
    /// how many there are, this one included), for requests of several tenants (`tenants`:
    /// one tenant then keeps off the [`headroom`]).
    pub fn with_tenants(
        per_replica: u32,
        backends: EndpointSet,
        gateways: Arc<AtomicUsize>,
        tenants: bool,
    ) -> Arc<Self> {
        Arc::new(Self {
            per_replica: per_replica.max(1),
            backends,
            gateways,
            tenants,
            inner: Mutex::new(Inner::default()),
        })
    }

    /// The most places one tenant holds under `capacity`.
    fn tenant_limit(&self, capacity: u64) -> u64 {
        if self.tenants {
            capacity.saturating_sub(headroom(capacity)).max(1)
        } else {
            capacity
        }
    }

    /// `containerConcurrency`: requests in flight per ready replica.
    pub fn per_replica(&self) -> u32 {
        self.per_replica
    }

    /// This replica's share of `containerConcurrency` on one endpoint, rounded up: the
    /// requests it may have in flight there before the engine's batch is full.
    pub fn per_endpoint(&self) -> usize {
        let gateways = self.gateways.load(Ordering::Relaxed).max(1);
        usize::try_from(self.per_replica)
            .unwrap_or(usize::MAX)
            .div_ceil(gateways)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// This replica's bound: its share of `per_replica` × ready endpoints, rounded up.
    fn capacity(&self) -> u64 {
        let all = u64::from(self.per_replica) * self.backends.len() as u64;
        let gateways = self.gateways.load(Ordering::Relaxed).max(1) as u64;
        all.div_ceil(gateways)
    }

    /// Dispatches `claim`'s request now if the bound allows and nobody waits, else queues it.
    /// `prompt_tokens` is charged to the tenant's counter when it is dispatched (a waiting
    /// request costs nothing: a tenant's backlog does not push it behind others).
    pub fn enter(self: &Arc<Self>, claim: Claim, prompt_tokens: f64) -> Entry {
        let capacity = self.capacity();
        let limit = self.tenant_limit(capacity);
        let mut inner = self.lock();
        let held = inner.in_flight_of.get(&claim.tenant).copied().unwrap_or(0);
        if inner.queued == 0 && inner.in_flight < capacity && held < limit {
            inner.in_flight += 1;
            *inner.in_flight_of.entry(claim.tenant).or_default() += 1;
            // Nobody waits: nothing to be fair to; the counter still follows the band's.
            let last = inner.last.get(&claim.priority).copied().unwrap_or(0.0);
            let counter = {
                let c = inner.counters.entry(claim.tenant).or_insert(0.0);
                *c = c.max(last) + prompt_tokens;
                *c
            };
            inner.last.insert(claim.priority, counter - prompt_tokens);
            drop(inner);
            return Entry::Dispatched(Permit::new(self.clone(), claim));
        }
        let id = inner.next_id;
        inner.next_id += 1;
        let (tx, rx) = oneshot::channel();
        let lifted = lift(&inner, claim);
        let band = inner.bands.entry(Reverse(claim.priority)).or_default();
        let waiters = band.tenants.entry(claim.tenant).or_default();
        let newly_backlogged = waiters.is_empty();
        waiters.push_back(Waiter {
            id,
            tx,
            prompt_tokens,
        });
        inner.queued += 1;
        if newly_backlogged {
            let c = inner.counters.entry(claim.tenant).or_insert(0.0);
            *c = c.max(lifted);
        }
        self.pump(&mut inner, capacity);
        drop(inner);
        Entry::Queued(Ticket {
            queue: self.clone(),
            claim,
            id,
            rx,
            since: Instant::now(),
        })
    }

    /// Dispatches waiters while the bound allows (`capacity` read by the caller).
    fn pump(self: &Arc<Self>, inner: &mut Inner, capacity: u64) {
        let limit = self.tenant_limit(capacity);
        while inner.in_flight < capacity {
            let Some((priority, tenant, waiter)) = next(inner, limit) else {
                return;
            };
            inner.queued -= 1;
            let permit = Permit::new(self.clone(), Claim { tenant, priority });
            if let Err(mut permit) = waiter.tx.send(permit) {
                // Its ticket was dropped meanwhile: the place goes to the next one, and the
                // tenant is charged nothing.
                permit.armed = false;
                continue;
            }
            inner.in_flight += 1;
            *inner.in_flight_of.entry(tenant).or_default() += 1;
            let counter = inner.counters.entry(tenant).or_insert(0.0);
            inner.last.insert(priority, *counter);
            *counter += waiter.prompt_tokens;
        }
    }

    /// Dispatches what the bound allows now: call after the ready endpoints changed.
    pub fn refresh(self: &Arc<Self>) {
        let capacity = self.capacity();
        let mut inner = self.lock();
        self.pump(&mut inner, capacity);
    }

    /// Requests waiting and in flight now.
    pub fn counts(&self) -> (usize, u64) {
        let inner = self.lock();
        (inner.queued, inner.in_flight)
    }

    /// `tenant`'s virtual token counter (tokens served, as charged).
    pub fn counter(&self, tenant: TenantId) -> f64 {
        self.lock().counters.get(&tenant).copied().unwrap_or(0.0)
    }

    fn charge(&self, tenant: TenantId, tokens: f64) {
        *self.lock().counters.entry(tenant).or_insert(0.0) += tokens;
    }

    fn release(self: &Arc<Self>, tenant: TenantId) {
        let capacity = self.capacity();
        let mut inner = self.lock();
        inner.in_flight = inner.in_flight.saturating_sub(1);
        untake(&mut inner, tenant);
        self.pump(&mut inner, capacity);
    }

    fn leave(&self, claim: Claim, id: u64) {
        let mut inner = self.lock();
        let Some(band) = inner.bands.get_mut(&Reverse(claim.priority)) else {
            return;
        };
        let Some(waiters) = band.tenants.get_mut(&claim.tenant) else {
            return;
        };
        let Some(at) = waiters.iter().position(|w| w.id == id) else {
            return;
        };
        waiters.remove(at);
        if waiters.is_empty() {
            band.tenants.remove(&claim.tenant);
        }
        if band.tenants.is_empty() {
            inner.bands.remove(&Reverse(claim.priority));
        }
        inner.queued -= 1;
    }
}

/// The counter a tenant of `claim` that starts waiting is lifted to: the lowest of the tenants
/// waiting in its band, or the last one dispatched there.
fn lift(inner: &Inner, claim: Claim) -> f64 {
    let waiting = inner
        .bands
        .get(&Reverse(claim.priority))
        .into_iter()
        .flat_map(|b| b.tenants.keys())
        .filter(|t| **t != claim.tenant)
        .map(|t| inner.counters.get(t).copied().unwrap_or(0.0))
        .reduce(f64::min);
    waiting.unwrap_or_else(|| inner.last.get(&claim.priority).copied().unwrap_or(0.0))
}

/// One place of `tenant` given back.
fn untake(inner: &mut Inner, tenant: TenantId) {
    if let Some(n) = inner.in_flight_of.get_mut(&tenant) {
        *n = n.saturating_sub(1);
        if *n == 0 {
            inner.in_flight_of.remove(&tenant);
        }
    }
}

/// The places kept from any one tenant out of `capacity`: 1/16, rounded up; none below 4
/// places (a lone tenant would lose too large a part of a small bound).
pub fn headroom(capacity: u64) -> u64 {
    if capacity < 4 {
        0
    } else {
        capacity.div_ceil(16)
    }
}

/// Takes the next waiter: in the highest band with a tenant holding fewer than `limit`
/// places, that band's such tenant with the lowest counter (ties: the oldest waiter), its
/// oldest waiter.
fn next(inner: &mut Inner, limit: u64) -> Option<(i32, TenantId, Waiter)> {
    let counters = &inner.counters;
    let held = &inner.in_flight_of;
    let (priority, tenant) = inner.bands.iter().find_map(|(&Reverse(priority), band)| {
        band.tenants
            .iter()
            .filter(|(t, _)| held.get(t).copied().unwrap_or(0) < limit)
            .map(|(t, w)| {
                let c = counters.get(t).copied().unwrap_or(0.0);
                (c, w.front().map_or(u64::MAX, |w| w.id), *t)
            })
            .min_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
            .map(|(_, _, t)| (priority, t))
    })?;
    let band = inner.bands.get_mut(&Reverse(priority))?;
    let waiters = band.tenants.get_mut(&tenant)?;
    let waiter = waiters.pop_front()?;
    if waiters.is_empty() {
        band.tenants.remove(&tenant);
    }
    if band.tenants.is_empty() {
        inner.bands.remove(&Reverse(priority));
    }
    Some((priority, tenant, waiter))
}

/// A request's place in flight: dispatches the next waiter when dropped.
#[derive(Debug)]
pub struct Permit {
    queue: Arc<FairQueue>,
    claim: Claim,
    armed: bool,
}

impl Permit {
    fn new(queue: Arc<FairQueue>, claim: Claim) -> Self {
        Self {
            queue,
            claim,
            armed: true,
        }
    }

    /// Adds `tokens` (may be negative: a correction to the response's `usage`) to the tenant's
    /// counter.
    pub fn charge(&self, tokens: f64) {
        if tokens != 0.0 {
            self.queue.charge(self.claim.tenant, tokens);
        }
    }

    /// The tenant and band it was dispatched for.
    pub fn claim(&self) -> Claim {
        self.claim
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.armed {
            self.queue.release(self.claim.tenant);
        }
    }
}

/// A place in the queue.
#[derive(Debug)]
pub struct Ticket {
    queue: Arc<FairQueue>,
    claim: Claim,
    id: u64,
    rx: oneshot::Receiver<Permit>,
    since: Instant,
}

impl Ticket {
    /// Waits for the permit until `deadline`; `None` then (the place is given back).
    pub async fn wait(mut self, deadline: Instant) -> Option<Permit> {
        // Woken when the ready endpoints change: the bound may have risen (a replica turned
        // ready) and nobody else dispatches then.
        let mut ready = self.queue.backends.subscribe();
        ready.borrow_and_update();
        // A change between `enter` and the subscription above would otherwise go unseen.
        self.queue.refresh();
        loop {
            tokio::select! {
                permit = &mut self.rx => return permit.ok(),
                changed = ready.changed() => {
                    if changed.is_err() {
                        // The set is gone (the model left the table): wait out the permit or
                        // the deadline only.
                        return tokio::select! {
                            permit = &mut self.rx => permit.ok(),
                            _ = tokio::time::sleep_until(deadline.into()) => None,
                        };
                    }
                    self.queue.refresh();
                }
                _ = tokio::time::sleep_until(deadline.into()) => return None,
            }
        }
    }

    /// When it started waiting.
    pub fn since(&self) -> Instant {
        self.since
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        // Still queued: leave. Already dispatched: the permit in the channel drops with it and
        // dispatches the next waiter.
        self.rx.close();
        if let Ok(permit) = self.rx.try_recv() {
            drop(permit);
        } else {
            self.queue.leave(self.claim, self.id);
        }
    }
}

#[cfg(test)]
mod tests;

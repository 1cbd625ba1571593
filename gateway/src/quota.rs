//! Tenants' quotas: requests per minute and tokens per minute, enforced across the gateway's
//! replicas.
//!
//! Each quota is a bucket holding at most one minute's allowance and refilled continuously at
//! `limit / 60` per second. A request takes one request and its token estimate (the prompt's
//! bytes / 4 plus `max_tokens` when it asks for them) at admission; when the response's
//! `usage` is known the estimate is corrected to it ([`Quotas::settle`]), so a bucket may go
//! below zero and then refuses until refilled. A request is refused with OpenAI's
//! `rate_limit_exceeded` (`429`, `Retry-After`) when its bucket holds less than one request, or
//! fewer tokens than it asks for (or a whole minute's allowance, when it asks for more).
//!
//! **Across replicas.** Each replica serves its usage so far, per tenant, at
//! [`USAGE_PATH`] and reads every peer's every [`SYNC_INTERVAL`]; what a peer used since
//! its last report is taken from this replica's buckets too. So every replica's buckets hold
//! the whole gateway's usage, late by at most one interval and one round trip: with `n`
//! replicas, a tenant can pass its quota by at most `(n - 1)` × its rate × that delay. A peer
//! that cannot be read is skipped (its usage is counted once it answers again: the reports are
//! totals, not deltas); one that restarted reports from zero and is followed from there.
//!
//! OpenAI's rate-limit headers go with every answer to a tenant with a quota
//! ([`Quotas::headers`]): `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`,
//! `x-ratelimit-reset-requests` and the same three for tokens (reset as a duration, `"6s"`,
//! `"1m0s"`: until the bucket is full again).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use axum::http::{HeaderMap, HeaderName, HeaderValue};

use crate::{fair::TenantId, tenants::Tenants};

/// The most a bucket owes: this many minutes of its allowance. A tenant that used more (answers
/// far past their estimates, a peer's report) is refused for at most this long.
pub const MAX_DEBT_MINUTES: f64 = 60.0;
const MAX_DEBT_MINUTES_DURATION: Duration = Duration::from_secs(60 * 61);

/// How often a replica reads its peers' usage.
pub const SYNC_INTERVAL: Duration = Duration::from_millis(250);
/// Where a replica serves its usage for its peers.
pub const USAGE_PATH: &str = "/hearth/quota-usage";

/// Which quota refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
}

impl Limit {
    /// OpenAI's error `type` and the headers' suffix: `requests` or `tokens`.
    pub const fn word(self) -> &'static str {
        match self {
            Self::Requests => "requests",
            Self::Tokens => "tokens",
        }
    }
}

/// A refusal: which quota, its limit per minute, and when to retry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limited {
    /// The tenant's name.
    pub tenant: Arc<str>,
    /// The quota.
    pub limit: Limit,
    /// Its limit per minute.
    pub per_minute: u64,
    /// What the request asked for (1, or its token estimate).
    pub requested: u64,
    /// When the bucket will hold what the request asks for.
    pub retry_after: Duration,
    /// The rate-limit headers of the answer.
    pub headers: HeaderMap,
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    per_minute: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(per_minute: u64, now: Instant) -> Self {
        Self {
            per_minute: per_minute as f64,
            level: per_minute as f64,
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_minute / 60.0).min(self.per_minute);
        self.at = now;
    }

    /// Time until the bucket holds `want`.
    fn wait_for(&self, want: f64) -> Duration {
        let missing = (want - self.level).max(0.0);
        Duration::try_from_secs_f64(missing * 60.0 / self.per_minute.max(1e-9))
            .unwrap_or(Duration::MAX)
            .min(MAX_DEBT_MINUTES_DURATION)
    }
}

#[derive(Debug, Default)]
struct TenantQuota {
    requests: Option<Bucket>,
    tokens: Option<Bucket>,
    /// This replica's usage so far: requests, tokens (for the peers).
    used: (u64, i64),
}

/// A tenant's token estimate taken from its quota at admission ([`Quotas::admit`]): corrected
/// to the answer's usage by [`Charge::settle`], or given back whole when dropped unsettled (the
/// request was refused or left before a backend served it).
#[derive(Debug)]
pub struct Charge {
    quotas: Arc<Quotas>,
    tenant: TenantId,
    estimate: u64,
    settled: std::sync::atomic::AtomicBool,
}

impl Charge {
    /// The `estimate` taken from `tenant`'s quota in `quotas`.
    pub fn new(quotas: Arc<Quotas>, tenant: TenantId, estimate: u64) -> Self {
        Self {
            quotas,
            tenant,
            estimate,
            settled: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Corrects the estimate to the tokens `used` (once).
    pub fn settle(&self, used: u64) {
        if !self.settled.swap(true, std::sync::atomic::Ordering::AcqRel) {
            let used = i64::try_from(used).unwrap_or(i64::MAX);
            let estimate = i64::try_from(self.estimate).unwrap_or(i64::MAX);
            self.quotas.settle(self.tenant, used - estimate);
        }
    }
}

impl Drop for Charge {
    fn drop(&mut self) {
        // Never served: nothing was used.
        self.settle(0);
    }
}

/// Usage so far per tenant name: `(requests, tokens)`.
pub type Usage = HashMap<String, (u64, i64)>;

/// The replica's quotas, per tenant.
#[derive(Debug)]
pub struct Quotas {
    tenants: Tenants,
    state: Mutex<Vec<TenantQuota>>,
    /// Per peer (`host:port`): its instance and the usage last read from it.
    peers: Mutex<HashMap<String, (String, Usage)>>,
}

impl Quotas {
    /// The quotas of `tenants`, full.
    pub fn new(tenants: Tenants) -> Self {
        let now = Instant::now();
        let state = tenants
            .iter()
            .map(|(_, t)| TenantQuota {
                requests: t.requests_per_minute.map(|l| Bucket::new(l, now)),
                tokens: t.tokens_per_minute.map(|l| Bucket::new(l, now)),
                used: (0, 0),
            })
            .collect();
        Self {
            tenants,
            state: Mutex::new(state),
            peers: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<TenantQuota>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The tenants.
    pub fn tenants(&self) -> &Tenants {
        &self.tenants
    }

    /// Whether `tenant` has a quota at all.
    pub fn limited(&self, tenant: TenantId) -> bool {
        let t = self.tenants.get(tenant);
        t.requests_per_minute.is_some() || t.tokens_per_minute.is_some()
    }

    /// Takes one request and `tokens` (its estimate) from `tenant`'s quotas at `now`, or says
    /// which quota refuses it. Nothing is taken from either when one refuses.
    ///
    /// # Errors
    /// [`Limited`] with the quota, its limit and when to retry.
    pub fn admit(&self, tenant: TenantId, tokens: u64, now: Instant) -> Result<(), Box<Limited>> {
        let mut state = self.lock();
        let Some(q) = state.get_mut(tenant as usize) else {
            return Ok(());
        };
        let mut refused = None;
        for (bucket, limit, want) in [
            (&mut q.requests, Limit::Requests, 1.0),
            (&mut q.tokens, Limit::Tokens, tokens as f64),
        ] {
            let Some(b) = bucket else { continue };
            b.refill(now);
            // A request asking for more than a minute's allowance waits for a full bucket.
            let want = want.min(b.per_minute);
            if b.level < want {
                let retry_after = b.wait_for(want).max(Duration::from_millis(1));
                refused = Some((limit, b.per_minute as u64, want as u64, retry_after));
                break;
            }
        }
        if let Some((limit, per_minute, requested, retry_after)) = refused {
            return Err(Box::new(Limited {
                tenant: self.tenants.get(tenant).name.clone(),
                limit,
                per_minute,
                requested,
                retry_after,
                headers: headers_of(q, now),
            }));
        }
        take(q, 1, i64::try_from(tokens).unwrap_or(i64::MAX));
        Ok(())
    }

    /// Corrects `tenant`'s token estimate by `delta` (the response's `usage` less the
    /// estimate; negative gives tokens back).
    pub fn settle(&self, tenant: TenantId, delta: i64) {
        if delta == 0 {
            return;
        }
        if let Some(q) = self.lock().get_mut(tenant as usize) {
            take(q, 0, delta);
        }
    }

    /// OpenAI's rate-limit headers for `tenant` now (none without a quota).
    pub fn headers(&self, tenant: TenantId) -> HeaderMap {
        let mut h = HeaderMap::with_capacity(6);
        self.write_headers(tenant, &mut h);
        h
    }

    /// Writes OpenAI's rate-limit headers for `tenant` now into `h` (an answer's own headers:
    /// no map of their own is built), replacing any of the same name; none without a quota.
    pub fn write_headers(&self, tenant: TenantId, h: &mut HeaderMap) {
        let now = Instant::now();
        if let Some(q) = self.lock().get_mut(tenant as usize) {
            write_headers(q, now, h);
        }
    }

    /// This replica's usage so far, per tenant name: `{"<tenant>": [requests, tokens]}`.
    pub fn usage(&self) -> Usage {
        self.lock()
            .iter()
            .enumerate()
            .filter(|(_, q)| q.used != (0, 0))
            .map(|(i, q)| {
                let id = TenantId::try_from(i).unwrap_or(TenantId::MAX);
                (self.tenants.get(id).name.to_string(), q.used)
            })
            .collect()
    }

    /// Takes from the buckets what peer `peer` (of `instance`) used since its last report,
    /// whose totals are `usage`.
    pub fn peer_usage(&self, peer: &str, instance: &str, usage: Usage) {
        let mut peers = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        let first = match peers.get(peer) {
            Some((seen, _)) => seen != instance,
            None => true,
        };
        if first {
            // A peer seen for the first time (this replica just started, or the peer did, or it
            // came back to the list): its totals so far are the baseline, charged nothing, so a
            // replica never takes a peer's lifetime usage at once. At most one report interval
            // of a restarted peer goes uncounted.
            peers.insert(peer.to_owned(), (instance.to_owned(), usage));
            return;
        }
        let Some(entry) = peers.get_mut(peer) else {
            return;
        };
        let mut state = self.lock();
        for (name, (requests, tokens)) in &usage {
            let (seen_r, seen_t) = entry.1.get(name).copied().unwrap_or((0, 0));
            let Some(id) = self.tenants.id(name) else {
                continue;
            };
            if let Some(q) = state.get_mut(id as usize) {
                let dr = requests.saturating_sub(seen_r);
                let dt = tokens.saturating_sub(seen_t);
                take_remote(q, dr, dt);
            }
        }
        entry.1 = usage;
    }

    /// How many peers have reported (their first report is the baseline their later use is
    /// counted from).
    pub fn known_peers(&self) -> usize {
        self.peers.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Forgets peers not in `peers`.
    pub fn retain_peers(&self, peers: &[String]) {
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p, _| peers.contains(p));
    }
}

/// Takes `requests` and `tokens` from `q`'s buckets and counts them as this replica's usage.
fn take(q: &mut TenantQuota, requests: u64, tokens: i64) {
    take_remote(q, requests, tokens);
    q.used.0 = q.used.0.saturating_add(requests);
    q.used.1 = q.used.1.saturating_add(tokens);
}

/// Takes `requests` and `tokens` from `q`'s buckets.
fn take_remote(q: &mut TenantQuota, requests: u64, tokens: i64) {
    // Each bucket is bounded below by [`MAX_DEBT_MINUTES`] of its allowance (a wrong `usage` or
    // report cannot lock a tenant out for longer), and above by one minute's (an estimate given
    // back is no credit).
    for (bucket, n) in [
        (&mut q.requests, requests as f64),
        (&mut q.tokens, tokens as f64),
    ] {
        if let Some(b) = bucket {
            b.level = (b.level - n).clamp(-b.per_minute * MAX_DEBT_MINUTES, b.per_minute);
        }
    }
}

/// OpenAI's rate-limit header names, per quota: limit, remaining, reset.
const HEADERS: [(Limit, [HeaderName; 3]); 2] = [
    (
        Limit::Requests,
        [
            HeaderName::from_static("x-ratelimit-limit-requests"),
            HeaderName::from_static("x-ratelimit-remaining-requests"),
            HeaderName::from_static("x-ratelimit-reset-requests"),
        ],
    ),
    (
        Limit::Tokens,
        [
            HeaderName::from_static("x-ratelimit-limit-tokens"),
            HeaderName::from_static("x-ratelimit-remaining-tokens"),
            HeaderName::from_static("x-ratelimit-reset-tokens"),
        ],
    ),
];

fn headers_of(q: &mut TenantQuota, now: Instant) -> HeaderMap {
    let mut h = HeaderMap::with_capacity(6);
    write_headers(q, now, &mut h);
    h
}

/// Writes `q`'s `x-ratelimit-*` headers at `now` into `h`.
fn write_headers(q: &mut TenantQuota, now: Instant, h: &mut HeaderMap) {
    for (limit, [limit_name, remaining, reset]) in HEADERS {
        let bucket = match limit {
            Limit::Requests => &mut q.requests,
            Limit::Tokens => &mut q.tokens,
        };
        let Some(b) = bucket else { continue };
        b.refill(now);
        h.insert(limit_name, HeaderValue::from(b.per_minute as u64));
        h.insert(
            remaining,
            HeaderValue::from(b.level.max(0.0).floor() as u64),
        );
        if let Ok(v) = HeaderValue::try_from(openai_duration(b.wait_for(b.per_minute))) {
            h.insert(reset, v);
        }
    }
}

/// A duration as OpenAI writes it in `x-ratelimit-reset-*`: `"1s"`, `"6m0s"`, `"20ms"`.
pub fn openai_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let s = d.as_secs_f64();
    if s < 60.0 {
        let r = (s * 1000.0).round() / 1000.0;
        return format!("{r}s");
    }
    let m = (s / 60.0).floor() as u64;
    let rest = s - (m as f64) * 60.0;
    format!("{m}m{}s", rest.round() as u64)
}

/// Reads the peers' usage every [`SYNC_INTERVAL`] until dropped; `peers` gives the current
/// peer list (`host:port` of their admin ports), `own` is this replica's instance (a peer
/// answering with it is this replica and is skipped), `auth` gives the token sent to them.
pub async fn sync_peers(
    quotas: Arc<Quotas>,
    peers: tokio::sync::watch::Receiver<Vec<String>>,
    own: String,
    auth: crate::admin::AdminAuth,
) {
    use http_body_util::{BodyExt, Empty};
    let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(Duration::from_secs(1)));
    let client: hyper_util::client::legacy::Client<_, Empty<bytes::Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(connector);
    let mut tick = tokio::time::interval(SYNC_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let list = peers.borrow().clone();
        quotas.retain_peers(&list);
        let reads = list.iter().map(|peer| {
            let client = client.clone();
            let authorization = auth.authorization();
            async move {
                let mut req = http::Request::get(format!("http://{peer}{USAGE_PATH}"));
                if let Some(v) = authorization {
                    req = req.header(http::header::AUTHORIZATION, v);
                }
                let req = req.body(Empty::new()).ok()?;
                let resp = tokio::time::timeout(SYNC_INTERVAL * 4, client.request(req))
                    .await
                    .ok()?
                    .ok()?;
                if !resp.status().is_success() {
                    return None;
                }
                let body = tokio::time::timeout(SYNC_INTERVAL * 4, resp.into_body().collect())
                    .await
                    .ok()?
                    .ok()?
                    .to_bytes();
                let report: UsageReport = serde_json::from_slice(&body).ok()?;
                Some((peer.clone(), report))
            }
        });
        for (peer, report) in futures::future::join_all(reads).await.into_iter().flatten() {
            if report.instance != own {
                quotas.peer_usage(&peer, &report.instance, report.tenants);
            }
        }
    }
}

/// What [`USAGE_PATH`] answers: the replica's instance and its usage so far, per tenant.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
pub struct UsageReport {
    /// The replica (see [`crate::demand::DemandHub::instance`]), in hex.
    pub instance: String,
    /// `{"<tenant>": [requests, tokens]}`.
    pub tenants: Usage,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::Tenant;

    fn quotas(rpm: Option<u64>, tpm: Option<u64>) -> Quotas {
        let mut t = Tenant::parse("name=a,key-file=/k").unwrap();
        t.requests_per_minute = rpm;
        t.tokens_per_minute = tpm;
        Quotas::new(Tenants::new(vec![t]).unwrap())
    }

    #[test]
    fn requests_past_the_rate_are_refused_until_refilled() {
        let q = quotas(Some(60), None);
        let t0 = Instant::now();
        for _ in 0..60 {
            q.admit(1, 0, t0).unwrap();
        }
        let err = q.admit(1, 0, t0).unwrap_err();
        assert_eq!(err.limit, Limit::Requests);
        assert_eq!(err.per_minute, 60);
        assert!(err.retry_after <= Duration::from_secs(1), "{err:?}");
        assert_eq!(err.headers["x-ratelimit-remaining-requests"], "0");
        assert_eq!(err.headers["x-ratelimit-limit-requests"], "60");
        // One request a second comes back.
        q.admit(1, 0, t0 + Duration::from_secs(1)).unwrap();
        // The default tenant has no quota.
        for _ in 0..1000 {
            q.admit(0, 1000, t0).unwrap();
        }
    }

    #[test]
    fn tokens_are_estimated_then_settled_to_the_usage() {
        let q = quotas(None, Some(1000));
        let t0 = Instant::now();
        q.admit(1, 600, t0).unwrap();
        // 400 left: a request for 500 waits.
        let err = q.admit(1, 500, t0).unwrap_err();
        assert_eq!(err.limit, Limit::Tokens);
        assert!(err.retry_after > Duration::from_secs(5), "{err:?}");
        // The answer used 100 tokens only: 500 come back.
        q.settle(1, -500);
        q.admit(1, 500, t0).unwrap();
        // More than a minute's allowance waits for a full bucket, not forever.
        let err = q.admit(1, 5000, t0).unwrap_err();
        assert_eq!(err.requested, 1000);
        // An estimate given back never fills the bucket past a minute's allowance.
        q.settle(1, -100_000);
        q.admit(1, 1000, t0).unwrap();
        assert!(q.admit(1, 1, t0).is_err());
    }

    #[test]
    fn a_peers_usage_counts_from_when_it_is_first_seen_and_once() {
        let q = quotas(Some(10), None);
        let t0 = Instant::now();
        let report = |n| HashMap::from([("a".to_owned(), (n, 0))]);
        // First report: the baseline (its lifetime usage is not taken at once).
        q.peer_usage("p:8080", "i1", report(100_000));
        q.peer_usage("p:8080", "i1", report(100_006));
        q.peer_usage("p:8080", "i1", report(100_006));
        for _ in 0..4 {
            q.admit(1, 0, t0).unwrap();
        }
        assert!(q.admit(1, 0, t0).is_err());
        // The peer restarted: a new baseline, nothing charged; its later use counts.
        q.peer_usage("p:8080", "i2", report(0));
        q.peer_usage("p:8080", "i2", report(1));
        assert!(q.admit(1, 0, t0 + Duration::from_secs(12)).is_ok());
        assert_eq!(q.usage()["a"], (5, 0));
        // A garbage report cannot lock the tenant out for more than MAX_DEBT_MINUTES.
        q.peer_usage("p:8080", "i2", report(u64::MAX));
        let err = q.admit(1, 0, t0).unwrap_err();
        assert!(err.retry_after <= Duration::from_secs(61 * 60), "{err:?}");
    }

    #[test]
    fn durations_are_written_as_openai_does() {
        assert_eq!(openai_duration(Duration::from_millis(20)), "20ms");
        assert_eq!(openai_duration(Duration::from_millis(1500)), "1.5s");
        assert_eq!(openai_duration(Duration::from_secs(360)), "6m0s");
    }
}

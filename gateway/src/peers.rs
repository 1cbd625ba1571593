//! Demand aggregation over gateway replicas.
//!
//! Each replica serves its own demand at `GET /hearth/local-demand` as a long-lived
//! newline-delimited JSON stream (`{"demand": N}` at connect, on every change, and every
//! [`KEEPALIVE`] as a liveness signal). Each replica subscribes to every peer found in the
//! gateway Service's EndpointSlices, so a cold request on any replica reaches the replica KEDA
//! talks to within one network hop, with no polling and no cache to go stale.
//!
//! A peer whose stream is not connected, or sends no complete demand line for
//! [`PEER_SILENCE`], is *unknown*: the total demand is then an error (see [`crate::demand`]),
//! never a silently low number. So is a peer that answers anything but well-formed lines of at
//! most [`MAX_LINE`] bytes holding a count a replica can hold (`0..=i64::MAX`).
//!
//! Each stream names the replica serving it in the [`INSTANCE_HEADER`] response header, so a
//! replica that finds itself in its own peer list (a missing or wrong `--pod-ip`) counts that
//! peer as 0 instead of counting its own demand twice.
//!
//! **Shared gateways.** A replica of a shared gateway serves every model's local demand in one
//! line, `{"demand": {"<namespace>/<name>": N, ...}}`, one entry per model of its route table,
//! and a subscriber adds each entry to its own model of that key (a model a peer does not list
//! counts 0 for that peer: the peer has no route to it, so no demand). A single-service gateway
//! keeps the line `{"demand": N}`, so replicas of different versions agree during a rollout;
//! both ends are this binary, and each refuses the other's shape with an error naming it (the
//! peer is then unknown, as for any bad line). Lines of a shared gateway may be up to
//! [`MAX_SHARED_LINE`] bytes.

use std::{
    collections::HashMap,
    net::IpAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{
    body::Body,
    http::{HeaderValue, header},
    response::Response,
};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{Client, connect::HttpConnector};
use tokio::{sync::watch, task::JoinHandle};

use crate::demand::{BUSY_RECHECK, DemandHub, DemandState};

/// How often a demand stream repeats its value when nothing changes.
pub const KEEPALIVE: Duration = Duration::from_secs(5);
/// A peer that sends no complete demand line for this long is considered unknown.
pub const PEER_SILENCE: Duration = Duration::from_secs(15);
/// Longest demand line accepted from a peer (a real one is about 15 bytes); a peer that sends
/// more without a newline is cut off instead of being buffered without bound.
pub const MAX_LINE: usize = 4096;
/// Longest demand line accepted from a shared gateway's peer (one entry per model: about
/// 40 bytes each).
pub const MAX_SHARED_LINE: usize = 4 << 20;
/// Response header of `/hearth/local-demand` naming the replica serving it (see
/// [`DemandHub::instance`]).
pub const INSTANCE_HEADER: &str = "x-hearth-instance";

fn instance_value(instance: u64) -> String {
    format!("{instance:016x}")
}

/// A replica's local demand, as a demand line carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerDemand {
    /// A single-service gateway's: `{"demand": N}`.
    One(u64),
    /// A shared gateway's, per model key (`<namespace>/<name>`): `{"demand": {"ns/a": N}}`.
    PerService(Arc<HashMap<String, u64>>),
    /// Nothing to add: the peer is this replica itself.
    Zero,
}

impl PeerDemand {
    /// The line for this demand (`Zero` is never sent).
    fn line(&self) -> Bytes {
        match self {
            PeerDemand::One(v) => Bytes::from(format!("{{\"demand\":{v}}}\n")),
            PeerDemand::PerService(m) => {
                #[derive(serde::Serialize)]
                struct Line<'a> {
                    demand: &'a HashMap<String, u64>,
                }
                let mut out = serde_json::to_vec(&Line { demand: m }).unwrap_or_default();
                out.push(b'\n');
                Bytes::from(out)
            }
            PeerDemand::Zero => Bytes::from_static(b"{\"demand\":0}\n"),
        }
    }

    /// Whether any demand is positive.
    fn busy(&self) -> bool {
        match self {
            PeerDemand::One(v) => *v > 0,
            PeerDemand::PerService(m) => m.values().any(|v| *v > 0),
            PeerDemand::Zero => false,
        }
    }
}

/// What a replica serves at `/hearth/local-demand`: its local demand now, and what wakes the
/// stream to look again.
pub(crate) trait DemandFeed: Send + 'static {
    /// The local demand now (marking what was seen).
    fn current(&mut self) -> PeerDemand;
    /// Resolves on a change that may matter while no demand is sent; `false` once the demand
    /// can no longer change (the replica is going away).
    fn changed(&mut self) -> impl Future<Output = bool> + Send + '_;
    /// Resolves on a change that must be sent at once even while demand is being sent (a
    /// shared gateway's model rising from 0); `false` as for [`DemandFeed::changed`].
    fn rose(&mut self) -> impl Future<Output = bool> + Send + '_;
    /// Whether the demand can no longer change.
    fn closed(&self) -> bool;
}

/// A single-service replica's demand: its one hub.
impl DemandFeed for watch::Receiver<DemandState> {
    fn current(&mut self) -> PeerDemand {
        PeerDemand::One(self.borrow_and_update().local())
    }

    async fn changed(&mut self) -> bool {
        watch::Receiver::changed(self).await.is_ok()
    }

    fn rose(&mut self) -> impl Future<Output = bool> + Send + '_ {
        // Demand is being sent already: nothing rises from 0.
        std::future::pending()
    }

    fn closed(&self) -> bool {
        self.has_changed().is_err()
    }
}

/// The `/hearth/local-demand` response of a single-service replica: local demand now, on every
/// change, and every [`KEEPALIVE`]; ends when `stop` turns true.
pub fn local_demand_stream(
    rx: watch::Receiver<DemandState>,
    stop: watch::Receiver<bool>,
) -> Response {
    let instance = rx.borrow().instance();
    demand_stream(rx, instance, stop)
}

/// The `/hearth/local-demand` response over `feed`, for replica `instance`: the demand now,
/// on every change (a rise from 0 at once, later changes within [`BUSY_RECHECK`]), and every
/// [`KEEPALIVE`]; ends when `stop` turns true.
pub(crate) fn demand_stream<F: DemandFeed>(
    feed: F,
    instance: u64,
    stop: watch::Receiver<bool>,
) -> Response {
    let instance = instance_value(instance);
    // The keepalive is due KEEPALIVE after the last line sent, not after the last wake-up:
    // changes that leave local demand as it is (a peer's value, say) must not postpone it, or
    // a busy cluster would starve an idle replica's liveness signal and make it unknown.
    let stream = futures::stream::unfold(
        (feed, stop, None::<PeerDemand>, tokio::time::Instant::now()),
        |(mut feed, mut stop, last, due)| async move {
            loop {
                if *stop.borrow() {
                    return None;
                }
                let v = feed.current();
                let next = tokio::time::Instant::now() + KEEPALIVE;
                if last.as_ref() != Some(&v) {
                    let line = v.line();
                    return Some((
                        Ok::<_, std::convert::Infallible>(line),
                        (feed, stop, Some(v), next),
                    ));
                }
                // With demand sent, look again every BUSY_RECHECK instead of waking on each
                // change (every request); the rise from 0 is sent at once.
                let busy = v.busy();
                let woken = async {
                    if busy {
                        feed.rose().await
                    } else {
                        feed.changed().await
                    }
                };
                tokio::select! {
                    ok = woken => if !ok { return None },
                    _ = tokio::time::sleep(BUSY_RECHECK), if busy => {
                        if feed.closed() { return None }
                    }
                    // A dropped sender would make `changed` ready forever.
                    r = stop.changed() => if r.is_err() { return None },
                    _ = tokio::time::sleep_until(due) => {
                        let line = v.line();
                        return Some((Ok(line), (feed, stop, Some(v), next)));
                    }
                }
            }
        },
    );
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    if let Ok(v) = HeaderValue::from_str(&instance) {
        resp.headers_mut().insert(INSTANCE_HEADER, v);
    }
    resp
}

/// The replicas in `endpoints` (the gateway Service's, as `host:port`) other than this one,
/// whose addresses are `own` (`--pod-ip`, every family of a dual-stack pod). An IPv4 address
/// and its IPv4-mapped IPv6 form are the same address.
pub fn other_replicas(
    endpoints: impl IntoIterator<Item = http::uri::Authority>,
    own: &[IpAddr],
) -> Vec<String> {
    endpoints
        .into_iter()
        .filter(|a| {
            let host = a.host().trim_matches(['[', ']']);
            !host
                .parse::<IpAddr>()
                .is_ok_and(|ip| own.iter().any(|o| o.to_canonical() == ip.to_canonical()))
        })
        .map(|a| a.to_string())
        .collect()
}

/// Where the peers' demand goes: a single-service replica's hub, or a shared replica's route
/// table (each entry to its model's hub).
pub trait PeerSink: Send + Sync + std::fmt::Debug + 'static {
    /// This replica's instance (see [`INSTANCE_HEADER`]).
    fn instance(&self) -> u64;
    /// Replaces the peer list (peers keep their last values; new ones start unknown) and marks
    /// discovery as working.
    fn set_peers(&self, peers: &[String]);
    /// Records a peer's local demand (`None`: unknown now); an error when its shape is not this
    /// replica's (a single-service peer of a shared replica, or the other way round).
    fn set_peer_value(&self, peer: &str, value: Option<PeerDemand>) -> Result<(), String>;
    /// Records that peer discovery fails, making the totals unknown until it works again.
    fn set_peer_discovery_error(&self, error: String);
    /// The longest line accepted from a peer.
    fn max_line(&self) -> usize {
        MAX_LINE
    }
}

impl PeerSink for DemandHub {
    fn instance(&self) -> u64 {
        DemandHub::instance(self)
    }

    fn set_peers(&self, peers: &[String]) {
        DemandHub::set_peers(self, peers.iter().cloned());
    }

    fn set_peer_value(&self, peer: &str, value: Option<PeerDemand>) -> Result<(), String> {
        let v = match value {
            None => None,
            Some(PeerDemand::One(n)) => Some(n),
            Some(PeerDemand::Zero) => Some(0),
            Some(PeerDemand::PerService(_)) => {
                return Err(
                    "the peer sends per-service demand: it is a shared gateway, not a replica of this single-service one (check --peer-service)".to_owned(),
                );
            }
        };
        DemandHub::set_peer_value(self, peer, v);
        Ok(())
    }

    fn set_peer_discovery_error(&self, error: String) {
        DemandHub::set_peer_discovery_error(self, error);
    }
}

/// Subscriptions to the peer replicas' demand streams.
#[derive(Debug, Clone)]
pub struct PeerSet {
    demand: Arc<dyn PeerSink>,
    client: Client<HttpConnector, Empty<Bytes>>,
    tasks: Arc<Mutex<HashMap<String, JoinHandle<()>>>>,
    silence: Duration,
    auth: crate::admin::AdminAuth,
}

impl PeerSet {
    /// Peers feeding `demand`: a [`DemandHub`] created with aggregation on, or a gateway's
    /// [`crate::Gateway::peer_sink`].
    pub fn new(demand: impl Into<Arc<dyn PeerSink>>) -> Self {
        Self::with_silence(demand, PEER_SILENCE)
    }

    /// Like [`PeerSet::new`], with a peer unknown after `silence` without a complete demand
    /// line instead of [`PEER_SILENCE`] (keep it above [`KEEPALIVE`] for real replicas).
    pub fn with_silence(demand: impl Into<Arc<dyn PeerSink>>, silence: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        Self {
            demand: demand.into(),
            client,
            tasks: Arc::new(Mutex::new(HashMap::new())),
            silence,
            auth: crate::admin::AdminAuth::open(),
        }
    }

    /// Sends the gateway's own admin token ([`crate::admin::AdminAuth::authorization`]) to the
    /// peers, whose admin port checks it; set before the first [`PeerSet::update`].
    #[must_use]
    pub fn authenticated(mut self, auth: crate::admin::AdminAuth) -> Self {
        self.auth = auth;
        self
    }

    /// Replaces the peer list (`host:port` of each other replica's HTTP port): subscribes to
    /// new peers and drops removed ones.
    pub fn update(&self, peers: Vec<String>) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        // Under the lock, so concurrent updates cannot leave the demand's peer list and the
        // subscriptions describing different lists.
        self.demand.set_peers(&peers);
        tasks.retain(|peer, task| {
            let keep = peers.contains(peer);
            if !keep {
                task.abort();
            }
            keep
        });
        for peer in peers {
            tasks.entry(peer.clone()).or_insert_with(|| {
                tokio::spawn(subscribe(
                    self.client.clone(),
                    self.auth.clone(),
                    self.demand.clone(),
                    peer,
                    self.silence,
                ))
            });
        }
    }

    /// Marks the total demand unknown because the peer list cannot be discovered.
    pub fn discovery_failed(&self, error: String) {
        self.demand.set_peer_discovery_error(error);
    }
}

impl From<DemandHub> for Arc<dyn PeerSink> {
    fn from(hub: DemandHub) -> Self {
        Arc::new(hub)
    }
}

impl Drop for PeerSet {
    fn drop(&mut self) {
        if Arc::strong_count(&self.tasks) == 1 {
            for (_, t) in self.tasks.lock().unwrap_or_else(|e| e.into_inner()).drain() {
                t.abort();
            }
        }
    }
}

/// How a peer's demand stream ended.
enum Ended {
    /// The peer closed it; reconnect.
    Closed,
    /// The peer is this replica itself: its demand is already counted locally.
    Itself,
}

/// Follows one peer's demand stream forever, reconnecting with backoff; the peer's value is
/// unknown whenever the stream is down or silent.
async fn subscribe(
    client: Client<HttpConnector, Empty<Bytes>>,
    auth: crate::admin::AdminAuth,
    demand: Arc<dyn PeerSink>,
    peer: String,
    silence: Duration,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        match follow(&client, &auth, &*demand, &peer, silence).await {
            Ok(Ended::Itself) => {
                tracing::warn!(%peer, "peer list holds this replica itself (check that --pod-ip, env POD_IPS, lists every address of the pod: downward API status.podIPs); counting it as 0");
                let _ = demand.set_peer_value(&peer, Some(PeerDemand::Zero));
                // Nothing more to learn from it; ends when the peer leaves the list.
                std::future::pending::<()>().await;
            }
            Ok(Ended::Closed) => tracing::debug!(%peer, "peer demand stream ended"),
            Err(e) => tracing::warn!(%peer, error = %e, "peer demand stream failed"),
        }
        let _ = demand.set_peer_value(&peer, None);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

/// Parses one demand line: `{"demand": N}` or `{"demand": {"<namespace>/<name>": N, ...}}`;
/// each `N` must be a count a replica can hold.
fn parse_line(line: &[u8]) -> Result<PeerDemand, String> {
    let count = |v: &serde_json::Value| v.as_u64().filter(|n| i64::try_from(*n).is_ok());
    let wrong = || {
        format!(
            "demand line without a \"demand\" count in 0..={} (or an object of such counts): {}",
            i64::MAX,
            String::from_utf8_lossy(&line[..line.len().min(64)])
        )
    };
    let v: serde_json::Value =
        serde_json::from_slice(line).map_err(|e| format!("bad demand line: {e}"))?;
    match &v["demand"] {
        serde_json::Value::Object(m) => m
            .iter()
            .map(|(k, v)| Some((k.clone(), count(v)?)))
            .collect::<Option<HashMap<_, _>>>()
            .map(|m| PeerDemand::PerService(Arc::new(m)))
            .ok_or_else(wrong),
        n => count(n).map(PeerDemand::One).ok_or_else(wrong),
    }
}

async fn follow(
    client: &Client<HttpConnector, Empty<Bytes>>,
    auth: &crate::admin::AdminAuth,
    demand: &dyn PeerSink,
    peer: &str,
    silence: Duration,
) -> Result<Ended, String> {
    let uri: http::Uri = format!("http://{peer}/hearth/local-demand")
        .parse()
        .map_err(|e| format!("bad peer address {peer}: {e}"))?;
    let mut req = http::Request::get(uri);
    if let Some(v) = auth.authorization() {
        req = req.header(header::AUTHORIZATION, v);
    }
    let req = req.body(Empty::new()).map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(silence, client.request(req))
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("answered {}", resp.status()));
    }
    let me = instance_value(demand.instance());
    if resp
        .headers()
        .get(INSTANCE_HEADER)
        .is_some_and(|v| v.as_bytes() == me.as_bytes())
    {
        return Ok(Ended::Itself);
    }
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    // Liveness is a complete line: bytes that never finish one do not keep a peer known.
    let mut deadline = tokio::time::Instant::now() + silence;
    loop {
        let frame = tokio::time::timeout_at(deadline, body.frame())
            .await
            .map_err(|_| format!("no demand line for {silence:?}"))?;
        let Some(frame) = frame else {
            return Ok(Ended::Closed);
        };
        let frame = frame.map_err(|e| e.to_string())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        // Only the new bytes are searched, and consumed lines are dropped once per frame, so a
        // burst of lines costs linear time.
        let searched = buf.len();
        buf.extend_from_slice(&data);
        let mut start = 0;
        let mut last = None;
        let mut from = searched;
        while let Some(i) = buf[from..].iter().position(|b| *b == b'\n') {
            let end = from + i;
            let line = buf[start..end].trim_ascii();
            if !line.is_empty() {
                last = Some(parse_line(line)?);
            }
            start = end + 1;
            from = start;
        }
        buf.drain(..start);
        let max_line = demand.max_line();
        if buf.len() > max_line {
            return Err(format!(
                "demand line longer than {max_line} bytes; not a gateway replica?"
            ));
        }
        if let Some(n) = last {
            demand.set_peer_value(peer, Some(n))?;
            deadline = tokio::time::Instant::now() + silence;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn auths(list: &[&str]) -> Vec<http::uri::Authority> {
        list.iter().map(|a| a.parse().unwrap()).collect()
    }

    #[test]
    fn a_replica_leaves_out_each_of_its_addresses() {
        let eps = auths(&[
            "10.0.0.7:8080",
            "10.0.0.8:8080",
            "[fd00::7]:8080",
            "[fd00::8]:8080",
        ]);
        let own: Vec<IpAddr> = vec!["fd00::7".parse().unwrap(), "10.0.0.7".parse().unwrap()];
        assert_eq!(
            other_replicas(eps, &own),
            ["10.0.0.8:8080", "[fd00::8]:8080"]
        );
    }

    #[test]
    fn an_ipv4_mapped_address_is_the_ipv4_address() {
        let eps = auths(&["[::ffff:10.0.0.7]:8080", "10.0.0.9:8080"]);
        let own: Vec<IpAddr> = vec!["10.0.0.7".parse().unwrap()];
        assert_eq!(other_replicas(eps, &own), ["10.0.0.9:8080"]);
    }

    #[test]
    fn names_are_kept_and_no_own_address_keeps_all() {
        let eps = auths(&["gw-0.gw:8080", "10.0.0.7:8080"]);
        assert_eq!(other_replicas(eps, &[]), ["gw-0.gw:8080", "10.0.0.7:8080"]);
    }

    #[test]
    fn demand_lines_are_one_count_or_one_per_service() {
        assert_eq!(parse_line(br#"{"demand":3}"#), Ok(PeerDemand::One(3)));
        let per = PeerDemand::PerService(Arc::new(HashMap::from([
            ("ns/a".to_owned(), 1),
            ("ns/b".to_owned(), 0),
        ])));
        let line = per.line();
        assert!(line.ends_with(b"\n"));
        assert_eq!(parse_line(line.trim_ascii()), Ok(per));
        assert_eq!(
            parse_line(PeerDemand::One(7).line().trim_ascii()),
            Ok(PeerDemand::One(7))
        );
        for bad in [
            &br#"{"demand":-1}"#[..],
            br#"{"demand":9223372036854775808}"#,
            br#"{"demand":{"ns/a":-1}}"#,
            br#"{"demand":{"ns/a":"1"}}"#,
            br#"{"demand":[1]}"#,
            br#"{"other":1}"#,
        ] {
            assert!(parse_line(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn a_single_service_hub_refuses_per_service_demand() {
        let hub = DemandHub::new(8, true);
        PeerSink::set_peers(&hub, &["p:1".to_owned()]);
        let per = PeerDemand::PerService(Arc::new(HashMap::new()));
        assert!(PeerSink::set_peer_value(&hub, "p:1", Some(per)).is_err());
        PeerSink::set_peer_value(&hub, "p:1", Some(PeerDemand::One(2))).unwrap();
        assert_eq!(hub.state().total(), Ok(2));
        assert_eq!(PeerSink::max_line(&hub), MAX_LINE);
    }
}

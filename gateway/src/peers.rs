//! Demand aggregation over gateway replicas.
//!
//! Each replica serves its own demand at `GET /hearth/local-demand` as a long-lived
//! newline-delimited JSON stream (`{"demand": N}` at connect, on every change, and every
//! [`KEEPALIVE`] as a liveness signal). Each replica subscribes to every peer found in the
//! gateway Service's EndpointSlices, so a cold request on any replica reaches the replica KEDA
//! talks to within one network hop, with no polling and no cache to go stale.
//!
//! A peer whose stream is not connected, or silent for [`PEER_SILENCE`], is *unknown*: the
//! total demand is then an error (see [`crate::demand`]), never a silently low number.

use std::{
    collections::HashMap,
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

use crate::demand::{DemandHub, DemandState};

/// How often a demand stream repeats its value when nothing changes.
pub const KEEPALIVE: Duration = Duration::from_secs(5);
/// A peer silent this long is considered unknown.
pub const PEER_SILENCE: Duration = Duration::from_secs(15);

fn line(v: u64) -> Bytes {
    Bytes::from(format!("{{\"demand\":{v}}}\n"))
}

/// The `/hearth/local-demand` response: local demand now, on every change, and every
/// [`KEEPALIVE`]; ends when `stop` turns true.
pub fn local_demand_stream(
    rx: watch::Receiver<DemandState>,
    stop: watch::Receiver<bool>,
) -> Response {
    let stream = futures::stream::unfold(
        (rx, stop, None::<u64>),
        |(mut rx, mut stop, last)| async move {
            loop {
                if *stop.borrow() {
                    return None;
                }
                let v = rx.borrow_and_update().local();
                if last != Some(v) {
                    return Some((
                        Ok::<_, std::convert::Infallible>(line(v)),
                        (rx, stop, Some(v)),
                    ));
                }
                tokio::select! {
                    r = rx.changed() => if r.is_err() { return None },
                    _ = stop.changed() => {}
                    _ = tokio::time::sleep(KEEPALIVE) => {
                        return Some((Ok(line(v)), (rx, stop, Some(v))));
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
    resp
}

/// Subscriptions to the peer replicas' demand streams.
#[derive(Debug, Clone)]
pub struct PeerSet {
    demand: DemandHub,
    client: Client<HttpConnector, Empty<Bytes>>,
    tasks: Arc<Mutex<HashMap<String, JoinHandle<()>>>>,
}

impl PeerSet {
    /// Peers feeding `demand` (which must have been created with aggregation on).
    pub fn new(demand: DemandHub) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(2)));
        let client = Client::builder(hyper_util::rt::TokioExecutor::new()).build(connector);
        Self {
            demand,
            client,
            tasks: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Replaces the peer list (`host:port` of each other replica's HTTP port): subscribes to
    /// new peers and drops removed ones.
    pub fn update(&self, peers: Vec<String>) {
        self.demand.set_peers(peers.clone());
        let mut tasks = self.tasks.lock().unwrap_or_else(|e| e.into_inner());
        tasks.retain(|peer, task| {
            let keep = peers.contains(peer);
            if !keep {
                task.abort();
            }
            keep
        });
        for peer in peers {
            tasks.entry(peer.clone()).or_insert_with(|| {
                tokio::spawn(subscribe(self.client.clone(), self.demand.clone(), peer))
            });
        }
    }

    /// Marks the total demand unknown because the peer list cannot be discovered.
    pub fn discovery_failed(&self, error: String) {
        self.demand.set_peer_discovery_error(error);
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

/// Follows one peer's demand stream forever, reconnecting with backoff; the peer's value is
/// unknown whenever the stream is down or silent.
async fn subscribe(client: Client<HttpConnector, Empty<Bytes>>, demand: DemandHub, peer: String) {
    let mut backoff = Duration::from_millis(50);
    loop {
        match follow(&client, &demand, &peer).await {
            Ok(()) => tracing::debug!(%peer, "peer demand stream ended"),
            Err(e) => tracing::warn!(%peer, error = %e, "peer demand stream failed"),
        }
        demand.set_peer_value(&peer, None);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(2));
    }
}

async fn follow(
    client: &Client<HttpConnector, Empty<Bytes>>,
    demand: &DemandHub,
    peer: &str,
) -> Result<(), String> {
    let uri: http::Uri = format!("http://{peer}/hearth/local-demand")
        .parse()
        .map_err(|e| format!("bad peer address {peer}: {e}"))?;
    let resp = tokio::time::timeout(PEER_SILENCE, client.get(uri))
        .await
        .map_err(|_| "no answer".to_owned())?
        .map_err(|e| e.to_string())?;
    if !resp.status().is_success() {
        return Err(format!("answered {}", resp.status()));
    }
    let mut body = resp.into_body();
    let mut buf = Vec::new();
    loop {
        let frame = tokio::time::timeout(PEER_SILENCE, body.frame())
            .await
            .map_err(|_| format!("silent for {PEER_SILENCE:?}"))?;
        let Some(frame) = frame else { return Ok(()) };
        let frame = frame.map_err(|e| e.to_string())?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        buf.extend_from_slice(&data);
        while let Some(pos) = buf.iter().position(|b| *b == b'\n') {
            let rest = buf.split_off(pos + 1);
            let text = std::mem::replace(&mut buf, rest);
            let v: serde_json::Value =
                serde_json::from_slice(&text).map_err(|e| format!("bad demand line: {e}"))?;
            let n = v["demand"]
                .as_u64()
                .ok_or_else(|| "demand line without a \"demand\" number".to_owned())?;
            demand.set_peer_value(peer, Some(n));
        }
    }
}

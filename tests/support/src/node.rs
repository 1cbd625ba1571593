//! The real node of `tests/cluster` (kubelet, containerd, CNI, kube-proxy, CoreDNS): what tests
//! need to place pods on it and to hear from them.
//!
//! - [`RealNode::load`] reads `<state dir>/node.env`, written by `tests/cluster/up`.
//! - [`RealNode::place`] pins a pod spec to the node by its hostname.
//! - [`EventSink`] is an HTTP server on the host end of the node's link: containers report what
//!   happens inside them (`wget http://<sink>/<event>`), in the order it happens, also while
//!   their pod is being deleted.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::metric_server::read_request_head;
use crate::state_dir;
use crate::wait::{Observed, wait_until};

/// The real node as `tests/cluster/up` made it.
#[derive(Debug, Clone)]
pub struct RealNode {
    /// The Node's name (`hearth-node`).
    pub name: String,
    /// The node's InternalIP.
    pub ip: String,
    /// The host end of the node's link: the apiserver's address, reachable from every pod.
    pub host_ip: String,
    /// The cluster DNS Service's ClusterIP.
    pub dns_ip: String,
    /// An image with a shell and busybox's tools, present on the node (runs as root).
    pub tools_image: String,
}

impl RealNode {
    /// Reads `<state dir>/node.env`; fails naming the file and the fix when the cluster has no
    /// real node.
    pub fn load() -> Result<Self> {
        let path = state_dir().join("node.env");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!(
                "reading {} (written by tests/cluster/up with the real node; run tests/cluster/up as root)",
                path.display()
            )
        })?;
        let vars: BTreeMap<&str, &str> = text
            .lines()
            .filter_map(|line| line.split_once('='))
            .collect();
        let get = |key: &str| -> Result<String> {
            match vars.get(key) {
                Some(v) if !v.is_empty() => Ok((*v).to_string()),
                _ => bail!("{} has no {key}", path.display()),
            }
        };
        Ok(Self {
            name: get("NODE_NAME")?,
            ip: get("NODE_IP")?,
            host_ip: get("NODE_HOST_IP")?,
            dns_ip: get("CLUSTER_DNS_IP")?,
            tools_image: get("TOOLS_IMAGE")?,
        })
    }

    /// Pins a pod spec (JSON) to this node: `nodeSelector` on its hostname, merged into what the
    /// spec already has. (The fake nodes are tainted, so an unpinned pod without tolerations
    /// lands here too; pinning makes a test's intent explicit.)
    pub fn place(&self, mut spec: Value) -> Value {
        spec["nodeSelector"]["kubernetes.io/hostname"] = json!(self.name);
        spec
    }
}

/// One request a container made to the sink.
#[derive(Debug, Clone)]
pub struct Event {
    /// The request path without its leading `/` (`wget http://<sink>/main-term` → `main-term`).
    pub name: String,
    /// When it arrived, since the sink started.
    pub at: Duration,
}

/// An HTTP server on the real node's host address that records each request's path, in order
/// of arrival. Stops when dropped.
pub struct EventSink {
    addr: SocketAddr,
    events: Arc<Mutex<Vec<Event>>>,
    task: JoinHandle<()>,
}

impl EventSink {
    /// Binds `<host_ip>:0` of the node's link, so pods reach it without a Service.
    pub async fn start(node: &RealNode) -> Result<Self> {
        let listener = TcpListener::bind((node.host_ip.as_str(), 0))
            .await
            .with_context(|| format!("binding the event sink on {}", node.host_ip))?;
        let addr = listener.local_addr()?;
        let events = Arc::new(Mutex::new(Vec::new()));
        let (sink, start) = (events.clone(), Instant::now());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let sink = sink.clone();
                tokio::spawn(async move {
                    // A client that hangs up early is no concern of the test.
                    let _ = record(stream, &sink, start).await;
                });
            }
        });
        Ok(Self { addr, events, task })
    }

    /// `http://<ip>:<port>`: a container reports with `wget -q -O- <url>/<event>`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The events so far, in order of arrival.
    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|e| e.clone()).unwrap_or_default()
    }

    /// The names of the events so far, in order of arrival.
    pub fn names(&self) -> Vec<String> {
        self.events().into_iter().map(|e| e.name).collect()
    }

    /// Waits until every name in `expected` has arrived (at least once).
    pub async fn wait_for(&self, expected: &[&str], timeout: Duration) -> Result<Vec<String>> {
        wait_until(
            format!("events {expected:?} at the sink"),
            timeout,
            || async {
                let names = self.names();
                Ok(if expected.iter().all(|e| names.iter().any(|n| n == e)) {
                    Observed::Ready(names)
                } else {
                    Observed::NotYet(format!("events so far: {names:?}"))
                })
            },
        )
        .await
    }
}

impl Drop for EventSink {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn record(mut stream: TcpStream, sink: &Mutex<Vec<Event>>, start: Instant) -> Result<()> {
    let Some(head) = read_request_head(&mut stream).await? else {
        return Ok(());
    };
    let at = start.elapsed();
    let line = String::from_utf8_lossy(&head);
    let path = line.split_whitespace().nth(1).unwrap_or("/");
    if let Ok(mut events) = sink.lock() {
        events.push(Event {
            name: path.trim_start_matches('/').to_string(),
            at,
        });
    }
    stream
        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n")
        .await?;
    stream.shutdown().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;

    fn node() -> RealNode {
        RealNode {
            name: "hearth-node".into(),
            ip: "198.19.0.2".into(),
            host_ip: "127.0.0.1".into(),
            dns_ip: "198.19.128.10".into(),
            tools_image: "hearth.dev/test-tools:busybox".into(),
        }
    }

    #[test]
    fn place_adds_the_node_selector_to_what_is_there() {
        let spec = node().place(json!({
            "nodeSelector": {"a": "b"},
            "tolerations": [{"key": "x", "operator": "Exists"}],
        }));
        assert_eq!(spec["nodeSelector"]["a"], "b");
        assert_eq!(
            spec["nodeSelector"]["kubernetes.io/hostname"],
            "hearth-node"
        );
        let tolerations = spec["tolerations"].as_array().cloned().unwrap_or_default();
        assert_eq!(tolerations.len(), 1, "the spec's own tolerations are kept");
    }

    #[tokio::test]
    async fn sink_records_paths_in_order() {
        let sink = EventSink::start(&node()).await.unwrap();
        for event in ["first", "second"] {
            let mut stream = TcpStream::connect(sink.addr).await.unwrap();
            stream
                .write_all(format!("GET /{event} HTTP/1.1\r\nhost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut out = String::new();
            stream.read_to_string(&mut out).await.unwrap();
            assert!(out.starts_with("HTTP/1.1 200 OK"), "{out}");
        }
        assert_eq!(sink.names(), ["first", "second"]);
        let names = sink
            .wait_for(&["second"], Duration::from_secs(1))
            .await
            .unwrap();
        assert_eq!(names.len(), 2);
    }
}

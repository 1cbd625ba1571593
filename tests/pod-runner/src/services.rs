//! What kube-proxy and cluster DNS would give host processes for the runner's pods: every
//! ClusterIP:port of a Service in a namespace the runner plays is served by a userspace TCP proxy
//! (kube-proxy's original mode) to a ready endpoint from the Service's EndpointSlices, and
//! `<svc>.<ns>.svc[.cluster.local]` resolve to the ClusterIP through a marked block in
//! `/etc/hosts`. This is how the KEDA operator, a host process, reaches a gateway's
//! `external-push` `scalerAddress`. ClusterIPs belong to the cluster's real node (its kube-proxy
//! serves them); the runner puts the ClusterIPs it serves on `lo` as /32 addresses (recorded,
//! removed with the Service), which take precedence over the host's route into the node. Also
//! the apiserver passthrough for pods.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use tokio::net::{TcpListener, TcpStream};

use crate::net::{Record, ip};
use tokio::task::JoinHandle;

const HOSTS: &str = "/etc/hosts";
const BEGIN: &str = "# BEGIN hearth-pod-runner: Service names of the test cluster (tests/pod-runner; removed when it exits)";
const END: &str = "# END hearth-pod-runner";

/// Forwards every connection on `listen` to `target` (the apiserver, for pods).
pub async fn passthrough(listen: SocketAddr, target: SocketAddr) -> Result<JoinHandle<()>> {
    let l = TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the apiserver passthrough on {listen}"))?;
    Ok(tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            tokio::spawn(async move {
                if let Ok(mut t) = TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut t).await;
                }
            });
        }
    }))
}

/// Rewrites the marked block of `/etc/hosts` to `entries` (ip → names); empty removes it.
pub fn write_hosts(entries: &BTreeMap<String, Vec<String>>) -> Result<()> {
    let text = std::fs::read_to_string(HOSTS).context("reading /etc/hosts")?;
    let mut out = String::new();
    let mut inside = false;
    for line in text.lines() {
        if line == BEGIN {
            inside = true;
        } else if line == END {
            inside = false;
        } else if !inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    if !entries.is_empty() {
        out.push_str(BEGIN);
        out.push('\n');
        for (ip, names) in entries {
            out.push_str(&format!("{ip} {}\n", names.join(" ")));
        }
        out.push_str(END);
        out.push('\n');
    }
    // In place, not by rename: /etc/hosts is often a bind mount.
    std::fs::write(HOSTS, out).context("writing /etc/hosts")
}

/// ClusterIPs the runner put on `lo`, by the Service that needs them.
struct LocalAddrs {
    record: Arc<Record>,
    added: HashMap<String, String>,
}

impl LocalAddrs {
    /// Binds `addr`; when its IP is not local, first puts it on `lo` as a /32 (recorded).
    async fn bind(&mut self, service: &str, addr: SocketAddr) -> Result<TcpListener> {
        match TcpListener::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrNotAvailable => {
                let cidr = format!("{}/32", addr.ip());
                self.record.add("addr", &cidr)?;
                ip(&["addr", "add", &cidr, "dev", "lo"])?;
                self.added.insert(service.to_string(), cidr);
                Ok(TcpListener::bind(addr).await?)
            }
            other => Ok(other?),
        }
    }

    /// Removes the address put on `lo` for `service`, if any.
    fn release(&mut self, service: &str) {
        if let Some(cidr) = self.added.remove(service)
            && let Err(e) = ip(&["addr", "del", &cidr, "dev", "lo"])
        {
            tracing::warn!(service, error = %e, "removing a ClusterIP from lo");
        }
    }
}

struct Listener {
    key: String,
    task: JoinHandle<()>,
}

/// Watches Services and serves each ClusterIP:port until the Service goes away.
pub async fn run(client: Client, prefixes: Vec<String>, record: Arc<Record>) -> Result<()> {
    let slices: Api<EndpointSlice> = Api::all(client.clone());
    let (store, writer) = reflector::store();
    let refl = reflector::reflector(writer, watcher(slices, watcher::Config::default()))
        .applied_objects()
        .for_each(|_| async {});
    tokio::spawn(refl);

    let services: Api<Service> = Api::all(client);
    let mut listeners: HashMap<String, Vec<Listener>> = HashMap::new();
    let mut hosts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut local = LocalAddrs {
        record,
        added: HashMap::new(),
    };
    let mut stream = watcher(services, watcher::Config::default()).boxed();
    while let Some(ev) = stream.next().await {
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                tracing::warn!(error = %e, "Service watch");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let before = hosts.clone();
        match ev {
            watcher::Event::Apply(svc) | watcher::Event::InitApply(svc) => {
                let ns = svc.namespace().unwrap_or_default();
                if prefixes.iter().any(|p| ns.starts_with(p.as_str())) {
                    serve(&svc, &store, &mut listeners, &mut hosts, &mut local).await;
                }
            }
            watcher::Event::Delete(svc) => {
                let id = format!("{}/{}", svc.namespace().unwrap_or_default(), svc.name_any());
                for l in listeners.remove(&id).unwrap_or_default() {
                    l.task.abort();
                }
                local.release(&id);
                hosts.retain(|_, names| !names.iter().any(|n| n == &dns(&svc)));
            }
            watcher::Event::Init | watcher::Event::InitDone => {}
        }
        if hosts != before
            && let Err(e) = write_hosts(&hosts)
        {
            tracing::warn!(error = %e, "updating /etc/hosts");
        }
    }
    Ok(())
}

fn dns(svc: &Service) -> String {
    format!(
        "{}.{}.svc",
        svc.name_any(),
        svc.namespace().unwrap_or_default()
    )
}

async fn serve(
    svc: &Service,
    store: &Store<EndpointSlice>,
    listeners: &mut HashMap<String, Vec<Listener>>,
    hosts: &mut BTreeMap<String, Vec<String>>,
    local: &mut LocalAddrs,
) {
    let ns = svc.namespace().unwrap_or_default();
    let name = svc.name_any();
    let id = format!("{ns}/{name}");
    let Some(spec) = &svc.spec else { return };
    let Some(ip) = spec
        .cluster_ip
        .clone()
        .filter(|ip| ip != "None" && !ip.is_empty())
    else {
        return;
    };
    // The apiserver's own Service has no endpoints here (see tests/cluster/README.md).
    if ns == "default" && name == "kubernetes" {
        return;
    }
    let mut wanted = Vec::new();
    for p in spec.ports.iter().flatten() {
        if p.protocol.as_deref().unwrap_or("TCP") != "TCP" {
            continue;
        }
        wanted.push((
            format!("{ip}:{}:{}", p.port, p.name.clone().unwrap_or_default()),
            p.port,
            p.name.clone(),
        ));
    }
    let current = listeners.remove(&id).unwrap_or_default();
    let mut kept = Vec::new();
    for l in current {
        if wanted.iter().any(|(k, _, _)| k == &l.key) {
            kept.push(l);
        } else {
            l.task.abort();
        }
    }
    for (key, port, port_name) in wanted {
        if kept.iter().any(|l| l.key == key) {
            continue;
        }
        let addr: SocketAddr = match format!("{ip}:{port}").parse() {
            Ok(a) => a,
            Err(_) => continue,
        };
        let l = match local.bind(&id, addr).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(service = %id, %addr, error = %e, "cannot serve ClusterIP");
                continue;
            }
        };
        let store = store.clone();
        let (ns, name) = (ns.clone(), name.clone());
        let rr = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(async move {
            while let Ok((mut c, _)) = l.accept().await {
                let (store, ns, name, port_name, rr) = (
                    store.clone(),
                    ns.clone(),
                    name.clone(),
                    port_name.clone(),
                    rr.clone(),
                );
                tokio::spawn(async move {
                    // Our watch of EndpointSlices may trail the API a little; wait for a ready
                    // endpoint up to 3 s before refusing the connection.
                    let mut target = None;
                    for _ in 0..30 {
                        target = pick(&store, &ns, &name, port_name.as_deref(), &rr);
                        if target.is_some() {
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    let Some(target) = target else { return };
                    let connect = TcpStream::connect(target);
                    if let Ok(Ok(mut t)) =
                        tokio::time::timeout(Duration::from_secs(3), connect).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut c, &mut t).await;
                    }
                });
            }
        });
        kept.push(Listener { key, task });
    }
    if !kept.is_empty() {
        let d = dns(svc);
        hosts.insert(ip, vec![d.clone(), format!("{d}.cluster.local")]);
    }
    listeners.insert(id, kept);
}

/// A ready endpoint of the Service (round robin), with the slice port of the Service port.
fn pick(
    store: &Store<EndpointSlice>,
    ns: &str,
    svc: &str,
    port_name: Option<&str>,
    rr: &AtomicUsize,
) -> Option<SocketAddr> {
    let mut targets = Vec::new();
    for s in store.state() {
        if s.namespace().as_deref() != Some(ns)
            || s.labels()
                .get("kubernetes.io/service-name")
                .map(String::as_str)
                != Some(svc)
        {
            continue;
        }
        let want = port_name.unwrap_or("");
        let Some(port) = s
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref().unwrap_or("") == want)
            .and_then(|p| p.port)
        else {
            continue;
        };
        for e in &s.endpoints {
            let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            if !ready {
                continue;
            }
            for a in &e.addresses {
                if let Ok(ip) = a.parse::<std::net::IpAddr>() {
                    targets.push(SocketAddr::new(ip, port as u16));
                }
            }
        }
    }
    if targets.is_empty() {
        return None;
    }
    targets.sort();
    Some(targets[rr.fetch_add(1, Ordering::Relaxed) % targets.len()])
}

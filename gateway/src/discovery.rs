//! Endpoint discovery from a Service's EndpointSlices (`discovery.k8s.io/v1`).
//!
//! Slices are watched with the label `kubernetes.io/service-name=<service>` (the label the
//! EndpointSlice controller sets). An endpoint is used when its `conditions.ready` is not
//! `false` (Kubernetes: a nil `ready` should be interpreted as ready) and `conditions.terminating`
//! is not `true`, so a pod leaves the set the moment it starts terminating. Of an endpoint's
//! `addresses`, the first is used (the API says they are fungible).
//!
//! The port is the slice port named `port_name` when given; otherwise the only port of the
//! slice, or the one named `http`.
//!
//! A dual-stack Service (`ipFamilyPolicy: PreferDualStack|RequireDualStack`) has one set of
//! slices per address family, each listing every pod: a pod (by `targetRef`) is used once, at
//! its IPv4 address when it has one, so a backend is not balanced as two and a peer gateway's
//! demand is not counted twice.

use std::collections::BTreeMap;

use futures::StreamExt;
use http::uri::Authority;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt, watcher},
};

/// Which Service's endpoints to follow.
#[derive(Debug, Clone)]
pub struct SliceSource {
    /// Namespace of the Service.
    pub namespace: String,
    /// Name of the Service.
    pub service: String,
    /// Name of the Service port (as copied into the slices); `None`: the slice's only port, or
    /// the one named `http`.
    pub port_name: Option<String>,
}

/// Why the watch stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// The apiserver refused (HTTP 403): the service account may not list/watch EndpointSlices.
    #[error(
        "forbidden to list/watch EndpointSlices in namespace {namespace}: {message} (grant get/list/watch on discovery.k8s.io endpointslices to the gateway's service account)"
    )]
    Forbidden {
        /// The namespace.
        namespace: String,
        /// The apiserver's message.
        message: String,
    },
    /// The watch stream ended (the client was dropped).
    #[error("EndpointSlice watch ended")]
    Ended,
}

/// The ready, non-terminating endpoints of one slice, as `host:port`.
pub fn ready_endpoints(slice: &EndpointSlice, port_name: Option<&str>) -> Vec<Authority> {
    slice_endpoints(slice, port_name)
        .endpoints
        .into_iter()
        .map(|(_, a)| a)
        .collect()
}

/// The ready endpoints of one slice with the pod behind each (`targetRef`), if named.
#[derive(Debug, Default)]
struct SliceEndpoints {
    ipv4: bool,
    endpoints: Vec<(Option<String>, Authority)>,
}

fn slice_endpoints(slice: &EndpointSlice, port_name: Option<&str>) -> SliceEndpoints {
    let ipv4 = slice.address_type == "IPv4";
    let ports = slice.ports.as_deref().unwrap_or_default();
    let port = match port_name {
        Some(name) => ports.iter().find(|p| p.name.as_deref() == Some(name)),
        None if ports.len() == 1 => ports.first(),
        None => ports.iter().find(|p| p.name.as_deref() == Some("http")),
    };
    let Some(port) = port.and_then(|p| p.port) else {
        return SliceEndpoints {
            ipv4,
            endpoints: Vec::new(),
        };
    };
    let endpoints = slice
        .endpoints
        .iter()
        .filter(|e| {
            let c = e.conditions.as_ref();
            c.and_then(|c| c.ready) != Some(false) && c.and_then(|c| c.terminating) != Some(true)
        })
        .filter_map(|e| {
            let addr = e.addresses.first()?;
            let host = if slice.address_type == "IPv6" {
                format!("[{addr}]")
            } else {
                addr.clone()
            };
            let pod = e.target_ref.as_ref().and_then(|r| {
                Some(format!(
                    "{}/{}",
                    r.namespace.as_deref().unwrap_or_default(),
                    r.name.as_deref()?
                ))
            });
            Some((pod, format!("{host}:{port}").parse::<Authority>().ok()?))
        })
        .collect();
    SliceEndpoints { ipv4, endpoints }
}

/// Every slice's endpoints, each pod once: IPv4 slices first, so a pod listed in both families
/// is used at its IPv4 address. Endpoints without a `targetRef` are all kept.
fn merge(slices: &BTreeMap<String, SliceEndpoints>) -> Vec<Authority> {
    let mut seen = std::collections::HashSet::new();
    let (v4, other): (Vec<_>, Vec<_>) = slices.values().partition(|s| s.ipv4);
    v4.into_iter()
        .chain(other)
        .flat_map(|s| &s.endpoints)
        .filter(|(pod, _)| pod.as_ref().is_none_or(|p| seen.insert(p.clone())))
        .map(|(_, a)| a.clone())
        .collect()
}

fn forbidden(e: &watcher::Error) -> Option<String> {
    let inner = match e {
        watcher::Error::InitialListFailed(e)
        | watcher::Error::WatchStartFailed(e)
        | watcher::Error::WatchFailed(e) => e,
        watcher::Error::WatchError(s) if s.is_forbidden() => return Some(s.message.clone()),
        _ => return None,
    };
    match inner {
        kube::Error::Api(s) if s.is_forbidden() => Some(s.message.clone()),
        _ => None,
    }
}

/// Watches the Service's EndpointSlices and calls `on_change` with the full set of ready
/// endpoints after the initial list and after every change. Transient errors are retried with
/// kube's default backoff; returns only when the apiserver forbids the watch or the stream
/// ends.
pub async fn watch_endpoints(
    client: Client,
    source: SliceSource,
    mut on_change: impl FnMut(Vec<Authority>) + Send,
) -> DiscoveryError {
    let api: Api<EndpointSlice> = Api::namespaced(client, &source.namespace);
    let cfg = watcher::Config::default()
        .labels(&format!("kubernetes.io/service-name={}", source.service));
    let stream = watcher(api, cfg).default_backoff();
    futures::pin_mut!(stream);
    let port_name = source.port_name.as_deref();
    let mut slices: BTreeMap<String, SliceEndpoints> = BTreeMap::new();
    let mut init: Option<BTreeMap<String, SliceEndpoints>> = None;
    let emit = |slices: &BTreeMap<String, SliceEndpoints>, f: &mut dyn FnMut(Vec<Authority>)| {
        f(merge(slices));
    };
    while let Some(ev) = stream.next().await {
        match ev {
            Ok(watcher::Event::Init) => init = Some(BTreeMap::new()),
            Ok(watcher::Event::InitApply(s)) => {
                let name = s.metadata.name.clone().unwrap_or_default();
                init.get_or_insert_with(BTreeMap::new)
                    .insert(name, slice_endpoints(&s, port_name));
            }
            Ok(watcher::Event::InitDone) => {
                slices = init.take().unwrap_or_default();
                emit(&slices, &mut on_change);
            }
            Ok(watcher::Event::Apply(s)) => {
                let name = s.metadata.name.clone().unwrap_or_default();
                slices.insert(name, slice_endpoints(&s, port_name));
                emit(&slices, &mut on_change);
            }
            Ok(watcher::Event::Delete(s)) => {
                slices.remove(&s.metadata.name.clone().unwrap_or_default());
                emit(&slices, &mut on_change);
            }
            Err(e) => {
                if let Some(message) = forbidden(&e) {
                    return DiscoveryError::Forbidden {
                        namespace: source.namespace.clone(),
                        message,
                    };
                }
                tracing::warn!(service = %source.service, error = %e, "EndpointSlice watch error; retrying");
            }
        }
    }
    DiscoveryError::Ended
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slice(json: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn keeps_ready_non_terminating_endpoints() {
        let s = slice(serde_json::json!({
            "metadata": {"name": "s1"},
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "conditions": {"ready": true}},
                {"addresses": ["10.0.0.2"], "conditions": {"ready": false}},
                {"addresses": ["10.0.0.3"], "conditions": {"ready": true, "terminating": true}},
                {"addresses": ["10.0.0.4"]},
                {"addresses": ["10.0.0.5", "10.0.0.6"], "conditions": {}}
            ]
        }));
        let got: Vec<String> = ready_endpoints(&s, None)
            .iter()
            .map(|a| a.to_string())
            .collect();
        assert_eq!(got, ["10.0.0.1:8000", "10.0.0.4:8000", "10.0.0.5:8000"]);
    }

    #[test]
    fn picks_the_port_by_name_and_brackets_ipv6() {
        let s = slice(serde_json::json!({
            "metadata": {"name": "s1"},
            "addressType": "IPv6",
            "ports": [{"name": "metrics", "port": 9000}, {"name": "http", "port": 8000}],
            "endpoints": [{"addresses": ["fd00::1"]}]
        }));
        assert_eq!(ready_endpoints(&s, None)[0].as_str(), "[fd00::1]:8000");
        assert_eq!(
            ready_endpoints(&s, Some("metrics"))[0].as_str(),
            "[fd00::1]:9000"
        );
        assert!(ready_endpoints(&s, Some("grpc")).is_empty());
    }

    #[test]
    fn a_dual_stack_service_lists_each_pod_once_at_its_ipv4_address() {
        let pod = |n: &str| serde_json::json!({"kind": "Pod", "namespace": "m", "name": n});
        let v6 = slice(serde_json::json!({
            "metadata": {"name": "a-v6"},
            "addressType": "IPv6",
            "ports": [{"port": 8080}],
            "endpoints": [
                {"addresses": ["fd00::1"], "targetRef": pod("gw-1")},
                {"addresses": ["fd00::2"], "targetRef": pod("gw-2")},
                {"addresses": ["fd00::9"]}
            ]
        }));
        let v4 = slice(serde_json::json!({
            "metadata": {"name": "b-v4"},
            "addressType": "IPv4",
            "ports": [{"port": 8080}],
            "endpoints": [
                {"addresses": ["10.0.0.1"], "targetRef": pod("gw-1")},
                {"addresses": ["10.0.0.3"], "targetRef": pod("gw-3")}
            ]
        }));
        let slices = BTreeMap::from([
            ("a-v6".to_owned(), slice_endpoints(&v6, None)),
            ("b-v4".to_owned(), slice_endpoints(&v4, None)),
        ]);
        let got: Vec<String> = merge(&slices).iter().map(|a| a.to_string()).collect();
        assert_eq!(
            got,
            [
                "10.0.0.1:8080",
                "10.0.0.3:8080",
                "[fd00::2]:8080",
                "[fd00::9]:8080"
            ]
        );
    }
}

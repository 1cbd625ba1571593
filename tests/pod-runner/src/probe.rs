//! httpGet probes and preStop hooks, as the kubelet runs them: a `GET` whose status in
//! 200..=399 is success (Kubernetes docs, "Configure Liveness, Readiness and Startup Probes").

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, HTTPGetAction, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Timing of one probe with the kubelet's defaults filled in.
#[derive(Clone, Debug)]
pub struct Timing {
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
}

impl Timing {
    /// Defaults from the Probe API: period 10 s, timeout 1 s, failureThreshold 3.
    pub fn of(p: &Probe) -> Timing {
        let secs = |v: Option<i32>, d: i32| Duration::from_secs(v.unwrap_or(d).max(0) as u64);
        Timing {
            initial_delay: secs(p.initial_delay_seconds, 0),
            period: secs(p.period_seconds, 10).max(Duration::from_secs(1)),
            timeout: secs(p.timeout_seconds, 1).max(Duration::from_secs(1)),
            failure_threshold: p.failure_threshold.unwrap_or(3).max(1) as u32,
        }
    }
}

/// Resolves a probe or hook port (number or the container's port name).
pub fn resolve_port(port: &IntOrString, c: &Container) -> Result<u16, String> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).map_err(|_| format!("port {n} out of range")),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|p| p.name.as_deref() == Some(name))
            .and_then(|p| u16::try_from(p.container_port).ok())
            .ok_or_else(|| format!("container {:?} has no port named {name:?}", c.name)),
    }
}

/// Sends `GET path` to `ip:port` of the action and returns whether the status was 2xx/3xx.
pub async fn http_get(
    action: &HTTPGetAction,
    c: &Container,
    pod_ip: IpAddr,
    timeout: Duration,
) -> Result<bool, String> {
    let port = resolve_port(&action.port, c)?;
    let path = action.path.as_deref().unwrap_or("/");
    let addr = SocketAddr::new(pod_ip, port);
    let work = async {
        let mut s = TcpStream::connect(addr).await?;
        let mut req = format!(
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nUser-Agent: kube-probe/1.35\r\n"
        );
        for h in action.http_headers.iter().flatten() {
            req.push_str(&format!("{}: {}\r\n", h.name, h.value));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).await?;
        let mut buf = [0u8; 64];
        let mut n = 0;
        while n < 12 {
            let m = s.read(&mut buf[n..]).await?;
            if m == 0 {
                break;
            }
            n += m;
        }
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    match tokio::time::timeout(timeout, work).await {
        Ok(Ok(head)) => {
            let code: u16 = head
                .split_whitespace()
                .nth(1)
                .and_then(|c| c.parse().ok())
                .unwrap_or(0);
            Ok((200..400).contains(&code))
        }
        Ok(Err(_)) | Err(_) => Ok(false),
    }
}

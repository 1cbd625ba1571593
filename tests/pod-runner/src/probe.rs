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

/// Resolves a probe or hook port: a number (even as a string, as the kubelet accepts) needs no
/// declared port, so a hook can reach another container of the pod; a name is looked up in
/// `c`'s ports.
pub fn resolve_port(port: &IntOrString, c: &Container) -> Result<u16, String> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).map_err(|_| format!("port {n} out of range")),
        IntOrString::String(s) if s.parse::<i64>().is_ok() => s
            .parse::<u16>()
            .map_err(|_| format!("port {s} out of range")),
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    #[test]
    fn numeric_ports_need_no_declared_port_names_do() {
        let c = Container {
            name: "main".into(),
            ..Default::default()
        };
        assert_eq!(resolve_port(&IntOrString::Int(8099), &c), Ok(8099));
        assert_eq!(
            resolve_port(&IntOrString::String("8099".into()), &c),
            Ok(8099)
        );
        assert!(resolve_port(&IntOrString::Int(70000), &c).is_err());
        let err = resolve_port(&IntOrString::String("drain".into()), &c).expect_err("no such name");
        assert!(err.contains("no port named \"drain\""), "{err}");
    }

    /// The main container's preStop httpGet on a numeric port reaches whatever listens there
    /// in the pod, such as a sidecar, though the main container declares no ports.
    #[tokio::test]
    async fn http_get_on_a_numeric_port_reaches_another_listener() {
        let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = l.local_addr().expect("addr").port();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.expect("accept");
            let mut buf = [0u8; 1024];
            let n = s.read(&mut buf).await.expect("read");
            s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .expect("write");
            String::from_utf8_lossy(&buf[..n]).into_owned()
        });
        let action = HTTPGetAction {
            port: IntOrString::Int(i32::from(port)),
            path: Some("/drain".into()),
            ..Default::default()
        };
        let main = Container {
            name: "main".into(),
            ..Default::default()
        };
        let ok = http_get(
            &action,
            &main,
            "127.0.0.1".parse().expect("ip"),
            Duration::from_secs(5),
        )
        .await
        .expect("resolved");
        assert!(ok);
        let req = server.await.expect("server");
        assert!(req.starts_with("GET /drain HTTP/1.1"), "{req}");
        // Nothing listening: a failure, not an error.
        let closed = HTTPGetAction {
            port: IntOrString::Int(i32::from(port)),
            ..Default::default()
        };
        assert_eq!(
            http_get(
                &closed,
                &main,
                "127.0.0.1".parse().expect("ip"),
                Duration::from_secs(5)
            )
            .await,
            Ok(false)
        );
    }
}

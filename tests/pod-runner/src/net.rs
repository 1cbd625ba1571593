//! The pod network: one Linux bridge with the host-side gateway address, and per pod a network
//! namespace joined to it by a veth pair. Every name made is appended to a record file first, so
//! `hearth-pod-runner cleanup` and `tests/cluster/down` remove exactly those names (never by
//! pattern).

use std::fs::OpenOptions;
use std::io::Write;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context, Result, bail};

/// The pod network is 198.18.0.0/16, RFC 2544's benchmarking block cut to a /16: never routed on
/// the internet and owned by this runner on the test machine.
/// This is its prefix length.
pub const POD_PREFIX: u8 = 16;
/// The bridge's own address: the pods' next hop and where the runner exposes the apiserver.
pub const HOST_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// Name of the bridge (Linux interface names have at most 15 bytes).
pub const BRIDGE: &str = "hearth-br0";

/// Names made by the runner, recorded as `<kind> <name>` lines (`bridge`, `netns`, `link`,
/// and `addr`: a Service ClusterIP/32 put on `lo`).
pub struct Record {
    path: PathBuf,
    lock: Mutex<()>,
}

impl Record {
    /// Opens (creates) the record file at `path`.
    pub fn new(path: PathBuf) -> Self {
        Record {
            path,
            lock: Mutex::new(()),
        }
    }

    pub(crate) fn add(&self, kind: &str, name: &str) -> Result<()> {
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
            .with_context(|| format!("opening {}", self.path.display()))?;
        writeln!(f, "{kind} {name}")?;
        Ok(())
    }
}

/// Runs `ip` with `args`, failing with its stderr.
pub fn ip(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .context("running `ip` (iproute2 must be installed and the runner must run as root)")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

/// Creates the bridge with [`HOST_IP`] and brings it up.
pub fn create_bridge(record: &Record) -> Result<()> {
    // The pod network is one per machine: never adopt (or later delete) another runner's.
    if std::path::Path::new("/sys/class/net").join(BRIDGE).exists() {
        bail!(
            "{BRIDGE} exists: another pod runner owns the pod network (one per machine); stop its cluster with tests/cluster/down, or remove the bridge if no runner is left"
        );
    }
    record.add("link", BRIDGE)?;
    ip(&["link", "add", BRIDGE, "type", "bridge"])?;
    ip(&[
        "addr",
        "add",
        &format!("{HOST_IP}/{POD_PREFIX}"),
        "dev",
        BRIDGE,
    ])?;
    ip(&["link", "set", BRIDGE, "up"])
}

/// The address of the `n`-th pod (from 1): 198.18.1.1, 198.18.1.2, … skipping .0 and .255.
pub fn pod_ip(n: u32) -> Ipv4Addr {
    let k = n - 1;
    let third = 1 + k / 254;
    let fourth = 1 + k % 254;
    assert!(third < 255, "pod address pool 198.18.0.0/16 exhausted");
    Ipv4Addr::new(198, 18, third as u8, fourth as u8)
}

/// The network namespace and host-side veth of one pod.
pub struct PodNet {
    /// `ip netns` name, `hearth-p<n>`.
    pub netns: String,
    /// Host end of the veth pair, `hearth-v<n>`, enslaved to the bridge.
    pub veth: String,
    /// The pod's address on the bridge.
    pub ip: Ipv4Addr,
}

impl PodNet {
    /// Makes namespace `hearth-p<n>` with loopback up and `eth0` at [`pod_ip`]`(n)`. No default
    /// route: a pod reaches only the pod network (other pods, the bridge address), never
    /// anything beyond this machine.
    pub fn create(n: u32, record: &Record) -> Result<PodNet> {
        let net = PodNet {
            netns: format!("hearth-p{n}"),
            veth: format!("hearth-v{n}"),
            ip: pod_ip(n),
        };
        record.add("netns", &net.netns)?;
        record.add("link", &net.veth)?;
        ip(&["netns", "add", &net.netns])?;
        ip(&[
            "link", "add", &net.veth, "type", "veth", "peer", "name", "eth0", "netns", &net.netns,
        ])?;
        ip(&["link", "set", &net.veth, "master", BRIDGE, "up"])?;
        let n = net.netns.as_str();
        ip(&["-n", n, "link", "set", "lo", "up"])?;
        ip(&[
            "-n",
            n,
            "addr",
            "add",
            &format!("{}/{POD_PREFIX}", net.ip),
            "dev",
            "eth0",
        ])?;
        ip(&["-n", n, "link", "set", "eth0", "up"])?;
        Ok(net)
    }

    /// Deletes the namespace (which takes the veth pair with it) and the host end if left.
    pub fn destroy(&self) {
        kill_pids(&self.netns);
        let _ = ip(&["netns", "del", &self.netns]);
        let _ = ip(&["link", "del", &self.veth]);
    }
}

/// SIGKILLs every process left in network namespace `netns`: what a pod's containers started
/// (sidecars, their children) must not outlive the pod, nor a runner that died.
fn kill_pids(netns: &str) {
    let Ok(out) = std::process::Command::new("ip")
        .args(["netns", "pids", netns])
        .output()
    else {
        return;
    };
    for pid in String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .filter_map(|p| p.parse::<i32>().ok())
        .filter(|p| *p > 1)
    {
        // SAFETY: kill(2) has no memory effects; the pid was just listed in the pod's namespace.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
        }
    }
}

/// Removes every name in the record at `path` (missing ones are skipped), then the record;
/// processes left in a recorded namespace are killed first.
pub fn cleanup(path: &Path) -> Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    // Namespaces first (their veths go with them), then links, the bridge last.
    let mut lines: Vec<(&str, &str)> = text.lines().filter_map(|l| l.split_once(' ')).collect();
    lines.sort_by_key(|(kind, name)| match (*kind, *name) {
        ("netns", _) => 0,
        (_, BRIDGE) => 2,
        _ => 1,
    });
    for (kind, name) in lines {
        let _ = match kind {
            "netns" => {
                kill_pids(name);
                ip(&["netns", "del", name])
            }
            "link" => ip(&["link", "del", name]),
            "addr" => ip(&["addr", "del", name, "dev", "lo"]),
            _ => Ok(()),
        };
    }
    std::fs::remove_file(path).with_context(|| format!("removing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ips_skip_network_and_broadcast_octets() {
        assert_eq!(pod_ip(1), Ipv4Addr::new(198, 18, 1, 1));
        assert_eq!(pod_ip(254), Ipv4Addr::new(198, 18, 1, 254));
        assert_eq!(pod_ip(255), Ipv4Addr::new(198, 18, 2, 1));
    }
}

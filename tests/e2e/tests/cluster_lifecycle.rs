//! `tests/cluster/down` leaves nothing on the host that `tests/cluster/up` made, also when `up`
//! died half-way: no process, mount, network namespace, interface, route, iptables rule, cgroup,
//! kernel setting or `/etc` change.
//!
//! Each case starts a second cluster beside the one the other suites use (its own state dir,
//! control-plane loopback /16 and real-node /18), kills `up` with SIGKILL when its progress
//! reaches a given step (what a crash or a Ctrl-C in a bad moment leaves), runs `down`, and
//! compares what the host shows with what it showed before. Needs root and the binaries `up`
//! builds (the test command builds them first).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};

/// Addresses of the second cluster: beside the default cluster's (127.100, 198.19.0.0/18).
const CONTROL_PLANE_NET: &str = "127.101";
const NODE_NET: &str = "198.19.64.0/18";
const NODE_LINK: &str = "hearth-19-64";
const NODE_CGROUP: &str = "hearth-198-19-64";
/// How long `up` may take to reach a step, and `down` to finish.
const STEP_TIMEOUT: Duration = Duration::from_secs(240);

/// The kernel settings the kubelet changes (tests/cluster/lib/node.sh).
const KUBELET_SYSCTLS: [&str; 6] = [
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn output(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("running {program} {args:?}"))?;
    ensure!(
        out.status.success(),
        "{program} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What the host shows of the things a cluster may leave behind.
#[derive(Debug, PartialEq, Eq)]
struct HostView {
    links: BTreeSet<String>,
    routes: BTreeSet<String>,
    mounts: BTreeSet<String>,
    iptables: BTreeSet<String>,
    sysctls: Vec<String>,
}

impl HostView {
    fn take() -> Result<Self> {
        let links = output("ip", &["-o", "link", "show"])?
            .lines()
            .filter_map(|l| l.split(':').nth(1))
            .map(|name| name.trim().split('@').next().unwrap_or("").to_string())
            .collect();
        let mut routes: BTreeSet<String> = output("ip", &["route", "show", "table", "all"])?
            .lines()
            .map(str::to_string)
            .collect();
        routes.extend(
            output("ip", &["-6", "route", "show", "table", "all"])?
                .lines()
                .map(str::to_string),
        );
        let mounts = std::fs::read_to_string("/proc/self/mountinfo")?
            .lines()
            .filter_map(|l| l.split_whitespace().nth(4))
            .map(str::to_string)
            .collect();
        // Rules without their packet counters. Without iptables-save the rules a cluster left
        // behind would go unseen, so its absence fails the test instead of passing this check.
        let iptables = output("iptables-save", &[])
            .context(
                "reading the host's iptables rules needs iptables-save: install iptables \
                 (Debian: apt-get install -y iptables; tests/run-tests installs it)",
            )?
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(|l| match l.split_once(" [") {
                Some((chain, _)) if l.starts_with(':') => chain.to_string(),
                _ => l.to_string(),
            })
            .collect();
        let sysctls = KUBELET_SYSCTLS
            .iter()
            .map(|s| {
                let value = std::fs::read_to_string(format!("/proc/sys/{s}")).unwrap_or_default();
                format!("{s}={}", value.trim())
            })
            .collect();
        Ok(Self {
            links,
            routes,
            mounts,
            iptables,
            sysctls,
        })
    }
}

/// Processes that belong to the test cluster: its state dir in their command line, or its
/// cgroup in their cgroup paths.
fn cluster_processes(state: &Path) -> Vec<String> {
    let state = state.to_string_lossy().into_owned();
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in entries.flatten() {
        let pid = entry.file_name().to_string_lossy().into_owned();
        if !pid.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .unwrap_or_default();
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        if cmdline.contains(&state) || cgroup.contains(NODE_CGROUP) {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // "<pid> (<comm>) <state> ...": comm and state say what it is, also for a zombie.
            let what = stat.split(") ").next().unwrap_or("").to_string();
            let state = stat
                .split(") ")
                .nth(1)
                .and_then(|r| r.split(' ').next())
                .unwrap_or("?");
            found.push(format!("{what}) state {state}: {}", cmdline.trim()));
        }
    }
    found
}

/// cgroup directories of the test cluster's node, in any hierarchy.
fn cluster_cgroups() -> Vec<String> {
    let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") else {
        return Vec::new();
    };
    hierarchies
        .flatten()
        .map(|h| h.path().join(NODE_CGROUP))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect()
}

/// Files under /etc changed since `since`.
fn etc_changed_since(since: std::time::SystemTime) -> Vec<String> {
    fn walk(dir: &Path, since: std::time::SystemTime, out: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.path().symlink_metadata() else {
                continue;
            };
            if meta.is_dir() {
                walk(&entry.path(), since, out);
            } else if meta.modified().is_ok_and(|m| m > since) {
                out.push(entry.path().display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(Path::new("/etc"), since, &mut out);
    out
}

fn cluster_command(script: &str, state: &Path) -> Command {
    let mut cmd = Command::new(repo().join("tests/cluster").join(script));
    cmd.env("HEARTH_CLUSTER_STATE", state)
        .env("HEARTH_CLUSTER_NET", CONTROL_PLANE_NET)
        .env("HEARTH_NODE_NET", NODE_NET)
        .env_remove("KUBECONFIG");
    cmd
}

/// Runs `up` until its progress prints a line containing `step`, then kills it (SIGKILL to
/// its process group; the components it started run in sessions of their own and survive, as
/// after a crash). Returns the progress lines seen.
fn crash_up_at(state: &Path, step: &str) -> Result<Vec<String>> {
    let mut child = cluster_command("up", state)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .context("starting tests/cluster/up")?;
    let stderr = child.stderr.take().context("up's stderr")?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut seen = Vec::new();
    let reached = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                let hit = line.contains(step);
                seen.push(line);
                if hit {
                    break true;
                }
            }
            Err(_) => break false,
        }
    };
    let pgid = i32::try_from(child.id()).context("pid")?;
    // SAFETY: kill(2) with a negative pid signals that process group; no memory is touched.
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
    let _ = child.wait();
    if !reached {
        bail!(
            "up never printed {step:?} within {STEP_TIMEOUT:?}; its progress:\n{}",
            seen.join("\n")
        );
    }
    Ok(seen)
}

fn down(state: &Path) -> Result<()> {
    let out = cluster_command("down", state)
        .output()
        .context("running tests/cluster/down")?;
    ensure!(
        out.status.success(),
        "tests/cluster/down failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Crash `up` at `step`, run `down`, and check the host is as it was.
fn crash_then_down_leaves_nothing(step: &str) -> Result<()> {
    ensure!(
        output("id", &["-u"])?.trim() == "0",
        "this test needs root, as tests/cluster/up does"
    );
    let tmp = std::env::temp_dir().join(format!("hearth-lifecycle-{}", std::process::id()));
    let state = tmp.join(step.split_whitespace().next().unwrap_or("step"));
    let _ = std::fs::remove_dir_all(&state);
    let before = HostView::take()?;
    let started = std::time::SystemTime::now();

    let progress = crash_up_at(&state, step);
    // Whatever happened, `down` runs, so a failed case does not leave a cluster running.
    let down_result = down(&state);
    progress?;
    down_result?;

    let after = HostView::take()?;
    let mut problems = Vec::new();
    let diff =
        |what: &str, a: &BTreeSet<String>, b: &BTreeSet<String>, problems: &mut Vec<String>| {
            let added: Vec<_> = b.difference(a).collect();
            let removed: Vec<_> = a.difference(b).collect();
            if !added.is_empty() || !removed.is_empty() {
                problems.push(format!("{what}: added {added:?}, removed {removed:?}"));
            }
        };
    diff("links", &before.links, &after.links, &mut problems);
    diff("routes", &before.routes, &after.routes, &mut problems);
    diff("mounts", &before.mounts, &after.mounts, &mut problems);
    diff(
        "iptables rules",
        &before.iptables,
        &after.iptables,
        &mut problems,
    );
    if before.sysctls != after.sysctls {
        problems.push(format!(
            "kernel settings: before {:?}, after {:?}",
            before.sysctls, after.sysctls
        ));
    }
    // Killed processes whose parent died with them are reaped by init a moment later; until
    // then they show (as zombies) with the cgroup they died in.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut processes = cluster_processes(&state);
    while !processes.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
        processes = cluster_processes(&state);
    }
    if !processes.is_empty() {
        problems.push(format!("processes left: {processes:?}"));
    }
    let cgroups = cluster_cgroups();
    if !cgroups.is_empty() {
        problems.push(format!("cgroups left: {cgroups:?}"));
    }
    let etc = etc_changed_since(started);
    if !etc.is_empty() {
        problems.push(format!("/etc files changed: {etc:?}"));
    }
    if state.exists() {
        problems.push(format!("state dir {} left", state.display()));
    }
    let _ = std::fs::remove_dir_all(&tmp);
    ensure!(
        problems.is_empty(),
        "after up was killed at {step:?} and down ran, the host differs:\n{}",
        problems.join("\n")
    );
    Ok(())
}

/// Two crashes, one after the other (they share the second cluster's addresses): right after
/// the node's namespaces, link, route and cgroups exist, before any process of the node
/// started; and when everything runs: the registry serving (its process and storage in the
/// state dir), the real node Ready with pods (CoreDNS) and their mounts, shims, network
/// namespaces and iptables rules, KEDA started.
#[test]
fn down_after_up_died_half_way_leaves_nothing() -> Result<()> {
    crash_then_down_leaves_nothing("node network ready")?;
    crash_then_down_leaves_nothing("CoreDNS serving")?;
    ensure!(
        !HostView::take()?.links.contains(NODE_LINK),
        "link {NODE_LINK} still exists"
    );
    Ok(())
}

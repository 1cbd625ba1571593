//! A bound on the request-body bytes one replica holds at once.
//!
//! Bodies are read whole and kept until the request is forwarded (see [`crate::proxy`]), so
//! during a cold start every held request keeps its body: `maxQueue` × `--body-limit` is 8 GiB
//! with the defaults, far past any gateway pod's memory. Past `--body-memory-limit` a request is
//! refused (`503` + `Retry-After`, reason `body_memory`) instead of the replica being OOM-killed
//! with every held request in it.

use std::path::Path;
use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

/// `--body-memory-limit` when the container has no memory limit: 256 MiB.
pub const DEFAULT_LIMIT: usize = 256 << 20;

/// `--body-memory-limit` when it is not given: [`DEFAULT_LIMIT`], or half of `container_limit`
/// (bytes, see [`container_memory_limit`]) when that is lower, so that the gateway's own memory
/// (about 7 MiB idle and 9 KiB per open connection, `docs/benchmarks.md`) fits in the other half
/// and a full budget does not get the replica OOM-killed with every held request in it.
pub fn default_limit(container_limit: Option<u64>) -> usize {
    container_limit.map_or(DEFAULT_LIMIT, |l| {
        usize::try_from(l / 2).map_or(DEFAULT_LIMIT, |half| half.min(DEFAULT_LIMIT))
    })
}

/// The memory limit of this process's cgroup and its visible ancestors, in bytes, the lowest
/// one: cgroup v2 `memory.max`, else cgroup v1 `memory.limit_in_bytes` (what the kubelet sets
/// from the container's `resources.limits.memory`). `None` when there is none or it cannot be
/// read.
pub fn container_memory_limit() -> Option<u64> {
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    memory_limit_in(Path::new("/sys/fs/cgroup"), &own)
}

/// [`container_memory_limit`] with the cgroup file system mounted at `root` and `proc_cgroup`
/// the text of `/proc/self/cgroup` (`hierarchy-ID:controllers:path` lines, `man 7 cgroups`).
fn memory_limit_in(root: &Path, proc_cgroup: &str) -> Option<u64> {
    let mut v1 = None;
    let mut v2 = None;
    for line in proc_cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path);
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path);
        }
    }
    // On a hybrid host the v2 hierarchy carries no memory controller; v1's counts there.
    let (dir, file, path) = match (v1, v2) {
        (Some(p), _) => (root.join("memory"), "memory.limit_in_bytes", p),
        (None, Some(p)) => (root.to_path_buf(), "memory.max", p),
        (None, None) => return None,
    };
    // The path is the host's view; inside a cgroup namespace only the part below the
    // container's own cgroup is mounted, so look at every ancestor that exists.
    let mut lowest: Option<u64> = None;
    let mut at = Path::new(path.trim_start_matches('/'));
    loop {
        if let Some(l) = std::fs::read_to_string(dir.join(at).join(file))
            .ok()
            .and_then(|s| parse_limit(&s))
        {
            lowest = Some(lowest.map_or(l, |m| m.min(l)));
        }
        match at.parent() {
            Some(p) => at = p,
            None => break,
        }
    }
    lowest
}

/// A cgroup memory limit file's value: `None` for v2's `max` and for v1's "no limit" (the
/// largest page-aligned `i64`, or anything near it).
fn parse_limit(s: &str) -> Option<u64> {
    let v: u64 = s.trim().parse().ok()?;
    (v < 1 << 62).then_some(v)
}

/// The count of request-body bytes held (being read, or kept to forward), and its limit. Cheap
/// to clone (shared).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    held: Arc<AtomicUsize>,
    limit: usize,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Self {
        Self {
            held: Arc::new(AtomicUsize::new(0)),
            limit,
        }
    }

    /// Bytes held now.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// The limit, in bytes.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// An empty reservation on this budget.
    pub fn reservation(&self) -> Reservation {
        Reservation {
            held: self.held.clone(),
            bytes: 0,
        }
    }

    /// Adds `n` bytes to `r`; `false`, taking nothing, when the budget would pass its limit.
    pub fn reserve(&self, r: &mut Reservation, n: usize) -> bool {
        let taken = self
            .held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                held.checked_add(n).filter(|t| *t <= self.limit)
            })
            .is_ok();
        if taken {
            r.bytes += n;
        }
        taken
    }
}

/// Bytes taken from a [`BodyBudget`], given back when dropped.
#[derive(Debug)]
pub struct Reservation {
    held: Arc<AtomicUsize>,
    bytes: usize,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.held.fetch_sub(self.bytes, Ordering::AcqRel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_stay_within_the_limit_and_give_back_on_drop() {
        let b = BodyBudget::new(100);
        let mut r1 = b.reservation();
        assert!(b.reserve(&mut r1, 60));
        let mut r2 = b.reservation();
        assert!(!b.reserve(&mut r2, 41), "past the limit");
        assert!(b.reserve(&mut r2, 40));
        assert_eq!(b.held(), 100);
        drop(r1);
        assert_eq!(b.held(), 40);
        drop(r2);
        assert_eq!(b.held(), 0);
        assert!(!b.reserve(&mut b.reservation(), usize::MAX), "no overflow");
    }

    #[test]
    fn the_default_is_half_the_container_limit_when_that_is_lower() {
        assert_eq!(default_limit(None), DEFAULT_LIMIT);
        assert_eq!(default_limit(Some(4 << 30)), DEFAULT_LIMIT);
        assert_eq!(default_limit(Some(128 << 20)), 64 << 20);
        assert_eq!(default_limit(Some(u64::MAX - 1)), DEFAULT_LIMIT);
    }

    fn write(root: &Path, rel: &str, value: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, value).unwrap();
    }

    #[test]
    fn reads_the_lowest_limit_of_cgroup_v1_and_v2() {
        let root = std::env::temp_dir().join(format!("hearth-cgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        // v2 inside a cgroup namespace: the container's cgroup is the root of the mount.
        write(&root.join("v2"), "memory.max", "268435456\n");
        assert_eq!(memory_limit_in(&root.join("v2"), "0::/\n"), Some(256 << 20));
        // v2 without one: the pod's cgroup limits less than the container's own says.
        write(&root.join("v2b"), "kubepods/pod1/memory.max", "100000000\n");
        write(&root.join("v2b"), "kubepods/pod1/c1/memory.max", "max\n");
        assert_eq!(
            memory_limit_in(&root.join("v2b"), "0::/kubepods/pod1/c1\n"),
            Some(100_000_000)
        );
        // v1, with the hybrid host's empty v2 line; unlimited reads as none.
        let v1 = root.join("v1");
        write(&v1, "memory/memory.limit_in_bytes", "9223372036854771712\n");
        write(
            &v1,
            "memory/x/memory.limit_in_bytes",
            "9223372036854771712\n",
        );
        let own = "4:memory:/x\n1:cpu,cpuacct:/\n0::/\n";
        assert_eq!(memory_limit_in(&v1, own), None);
        write(&v1, "memory/x/memory.limit_in_bytes", "536870912\n");
        assert_eq!(memory_limit_in(&v1, own), Some(512 << 20));
        assert_eq!(memory_limit_in(&v1, "garbage"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}

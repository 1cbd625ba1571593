//! Reads of an InferenceRuntime that a review names and the snapshot lacks.
//!
//! The snapshot follows a watch and is rebuilt after [`crate::watch::DEBOUNCE`], so a runtime
//! created just before the object that names it (`kubectl apply -f runtime.yaml -f
//! deployment.yaml`) may not be in it yet: the review would deny the workload, or warn on the
//! service, for a runtime that exists. [`RuntimeReads::read`] asks the apiserver instead, within
//! bounds, since the name comes from whoever sent the object:
//!
//! - only a valid object name (DNS-1123 subdomain) is read;
//! - at most [`MAX_READS`] reads at once; a review that finds them all taken is answered from
//!   the snapshot (`busy`);
//! - a name the apiserver did not have is not read again for [`MISS_TTL`] (`cached_miss`; at
//!   most [`MAX_MISSES`] names are remembered);
//! - a read takes at most [`READ_TIMEOUT`].
//!
//! Each review that names a runtime the snapshot lacks is counted in
//! `hearth_webhook_runtime_reads_total{result}`. RBAC: `get` on
//! `inferenceruntimes`.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use hearth_crds::InferenceRuntime;
use hearth_crds::naming::is_dns1123_subdomain;
use kube::Api;
use tokio::sync::Semaphore;

/// Reads at once.
pub const MAX_READS: usize = 2;
/// How long a name the apiserver did not have is answered from the snapshot without a read.
pub const MISS_TTL: Duration = Duration::from_secs(1);
/// Names remembered as missing; past it the oldest half is forgotten.
pub const MAX_MISSES: usize = 1024;
/// The longest a review waits for the apiserver's answer (the chart gives a review 5 s).
pub const READ_TIMEOUT: Duration = Duration::from_secs(2);

/// What a read found; the label of `hearth_webhook_runtime_reads_total`.
#[derive(Clone, Debug)]
pub enum Read {
    /// The apiserver has it.
    Found(Box<InferenceRuntime>),
    /// No read: the name is not an object name, a read of it found nothing less than
    /// [`MISS_TTL`] ago, or every slot was taken; or the read found nothing, failed or timed
    /// out. The review is answered from the snapshot.
    NotRead(&'static str),
}

impl Read {
    /// The metric label: `found`, `not_found`, `invalid_name`, `cached_miss`, `busy`,
    /// `error`, `timeout`.
    pub fn result(&self) -> &'static str {
        match self {
            Self::Found(_) => "found",
            Self::NotRead(why) => why,
        }
    }
}

/// Names the apiserver did not have, and when it said so.
#[derive(Debug, Default)]
pub struct Misses {
    at: HashMap<String, Instant>,
}

impl Misses {
    /// Whether `name` was missing less than [`MISS_TTL`] before `now`.
    pub fn recent(&self, name: &str, now: Instant) -> bool {
        self.at
            .get(name)
            .is_some_and(|t| now.saturating_duration_since(*t) < MISS_TTL)
    }

    /// Remembers `name` as missing at `now`; drops expired names, and at [`MAX_MISSES`] the
    /// oldest half.
    pub fn insert(&mut self, name: &str, now: Instant) {
        if self.at.len() >= MAX_MISSES {
            self.at
                .retain(|_, t| now.saturating_duration_since(*t) < MISS_TTL);
        }
        if self.at.len() >= MAX_MISSES {
            let mut by_age: Vec<(Instant, String)> =
                self.at.drain().map(|(name, t)| (t, name)).collect();
            let half = by_age.len() / 2;
            by_age.select_nth_unstable(half);
            self.at = by_age
                .into_iter()
                .skip(half)
                .map(|(t, name)| (name, t))
                .collect();
        }
        self.at.insert(name.to_owned(), now);
    }

    /// Forgets `name` (it was found).
    pub fn remove(&mut self, name: &str) {
        self.at.remove(name);
    }

    /// Names remembered.
    pub fn len(&self) -> usize {
        self.at.len()
    }

    /// Whether none is remembered.
    pub fn is_empty(&self) -> bool {
        self.at.is_empty()
    }
}

/// The bounded reader (see the module docs).
#[derive(Debug)]
pub struct RuntimeReads {
    api: Api<InferenceRuntime>,
    slots: Semaphore,
    misses: Mutex<Misses>,
}

impl RuntimeReads {
    /// Reads through `api` (cluster-scoped InferenceRuntimes).
    pub fn new(api: Api<InferenceRuntime>) -> Self {
        Self {
            api,
            slots: Semaphore::new(MAX_READS),
            misses: Mutex::new(Misses::default()),
        }
    }

    /// Reads the runtime `name` from the apiserver, within the module's bounds.
    pub async fn read(&self, name: &str) -> Read {
        if !is_dns1123_subdomain(name) {
            return Read::NotRead("invalid_name");
        }
        if self.misses().recent(name, Instant::now()) {
            return Read::NotRead("cached_miss");
        }
        let Ok(_slot) = self.slots.try_acquire() else {
            return Read::NotRead("busy");
        };
        match tokio::time::timeout(READ_TIMEOUT, self.api.get_opt(name)).await {
            Ok(Ok(Some(runtime))) => {
                self.misses().remove(name);
                Read::Found(Box::new(runtime))
            }
            Ok(Ok(None)) => {
                self.misses().insert(name, Instant::now());
                Read::NotRead("not_found")
            }
            Ok(Err(e)) => {
                tracing::warn!(runtime = %name, error = %e, "reading an InferenceRuntime the snapshot lacks failed (RBAC: get on inferenceruntimes); answering from the snapshot");
                Read::NotRead("error")
            }
            Err(_) => {
                tracing::warn!(runtime = %name, timeout = ?READ_TIMEOUT, "reading an InferenceRuntime the snapshot lacks timed out; answering from the snapshot");
                Read::NotRead("timeout")
            }
        }
    }

    fn misses(&self) -> std::sync::MutexGuard<'_, Misses> {
        self.misses.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [`MAX_MISSES`] names `n0`, `n1`, … remembered at `at(i)`.
    fn filled(at: impl Fn(usize) -> Instant) -> Misses {
        let mut m = Misses::default();
        for i in 0..MAX_MISSES {
            m.insert(&format!("n{i}"), at(i));
        }
        m
    }

    #[test]
    fn a_miss_is_remembered_for_its_ttl_then_read_again() {
        let mut m = Misses::default();
        let t0 = Instant::now();
        assert!(!m.recent("a", t0));
        m.insert("a", t0);
        assert!(m.recent("a", t0 + MISS_TTL / 2));
        assert!(!m.recent("a", t0 + MISS_TTL));
        m.remove("a");
        assert!(!m.recent("a", t0));
    }

    #[test]
    fn misses_stay_bounded_dropping_the_oldest() {
        let t0 = Instant::now();
        // All within the TTL, so none expires: the oldest half goes.
        let mut m = filled(|i| t0 + Duration::from_micros(i as u64));
        assert_eq!(m.len(), MAX_MISSES);
        let now = t0 + Duration::from_micros(MAX_MISSES as u64);
        m.insert("newest", now);
        assert!(m.len() <= MAX_MISSES / 2 + 1, "{} remembered", m.len());
        assert!(m.recent("newest", now));
        assert!(m.recent(&format!("n{}", MAX_MISSES - 1), now));
        assert!(!m.recent("n0", now));
    }

    #[test]
    fn misses_at_one_instant_keep_half() {
        let t0 = Instant::now();
        let mut m = filled(|_| t0);
        m.insert("next", t0);
        assert_eq!(m.len(), MAX_MISSES / 2 + 1);
        assert!(m.recent("next", t0));
    }

    #[test]
    fn expired_misses_go_first() {
        let t0 = Instant::now();
        let mut m = filled(|_| t0);
        let later = t0 + MISS_TTL;
        m.insert("late", later);
        assert_eq!(m.len(), 1);
        assert!(m.recent("late", later));
    }
}

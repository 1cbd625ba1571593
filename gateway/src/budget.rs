//! A bound on the request-body bytes one replica holds at once.
//!
//! Bodies are read whole and kept until the request is forwarded (see [`crate::proxy`]), so
//! during a cold start every held request keeps its body: `maxQueue` × `--body-limit` is 8 GiB
//! with the defaults, far past any gateway pod's memory. Past `--body-memory-limit` a request is
//! refused (`503` + `Retry-After`, reason `body_memory`) instead of the replica being OOM-killed
//! with every held request in it.

use std::sync::{
    Arc,
    atomic::{AtomicUsize, Ordering},
};

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
}

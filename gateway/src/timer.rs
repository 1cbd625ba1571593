//! A coarse timer for hyper's connection timeouts that keeps no kernel timer armed.
//!
//! hyper arms a header-read timeout for every request on a keep-alive connection. With tokio's
//! timer, a pending timer turns every `epoll_wait` of the HTTP worker into one with a timeout,
//! and the kernel arms and cancels a high-resolution timer on each sleep; in a virtual machine
//! each of those is a trap to the hypervisor. Measured on the 2-core VM of `docs/benchmarks.md`:
//! a single pending one-second tokio interval on a minimal hyper proxy's runtime added 5–7 µs to
//! every proxied request (p50, concurrency 1). This timer keeps its deadlines in a table that a
//! thread of its own checks once per [`RESOLUTION`]; registering and dropping a sleep are two
//! uncontended lock operations, and the worker runtimes are woken only when a deadline passes.

use std::{
    future::Future,
    pin::Pin,
    sync::{Arc, Mutex, Weak},
    task::{Context, Poll, Waker},
    time::{Duration, Instant},
};

use slab::Slab;

/// How late a [`CoarseTimer`] deadline may fire: at most this much after it passes.
pub const RESOLUTION: Duration = Duration::from_secs(1);

#[derive(Debug)]
struct Entry {
    deadline: Instant,
    fired: bool,
    waker: Option<Waker>,
}

#[derive(Debug, Default)]
struct Table {
    entries: Mutex<Slab<Entry>>,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slab<Entry>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks every entry whose deadline has passed as fired and wakes its task.
    fn fire_expired(&self, now: Instant) {
        let mut wake = Vec::new();
        {
            let mut entries = self.lock();
            for (_, e) in entries.iter_mut() {
                if !e.fired && e.deadline <= now {
                    e.fired = true;
                    wake.extend(e.waker.take());
                }
            }
        }
        for w in wake {
            w.wake();
        }
    }
}

/// A [`hyper::rt::Timer`] with [`RESOLUTION`] granularity, for timeouts of seconds (hyper's
/// header-read timeout); not for short or precise delays. Cheap to clone (shared). Its thread
/// ends when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct CoarseTimer {
    table: Arc<Table>,
}

impl CoarseTimer {
    /// A timer with its checking thread running.
    ///
    /// # Errors
    /// The operating system refused to start the thread (e.g. `EAGAIN` at the task limit).
    pub fn new() -> std::io::Result<Self> {
        let table = Arc::new(Table::default());
        let weak: Weak<Table> = Arc::downgrade(&table);
        std::thread::Builder::new()
            .name("hearth-coarse-timer".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(RESOLUTION);
                    let Some(table) = weak.upgrade() else { return };
                    table.fire_expired(Instant::now());
                }
            })?;
        Ok(Self { table })
    }

    /// Deadlines not yet dropped (for tests).
    pub fn pending(&self) -> usize {
        self.table.lock().len()
    }

    fn register(&self, deadline: Instant) -> CoarseSleep {
        let key = self.table.lock().insert(Entry {
            deadline,
            fired: false,
            waker: None,
        });
        CoarseSleep {
            table: self.table.clone(),
            key,
        }
    }
}

impl hyper::rt::Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.register(Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(self.register(deadline))
    }
}

/// One deadline of a [`CoarseTimer`]; removed from its table when dropped.
#[derive(Debug)]
pub struct CoarseSleep {
    table: Arc<Table>,
    key: usize,
}

impl Future for CoarseSleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut entries = self.table.lock();
        let Some(e) = entries.get_mut(self.key) else {
            return Poll::Ready(());
        };
        if e.fired {
            return Poll::Ready(());
        }
        match &e.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => e.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

impl hyper::rt::Sleep for CoarseSleep {}

impl Drop for CoarseSleep {
    fn drop(&mut self) {
        self.table.lock().try_remove(self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fires_after_the_deadline_and_forgets_dropped_sleeps() {
        let timer = CoarseTimer::new().unwrap();
        let start = Instant::now();
        let sleep = timer.register(start + Duration::from_millis(100));
        let dropped = timer.register(start + Duration::from_secs(3600));
        assert_eq!(timer.pending(), 2);
        drop(dropped);
        assert_eq!(timer.pending(), 1);
        sleep.await;
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(100), "{waited:?}");
        assert!(waited <= RESOLUTION * 3, "{waited:?}");
        assert_eq!(timer.pending(), 0);
    }

    #[test]
    fn fire_expired_wakes_only_passed_deadlines() {
        let timer = CoarseTimer::new().unwrap();
        let now = Instant::now();
        let mut early = Box::pin(timer.register(now));
        let mut late = Box::pin(timer.register(now + Duration::from_secs(3600)));
        let waker = Waker::noop();
        let mut cx = Context::from_waker(waker);
        let _ = early.as_mut().poll(&mut cx);
        timer.table.fire_expired(now);
        assert!(early.as_mut().poll(&mut cx).is_ready());
        assert!(late.as_mut().poll(&mut cx).is_pending());
    }
}

//! Native-evaluator fallbacks: each time the native evaluator hands a policy to the `cel`
//! interpreter (see [`crate::native`] and `docs/policies.md`), the hand-over is logged at debug
//! level (policy, expression, reason) and counted twice: per thread, for tests and benchmarks
//! ([`crate::PolicySet::native_fallbacks`]), and per process and reason, for the binaries'
//! metrics (`hearth_policy_native_fallbacks_total{reason}`, exported by [`Collector`]).

use std::{
    cell::Cell,
    sync::atomic::{AtomicU64, Ordering},
};

use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{TypedMetric, counter::ConstCounter},
};

/// Why the native evaluator handed a policy to the interpreter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The native evaluator panicked (a defect of its own; the interpreter answered instead).
    Panic,
    /// Anything else the native evaluator does not answer: an evaluation error (the
    /// interpreter words it), a wrong-typed result, or a value or construct it does not handle.
    Unsupported,
}

impl Reason {
    /// Every reason, in label order.
    pub const ALL: [Reason; 2] = [Reason::Panic, Reason::Unsupported];

    /// The `reason` label value: `panic` or `unsupported`.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Panic => "panic",
            Reason::Unsupported => "unsupported",
        }
    }

    fn total(self) -> &'static AtomicU64 {
        match self {
            Reason::Panic => &PANICS,
            Reason::Unsupported => &UNSUPPORTED,
        }
    }
}

static PANICS: AtomicU64 = AtomicU64::new(0);
static UNSUPPORTED: AtomicU64 = AtomicU64::new(0);

thread_local! {
    static ON_THREAD: Cell<u64> = const { Cell::new(0) };
}

/// Fallbacks for `reason` in this process since it started (all threads, all policy sets).
pub fn total(reason: Reason) -> u64 {
    reason.total().load(Ordering::Relaxed)
}

/// Fallbacks on the current thread since it started (all reasons).
pub(crate) fn on_thread() -> u64 {
    ON_THREAD.get()
}

/// Records one fallback of policy `policy` at expression `expression` (its CEL source).
pub(crate) fn record(policy: &str, expression: &str, reason: Reason) {
    ON_THREAD.set(ON_THREAD.get() + 1);
    reason.total().fetch_add(1, Ordering::Relaxed);
    tracing::debug!(
        policy,
        expression,
        reason = reason.as_str(),
        "native evaluator handed the policy to the interpreter"
    );
}

/// The metric's name as registered; the exposition adds `_total`.
pub const METRIC: &str = "hearth_policy_native_fallbacks";

/// A prometheus-client collector of `hearth_policy_native_fallbacks_total{reason}`: the process's
/// [`total`] per [`Reason`], read at each scrape. Register it in a registry without a prefix
/// (`Registry::register_collector`); one per registry.
#[derive(Debug, Clone, Copy, Default)]
pub struct Collector;

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut metric = encoder.encode_descriptor(
            METRIC,
            "Policies the native CEL evaluator handed to the interpreter, by reason",
            None,
            ConstCounter::<u64>::TYPE,
        )?;
        for reason in Reason::ALL {
            let labels = [("reason", reason.as_str())];
            ConstCounter::new(total(reason)).encode(metric.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

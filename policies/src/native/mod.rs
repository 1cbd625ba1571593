//! The native evaluator: the CEL that policies use most, evaluated over the request's JSON by
//! reference.
//!
//! The `cel` interpreter copies every map it selects from, converts every function argument
//! and result between its two value representations, and copies a comprehension's
//! accumulator on every step; a policy set over a Deployment spends nearly all its time there.
//! This evaluator reads `object`, `params` and the other roots in place, shares built values,
//! appends to a comprehension's accumulator in place, and calls into the `cel` interpreter
//! only for library functions it does not implement itself (quantities, URLs, IPs, …).
//!
//! It is exact where it answers, and only answers on success: any error, unexpected type or
//! construct it does not implement makes it return [`Failure::Fallback`], and the engine
//! evaluates the whole policy again with the interpreter, which is the reference and produces
//! the error message. Exceeded bounds are reported directly ([`Failure::Bound`]). Equality,
//! ordering, `size` and the functions below follow the interpreter (`cel` 0.13 with kube-cel
//! 0.8), which the differential tests in `tests/native.rs` check.
//!
//! `value` holds the values and their equality and ordering, `compile` the programs and how
//! a parsed expression becomes one, `eval` the environment that runs them.

mod compile;
mod eval;
mod value;

pub(crate) use compile::{Program, REQUEST_ROOT, compile};
pub(crate) use eval::Env;
pub(crate) use value::{Val, from_json};

/// Why the native evaluator gave no value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Failure {
    /// Let the interpreter evaluate the policy (an error, or something not implemented here).
    Fallback,
    /// A bound of [`crate::Limits`] was exceeded: the message for the policy's error.
    Bound(String),
}

type R<'a> = Result<Val<'a>, Failure>;

//! The ServingPolicy CEL engine.
//!
//! Platform teams (and Hearth's own defaults, in `policies/builtin`) write `ServingPolicy`
//! objects: CEL validations and mutations with the semantics of Kubernetes
//! `ValidatingAdmissionPolicy` (KEP-3488) and `MutatingAdmissionPolicy` (KEP-3962), where
//! `params` is the resolved `InferenceRuntime` and `service` the owning `LLMService`.
//!
//! - [`PolicySet::compile`] compiles once (bad policies are reported as [`PolicyLoadError`]s
//!   naming policy, field and position, and left out); the set is an `Arc`, cheap to clone
//!   and share across threads.
//! - [`PolicySet::evaluate`] runs an admission request: mutations, then validations; the
//!   [`Outcome`] separates denials, warnings, audit annotations, the JSON Patch and the
//!   patched object, and evaluation errors (with `failurePolicy` applied).
//! - [`PolicySet::mutate`] is the controller's render path: mutations only.
//! - [`report::results`] is a background scan's: what each policy says of an object that
//!   already exists, as Policy Report results.
//! - [`resolve::resolve_runtime`] picks the InferenceRuntime for a workload.
//! - [`Limits`] bounds what any expression may cost; see [`limits`].
//! - [`export`] turns the policies the apiserver can run into ValidatingAdmissionPolicy and
//!   MutatingAdmissionPolicy objects, and says why the others cannot be.
//! - [`fallback`] counts and logs the policies the native evaluator hands to the interpreter.
//!
//! Expressions use kube-cel's Kubernetes CEL libraries through its `cel` re-export.

pub mod builtin;
pub mod cluster;
pub mod compile;
pub mod engine;
pub mod export;
pub mod expression;
pub mod fallback;
pub(crate) mod guard;
pub mod limits;
pub mod manifest;
pub mod matching;
pub mod merge;
pub(crate) mod native;
pub mod report;
pub mod resolve;
pub mod testfile;
pub mod value;

pub use compile::{CompiledExpr, ExprError};
pub use engine::{
    Denial, ErrorKind, EvalError, EvalInput, GroupVersionKind, GroupVersionResource,
    MUTATION_REPORT, MutateError, Mutated, MutationReport, Outcome, Phase, PolicyLoadError,
    PolicySet, PolicySettings, RequestInfo, UserInfo, VALIDATION_FAILURE, ValidationFailure,
};
pub use limits::Limits;
pub use resolve::{ResolveError, Selection, resolve_runtime};

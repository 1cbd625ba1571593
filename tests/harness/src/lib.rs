//! The end-to-end harness of the local cluster (`tests/cluster`), shared by the suites of
//! `tests/e2e` and `make demo`: installs Hearth with its Helm chart (once per cluster), applies
//! stub runtimes and services whose gateway and backend pods run on the real node, and observes
//! what happens: a streaming chat client that timestamps heartbeats and tokens, and timelines of
//! a Deployment's replicas and of its pods. The demo's steps live in [`demo`], run by the
//! `hearth-demo` binary and checked by the suite `tests/e2e/tests/demo.rs`. See docs/e2e.md.

pub mod admin;
pub mod client;
pub mod demo;
pub mod faults;
pub mod stack;
pub mod timeline;

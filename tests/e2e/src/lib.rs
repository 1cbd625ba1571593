//! End-to-end suites against the local control plane of `tests/cluster/`; the tests live in
//! `tests/*.rs` and share `hearth-test-support`.

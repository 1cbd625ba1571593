//! `hearth-policy test` over `policies/builtin` and `examples/`, so `cargo test` covers them.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::path::Path;

use hearth_policies::testfile::{find_test_files, render_table, run_dir};

fn run(dir: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    assert!(
        !find_test_files(&root).is_empty(),
        "no hearth-test.yaml under {}",
        root.display()
    );
    let rows = run_dir(&root);
    let table = render_table(&rows);
    println!("{table}");
    assert!(rows.iter().all(|r| r.passed()), "{table}");
}

#[test]
fn builtin_policies_pass_their_tests() {
    run("builtin");
}

#[test]
fn examples_pass_their_tests() {
    run("../examples");
}

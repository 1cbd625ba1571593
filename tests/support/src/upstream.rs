//! The public Hearth example manifests every suite checks against, read from
//! `../shared/examples/upstream` beside the repository (or `HEARTH_UPSTREAM_EXAMPLES`).

use std::path::PathBuf;

use serde_json::Value;

/// Environment variable naming another directory of upstream examples.
pub const UPSTREAM_EXAMPLES_ENV: &str = "HEARTH_UPSTREAM_EXAMPLES";

/// The upstream examples directory. Panics with the fix when it is missing: every test that
/// asks for it needs it.
pub fn upstream_dir() -> PathBuf {
    let dir = std::env::var_os(UPSTREAM_EXAMPLES_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/examples/upstream")
        });
    assert!(
        dir.is_dir(),
        "upstream examples not found at {}: check out shared/ beside the repository or set {UPSTREAM_EXAMPLES_ENV}",
        dir.display()
    );
    dir
}

/// The path of one upstream example file, e.g. `stub-llmservice.yaml`.
pub fn upstream_file(name: &str) -> PathBuf {
    upstream_dir().join(name)
}

/// Every upstream example of `kind`, as JSON, in file-name order.
pub fn upstream_examples(kind: &str) -> Vec<Value> {
    let dir = upstream_dir();
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("upstream examples at {}: {e}", dir.display()))
        .map(|e| e.expect("reading the upstream examples directory").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
            serde_yaml::from_str::<Value>(&text)
                .unwrap_or_else(|e| panic!("parsing {}: {e}", p.display()))
        })
        .filter(|v| v["kind"] == kind)
        .collect()
}

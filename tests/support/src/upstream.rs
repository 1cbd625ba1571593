//! The public Hearth example manifests every suite checks against, read from
//! `../shared/examples/upstream` beside the repository (or `HEARTH_UPSTREAM_EXAMPLES`). A test
//! that asks for them fails, naming where it looked and how to provide them, when the directory,
//! a named file or every example of a kind is missing: none passes without them.

use std::path::PathBuf;

use serde_json::Value;

/// Environment variable naming another directory of upstream examples.
pub const UPSTREAM_EXAMPLES_ENV: &str = "HEARTH_UPSTREAM_EXAMPLES";

/// Where the directory was looked up, and how to provide it, as the end of a failure message:
/// `(<where it came from>): <the fix>`.
fn how_to_provide() -> String {
    let source = if std::env::var_os(UPSTREAM_EXAMPLES_ENV).is_some() {
        format!("{UPSTREAM_EXAMPLES_ENV} names it")
    } else {
        format!("{UPSTREAM_EXAMPLES_ENV} is unset, so the default beside the checkout was used")
    };
    format!(
        "({source}): put the public Hearth example manifests at ../shared/examples/upstream \
         beside the checkout, or set {UPSTREAM_EXAMPLES_ENV} to a directory holding them"
    )
}

/// The upstream examples directory. Panics when it is missing, naming where it looked and how
/// to provide it: every test that asks for it needs it.
pub fn upstream_dir() -> PathBuf {
    let dir = std::env::var_os(UPSTREAM_EXAMPLES_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/examples/upstream")
        });
    assert!(
        dir.is_dir(),
        "upstream examples not found at {} {}",
        dir.display(),
        how_to_provide()
    );
    dir
}

/// The path of one upstream example file, e.g. `stub-llmservice.yaml`. Panics when the file is
/// not in the directory.
pub fn upstream_file(name: &str) -> PathBuf {
    let path = upstream_dir().join(name);
    assert!(
        path.is_file(),
        "upstream example {name} not found at {} {}",
        path.display(),
        how_to_provide()
    );
    path
}

/// Every upstream example of `kind`, as JSON, in file-name order. Panics when there is none, so
/// that a test looping over them cannot pass without checking one.
pub fn upstream_examples(kind: &str) -> Vec<Value> {
    let dir = upstream_dir();
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("upstream examples at {}: {e}", dir.display()))
        .map(|e| e.expect("reading the upstream examples directory").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    let examples: Vec<Value> = paths
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(&p)
                .unwrap_or_else(|e| panic!("reading {}: {e}", p.display()));
            serde_yaml::from_str::<Value>(&text)
                .unwrap_or_else(|e| panic!("parsing {}: {e}", p.display()))
        })
        .filter(|v| v["kind"] == kind)
        .collect();
    assert!(
        !examples.is_empty(),
        "no upstream {kind} examples in {} {}",
        dir.display(),
        how_to_provide()
    );
    examples
}

//! Embeds the built-in ServingPolicies (`builtin/*.yaml`) into the library, so the webhook and
//! the controller carry exactly the defaults they were built and tested with.
#![allow(
    clippy::expect_used,
    reason = "a build script reports a failure by panicking"
)]

use std::fmt::Write as _;
use std::path::PathBuf;

fn main() {
    // The runtime variable, not `env!`: a build script binary may be reused from another checkout.
    let manifest_dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = PathBuf::from(manifest_dir).join("builtin");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    // Never build the engine without its defaults.
    assert!(
        !files.is_empty(),
        "no built-in policies in {}: the library embeds builtin/*.yaml",
        dir.display()
    );
    let mut out = String::from(
        "/// The built-in policy manifests: (file name, YAML), in evaluation order.\npub const MANIFESTS: &[(&str, &str)] = &[\n",
    );
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        let name = f
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "    ({name:?}, include_str!({:?})),",
            f.display().to_string()
        );
    }
    out.push_str("];\n");
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    std::fs::write(PathBuf::from(out_dir).join("builtin.rs"), out).expect("writing builtin.rs");
}

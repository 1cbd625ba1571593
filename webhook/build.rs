//! Embeds Hearth's built-in ServingPolicies (`policies/builtin/*.yaml`) into the webhook, so
//! the binary always carries the defaults it was built and tested with.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/builtin");
    println!("cargo:rerun-if-changed={}", dir.display());
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "yaml" || e == "yml"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    // Never build a webhook without its defaults.
    assert!(
        !files.is_empty(),
        "no built-in policies in {}: the webhook embeds policies/builtin/*.yaml",
        dir.display()
    );
    let mut out = String::from(
        "/// The built-in policy manifests: (file name, YAML).\npub const BUILTIN: &[(&str, &str)] = &[\n",
    );
    for f in &files {
        println!("cargo:rerun-if-changed={}", f.display());
        let name = f.file_name().unwrap().to_string_lossy();
        let _ = writeln!(
            out,
            "    ({name:?}, include_str!({:?})),",
            f.display().to_string()
        );
    }
    out.push_str("];\n");
    let target = Path::new(&std::env::var("OUT_DIR").unwrap()).join("builtin.rs");
    std::fs::write(target, out).unwrap();
}

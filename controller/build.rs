//! Embeds Hearth's built-in ServingPolicies (`policies/builtin/*.yaml`) into the controller, so
//! the binary renders backends with exactly the defaults it was built and tested with.

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
    let mut out = String::from(
        "/// The built-in policy manifests: (file name, YAML), in evaluation order.\npub const BUILTIN: &[(&str, &str)] = &[\n",
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
    std::fs::write(Path::new(&out_dir).join("builtin.rs"), out).expect("writing builtin.rs");
}

//! Writes the generated CRD manifests into `crds/` (or the directory given as the first
//! argument). Run it after changing the API types: `cargo run -p hearth-crds --example crdgen`.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::exit)]

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
    for (file, crd) in hearth_crds::crds() {
        let path = dir.join(file);
        std::fs::write(&path, hearth_crds::crd_yaml(&crd)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

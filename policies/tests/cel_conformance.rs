//! CEL conformance of the policy engine: the cel-spec "simple" suite and the Kubernetes
//! library table (`tests/cel/kubernetes.yaml`) through both evaluators. Fails when a case in
//! `tests/cel/baseline.txt` no longer passes; `HEARTH_CEL_BASELINE=update` rewrites the
//! baseline with today's passing cases. `cargo run -p hearth-policies --example
//! cel_conformance` prints the table.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod cel;

use std::collections::BTreeSet;

#[test]
fn conformance_does_not_regress() {
    let spec = cel::spec_dir();
    let mut groups = Vec::new();
    if spec.join("testdata").is_dir() {
        groups.extend(cel::load_spec(&spec).expect("the cel-spec data loads"));
    } else {
        eprintln!(
            "no cel-spec data at {} (set {}): only the Kubernetes table runs",
            spec.display(),
            cel::SPEC_DIR_VAR
        );
    }
    groups.extend(cel::load_kubernetes().expect("the Kubernetes table loads"));
    let results = cel::run_all(groups);
    let table = cel::render(&results, true);
    println!("{table}");
    let passing = cel::passing(&results);
    let ran: BTreeSet<String> = results
        .iter()
        .flat_map(|g| &g.results)
        .map(|r| r.id.clone())
        .collect();
    let path = cel::data_dir().join("baseline.txt");
    if std::env::var("HEARTH_CEL_BASELINE").as_deref() == Ok("update") {
        let mut text = String::from(
            "# Conformance cases that pass (tests/cel_conformance.rs); regenerate with\n\
             # HEARTH_CEL_BASELINE=update cargo test -p hearth-policies --test cel_conformance\n",
        );
        for id in &passing {
            text.push_str(id);
            text.push('\n');
        }
        std::fs::write(&path, text).expect("baseline written");
        return;
    }
    let baseline: BTreeSet<String> = std::fs::read_to_string(&path)
        .expect("tests/cel/baseline.txt")
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    // Cases of data that is not here (no cel-spec directory) are not regressions.
    let regressed: Vec<&String> = baseline
        .iter()
        .filter(|id| ran.contains(*id) && !passing.contains(*id))
        .collect();
    let new: Vec<&String> = passing.difference(&baseline).collect();
    if !new.is_empty() {
        println!(
            "{} cases pass that the baseline does not list (HEARTH_CEL_BASELINE=update adds them)",
            new.len()
        );
    }
    assert!(
        regressed.is_empty(),
        "cases that passed before fail now:\n{}",
        regressed
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

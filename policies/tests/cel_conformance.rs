//! CEL conformance of the policy engine: the cel-spec "simple" suite and the Kubernetes
//! library table (`tests/cel/kubernetes.yaml`) through both evaluators. Fails when a case in
//! `tests/cel/baseline.txt` no longer passes or no longer runs, and when the cel-spec data is
//! missing (`../shared/conformance/cel-spec` beside the checkout, or `$HEARTH_CEL_SPEC_DIR`):
//! the message names the directory it looked in and how to provide it.
//! `HEARTH_CEL_BASELINE=update` rewrites the baseline with today's passing cases.
//! `cargo run -p hearth-policies --example cel_conformance` prints the table.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod cel;

use std::collections::BTreeSet;

#[test]
fn conformance_does_not_regress() {
    let spec = cel::require_spec_dir().unwrap_or_else(|e| panic!("{e}"));
    let mut groups = cel::load_spec(&spec)
        .unwrap_or_else(|e| panic!("the cel-spec data at {} does not load: {e}", spec.display()));
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
    // A baseline case that did not run at all (a cel-spec file missing from the data, a
    // Kubernetes case removed from the table) is not a pass either.
    let not_run: Vec<&String> = baseline.iter().filter(|id| !ran.contains(*id)).collect();
    assert!(
        not_run.is_empty(),
        "{} cases of the baseline did not run: the cel-spec data at {} lacks them (it must be \
         the whole tests/simple/testdata of cel-spec) or tests/cel/kubernetes.yaml dropped \
         them; after removing cases on purpose, HEARTH_CEL_BASELINE=update rewrites the \
         baseline:\n{}",
        not_run.len(),
        spec.display(),
        not_run
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    let regressed: Vec<&String> = baseline
        .iter()
        .filter(|id| !passing.contains(*id))
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

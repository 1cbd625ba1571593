//! Prints the engine's CEL conformance table: the cel-spec "simple" suite (from
//! `$HEARTH_CEL_SPEC_DIR`, else `../shared/conformance/cel-spec` next to the checkout) and the
//! Kubernetes library table, each case through the native evaluator (with its hand-over to
//! the interpreter) and the interpreter alone.
//!
//! `cargo run -p hearth-policies --example cel_conformance [-- --failures]`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::exit)]

#[path = "../tests/cel/mod.rs"]
mod cel;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // `--eval EXPR`: one expression through both evaluators.
    if let Some(i) = args.iter().position(|a| a == "--eval") {
        let source = args.get(i + 1).map_or("", String::as_str);
        match hearth_policies::expression::Expression::compile(source, &[]) {
            Err(e) => println!("load error: {e}"),
            Ok(expr) => {
                for path in [
                    hearth_policies::expression::Path::Engine,
                    hearth_policies::expression::Path::Interpreter,
                ] {
                    let got = expr.evaluate(&[], path);
                    println!("{path:?} (native: {}): {:?}", got.native, got.result);
                }
            }
        }
        return;
    }
    let failures = args.iter().any(|a| a == "--failures");
    let spec = cel::require_spec_dir().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    });
    let mut groups = match cel::load_spec(&spec) {
        Ok(g) => g,
        Err(e) => {
            eprintln!(
                "cel-spec data at {} does not load ({e}); set {}",
                spec.display(),
                cel::SPEC_DIR_VAR
            );
            std::process::exit(2);
        }
    };
    let spec_len = groups.len();
    groups.extend(cel::load_kubernetes().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2);
    }));
    let results = cel::run_all(groups);
    let (spec_results, k8s) = results.split_at(spec_len);
    println!("cel-spec simple suite ({}):\n", spec.display());
    println!("{}", cel::render(spec_results, failures));
    println!("Kubernetes CEL libraries (tests/cel/kubernetes.yaml):\n");
    println!("{}", cel::render(k8s, failures));
}

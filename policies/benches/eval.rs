//! Benchmark (not a timed test): evaluations/s and latency percentiles of one full admission
//! evaluation (mutations + validations) of an annotated Deployment, on one thread.
//!
//! `cargo bench -p hearth-policies --bench eval` (pin to one core with `taskset -c 0`).
//! Rows: a one-policy baseline, the built-ins, the built-ins plus 20 platform policies, and that
//! set again with the `cel` interpreter only (no native evaluator, a tenth of the
//! iterations); the last column is the cost relative to the baseline in the same run.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::exit)]

use std::{path::Path, time::Instant};

use hearth_crds::servingpolicy::Operation;
use hearth_policies::{EvalInput, PolicySet, manifest};
use serde_json::json;

fn load(paths: &[&Path]) -> manifest::Bundle {
    let mut b = manifest::Bundle::default();
    for p in paths {
        manifest::read_path(p, &mut b).expect("manifests load");
    }
    b
}

struct Row {
    name: &'static str,
    policies: usize,
    per_sec: f64,
    p50_us: f64,
    p99_us: f64,
}

fn measure(name: &'static str, set: &PolicySet, input: &EvalInput, iterations: usize) -> Row {
    for _ in 0..iterations / 10 {
        std::hint::black_box(set.evaluate(input));
    }
    let mut samples = Vec::with_capacity(iterations);
    let start = Instant::now();
    for _ in 0..iterations {
        let t = Instant::now();
        let out = set.evaluate(std::hint::black_box(input));
        samples.push(t.elapsed().as_nanos() as f64 / 1000.0);
        assert!(out.errors.is_empty(), "{:?}", out.errors);
        std::hint::black_box(out);
    }
    let total = start.elapsed().as_secs_f64();
    samples.sort_by(f64::total_cmp);
    let pct = |p: f64| samples[((samples.len() as f64 - 1.0) * p) as usize];
    Row {
        name,
        policies: set.names().len(),
        per_sec: iterations as f64 / total,
        p50_us: pct(0.50),
        p99_us: pct(0.99),
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let builtin = load(&[&root.join("builtin"), &root.join("builtin/tests/runtimes")]);
    let platform = load(&[&root.join("benches/platform-policies.yaml")]);
    let rt = builtin
        .runtimes
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some("vllm-nvidia-a10"))
        .expect("runtime");

    let deployment = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "qwen", "namespace": "team-a",
                     "labels": {"team": "a", "app": "qwen"},
                     "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10", "example.com/owner": "alice"}},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"app": "qwen"}},
            "template": {"metadata": {"labels": {"app": "qwen"}},
                "spec": {"securityContext": {"runAsNonRoot": true},
                    "containers": [
                        {"name": "vllm", "image": "vllm/vllm-openai:v0.25.1",
                         "args": ["Qwen/Qwen2.5-7B-Instruct", "--port=8000"],
                         "env": [{"name": "HF_HOME", "value": "/cache"}, {"name": "VLLM_LOGGING_LEVEL", "value": "INFO"}],
                         "ports": [{"name": "http", "containerPort": 8000}],
                         "resources": {"requests": {"cpu": "8", "memory": "32Gi"}, "limits": {"memory": "32Gi"}}},
                        {"name": "metrics", "image": "registry.example.com/exporter:1.2",
                         "ports": [{"name": "metrics", "containerPort": 9400}],
                         "resources": {"limits": {"memory": "128Mi"}}}
                    ]}}}
    });
    let mut input = EvalInput::for_object(deployment, Operation::Create);
    input.params = Some(manifest::runtime_params(rt));

    let baseline = manifest::Bundle {
        policies: platform.policies[..1].to_vec(),
        ..Default::default()
    };
    let all = [&builtin.policies[..], &platform.policies[..]].concat();
    let sets = [
        ("baseline: 1 validation", baseline.policies.clone()),
        ("built-ins", builtin.policies.clone()),
        ("built-ins + 20 platform", all),
    ];
    // `cargo bench` passes `--bench`; under `cargo test --all-targets` run a quick smoke pass.
    let benching = std::env::args().any(|a| a == "--bench");
    let iterations: usize = std::env::var("BENCH_ITERATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if benching { 5000 } else { 20 });
    let mut rows = Vec::new();
    let mut full = None;
    // `BENCH_ONLY=built-ins` measures only the rows whose name starts with it (for profiling).
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    for (name, policies) in &sets {
        if !name.starts_with(&only) && !rows.is_empty() {
            continue;
        }
        let (set, errors) = PolicySet::compile(policies);
        assert!(errors.is_empty(), "{errors:?}");
        rows.push(measure(name, &set, &input, iterations));
        full = Some(set);
    }
    // The same set with the `cel` interpreter only: what the native evaluator saves.
    let full = full.expect("sets");
    let native = full.native_policies().len();
    let fallbacks = PolicySet::native_fallbacks();
    let all_rows = only.is_empty();
    rows.extend(all_rows.then(|| {
        measure(
            "  same, interpreter only",
            &full.interpreted(),
            &input,
            iterations / 10,
        )
    }));
    let base = rows[0].per_sec;
    println!("hearth-policies evaluation benchmark: {iterations} evaluations per row, one thread");
    println!(
        "native evaluator runs {native} of {} policies of the full set; {fallbacks} fallbacks to the interpreter",
        full.names().len()
    );
    println!(
        "{:<26} {:>8} {:>12} {:>10} {:>10} {:>12}",
        "set", "policies", "evals/s", "p50 µs", "p99 µs", "cost vs base"
    );
    for r in &rows {
        println!(
            "{:<26} {:>8} {:>12.0} {:>10.1} {:>10.1} {:>11.1}x",
            r.name,
            r.policies,
            r.per_sec,
            r.p50_us,
            r.p99_us,
            base / r.per_sec
        );
    }
}

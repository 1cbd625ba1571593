//! The runner's command line refuses bad input with messages that name the flag and the fix.
//! (Also makes `cargo test --workspace --no-run` build the runner and demo binaries, which
//! tests/cluster/up starts.)

use std::process::Command;

fn run(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_hearth-pod-runner"))
        .args(args)
        .output()
        .expect("runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn image_without_binary_is_refused_with_the_expected_form() {
    let dir = std::env::temp_dir().join(format!("pod-runner-cli-{}", std::process::id()));
    let (ok, err) = run(&[
        "run",
        "--kubeconfig=/nonexistent",
        &format!("--state-dir={}", dir.display()),
        "--image=hearth.dev/vllm-stub:e2e",
    ]);
    assert!(!ok);
    assert!(err.contains("expected IMAGE=BINARY"), "{err}");
}

#[test]
fn missing_binary_is_refused_with_a_build_hint() {
    let dir = std::env::temp_dir().join(format!("pod-runner-cli-b-{}", std::process::id()));
    let (ok, err) = run(&[
        "run",
        "--kubeconfig=/nonexistent",
        &format!("--state-dir={}", dir.display()),
        "--image=hearth.dev/vllm-stub:e2e=/nonexistent/vllm-stub",
    ]);
    assert!(!ok);
    assert!(err.contains("not found; build it first"), "{err}");
}

#[test]
fn image_is_required() {
    let (ok, err) = run(&["run", "--kubeconfig=/nonexistent", "--state-dir=/tmp"]);
    assert!(!ok);
    assert!(err.contains("--image"), "{err}");
}

//! Running the cluster's command-line tools (helm, kubectl, go) from a test.

use std::io::Write as _;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail};

/// Runs `cmd`, failing with its stdout and stderr unless it exits 0; `what` names it in errors.
///
/// # Errors
/// It cannot be started, or it exits non-zero.
pub fn run(cmd: &mut Command, what: &str) -> Result<Output> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    checked(out, what)
}

/// [`run`] with `input` on its stdin.
///
/// # Errors
/// As [`run`], and stdin that cannot be written.
pub fn run_stdin(cmd: &mut Command, input: &[u8], what: &str) -> Result<Output> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {what}"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input)
        .with_context(|| format!("writing stdin of {what}"))?;
    let out = child.wait_with_output()?;
    checked(out, what)
}

fn checked(out: Output, what: &str) -> Result<Output> {
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(out)
}

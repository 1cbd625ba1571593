//! The local cluster's OCI registry (`tests/cluster/lib/registry.sh`) as the suites use it:
//! its address and credentials from the state dir, requests to its API, copies within it. What
//! `build/push` pushed there: `hearth_test_support::pushed_images`.

use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use hearth_test_support::state_dir;
use serde_json::json;

/// The cluster's registry, as `tests/cluster/up` left it in the state dir.
pub struct Registry {
    /// `host:port`.
    pub host: String,
    dir: PathBuf,
    ca: PathBuf,
}

impl Registry {
    pub fn load() -> Result<Self> {
        let state = state_dir();
        let env = std::fs::read_to_string(state.join("node.env"))
            .context("reading the cluster's node.env (tests/cluster/up writes it)")?;
        let host = env
            .lines()
            .find_map(|l| l.strip_prefix("REGISTRY="))
            .filter(|h| !h.is_empty())
            .context("node.env names no REGISTRY: a cluster started before the registry; run tests/cluster/down, then up")?
            .to_owned();
        Ok(Self {
            host,
            dir: state.join("registry"),
            ca: state.join("pki/ca.crt"),
        })
    }

    pub fn password(&self) -> Result<String> {
        Ok(std::fs::read_to_string(self.dir.join("password"))?
            .trim()
            .to_owned())
    }

    /// The Docker config with the registry's credentials that `up` wrote (`auth.json`).
    pub fn auth_config(&self) -> Result<serde_json::Value> {
        let text = std::fs::read_to_string(self.dir.join("auth.json"))?;
        Ok(serde_json::from_str(&text)?)
    }

    /// An image tag no earlier run used (`<prefix>-<pid>-<nanoseconds>`): a reference the node has
    /// not pulled, so its first use is a real pull.
    pub fn fresh_tag(prefix: &str) -> String {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        format!("{prefix}-{}-{nanos}", std::process::id())
    }

    /// A Docker config (`.dockerconfigjson`) giving `user:password` for `key` (a registry host,
    /// or host/path: the kubelet matches the longest prefix of the image's name).
    pub fn docker_config(key: &str, user: &str, password: &str) -> String {
        json!({"auths": {key: {"username": user, "password": password}}}).to_string()
    }

    /// `GET https://<host><path>` with `credentials` (none: anonymous; given to curl on its stdin,
    /// not its command line); the status and the body.
    pub async fn get(
        &self,
        path: &str,
        credentials: Option<(&str, &str)>,
        accept: &str,
    ) -> Result<(u16, String)> {
        let mut cmd = tokio::process::Command::new("curl");
        cmd.args([
            "-sS",
            "--max-time",
            "10",
            "-w",
            "\n%{http_code}",
            "--cacert",
        ])
        .arg(&self.ca)
        .args(["-H", &format!("Accept: {accept}"), "-K", "-"])
        .arg(format!("https://{}{path}", self.host))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
        let mut child = cmd.spawn().context("running curl")?;
        let config = credentials
            .map(|(user, password)| format!("user = \"{user}:{password}\"\n"))
            .unwrap_or_default();
        {
            use tokio::io::AsyncWriteExt as _;
            let mut stdin = child.stdin.take().context("curl's stdin")?;
            stdin.write_all(config.as_bytes()).await?;
        }
        let out = child.wait_with_output().await.context("running curl")?;
        ensure!(
            out.status.success(),
            "curl https://{}{path}: {}",
            self.host,
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').context("curl printed no status")?;
        Ok((code.trim().parse()?, body.to_owned()))
    }

    /// Copies an image within the registry (`skopeo copy docker://… docker://…`): a new
    /// reference, so the node has no image of that name yet.
    pub async fn copy(&self, from: &str, to: &str) -> Result<()> {
        let out = tokio::process::Command::new("skopeo")
            .args(["copy", "--quiet", "--authfile"])
            .arg(self.dir.join("auth.json"))
            .arg("--src-cert-dir")
            .arg(self.dir.join("certs.d").join(&self.host))
            .arg("--dest-cert-dir")
            .arg(self.dir.join("certs.d").join(&self.host))
            .arg(format!("docker://{}/{from}", self.host))
            .arg(format!("docker://{}/{to}", self.host))
            .output()
            .await
            .context("running skopeo")?;
        ensure!(
            out.status.success(),
            "skopeo copy {from} {to}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }
}

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
        let env = std::fs::read_to_string(state.join("node.env")).with_context(|| {
            format!(
                "reading the cluster's {} (tests/cluster/up writes it; HEARTH_CLUSTER_STATE names another state dir)",
                state.join("node.env").display()
            )
        })?;
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

    /// The cluster's signing public key (`cosign.pub`), whose private key signed what
    /// `tests/cluster/push-images` pushed.
    pub fn public_key(&self) -> PathBuf {
        self.dir.join("cosign.pub")
    }

    /// Runs the cluster's cosign (`<state>/bin/cosign`) as `cosign <subcommand> <args>` with the
    /// registry's credentials (a Docker config dir) and CA (`--registry-cacert`): whether it
    /// succeeded, its stdout and its stderr.
    pub async fn cosign(
        &self,
        subcommand: &[&str],
        args: &[&str],
    ) -> Result<(bool, String, String)> {
        let config =
            std::env::temp_dir().join(format!("hearth-cosign-{}", Self::fresh_tag("auth")));
        std::fs::create_dir_all(&config)?;
        std::fs::copy(self.dir.join("auth.json"), config.join("config.json"))?;
        let out = tokio::process::Command::new(state_dir().join("bin/cosign"))
            .args(subcommand)
            .arg("--registry-cacert")
            .arg(&self.ca)
            .args(args)
            .env("DOCKER_CONFIG", &config)
            .env("COSIGN_PASSWORD", "")
            .output()
            .await;
        let _ = std::fs::remove_dir_all(&config);
        let out = out.context("running cosign (<state>/bin/cosign; tests/cluster/up links it)")?;
        Ok((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    }

    /// `cosign verify --key <key>` of `reference`, without a transparency log (what
    /// `build/push --sign-key` signs): whether it verified, stdout (the signed payloads) and
    /// stderr.
    pub async fn verify(&self, key: &str, reference: &str) -> Result<(bool, String, String)> {
        self.cosign(
            &["verify"],
            &["--key", key, "--insecure-ignore-tlog=true", reference],
        )
        .await
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
    /// Builds an image `FROM scratch` holding `files` (name, content; mode 0644) at its root,
    /// with buildah in a storage of its own, and pushes it to `reference` (`<host>/<path>:<tag>`)
    /// with the registry's credentials. The digest of the pushed manifest.
    pub async fn build_and_push(
        &self,
        reference: &str,
        files: &[(&str, Vec<u8>)],
    ) -> Result<String> {
        use std::os::unix::fs::PermissionsExt as _;
        let work = std::env::temp_dir().join(format!("hearth-image-{}", Self::fresh_tag("build")));
        let context = work.join("context");
        std::fs::create_dir_all(&context)?;
        let mut containerfile = String::from("FROM scratch\n");
        for (name, content) in files {
            let path = context.join(name);
            std::fs::write(&path, content)?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))?;
            containerfile.push_str(&format!("COPY {name} /{name}\n"));
        }
        std::fs::write(work.join("Containerfile"), containerfile)?;
        let storage = [
            "--root".to_owned(),
            work.join("root").display().to_string(),
            "--runroot".to_owned(),
            work.join("runroot").display().to_string(),
            "--storage-driver".to_owned(),
            "vfs".to_owned(),
        ];
        let run = |args: Vec<String>| async move {
            let out = tokio::process::Command::new("buildah")
                .args(&args)
                .output()
                .await
                .context("running buildah (Debian: apt-get install buildah)")?;
            ensure!(
                out.status.success(),
                "buildah {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            anyhow::Ok(())
        };
        let result = async {
            let mut build = storage.to_vec();
            build.extend(["build", "--quiet", "-f"].map(String::from));
            build.push(work.join("Containerfile").display().to_string());
            build.extend(["-t".to_owned(), reference.to_owned()]);
            build.push(context.display().to_string());
            run(build).await?;
            let mut push = storage.to_vec();
            push.extend(["push", "--quiet", "--authfile"].map(String::from));
            push.push(self.dir.join("auth.json").display().to_string());
            push.push("--cert-dir".to_owned());
            push.push(
                self.dir
                    .join("certs.d")
                    .join(&self.host)
                    .display()
                    .to_string(),
            );
            push.push("--digestfile".to_owned());
            push.push(work.join("digest").display().to_string());
            push.push(reference.to_owned());
            push.push(format!("docker://{reference}"));
            run(push).await?;
            Ok(std::fs::read_to_string(work.join("digest"))?
                .trim()
                .to_owned())
        }
        .await;
        let mut clean = storage.to_vec();
        clean.extend(["rmi", "--all", "--force"].map(String::from));
        let _ = run(clean).await;
        let _ = std::fs::remove_dir_all(&work);
        result
    }
}

//! The stub binary reading its model from disk, as a process: the prewarm step (the binary
//! invoked as `python3 -c <the controller's program>`) fills a Hugging Face cache; a stub whose
//! `--model` is a repository id with `HF_HOME` set waits (503, a log line saying what is missing)
//! until the files are there, then serves; a model directory is checked, and a corrupt one ends
//! the process.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

use common::{Process, TempDir, python3};

/// The program controller/src/render/cache.rs renders for `hf://<repo>`.
fn prewarm_program(repo: &str) -> String {
    format!(
        "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id={repo:?}))\n"
    )
}

/// A stub process whose log lines are collected.
struct Stub(Process);

impl Stub {
    fn start(model: &str, envs: &[(&str, &Path)]) -> Self {
        Self(Process::start(model, &[], envs))
    }

    fn url(&self, path: &str) -> String {
        self.0.url(path)
    }

    fn log_has(&self, needle: &str) -> bool {
        self.0
            .log
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains(needle))
    }

    async fn wait_log(&self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !self.log_has(needle) {
            assert!(
                Instant::now() < deadline,
                "no log line with {needle:?}: {:#?}",
                self.0.log.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn health(&self, c: &HttpClient) -> Option<StatusCode> {
        let req = Request::get(self.url("/health"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        c.request(req).await.ok().map(|r| r.status())
    }

    async fn wait_health(&self, c: &HttpClient, want: StatusCode) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if self.health(c).await == Some(want) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "/health never answered {want}: {:#?}",
                self.0.log.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn chat(c: &HttpClient, stub: &Stub) -> (StatusCode, String) {
    let body = serde_json::json!({"model": "stub-svc", "stream": true,
        "messages": [{"role": "user", "content": "hi"}]});
    let req = Request::post(stub.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = c.request(req).await.unwrap();
    let status = resp.status();
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

#[test]
fn python3_runs_the_controllers_prewarm_program() {
    let tmp = TempDir::new("py");
    let py = python3(&tmp.0);
    let hf_home = tmp.0.join("models/huggingface");
    let run = || {
        Command::new(&py)
            .args(["-c", &prewarm_program("hearth/stub-model")])
            .env("HF_HOME", &hf_home)
            .env_remove("HF_HUB_CACHE")
            .output()
            .unwrap()
    };
    let out = run();
    assert!(out.status.success(), "{out:?}");
    let stdout = String::from_utf8(out.stdout).unwrap();
    let snapshot = PathBuf::from(stdout.trim_end());
    let repo_dir = hf_home.join("hub/models--hearth--stub-model");
    assert_eq!(snapshot.parent().unwrap(), repo_dir.join("snapshots"));
    let revision = std::fs::read_to_string(repo_dir.join("refs/main")).unwrap();
    assert_eq!(
        snapshot.file_name().unwrap().to_str(),
        Some(revision.as_str())
    );
    for f in ["config.json", "model.safetensors"] {
        let target = std::fs::read_link(snapshot.join(f)).unwrap();
        assert!(target.starts_with("../../blobs"), "{f} -> {target:?}");
        assert!(snapshot.join(f).is_file(), "{f}");
    }
    // Idempotent, as snapshot_download: the second run fetches nothing and prints the same path.
    let again = run();
    assert!(again.status.success());
    assert_eq!(String::from_utf8(again.stdout).unwrap(), stdout);
    assert!(String::from_utf8_lossy(&again.stderr).contains("cached already"));
    // Anything but the prewarm program fails as Python would.
    let bad = Command::new(&py)
        .args(["-c", "import os; os.system('true')"])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("Traceback"));
}

#[tokio::test]
async fn repository_in_hf_home_waits_for_the_prewarm_then_serves() {
    let tmp = TempDir::new("wait");
    let hf_home = tmp.0.join("models/huggingface");
    std::fs::create_dir_all(&hf_home).unwrap();
    let stub = Stub::start("hearth/stub-model", &[("HF_HOME", &hf_home)]);
    let c = client();
    stub.wait_log("model files not found yet").await;
    assert!(stub.log_has("refs/main does not exist"));
    stub.wait_health(&c, StatusCode::SERVICE_UNAVAILABLE).await;
    let (status, _) = chat(&c, &stub).await;
    assert_eq!(
        status,
        StatusCode::SERVICE_UNAVAILABLE,
        "no model, no tokens"
    );
    // Still waiting a while later: nothing is downloaded by the server itself.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(stub.health(&c).await, Some(StatusCode::SERVICE_UNAVAILABLE));
    assert!(
        !hf_home.join("hub").exists(),
        "the server wrote into the cache"
    );

    let out = Command::new(python3(&tmp.0))
        .args(["-c", &prewarm_program("hearth/stub-model")])
        .env("HF_HOME", &hf_home)
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    stub.wait_health(&c, StatusCode::OK).await;
    stub.wait_log("model loaded").await;
    let loaded = stub
        .0
        .log
        .lock()
        .unwrap()
        .iter()
        .find(|l| l.contains("model loaded"))
        .cloned()
        .unwrap();
    let line: serde_json::Value = serde_json::from_str(&loaded).unwrap();
    let fields = &line["fields"];
    assert_eq!(fields["source"], "huggingface-cache", "{line}");
    assert_eq!(fields["verified_blobs"], 2, "{line}");
    assert_eq!(fields["name_or_path"], "hearth/stub-model", "{line}");
    assert_eq!(
        fields["dir"].as_str().unwrap(),
        String::from_utf8(out.stdout).unwrap().trim_end(),
        "the stub reads the snapshot the prewarm printed"
    );
    let (status, body) = chat(&c, &stub).await;
    assert_eq!(status, StatusCode::OK);
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
}

#[tokio::test]
async fn model_directory_is_checked() {
    let tmp = TempDir::new("dir");
    let dir = tmp.0.join("qwen");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        br#"{"model_type": "stub", "_name_or_path": "dir-model"}"#,
    )
    .unwrap();
    let weights = vllm_stub::model::safetensors_bytes(&[("w", "U8", &[4], &[1, 2, 3, 4])]);
    std::fs::write(dir.join("model.safetensors"), &weights).unwrap();
    let c = client();
    let stub = Stub::start(dir.to_str().unwrap(), &[]);
    stub.wait_health(&c, StatusCode::OK).await;
    stub.wait_log("model loaded").await;
    assert!(stub.log_has("dir-model"));
    let (status, body) = chat(&c, &stub).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    drop(stub);

    // Truncated weights: the process ends with an error, as vLLM on a corrupt checkpoint.
    std::fs::write(dir.join("model.safetensors"), &weights[..weights.len() - 1]).unwrap();
    let mut stub = Stub::start(dir.to_str().unwrap(), &[]);
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = stub.0.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "a corrupt model was served");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(!status.success());
    stub.wait_log("invalid model").await;
}

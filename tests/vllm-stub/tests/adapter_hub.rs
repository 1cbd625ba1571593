//! LoRA adapters from the stub's hub, and `snapshot_download(..., local_dir=...)`: the binary as
//! `python3` running the controller's adapter prewarm programs for both hub libraries, what they
//! leave in `local_dir` (plain files, huggingface_hub's metadata, ModelScope's temporary folder),
//! a second run fetching nothing, repairs and copies from the cache, offline runs, adapters in the
//! Hugging Face cache layout, and the stub's adapter loader and server reading what was fetched
//! (refusing a rank above `--max-lora-rank` with vLLM's message).

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant, SystemTime};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::{Value, json};
use vllm_stub::hub::{self, HubError, ModelScopeDest};
use vllm_stub::{lora, model, sha256};

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>;

use common::{Process, TempDir, python3};

/// The adapter prewarm program for `huggingface_hub` (the controller's, Rust's `{:?}` quoting).
fn hf_program(repo: &str, local_dir: &str) -> String {
    format!(
        "from huggingface_hub import snapshot_download\nprint(snapshot_download(repo_id={repo:?}, local_dir={local_dir:?}))\n"
    )
}

/// The adapter prewarm program for ModelScope.
fn modelscope_program(repo: &str, local_dir: &str) -> String {
    format!(
        "from modelscope import snapshot_download\nprint(snapshot_download({repo:?}, local_dir={local_dir:?}))\n"
    )
}

/// Runs `python3 -c program` with `envs` (and no hub variables of the caller's), in `cwd`.
fn run_python(py: &Path, program: &str, envs: &[(&str, &Path)], cwd: &Path) -> Output {
    let mut cmd = Command::new(py);
    cmd.args(["-c", program])
        .current_dir(cwd)
        .env_remove("HF_HOME")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("MODELSCOPE_CACHE")
        .env("HOME", cwd);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The revision the hub gives `repo`.
fn revision_of(repo: &str) -> String {
    hub::revision(&hub::repo_files(repo))
}

/// Every path under `dir`, relative, sorted (directories too).
fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            out.push(p.strip_prefix(root).unwrap().display().to_string());
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                walk(root, &p, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// Whether `path` is a regular file, not a link.
fn is_plain_file(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_file())
}

/// The three lines of a huggingface_hub download metadata file.
fn metadata(local_dir: &Path, file: &str) -> (String, String, f64) {
    let text = std::fs::read_to_string(
        local_dir
            .join(".cache/huggingface/download")
            .join(format!("{file}.metadata")),
    )
    .unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text:?}");
    (
        lines[0].to_owned(),
        lines[1].to_owned(),
        lines[2].parse().unwrap(),
    )
}

/// Sets the file's modification time `secs` from now.
fn touch(path: &Path, secs: i64) {
    let now = SystemTime::now();
    let t = if secs >= 0 {
        now + Duration::from_secs(secs.unsigned_abs())
    } else {
        now - Duration::from_secs(secs.unsigned_abs())
    };
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(t)
        .unwrap();
}

fn names(files: &[(String, u64)]) -> Vec<&str> {
    files.iter().map(|(n, _)| n.as_str()).collect()
}

#[test]
fn python3_fetches_an_adapter_into_local_dir_with_huggingface_hub() {
    let tmp = TempDir::new("ahub-hf");
    let py = python3(&tmp.0);
    let hf_home = tmp.0.join("models/hf");
    let repo = "acme/sql-lora-r16";
    let local = tmp.0.join("models/adapters/hf/acme/sql-lora-r16");
    let program = hf_program(repo, local.to_str().unwrap());
    let out = run_python(&py, &program, &[("HF_HOME", &hf_home)], &tmp.0);
    assert!(out.status.success(), "{out:?}");
    // It prints local_dir (parents created), as snapshot_download returns it.
    assert_eq!(stdout(&out), format!("{}\n", local.display()));
    let err = stderr(&out);
    let fetched = err.find("fetched adapter_model.safetensors").unwrap();
    let config = err.find("fetched adapter_config.json").unwrap();
    assert!(fetched < config, "the config file last: {err}");

    // Plain files directly in local_dir, huggingface_hub's metadata beside them, nothing else.
    assert_eq!(
        tree(&local),
        [
            ".cache",
            ".cache/huggingface",
            ".cache/huggingface/.gitignore",
            ".cache/huggingface/download",
            ".cache/huggingface/download/adapter_config.json.metadata",
            ".cache/huggingface/download/adapter_model.safetensors.metadata",
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
    );
    for f in hub::repo_files(repo) {
        let path = local.join(&f.name);
        assert!(is_plain_file(&path), "{} is not a plain file", f.name);
        assert_eq!(std::fs::read(&path).unwrap(), f.content, "{}", f.name);
        let (commit, etag, written) = metadata(&local, &f.name);
        assert_eq!(commit, revision_of(repo));
        assert_eq!(etag, sha256::hex(&f.content));
        assert!(written > 1.7e9, "{written}");
    }
    assert_eq!(
        std::fs::read_to_string(local.join(".cache/huggingface/.gitignore")).unwrap(),
        "*"
    );
    // The cache gets the branch's ref only: the files are in local_dir.
    let repo_cache = hf_home.join("hub/models--acme--sql-lora-r16");
    assert_eq!(tree(&repo_cache), ["refs", "refs/main"]);
    assert_eq!(
        std::fs::read_to_string(repo_cache.join("refs/main")).unwrap(),
        revision_of(repo)
    );

    // What the engine then loads from that directory.
    let files = lora::read_adapter("sql", local.to_str().unwrap(), 16).unwrap();
    assert_eq!(files.config.rank(), 16);
    assert_eq!(files.weights, local.join("adapter_model.safetensors"));
    assert!(files.config.resolves_for(hub::ADAPTER_BASE_MODEL));
    let weights = std::fs::read(&files.weights).unwrap();
    assert_eq!(model::safetensors_tensors(&weights).unwrap().len(), 4);

    // A second run over the complete directory downloads nothing and prints the same.
    let before = tree(&local);
    let again = run_python(&py, &program, &[("HF_HOME", &hf_home)], &tmp.0);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(stdout(&again), stdout(&out));
    let err = stderr(&again);
    assert!(err.contains("nothing to fetch"), "{err}");
    assert!(!err.contains("fetched") && !err.contains("copied"), "{err}");
    assert_eq!(tree(&local), before);
}

#[test]
fn python3_fetches_an_adapter_into_local_dir_with_modelscope() {
    let tmp = TempDir::new("ahub-ms");
    let py = python3(&tmp.0);
    let ms_cache = tmp.0.join("models/modelscope");
    let repo = "acme/fin-LoRA";
    // A relative local_dir: the call returns os.path.abspath(local_dir).
    let program = modelscope_program(repo, "models/adapters/modelscope/acme/./fin-LoRA");
    let out = run_python(&py, &program, &[("MODELSCOPE_CACHE", &ms_cache)], &tmp.0);
    assert!(out.status.success(), "{out:?}");
    let local = tmp.0.join("models/adapters/modelscope/acme/fin-LoRA");
    assert_eq!(stdout(&out), format!("{}\n", local.display()));
    // The files directly in local_dir, written through ModelScope's temporary folder (which
    // stays, empty); no ModelScope index; nothing in the cache.
    assert_eq!(
        tree(&local),
        [
            "._____temp",
            "adapter_config.json",
            "adapter_model.safetensors"
        ]
    );
    assert!(!ms_cache.exists());
    let files = lora::read_adapter("fin", local.to_str().unwrap(), 16).unwrap();
    assert_eq!(files.config.rank(), hub::DEFAULT_ADAPTER_RANK);
    let err = stderr(&out);
    assert!(
        err.find("fetched adapter_model.safetensors").unwrap()
            < err.find("fetched adapter_config.json").unwrap(),
        "{err}"
    );

    let again = run_python(&py, &program, &[("MODELSCOPE_CACHE", &ms_cache)], &tmp.0);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(stdout(&again), stdout(&out));
    assert!(stderr(&again).contains("nothing to fetch"), "{again:?}");
    assert!(!stderr(&again).contains("fetched"), "{again:?}");

    // local_dir wins over cache_dir; cache_dir alone is <cache_dir>/org/name.
    let both = format!(
        "from modelscope import snapshot_download\nprint(snapshot_download(model_id={repo:?}, cache_dir={:?}, local_dir={:?}))",
        tmp.0.join("ms-cache-dir").display().to_string(),
        tmp.0.join("both").display().to_string(),
    );
    let out = run_python(&py, &both, &[], &tmp.0);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out), format!("{}\n", tmp.0.join("both").display()));
    assert!(tmp.0.join("both/adapter_config.json").is_file());
    assert!(!tmp.0.join("ms-cache-dir").exists());
    let cache_dir = format!(
        "from modelscope import snapshot_download\nprint(snapshot_download({repo:?}, cache_dir={:?}))",
        tmp.0.join("ms-cache-dir").display().to_string(),
    );
    let out = run_python(&py, &cache_dir, &[], &tmp.0);
    assert!(out.status.success(), "{out:?}");
    let dir = tmp.0.join("ms-cache-dir/acme/fin-LoRA");
    assert_eq!(stdout(&out), format!("{}\n", dir.display()));
    lora::read_adapter("fin", dir.to_str().unwrap(), 16).unwrap();
}

#[test]
fn local_dir_fetches_only_what_is_missing_or_changed() {
    let tmp = TempDir::new("ahub-repair");
    let cache = tmp.0.join("cache");
    let local = tmp.0.join("sql");
    let repo = "acme/sql-lora";
    let fetch = || hub::download_hf_local_dir(&cache, &local, repo, None, false).unwrap();
    let d = fetch();
    assert_eq!(
        names(&d.fetched),
        ["adapter_model.safetensors", "adapter_config.json"]
    );
    assert_eq!(d.revision, revision_of(repo));
    assert!(d.copied.is_empty() && d.warnings.is_empty(), "{d:?}");
    let weights = local.join("adapter_model.safetensors");
    let good = std::fs::read(&weights).unwrap();

    // No metadata at all: the files' SHA-256 match, so nothing is downloaded and the metadata is
    // written again.
    std::fs::remove_dir_all(local.join(".cache")).unwrap();
    let d = fetch();
    assert!(d.fetched.is_empty() && d.copied.is_empty(), "{d:?}");
    assert_eq!(metadata(&local, "adapter_model.safetensors").0, d.revision);
    assert!(local.join(".cache/huggingface/.gitignore").is_file());

    // Metadata of another commit with the same ETag: kept, the metadata brought up to date.
    let meta = local.join(".cache/huggingface/download/adapter_config.json.metadata");
    let (_, etag, ts) = metadata(&local, "adapter_config.json");
    std::fs::write(&meta, format!("{}\n{etag}\n{ts}\n", "0".repeat(40))).unwrap();
    assert!(fetch().fetched.is_empty());
    assert_eq!(metadata(&local, "adapter_config.json").0, revision_of(repo));

    // Malformed metadata is dropped, and the file's hash decides.
    std::fs::write(&meta, "not metadata").unwrap();
    assert!(fetch().fetched.is_empty());
    assert_eq!(metadata(&local, "adapter_config.json").0, revision_of(repo));

    // A file changed after its metadata was written is hashed, and downloaded again.
    std::fs::write(&weights, b"corrupt").unwrap();
    touch(&weights, 10);
    let d = fetch();
    assert_eq!(names(&d.fetched), ["adapter_model.safetensors"]);
    assert_eq!(std::fs::read(&weights).unwrap(), good);

    // As huggingface_hub, metadata naming the commit is trusted while the file is not newer.
    std::fs::write(&weights, b"corrupt").unwrap();
    touch(&weights, -10);
    assert!(fetch().fetched.is_empty());
    assert_eq!(std::fs::read(&weights).unwrap(), b"corrupt");
    std::fs::remove_file(&weights).unwrap();

    // A missing file is downloaded, alone.
    let d = fetch();
    assert_eq!(names(&d.fetched), ["adapter_model.safetensors"]);
    std::fs::remove_file(local.join("adapter_config.json")).unwrap();
    assert_eq!(names(&fetch().fetched), ["adapter_config.json"]);
    lora::read_adapter("sql", local.to_str().unwrap(), 8).unwrap();
    // Nothing half-written is left behind.
    assert!(
        tree(&local).iter().all(|p| !p.ends_with(".incomplete")),
        "{:?}",
        tree(&local)
    );
}

#[test]
fn local_dir_copies_from_the_cache_and_writes_the_ref_there() {
    let tmp = TempDir::new("ahub-cache");
    let cache = tmp.0.join("hub");
    let repo = "acme/sql-lora-r32";
    let rev = revision_of(repo);
    // In the cache already: copied from there into local_dir, as plain files.
    hub::download_hf(&cache, repo, None, false).unwrap();
    let local = tmp.0.join("copy");
    let d = hub::download_hf_local_dir(&cache, &local, repo, None, false).unwrap();
    assert!(d.fetched.is_empty(), "{d:?}");
    assert_eq!(
        names(&d.copied),
        ["adapter_model.safetensors", "adapter_config.json"]
    );
    assert!(is_plain_file(&local.join("adapter_model.safetensors")));
    assert_eq!(metadata(&local, "adapter_config.json").0, rev);
    assert_eq!(
        lora::read_adapter("big", local.to_str().unwrap(), 32)
            .unwrap()
            .config
            .rank(),
        32
    );

    // An empty cache gets refs/main only; asked by commit hash, not even that.
    let other = tmp.0.join("other-hub");
    hub::download_hf_local_dir(&other, &tmp.0.join("a"), repo, Some("main"), false).unwrap();
    assert_eq!(
        std::fs::read_to_string(other.join("models--acme--sql-lora-r32/refs/main")).unwrap(),
        rev
    );
    let third = tmp.0.join("third-hub");
    hub::download_hf_local_dir(&third, &tmp.0.join("b"), repo, Some(&rev), false).unwrap();
    assert!(!third.exists());
    // A cache that cannot be written is a warning, not a failure.
    let not_a_dir = tmp.0.join("file");
    std::fs::write(&not_a_dir, b"").unwrap();
    let d = hub::download_hf_local_dir(&not_a_dir, &tmp.0.join("c"), repo, None, false).unwrap();
    assert_eq!(d.fetched.len(), 2);
    assert!(
        d.warnings[0].starts_with("Ignored error while writing commit hash to "),
        "{:?}",
        d.warnings
    );
    // A revision the hub does not have, and a bad id.
    assert!(matches!(
        hub::download_hf_local_dir(&cache, &tmp.0.join("d"), repo, Some("v2"), false),
        Err(HubError::Revision { .. })
    ));
    assert!(matches!(
        hub::download_hf_local_dir(&cache, &tmp.0.join("d"), "a/b/c", None, false),
        Err(HubError::RepoId(_))
    ));
    assert!(!tmp.0.join("d").exists());
}

#[test]
fn offline_local_dir_is_returned_only_when_not_empty() {
    let tmp = TempDir::new("ahub-offline");
    let cache = tmp.0.join("hub");
    let local = tmp.0.join("sql");
    let repo = "acme/sql-lora";
    assert!(matches!(
        hub::download_hf_local_dir(&cache, &local, repo, None, true),
        Err(HubError::OfflineLocalDir { .. })
    ));
    std::fs::create_dir_all(&local).unwrap();
    assert!(matches!(
        hub::download_hf_local_dir(&cache, &local, repo, None, true),
        Err(HubError::OfflineLocalDir { .. })
    ));
    hub::download_hf_local_dir(&cache, &local, repo, None, false).unwrap();
    let d = hub::download_hf_local_dir(&cache, &local, repo, None, true).unwrap();
    assert_eq!(d.path, local);
    assert!(d.fetched.is_empty());
    assert!(
        d.warnings[0].starts_with("Returning existing local_dir"),
        "{:?}",
        d.warnings
    );
    // Through python3, HF_HUB_OFFLINE=1.
    let py = python3(&tmp.0);
    let program = hf_program(repo, tmp.0.join("absent").to_str().unwrap());
    let out = run_python(&py, &program, &[("HF_HUB_OFFLINE", Path::new("1"))], &tmp.0);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(stderr(&out).contains("LocalEntryNotFoundError"), "{out:?}");
}

#[test]
fn adapters_in_the_cache_layouts() {
    let tmp = TempDir::new("ahub-layouts");
    let cache = tmp.0.join("hub");
    let repo = "acme/sql-lora-r16";
    let d = hub::download_hf(&cache, repo, None, false).unwrap();
    assert_eq!(
        d.path,
        cache
            .join("models--acme--sql-lora-r16/snapshots")
            .join(&d.revision)
    );
    assert_eq!(
        names(&d.fetched),
        ["adapter_model.safetensors", "adapter_config.json"]
    );
    for f in ["adapter_config.json", "adapter_model.safetensors"] {
        let target = std::fs::read_link(d.path.join(f)).unwrap();
        assert!(target.starts_with("../../blobs"), "{f} -> {target:?}");
    }
    let files = lora::read_adapter("sql", d.path.to_str().unwrap(), 16).unwrap();
    assert_eq!(files.config.rank(), 16);
    assert!(
        hub::download_hf(&cache, repo, None, true)
            .unwrap()
            .fetched
            .is_empty(),
        "cached: nothing fetched, offline too"
    );
    // A corrupt blob is fetched again.
    let blob = d
        .path
        .join(std::fs::read_link(d.path.join("adapter_config.json")).unwrap());
    std::fs::write(&blob, b"{}").unwrap();
    assert_eq!(
        hub::download_hf(&cache, repo, None, false)
            .unwrap()
            .fetched
            .len(),
        2
    );
    lora::read_adapter("sql", d.path.to_str().unwrap(), 16).unwrap();

    let ms = tmp.0.join("modelscope");
    let d = hub::download_modelscope(&ModelScopeDest::Cache(ms.clone()), repo).unwrap();
    assert_eq!(d.path, ms.join("models/acme/sql-lora-r16"));
    lora::read_adapter("sql", d.path.to_str().unwrap(), 16).unwrap();
}

/// A stub process whose log lines are collected; killed when dropped.
struct Stub(Process);

impl Stub {
    fn start(args: &[&str], envs: &[(&str, &str)]) -> Self {
        Self(Process::start("hearth/stub-model", args, envs))
    }

    async fn wait_healthy(&self, c: &HttpClient) {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let req = Request::get(self.0.url("/health"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            if let Ok(r) = c.request(req).await
                && r.status() == StatusCode::OK
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "never healthy: {:#?}",
                self.0.log.lock().unwrap()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn post(&self, c: &HttpClient, path: &str, body: Value) -> (StatusCode, String) {
        let req = Request::post(self.0.url(path))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap();
        let resp = c.request(req).await.unwrap();
        let status = resp.status();
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8_lossy(&body).into_owned())
    }
}

#[tokio::test]
async fn the_stub_loads_fetched_adapters_and_refuses_a_rank_above_its_max() {
    let tmp = TempDir::new("ahub-serve");
    let py = python3(&tmp.0);
    let hf_home = tmp.0.join("models/hf");
    let adapters = tmp.0.join("models/adapters/hf/acme");
    // The prewarm Jobs: each prints the directory the engine is then given as lora_path.
    let mut paths = Vec::new();
    for repo in ["acme/sql-lora-r16", "acme/big-lora-r64", "acme/fin-lora"] {
        let local = adapters.join(hub::repo_name(repo));
        let out = run_python(
            &py,
            &hf_program(repo, local.to_str().unwrap()),
            &[("HF_HOME", &hf_home)],
            &tmp.0,
        );
        assert!(out.status.success(), "{out:?}");
        paths.push(stdout(&out).trim_end().to_owned());
    }
    let stub = Stub::start(
        &[
            "--enable-lora",
            "--max-lora-rank",
            "16",
            "--max-cpu-loras=4",
        ],
        &[
            ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),
            ("VLLM_PLUGINS", "lora_filesystem_resolver"),
            ("VLLM_LORA_RESOLVER_CACHE_DIR", adapters.to_str().unwrap()),
        ],
    );
    let c = Client::builder(TokioExecutor::new()).build_http();
    stub.wait_healthy(&c).await;

    let (status, body) = stub
        .post(
            &c,
            "/v1/load_lora_adapter",
            json!({"lora_name": "sql", "lora_path": paths[0]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body, "Success: LoRA adapter 'sql' added successfully.");
    let (status, body) = stub
        .post(
            &c,
            "/v1/load_lora_adapter",
            json!({"lora_name": "big", "lora_path": paths[1]}),
        )
        .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let err: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(err["error"]["type"], "BadRequestError", "{body}");
    assert_eq!(
        err["error"]["message"],
        "Call to add_lora method failed: LoRA rank 64 is greater than max_lora_rank 16."
    );
    // The hub's adapters name the stub's model as their base, so the filesystem resolver takes
    // them for `--model=hearth/stub-model`.
    let (status, body) = stub
        .post(
            &c,
            "/v1/chat/completions",
            json!({"model": "fin-lora", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["model"], "fin-lora");
    let (status, body) = stub
        .post(
            &c,
            "/v1/chat/completions",
            json!({"model": "sql", "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let log = stub.0.log.lock().unwrap().join("\n");
    assert!(log.contains("LoRA adapter loaded into the engine"), "{log}");
}

//! The stub's hub: what a download fetches, and the layouts it writes.
//!
//! The test cluster reaches no hub, so the stub carries one. Every valid repository id names a
//! small repository made from the id itself (deterministic, so every node and every run fetches
//! the same bytes), of one of two kinds ([`repo_files`]):
//!
//! - **A model**: `config.json` (`model_type: "stub"`, `_name_or_path: <repo>`) and
//!   `model.safetensors` (two F16 tensors), which the stub serves ([`crate::model`]).
//! - **A LoRA adapter**, when the repository's name (the part after `org/`) contains `lora` in
//!   any case ([`is_adapter_repo`]): `adapter_config.json` as PEFT writes it (`peft_type: "LORA"`,
//!   `r` = N when the name ends in `-r<N>` with 1 ≤ N ≤ [`MAX_NAMED_RANK`], else
//!   [`DEFAULT_ADAPTER_RANK`] (`acme/sql-lora-r16` → 16, see [`adapter_rank`]); `lora_alpha` =
//!   2r, `target_modules: ["q_proj", "v_proj"]`, `base_model_name_or_path` [`ADAPTER_BASE_MODEL`],
//!   `bias: "none"`, `task_type: "CAUSAL_LM"`) and `adapter_model.safetensors` (`lora_A` [r, 4] and
//!   `lora_B` [4, r] of both modules of layer 0, F16), a directory the stub's adapter loader
//!   ([`crate::lora::read_adapter`]) reads.
//!
//! Its revision is derived from the files, as a commit hash is ([`revision`]).
//!
//! The stub writes each file to a temporary name and renames it into place, and writes the
//! repository's config file (`config.json`, `adapter_config.json`) last, in every layout, so a
//! reader that looks for the config file sees no repository or a whole one. (The real libraries
//! write each file through a temporary name too, but fetch the files in parallel, in no set
//! order: against them, wait for the download to end.) A repository already complete where it is
//! written is left as it is: a second download fetches nothing.
//!
//! # `huggingface_hub.snapshot_download`
//!
//! [`download_hf`], `snapshot_download(repo_id=...)`, writes the Hugging Face cache `cache`
//! (`cache_dir`, else `HF_HUB_CACHE`, else `$HF_HOME/hub`): `models--org--name/blobs/<sha256>`
//! (content-addressed, written to `*.incomplete` and renamed), `snapshots/<revision>/<file>` as
//! relative links to the blobs, and `refs/main` holding the revision, written last (the library
//! writes it before the files; the stub after them, so that a reader of `refs/main` finds a whole
//! snapshot). It returns the snapshot directory. A cached, intact repository is left as it is; a corrupt blob is
//! fetched again. Offline (`HF_HUB_OFFLINE`), only a cached repository is returned.
//!
//! [`download_hf_local_dir`], `snapshot_download(repo_id=..., local_dir=...)`, follows
//! huggingface_hub 0.23 and later (`_hf_hub_download_to_local_dir`, `_local_folder.py`):
//!
//! - The files are plain files directly in `local_dir` (no links, no blobs), the directory and
//!   its parents created. Each file is downloaded to
//!   `<local_dir>/.cache/huggingface/download/<file>.<etag>.incomplete` and renamed into place
//!   (the name huggingface_hub 0.23 to 0.29 uses; later versions name it by a hash of the file's
//!   name), an outdated file removed first.
//! - After each file, `<local_dir>/.cache/huggingface/download/<file>.metadata` holds three
//!   lines: the commit hash, the file's ETag, and the Unix time it was written (Python's
//!   `time.time()`); `<local_dir>/.cache/huggingface/.gitignore` is `*`. The stub's ETag is the
//!   file's SHA-256 for every file (the hub's is the SHA-256 for LFS files, the git blob id for
//!   the others). No lock files are written.
//! - A file is kept, nothing downloaded, when its metadata names the commit and the file was not
//!   modified after the metadata was written (its mtime at most 1 s later, the library's
//!   check); else when its metadata's ETag is the hub's, or, without valid metadata, when the
//!   file's SHA-256 is the hub's ETag (the metadata is then written again). Otherwise, when the cache
//!   `cache` holds the file at that commit it is copied from there (the library's
//!   `try_to_load_from_cache`), else it is downloaded. A second run over a complete directory
//!   downloads nothing.
//! - `cache_dir` (else `HF_HUB_CACHE` / `$HF_HOME/hub`) still gets `models--org--name/refs/main`,
//!   as `snapshot_download` writes the ref of a branch with or without `local_dir` (an error
//!   writing it is only a warning, as from huggingface_hub 0.27; earlier versions fail), and is
//!   where files already cached are copied from; the files themselves go to `local_dir` only.
//! - Offline, a `local_dir` that is a non-empty directory is returned as it is, unchecked, with
//!   the library's warning (huggingface_hub 0.26 and later); anything else is
//!   `LocalEntryNotFoundError`.
//! - It returns `os.path.realpath(local_dir)`.
//!
//! # `modelscope.snapshot_download`
//!
//! [`download_modelscope`] writes where [`ModelScopeDest`] says, as ModelScope's
//! `_snapshot_download` does:
//!
//! | arguments | the files go to | temporary folder |
//! |---|---|---|
//! | neither `cache_dir` nor `local_dir` | `$MODELSCOPE_CACHE/models/org/name` (`MODELSCOPE_CACHE` defaults to `~/.cache/modelscope/hub`) | `$MODELSCOPE_CACHE/models/._____temp/org/name/` |
//! | `cache_dir` | `<cache_dir>/org/name` | `<cache_dir>/._____temp/org/name/` |
//! | `local_dir` (`cache_dir` is then ignored) | `<local_dir>/<file>`, the directory and its parents created | `<local_dir>/._____temp/` |
//!
//! Each file is written into the temporary folder and renamed into place; the folder stays, as
//! ModelScope leaves it. A file whose SHA-256 is the hub's is kept, so a second run downloads
//! nothing. ModelScope itself decides that from its pickled indexes (`.msc`, `.mdl`, `.mv` in the
//! repository's directory); the stub writes none of them and compares the files instead, so a
//! real ModelScope would download again into a directory the stub filled. It returns the
//! repository's directory: `os.path.abspath(local_dir)` with `local_dir`.

use std::io::Write;
use std::path::{Component, Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::json;

use crate::lora;
use crate::model;
use crate::sha256;

/// The rank of an adapter whose name gives none.
pub const DEFAULT_ADAPTER_RANK: u32 = 8;
/// The highest rank a name's `-r<N>` gives (larger numbers are not read as a rank).
pub const MAX_NAMED_RANK: u32 = 4096;
/// The base model the hub's adapters name (`base_model_name_or_path`).
pub const ADAPTER_BASE_MODEL: &str = "hearth/stub-model";
/// The hidden size of the hub's models, which its adapters' tensors match.
const HIDDEN_SIZE: u64 = 4;
/// ModelScope's temporary folder (`TEMPORARY_FOLDER_NAME`).
pub const MODELSCOPE_TEMP: &str = "._____temp";
/// The config file of a model.
const MODEL_CONFIG: &str = "config.json";

/// Why a download failed; messages name the hub library's error they stand for.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    /// Not a repository id.
    #[error("HFValidationError: Repo id must be 'name' or 'namespace/name': {0:?}")]
    RepoId(String),
    /// A revision the hub does not have.
    #[error("RevisionNotFoundError: {repo} has no revision {revision:?} (it has main = {main})")]
    Revision {
        repo: String,
        revision: String,
        main: String,
    },
    /// Offline (`HF_HUB_OFFLINE`) and not cached.
    #[error(
        "LocalEntryNotFoundError: {repo} is not in the cache {cache} and HF_HUB_OFFLINE is set, so it cannot be downloaded"
    )]
    Offline { repo: String, cache: PathBuf },
    /// Offline (`HF_HUB_OFFLINE`) with a `local_dir` that is not a non-empty directory.
    #[error(
        "LocalEntryNotFoundError: Cannot find an appropriate cached snapshot folder for the specified revision on the local disk and outgoing traffic has been disabled. To enable repo look-ups and downloads online, set 'HF_HUB_OFFLINE=0' as environment variable. ({repo}: local_dir {local_dir} is empty or absent)"
    )]
    OfflineLocalDir { repo: String, local_dir: PathBuf },
    /// The hub at `HF_ENDPOINT` could not be read ([`crate::mirror::fetch`]).
    #[error("{message} ({url})")]
    Http { url: String, message: String },
    /// Writing the files failed.
    #[error("OSError: {what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
}

fn io(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> HubError {
    let path = path.to_path_buf();
    move |source| HubError::Io { what, path, source }
}

/// One file of a repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoFile {
    pub name: String,
    pub content: Vec<u8>,
}

/// The name of a repository: what follows `org/` (the whole id when it has no `org/`).
pub fn repo_name(repo: &str) -> &str {
    repo.rsplit_once('/').map_or(repo, |(_, name)| name)
}

/// Whether the hub serves `repo` as a LoRA adapter: its name contains `lora`, in any case.
pub fn is_adapter_repo(repo: &str) -> bool {
    repo_name(repo).to_ascii_lowercase().contains("lora")
}

/// The rank of the adapter `repo`: N when its name ends in `-r<N>` (any case, N decimal digits,
/// 1 ≤ N ≤ [`MAX_NAMED_RANK`]), else [`DEFAULT_ADAPTER_RANK`].
pub fn adapter_rank(repo: &str) -> u32 {
    repo_name(repo)
        .to_ascii_lowercase()
        .rsplit_once("-r")
        .map(|(_, n)| n.to_owned())
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|n| n.parse::<u32>().ok())
        .filter(|r| (1..=MAX_NAMED_RANK).contains(r))
        .unwrap_or(DEFAULT_ADAPTER_RANK)
}

/// `len` bytes from a SHA-256 hash chain seeded with the repository id.
fn seeded_bytes(repo: &str, len: usize) -> Vec<u8> {
    let mut seed = sha256::digest(repo.as_bytes());
    let mut data = Vec::with_capacity(len + seed.len());
    while data.len() < len {
        data.extend_from_slice(&seed);
        seed = sha256::digest(&seed);
    }
    data.truncate(len);
    data
}

/// The files the stub's hub serves for `repo`: [`adapter_files`] for an adapter
/// ([`is_adapter_repo`]), else [`model_files`].
pub fn repo_files(repo: &str) -> Vec<RepoFile> {
    if is_adapter_repo(repo) {
        adapter_files(repo)
    } else {
        model_files(repo)
    }
}

/// The files of the model `repo`: `config.json` and `model.safetensors`.
pub fn model_files(repo: &str) -> Vec<RepoFile> {
    let config = json!({
        "_name_or_path": repo,
        "architectures": ["StubForCausalLM"],
        "model_type": "stub",
        "hidden_size": HIDDEN_SIZE,
        "vocab_size": 8,
        "torch_dtype": "float16",
    });
    // 64 bytes per tensor, a hash chain seeded with the repository id.
    let data = seeded_bytes(repo, 128);
    let weights = model::safetensors_bytes(&[
        (
            "model.embed_tokens.weight",
            "F16",
            &[8, HIDDEN_SIZE],
            &data[..64],
        ),
        ("lm_head.weight", "F16", &[8, HIDDEN_SIZE], &data[64..128]),
    ]);
    vec![
        RepoFile {
            name: MODEL_CONFIG.into(),
            content: serde_json::to_vec_pretty(&config).expect("JSON"),
        },
        RepoFile {
            name: "model.safetensors".into(),
            content: weights,
        },
    ]
}

/// The files of the LoRA adapter `repo` (see the module docs): `adapter_config.json` and
/// `adapter_model.safetensors`, of rank [`adapter_rank`].
pub fn adapter_files(repo: &str) -> Vec<RepoFile> {
    let r = adapter_rank(repo);
    let config = json!({
        "alpha_pattern": {},
        "base_model_name_or_path": ADAPTER_BASE_MODEL,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "lora_alpha": 2 * r,
        "lora_dropout": 0.0,
        "modules_to_save": null,
        "peft_type": "LORA",
        "r": r,
        "rank_pattern": {},
        "revision": null,
        "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM",
        "use_dora": false,
        "use_rslora": false,
    });
    // F16: 2 bytes per element, r × 4 elements per tensor, four tensors (r ≤ MAX_NAMED_RANK, so
    // at most 32 KiB each).
    let r = u64::from(r);
    let size = (2 * r * HIDDEN_SIZE) as usize;
    let data = seeded_bytes(repo, 4 * size);
    let names: Vec<(String, [u64; 2])> = ["q_proj", "v_proj"]
        .iter()
        .flat_map(|m| {
            let prefix = format!("base_model.model.model.layers.0.self_attn.{m}");
            [
                (format!("{prefix}.lora_A.weight"), [r, HIDDEN_SIZE]),
                (format!("{prefix}.lora_B.weight"), [HIDDEN_SIZE, r]),
            ]
        })
        .collect();
    let tensors: Vec<(&str, &str, &[u64], &[u8])> = names
        .iter()
        .zip(data.chunks(size))
        .map(|((name, shape), bytes)| (name.as_str(), "F16", &shape[..], bytes))
        .collect();
    vec![
        RepoFile {
            name: lora::ADAPTER_CONFIG.into(),
            content: serde_json::to_vec_pretty(&config).expect("JSON"),
        },
        RepoFile {
            name: lora::ADAPTER_WEIGHTS[0].into(),
            content: model::safetensors_bytes(&tensors),
        },
    ]
}

/// Whether `name` is a repository's config file, the file written last.
pub fn is_config_file(name: &str) -> bool {
    name == MODEL_CONFIG || name == lora::ADAPTER_CONFIG
}

/// `files` in the order the stub writes them: the config file last.
fn write_order(files: &[RepoFile]) -> impl Iterator<Item = &RepoFile> {
    let (config, data): (Vec<&RepoFile>, Vec<&RepoFile>) =
        files.iter().partition(|f| is_config_file(&f.name));
    data.into_iter().chain(config)
}

/// The revision (a 40-hex commit id) of a repository's files.
pub fn revision(files: &[RepoFile]) -> String {
    let mut all = Vec::new();
    for f in files {
        all.extend_from_slice(f.name.as_bytes());
        all.push(0);
        all.extend_from_slice(sha256::hex(&f.content).as_bytes());
        all.push(b'\n');
    }
    sha256::hex(&all)[..40].to_owned()
}

/// What a download did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Download {
    /// What `snapshot_download` returns: the directory holding the repository's files (the
    /// snapshot in a Hugging Face cache, `local_dir` resolved).
    pub path: PathBuf,
    /// The revision.
    pub revision: String,
    /// Files downloaded from the hub, with their sizes, in the order written; empty when
    /// everything was there already.
    pub fetched: Vec<(String, u64)>,
    /// Files copied into `local_dir` from the Hugging Face cache instead of downloaded.
    pub copied: Vec<(String, u64)>,
    /// What the library logs as warnings.
    pub warnings: Vec<String>,
}

impl Download {
    fn new(path: PathBuf, revision: String) -> Self {
        Self {
            path,
            revision,
            fetched: Vec::new(),
            copied: Vec::new(),
            warnings: Vec::new(),
        }
    }
}

fn check_repo(repo: &str) -> Result<(), HubError> {
    if model::is_repo_id(repo) {
        Ok(())
    } else {
        Err(HubError::RepoId(repo.to_owned()))
    }
}

/// Where a download reads the repository from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hub {
    /// The stub's own hub, in the process (the test cluster reaches no hub).
    BuiltIn,
    /// The hub at this endpoint (`HF_ENDPOINT`), over HTTP ([`crate::mirror::fetch`]); an
    /// endpoint that cannot be read fails the download.
    Endpoint(String),
}

/// The files and revision of `repo` on `hub`, checking the revision asked for (`None`, `main`
/// or the commit hash itself). `offline` (`HF_HUB_OFFLINE`): no endpoint is contacted.
fn resolve_on(
    hub: &Hub,
    offline: bool,
    repo: &str,
    revision_wanted: Option<&str>,
) -> Result<(Vec<RepoFile>, String), HubError> {
    match hub {
        Hub::Endpoint(endpoint) if !offline => {
            check_repo(repo)?;
            crate::mirror::fetch(endpoint, repo, revision_wanted)
        }
        _ => resolve(repo, revision_wanted),
    }
}

/// The files and revision of `repo`, checking the revision asked for (`None`, `main` or the
/// commit hash itself).
fn resolve(repo: &str, revision_wanted: Option<&str>) -> Result<(Vec<RepoFile>, String), HubError> {
    check_repo(repo)?;
    let files = repo_files(repo);
    let rev = revision(&files);
    if let Some(r) = revision_wanted.filter(|r| *r != "main" && *r != rev) {
        return Err(HubError::Revision {
            repo: repo.to_owned(),
            revision: r.to_owned(),
            main: rev,
        });
    }
    Ok((files, rev))
}

/// Writes `content` to `tmp` (its directory created), then renames it to `path`.
fn write_via(tmp: &Path, path: &Path, content: &[u8]) -> Result<(), HubError> {
    if let Some(dir) = tmp.parent() {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    }
    let mut f = std::fs::File::create(tmp).map_err(io("creating", tmp))?;
    f.write_all(content).map_err(io("writing", tmp))?;
    f.sync_all().map_err(io("syncing", tmp))?;
    std::fs::rename(tmp, path).map_err(io("renaming into place", path))
}

/// Writes `content` to `path` through `<path>.incomplete` and a rename.
fn write_atomic(path: &Path, content: &[u8]) -> Result<(), HubError> {
    write_via(
        &PathBuf::from(format!("{}.incomplete", path.display())),
        path,
        content,
    )
}

/// Whether `path` holds exactly `content`.
fn holds(path: &Path, content: &[u8]) -> bool {
    std::fs::read(path).is_ok_and(|c| c == content)
}

/// Whether the Hugging Face cache directory `repo_dir` holds `files` at `rev`, intact, with
/// `refs/main` naming it.
fn hf_cached(repo_dir: &Path, rev: &str, files: &[RepoFile]) -> bool {
    let snapshot = repo_dir.join("snapshots").join(rev);
    std::fs::read_to_string(repo_dir.join("refs/main")).is_ok_and(|r| r.trim() == rev)
        && files
            .iter()
            .all(|f| holds(&snapshot.join(&f.name), &f.content))
}

/// `snapshot_download(repo_id=repo, revision=revision)` into the Hugging Face cache `cache`
/// (the directory holding `models--*`). `offline` is `HF_HUB_OFFLINE`: only a cached repository.
///
/// # Errors
/// [`HubError::RepoId`], [`HubError::Revision`], [`HubError::Offline`], [`HubError::Io`].
pub fn download_hf(
    cache: &Path,
    repo: &str,
    revision_wanted: Option<&str>,
    offline: bool,
) -> Result<Download, HubError> {
    download_hf_via(&Hub::BuiltIn, cache, repo, revision_wanted, offline)
}

/// [`download_hf`] from `hub`. Offline, the hub is not contacted.
///
/// # Errors
/// As [`download_hf`], and [`HubError::Http`] from an endpoint.
pub fn download_hf_via(
    hub: &Hub,
    cache: &Path,
    repo: &str,
    revision_wanted: Option<&str>,
    offline: bool,
) -> Result<Download, HubError> {
    let (files, rev) = resolve_on(hub, offline, repo, revision_wanted)?;
    let repo_dir = model::hf_repo_dir(cache, repo);
    let snapshot = repo_dir.join("snapshots").join(&rev);
    let mut d = Download::new(snapshot.clone(), rev.clone());
    if hf_cached(&repo_dir, &rev, &files) {
        return Ok(d);
    }
    if offline {
        return Err(HubError::Offline {
            repo: repo.to_owned(),
            cache: cache.to_path_buf(),
        });
    }
    let blobs = repo_dir.join("blobs");
    let refs = repo_dir.join("refs");
    for dir in [&blobs, &snapshot, &refs] {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    }
    for f in write_order(&files) {
        let sha = sha256::hex(&f.content);
        let blob = blobs.join(&sha);
        if !holds(&blob, &f.content) {
            write_atomic(&blob, &f.content)?;
        }
        let link = snapshot.join(&f.name);
        let tmp = snapshot.join(format!(".{}.link", f.name));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&sha), &tmp)
            .map_err(io("linking", &tmp))?;
        std::fs::rename(&tmp, &link).map_err(io("renaming into place", &link))?;
        d.fetched.push((f.name.clone(), f.content.len() as u64));
    }
    write_atomic(&refs.join("main"), rev.as_bytes())?;
    Ok(d)
}

/// A `local_dir` file's download metadata (`<file>.metadata`).
struct LocalMetadata {
    commit_hash: String,
    etag: String,
}

/// `<local_dir>/.cache/huggingface`.
fn hf_local_meta_dir(local_dir: &Path) -> PathBuf {
    local_dir.join(".cache").join("huggingface")
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Reads the metadata `meta` of `file` as `read_download_metadata` does: `None` when absent,
/// malformed (then removed) or older than the file (the file's mtime more than 1 s after it).
fn read_local_metadata(meta: &Path, file: &Path) -> Option<LocalMetadata> {
    let text = std::fs::read_to_string(meta).ok()?;
    let mut lines = text.lines().map(str::trim);
    let parsed = match (lines.next(), lines.next(), lines.next()) {
        (Some(c), Some(e), Some(t)) if !c.is_empty() && !e.is_empty() => t
            .parse::<f64>()
            .ok()
            .map(|ts| (c.to_owned(), e.to_owned(), ts)),
        _ => None,
    };
    let Some((commit_hash, etag, timestamp)) = parsed else {
        let _ = std::fs::remove_file(meta);
        return None;
    };
    let mtime = std::fs::metadata(file).ok()?.modified().ok()?;
    (unix_seconds(mtime) - 1.0 <= timestamp).then_some(LocalMetadata { commit_hash, etag })
}

fn write_local_metadata(meta: &Path, commit_hash: &str, etag: &str) -> Result<(), HubError> {
    if let Some(dir) = meta.parent() {
        std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    }
    let now = unix_seconds(SystemTime::now());
    std::fs::write(meta, format!("{commit_hash}\n{etag}\n{now}\n")).map_err(io("writing", meta))
}

/// `snapshot_download(repo_id=repo, revision=revision, local_dir=local_dir)`: the files as plain
/// files in `local_dir`, with huggingface_hub's metadata, as the module docs describe. `cache` is
/// the Hugging Face cache (`cache_dir`, else the environment's): it gets the ref, and files it
/// holds are copied from it. `offline` is `HF_HUB_OFFLINE`.
///
/// # Errors
/// [`HubError::RepoId`], [`HubError::Revision`], [`HubError::OfflineLocalDir`],
/// [`HubError::Io`].
pub fn download_hf_local_dir(
    cache: &Path,
    local_dir: &Path,
    repo: &str,
    revision_wanted: Option<&str>,
    offline: bool,
) -> Result<Download, HubError> {
    download_hf_local_dir_via(
        &Hub::BuiltIn,
        cache,
        local_dir,
        repo,
        revision_wanted,
        offline,
    )
}

/// [`download_hf_local_dir`] from `hub`. Offline, the hub is not contacted.
///
/// # Errors
/// As [`download_hf_local_dir`], and [`HubError::Http`] from an endpoint.
pub fn download_hf_local_dir_via(
    hub: &Hub,
    cache: &Path,
    local_dir: &Path,
    repo: &str,
    revision_wanted: Option<&str>,
    offline: bool,
) -> Result<Download, HubError> {
    let (files, rev) = resolve_on(hub, offline, repo, revision_wanted)?;
    if offline {
        let non_empty = std::fs::read_dir(local_dir).is_ok_and(|mut d| d.next().is_some());
        if !non_empty {
            return Err(HubError::OfflineLocalDir {
                repo: repo.to_owned(),
                local_dir: local_dir.to_path_buf(),
            });
        }
        let path = std::fs::canonicalize(local_dir).map_err(io("resolving", local_dir))?;
        let mut d = Download::new(path, rev);
        d.warnings.push(format!(
            "Returning existing local_dir `{}` as remote repo cannot be accessed in `snapshot_download` (OfflineModeIsEnabled: HF_HUB_OFFLINE is set).",
            d.path.display()
        ));
        return Ok(d);
    }
    std::fs::create_dir_all(local_dir).map_err(io("creating", local_dir))?;
    let path = std::fs::canonicalize(local_dir).map_err(io("resolving", local_dir))?;
    let mut d = Download::new(path, rev.clone());
    // The ref of the branch, in the cache, as snapshot_download writes it before the files.
    let repo_cache = model::hf_repo_dir(cache, repo);
    if revision_wanted != Some(rev.as_str()) {
        let refs = repo_cache.join("refs");
        let ref_path = refs.join("main");
        if let Err(e) =
            std::fs::create_dir_all(&refs).and_then(|()| std::fs::write(&ref_path, &rev))
        {
            d.warnings.push(format!(
                "Ignored error while writing commit hash to {}: {e}.",
                ref_path.display()
            ));
        }
    }
    let hf_dir = hf_local_meta_dir(local_dir);
    std::fs::create_dir_all(&hf_dir).map_err(io("creating", &hf_dir))?;
    let gitignore = hf_dir.join(".gitignore");
    if !gitignore.exists() {
        std::fs::write(&gitignore, "*").map_err(io("writing", &gitignore))?;
    }
    let cached_snapshot = repo_cache.join("snapshots").join(&rev);
    for f in write_order(&files) {
        let file = local_dir.join(&f.name);
        let meta = hf_dir.join("download").join(format!("{}.metadata", f.name));
        let etag = sha256::hex(&f.content);
        let metadata = read_local_metadata(&meta, &file);
        let is_file = std::fs::metadata(&file).is_ok_and(|m| m.is_file());
        if is_file && metadata.as_ref().is_some_and(|m| m.commit_hash == rev) {
            continue;
        }
        if is_file {
            let etag_matches = match &metadata {
                Some(m) => m.etag == etag,
                None => std::fs::read(&file).is_ok_and(|c| sha256::hex(&c) == etag),
            };
            if etag_matches {
                write_local_metadata(&meta, &rev, &etag)?;
                continue;
            }
        }
        let incomplete = hf_dir
            .join("download")
            .join(format!("{}.{etag}.incomplete", f.name));
        if holds(&cached_snapshot.join(&f.name), &f.content) {
            write_via(&incomplete, &file, &f.content)?;
            d.copied.push((f.name.clone(), f.content.len() as u64));
        } else {
            match std::fs::remove_file(&file) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("removing the outdated", &file)(e)),
            }
            write_via(&incomplete, &file, &f.content)?;
            d.fetched.push((f.name.clone(), f.content.len() as u64));
        }
        write_local_metadata(&meta, &rev, &etag)?;
    }
    Ok(d)
}

/// Where `modelscope.snapshot_download` writes a repository (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelScopeDest {
    /// Neither `cache_dir` nor `local_dir`: the cache `MODELSCOPE_CACHE`, as vLLM reads it
    /// (`<cache>/models/org/name`).
    Cache(PathBuf),
    /// `cache_dir=`: `<cache_dir>/org/name`.
    CacheDir(PathBuf),
    /// `local_dir=`: the files directly in it.
    LocalDir(PathBuf),
}

impl ModelScopeDest {
    /// The directory the files of `repo` go to, and the temporary folder they are written in.
    pub fn dirs(&self, repo: &str) -> (PathBuf, PathBuf) {
        match self {
            ModelScopeDest::Cache(cache) => (
                model::modelscope_repo_dir(cache, repo),
                cache.join("models").join(MODELSCOPE_TEMP).join(repo),
            ),
            ModelScopeDest::CacheDir(dir) => (dir.join(repo), dir.join(MODELSCOPE_TEMP).join(repo)),
            ModelScopeDest::LocalDir(dir) => (dir.clone(), dir.join(MODELSCOPE_TEMP)),
        }
    }
}

/// Python's `os.path.abspath`: `path` joined to the working directory, `.` and `..` resolved
/// lexically (symbolic links are not).
fn abspath(path: &Path) -> Result<PathBuf, HubError> {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(io("reading the working directory for", path))?
            .join(path)
    };
    let mut out = PathBuf::new();
    for c in joined.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir => {
                out.pop();
            }
            other => out.push(other.as_os_str()),
        }
    }
    Ok(out)
}

/// `modelscope.snapshot_download(repo, ...)` into `dest`.
///
/// # Errors
/// [`HubError::RepoId`] (ModelScope needs `org/name`), [`HubError::Io`].
pub fn download_modelscope(dest: &ModelScopeDest, repo: &str) -> Result<Download, HubError> {
    check_repo(repo)?;
    if !repo.contains('/') {
        return Err(HubError::RepoId(repo.to_owned()));
    }
    let files = repo_files(repo);
    let rev = revision(&files);
    let (dir, temp) = dest.dirs(repo);
    let path = match dest {
        ModelScopeDest::LocalDir(_) => abspath(&dir)?,
        _ => dir.clone(),
    };
    let mut d = Download::new(path, rev);
    if files.iter().all(|f| holds(&dir.join(&f.name), &f.content)) {
        return Ok(d);
    }
    for made in [&dir, &temp] {
        std::fs::create_dir_all(made).map_err(io("creating", made))?;
    }
    for f in write_order(&files) {
        let file = dir.join(&f.name);
        if holds(&file, &f.content) {
            continue;
        }
        write_via(&temp.join(&f.name), &file, &f.content)?;
        d.fetched.push((f.name.clone(), f.content.len() as u64));
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelLocation;

    fn tempdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("vllm-stub-hub-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn repo_files_are_a_valid_model_per_repo() {
        let a = repo_files("org/a");
        assert_eq!(a, repo_files("org/a"));
        assert_ne!(a, repo_files("org/b"));
        assert_eq!(revision(&a).len(), 40);
        let mut tensors = model::safetensors_tensors(&a[1].content).unwrap();
        tensors.sort();
        assert_eq!(tensors, vec!["lm_head.weight", "model.embed_tokens.weight"]);
    }

    #[test]
    fn hf_download_writes_the_hub_layout_once() {
        let cache = tempdir("hf");
        let d = download_hf(&cache, "hearth/stub-model", None, false).unwrap();
        assert_eq!(d.fetched.len(), 2);
        let repo_dir = cache.join("models--hearth--stub-model");
        assert_eq!(
            std::fs::read_to_string(repo_dir.join("refs/main")).unwrap(),
            d.revision
        );
        let link = std::fs::read_link(d.path.join("model.safetensors")).unwrap();
        assert!(link.starts_with("../../blobs"), "{link:?}");
        let m = model::load(&ModelLocation::HfCache {
            cache: cache.clone(),
            repo: "hearth/stub-model".into(),
        })
        .unwrap();
        assert_eq!(m.revision.as_deref(), Some(d.revision.as_str()));
        assert_eq!(m.verified_blobs, 2);
        assert_eq!(m.name_or_path.as_deref(), Some("hearth/stub-model"));
        // Cached: nothing fetched again; offline works too.
        assert!(
            download_hf(&cache, "hearth/stub-model", Some("main"), true)
                .unwrap()
                .fetched
                .is_empty()
        );
        // Offline and absent, a wrong revision, a bad id.
        assert!(matches!(
            download_hf(&cache, "hearth/other", None, true),
            Err(HubError::Offline { .. })
        ));
        assert!(matches!(
            download_hf(&cache, "hearth/stub-model", Some("v2"), false),
            Err(HubError::Revision { .. })
        ));
        assert!(matches!(
            download_hf(&cache, "a/b/c", None, false),
            Err(HubError::RepoId(_))
        ));
        // A corrupted blob is refused by the loader and repaired by the next download.
        let blob = repo_dir.join("blobs").join(link.file_name().unwrap());
        std::fs::write(&blob, b"corrupt").unwrap();
        let loc = ModelLocation::HfCache {
            cache: cache.clone(),
            repo: "hearth/stub-model".into(),
        };
        assert!(matches!(
            model::load(&loc),
            Err(model::LoadError::Invalid(_))
        ));
        assert_eq!(
            download_hf(&cache, "hearth/stub-model", None, false)
                .unwrap()
                .fetched
                .len(),
            2
        );
        model::load(&loc).unwrap();
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn modelscope_download() {
        let cache = tempdir("ms");
        let dest = ModelScopeDest::Cache(cache.clone());
        let d = download_modelscope(&dest, "Qwen/Qwen2.5-7B").unwrap();
        assert_eq!(d.path, cache.join("models/Qwen/Qwen2.5-7B"));
        assert_eq!(d.fetched.last().unwrap().0, "config.json");
        let m = model::load(&ModelLocation::ModelScopeCache {
            cache: cache.clone(),
            repo: "Qwen/Qwen2.5-7B".into(),
        })
        .unwrap();
        assert_eq!(m.model_type.as_deref(), Some("stub"));
        assert!(
            download_modelscope(&dest, "Qwen/Qwen2.5-7B")
                .unwrap()
                .fetched
                .is_empty()
        );
        assert!(download_modelscope(&dest, "gpt2").is_err());
        // Written through ModelScope's temporary folder, which stays.
        assert!(cache.join("models/._____temp/Qwen/Qwen2.5-7B").is_dir());
        assert!(
            std::fs::read_dir(cache.join("models/._____temp/Qwen/Qwen2.5-7B"))
                .unwrap()
                .next()
                .is_none()
        );
        std::fs::remove_dir_all(&cache).unwrap();
    }

    #[test]
    fn modelscope_destinations() {
        let repo = "acme/sql-lora";
        assert_eq!(
            ModelScopeDest::Cache("/m".into()).dirs(repo),
            (
                "/m/models/acme/sql-lora".into(),
                "/m/models/._____temp/acme/sql-lora".into()
            )
        );
        assert_eq!(
            ModelScopeDest::CacheDir("/c".into()).dirs(repo),
            (
                "/c/acme/sql-lora".into(),
                "/c/._____temp/acme/sql-lora".into()
            )
        );
        assert_eq!(
            ModelScopeDest::LocalDir("/l/x".into()).dirs(repo),
            ("/l/x".into(), "/l/x/._____temp".into())
        );
        assert_eq!(
            abspath(Path::new("/a/./b/../c/")).unwrap(),
            PathBuf::from("/a/c")
        );
        assert_eq!(abspath(Path::new("/..")).unwrap(), PathBuf::from("/"));
        assert_eq!(
            abspath(Path::new("rel")).unwrap(),
            std::env::current_dir().unwrap().join("rel")
        );
    }

    #[test]
    fn adapter_repositories_by_name() {
        for (repo, adapter) in [
            ("acme/sql-lora", true),
            ("acme/SQL-LoRA-r16", true),
            ("qwen-lora", true),
            ("acme/loraxyz", true),
            ("lora/model", false),
            ("hearth/stub-model", false),
            ("gpt2", false),
        ] {
            assert_eq!(is_adapter_repo(repo), adapter, "{repo}");
        }
        for (repo, rank) in [
            ("acme/sql-lora-r16", 16),
            ("acme/sql-lora-R32", 32),
            ("acme/sql-lora-r64", 64),
            ("acme/sql-lora-r4096", 4096),
            ("acme/sql-lora", DEFAULT_ADAPTER_RANK),
            ("acme/sql-lora-r0", DEFAULT_ADAPTER_RANK),
            ("acme/sql-lora-r4097", DEFAULT_ADAPTER_RANK),
            ("acme/sql-lora-r99999999999", DEFAULT_ADAPTER_RANK),
            ("acme/sql-lora-r+8", DEFAULT_ADAPTER_RANK),
            ("acme/sql-lora-r", DEFAULT_ADAPTER_RANK),
            ("acme/lora-rank", DEFAULT_ADAPTER_RANK),
            ("acme-r16/sql-lora", DEFAULT_ADAPTER_RANK),
        ] {
            assert_eq!(adapter_rank(repo), rank, "{repo}");
        }
    }

    #[test]
    fn adapter_files_are_a_peft_lora_adapter() {
        let files = repo_files("acme/sql-lora-r16");
        assert_eq!(files, adapter_files("acme/sql-lora-r16"));
        assert_eq!(files, repo_files("acme/sql-lora-r16"), "deterministic");
        assert_ne!(files, repo_files("acme/fin-lora-r16"));
        assert_ne!(revision(&files), revision(&repo_files("acme/fin-lora-r16")));
        let names: Vec<&str> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(names, ["adapter_config.json", "adapter_model.safetensors"]);
        let config: serde_json::Value = serde_json::from_slice(&files[0].content).unwrap();
        assert_eq!(config["peft_type"], "LORA");
        assert_eq!(config["r"], 16);
        assert_eq!(config["lora_alpha"], 32);
        assert_eq!(config["target_modules"], json!(["q_proj", "v_proj"]));
        assert_eq!(config["base_model_name_or_path"], ADAPTER_BASE_MODEL);
        assert_eq!(config["bias"], "none");
        assert_eq!(config["task_type"], "CAUSAL_LM");
        let parsed = lora::AdapterConfig::parse(&files[0].content).unwrap();
        assert_eq!(parsed.rank(), 16);
        assert!(parsed.resolves_for(ADAPTER_BASE_MODEL));
        let mut tensors = model::safetensors_tensors(&files[1].content).unwrap();
        tensors.sort();
        assert_eq!(
            tensors,
            [
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
                "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
                "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight",
                "base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight",
            ]
        );
        // The shapes carry the rank: [r, 4] and [4, r] in F16.
        let header_len = u64::from_le_bytes(files[1].content[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value =
            serde_json::from_slice(&files[1].content[8..8 + header_len]).unwrap();
        let a = &header["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"];
        assert_eq!(
            (a["dtype"].as_str(), &a["shape"]),
            (Some("F16"), &json!([16, 4]))
        );
        let b = &header["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"];
        assert_eq!(b["shape"], json!([4, 16]));
        assert_eq!(files[1].content.len(), 8 + header_len + 4 * 16 * 4 * 2);
        // The default rank.
        let config: serde_json::Value =
            serde_json::from_slice(&repo_files("acme/sql-lora")[0].content).unwrap();
        assert_eq!(
            (config["r"].as_u64(), config["lora_alpha"].as_u64()),
            (Some(8), Some(16))
        );
    }

    #[test]
    fn the_config_file_is_written_last() {
        let model = repo_files("hearth/stub-model");
        let order: Vec<&str> = write_order(&model).map(|f| f.name.as_str()).collect();
        assert_eq!(order, ["model.safetensors", "config.json"]);
        let adapter = repo_files("acme/sql-lora");
        let order: Vec<&str> = write_order(&adapter).map(|f| f.name.as_str()).collect();
        assert_eq!(order, ["adapter_model.safetensors", "adapter_config.json"]);
        let cache = tempdir("order");
        let d = download_hf(&cache, "acme/sql-lora", None, false).unwrap();
        assert_eq!(d.fetched.last().unwrap().0, "adapter_config.json");
        let local = cache.join("local");
        let d = download_hf_local_dir(&cache, &local, "acme/sql-lora", None, false).unwrap();
        assert_eq!(d.copied.last().unwrap().0, "adapter_config.json");
        let d = download_modelscope(&ModelScopeDest::LocalDir(cache.join("ms")), "acme/sql-lora")
            .unwrap();
        assert_eq!(d.fetched.last().unwrap().0, "adapter_config.json");
        std::fs::remove_dir_all(&cache).unwrap();
    }
}

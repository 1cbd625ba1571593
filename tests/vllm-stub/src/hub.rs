//! The stub's model hub: what a download fetches, and the cache layouts it writes.
//!
//! The test cluster reaches no hub, so the stub carries one: every valid repository id names a
//! small model made from the id itself (deterministic, so every node and every run fetches the
//! same bytes): `config.json` (`model_type: "stub"`, `_name_or_path: <repo>`) and
//! `model.safetensors` (two F16 tensors). Its revision is derived from the files, as a commit
//! hash is.
//!
//! [`download_hf`] writes what `huggingface_hub.snapshot_download` writes into a Hugging Face
//! cache: `models--org--name/blobs/<sha256>` (content-addressed, written to `*.incomplete` and
//! renamed), `snapshots/<revision>/<file>` as relative links to the blobs, and `refs/main`
//! holding the revision, written last, so a reader sees either no model or a whole one.
//! [`download_modelscope`] writes the files of a ModelScope cache (`models/org/name/`),
//! `config.json` last. Both return the directory the model's files are in and leave a complete
//! cached model as it is (a second prewarm downloads nothing).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::model::{self, ModelLocation};
use crate::sha256;

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
    /// Writing the cache failed.
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

/// The files the stub's hub serves for `repo`.
pub fn repo_files(repo: &str) -> Vec<RepoFile> {
    let config = json!({
        "_name_or_path": repo,
        "architectures": ["StubForCausalLM"],
        "model_type": "stub",
        "hidden_size": 4,
        "vocab_size": 8,
        "torch_dtype": "float16",
    });
    // 64 bytes per tensor, a hash chain seeded with the repository id.
    let mut seed = sha256::digest(repo.as_bytes());
    let mut data = Vec::with_capacity(128);
    while data.len() < 128 {
        data.extend_from_slice(&seed);
        seed = sha256::digest(&seed);
    }
    let weights = model::safetensors_bytes(&[
        ("model.embed_tokens.weight", "F16", &[8, 4], &data[..64]),
        ("lm_head.weight", "F16", &[8, 4], &data[64..128]),
    ]);
    vec![
        RepoFile {
            name: "config.json".into(),
            content: serde_json::to_vec_pretty(&config).expect("JSON"),
        },
        RepoFile {
            name: "model.safetensors".into(),
            content: weights,
        },
    ]
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
    /// The directory holding the model's files (the snapshot for a Hugging Face cache).
    pub path: PathBuf,
    /// The revision.
    pub revision: String,
    /// Files written, with their sizes; empty when the model was cached already.
    pub fetched: Vec<(String, u64)>,
}

fn check_repo(repo: &str) -> Result<(), HubError> {
    if model::is_repo_id(repo) {
        Ok(())
    } else {
        Err(HubError::RepoId(repo.to_owned()))
    }
}

/// Writes `content` to `path` through `<path>.incomplete` and a rename.
fn write_atomic(path: &Path, content: &[u8]) -> Result<(), HubError> {
    let tmp = PathBuf::from(format!("{}.incomplete", path.display()));
    let mut f = std::fs::File::create(&tmp).map_err(io("creating", &tmp))?;
    f.write_all(content).map_err(io("writing", &tmp))?;
    f.sync_all().map_err(io("syncing", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io("renaming into place", path))
}

/// `snapshot_download(repo_id=repo, revision=revision)` into the Hugging Face cache `cache`
/// (the directory holding `models--*`). `offline` is `HF_HUB_OFFLINE`: only a cached model.
pub fn download_hf(
    cache: &Path,
    repo: &str,
    revision_wanted: Option<&str>,
    offline: bool,
) -> Result<Download, HubError> {
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
    let repo_dir = model::hf_repo_dir(cache, repo);
    let snapshot = repo_dir.join("snapshots").join(&rev);
    let location = ModelLocation::HfCache {
        cache: cache.to_path_buf(),
        repo: repo.to_owned(),
    };
    if model::load(&location).is_ok_and(|m| m.revision.as_deref() == Some(rev.as_str())) {
        return Ok(Download {
            path: snapshot,
            revision: rev,
            fetched: Vec::new(),
        });
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
    let mut fetched = Vec::new();
    for f in &files {
        let sha = sha256::hex(&f.content);
        let blob = blobs.join(&sha);
        let intact = std::fs::read(&blob).is_ok_and(|c| sha256::hex(&c) == sha);
        if !intact {
            write_atomic(&blob, &f.content)?;
        }
        let link = snapshot.join(&f.name);
        let tmp = snapshot.join(format!(".{}.link", f.name));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(Path::new("../../blobs").join(&sha), &tmp)
            .map_err(io("linking", &tmp))?;
        std::fs::rename(&tmp, &link).map_err(io("renaming into place", &link))?;
        fetched.push((f.name.clone(), f.content.len() as u64));
    }
    write_atomic(&refs.join("main"), rev.as_bytes())?;
    Ok(Download {
        path: snapshot,
        revision: rev,
        fetched,
    })
}

/// `modelscope.snapshot_download(repo)` into the ModelScope cache `cache` (`MODELSCOPE_CACHE`).
pub fn download_modelscope(cache: &Path, repo: &str) -> Result<Download, HubError> {
    check_repo(repo)?;
    if !repo.contains('/') {
        return Err(HubError::RepoId(repo.to_owned()));
    }
    let files = repo_files(repo);
    let rev = revision(&files);
    let dir = model::modelscope_repo_dir(cache, repo);
    if model::load_dir(&dir).is_ok_and(|m| {
        files.iter().all(|f| {
            f.name == "config.json"
                || m.weights
                    .iter()
                    .any(|w| w.name == f.name && w.sha256 == sha256::hex(&f.content))
        })
    }) {
        return Ok(Download {
            path: dir,
            revision: rev,
            fetched: Vec::new(),
        });
    }
    std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
    let mut fetched = Vec::new();
    // config.json last: a reader finds no model until the weights are complete.
    let (config, weights): (Vec<&RepoFile>, Vec<&RepoFile>) =
        files.iter().partition(|f| f.name == "config.json");
    for f in weights.into_iter().chain(config) {
        write_atomic(&dir.join(&f.name), &f.content)?;
        fetched.push((f.name.clone(), f.content.len() as u64));
    }
    Ok(Download {
        path: dir,
        revision: rev,
        fetched,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let d = download_modelscope(&cache, "Qwen/Qwen2.5-7B").unwrap();
        assert_eq!(d.path, cache.join("models/Qwen/Qwen2.5-7B"));
        assert_eq!(d.fetched.last().unwrap().0, "config.json");
        let m = model::load(&ModelLocation::ModelScopeCache {
            cache: cache.clone(),
            repo: "Qwen/Qwen2.5-7B".into(),
        })
        .unwrap();
        assert_eq!(m.model_type.as_deref(), Some("stub"));
        assert!(
            download_modelscope(&cache, "Qwen/Qwen2.5-7B")
                .unwrap()
                .fetched
                .is_empty()
        );
        assert!(download_modelscope(&cache, "gpt2").is_err());
        std::fs::remove_dir_all(&cache).unwrap();
    }
}

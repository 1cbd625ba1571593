//! Where the stub's "weights" are and whether they are really there, as vLLM resolves `--model`:
//!
//! | `--model` | environment | where the stub reads the model |
//! |---|---|---|
//! | an existing path, or an absolute path on a mounted volume | | that directory |
//! | a repository id (`org/name`) | `VLLM_USE_MODELSCOPE=True` and `MODELSCOPE_CACHE` | `$MODELSCOPE_CACHE/models/org/name` |
//! | a repository id | `HF_HUB_CACHE`, else `HF_HOME` | `$HF_HUB_CACHE/models--org--name` (`$HF_HOME/hub/...`): `refs/main` → `snapshots/<commit>/` → `../../blobs/<sha256>` |
//! | anything else (no cache configured, or an absolute path that does not exist and is on no volume) | | nothing: the built-in model, as the stub always served |
//!
//! A model directory must hold a `config.json` (a JSON object) and its weights: the shards
//! `model.safetensors.index.json` names, or else every `*.safetensors` file (at least one). Each
//! weight file is checked as a safetensors file (header length, JSON header, every tensor's dtype,
//! shape and data offsets, the data section covered exactly), and each file of a hub snapshot must
//! be a link to a blob whose SHA-256 is the blob's name. Files that are not there yet are
//! [`LoadError::Missing`] (the stub waits, answering 503 on `/health`); files that are there but
//! wrong are [`LoadError::Invalid`] (the stub exits, as vLLM fails on a corrupt checkpoint).
//!
//! Unlike vLLM, the stub never downloads on its own when it serves: with a cache configured it
//! only reads what the prewarm step (see [`crate::prewarm`]) or someone else put there.

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use crate::sha256;

/// Where the model is read from, decided once at start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ModelLocation {
    /// A model directory (vLLM's `--model=<path>`).
    Dir(PathBuf),
    /// A repository in a Hugging Face hub cache (the dir holding `models--org--name`).
    HfCache { cache: PathBuf, repo: String },
    /// A repository in a ModelScope cache (`MODELSCOPE_CACHE`).
    ModelScopeCache { cache: PathBuf, repo: String },
    /// Nothing on disk: the stub's built-in model; `why` says why nothing is read.
    Builtin { why: String },
}

impl ModelLocation {
    /// Whether the stub must find files before it is ready.
    pub fn reads_files(&self) -> bool {
        !matches!(self, ModelLocation::Builtin { .. })
    }

    /// A short name of the kind of location, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            ModelLocation::Dir(_) => "directory",
            ModelLocation::HfCache { .. } => "huggingface-cache",
            ModelLocation::ModelScopeCache { .. } => "modelscope-cache",
            ModelLocation::Builtin { .. } => "builtin",
        }
    }
}

impl fmt::Display for ModelLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ModelLocation::Dir(d) => write!(f, "model directory {}", d.display()),
            ModelLocation::HfCache { cache, repo } => write!(
                f,
                "{repo} in the Hugging Face cache {}",
                hf_repo_dir(cache, repo).display()
            ),
            ModelLocation::ModelScopeCache { cache, repo } => write!(
                f,
                "{repo} in the ModelScope cache {}",
                modelscope_repo_dir(cache, repo).display()
            ),
            ModelLocation::Builtin { why } => write!(f, "the built-in model ({why})"),
        }
    }
}

/// The cache directory of a Hugging Face repository: `<cache>/models--org--name`.
pub fn hf_repo_dir(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

/// The directory of a ModelScope repository: `<cache>/models/org/name`.
pub fn modelscope_repo_dir(cache: &Path, repo: &str) -> PathBuf {
    cache.join("models").join(repo)
}

/// The Hugging Face hub cache the environment names: `HF_HUB_CACHE`, else `$HF_HOME/hub`.
pub fn hf_cache_from_env(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let set = |k: &str| env(k).filter(|v| !v.is_empty());
    set("HF_HUB_CACHE")
        .map(PathBuf::from)
        .or_else(|| set("HF_HOME").map(|h| Path::new(&h).join("hub")))
}

/// The ModelScope cache when vLLM would use ModelScope (`VLLM_USE_MODELSCOPE` true and
/// `MODELSCOPE_CACHE` set).
pub fn modelscope_cache_from_env(env: &dyn Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let on = env("VLLM_USE_MODELSCOPE")
        .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "true" | "1"));
    if !on {
        return None;
    }
    env("MODELSCOPE_CACHE")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// Whether `repo` is a hub repository id (`name` or `org/name`, the hub's rules).
pub fn is_repo_id(repo: &str) -> bool {
    hearth_crds::model_uri::parse_model_uri(&format!("hf://{repo}")).is_ok()
}

/// Decides where `--model` is read from. `env` reads the environment; `mount_point` gives the
/// mount point a path lies on (see [`mount_point_of`]).
pub fn locate(
    model: &str,
    env: &dyn Fn(&str) -> Option<String>,
    mount_point: &dyn Fn(&Path) -> Option<PathBuf>,
) -> ModelLocation {
    let path = Path::new(model);
    // vLLM: a path that exists is a local model, whatever it looks like.
    if path.exists() {
        return ModelLocation::Dir(path.to_path_buf());
    }
    if path.is_absolute() {
        return match mount_point(path) {
            Some(mp) if mp != Path::new("/") => ModelLocation::Dir(path.to_path_buf()),
            _ => ModelLocation::Builtin {
                why: format!(
                    "{model} does not exist and no volume is mounted at or above it, so there is nothing to load"
                ),
            },
        };
    }
    if is_repo_id(model) {
        if let Some(cache) = modelscope_cache_from_env(env) {
            if model.contains('/') {
                return ModelLocation::ModelScopeCache {
                    cache,
                    repo: model.to_owned(),
                };
            }
        } else if let Some(cache) = hf_cache_from_env(env) {
            return ModelLocation::HfCache {
                cache,
                repo: model.to_owned(),
            };
        }
        return ModelLocation::Builtin {
            why: format!(
                "no hub cache is configured (HF_HOME, HF_HUB_CACHE, MODELSCOPE_CACHE unset), so {model} is not read from disk"
            ),
        };
    }
    ModelLocation::Builtin {
        why: format!("{model} is neither an existing path nor a repository id"),
    }
}

/// The mount point `path` lies on, from `/proc/self/mountinfo` (the longest mount point that is
/// `path` or one of its ancestors); `None` when the table cannot be read.
pub fn mount_point_of(path: &Path) -> Option<PathBuf> {
    let table = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    longest_mount_point(&table, path)
}

/// [`mount_point_of`] over a mountinfo table.
pub fn longest_mount_point(mountinfo: &str, path: &Path) -> Option<PathBuf> {
    let path: PathBuf = path
        .components()
        .filter(|c| !matches!(c, Component::CurDir))
        .collect();
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .map(|mp| PathBuf::from(unescape_mountinfo(mp)))
        .filter(|mp| path.starts_with(mp))
        .max_by_key(|mp| mp.components().count())
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|o| b[i] == b'\\' && o.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(o) => {
                let v = o.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(u8::try_from(v).unwrap_or(b'?'));
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Why a model could not be loaded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// Files are not there (yet): the stub waits for them.
    #[error("{0}")]
    Missing(String),
    /// Files are there but not a valid model: the stub gives up.
    #[error("{0}")]
    Invalid(String),
}

/// One weight file that passed the checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightFile {
    /// Its name in the model directory.
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// SHA-256 of its content.
    pub sha256: String,
    /// Tensor names, in the header's order.
    pub tensors: Vec<String>,
}

/// A model that passed the checks: what the stub logs when it is ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedModel {
    /// The directory the files were read from (a hub snapshot for a cache).
    pub dir: PathBuf,
    /// The hub revision (commit) of a Hugging Face cache snapshot.
    pub revision: Option<String>,
    /// Blobs whose SHA-256 was checked against their name (hub caches).
    pub verified_blobs: usize,
    /// `config.json`'s `model_type`.
    pub model_type: Option<String>,
    /// `config.json`'s `_name_or_path`.
    pub name_or_path: Option<String>,
    /// The weight files.
    pub weights: Vec<WeightFile>,
}

impl LoadedModel {
    /// Every tensor of every weight file.
    pub fn tensor_count(&self) -> usize {
        self.weights.iter().map(|w| w.tensors.len()).sum()
    }

    /// Total weight bytes.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.iter().map(|w| w.bytes).sum()
    }
}

fn missing_or_invalid(path: &Path, what: &str, e: &std::io::Error) -> LoadError {
    if e.kind() == std::io::ErrorKind::NotFound {
        LoadError::Missing(format!("{} does not exist ({what})", path.display()))
    } else {
        LoadError::Invalid(format!("reading {} ({what}): {e}", path.display()))
    }
}

/// Reads and checks the model at `location`.
pub fn load(location: &ModelLocation) -> Result<LoadedModel, LoadError> {
    match location {
        ModelLocation::Dir(dir) => load_dir(dir),
        ModelLocation::ModelScopeCache { cache, repo } => {
            load_dir(&modelscope_repo_dir(cache, repo))
        }
        ModelLocation::HfCache { cache, repo } => load_hf(cache, repo),
        ModelLocation::Builtin { why } => Err(LoadError::Invalid(format!(
            "the built-in model has no files to load ({why})"
        ))),
    }
}

fn load_hf(cache: &Path, repo: &str) -> Result<LoadedModel, LoadError> {
    let repo_dir = hf_repo_dir(cache, repo);
    let refs = repo_dir.join("refs/main");
    let revision = match std::fs::read_to_string(&refs) {
        Ok(r) => r.trim().to_owned(),
        Err(e) => {
            return Err(missing_or_invalid(
                &refs,
                &format!("{repo} has not been downloaded into this cache"),
                &e,
            ));
        }
    };
    if revision.is_empty() || !revision.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(LoadError::Invalid(format!(
            "{} holds {revision:?}, not a commit hash",
            refs.display()
        )));
    }
    let snapshot = repo_dir.join("snapshots").join(&revision);
    let entries = std::fs::read_dir(&snapshot)
        .map_err(|e| missing_or_invalid(&snapshot, "the snapshot refs/main names", &e))?;
    let mut verified = 0;
    for entry in entries {
        let entry =
            entry.map_err(|e| LoadError::Invalid(format!("{}: {e}", snapshot.display())))?;
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path)
            .map_err(|e| missing_or_invalid(&path, "snapshot file", &e))?;
        if !meta.file_type().is_symlink() {
            continue;
        }
        let target = std::fs::read_link(&path)
            .map_err(|e| LoadError::Invalid(format!("{}: {e}", path.display())))?;
        let blob = snapshot.join(&target);
        let content = std::fs::read(&blob)
            .map_err(|e| missing_or_invalid(&blob, "blob of a snapshot file", &e))?;
        let name = target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if name.len() == 64 && name.bytes().all(|b| b.is_ascii_hexdigit()) {
            let got = sha256::hex(&content);
            if got != name {
                return Err(LoadError::Invalid(format!(
                    "blob {} of {} has SHA-256 {got}: the cache is corrupt",
                    blob.display(),
                    path.display()
                )));
            }
            verified += 1;
        }
    }
    let mut model = load_dir(&snapshot)?;
    model.revision = Some(revision);
    model.verified_blobs = verified;
    Ok(model)
}

/// Reads and checks a model directory (`config.json` and safetensors weights).
pub fn load_dir(dir: &Path) -> Result<LoadedModel, LoadError> {
    let meta =
        std::fs::metadata(dir).map_err(|e| missing_or_invalid(dir, "model directory", &e))?;
    if !meta.is_dir() {
        return Err(LoadError::Invalid(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    let config_path = dir.join("config.json");
    let config_text = std::fs::read(&config_path)
        .map_err(|e| missing_or_invalid(&config_path, "the model's config", &e))?;
    let config: Value = serde_json::from_slice(&config_text)
        .map_err(|e| LoadError::Invalid(format!("{} is not JSON: {e}", config_path.display())))?;
    if !config.is_object() {
        return Err(LoadError::Invalid(format!(
            "{} is not a JSON object",
            config_path.display()
        )));
    }
    let names = weight_names(dir)?;
    let mut weights = Vec::with_capacity(names.len());
    for name in names {
        let path = dir.join(&name);
        let bytes = std::fs::read(&path).map_err(|e| missing_or_invalid(&path, "weights", &e))?;
        let tensors = safetensors_tensors(&bytes)
            .map_err(|why| LoadError::Invalid(format!("{}: {why}", path.display())))?;
        weights.push(WeightFile {
            name,
            bytes: bytes.len() as u64,
            sha256: sha256::hex(&bytes),
            tensors,
        });
    }
    let text = |k: &str| config.get(k).and_then(Value::as_str).map(str::to_owned);
    Ok(LoadedModel {
        dir: dir.to_path_buf(),
        revision: None,
        verified_blobs: 0,
        model_type: text("model_type"),
        name_or_path: text("_name_or_path"),
        weights,
    })
}

/// The weight files of a model directory: the shards of `model.safetensors.index.json`, else
/// every `*.safetensors` file.
fn weight_names(dir: &Path) -> Result<Vec<String>, LoadError> {
    let index = dir.join("model.safetensors.index.json");
    match std::fs::read(&index) {
        Ok(text) => {
            let v: Value = serde_json::from_slice(&text)
                .map_err(|e| LoadError::Invalid(format!("{} is not JSON: {e}", index.display())))?;
            let map = v
                .get("weight_map")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    LoadError::Invalid(format!("{} has no weight_map object", index.display()))
                })?;
            let mut shards = BTreeSet::new();
            for (tensor, file) in map {
                let file = file
                    .as_str()
                    .filter(|f| is_plain_file_name(f))
                    .ok_or_else(|| {
                        LoadError::Invalid(format!(
                            "{}: tensor {tensor} maps to {file}, not a file name",
                            index.display()
                        ))
                    })?;
                shards.insert(file.to_owned());
            }
            if shards.is_empty() {
                return Err(LoadError::Invalid(format!(
                    "{} maps no tensor",
                    index.display()
                )));
            }
            Ok(shards.into_iter().collect())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let entries = std::fs::read_dir(dir)
                .map_err(|e| missing_or_invalid(dir, "model directory", &e))?;
            let mut names: Vec<String> = entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".safetensors"))
                .collect();
            names.sort();
            if names.is_empty() {
                return Err(LoadError::Missing(format!(
                    "{} has no *.safetensors weights",
                    dir.display()
                )));
            }
            Ok(names)
        }
        Err(e) => Err(missing_or_invalid(&index, "shard index", &e)),
    }
}

fn is_plain_file_name(f: &str) -> bool {
    !f.is_empty() && !f.contains('/') && f != "." && f != ".."
}

/// Bytes per element of a safetensors dtype.
fn dtype_size(dtype: &str) -> Option<u64> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" => 1,
        "I16" | "U16" | "F16" | "BF16" => 2,
        "I32" | "U32" | "F32" => 4,
        "I64" | "U64" | "F64" => 8,
        _ => return None,
    })
}

/// Checks a safetensors file (8-byte little-endian header length, a JSON header of tensors with
/// `dtype`, `shape` and `data_offsets`, then the data, which the tensors must cover exactly) and
/// returns its tensor names.
pub fn safetensors_tensors(bytes: &[u8]) -> Result<Vec<String>, String> {
    let Some(len) = bytes.get(..8) else {
        return Err(format!(
            "{} bytes: too short for a safetensors header",
            bytes.len()
        ));
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    let rest = (bytes.len() - 8) as u64;
    if n > rest {
        return Err(format!(
            "the header length {n} exceeds the {rest} bytes after it"
        ));
    }
    let header = &bytes[8..8 + n as usize];
    let header: serde_json::Map<String, Value> = serde_json::from_slice(header)
        .map_err(|e| format!("the header is not a JSON object: {e}"))?;
    let data_len = rest - n;
    let mut ranges = Vec::new();
    let mut names = Vec::new();
    for (name, t) in &header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = t.get("dtype").and_then(Value::as_str).unwrap_or_default();
        let size = dtype_size(dtype).ok_or_else(|| format!("tensor {name}: dtype {dtype:?}"))?;
        let shape = t
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| format!("tensor {name}: no shape"))?;
        let mut elems: u64 = 1;
        for d in shape {
            let d = d
                .as_u64()
                .ok_or_else(|| format!("tensor {name}: shape {shape:?}"))?;
            elems = elems
                .checked_mul(d)
                .ok_or_else(|| format!("tensor {name}: shape {shape:?} overflows"))?;
        }
        let offsets = match t.get("data_offsets").and_then(Value::as_array) {
            Some(o) if o.len() == 2 => o[0].as_u64().zip(o[1].as_u64()),
            _ => None,
        };
        let offsets =
            offsets.ok_or_else(|| format!("tensor {name}: data_offsets must be [begin, end]"))?;
        let (begin, end) = offsets;
        if begin > end || end > data_len {
            return Err(format!(
                "tensor {name}: data_offsets [{begin}, {end}] outside the {data_len} data bytes"
            ));
        }
        if elems.checked_mul(size) != Some(end - begin) {
            return Err(format!(
                "tensor {name}: {dtype} {shape:?} needs {} bytes, data_offsets give {}",
                elems.saturating_mul(size),
                end - begin
            ));
        }
        ranges.push((begin, end, name.clone()));
        names.push(name.clone());
    }
    if names.is_empty() {
        return Err("no tensors".to_owned());
    }
    ranges.sort();
    let mut at = 0;
    for (begin, end, name) in &ranges {
        if *begin != at {
            return Err(format!(
                "tensor {name} starts at {begin}, the previous data ends at {at} (gap or overlap)"
            ));
        }
        at = *end;
    }
    if at != data_len {
        return Err(format!(
            "the tensors cover {at} of the {data_len} data bytes"
        ));
    }
    Ok(names)
}

/// A safetensors file of the given tensors (name, dtype, shape, data), in the format
/// [`safetensors_tensors`] checks.
pub fn safetensors_bytes(tensors: &[(&str, &str, &[u64], &[u8])]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let begin = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            (*name).to_owned(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    let mut header = serde_json::to_vec(&Value::Object(header)).expect("a JSON map");
    // Padded with spaces to a multiple of 8, as the safetensors writer does.
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&header);
    out.extend_from_slice(&data);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env_of<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            vars.iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        }
    }

    #[test]
    fn locates_like_vllm() {
        let root_only = |_: &Path| Some(PathBuf::from("/"));
        let models_mounted = |p: &Path| {
            Some(if p.starts_with("/models") {
                PathBuf::from("/models")
            } else {
                PathBuf::from("/")
            })
        };
        let hf = [("HF_HOME", "/models/huggingface")];
        assert_eq!(
            locate("hearth/stub-model", &env_of(&hf), &root_only),
            ModelLocation::HfCache {
                cache: "/models/huggingface/hub".into(),
                repo: "hearth/stub-model".into()
            }
        );
        let both = [("HF_HOME", "/h"), ("HF_HUB_CACHE", "/c")];
        assert_eq!(
            locate("gpt2", &env_of(&both), &root_only),
            ModelLocation::HfCache {
                cache: "/c".into(),
                repo: "gpt2".into()
            }
        );
        let ms = [
            ("VLLM_USE_MODELSCOPE", "True"),
            ("MODELSCOPE_CACHE", "/models/modelscope"),
        ];
        assert_eq!(
            locate("Qwen/Qwen2.5-7B", &env_of(&ms), &root_only),
            ModelLocation::ModelScopeCache {
                cache: "/models/modelscope".into(),
                repo: "Qwen/Qwen2.5-7B".into()
            }
        );
        // No cache: the built-in model, as with cache.strategy None.
        assert!(matches!(
            locate("hearth/stub-model", &env_of(&[]), &root_only),
            ModelLocation::Builtin { .. }
        ));
        // An absolute path on a volume is read (and waited for); on the root filesystem only,
        // a path that does not exist is the built-in model.
        assert_eq!(
            locate("/models/qwen/7b", &env_of(&[]), &models_mounted),
            ModelLocation::Dir("/models/qwen/7b".into())
        );
        assert!(matches!(
            locate("/models/stub", &env_of(&[]), &root_only),
            ModelLocation::Builtin { .. }
        ));
        // An existing path is a directory model whatever the environment says.
        let here = env!("CARGO_MANIFEST_DIR");
        assert_eq!(
            locate(here, &env_of(&hf), &root_only),
            ModelLocation::Dir(here.into())
        );
    }

    #[test]
    fn mount_points_from_mountinfo() {
        let table = "\
22 1 0:21 / / rw,relatime - overlay overlay rw
23 22 0:22 / /proc rw - proc proc rw
30 22 8:1 /var/lib/kubelet/pods/x/volumes/kubernetes.io~local-volume/pv /models ro,relatime - ext4 /dev/sda1 rw
31 22 8:1 /x /with\\040space rw - ext4 /dev/sda1 rw
";
        assert_eq!(
            longest_mount_point(table, Path::new("/models/qwen/7b")),
            Some(PathBuf::from("/models"))
        );
        assert_eq!(
            longest_mount_point(table, Path::new("/modelsx")),
            Some(PathBuf::from("/"))
        );
        assert_eq!(
            longest_mount_point(table, Path::new("/with space/m")),
            Some(PathBuf::from("/with space"))
        );
    }

    #[test]
    fn safetensors_checks() {
        let ok = safetensors_bytes(&[
            ("a", "F16", &[2, 2], &[0u8; 8]),
            ("b", "U8", &[3], &[1, 2, 3]),
        ]);
        assert_eq!(safetensors_tensors(&ok).unwrap(), vec!["a", "b"]);
        // Truncated data, extra data, a wrong shape, a bad dtype, garbage.
        assert!(safetensors_tensors(&ok[..ok.len() - 1]).is_err());
        let mut extra = ok.clone();
        extra.push(0);
        assert!(safetensors_tensors(&extra).is_err());
        let wrong = safetensors_bytes(&[("a", "F32", &[2, 2], &[0u8; 8])]);
        assert!(
            safetensors_tensors(&wrong)
                .unwrap_err()
                .contains("needs 16 bytes")
        );
        let bad = safetensors_bytes(&[("a", "F12", &[1], &[0u8; 1])]);
        assert!(safetensors_tensors(&bad).is_err());
        assert!(safetensors_tensors(b"not a safetensors file").is_err());
        assert!(safetensors_tensors(&[0u8; 4]).is_err());
    }
}

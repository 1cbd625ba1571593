//! vLLM's LoRA adapters: static `--lora-modules`, runtime `POST /v1/load_lora_adapter` and
//! `POST /v1/unload_lora_adapter`, the filesystem resolver, and the worker's CPU cache and batch
//! slots.
//!
//! The stub follows vLLM's serving layer (`vllm/entrypoints/openai/models/serving.py`,
//! `OpenAIServingModels`, earlier `vllm/entrypoints/openai/serving_models.py`) and its worker
//! (`vllm/lora/worker_manager.py`, `LRUCacheWorkerLoRAManager`):
//!
//! - **Registration** (the frontend's `lora_requests`): every adapter loaded by
//!   `--lora-modules`, `load_lora_adapter` or the resolver, in load order. It is not bounded by
//!   `--max-cpu-loras`: vLLM keeps every registered adapter and only its worker's cache is
//!   bounded. Requests may name any registered adapter in `model`.
//! - **The CPU cache** (the worker's `LRUCacheWorkerLoRAManager`): at most `max_cpu_loras`
//!   adapters (default `max_loras`), least recently used first out. Loading an adapter reads its
//!   files ([`read_adapter`]), waits `load_delay`, and then evicts the least recently used one if
//!   the cache is full (vLLM loads first, so a failing load evicts nothing). A request for a
//!   registered adapter that fell out of the cache loads it again, paying `load_delay` again.
//!   Adapters with requests generating count as used at every step, as vLLM touches them each
//!   step, so the victim is the least recently used adapter with no request generating.
//! - **Batch slots** (`max_loras`, vLLM's scheduler): at most `max_loras` distinct adapters have
//!   requests generating at once; a request for another adapter waits (counted in
//!   `vllm:num_requests_waiting` and `waiting_lora_adapters`) until one of them has no request
//!   left, while requests for an adapter already generating go ahead. The stub takes the adapter
//!   slot before the `--max-num-seqs` slot.
//! - **Loads are serialized**, as vLLM's engine core runs its `add_lora` calls one at a time;
//!   registration checks are atomic per adapter name (vLLM's `lora_resolver_lock`).
//!
//! Errors are vLLM's, status, `type` and message (see [`LoraError`] and [`AdapterError`]).
//! Load failures that come from the engine carry vLLM's utility-call prefix
//! `Call to add_lora method failed: ` (`vllm/v1/engine/core.py`, `_handle_client_request`).
//!
//! Sleep mode: vLLM does not say what a load does while its engine sleeps (its `add_lora` would
//! write into GPU memory that is offloaded or dropped), so the stub refuses
//! `POST /v1/load_lora_adapter` with `503` from the start of falling asleep until awake again.
//! `POST /v1/unload_lora_adapter` only changes the frontend's registry in vLLM and works while
//! asleep. Waking from sleep level 2 empties the CPU cache: vLLM drops every adapter from its
//! worker when the weights are loaded again (`LoRAModelRunnerMixin.reset_lora_state`), and each
//! is loaded again on its next request.

use std::{
    collections::{BTreeMap, HashMap},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    body::{Body, Bytes},
    extract::State,
    http::{HeaderMap, StatusCode, header},
    response::Response,
};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::{StubState, error, error_in, not_ready, sleep::refuse_while_sleeping};

/// vLLM's `--max-loras` default: adapters in one batch.
pub const DEFAULT_MAX_LORAS: usize = 1;
/// vLLM's `--max-lora-rank` default.
pub const DEFAULT_MAX_LORA_RANK: u32 = 16;
/// The values vLLM accepts for `--max-lora-rank` (`vllm/config/lora.py`, `MaxLoRARanks`).
pub const MAX_LORA_RANKS: [u32; 9] = [1, 8, 16, 32, 64, 128, 256, 320, 512];
/// The name of vLLM's filesystem resolver plugin in `VLLM_PLUGINS`.
pub const FILESYSTEM_RESOLVER_PLUGIN: &str = "lora_filesystem_resolver";
/// The file that makes a directory an adapter, as PEFT writes it.
pub const ADAPTER_CONFIG: &str = "adapter_config.json";
/// The weight files vLLM looks for, in its order (`vllm/lora/lora_model.py`,
/// `LoRAModel.from_local_checkpoint`); the stub checks only that one is a file.
pub const ADAPTER_WEIGHTS: [&str; 3] = [
    "adapter_model.safetensors",
    "adapter_model.bin",
    "adapter_model.pt",
];
/// Label sets of `vllm:lora_requests_info` kept (the newest); vLLM keeps every one it saw.
const MAX_INFO_SERIES: usize = 64;

/// How the stub serves LoRA adapters ([`crate::StubConfig::lora`]).
#[derive(Clone, Debug)]
pub struct LoraConfig {
    /// vLLM's `--enable-lora`. Without it every load fails with vLLM's "LoRA is not enabled"
    /// error and `/metrics` has no LoRA series.
    pub enable: bool,
    /// vLLM's `--max-loras`: distinct adapters generating at once (at least 1).
    pub max_loras: usize,
    /// vLLM's `--max-cpu-loras`: adapters in the worker's CPU cache; `None` is `max_loras`.
    pub max_cpu_loras: Option<usize>,
    /// vLLM's `--max-lora-rank`: the highest rank an adapter may have (one of
    /// [`MAX_LORA_RANKS`]).
    pub max_lora_rank: u32,
    /// vLLM's `--lora-modules`: adapters loaded at start, before the stub is ready.
    pub modules: Vec<LoraModule>,
    /// `VLLM_ALLOW_RUNTIME_LORA_UPDATING` ([`parse_runtime_updating`]): the load and unload routes
    /// are served, and the resolver is asked about unknown models.
    pub runtime_updating: bool,
    /// The filesystem resolver's directory ([`filesystem_resolver_dir`]): an unknown model `x`
    /// whose `<dir>/x` is an adapter of the served model is loaded on first use (only with
    /// `runtime_updating`, as vLLM).
    pub resolver_cache_dir: Option<PathBuf>,
    /// Stub-only: how long loading one adapter into the engine takes (`STUB_LORA_LOAD_DELAY`).
    pub load_delay: Duration,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            enable: false,
            max_loras: DEFAULT_MAX_LORAS,
            max_cpu_loras: None,
            max_lora_rank: DEFAULT_MAX_LORA_RANK,
            modules: Vec::new(),
            runtime_updating: false,
            resolver_cache_dir: None,
            load_delay: Duration::ZERO,
        }
    }
}

impl LoraConfig {
    /// Adapters the CPU cache holds: `max_cpu_loras`, else `max_loras` (at least 1).
    pub fn cpu_capacity(&self) -> usize {
        self.max_cpu_loras.unwrap_or(self.max_loras).max(1)
    }

    /// Checks the limits as vLLM's `LoRAConfig` does (`vllm/config/lora.py`,
    /// `_validate_lora_config`); vLLM checks them only with `--enable-lora`, and so should the
    /// caller.
    ///
    /// # Errors
    /// `max_loras` of 0, a `max_lora_rank` vLLM does not accept, `max_cpu_loras < max_loras`.
    pub fn validate(&self) -> Result<(), LoraConfigError> {
        if self.max_loras == 0 {
            return Err(LoraConfigError::MaxLoras(self.max_loras));
        }
        if !MAX_LORA_RANKS.contains(&self.max_lora_rank) {
            return Err(LoraConfigError::MaxLoraRank(self.max_lora_rank));
        }
        match self.max_cpu_loras {
            Some(cpu) if cpu < self.max_loras => Err(LoraConfigError::MaxCpuLoras {
                cpu,
                max: self.max_loras,
            }),
            _ => Ok(()),
        }
    }
}

/// A LoRA configuration vLLM refuses at start.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraConfigError {
    /// `--max-loras` below 1.
    #[error("max_loras must be at least 1, not {0}")]
    MaxLoras(usize),
    /// `--max-lora-rank` not one of [`MAX_LORA_RANKS`].
    #[error(
        "invalid max_lora_rank {0}: choose from 1, 8, 16, 32, 64, 128, 256, 320, 512 (vLLM's MaxLoRARanks)"
    )]
    MaxLoraRank(u32),
    /// `--max-cpu-loras` below `--max-loras` (vLLM's message).
    #[error("max_cpu_loras ({cpu}) must be >= max_loras ({max})")]
    MaxCpuLoras {
        /// `--max-cpu-loras`.
        cpu: usize,
        /// `--max-loras`.
        max: usize,
    },
    /// `VLLM_LORA_RESOLVER_CACHE_DIR` is not a directory
    /// (`vllm/plugins/lora_resolvers/filesystem_resolver.py`, `register_filesystem_resolver`).
    #[error(
        "VLLM_LORA_RESOLVER_CACHE_DIR must be set to a valid directory for Filesystem Resolver plugin to function (not a directory: {})",
        .0.display()
    )]
    ResolverDir(PathBuf),
}

/// Whether `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (its value, `None` when unset) enables the runtime
/// routes: `1` or `true` in any case, around spaces, as `vllm/envs.py` reads it.
pub fn parse_runtime_updating(value: Option<&str>) -> bool {
    value.is_some_and(|v| matches!(v.trim().to_lowercase().as_str(), "1" | "true"))
}

/// The filesystem resolver's directory from `VLLM_PLUGINS` and `VLLM_LORA_RESOLVER_CACHE_DIR`
/// (their values, `None` when unset), as vLLM registers it: the plugin loads when
/// `VLLM_PLUGINS` is unset (all plugins) or names `lora_filesystem_resolver` in its
/// comma-separated list (`vllm/plugins/__init__.py`, `load_plugins_by_group`), and registers a
/// resolver only when the directory is set and not empty.
///
/// # Errors
/// A directory that is set but is not a directory, which vLLM refuses at start.
pub fn filesystem_resolver_dir(
    plugins: Option<&str>,
    cache_dir: Option<&str>,
) -> Result<Option<PathBuf>, LoraConfigError> {
    let loaded = plugins.is_none_or(|p| p.split(',').any(|n| n == FILESYSTEM_RESOLVER_PLUGIN));
    match cache_dir {
        Some(dir) if loaded && !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_dir() {
                Ok(Some(dir))
            } else {
                Err(LoraConfigError::ResolverDir(dir))
            }
        }
        _ => Ok(None),
    }
}

/// One `--lora-modules` adapter (vLLM's `LoRAModulePath`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoraModule {
    /// The name requests use in `model`.
    pub name: String,
    /// The adapter's directory.
    pub path: String,
    /// The base model it lists as `parent` in `/v1/models`, when that is a served name;
    /// otherwise the first served name is.
    pub base_model_name: Option<String>,
}

/// The JSON form of `--lora-modules`: `LoRAModulePath`'s fields, no others.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LoraModuleJson {
    name: String,
    path: String,
    #[serde(default)]
    base_model_name: Option<String>,
    /// Accepted as newer vLLM does; the stub has no 3D MoE weights.
    #[serde(default)]
    #[allow(dead_code)]
    is_3d_lora_weight: bool,
}

/// A `--lora-modules` value vLLM's `LoRAParserAction` refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraModuleError {
    /// Not `name=path` and not JSON.
    #[error("Invalid JSON format for --lora-modules: {0}")]
    Json(String),
    /// JSON, but not an object of `name`, `path` and optionally `base_model_name`.
    #[error("Invalid fields for --lora-modules: {item} - {reason}")]
    Fields {
        /// The value given.
        item: String,
        /// What is wrong with its fields.
        reason: String,
    },
    /// `name=path` with more than one `=` (vLLM fails unpacking it).
    #[error("Invalid --lora-modules value {0}: the name=path form takes exactly one '='")]
    Pair(String),
}

/// Parses one `--lora-modules` value as vLLM's `LoRAParserAction`
/// (`vllm/entrypoints/openai/cli_args.py`): an empty value is skipped (`None`); a value with
/// `=` and no `,` is `name=path`; anything else is JSON
/// `{"name": .., "path": .., "base_model_name": ..}`.
///
/// # Errors
/// [`LoraModuleError`], with vLLM's messages.
pub fn parse_lora_module(item: &str) -> Result<Option<LoraModule>, LoraModuleError> {
    if item.is_empty() {
        return Ok(None);
    }
    if item.contains('=') && !item.contains(',') {
        let mut parts = item.split('=');
        return match (parts.next(), parts.next(), parts.next()) {
            (Some(name), Some(path), None) => Ok(Some(LoraModule {
                name: name.to_owned(),
                path: path.to_owned(),
                base_model_name: None,
            })),
            _ => Err(LoraModuleError::Pair(item.to_owned())),
        };
    }
    let value: Value =
        serde_json::from_str(item).map_err(|_| LoraModuleError::Json(item.to_owned()))?;
    if !value.is_object() {
        // Python's `LoRAModulePath(**value)` takes a mapping only.
        return Err(LoraModuleError::Fields {
            item: item.to_owned(),
            reason: "argument after ** must be a mapping".into(),
        });
    }
    let m: LoraModuleJson = serde_json::from_value(value).map_err(|e| LoraModuleError::Fields {
        item: item.to_owned(),
        reason: e.to_string(),
    })?;
    Ok(Some(LoraModule {
        name: m.name,
        path: m.path,
        base_model_name: m.base_model_name,
    }))
}

/// Parses every `--lora-modules` value ([`parse_lora_module`]), skipping empty ones.
///
/// # Errors
/// The first value vLLM would refuse.
pub fn parse_lora_modules<S: AsRef<str>>(items: &[S]) -> Result<Vec<LoraModule>, LoraModuleError> {
    let mut out = Vec::new();
    for item in items {
        if let Some(m) = parse_lora_module(item.as_ref())? {
            out.push(m);
        }
    }
    Ok(out)
}

/// The fields of `adapter_config.json` the stub reads (vLLM's `PEFTHelper`,
/// `vllm/lora/peft_helper.py`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterConfig {
    /// `r`: the adapter's rank.
    pub r: u32,
    /// The highest rank in `rank_pattern` (per-module ranks), if any.
    pub max_pattern_rank: Option<u32>,
    /// `peft_type` (`"LORA"` for a LoRA adapter), if present.
    pub peft_type: Option<String>,
    /// `base_model_name_or_path`: the model it was trained on, if present.
    pub base_model_name_or_path: Option<String>,
    /// `bias` (`"none"` unless set).
    pub bias: String,
}

impl AdapterConfig {
    /// Parses `adapter_config.json`: `r`, `lora_alpha` and `target_modules` are required, as
    /// `PEFTHelper.from_dict` requires its fields without defaults.
    ///
    /// # Errors
    /// [`AdapterError::Json`] for text that is not a JSON object, [`AdapterError::MissingFields`]
    /// (vLLM's "Missing required configuration fields"), [`AdapterError::Json`] for an `r` (or a
    /// `rank_pattern` value) that is not a non-negative integer.
    pub fn parse(text: &[u8]) -> Result<Self, AdapterError> {
        let v: Value =
            serde_json::from_slice(text).map_err(|e| AdapterError::Json(e.to_string()))?;
        let Some(obj) = v.as_object() else {
            return Err(AdapterError::Json(
                "adapter_config.json is not a JSON object".into(),
            ));
        };
        let missing: Vec<String> = ["lora_alpha", "r", "target_modules"]
            .into_iter()
            .filter(|k| !obj.contains_key(*k))
            .map(String::from)
            .collect();
        if !missing.is_empty() {
            return Err(AdapterError::MissingFields(missing));
        }
        let rank = |v: &Value, what: &str| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    AdapterError::Json(format!("{what} must be a rank (an integer), not {v}"))
                })
        };
        let r = rank(&obj["r"], "r")?;
        let mut max_pattern_rank = None;
        if let Some(pattern) = obj.get("rank_pattern").and_then(Value::as_object) {
            for (module, v) in pattern {
                let n = rank(v, &format!("rank_pattern.{module}"))?;
                max_pattern_rank = Some(max_pattern_rank.map_or(n, |m: u32| m.max(n)));
            }
        }
        let text = |k: &str| obj.get(k).and_then(Value::as_str).map(String::from);
        Ok(Self {
            r,
            max_pattern_rank,
            peft_type: text("peft_type"),
            base_model_name_or_path: text("base_model_name_or_path"),
            bias: text("bias").unwrap_or_else(|| "none".into()),
        })
    }

    /// The adapter's rank: the highest of `r` and `rank_pattern`'s values.
    pub fn rank(&self) -> u32 {
        self.max_pattern_rank.map_or(self.r, |p| p.max(self.r))
    }

    /// Checks the adapter against the server's limits as `PEFTHelper.validate_legal` does.
    ///
    /// # Errors
    /// [`AdapterError::Illegal`] with vLLM's messages, joined by a space: "LoRA rank {r} is
    /// greater than max_lora_rank {max}." and "Adapter bias is not supported.".
    pub fn validate_legal(&self, max_lora_rank: u32) -> Result<(), AdapterError> {
        let mut errors = Vec::new();
        let rank = self.rank();
        if rank > max_lora_rank {
            errors.push(format!(
                "LoRA rank {rank} is greater than max_lora_rank {max_lora_rank}."
            ));
        }
        if self.bias != "none" {
            errors.push("Adapter bias is not supported.".to_owned());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(AdapterError::Illegal(errors.join(" ")))
        }
    }

    /// Whether vLLM's filesystem resolver takes this adapter for `base_model` (the `--model`
    /// value): `peft_type` is `"LORA"` and `base_model_name_or_path` is `base_model`
    /// (`FilesystemResolver._get_lora_req_from_path`).
    pub fn resolves_for(&self, base_model: &str) -> bool {
        self.peft_type.as_deref() == Some("LORA")
            && self.base_model_name_or_path.as_deref() == Some(base_model)
    }
}

/// An adapter directory as read from disk ([`read_adapter`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterFiles {
    /// Its `adapter_config.json`.
    pub config: AdapterConfig,
    /// The weight file found (the first of [`ADAPTER_WEIGHTS`]).
    pub weights: PathBuf,
    /// Its size in bytes.
    pub weight_bytes: u64,
}

/// Why an adapter could not be loaded into the engine: vLLM's worker errors
/// (`vllm/lora/worker_manager.py`, `WorkerLoRAManager._load_adapter`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdapterError {
    /// The directory or its `adapter_config.json` does not exist: vLLM's
    /// `LoRAAdapterNotFoundError` (`vllm/exceptions.py`), a `404`.
    #[error("Loading lora {name} failed: No adapter found for {path}")]
    NotFound {
        /// The adapter's name.
        name: String,
        /// Its path as given.
        path: String,
    },
    /// `adapter_config.json` cannot be read or is not valid JSON of the right types.
    #[error("{0}")]
    Json(String),
    /// `adapter_config.json` lacks fields `PEFTHelper` requires (names sorted).
    #[error("Missing required configuration fields: {{{}}}", quoted(.0))]
    MissingFields(Vec<String>),
    /// `PEFTHelper.validate_legal` refused it (a rank above `--max-lora-rank`, a bias).
    #[error("{0}")]
    Illegal(String),
    /// No weight file ([`ADAPTER_WEIGHTS`]) in the directory.
    #[error("{dir} doesn't contain tensors")]
    NoWeights {
        /// The directory as given.
        dir: String,
    },
    /// The server runs without `--enable-lora`.
    #[error("LoRA is not enabled. Use --enable-lora to enable LoRA.")]
    Disabled,
}

/// `{'a', 'b'}` as Python prints a set of strings (here sorted).
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Reads and checks the adapter `name` at `path` as vLLM's worker loads it from a local path:
/// `adapter_config.json` (a missing one is [`AdapterError::NotFound`]), the checks of
/// `validate_legal` against `max_lora_rank`, then a weight file. The weights' contents are not
/// read.
///
/// # Errors
/// [`AdapterError`].
pub fn read_adapter(
    name: &str,
    path: &str,
    max_lora_rank: u32,
) -> Result<AdapterFiles, AdapterError> {
    let dir = Path::new(path);
    let text = match std::fs::read(dir.join(ADAPTER_CONFIG)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(AdapterError::NotFound {
                name: name.to_owned(),
                path: path.to_owned(),
            });
        }
        Err(e) => {
            return Err(AdapterError::Json(format!(
                "{}: {e}",
                dir.join(ADAPTER_CONFIG).display()
            )));
        }
    };
    let config = AdapterConfig::parse(&text)?;
    config.validate_legal(max_lora_rank)?;
    for file in ADAPTER_WEIGHTS {
        let weights = dir.join(file);
        if let Ok(meta) = std::fs::metadata(&weights)
            && meta.is_file()
        {
            return Ok(AdapterFiles {
                config,
                weights,
                weight_bytes: meta.len(),
            });
        }
    }
    Err(AdapterError::NoWeights {
        dir: path.to_owned(),
    })
}

/// A registered adapter, as `/v1/models` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adapter {
    /// The name requests use in `model` (the card's `id`).
    pub name: String,
    /// Its directory as given (the card's `root`).
    pub path: String,
    /// The base model it belongs to (the card's `parent`).
    pub parent: String,
    /// vLLM's `lora_int_id`: a new one for every registration.
    pub id: u64,
    /// Its rank, as last read from `adapter_config.json`.
    pub rank: u32,
}

/// A refused adapter operation, with vLLM's status, `type` and message
/// (`OpenAIServingModels`: `_check_load_lora_adapter_request`, `load_lora_adapter`,
/// `_check_unload_lora_adapter_request`, `resolve_lora`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoraError {
    /// `lora_name` or `lora_path` empty: `400 InvalidUserInput`.
    #[error("Both 'lora_name' and 'lora_path' must be provided.")]
    MissingNameOrPath,
    /// The name is registered already (without `load_inplace`): `400 InvalidUserInput`.
    #[error(
        "The lora adapter '{0}' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
    )]
    AlreadyLoaded(String),
    /// `lora_name` empty on unload: `400 InvalidUserInput`.
    #[error("'lora_name' needs to be provided to unload a LoRA adapter.")]
    MissingName,
    /// Unload of a name that is not registered: `404 NotFoundError`.
    #[error("The lora adapter '{0}' cannot be found.")]
    NotLoaded(String),
    /// The engine's `add_lora` failed: `404 NotFoundError` when no adapter is at the path,
    /// else `400 BadRequestError`.
    #[error("Call to add_lora method failed: {0}")]
    AddLora(AdapterError),
    /// The resolver found the adapter but the engine could not load it: `400 BadRequestError`.
    #[error("LoRA adapter '{name}' was found but could not be loaded: {reason}")]
    ResolvedButFailed {
        /// The requested model.
        name: String,
        /// The engine's error.
        reason: String,
    },
}

impl LoraError {
    /// The HTTP status vLLM answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::NotLoaded(_) | Self::AddLora(AdapterError::NotFound { .. }) => {
                StatusCode::NOT_FOUND
            }
            _ => StatusCode::BAD_REQUEST,
        }
    }

    /// The error `type` vLLM answers with.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::MissingNameOrPath | Self::AlreadyLoaded(_) | Self::MissingName => {
                "InvalidUserInput"
            }
            Self::NotLoaded(_) | Self::AddLora(AdapterError::NotFound { .. }) => "NotFoundError",
            Self::AddLora(_) | Self::ResolvedButFailed { .. } => "BadRequestError",
        }
    }

    fn response(&self) -> Response {
        error(self.status(), &self.to_string(), self.kind())
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Requests per adapter (by `lora_int_id`, with its name), running or waiting.
type PerAdapter = BTreeMap<u64, (String, usize)>;

/// The scheduler's view of adapters: requests generating and waiting per adapter, and the
/// `vllm:lora_requests_info` label sets seen.
#[derive(Default)]
struct Sched {
    running: PerAdapter,
    waiting: PerAdapter,
    /// (running, waiting, seconds since the epoch), in first-seen order.
    series: Vec<(String, String, f64)>,
}

fn bump(map: &mut PerAdapter, id: u64, name: &str, up: bool) {
    if up {
        map.entry(id).or_insert_with(|| (name.to_owned(), 0)).1 += 1;
    } else if let Some(e) = map.get_mut(&id) {
        e.1 = e.1.saturating_sub(1);
        if e.1 == 0 {
            map.remove(&id);
        }
    }
}

/// The adapter names of `map`, each once, in load order, comma-separated as vLLM's label.
fn names(map: &PerAdapter) -> String {
    let mut out: Vec<&str> = Vec::new();
    for (name, _) in map.values() {
        if !out.contains(&name.as_str()) {
            out.push(name);
        }
    }
    out.join(",")
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Sched {
    fn can_run(&self, id: u64, max_loras: usize) -> bool {
        self.running.contains_key(&id) || self.running.len() < max_loras
    }

    /// Sets the current label set's time to now, as vLLM's `set_to_current_time` each step.
    fn record(&mut self) {
        let (running, waiting) = (names(&self.running), names(&self.waiting));
        let now = now_unix();
        match self
            .series
            .iter_mut()
            .find(|(r, w, _)| *r == running && *w == waiting)
        {
            Some(s) => s.2 = now,
            None => {
                if self.series.len() >= MAX_INFO_SERIES
                    && let Some(oldest) = self
                        .series
                        .iter()
                        .enumerate()
                        .min_by(|a, b| a.1.2.total_cmp(&b.1.2))
                        .map(|(i, _)| i)
                {
                    self.series.remove(oldest);
                }
                self.series.push((running, waiting, now));
            }
        }
    }
}

/// Prometheus' (Go's) float form for a timestamp: `1.789828498802105e+09`, as vLLM's
/// `prometheus_client` prints it.
fn go_float(v: f64) -> String {
    let s = format!("{v:e}");
    match s.split_once('e') {
        Some((mantissa, exp)) => match exp.parse::<i32>() {
            Ok(e) if e >= 0 => format!("{mantissa}e+{e:02}"),
            Ok(e) => format!("{mantissa}e-{:02}", -e),
            Err(_) => s,
        },
        None => s,
    }
}

/// The LoRA state of a running stub: registry, CPU cache, batch slots, counters.
pub(crate) struct LoraRuntime {
    config: LoraConfig,
    /// `--model`: the base model the resolver compares `base_model_name_or_path` with.
    base_model: String,
    /// The served names; the first is an adapter's default parent.
    served: Vec<String>,
    registry: Mutex<Vec<Arc<Adapter>>>,
    name_locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// Held while an adapter loads: the engine core loads one at a time.
    engine: tokio::sync::Mutex<()>,
    /// The worker's CPU cache, least recently used first.
    cache: Mutex<Vec<Arc<Adapter>>>,
    sched: Mutex<Sched>,
    slot_freed: tokio::sync::Notify,
    next_id: AtomicU64,
    loads: AtomicU64,
    evictions: AtomicU64,
    static_ready: AtomicBool,
}

impl std::fmt::Debug for LoraRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoraRuntime")
            .field("config", &self.config)
            .field("registered", &lock(&self.registry).len())
            .finish_non_exhaustive()
    }
}

impl LoraRuntime {
    pub(crate) fn new(config: LoraConfig, base_model: String, served: Vec<String>) -> Self {
        let static_ready = AtomicBool::new(config.modules.is_empty());
        let mut sched = Sched::default();
        if config.enable {
            sched.record();
        }
        Self {
            config,
            base_model,
            served,
            registry: Mutex::new(Vec::new()),
            name_locks: Mutex::new(HashMap::new()),
            engine: tokio::sync::Mutex::new(()),
            cache: Mutex::new(Vec::new()),
            sched: Mutex::new(sched),
            slot_freed: tokio::sync::Notify::new(),
            next_id: AtomicU64::new(1),
            loads: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
            static_ready,
        }
    }

    pub(crate) fn static_ready(&self) -> bool {
        self.static_ready.load(Ordering::SeqCst)
    }

    pub(crate) fn loads(&self) -> u64 {
        self.loads.load(Ordering::SeqCst)
    }

    pub(crate) fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::SeqCst)
    }

    pub(crate) fn adapters(&self) -> Vec<Adapter> {
        lock(&self.registry).iter().map(|a| (**a).clone()).collect()
    }

    pub(crate) fn cached(&self) -> Vec<String> {
        lock(&self.cache).iter().map(|a| a.name.clone()).collect()
    }

    pub(crate) fn running_adapters(&self) -> Vec<String> {
        lock(&self.sched)
            .running
            .values()
            .map(|(n, _)| n.clone())
            .collect()
    }

    pub(crate) fn find(&self, name: &str) -> Option<Arc<Adapter>> {
        lock(&self.registry)
            .iter()
            .find(|a| a.name == name)
            .cloned()
    }

    fn name_lock(&self, name: &str) -> Arc<tokio::sync::Mutex<()>> {
        lock(&self.name_locks)
            .entry(name.to_owned())
            .or_default()
            .clone()
    }

    fn register(&self, adapter: Arc<Adapter>) {
        let mut reg = lock(&self.registry);
        match reg.iter_mut().find(|a| a.name == adapter.name) {
            Some(slot) => *slot = adapter,
            None => reg.push(adapter),
        }
    }

    /// The parent of an adapter registered with `base_model_name`: that name when it is served,
    /// else the first served name (`show_available_models`).
    fn parent(&self, base_model_name: Option<&str>) -> String {
        match base_model_name {
            Some(b) if self.served.iter().any(|s| s == b) => b.to_owned(),
            _ => self.served.first().cloned().unwrap_or_default(),
        }
    }

    /// The engine's `add_lora`: a cached adapter (unless `inplace`) is only touched; otherwise its
    /// files are read and checked, `load_delay` passes, and it enters the CPU cache, evicting the
    /// least recently used idle adapter when full. Returns the adapter's rank.
    async fn engine_add(&self, adapter: &Arc<Adapter>, inplace: bool) -> Result<u32, AdapterError> {
        if !self.config.enable {
            return Err(AdapterError::Disabled);
        }
        let _engine = self.engine.lock().await;
        if !inplace && self.touch(adapter.id) {
            return Ok(adapter.rank);
        }
        let files = read_adapter(&adapter.name, &adapter.path, self.config.max_lora_rank)?;
        if !self.config.load_delay.is_zero() {
            tokio::time::sleep(self.config.load_delay).await;
        }
        self.loads.fetch_add(1, Ordering::SeqCst);
        let evicted = {
            let mut cache = lock(&self.cache);
            cache.retain(|a| a.id != adapter.id);
            let mut evicted = None;
            if cache.len() >= self.config.cpu_capacity() {
                let running = lock(&self.sched);
                let victim = cache
                    .iter()
                    .position(|a| !running.running.contains_key(&a.id))
                    .unwrap_or(0);
                evicted = Some(cache.remove(victim));
            }
            cache.push(adapter.clone());
            evicted
        };
        if let Some(old) = evicted {
            self.evictions.fetch_add(1, Ordering::SeqCst);
            tracing::info!(adapter = %old.name, for_adapter = %adapter.name, "LoRA adapter evicted from the CPU cache");
        }
        tracing::info!(
            adapter = %adapter.name,
            path = %adapter.path,
            rank = files.config.rank(),
            weights = %files.weights.display(),
            weight_bytes = files.weight_bytes,
            "LoRA adapter loaded into the engine"
        );
        Ok(files.config.rank())
    }

    /// Moves `id` to the most recently used end of the CPU cache; whether it was there.
    fn touch(&self, id: u64) -> bool {
        let mut cache = lock(&self.cache);
        match cache.iter().position(|a| a.id == id) {
            Some(i) => {
                let a = cache.remove(i);
                cache.push(a);
                true
            }
            None => false,
        }
    }

    /// Loads and registers an adapter as `load_lora_adapter` does; the success message.
    pub(crate) async fn load(
        &self,
        name: &str,
        path: &str,
        base_model_name: Option<&str>,
        inplace: bool,
    ) -> Result<String, LoraError> {
        let name_lock = self.name_lock(name);
        let _guard = name_lock.lock().await;
        if name.is_empty() || path.is_empty() {
            return Err(LoraError::MissingNameOrPath);
        }
        let existing = self.find(name);
        if existing.is_some() && !inplace {
            return Err(LoraError::AlreadyLoaded(name.to_owned()));
        }
        let id = existing
            .as_ref()
            .map_or_else(|| self.next_id.fetch_add(1, Ordering::SeqCst), |a| a.id);
        let mut adapter = Adapter {
            name: name.to_owned(),
            path: path.to_owned(),
            parent: self.parent(base_model_name),
            id,
            rank: 0,
        };
        adapter.rank = self
            .engine_add(&Arc::new(adapter.clone()), true)
            .await
            .map_err(LoraError::AddLora)?;
        let adapter = Arc::new(adapter);
        // The cache entry carries the rank read on load.
        {
            let mut cache = lock(&self.cache);
            if let Some(slot) = cache.iter_mut().find(|a| a.id == id) {
                *slot = adapter.clone();
            }
        }
        self.register(adapter);
        tracing::info!("Loaded new LoRA adapter: name '{name}', path '{path}'");
        Ok(format!(
            "Success: LoRA adapter '{name}' added successfully."
        ))
    }

    /// Unregisters an adapter as `unload_lora_adapter` does; the success message. The engine's
    /// cache keeps it until evicted, as in vLLM.
    pub(crate) async fn unload(&self, name: &str) -> Result<String, LoraError> {
        let name_lock = self.name_lock(name);
        let _guard = name_lock.lock().await;
        if name.is_empty() {
            return Err(LoraError::MissingName);
        }
        let mut reg = lock(&self.registry);
        let Some(i) = reg.iter().position(|a| a.name == name) else {
            return Err(LoraError::NotLoaded(name.to_owned()));
        };
        reg.remove(i);
        tracing::info!("Removed LoRA adapter: name '{name}'");
        Ok(format!(
            "Success: LoRA adapter '{name}' removed successfully."
        ))
    }

    /// Whether requests for unknown models ask the resolver.
    pub(crate) fn resolves(&self) -> bool {
        self.config.runtime_updating && self.config.resolver_cache_dir.is_some()
    }

    /// `resolve_lora` with vLLM's filesystem resolver: `Ok(None)` when `<dir>/<name>` is not an
    /// adapter of the base model (the caller answers vLLM's 404 for an unknown model).
    pub(crate) async fn resolve(&self, name: &str) -> Result<Option<Arc<Adapter>>, LoraError> {
        let Some(dir) = self
            .config
            .resolver_cache_dir
            .as_ref()
            .filter(|_| self.resolves())
        else {
            return Ok(None);
        };
        let name_lock = self.name_lock(name);
        let _guard = name_lock.lock().await;
        if let Some(a) = self.find(name) {
            return Ok(Some(a));
        }
        let path = dir.join(name);
        let matches = std::fs::read(path.join(ADAPTER_CONFIG))
            .ok()
            .and_then(|t| AdapterConfig::parse(&t).ok())
            .is_some_and(|c| c.resolves_for(&self.base_model));
        if !matches {
            return Ok(None);
        }
        let mut adapter = Adapter {
            name: name.to_owned(),
            path: path.to_string_lossy().into_owned(),
            parent: self.parent(None),
            id: self.next_id.fetch_add(1, Ordering::SeqCst),
            rank: 0,
        };
        match self.engine_add(&Arc::new(adapter.clone()), true).await {
            Ok(rank) => {
                adapter.rank = rank;
                let adapter = Arc::new(adapter);
                {
                    let mut cache = lock(&self.cache);
                    if let Some(slot) = cache.iter_mut().find(|a| a.id == adapter.id) {
                        *slot = adapter.clone();
                    }
                }
                self.register(adapter.clone());
                tracing::info!(
                    "Resolved and loaded LoRA adapter '{name}' using FilesystemResolver"
                );
                Ok(Some(adapter))
            }
            Err(e) => {
                let reason = LoraError::AddLora(e).to_string();
                tracing::warn!(
                    "Failed to load LoRA '{name}' resolved by FilesystemResolver: {reason}"
                );
                Err(LoraError::ResolvedButFailed {
                    name: name.to_owned(),
                    reason,
                })
            }
        }
    }

    /// Loads `--lora-modules` in order, as vLLM's `init_static_loras`; then the stub may be ready.
    pub(crate) async fn load_static(&self) -> Result<(), LoraError> {
        for m in self.config.modules.clone() {
            self.load(&m.name, &m.path, m.base_model_name.as_deref(), false)
                .await?;
        }
        self.static_ready.store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Makes sure a request's adapter is in the CPU cache before it generates: touches it, or
    /// loads it again from disk (paying `load_delay`) when it was evicted.
    pub(crate) async fn ensure_cached(&self, adapter: &Arc<Adapter>) -> Result<(), AdapterError> {
        if self.touch(adapter.id) {
            return Ok(());
        }
        tracing::info!(adapter = %adapter.name, "LoRA adapter not in the CPU cache: loading it again");
        self.engine_add(adapter, false).await.map(|_| ())
    }

    /// Empties the CPU cache (waking from sleep level 2).
    pub(crate) fn reset_cache(&self) {
        let mut cache = lock(&self.cache);
        if !cache.is_empty() {
            tracing::info!(
                dropped = cache.len(),
                "weights loaded again: LoRA adapters dropped from the CPU cache"
            );
        }
        cache.clear();
    }

    /// Waits for a batch slot for `adapter` (at most `max_loras` distinct adapters generate); the
    /// request counts in `waiting_lora_adapters` meanwhile.
    pub(crate) async fn admit(self: &Arc<Self>, adapter: Arc<Adapter>) -> LoraSlot {
        let waiting = Waiting::enter(self.clone(), adapter.clone());
        loop {
            let notified = self.slot_freed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut s = lock(&self.sched);
                if s.can_run(adapter.id, self.config.max_loras.max(1)) {
                    waiting.leave(&mut s);
                    bump(&mut s.running, adapter.id, &adapter.name, true);
                    s.record();
                    return LoraSlot {
                        lora: self.clone(),
                        adapter,
                    };
                }
            }
            notified.await;
        }
    }

    /// The LoRA lines of `/metrics`: vLLM's `vllm:lora_requests_info` and the stub's counters;
    /// nothing without `--enable-lora`.
    pub(crate) fn metrics(&self, labels: &str) -> String {
        if !self.config.enable {
            return String::new();
        }
        let series = {
            let mut s = lock(&self.sched);
            s.record();
            s.series.clone()
        };
        let mut out = String::from(
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n\
             # TYPE vllm:lora_requests_info gauge\n",
        );
        for (running, waiting, at) in series {
            out.push_str(&format!(
                "vllm:lora_requests_info{{max_lora=\"{}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}\n",
                self.config.max_loras,
                crate::escape_label(&running),
                crate::escape_label(&waiting),
                go_float(at)
            ));
        }
        out.push_str(&format!(
            "# HELP stub_lora_adapter_loads_total LoRA adapters loaded from disk into the engine (the stub's counter).\n\
             # TYPE stub_lora_adapter_loads_total counter\n\
             stub_lora_adapter_loads_total{{{labels}}} {}\n\
             # HELP stub_lora_adapter_evictions_total LoRA adapters evicted from the CPU cache (the stub's counter).\n\
             # TYPE stub_lora_adapter_evictions_total counter\n\
             stub_lora_adapter_evictions_total{{{labels}}} {}\n",
            self.loads(),
            self.evictions()
        ));
        out
    }
}

/// A request counted in `waiting_lora_adapters` until it is admitted or dropped.
struct Waiting {
    lora: Arc<LoraRuntime>,
    adapter: Arc<Adapter>,
    counted: AtomicBool,
}

impl Waiting {
    fn enter(lora: Arc<LoraRuntime>, adapter: Arc<Adapter>) -> Self {
        {
            let mut s = lock(&lora.sched);
            bump(&mut s.waiting, adapter.id, &adapter.name, true);
            s.record();
        }
        Self {
            lora,
            adapter,
            counted: AtomicBool::new(true),
        }
    }

    fn leave(&self, s: &mut Sched) {
        if self.counted.swap(false, Ordering::SeqCst) {
            bump(&mut s.waiting, self.adapter.id, &self.adapter.name, false);
        }
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        if self.counted.load(Ordering::SeqCst) {
            let mut s = lock(&self.lora.sched);
            self.leave(&mut s);
            s.record();
        }
    }
}

/// A request's batch slot for its adapter; released on drop (end of generation, or the client
/// went away).
pub(crate) struct LoraSlot {
    lora: Arc<LoraRuntime>,
    adapter: Arc<Adapter>,
}

impl Drop for LoraSlot {
    fn drop(&mut self) {
        {
            let mut s = lock(&self.lora.sched);
            bump(&mut s.running, self.adapter.id, &self.adapter.name, false);
            s.record();
        }
        self.lora.slot_freed.notify_waiters();
    }
}

/// A `400` as vLLM's request validation answers (FastAPI's `RequestValidationError`, rendered by
/// vLLM's `validation_exception_handler`): type `Bad Request`, `param` the field's dotted
/// location, the message listing pydantic's errors (without their `input`).
fn validation_error(errors: &[(&str, &str, &str)]) -> Response {
    let label = if errors.len() == 1 { "error" } else { "errors" };
    let mut message = format!("{} validation {label}:", errors.len());
    for (kind, loc, msg) in errors {
        message.push_str(&format!(
            "\n  {{'type': '{kind}', 'loc': {loc}, 'msg': '{msg}'}}"
        ));
    }
    let param = errors.first().map(|(_, loc, _)| {
        loc.trim_matches(|c| c == '(' || c == ')' || c == ',')
            .split(", ")
            .map(|p| p.trim_matches('\''))
            .collect::<Vec<_>>()
            .join(".")
    });
    error_in(
        StatusCode::BAD_REQUEST,
        &message,
        "Bad Request",
        param.as_deref(),
    )
}

/// The body of a load or unload: JSON (vLLM's `validate_json_request`) of an object.
fn json_body(headers: &HeaderMap, body: &[u8]) -> Result<Map<String, Value>, Box<Response>> {
    let media = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_ascii_lowercase();
    if media.split(';').next().unwrap_or_default().trim() != "application/json" {
        return Err(Box::new(error(
            StatusCode::BAD_REQUEST,
            "1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed",
            "Bad Request",
        )));
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(Box::new(validation_error(&[(
            "model_attributes_type",
            "('body',)",
            "Input should be a valid dictionary or object to extract fields from",
        )]))),
        Err(_) => Err(Box::new(validation_error(&[(
            "json_invalid",
            "('body', 0)",
            "JSON decode error",
        )]))),
    }
}

/// The `required` string fields of `body`, in order, as pydantic checks required `str` fields.
fn strings<'b>(
    body: &'b Map<String, Value>,
    required: &[&'static str],
) -> Result<Vec<&'b str>, Box<Response>> {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    let locs: Vec<String> = required
        .iter()
        .map(|f| format!("('body', '{f}')"))
        .collect();
    for (field, loc) in required.iter().zip(&locs) {
        match body.get(*field) {
            None => errors.push(("missing", loc.as_str(), "Field required")),
            Some(Value::String(s)) => out.push(s.as_str()),
            Some(_) => errors.push((
                "string_type",
                loc.as_str(),
                "Input should be a valid string",
            )),
        }
    }
    if errors.is_empty() {
        Ok(out)
    } else {
        Err(Box::new(validation_error(&errors)))
    }
}

/// A load or unload call's JSON body and its required string fields, in order.
type CallFields = (Map<String, Value>, Vec<String>);

/// What a load or unload call starts with: `503` before the model is ready, then the JSON body
/// and its `required` string fields (vLLM's validation errors otherwise).
fn call_fields(
    state: &StubState,
    headers: &HeaderMap,
    body: &[u8],
    required: &[&'static str],
) -> Result<CallFields, Box<Response>> {
    if !state.is_ready() {
        return Err(Box::new(not_ready()));
    }
    let body = json_body(headers, body)?;
    let fields = strings(&body, required)?
        .into_iter()
        .map(str::to_owned)
        .collect();
    Ok((body, fields))
}

/// vLLM answers a successful load or unload with the message as a bare body (Starlette's
/// `Response(content=...)`, no content type).
fn success(message: String) -> Response {
    let mut resp = Response::new(Body::from(message));
    *resp.status_mut() = StatusCode::OK;
    resp
}

/// `POST /v1/load_lora_adapter` `{"lora_name", "lora_path"[, "load_inplace"]}`: loads the
/// adapter into the engine and registers it (vLLM's `load_lora_adapter`,
/// `vllm/entrypoints/serve/lora/api_router.py` and `OpenAIServingModels.load_lora_adapter`).
///
/// `200` with `Success: LoRA adapter '<name>' added successfully.`; errors as [`LoraError`];
/// a missing or non-string field is a `400` `Bad Request` naming it in `param`
/// (`body.lora_path`); `503` before the model is ready and while the engine sleeps (see the
/// module documentation). `load_inplace: true` loads a registered name again from its (new) path.
pub(crate) async fn load_lora_adapter(
    State(state): State<Arc<StubState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (body, fields) = match call_fields(&state, &headers, &body, &["lora_name", "lora_path"]) {
        Ok(read) => read,
        Err(resp) => return *resp,
    };
    let inplace = match body.get("load_inplace") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return validation_error(&[(
                "bool_type",
                "('body', 'load_inplace')",
                "Input should be a valid boolean",
            )]);
        }
    };
    if let Some(refused) = refuse_while_sleeping(&state) {
        return refused;
    }
    match state.lora.load(&fields[0], &fields[1], None, inplace).await {
        Ok(message) => success(message),
        Err(e) => e.response(),
    }
}

/// `POST /v1/unload_lora_adapter` `{"lora_name"[, "lora_int_id"]}`: unregisters the adapter
/// (vLLM's `OpenAIServingModels.unload_lora_adapter`); requests naming it get vLLM's `404` for
/// an unknown model from then on.
///
/// `200` with `Success: LoRA adapter '<name>' removed successfully.`; errors as [`LoraError`]
/// (`404 NotFoundError` for a name not loaded); a missing `lora_name` is a `400` `Bad Request`;
/// `503` before the model is ready.
pub(crate) async fn unload_lora_adapter(
    State(state): State<Arc<StubState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let (body, fields) = match call_fields(&state, &headers, &body, &["lora_name"]) {
        Ok(read) => read,
        Err(resp) => return *resp,
    };
    if !matches!(body.get("lora_int_id"), None | Some(Value::Null)) && !body["lora_int_id"].is_i64()
    {
        return validation_error(&[(
            "int_type",
            "('body', 'lora_int_id')",
            "Input should be a valid integer",
        )]);
    }
    match state.lora.unload(&fields[0]).await {
        Ok(message) => success(message),
        Err(e) => e.response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lora_modules_both_forms() {
        assert_eq!(
            parse_lora_module("sql=/adapters/sql").unwrap(),
            Some(LoraModule {
                name: "sql".into(),
                path: "/adapters/sql".into(),
                base_model_name: None
            })
        );
        assert_eq!(
            parse_lora_module(r#"{"name": "sql", "path": "/a/sql", "base_model_name": "base"}"#)
                .unwrap(),
            Some(LoraModule {
                name: "sql".into(),
                path: "/a/sql".into(),
                base_model_name: Some("base".into())
            })
        );
        // A JSON value with '=' in it is still JSON (it has a ',').
        assert_eq!(
            parse_lora_module(r#"{"name": "a=b", "path": "/p"}"#)
                .unwrap()
                .unwrap()
                .name,
            "a=b"
        );
        assert_eq!(parse_lora_module("").unwrap(), None);
        assert_eq!(parse_lora_modules(&["a=/x", "", "b=/y"]).unwrap().len(), 2);
    }

    #[test]
    fn lora_modules_errors_are_vllms() {
        assert_eq!(
            parse_lora_module("sql").unwrap_err(),
            LoraModuleError::Json("sql".into())
        );
        assert_eq!(
            parse_lora_module("a=/x,b=/y").unwrap_err().to_string(),
            "Invalid JSON format for --lora-modules: a=/x,b=/y"
        );
        let e = parse_lora_module(r#"{"name": "sql"}"#).unwrap_err();
        assert!(
            e.to_string()
                .starts_with(r#"Invalid fields for --lora-modules: {"name": "sql"} - "#),
            "{e}"
        );
        assert!(e.to_string().contains("path"), "{e}");
        assert!(matches!(
            parse_lora_module(r#"{"name": "a", "path": "/p", "rank": 8}"#),
            Err(LoraModuleError::Fields { .. })
        ));
        assert!(matches!(
            parse_lora_module(r#"["a", "/p"]"#),
            Err(LoraModuleError::Fields { .. })
        ));
        assert_eq!(
            parse_lora_module("a=b=c").unwrap_err(),
            LoraModuleError::Pair("a=b=c".into())
        );
    }

    #[test]
    fn config_limits_as_vllm() {
        let ok = LoraConfig {
            enable: true,
            ..LoraConfig::default()
        };
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.cpu_capacity(), 1);
        let cpu = LoraConfig {
            max_loras: 2,
            max_cpu_loras: Some(1),
            ..ok.clone()
        };
        assert_eq!(
            cpu.validate().unwrap_err().to_string(),
            "max_cpu_loras (1) must be >= max_loras (2)"
        );
        assert_eq!(
            LoraConfig {
                max_lora_rank: 48,
                ..ok.clone()
            }
            .validate(),
            Err(LoraConfigError::MaxLoraRank(48))
        );
        assert_eq!(
            LoraConfig {
                max_loras: 0,
                ..ok.clone()
            }
            .validate(),
            Err(LoraConfigError::MaxLoras(0))
        );
        let three = LoraConfig {
            max_loras: 2,
            max_cpu_loras: Some(3),
            ..ok
        };
        assert_eq!(three.validate(), Ok(()));
        assert_eq!(three.cpu_capacity(), 3);
    }

    #[test]
    fn runtime_updating_and_resolver_env() {
        for on in ["1", "true", "True", " TRUE "] {
            assert!(parse_runtime_updating(Some(on)), "{on:?}");
        }
        for off in ["0", "false", "yes", ""] {
            assert!(!parse_runtime_updating(Some(off)), "{off:?}");
        }
        assert!(!parse_runtime_updating(None));

        let dir = std::env::temp_dir();
        let d = dir.to_str().unwrap();
        assert_eq!(
            filesystem_resolver_dir(None, Some(d)),
            Ok(Some(dir.clone()))
        );
        assert_eq!(
            filesystem_resolver_dir(Some("x,lora_filesystem_resolver"), Some(d)),
            Ok(Some(dir.clone()))
        );
        assert_eq!(
            filesystem_resolver_dir(Some("lora_hf_hub_resolver"), Some(d)),
            Ok(None)
        );
        assert_eq!(filesystem_resolver_dir(Some(""), Some(d)), Ok(None));
        assert_eq!(filesystem_resolver_dir(None, None), Ok(None));
        assert_eq!(filesystem_resolver_dir(None, Some("")), Ok(None));
        assert!(matches!(
            filesystem_resolver_dir(None, Some("/nonexistent/lora-cache")),
            Err(LoraConfigError::ResolverDir(_))
        ));
    }

    #[test]
    fn adapter_config_parsing() {
        let c = AdapterConfig::parse(
            br#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                "base_model_name_or_path": "/models/base", "rank_pattern": {"v_proj": 32}}"#,
        )
        .unwrap();
        assert_eq!(c.r, 8);
        assert_eq!(c.rank(), 32);
        assert!(c.resolves_for("/models/base"));
        assert!(!c.resolves_for("other"));
        assert_eq!(
            c.validate_legal(16).unwrap_err().to_string(),
            "LoRA rank 32 is greater than max_lora_rank 16."
        );
        assert_eq!(c.validate_legal(32), Ok(()));

        let e =
            AdapterConfig::parse(br#"{"peft_type": "LORA", "target_modules": "all"}"#).unwrap_err();
        assert_eq!(
            e.to_string(),
            "Missing required configuration fields: {'lora_alpha', 'r'}"
        );
        assert!(matches!(
            AdapterConfig::parse(b"not json"),
            Err(AdapterError::Json(_))
        ));
        assert!(matches!(
            AdapterConfig::parse(br#"{"r": "8", "lora_alpha": 1, "target_modules": []}"#),
            Err(AdapterError::Json(_))
        ));
        let biased = AdapterConfig::parse(
            br#"{"r": 64, "lora_alpha": 1, "target_modules": [], "bias": "all"}"#,
        )
        .unwrap();
        assert_eq!(
            biased.validate_legal(16).unwrap_err().to_string(),
            "LoRA rank 64 is greater than max_lora_rank 16. Adapter bias is not supported."
        );
        // Without peft_type the resolver does not take it.
        let bare =
            AdapterConfig::parse(br#"{"r": 8, "lora_alpha": 1, "target_modules": []}"#).unwrap();
        assert!(!bare.resolves_for("/models/base"));
    }

    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            let d = std::env::temp_dir()
                .join(format!("vllm-stub-lora-unit-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d).unwrap();
            Self(d)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    #[test]
    fn adapter_directory_checks() {
        let d = Dir::new("dir");
        let path = d.0.to_str().unwrap();
        assert_eq!(
            read_adapter("a", path, 16).unwrap_err(),
            AdapterError::NotFound {
                name: "a".into(),
                path: path.into()
            }
        );
        assert_eq!(
            read_adapter("a", "/nonexistent/adapter", 16)
                .unwrap_err()
                .to_string(),
            "Loading lora a failed: No adapter found for /nonexistent/adapter"
        );
        std::fs::write(
            d.0.join(ADAPTER_CONFIG),
            r#"{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}"#,
        )
        .unwrap();
        assert_eq!(
            read_adapter("a", path, 16).unwrap_err().to_string(),
            format!("{path} doesn't contain tensors")
        );
        std::fs::write(d.0.join("adapter_model.bin"), b"anything").unwrap();
        let files = read_adapter("a", path, 16).unwrap();
        assert_eq!(files.weights, d.0.join("adapter_model.bin"));
        assert_eq!(files.weight_bytes, 8);
        std::fs::write(d.0.join("adapter_model.safetensors"), b"xy").unwrap();
        assert_eq!(
            read_adapter("a", path, 16).unwrap().weights,
            d.0.join("adapter_model.safetensors"),
            "safetensors first, as vLLM"
        );
        assert_eq!(
            read_adapter("a", path, 1).unwrap_err().to_string(),
            "LoRA rank 8 is greater than max_lora_rank 1."
        );
    }

    #[test]
    fn errors_map_to_vllms_statuses() {
        let not_found = LoraError::AddLora(AdapterError::NotFound {
            name: "a".into(),
            path: "/p".into(),
        });
        assert_eq!(not_found.status(), StatusCode::NOT_FOUND);
        assert_eq!(not_found.kind(), "NotFoundError");
        assert_eq!(
            not_found.to_string(),
            "Call to add_lora method failed: Loading lora a failed: No adapter found for /p"
        );
        let rank = LoraError::AddLora(AdapterError::Illegal(
            "LoRA rank 32 is greater than max_lora_rank 16.".into(),
        ));
        assert_eq!(rank.status(), StatusCode::BAD_REQUEST);
        assert_eq!(rank.kind(), "BadRequestError");
        assert_eq!(LoraError::MissingNameOrPath.kind(), "InvalidUserInput");
        assert_eq!(
            LoraError::NotLoaded("x".into()).status(),
            StatusCode::NOT_FOUND
        );
        assert_eq!(
            LoraError::AlreadyLoaded("x".into()).to_string(),
            "The lora adapter 'x' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True."
        );
    }

    #[test]
    fn info_series_and_float_form() {
        assert_eq!(go_float(1_789_828_498.802_105), "1.789828498802105e+09");
        assert_eq!(go_float(1_700_000_000.0), "1.7e+09");
        let mut s = Sched::default();
        bump(&mut s.running, 2, "b", true);
        bump(&mut s.running, 1, "a", true);
        bump(&mut s.running, 1, "a", true);
        bump(&mut s.waiting, 3, "c", true);
        assert_eq!(names(&s.running), "a,b");
        assert!(s.can_run(1, 2) && s.can_run(2, 2) && !s.can_run(3, 2));
        s.record();
        bump(&mut s.running, 1, "a", false);
        s.record();
        assert_eq!(s.series.len(), 1, "the same label set: {:?}", s.series);
        bump(&mut s.running, 1, "a", false);
        assert_eq!(names(&s.running), "b");
        s.record();
        assert_eq!(s.series.len(), 2);
        assert_eq!((s.series[1].0.as_str(), s.series[1].1.as_str()), ("b", "c"));
        for i in 0..(MAX_INFO_SERIES as u64 + 5) {
            bump(&mut s.waiting, 100 + i, &format!("w{i}"), true);
            s.record();
        }
        assert_eq!(s.series.len(), MAX_INFO_SERIES);
    }
}

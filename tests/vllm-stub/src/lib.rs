//! A CPU stand-in for a vLLM OpenAI-compatible server.
//!
//! It answers the endpoints the Hearth gateway, the kubelet probes and KEDA touch on a real vLLM
//! pod, with deterministic fake tokens and configurable timing, so the data path can be tested
//! without an accelerator:
//!
//! | endpoint | behaviour |
//! |---|---|
//! | `GET /health` | `503` until the model is loaded and the startup delay has passed, then `200` (vLLM's health route) |
//! | `GET /v1/models` | the served model names, OpenAI `list` of `model` objects, then the registered LoRA adapters (`root` their path, `parent` their base model) |
//! | `POST /v1/chat/completions` | `chat.completion`, or SSE `chat.completion.chunk` events ending with `data: [DONE]` when `"stream": true` |
//! | `POST /v1/completions` | `text_completion`, streaming likewise |
//! | `GET /metrics` | Prometheus text: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`, `vllm:engine_sleep_state`; with LoRA `vllm:lora_requests_info`, `stub_lora_adapter_loads_total`, `stub_lora_adapter_evictions_total` |
//! | `POST /v1/load_lora_adapter` | runtime LoRA updating only (below): loads and registers `{"lora_name", "lora_path"}` |
//! | `POST /v1/unload_lora_adapter` | runtime LoRA updating only: unregisters `{"lora_name"}` |
//! | `POST /sleep[?level=N]` | sleep mode only (below): level `1` (default) offloads the weights and drops the KV cache, `2` drops both; answers `200` once asleep, after `sleep_delay`; another level is a `400` naming `level` |
//! | `POST /wake_up[?tags=weights&tags=kv_cache]` | sleep mode only: `200` once the tags named (all without `tags`) are awake, after `wake_delay`; after level 2 the weights are back but stale until `reload_weights`; at once when awake or for a tag that is not asleep |
//! | `POST /collective_rpc` | sleep mode only: `{"method": "reload_weights"}` loads the weights again (after `startup_delay`), `{"results": [null]}`; `409` while the weights are asleep, `400` for another method |
//! | `GET /is_sleeping` | sleep mode only: `{"is_sleeping": bool}`, `true` from the start of falling asleep until every tag is awake |
//! | any method `/stub/echo` | test aid: the request's method, URI, headers and body size as JSON |
//! | `POST /stub/oom` | fault injection: allocates memory until the kernel's OOM killer ends the process (the container's memory limit), at most `?max=<MiB>` (default 1024); `500` if it is still alive then |
//!
//! Per-request overrides (documented in `docs/gateway.md`, section "The vLLM stand-in"):
//! - `max_tokens` (or `max_completion_tokens` for chat) sets how many tokens are generated;
//! - the header `x-stub-token-delay` or the body field `stub_token_delay` (a Go-style duration,
//!   `"10ms"`) sets the delay before each token;
//! - the header `x-stub-status` (an HTTP status code, 400..=599) makes the request fail with that
//!   status and an OpenAI-style error body;
//! - the header `x-stub-abort-after` (a token count) cuts a stream after that many token
//!   events, without its end (as a server that died mid-stream).
//!
//! At most `max_num_seqs` requests generate at once (vLLM's `--max-num-seqs`); the others wait,
//! and are counted by `vllm:num_requests_waiting`.
//!
//! Sleep mode ([`sleep`]): the three sleep routes exist only when the stub runs with
//! `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1` ([`StubConfig::sleep_endpoints`]);
//! otherwise they are `404`. From the start of falling asleep until woken, completions are
//! refused with `503` ("the engine is sleeping"), while `/health`, `/v1/models` and `/metrics`
//! keep answering.
//!
//! LoRA adapters ([`lora`], [`LoraConfig`]): with `--enable-lora`, requests may name an adapter
//! in `model`; the response's `model` is the adapter and its text starts with
//! `[adapter <name>] `. Adapters come from `--lora-modules` at start, from
//! `POST /v1/load_lora_adapter` (served only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`, as
//! vLLM), or from vLLM's filesystem resolver on first use; at most `max_cpu_loras` stay in the
//! CPU cache (least recently used evicted, loaded again on demand) and at most `max_loras`
//! generate at once. Without LoRA nothing of this changes the stub.
//!
//! The binary reads its model from disk when `--model` names one ([`model`]: a directory, or a
//! repository in the Hugging Face or ModelScope cache the environment names) and is not ready
//! before it has ([`StubConfig::await_model`], [`StubState::model_loaded`]); invoked as
//! `python3` it is the prewarm step that fills such a cache ([`prewarm`], [`hub`]).

pub mod hub;
pub mod lora;
pub mod mirror;
pub mod model;
pub mod prewarm;
pub mod sha256;
pub mod sleep;

pub use lora::{Adapter, LoraConfig, LoraModule};
pub use sleep::{SleepLevel, SleepState, Tags, parse_dev_mode};

use std::{
    future::Future,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use axum::{
    Json, Router,
    body::{Body, Bytes},
    extract::{Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{any, get, post},
};
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::{net::TcpListener, sync::Semaphore};

pub use hearth_crds::duration::parse_duration;

/// Default number of tokens a request generates (`STUB_TOKEN_COUNT`).
pub const DEFAULT_TOKEN_COUNT: u32 = 16;
/// Default delay before each token (`STUB_TOKEN_DELAY`).
pub const DEFAULT_TOKEN_DELAY: Duration = Duration::from_millis(20);
/// Default concurrency limit, as vLLM's `--max-num-seqs` default.
pub const DEFAULT_MAX_NUM_SEQS: usize = 256;
/// Largest request body the stub reads, in bytes.
pub const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;

/// What a stub serves and how slowly.
#[derive(Clone, Debug)]
pub struct StubConfig {
    /// The model path or name given with `--model`; reported as the model's `root`.
    pub model: String,
    /// The names requests may use in `model` (`--served-model-name`); `model` when empty.
    pub served_model_names: Vec<String>,
    /// How long `/health` answers 503 after start (`STUB_STARTUP_DELAY`).
    pub startup_delay: Duration,
    /// Tokens generated per request unless `max_tokens` says otherwise (`STUB_TOKEN_COUNT`).
    pub token_count: u32,
    /// Delay before each generated token (`STUB_TOKEN_DELAY`).
    pub token_delay: Duration,
    /// Requests generating at once; the rest wait (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Whether the stub waits for [`StubState::model_loaded`] before it is ready (the startup
    /// delay then counts from the load); otherwise the model counts as loaded at start.
    pub await_model: bool,
    /// vLLM's `--enable-sleep-mode`: the engine may be put to sleep.
    pub enable_sleep_mode: bool,
    /// vLLM's `VLLM_SERVER_DEV_MODE=1`: the development endpoints (here the sleep routes) are
    /// served.
    pub dev_mode: bool,
    /// How long falling asleep takes (`STUB_SLEEP_DELAY`).
    pub sleep_delay: Duration,
    /// How long waking up takes, after sleep level 2 on top of `startup_delay`
    /// (`STUB_WAKE_DELAY`).
    pub wake_delay: Duration,
    /// vLLM's LoRA adapters ([`lora`]); off by default, and then nothing changes.
    pub lora: LoraConfig,
}

impl Default for StubConfig {
    fn default() -> Self {
        Self {
            model: "stub-model".into(),
            served_model_names: Vec::new(),
            startup_delay: Duration::ZERO,
            token_count: DEFAULT_TOKEN_COUNT,
            token_delay: DEFAULT_TOKEN_DELAY,
            max_num_seqs: DEFAULT_MAX_NUM_SEQS,
            await_model: false,
            enable_sleep_mode: false,
            dev_mode: false,
            sleep_delay: Duration::ZERO,
            wake_delay: Duration::ZERO,
            lora: LoraConfig::default(),
        }
    }
}

impl StubConfig {
    /// The names the stub answers to: `served_model_names`, or `model` when that is empty.
    pub fn names(&self) -> Vec<String> {
        if self.served_model_names.is_empty() {
            vec![self.model.clone()]
        } else {
            self.served_model_names.clone()
        }
    }

    /// Whether `POST /sleep`, `POST /wake_up` and `GET /is_sleeping` are served: with
    /// `enable_sleep_mode` and `dev_mode` both, as vLLM needs both for a sleep over HTTP.
    pub fn sleep_endpoints(&self) -> bool {
        self.enable_sleep_mode && self.dev_mode
    }

    /// How long a wake-up takes, whole or of some tags, from either level: `wake_delay`. After
    /// level 2 it gives the weights their memory back but not their values: loading them again
    /// is `POST /collective_rpc` `reload_weights`, which takes [`Self::reload_delay`].
    pub fn wake_delay(&self) -> Duration {
        self.wake_delay
    }

    /// How long `reload_weights` takes: `startup_delay`, the stub's model load time.
    pub fn reload_delay(&self) -> Duration {
        self.startup_delay
    }
}

/// Live counters of a running stub, shared by its handlers and readable by tests.
#[derive(Debug)]
pub struct StubState {
    config: StubConfig,
    /// When the model was loaded (at start unless `await_model`).
    loaded: std::sync::OnceLock<Instant>,
    created_unix: u64,
    running: AtomicUsize,
    waiting: AtomicUsize,
    received: AtomicU64,
    next_id: AtomicU64,
    seqs: Arc<Semaphore>,
    received_tx: tokio::sync::watch::Sender<u64>,
    /// Where the engine is in sleep mode ([`sleep`]).
    sleep: tokio::sync::watch::Sender<SleepState>,
    /// Held by the sleep or wake-up under way: they run one after the other.
    transitions: tokio::sync::Mutex<()>,
    wake_ups: AtomicU64,
    /// The weights were dropped (sleep level 2) and not loaded again since ([`sleep`]).
    weights_stale: std::sync::atomic::AtomicBool,
    /// Registered adapters, the CPU cache, batch slots ([`lora`]).
    lora: Arc<lora::LoraRuntime>,
}

impl StubState {
    /// A fresh state; the startup delay counts from now, or with `await_model` from
    /// [`StubState::model_loaded`].
    pub fn new(config: StubConfig) -> Arc<Self> {
        let seqs = Arc::new(Semaphore::new(config.max_num_seqs.max(1)));
        let loaded = std::sync::OnceLock::new();
        if !config.await_model {
            let _ = loaded.set(Instant::now());
        }
        let lora = Arc::new(lora::LoraRuntime::new(
            config.lora.clone(),
            config.model.clone(),
            config.names(),
        ));
        Arc::new(Self {
            lora,
            config,
            loaded,
            created_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            running: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            received: AtomicU64::new(0),
            next_id: AtomicU64::new(1),
            seqs,
            received_tx: tokio::sync::watch::channel(0).0,
            sleep: tokio::sync::watch::channel(SleepState::Awake).0,
            transitions: tokio::sync::Mutex::new(()),
            wake_ups: AtomicU64::new(0),
            weights_stale: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// The configuration this stub runs with.
    pub fn config(&self) -> &StubConfig {
        &self.config
    }

    /// Records that the model is loaded: the startup delay counts from now (once).
    pub fn model_loaded(&self) {
        let _ = self.loaded.set(Instant::now());
    }

    /// Whether the model is loaded.
    pub fn is_loaded(&self) -> bool {
        self.loaded.get().is_some()
    }

    /// Whether the model is loaded, the startup delay has passed since, and the `--lora-modules`
    /// adapters are loaded ([`StubState::load_static_adapters`]).
    pub fn is_ready(&self) -> bool {
        self.loaded
            .get()
            .is_some_and(|t| t.elapsed() >= self.config.startup_delay)
            && self.lora.static_ready()
    }

    /// Loads the `--lora-modules` adapters ([`LoraConfig::modules`]) in order, each paying the
    /// load delay, as vLLM does before it serves; the stub is not ready before they are.
    ///
    /// # Errors
    /// The first adapter vLLM would fail to load ([`lora::LoraError`]); vLLM does not start then.
    pub async fn load_static_adapters(&self) -> Result<(), lora::LoraError> {
        self.lora.load_static().await
    }

    /// The registered LoRA adapters, in load order (`/v1/models` lists them after the base
    /// model).
    pub fn lora_adapters(&self) -> Vec<Adapter> {
        self.lora.adapters()
    }

    /// The names of the adapters in the worker's CPU cache, least recently used first.
    pub fn lora_cached(&self) -> Vec<String> {
        self.lora.cached()
    }

    /// The names of the adapters with requests generating now (at most `max_loras`).
    pub fn lora_running(&self) -> Vec<String> {
        self.lora.running_adapters()
    }

    /// Adapters loaded from disk into the engine so far (`stub_lora_adapter_loads_total`):
    /// static, runtime, resolved, and loaded again after an eviction.
    pub fn lora_loads(&self) -> u64 {
        self.lora.loads()
    }

    /// Adapters evicted from the CPU cache so far (`stub_lora_adapter_evictions_total`).
    pub fn lora_evictions(&self) -> u64 {
        self.lora.evictions()
    }

    /// Requests generating tokens now (`vllm:num_requests_running`).
    pub fn running(&self) -> usize {
        self.running.load(Ordering::SeqCst)
    }

    /// Requests waiting for a generation slot (`vllm:num_requests_waiting`).
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }

    /// Completion requests received so far (counted when their body has been read).
    pub fn received(&self) -> u64 {
        self.received.load(Ordering::SeqCst)
    }

    /// A receiver that changes each time a completion request arrives (value: [`Self::received`]).
    pub fn subscribe_received(&self) -> tokio::sync::watch::Receiver<u64> {
        self.received_tx.subscribe()
    }
}

/// The stub's routes over `state`.
pub fn router(state: Arc<StubState>) -> Router {
    let mut router = Router::new()
        .route("/health", get(health))
        .route("/v1/models", get(models))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/metrics", get(metrics))
        .route("/stub/echo", any(echo))
        .route("/stub/oom", post(oom));
    if state.config.sleep_endpoints() {
        router = router
            .route("/sleep", post(sleep::sleep))
            .route("/wake_up", post(sleep::wake_up))
            .route("/is_sleeping", get(sleep::is_sleeping))
            .route("/collective_rpc", post(sleep::collective_rpc));
    }
    if state.config.lora.runtime_updating {
        router = router
            .route("/v1/load_lora_adapter", post(lora::load_lora_adapter))
            .route("/v1/unload_lora_adapter", post(lora::unload_lora_adapter));
    }
    router.with_state(state)
}

/// A stub serving on a bound listener; dropping it does not stop the server, call
/// [`RunningStub::shutdown`] or abort the task.
pub struct RunningStub {
    /// The address the stub listens on.
    pub addr: SocketAddr,
    /// The stub's counters.
    pub state: Arc<StubState>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

impl RunningStub {
    /// `http://<addr>`, the base URL to send requests to.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Stops accepting connections, lets in-flight requests finish, and waits for the server.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(std::io::Error::other(e)),
        }
    }
}

/// Binds `addr` (port 0 for an ephemeral port), loads the `--lora-modules` adapters, and serves
/// the stub in a background task.
///
/// # Errors
/// The bind error, if the address cannot be bound; an `InvalidInput` error naming the static
/// adapter that could not be loaded.
pub async fn spawn(config: StubConfig, addr: SocketAddr) -> std::io::Result<RunningStub> {
    let listener = TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let state = StubState::new(config);
    state.load_static_adapters().await.map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("loading --lora-modules: {e}"),
        )
    })?;
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(serve(listener, state.clone(), async move {
        let _ = rx.await;
    }));
    Ok(RunningStub {
        addr,
        state,
        shutdown: Some(tx),
        task,
    })
}

/// Serves the stub on `listener` until `shutdown` resolves, then stops accepting connections
/// and returns once every in-flight request (streams included) has finished.
///
/// # Errors
/// I/O errors of the accept loop.
pub async fn serve(
    listener: TcpListener,
    state: Arc<StubState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // TCP_NODELAY, as vLLM's server (uvicorn) sets it: without it, Nagle's algorithm holds each
    // small SSE chunk until the previous one is acknowledged.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp: &mut tokio::net::TcpStream| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn health(State(state): State<Arc<StubState>>) -> StatusCode {
    if state.is_ready() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    }
}

async fn models(State(state): State<Arc<StubState>>) -> Response {
    if !state.is_ready() {
        return not_ready();
    }
    let data: Vec<Value> = state
        .config
        .names()
        .into_iter()
        .map(|name| {
            json!({
                "id": name,
                "object": "model",
                "created": state.created_unix,
                "owned_by": "vllm",
                "root": state.config.model,
                "parent": null,
                "max_model_len": 4096,
            })
        })
        .chain(state.lora.adapters().into_iter().map(|a| {
            // vLLM's adapter card: `root` its path, `parent` its base model, no length.
            json!({
                "id": a.name,
                "object": "model",
                "created": state.created_unix,
                "owned_by": "vllm",
                "root": a.path,
                "parent": a.parent,
                "max_model_len": null,
            })
        }))
        .collect();
    Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(state): State<Arc<StubState>>) -> Response {
    let running = state.running();
    let waiting = state.waiting();
    let usage = running as f64 / state.config.max_num_seqs.max(1) as f64;
    // One engine serves every name; vLLM labels its gauges with the first served name.
    let name = state.config.names().into_iter().next().unwrap_or_default();
    let labels = format!("engine=\"0\",model_name=\"{}\"", escape_label(&name));
    let sleep = state.sleep_state();
    let gauge = |on: bool| if on { "1.0" } else { "0.0" };
    let awake = gauge(!sleep.is_sleeping());
    let offloaded = gauge(sleep.level() == Some(SleepLevel::Offload));
    let discarded = gauge(sleep.level() == Some(SleepLevel::Discard));
    let out = format!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{{{labels}}} {running}.0\n\
         # HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n\
         # TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{{labels}}} {waiting}.0\n\
         # HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{{{labels}}} {usage}\n\
         # HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is sleeping; \
         awake = 1 means engine is awake; weights_offloaded = 1 means sleep level 1; \
         discard_all = 1 means sleep level 2.\n\
         # TYPE vllm:engine_sleep_state gauge\n\
         vllm:engine_sleep_state{{{labels},sleep_state=\"awake\"}} {awake}\n\
         vllm:engine_sleep_state{{{labels},sleep_state=\"weights_offloaded\"}} {offloaded}\n\
         vllm:engine_sleep_state{{{labels},sleep_state=\"discard_all\"}} {discarded}\n{}",
        state.lora.metrics(&labels)
    );
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        out,
    )
        .into_response()
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

async fn echo(req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(b) => b,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("reading body: {e}"),
                "BadRequestError",
            );
        }
    };
    let headers: Vec<Value> = parts
        .headers
        .iter()
        .map(|(k, v)| json!([k.as_str(), String::from_utf8_lossy(v.as_bytes())]))
        .collect();
    Json(json!({
        "method": parts.method.as_str(),
        "uri": parts.uri.to_string(),
        "version": format!("{:?}", parts.version),
        "headers": headers,
        "body_len": bytes.len(),
        "body": String::from_utf8_lossy(&bytes),
    }))
    .into_response()
}

/// An OpenAI-style error response: `{"error": {"message", "type", "param", "code"}}`.
fn error(status: StatusCode, message: &str, kind: &str) -> Response {
    error_in(status, message, kind, None)
}

/// [`error`] about the request parameter `param`.
fn error_in(status: StatusCode, message: &str, kind: &str, param: Option<&str>) -> Response {
    (
        status,
        Json(json!({
            "error": {
                "message": message,
                "type": kind,
                "param": param,
                "code": status.as_u16(),
            }
        })),
    )
        .into_response()
}

fn not_ready() -> Response {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "the model is still loading",
        "ServiceUnavailableError",
    )
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

/// The request fields the stub reads; everything else is accepted and ignored, as vLLM does for
/// sampling parameters it would apply.
#[derive(Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    #[serde(default)]
    stream: bool,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    stream_options: Option<StreamOptions>,
    stub_token_delay: Option<String>,
    messages: Option<Vec<Value>>,
    prompt: Option<Value>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

async fn chat_completions(
    State(state): State<Arc<StubState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, Kind::Chat, headers, body).await
}

async fn completions(
    State(state): State<Arc<StubState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    generate(state, Kind::Completion, headers, body).await
}

/// Counts a request in `vllm:num_requests_waiting` or `vllm:num_requests_running` until dropped.
struct Gauge<'a>(&'a AtomicUsize);

impl<'a> Gauge<'a> {
    fn enter(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter)
    }
}

impl Drop for Gauge<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// An owned "running" slot: the semaphore permit plus the running gauge, and the adapter's batch
/// slot, released on drop (end of generation, or the client went away and the body was dropped).
struct Running {
    state: Arc<StubState>,
    _permit: tokio::sync::OwnedSemaphorePermit,
    _lora: Option<lora::LoraSlot>,
}

/// The model a request names: its name, and the adapter when it names one (adapters first, as
/// vLLM's `_maybe_get_adapters`). An unknown name asks the LoRA resolver when there is one
/// (vLLM's `BaseServing._check_model`, `vllm/entrypoints/serve/engine/serving.py`): found and
/// loaded, it serves; found but not loadable, vLLM's `400`; otherwise vLLM's `404` for an unknown
/// model.
async fn resolve_model(
    state: &StubState,
    model: Option<String>,
) -> Result<(String, Option<Arc<Adapter>>), Response> {
    let Some(m) = model else {
        return Err(error(
            StatusCode::BAD_REQUEST,
            "field `model` is required",
            "BadRequestError",
        ));
    };
    if let Some(a) = state.lora.find(&m) {
        return Ok((m, Some(a)));
    }
    if state.config.names().contains(&m) {
        return Ok((m, None));
    }
    if state.lora.resolves() {
        match state.lora.resolve(&m).await {
            Ok(Some(a)) => return Ok((m, Some(a))),
            Ok(None) => {}
            Err(e) => return Err(error(e.status(), &e.to_string(), e.kind())),
        }
    }
    Err(error(
        StatusCode::NOT_FOUND,
        &format!("The model `{m}` does not exist."),
        "NotFoundError",
    ))
}

impl Drop for Running {
    fn drop(&mut self) {
        self.state.running.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn generate(state: Arc<StubState>, kind: Kind, headers: HeaderMap, body: Bytes) -> Response {
    state.received.fetch_add(1, Ordering::SeqCst);
    state.received_tx.send_modify(|n| *n += 1);
    if !state.is_ready() {
        return not_ready();
    }
    if let Some(refused) = sleep::refuse_while_sleeping(&state) {
        return refused;
    }
    if let Some(v) = headers.get("x-stub-status") {
        let code = v
            .to_str()
            .ok()
            .and_then(|s| s.parse::<u16>().ok())
            .and_then(|c| StatusCode::from_u16(c).ok())
            .filter(|c| c.is_client_error() || c.is_server_error());
        return match code {
            Some(code) => error(code, "failure requested by x-stub-status", "StubError"),
            None => error(
                StatusCode::BAD_REQUEST,
                "x-stub-status must be an HTTP status code from 400 to 599",
                "BadRequestError",
            ),
        };
    }
    let req: CompletionRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                &format!("request body is not a valid completion request: {e}"),
                "BadRequestError",
            );
        }
    };
    let (model, adapter) = match resolve_model(&state, req.model).await {
        Ok(served) => served,
        Err(resp) => return resp,
    };
    match kind {
        Kind::Chat if req.messages.as_ref().is_none_or(|m| m.is_empty()) => {
            return error(
                StatusCode::BAD_REQUEST,
                "field `messages` is required and must not be empty",
                "BadRequestError",
            );
        }
        Kind::Completion if req.prompt.is_none() => {
            return error(
                StatusCode::BAD_REQUEST,
                "field `prompt` is required",
                "BadRequestError",
            );
        }
        _ => {}
    }
    let delay_src = headers
        .get("x-stub-token-delay")
        .map(|v| {
            (
                v.to_str().unwrap_or("\u{fffd}").to_owned(),
                "header x-stub-token-delay",
            )
        })
        .or_else(|| req.stub_token_delay.map(|v| (v, "field stub_token_delay")));
    let token_delay = match delay_src {
        None => state.config.token_delay,
        Some((v, what)) => match parse_duration(&v) {
            Ok(d) => d,
            Err(e) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    &format!("{what}: {e}"),
                    "BadRequestError",
                );
            }
        },
    };
    let abort_after = match headers.get("x-stub-abort-after").map(|v| v.to_str()) {
        None => None,
        Some(Ok(v)) if v.parse::<u32>().is_ok() => v.parse::<u32>().ok(),
        Some(_) => {
            return error(
                StatusCode::BAD_REQUEST,
                "header x-stub-abort-after must be a token count (an unsigned integer)",
                "BadRequestError",
            );
        }
    };
    let limit = match kind {
        Kind::Chat => req.max_completion_tokens.or(req.max_tokens),
        Kind::Completion => req.max_tokens,
    };
    let tokens = limit.unwrap_or(state.config.token_count);
    let finish_reason = if limit.is_some() { "length" } else { "stop" };
    let prompt_tokens = prompt_tokens(&body);

    // Wait for a batch slot for its adapter (vLLM's --max-loras), then for a generation slot,
    // as vLLM's scheduler does past --max-num-seqs.
    let (permit, lora_slot) = {
        let _waiting = Gauge::enter(&state.waiting);
        let lora_slot = match &adapter {
            Some(a) => Some(state.lora.admit(a.clone()).await),
            None => None,
        };
        match state.seqs.clone().acquire_owned().await {
            Ok(p) => (p, lora_slot),
            Err(_) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the server is shutting down",
                    "ServiceUnavailableError",
                );
            }
        }
    };
    // The engine may have fallen asleep while the request waited for its slot.
    if let Some(refused) = sleep::refuse_while_sleeping(&state) {
        return refused;
    }
    state.running.fetch_add(1, Ordering::SeqCst);
    let slot = Running {
        state: state.clone(),
        _permit: permit,
        _lora: lora_slot,
    };
    // An adapter evicted from the CPU cache is loaded again before the request generates.
    if let Some(a) = &adapter
        && let Err(e) = state.lora.ensure_cached(a).await
    {
        return error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("loading LoRA adapter '{}' again failed: {e}", a.name),
            "InternalServerError",
        );
    }
    let id_num = state.next_id.fetch_add(1, Ordering::Relaxed);
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let generation = Generation {
        kind,
        id: match kind {
            Kind::Chat => format!("chatcmpl-stub{id_num}"),
            Kind::Completion => format!("cmpl-stub{id_num}"),
        },
        created,
        model,
        adapter: adapter.map(|a| a.name.clone()),
        stale_weights: state.weights_stale(),
        tokens,
        finish_reason,
        prompt_tokens,
    };

    if req.stream {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let stream = sse_stream(generation, token_delay, include_usage, abort_after, slot);
        let mut resp = Response::new(Body::from_stream(stream));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream; charset=utf-8"),
        );
        resp.headers_mut()
            .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        resp
    } else {
        for _ in 0..tokens {
            token_pause(token_delay).await;
        }
        drop(slot);
        Json(generation.full()).into_response()
    }
}

/// Waits `delay` before a token. A zero delay only yields: tokio's timer has a 1 ms
/// resolution, so a zero-length sleep would still cost about a millisecond per token.
async fn token_pause(delay: Duration) {
    if delay.is_zero() {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(delay).await;
    }
}

/// A rough prompt size: whitespace-separated words in the request body.
fn prompt_tokens(body: &[u8]) -> u64 {
    String::from_utf8_lossy(body).split_whitespace().count() as u64
}

/// Each token of an engine whose weights were dropped at sleep level 2 and never loaded again
/// (`POST /collective_rpc` `reload_weights`): U+FFFD, the replacement character.
pub const STALE_WEIGHTS_TOKEN: &str = "\u{fffd}";

const WORDS: [&str; 8] = [
    "Hearth ", "keeps ", "the ", "model ", "warm ", "until ", "idle ", "time. ",
];

struct Generation {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    /// The adapter that answers: the text starts with `[adapter <name>] `.
    adapter: Option<String>,
    /// The weights were dropped at sleep level 2 and not loaded again: every token is
    /// [`STALE_WEIGHTS_TOKEN`], as vLLM's output is noise then.
    stale_weights: bool,
    tokens: u32,
    finish_reason: &'static str,
    prompt_tokens: u64,
}

impl Generation {
    fn usage(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.tokens,
            "total_tokens": self.prompt_tokens + u64::from(self.tokens),
        })
    }

    /// The text of token `i`: a word, the first one after the adapter's name when an adapter
    /// answers.
    fn token(&self, i: u32) -> String {
        if self.stale_weights {
            return STALE_WEIGHTS_TOKEN.to_owned();
        }
        let word = WORDS[i as usize % WORDS.len()];
        match &self.adapter {
            Some(name) if i == 0 => format!("[adapter {name}] {word}"),
            _ => word.to_owned(),
        }
    }

    fn text(&self) -> String {
        (0..self.tokens).map(|i| self.token(i)).collect()
    }

    fn full(&self) -> Value {
        match self.kind {
            Kind::Chat => json!({
                "id": self.id,
                "object": "chat.completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": self.text()},
                    "logprobs": null,
                    "finish_reason": self.finish_reason,
                }],
                "usage": self.usage(),
            }),
            Kind::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{
                    "index": 0,
                    "text": self.text(),
                    "logprobs": null,
                    "finish_reason": self.finish_reason,
                }],
                "usage": self.usage(),
            }),
        }
    }

    /// The chunk for token `i`, or the final chunk (`finish_reason` set) when `i == tokens`.
    fn chunk(&self, i: u32) -> Value {
        let last = i == self.tokens;
        let finish = if last {
            Value::from(self.finish_reason)
        } else {
            Value::Null
        };
        let word = if last { String::new() } else { self.token(i) };
        match self.kind {
            Kind::Chat => {
                let delta = if last {
                    json!({})
                } else if i == 0 {
                    json!({"role": "assistant", "content": word})
                } else {
                    json!({"content": word})
                };
                json!({
                    "id": self.id,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.model,
                    "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
                })
            }
            Kind::Completion => json!({
                "id": self.id,
                "object": "text_completion",
                "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": word, "logprobs": null, "finish_reason": finish}],
            }),
        }
    }

    fn usage_chunk(&self) -> Value {
        let object = match self.kind {
            Kind::Chat => "chat.completion.chunk",
            Kind::Completion => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": self.usage(),
        })
    }
}

fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The SSE body: one `data:` event per token after `delay`, a final chunk with
/// `finish_reason`, an optional usage chunk, then `data: [DONE]`; with `abort_after`, an error
/// after that many token events instead (the server cuts the connection without the body's
/// end). `slot` is held until the stream ends or is dropped (client gone), keeping
/// `vllm:num_requests_running` exact.
fn sse_stream(
    generation: Generation,
    delay: Duration,
    include_usage: bool,
    abort_after: Option<u32>,
    slot: Running,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let total = generation.tokens;
    futures::stream::unfold(
        (generation, 0u32, Some(slot)),
        move |(generation, i, mut slot)| async move {
            slot.as_ref()?;
            if abort_after.is_some_and(|n| i >= n.min(total)) {
                return Some((
                    Err(std::io::Error::other("aborted as x-stub-abort-after asked")),
                    (generation, i + 1, None),
                ));
            }
            let out = if i < total {
                token_pause(delay).await;
                event(&generation.chunk(i))
            } else if i == total {
                event(&generation.chunk(i))
            } else if i == total + 1 && include_usage {
                event(&generation.usage_chunk())
            } else {
                slot = None;
                Bytes::from_static(b"data: [DONE]\n\n")
            };
            Some((Ok(out), (generation, i + 1, slot)))
        },
    )
    .fuse()
}

/// The size of the blocks [`allocate`] touches.
const BLOCK: usize = 8 << 20;

/// Allocates and touches `mib` MiB in 8 MiB blocks, 2 ms apart (a container's memory limit
/// below it ends the process with the kernel's OOM killer on the way), and returns them.
pub fn allocate(mib: usize) -> Vec<Vec<u8>> {
    let mut held: Vec<Vec<u8>> = Vec::new();
    while held.len() * BLOCK < mib << 20 {
        // Non-zero bytes: every page is really touched (no zero-page sharing).
        held.push(vec![0x5a; BLOCK]);
        std::thread::sleep(Duration::from_millis(2));
    }
    held
}

/// `POST /stub/oom[?max=<MiB>]`: touches memory in 8 MiB blocks until the kernel's OOM killer
/// ends the process at the container's memory limit, as an engine that runs out of memory
/// mid-generation. Bounded by `max` (MiB, default 1024, at most 4096): a process still alive
/// then frees it all and answers `500` (no memory limit at or below it).
async fn oom(axum::extract::RawQuery(query): axum::extract::RawQuery) -> Response {
    let max_mib = match query.as_deref().and_then(|q| q.strip_prefix("max=")) {
        None => 1024,
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=4096).contains(&n) => n,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "query max must be a size in MiB from 1 to 4096",
                    "BadRequestError",
                );
            }
        },
    };
    tracing::warn!(
        max_mib,
        "allocating memory until OOM-killed (POST /stub/oom)"
    );
    let blocks = tokio::task::spawn_blocking(move || allocate(max_mib).len())
        .await
        .unwrap_or(0);
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        &format!(
            "still alive after allocating {} MiB: the container has no memory limit at or below it",
            blocks * (BLOCK >> 20)
        ),
        "StubError",
    )
}

//! `vllm-stub`: the command line of the CPU stand-in for vLLM's OpenAI server.
//!
//! Invoked like `vllm serve` is by the upstream stub runtime:
//! `vllm-stub --model=<path> --served-model-name=<name> [--host H] [--port 8000]`, timing from
//! `STUB_STARTUP_DELAY`, `STUB_TOKEN_COUNT`, `STUB_TOKEN_DELAY`; `STUB_ALLOCATE_AT_START` (MiB)
//! makes it hold that much memory from the start (an OOM kill at a lower limit). With `--enable-sleep-mode` and
//! `VLLM_SERVER_DEV_MODE=1` it serves vLLM's sleep mode (`/sleep`, `/wake_up`, `/is_sleeping`, `/collective_rpc`),
//! timed by `STUB_SLEEP_DELAY` and `STUB_WAKE_DELAY`. With `--enable-lora` it serves vLLM's LoRA
//! adapters (`--max-loras`, `--max-cpu-loras`, `--max-lora-rank`, `--lora-modules`; the runtime
//! routes with `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`; the filesystem resolver with
//! `VLLM_LORA_RESOLVER_CACHE_DIR`), each load taking `STUB_LORA_LOAD_DELAY`
//! (`vllm_stub::lora`). See `docs/gateway.md`, section "The vLLM stand-in", and
//! `tests/vllm-stub/README.md`.
//!
//! When `--model` names files (a model directory, or a repository in the hub cache that
//! `HF_HOME` / `MODELSCOPE_CACHE` names), the stub reads and checks them before it is ready:
//! until they are there `/health` answers 503 and the log says what is missing; files that are
//! there but invalid end the process with an error. Invoked as `python3` (the image installs the
//! binary under that name too), it runs the controller's prewarm program instead
//! (`vllm_stub::prewarm`).

use std::{net::SocketAddr, time::Duration};

use anyhow::Context;
use clap::{CommandFactory, Parser};
use tokio::signal::unix::{SignalKind, signal};
use vllm_stub::lora::{self, LoraConfig};
use vllm_stub::model::{self, LoadError, ModelLocation};
use vllm_stub::{StubConfig, StubState, parse_duration};

/// A CPU stand-in for a vLLM OpenAI-compatible server (tests and the demo only).
#[derive(Parser, Debug)]
#[command(name = "vllm-stub", version = hearth_net::version!())]
struct Args {
    /// Model path or name (vLLM's `--model`); the served name when `--served-model-name` is absent.
    #[arg(long)]
    model: String,
    /// Name(s) clients use in the `model` field (vLLM's `--served-model-name`).
    #[arg(long = "served-model-name", num_args = 1..)]
    served_model_name: Vec<String>,
    /// Address to listen on.
    #[arg(long, env = "STUB_HOST", default_value = "0.0.0.0")]
    host: std::net::IpAddr,
    /// Port to listen on.
    #[arg(long, env = "STUB_PORT", default_value_t = 8000)]
    port: u16,
    /// Requests generating at once; the others wait (vLLM's `--max-num-seqs`).
    #[arg(long = "max-num-seqs", default_value_t = vllm_stub::DEFAULT_MAX_NUM_SEQS)]
    max_num_seqs: usize,
    /// How long `/health` answers 503 after start, Go duration ("5s").
    #[arg(long, env = "STUB_STARTUP_DELAY", default_value = "0s", value_parser = duration)]
    startup_delay: Duration,
    /// Tokens generated per request unless the request sets `max_tokens`.
    #[arg(long, env = "STUB_TOKEN_COUNT", default_value_t = vllm_stub::DEFAULT_TOKEN_COUNT)]
    token_count: u32,
    /// Delay before each token, Go duration ("150ms").
    #[arg(long, env = "STUB_TOKEN_DELAY", default_value = "20ms", value_parser = duration)]
    token_delay: Duration,
    /// Allow the engine to sleep (vLLM's `--enable-sleep-mode`); with `VLLM_SERVER_DEV_MODE=1`
    /// the stub then serves `POST /sleep`, `POST /wake_up`, `GET /is_sleeping` and
    /// `POST /collective_rpc` (`reload_weights`).
    #[arg(long = "enable-sleep-mode")]
    enable_sleep_mode: bool,
    /// How long falling asleep takes (`POST /sleep`), Go duration ("500ms").
    #[arg(long, env = "STUB_SLEEP_DELAY", default_value = "0s", value_parser = duration)]
    sleep_delay: Duration,
    /// How long waking up takes (`POST /wake_up`, whole or of some tags), Go duration ("2s");
    /// after sleep level 2 the weights are loaded again by `reload_weights`, which takes the
    /// startup delay.
    #[arg(long, env = "STUB_WAKE_DELAY", default_value = "0s", value_parser = duration)]
    wake_delay: Duration,
    /// Serve LoRA adapters (vLLM's `--enable-lora`).
    #[arg(long = "enable-lora")]
    enable_lora: bool,
    /// Distinct adapters generating at once; requests for others wait (vLLM's `--max-loras`).
    #[arg(long = "max-loras", default_value_t = lora::DEFAULT_MAX_LORAS)]
    max_loras: usize,
    /// Adapters kept in the worker's CPU cache, least recently used evicted first (vLLM's
    /// `--max-cpu-loras`); default `--max-loras`, never below it.
    #[arg(long = "max-cpu-loras")]
    max_cpu_loras: Option<usize>,
    /// Highest adapter rank loaded (vLLM's `--max-lora-rank`): 1, 8, 16, 32, 64, 128, 256, 320
    /// or 512.
    #[arg(long = "max-lora-rank", default_value_t = lora::DEFAULT_MAX_LORA_RANK, value_parser = max_lora_rank)]
    max_lora_rank: u32,
    /// Adapters loaded at start (vLLM's `--lora-modules`): `name=path`, or JSON
    /// `{"name": .., "path": .., "base_model_name": ..}`.
    #[arg(long = "lora-modules", num_args = 1..)]
    lora_modules: Vec<String>,
    /// How long loading one adapter into the engine takes, Go duration ("300ms"): on
    /// `/v1/load_lora_adapter`, at a resolver's first use, and again for an adapter evicted from
    /// the CPU cache.
    #[arg(long, env = "STUB_LORA_LOAD_DELAY", default_value = "0s", value_parser = duration)]
    lora_load_delay: Duration,
    /// MiB allocated and touched at start, before serving, and held: an engine whose weights
    /// do not fit its memory limit (a container limit below it OOM-kills the stub at start).
    #[arg(
        long = "stub-allocate-at-start",
        env = "STUB_ALLOCATE_AT_START",
        default_value_t = 0
    )]
    allocate_at_start: usize,
    /// After SIGTERM, how long in-flight requests may run before the stub exits anyway.
    #[arg(long, env = "STUB_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = duration)]
    shutdown_timeout: Duration,
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

/// `--max-lora-rank`: one of the ranks vLLM accepts.
fn max_lora_rank(s: &str) -> Result<u32, String> {
    let choices = lora::MAX_LORA_RANKS
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ");
    s.parse::<u32>()
        .ok()
        .filter(|r| lora::MAX_LORA_RANKS.contains(r))
        .ok_or_else(|| format!("invalid choice: {s} (choose from {choices})"))
}

fn main() -> anyhow::Result<()> {
    let mut argv = std::env::args_os();
    let argv0 = argv.next().unwrap_or_default();
    let name = std::path::Path::new(&argv0)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if name == "python" || name == "python3" || name.starts_with("python3.") {
        let args: Vec<std::ffi::OsString> = argv.collect();
        let code = vllm_stub::prewarm::python_main(
            &args,
            &|k| std::env::var(k).ok(),
            &mut std::io::stdout().lock(),
            &mut std::io::stderr().lock(),
        );
        std::process::exit(code);
    }
    // `vllm-stub hub-mirror [--port N]`: the stub's hub over HTTP (vllm_stub::mirror).
    let rest: Vec<String> = std::env::args().skip(1).collect();
    if rest.first().map(String::as_str) == Some("hub-mirror") {
        let port = match rest.get(1..).unwrap_or_default() {
            [] => 8080,
            [flag, port] if flag == "--port" => port.parse().context("--port")?,
            other => anyhow::bail!("usage: vllm-stub hub-mirror [--port N], got {other:?}"),
        };
        tracing_subscriber::fmt().init();
        return tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .context("starting the runtime")?
            .block_on(vllm_stub::mirror::serve(port))
            .context("serving the hub mirror");
    }
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(serve())
}

/// How often a missing model is looked for again, and logged again when nothing changed.
const MODEL_POLL: Duration = Duration::from_secs(1);
const MODEL_LOG_EVERY: Duration = Duration::from_secs(10);

/// Loads the model at `location` (waiting for missing files), then marks `state` loaded.
/// Returns an error when the files are there but invalid.
async fn load_model(
    location: ModelLocation,
    model: String,
    state: std::sync::Arc<StubState>,
) -> anyhow::Result<()> {
    let mut last: Option<(String, std::time::Instant)> = None;
    loop {
        let loc = location.clone();
        let result = tokio::task::spawn_blocking(move || model::load(&loc))
            .await
            .context("model loading task")?;
        match result {
            Ok(m) => {
                let weights: Vec<String> = m
                    .weights
                    .iter()
                    .map(|w| {
                        format!(
                            "{} ({} bytes, {} tensors, sha256 {})",
                            w.name,
                            w.bytes,
                            w.tensors.len(),
                            w.sha256
                        )
                    })
                    .collect();
                tracing::info!(
                    model = %model,
                    source = location.kind(),
                    dir = %m.dir.display(),
                    revision = m.revision.as_deref().unwrap_or("-"),
                    verified_blobs = m.verified_blobs,
                    model_type = m.model_type.as_deref().unwrap_or("-"),
                    name_or_path = m.name_or_path.as_deref().unwrap_or("-"),
                    tensors = m.tensor_count(),
                    weight_bytes = m.weight_bytes(),
                    weights = %weights.join(", "),
                    "model loaded from {location}"
                );
                state.model_loaded();
                return Ok(());
            }
            Err(LoadError::Missing(why)) => {
                let repeat = last
                    .as_ref()
                    .is_some_and(|(w, at)| *w == why && at.elapsed() < MODEL_LOG_EVERY);
                if !repeat {
                    tracing::warn!(
                        model = %model,
                        source = location.kind(),
                        "model files not found yet: {why}; /health answers 503 until {location} is complete"
                    );
                    last = Some((why, std::time::Instant::now()));
                }
                tokio::time::sleep(MODEL_POLL).await;
            }
            Err(LoadError::Invalid(why)) => {
                tracing::error!(model = %model, source = location.kind(), "invalid model: {why}");
                anyhow::bail!("cannot load {location}: {why}");
            }
        }
    }
}

async fn serve() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    if args.allocate_at_start > 0 {
        let mib = args.allocate_at_start;
        tracing::warn!(mib, "allocating memory at start (STUB_ALLOCATE_AT_START)");
        // Held for the process's life, as loaded weights are.
        let held = tokio::task::spawn_blocking(move || vllm_stub::allocate(mib)).await?;
        std::mem::forget(held);
    }
    let dev_mode = vllm_stub::parse_dev_mode(std::env::var("VLLM_SERVER_DEV_MODE").ok().as_deref())
        .map_err(anyhow::Error::msg)?;
    let env = |k: &str| std::env::var(k).ok();
    let modules = lora::parse_lora_modules(&args.lora_modules).unwrap_or_else(|e| {
        Args::command()
            .error(clap::error::ErrorKind::ValueValidation, e)
            .exit()
    });
    let lora = LoraConfig {
        enable: args.enable_lora,
        max_loras: args.max_loras,
        max_cpu_loras: args.max_cpu_loras,
        max_lora_rank: args.max_lora_rank,
        modules,
        runtime_updating: lora::parse_runtime_updating(
            env("VLLM_ALLOW_RUNTIME_LORA_UPDATING").as_deref(),
        ),
        resolver_cache_dir: lora::filesystem_resolver_dir(
            env("VLLM_PLUGINS").as_deref(),
            env("VLLM_LORA_RESOLVER_CACHE_DIR").as_deref(),
        )?,
        load_delay: args.lora_load_delay,
    };
    if lora.enable {
        lora.validate()?;
    }
    let location = model::locate(
        &args.model,
        &|k| std::env::var(k).ok(),
        &model::mount_point_of,
    );
    let config = StubConfig {
        model: args.model,
        served_model_names: args.served_model_name,
        startup_delay: args.startup_delay,
        token_count: args.token_count,
        token_delay: args.token_delay,
        max_num_seqs: args.max_num_seqs,
        await_model: location.reads_files(),
        enable_sleep_mode: args.enable_sleep_mode,
        dev_mode,
        sleep_delay: args.sleep_delay,
        wake_delay: args.wake_delay,
        lora,
    };
    if config.sleep_endpoints() {
        tracing::warn!(
            sleep_delay_ms = config.sleep_delay.as_millis() as u64,
            wake_delay_ms = config.wake_delay.as_millis() as u64,
            "development endpoints enabled (VLLM_SERVER_DEV_MODE=1): POST /sleep, POST /wake_up, GET /is_sleeping, POST /collective_rpc"
        );
    } else if config.enable_sleep_mode {
        tracing::info!(
            "--enable-sleep-mode without VLLM_SERVER_DEV_MODE=1: the sleep routes are not served"
        );
    }
    if config.lora.runtime_updating {
        tracing::warn!(
            "LoRA dynamic loading & unloading is enabled in the API server. This should ONLY be used for local development! (POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter)"
        );
    }
    if let Some(dir) = &config.lora.resolver_cache_dir {
        tracing::info!(
            dir = %dir.display(),
            runtime_updating = config.lora.runtime_updating,
            "LoRA filesystem resolver registered; it answers only with VLLM_ALLOW_RUNTIME_LORA_UPDATING"
        );
    }
    if config.lora.enable {
        tracing::info!(
            max_loras = config.lora.max_loras,
            max_cpu_loras = config.lora.cpu_capacity(),
            max_lora_rank = config.lora.max_lora_rank,
            static_adapters = config.lora.modules.len(),
            load_delay_ms = config.lora.load_delay.as_millis() as u64,
            "LoRA enabled"
        );
    }
    let addr = SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr} (set --host/--port)"))?;
    let names = config.names();
    let model_name = config.model.clone();
    let state = StubState::new(config);
    tracing::info!(%addr, models = ?names, model = %model_name, "vllm-stub listening; model: {location}");
    let (failed_tx, mut failed_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    {
        // The model's files first (when it reads any), then the --lora-modules adapters, as
        // vLLM loads them once its engine is up.
        let state = state.clone();
        tokio::spawn(async move {
            if location.reads_files()
                && let Err(e) = load_model(location, model_name, state.clone()).await
            {
                let _ = failed_tx.send(e);
                return;
            }
            if let Err(e) = state.load_static_adapters().await {
                tracing::error!("cannot load --lora-modules: {e}");
                let _ = failed_tx.send(anyhow::anyhow!("cannot load --lora-modules: {e}"));
            }
        });
    }

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(vllm_stub::serve(listener, state.clone(), async move {
        let _ = first_rx.await;
    }));
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
        Ok(e) = &mut failed_rx => return Err(e),
    }
    tracing::info!(
        running = state.running(),
        waiting = state.waiting(),
        "signal received: no new connections, finishing in-flight requests"
    );
    let _ = first_tx.send(());
    tokio::select! {
        r = server => {
            r.context("server task")?.context("serving")?;
            tracing::info!("all requests finished, exiting");
        }
        _ = tokio::time::sleep(args.shutdown_timeout) => {
            tracing::warn!(running = state.running(), "shutdown timeout passed, exiting with requests in flight");
        }
        _ = term.recv() => tracing::warn!("second signal, exiting at once"),
        _ = int.recv() => tracing::warn!("second signal, exiting at once"),
    }
    Ok(())
}

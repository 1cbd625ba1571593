//! `vllm-stub`: the command line of the CPU stand-in for vLLM's OpenAI server.
//!
//! Invoked like `vllm serve` is by the upstream stub runtime:
//! `vllm-stub --model=<path> --served-model-name=<name> [--host H] [--port 8000]`, timing from
//! `STUB_STARTUP_DELAY`, `STUB_TOKEN_COUNT`, `STUB_TOKEN_DELAY`. See `docs/gateway.md`,
//! section "The vLLM stand-in".

use std::{net::SocketAddr, time::Duration};

use anyhow::Context;
use clap::Parser;
use tokio::signal::unix::{SignalKind, signal};
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
    /// After SIGTERM, how long in-flight requests may run before the stub exits anyway.
    #[arg(long, env = "STUB_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = duration)]
    shutdown_timeout: Duration,
}

fn duration(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .json()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let config = StubConfig {
        model: args.model,
        served_model_names: args.served_model_name,
        startup_delay: args.startup_delay,
        token_count: args.token_count,
        token_delay: args.token_delay,
        max_num_seqs: args.max_num_seqs,
    };
    let addr = SocketAddr::new(args.host, args.port);
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr} (set --host/--port)"))?;
    let names = config.names();
    let state = StubState::new(config);
    tracing::info!(%addr, models = ?names, "vllm-stub listening");

    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(vllm_stub::serve(listener, state.clone(), async move {
        let _ = first_rx.await;
    }));
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
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

//! The process runtime every Hearth binary starts with (controller, webhook, gateway), so that
//! each sets itself up, stops and fails the same way:
//!
//! - [`main`]: installs the crypto provider and the log subscriber, runs the binary's `async`
//!   body on a multi-thread tokio runtime, and reports a failure in one shape: an `error` log
//!   event (the cause chain as one line) and `Error: …` on stderr, exit status 1.
//! - [`install_crypto_provider`]: ring as rustls's process-wide provider (the one provider
//!   the workspace builds). A different provider installed before is an error, not ignored.
//! - [`init_tracing`]: JSON or text lines on stdout; `RUST_LOG` (tracing-subscriber
//!   `EnvFilter` syntax) overrides the binary's default filter, and a malformed `RUST_LOG` is
//!   an error naming the variable.
//! - [`Signals`]: SIGTERM and SIGINT handlers, installed before the binary serves anything
//!   so that a process that could not stop gracefully never starts.

use std::fmt;
use std::future::Future;
use std::process::ExitCode;

use tokio::signal::unix::{Signal as UnixSignal, SignalKind, signal};

/// Why a process could not start: each names what failed and the fix where there is one.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// `rustls::crypto::CryptoProvider::install_default` refused ring: another provider was
    /// installed first.
    #[error(
        "installing ring as the TLS crypto provider: a different provider is installed already (Hearth builds rustls with ring only)"
    )]
    CryptoProvider,
    /// `RUST_LOG` is set but is not a tracing-subscriber filter.
    #[error(
        "RUST_LOG={value:?} is not a log filter: {reason}; use directives like \"info\" or \"info,kube=warn\""
    )]
    LogFilter {
        /// The variable's value.
        value: String,
        /// The parser's message.
        reason: String,
    },
    /// A global log subscriber was set before this one.
    #[error("installing the log subscriber: {0}")]
    Tracing(String),
    /// `sigaction(2)` for a termination signal failed.
    #[error("installing the {signal} handler: {source}")]
    Signal {
        /// `SIGTERM` or `SIGINT`.
        signal: &'static str,
        /// The system error.
        source: std::io::Error,
    },
    /// The tokio runtime could not be built (threads, an epoll instance).
    #[error("starting the tokio runtime: {0}")]
    Runtime(std::io::Error),
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// One JSON object per event (tracing-subscriber's `json` format), for log pipelines.
    Json,
    /// Human-readable lines.
    Text,
}

/// What [`main`] sets up before the body runs.
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    /// The log line format.
    pub log_format: LogFormat,
    /// The filter used when `RUST_LOG` is unset or empty, e.g. `"info,kube=warn"`.
    pub default_filter: &'static str,
}

/// Installs ring as rustls's process-wide crypto provider. Calling it again once ring is
/// installed is a no-op.
///
/// # Errors
/// [`StartError::CryptoProvider`] when a different provider was installed first.
pub fn install_crypto_provider() -> Result<(), StartError> {
    let ring = rustls::crypto::ring::default_provider();
    match ring.clone().install_default() {
        Ok(()) => Ok(()),
        Err(installed) if same_provider(&installed, &ring) => Ok(()),
        Err(_) => Err(StartError::CryptoProvider),
    }
}

/// Two providers are the same when they offer the same cipher suites and key exchanges (a
/// `CryptoProvider` has no identity of its own).
fn same_provider(a: &rustls::crypto::CryptoProvider, b: &rustls::crypto::CryptoProvider) -> bool {
    let suites = |p: &rustls::crypto::CryptoProvider| {
        p.cipher_suites
            .iter()
            .map(|s| s.suite())
            .collect::<Vec<_>>()
    };
    let groups = |p: &rustls::crypto::CryptoProvider| {
        p.kx_groups.iter().map(|g| g.name()).collect::<Vec<_>>()
    };
    suites(a) == suites(b) && groups(a) == groups(b)
}

/// The log filter: `RUST_LOG` when set and not empty, else `default`.
///
/// # Errors
/// [`StartError::LogFilter`] for a `RUST_LOG` that does not parse (a typo would otherwise
/// silently log nothing, or everything).
pub fn log_filter(
    rust_log: Option<&str>,
    default: &str,
) -> Result<tracing_subscriber::EnvFilter, StartError> {
    match rust_log.filter(|v| !v.trim().is_empty()) {
        Some(value) => tracing_subscriber::EnvFilter::builder()
            .parse(value)
            .map_err(|e| StartError::LogFilter {
                value: value.to_owned(),
                reason: e.to_string(),
            }),
        None => tracing_subscriber::EnvFilter::builder()
            .parse(default)
            .map_err(|e| StartError::LogFilter {
                value: default.to_owned(),
                reason: e.to_string(),
            }),
    }
}

/// Installs the global log subscriber: `format` lines on stdout, filtered by `RUST_LOG` or
/// `default_filter`.
///
/// # Errors
/// [`StartError::LogFilter`] for a bad `RUST_LOG`; [`StartError::Tracing`] when a subscriber
/// is installed already.
pub fn init_tracing(format: LogFormat, default_filter: &str) -> Result<(), StartError> {
    let rust_log = std::env::var("RUST_LOG").ok();
    let filter = log_filter(rust_log.as_deref(), default_filter)?;
    let builder = tracing_subscriber::fmt().with_env_filter(filter);
    let installed = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
    installed.map_err(|e| StartError::Tracing(e.to_string()))
}

/// The termination signal received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// `SIGTERM`: the kubelet stopping the pod.
    Terminate,
    /// `SIGINT`: Ctrl-C in a terminal.
    Interrupt,
}

impl fmt::Display for Signal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Signal::Terminate => "SIGTERM",
            Signal::Interrupt => "SIGINT",
        })
    }
}

/// SIGTERM and SIGINT handlers. A second signal after the first can be awaited again (e.g. to
/// cut a graceful drain short).
#[derive(Debug)]
pub struct Signals {
    term: UnixSignal,
    int: UnixSignal,
}

impl Signals {
    /// Installs both handlers. Must be called within a tokio runtime.
    ///
    /// # Errors
    /// [`StartError::Signal`] naming the signal whose handler could not be installed.
    pub fn install() -> Result<Self, StartError> {
        let install = |kind: SignalKind, name: &'static str| {
            signal(kind).map_err(|source| StartError::Signal {
                signal: name,
                source,
            })
        };
        Ok(Self {
            term: install(SignalKind::terminate(), "SIGTERM")?,
            int: install(SignalKind::interrupt(), "SIGINT")?,
        })
    }

    /// Waits for the next SIGTERM or SIGINT and logs it.
    pub async fn recv(&mut self) -> Signal {
        let got = tokio::select! {
            _ = self.term.recv() => Signal::Terminate,
            _ = self.int.recv() => Signal::Interrupt,
        };
        tracing::info!(signal = %got, "stopping");
        got
    }
}

/// Runs a binary: [`install_crypto_provider`], [`init_tracing`], then `body` on a
/// multi-thread tokio runtime. Returns the exit status: success, or 1 after reporting the
/// error (or the start failure) as an `error` log event and as `Error: <cause chain>` on
/// stderr. `body`'s error is printed with `{:#}`, which for `anyhow::Error` is the whole cause
/// chain on one line.
pub fn main<F, E>(setup: Setup, body: F) -> ExitCode
where
    F: Future<Output = Result<(), E>>,
    E: fmt::Display,
{
    match start(setup) {
        Ok(rt) => exit_code(rt.block_on(body)),
        Err(e) => exit_code(Err(e)),
    }
}

/// The exit status for a body's outcome, reporting an error with [`report`].
pub fn exit_code<E: fmt::Display>(outcome: Result<(), E>) -> ExitCode {
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report(&format!("{e:#}"));
            ExitCode::FAILURE
        }
    }
}

fn start(setup: Setup) -> Result<tokio::runtime::Runtime, StartError> {
    install_crypto_provider()?;
    init_tracing(setup.log_format, setup.default_filter)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(StartError::Runtime)
}

/// The one way a Hearth process reports that it is exiting on an error.
pub fn report(message: &str) {
    tracing::error!(error = %message, "exiting");
    eprintln!("Error: {message}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_filter_applies_when_rust_log_is_unset_or_empty() {
        for unset in [None, Some(""), Some("  ")] {
            let f = log_filter(unset, "info,kube=warn").unwrap();
            assert_eq!(f.to_string(), "kube=warn,info");
        }
        let f = log_filter(Some("debug"), "info").unwrap();
        assert_eq!(f.to_string(), "debug");
    }

    #[test]
    fn a_bad_rust_log_names_the_variable_and_the_fix() {
        let e = log_filter(Some("info,kube=loud"), "info").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("RUST_LOG=\"info,kube=loud\""), "{msg}");
        assert!(msg.contains("info,kube=warn"), "{msg}");
    }

    #[test]
    fn installing_ring_twice_is_fine() {
        install_crypto_provider().unwrap();
        install_crypto_provider().unwrap();
    }

    #[tokio::test]
    async fn signals_arrive_and_can_be_awaited_again() {
        let mut signals = Signals::install().unwrap();
        // Signals raised at this very process, whose handlers tokio now owns.
        let pid = std::process::id().to_string();
        for (sig, want) in [("-TERM", Signal::Terminate), ("-INT", Signal::Interrupt)] {
            std::process::Command::new("kill")
                .args([sig, &pid])
                .status()
                .unwrap();
            let got = tokio::time::timeout(std::time::Duration::from_secs(5), signals.recv())
                .await
                .unwrap();
            assert_eq!(got, want);
        }
    }

    #[test]
    fn a_failure_exits_with_status_one() {
        assert_eq!(exit_code(Err("boom")), ExitCode::FAILURE);
        assert_eq!(exit_code(Ok::<(), &str>(())), ExitCode::SUCCESS);
        let start = StartError::Signal {
            signal: "SIGTERM",
            source: std::io::Error::from_raw_os_error(22),
        };
        assert!(
            start
                .to_string()
                .starts_with("installing the SIGTERM handler: ")
        );
        assert_eq!(exit_code(Err(start)), ExitCode::FAILURE);
    }
}

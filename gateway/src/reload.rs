//! The reload loop of the files the gateway follows (API keys, the ExternalScaler's TLS files,
//! the admin tokens): mounted Secrets, which the kubelet swaps in place.

use std::time::Duration;

/// Calls `reload` every `interval` (the first time one interval from now) until the task is
/// dropped: `Ok(true)` (the files changed and are in force) is logged at info with `changed`,
/// an error at warn with `kept` (the previous content stays in force), `Ok(false)` not at all.
/// `interval` must not be zero (tokio's interval panics on it).
pub(crate) async fn every<E: std::fmt::Display>(
    interval: Duration,
    changed: &str,
    kept: &str,
    mut reload: impl FnMut() -> Result<bool, E>,
) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        match reload() {
            Ok(true) => tracing::info!("{changed}"),
            Ok(false) => {}
            Err(e) => tracing::warn!(error = %e, "{kept}"),
        }
    }
}

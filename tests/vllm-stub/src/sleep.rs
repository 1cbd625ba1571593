//! vLLM's sleep mode: `POST /sleep[?level=N]`, `POST /wake_up`, `GET /is_sleeping`.
//!
//! vLLM registers these development routes only with `VLLM_SERVER_DEV_MODE=1`, and its engine
//! sleeps only when started with `--enable-sleep-mode`; the stub serves them only with both
//! ([`StubConfig::sleep_endpoints`](crate::StubConfig::sleep_endpoints)) and answers `404`
//! otherwise, as for any unknown path.
//!
//! - `POST /sleep?level=1` (the default) offloads the weights to CPU memory and drops the KV
//!   cache, `level=2` drops both; the answer (`200`, empty, as vLLM's) comes once asleep, after
//!   `sleep_delay`. Another `level` is a `400` whose error names the parameter. Asleep at level 1,
//!   a sleep at level 2 drops the offloaded weights at once; any other sleep while asleep changes
//!   nothing.
//! - `POST /wake_up` answers `200` once awake: after `wake_delay` from level 1, after
//!   `startup_delay` + `wake_delay` from level 2, whose weights are loaded again (the model's
//!   files are not read again). Awake, it answers at once. vLLM's partial wake-up (`tags`) is
//!   refused with a `400`.
//! - `GET /is_sleeping`: `{"is_sleeping": true}` from the start of falling asleep until the
//!   engine is awake again: the span in which it serves nothing.
//!
//! Sleeps and wake-ups run one at a time in arrival order, each in a task of its own so that it
//! ends even if its client leaves. A wake-up that arrives while another is under way waits for
//! it and then finds the engine awake: concurrent wake-ups cost one wake ([`StubState::wake_ups`]).
//!
//! While the engine is not awake, completions are refused with `503` and a message saying it
//! sleeps (requests already generating finish); `/health` stays `200`, as vLLM's server is alive
//! while asleep, and `/v1/models` and `/metrics` keep answering. `vllm:engine_sleep_state` is
//! vLLM's gauge: `sleep_state="awake"` is 1 when awake, else `weights_offloaded` (level 1) or
//! `discard_all` (level 2) is.
//!
//! Before the model is ready the three routes answer `503`, like the rest of the API.
//!
//! LoRA adapters ([`crate::lora`]): loading one is refused with `503` while the engine is not
//! awake; waking from level 2 empties the adapters' CPU cache.

use std::{
    sync::{Arc, atomic::Ordering},
    time::Duration,
};

use axum::{
    Json,
    extract::{RawQuery, State},
    http::StatusCode,
    response::{IntoResponse, Response},
};
use serde_json::json;

use crate::{StubState, error, error_in, not_ready};

/// How deeply the engine sleeps (`?level=` of `POST /sleep`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SleepLevel {
    /// Level 1: the weights are offloaded to CPU memory, the KV cache is dropped.
    Offload,
    /// Level 2: the weights and the KV cache are dropped; waking loads the weights again.
    Discard,
}

impl SleepLevel {
    /// The level's number in vLLM's API: 1 or 2.
    pub fn number(self) -> u8 {
        match self {
            Self::Offload => 1,
            Self::Discard => 2,
        }
    }

    /// The level of `?level=<value>`: `"1"` or `"2"`.
    pub fn parse(value: &str) -> Option<Self> {
        match value {
            "1" => Some(Self::Offload),
            "2" => Some(Self::Discard),
            _ => None,
        }
    }
}

/// Where the engine is in sleep mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SleepState {
    /// Serving.
    Awake,
    /// `POST /sleep` is under way (`sleep_delay`).
    FallingAsleep(SleepLevel),
    /// Asleep at this level.
    Asleep(SleepLevel),
    /// `POST /wake_up` is under way, from this level.
    WakingUp(SleepLevel),
}

impl SleepState {
    /// Whether the engine is anywhere but awake: it serves no completions then.
    pub fn is_sleeping(self) -> bool {
        self != Self::Awake
    }

    /// The level being entered, slept at, or woken from; `None` when awake.
    pub fn level(self) -> Option<SleepLevel> {
        match self {
            Self::Awake => None,
            Self::FallingAsleep(l) | Self::Asleep(l) | Self::WakingUp(l) => Some(l),
        }
    }
}

/// Whether `VLLM_SERVER_DEV_MODE` (its value, `None` when unset) enables vLLM's development
/// endpoints. vLLM reads it as `bool(int(value))`: an integer, true unless 0; unset is false.
///
/// # Errors
/// A value that is not an integer, which vLLM refuses too.
pub fn parse_dev_mode(value: Option<&str>) -> Result<bool, String> {
    match value {
        None => Ok(false),
        Some(v) => v
            .trim()
            .parse::<i64>()
            .map(|n| n != 0)
            .map_err(|_| format!("VLLM_SERVER_DEV_MODE must be an integer (0 or 1), not {v:?}")),
    }
}

impl StubState {
    /// Where the engine is in sleep mode.
    pub fn sleep_state(&self) -> SleepState {
        *self.sleep.borrow()
    }

    /// Whether the engine is falling asleep, asleep or waking up (`GET /is_sleeping`).
    pub fn is_sleeping(&self) -> bool {
        self.sleep_state().is_sleeping()
    }

    /// A receiver that changes with each step of a sleep or wake-up.
    pub fn subscribe_sleep(&self) -> tokio::sync::watch::Receiver<SleepState> {
        self.sleep.subscribe()
    }

    /// Wake-ups from sleep completed so far; a wake-up of an awake engine does not count.
    pub fn wake_ups(&self) -> u64 {
        self.wake_ups.load(Ordering::SeqCst)
    }

    fn set_sleep(&self, s: SleepState) {
        self.sleep.send_replace(s);
    }
}

#[derive(Clone, Copy, Debug)]
enum Transition {
    Sleep(SleepLevel),
    Wake,
}

/// Runs `t` after the sleeps and wake-ups before it, in a task of its own: it completes even
/// when its client goes away, so the engine never stays half-way.
async fn transition(state: &Arc<StubState>, t: Transition) -> Result<(), tokio::task::JoinError> {
    let state = state.clone();
    tokio::spawn(async move {
        let _turn = state.transitions.lock().await;
        match (t, state.sleep_state()) {
            (Transition::Sleep(level), SleepState::Awake) => {
                let delay = state.config.sleep_delay;
                tracing::info!(
                    level = level.number(),
                    delay_ms = delay.as_millis() as u64,
                    "falling asleep (POST /sleep)"
                );
                state.set_sleep(SleepState::FallingAsleep(level));
                pause(delay).await;
                state.set_sleep(SleepState::Asleep(level));
                tracing::info!(level = level.number(), "asleep");
            }
            (Transition::Sleep(level), SleepState::Asleep(current)) if level > current => {
                state.set_sleep(SleepState::Asleep(level));
                tracing::info!(
                    level = level.number(),
                    "asleep at level 2: the offloaded weights are dropped"
                );
            }
            (Transition::Wake, SleepState::Asleep(level)) => {
                let delay = state.config.wake_delay(level);
                tracing::info!(
                    level = level.number(),
                    delay_ms = delay.as_millis() as u64,
                    "waking up (POST /wake_up)"
                );
                state.set_sleep(SleepState::WakingUp(level));
                pause(delay).await;
                if level == SleepLevel::Discard {
                    // The weights are loaded again: vLLM drops every LoRA adapter from its worker
                    // then, and loads each again on its next request.
                    state.lora.reset_cache();
                }
                state.wake_ups.fetch_add(1, Ordering::SeqCst);
                state.set_sleep(SleepState::Awake);
                tracing::info!("awake");
            }
            // A wake-up of an awake engine, a sleep no deeper than the current one. (The
            // states in between exist only while a transition holds the turn.)
            _ => {}
        }
    })
    .await
}

async fn pause(delay: Duration) {
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
}

/// The `503` for a completion while the engine is not awake, `None` when it is.
pub(crate) fn refuse_while_sleeping(state: &StubState) -> Option<Response> {
    let message = match state.sleep_state() {
        SleepState::Awake => return None,
        SleepState::FallingAsleep(l) => format!(
            "the engine is sleeping: falling asleep at level {}; POST /wake_up wakes it",
            l.number()
        ),
        SleepState::Asleep(l) => format!(
            "the engine is sleeping (level {}); POST /wake_up wakes it",
            l.number()
        ),
        SleepState::WakingUp(l) => format!(
            "the engine is sleeping: waking up from level {}",
            l.number()
        ),
    };
    Some(error(
        StatusCode::SERVICE_UNAVAILABLE,
        &message,
        "ServiceUnavailableError",
    ))
}

/// The values of the query parameter `name` in `query`, in order.
fn query_values<'q>(query: Option<&'q str>, name: &'q str) -> impl Iterator<Item = &'q str> {
    query
        .unwrap_or_default()
        .split('&')
        .filter_map(move |pair| match pair.split_once('=') {
            Some((k, v)) if k == name => Some(v),
            None if pair == name => Some(""),
            _ => None,
        })
}

fn transition_failed(e: &tokio::task::JoinError) -> Response {
    error(
        StatusCode::INTERNAL_SERVER_ERROR,
        &format!("the sleep mode transition failed: {e}"),
        "InternalServerError",
    )
}

/// `POST /sleep[?level=N]`.
pub(crate) async fn sleep(
    State(state): State<Arc<StubState>>,
    RawQuery(query): RawQuery,
) -> Response {
    if !state.is_ready() {
        return not_ready();
    }
    // As Starlette's `query_params.get`, the last value counts.
    let level = match query_values(query.as_deref(), "level").last() {
        None => SleepLevel::Offload,
        Some(v) => match SleepLevel::parse(v) {
            Some(l) => l,
            None => {
                return error_in(
                    StatusCode::BAD_REQUEST,
                    &format!(
                        "invalid sleep level {v:?} in query parameter `level`: allowed values \
                         are 1 (offload the weights to CPU memory, drop the KV cache) and 2 \
                         (drop the weights and the KV cache)"
                    ),
                    "BadRequestError",
                    Some("level"),
                );
            }
        },
    };
    match transition(&state, Transition::Sleep(level)).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => transition_failed(&e),
    }
}

/// `POST /wake_up`.
pub(crate) async fn wake_up(
    State(state): State<Arc<StubState>>,
    RawQuery(query): RawQuery,
) -> Response {
    if !state.is_ready() {
        return not_ready();
    }
    if query_values(query.as_deref(), "tags").next().is_some() {
        return error_in(
            StatusCode::BAD_REQUEST,
            "the stub wakes the whole engine only: query parameter `tags` (a partial wake-up) \
             is not supported",
            "BadRequestError",
            Some("tags"),
        );
    }
    match transition(&state, Transition::Wake).await {
        Ok(()) => StatusCode::OK.into_response(),
        Err(e) => transition_failed(&e),
    }
}

/// `GET /is_sleeping`.
pub(crate) async fn is_sleeping(State(state): State<Arc<StubState>>) -> Response {
    if !state.is_ready() {
        return not_ready();
    }
    Json(json!({"is_sleeping": state.is_sleeping()})).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dev_mode_reads_like_vllm() {
        assert_eq!(parse_dev_mode(None), Ok(false));
        assert_eq!(parse_dev_mode(Some("0")), Ok(false));
        assert_eq!(parse_dev_mode(Some("1")), Ok(true));
        assert_eq!(parse_dev_mode(Some(" 2 ")), Ok(true));
        assert!(
            parse_dev_mode(Some("true"))
                .unwrap_err()
                .contains("integer")
        );
        assert!(parse_dev_mode(Some("")).is_err());
    }

    #[test]
    fn levels_and_states() {
        assert_eq!(SleepLevel::parse("1"), Some(SleepLevel::Offload));
        assert_eq!(SleepLevel::parse("2"), Some(SleepLevel::Discard));
        for bad in ["", "0", "3", "01", "one", "1.0"] {
            assert_eq!(SleepLevel::parse(bad), None, "{bad:?}");
        }
        assert!(SleepLevel::Discard > SleepLevel::Offload);
        assert!(!SleepState::Awake.is_sleeping());
        for s in [
            SleepState::FallingAsleep(SleepLevel::Offload),
            SleepState::Asleep(SleepLevel::Discard),
            SleepState::WakingUp(SleepLevel::Offload),
        ] {
            assert!(s.is_sleeping(), "{s:?}");
            assert!(s.level().is_some());
        }
    }

    #[test]
    fn query_parameters() {
        let q = Some("a=1&level=2&tags&level=1");
        assert_eq!(query_values(q, "level").collect::<Vec<_>>(), ["2", "1"]);
        assert_eq!(query_values(q, "tags").collect::<Vec<_>>(), [""]);
        assert_eq!(query_values(None, "level").count(), 0);
    }

    #[test]
    fn wake_delay_after_level_2_includes_the_load() {
        let cfg = crate::StubConfig {
            startup_delay: Duration::from_millis(300),
            wake_delay: Duration::from_millis(40),
            ..crate::StubConfig::default()
        };
        assert_eq!(
            cfg.wake_delay(SleepLevel::Offload),
            Duration::from_millis(40)
        );
        assert_eq!(
            cfg.wake_delay(SleepLevel::Discard),
            Duration::from_millis(340)
        );
    }
}

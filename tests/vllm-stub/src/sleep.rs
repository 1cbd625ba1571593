//! vLLM's sleep mode: `POST /sleep[?level=N]`, `POST /wake_up[?tags=...]`, `GET /is_sleeping`,
//! and `POST /collective_rpc` for `reload_weights`.
//!
//! vLLM registers these development routes only with `VLLM_SERVER_DEV_MODE=1`, and its engine
//! sleeps only when started with `--enable-sleep-mode`; the stub serves them only with both
//! ([`StubConfig::sleep_endpoints`](crate::StubConfig::sleep_endpoints)) and answers `404`
//! otherwise, as for any unknown path.
//!
//! - `POST /sleep?level=1` (the default) offloads the weights to CPU memory and drops the KV
//!   cache, `level=2` drops both; the answer (`200`, empty, as vLLM's) comes once asleep, after
//!   `sleep_delay`. Another `level` is a `400` whose error names the parameter. Asleep at level 1,
//!   a sleep at level 2 drops the offloaded weights at once; any other sleep while asleep (even
//!   partly) changes nothing, as vLLM's executor ignores a sleep while it sleeps.
//! - `POST /wake_up` wakes the memory of the tags named by `tags` (repeatable: `weights`,
//!   `kv_cache`; all when absent), as vLLM's executor does: `200` after `wake_delay`; the engine
//!   is awake once no tag sleeps. A tag that is not asleep (or unknown) makes the call do
//!   nothing (vLLM logs a warning and answers `200`), as does a wake-up of an awake engine.
//! - After level 2 the weights come back without their values: the engine answers noise (every
//!   token [`STALE_WEIGHTS_TOKEN`](crate::STALE_WEIGHTS_TOKEN)) until `POST /collective_rpc`
//!   `{"method": "reload_weights"}` loads them again (after `startup_delay`; the model's files
//!   are not read again). vLLM's documented level-2 wake-up is `tags=weights`, then
//!   `reload_weights`, then `tags=kv_cache`. The call is `409` while the weights sleep, `400`
//!   for a method the stub does not implement; it answers `{"results": [null]}`, one result per
//!   worker.
//! - `GET /is_sleeping`: `{"is_sleeping": true}` from the start of falling asleep until every
//!   tag is awake again: the span in which it serves nothing.
//!
//! Sleeps, wake-ups and reloads run one at a time in arrival order, each in a task of its own so
//! that it ends even if its client leaves. A wake-up that arrives while another is under way
//! waits for it and then finds the engine awake: concurrent wake-ups cost one wake
//! ([`StubState::wake_ups`]).
//!
//! While the engine is not awake, completions are refused with `503` and a message saying it
//! sleeps (requests already generating finish); `/health` stays `200`, as vLLM's server is alive
//! while asleep, and `/v1/models` and `/metrics` keep answering. `vllm:engine_sleep_state` is
//! vLLM's gauge: `sleep_state="awake"` is 1 when awake, else `weights_offloaded` (level 1) or
//! `discard_all` (level 2) is.
//!
//! Before the model is ready the routes answer `503`, like the rest of the API.
//!
//! LoRA adapters ([`crate::lora`]): loading one is refused with `503` while the engine is not
//! awake; waking the weights from level 2 empties the adapters' CPU cache.

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
    /// Woken partly (`POST /wake_up?tags=`): the tags of `asleep` still sleep.
    PartlyAwake {
        /// The level slept at.
        level: SleepLevel,
        /// The tags still asleep (never empty: then the engine is awake).
        asleep: Tags,
    },
}

/// vLLM's sleep tags: the memory of the weights and of the KV cache, woken one at a time with
/// `POST /wake_up?tags=<tag>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tags {
    /// `weights`.
    pub weights: bool,
    /// `kv_cache`.
    pub kv_cache: bool,
}

impl Tags {
    /// Both tags.
    pub const ALL: Self = Self {
        weights: true,
        kv_cache: true,
    };

    /// No tag.
    pub const NONE: Self = Self {
        weights: false,
        kv_cache: false,
    };

    /// The tags of `?tags=` values; `None` when one is not a tag vLLM knows.
    pub fn parse<'a>(values: impl IntoIterator<Item = &'a str>) -> Option<Self> {
        let mut t = Self::NONE;
        for v in values {
            match v {
                "weights" => t.weights = true,
                "kv_cache" => t.kv_cache = true,
                _ => return None,
            }
        }
        Some(t)
    }

    /// Whether every tag of `self` is in `other`.
    pub fn within(self, other: Self) -> bool {
        (!self.weights || other.weights) && (!self.kv_cache || other.kv_cache)
    }

    /// The tags of `self` that are not in `other`.
    pub fn without(self, other: Self) -> Self {
        Self {
            weights: self.weights && !other.weights,
            kv_cache: self.kv_cache && !other.kv_cache,
        }
    }

    /// Whether no tag is set.
    pub fn is_empty(self) -> bool {
        !self.weights && !self.kv_cache
    }

    fn names(self) -> String {
        [(self.weights, "weights"), (self.kv_cache, "kv_cache")]
            .iter()
            .filter(|(on, _)| *on)
            .map(|(_, n)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    }
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
            Self::FallingAsleep(l)
            | Self::Asleep(l)
            | Self::WakingUp(l)
            | Self::PartlyAwake { level: l, .. } => Some(l),
        }
    }

    /// The tags asleep: both when asleep, some when woken partly, none when awake. A sleep or
    /// wake-up under way counts as both (the engine serves nothing then).
    pub fn asleep(self) -> Tags {
        match self {
            Self::Awake => Tags::NONE,
            Self::PartlyAwake { asleep, .. } => asleep,
            _ => Tags::ALL,
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

    /// Whether the weights were dropped at sleep level 2 and not loaded again since (`POST
    /// /collective_rpc` `reload_weights`): completions answer noise then.
    pub fn weights_stale(&self) -> bool {
        self.weights_stale.load(Ordering::SeqCst)
    }

    fn set_sleep(&self, s: SleepState) {
        self.sleep.send_replace(s);
    }
}

#[derive(Clone, Copy, Debug)]
enum Transition {
    Sleep(SleepLevel),
    /// Wake these tags (all that sleep when `None`).
    Wake(Option<Tags>),
    /// `reload_weights`.
    Reload,
}

/// What a transition came to, for its answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Done {
    /// Done, or nothing to do (as vLLM answers both).
    Ok,
    /// `reload_weights` while the weights sleep.
    WeightsAsleep,
}

/// Runs `t` after the sleeps, wake-ups and reloads before it, in a task of its own: it
/// completes even when its client goes away, so the engine never stays half-way.
async fn transition(state: &Arc<StubState>, t: Transition) -> Result<Done, tokio::task::JoinError> {
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
                if level == SleepLevel::Discard {
                    state.weights_stale.store(true, Ordering::SeqCst);
                }
                state.set_sleep(SleepState::Asleep(level));
                tracing::info!(level = level.number(), "asleep");
            }
            (Transition::Sleep(level), SleepState::Asleep(current)) if level > current => {
                state.weights_stale.store(true, Ordering::SeqCst);
                state.set_sleep(SleepState::Asleep(level));
                tracing::info!(
                    level = level.number(),
                    "asleep at level 2: the offloaded weights are dropped"
                );
            }
            (
                Transition::Wake(tags),
                now @ (SleepState::Asleep(_) | SleepState::PartlyAwake { .. }),
            ) => {
                let asleep = now.asleep();
                let level = now.level().unwrap_or(SleepLevel::Offload);
                let waking = tags.unwrap_or(asleep);
                if waking.is_empty() || !waking.within(asleep) {
                    tracing::warn!(
                        requested = %waking.names(),
                        asleep = %asleep.names(),
                        "wake-up of tags that are not asleep: nothing done (as vLLM)"
                    );
                    return Done::Ok;
                }
                let delay = state.config.wake_delay();
                tracing::info!(
                    level = level.number(),
                    tags = %waking.names(),
                    delay_ms = delay.as_millis() as u64,
                    "waking up (POST /wake_up)"
                );
                state.set_sleep(SleepState::WakingUp(level));
                pause(delay).await;
                if level == SleepLevel::Discard && waking.weights {
                    // The weights' memory is back, their values are not: vLLM drops every LoRA
                    // adapter from its worker then, and loads each again on its next request.
                    state.lora.reset_cache();
                }
                let left = asleep.without(waking);
                if left.is_empty() {
                    state.wake_ups.fetch_add(1, Ordering::SeqCst);
                    state.set_sleep(SleepState::Awake);
                    tracing::info!(stale_weights = state.weights_stale(), "awake");
                } else {
                    state.set_sleep(SleepState::PartlyAwake {
                        level,
                        asleep: left,
                    });
                    tracing::info!(asleep = %left.names(), "partly awake");
                }
            }
            (Transition::Reload, now) if now.asleep().weights => return Done::WeightsAsleep,
            (Transition::Reload, _) => {
                let delay = state.config.reload_delay();
                tracing::info!(
                    delay_ms = delay.as_millis() as u64,
                    "loading the weights again (reload_weights)"
                );
                pause(delay).await;
                state.weights_stale.store(false, Ordering::SeqCst);
                tracing::info!("weights loaded");
            }
            // A wake-up of an awake engine, a sleep no deeper than the current one, a sleep
            // while woken partly. (The states in between exist only while a transition holds
            // the turn.)
            _ => {}
        }
        Done::Ok
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
        SleepState::PartlyAwake { level, asleep } => format!(
            "the engine is sleeping: woken partly from level {} ({} still asleep; POST \
             /wake_up?tags=... wakes it)",
            level.number(),
            asleep.names()
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
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => transition_failed(&e),
    }
}

/// `POST /wake_up[?tags=<tag>...]`.
pub(crate) async fn wake_up(
    State(state): State<Arc<StubState>>,
    RawQuery(query): RawQuery,
) -> Response {
    if !state.is_ready() {
        return not_ready();
    }
    // As Starlette's `query_params.getlist("tags")`; none means every tag. A value vLLM does not
    // know is not asleep either: nothing is woken, as vLLM's executor does.
    let values: Vec<&str> = query_values(query.as_deref(), "tags").collect();
    let tags = if values.is_empty() {
        None
    } else {
        Some(Tags::parse(values.iter().copied()).unwrap_or(Tags::NONE))
    };
    match transition(&state, Transition::Wake(tags)).await {
        Ok(_) => StatusCode::OK.into_response(),
        Err(e) => transition_failed(&e),
    }
}

/// The body of `POST /collective_rpc` (vLLM's fields; the stub reads `method`).
#[derive(serde::Deserialize)]
struct CollectiveRpc {
    method: String,
}

/// `POST /collective_rpc`: `reload_weights` only.
pub(crate) async fn collective_rpc(
    State(state): State<Arc<StubState>>,
    body: axum::body::Bytes,
) -> Response {
    if !state.is_ready() {
        return not_ready();
    }
    let rpc: CollectiveRpc = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return error_in(
                StatusCode::BAD_REQUEST,
                &format!("the body must be a JSON object with `method`: {e}"),
                "BadRequestError",
                Some("method"),
            );
        }
    };
    if rpc.method != "reload_weights" {
        return error_in(
            StatusCode::BAD_REQUEST,
            &format!(
                "the stub implements only the method reload_weights, not {:?}",
                rpc.method
            ),
            "BadRequestError",
            Some("method"),
        );
    }
    match transition(&state, Transition::Reload).await {
        Ok(Done::Ok) => Json(json!({"results": [null]})).into_response(),
        Ok(Done::WeightsAsleep) => error(
            StatusCode::CONFLICT,
            "the weights are asleep: POST /wake_up?tags=weights before reload_weights",
            "ConflictError",
        ),
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
    fn a_wake_up_is_the_wake_delay_and_a_reload_the_load() {
        let cfg = crate::StubConfig {
            startup_delay: Duration::from_millis(300),
            wake_delay: Duration::from_millis(40),
            ..crate::StubConfig::default()
        };
        assert_eq!(cfg.wake_delay(), Duration::from_millis(40));
        assert_eq!(cfg.reload_delay(), Duration::from_millis(300));
    }

    #[test]
    fn tags_parse_and_combine_like_vllms_sleeping_tags() {
        let weights = Tags::parse(["weights"]).unwrap();
        let kv = Tags::parse(["kv_cache"]).unwrap();
        assert_eq!(Tags::parse(["weights", "kv_cache"]), Some(Tags::ALL));
        assert_eq!(Tags::parse(["weights", "weights"]), Some(weights));
        for bad in [vec!["weight"], vec![""], vec!["weights", "kv"]] {
            assert_eq!(Tags::parse(bad.clone()), None, "{bad:?}");
        }
        assert!(weights.within(Tags::ALL) && !Tags::ALL.within(weights));
        assert_eq!(Tags::ALL.without(weights), kv);
        assert!(weights.without(weights).is_empty());
        assert_eq!(Tags::ALL.names(), "weights, kv_cache");
        assert!(SleepState::Awake.asleep().is_empty());
        assert_eq!(SleepState::Asleep(SleepLevel::Discard).asleep(), Tags::ALL);
        let partly = SleepState::PartlyAwake {
            level: SleepLevel::Discard,
            asleep: kv,
        };
        assert!(partly.is_sleeping());
        assert_eq!(
            (partly.asleep(), partly.level()),
            (kv, Some(SleepLevel::Discard))
        );
    }
}

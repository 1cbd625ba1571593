//! The sleeping tier: an idle model's engines are put to sleep (their accelerator memory freed,
//! the process and the pod kept) and woken on demand, in seconds instead of a full cold start.
//!
//! vLLM's sleep mode (engine started with `--enable-sleep-mode` and `VLLM_SERVER_DEV_MODE=1`):
//! `POST /sleep?level=1` offloads the weights to CPU memory and drops the KV cache, `level=2`
//! drops both; `POST /wake_up` brings the engine back; `GET /is_sleeping` answers
//! `{"is_sleeping": bool}`. The paths and the wake-up calls come from the InferenceRuntime's
//! `spec.sleepMode` (through the gateway's flags), so an engine with the same idea is data.
//!
//! One task per replica ([`SleepTask::run`]) keeps every discovered endpoint in one state of
//! [`State`] and lets only awake engines serve: the request path's [`EndpointSet`] is the
//! discovered set less the engines not known to be awake. A request that finds every engine
//! asleep is a cold request like any other: held (heartbeats for streams) or rejected as the
//! service's cold-start mode says, demand raised, forwarded once an engine is awake.
//!
//! - A newly discovered endpoint is asked `is_sleeping` before it serves: a gateway restarted
//!   while the model sleeps must not send it requests. An engine that does not answer is taken
//!   as awake (it is in the EndpointSlice, so it passed its readiness probe).
//! - When the demand summed over every gateway replica has been 0 for `after` (an unknown sum
//!   counts as demand), every awake engine leaves the set and is put to sleep.
//! - While this replica has demand (requests held or in flight, or the activation lease), every
//!   sleeping engine is woken: the wake-up calls run in order, and the engine serves again once
//!   each answered 2xx.
//! - A backend that answers `503` is asked `is_sleeping` ([`SleepTier::confirm_asleep`]):
//!   another gateway replica may have put it to sleep. The request is then held and sent again.
//! - A failed sleep or wake-up is retried with backoff ([`retry_delay`]: 1 s doubling to 30 s);
//!   after a failed sleep the engine is asked `is_sleeping` again, so it serves while awake.

use std::{
    collections::HashMap,
    str::FromStr,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use hearth_crds::wellknown::GATEWAY_FIELD_MANAGER;
use http::{Method, Request, StatusCode, header, uri::Authority};
use http_body_util::{BodyExt, Full, Limited};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff};
use tokio::sync::mpsc;

use crate::{
    demand::{DemandHub, DemandState},
    endpoints::EndpointSet,
    metrics::ModelMetrics,
    upstream::UpstreamPool,
};

/// How long `is_sleeping` may take before the engine is taken as awake.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest engine answer read (an `is_sleeping` document, an error message), in bytes.
const ANSWER_LIMIT: usize = 64 * 1024;

/// One HTTP call to the engine: `POST` with a JSON body when `body` is set, `POST` without a
/// body otherwise. Written `PATH` or `PATH BODY` on the command line
/// (`/collective_rpc {"method":"reload_weights"}`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineCall {
    /// Origin-form target: path and optional query (`/wake_up?tags=weights`).
    pub path_and_query: http::uri::PathAndQuery,
    /// JSON request body, sent with `Content-Type: application/json`.
    pub body: Option<String>,
}

impl FromStr for EngineCall {
    type Err = String;

    /// Parses `PATH` or `PATH BODY`; the path must start with `/`, the body must be JSON.
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        let (path, body) = match s.split_once(char::is_whitespace) {
            Some((path, body)) => (path, Some(body.trim())),
            None => (s, None),
        };
        if !path.starts_with('/') {
            return Err(format!(
                "{s:?}: the call must start with an absolute path, such as /wake_up or /collective_rpc {{\"method\":\"reload_weights\"}}"
            ));
        }
        let path_and_query = path
            .parse()
            .map_err(|e| format!("{path:?} is not a valid path and query: {e}"))?;
        if let Some(body) = body {
            serde_json::from_str::<serde_json::Value>(body)
                .map_err(|e| format!("the body of {path:?} is not JSON ({e}): {body:?}"))?;
        }
        Ok(Self {
            path_and_query,
            body: body.map(str::to_owned),
        })
    }
}

impl std::fmt::Display for EngineCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.body {
            Some(body) => write!(f, "{} {body}", self.path_and_query),
            None => write!(f, "{}", self.path_and_query),
        }
    }
}

/// The sleeping tier's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SleepConfig {
    /// vLLM's sleep level: `1` (weights offloaded to CPU memory) or `2` (weights dropped).
    pub level: u8,
    /// How long the summed demand must stay 0 before the engines are put to sleep.
    pub after: Duration,
    /// `POST <sleep_path>?level=<level>` puts an engine to sleep.
    pub sleep_path: String,
    /// `GET <is_sleeping_path>` answers `{"is_sleeping": bool}`.
    pub is_sleeping_path: String,
    /// Run in order to wake an engine, each answering 2xx.
    pub wake_up: Vec<EngineCall>,
    /// How long one sleep or wake-up call may take (a level-2 wake-up reloads the weights).
    pub call_timeout: Duration,
}

/// Why a call to the engine failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// No answer: connection refused or reset, or no answer within the call's timeout.
    #[error("{call}: {message}")]
    Unreachable {
        /// The call.
        call: String,
        /// What happened.
        message: String,
    },
    /// A status other than 2xx.
    #[error("{call}: the engine answered {status}: {body}")]
    Status {
        /// The call.
        call: String,
        /// The status.
        status: StatusCode,
        /// The start of the answer's body.
        body: String,
    },
    /// `is_sleeping` answered something other than `{"is_sleeping": bool}`.
    #[error("{call}: expected {{\"is_sleeping\": true|false}}, got {body}")]
    Malformed {
        /// The call.
        call: String,
        /// The start of the answer's body.
        body: String,
    },
}

/// Where one engine is, as this gateway replica knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Asked `is_sleeping`; not serving until it answers.
    Probing,
    /// Serving.
    Awake,
    /// `POST /sleep` sent; not serving.
    FallingAsleep,
    /// Asleep; woken on demand.
    Asleep,
    /// Wake-up calls under way; not serving.
    Waking,
}

/// What the tier asks its runner to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// `GET is_sleeping`.
    Probe(Authority),
    /// `POST sleep?level=N`.
    Sleep(Authority),
    /// The wake-up calls.
    WakeUp(Authority),
}

/// What came back from the engine.
#[derive(Debug)]
pub enum Outcome {
    /// `is_sleeping` answered (or did not).
    Probed(Authority, Result<bool, EngineError>),
    /// The sleep call finished.
    Slept(Authority, Result<(), EngineError>),
    /// The wake-up calls finished.
    Woke(Authority, Result<(), EngineError>, WakeTiming),
    /// Asked before waking, the engine said it was awake (another replica woke it): no
    /// wake-up call was sent.
    AlreadyAwake(Authority),
    /// Another replica put the engine to sleep (seen by the request path).
    FoundAsleep(Authority),
}

/// When one wake-up's steps happened, on this replica's monotonic clock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WakeTiming {
    /// Demand reached this replica while the engine slept (its local demand turned non-zero).
    pub demand: Instant,
    /// The wake-up calls started (after the `is_sleeping` check).
    pub calls: Instant,
    /// The last wake-up call answered (or one failed).
    pub done: Instant,
}

impl WakeTiming {
    /// How long the wake-up calls took.
    pub fn calls_took(&self) -> Duration {
        self.done.saturating_duration_since(self.calls)
    }

    /// The record of this wake for `status.lastWake`, `now` being [`Instant::now`] at
    /// `wall_now` (times in the status are wall-clock).
    pub fn record(
        &self,
        endpoint: &Authority,
        level: u8,
        gateway: Option<String>,
        now: Instant,
        wall_now: jiff::Timestamp,
    ) -> hearth_crds::Wake {
        let wall = |at: Instant| {
            let ago = now.saturating_duration_since(at);
            Time(wall_now.checked_sub(ago).unwrap_or(wall_now))
        };
        let go = hearth_crds::go_duration;
        hearth_crds::Wake {
            start_time: wall(self.demand),
            ready_time: wall(self.done),
            endpoint: endpoint.to_string(),
            level: i32::from(level),
            gateway,
            phases: hearth_crds::WakePhases {
                wake_decision: go(self.calls.saturating_duration_since(self.demand)),
                wake_up: go(self.calls_took()),
                total: go(self.done.saturating_duration_since(self.demand)),
            },
        }
    }
}

/// The shortest time between two probes of an engine asleep here ([`Tier::step`]).
pub const REPROBE_MIN: Duration = Duration::from_secs(5);

/// Delay before the next try after `failures` failed calls in a row: 1 s doubling to 30 s.
pub fn retry_delay(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(5)).min(Duration::from_secs(30))
}

#[derive(Debug, Clone, Copy)]
struct Engine {
    state: State,
    failures: u32,
    /// No sleep or wake-up is started before this.
    retry_at: Option<Instant>,
    /// An engine asleep here is asked its state again at this time (while this replica has no
    /// demand): another replica may have woken it, and only a replica that knows it awake
    /// puts it to sleep again.
    reprobe_at: Option<Instant>,
}

/// The state machine of every engine, without I/O: fed the discovered endpoints, the demand and
/// the calls' outcomes, it answers with [`Action`]s and the endpoints that may serve.
#[derive(Debug)]
pub struct Tier {
    after: Duration,
    engines: HashMap<Authority, Engine>,
    /// Since when the summed demand has been 0; `None` while there is demand.
    idle_since: Option<Instant>,
}

/// The demand the tier acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demand {
    /// Demand anywhere: some replica's, or an unknown sum.
    pub anywhere: bool,
    /// This replica's own: it wakes sleeping engines.
    pub here: bool,
}

impl Demand {
    /// From a replica's demand counters.
    pub fn of(state: &DemandState) -> Self {
        Self {
            anywhere: state.total().map_or(true, |t| t > 0),
            here: state.local() > 0,
        }
    }
}

impl Tier {
    /// A tier with no engine, idle since `now`.
    pub fn new(after: Duration, now: Instant) -> Self {
        Self {
            after,
            engines: HashMap::new(),
            idle_since: Some(now),
        }
    }

    /// The engine's state, if it is known.
    pub fn state(&self, authority: &Authority) -> Option<State> {
        self.engines.get(authority).map(|e| e.state)
    }

    /// Follows the discovered endpoints: new ones are probed, gone ones forgotten.
    pub fn discovered(&mut self, found: &[Authority]) -> Vec<Action> {
        self.engines.retain(|a, _| found.contains(a));
        let mut actions = Vec::new();
        for a in found {
            if !self.engines.contains_key(a) {
                self.engines.insert(
                    a.clone(),
                    Engine {
                        state: State::Probing,
                        failures: 0,
                        retry_at: None,
                        reprobe_at: None,
                    },
                );
                actions.push(Action::Probe(a.clone()));
            }
        }
        actions
    }

    /// Applies an outcome; may ask for a probe (after a failed sleep or wake-up).
    pub fn outcome(&mut self, outcome: &Outcome, now: Instant) -> Vec<Action> {
        let (authority, next, failed) = match outcome {
            Outcome::Probed(a, Ok(true)) | Outcome::FoundAsleep(a) => (a, State::Asleep, false),
            // Unanswered: it passed its readiness probe, so it serves.
            Outcome::Probed(a, _) => (a, State::Awake, false),
            Outcome::Slept(a, Ok(())) => (a, State::Asleep, false),
            Outcome::Woke(a, Ok(()), _) | Outcome::AlreadyAwake(a) => (a, State::Awake, false),
            Outcome::Slept(a, Err(_)) | Outcome::Woke(a, Err(_), _) => (a, State::Probing, true),
        };
        let Some(engine) = self.engines.get_mut(authority) else {
            return Vec::new();
        };
        // Only the answer to the call under way counts: a late report (a request's "found
        // asleep" while a wake-up runs, or a call to a replaced pod at the same address) is
        // stale.
        let expected = match outcome {
            Outcome::Probed(..) => State::Probing,
            Outcome::Slept(..) => State::FallingAsleep,
            Outcome::Woke(..) | Outcome::AlreadyAwake(_) => State::Waking,
            Outcome::FoundAsleep(_) => State::Awake,
        };
        if engine.state != expected {
            return Vec::new();
        }
        engine.state = next;
        engine.reprobe_at = (next == State::Asleep).then(|| now + self.after.max(REPROBE_MIN));
        if failed {
            engine.failures = engine.failures.saturating_add(1);
            engine.retry_at = Some(now + retry_delay(engine.failures));
            return vec![Action::Probe(authority.clone())];
        }
        if matches!(
            outcome,
            Outcome::Slept(..) | Outcome::Woke(..) | Outcome::AlreadyAwake(_)
        ) {
            engine.failures = 0;
            engine.retry_at = None;
        }
        Vec::new()
    }

    /// Acts on `demand` at `now`: wakes sleeping engines while this replica has demand, puts
    /// awake ones to sleep once the summed demand has been 0 for `after`, and asks an engine
    /// asleep here for `after` (at least [`REPROBE_MIN`]) its state again (another replica may
    /// have woken it).
    pub fn step(&mut self, demand: Demand, now: Instant) -> Vec<Action> {
        if demand.anywhere {
            self.idle_since = None;
        } else if self.idle_since.is_none() {
            self.idle_since = Some(now);
        }
        let sleepy = self
            .idle_since
            .is_some_and(|since| now.saturating_duration_since(since) >= self.after);
        let mut actions = Vec::new();
        for (a, engine) in &mut self.engines {
            if engine.retry_at.is_some_and(|t| t > now) {
                continue;
            }
            match engine.state {
                State::Asleep if demand.here => {
                    engine.state = State::Waking;
                    actions.push(Action::WakeUp(a.clone()));
                }
                State::Awake if sleepy => {
                    engine.state = State::FallingAsleep;
                    actions.push(Action::Sleep(a.clone()));
                }
                State::Asleep if engine.reprobe_at.is_some_and(|t| t <= now) => {
                    engine.state = State::Probing;
                    engine.reprobe_at = None;
                    actions.push(Action::Probe(a.clone()));
                }
                _ => {}
            }
        }
        actions
    }

    /// When [`Tier::step`] may have something new to do without a new input: the end of the
    /// idle period while an engine is awake, or the next retry.
    pub fn next_deadline(&self) -> Option<Instant> {
        let idle_end = self.idle_since.map(|since| since + self.after);
        self.engines
            .values()
            .filter_map(|e| match e.state {
                // Put to sleep at the end of the idle period, or after its back-off.
                State::Awake => idle_end.map(|end| e.retry_at.map_or(end, |r| r.max(end))),
                // Woken on demand, which wakes the task; after a failure, at its retry; asked
                // its state again at its re-probe.
                State::Asleep => [e.retry_at, e.reprobe_at].into_iter().flatten().min(),
                _ => None,
            })
            .min()
    }

    /// The engines that may serve: the awake ones.
    pub fn serving(&self) -> Vec<Authority> {
        self.count_with(|s| s == State::Awake)
    }

    /// How many engines are not awake: asleep, or on their way in or out of sleep.
    pub fn sleeping(&self) -> usize {
        self.count_with(|s| matches!(s, State::FallingAsleep | State::Asleep | State::Waking))
            .len()
    }

    fn count_with(&self, keep: impl Fn(State) -> bool) -> Vec<Authority> {
        self.engines
            .iter()
            .filter(|(_, e)| keep(e.state))
            .map(|(a, _)| a.clone())
            .collect()
    }
}

/// The request path's handle on the tier: reports a backend found asleep.
#[derive(Debug, Clone)]
pub struct SleepTier {
    engine: EngineClient,
    tx: mpsc::UnboundedSender<Outcome>,
}

impl SleepTier {
    /// Whether the engine at `authority`, which just answered `503`, is asleep; when it is, the
    /// tier stops sending it requests until it is woken. An engine that does not answer
    /// `is_sleeping` is not asleep (its `503` is its own).
    pub async fn confirm_asleep(&self, authority: &Authority) -> bool {
        match self.engine.is_sleeping(authority).await {
            Ok(true) => {
                let _ = self.tx.send(Outcome::FoundAsleep(authority.clone()));
                true
            }
            Ok(false) | Err(_) => false,
        }
    }
}

/// The engine's sleep API over the gateway's backend connections.
#[derive(Debug, Clone)]
struct EngineClient {
    cfg: Arc<SleepConfig>,
    pool: UpstreamPool,
}

impl EngineClient {
    /// One call; its answer's body when 2xx.
    async fn call(
        &self,
        authority: &Authority,
        method: Method,
        target: &str,
        body: Option<&str>,
        timeout: Duration,
    ) -> Result<Bytes, EngineError> {
        let name = format!("{method} http://{authority}{target}");
        let unreachable = |message: String| EngineError::Unreachable {
            call: name.clone(),
            message,
        };
        let mut req = Request::builder()
            .method(method)
            .uri(target)
            .header(header::HOST, authority.as_str());
        if body.is_some() {
            req = req.header(header::CONTENT_TYPE, "application/json");
        }
        let payload = Bytes::from(body.unwrap_or_default().to_owned());
        req = req.header(header::CONTENT_LENGTH, payload.len());
        let req = req
            .body(Full::new(payload))
            .map_err(|e| unreachable(format!("building the request: {e}")))?;
        let exchange = async {
            let resp = self
                .pool
                .send(authority, req)
                .await
                .map_err(|e| unreachable(e.to_string()))?;
            let status = resp.status();
            let bytes = Limited::new(resp.into_body(), ANSWER_LIMIT)
                .collect()
                .await
                .map_err(|e| unreachable(format!("reading the answer: {e}")))?
                .to_bytes();
            if status.is_success() {
                Ok(bytes)
            } else {
                Err(EngineError::Status {
                    call: name.clone(),
                    status,
                    body: excerpt(&bytes),
                })
            }
        };
        tokio::time::timeout(timeout, exchange)
            .await
            .unwrap_or_else(|_| Err(unreachable(format!("no answer within {timeout:?}"))))
    }

    async fn is_sleeping(&self, authority: &Authority) -> Result<bool, EngineError> {
        let path = &self.cfg.is_sleeping_path;
        let body = self
            .call(authority, Method::GET, path, None, PROBE_TIMEOUT)
            .await?;
        #[derive(serde::Deserialize)]
        struct Answer {
            is_sleeping: bool,
        }
        serde_json::from_slice::<Answer>(&body)
            .map(|a| a.is_sleeping)
            .map_err(|_| EngineError::Malformed {
                call: format!("GET http://{authority}{path}"),
                body: excerpt(&body),
            })
    }

    async fn sleep(&self, authority: &Authority) -> Result<(), EngineError> {
        let target = format!("{}?level={}", self.cfg.sleep_path, self.cfg.level);
        self.call(
            authority,
            Method::POST,
            &target,
            None,
            self.cfg.call_timeout,
        )
        .await
        .map(drop)
    }

    async fn wake_up(&self, authority: &Authority) -> Result<(), EngineError> {
        for call in &self.cfg.wake_up {
            self.call(
                authority,
                Method::POST,
                call.path_and_query.as_str(),
                call.body.as_deref(),
                self.cfg.call_timeout,
            )
            .await?;
        }
        Ok(())
    }
}

/// The first 200 characters of an answer, for errors.
fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body).chars().take(200).collect()
}

/// Where the tier reports on its LLMService: engines put to sleep and woken as Kubernetes
/// Events (`kubectl describe llmservice` lists them with the controller's `Activated`), by
/// kube-runtime's Recorder (events.k8s.io, aggregated into series), and the last wake in
/// `status.lastWake`. Event reasons: `EngineSlept`, `EngineWoken` (with the wake-up's seconds),
/// `WakeUpFailed` (Warning). Needs events.k8s.io `create` and `patch`, and `patch` on the
/// service's `llmservices/status` (the controller's Role for the gateway grants them).
#[derive(Clone)]
pub struct ServiceReporter {
    recorder: kube::runtime::events::Recorder,
    regarding: k8s_openapi::api::core::v1::ObjectReference,
    status: kube::Api<kube::api::DynamicObject>,
    instance: Option<String>,
}

impl std::fmt::Debug for ServiceReporter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServiceReporter")
            .field("regarding", &self.regarding)
            .field("instance", &self.instance)
            .finish_non_exhaustive()
    }
}

impl ServiceReporter {
    /// Reports on the LLMService `service` (with `uid`, which `kubectl describe` matches Events
    /// on) in `namespace`, as `hearth-gateway` from `instance` (the pod's name).
    pub fn new(
        client: kube::Client,
        namespace: &str,
        service: &str,
        uid: Option<String>,
        instance: Option<String>,
    ) -> Self {
        use hearth_crds::LLMService;
        use kube::Resource;
        let reporter = kube::runtime::events::Reporter {
            controller: GATEWAY_FIELD_MANAGER.to_owned(),
            instance: instance.clone(),
        };
        let resource = kube::api::ApiResource::erase::<LLMService>(&());
        Self {
            recorder: kube::runtime::events::Recorder::new(client.clone(), reporter),
            regarding: k8s_openapi::api::core::v1::ObjectReference {
                api_version: Some(LLMService::api_version(&()).into_owned()),
                kind: Some(LLMService::kind(&()).into_owned()),
                name: Some(service.to_owned()),
                namespace: Some(namespace.to_owned()),
                uid,
                ..Default::default()
            },
            status: kube::Api::namespaced_with(client, namespace, &resource),
            instance,
        }
    }

    /// Publishes one Event in the background; a failure is logged at debug (an Event is a
    /// courtesy, never a reason to stall the tier).
    fn publish(&self, warning: bool, reason: &'static str, note: String) {
        use kube::runtime::events::{Event, EventType};
        let this = self.clone();
        tokio::spawn(async move {
            let event = Event {
                type_: if warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: reason.to_owned(),
                note: Some(note),
                action: "SleepingTier".to_owned(),
                secondary: None,
            };
            if let Err(e) = this.recorder.publish(&event, &this.regarding).await {
                tracing::debug!(error = %e, reason, "publishing an engine Event failed");
            }
        });
    }

    /// Applies `wake` as `status.lastWake` in the background (server-side apply under
    /// [`GATEWAY_FIELD_MANAGER`], forced: every gateway replica writes the same field). A failure is
    /// logged as a warning and not retried: the next wake writes again.
    fn record_wake(&self, wake: hearth_crds::Wake) {
        let this = self.clone();
        tokio::spawn(async move {
            let Some(name) = this.regarding.name.as_deref() else {
                return;
            };
            let patch = serde_json::json!({
                "apiVersion": this.regarding.api_version,
                "kind": this.regarding.kind,
                "status": { "lastWake": wake },
            });
            let params = kube::api::PatchParams::apply(GATEWAY_FIELD_MANAGER).force();
            match this
                .status
                .patch_status(name, &params, &kube::api::Patch::Apply(&patch))
                .await
            {
                Ok(_) => tracing::debug!(endpoint = %wake.endpoint, "status.lastWake written"),
                Err(e) => {
                    tracing::warn!(error = %e, llmservice = name, "writing status.lastWake failed");
                }
            }
        });
    }
}

/// The tier's task: created with the gateway, started by its background work.
#[derive(Debug)]
pub struct SleepTask {
    engine: EngineClient,
    tx: mpsc::UnboundedSender<Outcome>,
    rx: mpsc::UnboundedReceiver<Outcome>,
    discovered: EndpointSet,
    serving: EndpointSet,
    demand: DemandHub,
    metrics: Arc<ModelMetrics>,
    reporter: Option<ServiceReporter>,
    /// Since when this replica has had demand; `None` while it has none.
    demand_since: Option<Instant>,
}

impl SleepTask {
    /// A task serving the awake engines of `discovered` through `serving`, and its handle.
    pub fn new(
        cfg: SleepConfig,
        pool: UpstreamPool,
        discovered: EndpointSet,
        serving: EndpointSet,
        demand: DemandHub,
        metrics: Arc<ModelMetrics>,
    ) -> (Self, SleepTier) {
        let engine = EngineClient {
            cfg: Arc::new(cfg),
            pool,
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let tier = SleepTier {
            engine: engine.clone(),
            tx: tx.clone(),
        };
        (
            Self {
                engine,
                tx,
                rx,
                discovered,
                serving,
                demand,
                metrics,
                reporter: None,
                demand_since: None,
            },
            tier,
        )
    }

    /// Runs the tier until the discovered set or the demand hub is dropped.
    pub async fn run(mut self) {
        let cfg = self.engine.cfg.clone();
        tracing::info!(
            level = cfg.level,
            after = ?cfg.after,
            sleep = %cfg.sleep_path,
            is_sleeping = %cfg.is_sleeping_path,
            wake_up = %cfg.wake_up.iter().map(ToString::to_string).collect::<Vec<_>>().join(", "),
            "sleeping tier on: idle engines are put to sleep and woken on demand"
        );
        let mut found = self.discovered.subscribe();
        let mut demand = self.demand.subscribe();
        let mut tier = Tier::new(cfg.after, Instant::now());
        loop {
            let now = Instant::now();
            let endpoints: Vec<Authority> = found
                .borrow_and_update()
                .iter()
                .map(|e| e.authority().clone())
                .collect();
            let mut actions = tier.discovered(&endpoints);
            while let Ok(outcome) = self.rx.try_recv() {
                self.observe(&tier, &outcome);
                actions.extend(tier.outcome(&outcome, now));
            }
            let wanted = Demand::of(&demand.borrow_and_update());
            self.demand_since = wanted.here.then(|| self.demand_since.unwrap_or(now));
            actions.extend(tier.step(wanted, now));
            for action in actions {
                self.start(action);
            }
            self.serving.replace(tier.serving());
            self.metrics.set_backends_sleeping(tier.sleeping());

            let deadline = tier.next_deadline();
            tokio::select! {
                changed = found.changed() => if changed.is_err() { return },
                changed = demand.changed() => if changed.is_err() { return },
                Some(outcome) = self.rx.recv() => {
                    self.observe(&tier, &outcome);
                    for action in tier.outcome(&outcome, Instant::now()) {
                        self.start(action);
                    }
                }
                () = sleep_until(deadline) => {}
            }
        }
    }

    /// Logs an outcome and counts it.
    fn observe(&self, tier: &Tier, outcome: &Outcome) {
        let m = &self.metrics;
        match outcome {
            Outcome::Probed(a, Ok(asleep)) => {
                tracing::debug!(endpoint = %a, asleep, "engine sleep state read");
                m.engine_call("is_sleeping", true);
            }
            Outcome::Probed(a, Err(e)) => {
                tracing::warn!(endpoint = %a, error = %e, "could not read the engine's sleep state; taking it as awake");
                m.engine_call("is_sleeping", false);
            }
            Outcome::Slept(a, Ok(())) => {
                tracing::info!(endpoint = %a, "engine put to sleep");
                m.engine_call("sleep", true);
                let cfg = &self.engine.cfg;
                self.event(
                    false,
                    "EngineSlept",
                    format!(
                        "engine {a} put to sleep (level {}) after {:?} without requests",
                        cfg.level, cfg.after
                    ),
                );
            }
            Outcome::Slept(a, Err(e)) => {
                tracing::warn!(endpoint = %a, error = %e, "putting the engine to sleep failed");
                m.engine_call("sleep", false);
            }
            Outcome::Woke(a, Ok(()), timing) => {
                let took = timing.calls_took();
                tracing::info!(endpoint = %a, took_ms = took.as_millis() as u64, "engine woken up");
                m.engine_call("wake_up", true);
                m.observe_phase("wake_up", took.as_secs_f64());
                let level = self.engine.cfg.level;
                if let Some(reporter) = &self.reporter {
                    reporter.publish(
                        false,
                        "EngineWoken",
                        format!(
                            "sleep→awake: engine {a} woke from level {level} in {:.2}s (wake-up calls)",
                            took.as_secs_f64()
                        ),
                    );
                    reporter.record_wake(timing.record(
                        a,
                        level,
                        reporter.instance.clone(),
                        Instant::now(),
                        jiff::Timestamp::now(),
                    ));
                }
            }
            Outcome::Woke(a, Err(e), _) => {
                tracing::warn!(endpoint = %a, error = %e, "waking the engine failed");
                m.engine_call("wake_up", false);
                self.event(
                    true,
                    "WakeUpFailed",
                    format!("waking engine {a} failed: {e}; retrying with backoff"),
                );
            }
            Outcome::AlreadyAwake(a) => {
                tracing::info!(endpoint = %a, "engine already awake (woken by another gateway replica); no wake-up call sent");
                m.engine_call("is_sleeping", true);
            }
            Outcome::FoundAsleep(a) => {
                if tier.state(a) == Some(State::Awake) {
                    tracing::info!(endpoint = %a, "engine found asleep (put to sleep by another gateway replica)");
                }
            }
        }
    }

    /// Reports on the LLMService (Events, `status.lastWake`) through `reporter`.
    pub fn report_to(&mut self, reporter: ServiceReporter) {
        self.reporter = Some(reporter);
    }

    fn event(&self, warning: bool, reason: &'static str, note: String) {
        if let Some(reporter) = &self.reporter {
            reporter.publish(warning, reason, note);
        }
    }

    /// Starts an engine call; its outcome comes back through the channel.
    fn start(&self, action: Action) {
        let engine = self.engine.clone();
        let tx = self.tx.clone();
        let demand = self.demand_since.unwrap_or_else(Instant::now);
        tokio::spawn(async move {
            let outcome = match action {
                Action::Probe(a) => {
                    let r = engine.is_sleeping(&a).await;
                    Outcome::Probed(a, r)
                }
                Action::Sleep(a) => {
                    let r = engine.sleep(&a).await;
                    Outcome::Slept(a, r)
                }
                Action::WakeUp(a) => {
                    // Another replica may have woken it since this one saw it asleep: ask
                    // first, so that a level-2 wake-up does not reload the weights twice. No
                    // answer is no answer: wake it.
                    if let Ok(false) = engine.is_sleeping(&a).await {
                        Outcome::AlreadyAwake(a)
                    } else {
                        let calls = Instant::now();
                        let r = engine.wake_up(&a).await;
                        let timing = WakeTiming {
                            demand,
                            calls,
                            done: Instant::now(),
                        };
                        Outcome::Woke(a, r, timing)
                    }
                }
            };
            let _ = tx.send(outcome);
        });
    }
}

/// Sleeps until `deadline`, or forever without one.
async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t.into()).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn a(s: &str) -> Authority {
        s.parse().unwrap()
    }

    /// A wake-up whose calls took 1 s, started 0.25 s after the demand at `t`.
    fn woke(t: Instant) -> WakeTiming {
        WakeTiming {
            demand: t,
            calls: t + Duration::from_millis(250),
            done: t + Duration::from_millis(1250),
        }
    }

    #[test]
    fn a_wake_is_recorded_in_wall_clock_time_with_its_phases() {
        let t = Instant::now();
        let timing = woke(t);
        let now = t + Duration::from_secs(2);
        let wall_now: jiff::Timestamp = "2026-12-03T10:00:02Z".parse().unwrap();
        let wake = timing.record(
            &a("198.18.0.7:8000"),
            1,
            Some("gw-0".to_owned()),
            now,
            wall_now,
        );
        assert_eq!(timing.calls_took(), Duration::from_secs(1));
        let at = |s: &str| Time(s.parse().unwrap());
        assert_eq!(wake.start_time, at("2026-12-03T10:00:00Z"));
        assert_eq!(wake.ready_time, at("2026-12-03T10:00:01.25Z"));
        assert_eq!(wake.endpoint, "198.18.0.7:8000");
        assert_eq!((wake.level, wake.gateway.as_deref()), (1, Some("gw-0")));
        assert_eq!(
            wake.phases,
            hearth_crds::WakePhases {
                wake_decision: "250ms".to_owned(),
                wake_up: "1s".to_owned(),
                total: "1.25s".to_owned(),
            }
        );
    }

    const IDLE: Demand = Demand {
        anywhere: false,
        here: false,
    };
    const HERE: Demand = Demand {
        anywhere: true,
        here: true,
    };
    const PEER: Demand = Demand {
        anywhere: true,
        here: false,
    };

    #[test]
    fn an_engine_another_replica_woke_serves_without_wake_up_calls() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::from_secs(60), t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(true)), t0);
        assert!(tier.serving().is_empty());
        // Stale: no wake-up under way.
        tier.outcome(&Outcome::AlreadyAwake(e.clone()), t0);
        assert!(tier.serving().is_empty());
        assert_eq!(tier.step(HERE, t0), [Action::WakeUp(e.clone())]);
        tier.outcome(&Outcome::AlreadyAwake(e.clone()), t0);
        assert_eq!(tier.serving(), std::slice::from_ref(&e));
        assert_eq!(tier.state(&e), Some(State::Awake));
    }

    #[test]
    fn an_engine_another_replica_woke_is_seen_awake_and_put_to_sleep_again() {
        let after = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut tier = Tier::new(after, t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(true)), t0);
        // Asleep here; another replica wakes it and serves with it. Nothing to do before `after`.
        assert!(tier.step(IDLE, t0 + after / 2).is_empty());
        assert_eq!(tier.next_deadline(), Some(t0 + after));
        // Then it is asked again, found awake, and put to sleep after `after` without demand.
        assert_eq!(tier.step(IDLE, t0 + after), [Action::Probe(e.clone())]);
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0 + after);
        assert_eq!(tier.serving(), std::slice::from_ref(&e));
        assert_eq!(tier.step(IDLE, t0 + after * 2), [Action::Sleep(e.clone())]);
        // Still asleep when asked: asked again one `after` later.
        tier.outcome(&Outcome::Slept(e.clone(), Ok(())), t0 + after * 2);
        assert!(tier.step(IDLE, t0 + after * 2).is_empty());
        assert_eq!(tier.step(IDLE, t0 + after * 3), [Action::Probe(e.clone())]);
        tier.outcome(&Outcome::Probed(e.clone(), Ok(true)), t0 + after * 3);
        assert_eq!(tier.next_deadline(), Some(t0 + after * 4));
        // Demand here wakes it rather than probing.
        assert_eq!(tier.step(HERE, t0 + after * 4), [Action::WakeUp(e.clone())]);
    }

    #[test]
    fn engine_calls_parse_path_and_json_body() {
        let plain: EngineCall = "/wake_up".parse().unwrap();
        assert_eq!(plain.path_and_query.as_str(), "/wake_up");
        assert_eq!(plain.body, None);
        let rpc: EngineCall = r#"/collective_rpc {"method": "reload_weights"}"#.parse().unwrap();
        assert_eq!(rpc.path_and_query.as_str(), "/collective_rpc");
        assert_eq!(rpc.body.as_deref(), Some(r#"{"method": "reload_weights"}"#));
        assert_eq!(
            "/wake_up?tags=weights"
                .parse::<EngineCall>()
                .unwrap()
                .to_string(),
            "/wake_up?tags=weights"
        );
        let e = "wake_up".parse::<EngineCall>().unwrap_err();
        assert!(e.contains("absolute path"), "{e}");
        let e = "/collective_rpc {method".parse::<EngineCall>().unwrap_err();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn retry_delay_doubles_to_thirty_seconds() {
        let secs: Vec<u64> = (1..=8).map(|n| retry_delay(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
    }

    #[test]
    fn new_endpoints_serve_only_once_known_awake() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::from_secs(60), t0);
        let e = a("198.18.0.1:8000");
        assert_eq!(
            tier.discovered(std::slice::from_ref(&e)),
            [Action::Probe(e.clone())]
        );
        assert!(tier.serving().is_empty());
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        assert_eq!(tier.serving(), std::slice::from_ref(&e));
        // Asleep when found: held until woken.
        let f = a("198.18.0.2:8000");
        tier.discovered(&[e.clone(), f.clone()]);
        tier.outcome(&Outcome::Probed(f.clone(), Ok(true)), t0);
        assert_eq!(tier.serving(), std::slice::from_ref(&e));
        assert_eq!(tier.sleeping(), 1);
        // Gone endpoints are forgotten.
        tier.discovered(std::slice::from_ref(&f));
        assert!(tier.serving().is_empty());
        assert_eq!(tier.state(&e), None);
    }

    #[test]
    fn an_unanswered_probe_counts_as_awake() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::from_secs(60), t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        let err = EngineError::Unreachable {
            call: "GET /is_sleeping".into(),
            message: "refused".into(),
        };
        tier.outcome(&Outcome::Probed(e.clone(), Err(err)), t0);
        assert_eq!(tier.serving(), [e]);
    }

    #[test]
    fn idle_for_after_puts_awake_engines_to_sleep_and_demand_wakes_them() {
        let t0 = Instant::now();
        let after = Duration::from_secs(60);
        let mut tier = Tier::new(after, t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        assert!(tier.step(IDLE, t0).is_empty());
        assert_eq!(tier.next_deadline(), Some(t0 + after));
        // Demand anywhere restarts the idle period.
        assert!(tier.step(PEER, t0 + Duration::from_secs(50)).is_empty());
        assert!(tier.step(IDLE, t0 + Duration::from_secs(51)).is_empty());
        assert!(tier.step(IDLE, t0 + Duration::from_secs(110)).is_empty());
        let t1 = t0 + Duration::from_secs(111);
        assert_eq!(tier.step(IDLE, t1), [Action::Sleep(e.clone())]);
        // Out of the serving set from the moment the sleep is sent.
        assert!(tier.serving().is_empty());
        assert_eq!(tier.state(&e), Some(State::FallingAsleep));
        tier.outcome(&Outcome::Slept(e.clone(), Ok(())), t1);
        // Next: asked its state again (another replica may wake it).
        assert_eq!(tier.next_deadline(), Some(t1 + after));
        // A peer's demand does not wake it: the peer does.
        assert!(tier.step(PEER, t1).is_empty());
        assert_eq!(tier.step(HERE, t1), [Action::WakeUp(e.clone())]);
        assert!(tier.serving().is_empty());
        assert!(tier.step(HERE, t1).is_empty(), "woken once");
        tier.outcome(&Outcome::Woke(e.clone(), Ok(()), woke(t0)), t1);
        assert_eq!(tier.serving(), [e]);
        assert!(tier.step(HERE, t1).is_empty());
    }

    #[test]
    fn demand_while_falling_asleep_wakes_once_asleep() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::ZERO, t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        assert_eq!(tier.step(IDLE, t0), [Action::Sleep(e.clone())]);
        assert!(tier.step(HERE, t0).is_empty());
        tier.outcome(&Outcome::Slept(e.clone(), Ok(())), t0);
        assert_eq!(tier.step(HERE, t0), [Action::WakeUp(e)]);
    }

    #[test]
    fn failed_calls_probe_again_and_back_off() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::ZERO, t0);
        let e = a("198.18.0.1:8000");
        let err = || EngineError::Status {
            call: "POST /wake_up".into(),
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body: "boom".into(),
        };
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(true)), t0);
        assert_eq!(tier.step(HERE, t0), [Action::WakeUp(e.clone())]);
        assert_eq!(
            tier.outcome(&Outcome::Woke(e.clone(), Err(err()), woke(t0)), t0),
            [Action::Probe(e.clone())]
        );
        tier.outcome(&Outcome::Probed(e.clone(), Ok(true)), t0);
        // Not again before the retry delay.
        assert!(tier.step(HERE, t0).is_empty());
        assert_eq!(tier.next_deadline(), Some(t0 + Duration::from_secs(1)));
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(tier.step(HERE, t1), [Action::WakeUp(e.clone())]);
        tier.outcome(&Outcome::Woke(e.clone(), Err(err()), woke(t0)), t1);
        tier.outcome(&Outcome::Probed(e.clone(), Ok(true)), t1);
        assert_eq!(tier.next_deadline(), Some(t1 + Duration::from_secs(2)));
        // A failed sleep leaves an engine that says it is awake serving.
        let mut tier = Tier::new(Duration::ZERO, t0);
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        assert_eq!(tier.step(IDLE, t0), [Action::Sleep(e.clone())]);
        tier.outcome(&Outcome::Slept(e.clone(), Err(err())), t0);
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        assert_eq!(tier.serving(), std::slice::from_ref(&e));
        assert!(tier.step(IDLE, t0).is_empty(), "backs off");
        assert_eq!(
            tier.step(IDLE, t0 + Duration::from_secs(1)),
            [Action::Sleep(e)]
        );
    }

    #[test]
    fn found_asleep_leaves_the_serving_set() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::from_secs(60), t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        tier.outcome(&Outcome::FoundAsleep(e.clone()), t0);
        assert!(tier.serving().is_empty());
        assert_eq!(tier.step(HERE, t0), [Action::WakeUp(e)]);
    }

    #[test]
    fn unknown_total_demand_keeps_engines_awake() {
        assert_eq!(Demand::of(&DemandHub::new(10, false).state()), IDLE);
        // Peers not discovered yet, or their discovery failing: the sum is unknown.
        let hub = DemandHub::new(10, true);
        assert_eq!(Demand::of(&hub.state()), PEER);
        hub.set_peers(Vec::new());
        assert_eq!(Demand::of(&hub.state()), IDLE);
        hub.set_peer_discovery_error("forbidden".into());
        assert_eq!(Demand::of(&hub.state()), PEER);
    }

    #[test]
    fn backing_off_after_a_failed_sleep_waits_for_the_retry() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::from_secs(60), t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(tier.step(IDLE, t1), [Action::Sleep(e.clone())]);
        let err = EngineError::Status {
            call: "POST /sleep".into(),
            status: StatusCode::NOT_FOUND,
            body: String::new(),
        };
        tier.outcome(&Outcome::Slept(e.clone(), Err(err)), t1);
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t1);
        assert!(tier.step(IDLE, t1).is_empty());
        // Not the idle period's end, long past: the loop would spin.
        assert_eq!(tier.next_deadline(), Some(t1 + Duration::from_secs(1)));
    }

    #[test]
    fn stale_outcomes_are_ignored() {
        let t0 = Instant::now();
        let mut tier = Tier::new(Duration::ZERO, t0);
        let e = a("198.18.0.1:8000");
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(true)), t0);
        assert_eq!(tier.step(HERE, t0), [Action::WakeUp(e.clone())]);
        // A request's late "found asleep" while waking starts no second wake-up.
        tier.outcome(&Outcome::FoundAsleep(e.clone()), t0);
        assert_eq!(tier.state(&e), Some(State::Waking));
        assert!(tier.step(HERE, t0).is_empty());
        tier.outcome(&Outcome::Woke(e.clone(), Ok(()), woke(t0)), t0);
        // The old pod's sleep, answered after a new pod took the address, is not the new one's.
        let mut tier = Tier::new(Duration::ZERO, t0);
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        assert_eq!(tier.step(IDLE, t0), [Action::Sleep(e.clone())]);
        tier.discovered(&[]);
        tier.discovered(std::slice::from_ref(&e));
        tier.outcome(&Outcome::Probed(e.clone(), Ok(false)), t0);
        tier.outcome(&Outcome::Slept(e.clone(), Ok(())), t0);
        assert_eq!(tier.serving(), std::slice::from_ref(&e));
    }
}

//! LoRA adapters served on demand: a request whose `model` names an adapter goes to its base
//! model's engines (the same queue, demand, tenants and cold start as the base), and the
//! adapter is loaded into the engine the request is sent to, when that engine does not have it.
//!
//! - **Input.** A model's adapters are an [`AdapterTable`] the controller writes: a
//!   single-service gateway follows its ConfigMap (`--adapters-configmap`, key
//!   [`ADAPTERS_KEY`], [`watch_adapters`]), a shared gateway takes each model's from its route
//!   (`ModelRoute.adapters`). A table is checked whole ([`check`]); one that does not parse or
//!   holds a value out of range is refused and the last good one stays. An adapter named like
//!   a model is left out (the model wins) and the clash logged.
//! - **Per engine** (backend endpoint), the gateway keeps the adapters the engine has, least
//!   recently used first (module `lru`). Before an adapter request is sent to an engine: loaded
//!   there, it is touched; otherwise, when the engine has `maxLoaded` loaded, the least
//!   recently used one that no request in flight on that engine uses is unloaded
//!   (`POST unloadPath {"lora_name"}`), then the adapter is loaded (`POST loadPath
//!   {"lora_name", "lora_path"}`). Requests for one adapter on one engine share one load; the
//!   calls that change an engine's adapters run one at a time per engine. A load answered `400`
//!   "has already been loaded" is a load.
//! - **What the engine says is true.** An engine that enters the serving set (discovered,
//!   ready again, or awake again after the sleeping tier woke it) is a new one to the gateway:
//!   its `GET /v1/models` is read once, before any call changes its adapters, and the entries
//!   with a `parent` are the adapters it has. An engine that leaves the set drops its state.
//!   An adapter that leaves the table is unloaded from every engine that has it.
//! - **Affinity.** An adapter request prefers a ready engine that has (or is loading) the
//!   adapter, while that engine has fewer requests of this replica in flight than its share of
//!   `containerConcurrency`; otherwise the usual least-outstanding choice
//!   ([`crate::endpoints::EndpointSet::pick_preferring`]).
//! - **Failures.** A load the engine refuses answers the request with the engine's status and
//!   an OpenAI error whose message starts "The adapter `x` could not be loaded: " and goes on
//!   with the engine's (`code: "adapter_load_failed"`); it is counted and logged with the
//!   adapter and the engine. The next request for the adapter loads it again (the requests
//!   that waited for the failed load share its answer). A connection refused is retried on
//!   another engine, as for any request. The last failed load of each adapter on each engine
//!   is kept ([`Adapters::failures`], served at
//!   [`hearth_crds::llmadapter::ADAPTER_FAILURES_PATH`]): the engine's status (`0` when it did
//!   not answer), its message and the time. It goes when a later load of the adapter on that
//!   engine succeeds (or the engine lists the adapter), when the engine leaves the serving set,
//!   and when the adapter leaves the table or its path changes.
//! - **Lost adapters.** Another gateway replica may unload an adapter from an engine this
//!   replica thinks has it: the engine then answers the request `404` "The model `x` does not
//!   exist." ([`engine_lost`]). Before anything reaches the client, the adapter is dropped from
//!   that engine's slots ([`AdapterUse::lost`]), loaded again through the same shared load, and
//!   the request sent once more to the same engine; a second `404` goes to the client.

mod catalog;
mod lru;

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::{Duration, Instant},
};

use arc_swap::ArcSwap;
use axum::response::Response;
use bytes::Bytes;
use hearth_crds::llmadapter::{ADAPTERS_KEY, AdapterLoadFailure, AdapterTable};
use http::{Method, Request, StatusCode, header, uri::Authority};
use http_body_util::{BodyExt, Full, Limited};
use tokio::sync::watch;

pub use catalog::{Adapter, AdapterTableError, Catalog, check, parse_adapter_table};
use lru::{Found, Lru};

use crate::{
    endpoints::{Endpoint, EndpointSet},
    metrics::ModelMetrics,
    upstream::UpstreamPool,
};

/// How long reading an engine's `/v1/models` may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest engine answer read (a model list, an error), in bytes.
const ANSWER_LIMIT: usize = 1024 * 1024;

/// The OpenAI error `code` of a request whose adapter could not be loaded.
pub const LOAD_FAILED_CODE: &str = "adapter_load_failed";

/// Why an adapter could not be loaded into an engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoadFailure {
    /// No connection to the engine: nothing was sent, another engine may take the request.
    Connect(String),
    /// The call was sent and got no answer (the connection broke, or the call's timeout).
    Broken(String),
    /// The engine refused: its status, error type and message.
    Refused {
        /// The engine's status.
        status: StatusCode,
        /// The engine's error type (`NotFoundError`), or the gateway's for its status.
        kind: String,
        /// The engine's message.
        message: String,
    },
}

impl LoadFailure {
    /// The status the engine answered, if it answered.
    pub fn status(&self) -> Option<StatusCode> {
        match self {
            Self::Refused { status, .. } => Some(*status),
            Self::Connect(_) | Self::Broken(_) => None,
        }
    }
}

impl std::fmt::Display for LoadFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Connect(m) | Self::Broken(m) => f.write_str(m),
            Self::Refused {
                status, message, ..
            } => write!(f, "{status}: {message}"),
        }
    }
}

/// What the client of a request whose adapter could not be loaded gets: the engine's status
/// (`502` when it did not answer) and an OpenAI error saying so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AdapterError {
    status: StatusCode,
    kind: String,
    message: String,
}

impl AdapterError {
    pub(crate) fn new(adapter: &str, failure: &LoadFailure) -> Self {
        let prefix = format!("The adapter `{adapter}` could not be loaded: ");
        match failure {
            LoadFailure::Refused {
                status,
                kind,
                message,
            } => Self {
                status: *status,
                kind: kind.clone(),
                message: format!("{prefix}{message}"),
            },
            LoadFailure::Connect(m) | LoadFailure::Broken(m) => Self {
                status: StatusCode::BAD_GATEWAY,
                kind: "server_error".to_owned(),
                message: format!("{prefix}the backend failed: {m}"),
            },
        }
    }

    /// The answer to the request.
    pub(crate) fn response(&self) -> Response {
        crate::openai::error_response_param(
            self.status,
            &self.message,
            &self.kind,
            Some("model"),
            Some(LOAD_FAILED_CODE),
        )
    }

    /// The SSE `error` event a held stream ends with.
    pub(crate) fn sse_event(&self) -> Bytes {
        crate::openai::sse_error_event_param(
            &self.message,
            &self.kind,
            Some("model"),
            Some(LOAD_FAILED_CODE),
        )
    }
}

/// An adapter of a model's catalog, as a request is routed to it.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The catalog the request was routed by (its load and unload calls, `maxLoaded`).
    pub(crate) catalog: Arc<Catalog>,
    /// The adapter.
    pub(crate) adapter: Arc<Adapter>,
}

/// How the request path calls engines: the pool, the model's series and name, the timeout.
#[derive(Debug, Clone)]
pub(crate) struct Caller {
    pub(crate) pool: UpstreamPool,
    pub(crate) metrics: Arc<ModelMetrics>,
    /// The base model's name (the `model` label).
    pub(crate) model: Arc<str>,
    /// How long one load or unload may take.
    pub(crate) timeout: Duration,
}

/// The answer a load's waiters get.
type LoadResult = Option<Result<(), LoadFailure>>;

/// One engine as the adapters see it.
#[derive(Debug)]
struct Engine {
    authority: Authority,
    /// The endpoint it was made for: an endpoint that leaves the serving set and comes back is
    /// another one, and so another engine (its adapters are read again).
    endpoint: Weak<Endpoint>,
    state: Mutex<EngineState>,
    /// Held by the calls that change the engine's adapters (and the first read of its list):
    /// one at a time.
    calls: tokio::sync::Mutex<()>,
}

#[derive(Debug, Default)]
struct EngineState {
    /// Its `/v1/models` was read.
    synced: bool,
    lru: Lru,
    /// The loads under way, for the requests that wait for them.
    loading: HashMap<Arc<str>, watch::Receiver<LoadResult>>,
    /// The last failed load of each adapter, by name, until a load of it succeeds here (or the
    /// engine lists it). Bounded by the table: at most one entry per adapter of the table, on
    /// an engine of the serving set. An adapter that leaves the table (or whose path changes)
    /// takes its entry with it ([`Adapters::track`], `retire`; one a request routed by the
    /// older table left behind is dropped at the next [`Adapters::failures`]), and the whole
    /// map goes with the engine when it leaves the serving set.
    failures: HashMap<Arc<str>, Failed>,
}

/// A failed load of one adapter on one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Failed {
    /// `<namespace>/<name>` of the LLMAdapter.
    object: String,
    /// The path the load asked for: an entry of an older path is not reported.
    path: String,
    /// The engine's status; `0` when it did not answer.
    status: u16,
    /// The engine's message (the gateway's when it did not answer).
    message: String,
    /// When it failed, RFC 3339 in UTC.
    time: String,
}

/// The most characters of an engine's message a remembered failure keeps.
const FAILURE_MESSAGE_CHARS: usize = 1024;

impl Failed {
    fn new(adapter: &Adapter, failure: &LoadFailure) -> Self {
        let message = match failure {
            LoadFailure::Connect(m) | LoadFailure::Broken(m) => m,
            LoadFailure::Refused { message, .. } => message,
        };
        // Kept short: it is reported to the controller, which puts it in a condition.
        let message = match message.char_indices().nth(FAILURE_MESSAGE_CHARS) {
            Some((cut, _)) => format!("{}…", &message[..cut]),
            None => message.clone(),
        };
        Self {
            object: adapter.object.clone(),
            path: adapter.path.clone(),
            status: failure.status().map_or(0, |s| s.as_u16()),
            message,
            time: rfc3339(k8s_openapi::jiff::Timestamp::now()),
        }
    }
}

/// `at` in RFC 3339, UTC, to the second (`2026-12-05T14:45:43Z`).
fn rfc3339(at: k8s_openapi::jiff::Timestamp) -> String {
    format!("{at:.0}")
}

impl Engine {
    fn new(endpoint: &Arc<Endpoint>) -> Self {
        Self {
            authority: endpoint.authority().clone(),
            endpoint: Arc::downgrade(endpoint),
            state: Mutex::new(EngineState::default()),
            calls: tokio::sync::Mutex::new(()),
        }
    }

    fn is(&self, endpoint: &Arc<Endpoint>) -> bool {
        std::ptr::eq(self.endpoint.as_ptr(), Arc::as_ptr(endpoint))
    }

    fn lock(&self) -> MutexGuard<'_, EngineState> {
        lock(&self.state)
    }

    /// Reads the engine's adapters from its `/v1/models` unless read already. The caller
    /// holds `calls`. A failure is logged; the next call tries again.
    async fn sync(&self, pool: &UpstreamPool, service: &str) {
        if self.lock().synced {
            return;
        }
        let listed = call(
            pool,
            &self.authority,
            Method::GET,
            "/v1/models",
            None,
            LIST_TIMEOUT,
        )
        .await
        .map_err(|e| e.to_string())
        .and_then(|body| {
            listed_adapters(&body).ok_or_else(|| {
                format!(
                    "not a model list: {}",
                    excerpt(&body).unwrap_or_else(|| "(empty)".into())
                )
            })
        });
        match listed {
            Ok(names) => {
                tracing::debug!(%service, engine = %self.authority, adapters = ?names, "engine's adapters read");
                let mut st = self.lock();
                st.lru.learn(&names);
                st.failures.retain(|n, _| !names.contains(n));
                st.synced = true;
            }
            Err(e) => {
                tracing::warn!(%service, engine = %self.authority, error = %e, "could not read the engine's adapters (GET /v1/models); reading them again before its next load");
            }
        }
    }
}

/// A request's hold on an adapter of one engine: the adapter is not unloaded from that engine
/// while it lives (it lives as long as the request's answer).
#[derive(Debug)]
pub(crate) struct AdapterUse {
    engine: Arc<Engine>,
    name: Arc<str>,
    id: u64,
}

impl AdapterUse {
    /// The engine answered that it does not have the adapter (another replica unloaded it,
    /// [`engine_lost`]): its slot is dropped, unless a load of it has already begun since, so
    /// the next claim loads it again (one load for every request that finds it lost).
    pub(crate) fn lost(self) {
        self.engine.lock().lru.lose(&self.name, self.id);
    }

    /// The adapter's name.
    pub(crate) fn name(&self) -> &Arc<str> {
        &self.name
    }

    /// The engine's address.
    pub(crate) fn engine(&self) -> &Authority {
        &self.engine.authority
    }
}

impl Drop for AdapterUse {
    fn drop(&mut self) {
        self.engine.lock().lru.release(&self.name, self.id);
    }
}

/// One model's adapters: its catalog, and per engine what is loaded.
#[derive(Debug)]
pub struct Adapters {
    catalog: ArcSwap<Catalog>,
    /// Bumped on every catalog change.
    changed: watch::Sender<u64>,
    engines: Mutex<HashMap<Authority, Arc<Engine>>>,
}

impl Default for Adapters {
    fn default() -> Self {
        Self::new()
    }
}

impl Adapters {
    /// No adapters, no engines.
    pub fn new() -> Self {
        Self {
            catalog: ArcSwap::from_pointee(Catalog::default()),
            changed: watch::channel(0).0,
            engines: Mutex::new(HashMap::new()),
        }
    }

    /// The catalog now (lock-free).
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.load_full()
    }

    /// Whether the model has no adapter (lock-free): its requests are not read for one.
    pub fn is_empty(&self) -> bool {
        self.catalog.load().is_empty()
    }

    /// Serves `catalog` from now on (requests already routed keep theirs).
    pub(crate) fn set_catalog(&self, catalog: Catalog) {
        if **self.catalog.load() == catalog {
            return;
        }
        self.catalog.store(Arc::new(catalog));
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// The adapter clients call `name`.
    pub(crate) fn target(&self, name: &str) -> Option<Target> {
        let catalog = self.catalog();
        let adapter = catalog.get(name)?.clone();
        Some(Target { catalog, adapter })
    }

    /// On how many engines of `serving` adapter `name` is loaded, as far as this replica knows.
    pub fn loaded_on(&self, name: &str, serving: &EndpointSet) -> usize {
        let serving = serving.snapshot();
        let engines = lock(&self.engines);
        serving
            .iter()
            .filter(|ep| {
                engines
                    .get(ep.authority())
                    .is_some_and(|e| e.is(ep) && e.lock().lru.is_loaded(name))
            })
            .count()
    }

    /// The adapters this replica knows the engine at `authority` has, least recently used
    /// first.
    pub fn loaded(&self, authority: &Authority) -> Vec<String> {
        self.engine_at(authority)
            .map(|e| {
                e.lock()
                    .lru
                    .loaded()
                    .iter()
                    .map(|n| n.to_string())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The last failed load of each adapter of the catalog on each engine of the serving set,
    /// sorted by adapter (`<namespace>/<name>`) and engine; `service` is left empty (the
    /// caller's to fill). Entries of an older path of an adapter are dropped here.
    pub fn failures(&self) -> Vec<AdapterLoadFailure> {
        let catalog = self.catalog();
        let engines: Vec<Arc<Engine>> = lock(&self.engines).values().cloned().collect();
        let mut out = Vec::new();
        for engine in engines {
            let mut st = engine.lock();
            st.failures
                .retain(|name, f| catalog.get(name).is_some_and(|a| a.path == f.path));
            out.extend(st.failures.iter().map(|(name, f)| AdapterLoadFailure {
                service: String::new(),
                adapter: f.object.clone(),
                name: name.to_string(),
                engine: engine.authority.to_string(),
                status: f.status,
                message: f.message.clone(),
                time: f.time.clone(),
            }));
        }
        out.sort_by(|a, b| (&a.adapter, &a.engine).cmp(&(&b.adapter, &b.engine)));
        out
    }

    /// Whether the engine at `authority` has adapter `name`, or is loading it (affinity).
    pub(crate) fn has(&self, authority: &Authority, name: &str) -> bool {
        self.engine_at(authority)
            .is_some_and(|e| e.lock().lru.has(name))
    }

    fn engine_at(&self, authority: &Authority) -> Option<Arc<Engine>> {
        lock(&self.engines).get(authority).cloned()
    }

    /// The engine of `endpoint`; a fresh one for an endpoint the map does not know (or knew as
    /// another endpoint at the same address).
    fn engine(&self, endpoint: &Arc<Endpoint>) -> Arc<Engine> {
        let mut engines = lock(&self.engines);
        if let Some(e) = engines.get(endpoint.authority())
            && e.is(endpoint)
        {
            return e.clone();
        }
        let e = Arc::new(Engine::new(endpoint));
        engines.insert(endpoint.authority().clone(), e.clone());
        e
    }

    /// Makes sure `target`'s adapter is loaded on the engine of `endpoint` and holds it there
    /// for the request: touched when loaded, else loaded (after unloading the least recently
    /// used idle ones past `maxLoaded`), sharing a load already under way.
    ///
    /// # Errors
    /// The load's failure: shared by every request that waited for it.
    pub(crate) async fn acquire(
        &self,
        target: &Target,
        endpoint: &Arc<Endpoint>,
        caller: &Caller,
    ) -> Result<AdapterUse, LoadFailure> {
        let engine = self.engine(endpoint);
        let name = target.adapter.name.clone();
        let (hold, mut wait, start) = {
            let mut st = engine.lock();
            let (id, found) = st.lru.claim(&name);
            let hold = AdapterUse {
                engine: engine.clone(),
                name: name.clone(),
                id,
            };
            match (found, st.loading.get(&name).cloned()) {
                (Found::Loaded, _) => (hold, None, None),
                (Found::Loading, Some(rx)) => (hold, Some(rx), None),
                // A slot being loaded always has its receiver; start one if it had none.
                (Found::Loading | Found::Absent, _) => {
                    let (tx, rx) = watch::channel(None);
                    st.loading.insert(name.clone(), rx.clone());
                    (hold, Some(rx), Some((id, tx)))
                }
            }
        };
        if let Some((id, tx)) = start {
            // A task of its own: the load finishes for the other waiters even if this
            // request's client leaves.
            tokio::spawn(load(engine, target.clone(), id, tx, caller.clone()));
        }
        if let Some(rx) = wait.as_mut() {
            let answer = rx
                .wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|r| r.clone());
            match answer {
                Some(Ok(())) => {}
                Some(Err(f)) => return Err(f),
                None => return Err(LoadFailure::Broken("the load was abandoned".to_owned())),
            }
        }
        Ok(hold)
    }

    /// Follows `serving` (the model's endpoints requests go to): an engine that enters it gets
    /// its adapters read (while the model has a catalog), one that leaves it is forgotten; and
    /// the catalog: an adapter that leaves it is unloaded from every engine that has it. Runs
    /// until the set is dropped.
    pub(crate) async fn track(self: Arc<Self>, serving: EndpointSet, caller: Caller) {
        let mut endpoints = serving.subscribe();
        let mut changes = self.changed.subscribe();
        let mut last = self.catalog();
        loop {
            let snapshot = endpoints.borrow_and_update().clone();
            changes.borrow_and_update();
            let catalog = self.catalog();
            let unsynced: Vec<Arc<Engine>> = {
                let mut engines = lock(&self.engines);
                engines.retain(|_, e| snapshot.iter().any(|ep| e.is(ep)));
                drop(engines);
                snapshot
                    .iter()
                    .map(|ep| self.engine(ep))
                    .filter(|e| !e.lock().synced)
                    .collect()
            };
            if !catalog.is_empty() {
                for engine in unsynced {
                    let caller = caller.clone();
                    tokio::spawn(async move {
                        let _calls = engine.calls.lock().await;
                        engine.sync(&caller.pool, caller.metrics.service()).await;
                    });
                }
            }
            // Adapters that left the table, and those whose files moved (a changed source under
            // the same name): an engine holding the old files unloads them, and the next
            // request loads the new ones.
            let left: Vec<Arc<str>> = last
                .adapters()
                .iter()
                .filter(|a| catalog.get(&a.name).is_none_or(|now| now.path != a.path))
                .map(|a| a.name.clone())
                .collect();
            if !left.is_empty() {
                let engines: Vec<Arc<Engine>> = lock(&self.engines).values().cloned().collect();
                for engine in &engines {
                    engine.lock().failures.retain(|n, _| !left.contains(n));
                }
                for engine in engines {
                    tokio::spawn(retire(engine, last.clone(), left.clone(), caller.clone()));
                }
            }
            last = catalog;
            tokio::select! {
                r = endpoints.changed() => if r.is_err() { return },
                r = changes.changed() => if r.is_err() { return },
            }
        }
    }
}

/// Unloads from `engine` the adapters of `left`, which left the catalog `old` or whose path
/// changed (requests in flight for one, admitted before the change, may fail), and forgets
/// their failed loads there.
async fn retire(engine: Arc<Engine>, old: Arc<Catalog>, left: Vec<Arc<str>>, caller: Caller) {
    let _calls = engine.calls.lock().await;
    for name in left {
        // A load of the old path that was under way has ended by now: its failure goes too.
        engine.lock().failures.remove(&name);
        if engine.lock().lru.forget(&name) {
            unload(&engine, &old, &name, &caller, "it left the adapter table").await;
        }
    }
}

/// Loads `target` into `engine` for the slot `id`, and tells the waiters through `tx`.
async fn load(
    engine: Arc<Engine>,
    target: Target,
    id: u64,
    tx: watch::Sender<LoadResult>,
    caller: Caller,
) {
    let name = target.adapter.name.clone();
    let service = caller.metrics.service().clone();
    // Whether the engine's answer (or list) decided the outcome: a failure is remembered, a
    // success forgets the last one.
    let mut engines_answer = true;
    let result = {
        let _calls = engine.calls.lock().await;
        engine.sync(&caller.pool, &service).await;
        if !engine.lock().lru.holds(&name, id) {
            // Retired while this load waited for the engine (it left the table): loading it
            // now would leave it on the engine, counted nowhere.
            engines_answer = false;
            Err(LoadFailure::Refused {
                status: StatusCode::NOT_FOUND,
                kind: "NotFoundError".to_owned(),
                message: format!("the adapter {name} left the adapter table"),
            })
        } else if engine.lock().lru.is_loaded(&name) {
            // The engine listed it: nothing to load.
            Ok(())
        } else {
            let catalog = &target.catalog;
            let victims = engine.lock().lru.evict_for(&name, catalog.max_loaded());
            for victim in victims {
                unload(&engine, catalog, &victim, &caller, "least recently used").await;
            }
            let started = Instant::now();
            let body = serde_json::json!({"lora_name": &*name, "lora_path": &target.adapter.path});
            let answer = call(
                &caller.pool,
                &engine.authority,
                Method::POST,
                catalog.load_path(),
                Some(body),
                caller.timeout,
            )
            .await;
            let result = match answer {
                Ok(_) => Ok(()),
                Err(CallError::Status { status, body })
                    if status == StatusCode::BAD_REQUEST
                        && String::from_utf8_lossy(&body).contains("has already been loaded") =>
                {
                    Ok(())
                }
                Err(e) => Err(e.into_failure()),
            };
            let took = started.elapsed();
            caller
                .metrics
                .adapter_load(&caller.model, &name, result.is_ok(), took.as_secs_f64());
            match &result {
                Ok(()) => tracing::info!(
                    %service,
                    adapter = %name,
                    engine = %engine.authority,
                    took_ms = u64::try_from(took.as_millis()).unwrap_or(u64::MAX),
                    "adapter loaded"
                ),
                Err(e) => tracing::warn!(
                    %service,
                    adapter = %name,
                    path = %target.adapter.path,
                    engine = %engine.authority,
                    error = %e,
                    "loading the adapter failed"
                ),
            }
            result
        }
    };
    {
        let mut st = engine.lock();
        st.lru.settle(&name, id, result.is_ok());
        match &result {
            Ok(()) => {
                st.failures.remove(&name);
            }
            Err(f) if engines_answer => {
                st.failures
                    .insert(name.clone(), Failed::new(&target.adapter, f));
            }
            Err(_) => {}
        }
        if st
            .loading
            .get(&name)
            .is_some_and(|rx| rx.same_channel(&tx.subscribe()))
        {
            st.loading.remove(&name);
        }
    }
    tx.send_replace(Some(result));
}

/// Unloads `victim` from `engine` (to make room, or it left the table: `why`). A victim the
/// engine does not have is gone already; another failure is logged (the engine then holds one
/// more than the gateway counts until it is read again).
async fn unload(
    engine: &Engine,
    catalog: &Catalog,
    victim: &Arc<str>,
    caller: &Caller,
    why: &'static str,
) {
    let service = caller.metrics.service();
    let body = serde_json::json!({"lora_name": &**victim});
    let answer = call(
        &caller.pool,
        &engine.authority,
        Method::POST,
        catalog.unload_path(),
        Some(body),
        caller.timeout,
    )
    .await;
    match answer {
        Ok(_) => {
            tracing::info!(%service, adapter = %victim, engine = %engine.authority, why, "adapter unloaded");
            // Series only for the catalog's adapters: labels come from the table.
            if catalog.get(victim).is_some() {
                caller.metrics.adapter_unload(&caller.model, victim);
            }
        }
        Err(CallError::Status { status, .. }) if status == StatusCode::NOT_FOUND => {
            tracing::debug!(%service, adapter = %victim, engine = %engine.authority, "adapter to unload was not loaded");
        }
        Err(e) => {
            tracing::warn!(%service, adapter = %victim, engine = %engine.authority, error = %e, "unloading the adapter failed");
        }
    }
}

/// Why an engine call failed.
#[derive(Debug, thiserror::Error)]
enum CallError {
    #[error("{0}")]
    Connect(String),
    #[error("{0}")]
    Broken(String),
    #[error("answered {status}: {}", excerpt(body).unwrap_or_default())]
    Status { status: StatusCode, body: Bytes },
}

impl CallError {
    fn into_failure(self) -> LoadFailure {
        match self {
            Self::Connect(m) => LoadFailure::Connect(m),
            Self::Broken(m) => LoadFailure::Broken(m),
            Self::Status { status, body } => {
                let (kind, message) = engine_error(&body);
                let kind = kind.unwrap_or_else(|| {
                    if status.is_client_error() {
                        "invalid_request_error".to_owned()
                    } else {
                        "server_error".to_owned()
                    }
                });
                LoadFailure::Refused {
                    status,
                    kind,
                    message: message.unwrap_or_else(|| format!("the engine answered {status}")),
                }
            }
        }
    }
}

/// One call to the engine at `authority`: its answer's body when 2xx.
async fn call(
    pool: &UpstreamPool,
    authority: &Authority,
    method: Method,
    target: &str,
    body: Option<serde_json::Value>,
    timeout: Duration,
) -> Result<Bytes, CallError> {
    let payload = body.map(|b| Bytes::from(b.to_string())).unwrap_or_default();
    let mut req = Request::builder()
        .method(method)
        .uri(target)
        .header(header::HOST, authority.as_str())
        .header(header::CONTENT_LENGTH, payload.len());
    if !payload.is_empty() {
        req = req.header(header::CONTENT_TYPE, "application/json");
    }
    let req = req
        .body(Full::new(payload))
        .map_err(|e| CallError::Broken(format!("building the request: {e}")))?;
    let exchange = async {
        let resp = pool.send(authority, req).await.map_err(|e| {
            if e.is_connect() {
                CallError::Connect(e.to_string())
            } else {
                CallError::Broken(format!("the backend failed: {e}"))
            }
        })?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), ANSWER_LIMIT)
            .collect()
            .await
            .map_err(|e| CallError::Broken(format!("reading the answer: {e}")))?
            .to_bytes();
        if status.is_success() {
            Ok(body)
        } else {
            Err(CallError::Status { status, body })
        }
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| Err(CallError::Broken(format!("no answer within {timeout:?}"))))
}

/// The error type and message of an engine's error answer: OpenAI's `{"error": {...}}`, or
/// vLLM's older flat `{"object": "error", "message", "type"}`.
fn engine_error(body: &[u8]) -> (Option<String>, Option<String>) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(body) else {
        return (None, excerpt(body));
    };
    let e = v.get("error").filter(|e| e.is_object()).unwrap_or(&v);
    let field = |k: &str| e.get(k).and_then(|m| m.as_str()).map(str::to_owned);
    (field("type"), field("message").or_else(|| excerpt(body)))
}

/// Whether an engine's `404` answer to an adapter request says it does not know the model
/// (vLLM's "The model `x` does not exist.", OpenAI's or the older flat error): the engine
/// does not have the adapter.
pub(crate) fn engine_lost(body: &[u8]) -> bool {
    engine_error(body)
        .1
        .is_some_and(|m| m.contains("does not exist"))
}

/// The first 300 characters of an answer; `None` when empty.
fn excerpt(body: &[u8]) -> Option<String> {
    let text: String = String::from_utf8_lossy(body).chars().take(300).collect();
    let text = text.trim();
    (!text.is_empty()).then(|| text.to_owned())
}

/// The adapters in an engine's `/v1/models` answer: the entries with a `parent`, in order.
fn listed_adapters(body: &[u8]) -> Option<Vec<Arc<str>>> {
    #[derive(serde::Deserialize)]
    struct List {
        data: Vec<Card>,
    }
    #[derive(serde::Deserialize)]
    struct Card {
        id: String,
        #[serde(default)]
        parent: Option<String>,
    }
    let list: List = serde_json::from_slice(body).ok()?;
    Some(
        list.data
            .into_iter()
            .filter(|c| c.parent.is_some())
            .map(|c| Arc::from(c.id))
            .collect(),
    )
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Follows the ConfigMap `name` in `namespace` (a single-service gateway's
/// `--adapters-configmap`) and applies the adapter table under its key [`ADAPTERS_KEY`] to
/// `gateway`, until the task is dropped: the same watch as the routes ConfigMap's
/// (`crate::configmap::follow`).
///
/// - Until the ConfigMap exists, and after it is deleted, the model has no adapters.
/// - A table that does not parse, holds a value out of range, or a ConfigMap without the key,
///   is refused: the last good table stays, the error is logged naming the ConfigMap and the
///   JSON path, and counted in `hearth_gateway_adapter_table_errors_total`.
///
/// RBAC: `get`, `list`, `watch` on `configmaps` in `namespace` (restricted to the one name,
/// `resourceNames`, since the watch selects it by `metadata.name`).
pub async fn watch_adapters(
    client: kube::Client,
    namespace: String,
    name: String,
    gateway: crate::Gateway,
) {
    let what =
        crate::configmap::Followed::config_map("adapters ConfigMap", "no adapters are served");
    crate::configmap::follow::<k8s_openapi::api::core::v1::ConfigMap>(
        client,
        &namespace,
        &name,
        what,
        |configmap, change| {
            let result = match change {
                crate::configmap::Change::Object(cm) => {
                    match cm.data.as_ref().and_then(|d| d.get(ADAPTERS_KEY)) {
                        Some(json) => gateway.apply_adapters_json(json),
                        None => {
                            gateway.metrics().adapter_table_errors.inc();
                            Err(AdapterTableError::MissingKey)
                        }
                    }
                }
                crate::configmap::Change::Missing => {
                    gateway.clear_adapters();
                    return;
                }
            };
            match result {
                Ok(applied) => tracing::info!(
                    %configmap,
                    adapters = ?applied.adapters,
                    left_out = ?applied.left_out,
                    "adapter table applied"
                ),
                Err(e) => tracing::error!(
                    %configmap,
                    key = ADAPTERS_KEY,
                    path = e.path().unwrap_or(""),
                    error = %e,
                    "adapter table refused; the last good table stays"
                ),
            }
        },
    )
    .await;
}

/// What an applied adapter table changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdaptersApplied {
    /// The adapters served now, by name.
    pub adapters: Vec<String>,
    /// The table's adapters left out: their name is a model's.
    pub left_out: Vec<String>,
}

/// The catalog of a checked `table` of the model of service `service`, less the adapters whose
/// name `taken` says is a model's (or another's): those clashes are logged and returned.
pub(crate) fn catalog_for(
    table: &AdapterTable,
    service: &str,
    taken: impl Fn(&str) -> bool,
) -> (Catalog, Vec<String>) {
    let (catalog, clashes) = Catalog::new(table, taken);
    for name in &clashes {
        tracing::warn!(%service, adapter = %name, "an adapter has the name of a model; the model wins and the adapter is not served");
    }
    (catalog, clashes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_engines_list_gives_its_adapters() {
        let body = br#"{"object":"list","data":[
            {"id":"base","parent":null,"root":"/m"},
            {"id":"a","parent":"base","root":"/a"},
            {"id":"b","parent":"base"}]}"#;
        let names = listed_adapters(body).unwrap();
        let names: Vec<&str> = names.iter().map(|n| &**n).collect();
        assert_eq!(names, ["a", "b"]);
        assert!(listed_adapters(b"{}").is_none());
    }

    #[test]
    fn an_engines_error_keeps_its_status_type_and_message() {
        let e = CallError::Status {
            status: StatusCode::NOT_FOUND,
            body: Bytes::from_static(
                br#"{"error":{"message":"Loading lora x failed: No adapter found for /p","type":"NotFoundError","param":null,"code":404}}"#,
            ),
        }
        .into_failure();
        assert_eq!(
            e,
            LoadFailure::Refused {
                status: StatusCode::NOT_FOUND,
                kind: "NotFoundError".into(),
                message: "Loading lora x failed: No adapter found for /p".into(),
            }
        );
        let client = AdapterError::new("x", &e);
        assert_eq!(client.status, StatusCode::NOT_FOUND);
        assert_eq!(
            client.message,
            "The adapter `x` could not be loaded: Loading lora x failed: No adapter found for /p"
        );
        // vLLM's flat error, and a text answer.
        let flat = CallError::Status {
            status: StatusCode::BAD_REQUEST,
            body: Bytes::from_static(
                br#"{"object":"error","message":"rank","type":"BadRequestError"}"#,
            ),
        }
        .into_failure();
        assert_eq!(flat.status(), Some(StatusCode::BAD_REQUEST));
        assert!(
            matches!(&flat, LoadFailure::Refused { kind, message, .. } if kind == "BadRequestError" && message == "rank")
        );
        let text = CallError::Status {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            body: Bytes::from_static(b"boom"),
        }
        .into_failure();
        assert!(
            matches!(&text, LoadFailure::Refused { kind, message, .. } if kind == "server_error" && message == "boom")
        );
        let gone = AdapterError::new("x", &LoadFailure::Broken("reset".into()));
        assert_eq!(gone.status, StatusCode::BAD_GATEWAY);
    }

    #[test]
    fn a_failed_load_keeps_the_engines_status_and_message() {
        let adapter = Adapter {
            name: Arc::from("x"),
            path: "/adapters/x".into(),
            object: "ns/x".into(),
            unavailable: None,
        };
        let refused = LoadFailure::Refused {
            status: StatusCode::NOT_FOUND,
            kind: "NotFoundError".into(),
            message: "No adapter found for /adapters/x".into(),
        };
        let f = Failed::new(&adapter, &refused);
        assert_eq!(
            (
                f.status,
                f.message.as_str(),
                f.object.as_str(),
                f.path.as_str()
            ),
            (
                404,
                "No adapter found for /adapters/x",
                "ns/x",
                "/adapters/x"
            )
        );
        let t: k8s_openapi::jiff::Timestamp = f.time.parse().unwrap();
        assert!(f.time.ends_with('Z'), "{}", f.time);
        assert!(
            k8s_openapi::jiff::Timestamp::now()
                .duration_since(t)
                .as_secs()
                < 60
        );
        // No answer: status 0 and the gateway's message.
        let f = Failed::new(&adapter, &LoadFailure::Connect("connection refused".into()));
        assert_eq!((f.status, f.message.as_str()), (0, "connection refused"));
        // To the second, in UTC.
        let at: k8s_openapi::jiff::Timestamp = "2026-12-05T14:45:43.123456+01:00".parse().unwrap();
        assert_eq!(rfc3339(at), "2026-12-05T13:45:43Z");
    }

    #[test]
    fn an_engines_404_says_whether_it_lost_the_model() {
        assert!(engine_lost(
            br#"{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","param":null,"code":404}}"#
        ));
        assert!(engine_lost(
            br#"{"object":"error","message":"The model `x` does not exist.","type":"NotFoundError","code":404}"#
        ));
        assert!(!engine_lost(
            br#"{"error":{"message":"failure requested by x-stub-status","type":"StubError","code":404}}"#
        ));
        assert!(!engine_lost(b""));
        assert!(!engine_lost(b"<html>404 Not Found</html>"));
    }
}

//! One model behind the gateway: its settings ([`ModelConfig`]) and everything a gateway of its
//! own would hold for it ([`ModelState`]): the backend endpoints, the demand and its bounded
//! queue, the activation lease, the sleeping tier and the model's metric series.
//!
//! A single-service gateway has exactly one model, built from its flags; a shared gateway has
//! one per entry of its route table ([`crate::routes`]), each behaving as a single-service
//! gateway would. What is not per model stays with the replica ([`crate::gateway`]): API keys,
//! the body budget, the timer, the backend connection pools, `Via`, draining.
//!
//! A model leaving the table is dropped from it at once; requests already admitted keep their
//! [`Model`] (and so its state) until they finish. When the last one is gone the state drops,
//! which stops its tasks (the endpoint watch, the lease, the sleeping tier) and removes its
//! metric series.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use tokio::{sync::watch, task::AbortHandle};

use crate::{
    adapters::{Adapter, Adapters},
    config::ModelConfig,
    demand::{DemandHub, DemandState, Lease},
    endpoints::EndpointSet,
    metrics::{Metrics, ModelMetrics},
    sleep::{ServiceReporter, SleepTask, SleepTier},
    upstream::UpstreamPool,
};

/// One model: its settings and its state. Cheap to clone: a route table change that only
/// changes settings makes a new `Model` over the same [`ModelState`].
#[derive(Debug, Clone)]
pub struct Model {
    pub(crate) cfg: Arc<ModelConfig>,
    pub(crate) state: Arc<ModelState>,
    /// The route table entry it came from (shared mode).
    pub(crate) route: Option<Arc<hearth_crds::llmendpoint::ModelRoute>>,
}

/// Where a model stands, as `/v1/models` reports it (`hearth.state`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelStatus {
    /// An engine is ready (with the sleeping tier: awake).
    Ready,
    /// Demand is raised (a request held or in flight, or the activation lease, on any replica)
    /// and no engine is ready yet.
    Activating,
    /// Engines exist, none awake, no demand: the sleeping tier put them to sleep.
    Sleeping,
    /// No engine, no demand.
    Zero,
}

impl ModelStatus {
    /// The JSON value: `ready`, `activating`, `sleeping` or `zero`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Ready => "ready",
            Self::Activating => "activating",
            Self::Sleeping => "sleeping",
            Self::Zero => "zero",
        }
    }
}

impl Model {
    /// The model's settings.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// `<namespace>/<name>` of its LLMService (empty when unknown).
    pub fn key(&self) -> &str {
        &self.cfg.key
    }

    /// The name clients send in `model` (a shared gateway's route; the first served name of a
    /// single-service gateway, if any).
    pub fn name(&self) -> Option<&str> {
        self.cfg.served_model_names.first().map(String::as_str)
    }

    /// Whether clients may call it `name`: one of its served names or aliases.
    pub fn answers_to(&self, name: &str) -> bool {
        self.cfg.served_model_names.iter().any(|n| n == name)
            || self.cfg.aliases.iter().any(|n| n == name)
    }

    /// The name a request calling it `name` is forwarded under: its first served name when
    /// `name` is one of its aliases, else `None` (sent as it came).
    pub fn renamed_from(&self, name: &str) -> Option<&str> {
        if self.cfg.aliases.iter().any(|a| a == name) {
            self.name()
        } else {
            None
        }
    }

    /// Its served names, then its aliases: the names `GET /v1/models` lists.
    fn all_names(&self) -> impl Iterator<Item = &String> {
        self.cfg.served_model_names.iter().chain(&self.cfg.aliases)
    }

    /// The endpoints its requests go to (with the sleeping tier, the awake engines).
    pub fn backends(&self) -> &EndpointSet {
        &self.state.backends
    }

    /// The endpoints discovery feeds: every ready backend endpoint, awake or not.
    pub fn discovered(&self) -> &EndpointSet {
        &self.state.discovered
    }

    /// Its LoRA adapters: the catalog clients may call, and what each engine has loaded.
    pub fn adapters(&self) -> &Adapters {
        &self.state.adapters
    }

    /// Its demand counters and bounded queue.
    pub fn demand(&self) -> &DemandHub {
        &self.state.demand
    }

    /// Whether `other` shares this model's state (the same model, whatever its settings).
    pub fn same_state(&self, other: &Model) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// Where the model stands, and how many engines are ready.
    pub fn status(&self) -> (ModelStatus, usize) {
        let ready = self.state.backends.snapshot().len();
        let demand = self.state.demand.state();
        let status = if ready > 0 {
            ModelStatus::Ready
        } else if demand.active().unwrap_or(demand.local() > 0) {
            ModelStatus::Activating
        } else if self.state.sleep.is_some() && self.state.discovered.is_ready() {
            ModelStatus::Sleeping
        } else {
            ModelStatus::Zero
        };
        (status, ready)
    }

    /// How long an activation is expected to take: the last one this replica measured (demand
    /// raised until a ready engine was seen), else the one the route table reports.
    pub fn expected_wait(&self) -> Option<Duration> {
        self.state
            .lease
            .last_activation()
            .or(self.cfg.last_activation)
    }

    /// When this replica first served the model (its state was made), in seconds since the
    /// Unix epoch: `/v1/models`' `created`.
    pub fn created(&self) -> u64 {
        self.state.created
    }

    /// The demand state now.
    pub(crate) fn demand_state(&self) -> DemandState {
        self.state.demand.state()
    }

    /// The model's `/v1/models` entry.
    pub fn entry(&self) -> ModelEntry<'_> {
        self.entry_named(self.name().unwrap_or_default())
    }

    /// The model's `/v1/models` entry under the name `id` (one of its served names).
    pub fn entry_named<'a>(&'a self, id: &'a str) -> ModelEntry<'a> {
        let (status, ready) = self.status();
        ModelEntry {
            id,
            object: "model",
            created: self.created(),
            owned_by: "hearth",
            hearth: HearthModel {
                service: &self.cfg.key,
                state: status.as_str(),
                ready_replicas: ready,
                expected_wait_seconds: self.expected_wait().map(|d| d.as_secs_f64()),
            },
        }
    }
}

impl Model {
    /// The `/v1/models` entry of its adapter `adapter`.
    pub fn adapter_entry(&self, adapter: &Adapter) -> AdapterEntry {
        let loaded_replicas = self
            .state
            .adapters
            .loaded_on(&adapter.name, &self.state.backends);
        let state = match (&adapter.unavailable, loaded_replicas) {
            (Some(_), _) => "unavailable",
            (None, 0) => "available",
            (None, _) => "loaded",
        };
        AdapterEntry {
            id: adapter.name.to_string(),
            object: "model",
            created: self.created(),
            owned_by: "hearth",
            parent: self.name().unwrap_or_default().to_owned(),
            root: adapter.path.clone(),
            hearth: HearthAdapter {
                service: self.cfg.key.clone(),
                adapter: adapter.object.clone(),
                state,
                loaded_replicas,
                unavailable: adapter.unavailable.clone(),
            },
        }
    }

    /// The `/v1/models/{id}` answer of `id`: the model itself under one of its names, or one of
    /// its adapters.
    pub fn entry_for<'a>(&'a self, id: &'a str) -> Option<ListEntry<'a>> {
        if self.answers_to(id) {
            return Some(ListEntry::Model(self.entry_named(id)));
        }
        let catalog = self.state.adapters.catalog();
        let adapter = catalog.get(id)?;
        Some(ListEntry::Adapter(self.adapter_entry(adapter)))
    }

    /// Its adapters' `/v1/models` entries, in the table's order.
    fn adapter_entries(&self) -> impl Iterator<Item = ListEntry<'_>> {
        let catalog = self.state.adapters.catalog();
        let entries: Vec<_> = catalog
            .adapters()
            .iter()
            .map(|a| ListEntry::Adapter(self.adapter_entry(a)))
            .collect();
        entries.into_iter()
    }
}

/// A gateway's own answer to `GET /v1/models`: OpenAI's list of models.
#[derive(Debug, serde::Serialize)]
pub struct ModelList<'a> {
    /// Always `list`.
    pub object: &'static str,
    /// One entry per model of the route table, sorted by name, each followed by
    /// its aliases and its adapters.
    pub data: Vec<ListEntry<'a>>,
}

impl<'a> ModelList<'a> {
    /// The list of `models` (a shared gateway's), each model followed by its aliases and
    /// its adapters.
    pub fn of(models: &'a [Arc<Model>]) -> Self {
        Self {
            object: "list",
            data: models
                .iter()
                .flat_map(|m| {
                    std::iter::once(ListEntry::Model(m.entry()))
                        .chain(
                            m.cfg
                                .aliases
                                .iter()
                                .map(|a| ListEntry::Model(m.entry_named(a))),
                        )
                        .chain(m.adapter_entries())
                })
                .collect(),
        }
    }

    /// The list of a single-service gateway's model with adapters or aliases: one entry per
    /// served name and alias, then the adapters.
    pub fn single(model: &'a Model) -> Self {
        let names = model.all_names();
        Self {
            object: "list",
            data: names
                .map(|n| ListEntry::Model(model.entry_named(n)))
                .chain(model.adapter_entries())
                .collect(),
        }
    }
}

/// One entry of `GET /v1/models`: a model, or a LoRA adapter.
#[derive(Debug, serde::Serialize)]
#[serde(untagged)]
pub enum ListEntry<'a> {
    /// A model.
    Model(ModelEntry<'a>),
    /// An adapter, after its base model.
    Adapter(AdapterEntry),
}

/// One LoRA adapter of `GET /v1/models`: OpenAI's model object with vLLM's `parent` and
/// `root`, and Hearth's fields under `hearth`.
#[derive(Debug, serde::Serialize)]
pub struct AdapterEntry {
    /// The adapter's name, which clients send in `model`.
    pub id: String,
    /// Always `model`.
    pub object: &'static str,
    /// When this replica first served the base model, in seconds since the Unix epoch.
    pub created: u64,
    /// Always `hearth`.
    pub owned_by: &'static str,
    /// The base model's name.
    pub parent: String,
    /// The adapter's directory as the engine sees it.
    pub root: String,
    /// Hearth's view of the adapter.
    pub hearth: HearthAdapter,
}

/// Hearth's fields of an adapter's `/v1/models` entry.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HearthAdapter {
    /// `<namespace>/<name>` of the base LLMService.
    pub service: String,
    /// `<namespace>/<name>` of the LLMAdapter.
    pub adapter: String,
    /// `unavailable` (its engines cannot load it yet: requests for it are answered `503`),
    /// `loaded` (a ready engine has it, as this replica knows), or `available` (the next
    /// request loads it).
    pub state: &'static str,
    /// Engines ready to serve (awake) that have the adapter loaded, as this replica knows them.
    pub loaded_replicas: usize,
    /// Why it cannot be loaded yet (its route's `unavailable`); left out when it can.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// One model of `GET /v1/models` (and the answer to `GET /v1/models/{id}`): OpenAI's model
/// object and Hearth's fields under `hearth`.
#[derive(Debug, serde::Serialize)]
pub struct ModelEntry<'a> {
    /// The name clients send in `model`.
    pub id: &'a str,
    /// Always `model`.
    pub object: &'static str,
    /// When this replica first served the model, in seconds since the Unix epoch.
    pub created: u64,
    /// Always `hearth`.
    pub owned_by: &'static str,
    /// Hearth's view of the model.
    pub hearth: HearthModel<'a>,
}

/// Hearth's fields of a `/v1/models` entry.
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HearthModel<'a> {
    /// `<namespace>/<name>` of the LLMService.
    pub service: &'a str,
    /// `ready`, `activating`, `sleeping` or `zero` (see [`ModelStatus`]).
    pub state: &'static str,
    /// Engines ready to serve (with the sleeping tier: awake), as this replica sees them.
    pub ready_replicas: usize,
    /// The expected wait for a cold request, in seconds ([`Model::expected_wait`]); `null`
    /// until one activation was measured or reported.
    pub expected_wait_seconds: Option<f64>,
}

/// What the state of a model is built from, besides its settings.
#[derive(Debug, Clone)]
pub(crate) struct StateParts {
    /// The replica's instance (see [`DemandHub::instance`]).
    pub(crate) instance: u64,
    /// Demand is summed over peer replicas.
    pub(crate) aggregate: bool,
    /// `--activation-grace`.
    pub(crate) grace: Duration,
    /// The replica's metrics.
    pub(crate) metrics: Arc<Metrics>,
    /// The pool the sleeping tier calls engines through.
    pub(crate) pool: UpstreamPool,
    /// Announces rises of demand from 0 (shared mode's peer stream).
    pub(crate) rises: Option<Arc<watch::Sender<u64>>>,
    /// Gateway replicas (this one and its peers): the fair queues' bound is shared by them.
    pub(crate) gateways: Arc<std::sync::atomic::AtomicUsize>,
    /// Whether the replica has several tenants (the fair queues then keep a headroom).
    pub(crate) tenants: bool,
}

/// The state a gateway of the model's own would hold. Dropping it stops its tasks.
#[derive(Debug)]
pub struct ModelState {
    /// Fed by discovery.
    discovered: EndpointSet,
    /// Where requests go: `discovered`, or its awake engines with the sleeping tier.
    pub(crate) backends: EndpointSet,
    pub(crate) demand: DemandHub,
    pub(crate) lease: Lease,
    pub(crate) sleep: Option<SleepTier>,
    /// The sleeping tier's task until [`ModelState::start`].
    sleep_task: Mutex<Option<SleepTask>>,
    pub(crate) metrics: Arc<ModelMetrics>,
    /// Requests in flight bounded per ready replica, the rest queued fairly.
    pub(crate) fair: Arc<crate::fair::FairQueue>,
    /// Its LoRA adapters, and what each engine has loaded.
    pub(crate) adapters: Arc<Adapters>,
    /// The pool the adapters' background calls (an engine's first read, unloads of adapters
    /// that left the table) go through.
    pool: UpstreamPool,
    /// The model's name when the state was made: the `model` label of those calls.
    base: Arc<str>,
    /// How long one of those calls may take (the model's activation timeout).
    call_timeout: Duration,
    /// Seconds since the Unix epoch when the state was made.
    created: u64,
    /// The tasks started for the model; `None` until started.
    tasks: Mutex<Option<Vec<AbortHandle>>>,
}

impl ModelState {
    /// The state of a model configured by `cfg`, whose endpoints `discovered` is fed with.
    /// Nothing runs until [`ModelState::start`].
    pub(crate) fn new(cfg: &ModelConfig, discovered: EndpointSet, parts: &StateParts) -> Self {
        let metrics = Arc::new(ModelMetrics::new(parts.metrics.clone(), &cfg.key));
        let mut demand = DemandHub::with_instance(parts.instance, cfg.max_queue, parts.aggregate)
            .with_activation_counter(metrics.activation_events())
            .with_demand_to_ready(metrics.demand_to_ready());
        if let Some(rises) = &parts.rises {
            demand = demand.with_rises(rises.clone());
        }
        let lease = Lease::new(demand.clone(), cfg.activation_timeout, parts.grace);
        // With the sleeping tier, requests go to the awake engines among those discovered.
        let (backends, sleep, sleep_task) = match cfg.sleep.clone() {
            Some(sleep_cfg) => {
                let serving = EndpointSet::new();
                let (task, tier) = SleepTask::new(
                    sleep_cfg,
                    parts.pool.clone(),
                    discovered.clone(),
                    serving.clone(),
                    demand.clone(),
                    metrics.clone(),
                );
                (serving, Some(tier), Some(task))
            }
            None => (discovered.clone(), None, None),
        };
        let created = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let fair = crate::fair::FairQueue::with_tenants(
            cfg.container_concurrency,
            backends.clone(),
            parts.gateways.clone(),
            parts.tenants,
        );
        Self {
            discovered,
            fair,
            adapters: Arc::new(Adapters::new()),
            pool: parts.pool.clone(),
            base: Arc::from(cfg.served_model_names.first().map_or("", String::as_str)),
            call_timeout: cfg.activation_timeout,
            backends,
            demand,
            lease,
            sleep,
            sleep_task: Mutex::new(sleep_task),
            metrics,
            created,
            tasks: Mutex::new(None),
        }
    }

    /// Reports the sleeping tier's sleeps and wake-ups on the LLMService through `reporter`
    /// (no effect without a tier, or once started).
    pub(crate) fn report_to(&self, reporter: ServiceReporter) {
        if let Some(task) = lock(&self.sleep_task).as_mut() {
            task.report_to(reporter);
        }
    }

    /// Starts the lease expiry and the sleeping tier (when on), and keeps `more` (discovery's
    /// tasks) to stop with them. Needs a Tokio runtime; a second call only adds `more`.
    /// Outside a runtime nothing starts and `false` is returned.
    pub(crate) fn start(&self, more: Vec<AbortHandle>) -> bool {
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return false;
        };
        let mut tasks = lock(&self.tasks);
        let tasks = tasks.get_or_insert_with(|| {
            let mut started = vec![
                rt.spawn(self.lease.clone().run(self.backends.clone()))
                    .abort_handle(),
                rt.spawn(self.adapters.clone().track(
                    self.backends.clone(),
                    crate::adapters::Caller {
                        pool: self.pool.clone(),
                        metrics: self.metrics.clone(),
                        model: self.base.clone(),
                        timeout: self.call_timeout,
                    },
                ))
                .abort_handle(),
            ];
            if let Some(task) = lock(&self.sleep_task).take() {
                started.push(rt.spawn(task.run()).abort_handle());
            }
            started
        });
        tasks.extend(more);
        true
    }

    /// The endpoints discovery found (with the sleeping tier, asleep ones too).
    pub(crate) fn discovered(&self) -> &EndpointSet {
        &self.discovered
    }

    /// Whether [`ModelState::start`] ran.
    pub(crate) fn started(&self) -> bool {
        lock(&self.tasks).is_some()
    }
}

impl Drop for ModelState {
    fn drop(&mut self) {
        if let Some(tasks) = lock(&self.tasks).take() {
            for t in tasks {
                t.abort();
            }
        }
    }
}

/// Locks `m`, taking over a lock whose holder panicked (the values stay consistent).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

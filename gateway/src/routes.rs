//! The route table: which models a gateway serves, looked up by name (a shared gateway routes
//! each request by its `model`) or by service key (`<namespace>/<name>`: KEDA's `service`).
//!
//! A single-service gateway's table holds its one model, built from its flags, and never
//! changes. A shared gateway (`--routes-configmap`) starts with an empty table and applies
//! each [`RouteTable`] the controller writes into its ConfigMap ([`watch_routes`]), as data:
//!
//! - the table is checked whole first ([`model_configs`]); one that does not parse or holds a
//!   value out of range is refused, naming the JSON path of the field, and the last good table
//!   stays (`hearth_gateway_route_table_errors_total` counts refusals);
//! - a model is identified by its key. A key already served keeps its state (demand, queue,
//!   lease, endpoints, sleeping tier) when its backend Service, port name, namespace, sleeping
//!   tier and UID are unchanged: new settings (queue bound, cold-start mode, timeouts, the
//!   model name) apply to requests that arrive from then on. Otherwise it gets a fresh state,
//!   with a discovery watch of its own ([`BackendSource`]);
//! - a model that left the table is unknown at once (`404` for new requests); requests
//!   already admitted keep its state until they finish, then its tasks stop (see
//!   [`crate::model`]). A key that comes back with the same backends while they still hold
//!   its state takes that state again, so their demand is seen again.
//!
//! Readers load the table without a lock ([`ArcSwap`]); applying one is serialized, and so are
//! the peer replicas' demand updates, which a shared gateway keeps per peer to give every new
//! model its peers' current values at once (see [`crate::peers`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, Weak},
    time::Duration,
};

use arc_swap::ArcSwap;
use hearth_crds::llmendpoint::{ModelRoute, ROUTES_KEY, RouteTable};
use k8s_openapi::api::core::v1::ConfigMap;
use tokio::{sync::watch, task::AbortHandle};

use crate::{
    config::{ColdStartMode, ModelConfig},
    demand::DemandHub,
    discovery::{SliceSource, watch_endpoints},
    endpoints::EndpointSet,
    model::{Model, ModelState, StateParts},
    peers::{MAX_SHARED_LINE, PeerDemand, PeerSink},
    sleep::{EngineCall, ServiceReporter, SleepConfig},
};

/// Why a route table was refused. The table in force stays.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RoutesError {
    /// The JSON does not parse into a [`RouteTable`].
    #[error(
        "{path}: {message} (the route table is the JSON of hearth_crds::llmendpoint::RouteTable)"
    )]
    Json {
        /// The JSON path of the value at fault (`models[2].maxQueue`), `.` for the document.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// A value is out of range, or two entries claim one model name or service.
    #[error("{path}: {message}")]
    Invalid {
        /// The JSON path of the value at fault (`models[2].activationTimeout`).
        path: String,
        /// What is wrong and what it must be.
        message: String,
    },
    /// The ConfigMap exists without the table's key.
    #[error("the ConfigMap has no key {ROUTES_KEY:?}; it must hold the route table as JSON")]
    MissingKey,
    /// A single-service gateway serves the model of its flags; it takes no route table.
    #[error(
        "this gateway serves one service (--backend-service/--backend-url); only a shared gateway (--routes-configmap) takes a route table"
    )]
    SingleService,
}

impl RoutesError {
    /// The JSON path of the value at fault, when there is one.
    pub fn path(&self) -> Option<&str> {
        match self {
            Self::Json { path, .. } | Self::Invalid { path, .. } => Some(path),
            Self::MissingKey | Self::SingleService => None,
        }
    }
}

/// Parses a route table from its JSON (the ConfigMap's [`ROUTES_KEY`]).
///
/// # Errors
/// [`RoutesError::Json`] with the path of the value that does not fit.
pub fn parse_route_table(json: &str) -> Result<RouteTable, RoutesError> {
    crate::configmap::parse_table(json)
        .map_err(|(path, message)| RoutesError::Json { path, message })
}

/// Each entry of `table` as the settings of its model, checked: names and keys present and
/// unique, counts and durations positive, the sleeping tier's paths and calls well formed.
///
/// # Errors
/// [`RoutesError::Invalid`] naming the first field at fault.
pub fn model_configs(table: &RouteTable) -> Result<Vec<ModelConfig>, RoutesError> {
    let mut names: HashMap<&str, usize> = HashMap::new();
    let mut keys: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::with_capacity(table.models.len());
    for (i, route) in table.models.iter().enumerate() {
        let cfg = model_config(i, route)?;
        let fields = std::iter::once(("model".to_owned(), &route.model)).chain(
            route
                .aliases
                .iter()
                .enumerate()
                .map(|(k, a)| (format!("aliases[{k}]"), a)),
        );
        for (field, name) in fields {
            if name.is_empty() {
                return Err(invalid(i, &field, "must not be empty"));
            }
            if let Some(j) = names.insert(name, i) {
                return Err(invalid(
                    i,
                    &field,
                    format!(
                        "{name:?} is also a name of models[{j}]: model names and aliases are unique on an endpoint"
                    ),
                ));
            }
        }
        if let Some(j) = keys.insert(cfg.key.clone(), i) {
            return Err(invalid(
                i,
                "service",
                format!(
                    "service {:?} is also models[{j}]: one entry per service",
                    cfg.key
                ),
            ));
        }
        out.push(cfg);
    }
    Ok(out)
}

fn invalid(i: usize, field: &str, message: impl Into<String>) -> RoutesError {
    RoutesError::Invalid {
        path: format!("models[{i}].{field}"),
        message: message.into(),
    }
}

/// A positive duration of entry `i`'s `field`.
fn positive(
    i: usize,
    field: &str,
    d: &hearth_crds::Duration,
    example: &str,
) -> Result<Duration, RoutesError> {
    match d.get() {
        Ok(d) if !d.is_zero() => Ok(d),
        Ok(_) => Err(invalid(
            i,
            field,
            format!("must be positive, like {example:?}"),
        )),
        Err(e) => Err(invalid(i, field, e.to_string())),
    }
}

/// The settings of entry `i`.
fn model_config(i: usize, r: &ModelRoute) -> Result<ModelConfig, RoutesError> {
    for (field, value) in [
        ("model", &r.model),
        ("namespace", &r.namespace),
        ("service", &r.service),
        ("backendService", &r.backend_service),
    ] {
        if value.trim().is_empty() {
            return Err(invalid(i, field, "must not be empty"));
        }
    }
    if r.namespace.contains('/') || r.service.contains('/') {
        return Err(invalid(
            i,
            "service",
            "namespace and service are Kubernetes names, without '/'",
        ));
    }
    if r.max_queue == 0 {
        return Err(invalid(i, "maxQueue", "must be at least 1"));
    }
    if !(r.metric_target.is_finite() && r.metric_target > 0.0) {
        return Err(invalid(
            i,
            "metricTarget",
            "must be a positive number, like 1",
        ));
    }
    let heartbeat_interval = positive(i, "heartbeatInterval", &r.heartbeat_interval, "5s")?;
    let activation_timeout = positive(i, "activationTimeout", &r.activation_timeout, "5m")?;
    let last_activation = match &r.last_activation {
        None => None,
        Some(d) => Some(
            d.get()
                .map_err(|e| invalid(i, "lastActivation", e.to_string()))?,
        ),
    };
    if let Some(adapters) = &r.adapters {
        crate::adapters::check(adapters).map_err(|e| match e {
            crate::adapters::AdapterTableError::Invalid { path, message } => {
                invalid(i, &format!("adapters.{path}"), message)
            }
            other => invalid(i, "adapters", other.to_string()),
        })?;
    }
    let sleep = match &r.sleep {
        None => None,
        Some(s) => {
            let after = positive(i, "sleep.after", &s.after, "5m")?;
            let level = u8::try_from(s.level)
                .ok()
                .filter(|l| (1..=2).contains(l))
                .ok_or_else(|| invalid(i, "sleep.level", "must be 1 or 2"))?;
            for (field, path) in [
                ("sleep.sleepPath", &s.sleep_path),
                ("sleep.isSleepingPath", &s.is_sleeping_path),
            ] {
                if !path.starts_with('/') || path.parse::<http::uri::PathAndQuery>().is_err() {
                    return Err(invalid(
                        i,
                        field,
                        format!("{path:?} must be an absolute path, like \"/sleep\""),
                    ));
                }
            }
            let mut wake_up = Vec::with_capacity(s.wake_up.len().max(1));
            for (j, call) in s.wake_up.iter().enumerate() {
                let written = match &call.body {
                    Some(body) => format!("{} {body}", call.path),
                    None => call.path.clone(),
                };
                let parsed = written
                    .parse::<EngineCall>()
                    .map_err(|e| invalid(i, &format!("sleep.wakeUp[{j}]"), e))?;
                wake_up.push(parsed);
            }
            if wake_up.is_empty() {
                wake_up.push(EngineCall {
                    path_and_query: http::uri::PathAndQuery::from_static("/wake_up"),
                    body: None,
                });
            }
            Some(SleepConfig {
                level,
                after,
                sleep_path: s.sleep_path.clone(),
                is_sleeping_path: s.is_sleeping_path.clone(),
                wake_up,
                // A wake-up may reload the weights; a held request waits no longer than this.
                call_timeout: activation_timeout,
            })
        }
    };
    Ok(ModelConfig {
        key: r.key(),
        served_model_names: vec![r.model.clone()],
        aliases: r.aliases.clone(),
        max_queue: r.max_queue,
        cold_start: match r.cold_start {
            hearth_crds::llmservice::ColdStartMode::Keepalive => ColdStartMode::Keepalive,
            hearth_crds::llmservice::ColdStartMode::Reject => ColdStartMode::Reject,
        },
        heartbeat_interval,
        activation_timeout,
        metric_target: r.metric_target,
        last_activation,
        sleep,
        container_concurrency: r
            .container_concurrency
            .unwrap_or(crate::fair::DEFAULT_CONTAINER_CONCURRENCY)
            .max(1),
    })
}

/// A route for model `model` of the LLMService `namespace/service` with a per-service
/// gateway's default settings: backend Service `<service>`, port `http`, queue bound 1000,
/// keepalive cold starts with a 5 s heartbeat, activation timeout 5 m, metric target 1, no
/// sleeping tier. For tests and benchmarks, which change what they need.
pub fn default_route(namespace: &str, service: &str, model: &str) -> ModelRoute {
    ModelRoute {
        model: model.to_owned(),
        aliases: Vec::new(),
        namespace: namespace.to_owned(),
        service: service.to_owned(),
        uid: None,
        backend_service: service.to_owned(),
        backend_port_name: "http".to_owned(),
        max_queue: 1000,
        cold_start: hearth_crds::llmservice::ColdStartMode::Keepalive,
        heartbeat_interval: hearth_crds::Duration::new("5s"),
        activation_timeout: hearth_crds::Duration::new("5m"),
        metric_target: 1.0,
        last_activation: None,
        sleep: None,
        container_concurrency: None,
        adapters: None,
    }
}

/// Each route's adapter catalog (checked by [`model_configs`] already): an adapter named like
/// any model or alias of the table, or like an adapter of an earlier entry, is left out and
/// logged (a model wins; names come unique from the controller, so this is a safeguard).
fn adapter_catalogs(table: &RouteTable) -> Vec<crate::adapters::Catalog> {
    let models: std::collections::HashSet<&str> = table
        .models
        .iter()
        .flat_map(|r| std::iter::once(&r.model).chain(&r.aliases))
        .map(String::as_str)
        .collect();
    let mut claimed: std::collections::HashSet<String> = std::collections::HashSet::new();
    table
        .models
        .iter()
        .map(|route| {
            let Some(adapters) = &route.adapters else {
                return crate::adapters::Catalog::default();
            };
            let (catalog, _) = crate::adapters::catalog_for(adapters, &route.key(), |n| {
                models.contains(n) || claimed.contains(n)
            });
            claimed.extend(catalog.adapters().iter().map(|a| a.name.to_string()));
            catalog
        })
        .collect()
}

/// Whether a model's state can stay when its route changes from `a` to `b`: the same
/// backends, sleeping tier, service object and concurrency per replica (its fair queue).
fn same_backends(a: &ModelRoute, b: &ModelRoute) -> bool {
    a.namespace == b.namespace
        && a.service == b.service
        && a.uid == b.uid
        && a.backend_service == b.backend_service
        && a.backend_port_name == b.backend_port_name
        && a.sleep == b.sleep
        && a.container_concurrency == b.container_concurrency
}

/// How a shared gateway finds each model's backends, and where its sleeping tier reports.
pub trait BackendSource: Send + Sync + 'static {
    /// Starts feeding `endpoints` with the ready backend endpoints of `route` (called within a
    /// Tokio runtime when the model's state starts). The tasks returned are stopped when the
    /// model has left the table and its last request finished.
    fn watch(&self, route: &ModelRoute, endpoints: &EndpointSet) -> Vec<AbortHandle>;

    /// Where the model's sleeping tier reports its sleeps and wake-ups (`None`: nowhere).
    fn reporter(&self, route: &ModelRoute) -> Option<ServiceReporter> {
        let _ = route;
        None
    }
}

/// A function as a [`BackendSource`]: it fills (or keeps) the set, nothing runs in the
/// background. For tests and benchmarks: `|route, endpoints| endpoints.replace([...])`.
impl<F> BackendSource for F
where
    F: Fn(&ModelRoute, &EndpointSet) + Send + Sync + 'static,
{
    fn watch(&self, route: &ModelRoute, endpoints: &EndpointSet) -> Vec<AbortHandle> {
        self(route, endpoints);
        Vec::new()
    }
}

/// Each model's backends from its backend Service's EndpointSlices, in the model's namespace
/// (see [`crate::discovery`]), and an LLMService's activation failures ([`crate::diagnosis`]);
/// the sleeping tier reports on the LLMService. A watch the
/// apiserver forbids (the Role in the model's namespace may come a moment after the route) is
/// retried with backoff (1 s doubling to 30 s) until the model leaves.
#[derive(Clone)]
pub struct KubeBackends {
    client: kube::Client,
    pod_name: Option<String>,
}

impl std::fmt::Debug for KubeBackends {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeBackends")
            .field("pod_name", &self.pod_name)
            .finish_non_exhaustive()
    }
}

impl KubeBackends {
    /// Discovery through `client`; the sleeping tier's Events name the reporting pod
    /// `pod_name`.
    pub fn new(client: kube::Client, pod_name: Option<String>) -> Self {
        Self { client, pod_name }
    }
}

impl BackendSource for KubeBackends {
    fn watch(&self, route: &ModelRoute, endpoints: &EndpointSet) -> Vec<AbortHandle> {
        let source = SliceSource {
            namespace: route.namespace.clone(),
            service: route.backend_service.clone(),
            port_name: Some(route.backend_port_name.clone()).filter(|p| !p.is_empty()),
        };
        let (client, set, key) = (self.client.clone(), endpoints.clone(), route.key());
        let task = tokio::spawn(async move {
            let mut backoff = Duration::from_secs(1);
            loop {
                let feed = set.clone();
                let e = watch_endpoints(client.clone(), source.clone(), move |eps| {
                    feed.replace(eps);
                })
                .await;
                tracing::warn!(service = %key, error = %e, retry_in_s = backoff.as_secs(), "backend discovery stopped; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(30));
            }
        });
        let mut tasks = vec![task.abort_handle()];
        // An LLMService's activation failures end the requests held for it (a joined
        // Deployment has none).
        if route.uid.is_some() {
            let follow = crate::diagnosis::follow(
                self.client.clone(),
                route.namespace.clone(),
                route.service.clone(),
                endpoints.clone(),
            );
            tasks.push(tokio::spawn(follow).abort_handle());
        }
        tasks
    }

    fn reporter(&self, route: &ModelRoute) -> Option<ServiceReporter> {
        route.sleep.as_ref().map(|_| {
            ServiceReporter::new(
                self.client.clone(),
                &route.namespace,
                &route.service,
                route.uid.clone(),
                self.pod_name.clone(),
            )
        })
    }
}

/// What an applied table changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoutesApplied {
    /// Models in the table now.
    pub models: usize,
    /// Keys that entered (a fresh state each).
    pub added: Vec<String>,
    /// Keys whose settings changed, their state kept.
    pub updated: Vec<String>,
    /// Keys whose backends or sleeping tier changed: a fresh state (the old one finishes its
    /// requests).
    pub replaced: Vec<String>,
    /// Keys that left.
    pub removed: Vec<String>,
}

/// One table: every model by name and by key, and sorted by name.
#[derive(Debug, Default)]
pub(crate) struct Table {
    by_name: HashMap<String, Arc<Model>>,
    by_key: HashMap<String, Arc<Model>>,
    sorted: Vec<Arc<Model>>,
}

impl Table {
    fn new(models: Vec<Arc<Model>>) -> Self {
        let mut t = Table::default();
        for m in models {
            for name in m.cfg.served_model_names.iter().chain(&m.cfg.aliases) {
                t.by_name.insert(name.clone(), m.clone());
            }
            if !m.cfg.key.is_empty() {
                t.by_key.insert(m.cfg.key.clone(), m.clone());
            }
            t.sorted.push(m);
        }
        // An adapter is routed to its base model. Catalogs leave out names a model or an
        // earlier model's adapter has (see `Routes::apply`), so none replaces another here.
        for m in &t.sorted {
            for a in m.state.adapters.catalog().adapters() {
                t.by_name
                    .entry(a.name.to_string())
                    .or_insert_with(|| m.clone());
            }
        }
        t.sorted
            .sort_by(|a, b| a.name().unwrap_or("").cmp(b.name().unwrap_or("")));
        t
    }

    /// Every model, sorted by name.
    pub(crate) fn models(&self) -> &[Arc<Model>] {
        &self.sorted
    }

    /// The model clients call `name`.
    pub(crate) fn by_name(&self, name: &str) -> Option<&Arc<Model>> {
        self.by_name.get(name)
    }

    /// The model of service `key` (`<namespace>/<name>`).
    pub(crate) fn by_key(&self, key: &str) -> Option<&Arc<Model>> {
        self.by_key.get(key)
    }
}

/// Why a model could not be selected by its service key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SelectError {
    /// A shared gateway needs the key.
    Missing,
    /// No model of that key.
    Unknown(String),
}

/// The peer replicas' demand as a shared replica last heard it (see [`PeerSink`]).
#[derive(Debug, Default)]
struct PeerBook {
    synced: bool,
    discovery_error: Option<String>,
    peers: Vec<String>,
    values: HashMap<String, Option<PeerDemand>>,
}

impl PeerBook {
    /// Gives a new model's hub (of service `key`) the peers' current values.
    fn init(&self, hub: &DemandHub, key: &str) {
        if self.synced {
            hub.set_peers(self.peers.iter().cloned());
            for (peer, value) in &self.values {
                hub.set_peer_value(peer, value.as_ref().map(|v| value_for(v, key)));
            }
        }
        if let Some(e) = &self.discovery_error {
            hub.set_peer_discovery_error(e.clone());
        }
    }
}

/// A peer's demand for the model of `key`: an entry it does not list counts 0.
fn value_for(v: &PeerDemand, key: &str) -> u64 {
    match v {
        PeerDemand::PerService(m) => m.get(key).copied().unwrap_or(0),
        PeerDemand::One(_) | PeerDemand::Zero => 0,
    }
}

/// What [`Routes`] serializes: applies and peer updates.
#[derive(Debug, Default)]
struct Control {
    book: PeerBook,
    /// The gateway's background work runs: new models start at once.
    started: bool,
    /// The states of models that left the table (or got other backends) while requests still
    /// hold them, by key: a key that comes back with the same backends takes its state again,
    /// so the requests it holds count in the demand KEDA and the peers see. Pruned on every
    /// apply; an entry lives no longer than the last request holding its state.
    retired: HashMap<String, (Arc<ModelRoute>, Weak<ModelState>)>,
}

/// The route table of a replica, and what a shared one needs to change it.
pub(crate) struct Routes {
    /// Routes by `model` and needs KEDA's `service` (`--routes-configmap`).
    pub(crate) shared: bool,
    table: ArcSwap<Table>,
    /// Bumped on every table applied.
    generation: watch::Sender<u64>,
    /// Bumped on every rise of a model's demand from 0 (shared mode).
    pub(crate) rises: Arc<watch::Sender<u64>>,
    control: Mutex<Control>,
    source: Option<Arc<dyn BackendSource>>,
    parts: StateParts,
}

impl std::fmt::Debug for Routes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Routes")
            .field("shared", &self.shared)
            .field("models", &self.table.load().sorted.len())
            .finish_non_exhaustive()
    }
}

impl Routes {
    /// The table of a single-service gateway: `model`, for good.
    /// What every model's state is built from.
    pub(crate) fn parts(&self) -> &StateParts {
        &self.parts
    }

    pub(crate) fn single(model: Arc<Model>, parts: StateParts) -> Self {
        Self {
            shared: false,
            table: ArcSwap::from_pointee(Table::new(vec![model])),
            generation: watch::channel(0).0,
            rises: Arc::new(watch::channel(0).0),
            control: Mutex::new(Control::default()),
            source: None,
            parts,
        }
    }

    /// The empty table of a shared gateway whose models' backends come from `source`.
    pub(crate) fn shared(source: Arc<dyn BackendSource>, parts: StateParts) -> Self {
        let rises = parts
            .rises
            .clone()
            .unwrap_or_else(|| Arc::new(watch::channel(0).0));
        Self {
            shared: true,
            table: ArcSwap::from_pointee(Table::default()),
            generation: watch::channel(0).0,
            rises,
            control: Mutex::new(Control::default()),
            source: Some(source),
            parts,
        }
    }

    /// The table now (lock-free).
    pub(crate) fn load(&self) -> arc_swap::Guard<Arc<Table>> {
        self.table.load()
    }

    /// A receiver woken on every table applied.
    pub(crate) fn subscribe(&self) -> watch::Receiver<u64> {
        self.generation.subscribe()
    }

    /// The model of service `service`: a shared gateway needs it; a single-service one serves
    /// its model for none, and for its own key or any when it does not know its key.
    pub(crate) fn select(&self, service: Option<&str>) -> Result<Arc<Model>, SelectError> {
        let table = self.table.load();
        if self.shared {
            let key = service.ok_or(SelectError::Missing)?;
            return table
                .by_key(key)
                .cloned()
                .ok_or_else(|| SelectError::Unknown(key.to_owned()));
        }
        let model = table
            .sorted
            .first()
            .ok_or_else(|| SelectError::Unknown(service.unwrap_or_default().to_owned()))?;
        match service {
            Some(key) if !model.cfg.key.is_empty() && model.cfg.key != key => {
                Err(SelectError::Unknown(key.to_owned()))
            }
            _ => Ok(model.clone()),
        }
    }

    fn control(&self) -> std::sync::MutexGuard<'_, Control> {
        self.control.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Starts every model of the table (the gateway's background work starts), and every
    /// model added from now on as it is added.
    pub(crate) fn start(&self) {
        let mut control = self.control();
        control.started = true;
        for m in self.table.load().models() {
            self.start_model(m);
        }
    }

    fn start_model(&self, m: &Model) {
        if m.state.started() {
            return;
        }
        let more = match (&self.source, &m.route) {
            (Some(source), Some(route)) if tokio::runtime::Handle::try_current().is_ok() => {
                source.watch(route, m.discovered())
            }
            _ => Vec::new(),
        };
        m.state.start(more);
    }

    /// Applies `table` (shared mode): see the module documentation.
    pub(crate) fn apply(&self, table: &RouteTable) -> Result<RoutesApplied, RoutesError> {
        let Some(source) = self.source.clone().filter(|_| self.shared) else {
            return Err(RoutesError::SingleService);
        };
        let configs = model_configs(table)?;
        let mut control = self.control();
        let old = self.table.load_full();
        let mut applied = RoutesApplied {
            models: configs.len(),
            ..RoutesApplied::default()
        };
        let catalogs = adapter_catalogs(table);
        let mut models = Vec::with_capacity(configs.len());
        let mut fresh = Vec::new();
        for ((cfg, route), catalog) in configs.into_iter().zip(&table.models).zip(catalogs) {
            let key = cfg.key.clone();
            let prev = old
                .by_key(&key)
                .filter(|p| p.route.as_deref().is_some_and(|r| same_backends(r, route)));
            // A model whose backends are not the table's takes back the state it had with
            // these backends, if requests still hold it (it left the table, or its backends
            // changed, a moment ago).
            let back = match prev {
                Some(_) => None,
                None => control
                    .retired
                    .get(&key)
                    .filter(|(r, _)| same_backends(r, route))
                    .and_then(|(_, state)| state.upgrade()),
            };
            let model = match (prev, back) {
                (Some(p), _) if *p.cfg == cfg && p.route.as_deref() == Some(route) => p.clone(),
                (Some(p), _) => {
                    p.state.demand.set_max_queue(cfg.max_queue);
                    p.state.lease.set_timeout(cfg.activation_timeout);
                    applied.updated.push(key);
                    Arc::new(Model {
                        cfg: Arc::new(cfg),
                        state: p.state.clone(),
                        route: Some(Arc::new(route.clone())),
                    })
                }
                (None, Some(state)) => {
                    state.demand.set_max_queue(cfg.max_queue);
                    state.lease.set_timeout(cfg.activation_timeout);
                    // The peers' lines it missed while out of the table.
                    control.book.init(&state.demand, &key);
                    if old.by_key(&key).is_some() {
                        applied.replaced.push(key);
                    } else {
                        applied.added.push(key);
                    }
                    Arc::new(Model {
                        cfg: Arc::new(cfg),
                        state,
                        route: Some(Arc::new(route.clone())),
                    })
                }
                (None, None) => {
                    if old.by_key(&key).is_some() {
                        applied.replaced.push(key.clone());
                    } else {
                        applied.added.push(key.clone());
                    }
                    let state = ModelState::new(&cfg, EndpointSet::new(), &self.parts);
                    if let Some(reporter) = source.reporter(route) {
                        state.report_to(reporter);
                    }
                    control.book.init(&state.demand, &key);
                    let m = Arc::new(Model {
                        cfg: Arc::new(cfg),
                        state: Arc::new(state),
                        route: Some(Arc::new(route.clone())),
                    });
                    fresh.push(m.clone());
                    m
                }
            };
            model.state.adapters.set_catalog(catalog);
            models.push(model);
        }
        let next = Table::new(models);
        applied.removed = old
            .by_key
            .keys()
            .filter(|k| next.by_key(k).is_none())
            .cloned()
            .collect();
        applied.removed.sort();
        // The states that are no longer the table's stay findable while requests hold them.
        for (key, m) in &old.by_key {
            let kept = next.by_key(key).is_some_and(|n| n.same_state(m));
            if let (false, Some(route)) = (kept, &m.route) {
                control
                    .retired
                    .insert(key.clone(), (route.clone(), Arc::downgrade(&m.state)));
            }
        }
        control.retired.retain(|key, (_, state)| {
            let in_table = next
                .by_key(key)
                .is_some_and(|n| std::ptr::eq(state.as_ptr(), Arc::as_ptr(&n.state)));
            !in_table && state.strong_count() > 0
        });
        self.table.store(Arc::new(next));
        self.generation.send_modify(|g| *g = g.wrapping_add(1));
        self.parts
            .metrics
            .route_table_models
            .set(i64::try_from(applied.models).unwrap_or(i64::MAX));
        if control.started {
            for m in &fresh {
                self.start_model(m);
            }
        }
        Ok(applied)
    }

    /// Every hub of the table now, with its key.
    fn hubs(&self) -> Vec<(String, DemandHub)> {
        self.table
            .load()
            .models()
            .iter()
            .map(|m| (m.cfg.key.clone(), m.state.demand.clone()))
            .collect()
    }
}

/// A shared replica's peers: each line from a peer goes to every model of the table, and is
/// kept for the models added later.
impl PeerSink for Routes {
    fn instance(&self) -> u64 {
        self.parts.instance
    }

    fn set_peers(&self, peers: &[String]) {
        let mut control = self.control();
        let book = &mut control.book;
        book.synced = true;
        book.discovery_error = None;
        book.peers = peers.to_vec();
        book.values.retain(|p, _| peers.contains(p));
        for p in peers {
            book.values.entry(p.clone()).or_insert(None);
        }
        for (_, hub) in self.hubs() {
            hub.set_peers(peers.iter().cloned());
        }
    }

    fn set_peer_value(&self, peer: &str, value: Option<PeerDemand>) -> Result<(), String> {
        if let Some(PeerDemand::One(_)) = value {
            return Err(
                "the peer sends one service's demand: it is a single-service gateway, not a replica of this shared one (check --peer-service)".to_owned(),
            );
        }
        let mut control = self.control();
        let book = &mut control.book;
        match book.values.get_mut(peer) {
            Some(v) => *v = value.clone(),
            // Not in the list (any more): ignored, as a hub ignores it.
            None => return Ok(()),
        }
        for (key, hub) in self.hubs() {
            hub.set_peer_value(peer, value.as_ref().map(|v| value_for(v, &key)));
        }
        Ok(())
    }

    fn set_peer_discovery_error(&self, error: String) {
        let mut control = self.control();
        control.book.discovery_error = Some(error.clone());
        for (_, hub) in self.hubs() {
            hub.set_peer_discovery_error(error.clone());
        }
    }

    fn max_line(&self) -> usize {
        MAX_SHARED_LINE
    }
}

/// A shared replica's local demand, for its peers: every model's, woken by any model's rise
/// from 0 and by every table applied.
pub(crate) struct TableFeed {
    routes: Arc<Routes>,
    rises: watch::Receiver<u64>,
    tables: watch::Receiver<u64>,
}

impl TableFeed {
    pub(crate) fn new(routes: Arc<Routes>) -> Self {
        let rises = routes.rises.subscribe();
        let tables = routes.subscribe();
        Self {
            routes,
            rises,
            tables,
        }
    }
}

impl crate::peers::DemandFeed for TableFeed {
    fn current(&mut self) -> PeerDemand {
        self.rises.mark_unchanged();
        self.tables.mark_unchanged();
        let demand = self
            .routes
            .load()
            .models()
            .iter()
            .map(|m| (m.cfg.key.clone(), m.state.demand.local()))
            .collect();
        PeerDemand::PerService(Arc::new(demand))
    }

    async fn changed(&mut self) -> bool {
        tokio::select! {
            r = self.rises.changed() => r.is_ok(),
            r = self.tables.changed() => r.is_ok(),
        }
    }

    async fn rose(&mut self) -> bool {
        self.rises.changed().await.is_ok()
    }

    fn closed(&self) -> bool {
        false
    }
}

/// Follows the ConfigMap `name` in `namespace` (a watch on that one object, by field selector)
/// and applies each route table it holds to `gateway`, until the task is dropped.
///
/// - Until the ConfigMap exists, and after it is deleted, the table is empty: every model is
///   unknown.
/// - A table that does not parse, or holds a value out of range, is refused: the last good
///   one stays, the error is logged naming the ConfigMap and the JSON path, and counted in
///   `hearth_gateway_route_table_errors_total`.
/// - Watch errors (the apiserver unreachable, RBAC forbidding the watch) are logged and the
///   watch retried with kube's backoff; the table in force stays meanwhile.
///
/// RBAC: `get`, `list`, `watch` on `configmaps` in `namespace`.
pub async fn watch_routes(
    client: kube::Client,
    namespace: String,
    name: String,
    gateway: crate::Gateway,
) {
    let followed =
        crate::configmap::Followed::config_map("routes ConfigMap", "no models are served");
    crate::configmap::follow::<k8s_openapi::api::core::v1::ConfigMap>(
        client,
        &namespace,
        &name,
        followed,
        |configmap, change| match change {
            crate::configmap::Change::Object(cm) => apply_config_map(&gateway, configmap, cm),
            crate::configmap::Change::Missing => apply_empty(&gateway, configmap),
        },
    )
    .await;
}

fn apply_empty(gateway: &crate::Gateway, configmap: &str) {
    if let Err(e) = gateway.apply_routes(&RouteTable::default()) {
        tracing::error!(%configmap, error = %e, "clearing the route table failed");
    }
}

fn apply_config_map(gateway: &crate::Gateway, configmap: &str, cm: &ConfigMap) {
    let json = cm.data.as_ref().and_then(|d| d.get(ROUTES_KEY));
    let result = match json {
        Some(json) => gateway.apply_routes_json(json),
        None => {
            gateway.metrics().route_table_errors.inc();
            Err(RoutesError::MissingKey)
        }
    };
    match result {
        Ok(applied) => tracing::info!(
            %configmap,
            models = applied.models,
            added = ?applied.added,
            updated = ?applied.updated,
            replaced = ?applied.replaced,
            removed = ?applied.removed,
            "route table applied"
        ),
        Err(e) => tracing::error!(
            %configmap,
            key = ROUTES_KEY,
            path = e.path().unwrap_or(""),
            error = %e,
            "route table refused; the last good table stays"
        ),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Weak;

    use hearth_crds::llmendpoint::{SleepRoute, WakeUpCall};

    use super::*;
    use crate::{Gateway, GatewayConfig, apikeys::ApiKeys};

    fn route(service: &str) -> ModelRoute {
        default_route("ns", service, service)
    }

    fn table(routes: Vec<ModelRoute>) -> RouteTable {
        RouteTable { models: routes }
    }

    /// A shared gateway whose models get no endpoint.
    fn gateway() -> Gateway {
        Gateway::new_shared(
            GatewayConfig::default(),
            ApiKeys::disabled(),
            Arc::new(|_: &ModelRoute, _: &EndpointSet| {}),
        )
        .unwrap()
    }

    #[test]
    fn a_table_that_does_not_parse_names_the_json_path() {
        let mut v = serde_json::to_value(table(vec![route("a"), route("b")])).unwrap();
        v["models"][1]["maxQueue"] = serde_json::json!("many");
        let e = parse_route_table(&v.to_string()).unwrap_err();
        assert_eq!(e.path(), Some("models[1].maxQueue"), "{e}");
        assert!(e.to_string().starts_with("models[1].maxQueue: "), "{e}");
        let mut v = serde_json::to_value(table(vec![route("a")])).unwrap();
        v["models"][0]
            .as_object_mut()
            .unwrap()
            .remove("backendService");
        let e = parse_route_table(&v.to_string()).unwrap_err();
        assert!(e.to_string().contains("backendService"), "{e}");
        assert!(parse_route_table("{").is_err());
        // The controller's own JSON reads back.
        let t = table(vec![route("a")]);
        let json = serde_json::to_string(&t).unwrap();
        assert_eq!(parse_route_table(&json).unwrap(), t);
    }

    #[test]
    fn aliases_are_unique_among_every_name_of_the_table() {
        let with_aliases = |service: &str, aliases: &[&str]| ModelRoute {
            aliases: aliases.iter().map(|a| (*a).to_owned()).collect(),
            ..route(service)
        };
        let ok = table(vec![
            with_aliases("a", &["org/a"]),
            with_aliases("b", &["org/b"]),
        ]);
        let cfgs = model_configs(&ok).unwrap();
        assert_eq!(cfgs[0].aliases, ["org/a"]);
        for (t, path) in [
            (
                table(vec![with_aliases("a", &["b"]), route("b")]),
                "models[1].model",
            ),
            (
                table(vec![with_aliases("a", &["x"]), with_aliases("b", &["x"])]),
                "models[1].aliases[0]",
            ),
            (
                table(vec![with_aliases("a", &["a"])]),
                "models[0].aliases[0]",
            ),
            (
                table(vec![with_aliases("a", &[""])]),
                "models[0].aliases[0]",
            ),
        ] {
            match model_configs(&t) {
                Err(RoutesError::Invalid { path: p, .. }) => assert_eq!(p, path),
                other => panic!("{path}: {other:?}"),
            }
        }
    }

    #[test]
    fn values_out_of_range_name_their_field() {
        let cases: Vec<(ModelRoute, &str)> = vec![
            (
                ModelRoute {
                    max_queue: 0,
                    ..route("a")
                },
                "models[0].maxQueue",
            ),
            (
                ModelRoute {
                    activation_timeout: hearth_crds::Duration::new("soon"),
                    ..route("a")
                },
                "models[0].activationTimeout",
            ),
            (
                ModelRoute {
                    heartbeat_interval: hearth_crds::Duration::new("0s"),
                    ..route("a")
                },
                "models[0].heartbeatInterval",
            ),
            (
                ModelRoute {
                    metric_target: f64::NAN,
                    ..route("a")
                },
                "models[0].metricTarget",
            ),
            (
                ModelRoute {
                    model: String::new(),
                    ..route("a")
                },
                "models[0].model",
            ),
            (
                ModelRoute {
                    sleep: Some(SleepRoute {
                        after: hearth_crds::Duration::new("5m"),
                        level: 3,
                        sleep_path: "/sleep".into(),
                        is_sleeping_path: "/is_sleeping".into(),
                        wake_up: Vec::new(),
                    }),
                    ..route("a")
                },
                "models[0].sleep.level",
            ),
            (
                ModelRoute {
                    sleep: Some(SleepRoute {
                        after: hearth_crds::Duration::new("5m"),
                        level: 1,
                        sleep_path: "/sleep".into(),
                        is_sleeping_path: "/is_sleeping".into(),
                        wake_up: vec![WakeUpCall {
                            path: "/wake_up".into(),
                            body: Some("{oops".into()),
                        }],
                    }),
                    ..route("a")
                },
                "models[0].sleep.wakeUp[0]",
            ),
        ];
        for (r, path) in cases {
            let e = model_configs(&table(vec![r])).unwrap_err();
            assert_eq!(e.path(), Some(path), "{e}");
        }
        let twice = table(vec![
            route("a"),
            ModelRoute {
                model: "a".into(),
                ..route("b")
            },
        ]);
        let e = model_configs(&twice).unwrap_err();
        assert_eq!(e.path(), Some("models[1].model"), "{e}");
        assert!(e.to_string().contains("models[0]"), "{e}");
        let same_service = table(vec![
            route("a"),
            ModelRoute {
                model: "other".into(),
                ..route("a")
            },
        ]);
        assert_eq!(
            model_configs(&same_service).unwrap_err().path(),
            Some("models[1].service")
        );
    }

    #[test]
    fn a_route_becomes_the_settings_of_its_model() {
        let r = ModelRoute {
            max_queue: 7,
            cold_start: hearth_crds::llmservice::ColdStartMode::Reject,
            heartbeat_interval: hearth_crds::Duration::new("2s"),
            activation_timeout: hearth_crds::Duration::new("90s"),
            metric_target: 2.5,
            last_activation: Some(hearth_crds::Duration::new("34.2s")),
            sleep: Some(SleepRoute {
                after: hearth_crds::Duration::new("10m"),
                level: 2,
                sleep_path: "/sleep".into(),
                is_sleeping_path: "/is_sleeping".into(),
                wake_up: Vec::new(),
            }),
            ..default_route("team-a", "qwen-chat", "qwen")
        };
        let cfg = model_configs(&table(vec![r])).unwrap().remove(0);
        assert_eq!(cfg.key, "team-a/qwen-chat");
        assert_eq!(cfg.served_model_names, ["qwen"]);
        assert_eq!(cfg.max_queue, 7);
        assert_eq!(cfg.cold_start, ColdStartMode::Reject);
        assert_eq!(cfg.heartbeat_interval, Duration::from_secs(2));
        assert_eq!(cfg.activation_timeout, Duration::from_secs(90));
        assert_eq!(cfg.metric_target, 2.5);
        assert_eq!(cfg.last_activation, Some(Duration::from_millis(34_200)));
        let sleep = cfg.sleep.unwrap();
        assert_eq!((sleep.level, sleep.after), (2, Duration::from_secs(600)));
        assert_eq!(sleep.call_timeout, Duration::from_secs(90));
        assert_eq!(sleep.wake_up.len(), 1, "the default wake-up call");
    }

    #[test]
    fn applying_tables_adds_keeps_updates_replaces_and_removes() {
        let gw = gateway();
        let applied = gw
            .apply_routes(&table(vec![route("a"), route("b")]))
            .unwrap();
        assert_eq!(applied.added, ["ns/a", "ns/b"]);
        let (a0, b0) = (gw.model("ns/a").unwrap(), gw.model("ns/b").unwrap());
        assert_eq!(gw.model_named("b").unwrap().key(), "ns/b");

        // b's queue bound and name change: the same state, the new settings.
        let b = ModelRoute {
            max_queue: 1,
            model: "b2".into(),
            ..route("b")
        };
        // a's backend Service changes: a fresh state.
        let a = ModelRoute {
            backend_service: "a-v2".into(),
            ..route("a")
        };
        let applied = gw
            .apply_routes(&table(vec![a.clone(), b.clone(), route("c")]))
            .unwrap();
        assert_eq!(applied.added, ["ns/c"]);
        assert_eq!(applied.updated, ["ns/b"]);
        assert_eq!(applied.replaced, ["ns/a"]);
        assert!(applied.removed.is_empty());
        let b1 = gw.model("ns/b").unwrap();
        assert!(b1.same_state(&b0));
        assert_eq!(b1.config().max_queue, 1);
        assert_eq!(b1.demand().state().max_queue(), 1);
        assert!(gw.model_named("b").is_none() && gw.model_named("b2").is_some());
        assert!(!gw.model("ns/a").unwrap().same_state(&a0));

        // The same table again changes nothing.
        let applied = gw
            .apply_routes(&table(vec![a.clone(), b.clone(), route("c")]))
            .unwrap();
        assert_eq!(
            (
                applied.added.len(),
                applied.updated.len(),
                applied.replaced.len()
            ),
            (0, 0, 0)
        );
        assert!(Arc::ptr_eq(&gw.model("ns/b").unwrap(), &b1));

        let applied = gw.apply_routes(&table(vec![a])).unwrap();
        assert_eq!(applied.removed, ["ns/b", "ns/c"]);
        assert!(gw.model("ns/b").is_none() && gw.model_named("b2").is_none());
        assert_eq!(gw.models().len(), 1);
    }

    #[test]
    fn a_refused_table_keeps_the_last_good_one_and_is_counted() {
        let gw = gateway();
        gw.apply_routes(&table(vec![route("a")])).unwrap();
        let e = gw
            .apply_routes_json(r#"{"models": [{"model": 1}]}"#)
            .unwrap_err();
        assert!(e.path().is_some_and(|p| p.starts_with("models[0]")), "{e}");
        let bad = table(vec![ModelRoute {
            max_queue: 0,
            ..route("b")
        }]);
        assert!(gw.apply_routes(&bad).is_err());
        assert_eq!(gw.metrics().route_table_errors.get(), 2);
        assert!(gw.model("ns/a").is_some() && gw.model("ns/b").is_none());
        // A single-service gateway takes no table.
        let single = Gateway::new(
            GatewayConfig::default(),
            EndpointSet::new(),
            ApiKeys::disabled(),
        )
        .unwrap();
        assert_eq!(
            single.apply_routes(&table(vec![route("a")])),
            Err(RoutesError::SingleService)
        );
    }

    #[test]
    fn a_model_is_selected_by_its_service_key() {
        let gw = gateway();
        gw.apply_routes(&table(vec![route("a")])).unwrap();
        let routes = &gw.shared().routes;
        assert!(routes.select(Some("ns/a")).is_ok());
        assert_eq!(routes.select(None).err(), Some(SelectError::Missing));
        assert_eq!(
            routes.select(Some("ns/z")).err(),
            Some(SelectError::Unknown("ns/z".into()))
        );
    }

    /// A source whose watch is a task that runs until aborted; the test keeps its handles.
    struct Forever(Mutex<Vec<(String, tokio::task::JoinHandle<()>)>>);

    impl BackendSource for Arc<Forever> {
        fn watch(&self, route: &ModelRoute, _: &EndpointSet) -> Vec<AbortHandle> {
            let task = tokio::spawn(std::future::pending());
            let abort = task.abort_handle();
            self.0.lock().unwrap().push((route.key(), task));
            vec![abort]
        }
    }

    #[tokio::test]
    async fn a_model_that_leaves_finishes_its_requests_then_stops_its_tasks() {
        let source = Arc::new(Forever(Mutex::new(Vec::new())));
        let gw = Gateway::new_shared(
            GatewayConfig::default(),
            ApiKeys::disabled(),
            Arc::new(source.clone()),
        )
        .unwrap();
        gw.apply_routes(&table(vec![route("a"), route("b")]))
            .unwrap();
        assert!(
            source.0.lock().unwrap().is_empty(),
            "nothing runs before the gateway"
        );
        gw.spawn_background(Duration::from_secs(60));
        assert_eq!(source.0.lock().unwrap().len(), 2);
        gw.apply_routes(&table(vec![route("a"), route("b"), route("c")]))
            .unwrap();
        assert_eq!(
            source.0.lock().unwrap().len(),
            3,
            "a model added later starts at once"
        );

        // A request in flight for b holds its model (as the request path does) and a slot.
        let b = gw.model("ns/b").unwrap();
        let slot = b.demand().try_admit().unwrap();
        let state: Weak<ModelState> = Arc::downgrade(&b.state);
        gw.apply_routes(&table(vec![route("a"), route("c")]))
            .unwrap();
        assert!(gw.model("ns/b").is_none(), "unknown at once");
        assert!(
            b.backends().subscribe().has_changed().is_ok(),
            "still served"
        );
        let b_watch = |source: &Forever| {
            source
                .0
                .lock()
                .unwrap()
                .iter()
                .find(|(k, _)| k == "ns/b")
                .map(|(_, t)| t.is_finished())
        };
        tokio::task::yield_now().await;
        assert_eq!(
            b_watch(&source),
            Some(false),
            "its watch runs while in flight"
        );
        drop((slot, b));
        assert!(state.upgrade().is_none(), "its state is gone once idle");
        tokio::task::yield_now().await;
        assert_eq!(b_watch(&source), Some(true), "and its watch stopped");
        let a_running = source
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|(_, t)| !t.is_finished())
            .count();
        assert_eq!(a_running, 2, "a and c still watch");
    }

    #[test]
    fn a_model_that_leaves_and_comes_back_while_held_keeps_its_state() {
        let cfg = GatewayConfig {
            aggregate_peers: true,
            ..Default::default()
        };
        let gw = Gateway::new_shared(
            cfg,
            ApiKeys::disabled(),
            Arc::new(|_: &ModelRoute, _: &EndpointSet| {}),
        )
        .unwrap();
        gw.apply_routes(&table(vec![route("a")])).unwrap();
        let sink = gw.peer_sink();
        sink.set_peers(&["10.0.0.2:8080".to_owned()]);
        let a = gw.model("ns/a").unwrap();
        // A held request: its slot and its lease are the demand that wakes the model.
        let slot = a.demand().try_admit().unwrap();
        a.state.lease.raise();
        // The table loses the model for a moment (the ConfigMap deleted and written again, a
        // transient table of the controller) while the request waits.
        gw.apply_routes(&table(vec![])).unwrap();
        let line = PeerDemand::PerService(Arc::new(HashMap::from([("ns/a".to_owned(), 3)])));
        sink.set_peer_value("10.0.0.2:8080", Some(line)).unwrap();
        gw.apply_routes(&table(vec![ModelRoute {
            max_queue: 5,
            ..route("a")
        }]))
        .unwrap();
        let back = gw.model("ns/a").unwrap();
        assert!(
            back.same_state(&a),
            "the same backends: the state the held request counts in"
        );
        assert_eq!(
            back.demand().state().local(),
            1,
            "KEDA sees the held request"
        );
        assert_eq!(back.demand().state().total(), Ok(4), "and the peer's line");
        assert_eq!(
            back.demand().state().max_queue(),
            5,
            "with the new settings"
        );
        // Back with other backends: a fresh state, as for any change of backends.
        gw.apply_routes(&table(vec![])).unwrap();
        gw.apply_routes(&table(vec![ModelRoute {
            backend_service: "a-v2".into(),
            ..route("a")
        }]))
        .unwrap();
        assert!(!gw.model("ns/a").unwrap().same_state(&a));
        // Once its requests are done, a model that comes back starts afresh.
        drop((slot, back));
        gw.apply_routes(&table(vec![])).unwrap();
        drop(a);
        gw.apply_routes(&table(vec![route("a")])).unwrap();
        assert_eq!(gw.model("ns/a").unwrap().demand().state().local(), 0);
    }

    #[test]
    fn a_new_model_gets_its_peers_demand_at_once() {
        let cfg = GatewayConfig {
            aggregate_peers: true,
            ..Default::default()
        };
        let gw = Gateway::new_shared(
            cfg,
            ApiKeys::disabled(),
            Arc::new(|_: &ModelRoute, _: &EndpointSet| {}),
        )
        .unwrap();
        gw.apply_routes(&table(vec![route("a")])).unwrap();
        let sink = gw.peer_sink();
        let a = gw.model("ns/a").unwrap();
        assert!(
            a.demand().state().total().is_err(),
            "peers not discovered yet"
        );
        sink.set_peers(&["10.0.0.2:8080".to_owned()]);
        assert!(
            a.demand().state().total().is_err(),
            "no line from the peer yet"
        );
        let line = PeerDemand::PerService(Arc::new(HashMap::from([
            ("ns/a".to_owned(), 2),
            ("ns/b".to_owned(), 5),
        ])));
        sink.set_peer_value("10.0.0.2:8080", Some(line)).unwrap();
        assert_eq!(a.demand().state().total(), Ok(2));
        gw.apply_routes(&table(vec![route("a"), route("b"), route("c")]))
            .unwrap();
        let (b, c) = (gw.model("ns/b").unwrap(), gw.model("ns/c").unwrap());
        assert_eq!(b.demand().state().total(), Ok(5), "the peer's last line");
        assert_eq!(
            c.demand().state().total(),
            Ok(0),
            "not listed by the peer: 0"
        );
        assert!(
            sink.set_peer_value("10.0.0.2:8080", Some(PeerDemand::One(1)))
                .is_err(),
            "a single-service peer"
        );
        sink.set_peer_value("10.0.0.2:8080", None).unwrap();
        assert!(a.demand().state().total().is_err());
        sink.set_peer_discovery_error("forbidden".into());
        gw.apply_routes(&table(vec![route("d")])).unwrap();
        let d = gw.model("ns/d").unwrap();
        assert!(
            d.demand()
                .state()
                .total()
                .unwrap_err()
                .0
                .contains("forbidden")
        );
    }
}

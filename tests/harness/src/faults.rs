//! Accounting for fault injection (`tests/e2e/tests/faults.rs`, docs/operations.md): a steady
//! mixed load (streaming and non-streaming chat completions through a gateway, admissions of
//! opted-in and unrelated Deployments, edits of an LLMService) whose every operation ends in
//! exactly one [`Outcome`], and one report row per fault: admitted, completed, failed by
//! status, lost (no answer within the deadline), admissions refused, recovery seconds.
//!
//! Also the blunt instruments the faults need that the API does not offer: SIGKILL of a
//! container's processes on the real node (through its cgroup), and restarts of the cluster's
//! own processes (kubelet, containerd, kube-apiserver, etcd) with `tests/cluster/restart`.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::client::{self, ChatError};

/// What one operation of the load was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Kind {
    /// A streaming chat completion through the gateway.
    Stream,
    /// A non-streaming chat completion through the gateway.
    Chat,
    /// Creation of a Deployment annotated `serving.hearth.dev/runtime` (reaches the webhook).
    OptedIn,
    /// Creation of a plain Deployment (never reaches the webhook: `matchConditions`).
    Unrelated,
    /// A merge patch of the LLMService (validated by the webhook, reconciled by the controller).
    Edit,
}

impl Kind {
    /// Whether this is a chat request (as opposed to an admission).
    pub fn is_request(self) -> bool {
        matches!(self, Kind::Stream | Kind::Chat)
    }
}

/// How one operation ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Answered as it should be: `200` with every token (and `[DONE]`), or admitted (and, for an
    /// opted-in Deployment, mutated).
    Completed,
    /// Answered, but not as it should be; the class (an HTTP status like `503`, `error event`,
    /// `stream cut`, `connect`, `webhook refused`, an API status code).
    Failed(String),
    /// No answer within the deadline.
    Lost,
}

/// One operation of the load.
#[derive(Clone, Debug)]
pub struct Record {
    /// What it was.
    pub kind: Kind,
    /// When it was sent.
    pub sent: Instant,
    /// When it ended (the deadline for a lost one).
    pub ended: Instant,
    /// How it ended.
    pub outcome: Outcome,
    /// The error text of a failure (empty otherwise).
    pub detail: String,
    /// A label the caller gave it (the replica a pinned stream went to, say).
    pub tag: String,
}

/// Every operation recorded so far, shared by the load's tasks.
#[derive(Clone, Default)]
pub struct Ledger {
    records: Arc<Mutex<Vec<Record>>>,
}

impl Ledger {
    /// Records one operation.
    pub fn push(&self, r: Record) {
        if let Ok(mut v) = self.records.lock() {
            v.push(r);
        }
    }

    /// A copy of every record.
    pub fn records(&self) -> Vec<Record> {
        self.records.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// Records of `kind` sent in `[from, to)`.
    pub fn sent_between(&self, kind: Kind, from: Instant, to: Instant) -> Vec<Record> {
        self.records()
            .into_iter()
            .filter(|r| r.kind == kind && r.sent >= from && r.sent < to)
            .collect()
    }
}

/// How a chat completion ended: completed only with status 200 and, for a stream, exactly
/// `tokens` tokens, `[DONE]` and no error event.
fn classify_chat(
    result: &Result<client::Trace, ChatError>,
    stream: bool,
    tokens: usize,
) -> Outcome {
    match result {
        Err(ChatError::Timeout { .. }) => Outcome::Lost,
        Err(ChatError::Request { .. }) => Outcome::Failed("connect".into()),
        Err(ChatError::Body { .. }) => Outcome::Failed("body cut".into()),
        Err(ChatError::Invalid(_)) => Outcome::Failed("invalid".into()),
        Ok(t) if t.status != 200 => Outcome::Failed(t.status.to_string()),
        Ok(t) if stream => {
            if t.events
                .iter()
                .any(|(_, e)| matches!(e, client::Event::Error(_)))
            {
                Outcome::Failed("error event".into())
            } else if !t.complete() || t.tokens(None) != tokens {
                Outcome::Failed("stream cut".into())
            } else {
                Outcome::Completed
            }
        }
        Ok(t) if t.body.contains("\"choices\"") => Outcome::Completed,
        Ok(_) => Outcome::Failed("200 without choices".into()),
    }
}

/// Sends one chat completion and records it; returns its outcome.
pub async fn chat_once(
    ledger: &Ledger,
    base: &str,
    model: &str,
    stream: bool,
    tokens: u32,
    deadline: Duration,
    tag: &str,
) -> Outcome {
    let sent = Instant::now();
    let result = client::chat_with(base, model, stream, Some(tokens), deadline).await;
    let outcome = classify_chat(&result, stream, tokens as usize);
    let detail = match &result {
        Err(e) => e.to_string(),
        Ok(t) if outcome != Outcome::Completed => format!(
            "status {}, {} tokens, last events {:?}, body {}",
            t.status,
            t.tokens(None),
            t.events.iter().rev().take(2).collect::<Vec<_>>(),
            t.body.chars().take(300).collect::<String>()
        ),
        Ok(_) => String::new(),
    };
    ledger.push(Record {
        kind: if stream { Kind::Stream } else { Kind::Chat },
        sent,
        ended: Instant::now(),
        outcome: outcome.clone(),
        detail,
        tag: tag.to_owned(),
    });
    outcome
}

/// What the load sends.
#[derive(Clone)]
pub struct LoadConfig {
    /// The gateway (`http://<ClusterIP>:80`); None: no chat load.
    pub url: Option<String>,
    /// The served model name.
    pub model: String,
    /// Chat clients, each sending one request after another (streaming and not, alternately).
    pub chat_workers: usize,
    /// `max_tokens` of each chat completion (150 ms a token in the stub runtime).
    pub tokens: u32,
    /// An operation unanswered this long is lost.
    pub deadline: Duration,
    /// Admissions: the client and the namespace to create Deployments in (None: none).
    pub admissions: Option<(Client, String)>,
    /// The LLMService to edit (its name in the admissions' namespace), with the admissions.
    pub edit: Option<String>,
    /// The runtime opted-in Deployments name (`serving.hearth.dev/runtime`).
    pub runtime: String,
}

/// The steady load, running until [`Load::stop`].
pub struct Load {
    stop: watch::Sender<bool>,
    /// What it did so far.
    pub ledger: Ledger,
    tasks: Vec<JoinHandle<()>>,
}

impl Load {
    /// Starts the load's tasks.
    pub fn start(cfg: LoadConfig) -> Self {
        let (stop, _) = watch::channel(false);
        let ledger = Ledger::default();
        let mut tasks = Vec::new();
        if let Some(url) = cfg.url.clone() {
            for worker in 0..cfg.chat_workers {
                let (ledger, rx, url, cfg) =
                    (ledger.clone(), stop.subscribe(), url.clone(), cfg.clone());
                tasks.push(tokio::spawn(async move {
                    let mut round = worker;
                    while !*rx.borrow() {
                        let stream = round % 2 == 0;
                        round += 1;
                        chat_once(
                            &ledger,
                            &url,
                            &cfg.model,
                            stream,
                            cfg.tokens,
                            cfg.deadline,
                            "load",
                        )
                        .await;
                    }
                }));
            }
        }
        if let Some((client, ns)) = cfg.admissions.clone() {
            let (ledger, rx) = (ledger.clone(), stop.subscribe());
            tasks.push(tokio::spawn(admission_load(ledger, rx, client, ns, cfg)));
        }
        Self {
            stop,
            ledger,
            tasks,
        }
    }

    /// Stops sending and waits for what is in flight (each bounded by the deadline).
    pub async fn stop(mut self) -> Ledger {
        let _ = self.stop.send(true);
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
        self.ledger.clone()
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// A Deployment of `replicas: 0` (admission only: no pod, no device), opted in with the
/// runtime annotation or plain.
pub fn load_deployment(name: &str, runtime: Option<&str>) -> serde_json::Value {
    let mut d = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": {"tests.hearth.dev/fault-load": "true"}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "vllm",
                    "image": "hearth.dev/vllm-stub:e2e",
                    "args": ["--model=/models/stub", format!("--served-model-name={name}")],
                    "ports": [{"name": "http", "containerPort": 8000}],
                }]},
            },
        },
    });
    if let Some(rt) = runtime {
        d["metadata"]["annotations"] = json!({"serving.hearth.dev/runtime": rt});
    }
    d
}

/// Whether the webhook mutated a Deployment (the runtime's accelerator limit).
fn mutated(d: &Deployment) -> bool {
    d.spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first())
        .and_then(|c| c.resources.as_ref())
        .and_then(|r| r.limits.as_ref())
        .is_some_and(|l| l.contains_key("hearth.dev/fake-gpu"))
}

/// The class of a failed API call.
pub fn api_failure(e: &kube::Error) -> (String, String) {
    match e {
        kube::Error::Api(s) if s.message.contains("failed calling webhook") => {
            ("webhook refused".into(), s.message.clone())
        }
        kube::Error::Api(s) => (format!("{} {}", s.code, s.reason), s.message.clone()),
        other => ("client error".into(), other.to_string()),
    }
}

async fn timed<T>(
    deadline: Duration,
    f: impl Future<Output = Result<T, kube::Error>>,
) -> Result<Result<T, kube::Error>, ()> {
    tokio::time::timeout(deadline, f).await.map_err(|_| ())
}

/// One admission after another until stopped: an opted-in Deployment (must come back mutated),
/// a plain one, an edit of the LLMService (an annotation), and deletion of the Deployments of
/// three rounds ago.
async fn admission_load(
    ledger: Ledger,
    rx: watch::Receiver<bool>,
    client: Client,
    ns: String,
    cfg: LoadConfig,
) {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let services: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "serving.hearth.dev",
            "v1alpha1",
            "LLMService",
        )),
    );
    // A short per-call deadline: the apiserver answers a webhook failure within timeoutSeconds.
    let deadline = cfg.deadline.min(Duration::from_secs(30));
    let pp = PatchParams::apply("hearth-e2e-faults").force();
    let mut round = 0u64;
    while !*rx.borrow() {
        round += 1;
        for (kind, name, runtime) in [
            (
                Kind::OptedIn,
                format!("opted-{round}"),
                Some(cfg.runtime.as_str()),
            ),
            (Kind::Unrelated, format!("plain-{round}"), None),
        ] {
            let sent = Instant::now();
            let obj = load_deployment(&name, runtime);
            let r = timed(deadline, deployments.patch(&name, &pp, &Patch::Apply(&obj))).await;
            let (outcome, detail) = match r {
                Err(()) => (Outcome::Lost, String::new()),
                Ok(Ok(d)) if kind == Kind::OptedIn && !mutated(&d) => (
                    Outcome::Failed("not mutated".into()),
                    format!("{:?}", d.spec),
                ),
                Ok(Ok(_)) => (Outcome::Completed, String::new()),
                Ok(Err(e)) => {
                    let (class, msg) = api_failure(&e);
                    (Outcome::Failed(class), msg)
                }
            };
            ledger.push(Record {
                kind,
                sent,
                ended: Instant::now(),
                outcome,
                detail,
                tag: name,
            });
        }
        if let Some(svc) = &cfg.edit {
            let sent = Instant::now();
            let patch =
                json!({"metadata": {"annotations": {"tests.hearth.dev/round": round.to_string()}}});
            let r = timed(
                deadline,
                services.patch(svc, &PatchParams::default(), &Patch::Merge(&patch)),
            )
            .await;
            let (outcome, detail) = match r {
                Err(()) => (Outcome::Lost, String::new()),
                Ok(Ok(_)) => (Outcome::Completed, String::new()),
                Ok(Err(e)) => {
                    let (class, msg) = api_failure(&e);
                    (Outcome::Failed(class), msg)
                }
            };
            ledger.push(Record {
                kind: Kind::Edit,
                sent,
                ended: Instant::now(),
                outcome,
                detail,
                tag: svc.clone(),
            });
        }
        if round > 3 {
            for prefix in ["opted", "plain"] {
                let _ = deployments
                    .delete(&format!("{prefix}-{}", round - 3), &DeleteParams::default())
                    .await;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One fault's line of the report.
#[derive(Clone, Debug, Default)]
pub struct Row {
    /// The fault.
    pub fault: String,
    /// Chat requests sent.
    pub admitted: usize,
    /// Chat requests answered in full.
    pub completed: usize,
    /// Chat requests answered otherwise, by class.
    pub failed: BTreeMap<String, usize>,
    /// Chat requests and admissions never answered within the deadline.
    pub lost: usize,
    /// Admissions (Deployment creations, LLMService edits) made.
    pub admissions: usize,
    /// Admissions refused (any reason), by kind.
    pub refused: BTreeMap<String, usize>,
    /// Seconds from the fault to recovery as the test defines it (None: not measured).
    pub recovery: Option<f64>,
}

impl Row {
    /// Sums a ledger into a row for `fault`.
    pub fn from_records(fault: &str, records: &[Record], recovery: Option<Duration>) -> Self {
        let mut row = Row {
            fault: fault.to_owned(),
            recovery: recovery.map(|d| d.as_secs_f64()),
            ..Row::default()
        };
        for r in records {
            if r.outcome == Outcome::Lost {
                row.lost += 1;
            }
            if r.kind.is_request() {
                row.admitted += 1;
                match &r.outcome {
                    Outcome::Completed => row.completed += 1,
                    Outcome::Failed(class) => *row.failed.entry(class.clone()).or_default() += 1,
                    Outcome::Lost => {}
                }
            } else {
                row.admissions += 1;
                if let Outcome::Failed(class) = &r.outcome {
                    *row.refused
                        .entry(format!("{:?}: {class}", r.kind))
                        .or_default() += 1;
                }
            }
        }
        row
    }
}

fn counts(m: &BTreeMap<String, usize>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    m.iter()
        .map(|(k, v)| format!("{v} {k}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The report as a Markdown table, one row per fault.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| fault | requests admitted | completed | failed (by status) | lost | admissions | refused | recovery s |\n\
         |---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            r.fault,
            r.admitted,
            r.completed,
            counts(&r.failed),
            r.lost,
            r.admissions,
            counts(&r.refused),
            r.recovery.map_or("-".into(), |s| format!("{s:.1}")),
        );
    }
    out
}

/// Errors of [`kill_container`].
#[derive(Debug, thiserror::Error)]
pub enum KillError {
    #[error("pod {0} has no container {1} with a container ID")]
    NoContainer(String, String),
    #[error("no cgroup of container {0} under {1}")]
    NoCgroup(String, PathBuf),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

/// Finds the directory named `id` (or ending in it, as `cri-containerd-<id>.scope` would be)
/// under `root`, at most `depth` levels down.
fn find_dir(root: &Path, id: &str, depth: usize) -> Option<PathBuf> {
    let entries = std::fs::read_dir(root).ok()?;
    let dirs: Vec<PathBuf> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    for d in &dirs {
        if d.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.contains(id))
        {
            return Some(d.clone());
        }
    }
    if depth == 0 {
        return None;
    }
    dirs.iter().find_map(|d| find_dir(d, id, depth - 1))
}

/// SIGKILLs every process of `container` in `pod` on the real node (found through its
/// cgroup in the memory hierarchy, the one the real node always has; the node shares the
/// host's PID namespace), as the kernel's OOM killer or a crash would end it. Returns the PIDs.
pub fn kill_container(pod: &Pod, container: &str) -> Result<Vec<i32>, KillError> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == container))
        .and_then(|c| c.container_id.clone())
        .and_then(|id| id.split_once("://").map(|(_, id)| id.to_owned()))
        .ok_or_else(|| KillError::NoContainer(name.clone(), container.to_owned()))?;
    let root = Path::new("/sys/fs/cgroup/memory");
    let dir = find_dir(root, &id, 6).ok_or_else(|| KillError::NoCgroup(id.clone(), root.into()))?;
    let procs = dir.join("cgroup.procs");
    let text = std::fs::read_to_string(&procs)
        .map_err(|e| KillError::Io(format!("reading {}", procs.display()), e))?;
    let pids: Vec<i32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    for pid in &pids {
        let status = std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
            .map_err(|e| KillError::Io(format!("kill -KILL {pid}"), e))?;
        if !status.success() {
            return Err(KillError::Io(
                format!("kill -KILL {pid}"),
                std::io::Error::other(status.to_string()),
            ));
        }
    }
    Ok(pids)
}

/// A Deployment scaled for a fault (the controller to 2, KEDA's operator to 0).
/// [`ScaledDeployment::restore`] puts its replicas back; when a test fails before that, `Drop`
/// does it with kubectl, so a failed fault does not leave the shared cluster changed.
pub struct ScaledDeployment {
    cluster: hearth_test_support::Cluster,
    namespace: String,
    name: String,
    /// Its replicas before the fault.
    pub original: i32,
    restored: bool,
}

impl ScaledDeployment {
    /// Reads the Deployment's replicas, then scales it to `replicas`.
    pub async fn scale(
        cluster: &hearth_test_support::Cluster,
        namespace: &str,
        name: &str,
        replicas: i32,
    ) -> Result<Self, kube::Error> {
        let api: Api<Deployment> = Api::namespaced(cluster.client(), namespace);
        let original = api
            .get(name)
            .await?
            .spec
            .and_then(|s| s.replicas)
            .unwrap_or(1);
        let scaled = Self {
            cluster: cluster.clone(),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            original,
            restored: false,
        };
        scaled.set(replicas).await?;
        Ok(scaled)
    }

    async fn set(&self, replicas: i32) -> Result<(), kube::Error> {
        let api: Api<Deployment> = Api::namespaced(self.cluster.client(), &self.namespace);
        api.patch(
            &self.name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": replicas}})),
        )
        .await?;
        Ok(())
    }

    /// Puts the replicas back to [`Self::original`].
    pub async fn restore(mut self) -> Result<(), kube::Error> {
        self.set(self.original).await?;
        self.restored = true;
        Ok(())
    }
}

impl Drop for ScaledDeployment {
    fn drop(&mut self) {
        if self.restored {
            return;
        }
        if let Ok(mut cmd) = self.cluster.kubectl() {
            let _ = cmd
                .args(["-n", &self.namespace, "scale"])
                .arg(format!("deployment/{}", self.name))
                .arg(format!("--replicas={}", self.original))
                .status();
        }
    }
}

/// Errors of [`restart_components`].
#[derive(Debug, thiserror::Error)]
pub enum RestartError {
    #[error("running {0}: {1}")]
    Spawn(String, std::io::Error),
    #[error("tests/cluster/restart {components} failed ({status}):\n{log}")]
    Failed {
        components: String,
        status: std::process::ExitStatus,
        log: String,
    },
}

/// The state dir of the running cluster: the kubeconfig's directory when it is a state dir
/// (it has `pids/`), else [`hearth_test_support::state_dir`].
fn cluster_state() -> PathBuf {
    let from_kubeconfig = hearth_test_support::kubeconfig_path()
        .parent()
        .map(Path::to_path_buf)
        .filter(|d| d.join("pids").is_dir());
    from_kubeconfig.unwrap_or_else(hearth_test_support::state_dir)
}

/// Restarts components of the local cluster in place with `tests/cluster/restart` (SIGTERM,
/// or SIGKILL when `kill`), in start order, and returns once each serves again (its log lines:
/// old and new PIDs, seconds per step). Components are the script's names: `etcd`,
/// `kube-apiserver`, `containerd`, `kubelet`, ...
pub async fn restart_components(components: &[&str], kill: bool) -> Result<String, RestartError> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster/restart");
    let mut cmd = tokio::process::Command::new(&script);
    if kill {
        cmd.arg("--kill");
    }
    let out = cmd
        .args(components)
        .env("HEARTH_CLUSTER_STATE", cluster_state())
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| RestartError::Spawn(script.display().to_string(), e))?;
    let log = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        return Err(RestartError::Failed {
            components: components.join(" "),
            status: out.status,
            log,
        });
    }
    Ok(log)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(kind: Kind, outcome: Outcome) -> Record {
        let now = Instant::now();
        Record {
            kind,
            sent: now,
            ended: now,
            outcome,
            detail: String::new(),
            tag: String::new(),
        }
    }

    #[test]
    fn rows_count_requests_and_admissions_apart() {
        let records = vec![
            rec(Kind::Stream, Outcome::Completed),
            rec(Kind::Chat, Outcome::Failed("503".into())),
            rec(Kind::Stream, Outcome::Lost),
            rec(Kind::OptedIn, Outcome::Failed("webhook refused".into())),
            rec(Kind::Unrelated, Outcome::Completed),
        ];
        let row = Row::from_records("f", &records, Some(Duration::from_millis(1500)));
        assert_eq!((row.admitted, row.completed, row.lost), (3, 1, 1));
        assert_eq!(row.failed.get("503"), Some(&1));
        assert_eq!(row.admissions, 2);
        assert_eq!(row.refused.get("OptedIn: webhook refused"), Some(&1));
        let t = table(&[row]);
        assert!(
            t.contains("| f | 3 | 1 | 1 503 | 1 | 2 | 1 OptedIn: webhook refused | 1.5 |"),
            "{t}"
        );
    }
}

//! One pod, played as the kubelet would: network namespace, service-account kubeconfig, native
//! sidecars (`initContainers` with `restartPolicy: Always`, KEP-753) started in order before the
//! main container (each once its startup probe passes) and restarted whenever they exit, the
//! main container's process with startup/readiness/liveness probes, status through the status
//! subresource, restarts per `restartPolicy`, and on deletion: the main container's preStop →
//! SIGTERM → SIGKILL after the grace period (at least 2 s after SIGTERM), and only once it has
//! exited the sidecars the same way in reverse order (so they can serve its preStop hook), then
//! the final delete with grace 0 (Kubernetes docs, "Pod Lifecycle: Termination of Pods" and
//! "Sidecar Containers").

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    Container, HTTPGetAction, LifecycleHandler, Node, Pod, ServiceAccount,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};
use tokio::process::{Child, Command};
use tokio::sync::watch;
use tokio::time::{Instant, sleep, sleep_until};

use crate::net::{PodNet, Record};
use crate::probe::{self, Timing};

/// What every pod task shares.
pub struct Shared {
    pub client: Client,
    /// Image reference → local binary playing its entrypoint.
    pub images: HashMap<String, PathBuf>,
    /// Namespaces (by name prefix) whose pods of those images this runner plays.
    pub namespace_prefixes: Vec<String>,
    /// Per-pod files (kubeconfig, logs) live under `<state>/pods/<namespace>_<name>_<uid>/`.
    pub state_dir: PathBuf,
    pub record: Arc<Record>,
    pub next: AtomicU32,
    /// The apiserver's CA (base64 PEM, as in a kubeconfig), for pod kubeconfigs.
    pub ca_data: String,
    /// Where pods reach the apiserver: the runner's passthrough on the bridge address.
    pub apiserver_for_pods: SocketAddr,
    /// A name in the apiserver certificate, for `tls-server-name`.
    pub tls_server_name: String,
}

/// A deletion seen by the watch: the grace period to honour (0 = the pod is already gone).
#[derive(Clone, Copy, Debug)]
pub struct Term {
    pub grace: Duration,
}

/// Whether this runner plays the pod: scheduled, in a namespace starting with one of
/// `prefixes`, with a first container image it maps (the rule kwok's stages exclude, see
/// tests/cluster/kwok/kwok.yaml).
pub fn wanted(pod: &Pod, images: &HashMap<String, PathBuf>, prefixes: &[String]) -> bool {
    let Some(spec) = &pod.spec else { return false };
    let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
    prefixes.iter().any(|p| ns.starts_with(p.as_str()))
        && spec.node_name.is_some()
        && spec
            .containers
            .first()
            .and_then(|c| c.image.as_ref())
            .is_some_and(|i| images.contains_key(i))
}

fn now() -> Value {
    serde_json::to_value(Time(k8s_openapi::jiff::Timestamp::now())).unwrap_or(Value::Null)
}

/// The kubelet's minimum time from SIGTERM to SIGKILL when preStop used up the grace period.
const MIN_TERM: Duration = Duration::from_secs(2);

/// Cap of a sidecar's restart back-off (1 s, doubling); a process that ran this long starts
/// over at 1 s. Shorter than the kubelet's 5 min, so a flaky sidecar does not stall a test.
const SIDECAR_BACKOFF_MAX: Duration = Duration::from_secs(10);

/// The pod's native sidecars in start order: its `initContainers`, each of which must have
/// `restartPolicy: Always` and an image mapped to a local binary.
pub fn sidecars(pod: &Pod, images: &HashMap<String, PathBuf>) -> Result<Vec<Container>> {
    let inits = pod
        .spec
        .as_ref()
        .and_then(|s| s.init_containers.clone())
        .unwrap_or_default();
    for c in &inits {
        if c.restart_policy.as_deref() != Some("Always") {
            bail!(
                "init container {:?}: plain init containers (without restartPolicy: Always) are not supported by the pod runner; only native sidecars are",
                c.name
            );
        }
        argv(c, images).with_context(|| format!("sidecar {:?}", c.name))?;
    }
    Ok(inits)
}

/// The `terminated` state of a container that ran since `started_at` and ended with `code`.
fn terminated(code: i32, started_at: &Value) -> Value {
    json!({"terminated": {
        "exitCode": code, "startedAt": started_at, "finishedAt": now(),
        "reason": if code == 0 { "Completed" } else { "Error" }
    }})
}

/// The exit code the kubelet reports: the process's own, or 128 + the signal that ended it.
fn exit_code(st: std::io::Result<ExitStatus>) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match st {
        Ok(s) => s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(9)),
        Err(_) => 1,
    }
}

/// One native sidecar: its process (none while it backs off) and what its status reports.
struct Sidecar {
    c: Container,
    startup: Option<(HTTPGetAction, Timing)>,
    child: Option<Child>,
    /// Startup probe passed (or none), for the current process.
    started: bool,
    state: Value,
    last: Option<Value>,
    started_at: Value,
    since: Instant,
    restart_count: i32,
    backoff: Duration,
    restart_at: Option<Instant>,
    next_probe: Option<Instant>,
    probe_fails: u32,
}

impl Sidecar {
    fn new(c: Container) -> Sidecar {
        let startup = c
            .startup_probe
            .as_ref()
            .and_then(|p| Some((p.http_get.clone()?, Timing::of(p))));
        Sidecar {
            c,
            startup,
            child: None,
            started: false,
            state: json!({"waiting": {"reason": "PodInitializing"}}),
            last: None,
            started_at: Value::Null,
            since: Instant::now(),
            restart_count: 0,
            backoff: Duration::from_secs(1),
            restart_at: None,
            next_probe: None,
            probe_fails: 0,
        }
    }

    /// Its own log, next to the main container's `container.log`.
    fn log(&self) -> String {
        format!("{}.log", self.c.name)
    }

    fn ready(&self) -> bool {
        self.started && self.child.is_some()
    }

    /// A new process runs: started at once without a startup probe, else once it passes.
    fn running(&mut self, child: Child) {
        self.child = Some(child);
        self.since = Instant::now();
        self.started_at = now();
        self.state = json!({"running": {"startedAt": self.started_at}});
        self.started = self.startup.is_none();
        self.probe_fails = 0;
        self.next_probe = self
            .startup
            .as_ref()
            .map(|(_, t)| Instant::now() + t.initial_delay);
    }

    /// The process ended on its own (or its startup probe failed): restart after the back-off.
    fn exited(&mut self, code: i32) {
        self.stopped(code);
        self.last = Some(std::mem::replace(
            &mut self.state,
            json!({"waiting": {"reason": "CrashLoopBackOff", "message": format!("exit code {code}")}}),
        ));
        self.restart_count += 1;
        if self.since.elapsed() >= SIDECAR_BACKOFF_MAX {
            self.backoff = Duration::from_secs(1);
        }
        self.schedule_restart();
    }

    /// The process is gone; no restart unless scheduled.
    fn stopped(&mut self, code: i32) {
        self.child = None;
        self.started = false;
        self.next_probe = None;
        self.state = terminated(code, &self.started_at);
    }

    fn schedule_restart(&mut self) {
        self.restart_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(SIDECAR_BACKOFF_MAX);
    }

    /// Its entry in `initContainerStatuses`.
    fn status(&self) -> Value {
        let mut s = json!({
            "name": self.c.name, "image": self.c.image, "imageID": "",
            "ready": self.ready(), "started": self.started, "restartCount": self.restart_count,
            "state": self.state,
        });
        if let Some(last) = &self.last {
            s["lastState"] = last.clone();
        }
        s
    }
}

/// What a sidecar needs next.
enum SideEvent {
    Exited(usize, i32),
    RestartDue(usize),
    ProbeDue(usize),
}

/// Waits for the next sidecar event: a process ended, a back-off is over, or a startup probe is
/// due. Never returns when no sidecar has anything pending.
async fn side_event(side: &mut [Sidecar]) -> SideEvent {
    type Wait<'a> = Pin<Box<dyn Future<Output = SideEvent> + Send + 'a>>;
    let mut waits: Vec<Wait<'_>> = Vec::new();
    for (i, s) in side.iter_mut().enumerate() {
        let probe_at = s.next_probe.filter(|_| !s.started);
        if let Some(child) = s.child.as_mut() {
            waits.push(Box::pin(async move {
                tokio::select! {
                    st = child.wait() => SideEvent::Exited(i, exit_code(st)),
                    _ = until(probe_at) => SideEvent::ProbeDue(i),
                }
            }));
        } else if let Some(at) = s.restart_at {
            waits.push(Box::pin(async move {
                sleep_until(at).await;
                SideEvent::RestartDue(i)
            }));
        }
    }
    if waits.is_empty() {
        return std::future::pending().await;
    }
    futures::future::select_all(waits).await.0
}

async fn until(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Container `c`'s environment: `PATH` from the runner, `HOSTNAME`, `KUBECONFIG` (when the pod
/// gets a token), then its `env` in order with `$(VAR)` expansion and the supported `fieldRef`s
/// of `pod`, running at `ip` on a node at `host_ip`.
fn env(
    pod: &Pod,
    ip: Ipv4Addr,
    host_ip: Option<&str>,
    c: &Container,
    kubeconfig: Option<&Path>,
) -> Result<Vec<(String, String)>> {
    let mut env: Vec<(String, String)> = vec![(
        "PATH".into(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
    )];
    env.push(("HOSTNAME".into(), pod.name_any()));
    if let Some(k) = kubeconfig {
        env.push(("KUBECONFIG".into(), k.display().to_string()));
    }
    for e in c.env.iter().flatten() {
        let value = if let Some(v) = &e.value {
            expand(v, &env)
        } else if let Some(from) = &e.value_from {
            let path = from
                .field_ref
                .as_ref()
                .map(|f| f.field_path.as_str())
                .ok_or_else(|| {
                    anyhow!(
                        "env {}: only valueFrom.fieldRef is supported by the test pod runner",
                        e.name
                    )
                })?;
            field(pod, ip, host_ip, path).ok_or_else(|| {
                anyhow!("env {}: fieldRef {path:?} is not supported by the test pod runner (supported: metadata.name, metadata.namespace, metadata.uid, spec.nodeName, spec.serviceAccountName, status.podIP, status.podIPs, status.hostIP, status.hostIPs)", e.name)
            })?
        } else {
            String::new()
        };
        env.retain(|(k, _)| k != &e.name);
        env.push((e.name.clone(), value));
    }
    Ok(env)
}

fn field(pod: &Pod, ip: Ipv4Addr, host_ip: Option<&str>, path: &str) -> Option<String> {
    let spec = pod.spec.as_ref();
    Some(match path {
        "metadata.name" => pod.name_any(),
        "metadata.namespace" => pod.namespace().unwrap_or_default(),
        "metadata.uid" => pod.uid().unwrap_or_default(),
        "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".into()),
        // The runner gives a pod one address, so the lists hold one entry.
        "status.podIP" | "status.podIPs" => ip.to_string(),
        "status.hostIP" | "status.hostIPs" => host_ip.unwrap_or_default().to_string(),
        _ => return None,
    })
}

/// Container `c`'s argv: its image's entrypoint is the mapped binary; a `command` whose first
/// word names that binary runs it too, any other command runs as written.
fn argv(c: &Container, images: &HashMap<String, PathBuf>) -> Result<Vec<String>> {
    let image = c.image.clone().unwrap_or_default();
    let bin = images
        .get(&image)
        .ok_or_else(|| anyhow!("image {image:?} is not mapped to a local binary"))?;
    let bin_s = bin.display().to_string();
    let mut argv = match &c.command {
        Some(cmd) if !cmd.is_empty() => {
            let mut cmd = cmd.clone();
            let base = bin.file_name().map(|f| f.to_string_lossy().into_owned());
            if Path::new(&cmd[0])
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                == base
            {
                cmd[0] = bin_s;
            }
            cmd
        }
        _ => vec![bin_s],
    };
    argv.extend(c.args.iter().flatten().cloned());
    Ok(argv)
}

struct Ctx {
    shared: Arc<Shared>,
    api: Api<Pod>,
    pod: Pod,
    name: String,
    container: Container,
    side: Vec<Sidecar>,
    net: PodNet,
    dir: PathBuf,
    host_ip: Option<String>,
    kubeconfig: Option<PathBuf>,
    start_time: Value,
    restart_count: i32,
    /// The main container's last status entry (none before it first starts), its readiness and
    /// the pod phase: status lists are replaced whole, so every patch repeats them.
    main: Option<Value>,
    main_ready: bool,
    phase: &'static str,
}

/// Runs the pod until it is deleted; errors are reported in the pod's status and the log.
pub async fn run(shared: Arc<Shared>, pod: Pod, term: watch::Receiver<Option<Term>>) {
    let ns = pod.namespace().unwrap_or_default();
    let name = pod.name_any();
    let api: Api<Pod> = Api::namespaced(shared.client.clone(), &ns);
    let n = shared.next.fetch_add(1, Ordering::SeqCst);
    let net = match PodNet::create(n, &shared.record) {
        Ok(net) => net,
        Err(e) => {
            tracing::error!(pod = %format!("{ns}/{name}"), error = %format!("{e:#}"), "pod network");
            fail_and_wait(&api, &name, &pod, &format!("{e:#}"), term).await;
            return;
        }
    };
    let dir = shared
        .state_dir
        .join("pods")
        .join(format!("{ns}_{name}_{}", pod.uid().unwrap_or_default()));
    let container = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first().cloned())
        .unwrap_or_default();
    let mut ctx = Ctx {
        shared,
        api,
        name,
        container,
        side: Vec::new(),
        dir,
        host_ip: None,
        kubeconfig: None,
        start_time: now(),
        restart_count: 0,
        main: None,
        main_ready: false,
        phase: "Running",
        net,
        pod,
    };
    if let Err(e) = ctx.play(term.clone()).await {
        tracing::error!(pod = %format!("{ns}/{}", ctx.name), error = %format!("{e:#}"), "pod failed");
        // Nothing of a failed pod keeps running: dropping the sidecars kills them (kill_on_drop).
        ctx.side.clear();
        fail_and_wait(&ctx.api, &ctx.name, &ctx.pod, &format!("{e:#}"), term).await;
    }
    ctx.net.destroy();
}

/// Reports a pod the runner cannot start as Failed, then waits for its deletion.
async fn fail_and_wait(
    api: &Api<Pod>,
    name: &str,
    pod: &Pod,
    msg: &str,
    mut term: watch::Receiver<Option<Term>>,
) {
    let patch = json!({"status": {"phase": "Failed", "reason": "RunnerError", "message": msg}});
    let _ = api
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await;
    while term.borrow().is_none() {
        if term.changed().await.is_err() {
            return;
        }
    }
    final_delete(api, name, pod).await;
}

async fn final_delete(api: &Api<Pod>, name: &str, pod: &Pod) {
    let dp = DeleteParams {
        grace_period_seconds: Some(0),
        preconditions: Some(Preconditions {
            uid: pod.uid(),
            resource_version: None,
        }),
        ..Default::default()
    };
    if let Err(e) = api.delete(name, &dp).await {
        tracing::debug!(pod = name, error = %e, "final delete");
    }
}

enum Exit {
    /// The process ended with this code (or was killed by a signal: 128 + signal).
    Exited(i32),
    /// Startup or liveness probe failed: the kubelet kills and restarts the container.
    Unhealthy(&'static str),
}

impl Ctx {
    fn id(&self) -> String {
        format!("{}/{}", self.pod.namespace().unwrap_or_default(), self.name)
    }

    async fn play(&mut self, mut term: watch::Receiver<Option<Term>>) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        // Refuse what the runner cannot play before anything starts.
        argv(&self.container, &self.shared.images)?;
        self.side = sidecars(&self.pod, &self.shared.images)?
            .into_iter()
            .map(Sidecar::new)
            .collect();
        if let Some(node) = self.pod.spec.as_ref().and_then(|s| s.node_name.clone()) {
            let nodes: Api<Node> = Api::all(self.shared.client.clone());
            if let Ok(n) = nodes.get(&node).await {
                self.host_ip = n
                    .status
                    .and_then(|s| s.addresses)
                    .and_then(|a| a.into_iter().find(|a| a.type_ == "InternalIP"))
                    .map(|a| a.address);
            }
        }
        self.kubeconfig = self.write_kubeconfig().await?;
        let spec = self.pod.spec.as_ref();
        let restart_policy = spec
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into());
        let pod_grace = Duration::from_secs(
            spec.and_then(|s| s.termination_grace_period_seconds)
                .unwrap_or(30)
                .max(0) as u64,
        );
        if !self.start_sidecars(&mut term).await? {
            return Ok(()); // deleted while the sidecars started
        }
        let mut backoff = Duration::from_secs(1);
        loop {
            let mut child = self.spawn(&self.container, "container.log")?;
            tracing::info!(pod = %self.id(), ip = %self.net.ip, pid = child.id(), "started");
            let started_at = now();
            let running = json!({"running": {"startedAt": started_at}});
            self.patch_status(false, false, running, None, None).await;
            let outcome = self.supervise(&mut child, &started_at, &mut term).await;
            let exit = match outcome {
                Some(exit) => exit,
                None => return Ok(()), // deleted and terminated
            };
            let code = match exit {
                Exit::Exited(c) => c,
                Exit::Unhealthy(probe) => {
                    tracing::info!(pod = %self.id(), probe, "probe failed; killing the container");
                    signal(&child, libc::SIGKILL);
                    let _ = child.wait().await;
                    137
                }
            };
            let terminated = terminated(code, &started_at);
            let restart = match restart_policy.as_str() {
                "Never" => false,
                "OnFailure" => code != 0,
                _ => true,
            };
            if !restart {
                // The pod is done, and so are its sidecars (the kubelet stops them too).
                self.stop_sidecars(Instant::now() + pod_grace, MIN_TERM)
                    .await;
                let phase = if code == 0 { "Succeeded" } else { "Failed" };
                self.patch_status(false, false, terminated, None, Some(phase))
                    .await;
                while term.borrow().is_none() {
                    if term.changed().await.is_err() {
                        return Ok(());
                    }
                }
                final_delete(&self.api, &self.name, &self.pod).await;
                return Ok(());
            }
            self.restart_count += 1;
            tracing::info!(pod = %self.id(), code, restarts = self.restart_count, "container exited; restarting");
            let waiting = json!({"waiting": {"reason": "CrashLoopBackOff", "message": format!("exit code {code}")}});
            self.patch_status(false, false, waiting, Some(terminated), None)
                .await;
            // Sidecars keep running (and restarting) through the main container's back-off.
            let until = Instant::now() + backoff;
            loop {
                tokio::select! {
                    _ = sleep_until(until) => break,
                    ev = side_event(&mut self.side) => self.on_side_event(ev).await,
                    _ = term.changed() => {
                        let grace = term.borrow().map(|t| t.grace).unwrap_or_default();
                        self.terminate(None, grace).await;
                        return Ok(());
                    }
                }
            }
            // The kubelet's crash-loop back-off doubles up to 5 minutes.
            backoff = (backoff * 2).min(Duration::from_secs(300));
        }
    }

    /// Starts the sidecars in order, each once the previous one has started (its startup probe
    /// passed, if it has one), as the kubelet does. False: the pod was deleted meanwhile, and
    /// what had started is stopped.
    async fn start_sidecars(&mut self, term: &mut watch::Receiver<Option<Term>>) -> Result<bool> {
        if self.side.is_empty() {
            return Ok(true);
        }
        self.phase = "Pending";
        for i in 0..self.side.len() {
            let child = self.spawn(&self.side[i].c, &self.side[i].log())?;
            tracing::info!(pod = %self.id(), container = %self.side[i].c.name, pid = child.id(), "sidecar started");
            self.side[i].running(child);
            self.send_status().await;
            loop {
                let deleted = *term.borrow();
                if let Some(t) = deleted {
                    self.terminate(None, t.grace).await;
                    return Ok(false);
                }
                if self.side[i].started {
                    break;
                }
                tokio::select! {
                    ev = side_event(&mut self.side) => self.on_side_event(ev).await,
                    _ = term.changed() => {}
                }
            }
        }
        Ok(true)
    }

    /// Restarts a sidecar whose process ended (once its back-off is over) and runs startup
    /// probes; other probes of sidecars are not played.
    async fn on_side_event(&mut self, ev: SideEvent) {
        let id = self.id();
        match ev {
            SideEvent::Exited(i, code) => {
                tracing::info!(pod = %id, container = %self.side[i].c.name, code, "sidecar exited; restarting");
                self.side[i].exited(code);
            }
            SideEvent::RestartDue(i) => {
                self.side[i].restart_at = None;
                match self.spawn(&self.side[i].c, &self.side[i].log()) {
                    Ok(child) => {
                        tracing::info!(pod = %id, container = %self.side[i].c.name, pid = child.id(), "sidecar restarted");
                        self.side[i].running(child);
                    }
                    Err(e) => {
                        tracing::warn!(pod = %id, container = %self.side[i].c.name, error = %format!("{e:#}"), "sidecar restart");
                        self.side[i].schedule_restart();
                    }
                }
            }
            SideEvent::ProbeDue(i) => {
                let Some((get, t)) = self.side[i].startup.clone() else {
                    return;
                };
                let ok = probe::http_get(&get, &self.side[i].c, IpAddr::V4(self.net.ip), t.timeout)
                    .await
                    .unwrap_or(false);
                let s = &mut self.side[i];
                if ok {
                    s.started = true;
                    s.next_probe = None;
                    tracing::info!(pod = %id, container = %s.c.name, "sidecar startup probe passed");
                } else {
                    s.probe_fails += 1;
                    if s.probe_fails < t.failure_threshold {
                        s.next_probe = Some(Instant::now() + t.period);
                        return;
                    }
                    // The kubelet kills a container whose startup probe failed, then restarts it.
                    tracing::info!(pod = %id, container = %s.c.name, "sidecar startup probe failed; killing it");
                    if let Some(mut child) = s.child.take() {
                        signal(&child, libc::SIGKILL);
                        let _ = child.wait().await;
                    }
                    s.exited(137);
                }
            }
        }
        self.send_status().await;
    }

    /// Asks the TokenRequest API for a token of the pod's service account, bound to the pod,
    /// and writes a kubeconfig that reaches the apiserver through the bridge passthrough.
    async fn write_kubeconfig(&self) -> Result<Option<PathBuf>> {
        let spec = self
            .pod
            .spec
            .as_ref()
            .ok_or_else(|| anyhow!("pod has no spec"))?;
        if spec.automount_service_account_token == Some(false) {
            return Ok(None);
        }
        let sa = spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into());
        let ns = self.pod.namespace().unwrap_or_default();
        let sas: Api<ServiceAccount> = Api::namespaced(self.shared.client.clone(), &ns);
        let req = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![],
                expiration_seconds: Some(24 * 3600),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(self.name.clone()),
                    uid: self.pod.uid(),
                }),
            },
            ..Default::default()
        };
        let tr = sas
            .create_token_request(&sa, &PostParams::default(), &req)
            .await
            .with_context(|| format!("TokenRequest for service account {ns}/{sa}"))?;
        let token = tr
            .status
            .map(|s| s.token)
            .ok_or_else(|| anyhow!("TokenRequest for {ns}/{sa} returned no token"))?;
        // JSON is YAML, which is what kubeconfig loaders read.
        let cfg = json!({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "cluster", "cluster": {
                "server": format!("https://{}", self.shared.apiserver_for_pods),
                "certificate-authority-data": self.shared.ca_data,
                "tls-server-name": self.shared.tls_server_name,
            }}],
            "users": [{"name": sa, "user": {"token": token}}],
            "contexts": [{"name": "pod", "context": {"cluster": "cluster", "user": sa, "namespace": ns}}],
            "current-context": "pod",
        });
        let path = self.dir.join("kubeconfig");
        std::fs::write(&path, serde_json::to_vec_pretty(&cfg)?)
            .with_context(|| format!("writing {}", path.display()))?;
        Ok(Some(path))
    }

    /// Runs the probes until the process exits, a probe kills it, or the pod is deleted (then
    /// terminates it and returns `None`).
    async fn supervise(
        &mut self,
        child: &mut Child,
        started_at: &Value,
        term: &mut watch::Receiver<Option<Term>>,
    ) -> Option<Exit> {
        let c = &self.container.clone();
        let ip = IpAddr::V4(self.net.ip);
        let t0 = Instant::now();
        let startup = c
            .startup_probe
            .as_ref()
            .and_then(|p| Some((p.http_get.clone()?, Timing::of(p))));
        let readiness = c
            .readiness_probe
            .as_ref()
            .and_then(|p| Some((p.http_get.clone()?, Timing::of(p))));
        let liveness = c
            .liveness_probe
            .as_ref()
            .and_then(|p| Some((p.http_get.clone()?, Timing::of(p))));
        let mut started = startup.is_none();
        let mut ready = false;
        let mut reported = (false, false);
        let mut startup_fails = 0;
        let mut live_fails = 0;
        let mut ready_fails = 0;
        let mut next_startup = t0
            + startup
                .as_ref()
                .map(|s| s.1.initial_delay)
                .unwrap_or_default();
        let mut next_ready = t0;
        let mut next_live = t0;
        if started {
            next_ready = t0
                + readiness
                    .as_ref()
                    .map(|s| s.1.initial_delay)
                    .unwrap_or_default();
            next_live = t0
                + liveness
                    .as_ref()
                    .map(|s| s.1.initial_delay)
                    .unwrap_or_default();
        }
        loop {
            if term.borrow().is_some() {
                let grace = term.borrow().map(|t| t.grace).unwrap_or_default();
                self.terminate(Some(child), grace).await;
                return None;
            }
            // Readiness without a probe: ready once started (Kubernetes default).
            if started && readiness.is_none() {
                ready = true;
            }
            if (started, ready) != reported {
                reported = (started, ready);
                let running = json!({"running": {"startedAt": started_at}});
                self.patch_status(ready, started, running, None, None).await;
                tracing::info!(pod = %self.id(), started, ready, "status");
            }
            let mut due = Instant::now() + Duration::from_secs(3600);
            if !started {
                due = due.min(next_startup);
            } else {
                if readiness.is_some() {
                    due = due.min(next_ready);
                }
                if liveness.is_some() {
                    due = due.min(next_live);
                }
            }
            tokio::select! {
                st = child.wait() => {
                    let code = exit_code(st);
                    tracing::info!(pod = %self.id(), code, "container exited");
                    return Some(Exit::Exited(code));
                }
                _ = term.changed() => continue,
                ev = side_event(&mut self.side) => {
                    self.on_side_event(ev).await;
                    continue;
                }
                _ = sleep_until(due) => {}
            }
            let now_i = Instant::now();
            if !started {
                if let Some((get, t)) = &startup
                    && now_i >= next_startup
                {
                    if probe::http_get(get, c, ip, t.timeout)
                        .await
                        .unwrap_or(false)
                    {
                        started = true;
                        next_ready = Instant::now();
                        next_live = Instant::now();
                    } else {
                        startup_fails += 1;
                        if startup_fails >= t.failure_threshold {
                            return Some(Exit::Unhealthy("startup"));
                        }
                    }
                    next_startup = now_i + t.period;
                }
                continue;
            }
            if let Some((get, t)) = &readiness
                && now_i >= next_ready
            {
                // Kubelet: one success makes ready (successThreshold 1), failureThreshold
                // failures in a row make unready.
                if probe::http_get(get, c, ip, t.timeout)
                    .await
                    .unwrap_or(false)
                {
                    ready = true;
                    ready_fails = 0;
                } else {
                    ready_fails += 1;
                    if ready_fails >= t.failure_threshold {
                        ready = false;
                    }
                }
                next_ready = now_i + t.period;
            }
            if let Some((get, t)) = &liveness
                && now_i >= next_live
            {
                if probe::http_get(get, c, ip, t.timeout)
                    .await
                    .unwrap_or(false)
                {
                    live_fails = 0;
                } else {
                    live_fails += 1;
                    if live_fails >= t.failure_threshold {
                        return Some(Exit::Unhealthy("liveness"));
                    }
                }
                next_live = now_i + t.period;
            }
        }
    }

    /// Starts container `c` in the pod's network namespace, in its own process group, output
    /// appended to `<pod dir>/<log>`.
    fn spawn(&self, c: &Container, log: &str) -> Result<Child> {
        let env = env(
            &self.pod,
            self.net.ip,
            self.host_ip.as_deref(),
            c,
            self.kubeconfig.as_deref(),
        )?;
        let argv: Vec<String> = argv(c, &self.shared.images)?
            .iter()
            .map(|a| expand(a, &env))
            .collect();
        let log_path = self.dir.join(log);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .with_context(|| format!("opening {}", log_path.display()))?;
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.net.netns])
            .args(&argv)
            .env_clear()
            .envs(env)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .current_dir(&self.dir)
            .process_group(0)
            .kill_on_drop(true);
        if let Some(wd) = &c.working_dir {
            cmd.current_dir(wd);
        }
        cmd.spawn()
            .with_context(|| format!("starting {argv:?} in netns {}", self.net.netns))
    }

    /// Pod deletion, in the kubelet's order: the main container (if running) first, then the
    /// sidecars in reverse start order, which therefore serve the main container's preStop
    /// hook; then the pod object is deleted with grace 0.
    async fn terminate(&mut self, child: Option<&mut Child>, grace: Duration) {
        let deadline = Instant::now() + grace;
        let min_term = if grace.is_zero() {
            Duration::ZERO
        } else {
            MIN_TERM
        };
        tracing::info!(pod = %self.id(), grace_s = grace.as_secs(), "terminating");
        if let Some(child) = child {
            self.stop(&self.container, child, deadline, min_term).await;
        }
        self.stop_sidecars(deadline, min_term).await;
        final_delete(&self.api, &self.name, &self.pod).await;
        tracing::info!(pod = %self.id(), "terminated and deleted");
    }

    /// Stops the running sidecars in reverse start order, each after the one before has exited.
    async fn stop_sidecars(&mut self, deadline: Instant, min_term: Duration) {
        for i in (0..self.side.len()).rev() {
            self.side[i].restart_at = None;
            let Some(mut child) = self.side[i].child.take() else {
                continue;
            };
            let code = self
                .stop(&self.side[i].c, &mut child, deadline, min_term)
                .await;
            tracing::info!(pod = %self.id(), container = %self.side[i].c.name, code, "sidecar stopped");
            self.side[i].stopped(code);
        }
    }

    /// Stops one container: its preStop hook (bounded by `deadline`), SIGTERM, then SIGKILL at
    /// `deadline` but no sooner than `min_term` after SIGTERM. Returns the exit code.
    async fn stop(
        &self,
        c: &Container,
        child: &mut Child,
        deadline: Instant,
        min_term: Duration,
    ) -> i32 {
        if Instant::now() < deadline
            && let Some(hook) = c.lifecycle.as_ref().and_then(|l| l.pre_stop.as_ref())
        {
            tokio::select! {
                r = self.pre_stop(c, hook) => if let Err(e) = r {
                    tracing::warn!(pod = %self.id(), container = %c.name, error = %format!("{e:#}"), "preStop hook failed");
                },
                _ = sleep_until(deadline) => tracing::warn!(pod = %self.id(), container = %c.name, "preStop hook ran out of the grace period"),
                _ = child.wait() => {}
            }
            tracing::info!(pod = %self.id(), container = %c.name, "preStop done");
        }
        signal(child, libc::SIGTERM);
        let kill_at = deadline.max(Instant::now() + min_term);
        tokio::select! {
            st = child.wait() => exit_code(st),
            _ = sleep_until(kill_at) => {
                tracing::info!(pod = %self.id(), container = %c.name, "grace period over; SIGKILL");
                signal(child, libc::SIGKILL);
                exit_code(child.wait().await)
            }
        }
    }

    /// Runs container `c`'s preStop hook. An httpGet goes to the pod IP, so it reaches any
    /// container of the pod (a sidecar too) on a numeric port.
    async fn pre_stop(&self, c: &Container, hook: &LifecycleHandler) -> Result<()> {
        if let Some(exec) = &hook.exec {
            let cmd = exec.command.clone().unwrap_or_default();
            if cmd.is_empty() {
                bail!("preStop exec has an empty command");
            }
            let env = env(&self.pod, self.net.ip, self.host_ip.as_deref(), c, None)?;
            let st = Command::new("ip")
                .args(["netns", "exec", &self.net.netns])
                .args(&cmd)
                .env_clear()
                .envs(env)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .status()
                .await
                .with_context(|| format!("running preStop {cmd:?}"))?;
            if !st.success() {
                bail!("preStop {cmd:?} exited with {st}");
            }
        } else if let Some(s) = &hook.sleep {
            sleep(Duration::from_secs(s.seconds.max(0) as u64)).await;
        } else if let Some(get) = &hook.http_get {
            let ok = probe::http_get(get, c, IpAddr::V4(self.net.ip), Duration::from_secs(3600))
                .await
                .map_err(|e| anyhow!(e))?;
            if !ok {
                bail!(
                    "preStop httpGet {} on port {:?}: no 2xx/3xx answer",
                    get.path.as_deref().unwrap_or("/"),
                    get.port
                );
            }
        }
        Ok(())
    }

    fn conditions(&self, ready: bool) -> Value {
        let s = if ready { "True" } else { "False" };
        // Sidecars all start before the main container does.
        let init = if self.main.is_some() { "True" } else { "False" };
        json!([
            {"type": "PodReadyToStartContainers", "status": "True"},
            {"type": "Initialized", "status": init},
            {"type": "ContainersReady", "status": s, "lastTransitionTime": now()},
            {"type": "Ready", "status": s, "lastTransitionTime": now()},
        ])
    }

    fn status_base(&self, ready: bool, phase: &str) -> serde_json::Map<String, Value> {
        let ip = self.net.ip.to_string();
        let mut st = serde_json::Map::new();
        st.insert("phase".into(), json!(phase));
        st.insert("podIP".into(), json!(ip));
        st.insert("podIPs".into(), json!([{"ip": ip}]));
        if let Some(h) = &self.host_ip {
            st.insert("hostIP".into(), json!(h));
            st.insert("hostIPs".into(), json!([{"ip": h}]));
        }
        st.insert("startTime".into(), self.start_time.clone());
        st.insert("conditions".into(), self.conditions(ready));
        st
    }

    /// Reports the main container's state (with `lastState` after a restart) and the phase
    /// (`Running` unless given).
    async fn patch_status(
        &mut self,
        ready: bool,
        started: bool,
        state: Value,
        last: Option<Value>,
        phase: Option<&'static str>,
    ) {
        let mut main = json!({
            "name": self.container.name, "image": self.container.image, "imageID": "",
            "ready": ready, "started": started, "restartCount": self.restart_count,
            "state": state,
        });
        if let Some(last) = last {
            main["lastState"] = last;
        }
        self.main = Some(main);
        self.main_ready = ready;
        self.phase = phase.unwrap_or("Running");
        self.send_status().await;
    }

    /// Sends the whole status: the pod is ready when the main container and every sidecar are.
    async fn send_status(&self) {
        let ready = self.main_ready && self.side.iter().all(Sidecar::ready);
        let mut st = self.status_base(ready, self.phase);
        let main = self.main.clone().unwrap_or_else(|| {
            json!({
                "name": self.container.name, "image": self.container.image, "imageID": "",
                "ready": false, "started": false, "restartCount": 0,
                "state": {"waiting": {"reason": "PodInitializing"}},
            })
        });
        st.insert("containerStatuses".into(), json!([main]));
        if !self.side.is_empty() {
            let side: Vec<Value> = self.side.iter().map(Sidecar::status).collect();
            st.insert("initContainerStatuses".into(), json!(side));
        }
        self.send(Value::Object(st)).await;
    }

    async fn send(&self, status: Value) {
        // Strategic merge: conditions merge by type, keeping what the scheduler wrote
        // (PodScheduled); container status lists are replaced whole.
        let patch = json!({"status": status});
        for _ in 0..3 {
            match self
                .api
                .patch_status(
                    &self.name,
                    &PatchParams::default(),
                    &Patch::Strategic(&patch),
                )
                .await
            {
                Ok(_) => return,
                Err(kube::Error::Api(e)) if e.code == 404 => return,
                Err(e) => {
                    tracing::warn!(pod = %self.id(), error = %e, "status update");
                    sleep(Duration::from_millis(200)).await;
                }
            }
        }
    }
}

fn signal(child: &Child, sig: i32) {
    if let Some(pid) = child.id() {
        // SAFETY: kill(2) with a PID we spawned and have not reaped yet.
        unsafe {
            libc::kill(pid as i32, sig);
        }
    }
}

/// Expands `$(VAR)` references to earlier variables; `$$(VAR)` escapes (Kubernetes' rule for
/// env values, command and args). Unknown references stay as written.
pub fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix("$(") {
            out.push_str("$(");
            rest = stripped;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let var = &inner[..end];
            match env.iter().rev().find(|(k, _)| k == var) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&format!("$({var})")),
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, image: &str, node: Option<&str>) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": ns},
            "spec": {"nodeName": node, "containers": [{"name": "c", "image": image}]},
        }))
        .expect("valid pod")
    }

    #[test]
    fn plays_mapped_images_in_suite_namespaces_once_scheduled() {
        let images = HashMap::from([(
            "hearth.dev/vllm-stub:e2e".to_string(),
            PathBuf::from("/bin/true"),
        )]);
        let prefixes = vec!["e2e-".to_string(), "hearth-e2e".to_string()];
        let stub = "hearth.dev/vllm-stub:e2e";
        assert!(wanted(
            &pod("e2e-zero-abc", stub, Some("kwok-stub-0")),
            &images,
            &prefixes
        ));
        assert!(wanted(
            &pod("hearth-e2e-push", stub, Some("kwok-stub-0")),
            &images,
            &prefixes
        ));
        // Other suites' stub pods stay with kwok; unscheduled pods and other images are not ours.
        assert!(!wanted(
            &pod("ctrl-phase-abc", stub, Some("kwok-stub-0")),
            &images,
            &prefixes
        ));
        assert!(!wanted(
            &pod("e2e-zero-abc", stub, None),
            &images,
            &prefixes
        ));
        assert!(!wanted(
            &pod(
                "e2e-zero-abc",
                "vllm/vllm-openai:v0.25.1",
                Some("kwok-gpu-0")
            ),
            &images,
            &prefixes
        ));
    }

    #[test]
    fn expands_references_like_the_kubelet() {
        let env = vec![("A".to_string(), "x".to_string())];
        assert_eq!(expand("--a=$(A)", &env), "--a=x");
        assert_eq!(expand("$$(A)", &env), "$(A)");
        assert_eq!(expand("$(B)", &env), "$(B)");
        assert_eq!(expand("cost $5", &env), "cost $5");
    }

    fn images() -> HashMap<String, PathBuf> {
        HashMap::from([
            (
                "hearth.dev/vllm-stub:e2e".to_string(),
                PathBuf::from("/opt/bin/vllm-stub"),
            ),
            (
                "hearth.dev/drain:e2e".to_string(),
                PathBuf::from("/opt/bin/drain"),
            ),
        ])
    }

    /// A backend whose preStop calls a sidecar's drain endpoint in the same pod.
    fn pod_with_inits(inits: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "backend-0", "namespace": "e2e-x", "uid": "u-1"},
            "spec": {
                "nodeName": "kwok-stub-0",
                "initContainers": inits,
                "containers": [{
                    "name": "stub", "image": "hearth.dev/vllm-stub:e2e",
                    "args": ["--port=8000"],
                    "env": [{"name": "ROLE", "value": "main"}],
                    "lifecycle": {"preStop": {"httpGet": {"port": 8099, "path": "/drain"}}},
                }],
            },
        }))
        .expect("valid pod")
    }

    fn drain_sidecar(name: &str) -> Value {
        json!({
            "name": name, "image": "hearth.dev/drain:e2e", "restartPolicy": "Always",
            "command": ["drain"], "args": ["--listen=0.0.0.0:8099", "--pod=$(POD)"],
            "env": [
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "WHO", "value": "$(POD)@$(IP)"},
            ],
        })
    }

    #[test]
    fn sidecars_are_the_restartable_init_containers_in_order() {
        let two = pod_with_inits(json!([drain_sidecar("drain"), drain_sidecar("log")]));
        let side = sidecars(&two, &images()).expect("sidecars");
        let names: Vec<&str> = side.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["drain", "log"]);
        // No init containers: nothing to start first.
        let plain = pod("e2e-x", "hearth.dev/vllm-stub:e2e", Some("n"));
        assert!(sidecars(&plain, &images()).expect("none").is_empty());
    }

    #[test]
    fn plain_init_containers_fail_the_pod_with_a_clear_message() {
        let pod = pod_with_inits(json!([
            drain_sidecar("drain"),
            {"name": "migrate", "image": "hearth.dev/drain:e2e"},
        ]));
        let err = format!("{:#}", sidecars(&pod, &images()).expect_err("refused"));
        assert!(err.contains("\"migrate\""), "{err}");
        assert!(err.contains("not supported by the pod runner"), "{err}");
    }

    #[test]
    fn a_sidecar_image_without_a_binary_fails_the_pod() {
        let mut side = drain_sidecar("drain");
        side["image"] = json!("envoyproxy/envoy:v1.31");
        let err = format!(
            "{:#}",
            sidecars(&pod_with_inits(json!([side])), &images()).expect_err("refused")
        );
        assert!(err.contains("sidecar \"drain\""), "{err}");
        assert!(
            err.contains("\"envoyproxy/envoy:v1.31\" is not mapped to a local binary"),
            "{err}"
        );
    }

    #[test]
    fn each_container_gets_its_own_env_and_argv() {
        let pod = pod_with_inits(json!([drain_sidecar("drain")]));
        let spec = pod.spec.as_ref().expect("spec");
        let side = &spec.init_containers.as_ref().expect("inits")[0];
        let main = &spec.containers[0];
        let ip = Ipv4Addr::new(198, 18, 1, 7);
        let get = |env: &[(String, String)], k: &str| {
            env.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone())
        };

        let se = env(&pod, ip, None, side, Some(Path::new("/s/kubeconfig"))).expect("env");
        assert_eq!(get(&se, "POD").as_deref(), Some("backend-0"));
        assert_eq!(get(&se, "WHO").as_deref(), Some("backend-0@198.18.1.7"));
        assert_eq!(get(&se, "HOSTNAME").as_deref(), Some("backend-0"));
        assert_eq!(get(&se, "KUBECONFIG").as_deref(), Some("/s/kubeconfig"));
        assert_eq!(
            get(&se, "ROLE"),
            None,
            "the main container's env stays its own"
        );
        // `command` naming the image's binary runs the mapped binary; args are expanded at spawn.
        let sa: Vec<String> = argv(side, &images())
            .expect("argv")
            .iter()
            .map(|a| expand(a, &se))
            .collect();
        assert_eq!(
            sa,
            ["/opt/bin/drain", "--listen=0.0.0.0:8099", "--pod=backend-0"]
        );

        let me = env(&pod, ip, None, main, None).expect("env");
        assert_eq!(get(&me, "ROLE").as_deref(), Some("main"));
        assert_eq!(get(&me, "POD"), None);
        assert_eq!(get(&me, "KUBECONFIG"), None);
        assert_eq!(
            argv(main, &images()).expect("argv"),
            ["/opt/bin/vllm-stub", "--port=8000"]
        );

        // Any other command runs as written; unsupported env sources are errors, not panics.
        let mut shell = side.clone();
        shell.command = Some(vec!["sh".into(), "-c".into()]);
        shell.args = Some(vec!["exec drain".into()]);
        assert_eq!(
            argv(&shell, &images()).expect("argv"),
            ["sh", "-c", "exec drain"]
        );
        let mut bad: Container = serde_json::from_value(json!({"name": "x", "env": [
            {"name": "N", "valueFrom": {"fieldRef": {"fieldPath": "spec.volumes"}}},
        ]}))
        .expect("container");
        let err = format!(
            "{:#}",
            env(&pod, ip, None, &bad, None).expect_err("refused")
        );
        assert!(err.contains("fieldRef \"spec.volumes\""), "{err}");
        bad.image = Some("nope".into());
        assert!(argv(&bad, &images()).is_err());
    }

    #[test]
    fn a_sidecar_that_exits_restarts_after_a_short_back_off() {
        let c: Container = serde_json::from_value(drain_sidecar("drain")).expect("container");
        let mut s = Sidecar::new(c);
        let st = s.status();
        assert_eq!(st["started"], json!(false));
        assert_eq!(st["state"]["waiting"]["reason"], json!("PodInitializing"));

        s.started_at = now();
        s.state = json!({"running": {"startedAt": s.started_at}});
        s.exited(1);
        let st = s.status();
        assert_eq!(st["restartCount"], json!(1));
        assert_eq!(st["ready"], json!(false));
        assert_eq!(st["state"]["waiting"]["reason"], json!("CrashLoopBackOff"));
        assert_eq!(st["lastState"]["terminated"]["exitCode"], json!(1));
        let due = s.restart_at.expect("restart scheduled") - Instant::now();
        assert!(due <= Duration::from_secs(1), "{due:?}");
        for _ in 0..6 {
            s.exited(1);
        }
        assert_eq!(s.backoff, SIDECAR_BACKOFF_MAX);
        assert_eq!(s.status()["restartCount"], json!(7));

        // Stopped at pod deletion: terminated, nothing scheduled by `stopped` itself.
        s.restart_at = None;
        s.stopped(0);
        assert_eq!(
            s.status()["state"]["terminated"]["reason"],
            json!("Completed")
        );
        assert!(s.restart_at.is_none());
    }

    #[test]
    fn a_startup_probe_gates_a_sidecar() {
        let mut c: Container = serde_json::from_value(drain_sidecar("drain")).expect("container");
        c.startup_probe = Some(
            serde_json::from_value(
                json!({"httpGet": {"port": 8099, "path": "/healthz"}, "initialDelaySeconds": 2}),
            )
            .expect("probe"),
        );
        let s = Sidecar::new(c);
        let (get, t) = s.startup.as_ref().expect("startup probe");
        assert_eq!(get.path.as_deref(), Some("/healthz"));
        assert_eq!(t.initial_delay, Duration::from_secs(2));
        assert!(!s.ready());
    }
}

//! One pod, played as the kubelet would: network namespace, service-account kubeconfig,
//! process from the pod spec, startup/readiness/liveness probes, status through the status
//! subresource, restarts per `restartPolicy`, and on deletion preStop → SIGTERM → SIGKILL after
//! the grace period → final delete with grace 0 (Kubernetes docs, "Pod Lifecycle: Termination
//! of Pods").

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Container, LifecycleHandler, Node, Pod, ServiceAccount};
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
    pub record: Record,
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

struct Ctx {
    shared: Arc<Shared>,
    api: Api<Pod>,
    pod: Pod,
    name: String,
    container: Container,
    net: PodNet,
    dir: PathBuf,
    host_ip: Option<String>,
    start_time: Value,
    restart_count: i32,
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
        dir,
        host_ip: None,
        start_time: now(),
        restart_count: 0,
        net,
        pod,
    };
    if let Err(e) = ctx.play(term.clone()).await {
        tracing::error!(pod = %format!("{ns}/{}", ctx.name), error = %format!("{e:#}"), "pod failed");
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
        let kubeconfig = self.kubeconfig().await?;
        let restart_policy = self
            .pod
            .spec
            .as_ref()
            .and_then(|s| s.restart_policy.clone())
            .unwrap_or_else(|| "Always".into());
        let mut backoff = Duration::from_secs(1);
        loop {
            let mut child = self.spawn(kubeconfig.as_ref())?;
            tracing::info!(pod = %self.id(), ip = %self.net.ip, pid = child.id(), "started");
            let started_at = now();
            self.patch_status(
                false,
                false,
                json!({"running": {"startedAt": started_at}}),
                None,
            )
            .await;
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
            let terminated = json!({"terminated": {
                "exitCode": code, "startedAt": started_at, "finishedAt": now(),
                "reason": if code == 0 { "Completed" } else { "Error" }
            }});
            let restart = match restart_policy.as_str() {
                "Never" => false,
                "OnFailure" => code != 0,
                _ => true,
            };
            if !restart {
                let phase = if code == 0 { "Succeeded" } else { "Failed" };
                self.patch_status(false, false, terminated, Some(phase))
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
            self.patch_status_last(waiting, terminated).await;
            tokio::select! {
                _ = sleep(backoff) => {}
                _ = term.changed() => {
                    final_delete(&self.api, &self.name, &self.pod).await;
                    return Ok(());
                }
            }
            // The kubelet's crash-loop back-off doubles up to 5 minutes.
            backoff = (backoff * 2).min(Duration::from_secs(300));
        }
    }

    /// Asks the TokenRequest API for a token of the pod's service account, bound to the pod,
    /// and writes a kubeconfig that reaches the apiserver through the bridge passthrough.
    async fn kubeconfig(&self) -> Result<Option<PathBuf>> {
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

    fn env(&self, kubeconfig: Option<&PathBuf>) -> Result<Vec<(String, String)>> {
        let mut env: Vec<(String, String)> = vec![(
            "PATH".into(),
            std::env::var("PATH").unwrap_or_else(|_| "/usr/local/bin:/usr/bin:/bin".into()),
        )];
        env.push(("HOSTNAME".into(), self.name.clone()));
        if let Some(k) = kubeconfig {
            env.push(("KUBECONFIG".into(), k.display().to_string()));
        }
        for e in self.container.env.iter().flatten() {
            let value = if let Some(v) = &e.value {
                expand(v, &env)
            } else if let Some(from) = &e.value_from {
                let field = from
                    .field_ref
                    .as_ref()
                    .map(|f| f.field_path.as_str())
                    .ok_or_else(|| {
                        anyhow!(
                            "env {}: only valueFrom.fieldRef is supported by the test pod runner",
                            e.name
                        )
                    })?;
                self.field(field).ok_or_else(|| {
                    anyhow!("env {}: fieldRef {field:?} is not supported by the test pod runner (supported: metadata.name, metadata.namespace, metadata.uid, spec.nodeName, spec.serviceAccountName, status.podIP, status.hostIP)", e.name)
                })?
            } else {
                String::new()
            };
            env.retain(|(k, _)| k != &e.name);
            env.push((e.name.clone(), value));
        }
        Ok(env)
    }

    fn field(&self, path: &str) -> Option<String> {
        let spec = self.pod.spec.as_ref();
        Some(match path {
            "metadata.name" => self.name.clone(),
            "metadata.namespace" => self.pod.namespace().unwrap_or_default(),
            "metadata.uid" => self.pod.uid().unwrap_or_default(),
            "spec.nodeName" => spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
            "spec.serviceAccountName" => spec
                .and_then(|s| s.service_account_name.clone())
                .unwrap_or_else(|| "default".into()),
            "status.podIP" => self.net.ip.to_string(),
            "status.hostIP" => self.host_ip.clone().unwrap_or_default(),
            _ => return None,
        })
    }

    /// The argv: the image's entrypoint is the mapped binary; a `command` whose first word
    /// names that binary runs it too, any other command runs as written.
    fn argv(&self) -> Result<Vec<String>> {
        let image = self.container.image.clone().unwrap_or_default();
        let bin = self
            .shared
            .images
            .get(&image)
            .ok_or_else(|| anyhow!("image {image:?} is not mapped to a local binary"))?;
        let bin_s = bin.display().to_string();
        let mut argv = match &self.container.command {
            Some(cmd) if !cmd.is_empty() => {
                let mut cmd = cmd.clone();
                let base = bin.file_name().map(|f| f.to_string_lossy().into_owned());
                if std::path::Path::new(&cmd[0])
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
        argv.extend(self.container.args.iter().flatten().cloned());
        Ok(argv)
    }

    fn spawn(&self, kubeconfig: Option<&PathBuf>) -> Result<Child> {
        let env = self.env(kubeconfig)?;
        let argv: Vec<String> = self.argv()?.iter().map(|a| expand(a, &env)).collect();
        let log_path = self.dir.join("container.log");
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
        if let Some(wd) = &self.container.working_dir {
            cmd.current_dir(wd);
        }
        cmd.spawn()
            .with_context(|| format!("starting {argv:?} in netns {}", self.net.netns))
    }

    /// Runs the probes until the process exits, a probe kills it, or the pod is deleted (then
    /// terminates it and returns `None`).
    async fn supervise(
        &self,
        child: &mut Child,
        started_at: &Value,
        term: &mut watch::Receiver<Option<Term>>,
    ) -> Option<Exit> {
        let c = &self.container;
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
                self.terminate(child, grace).await;
                return None;
            }
            // Readiness without a probe: ready once started (Kubernetes default).
            if started && readiness.is_none() {
                ready = true;
            }
            if (started, ready) != reported {
                reported = (started, ready);
                self.patch_status(
                    ready,
                    started,
                    json!({"running": {"startedAt": started_at}}),
                    None,
                )
                .await;
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
                    let code = match st {
                        Ok(s) => s.code().unwrap_or_else(|| {
                            use std::os::unix::process::ExitStatusExt;
                            128 + s.signal().unwrap_or(9)
                        }),
                        Err(_) => 1,
                    };
                    tracing::info!(pod = %self.id(), code, "container exited");
                    return Some(Exit::Exited(code));
                }
                _ = term.changed() => continue,
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

    /// preStop (bounded by the grace period), then SIGTERM, then SIGKILL when the grace period
    /// is over; finally the pod object is deleted with grace 0, as the kubelet does.
    async fn terminate(&self, child: &mut Child, grace: Duration) {
        let deadline = Instant::now() + grace;
        tracing::info!(pod = %self.id(), grace_s = grace.as_secs(), "terminating");
        if !grace.is_zero()
            && let Some(hook) = self
                .container
                .lifecycle
                .as_ref()
                .and_then(|l| l.pre_stop.as_ref())
        {
            tokio::select! {
                r = self.pre_stop(hook) => if let Err(e) = r {
                    tracing::warn!(pod = %self.id(), error = %format!("{e:#}"), "preStop hook failed");
                },
                _ = sleep_until(deadline) => tracing::warn!(pod = %self.id(), "preStop hook ran out of the grace period"),
                _ = child.wait() => {}
            }
            tracing::info!(pod = %self.id(), "preStop done");
        }
        signal(child, libc::SIGTERM);
        // The kubelet gives at least 2 s after SIGTERM when preStop used up the grace period.
        let kill_at =
            deadline.max(Instant::now() + Duration::from_secs(if grace.is_zero() { 0 } else { 2 }));
        tokio::select! {
            _ = child.wait() => {}
            _ = sleep_until(kill_at) => {
                tracing::info!(pod = %self.id(), "grace period over; SIGKILL");
                signal(child, libc::SIGKILL);
                let _ = child.wait().await;
            }
        }
        final_delete(&self.api, &self.name, &self.pod).await;
        tracing::info!(pod = %self.id(), "terminated and deleted");
    }

    async fn pre_stop(&self, hook: &LifecycleHandler) -> Result<()> {
        if let Some(exec) = &hook.exec {
            let cmd = exec.command.clone().unwrap_or_default();
            if cmd.is_empty() {
                bail!("preStop exec has an empty command");
            }
            let env = self.env(None)?;
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
            probe::http_get(
                get,
                &self.container,
                IpAddr::V4(self.net.ip),
                Duration::from_secs(3600),
            )
            .await
            .map_err(|e| anyhow!(e))?;
        }
        Ok(())
    }

    fn conditions(&self, ready: bool) -> Value {
        let s = if ready { "True" } else { "False" };
        json!([
            {"type": "PodReadyToStartContainers", "status": "True"},
            {"type": "Initialized", "status": "True"},
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

    async fn patch_status(&self, ready: bool, started: bool, state: Value, phase: Option<&str>) {
        let mut st = self.status_base(ready, phase.unwrap_or("Running"));
        st.insert(
            "containerStatuses".into(),
            json!([{
                "name": self.container.name, "image": self.container.image, "imageID": "",
                "ready": ready, "started": started, "restartCount": self.restart_count,
                "state": state,
            }]),
        );
        self.send(Value::Object(st)).await;
    }

    async fn patch_status_last(&self, state: Value, last: Value) {
        let mut st = self.status_base(false, "Running");
        st.insert(
            "containerStatuses".into(),
            json!([{
                "name": self.container.name, "image": self.container.image, "imageID": "",
                "ready": false, "started": false, "restartCount": self.restart_count,
                "state": state, "lastState": last,
            }]),
        );
        self.send(Value::Object(st)).await;
    }

    async fn send(&self, status: Value) {
        // Strategic merge: conditions merge by type and container statuses by name, keeping
        // what the scheduler wrote (PodScheduled).
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
}

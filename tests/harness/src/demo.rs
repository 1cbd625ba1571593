//! The demo of `make demo` (`tests/demo` runs the `hearth-demo` binary, which prints what
//! [`run`] returns) and of the end-to-end suite `tests/e2e/tests/demo.rs`, which asserts on it:
//! installs Hearth with its Helm chart (`tests/cluster/install-hearth`: the chart and the images
//! of `build/images` pushed to the cluster's registry, installed from there), applies the quickstart runtime and model of
//! `examples/quickstart/` (once per KEDA scaler mode, each in its own namespace), and measures a
//! cold streaming request in each mode: the request, KEDA's 0 → 1, the backend pod scheduled,
//! started and Ready on the real node, the tokens, and the way back to 0.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ListParams, PostParams};
use kube::{Api, Client};
use serde_json::Value;

use crate::client::{self, ChatError, Event, Trace};
use crate::stack::{self, ScalerMode, StackError};
use crate::timeline::{PodMilestones, PodTimeline, Sample, Timeline};

/// The quickstart LLMService's name and served model name (examples/quickstart/llmservice.yaml).
pub const SERVICE: &str = "quickstart";
/// Its backend Deployment.
pub const BACKEND: &str = "quickstart";
/// The scaler modes the demo runs, in order.
pub const MODES: [ScalerMode; 2] = [ScalerMode::Poll, ScalerMode::Push];

/// The namespace of each mode's copy of the quickstart service: poll mode is the example as
/// written, push mode the same manifest in a namespace of its own, so that each mode's cold
/// start is a first activation.
pub fn namespace(mode: ScalerMode) -> &'static str {
    match mode {
        ScalerMode::Poll => "hearth-demo",
        ScalerMode::Push => "hearth-demo-push",
    }
}

/// The manifests the demo applies (`examples/quickstart/`).
pub fn quickstart_dir() -> PathBuf {
    stack::examples_dir().join("quickstart")
}

/// Errors of [`run`]; each says what was awaited or what failed.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error(transparent)]
    Stack(#[from] StackError),
    #[error("{what}: {source}")]
    Kube { what: String, source: kube::Error },
    #[error("[{mode}] the cold request failed: {source}")]
    Chat {
        mode: &'static str,
        source: ChatError,
    },
    #[error("[{mode}] the cold request failed: status {status}, events {events:?}")]
    ColdRequest {
        mode: &'static str,
        status: u16,
        events: Vec<Event>,
    },
    #[error(
        "LLMService {namespace}/{SERVICE} not ScaledToZero with the {trigger} trigger after 240 s (phase {phase:?}, trigger {seen:?})"
    )]
    NotScaledToZero {
        namespace: &'static str,
        trigger: &'static str,
        phase: Option<String>,
        seen: Option<Value>,
    },
    #[error("the gateway of {namespace}/{SERVICE} has no ready endpoint after 180 s")]
    NoGateway { namespace: &'static str },
    #[error("{url} (Service {namespace}/{SERVICE}) never accepted a connection from this host")]
    Unreachable {
        url: String,
        namespace: &'static str,
    },
    #[error("namespace {0} is still being deleted after 180 s")]
    NamespaceDeleting(&'static str),
    #[error("kubeconfig {0} has no parent dir")]
    NoStateDir(PathBuf),
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> DemoError {
    let what = what.into();
    move |source| DemoError::Kube { what, source }
}

fn log(msg: impl AsRef<str>) {
    eprintln!("[demo] {}", msg.as_ref());
}

/// What one mode's cold request measured (instants on this host's clock).
#[derive(Clone, Debug)]
pub struct ModeReport {
    /// The scaler mode.
    pub mode: ScalerMode,
    /// The namespace of this mode's copy of the quickstart service.
    pub namespace: &'static str,
    /// The gateway Service's `http://<ClusterIP>:<port>` the request was sent to.
    pub url: String,
    /// The cold streaming request and its answer.
    pub trace: Trace,
    /// The backend Deployment's `(spec.replicas, status.readyReplicas)` from just before the
    /// request until the pod was gone.
    pub samples: Vec<Sample>,
    /// The first backend pod created after the request (default when none was).
    pub pod: PodMilestones,
    /// When the Deployment first asked for a replica after the request.
    pub scaled: Option<Instant>,
    /// When the Deployment first had a ready replica after the request.
    pub ready: Option<Instant>,
    /// When the Deployment was back at 0 desired and 0 ready after the answer.
    pub zero: Option<Instant>,
    /// When no backend pod was listed any more after that.
    pub gone: Option<Instant>,
    base_i: Instant,
    base_w: SystemTime,
}

impl ModeReport {
    /// When the request was sent.
    pub fn sent(&self) -> Instant {
        self.trace.sent
    }

    fn rel(&self, t: Option<Instant>) -> String {
        t.map(|t| {
            format!(
                "{:.2}",
                t.saturating_duration_since(self.sent()).as_secs_f64()
            )
        })
        .unwrap_or_else(|| "-".into())
    }

    fn at(&self, t: Option<Instant>) -> String {
        t.map(|t| wall(t, self.base_i, self.base_w))
            .unwrap_or_else(|| "-".into())
    }

    /// The timeline `hearth-demo` prints for this mode (a blank line first).
    pub fn timeline_text(&self) -> String {
        let m = self.mode.annotation();
        let t0 = Some(self.sent());
        let (pod, first, last) = (&self.pod, self.trace.first_token(), self.trace.last_token());
        let describe = match self.mode {
            ScalerMode::Poll => "KEDA metrics-api polls /hearth/queue on each gateway endpoint",
            ScalerMode::Push => "KEDA external-push, the gateway's ExternalScaler streams demand",
        };
        [
            String::new(),
            format!("Timeline [{m} mode: {describe}]"),
            format!("  {}  +0.00s  request sent (stream: true)", self.at(t0)),
            format!(
                "  {}  +{}s  scaled 0 → 1 (Deployment spec.replicas)",
                self.at(self.scaled),
                self.rel(self.scaled)
            ),
            format!(
                "  {}  +{}s  backend pod {} scheduled to a node",
                self.at(pod.scheduled),
                self.rel(pod.scheduled),
                pod.name
            ),
            format!(
                "  {}  +{}s  its containers started (the kubelet ran them)",
                self.at(pod.started),
                self.rel(pod.started)
            ),
            format!(
                "  {}  +{}s  pod Ready (readiness probe on /health); Deployment ready {}s",
                self.at(pod.ready),
                self.rel(pod.ready),
                self.rel(self.ready)
            ),
            format!(
                "  {}  +{}s  first token ({} SSE heartbeats before it)",
                self.at(first),
                self.rel(first),
                self.trace.heartbeats()
            ),
            format!(
                "  {}  +{}s  last token; 200, [DONE]: \"{}\"",
                self.at(last),
                self.rel(last),
                self.trace.text().trim()
            ),
            format!(
                "  {}  +{}s  back to 0",
                self.at(self.zero),
                self.rel(self.zero)
            ),
            format!(
                "  {}  +{}s  backend pod gone (preStop drain ended)",
                self.at(self.gone),
                self.rel(self.gone)
            ),
        ]
        .map(|line| line + "\n")
        .concat()
    }

    /// This mode's row of the table `hearth-demo` prints (seconds after the request, `-` for
    /// what was not seen).
    pub fn table_row(&self) -> String {
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            self.mode.annotation(),
            self.rel(self.scaled),
            self.rel(self.pod.scheduled),
            self.rel(self.pod.started),
            self.rel(self.pod.ready),
            self.rel(self.trace.first_token()),
            self.rel(self.trace.last_token()),
            self.rel(self.zero),
            self.rel(self.gone)
        )
    }
}

/// What a whole run of the demo measured.
#[derive(Clone, Debug)]
pub struct DemoReport {
    /// The cluster's kubeconfig.
    pub kubeconfig: PathBuf,
    /// The cluster's state dir (the kubeconfig's dir: `bin/`, `logs/`).
    pub state: PathBuf,
    /// Whether this run installed Hearth (false when the release was already current).
    pub installed: bool,
    /// One report per mode, in the order of [`MODES`].
    pub modes: Vec<ModeReport>,
    /// The address of the printed `curl` line: the poll mode's gateway Service.
    pub url: String,
}

impl DemoReport {
    /// The `curl` command `hearth-demo` prints (two lines, indented).
    pub fn curl_command(&self) -> String {
        format!(
            "  curl -N {}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{SERVICE}\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'",
            self.url
        )
    }

    /// What `hearth-demo` prints after the timelines: the table of both modes, the `curl` line
    /// and where to look next (a blank line first).
    pub fn summary_text(&self) -> String {
        let mut lines = vec![
            String::new(),
            "Cold activation, both scaler modes, this run (seconds after the request was sent):"
                .to_string(),
            String::new(),
            "| mode | scaled 0 → 1 | pod scheduled | container started | pod Ready | first token | last token | back to 0 | pod gone |".to_string(),
            "|---|---|---|---|---|---|---|---|---|".to_string(),
        ];
        lines.extend(self.modes.iter().map(ModeReport::table_row));
        lines.extend([
            String::new(),
            "Hearth is running. Talk to the model from this host, through the gateway Service's ClusterIP (the host routes the Service range into the node, where kube-proxy forwards it):".to_string(),
            self.curl_command(),
            format!(
                "  export KUBECONFIG={} PATH={}/bin:$PATH; kubectl get llmservice,pods -A -w",
                self.kubeconfig.display(),
                self.state.display()
            ),
            format!(
                "Logs: kubectl -n hearth-system logs deploy/hearth-controller (and deploy/hearth-webhook), {}/logs/  Stop everything: tests/cluster/down",
                self.state.display()
            ),
        ]);
        lines.into_iter().map(|line| line + "\n").collect()
    }
}

/// Runs the demo on the cluster of `kubeconfig` (a state dir of `tests/cluster/up`): installs
/// Hearth unless current, applies the quickstart runtime and both copies of its model in the
/// namespaces of [`namespace`] (made when absent, kept afterwards), and sends one cold streaming
/// request per mode, waiting each time until the backend is back at 0 and its pod gone.
/// `on_mode` sees each mode's report as soon as it is complete. Fails when a wait for the
/// starting state times out or the cold request is not answered `200` with `[DONE]`; what
/// happened after the answer is reported, not judged.
pub async fn run(
    client: &Client,
    kubeconfig: &Path,
    mut on_mode: impl FnMut(&ModeReport),
) -> Result<DemoReport, DemoError> {
    let state = kubeconfig
        .parent()
        .ok_or_else(|| DemoError::NoStateDir(kubeconfig.to_path_buf()))?
        .to_path_buf();
    log(
        "installing Hearth with its Helm chart (tests/cluster/install-hearth: images from build/images, webhook and controller as pods on the real node)",
    );
    let install = Instant::now();
    let installed = stack::ensure_hearth(client, kubeconfig).await?;
    if installed {
        log(format!(
            "helm install to a ready webhook and controller: {:.1}s (log {}/logs/install-hearth.log)",
            install.elapsed().as_secs_f64(),
            state.display()
        ));
    } else {
        log("Hearth was already installed with these images (helm release hearth-system/hearth)");
    }
    let examples = quickstart_dir();
    log("applying examples/quickstart/runtime.yaml (InferenceRuntime quickstart-stub)");
    stack::apply_file(client, &examples.join("runtime.yaml"), None).await?;

    let service = stack::first_manifest(&examples.join("llmservice.yaml"))?;
    for mode in MODES {
        let ns = namespace(mode);
        log(format!(
            "applying examples/quickstart/llmservice.yaml as {ns}/{SERVICE} ({} mode)",
            mode.annotation()
        ));
        ensure_namespace(client, ns).await?;
        let mut obj = service.clone();
        obj["metadata"]["namespace"] = Value::from(ns);
        mode.annotate(&mut obj);
        stack::apply(client, obj, None).await?;
    }
    let mut modes = Vec::new();
    for mode in MODES {
        let ns = namespace(mode);
        wait_scaled_to_zero(client, mode).await?;
        wait_gateway(client, mode).await?;
        let url = stack::service_url(client, ns, SERVICE).await?;
        if !stack::wait_reachable(&url, Duration::from_secs(60)).await {
            return Err(DemoError::Unreachable { url, namespace: ns });
        }
        let report = cold_request(client, &url, mode).await?;
        on_mode(&report);
        modes.push(report);
    }
    let url = modes
        .iter()
        .find(|m| m.mode == ScalerMode::Poll)
        .map(|m| m.url.clone())
        .unwrap_or_default();
    Ok(DemoReport {
        kubeconfig: kubeconfig.to_path_buf(),
        state,
        installed,
        modes,
        url,
    })
}

/// Creates the namespace unless it exists; one still being deleted (a run before this one
/// removed it) is waited out first.
async fn ensure_namespace(client: &Client, name: &'static str) -> Result<(), DemoError> {
    let api: Api<Namespace> = Api::all(client.clone());
    let start = Instant::now();
    loop {
        let ns = api
            .get_opt(name)
            .await
            .map_err(kube_err(format!("reading namespace {name}")))?;
        match ns {
            Some(ns) if ns.metadata.deletion_timestamp.is_none() => return Ok(()),
            Some(_) if start.elapsed() > Duration::from_secs(180) => {
                return Err(DemoError::NamespaceDeleting(name));
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            None => {
                let ns = Namespace {
                    metadata: ObjectMeta {
                        name: Some(name.to_string()),
                        ..Default::default()
                    },
                    ..Default::default()
                };
                api.create(&PostParams::default(), &ns)
                    .await
                    .map_err(kube_err(format!("creating namespace {name}")))?;
                return Ok(());
            }
        }
    }
}

async fn wait_scaled_to_zero(client: &Client, mode: ScalerMode) -> Result<(), DemoError> {
    let ns = namespace(mode);
    let trigger = mode.trigger();
    let so = stack::scaled_objects(client, ns);
    log(format!(
        "[{}] waiting for phase ScaledToZero and the {trigger} trigger",
        mode.annotation()
    ));
    let start = Instant::now();
    loop {
        let phase = stack::phase(client, ns, SERVICE).await?;
        let seen = so
            .get_opt(SERVICE)
            .await
            .map_err(kube_err(format!("reading ScaledObject {ns}/{SERVICE}")))?
            .map(|o| o.data["spec"]["triggers"][0]["type"].clone());
        if phase.as_deref() == Some("ScaledToZero")
            && seen.as_ref().and_then(Value::as_str) == Some(trigger)
        {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(240) {
            return Err(DemoError::NotScaledToZero {
                namespace: ns,
                trigger,
                phase,
                seen,
            });
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn wait_gateway(client: &Client, mode: ScalerMode) -> Result<(), DemoError> {
    let ns = namespace(mode);
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={SERVICE}"));
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let gw = ListParams::default().labels(stack::GATEWAY_PODS);
    let start = Instant::now();
    loop {
        let ready = api
            .list(&lp)
            .await
            .map_err(kube_err(format!(
                "listing the EndpointSlices of Service {ns}/{SERVICE}"
            )))?
            .items
            .iter()
            .flat_map(|s| &s.endpoints)
            .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false));
        // A scaler-mode switch re-renders the gateway: wait until the rollout is over, so the
        // request does not land on a replica being replaced.
        let gws = pods
            .list(&gw)
            .await
            .map_err(kube_err(format!("listing the gateway pods of {ns}")))?
            .items;
        let settled = gws.len() == 1 && gws[0].metadata.deletion_timestamp.is_none();
        if ready && settled {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(180) {
            return Err(DemoError::NoGateway { namespace: ns });
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// `t` as wall-clock `HH:MM:SS.mmm` (UTC), from a pair of instant and wall-clock readings.
fn wall(t: Instant, base_i: Instant, base_w: SystemTime) -> String {
    let w = base_w + t.saturating_duration_since(base_i);
    let ts = k8s_openapi::jiff::Timestamp::try_from(w)
        .map(|t| t.to_string())
        .unwrap_or_default();
    ts.get(11..23).unwrap_or(&ts).to_string()
}

async fn cold_request(
    client: &Client,
    url: &str,
    mode: ScalerMode,
) -> Result<ModeReport, DemoError> {
    let m = mode.annotation();
    let ns = namespace(mode);
    let tl = Timeline::start(client.clone(), ns, BACKEND);
    let pod_tl = PodTimeline::start(client.clone(), ns, &stack::backend_pods(SERVICE));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let base_w = SystemTime::now();
    let base_i = Instant::now();
    log(format!(
        "[{m}] sending a cold streaming chat completion to {url}"
    ));
    let trace = client::chat(url, SERVICE, true, Duration::from_secs(300))
        .await
        .map_err(|source| DemoError::Chat { mode: m, source })?;
    if trace.status != 200 || !trace.complete() {
        return Err(DemoError::ColdRequest {
            mode: m,
            status: trace.status,
            events: trace.events.into_iter().map(|(_, e)| e).collect(),
        });
    }
    let t0 = trace.sent;
    log(format!(
        "[{m}] answered; waiting for the backend to go back to 0 (idle; scaleDownStabilization 15s)"
    ));
    let start = Instant::now();
    let zero = loop {
        if let Some(z) = tl.first_after(trace.end, |s| s.desired == 0 && s.ready == 0) {
            break Some(z);
        }
        if start.elapsed() > Duration::from_secs(240) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // The idle pod leaves once its preStop drain (the hearth-drain sidecar) has seen the engine
    // idle for the settle time, not after the whole drainTimeout.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&stack::backend_pods(SERVICE));
    let gone = match zero {
        None => None,
        Some(_) => loop {
            let listed = pods
                .list(&lp)
                .await
                .map_err(kube_err(format!("listing the backend pods of {ns}")))?;
            if listed.items.is_empty() {
                break Some(Instant::now());
            }
            if start.elapsed() > Duration::from_secs(300) {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        },
    };
    Ok(ModeReport {
        mode,
        namespace: ns,
        url: url.to_string(),
        scaled: tl.first_after(t0, |s| s.desired >= 1),
        ready: tl.first_after(t0, |s| s.ready >= 1),
        samples: tl.samples(),
        pod: pod_tl.first_after(t0).unwrap_or_default(),
        zero,
        gone,
        trace,
        base_i,
        base_w,
    })
}

//! The Helm release of `charts/hearth` on the real node, for real, through its whole life:
//!
//! 1. install (or upgrade to this checkout) with `tests/cluster/install-hearth`; the release
//!    works: the upstream stub runtime and service get a gateway on the real node and reach
//!    `ScaledToZero`, an invalid LLMService is denied by the chart's webhook, an annotated
//!    Deployment is mutated (accelerator, probes, the `hearth-drain` native sidecar) and its pod
//!    runs on the real node;
//! 2. under a steady stream of admissions (annotated Deployments created and updated, LLMService
//!    edits, invalid LLMServices that must be denied) and of chat requests through the stub
//!    service's gateway, `helm upgrade` to a new image tag, then `helm rollback`: not one
//!    admission or request may fail, and the webhook and controller pods roll
//!    both times (the LLMService's gateway follows the gateway image);
//! 3. `helm uninstall` with the chat requests going on (the admissions stop first: after the
//!    uninstall nothing mutates or denies them): not one request fails, since the LLMService's
//!    gateway and backend are not the release's; no webhook configuration is left that could refuse a request, CRDs and
//!    the LLMService stay, nothing left behind holds a finalizer, and an annotated Deployment is
//!    then created as any other;
//! 4. install again: other suites share the release (also when this test fails half-way).
//!
//! The loads of step 2 run as [`Loads`]: each is a task that runs until stopped and counts
//! what succeeded and what failed per phase of the release: the admissions, and chat requests
//! (streaming and not) through the stub service's gateway, whose pods roll with the release.
//!
//! Holds `<state>/install-hearth.lock` (the harness's install lock) throughout, so a suite
//! starting meanwhile waits for the release instead of installing over it. Needs a cluster
//! with its real node (`tests/cluster/up` as root) and Hearth's images (`build/images`).

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::{service_url, wait_reachable};
use hearth_test_support::{
    Cluster, Observed, RealNode, TestNamespace, describe_pods, upstream_file, wait_until,
};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
    PostParams,
};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const RELEASE: &str = "hearth";
const RELEASE_NAMESPACE: &str = "hearth-system";
/// The image tag the upgrade moves to: `install-hearth --image-tag` pushes the images under it
/// to the cluster's registry too (the chart keeps pinning the same digests).
const UPGRADE_TAG: &str = "e2e-upgrade";
/// The stub runtime's name (upstream `stub-inferenceruntime.yaml`) and its accelerator.
const RUNTIME: &str = "vllm-stub";
const ACCELERATOR: &str = "hearth.dev/fake-gpu";
const STUB_IMAGE: &str = "hearth.dev/vllm-stub:e2e";
/// Field manager of what this test applies.
const MANAGER: &str = "hearth-e2e-helm";
/// The webhook's own message for an unsupported model URI (the CRD accepts any string).
const URI_DENIAL: &str = "spec.model.source.uri: has unsupported scheme";
/// Pods to start, objects to be reconciled; generous, the machine has 2 cores. (Helm's own
/// steps are bounded by their --timeout: 5m, as install-hearth's.)
const POD_TIMEOUT: Duration = Duration::from_secs(120);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs a command to completion on a blocking thread; fails with its output unless it exits 0.
async fn run(mut cmd: Command, what: String) -> Result<String> {
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await?
        .with_context(|| format!("starting {what}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "{what} failed ({}):\n{text}",
        out.status
    );
    Ok(text)
}

/// `tests/cluster/install-hearth [args]` against the cluster of `kubeconfig`, recording the
/// images' build id as the harness does (so the suites after this one keep the release).
fn install_command(kubeconfig: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(repo().join("tests/cluster/install-hearth"));
    cmd.args(args)
        .args(hearth_e2e_harness::stack::images_build_args())
        .env("KUBECONFIG", kubeconfig)
        .env(
            "HEARTH_CLUSTER_STATE",
            kubeconfig.parent().unwrap_or(Path::new(".")),
        );
    cmd
}

/// Runs install-hearth and returns its summary line (the install's timing).
async fn install(kubeconfig: &Path, args: &[&str]) -> Result<String> {
    let out = run(
        install_command(kubeconfig, args),
        format!("tests/cluster/install-hearth {}", args.join(" ")),
    )
    .await?;
    Ok(out
        .lines()
        .find(|l| l.starts_with("hearth installed") || l.starts_with("hearth upgraded"))
        .unwrap_or("install-hearth printed no summary")
        .to_owned())
}

/// The cluster's helm (linked into the state dir by `tests/cluster/up`, beside the
/// kubeconfig), pointed at the cluster.
fn helm(kubeconfig: &Path, args: &[&str]) -> Result<Command> {
    let bin = kubeconfig
        .parent()
        .unwrap_or(Path::new("."))
        .join("bin")
        .join("helm");
    ensure!(
        bin.is_file(),
        "no helm at {}: run tests/cluster/up",
        bin.display()
    );
    let mut cmd = Command::new(bin);
    cmd.arg("--kubeconfig").arg(kubeconfig).args(args);
    Ok(cmd)
}

/// While armed, installs the release again when dropped: a test that fails after the upgrade
/// or the uninstall still leaves the release as other suites expect it.
struct Reinstall {
    kubeconfig: PathBuf,
    armed: bool,
}

impl Drop for Reinstall {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        eprintln!("helm_lifecycle: installing the release again after a failure");
        let mut cmd = install_command(&self.kubeconfig, &[]);
        match std::thread::spawn(move || cmd.output()).join() {
            Ok(Ok(out)) if out.status.success() => {}
            Ok(Ok(out)) => eprintln!(
                "warning: install-hearth failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
            other => eprintln!("warning: install-hearth did not run: {other:?}"),
        }
    }
}

// --- loads --------------------------------------------------------------------------------

/// What one load did, per phase of the release.
#[derive(Default, Debug)]
struct Tally {
    ok: BTreeMap<String, u64>,
    /// (phase, seconds since the loads started, what failed and how).
    failed: Vec<(String, f64, String)>,
}

impl Tally {
    fn total_ok(&self) -> u64 {
        self.ok.values().sum()
    }
}

/// What a load task sees: whether to stop, and where to count each operation (under the phase
/// the release is in at that moment).
#[derive(Clone)]
struct LoadCtx {
    stop: watch::Receiver<bool>,
    phase: Arc<Mutex<String>>,
    started: Instant,
    tally: Arc<Mutex<Tally>>,
}

impl LoadCtx {
    fn stopped(&self) -> bool {
        *self.stop.borrow()
    }

    /// Counts one operation; `what` names it in the failure.
    fn record(&self, what: &str, outcome: Result<()>) {
        let phase = self.phase.lock().map(|p| p.clone()).unwrap_or_default();
        let Ok(mut tally) = self.tally.lock() else {
            return;
        };
        match outcome {
            Ok(()) => *tally.ok.entry(phase).or_default() += 1,
            Err(e) => tally.failed.push((
                phase,
                self.started.elapsed().as_secs_f64(),
                format!("{what}: {}", brief(&e)),
            )),
        }
    }
}

/// An error in one line: the apiserver's message for API errors (kube's own text repeats the
/// whole Status), the chain otherwise.
fn brief(e: &anyhow::Error) -> String {
    match e.downcast_ref::<kube::Error>() {
        Some(kube::Error::Api(s)) => format!("{} {}: {}", s.code, s.reason, s.message),
        _ => format!("{e:#}"),
    }
}

/// Background loads that run while the release changes: each runs until told to stop and
/// counts its operations through its [`LoadCtx`].
struct Loads {
    stop: watch::Sender<bool>,
    phase: Arc<Mutex<String>>,
    started: Instant,
    tasks: Vec<RunningLoad>,
}

/// One load started by [`Loads::spawn`].
struct RunningLoad {
    name: &'static str,
    tally: Arc<Mutex<Tally>>,
    task: JoinHandle<Result<()>>,
}

impl Loads {
    fn new() -> Self {
        Self {
            stop: watch::channel(false).0,
            phase: Arc::new(Mutex::new("steady".to_owned())),
            started: Instant::now(),
            tasks: Vec::new(),
        }
    }

    /// Starts a load: `load` runs until its context says stop. An error it returns (it could
    /// not run at all) fails [`Loads::finish`]; failed operations are counted, not returned.
    fn spawn<F, Fut>(&mut self, name: &'static str, load: F)
    where
        F: FnOnce(LoadCtx) -> Fut,
        Fut: Future<Output = Result<()>> + Send + 'static,
    {
        let tally = Arc::new(Mutex::new(Tally::default()));
        let ctx = LoadCtx {
            stop: self.stop.subscribe(),
            phase: self.phase.clone(),
            started: self.started,
            tally: tally.clone(),
        };
        self.tasks.push(RunningLoad {
            name,
            tally,
            task: tokio::spawn(load(ctx)),
        });
    }

    /// Another set of loads, stopped on its own, that shares this one's phase and clock.
    fn sharing_phase(&self) -> Self {
        Self {
            stop: watch::channel(false).0,
            phase: self.phase.clone(),
            started: self.started,
            tasks: Vec::new(),
        }
    }

    /// Names the phase the release is in from now on.
    fn phase(&self, phase: &str) {
        if let Ok(mut p) = self.phase.lock() {
            *p = phase.to_owned();
        }
    }

    /// Waits until every load has done `min` operations successfully in the current phase.
    async fn settle(&self, min: u64) -> Result<()> {
        let phase = self.phase.lock().map(|p| p.clone()).unwrap_or_default();
        wait_until(
            format!("{min} successful operations of every load in phase {phase:?}"),
            Duration::from_secs(60),
            || {
                let behind: Vec<String> = self
                    .tasks
                    .iter()
                    .filter_map(|RunningLoad { name, tally, task }| {
                        let t = tally.lock().ok()?;
                        let n = t.ok.get(&phase).copied().unwrap_or(0);
                        (n < min || task.is_finished()).then(|| {
                            format!(
                                "{name}: {n} ok, {} failed{}",
                                t.failed.len(),
                                if task.is_finished() { ", ended" } else { "" }
                            )
                        })
                    })
                    .collect();
                async move {
                    Ok(if behind.is_empty() {
                        Observed::Ready(())
                    } else {
                        Observed::NotYet(behind.join("; "))
                    })
                }
            },
        )
        .await
    }

    /// Stops every load and returns their tallies.
    async fn finish(mut self) -> Result<Vec<(&'static str, Tally)>> {
        let _ = self.stop.send(true);
        let mut out = Vec::new();
        for RunningLoad { name, tally, task } in std::mem::take(&mut self.tasks) {
            task.await
                .with_context(|| format!("load {name} panicked"))?
                .with_context(|| format!("load {name}"))?;
            let tally =
                std::mem::take(&mut *tally.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
            out.push((name, tally));
        }
        Ok(out)
    }
}

impl Drop for Loads {
    /// A test that fails before [`Loads::finish`] stops its loads too.
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        for t in &self.tasks {
            t.task.abort();
        }
    }
}

// --- objects --------------------------------------------------------------------------------

fn llmservices(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("serving.hearth.dev", "v1alpha1", "LLMService");
    Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::from_gvk_with_plural(&gvk, "llmservices"),
    )
}

fn inferenceruntimes(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("serving.hearth.dev", "v1alpha1", "InferenceRuntime");
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "inferenceruntimes"),
    )
}

fn yaml_file(name: &str) -> Result<Value> {
    let path = upstream_file(name);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// An LLMService that only the webhook refuses: the CRD takes any URI.
fn invalid_service(namespace: &str, name: &str) -> Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"model": {"source": {"uri": "s3://bucket/model"}}, "runtime": {"name": RUNTIME}},
    }))?)
}

/// Creating `obj` must be denied by the webhook's own check (`dry_run` or not).
async fn expect_denied(api: &Api<DynamicObject>, obj: &DynamicObject, dry_run: bool) -> Result<()> {
    let pp = PostParams {
        dry_run,
        ..PostParams::default()
    };
    match api.create(&pp, obj).await {
        Ok(_) => bail!("an LLMService with an s3:// model URI was admitted"),
        Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains(URI_DENIAL) => Ok(()),
        Err(e) => bail!("not the webhook's denial: {}", brief(&e.into())),
    }
}

/// A plain Deployment opted into Hearth by the runtime annotation, running the stub.
fn annotated_deployment(name: &str, replicas: i32) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {"serving.hearth.dev/runtime": RUNTIME}},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{
                    "name": "vllm",
                    "image": STUB_IMAGE,
                    "args": ["--model=/models/stub", format!("--served-model-name={name}")],
                    "ports": [{"name": "http", "containerPort": 8000}],
                }]},
            },
        },
    }))?)
}

/// What the webhook adds to an annotated Deployment of the stub runtime: the accelerator
/// limit, the runtime's probes and the `hearth-drain` native sidecar (on `drain_image` when
/// given) with the model container's preStop pointing at it.
fn check_mutated(d: &Deployment, drain_image: Option<&str>) -> Result<()> {
    let spec = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("no pod spec")?;
    let c = spec.containers.first().context("no container")?;
    let limit = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get(ACCELERATOR))
        .map(|q| q.0.as_str());
    ensure!(
        limit == Some("1"),
        "not mutated: {ACCELERATOR} limit {limit:?}"
    );
    ensure!(
        c.startup_probe.is_some() && c.readiness_probe.is_some(),
        "the runtime's probes are missing"
    );
    let sidecar = spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "hearth-drain")
        .context("no hearth-drain sidecar")?;
    ensure!(
        sidecar.restart_policy.as_deref() == Some("Always"),
        "hearth-drain is not a native sidecar (restartPolicy {:?})",
        sidecar.restart_policy
    );
    if let Some(image) = drain_image {
        ensure!(
            sidecar.image.as_deref() == Some(image),
            "hearth-drain runs {:?}, not {image}",
            sidecar.image
        );
    }
    let hook = c
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|p| p.http_get.as_ref());
    ensure!(
        hook.is_some_and(|h| h.path.as_deref() == Some("/drain")),
        "the preStop is not the sidecar's GET /drain: {:?}",
        c.lifecycle
    );
    Ok(())
}

/// Running, not terminating, pods of one of the release's components, as (name, image).
async fn component_pods(client: &Client, component: &str) -> Result<Vec<(String, String)>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let lp = ListParams::default().labels(&format!(
        "app.kubernetes.io/instance={RELEASE},app.kubernetes.io/component={component}"
    ));
    Ok(pods
        .list(&lp)
        .await?
        .items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let image = p
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .and_then(|c| c.image.clone())
                .unwrap_or_default();
            (p.metadata.name.unwrap_or_default(), image)
        })
        .collect())
}

/// The webhook's and the controller's current pods.
async fn release_pods(client: &Client) -> Result<BTreeMap<&'static str, Vec<(String, String)>>> {
    let mut out = BTreeMap::new();
    for component in ["webhook", "controller"] {
        out.insert(component, component_pods(client, component).await?);
    }
    Ok(out)
}

/// Both components run only new pods (none of `before`), all on images tagged `tag`, as many
/// as their Deployments ask for.
async fn assert_rolled(
    client: &Client,
    before: &BTreeMap<&'static str, Vec<(String, String)>>,
    tag: &str,
) -> Result<BTreeMap<&'static str, Vec<(String, String)>>> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    wait_until(
        format!("the webhook and controller pods to roll to :{tag}"),
        Duration::from_secs(60),
        || async {
            let now = release_pods(client).await?;
            for (component, pods) in &now {
                let want = deployments
                    .get(&format!("hearth-{component}"))
                    .await?
                    .spec
                    .and_then(|s| s.replicas)
                    .unwrap_or(1) as usize;
                let old: BTreeSet<&String> = before[component].iter().map(|(n, _)| n).collect();
                let rolled = pods.len() == want
                    && pods
                        .iter()
                        .all(|(n, image)| !old.contains(n) && tag_of(image) == tag);
                if !rolled {
                    return Ok(Observed::NotYet(format!(
                        "{component}: {pods:?} (before: {:?})",
                        before[component]
                    )));
                }
            }
            Ok(Observed::Ready(now))
        },
    )
    .await
}

/// The image tag of a reference (`registry/repo:tag`, or `registry/repo:tag@digest` as the
/// pushed chart pins its images).
fn tag_of(image: &str) -> &str {
    let name = image.split_once('@').map_or(image, |(n, _)| n);
    name.rsplit_once(':').map_or("", |(_, t)| t)
}

/// The gateway image the chart's controller renders (`--gateway-image`).
async fn gateway_image(client: &Client) -> Result<String> {
    let d = Api::<Deployment>::namespaced(client.clone(), RELEASE_NAMESPACE)
        .get("hearth-controller")
        .await?;
    d.spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.args)
        .into_iter()
        .flatten()
        .find_map(|a| a.strip_prefix("--gateway-image=").map(str::to_owned))
        .context("the controller has no --gateway-image")
}

/// Waits until the stub service's gateway Deployment runs `image` and a pod of it is Running
/// and Ready on the real node.
async fn wait_gateway(ns: &TestNamespace, node: &RealNode, image: &str) -> Result<()> {
    let pods = ns
        .wait_for_pods(
            &format!("a Ready gateway pod on {} running {image}", node.name),
            "app.kubernetes.io/component=gateway,serving.hearth.dev/gateway=stub-svc",
            POD_TIMEOUT,
            |pods| {
                pods.iter().any(|p| {
                    p.metadata.deletion_timestamp.is_none()
                        && p.spec.as_ref().is_some_and(|s| {
                            s.node_name.as_deref() == Some(node.name.as_str())
                                && s.containers.first().and_then(|c| c.image.as_deref())
                                    == Some(image)
                        })
                        && hearth_test_support::pod_ready(p)
                })
            },
        )
        .await?;
    println!("gateway: {}", describe_pods(&pods));
    Ok(())
}

async fn wait_phase(client: &Client, ns: &str, name: &str, want: &str) -> Result<()> {
    let api = llmservices(client, ns);
    wait_until(
        format!("LLMService {ns}/{name} to reach phase {want}"),
        POD_TIMEOUT,
        || async {
            let obj = api.get(name).await?;
            let phase = obj.data["status"]["phase"]
                .as_str()
                .unwrap_or("")
                .to_owned();
            Ok(if phase == want {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("phase {phase:?}, status {}", obj.data["status"]))
            })
        },
    )
    .await
}

// --- the admission load ---------------------------------------------------------------------

/// Admissions through the chart's webhook, one after another until stopped: create an
/// annotated Deployment (0 replicas: admission only) and check it came back mutated; update it;
/// edit the stub LLMService (an annotation every time, `spec.scaling.max` every fifth round); a
/// dry run of an invalid LLMService, which must come back denied by the webhook; and delete the
/// Deployment of three rounds ago (deletes do not reach Hearth's webhooks).
async fn admission_load(ctx: LoadCtx, client: Client, namespace: String) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &namespace);
    let services = llmservices(&client, &namespace);
    let invalid = invalid_service(&namespace, "load-invalid")?;
    let mut round = 0u64;
    while !ctx.stopped() {
        round += 1;
        let name = format!("load-{round}");
        let created = async {
            let d = deployments
                .create(&PostParams::default(), &annotated_deployment(&name, 0)?)
                .await?;
            check_mutated(&d, None)
        }
        .await;
        let exists = created.is_ok();
        ctx.record(&format!("create Deployment {name}"), created);
        let round_annotation =
            json!({"metadata": {"annotations": {"tests.hearth.dev/round": round.to_string()}}});
        // An update of what exists (a failed create is counted once, not again as its update).
        if exists {
            let updated = async {
                let d = deployments
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(&round_annotation),
                    )
                    .await?;
                check_mutated(&d, None)
            }
            .await;
            ctx.record(&format!("update Deployment {name}"), updated);
        }
        let mut edit = round_annotation.clone();
        if round.is_multiple_of(5) {
            edit["spec"] = json!({"scaling": {"max": 2 + (round / 5) % 2}});
        }
        let edited = services
            .patch("stub-svc", &PatchParams::default(), &Patch::Merge(&edit))
            .await
            .map(|_| ())
            .map_err(anyhow::Error::from);
        ctx.record("edit LLMService stub-svc", edited);
        ctx.record(
            "dry-run create of an invalid LLMService",
            expect_denied(&services, &invalid, true).await,
        );
        if round > 3 {
            let _ = deployments
                .delete(&format!("load-{}", round - 3), &DeleteParams::default())
                .await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Chat completions through the stub service's gateway (its Service's ClusterIP), one after
/// another until stopped: streaming and not, each must end `200` with every token (and
/// `[DONE]` for a stream). The gateway is re-rendered with the new image on an upgrade and a
/// rollback, so its pods roll under this load too.
async fn chat_load(ctx: LoadCtx, url: String) -> Result<()> {
    const TOKENS: u32 = 4;
    let mut round = 0u64;
    while !ctx.stopped() {
        round += 1;
        let stream = round % 2 == 1;
        let outcome = async {
            let t = client::chat_with(
                &url,
                "stub-svc",
                stream,
                Some(TOKENS),
                Duration::from_secs(150),
            )
            .await?;
            ensure!(t.status == 200, "status {}: {}", t.status, t.body);
            if stream {
                ensure!(
                    t.complete() && t.tokens(None) == TOKENS as usize,
                    "stream ended after {} of {TOKENS} tokens: {:?}",
                    t.tokens(None),
                    t.events.iter().rev().take(3).collect::<Vec<_>>()
                );
            }
            Ok(())
        }
        .await;
        ctx.record(
            if stream {
                "streaming chat completion"
            } else {
                "chat completion"
            },
            outcome,
        );
    }
    Ok(())
}

// --- the test -------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn install_upgrade_rollback_uninstall_under_admission_load() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    let kubeconfig = cluster.kubeconfig().to_path_buf();
    let node = RealNode::load()?;
    // The harness's install lock, held to the end: suites wait instead of installing over us.
    let lock_path = kubeconfig
        .parent()
        .context("kubeconfig has no dir")?
        .join("install-hearth.lock");
    let lock = std::fs::File::create(&lock_path)
        .with_context(|| format!("creating {}", lock_path.display()))?;
    let _lock = tokio::task::spawn_blocking(move || lock.lock().map(|()| lock))
        .await?
        .with_context(|| format!("locking {}", lock_path.display()))?;
    let mut reinstall = Reinstall {
        kubeconfig: kubeconfig.clone(),
        armed: true,
    };

    // 1. Install (or bring the release to this checkout) and prove it works.
    let t = Instant::now();
    let summary = install(&kubeconfig, &[]).await?;
    println!(
        "install: {summary} ({:.1}s in all)",
        t.elapsed().as_secs_f64()
    );
    let first = release_pods(&client).await?;
    let tag0 = tag_of(&first["webhook"].first().context("no webhook pod")?.1).to_owned();
    ensure!(
        tag0 != UPGRADE_TAG,
        "the release already runs :{UPGRADE_TAG} after install-hearth without --image-tag"
    );
    let gateway0 = gateway_image(&client).await?;

    let runtime = yaml_file("stub-inferenceruntime.yaml")?;
    inferenceruntimes(&client)
        .patch(
            RUNTIME,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&runtime),
        )
        .await
        .context("applying the upstream stub InferenceRuntime")?;
    let ns = cluster.namespace("e2e-helm").await?;
    let mut service = yaml_file("stub-llmservice.yaml")?;
    service["metadata"]["namespace"] = json!(ns.name());
    let services = llmservices(&client, ns.name());
    services
        .patch(
            "stub-svc",
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&service),
        )
        .await
        .context("applying the upstream stub LLMService")?;
    wait_gateway(&ns, &node, &gateway0).await?;
    wait_phase(&client, ns.name(), "stub-svc", "ScaledToZero").await?;

    expect_denied(&services, &invalid_service(ns.name(), "invalid")?, false)
        .await
        .context("an invalid LLMService")?;

    let deployments: Api<Deployment> = ns.api();
    let d = deployments
        .create(
            &PostParams::default(),
            &annotated_deployment("plain-stub", 1)?,
        )
        .await
        .context("creating an annotated Deployment")?;
    check_mutated(&d, Some(&gateway0)).context("the annotated Deployment")?;
    let pods = ns
        .wait_for_pods(
            &format!("the annotated Deployment's pod Running on {}", node.name),
            "app=plain-stub",
            POD_TIMEOUT,
            |pods| {
                pods.len() == 1
                    && pods.iter().all(|p| {
                        p.spec.as_ref().and_then(|s| s.node_name.as_deref())
                            == Some(node.name.as_str())
                            && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
                    })
            },
        )
        .await?;
    println!("annotated Deployment: {}", describe_pods(&pods));
    // Its fake GPU back for other suites; the load's Deployments have no pods.
    deployments
        .delete("plain-stub", &DeleteParams::default())
        .await?;

    // 2. Upgrade and roll back under load: admissions, and chat requests through the gateway.
    let url = service_url(&client, ns.name(), "stub-svc").await?;
    ensure!(
        wait_reachable(&url, Duration::from_secs(60)).await,
        "{url} never accepted a connection"
    );
    // Two sets: the admissions stop before the uninstall (after it nothing mutates or denies
    // them, by design); the chat requests go on through it.
    let mut loads = Loads::new();
    let mut chats = loads.sharing_phase();
    {
        let (client, namespace) = (client.clone(), ns.name().to_owned());
        loads.spawn("admissions", move |ctx| {
            admission_load(ctx, client, namespace)
        });
    }
    chats.spawn("chat requests", move |ctx| chat_load(ctx, url));
    loads.settle(20).await?;
    chats.settle(20).await?;

    loads.phase("upgrade");
    let t = Instant::now();
    let summary = install(&kubeconfig, &["--image-tag", UPGRADE_TAG]).await?;
    let upgrade_s = t.elapsed().as_secs_f64();
    println!("upgrade to :{UPGRADE_TAG}: {summary} ({upgrade_s:.1}s)");
    let upgraded = assert_rolled(&client, &first, UPGRADE_TAG).await?;
    let gateway1 = gateway_image(&client).await?;
    ensure!(
        tag_of(&gateway1) == UPGRADE_TAG,
        "the controller renders gateways with {gateway1} after the upgrade"
    );
    wait_gateway(&ns, &node, &gateway1).await?;
    loads.phase("after upgrade");
    loads.settle(20).await?;
    chats.settle(20).await?;

    loads.phase("rollback");
    let t = Instant::now();
    run(
        helm(
            &kubeconfig,
            &[
                "rollback",
                RELEASE,
                "--namespace",
                RELEASE_NAMESPACE,
                "--wait",
                "--timeout",
                "5m",
            ],
        )?,
        "helm rollback".to_owned(),
    )
    .await?;
    let rollback_s = t.elapsed().as_secs_f64();
    println!("rollback: {rollback_s:.1}s");
    assert_rolled(&client, &upgraded, &tag0).await?;
    wait_gateway(&ns, &node, &gateway0).await?;
    loads.phase("after rollback");
    loads.settle(20).await?;
    chats.settle(20).await?;

    let tallies = loads.finish().await?;
    check_tallies(
        &tallies,
        &["upgrade", "rollback"],
        "upgraded and rolled back",
    )?;

    // 3. Uninstall, with the chat requests going on: the LLMService's gateway and backend are
    // its own (not the release's), so its clients see nothing.
    chats.phase("uninstall");
    let t = Instant::now();
    run(
        helm(
            &kubeconfig,
            &[
                "uninstall",
                RELEASE,
                "--namespace",
                RELEASE_NAMESPACE,
                "--wait",
                "--timeout",
                "5m",
            ],
        )?,
        "helm uninstall".to_owned(),
    )
    .await?;
    println!("uninstall: {:.1}s", t.elapsed().as_secs_f64());
    // Until the release's pods are gone (their preStop delays and drains): that is the span
    // in which the uninstall could reach a client.
    assert_uninstalled(&client, ns.name()).await?;
    chats.phase("after uninstall");
    chats.settle(20).await?;
    let chat_tallies = chats.finish().await?;
    check_tallies(
        &chat_tallies,
        &["upgrade", "rollback", "uninstall"],
        "upgraded, rolled back and uninstalled",
    )?;

    // The cluster admits opted-in objects as any other now, unchanged.
    let d = deployments
        .create(
            &PostParams::default(),
            &annotated_deployment("after-uninstall", 0)?,
        )
        .await
        .context("creating an annotated Deployment after the uninstall")?;
    ensure!(
        check_mutated(&d, None).is_err(),
        "an annotated Deployment was still mutated after the uninstall"
    );
    services
        .patch(
            "stub-svc",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"metadata": {"annotations": {"tests.hearth.dev/after": "uninstall"}}}),
            ),
        )
        .await
        .context("editing the LLMService after the uninstall")?;

    // 4. Install again, for the suites that share the release.
    let summary = install(&kubeconfig, &[]).await?;
    println!("reinstall: {summary}");
    reinstall.armed = false;
    wait_gateway(&ns, &node, &gateway0).await?;
    Ok(())
}

/// Prints each load's tally and fails on any failed operation, or on a load that did fewer
/// than 5 operations in one of `phases` (it would prove nothing about that phase).
fn check_tallies(tallies: &[(&'static str, Tally)], phases: &[&str], what: &str) -> Result<()> {
    let mut failures = Vec::new();
    for (name, tally) in tallies {
        println!(
            "load {name}: {} ok ({:?}), {} failed",
            tally.total_ok(),
            tally.ok,
            tally.failed.len()
        );
        for (phase, at, what) in &tally.failed {
            failures.push(format!("[{name}, {phase}, {at:.1}s] {what}"));
        }
        for phase in phases {
            ensure!(
                tally.ok.get(*phase).copied().unwrap_or(0) >= 5,
                "load {name} did almost nothing during the {phase}: {:?}",
                tally.ok
            );
        }
    }
    ensure!(
        failures.is_empty(),
        "{} operations failed while the release was {what}:\n{}",
        failures.len(),
        failures.join("\n")
    );
    Ok(())
}

/// After `helm uninstall`: nothing that could refuse a request, the CRDs and the user's
/// objects kept, what stays behind in the release namespace is only what docs/install.md lists
/// and holds no finalizer, and the release's pods go.
async fn assert_uninstalled(client: &Client, test_ns: &str) -> Result<()> {
    // No webhook configuration of Hearth's, by name or by the Service it calls.
    let calls_hearth = |name: &str, services: Vec<Option<(String, String)>>| {
        name == "hearth"
            || services
                .into_iter()
                .flatten()
                .any(|(ns, svc)| ns == RELEASE_NAMESPACE && svc == "hearth-webhook")
    };
    let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    for m in mutating.items {
        let name = m.metadata.name.clone().unwrap_or_default();
        let targets = m
            .webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|w| w.client_config.service.map(|s| (s.namespace, s.name)))
            .collect();
        ensure!(
            !calls_hearth(&name, targets),
            "MutatingWebhookConfiguration {name} is left after the uninstall"
        );
    }
    let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    for v in validating.items {
        let name = v.metadata.name.clone().unwrap_or_default();
        let targets = v
            .webhooks
            .unwrap_or_default()
            .into_iter()
            .map(|w| w.client_config.service.map(|s| (s.namespace, s.name)))
            .collect();
        ensure!(
            !calls_hearth(&name, targets),
            "ValidatingWebhookConfiguration {name} is left after the uninstall"
        );
    }
    // Helm never deletes crds/, so the CRDs and every object of them stay.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in [
        "llmservices.serving.hearth.dev",
        "inferenceruntimes.serving.hearth.dev",
        "servingpolicies.serving.hearth.dev",
    ] {
        ensure!(
            crds.get_opt(crd).await?.is_some(),
            "CRD {crd} was deleted by the uninstall"
        );
    }
    ensure!(
        llmservices(client, test_ns)
            .get_opt("stub-svc")
            .await?
            .is_some(),
        "the LLMService was deleted by the uninstall"
    );
    ensure!(
        inferenceruntimes(client).get_opt(RUNTIME).await?.is_some(),
        "the InferenceRuntime was deleted by the uninstall"
    );
    // The release's own objects are gone, the built-in ServingPolicies among them.
    let gvk = GroupVersionKind::gvk("serving.hearth.dev", "v1alpha1", "ServingPolicy");
    let policies: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "servingpolicies"),
    );
    let builtin = policies
        .list(&ListParams::default().labels("serving.hearth.dev/builtin=true"))
        .await?;
    ensure!(
        builtin.items.is_empty(),
        "built-in ServingPolicies left: {:?}",
        builtin
            .items
            .iter()
            .map(|p| p.metadata.name.clone())
            .collect::<Vec<_>>()
    );
    for name in [
        format!("{RELEASE}-webhook"),
        format!("{RELEASE}-controller"),
    ] {
        ensure!(
            Api::<ClusterRole>::all(client.clone())
                .get_opt(&name)
                .await?
                .is_none()
                && Api::<ClusterRoleBinding>::all(client.clone())
                    .get_opt(&name)
                    .await?
                    .is_none(),
            "ClusterRole or ClusterRoleBinding {name} left"
        );
    }
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let left = deployments
        .list(&ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}")))
        .await?;
    ensure!(
        left.items.is_empty(),
        "Deployments of the release left in {RELEASE_NAMESPACE}"
    );
    // What stays on purpose (docs/install.md, "Uninstall"): the webhook's Secret and the
    // controller's Lease, made by the binaries, not by Helm. Neither may hold a finalizer.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let mut kept = Vec::new();
    for s in secrets.list(&ListParams::default()).await?.items {
        let name = s.metadata.name.clone().unwrap_or_default();
        ensure!(
            !name.starts_with("sh.helm.release."),
            "Helm's release record {name} is left"
        );
        ensure!(
            s.metadata.finalizers.unwrap_or_default().is_empty(),
            "Secret {name} holds finalizers"
        );
        kept.push(format!("Secret {name}"));
    }
    let leases: Api<Lease> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    for l in leases.list(&ListParams::default()).await?.items {
        let name = l.metadata.name.clone().unwrap_or_default();
        ensure!(
            l.metadata.finalizers.unwrap_or_default().is_empty(),
            "Lease {name} holds finalizers"
        );
        kept.push(format!("Lease {name}"));
    }
    // Kept for the models (docs/install.md, "Uninstall"): the key of the gateways' admin tokens,
    // KEDA's token and the ClusterTriggerAuthentication its metrics-api triggers name, so KEDA
    // keeps scaling poll-mode models and a new install finds the same key. The scrapers' token
    // goes with the release.
    let keys = secrets
        .get_opt("hearth-controller-keys")
        .await?
        .context("the admin token key was deleted by the uninstall")?;
    ensure!(
        keys.data.is_some_and(|d| d.contains_key("admin-key")),
        "the admin token key Secret lost its key"
    );
    let keda = Api::<Secret>::namespaced(client.clone(), "keda")
        .get_opt("hearth-gateway-keda")
        .await?
        .context("KEDA's token was deleted by the uninstall")?;
    ensure!(
        keda.data.is_some_and(|d| d.contains_key("token")),
        "KEDA's token Secret lost its token"
    );
    // And KEDA's client certificate for the shared gateways' ExternalScalers, with the
    // ClusterTriggerAuthentication their push triggers name.
    let scaler = Api::<Secret>::namespaced(client.clone(), "keda")
        .get_opt("hearth-scaler-keda")
        .await?
        .context(
            "KEDA's client certificate for the shared gateways was deleted by the uninstall",
        )?;
    ensure!(
        scaler.data.is_some_and(|d| d.contains_key("tls.crt")),
        "KEDA's client certificate Secret lost its certificate"
    );
    let cta = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("keda.sh", "v1alpha1", "ClusterTriggerAuthentication"),
        "clustertriggerauthentications",
    );
    for (name, whose) in [("gateway-admin", "poll"), ("scaler", "shared push")] {
        ensure!(
            Api::<DynamicObject>::all_with(client.clone(), &cta)
                .get_opt(&format!("{RELEASE}-{name}"))
                .await?
                .is_some(),
            "the ClusterTriggerAuthentication of the models' {whose} triggers was deleted"
        );
    }
    ensure!(
        secrets.get_opt("hearth-gateway-metrics").await?.is_none(),
        "the scrapers' token Secret is left"
    );
    println!("left in {RELEASE_NAMESPACE} after the uninstall: {kept:?}");
    // The release's pods stop (preStop sleep, then the server's drain).
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let lp = ListParams::default().labels(&format!("app.kubernetes.io/instance={RELEASE}"));
    wait_until(
        "the release's pods to be gone",
        Duration::from_secs(60),
        || async {
            let left = pods.list(&lp).await?.items;
            Ok(if left.is_empty() {
                Observed::Ready(())
            } else {
                Observed::NotYet(describe_pods(&left))
            })
        },
    )
    .await
}

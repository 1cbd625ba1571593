//! Bringing up Hearth on the local test cluster: the pod runner (one per cluster, shared by every
//! suite and the demo, stopped by `tests/cluster/down`), the CRDs and upstream stub runtime,
//! `hearth-controller` as a local process, and the upstream stub service.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::{Api, Client};
use serde_json::Value;
use tokio::process::{Child, Command};

use crate::{GATEWAY_IMAGE, STUB_IMAGE};

/// Field manager of what the stack applies.
pub const FIELD_MANAGER: &str = "hearth-e2e";
/// Label selector of the upstream stub service's backend pods.
pub const STUB_BACKEND_PODS: &str =
    "app.kubernetes.io/component=backend,serving.hearth.dev/llmservice=stub-svc";

/// Errors of the stack helpers; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error(
        "binary {0} is missing: build it first with `cargo build -p hearth-gateway -p vllm-stub -p hearth-controller -p hearth-pod-runner` (tests/run-tests and make demo do)"
    )]
    MissingBinary(PathBuf),
    #[error(
        "the pod runner needs root (network namespaces, a bridge, /etc/hosts); run the suites as root"
    )]
    NotRoot,
    #[error("the pod runner did not become ready within {0:?}; see its log {1}")]
    RunnerNotReady(Duration, PathBuf),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Kube { what: String, source: kube::Error },
    #[error("{path}: {msg}")]
    Manifest { path: PathBuf, msg: String },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StackError {
    let what = what.into();
    move |source| StackError::Io { what, source }
}

/// The workspace root (this crate lives in `tests/pod-runner`).
pub fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The upstream example manifests: `$HEARTH_UPSTREAM_EXAMPLES`, else `../shared/examples/upstream`
/// beside the repository (the convention of the other suites).
pub fn upstream_dir() -> PathBuf {
    std::env::var_os("HEARTH_UPSTREAM_EXAMPLES")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_dir().join("../shared/examples/upstream"))
}

/// A binary of the workspace's debug build (`$CARGO_TARGET_DIR` or `target/`).
pub fn binary(name: &str) -> Result<PathBuf, StackError> {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_dir().join("target"));
    let path = target.join("debug").join(name);
    if path.is_file() {
        Ok(path)
    } else {
        Err(StackError::MissingBinary(path))
    }
}

/// Where the runner of the cluster behind `kubeconfig` keeps its state: `<state dir>/pod-runner`.
pub fn runner_dir(kubeconfig: &Path) -> PathBuf {
    kubeconfig
        .parent()
        .unwrap_or(Path::new("."))
        .join("pod-runner")
}

fn runner_alive(dir: &Path) -> bool {
    let Ok(pid) = std::fs::read_to_string(dir.join("runner.pid")) else {
        return false;
    };
    let exe = std::fs::read_link(format!("/proc/{}/exe", pid.trim())).unwrap_or_default();
    exe.to_string_lossy()
        .trim_end_matches(" (deleted)")
        .ends_with("/hearth-pod-runner")
        && dir.join("ready").exists()
}

/// Starts the pod runner for the cluster of `kubeconfig` unless one runs; it outlives the
/// caller (its own process group) until `tests/cluster/down` stops it. Serialized by a lock
/// file, so parallel suites start one runner.
pub async fn ensure_runner(kubeconfig: &Path) -> Result<PathBuf, StackError> {
    let dir = runner_dir(kubeconfig);
    std::fs::create_dir_all(&dir).map_err(io(format!("creating {}", dir.display())))?;
    let lock = File::create(dir.join("start.lock")).map_err(io("creating the runner lock"))?;
    lock.lock().map_err(io("locking the runner lock"))?;
    if runner_alive(&dir) {
        return Ok(dir);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err(StackError::NotRoot);
    }
    let runner = binary("hearth-pod-runner")?;
    let gateway = binary("hearth-gateway")?;
    let stub = binary("vllm-stub")?;
    let logs = kubeconfig.parent().unwrap_or(Path::new(".")).join("logs");
    std::fs::create_dir_all(&logs).map_err(io("creating the logs dir"))?;
    let log_path = logs.join("pod-runner.log");
    let log = File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
    let _ = std::fs::remove_file(dir.join("ready"));
    let mut child = std::process::Command::new(&runner)
        .arg("run")
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--state-dir")
        .arg(&dir)
        .arg("--image")
        .arg(format!("{STUB_IMAGE}={}", stub.display()))
        .arg("--image")
        .arg(format!("{GATEWAY_IMAGE}={}", gateway.display()))
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(io("log"))?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(io(format!("starting {}", runner.display())))?;
    let limit = Duration::from_secs(30);
    let start = Instant::now();
    while start.elapsed() < limit {
        if dir.join("ready").exists() {
            // Detached on purpose: the runner serves every later suite of this cluster.
            std::thread::spawn(move || child.wait());
            return Ok(dir);
        }
        if let Ok(Some(_)) = child.try_wait() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Err(StackError::RunnerNotReady(limit, log_path))
}

/// Splits a multi-document YAML file into JSON values.
pub fn read_manifests(path: &Path) -> Result<Vec<Value>, StackError> {
    let text = std::fs::read_to_string(path).map_err(io(format!("reading {}", path.display())))?;
    parse_manifests(&text).map_err(|msg| StackError::Manifest {
        path: path.to_path_buf(),
        msg,
    })
}

/// Splits multi-document YAML text into JSON values (empty documents skipped).
pub fn parse_manifests(text: &str) -> Result<Vec<Value>, String> {
    let mut out = Vec::new();
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v: Value = serde::Deserialize::deserialize(doc).map_err(|e| e.to_string())?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}

/// Server-side applies one object (any kind whose plural is its lowercase kind + "s", which
/// holds for everything the stack applies); `namespace` overrides the object's.
pub async fn apply(
    client: &Client,
    mut obj: Value,
    namespace: Option<&str>,
) -> Result<DynamicObject, StackError> {
    let api_version = obj["apiVersion"].as_str().unwrap_or_default().to_string();
    let kind = obj["kind"].as_str().unwrap_or_default().to_string();
    let name = obj["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let (group, version) = api_version
        .split_once('/')
        .unwrap_or(("", api_version.as_str()));
    let gvk = GroupVersionKind::gvk(group, version, &kind);
    let ar = ApiResource::from_gvk(&gvk);
    if let Some(ns) = namespace {
        obj["metadata"]["namespace"] = Value::from(ns);
    }
    let api: Api<DynamicObject> = match obj["metadata"]["namespace"].as_str() {
        Some(ns) => Api::namespaced_with(client.clone(), ns, &ar),
        None => Api::all_with(client.clone(), &ar),
    };
    api.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&obj),
    )
    .await
    .map_err(|source| StackError::Kube {
        what: format!("applying {kind} {name}"),
        source,
    })
}

/// Applies the CRDs (`crds/*.yaml`) and the upstream stub InferenceRuntime, unchanged.
pub async fn install(client: &Client) -> Result<(), StackError> {
    install_crds(client).await?;
    install_stub_runtime(client).await
}

/// Applies the CRDs (`crds/*.yaml`).
pub async fn install_crds(client: &Client) -> Result<(), StackError> {
    let crds = workspace_dir().join("crds");
    for f in [
        "inferenceruntimes.yaml",
        "llmservices.yaml",
        "servingpolicies.yaml",
    ] {
        for obj in read_manifests(&crds.join(f))? {
            apply(client, obj, None).await?;
        }
    }
    Ok(())
}

/// Applies the upstream stub InferenceRuntime unchanged, retrying for up to 60 s while its CRD
/// is not established yet or a just-started webhook is not trusted yet.
pub async fn install_stub_runtime(client: &Client) -> Result<(), StackError> {
    // Until established, the stub runtime cannot be applied; retry briefly.
    let runtime = upstream_dir().join("stub-inferenceruntime.yaml");
    let start = Instant::now();
    loop {
        let mut last = None;
        for obj in read_manifests(&runtime)? {
            if let Err(e) = apply(client, obj, None).await {
                last = Some(e);
            }
        }
        match last {
            None => return Ok(()),
            Some(e) if start.elapsed() > Duration::from_secs(60) => return Err(e),
            Some(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}

/// `hearth-controller run` as a child process, watching one namespace (or all), logging to
/// `log`. Killed when dropped.
pub fn start_controller(
    kubeconfig: &Path,
    namespace: Option<&str>,
    log: &Path,
) -> Result<Child, StackError> {
    let bin = binary("hearth-controller")?;
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).map_err(io("creating the log dir"))?;
    }
    let out = File::create(log).map_err(io(format!("creating {}", log.display())))?;
    let mut cmd = Command::new(&bin);
    cmd.arg("run")
        .arg("--leader-elect=false")
        .arg("--metrics-addr=127.0.0.1:0")
        .arg(format!("--gateway-image={GATEWAY_IMAGE}"))
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .stdout(out.try_clone().map_err(io("log"))?)
        .stderr(out)
        .kill_on_drop(true);
    if let Some(ns) = namespace {
        cmd.arg(format!("--namespace={ns}"));
    }
    cmd.spawn()
        .map_err(io(format!("starting {}", bin.display())))
}

/// How KEDA reads the gateway's demand (the `serving.hearth.dev/scaler` annotation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalerMode {
    /// `metrics-api` trigger polling `/hearth/queue` on every gateway endpoint.
    Poll,
    /// `external-push` trigger to the gateway's ExternalScaler gRPC.
    Push,
}

impl ScalerMode {
    /// The annotation value.
    pub fn annotation(self) -> &'static str {
        match self {
            ScalerMode::Poll => "poll",
            ScalerMode::Push => "push",
        }
    }
}

/// The upstream stub LLMService (`stub-svc`) as applied: the manifest unchanged but for the
/// namespace (each suite has its own) and, for push mode, the scaler annotation.
pub fn stub_service(namespace: &str, mode: ScalerMode) -> Result<Value, StackError> {
    let path = upstream_dir().join("stub-llmservice.yaml");
    let mut obj =
        read_manifests(&path)?
            .into_iter()
            .next()
            .ok_or_else(|| StackError::Manifest {
                path: path.clone(),
                msg: "no document".into(),
            })?;
    obj["metadata"]["namespace"] = Value::from(namespace);
    if mode == ScalerMode::Push {
        obj["metadata"]["annotations"] =
            serde_json::json!({ hearth_crds::wellknown::SCALER_ANNOTATION: mode.annotation() });
    }
    Ok(obj)
}

/// The LLMService's `status.phase` (None while unset).
pub async fn phase(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<String>, StackError> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "serving.hearth.dev",
        "v1alpha1",
        "LLMService",
    ));
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
    let obj = api.get(name).await.map_err(|source| StackError::Kube {
        what: format!("reading LLMService {namespace}/{name}"),
        source,
    })?;
    Ok(obj.data["status"]["phase"].as_str().map(str::to_owned))
}

/// Waits until `host` resolves (the runner writes Service names into /etc/hosts when it sees
/// the Service).
pub async fn wait_resolvable(host: &str, timeout: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if tokio::net::lookup_host((host, 80))
            .await
            .is_ok_and(|mut a| a.next().is_some())
        {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

//! Hearth on the local test cluster, as a platform team installs it: the Helm chart
//! (`tests/cluster/install-hearth`, once per cluster, shared by every suite and the demo), a stub
//! InferenceRuntime, and stub LLMServices whose gateway and backend pods run on the real node.
//! Clients reach a service through its Service's ClusterIP, which the host routes into the node
//! (kube-proxy's rules there), as an in-cluster client would.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Service;
use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
use kube::core::GroupVersionKind;
use kube::{Api, Client};
use serde_json::Value;

/// Field manager of what the harness applies.
pub const FIELD_MANAGER: &str = "hearth-e2e";
/// Namespace and name of the Helm release `tests/cluster/install-hearth` installs.
pub const RELEASE_NAMESPACE: &str = "hearth-system";
pub const RELEASE: &str = "hearth";
/// The chart's Deployments; the install is usable when both are Available.
pub const HEARTH_DEPLOYMENTS: [&str; 2] = ["hearth-webhook", "hearth-controller"];
/// Label selector of a stub service's backend pods (`{}` is the service's name).
pub fn backend_pods(service: &str) -> String {
    format!("app.kubernetes.io/component=backend,serving.hearth.dev/llmservice={service}")
}
/// The cluster-scoped `InferenceRuntime` API (`serving.hearth.dev/v1alpha1`), untyped.
pub fn inference_runtimes(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "serving.hearth.dev",
            "v1alpha1",
            "InferenceRuntime",
        )),
    )
}
/// The `LLMService` API (`serving.hearth.dev/v1alpha1`) in one namespace, untyped.
pub fn llm_services(client: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "serving.hearth.dev",
            "v1alpha1",
            "LLMService",
        )),
    )
}
/// KEDA's `ScaledObject` API (`keda.sh/v1alpha1`) in one namespace, untyped.
pub fn scaled_objects(client: &Client, namespace: &str) -> Api<DynamicObject> {
    Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "keda.sh",
            "v1alpha1",
            "ScaledObject",
        )),
    )
}
/// Label selector of every gateway pod in a namespace.
pub const GATEWAY_PODS: &str = "app.kubernetes.io/component=gateway";

/// Errors of the stack helpers; each says what to do.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error(
        "installing Hearth with tests/cluster/install-hearth failed ({status}); see {log} (the images come from build/images, pushed to the cluster's registry with the chart by build/push)"
    )]
    Install { status: String, log: PathBuf },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Kube { what: String, source: kube::Error },
    #[error("{path}: {msg}")]
    Manifest { path: PathBuf, msg: String },
    #[error("Service {0} has no ClusterIP")]
    NoClusterIp(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StackError {
    let what = what.into();
    move |source| StackError::Io { what, source }
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> StackError {
    let what = what.into();
    move |source| StackError::Kube { what, source }
}

/// The workspace root (this crate lives in `tests/harness`).
pub fn workspace_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The project's own examples (`examples/`), which the demo applies.
pub fn examples_dir() -> PathBuf {
    workspace_dir().join("examples")
}

/// Pod annotation that records which build of Hearth's images a release runs: the input
/// digests `build/images` wrote beside its archives (`target/images/<image>.tar.inputs`).
pub const IMAGES_ANNOTATION: &str = "hearth-images";

/// The images' build identity: the first 12 hex digits of each of the webhook's, controller's
/// and gateway's input digests, or None when `build/images` has not run.
pub fn images_build_id() -> Option<String> {
    // Where build/images writes and tests/cluster/install-hearth reads (not $CARGO_TARGET_DIR).
    let images = std::env::var_os("HEARTH_IMAGES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_dir().join("target/images"));
    let mut id = Vec::new();
    for image in ["hearth-webhook", "hearth-controller", "hearth-gateway"] {
        let inputs = std::fs::read_to_string(images.join(format!("{image}.tar.inputs"))).ok()?;
        id.push(inputs.trim().chars().take(12).collect::<String>());
    }
    Some(id.join("-"))
}

/// Installs Hearth with its chart unless the release is deployed, both Deployments Available,
/// and running the images `build/images` built last (their build id in the pod annotation
/// [`IMAGES_ANNOTATION`]): runs `tests/cluster/install-hearth` (images and chart pushed to the
/// cluster's registry, the chart pinning the images by digest, then `helm upgrade --install
/// oci://… --wait`, which rolls the pods to the new digests), logging to `<state>/logs/install-hearth.log`. Serialized by a lock file
/// in the cluster's state dir, so parallel suites install once. Returns whether it installed.
pub async fn ensure_hearth(client: &Client, kubeconfig: &Path) -> Result<bool, StackError> {
    let state = kubeconfig.parent().unwrap_or(Path::new("."));
    let lock = lock_install(state).await?;
    if hearth_available(client).await? && installed_build(client).await? == images_build_id() {
        return Ok(false);
    }
    install_locked(kubeconfig, state).await?;
    drop(lock);
    Ok(true)
}

/// Installs (or upgrades) the chart with `tests/cluster/install-hearth` whatever is installed:
/// for a suite that took part of the installation away (its webhook configurations, say).
///
/// # Errors
/// As [`ensure_hearth`].
pub async fn install_hearth(kubeconfig: &Path) -> Result<(), StackError> {
    let state = kubeconfig.parent().unwrap_or(Path::new("."));
    let lock = lock_install(state).await?;
    install_locked(kubeconfig, state).await?;
    drop(lock);
    Ok(())
}

/// The install lock of the cluster in `state` (a file lock, held until dropped).
async fn lock_install(state: &Path) -> Result<File, StackError> {
    let lock_path = state.join("install-hearth.lock");
    let lock = File::create(&lock_path).map_err(io(format!("creating {}", lock_path.display())))?;
    // Blocking lock on a blocking thread: another suite may hold it for a whole install.
    tokio::task::spawn_blocking(move || lock.lock().map(|()| lock))
        .await
        .map_err(|e| StackError::Io {
            what: "locking the install lock".into(),
            source: std::io::Error::other(e),
        })?
        .map_err(io("locking the install lock"))
}

/// Runs `tests/cluster/install-hearth`, its output in `<state>/logs/install-hearth.log`.
async fn install_locked(kubeconfig: &Path, state: &Path) -> Result<(), StackError> {
    let logs = state.join("logs");
    std::fs::create_dir_all(&logs).map_err(io("creating the logs dir"))?;
    let log_path = logs.join("install-hearth.log");
    let log = File::create(&log_path).map_err(io(format!("creating {}", log_path.display())))?;
    let script = workspace_dir().join("tests/cluster/install-hearth");
    let status = tokio::process::Command::new(&script)
        .args(images_build_args())
        .env("KUBECONFIG", kubeconfig)
        .env("HEARTH_CLUSTER_STATE", state)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(io("log"))?)
        .stderr(log)
        .status()
        .await
        .map_err(io(format!("running {}", script.display())))?;
    if !status.success() {
        return Err(StackError::Install {
            status: status.to_string(),
            log: log_path,
        });
    }
    Ok(())
}

/// Arguments of `tests/cluster/install-hearth` (for helm) that record the images' build id in
/// the webhook's and controller's pod template ([`IMAGES_ANNOTATION`]); none without images.
pub fn images_build_args() -> Vec<String> {
    let Some(id) = images_build_id() else {
        return Vec::new();
    };
    ["webhook", "controller"]
        .iter()
        .flat_map(|component| {
            [
                "--set-string".to_string(),
                format!("{component}.podAnnotations.{IMAGES_ANNOTATION}={id}"),
            ]
        })
        .collect()
}

/// The images' build id the installed controller's pods carry ([`IMAGES_ANNOTATION`]).
async fn installed_build(client: &Client) -> Result<Option<String>, StackError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let d = api
        .get_opt("hearth-controller")
        .await
        .map_err(kube_err(format!(
            "reading Deployment {RELEASE_NAMESPACE}/hearth-controller"
        )))?;
    Ok(d.and_then(|d| d.spec)
        .and_then(|s| s.template.metadata)
        .and_then(|m| m.annotations)
        .and_then(|mut a| a.remove(IMAGES_ANNOTATION)))
}

/// Whether the chart's webhook and controller Deployments exist, are Available and have a
/// ready replica (a Deployment scaled to zero counts as Available).
pub async fn hearth_available(client: &Client) -> Result<bool, StackError> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    for name in HEARTH_DEPLOYMENTS {
        let Some(d) = api.get_opt(name).await.map_err(kube_err(format!(
            "reading Deployment {RELEASE_NAMESPACE}/{name}"
        )))?
        else {
            return Ok(false);
        };
        let status = d.status.unwrap_or_default();
        let available = status.ready_replicas.unwrap_or_default() >= 1
            && status
                .conditions
                .unwrap_or_default()
                .iter()
                .any(|c| c.type_ == "Available" && c.status == "True");
        if !available {
            return Ok(false);
        }
    }
    Ok(true)
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
/// holds for everything the harness applies); `namespace` overrides the object's.
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
    .map_err(kube_err(format!("applying {kind} {name}")))
}

/// Applies every object of `path`, retrying for up to 60 s while the webhook refuses them
/// (a webhook that has just started may not be trusted yet); `namespace` overrides theirs.
pub async fn apply_file(
    client: &Client,
    path: &Path,
    namespace: Option<&str>,
) -> Result<(), StackError> {
    let start = Instant::now();
    for obj in read_manifests(path)? {
        loop {
            match apply(client, obj.clone(), namespace).await {
                Ok(_) => break,
                Err(e) if start.elapsed() > Duration::from_secs(60) => return Err(e),
                Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
            }
        }
    }
    Ok(())
}

/// Applies the upstream stub InferenceRuntime (`vllm-stub`) unchanged.
pub async fn install_stub_runtime(client: &Client) -> Result<(), StackError> {
    apply_file(
        client,
        &hearth_test_support::upstream_file("stub-inferenceruntime.yaml"),
        None,
    )
    .await
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

    /// The KEDA trigger type the controller renders for this mode.
    pub fn trigger(self) -> &'static str {
        match self {
            ScalerMode::Poll => "metrics-api",
            ScalerMode::Push => "external-push",
        }
    }

    /// Sets (push) or leaves unset (poll, the default) the scaler annotation of an LLMService.
    pub fn annotate(self, obj: &mut Value) {
        if self == ScalerMode::Push {
            obj["metadata"]["annotations"][hearth_crds::wellknown::SCALER_ANNOTATION] =
                Value::from(self.annotation());
        }
    }
}

/// The first object of a manifest file.
pub fn first_manifest(path: &Path) -> Result<Value, StackError> {
    read_manifests(path)?
        .into_iter()
        .next()
        .ok_or_else(|| StackError::Manifest {
            path: path.to_path_buf(),
            msg: "no document".into(),
        })
}

/// The upstream stub LLMService (`stub-svc`) as applied: the manifest unchanged but for the
/// namespace (each suite has its own) and, for push mode, the scaler annotation.
pub fn stub_service(namespace: &str, mode: ScalerMode) -> Result<Value, StackError> {
    let mut obj = first_manifest(&hearth_test_support::upstream_file("stub-llmservice.yaml"))?;
    obj["metadata"]["namespace"] = Value::from(namespace);
    mode.annotate(&mut obj);
    Ok(obj)
}

/// The LLMService's `status.phase` (None while unset).
pub async fn phase(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<String>, StackError> {
    let obj = llm_services(client, namespace)
        .get(name)
        .await
        .map_err(kube_err(format!("reading LLMService {namespace}/{name}")))?;
    Ok(obj.data["status"]["phase"].as_str().map(str::to_owned))
}

/// `http://<ClusterIP>:<port>` of a Service's first port: the host routes the Service range
/// into the real node, where kube-proxy sends it to a ready endpoint.
pub async fn service_url(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<String, StackError> {
    let api: Api<Service> = Api::namespaced(client.clone(), namespace);
    let svc = api
        .get(name)
        .await
        .map_err(kube_err(format!("reading Service {namespace}/{name}")))?;
    let spec = svc.spec.unwrap_or_default();
    let ip = spec
        .cluster_ip
        .filter(|ip| !ip.is_empty() && ip != "None")
        .ok_or_else(|| StackError::NoClusterIp(format!("{namespace}/{name}")))?;
    let port = spec
        .ports
        .unwrap_or_default()
        .first()
        .map(|p| p.port)
        .unwrap_or(80);
    Ok(format!("http://{ip}:{port}"))
}

/// Waits until a TCP connection to `url`'s host and port succeeds: a Service's ClusterIP is
/// served once kube-proxy on the node has programmed it, which trails the Service and its
/// EndpointSlice by up to kube-proxy's sync period (until then the node rejects it as
/// unreachable). Returns false at the timeout.
pub async fn wait_reachable(url: &str, timeout: Duration) -> bool {
    let authority = url
        .split_once("://")
        .map_or(url, |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    let start = Instant::now();
    while start.elapsed() < timeout {
        let connect = tokio::net::TcpStream::connect(authority.as_str());
        if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(2), connect).await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    false
}

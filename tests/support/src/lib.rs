//! Support for tests that run against the local control plane of `tests/cluster/`.
//!
//! - [`Cluster::connect`] reaches the cluster through its kubeconfig (`KUBECONFIG`, else the
//!   default state dir of `tests/cluster/up`) and fails with a message naming the fix when no
//!   cluster answers.
//! - [`Cluster::namespace`] gives a test its own namespace, deleted when the returned
//!   [`TestNamespace`] is dropped, also when the test panics.
//! - [`wait_until`] and the helpers built on it poll a condition until a deadline and, on
//!   timeout, fail with what was awaited and the last state observed.
//! - [`MetricServer`] is a tiny HTTP server on loopback that serves a number as JSON, for KEDA's
//!   `metrics-api` trigger.
//! - [`RealNode`] and [`EventSink`]: pods on the cluster's real node, and what their containers
//!   report from inside.
//! - [`run_detached`] runs the async cleanup of a `Drop` to completion.

mod images;
mod metric_server;
mod node;
pub mod process;
mod upstream;
mod wait;

pub use images::{PushedImage, hearth_image, parse_pushed, pushed_images};
pub use metric_server::MetricServer;
pub use node::{Event, EventSink, RealNode};
pub use upstream::{UPSTREAM_EXAMPLES_ENV, upstream_dir, upstream_examples, upstream_file};
pub use wait::{Observed, install_policy_report_crd, wait_crds_established, wait_until};

/// An LLMService manifest (`serving.hearth.dev/v1alpha1`) named `name`: `defaults` as its spec,
/// with `spec` deep-merged over them ([`merge_json`]).
pub fn llmservice(
    name: &str,
    defaults: serde_json::Value,
    spec: serde_json::Value,
) -> serde_json::Value {
    let mut svc = serde_json::json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "metadata": {"name": name},
        "spec": defaults,
    });
    merge_json(&mut svc["spec"], spec);
    svc
}

/// Deep-merges `patch` into `base`: objects key by key, anything else (`null` included) replaces
/// the value, so a test can set a field to `null` to drop it from a typed object.
pub fn merge_json(base: &mut serde_json::Value, patch: serde_json::Value) {
    match (base, patch) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge_json(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (a, b) => *a = b,
    }
}

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::{Namespace, Pod, ServiceAccount};
use kube::api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

/// Label put on every namespace made by [`Cluster::namespace`], so leftovers can be found.
pub const TEST_NAMESPACE_LABEL: &str = "tests.hearth.dev/test-namespace";

/// Environment variable that, when set to `1`, keeps test namespaces for inspection.
pub const KEEP_NAMESPACES_ENV: &str = "HEARTH_TEST_KEEP_NAMESPACES";

/// How long [`Cluster::connect`] waits for the apiserver to answer.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to the local test cluster.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    config: Config,
    kubeconfig: PathBuf,
}

impl Cluster {
    /// Connects through `$KUBECONFIG`, or `tests/cluster/.state/kubeconfig` (the state dir may be
    /// moved with `HEARTH_CLUSTER_STATE`, as for `tests/cluster/up`), and checks that the
    /// apiserver answers.
    pub async fn connect() -> Result<Self> {
        // kube's rustls transport needs a process-wide provider; ring is the project's choice.
        // An error only means a provider is installed already.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let path = kubeconfig_path();
        let hint = "start the local cluster with `tests/cluster/up` (it prints the KUBECONFIG \
                    export), or run the whole suite with `tests/run-tests`";
        if !path.is_file() {
            bail!(
                "no kubeconfig at {} ({}); {hint}",
                path.display(),
                if std::env::var_os("KUBECONFIG").is_some() {
                    "from KUBECONFIG"
                } else {
                    "KUBECONFIG is unset, so the default state dir of tests/cluster/up was used"
                }
            );
        }
        let kubeconfig = Kubeconfig::read_from(&path)
            .with_context(|| format!("reading kubeconfig {}", path.display()))?;
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .with_context(|| format!("loading kubeconfig {}", path.display()))?;
        let server = config.cluster_url.clone();
        let client = Client::try_from(config.clone())
            .with_context(|| format!("building a client for {server}"))?;
        match tokio::time::timeout(CONNECT_TIMEOUT, client.apiserver_version()).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => bail!(
                "the cluster at {server} (kubeconfig {}) did not answer: {e}; {hint}",
                path.display()
            ),
            Err(_) => bail!(
                "the cluster at {server} (kubeconfig {}) did not answer within {CONNECT_TIMEOUT:?}; {hint}",
                path.display()
            ),
        }
        Ok(Self {
            client,
            config,
            kubeconfig: path,
        })
    }

    /// A client with the cluster's admin credentials.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// The apiserver's audit log (JSON lines) of the local cluster, beside its kubeconfig in the
    /// state dir: the writes to Deployments, StatefulSets and Pods at `Metadata` level
    /// (`tests/cluster/lib/components.sh`), which carries admission webhooks' audit annotations.
    pub fn audit_log(&self) -> PathBuf {
        self.kubeconfig
            .parent()
            .unwrap_or_else(|| std::path::Path::new("."))
            .join("logs/audit.log")
    }

    /// The apiserver's audit event (stage `ResponseComplete`) of `verb` on the object
    /// `namespace/name`, from [`Cluster::audit_log`] and the files it was rotated into
    /// (`audit-<time>.log`), waited for up to `timeout`.
    ///
    /// # Errors
    /// When the log cannot be read, or no such event is written in time.
    pub async fn wait_audit_event(
        &self,
        verb: &str,
        namespace: &str,
        name: &str,
        timeout: Duration,
    ) -> Result<serde_json::Value> {
        let path = self.audit_log();
        let dir = path
            .parent()
            .context("the audit log's directory")?
            .to_path_buf();
        wait_until(
            format!("the audit event of {verb} {namespace}/{name}"),
            timeout,
            || {
                let (dir, path) = (dir.clone(), path.clone());
                async move {
                    let mut text = String::new();
                    for entry in std::fs::read_dir(&dir)? {
                        let p = entry?.path();
                        let file = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
                        if file.starts_with("audit") && file.ends_with(".log") {
                            text.push_str(&tokio::fs::read_to_string(&p).await?);
                        }
                    }
                    let found = text
                        .lines()
                        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                        .find(|e| {
                            e["verb"] == verb
                                && e["stage"] == "ResponseComplete"
                                && e["objectRef"]["namespace"] == namespace
                                && e["objectRef"]["name"] == name
                        });
                    Ok(match found {
                        Some(e) => Observed::Ready(e),
                        None => Observed::NotYet(format!("no event in {}", path.display())),
                    })
                }
            },
        )
        .await
    }

    /// Like [`Cluster::client`], without kube's default retries of `429`, `503` and `504`:
    /// for calls whose refusal is the answer under test (an eviction the PodDisruptionBudget
    /// refuses with `429` would otherwise be sent again until it is granted).
    ///
    /// # Errors
    /// When the client cannot be built from the connection's configuration.
    pub fn client_without_retries(&self) -> Result<Client> {
        let mut config = self.config.clone();
        config.default_retry = false;
        Client::try_from(config).context("building a client without retries")
    }

    /// The kubeconfig this connection was made from.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// A `kubectl` command of the cluster's Kubernetes version, already pointed at the cluster.
    /// `tests/cluster/up` links the binaries it built into `<state dir>/bin/`.
    pub fn kubectl(&self) -> Result<Command> {
        let state = self.kubeconfig.parent().with_context(|| {
            format!("kubeconfig {} has no parent dir", self.kubeconfig.display())
        })?;
        let kubectl = state.join("bin").join("kubectl");
        if !kubectl.is_file() {
            bail!(
                "no kubectl at {}: the kubeconfig {} is not in a state dir of tests/cluster/up, \
                 which links kubectl there",
                kubectl.display(),
                self.kubeconfig.display()
            );
        }
        let mut cmd = Command::new(kubectl);
        cmd.arg("--kubeconfig").arg(&self.kubeconfig);
        Ok(cmd)
    }

    /// Fails when Hearth is installed on the cluster (the chart's controller Deployment in
    /// `hearth-system`): suites that run their own controller or webhook in-process would then
    /// share their objects with the installed one. The message names the fix.
    pub async fn require_hearth_not_installed(&self) -> Result<()> {
        let api: Api<k8s_openapi::api::apps::v1::Deployment> =
            Api::namespaced(self.client.clone(), "hearth-system");
        if api.get_opt("hearth-controller").await?.is_some() {
            bail!(
                "Hearth is installed on this cluster (Deployment hearth-system/hearth-controller, from the Helm release the end-to-end suites install): its controller and webhook would act on this test's objects too. Uninstall it first: helm uninstall hearth --namespace hearth-system (tests/run-tests without arguments runs these suites before the end-to-end ones, which install it)"
            );
        }
        Ok(())
    }

    /// Creates a namespace named `<prefix>-<random suffix>` and waits until pods can be made in
    /// it (its `default` ServiceAccount exists). It is deleted when the guard is dropped.
    pub async fn namespace(&self, prefix: &str) -> Result<TestNamespace> {
        let name = format!("{prefix}-{}", random_suffix());
        if name.len() > 63 {
            bail!("namespace prefix {prefix:?} is too long: {name:?} exceeds 63 characters");
        }
        self.namespace_named(&name).await
    }

    /// Like [`Cluster::namespace`], with exactly this name, for manifests that name their
    /// namespace and are applied unchanged. Fails when it exists (a leftover of an earlier run:
    /// delete it, or wait until its deletion ends).
    pub async fn namespace_named(&self, name: &str) -> Result<TestNamespace> {
        let name = name.to_string();
        let namespaces: Api<Namespace> = Api::all(self.client.clone());
        let ns: Namespace = serde_json::from_value(serde_json::json!({
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": { "name": name, "labels": { TEST_NAMESPACE_LABEL: "true" } },
        }))?;
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating test namespace {name}"))?;
        // From here on the guard owns the namespace, so a failure below still deletes it.
        let guard = TestNamespace {
            name: name.clone(),
            client: self.client.clone(),
            config: self.config.clone(),
        };
        let accounts: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &name);
        wait_until(
            format!("ServiceAccount {name}/default (made by kube-controller-manager)"),
            Duration::from_secs(30),
            || async {
                Ok(match accounts.get_opt("default").await? {
                    Some(_) => Observed::Ready(()),
                    None => Observed::NotYet("not created yet".to_string()),
                })
            },
        )
        .await?;
        Ok(guard)
    }
}

/// A namespace owned by one test. Dropping it deletes the namespace (unless
/// `HEARTH_TEST_KEEP_NAMESPACES=1`), also while a panic unwinds.
pub struct TestNamespace {
    name: String,
    client: Client,
    config: Config,
}

impl TestNamespace {
    /// The namespace's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// A client with the cluster's admin credentials.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// A typed API for namespaced objects of this namespace.
    pub fn api<K>(&self) -> Api<K>
    where
        K: kube::Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        <K as kube::Resource>::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.name)
    }

    /// An untyped API in this namespace, for kinds without Rust types here (e.g. KEDA's).
    pub fn dynamic_api(
        &self,
        group: &str,
        version: &str,
        kind: &str,
        plural: &str,
    ) -> Api<DynamicObject> {
        let gvk = GroupVersionKind::gvk(group, version, kind);
        let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
        Api::namespaced_with(self.client.clone(), &self.name, &resource)
    }

    /// Waits until the pods matching `selector` satisfy `done`, and returns them. `done` sees
    /// the current pods; on timeout the error lists each pod with its phase and node.
    pub async fn wait_for_pods(
        &self,
        what: &str,
        selector: &str,
        timeout: Duration,
        done: impl Fn(&[Pod]) -> bool,
    ) -> Result<Vec<Pod>> {
        let pods: Api<Pod> = self.api();
        let lp = kube::api::ListParams::default().labels(selector);
        wait_until(
            format!("{what} (pods {selector} in {})", self.name),
            timeout,
            || async {
                let list = pods.list(&lp).await?.items;
                Ok(if done(&list) {
                    Observed::Ready(list)
                } else {
                    Observed::NotYet(describe_pods(&list))
                })
            },
        )
        .await
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::env::var(KEEP_NAMESPACES_ENV).as_deref() == Ok("1") {
            eprintln!(
                "keeping test namespace {} ({KEEP_NAMESPACES_ENV}=1)",
                self.name
            );
            return;
        }
        let name = self.name.clone();
        let config = self.config.clone();
        let outcome = run_detached(async move {
            let client = Client::try_from(config)?;
            let namespaces: Api<Namespace> = Api::all(client);
            match namespaces.delete(&name, &DeleteParams::background()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(e.into()),
            }
        })
        .and_then(|deleted| deleted);
        if let Err(e) = outcome {
            eprintln!("warning: deleting test namespace {}: {e:#}", self.name);
        }
    }
}

/// Creates `deployment` in `ns` (a server dry run with `dry_run`) and returns what the apiserver
/// answered with the `Warning` headers of the response: the admission warnings of the webhooks
/// and policies that reviewed it, which kube's typed API drops.
///
/// # Errors
/// When the request fails or the apiserver refuses it (its status and body).
pub async fn create_with_warnings(
    client: &Client,
    ns: &str,
    deployment: &k8s_openapi::api::apps::v1::Deployment,
    dry_run: bool,
) -> Result<(k8s_openapi::api::apps::v1::Deployment, Vec<String>)> {
    let answer = create_answer(client, ns, &serde_json::to_value(deployment)?, dry_run).await?;
    if !(200..300).contains(&answer.code) {
        bail!(
            "create {}: {}: {}",
            deployment.metadata.name.as_deref().unwrap_or_default(),
            answer.code,
            answer.body
        );
    }
    Ok((serde_json::from_value(answer.body)?, answer.warnings))
}

/// What the apiserver answered to a create: the HTTP status code, the body (the object, or
/// the `Status` of a refusal) and the `Warning` headers.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateAnswer {
    /// The HTTP status code.
    pub code: u16,
    /// The created object, or the refusal's `Status`.
    pub body: serde_json::Value,
    /// The admission warnings, as sent.
    pub warnings: Vec<String>,
}

/// Creates `object` (a Deployment, StatefulSet or Pod as JSON) in `ns`, a server dry run with
/// `dry_run`, and returns the answer whatever it is (a refusal is an answer, not an error).
///
/// # Errors
/// When the request cannot be sent, the body is not JSON, or the kind is none of those three.
pub async fn create_answer(
    client: &Client,
    ns: &str,
    object: &serde_json::Value,
    dry_run: bool,
) -> Result<CreateAnswer> {
    let query = if dry_run { "?dryRun=All" } else { "" };
    let path = match object["kind"].as_str() {
        Some("Deployment") => format!("/apis/apps/v1/namespaces/{ns}/deployments"),
        Some("StatefulSet") => format!("/apis/apps/v1/namespaces/{ns}/statefulsets"),
        Some("Pod") => format!("/api/v1/namespaces/{ns}/pods"),
        other => bail!("create_answer: kind {other:?} is not a Deployment, StatefulSet or Pod"),
    };
    let request = http::Request::post(format!("{path}{query}"))
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(kube::client::Body::from(serde_json::to_vec(object)?))?;
    let response = client.send(request).await?;
    let code = response.status().as_u16();
    let warnings = response
        .headers()
        .get_all(http::header::WARNING)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::to_owned)
        .collect();
    let bytes = response.into_body().collect_bytes().await?;
    let body = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "the answer is not JSON: {}",
            String::from_utf8_lossy(&bytes)
        )
    })?;
    Ok(CreateAnswer {
        code,
        body,
        warnings,
    })
}

/// The value of the audit annotation of an audit `event` whose key ends with `suffix` (an
/// admission webhook's `<webhook name>/<key>`, such as `/validation_failure`).
pub fn audit_annotation(event: &serde_json::Value, suffix: &str) -> Option<String> {
    event["annotations"].as_object().and_then(|a| {
        a.iter()
            .find(|(k, _)| k.ends_with(suffix))
            .and_then(|(_, v)| v.as_str().map(str::to_owned))
    })
}

/// Runs `task` to completion on a thread and a current-thread runtime of its own, for the
/// cleanup in a `Drop`: Drop cannot await, and the test's runtime may be the single thread
/// running the drop. Fails when the runtime cannot be built or `task` panics.
pub fn run_detached<F>(task: F) -> Result<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    std::thread::spawn(move || -> Result<F::Output> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(runtime.block_on(task))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the cleanup panicked"))?
}

/// Whether the pod's condition `type_` has status `status` ("True", "False").
pub fn pod_condition_is(pod: &Pod, type_: &str, status: &str) -> bool {
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == type_ && c.status == status))
}

/// Whether the pod is Ready (condition `Ready` true).
pub fn pod_ready(pod: &Pod) -> bool {
    pod_condition_is(pod, "Ready", "True")
}

/// The scheduler's message when it could not place the pod (`PodScheduled` false), else None.
pub fn unschedulable_message(pod: &Pod) -> Option<&str> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "False")
        .map(|c| c.message.as_deref().unwrap_or_default())
}

/// One line per pod: name, phase, node, and why it is not scheduled when it is not.
pub fn describe_pods(pods: &[Pod]) -> String {
    if pods.is_empty() {
        return "no pods".to_string();
    }
    let mut out = String::new();
    for pod in pods {
        let name = pod.metadata.name.as_deref().unwrap_or("?");
        let status = pod.status.as_ref();
        let phase = status.and_then(|s| s.phase.as_deref()).unwrap_or("?");
        let node = pod
            .spec
            .as_ref()
            .and_then(|s| s.node_name.as_deref())
            .unwrap_or("-");
        let _ = write!(out, "[{name} {phase} node={node}");
        let unscheduled = status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .find(|c| c.type_ == "PodScheduled" && c.status == "False");
        if let Some(c) = unscheduled {
            let _ = write!(
                out,
                " unscheduled: {}",
                c.message.as_deref().unwrap_or("no message")
            );
        }
        out.push_str("] ");
    }
    out.trim_end().to_string()
}

/// The kubeconfig the tests use: `$KUBECONFIG` (its first entry), else the default state dir of
/// `tests/cluster/up`.
pub fn kubeconfig_path() -> PathBuf {
    if let Some(value) = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty())
        && let Some(first) = std::env::split_paths(&value).next()
    {
        return first;
    }
    state_dir().join("kubeconfig")
}

/// The state dir of `tests/cluster/up`: `$HEARTH_CLUSTER_STATE`, else `tests/cluster/.state`.
pub fn state_dir() -> PathBuf {
    match std::env::var_os("HEARTH_CLUSTER_STATE").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("../cluster/.state"),
    }
}

/// Six lowercase base-36 characters, different for every call in a process and, through the
/// randomly keyed hasher, across processes.
fn random_suffix() -> String {
    use std::hash::{BuildHasher, Hasher};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default(),
    );
    let mut n = hasher.finish();
    let mut s = String::with_capacity(6);
    for _ in 0..6 {
        let digit = (n % 36) as u32;
        s.push(char::from_digit(digit, 36).unwrap_or('0'));
        n /= 36;
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_are_valid_dns_labels_and_differ() {
        let a = random_suffix();
        let b = random_suffix();
        assert_eq!(a.len(), 6);
        assert!(
            a.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
        assert_ne!(a, b);
    }

    #[test]
    fn describe_pods_names_the_scheduling_failure() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": { "name": "p" },
            "status": {
                "phase": "Pending",
                "conditions": [{
                    "type": "PodScheduled", "status": "False",
                    "message": "0/5 nodes are available: 5 Insufficient nvidia.com/gpu."
                }]
            }
        }))
        .unwrap();
        assert_eq!(
            describe_pods(&[pod]),
            "[p Pending node=- unscheduled: 0/5 nodes are available: 5 Insufficient nvidia.com/gpu.]"
        );
        assert_eq!(describe_pods(&[]), "no pods");
    }
}

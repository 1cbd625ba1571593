//! Local volumes on the real node and Jobs that fill them: what the suites that stage files on
//! a claim share (the model cache's `pvc://` model, the adapters' claim).

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use hearth_test_support::{Cluster, Observed, RealNode, TestNamespace, describe_pods, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolume, Pod};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::Api;
use kube::api::{ListParams, LogParams, PostParams};
use serde_json::json;

/// The installed controller's Deployment (namespace, name).
pub const CONTROLLER: (&str, &str) = ("hearth-system", "hearth-controller");

/// The user the stub image runs as (build/Containerfile).
pub const STUB_UID: u32 = 65532;
/// Where the node's local volumes of these tests live (the node's `/var/lib` is a tmpfs of its
/// own mount namespace).
pub const LOCAL_VOLUMES: &str = "/var/lib/hearth-e2e";

/// Cluster-scoped objects a test made (`kind/name` for kubectl), deleted when the guard drops:
/// at the end of the test, also when it fails. A PersistentVolume still bound to a claim of the
/// test's namespace waits (its `pv-protection` finalizer) until the namespace's deletion has
/// removed the claim.
pub struct ClusterScoped {
    cluster: Cluster,
    objects: Vec<String>,
}

impl ClusterScoped {
    pub fn new(cluster: &Cluster) -> Self {
        Self {
            cluster: cluster.clone(),
            objects: Vec::new(),
        }
    }

    /// Records an object before it is made, so a failure half-way still deletes it.
    pub fn will_make(&mut self, kind: &str, name: &str) {
        self.objects.push(format!("{kind}/{name}"));
    }
}

impl Drop for ClusterScoped {
    fn drop(&mut self) {
        if self.objects.is_empty() {
            return;
        }
        let Ok(mut kubectl) = self.cluster.kubectl() else {
            eprintln!("warning: no kubectl to delete {:?}", self.objects);
            return;
        };
        match kubectl
            .args(["delete", "--ignore-not-found", "--wait=false"])
            .args(&self.objects)
            .output()
        {
            Ok(o) if o.status.success() => {}
            Ok(o) => eprintln!(
                "warning: deleting {:?}: {}",
                self.objects,
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => eprintln!("warning: deleting {:?}: {e}", self.objects),
        }
    }
}

/// What one test made on the node and in the cluster besides its service.
pub struct Fixture {
    pub cluster: Cluster,
    pub node: RealNode,
    /// A namespace for the pods that prepare and clean the node's directories (made before the
    /// service's, which `stack::deploy` creates).
    pub node_ns: TestNamespace,
    /// Unique to the test: names the StorageClass, the PV and the node directory.
    pub id: String,
    pub scoped: ClusterScoped,
}

impl Fixture {
    pub async fn new(prefix: &str) -> Result<Self> {
        let cluster = Cluster::connect().await?;
        let node = RealNode::load()?;
        let node_ns = cluster.namespace(prefix).await?;
        let id = node_ns.name().to_owned();
        let scoped = ClusterScoped::new(&cluster);
        Ok(Self {
            cluster,
            node,
            node_ns,
            id,
            scoped,
        })
    }

    /// Runs `script` as root in the busybox tools image on the real node, with the node's
    /// directory `host_dir` (created if absent) at `/host`; returns the pod's output.
    pub async fn on_node(&self, name: &str, host_dir: &str, script: &str) -> Result<String> {
        let spec = self.node.place(json!({
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 0,
            "containers": [{
                "name": "sh",
                "image": self.node.tools_image,
                "command": ["sh", "-c", script],
                "volumeMounts": [{ "name": "host", "mountPath": "/host" }],
            }],
            "volumes": [{
                "name": "host",
                "hostPath": { "path": host_dir, "type": "DirectoryOrCreate" },
            }],
        }));
        let pod: Pod = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": { "name": name },
            "spec": spec,
        }))?;
        let pods = self.node_ns.api::<Pod>();
        pods.create(&PostParams::default(), &pod)
            .await
            .with_context(|| format!("creating pod {name}"))?;
        let phase = wait_until(
            format!("pod {}/{name} to finish", self.node_ns.name()),
            Duration::from_secs(90),
            || async {
                let p = pods.get(name).await?;
                let phase = p.status.as_ref().and_then(|s| s.phase.clone());
                Ok(match phase.as_deref() {
                    Some(done @ ("Succeeded" | "Failed")) => Observed::Ready(done.to_owned()),
                    _ => Observed::NotYet(describe_pods(&[p])),
                })
            },
        )
        .await?;
        let out = pods
            .logs(name, &LogParams::default())
            .await
            .with_context(|| format!("logs of pod {name}"))?;
        ensure!(phase == "Succeeded", "node pod {name} failed: {out}");
        Ok(out)
    }

    /// The installed controller's `--host-path-root` (the HostPath cache on the node), made as
    /// a platform team prepares it for a non-root runtime (owned by the stub's user, made if
    /// absent): `(root, parent, leaf)`, where `on_node(_, parent, _)` sees the root at
    /// `/host/<leaf>`. Install Hearth first.
    pub async fn prepare_host_path_root(&self) -> Result<(String, String, String)> {
        let dep = Api::<Deployment>::namespaced(self.cluster.client(), CONTROLLER.0)
            .get(CONTROLLER.1)
            .await
            .context("reading the installed controller")?;
        let args = dep
            .spec
            .and_then(|s| s.template.spec)
            .map(|s| s.containers)
            .unwrap_or_default()
            .into_iter()
            .flat_map(|c| c.args.unwrap_or_default())
            .collect::<Vec<_>>();
        let root = args
            .iter()
            .find_map(|a| a.strip_prefix("--host-path-root="))
            .unwrap_or("/var/lib/hearth/models")
            .to_owned();
        let (parent, leaf) = root
            .rsplit_once('/')
            .filter(|(p, l)| !p.is_empty() && !l.is_empty())
            .map(|(p, l)| (p.to_owned(), l.to_owned()))
            .with_context(|| format!("host path root {root} has no parent directory"))?;
        self.on_node(
            &format!("prepare-host-path-root-{}", self.id),
            &parent,
            &format!(
                "mkdir -p /host/{leaf} && chown {STUB_UID}:{STUB_UID} /host/{leaf} && ls -ld /host/{leaf}"
            ),
        )
        .await?;
        Ok((root, parent, leaf))
    }

    /// A StorageClass without a provisioner that binds at the first consumer, and one local
    /// PersistentVolume of it with `access_mode` on a fresh directory of the node, writable by
    /// the stub's user. Returns the class's name.
    pub async fn local_volume(&mut self, access_mode: &str) -> Result<String> {
        let name = self.id.clone();
        let client = self.cluster.client();
        self.scoped.will_make("storageclass", &name);
        let class: StorageClass = serde_json::from_value(json!({
            "apiVersion": "storage.k8s.io/v1",
            "kind": "StorageClass",
            "metadata": { "name": name },
            "provisioner": "kubernetes.io/no-provisioner",
            "volumeBindingMode": "WaitForFirstConsumer",
            "reclaimPolicy": "Retain",
        }))?;
        Api::<StorageClass>::all(client.clone())
            .create(&PostParams::default(), &class)
            .await
            .context("creating the StorageClass")?;
        self.on_node(
            "make-local-volume",
            LOCAL_VOLUMES,
            &format!("mkdir /host/{name} && chown {STUB_UID}:{STUB_UID} /host/{name} && ls -ld /host/{name}"),
        )
        .await?;
        self.scoped.will_make("persistentvolume", &name);
        let pv: PersistentVolume = serde_json::from_value(json!({
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": { "name": name },
            "spec": {
                "capacity": { "storage": "1Gi" },
                "accessModes": [access_mode],
                "persistentVolumeReclaimPolicy": "Retain",
                "storageClassName": name,
                "volumeMode": "Filesystem",
                "local": { "path": format!("{LOCAL_VOLUMES}/{name}") },
                "nodeAffinity": { "required": { "nodeSelectorTerms": [{
                    "matchExpressions": [{
                        "key": "kubernetes.io/hostname",
                        "operator": "In",
                        "values": [self.node.name],
                    }],
                }]}},
            },
        }))?;
        Api::<PersistentVolume>::all(client)
            .create(&PostParams::default(), &pv)
            .await
            .context("creating the local PersistentVolume")?;
        Ok(name)
    }

    /// Removes the local volume's directory from the node; returns what it held (`find`).
    pub async fn remove_local_volume(&self) -> Result<String> {
        let name = &self.id;
        self.on_node(
            "remove-local-volume",
            LOCAL_VOLUMES,
            &format!("find /host/{name} | sort && rm -rf /host/{name}"),
        )
        .await
    }
}

/// The output of the first container of the pods a Job made, for failure messages.
pub async fn job_logs(ns: &TestNamespace, job: &str) -> String {
    let pods = ns.api::<Pod>();
    let Ok(list) = pods
        .list(&ListParams::default().labels(&format!("job-name={job}")))
        .await
    else {
        return "no pods listed".into();
    };
    let mut out = describe_pods(&list.items);
    for p in &list.items {
        let name = p.metadata.name.clone().unwrap_or_default();
        let log = pods
            .logs(&name, &LogParams::default())
            .await
            .unwrap_or_else(|e| format!("(no log: {e})"));
        out.push_str(&format!("\n--- {name}:\n{log}"));
    }
    out
}

/// Waits until the Job has a succeeded pod; returns that pod. A failed Job fails at once, with
/// its pods' logs.
pub async fn wait_job(ns: &TestNamespace, job: &str, timeout: Duration) -> Result<Pod> {
    let jobs = ns.api::<Job>();
    let waited = wait_until(
        format!("Job {}/{job} to succeed", ns.name()),
        timeout,
        || async {
            let Some(j) = jobs.get_opt(job).await? else {
                return Ok(Observed::NotYet("no Job yet".into()));
            };
            let status = j.status.clone().unwrap_or_default();
            if status.succeeded.unwrap_or(0) > 0 {
                return Ok(Observed::Ready(Ok(())));
            }
            let failed = status
                .conditions
                .unwrap_or_default()
                .into_iter()
                .find(|c| c.type_ == "Failed" && c.status == "True");
            Ok(match failed {
                Some(c) => Observed::Ready(Err(c.message.unwrap_or_default())),
                None => Observed::NotYet(format!(
                    "active {:?}, failed {:?}",
                    status.active, status.failed
                )),
            })
        },
    )
    .await;
    match waited {
        Ok(Ok(())) => {}
        Ok(Err(why)) => bail!("Job {job} failed ({why}): {}", job_logs(ns, job).await),
        Err(e) => bail!("{e:#}\n{}", job_logs(ns, job).await),
    }
    let pods = ns
        .api::<Pod>()
        .list(&ListParams::default().labels(&format!("job-name={job}")))
        .await?
        .items;
    pods.into_iter()
        .find(|p| p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Succeeded"))
        .with_context(|| format!("Job {job} succeeded but none of its pods is Succeeded"))
}

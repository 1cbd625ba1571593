//! Model caches that really mount, on the real node: the upstream stub service with only its
//! `cache` and `model.source` changed, Hearth installed with its chart, every pod run by the
//! node's kubelet and containerd (see docs/controller.md, "Model path and cache").
//!
//! - **NodeLocalPVC** (`cache.size`, `cache.storageClassName`, `cache.prewarm: true`). The
//!   cluster has no dynamic provisioner, so the test pre-creates what a platform team running
//!   local disks would: a StorageClass with `kubernetes.io/no-provisioner` and
//!   `volumeBindingMode: WaitForFirstConsumer`, and one local PersistentVolume (`local:` on a
//!   directory of the node, `nodeAffinity` to it, `Retain`). A pre-created local PV is the honest
//!   minimum: the controller's claim binds to it through the scheduler's volume binding, as it
//!   would to one a local provisioner made, with no provisioner to install or to trust. The
//!   directory is made first by a pod with a `hostPath` (`DirectoryOrCreate`) on the node's
//!   `/var/lib` (a tmpfs inside the node's mount namespace, where the kubelet resolves local and
//!   hostPath volumes) and given to the runtime's user (65532: the stub image runs as non-root,
//!   and the controller sets no `fsGroup`, which local volumes would honour).
//! - **SharedPVC** (`cache.prewarm: true`): the same, with a ReadWriteMany claim and volume;
//!   the prewarm Job mounts it read-write, the backend read-only with `HF_HUB_OFFLINE=1`.
//! - **HostPath** (`cache.prewarm: true`): the controller's `--host-path-root` (read from the
//!   installed controller's args; the chart's `controller.hostPathRoot`, default
//!   `/var/lib/hearth/models`). The kubelet would create a missing root as root-owned 0755, which
//!   a non-root runtime cannot write, so the test prepares it on the node as a platform team must
//!   (owned by 65532). The repository id is unique to the run (`hf://hearth-e2e/hostpath-<id>`,
//!   a `model.source` edit), so the backend can only have read what this run's prewarm wrote,
//!   and the test removes it from the node at the end.
//! - **`pvc://`**: the test makes a claim (on a local PV as above), fills it with a Job of the
//!   busybox tools image (a `config.json` and a safetensors file the test builds, copied from a
//!   ConfigMap), and points `model.source.uri` at `pvc://weights/qwen/7b`; the backend mounts the
//!   claim read-only at `/models` and serves `/models/qwen/7b`.
//!
//! The prewarm Job runs what the controller renders for every runtime: the runtime's image with
//! `python3 -c 'from huggingface_hub import snapshot_download ...'`, `HF_HOME=/models/hf`
//! and the cache at `/models`. The stub image installs its binary as `python3` too; under that
//! name it runs exactly that program, writing the hub cache layout (`refs/main`, `snapshots/`,
//! SHA-256-named `blobs/`) from its built-in hub (tests/vllm-stub). The stub backend, with
//! `--model` a repository id and `HF_HOME` set, reads and checks those files (answering 503 until
//! they are there) and logs a "model loaded" line naming the snapshot it read, which each test
//! compares with what the prewarm printed or the fill Job wrote. Each test ends with a cold
//! streaming chat completion: `200`, every token, `[DONE]`.
//!
//! Cleanup: the test namespaces go with their guards; the StorageClasses and PersistentVolumes
//! (cluster-scoped) with a guard that deletes them when the test ends, also on failure; the
//! node directories are removed by a pod at the end of a passing test (they live on the node's
//! tmpfs, which `tests/cluster/down` drops anyway). Each test's backend takes one
//! `hearth.dev/fake-gpu` at a time.

mod stack;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hearth_e2e_harness::client::{self, Event};
use hearth_e2e_harness::stack::ScalerMode;
use hearth_test_support::{Observed, RealNode, TestNamespace, describe_pods, wait_until};
use k8s_openapi::ByteString;
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{ConfigMap, PersistentVolumeClaim, Pod, PodSpec};
use kube::Api;
use kube::api::{ApiResource, DynamicObject, LogParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use stack::registry::Registry;
use stack::volumes::{Fixture, wait_job};
use stack::{Deployed, SERVICE, TOKENS};

/// The stub runtime's image (the upstream stub InferenceRuntime), which the prewarm Job runs too.
const STUB_IMAGE: &str = "hearth.dev/vllm-stub:e2e";
/// The upstream stub service's model.
const UPSTREAM_REPO: &str = "hearth/stub-model";

/// The LLMService's condition `type_`: (status, reason).
async fn condition(
    client: &kube::Client,
    ns: &str,
    type_: &str,
) -> Result<Option<(String, String)>> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "serving.hearth.dev",
        "v1alpha1",
        "LLMService",
    ));
    let svc = Api::<DynamicObject>::namespaced_with(client.clone(), ns, &ar)
        .get(SERVICE)
        .await?;
    Ok(svc.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        }))
}

/// Waits for the LLMService condition `type_` to be True with `reason`.
async fn wait_condition(d: &Deployed, type_: &str, reason: &str) -> Result<()> {
    let client = d.cluster.client();
    wait_until(
        format!(
            "condition {type_}=True ({reason}) of LLMService {}/{SERVICE}",
            d.ns.name()
        ),
        Duration::from_secs(60),
        || async {
            let c = condition(&client, d.ns.name(), type_).await?;
            Ok(match c {
                Some((s, r)) if s == "True" && r == reason => Observed::Ready(()),
                other => Observed::NotYet(format!("{other:?}")),
            })
        },
    )
    .await
}

/// The path the prewarm's `print(snapshot_download(...))` wrote.
async fn prewarm_snapshot(ns: &TestNamespace, pod: &Pod) -> Result<(String, String)> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let log = ns
        .api::<Pod>()
        .logs(&name, &LogParams::default())
        .await
        .with_context(|| format!("logs of prewarm pod {name}"))?;
    let path = log
        .lines()
        .find(|l| l.starts_with("/models/"))
        .with_context(|| format!("the prewarm printed no snapshot path: {log}"))?;
    Ok((path.to_owned(), log))
}

/// Checks the prewarm pod: the runtime's image running `python3 -c <snapshot_download>` on the
/// real node, with `HF_HOME` in the cache mounted at `/models`; returns its spec.
fn check_prewarm_pod(pod: &Pod, node: &RealNode, repo: &str) -> Result<PodSpec> {
    let spec = pod.spec.clone().context("prewarm pod without spec")?;
    ensure!(
        spec.node_name.as_deref() == Some(node.name.as_str()),
        "the prewarm ran on {:?}, not the real node {}",
        spec.node_name,
        node.name
    );
    let c = &spec.containers[0];
    ensure!(
        c.image.as_deref() == Some(STUB_IMAGE),
        "prewarm image {:?}",
        c.image
    );
    let command = c.command.clone().unwrap_or_default();
    ensure!(
        command.first().map(String::as_str) == Some("python3")
            && command.get(1).map(String::as_str) == Some("-c")
            && command.get(2).is_some_and(
                |p| p.contains("snapshot_download") && p.contains(&format!("{repo:?}"))
            ),
        "prewarm command {command:?}"
    );
    let env: BTreeMap<_, _> = c
        .env
        .clone()
        .unwrap_or_default()
        .into_iter()
        .map(|e| (e.name, e.value.unwrap_or_default()))
        .collect();
    ensure!(
        env.get("HF_HOME").map(String::as_str) == Some("/models/hf"),
        "prewarm env {env:?}"
    );
    ensure!(
        c.volume_mounts
            .iter()
            .flatten()
            .any(|m| m.mount_path == "/models"),
        "the prewarm mounts nothing at /models: {:?}",
        c.volume_mounts
    );
    Ok(spec)
}

/// The one backend pod, ready.
async fn backend_pod(d: &Deployed) -> Result<Pod> {
    let pods = d.backend_pods().await?;
    let ready: Vec<Pod> = pods
        .into_iter()
        .filter(hearth_test_support::pod_ready)
        .collect();
    match ready.as_slice() {
        [p] => Ok(p.clone()),
        other => bail!(
            "{} ready backend pods: {}",
            other.len(),
            describe_pods(other)
        ),
    }
}

/// The stub container's "model loaded" log line of a backend pod: its JSON `fields`.
async fn model_loaded(d: &Deployed, pod: &Pod) -> Result<Value> {
    let name = pod.metadata.name.clone().unwrap_or_default();
    let spec = pod.spec.as_ref().context("backend pod without spec")?;
    let container = spec
        .containers
        .iter()
        .find(|c| c.image.as_deref() == Some(STUB_IMAGE))
        .with_context(|| format!("backend pod {name} runs no {STUB_IMAGE} container"))?;
    let log =
        d.ns.api::<Pod>()
            .logs(
                &name,
                &LogParams {
                    container: Some(container.name.clone()),
                    ..LogParams::default()
                },
            )
            .await
            .with_context(|| format!("logs of backend pod {name}"))?;
    log.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .map(|l| l["fields"].clone())
        .find(|f| {
            f["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("model loaded"))
        })
        .with_context(|| format!("the stub in {name} logged no \"model loaded\" line:\n{log}"))
}

/// A cold streaming chat completion: 200, every token, `[DONE]`. Returns (first token, end)
/// in seconds after sending.
async fn cold_chat(d: &Deployed) -> Result<(f64, f64)> {
    ensure!(
        d.backend_pods().await?.is_empty(),
        "a backend pod exists before the cold request"
    );
    let trace = client::chat(&d.url, SERVICE, true, Duration::from_secs(150)).await?;
    let tl = d.timeline_text(trace.sent);
    ensure!(
        trace.status == 200,
        "cold stream answered {} ({tl})",
        trace.status
    );
    ensure!(
        trace.complete(),
        "cold stream did not end with [DONE]: {:?} ({tl})",
        trace.events
    );
    let tokens = trace
        .events
        .iter()
        .filter(|(_, e)| matches!(e, Event::Token(_)))
        .count();
    ensure!(tokens == TOKENS, "{tokens} tokens, the stub sends {TOKENS}");
    let first = trace.first_token().context("no token")? - trace.sent;
    Ok((first.as_secs_f64(), (trace.end - trace.sent).as_secs_f64()))
}

fn secs(since: Instant) -> f64 {
    since.elapsed().as_secs_f64()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_local_pvc_prewarmed_on_a_local_volume() -> Result<()> {
    prewarmed_claim_served("NodeLocalPVC", "e2e-cache-local", "e2e-cache-pvc").await
}

/// SharedPVC: the same path with a ReadWriteMany claim, which the prewarm Job writes and the
/// backend mounts read-only and reads offline. (One node here: the claim's volume is a local
/// directory offered as ReadWriteMany; on a cluster its class would be a network file system,
/// which the scheduler and the kubelet treat the same way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_pvc_prewarmed_and_mounted_read_only() -> Result<()> {
    prewarmed_claim_served("SharedPVC", "e2e-cache-shared", "e2e-cache-rwx").await
}

/// A claim cache (`strategy` NodeLocalPVC or SharedPVC) on a local volume: the prewarm Job
/// fills it, the claim binds to the test's volume, and the backend serves a cold request from
/// the prewarmed snapshot, mounting the claim read-write (NodeLocalPVC) or read-only with
/// `HF_HUB_OFFLINE=1` (SharedPVC).
async fn prewarmed_claim_served(strategy: &str, fixture_ns: &str, service_ns: &str) -> Result<()> {
    let shared = strategy == "SharedPVC";
    let access_mode = if shared {
        "ReadWriteMany"
    } else {
        "ReadWriteOnce"
    };
    let t0 = Instant::now();
    let mut fx = Fixture::new(fixture_ns).await?;
    let class = fx.local_volume(access_mode).await?;
    let d = stack::deploy(service_ns, ScalerMode::Push, |o| {
        o["spec"]["cache"] = json!({
            "strategy": strategy,
            "size": "512Mi",
            "storageClassName": class,
            "prewarm": true,
        });
    })
    .await?;
    let applied = secs(t0);
    let job = format!("{SERVICE}-prewarm");
    let claim = format!("{SERVICE}-cache");
    // SharedPVC: a cold request sent while the Job still fills the cache is held; the backend
    // stays at zero (KEDA paused) until the Job is done.
    let mut early = None;
    if shared {
        let client = d.cluster.client();
        let prewarm = condition(&client, d.ns.name(), "Prewarmed").await?;
        let running = prewarm.as_ref().is_none_or(|(s, _)| s != "True");
        if running {
            let ready = condition(&client, d.ns.name(), "Ready").await?;
            ensure!(
                ready
                    .as_ref()
                    .is_some_and(|(s, r)| s == "False" && r == "WaitingForPrewarm"),
                "Ready while prewarm Job {job} runs: {ready:?} (Prewarmed {prewarm:?})"
            );
        }
        let url = d.url.clone();
        early = Some((
            secs(t0),
            running,
            tokio::spawn(async move {
                client::chat(&url, SERVICE, true, Duration::from_secs(240)).await
            }),
        ));
    }
    let pod = wait_job(&d.ns, &job, Duration::from_secs(180)).await?;
    let prewarmed = secs(t0);
    let spec = check_prewarm_pod(&pod, &fx.node, UPSTREAM_REPO)?;
    ensure!(
        spec.volumes.iter().flatten().any(|v| v
            .persistent_volume_claim
            .as_ref()
            .is_some_and(|c| c.claim_name == claim && c.read_only != Some(true))),
        "the prewarm does not mount claim {claim} read-write: {:?}",
        spec.volumes
    );
    let (snapshot, prewarm_log) = prewarm_snapshot(&d.ns, &pod).await?;
    ensure!(
        snapshot.starts_with("/models/hf/hub/models--hearth--stub-model/snapshots/"),
        "prewarm snapshot {snapshot}"
    );
    // The controller's claim is bound to the test's local volume on the real node.
    let pvc = d.ns.api::<PersistentVolumeClaim>().get(&claim).await?;
    ensure!(
        pvc.spec.as_ref().and_then(|s| s.volume_name.as_deref()) == Some(class.as_str()),
        "claim {claim} is bound to {:?}, not the local volume {class}",
        pvc.spec.as_ref().and_then(|s| s.volume_name.clone())
    );
    let modes = pvc.spec.as_ref().and_then(|s| s.access_modes.clone());
    ensure!(
        modes.as_deref() == Some(&[access_mode.to_owned()][..]),
        "claim {claim} asks for {modes:?}, not [{access_mode}]"
    );
    wait_condition(&d, "CacheReady", "Bound").await?;
    wait_condition(&d, "Prewarmed", "Downloaded").await?;

    let (sent, first_token, done) = match early {
        None => {
            let sent = secs(t0);
            let (first_token, done) = cold_chat(&d).await?;
            (sent, first_token, done)
        }
        Some((sent, before_prewarm, request)) => {
            let trace = request.await??;
            ensure!(
                trace.status == 200 && trace.complete() && trace.tokens(None) == TOKENS,
                "the request held for the prewarm: {} {:?}",
                trace.status,
                trace.events
            );
            // No backend pod before the Job was done (both times have whole seconds).
            let completed =
                d.ns.api::<Job>()
                    .get(&job)
                    .await?
                    .status
                    .and_then(|s| s.completion_time)
                    .context("the Job's completionTime")?;
            let created = backend_pod(&d)
                .await?
                .metadata
                .creation_timestamp
                .context("the backend pod's creationTimestamp")?;
            ensure!(
                created.0 >= completed.0,
                "backend pod created at {created:?}, before prewarm Job {job} completed at {completed:?}"
            );
            println!(
                "[{strategy}] request sent {} the Job was done: held, backend pod created at {} (Job completed at {})",
                if before_prewarm { "before" } else { "after" },
                created.0,
                completed.0
            );
            let first = trace.first_token().context("no token")? - trace.sent;
            (
                sent,
                first.as_secs_f64(),
                (trace.end - trace.sent).as_secs_f64(),
            )
        }
    };
    let backend = backend_pod(&d).await?;
    let bspec = backend.spec.clone().context("backend spec")?;
    ensure!(
        bspec.volumes.iter().flatten().any(|v| v
            .persistent_volume_claim
            .as_ref()
            .is_some_and(|c| c.claim_name == claim && (c.read_only == Some(true)) == shared)),
        "the backend does not mount claim {claim} {}: {:?}",
        if shared { "read-only" } else { "read-write" },
        bspec.volumes
    );
    let offline = bspec.containers.first().and_then(|c| {
        c.env
            .iter()
            .flatten()
            .find(|e| e.name == "HF_HUB_OFFLINE")
            .and_then(|e| e.value.clone())
    });
    ensure!(
        offline.as_deref() == shared.then_some("1"),
        "the backend's HF_HUB_OFFLINE is {offline:?}"
    );
    let loaded = model_loaded(&d, &backend).await?;
    ensure!(
        loaded["source"] == "huggingface-cache"
            && loaded["dir"] == snapshot.as_str()
            && loaded["verified_blobs"] == 2
            && loaded["name_or_path"] == UPSTREAM_REPO,
        "the backend did not load the prewarmed snapshot {snapshot}: {loaded}"
    );
    // What the prewarm wrote is on the node, in the local volume's directory.
    let files = fx.remove_local_volume().await?;
    let revision = snapshot.rsplit('/').next().unwrap_or_default();
    ensure!(
        files.contains(&format!(
            "/hf/hub/models--hearth--stub-model/snapshots/{revision}/model.safetensors"
        )) && files.contains("/hf/hub/models--hearth--stub-model/blobs/"),
        "the local volume's directory on the node holds:\n{files}"
    );
    println!(
        "[{strategy}] applied {applied:.1}s, prewarm Job done {prewarmed:.1}s; cold request at {sent:.1}s: first token +{first_token:.2}s, [DONE] +{done:.2}s; backend read {snapshot} ({} blobs verified, {} weight bytes); prewarm said:\n{}",
        loaded["verified_blobs"],
        loaded["weight_bytes"],
        prewarm_log.trim_end()
    );
    Ok(())
}

/// A hub mirror on the test network, named by the runtime, with no public hub reachable: the
/// stub as `hub-mirror` (the Hugging Face Hub's HTTP API over the stub's repositories) behind a
/// Service in the model's namespace, and a copy of the stub runtime whose `container.env` sets
/// `HF_ENDPOINT=http://hub-mirror.{{ .Service.Namespace }}.svc`. The prewarm Job gets it
/// (a runtime's download settings reach the Jobs, not only the engine), fetches the run's own
/// repository through the mirror (its request log lists the model info and every file), and the
/// backend serves a cold request from that snapshot on a NodeLocalPVC.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prewarm_fetches_through_a_hub_mirror_the_runtime_names() -> Result<()> {
    use hearth_e2e_harness::stack as hstack;
    let t0 = Instant::now();
    let mut fx = Fixture::new("e2e-mirror-fx").await?;
    let class = fx.local_volume("ReadWriteOnce").await?;
    let client = fx.cluster.client();
    hstack::ensure_hearth(&client, fx.cluster.kubeconfig()).await?;
    let mut rt = hstack::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    let runtime = format!("vllm-stub-mirror-{}", std::process::id());
    rt["metadata"]["name"] = json!(runtime);
    // Below the upstream runtime: no service that names none resolves to this copy.
    rt["spec"]["priority"] = json!(1);
    rt["spec"]["container"]["env"]
        .as_array_mut()
        .context("the stub runtime's env")?
        .push(json!({"name": "HF_ENDPOINT", "value": "http://hub-mirror.{{ .Service.Namespace }}.svc"}));
    hstack::apply(&client, rt, None).await?;
    let runtimes = hstack::inference_runtimes(&client);
    let result = async {
        // A repository of this run only: nothing of it is cached anywhere.
        let repo = format!("hearth-e2e/mirror-{}", fx.id.rsplit('-').next().unwrap_or("x"));
        let labels = json!({"app": "hub-mirror"});
        let mirror = vec![
            json!({
                "apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": {"name": "hub-mirror"},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "template": {
                        "metadata": {"labels": labels},
                        "spec": {
                            "nodeSelector": {"tests.hearth.dev/real-node": "true"},
                            "containers": [{
                                "name": "mirror",
                                "image": STUB_IMAGE,
                                "args": ["hub-mirror", "--port", "8080"],
                                "ports": [{"name": "http", "containerPort": 8080}],
                                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                            }],
                        },
                    },
                },
            }),
            json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"name": "hub-mirror"},
                "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
            }),
        ];
        let d = stack::deploy_with("e2e-mirror", ScalerMode::Poll, mirror, |o| {
            o["spec"]["runtime"]["name"] = json!(runtime);
            o["spec"]["model"]["source"]["uri"] = json!(format!("hf://{repo}"));
            o["spec"]["cache"] = json!({
                "strategy": "NodeLocalPVC",
                "size": "512Mi",
                "storageClassName": class,
                "prewarm": true,
            });
        })
        .await?;
        let ns = d.ns.name().to_owned();
        let endpoint = format!("http://hub-mirror.{ns}.svc");
        let job = format!("{SERVICE}-prewarm");
        let pod = wait_job(&d.ns, &job, Duration::from_secs(180)).await?;
        let prewarmed = secs(t0);
        let spec = check_prewarm_pod(&pod, &fx.node, &repo)?;
        let job_endpoint = spec.containers[0]
            .env
            .iter()
            .flatten()
            .find(|e| e.name == "HF_ENDPOINT")
            .and_then(|e| e.value.clone());
        ensure!(
            job_endpoint.as_deref() == Some(endpoint.as_str()),
            "the prewarm Job's HF_ENDPOINT is {job_endpoint:?}, not the runtime's {endpoint}"
        );
        let (snapshot, prewarm_log) = prewarm_snapshot(&d.ns, &pod).await?;
        ensure!(
            prewarm_log.contains(&format!("from {endpoint}")),
            "the prewarm did not fetch from the mirror:\n{prewarm_log}"
        );
        // The mirror's own log of what it answered.
        let ip = d
            .ns
            .api::<k8s_openapi::api::core::v1::Service>()
            .get("hub-mirror")
            .await?
            .spec
            .and_then(|s| s.cluster_ip)
            .context("the mirror Service's clusterIP")?;
        let (status, body) =
            client::get(&format!("http://{ip}/mirror/requests"), Duration::from_secs(10)).await?;
        ensure!(status == 200, "the mirror's request log: {status} {body}");
        let served: Vec<String> = serde_json::from_str(&body)?;
        let revision = snapshot.rsplit('/').next().unwrap_or_default().to_owned();
        for want in [
            format!("GET /api/models/{repo}/revision/main 200"),
            format!("GET /{repo}/resolve/{revision}/config.json 200"),
            format!("GET /{repo}/resolve/{revision}/model.safetensors 200"),
        ] {
            ensure!(served.contains(&want), "the mirror did not serve {want:?}: {served:?}");
        }
        wait_condition(&d, "Prewarmed", "Downloaded").await?;
        let (first_token, done) = cold_chat(&d).await?;
        let backend = backend_pod(&d).await?;
        let loaded = model_loaded(&d, &backend).await?;
        ensure!(
            loaded["dir"] == snapshot.as_str() && loaded["name_or_path"] == repo.as_str(),
            "the backend did not load the snapshot fetched through the mirror {snapshot}: {loaded}"
        );
        fx.remove_local_volume().await?;
        println!(
            "[mirror] prewarm Job done {prewarmed:.1}s after apply, {} requests to the mirror; cold request: first token +{first_token:.2}s, [DONE] +{done:.2}s; prewarm said:\n{}",
            served.len(),
            prewarm_log.trim_end()
        );
        Ok(())
    }
    .await;
    let _ = runtimes
        .delete(&runtime, &kube::api::DeleteParams::default())
        .await;
    result
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_path_cache_prewarmed_on_the_node() -> Result<()> {
    let t0 = Instant::now();
    let fx = Fixture::new("e2e-cache-hostnode").await?;
    let repo = format!(
        "hearth-e2e/hostpath-{}",
        fx.id.rsplit('-').next().unwrap_or("x")
    );
    let hub_dir = format!("hf/hub/models--{}", repo.replace('/', "--"));
    // The root is the installed controller's: install Hearth first (deploy() would do it too).
    hearth_e2e_harness::stack::ensure_hearth(&fx.cluster.client(), fx.cluster.kubeconfig()).await?;
    // The root as a platform team prepares it for a non-root runtime (see the file's docs); this
    // run's repository is not in it yet.
    let (root, parent, leaf) = fx.prepare_host_path_root().await?;
    let parent = parent.as_str();
    fx.on_node(
        "host-path-root-without-the-model",
        parent,
        &format!("test ! -e /host/{leaf}/{hub_dir} && ls -ld /host/{leaf}"),
    )
    .await?;
    let d = stack::deploy("e2e-cache-host", ScalerMode::Push, |o| {
        o["spec"]["model"]["source"]["uri"] = json!(format!("hf://{repo}"));
        o["spec"]["cache"] = json!({ "strategy": "HostPath", "prewarm": true });
    })
    .await?;
    let applied = secs(t0);
    let job = format!("{SERVICE}-prewarm");
    let pod = wait_job(&d.ns, &job, Duration::from_secs(180)).await?;
    let prewarmed = secs(t0);
    let spec = check_prewarm_pod(&pod, &fx.node, &repo)?;
    ensure!(
        spec.volumes
            .iter()
            .flatten()
            .any(|v| v.host_path.as_ref().is_some_and(|h| h.path == root)),
        "the prewarm does not mount the host path {root}: {:?}",
        spec.volumes
    );
    let (snapshot, prewarm_log) = prewarm_snapshot(&d.ns, &pod).await?;
    ensure!(
        snapshot.starts_with(&format!("/models/{hub_dir}/snapshots/")),
        "prewarm snapshot {snapshot}"
    );
    wait_condition(&d, "CacheReady", "HostPath").await?;
    wait_condition(&d, "Prewarmed", "Downloaded").await?;

    let sent = secs(t0);
    let (first_token, done) = cold_chat(&d).await?;
    let backend = backend_pod(&d).await?;
    let bspec = backend.spec.clone().context("backend spec")?;
    ensure!(
        bspec.node_name == spec.node_name,
        "the backend runs on {:?}, the prewarm filled {:?}",
        bspec.node_name,
        spec.node_name
    );
    ensure!(
        bspec
            .volumes
            .iter()
            .flatten()
            .any(|v| v.host_path.as_ref().is_some_and(|h| h.path == root)),
        "the backend does not mount the host path {root}: {:?}",
        bspec.volumes
    );
    let loaded = model_loaded(&d, &backend).await?;
    ensure!(
        loaded["source"] == "huggingface-cache"
            && loaded["dir"] == snapshot.as_str()
            && loaded["verified_blobs"] == 2
            && loaded["name_or_path"] == repo.as_str(),
        "the backend did not load the prewarmed snapshot {snapshot}: {loaded}"
    );
    // The files are in the node's directory; this run's repository is removed from it.
    let files = fx
        .on_node(
            "remove-host-path-model",
            parent,
            &format!("find /host/{leaf}/{hub_dir} | sort && rm -rf /host/{leaf}/{hub_dir}"),
        )
        .await?;
    ensure!(
        files.contains("/refs/main") && files.contains("/blobs/"),
        "{root}/{hub_dir} on the node holds:\n{files}"
    );
    println!(
        "[HostPath {root}] applied {applied:.1}s, prewarm Job done {prewarmed:.1}s; cold request at {sent:.1}s: first token +{first_token:.2}s, [DONE] +{done:.2}s; backend read {snapshot}; prewarm said:\n{}",
        prewarm_log.trim_end()
    );
    Ok(())
}

/// The stub container of a backend pod's spec, checked to mount volume `volume` read-only at
/// `/models`.
fn stub_mounts_at_models<'a>(
    spec: &'a PodSpec,
    volume: &str,
) -> Result<&'a k8s_openapi::api::core::v1::Container> {
    let engine = spec
        .containers
        .iter()
        .find(|c| c.image.as_deref() == Some(STUB_IMAGE))
        .context("no stub container")?;
    let mount = engine
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.name == volume)
        .with_context(|| format!("the stub container does not mount volume {volume}"))?;
    ensure!(
        mount.mount_path == "/models" && mount.read_only == Some(true),
        "volume {volume}'s mount is {mount:?}, not read-only at /models"
    );
    Ok(engine)
}

/// A safetensors file (8-byte little-endian header length, JSON header, data), written here
/// independently of the stub's own writer.
fn safetensors(tensors: &[(&str, &str, &[u64], Vec<u8>)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        let begin = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            (*name).to_owned(),
            json!({ "dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()] }),
        );
    }
    let mut header = serde_json::to_vec(&Value::Object(header)).expect("JSON");
    while !header.len().is_multiple_of(8) {
        header.push(b' ');
    }
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pvc_source_is_mounted_read_only_and_served() -> Result<()> {
    let t0 = Instant::now();
    let mut fx = Fixture::new("e2e-cache-weights").await?;
    let class = fx.local_volume("ReadWriteOnce").await?;
    let d = stack::deploy("e2e-cache-src", ScalerMode::Push, |o| {
        o["spec"]["model"]["source"]["uri"] = json!("pvc://weights/qwen/7b");
    })
    .await?;
    let applied = secs(t0);
    let ns = &d.ns;
    // The claim and what the platform team stages into it.
    let pvc: PersistentVolumeClaim = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": { "name": "weights" },
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": class,
            "resources": { "requests": { "storage": "1Gi" } },
        },
    }))?;
    ns.api::<PersistentVolumeClaim>()
        .create(&PostParams::default(), &pvc)
        .await
        .context("creating claim weights")?;
    let marker = format!("staged-by-{}", ns.name());
    let config = json!({ "model_type": "stub", "_name_or_path": marker, "architectures": ["StubForCausalLM"] });
    let embed: Vec<u8> = (0..64u8).collect();
    let head: Vec<u8> = (0..32u8).rev().collect();
    let weights = safetensors(&[
        ("model.embed_tokens.weight", "BF16", &[8, 4], embed),
        ("lm_head.weight", "U8", &[32], head),
    ]);
    let staged = ConfigMap {
        metadata: kube::api::ObjectMeta {
            name: Some("staged-model".into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([(
            "config.json".to_owned(),
            serde_json::to_string_pretty(&config)?,
        )])),
        binary_data: Some(BTreeMap::from([(
            "model.safetensors".to_owned(),
            ByteString(weights.clone()),
        )])),
        ..Default::default()
    };
    ns.api::<ConfigMap>()
        .create(&PostParams::default(), &staged)
        .await?;
    let fill: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": { "name": "stage-weights" },
        "spec": {
            "backoffLimit": 0,
            "template": { "spec": fx.node.place(json!({
                "restartPolicy": "Never",
                "containers": [{
                    "name": "stage",
                    "image": fx.node.tools_image,
                    "command": ["sh", "-c",
                        "mkdir -p /data/qwen/7b && cp /staged/model.safetensors /staged/config.json /data/qwen/7b/ && chmod -R a+rX /data && ls -ln /data/qwen/7b"],
                    "volumeMounts": [
                        { "name": "data", "mountPath": "/data" },
                        { "name": "staged", "mountPath": "/staged", "readOnly": true },
                    ],
                }],
                "volumes": [
                    { "name": "data", "persistentVolumeClaim": { "claimName": "weights" } },
                    { "name": "staged", "configMap": { "name": "staged-model" } },
                ],
            })) },
        },
    }))?;
    ns.api::<Job>()
        .create(&PostParams::default(), &fill)
        .await?;
    wait_job(ns, "stage-weights", Duration::from_secs(120)).await?;
    let staged_at = secs(t0);
    wait_condition(&d, "CacheReady", "PreStaged").await?;

    let sent = secs(t0);
    let (first_token, done) = cold_chat(&d).await?;
    let backend = backend_pod(&d).await?;
    let bspec = backend.spec.clone().context("backend spec")?;
    // Read-only twice over: the pod's claim volume and the container's mount.
    let volume = bspec
        .volumes
        .iter()
        .flatten()
        .find(|v| {
            v.persistent_volume_claim
                .as_ref()
                .is_some_and(|c| c.claim_name == "weights")
        })
        .with_context(|| {
            format!(
                "the backend does not mount claim weights: {:?}",
                bspec.volumes
            )
        })?;
    ensure!(
        volume
            .persistent_volume_claim
            .as_ref()
            .and_then(|c| c.read_only)
            == Some(true),
        "claim weights is not mounted read-only: {volume:?}"
    );
    let engine = stub_mounts_at_models(&bspec, &volume.name)?;
    ensure!(
        engine
            .args
            .iter()
            .flatten()
            .any(|a| a == "--model=/models/qwen/7b"),
        "the stub's args {:?}",
        engine.args
    );
    let loaded = model_loaded(&d, &backend).await?;
    ensure!(
        loaded["source"] == "directory"
            && loaded["dir"] == "/models/qwen/7b"
            && loaded["name_or_path"] == marker.as_str()
            && loaded["tensors"] == 2
            && loaded["weight_bytes"] == weights.len(),
        "the backend did not load the staged model ({marker}, {} weight bytes): {loaded}",
        weights.len()
    );
    let files = fx.remove_local_volume().await?;
    ensure!(
        files.contains("/qwen/7b/model.safetensors"),
        "the local volume's directory on the node holds:\n{files}"
    );
    println!(
        "[pvc://weights/qwen/7b] applied {applied:.1}s, weights staged {staged_at:.1}s; cold request at {sent:.1}s: first token +{first_token:.2}s, [DONE] +{done:.2}s; backend read {} ({} tensors, {} bytes, {})",
        loaded["dir"], loaded["tensors"], loaded["weight_bytes"], loaded["weights"]
    );
    Ok(())
}

/// `oci://`: the weights packaged as an OCI image (`FROM scratch`, a `config.json` and a
/// safetensors file at its root, built here with buildah as a platform team would build one),
/// pushed to the cluster's registry under a fresh tag, and named by `model.source.uri`. The
/// backend mounts it as a Kubernetes image volume (`ImageVolume`, on by default since Kubernetes
/// 1.35; the node's containerd 2 mounts it): the kubelet pulls it with the node's credentials
/// for the registry, the stub reads `/models` read-only and serves. No cache claim, no prewarm
/// (`CacheReady` says `ImageVolume`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oci_source_is_an_image_volume_and_served() -> Result<()> {
    let t0 = Instant::now();
    let registry = Registry::load()?;
    // The weights image: what `model loaded` must name.
    let marker = format!("oci-weights-{}", Registry::fresh_tag("run"));
    let config = json!({ "model_type": "stub", "_name_or_path": marker, "architectures": ["StubForCausalLM"] });
    let weights = safetensors(&[
        (
            "model.embed_tokens.weight",
            "BF16",
            &[4, 4],
            (0..32u8).collect(),
        ),
        ("lm_head.weight", "U8", &[16], (0..16u8).rev().collect()),
    ]);
    let reference = format!(
        "{}/models/stub-weights:{}",
        registry.host,
        Registry::fresh_tag("e2e")
    );
    let digest = registry
        .build_and_push(
            &reference,
            &[
                ("config.json", serde_json::to_vec_pretty(&config)?),
                ("model.safetensors", weights.clone()),
            ],
        )
        .await?;
    let pushed = secs(t0);

    let d = stack::deploy("e2e-cache-oci", ScalerMode::Push, |o| {
        o["spec"]["model"]["source"]["uri"] = json!(format!("oci://{reference}"));
        o["spec"]["cache"] = json!({"strategy": "None"});
    })
    .await?;
    wait_condition(&d, "CacheReady", "ImageVolume").await?;
    let applied = secs(t0);
    let node = RealNode::load()?;
    let runtime = Api::<k8s_openapi::api::core::v1::Node>::all(d.cluster.client())
        .get(&node.name)
        .await?
        .status
        .and_then(|s| s.node_info)
        .map(|i| i.container_runtime_version)
        .unwrap_or_default();

    let sent = secs(t0);
    let (first_token, done) = cold_chat(&d).await?;
    let backend = backend_pod(&d).await?;
    let spec = backend.spec.clone().context("backend spec")?;
    let volume = spec
        .volumes
        .iter()
        .flatten()
        .find(|v| v.image.is_some())
        .with_context(|| format!("the backend pod has no image volume: {:?}", spec.volumes))?;
    let image = volume.image.clone().unwrap_or_default();
    ensure!(
        image.reference.as_deref() == Some(reference.as_str())
            && image.pull_policy.as_deref() == Some("IfNotPresent"),
        "image volume {image:?}, not {reference} (IfNotPresent)"
    );
    let engine = stub_mounts_at_models(&spec, &volume.name)?;
    ensure!(
        engine.args.iter().flatten().any(|a| a == "--model=/models"),
        "the stub's args {:?}",
        engine.args
    );
    let loaded = model_loaded(&d, &backend).await?;
    ensure!(
        loaded["source"] == "directory"
            && loaded["dir"] == "/models"
            && loaded["name_or_path"] == marker.as_str()
            && loaded["tensors"] == 2
            && loaded["weight_bytes"] == weights.len(),
        "the backend did not load the pushed weights image ({marker}, {} weight bytes): {loaded}",
        weights.len()
    );
    // The kubelet pulled the volume's image (a fresh tag: a real pull, from the registry).
    let backend_name = backend.metadata.name.clone().unwrap_or_default();
    let pulled = pod_event_messages(&d, &backend_name)
        .await?
        .into_iter()
        .find(|m| m.starts_with("Successfully pulled image") && m.contains(&reference))
        .with_context(|| {
            format!("no \"Successfully pulled image {reference}\" event of pod {backend_name}")
        })?;
    println!(
        "[oci://{reference}] {runtime}: image {digest} pushed {pushed:.1}s, applied {applied:.1}s; cold request at {sent:.1}s: first token +{first_token:.2}s, [DONE] +{done:.2}s; backend read {} ({} tensors, {} bytes); kubelet: {pulled}",
        loaded["dir"], loaded["tensors"], loaded["weight_bytes"]
    );
    Ok(())
}

/// The messages of the events about pod `name` in the service's namespace.
async fn pod_event_messages(d: &Deployed, name: &str) -> Result<Vec<String>> {
    let events =
        d.ns.api::<k8s_openapi::api::core::v1::Event>()
            .list(&kube::api::ListParams::default().fields(&format!("involvedObject.name={name}")))
            .await?;
    Ok(events.items.into_iter().filter_map(|e| e.message).collect())
}

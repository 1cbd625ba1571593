//! Integration tests of the controller on the local control plane (`tests/cluster/up`): a real
//! kube-apiserver, kube-controller-manager (garbage collector, Deployment and Job controllers),
//! kube-scheduler, kwok nodes and KEDA. Each test runs its own controller in-process, scoped to
//! its own namespace, so tests run in parallel without seeing each other's objects.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context as _, Result, bail};
use hearth_controller::{
    metrics::Metrics,
    reconcile::RunConfig,
    render::{RenderConfig, scaled_object_resource},
};
use hearth_crds::{
    InferenceRuntime, LLMService, LLMServicePhase,
    wellknown::{FIELD_MANAGER, GATEWAY_FIELD_MANAGER},
};
use hearth_test_support::{Cluster, Observed, TestNamespace, wait_until};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Event, Pod, Service},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use tokio::{sync::oneshot, task::JoinHandle};

const TEST_MANAGER: &str = "hearth-controller-tests";
const WAIT: Duration = Duration::from_secs(60);

/// One upstream example file.
fn upstream(file: &str) -> PathBuf {
    hearth_test_support::upstream_file(file)
}

fn read_yaml<T: serde::de::DeserializeOwned>(path: &PathBuf) -> Result<T> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// A controller running in this process, stopped when dropped.
struct Running {
    metrics: Metrics,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl Running {
    async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// Connects to the local cluster, which must not have Hearth installed: this suite's
/// in-process controllers would share their namespaces with the installed one.
async fn connect() -> Result<Cluster> {
    let cluster = Cluster::connect().await?;
    cluster.require_hearth_not_installed().await?;
    Ok(cluster)
}

fn start(client: Client, namespace: &str, render: RenderConfig, requeue: Duration) -> Running {
    // A fixed key: the gateways get their admin Secrets as from an installed controller.
    let admin_tokens = render
        .admin_auth
        .as_ref()
        .map(|_| hearth_controller::admin_tokens::AdminTokens::from_key(&[0x42; 32]));
    start_with(
        client,
        RunConfig {
            render,
            namespace: Some(namespace.to_owned()),
            requeue,
            concurrency: 4,
            instance: format!("test-{namespace}"),
            cluster_policies: true,
            device_handover: true,
            scaler_tls: Default::default(),
            admin_tokens,
            shared_client_home: None,
            policy_scan: None,
            policy_export: None,
        },
    )
}

/// Runs the controller with `cfg` in this process.
fn start_with(client: Client, cfg: RunConfig) -> Running {
    let metrics = Metrics::new();
    let (tx, rx) = oneshot::channel::<()>();
    let m = metrics.clone();
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = rx.await;
        };
        if let Err(e) = hearth_controller::run(client, cfg, m, shutdown).await {
            panic!("controller stopped with an error: {e}");
        }
    });
    Running {
        metrics,
        stop: Some(tx),
        task: Some(task),
    }
}

/// [`start`] with the test render config and a five-minute resync.
fn start_default(client: &Client, ns: &TestNamespace) -> Running {
    start(
        client.clone(),
        ns.name(),
        test_render_config(),
        Duration::from_secs(300),
    )
}

/// The gateway image `build/images` built and `tests/cluster/push-images` pushed to the
/// cluster's registry (pinned by digest), so gateway pods and drain sidecars run for real.
fn test_render_config() -> RenderConfig {
    let gateway = hearth_test_support::hearth_image("hearth-gateway")
        .expect("the gateway image is in the cluster's registry (tests/cluster/push-images)");
    RenderConfig {
        gateway_image: gateway.clone(),
        drain_image: Some(gateway),
        ..RenderConfig::builtin().expect("the built-in ServingPolicies compile")
    }
}

/// Connects ([`connect`]), installs the CRDs and makes the test's namespace `<prefix>-<suffix>`.
async fn setup(prefix: &str) -> Result<(Client, TestNamespace)> {
    // The in-process controllers' warnings (RUST_LOG to change) go to the test's output, which
    // a failing test prints.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
    let cluster = connect().await?;
    let client = cluster.client();
    install_crds(&client).await?;
    let ns = cluster.namespace(prefix).await?;
    Ok((client, ns))
}

/// Applies the upstream stub InferenceRuntime (cluster-scoped, shared by the tests) and returns
/// it.
async fn apply_stub_runtime(client: &Client) -> Result<InferenceRuntime> {
    let rt: InferenceRuntime = read_yaml(&upstream("stub-inferenceruntime.yaml"))?;
    apply_runtime(client, &rt).await?;
    Ok(rt)
}

/// Installs Hearth's CRDs (idempotent server-side apply) and waits until they are served.
async fn install_crds(client: &Client) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    for (_, crd) in hearth_crds::crds() {
        let name = crd.name_any();
        api.patch(
            &name,
            &PatchParams::apply(TEST_MANAGER).force(),
            &Patch::Apply(&crd),
        )
        .await?;
        wait_established(&api, &name).await?;
    }
    Ok(())
}

async fn wait_established(api: &Api<CustomResourceDefinition>, name: &str) -> Result<()> {
    wait_until(format!("CRD {name} Established"), WAIT, || async {
        let crd = api.get(name).await?;
        let ok = crd.status.and_then(|s| s.conditions).is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        });
        Ok(if ok {
            Observed::Ready(())
        } else {
            Observed::NotYet("not established".into())
        })
    })
    .await
}

async fn apply_runtime(client: &Client, runtime: &InferenceRuntime) -> Result<()> {
    let api: Api<InferenceRuntime> = Api::all(client.clone());
    let mut rt = runtime.clone();
    rt.metadata.managed_fields = None;
    rt.metadata.resource_version = None;
    api.patch(
        &rt.name_any(),
        &PatchParams::apply(TEST_MANAGER).force(),
        &Patch::Apply(&rt),
    )
    .await?;
    Ok(())
}

async fn create_service(ns: &TestNamespace, mut svc: LLMService) -> Result<LLMService> {
    svc.metadata.namespace = Some(ns.name().to_owned());
    let api: Api<LLMService> = ns.api();
    Ok(api.create(&PostParams::default(), &svc).await?)
}

/// Waits until the service's status satisfies `done` (and describes the status otherwise).
async fn wait_service(
    ns: &TestNamespace,
    name: &str,
    what: &str,
    done: impl Fn(&LLMService) -> bool,
) -> Result<LLMService> {
    let api: Api<LLMService> = ns.api();
    wait_until(format!("LLMService {name}: {what}"), WAIT, || async {
        let svc = api.get(name).await?;
        Ok(if done(&svc) {
            Observed::Ready(svc)
        } else {
            Observed::NotYet(format!("status {}", serde_json::to_string(&svc.status)?))
        })
    })
    .await
}

fn condition<'a>(
    svc: &'a LLMService,
    type_: &str,
) -> Option<&'a k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition> {
    svc.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
}

fn has_condition(svc: &LLMService, type_: &str, status: &str, reason: &str) -> bool {
    condition(svc, type_).is_some_and(|c| c.status == status && c.reason == reason)
}

fn phase(svc: &LLMService) -> Option<LLMServicePhase> {
    svc.status.as_ref()?.phase
}

fn observed_current(svc: &LLMService) -> bool {
    svc.status.as_ref().and_then(|s| s.observed_generation) == svc.metadata.generation
}

/// `want` is contained in `got`: every field of `want` is in `got` with an equal value (arrays
/// element by element, same length). The apiserver adds defaults; it must not change ours.
fn subset(want: &Value, got: &Value, path: &str) -> std::result::Result<(), String> {
    match (want, got) {
        (Value::Object(w), Value::Object(g)) => {
            for (k, v) in w {
                let Some(gv) = g.get(k) else {
                    return Err(format!("{path}.{k} missing"));
                };
                subset(v, gv, &format!("{path}.{k}"))?;
            }
            Ok(())
        }
        (Value::Array(w), Value::Array(g)) if w.len() == g.len() => w
            .iter()
            .zip(g)
            .enumerate()
            .try_for_each(|(i, (a, b))| subset(a, b, &format!("{path}[{i}]"))),
        (w, g) if w == g => Ok(()),
        (w, g) => Err(format!("{path}: want {w}, got {g}")),
    }
}

fn resource_of(kind: &str, api_version: &str) -> ApiResource {
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let plural = match kind {
        "ServiceAccount" => "serviceaccounts",
        "Role" => "roles",
        "RoleBinding" => "rolebindings",
        "PersistentVolumeClaim" => "persistentvolumeclaims",
        "Job" => "jobs",
        "Service" => "services",
        "Deployment" => "deployments",
        "ScaledObject" => "scaledobjects",
        "PodDisruptionBudget" => "poddisruptionbudgets",
        "TriggerAuthentication" => "triggerauthentications",
        other => panic!("no plural for kind {other}"),
    };
    ApiResource {
        group: group.to_owned(),
        version: version.to_owned(),
        api_version: api_version.to_owned(),
        kind: kind.to_owned(),
        plural: plural.to_owned(),
    }
}

/// Every child the renderer produces for `svc` exists, is controlled by `svc`, and contains
/// what was rendered.
async fn assert_children(
    ns: &TestNamespace,
    svc: &LLMService,
    runtime: &InferenceRuntime,
) -> Result<usize> {
    let children = hearth_controller::render(svc, runtime, &test_render_config(), false)?;
    let values = children.to_values()?;
    for want in &values {
        let kind = want["kind"].as_str().unwrap_or_default();
        let name = want["metadata"]["name"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let api: Api<DynamicObject> = Api::namespaced_with(
            ns.client(),
            ns.name(),
            &resource_of(kind, want["apiVersion"].as_str().unwrap_or("")),
        );
        let got = wait_until(format!("{kind} {name}"), WAIT, || async {
            Ok(match api.get_opt(&name).await? {
                Some(o) => Observed::Ready(o),
                None => Observed::NotYet("absent".into()),
            })
        })
        .await?;
        let owner = got
            .owner_references()
            .iter()
            .find(|o| o.controller == Some(true))
            .cloned();
        if owner.as_ref().map(|o| o.uid.as_str()) != svc.metadata.uid.as_deref() {
            bail!(
                "{kind} {name} is not controlled by LLMService {}: {owner:?}",
                svc.name_any()
            );
        }
        let got = serde_json::to_value(&got)?;
        if let Err(e) = subset(&want["spec"], &got["spec"], "spec").and(subset(
            &want["metadata"]["labels"],
            &got["metadata"]["labels"],
            "labels",
        )) {
            bail!("{kind} {name} differs from the rendered object: {e}");
        }
    }
    Ok(values.len())
}

async fn backend_replicas(ns: &TestNamespace, service: &str) -> Result<Option<i32>> {
    let api: Api<Deployment> = ns.api();
    Ok(api.get(service).await?.spec.and_then(|s| s.replicas))
}

async fn scale_backend(ns: &TestNamespace, service: &str, replicas: i32) -> Result<()> {
    let api: Api<Deployment> = ns.api();
    // What KEDA's HPA or `kubectl scale` does: the scale subresource, another field manager.
    api.patch_scale(
        service,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"replicas": replicas}})),
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_examples_reconcile_to_expected_children() -> Result<()> {
    let (client, ns) = setup("ctrl-upstream").await?;
    let pairs = [
        (
            "nvidia-a10-llmservice.yaml",
            "nvidia-a10-inferenceruntime.yaml",
        ),
        (
            "ascend-910b3-llmservice.yaml",
            "ascend-910b3-inferenceruntime.yaml",
        ),
        ("stub-llmservice.yaml", "stub-inferenceruntime.yaml"),
    ];
    let mut runtimes = Vec::new();
    for (_, rt) in pairs {
        let rt: InferenceRuntime = read_yaml(&upstream(rt))?;
        apply_runtime(&client, &rt).await?;
        runtimes.push(rt);
    }
    let running = start_default(&client, &ns);
    let keda_installed = Api::<CustomResourceDefinition>::all(client.clone())
        .get_opt("scaledobjects.keda.sh")
        .await?
        .is_some();

    for ((svc_file, _), rt) in pairs.iter().zip(&runtimes) {
        let svc = create_service(&ns, read_yaml(&upstream(svc_file))?).await?;
        let name = svc.name_any();
        let svc = wait_service(&ns, &name, "runtime resolved and scaled to zero", |s| {
            has_condition(s, "RuntimeResolved", "True", "Pinned")
                && phase(s) == Some(LLMServicePhase::ScaledToZero)
                && observed_current(s)
        })
        .await?;
        let status = svc.status.clone().unwrap_or_default();
        assert_eq!(
            status.resolved_runtime.as_deref(),
            Some(rt.name_any().as_str())
        );
        assert_eq!(
            status.endpoint_url,
            Some(format!("http://{name}.{}.svc/v1", ns.name()))
        );
        let count = assert_children(&ns, &svc, rt).await?;
        assert!(count >= 8, "{name}: only {count} children");
        if !keda_installed {
            assert!(has_condition(
                &svc,
                "AutoscalingReady",
                "False",
                "KEDANotInstalled"
            ));
        }
        // min: 0 never starts a backend pod before the first request.
        assert_eq!(backend_replicas(&ns, &name).await?, Some(0), "{name}");
        let pods: Api<Pod> = ns.api();
        let backend_pods = pods
            .list(&ListParams::default().labels(&format!(
                "serving.hearth.dev/llmservice={name},app.kubernetes.io/component=backend"
            )))
            .await?;
        assert!(
            backend_pods.items.is_empty(),
            "{name}: backend pods exist: {}",
            hearth_test_support::describe_pods(&backend_pods.items)
        );
    }
    // The cache claims exist for the two NodeLocalPVC examples; the stub uses no cache.
    let svc_api: Api<LLMService> = ns.api();
    let stub = svc_api.get("stub-svc").await?;
    assert!(
        has_condition(&stub, "CacheReady", "True", "NoCache"),
        "{:?}",
        stub.status
    );
    assert!(
        has_condition(&stub, "Prewarmed", "False", "NotRequested"),
        "{:?}",
        stub.status
    );
    let a10 = svc_api.get("qwen2-5-7b-a10").await?;
    assert!(
        condition(&a10, "CacheReady").is_some_and(|c| c.status == "False" && c.reason == "Pending"),
        "{:?}",
        a10.status
    );
    running.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn phases_follow_the_backend_and_replicas_belong_to_the_scaler() -> Result<()> {
    let (client, ns) = setup("ctrl-phase").await?;
    apply_stub_runtime(&client).await?;
    let running = start_default(&client, &ns);
    create_service(&ns, read_yaml(&upstream("stub-llmservice.yaml"))?).await?;
    wait_service(&ns, "stub-svc", "ScaledToZero", |s| {
        phase(s) == Some(LLMServicePhase::ScaledToZero)
    })
    .await?;

    // This test plays the scaler by hand, so KEDA (running in the cluster, and seeing no
    // demand at the gateway) is paused on this ScaledObject, as an operator would
    // (`autoscaling.keda.sh/paused`); the annotation is another manager's field, which the
    // controller's apply leaves alone.
    let scaled_objects: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), ns.name(), &scaled_object_resource());
    scaled_objects
        .patch(
            "stub-svc",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"autoscaling.keda.sh/paused": "true"}}}),
            ),
        )
        .await?;

    // Woken by hand: the stub pod starts on the real node and becomes ready, the phase goes
    // Ready with one replica.
    scale_backend(&ns, "stub-svc", 1).await?;
    let svc = wait_service(&ns, "stub-svc", "Ready with 1 replica", |s| {
        phase(s) == Some(LLMServicePhase::Ready)
            && s.status.as_ref().and_then(|st| st.replicas) == Some(1)
    })
    .await?;
    assert!(
        has_condition(&svc, "Ready", "True", "BackendReady"),
        "{:?}",
        svc.status
    );

    // The 0→1 is recorded from the real pod and its kubelet's Events: status.lastActivation,
    // an `Activated` Event, the phase histogram.
    let svc = wait_service(&ns, "stub-svc", "lastActivation recorded", |s| {
        s.status
            .as_ref()
            .is_some_and(|st| st.last_activation.is_some())
    })
    .await?;
    let first = svc
        .status
        .and_then(|s| s.last_activation)
        .context("lastActivation")?;
    let pods: Api<Pod> = ns.api();
    let pod = pods.get(&first.pod).await?;
    assert_eq!(pod.uid().as_deref(), Some(first.pod_uid.as_str()));
    assert_eq!(
        first.node,
        pod.spec.as_ref().and_then(|s| s.node_name.clone())
    );
    assert_eq!(
        first.phases.scale_decision, None,
        "KEDA is paused on this ScaledObject: it made no scale decision"
    );
    assert!(
        first.image_present.is_some() && first.phases.image_pull.is_some(),
        "the kubelet's Pulled Event was read: {first:?}"
    );
    for d in [
        &first.phases.scheduled,
        &first.phases.containers_started,
        &first.phases.model_ready,
        &first.phases.total,
    ] {
        hearth_crds::parse_duration(d).with_context(|| format!("{first:?}"))?;
    }
    assert_eq!(
        first.start_time.0,
        pod.metadata
            .creation_timestamp
            .clone()
            .context("created")?
            .0
    );
    let note = wait_event(&ns, "stub-svc", "Activated").await?;
    assert!(
        note.starts_with("0→1 in ") && note.contains(&format!("(pod {} on node ", first.pod)),
        "{note}"
    );
    eprintln!("recorded: {note}\n{}", serde_json::to_string(&first)?);
    let once = "hearth_activation_phase_seconds_count{phase=\"total\"} 1\n";
    assert!(running.metrics.encode().contains(once));

    // Someone scales to 2; a following reconcile (spec change → new generation) keeps 2.
    // (Each replica takes one of the real node's 4 fake GPUs, shared with the other tests.)
    scale_backend(&ns, "stub-svc", 2).await?;
    let api: Api<LLMService> = ns.api();
    api.patch(
        "stub-svc",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"scaling": {"target": 2}}})),
    )
    .await?;
    wait_service(
        &ns,
        "stub-svc",
        "observed the new generation",
        observed_current,
    )
    .await?;
    let gateway: Api<Deployment> = ns.api();
    wait_until(
        "gateway re-rendered with --metric-target=2",
        WAIT,
        || async {
            let d = gateway.get("stub-svc-gateway").await?;
            let args = d
                .spec
                .and_then(|s| s.template.spec)
                .map(|p| p.containers[0].args.clone().unwrap_or_default());
            Ok(
                if args
                    .as_ref()
                    .is_some_and(|a| a.iter().any(|x| x == "--metric-target=2"))
                {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(format!("{args:?}"))
                },
            )
        },
    )
    .await?;
    assert_eq!(backend_replicas(&ns, "stub-svc").await?, Some(2));
    let svc = wait_service(&ns, "stub-svc", "2 ready replicas", |s| {
        s.status.as_ref().and_then(|st| st.replicas) == Some(2)
    })
    .await?;
    // 1→2 is no activation: the record stays the first pod's, observed once.
    assert_eq!(
        svc.status.and_then(|s| s.last_activation).as_ref(),
        Some(&first)
    );
    assert!(running.metrics.encode().contains(once));

    // Back to zero.
    scale_backend(&ns, "stub-svc", 0).await?;
    wait_service(&ns, "stub-svc", "ScaledToZero again", |s| {
        phase(s) == Some(LLMServicePhase::ScaledToZero)
    })
    .await?;

    // Transitions were recorded as Events on the LLMService.
    let events: Api<Event> = ns.api();
    let reasons: Vec<String> = wait_until("phase Events", WAIT, || async {
        let list = events
            .list(&ListParams::default().fields("involvedObject.name=stub-svc"))
            .await?;
        let reasons: Vec<String> = list.items.iter().filter_map(|e| e.reason.clone()).collect();
        Ok(
            if ["Ready", "ScaledToZero"]
                .iter()
                .all(|r| reasons.iter().any(|x| x == r))
            {
                Observed::Ready(reasons)
            } else {
                Observed::NotYet(format!("{reasons:?}"))
            },
        )
    })
    .await?;
    assert!(!reasons.is_empty());
    assert!(
        running
            .metrics
            .encode()
            .contains("hearth_controller_reconciles_total")
    );
    running.stop().await;
    Ok(())
}

/// A CRD standing in for KEDA's ScaledObject under a test-only group, so this test can install
/// "KEDA" mid-run without touching the real KEDA other tests use.
fn fake_keda_crd(group: &str) -> Result<CustomResourceDefinition> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("scaledobjects.{group}")},
        "spec": {
            "group": group,
            "names": {"kind": "ScaledObject", "plural": "scaledobjects", "singular": "scaledobject", "listKind": "ScaledObjectList"},
            "scope": "Namespaced",
            "versions": [{
                "name": "v1alpha1", "served": true, "storage": true,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}
            }]
        }
    }))?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keda_absent_is_a_condition_and_its_arrival_is_picked_up() -> Result<()> {
    let (client, ns) = setup("ctrl-keda").await?;
    let group = format!("{}.tests.hearth.dev", ns.name());
    let keda_api = ApiResource {
        group: group.clone(),
        api_version: format!("{group}/v1alpha1"),
        ..scaled_object_resource()
    };
    apply_stub_runtime(&client).await?;
    let render = RenderConfig {
        keda_api: keda_api.clone(),
        ..test_render_config()
    };
    let running = start(client.clone(), ns.name(), render, Duration::from_secs(300));
    create_service(&ns, read_yaml(&upstream("stub-llmservice.yaml"))?).await?;
    wait_service(&ns, "stub-svc", "KEDANotInstalled, so not Ready", |s| {
        has_condition(s, "AutoscalingReady", "False", "KEDANotInstalled")
            && has_condition(s, "Ready", "False", "AutoscalingNotReady")
    })
    .await?;
    // Not an error loop: no reconcile failed.
    let errors_before = running
        .metrics
        .errors
        .get_or_create(&hearth_controller::metrics::ErrorLabels {
            reason: "kube_api".into(),
        })
        .get();
    assert_eq!(errors_before, 0);

    // "Install KEDA": the CRD appears; the ScaledObject follows without a restart.
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = fake_keda_crd(&group)?;
    crds.create(&PostParams::default(), &crd).await?;
    let result = async {
        wait_established(&crds, &crd.name_any()).await?;
        let sos: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns.name(), &keda_api);
        let so = wait_until("ScaledObject stub-svc", WAIT, || async {
            Ok(match sos.get_opt("stub-svc").await? {
                Some(o) => Observed::Ready(o),
                None => Observed::NotYet("absent".into()),
            })
        })
        .await?;
        let trigger = &so.data["spec"]["triggers"][0];
        assert_eq!(trigger["type"], "metrics-api");
        assert_eq!(trigger["metadata"]["aggregationType"], "sum");
        assert_eq!(trigger["metadata"]["aggregateFromKubeServiceEndpoints"], "true");
        assert_eq!(so.data["spec"]["minReplicaCount"], 0);
        assert_eq!(so.data["spec"]["maxReplicaCount"], 2);
        assert_eq!(so.data["spec"]["cooldownPeriod"], 15);
        assert_eq!(
            so.data["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"],
            15
        );
        wait_service(&ns, "stub-svc", "AutoscalingReady pending on KEDA", |s| {
            condition(s, "AutoscalingReady").is_some_and(|c| c.reason != "KEDANotInstalled")
        })
        .await?;
        // KEDA reports Ready: the condition and Ready follow.
        sos.patch_status(
            "stub-svc",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "ScaledObjectReady", "message": "ok"}]}})),
        )
        .await?;
        wait_service(&ns, "stub-svc", "Ready while scaled to zero", |s| {
            has_condition(s, "AutoscalingReady", "True", "ScaledObjectReady") && has_condition(s, "Ready", "True", "ScaledToZero")
        })
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    running.stop().await;
    crds.delete(&crd.name_any(), &DeleteParams::default())
        .await?;
    result
}

fn runtime_named(name: &str, vendor: &str, priority: i32, image: &str) -> Result<InferenceRuntime> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": name},
        "spec": {
            "vendor": vendor,
            "priority": priority,
            "container": {"image": image, "args": ["--model={{ .Model.Path }}"]},
            "accelerator": {"resourceName": "hearth.dev/fake-gpu"}
        }
    }))?)
}

/// An LLMService `name` of the model hf://org/model without a cache, `spec` merged into its
/// spec.
fn uncached_service(name: &str, spec: Value) -> Result<LLMService> {
    let defaults = json!({
        "model": {"source": {"uri": "hf://org/model"}},
        "cache": {"strategy": "None"}
    });
    Ok(serde_json::from_value(hearth_test_support::llmservice(
        name, defaults, spec,
    ))?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_change_re_renders_its_services() -> Result<()> {
    let (client, ns) = setup("ctrl-switch").await?;
    // Cluster-scoped runtimes with a vendor unique to this test.
    let vendor = ns.name().to_owned();
    let (a, b) = (format!("{vendor}-a"), format!("{vendor}-b"));
    // A runtime of another vendor, so that "no runtime of the vendor" is what the end of the
    // test sees whatever runtimes other tests have (NoRuntimes when the cluster has none).
    let other = format!("{vendor}-other");
    apply_runtime(
        &client,
        &runtime_named(&other, &other, 1, "example.com/engine:other")?,
    )
    .await?;
    apply_runtime(
        &client,
        &runtime_named(&a, &vendor, 10, "example.com/engine:a")?,
    )
    .await?;
    apply_runtime(
        &client,
        &runtime_named(&b, &vendor, 5, "example.com/engine:b")?,
    )
    .await?;
    let running = start_default(&client, &ns);
    let svc = uncached_service(
        "switch",
        json!({"runtime": {"selector": {"vendor": ["nobody", vendor]}}}),
    )?;
    create_service(&ns, svc).await?;
    let image = |ns: &TestNamespace| {
        let api: Api<Deployment> = ns.api();
        async move {
            let d = api.get("switch").await?;
            Ok::<_, anyhow::Error>(
                d.spec
                    .and_then(|s| s.template.spec)
                    .and_then(|p| p.containers[0].image.clone()),
            )
        }
    };
    let result = async {
        wait_service(&ns, "switch", "runtime a", |s| {
            s.status
                .as_ref()
                .and_then(|st| st.resolved_runtime.as_deref())
                == Some(a.as_str())
                && has_condition(s, "RuntimeResolved", "True", "SelectedByVendor")
        })
        .await?;
        assert_eq!(image(&ns).await?.as_deref(), Some("example.com/engine:a"));
        // b outranks a now: the service follows, the backend is re-rendered.
        apply_runtime(
            &client,
            &runtime_named(&b, &vendor, 50, "example.com/engine:b")?,
        )
        .await?;
        wait_service(&ns, "switch", "runtime b", |s| {
            s.status
                .as_ref()
                .and_then(|st| st.resolved_runtime.as_deref())
                == Some(b.as_str())
        })
        .await?;
        wait_until("backend image b", WAIT, || async {
            let img = image(&ns).await?;
            Ok(if img.as_deref() == Some("example.com/engine:b") {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{img:?}"))
            })
        })
        .await?;
        // Every runtime of the vendor gone: a condition that says what to do, not an error.
        let rts: Api<InferenceRuntime> = Api::all(client.clone());
        rts.delete(&a, &DeleteParams::default()).await?;
        rts.delete(&b, &DeleteParams::default()).await?;
        let svc = wait_service(&ns, "switch", "NoRuntimeForVendor", |s| {
            has_condition(s, "RuntimeResolved", "False", "NoRuntimeForVendor")
        })
        .await?;
        assert!(
            condition(&svc, "RuntimeResolved")
                .is_some_and(|c| c.message.contains("spec.runtime.selector.vendor"))
        );
        assert_eq!(phase(&svc), Some(LLMServicePhase::Pending));
        Ok::<_, anyhow::Error>(())
    }
    .await;
    running.stop().await;
    let rts: Api<InferenceRuntime> = Api::all(client.clone());
    for n in [&a, &b, &other] {
        let _ = rts.delete(n, &DeleteParams::default()).await;
    }
    result
}

/// The HAMi example's fraction policy, renamed and limited to one namespace so it touches no
/// other test's backends (ServingPolicies are cluster-scoped).
fn scoped_fraction_policy(name: &str, namespace: &str) -> Result<hearth_crds::ServingPolicy> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/hami/fraction-policy.yaml");
    let mut p: Value = read_yaml(&path)?;
    p["metadata"]["name"] = json!(name);
    p["spec"]["matchConditions"]
        .as_array_mut()
        .context("the example has matchConditions")?
        .push(json!({
            "name": "this-test-only",
            "expression": format!("service != null && service.metadata.namespace == {namespace:?}"),
        }));
    Ok(serde_json::from_value(p)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_platform_policy_in_the_cluster_renders_fractions() -> Result<()> {
    let (client, ns) = setup("ctrl-policy").await?;
    let rt_name = format!("{}-hami", ns.name());
    let mut rt: InferenceRuntime = read_yaml(
        &PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../examples/hami/runtime.yaml"),
    )?;
    rt.metadata.name = Some(rt_name.clone());
    apply_runtime(&client, &rt).await?;
    let policies: Api<hearth_crds::ServingPolicy> = Api::all(client.clone());
    let policy_name = format!("{}-fraction", ns.name());
    let running = start_default(&client, &ns);
    let svc = uncached_service(
        "slice",
        json!({
            "runtime": {"name": rt_name},
            "resources": {"accelerators": 1, "fraction": {"memory": "8Gi", "cores": 30}},
        }),
    )?;
    create_service(&ns, svc).await?;
    let limits = |ns: &TestNamespace| {
        let api: Api<Deployment> = ns.api();
        async move {
            Ok::<_, anyhow::Error>(api.get_opt("slice").await?.and_then(|d| {
                d.spec?.template.spec?.containers[0]
                    .resources
                    .clone()?
                    .limits
            }))
        }
    };
    let result = async {
        // No policy renders the fraction: refused with a condition, no backend.
        let svc = wait_service(&ns, "slice", "fraction refused", |s| {
            has_condition(s, "Ready", "False", "PolicyFailed")
        })
        .await?;
        let msg = &condition(&svc, "Ready").context("Ready")?.message;
        assert!(
            msg.contains("no ServingPolicy renders fractional devices"),
            "{msg}"
        );
        assert!(
            limits(&ns).await?.is_none(),
            "no backend without the policy"
        );
        // The platform policy arrives: the service is reconciled without a restart or an edit.
        policies
            .patch(
                &policy_name,
                &PatchParams::apply(TEST_MANAGER).force(),
                &Patch::Apply(&scoped_fraction_policy(&policy_name, ns.name())?),
            )
            .await?;
        let got = wait_until("HAMi resources on the backend", WAIT, || async {
            let l = limits(&ns).await?;
            Ok(match &l {
                Some(l) if l.contains_key("nvidia.com/gpumem") => Observed::Ready(l.clone()),
                _ => Observed::NotYet(format!("limits {l:?}")),
            })
        })
        .await?;
        assert_eq!(got["nvidia.com/gpumem"].0, "8192");
        assert_eq!(got["nvidia.com/gpucores"].0, "30");
        assert_eq!(got["nvidia.com/gpu"].0, "1");
        wait_service(&ns, "slice", "no longer refused", |s| {
            !has_condition(s, "Ready", "False", "PolicyFailed")
        })
        .await?;
        // And its removal brings the refusal back.
        policies
            .delete(&policy_name, &DeleteParams::default())
            .await?;
        wait_service(&ns, "slice", "refused again", |s| {
            has_condition(s, "Ready", "False", "PolicyFailed")
        })
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    running.stop().await;
    let _ = policies
        .delete(&policy_name, &DeleteParams::default())
        .await;
    let rts: Api<InferenceRuntime> = Api::all(client.clone());
    let _ = rts.delete(&rt_name, &DeleteParams::default()).await;
    result
}

/// The note of the first Event with `reason` about the object `name` of `ns`, waited for.
async fn wait_event(ns: &TestNamespace, name: &str, reason: &str) -> Result<String> {
    let events: Api<Event> = ns.api();
    let fields = format!("involvedObject.name={name},reason={reason}");
    wait_until(format!("the {reason} Event on {name}"), WAIT, || async {
        let list = events.list(&ListParams::default().fields(&fields)).await?;
        Ok(match list.items.first() {
            Some(e) => Observed::Ready(e.message.clone().unwrap_or_default()),
            None => Observed::NotYet(format!("no {reason} Event")),
        })
    })
    .await
}

/// A report-only ServingPolicy in the cluster (step 2 of a rollout, docs/policies.md): the
/// backend is not changed, it carries the report, and the LLMService gets a `PolicyReport`
/// Event; switched to `Patch`, the same policy changes the backend and the report says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_report_only_policy_reports_on_the_backend_and_changes_nothing() -> Result<()> {
    let (client, ns) = setup("ctrl-report").await?;
    apply_stub_runtime(&client).await?;
    let policies: Api<hearth_crds::ServingPolicy> = Api::all(client.clone());
    let policy_name = format!("{}-team", ns.name());
    let policy = |actions: Value| -> Result<hearth_crds::ServingPolicy> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
            "metadata": {"name": policy_name},
            "spec": {
                "matchConditions": [{"name": "this-test-only", "expression":
                    format!("service != null && service.metadata.namespace == {:?}", ns.name())}],
                "mutationActions": actions,
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "Object{spec: Object.spec{template: Object.spec.template{metadata: Object.spec.template.metadata{labels: {'example.com/team': 'ml'}}}}}"}}]
            }
        }))?)
    };
    let pp = PatchParams::apply(TEST_MANAGER).force();
    policies
        .patch(
            &policy_name,
            &pp,
            &Patch::Apply(&policy(json!(["Warn", "Audit"]))?),
        )
        .await?;
    let running = start_default(&client, &ns);
    let result = async {
        create_service(&ns, read_yaml(&upstream("stub-llmservice.yaml"))?).await?;
        let deployments: Api<Deployment> = ns.api();
        let team_label = |d: &Deployment| {
            d.spec
                .as_ref()
                .and_then(|s| s.template.metadata.as_ref())
                .and_then(|m| m.labels.as_ref())
                .and_then(|l| l.get("example.com/team").cloned())
        };
        let report = |d: &Deployment| hearth_controller::policy::reports_of(d);
        let want = "ServingPolicy '{}' would change the object (report-only, not applied): add /spec/template/metadata/labels/example.com~1team"
            .replace("{}", &policy_name);
        let backend = wait_until("the backend with the policy's report", WAIT, || async {
            Ok(match deployments.get_opt("stub-svc").await? {
                Some(d) if report(&d) == [want.clone()] => Observed::Ready(d),
                Some(d) => Observed::NotYet(format!("reports {:?}", report(&d))),
                None => Observed::NotYet("no backend".into()),
            })
        })
        .await?;
        assert_eq!(team_label(&backend), None, "a report-only policy changed the backend");
        let note = wait_event(&ns, "stub-svc", "PolicyReport").await?;
        assert!(note.contains(&want), "{note}");

        // Enforced: the policy changes the backend, and the report says it did.
        policies
            .patch(&policy_name, &pp, &Patch::Apply(&policy(json!(["Patch", "Warn"]))?))
            .await?;
        let changed = want.replace("would change the object (report-only, not applied)", "changed the object");
        wait_until("the backend changed by the policy", WAIT, || async {
            Ok(match deployments.get_opt("stub-svc").await? {
                Some(d) if team_label(&d).as_deref() == Some("ml") && report(&d) == [changed.clone()] => {
                    Observed::Ready(())
                }
                Some(d) => Observed::NotYet(format!("label {:?}, reports {:?}", team_label(&d), report(&d))),
                None => Observed::NotYet("no backend".into()),
            })
        })
        .await?;
        // Removed: no report left on the backend.
        policies.delete(&policy_name, &DeleteParams::default()).await?;
        wait_until("the report gone", WAIT, || async {
            Ok(match deployments.get_opt("stub-svc").await? {
                Some(d) if report(&d).is_empty() => Observed::Ready(()),
                other => Observed::NotYet(format!("{:?}", other.map(|d| report(&d)))),
            })
        })
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    running.stop().await;
    let _ = policies
        .delete(&policy_name, &DeleteParams::default())
        .await;
    result
}

/// Someone else (another field manager, forcing) applies `pod` as the pod template spec of the
/// Deployment `name`.
async fn edit_pod_template(ns: &TestNamespace, name: &str, pod: Value) -> Result<()> {
    let edit = json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {"template": {"spec": pod}}
    });
    ns.api::<Deployment>()
        .patch(
            name,
            &PatchParams::apply("someone-else").force(),
            &Patch::Apply(&edit),
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_is_repaired_and_idle_makes_no_writes() -> Result<()> {
    let (client, ns) = setup("ctrl-drift").await?;
    let rt = apply_stub_runtime(&client).await?;
    // A short resync, so idling means many reconciles.
    let running = start(
        client.clone(),
        ns.name(),
        test_render_config(),
        Duration::from_millis(500),
    );
    let svc = create_service(&ns, read_yaml(&upstream("stub-llmservice.yaml"))?).await?;
    wait_service(&ns, "stub-svc", "ScaledToZero", |s| {
        phase(s) == Some(LLMServicePhase::ScaledToZero)
    })
    .await?;
    assert_children(&ns, &svc, &rt).await?;

    // A deleted child comes back.
    let services: Api<Service> = ns.api();
    services
        .delete("stub-svc-backend", &DeleteParams::default())
        .await?;
    wait_until("backend Service recreated", WAIT, || async {
        Ok(match services.get_opt("stub-svc-backend").await? {
            Some(s) if s.metadata.deletion_timestamp.is_none() => Observed::Ready(()),
            _ => Observed::NotYet("absent".into()),
        })
    })
    .await?;
    // An edited field the controller owns is set back.
    let gateways: Api<Deployment> = ns.api();
    edit_pod_template(
        &ns,
        "stub-svc-gateway",
        json!({"containers": [{"name": "gateway", "image": "evil.example.com/gw:1"}]}),
    )
    .await?;
    let want = test_render_config().gateway_image;
    wait_until("gateway image repaired", WAIT, || async {
        let d = gateways.get("stub-svc-gateway").await?;
        let img = d
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|p| p.containers[0].image.clone());
        Ok(if img.as_deref() == Some(want.as_str()) {
            Observed::Ready(())
        } else {
            Observed::NotYet(format!("{img:?}"))
        })
    })
    .await?;
    wait_service(&ns, "stub-svc", "ScaledToZero after repair", |s| {
        phase(s) == Some(LLMServicePhase::ScaledToZero)
    })
    .await?;

    // status.lastWake is the gateway's, written under its own field manager as the gateway's
    // sleeping tier does: the controller's status is unchanged by it (no write below while
    // idle), and its later status writes keep it.
    let svcs: Api<LLMService> = ns.api();
    let wake = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMService",
        "status": {"lastWake": {
            "startTime": "2026-12-03T10:00:00Z",
            "readyTime": "2026-12-03T10:00:01Z",
            "endpoint": "198.18.0.7:8000",
            "level": 1,
            "gateway": "stub-svc-gateway-0",
            "phases": {"wakeDecision": "3ms", "wakeUp": "1s", "total": "1.003s"},
        }},
    });
    svcs.patch_status(
        "stub-svc",
        &PatchParams::apply(GATEWAY_FIELD_MANAGER).force(),
        &Patch::Apply(&wake),
    )
    .await?;

    // Idle: record every resourceVersion, let at least 10 reconciles run, compare.
    let snapshot = || async {
        let mut rvs = Vec::new();
        let svcs: Api<LLMService> = ns.api();
        let s = svcs.get("stub-svc").await?;
        rvs.push(("LLMService".to_owned(), s.resource_version()));
        let children = hearth_controller::render(&s, &rt, &test_render_config(), false)?;
        for v in children.to_values()? {
            let kind = v["kind"].as_str().unwrap_or_default().to_owned();
            if kind == "ScaledObject" {
                // KEDA's operator writes its status; only our writes count here.
                continue;
            }
            let api: Api<DynamicObject> = Api::namespaced_with(
                client.clone(),
                ns.name(),
                &resource_of(&kind, v["apiVersion"].as_str().unwrap_or("")),
            );
            let name = v["metadata"]["name"].as_str().unwrap_or_default();
            rvs.push((
                format!("{kind}/{name}"),
                api.get(name).await?.resource_version(),
            ));
        }
        Ok::<_, anyhow::Error>(rvs)
    };
    // Settle: two snapshots in a row with 10 reconciles between them, no resourceVersion
    // changed and not one write (apply, create or status) was sent.
    let reconciles = || running.metrics.reconciles.get();
    let writes = || running.metrics.writes.get();
    let mut before = snapshot().await?;
    let mut stable = false;
    for _ in 0..20 {
        let start = reconciles();
        let writes_before = writes();
        wait_until("10 reconciles", WAIT, || async {
            let n = reconciles() - start;
            Ok(if n >= 10 {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{n} reconciles"))
            })
        })
        .await?;
        let after = snapshot().await?;
        if after == before && writes() == writes_before {
            stable = true;
            break;
        }
        before = after;
    }
    assert!(
        stable,
        "writes or resourceVersion changes kept happening while idle: {before:?}"
    );

    // An edit makes the controller write its status (observedGeneration): lastWake stays, and
    // stays the gateway's alone.
    svcs.patch(
        "stub-svc",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"scaling": {"scaleDownStabilization": "45s"}}})),
    )
    .await?;
    let svc = wait_service(&ns, "stub-svc", "the edit observed", observed_current).await?;
    let kept = svc.status.as_ref().and_then(|s| s.last_wake.as_ref());
    assert_eq!(
        kept.map(|w| (w.endpoint.as_str(), w.phases.wake_up.as_str())),
        Some(("198.18.0.7:8000", "1s")),
        "{:?}",
        svc.status
    );
    let owners: Vec<String> = svc
        .metadata
        .managed_fields
        .iter()
        .flatten()
        .filter(|m| {
            m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0.to_string().contains("f:lastWake"))
        })
        .filter_map(|m| m.manager.clone())
        .collect();
    assert_eq!(owners, [GATEWAY_FIELD_MANAGER], "owners of status.lastWake");
    running.stop().await;
    Ok(())
}

/// The drain sidecar's image and the pod template's generation of the backend Deployment.
async fn backend_drain(ns: &TestNamespace, service: &str) -> Result<(Option<String>, i64)> {
    let api: Api<Deployment> = ns.api();
    let d = api.get(service).await?;
    let image = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.init_containers.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.name == "hearth-drain"))
        .and_then(|c| c.image.clone());
    Ok((image, d.metadata.generation.unwrap_or_default()))
}

/// The backend Deployment's pod template, as JSON.
async fn backend_template(ns: &TestNamespace, service: &str) -> Result<String> {
    let api: Api<Deployment> = ns.api();
    let d = api.get(service).await?;
    Ok(serde_json::to_string(&d.spec.map(|s| s.template))?)
}

async fn wait_drain_image(ns: &TestNamespace, service: &str, image: &str) -> Result<i64> {
    wait_until(
        format!("backend Deployment {service} with drain image {image}"),
        WAIT,
        || async {
            let (got, generation) = backend_drain(ns, service).await?;
            Ok(if got.as_deref() == Some(image) {
                Observed::Ready(generation)
            } else {
                Observed::NotYet(format!("{got:?}"))
            })
        },
    )
    .await
}

/// Upgrading Hearth changes the drain sidecar's image (it follows the release). A backend with
/// pods keeps the running image, so the upgrade restarts no model server, until its template
/// changes for another reason; a backend at zero takes the new image at once. An image someone
/// else set is repaired, not kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_restarts_no_running_backend() -> Result<()> {
    let (client, ns) = setup("ctrl-upgrade").await?;
    apply_stub_runtime(&client).await?;
    let release = |tag: &str| RenderConfig {
        drain_image: Some(format!("hearth.dev/hearth-gateway:{tag}")),
        ..test_render_config()
    };
    let v1 = "hearth.dev/hearth-gateway:v1";
    let v2 = "hearth.dev/hearth-gateway:v2";

    let running = start(
        client.clone(),
        ns.name(),
        release("v1"),
        Duration::from_millis(500),
    );
    // The upstream example (min 0: no pods), and one kept at a replica.
    let idle: LLMService = read_yaml(&upstream("stub-llmservice.yaml"))?;
    let mut busy = idle.clone();
    busy.metadata.name = Some("busy-svc".to_owned());
    busy.spec.scaling.min = 1;
    let mut edited = busy.clone();
    edited.metadata.name = Some("edited-svc".to_owned());
    create_service(&ns, idle).await?;
    create_service(&ns, busy).await?;
    create_service(&ns, edited).await?;
    wait_drain_image(&ns, "stub-svc", v1).await?;
    wait_drain_image(&ns, "edited-svc", v1).await?;
    let busy_generation = wait_drain_image(&ns, "busy-svc", v1).await?;
    assert_eq!(backend_replicas(&ns, "busy-svc").await?, Some(1));
    // The pod template is what a restart follows (the generation also counts a replica count
    // KEDA writes).
    let busy_template = backend_template(&ns, "busy-svc").await?;
    running.stop().await;

    // The upgrade.
    let running = start(
        client.clone(),
        ns.name(),
        release("v2"),
        Duration::from_millis(500),
    );
    wait_drain_image(&ns, "stub-svc", v2).await?;
    let start_count = running.metrics.reconciles.get();
    wait_until("10 reconciles after the upgrade", WAIT, || async {
        let n = running.metrics.reconciles.get() - start_count;
        Ok(if n >= 10 {
            Observed::Ready(())
        } else {
            Observed::NotYet(format!("{n} reconciles"))
        })
    })
    .await?;
    assert_eq!(
        backend_drain(&ns, "busy-svc").await?.0.as_deref(),
        Some(v1),
        "the busy backend's drain image must not change for the upgrade alone"
    );
    assert_eq!(
        backend_template(&ns, "busy-svc").await?,
        busy_template,
        "the busy backend's pod template must not change for the upgrade alone"
    );

    // Someone else's image is not Hearth's to keep: the sidecar is set back, to the new image.
    edit_pod_template(
        &ns,
        "edited-svc",
        json!({"initContainers": [{"name": "hearth-drain", "image": "evil.example.com/drain:1"}]}),
    )
    .await?;
    wait_drain_image(&ns, "edited-svc", v2).await?;

    // Another change rolls the pods anyway: the new image comes along.
    let services: Api<LLMService> = ns.api();
    services
        .patch(
            "busy-svc",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"resources": {"memory": "256Mi"}}})),
        )
        .await?;
    let generation = wait_drain_image(&ns, "busy-svc", v2).await?;
    assert!(generation > busy_generation);
    running.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_the_service_removes_every_child() -> Result<()> {
    let (client, ns) = setup("ctrl-delete").await?;
    let rt = apply_stub_runtime(&client).await?;
    let running = start_default(&client, &ns);
    let mut svc: LLMService = read_yaml(&upstream("stub-llmservice.yaml"))?;
    // Push mode adds the scaler Service; a HostPath cache with prewarm adds the Job.
    svc.metadata.annotations =
        Some([("serving.hearth.dev/scaler".to_owned(), "push".to_owned())].into());
    svc.spec.cache.strategy = hearth_crds::llmservice::CacheStrategy::HostPath;
    svc.spec.cache.prewarm = true;
    let svc = create_service(&ns, svc).await?;
    wait_service(&ns, "stub-svc", "reconciled", |s| {
        observed_current(s) && phase(s).is_some()
    })
    .await?;
    let count = assert_children(&ns, &svc, &rt).await?;
    assert!(
        count == 13,
        "push mode with prewarm renders 13 children (no claim with HostPath; the gateway's PodDisruptionBudget and admin Service; the ExternalScaler's TriggerAuthentication), got {count}"
    );

    let api: Api<LLMService> = ns.api();
    api.delete("stub-svc", &DeleteParams::foreground()).await?;
    let children =
        hearth_controller::render(&svc, &rt, &test_render_config(), false)?.to_values()?;
    let client = Arc::new(client);
    wait_until("every child garbage-collected", WAIT, || {
        let client = client.clone();
        let children = children.clone();
        let ns = ns.name().to_owned();
        async move {
            let mut left = Vec::new();
            for v in &children {
                let kind = v["kind"].as_str().unwrap_or_default();
                let ar = resource_of(kind, v["apiVersion"].as_str().unwrap_or(""));
                let api: Api<DynamicObject> = Api::namespaced_with((*client).clone(), &ns, &ar);
                let name = v["metadata"]["name"].as_str().unwrap_or_default();
                if api.get_opt(name).await?.is_some() {
                    left.push(format!("{kind}/{name}"));
                }
            }
            Ok(if left.is_empty() {
                Observed::Ready(())
            } else {
                Observed::NotYet(left.join(", "))
            })
        }
    })
    .await?;
    running.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_takeover_after_expiry() -> Result<()> {
    use hearth_controller::leader::{LeaseConfig, try_acquire};
    let cluster = connect().await?;
    let ns = cluster.namespace("ctrl-lease").await?;
    let api: Api<k8s_openapi::api::coordination::v1::Lease> = ns.api();
    let cfg = |id: &str| LeaseConfig {
        name: FIELD_MANAGER.to_owned(),
        namespace: ns.name().to_owned(),
        identity: id.to_owned(),
        lease_duration: Duration::from_secs(2),
        renew_interval: Duration::from_millis(500),
    };
    assert!(try_acquire(&api, &cfg("a")).await?);
    assert!(
        !try_acquire(&api, &cfg("b")).await?,
        "b took a lease a holds"
    );
    assert!(try_acquire(&api, &cfg("a")).await?, "a could not renew");
    // a stops renewing; b takes over once the lease has expired.
    wait_until(
        "b takes over the expired lease",
        Duration::from_secs(30),
        || async {
            Ok(if try_acquire(&api, &cfg("b")).await? {
                Observed::Ready(())
            } else {
                Observed::NotYet("a still holds it".into())
            })
        },
    )
    .await?;
    let lease = api.get(FIELD_MANAGER).await?;
    let spec = lease.spec.unwrap_or_default();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(spec.lease_transitions, Some(1));
    assert!(!try_acquire(&api, &cfg("a")).await?);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn released_lease_is_taken_at_once_and_renewal_stops() -> Result<()> {
    use hearth_controller::leader::{LeaseConfig, acquire, release, try_acquire};
    let cluster = connect().await?;
    let ns = cluster.namespace("ctrl-release").await?;
    let api: Api<k8s_openapi::api::coordination::v1::Lease> = ns.api();
    // A lease far longer than the test: only a release lets b in.
    let cfg = |id: &str| LeaseConfig {
        name: FIELD_MANAGER.to_owned(),
        namespace: ns.name().to_owned(),
        identity: id.to_owned(),
        lease_duration: Duration::from_secs(300),
        renew_interval: Duration::from_millis(200),
    };
    let a = acquire(cluster.client(), cfg("a")).await?;
    assert!(*a.holding().borrow());
    assert!(
        !try_acquire(&api, &cfg("b")).await?,
        "b took a lease a holds"
    );
    assert!(
        !release(&api, &cfg("b")).await?,
        "b released a lease it does not hold"
    );
    let spec = api.get(FIELD_MANAGER).await?.spec.unwrap_or_default();
    assert_eq!(
        spec.holder_identity.as_deref(),
        Some("a"),
        "b's release wrote"
    );
    assert!(a.release().await?, "a could not release its lease");
    let spec = api.get(FIELD_MANAGER).await?.spec.unwrap_or_default();
    assert_eq!(spec.holder_identity.as_deref(), Some(""));
    assert_eq!(spec.lease_duration_seconds, Some(1));
    assert!(
        try_acquire(&api, &cfg("b")).await?,
        "b could not take the released lease"
    );
    // a's renewal stopped with the release: it does not take the lease back.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spec = api.get(FIELD_MANAGER).await?.spec.unwrap_or_default();
    assert_eq!(spec.holder_identity.as_deref(), Some("b"));
    assert_eq!(spec.lease_transitions, Some(1));
    Ok(())
}

/// An LLMAdapter `name` on service `base` from `uri`, `spec` merged into its spec.
fn adapter(
    ns: &TestNamespace,
    name: &str,
    base: &str,
    uri: &str,
    spec: Value,
) -> Result<hearth_crds::LLMAdapter> {
    let mut a = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name, "namespace": ns.name()},
        "spec": {"serviceRef": {"name": base}, "source": {"uri": uri}},
    });
    hearth_test_support::merge_json(&mut a["spec"], spec);
    Ok(serde_json::from_value(a)?)
}

/// Waits until adapter `name`'s condition `type_` has `status` and `reason`.
async fn wait_adapter(
    ns: &TestNamespace,
    name: &str,
    type_: &str,
    status: &str,
    reason: &str,
) -> Result<hearth_crds::LLMAdapter> {
    let api: Api<hearth_crds::LLMAdapter> = ns.api();
    wait_until(
        format!("LLMAdapter {name}: {type_}={status} ({reason})"),
        WAIT,
        || async {
            let a = api.get(name).await?;
            let ok = a.status.as_ref().is_some_and(|s| {
                s.conditions
                    .iter()
                    .any(|c| c.type_ == type_ && c.status == status && c.reason == reason)
            });
            Ok(if ok {
                Observed::Ready(a)
            } else {
                Observed::NotYet(format!("status {}", serde_json::to_string(&a.status)?))
            })
        },
    )
    .await
}

/// Adapters on a base whose runtime serves them (at most 3): each gets its `Accepted` by the
/// admission rule (a taken name refused, and then a fourth accepted one too many, since a
/// refused adapter holds no place; each naming why), the base's backend is
/// rendered with the runtime's adapter flags and one read-only volume for the claim both
/// `pvc://` adapters live on, the hub one gets a fetch Job into the base's model cache, the
/// gateway reads the ConfigMap `<svc>-adapters` (its Role may read it) listing the adapters (the
/// hub one unavailable while it is fetched, and `Loaded=False` `Fetching`), `Loaded` says no
/// engine is ready (the base is at zero); deleting them takes the flags, the volume, the Job
/// and the ConfigMap away again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_accepted_by_the_rule_rendered_and_removed() -> Result<()> {
    let (client, ns) = setup("ctrl-lora").await?;
    let rt_name = format!("{}-lora", ns.name());
    let mut rt = runtime_named(&rt_name, ns.name(), 1, "example.com/engine:lora")?;
    rt.spec.adapters = Some(serde_json::from_value(json!({
        "args": ["--enable-lora", "--max-lora-rank=16"],
        "env": [{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"}],
        "maxAdapters": 3,
    }))?);
    apply_runtime(&client, &rt).await?;
    let running = start_default(&client, &ns);
    let result = async {
        // A model cache on the node, for the hub adapter.
        let svc = uncached_service(
            "qwen",
            json!({"runtime": {"name": rt_name}, "cache": {"strategy": "HostPath"}}),
        )?;
        create_service(&ns, svc).await?;
        let api: Api<hearth_crds::LLMAdapter> = ns.api();
        // Created one after another (and named in that order: creationTimestamps share seconds,
        // and ties go by name), so each is younger than the ones before.
        for a in [
            adapter(
                &ns,
                "a-sql",
                "qwen",
                "pvc://lora/qwen/sql",
                json!({"rank": 16}),
            )?,
            adapter(&ns, "b-chat", "qwen", "pvc://lora/qwen/chat", json!({}))?,
            adapter(
                &ns,
                "c-clash",
                "qwen",
                "pvc://lora/x",
                json!({"servedName": "a-sql"}),
            )?,
            adapter(&ns, "d-hub", "qwen", "hf://acme/qwen-lora", json!({}))?,
            adapter(&ns, "e-extra", "qwen", "pvc://lora/y", json!({}))?,
            adapter(&ns, "f-orphan", "nobody", "pvc://lora/z", json!({}))?,
        ] {
            api.create(&PostParams::default(), &a).await?;
        }
        for name in ["a-sql", "b-chat", "d-hub"] {
            let a = wait_adapter(&ns, name, "Accepted", "True", "Accepted").await?;
            assert_eq!(
                a.status.as_ref().and_then(|s| s.served_name.as_deref()),
                Some(name)
            );
        }
        let clash = wait_adapter(&ns, "c-clash", "Accepted", "False", "ModelNameConflict").await?;
        let msg = &clash.status.as_ref().unwrap().conditions[0].message;
        assert!(
            msg.contains(&format!("LLMAdapter {}/a-sql", ns.name())),
            "{msg}"
        );
        let extra = wait_adapter(&ns, "e-extra", "Accepted", "False", "TooManyAdapters").await?;
        let msg = &extra.status.as_ref().unwrap().conditions[0].message;
        assert!(msg.contains("maxAdapters: 3"), "{msg}");
        wait_adapter(&ns, "f-orphan", "Accepted", "False", "ServiceNotFound").await?;
        // The engine-reported part: no engine at zero; the hub one is being fetched.
        wait_adapter(&ns, "a-sql", "Loaded", "False", "NoReadyEngine").await?;
        let fetch_job = hearth_controller::render::fetch_job_name(
            "qwen",
            &adapter(&ns, "d-hub", "qwen", "hf://acme/qwen-lora", json!({}))?,
        )
        .context("a hub adapter's fetch Job")?;
        let hub = wait_adapter(&ns, "d-hub", "Loaded", "False", "Fetching").await?;
        let msg = &hub.status.as_ref().unwrap().conditions;
        assert!(
            msg.iter().any(|c| c.message.contains(&fetch_job)),
            "{msg:?}"
        );
        let jobs: Api<k8s_openapi::api::batch::v1::Job> = ns.api();
        let job = jobs.get(&fetch_job).await?;
        let program = job
            .spec
            .and_then(|s| s.template.spec)
            .map(|p| p.containers[0].command.clone().unwrap_or_default())
            .unwrap_or_default();
        assert!(
            program
                .iter()
                .any(|c| c.contains("local_dir=\"/models/adapters/hf/acme/qwen-lora\"")),
            "{program:?}"
        );

        // The backend: flags once, environment, one volume for claim `lora`.
        let deployments: Api<Deployment> = ns.api();
        let backend = wait_until("the backend with the adapter flags", WAIT, || async {
            let d = deployments.get("qwen").await?;
            let pod = d
                .spec
                .as_ref()
                .and_then(|s| s.template.spec.clone())
                .unwrap_or_default();
            let args = pod.containers[0].args.clone().unwrap_or_default();
            Ok(if args.iter().any(|a| a == "--enable-lora") {
                Observed::Ready(pod)
            } else {
                Observed::NotYet(format!("args {args:?}"))
            })
        })
        .await?;
        let c = &backend.containers[0];
        assert_eq!(
            c.args
                .iter()
                .flatten()
                .filter(|a| *a == "--enable-lora")
                .count(),
            1
        );
        assert!(
            c.env
                .iter()
                .flatten()
                .any(|e| e.name == "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        );
        let claims: Vec<_> = backend
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| v.persistent_volume_claim.as_ref())
            .collect();
        assert_eq!(claims.len(), 1, "one volume for claim lora: {claims:?}");
        assert_eq!(claims[0].claim_name, "lora");
        assert_eq!(claims[0].read_only, Some(true));

        // The gateway's table: the two pvc:// adapters, and the hub one, unavailable.
        let cms: Api<k8s_openapi::api::core::v1::ConfigMap> = ns.api();
        let table = wait_until("ConfigMap qwen-adapters", WAIT, || async {
            Ok(match cms.get_opt("qwen-adapters").await? {
                Some(cm) => Observed::Ready(cm),
                None => Observed::NotYet("absent".into()),
            })
        })
        .await?;
        let table: hearth_crds::llmadapter::AdapterTable = serde_json::from_str(
            &table.data.unwrap_or_default()[hearth_crds::llmadapter::ADAPTERS_KEY],
        )?;
        let routed: Vec<(&str, &str)> = table
            .adapters
            .iter()
            .map(|a| (a.name.as_str(), a.path.as_str()))
            .collect();
        assert_eq!(
            routed,
            [
                ("a-sql", "/adapters/pvc/lora/qwen/sql"),
                ("b-chat", "/adapters/pvc/lora/qwen/chat"),
                ("d-hub", "/models/adapters/hf/acme/qwen-lora"),
            ]
        );
        let unavailable: Vec<bool> = table
            .adapters
            .iter()
            .map(|a| a.unavailable.is_some())
            .collect();
        assert_eq!(unavailable, [false, false, true]);
        let gateway = deployments.get("qwen-gateway").await?;
        let gw_args = gateway
            .spec
            .and_then(|s| s.template.spec)
            .map(|p| p.containers[0].args.clone().unwrap_or_default())
            .unwrap_or_default();
        assert!(
            gw_args.contains(&"--adapters-configmap=qwen-adapters".to_owned()),
            "{gw_args:?}"
        );
        let role: Api<k8s_openapi::api::rbac::v1::Role> = ns.api();
        let rules = role.get("qwen-gateway").await?.rules.unwrap_or_default();
        assert!(rules.iter().any(|r| {
            r.resources.iter().flatten().any(|x| x == "configmaps")
                && r.resource_names
                    .iter()
                    .flatten()
                    .any(|n| n == "qwen-adapters")
        }));

        // All gone: so are the flags and the table.
        for name in ["a-sql", "b-chat", "c-clash", "d-hub", "e-extra", "f-orphan"] {
            api.delete(name, &DeleteParams::default()).await?;
        }
        wait_until(
            "the backend without adapter flags, no table",
            WAIT,
            || async {
                let d = deployments.get("qwen").await?;
                let args = d
                    .spec
                    .and_then(|s| s.template.spec)
                    .map(|p| p.containers[0].args.clone().unwrap_or_default())
                    .unwrap_or_default();
                let cm = cms.get_opt("qwen-adapters").await?;
                let job = jobs.get_opt(&fetch_job).await?;
                Ok(
                    if !args.iter().any(|a| a == "--enable-lora") && cm.is_none() && job.is_none() {
                        Observed::Ready(())
                    } else {
                        Observed::NotYet(format!(
                            "args {args:?}, table present: {}, fetch Job present: {}",
                            cm.is_some(),
                            job.is_some()
                        ))
                    },
                )
            },
        )
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    running.stop().await;
    let _ = Api::<InferenceRuntime>::all(client.clone())
        .delete(&rt_name, &DeleteParams::default())
        .await;
    result
}

/// KEDA's client certificate for the shared gateways, as the leader keeps it, and where it
/// reaches: an LLMEndpoint's gateway serves the ExternalScaler with its own certificate (Secret
/// `<ep>-scaler-tls`, its record on the gateway Deployment) and takes only the shared name; an
/// attached push-mode service's trigger authenticates through the shared
/// ClusterTriggerAuthentication with the certificate's digest; KEDA's Secret (made empty, as
/// the chart does) holds it. Then, recorded as two thirds into its life, it is issued again in
/// the keys Secret from the same CA, copied into KEDA's Secret, and the trigger's digest
/// follows.
#[tokio::test]
async fn keda_shared_client_certificate_reaches_the_shared_triggers_and_is_renewed() -> Result<()> {
    use hearth_controller::scaler_tls::{
        RECORD_ANNOTATION, Record, ScalerTlsConfig, SharedClient, SharedClientHome,
    };
    use k8s_openapi::{ByteString, api::core::v1::Secret};
    use std::collections::BTreeMap;
    use time::{OffsetDateTime, format_description::well_known::Rfc3339};

    let (client, ns) = setup("shared-client").await?;
    apply_stub_runtime(&client).await?;
    let validity = Duration::from_secs(3 * 3600);
    let ca = hearth_net::pki::generate_ca(
        hearth_controller::keys::SCALER_CA_NAME,
        Duration::from_secs(30 * 86_400),
    )?;
    let first = SharedClient::issue(&ca, validity)?;
    let bytes = |v: &str| ByteString(v.as_bytes().to_vec());
    let record_field = |r: &Record| -> Result<ByteString> { Ok(bytes(&serde_json::to_string(r)?)) };
    let keys = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("keys".into()),
            ..Default::default()
        },
        data: Some(BTreeMap::from([
            ("scaler-ca.crt".to_owned(), bytes(&ca.cert)),
            ("scaler-ca.key".to_owned(), bytes(&ca.key)),
            (
                "scaler-ca.not-after".to_owned(),
                bytes(&ca.not_after.format(&Rfc3339)?),
            ),
            (
                "scaler-shared-client.crt".to_owned(),
                bytes(&first.leaf.cert),
            ),
            (
                "scaler-shared-client.key".to_owned(),
                bytes(&first.leaf.key),
            ),
            (
                "scaler-shared-client.record".to_owned(),
                record_field(&first.record)?,
            ),
        ])),
        ..Default::default()
    };
    let secrets = ns.api::<Secret>();
    secrets.create(&PostParams::default(), &keys).await?;
    let keda = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some("keda-scaler".into()),
            ..Default::default()
        },
        ..Default::default()
    };
    secrets.create(&PostParams::default(), &keda).await?;

    let running = start_with(
        client.clone(),
        RunConfig {
            namespace: Some(ns.name().to_owned()),
            requeue: Duration::from_secs(2),
            scaler_tls: ScalerTlsConfig {
                cert_validity: validity,
                ca: Some(ca.clone()),
                shared_client: Some(first.clone()),
            },
            shared_client_home: Some(SharedClientHome {
                keys: (ns.name().to_owned(), "keys".into()),
                keda: (ns.name().to_owned(), "keda-scaler".into()),
                ca_validity: Duration::from_secs(30 * 86_400),
                every: Duration::from_secs(1),
            }),
            ..RunConfig::new(test_render_config())
        },
    );
    // An endpoint, and a push-mode service attached to it.
    let endpoints = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        ns.name(),
        &ApiResource::erase::<hearth_crds::LLMEndpoint>(&()),
    );
    endpoints
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "LLMEndpoint",
                "metadata": {"name": "models"}, "spec": {},
            }))?,
        )
        .await?;
    let mut svc: Value = read_yaml(&upstream("stub-llmservice.yaml"))?;
    svc["metadata"]["name"] = json!("chat");
    svc["metadata"]["annotations"] = json!({"serving.hearth.dev/scaler": "push"});
    svc["spec"]["endpoint"]["sharedEndpointRef"] = json!({"name": "models"});
    create_service(&ns, serde_json::from_value(svc)?).await?;

    let field = |s: &Secret, k: &str| -> String {
        s.data
            .as_ref()
            .and_then(|d| d.get(k))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned())
            .unwrap_or_default()
    };
    let scaled_objects =
        Api::<DynamicObject>::namespaced_with(client.clone(), ns.name(), &scaled_object_resource());
    let trigger = |digest: String| {
        let scaled_objects = scaled_objects.clone();
        async move {
            let so = scaled_objects.get_opt("chat").await?;
            let t = so
                .map(|o| o.data["spec"]["triggers"][0].clone())
                .unwrap_or_default();
            Ok::<_, anyhow::Error>(
                if t["authenticationRef"]
                    == json!({"name": "hearth-scaler", "kind": "ClusterTriggerAuthentication"})
                    && t["metadata"]["tlsDigest"] == digest.as_str()
                {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(format!("trigger {t}"))
                },
            )
        }
    };
    wait_until(
        "the shared trigger with the certificate's digest",
        WAIT,
        || trigger(first.record.digest()),
    )
    .await?;
    let published = secrets.get("keda-scaler").await?;
    assert_eq!(field(&published, "tls.crt"), first.leaf.cert);
    assert_eq!(field(&published, "ca.crt"), ca.cert);
    let gateway = wait_until("the shared gateway with its certificate", WAIT, || {
        let (deployments, secrets) = (ns.api::<Deployment>(), secrets.clone());
        async move {
            let d = deployments.get_opt("models-gateway").await?;
            let served = secrets.get_opt("models-scaler-tls").await?.is_some();
            Ok(match d {
                Some(d) if served && d.annotations().contains_key(RECORD_ANNOTATION) => {
                    Observed::Ready(d)
                }
                _ => Observed::NotYet(format!("Secret models-scaler-tls: {served}")),
            })
        }
    })
    .await?;
    let args = gateway
        .spec
        .and_then(|s| s.template.spec)
        .map(|p| p.containers[0].args.clone().unwrap_or_default())
        .unwrap_or_default();
    assert!(
        args.contains(&format!(
            "--scaler-client-name={}",
            hearth_controller::names::SHARED_SCALER_CLIENT
        )),
        "{args:?}"
    );

    // Two thirds into its life: issued again, published, and the trigger follows.
    let due = Record::new(
        &ca.cert,
        OffsetDateTime::now_utc() + Duration::from_secs(1800),
    );
    secrets
        .patch(
            "keys",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"scaler-shared-client.record": record_field(&due)?}})),
        )
        .await?;
    let renewed = wait_until("a renewed certificate in KEDA's Secret", WAIT, || {
        let secrets = secrets.clone();
        let first = first.leaf.cert.clone();
        async move {
            let keys = secrets.get("keys").await?;
            let keda = secrets.get("keda-scaler").await?;
            let cert = field(&keda, "tls.crt");
            // The key that goes with it, too.
            Ok(
                if cert != first
                    && cert == field(&keys, "scaler-shared-client.crt")
                    && field(&keda, "tls.key") == field(&keys, "scaler-shared-client.key")
                {
                    Observed::Ready(keys)
                } else {
                    Observed::NotYet("KEDA's Secret holds the first certificate".into())
                },
            )
        }
    })
    .await?;
    let record: Record = serde_json::from_str(&field(&renewed, "scaler-shared-client.record"))?;
    assert_eq!(record.ca, ca.cert, "renewed from the same CA");
    assert!(
        OffsetDateTime::parse(&record.not_after, &Rfc3339)?
            > OffsetDateTime::now_utc() + validity / 2,
        "the record says the new expiry: {record:?}"
    );
    assert_eq!(
        field(&renewed, "scaler-ca.key"),
        ca.key,
        "the CA is untouched"
    );
    wait_until("the shared trigger with the renewed digest", WAIT, || {
        trigger(record.digest())
    })
    .await?;
    running.stop().await;
    Ok(())
}

/// A Deployment of no replicas pinned to `runtime` (or plain without one), with `labels`.
fn scanned_deployment(name: &str, runtime: Option<&str>, labels: Value) -> Result<Deployment> {
    let mut annotations = serde_json::Map::new();
    if let Some(rt) = runtime {
        annotations.insert(
            hearth_crds::wellknown::RUNTIME_ANNOTATION.to_owned(),
            json!(rt),
        );
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1"}]},
            },
        },
    }))?)
}

/// The `status.scan` of ServingPolicy `name` once it describes `generation` and `done` holds.
async fn wait_scan(
    policies: &Api<hearth_crds::ServingPolicy>,
    name: &str,
    what: &str,
    done: impl Fn(&hearth_crds::servingpolicy::ScanStatus) -> bool,
) -> Result<hearth_crds::servingpolicy::ScanStatus> {
    wait_until(format!("status.scan of {name}: {what}"), WAIT, || async {
        let p = policies.get(name).await?;
        let scan = p.status.as_ref().and_then(|s| s.scan.clone());
        Ok(match scan {
            Some(s) if s.observed_generation == p.metadata.generation && done(&s) => {
                Observed::Ready(s)
            }
            other => Observed::NotYet(format!("{other:?}")),
        })
    })
    .await
}

/// The results of `policy` in the PolicyReport of Deployment `name`, once `done` holds.
async fn wait_report(
    ns: &TestNamespace,
    name: &str,
    policy: &str,
    done: impl Fn(&[Value]) -> bool,
) -> Result<Value> {
    let deployments: Api<Deployment> = ns.api();
    let uid = deployments.get(name).await?.uid().context("uid")?;
    let reports = Api::<DynamicObject>::namespaced_with(
        ns.client(),
        ns.name(),
        &hearth_controller::scan::report_resource(),
    );
    let report_name = hearth_controller::scan::report_name(&uid);
    wait_until(
        format!("PolicyReport {report_name} of {name}"),
        WAIT,
        || async {
            let Some(r) = reports.get_opt(&report_name).await? else {
                return Ok(Observed::NotYet("no report".into()));
            };
            let mine: Vec<Value> = r.data["results"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|x| x["policy"] == policy)
                .cloned()
                .collect();
            Ok(if done(&mine) {
                Observed::Ready(serde_json::to_value(&r)?)
            } else {
                Observed::NotYet(format!("results {mine:?}"))
            })
        },
    )
    .await
}

/// `(rule, result)` of each result.
fn rule_results(results: &[Value]) -> Vec<(String, String)> {
    results
        .iter()
        .map(|r| {
            (
                r["rule"].as_str().unwrap_or_default().to_owned(),
                r["result"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// A ServingPolicy added to a cluster where workloads already run (docs/policies.md, "Reports on
/// what already runs"): the controller scans the Deployments annotated for Hearth, writes a
/// PolicyReport for each (none for a plain Deployment) and counts the results on the policy's
/// status; a change to the policy is scanned again and the reports follow; a Deployment that
/// leaves Hearth loses its report.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_policy_reports_on_the_workloads_that_already_run() -> Result<()> {
    let (client, ns) = setup("ctrl-scan").await?;
    hearth_test_support::install_policy_report_crd(&client).await?;
    let rt = apply_stub_runtime(&client).await?;
    let rt_name = rt.name_any();
    let deployments: Api<Deployment> = ns.api();
    for d in [
        scanned_deployment("labelled", Some(&rt_name), json!({"team": "a"}))?,
        scanned_deployment("unlabelled", Some(&rt_name), json!({}))?,
        scanned_deployment("plain", None, json!({}))?,
    ] {
        deployments.create(&PostParams::default(), &d).await?;
    }
    let running = start_with(
        client.clone(),
        RunConfig {
            namespace: Some(ns.name().to_owned()),
            policy_scan: Some(hearth_controller::scan::ScanConfig {
                interval: Duration::ZERO,
                rate: 200,
            }),
            ..RunConfig::new(test_render_config())
        },
    );
    let policies: Api<hearth_crds::ServingPolicy> = Api::all(client.clone());
    let name = format!("{}-team", ns.name());
    let this_namespace = json!({
        "name": "this-test-only",
        "expression": format!("object.metadata.namespace == {:?}", ns.name()),
    });
    let team = json!({
        "expression": "has(object.metadata.labels) && 'team' in object.metadata.labels",
        "message": "every workload names its team",
    });
    let result = async {
        // Added: one workload passes, one fails, the plain one is not Hearth's.
        let policy: hearth_crds::ServingPolicy = serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
            "metadata": {"name": name},
            "spec": {"matchConditions": [this_namespace], "validations": [team]},
        }))?;
        policies
            .patch(&name, &PatchParams::apply(TEST_MANAGER).force(), &Patch::Apply(&policy))
            .await?;
        let scan = wait_scan(&policies, &name, "pass 1, fail 1", |s| {
            s.resources == 2 && s.pass == 1 && s.fail == 1
        })
        .await?;
        assert_eq!((scan.warn, scan.error, scan.would_mutate), (0, 0, 0));
        assert!(scan.last_scan_time.is_some());
        let report = wait_report(&ns, "unlabelled", &name, |r| {
            rule_results(r) == [("validations".into(), "fail".into())]
        })
        .await?;
        let mine = report["results"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["policy"] == name.as_str())
            .cloned()
            .unwrap_or_default();
        assert_eq!(mine["message"], "every workload names its team");
        assert_eq!(mine["source"], "hearth");
        assert_eq!(report["scope"]["kind"], "Deployment");
        assert_eq!(report["scope"]["name"], "unlabelled");
        assert_eq!(report["metadata"]["ownerReferences"][0]["name"], "unlabelled");
        wait_report(&ns, "labelled", &name, |r| {
            rule_results(r) == [("validations".into(), "pass".into())]
        })
        .await?;
        let reports = Api::<DynamicObject>::namespaced_with(
            client.clone(),
            ns.name(),
            &hearth_controller::scan::report_resource(),
        );
        let plain_uid = deployments.get("plain").await?.uid().context("uid")?;
        assert!(
            reports
                .get_opt(&hearth_controller::scan::report_name(&plain_uid))
                .await?
                .is_none(),
            "a plain Deployment got a report"
        );

        // Changed: the validation only warns now, and a report-only mutation would add an
        // annotation to both.
        let policy: hearth_crds::ServingPolicy = serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
            "metadata": {"name": name},
            "spec": {
                "matchConditions": [this_namespace],
                "validationActions": ["Warn"],
                "validations": [team],
                "mutationActions": ["Audit"],
                "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                    "Object{metadata: Object.metadata{annotations: {'example.com/reviewed': 'true'}}}"}}],
            },
        }))?;
        policies
            .patch(&name, &PatchParams::apply(TEST_MANAGER).force(), &Patch::Apply(&policy))
            .await?;
        let scan = wait_scan(&policies, &name, "warn 1, would mutate 2", |s| {
            s.warn == 1 && s.would_mutate == 2
        })
        .await?;
        assert_eq!((scan.resources, scan.pass, scan.fail), (2, 1, 0));
        let report = wait_report(&ns, "unlabelled", &name, |r| {
            rule_results(r)
                == [
                    ("validations".into(), "warn".into()),
                    ("mutations".into(), "warn".into()),
                ]
        })
        .await?;
        let mutation = report["results"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|r| r["policy"] == name.as_str() && r["rule"] == "mutations")
            .cloned()
            .unwrap_or_default();
        assert_eq!(mutation["properties"]["outcome"], "would-mutate");
        assert!(
            mutation["properties"]["patch"]
                .as_str()
                .is_some_and(|p| p.contains("example.com~1reviewed")),
            "{mutation}"
        );
        // Report-only: nothing was changed.
        let unlabelled = deployments.get("unlabelled").await?;
        assert!(!unlabelled.annotations().contains_key("example.com/reviewed"));

        // A workload that leaves Hearth loses its report at the next scan (the policy's
        // next change).
        let labelled_uid = deployments.get("labelled").await?.uid().context("uid")?;
        deployments
            .patch(
                "labelled",
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {
                    hearth_crds::wellknown::RUNTIME_ANNOTATION: null
                }}})),
            )
            .await?;
        policies
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"validationActions": ["Audit"]}})),
            )
            .await?;
        wait_scan(&policies, &name, "one workload", |s| s.resources == 1).await?;
        wait_until("the left workload's report deleted", WAIT, || async {
            Ok(
                match reports
                    .get_opt(&hearth_controller::scan::report_name(&labelled_uid))
                    .await?
                {
                    None => Observed::Ready(()),
                    Some(_) => Observed::NotYet("still there".into()),
                },
            )
        })
        .await?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    running.stop().await;
    let _ = policies.delete(&name, &DeleteParams::default()).await;
    result
}

/// The export mode (docs/policies.md, "Exporting policies to the apiserver"), one pass at a
/// time: a policy the apiserver can run becomes a ValidatingAdmissionPolicy and its binding,
/// owned by the policy, with `status.export` and `Exported=True`; one that reads `service` says
/// why not, naming the field and the construct; a name taken by an object Hearth did not export
/// is never touched; an edit that makes a policy unexportable deletes what it exported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exportable_policies_become_admission_policies_and_the_rest_say_why() -> Result<()> {
    use hearth_controller::export::{ExportConfig, export_once};
    use hearth_policies::export::Kind;
    let (client, ns) = setup("ctrl-export").await?;
    let apis = hearth_crds::admission_apis::discover(&client).await?;
    let dynamic = |kind: Kind| -> Result<Api<kube::api::DynamicObject>> {
        let ar = kind.api_resource(&apis).context("not served")?;
        Ok(Api::all_with(client.clone(), &ar))
    };
    let selector = format!("tests.hearth.dev/export={}", ns.name());
    let cfg = ExportConfig {
        own_namespace: "hearth-system".to_owned(),
        interval: Duration::from_secs(60),
        selector: Some(selector.clone()),
    };
    let policies: Api<hearth_crds::ServingPolicy> = Api::all(client.clone());
    let policy = |name: &str, expression: &str| -> Result<hearth_crds::ServingPolicy> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
            "metadata": {"name": name, "labels": {"tests.hearth.dev/export": ns.name()}},
            "spec": {
                // Only this test's namespace: nothing else in the cluster is judged by them.
                "matchConstraints": {
                    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns.name()}},
                },
                "validations": [{"expression": expression, "message": "no"}],
            },
        }))?)
    };
    let plain = format!("{}-plain", ns.name());
    let reads_service = format!("{}-service", ns.name());
    let taken = format!("{}-taken", ns.name());
    for p in [
        policy(&plain, "has(object.metadata.labels)")?,
        policy(&reads_service, "service == null")?,
        policy(&taken, "true")?,
    ] {
        policies.create(&PostParams::default(), &p).await?;
    }
    // A ValidatingAdmissionPolicy of the platform team's own, with the name of a ServingPolicy.
    let vaps = dynamic(Kind::ValidatingAdmissionPolicy)?;
    let foreign: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": taken},
        "spec": {
            "matchConstraints": {
                "resourceRules": [{"apiGroups": ["apps"], "apiVersions": ["v1"],
                                   "operations": ["CREATE"], "resources": ["deployments"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns.name()}},
            },
            "validations": [{"expression": "true"}],
        },
    }))?;
    vaps.create(&PostParams::default(), &foreign).await?;

    // In phases, each given SETTLE: the policy object, then its binding, then the binding
    // marked enforced (the webhook evaluates the policy until then).
    let bindings = dynamic(Kind::ValidatingAdmissionPolicyBinding)?;
    let pass = export_once(&client, &cfg).await?;
    assert_eq!(
        (pass.exported, pass.not_exportable, pass.failed),
        (1, 1, 1),
        "{pass:?}"
    );
    assert!(pass.pending);
    assert!(
        bindings.get_opt(&plain).await?.is_none(),
        "bound before the policy settled"
    );
    tokio::time::sleep(hearth_controller::export::SETTLE).await;
    let pass = export_once(&client, &cfg).await?;
    assert!(pass.pending, "{pass:?}");
    let binding = bindings.get(&plain).await?;
    assert!(
        !binding
            .annotations()
            .contains_key(hearth_policies::export::ENFORCED)
    );
    tokio::time::sleep(hearth_controller::export::SETTLE).await;
    let pass = export_once(&client, &cfg).await?;
    assert!(!pass.pending, "{pass:?}");
    assert_eq!(
        bindings
            .get(&plain)
            .await?
            .annotations()
            .get(hearth_policies::export::ENFORCED)
            .map(String::as_str),
        Some("true")
    );
    let vap = vaps.get(&plain).await?;
    assert_eq!(
        vap.labels().get(hearth_policies::export::EXPORTED_FROM),
        Some(&plain)
    );
    let owner = policies.get(&plain).await?;
    assert_eq!(
        vap.owner_references()[0].uid,
        owner.metadata.uid.clone().unwrap_or_default()
    );
    let condition = |p: &hearth_crds::ServingPolicy| {
        p.status
            .as_ref()
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == "Exported"))
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
            .unwrap_or_default()
    };
    let exported = policies.get(&plain).await?;
    assert_eq!(condition(&exported).0, "True", "{:?}", exported.status);
    let kinds: Vec<String> = exported
        .status
        .as_ref()
        .and_then(|s| s.export.as_ref())
        .map(|e| e.objects.iter().map(|o| o.kind.clone()).collect())
        .unwrap_or_default();
    assert_eq!(
        kinds,
        [
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding"
        ]
    );
    let refused = policies.get(&reads_service).await?;
    let (status, reason, _) = condition(&refused);
    assert_eq!(
        (status.as_str(), reason.as_str()),
        ("False", "NotExportable")
    );
    let reasons = refused
        .status
        .and_then(|s| s.export)
        .map(|e| e.reasons)
        .unwrap_or_default();
    assert_eq!(reasons[0].field, "spec.validations[0].expression");
    assert_eq!(reasons[0].construct, "service");
    let (status, reason, message) = condition(&policies.get(&taken).await?);
    assert_eq!((status.as_str(), reason.as_str()), ("False", "ApplyFailed"));
    assert!(message.contains("Hearth did not export"), "{message}");
    assert!(
        vaps.get(&taken)
            .await?
            .labels()
            .get(hearth_policies::export::EXPORTED_FROM)
            .is_none(),
        "the platform team's own policy was taken over"
    );

    // The same pass again writes nothing new.
    let again = export_once(&client, &cfg).await?;
    assert_eq!(again.deleted, 0);

    // Edited to read `service`: no longer exportable, its objects go.
    let mut edited = policies.get(&plain).await?;
    edited.spec.validations[0].expression = "service == null".to_owned();
    policies
        .replace(&plain, &PostParams::default(), &edited)
        .await?;
    let pass = export_once(&client, &cfg).await?;
    assert_eq!(pass.deleted, 2, "{pass:?}");
    assert!(vaps.get_opt(&plain).await?.is_none());
    assert_eq!(condition(&policies.get(&plain).await?).0, "False");

    for name in [&plain, &reads_service, &taken] {
        policies.delete(name, &Default::default()).await?;
    }
    vaps.delete(&taken, &Default::default()).await?;
    Ok(())
}

//! The webhook registered with the real kube-apiserver of the local control plane
//! (`tests/cluster/up`), by URL (`https://127.0.0.1:PORT/...`) and the caBundle its self-managed
//! TLS publishes. The server runs in the test process.
//!
//! Each test makes its own namespace and its own webhook configurations, scoped to that
//! namespace (and, for cluster-scoped InferenceRuntimes, to objects labelled with it), so tests
//! running beside it in the same cluster never reach this webhook. The configurations are
//! deleted when the test ends, also when it fails.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hearth_crds::{InferenceRuntime, LLMService, ServingPolicy};
use hearth_test_support::{
    Cluster, Observed, TestNamespace, audit_annotation, create_with_warnings, run_detached,
    wait_crds_established, wait_until,
};
use hearth_webhook::registration::{Registration, Target};
use hearth_webhook::selfmanaged::{SelfManaged, SelfManagedConfig};
use hearth_webhook::{AppState, Limits, Snapshot, router, serve, watch};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::{Value, json};

const SCOPE_LABEL: &str = "tests.hearth.dev/webhook";

fn upstream(kind: &str) -> Vec<Value> {
    hearth_test_support::upstream_examples(kind)
}

/// A cluster-scoped kind a test creates and [`Cleanup`] deletes.
trait ClusterKind:
    kube::Resource<Scope = kube::core::ClusterResourceScope, DynamicType = ()>
    + Clone
    + std::fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + 'static
{
}

impl<K> ClusterKind for K where
    K: kube::Resource<Scope = kube::core::ClusterResourceScope, DynamicType = ()>
        + Clone
        + std::fmt::Debug
        + serde::de::DeserializeOwned
        + Send
        + 'static
{
}

/// Deletes cluster-scoped objects of kind `K` (ServingPolicies, InferenceRuntimes) made by a
/// test when it ends, also on failure.
struct Cleanup<K: ClusterKind> {
    client: Client,
    names: Vec<String>,
    kind: std::marker::PhantomData<K>,
}

impl<K: ClusterKind> Cleanup<K> {
    fn new(client: &Client, names: Vec<String>) -> Self {
        Self {
            client: client.clone(),
            names,
            kind: std::marker::PhantomData,
        }
    }
}

impl<K: ClusterKind> Drop for Cleanup<K> {
    fn drop(&mut self) {
        let client = self.client.clone();
        let names = std::mem::take(&mut self.names);
        let _ = run_detached(async move {
            let api: Api<K> = Api::all(client);
            for n in names {
                let _ = api.delete(&n, &DeleteParams::default()).await;
            }
        });
    }
}

/// The webhook serving in this process and registered with the cluster.
struct Webhook {
    state: AppState,
    shutdown: tokio::sync::watch::Sender<bool>,
    config: String,
    client: Client,
}

impl Webhook {
    async fn start(cluster: &Cluster, ns: &TestNamespace, cert_validity: Duration) -> Result<Self> {
        let builtins = hearth_policies::builtin::policies()?;
        let client = cluster.client();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let config = format!("hearth-test-{}", ns.name());
        let reg = Registration {
            name: config.clone(),
            target: Target::Url(format!("https://127.0.0.1:{port}")),
            ca_bundle: None,
            own_namespace: "hearth-system".to_owned(),
            timeout_seconds: 10,
            namespace_match_labels: BTreeMap::from([(
                "kubernetes.io/metadata.name".to_owned(),
                ns.name().to_owned(),
            )]),
            cluster_object_selector: Some(LabelSelector {
                match_labels: Some(BTreeMap::from([(
                    SCOPE_LABEL.to_owned(),
                    ns.name().to_owned(),
                )])),
                match_expressions: None,
            }),
        };
        let (shutdown, shutdown_rx) = tokio::sync::watch::channel(false);
        let mut state = AppState::new(Snapshot::default(), Limits::default());
        // As `hearth-webhook` runs: a runtime a review names and the snapshot lacks is read.
        state.runtimes = Some(std::sync::Arc::new(
            hearth_webhook::readthrough::RuntimeReads::new(Api::all(client.clone())),
        ));
        let hook = Self {
            state,
            shutdown,
            config: config.clone(),
            client: client.clone(),
        };
        hook.state.ready.store(false, Ordering::Release);
        let pp = PatchParams::apply("hearth-webhook-test").force();
        Api::<MutatingWebhookConfiguration>::all(client.clone())
            .patch(&config, &pp, &Patch::Apply(&reg.mutating()))
            .await
            .context("registering the mutating webhook")?;
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .patch(&config, &pp, &Patch::Apply(&reg.validating()))
            .await
            .context("registering the validating webhook")?;

        let tls = SelfManaged::new(
            client.clone(),
            SelfManagedConfig {
                namespace: ns.name().to_owned(),
                secret_name: "hearth-webhook-tls".to_owned(),
                sans: vec!["127.0.0.1".to_owned()],
                cert_validity,
                ca_validity: Duration::from_secs(3600),
                webhook_configuration: config.clone(),
                ca_propagation: Duration::from_secs(1),
            },
        );
        let store = tls
            .start(
                Duration::from_secs(1),
                hook.state.metrics.clone(),
                shutdown_rx.clone(),
            )
            .await?;
        tokio::spawn(watch::run(
            client.clone(),
            hook.state.clone(),
            builtins.into(),
            shutdown_rx.clone(),
        ));
        tokio::spawn(serve(
            listener,
            store.server_config()?,
            router(hook.state.clone()),
            Limits::default(),
            shutdown_rx,
        ));
        let ready = hook.state.ready.clone();
        wait_until(
            "the webhook's first snapshot",
            Duration::from_secs(30),
            || {
                let ready = ready.clone();
                async move {
                    Ok(if ready.load(Ordering::Acquire) {
                        Observed::Ready(())
                    } else {
                        Observed::NotYet("reflectors not synced".to_owned())
                    })
                }
            },
        )
        .await?;
        // The apiserver picks up new configurations asynchronously: wait until a review of an
        // invalid object comes back denied by this webhook.
        let api: Api<LLMService> = ns.api();
        let probe: LLMService = serde_json::from_value(llmservice(
            "probe",
            json!({"scaling": {"metric": "kvCacheUtil"}}),
        ))?;
        wait_until(
            "the apiserver to call the webhook",
            Duration::from_secs(30),
            || {
                let api = api.clone();
                let probe = probe.clone();
                async move {
                    match api.create(&dry_run(), &probe).await {
                        Err(kube::Error::Api(e)) if e.message.contains("spec.scaling.metric") => {
                            Ok(Observed::Ready(()))
                        }
                        other => Ok(Observed::NotYet(format!("{other:?}"))),
                    }
                }
            },
        )
        .await?;
        Ok(hook)
    }

    /// The sum of the counter `metric`'s series whose labels include `label="value"`.
    fn counter(&self, metric: &str, label: &str, value: &str) -> u64 {
        let text = self.state.metrics.encode();
        text.lines()
            .filter(|l| {
                l.starts_with(&format!("{metric}{{")) && l.contains(&format!("{label}=\"{value}\""))
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    }

    /// `hearth_webhook_runtime_reads_total{result}`.
    fn runtime_reads(&self, result: &str) -> u64 {
        self.counter("hearth_webhook_runtime_reads_total", "result", result)
    }

    fn reviews(&self, kind: &str) -> u64 {
        self.counter("hearth_webhook_reviews_total", "kind", kind)
    }
}

impl Drop for Webhook {
    fn drop(&mut self) {
        let _ = self.shutdown.send(true);
        // Remove the registrations even when the test failed.
        let client = self.client.clone();
        let name = self.config.clone();
        let _ = run_detached(async move {
            let dp = DeleteParams::default();
            let _ = Api::<MutatingWebhookConfiguration>::all(client.clone())
                .delete(&name, &dp)
                .await;
            let _ = Api::<ValidatingWebhookConfiguration>::all(client)
                .delete(&name, &dp)
                .await;
        });
    }
}

fn dry_run() -> PostParams {
    PostParams {
        dry_run: true,
        ..PostParams::default()
    }
}

fn llmservice(name: &str, spec: Value) -> Value {
    let defaults = json!({
        "model": {"source": {"uri": "hf://Qwen/Qwen2.5-0.5B-Instruct"}},
        "runtime": {"name": "vllm-nvidia-a10"},
        "cache": {"size": "30Gi"},
    });
    hearth_test_support::llmservice(name, defaults, spec)
}

async fn setup(prefix: &str, cert_validity: Duration) -> Result<(TestNamespace, Webhook)> {
    let cluster = Cluster::connect().await?;
    // An installed Hearth's webhook would admit this test's objects too.
    cluster.require_hearth_not_installed().await?;
    // Hearth's CRDs, which the webhook watches (idempotent server-side apply; the same content
    // as `crds/`), so the suite also runs first on a new cluster.
    let crds: Api<CustomResourceDefinition> = Api::all(cluster.client());
    let mut names = Vec::new();
    for (_, crd) in hearth_crds::crds() {
        let name = crd.metadata.name.clone().unwrap_or_default();
        crds.patch(
            &name,
            &PatchParams::apply("hearth-webhook-test").force(),
            &Patch::Apply(&crd),
        )
        .await
        .with_context(|| format!("applying CRD {name}"))?;
        names.push(name);
    }
    wait_crds_established(&cluster.client(), &names).await?;
    let ns = cluster.namespace(prefix).await?;
    let hook = Webhook::start(&cluster, &ns, cert_validity).await?;
    Ok((ns, hook))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_examples_are_accepted_and_invalid_llmservices_rejected() -> Result<()> {
    let (ns, hook) = setup("webhook-validate", Duration::from_secs(3600)).await?;

    // Runtimes are cluster-scoped and shared with other suites (they may exist already):
    // applied with server-side dry run, which runs admission (CREATE or UPDATE) without storing.
    let apply = PatchParams::apply("hearth-webhook-test").force().dry_run();
    let runtimes: Api<InferenceRuntime> = Api::all(ns.client());
    let before = hook.reviews("InferenceRuntime");
    for mut rt in upstream("InferenceRuntime") {
        rt["metadata"]["labels"][SCOPE_LABEL] = json!(ns.name());
        let rt: InferenceRuntime = serde_json::from_value(rt)?;
        let name = rt.metadata.name.clone().unwrap_or_default();
        runtimes
            .patch(&name, &apply, &Patch::Apply(&rt))
            .await
            .with_context(|| format!("upstream runtime {name}"))?;
    }
    assert_eq!(
        hook.reviews("InferenceRuntime") - before,
        3,
        "each runtime was reviewed"
    );
    let mut bad = upstream("InferenceRuntime").remove(0);
    bad["metadata"]["labels"][SCOPE_LABEL] = json!(ns.name());
    bad["spec"]["container"]["args"] = json!(["{{ .Model.Name }}"]);
    let bad: InferenceRuntime = serde_json::from_value(bad)?;
    let err = runtimes
        .patch(
            bad.metadata.name.as_deref().unwrap_or_default(),
            &apply,
            &Patch::Apply(&bad),
        )
        .await
        .expect_err("a runtime with an unknown template is denied");
    assert!(err.to_string().contains("unknown template"), "{err}");

    // The upstream LLMServices are stored, unchanged but for their namespace.
    let services: Api<LLMService> = ns.api();
    for mut svc in upstream("LLMService") {
        if let Some(m) = svc["metadata"].as_object_mut() {
            m.remove("namespace");
        }
        let svc: LLMService = serde_json::from_value(svc)?;
        services
            .create(&PostParams::default(), &svc)
            .await
            .with_context(|| format!("upstream LLMService {:?}", svc.metadata.name))?;
    }

    let cases = [
        (
            json!({"model": {"source": {"uri": "pvc://weights/../../etc"}}}),
            "spec.model.source.uri: subpath \"../../etc\" has a '..' segment",
        ),
        (
            json!({"model": {"source": {"uri": "s3://bucket/qwen"}}}),
            "unsupported scheme \"s3\"",
        ),
        (
            json!({"model": {"catalogRef": "qwen"}}),
            "spec.model.catalogRef: catalog resolution is not supported",
        ),
        (
            json!({"resources": {"fraction": {"cores": 50}}}),
            "spec.resources.fraction: InferenceRuntime \"vllm-nvidia-a10\"",
        ),
        (
            json!({"scaling": {"metric": "kvCacheUtil"}}),
            "spec.scaling.metric: kvCacheUtil is reserved",
        ),
        (
            json!({"cache": {"strategy": "SharedPVC"}}),
            "spec.cache.prewarm: must be true with strategy SharedPVC",
        ),
        (
            json!({"imagePullSecrets": [{"name": "Bad_Name"}]}),
            "spec.imagePullSecrets[0].name",
        ),
    ];
    // The fraction case needs the pinned runtime to exist in the cluster.
    let have_a10 = runtimes.get_opt("vllm-nvidia-a10").await?.is_some();
    for (spec, message) in cases {
        if message.contains("fraction") && !have_a10 {
            continue;
        }
        let svc: LLMService = serde_json::from_value(llmservice("bad", spec.clone()))?;
        match services.create(&PostParams::default(), &svc).await {
            Err(kube::Error::Api(e)) => {
                assert_eq!(e.code, 422, "{e:?}");
                assert!(e.message.contains("denied the request"), "{}", e.message);
                assert!(e.message.contains(message), "{message:?} in {}", e.message);
            }
            other => bail!("{spec} was not denied: {other:?}"),
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_opted_in_workloads_reach_the_workload_webhooks() -> Result<()> {
    let (ns, hook) = setup("webhook-workloads", Duration::from_secs(3600)).await?;
    let deployments: Api<Deployment> = ns.api();
    let deployment = |name: &str, annotations: Value| -> Deployment {
        serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "annotations": annotations},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1"}]}}}
        }))
        .unwrap()
    };
    // An unrelated Deployment never reaches the webhook (matchConditions).
    deployments
        .create(&PostParams::default(), &deployment("web", json!({})))
        .await?;
    assert_eq!(hook.reviews("Deployment"), 0);

    // One naming a runtime that does not exist is denied with the fix.
    let err = deployments
        .create(
            &PostParams::default(),
            &deployment(
                "qwen",
                json!({"serving.hearth.dev/runtime": "vllm-nowhere"}),
            ),
        )
        .await
        .expect_err("a missing runtime is denied");
    assert!(
        err.to_string().contains("\"vllm-nowhere\" does not exist"),
        "{err}"
    );
    assert!(hook.reviews("Deployment") >= 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_rotation_under_a_request_loop_loses_none() -> Result<()> {
    // A 6 s certificate is renewed every 4 s (two thirds of its life).
    let (ns, hook) = setup("webhook-rotate", Duration::from_secs(6)).await?;
    let api: Api<LLMService> = ns.api();
    let good: LLMService = serde_json::from_value(llmservice("loop", json!({})))?;
    let bad: LLMService = serde_json::from_value(llmservice(
        "loop",
        json!({"scaling": {"metric": "kvCacheUtil"}}),
    ))?;
    let rotations_before = hook.state.metrics.cert_reloads.get();
    let start = Instant::now();
    let mut sent = 0;
    let mut failures = Vec::new();
    // Keep going until at least two rotations happened, bounded.
    while hook.state.metrics.cert_reloads.get() < rotations_before + 2
        && start.elapsed() < Duration::from_secs(60)
    {
        sent += 2;
        if let Err(e) = api.create(&dry_run(), &good).await {
            failures.push(format!("valid: {e}"));
        }
        match api.create(&dry_run(), &bad).await {
            Err(kube::Error::Api(e)) if e.message.contains("spec.scaling.metric") => {}
            other => failures.push(format!("invalid: {other:?}")),
        }
    }
    let rotations = hook.state.metrics.cert_reloads.get() - rotations_before;
    assert!(
        rotations >= 2,
        "only {rotations} rotation(s) in {:?}",
        start.elapsed()
    );
    assert!(
        failures.is_empty(),
        "{} of {sent} requests failed: {failures:#?}",
        failures.len()
    );
    Ok(())
}

/// A ServingPolicy that only this test's namespace sees.
fn scoped_policy(name: &str, ns: &str, spec: Value) -> Result<ServingPolicy> {
    let mut spec = spec;
    spec["matchConstraints"] = json!({
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}}
    });
    Ok(serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "ServingPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }))?)
}

fn label_policy(expression: &str) -> Value {
    json!({"mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression": expression}}]})
}

async fn ready_condition(api: &Api<ServingPolicy>, name: &str) -> Result<Option<(String, String)>> {
    let p = api.get(name).await?;
    Ok(p.status
        .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"))
        .map(|c| (c.status, c.message)))
}

/// Waits (30 s at most, as `what`) until the ServingPolicy `name` reports Ready=False, and
/// returns that condition's status and message.
async fn wait_ready_false(
    api: &Api<ServingPolicy>,
    name: &str,
    what: &str,
) -> Result<(String, String)> {
    wait_until(what, Duration::from_secs(30), || async move {
        Ok(match ready_condition(api, name).await? {
            Some((s, m)) if s == "False" => Observed::Ready((s, m)),
            other => Observed::NotYet(format!("{other:?}")),
        })
    })
    .await
}

/// Makes sure the upstream runtime `vllm-nvidia-a10` exists (it is shared cluster-wide:
/// server-side apply, same content) and is in `hook`'s snapshot, which its watch fills.
async fn ensure_a10_runtime(client: &Client, hook: &Webhook) -> Result<()> {
    let runtimes: Api<InferenceRuntime> = Api::all(client.clone());
    let a10 = upstream("InferenceRuntime")
        .into_iter()
        .find(|r| r["metadata"]["name"] == "vllm-nvidia-a10")
        .context("the upstream examples have no vllm-nvidia-a10")?;
    if runtimes.get_opt("vllm-nvidia-a10").await?.is_none() {
        let rt: InferenceRuntime = serde_json::from_value(a10)?;
        runtimes
            .patch(
                "vllm-nvidia-a10",
                &PatchParams::apply("hearth-webhook-test"),
                &Patch::Apply(&rt),
            )
            .await?;
    }
    let snapshot = hook.state.snapshot.clone();
    wait_until(
        "vllm-nvidia-a10 in the webhook's snapshot",
        Duration::from_secs(30),
        || {
            let found = snapshot.load().runtimes.contains_key("vllm-nvidia-a10");
            async move {
                Ok(if found {
                    Observed::Ready(())
                } else {
                    Observed::NotYet("not yet".to_owned())
                })
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn report_only_policy_warns_the_client_and_reaches_the_audit_log() -> Result<()> {
    let (ns, hook) = setup("webhook-audit", Duration::from_secs(3600)).await?;
    let cluster = Cluster::connect().await?;
    let audit_log = cluster.audit_log();
    ensure!(
        audit_log.is_file(),
        "no audit log at {}: restart the local cluster (tests/cluster/down, tests/cluster/up) so \
         its apiserver writes one",
        audit_log.display()
    );
    let client = ns.client();
    ensure_a10_runtime(&client, &hook).await?;
    let name = format!("{}-cost-center", ns.name());
    let _guard = Cleanup::<ServingPolicy>::new(&client, vec![name.clone()]);
    // Step 2 of a rollout (docs/policies.md): every result reported, nothing enforced.
    let policy = scoped_policy(
        &name,
        ns.name(),
        json!({
            "validations": [{
                "expression": "has(object.metadata.labels) && 'example.com/cost-center' in object.metadata.labels",
                "message": "label example.com/cost-center is required"
            }],
            "validationActions": ["Warn", "Audit"],
            "auditAnnotations": [{"key": "replicas", "valueExpression": "string(object.spec.replicas)"}],
            "mutations": [{"patchType": "ApplyConfiguration", "applyConfiguration": {"expression":
                "Object{metadata: Object.metadata{annotations: {'example.com/reviewed': 'true'}}}"}}],
            "mutationActions": ["Warn", "Audit"]
        }),
    )?;
    Api::<ServingPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await?;
    let deployment = |n: &str| -> Result<Deployment> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": n, "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10"}},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": n}},
                     "template": {"metadata": {"labels": {"app": n}},
                                  "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1"}]}}}
        }))?)
    };
    let would_change = format!(
        "ServingPolicy '{name}' would change the object (report-only, not applied): add /metadata/annotations/example.com~1reviewed"
    );
    let validation = format!(
        "Validation failed for ServingPolicy '{name}': label example.com/cost-center is required"
    );
    // The webhook picks the new policy up from its watch: dry runs until it reports.
    let probe = deployment("probe")?;
    wait_until(
        "the policy's reports on a dry run",
        Duration::from_secs(30),
        || {
            let (client, probe, want) = (client.clone(), probe.clone(), would_change.clone());
            let ns = ns.name().to_owned();
            async move {
                let (_, warnings) = create_with_warnings(&client, &ns, &probe, true).await?;
                Ok(if warnings.iter().any(|w| w.contains(&want)) {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(format!("warnings {warnings:?}"))
                })
            }
        },
    )
    .await?;

    let (stored, warnings) =
        create_with_warnings(&client, ns.name(), &deployment("costly")?, false).await?;
    for want in [&validation, &would_change] {
        ensure!(
            warnings.iter().any(|w| w.contains(want.as_str())),
            "no warning {want:?} in {warnings:?}"
        );
    }
    let annotations = stored.metadata.annotations.unwrap_or_default();
    ensure!(
        !annotations.contains_key("example.com/reviewed"),
        "a report-only mutation was applied: {annotations:?}"
    );

    // The apiserver's audit event of that create carries the webhook's audit annotations, under
    // `<webhook name>/<key>`.
    let event = cluster
        .wait_audit_event("create", ns.name(), "costly", Duration::from_secs(30))
        .await?;
    let recorded = |suffix: &str| audit_annotation(&event, suffix);
    let failure = recorded("/validation_failure")
        .with_context(|| format!("no validation_failure in {}", event["annotations"]))?;
    ensure!(
        failure.contains("label example.com/cost-center is required"),
        "{failure}"
    );
    let report: Value = serde_json::from_str(
        &recorded("/mutation_report")
            .with_context(|| format!("no mutation_report in {}", event["annotations"]))?,
    )?;
    ensure!(
        report[0]["policy"] == name.as_str() && report[0]["applied"] == false,
        "{report}"
    );
    ensure!(
        report[0]["patch"][0]["path"] == "/metadata/annotations/example.com~1reviewed",
        "{report}"
    );
    ensure!(
        recorded(&format!("/{name}.replicas")).as_deref() == Some("0"),
        "no {name}.replicas in {}",
        event["annotations"]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotated_deployment_is_mutated_and_policy_changes_take_effect() -> Result<()> {
    let (ns, hook) = setup("webhook-mutate", Duration::from_secs(3600)).await?;
    let client = ns.client();
    ensure_a10_runtime(&client, &hook).await?;
    let policies: Api<ServingPolicy> = Api::all(client.clone());
    let label_name = format!("{}-vendor-label", ns.name());
    let broken_name = format!("{}-broken", ns.name());
    let _guard =
        Cleanup::<ServingPolicy>::new(&client, vec![label_name.clone(), broken_name.clone()]);

    let deployments: Api<Deployment> = ns.api();
    let manifest: Deployment = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "qwen", "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10"}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "qwen"}},
                 "template": {"metadata": {"labels": {"app": "qwen"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1",
                                                       "args": ["Qwen/Qwen2.5-7B-Instruct"]}]}}}
    }))?;

    // A ServingPolicy created now takes effect without a restart.
    let created = Instant::now();
    policies
        .create(
            &PostParams::default(),
            &scoped_policy(
                &label_name,
                ns.name(),
                label_policy("Object{metadata: Object.metadata{labels: {'platform.example.com/vendor': params.spec.vendor}}}"),
            )?,
        )
        .await?;
    // Poll tightly (not wait_until's 250 ms) so the printed latency means something.
    let effective = loop {
        let out = deployments.create(&dry_run(), &manifest).await?;
        let labels = out.metadata.labels.unwrap_or_default();
        if labels
            .get("platform.example.com/vendor")
            .map(String::as_str)
            == Some("nvidia")
        {
            break created.elapsed();
        }
        if created.elapsed() > Duration::from_secs(30) {
            bail!("the new ServingPolicy had no effect within 30 s; labels {labels:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!("new ServingPolicy effective after {effective:?} (create to first mutated review)");

    // The stored object carries the built-ins' and the platform policy's mutations; applying
    // the same manifest again changes nothing.
    let pp = PatchParams::apply("hearth-webhook-test");
    let first = deployments
        .patch("qwen", &pp, &Patch::Apply(&manifest))
        .await?;
    assert_eq!(
        first
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("platform.example.com/vendor"))
            .map(String::as_str),
        Some("nvidia")
    );
    let pod = first.spec.as_ref().unwrap().template.spec.as_ref().unwrap();
    let c = &pod.containers[0];
    let limits = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .unwrap();
    assert_eq!(
        limits.get("nvidia.com/gpu").map(|q| q.0.as_str()),
        Some("1")
    );
    assert!(c.startup_probe.is_some() && c.readiness_probe.is_some() && c.liveness_probe.is_some());
    assert!(
        c.lifecycle
            .as_ref()
            .and_then(|l| l.pre_stop.as_ref())
            .is_some()
    );
    assert!(pod.termination_grace_period_seconds.unwrap_or_default() >= 120);
    assert_eq!(
        pod.node_selector
            .as_ref()
            .and_then(|n| n.get("nvidia.com/gpu.product"))
            .map(String::as_str),
        Some("NVIDIA-A10")
    );
    // The deployment controller writes status and its revision annotation meanwhile, so compare
    // what the user and the webhook own: generation (bumped by any spec change), spec, labels,
    // annotations.
    let before = deployments.get("qwen").await?;
    let again = deployments
        .patch("qwen", &pp, &Patch::Apply(&manifest))
        .await?;
    assert_eq!(
        again.metadata.generation, before.metadata.generation,
        "re-apply changed the spec"
    );
    assert_eq!(again.spec, before.spec);
    assert_eq!(again.metadata.labels, before.metadata.labels);
    let ours = |d: &Deployment| {
        d.metadata
            .annotations
            .clone()
            .unwrap_or_default()
            .into_iter()
            .filter(|(k, _)| !k.starts_with("deployment.kubernetes.io/"))
            .collect::<BTreeMap<_, _>>()
    };
    assert_eq!(ours(&again), ours(&before));
    assert!(hook.reviews("Deployment") >= 2);

    // A policy that does not compile is reported on its status and does not disturb the rest.
    policies
        .create(
            &PostParams::default(),
            &scoped_policy(&broken_name, ns.name(), label_policy("Object{metadata: "))?,
        )
        .await?;
    let (status, message) =
        wait_ready_false(&policies, &broken_name, "Ready=False on the broken policy").await?;
    assert_eq!(status, "False");
    assert!(
        message.contains("spec.mutations[0].applyConfiguration.expression"),
        "{message}"
    );
    // The status may come from another test's webhook watching the same policy first; this
    // one's metrics follow its own watch.
    let label = format!("policy=\"{broken_name}\"");
    wait_until(
        "the broken policy in this webhook's metrics",
        Duration::from_secs(30),
        || async {
            let text = hook.state.metrics.encode();
            Ok(if text.contains(&label) {
                Observed::Ready(())
            } else {
                Observed::NotYet("no series for it yet".to_owned())
            })
        },
    )
    .await?;
    assert_eq!(
        ready_condition(&policies, &label_name)
            .await?
            .map(|c| c.0)
            .as_deref(),
        Some("True")
    );

    // Breaking the good policy keeps its last good version serving.
    let mut edited = policies.get(&label_name).await?;
    edited.spec.mutations[0]
        .apply_configuration
        .as_mut()
        .unwrap()
        .expression = "Object{".to_owned();
    policies
        .replace(&label_name, &PostParams::default(), &edited)
        .await?;
    wait_ready_false(&policies, &label_name, "Ready=False on the edited policy").await?;
    let out = deployments.create(&dry_run(), &serde_json::from_value::<Deployment>(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "qwen-2", "annotations": {"serving.hearth.dev/runtime": "vllm-nvidia-a10"}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "q2"}},
                 "template": {"metadata": {"labels": {"app": "q2"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1"}]}}}
    }))?).await?;
    assert_eq!(
        out.metadata
            .labels
            .unwrap_or_default()
            .get("platform.example.com/vendor")
            .map(String::as_str),
        Some("nvidia"),
        "the last good version of the edited policy still applies"
    );
    Ok(())
}

/// LLMAdapters reviewed by the real apiserver through this webhook, against what its
/// reflectors see: a runtime serving adapters (rank at most 16, at most 2 adapters) and a base
/// on it. An adapter within the limits is stored; one above the rank, one taking the base's
/// name, and a third adapter are denied naming the field; one whose base does not exist yet
/// is stored with a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn llmadapters_are_checked_against_their_base_and_its_runtime() -> Result<()> {
    let (ns, _hook) = setup("webhook-lora", Duration::from_secs(3600)).await?;
    let rt_name = format!("{}-lora", ns.name());
    let runtimes: Api<InferenceRuntime> = Api::all(ns.client());
    let rt: InferenceRuntime = serde_json::from_value(json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "InferenceRuntime",
        "metadata": {"name": rt_name, "labels": {SCOPE_LABEL: ns.name()}},
        "spec": {
            "vendor": "nvidia",
            "container": {"image": "vllm/vllm-openai:v0.25.1", "args": ["{{ .Model.Path }}"]},
            "accelerator": {"resourceName": "nvidia.com/gpu"},
            "adapters": {"maxRank": 16, "maxAdapters": 2},
        }
    }))?;
    runtimes.create(&PostParams::default(), &rt).await?;
    let result = async {
        let services: Api<LLMService> = ns.api();
        let base: LLMService =
            serde_json::from_value(llmservice("qwen", json!({"runtime": {"name": rt_name}})))?;
        services.create(&PostParams::default(), &base).await?;
        let adapters: Api<hearth_crds::LLMAdapter> = ns.api();
        let adapter = |name: &str, spec: Value| -> Result<hearth_crds::LLMAdapter> {
            let mut a = json!({
                "apiVersion": "serving.hearth.dev/v1alpha1",
                "kind": "LLMAdapter",
                "metadata": {"name": name},
                "spec": {"serviceRef": {"name": "qwen"}, "source": {"uri": "pvc://lora/qwen/sql"}},
            });
            hearth_test_support::merge_json(&mut a["spec"], spec);
            Ok(serde_json::from_value(a)?)
        };
        // The reflectors see the base (and later the first adapter) shortly after they exist.
        wait_until(
            "the webhook to see the base",
            Duration::from_secs(30),
            || {
                let adapters = adapters.clone();
                async move {
                    let a = adapter("probe", json!({"rank": 32}))?;
                    Ok(match adapters.create(&dry_run(), &a).await {
                        Err(kube::Error::Api(e)) if e.message.contains("spec.rank") => {
                            Observed::Ready(())
                        }
                        other => Observed::NotYet(format!("{other:?}")),
                    })
                }
            },
        )
        .await?;
        adapters
            .create(
                &PostParams::default(),
                &adapter("sql", json!({"rank": 16}))?,
            )
            .await
            .context("an adapter within the runtime's limits")?;
        let denied = |a: hearth_crds::LLMAdapter, want: &'static str| {
            let adapters = adapters.clone();
            async move {
                match adapters.create(&PostParams::default(), &a).await {
                    Err(kube::Error::Api(e)) => {
                        ensure!(e.code == 422, "{e:?}");
                        ensure!(e.message.contains(want), "{want:?} in {}", e.message);
                        Ok(())
                    }
                    other => bail!("{:?} was not denied: {other:?}", a.metadata.name),
                }
            }
        };
        denied(
            adapter("big", json!({"rank": 64}))?,
            "spec.rank: 64 is above 16",
        )
        .await?;
        denied(
            adapter("qwen", json!({}))?,
            "metadata.name: the model name \"qwen\" is taken by LLMService",
        )
        .await?;
        // `sql` counted once the reflector has it: a second is allowed, a third is not.
        adapters
            .create(&PostParams::default(), &adapter("chat", json!({}))?)
            .await
            .context("a second adapter")?;
        wait_until("the third adapter denied", Duration::from_secs(30), || {
            let adapters = adapters.clone();
            let a = adapter("third", json!({}));
            async move {
                Ok(match adapters.create(&dry_run(), &a?).await {
                    Err(kube::Error::Api(e)) if e.message.contains("maxAdapters: 2") => {
                        Observed::Ready(())
                    }
                    other => Observed::NotYet(format!("{other:?}")),
                })
            }
        })
        .await?;
        // A base that does not exist yet: stored, with a warning (the controller says
        // ServiceNotFound until it exists).
        let mut later = adapter("later", json!({}))?;
        later.spec.service_ref.name = "later".into();
        adapters
            .create(&PostParams::default(), &later)
            .await
            .context("an adapter whose base does not exist yet")?;
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let _ = runtimes.delete(&rt_name, &DeleteParams::default()).await;
    result
}

/// An annotated Deployment naming `runtime`, which the built-in policies mutate.
fn deployment_naming(runtime: &str) -> Result<Deployment> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "qwen", "annotations": {"serving.hearth.dev/runtime": runtime}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "qwen"}},
                 "template": {"metadata": {"labels": {"app": "qwen"}},
                              "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.25.1"}]}}}
    }))?)
}

/// A runtime created just before the workload that names it is resolved, though the webhook's
/// snapshot (a watch, rebuilt after a debounce) has not caught up: the review reads it from the
/// apiserver. Without that read the workload was denied ("does not exist; available: [...]")
/// at random, as `kubectl apply -f runtime.yaml -f deployment.yaml` sends them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runtime_created_just_before_its_workload_is_read_from_the_apiserver() -> Result<()> {
    let (ns, hook) = setup("webhook-readthrough", Duration::from_secs(3600)).await?;
    let client = ns.client();
    let runtimes: Api<InferenceRuntime> = Api::all(client.clone());
    let deployments: Api<Deployment> = ns.api();
    let a10 = upstream("InferenceRuntime")
        .into_iter()
        .find(|r| r["metadata"]["name"] == "vllm-nvidia-a10")
        .context("the upstream examples have no vllm-nvidia-a10")?;
    let names: Vec<String> = (0..5).map(|i| format!("{}-rt-{i}", ns.name())).collect();
    let _guard = Cleanup::<InferenceRuntime>::new(&client, names.clone());
    let reviews_before = hook.reviews("Deployment");
    for name in &names {
        let mut rt = a10.clone();
        rt["metadata"] = json!({"name": name, "labels": {SCOPE_LABEL: ns.name()}});
        // A vendor of its own: no other suite's vendor selection sees these runtimes.
        rt["spec"]["vendor"] = json!("readthrough-test");
        runtimes
            .create(&PostParams::default(), &serde_json::from_value(rt)?)
            .await?;
        // At once, as kubectl sends the next object of a file.
        let out = deployments
            .create(&dry_run(), &deployment_naming(name)?)
            .await
            .with_context(|| {
                format!(
                    "a Deployment naming {name}, created just after it (reads: found {}, not_found {}, busy {}, error {}, timeout {})",
                    hook.runtime_reads("found"),
                    hook.runtime_reads("not_found"),
                    hook.runtime_reads("busy"),
                    hook.runtime_reads("error"),
                    hook.runtime_reads("timeout")
                )
            })?;
        let limits = out
            .spec
            .as_ref()
            .and_then(|s| s.template.spec.as_ref())
            .and_then(|p| p.containers[0].resources.as_ref())
            .and_then(|r| r.limits.clone())
            .unwrap_or_default();
        ensure!(
            limits.contains_key("nvidia.com/gpu"),
            "the Deployment naming {name} was not mutated with the runtime's accelerator: limits {limits:?}"
        );
    }
    ensure!(
        hook.reviews("Deployment") >= reviews_before + names.len() as u64,
        "the reviews did not reach this webhook"
    );
    // The watch may have caught up with some of them, not with all (it waits 100 ms).
    let found = hook.runtime_reads("found");
    ensure!(found >= 1, "no runtime was read from the apiserver");
    eprintln!(
        "{found} reviews (of the {} Deployments' on /mutate and /validate) read their runtime from the apiserver",
        names.len()
    );

    // A runtime that does not exist is still refused, naming the annotation: twice in a row.
    let missing = format!("{}-absent", ns.name());
    for _ in 0..2 {
        match deployments
            .create(&dry_run(), &deployment_naming(&missing)?)
            .await
        {
            Err(kube::Error::Api(e)) => ensure!(
                e.code == 422
                    && e.message.contains("serving.hearth.dev/runtime")
                    && e.message
                        .contains(&format!("InferenceRuntime {missing:?} does not exist")),
                "unexpected refusal: {e:?}"
            ),
            other => bail!("a Deployment naming an absent runtime was not refused: {other:?}"),
        }
    }
    // One review each (the mutating webhook refuses; nothing is validated): the second, if it
    // comes within a second of the first's read, answered from the remembered miss (a busy
    // machine may take longer; the cache has unit tests).
    ensure!(
        hook.runtime_reads("not_found") >= 1
            && hook.runtime_reads("not_found") + hook.runtime_reads("cached_miss") >= 2,
        "reads of an absent runtime: not_found {}, cached_miss {}",
        hook.runtime_reads("not_found"),
        hook.runtime_reads("cached_miss")
    );
    Ok(())
}

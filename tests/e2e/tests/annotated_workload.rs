//! An annotated plain Deployment (no LLMService), admitted through the chart-installed
//! `hearth-webhook`: the built-in ServingPolicies resolve the upstream stub runtime and inject
//! its accelerator request (`hearth.dev/fake-gpu`), probes and the `hearth-drain` native sidecar
//! with its preStop hook. The pod then runs for real on the real node: the kubelet allocates a
//! fake GPU from the node's device plugin, starts the sidecar before the model container, and on
//! deletion the preStop drain ends as soon as the idle engine lets it. Uses 1 of the node's 4
//! `hearth.dev/fake-gpu`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::stack;
use hearth_test_support::{Cluster, Observed, describe_pods, pod_ready, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn annotated_deployment_is_mutated_and_runs_with_its_fake_gpu_and_drain_sidecar() -> Result<()>
{
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    stack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    stack::install_stub_runtime(&client).await?;
    let ns = cluster.namespace("e2e-annotated").await?;
    let deploy: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "plain-llm", "annotations": {"serving.hearth.dev/runtime": "vllm-stub"}},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"app": "plain-llm"}},
            "template": {
                "metadata": {"labels": {"app": "plain-llm"}},
                "spec": {"containers": [{
                    "name": "vllm",
                    "image": "hearth.dev/vllm-stub:e2e",
                    "args": ["--model=/models/stub", "--served-model-name=plain-llm"],
                    "ports": [{"name": "http", "containerPort": 8000}],
                }]},
            },
        },
    }))?;
    let api: Api<Deployment> = ns.api();
    let created = api.create(&PostParams::default(), &deploy).await?;
    let pod_spec = created
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("no pod spec")?;
    let c = &pod_spec.containers[0];
    let gpus = c
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref())
        .and_then(|l| l.get("hearth.dev/fake-gpu"))
        .map(|q| q.0.clone());
    ensure!(
        gpus.as_deref() == Some("1"),
        "not mutated: hearth.dev/fake-gpu limit {gpus:?} (container {c:?})"
    );
    let sidecar = pod_spec
        .init_containers
        .iter()
        .flatten()
        .find(|c| c.name == "hearth-drain")
        .context("no hearth-drain sidecar")?;
    ensure!(
        sidecar.restart_policy.as_deref() == Some("Always"),
        "hearth-drain is not a native sidecar: {sidecar:?}"
    );
    let hook = c
        .lifecycle
        .as_ref()
        .and_then(|l| l.pre_stop.as_ref())
        .and_then(|p| p.http_get.as_ref());
    ensure!(
        hook.is_some_and(|h| h.path.as_deref() == Some("/drain")),
        "preStop is not the drain sidecar's GET /drain: {:?}",
        c.lifecycle
    );

    // The pod runs on the real node: scheduled against the device plugin's capacity, the
    // sidecar started first, the model container Ready through the injected probe.
    let pods = ns
        .wait_for_pods(
            "the annotated Deployment's pod Ready",
            "app=plain-llm",
            Duration::from_secs(120),
            |p| p.len() == 1 && pod_ready(&p[0]),
        )
        .await?;
    let pod = &pods[0];
    let node = pod
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .unwrap_or_default();
    let real = hearth_test_support::RealNode::load()?;
    ensure!(
        node == real.name,
        "the pod runs on {node}, not the real node {}",
        real.name
    );
    let status = pod.status.as_ref().context("no pod status")?;
    let drain = status
        .init_container_statuses
        .iter()
        .flatten()
        .find(|s| s.name == "hearth-drain")
        .context("no status of hearth-drain")?;
    ensure!(
        drain.started == Some(true) && drain.state.as_ref().is_some_and(|s| s.running.is_some()),
        "hearth-drain is not running: {drain:?}"
    );
    println!("annotated Deployment: {}", describe_pods(&pods));

    // Deleting it: the preStop drain returns once the idle engine has settled, so the pod goes
    // well before terminationGracePeriodSeconds (30 s).
    let name = pod.metadata.name.clone().context("pod name")?;
    let start = Instant::now();
    ns.api::<Pod>()
        .delete(&name, &DeleteParams::default())
        .await?;
    let pods: Api<Pod> = ns.api();
    wait_until(
        format!("pod {name} gone"),
        Duration::from_secs(40),
        || async {
            Ok(match pods.get_opt(&name).await? {
                None => Observed::Ready(()),
                Some(p) => Observed::NotYet(describe_pods(&[p])),
            })
        },
    )
    .await?;
    let took = start.elapsed();
    ensure!(
        took < Duration::from_secs(20),
        "the idle pod took {took:?} to go: was the preStop a fixed wait?"
    );
    let left = ns.api::<Pod>().list(&ListParams::default()).await?.items;
    println!(
        "idle annotated pod gone {:.1}s after its deletion; pods now: {}",
        took.as_secs_f64(),
        describe_pods(&left)
    );
    Ok(())
}

/// A policy rolled out where annotated Deployments already run (docs/policies.md, "Rolling out a
/// policy" and "Reports on what already runs"), against the chart-installed webhook and
/// controller: added in warn-and-audit mode, the controller scans the running Deployment and
/// writes its PolicyReport; a new Deployment is admitted with the admission warning and the
/// audit annotation; switched to deny, the policy is scanned again and both reports say `fail`.
/// No pod runs (replicas 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_rolled_out_reports_on_running_deployments_then_warns_and_audits_new_ones()
-> Result<()> {
    use hearth_crds::ServingPolicy;
    use hearth_test_support::{audit_annotation, create_with_warnings};
    use kube::ResourceExt;
    use kube::api::{DynamicObject, Patch, PatchParams};

    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    stack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    stack::install_stub_runtime(&client).await?;
    hearth_test_support::install_policy_report_crd(&client).await?;
    let ns = cluster.namespace("e2e-rollout").await?;
    let deployment = |name: &str| -> Result<Deployment> {
        Ok(serde_json::from_value(json!({
            "metadata": {"name": name, "annotations": {"serving.hearth.dev/runtime": "vllm-stub"}},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"containers": [{"name": "vllm", "image": "hearth.dev/vllm-stub:e2e"}]}}},
        }))?)
    };
    let deployments: Api<Deployment> = ns.api();
    deployments
        .create(&PostParams::default(), &deployment("running")?)
        .await?;

    let policies: Api<ServingPolicy> = Api::all(client.clone());
    let name = format!("{}-team", ns.name());
    let message = "every workload names its team (label team)";
    let policy = |actions: serde_json::Value| -> Result<ServingPolicy> {
        Ok(serde_json::from_value(json!({
            "apiVersion": "serving.hearth.dev/v1alpha1", "kind": "ServingPolicy",
            "metadata": {"name": name},
            "spec": {
                "matchConditions": [{"name": "this-test-only",
                    "expression": format!("object.metadata.namespace == {:?}", ns.name())}],
                "validations": [{"expression": "has(object.metadata.labels) && 'team' in object.metadata.labels",
                                 "message": message}],
                "validationActions": actions,
            },
        }))?)
    };
    let apply = |p: ServingPolicy| {
        let policies = policies.clone();
        let name = name.clone();
        async move {
            policies
                .patch(
                    &name,
                    &PatchParams::apply("hearth-e2e").force(),
                    &Patch::Apply(&p),
                )
                .await
        }
    };
    let reports = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        ns.name(),
        &hearth_controller::scan::report_resource(),
    );
    // The result of this policy in the report of Deployment `workload`, once it is `want`.
    let report_says = |workload: &'static str, want: &'static str| {
        let (deployments, reports, name) = (deployments.clone(), reports.clone(), name.clone());
        async move {
            let uid = deployments.get(workload).await?.uid().context("uid")?;
            let report = hearth_controller::scan::report_name(&uid);
            wait_until(
                format!("{report} ({workload}) saying {want}"),
                Duration::from_secs(60),
                || async {
                    let got = reports.get_opt(&report).await?.and_then(|r| {
                        r.data["results"]
                            .as_array()?
                            .iter()
                            .find(|x| x["policy"] == name.as_str())
                            .cloned()
                    });
                    Ok(match got {
                        Some(r) if r["result"] == want => Observed::Ready(r),
                        other => Observed::NotYet(format!("{other:?}")),
                    })
                },
            )
            .await
        }
    };

    let result = async {
        // Added in warn-and-audit mode: the Deployment that already runs is scanned.
        let added = std::time::Instant::now();
        apply(policy(json!(["Warn", "Audit"]))?).await?;
        let r = report_says("running", "warn").await?;
        ensure!(r["message"] == message && r["rule"] == "validations", "{r}");
        let reported = added.elapsed();
        scan_says(&policies, &name, |s| s.resources == 1 && s.warn == 1).await?;

        // A new Deployment is admitted with the warning, and the audit event records it.
        let warning = format!("Validation failed for ServingPolicy '{name}': {message}");
        let (_, warnings) = wait_until(
            "the webhook warning about the new policy",
            Duration::from_secs(30),
            || {
                let (client, ns, warning) = (client.clone(), ns.name().to_owned(), warning.clone());
                async move {
                    let got =
                        create_with_warnings(&client, &ns, &deployment("probe")?, true).await?;
                    Ok(if got.1.iter().any(|w| w.contains(&warning)) {
                        Observed::Ready(got)
                    } else {
                        Observed::NotYet(format!("warnings {:?}", got.1))
                    })
                }
            },
        )
        .await?;
        let (stored, warnings_on_create) =
            create_with_warnings(&client, ns.name(), &deployment("new")?, false).await?;
        ensure!(
            warnings_on_create.iter().any(|w| w.contains(&warning)),
            "no warning on create: {warnings_on_create:?} (dry run: {warnings:?})"
        );
        ensure!(stored.metadata.uid.is_some(), "not stored");
        let event = cluster
            .wait_audit_event("create", ns.name(), "new", Duration::from_secs(30))
            .await?;
        let failure = audit_annotation(&event, "/validation_failure")
            .with_context(|| format!("no validation_failure in {}", event["annotations"]))?;
        ensure!(
            failure.contains(message) && failure.contains(&name),
            "{failure}"
        );

        // Enforced: the change is scanned again, both reports say fail.
        apply(policy(json!(["Deny"]))?).await?;
        report_says("running", "fail").await?;
        report_says("new", "fail").await?;
        let scan = scan_says(&policies, &name, |s| s.resources == 2 && s.fail == 2).await?;
        println!(
            "rollout: report on the running Deployment {:.1}s after the policy was added; \
             enforced: status.scan {scan:?}",
            reported.as_secs_f64()
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    let _ = policies
        .delete(&name, &kube::api::DeleteParams::default())
        .await;
    result
}

/// The `status.scan` of ServingPolicy `name` once it describes the policy's generation and
/// `done` holds.
async fn scan_says(
    policies: &Api<hearth_crds::ServingPolicy>,
    name: &str,
    done: impl Fn(&hearth_crds::servingpolicy::ScanStatus) -> bool,
) -> Result<hearth_crds::servingpolicy::ScanStatus> {
    wait_until(
        format!("status.scan of {name}"),
        Duration::from_secs(60),
        || async {
            let p = policies.get(name).await?;
            Ok(match p.status.and_then(|s| s.scan) {
                Some(s) if s.observed_generation == p.metadata.generation && done(&s) => {
                    Observed::Ready(s)
                }
                other => Observed::NotYet(format!("{other:?}")),
            })
        },
    )
    .await
}

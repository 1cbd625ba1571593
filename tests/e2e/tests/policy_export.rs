//! ServingPolicies exported to the apiserver (`hearth_policies::export`, what the controller's
//! export mode applies) against the same policies evaluated by the chart-installed webhook, on
//! the real apiserver with MutatingAdmissionPolicy `v1beta1` enabled (tests/cluster/up).
//!
//! For each policy test suite (`hearth-test.yaml`: the built-ins' and the examples'), its
//! runtimes and platform policies are applied, and every CREATE case's resource is created as a
//! server dry run twice: through the webhook alone, then with every policy that exports applied
//! as ValidatingAdmissionPolicy / MutatingAdmissionPolicy (the webhook then skips them: their
//! Ready condition turns to reason Exported). The answers must agree: the same admitted object
//! (server-set metadata aside) and warnings, or a denial with the same status code whose reason
//! (policy and message) the webhook gave too. A webhook outage (the webhook scaled to zero and
//! its configurations removed) leaves the exported policies enforcing; removing the exported
//! objects brings the webhook back to evaluating them.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_crds::admission_apis::discover;
use hearth_crds::{InferenceRuntime, ServingPolicy};
use hearth_e2e_harness::stack;
use hearth_policies::export::{self, Kind, Target};
use hearth_policies::manifest::{self, Bundle};
use hearth_policies::testfile::TestFile;
use hearth_test_support::{Cluster, CreateAnswer, Observed, create_answer, wait_until};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::{Value, json};

const MANAGER: &str = "e2e-policy-export";

/// The suites compared, relative to the workspace.
const SUITES: &[&str] = &[
    "policies/builtin/tests",
    "policies/builtin/tests/ascend-host-driver",
    "examples/ascend",
    "examples/cambricon",
    "examples/hami",
    "examples/runtimes",
    "examples/policy-rollout/enforce",
];

/// What one arm answered, compared across arms.
#[derive(Debug, Clone, PartialEq)]
enum Verdict {
    Admitted {
        object: Value,
        warnings: BTreeSet<String>,
    },
    Denied {
        code: u16,
        /// (policy, message) of each reason the answer gives.
        reasons: Vec<(String, String)>,
        message: String,
    },
}

/// `name: message` of a policy's warning, whoever evaluated it; other warnings as sent.
fn warning(w: &str) -> String {
    // `299 - "text"` as the apiserver sends it.
    let text = w
        .strip_prefix("299 - \"")
        .and_then(|t| t.strip_suffix('"'))
        .unwrap_or(w)
        .replace("\\\"", "\"");
    for prefix in [
        "Validation failed for ServingPolicy '",
        "Validation failed for ValidatingAdmissionPolicy '",
    ] {
        if let Some(rest) = text.strip_prefix(prefix)
            && let Some((name, tail)) = rest.split_once('\'')
            && let Some((_, message)) = tail.split_once(": ")
        {
            return format!("{name}: {message}");
        }
    }
    text
}

/// The (policy, message) reasons of a refusal: the webhook's `ServingPolicy 'p' denied the
/// request: m` (several, `; `-separated) or the apiserver's `ValidatingAdmissionPolicy 'p' with
/// binding 'b' denied request: m`; an evaluation error counts as the message `evaluation error`.
fn reasons(message: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (marker, denied) in [
        ("ServingPolicy '", "' denied the request: "),
        ("ValidatingAdmissionPolicy '", "' denied request: "),
        ("MutatingAdmissionPolicy '", "' denied request: "),
    ] {
        for (i, _) in message.match_indices(marker) {
            let rest = &message[i + marker.len()..];
            let Some((name, tail)) = rest.split_once('\'') else {
                continue;
            };
            let text = if let Some(at) = tail.find(denied.trim_start_matches('\'')) {
                let m = &tail[at + denied.len() - 1..];
                let end = m.find("; ServingPolicy '").unwrap_or(m.len());
                m[..end].to_owned()
            } else if tail.contains("failed to evaluate") || tail.contains("resulted in error") {
                "evaluation error".to_owned()
            } else {
                continue;
            };
            out.push((name.to_owned(), text));
        }
    }
    out
}

/// The pod spec of a Pod, Deployment or StatefulSet.
fn pod_spec(object: &mut Value) -> Option<&mut Value> {
    if object["kind"] == "Pod" {
        object.get_mut("spec")
    } else {
        object.get_mut("spec")?.get_mut("template")?.get_mut("spec")
    }
}

/// What carries no meaning in an admitted object: the service account token volume's random
/// suffix, and the order of `volumes` and `volumeMounts` (referred to by name and path; an
/// exported policy's mutations run before the webhook's, so what they append comes first).
fn normalize(object: &mut Value) {
    if let Some(spec) = pod_spec(object) {
        if let Some(v) = spec.get_mut("volumes").and_then(Value::as_array_mut) {
            v.sort_by_key(|x| x["name"].to_string());
        }
        for list in ["containers", "initContainers"] {
            for c in spec
                .get_mut(list)
                .and_then(Value::as_array_mut)
                .into_iter()
                .flatten()
            {
                if let Some(m) = c.get_mut("volumeMounts").and_then(Value::as_array_mut) {
                    m.sort_by_key(|x| x["mountPath"].to_string());
                }
            }
        }
    }
    let text = object.to_string();
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("kube-api-access-") {
        let end = at + "kube-api-access-".len();
        out.push_str(&rest[..end]);
        out.push('*');
        rest = rest[end..].trim_start_matches(|c: char| c.is_ascii_alphanumeric());
    }
    out.push_str(rest);
    *object = serde_json::from_str(&out).unwrap_or_default();
}

fn verdict(answer: &CreateAnswer) -> Verdict {
    if (200..300).contains(&answer.code) {
        let mut object = answer.body.clone();
        normalize(&mut object);
        if let Some(m) = object["metadata"].as_object_mut() {
            for k in [
                "uid",
                "creationTimestamp",
                "resourceVersion",
                "generation",
                "managedFields",
            ] {
                m.remove(k);
            }
        }
        Verdict::Admitted {
            object,
            warnings: answer.warnings.iter().map(|w| warning(w)).collect(),
        }
    } else {
        let message = answer.body["message"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        Verdict::Denied {
            code: answer.code,
            reasons: reasons(&message),
            message,
        }
    }
}

/// How the exported arm's answer compares with the webhook's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Agreement {
    /// The same object and warnings, or the same denial.
    Same,
    /// Both denied, every reason the exported arm gave the webhook gave too, but fewer: the
    /// apiserver stops at the first admission step that denies (a mutating webhook's denial
    /// ends the request before the ValidatingAdmissionPolicies run), so the status code follows
    /// the first reason given.
    FewerReasons,
    /// Anything else.
    Differs,
}

fn agree(webhook: &Verdict, exported: &Verdict) -> Agreement {
    match (webhook, exported) {
        (Verdict::Admitted { .. }, Verdict::Admitted { .. }) if webhook == exported => {
            Agreement::Same
        }
        (
            Verdict::Denied {
                code: a,
                reasons: ra,
                message: ma,
            },
            Verdict::Denied {
                code: b,
                reasons: rb,
                message: mb,
            },
        ) => {
            let same_reasons = {
                let (x, y): (BTreeSet<_>, BTreeSet<_>) = (ra.iter().collect(), rb.iter().collect());
                x == y
            };
            if a == b && (ma == mb || same_reasons) {
                Agreement::Same
            } else if !rb.is_empty() && rb.len() < ra.len() && rb.iter().all(|r| ra.contains(r)) {
                Agreement::FewerReasons
            } else {
                Agreement::Differs
            }
        }
        _ => Agreement::Differs,
    }
}

struct Case {
    name: String,
    object: Value,
}

struct Suite {
    dir: PathBuf,
    runtimes: Vec<InferenceRuntime>,
    policies: Vec<ServingPolicy>,
    cases: Vec<Case>,
}

fn read_one(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("{}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("{}", path.display()))
}

/// A suite's runtimes, platform policies (not the built-ins: the webhook has those) and the
/// CREATE cases admission can reproduce (no LLMService, settings, old object or user of its
/// own; the resource's namespace dropped).
fn load(dir: &Path, builtins: &BTreeSet<String>) -> Result<Suite> {
    let file = dir.join("hearth-test.yaml");
    let tf: TestFile = serde_yaml::from_str(&std::fs::read_to_string(&file)?)
        .with_context(|| format!("{}", file.display()))?;
    let mut bundle = Bundle::default();
    for p in tf.policies.iter().chain(&tf.manifests) {
        manifest::read_path(&dir.join(p), &mut bundle)?;
    }
    let mut seen = BTreeSet::new();
    bundle
        .runtimes
        .retain(|r| seen.insert(r.metadata.name.clone()));
    let policies = bundle
        .policies
        .into_iter()
        .filter(|p| !builtins.contains(&p.name_any()))
        .collect();
    let mut cases = Vec::new();
    for c in &tf.cases {
        // A case's `settings` are the installation's here (both arms see the same); its
        // `runtime` is the pin annotation an object would carry.
        let plain = c
            .operation
            .is_none_or(|o| o == hearth_crds::servingpolicy::Operation::Create)
            && c.old_resource.is_none()
            && c.service.is_none()
            && c.user_info.is_none()
            && c.namespace_object.is_none()
            && c.expect.resolve_error.is_none();
        if !plain {
            continue;
        }
        let mut object = read_one(&dir.join(&c.resource))?;
        if let Some(m) = object["metadata"].as_object_mut() {
            m.remove("namespace");
        }
        if let Some(rt) = &c.runtime
            && hearth_policies::Selection::from_object(&object).is_none()
        {
            object["metadata"]["annotations"]["serving.hearth.dev/runtime"] = json!(rt);
        }
        cases.push(Case {
            name: c.name.clone(),
            object,
        });
    }
    Ok(Suite {
        dir: dir.to_owned(),
        runtimes: bundle.runtimes,
        policies,
        cases,
    })
}

/// The upstream InferenceRuntimes (`../shared/examples/upstream/`, unchanged) as `params`:
/// a Deployment pinned to each, and one selecting by each vendor.
fn upstream() -> Result<Suite> {
    let mut runtimes = Vec::new();
    for f in [
        "stub-inferenceruntime.yaml",
        "nvidia-a10-inferenceruntime.yaml",
        "ascend-910b3-inferenceruntime.yaml",
    ] {
        let rt: InferenceRuntime = serde_yaml::from_value(serde_yaml::to_value(read_one(
            &hearth_test_support::upstream_file(f),
        )?)?)?;
        runtimes.push(rt);
    }
    let deployment = |name: &str, key: &str, value: &str| {
        json!({
            "apiVersion": "apps/v1", "kind": "Deployment",
            "metadata": {"name": name, "annotations": {key: value}},
            "spec": {
                "selector": {"matchLabels": {"app": name}},
                "template": {
                    "metadata": {"labels": {"app": name}},
                    "spec": {"containers": [{
                        "name": "vllm", "image": "vllm/vllm-openai:v0.25.1",
                        "ports": [{"name": "http", "containerPort": 8000}],
                    }]},
                },
            },
        })
    };
    let mut cases = Vec::new();
    for r in &runtimes {
        let name = r.name_any();
        cases.push(Case {
            name: format!("pinned-{name}"),
            object: deployment(
                &format!("pinned-{name}"),
                "serving.hearth.dev/runtime",
                &name,
            ),
        });
        let vendor = &r.spec.vendor;
        cases.push(Case {
            name: format!("vendor-{vendor}"),
            object: deployment(
                &format!("vendor-{vendor}"),
                "serving.hearth.dev/vendor",
                vendor,
            ),
        });
    }
    Ok(Suite {
        dir: hearth_test_support::upstream_file("README.md"),
        runtimes,
        policies: Vec::new(),
        cases,
    })
}

async fn apply<K>(api: &Api<K>, object: &K) -> Result<K>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut o = serde_json::to_value(object)?;
    if let Some(m) = o["metadata"].as_object_mut() {
        for k in [
            "uid",
            "resourceVersion",
            "creationTimestamp",
            "managedFields",
            "generation",
        ] {
            m.remove(k);
        }
    }
    o.as_object_mut().map(|m| m.remove("status"));
    let name = o["metadata"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    Ok(api
        .patch(
            &name,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&o),
        )
        .await?)
}

/// The Ready condition reason the webhook wrote for the current generation of `name`.
async fn ready_reason(client: &Client, name: &str) -> Result<Option<String>> {
    let p = Api::<ServingPolicy>::all(client.clone()).get(name).await?;
    let generation = p.metadata.generation;
    Ok(p.status.and_then(|s| {
        s.conditions
            .into_iter()
            .find(|c| c.type_ == "Ready" && c.observed_generation == generation)
            .map(|c| c.reason)
    }))
}

async fn wait_reasons(client: &Client, names: &[String], want: &str) -> Result<()> {
    wait_until(
        format!("Ready reason {want} on {names:?}"),
        Duration::from_secs(60),
        || async {
            let mut seen = Vec::new();
            for n in names {
                seen.push((n.clone(), ready_reason(client, n).await?));
            }
            Ok(if seen.iter().all(|(_, r)| r.as_deref() == Some(want)) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{seen:?}"))
            })
        },
    )
    .await
}

/// Waits until the webhook resolves each of `runtimes` by name (its watch has seen them).
async fn wait_runtimes_known(
    client: &Client,
    ns: &str,
    runtimes: &[InferenceRuntime],
) -> Result<()> {
    for r in runtimes {
        let name = r.name_any();
        let probe = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "runtime-probe", "annotations": {"serving.hearth.dev/runtime": name}},
            "spec": {"containers": [{"name": "c", "image": "example.com/probe:1"}]},
        });
        wait_until(
            format!("the webhook knowing runtime {name}"),
            Duration::from_secs(30),
            || async {
                let a = create_answer(client, ns, &probe, true).await?;
                let message = a.body["message"].as_str().unwrap_or_default().to_owned();
                Ok(if message.contains("does not exist") {
                    Observed::NotYet(message)
                } else {
                    Observed::Ready(())
                })
            },
        )
        .await?;
    }
    Ok(())
}

/// The apiserver's admission policy plugins read their objects through informers: give them
/// time to see a change (they do in well under a second on this cluster).
async fn settle() {
    tokio::time::sleep(Duration::from_secs(3)).await;
}

async fn answers(client: &Client, ns: &str, suite: &Suite) -> Result<Vec<Verdict>> {
    let mut out = Vec::new();
    for c in &suite.cases {
        let a = create_answer(client, ns, &c.object, true)
            .await
            .with_context(|| format!("{}: {}", suite.dir.display(), c.name))?;
        out.push(verdict(&a));
    }
    Ok(out)
}

fn dynamic(
    client: &Client,
    kind: Kind,
    apis: &hearth_crds::admission_apis::AdmissionApis,
) -> Result<Api<DynamicObject>> {
    let ar = kind
        .api_resource(apis)
        .with_context(|| format!("the apiserver does not serve {}", kind.as_str()))?;
    Ok(Api::all_with(client.clone(), &ar))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exported_policies_admit_and_deny_as_the_webhook_does_and_outlive_it() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    stack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    let apis = discover(&client).await?;
    // tests/cluster/up enables MutatingAdmissionPolicy v1beta1 on 1.34 and 1.35; the oldest
    // supported set (1.30) has none, and only validations are exported there.
    let mutating = apis.mutating_version().is_some();
    ensure!(
        mutating || apis.minor < 34,
        "the apiserver serves no MutatingAdmissionPolicy: tests/cluster/up enables v1beta1 ({apis:?})"
    );
    let target = Target::served(
        apis.minor,
        apis.validating_v1,
        apis.mutating_v1,
        apis.mutating_v1beta1,
    );
    // What an earlier run left.
    clear_exports(&client, &apis).await?;
    let root = stack::workspace_dir();
    let builtins: BTreeSet<String> = hearth_policies::builtin::policies()?
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let runtimes_api: Api<InferenceRuntime> = Api::all(client.clone());
    let policies_api: Api<ServingPolicy> = Api::all(client.clone());
    let ns = cluster.namespace("e2e-export").await?;
    let mut table = Vec::new();
    let mut differences = Vec::new();
    let mut exported_any = BTreeSet::new();
    let suites = SUITES
        .iter()
        .map(|d| Ok((d.to_string(), load(&root.join(d), &builtins)?)))
        .chain(std::iter::once(Ok(("upstream".to_owned(), upstream()?))))
        .collect::<Result<Vec<(String, Suite)>>>()?;
    for (dir, suite) in &suites {
        let dir = dir.as_str();
        // Runtimes other suites use (the upstream stub) stay when this one is done.
        let before: BTreeSet<String> = runtimes_api
            .list_metadata(&Default::default())
            .await?
            .items
            .iter()
            .map(ResourceExt::name_any)
            .collect();
        for r in &suite.runtimes {
            apply(&runtimes_api, r).await?;
        }
        let mut platform = Vec::new();
        for p in &suite.policies {
            platform.push(apply(&policies_api, p).await?.name_any());
        }
        let every: Vec<String> = builtins.iter().cloned().chain(platform.clone()).collect();
        wait_reasons(&client, &every, "Compiled").await?;
        wait_runtimes_known(&client, ns.name(), &suite.runtimes).await?;
        let through_webhook = answers(&client, ns.name(), suite).await?;

        // Export what exports, as the controller does, from the objects as stored.
        let runtimes = runtimes_api.list(&Default::default()).await?.items;
        let mut exported = Vec::new();
        let mut objects = Vec::new();
        for name in &every {
            let p = policies_api.get(name).await?;
            if let Ok(o) = export::export(
                &p,
                &runtimes,
                &target,
                &export::skipped_namespaces(stack::RELEASE_NAMESPACE),
            ) {
                exported.push(name.clone());
                objects.extend(o);
            }
        }
        // As the export mode does: the policies, then (the apiserver given time to load them)
        // the bindings, marked enforced.
        for bindings in [false, true] {
            for o in objects.iter_mut() {
                let kind =
                    Kind::from_name(o["kind"].as_str().unwrap_or_default()).context("kind")?;
                if kind.is_binding() != bindings {
                    continue;
                }
                if bindings {
                    o["metadata"]["annotations"][export::ENFORCED] = json!("true");
                }
                let name = o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                dynamic(&client, kind, &apis)?
                    .patch(
                        &name,
                        &PatchParams::apply(MANAGER).force(),
                        &Patch::Apply(&*o),
                    )
                    .await
                    .with_context(|| format!("applying {} {name}", kind.as_str()))?;
            }
            settle().await;
        }
        wait_reasons(&client, &exported, "Exported").await?;
        let through_apiserver = answers(&client, ns.name(), suite).await?;
        for ((c, a), b) in suite
            .cases
            .iter()
            .zip(&through_webhook)
            .zip(&through_apiserver)
        {
            let same = agree(a, b);
            table.push((
                dir.to_owned(),
                c.name.clone(),
                same,
                matches!(a, Verdict::Denied { .. }),
            ));
            if same == Agreement::Differs {
                differences.push(format!(
                    "{dir} {}:\n  webhook:  {a:?}\n  exported: {b:?}",
                    c.name
                ));
            }
        }
        exported_any.extend(exported.iter().cloned());

        // The suite with a MutatingAdmissionPolicy and a denying ValidatingAdmissionPolicy:
        // the webhook goes away, then comes back (the chart installed again).
        if dir == "examples/ascend" && mutating {
            outage(&client, ns.name(), suite).await?;
        }

        // Removing the exported objects gives the policies back to the webhook.
        for o in objects.iter().rev() {
            let kind = Kind::from_name(o["kind"].as_str().unwrap_or_default()).context("kind")?;
            let name = o["metadata"]["name"].as_str().unwrap_or_default();
            let _ = dynamic(&client, kind, &apis)?
                .delete(name, &DeleteParams::default())
                .await;
        }
        wait_reasons(&client, &exported, "Compiled").await?;
        for p in &platform {
            let _ = policies_api.delete(p, &DeleteParams::default()).await;
        }
        for r in suite
            .runtimes
            .iter()
            .filter(|r| !before.contains(&r.name_any()))
        {
            let _ = runtimes_api
                .delete(&r.name_any(), &DeleteParams::default())
                .await;
        }
        settle().await;
    }
    println!("\n| suite | case | webhook | exported |\n|---|---|---|---|");
    for (suite, case, same, denied) in &table {
        println!(
            "| {suite} | {case} | {} | {} |",
            if *denied { "denied" } else { "admitted" },
            match same {
                Agreement::Same => "same",
                Agreement::FewerReasons => "denied, fewer reasons",
                Agreement::Differs => "DIFFERS",
            }
        );
    }
    println!("exported: {exported_any:?}");
    ensure!(
        differences.is_empty(),
        "{} of {} answers differ:\n{}",
        differences.len(),
        table.len(),
        differences.join("\n")
    );
    ensure!(table.len() >= 20, "only {} cases compared", table.len());
    let mut must = vec![
        "hearth-model-container",
        "ascend-device-count",
        "internal-registry",
    ];
    if mutating {
        must.push("hearth-ascend-host-driver");
    }
    for must in must {
        ensure!(exported_any.contains(must), "{must} was not exported");
    }
    Ok(())
}

/// Deletes every exported object (label `serving.hearth.dev/exported-from`).
async fn clear_exports(
    client: &Client,
    apis: &hearth_crds::admission_apis::AdmissionApis,
) -> Result<()> {
    for kind in Kind::ALL {
        let api = dynamic(client, kind, apis)?;
        let lp = kube::api::ListParams::default().labels(export::EXPORTED_FROM);
        api.delete_collection(&DeleteParams::default(), &lp).await?;
    }
    Ok(())
}

/// Sets `failurePolicy` on every webhook of Hearth's two webhook configurations.
async fn failure_policy(client: &Client, policy: &str) -> Result<()> {
    set_failure_policy::<MutatingWebhookConfiguration>(client, policy, |c| {
        c.webhooks.as_ref().map_or(0, Vec::len)
    })
    .await?;
    set_failure_policy::<ValidatingWebhookConfiguration>(client, policy, |c| {
        c.webhooks.as_ref().map_or(0, Vec::len)
    })
    .await
}

/// Sets `failurePolicy` on each of the `webhooks` of the configuration `hearth` of kind `K`.
async fn set_failure_policy<K>(
    client: &Client,
    policy: &str,
    webhooks: impl Fn(&K) -> usize,
) -> Result<()>
where
    K: kube::Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + serde::de::DeserializeOwned
        + serde::Serialize
        + std::fmt::Debug,
{
    let api: Api<K> = Api::all(client.clone());
    let n = webhooks(&api.get("hearth").await?);
    let ops: Vec<Value> = (0..n)
        .map(|i| json!({"op": "replace", "path": format!("/webhooks/{i}/failurePolicy"), "value": policy}))
        .collect();
    let patch: json_patch::Patch = serde_json::from_value(json!(ops))?;
    api.patch("hearth", &PatchParams::default(), &Patch::<()>::Json(patch))
        .await?;
    Ok(())
}

/// A webhook outage where it hurts most: Hearth's webhooks set to `failurePolicy: Ignore` and
/// the webhook scaled to zero, so the apiserver admits opted-in workloads without it. The
/// exported policies still mutate (MutatingAdmissionPolicy) and deny (ValidatingAdmission
/// Policy), while the webhook's own defaults (probes) are missing. Everything is put back as
/// it was (same values: helm's server-side apply then shares the fields instead of conflicting).
async fn outage(client: &Client, ns: &str, suite: &Suite) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), stack::RELEASE_NAMESPACE);
    let replicas = deployments
        .get("hearth-webhook")
        .await?
        .spec
        .and_then(|s| s.replicas)
        .unwrap_or(1);
    failure_policy(client, "Ignore").await?;
    let scale = |n: i32| {
        let deployments = deployments.clone();
        async move {
            deployments
                .patch(
                    "hearth-webhook",
                    &PatchParams::default(),
                    &Patch::Merge(json!({"spec": {"replicas": n}})),
                )
                .await
        }
    };
    scale(0).await?;
    let checked = enforced_without_webhook(client, ns, suite).await;
    scale(replicas).await?;
    failure_policy(client, "Fail").await?;
    wait_until("the webhook back", Duration::from_secs(120), || async {
        Ok(if stack::hearth_available(client).await? {
            Observed::Ready(())
        } else {
            Observed::NotYet("not available".to_owned())
        })
    })
    .await?;
    checked
}

async fn enforced_without_webhook(client: &Client, ns: &str, suite: &Suite) -> Result<()> {
    let base = suite
        .cases
        .iter()
        .find(|c| c.name == "volcano-scheduling-and-npus")
        .context("examples/ascend has no case volcano-scheduling-and-npus")?;
    // Pinned to the suite's Ascend runtime: other suites' runtimes may share its vendor (the
    // vendor annotation could then resolve elsewhere, or tie).
    let runtime = suite
        .runtimes
        .iter()
        .find(|r| r.spec.vendor == "ascend")
        .context("examples/ascend has no Ascend runtime")?
        .name_any();
    let mut base_object = base.object.clone();
    base_object["metadata"]["annotations"] = json!({"serving.hearth.dev/runtime": runtime});
    let base = Case {
        name: base.name.clone(),
        object: base_object,
    };
    // Three NPUs asked for directly (no webhook to turn an annotation into a limit).
    let mut three = base.object.clone();
    three["metadata"]["name"] = json!("outage-three");
    let containers = three["spec"]["template"]["spec"]["containers"]
        .as_array_mut()
        .context("containers")?;
    containers[0]["resources"] = json!({"limits": {"huawei.com/Ascend910": "3"}});
    wait_until(
        "the webhook gone and the exported policies still enforcing",
        Duration::from_secs(60),
        || async {
            let admitted = create_answer(client, ns, &base.object, true).await?;
            let denied = create_answer(client, ns, &three, true).await?;
            let volumes: Vec<String> = admitted.body["spec"]["template"]["spec"]["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v["name"].as_str().map(str::to_owned))
                .collect();
            let message = denied.body["message"].as_str().unwrap_or_default().to_owned();
            let probes = admitted.body["spec"]["template"]["spec"]["containers"][0]
                .get("startupProbe")
                .is_some();
            let mutated = admitted.code == 201
                && volumes.iter().any(|v| v.contains("driver"))
                && !probes;
            let refused = denied.code == 422
                && message.contains("ValidatingAdmissionPolicy 'ascend-device-count'")
                && message.contains("not 3");
            Ok(if mutated && refused {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!(
                    "admitted {} with volumes {volumes:?} (the webhook's probes: {probes}); three NPUs: {} {message}",
                    admitted.code, denied.code
                ))
            })
        },
    )
    .await?;
    Ok(())
}

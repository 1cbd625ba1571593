//! Cold-start behaviours beyond keepalive, on the upstream stub service:
//! - `coldStart.mode: reject`: a cold request gets a fast `503` with `Retry-After`, and the model
//!   still wakes, so the retry succeeds;
//! - a runtime requesting a resource no node has: the backend pod stays Pending and held
//!   requests end at `activationTimeout` (a streaming one with an SSE `error` event after its
//!   heartbeats, a plain one with `503`);
//! - a backend that cannot come up (an image that cannot be pulled, an engine that exits at
//!   start, weights over the memory limit, a node selector no node matches): the held requests
//!   are answered with the reason (`activation_failed`) long before `activationTimeout`, the
//!   controller diagnoses it within 10 s of the kubelet's or the scheduler's Event saying so
//!   (`Failed`, `BackOff`, `FailedScheduling` on the pod), records it
//!   (`status.lastActivationFailure`, an Event), and once the runtime is fixed the same service
//!   serves.

mod stack;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client::{self, Event};
use hearth_e2e_harness::stack::{self as hstack, ScalerMode};
use k8s_openapi::api::core::v1::Pod;
use kube::api::DeleteParams;
use serde_json::Value;

use stack::SERVICE;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reject_mode_answers_503_with_retry_after_and_still_wakes() -> Result<()> {
    // The one change to the upstream manifest: the cold-start mode under test.
    let d = stack::deploy("e2e-reject", ScalerMode::Poll, |o| {
        o["spec"]["endpoint"]["coldStart"]["mode"] = Value::from("reject");
    })
    .await?;
    let t = client::chat(&d.url, SERVICE, false, Duration::from_secs(30)).await?;
    ensure!(
        t.status == 503,
        "cold request in reject mode answered {}",
        t.status
    );
    let retry = t.retry_after.clone();
    ensure!(retry.is_some(), "503 without Retry-After");
    // Fast: answered before any backend was ready (the gateway did not hold it).
    let ready = d.timeline.first_after(t.sent, |s| s.ready >= 1);
    ensure!(
        ready.is_none_or(|r| t.end < r),
        "the 503 came after a backend was ready"
    );
    // The model still wakes: retry as told until served.
    let wait = Duration::from_secs(retry.as_deref().and_then(|r| r.parse().ok()).unwrap_or(1));
    let mut tries = 0;
    let served = loop {
        tokio::time::sleep(wait).await;
        tries += 1;
        let t = client::chat(&d.url, SERVICE, true, Duration::from_secs(60)).await?;
        if t.status == 200 {
            break t;
        }
        ensure!(
            t.status == 503 && tries < 120,
            "retry {tries} answered {}",
            t.status
        );
    };
    ensure!(
        served.complete(),
        "served stream incomplete: {:?}",
        served.events
    );
    ensure!(
        d.timeline.first_after(t.sent, |s| s.desired >= 1).is_some(),
        "never scaled 0 → 1"
    );
    println!(
        "reject: 503 Retry-After {retry:?}, served after {tries} retries; timeline {}",
        d.timeline_text(t.sent)
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unschedulable_runtime_times_out_held_requests() -> Result<()> {
    let cluster = hearth_test_support::Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    // A copy of the upstream stub runtime whose accelerator no node advertises.
    let mut rt = hstack::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    let name = format!("vllm-stub-absent-{}", std::process::id());
    rt["metadata"]["name"] = Value::from(name.clone());
    rt["spec"]["accelerator"]["resourceName"] = Value::from("hearth.dev/absent-accelerator");
    hstack::apply(&client, rt, None).await?;
    let runtimes = hstack::inference_runtimes(&client);
    let result = async {
        let d = stack::deploy("e2e-absent", ScalerMode::Poll, |o| {
            o["spec"]["runtime"]["name"] = Value::from(name.clone());
            o["spec"]["scaling"]["activationTimeout"] = Value::from("20s");
        })
        .await?;
        let (s, p) = tokio::join!(
            client::chat(&d.url, SERVICE, true, Duration::from_secs(90)),
            client::chat(&d.url, SERVICE, false, Duration::from_secs(90)),
        );
        let (s, p) = (s?, p?);
        ensure!(s.status == 200, "held stream answered {}", s.status);
        ensure!(
            s.heartbeats() >= 1,
            "no heartbeat while held: {:?}",
            s.events
        );
        let err = s.events.iter().find_map(|(_, e)| match e {
            Event::Error(m) => Some(m.clone()),
            _ => None,
        });
        ensure!(
            err.as_deref()
                .is_some_and(|m| m.contains("activation timeout")),
            "held stream did not end with an activation-timeout error event: {:?}",
            s.events
        );
        ensure!(
            s.text().is_empty(),
            "tokens from a backend that cannot schedule"
        );
        ensure!(
            p.status == 503,
            "held plain request answered {} ({})",
            p.status,
            p.body
        );
        ensure!(
            p.body.contains("activation timeout"),
            "503 body does not name the activation timeout: {}",
            p.body
        );
        // Held for activationTimeout (20 s) as specified, not failed early.
        ensure!(
            p.end - p.sent >= Duration::from_secs(20),
            "plain request ended after {:?}",
            p.end - p.sent
        );
        // The backend pod exists and is unschedulable.
        let pods: Vec<Pod> = d.backend_pods().await?;
        let unschedulable = pods.iter().any(|p| {
            p.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter().any(|c| {
                        c.type_ == "PodScheduled"
                            && c.status == "False"
                            && c.reason.as_deref() == Some("Unschedulable")
                    })
                })
        });
        ensure!(
            unschedulable,
            "no Unschedulable backend pod: {}",
            hearth_test_support::describe_pods(&pods)
        );
        println!(
            "absent accelerator: stream error {:?} after {} heartbeats; plain 503 after {:.1}s",
            err,
            s.heartbeats(),
            (p.end - p.sent).as_secs_f64()
        );
        Ok(())
    }
    .await;
    let _ = runtimes.delete(&name, &DeleteParams::default()).await;
    result
}

/// One way a backend fails to come up, made by a change to the runtime copy and the service.
struct Breakage {
    /// What the test calls it.
    what: &'static str,
    /// Merge patch of the runtime copy (`spec`), and of the LLMService (`spec`, or null).
    runtime: Value,
    service: Value,
    /// The `Ready` reason, and the activation phase, the controller must report.
    reason: &'static str,
    phase: &'static str,
    /// The reason of the pod's Warning Event by which the kubelet or the scheduler says so.
    said_by: &'static str,
    /// True of the backend's pod template once both patches are rendered: the runtime's and
    /// the service's are two writes, and the controller may render the first alone (a pod of
    /// that template may even serve).
    applied: fn(&Value) -> bool,
}

/// The runtime copy's and the service's state as the upstream manifests have them.
fn healthy(rt: &Value) -> (Value, Value) {
    let mut accelerator = rt["spec"]["accelerator"].clone();
    accelerator["nodeSelector"][ABSENT_LABEL] = Value::Null;
    (
        serde_json::json!({
            "container": rt["spec"]["container"].clone(),
            "accelerator": accelerator,
        }),
        serde_json::json!({"resources": {"memory": null}}),
    )
}

/// A node label no node has.
const ABSENT_LABEL: &str = "hearth.dev/e2e-absent";

/// The `spec.container` of `rt` with `edit` applied.
fn container_with(rt: &Value, edit: impl FnOnce(&mut Value)) -> Value {
    let mut c = rt["spec"]["container"].clone();
    edit(&mut c);
    serde_json::json!({ "container": c })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_failures_answer_held_requests_with_the_reason_then_the_fix_serves() -> Result<()> {
    use k8s_openapi::api::core::v1::Event as CoreEvent;
    use kube::api::{ListParams, Patch, PatchParams};

    let cluster = hearth_test_support::Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    let upstream = hstack::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    let name = format!("vllm-stub-broken-{}", std::process::id());
    // On the real node's `nvidia.com/gpu`, which no other suite of this step asks for (the
    // rollouts between the breakages may hold two at once).
    let mut upstream = upstream;
    upstream["spec"]["accelerator"]["resourceName"] = Value::from("nvidia.com/gpu");
    upstream["spec"]["accelerator"]["nodeSelector"] =
        serde_json::json!({"tests.hearth.dev/real-node": "true"});
    let mut rt = upstream.clone();
    rt["metadata"]["name"] = Value::from(name.clone());
    // Below the upstream runtime, so no service that names none resolves to this copy.
    rt["spec"]["priority"] = Value::from(1);
    // First breakage: an image no registry serves (nothing listens on port 9).
    rt["spec"]["container"]["image"] = Value::from("127.0.0.1:9/hearth/absent:e2e");
    hstack::apply(&client, rt, None).await?;
    let runtimes = hstack::inference_runtimes(&client);
    let result = async {
        let d = stack::deploy("e2e-broken", ScalerMode::Poll, |o| {
            o["spec"]["runtime"]["name"] = Value::from(name.clone());
            // Far beyond what the answers may take: an answer at the timeout is a failure.
            o["spec"]["scaling"]["activationTimeout"] = Value::from("150s");
        })
        .await?;
        let ns = d.ns.name().to_owned();
        let services = hstack::llm_services(&client, &ns);
        let events: kube::Api<CoreEvent> = kube::Api::namespaced(client.clone(), &ns);
        let (fixed_runtime, fixed_service) = healthy(&upstream);
        let steps = [
            Breakage {
                what: "an image that cannot be pulled",
                runtime: Value::Null,
                service: Value::Null,
                reason: "ImagePullFailed",
                said_by: "Failed",
                phase: "imagePull",
                applied: |_| true,
            },
            Breakage {
                what: "an engine that exits at start",
                runtime: container_with(&upstream, |c| {
                    if let Some(a) = c["args"].as_array_mut() {
                        a.push("--no-such-flag".into());
                    }
                }),
                service: Value::Null,
                reason: "CrashLoopBackOff",
                said_by: "BackOff",
                phase: "modelReady",
                applied: |t| has_arg(t, "--no-such-flag"),
            },
            Breakage {
                what: "weights over the memory limit",
                runtime: container_with(&upstream, |c| {
                    if let Some(e) = c["env"].as_array_mut() {
                        e.push(serde_json::json!({"name": "STUB_ALLOCATE_AT_START", "value": "512"}));
                    }
                }),
                service: serde_json::json!({"resources": {"memory": "96Mi"}}),
                reason: "OOMKilled",
                said_by: "BackOff",
                phase: "modelReady",
                applied: |t| {
                    !has_arg(t, "--no-such-flag")
                        && has_env(t, "STUB_ALLOCATE_AT_START")
                        && memory_limit_is(t, "96Mi")
                },
            },
            Breakage {
                what: "a node selector no node matches",
                runtime: {
                    let mut a = fixed_runtime.clone();
                    a["accelerator"]["nodeSelector"][ABSENT_LABEL] = Value::from("true");
                    a
                },
                service: fixed_service.clone(),
                reason: "Unschedulable",
                said_by: "FailedScheduling",
                phase: "scheduled",
                applied: |t| healthy_template(t) && selects(t, ABSENT_LABEL),
            },
        ];
        let mut previous: Option<&str> = None;
        let mut lines = Vec::new();
        let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
            kube::Api::namespaced(client.clone(), &ns);
        for step in &steps {
            let before = template(&deployments).await?;
            if !step.runtime.is_null() {
                runtimes
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(serde_json::json!({"spec": step.runtime})),
                    )
                    .await?;
            }
            if !step.service.is_null() {
                services
                    .patch(
                        SERVICE,
                        &PatchParams::default(),
                        &Patch::Merge(serde_json::json!({"spec": step.service})),
                    )
                    .await?;
            }
            // The controller applied the new template, and the last breakage's pods are
            // replaced (or scaled away), before the new requests.
            if previous.is_some() {
                wait_applied(&deployments, before.clone(), step.applied).await?;
            }
            if let Some(prev) = previous {
                stack::wait_ready_reason(&services, |r| r != prev, Duration::from_secs(120))
                    .await
                    .with_context(|| format!("{}: the service still reports {prev}", step.what))?;
            }
            let (s, p) = past_stale(previous, || async {
                let (s, p) = tokio::join!(
                    client::chat(&d.url, SERVICE, true, Duration::from_secs(180)),
                    client::chat(&d.url, SERVICE, false, Duration::from_secs(180)),
                );
                Ok((s?, p?))
            })
            .await?;
            if !(p.status == 503
                && p.body.contains("activation_failed")
                && p.body.contains(step.reason))
            {
                // What the cluster showed then: the backend's pods and the service's status.
                let pods = match d.backend_pods().await {
                    Ok(pods) => pods
                        .iter()
                        .map(|p| {
                            format!(
                                "{} {}",
                                hearth_test_support::describe_pods(std::slice::from_ref(p)),
                                serde_json::to_string(
                                    &p.status.as_ref().map(|s| &s.container_statuses)
                                )
                                .unwrap_or_default()
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("; "),
                    Err(e) => format!("(listing them failed: {e})"),
                };
                let status = match services.get(SERVICE).await {
                    Ok(svc) => svc.data["status"].to_string(),
                    Err(e) => format!("(reading it failed: {e})"),
                };
                // Whether a pod was asked for at all: each Deployment's replicas and status.
                let scaled = match deployments.list(&ListParams::default()).await {
                    Ok(list) => list
                        .items
                        .iter()
                        .map(|dep| {
                            format!(
                                "{} replicas={:?} {}",
                                dep.metadata.name.as_deref().unwrap_or("?"),
                                dep.spec.as_ref().and_then(|s| s.replicas),
                                serde_json::to_string(&dep.status).unwrap_or_default()
                            )
                        })
                        .collect::<Vec<_>>()
                        .join("; "),
                    Err(e) => format!("(listing them failed: {e})"),
                };
                anyhow::bail!(
                    "{}: the held request answered {} {} (want 503 activation_failed naming {}); backend pods: {pods}; service status: {status}; deployments: {scaled}",
                    step.what,
                    p.status,
                    p.body,
                    step.reason
                );
            }
            let err = s.events.iter().find_map(|(_, e)| match e {
                Event::Error(m) => Some(m.clone()),
                _ => None,
            });
            ensure!(
                s.status == 200 && err.as_deref().is_some_and(|m| m.contains(step.reason)),
                "{}: the held stream did not end with an error naming {}: {:?}",
                step.what,
                step.reason,
                s.events
            );
            let held = p.end - p.sent;
            ensure!(
                held < Duration::from_secs(120),
                "{}: answered after {held:?}, near the activation timeout",
                step.what
            );
            // The record, and how soon after the kubelet or the scheduler said so.
            let svc = services.get(SERVICE).await?;
            let record = &svc.data["status"]["lastActivationFailure"];
            ensure!(
                record["reason"] == step.reason && record["phase"] == step.phase,
                "{}: status.lastActivationFailure {record}",
                step.what
            );
            let pod = record["pod"].as_str().context("no pod in the record")?.to_owned();
            let diagnosed: k8s_openapi::jiff::Timestamp = record["time"]
                .as_str()
                .context("no time in the record")?
                .parse()?;
            let pod_events = events
                .list(&ListParams::default().fields(&format!("involvedObject.name={pod}")))
                .await?
                .items;
            let said = pod_events
                .iter()
                .filter(|e| e.reason.as_deref() == Some(step.said_by))
                .filter_map(|e| {
                    e.event_time
                        .as_ref()
                        .map(|t| t.0)
                        .or(e.first_timestamp.as_ref().map(|t| t.0))
                })
                .min();
            let listed = || {
                pod_events
                    .iter()
                    .map(|e| {
                        format!(
                            "{:?} {:?} {:?}: {:?}",
                            e.first_timestamp.as_ref().map(|t| t.0),
                            e.type_,
                            e.reason,
                            e.message
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            let said = said.with_context(|| {
                format!(
                    "{}: no {} Event on pod {pod}:\n{}",
                    step.what,
                    step.said_by,
                    listed()
                )
            })?;
            let after = diagnosed.duration_since(said).as_secs_f64();
            ensure!(
                after <= 10.0,
                "{}: diagnosed at {diagnosed}, {after:.1}s after the pod's first {} Event; its Events:\n{}",
                step.what,
                step.said_by,
                listed()
            );
            // The Event comes right after the status write.
            stack::wait_warning_event(&events, step.reason)
                .await
                .with_context(|| step.what.to_owned())?;
            lines.push(format!(
                "{}: {} ({}) answered after {:.1}s held, diagnosed {after:.1}s after the pod's first {} Event",
                step.what,
                step.reason,
                step.phase,
                held.as_secs_f64(),
                step.said_by
            ));
            previous = Some(step.reason);
        }
        // Fixed: the same service, nothing recreated, serves the next request.
        let before = template(&deployments).await?;
        runtimes
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(serde_json::json!({"spec": fixed_runtime})),
            )
            .await?;
        wait_applied(&deployments, before, |t| {
            healthy_template(t) && !selects(t, ABSENT_LABEL)
        })
        .await?;
        if let Some(prev) = previous {
            stack::wait_ready_reason(&services, |r| r != prev, Duration::from_secs(120)).await?;
        }
        let (t, _) = past_stale(previous, || async {
            let t = client::chat(&d.url, SERVICE, true, Duration::from_secs(150)).await?;
            Ok((t.clone(), t))
        })
        .await?;
        ensure!(
            t.status == 200 && t.complete(),
            "after the fix: {} {:?}",
            t.status,
            t.events
        );
        for l in &lines {
            println!("{l}");
        }
        println!(
            "fixed: served after {:.1}s",
            (t.end - t.sent).as_secs_f64()
        );
        Ok(())
    }
    .await;
    let _ = runtimes.delete(&name, &DeleteParams::default()).await;
    result
}

/// Sends `ask` (a streaming and a plain request, or one twice) until no answer names `stale`,
/// the reason the service reported before: the gateway follows the LLMService by a watch of its
/// own, so for a moment after the status changed it may still answer with the old reason, as a
/// client told to retry after the fix would see. At most 10 tries, 1 s apart; the last answers
/// are returned whatever they say.
async fn past_stale<F, Fut>(stale: Option<&str>, ask: F) -> Result<(client::Trace, client::Trace)>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<(client::Trace, client::Trace)>>,
{
    let names = |t: &client::Trace, reason: &str| {
        t.body.contains(reason)
            || t.events
                .iter()
                .any(|(_, e)| matches!(e, Event::Error(m) if m.contains(reason)))
    };
    let mut attempt = 1;
    loop {
        let (a, b) = ask().await?;
        match stale {
            Some(reason) if attempt < 10 && (names(&a, reason) || names(&b, reason)) => {
                println!(
                    "answered with the previous reason {reason} (attempt {attempt}); asking again"
                );
                attempt += 1;
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            _ => return Ok((a, b)),
        }
    }
}

/// The backend Deployment's pod template (KEDA's scaling leaves it alone).
async fn template(
    deployments: &kube::Api<k8s_openapi::api::apps::v1::Deployment>,
) -> Result<Value> {
    let d = deployments.get(stack::BACKEND).await?;
    Ok(serde_json::to_value(d.spec.map(|s| s.template))?)
}

/// Waits until the backend Deployment's pod template differs from `before` and `applied` holds
/// of it: the controller applied the whole change of the runtime and the service.
async fn wait_applied(
    deployments: &kube::Api<k8s_openapi::api::apps::v1::Deployment>,
    before: Value,
    applied: fn(&Value) -> bool,
) -> Result<()> {
    use hearth_test_support::{Observed, wait_until};
    wait_until(
        "the controller applying the changed template",
        Duration::from_secs(60),
        || async {
            let now = template(deployments).await?;
            Ok(if now == before {
                Observed::NotYet("the pod template is unchanged".to_owned())
            } else if !applied(&now) {
                Observed::NotYet(format!("the pod template is not the change's yet: {now}"))
            } else {
                Observed::Ready(())
            })
        },
    )
    .await
}

/// The containers of a pod template (`template()`'s JSON).
fn containers(t: &Value) -> impl Iterator<Item = &Value> {
    t["spec"]["containers"].as_array().into_iter().flatten()
}

/// Whether a container of `t` has the argument `arg`.
fn has_arg(t: &Value, arg: &str) -> bool {
    containers(t).any(|c| {
        c["args"]
            .as_array()
            .is_some_and(|a| a.iter().any(|x| x == arg))
    })
}

/// Whether a container of `t` has the environment variable `name`.
fn has_env(t: &Value, name: &str) -> bool {
    containers(t).any(|c| {
        c["env"]
            .as_array()
            .is_some_and(|e| e.iter().any(|v| v["name"] == name))
    })
}

/// Whether a container of `t` has the memory limit `limit`.
fn memory_limit_is(t: &Value, limit: &str) -> bool {
    containers(t).any(|c| c["resources"]["limits"]["memory"] == limit)
}

/// Whether `t`'s node selector has `label`.
fn selects(t: &Value, label: &str) -> bool {
    t["spec"]["nodeSelector"].get(label).is_some()
}

/// No breakage of the runtime's container or the service's memory is in `t`.
fn healthy_template(t: &Value) -> bool {
    !has_arg(t, "--no-such-flag")
        && !has_env(t, "STUB_ALLOCATE_AT_START")
        && !memory_limit_is(t, "96Mi")
}

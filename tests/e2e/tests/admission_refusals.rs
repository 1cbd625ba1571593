//! Admission refusals on the real node: a backend pod that the apiserver refuses (here Pod
//! Security `restricted`, which the gateway's pods meet and the engine's does not: Hearth's
//! default security context for the engine leaves out `runAsNonRoot`, since vLLM's images run
//! as root) is on the LLMService as `Ready=False` `FailedCreate` with the
//! apiserver's message and a Warning Event within 10 s of the ReplicaSet's refusal, a held
//! request is answered with it, and with the namespace at `baseline` the same service serves.

mod stack;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::{self as hstack, ScalerMode};
use serde_json::Value;

use stack::SERVICE;

/// A backend pod refused by admission: the namespace enforces Pod Security `restricted`, which
/// the gateway's pods meet and the engine's (without `runAsNonRoot`) does not. The
/// ReplicaSet's pods are refused (`FailedCreate`); within 10 s of its Event the LLMService says
/// `Ready=False` `FailedCreate` with the apiserver's message, a Warning Event says so too, and
/// a held request is answered with it. With the namespace at `baseline`, the same service
/// serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_security_refusal_is_reported_within_seconds_then_the_fix_serves() -> Result<()> {
    use k8s_openapi::api::core::v1::{Event as CoreEvent, Namespace};
    use kube::api::{ListParams, Patch, PatchParams};

    const ENFORCE: &str = "pod-security.kubernetes.io/enforce";
    let d = stack::deploy("e2e-psa", ScalerMode::Poll, |o| {
        o["spec"]["scaling"]["activationTimeout"] = Value::from("150s");
    })
    .await?;
    let client = d.cluster.client();
    let ns = d.ns.name().to_owned();
    let namespaces: kube::Api<Namespace> = kube::Api::all(client.clone());
    let level =
        |level: &str| Patch::Merge(serde_json::json!({"metadata": {"labels": {ENFORCE: level}}}));
    namespaces
        .patch(&ns, &PatchParams::default(), &level("restricted"))
        .await?;

    // A cold request: KEDA asks for a backend, whose pods the apiserver refuses.
    let p = client::chat(&d.url, SERVICE, false, Duration::from_secs(180)).await?;
    ensure!(
        p.status == 503
            && p.body.contains("activation_failed")
            && p.body.contains("FailedCreate")
            && p.body.contains("PodSecurity"),
        "the held request answered {} {} (want 503 activation_failed naming FailedCreate and Pod Security)",
        p.status,
        p.body
    );
    let held = p.end - p.sent;
    let services = hstack::llm_services(&client, &ns);
    let svc = services.get(SERVICE).await?;
    let ready = svc.data["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .cloned()
        .unwrap_or_default();
    ensure!(
        ready["status"] == "False"
            && ready["reason"] == "FailedCreate"
            && ready["message"]
                .as_str()
                .is_some_and(|m| m.contains("violates PodSecurity")),
        "Ready: {ready}"
    );
    ensure!(
        svc.data["status"]["phase"] == "Degraded",
        "phase {}",
        svc.data["status"]["phase"]
    );
    let reported: k8s_openapi::jiff::Timestamp = ready["lastTransitionTime"]
        .as_str()
        .context("no lastTransitionTime")?
        .parse()?;
    // The ReplicaSet controller's Event of the refusal (second precision, as the condition's).
    let events: kube::Api<CoreEvent> = kube::Api::namespaced(client.clone(), &ns);
    let refused = events
        .list(&ListParams::default().fields("involvedObject.kind=ReplicaSet,reason=FailedCreate"))
        .await?
        .items
        .iter()
        .filter_map(|e| {
            e.first_timestamp
                .as_ref()
                .map(|t| t.0)
                .or(e.event_time.as_ref().map(|t| t.0))
        })
        .min()
        .context("no FailedCreate Event on the ReplicaSet")?;
    let after = reported.duration_since(refused).as_secs_f64();
    ensure!(
        after <= 10.0,
        "reported at {reported}, {after:.0}s after the ReplicaSet's first FailedCreate Event at {refused}"
    );
    stack::wait_warning_event(&events, "FailedCreate").await?;

    // The fix the message names: a level the engine meets. The ReplicaSet retries (with its
    // controller's backoff) and the same service serves.
    let fixed = std::time::Instant::now();
    namespaces
        .patch(&ns, &PatchParams::default(), &level("baseline"))
        .await?;
    stack::wait_ready_reason(&services, |r| r != "FailedCreate", Duration::from_secs(180)).await?;
    let t = client::chat(&d.url, SERVICE, true, Duration::from_secs(150)).await?;
    ensure!(
        t.status == 200 && t.complete(),
        "after the namespace's fix: {} {:?}",
        t.status,
        t.events
    );
    println!(
        "Pod Security refusal: held request answered after {:.1}s, Ready=False FailedCreate {after:.0}s after the ReplicaSet's first FailedCreate Event; at baseline, served {:.1}s after the fix",
        held.as_secs_f64(),
        fixed.elapsed().as_secs_f64()
    );
    Ok(())
}

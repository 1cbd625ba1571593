//! The whole loop of the upstream stub service on the local cluster, in both scaler modes:
//! apply → ScaledToZero with no backend pod; a cold streaming chat completion → SSE heartbeats
//! while the backend goes 0 → 1 → tokens → 200; then idle → back to 0, the idle pod leaving
//! as soon as its drain sidecar sees the engine idle (not after the whole `drainTimeout`).
//! In poll mode the service has an alias (`spec.model.aliases`, the hub id): `/v1/models` lists
//! it while the model is at zero, and the cold request calls the model by it (the stub engine
//! serves only the service's name, so an answer shows the gateway forwarded it under that name).
//! In push mode KEDA reaches the gateway's ExternalScaler over mutual TLS: a client without
//! KEDA's certificate for this service is refused, and after the certificates are issued again
//! (a renewal, from the same CA) a cold request scales it from zero again.
//! Hearth is installed with its chart and every pod runs on the real node of `tests/cluster/up`
//! (needs root); see docs/e2e.md.

mod stack;

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client::{self, Event};
use hearth_e2e_harness::stack::ScalerMode;
use hearth_test_support::{Observed, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::Api;
use kube::api::{DynamicObject, Patch, PatchParams};

use stack::scaler_tls::{
    Material, RECORD, open_scaler_port_to_the_host, plain_h2, signed_by_the_scaler_ca,
};
use stack::{SERVICE, TOKENS};

/// The alias the poll-mode service answers to: the hub id clients already use.
const ALIAS: &str = "Qwen/Qwen2.5-0.5B-Instruct";

async fn cold_start_then_back_to_zero(mode: ScalerMode) -> Result<stack::Deployed> {
    let alias = (mode == ScalerMode::Poll).then_some(ALIAS);
    let d = stack::deploy(&format!("e2e-zero-{}", mode.annotation()), mode, |o| {
        if let Some(alias) = alias {
            o["spec"]["model"]["aliases"] = serde_json::json!([alias]);
        }
    })
    .await?;
    // apply → ScaledToZero, and no backend pod exists.
    ensure!(
        d.backend_pods().await?.is_empty(),
        "a backend pod exists while ScaledToZero"
    );
    let model = match alias {
        Some(alias) => {
            // Listed while cold, beside the service's own name.
            let (status, body) =
                client::get(&format!("{}/v1/models", d.url), Duration::from_secs(10)).await?;
            let listed: serde_json::Value = serde_json::from_str(&body)
                .with_context(|| format!("/v1/models answered {status}: {body}"))?;
            let ids: Vec<&str> = listed["data"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|m| m["id"].as_str())
                .collect();
            ensure!(
                status == 200 && ids == [SERVICE, alias],
                "/v1/models while cold: {status} {body}"
            );
            alias
        }
        None => SERVICE,
    };

    let trace = client::chat(&d.url, model, true, Duration::from_secs(150)).await?;
    let t0 = trace.sent;
    let tl = d.timeline_text(t0);
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
    let tokens = trace.tokens(None);
    ensure!(tokens == TOKENS, "{tokens} tokens, the stub sends {TOKENS}");
    let first_token = trace.first_token().expect("complete stream has tokens");
    let heartbeats_before = trace
        .events
        .iter()
        .take_while(|(_, e)| *e == Event::Heartbeat)
        .count();
    ensure!(
        heartbeats_before >= 1,
        "no SSE heartbeat before the first token: {:?}",
        trace.events
    );
    // 0 → 1 happened after the request, and the backend pod was Ready before the first token:
    // its Ready condition's time (whole seconds, truncated) against the token's wall-clock
    // time. The Deployment's readyReplicas (the timeline) may follow the EndpointSlice, which
    // the gateway forwards by, by seconds on a busy node.
    let first_token_at = SystemTime::now() - first_token.elapsed();
    let pod_ready_at = d.backend_ready_at().await?;
    let scaled = d.timeline.first_after(t0, |s| s.desired >= 1);
    let ready = d.timeline.first_after(t0, |s| s.ready >= 1);
    ensure!(scaled.is_some(), "the backend never scaled 0 → 1 ({tl})");
    ensure!(
        pod_ready_at.is_some_and(|r| r <= first_token_at),
        "first token before any Ready backend pod (Ready at {:?}, first token at {first_token_at:?}; {tl})",
        pod_ready_at
    );
    ensure!(
        d.timeline.max_desired() == 1,
        "one request at target 1 scaled to {} replicas ({tl})",
        d.timeline.max_desired()
    );

    // Idle → 0.
    d.wait_zero(Duration::from_secs(180)).await?;
    let gone = Instant::now();
    d.wait_phase("ScaledToZero", Duration::from_secs(60))
        .await?;
    let back = Instant::now();
    // The idle pod's preStop (an httpGet to the hearth-drain sidecar) ends after the drain's
    // settle time (2 s), not after the service's drainTimeout (20 s) as a `sleep` would.
    let zeroed = ready
        .and_then(|r| d.timeline.first_after(r, |s| s.desired == 0))
        .unwrap_or(gone);
    let termination = gone.saturating_duration_since(zeroed);
    ensure!(
        termination < Duration::from_secs(15),
        "the idle backend pod took {termination:?} to go after scale-down (drainTimeout is 20s: was the preStop a fixed wait?) ({})",
        d.timeline_text(t0)
    );
    println!(
        "[{}] sent 0.00s, scaled 0→1 {:.2}s, ready {:.2}s, first token {:.2}s, last token {:.2}s, {} heartbeats, idle pod gone {:.1}s after scale-down, back to 0 by {:.1}s; timeline: {}",
        mode.annotation(),
        scaled.map(|s| (s - t0).as_secs_f64()).unwrap_or_default(),
        ready.map(|s| (s - t0).as_secs_f64()).unwrap_or_default(),
        (first_token - t0).as_secs_f64(),
        (trace.last_token().unwrap_or(first_token) - t0).as_secs_f64(),
        heartbeats_before,
        termination.as_secs_f64(),
        (back - t0).as_secs_f64(),
        d.timeline_text(t0),
    );
    Ok(d)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_cold_start_then_back_to_zero() -> Result<()> {
    let d = cold_start_then_back_to_zero(ScalerMode::Poll).await?;
    poll_trigger_fits_the_keda_version(&d).await
}

/// The poll trigger is the one the cluster's KEDA can run (its version read as the controller
/// reads it, from the ScaledObject CRD's label): KEDA 2.19 and later sum over the gateway's
/// endpoints; an older KEDA asks one replica, and the service's `AutoscalingReady` says so.
async fn poll_trigger_fits_the_keda_version(d: &stack::Deployed) -> Result<()> {
    use hearth_controller::versions::{KEDA_ENDPOINT_AGGREGATION, Version};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let client = d.cluster.client();
    let crd = Api::<CustomResourceDefinition>::all(client.clone())
        .get("scaledobjects.keda.sh")
        .await?;
    let keda: Option<Version> = hearth_controller::versions::keda_version_of(&crd);
    let so = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        d.ns.name(),
        &hearth_controller::render::scaled_object_resource(),
    )
    .get(SERVICE)
    .await?;
    let metadata = &so.data["spec"]["triggers"][0]["metadata"];
    let svc = hearth_e2e_harness::stack::llm_services(&client, d.ns.name())
        .get(SERVICE)
        .await?;
    let autoscaling = svc.data["status"]["conditions"]
        .as_array()
        .and_then(|cs| cs.iter().find(|c| c["type"] == "AutoscalingReady"))
        .cloned()
        .unwrap_or_default();
    let aggregates = keda.is_none_or(|v| v >= KEDA_ENDPOINT_AGGREGATION);
    ensure!(
        (metadata.get("aggregateFromKubeServiceEndpoints").is_some() == aggregates)
            && (autoscaling["message"]
                .as_str()
                .is_some_and(|m| m.contains("cannot sum"))
                != aggregates),
        "KEDA {keda:?}: trigger {metadata}, AutoscalingReady {autoscaling}"
    );
    println!(
        "[poll] KEDA {}: {}",
        keda.map_or("of unknown version".to_owned(), |v| v.to_string()),
        if aggregates {
            "the trigger sums over the gateway's endpoints"
        } else {
            "the trigger asks one gateway replica for the total, and AutoscalingReady says so"
        }
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn push_mode_cold_start_then_back_to_zero_over_mutual_tls_through_a_renewal() -> Result<()> {
    let d = cold_start_then_back_to_zero(ScalerMode::Push).await?;
    let ns = d.ns.name().to_owned();
    let client = d.cluster.client();
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let scaler_ip = Api::<Service>::namespaced(client.clone(), &ns)
        .get(&format!("{SERVICE}-scaler"))
        .await?
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the scaler Service has no ClusterIP")?;
    let addr = format!("{scaler_ip}:9090");
    let host = format!("{SERVICE}-scaler.{ns}.svc");
    let client_secret = format!("{SERVICE}-scaler-client-tls");
    open_scaler_port_to_the_host(&d.ns, SERVICE, &addr).await?;

    // KEDA's material gets in, checking the gateway's name against the CA as KEDA does; no
    // client certificate, or plain text, does not.
    let old = Material::read(&secrets, &client_secret).await?;
    ensure!(
        old.probe(&addr, &host, true).await?,
        "KEDA's client certificate was refused by the ExternalScaler"
    );
    ensure!(
        !old.probe(&addr, &host, false).await?,
        "a client without a certificate got an HTTP/2 answer from the ExternalScaler"
    );
    ensure!(
        !plain_h2(&addr).await?,
        "plain-text gRPC got an HTTP/2 answer from the ExternalScaler"
    );
    let deployments = Api::<Deployment>::namespaced(client.clone(), &ns);
    let gateway = format!("{SERVICE}-gateway");
    let old_record = record(&deployments, &gateway).await?;
    let digest = trigger_digest(&client, &ns).await?;
    ensure!(
        digest.as_deref() == Some(old_record.digest().as_str()),
        "the ScaledObject's tlsDigest {digest:?} is not the issuance's {}",
        old_record.digest()
    );
    // One CA signs every service's certificates, so the gateway takes only KEDA's certificate
    // for this service: one the test signs with the CA for this service's name gets in, one
    // for another service's scaler is refused, and so is one for the shared gateways.
    let mine = format!("keda.{SERVICE}-scaler.{ns}");
    ensure!(
        signed_by_the_scaler_ca(&client, &mine, &old)
            .await?
            .probe(&addr, &host, true)
            .await?,
        "a client certificate of Hearth's CA for {mine} was refused"
    );
    for name in [
        format!("keda.other-scaler.{ns}"),
        hearth_controller::names::SHARED_SCALER_CLIENT.to_owned(),
    ] {
        ensure!(
            !signed_by_the_scaler_ca(&client, &name, &old)
                .await?
                .probe(&addr, &host, true)
                .await?,
            "a client certificate of Hearth's CA for {name} got in"
        );
    }

    // A renewal, as two thirds into the certificates' life: the record on the gateway
    // Deployment says they expired. The controller issues both again from the same CA, so the
    // bundle does not change: KEDA's new certificate gets in at once, while the gateway still
    // serves its previous files (until the kubelet refreshes them), and a cold request right
    // away scales from zero.
    let mut expired = serde_json::to_value(&old_record)?;
    expired["notAfter"] = "2000-01-01T00:00:00Z".into();
    let rotated = Instant::now();
    deployments
        .patch(
            &gateway,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"annotations": {RECORD: expired.to_string()}}
            })),
        )
        .await?;
    let new = wait_until(
        "a new client certificate in KEDA's Secret",
        Duration::from_secs(30),
        || {
            let secrets = secrets.clone();
            let (name, old_cert) = (client_secret.clone(), old.cert.clone());
            async move {
                let m = Material::read(&secrets, &name).await?;
                Ok(if m.cert != old_cert {
                    Observed::Ready(m)
                } else {
                    Observed::NotYet("still the old certificate".into())
                })
            }
        },
    )
    .await?;
    let issued = rotated.elapsed();
    ensure!(
        new.ca == old.ca,
        "the renewal changed the trust bundle in KEDA's Secret"
    );
    let server_secret = format!("{SERVICE}-scaler-tls");
    let new_server = {
        use rustls::pki_types::pem::PemObject;
        let pem = Material::read(&secrets, &server_secret).await?.cert;
        rustls::pki_types::CertificateDer::from_pem_slice(pem.as_bytes())?
            .as_ref()
            .to_vec()
    };
    let served_before = served_certificate(&addr, &host, &new).await?;
    ensure!(
        new.probe(&addr, &host, true).await?,
        "KEDA's renewed client certificate was refused"
    );
    let accepted = rotated.elapsed();
    let new_record = wait_until(
        "the ScaledObject's tlsDigest to follow the renewal",
        Duration::from_secs(30),
        || {
            let (client, ns, deployments, gateway) = (
                client.clone(),
                ns.clone(),
                deployments.clone(),
                gateway.clone(),
            );
            let old_digest = old_record.digest();
            async move {
                let r = record(&deployments, &gateway).await?;
                let digest = trigger_digest(&client, &ns).await?;
                Ok(
                    if r.digest() != old_digest && digest.as_deref() == Some(r.digest().as_str()) {
                        Observed::Ready(r)
                    } else {
                        Observed::NotYet(format!("tlsDigest {digest:?}"))
                    },
                )
            }
        },
    )
    .await?;
    ensure!(new_record.ca == old_record.ca, "the renewal changed the CA");

    // KEDA reconnects with the new material at once: a cold request scales the backend from
    // zero, whatever the gateway serves yet.
    let trace = client::chat(&d.url, SERVICE, true, Duration::from_secs(150)).await?;
    ensure!(
        trace.status == 200 && trace.complete(),
        "the cold request after the renewal: {} {:?} ({})",
        trace.status,
        trace.events,
        d.timeline_text(trace.sent)
    );
    let cold = rotated.elapsed();
    wait_until(
        "the gateway serving its renewed certificate",
        Duration::from_secs(150),
        || {
            let (addr, host, new, want) =
                (addr.clone(), host.clone(), new.clone(), new_server.clone());
            async move {
                Ok(
                    if served_certificate(&addr, &host, &new).await? == Some(want) {
                        Observed::Ready(())
                    } else {
                        Observed::NotYet("the previous certificate is served yet".into())
                    },
                )
            }
        },
    )
    .await?;
    let served = rotated.elapsed();
    // Both client certificates of the CA for this scaler keep getting in.
    ensure!(
        old.probe(&addr, &host, true).await?,
        "the previous client certificate was refused after the renewal"
    );
    println!(
        "[push, mutual TLS] renewed: new certificates in KEDA's Secret {:.1}s after the record said expired, KEDA's accepted {:.1}s after it (the gateway then served the {} certificate), cold request after the renewal answered by {:.1}s (first token {:.2}s after it was sent), the gateway serving its new certificate {:.1}s after the renewal",
        issued.as_secs_f64(),
        accepted.as_secs_f64(),
        if served_before.as_ref() == Some(&new_server) {
            "new"
        } else {
            "previous"
        },
        cold.as_secs_f64(),
        (trace.first_token().unwrap_or(trace.sent) - trace.sent).as_secs_f64(),
        served.as_secs_f64(),
    );
    Ok(())
}

/// The issuance recorded on the gateway Deployment `gateway`.
async fn record(
    deployments: &Api<Deployment>,
    gateway: &str,
) -> Result<hearth_controller::scaler_tls::Record> {
    let live = deployments.get(gateway).await?;
    hearth_controller::scaler_tls::Record::of(&live)
        .context("the gateway Deployment has no record of the issuance")
}

/// The certificate (DER) the gateway serves at `addr` for `host`, read in a handshake with
/// `material` (KEDA's); `None` when the handshake fails.
async fn served_certificate(
    addr: &str,
    host: &str,
    material: &Material,
) -> Result<Option<Vec<u8>>> {
    Ok(material.connect(addr, host, true).await?.and_then(|tls| {
        tls.get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.as_ref().to_vec())
    }))
}

/// The `tlsDigest` of the ScaledObject's demand trigger.
async fn trigger_digest(client: &kube::Client, ns: &str) -> Result<Option<String>> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns,
        &hearth_controller::render::scaled_object_resource(),
    );
    let so = api.get(SERVICE).await?;
    Ok(so
        .data
        .pointer("/spec/triggers/0/metadata/tlsDigest")
        .and_then(|v| v.as_str())
        .map(str::to_owned))
}

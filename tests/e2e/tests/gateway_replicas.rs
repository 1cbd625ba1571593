//! What an LLMService's `spec.endpoint` makes of its gateway, on the real node: two gateway
//! replicas in push mode (a PodDisruptionBudget over them; each replica, and KEDA through the
//! external metrics API, sees the demand of both summed; one cold request on each replica
//! scales the backend 0 → 1 at target 2), and API keys from a Secret (401 with an OpenAI error
//! without or with a wrong key, 200 with the key, and a rotation of the Secret taking effect
//! in both replicas without a gateway pod restarting); the admin ports (the replicas read each
//! other's demand there with the gateway's own token) refuse a scrape without a token or with
//! one of the wrong scope and serve /metrics to the scrapers' token, and the client port serves
//! none of it; then two evictions at once through the
//! PodDisruptionBudget: one granted, the other refused with 429, and the Service answering
//! meanwhile.

mod stack;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::stack::ScalerMode;
use hearth_e2e_harness::{admin, client};
use hearth_test_support::{Observed, wait_until};
use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::api::policy::v1::PodDisruptionBudget;
use kube::ResourceExt;
use kube::api::{EvictParams, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use stack::SERVICE;

const OLD_KEY: &str = "sk-hearth-e2e-one";
const NEW_KEY: &str = "sk-hearth-e2e-two";

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// The gateway pods by name: (pod IP, uid, restart count, ready).
async fn gateway_pods(
    d: &stack::Deployed,
) -> Result<BTreeMap<String, (String, String, i32, bool)>> {
    let pods =
        d.ns.api::<Pod>()
            .list(&ListParams::default().labels("app.kubernetes.io/component=gateway"))
            .await?
            .items;
    Ok(pods
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .map(|p| {
            let st = p.status.as_ref();
            let ip = st.and_then(|s| s.pod_ip.clone()).unwrap_or_default();
            let restarts = st
                .and_then(|s| s.container_statuses.as_ref())
                .map(|cs| cs.iter().map(|c| c.restart_count).sum())
                .unwrap_or(0);
            (
                p.name_any(),
                (
                    ip,
                    p.uid().unwrap_or_default(),
                    restarts,
                    hearth_test_support::pod_ready(p),
                ),
            )
        })
        .collect())
}

/// `GET /hearth/queue` of one replica's admin port with `token`: `Some(pending)` (the total
/// over the replicas), `None` while it answers anything else (the total unknown).
async fn queue_of(ip: &str, token: &str) -> Option<i64> {
    let (status, body) = admin::get(
        &format!("{}/hearth/queue", admin::url(ip)),
        token,
        Duration::from_secs(5),
    )
    .await
    .ok()?;
    if status != 200 {
        return None;
    }
    serde_json::from_str::<Value>(&body).ok()?["pending"].as_i64()
}

/// The admin port of each replica refuses a scrape without a token (401) and a token of the
/// wrong scope (the scrapers' on /hearth/queue: 403), serves /metrics to the scrapers' token
/// (Secret hearth-gateway-metrics, as the chart's PodMonitor sends it); the client port does
/// not serve the admin paths at all (404).
async fn admin_port_is_guarded(d: &stack::Deployed, ips: &[String]) -> Result<String> {
    let secrets = kube::Api::<Secret>::namespaced(d.cluster.client(), "hearth-system");
    let scrape = secrets
        .get("hearth-gateway-metrics")
        .await
        .context("the scrapers' token Secret")?
        .data
        .and_then(|d| d.get("token").cloned())
        .context("the controller wrote no token into hearth-gateway-metrics")?;
    let scrape = String::from_utf8(scrape.0)?;
    let mut seen = Vec::new();
    for ip in ips {
        let base = admin::url(ip);
        let t = Duration::from_secs(5);
        let (open, _) = client::get(&format!("{base}/metrics"), t).await?;
        let (wrong, _) = admin::get(&format!("{base}/metrics"), "not-a-token", t).await?;
        let (scraped, body) = admin::get(&format!("{base}/metrics"), &scrape, t).await?;
        let (scoped, _) = admin::get(&format!("{base}/hearth/queue"), &scrape, t).await?;
        let client_port = if ip.contains(':') {
            format!("http://[{ip}]:8080")
        } else {
            format!("http://{ip}:8080")
        };
        let (on_client, _) = client::get(&format!("{client_port}/metrics"), t).await?;
        ensure!(
            (open, wrong, scraped, scoped, on_client) == (401, 401, 200, 403, 404),
            "{ip}: no token {open}, bad token {wrong}, scrapers' token {scraped} on /metrics and {scoped} on /hearth/queue, client port {on_client}"
        );
        ensure!(
            body.contains("hearth_gateway_"),
            "{ip}: /metrics without the gateway's series: {body}"
        );
        seen.push(format!("{ip}: 401/401/200/403/404"));
    }
    Ok(seen.join(", "))
}

/// Status of `GET /v1/models` through the gateway Service with `key` (or none).
async fn models_status(url: &str, key: Option<&str>) -> Result<(u16, String)> {
    let auth = key.map(bearer);
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("authorization", a.as_str())).collect();
    Ok(client::get_with_headers(
        &format!("{url}/v1/models"),
        &headers,
        Duration::from_secs(10),
    )
    .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_push_mode_gateways_sum_demand_and_api_keys_rotate_without_restarts() -> Result<()> {
    let secret = json!({
        "apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": "stub-keys"},
        "stringData": {"api-keys": format!("# clients of the e2e suite\n{OLD_KEY}\n")},
    });
    let d = stack::deploy_with("e2e-gw-replicas", ScalerMode::Push, vec![secret], |svc| {
        svc["spec"]["endpoint"]["replicas"] = json!(2);
        svc["spec"]["endpoint"]["apiKeySecretRef"] = json!({"name": "stub-keys"});
        // Two requests (one per replica) are one backend's worth: 0 → 1 only if KEDA sees both.
        svc["spec"]["scaling"]["target"] = json!(2);
    })
    .await?;

    // Two Ready gateway replicas, and their PodDisruptionBudget, owned by the LLMService.
    let pods = wait_until(
        "two Ready gateway replicas",
        Duration::from_secs(120),
        || async {
            let pods = gateway_pods(&d).await?;
            Ok(
                if pods.len() == 2 && pods.values().all(|p| p.3 && !p.0.is_empty()) {
                    Observed::Ready(pods)
                } else {
                    Observed::NotYet(format!("{pods:?}"))
                },
            )
        },
    )
    .await?;
    let pdb =
        d.ns.api::<PodDisruptionBudget>()
            .get(&format!("{SERVICE}-gateway"))
            .await
            .context("the gateway's PodDisruptionBudget")?;
    ensure!(
        pdb.owner_references()
            .iter()
            .any(|o| o.kind == "LLMService" && o.name == SERVICE && o.controller == Some(true)),
        "PodDisruptionBudget not controlled by the LLMService: {:?}",
        pdb.owner_references()
    );
    let pdb_spec = pdb.spec.clone().unwrap_or_default();
    ensure!(
        pdb_spec.max_unavailable
            == Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(1)),
        "PodDisruptionBudget {:?}",
        pdb_spec
    );

    // No key, a wrong key: 401 with an OpenAI error, and nothing wakes the backend.
    for key in [None, Some("sk-wrong")] {
        let (status, body) = models_status(&d.url, key).await?;
        ensure!(status == 401, "key {key:?}: status {status}, body {body}");
        let v: Value = serde_json::from_str(&body).with_context(|| format!("body {body}"))?;
        ensure!(
            v["error"]["code"] == "invalid_api_key" && v["error"]["message"].is_string(),
            "key {key:?}: not an OpenAI error: {body}"
        );
    }
    let (status, body) = models_status(&d.url, Some(OLD_KEY)).await?;
    ensure!(status == 200, "with the key: status {status}, body {body}");

    // One cold streaming request straight to each replica (by pod IP), held until the backend
    // is ready and then streaming for a while: every replica answers the total, 2.
    let ips: Vec<String> = pods.values().map(|p| p.0.clone()).collect();
    let t0 = Instant::now();
    let mut streams = Vec::new();
    for ip in &ips {
        let base = if ip.contains(':') {
            format!("http://[{ip}]:8080")
        } else {
            format!("http://{ip}:8080")
        };
        let auth = bearer(OLD_KEY);
        streams.push(tokio::spawn(async move {
            client::chat_with_headers(
                &base,
                SERVICE,
                true,
                Some(80),
                &[("authorization", auth.as_str())],
                Duration::from_secs(240),
            )
            .await
        }));
    }
    // The replicas read each other's demand with the gateway's own token (its admin Secret);
    // the test reads it the same way.
    let token = admin::token(&d.cluster.client(), d.ns.name(), SERVICE).await?;
    let totals = wait_until(
        "every gateway replica answering total demand 2",
        Duration::from_secs(60),
        || async {
            let mut totals = Vec::new();
            for ip in &ips {
                totals.push(queue_of(ip, &token).await);
            }
            Ok(if totals.iter().all(|t| *t == Some(2)) {
                Observed::Ready(totals)
            } else {
                Observed::NotYet(format!("/hearth/queue of the replicas: {totals:?}"))
            })
        },
    )
    .await?;
    // KEDA's view, read the HPA's way (apiserver → KEDA's metrics adapter → the ExternalScaler
    // of whichever replica its gRPC connection reached): the sum too.
    let client = d.cluster.client();
    let scaled_objects =
        d.ns.dynamic_api("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects");
    // KEDA writes the metric's name into the status once it has reconciled the ScaledObject.
    let metric = wait_until(
        "the ScaledObject's status.externalMetricNames",
        Duration::from_secs(60),
        || async {
            let so = scaled_objects.get(SERVICE).await?;
            Ok(match so.data["status"]["externalMetricNames"][0].as_str() {
                Some(m) => Observed::Ready(m.to_owned()),
                None => Observed::NotYet(format!("status {}", so.data["status"])),
            })
        },
    )
    .await?;
    let path = format!(
        "/apis/external.metrics.k8s.io/v1beta1/namespaces/{}/{metric}?labelSelector=scaledobject.keda.sh%2Fname%3D{SERVICE}",
        d.ns.name()
    );
    let keda_value = wait_until(
        format!("KEDA's external metric {metric} = 2"),
        Duration::from_secs(60),
        || async {
            let body = client
                .request_text(http::Request::get(path.as_str()).body(Vec::new())?)
                .await?;
            let v: Value = serde_json::from_str(&body)?;
            Ok(if v["items"][0]["value"] == "2" {
                Observed::Ready(body)
            } else {
                Observed::NotYet(body)
            })
        },
    )
    .await?;
    let mut traces = Vec::new();
    for s in streams {
        traces.push(s.await??);
    }
    let tl = d.timeline_text(t0);
    for t in &traces {
        ensure!(
            t.status == 200 && t.complete() && t.tokens(None) == 80,
            "held stream: status {}, {} tokens, last events {:?} ({tl})",
            t.status,
            t.tokens(None),
            t.events.iter().rev().take(3).collect::<Vec<_>>()
        );
    }
    ensure!(
        d.timeline.first_after(t0, |s| s.ready >= 1).is_some(),
        "the backend never became ready ({tl})"
    );
    ensure!(
        d.timeline.max_desired() == 1,
        "demand 2 at target 2 scaled to {} replicas ({tl})",
        d.timeline.max_desired()
    );

    // Rotation: the Secret now holds only the new key. Both replicas take it (the kubelet
    // swaps the mounted file, the gateway re-reads it); no gateway pod restarts or is replaced.
    let rotated = Instant::now();
    d.ns.api::<Secret>()
        .patch(
            "stub-keys",
            &PatchParams::apply("hearth-e2e").force(),
            &Patch::Apply(json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "stub-keys"},
                "stringData": {"api-keys": format!("{NEW_KEY}\n")},
            })),
        )
        .await?;
    wait_until(
        "the new key accepted and the old one refused by both replicas",
        Duration::from_secs(240),
        || async {
            let mut seen = Vec::new();
            for ip in &ips {
                let base = if ip.contains(':') {
                    format!("http://[{ip}]:8080")
                } else {
                    format!("http://{ip}:8080")
                };
                seen.push((
                    models_status(&base, Some(NEW_KEY)).await?.0,
                    models_status(&base, Some(OLD_KEY)).await?.0,
                ));
            }
            Ok(if seen.iter().all(|s| *s == (200, 401)) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("(new, old) key status per replica: {seen:?}"))
            })
        },
    )
    .await?;
    let took = rotated.elapsed();
    let after = gateway_pods(&d).await?;
    for (name, (_, uid, restarts, _)) in &pods {
        let now = after
            .get(name)
            .with_context(|| format!("gateway pod {name} is gone after the rotation: {after:?}"))?;
        ensure!(
            now.1 == *uid && now.2 == *restarts,
            "gateway pod {name} was replaced or restarted: before uid {uid} restarts {restarts}, after {now:?}"
        );
    }
    ensure!(
        after.len() == 2,
        "gateway pods after the rotation: {after:?}"
    );
    let guarded = admin_port_is_guarded(&d, &ips).await?;
    println!("[push, 2 gateways] admin ports: {guarded}");
    println!(
        "[push, 2 gateways] /hearth/queue {totals:?}, KEDA {keda_value}, rotation effective after {:.1}s with no gateway restart; timeline: {tl}",
        took.as_secs_f64()
    );

    // Voluntary disruptions go through the PodDisruptionBudget (maxUnavailable 1): of two
    // evictions, one is granted and the other refused (429), and the Service keeps answering
    // through the replica that stays.
    let (first, second) = {
        let mut names = pods.keys();
        (
            names.next().context("a gateway pod")?.clone(),
            names.next().context("a second gateway pod")?.clone(),
        )
    };
    wait_until(
        "the PodDisruptionBudget allowing one disruption",
        Duration::from_secs(60),
        || async {
            let pdb =
                d.ns.api::<PodDisruptionBudget>()
                    .get(&format!("{SERVICE}-gateway"))
                    .await?;
            let allowed = pdb.status.as_ref().map(|s| s.disruptions_allowed);
            Ok(if allowed == Some(1) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("status {:?}", pdb.status))
            })
        },
    )
    .await?;
    // Both at once: the budget allows one, so exactly one is granted and the other refused.
    // (One after the other would race the replacement pod: a gateway is Ready within about two
    // seconds, and then the budget allows a disruption again, as it should.)
    // Without kube's default retry of 429, which would send the refused eviction again until
    // the replacement pod is Ready and the budget grants it.
    let pod_api: kube::Api<Pod> =
        kube::Api::namespaced(d.cluster.client_without_retries()?, d.ns.name());
    let params = EvictParams::default();
    let (a, b) = tokio::join!(
        pod_api.evict(&first, &params),
        pod_api.evict(&second, &params)
    );
    let (evicted, kept, refusal) = match (a, b) {
        (Ok(_), Err(kube::Error::Api(e))) => (&first, &second, e),
        (Err(kube::Error::Api(e)), Ok(_)) => (&second, &first, e),
        other => anyhow::bail!(
            "two evictions at once under maxUnavailable 1: not one granted and one refused: {other:?}"
        ),
    };
    ensure!(
        refusal.code == 429 && refusal.message.contains("disruption budget"),
        "the refused eviction of {kept}: {refusal:?}"
    );
    let auth = bearer(NEW_KEY);
    let served = client::chat_with_headers(
        &d.url,
        SERVICE,
        false,
        Some(4),
        &[("authorization", auth.as_str())],
        Duration::from_secs(60),
    )
    .await?;
    ensure!(
        served.status == 200,
        "a request during the eviction: status {}",
        served.status
    );
    let still = gateway_pods(&d).await?;
    ensure!(
        still.get(kept).is_some_and(|p| p.3),
        "the gateway pod {kept} that was not evicted is not Ready: {still:?}"
    );
    println!(
        "[push, 2 gateways] two evictions at once: {evicted} granted, {kept} refused (429, PodDisruptionBudget); a request served meanwhile"
    );
    Ok(())
}

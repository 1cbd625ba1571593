//! One OpenAI endpoint for many models, on the real node: an `LLMEndpoint` in one namespace
//! that admits a second by namespace selector, seven upstream stub services in three
//! namespaces, both scaler modes.
//!
//! - each cold model wakes from its own request, at the endpoint's URL, and only it wakes;
//! - a flood to one cold model (its queue full: 429s) leaves another cold model served;
//! - `/v1/models` lists every accepted model with its state, and a model's alias
//!   (`spec.model.aliases`) beside it; a cold model called by its alias wakes and answers;
//! - an unknown model gets OpenAI's 404 `model_not_found` at once;
//! - a second service claiming a model name is reported (`ModelNameConflict`, and in the
//!   endpoint's `status.conflicts`) and keeps its own gateway; a namespace the endpoint does not
//!   admit gets `NotAllowedByEndpoint`;
//! - a service leaving the endpoint gets its own gateway back, and the stream it had in flight
//!   through the endpoint completes;
//! - KEDA reaches the shared gateway's ExternalScaler over mutual TLS with its one certificate
//!   for the shared gateways (a ClusterTriggerAuthentication; refused: no certificate, plain
//!   text, a certificate of Hearth's CA for a service's own scaler);
//! - a plain Deployment annotated for Hearth joins with its model name in an annotation, is
//!   woken from zero through the endpoint, and taking the annotation away gives it back as it
//!   was (its ScaledObject gone, its replicas what they were).
//!
//! Devices: the real node has 4 `hearth.dev/fake-gpu`; at most 4 backends of this suite run at
//! once (the flood's target requests a resource no node has and never runs).

mod stack;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::stack::{self as hstack, ScalerMode};
use hearth_e2e_harness::{admin, client};
use hearth_test_support::{Cluster, Observed, TestNamespace, wait_until};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams};
use serde_json::{Value, json};

/// The endpoint's name (its client Service is named the same).
const ENDPOINT: &str = "models";
/// The label that admits a namespace to the endpoint (`allowedServices.namespaces.selector`).
const ADMIT_LABEL: &str = "e2e.hearth.dev/endpoint";

fn api(client: &kube::Client, ns: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
    let gvk = kube::api::GroupVersionKind::gvk("serving.hearth.dev", "v1alpha1", kind);
    Api::namespaced_with(
        client.clone(),
        ns,
        &ApiResource::from_gvk_with_plural(&gvk, plural),
    )
}

fn services(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    api(client, ns, "LLMService", "llmservices")
}

fn endpoints(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    api(client, ns, "LLMEndpoint", "llmendpoints")
}

/// The shared gateway's ExternalScaler over mutual TLS, probed from the host (a NetworkPolicy of
/// the suite's own admits it there): the push trigger of mistral (namespace `nb`) names the
/// chart's ClusterTriggerAuthentication, whose Secret in KEDA's namespace holds KEDA's
/// certificate for the shared gateways, with the digest of its record in the keys Secret as
/// `tlsDigest`; that material, and a certificate the test signs with Hearth's CA for the shared
/// name, get an HTTP/2 SETTINGS frame; no client certificate, plain text, or a certificate
/// signed the same way for a service's own scaler (`keda.mistral-scaler.<nb>`) get none. The gateway's serving certificate is the endpoint's Secret, its issuance recorded on
/// the gateway Deployment.
async fn shared_scaler_mutual_tls(
    client: &kube::Client,
    a: &TestNamespace,
    nb: &str,
) -> Result<()> {
    use k8s_openapi::api::apps::v1::Deployment;
    use k8s_openapi::api::core::v1::{Secret, Service};
    use stack::scaler_tls::{
        Material, RECORD, open_scaler_port_to_the_host, plain_h2, signed_by_the_scaler_ca,
    };
    let na = a.name();
    let so = Api::<DynamicObject>::namespaced_with(
        client.clone(),
        nb,
        &hearth_controller::render::scaled_object_resource(),
    )
    .get("mistral")
    .await?;
    let trigger = &so.data["spec"]["triggers"][0];
    let auth = &trigger["authenticationRef"];
    ensure!(
        auth["kind"] == "ClusterTriggerAuthentication",
        "mistral's push trigger does not authenticate through the shared ClusterTriggerAuthentication: {trigger}"
    );
    let cta = Api::<DynamicObject>::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &kube::api::GroupVersionKind::gvk(
                "keda.sh",
                "v1alpha1",
                "ClusterTriggerAuthentication",
            ),
            "clustertriggerauthentications",
        ),
    )
    .get(auth["name"].as_str().unwrap_or_default())
    .await?;
    let secret = cta.data["spec"]["secretTargetRef"][0]["name"]
        .as_str()
        .context("the ClusterTriggerAuthentication names no Secret")?
        .to_owned();
    let keda = Material::read(&Api::<Secret>::namespaced(client.clone(), "keda"), &secret).await?;
    let keys = Api::<Secret>::namespaced(client.clone(), "hearth-system")
        .get("hearth-controller-keys")
        .await?;
    let record: hearth_controller::scaler_tls::Record = serde_json::from_slice(
        &keys
            .data
            .as_ref()
            .and_then(|d| d.get("scaler-shared-client.record"))
            .context("the keys Secret has no record of KEDA's shared client certificate")?
            .0,
    )?;
    ensure!(
        trigger["metadata"]["tlsDigest"] == record.digest().as_str(),
        "mistral's tlsDigest is not the digest of KEDA's shared certificate {}: {trigger}",
        record.digest()
    );
    let gateway = Api::<Deployment>::namespaced(client.clone(), na)
        .get(&format!("{ENDPOINT}-gateway"))
        .await?;
    ensure!(
        gateway
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(RECORD)),
        "the shared gateway Deployment has no record of its serving certificate"
    );
    Api::<Secret>::namespaced(client.clone(), na)
        .get(&format!("{ENDPOINT}-scaler-tls"))
        .await
        .context("the shared gateway's serving certificate Secret")?;
    let ip = Api::<Service>::namespaced(client.clone(), na)
        .get(&format!("{ENDPOINT}-scaler"))
        .await?
        .spec
        .and_then(|s| s.cluster_ip)
        .context("the shared scaler Service has no ClusterIP")?;
    let addr = format!("{ip}:9090");
    let host = format!("{ENDPOINT}-scaler.{na}.svc");
    open_scaler_port_to_the_host(a, ENDPOINT, &addr).await?;
    ensure!(
        keda.probe(&addr, &host, true).await?,
        "KEDA's shared client certificate was refused by the shared ExternalScaler"
    );
    ensure!(
        !keda.probe(&addr, &host, false).await?,
        "a client without a certificate got an HTTP/2 answer from the shared ExternalScaler"
    );
    ensure!(
        !plain_h2(&addr).await?,
        "plain-text gRPC got an HTTP/2 answer from the shared ExternalScaler"
    );
    // Signed the same way, the shared name gets in and a service's own scaler name does not:
    // the refusal is the name's.
    let shared = hearth_controller::names::SHARED_SCALER_CLIENT;
    ensure!(
        signed_by_the_scaler_ca(client, shared, &keda)
            .await?
            .probe(&addr, &host, true)
            .await?,
        "a client certificate of Hearth's CA for {shared} was refused by the shared ExternalScaler"
    );
    let own = format!("keda.mistral-scaler.{nb}");
    ensure!(
        !signed_by_the_scaler_ca(client, &own, &keda)
            .await?
            .probe(&addr, &host, true)
            .await?,
        "a client certificate of Hearth's CA for {own} got into the shared ExternalScaler"
    );
    println!(
        "[shared endpoint] ExternalScaler over mutual TLS: KEDA's shared certificate taken, no certificate / plain text / {own} refused"
    );
    Ok(())
}

/// The upstream stub service renamed to `name` (its served model name) in `ns`, in scaler mode
/// `mode`, joining the endpoint in `endpoint_ns`.
/// The alias mistral answers to on the endpoint (`spec.model.aliases`).
const MISTRAL_ALIAS: &str = "mistralai/Mistral-7B-Instruct-v0.3";

fn member(ns: &str, name: &str, mode: ScalerMode, endpoint_ns: &str) -> Result<Value> {
    let mut o = hstack::stub_service(ns, mode)?;
    o["metadata"]["name"] = Value::from(name);
    o["spec"]["endpoint"]["sharedEndpointRef"] =
        json!({"name": ENDPOINT, "namespace": endpoint_ns});
    Ok(o)
}

/// A plain Deployment of the stub engine serving `model`, at `replicas: 0` (as its team left
/// it), annotated for the webhook (the stub runtime) and for the endpoint.
fn plain_deployment(ns: &str, model: &str, endpoint_ns: &str) -> Value {
    json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": model, "namespace": ns, "annotations": {
            "serving.hearth.dev/runtime": "vllm-stub",
            "serving.hearth.dev/endpoint": format!("{endpoint_ns}/{ENDPOINT}"),
            "serving.hearth.dev/model": model,
        }},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": model}},
            "template": {
                "metadata": {"labels": {"app": model}},
                "spec": {"containers": [{
                    "name": "vllm",
                    "image": "hearth.dev/vllm-stub:e2e",
                    "args": ["--model=/models/stub", format!("--served-model-name={model}")],
                    "ports": [{"name": "http", "containerPort": 8000}],
                }]},
            },
        },
    })
}

async fn label_namespace(client: &kube::Client, ns: &TestNamespace) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    api.patch(
        ns.name(),
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {ADMIT_LABEL: "models"}}})),
    )
    .await
    .with_context(|| format!("labelling namespace {}", ns.name()))?;
    Ok(())
}

/// The `EndpointAccepted` condition of LLMService `ns/name`: (status, reason, message).
async fn accepted(
    client: &kube::Client,
    ns: &str,
    name: &str,
) -> Result<Option<(String, String, String)>> {
    let svc = services(client, ns).get(name).await?;
    Ok(svc.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "EndpointAccepted")
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (s("status"), s("reason"), s("message"))
        }))
}

async fn wait_accepted(
    client: &kube::Client,
    ns: &str,
    name: &str,
    reason: &str,
) -> Result<String> {
    wait_until(
        format!("LLMService {ns}/{name} EndpointAccepted reason {reason}"),
        Duration::from_secs(90),
        || async {
            Ok(match accepted(client, ns, name).await? {
                Some((_, r, m)) if r == reason => Observed::Ready(m),
                other => Observed::NotYet(format!("{other:?}")),
            })
        },
    )
    .await
}

/// `GET <url>/v1/models` parsed: model id → its entry.
async fn models(url: &str) -> Result<serde_json::Map<String, Value>> {
    let (status, body) = client::get(&format!("{url}/v1/models"), Duration::from_secs(10)).await?;
    ensure!(status == 200, "/v1/models answered {status}: {body}");
    let v: Value = serde_json::from_str(&body).with_context(|| format!("/v1/models: {body}"))?;
    ensure!(v["object"] == "list", "/v1/models is not a list: {body}");
    Ok(v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| Some((m["id"].as_str()?.to_owned(), m.clone())))
        .collect())
}

fn state(entry: &Value) -> &str {
    entry["hearth"]["state"].as_str().unwrap_or("?")
}

/// Desired replicas of `ns/name`'s backend Deployment.
async fn desired(client: &kube::Client, ns: &str, name: &str) -> Result<i32> {
    let api: Api<k8s_openapi::api::apps::v1::Deployment> = Api::namespaced(client.clone(), ns);
    Ok(api
        .get_opt(name)
        .await?
        .and_then(|d| d.spec)
        .and_then(|s| s.replicas)
        .unwrap_or(0))
}

async fn chat_ok(url: &str, model: &str, stream: bool) -> Result<client::Trace> {
    let t = client::chat(url, model, stream, Duration::from_secs(150)).await?;
    ensure!(
        t.status == 200,
        "{model} at {url} answered {}: {}",
        t.status,
        t.body
    );
    if stream {
        ensure!(t.complete(), "{model}: stream incomplete: {:?}", t.events);
    }
    Ok(t)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_endpoint_routes_wakes_and_isolates_many_models() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    hstack::install_stub_runtime(&client).await?;
    // The flood's target: a copy of the stub runtime whose accelerator no node has, so its
    // model stays cold and its queue fills.
    let mut rt = hstack::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    let absent = format!("vllm-stub-absent-ep-{}", std::process::id());
    rt["metadata"]["name"] = Value::from(absent.clone());
    rt["spec"]["accelerator"]["resourceName"] = Value::from("hearth.dev/absent-accelerator");
    hstack::apply(&client, rt, None).await?;
    let result = run(&cluster, &absent).await;
    let _ = hstack::inference_runtimes(&client)
        .delete(&absent, &DeleteParams::default())
        .await;
    result
}

async fn run(cluster: &Cluster, absent_runtime: &str) -> Result<()> {
    let client = cluster.client();
    let a = cluster.namespace("e2e-ep-a").await?;
    let b = cluster.namespace("e2e-ep-b").await?;
    let c = cluster.namespace("e2e-ep-c").await?;
    label_namespace(&client, &a).await?;
    label_namespace(&client, &b).await?;
    let (na, nb, nc) = (a.name(), b.name(), c.name());

    hstack::apply(
        &client,
        json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMEndpoint",
            "metadata": {"name": ENDPOINT, "namespace": na},
            "spec": {"allowedServices": {"namespaces": {
                "from": "Selector",
                "selector": {"matchLabels": {ADMIT_LABEL: "models"}},
            }}},
        }),
        None,
    )
    .await?;

    // Namespace A: two cold models in both scaler modes (one in reject mode), and the
    // flood's target. Namespace B: two more, and a second claim on `qwen-chat` made later.
    // Namespace C is not admitted.
    let mut stuck = member(na, "stuck-model", ScalerMode::Poll, na)?;
    stuck["spec"]["runtime"]["name"] = Value::from(absent_runtime);
    stuck["spec"]["scaling"]["activationTimeout"] = Value::from("90s");
    let mut tools = member(na, "llama-tools", ScalerMode::Poll, na)?;
    tools["spec"]["endpoint"]["coldStart"]["mode"] = Value::from("reject");
    // mistral answers to its hub id too, and is woken by it.
    let mut mistral = member(nb, "mistral", ScalerMode::Push, na)?;
    mistral["spec"]["model"]["aliases"] = json!([MISTRAL_ALIAS]);
    for o in [
        member(na, "qwen-chat", ScalerMode::Push, na)?,
        tools,
        stuck,
        mistral,
        member(nb, "phi", ScalerMode::Poll, na)?,
    ] {
        hstack::apply(&client, o, None).await?;
    }
    for (ns, name) in [
        (na, "qwen-chat"),
        (na, "llama-tools"),
        (na, "stuck-model"),
        (nb, "mistral"),
        (nb, "phi"),
    ] {
        wait_accepted(&client, ns, name, "Accepted").await?;
    }
    hstack::apply(&client, plain_deployment(nb, "plain-stub", na), None).await?;
    // Made after the holder: the older service keeps the name.
    hstack::apply(
        &client,
        member(nb, "qwen-chat", ScalerMode::Push, na)?,
        None,
    )
    .await?;
    hstack::apply(&client, member(nc, "gemma", ScalerMode::Poll, na)?, None).await?;
    let conflict = wait_accepted(&client, nb, "qwen-chat", "ModelNameConflict").await?;
    ensure!(
        conflict.contains(na),
        "the conflict message does not name the holder's namespace {na}: {conflict}"
    );
    let refused = wait_accepted(&client, nc, "gemma", "NotAllowedByEndpoint").await?;
    println!("conflict: {conflict}\nnot allowed: {refused}");

    // The endpoint's status: six models (one a plain Deployment), two services not accepted.
    let ep = wait_until(
        format!("LLMEndpoint {na}/{ENDPOINT} lists 6 models and 2 conflicts"),
        Duration::from_secs(60),
        || async {
            let ep = endpoints(&client, na).get(ENDPOINT).await?;
            let models = ep.data["status"]["models"].as_array().map_or(0, Vec::len);
            let conflicts = ep.data["status"]["conflicts"]
                .as_array()
                .map_or(0, Vec::len);
            Ok(if models == 6 && conflicts == 2 {
                Observed::Ready(ep)
            } else {
                Observed::NotYet(format!(
                    "{} models, {} conflicts: {}",
                    models, conflicts, ep.data["status"]
                ))
            })
        },
    )
    .await?;
    let reasons: Vec<&str> = ep.data["status"]["conflicts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|c| c["reason"].as_str())
        .collect();
    ensure!(
        reasons.contains(&"ModelNameConflict") && reasons.contains(&"NotAllowedByEndpoint"),
        "endpoint conflicts: {}",
        ep.data["status"]["conflicts"]
    );

    // The services not accepted keep their own gateways; the accepted ones have none.
    stack::wait_service_url(&client, nb, "qwen-chat").await?;
    stack::wait_service_url(&client, nc, "gemma").await?;
    let own: Api<k8s_openapi::api::core::v1::Service> = Api::namespaced(client.clone(), na);
    wait_until(
        "no own gateway Service for the accepted qwen-chat",
        Duration::from_secs(60),
        || async {
            Ok(match own.get_opt("qwen-chat").await? {
                None => Observed::Ready(()),
                Some(_) => Observed::NotYet("Service qwen-chat exists".into()),
            })
        },
    )
    .await?;

    let url = stack::wait_service_url(&client, na, ENDPOINT).await?;
    ensure!(
        hstack::wait_reachable(&url, Duration::from_secs(90)).await,
        "the endpoint {url} never accepted a connection"
    );
    // The gateway has read its routes once /v1/models lists them all.
    let listed = wait_until(
        "/v1/models lists the 6 accepted models and mistral's alias, all at zero",
        Duration::from_secs(60),
        || async {
            let m = models(&url).await?;
            Ok(if m.len() == 7 && m.values().all(|e| state(e) == "zero") {
                Observed::Ready(m)
            } else {
                Observed::NotYet(format!("{m:?}"))
            })
        },
    )
    .await?;
    for id in [
        "qwen-chat",
        "llama-tools",
        "stuck-model",
        "mistral",
        "phi",
        "plain-stub",
        MISTRAL_ALIAS,
    ] {
        ensure!(listed.contains_key(id), "/v1/models lacks {id}: {listed:?}");
    }

    // An unknown model: 404 model_not_found, at once.
    let t = client::chat(&url, "no-such-model", false, Duration::from_secs(10)).await?;
    ensure!(
        t.status == 404 && t.body.contains("model_not_found"),
        "unknown model answered {}: {}",
        t.status,
        t.body
    );
    ensure!(
        t.end - t.sent < Duration::from_secs(1),
        "the 404 took {:?}",
        t.end - t.sent
    );

    // The flood: 100 held requests fill stuck-model's queue (maxQueue 100 for target 1, max
    // 2), 20 more get 429; meanwhile qwen-chat, cold too, wakes and serves.
    let mut held = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let url = url.clone();
        held.spawn(async move {
            client::chat(&url, "stuck-model", false, Duration::from_secs(120)).await
        });
    }
    let stuck_key = format!("{na}/stuck-model");
    wait_until(
        "stuck-model's queue holds 100",
        Duration::from_secs(30),
        || async {
            let (s, body) = admin::get_owner(
                &client,
                na,
                ENDPOINT,
                &format!("/hearth/queue/{stuck_key}/local"),
                Duration::from_secs(5),
            )
            .await?;
            let pending = serde_json::from_str::<Value>(&body)
                .ok()
                .and_then(|v| v["pending"].as_u64());
            Ok(if s == 200 && pending == Some(100) {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{s} {body}"))
            })
        },
    )
    .await?;
    let flood_start = Instant::now();
    let (over, woke) = tokio::join!(
        async {
            let mut over = Vec::new();
            for _ in 0..20 {
                over.push(client::chat(&url, "stuck-model", false, Duration::from_secs(10)).await);
            }
            over
        },
        chat_ok(&url, "qwen-chat", true),
    );
    let rejected = over
        .iter()
        .filter(|t| t.as_ref().is_ok_and(|t| t.status == 429))
        .count();
    ensure!(
        rejected == 20,
        "of 20 requests beyond stuck-model's queue, {rejected} got 429: {:?}",
        over.iter()
            .map(|t| t.as_ref().map(|t| t.status).map_err(|e| e.to_string()))
            .collect::<Vec<_>>()
    );
    let woke = woke.context("qwen-chat during stuck-model's flood")?;
    println!(
        "flood: 100 held + 20 × 429 for stuck-model; qwen-chat woke from zero and streamed in {:.1}s",
        (woke.end - flood_start).as_secs_f64()
    );
    held.abort_all();
    ensure!(
        desired(&client, nb, "mistral").await? == 0 && desired(&client, nb, "phi").await? == 0,
        "a model nobody asked for was woken"
    );

    // Each other cold model wakes from its own request: push (mistral), poll (phi), and reject
    // mode (llama-tools: 503 with Retry-After, then served).
    let t = client::chat(&url, "llama-tools", false, Duration::from_secs(10)).await?;
    ensure!(
        t.status == 503 && t.retry_after.is_some(),
        "cold llama-tools in reject mode answered {} ({:?})",
        t.status,
        t.retry_after
    );
    // mistral is called by its alias: the stub engine serves only "mistral", so an answer
    // shows the gateway forwarded the request under the service's name.
    let (m, p) = tokio::join!(
        chat_ok(&url, MISTRAL_ALIAS, true),
        chat_ok(&url, "phi", false)
    );
    m?;
    p?;
    wait_until(
        "llama-tools served after its 503",
        Duration::from_secs(120),
        || async {
            let t = client::chat(&url, "llama-tools", false, Duration::from_secs(30)).await?;
            Ok(if t.status == 200 {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{}", t.status))
            })
        },
    )
    .await?;
    let now = models(&url).await?;
    for id in ["qwen-chat", "llama-tools", "mistral", "phi"] {
        ensure!(
            now.get(id).map(state) == Some("ready"),
            "{id} is not ready in /v1/models: {now:?}"
        );
    }
    ensure!(
        now.get("stuck-model").map(state) == Some("activating"),
        "stuck-model should be activating: {now:?}"
    );
    // mistral (push, namespace B) woke through the shared gateway's ExternalScaler, which takes
    // only KEDA's certificate for the shared gateways. (After the check above: the stuck
    // model's activation times out after 90 s.)
    shared_scaler_mutual_tls(&client, &a, nb).await?;

    // phi leaves the endpoint while a stream is in flight through it.
    let in_flight = {
        let url = url.clone();
        tokio::spawn(async move {
            client::chat_with(&url, "phi", true, Some(40), Duration::from_secs(60)).await
        })
    };
    // The stream is admitted (in flight through the endpoint) before phi leaves.
    let phi_queue = format!("/hearth/queue/{nb}/phi/local");
    wait_until(
        "phi's stream in flight through the endpoint",
        Duration::from_secs(10),
        || async {
            let (s, body) =
                admin::get_owner(&client, na, ENDPOINT, &phi_queue, Duration::from_secs(5)).await?;
            let pending = serde_json::from_str::<Value>(&body)
                .ok()
                .and_then(|v| v["pending"].as_u64());
            Ok(match pending {
                Some(n) if s == 200 && n >= 1 => Observed::Ready(()),
                _ => Observed::NotYet(format!("{s} {body}")),
            })
        },
    )
    .await?;
    services(&client, nb)
        .patch(
            "phi",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"endpoint": {"sharedEndpointRef": null}}})),
        )
        .await?;
    let own_url = stack::wait_service_url(&client, nb, "phi").await?;
    ensure!(
        hstack::wait_reachable(&own_url, Duration::from_secs(90)).await,
        "phi's own gateway {own_url} never accepted a connection"
    );
    let flight = in_flight.await??;
    ensure!(
        flight.status == 200 && flight.complete(),
        "the stream in flight when phi left: {} {:?}",
        flight.status,
        flight.events
    );
    chat_ok(&own_url, "phi", true).await?;
    wait_until(
        "/v1/models without phi",
        Duration::from_secs(60),
        || async {
            let m = models(&url).await?;
            Ok(if m.contains_key("phi") {
                Observed::NotYet(format!("{m:?}"))
            } else {
                Observed::Ready(())
            })
        },
    )
    .await?;
    println!("phi left: its own gateway serves at {own_url}; the stream in flight completed");

    // The plain Deployment wakes from zero through the endpoint (held until a device is free:
    // four of this suite's backends may hold the node's four), then leaves.
    let woke = chat_ok(&url, "plain-stub", true).await?;
    println!(
        "plain-stub (a plain Deployment) woke from zero and streamed in {:.1}s",
        (woke.end - woke.sent).as_secs_f64()
    );
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(client.clone(), nb);
    deployments
        .patch(
            "plain-stub",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"serving.hearth.dev/endpoint": null}}}),
            ),
        )
        .await?;
    let scaled_objects = hstack::scaled_objects(&client, nb);
    wait_until(
        "plain-stub given back: no ScaledObject, 0 replicas as before, not on /v1/models",
        Duration::from_secs(120),
        || async {
            let sos = scaled_objects.list(&Default::default()).await?;
            let left: Vec<String> = sos
                .items
                .iter()
                .filter(|o| o.data["spec"]["scaleTargetRef"]["name"].as_str() == Some("plain-stub"))
                .map(|o| o.metadata.name.clone().unwrap_or_default())
                .collect();
            let replicas = desired(&client, nb, "plain-stub").await?;
            let listed = models(&url).await?.contains_key("plain-stub");
            Ok(if left.is_empty() && replicas == 0 && !listed {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!(
                    "ScaledObjects {left:?}, replicas {replicas}, listed {listed}"
                ))
            })
        },
    )
    .await?;
    Ok(())
}

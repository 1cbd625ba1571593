//! `hearth-demo`, run by `tests/demo` (`make demo`) on a cluster from `tests/cluster/up`:
//! installs Hearth with its Helm chart (`tests/cluster/install-hearth`: the images of
//! `build/images`, imported into the real node), applies the quickstart runtime and model of
//! `examples/quickstart/` (once per KEDA scaler mode, each in its own namespace), and prints the
//! timeline of a cold streaming request in each mode: the request, KEDA's 0 → 1, the backend pod
//! scheduled, started and Ready on the real node, the tokens, and the way back to 0.

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use hearth_e2e_harness::client::{self, Trace};
use hearth_e2e_harness::stack::{self, ScalerMode};
use hearth_e2e_harness::timeline::{PodTimeline, Timeline};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ApiResource, DynamicObject, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use kube::{Api, Client, Config};

/// The quickstart LLMService's name (examples/quickstart/llmservice.yaml).
const SVC: &str = "quickstart";
/// Its backend Deployment.
const BACKEND: &str = "quickstart";

fn log(msg: impl AsRef<str>) {
    eprintln!("[demo] {}", msg.as_ref());
}

#[tokio::main]
async fn main() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kubeconfig = std::path::PathBuf::from(
        std::env::var_os("KUBECONFIG").context("KUBECONFIG is unset: run through tests/demo")?,
    );
    let state = kubeconfig
        .parent()
        .context("kubeconfig has no parent dir")?
        .to_path_buf();
    let kc = Kubeconfig::read_from(&kubeconfig)?;
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await?;
    let client = Client::try_from(config)?;

    log(
        "installing Hearth with its Helm chart (tests/cluster/install-hearth: images from build/images, webhook and controller as pods on the real node)",
    );
    let install = Instant::now();
    if !stack::ensure_hearth(&client, &kubeconfig).await? {
        log("Hearth was already installed with these images (helm release hearth-system/hearth)");
    } else {
        log(format!(
            "helm install to a ready webhook and controller: {:.1}s (log {}/logs/install-hearth.log)",
            install.elapsed().as_secs_f64(),
            state.display()
        ));
    }
    let examples = stack::examples_dir().join("quickstart");
    log("applying examples/quickstart/runtime.yaml (InferenceRuntime quickstart-stub)");
    stack::apply_file(&client, &examples.join("runtime.yaml"), None).await?;

    // Poll mode: the example as written (namespace hearth-demo). Push mode: the same manifest in
    // its own namespace with the scaler annotation, so each mode's cold start is a first
    // activation.
    let service = stack::first_manifest(&examples.join("llmservice.yaml"))?;
    for mode in [ScalerMode::Poll, ScalerMode::Push] {
        let ns = ns_of(mode);
        log(format!(
            "applying examples/quickstart/llmservice.yaml as {ns}/{SVC} ({} mode)",
            mode.annotation()
        ));
        ensure_namespace(&client, ns).await?;
        let mut obj = service.clone();
        obj["metadata"]["namespace"] = serde_json::Value::from(ns);
        mode.annotate(&mut obj);
        stack::apply(&client, obj, None).await?;
    }
    let mut rows = Vec::new();
    let mut url = String::new();
    for mode in [ScalerMode::Poll, ScalerMode::Push] {
        wait_scaled_to_zero(&client, mode).await?;
        wait_gateway(&client, mode).await?;
        let u = stack::service_url(&client, ns_of(mode), SVC).await?;
        if !stack::wait_reachable(&u, Duration::from_secs(60)).await {
            bail!(
                "{u} (Service {}/{SVC}) never accepted a connection from this host",
                ns_of(mode)
            );
        }
        rows.push(cold_request(&client, &u, mode).await?);
        if mode == ScalerMode::Poll {
            url = u;
        }
    }

    println!();
    println!("Cold activation, both scaler modes, this run (seconds after the request was sent):");
    println!();
    println!(
        "| mode | scaled 0 → 1 | pod scheduled | container started | pod Ready | first token | last token | back to 0 | pod gone |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    println!();
    println!(
        "Hearth is running. Talk to the model from this host, through the gateway Service's ClusterIP (the host routes the Service range into the node, where kube-proxy forwards it):"
    );
    println!(
        "  curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{SVC}\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'"
    );
    println!(
        "  export KUBECONFIG={} PATH={}/bin:$PATH; kubectl get llmservice,pods -A -w",
        kubeconfig.display(),
        state.display()
    );
    println!(
        "Logs: kubectl -n hearth-system logs deploy/hearth-controller (and deploy/hearth-webhook), {}/logs/  Stop everything: tests/cluster/down",
        state.display()
    );
    Ok(())
}

async fn ensure_namespace(client: &Client, name: &str) -> Result<()> {
    let api: Api<Namespace> = Api::all(client.clone());
    if api.get_opt(name).await?.is_none() {
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        api.create(&PostParams::default(), &ns).await?;
    }
    Ok(())
}

/// The namespace of each mode's copy of the quickstart service.
fn ns_of(mode: ScalerMode) -> &'static str {
    match mode {
        ScalerMode::Poll => "hearth-demo",
        ScalerMode::Push => "hearth-demo-push",
    }
}

async fn wait_scaled_to_zero(client: &Client, mode: ScalerMode) -> Result<()> {
    let trigger = mode.trigger();
    let so: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        ns_of(mode),
        &ApiResource::from_gvk(&GroupVersionKind::gvk(
            "keda.sh",
            "v1alpha1",
            "ScaledObject",
        )),
    );
    log(format!(
        "[{}] waiting for phase ScaledToZero and the {trigger} trigger",
        mode.annotation()
    ));
    let start = Instant::now();
    loop {
        let phase = stack::phase(client, ns_of(mode), SVC).await?;
        let t = so
            .get_opt(SVC)
            .await?
            .map(|o| o.data["spec"]["triggers"][0]["type"].clone());
        if phase.as_deref() == Some("ScaledToZero")
            && t.as_ref().and_then(|t| t.as_str()) == Some(trigger)
        {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(240) {
            bail!(
                "LLMService {}/{SVC} not ScaledToZero with the {trigger} trigger after 240 s (phase {phase:?}, trigger {t:?})",
                ns_of(mode)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn wait_gateway(client: &Client, mode: ScalerMode) -> Result<()> {
    let ns = ns_of(mode);
    let api: Api<EndpointSlice> = Api::namespaced(client.clone(), ns);
    let lp = ListParams::default().labels(&format!("kubernetes.io/service-name={SVC}"));
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let gw = ListParams::default().labels(stack::GATEWAY_PODS);
    let start = Instant::now();
    loop {
        let ready = api
            .list(&lp)
            .await?
            .items
            .iter()
            .flat_map(|s| &s.endpoints)
            .any(|e| e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(false));
        // A scaler-mode switch re-renders the gateway: wait until the rollout is over, so the
        // request does not land on a replica being replaced.
        let gws = pods.list(&gw).await?.items;
        let settled = gws.len() == 1 && gws[0].metadata.deletion_timestamp.is_none();
        if ready && settled {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(180) {
            bail!("the gateway of {ns}/{SVC} has no ready endpoint after 180 s");
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

fn wall(t: Instant, base_i: Instant, base_w: SystemTime) -> String {
    let w = base_w + t.saturating_duration_since(base_i);
    let ts = k8s_openapi::jiff::Timestamp::try_from(w)
        .map(|t| t.to_string())
        .unwrap_or_default();
    // HH:MM:SS.mmm
    ts.get(11..23).unwrap_or(&ts).to_string()
}

async fn cold_request(client: &Client, url: &str, mode: ScalerMode) -> Result<String> {
    let m = mode.annotation();
    let tl = Timeline::start(client.clone(), ns_of(mode), BACKEND);
    let pod_tl = PodTimeline::start(client.clone(), ns_of(mode), &stack::backend_pods(SVC));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let base_w = SystemTime::now();
    let base_i = Instant::now();
    log(format!(
        "[{m}] sending a cold streaming chat completion to {url}"
    ));
    let trace: Trace = client::chat(url, SVC, true, Duration::from_secs(300)).await?;
    if trace.status != 200 || !trace.complete() {
        bail!(
            "[{m}] the cold request failed: status {}, events {:?}",
            trace.status,
            trace.events
        );
    }
    let t0 = trace.sent;
    let scaled = tl.first_after(t0, |s| s.desired >= 1);
    let ready = tl.first_after(t0, |s| s.ready >= 1);
    let first = trace.first_token();
    let pod = pod_tl.first_after(t0).unwrap_or_default();
    let last = trace.last_token();
    log(format!(
        "[{m}] answered; waiting for the backend to go back to 0 (idle; scaleDownStabilization 15s)"
    ));
    let start = Instant::now();
    let zero = loop {
        if let Some(z) = tl.first_after(trace.end, |s| s.desired == 0 && s.ready == 0) {
            break Some(z);
        }
        if start.elapsed() > Duration::from_secs(240) {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // The idle pod leaves once its preStop drain (the hearth-drain sidecar) has seen the engine
    // idle for the settle time, not after the whole drainTimeout.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns_of(mode));
    let lp = ListParams::default().labels(&stack::backend_pods(SVC));
    let gone = match zero {
        None => None,
        Some(_) => loop {
            if pods.list(&lp).await?.items.is_empty() {
                break Some(Instant::now());
            }
            if start.elapsed() > Duration::from_secs(300) {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        },
    };
    let rel = |t: Option<Instant>| {
        t.map(|t| format!("{:.2}", t.saturating_duration_since(t0).as_secs_f64()))
            .unwrap_or_else(|| "-".into())
    };
    let at = |t: Option<Instant>| {
        t.map(|t| wall(t, base_i, base_w))
            .unwrap_or_else(|| "-".into())
    };
    println!();
    println!(
        "Timeline [{m} mode: {}]",
        match mode {
            ScalerMode::Poll => "KEDA metrics-api polls /hearth/queue on each gateway endpoint",
            ScalerMode::Push => "KEDA external-push, the gateway's ExternalScaler streams demand",
        }
    );
    println!("  {}  +0.00s  request sent (stream: true)", at(Some(t0)));
    println!(
        "  {}  +{}s  scaled 0 → 1 (Deployment spec.replicas)",
        at(scaled),
        rel(scaled)
    );
    println!(
        "  {}  +{}s  backend pod {} scheduled to a node",
        at(pod.scheduled),
        rel(pod.scheduled),
        pod.name
    );
    println!(
        "  {}  +{}s  its containers started (the kubelet ran them)",
        at(pod.started),
        rel(pod.started)
    );
    println!(
        "  {}  +{}s  pod Ready (readiness probe on /health); Deployment ready {}s",
        at(pod.ready),
        rel(pod.ready),
        rel(ready)
    );
    println!(
        "  {}  +{}s  first token ({} SSE heartbeats before it)",
        at(first),
        rel(first),
        trace.heartbeats()
    );
    println!(
        "  {}  +{}s  last token; 200, [DONE]: \"{}\"",
        at(last),
        rel(last),
        trace.text().trim()
    );
    println!("  {}  +{}s  back to 0", at(zero), rel(zero));
    println!(
        "  {}  +{}s  backend pod gone (preStop drain ended)",
        at(gone),
        rel(gone)
    );
    Ok(format!(
        "| {m} | {} | {} | {} | {} | {} | {} | {} | {} |",
        rel(scaled),
        rel(pod.scheduled),
        rel(pod.started),
        rel(pod.ready),
        rel(first),
        rel(last),
        rel(zero),
        rel(gone)
    ))
}

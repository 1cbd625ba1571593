//! `hearth-demo`, run by `tests/demo` (`make demo`) on a cluster from `tests/cluster/up`:
//! installs Hearth as local processes (CRDs, `hearth-webhook` with its embedded built-in
//! policies, `hearth-controller`), starts the pod runner, applies the upstream stub runtime and
//! service unchanged, and prints the timeline of a cold streaming request in each scaler mode.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail};
use hearth_pod_runner::client::{self, Trace};
use hearth_pod_runner::stack::{self, ScalerMode};
use hearth_pod_runner::timeline::Timeline;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{ApiResource, DynamicObject, ListParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::GroupVersionKind;
use kube::{Api, Client, Config};

const NS: &str = "hearth-e2e";
const SVC: &str = "stub-svc";
const HEARTH_NS: &str = "hearth-system";

fn log(msg: impl AsRef<str>) {
    eprintln!("[demo] {}", msg.as_ref());
}

#[tokio::main]
async fn main() -> Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kubeconfig = PathBuf::from(
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
        "the pod runner (the test kubelet for gateway and stub pods): using the one tests/cluster/up started, or starting it",
    );
    stack::ensure_runner(&kubeconfig).await?;
    log("installing Hearth: CRDs, webhook (built-in policies embedded), controller");
    stack::install_crds(&client).await?;
    ensure_namespace(&client, HEARTH_NS).await?;
    let webhook_ip = webhook_ip(&state)?;
    start_webhook(&kubeconfig, &state, &webhook_ip).await?;
    stack::install_stub_runtime(&client).await?;
    start_daemon(
        &state,
        "hearth-controller",
        &[
            "run",
            "--leader-elect=false",
            "--metrics-addr=127.0.0.1:0",
            &format!("--gateway-image={}", hearth_pod_runner::GATEWAY_IMAGE),
        ],
        &kubeconfig,
    )?;

    // Poll mode: the upstream service exactly as published (namespace hearth-e2e). Push mode:
    // the same manifest in its own namespace with the scaler annotation, so each mode's cold
    // start is a first activation.
    for mode in [ScalerMode::Poll, ScalerMode::Push] {
        let ns = ns_of(mode);
        log(format!(
            "applying the upstream stub service as {ns}/{SVC} ({} mode)",
            mode.annotation()
        ));
        ensure_namespace(&client, ns).await?;
        apply_retrying(&client, stack::stub_service(ns, mode)?).await?;
    }
    let mut rows = Vec::new();
    for mode in [ScalerMode::Poll, ScalerMode::Push] {
        let url = format!("http://{SVC}.{}.svc", ns_of(mode));
        wait_scaled_to_zero(&client, mode).await?;
        wait_gateway(&client, mode).await?;
        rows.push(cold_request(&client, &url, mode).await?);
    }
    let url = format!("http://{SVC}.{NS}.svc");

    println!();
    println!("Cold activation, both scaler modes, this run (seconds after the request was sent):");
    println!();
    println!(
        "| mode | scaled 0 → 1 | pod ready | first token | last token | back to 0 | pod gone |"
    );
    println!("|---|---|---|---|---|---|---|");
    for r in &rows {
        println!("{r}");
    }
    println!();
    println!("Hearth is running. Talk to the model (the pod runner resolves Service names here):");
    println!(
        "  curl -N {url}/v1/chat/completions -H 'content-type: application/json' \\\n    -d '{{\"model\":\"{SVC}\",\"stream\":true,\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'"
    );
    println!(
        "  export KUBECONFIG={} PATH={}/bin:$PATH; kubectl get llmservice,pods -A -w",
        kubeconfig.display(),
        state.display()
    );
    println!(
        "Logs: {}/logs/  Stop everything: tests/cluster/down",
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

/// `127.X.0.11`: the first address the cluster's README leaves free for Hearth's processes, in
/// the control plane's loopback /16 (`CONTROL_PLANE_NET` in `<state>/node.env`, from `up`).
fn webhook_ip(state: &Path) -> Result<String> {
    let path = state.join("node.env");
    let env = std::fs::read_to_string(&path)
        .with_context(|| format!("reading {} (written by tests/cluster/up)", path.display()))?;
    let Some(net) = env
        .lines()
        .find_map(|l| l.strip_prefix("CONTROL_PLANE_NET="))
    else {
        bail!("{} has no CONTROL_PLANE_NET", path.display());
    };
    Ok(format!("{net}.0.11"))
}

/// Starts `bin` detached in its own process group with a PID file in `<state>/hearth/`, which
/// `tests/cluster/down` stops; a running one is kept.
fn start_daemon(state: &Path, bin: &str, args: &[&str], kubeconfig: &Path) -> Result<()> {
    let dir = state.join("hearth");
    std::fs::create_dir_all(&dir)?;
    let pid_file = dir.join(format!("{bin}.pid"));
    if let Ok(pid) = std::fs::read_to_string(&pid_file)
        && std::fs::read_link(format!("/proc/{}/exe", pid.trim()))
            .is_ok_and(|e| e.to_string_lossy().contains(bin))
    {
        log(format!("{bin} already runs (pid {})", pid.trim()));
        return Ok(());
    }
    let path = stack::binary(bin)?;
    let logs = state.join("logs");
    std::fs::create_dir_all(&logs)?;
    let out = File::create(logs.join(format!("{bin}.log")))?;
    let child = std::process::Command::new(&path)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {}", path.display()))?;
    std::fs::write(&pid_file, format!("{}\n", child.id()))?;
    log(format!(
        "{bin} started (pid {}, log {}/logs/{bin}.log)",
        child.id(),
        state.display()
    ));
    Ok(())
}

async fn start_webhook(kubeconfig: &Path, state: &Path, ip: &str) -> Result<()> {
    let listen = format!("{ip}:8443");
    // Register by URL first: the self-managed webhook publishes its CA into the existing
    // configurations at start and keeps it current.
    let out = std::process::Command::new(stack::binary("hearth-webhook")?)
        .args([
            "configurations",
            &format!("--namespace={HEARTH_NS}"),
            &format!("--url=https://{listen}"),
        ])
        .output()?;
    if !out.status.success() {
        bail!(
            "hearth-webhook configurations failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let client = Client::try_from(
        Config::from_custom_kubeconfig(
            Kubeconfig::read_from(kubeconfig)?,
            &KubeConfigOptions::default(),
        )
        .await?,
    )?;
    let docs = stack::parse_manifests(&String::from_utf8_lossy(&out.stdout))
        .map_err(|e| anyhow::anyhow!("hearth-webhook configurations output: {e}"))?;
    for v in docs {
        stack::apply(&client, v, None).await?;
    }
    start_daemon(
        state,
        "hearth-webhook",
        &[
            &format!("--listen={listen}"),
            "--self-managed",
            &format!("--namespace={HEARTH_NS}"),
            &format!("--extra-san={ip}"),
        ],
        kubeconfig,
    )?;
    let start = Instant::now();
    while tokio::net::TcpStream::connect(&listen).await.is_err() {
        if start.elapsed() > Duration::from_secs(30) {
            bail!(
                "hearth-webhook does not listen on {listen}; see {}/logs/hearth-webhook.log",
                state.display()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Applies, retrying while the webhook's caBundle is being published.
async fn apply_retrying(client: &Client, obj: serde_json::Value) -> Result<()> {
    let start = Instant::now();
    loop {
        match stack::apply(client, obj.clone(), None).await {
            Ok(_) => return Ok(()),
            Err(e) if start.elapsed() > Duration::from_secs(60) => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}

/// The namespace of each mode's copy of the upstream stub service.
fn ns_of(mode: ScalerMode) -> &'static str {
    match mode {
        ScalerMode::Poll => NS,
        ScalerMode::Push => "hearth-e2e-push",
    }
}

async fn wait_scaled_to_zero(client: &Client, mode: ScalerMode) -> Result<()> {
    let trigger = match mode {
        ScalerMode::Poll => "metrics-api",
        ScalerMode::Push => "external-push",
    };
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
    let gw = ListParams::default().labels(&format!(
        "app.kubernetes.io/component=gateway,serving.hearth.dev/llmservice={SVC}"
    ));
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
        if ready
            && settled
            && stack::wait_resolvable(&format!("{SVC}.{ns}.svc"), Duration::from_secs(1)).await
        {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(120) {
            bail!("the gateway of {ns}/{SVC} has no ready endpoint after 120 s");
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
    let tl = Timeline::start(client.clone(), ns_of(mode), "stub-svc-backend");
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
    let lp = ListParams::default().labels(stack::STUB_BACKEND_PODS);
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
    println!("  {}  +{}s  backend pod ready", at(ready), rel(ready));
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
        "| {m} | {} | {} | {} | {} | {} | {} |",
        rel(scaled),
        rel(ready),
        rel(first),
        rel(last),
        rel(zero),
        rel(gone)
    ))
}

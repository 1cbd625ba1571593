//! The sleeping tier on the real node (`spec.scaling.sleep`), in both scaler modes: the upstream
//! stub service on a copy of the stub runtime that declares vLLM's sleep mode. A cold request
//! takes the backend 0 → 1; once idle for `sleep.after` the gateway puts the engine to sleep
//! (the pod keeps running); a streaming request then gets heartbeats while the gateway wakes the
//! same pod (no new pod, no restart, no 0 → 1) and its tokens once awake; idle again, the engine
//! sleeps, and after `scaleDownStabilization` the service goes to zero as before; a second cold
//! request then takes it 0 → 1 again on the same node. Prints the wake's timeline and both cold
//! activations' phases as the controller recorded them (`status.lastActivation`), and the wake as
//! the gateway recorded it (`status.lastWake`, kept through the controller's writes). Poll mode
//! sleeps at level 1; push mode at level 2, woken by the runtime's three calls as vLLM documents
//! them (`tags=weights`, `reload_weights`, `tags=kv_cache`), and the answer must come from
//! reloaded weights (the stub answers noise otherwise). The stub's model load is
//! `STUB_STARTUP_DELAY` 8s, about a 16 GiB model read from a local cache. See docs/e2e.md.

mod stack;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use hearth_crds::{LLMService, Wake, llmservice::Activation};
use hearth_e2e_harness::client::{self, Event};
use hearth_e2e_harness::stack::{self as harness, ScalerMode};
use hearth_test_support::{Observed, wait_until};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use stack::{SERVICE, TOKENS};

/// The runtime this suite applies: the upstream stub runtime with `sleepMode`.
const RUNTIME: &str = "vllm-stub-sleep";
/// The stub's `STUB_WAKE_DELAY` in that runtime.
const WAKE_DELAY: Duration = Duration::from_secs(1);
/// The stub's `STUB_STARTUP_DELAY` in that runtime: its model load, and a level-2 reload.
const STARTUP_DELAY: Duration = Duration::from_secs(8);
/// `spec.scaling.sleep.after` of the service.
const SLEEP_AFTER: &str = "5s";

/// The upstream stub runtime, renamed, with vLLM's sleep mode (both levels) and the stub's
/// sleep and wake-up delays. Priority 0, below the upstream runtime's, so that no other suite's
/// service resolves to it; this suite's service names it.
fn sleep_runtime() -> Result<Value> {
    let mut rt = harness::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    rt["metadata"]["name"] = json!(RUNTIME);
    rt["spec"]["priority"] = json!(0);
    let env = rt["spec"]["container"]["env"]
        .as_array_mut()
        .context("the stub runtime has container.env")?;
    for e in env.iter_mut() {
        if e["name"] == "STUB_STARTUP_DELAY" {
            e["value"] = json!(format!("{}s", STARTUP_DELAY.as_secs()));
        }
    }
    env.push(json!({"name": "STUB_SLEEP_DELAY", "value": "200ms"}));
    env.push(json!({"name": "STUB_WAKE_DELAY", "value": format!("{}ms", WAKE_DELAY.as_millis())}));
    // Level 2 wakes as vLLM documents it: the weights' memory, their values loaded again,
    // then the KV cache. (A plain `/wake_up` would leave the stub answering noise.)
    rt["spec"]["sleepMode"] = json!({
        "args": ["--enable-sleep-mode"],
        "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}],
        "levels": [
            {"level": 1},
            {"level": 2, "wakeUp": [
                {"path": "/wake_up?tags=weights"},
                {"path": "/collective_rpc", "body": "{\"method\":\"reload_weights\"}"},
                {"path": "/wake_up?tags=kv_cache"},
            ]},
        ],
    });
    Ok(rt)
}

/// The controller's record of the last 0 → 1 (`status.lastActivation`) once it names `pod`.
async fn activation(d: &stack::Deployed, pod: &str) -> Result<Activation> {
    let api: kube::Api<LLMService> = kube::Api::namespaced(d.cluster.client(), d.ns.name());
    wait_until(
        format!("status.lastActivation of pod {pod}"),
        Duration::from_secs(30),
        || async {
            let svc = api.get(SERVICE).await?;
            Ok(match svc.status.and_then(|s| s.last_activation) {
                Some(a) if a.pod == pod => Observed::Ready(a),
                other => Observed::NotYet(format!("{:?}", other.map(|a| a.pod))),
            })
        },
    )
    .await
}

/// One line of an activation's phases.
fn phases(a: &Activation) -> String {
    let p = &a.phases;
    format!(
        "total {}: scale decision {}, scheduled {}, image {}, containers started {}, model ready {} (node {})",
        p.total,
        p.scale_decision.as_deref().unwrap_or("unknown"),
        p.scheduled,
        match (a.image_present, &p.image_pull) {
            (Some(true), _) => "present".to_owned(),
            (_, Some(pull)) => format!("pulled in {pull}"),
            _ => "unknown".to_owned(),
        },
        p.containers_started,
        p.model_ready,
        a.node.as_deref().unwrap_or("?"),
    )
}

fn pod_name(pod: &Pod) -> String {
    pod.metadata.name.clone().unwrap_or_default()
}

fn restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .map_or(0, |cs| cs.iter().map(|c| c.restart_count).sum())
}

/// One service's cycle in `mode`, sleeping at `level` (1 or 2).
async fn sleep_then_wake(mode: ScalerMode, level: u8) -> Result<()> {
    let cluster = hearth_test_support::Cluster::connect().await?;
    // Hearth first: its CRDs define the runtime's sleepMode.
    harness::ensure_hearth(&cluster.client(), cluster.kubeconfig()).await?;
    harness::apply(&cluster.client(), sleep_runtime()?, None).await?;
    let d = stack::deploy(&format!("e2e-sleep-{}", mode.annotation()), mode, |svc| {
        svc["spec"]["runtime"] = json!({"name": RUNTIME});
        svc["spec"]["scaling"]["scaleDownStabilization"] = json!("60s");
        svc["spec"]["scaling"]["sleep"] = json!({"after": SLEEP_AFTER, "level": level});
    })
    .await?;

    // 0 → 1 on a cold request, as without the tier.
    let cold = client::chat(&d.url, SERVICE, false, Duration::from_secs(150)).await?;
    ensure!(cold.status == 200, "cold request answered {}", cold.status);
    let awake_pod = d.wait_engine(false, Duration::from_secs(10)).await?;
    let first = activation(&d, &pod_name(&awake_pod)).await?;

    // Idle for sleep.after: the engine sleeps, its pod stays.
    let slept_pod = d.wait_engine(true, Duration::from_secs(60)).await?;
    let slept_at = Instant::now();
    ensure!(
        slept_pod.metadata.uid == awake_pod.metadata.uid,
        "the backend pod was replaced instead of put to sleep"
    );
    let last = d.timeline.last().context("no backend sample")?;
    ensure!(
        last.desired == 1 && last.ready == 1,
        "a sleeping engine keeps its replica: {last:?}"
    );

    // A streaming request wakes it: heartbeats, then the tokens, from the same pod.
    let trace = client::chat(&d.url, SERVICE, true, Duration::from_secs(60)).await?;
    let t0 = trace.sent;
    ensure!(
        trace.status == 200,
        "the wake-up request answered {}",
        trace.status
    );
    ensure!(
        trace.complete() && trace.tokens(None) == TOKENS,
        "the wake-up stream: {:?}",
        trace.events
    );
    let first_token = trace.first_token().context("no token")?;
    // From level 2 the weights were loaded again (the stub answers U+FFFD tokens otherwise).
    ensure!(
        !trace.text().contains('\u{fffd}'),
        "the woken engine answered noise: its weights were not loaded again ({:?})",
        trace.text()
    );
    let heartbeats = trace
        .events
        .iter()
        .take_while(|(_, e)| *e == Event::Heartbeat)
        .count();
    let woken_pod = d.wait_engine(false, Duration::from_secs(5)).await?;
    ensure!(
        woken_pod.metadata.uid == awake_pod.metadata.uid && restarts(&woken_pod) == 0,
        "the engine was not woken in place: pod {:?} with {} restarts",
        woken_pod.metadata.name,
        restarts(&woken_pod)
    );
    ensure!(
        d.timeline
            .first_after(slept_at, |s| s.desired == 0)
            .is_none(),
        "the backend went to zero while asleep, before scaleDownStabilization: {}",
        d.timeline_text(slept_at)
    );
    // The gateway that slept and woke the engine said so on the LLMService.
    let slept_event = service_event(&d, "EngineSlept").await?;
    let woken_event = service_event(&d, "EngineWoken").await?;
    // ...and recorded the wake in status.lastWake.
    let woken_ip = woken_pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("the woken pod has no IP")?;
    let last_wake = wake_record(&d, &woken_ip, level).await?;
    let wake = first_token.saturating_duration_since(t0);
    // Level 2: two wake-ups and the reload (the stub's 8 s load).
    let least = if level == 2 {
        WAKE_DELAY * 2 + STARTUP_DELAY
    } else {
        WAKE_DELAY
    };
    ensure!(
        wake >= least,
        "first token {wake:?} after the request, before the stub's {least:?} wake-up from level {level}: was the engine asleep?"
    );

    // Idle again: asleep again, then at zero after scaleDownStabilization.
    d.wait_engine(true, Duration::from_secs(60)).await?;
    d.wait_zero(Duration::from_secs(180)).await?;
    let zero = Instant::now();

    // A second cold start on the same node: the image is there, the model "cache" warm.
    let again = client::chat(&d.url, SERVICE, false, Duration::from_secs(150)).await?;
    ensure!(
        again.status == 200,
        "second cold request answered {}",
        again.status
    );
    let second_pod = d.wait_engine(false, Duration::from_secs(10)).await?;
    let second = activation(&d, &pod_name(&second_pod)).await?;
    // The controller's status writes since (phases, a second lastActivation) kept the
    // gateway's record.
    let api: kube::Api<LLMService> = kube::Api::namespaced(d.cluster.client(), d.ns.name());
    let kept = api.get(SERVICE).await?.status.and_then(|s| s.last_wake);
    ensure!(
        kept.as_ref() == Some(&last_wake),
        "status.lastWake changed without a wake: {kept:?}, was {last_wake:?}"
    );
    println!(
        "[{}] first 0→1: {}; second 0→1: {}",
        mode.annotation(),
        phases(&first),
        phases(&second)
    );
    println!(
        "[{}] sleep({level})→awake: request 0.00s, first token {:.2}s (stub wake-up {:.2}s, {} heartbeats before it), last token {:.2}s; same pod, 0 restarts; asleep again, then zero {:.0}s after the wake (scaleDownStabilization 60s)",
        mode.annotation(),
        wake.as_secs_f64(),
        least.as_secs_f64(),
        heartbeats,
        trace
            .last_token()
            .unwrap_or(first_token)
            .saturating_duration_since(t0)
            .as_secs_f64(),
        zero.saturating_duration_since(t0).as_secs_f64(),
    );
    println!(
        "[{}] Events on the LLMService: EngineSlept \"{slept_event}\"; EngineWoken \"{woken_event}\"",
        mode.annotation()
    );
    let p = &last_wake.phases;
    println!(
        "[{}] status.lastWake: engine {} woke from level {} by {}: total {}: wake decision {}, wake-up calls {}",
        mode.annotation(),
        last_wake.endpoint,
        last_wake.level,
        last_wake.gateway.as_deref().unwrap_or("?"),
        p.total,
        p.wake_decision,
        p.wake_up,
    );
    Ok(())
}

/// The gateway's record of the last sleep→awake (`status.lastWake`) once it names the engine
/// at `ip`, checked: `level`, woken by a gateway pod, the wake-up calls at least the stub's
/// wake delay, the phases adding up to the total.
async fn wake_record(d: &stack::Deployed, ip: &str, level: u8) -> Result<Wake> {
    let api: kube::Api<LLMService> = kube::Api::namespaced(d.cluster.client(), d.ns.name());
    let wake = wait_until(
        format!("status.lastWake of the engine at {ip}"),
        Duration::from_secs(20),
        || async {
            let svc = api.get(SERVICE).await?;
            Ok(match svc.status.and_then(|s| s.last_wake) {
                Some(w) if w.endpoint.starts_with(&format!("{ip}:")) => Observed::Ready(w),
                other => Observed::NotYet(format!("{:?}", other.map(|w| w.endpoint))),
            })
        },
    )
    .await?;
    let secs = |d: &str| hearth_crds::parse_duration(d).with_context(|| format!("{wake:?}"));
    let (decision, calls, total) = (
        secs(&wake.phases.wake_decision)?,
        secs(&wake.phases.wake_up)?,
        secs(&wake.phases.total)?,
    );
    ensure!(
        wake.level == i32::from(level) && calls >= WAKE_DELAY,
        "a level-{level} wake through the stub's {WAKE_DELAY:?} wake-up: {wake:?}"
    );
    ensure!(
        (decision + calls).abs_diff(total) <= Duration::from_millis(2),
        "the phases add up to the total: {wake:?}"
    );
    ensure!(
        wake.start_time.0 <= wake.ready_time.0
            && wake
                .gateway
                .as_deref()
                .is_some_and(|g| g.starts_with(&format!("{SERVICE}-gateway-"))),
        "{wake:?}"
    );
    Ok(wake)
}

/// The note of the Event with `reason` on the stub LLMService (core/v1 view of the gateway's
/// events.k8s.io Events), once there is one.
async fn service_event(d: &stack::Deployed, reason: &str) -> Result<String> {
    let events: kube::Api<k8s_openapi::api::core::v1::Event> =
        kube::Api::namespaced(d.cluster.client(), d.ns.name());
    let fields =
        format!("involvedObject.kind=LLMService,involvedObject.name={SERVICE},reason={reason}");
    wait_until(
        format!("a {reason} Event on LLMService {SERVICE}"),
        Duration::from_secs(20),
        || async {
            let list = events
                .list(&kube::api::ListParams::default().fields(&fields))
                .await?;
            Ok(match list.items.into_iter().next() {
                Some(e) => Observed::Ready(e.message.unwrap_or_default()),
                None => Observed::NotYet("none yet".to_owned()),
            })
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_mode_idle_engine_sleeps_and_wakes_in_place() -> Result<()> {
    sleep_then_wake(ScalerMode::Poll, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
/// Level 2 here: the runtime's three wake-up calls, and an answer from reloaded weights.
async fn push_mode_idle_engine_sleeps_at_level_2_and_wakes_in_place() -> Result<()> {
    sleep_then_wake(ScalerMode::Push, 2).await
}

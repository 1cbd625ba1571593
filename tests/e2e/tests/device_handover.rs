//! Device handover on the real node: four stub models of one `nvidia.com/gpu` each on the real
//! node's two (its device plugin serves them; a copy of the stub runtime asks for that resource
//! and selects the real node, so the kwok GPU nodes never take a pod). Three join one
//! `LLMEndpoint` with two gateway replicas; `batch` (priority -5) keeps its own gateway;
//! `urgent` has priority 10, `m1` and `m2` 0. Every model keeps `scaleDownStabilization: 10m`,
//! so only handovers free devices, and `minResidency: 6s`.
//!
//! - **priority:** with `m2` and then `batch` loaded (`batch` used last), a cold `urgent` takes
//!   `batch`'s device (the lowest priority), not `m2`'s (the least recently used);
//! - **never a request in flight:** with `m2` streaming and `urgent` loaded, a cold `m1` waits
//!   (`urgent` outranks it, `m2` is serving) until the stream has ended, then takes `m2`'s
//!   device; the stream completes with all its tokens, and the handover starts after it ended;
//! - **a controller restart during a handover:** the controller pod is deleted right after the
//!   next handover starts; the waiting request is answered and the victim's pause is removed;
//! - **the loop:** with every priority 0, a bounded random request loop over the four models for
//!   `HEARTH_HANDOVER_LOOP_SECONDS` (default 30): every request answered, handovers counted
//!   (from the victims' ScaledObjects), each removed again, and for each the time from the
//!   controller's decision until the scheduler placed a waiting pod on the freed device (its
//!   `Scheduled` Event) under the victim's drain (record set until removed) plus 5 s. The activations' whole wait
//!   for devices (which also counts waiting for a victim to pass its minimum residency or end
//!   its requests) is in the printed table;
//! - **the baseline:** the same loop with the controller's `--device-handover=false`, in the same
//!   run; a table compares both.
//!
//! Shares its step with suites that ask for no `nvidia.com/gpu` on the real node; its
//! controller restarts are the kind the controller's other clients ride through (its work
//! resumes from the caches on start).

mod stack;

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use hearth_e2e_harness::{
    admin, client,
    stack::{self as hstack, RELEASE_NAMESPACE, ScalerMode},
};
use hearth_test_support::{Cluster, Observed, wait_until};
use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{Event, Pod},
};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

const ENDPOINT: &str = "models";
/// The four models; `batch` has its own gateway, the others join the endpoint.
const MODELS: [&str; 4] = ["batch", "m1", "m2", "urgent"];
/// The accelerator: the real node's device plugin serves 2.
const RESOURCE: &str = "nvidia.com/gpu";
/// The annotation the controller puts on a victim's ScaledObject during a handover.
const HANDOVER: &str = "serving.hearth.dev/handover";
const PAUSED_REPLICAS: &str = "autoscaling.keda.sh/paused-replicas";
/// A request's bound: the longest a cold request may wait (activation timeout 150 s).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(160);
/// A loop request's bound: a handover and a stub's cold start take seconds; without handover
/// a cold model's devices free only after an idle one's 10-minute cooldown, so its requests
/// fail at this bound.
const LOOP_TIMEOUT: Duration = Duration::from_secs(30);

/// The copy of the stub runtime this suite's models run on.
fn runtime_name() -> String {
    format!("vllm-stub-handover-{}", std::process::id())
}

/// The stub runtime asking for one [`RESOURCE`] on the real node, starting in 2 s.
fn runtime() -> Result<Value> {
    let mut rt = hstack::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    rt["metadata"]["name"] = Value::from(runtime_name());
    rt["spec"]["accelerator"]["resourceName"] = Value::from(RESOURCE);
    rt["spec"]["accelerator"]["nodeSelector"] = json!({"tests.hearth.dev/real-node": "true"});
    for e in rt["spec"]["container"]["env"]
        .as_array_mut()
        .into_iter()
        .flatten()
    {
        if e["name"] == "STUB_STARTUP_DELAY" {
            e["value"] = Value::from("2s");
        }
    }
    Ok(rt)
}

fn priority_of(name: &str) -> i32 {
    match name {
        "batch" => -5,
        "urgent" => 10,
        _ => 0,
    }
}

fn model(ns: &str, name: &str) -> Result<Value> {
    let mut o = hstack::stub_service(ns, ScalerMode::Poll)?;
    o["metadata"]["name"] = Value::from(name);
    o["spec"]["runtime"] = json!({"name": runtime_name()});
    o["spec"]["scaling"]["min"] = json!(0);
    o["spec"]["scaling"]["max"] = json!(1);
    o["spec"]["scaling"]["priority"] = json!(priority_of(name));
    o["spec"]["scaling"]["minResidency"] = json!("6s");
    o["spec"]["scaling"]["scaleDownStabilization"] = json!("10m");
    o["spec"]["scaling"]["activationTimeout"] = json!("150s");
    if name != "batch" {
        o["spec"]["endpoint"]["sharedEndpointRef"] = json!({"name": ENDPOINT});
    }
    Ok(o)
}

/// One request's outcome in a loop.
#[derive(Clone, Debug)]
struct Outcome {
    model: &'static str,
    ok: bool,
    latency: Duration,
    error: String,
}

/// One handover seen on a victim's ScaledObject: set at `seen`, removed at `gone`.
#[derive(Clone, Debug)]
struct Seen {
    victim: String,
    to: String,
    /// The record's `since`: when the controller decided.
    since: Option<k8s_openapi::jiff::Timestamp>,
    seen: Instant,
    gone: Option<Instant>,
}

impl Seen {
    /// From the record's appearance to its removal: KEDA's reaction, the victim's drain, its
    /// pod's deletion and the controller's look.
    fn drain(&self) -> Option<Duration> {
        self.gone.map(|g| g.duration_since(self.seen))
    }
}

/// Polls the namespace's ScaledObjects every 250 ms and records each handover record (by its
/// `since`) from when it appears until it is removed.
fn watch_handovers(
    client: kube::Client,
    ns: String,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> (
    Arc<Mutex<BTreeMap<String, Seen>>>,
    tokio::task::JoinHandle<()>,
) {
    let seen: Arc<Mutex<BTreeMap<String, Seen>>> = Arc::default();
    let out = seen.clone();
    let task = tokio::spawn(async move {
        let api = hstack::scaled_objects(&client, &ns);
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            if let Ok(list) = api.list(&ListParams::default()).await {
                let now = Instant::now();
                let mut current = BTreeSet::new();
                let mut s = seen.lock().unwrap();
                for so in list.items {
                    let name = so.metadata.name.clone().unwrap_or_default();
                    let Some(raw) = so
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get(HANDOVER))
                    else {
                        continue;
                    };
                    let record: Value = serde_json::from_str(raw).unwrap_or_default();
                    let key = format!("{name}@{}", record["since"].as_str().unwrap_or_default());
                    current.insert(key.clone());
                    s.entry(key).or_insert_with(|| Seen {
                        victim: name.clone(),
                        to: record["to"].as_str().unwrap_or_default().to_owned(),
                        since: record["since"].as_str().and_then(|t| t.parse().ok()),
                        seen: now,
                        gone: None,
                    });
                }
                for (key, h) in s.iter_mut() {
                    if h.gone.is_none() && !current.contains(key) {
                        h.gone = Some(now);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    (out, task)
}

/// A chat request to `model` at its URL, answered 200 within `timeout`.
async fn chat_within(url: &str, model: &str, timeout: Duration) -> Result<client::Trace> {
    let t = client::chat_with(url, model, false, Some(4), timeout).await?;
    ensure!(t.status == 200, "{model} answered {}: {}", t.status, t.body);
    Ok(t)
}

/// [`chat_within`] [`REQUEST_TIMEOUT`].
async fn chat_ok(url: &str, model: &str) -> Result<client::Trace> {
    chat_within(url, model, REQUEST_TIMEOUT).await
}

/// The phase of LLMService `ns/name`.
async fn phase(client: &kube::Client, ns: &str, name: &str) -> Result<String> {
    Ok(hstack::phase(client, ns, name).await?.unwrap_or_default())
}

/// Waits until the demand the gateway of `owner` (a service, or the endpoint) reports at
/// `path` of its admin port (`{"pending": N}`, summed over its replicas) satisfies `ok`.
async fn wait_demand(
    client: &kube::Client,
    ns: &str,
    owner: &str,
    path: &str,
    what: &str,
    ok: fn(u64) -> bool,
) -> Result<()> {
    wait_until(what, Duration::from_secs(60), || async {
        let (status, body) =
            admin::get_owner(client, ns, owner, path, Duration::from_secs(5)).await?;
        let pending = serde_json::from_str::<Value>(&body)
            .ok()
            .and_then(|v| v["pending"].as_u64());
        Ok(match pending {
            Some(d) if status == 200 && ok(d) => Observed::Ready(()),
            _ => Observed::NotYet(format!("{owner} {path}: {status} {body}")),
        })
    })
    .await
}

/// Waits until `name`'s backend is at zero with no pod left.
async fn wait_gone(client: &kube::Client, ns: &str, name: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let selector = hstack::backend_pods(name);
    wait_until(
        format!("{name}'s backend pods gone"),
        Duration::from_secs(90),
        || async {
            let n = pods
                .list(&ListParams::default().labels(&selector))
                .await?
                .items
                .len();
            Ok(if n == 0 {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{n} pod(s)"))
            })
        },
    )
    .await
}

/// The controller Deployment's `--device-handover` argument set to `on`; waits until exactly
/// one controller pod runs, Ready, with it.
async fn set_handover(client: &kube::Client, on: bool) -> Result<()> {
    let api: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let d = api.get("hearth-controller").await?;
    let container = d
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|s| s.containers.first())
        .context("the controller Deployment has no container")?;
    let mut args = container.args.clone().unwrap_or_default();
    let i = args
        .iter()
        .position(|a| a.starts_with("--device-handover="))
        .context("the controller has no --device-handover argument")?;
    let want = format!("--device-handover={on}");
    if args[i] != want {
        args[i] = want.clone();
        // Strategic merge: the container by name, its args (no merge key) replaced whole.
        let patch = json!({"spec": {"template": {"spec": {"containers": [
            {"name": container.name, "args": args}
        ]}}}});
        api.patch(
            "hearth-controller",
            &PatchParams::default(),
            &Patch::Strategic(patch),
        )
        .await?;
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    wait_until(
        format!("one Ready controller pod with {want}"),
        Duration::from_secs(120),
        || async {
            let list = pods
                .list(&ListParams::default().labels("app.kubernetes.io/component=controller"))
                .await?;
            let with: Vec<&Pod> = list
                .items
                .iter()
                .filter(|p| {
                    p.spec
                        .as_ref()
                        .is_some_and(|s| s.containers[0].args.iter().flatten().any(|a| *a == want))
                })
                .collect();
            Ok(
                if list.items.len() == 1
                    && with.len() == 1
                    && hearth_test_support::pod_ready(with[0])
                {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(format!("{} pods, {} with it", list.items.len(), with.len()))
                },
            )
        },
    )
    .await
}

/// `(waiting for devices, total)` of each `Activated` Event in `ns` after `since`, by service.
async fn activations(
    client: &kube::Client,
    ns: &str,
    since: k8s_openapi::jiff::Timestamp,
) -> Result<Vec<(String, Option<f64>, f64)>> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events
        .list(&ListParams::default().fields("reason=Activated"))
        .await?;
    let seconds = |note: &str, after: &str| -> Option<f64> {
        let rest = note.split(after).nth(1)?;
        rest.split('s').next()?.trim().parse().ok()
    };
    let mut out = Vec::new();
    for e in list.items {
        let at = e
            .event_time
            .as_ref()
            .map(|t| t.0)
            .or(e.first_timestamp.as_ref().map(|t| t.0));
        if at.is_none_or(|t| t < since) {
            continue;
        }
        let note = e.message.unwrap_or_default();
        let Some(total) = seconds(&note, "0→1 in ") else {
            continue;
        };
        out.push((
            e.involved_object.name.unwrap_or_default(),
            seconds(&note, "waiting for devices "),
            total,
        ));
    }
    Ok(out)
}

/// When the scheduler placed each backend pod of `ns` (its `Scheduled` Events), by the
/// service the pod belongs to (pods are `<service>-<hash>-<hash>`).
async fn scheduled(
    client: &kube::Client,
    ns: &str,
) -> Result<Vec<(String, k8s_openapi::jiff::Timestamp)>> {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let list = events
        .list(&ListParams::default().fields("reason=Scheduled"))
        .await?;
    Ok(list
        .items
        .into_iter()
        .filter_map(|e| {
            let pod = e.involved_object.name?;
            let service = MODELS.iter().find(|m| pod.starts_with(&format!("{m}-")))?;
            let at = e
                .event_time
                .map(|t| t.0)
                .or(e.first_timestamp.map(|t| t.0))?;
            Some(((*service).to_owned(), at))
        })
        .collect())
}

/// Prints the namespace's Events from `since` on, oldest first (a handover that took long).
async fn dump_events(client: &kube::Client, ns: &str, since: k8s_openapi::jiff::Timestamp) {
    let events: Api<Event> = Api::namespaced(client.clone(), ns);
    let Ok(list) = events.list(&ListParams::default()).await else {
        return;
    };
    let mut rows: Vec<(k8s_openapi::jiff::Timestamp, String)> = list
        .items
        .into_iter()
        .filter_map(|e| {
            let at = e
                .event_time
                .map(|t| t.0)
                .or(e.last_timestamp.map(|t| t.0))?;
            (at >= since - k8s_openapi::jiff::SignedDuration::from_secs(20)).then(|| {
                let message: String = e.message.unwrap_or_default().chars().take(100).collect();
                (
                    at,
                    format!(
                        "{} {} {}: {message}",
                        e.reason.unwrap_or_default(),
                        e.involved_object.kind.unwrap_or_default(),
                        e.involved_object.name.unwrap_or_default()
                    ),
                )
            })
        })
        .collect();
    rows.sort();
    for (at, row) in rows {
        println!("  {at} {row}");
    }
}

/// A deterministic pseudo-random sequence (xorshift), so runs are comparable.
struct Rng(u64);

impl Rng {
    fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Three clients, each sending a short chat to a random model then thinking 0.5 to 2 s, until
/// `length` has passed; every outcome.
async fn request_loop(urls: &BTreeMap<&'static str, String>, length: Duration) -> Vec<Outcome> {
    let end = Instant::now() + length;
    let mut clients = Vec::new();
    for c in 0..3u64 {
        let urls = urls.clone();
        clients.push(tokio::spawn(async move {
            let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (c + 1));
            let mut out = Vec::new();
            while Instant::now() < end {
                let model = MODELS[rng.next(MODELS.len() as u64) as usize];
                let start = Instant::now();
                let r = chat_within(&urls[model], model, LOOP_TIMEOUT).await;
                out.push(Outcome {
                    model,
                    ok: r.is_ok(),
                    latency: start.elapsed(),
                    error: r.err().map(|e| format!("{e:#}")).unwrap_or_default(),
                });
                tokio::time::sleep(Duration::from_millis(500 + rng.next(1500))).await;
            }
            out
        }));
    }
    let mut all = Vec::new();
    for c in clients {
        all.extend(c.await.unwrap_or_default());
    }
    all
}

/// p50 and max of `v`, `-` when empty.
fn p50_max(mut v: Vec<f64>) -> String {
    if v.is_empty() {
        return "-".to_owned();
    }
    v.sort_by(f64::total_cmp);
    format!("{:.1} / {:.1}", v[v.len() / 2], v[v.len() - 1])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn idle_models_hand_their_devices_to_cold_ones() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    hstack::apply(&client, runtime()?, None).await?;
    let result = run(&cluster).await;
    // Whatever happened, the controller hands over again for the suites after this one.
    let restored = set_handover(&client, true).await;
    let _ = hstack::inference_runtimes(&client)
        .delete(&runtime_name(), &DeleteParams::default())
        .await;
    result.and(restored)
}

async fn run(cluster: &Cluster) -> Result<()> {
    let client = cluster.client();
    let ns = cluster.namespace("e2e-handover").await?;
    let n = ns.name().to_owned();
    set_handover(&client, true).await?;

    hstack::apply(
        &client,
        json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "LLMEndpoint",
            "metadata": {"name": ENDPOINT, "namespace": n},
            "spec": {"replicas": 2},
        }),
        None,
    )
    .await?;
    for m in MODELS {
        hstack::apply(&client, model(&n, m)?, None).await?;
    }
    for m in MODELS {
        wait_until(
            format!("{m} ScaledToZero"),
            Duration::from_secs(120),
            || async {
                let p = phase(&client, &n, m).await?;
                Ok(if p == "ScaledToZero" {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(p)
                })
            },
        )
        .await?;
    }
    let endpoint_url = stack::wait_service_url(&client, &n, ENDPOINT).await?;
    let batch_url = stack::wait_service_url(&client, &n, "batch").await?;
    for url in [&endpoint_url, &batch_url] {
        ensure!(
            hstack::wait_reachable(url, Duration::from_secs(90)).await,
            "{url} never accepted a connection"
        );
    }
    let urls: BTreeMap<&'static str, String> = MODELS
        .iter()
        .map(|m| {
            let url = if *m == "batch" {
                &batch_url
            } else {
                &endpoint_url
            };
            (*m, url.clone())
        })
        .collect();

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (handovers, watcher) = watch_handovers(client.clone(), n.clone(), stop.clone());
    let result = scenarios(cluster, &n, &urls, &handovers).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let _ = watcher.await;
    result
}

/// The handovers seen so far, oldest first.
fn seen(handovers: &Mutex<BTreeMap<String, Seen>>) -> Vec<Seen> {
    let mut v: Vec<Seen> = handovers.lock().unwrap().values().cloned().collect();
    v.sort_by_key(|h| h.seen);
    v
}

/// Waits until more than `before` handovers were seen; the newest.
async fn next_handover(handovers: &Mutex<BTreeMap<String, Seen>>, before: usize) -> Result<Seen> {
    wait_until(
        format!("handover number {}", before + 1),
        Duration::from_secs(60),
        || async {
            let all = seen(handovers);
            Ok(match all.get(before) {
                Some(h) => Observed::Ready(h.clone()),
                None => Observed::NotYet(format!("{} handovers", all.len())),
            })
        },
    )
    .await
}

async fn scenarios(
    cluster: &Cluster,
    n: &str,
    urls: &BTreeMap<&'static str, String>,
    handovers: &Arc<Mutex<BTreeMap<String, Seen>>>,
) -> Result<()> {
    let client = cluster.client();
    let so_api = hstack::scaled_objects(&client, n);

    // 1. Priority over recency: m2, then batch loaded (batch used last); a cold urgent takes
    // batch's device.
    chat_ok(&urls["m2"], "m2").await?;
    chat_ok(&urls["batch"], "batch").await?;
    // Until their gateways' activation leases end (10 s after a cold start's backend turned
    // Ready demand stays 1: the model counts as serving), which is past the 6 s residency.
    wait_demand(
        &client,
        n,
        "batch",
        "/hearth/queue/local",
        "batch idle",
        |d| d == 0,
    )
    .await?;
    let m2_queue = format!("/hearth/queue/{n}/m2");
    wait_demand(&client, n, ENDPOINT, &m2_queue, "m2 idle", |d| d == 0).await?;
    chat_ok(&urls["batch"], "batch").await?;
    let t = chat_ok(&urls["urgent"], "urgent").await?;
    println!(
        "urgent (priority 10) served {:.1}s after its cold request",
        t.end.duration_since(t.sent).as_secs_f64()
    );
    let first = seen(handovers);
    ensure!(
        first.len() == 1 && first[0].victim == "batch" && first[0].to == format!("{n}/urgent"),
        "the cold urgent should take batch's device (the lowest priority), took: {first:?}"
    );
    wait_gone(&client, n, "batch").await?;

    // 2. Never a request in flight: m2 streams for about 15 s; a cold m1 (priority 0, below
    // urgent) must wait for the stream to end, then takes m2's device.
    let m2_url = urls["m2"].clone();
    let stream = tokio::spawn(async move {
        client::chat_with_headers(
            &m2_url,
            "m2",
            true,
            Some(15),
            &[("x-stub-token-delay", "1s")],
            REQUEST_TIMEOUT,
        )
        .await
    });
    wait_demand(&client, n, ENDPOINT, &m2_queue, "m2 streaming", |d| d >= 1).await?;
    let m1_url = urls["m1"].clone();
    let m1 = tokio::spawn(async move { chat_ok(&m1_url, "m1").await });
    let trace = stream.await?.context("m2's stream")?;
    let stream_end = trace.end;
    ensure!(
        trace.status == 200 && trace.complete() && trace.tokens(None) == 15,
        "m2's stream through the wait: {} complete={} tokens={}",
        trace.status,
        trace.complete(),
        trace.tokens(None)
    );
    let h = next_handover(handovers, 1).await?;
    ensure!(
        h.victim == "m2" && h.to == format!("{n}/m1"),
        "m1 should take m2's device once its stream ended, took: {h:?}"
    );
    // The poll sees a record within 250 ms of its making.
    ensure!(
        h.seen + Duration::from_millis(300) >= stream_end,
        "the handover from m2 started {:.1}s before its stream ended",
        stream_end.duration_since(h.seen).as_secs_f64()
    );
    m1.await?.context("m1 after the handover")?;
    println!("m1 waited for m2's stream to end, then took its device");

    // 3. A controller restart during a handover: m2 is cold again; the controller pod is
    // deleted as soon as the victim's record appears. First m1's lease ends (see above).
    let m1_queue = format!("/hearth/queue/{n}/m1");
    wait_demand(&client, n, ENDPOINT, &m1_queue, "m1 idle", |d| d == 0).await?;
    let m2_url = urls["m2"].clone();
    let m2 = tokio::spawn(async move { chat_ok(&m2_url, "m2").await });
    let h = next_handover(handovers, 2).await?;
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    pods.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().labels("app.kubernetes.io/component=controller"),
    )
    .await?;
    m2.await?.context("m2 across the controller restart")?;
    wait_until(
        format!("{}'s pause removed after the controller restart", h.victim),
        Duration::from_secs(180),
        || async {
            let so = so_api.get(&h.victim).await?;
            let a = so.metadata.annotations.unwrap_or_default();
            Ok(
                if a.contains_key(HANDOVER) || a.contains_key(PAUSED_REPLICAS) {
                    Observed::NotYet(format!("{a:?}"))
                } else {
                    Observed::Ready(())
                },
            )
        },
    )
    .await?;
    println!(
        "controller restart mid-handover: {}'s pause removed, m2 served",
        h.victim
    );

    // 4. The loop with every priority 0, with handover; then 5. the baseline without.
    let services = hstack::llm_services(&client, n);
    for m in MODELS {
        services
            .patch(
                m,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"scaling": {"priority": 0}}})),
            )
            .await?;
    }
    let length = Duration::from_secs(
        std::env::var("HEARTH_HANDOVER_LOOP_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(30),
    );
    let mut rows = Vec::new();
    for on in [true, false] {
        set_handover(&client, on).await?;
        let since = k8s_openapi::jiff::Timestamp::now();
        let counted = seen(handovers).len();
        let outcomes = request_loop(urls, length).await;
        // The loop's last activations reach their Events within a reconcile.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let acts = activations(&client, n, since).await?;
        let new: Vec<Seen> = seen(handovers).into_iter().skip(counted).collect();
        let failed: Vec<&Outcome> = outcomes.iter().filter(|o| !o.ok).collect();
        println!(
            "{} activations (service, wait for devices s, total s): {acts:?}",
            if on { "handover" } else { "baseline" }
        );
        rows.push(format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            if on { "handover" } else { "none (baseline)" },
            outcomes.len(),
            failed.len(),
            acts.len(),
            new.len(),
            p50_max(acts.iter().filter_map(|a| a.1).collect()),
            p50_max(acts.iter().map(|a| a.2).collect()),
            p50_max(
                outcomes
                    .iter()
                    .filter(|o| o.ok)
                    .map(|o| o.latency.as_secs_f64())
                    .collect()
            ),
        ));
        if !on {
            continue;
        }
        ensure!(
            failed.is_empty(),
            "{} of {} requests failed with handover: {:?}",
            failed.len(),
            outcomes.len(),
            failed
                .iter()
                .take(5)
                .map(|o| format!(
                    "{} after {:.1}s: {}",
                    o.model,
                    o.latency.as_secs_f64(),
                    o.error
                ))
                .collect::<Vec<_>>()
        );
        ensure!(!new.is_empty(), "no handover in the loop");
        // Each handover: from the controller's decision until the scheduler placed a waiting
        // pod on the freed device is under the victim's drain (its record set until removed)
        // + 5 s. Which waiting pod gets it is the scheduler's choice (its queue order: pod
        // priority, then arrival), so with several models waiting it may be another one.
        let placed = scheduled(&client, n).await?;
        let mut latencies = Vec::new();
        for h in &new {
            let Some(drain) = h.drain() else {
                bail!("{}'s handover record was never removed: {h:?}", h.victim);
            };
            let since = h.since.context("a handover record without since")?;
            let Some((service, at)) = placed
                .iter()
                .filter(|(_, at)| *at >= since)
                .min_by_key(|(_, at)| *at)
            else {
                bail!("no pod was scheduled after the handover {h:?}");
            };
            let latency = Duration::try_from(at.duration_since(since)).unwrap_or_default();
            if latency > drain + Duration::from_secs(5) {
                dump_events(&client, n, since).await;
            }
            ensure!(
                latency <= drain + Duration::from_secs(5),
                "{service}'s pod was scheduled {:.1}s after the handover from {} started; its drain took {:.1}s",
                latency.as_secs_f64(),
                h.victim,
                drain.as_secs_f64()
            );
            latencies.push((latency.as_secs_f64(), drain.as_secs_f64()));
        }
        println!(
            "handovers in the loop (scheduled after the decision s, victim's drain s): {latencies:.1?}"
        );
    }
    println!(
        "loop of {}s, 3 clients, 4 models of 1 {RESOURCE} on 2\n| mode | requests | failed | activations | handovers | wait for devices p50 / max s | cold start p50 / max s | request latency p50 / max s |\n|---|---|---|---|---|---|---|---|\n{}",
        length.as_secs(),
        rows.join("\n")
    );
    Ok(())
}

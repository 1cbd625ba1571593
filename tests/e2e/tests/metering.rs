//! Accelerator-seconds on the real node: the stub service on a runtime asking for 2
//! `nvidia.com/gpu` per backend pod (the node's two), with the sleeping tier, two tenants known
//! by their keys and `spec.owner: platform`. One run goes through every phase:
//! - a cold start `team-a` waited for, its request served, idle, asleep;
//! - a gateway restart (every gateway pod deleted), then `team-b` wakes the engine and is
//!   served; a controller restart while the pod runs; asleep again;
//! - a warm window opened: served, idle inside it until the ledger shows it; the window
//!   removed, the service goes to zero;
//! - a second cold start, `team-b`'s, served, then zero again.
//!
//! The suite watches the backend pods itself (devices × `PodScheduled` until the watch saw the
//! pod deleted) and checks that the ledger's charges over every tenant and phase add up to that
//! within ±2 %; that each cold start went to the tenant who waited, serving to the tenants
//! served, and idle, sleeping and the warm window to the owner; and that `status.usage` and
//! `kubectl hearth usage`'s table say the same. Prints the table.
//!
//! Devices: both of the node's `nvidia.com/gpu` (no other suite of its step asks for one).

mod stack;

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use futures::StreamExt;
use hearth_controller::metering::{self, Charges, Phase};
use hearth_crds::LLMService;
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::{self as harness, RELEASE_NAMESPACE, ScalerMode};
use hearth_test_support::{Observed, wait_until};
use k8s_openapi::{api::core::v1::Pod, jiff::Timestamp};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams},
    runtime::watcher,
};
use serde_json::{Value, json};

use stack::SERVICE;

const RESOURCE: &str = "nvidia.com/gpu";
/// Devices per backend pod.
const DEVICES: u32 = 2;
const KEYS: [(&str, &str); 2] = [("team-a", "sk-meter-a"), ("team-b", "sk-meter-b")];
const OWNER: &str = "platform";
const SLEEP_AFTER: &str = "10s";

fn runtime_name() -> String {
    format!("vllm-stub-meter-{}", std::process::id())
}

/// The stub runtime on [`RESOURCE`] with vLLM's sleep mode, starting in 3 s.
fn runtime() -> Result<Value> {
    let mut rt = harness::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    rt["metadata"]["name"] = json!(runtime_name());
    rt["spec"]["priority"] = json!(0);
    rt["spec"]["accelerator"]["resourceName"] = json!(RESOURCE);
    rt["spec"]["accelerator"]["nodeSelector"] = json!({"tests.hearth.dev/real-node": "true"});
    let env = rt["spec"]["container"]["env"]
        .as_array_mut()
        .context("the stub runtime has container.env")?;
    for e in env.iter_mut() {
        if e["name"] == "STUB_STARTUP_DELAY" {
            e["value"] = json!("3s");
        }
    }
    env.push(json!({"name": "STUB_WAKE_DELAY", "value": "500ms"}));
    rt["spec"]["sleepMode"] = json!({
        "args": ["--enable-sleep-mode"],
        "env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "1"}],
        "levels": [{"level": 1}],
    });
    Ok(rt)
}

fn key(tenant: &str) -> &'static str {
    KEYS.iter()
        .find(|(t, _)| *t == tenant)
        .map_or("sk-none", |(_, k)| *k)
}

/// A chat completion as `tenant`, answered 200.
async fn ask(url: &str, tenant: &str) -> Result<()> {
    let auth = format!("Bearer {}", key(tenant));
    let t = client::chat_with_headers(
        url,
        SERVICE,
        true,
        Some(20),
        &[
            ("authorization", auth.as_str()),
            ("x-stub-token-delay", "100ms"),
        ],
        Duration::from_secs(150),
    )
    .await?;
    ensure!(
        t.status == 200 && t.complete(),
        "{tenant}'s request answered {} (complete: {})",
        t.status,
        t.complete()
    );
    Ok(())
}

/// The pods' device time as this suite sees it: per UID, devices, scheduled and gone (Unix ms).
#[derive(Default)]
struct Truth {
    pods: BTreeMap<String, (u32, Option<i64>, Option<i64>)>,
}

impl Truth {
    /// Device-seconds of every pod, gone ones until they went, others until `now_ms`.
    fn seconds(&self, now_ms: i64) -> f64 {
        self.pods
            .values()
            .filter_map(|(d, s, g)| Some(f64::from(*d) * (g.unwrap_or(now_ms) - (*s)?) as f64))
            .sum::<f64>()
            / 1000.0
    }

    fn all_gone(&self) -> Option<i64> {
        self.pods
            .values()
            .map(|(_, _, g)| *g)
            .collect::<Option<Vec<_>>>()
            .and_then(|g| g.into_iter().max())
    }
}

/// Watches the namespace's backend pods into `truth`.
fn watch_pods(api: Api<Pod>, truth: Arc<Mutex<Truth>>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let cfg = watcher::Config::default().labels(&stack::backend_selector());
        let mut events = std::pin::pin!(watcher(api, cfg));
        while let Some(ev) = events.next().await {
            let now = Timestamp::now().as_millisecond();
            let mut t = truth.lock().unwrap_or_else(|e| e.into_inner());
            match ev {
                Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                    let uid = p.uid().unwrap_or_default();
                    let scheduled = scheduled_ms(&p);
                    let entry = t.pods.entry(uid).or_insert((DEVICES, None, None));
                    entry.0 = metering::devices(&p);
                    entry.1 = entry.1.or(scheduled);
                }
                Ok(watcher::Event::Delete(p)) => {
                    let entry = t
                        .pods
                        .entry(p.uid().unwrap_or_default())
                        .or_insert((DEVICES, None, None));
                    entry.1 = entry.1.or(scheduled_ms(&p));
                    entry.2 = Some(now);
                }
                _ => {}
            }
        }
    })
}

/// `PodScheduled` true since, Unix ms.
fn scheduled_ms(p: &Pod) -> Option<i64> {
    hearth_controller::activation::condition_true_since(p, "PodScheduled")
        .map(|t| t.as_millisecond())
}

/// Deletes the pods of `selector` in `ns` and waits until a new one is Ready.
async fn restart(client: &kube::Client, ns: &str, selector: &str, what: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let before: Vec<String> = pods
        .list(&ListParams::default().labels(selector))
        .await?
        .items
        .iter()
        .filter_map(|p| p.uid())
        .collect();
    pods.delete_collection(
        &DeleteParams::default(),
        &ListParams::default().labels(selector),
    )
    .await?;
    wait_until(
        format!("a new Ready {what} pod"),
        Duration::from_secs(90),
        || async {
            let now = pods
                .list(&ListParams::default().labels(selector))
                .await?
                .items;
            let fresh = now
                .iter()
                .filter(|p| p.uid().is_some_and(|u| !before.contains(&u)))
                .filter(|p| hearth_test_support::pod_ready(p))
                .count();
            Ok(if fresh > 0 {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("{} pods, none new and Ready", now.len()))
            })
        },
    )
    .await
}

/// A warm window open now (an hour either side, UTC), or none.
fn warm_window(open: bool) -> Value {
    if !open {
        return json!([]);
    }
    let hour = |offset: i64| {
        let h = (Timestamp::now().as_second() / 3600 + offset).rem_euclid(24);
        format!("0 {h} * * *")
    };
    json!([{"timezone": "UTC", "start": hour(-1), "end": hour(2), "replicas": 1}])
}

fn phase(c: &Charges, tenant: &str, p: Phase) -> f64 {
    c.get(tenant).map_or(0.0, |s| s.get(p))
}

#[tokio::test]
async fn accelerator_seconds_add_up_across_restarts() -> Result<()> {
    let cluster = hearth_test_support::Cluster::connect().await?;
    let client = cluster.client();
    harness::ensure_hearth(&client, cluster.kubeconfig()).await?;
    harness::apply(&client, runtime()?, None).await?;
    let secrets = stack::key_secrets(&KEYS);
    let d = stack::deploy_with("e2e-metering", ScalerMode::Push, secrets, |svc| {
        svc["spec"]["runtime"] = json!({"name": runtime_name()});
        svc["spec"]["resources"]["accelerators"] = json!(DEVICES);
        svc["spec"]["owner"] = json!(OWNER);
        svc["spec"]["scaling"]["max"] = json!(1);
        svc["spec"]["scaling"]["scaleDownStabilization"] = json!("45s");
        svc["spec"]["scaling"]["sleep"] = json!({"after": SLEEP_AFTER, "level": 1});
        svc["spec"]["endpoint"]["tenants"] = json!([
            {"name": "team-a", "apiKeySecretRef": {"name": "team-a-keys"}},
            {"name": "team-b", "apiKeySecretRef": {"name": "team-b-keys"}},
        ]);
    })
    .await?;
    let ns = d.ns.name().to_owned();
    let truth = Arc::new(Mutex::new(Truth::default()));
    let watch = watch_pods(d.ns.api::<Pod>(), truth.clone());
    let services: Api<LLMService> = Api::namespaced(client.clone(), &ns);

    // 1. team-a's cold start, served; idle, then asleep.
    ask(&d.url, "team-a")
        .await
        .context("team-a's cold request")?;
    d.wait_engine(true, Duration::from_secs(60)).await?;

    // 2. Every gateway pod replaced; team-b wakes the engine. Then the controller restarts
    //    while the pod runs.
    restart(
        &client,
        &ns,
        "app.kubernetes.io/component=gateway",
        "gateway",
    )
    .await?;
    d.wait_gateway_endpoint().await?;
    ask(&d.url, "team-b")
        .await
        .context("team-b after the gateway restart")?;
    restart(
        &client,
        RELEASE_NAMESPACE,
        "app.kubernetes.io/component=controller",
        "controller",
    )
    .await?;
    // The old gateway may have woken the engine while draining: the new one, which found it
    // asleep, asks again and puts it back to sleep.
    d.wait_engine(true, Duration::from_secs(60)).await?;

    // 3. A warm window: served, idle inside it, asleep; closed, the service goes to zero.
    let patch = |w: Value| json!({"spec": {"scaling": {"warmWindows": w}}});
    services
        .patch(
            SERVICE,
            &PatchParams::default(),
            &Patch::Merge(patch(warm_window(true))),
        )
        .await?;
    ask(&d.url, "team-a")
        .await
        .context("team-a in the window")?;
    wait_until(
        "idle time in the warm window charged",
        Duration::from_secs(90),
        || async {
            let ledgers = metering::read_ledgers(&client, Some(&ns), Some(SERVICE)).await?;
            let charged = ledgers
                .first()
                .map_or(0.0, |(_, _, l)| phase(&l.totals, OWNER, Phase::WarmWindow));
            Ok(if charged > 0.0 {
                Observed::Ready(())
            } else {
                Observed::NotYet("no warmWindow seconds in the ledger yet".to_owned())
            })
        },
    )
    .await?;
    services
        .patch(
            SERVICE,
            &PatchParams::default(),
            &Patch::Merge(patch(warm_window(false))),
        )
        .await?;
    d.wait_zero(Duration::from_secs(150)).await?;

    // 4. team-b's cold start, served; zero again.
    ask(&d.url, "team-b")
        .await
        .context("team-b's cold request")?;
    d.wait_zero(Duration::from_secs(150)).await?;

    // The ledger once it has charged every pod until it went.
    let gone = wait_until(
        "every backend pod gone in the watch",
        Duration::from_secs(30),
        || async {
            let t = truth.lock().unwrap_or_else(|e| e.into_inner());
            Ok(match t.all_gone() {
                Some(at) if t.pods.len() >= 2 => Observed::Ready(at),
                _ => Observed::NotYet(format!("{} pods seen", t.pods.len())),
            })
        },
    )
    .await?;
    let ledger = wait_until(
        "the ledger past the last pod's end",
        Duration::from_secs(60),
        || async {
            let ledgers = metering::read_ledgers(&client, Some(&ns), Some(SERVICE)).await?;
            Ok(match ledgers.into_iter().next() {
                Some((_, _, l)) if l.pods.is_empty() && l.at_ms >= gone => Observed::Ready(l),
                Some((_, _, l)) => {
                    Observed::NotYet(format!("at {} with {} pods", l.at_ms, l.pods.len()))
                }
                None => Observed::NotYet("no ledger".to_owned()),
            })
        },
    )
    .await?;
    watch.abort();
    let expected = truth
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .seconds(gone);
    let total = metering::charges_total(&ledger.totals);
    let c = &ledger.totals;
    let table = metering::usage_table(&metering::usage_rows(
        &[(ns.clone(), SERVICE.to_owned(), ledger.clone())],
        i64::MIN,
        i64::MAX,
    ));
    println!("{table}");
    println!(
        "pods' device-seconds (this suite's watch): {expected:.1}; charged: {total:.1} ({:+.2} %)",
        (total - expected) / expected * 100.0
    );
    ensure!(
        (total - expected).abs() <= expected * 0.02,
        "charged {total:.1} device-seconds, the pods had {expected:.1} (more than 2 % apart)\n{table}"
    );
    // Who paid for what.
    for (tenant, p) in [
        ("team-a", Phase::ColdStart),
        ("team-b", Phase::ColdStart),
        ("team-a", Phase::Serving),
        ("team-b", Phase::Serving),
        (OWNER, Phase::Idle),
        (OWNER, Phase::Sleeping),
        (OWNER, Phase::WarmWindow),
    ] {
        ensure!(
            phase(c, tenant, p) > 0.0,
            "{tenant} was charged no {} time\n{table}",
            p.as_str()
        );
    }
    for p in [Phase::Idle, Phase::Sleeping, Phase::WarmWindow] {
        for tenant in ["team-a", "team-b"] {
            ensure!(
                phase(c, tenant, p) == 0.0,
                "{tenant} was charged {} time, the owner's\n{table}",
                p.as_str()
            );
        }
    }
    // The cold starts went to who waited: the owner's share of them is at most a tick's.
    ensure!(
        phase(c, OWNER, Phase::ColdStart) <= f64::from(DEVICES) * 5.0,
        "the owner paid {:.1} s of cold starts tenants waited for\n{table}",
        phase(c, OWNER, Phase::ColdStart)
    );
    // status.usage says the same, in whole seconds.
    let usage = wait_until(
        "status.usage as the ledger",
        Duration::from_secs(60),
        || async {
            let svc = services.get(SERVICE).await?;
            Ok(match svc.status.and_then(|s| s.usage) {
                // `updated` has whole seconds.
                Some(u)
                    if u.updated.0.as_millisecond()
                        >= ledger.at_ms - ledger.at_ms.rem_euclid(1000) =>
                {
                    Observed::Ready(u)
                }
                other => Observed::NotYet(format!("{other:?}")),
            })
        },
    )
    .await?;
    ensure!(
        (usage.accelerator_seconds - total.round() as i64).abs() <= 1,
        "status.usage.acceleratorSeconds {} vs the ledger's {total:.1}",
        usage.accelerator_seconds
    );
    ensure!(
        usage.tenants.iter().any(|t| t.name == OWNER)
            && usage.tenants.iter().any(|t| t.name == "team-a"),
        "status.usage.tenants: {:?}",
        usage.tenants
    );
    Ok(())
}

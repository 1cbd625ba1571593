//! The meter: every [`TICK`], each LLMService with backend pods has their device time charged
//! to its tenants and phases ([`crate::metering`]), from the pod cache, the pods' deletions
//! seen by the watch ([`tap_gone`]) and the gateway replicas' [`METERING_PATH`] reports.
//!
//! The [`Ledger`] lives in the ConfigMap `<service>-usage` (owned by the service, so deleted
//! with it), written every [`PERSIST`] while something is charged and at once when a pod
//! goes; `status.usage` is written with it (server-side apply, field manager
//! [`FIELD_MANAGER`]). A restarted controller (or a new leader) reads the ledger and charges
//! the time since it was written: nothing is lost but the deletion times of pods that went
//! while no controller ran (charged until the meter saw them gone).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{FutureExt, StreamExt, stream};
use hearth_crds::{
    LLMService, TenantUsage, Usage, UsagePhases,
    metering::{METERING_PATH, MeteringReport},
    wellknown::LLMSERVICE_LABEL,
};
use k8s_openapi::{
    api::core::v1::{ConfigMap, Pod},
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{Patch, PatchParams},
    runtime::reflector::{ObjectRef, Store},
};

use super::{Context, handover};
use crate::{
    metering::{self, Charges, LEDGER_KEY, Ledger, Observation, Phase, PhaseSeconds, PodNow, TICK},
    metrics::UsageLabel,
    names,
};

/// The field manager of the ledger ConfigMaps and `status.usage`.
pub const FIELD_MANAGER: &str = "hearth-metering";
/// How often a ledger that charges is written.
pub const PERSIST: Duration = Duration::from_secs(30);
/// Gateway reports read at once.
const CONCURRENCY: usize = 16;
/// A metering report's size limit.
const REPORT_LIMIT: usize = 1 << 20;
/// How long a pod's deletion time is kept for the meter.
const GONE_KEPT_MS: i64 = 10 * 60 * 1000;

/// Deletion times of backend pods, by UID, Unix milliseconds.
pub(super) type GoneLog = Arc<Mutex<BTreeMap<String, i64>>>;

fn now_ms() -> i64 {
    Timestamp::now().as_millisecond()
}

/// Records in `gone` the pods of `stream` (after the reflector wrote `store`) that are no
/// longer in the store: their deletion, seen when it happened. Nothing is recorded while the
/// first list is read (the store is not ready, so every pod would look absent); a pod that
/// looks absent during a re-list (created while the watch was down) gets a time its real
/// deletion later replaces, and the meter reads it only for pods it no longer sees.
pub(super) fn tap_gone<S, E>(
    stream: S,
    store: Store<Pod>,
    gone: GoneLog,
) -> impl futures::Stream<Item = Result<Pod, E>> + Send + 'static
where
    S: futures::Stream<Item = Result<Pod, E>> + Send + 'static,
{
    stream.map(move |item| {
        if let Ok(pod) = &item
            && let Some(uid) = pod.uid()
            && store.wait_until_ready().now_or_never().is_some()
            && store
                .get(&ObjectRef::from_obj(pod))
                .is_none_or(|p| p.uid().as_deref() != Some(uid.as_str()))
        {
            gone.lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(uid, now_ms());
        }
        item
    })
}

/// One service's ledger in memory.
struct Entry {
    ledger: Ledger,
    /// When it was last written; `None`: never by this process.
    written: Option<Instant>,
}

/// Runs the meter until the process ends.
pub(super) async fn run(ctx: Arc<Context>, gone: GoneLog) {
    let mut ledgers: HashMap<(String, String), Option<Entry>> = HashMap::new();
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if !ctx.caches_synced() {
            continue;
        }
        let services = ctx.llmservices.state();
        ledgers.retain(|(ns, name), _| {
            services
                .iter()
                .any(|s| s.namespace().as_deref() == Some(ns) && s.name_any() == *name)
        });
        let now = now_ms();
        let gone_now = {
            let mut g = gone.lock().unwrap_or_else(|e| e.into_inner());
            g.retain(|_, at| *at > now - GONE_KEPT_MS);
            g.clone()
        };
        // The services with something to charge: pods now, or pods at the last tick.
        let mut by_service = backend_pods(&ctx);
        let mut work = Vec::new();
        for svc in services {
            let key = (svc.namespace().unwrap_or_default(), svc.name_any());
            let pods = by_service.remove(&key).unwrap_or_default();
            if !ledgers.contains_key(&key) {
                match load(&ctx, &key.0, &key.1).await {
                    Ok(ledger) => {
                        let entry = ledger.map(|ledger| Entry {
                            ledger,
                            written: None,
                        });
                        ledgers.insert(key.clone(), entry);
                    }
                    Err(e) => {
                        tracing::warn!(llmservice = %format!("{}/{}", key.0, key.1), error = %e, "reading the usage ledger; metering it at the next tick");
                        continue;
                    }
                }
            }
            let had_pods = ledgers
                .get(&key)
                .and_then(Option::as_ref)
                .is_some_and(|e| !e.ledger.pods.is_empty());
            if pods.is_empty() && !had_pods {
                continue;
            }
            work.push((svc, pods));
        }
        let observed: Vec<_> = stream::iter(work)
            .map(|(svc, pods)| {
                let ctx = ctx.clone();
                async move {
                    let gateways = reports(&ctx, &svc).await;
                    (svc, pods, gateways)
                }
            })
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        let now = now_ms();
        for (svc, pods, gateways) in observed {
            let key = (svc.namespace().unwrap_or_default(), svc.name_any());
            let entry = ledgers
                .entry(key.clone())
                .or_insert(None)
                .get_or_insert_with(|| Entry {
                    ledger: metering::new_ledger(now),
                    written: None,
                });
            let before = entry.ledger.pods.len();
            let obs = Observation {
                now_ms: now,
                pods,
                gone_ms: gone_now.clone(),
                gateways,
                warm_window: crate::handover::open_warm_window(&svc, now / 1000).is_some(),
                owner: owner(&svc),
            };
            let charged = metering::advance(&mut entry.ledger, &obs);
            count(&ctx, &key, &charged);
            let due = entry.written.is_none_or(|w| w.elapsed() >= PERSIST);
            if due || entry.ledger.pods.len() < before {
                match persist(&ctx, &svc, &entry.ledger).await {
                    Ok(()) => entry.written = Some(Instant::now()),
                    Err(e) => {
                        tracing::warn!(llmservice = %format!("{}/{}", key.0, key.1), error = %e, "writing the usage ledger; retrying at the next tick")
                    }
                }
            }
        }
    }
}

/// The tenant charged for what no request used: `spec.owner`, else the namespace.
pub fn owner(svc: &LLMService) -> String {
    svc.spec
        .owner
        .clone()
        .unwrap_or_else(|| svc.namespace().unwrap_or_default())
}

/// The backend pods in the cache by service (`(namespace, name)`), as the meter reads them;
/// a pod that finished (`Succeeded`, `Failed`) and is not being deleted (an evicted pod kept
/// for its record) holds no device and is left out; one being deleted counts until it is gone.
pub(super) fn backend_pods(ctx: &Context) -> HashMap<(String, String), Vec<PodNow>> {
    let mut out: HashMap<(String, String), Vec<PodNow>> = HashMap::new();
    for p in ctx.pods.state() {
        let finished = matches!(
            p.status.as_ref().and_then(|s| s.phase.as_deref()),
            Some("Succeeded" | "Failed")
        );
        if finished && p.metadata.deletion_timestamp.is_none() {
            continue;
        }
        let (Some(ns), Some(name)) = (p.namespace(), p.labels().get(LLMSERVICE_LABEL)) else {
            continue;
        };
        out.entry((ns, name.clone())).or_default().push(pod_now(&p));
    }
    out
}

/// A pod as [`metering::advance`] reads it.
pub fn pod_now(p: &Pod) -> PodNow {
    PodNow {
        uid: p.uid().unwrap_or_default(),
        name: p.name_any(),
        devices: metering::devices(p),
        scheduled_ms: crate::activation::condition_true_since(p, "PodScheduled")
            .map(|t| t.as_millisecond()),
        ready_ms: crate::activation::ready_since(p).map(|t| t.as_millisecond()),
        ip: p.status.as_ref().and_then(|s| s.pod_ip.clone()),
    }
}

/// Every gateway replica's report of `svc`; `None` when any could not be read.
async fn reports(
    ctx: &Context,
    svc: &LLMService,
) -> Option<Vec<(String, hearth_crds::metering::ServiceMetering)>> {
    let (key, answers) = match handover::ask_gateways::<MeteringReport>(
        ctx,
        svc,
        |key| handover::for_service(METERING_PATH, key),
        REPORT_LIMIT,
    )
    .await
    {
        Ok(a) => a,
        Err(e) => {
            tracing::debug!(llmservice = %svc.name_any(), error = %e, "no gateway to meter");
            return None;
        }
    };
    let mut out = Vec::new();
    for (ip, a) in answers {
        match a {
            Ok(r) => out.push(r),
            Err(e) => {
                tracing::info!(llmservice = %svc.name_any(), gateway = %ip, error = %e, "reading a gateway's metering report failed; this tick is charged without its activity");
                return None;
            }
        }
    }
    Some(metering::reports_of(&out, &key))
}

/// Reads the ledger from the ConfigMap; `Ok(None)` when there is none.
async fn load(ctx: &Context, ns: &str, name: &str) -> Result<Option<Ledger>, String> {
    let cm = Api::<ConfigMap>::namespaced(ctx.client.clone(), ns)
        .get_opt(&names::usage(name))
        .await
        .map_err(|e| e.to_string())?;
    let Some(json) = cm.as_ref().and_then(|c| c.data.as_ref()?.get(LEDGER_KEY)) else {
        return Ok(None);
    };
    match serde_json::from_str(json) {
        Ok(l) => Ok(Some(l)),
        Err(e) => {
            // A ledger that does not parse (edited by hand) is started anew, not retried.
            tracing::warn!(llmservice = %format!("{ns}/{name}"), error = %e, "the usage ledger does not parse; starting a new one");
            Ok(None)
        }
    }
}

/// Adds a tick's charges to `hearth_accelerator_seconds_total`.
fn count(ctx: &Context, (ns, name): &(String, String), charged: &Charges) {
    for (tenant, secs) in charged {
        for phase in Phase::ALL {
            let s = secs.get(phase);
            if s > 0.0 {
                ctx.metrics
                    .accelerator_seconds
                    .get_or_create(&UsageLabel {
                        service: format!("{ns}/{name}"),
                        tenant: tenant.clone(),
                        phase: phase.as_str(),
                    })
                    .inc_by(s);
            }
        }
    }
}

/// Writes the ledger's ConfigMap and `status.usage`.
async fn persist(ctx: &Context, svc: &LLMService, ledger: &Ledger) -> Result<(), String> {
    let ns = svc.namespace().unwrap_or_default();
    let name = svc.name_any();
    let json = serde_json::to_string(ledger).map_err(|e| e.to_string())?;
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some(names::usage(&name)),
            namespace: Some(ns.clone()),
            labels: Some(
                [
                    ("app.kubernetes.io/name".to_owned(), "hearth".to_owned()),
                    (
                        "app.kubernetes.io/component".to_owned(),
                        metering::LEDGER_COMPONENT.to_owned(),
                    ),
                    (LLMSERVICE_LABEL.to_owned(), name.clone()),
                ]
                .into(),
            ),
            owner_references: svc.controller_owner_ref(&()).map(|mut o| {
                o.controller = Some(false);
                vec![o]
            }),
            ..ObjectMeta::default()
        },
        data: Some([(LEDGER_KEY.to_owned(), json)].into()),
        ..ConfigMap::default()
    };
    let params = PatchParams::apply(FIELD_MANAGER).force();
    Api::<ConfigMap>::namespaced(ctx.client.clone(), &ns)
        .patch(&names::usage(&name), &params, &Patch::Apply(&cm))
        .await
        .map_err(|e| format!("apply ConfigMap {}: {e}", names::usage(&name)))?;
    let patch = serde_json::json!({
        "apiVersion": LLMService::api_version(&()),
        "kind": LLMService::kind(&()),
        "status": { "usage": usage(ledger) },
    });
    Api::<LLMService>::namespaced(ctx.client.clone(), &ns)
        .patch_status(&name, &params, &Patch::Apply(&patch))
        .await
        .map_err(|e| format!("apply status.usage: {e}"))?;
    ctx.metrics.writes.inc_by(2);
    Ok(())
}

/// `status.usage` from a ledger: whole seconds.
pub fn usage(ledger: &Ledger) -> Usage {
    let time = |ms: i64| Time(Timestamp::from_millisecond(ms).unwrap_or(Timestamp::UNIX_EPOCH));
    let phases = |p: &PhaseSeconds| UsagePhases {
        cold_start: p.cold_start.round() as i64,
        serving: p.serving.round() as i64,
        idle: p.idle.round() as i64,
        sleeping: p.sleeping.round() as i64,
        warm_window: p.warm_window.round() as i64,
    };
    Usage {
        since: time(ledger.since_ms),
        updated: time(ledger.at_ms),
        accelerator_seconds: metering::charges_total(&ledger.totals).round() as i64,
        phases: phases(&metering::by_phase(&ledger.totals)),
        tenants: ledger
            .totals
            .iter()
            .map(|(name, p)| TenantUsage {
                name: name.clone(),
                accelerator_seconds: p.total().round() as i64,
                phases: phases(p),
            })
            .collect(),
    }
}

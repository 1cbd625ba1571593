//! Timelines sampled every 100 ms, for asserting 0 → 1 → N → 0 and for printing the demo's
//! timeline: a Deployment's replicas (desired, ready), and the milestones of its pods
//! (created, scheduled, started, Ready, gone).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use tokio::task::JoinHandle;

/// One change of `(spec.replicas, status.readyReplicas)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub at: Instant,
    /// `spec.replicas` (what KEDA/the HPA asked for).
    pub desired: i32,
    /// `status.readyReplicas`.
    pub ready: i32,
}

/// Samples a Deployment until dropped.
pub struct Timeline {
    samples: Arc<Mutex<Vec<Sample>>>,
    task: JoinHandle<()>,
}

impl Timeline {
    /// Starts sampling Deployment `name` in `namespace` (absent counts as 0/0).
    pub fn start(client: Client, namespace: &str, name: &str) -> Timeline {
        let api: Api<Deployment> = Api::namespaced(client, namespace);
        let samples: Arc<Mutex<Vec<Sample>>> = Arc::default();
        let out = samples.clone();
        let name = name.to_string();
        let task = tokio::spawn(async move {
            loop {
                if let Ok(d) = api.get_opt(&name).await {
                    let desired = d
                        .as_ref()
                        .and_then(|d| d.spec.as_ref())
                        .and_then(|s| s.replicas)
                        .unwrap_or(0);
                    let ready = d
                        .as_ref()
                        .and_then(|d| d.status.as_ref())
                        .and_then(|s| s.ready_replicas)
                        .unwrap_or(0);
                    let mut s = out.lock().unwrap_or_else(|e| e.into_inner());
                    if s.last()
                        .is_none_or(|l| (l.desired, l.ready) != (desired, ready))
                    {
                        s.push(Sample {
                            at: Instant::now(),
                            desired,
                            ready,
                        });
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        Timeline { samples, task }
    }

    /// Every change so far.
    pub fn samples(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The latest sample.
    pub fn last(&self) -> Option<Sample> {
        self.samples().last().copied()
    }

    /// First time `pred` held after `after`.
    pub fn first_after(&self, after: Instant, pred: impl Fn(&Sample) -> bool) -> Option<Instant> {
        self.samples()
            .iter()
            .find(|s| s.at >= after && pred(s))
            .map(|s| s.at)
    }

    /// The highest `desired` seen.
    pub fn max_desired(&self) -> i32 {
        self.samples().iter().map(|s| s.desired).max().unwrap_or(0)
    }

    /// The highest `ready` seen.
    pub fn max_ready(&self) -> i32 {
        self.samples().iter().map(|s| s.ready).max().unwrap_or(0)
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What happened to one pod, as first seen by the sampler (local clock, 100 ms resolution; the
/// API's own timestamps have whole seconds).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodMilestones {
    pub name: String,
    /// First seen (created).
    pub created: Option<Instant>,
    /// `spec.nodeName` set: the scheduler bound it.
    pub scheduled: Option<Instant>,
    /// Every regular container `running` (the kubelet started them).
    pub started: Option<Instant>,
    /// Condition `Ready` true.
    pub ready: Option<Instant>,
    /// No longer listed (the kubelet confirmed its deletion).
    pub gone: Option<Instant>,
}

/// Samples the pods of a label selector until dropped, per pod UID.
pub struct PodTimeline {
    pods: Arc<Mutex<Vec<(String, PodMilestones)>>>,
    task: JoinHandle<()>,
}

impl PodTimeline {
    /// Starts sampling pods matching `selector` in `namespace` every 100 ms.
    pub fn start(client: Client, namespace: &str, selector: &str) -> PodTimeline {
        let api: Api<Pod> = Api::namespaced(client, namespace);
        let pods: Arc<Mutex<Vec<(String, PodMilestones)>>> = Arc::default();
        let out = pods.clone();
        let lp = ListParams::default().labels(selector);
        let task = tokio::spawn(async move {
            loop {
                if let Ok(list) = api.list(&lp).await {
                    let now = Instant::now();
                    let mut seen = out.lock().unwrap_or_else(|e| e.into_inner());
                    let uids: Vec<String> = list
                        .items
                        .iter()
                        .filter_map(|p| p.metadata.uid.clone())
                        .collect();
                    for (uid, m) in seen.iter_mut() {
                        if m.gone.is_none() && !uids.contains(uid) {
                            m.gone = Some(now);
                        }
                    }
                    for p in &list.items {
                        let Some(uid) = p.metadata.uid.clone() else {
                            continue;
                        };
                        let i = match seen.iter().position(|(u, _)| *u == uid) {
                            Some(i) => i,
                            None => {
                                seen.push((
                                    uid,
                                    PodMilestones {
                                        name: p.metadata.name.clone().unwrap_or_default(),
                                        created: Some(now),
                                        ..Default::default()
                                    },
                                ));
                                seen.len() - 1
                            }
                        };
                        let m = &mut seen[i].1;
                        let spec = p.spec.as_ref();
                        let status = p.status.as_ref();
                        if m.scheduled.is_none()
                            && spec.and_then(|s| s.node_name.as_ref()).is_some()
                        {
                            m.scheduled = Some(now);
                        }
                        let statuses = status
                            .and_then(|s| s.container_statuses.as_ref())
                            .filter(|c| !c.is_empty());
                        if m.started.is_none()
                            && statuses.is_some_and(|c| {
                                c.iter()
                                    .all(|c| c.state.as_ref().is_some_and(|s| s.running.is_some()))
                            })
                        {
                            m.started = Some(now);
                        }
                        if m.ready.is_none()
                            && status.and_then(|s| s.conditions.as_ref()).is_some_and(|c| {
                                c.iter().any(|c| c.type_ == "Ready" && c.status == "True")
                            })
                        {
                            m.ready = Some(now);
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        PodTimeline { pods, task }
    }

    /// Every pod seen so far, in order of first sighting.
    pub fn pods(&self) -> Vec<PodMilestones> {
        self.pods
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(_, m)| m.clone())
            .collect()
    }

    /// The first pod first seen at or after `after`.
    pub fn first_after(&self, after: Instant) -> Option<PodMilestones> {
        self.pods()
            .into_iter()
            .find(|m| m.created.is_some_and(|c| c >= after))
    }
}

impl Drop for PodTimeline {
    fn drop(&mut self) {
        self.task.abort();
    }
}

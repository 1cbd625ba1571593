//! A timeline of a Deployment's replicas (desired, ready), sampled every 100 ms, for asserting
//! 0 → 1 → N → 0 and for printing the demo's timeline.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
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

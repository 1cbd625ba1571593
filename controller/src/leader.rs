//! Leader election on a `coordination.k8s.io/v1` Lease, the way client-go's `leaderelection`
//! does it: the holder renews `renewTime` every `renew_interval`; a candidate takes the Lease
//! once `renewTime + leaseDurationSeconds` has passed. Writes use the Lease's
//! `resourceVersion`, so two candidates cannot both win (the loser gets 409 Conflict).
//! kube-runtime 5 has no leader election of its own.

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, Client, api::PostParams};
use tokio::sync::watch;

/// Where the Lease lives and how long it lasts.
#[derive(Clone, Debug)]
pub struct LeaseConfig {
    /// Lease name.
    pub name: String,
    /// Lease namespace.
    pub namespace: String,
    /// This candidate's identity (`holderIdentity`), unique per process.
    pub identity: String,
    /// `leaseDurationSeconds`: how long a silent holder keeps the Lease.
    pub lease_duration: Duration,
    /// How often the holder renews (well under `lease_duration`).
    pub renew_interval: Duration,
}

/// Why leadership could not be held.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    /// The Lease could not be read or written.
    #[error("lease {namespace}/{name}: {source}")]
    Kube {
        /// Lease namespace.
        namespace: String,
        /// Lease name.
        name: String,
        /// The API error.
        source: kube::Error,
    },
}

fn now() -> MicroTime {
    MicroTime(Timestamp::now())
}

/// One attempt to take or renew the Lease. `Ok(true)` when this candidate holds it afterwards.
pub async fn try_acquire(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, kube::Error> {
    let duration_secs = i32::try_from(cfg.lease_duration.as_secs()).unwrap_or(i32::MAX);
    let existing = api.get_opt(&cfg.name).await?;
    let Some(mut lease) = existing else {
        let lease = Lease {
            metadata: ObjectMeta {
                name: Some(cfg.name.clone()),
                ..Default::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(cfg.identity.clone()),
                lease_duration_seconds: Some(duration_secs),
                acquire_time: Some(now()),
                renew_time: Some(now()),
                lease_transitions: Some(0),
                ..Default::default()
            }),
        };
        return match api.create(&PostParams::default(), &lease).await {
            Ok(_) => Ok(true),
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
            Err(e) => Err(e),
        };
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    let holder = spec.holder_identity.clone().unwrap_or_default();
    let mine = holder == cfg.identity;
    let expired = match (&spec.renew_time, spec.lease_duration_seconds) {
        (Some(renew), Some(secs)) => {
            let deadline = renew.0 + jiff_secs(i64::from(secs));
            Timestamp::now() > deadline
        }
        _ => true,
    };
    if !mine && !holder.is_empty() && !expired {
        return Ok(false);
    }
    if !mine {
        spec.holder_identity = Some(cfg.identity.clone());
        spec.acquire_time = Some(now());
        spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0) + 1);
    }
    spec.lease_duration_seconds = Some(duration_secs);
    spec.renew_time = Some(now());
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

fn jiff_secs(secs: i64) -> k8s_openapi::jiff::SignedDuration {
    k8s_openapi::jiff::SignedDuration::from_secs(secs)
}

/// Blocks until this candidate holds the Lease, then keeps renewing it in the background.
/// The returned receiver turns `false` when leadership is lost (renewal failed for longer than
/// the lease duration, or another holder took over): the caller must stop working then.
pub async fn acquire(
    client: Client,
    cfg: LeaseConfig,
) -> Result<watch::Receiver<bool>, LeaderError> {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    let err = |source| LeaderError::Kube {
        namespace: cfg.namespace.clone(),
        name: cfg.name.clone(),
        source,
    };
    loop {
        match try_acquire(&api, &cfg).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(kube::Error::Api(e)) if e.code >= 500 => {}
            Err(e) => return Err(err(e)),
        }
        tokio::time::sleep(cfg.renew_interval).await;
    }
    tracing::info!(lease = %cfg.name, identity = %cfg.identity, "acquired leadership");
    let (tx, rx) = watch::channel(true);
    tokio::spawn(async move {
        let mut last_ok = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(cfg.renew_interval).await;
            match try_acquire(&api, &cfg).await {
                Ok(true) => last_ok = tokio::time::Instant::now(),
                Ok(false) => {
                    tracing::warn!(lease = %cfg.name, "another candidate holds the lease");
                    let _ = tx.send(false);
                    return;
                }
                Err(e) => {
                    tracing::warn!(lease = %cfg.name, error = %e, "lease renewal failed");
                    if last_ok.elapsed() >= cfg.lease_duration {
                        let _ = tx.send(false);
                        return;
                    }
                }
            }
        }
    });
    Ok(rx)
}

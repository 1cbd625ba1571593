//! Leader election on a `coordination.k8s.io/v1` Lease, the way client-go's `leaderelection`
//! does it: the holder renews `renewTime` every `renew_interval`; a candidate takes the Lease
//! once `renewTime + leaseDurationSeconds` has passed. Writes use the Lease's
//! `resourceVersion`, so two candidates cannot both win (the loser gets 409 Conflict). A holder
//! that stops gracefully releases the Lease (client-go's `ReleaseOnCancel`: `holderIdentity`
//! emptied, `leaseDurationSeconds: 1`), so a standby takes over within one `renew_interval`
//! instead of waiting out the lease. kube-runtime 5 has no leader election of its own.

use std::time::Duration;

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, Client, api::PostParams};
use tokio::{sync::watch, task::JoinHandle};

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

/// Gives the Lease up if this candidate holds it, as client-go's `ReleaseOnCancel` does:
/// `holderIdentity` emptied and `leaseDurationSeconds: 1`, so the next candidate's attempt
/// takes it. `Ok(false)` when another candidate holds it (nothing is written) or took it
/// concurrently (409).
pub async fn release(api: &Api<Lease>, cfg: &LeaseConfig) -> Result<bool, kube::Error> {
    let Some(mut lease) = api.get_opt(&cfg.name).await? else {
        return Ok(false);
    };
    let spec = lease.spec.get_or_insert_with(Default::default);
    if spec.holder_identity.as_deref() != Some(cfg.identity.as_str()) {
        return Ok(false);
    }
    spec.holder_identity = Some(String::new());
    spec.lease_duration_seconds = Some(1);
    spec.renew_time = Some(now());
    spec.acquire_time = Some(now());
    match api.replace(&cfg.name, &PostParams::default(), &lease).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(false),
        Err(e) => Err(e),
    }
}

/// Whether a failed Lease request is worth repeating: everything but the answers a retry
/// cannot change (400 Bad Request, 401 Unauthorized, 403 Forbidden, 422 Invalid: a
/// misconfigured identity, RBAC or Lease name). Connection errors, timeouts, 404 (the
/// namespace is not there yet), 409, 429 and 5xx are retried, as client-go does.
fn retryable(e: &kube::Error) -> bool {
    !matches!(e, kube::Error::Api(s) if matches!(s.code, 400 | 401 | 403 | 422))
}

/// The Lease held by this candidate, renewed in the background until [`Leadership::release`]
/// or loss.
#[derive(Debug)]
pub struct Leadership {
    api: Api<Lease>,
    cfg: LeaseConfig,
    holding: watch::Receiver<bool>,
    renewer: JoinHandle<()>,
}

impl Leadership {
    /// Turns `false` when leadership is lost (renewal failed for longer than the lease
    /// duration, or another holder took over): the caller must stop working then.
    pub fn holding(&self) -> watch::Receiver<bool> {
        self.holding.clone()
    }

    /// Stops renewing and gives the Lease up ([`release`]), so a standby takes over at its
    /// next attempt. Call it once the work that needs leadership has stopped. `Ok(false)` when
    /// the Lease was no longer this candidate's.
    ///
    /// # Errors
    /// [`LeaderError::Kube`] when the Lease could not be read or written; it then expires on
    /// its own after `lease_duration`.
    pub async fn release(self) -> Result<bool, LeaderError> {
        self.renewer.abort();
        let _ = self.renewer.await;
        release(&self.api, &self.cfg)
            .await
            .map_err(|source| LeaderError::Kube {
                namespace: self.cfg.namespace.clone(),
                name: self.cfg.name.clone(),
                source,
            })
    }
}

/// Blocks until this candidate holds the Lease (retrying every `renew_interval` while it is
/// held by another or the apiserver cannot be reached), then keeps renewing it in the
/// background. Cancel-safe: dropping the future stops campaigning.
///
/// # Errors
/// [`LeaderError::Kube`] on an answer a retry cannot change (400, 401, 403, 422).
pub async fn acquire(client: Client, cfg: LeaseConfig) -> Result<Leadership, LeaderError> {
    let api: Api<Lease> = Api::namespaced(client, &cfg.namespace);
    loop {
        match try_acquire(&api, &cfg).await {
            Ok(true) => break,
            Ok(false) => {}
            Err(e) if retryable(&e) => {
                tracing::warn!(lease = %cfg.name, error = %e, "lease request failed; retrying");
            }
            Err(source) => {
                return Err(LeaderError::Kube {
                    namespace: cfg.namespace.clone(),
                    name: cfg.name.clone(),
                    source,
                });
            }
        }
        tokio::time::sleep(cfg.renew_interval).await;
    }
    tracing::info!(lease = %cfg.name, identity = %cfg.identity, "acquired leadership");
    let (tx, holding) = watch::channel(true);
    let renewer = {
        let (api, cfg) = (api.clone(), cfg.clone());
        tokio::spawn(async move {
            let mut last_ok = tokio::time::Instant::now();
            loop {
                tokio::time::sleep(cfg.renew_interval).await;
                // A renewal may not outlive the Lease: an answer that never comes (a connection
                // an apiserver restart left hanging) must end in "lost", not in two leaders.
                let left = cfg.lease_duration.saturating_sub(last_ok.elapsed());
                let renewed = match tokio::time::timeout(left, try_acquire(&api, &cfg)).await {
                    Ok(r) => r.map_err(|e| e.to_string()),
                    Err(_) => Err(format!("no answer within {left:?}")),
                };
                match renewed {
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
        })
    };
    Ok(Leadership {
        api,
        cfg,
        holding,
        renewer,
    })
}

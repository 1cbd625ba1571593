//! Polling with a deadline and a useful failure message.

use std::fmt::Display;
use std::future::Future;
use std::time::Duration;

use anyhow::{Result, bail};
use tokio::time::{Instant, sleep};

/// How often [`wait_until`] probes.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// What one probe of [`wait_until`] saw.
#[derive(Debug)]
pub enum Observed<T> {
    /// The condition holds; the wait ends with this value.
    Ready(T),
    /// Not yet; the text describes the state seen, for the timeout message.
    NotYet(String),
}

/// Probes every 250 ms until `probe` returns [`Observed::Ready`], and returns its value.
///
/// A probe error (e.g. an API call failing while a component starts) is recorded as the last
/// observation and retried. After `timeout` the error says what was awaited (`what`), for how
/// long, and the last observation.
pub async fn wait_until<T, F, Fut>(what: impl Display, timeout: Duration, mut probe: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Observed<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(Observed::Ready(value)) => return Ok(value),
            Ok(Observed::NotYet(state)) => state,
            Err(e) => format!("probe failed: {e:#}"),
        };
        if Instant::now() >= deadline {
            bail!("timed out after {timeout:?} waiting for {what}; last observed: {last}");
        }
        sleep(POLL_INTERVAL).await;
    }
}

/// Waits until each CustomResourceDefinition of `names` is `Established` (its API is served),
/// up to 30 s each.
///
/// # Errors
/// A CRD that is not established in time, naming it and what was seen.
pub async fn wait_crds_established(client: &kube::Client, names: &[String]) -> Result<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: kube::Api<CustomResourceDefinition> = kube::Api::all(client.clone());
    for n in names {
        wait_until(
            format!("CRD {n} established"),
            Duration::from_secs(30),
            || async {
                let crd = crds.get(n).await?;
                let ok = crd
                    .status
                    .and_then(|s| s.conditions)
                    .into_iter()
                    .flatten()
                    .any(|c| c.type_ == "Established" && c.status == "True");
                Ok(if ok {
                    Observed::Ready(())
                } else {
                    Observed::NotYet("not established".into())
                })
            },
        )
        .await?;
    }
    Ok(())
}

/// Applies the Policy Reports API's PolicyReport CRD as the chart ships it
/// (`charts/hearth/files/policyreports.wgpolicyk8s.io.yaml`, installed with
/// `policyReports.installCRD`), as a policy engine would have installed it, and waits until it is
/// served. Idempotent (server-side apply).
///
/// # Errors
/// When the file cannot be read or the CRD is not applied and established.
pub async fn install_policy_report_crd(client: &kube::Client) -> Result<()> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let path = crate::images::chart_dir().join("files/policyreports.wgpolicyk8s.io.yaml");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
    let crd: CustomResourceDefinition = serde_yaml::from_str(&text)?;
    let name = "policyreports.wgpolicyk8s.io";
    kube::Api::<CustomResourceDefinition>::all(client.clone())
        .patch(
            name,
            &kube::api::PatchParams::apply("hearth-tests").force(),
            &kube::api::Patch::Apply(&crd),
        )
        .await?;
    wait_crds_established(client, &[name.to_owned()]).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[tokio::test]
    async fn returns_the_ready_value() {
        let calls = Cell::new(0);
        let value = wait_until("the third call", Duration::from_secs(60), || {
            calls.set(calls.get() + 1);
            let n = calls.get();
            async move {
                Ok(if n == 3 {
                    Observed::Ready(n)
                } else {
                    Observed::NotYet(format!("call {n}"))
                })
            }
        })
        .await
        .unwrap();
        assert_eq!(value, 3);
    }

    #[tokio::test]
    async fn timeout_names_the_wait_and_the_last_observation() {
        let err = wait_until("a thing that never happens", Duration::ZERO, || async {
            Ok(Observed::<()>::NotYet("still 7 pods".to_string()))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("waiting for a thing that never happens"),
            "{err}"
        );
        assert!(err.contains("last observed: still 7 pods"), "{err}");
    }

    #[tokio::test]
    async fn probe_errors_are_reported_as_the_last_observation() {
        let err = wait_until("an answer", Duration::ZERO, || async {
            Err::<Observed<()>, _>(anyhow::anyhow!("connection refused"))
        })
        .await
        .unwrap_err()
        .to_string();
        assert!(err.contains("probe failed: connection refused"), "{err}");
    }
}

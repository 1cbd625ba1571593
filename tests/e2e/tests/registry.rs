//! Hearth installed from the cluster's OCI registry, the way users install it, on the real node:
//!
//! - the registry (`tests/cluster/lib/registry.sh`: TLS with the cluster CA, basic auth) refuses
//!   anonymous and wrongly authenticated requests, and holds the chart `tests/cluster/install-hearth`
//!   pushed (`build/push`) as a Helm OCI artifact;
//! - the release runs the images `build/push` pushed, pinned by digest in the pushed chart's
//!   values, pulled by the node with the release's pull Secret (`image.pullSecrets`): the pods'
//!   image IDs are the pushed digests (or, on a node that pulled an earlier index holding the same
//!   platform image, that index's);
//! - a model whose image needs other credentials than its pull Secret has: the backend's pull is
//!   refused, the held request is answered with `ImagePullFailed` and the service's status records
//!   the kubelet's reason; with the right Secret the same service serves, its first activation
//!   with a real pull phase (`imagePresent: false`) and the next one with none;
//! - what was pushed is signed with the cluster's key pair and carries its SBOMs: cosign verifies
//!   each image index, each platform image, each platform image's CycloneDX attestation (about
//!   that image, describing its binary) and the chart against the registry with the public key;
//!   another key verifies nothing, and an image pushed unsigned has no signature.
//!
//! Needs the local cluster (`tests/cluster/up`) and Hearth's images (`build/images`).

mod stack;

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use hearth_e2e_harness::client;
use hearth_e2e_harness::stack::{self as hstack, RELEASE_NAMESPACE, ScalerMode};
use hearth_test_support::{Observed, wait_until};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams};
use serde_json::{Value, json};

use stack::SERVICE;
use stack::registry::Registry;

/// The pull Secret `tests/cluster/install-hearth` writes and the release names.
const PULL_SECRET: &str = "hearth-registry";

/// The chart's version (charts/hearth/Chart.yaml), which `build/push` pushes it under.
fn chart_version() -> Result<String> {
    let chart = std::fs::read_to_string(hstack::workspace_dir().join("charts/hearth/Chart.yaml"))?;
    chart
        .lines()
        .find_map(|l| l.strip_prefix("version:"))
        .map(|v| v.trim().trim_matches('"').to_owned())
        .context("charts/hearth/Chart.yaml has no version")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_release_runs_the_registrys_images_by_digest_with_its_pull_secret() -> Result<()> {
    let cluster = hearth_test_support::Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    let registry = Registry::load()?;
    let password = registry.password()?;

    // Authentication is on: anonymous and wrong credentials get 401, the right ones 200.
    for (what, credentials, want) in [
        ("anonymous", None, 401),
        (
            "a wrong password",
            Some(("hearth", "not-the-password")),
            401,
        ),
        (
            "the cluster's credentials",
            Some(("hearth", password.as_str())),
            200,
        ),
    ] {
        let (code, body) = registry.get("/v2/", credentials, "*/*").await?;
        ensure!(
            code == want,
            "GET /v2/ with {what}: {code} (want {want}): {body}"
        );
    }
    // The chart, as a Helm OCI artifact under its version.
    let version = chart_version()?;
    let creds = Some(("hearth", password.as_str()));
    let (code, body) = registry
        .get(
            &format!("/v2/charts/hearth/manifests/{version}"),
            creds,
            "application/vnd.oci.image.manifest.v1+json",
        )
        .await?;
    ensure!(code == 200, "the chart's manifest: {code} {body}");
    let manifest: Value = serde_json::from_str(&body)?;
    ensure!(
        manifest["config"]["mediaType"] == "application/vnd.cncf.helm.config.v1+json",
        "charts/hearth:{version} is not a Helm chart artifact: {manifest}"
    );

    // The release's Deployments name the pushed images by digest and the pull Secret; their
    // pods run exactly those digests.
    let images = hearth_test_support::pushed_images()?;
    let pinned = |name: &str| -> Result<(String, String)> {
        images
            .iter()
            .find(|i| i.name == name)
            .map(|i| (i.pinned(), i.digest.clone()))
            .with_context(|| format!("build/push pushed no {name}"))
    };
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), RELEASE_NAMESPACE);
    for component in ["hearth-webhook", "hearth-controller"] {
        let (image, digest) = pinned(component)?;
        ensure!(
            image.starts_with(&format!("{}/", registry.host)),
            "{image} is not in the cluster's registry"
        );
        let d = deployments.get(component).await?;
        let spec = d
            .spec
            .and_then(|s| s.template.spec)
            .context("no pod spec")?;
        let container = spec.containers.first().context("no container")?;
        ensure!(
            container.image.as_deref() == Some(image.as_str()),
            "{component} runs {:?}, not the pushed {image}",
            container.image
        );
        let secrets: Vec<String> = spec
            .image_pull_secrets
            .iter()
            .flatten()
            .map(|s| s.name.clone())
            .collect();
        ensure!(
            secrets == [PULL_SECRET],
            "{component}'s imagePullSecrets: {secrets:?}"
        );
        let running = pods
            .list(&ListParams::default().labels(&format!(
                "app.kubernetes.io/name=hearth,app.kubernetes.io/component={}",
                component.trim_start_matches("hearth-")
            )))
            .await?
            .items;
        ensure!(!running.is_empty(), "no {component} pod");
        // The node's platform image of the pushed index. The image ID is the index digest the
        // node pulled it by first: an earlier index holding the same platform image (a build
        // for fewer platforms, pushed before) keeps its digest there.
        let path = image
            .split_once('@')
            .and_then(|(r, _)| r.rsplit_once(':'))
            .and_then(|(r, _)| r.strip_prefix(&format!("{}/", registry.host)))
            .context("pinned reference")?
            .to_owned();
        let wanted = platform_image(&registry, &path, &digest).await?;
        for p in &running {
            let ids: Vec<String> = p
                .status
                .iter()
                .flat_map(|s| s.container_statuses.iter().flatten())
                .map(|c| c.image_id.clone())
                .collect();
            let id = ids
                .first()
                .and_then(|id| id.rsplit_once('@'))
                .map(|(_, d)| d.to_owned())
                .with_context(|| {
                    format!("{component} pod {:?} has no image ID", p.metadata.name)
                })?;
            ensure!(
                id == digest || platform_image(&registry, &path, &id).await? == wanted,
                "{component} pod {:?} runs image IDs {ids:?}, neither {digest} nor an index of its platform image {wanted}",
                p.metadata.name
            );
        }
    }
    // The pull Secret holds the registry's credentials for its host (the node has credentials of
    // its own too, so the pull alone does not prove the Secret right).
    let secret: k8s_openapi::api::core::v1::Secret =
        Api::namespaced(client.clone(), RELEASE_NAMESPACE)
            .get(PULL_SECRET)
            .await?;
    ensure!(
        secret.type_.as_deref() == Some("kubernetes.io/dockerconfigjson"),
        "{PULL_SECRET} is of type {:?}",
        secret.type_
    );
    let config: Value = secret
        .data
        .as_ref()
        .and_then(|d| d.get(".dockerconfigjson"))
        .map(|b| serde_json::from_slice(&b.0))
        .transpose()?
        .context("no .dockerconfigjson in the pull Secret")?;
    // The credentials `up` made, with which build/push and helm just pushed and pulled.
    let made = registry.auth_config()?;
    ensure!(
        config["auths"][registry.host.as_str()] == made["auths"][registry.host.as_str()]
            && !made["auths"][registry.host.as_str()].is_null(),
        "{PULL_SECRET} does not hold the cluster's registry credentials for {}",
        registry.host
    );
    // The gateway image the controller renders into every model's gateway is pinned the same way.
    let (gateway, _) = pinned("hearth-gateway")?;
    let controller = deployments.get("hearth-controller").await?;
    let args = controller
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .and_then(|c| c.args)
        .unwrap_or_default();
    ensure!(
        args.contains(&format!("--gateway-image={gateway}")),
        "the controller's --gateway-image is not the pushed {gateway}: {args:?}"
    );
    println!(
        "registry {}: anonymous and wrong credentials 401; charts/hearth:{version} a Helm artifact; release pinned to {}",
        registry.host,
        images
            .iter()
            .map(|i| format!("{}@{}", i.name, &i.digest[..19.min(i.digest.len())]))
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_pull_secret_is_the_backends_image_pull_failure_and_the_right_one_serves()
-> Result<()> {
    let cluster = hearth_test_support::Cluster::connect().await?;
    let client = cluster.client();
    hstack::ensure_hearth(&client, cluster.kubeconfig()).await?;
    let registry = Registry::load()?;
    let password = registry.password()?;
    // The stub under a repository of the test's own, with a tag no node has pulled: the first
    // activation pulls it for real. The pull Secrets are keyed by that repository, so they apply
    // to the backend's image alone (the gateway's pulls with the node's credentials).
    let id = std::process::id();
    let repository = "e2e-pull/vllm-stub";
    let tag = Registry::fresh_tag("run");
    registry
        .copy("vllm-stub:e2e", &format!("{repository}:{tag}"))
        .await?;
    let image = format!("{}/{repository}:{tag}", registry.host);
    let key = format!("{}/{repository}", registry.host);

    let name = format!("vllm-stub-pull-{id}");
    let mut rt = hstack::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    rt["metadata"] = json!({"name": name});
    // Below the upstream runtime: no service that names none resolves to this copy.
    rt["spec"]["priority"] = json!(1);
    rt["spec"]["container"]["image"] = json!(image);
    hstack::apply(&client, rt, None).await?;
    let runtimes = hstack::inference_runtimes(&client);
    let result = async {
        let secret = |name: &str, password: &str| {
            json!({
                "apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": name},
                "type": "kubernetes.io/dockerconfigjson",
                "stringData": {".dockerconfigjson": Registry::docker_config(&key, "hearth", password)},
            })
        };
        let d = stack::deploy_with(
            "e2e-pull",
            ScalerMode::Poll,
            vec![
                secret("pull-wrong", "not-the-password"),
                secret("pull-right", &password),
            ],
            |o| {
                o["spec"]["runtime"]["name"] = json!(name);
                o["spec"]["imagePullSecrets"] = json!([{"name": "pull-wrong"}]);
                o["spec"]["scaling"]["activationTimeout"] = json!("150s");
            },
        )
        .await?;
        let ns = d.ns.name().to_owned();
        let services = hstack::llm_services(&client, &ns);

        // 1. The wrong Secret: the held request is answered with the pull failure.
        let p = client::chat(&d.url, SERVICE, false, Duration::from_secs(180)).await?;
        ensure!(
            p.status == 503 && p.body.contains("activation_failed") && p.body.contains("ImagePullFailed"),
            "the held request with a wrong pull Secret answered {} {}",
            p.status,
            p.body
        );
        let svc = services.get(SERVICE).await?;
        let failure = &svc.data["status"]["lastActivationFailure"];
        let message = failure["message"].as_str().unwrap_or_default();
        ensure!(
            failure["reason"] == "ImagePullFailed"
                && failure["phase"] == "imagePull"
                && message.contains(&image)
                && message.to_ascii_lowercase().contains("unauthorized"),
            "status.lastActivationFailure after a wrong pull Secret: {failure}"
        );
        println!(
            "wrong pull Secret: 503 after {:.1}s; {}",
            (p.end - p.sent).as_secs_f64(),
            message
        );

        // 2. The right Secret: the same service serves, and its activation pulled the image.
        services
            .patch(
                SERVICE,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"imagePullSecrets": [{"name": "pull-right"}]}})),
            )
            .await?;
        stack::wait_ready_reason(&services, |r| r != "ImagePullFailed", Duration::from_secs(120))
            .await
            .context("the service still reports ImagePullFailed with the right Secret")?;
        let t = client::chat(&d.url, SERVICE, true, Duration::from_secs(150)).await?;
        ensure!(
            t.status == 200 && t.complete(),
            "with the right pull Secret: {} {:?}",
            t.status,
            t.events
        );
        let first = wait_activation(&services, None).await?;
        ensure!(
            first["imagePresent"] == false && first["phases"]["imagePull"].as_str().is_some_and(|d| d != "0s"),
            "the first activation after the pull: {first}"
        );
        // 3. Scaled to zero and woken again: the image is on the node, no pull.
        d.wait_zero(Duration::from_secs(180)).await?;
        let again = client::chat(&d.url, SERVICE, false, Duration::from_secs(150)).await?;
        ensure!(again.status == 200, "the second activation answered {} {}", again.status, again.body);
        let second = wait_activation(&services, first["podUID"].as_str()).await?;
        ensure!(
            second["imagePresent"] == true && second["phases"]["imagePull"] == "0s",
            "the second activation: {second}"
        );
        println!(
            "first activation (image pulled from the registry): {}\nsecond activation (image present): {}",
            first["phases"], second["phases"]
        );
        Ok(())
    }
    .await;
    let _ = runtimes.delete(&name, &DeleteParams::default()).await;
    result
}

/// The service's `status.lastActivation` once it is of another pod than `after`'s (podUID).
async fn wait_activation(
    services: &Api<kube::api::DynamicObject>,
    after: Option<&str>,
) -> Result<Value> {
    wait_until(
        "status.lastActivation of the new backend pod",
        Duration::from_secs(60),
        || async {
            let svc = services.get(SERVICE).await?;
            let a = svc.data["status"]["lastActivation"].clone();
            Ok(match a["podUID"].as_str() {
                Some(uid) if Some(uid) != after => Observed::Ready(a),
                _ => Observed::NotYet(format!("lastActivation: {a}")),
            })
        },
    )
    .await
}

/// What `tests/cluster/push-images` pushed is signed and carries its SBOMs, verified against the
/// registry with cosign and the cluster's public key, as a platform team verifies a release:
/// every image index and each of its platform images has a signature of that key; each platform
/// image has a signed CycloneDX attestation whose subject is that image and whose SBOM describes
/// the image's binary (its package, and the crates compiled into it); the chart's artifact is
/// signed. Another key verifies none of them, and an image pushed without signing has no
/// signature.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_and_chart_are_signed_and_carry_their_sboms() -> Result<()> {
    use base64::Engine as _;
    let registry = Registry::load()?;
    let key = registry.public_key();
    let key = key.to_str().context("key path")?;
    let password = registry.password()?;
    let creds = Some(("hearth", password.as_str()));
    let pushed = hearth_test_support::pushed_images()?;
    ensure!(
        pushed.len() == 4,
        "push-images recorded {} images: {pushed:?}",
        pushed.len()
    );
    let mut rows = Vec::new();
    for image in &pushed {
        let pinned = by_digest(image)?;
        let (repository, _) = pinned.split_once('@').context("pinned")?;
        let path = repository
            .strip_prefix(&format!("{}/", registry.host))
            .context("an image of another registry")?;
        // The index's signature.
        let (ok, out, err) = registry.verify(key, &pinned).await?;
        ensure!(ok, "cosign verify {pinned}: {err}");
        ensure!(
            out.contains(&format!("\"docker-manifest-digest\":\"{}\"", image.digest)),
            "cosign verify {pinned} printed no claim for its digest: {out}"
        );
        // Its platform images, from the index the registry serves.
        let (code, body) = registry
            .get(
                &format!("/v2/{path}/manifests/{}", image.digest),
                creds,
                "application/vnd.oci.image.index.v1+json",
            )
            .await?;
        ensure!(code == 200, "GET the index of {pinned}: {code} {body}");
        let index: Value = serde_json::from_str(&body)?;
        let platforms: Vec<(String, String)> = index["manifests"]
            .as_array()
            .context("not an image index")?
            .iter()
            .filter_map(|m| {
                Some((
                    m["platform"]["architecture"].as_str()?.to_owned(),
                    m["digest"].as_str()?.to_owned(),
                ))
            })
            .collect();
        ensure!(
            !platforms.is_empty(),
            "the index of {pinned} names no platform image: {body}"
        );
        for (arch, digest) in &platforms {
            let platform_ref = format!("{repository}@{digest}");
            let (ok, _, err) = registry.verify(key, &platform_ref).await?;
            ensure!(ok, "cosign verify {platform_ref} (linux/{arch}): {err}");
            let (ok, out, err) = registry
                .cosign(
                    &["verify-attestation"],
                    &[
                        "--key",
                        key,
                        "--insecure-ignore-tlog=true",
                        "--type",
                        "cyclonedx",
                        &platform_ref,
                    ],
                )
                .await?;
            ensure!(
                ok,
                "cosign verify-attestation {platform_ref} (linux/{arch}): {err}"
            );
            let envelope: Value = serde_json::from_str(out.lines().next().unwrap_or_default())
                .with_context(|| format!("cosign verify-attestation printed {out}"))?;
            let payload = base64::engine::general_purpose::STANDARD
                .decode(envelope["payload"].as_str().unwrap_or_default())?;
            let statement: Value = serde_json::from_slice(&payload)?;
            ensure!(
                statement["predicateType"] == "https://cyclonedx.org/bom"
                    && statement["subject"][0]["digest"]["sha256"]
                        == digest.trim_start_matches("sha256:"),
                "the attestation of {platform_ref} is not a CycloneDX SBOM about it: {}",
                statement["predicateType"]
            );
            let bom = &statement["predicate"];
            let components: Vec<&str> = bom["components"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|c| c["name"].as_str())
                .collect();
            ensure!(
                bom["bomFormat"] == "CycloneDX"
                    && bom["metadata"]["component"]["name"] == image.name.as_str()
                    && ["tokio", "hyper", "serde"]
                        .iter()
                        .all(|c| components.contains(c)),
                "the SBOM of {} linux/{arch} does not describe its binary: {} with {} components",
                image.name,
                bom["metadata"]["component"]["name"],
                components.len()
            );
            rows.push(format!(
                "{:<18} linux/{arch:<6} {digest} signed, SBOM {} components",
                image.name,
                components.len()
            ));
        }
    }
    // The chart's artifact.
    let chart = format!("{}/charts/hearth:{}", registry.host, chart_version()?);
    let (ok, _, err) = registry.verify(key, &chart).await?;
    ensure!(ok, "cosign verify {chart}: {err}");
    rows.push(format!("{chart} signed"));

    // Another key verifies nothing.
    let other = std::env::temp_dir().join(format!("hearth-other-key-{}", Registry::fresh_tag("k")));
    std::fs::create_dir_all(&other)?;
    let prefix = other.join("cosign");
    let status = tokio::process::Command::new(hearth_test_support::state_dir().join("bin/cosign"))
        .args(["generate-key-pair", "--output-key-prefix"])
        .arg(&prefix)
        .env("COSIGN_PASSWORD", "")
        .output()
        .await?;
    ensure!(
        status.status.success(),
        "cosign generate-key-pair: {}",
        String::from_utf8_lossy(&status.stderr)
    );
    let other_key = other.join("cosign.pub");
    let first = by_digest(&pushed[0])?;
    let (ok, _, err) = registry
        .verify(other_key.to_str().unwrap_or_default(), &first)
        .await?;
    let _ = std::fs::remove_dir_all(&other);
    ensure!(!ok, "{first} verified with a key that did not sign it");
    ensure!(
        err.contains("no matching signatures"),
        "cosign's refusal with another key: {err}"
    );
    // An image pushed without signing has no signature.
    let unsigned = format!(
        "{}/e2e/unsigned:{}",
        registry.host,
        Registry::fresh_tag("u")
    );
    let digest = registry
        .build_and_push(&unsigned, &[("README", b"not signed\n".to_vec())])
        .await?;
    let unsigned = format!(
        "{}@{digest}",
        unsigned.rsplit_once(':').map_or("", |(r, _)| r)
    );
    let (ok, _, err) = registry.verify(key, &unsigned).await?;
    ensure!(
        !ok && err.contains("no signatures found"),
        "cosign verify {unsigned} (never signed): ok={ok} {err}"
    );
    println!("{}", rows.join("\n"));
    Ok(())
}

/// `<registry>/<repository>@<digest>` of a pushed image (its tag dropped): what cosign signs.
fn by_digest(image: &hearth_test_support::PushedImage) -> Result<String> {
    let (repository, _tag) = image
        .reference
        .rsplit_once(':')
        .with_context(|| format!("{} has no tag", image.reference))?;
    Ok(format!("{repository}@{}", image.digest))
}

/// The digest of the image for this machine's architecture (the node's) in the image index
/// `<path>@<digest>` of the cluster's registry.
async fn platform_image(registry: &Registry, path: &str, digest: &str) -> Result<String> {
    let password = registry.password()?;
    let (code, body) = registry
        .get(
            &format!("/v2/{path}/manifests/{digest}"),
            Some(("hearth", password.as_str())),
            "application/vnd.oci.image.index.v1+json",
        )
        .await?;
    ensure!(code == 200, "GET the index {path}@{digest}: {code} {body}");
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    let index: Value = serde_json::from_str(&body)?;
    index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["platform"]["architecture"] == arch)
        .and_then(|m| m["digest"].as_str())
        .map(str::to_owned)
        .with_context(|| format!("the index {path}@{digest} has no linux/{arch} image: {body}"))
}

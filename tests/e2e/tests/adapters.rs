//! LoRA adapters on the real node: 50 `LLMAdapter`s on the upstream stub service, whose runtime
//! (a copy of the stub runtime named [`RUNTIME`]) serves adapters, loads at most [`MAX_LOADED`]
//! per engine, and takes [`LOAD_DELAY`] to load one (the stub's `STUB_LORA_LOAD_DELAY`). The
//! adapters' files are staged on a claim (a local volume of the node, filled by a Job), one
//! directory each, `pvc://lora/aNN`; three more come from the hubs (`hf://`, `modelscope://`,
//! the stub's built-in hub), fetched into the base's model cache (HostPath on the node) by the
//! controller's fetch Jobs.
//!
//! - Admission: an adapter above the runtime's `maxRank`, and one whose source is no model URI,
//!   are denied by the installed webhook.
//! - Acceptance: all 50 (and one whose directory is missing, and the hub ones) are `Accepted`;
//!   the hub ones are `Loaded=False` `Fetching` until their Job has fetched them; with the base
//!   at zero the others' `Loaded` is `False` (`NoReadyEngine`).
//! - Cold: an adapter request with the base at zero is held, wakes the base and gets its first
//!   token within the base's own cold start + 3 s (a cold request for the base model measured
//!   just before, from the base at zero as well).
//! - A bounded random loop over the 50: every answer is the adapter's (`[adapter aNN]`, `model`),
//!   the gateway unloads least recently used adapters (its `hearth_gateway_adapter_unloads_total`),
//!   and the adapters' `loadedOn` agrees with the engine's own `/v1/models` afterwards.
//! - Warm switches (an adapter not loaded, the engine ready): p95 under 1 s with the 0.5 s load.
//! - The hub adapters are answered by themselves (from the files their Jobs fetched).
//! - A load failure (the missing directory; a hub adapter of rank 64, which admission cannot see
//!   without `spec.rank`, on an engine of `--max-lora-rank=16`) reaches the client as an error
//!   naming the adapter, and the adapter's `Loaded` condition as `LoadFailed` with the engine's
//!   message.
//!
//! KEDA learns the demand by push (the gateway's ExternalScaler stream), so both cold starts
//! compared begin when the request arrives, without a polling interval's jitter.
//!
//! Devices: 1 of the real node's 2 `nvidia.com/gpu` (`scaling.max: 1`; its runtime asks for that
//! resource), so it shares a step with suites of `hearth.dev/fake-gpu` only.

mod stack;

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use hearth_e2e_harness::stack::{self as harness, ScalerMode};
use hearth_e2e_harness::{admin, client};
use hearth_test_support::{Observed, wait_until};
use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{PersistentVolumeClaim, Pod};
use kube::Api;
use kube::api::{ApiResource, DynamicObject, ListParams, PostParams};
use kube::core::GroupVersionKind;
use serde_json::{Value, json};

use stack::SERVICE;
use stack::volumes::{Fixture, wait_job};

/// The runtime this suite makes (cluster-scoped; deleted at the end, also on failure).
const RUNTIME: &str = "e2e-stub-lora";
/// Adapters on the base.
const ADAPTERS: usize = 50;
/// The runtime's `spec.adapters.maxLoaded`.
const MAX_LOADED: usize = 8;
/// The stub's time to load one adapter.
const LOAD_DELAY: &str = "500ms";
/// Requests of the random loop.
const LOOP: usize = 60;

fn adapters_api(client: &kube::Client, ns: &str) -> Api<DynamicObject> {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "serving.hearth.dev",
        "v1alpha1",
        "LLMAdapter",
    ));
    Api::namespaced_with(client.clone(), ns, &ar)
}

fn name(i: usize) -> String {
    format!("a{i:02}")
}

fn hub_adapter(name: &str, uri: &str) -> Value {
    json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name},
        "spec": {"serviceRef": {"name": SERVICE}, "source": {"uri": uri}},
    })
}

/// Adapter `name`'s `Loaded` condition, once its reason is `reason` (within `within`).
async fn wait_loaded(
    api: &Api<DynamicObject>,
    name: &str,
    reason: &str,
    within: Duration,
) -> Result<Value> {
    wait_until(format!("{name} Loaded reason {reason}"), within, || async {
        let a = api.get(name).await?;
        let c = a.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|c| c["type"] == "Loaded")
            .cloned();
        Ok(match c {
            Some(c) if c["reason"] == reason => Observed::Ready(c),
            other => Observed::NotYet(format!("{other:?}")),
        })
    })
    .await
}

fn adapter(name: &str, dir: &str, extra: Value) -> Value {
    let mut a = json!({
        "apiVersion": "serving.hearth.dev/v1alpha1",
        "kind": "LLMAdapter",
        "metadata": {"name": name},
        "spec": {"serviceRef": {"name": SERVICE}, "source": {"uri": format!("pvc://lora/{dir}")}},
    });
    hearth_test_support::merge_json(&mut a["spec"], extra);
    a
}

/// The upstream stub runtime as [`RUNTIME`], serving adapters.
fn lora_runtime() -> Result<Value> {
    let mut rt = harness::first_manifest(&hearth_test_support::upstream_file(
        "stub-inferenceruntime.yaml",
    ))?;
    rt["metadata"] = json!({"name": RUNTIME});
    rt["spec"]["priority"] = json!(0);
    // The real node's device plugin's devices, which no other suite of its step asks for.
    rt["spec"]["accelerator"]["resourceName"] = json!("nvidia.com/gpu");
    rt["spec"]["adapters"] = json!({
        "args": ["--enable-lora", "--max-loras=4", format!("--max-cpu-loras={MAX_LOADED}"), "--max-lora-rank=16"],
        "env": [
            {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "true"},
            {"name": "STUB_LORA_LOAD_DELAY", "value": LOAD_DELAY},
        ],
        "maxRank": 16,
        "maxLoaded": MAX_LOADED,
    });
    Ok(rt)
}

/// One non-streamed chat completion for `model` through the gateway: (status, body, seconds).
async fn ask(url: &str, model: &str) -> Result<(u16, Value, f64)> {
    let t = client::chat_with(url, model, false, Some(2), Duration::from_secs(120)).await?;
    let body: Value = serde_json::from_str(&t.body).unwrap_or(Value::String(t.body.clone()));
    Ok((t.status, body, (t.end - t.sent).as_secs_f64()))
}

/// Checks an answer is adapter `name`'s.
fn answered_by(name: &str, status: u16, body: &Value) -> Result<()> {
    let text = body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_default();
    ensure!(
        status == 200 && body["model"] == name && text.starts_with(&format!("[adapter {name}]")),
        "{name}: {status} {body}"
    );
    Ok(())
}

/// The engine's adapters (`/v1/models` entries with a `parent`), from the backend pod.
async fn engine_adapters(pod: &Pod) -> Result<Vec<String>> {
    let ip = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.clone())
        .context("backend pod without an IP")?;
    let (status, body) = client::get(
        &format!("http://{ip}:8000/v1/models"),
        Duration::from_secs(10),
    )
    .await?;
    ensure!(status == 200, "/v1/models: {status} {body}");
    let v: Value = serde_json::from_str(&body)?;
    let mut out: Vec<String> = v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m.get("parent").is_some_and(|p| !p.is_null()))
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect();
    out.sort();
    Ok(out)
}

/// The adapters whose status says they are loaded on `pod`.
async fn status_loaded(api: &Api<DynamicObject>, pod: &str) -> Result<Vec<String>> {
    let mut out: Vec<String> = api
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter(|a| {
            a.data["status"]["loadedOn"]
                .as_array()
                .is_some_and(|on| on.iter().any(|p| p == pod))
        })
        .filter_map(|a| a.metadata.name)
        .collect();
    out.sort();
    Ok(out)
}

/// The sum of a counter over its label sets in the gateway pods' `/metrics`.
async fn gateway_metric(d: &stack::Deployed, metric: &str) -> Result<f64> {
    let pods: Api<Pod> = d.ns.api();
    let list = pods
        .list(&ListParams::default().labels(&format!("serving.hearth.dev/gateway={SERVICE}")))
        .await?;
    let token = admin::token(&d.cluster.client(), d.ns.name(), SERVICE).await?;
    let mut sum = 0.0;
    for p in list.items {
        let Some(ip) = p.status.and_then(|s| s.pod_ip) else {
            continue;
        };
        let (_, text) = admin::get(
            &format!("{}/metrics", admin::url(&ip)),
            &token,
            Duration::from_secs(10),
        )
        .await?;
        sum += client::metric_value(&text, metric).unwrap_or(0.0);
    }
    Ok(sum)
}

/// A streamed cold request for `model` (the base at zero): seconds to its first token, after
/// checking the answer is whole and starts with `prefix`.
async fn cold_first_token(d: &stack::Deployed, model: &str, prefix: &str) -> Result<f64> {
    let sent = Instant::now();
    let cold = client::chat_with(&d.url, model, true, Some(2), Duration::from_secs(300)).await?;
    ensure!(
        cold.status == 200 && cold.complete() && cold.text().starts_with(prefix),
        "cold {model}: {} {:?} {}",
        cold.status,
        cold.events.iter().map(|(_, e)| e).collect::<Vec<_>>(),
        cold.body
    );
    Ok((cold.first_token().context("no token")? - sent).as_secs_f64())
}

fn p95(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[((xs.len() as f64 - 1.0) * 0.95).round() as usize]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_adapters_on_one_base_are_loaded_on_demand() -> Result<()> {
    let t0 = Instant::now();
    let mut fx = Fixture::new("e2e-lora-vol").await?;
    let client = fx.cluster.client();
    harness::ensure_hearth(&client, fx.cluster.kubeconfig()).await?;
    fx.scoped.will_make("inferenceruntime", RUNTIME);
    harness::apply(&client, lora_runtime()?, None).await?;
    let class = fx.local_volume("ReadWriteOnce").await?;
    let claim = json!({
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "lora"},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": class,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    });
    // The base's model cache on the node, where the hub adapters are fetched to.
    let (root, parent, leaf) = fx.prepare_host_path_root().await?;
    let d = stack::deploy_with("e2e-lora", ScalerMode::Push, vec![claim], |o| {
        o["spec"]["runtime"] = json!({"name": RUNTIME});
        o["spec"]["scaling"]["max"] = json!(1);
        // The base model prewarmed there too: the stub engine reads a HostPath cache only.
        o["spec"]["cache"] = json!({"strategy": "HostPath", "prewarm": true});
    })
    .await?;
    let ns = d.ns.name();
    ensure!(
        d.ns.api::<PersistentVolumeClaim>()
            .get_opt("lora")
            .await?
            .is_some(),
        "claim lora"
    );

    // The adapters' files: one directory each, as a platform team stages them.
    let script = format!(
        "for i in $(seq -w 1 {ADAPTERS}); do d=/data/a$i; mkdir -p $d; \
         printf '{{\"r\": 8, \"lora_alpha\": 16, \"target_modules\": [\"q_proj\", \"v_proj\"], \"peft_type\": \"LORA\", \"base_model_name_or_path\": \"hearth/stub-model\"}}' > $d/adapter_config.json; \
         printf 'weights of a%s' $i > $d/adapter_model.safetensors; done; chmod -R a+rX /data; ls /data | wc -l"
    );
    let fill: Job = serde_json::from_value(json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "stage-adapters"},
        "spec": {
            "backoffLimit": 0,
            "template": {"spec": fx.node.place(json!({
                "restartPolicy": "Never",
                "containers": [{
                    "name": "stage",
                    "image": fx.node.tools_image,
                    "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                }],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "lora"}}],
            }))},
        },
    }))?;
    d.ns.api::<Job>()
        .create(&PostParams::default(), &fill)
        .await?;
    wait_job(&d.ns, "stage-adapters", Duration::from_secs(120)).await?;
    let staged = t0.elapsed().as_secs_f64();

    // Admission: the installed webhook checks the rank against the runtime's maxRank.
    let api = adapters_api(&client, ns);
    let big: DynamicObject = serde_json::from_value(adapter("big", "a01", json!({"rank": 64})))?;
    match api.create(&PostParams::default(), &big).await {
        Err(kube::Error::Api(e)) => ensure!(
            e.code == 422 && e.message.contains("spec.rank: 64 is above 16"),
            "{e:?}"
        ),
        other => bail!("an adapter of rank 64 was not denied: {other:?}"),
    }
    // And the source: one that is no model URI is denied naming the field.
    let mut bad = adapter("bad-source", "a01", json!({}));
    bad["spec"]["source"]["uri"] = json!("s3://bucket/lora");
    match api
        .create(&PostParams::default(), &serde_json::from_value(bad)?)
        .await
    {
        Err(kube::Error::Api(e)) => ensure!(
            e.code == 422 && e.message.contains("spec.source.uri: "),
            "{e:?}"
        ),
        other => bail!("an adapter from s3:// was not denied: {other:?}"),
    }
    for i in 1..=ADAPTERS {
        let a: DynamicObject =
            serde_json::from_value(adapter(&name(i), &name(i), json!({"rank": 8})))?;
        api.create(&PostParams::default(), &a).await?;
    }
    let broken: DynamicObject = serde_json::from_value(adapter("broken", "missing", json!({})))?;
    api.create(&PostParams::default(), &broken).await?;
    // From the hubs, under this run's own organisation (the node's cache outlives the run).
    let org = format!("hearth-e2e-{}", ns.rsplit('-').next().unwrap_or("x"));
    let hub = [
        ("hub-sql", format!("hf://{org}/sql-lora")),
        ("hub-legal", format!("modelscope://{org}/legal-lora")),
        // Rank 64 (the stub hub's `-r64`), which the engine refuses.
        ("hub-big", format!("hf://{org}/big-lora-r64")),
    ];
    for (n, uri) in &hub {
        let a: DynamicObject = serde_json::from_value(hub_adapter(n, uri))?;
        api.create(&PostParams::default(), &a).await?;
    }
    wait_until(
        "every adapter Accepted",
        Duration::from_secs(60),
        || async {
            let list = api.list(&ListParams::default()).await?.items;
            let accepted = list
                .iter()
                .filter(|a| {
                    a.data["status"]["conditions"].as_array().is_some_and(|cs| {
                        cs.iter()
                            .any(|c| c["type"] == "Accepted" && c["status"] == "True")
                    })
                })
                .count();
            Ok(if accepted == ADAPTERS + 1 + hub.len() {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!(
                    "{accepted} of {} accepted",
                    ADAPTERS + 1 + hub.len()
                ))
            })
        },
    )
    .await?;
    let a01 = wait_loaded(&api, "a01", "NoReadyEngine", Duration::from_secs(60)).await?;
    ensure!(a01["status"] == "False", "a01's Loaded: {a01}");
    // The hub adapters: one fetch Job each, then loadable (the base still at zero).
    for (n, _) in &hub {
        wait_loaded(&api, n, "NoReadyEngine", Duration::from_secs(120)).await?;
    }
    let jobs =
        d.ns.api::<Job>()
            .list(&ListParams::default().labels("app.kubernetes.io/component=adapter-fetch"))
            .await?
            .items;
    ensure!(
        jobs.len() == hub.len()
            && jobs
                .iter()
                .all(|j| j.status.as_ref().and_then(|s| s.succeeded) == Some(1)),
        "{} fetch Jobs, not all succeeded: {:?}",
        jobs.len(),
        jobs.iter()
            .map(|j| (&j.metadata.name, &j.status))
            .collect::<Vec<_>>()
    );
    let fetched = t0.elapsed().as_secs_f64();
    d.wait_zero(Duration::from_secs(180)).await?;

    // Cold, the base alone: its first token, as a client sees the cold start.
    let base_first = cold_first_token(&d, SERVICE, "").await?;
    d.wait_zero(Duration::from_secs(180)).await?;
    // Cold through an adapter: the base wakes, then the adapter loads.
    let first = cold_first_token(&d, "a07", "[adapter a07]").await?;
    println!(
        "cold request, first token: base model {base_first:.2}s, adapter {first:.2}s (bound: the base's + 3s = {:.2}s)",
        base_first + 3.0
    );
    ensure!(
        first <= base_first + 3.0,
        "an adapter's cold first token {first:.2}s is over the base's {base_first:.2}s + 3s"
    );

    // The random loop (a fixed LCG: the same run every time).
    let unloads_before = gateway_metric(&d, "hearth_gateway_adapter_unloads_total").await?;
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    for _ in 0..LOOP {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        let n = name(1 + (x >> 33) as usize % ADAPTERS);
        let (status, body, _) = ask(&d.url, &n).await?;
        answered_by(&n, status, &body)?;
    }
    let unloads =
        gateway_metric(&d, "hearth_gateway_adapter_unloads_total").await? - unloads_before;
    ensure!(
        unloads > 0.0,
        "no adapter was unloaded over {LOOP} requests on {ADAPTERS} adapters"
    );
    let pods = d.backend_pods().await?;
    ensure!(pods.len() == 1, "one backend pod: {}", pods.len());
    let pod = &pods[0];
    let pod_name = pod.metadata.name.clone().unwrap_or_default();
    let engine = engine_adapters(pod).await?;
    ensure!(
        !engine.is_empty() && engine.len() <= MAX_LOADED,
        "the engine holds {} adapters (at most {MAX_LOADED}): {engine:?}",
        engine.len()
    );
    wait_until(
        "the adapters' loadedOn as the engine lists them",
        Duration::from_secs(30),
        || async {
            let engine = engine_adapters(pod).await?;
            let status = status_loaded(&api, &pod_name).await?;
            Ok(if engine == status {
                Observed::Ready(())
            } else {
                Observed::NotYet(format!("engine {engine:?}, status {status:?}"))
            })
        },
    )
    .await?;

    // Warm switches: adapters the engine does not hold, one after another.
    let held = engine_adapters(pod).await?;
    let mut switches = Vec::new();
    for i in 1..=ADAPTERS {
        let n = name(i);
        if held.contains(&n) || switches.len() >= 20 {
            continue;
        }
        let (status, body, secs) = ask(&d.url, &n).await?;
        answered_by(&n, status, &body)?;
        switches.push(secs);
    }
    let switch_p95 = p95(switches.clone());
    println!(
        "warm adapter switch ({} requests, load delay {LOAD_DELAY}): p95 {switch_p95:.3}s, max {:.3}s",
        switches.len(),
        switches.iter().copied().fold(0.0, f64::max)
    );
    ensure!(switch_p95 < 1.0, "warm switch p95 {switch_p95:.3}s");

    // The hub adapters, from the files their Jobs fetched into the cache.
    for n in ["hub-sql", "hub-legal"] {
        let (status, body, _) = ask(&d.url, n).await?;
        answered_by(n, status, &body)?;
    }

    // Load failures reach the client, naming the adapter, and the adapter's status with the
    // engine's message; the next request is served.
    let (status, body, _) = ask(&d.url, "broken").await?;
    ensure!(
        status >= 400 && body.to_string().contains("broken"),
        "broken: {status} {body}"
    );
    let (status, body, _) = ask(&d.url, "hub-big").await?;
    ensure!(
        status == 400
            && body["error"]["code"] == "adapter_load_failed"
            && body["error"]["message"]
                .as_str()
                .is_some_and(|m| m.contains("LoRA rank 64 is greater than max_lora_rank 16")),
        "hub-big: {status} {body}"
    );
    let (status, body, _) = ask(&d.url, "a03").await?;
    answered_by("a03", status, &body)?;
    let big = wait_loaded(&api, "hub-big", "LoadFailed", Duration::from_secs(30)).await?;
    ensure!(
        big["status"] == "False"
            && big["message"]
                .as_str()
                .is_some_and(|m| m.contains(&pod_name)
                    && m.contains("LoRA rank 64 is greater than max_lora_rank 16")),
        "hub-big's Loaded: {big}"
    );
    let broken = wait_loaded(&api, "broken", "LoadFailed", Duration::from_secs(30)).await?;
    println!(
        "load failures in status: hub-big: {}; broken: {}",
        big["message"], broken["message"]
    );
    // This run's adapters leave the node's cache.
    let files = fx
        .on_node(
            "remove-fetched-adapters",
            &parent,
            &format!(
                "find /host/{leaf}/adapters -path '*{org}*' -name adapter_config.json | sort; \
                 rm -rf /host/{leaf}/adapters/hf/{org} /host/{leaf}/adapters/modelscope/{org} \
                 /host/{leaf}/hf/hub/models--{org}--*"
            ),
        )
        .await?;
    ensure!(
        files.lines().count() == hub.len(),
        "{root}/adapters on the node holds:\n{files}"
    );
    let failed = gateway_metric(&d, "hearth_gateway_adapter_loads_total").await?;
    println!(
        "staged {ADAPTERS} adapters at {staged:.1}s, hub adapters fetched at {fetched:.1}s; \
         {LOOP} random requests: {unloads} unloads; \
         engine holds {} of at most {MAX_LOADED}; loads counted {failed}; done at {:.1}s",
        engine.len(),
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

//! Tenants through real HTTP: a real gateway (or two) in front of a real vllm-stub, on
//! loopback. Who is dispatched first when a model's `containerConcurrency` is taken (fair share
//! inside a priority band, the higher band first), the quotas and OpenAI's rate-limit answer,
//! quotas shared by two replicas, the tokens metered per tenant, and the API key that names the
//! tenant.
//!
//! Order is measured by completion rank (each request takes the next number of a shared
//! counter when its whole answer has arrived), never by timing; waits poll a condition until a
//! deadline.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use hearth_gateway::{
    EndpointSet, Gateway, GatewayConfig, RunningGateway,
    admin::AdminAuth,
    apikeys::ApiKeys,
    tenants::{Tenant, Tenants},
};
use http_body_util::{BodyExt, Full};
use hyper::{Request, StatusCode};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use serde_json::{Value, json};
use vllm_stub::{RunningStub, StubConfig};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How long any wait of these tests may take before it fails the test.
const DEADLINE: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Helpers

/// A directory of key files, removed when dropped.
struct KeyDir(PathBuf);

impl KeyDir {
    fn new(test: &str) -> Self {
        let p = std::env::temp_dir().join(format!("hearth-tenants-{}-{test}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    /// Tenant `name` with its key `sk-<name>` in a file of its own, and `extra` flags
    /// (`priority=10,requests-per-minute=3`), as `--tenant` takes them.
    fn tenant(&self, name: &str, extra: &str) -> Tenant {
        let path = self.0.join(name);
        std::fs::write(&path, format!("# {name}\nsk-{name}\n")).unwrap();
        let mut spec = format!("name={name},key-file={}", path.display());
        if !extra.is_empty() {
            spec.push(',');
            spec.push_str(extra);
        }
        Tenant::parse(&spec).unwrap()
    }
}

impl Drop for KeyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

async fn stub() -> RunningStub {
    vllm_stub::spawn(
        StubConfig {
            served_model_names: vec!["stub-svc".into()],
            token_count: 5,
            token_delay: Duration::from_millis(1),
            ..StubConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap()
}

/// A gateway in front of `stub` with `tenants` (keys on as soon as one has a key file) and
/// `container_concurrency` requests in flight on the stub.
async fn gateway(stub: &RunningStub, tenants: Vec<Tenant>, concurrency: u32) -> RunningGateway {
    let tenants = Tenants::new(tenants).unwrap();
    let keys = ApiKeys::load_tenants(None, &tenants).unwrap();
    gateway_with(stub, tenants, keys, concurrency).await
}

async fn gateway_with(
    stub: &RunningStub,
    tenants: Tenants,
    keys: ApiKeys,
    concurrency: u32,
) -> RunningGateway {
    let cfg = GatewayConfig {
        activation_timeout: Duration::from_secs(30),
        drain_timeout: Duration::from_secs(5),
        container_concurrency: concurrency,
        tenants,
        ..GatewayConfig::default()
    };
    let backend = stub.addr.to_string().parse().unwrap();
    hearth_gateway::spawn(
        Gateway::new(cfg, EndpointSet::fixed([backend]), keys).unwrap(),
        "127.0.0.1".parse().unwrap(),
    )
    .await
    .unwrap()
}

fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A chat completion of `tokens` tokens.
fn chat(tokens: u32, stream: bool) -> Value {
    json!({
        "model": "stub-svc",
        "stream": stream,
        "max_tokens": tokens,
        "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
    })
}

/// `POST /v1/chat/completions` of `body` with the key `sk-<tenant>` (none: `None`) and the
/// stub's `token_delay`.
fn post(
    gw: &RunningGateway,
    tenant: Option<&str>,
    body: &Value,
    delay: &str,
) -> Request<Full<Bytes>> {
    let mut req = Request::post(format!("{}/v1/chat/completions", gw.url()))
        .header("content-type", "application/json")
        .header("x-stub-token-delay", delay);
    if let Some(t) = tenant {
        req = req.header("authorization", format!("Bearer sk-{t}"));
    }
    req.body(Full::new(Bytes::from(body.to_string()))).unwrap()
}

/// Sends and reads the whole answer.
async fn send(c: &HttpClient, req: Request<Full<Bytes>>) -> (StatusCode, http::HeaderMap, Bytes) {
    let resp = tokio::time::timeout(DEADLINE, c.request(req))
        .await
        .expect("no answer in time")
        .unwrap();
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(DEADLINE, body.collect())
        .await
        .expect("the answer did not end in time")
        .unwrap()
        .to_bytes();
    (parts.status, parts.headers, body)
}

fn body_json(body: &[u8]) -> Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)))
}

/// Sends `n` requests at once, each on a task of its own; each gives the rank it finished at
/// among all the requests counted by `done` (0 = first), once its whole `200` answer arrived.
fn burst(
    c: &HttpClient,
    n: usize,
    req: impl Fn() -> Request<Full<Bytes>>,
    done: &Arc<AtomicUsize>,
) -> Vec<tokio::task::JoinHandle<usize>> {
    (0..n)
        .map(|_| {
            let (c, req, done) = (c.clone(), req(), done.clone());
            tokio::spawn(async move {
                let (status, _, body) = send(&c, req).await;
                assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
                done.fetch_add(1, Ordering::SeqCst)
            })
        })
        .collect()
}

async fn ranks(tasks: Vec<tokio::task::JoinHandle<usize>>) -> Vec<usize> {
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out.sort_unstable();
    out
}

/// Polls `cond` every 2 ms until it holds; fails the test naming `what` after [`DEADLINE`].
async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits until `gw` has admitted `pending` requests and the stub is generating `running`: the
/// rest wait in the gateway's fair queue.
async fn wait_queued(gw: &RunningGateway, stub: &RunningStub, pending: u64, running: usize) {
    wait_for(
        &format!("{pending} requests admitted, {running} of them on the stub"),
        || gw.gateway.demand().state().pending() == pending && stub.state.running() == running,
    )
    .await;
}

async fn metrics_text(c: &HttpClient, gw: &RunningGateway) -> String {
    let req = Request::get(format!("{}/metrics", gw.admin_url()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, _, body) = send(c, req).await;
    assert_eq!(status, StatusCode::OK);
    String::from_utf8(body.to_vec()).unwrap()
}

/// The value of the sample `sample` (`name{labels}`) in a Prometheus text body.
fn metric(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

fn tokens_sample(tenant: &str, kind: &str) -> String {
    format!("hearth_gateway_tenant_tokens_total{{tenant=\"{tenant}\",kind=\"{kind}\"}}")
}

/// A header's value as text.
fn header<'a>(h: &'a http::HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .unwrap_or_else(|| panic!("no {name} in {h:?}"))
        .to_str()
        .unwrap()
}

// ---------------------------------------------------------------------------------------------
// Fair queue

/// Places in flight on the stub in the fair-queue tests.
const PLACES: u32 = 4;

/// Tenant `flood` sends 40 requests of `body` at once: it takes every place it may (all but
/// the headroom kept for other tenants, `fair::headroom`) and the rest wait. Then tenant
/// `light` sends 8. Returns each tenant's completion ranks (sorted; 0 = first of all 48).
async fn flood_then_light(test: &str, body: &Value, delay: &str) -> (Vec<usize>, Vec<usize>) {
    let stub = stub().await;
    let dir = KeyDir::new(test);
    let gw = gateway(
        &stub,
        vec![dir.tenant("flood", ""), dir.tenant("light", "")],
        PLACES,
    )
    .await;
    let c = client();
    let done = Arc::new(AtomicUsize::new(0));
    let places = u64::from(PLACES);
    let flood_places = (places - hearth_gateway::fair::headroom(places)) as usize;
    let flood = burst(&c, 40, || post(&gw, Some("flood"), body, delay), &done);
    wait_queued(&gw, &stub, 40, flood_places).await;
    let light = burst(&c, 8, || post(&gw, Some("light"), body, delay), &done);
    // One of them takes the headroom's place at once, while the flood still waits.
    wait_for("a light request on the stub beside the flood", || {
        stub.state.running() == flood_places + 1
    })
    .await;
    assert!(
        done.load(Ordering::SeqCst) < 10,
        "the flood drained before the test could queue behind it"
    );
    let (flood, light) = (ranks(flood).await, ranks(light).await);
    let m = metrics_text(&c, &gw).await;
    for (tenant, n) in [("flood", 40.0), ("light", 8.0)] {
        let sample = |name: &str| format!("hearth_gateway_{name}{{tenant=\"{tenant}\"}}");
        assert_eq!(metric(&m, &sample("tenant_requests_total")), Some(n), "{m}");
        assert_eq!(
            metric(&m, &sample("queue_wait_seconds_count")),
            Some(n),
            "{m}"
        );
    }
    (flood, light)
}

/// Asserts `light` got its fair share of the places once both tenants waited: all of its
/// requests finish before half of the flood's. First come, first served would finish it last
/// (ranks 40 to 47); the headroom's one place alone, about one `light` request per round of
/// the flood's, would finish it near the flood's 24th.
fn assert_fair_share(flood: &[usize], light: &[usize]) {
    let half = flood[20];
    assert!(
        light.iter().all(|r| *r < half),
        "light finished at ranks {light:?}, not all before the flood's 21st (rank {half}); flood: {flood:?}"
    );
}

/// Fair share between two tenants of one band, with streams (whose tokens are counted as
/// they stream).
#[tokio::test]
async fn a_tenant_behind_anothers_flood_gets_its_share_of_the_places() {
    let (flood, light) = flood_then_light("fair", &chat(20, true), "2ms").await;
    assert_fair_share(&flood, &light);
}

/// The same with short JSON answers whose `usage` counts fewer prompt tokens than the estimate
/// (body bytes / 4), as an engine does for a short prompt in verbose JSON: the correction at
/// the end lowers the flood's counter. (With prompt tokens charged as a request queues, as
/// before 2dde381, the flood's whole backlog was charged at once, `light` was lifted above it,
/// and each of the flood's answers lowered the flood's counter again: `light` kept only the
/// headroom's place and finished at ranks 3, 7, ..., 31, past the flood's 21st at 26.)
#[tokio::test]
async fn fair_share_holds_when_the_usage_is_below_the_estimate() {
    let (flood, light) = flood_then_light("fair-short", &chat(4, false), "10ms").await;
    assert_fair_share(&flood, &light);
}

/// `containerConcurrency` 1: five requests of band 0 hold the place and queue; one request of
/// band 10 sent after them is dispatched as soon as the place frees, before all four queued.
#[tokio::test]
async fn a_higher_band_is_dispatched_before_a_lower_bands_backlog() {
    let stub = stub().await;
    let dir = KeyDir::new("bands");
    let gw = gateway(
        &stub,
        vec![
            dir.tenant("batch", "priority=0"),
            dir.tenant("online", "priority=10"),
        ],
        1,
    )
    .await;
    let c = client();
    let done = Arc::new(AtomicUsize::new(0));
    let body = chat(20, false);
    let batch = burst(&c, 5, || post(&gw, Some("batch"), &body, "5ms"), &done);
    wait_queued(&gw, &stub, 5, 1).await;
    assert_eq!(
        done.load(Ordering::SeqCst),
        0,
        "the first batch request is still running"
    );
    let online = burst(&c, 1, || post(&gw, Some("online"), &body, "5ms"), &done);
    let (batch, online) = (ranks(batch).await, ranks(online).await);
    // Rank 0: the batch request that held the place; then the online one.
    assert_eq!(online, [1], "batch: {batch:?}");
    assert_eq!(batch, [0, 2, 3, 4, 5]);
}

// ---------------------------------------------------------------------------------------------
// Quotas

/// `requests-per-minute=3`: three answers carry OpenAI's rate-limit headers counting down, the
/// fourth is OpenAI's `429 rate_limit_exceeded` of type `requests` with `Retry-After`. Another
/// tenant without a quota is not limited and gets no such headers.
#[tokio::test]
async fn the_fourth_request_of_three_per_minute_is_refused_as_openai_does() {
    let stub = stub().await;
    let dir = KeyDir::new("rpm");
    let gw = gateway(
        &stub,
        vec![
            dir.tenant("small", "requests-per-minute=3"),
            dir.tenant("free", ""),
        ],
        256,
    )
    .await;
    let c = client();
    let body = chat(2, false);
    for remaining in ["2", "1", "0"] {
        let (status, h, b) = send(&c, post(&gw, Some("small"), &body, "0s")).await;
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
        assert_eq!(header(&h, "x-ratelimit-limit-requests"), "3");
        assert_eq!(header(&h, "x-ratelimit-remaining-requests"), remaining);
        assert!(
            header(&h, "x-ratelimit-reset-requests").ends_with('s'),
            "{h:?}"
        );
        assert!(
            !h.contains_key("x-ratelimit-limit-tokens"),
            "no token quota: {h:?}"
        );
    }
    let received = stub.state.received();
    let (status, h, b) = send(&c, post(&gw, Some("small"), &body, "0s")).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let v = body_json(&b);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert_eq!(v["error"]["type"], "requests", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("small") && message.contains("Limit 3"),
        "{message}"
    );
    let retry: u64 = header(&h, "retry-after").parse().unwrap();
    // One request comes back every 20 s.
    assert!((1..=20).contains(&retry), "Retry-After: {retry}");
    assert_eq!(header(&h, "x-ratelimit-limit-requests"), "3");
    assert_eq!(header(&h, "x-ratelimit-remaining-requests"), "0");
    assert_eq!(
        stub.state.received(),
        received,
        "the refused request reached the stub"
    );
    // The other tenant has no quota.
    for _ in 0..5 {
        let (status, h, _) = send(&c, post(&gw, Some("free"), &body, "0s")).await;
        assert_eq!(status, StatusCode::OK);
        assert!(!h.contains_key("x-ratelimit-limit-requests"), "{h:?}");
    }
    let m = metrics_text(&c, &gw).await;
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_rejections_total{reason=\"rate_limit_exceeded\"}"
        ),
        Some(1.0),
        "{m}"
    );
}

/// `tokens-per-minute=1000`: after a 300-token answer, a request whose estimate (prompt bytes
/// / 4 + `max_tokens`) is larger than what is left is refused with type `tokens`; the refusal
/// takes nothing, so a small request still passes.
#[tokio::test]
async fn a_request_estimated_past_the_token_quota_is_refused() {
    let stub = stub().await;
    let dir = KeyDir::new("tpm");
    let gw = gateway(&stub, vec![dir.tenant("t", "tokens-per-minute=1000")], 256).await;
    let c = client();
    let (status, h, b) = send(&c, post(&gw, Some("t"), &chat(300, false), "0s")).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    assert_eq!(header(&h, "x-ratelimit-limit-tokens"), "1000");
    let used = body_json(&b)["usage"]["total_tokens"].as_u64().unwrap();
    assert!(used >= 300, "{used}");

    let (status, h, b) = send(&c, post(&gw, Some("t"), &chat(900, false), "0s")).await;
    assert_eq!(
        status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        String::from_utf8_lossy(&b)
    );
    let v = body_json(&b);
    assert_eq!(v["error"]["code"], "rate_limit_exceeded", "{v}");
    assert_eq!(v["error"]["type"], "tokens", "{v}");
    assert!(h.contains_key("retry-after"), "{h:?}");
    assert_eq!(header(&h, "x-ratelimit-limit-tokens"), "1000");
    let left: u64 = header(&h, "x-ratelimit-remaining-tokens").parse().unwrap();
    assert!(
        left < 900 && left + used <= 1000 + 20,
        "remaining {left} after {used}"
    );

    let (status, _, b) = send(&c, post(&gw, Some("t"), &chat(5, false), "0s")).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
}

/// Two replicas with the same tenants, each reading the other's usage
/// (`quota::sync_peers`): the quota used up on replica 1 is refused on replica 2 too, which
/// answered no request of that tenant itself.
#[tokio::test]
async fn a_quota_used_on_one_replica_is_refused_on_the_other() {
    let stub = stub().await;
    let dir = KeyDir::new("peers");
    let tenants = || vec![dir.tenant("p", "requests-per-minute=3")];
    let (one, two) = (
        gateway(&stub, tenants(), 256).await,
        gateway(&stub, tenants(), 256).await,
    );
    let mut syncs = Vec::new();
    for (me, peer) in [(&one, &two), (&two, &one)] {
        let (tx, rx) = tokio::sync::watch::channel(vec![peer.admin.to_string()]);
        let (quotas, own) = (me.gateway.quotas(), me.gateway.instance());
        syncs.push(tokio::spawn(async move {
            // The peer list stays as it is: its sender lives as long as the task.
            let _peers = tx;
            hearth_gateway::quota::sync_peers(quotas, rx, own, AdminAuth::open()).await;
        }));
    }
    let quotas_two = two.gateway.quotas();
    let p = quotas_two.tenants().id("p").unwrap();
    let remaining = || {
        quotas_two.headers(p)["x-ratelimit-remaining-requests"]
            .to_str()
            .unwrap()
            .to_owned()
    };
    assert_eq!(remaining(), "3");
    // Each counts the other's use from its first report on.
    wait_for("each replica to have its peer's first report", || {
        one.gateway.quotas().known_peers() == 1 && quotas_two.known_peers() == 1
    })
    .await;
    let c = client();
    let body = chat(2, false);
    for _ in 0..3 {
        let (status, _, _) = send(&c, post(&one, Some("p"), &body, "0s")).await;
        assert_eq!(status, StatusCode::OK);
    }
    let req = Request::get(format!("{}/hearth/quota-usage", one.admin_url()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (_, _, b) = send(&c, req).await;
    let usage = body_json(&b);
    assert_eq!(usage["tenants"]["p"][0], 3, "{usage}");
    assert_eq!(usage["instance"], one.gateway.instance(), "{usage}");
    // Replica 2 reads it within a sync interval or two (250 ms each).
    wait_for("replica 2 to count replica 1's requests", || {
        remaining() == "0"
    })
    .await;
    let (status, h, b) = send(&c, post(&two, Some("p"), &body, "0s")).await;
    assert_eq!(
        status,
        StatusCode::TOO_MANY_REQUESTS,
        "{}",
        String::from_utf8_lossy(&b)
    );
    assert_eq!(body_json(&b)["error"]["type"], "requests");
    assert_eq!(header(&h, "x-ratelimit-remaining-requests"), "0");
    for s in syncs {
        s.abort();
    }
}

// ---------------------------------------------------------------------------------------------
// Metering

/// The tokens counted for a tenant are the stub's `usage`: a JSON answer's, then a stream's
/// with `stream_options.include_usage`.
#[tokio::test]
async fn a_tenants_tokens_are_the_answers_usage() {
    let stub = stub().await;
    let dir = KeyDir::new("meter");
    let gw = gateway(&stub, vec![dir.tenant("m", "")], 256).await;
    let c = client();
    let (status, _, b) = send(&c, post(&gw, Some("m"), &chat(7, false), "0s")).await;
    assert_eq!(status, StatusCode::OK);
    let usage = &body_json(&b)["usage"];
    let (prompt, completion) = (
        usage["prompt_tokens"].as_f64().unwrap(),
        usage["completion_tokens"].as_f64().unwrap(),
    );
    assert_eq!(completion, 7.0);
    let m = metrics_until(&c, &gw, &tokens_sample("m", "completion"), completion).await;
    assert_eq!(
        metric(&m, &tokens_sample("m", "prompt")),
        Some(prompt),
        "{m}"
    );

    let mut stream = chat(9, true);
    stream["stream_options"] = json!({"include_usage": true});
    let (status, _, b) = send(&c, post(&gw, Some("m"), &stream, "0s")).await;
    assert_eq!(status, StatusCode::OK);
    let text = String::from_utf8(b.to_vec()).unwrap();
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let usage = text
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .find_map(|v| v.get("usage").filter(|u| !u.is_null()).cloned())
        .unwrap_or_else(|| panic!("no usage event: {text}"));
    let (p2, c2) = (
        usage["prompt_tokens"].as_f64().unwrap(),
        usage["completion_tokens"].as_f64().unwrap(),
    );
    assert_eq!(c2, 9.0);
    let m = metrics_until(&c, &gw, &tokens_sample("m", "completion"), completion + c2).await;
    assert_eq!(
        metric(&m, &tokens_sample("m", "prompt")),
        Some(prompt + p2),
        "{m}"
    );
    assert_eq!(
        metric(&m, "hearth_gateway_tenant_requests_total{tenant=\"m\"}"),
        Some(2.0),
        "{m}"
    );
}

/// The gateway's metrics once `sample` is `want`; the sample is written when the answer's end
/// passed through, so a scrape right after the client read it may come first.
async fn metrics_until(c: &HttpClient, gw: &RunningGateway, sample: &str, want: f64) -> String {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let m = metrics_text(c, gw).await;
        if metric(&m, sample) == Some(want) || Instant::now() >= deadline {
            assert_eq!(metric(&m, sample), Some(want), "{m}");
            return m;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

// ---------------------------------------------------------------------------------------------
// Keys

/// With tenants' keys on, a request without a key or with an unknown one is `401`
/// `invalid_api_key` and reaches nothing; with keys off, requests are the default tenant's.
#[tokio::test]
async fn keys_name_the_tenant_and_without_keys_it_is_the_default() {
    let stub = stub().await;
    let dir = KeyDir::new("keys");
    let gw = gateway(&stub, vec![dir.tenant("k", "")], 256).await;
    let c = client();
    let body = chat(2, false);
    let mut unknown = post(&gw, None, &body, "0s");
    unknown
        .headers_mut()
        .insert("authorization", "Bearer sk-nobody".parse().unwrap());
    for req in [unknown, post(&gw, None, &body, "0s")] {
        let (status, h, b) = send(&c, req).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(body_json(&b)["error"]["code"], "invalid_api_key");
        assert!(h.contains_key("www-authenticate"), "{h:?}");
    }
    assert_eq!(stub.state.received(), 0);
    let (status, _, _) = send(&c, post(&gw, Some("k"), &body, "0s")).await;
    assert_eq!(status, StatusCode::OK);

    // Keys off: every request is the default tenant's.
    let open = gateway_with(&stub, Tenants::default(), ApiKeys::disabled(), 256).await;
    let (status, _, b) = send(&c, post(&open, None, &body, "0s")).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&b));
    let m = metrics_until(&c, &open, &tokens_sample("default", "completion"), 2.0).await;
    assert_eq!(
        metric(
            &m,
            "hearth_gateway_tenant_requests_total{tenant=\"default\"}"
        ),
        Some(1.0),
        "{m}"
    );
}

/// A request the gateway refuses before any backend saw it (here `503` of `--cold-start=reject`:
/// no backend is ready) is not served, so its token estimate is not spent: the next one is
/// refused for the same reason, not for the quota. (The estimate taken at admission is given
/// back when its charge drops unsettled: cold reject, `queue_full`, activation timeout, a
/// client gone while queued.)
#[tokio::test]
async fn a_request_refused_before_the_backend_spends_no_tokens() {
    let dir = KeyDir::new("refused");
    let tenants = Tenants::new(vec![dir.tenant("t", "tokens-per-minute=1000")]).unwrap();
    let keys = ApiKeys::load_tenants(None, &tenants).unwrap();
    let cfg = GatewayConfig {
        cold_start: hearth_gateway::ColdStartMode::Reject,
        tenants,
        ..GatewayConfig::default()
    };
    let gw = hearth_gateway::spawn(
        Gateway::new(cfg, EndpointSet::new(), keys).unwrap(),
        "127.0.0.1".parse().unwrap(),
    )
    .await
    .unwrap();
    let c = client();
    for _ in 0..3 {
        let (status, _, b) = send(&c, post(&gw, Some("t"), &chat(600, false), "0s")).await;
        let v = body_json(&b);
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{v}");
    }
}

#[tokio::test]
async fn the_metering_report_counts_each_tenants_requests_and_tokens_and_the_endpoints_busy_time() {
    let keys = KeyDir::new("metering");
    let s = stub().await;
    let gw = gateway(&s, vec![keys.tenant("a", ""), keys.tenant("b", "")], 8).await;
    let c = client();
    for (tenant, n) in [("a", 2), ("b", 1)] {
        for _ in 0..n {
            let (status, _, _) = send(&c, post(&gw, Some(tenant), &chat(5, true), "20ms")).await;
            assert_eq!(status, StatusCode::OK);
        }
    }
    let req = Request::get(format!("{}/hearth/metering", gw.admin_url()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let (status, _, body) = send(&c, req).await;
    assert_eq!(status, StatusCode::OK);
    let report: hearth_crds::metering::MeteringReport =
        serde_json::from_slice(&body).unwrap_or_else(|e| panic!("{e}: {body:?}"));
    assert_eq!(report.instance, gw.gateway.instance());
    let [service] = report.services.as_slice() else {
        panic!("one service expected: {report:?}");
    };
    let of = |t: &str| service.tenants.iter().find(|x| x.tenant == t).cloned();
    let (a, b) = (of("a").unwrap(), of("b").unwrap());
    assert_eq!((a.requests, b.requests), (2, 1));
    // Each answer's usage: the prompt's tokens and 5 completion tokens.
    assert!(
        a.tokens > 10 && b.tokens > 5 && a.tokens == 2 * b.tokens,
        "{a:?} {b:?}"
    );
    assert_eq!((a.cold_requests, b.cold_requests), (0, 0));
    // The stub's endpoint: serving, busy about 3 × 5 × 20 ms.
    let [e] = service.endpoints.as_slice() else {
        panic!("one endpoint expected: {service:?}");
    };
    assert_eq!(e.address, s.addr.to_string());
    assert!(e.serving);
    assert!(e.busy_seconds >= 0.25 && e.busy_seconds < 5.0, "{e:?}");
    // Another service's name answers nothing.
    let req = Request::get(format!(
        "{}/hearth/metering?service=ns%2Fother",
        gw.admin_url()
    ))
    .body(Full::new(Bytes::new()))
    .unwrap();
    let (_, _, body) = send(&c, req).await;
    let other: hearth_crds::metering::MeteringReport = serde_json::from_slice(&body).unwrap();
    assert!(other.services.is_empty(), "{other:?}");
}

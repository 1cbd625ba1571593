//! Gateway benchmarks, side by side in one run on loopback; prints markdown tables.
//!
//! `cargo bench -p hearth-gateway` (needs `nginx` on PATH or in /usr/sbin for the reverse-proxy
//! baseline: `apt-get install nginx-light`; without it that row is left out).
//!
//! 1. Warm proxy overhead: direct to the stub, through the `hearth-gateway` binary, through
//!    nginx (as configured by default, and sending the same forwarded fields as the gateway), for a small JSON completion, a 64-token SSE stream and the same stream paced at
//!    2 ms per token (a backend that is latency-bound, as a model is, rather than CPU-free):
//!    p50/p99 latency at concurrency 1, and throughput at concurrency 32; added latency and
//!    throughput are given relative to direct, measured in the same run.
//! 2. Readiness to forward: a held request, the endpoint set turns ready, the stub receives the
//!    request.
//! 3. 10,000 held cold streaming connections with heartbeats: RSS and CPU of a process that
//!    runs only the gateway.
//! 4. Push activation: first cold request written → `StreamIsActive(true)` received by a tonic
//!    client.
//! 5. Shared endpoint: a shared gateway with 100 models (its route table built in code, every
//!    model's backend the stub) against a per-service gateway, both the library serving with 2
//!    HTTP workers in a child process of their own: added latency and throughput as in 1,
//!    `GET /v1/models` with 100 models, and the idle RSS of each (the shared gateway's per
//!    model, and against 100 per-service gateways).
//! 6. Tenants and quotas on vs off: the same per-service gateway child (2 HTTP workers) with API
//!    keys off (twice: how far two instances of one configuration land apart), with keys naming
//!    one of 2 tenants, and with those tenants' quotas (limits too large to refuse anything):
//!    added latency and throughput as in 1 (throughput in interleaved windows), and each one's
//!    cost against keys off, in the same run; then the steps tenants and quotas add, called in
//!    process.
//! 7. Fair queue dispatch: [`hearth_gateway::fair::FairQueue`] on its own, 10,000 requests
//!    queued over 100 tenants in 3 priority bands and dispatched one by one as places free,
//!    against enter and release with nothing queued.
//!
//! Every gateway here allows 4096 requests in flight per backend (`containerConcurrency`, as the
//! stub's `max_num_seqs`), so no section but the last queues in the gateway.
//!
//! `BENCH_QUICK=1` shrinks every sample count (for a smoke run);
//! `BENCH_ONLY=warm|ready|push|held|shared|tenants|fair` runs one section;
//! `BENCH_BASELINE_GATEWAY=<path>` adds another build of the binary (say, of the last commit) to
//! the warm rows.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::exit)]

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use bytes::Bytes;
use hearth_gateway::{
    EndpointSet, Gateway, GatewayConfig,
    apikeys::ApiKeys,
    fair::{Claim, Entry, FairQueue},
    scaler::pb::{ScaledObjectRef, external_scaler_client::ExternalScalerClient},
    tenants::{Tenant, Tenants},
};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vllm_stub::StubConfig;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// The binary's allocator (see `src/main.rs`), so the held-connections child, which is this
/// executable, measures what the `hearth-gateway` binary would.
#[global_allocator]
static ALLOC: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

const ROLE_ENV: &str = "HEARTH_BENCH_ROLE";

/// Requests in flight per backend for every gateway of the bench (`containerConcurrency`): the
/// stub's `max_num_seqs`, so requests never wait in the gateway's fair queue (the fair queue
/// section measures that queue on its own).
const BENCH_CONCURRENCY: u32 = 4096;

fn quick() -> bool {
    std::env::var_os("BENCH_QUICK").is_some()
}

fn main() {
    // A child role: the bench re-executes itself to run only a cold gateway, so its RSS and CPU
    // are the gateway's alone.
    match std::env::var(ROLE_ENV).as_deref() {
        Ok("cold-gateway") => return cold_gateway_child(),
        Ok(role @ ("single-gateway" | "shared-gateway" | "tenants-gateway")) => {
            return gateway_child(role);
        }
        _ => {}
    }
    // `cargo bench` passes `--bench`; ignore arguments.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(run());
}

async fn run() {
    let host = std::process::Command::new("uname")
        .arg("-srm")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    println!(
        "# hearth-gateway benchmarks\n\nmachine: {} cores, {host}; all processes on loopback\n",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    // `BENCH_ONLY=warm|ready|push|held|shared|tenants|fair` runs one section.
    let only = std::env::var("BENCH_ONLY").ok();
    let run = |name: &str| only.as_deref().is_none_or(|o| o == name);
    if run("warm") {
        warm_overhead().await;
    }
    if run("ready") {
        readiness_to_forward().await;
    }
    if run("push") {
        push_activation().await;
    }
    if run("held") {
        held_connections().await;
    }
    if run("shared") {
        shared_endpoint().await;
    }
    if run("tenants") {
        tenants_overhead().await;
    }
    if run("fair") {
        fair_queue_dispatch().await;
    }
}

// ---------------------------------------------------------------------------------------------
// Warm proxy overhead

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn wait_http(c: &HttpClient, url: &str) {
    for _ in 0..500 {
        if let Ok(r) = c
            .request(Request::get(url).body(Full::new(Bytes::new())).unwrap())
            .await
            && r.status().is_success()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{url} did not come up");
}

fn nginx_path() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/bin/nginx", "/usr/local/sbin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
}

/// Starts nginx as a reverse proxy to `upstream` with keep-alive upstream connections and no
/// response buffering (so SSE is streamed, as through the gateway), on two ports: `port` with
/// nginx's defaults, and `same_fields_port` also sending what the gateway adds to each request
/// (`Via`, RFC 9110 §7.6.3, and `X-Forwarded-For`/`-Host`/`-Proto`), as a reverse proxy in front
/// of a model server is usually configured.
fn start_nginx(
    upstream: SocketAddr,
    port: u16,
    same_fields_port: u16,
) -> Option<(Proc, tempdir::Dir)> {
    let bin = nginx_path()?;
    let dir = tempdir::Dir::new("hearth-bench-nginx");
    let conf = format!(
        r#"worker_processes auto;
daemon off;
user root;
pid {d}/nginx.pid;
error_log {d}/error.log warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {d}/body;
  proxy_temp_path {d}/proxy;
  fastcgi_temp_path {d}/fastcgi;
  uwsgi_temp_path {d}/uwsgi;
  scgi_temp_path {d}/scgi;
  upstream stub {{ server {upstream}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
      proxy_request_buffering on;
    }}
  }}
  server {{
    listen 127.0.0.1:{same_fields_port};
    location / {{
      proxy_pass http://stub;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Via "1.1 nginx";
      proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Host $host;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_buffering off;
      proxy_request_buffering on;
    }}
  }}
}}
"#,
        d = dir.path().display()
    );
    let conf_path = dir.path().join("nginx.conf");
    std::fs::write(&conf_path, conf).unwrap();
    let child = Command::new(bin)
        .args([
            "-c",
            conf_path.to_str().unwrap(),
            "-p",
            dir.path().to_str().unwrap(),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    Some((Proc(child), dir))
}

mod tempdir {
    use std::path::{Path, PathBuf};

    /// A temporary directory removed on drop.
    pub struct Dir(PathBuf);

    impl Dir {
        pub fn new(prefix: &str) -> Self {
            let p = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&p);
            std::fs::create_dir_all(&p).unwrap();
            Self(p)
        }
        pub fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn small_json() -> Bytes {
    Bytes::from(
        serde_json::json!({"model": "stub-svc", "max_tokens": 1, "stub_token_delay": "0s",
            "messages": [{"role": "user", "content": "ping"}]})
        .to_string(),
    )
}

fn sse_64() -> Bytes {
    sse_64_paced("0s")
}

/// A 64-token stream with `delay` between tokens (a Go-style duration).
fn sse_64_paced(delay: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({"model": "stub-svc", "max_tokens": 64, "stub_token_delay": delay,
            "stream": true, "messages": [{"role": "user", "content": "ping"}]})
        .to_string(),
    )
}

/// One `POST` of `body` to `url` (with `Authorization: <auth>` when given), its answer read
/// whole: the answer's length.
async fn one(c: &HttpClient, url: &str, body: &Bytes, auth: Option<&str>) -> usize {
    let mut req = Request::post(url).header("content-type", "application/json");
    if let Some(auth) = auth {
        req = req.header("authorization", auth);
    }
    let req = req.body(Full::new(body.clone())).unwrap();
    let resp = c.request(req).await.expect("request failed");
    assert!(resp.status().is_success(), "{url}: {}", resp.status());
    resp.into_body().collect().await.unwrap().to_bytes().len()
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn us(d: Duration) -> String {
    format!("{:.0}", d.as_secs_f64() * 1e6)
}

async fn throughput(
    c: &HttpClient,
    url: &str,
    body: &Bytes,
    auth: Option<&str>,
    conc: usize,
    dur: Duration,
) -> f64 {
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..conc {
        let (c, url, body, auth, done, stop) = (
            c.clone(),
            url.to_owned(),
            body.clone(),
            auth.map(str::to_owned),
            done.clone(),
            stop.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                one(&c, &url, &body, auth.as_deref()).await;
                done.fetch_add(1, Ordering::Relaxed);
            }
        }));
    }
    let start = Instant::now();
    tokio::time::sleep(dur).await;
    stop.store(true, Ordering::Relaxed);
    let n = done.load(Ordering::Relaxed);
    let el = start.elapsed();
    for t in tasks {
        let _ = t.await;
    }
    n as f64 / el.as_secs_f64()
}

/// Latency and throughput of one path.
struct PathResult {
    p50: Duration,
    p99: Duration,
    /// Requests per second at concurrency 32.
    tp: f64,
}

/// Latency of `urls` at concurrency 1 (`warmup` requests each first, then `rounds` rounds of
/// `per_round` requests per URL, interleaved), then throughput at concurrency 32 for
/// `tp_dur` each. Every request carries `Authorization: <auth>` when given.
#[allow(clippy::too_many_arguments)]
async fn measure_paths(
    c: &HttpClient,
    urls: &[String],
    body: &Bytes,
    auth: Option<&str>,
    per_round: usize,
    warmup: usize,
    rounds: usize,
    tp_dur: Duration,
) -> Vec<PathResult> {
    measure_paths_in(c, urls, body, auth, per_round, warmup, rounds, tp_dur, 1).await
}

/// [`measure_paths`], the throughput measured in `tp_rounds` windows of `tp_dur / tp_rounds`
/// per URL, interleaved (the mean of the windows' rates): a slow drift of the machine then
/// weighs on every URL alike.
#[allow(clippy::too_many_arguments)]
async fn measure_paths_in(
    c: &HttpClient,
    urls: &[String],
    body: &Bytes,
    auth: Option<&str>,
    per_round: usize,
    warmup: usize,
    rounds: usize,
    tp_dur: Duration,
    tp_rounds: usize,
) -> Vec<PathResult> {
    for u in urls {
        for _ in 0..warmup {
            one(c, u, body, auth).await;
        }
    }
    let mut samples: Vec<Vec<Duration>> = vec![Vec::new(); urls.len()];
    for _ in 0..rounds {
        for (i, u) in urls.iter().enumerate() {
            for _ in 0..per_round {
                let t = Instant::now();
                one(c, u, body, auth).await;
                samples[i].push(t.elapsed());
            }
        }
    }
    let tp_rounds = tp_rounds.max(1);
    let mut tps = vec![0.0; urls.len()];
    for _ in 0..tp_rounds {
        for (i, u) in urls.iter().enumerate() {
            tps[i] += throughput(c, u, body, auth, 32, tp_dur / tp_rounds as u32).await
                / tp_rounds as f64;
        }
    }
    samples
        .iter_mut()
        .zip(tps)
        .map(|(s, tp)| {
            s.sort();
            PathResult {
                p50: pct(s, 0.5),
                p99: pct(s, 0.99),
                tp,
            }
        })
        .collect()
}

/// `a - b` in µs with its sign, or `—` for the baseline row (`i == 0`).
fn added(i: usize, a: Duration, b: Duration) -> String {
    if i == 0 {
        "—".to_owned()
    } else {
        format!("{:+.0}", (a.as_secs_f64() - b.as_secs_f64()) * 1e6)
    }
}

/// The release gateway binary as a child process forwarding to `backend`; returns it with its
/// HTTP and ExternalScaler ports.
fn start_gateway(backend: &str) -> (Proc, u16, u16) {
    start_gateway_bin(env!("CARGO_BIN_EXE_hearth-gateway"), backend)
}

/// [`start_gateway`] for the gateway binary at `bin`.
fn start_gateway_bin(bin: &str, backend: &str) -> (Proc, u16, u16) {
    let (http, grpc) = (free_port(), free_port());
    let proc = Proc(
        Command::new(bin)
            .args([
                &format!("--listen=127.0.0.1:{http}"),
                &format!("--scaler-listen=127.0.0.1:{grpc}"),
                &format!("--backend-url={backend}"),
                "--max-queue=100000",
            ])
            // By environment, not flag: a baseline build from before the fair queue ignores it.
            .env(
                "HEARTH_CONTAINER_CONCURRENCY",
                BENCH_CONCURRENCY.to_string(),
            )
            .env("RUST_LOG", "warn")
            // By environment too: a baseline build from before the admin port ignores it.
            .env("HEARTH_ADMIN_LISTEN", format!("127.0.0.1:{}", free_port()))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    (proc, http, grpc)
}

async fn warm_overhead() {
    let stub = vllm_stub::spawn(
        StubConfig {
            served_model_names: vec!["stub-svc".into()],
            max_num_seqs: 4096,
            ..StubConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let c: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http();

    let (_gw, gw_port, _) = start_gateway(&stub.url());
    wait_http(&c, &format!("http://127.0.0.1:{gw_port}/readyz")).await;
    // The same binary with a KEDA `external-push` stream open, as in push mode: demand changes
    // on every request, and the stream must not cost each request a wake-up of its own.
    let (_gw_push, push_port, push_grpc) = start_gateway(&stub.url());
    wait_http(&c, &format!("http://127.0.0.1:{push_port}/readyz")).await;
    let pushed = Arc::new(AtomicU64::new(0));
    let ch = tonic::transport::Channel::from_shared(format!("http://127.0.0.1:{push_grpc}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut push_stream = ExternalScalerClient::new(ch)
        .stream_is_active(ScaledObjectRef::default())
        .await
        .unwrap()
        .into_inner();
    let counter = pushed.clone();
    tokio::spawn(async move {
        while let Ok(Some(_)) = push_stream.message().await {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });
    let (nginx_port, nginx_fields_port) = (free_port(), free_port());
    let nginx = start_nginx(stub.addr, nginx_port, nginx_fields_port);
    let mut paths: Vec<(&str, String)> = vec![
        ("direct", stub.url()),
        ("hearth-gateway", format!("http://127.0.0.1:{gw_port}")),
        (
            "hearth-gateway, push stream open",
            format!("http://127.0.0.1:{push_port}"),
        ),
    ];
    // Another build of the binary (`BENCH_BASELINE_GATEWAY=<path>`, say the last release's),
    // side by side with this one: a change's cost on the warm path within one run.
    let baseline = std::env::var("BENCH_BASELINE_GATEWAY").ok().map(|bin| {
        let (proc, port, _) = start_gateway_bin(&bin, &stub.url());
        (proc, port)
    });
    if let Some((_, port)) = &baseline {
        wait_http(&c, &format!("http://127.0.0.1:{port}/readyz")).await;
        paths.push((
            "hearth-gateway, baseline build",
            format!("http://127.0.0.1:{port}"),
        ));
    }
    if nginx.is_some() {
        wait_http(&c, &format!("http://127.0.0.1:{nginx_port}/health")).await;
        wait_http(&c, &format!("http://127.0.0.1:{nginx_fields_port}/health")).await;
        paths.push(("nginx", format!("http://127.0.0.1:{nginx_port}")));
        paths.push((
            "nginx, same forwarded fields",
            format!("http://127.0.0.1:{nginx_fields_port}"),
        ));
    } else {
        println!("(nginx not found: install nginx-light for the baseline row)\n");
    }

    let (rounds, per_round, tp_dur) = if quick() {
        (2, 50, Duration::from_millis(500))
    } else {
        (10, 300, Duration::from_secs(4))
    };
    let nginx_version = nginx_path()
        .and_then(|p| Command::new(p).arg("-v").output().ok())
        .map(|o| String::from_utf8_lossy(&o.stderr).trim().to_owned())
        .unwrap_or_default();
    println!("## Warm proxy overhead\n");
    // The paced stream: a backend that takes time per token, as a model does, so the load
    // generator, the stub and the proxy do not just compete for the same two cores.
    let paced_per_round = if quick() { 5 } else { 10 };
    println!(
        "Latency: concurrency 1, {} requests per path ({} for the paced stream), interleaved in \
         {rounds} rounds after warm-up. Throughput: concurrency 32 for {:?} per path. Stub: \
         token delay 0, except the paced stream (2 ms per token). {nginx_version}\n",
        rounds * per_round,
        rounds * paced_per_round,
        tp_dur
    );
    println!(
        "| workload | path | p50 µs | p99 µs | added p50 µs | added p99 µs | req/s | vs direct |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for (wname, body, per_round, warmup) in [
        ("small JSON", small_json(), per_round, 100),
        ("SSE 64 tokens", sse_64(), per_round, 100),
        (
            "SSE 64 tokens, 2 ms/token",
            sse_64_paced("2ms"),
            paced_per_round,
            5,
        ),
    ] {
        let urls: Vec<String> = paths
            .iter()
            .map(|(_, base)| format!("{base}/v1/chat/completions"))
            .collect();
        let results =
            measure_paths(&c, &urls, &body, None, per_round, warmup, rounds, tp_dur).await;
        let direct = &results[0];
        for (i, ((pname, _), r)) in paths.iter().zip(&results).enumerate() {
            println!(
                "| {wname} | {pname} | {} | {} | {} | {} | {:.0} | {:.0}% |",
                us(r.p50),
                us(r.p99),
                added(i, r.p50, direct.p50),
                added(i, r.p99, direct.p99),
                r.tp,
                100.0 * r.tp / direct.tp
            );
        }
    }
    println!(
        "\nStreamIsActive messages pushed to the open stream over the whole run: {}\n",
        pushed.load(Ordering::Relaxed)
    );
    drop(nginx);
    let _ = stub.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Readiness to forward

fn bench_config() -> GatewayConfig {
    GatewayConfig {
        heartbeat_interval: Duration::from_secs(1),
        activation_timeout: Duration::from_secs(600),
        activation_grace: Duration::ZERO,
        max_queue: 100_000,
        container_concurrency: BENCH_CONCURRENCY,
        ..GatewayConfig::default()
    }
}

async fn readiness_to_forward() {
    let stub = vllm_stub::spawn(
        StubConfig {
            served_model_names: vec!["stub-svc".into()],
            ..StubConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let backends = EndpointSet::new();
    let gw = hearth_gateway::spawn(
        Gateway::new(bench_config(), backends.clone(), ApiKeys::disabled()).unwrap(),
        "127.0.0.1".parse().unwrap(),
    )
    .await
    .unwrap();
    let c: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let ready: http::uri::Authority = stub.addr.to_string().parse().unwrap();
    let n = if quick() { 30 } else { 300 };
    let mut samples = Vec::with_capacity(n);
    let mut received = stub.state.subscribe_received();
    let url = format!("{}/v1/chat/completions", gw.url());
    for _ in 0..n {
        let req = Request::post(&url)
            .header("content-type", "application/json")
            .body(Full::new(small_json()))
            .unwrap();
        let c2 = c.clone();
        let task = tokio::spawn(async move { c2.request(req).await.map(|r| r.status()) });
        let mut d = gw.gateway.demand().subscribe();
        d.wait_for(|s| s.pending() == 1).await.unwrap();
        // Let the held request park on the endpoint watch.
        tokio::time::sleep(Duration::from_millis(2)).await;
        received.mark_unchanged();
        let before = *received.borrow();
        let t0 = Instant::now();
        backends.replace([ready.clone()]);
        received.wait_for(|v| *v > before).await.unwrap();
        samples.push(t0.elapsed());
        assert!(task.await.unwrap().unwrap().is_success());
        // The lease ends once the backend is seen ready (grace 0); then the backend goes away.
        d.wait_for(|s| s.local() == 0).await.unwrap();
        backends.replace(Vec::new());
        // A cold request comes after idle time, when the CPUs are idle too: measured from
        // there, not from a loop that keeps them busy.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    samples.sort();
    println!("## Readiness to forward\n");
    println!(
        "{n} held requests; clock from the endpoint set turning ready (what the EndpointSlice watch \
         does) to the stub receiving the request. Goal: p99 under 20 ms.\n"
    );
    println!("| samples | p50 µs | p99 µs | max µs |");
    println!("|---:|---:|---:|---:|");
    println!(
        "| {n} | {} | {} | {} |\n",
        us(pct(&samples, 0.5)),
        us(pct(&samples, 0.99)),
        us(*samples.last().unwrap())
    );
    gw.gateway.stop();
    let _ = stub.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Push activation

async fn push_activation() {
    let backends = EndpointSet::new();
    let gw = hearth_gateway::spawn(
        Gateway::new(bench_config(), backends.clone(), ApiKeys::disabled()).unwrap(),
        "127.0.0.1".parse().unwrap(),
    )
    .await
    .unwrap();
    let ch = tonic::transport::Channel::from_shared(gw.grpc_url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut k = ExternalScalerClient::new(ch);
    let mut stream = k
        .stream_is_active(ScaledObjectRef::default())
        .await
        .unwrap()
        .into_inner();
    assert!(!stream.message().await.unwrap().unwrap().result);
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        small_json().len()
    );
    let mut wire = request.into_bytes();
    wire.extend_from_slice(&small_json());
    let dead: http::uri::Authority = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let n = if quick() { 30 } else { 300 };
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let mut sock = tokio::net::TcpStream::connect(gw.http).await.unwrap();
        sock.set_nodelay(true).unwrap();
        let t0 = Instant::now();
        sock.write_all(&wire).await.unwrap();
        let msg = stream.message().await.unwrap().unwrap();
        samples.push(t0.elapsed());
        assert!(msg.result);
        // Reset: the client leaves, a (dead) endpoint appears so the lease ends, then cold again.
        drop(sock);
        backends.replace([dead.clone()]);
        assert!(!stream.message().await.unwrap().unwrap().result);
        backends.replace(Vec::new());
        // A cold request comes after idle time, when the CPUs are idle too: measured from
        // there, not from a loop that keeps them busy.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    samples.sort();
    println!("## Push activation\n");
    println!(
        "{n} cold requests, each after 100 ms idle; clock from writing the request on a fresh \
         connection to the tonic client receiving StreamIsActive(true). Goal: under 5 ms.\n"
    );
    println!("| samples | p50 µs | p99 µs | max µs |");
    println!("|---:|---:|---:|---:|");
    println!(
        "| {n} | {} | {} | {} |\n",
        us(pct(&samples, 0.5)),
        us(pct(&samples, 0.99)),
        us(*samples.last().unwrap())
    );
    gw.gateway.stop();
}

// ---------------------------------------------------------------------------------------------
// Held connections

/// The child role: a gateway with no backend, printing its HTTP address, until stdin closes.
fn cold_gateway_child() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let gw = hearth_gateway::spawn(
            Gateway::new(bench_config(), EndpointSet::new(), ApiKeys::disabled()).unwrap(),
            "127.0.0.1".parse().unwrap(),
        )
        .await
        .unwrap();
        println!("{}", gw.http);
        // Run until the parent closes stdin.
        let _ = tokio::task::spawn_blocking(|| {
            let mut buf = [0u8; 16];
            while matches!(std::io::Read::read(&mut std::io::stdin(), &mut buf), Ok(n) if n > 0) {}
        })
        .await;
    });
}

fn proc_rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// utime + stime of `pid`, in clock ticks (USER_HZ, 100 on Linux).
fn proc_cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields after the command: state is index 0; utime is field 14 overall → index 11 here.
    let ut: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
    let st: u64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    ut + st
}

fn open_files_limit() -> u64 {
    std::fs::read_to_string("/proc/self/limits")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3)?.parse().ok())
        .unwrap_or(0)
}

async fn held_connections() {
    let target: usize = if quick() { 1000 } else { 10_000 };
    let limit = open_files_limit();
    println!("## Held cold connections\n");
    if limit < target as u64 + 200 {
        println!(
            "skipped: the open-files limit is {limit}; raise it (`ulimit -n {}`) to hold {target} connections\n",
            target + 1000
        );
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .env(ROLE_ENV, "cold-gateway")
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    let addr: SocketAddr = line.trim().parse().unwrap();
    let rss_idle = proc_rss_kib(pid);

    let body = sse_64();
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let mut wire = head.into_bytes();
    wire.extend_from_slice(&body);
    let wire = Bytes::from(wire);
    let heartbeats = Arc::new(AtomicU64::new(0));
    let connected = Arc::new(AtomicU64::new(0));
    let sem = Arc::new(tokio::sync::Semaphore::new(256));
    let mut tasks = Vec::with_capacity(target);
    for _ in 0..target {
        let (wire, hb, conn, sem) = (
            wire.clone(),
            heartbeats.clone(),
            connected.clone(),
            sem.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let permit = sem.acquire_owned().await.unwrap();
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(&wire).await.unwrap();
            let mut buf = [0u8; 512];
            // The first read holds the status line and the first comment line.
            let n = s.read(&mut buf).await.unwrap();
            assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
            conn.fetch_add(1, Ordering::Relaxed);
            drop(permit);
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        hb.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    let t_connect = Instant::now();
    while connected.load(Ordering::Relaxed) < target as u64 {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let connect_time = t_connect.elapsed();
    // Settle, then measure over a window of several heartbeat intervals.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let window = if quick() {
        Duration::from_secs(3)
    } else {
        Duration::from_secs(10)
    };
    let hb0 = heartbeats.load(Ordering::Relaxed);
    let cpu0 = proc_cpu_ticks(pid);
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    let cpu1 = proc_cpu_ticks(pid);
    let el = t0.elapsed();
    let hb1 = heartbeats.load(Ordering::Relaxed);
    let rss_held = proc_rss_kib(pid);
    let cpu_pct = (cpu1 - cpu0) as f64 / 100.0 / el.as_secs_f64() * 100.0;
    let hb_rate = (hb1 - hb0) as f64 / el.as_secs_f64();
    println!(
        "{target} streaming requests held by a gateway with no ready backend (keepalive mode, \
         heartbeat every 1s), each on its own connection; the gateway runs alone in a child \
         process. Goal: RSS under 100 MiB.\n"
    );
    println!(
        "| connections | connect all (s) | RSS idle MiB | RSS held MiB | per connection KiB | CPU % of one core | heartbeats/s received |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {target} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} |\n",
        connect_time.as_secs_f64(),
        rss_idle as f64 / 1024.0,
        rss_held as f64 / 1024.0,
        (rss_held.saturating_sub(rss_idle)) as f64 / target as f64,
        cpu_pct,
        hb_rate
    );
    for t in &tasks {
        t.abort();
    }
    drop(child.stdin.take());
    let _ = child.wait();
}

// ---------------------------------------------------------------------------------------------
// Shared endpoint

/// Models of the bench's shared gateway.
const SHARED_MODELS: usize = 100;

/// The name of model `i` of the shared gateway (the stub serves them all).
fn shared_model(i: usize) -> String {
    format!("m{i:03}")
}

/// The child roles `single-gateway`, `tenants-gateway` and `shared-gateway`: the library serving
/// on `HEARTH_BENCH_PORT` with 2 HTTP workers (as the binary on 2 cores), forwarding to the stub
/// at `HEARTH_BENCH_STUB`: one service (with the tenants of [`bench_tenants`] for
/// `tenants-gateway`), or [`SHARED_MODELS`] models all on the stub. Prints `ready`, runs until
/// stdin closes.
fn gateway_child(role: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let stub: http::uri::Authority =
            std::env::var("HEARTH_BENCH_STUB").unwrap().parse().unwrap();
        let port: u16 = std::env::var("HEARTH_BENCH_PORT").unwrap().parse().unwrap();
        let (tenants, keys) = bench_tenants();
        let cfg = GatewayConfig {
            max_queue: 100_000,
            container_concurrency: BENCH_CONCURRENCY,
            tenants,
            ..GatewayConfig::default()
        };
        let gw = if role == "single-gateway" || role == "tenants-gateway" {
            Gateway::new(cfg, EndpointSet::fixed([stub]), keys).unwrap()
        } else {
            let gw = Gateway::new_shared(
                cfg,
                ApiKeys::disabled(),
                Arc::new(
                    move |_: &hearth_crds::llmendpoint::ModelRoute, eps: &EndpointSet| {
                        eps.replace([stub.clone()]);
                    },
                ),
            )
            .unwrap();
            let models = (0..SHARED_MODELS)
                .map(|i| hearth_crds::llmendpoint::ModelRoute {
                    max_queue: 100_000,
                    container_concurrency: Some(BENCH_CONCURRENCY),
                    ..hearth_gateway::routes::default_route(
                        "bench",
                        &shared_model(i),
                        &shared_model(i),
                    )
                })
                .collect();
            gw.apply_routes(&hearth_crds::llmendpoint::RouteTable { models })
                .unwrap();
            gw
        };
        gw.spawn_background(Duration::from_secs(10));
        let _workers = gw
            .serve_http_workers(SocketAddr::from(([127, 0, 0, 1], port)), 2)
            .unwrap();
        println!("ready");
        let _ = tokio::task::spawn_blocking(|| {
            let mut buf = [0u8; 16];
            while matches!(std::io::Read::read(&mut std::io::stdin(), &mut buf), Ok(n) if n > 0) {}
        })
        .await;
    });
}

/// The tenants and keys of a gateway child: with `HEARTH_BENCH_KEYS_DIR`, tenants `a` (band 0)
/// and `b` (band 5) whose keys are the files `a` and `b` there, each with quotas too large to
/// refuse anything when `HEARTH_BENCH_QUOTAS=1`; without it, keys off (the default tenant).
fn bench_tenants() -> (Tenants, ApiKeys) {
    let Some(dir) = std::env::var_os("HEARTH_BENCH_KEYS_DIR") else {
        return (Tenants::default(), ApiKeys::disabled());
    };
    let quotas = if std::env::var("HEARTH_BENCH_QUOTAS").as_deref() == Ok("1") {
        ",requests-per-minute=1000000000,tokens-per-minute=1000000000000"
    } else {
        ""
    };
    let dir = PathBuf::from(dir);
    let declared = [("a", 0), ("b", 5)]
        .iter()
        .map(|(name, priority)| {
            let file = dir.join(name);
            Tenant::parse(&format!(
                "name={name},priority={priority},key-file={}{quotas}",
                file.display()
            ))
            .unwrap()
        })
        .collect();
    let tenants = Tenants::new(declared).unwrap();
    let keys = ApiKeys::load_tenants(None, &tenants).unwrap();
    (tenants, keys)
}

/// A gateway child of `role` (see [`gateway_child`]) forwarding to `stub`: the process and its
/// HTTP port, once it serves.
fn start_child(role: &str, stub: SocketAddr) -> (Child, u16) {
    start_child_with(role, stub, &[])
}

/// [`start_child`] with the environment `env` added.
fn start_child_with(role: &str, stub: SocketAddr, env: &[(&str, &str)]) -> (Child, u16) {
    let port = free_port();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .envs(env.iter().copied())
        .env(ROLE_ENV, role)
        .env("HEARTH_BENCH_STUB", stub.to_string())
        .env("HEARTH_BENCH_PORT", port.to_string())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut out, &mut line).unwrap();
    assert_eq!(line.trim(), "ready", "the {role} child did not start");
    (child, port)
}

/// A JSON completion request body for `model` (as [`small_json`]).
fn small_json_for(model: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({"model": model, "max_tokens": 1, "stub_token_delay": "0s",
            "messages": [{"role": "user", "content": "ping"}]})
        .to_string(),
    )
}

/// A 64-token stream request body for `model` (as [`sse_64`]).
fn sse_64_for(model: &str) -> Bytes {
    Bytes::from(
        serde_json::json!({"model": model, "max_tokens": 64, "stub_token_delay": "0s",
            "stream": true, "messages": [{"role": "user", "content": "ping"}]})
        .to_string(),
    )
}

/// GET `url` `n` times at concurrency 1 (after 50 warm-up requests): sorted latencies.
async fn get_latencies(c: &HttpClient, url: &str, n: usize) -> Vec<Duration> {
    let get = || async {
        let resp = c
            .request(Request::get(url).body(Full::new(Bytes::new())).unwrap())
            .await
            .unwrap();
        assert!(resp.status().is_success(), "{url}: {}", resp.status());
        resp.into_body().collect().await.unwrap().to_bytes().len()
    };
    for _ in 0..50 {
        get().await;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        get().await;
        samples.push(t.elapsed());
    }
    samples.sort();
    samples
}

async fn shared_endpoint() {
    let mut names: Vec<String> = (0..SHARED_MODELS).map(shared_model).collect();
    names.push("stub-svc".into());
    let stub = vllm_stub::spawn(
        StubConfig {
            served_model_names: names,
            max_num_seqs: 4096,
            ..StubConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let c: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http();
    let (mut single, single_port) = start_child("single-gateway", stub.addr);
    let (mut shared, shared_port) = start_child("shared-gateway", stub.addr);
    wait_http(&c, &format!("http://127.0.0.1:{single_port}/readyz")).await;
    wait_http(&c, &format!("http://127.0.0.1:{shared_port}/readyz")).await;
    // Idle, before any proxied request.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_single, rss_shared) = (proc_rss_kib(single.id()), proc_rss_kib(shared.id()));

    let (rounds, per_round, tp_dur, list_n) = if quick() {
        (2, 50, Duration::from_millis(500), 200)
    } else {
        (10, 300, Duration::from_secs(4), 3000)
    };
    let paths = [
        ("direct", stub.url()),
        (
            "per-service gateway",
            format!("http://127.0.0.1:{single_port}"),
        ),
        (
            "shared gateway, 100 models",
            format!("http://127.0.0.1:{shared_port}"),
        ),
    ];
    println!("## Shared endpoint\n");
    println!(
        "A shared gateway with {SHARED_MODELS} models (route table built in code, every model's \
         backend the stub) against a per-service gateway, each the library serving with 2 HTTP \
         workers in a child process of its own; requests name model {}. Latency: concurrency 1, \
         {} requests per path, interleaved in {rounds} rounds after warm-up. Throughput: \
         concurrency 32 for {tp_dur:?} per path. Stub token delay 0.\n",
        shared_model(42),
        rounds * per_round,
    );
    println!(
        "| workload | path | p50 µs | p99 µs | added p50 µs | added p99 µs | req/s | vs direct | vs per-service |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    let model = shared_model(42);
    for (wname, body) in [
        ("small JSON", small_json_for(&model)),
        ("SSE 64 tokens", sse_64_for(&model)),
    ] {
        let urls: Vec<String> = paths
            .iter()
            .map(|(_, base)| format!("{base}/v1/chat/completions"))
            .collect();
        let results = measure_paths(&c, &urls, &body, None, per_round, 100, rounds, tp_dur).await;
        let (direct, per_service) = (&results[0], &results[1]);
        for (i, ((pname, _), r)) in paths.iter().zip(&results).enumerate() {
            let vs_service = if i == 0 {
                "—".to_owned()
            } else {
                format!("{:.0}%", 100.0 * r.tp / per_service.tp)
            };
            println!(
                "| {wname} | {pname} | {} | {} | {} | {} | {:.0} | {:.0}% | {vs_service} |",
                us(r.p50),
                us(r.p99),
                added(i, r.p50, direct.p50),
                added(i, r.p99, direct.p99),
                r.tp,
                100.0 * r.tp / direct.tp,
            );
        }
    }

    let list_url = format!("http://127.0.0.1:{shared_port}/v1/models");
    let (status, list) = {
        let resp = c
            .request(
                Request::get(&list_url)
                    .body(Full::new(Bytes::new()))
                    .unwrap(),
            )
            .await
            .unwrap();
        (
            resp.status(),
            resp.into_body().collect().await.unwrap().to_bytes(),
        )
    };
    let list: serde_json::Value = serde_json::from_slice(&list).unwrap();
    assert!(status.is_success(), "{status}: {list}");
    assert_eq!(list["data"].as_array().map(Vec::len), Some(SHARED_MODELS));
    let models = get_latencies(&c, &list_url, list_n).await;
    let healthz = get_latencies(
        &c,
        &format!("http://127.0.0.1:{shared_port}/healthz"),
        list_n,
    )
    .await;
    println!(
        "\n`GET /v1/models` of the shared gateway ({SHARED_MODELS} models: state, ready replicas \
         and expected wait of each), concurrency 1, {list_n} requests; `GET /healthz` of the same \
         gateway as the baseline. Goal: p99 under 5 ms.\n"
    );
    println!("| request | p50 µs | p99 µs | max µs |");
    println!("|---|---:|---:|---:|");
    for (name, s) in [("GET /v1/models", &models), ("GET /healthz", &healthz)] {
        println!(
            "| {name} | {} | {} | {} |",
            us(pct(s, 0.5)),
            us(pct(s, 0.99)),
            us(*s.last().unwrap())
        );
    }

    println!("\nIdle RSS (after start, before any proxied request) of each child process.\n");
    println!(
        "| gateway | RSS MiB | per model KiB | vs one per-service gateway | vs 100 per-service gateways |"
    );
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| per-service | {:.1} | — | 1.00× | — |",
        rss_single as f64 / 1024.0
    );
    println!(
        "| shared, {SHARED_MODELS} idle models | {:.1} | {:.1} | {:.2}× | {:.1}% |\n",
        rss_shared as f64 / 1024.0,
        rss_shared.saturating_sub(rss_single) as f64 / SHARED_MODELS as f64,
        rss_shared as f64 / rss_single as f64,
        100.0 * rss_shared as f64 / (SHARED_MODELS as f64 * rss_single as f64),
    );
    for child in [&mut single, &mut shared] {
        drop(child.stdin.take());
        let _ = child.wait();
    }
    let _ = stub.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Tenants and quotas on vs off

/// The key of tenant `a` of [`bench_tenants`], sent by every request of the section (also to
/// the paths without keys, so every path gets the same bytes).
const BENCH_KEY: &str = "Bearer sk-bench-a";

async fn tenants_overhead() {
    let stub = vllm_stub::spawn(
        StubConfig {
            served_model_names: vec!["stub-svc".into()],
            max_num_seqs: 4096,
            ..StubConfig::default()
        },
        "127.0.0.1:0".parse().unwrap(),
    )
    .await
    .unwrap();
    let c: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(256)
        .build_http();
    let keys = tempdir::Dir::new("hearth-bench-keys");
    std::fs::write(keys.path().join("a"), "sk-bench-a\n").unwrap();
    std::fs::write(keys.path().join("b"), "sk-bench-b\n").unwrap();
    let dir = keys.path().to_str().unwrap();
    let (mut off, off_port) = start_child("single-gateway", stub.addr);
    // The same child again: how far two instances of one configuration land apart.
    let (mut off2, off2_port) = start_child("single-gateway", stub.addr);
    let (mut on, on_port) = start_child_with(
        "tenants-gateway",
        stub.addr,
        &[("HEARTH_BENCH_KEYS_DIR", dir), ("HEARTH_BENCH_QUOTAS", "0")],
    );
    let (mut quota, quota_port) = start_child_with(
        "tenants-gateway",
        stub.addr,
        &[("HEARTH_BENCH_KEYS_DIR", dir), ("HEARTH_BENCH_QUOTAS", "1")],
    );
    for port in [off_port, off2_port, on_port, quota_port] {
        wait_http(&c, &format!("http://127.0.0.1:{port}/readyz")).await;
    }
    // The paths are what they say: keys are checked, the quota answers its headers.
    let probe = |port: u16, auth: &'static str| {
        let c = c.clone();
        async move {
            let req = Request::post(format!("http://127.0.0.1:{port}/v1/chat/completions"))
                .header("content-type", "application/json")
                .header("authorization", auth)
                .body(Full::new(small_json()))
                .unwrap();
            let resp = c.request(req).await.unwrap();
            let (status, quota) = (
                resp.status(),
                resp.headers()
                    .contains_key("x-ratelimit-remaining-requests"),
            );
            resp.into_body().collect().await.unwrap();
            (status.as_u16(), quota)
        }
    };
    assert_eq!(probe(off_port, "Bearer sk-nobody").await, (200, false));
    assert_eq!(probe(off2_port, "Bearer sk-nobody").await, (200, false));
    assert_eq!(probe(on_port, "Bearer sk-nobody").await, (401, false));
    assert_eq!(probe(on_port, BENCH_KEY).await, (200, false));
    assert_eq!(probe(quota_port, BENCH_KEY).await, (200, true));

    let (rounds, per_round, tp_dur, tp_rounds) = if quick() {
        (2, 50, Duration::from_millis(500), 1)
    } else {
        (10, 500, Duration::from_secs(8), 8)
    };
    // The second instance of keys off last: what the position in a round costs shows too.
    let paths = [
        ("direct", stub.url()),
        ("keys off", format!("http://127.0.0.1:{off_port}")),
        ("keys, 2 tenants", format!("http://127.0.0.1:{on_port}")),
        (
            "keys, 2 tenants, quotas",
            format!("http://127.0.0.1:{quota_port}"),
        ),
        (
            "keys off, second instance",
            format!("http://127.0.0.1:{off2_port}"),
        ),
    ];
    println!("## Tenants and quotas on vs off\n");
    println!(
        "The per-service gateway (the library with 2 HTTP workers in a child process, \
         containerConcurrency {BENCH_CONCURRENCY}) four times, in front of the same stub: API \
         keys off, twice (the second instance, measured last in each round, shows how far two \
         of the same land apart); keys naming one of 2 tenants (bands 0 and 5); the same with \
         each tenant's requests and tokens per minute limited (limits too large to refuse \
         anything: the body is parsed for `max_tokens`, the buckets are charged and settled to \
         the answer's `usage`, the answer carries the `x-ratelimit-*` headers). Every request \
         carries the key of tenant `a`. Latency: concurrency 1, {} requests per path, interleaved in {rounds} rounds after \
         warm-up. Throughput: concurrency 32 for {tp_dur:?} per path, in {tp_rounds} windows \
         interleaved with the other paths'. Stub token delay 0. Goal: at most 5 µs more than \
         keys off at p50.\n",
        rounds * per_round,
    );
    println!(
        "| workload | path | p50 µs | p99 µs | added p50 µs | added p99 µs | vs keys off p50 µs | vs keys off p99 µs | req/s | vs keys off |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (wname, body) in [("small JSON", small_json()), ("SSE 64 tokens", sse_64())] {
        let urls: Vec<String> = paths
            .iter()
            .map(|(_, base)| format!("{base}/v1/chat/completions"))
            .collect();
        let results = measure_paths_in(
            &c,
            &urls,
            &body,
            Some(BENCH_KEY),
            per_round,
            100,
            rounds,
            tp_dur,
            tp_rounds,
        )
        .await;
        let (direct, off) = (&results[0], &results[1]);
        for (i, ((pname, _), r)) in paths.iter().zip(&results).enumerate() {
            let (d50, d99, dtp) = if i < 2 {
                ("—".to_owned(), "—".to_owned(), "—".to_owned())
            } else {
                (
                    added(i, r.p50, off.p50),
                    added(i, r.p99, off.p99),
                    format!("{:.0}%", 100.0 * r.tp / off.tp),
                )
            };
            println!(
                "| {wname} | {pname} | {} | {} | {} | {} | {d50} | {d99} | {:.0} | {dtp} |",
                us(r.p50),
                us(r.p99),
                added(i, r.p50, direct.p50),
                added(i, r.p99, direct.p99),
                r.tp,
            );
        }
    }
    println!();
    // The gateway's own cost, apart from the client's: its CPU time per small-JSON request.
    let children = [
        ("keys off", off.id(), off_port),
        ("keys, 2 tenants", on.id(), on_port),
        ("keys, 2 tenants, quotas", quota.id(), quota_port),
        ("keys off, second instance", off2.id(), off2_port),
    ];
    let cpu_rounds = if quick() { 2 } else { 10 };
    let cpu_per_round = if quick() { 100 } else { 1000 };
    let mut cpu = vec![Duration::ZERO; children.len()];
    for _ in 0..cpu_rounds {
        for (i, (_, pid, port)) in children.iter().enumerate() {
            let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
            let before = process_cpu(*pid);
            for _ in 0..cpu_per_round {
                one(&c, &url, &small_json(), Some(BENCH_KEY)).await;
            }
            cpu[i] += process_cpu(*pid).saturating_sub(before);
        }
    }
    let n = (cpu_rounds * cpu_per_round) as u32;
    println!(
        "The gateway child's CPU time (user and system, all its threads, from \
         `/proc/<pid>/task/*/schedstat`) per small-JSON request at concurrency 1, {} requests \
         per path in {cpu_rounds} interleaved rounds: the gateway's own cost, without the \
         client's.\n",
        n
    );
    println!("| path | CPU µs per request | vs keys off µs |");
    println!("|---|---:|---:|");
    for (i, (name, _, _)) in children.iter().enumerate() {
        let per = cpu[i] / n;
        let vs = if i == 0 {
            "—".to_owned()
        } else {
            format!(
                "{:+.1}",
                (per.as_secs_f64() - (cpu[0] / n).as_secs_f64()) * 1e6
            )
        };
        println!("| {name} | {:.1} | {vs} |", per.as_secs_f64() * 1e6);
    }
    println!();
    for child in [&mut off, &mut off2, &mut on, &mut quota] {
        drop(child.stdin.take());
        let _ = child.wait();
    }
    let _ = stub.shutdown().await;
    tenant_steps_in_process(keys.path());
}

/// CPU time process `pid` has used so far: the sum over its threads of the first field of
/// `/proc/<pid>/task/<tid>/schedstat` (ns on a CPU, user and system).
fn process_cpu(pid: u32) -> Duration {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the child's /proc");
    let ns: u64 = tasks
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum();
    Duration::from_nanos(ns)
}

/// Mean ns of `f` over `n` calls (after `n / 10` to warm up).
fn mean_ns(n: usize, mut f: impl FnMut(usize)) -> f64 {
    for i in 0..n / 10 {
        f(i);
    }
    let t = Instant::now();
    for i in 0..n {
        f(i);
    }
    t.elapsed().as_secs_f64() * 1e9 / n as f64
}

/// The per-request steps tenants and quotas add, called in process (no HTTP): the HTTP rows
/// above are differences of about 100 µs paths; these are the steps alone.
fn tenant_steps_in_process(dir: &std::path::Path) {
    use hearth_gateway::{openai::RequestHints, quota::Quotas};

    let n = if quick() { 100_000 } else { 1_000_000 };
    let limits = ",requests-per-minute=1000000000,tokens-per-minute=1000000000000";
    let declared = ["a", "b"]
        .iter()
        .map(|t| {
            Tenant::parse(&format!(
                "name={t},key-file={}{limits}",
                dir.join(t).display()
            ))
            .unwrap()
        })
        .collect();
    let tenants = Tenants::new(declared).unwrap();
    let keys = ApiKeys::load_tenants(None, &tenants).unwrap();
    let quotas = Quotas::new(tenants);
    let method = http::Method::POST;
    let mut head = http::HeaderMap::new();
    head.insert("content-type", "application/json".parse().unwrap());
    let body = small_json();
    let a = keys.check(Some(BENCH_KEY.as_bytes()));
    assert_eq!(a, hearth_gateway::apikeys::AuthOutcome::Allowed(1));
    let rows = [
        (
            "API key → tenant (`ApiKeys::check`)",
            mean_ns(n, |_| {
                std::hint::black_box(keys.check(Some(std::hint::black_box(BENCH_KEY).as_bytes())));
            }),
        ),
        (
            "the body read for `max_tokens` (`RequestHints::from_request`, small JSON)",
            mean_ns(n, |_| {
                std::hint::black_box(RequestHints::from_request(
                    &method,
                    &head,
                    std::hint::black_box(&body),
                ));
            }),
        ),
        (
            "quota: admit, `x-ratelimit-*` headers, settle to the usage",
            mean_ns(n, |i| {
                quotas.admit(1, 20, Instant::now()).unwrap();
                // Into an answer's headers, as the gateway writes them.
                let mut answer = http::HeaderMap::with_capacity(4);
                answer.insert(
                    http::header::CONTENT_TYPE,
                    "application/json".parse().unwrap(),
                );
                quotas.write_headers(1, &mut answer);
                std::hint::black_box(answer);
                quotas.settle(1, (i % 7) as i64 - 3);
            }),
        ),
        (
            "the quota check of a tenant without one (`Quotas::limited`)",
            mean_ns(n, |_| {
                std::hint::black_box(quotas.limited(std::hint::black_box(0)));
            }),
        ),
    ];
    println!(
        "The same steps in process, one thread, {n} calls each (mean; the gateway runs them once \
         per request):\n"
    );
    println!("| step | ns per request |");
    println!("|---|---:|");
    for (step, v) in rows {
        println!("| {step} | {v:.0} |");
    }
    println!();
}

// ---------------------------------------------------------------------------------------------
// Fair queue dispatch

/// Tenant `t`'s claim: 100 tenants over bands 0, 5 and 10.
fn bench_claim(t: u32) -> Claim {
    Claim {
        tenant: t,
        priority: [0, 5, 10][(t % 3) as usize],
    }
}

/// `d` in ns.
fn ns(d: Duration) -> String {
    format!("{}", d.as_nanos())
}

/// Sorted `samples`' p50, p99 and mean.
fn stats(samples: &mut [Duration]) -> (Duration, Duration, Duration) {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len().max(1) as u32;
    (pct(samples, 0.5), pct(samples, 0.99), mean)
}

async fn fair_queue_dispatch() {
    use futures::{StreamExt, stream::FuturesUnordered};

    const TENANTS: u32 = 100;
    let (queued, base_n, runs) = if quick() {
        (2_000, 20_000, 1)
    } else {
        (10_000, 100_000, 3)
    };
    // One ready replica: with containerConcurrency 1, one place in flight. Several tenants:
    // the queue as a gateway with tenants builds it (one tenant keeps off the headroom, none
    // at capacity 1).
    let queue = || {
        FairQueue::with_tenants(
            1,
            EndpointSet::fixed(["10.0.0.1:8000".parse().unwrap()]),
            Arc::new(std::sync::atomic::AtomicUsize::new(1)),
            true,
        )
    };

    // Baseline: nothing waits, so `enter` dispatches at once and the release finds nobody.
    let q = queue();
    let mut base = Vec::with_capacity(base_n);
    for i in 0..base_n + 1000 {
        let t = Instant::now();
        let Entry::Dispatched(permit) = q.enter(bench_claim(i as u32 % TENANTS), 40.0) else {
            panic!("queued with nothing in flight");
        };
        drop(permit);
        if i >= 1000 {
            base.push(t.elapsed());
        }
    }
    assert_eq!(q.counts(), (0, 0));

    // Full: one request holds the place, `queued` wait; each release dispatches the next one
    // (the top band's tenant with the lowest counter), which is then served and released.
    let mut enters = Vec::with_capacity(queued * runs);
    let mut dispatches = Vec::with_capacity(queued * runs);
    for run in 0..runs {
        let q = queue();
        let Entry::Dispatched(mut running) = q.enter(bench_claim(0), 40.0) else {
            panic!("queued with nothing in flight");
        };
        let far = Instant::now() + Duration::from_secs(3600);
        let waits = FuturesUnordered::new();
        for i in 0..queued {
            // Tenants arrive interleaved, prompts of 20 to 140 tokens.
            let tenant = (i as u32).wrapping_mul(37).wrapping_add(run as u32) % TENANTS;
            let prompt = 20.0 + (i % 13) as f64 * 10.0;
            let t = Instant::now();
            let entry = q.enter(bench_claim(tenant), prompt);
            enters.push(t.elapsed());
            let Entry::Queued(ticket) = entry else {
                panic!("dispatched while the place is taken");
            };
            waits.push(ticket.wait(far));
        }
        assert_eq!(q.counts(), (queued, 1));
        let mut waits = waits;
        let mut bands = Vec::with_capacity(queued);
        for i in 0..queued {
            let t = Instant::now();
            drop(running);
            dispatches.push(t.elapsed());
            running = waits
                .next()
                .await
                .expect("a waiter")
                .expect("dispatched before its deadline");
            bands.push(running.claim().priority);
            // Served: 50 to 250 completion tokens.
            running.charge(50.0 + (i % 5) as f64 * 50.0);
        }
        drop(running);
        assert_eq!(q.counts(), (0, 0));
        // Strict bands: every request of band 10, then 5, then 0.
        assert!(
            bands.windows(2).all(|w| w[0] >= w[1]),
            "a lower band went before a higher one"
        );
    }

    let (b50, b99, bmean) = stats(&mut base);
    let (e50, e99, emean) = stats(&mut enters);
    let (d50, d99, dmean) = stats(&mut dispatches);
    let ratio = |mean: Duration| format!("{:.1}×", mean.as_secs_f64() / bmean.as_secs_f64());
    println!("## Fair queue dispatch\n");
    println!(
        "`hearth_gateway::fair::FairQueue` on its own (no HTTP), as a gateway with several \
         tenants makes it (`FairQueue::with_tenants`), one ready replica with \
         containerConcurrency 1. Baseline: `enter` with nothing queued (dispatched at once) and \
         the permit's release, {base_n} times over {TENANTS} tenants. Queued: one request holds \
         the place, {queued} requests of {TENANTS} tenants in 3 bands (0, 5, 10) enter the queue, \
         then each release dispatches the next one (highest band, lowest virtual token counter: \
         a scan of the band's backlogged tenants) to its waiting `Ticket`; {runs} runs. Times \
         include one `Instant::now()` (~20-30 ns).\n"
    );
    println!("| operation | samples | p50 ns | p99 ns | mean ns | mean vs baseline |");
    println!("|---|---:|---:|---:|---:|---:|");
    println!(
        "| enter + release, nothing queued (baseline) | {} | {} | {} | {} | 1.0× |",
        base.len(),
        ns(b50),
        ns(b99),
        ns(bmean)
    );
    println!(
        "| enter, queued (0 → {queued} waiting) | {} | {} | {} | {} | {} |",
        enters.len(),
        ns(e50),
        ns(e99),
        ns(emean),
        ratio(emean)
    );
    println!(
        "| release + dispatch of the next ({queued} → 0 waiting) | {} | {} | {} | {} | {} |",
        dispatches.len(),
        ns(d50),
        ns(d99),
        ns(dmean),
        ratio(dmean)
    );
    println!(
        "| enter + dispatch, queued (sum of means) | — | — | — | {} | {} |\n",
        ns(emean + dmean),
        ratio(emean + dmean)
    );
}

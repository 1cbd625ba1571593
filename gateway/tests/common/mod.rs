//! Shared test helpers: a real vllm-stub, a real gateway, and an HTTP client.
#![allow(dead_code)]

pub mod raw;
pub mod shared;

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use bytes::Bytes;
use hearth_gateway::{EndpointSet, Gateway, GatewayConfig, RunningGateway, apikeys::ApiKeys};
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode, body::Incoming};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tokio::{
    io::AsyncReadExt,
    net::{TcpListener, TcpStream},
};
use vllm_stub::{RunningStub, StubConfig};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    Client::builder(TokioExecutor::new()).build_http()
}

pub fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

pub fn stub_config() -> StubConfig {
    StubConfig {
        model: "/models/stub".into(),
        served_model_names: vec!["stub-svc".into()],
        token_count: 5,
        token_delay: Duration::from_millis(2),
        ..StubConfig::default()
    }
}

pub async fn stub() -> RunningStub {
    vllm_stub::spawn(stub_config(), localhost()).await.unwrap()
}

/// A stub serving model `name`.
pub async fn stub_named(name: &str) -> RunningStub {
    let cfg = StubConfig {
        served_model_names: vec![name.into()],
        ..stub_config()
    };
    vllm_stub::spawn(cfg, localhost()).await.unwrap()
}

/// A stub that generates 1000 tokens `token_delay` apart: a stream that outlives the test's
/// client unless it is cut.
pub async fn long_stub(token_delay: Duration) -> RunningStub {
    let cfg = StubConfig {
        token_count: 1000,
        token_delay,
        ..stub_config()
    };
    vllm_stub::spawn(cfg, localhost()).await.unwrap()
}

pub fn authority(stub: &RunningStub) -> http::uri::Authority {
    stub.addr.to_string().parse().unwrap()
}

pub fn config() -> GatewayConfig {
    GatewayConfig {
        heartbeat_interval: Duration::from_millis(50),
        activation_timeout: Duration::from_secs(30),
        activation_grace: Duration::from_millis(100),
        drain_timeout: Duration::from_secs(10),
        retry_after: Duration::from_secs(3),
        ..GatewayConfig::default()
    }
}

pub async fn gateway(cfg: GatewayConfig, backends: EndpointSet) -> RunningGateway {
    gateway_with_keys(cfg, backends, ApiKeys::disabled()).await
}

pub async fn gateway_with_keys(
    cfg: GatewayConfig,
    backends: EndpointSet,
    keys: ApiKeys,
) -> RunningGateway {
    hearth_gateway::spawn(
        Gateway::new(cfg, backends, keys).unwrap(),
        "127.0.0.1".parse().unwrap(),
    )
    .await
    .unwrap()
}

pub fn chat(stream: bool) -> serde_json::Value {
    serde_json::json!({
        "model": "stub-svc",
        "stream": stream,
        "messages": [{"role": "user", "content": "Hello there"}],
    })
}

pub fn post_req(
    url: &str,
    body: &serde_json::Value,
    headers: &[(&str, &str)],
) -> Request<Full<Bytes>> {
    let mut req = Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    req.body(Full::new(Bytes::from(body.to_string()))).unwrap()
}

/// A `POST {base}/v1/chat/completions` with `body` (see [`post_req`]).
pub fn chat_req(base: &str, body: &serde_json::Value) -> Request<Full<Bytes>> {
    post_req(&format!("{base}/v1/chat/completions"), body, &[])
}

/// Sends and returns the response with its body unread.
pub async fn send(c: &HttpClient, req: Request<Full<Bytes>>) -> Response<Incoming> {
    c.request(req).await.unwrap()
}

/// Sends and reads the whole body.
pub async fn send_full(
    c: &HttpClient,
    req: Request<Full<Bytes>>,
) -> (StatusCode, http::HeaderMap, Bytes) {
    let resp = send(c, req).await;
    let (parts, body) = resp.into_parts();
    (
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    )
}

pub async fn get(c: &HttpClient, url: &str) -> (StatusCode, Bytes) {
    let (s, _, b) = send_full(c, Request::get(url).body(Full::new(Bytes::new())).unwrap()).await;
    (s, b)
}

pub async fn json(c: &HttpClient, url: &str) -> (StatusCode, serde_json::Value) {
    let (s, b) = get(c, url).await;
    (
        s,
        serde_json::from_slice(&b).unwrap_or(serde_json::Value::Null),
    )
}

/// Reads the next data frame of a streaming body.
pub async fn next_chunk(body: &mut Incoming) -> Option<Bytes> {
    loop {
        match body.frame().await? {
            Ok(f) => {
                if let Ok(d) = f.into_data() {
                    return Some(d);
                }
            }
            Err(e) => panic!("body error: {e}"),
        }
    }
}

/// The events of an SSE body, split on blank lines.
pub fn sse_events(body: &[u8]) -> Vec<String> {
    std::str::from_utf8(body)
        .unwrap()
        .split("\n\n")
        .filter(|e| !e.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Waits until `pred` holds for the gateway's demand state (no time limit: the test runner's
/// own timeout applies; these waits end in milliseconds when the behaviour is right).
pub async fn wait_demand(
    g: &RunningGateway,
    pred: impl Fn(&hearth_gateway::demand::DemandState) -> bool,
) {
    let mut rx = g.gateway.demand().subscribe();
    rx.wait_for(|s| pred(s)).await.unwrap();
}

/// The value of one sample line (`name{labels} value`) in a Prometheus text body.
pub fn metric(text: &str, sample: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(sample).and_then(|r| r.strip_prefix(' ')))
        .and_then(|v| v.trim().parse().ok())
}

pub async fn gateway_metrics(c: &HttpClient, g: &RunningGateway) -> String {
    let (_, b) = get(c, &format!("{}/metrics", g.admin_url())).await;
    String::from_utf8(b.to_vec()).unwrap()
}

/// Serves `l` on a spawned task: accepts connections until accepting fails and runs
/// `handle(i, stream)` on its own task for each, `i` counting the listener's connections in
/// accept order from 0. `handle` itself is called in the accept loop, so work it does before
/// returning its future happens at accept time.
pub fn accept_each<F, Fut>(l: TcpListener, handle: F)
where
    F: Fn(usize, TcpStream) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    tokio::spawn(async move {
        for i in 0.. {
            let Ok((s, _)) = l.accept().await else {
                return;
            };
            tokio::spawn(handle(i, s));
        }
    });
}

/// Reads up to the end of a request head (the blank line); returns the bytes read after it.
/// `None` on EOF or a read error.
pub async fn read_head(s: &mut TcpStream) -> Option<Vec<u8>> {
    let mut buf = Vec::new();
    let mut tmp = [0u8; 8192];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            return Some(buf[end + 4..].to_vec());
        }
        let n = s.read(&mut tmp).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&tmp[..n]);
    }
}

/// Fails the test (instead of hanging it) when `f` takes longer than `secs`.
pub async fn within<T>(secs: u64, what: &str, f: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(secs), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: not done within {secs} s"))
}

/// A child process, killed and reaped when dropped.
pub struct Child(pub std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Sends SIGTERM to `child`.
pub fn sigterm(child: &Child) {
    let ok = std::process::Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .unwrap()
        .success();
    assert!(ok);
}

/// Waits for `child` to exit and returns its status, failing (and killing it) after `secs`.
pub async fn exit_within(child: Child, secs: u64) -> std::process::ExitStatus {
    let pid = child.0.id();
    let task = tokio::task::spawn_blocking(move || {
        let mut child = child;
        let s = child.0.wait().unwrap();
        // Already reaped: nothing left for Drop to kill.
        std::mem::forget(child);
        s
    });
    match tokio::time::timeout(Duration::from_secs(secs), task).await {
        Ok(s) => s.unwrap(),
        Err(_) => {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &pid.to_string()])
                .status();
            panic!("the process did not exit within {secs} s");
        }
    }
}

/// Runs the `hearth-gateway` binary with `args`, which it must refuse at start (non-zero exit);
/// returns what it wrote to stderr.
pub fn refused<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> String {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_hearth-gateway"))
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "accepted {:?}: {err}", out.status);
    err
}

/// Starts the `hearth-gateway` binary on free loopback ports with `args`; returns it, its
/// HTTP base URL and its admin port's base URL (open: no `--admin-auth-dir`).
pub fn spawn_gateway(args: &[String]) -> (Child, String, String) {
    let mut all = vec!["--http-workers=2".to_owned()];
    all.extend_from_slice(args);
    let g = spawn_gateway_at("127.0.0.1", &all);
    (
        g.child,
        format!("http://127.0.0.1:{}", g.http),
        format!("http://127.0.0.1:{}", g.admin),
    )
}

/// A `hearth-gateway` process listening on `host` (`127.0.0.1`, `[::]`) and its three ports.
pub struct Spawned {
    pub child: Child,
    pub http: u16,
    pub grpc: u16,
    pub admin: u16,
}

/// Starts `hearth-gateway` with `--listen`, `--scaler-listen` and `--admin-listen` on free ports
/// of `host` and `args`, and returns once it accepts connections (every port is bound by then).
/// A port free a moment ago may be taken (by another test's connection) before the gateway binds
/// it; the gateway then exits at once, and the ports are drawn again (five times at most).
pub fn spawn_gateway_at(host: &str, args: &[String]) -> Spawned {
    for _ in 0..5 {
        let (http, grpc, admin) = (free_port(), free_port(), free_port());
        let mut child = Child(
            std::process::Command::new(env!("CARGO_BIN_EXE_hearth-gateway"))
                .args([
                    format!("--listen={host}:{http}"),
                    format!("--scaler-listen={host}:{grpc}"),
                    format!("--admin-listen={host}:{admin}"),
                ])
                .args(args)
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap(),
        );
        if serving(&mut child, http) {
            return Spawned {
                child,
                http,
                grpc,
                admin,
            };
        }
    }
    panic!("hearth-gateway exited at start five times (its ports taken?)");
}

/// Waits (10 s at most) until `child` accepts on `http`, the port it binds last: true; false
/// when it exits first.
fn serving(child: &mut Child, http: u16) -> bool {
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(10) {
        if child.0.try_wait().unwrap().is_some() {
            return false;
        }
        if std::net::TcpStream::connect(("127.0.0.1", http)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("hearth-gateway did not listen on 127.0.0.1:{http} within 10 s");
}

/// Polls `url` with GET until it answers `want` (10 s at most).
pub async fn wait_status(c: &HttpClient, url: &str, want: StatusCode) {
    within(10, &format!("{url} -> {want}"), async {
        loop {
            let req = Request::get(url).body(Full::new(Bytes::new())).unwrap();
            if let Ok(r) = c.request(req).await
                && r.status() == want
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

/// A tonic client of `g`'s ExternalScaler.
pub async fn scaler_client(
    g: &RunningGateway,
) -> hearth_gateway::scaler::pb::external_scaler_client::ExternalScalerClient<
    tonic::transport::Channel,
> {
    let ch = tonic::transport::Channel::from_shared(g.grpc_url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    hearth_gateway::scaler::pb::external_scaler_client::ExternalScalerClient::new(ch)
}

/// The ScaledObject KEDA names in its calls, with trigger metadata `meta`.
pub fn so_ref(meta: &[(&str, &str)]) -> hearth_gateway::scaler::pb::ScaledObjectRef {
    hearth_gateway::scaler::pb::ScaledObjectRef {
        name: "stub-svc".into(),
        namespace: "hearth".into(),
        scaler_metadata: meta
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    }
}

/// `GetMetrics` for `name`, as KEDA sends it.
pub fn metrics_req(name: &str) -> hearth_gateway::scaler::pb::GetMetricsRequest {
    hearth_gateway::scaler::pb::GetMetricsRequest {
        scaled_object_ref: Some(so_ref(&[])),
        metric_name: name.into(),
    }
}

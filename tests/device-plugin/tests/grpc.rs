//! The binary against a stand-in kubelet: registration, ListAndWatch and Allocate over the real
//! gRPC API on unix sockets, re-registration after a "kubelet restart", and SIGTERM.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use hearth_fake_device_plugin::v1beta1::device_plugin_client::DevicePluginClient;
use hearth_fake_device_plugin::v1beta1::registration_server::{Registration, RegistrationServer};
use hearth_fake_device_plugin::v1beta1::{
    AllocateRequest, ContainerAllocateRequest, Empty, RegisterRequest,
};
use hearth_fake_device_plugin::{connect_unix, unix_incoming};
use tokio::net::UnixListener;
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::{Instant, timeout};
use tonic::transport::{Channel, Server};
use tonic::{Code, Request, Response, Status};

const RESOURCE: &str = "hearth.dev/fake-gpu";
const COUNT: usize = 4;
const ENV: &str = "HEARTH_VISIBLE_DEVICES";
const SOCKET: &str = "hearth-hearth.dev_fake-gpu.sock";
/// Bound on every wait.
const WAIT: Duration = Duration::from_secs(15);

/// The kubelet's side of `Registration`: like the real one, it dials the plugin back and asks
/// for its options before answering, then reports the request.
struct Registrar {
    dir: PathBuf,
    seen: mpsc::UnboundedSender<RegisterRequest>,
}

#[tonic::async_trait]
impl Registration for Registrar {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<Empty>, Status> {
        let req = req.into_inner();
        let mut plugin = dial(&self.dir.join(&req.endpoint))
            .await
            .map_err(|e| Status::unavailable(format!("cannot dial the plugin: {e}")))?;
        plugin.get_device_plugin_options(Empty {}).await?;
        let _ = self.seen.send(req);
        Ok(Response::new(Empty {}))
    }
}

/// A `Registration` server on `<dir>/kubelet.sock`.
struct FakeKubelet {
    path: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
    registrations: mpsc::UnboundedReceiver<RegisterRequest>,
}

impl FakeKubelet {
    fn start(dir: &Path) -> Self {
        Self::start_as(dir, "kubelet.sock")
    }

    /// Serves on `<dir>/<name>`, then renames that to `kubelet.sock` (replacing what was there).
    fn start_as(dir: &Path, name: &str) -> Self {
        let path = dir.join("kubelet.sock");
        let bound = dir.join(name);
        let _ = std::fs::remove_file(&bound);
        let listener = UnixListener::bind(&bound).unwrap();
        std::fs::rename(&bound, &path).unwrap();
        let (seen, registrations) = mpsc::unbounded_channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let registrar = Registrar {
            dir: dir.to_owned(),
            seen,
        };
        let task = tokio::spawn(
            Server::builder()
                .add_service(RegistrationServer::new(registrar))
                .serve_with_incoming_shutdown(unix_incoming(listener), async {
                    let _ = stopped.await;
                }),
        );
        Self {
            path,
            stop: Some(stop),
            task,
            registrations,
        }
    }

    async fn next_registration(&mut self) -> RegisterRequest {
        timeout(WAIT, self.registrations.recv())
            .await
            .expect("no registration in time")
            .expect("registration channel closed")
    }

    /// Stops serving and removes `kubelet.sock`, as a stopping kubelet does.
    async fn stop(self) {
        let path = self.path.clone();
        self.stop_serving().await;
        std::fs::remove_file(path).unwrap();
    }

    /// Stops serving, leaving the socket file alone.
    async fn stop_serving(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        timeout(WAIT, self.task)
            .await
            .expect("the fake kubelet did not stop in time")
            .unwrap()
            .unwrap();
    }
}

async fn dial(path: &Path) -> Result<DevicePluginClient<Channel>, tonic::transport::Error> {
    Ok(DevicePluginClient::new(
        connect_unix(path.to_owned()).await?,
    ))
}

fn assert_registration(req: &RegisterRequest) {
    assert_eq!(req.version, "v1beta1");
    assert_eq!(
        req.endpoint, SOCKET,
        "the endpoint is the socket's file name"
    );
    assert_eq!(req.resource_name, RESOURCE);
    let options = req.options.as_ref().expect("options are sent");
    assert!(!options.pre_start_required);
    assert!(!options.get_preferred_allocation_available);
}

/// Calls ListAndWatch and checks its first answer: COUNT distinct healthy devices. Returns their
/// IDs and the (still open) stream.
async fn list_devices(
    plugin: &mut DevicePluginClient<Channel>,
) -> (
    Vec<String>,
    tonic::Streaming<hearth_fake_device_plugin::v1beta1::ListAndWatchResponse>,
) {
    let mut stream = timeout(WAIT, plugin.list_and_watch(Empty {}))
        .await
        .expect("ListAndWatch in time")
        .unwrap()
        .into_inner();
    let first = timeout(WAIT, stream.message())
        .await
        .expect("a device list in time")
        .unwrap()
        .expect("a device list");
    assert_eq!(first.devices.len(), COUNT);
    assert!(first.devices.iter().all(|d| d.health == "Healthy"));
    let ids: Vec<String> = first.devices.into_iter().map(|d| d.id).collect();
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), COUNT, "{ids:?}");
    (ids, stream)
}

/// Polls `cond` every 20 ms until it holds; fails after `WAIT`.
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn start_plugin(dir: &Path) -> Child {
    Command::new(env!("CARGO_BIN_EXE_hearth-fake-device-plugin"))
        .arg("--device-plugin-dir")
        .arg(dir)
        .arg("--resource")
        .arg(format!("{RESOURCE}={COUNT}:{ENV}"))
        .env("RUST_LOG", "debug,h2=info,hyper=info,tower=info")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_serves_reregisters_and_cleans_up() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let socket = dir.join(SOCKET);

    // The plugin starts before the kubelet: it serves, and retries registering until
    // kubelet.sock answers.
    let mut child = start_plugin(dir);
    eventually("the plugin's socket", || socket.exists()).await;
    let mut kubelet = FakeKubelet::start(dir);
    let registration = kubelet.next_registration().await;
    assert_registration(&registration);

    // The kubelet's calls.
    let mut plugin = dial(&socket).await.unwrap();
    let options = plugin
        .get_device_plugin_options(Empty {})
        .await
        .unwrap()
        .into_inner();
    assert!(!options.pre_start_required && !options.get_preferred_allocation_available);
    let (ids, mut old_stream) = list_devices(&mut plugin).await;
    let wanted = vec![ids[1].clone(), ids[3].clone()];
    let allocated = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                device_ids: wanted.clone(),
            }],
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(allocated.container_responses.len(), 1);
    let value = &allocated.container_responses[0].envs[ENV];
    let got: Vec<&str> = value.split(',').collect();
    assert_eq!(got, wanted, "{ENV}={value}");
    assert_ne!(got[0], got[1]);
    let refused = plugin
        .allocate(AllocateRequest {
            container_requests: vec![ContainerAllocateRequest {
                device_ids: vec!["no-such-device".into()],
            }],
        })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("no-such-device"));

    // A kubelet restart: the kubelet goes away, its start wipes the plugin sockets, and a new
    // kubelet.sock appears. The plugin notices its socket is gone and re-creates it at once,
    // then retries registering until kubelet.sock is back.
    kubelet.stop().await;
    std::fs::remove_file(&socket).unwrap();
    eventually("the plugin to re-create its socket", || socket.exists()).await;
    let mut kubelet = FakeKubelet::start(dir);
    let registration = kubelet.next_registration().await;
    assert_registration(&registration);
    // The old server stopped, ending its stream; the new socket serves.
    let ended = timeout(WAIT, old_stream.message())
        .await
        .expect("the old ListAndWatch stream ends");
    assert!(matches!(ended, Ok(None) | Err(_)), "{ended:?}");
    let mut plugin = dial(&socket).await.unwrap();
    let (new_ids, mut old_stream) = list_devices(&mut plugin).await;
    assert_eq!(new_ids, ids, "device IDs are stable");

    // Only kubelet.sock is replaced (a new inode at the same path): the plugin registers again.
    let old_kubelet = kubelet;
    let mut kubelet = FakeKubelet::start_as(dir, "kubelet.sock.new");
    old_kubelet.stop_serving().await;
    let registration = kubelet.next_registration().await;
    assert_registration(&registration);
    let ended = timeout(WAIT, old_stream.message())
        .await
        .expect("the old ListAndWatch stream ends");
    assert!(matches!(ended, Ok(None) | Err(_)), "{ended:?}");
    let mut plugin = dial(&socket).await.unwrap();
    let (new_ids, _stream) = list_devices(&mut plugin).await;
    assert_eq!(new_ids, ids, "device IDs are stable");

    // SIGTERM: exit 0, socket removed.
    let pid = child.id().expect("the plugin is running") as libc::pid_t;
    // SAFETY: signalling our own child process, which has not been reaped yet.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = timeout(WAIT, child.wait())
        .await
        .expect("the plugin exits in time")
        .unwrap();
    assert!(status.success(), "{status}");
    assert!(!socket.exists(), "the plugin removed its socket");
    kubelet.stop().await;
}

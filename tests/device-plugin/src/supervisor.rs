//! Serving every resource's socket, registering it with the kubelet, and doing both again when
//! the kubelet restarts.
//!
//! Per resource, in a loop:
//! 1. Remove a stale file at our socket path, bind a fresh unix socket and serve
//!    `v1beta1.DevicePlugin` on it (one tonic server per socket, with its own stop signal).
//! 2. Register: call `Registration/Register` on `kubelet.sock`, retrying with a short backoff
//!    while `kubelet.sock` is missing or the call fails (the first failure is logged at warn,
//!    each retry at debug). The identity of `kubelet.sock` (device, inode and change time, so a
//!    reused inode number still counts as a new file) is read just before the successful
//!    attempt.
//! 3. Every `check_interval` (1 s), check that our socket file is still the one we bound and that
//!    `kubelet.sock` still has the identity we registered with. A starting kubelet removes every
//!    socket in its directory and creates a new `kubelet.sock`, so either check failing means the
//!    kubelet restarted (or is gone) and expects plugins to register again: stop this server,
//!    which also ends its `ListAndWatch` streams, and go back to 1.
//!
//! Stopping a server before registering again matters: when the kubelet sees a plugin's
//! `ListAndWatch` stream end, it disconnects whatever client is current for that resource, so an
//! old stream ending after a new registration would disconnect the new one.
//!
//! On shutdown every server stops and its socket file is removed (if it is still ours).

use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use futures::Stream;
use hyper_util::rt::TokioIo;
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint, Server, Uri};
use tracing::{Instrument, debug, info, warn};

use crate::plugin::FakeDevicePlugin;
use crate::resource::{ResourceSpec, check_unique};
use crate::v1beta1::RegisterRequest;
use crate::v1beta1::device_plugin_server::DevicePluginServer;
use crate::v1beta1::registration_client::RegistrationClient;
use crate::{API_VERSION, Error, KUBELET_SOCKET};

/// The longest path a unix socket address holds on Linux (`sun_path` is 108 bytes with the NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// How long a stopping server waits for its connections to close before it is dropped.
const STOP_GRACE: Duration = Duration::from_secs(2);
/// Bound on one `Register` call. The kubelet dials the plugin back within it, for up to 10 s.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(15);
/// Bound on connecting to a unix socket.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Registration (and bind) retry backoff: from the first to the longest delay, doubling.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// What to serve where.
#[derive(Debug, Clone)]
pub struct Config {
    /// The kubelet's device-plugin directory: it serves `kubelet.sock` there and we put our
    /// sockets there.
    pub dir: PathBuf,
    /// One per resource, distinct names.
    pub resources: Vec<ResourceSpec>,
    /// How often to check that our sockets and `kubelet.sock` are unchanged.
    pub check_interval: Duration,
}

impl Config {
    /// `resources` in `dir`, checked every second.
    pub fn new(dir: PathBuf, resources: Vec<ResourceSpec>) -> Self {
        Self {
            dir,
            resources,
            check_interval: Duration::from_secs(1),
        }
    }

    /// Distinct resources, socket paths that fit in a unix socket address.
    pub fn validate(&self) -> Result<(), Error> {
        check_unique(&self.resources)?;
        let names = self
            .resources
            .iter()
            .map(ResourceSpec::socket_file_name)
            .chain([KUBELET_SOCKET.to_owned()]);
        for name in names {
            let path = self.dir.join(name);
            let len = path.as_os_str().len();
            if len > MAX_SOCKET_PATH {
                return Err(Error::SocketPathTooLong { path, len });
            }
        }
        Ok(())
    }
}

/// Serves and registers every resource of `config` until `shutdown` completes, then stops
/// serving and removes the sockets.
pub async fn run(config: Config, shutdown: impl Future<Output = ()> + Send) -> Result<(), Error> {
    config.validate()?;
    let (stop, stopped) = watch::channel(false);
    let tasks: Vec<_> = config
        .resources
        .iter()
        .map(|spec| {
            let span = tracing::info_span!("resource", name = %spec.name);
            tokio::spawn(
                supervise(
                    config.dir.clone(),
                    spec.clone(),
                    config.check_interval,
                    stopped.clone(),
                )
                .instrument(span),
            )
        })
        .collect();
    shutdown.await;
    info!("shutting down");
    stop.send_replace(true);
    for task in tasks {
        if let Err(e) = task.await {
            warn!(error = %e, "a resource's task failed");
        }
    }
    Ok(())
}

/// The connections accepted on `listener`, as a stream for tonic's `serve_with_incoming*`.
pub fn unix_incoming(listener: UnixListener) -> impl Stream<Item = io::Result<UnixStream>> {
    futures::stream::unfold(listener, |listener| async move {
        let conn = listener.accept().await.map(|(stream, _)| stream);
        Some((conn, listener))
    })
}

/// A gRPC channel to the unix socket at `path` (the URI's authority is `localhost`, as the
/// kubelet uses).
pub async fn connect_unix(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_static("http://localhost")
        .connect_timeout(CONNECT_TIMEOUT)
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
}

/// Identity of a file: device, inode and change time. The change time tells a new file from a
/// removed one whose inode number the filesystem reused at once (tmpfs and ext4 do).
type FileId = (u64, u64, i64, i64);

fn id_of(m: &std::fs::Metadata) -> FileId {
    (m.dev(), m.ino(), m.ctime(), m.ctime_nsec())
}

fn file_id(path: &Path) -> Option<FileId> {
    std::fs::metadata(path).ok().map(|m| id_of(&m))
}

/// The identity of the unix socket at `path`, if there is one.
fn socket_id(path: &Path) -> Option<FileId> {
    std::fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.file_type().is_socket())
        .map(|m| id_of(&m))
}

/// One server on one freshly bound socket.
struct Served {
    path: PathBuf,
    id: FileId,
    stop: watch::Sender<bool>,
    task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Served {
    fn start(path: &Path, spec: &ResourceSpec) -> io::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        match std::fs::remove_file(path) {
            Ok(()) => debug!(socket = %path.display(), "removed a stale socket"),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let listener = UnixListener::bind(path)?;
        let id = socket_id(path).ok_or_else(|| {
            io::Error::other(format!("{} vanished right after bind", path.display()))
        })?;
        let (stop, stopped) = watch::channel(false);
        let plugin = FakeDevicePlugin::new(spec, stopped.clone());
        let mut signal = stopped;
        let task = tokio::spawn(
            Server::builder()
                .add_service(DevicePluginServer::new(plugin))
                .serve_with_incoming_shutdown(unix_incoming(listener), async move {
                    // An error means the sender is gone: stop too.
                    let _ = signal.wait_for(|stopped| *stopped).await;
                }),
        );
        Ok(Self {
            path: path.to_owned(),
            id,
            stop,
            task,
        })
    }

    /// Our socket file is still there and still the one we bound.
    fn is_current(&self) -> bool {
        socket_id(&self.path) == Some(self.id)
    }

    /// Stops serving: ends the `ListAndWatch` streams, stops accepting, and waits up to
    /// [`STOP_GRACE`] for the connections to close.
    async fn stop(&mut self) {
        self.stop.send_replace(true);
        match tokio::time::timeout(STOP_GRACE, &mut self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => warn!(error = %chain(&e), "the gRPC server failed"),
            Ok(Err(e)) => warn!(error = %e, "the gRPC server task failed"),
            Err(_) => {
                debug!("connections still open after the grace period; dropping the server");
                self.task.abort();
            }
        }
    }

    /// Removes the socket file if it is still ours.
    fn remove_socket(&self) {
        if !self.is_current() {
            return;
        }
        match std::fs::remove_file(&self.path) {
            Ok(()) => info!(socket = %self.path.display(), "removed our socket"),
            Err(e) => warn!(socket = %self.path.display(), error = %e, "cannot remove our socket"),
        }
    }
}

/// Why one socket's life ended.
enum Next {
    Shutdown,
    Restart(&'static str),
}

/// Outcome of registering.
enum Registration {
    /// Registered while `kubelet.sock` had this identity.
    Done(FileId),
    SocketGone,
    Shutdown,
}

struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Self(BACKOFF_FIRST)
    }

    fn next(&mut self) -> Duration {
        let delay = self.0;
        self.0 = (self.0 * 2).min(BACKOFF_MAX);
        delay
    }
}

/// Waits `delay`; `true` if shutdown came first.
async fn sleep_or_shutdown(delay: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => false,
        _ = shutdown.wait_for(|stopped| *stopped) => true,
    }
}

/// One resource, until shutdown.
async fn supervise(
    dir: PathBuf,
    spec: ResourceSpec,
    check_interval: Duration,
    mut shutdown: watch::Receiver<bool>,
) {
    let socket_name = spec.socket_file_name();
    let socket = dir.join(&socket_name);
    let kubelet = dir.join(KUBELET_SOCKET);
    let request = RegisterRequest {
        version: API_VERSION.into(),
        endpoint: socket_name,
        resource_name: spec.name.clone(),
        options: Some(FakeDevicePlugin::options()),
    };
    let mut bind_backoff = Backoff::new();
    loop {
        let mut served = match Served::start(&socket, &spec) {
            Ok(served) => served,
            Err(e) => {
                warn!(socket = %socket.display(), error = %e, "cannot serve the plugin socket; retrying");
                if sleep_or_shutdown(bind_backoff.next(), &mut shutdown).await {
                    return;
                }
                continue;
            }
        };
        bind_backoff = Backoff::new();
        info!(socket = %socket.display(), devices = spec.count, "serving");
        let next = match register(&kubelet, &request, &served, &mut shutdown).await {
            Registration::Done(kubelet_id) => {
                info!(kubelet = %kubelet.display(), "registered with the kubelet");
                watch(&kubelet, kubelet_id, &served, check_interval, &mut shutdown).await
            }
            Registration::SocketGone => Next::Restart("our socket file was removed"),
            Registration::Shutdown => Next::Shutdown,
        };
        served.stop().await;
        match next {
            Next::Shutdown => {
                served.remove_socket();
                return;
            }
            Next::Restart(why) => {
                info!(why, "re-creating our socket and registering again");
            }
        }
    }
}

/// Registers `request` with the kubelet, retrying until it succeeds, our socket goes away, or
/// shutdown.
async fn register(
    kubelet: &Path,
    request: &RegisterRequest,
    served: &Served,
    shutdown: &mut watch::Receiver<bool>,
) -> Registration {
    let mut backoff = Backoff::new();
    let mut failures = 0u32;
    loop {
        if !served.is_current() {
            return Registration::SocketGone;
        }
        let attempt = async {
            let id =
                file_id(kubelet).ok_or_else(|| format!("{} does not exist", kubelet.display()))?;
            register_once(kubelet, request.clone()).await?;
            Ok::<_, String>(id)
        };
        let result = tokio::select! {
            result = attempt => result,
            _ = shutdown.wait_for(|stopped| *stopped) => return Registration::Shutdown,
        };
        let error = match result {
            Ok(id) => return Registration::Done(id),
            Err(error) => error,
        };
        failures += 1;
        let delay = backoff.next();
        if failures == 1 {
            warn!(%error, "cannot register with the kubelet yet; retrying");
        } else {
            debug!(%error, attempt = failures, retry_in = ?delay, "registration failed; retrying");
        }
        if sleep_or_shutdown(delay, shutdown).await {
            return Registration::Shutdown;
        }
    }
}

async fn register_once(kubelet: &Path, request: RegisterRequest) -> Result<(), String> {
    let channel = connect_unix(kubelet.to_owned())
        .await
        .map_err(|e| format!("cannot connect to {}: {}", kubelet.display(), chain(&e)))?;
    let mut client = RegistrationClient::new(channel);
    tokio::time::timeout(REGISTER_TIMEOUT, client.register(request))
        .await
        .map_err(|_| format!("Register timed out after {REGISTER_TIMEOUT:?}"))?
        .map_err(|status| format!("Register failed: {:?}: {}", status.code(), status.message()))?;
    Ok(())
}

/// Watches our socket and `kubelet.sock` until one changes, the server stops, or shutdown.
async fn watch(
    kubelet: &Path,
    kubelet_id: FileId,
    served: &Served,
    check_interval: Duration,
    shutdown: &mut watch::Receiver<bool>,
) -> Next {
    let mut tick = tokio::time::interval(check_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = shutdown.wait_for(|stopped| *stopped) => return Next::Shutdown,
        }
        if !served.is_current() {
            return Next::Restart(
                "our socket file is gone or replaced (a starting kubelet removes plugin sockets)",
            );
        }
        if served.task.is_finished() {
            return Next::Restart("our gRPC server stopped");
        }
        match file_id(kubelet) {
            Some(id) if id == kubelet_id => {}
            Some(_) => return Next::Restart("kubelet.sock was re-created (the kubelet restarted)"),
            None => return Next::Restart("kubelet.sock is gone (the kubelet stopped)"),
        }
    }
}

/// An error with its sources, `: `-separated (tonic's transport errors say little on their own).
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

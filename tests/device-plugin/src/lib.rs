//! A test-only Kubernetes device plugin: advertises fake accelerators to a real kubelet through
//! the kubelet's device-plugin gRPC API (`v1beta1`), so that pods requesting e.g.
//! `nvidia.com/gpu` are admitted by the kubelet's device manager and see, in an environment
//! variable, which fake devices they got.
//!
//! For every `--resource NAME=COUNT:ENV` the plugin
//! - serves `v1beta1.DevicePlugin` on `<device-plugin dir>/hearth-<NAME with '/' as '_'>.sock`
//!   ([`ResourceSpec::socket_file_name`]);
//! - registers it with `v1beta1.Registration/Register` on `<device-plugin dir>/kubelet.sock`;
//! - lists COUNT devices, all `Healthy`, with the IDs of [`device_ids`];
//! - answers `Allocate` with `ENV=<requested IDs joined by ','>` for each container;
//! - re-creates its socket and registers again when the kubelet restarts (see [`supervisor`]).
//!
//! The protocol is our own wire-compatible description, `proto/v1beta1/deviceplugin.proto`,
//! compiled into [`v1beta1`].

pub mod plugin;
pub mod resource;
pub mod supervisor;

use std::path::PathBuf;

pub use plugin::FakeDevicePlugin;
pub use resource::{ResourceSpec, check_unique, device_ids};
pub use supervisor::{Config, connect_unix, run, unix_incoming};

/// Code generated from `proto/v1beta1/deviceplugin.proto`: the messages, the `Registration`
/// and `DevicePlugin` servers and clients.
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod v1beta1 {
    tonic::include_proto!("v1beta1");
}

/// The API version this plugin speaks, sent in `RegisterRequest.version`.
pub const API_VERSION: &str = "v1beta1";

/// The kubelet's registration socket, in the device-plugin directory.
pub const KUBELET_SOCKET: &str = "kubelet.sock";

/// The device health the kubelet counts as allocatable.
pub const HEALTHY: &str = "Healthy";

/// The library's errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A `--resource` value that does not parse.
    #[error(
        "invalid --resource {value:?}: {reason}; expected --resource NAME=COUNT:ENV, e.g. \
         --resource nvidia.com/gpu=2:NVIDIA_VISIBLE_DEVICES"
    )]
    InvalidResource {
        /// The value as given.
        value: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The same resource name in two `--resource` flags.
    #[error(
        "--resource {0} is given more than once; give each resource once, with its total count"
    )]
    DuplicateResource(String),
    /// A socket path that does not fit in a unix socket address.
    #[error(
        "socket path {} is {len} bytes, longer than the {max} bytes a unix socket path may have; \
         use a shorter --device-plugin-dir",
        path.display(),
        max = supervisor::MAX_SOCKET_PATH
    )]
    SocketPathTooLong {
        /// The socket path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
}

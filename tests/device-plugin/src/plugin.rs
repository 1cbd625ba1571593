//! The `v1beta1.DevicePlugin` service of one fake resource.

use std::collections::{HashMap, HashSet};
use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt, future, stream};
use tokio::sync::watch;
use tonic::{Request, Response, Status};

use crate::HEALTHY;
use crate::resource::ResourceSpec;
use crate::v1beta1::device_plugin_server::DevicePlugin;
use crate::v1beta1::{
    AllocateRequest, AllocateResponse, ContainerAllocateResponse, Device, DevicePluginOptions,
    Empty, ListAndWatchResponse, PreStartContainerRequest, PreStartContainerResponse,
    PreferredAllocationRequest, PreferredAllocationResponse,
};

/// Serves one resource's fake devices. Cheap to clone.
#[derive(Debug, Clone)]
pub struct FakeDevicePlugin {
    inner: Arc<Inner>,
    /// Becomes `true` when this server stops: ends the `ListAndWatch` streams.
    stop: watch::Receiver<bool>,
}

#[derive(Debug)]
struct Inner {
    resource: String,
    env: String,
    /// In order.
    devices: Vec<String>,
    known: HashSet<String>,
}

/// The stream `ListAndWatch` answers.
pub type ListAndWatchStream =
    Pin<Box<dyn Stream<Item = Result<ListAndWatchResponse, Status>> + Send + 'static>>;

impl FakeDevicePlugin {
    /// The plugin of `spec`; its `ListAndWatch` streams end when `stop` becomes `true` (or its
    /// sender is dropped).
    pub fn new(spec: &ResourceSpec, stop: watch::Receiver<bool>) -> Self {
        let devices = spec.device_ids();
        Self {
            inner: Arc::new(Inner {
                resource: spec.name.clone(),
                env: spec.env.clone(),
                known: devices.iter().cloned().collect(),
                devices,
            }),
            stop,
        }
    }

    /// The options this plugin registers with and answers: no pre-start, no preferred
    /// allocation.
    pub fn options() -> DevicePluginOptions {
        DevicePluginOptions {
            pre_start_required: false,
            get_preferred_allocation_available: false,
        }
    }

    /// Every device, healthy.
    pub fn devices(&self) -> Vec<Device> {
        self.inner
            .devices
            .iter()
            .map(|id| Device {
                id: id.clone(),
                health: HEALTHY.into(),
                topology: None,
            })
            .collect()
    }

    /// The `Allocate` answer: per container, `ENV=<its device IDs joined by ','>`; an unknown
    /// device ID is `InvalidArgument`.
    pub fn allocate_response(&self, req: &AllocateRequest) -> Result<AllocateResponse, Status> {
        let container_responses = req
            .container_requests
            .iter()
            .map(|container| {
                if let Some(unknown) = container
                    .device_ids
                    .iter()
                    .find(|id| !self.inner.known.contains(id.as_str()))
                {
                    return Err(Status::invalid_argument(format!(
                        "unknown device ID {unknown:?} for resource {}; this plugin has {}",
                        self.inner.resource,
                        self.inner.devices.join(",")
                    )));
                }
                Ok(ContainerAllocateResponse {
                    envs: HashMap::from([(self.inner.env.clone(), container.device_ids.join(","))]),
                    ..Default::default()
                })
            })
            .collect::<Result<Vec<_>, Status>>()?;
        Ok(AllocateResponse {
            container_responses,
        })
    }
}

#[tonic::async_trait]
impl DevicePlugin for FakeDevicePlugin {
    async fn get_device_plugin_options(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<DevicePluginOptions>, Status> {
        Ok(Response::new(Self::options()))
    }

    type ListAndWatchStream = ListAndWatchStream;

    async fn list_and_watch(
        &self,
        _: Request<Empty>,
    ) -> Result<Response<Self::ListAndWatchStream>, Status> {
        tracing::debug!(resource = %self.inner.resource, "ListAndWatch");
        let devices = ListAndWatchResponse {
            devices: self.devices(),
        };
        let mut stop = self.stop.clone();
        // The devices never change: send them once, then hold the stream open until this
        // server stops (the kubelet takes a closed stream for a plugin that went away).
        let hold = stream::once(async move {
            // An error means the sender is gone, which is a stop too.
            let _ = stop.wait_for(|stopped| *stopped).await;
        })
        .filter_map(|()| future::ready(None));
        Ok(Response::new(Box::pin(
            stream::once(future::ready(Ok(devices))).chain(hold),
        )))
    }

    async fn get_preferred_allocation(
        &self,
        _: Request<PreferredAllocationRequest>,
    ) -> Result<Response<PreferredAllocationResponse>, Status> {
        Ok(Response::new(PreferredAllocationResponse::default()))
    }

    async fn allocate(
        &self,
        req: Request<AllocateRequest>,
    ) -> Result<Response<AllocateResponse>, Status> {
        let answer = self.allocate_response(req.get_ref());
        match &answer {
            Ok(_) => tracing::info!(
                resource = %self.inner.resource,
                devices = ?req.get_ref().container_requests.iter().map(|c| &c.device_ids).collect::<Vec<_>>(),
                "allocated"
            ),
            Err(status) => tracing::warn!(
                resource = %self.inner.resource,
                error = %status.message(),
                "refused an allocation"
            ),
        }
        answer.map(Response::new)
    }

    async fn pre_start_container(
        &self,
        _: Request<PreStartContainerRequest>,
    ) -> Result<Response<PreStartContainerResponse>, Status> {
        Ok(Response::new(PreStartContainerResponse::default()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tonic::Code;

    use super::*;
    use crate::v1beta1::ContainerAllocateRequest;

    fn plugin() -> (FakeDevicePlugin, watch::Sender<bool>) {
        let (tx, rx) = watch::channel(false);
        let spec: ResourceSpec = "nvidia.com/gpu=3:NVIDIA_VISIBLE_DEVICES".parse().unwrap();
        (FakeDevicePlugin::new(&spec, rx), tx)
    }

    fn request(containers: &[&[&str]]) -> Request<AllocateRequest> {
        Request::new(AllocateRequest {
            container_requests: containers
                .iter()
                .map(|ids| ContainerAllocateRequest {
                    device_ids: ids.iter().map(|id| id.to_string()).collect(),
                })
                .collect(),
        })
    }

    #[tokio::test]
    async fn allocate_sets_the_env_per_container_in_request_order() {
        let (plugin, _stop) = plugin();
        let answer = plugin
            .allocate(request(&[&["gpu-2", "gpu-0"], &["gpu-1"]]))
            .await
            .unwrap()
            .into_inner();
        let envs: Vec<_> = answer
            .container_responses
            .iter()
            .map(|c| c.envs.clone())
            .collect();
        assert_eq!(
            envs,
            [
                HashMap::from([(
                    "NVIDIA_VISIBLE_DEVICES".to_string(),
                    "gpu-2,gpu-0".to_string()
                )]),
                HashMap::from([("NVIDIA_VISIBLE_DEVICES".to_string(), "gpu-1".to_string())]),
            ]
        );
        for c in &answer.container_responses {
            assert!(c.mounts.is_empty() && c.devices.is_empty() && c.annotations.is_empty());
            assert!(c.cdi_devices.is_empty());
        }
    }

    #[tokio::test]
    async fn allocate_refuses_an_unknown_device() {
        let (plugin, _stop) = plugin();
        let err = plugin
            .allocate(request(&[&["gpu-0"], &["gpu-1", "gpu-7"]]))
            .await
            .unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(err.message().contains("\"gpu-7\""), "{}", err.message());
        assert!(
            err.message().contains("nvidia.com/gpu"),
            "{}",
            err.message()
        );
    }

    #[tokio::test]
    async fn options_and_the_other_calls_are_empty() {
        let (plugin, _stop) = plugin();
        let options = plugin
            .get_device_plugin_options(Request::new(Empty {}))
            .await
            .unwrap()
            .into_inner();
        assert!(!options.pre_start_required && !options.get_preferred_allocation_available);
        let preferred = plugin
            .get_preferred_allocation(Request::new(PreferredAllocationRequest::default()))
            .await
            .unwrap()
            .into_inner();
        assert!(preferred.container_responses.is_empty());
        plugin
            .pre_start_container(Request::new(PreStartContainerRequest::default()))
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn list_and_watch_sends_all_devices_healthy_then_holds_until_stop() {
        let (plugin, stop) = plugin();
        let mut stream = plugin
            .list_and_watch(Request::new(Empty {}))
            .await
            .unwrap()
            .into_inner();
        let first = stream.next().await.unwrap().unwrap();
        let ids: Vec<_> = first.devices.iter().map(|d| d.id.as_str()).collect();
        assert_eq!(ids, ["gpu-0", "gpu-1", "gpu-2"]);
        assert!(first.devices.iter().all(|d| d.health == HEALTHY));
        assert!(
            tokio::time::timeout(Duration::from_millis(100), stream.next())
                .await
                .is_err(),
            "the stream stays open"
        );
        stop.send_replace(true);
        let end = tokio::time::timeout(Duration::from_secs(5), stream.next()).await;
        assert!(matches!(end, Ok(None)), "the stream ends on stop");
    }
}

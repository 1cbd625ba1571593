//! The local Hearth stack on tests/cluster, for the end-to-end suites and `make demo`: starts the
//! pod runner (the `hearth-pod-runner` binary of this crate) once per cluster, installs the CRDs
//! and the upstream stub runtime, runs `hearth-controller` as a local process, applies the
//! upstream stub service, and observes what happens: a streaming chat client that timestamps
//! heartbeats and tokens, and a timeline of the backend Deployment's replicas.

pub mod client;
pub mod stack;
pub mod timeline;

/// The image the suites give `hearth-controller run --gateway-image`; the runner maps it to
/// `target/debug/hearth-gateway` and kwok's stages skip it (tests/cluster/kwok/kwok.yaml).
pub const GATEWAY_IMAGE: &str = "hearth.dev/hearth-gateway:e2e";
/// The image of the upstream stub runtime; the runner maps it to `target/debug/vllm-stub`.
pub const STUB_IMAGE: &str = "hearth.dev/vllm-stub:e2e";

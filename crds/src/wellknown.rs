//! Label and annotation keys Hearth reads and writes: one home, so every component agrees.

/// Annotation (or label) on a Deployment, StatefulSet or Pod naming the `InferenceRuntime` the
/// admission webhook should apply: `serving.hearth.dev/runtime: vllm-nvidia-a10`.
pub const RUNTIME_ANNOTATION: &str = "serving.hearth.dev/runtime";

/// Annotation (or label) listing acceptable vendors in preference order, when no runtime is
/// named: `serving.hearth.dev/vendor: nvidia,ascend`.
pub const VENDOR_ANNOTATION: &str = "serving.hearth.dev/vendor";

/// Label on every child object naming the `LLMService` that owns it.
pub const LLMSERVICE_LABEL: &str = "serving.hearth.dev/llmservice";

/// Label on every child naming its role: `backend`, `gateway`, `cache`, `prewarm`.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";

/// The field manager Hearth's controller uses for server-side apply.
pub const FIELD_MANAGER: &str = "hearth-controller";

/// Pod annotation carrying the Volcano queue (`accelerator.scheduler.queue`).
pub const VOLCANO_QUEUE_ANNOTATION: &str = "scheduling.volcano.sh/queue-name";

/// Annotation on an `LLMService` choosing how KEDA reads the gateway's demand: `poll` (default:
/// a `metrics-api` trigger on `GET /hearth/queue`, summed over gateway endpoints) or `push`
/// (an `external-push` trigger to the gateway's KEDA ExternalScaler gRPC port).
pub const SCALER_ANNOTATION: &str = "serving.hearth.dev/scaler";

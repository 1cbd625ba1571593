//! Label and annotation keys Hearth reads and writes: one home, so every component agrees.

/// Annotation (or label) on a Deployment, StatefulSet or Pod naming the `InferenceRuntime` the
/// admission webhook should apply: `serving.hearth.dev/runtime: vllm-nvidia-a10`.
pub const RUNTIME_ANNOTATION: &str = "serving.hearth.dev/runtime";

/// Annotation (or label) listing acceptable vendors in preference order, when no runtime is
/// named: `serving.hearth.dev/vendor: nvidia,ascend`.
pub const VENDOR_ANNOTATION: &str = "serving.hearth.dev/vendor";

/// Label on every child object naming the `LLMService` that owns it, except the gateway
/// Deployment and its pods (as upstream Hearth: a selector on this label finds the model's pods
/// only); those carry [`GATEWAY_LABEL`].
pub const LLMSERVICE_LABEL: &str = "serving.hearth.dev/llmservice";

/// Label on the gateway Deployment, its pods and its Services naming the `LLMService` served.
pub const GATEWAY_LABEL: &str = "serving.hearth.dev/gateway";

/// Value of `app.kubernetes.io/managed-by` on every child (upstream Hearth's, which its
/// ServiceMonitor example selects on). The field manager is [`FIELD_MANAGER`].
pub const MANAGED_BY: &str = "hearth";

/// Label on every child naming its role: `backend`, `gateway`, `cache`, `prewarm`.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";

/// The field manager Hearth's controller uses for server-side apply.
pub const FIELD_MANAGER: &str = "hearth-controller";

/// The field manager of the gateway's one write, `status.lastWake` of its LLMService (server-side
/// apply); also the `reportingController` of its Events.
pub const GATEWAY_FIELD_MANAGER: &str = "hearth-gateway";

/// Pod annotation carrying the Volcano queue (`accelerator.scheduler.queue`).
pub const VOLCANO_QUEUE_ANNOTATION: &str = "scheduling.volcano.sh/queue-name";

/// Annotation on an `LLMService` choosing how KEDA reads the gateway's demand: `poll` (default:
/// a `metrics-api` trigger on `GET /hearth/queue`, summed over gateway endpoints) or `push`
/// (an `external-push` trigger to the gateway's KEDA ExternalScaler gRPC port).
pub const SCALER_ANNOTATION: &str = "serving.hearth.dev/scaler";

/// Annotation (or label) on an annotated plain workload bounding its preStop drain, as a Go
/// duration (`"90s"`, `"2m"`); [`DEFAULT_DRAIN_TIMEOUT`] when absent. An LLMService uses
/// `spec.scaling.drainTimeout` instead.
pub const DRAIN_TIMEOUT_ANNOTATION: &str = "serving.hearth.dev/drain-timeout";

/// The drain timeout of annotated plain workloads without [`DRAIN_TIMEOUT_ANNOTATION`]; the same
/// as the LLMService default.
pub const DEFAULT_DRAIN_TIMEOUT: &str = "2m";

/// Annotation on an LLMService's backend Deployment: the drain sidecar image the controller last
/// put into its pod template. An upgrade keeps a running backend's sidecar image only while it
/// is still this one, so someone else's edit of it is repaired, not kept.
pub const DRAIN_IMAGE_ANNOTATION: &str = "serving.hearth.dev/drain-image";

/// Annotation naming the model-serving container of an annotated workload, when the pod has
/// several containers.
pub const CONTAINER_ANNOTATION: &str = "serving.hearth.dev/container";

/// Annotation on an annotated plain workload: how many whole accelerators the model container
/// requests (default 1). An LLMService uses `spec.resources.accelerators` instead.
pub const ACCELERATORS_ANNOTATION: &str = "serving.hearth.dev/accelerators";

/// KEDA's annotation that pauses a ScaledObject at the target's current replica count
/// (`"true"`), until it is removed. The controller sets it while a `SharedPVC` backend at zero
/// waits for its prewarm Job.
pub const KEDA_PAUSED_ANNOTATION: &str = "autoscaling.keda.sh/paused";

/// Annotation on a ScaledObject the controller paused ([`KEDA_PAUSED_ANNOTATION`]) while its
/// `SharedPVC` backend waits for the prewarm Job the value names: the controller's caches keep
/// no managedFields, so this says the pause is the controller's to lift (a pause set by hand
/// has no such annotation and is left alone).
pub const PREWARM_WAIT_ANNOTATION: &str = "serving.hearth.dev/waiting-for-prewarm";

/// Annotation on a plain Deployment joining a shared `LLMEndpoint`: `<name>` (an endpoint of the
/// Deployment's namespace) or `<namespace>/<name>`. With it (and [`MODEL_ANNOTATION`]) the
/// endpoint's gateway routes the model to the Deployment's pods and KEDA scales the Deployment
/// on the gateway's demand, to zero when idle; removing it gives the Deployment back with the
/// replica count it had. Checked by `rules::check_deployment`.
pub const ENDPOINT_ANNOTATION: &str = "serving.hearth.dev/endpoint";

/// Annotation on a Deployment with [`ENDPOINT_ANNOTATION`]: the model name clients send in the
/// OpenAI `model` field. Required (no default): the gateway forwards the request body
/// unchanged, so it must be a name the engine serves (vLLM's `--served-model-name`), which the
/// Deployment's name is not in general.
pub const MODEL_ANNOTATION: &str = "serving.hearth.dev/model";

/// Annotation on a Deployment with [`ENDPOINT_ANNOTATION`]: the fewest replicas KEDA keeps,
/// a whole number, [`DEFAULT_MEMBER_MIN_REPLICAS`] (scale to zero) when absent.
pub const MIN_REPLICAS_ANNOTATION: &str = "serving.hearth.dev/min-replicas";

/// Annotation on a Deployment with [`ENDPOINT_ANNOTATION`]: the most replicas KEDA scales to,
/// a whole number of at least 1, [`DEFAULT_MEMBER_MAX_REPLICAS`] when absent.
pub const MAX_REPLICAS_ANNOTATION: &str = "serving.hearth.dev/max-replicas";

/// Annotation on a Deployment with [`ENDPOINT_ANNOTATION`]: the demand (requests held or in
/// flight) per replica KEDA scales for, a whole number of at least 1; an LLMService's default
/// `spec.scaling.target` (10) when absent.
pub const TARGET_ANNOTATION: &str = "serving.hearth.dev/target";

/// Annotation on a Deployment with [`ENDPOINT_ANNOTATION`]: how long the gateway holds a request
/// while the model starts, a positive duration (`"90s"`, `"10m"`); an LLMService's default
/// `spec.scaling.activationTimeout` (`5m`) when absent.
pub const ACTIVATION_TIMEOUT_ANNOTATION: &str = "serving.hearth.dev/activation-timeout";

/// Annotation on a Deployment with [`ENDPOINT_ANNOTATION`]: what a request that finds no ready
/// engine gets, `keepalive` (held, SSE heartbeats) or `reject` (`503` with `Retry-After`); an
/// LLMService's default `spec.endpoint.coldStart.mode` (`keepalive`) when absent.
pub const COLD_START_ANNOTATION: &str = "serving.hearth.dev/cold-start";

/// The replicas KEDA keeps at least of a Deployment joined to an endpoint without
/// [`MIN_REPLICAS_ANNOTATION`]: zero, as an LLMService's `spec.scaling.min`.
pub const DEFAULT_MEMBER_MIN_REPLICAS: i32 = 0;

/// The replicas KEDA scales a Deployment joined to an endpoint to at most, without
/// [`MAX_REPLICAS_ANNOTATION`]: one, as an LLMService's `spec.scaling.max`.
pub const DEFAULT_MEMBER_MAX_REPLICAS: i32 = 1;

/// Label on the objects the controller renders for a Deployment joined to an endpoint (its
/// Service `<name>-hearth`, Role, RoleBinding and ScaledObject), naming the Deployment.
pub const DEPLOYMENT_LABEL: &str = "serving.hearth.dev/deployment";

/// On a rendered backend Deployment (its metadata, not its pod template): what ServingPolicies
/// whose `spec.mutationActions` say `Warn` or `Audit` changed or, report-only, would change on
/// it, as a JSON list of their admission warnings (`ServingPolicy '<name>' would change the
/// object (report-only, not applied): add /spec/…`). Absent when none reports. Written by the
/// controller; a change of it to a list that is not empty is also an Event `PolicyReport` on the
/// LLMService.
pub const POLICY_REPORTS_ANNOTATION: &str = "serving.hearth.dev/policy-reports";

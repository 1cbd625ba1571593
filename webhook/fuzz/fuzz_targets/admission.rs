//! Fuzzes the in-process admission handler: any bytes on either endpoint must produce an
//! AdmissionReview or a ReviewError, never a panic, and an answer must echo the request uid.
#![no_main]

use std::sync::LazyLock;

use hearth_crds::InferenceRuntime;
use hearth_webhook::{Endpoint, Snapshot, handle};
use libfuzzer_sys::fuzz_target;

static SNAPSHOT: LazyLock<Snapshot> = LazyLock::new(|| {
    let runtimes = [
        include_str!("../../../../shared/examples/upstream/nvidia-a10-inferenceruntime.yaml"),
        include_str!("../../../../shared/examples/upstream/ascend-910b3-inferenceruntime.yaml"),
        include_str!("../../../../shared/examples/upstream/stub-inferenceruntime.yaml"),
    ]
    .map(|y| serde_yaml::from_str::<InferenceRuntime>(y).expect("example runtime parses"));
    // The built-ins, as the webhook serves them, so workloads run through the policy engine.
    let policies = hearth_webhook::builtin::policies().expect("built-ins parse");
    Snapshot::offline(runtimes, &policies)
});

#[derive(serde::Deserialize)]
struct Sent {
    request: SentRequest,
}

#[derive(serde::Deserialize)]
struct SentRequest {
    uid: String,
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    let endpoint = if selector & 1 == 0 {
        Endpoint::Validate
    } else {
        Endpoint::Mutate
    };
    if let Ok(answer) = handle(endpoint, body, &SNAPSHOT) {
        let out = serde_json::to_vec(&answer.review).expect("answers serialize");
        let resp = answer.review.response.expect("an answer has a response");
        // The uid is echoed, and patchType appears only with a non-empty patch. The uid is read
        // as leniently as the handler reads the body (unknown fields skipped unchecked).
        let sent: Sent = serde_json::from_slice(body).expect("accepted bodies have a request uid");
        assert_eq!(sent.request.uid, resp.uid);
        let v: serde_json::Value = serde_json::from_slice(&out).expect("answers are JSON");
        let r = &v["response"];
        assert_eq!(r.get("patchType").is_some(), r.get("patch").is_some_and(|p| !p.is_null()));
        assert_eq!(v["apiVersion"], "admission.k8s.io/v1");
        assert_eq!(v["kind"], "AdmissionReview");
    }
});

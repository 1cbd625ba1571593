#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use rstest::rstest;

fn adapter(yaml: &str) -> LLMAdapter {
    serde_yaml::from_str(yaml).unwrap()
}

fn sql() -> LLMAdapter {
    adapter(
        r#"
apiVersion: serving.hearth.dev/v1alpha1
kind: LLMAdapter
metadata: {name: sql, namespace: team-a}
spec:
  serviceRef: {name: qwen}
  source: {uri: hf://acme/qwen-sql-lora}
  rank: 16
"#,
    )
}

fn base(allowed: &str) -> LLMService {
    serde_yaml::from_str(&format!(
        r#"
apiVersion: serving.hearth.dev/v1alpha1
kind: LLMService
metadata: {{name: qwen, namespace: team-a}}
spec:
  model: {{source: {{uri: hf://Qwen/Qwen2.5-0.5B-Instruct}}}}
  {allowed}
"#
    ))
    .unwrap()
}

fn runtime(adapters: &str) -> InferenceRuntime {
    serde_yaml::from_str(&format!(
        r#"
apiVersion: serving.hearth.dev/v1alpha1
kind: InferenceRuntime
metadata: {{name: vllm-nvidia}}
spec:
  vendor: nvidia
  container: {{image: vllm/vllm-openai:v0.11.0}}
  accelerator: {{resourceName: nvidia.com/gpu}}
  {adapters}
"#
    ))
    .unwrap()
}

fn lora_runtime() -> InferenceRuntime {
    runtime("adapters: {maxRank: 64, maxAdapters: 2}")
}

/// The errors' `(reason, field)`, and the warnings' reasons.
fn summary(f: &Findings) -> (Vec<(&'static str, String)>, Vec<&'static str>) {
    (
        f.errors()
            .map(|e| (e.reason.as_str(), e.field.clone()))
            .collect(),
        f.warnings().map(|w| w.reason.as_str()).collect(),
    )
}

#[test]
fn an_adapter_within_its_runtime_limits_on_its_base_is_accepted() {
    let (svc, rt) = (base(""), lora_runtime());
    let taken = taken_names(&svc, [], &[]);
    let f = check_llmadapter(
        &sql(),
        &AdapterContext {
            service: Some(&svc),
            runtime: Some(&rt),
            taken: Some(&taken),
            ..Default::default()
        },
    );
    assert!(f.is_empty(), "{f}");
}

#[test]
fn the_runtime_declares_its_adapter_defaults() {
    let rt = runtime("adapters: {}");
    let a = rt.spec.adapters.unwrap();
    assert_eq!(
        (a.max_rank, a.max_loaded, a.max_adapters),
        (16, 8, 100),
        "vLLM's --max-lora-rank default, and Hearth's"
    );
    assert_eq!(
        (a.load_path.as_str(), a.unload_path.as_str()),
        ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
    );
}

#[rstest]
#[case::bad_source(
    "spec: {serviceRef: {name: qwen}, source: {uri: 'http://x/y'}}",
    "InvalidModelSource",
    "spec.source.uri"
)]
#[case::bad_served_name(
    "spec: {serviceRef: {name: qwen}, source: {uri: 'hf://a/b'}, servedName: '-x'}",
    "InvalidSpec",
    "spec.servedName"
)]
#[case::bad_service_name(
    "spec: {serviceRef: {name: Qwen}, source: {uri: 'hf://a/b'}}",
    "InvalidSpec",
    "spec.serviceRef.name"
)]
#[case::bad_rank(
    "spec: {serviceRef: {name: qwen}, source: {uri: 'hf://a/b'}, rank: 0}",
    "InvalidSpec",
    "spec.rank"
)]
#[case::bad_secret(
    "spec: {serviceRef: {name: qwen}, source: {uri: 'hf://a/b', secretRef: {name: 'A_B'}}}",
    "InvalidSpec",
    "spec.source.secretRef.name"
)]
fn an_adapter_alone_is_checked_field_by_field(
    #[case] spec: &str,
    #[case] reason: &str,
    #[case] field: &str,
) {
    let a = adapter(&format!(
        "apiVersion: serving.hearth.dev/v1alpha1\nkind: LLMAdapter\nmetadata: {{name: sql, namespace: team-a}}\n{spec}"
    ));
    let f = check_llmadapter(&a, &AdapterContext::default());
    assert_eq!(
        summary(&f),
        (
            vec![(reason_static(reason), field.to_owned())],
            vec!["ServiceNotFound"]
        ),
        "{f}"
    );
}

fn reason_static(s: &str) -> &'static str {
    [
        "InvalidModelSource",
        "InvalidSpec",
        "ServiceNotFound",
        "NotAllowedByService",
        "AdaptersNotSupported",
        "RankTooHigh",
        "TooManyAdapters",
        "ModelNameConflict",
    ]
    .into_iter()
    .find(|r| *r == s)
    .unwrap()
}

#[test]
fn a_missing_base_is_a_warning_so_either_can_be_applied_first() {
    let f = check_llmadapter(&sql(), &AdapterContext::default());
    assert!(!f.blocks_rendering());
    let w = f.warnings().next().unwrap();
    assert_eq!(w.reason, Reason::ServiceNotFound);
    assert_eq!(w.reason.condition_type(), "Accepted");
    assert!(w.message.contains("team-a/qwen"), "{}", w.message);
}

#[test]
fn a_base_in_another_namespace_admits_adapters_only_as_it_says() {
    let mut a = sql();
    a.metadata.namespace = Some("team-b".into());
    a.spec.service_ref.namespace = Some("team-a".into());
    let rt = lora_runtime();
    let labels = BTreeMap::from([("hearth.dev/adapters".to_owned(), "qwen".to_owned())]);
    let check = |svc: &LLMService, labels: Option<&BTreeMap<String, String>>| {
        check_llmadapter(
            &a,
            &AdapterContext {
                service: Some(svc),
                runtime: Some(&rt),
                namespace_labels: labels,
                ..Default::default()
            },
        )
    };
    // Same (the default): refused, naming the fix.
    let f = check(&base(""), Some(&labels));
    let e = f.first_error().unwrap();
    assert_eq!(
        (e.reason, e.field.as_str()),
        (Reason::NotAllowedByService, "spec.serviceRef")
    );
    assert!(e.message.contains("from: All"), "{}", e.message);
    // All.
    let all = base("allowedAdapters: {namespaces: {from: All}}");
    assert!(check(&all, None).is_empty());
    // Selector: by the namespace's labels.
    let sel = base(
        "allowedAdapters: {namespaces: {from: Selector, selector: {matchLabels: {hearth.dev/adapters: qwen}}}}",
    );
    assert!(check(&sel, Some(&labels)).is_empty());
    let f = check(&sel, Some(&BTreeMap::new()));
    assert_eq!(f.first_error().unwrap().reason, Reason::NotAllowedByService);
    assert!(f.to_string().contains("label the namespace"), "{f}");
    // An unknown namespace matches no selector.
    assert_eq!(
        check(&sel, None).first_error().unwrap().reason,
        Reason::NotAllowedByService
    );
}

#[test]
fn the_runtime_must_serve_adapters_and_bounds_their_rank_and_count() {
    let svc = base("");
    let plain = runtime("");
    let ctx = |rt, older_siblings| AdapterContext {
        service: Some(&svc),
        runtime: Some(rt),
        older_siblings,
        ..Default::default()
    };
    let f = check_llmadapter(&sql(), &ctx(&plain, 0));
    assert_eq!(
        f.first_error().unwrap().reason,
        Reason::AdaptersNotSupported
    );
    assert!(f.to_string().contains("vllm-nvidia"), "{f}");

    let low = runtime("adapters: {maxRank: 8}");
    let f = check_llmadapter(&sql(), &ctx(&low, 0));
    let e = f.first_error().unwrap();
    assert_eq!(
        (e.reason, e.field.as_str()),
        (Reason::RankTooHigh, "spec.rank")
    );
    assert!(e.message.contains("16 is above 8"), "{}", e.message);
    // An adapter without a declared rank is left to the engine.
    let mut unranked = sql();
    unranked.spec.rank = None;
    assert!(check_llmadapter(&unranked, &ctx(&low, 0)).is_empty());

    // maxAdapters 2: a third is refused.
    let rt = lora_runtime();
    assert!(check_llmadapter(&sql(), &ctx(&rt, 1)).is_empty());
    let f = check_llmadapter(&sql(), &ctx(&rt, 2));
    let e = f.first_error().unwrap();
    assert_eq!(e.reason, Reason::TooManyAdapters);
    assert!(e.message.contains("maxAdapters: 2"), "{}", e.message);
}

#[test]
fn a_model_name_taken_on_the_same_gateway_is_refused() {
    let svc = base("");
    let rt = lora_runtime();
    let mut other = sql();
    other.metadata.name = Some("sql-v1".into());
    other.spec.served_name = Some("sql".into());
    let endpoint = [crate::llmendpoint::EndpointModel {
        name: "llama".into(),
        namespace: "team-c".into(),
        service: "llama".into(),
        kind: None,
    }];
    let taken = taken_names(&svc, [&other], &endpoint);
    assert_eq!(
        taken.keys().map(String::as_str).collect::<Vec<_>>(),
        ["llama", "qwen", "sql"]
    );
    let ctx = AdapterContext {
        service: Some(&svc),
        runtime: Some(&rt),
        taken: Some(&taken),
        ..Default::default()
    };
    // By its default name (metadata.name).
    let f = check_llmadapter(&sql(), &ctx);
    let e = f.first_error().unwrap();
    assert_eq!(
        (e.reason, e.field.as_str()),
        (Reason::ModelNameConflict, "metadata.name")
    );
    assert!(
        e.message.contains("LLMAdapter team-a/sql-v1"),
        "{}",
        e.message
    );
    // By its servedName: the base's own name, a model of the shared endpoint.
    for (name, by) in [
        ("qwen", "LLMService team-a/qwen"),
        ("llama", "LLMService team-c/llama (on the same LLMEndpoint)"),
    ] {
        let mut a = sql();
        a.spec.served_name = Some(name.into());
        let f = check_llmadapter(&a, &ctx);
        let e = f.first_error().unwrap();
        assert_eq!(e.field, "spec.servedName");
        assert!(e.message.contains(by), "{}", e.message);
    }
}

#[rstest]
#[case("sql", true)]
#[case("acme/qwen-sql:v2", true)]
#[case("ft:qwen:acme:sql_1", true)]
#[case("", false)]
#[case("-sql", false)]
#[case("sql/", false)]
#[case("sql lora", false)]
fn served_names_follow_the_crd_pattern(#[case] name: &str, #[case] ok: bool) {
    assert_eq!(is_served_name(name), ok);
    let pattern = crd_pattern_matches(name) && name.len() <= MAX_SERVED_NAME_LEN;
    assert_eq!(
        pattern, ok,
        "the CRD's pattern and the rule agree on {name:?}"
    );
}

/// The CRD's `servedName` pattern, read from the generated schema, applied to `name`.
fn crd_pattern_matches(name: &str) -> bool {
    use kube::CustomResourceExt;
    let crd = serde_json::to_value(LLMAdapter::crd()).unwrap();
    let field = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["servedName"];
    assert_eq!(
        field["maxLength"].as_u64(),
        Some(MAX_SERVED_NAME_LEN as u64)
    );
    regex::Regex::new(field["pattern"].as_str().unwrap())
        .unwrap()
        .is_match(name)
}

#[test]
fn older_adapters_come_first() {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    let mut old = sql();
    old.metadata.creation_timestamp = Some(Time("2026-01-01T00:00:00Z".parse().unwrap()));
    let mut new = sql();
    new.metadata.name = Some("a-newer".into());
    new.metadata.creation_timestamp = Some(Time("2026-02-01T00:00:00Z".parse().unwrap()));
    let pending = sql();
    assert!(comes_before(&old, &new));
    assert!(!comes_before(&new, &old));
    assert!(comes_before(&new, &pending), "not created yet: last");
}

fn at(mut a: LLMAdapter, name: &str, ts: &str) -> LLMAdapter {
    a.metadata.name = Some(name.into());
    a.metadata.creation_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
        ts.parse().unwrap(),
    ));
    a
}

#[test]
fn only_accepted_adapters_take_a_place_and_a_name() {
    // maxAdapters 2. Oldest first: another namespace's (not admitted: Same), one of rank 128
    // (above maxRank 64), then `sql`, `chat`, and `extra`.
    let svc = base("");
    let rt = lora_runtime();
    let mut foreign = at(sql(), "foreign", "2026-01-01T00:00:00Z");
    foreign.metadata.namespace = Some("team-b".into());
    foreign.spec.service_ref.namespace = Some("team-a".into());
    foreign.spec.served_name = Some("chat".into());
    let mut big = at(sql(), "big", "2026-01-02T00:00:00Z");
    big.spec.rank = Some(128);
    big.spec.served_name = Some("sql".into());
    let sql = at(sql(), "sql", "2026-01-03T00:00:00Z");
    let chat = at(sql.clone(), "chat", "2026-01-04T00:00:00Z");
    let extra = at(sql.clone(), "extra", "2026-01-05T00:00:00Z");
    let all = [&extra, &chat, &sql, &big, &foreign];
    let decided = check_base_adapters(Some(&svc), Some(&rt), all, &[], &[], &|_| None);
    let reasons: Vec<(&str, Option<&str>)> = decided
        .iter()
        .map(|(a, f)| {
            (
                a.metadata.name.as_deref().unwrap(),
                f.first_error().map(|e| e.reason.as_str()),
            )
        })
        .collect();
    assert_eq!(
        reasons,
        [
            ("foreign", Some("NotAllowedByService")),
            ("big", Some("RankTooHigh")),
            // The refused ones took neither a place nor their names.
            ("sql", None),
            ("chat", None),
            ("extra", Some("TooManyAdapters")),
        ]
    );
    // One adapter among them gets the same verdict.
    let f = check_llmadapter_among(
        &chat,
        Some(&svc),
        Some(&rt),
        all,
        &[],
        &|_, _| None,
        &|_| None,
    );
    assert!(f.is_empty(), "{f}");
    let f = check_llmadapter_among(
        &extra,
        Some(&svc),
        Some(&rt),
        all,
        &[],
        &|_, _| None,
        &|_| None,
    );
    assert_eq!(f.first_error().unwrap().reason, Reason::TooManyAdapters);
}

#[test]
fn a_new_adapter_is_judged_the_youngest() {
    // An existing adapter `zeta` and a new `alpha` (no creationTimestamp, as the webhook
    // reviews a CREATE) with the same served name: `alpha` is refused, whatever the names.
    let svc = base("");
    let rt = lora_runtime();
    let zeta = at(sql(), "zeta", "2026-01-01T00:00:00Z");
    let mut alpha = sql();
    alpha.metadata.name = Some("alpha".into());
    alpha.spec.served_name = Some("zeta".into());
    let f = check_llmadapter_among(
        &alpha,
        Some(&svc),
        Some(&rt),
        [&zeta],
        &[],
        &|_, _| None,
        &|_| None,
    );
    assert_eq!(f.first_error().unwrap().reason, Reason::ModelNameConflict);
    let f = check_llmadapter_among(
        &zeta,
        Some(&svc),
        Some(&rt),
        [&alpha],
        &[],
        &|_, _| None,
        &|_| None,
    );
    assert!(f.is_empty(), "{f}");
}

#[rstest]
#[case::hub_on_a_cached_hub_model("hf://acme/qwen-sql-lora", "", None)]
#[case::modelscope_on_a_shared_cache(
    "modelscope://acme/sql-lora",
    "cache: {strategy: SharedPVC, prewarm: true}",
    None
)]
#[case::hub_on_a_host_path_cache("hf://acme/qwen-sql-lora", "cache: {strategy: HostPath}", None)]
#[case::hub_without_a_cache(
    "hf://acme/qwen-sql-lora",
    "cache: {strategy: None}",
    Some("its spec.cache.strategy is None")
)]
#[case::hub_on_a_staged_model(
    "hf://acme/qwen-sql-lora",
    "model: {source: {uri: 'pvc://weights/qwen'}}",
    Some("its model is pvc://weights/qwen")
)]
#[case::claim_on_any_base("pvc://adapters/sql", "cache: {strategy: None}", None)]
fn a_hub_adapter_needs_its_bases_model_cache(
    #[case] uri: &str,
    #[case] base_spec: &str,
    #[case] refused: Option<&str>,
) {
    let mut a = sql();
    a.spec.source.uri = uri.into();
    let mut svc = base("");
    let patch: serde_yaml::Value = serde_yaml::from_str(&format!("{{{base_spec}}}")).unwrap();
    let mut spec = serde_yaml::to_value(&svc.spec).unwrap();
    if let (serde_yaml::Value::Mapping(s), serde_yaml::Value::Mapping(p)) = (&mut spec, patch) {
        for (k, v) in p {
            s.insert(k, v);
        }
    }
    svc.spec = serde_yaml::from_value(spec).unwrap();
    let rt = lora_runtime();
    let f = check_llmadapter(
        &a,
        &AdapterContext {
            service: Some(&svc),
            runtime: Some(&rt),
            ..Default::default()
        },
    );
    match refused {
        None => assert!(f.is_empty(), "{f}"),
        Some(why) => {
            let e = f.first_error().unwrap();
            assert_eq!(
                (e.reason, e.field.as_str(), e.reason.condition_type()),
                (Reason::NoModelCache, "spec.source.uri", "Accepted")
            );
            assert!(e.message.contains(why), "{}", e.message);
            assert!(e.message.contains("pvc://<claim>/<dir>"), "{}", e.message);
        }
    }
}

#[test]
fn a_claim_adapter_must_be_in_its_bases_namespace() {
    let mut a = sql();
    a.spec.source.uri = "pvc://team-a-secrets/sql".into();
    a.metadata.namespace = Some("team-b".into());
    a.spec.service_ref.namespace = Some("team-a".into());
    let svc = base("allowedAdapters: {namespaces: {from: All}}");
    let rt = lora_runtime();
    let ctx = AdapterContext {
        service: Some(&svc),
        runtime: Some(&rt),
        ..Default::default()
    };
    let f = check_llmadapter(&a, &ctx);
    let e = f.first_error().unwrap();
    assert_eq!(
        (e.reason, e.field.as_str()),
        (Reason::SourceNotInNamespace, "spec.source.uri")
    );
    assert!(
        e.message.contains("\"team-a-secrets\"")
            && e.message.contains("namespace team-a, not team-b"),
        "{}",
        e.message
    );
    // The same adapter from the base's namespace is accepted; a hub one from team-b too.
    a.metadata.namespace = Some("team-a".into());
    assert!(check_llmadapter(&a, &ctx).is_empty());
    a.metadata.namespace = Some("team-b".into());
    a.spec.source.uri = "hf://acme/qwen-sql-lora".into();
    assert!(check_llmadapter(&a, &ctx).is_empty());
    // With a Secret, only from the base's namespace.
    a.spec.source.secret_ref = Some(k8s_openapi::api::core::v1::LocalObjectReference {
        name: "hub-token".into(),
    });
    let e = check_llmadapter(&a, &ctx);
    let e = e.first_error().unwrap();
    assert_eq!(
        (e.reason, e.field.as_str()),
        (Reason::SourceNotInNamespace, "spec.source.secretRef")
    );
    a.metadata.namespace = Some("team-a".into());
    assert!(check_llmadapter(&a, &ctx).is_empty());
}

/// Two bases on one endpoint: an adapter name is kept by the older of two adapters of
/// different bases; a rival refused on its own base takes no name.
#[test]
fn an_adapter_name_on_an_endpoint_goes_to_the_older_adapter_of_any_base() {
    let svc = base("");
    let rt = lora_runtime();
    let mut llama = base("");
    llama.metadata.name = Some("llama".into());
    let models = [
        EndpointModel {
            name: "qwen".into(),
            namespace: "team-a".into(),
            service: "qwen".into(),
            kind: None,
        },
        EndpointModel {
            name: "llama".into(),
            namespace: "team-a".into(),
            service: "llama".into(),
            kind: None,
        },
    ];
    let on_llama = |name: &str, ts: &str| {
        let mut a = at(sql(), name, ts);
        a.spec.service_ref.name = "llama".into();
        a.spec.served_name = Some("docs".into());
        a
    };
    let mut ours = at(sql(), "docs", "2026-12-02T00:00:00Z");
    ours.spec.served_name = Some("docs".into());
    let lookup = |ns: &str, name: &str| {
        (ns == "team-a" && name == "llama").then(|| (llama.clone(), Some(rt.clone())))
    };
    let check = |others: &[&LLMAdapter]| {
        check_llmadapter_among(
            &ours,
            Some(&svc),
            Some(&rt),
            others.iter().copied(),
            &models,
            &lookup,
            &|_| None,
        )
    };
    // Older on llama: refused, naming it.
    let older = on_llama("llama-docs", "2026-12-01T00:00:00Z");
    let f = check(&[&older]);
    let e = f.first_error().unwrap();
    assert_eq!(
        (e.reason, e.field.as_str()),
        (Reason::ModelNameConflict, "spec.servedName")
    );
    assert!(
        e.message.contains(
            "LLMAdapter team-a/llama-docs of LLMService team-a/llama (on the same LLMEndpoint)"
        ),
        "{}",
        e.message
    );
    // Younger on llama: ours keeps it.
    let younger = on_llama("llama-docs", "2026-12-03T00:00:00Z");
    assert!(check(&[&younger]).is_empty(), "{}", check(&[&younger]));
    // Older, but refused on its base (rank above the runtime's): no name taken.
    let mut refused = on_llama("llama-docs", "2026-12-01T00:00:00Z");
    refused.spec.rank = Some(128);
    assert!(check(&[&refused]).is_empty());
    // Without the endpoint, no rival.
    let f = check_llmadapter_among(
        &ours,
        Some(&svc),
        Some(&rt),
        [&older],
        &[],
        &lookup,
        &|_| None,
    );
    assert!(f.is_empty(), "{f}");
}

/// One pass over every base of an endpoint: a place freed on one base by a name refused there
/// goes to that base's next adapter, whose name then is taken for the other bases too.
#[test]
fn every_base_of_an_endpoint_is_decided_in_one_pass() {
    let one = runtime("adapters: {maxAdapters: 1}");
    let named = |svc: &str| {
        let mut b = base("");
        b.metadata.name = Some(svc.into());
        b
    };
    let (x, y, z) = (named("x"), named("y"), named("z"));
    let models: Vec<EndpointModel> = ["x", "y", "z"]
        .iter()
        .map(|n| EndpointModel {
            name: (*n).into(),
            namespace: "team-a".into(),
            service: (*n).into(),
            kind: None,
        })
        .collect();
    let on = |svc: &str, name: &str, served: &str, ts: &str| {
        let mut a = at(sql(), name, ts);
        a.spec.service_ref.name = svc.into();
        a.spec.served_name = Some(served.into());
        a.spec.rank = None;
        a
    };
    let a = on("x", "a", "docs", "2026-12-01T00:00:01Z");
    let b1 = on("y", "b1", "docs", "2026-12-01T00:00:02Z");
    let b2 = on("y", "b2", "chat", "2026-12-01T00:00:03Z");
    let c = on("z", "c", "chat", "2026-12-01T00:00:04Z");
    fn other<'a>(
        svc: &LLMService,
        rt: &InferenceRuntime,
        adapters: Vec<&'a LLMAdapter>,
    ) -> OtherBase<'a> {
        OtherBase {
            service: svc.clone(),
            runtime: Some(rt.clone()),
            adapters,
        }
    }
    // Y: b1 refused (a keeps "docs"), so b2 takes Y's one place and "chat".
    let y_decided = check_base_adapters(
        Some(&y),
        Some(&one),
        [&b1, &b2],
        &models,
        &[other(&x, &one, vec![&a]), other(&z, &one, vec![&c])],
        &|_| None,
    );
    let reasons: Vec<Option<Reason>> = y_decided
        .iter()
        .map(|(_, f)| f.first_error().map(|e| e.reason))
        .collect();
    assert_eq!(reasons, [Some(Reason::ModelNameConflict), None]);
    // Z sees the same: c's "chat" is b2's.
    let z_decided = check_base_adapters(
        Some(&z),
        Some(&one),
        [&c],
        &models,
        &[other(&x, &one, vec![&a]), other(&y, &one, vec![&b1, &b2])],
        &|_| None,
    );
    let e = z_decided[0].1.first_error().unwrap();
    assert_eq!(e.reason, Reason::ModelNameConflict);
    assert!(
        e.message
            .contains("LLMAdapter team-a/b2 of LLMService team-a/y"),
        "{}",
        e.message
    );
    // A base without a runtime accepts nothing, so takes no name.
    let z_decided = check_base_adapters(
        Some(&z),
        Some(&one),
        [&c],
        &models,
        &[OtherBase {
            runtime: None,
            ..other(&y, &one, vec![&b1, &b2])
        }],
        &|_| None,
    );
    assert!(z_decided[0].1.is_empty(), "{}", z_decided[0].1);
}

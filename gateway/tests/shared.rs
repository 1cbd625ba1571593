//! A shared gateway (one replica, several models routed by the request's `model`) against real
//! in-process stubs: routing, the gateway's own `404`/`400`, per-model queues and cold starts,
//! `/v1/models`, KEDA per service (poll and push), peers, and a model leaving mid-stream.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{shared::*, *};
use hearth_crds::llmendpoint::{ModelRoute, RouteTable};
use hearth_gateway::{GatewayConfig, apikeys::ApiKeys, peers::PeerSet};
use http_body_util::Full;
use hyper::{Request, StatusCode};
use tonic::Code;

fn backends(pairs: &[(&str, &vllm_stub::RunningStub)]) -> Backends {
    pairs
        .iter()
        .map(|(svc, stub)| ((*svc).to_owned(), vec![authority(stub)]))
        .collect()
}

async fn body_json(c: &HttpClient, req: Request<Full<Bytes>>) -> (StatusCode, serde_json::Value) {
    let (status, _, body) = send_full(c, req).await;
    (
        status,
        serde_json::from_slice(&body).unwrap_or(serde_json::Value::Null),
    )
}

#[tokio::test]
async fn each_model_goes_to_its_own_backend_with_its_bytes_unchanged() {
    let (a, b) = (stub_named("a").await, stub_named("b").await);
    let gw = shared_gateway(
        config(),
        vec![route("a"), route("b")],
        backends(&[("a", &a), ("b", &b)]),
    )
    .await;
    let c = client();
    for (model, hits, misses) in [("a", &a, &b), ("b", &b, &a)] {
        let (before, other) = (hits.state.received(), misses.state.received());
        let (status, v) = body_json(&c, chat_req(&gw.url(), &chat_for(model, false))).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(hits.state.received(), before + 1, "{model}'s backend");
        assert_eq!(misses.state.received(), other, "not the other one");
    }
    // A stream, through the model's backend.
    let resp = send(&c, chat_req(&gw.url(), &chat_for("b", true))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = http_body_util::BodyExt::collect(resp.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert!(sse_events(&body).last().unwrap().contains("[DONE]"));
    // The body reaches the backend byte for byte (the stub echoes it).
    let raw = "{\"model\" : \"a\",\n  \"x\": [1,2 ,3], \"stream\":false}";
    let req = Request::post(format!("{}/stub/echo", gw.url()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(raw)))
        .unwrap();
    let (status, v) = body_json(&c, req).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["body"], raw);
}

#[tokio::test]
async fn an_unknown_or_missing_model_is_answered_at_once_and_raises_no_demand() {
    let gw = shared_gateway(config(), vec![route("a"), route("b")], Backends::new()).await;
    let c = client();
    let t = Instant::now();
    let (status, v) = body_json(&c, chat_req(&gw.url(), &chat_for("x", false))).await;
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(
        v,
        serde_json::json!({"error": {
            "message": "The model `x` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }})
    );
    for req in [
        post_req(
            &format!("{}/v1/chat/completions", gw.url()),
            &serde_json::json!({"messages": []}),
            &[],
        ),
        Request::post(format!("{}/v1/completions", gw.url()))
            .header("content-type", "text/plain")
            .body(Full::new(Bytes::from("{\"model\":\"a\"}")))
            .unwrap(),
        Request::get(format!("{}/v1/files", gw.url()))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    ] {
        let (status, v) = body_json(&c, req).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
        assert_eq!(v["error"]["param"], "model");
        assert_eq!(v["error"]["code"], "model_required");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains("`model`") && msg.contains("routes"), "{msg}");
    }
    for m in gw.gateway.models() {
        assert_eq!(m.demand().state().local(), 0, "{}", m.key());
    }
    assert_eq!(gw.gateway.demand().state().pending(), 0);
    let text = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(
            &text,
            r#"hearth_gateway_rejections_total{reason="unknown_model"}"#
        ),
        Some(1.0),
        "counted without a service: {text}"
    );
    assert_eq!(
        metric(
            &text,
            r#"hearth_gateway_rejections_total{reason="model_required"}"#
        ),
        Some(3.0)
    );
}

#[tokio::test]
async fn a_flood_to_one_cold_model_gets_429s_while_other_models_are_served() {
    let a = stub_named("a").await;
    let later = stub_named("later").await;
    let stuck = ModelRoute {
        max_queue: 5,
        ..route("stuck")
    };
    let gw = shared_gateway(
        config(),
        vec![route("a"), stuck, route("later")],
        backends(&[("a", &a)]),
    )
    .await;
    let c = client();
    let mut held = Vec::new();
    for _ in 0..5 {
        let (c, req) = (c.clone(), chat_req(&gw.url(), &chat_for("stuck", false)));
        held.push(tokio::spawn(async move { send_full(&c, req).await }));
    }
    wait_model_demand(&gw, "ns/stuck", |s| s.pending() == 5).await;
    for _ in 0..3 {
        let (status, headers, body) =
            send_full(&c, chat_req(&gw.url(), &chat_for("stuck", false))).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(headers["retry-after"], "3");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "queue_full");
    }
    // While the flood holds its queue: a warm model answers at once, and a cold one is held
    // (its own queue, its own lease) and served as soon as its backend is ready.
    let t = Instant::now();
    let (status, _) = body_json(&c, chat_req(&gw.url(), &chat_for("a", false))).await;
    assert_eq!(status, StatusCode::OK);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    let cold = {
        let (c, req) = (c.clone(), chat_req(&gw.url(), &chat_for("later", true)));
        tokio::spawn(async move { send_full(&c, req).await })
    };
    wait_model_demand(&gw, "ns/later", |s| s.pending() == 1 && s.lease()).await;
    assert!(!gw.gateway.model("ns/a").unwrap().demand().state().lease());
    gw.gateway
        .model("ns/later")
        .unwrap()
        .discovered()
        .replace([authority(&later)]);
    let (status, _, body) = within(10, "the cold model's stream", cold).await.unwrap();
    assert_eq!(status, StatusCode::OK);
    let events = sse_events(&body);
    assert!(
        events.first().unwrap().starts_with(": hearth"),
        "{events:?}"
    );
    assert!(events.last().unwrap().contains("[DONE]"));
    assert_eq!(
        gw.gateway
            .model("ns/stuck")
            .unwrap()
            .demand()
            .state()
            .pending(),
        5,
        "the flood is still held"
    );
    let text = gateway_metrics(&c, &gw).await;
    for (sample, want) in [
        (
            r#"hearth_gateway_rejections_total{service="ns/stuck",reason="queue_full"}"#,
            3.0,
        ),
        (r#"hearth_gateway_pending{service="ns/stuck"}"#, 5.0),
        (
            r#"hearth_gateway_requests_total{service="ns/a",code="200"}"#,
            1.0,
        ),
        (
            r#"hearth_gateway_backend_endpoints{service="ns/later"}"#,
            1.0,
        ),
        ("hearth_gateway_route_table_models", 3.0),
    ] {
        assert_eq!(metric(&text, sample), Some(want), "{sample}: {text}");
    }
    assert!(
        !text.contains(r#"rejections_total{service="ns/a""#),
        "nothing refused for a: {text}"
    );
    for h in held {
        h.abort();
    }
}

#[tokio::test]
async fn keda_reads_each_model_by_its_service() {
    let gw = shared_gateway(config(), vec![route("a"), route("b")], Backends::new()).await;
    let c = client();
    let held = {
        let (c, req) = (c.clone(), chat_req(&gw.url(), &chat_for("a", false)));
        tokio::spawn(async move { send_full(&c, req).await })
    };
    wait_model_demand(&gw, "ns/a", |s| s.pending() == 1).await;
    // Poll mode.
    let q = |query: &str| {
        let url = format!("{}/hearth/queue{query}", gw.admin_url());
        let c = c.clone();
        async move { json(&c, &url).await }
    };
    assert_eq!(
        q("?service=ns/a").await,
        (StatusCode::OK, serde_json::json!({"pending": 1}))
    );
    let (status, local) = q("?service=ns/a&scope=local").await;
    assert_eq!(
        (status, &local["pending"]),
        (StatusCode::OK, &serde_json::json!(1))
    );
    // While it has demand the replica is not idle (what the device handover ranks by).
    assert_eq!(local["idleSeconds"], serde_json::json!(0.0));
    assert_eq!(
        q("?service=ns/b").await,
        (StatusCode::OK, serde_json::json!({"pending": 0}))
    );
    // The path forms, which KEDA's endpoint aggregation keeps (it drops the query).
    for (path, pending) in [("/ns/a", 1), ("/ns/a/local", 1), ("/ns/b/local", 0)] {
        let (status, v) = q(path).await;
        assert_eq!(
            (status, &v["pending"]),
            (StatusCode::OK, &serde_json::json!(pending)),
            "{path}"
        );
        // The local answers say how long the replica has had no demand for the model.
        assert_eq!(
            v.get("idleSeconds").is_some(),
            path.ends_with("/local"),
            "{path}: {v}"
        );
    }
    let (_, idle_b) = q("/ns/b/local").await;
    assert!(
        idle_b["idleSeconds"].as_f64().is_some_and(|s| s > 0.0),
        "{idle_b}"
    );
    let (status, v) = q("/ns/zz/local").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{v}");
    let (status, v) = q("/local").await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let (status, v) = q("").await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(v["error"].as_str().unwrap().contains("service"), "{v}");
    let (status, v) = q("?service=ns/zz").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert!(v["error"].as_str().unwrap().contains("ns/zz"), "{v}");

    // Push mode: one stream per ScaledObject, each following its own model.
    let mut k = scaler_client(&gw).await;
    let e = k.is_active(so_ref(&[])).await.unwrap_err();
    assert_eq!(e.code(), Code::InvalidArgument);
    assert!(e.message().contains("service"), "{}", e.message());
    assert_eq!(
        k.is_active(so_for("ns/nope")).await.unwrap_err().code(),
        Code::NotFound
    );
    assert!(
        k.is_active(so_for("ns/a"))
            .await
            .unwrap()
            .into_inner()
            .result
    );
    assert!(
        !k.is_active(so_for("ns/b"))
            .await
            .unwrap()
            .into_inner()
            .result
    );
    let m = k
        .get_metrics(hearth_gateway::scaler::pb::GetMetricsRequest {
            scaled_object_ref: Some(so_for("ns/a")),
            metric_name: "s0-hearth_queue_depth".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(m.metric_values[0].metric_value, 1);

    let mut sa = k
        .stream_is_active(so_for("ns/a"))
        .await
        .unwrap()
        .into_inner();
    let mut sb = k
        .stream_is_active(so_for("ns/b"))
        .await
        .unwrap()
        .into_inner();
    // Subscribed before its model enters the table: it waits for it.
    let mut sc = k
        .stream_is_active(so_for("ns/c"))
        .await
        .unwrap()
        .into_inner();
    assert!(sa.message().await.unwrap().unwrap().result);
    assert!(!sb.message().await.unwrap().unwrap().result);
    assert!(!sc.message().await.unwrap().unwrap().result);
    // Demand on b reaches b's stream only.
    let held_b = {
        let (c, req) = (c.clone(), chat_req(&gw.url(), &chat_for("b", false)));
        tokio::spawn(async move { send_full(&c, req).await })
    };
    assert!(
        within(5, "b's stream", sb.message())
            .await
            .unwrap()
            .unwrap()
            .result
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(300), sc.message())
            .await
            .is_err(),
        "c's stream says nothing about b"
    );
    gw.gateway
        .apply_routes(&RouteTable {
            models: vec![route("a"), route("b"), route("c")],
        })
        .unwrap();
    let held_c = {
        let (c, req) = (c.clone(), chat_req(&gw.url(), &chat_for("c", false)));
        tokio::spawn(async move { send_full(&c, req).await })
    };
    assert!(
        within(5, "c's stream", sc.message())
            .await
            .unwrap()
            .unwrap()
            .result
    );
    for h in [held, held_b, held_c] {
        h.abort();
    }
}

#[tokio::test]
async fn v1_models_lists_the_table_behind_the_api_keys() {
    let a = stub_named("a").await;
    let dir = std::env::temp_dir().join(format!("hearth-shared-keys-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("keys");
    std::fs::write(&path, "sk-one\n").unwrap();
    let keys = ApiKeys::load(&path).unwrap();
    let gw = shared_gateway_with_keys(
        config(),
        vec![
            route("a"),
            ModelRoute {
                last_activation: Some(hearth_crds::Duration::new("12s")),
                ..route("b")
            },
        ],
        backends(&[("a", &a)]),
        keys,
    )
    .await;
    let c = client();
    let get = |path: &str, key: Option<&str>| {
        let mut req = Request::get(format!("{}{path}", gw.url()));
        if let Some(key) = key {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        req.body(Full::new(Bytes::new())).unwrap()
    };
    let (status, _) = body_json(&c, get("/v1/models", None)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    let (status, v) = body_json(&c, get("/v1/models", Some("sk-one"))).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["object"], "list");
    let hearth: Vec<_> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e["id"].clone(), e["hearth"].clone()))
        .collect();
    assert_eq!(
        hearth,
        [
            (
                "a".into(),
                serde_json::json!({"service": "ns/a", "state": "ready", "readyReplicas": 1, "expectedWaitSeconds": null})
            ),
            (
                "b".into(),
                serde_json::json!({"service": "ns/b", "state": "zero", "readyReplicas": 0, "expectedWaitSeconds": 12.0})
            ),
        ]
    );
    let (status, v) = body_json(&c, get("/v1/models/b", Some("sk-one"))).await;
    assert_eq!(
        (status, &v["id"]),
        (StatusCode::OK, &serde_json::json!("b"))
    );
    let (status, v) = body_json(&c, get("/v1/models/z", Some("sk-one"))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(v["error"]["code"], "model_not_found");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn replicas_sum_each_models_demand() {
    let cfg = GatewayConfig {
        aggregate_peers: true,
        ..config()
    };
    let a = shared_gateway(cfg.clone(), vec![route("m"), route("n")], Backends::new()).await;
    let b = shared_gateway(cfg, vec![route("m"), route("n")], Backends::new()).await;
    let peers_a = PeerSet::new(a.gateway.peer_sink());
    let peers_b = PeerSet::new(b.gateway.peer_sink());
    peers_a.update(vec![b.admin.to_string()]);
    peers_b.update(vec![a.admin.to_string()]);
    let c = client();
    let mut held = Vec::new();
    for (g, model) in [(&a, "m"), (&b, "m"), (&b, "n")] {
        let (c, req) = (c.clone(), chat_req(&g.url(), &chat_for(model, false)));
        held.push(tokio::spawn(async move { send_full(&c, req).await }));
    }
    // Each replica sees the other's demand per model.
    for g in [&a, &b] {
        within(5, "the totals", async {
            wait_model_demand(g, "ns/m", |s| s.total() == Ok(2)).await;
            wait_model_demand(g, "ns/n", |s| s.total() == Ok(1)).await;
        })
        .await;
    }
    let (status, v) = json(&c, &format!("{}/hearth/queue?service=ns/n", a.admin_url())).await;
    assert_eq!(
        (status, v),
        (StatusCode::OK, serde_json::json!({"pending": 1}))
    );
    // The peer stream's line: one entry per model.
    let resp = send(
        &c,
        Request::get(format!("{}/hearth/local-demand", b.admin_url()))
            .body(Full::new(Bytes::new()))
            .unwrap(),
    )
    .await;
    let mut body = resp.into_body();
    let line = within(5, "a demand line", next_chunk(&mut body))
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&line).unwrap();
    assert_eq!(v, serde_json::json!({"demand": {"ns/m": 1, "ns/n": 1}}));
    for h in held {
        h.abort();
    }
}

#[tokio::test]
async fn a_model_leaving_the_table_finishes_its_stream_then_is_unknown() {
    let long = long_stub(Duration::from_millis(5)).await;
    let gw = shared_gateway(
        config(),
        vec![ModelRoute {
            model: "stub-svc".into(),
            ..route("a")
        }],
        backends(&[("a", &long)]),
    )
    .await;
    let c = client();
    let mut body = chat_for("stub-svc", true);
    body["max_tokens"] = 40.into();
    let resp = send(&c, chat_req(&gw.url(), &body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut stream = resp.into_body();
    let first = next_chunk(&mut stream).await.unwrap();
    assert!(first.starts_with(b"data: "));
    gw.gateway
        .apply_routes(&RouteTable { models: Vec::new() })
        .unwrap();
    let (status, _) = body_json(&c, chat_req(&gw.url(), &chat_for("stub-svc", false))).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "unknown for new requests");
    let mut rest = Vec::new();
    while let Some(chunk) = within(10, "the stream", next_chunk(&mut stream)).await {
        rest.extend_from_slice(&chunk);
    }
    let events = sse_events(&rest);
    assert!(events.last().unwrap().contains("[DONE]"), "{events:?}");
    let (_, v) = json(&c, &format!("{}/v1/models", gw.url())).await;
    assert_eq!(v["data"], serde_json::json!([]));
}

#[tokio::test]
async fn each_model_has_its_own_sleeping_tier_and_v1_models_follows_it() {
    use vllm_stub::{SleepState, StubConfig};
    let sleepy = vllm_stub::spawn(
        StubConfig {
            served_model_names: vec!["sleepy".into()],
            enable_sleep_mode: true,
            dev_mode: true,
            sleep_delay: Duration::from_millis(20),
            wake_delay: Duration::from_millis(200),
            ..stub_config()
        },
        localhost(),
    )
    .await
    .unwrap();
    let awake = stub_named("awake").await;
    let sleepy_route = ModelRoute {
        sleep: Some(hearth_crds::llmendpoint::SleepRoute {
            after: hearth_crds::Duration::new("200ms"),
            level: 1,
            sleep_path: "/sleep".into(),
            is_sleeping_path: "/is_sleeping".into(),
            wake_up: Vec::new(),
        }),
        ..route("sleepy")
    };
    let gw = shared_gateway(
        config(),
        vec![sleepy_route, route("awake")],
        backends(&[("sleepy", &sleepy), ("awake", &awake)]),
    )
    .await;
    let c = client();
    let state = |id: &'static str| {
        let (c, url) = (c.clone(), format!("{}/v1/models/{id}", gw.url()));
        async move { json(&c, &url).await.1["hearth"]["state"].clone() }
    };
    // Idle: only the model with a sleeping tier is put to sleep.
    let mut rx = sleepy.state.subscribe_sleep();
    within(
        10,
        "the engine asleep",
        rx.wait_for(|s| *s != SleepState::Awake),
    )
    .await
    .unwrap();
    within(10, "sleeping in /v1/models", async {
        while state("sleepy").await != "sleeping" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(state("awake").await, "ready");
    assert_eq!(
        awake.state.received(),
        0,
        "the other model's engine was left alone"
    );
    // A request wakes it and is served.
    let (status, v) = body_json(&c, chat_req(&gw.url(), &chat_for("sleepy", false))).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(*sleepy.state.subscribe_sleep().borrow(), SleepState::Awake);
    let text = gateway_metrics(&c, &gw).await;
    assert_eq!(
        metric(
            &text,
            r#"hearth_gateway_engine_calls_total{service="ns/sleepy",call="wake_up",result="ok"}"#
        ),
        Some(1.0),
        "{text}"
    );
    assert!(
        !text.contains(r#"engine_calls_total{service="ns/awake""#),
        "{text}"
    );
}

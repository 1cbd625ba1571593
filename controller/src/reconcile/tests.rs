use k8s_openapi::api::apps::v1::{Deployment, DeploymentStatus};
use kube::{core::Status, runtime::watcher::Event};
use rstest::rstest;

use super::{
    CONFLICT_RETRY, ERROR_RETRY, Error,
    watch::{Churn, relevant, without_errors},
};

fn api_error(code: u16) -> Error {
    Error::Kube {
        action: "apply Deployment team-a/chat".to_owned(),
        source: kube::Error::Api(Box::new(Status {
            code,
            ..Status::default()
        })),
    }
}

#[test]
fn back_off_and_metric_label_by_error() {
    let cases = [
        (api_error(409), CONFLICT_RETRY, "conflict"),
        (api_error(422), ERROR_RETRY, "invalid"),
        (api_error(403), ERROR_RETRY, "forbidden"),
        (api_error(500), ERROR_RETRY, "kube_api"),
        (
            Error::Kube {
                action: "get Deployment team-a/chat".to_owned(),
                source: kube::Error::LinesCodecMaxLineLengthExceeded,
            },
            ERROR_RETRY,
            "kube_api",
        ),
        (Error::Serialize("x".to_owned()), ERROR_RETRY, "serialize"),
        (Error::Render("x".to_owned()), ERROR_RETRY, "render"),
    ];
    for (error, backoff, label) in cases {
        assert_eq!(
            (error.backoff(), error.metric_label()),
            (backoff, label),
            "{error}"
        );
    }
    assert_eq!(CONFLICT_RETRY.as_secs(), 1);
    assert_eq!(ERROR_RETRY.as_secs(), 15);
}

fn deployment(name: &str, ready: i32, resource_version: &str) -> Deployment {
    let mut d = Deployment::default();
    d.metadata.name = Some(name.to_owned());
    d.metadata.namespace = Some("team-a".to_owned());
    d.metadata.resource_version = Some(resource_version.to_owned());
    d.status = Some(DeploymentStatus {
        ready_replicas: Some(ready),
        ..Default::default()
    });
    d
}

/// What reconcilers read of a Deployment: its ready replicas.
const READY: fn(&Deployment) -> u64 =
    |d| relevant(d, &d.status.as_ref().and_then(|s| s.ready_replicas));

/// Each event through a churn filter on `relevant`, after the initial list of Deployment `a`
/// (which passes `a` once): the name of the Deployment it passes, `None` where it passes
/// nothing.
#[rstest]
#[case::passes_what_the_reconciler_reads_and_every_deletion(
    Some(READY),
    vec![
        // Only the resourceVersion changed (another status field): dropped.
        Event::Apply(deployment("a", 0, "2")),
        Event::Apply(deployment("a", 1, "3")),
        Event::Apply(deployment("b", 1, "4")),
        Event::Delete(deployment("a", 1, "5")),
        // Seen again after its deletion: passes.
        Event::Apply(deployment("a", 1, "6")),
    ],
    &[None, Some("a"), Some("b"), Some("a"), Some("a")],
)]
#[case::without_a_relevant_function_every_change_passes(
    None,
    vec![
        Event::Apply(deployment("a", 0, "1")),
        Event::Delete(deployment("a", 0, "1")),
    ],
    &[Some("a"), Some("a")],
)]
fn the_churn_filter(
    #[case] relevant: Option<fn(&Deployment) -> u64>,
    #[case] events: Vec<Event<Deployment>>,
    #[case] want: &[Option<&str>],
) {
    let mut churn = Churn::new(relevant);
    let initial_list = [
        Event::Init,
        Event::InitApply(deployment("a", 0, "1")),
        Event::InitDone,
    ];
    let got: Vec<Option<String>> = initial_list
        .into_iter()
        .chain(events)
        .map(|e| churn.pass(e).and_then(|d| d.metadata.name))
        .collect();
    let want = [None, Some("a"), None].iter().chain(want);
    assert_eq!(got, want.map(|n| n.map(str::to_owned)).collect::<Vec<_>>());
}

/// Virtual seconds from the start until the Controller's first reconcile, when its only trigger
/// stream yields `errors` watch errors and then a Deployment.
async fn first_reconcile_after(errors: usize, filtered: bool) -> f64 {
    use futures::{StreamExt, stream};
    use kube::runtime::{Controller, controller::Action, reflector, watcher};
    use std::{sync::Arc, time::Duration};

    let failure = || {
        watcher::Error::WatchFailed(kube::Error::Api(Box::new(Status {
            code: 503,
            ..Status::default()
        })))
    };
    let mut dep = Deployment::default();
    dep.metadata.name = Some("chat-backend".into());
    dep.metadata.namespace = Some("team-a".into());
    let (store, mut writer) = reflector::store::<Deployment>();
    writer.apply_watcher_event(&Event::InitApply(dep.clone()));
    writer.apply_watcher_event(&Event::InitDone);
    let items = stream::iter((0..errors).map(move |_| Err(failure())))
        .chain(stream::iter([Ok(dep)]))
        .chain(stream::pending());
    let trigger = if filtered {
        without_errors("Deployment", items).boxed()
    } else {
        items.boxed()
    };
    let start = tokio::time::Instant::now();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let run = Controller::for_stream(trigger, store).run(
        move |_, _| {
            let _ = tx.send(());
            async { Ok::<_, Error>(Action::await_change()) }
        },
        |_, _, _| Action::await_change(),
        Arc::new(()),
    );
    tokio::spawn(run.for_each(|_| async {}));
    let _ = tokio::time::timeout(Duration::from_secs(3600), rx.recv()).await;
    start.elapsed().as_secs_f64()
}

/// A burst of watch errors (every watch failing during an apiserver restart) must not delay
/// the next trigger: the Controller's one shared trigger backoff slept 0.8 s doubling to 30 s
/// per error, and edits went unreconciled for minutes. `without_errors` keeps the errors out.
#[tokio::test(start_paused = true)]
async fn watch_errors_do_not_put_the_controller_to_sleep() {
    let unfiltered = first_reconcile_after(12, false).await;
    let filtered = first_reconcile_after(12, true).await;
    assert!(
        unfiltered > 60.0,
        "kube-runtime's shared trigger backoff no longer delays triggers ({unfiltered} s); without_errors may be unneeded"
    );
    assert!(filtered < 1.0, "first reconcile after {filtered} virtual s");
}

/// A Deployment `team-a/<name>` with `annotations`, a status and kubectl's last-applied copy.
fn plain(name: &str, annotations: serde_json::Value, replicas: i32) -> Deployment {
    let mut a = serde_json::json!({"kubectl.kubernetes.io/last-applied-configuration": "{...}"});
    hearth_test_support::merge_json(&mut a, annotations);
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": "team-a", "uid": format!("uid-{name}"),
                     "annotations": a,
                     "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "strategy": {"type": "Recreate"},
            "template": {"metadata": {"labels": {"app": name}},
                         "spec": {"nodeSelector": {"gpu": "a10"},
                                  "containers": [{"name": "vllm", "image": "vllm", "args": ["--x"],
                                                  "env": [{"name": "A", "value": "b"}],
                                                  "ports": [{"name": "http", "containerPort": 8000}]}]}},
        },
        "status": {"replicas": replicas, "readyReplicas": replicas},
    }))
    .unwrap()
}

fn joining(name: &str, replicas: i32) -> Deployment {
    plain(
        name,
        serde_json::json!({"serving.hearth.dev/endpoint": "shared", "serving.hearth.dev/model": "m"}),
        replicas,
    )
}

#[test]
fn only_joining_deployments_are_kept_and_lean() {
    use super::watch::member_events;
    // A member: kept without status, managedFields, last-applied, or what the pod template has
    // beyond its containers' names, ports, command and args.
    let Some(Event::Apply(d)) = member_events(Event::Apply(joining("a", 2))) else {
        panic!("a member is applied");
    };
    assert!(d.status.is_none() && d.metadata.managed_fields.is_none());
    assert_eq!(
        d.metadata
            .annotations
            .as_ref()
            .unwrap()
            .keys()
            .collect::<Vec<_>>(),
        ["serving.hearth.dev/endpoint", "serving.hearth.dev/model"]
    );
    let v = serde_json::to_value(d.spec.as_ref().unwrap()).unwrap();
    assert_eq!(
        v,
        serde_json::json!({
            "replicas": 2,
            "selector": {"matchLabels": {"app": "a"}},
            "template": {"spec": {"containers": [{"name": "vllm", "args": ["--x"],
                                                  "ports": [{"name": "http", "containerPort": 8000}]}]}},
        })
    );
    assert!(matches!(
        member_events(Event::InitApply(joining("a", 2))),
        Some(Event::InitApply(_))
    ));
    // Anything else is never kept: listed, it is dropped; updated, it is removed (it may have
    // had the annotation before).
    assert!(member_events(Event::InitApply(plain("b", serde_json::json!({}), 1))).is_none());
    let Some(Event::Delete(gone)) =
        member_events(Event::Apply(plain("b", serde_json::json!({}), 1)))
    else {
        panic!("an update of a non-member removes it");
    };
    assert_eq!(
        (gone.metadata.name.as_deref(), gone.spec.is_none()),
        (Some("b"), true)
    );
    assert!(matches!(member_events(Event::Init), Some(Event::Init)));
    assert!(matches!(
        member_events(Event::InitDone),
        Some(Event::InitDone)
    ));
}

#[test]
fn member_triggers_reconcile_changes_and_sweep_those_that_left() {
    use super::watch::{MemberTriggers, member_events};
    let mut t = MemberTriggers::new();
    let mut pass = |e: Event<Deployment>| {
        // What the cache does not take triggers nothing.
        let Some(e) = member_events(e) else {
            return (None, Vec::new());
        };
        let change = t.pass(e);
        (
            change.reconcile.map(|d| d.metadata.name.unwrap()),
            change
                .left
                .into_iter()
                .map(|d| d.metadata.name.unwrap())
                .collect::<Vec<_>>(),
        )
    };
    let none: Vec<String> = Vec::new();
    assert_eq!(
        pass(Event::Apply(joining("a", 0))),
        (Some("a".into()), none.clone())
    );
    // KEDA scaling it (replicas, status) triggers nothing; an annotation does.
    assert_eq!(pass(Event::Apply(joining("a", 3))), (None, none.clone()));
    let mut changed = joining("a", 3);
    changed
        .metadata
        .annotations
        .as_mut()
        .unwrap()
        .insert("serving.hearth.dev/max-replicas".into(), "3".into());
    assert_eq!(
        pass(Event::Apply(changed)),
        (Some("a".into()), none.clone())
    );
    // The annotation removed: it left.
    assert_eq!(
        pass(Event::Apply(plain("a", serde_json::json!({}), 3))),
        (None, vec!["a".to_owned()])
    );
    // Another Deployment's updates: nothing.
    assert_eq!(
        pass(Event::Apply(plain("b", serde_json::json!({}), 1))),
        (None, none.clone())
    );
    // Deleted while a member: it left.
    assert_eq!(
        pass(Event::Apply(joining("c", 1))),
        (Some("c".into()), none.clone())
    );
    assert_eq!(
        pass(Event::Delete(joining("c", 1))),
        (None, vec!["c".to_owned()])
    );
    // A re-list that no longer has a member (its annotation removed while the watch was down).
    assert_eq!(
        pass(Event::Apply(joining("d", 1))),
        (Some("d".into()), none.clone())
    );
    assert_eq!(
        pass(Event::Apply(joining("e", 1))),
        (Some("e".into()), none.clone())
    );
    assert_eq!(pass(Event::Init), (None, none.clone()));
    assert_eq!(
        pass(Event::InitApply(joining("e", 1))),
        (None, none.clone())
    );
    assert_eq!(
        pass(Event::InitApply(plain("d", serde_json::json!({}), 1))),
        (None, none.clone())
    );
    assert_eq!(pass(Event::InitDone), (None, vec!["d".to_owned()]));
}

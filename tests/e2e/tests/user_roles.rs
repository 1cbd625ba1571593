//! Roles for users on the installed release, as the apiserver's own authorizer answers them
//! (SubjectAccessReview, what `kubectl auth can-i --as` asks), for users bound the way a
//! platform team binds them:
//!
//! - a namespace's RoleBindings to Kubernetes' built-in `view`, `edit` and `admin` (which
//!   aggregate the chart's `hearth-view`, `hearth-edit` and `hearth-admin`): view reads
//!   LLMServices, LLMAdapters and LLMEndpoints there; edit also writes LLMServices and
//!   LLMAdapters, not LLMEndpoints; admin also writes LLMEndpoints; none of them reads or
//!   writes InferenceRuntimes or ServingPolicies, or acts in another namespace;
//! - ClusterRoleBindings to `hearth-runtime-viewer` (reads InferenceRuntimes and
//!   ServingPolicies, nothing else) and `hearth-platform-admin` (writes them, and no model's
//!   namespace);
//! - a user bound to nothing gets nothing.
//!
//! Installs the release with `tests/cluster/install-hearth` unless it is there (the harness's
//! `ensure_hearth`).

use std::time::Duration;

use anyhow::{Context, Result};
use hearth_e2e_harness::stack::{RELEASE, ensure_hearth};
use hearth_test_support::{Cluster, Observed, wait_until};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, RoleBinding};
use kube::Api;
use kube::api::PostParams;
use serde_json::json;

/// Deletes the ClusterRoleBindings on drop (the namespace takes the RoleBindings), with
/// kubectl: the test's kube client cannot be driven from `drop` on the test's own runtime.
struct Bindings(std::process::Command);

impl Drop for Bindings {
    fn drop(&mut self) {
        let _ = self.0.output();
    }
}

/// Whether `user` may `verb` `resource` (group serving.hearth.dev) in `namespace` (`None`:
/// cluster-wide), as the apiserver authorizes it.
async fn allowed(
    client: &kube::Client,
    user: &str,
    verb: &str,
    resource: &str,
    namespace: Option<&str>,
) -> Result<bool> {
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.to_owned()),
            resource_attributes: Some(ResourceAttributes {
                group: Some("serving.hearth.dev".to_owned()),
                resource: Some(resource.to_owned()),
                verb: Some(verb.to_owned()),
                namespace: namespace.map(str::to_owned),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let answer = Api::<SubjectAccessReview>::all(client.clone())
        .create(&PostParams::default(), &review)
        .await
        .context("SubjectAccessReview")?;
    Ok(answer.status.is_some_and(|s| s.allowed))
}

#[tokio::test]
async fn namespace_roles_and_platform_roles_grant_what_the_docs_say() -> Result<()> {
    let cluster = Cluster::connect().await?;
    let client = cluster.client();
    ensure_hearth(&client, cluster.kubeconfig()).await?;
    let ns = cluster.namespace("e2e-roles").await?;
    let here = ns.name();
    let user = |role: &str| format!("{role}@{here}");
    for role in ["view", "edit", "admin"] {
        ns.api::<RoleBinding>()
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": format!("e2e-{role}")},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": role},
                    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                  "name": user(role)}],
                }))?,
            )
            .await
            .with_context(|| format!("binding {} to {role}", user(role)))?;
    }
    let cluster_roles = ["runtime-viewer", "platform-admin"];
    let binding = |role: &str| format!("{here}-{role}");
    for role in cluster_roles {
        Api::<ClusterRoleBinding>::all(client.clone())
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": binding(role)},
                    "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                "name": format!("{RELEASE}-{role}")},
                    "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                                  "name": user(role)}],
                }))?,
            )
            .await
            .with_context(|| format!("binding {} to {RELEASE}-{role}", user(role)))?;
    }
    let mut delete = cluster.kubectl()?;
    delete.args([
        "delete",
        "clusterrolebinding",
        "--ignore-not-found",
        "--wait=false",
    ]);
    delete.args(cluster_roles.map(binding));
    let _bindings = Bindings(delete);

    // (user, verb, resource, in this namespace (else cluster-wide, or "default" for a
    // namespaced resource), allowed)
    let here_ns = Some(here);
    let other = Some("default");
    let table: Vec<(String, &str, &str, Option<&str>, bool)> = vec![
        (user("view"), "get", "llmservices", here_ns, true),
        (user("view"), "list", "llmendpoints", here_ns, true),
        (user("view"), "watch", "llmadapters", here_ns, true),
        (user("view"), "create", "llmservices", here_ns, false),
        (user("view"), "get", "inferenceruntimes", None, false),
        (user("edit"), "create", "llmservices", here_ns, true),
        (user("edit"), "patch", "llmservices", here_ns, true),
        (user("edit"), "delete", "llmadapters", here_ns, true),
        (user("edit"), "create", "llmendpoints", here_ns, false),
        (user("edit"), "create", "llmservices", other, false),
        (user("edit"), "create", "inferenceruntimes", None, false),
        (user("admin"), "create", "llmendpoints", here_ns, true),
        (user("admin"), "create", "servingpolicies", None, false),
        (user("admin"), "list", "inferenceruntimes", None, false),
        (
            user("runtime-viewer"),
            "list",
            "inferenceruntimes",
            None,
            true,
        ),
        (user("runtime-viewer"), "get", "servingpolicies", None, true),
        (
            user("runtime-viewer"),
            "create",
            "inferenceruntimes",
            None,
            false,
        ),
        (user("runtime-viewer"), "get", "llmservices", here_ns, false),
        (
            user("platform-admin"),
            "create",
            "inferenceruntimes",
            None,
            true,
        ),
        (
            user("platform-admin"),
            "delete",
            "servingpolicies",
            None,
            true,
        ),
        (
            user("platform-admin"),
            "create",
            "llmservices",
            here_ns,
            false,
        ),
        (user("nobody"), "get", "llmservices", here_ns, false),
        (user("nobody"), "list", "inferenceruntimes", None, false),
    ];
    // The aggregation controller and the authorizer's cache take a moment to see new roles.
    wait_until(
        "every access review to answer as documented",
        Duration::from_secs(60),
        || {
            let (client, table) = (client.clone(), table.clone());
            async move {
                let mut wrong = Vec::new();
                for (user, verb, resource, namespace, want) in &table {
                    if allowed(&client, user, verb, resource, *namespace).await? != *want {
                        wrong.push(format!(
                            "{user} {verb} {resource} in {}: want {}",
                            namespace.unwrap_or("the cluster"),
                            if *want { "allowed" } else { "denied" }
                        ));
                    }
                }
                Ok(if wrong.is_empty() {
                    Observed::Ready(())
                } else {
                    Observed::NotYet(wrong.join("; "))
                })
            }
        },
    )
    .await?;
    println!(
        "[user roles] {} access reviews answered as documented",
        table.len()
    );
    Ok(())
}

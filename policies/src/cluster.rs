//! Platform `ServingPolicy` objects from the cluster, shared by the admission webhook and the
//! controller so both evaluate the same set in the same order: each policy is compiled on its
//! own ([`Compiled::compile`]), a broken edit falls back to the policy's last good version, and
//! [`evaluation_order`] puts the built-ins first (a cluster copy of a built-in replacing it in
//! its place) and then the platform policies by name.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use hearth_crds::ServingPolicy;

use crate::PolicySet;

/// One platform `ServingPolicy` that compiled, kept with the identity of that version so a
/// later broken edit can fall back to it.
#[derive(Clone, Debug)]
pub struct Compiled {
    /// `metadata.uid` of the compiled object.
    pub uid: Option<String>,
    /// `metadata.generation` of the compiled object.
    pub generation: i64,
    /// The policy object as it compiled.
    pub policy: Arc<ServingPolicy>,
}

impl Compiled {
    /// Compiles one policy on its own. The error names the policy, the field and the position
    /// in the expression.
    pub fn compile(p: &ServingPolicy) -> Result<Self, String> {
        let (_, errors) = PolicySet::compile(std::slice::from_ref(p));
        if !errors.is_empty() {
            return Err(errors
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "));
        }
        Ok(Self {
            uid: p.metadata.uid.clone(),
            generation: p.metadata.generation.unwrap_or_default(),
            policy: Arc::new(p.clone()),
        })
    }

    /// Whether this is the compilation of `p` as it is now (same object, same generation).
    pub fn is_of(&self, p: &ServingPolicy) -> bool {
        self.generation == p.metadata.generation.unwrap_or_default() && self.uid == p.metadata.uid
    }
}

fn name_of(p: &ServingPolicy) -> String {
    p.metadata.name.clone().unwrap_or_default()
}

/// The policies a set evaluates, in order: the built-ins first, then the platform policies by
/// name. A cluster ServingPolicy named like a built-in (the chart installs the built-ins as
/// objects, so platform teams can read and edit them) replaces it in its place, so an edit takes
/// effect and nothing runs twice; deleting it restores the embedded default.
pub fn evaluation_order(
    builtins: &[ServingPolicy],
    cluster: &BTreeMap<String, Compiled>,
) -> Vec<ServingPolicy> {
    let builtin_names: BTreeSet<String> = builtins.iter().map(name_of).collect();
    builtins
        .iter()
        .map(|b| {
            cluster
                .get(&name_of(b))
                .map_or_else(|| b.clone(), |c| (*c.policy).clone())
        })
        .chain(
            cluster
                .iter()
                .filter(|(name, _)| !builtin_names.contains(*name))
                .map(|(_, c)| (*c.policy).clone()),
        )
        .collect()
}

/// What [`LastGood::update`] found for one policy of the cluster's list.
#[derive(Clone, Debug)]
pub struct PolicyState {
    /// The policy as listed.
    pub policy: Arc<ServingPolicy>,
    /// `None`: this version compiled; `Some`: its compile error (the last good version, if
    /// any, is used instead).
    pub error: Option<String>,
    /// Whether this version was compiled by this update (false: known from before).
    pub fresh: bool,
}

/// The last good compilation of each cluster policy, by name.
#[derive(Clone, Debug, Default)]
pub struct LastGood {
    compiled: BTreeMap<String, Compiled>,
    failed: BTreeMap<String, (Option<String>, i64, String)>,
}

impl LastGood {
    /// Brings the set up to date with the cluster's current list: policies gone are forgotten,
    /// a new or edited one is compiled on its own (once per generation), and a broken version
    /// keeps the last good one in the set.
    pub fn update(&mut self, current: &[Arc<ServingPolicy>]) -> Vec<PolicyState> {
        let present: BTreeSet<String> = current.iter().map(|p| name_of(p)).collect();
        self.compiled.retain(|name, _| present.contains(name));
        self.failed.retain(|name, _| present.contains(name));
        let mut out = Vec::with_capacity(current.len());
        for p in current {
            let name = name_of(p);
            let generation = p.metadata.generation.unwrap_or_default();
            if self.compiled.get(&name).is_some_and(|c| c.is_of(p)) {
                out.push(PolicyState {
                    policy: p.clone(),
                    error: None,
                    fresh: false,
                });
                continue;
            }
            if let Some((_, _, e)) = self
                .failed
                .get(&name)
                .filter(|(uid, g, _)| *g == generation && *uid == p.metadata.uid)
            {
                out.push(PolicyState {
                    policy: p.clone(),
                    error: Some(e.clone()),
                    fresh: false,
                });
                continue;
            }
            match Compiled::compile(p) {
                Ok(c) => {
                    self.failed.remove(&name);
                    self.compiled.insert(name, c);
                    out.push(PolicyState {
                        policy: p.clone(),
                        error: None,
                        fresh: true,
                    });
                }
                Err(e) => {
                    self.failed
                        .insert(name, (p.metadata.uid.clone(), generation, e.clone()));
                    out.push(PolicyState {
                        policy: p.clone(),
                        error: Some(e),
                        fresh: true,
                    });
                }
            }
        }
        out
    }

    /// The compiled policies by name.
    pub fn compiled(&self) -> &BTreeMap<String, Compiled> {
        &self.compiled
    }

    /// [`evaluation_order`] of `builtins` and these policies.
    pub fn evaluation_order(&self, builtins: &[ServingPolicy]) -> Vec<ServingPolicy> {
        evaluation_order(builtins, &self.compiled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(name: &str, expression: &str) -> ServingPolicy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "serving.hearth.dev/v1alpha1",
            "kind": "ServingPolicy",
            "metadata": {"name": name},
            "spec": {"validations": [{"expression": expression}]},
        }))
        .unwrap()
    }

    fn compiled(p: ServingPolicy) -> (String, Compiled) {
        (name_of(&p), Compiled::compile(&p).unwrap())
    }

    #[test]
    fn a_cluster_copy_of_a_builtin_replaces_it_in_place() {
        let builtins = [named("hearth-a", "true"), named("hearth-b", "true")];
        let cluster: BTreeMap<String, Compiled> = [
            compiled(named("zz-platform", "true")),
            compiled(named("hearth-b", "false")),
            compiled(named("aa-platform", "true")),
        ]
        .into_iter()
        .collect();
        let order = evaluation_order(&builtins, &cluster);
        let names: Vec<String> = order.iter().map(name_of).collect();
        assert_eq!(
            names,
            ["hearth-a", "hearth-b", "aa-platform", "zz-platform"]
        );
        assert_eq!(
            order[1].spec.validations[0].expression, "false",
            "the cluster's edit"
        );
        assert_eq!(order[0].spec.validations[0].expression, "true");
    }

    #[test]
    fn without_cluster_copies_the_embedded_builtins_run() {
        let builtins = [named("hearth-a", "true")];
        let order = evaluation_order(&builtins, &BTreeMap::new());
        assert_eq!(order.len(), 1);
        assert_eq!(name_of(&order[0]), "hearth-a");
    }

    #[test]
    fn a_broken_edit_keeps_the_last_good_version_and_is_compiled_once() {
        let mut good = named("p", "true");
        good.metadata.generation = Some(1);
        let mut lg = LastGood::default();
        let s = lg.update(&[Arc::new(good.clone())]);
        assert!(s[0].error.is_none() && s[0].fresh);
        let mut broken = named("p", "this is not CEL (");
        broken.metadata.generation = Some(2);
        let s = lg.update(&[Arc::new(broken.clone())]);
        assert!(s[0].error.is_some() && s[0].fresh);
        assert_eq!(
            lg.compiled()["p"].policy.spec.validations[0].expression,
            "true"
        );
        let s = lg.update(&[Arc::new(broken)]);
        assert!(s[0].error.is_some() && !s[0].fresh, "not compiled again");
        assert!(lg.update(&[]).is_empty());
        assert!(lg.compiled().is_empty(), "a deleted policy is forgotten");
    }
}

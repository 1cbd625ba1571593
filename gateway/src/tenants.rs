//! Tenants: who a request is for, found by its API key ([`crate::apikeys`]), with the
//! priority band its requests are dispatched in ([`crate::fair`]) and its quotas
//! ([`crate::quota`]).
//!
//! The table is fixed for the life of the process (`--tenant` flags; the controller renders
//! them from the LLMService's `spec.endpoint.tenants` or the LLMEndpoint's `spec.tenants`); the
//! keys behind each tenant are files re-read without a restart. Entry 0 is always the
//! [`DEFAULT_TENANT`]: every request while keys are off, and the keys of `--api-key-file`; a
//! `--tenant` of that name sets its band and quotas.

use std::{path::PathBuf, sync::Arc};

use crate::fair::TenantId;

/// The tenant of requests without a tenant of their own (the API's, `hearth_crds::rules`).
pub use hearth_crds::rules::DEFAULT_TENANT;

/// One tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// A DNS label; the `tenant` label of the metrics.
    pub name: Arc<str>,
    /// The priority band: a higher band is dispatched first.
    pub priority: i32,
    /// Requests per minute across the gateway's replicas; `None`: unlimited.
    pub requests_per_minute: Option<u64>,
    /// Tokens (prompt and completion) per minute across the replicas; `None`: unlimited.
    pub tokens_per_minute: Option<u64>,
    /// The file of this tenant's keys, one per line (the default tenant's may be none).
    pub key_file: Option<PathBuf>,
}

impl Tenant {
    /// A tenant named `name` in band 0 without quotas or keys.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.into(),
            priority: 0,
            requests_per_minute: None,
            tokens_per_minute: None,
            key_file: None,
        }
    }

    /// Parses a `--tenant` value: comma-separated `key=value` pairs, `name` required;
    /// `priority`, `requests-per-minute`, `tokens-per-minute` and `key-file` optional.
    ///
    /// # Errors
    /// A message naming the pair at fault and what it must be.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut t = Self::named("");
        let mut seen: Vec<&str> = Vec::new();
        for pair in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = pair
                .split_once('=')
                .ok_or_else(|| format!("--tenant: {pair:?} is not key=value"))?;
            if seen.contains(&k) {
                return Err(format!("--tenant: {k} is given twice in {s:?}"));
            }
            seen.push(k);
            let number = |what: &str| {
                v.parse::<u64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                    format!("--tenant: {what} must be a positive integer, not {v:?}")
                })
            };
            match k {
                "name" => t.name = v.into(),
                "priority" => {
                    t.priority = v
                        .parse()
                        .map_err(|_| format!("--tenant: priority must be an integer, not {v:?}"))?;
                }
                "requests-per-minute" => t.requests_per_minute = Some(number(k)?),
                "tokens-per-minute" => t.tokens_per_minute = Some(number(k)?),
                "key-file" => t.key_file = Some(PathBuf::from(v)),
                other => {
                    return Err(format!(
                        "--tenant: unknown key {other:?} (name, priority, requests-per-minute, tokens-per-minute, key-file)"
                    ));
                }
            }
        }
        if !hearth_crds::naming::is_dns1123_label(&t.name) {
            return Err(format!(
                "--tenant: name must be a DNS label (lowercase letters, digits, '-', at most 63), not {:?}",
                &*t.name
            ));
        }
        if t.key_file.is_none() && &*t.name != DEFAULT_TENANT {
            return Err(format!(
                "--tenant {}: key-file is required (its clients are known by their keys)",
                t.name
            ));
        }
        Ok(t)
    }
}

/// The replica's tenants; entry 0 is the [`DEFAULT_TENANT`].
#[derive(Debug, Clone)]
pub struct Tenants {
    list: Arc<[Tenant]>,
}

impl Default for Tenants {
    fn default() -> Self {
        Self {
            list: Arc::from([Tenant::named(DEFAULT_TENANT)]),
        }
    }
}

impl Tenants {
    /// The table of `declared` tenants, after the default one (replaced by a declared tenant of
    /// its name).
    ///
    /// # Errors
    /// A tenant declared twice.
    pub fn new(declared: Vec<Tenant>) -> Result<Self, String> {
        let mut list = vec![Tenant::named(DEFAULT_TENANT)];
        let mut default_seen = false;
        for t in declared {
            if &*t.name == DEFAULT_TENANT {
                if default_seen {
                    return Err(format!("--tenant {DEFAULT_TENANT} is given twice"));
                }
                default_seen = true;
                list[0] = t;
            } else if list.iter().any(|o| o.name == t.name) {
                return Err(format!("--tenant {} is given twice", t.name));
            } else {
                list.push(t);
            }
        }
        Ok(Self { list: list.into() })
    }

    /// The tenant `id` (the default one for an id out of range).
    pub fn get(&self, id: TenantId) -> &Tenant {
        self.list.get(id as usize).unwrap_or(&self.list[0])
    }

    /// Every tenant, by id.
    pub fn iter(&self) -> impl Iterator<Item = (TenantId, &Tenant)> {
        self.list
            .iter()
            .enumerate()
            .map(|(i, t)| (TenantId::try_from(i).unwrap_or(TenantId::MAX), t))
    }

    /// The id of the tenant named `name`.
    pub fn id(&self, name: &str) -> Option<TenantId> {
        self.iter().find(|(_, t)| &*t.name == name).map(|(i, _)| i)
    }

    /// Whether any tenant has a quota.
    pub fn any_quota(&self) -> bool {
        self.list
            .iter()
            .any(|t| t.requests_per_minute.is_some() || t.tokens_per_minute.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_flag_names_its_band_quotas_and_keys() {
        let t = Tenant::parse(
            "name=team-a,priority=10,requests-per-minute=600,tokens-per-minute=90000,key-file=/k/a",
        )
        .unwrap();
        assert_eq!(&*t.name, "team-a");
        assert_eq!(t.priority, 10);
        assert_eq!(t.requests_per_minute, Some(600));
        assert_eq!(t.tokens_per_minute, Some(90000));
        assert_eq!(t.key_file.as_deref(), Some(std::path::Path::new("/k/a")));
    }

    #[test]
    fn a_bad_tenant_flag_says_which_pair_is_wrong() {
        for (flag, says) in [
            ("name=A,key-file=/k", "DNS label"),
            ("name=a", "key-file is required"),
            (
                "name=a,key-file=/k,priority=high",
                "priority must be an integer",
            ),
            (
                "name=a,key-file=/k,requests-per-minute=0",
                "positive integer",
            ),
            ("name=a,key-file=/k,burst=3", "unknown key \"burst\""),
            ("name=a,key-file", "not key=value"),
            (
                "name=a,key-file=/k,priority=1,priority=2",
                "priority is given twice",
            ),
        ] {
            let err = Tenant::parse(flag).unwrap_err();
            assert!(err.contains(says), "{flag}: {err}");
        }
        // The default tenant needs no keys of its own.
        assert!(Tenant::parse("name=default,requests-per-minute=5").is_ok());
    }

    #[test]
    fn the_default_tenant_comes_first_and_names_are_unique() {
        let a = Tenant::parse("name=a,key-file=/k").unwrap();
        let d = Tenant::parse("name=default,priority=-5").unwrap();
        let t = Tenants::new(vec![a.clone(), d]).unwrap();
        assert_eq!(t.get(0).priority, -5);
        assert_eq!(t.id("a"), Some(1));
        assert_eq!(&*t.get(99).name, DEFAULT_TENANT);
        assert!(Tenants::new(vec![a.clone(), a]).is_err());
        let plain = Tenant::parse("name=default").unwrap();
        assert!(Tenants::new(vec![plain.clone(), plain]).is_err());
    }
}

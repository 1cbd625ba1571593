//! The `--resource NAME=COUNT:ENV` flag and what follows from it: device IDs and socket names.

use std::collections::HashSet;
use std::str::FromStr;

use crate::Error;

/// Most devices one `--resource` may advertise.
pub const MAX_COUNT: u32 = 1024;

/// One fake resource: `--resource NAME=COUNT:ENV`.
///
/// NAME must be an extended resource name as the kubelet checks it on registration
/// (`IsExtendedResourceName`): `DOMAIN/NAME`, where DOMAIN is a lowercase DNS subdomain outside
/// `kubernetes.io`, and NAME is 1 to 63 characters of `[A-Za-z0-9._-]` that start and end
/// alphanumeric (the name part of a Kubernetes qualified name). COUNT is 1 to [`MAX_COUNT`].
/// ENV is the environment variable `Allocate` sets in the container: non-empty, printable ASCII
/// without `=` or spaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResourceSpec {
    /// Extended resource name, e.g. `nvidia.com/gpu`.
    pub name: String,
    /// Number of fake devices.
    pub count: u32,
    /// Environment variable listing the allocated device IDs.
    pub env: String,
}

impl ResourceSpec {
    /// The IDs of this resource's devices: see [`device_ids`].
    pub fn device_ids(&self) -> Vec<String> {
        device_ids(&self.name, self.count)
    }

    /// The file name of this resource's plugin socket: `hearth-<name>.sock` with the `/` of the
    /// name replaced by `_`, e.g. `hearth-nvidia.com_gpu.sock`. Distinct for distinct valid
    /// names, as a valid domain never contains `_` (anything outside `[A-Za-z0-9._-]` becomes
    /// `_`, but a valid name has nothing else).
    pub fn socket_file_name(&self) -> String {
        let sanitized: String = self
            .name
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        format!("hearth-{sanitized}.sock")
    }
}

/// The device IDs of resource `name` with `count` devices: the last `/`-separated segment of the
/// name, lowercased, then `-` and the index from 0. So `nvidia.com/gpu` has `gpu-0`, `gpu-1`, …;
/// `huawei.com/Ascend910` has `ascend910-0`, …; `hearth.dev/fake-gpu` has `fake-gpu-0`, ….
/// The IDs are stable (the same flags give the same IDs after a restart, which the kubelet's
/// checkpoint of allocated devices relies on) and distinct within the resource.
pub fn device_ids(name: &str, count: u32) -> Vec<String> {
    let segment = name.rsplit('/').next().unwrap_or(name).to_ascii_lowercase();
    (0..count).map(|i| format!("{segment}-{i}")).collect()
}

/// Fails with [`Error::DuplicateResource`] if two specs name the same resource.
pub fn check_unique(specs: &[ResourceSpec]) -> Result<(), Error> {
    let mut seen = HashSet::new();
    for spec in specs {
        if !seen.insert(spec.name.as_str()) {
            return Err(Error::DuplicateResource(spec.name.clone()));
        }
    }
    Ok(())
}

impl FromStr for ResourceSpec {
    type Err = Error;

    fn from_str(value: &str) -> Result<Self, Error> {
        let invalid = |reason: String| Error::InvalidResource {
            value: value.to_owned(),
            reason,
        };
        let (name, rest) = value
            .split_once('=')
            .ok_or_else(|| invalid("no '=' after the resource name".into()))?;
        let (count, env) = rest.split_once(':').ok_or_else(|| {
            invalid("no ':' between the count and the environment variable".into())
        })?;
        check_resource_name(name).map_err(|reason| {
            invalid(format!(
                "{name:?} is not an extended resource name: {reason}"
            ))
        })?;
        let count: u32 = count.parse().map_err(|_| {
            invalid(format!(
                "count {count:?} is not a whole number from 1 to {MAX_COUNT}"
            ))
        })?;
        if count == 0 || count > MAX_COUNT {
            return Err(invalid(format!(
                "count {count} is not from 1 to {MAX_COUNT}"
            )));
        }
        if env.is_empty() {
            return Err(invalid("the environment variable name is empty".into()));
        }
        if let Some(c) = env.chars().find(|c| !c.is_ascii_graphic() || *c == '=') {
            return Err(invalid(format!(
                "environment variable name {env:?} contains {c:?}; use printable ASCII without \
                 '=' or spaces"
            )));
        }
        Ok(Self {
            name: name.to_owned(),
            count,
            env: env.to_owned(),
        })
    }
}

/// The longest name part of a qualified name.
const NAME_MAX: usize = 63;
/// The longest DNS subdomain.
const SUBDOMAIN_MAX: usize = 253;
/// What the kubelet prepends before checking the name as a qualified name (the quota name).
const REQUESTS_PREFIX: &str = "requests.";

/// The kubelet's `IsExtendedResourceName`: not native (has a `/`, not in `kubernetes.io/`), not
/// `requests.`-prefixed, and `requests.<name>` is a qualified name (`DOMAIN/NAME`).
fn check_resource_name(name: &str) -> Result<(), String> {
    let Some((domain, short)) = name.split_once('/') else {
        return Err("it needs a domain, as in example.com/gpu".into());
    };
    if short.contains('/') {
        return Err("it has more than one '/'".into());
    }
    if name.contains("kubernetes.io/") {
        return Err("names in kubernetes.io are native resources, not extended ones".into());
    }
    if name.starts_with(REQUESTS_PREFIX) {
        return Err(format!(
            "names starting with {REQUESTS_PREFIX:?} are reserved for quota"
        ));
    }
    if domain.is_empty() {
        return Err("the domain before '/' is empty".into());
    }
    if REQUESTS_PREFIX.len() + domain.len() > SUBDOMAIN_MAX {
        return Err(format!(
            "the domain is longer than {} characters",
            SUBDOMAIN_MAX - REQUESTS_PREFIX.len()
        ));
    }
    if !domain.split('.').all(is_dns_label) {
        return Err(format!(
            "domain {domain:?} is not a DNS subdomain (lowercase letters, digits, '-' and '.', \
             each dot-separated part starting and ending with a letter or digit)"
        ));
    }
    if short.is_empty() {
        return Err("the name after '/' is empty".into());
    }
    if short.len() > NAME_MAX {
        return Err(format!(
            "the name after '/' is longer than {NAME_MAX} characters"
        ));
    }
    let edge_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !edge_ok(short.chars().next())
        || !edge_ok(short.chars().next_back())
        || !short
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err(format!(
            "name {short:?} after '/' must be letters, digits, '-', '_' and '.', starting and \
             ending with a letter or digit"
        ));
    }
    Ok(())
}

/// A DNS-1123 label as Kubernetes checks it in a subdomain: `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn is_dns_label(label: &str) -> bool {
    let b = label.as_bytes();
    let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    match (b.first(), b.last()) {
        (Some(first), Some(last)) => {
            alnum(first) && alnum(last) && b.iter().all(|c| alnum(c) || *c == b'-')
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use rstest::rstest;

    use super::*;

    #[rstest]
    #[case(
        "nvidia.com/gpu=2:NVIDIA_VISIBLE_DEVICES",
        "nvidia.com/gpu",
        2,
        "NVIDIA_VISIBLE_DEVICES"
    )]
    #[case(
        "huawei.com/Ascend910=8:ASCEND_VISIBLE_DEVICES",
        "huawei.com/Ascend910",
        8,
        "ASCEND_VISIBLE_DEVICES"
    )]
    #[case(
        "hearth.dev/fake-gpu=4:HEARTH_VISIBLE_DEVICES",
        "hearth.dev/fake-gpu",
        4,
        "HEARTH_VISIBLE_DEVICES"
    )]
    #[case("a.b-c.example/x_y.z=1:e", "a.b-c.example/x_y.z", 1, "e")]
    #[case("example.com/gpu=1024:V", "example.com/gpu", 1024, "V")]
    #[case("example.com/GPU=3:A:B", "example.com/GPU", 3, "A:B")]
    fn parses_good_resources(
        #[case] value: &str,
        #[case] name: &str,
        #[case] count: u32,
        #[case] env: &str,
    ) {
        let spec: ResourceSpec = value.parse().unwrap();
        assert_eq!(
            spec,
            ResourceSpec {
                name: name.into(),
                count,
                env: env.into()
            }
        );
    }

    #[rstest]
    #[case::no_equals("nvidia.com/gpu", "no '='")]
    #[case::no_colon("nvidia.com/gpu=2", "no ':'")]
    #[case::no_domain("gpu=2:ENV", "needs a domain")]
    #[case::native("kubernetes.io/gpu=2:ENV", "native")]
    #[case::native_subdomain("foo.kubernetes.io/gpu=2:ENV", "native")]
    #[case::quota("requests.example.com/gpu=2:ENV", "reserved for quota")]
    #[case::two_slashes("example.com/a/b=2:ENV", "more than one '/'")]
    #[case::empty_domain("/gpu=2:ENV", "domain before '/' is empty")]
    #[case::upper_domain("Example.com/gpu=2:ENV", "not a DNS subdomain")]
    #[case::bad_label("example..com/gpu=2:ENV", "not a DNS subdomain")]
    #[case::dash_label("-example.com/gpu=2:ENV", "not a DNS subdomain")]
    #[case::empty_name("example.com/=2:ENV", "name after '/' is empty")]
    #[case::name_edge("example.com/gpu-=2:ENV", "starting and ending")]
    #[case::name_char("example.com/g@pu=2:ENV", "starting and ending")]
    #[case::long_name(
        "example.com/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa=2:ENV",
        "longer than 63"
    )]
    #[case::zero("nvidia.com/gpu=0:ENV", "count 0 is not from 1 to 1024")]
    #[case::too_many("nvidia.com/gpu=1025:ENV", "not from 1 to 1024")]
    #[case::not_a_number("nvidia.com/gpu=two:ENV", "count \"two\" is not a whole number")]
    #[case::negative("nvidia.com/gpu=-1:ENV", "not a whole number")]
    #[case::empty_count("nvidia.com/gpu=:ENV", "not a whole number")]
    #[case::empty_env("nvidia.com/gpu=2:", "environment variable name is empty")]
    #[case::env_space("nvidia.com/gpu=2:MY VAR", "contains ' '")]
    #[case::env_equals("nvidia.com/gpu=2:A=B", "contains '='")]
    fn rejects_bad_resources(#[case] value: &str, #[case] reason: &str) {
        let err = value.parse::<ResourceSpec>().unwrap_err().to_string();
        assert!(err.contains(reason), "{err:?} should say {reason:?}");
        assert!(
            err.starts_with(&format!("invalid --resource {value:?}")),
            "{err:?} should name --resource and the value"
        );
        assert!(
            err.contains("expected --resource NAME=COUNT:ENV, e.g. --resource nvidia.com/gpu=2:"),
            "{err:?} should show the expected form"
        );
    }

    #[test]
    fn rejects_duplicate_resources() {
        let specs: Vec<ResourceSpec> = ["a.io/x=1:A", "b.io/x=1:B", "a.io/x=2:C"]
            .iter()
            .map(|v| v.parse().unwrap())
            .collect();
        let err = check_unique(&specs).unwrap_err().to_string();
        assert_eq!(
            err,
            "--resource a.io/x is given more than once; give each resource once, with its total count"
        );
        check_unique(&specs[..2]).unwrap();
    }

    #[rstest]
    #[case("nvidia.com/gpu", 2, &["gpu-0", "gpu-1"])]
    #[case("huawei.com/Ascend910", 3, &["ascend910-0", "ascend910-1", "ascend910-2"])]
    #[case("hearth.dev/fake-gpu", 1, &["fake-gpu-0"])]
    fn device_ids_are_derived_from_the_name(
        #[case] name: &str,
        #[case] count: u32,
        #[case] want: &[&str],
    ) {
        assert_eq!(device_ids(name, count), want);
    }

    #[test]
    fn device_ids_are_distinct_and_stable() {
        let ids = device_ids("example.com/tpu", 1024);
        let distinct: HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), 1024);
        assert_eq!(ids, device_ids("example.com/tpu", 1024));
    }

    #[rstest]
    #[case("nvidia.com/gpu", "hearth-nvidia.com_gpu.sock")]
    #[case("huawei.com/Ascend910", "hearth-huawei.com_Ascend910.sock")]
    fn socket_file_names(#[case] name: &str, #[case] want: &str) {
        let spec = ResourceSpec {
            name: name.into(),
            count: 1,
            env: "E".into(),
        };
        assert_eq!(spec.socket_file_name(), want);
    }
}

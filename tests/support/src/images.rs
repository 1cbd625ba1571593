//! Hearth's own images as the local cluster's node pulls them: what `build/push` pushed to the
//! cluster's registry (`tests/cluster/push-images`, which `tests/run-tests` and
//! `tests/cluster/install-hearth` run), recorded in `<state dir>/registry/pushed.tsv`.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

/// `charts/hearth` of this checkout.
pub(crate) fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../charts/hearth")
}

/// One image `build/push` pushed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushedImage {
    /// The archive's name: `hearth-gateway`, `hearth-webhook`, `hearth-controller`, `vllm-stub`.
    pub name: String,
    /// `<registry>/<repository>:<tag>`.
    pub reference: String,
    /// `sha256:<64 hex>`, the pushed manifest's digest.
    pub digest: String,
}

impl PushedImage {
    /// `<reference>@<digest>`: the image the chart pins, whatever a tag names later.
    pub fn pinned(&self) -> String {
        format!("{}@{}", self.reference, self.digest)
    }
}

/// The lines of a `pushed.tsv` (name, reference, digest, tab-separated); errors name the line.
pub fn parse_pushed(text: &str) -> Result<Vec<PushedImage>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| match l.split('\t').collect::<Vec<_>>()[..] {
            [name, reference, digest] if digest.starts_with("sha256:") => Ok(PushedImage {
                name: name.to_owned(),
                reference: reference.to_owned(),
                digest: digest.to_owned(),
            }),
            _ => bail!("not a line of name, reference and sha256 digest: {l:?}"),
        })
        .collect()
}

/// What `tests/cluster/push-images` pushed last to the cluster's registry
/// (`<state dir>/registry/pushed.tsv`); the error says how to make it.
pub fn pushed_images() -> Result<Vec<PushedImage>> {
    let path = crate::state_dir().join("registry/pushed.tsv");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {} (tests/cluster/push-images pushes build/images' archives to the cluster's registry and writes it)",
            path.display()
        )
    })?;
    parse_pushed(&text).with_context(|| format!("in {}", path.display()))
}

/// One of Hearth's images (`hearth-gateway`, `hearth-webhook`, `hearth-controller`, or the
/// stub's `vllm-stub`) as pushed to the cluster's registry, pinned by digest
/// (`<registry>/<repository>:<tag>@sha256:…`): pods that name it run that build, pulled by the
/// node. Errors when it was not pushed.
pub fn hearth_image(name: &str) -> Result<String> {
    pushed_images()?
        .into_iter()
        .find(|i| i.name == name)
        .map(|i| i.pinned())
        .with_context(|| format!("build/push pushed no {name} (tests/cluster/push-images)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pushed_lines_parse_and_pin() {
        let d = format!("sha256:{}", "a".repeat(64));
        let text = format!("hearth-gateway\tr:5000/hearth-rs/hearth-gateway:v1\t{d}\n\n");
        let images = parse_pushed(&text).unwrap();
        assert_eq!(images.len(), 1);
        assert_eq!(
            images[0].pinned(),
            format!("r:5000/hearth-rs/hearth-gateway:v1@{d}")
        );
        assert!(parse_pushed("hearth-gateway\tr/x:1\n").is_err());
        assert!(parse_pushed("hearth-gateway\tr/x:1\tmd5:00\n").is_err());
    }
}

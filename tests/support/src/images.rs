//! References of Hearth's own images as `build/images` builds them and the chart names them:
//! `<image.registry>/<name>:v<appVersion>` from `charts/hearth` (values.yaml, Chart.yaml).
//! `tests/cluster/up` imports them into the real node, so pods that use them run for real.

use std::path::PathBuf;

use anyhow::{Context, Result};

/// `charts/hearth` of this checkout.
pub(crate) fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../charts/hearth")
}

fn read_yaml(file: &str) -> Result<serde_yaml::Value> {
    let path = chart_dir().join(file);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_yaml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// The reference of one of Hearth's images (`hearth-gateway`, `hearth-webhook`,
/// `hearth-controller`) with the chart's default registry and tag; errors name the chart file
/// that lacks `image.registry` or `appVersion`.
pub fn hearth_image(name: &str) -> Result<String> {
    let values = read_yaml("values.yaml")?;
    let registry = values["image"]["registry"]
        .as_str()
        .context("charts/hearth/values.yaml has no image.registry")?;
    let chart = read_yaml("Chart.yaml")?;
    let version = chart["appVersion"]
        .as_str()
        .context("charts/hearth/Chart.yaml has no appVersion")?;
    Ok(format!("{registry}/{name}:v{version}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn gateway_image_follows_the_chart() {
        let image = super::hearth_image("hearth-gateway").unwrap();
        assert!(
            image.contains("/hearth-gateway:v"),
            "unexpected reference {image}"
        );
    }
}

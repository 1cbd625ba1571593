//! `/`-separated paths compared by what they name: the one home of dot-segment removal for the
//! webhook (a hostPath reaching the node's `/dev`) and the gateway (an admin path in disguise
//! on its client port).

/// The segments of `path` with empty and `.` segments dropped and `..` resolved (RFC 3986's
/// `remove_dot_segments`; a `..` above the root is dropped): `/a//b/./c/../d` → `[a, b, d]`.
pub fn segments(path: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                out.pop();
            }
            s => out.push(s),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::segments;

    #[test]
    fn dot_segments_and_repeated_slashes_go() {
        for (path, want) in [
            ("/a//b/./c/../d", &["a", "b", "d"][..]),
            ("/../../dev", &["dev"][..]),
            ("/", &[][..]),
            ("metrics/", &["metrics"][..]),
        ] {
            assert_eq!(segments(path), want, "{path}");
        }
    }
}

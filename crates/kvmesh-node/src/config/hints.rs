//! What to write instead, for the config mistakes whose TOML or serde message only says what
//! was found: a misspelt key, `[replicas]` for `[[replicas]]`, `peers` in the wrong shape, an
//! address without its port.

/// A hint (a line to append, starting with a newline) for `e`, raised while reading `text`;
/// empty when there is nothing to add.
pub(super) fn hint(e: &toml::de::Error, text: &str) -> String {
    let message = e.message();
    // The line the error points at, which names the key for type errors.
    let line = e
        .span()
        .and_then(|s| text.get(..s.start.min(text.len())))
        .map(|before| before.rfind('\n').map_or(0, |i| i + 1))
        .and_then(|start| text[start..].lines().next())
        .unwrap_or("")
        .trim();
    let hint = if let Some(near) = misspelt(message) {
        format!("did you mean `{near}`?")
    } else if line.starts_with("[replicas") && message.contains("expected a sequence") {
        "each replica is its own table with double brackets: [[replicas]] (then name, http, …)".into()
    } else if line.starts_with("peers") || line.starts_with("[cluster.peers") {
        r#"cluster.peers is a list of "id=host:port" strings, this node included: peers = ["1=10.0.0.1:50051", "2=10.0.0.2:50051", "3=10.0.0.3:50051"]"#.into()
    } else if message.contains("invalid socket address syntax") {
        r#"expected an IP address and a port, e.g. "0.0.0.0:8080" or "[::]:50051""#.into()
    } else {
        return String::new();
    };
    format!("\nhint: {hint}")
}

/// For serde's "unknown field `x`, expected one of `a`, `b`": the expected key closest to `x`,
/// when close enough to be a misspelling (Jaro–Winkler similarity ≥ 0.85).
fn misspelt(message: &str) -> Option<&str> {
    let rest = message.strip_prefix("unknown field `")?;
    let (unknown, expected) = rest.split_once("`, expected ")?;
    expected
        .split('`')
        .skip(1)
        .step_by(2)
        .map(|k| (strsim::jaro_winkler(unknown, k), k))
        .filter(|(score, _)| *score >= 0.85)
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .map(|(_, k)| k)
}

#[cfg(test)]
mod tests {
    use crate::config::NodeConfig;

    fn error(text: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kvmesh.toml");
        std::fs::write(&path, text).unwrap();
        let e = NodeConfig::read(&path).unwrap_err().to_string();
        assert!(!e.contains("\n\n"), "a blank line in {e:?}");
        e.lines().last().unwrap().to_string()
    }

    #[test]
    fn each_common_mistake_says_what_to_write() {
        assert_eq!(error("[autoscaler]\ntarget_utilization = 0.7\n"), "hint: did you mean `target_utilisation`?");
        assert_eq!(error("[node]\npolcy = \"token_load\"\n"), "hint: did you mean `policy`?");
        assert_eq!(
            error("[replicas]\nname = \"a\"\n"),
            "hint: each replica is its own table with double brackets: [[replicas]] (then name, http, …)"
        );
        let peers = r#"hint: cluster.peers is a list of "id=host:port" strings, this node included: peers = ["1=10.0.0.1:50051", "2=10.0.0.2:50051", "3=10.0.0.3:50051"]"#;
        assert_eq!(error("[cluster]\nid = 1\npeers = \"1=a:1,2=b:2\"\n"), peers);
        assert_eq!(error("[cluster]\nid = 1\n[cluster.peers]\n1 = \"a:1\"\n"), peers);
        assert_eq!(
            error("[node]\nhttp = \"127.0.0.1\"\n"),
            r#"hint: expected an IP address and a port, e.g. "0.0.0.0:8080" or "[::]:50051""#
        );
        // Another key's line that mentions peers is not a peers mistake.
        let named = error("[node]\nmodel = 5 # the same on all peers\n");
        assert!(!named.starts_with("hint:"), "{named}");
        // A key far from every known one gets no guess; the message lists them all.
        let far = error("[node]\nzzzz = 1\n");
        assert!(!far.starts_with("hint:") && far.contains("expected one of"), "{far}");
    }
}

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
    // A key's own line is searched for from where the error points (its line, or its table's
    // header for a section read in parts), so another section's key of the same name is not it.
    let after = e.span().and_then(|s| text.get(s.start.min(text.len())..)).unwrap_or(text);
    let hint = if let Some(h) = renamed_duration(message, after) {
        // serde stops at the first: name every other old key too, so one run lists them all.
        let others = old_duration_keys(text);
        if others.len() > 1 {
            format!("{h}\nhint: every duration key from before in this file, as it is now: {}", others.join("; "))
        } else {
            h
        }
    } else if let Some(h) = bare_duration(message, line, after) {
        h
    } else if let Some(near) = misspelt(message) {
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

/// For a duration key from before durations became text (`scrape_interval_ms = 250`, until
/// 2026-12-07): the key it is now, with the value as text (`scrape_interval = "250ms"`).
/// `text` starts where the error points (the key's line, or its table's header).
fn renamed_duration(message: &str, text: &str) -> Option<String> {
    let rest = message.strip_prefix("unknown field `")?;
    let (unknown, expected) = rest.split_once("`, expected ")?;
    let number = |key: &str| value_of(text, key).and_then(|v| v.parse::<f64>().ok());
    if matches!(unknown, "half_life_s" | "sketch_capacity") && expected.contains("`sketch`") {
        // The section's own values, where given; the defaults otherwise.
        let half_life = number("half_life_s").and_then(|s| std::time::Duration::try_from_secs_f64(s).ok());
        let half_life = half_life.map_or("10s".to_string(), super::human);
        let capacity = number("sketch_capacity").map_or(4096, |c| c as u64);
        return Some(format!(
            "[replication]'s sketch settings are a table now: sketch = {{ half_life = \"{half_life}\", capacity = \
             {capacity} }}"
        ));
    }
    let (stem, seconds_per_unit) = old_duration_key(unknown)?;
    if !expected.contains(&format!("`{stem}`")) {
        return None;
    }
    let d = std::time::Duration::try_from_secs_f64(number(unknown)? * seconds_per_unit).ok()?;
    Some(format!("durations are text now: write {stem} = \"{}\" (units: ms, s, m, h, days)", super::human(d)))
}

/// An old duration key's name now and its unit in seconds: `scrape_interval_ms` →
/// (`scrape_interval`, 0.001); `None` for a key without `_ms` or `_s`.
fn old_duration_key(key: &str) -> Option<(&str, f64)> {
    match (key.strip_suffix("_ms"), key.strip_suffix("_s")) {
        (Some(stem), _) => Some((stem, 1e-3)),
        (None, Some(stem)) => Some((stem, 1.0)),
        _ => None,
    }
}

/// `key`'s value as written in the section `text` starts in (its header, or a line of it),
/// without a trailing comment.
fn value_of<'a>(text: &'a str, key: &str) -> Option<&'a str> {
    let mut lines = text.lines();
    let first = lines.next()?;
    std::iter::once(first).chain(lines.take_while(|l| !l.trim_start().starts_with('['))).find_map(|l| {
        let (k, v) = l.split_once('=')?;
        (k.trim() == key).then(|| v.split('#').next().unwrap_or("").trim())
    })
}

/// Every numeric `_ms` / `_s` key of `text` whose section now takes it as a duration without
/// the suffix, rewritten (`[cluster] heartbeat = "100ms"`), section by section; empty when
/// `text` is not TOML.
fn old_duration_keys(text: &str) -> Vec<String> {
    use super::split::keys;
    let Ok(table) = text.parse::<toml::Table>() else { return Vec::new() };
    let sections: [(&str, &[&str]); 6] = [
        ("node", keys::<super::NodeSection>()),
        ("cluster", keys::<super::ClusterSection>()),
        ("limits", keys::<super::LimitsSection>()),
        ("admission", keys::<super::AdmissionSection>()),
        ("autoscaler", keys::<kvmesh_core::autoscale::AutoscaleConfig>()),
        ("replication", keys::<kvmesh_core::replication::ReplicationConfig>()),
    ];
    let mut out = Vec::new();
    for (section, accepted) in sections {
        let Some(toml::Value::Table(t)) = table.get(section) else { continue };
        for (key, value) in t {
            let Some(n) = value.as_float().or_else(|| value.as_integer().map(|i| i as f64)) else { continue };
            let Some((stem, unit)) = old_duration_key(key) else { continue };
            let Ok(d) = std::time::Duration::try_from_secs_f64(n * unit) else { continue };
            if accepted.contains(&stem) {
                out.push(format!("[{section}] {stem} = \"{}\"", super::human(d)));
            } else if section == "replication" && stem == "half_life" {
                out.push(format!("[replication] sketch = {{ half_life = \"{}\" }}", super::human(d)));
            }
        }
    }
    out
}

/// For a number given where a duration is read (`scrape_interval = 250`): the same with a unit.
/// The key is the error's line's, or named at the message's start (a section read in parts,
/// `config::split`, points at its table).
fn bare_duration(message: &str, line: &str, text: &str) -> Option<String> {
    // Text that is not a duration ("2 sek", "500"): the grammar, not a guess.
    if message.contains("invalid value: string") && message.contains("expected a duration")
        || message.contains("is not a duration")
    {
        return Some(
            "a duration is numbers with units, e.g. \"250ms\", \"2s\", \"1m 30s\", \"1h\", \"2days\" (units: us, ms, \
             s, m, h, days; lower case)"
                .into(),
        );
    }
    if !message.contains("expected a duration") {
        return None;
    }
    let named = message.strip_prefix('`').and_then(|m| m.split_once("`: ")).map(|(k, _)| k);
    let (key, value) = match named {
        Some(k) => (k, value_of(text, k)?),
        None => line.split_once('=').map(|(k, v)| (k.trim(), v.split('#').next().unwrap_or("").trim()))?,
    };
    // The likelier unit first: a small number is more often seconds, a large one milliseconds.
    let (first, second) = if value.parse::<f64>().ok()? < 100.0 { ("s", "ms") } else { ("ms", "s") };
    Some(format!("durations are text with a unit: {key} = \"{value}{first}\" or \"{value}{second}\""))
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

//! toml's error, pointed at the key it is about.
//!
//! `[autoscaler]` and `[replication]` are read in two parts (`config::split`), each from the
//! whole table, so toml can only point at the section's header; the message names the key
//! (`` `interval`: invalid type … `` or ``unknown field `cooldown` ``). Here the error is drawn
//! again at that key's line, the way toml draws it.

/// `e` as toml renders it, but at the line of the key its message names when toml pointed at
/// a section header (`[autoscaler]`); toml's own rendering otherwise.
pub(super) fn located(e: &toml::de::Error, text: &str) -> String {
    let own = e.to_string().trim_end().to_string();
    let Some(span) = e.span() else { return own };
    let Some(start) = text.get(..span.start).map(|before| before.rfind('\n').map_or(0, |i| i + 1)) else {
        return own;
    };
    let header = text[start..].lines().next().unwrap_or("");
    if !header.trim_start().starts_with('[') {
        return own;
    }
    let message = e.message();
    let Some(key) = named_key(message) else { return own };
    // The message names the key below the split section (a top-level table), whichever of its
    // headers (`[replication]`, `[replication.sketch]`) toml pointed at.
    let top = table_name(header).split('.').next().unwrap_or("").to_string();
    let Some(line_no) = line_of_key(text, &format!("{top}.{key}")) else { return own };
    let line = text.lines().nth(line_no - 1).unwrap_or("");
    let written = line.split_once('=').map_or(line, |(k, _)| k).trim();
    draw(line_no, &line[..line.len() - line.trim_start().len()], written.len(), line, message)
}

/// The line (1-based) where `text` sets the dotted key `key` (`node.block_size`,
/// `replication.sketch.half_life`): in its section, a sub-table of it, a dotted key or an
/// inline table; `None` when the file does not set it (a default was refused).
pub(super) fn line_of_key(text: &str, key: &str) -> Option<usize> {
    let (section, rest) = key.split_once('.')?;
    let mut prefix: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        if is_header(line) {
            let n = table_name(line);
            prefix =
                if n == section { Some(String::new()) } else { n.strip_prefix(&format!("{section}.")).map(path_of) };
            continue;
        }
        let (Some(prefix), Some((k, _))) = (&prefix, line.split_once('=')) else { continue };
        let full = if prefix.is_empty() { path_of(k) } else { format!("{prefix}.{}", path_of(k)) };
        if full == rest || rest.starts_with(&format!("{full}.")) {
            return Some(i + 1);
        }
    }
    None
}

/// The line (1-based) of `field` in the `[[replicas]]` entry named `replica`, or of its
/// `name = "…"` when the entry does not set `field`.
pub(super) fn line_of_replica(text: &str, replica: &str, field: &str) -> Option<usize> {
    // Each entry's lines: its `name` line and its `field` line, when set.
    let (mut name_at, mut field_at, mut in_replicas) = (None, None, false);
    for (i, line) in text.lines().enumerate() {
        if is_header(line) {
            if name_at.is_some() {
                break;
            }
            in_replicas = line.trim_start().starts_with("[[replicas]]");
            field_at = None;
            continue;
        }
        let Some((k, v)) = line.split_once('=').filter(|_| in_replicas) else { continue };
        let v = v.split('#').next().unwrap_or("").trim().trim_matches(['"', '\'']);
        match path_of(k) {
            k if k == "name" && v == replica => name_at = Some(i + 1),
            k if k == field => field_at = Some(i + 1),
            _ => {}
        }
    }
    name_at.map(|n| field_at.unwrap_or(n))
}

/// The line (1-based) of the `nth` (from 1) `[[replicas]]` entry's `name = "replica"`.
pub(super) fn line_of_name(text: &str, replica: &str, nth: usize) -> Option<usize> {
    let mut in_replicas = false;
    let names = text.lines().enumerate().filter(|(_, line)| {
        if is_header(line) {
            in_replicas = line.trim_start().starts_with("[[replicas]]");
            return false;
        }
        let Some((k, v)) = line.split_once('=').filter(|_| in_replicas) else { return false };
        path_of(k) == "name" && v.split('#').next().unwrap_or("").trim().trim_matches(['"', '\'']) == replica
    });
    names.map(|(i, _)| i + 1).nth(nth.checked_sub(1)?)
}

/// The table a header line names: `[replication.sketch]  # …` → `replication.sketch`.
fn table_name(header: &str) -> String {
    header.split('#').next().unwrap_or("").trim().trim_matches(['[', ']']).trim().to_string()
}

/// A written key path without quotes or spaces: `"sketch" . half_life` → `sketch.half_life`.
fn path_of(written: &str) -> String {
    written.split('.').map(|s| s.trim().trim_matches(['"', '\''])).collect::<Vec<_>>().join(".")
}

/// Whether `line` is a table header (`[name]`, `[[name]]`, a comment after it), not a line of
/// a multi-line array that starts with `[`.
fn is_header(line: &str) -> bool {
    let l = line.split('#').next().unwrap_or("").trim();
    l.starts_with('[') && l.ends_with(']') && !l.contains(['=', ',', '"'])
}

/// The key a split section's message is about: `` `interval`: … `` or ``unknown field `k` ``.
fn named_key(message: &str) -> Option<&str> {
    match message.strip_prefix("unknown field ") {
        Some(rest) => rest.strip_prefix('`').and_then(|r| r.split_once('`')).map(|(k, _)| k),
        None => message.strip_prefix('`').and_then(|r| r.split_once("`: ")).map(|(k, _)| k),
    }
}

/// toml's drawing: the position, the line with its number, carets under `width` characters
/// after the line's `indent` (repeated as it is, so a tab lines up), then the message.
fn draw(line_no: usize, indent: &str, width: usize, line: &str, message: &str) -> String {
    let gutter = " ".repeat(line_no.to_string().len());
    format!(
        "TOML parse error at line {line_no}, column {}\n{gutter} |\n{line_no} | {line}\n{gutter} | {indent}{}\n{message}",
        indent.chars().count() + 1,
        "^".repeat(width.max(1)),
    )
}

#[cfg(test)]
mod tests {
    use super::super::NodeConfig;

    fn error_of(text: &str) -> String {
        NodeConfig::parse(text).unwrap_err().to_string()
    }

    #[test]
    fn a_split_sections_error_points_at_its_key() {
        let text = "[node]\nmodel = \"m\"\n\n[autoscaler]\nenabled = true\n  interval = 30\n";
        assert_eq!(
            error_of(text),
            "TOML parse error at line 6, column 3\n  |\n6 |   interval = 30\n  |   ^^^^^^^^\n`interval`: invalid \
             type: integer `30`, expected a duration as text, like \"250ms\" or \"2s\"\nhint: durations are text with \
             a unit: interval = \"30s\" or \"30ms\""
        );
        // Its line is found in its own section, not another section's key of the same name.
        let text = "[autoscaler]\ninterval = \"1s\"\n[replication]\nenabled = true\ninterval = 5\n";
        assert!(error_of(text).starts_with("TOML parse error at line 5, column 1\n  |\n5 | interval = 5\n"));
        // A dotted key, and a header with a comment.
        let text = "[replication]  # hot prefixes\n\tsketch.half_life = 5\n";
        let e = error_of(text);
        assert!(
            e.starts_with(
                "TOML parse error at line 2, column 2\n  |\n2 | \tsketch.half_life = 5\n  | \t^^^^^^^^^^^^^^^^\n\
                 `sketch.half_life`: "
            ),
            "{e}"
        );
        // The same in a sub-table of its own, and in an inline table.
        let text = "[replication]\nenabled = true\n\n[replication.sketch]\ncapacity = 10\nhalf_life = 5\n";
        assert!(
            error_of(text).starts_with("TOML parse error at line 6, column 1\n  |\n6 | half_life = 5\n  | ^^^^^^^^^\n")
        );
        let text = "[replication]\nsketch = { capacity = 10, half_life = 5 }\n";
        assert!(error_of(text).starts_with("TOML parse error at line 2, column 1\n  |\n2 | sketch = { capacity"));
        // An unknown key.
        let e = error_of("[replication]\nenabled = true\nhalf = 2\n");
        assert!(
            e.starts_with("TOML parse error at line 3, column 1\n  |\n3 | half = 2\n  | ^^^^\nunknown field `half`"),
            "{e}"
        );
    }

    #[test]
    fn a_refused_value_is_found_in_the_file() {
        let text =
            "[node]\nblock_size = 0\n\n[replication]\nenabled = true\n[replication.sketch]\nmax_depth_blocks = 3\n\
                    [[replicas]]\nname = \"a\"\nhttp = \"http://a:8000\"\ncapacity_blocks = 9\n[[replicas]]\nname = \"b\"  # second\n\
                    http = \"http://b:8000\"\ncapacity_blocks = 9\n";
        assert_eq!(super::line_of_key(text, "node.block_size"), Some(2));
        assert_eq!(super::line_of_key(text, "replication.sketch.max_depth_blocks"), Some(7));
        assert_eq!(super::line_of_key(text, "node.hung_after"), None, "a default is in no line");
        assert_eq!(super::line_of_replica(text, "b", "capacity_blocks"), Some(15));
        assert_eq!(super::line_of_replica(text, "b", "engine"), Some(13), "not set: its name's line");
        assert_eq!(super::line_of_replica(text, "a", "capacity_blocks"), Some(11));
        assert_eq!(super::line_of_replica(text, "c", "capacity_blocks"), None);
        let refused = NodeConfig::parse(text).unwrap().validate().unwrap_err();
        assert_eq!(
            (refused.to_string().as_str(), refused.line_in(text)),
            ("node.block_size must be positive", Some(2))
        );
    }

    #[test]
    fn other_errors_keep_tomls_position() {
        // toml already points at the value.
        let e = error_of("[node]\nscrape_interval = 30\n");
        assert!(e.starts_with("TOML parse error at line 2, column 19\n  |\n2 | scrape_interval = 30\n"), "{e}");
        // A key the message names that is not in the section: toml's header position stands.
        let drawn = super::draw(12, "", 3, "abc = 1", "m");
        assert_eq!(drawn, "TOML parse error at line 12, column 1\n   |\n12 | abc = 1\n   | ^^^\nm");
    }
}

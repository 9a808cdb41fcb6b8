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
    let header_line = text[..start].lines().count();
    // The section's lines after its header, up to the next header.
    let body = text[start..].lines().enumerate().skip(1).take_while(|(_, l)| !is_header(l));
    for (offset, line) in body {
        let Some((k, _)) = line.split_once('=') else { continue };
        // `key = …`, `"key" = …`, or a dotted `key.sub = …`.
        let k = k.trim();
        let first = k.split('.').next().unwrap_or(k).trim().trim_matches('"').trim_matches('\'');
        if first == key {
            let indent = &line[..line.len() - line.trim_start().len()];
            return draw(header_line + offset + 1, indent, k.len(), line, message);
        }
    }
    own
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
             a unit: interval = \"30ms\" or \"30s\""
        );
        // Its line is found in its own section, not another section's key of the same name.
        let text = "[autoscaler]\ninterval = \"1s\"\n[replication]\nenabled = true\ninterval = 5\n";
        assert!(error_of(text).starts_with("TOML parse error at line 5, column 1\n  |\n5 | interval = 5\n"));
        // A dotted key, and a header with a comment.
        let text = "[replication]  # hot prefixes\n\tsketch.half_life = 5\n";
        let e = error_of(text);
        assert!(
            e.starts_with(
                "TOML parse error at line 2, column 2\n  |\n2 | \tsketch.half_life = 5\n  | \t^^^^^^^^^^^^^^^^\n"
            ),
            "{e}"
        );
        // An unknown key.
        let e = error_of("[replication]\nenabled = true\nhalf = 2\n");
        assert!(
            e.starts_with("TOML parse error at line 3, column 1\n  |\n3 | half = 2\n  | ^^^^\nunknown field `half`"),
            "{e}"
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

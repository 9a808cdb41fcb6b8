//! Error text for operators: an error with every cause it carries.

/// An error with its causes, `outer: cause: root` (reqwest's own message omits them, e.g.
/// the "connection refused" behind "error sending request").
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = cause.source();
    }
    out
}

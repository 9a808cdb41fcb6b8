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

/// Whether a failed upstream call lost its connection before any response arrived: the peer
/// closed or reset it (an engine killed or restarting, a keep-alive connection it had already
/// dropped), as opposed to a timeout or a refused connection. hyper reports such a close as
/// an incomplete message; the OS as a reset, an abort, a broken pipe or an early EOF.
///
/// The replica answered nothing, so the request can go elsewhere. It may have started
/// computing it; a vLLM engine aborts a request whose client went away
/// (`vllm/entrypoints/openai/api_server.py`, `with_cancellation`), and one that died has
/// nothing to deliver. Envoy's `retry_on: reset` makes the same call.
pub fn lost_before_response(e: &reqwest::Error) -> bool {
    if e.is_timeout() || e.is_connect() || e.is_status() || e.is_body() || e.is_decode() {
        return false;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(cause) = source {
        if let Some(h) = cause.downcast_ref::<hyper::Error>() {
            if h.is_incomplete_message() || h.is_canceled() {
                return true;
            }
        }
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::*;
            if matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof) {
                return true;
            }
        }
        source = cause.source();
    }
    false
}

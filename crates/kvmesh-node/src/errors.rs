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

#[cfg(test)]
mod tests {
    use super::lost_before_response;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    /// A loopback server that reads one request and then does `then` with the connection.
    async fn server(then: &'static [u8], close: bool) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let _ = conn.read(&mut buf).await;
            conn.write_all(then).await.unwrap();
            if close {
                drop(conn);
            } else {
                tokio::time::sleep(Duration::from_secs(30)).await;
            }
        });
        format!("http://{addr}/v1/completions")
    }

    fn client() -> reqwest::Client {
        reqwest::Client::builder().timeout(Duration::from_millis(300)).build().unwrap()
    }

    #[tokio::test]
    async fn only_a_connection_lost_before_any_answer_counts() {
        // Read the request, answer nothing, hang up: retried elsewhere.
        let url = server(b"", true).await;
        let e = client().post(&url).body("{}").send().await.unwrap_err();
        assert!(lost_before_response(&e), "closed unanswered: {e:?}");

        // Refused: the replica is down, which the health checks handle, not a retry here.
        let port = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port();
        let e = client().post(format!("http://127.0.0.1:{port}/")).send().await.unwrap_err();
        assert!(e.is_connect() && !lost_before_response(&e), "refused: {e:?}");

        // No answer within the timeout: it may still be computing, so never sent twice.
        let url = server(b"", false).await;
        let e = client().post(&url).body("{}").send().await.unwrap_err();
        assert!(e.is_timeout() && !lost_before_response(&e), "timed out: {e:?}");

        // An answer that breaks off mid-body has started: the client got a status already.
        let url = server(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789", true).await;
        let answer = client().post(&url).body("{}").send().await.unwrap();
        let e = answer.bytes().await.unwrap_err();
        assert!(!lost_before_response(&e), "broken body: {e:?}");
    }
}

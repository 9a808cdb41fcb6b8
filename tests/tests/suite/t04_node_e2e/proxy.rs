//! The proxy's own threads: it answers while the main runtime is blocked, reads large bodies
//! off its threads, and retries a replica that closes the connection unanswered.

use super::*;

/// One blocking `GET /health` over a raw socket (5 s read timeout); returns the status line.
fn blocking_health(addr: std::net::SocketAddr) -> String {
    use std::io::{BufRead, Write};
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    tcp.write_all(b"GET /health HTTP/1.1\r\nhost: kvmesh\r\nconnection: close\r\n\r\n").unwrap();
    let mut line = String::new();
    let _ = std::io::BufReader::new(tcp).read_line(&mut line);
    line
}

// A current-thread test runtime: the node's main runtime is this test's one thread.
#[tokio::test]
async fn the_proxy_answers_while_the_main_runtime_is_blocked_and_stops_with_the_node() {
    let engines = engines(2, 5.0).await;
    let replicas = engines.iter().enumerate().map(|(i, e)| replica(i, e)).collect();
    let one = kvmesh_node::config::NodeSection { proxy_threads: 1, ..section() };
    let node = kvmesh_node::start(single(one, replicas)).await.unwrap();
    let addr = node.http;
    // Block the main runtime (this thread) until a client on another thread has its answer:
    // only a proxy with a runtime of its own can give one (else the read times out).
    let status = std::thread::spawn(move || blocking_health(addr)).join().unwrap();
    assert!(status.starts_with("HTTP/1.1 "), "no answer from the proxy: {status:?}");
    let client = reqwest::Client::new();
    let (code, replica, body) = complete(&client, &node, "served from the proxy's own runtime").await;
    assert_eq!((code, body["usage"]["completion_tokens"].as_u64()), (200, Some(3)), "{body}");
    assert!(replica == "e0" || replica == "e1", "{replica}");
    eventually("the booking released", || node.shared.core().fleet.bookings().is_empty()).await;
    node.stop().await;
    // The proxy's runtime is gone with its listener: nothing answers on the port.
    assert!(std::net::TcpStream::connect(addr).is_err(), "the HTTP port still accepts after stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_are_read_off_the_proxy_threads_and_routed_like_any_other() {
    let engines = engines(2, 5.0).await;
    let node = node(&engines).await;
    let client = reqwest::Client::new();
    // 20,480 bytes of prompt: past the 16 KiB inline limit. 4 bytes per approximate token:
    // 5,120 tokens, 320 blocks of 16.
    let long = "abcd".repeat(5120);
    let (status, first, body) = complete(&client, &node, &long).await;
    assert_eq!(status, 200, "{body}");
    let held = first.clone();
    eventually("the prompt's blocks announced", || index_blocks(&node, &held) >= 320).await;
    let (status, again, _) = complete(&client, &node, &long).await;
    assert_eq!((status, again.as_str()), (200, first.as_str()), "the repeat goes where the prefix is");
    let chat = client
        .post(format!("http://{}/v1/chat/completions", node.http))
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": long}], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status().as_u16(), 200);
    let bad =
        client.post(format!("http://{}/v1/completions", node.http)).body(format!("{{{long}")).send().await.unwrap();
    assert_eq!(bad.status().as_u16(), 400, "a malformed large body is still the client's error");
    // Newest first: the chat (its rendered conversation: 6 tokens of role markup more, cached
    // nowhere), the repeat (all 320 blocks held), the first.
    let d: Vec<(u32, u32)> =
        node.shared.recent_decisions(3).iter().map(|d| (d.prompt_tokens, d.overlap_blocks)).collect();
    assert_eq!(d, vec![(5126, 0), (5120, 320), (5120, 0)]);
    eventually("bookings released", || node.shared.core().fleet.bookings().is_empty()).await;
    node.stop().await;
}

/// An upstream that reads each POST's head and closes the connection without a word: an
/// engine killed or restarting under a request. GETs get an empty 200. Counts the POSTs.
async fn closes_unanswered() -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let posts = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = posts.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut buf = [0u8; 4096];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                if head.starts_with(b"POST") {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                } else {
                    let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").await;
                }
            });
        }
    });
    (url, posts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_closes_the_connection_unanswered_is_retried_elsewhere() {
    let engines = engines(1, 5.0).await;
    let (dying, posts) = closes_unanswered().await;
    // Scraped from the live engine, so the node takes it for a ready replica.
    let closing = kvmesh_node::config::ReplicaConfig {
        name: "dying".into(),
        http: dying,
        kv_events: None,
        replay: None,
        metrics_url: Some(format!("{}/metrics", engines[0].base_url())),
        ..replica(1, &engines[0])
    };
    let node = kvmesh_node::start(single(section(), vec![replica(0, &engines[0]), closing])).await.unwrap();
    eventually("first scrapes", || node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some()))
        .await;
    let client = reqwest::Client::new();
    for q in 0..6 {
        let (status, replica, body) = complete(&client, &node, &format!("question {q} of six")).await;
        assert_eq!((status, replica.as_str()), (200, "e0"), "question {q}: {body}");
    }
    // Equal replicas take turns, so the closing one was tried about every other request; each
    // of those was answered by e0 instead (a 502 before).
    let tried = posts.load(std::sync::atomic::Ordering::SeqCst);
    assert!(tried >= 2, "the closing replica was never tried");
    eventually("bookings released", || node.shared.core().fleet.bookings().is_empty()).await;
    // One outcome per client request; each attempt on the closing replica counts against it.
    let page = kvmesh_node::metrics_page::render(&node.shared);
    assert!(page.contains("kvmesh_requests_total{outcome=\"ok\"} 6\n"), "{page}");
    assert!(page.contains("kvmesh_requests_total{outcome=\"upstream_error\"} 0\n"), "{page}");
    let charged = format!("kvmesh_replica_requests_total{{replica=\"dying\",outcome=\"upstream_error\"}} {tried}\n");
    assert!(page.contains(&charged), "{page}");
    node.stop().await;
}

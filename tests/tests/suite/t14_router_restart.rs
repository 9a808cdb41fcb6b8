//! A router that restarts while its engines stay warm: the new node asks each replay socket
//! for everything the engine holds as soon as it subscribes (it does not wait for a live
//! message, which a warm engine serving cached prompts may never send), and the live copies
//! of replayed messages it queued meanwhile are not taken for an engine restart.

use crate::common;

use common::publisher::{stored_batch, Publisher};
use common::{blocks, eventually_within, metric};
use kvmesh_node::config::{NodeSection, ReplicaConfig};
use kvmesh_node::Node;
use serde_json::json;
use std::sync::Arc;
use std::time::Duration;

fn last_seq(node: &Node, name: &str) -> Option<u64> {
    node.shared.core().replicas.get(name).and_then(|r| r.stream.lock().last_seq)
}

async fn start(replicas: Vec<ReplicaConfig>) -> Node {
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    kvmesh_node::start(common::single(section, replicas)).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_node_indexes_warm_engines_without_waiting_for_their_events() {
    let mut engines = common::engines(2, 20.0).await;
    let replicas: Vec<ReplicaConfig> = engines.iter().enumerate().map(|(i, e)| common::replica(i, e)).collect();
    let first = start(replicas.clone()).await;
    let client = reqwest::Client::new();
    // Warm both engines: 8 distinct prompts of 6 full blocks each (4 bytes per approximate token).
    for tag in 0..8 {
        let prompt = format!("{tag:03}:").repeat(6 * 16);
        let r = client
            .post(format!("http://{}/v1/completions", first.http))
            .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
    }
    eventually_within("the first node indexed both engines", 10, || blocks(&first, "e0") + blocks(&first, "e1") >= 48)
        .await;
    let held = [blocks(&first, "e0"), blocks(&first, "e1")];
    first.stop().await;

    // A new node, nothing sent: the engines publish nothing, yet their blocks are back.
    let second = start(replicas).await;
    // Within 5 s of its start (the target; eventually_within fails past it).
    eventually_within("the new node indexed what the engines hold", 5, || {
        [blocks(&second, "e0"), blocks(&second, "e1")] == held
    })
    .await;
    // A full replay, not a restart or a clear.
    let resyncs = metric(&second, "kvmesh_resyncs_total");
    assert!(!resyncs.contains("method=\"restart\""), "{resyncs}");
    assert!(!resyncs.contains("method=\"clear\""), "{resyncs}");
    second.stop().await;
    for e in engines.drain(..) {
        e.stop().await;
    }
}

/// One stored block `hash` (a sequence's first), 16 tokens, in a batch stamped `ts`.
fn stored(hash: u64, ts: f64) -> bytes::Bytes {
    let tokens: Vec<u32> = (0..16).map(|t| (hash as u32) * 100 + t).collect();
    stored_batch(&[hash], &tokens, None, ts)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_copies_of_replayed_messages_are_not_a_restart_and_a_real_restart_still_is() {
    let mut publisher = Publisher::start().await;
    // The engine's buffer holds messages 0..5: five blocks.
    let payloads: Vec<bytes::Bytes> = (0..5).map(|s| stored(1000 + s, 1.0 + s as f64)).collect();
    *publisher.buffer.lock().unwrap() = payloads.iter().cloned().enumerate().map(|(s, p)| (s as u64, p)).collect();
    let engine = common::engines(1, 20.0).await.remove(0);
    let replica = publisher.replica(0, &engine);
    let node = start(vec![replica]).await;
    // Replayed at subscribe, before any live message.
    eventually_within("the replay at subscribe", 5, || last_seq(&node, "e0") == Some(4)).await;
    assert_eq!(blocks(&node, "e0"), 5);
    // The subscription reached the publisher before the replay was asked for; give the PUB a
    // moment to have it on its side too.
    tokio::time::sleep(Duration::from_millis(300)).await;
    // What the subscriber queued while the replay ran: copies of 3 and 4, then a new 5.
    publisher.send(3, &payloads[3]).await;
    publisher.send(4, &payloads[4]).await;
    let fifth = stored(1005, 6.0);
    publisher.send(5, &fifth).await;
    eventually_within("message 5 applied", 5, || last_seq(&node, "e0") == Some(5)).await;
    assert_eq!(blocks(&node, "e0"), 6);
    assert!(metric(&node, "kvmesh_event_replay_copies_total").contains("replica=\"e0\"} 2"));
    assert!(!metric(&node, "kvmesh_resyncs_total").contains("method=\"restart\""));

    // The engine restarts: its message 0 is another batch. That is a restart: the old blocks
    // go (the new buffer is empty, so nothing is replayed) and the new one is indexed.
    publisher.buffer.lock().unwrap().clear();
    publisher.send(0, &stored(2000, 10.0)).await;
    eventually_within("the restart seen", 5, || last_seq(&node, "e0") == Some(0)).await;
    assert_eq!(blocks(&node, "e0"), 1);
    let resyncs = metric(&node, "kvmesh_resyncs_total");
    let restarts = resyncs.lines().find(|l| l.contains("method=\"restart\"")).and_then(|l| l.rsplit(' ').next());
    assert_eq!(restarts, Some("1"), "{resyncs}");
    assert!(metric(&node, "kvmesh_event_replay_copies_total").contains("replica=\"e0\"} 2"));
    node.stop().await;
    engine.stop().await;
}

/// A vLLM `/metrics` page of an idle engine whose counters read `prompt` prompt tokens and
/// `generated` generated tokens.
fn vllm_page(prompt: u64, generated: u64) -> String {
    let mut out = String::new();
    for (name, kind, value) in [
        ("vllm:num_requests_running", "gauge", 0),
        ("vllm:num_requests_waiting", "gauge", 0),
        ("vllm:kv_cache_usage_perc", "gauge", 0),
        ("vllm:prompt_tokens_total", "counter", prompt),
        ("vllm:generation_tokens_total", "counter", generated),
        ("vllm:prefix_cache_hits_total", "counter", 0),
    ] {
        out.push_str(&format!("# TYPE {name} {kind}\n{name}{{engine=\"0\",model_name=\"m\"}} {value}.0\n"));
    }
    out
}

/// An HTTP server answering every request with [`vllm_page`] of the counts in `counts`
/// (prompt tokens in the high 32 bits, generated tokens in the low).
async fn metrics_server(counts: Arc<std::sync::atomic::AtomicU64>) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = listener.accept().await {
            let n = counts.load(std::sync::atomic::Ordering::Relaxed);
            let page = vllm_page(n >> 32, n & 0xffff_ffff);
            tokio::spawn(async move {
                let mut request = [0u8; 4096];
                let _ = c.read(&mut request).await;
                let head = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    page.len()
                );
                let _ = c.write_all(head.as_bytes()).await;
                let _ = c.write_all(page.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}/metrics")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_whose_counters_went_back_restarted_and_loses_its_blocks_without_an_event() {
    use std::sync::atomic::{AtomicU64, Ordering};
    let engine = common::engines(1, 20.0).await.remove(0);
    let counts = Arc::new(AtomicU64::new(0));
    let set = |prompt: u64, generated: u64| counts.store(prompt << 32 | generated, Ordering::Relaxed);
    set(1000, 500);
    // Its load from a page the test sets; its events from the engine itself; no replay socket,
    // so a rebuild can only clear.
    let replica = ReplicaConfig {
        replay: None,
        metrics_url: Some(metrics_server(counts.clone()).await),
        ..common::replica(0, &engine)
    };
    let node = start(vec![replica]).await;
    let prompt = "abc:".repeat(4 * 16);
    eventually_within("e0 scraped", 10, || node.shared.core().replicas["e0"].health.lock().engine.is_some()).await;
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    eventually_within("its blocks indexed", 10, || blocks(&node, "e0") >= 4).await;
    let indexed = blocks(&node, "e0");
    // Counters that grow are no restart; nor is a served-token count that falls while the
    // generated count rises (vLLM counts a long prompt's cache hits before its prompt tokens,
    // and a preempted request's hits twice).
    set(2000, 600);
    tokio::time::sleep(Duration::from_millis(300)).await;
    set(1200, 700);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(blocks(&node, "e0"), indexed);
    assert!(!metric(&node, "kvmesh_resyncs_total").contains("method=\"restart\""));
    // The engine restarted (its counters start again) and publishes nothing.
    set(16, 4);
    eventually_within("its blocks dropped", 10, || blocks(&node, "e0") == 0).await;
    let resyncs = metric(&node, "kvmesh_resyncs_total");
    let restarts = resyncs.lines().find(|l| l.contains("method=\"restart\"")).and_then(|l| l.rsplit(' ').next());
    assert_eq!(restarts, Some("1"), "{resyncs}");
    node.stop().await;
    engine.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_buffer_that_wrapped_is_applied_from_its_oldest_message() {
    // A long-running engine: its buffer holds only messages 5..10 of its history.
    let publisher = Publisher::start().await;
    *publisher.buffer.lock().unwrap() = (5..10u64).map(|s| (s, stored(3000 + s, s as f64))).collect();
    let engine = common::engines(1, 20.0).await.remove(0);
    let replica = publisher.replica(0, &engine);
    let node = start(vec![replica]).await;
    eventually_within("what the buffer holds, replayed at subscribe", 5, || last_seq(&node, "e0") == Some(9)).await;
    assert_eq!(blocks(&node, "e0"), 5);
    node.stop().await;
    engine.stop().await;
}

/// The engine-sim's own restarts: one that keeps its cache restarts only its event stream
/// (sequence from 0): the node rebuilds from what the new stream and buffer show; one that
/// drops its cache and then publishes nothing is told by its counters going back, and its
/// blocks leave the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_that_drops_its_cache_and_stays_silent_is_seen_in_its_metrics() {
    let engine = common::engines(1, 20.0).await.remove(0);
    let node = start(vec![common::replica(0, &engine)]).await;
    let client = reqwest::Client::new();
    let send = |prompt: String| {
        let (client, url) = (client.clone(), format!("http://{}/v1/completions", node.http));
        async move {
            let r = client.post(&url).json(&json!({"model": "m", "prompt": prompt, "max_tokens": 2})).send().await;
            assert_eq!(r.unwrap().status().as_u16(), 200);
        }
    };
    send("abc:".repeat(4 * 16)).await;
    eventually_within("4 blocks indexed", 10, || blocks(&node, "e0") == 4).await;
    assert_eq!(engine.cached_blocks(), [4]);

    // Restart keeping the cache: the stream numbers from 0 again; the next store (3 blocks)
    // comes as message 0, which the node takes for a restart, rebuilding from the replay
    // buffer (emptied, then holding that message).
    engine.faults.set(kvmesh_engine_sim::Faults { restart_seq: true, ..Default::default() });
    send("def:".repeat(3 * 16)).await;
    eventually_within("rebuilt from the new stream", 10, || blocks(&node, "e0") == 3).await;
    assert_eq!(engine.cached_blocks(), [7], "the engine kept its cache");

    // Restart dropping the cache, then silence: no event will come. (Once the node has read
    // the counters it will see go back.)
    eventually_within("the counters read", 10, || {
        node.shared.core().replicas["e0"].health.lock().engine_served.is_some_and(|(served, _)| served > 0.0)
    })
    .await;
    engine.faults.set(kvmesh_engine_sim::Faults { restart_engine: true, ..Default::default() });
    eventually_within("the engine restarted", 10, || engine.cached_blocks() == [0]).await;
    eventually_within("its blocks dropped", 10, || blocks(&node, "e0") == 0).await;
    let resyncs = metric(&node, "kvmesh_resyncs_total");
    let restarts = resyncs.lines().find(|l| l.contains("method=\"restart\"")).and_then(|l| l.rsplit(' ').next());
    assert_eq!(restarts, Some("2"), "{resyncs}");
    // It serves, and is indexed, again.
    send("ghi:".repeat(5 * 16)).await;
    eventually_within("the new engine's blocks", 10, || blocks(&node, "e0") == 5).await;
    node.stop().await;
    engine.stop().await;
}

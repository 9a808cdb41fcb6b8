//! Hostile or broken peers degrade only themselves: event streams refused and quarantined, slow
//! clients and body floods cut off, oversized frames cut before allocation, bad pushed events.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_event_stream_is_refused_unparsed_quarantined_and_recovers_while_the_others_serve() {
    use zeromq::{Socket, SocketSend};
    let (good, other) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    // Replica e1's KV events come from this test's publisher, not from its engine.
    let mut publisher = zeromq::PubSocket::new();
    let endpoint = publisher.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let hostile = ReplicaConfig { kv_events: Some(endpoint), replay: None, ..common::replica(1, &other) };
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let mut config = common::single(section, vec![replica(0, &good, true), hostile]);
    config.limits.kv_event_quarantine = std::time::Duration::from_millis(1000);
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("first scrapes", || node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some()))
        .await;
    // Over the 65,536-event budget: the frame guard drops the message at the payload's first
    // bytes, so it never reaches zeromq nor is decoded. Sent until the subscriber has joined
    // (a PUB drops messages before that) and two (`kv_event_bad_messages`' default) have
    // counted.
    let bad = kvmesh_events::encode::encode_nil_batch(1.0, 70_000);
    let mut seq = 0u64;
    eventually("e1 quarantined", || {
        seq += 1;
        let m: Vec<bytes::Bytes> = vec![
            bytes::Bytes::new(),
            bytes::Bytes::copy_from_slice(&seq.to_be_bytes()),
            bytes::Bytes::from(bad.clone()),
        ];
        let _ = futures_block(publisher.send(zeromq::ZmqMessage::try_from(m).unwrap()));
        status(&node, "e1") == ReplicaStatus::BadEvents
    })
    .await;
    let page = metric(&node, "kvmesh_events_rejected_total");
    // Two or more: drops between the quarantine and the disconnect, and dropped replay
    // answers, count under the same label.
    assert!(counted(&page, "replica=\"e1\",reason=\"over_budget\"") >= 2, "{page}");
    assert!(metric(&node, "kvmesh_event_quarantines_total").contains("replica=\"e1\"} 1"));
    // The other replica kept its status and its events apply; requests still route (e1 on
    // load only: it holds no block).
    assert_eq!(status(&node, "e0"), ReplicaStatus::Ready);
    for tag in 2..22 {
        assert_eq!(send(&node, tag, 2).await, 200);
        if blocks(&node, "e0") > 0 {
            break;
        }
    }
    eventually("e0's events applied", || blocks(&node, "e0") > 0).await;
    assert_eq!(blocks(&node, "e1"), 0);
    // The quarantine ends by itself.
    // (The status turns at the quarantine's end; the ingest task clears the mark once it wakes.)
    eventually("e1 out of quarantine, its mark cleared", || {
        status(&node, "e1") != ReplicaStatus::BadEvents
            && node.shared.core().replicas["e1"].stream.lock().bad_events_until.is_none()
    })
    .await;
    node.stop().await;
    good.stop().await;
    other.stop().await;
}

/// A loopback server that runs `serve` on each connection it accepts; returns its address.
async fn fake_server<F, Fut>(serve: F) -> std::net::SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((c, _)) = listener.accept().await {
            tokio::spawn(serve(c));
        }
    });
    addr
}

/// The value of the sample whose labels are exactly `labels` on an OpenMetrics page (0 when absent).
fn counted(page: &str, labels: &str) -> u64 {
    page.lines()
        .find_map(|l| l.split_once(&format!("{{{labels}}} ")).and_then(|(_, v)| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// POSTs `body` to `/v1/completions` over a fresh connection, reading while it writes, and
/// returns the answer's status line and headers (or what went wrong, as text).
async fn raw_post(addr: std::net::SocketAddr, body: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = match tokio::net::TcpStream::connect(addr).await {
        Ok(c) => c,
        Err(e) => return format!("connect: {e}"),
    };
    let (mut rx, mut tx) = c.into_split();
    let mut req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    // A write cut short by the node's answer is expected; the answer is read regardless.
    let writer = tokio::spawn(async move {
        let _ = tx.write_all(&req).await;
        tx
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match rx.read(&mut buf).await {
                Ok(0) => return Err("closed".to_string()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => return Err(format!("read: {e}")),
            }
        }
        Ok(())
    })
    .await;
    writer.abort();
    match read {
        Ok(Ok(())) => String::from_utf8_lossy(&got).into_owned(),
        Ok(Err(e)) => format!("{e} after {} bytes", got.len()),
        Err(_) => format!("no answer within 10 s ({} bytes)", got.len()),
    }
}

/// Runs a future to completion from a synchronous closure (the publisher's send is quick).
fn futures_block<F: std::future::Future>(f: F) -> F::Output {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_and_body_floods_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let e = engine(16, Faults::default()).await;
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let mut config = common::single(section, vec![replica(0, &e, true)]);
    config.limits.http_header_timeout = std::time::Duration::from_millis(200);
    config.limits.http_body_budget_bytes = 1 << 20;
    config.limits.http_max_body_bytes = 1 << 20;
    let node = kvmesh_node::start(config).await.unwrap();
    // Slowloris: headers never finished; the node closes the connection.
    let mut slow = tokio::net::TcpStream::connect(node.http).await.unwrap();
    slow.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n").await.unwrap();
    let mut buf = [0u8; 256];
    let closed = tokio::time::timeout(std::time::Duration::from_secs(5), slow.read(&mut buf)).await;
    assert!(matches!(closed, Ok(Ok(_)) | Ok(Err(_))), "the half-sent request's connection was not closed");
    // A client that declares a 1 MB body and sends one byte holds one byte's worth...
    let mut teaser = tokio::net::TcpStream::connect(node.http).await.unwrap();
    teaser
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000000\r\n\r\n{")
        .await
        .unwrap();
    // ...but one that has sent 600 KiB of a 900 KiB body holds its buffer (600 to 900 KiB of
    // the 1 MiB budget) while the rest trickles in...
    let mut holder = tokio::net::TcpStream::connect(node.http).await.unwrap();
    holder
        .write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 921600\r\n\r\n")
        .await
        .unwrap();
    holder.write_all(&vec![b' '; 600 << 10]).await.unwrap();
    // (Once the node has taken the holder's 600 KiB into the budget: before that, the second
    // body could take the room first and the holder be the one refused.)
    let in_flight = |node: &Node| {
        let page = metric(node, "kvmesh_http_body_bytes_in_flight");
        page.split_whitespace().last().and_then(|v| v.parse::<usize>().ok()).unwrap_or(0)
    };
    eventually_within("the holder's 600 KiB reserved", 30, || in_flight(&node) > 600 << 10).await;
    // ...which leaves no room for a second: 503 with Retry-After. (Sent over raw TCP, reading
    // while writing: the node answers before it has read the whole body, and an HTTP client
    // still writing it may report the reset instead of the answer.)
    let refused = raw_post(node.http, &vec![b' '; 600 << 10]).await;
    assert!(refused.starts_with("HTTP/1.1 503"), "a second large body was admitted beside the first: {refused}");
    assert!(refused.to_ascii_lowercase().contains("\r\nretry-after: 1\r\n"), "{refused}");
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", node.http);
    // Over the per-body cap: 413 from the headers alone, before any byte of the body is sent.
    let mut big = tokio::net::TcpStream::connect(node.http).await.unwrap();
    big.write_all(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 2097152\r\n\r\n")
        .await
        .unwrap();
    let mut answer = [0u8; 12];
    big.read_exact(&mut answer).await.unwrap();
    assert_eq!(&answer, b"HTTP/1.1 413");
    // Each refusal is a client request's final outcome, counted as such.
    eventually("the refusals counted", || requests(&node, "body_too_large") == 1).await;
    assert_eq!(requests(&node, "body_budget"), 1);
    // Once the holder goes, the budget is whole again.
    drop(holder);
    drop(teaser);
    let mut ok = 0;
    for _ in 0..100 {
        let r = client
            .post(&url)
            .json(&json!({"model": "m", "prompt": prompt(1, 2), "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        if r.status() == 200 {
            ok += 1;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert_eq!(ok, 1);
    eventually("every reserved byte released", || in_flight(&node) == 0).await;
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frame_header_declaring_a_petabyte_is_cut_before_zeromq_allocates() {
    use tokio::io::AsyncWriteExt;
    let (good, other) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    // A "publisher" that greets like a ZMTP 3.0 PUB (NULL mechanism, READY), then declares a
    // 2^50-byte frame, on every connection.
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let a = accepted.clone();
    let fake = fake_server(move |mut s| {
        a.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        async move {
            let mut greeting = vec![0u8; 64];
            greeting[0] = 0xff;
            greeting[9] = 0x7f;
            greeting[10] = 3;
            greeting[12..16].copy_from_slice(b"NULL");
            let _ = s.write_all(&greeting).await;
            let mut ready = b"\x05READY\x0bSocket-Type".to_vec();
            ready.extend_from_slice(&3u32.to_be_bytes());
            ready.extend_from_slice(b"PUB");
            let _ = s.write_all(&[0b100, ready.len() as u8]).await;
            let _ = s.write_all(&ready).await;
            let mut header = vec![0b10u8];
            header.extend_from_slice(&(1u64 << 50).to_be_bytes());
            let _ = s.write_all(&header).await;
            tokio::time::sleep(std::time::Duration::from_secs(30)).await;
        }
    })
    .await;
    let endpoint = format!("tcp://{fake}");
    let hostile = ReplicaConfig { kv_events: Some(endpoint), replay: None, ..common::replica(1, &other) };
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let node = kvmesh_node::start(common::single(section, vec![replica(0, &good, true), hostile])).await.unwrap();
    eventually("e1 quarantined after two cut connections", || status(&node, "e1") == ReplicaStatus::BadEvents).await;
    assert!(accepted.load(std::sync::atomic::Ordering::Relaxed) >= 2);
    let page = metric(&node, "kvmesh_events_rejected_total");
    // Two or more: cuts between the quarantine and the disconnect count too.
    assert!(counted(&page, "replica=\"e1\",reason=\"frame_too_large\"") >= 2, "{page}");
    // The node is alive and routes.
    assert_eq!(send(&node, 1, 2).await, 200);
    node.stop().await;
    good.stop().await;
    other.stop().await;
}

/// A stored event of `blocks` blocks from `first` on (block size 16), with `tokens` token ids
/// (16 × `blocks` is the sound count).
fn pushed_store(first: u64, blocks: u64, tokens: usize) -> kvmesh_proto::v1::KvEvent {
    use kvmesh_proto::v1;
    v1::KvEvent {
        event: Some(v1::kv_event::Event::Stored(v1::BlockStored {
            block_hashes: (first..first + blocks).collect(),
            parent_block_hash: None,
            token_ids: (0..tokens as u32).collect(),
            block_size: 16,
            medium: v1::Medium::Gpu.into(),
            lora_name: None,
        })),
    }
}

fn pushed(replica: &str, seq: u64, events: Vec<kvmesh_proto::v1::KvEvent>) -> kvmesh_proto::v1::PublishRequest {
    kvmesh_proto::v1::PublishRequest { replica_id: replica.into(), seq, ts: 1.0, events }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushed_events_apply_and_a_bad_pusher_is_quarantined_alone_then_recovers() {
    use kvmesh_proto::v1::{self, events_client::EventsClient};
    let (good, other) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    // e1's events come by Events.Publish, from this test.
    let pushing = ReplicaConfig { kv_events: None, replay: None, ..common::replica(1, &other) };
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let mut config = common::single(section, vec![replica(0, &good, true), pushing]);
    config.limits.kv_event_max_events = 4;
    config.limits.kv_event_max_elements = 100;
    // Five, not the default two: the count itself is what this test follows.
    config.limits.kv_event_bad_messages = 5;
    // Long enough for the checks made during it on a loaded machine.
    config.limits.kv_event_quarantine = std::time::Duration::from_millis(3000);
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("first scrapes", || node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some()))
        .await;
    let events = EventsClient::new(common::grpc(node.grpc).await);
    let publish = |batches: Vec<v1::PublishRequest>| {
        let mut c = events.clone();
        async move { c.publish(tokio_stream::iter(batches)).await.map(|r| r.into_inner()) }
    };

    let ok = publish(vec![pushed("e1", 0, vec![pushed_store(100, 2, 32)])]).await.unwrap();
    assert_eq!((ok.batches, ok.events_applied, ok.events_rejected), (1, 1, 0));
    assert_eq!(blocks(&node, "e1"), 2);
    let unknown = publish(vec![pushed("nobody", 0, vec![])]).await.unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);

    // One batch over the 4-event budget (refused whole: its loss is a gap, which drops e1's
    // blocks at the next batch), three with impossible stores (2 blocks' hashes, 10 tokens),
    // then a sound store: four bad messages, not yet a quarantine.
    let cleared = || v1::KvEvent { event: Some(v1::kv_event::Event::Cleared(v1::AllBlocksCleared {})) };
    let mut bad = vec![pushed("e1", 1, (0..5).map(|_| cleared()).collect())];
    bad.extend((2..5).map(|seq| pushed("e1", seq, vec![pushed_store(200 + seq * 10, 2, 10)])));
    bad.push(pushed("e1", 5, vec![pushed_store(300, 1, 16)]));
    let four = publish(bad).await.unwrap();
    assert_eq!((four.batches, four.events_applied, four.events_rejected), (5, 1, 8));
    assert_eq!(status(&node, "e1"), ReplicaStatus::Ready);
    assert_eq!(blocks(&node, "e1"), 1);
    // The fifth quarantines e1 and drops its blocks; the next batch is refused.
    let fifth = vec![pushed("e1", 6, vec![pushed_store(400, 2, 10)]), pushed("e1", 7, vec![pushed_store(500, 1, 16)])];
    let refused = publish(fifth).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("quarantined"), "{}", refused.message());
    assert_eq!(status(&node, "e1"), ReplicaStatus::BadEvents);
    assert_eq!(blocks(&node, "e1"), 0, "its blocks dropped");
    let page = metric(&node, "kvmesh_events_rejected_total");
    assert!(page.contains("replica=\"e1\",reason=\"over_budget\"} 1"), "{page}");
    assert!(page.contains("replica=\"e1\",reason=\"token_count_mismatch\"} 4"), "{page}");
    assert!(metric(&node, "kvmesh_event_quarantines_total").contains("replica=\"e1\"} 1"));
    // The other replica did not notice; requests route.
    assert_eq!(status(&node, "e0"), ReplicaStatus::Ready);
    assert_eq!(send(&node, 1, 2).await, 200);

    // The quarantine ends by itself (nothing pushes meanwhile), and pushes apply again.
    eventually("e1 out of quarantine", || status(&node, "e1") != ReplicaStatus::BadEvents).await;
    let again = publish(vec![pushed("e1", 0, vec![pushed_store(600, 3, 48)])]).await.unwrap();
    assert_eq!((again.batches, again.events_applied, again.events_rejected), (1, 1, 0));
    assert_eq!(blocks(&node, "e1"), 3);
    // Over the element budget (7 hashes + 112 token ids > 100): refused whole.
    let big = publish(vec![pushed("e1", 1, vec![pushed_store(700, 7, 112)])]).await.unwrap();
    assert_eq!((big.batches, big.events_applied, big.events_rejected), (1, 0, 1));
    assert!(metric(&node, "kvmesh_events_rejected_total").contains("replica=\"e1\",reason=\"over_budget\"} 2"));
    // A store whose parent this node never saw: e1 missed events, and with no replay socket
    // its blocks are dropped to rebuild from what comes next (the refused batch was a gap too).
    let mut orphan = pushed_store(800, 1, 16);
    if let Some(v1::kv_event::Event::Stored(s)) = orphan.event.as_mut() {
        s.parent_block_hash = Some(9_999);
    }
    publish(vec![pushed("e1", 2, vec![pushed_store(650, 1, 16)]), pushed("e1", 3, vec![orphan])]).await.unwrap();
    assert_eq!(blocks(&node, "e1"), 0);
    assert!(
        metric(&node, "kvmesh_resyncs_total").contains("method=\"unknown_parent\",replica=\"e1\"} 1")
            || metric(&node, "kvmesh_resyncs_total").contains("replica=\"e1\",method=\"unknown_parent\"} 1")
    );
    node.stop().await;
    good.stop().await;
    other.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_calls_beyond_the_per_connection_limit_wait_while_other_connections_are_served() {
    use kvmesh_proto::v1::{self, events_client::EventsClient, router_client::RouterClient};
    use std::time::Duration;
    let e = engine(16, Faults::default()).await;
    let mut config = common::single(common::section(), vec![replica(0, &e, true)]);
    config.limits.grpc_concurrency_per_connection = 1;
    let node = kvmesh_node::start(config).await.unwrap();
    let route = |mut r: RouterClient<tonic::transport::Channel>| async move {
        let req = v1::RouteRequest {
            model: String::new(),
            prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids: (0..64).collect() })),
            max_tokens: Some(4),
            session_key: None,
            lora_name: None,
            expected_output_tokens: None,
            cache_salt: None,
            accept_disaggregated: false,
        };
        tokio::time::timeout(Duration::from_millis(500), r.route(req)).await
    };
    // A publish stream held open takes connection A's one slot.
    let a = common::grpc(node.grpc).await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pushed("e0", 0, vec![])).await.unwrap();
    let mut events = EventsClient::new(a.clone());
    let held = tokio::spawn(async move { events.publish(tokio_stream::wrappers::ReceiverStream::new(rx)).await });
    eventually("the batch applied", || node.shared.core().replicas["e0"].stream.lock().last_seq == Some(0)).await;
    assert!(route(RouterClient::new(a.clone())).await.is_err(), "connection A's second call waits");
    // Connection B is not held up by A.
    let b = common::grpc(node.grpc).await;
    assert!(route(RouterClient::new(b)).await.expect("B answered").is_ok());
    // Once A's stream ends, A is served again.
    drop(tx);
    let summary = held.await.unwrap().unwrap().into_inner();
    assert_eq!(summary.batches, 1);
    assert!(route(RouterClient::new(a)).await.expect("A answered").is_ok());
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_page_over_the_limit_fails_the_scrape_without_being_read_whole() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (good, other) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    // e1's metrics come from this fake: a 200 with no length, then page text without end.
    // The most any one scrape's connection was sent.
    let served = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let s = served.clone();
    let fake = fake_server(move |mut c| {
        let s = s.clone();
        async move {
            let mut req = [0u8; 1024];
            let _ = c.read(&mut req).await;
            let _ = c.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\nconnection: close\r\n\r\n").await;
            let line = b"vllm:num_requests_running{engine=\"0\"} 0\n".repeat(1024);
            let mut sent = 0u64;
            while c.write_all(&line).await.is_ok() {
                sent += line.len() as u64;
                s.fetch_max(sent, std::sync::atomic::Ordering::Relaxed);
            }
        }
    })
    .await;
    let metrics_url = format!("http://{fake}/metrics");
    let hostile = ReplicaConfig { metrics_url: Some(metrics_url), ..replica(1, &other, false) };
    let section =
        NodeSection { scrape_interval: std::time::Duration::from_millis(50), unhealthy_after: 2, ..common::section() };
    let mut config = common::single(section, vec![replica(0, &good, true), hostile]);
    config.limits.metrics_max_page_bytes = 1 << 20;
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("e1 unhealthy from its oversized page", || status(&node, "e1") == ReplicaStatus::Unhealthy).await;
    let error = node.shared.core().replicas["e1"].health.lock().last_error.clone().unwrap_or_default();
    assert!(error.contains("page over limits.metrics_max_page_bytes (1048576 bytes)"), "{error}");
    // Each scrape stopped reading at the limit: no connection took more than the 1 MiB limit
    // plus what socket buffers hold (a few MiB), where the old read took all it could get
    // within the 500 ms scrape timeout.
    assert_eq!(status(&node, "e0"), ReplicaStatus::Ready);
    assert_eq!(send(&node, 1, 2).await, 200);
    node.stop().await;
    let per_scrape = served.load(std::sync::atomic::Ordering::Relaxed);
    assert!(per_scrape < 64 << 20, "{per_scrape} bytes written on one connection");
    good.stop().await;
    other.stop().await;
}

/// Shutdown drains: the node reports not ready at once (`/health` 503 `stopping`) and lets a
/// streamed answer in flight finish (to `data: [DONE]`) before it stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_node_reports_not_ready_and_lets_its_streams_finish() {
    // A fifth of real speed: ~40 decode steps of ~30 ms, over a second of stream.
    let engine = kvmesh_engine_sim::start(kvmesh_engine_sim::EngineSimConfig { speed: 0.2, ..Default::default() })
        .await
        .unwrap();
    let section = NodeSection { shutdown_grace: std::time::Duration::from_millis(20000), ..common::section() };
    let node = kvmesh_node::start(common::single(section, vec![common::replica(0, &engine)])).await.unwrap();
    common::eventually("ready", || kvmesh_node::health::Readiness::of(&node.shared).ready()).await;
    let http = node.http;
    let r = reqwest::Client::new()
        .post(format!("http://{http}/v1/completions"))
        .json(&serde_json::json!({"prompt": "a long answer, please", "max_tokens": 40, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut body = r.bytes_stream();
    let first = tokio_stream::StreamExt::next(&mut body).await.unwrap().unwrap();
    let stopped = tokio::spawn(node.stop());
    let health = reqwest::get(format!("http://{http}/health")).await.unwrap();
    assert_eq!(health.status(), 503);
    assert_eq!(health.json::<serde_json::Value>().await.unwrap()["status"], "stopping");
    let mut text = String::from_utf8(first.to_vec()).unwrap();
    while let Some(chunk) = tokio_stream::StreamExt::next(&mut body).await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
    }
    assert!(text.ends_with("data: [DONE]\n\n"), "the stream finished whole: {text}");
    assert_eq!(text.matches("data: ").count(), 42, "40 tokens, the finish event and [DONE]");
    stopped.await.unwrap();
    engine.stop().await;
}

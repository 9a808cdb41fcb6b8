//! The router node against misbehaving engines, one case each (see `../shared/cases`): event
//! gaps recovered by replay or by clearing (C07), engine restart (C08), silent publisher (C09),
//! block-size mismatch (C04), leaked bookings on client disconnect (C14), partial health for
//! `/v1/models` (C17), overload marks that expire (C18); a hostile event stream quarantined
//! while the others serve; gRPC health that follows `/health`; and the metrics page parses.

use crate::common;

use common::{blocks, eventually, eventually_within, metric};
use kvmesh_core::ReplicaStatus;
use kvmesh_engine_sim::{EngineSim, EngineSimConfig, Faults};
use kvmesh_node::config::{NodeSection, ReplicaConfig};
use kvmesh_node::Node;
use serde_json::json;

async fn engine(block_size: u32, faults: Faults) -> EngineSim {
    kvmesh_engine_sim::start(EngineSimConfig { speed: 5.0, block_size, faults, ..EngineSimConfig::default() })
        .await
        .unwrap()
}

fn replica(i: usize, e: &EngineSim, replay: bool) -> ReplicaConfig {
    ReplicaConfig { replay: replay.then(|| e.replay.clone()), ..common::replica(i, e) }
}

async fn node(replicas: Vec<ReplicaConfig>, tweak: impl FnOnce(&mut NodeSection)) -> Node {
    let mut section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    tweak(&mut section);
    let node = kvmesh_node::start(common::single(section, replicas)).await.unwrap();
    eventually("first scrapes", || node.shared.core().replicas.values().all(|r| r.health.lock().engine.is_some()))
        .await;
    node
}

/// A prompt of exactly `blocks` full 16-token blocks (4 bytes per approximate token) that
/// shares nothing with other `tag`s.
fn prompt(tag: usize, blocks: usize) -> String {
    let unit = format!("{tag:03}:");
    unit.repeat(blocks * 16)
}

async fn send(node: &Node, tag: usize, blocks: usize) -> u16 {
    reqwest::Client::new()
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": prompt(tag, blocks), "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

fn status(node: &Node, name: &str) -> ReplicaStatus {
    let now = node.shared.now();
    let core = node.shared.core();
    core.status(&core.replicas[name], now)
}

/// `kvmesh_requests_total{outcome}`: requests that ended so.
fn requests(node: &Node, outcome: &str) -> u64 {
    let line = format!("kvmesh_requests_total{{outcome=\"{outcome}\"}} ");
    metric(node, "kvmesh_requests_total").lines().find_map(|l| l.strip_prefix(&line)).map_or(0, |v| v.parse().unwrap())
}

/// Five unrelated prompts of exactly 5 full blocks, one at a time: each is one event message
/// (seq 0..4) storing 5 blocks.
async fn five_prompts(node: &Node) {
    for tag in 0..5 {
        assert_eq!(send(node, tag, 5).await, 200);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c07_gaps_are_replayed_when_a_replay_socket_exists() {
    let e = engine(16, Faults { drop_every: 2, ..Faults::default() }).await;
    let node = node(vec![replica(0, &e, true)], |_| {}).await;
    five_prompts(&node).await;
    // Messages 1 and 3 were never published; the next message's gap triggered a replay each
    // time: all 25 blocks held.
    eventually("all blocks", || blocks(&node, "e0") == 25).await;
    assert!(
        metric(&node, "kvmesh_resyncs_total").contains("method=\"replay\""),
        "{}",
        metric(&node, "kvmesh_resyncs_total")
    );
    assert_eq!(status(&node, "e0"), ReplicaStatus::Ready);
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c07_without_replay_a_gap_drops_the_replicas_blocks_and_rebuilds() {
    let e = engine(16, Faults { drop_every: 2, ..Faults::default() }).await;
    let node = node(vec![replica(0, &e, false)], |_| {}).await;
    five_prompts(&node).await;
    // Messages 1 and 3 were dropped: the gaps at 2 and 4 clear, so only message 4's blocks
    // remain.
    eventually("a clear", || metric(&node, "kvmesh_resyncs_total").contains("method=\"clear\"")).await;
    eventually("rebuilt from the last published message", || blocks(&node, "e0") == 5).await;
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c08_a_sequence_restart_drops_the_stale_blocks() {
    let e = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &e, true)], |_| {}).await;
    five_prompts(&node).await;
    eventually("all blocks", || blocks(&node, "e0") == 25).await;
    e.faults.set(Faults { restart_seq: true, ..Faults::default() });
    assert_eq!(send(&node, 9, 3).await, 200);
    eventually("the restart seen", || metric(&node, "kvmesh_resyncs_total").contains("method=\"restart\"")).await;
    // Only the blocks announced since the restart.
    eventually("stale blocks dropped", || blocks(&node, "e0") == 3).await;
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c09_a_silent_publisher_is_reported_and_still_served() {
    let e = engine(16, Faults { drop_events: true, ..Faults::default() }).await;
    let node = node(vec![replica(0, &e, true)], |s| s.events_silent = std::time::Duration::from_millis(300)).await;
    assert_eq!(send(&node, 1, 4).await, 200);
    // Not reported before the event it owes is `events_silent` late.
    assert_ne!(status(&node, "e0"), ReplicaStatus::NoEvents);
    eventually("no_events status", || status(&node, "e0") == ReplicaStatus::NoEvents).await;
    assert_eq!(send(&node, 2, 4).await, 200, "routed on load meanwhile");
    assert_eq!(blocks(&node, "e0"), 0);
    node.stop().await;
    e.stop().await;
}

/// A replica whose KV-event socket never comes up — nothing listens there, or the endpoint is
/// the engine's replay (ROUTER) socket — is `no_events` once `events_silent` passes, its
/// detail saying why, and is still routed on load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kv_event_socket_that_never_comes_up_is_reported_with_why() {
    let (e0, e1) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    let closed = format!("127.0.0.1:{}", common::ports(1)[0]);
    let replicas = vec![
        ReplicaConfig { kv_events: Some(format!("tcp://{closed}")), ..replica(0, &e0, false) },
        ReplicaConfig { kv_events: Some(e1.replay.clone()), ..replica(1, &e1, false) },
    ];
    let node = node(replicas, |s| s.events_silent = std::time::Duration::from_millis(300)).await;
    let detail = |name: &str| {
        let now = node.shared.now();
        let core = node.shared.core();
        let r = &core.replicas[name];
        core.status_detail(r, core.status(r, now), now)
    };
    eventually("both no_events", || {
        status(&node, "e0") == ReplicaStatus::NoEvents && status(&node, "e1") == ReplicaStatus::NoEvents
    })
    .await;
    let (d0, d1) = (detail("e0"), detail("e1"));
    assert!(d0.starts_with("its KV-event socket has not come up for "), "{d0}");
    assert!(d0.contains(&format!("cannot reach {closed}: Connection refused")), "{d0}");
    assert!(d1.contains("the endpoint is a ZMQ socket of another kind than PUB"), "{d1}");
    assert_eq!(send(&node, 1, 4).await, 200, "routed on load meanwhile");
    node.stop().await;
    e0.stop().await;
    e1.stop().await;
}

/// A replica whose first scrape fails (here its metrics URL answers 404) is out of rotation
/// at once, not after `unhealthy_after` scrapes: nothing has said it is up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_never_scraped_well_is_out_after_its_first_failed_scrape() {
    let e = engine(16, Faults::default()).await;
    let r = ReplicaConfig { metrics_url: Some(format!("{}/no-metrics-here", e.base_url())), ..replica(0, &e, true) };
    let section = NodeSection { scrape_interval: std::time::Duration::from_secs(30), ..common::section() };
    let node = kvmesh_node::start(common::single(section, vec![r])).await.unwrap();
    // One scrape in the test's time (the next is 30 s away).
    eventually("unhealthy after one scrape", || status(&node, "e0") == ReplicaStatus::Unhealthy).await;
    assert!(node.shared.core().replicas["e0"].health.lock().engine.is_none());
    node.stop().await;
    e.stop().await;
}

/// The quickstart's shape: a prompt the engine holds whole, answered with 40 tokens. Its
/// output fills two blocks, which vLLM caches and announces (the engine-sim too), so the
/// replica stays `ready` instead of owing an event that never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_filled_by_output_are_announced_so_a_cached_prompt_owes_nothing() {
    let e = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &e, true)], |s| s.events_silent = std::time::Duration::from_millis(300)).await;
    let client = reqwest::Client::new();
    for round in 1..=2 {
        let body = json!({"model": "m", "prompt": prompt(1, 4), "max_tokens": 40});
        let r = client.post(format!("http://{}/v1/completions", node.http)).json(&body).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 200);
        // 4 prompt blocks once, then 2 output blocks per answer (64 + 39 tokens' KV).
        eventually("output blocks indexed", || blocks(&node, "e0") == 4 + 2 * round).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(600)).await;
    assert_eq!(status(&node, "e0"), ReplicaStatus::Ready);
    node.stop().await;
    e.stop().await;
}

/// A replica registered without `capacity_blocks` takes its engine's own figure (vLLM's
/// `vllm:cache_config_info{num_gpu_blocks}`, which the engine-sim serves) from the first
/// scrape, and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_capacity_blocks_takes_its_engines_figure_and_serves() {
    let e = engine(16, Faults::default()).await;
    let node = node(vec![ReplicaConfig { capacity_blocks: 0, ..replica(0, &e, true) }], |_| {}).await;
    let engine_blocks = EngineSimConfig::default().profile.kv_blocks(16);
    // The engine-sim serves a whole vLLM page (600 lines, histograms and all), its blocks in it.
    let page = reqwest::get(format!("{}/metrics", e.base_url())).await.unwrap().text().await.unwrap();
    assert!(page.lines().count() > 500, "{} lines", page.lines().count());
    let read = kvmesh_events::parse_engine_page(&page, 0.0).unwrap();
    assert_eq!((read.kv_blocks, read.kv_block_size), (Some(engine_blocks), Some(16)));
    let capacity = || {
        let core = node.shared.core();
        core.fleet.replica(core.replicas["e0"].id).unwrap().spec.capacity_blocks
    };
    eventually("the engine's capacity", || capacity() == engine_blocks).await;
    eventually("ready", || status(&node, "e0") == ReplicaStatus::Ready).await;
    assert_eq!(send(&node, 1, 4).await, 200);
    assert_eq!(node.shared.core().replicas["e0"].config.capacity_blocks, 0, "the configuration is left as written");
    node.stop().await;
    e.stop().await;
}

/// The same behind an engine of another block size: its KV counted in the node's blocks, and
/// the mismatch reported as with a configured capacity (routed on load only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_without_capacity_blocks_of_another_block_size_counts_its_kv_in_the_nodes_blocks() {
    let e = engine(32, Faults::default()).await;
    let node = node(vec![ReplicaConfig { capacity_blocks: 0, ..replica(0, &e, true) }], |_| {}).await;
    // As many tokens, in 16-token blocks.
    let want = EngineSimConfig::default().profile.kv_blocks(32) * 2;
    eventually("mismatch, with the engine's capacity", || {
        let core = node.shared.core();
        let capacity = core.fleet.replica(core.replicas["e0"].id).unwrap().spec.capacity_blocks;
        drop(core);
        capacity == want && status(&node, "e0") == ReplicaStatus::BlockSizeMismatch
    })
    .await;
    assert_eq!(send(&node, 1, 4).await, 200, "routed, on load");
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c04_a_block_size_mismatch_is_loud() {
    let e = engine(32, Faults::default()).await;
    let node = node(vec![replica(0, &e, true)], |_| {}).await;
    // Before any event: its metrics page (vllm:cache_config_info) says 32.
    eventually("mismatch status from the metrics page", || status(&node, "e0") == ReplicaStatus::BlockSizeMismatch)
        .await;
    let detail = {
        let (core, now) = (node.shared.core(), node.shared.now());
        core.status_detail(&core.replicas["e0"], ReplicaStatus::BlockSizeMismatch, now)
    };
    assert_eq!(
        detail,
        "its engine reports block size 32 (vllm:cache_config_info), this node uses 16: routed on load only"
    );
    assert_eq!(send(&node, 1, 4).await, 200);
    assert!(metric(&node, "kvmesh_events_rejected_total").contains("reason=\"block_size_mismatch\""));
    assert_eq!(send(&node, 2, 4).await, 200, "still routed, on load");
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c14_clients_that_disconnect_leave_no_booking() {
    let e = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &e, true)], |_| {}).await;
    let client = reqwest::Client::new();
    for i in 0..50 {
        let mut r = client
            .post(format!("http://{}/v1/completions", node.http))
            .json(&json!({"model": "m", "prompt": prompt(i, 2), "max_tokens": 20_000, "stream": true}))
            .send()
            .await
            .unwrap();
        // Read the first chunk (the first token), then hang up mid-stream.
        assert!(r.chunk().await.unwrap().is_some());
        drop(r);
    }
    eventually("every booking released", || node.shared.core().fleet.bookings().is_empty()).await;
    assert!(requests(&node, "disconnected") >= 1);
    // The upstream request was dropped too, and the engine aborted it: nothing left running.
    eventually("the engine idle", || {
        node.shared.core().replicas["e0"].health.lock().engine.is_some_and(|m| m.running == 0 && m.waiting == 0)
    })
    .await;
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c17_models_answers_from_a_healthy_replica_and_c18_overload_marks_expire() {
    let (a, b) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    let node = node(vec![replica(0, &a, true), replica(1, &b, true)], |s| {
        s.policy = "round_robin".into();
        s.overload_backoff = std::time::Duration::from_millis(300);
    })
    .await;
    // C18: e0 answers 503; the request moves to e1 and e0 sits out the backoff.
    a.faults.set(Faults { status: Some(503), ..Faults::default() });
    for i in 0..4 {
        assert_eq!(send(&node, i, 1).await, 200);
    }
    a.faults.set(Faults::default());
    assert_eq!(status(&node, "e0"), ReplicaStatus::Overloaded);
    eventually("the mark expires", || status(&node, "e0") == ReplicaStatus::Ready).await;
    // C17: with e0 gone, /v1/models still answers.
    a.stop().await;
    let r = reqwest::get(format!("http://{}/v1/models", node.http)).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    node.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metrics_page_is_valid_openmetrics() {
    let e = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &e, true)], |_| {}).await;
    assert_eq!(send(&node, 1, 2).await, 200);
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    let parsed = openmetrics_parser::openmetrics::parse_openmetrics(&page).unwrap_or_else(|e| panic!("{e}\n{page}"));
    for family in
        ["kvmesh_decisions", "kvmesh_decision_latency_seconds", "kvmesh_replica_status", "kvmesh_events_applied"]
    {
        assert!(parsed.families.contains_key(family), "{family} missing:\n{page}");
    }
    // Outcomes that have not happened yet are series at 0, not missing ones.
    assert!(page.contains("kvmesh_admission_refused_total{outcome=\"queue_full\"} 0\n"), "{page}");
    // The request's blocks came back as a live event batch: its publish-to-applied time is
    // recorded (one host, one clock), under a second.
    let field = |page: &str, name: &str| {
        page.lines().find_map(|l| l.strip_prefix(name)).and_then(|v| v.trim().parse::<f64>().ok()).unwrap_or(0.0)
    };
    let mut page = page;
    for _ in 0..100 {
        if field(&page, "kvmesh_event_lag_seconds_count ") >= 1.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    }
    let (count, sum) = (field(&page, "kvmesh_event_lag_seconds_count "), field(&page, "kvmesh_event_lag_seconds_sum "));
    assert!(count >= 1.0 && (0.0..count).contains(&sum), "lag count {count}, sum {sum} s:\n{page}");
    assert!(page.contains("kvmesh_requests_total{outcome=\"upstream_error\"} 0\n"), "{page}");
    // Per replica: the one request (not streamed) counted, its TTFT and E2E observed once.
    for line in [
        "kvmesh_replica_requests_total{replica=\"e0\",outcome=\"ok\"} 1\n",
        "kvmesh_replica_ttft_seconds_count{replica=\"e0\",streamed=\"false\"} 1\n",
        "kvmesh_replica_e2e_seconds_count{replica=\"e0\"} 1\n",
    ] {
        assert!(page.contains(line), "{line} missing:\n{page}");
    }
    // A scraper asking for the classic text format gets it, its counters typed as counters.
    let classic = reqwest::Client::new()
        .get(format!("http://{}/metrics", node.http))
        .header("accept", "text/plain;version=0.0.4")
        .send()
        .await
        .unwrap();
    assert_eq!(classic.headers()["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    let text = classic.text().await.unwrap();
    let parsed = openmetrics_parser::prometheus::parse_prometheus(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    let kind = |f: &str| parsed.families.get(f).map(|f| f.family_type.clone());
    assert_eq!(kind("kvmesh_requests_total"), Some(openmetrics_parser::PrometheusType::Counter), "{text}");
    assert_eq!(kind("kvmesh_decision_latency_seconds"), Some(openmetrics_parser::PrometheusType::Histogram));
    assert!(!text.contains("# EOF"));
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event() {
    let e = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &e, true)], |_| {}).await;
    let mut r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": prompt(1, 2), "max_tokens": 20_000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(r.chunk().await.unwrap().is_some(), "the first token");
    let die = reqwest::Client::new().post(format!("{}/admin/faults", e.base_url())).json(&json!({"die": true}));
    assert_eq!(die.send().await.unwrap().status().as_u16(), 200);
    // The rest of the stream ends cleanly (no transport error) with an SSE error event.
    let mut rest = Vec::new();
    while let Some(chunk) = r.chunk().await.expect("the stream ends cleanly, not cut") {
        rest.extend_from_slice(&chunk);
    }
    let text = String::from_utf8_lossy(&rest);
    let last = text.trim_end().rsplit("\n\n").next().unwrap();
    let event: serde_json::Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!((&event["error"]["type"], &event["error"]["code"]), (&json!("upstream_error"), &json!(502)));
    assert!(event["error"]["message"].as_str().unwrap().starts_with("replica e0 failed mid-stream: "), "{event}");
    eventually("the booking released", || node.shared.core().fleet.bookings().is_empty()).await;
    assert_eq!(requests(&node, "upstream_error"), 1);
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_that_dies_is_routed_around() {
    let (a, b) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    let node = node(vec![replica(0, &a, true), replica(1, &b, true)], |s| s.policy = "round_robin".into()).await;
    let r = reqwest::Client::new()
        .post(format!("{}/admin/faults", a.base_url()))
        .json(&json!({"die": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    a.stopped().await;
    for i in 0..4 {
        assert_eq!(send(&node, i, 1).await, 200, "request {i}");
    }
    assert_eq!(status(&node, "e0"), ReplicaStatus::Unhealthy);
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
    a.stop().await;
    b.stop().await;
}

/// `grpc.health.v1` statuses of the server (`""`), `kvmesh.v1.Router` and `kvmesh.v1.Admin`.
async fn grpc_health(node: &Node) -> [i32; 3] {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let mut client = HealthClient::new(common::grpc(node.grpc).await);
    let mut out = [0; 3];
    for (i, service) in ["", "kvmesh.v1.Router", "kvmesh.v1.Admin"].into_iter().enumerate() {
        out[i] = client.check(HealthCheckRequest { service: service.into() }).await.unwrap().into_inner().status;
    }
    out
}

/// Waits up to 10 s for [`grpc_health`] to read `want`.
async fn grpc_health_becomes(node: &Node, want: [i32; 3]) {
    let t0 = std::time::Instant::now();
    loop {
        let got = grpc_health(node).await;
        if got == want {
            return;
        }
        assert!(t0.elapsed().as_secs() < 10, "gRPC health {got:?}, want {want:?}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

async fn http_health(node: &Node) -> u16 {
    reqwest::get(format!("http://{}/health", node.http)).await.unwrap().status().as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_health_says_what_http_health_says() {
    use tonic_health::pb::health_check_response::ServingStatus as S;
    let (serving, not_serving) = (S::Serving as i32, S::NotServing as i32);
    let a = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &a, true)], |_| {}).await;
    eventually("e0 ready", || status(&node, "e0") == ReplicaStatus::Ready).await;
    assert_eq!(http_health(&node).await, 200);
    // The follower runs every 500 ms: within a few periods of a change.
    grpc_health_becomes(&node, [serving, serving, serving]).await;
    // The only replica dies: /health turns 503, and so do the server's and Router's gRPC
    // statuses; Admin still answers (it works without replicas).
    let r = reqwest::Client::new()
        .post(format!("{}/admin/faults", a.base_url()))
        .json(&json!({"die": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    a.stopped().await;
    eventually("e0 unhealthy", || status(&node, "e0") == ReplicaStatus::Unhealthy).await;
    assert_eq!(http_health(&node).await, 503);
    grpc_health_becomes(&node, [not_serving, not_serving, serving]).await;
    node.stop().await;
    a.stop().await;
}

mod hostile;
mod requests;

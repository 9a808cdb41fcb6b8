//! Requests the node refuses or survives: one that fits nowhere, output-length hints, a hung
//! engine, a restarted engine, an unknown parent, prompts over the limit.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_that_fits_no_replica_is_refused_not_booked() {
    use kvmesh_proto::v1;
    let a = engine(16, Faults::default()).await;
    // Admission is off (the default): the refusal must not depend on it.
    let node = node(vec![replica(0, &a, true)], |_| {}).await;
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let ask = |max_tokens: u32, prompt: v1::route_request::Prompt| v1::RouteRequest {
        model: String::new(),
        prompt: Some(prompt),
        max_tokens: Some(max_tokens),
        session_key: None,
        lora_name: None,
        expected_output_tokens: None,
        cache_salt: None,
        accept_disaggregated: false,
    };
    let ids = || v1::route_request::Prompt::TokenIds(v1::TokenIds { ids: (0..32).collect() });
    let capacity = node.shared.core().fleet.largest_kv_tokens() / 16;
    for prompt in [ids(), v1::route_request::Prompt::Text("hello".into())] {
        let refused = router.route(ask(u32::MAX, prompt)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
        assert!(
            refused.message().contains(&format!("the largest replica holds {capacity} (capacity_blocks)")),
            "{}",
            refused.message()
        );
    }
    assert!(node.shared.core().fleet.bookings().is_empty(), "nothing booked");
    // At exactly the capacity (the prompt's 2 blocks and the rest as output) it is routed.
    let fits = (capacity as u32 - 2) * 16;
    let routed = router.route(ask(fits, ids())).await.unwrap().into_inner();
    assert_eq!(routed.replica_id, "e0");
    assert_eq!(node.shared.core().fleet.bookings().len(), 1);
    let refused = router.route(ask(fits + 1, ids())).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    node.stop().await;
    a.stop().await;
}

/// A client's output-length hint is booked as the request's decode work, capped by its
/// max_tokens; a malformed hint header is a clear 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_output_length_hint_is_booked_and_a_bad_one_refused() {
    use kvmesh_proto::v1;
    let a = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &a, true)], |_| {}).await;
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let ask = |hint: Option<u32>| v1::RouteRequest {
        prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids: (0..32).collect() })),
        max_tokens: Some(8192),
        expected_output_tokens: hint,
        ..Default::default()
    };
    let booked =
        |node: &Node| node.shared.core().fleet.bookings().loads().iter().map(|l| l.expected_decode_tokens).sum::<u64>();
    router.route(ask(Some(300))).await.unwrap();
    assert_eq!(booked(&node), 300);
    // Without a hint, and nothing learned yet, max_tokens is booked.
    router.route(ask(None)).await.unwrap();
    assert_eq!(booked(&node), 300 + 8192);
    // A hint above max_tokens is capped by it.
    router.route(ask(Some(100_000))).await.unwrap();
    assert_eq!(booked(&node), 300 + 2 * 8192);
    let zero = router.route(ask(Some(0))).await.unwrap_err();
    assert_eq!(zero.code(), tonic::Code::InvalidArgument, "{zero:?}");
    assert_eq!(zero.message(), "expected_output_tokens must be a whole number of tokens from 1 to 4294967295, got 0");
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", node.http))
        .header("x-kvmesh-expected-output-tokens", "lots")
        .json(&json!({"model": "m", "prompt": prompt(1, 1), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body = r.text().await.unwrap();
    assert!(
        body.contains(
            "x-kvmesh-expected-output-tokens must be a whole number of tokens from 1 to 4294967295, got \\\"lots\\\""
        ),
        "{body}"
    );
    assert_eq!(send(&node, 2, 1).await, 200, "the node serves on");
    node.stop().await;
    a.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_whose_metrics_still_answer_is_taken_out_and_its_requests_get_504() {
    let (a, b) = (engine(16, Faults::default()).await, engine(16, Faults::default()).await);
    let node = node(vec![replica(0, &a, true), replica(1, &b, true)], |s| {
        s.policy = "round_robin".into();
        s.hung_after = std::time::Duration::from_millis(1000);
        s.request_timeout = std::time::Duration::from_secs(2);
    })
    .await;
    // Both serve once, so both counters are on the scraped pages.
    for i in 0..2 {
        assert_eq!(send(&node, i, 1).await, 200);
    }
    a.faults.set(Faults { hang: true, ..Faults::default() });
    // Round robin sends one of two requests to e0, which takes it and never answers.
    let client = reqwest::Client::new();
    let two: Vec<_> = (2..4)
        .map(|i| {
            let url = format!("http://{}/v1/completions", node.http);
            let body = json!({"model": "m", "prompt": prompt(i, 1), "max_tokens": 2});
            let c = client.clone();
            tokio::spawn(async move { c.post(url).json(&body).send().await.unwrap() })
        })
        .collect();
    eventually("e0 is hung", || status(&node, "e0") == ReplicaStatus::Unhealthy).await;
    let detail = {
        let core = node.shared.core();
        core.status_detail(&core.replicas["e0"], ReplicaStatus::Unhealthy, node.shared.now())
    };
    assert!(detail.starts_with("hung: its engine served no token for"), "{detail}");
    // Routed around: every new request goes to e1.
    for i in 10..14 {
        assert_eq!(send(&node, i, 1).await, 200, "request {i}");
    }
    // The request already on e0 gets 504 after request_timeout, naming the replica; the
    // other was served by e1.
    let mut answers = Vec::new();
    for t in two {
        answers.push(t.await.unwrap());
    }
    answers.sort_by_key(|r| r.status());
    assert_eq!(answers.iter().map(|r| r.status().as_u16()).collect::<Vec<_>>(), [200, 504]);
    let r = answers.pop().unwrap();
    assert_eq!(r.headers()["x-kvmesh-replica"], "e0");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["type"], "timeout");
    // Its request over, e0 stays out (still hung) until nothing was in flight there for
    // hung_after, then it is tried again.
    assert_eq!(status(&node, "e0"), ReplicaStatus::Unhealthy);
    eventually("e0 tried again", || status(&node, "e0") == ReplicaStatus::Ready).await;
    node.stop().await;
    a.stop().await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_engine_recovers_and_its_events_resume() {
    let first = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &first, true)], |_| {}).await;
    assert_eq!(send(&node, 1, 3).await, 200);
    eventually("blocks", || blocks(&node, "e0") == 3).await;
    // The engine dies: unhealthy once the scrapes fail.
    let (http, kv_events, replay) = (first.http, first.kv_events.clone(), first.replay.clone());
    first.stop().await;
    eventually("unhealthy", || status(&node, "e0") == ReplicaStatus::Unhealthy).await;
    // It comes back on the same addresses, with a fresh cache and its sequence from 0.
    let second =
        kvmesh_engine_sim::start(EngineSimConfig { http, kv_events, replay, speed: 5.0, ..EngineSimConfig::default() })
            .await
            .unwrap();
    eventually("ready again", || status(&node, "e0") == ReplicaStatus::Ready).await;
    assert_eq!(send(&node, 2, 4).await, 200);
    // The SUB reconnected; the sequence went back to 0, so the old engine's blocks were
    // dropped and only the new one's remain.
    eventually("new blocks only", || blocks(&node, "e0") == 4).await;
    node.stop().await;
    second.stop().await;
}

async fn send_text(node: &Node, text: String) -> u16 {
    reqwest::Client::new()
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": text, "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c03_an_unknown_parent_marks_the_replica_and_rebuilds_it() {
    // Without replay, every second message is lost: a conversation's second turn (message 1)
    // never arrives, so its third turn (message 2) chains to a block this node never saw.
    let e = engine(16, Faults { drop_every: 2, ..Faults::default() }).await;
    let node = node(vec![replica(0, &e, false)], |_| {}).await;
    let turn1 = prompt(1, 4);
    let turn2 = format!("{turn1}{}", prompt(2, 2));
    let turn3 = format!("{turn2}{}", prompt(3, 2));
    for text in [turn1, turn2, turn3] {
        assert_eq!(send_text(&node, text).await, 200);
    }
    eventually("the unknown parent counted", || {
        metric(&node, "kvmesh_events_rejected_total").contains("reason=\"unknown_parent\"")
    })
    .await;
    eventually("a rebuild", || metric(&node, "kvmesh_resyncs_total").contains("method=\"unknown_parent\"")).await;
    eventually("in sync again", || status(&node, "e0") == ReplicaStatus::Ready).await;
    // It rebuilds from what the engine announces next (message 3 is lost too; message 4 lands).
    assert_eq!(send(&node, 8, 2).await, 200);
    assert_eq!(send(&node, 9, 3).await, 200);
    eventually("rebuilt", || blocks(&node, "e0") == 3).await;
    node.stop().await;
    e.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_over_the_limit_are_refused_before_any_work() {
    let e = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &e, true)], |s| s.max_prompt_tokens = 64).await;
    // 64 tokens of 4 bytes pass, 65 do not.
    assert_eq!(send_text(&node, "abcd".repeat(64)).await, 200);
    assert_eq!(send_text(&node, "abcd".repeat(65)).await, 413);
    assert_eq!(node.shared.core().fleet.bookings().len(), 0);
    node.stop().await;
    e.stop().await;
}

/// Every replica answering 503 (busy, not dead): the client's 503 says when to come back, and
/// the node stays ready (`/health` 200, `backing_off`), so a readiness probe does not take
/// every router of a busy fleet out of its Service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_fleet_keeps_the_node_ready_and_says_when_to_retry() {
    let a = engine(16, Faults::default()).await;
    let node = node(vec![replica(0, &a, true)], |s| s.overload_backoff = std::time::Duration::from_secs(3)).await;
    a.faults.set(Faults { status: Some(503), ..Faults::default() });
    let r = reqwest::Client::new()
        .post(format!("http://{}/v1/completions", node.http))
        .json(&json!({"model": "m", "prompt": prompt(1, 2), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    assert_eq!(r.headers()["retry-after"], "3");
    assert_eq!(status(&node, "e0"), ReplicaStatus::Overloaded);
    let health = reqwest::get(format!("http://{}/health", node.http)).await.unwrap();
    assert_eq!(health.status().as_u16(), 200);
    let body: serde_json::Value = health.json().await.unwrap();
    assert_eq!(body, json!({"status": "backing_off", "replicas": 1, "routable": 0}));
    node.stop().await;
    a.stop().await;
}

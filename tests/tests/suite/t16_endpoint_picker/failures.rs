//! The endpoint picker when things go wrong: refusals (fail open or closed), body budgets and
//! deadlines, trailers, gateways that go away, broken streams, disaggregated picks.

use super::*;

/// Fail closed answers a request kvmesh refuses with the error itself; fail open lets it go on
/// with no destination (the gateway's fallback places it) and its body unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_fails_closed_or_open_as_configured() {
    let unknown = serde_json::json!({"model": "other", "prompt": "hello", "max_tokens": 2}).to_string().into_bytes();
    for fail_open in [false, true] {
        let (node, engines) = fleet(1, EppSection { fail_open, ..EppSection::default() }).await;
        for body in [unknown.clone(), b"{not json".to_vec()] {
            let mut gw = Gateway::open(&node).await;
            gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
            gw.send(request_body(&body, true)).await;
            let answer = gw.answer_with_metadata().await;
            if fail_open {
                assert_eq!(destination(&answer), (None, None), "no destination");
                assert_eq!(streamed_body(&gw.answer().await), (body.clone(), true));
            } else {
                let Some(Answer::ImmediateResponse(i)) = answer.response else { panic!("{answer:?}") };
                let want = if body == unknown { 404 } else { 400 };
                assert_eq!(i.status.unwrap().code, want);
                let error: serde_json::Value = serde_json::from_slice(&i.body).unwrap();
                assert!(error["error"]["message"].as_str().unwrap().contains(if want == 404 {
                    "other"
                } else {
                    "JSON"
                }));
            }
        }
        assert_eq!(live_bookings(&node), 0);
        node.stop().await;
        engines.into_iter().next().unwrap().stop().await;
    }
}

/// Bodies through the picker share the node's body budget with the proxy: one over
/// `http_max_body_bytes` is a 413, one that does not fit what others hold a 503 with
/// `Retry-After`, one that never completes a 408 after `http_idle_timeout`; each gives its
/// bytes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_held_to_the_nodes_budget_and_deadline() {
    let engines = common::engines(1, 50.0).await;
    let limits = kvmesh_node::config::LimitsSection {
        http_max_body_bytes: 600,
        http_body_budget_bytes: 1000,
        http_idle_timeout: std::time::Duration::from_secs(1),
        ..Default::default()
    };
    let config = NodeConfig { limits, ..common::single(common::section(), vec![common::replica(0, &engines[0])]) };
    let node = kvmesh_node::start(config).await.unwrap();
    let status = |a: Answer| match a {
        Answer::ImmediateResponse(i) => {
            let retry = i
                .headers
                .iter()
                .flat_map(|h| &h.set_headers)
                .filter_map(|o| o.header.as_ref())
                .any(|h| h.key == "retry-after");
            (i.status.unwrap().code, retry)
        }
        other => panic!("not an immediate answer: {other:?}"),
    };
    // A holds 500 bytes of an unfinished body.
    let mut a = Gateway::open(&node).await;
    a.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    a.send(request_body(&[b' '; 500], false)).await;
    eventually("A's bytes held", || node.shared.body_budget.used() == 500).await;
    let mut b = Gateway::open(&node).await;
    b.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    b.send(request_body(&[b' '; 600], false)).await;
    assert_eq!(status(b.answer().await), (503, true), "600 more do not fit the 1000-byte budget");
    let mut c = Gateway::open(&node).await;
    c.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    c.send(request_body(&[b' '; 601], true)).await;
    assert_eq!(status(c.answer().await), (413, false));
    assert_eq!(status(a.answer().await), (408, false), "A's body never completed");
    eventually("every byte given back", || node.shared.body_budget.used() == 0).await;
    node.stop().await;
    engines.into_iter().next().unwrap().stop().await;
}

/// A body Envoy ends with trailers (full duplex's other ending) is picked on the trailers; a
/// large body goes back in chunks of at most 64 KiB, the last not ending the stream (the
/// trailers do), then the trailers are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_body_ended_by_trailers_goes_back_in_64_kib_chunks() {
    let (node, engines) = fleet(1, EppSection::default()).await;
    let prompt = "word ".repeat(40_000);
    let body = serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 2})).unwrap();
    assert!(body.len() > 3 * 64 * 1024);
    let mut gw = Gateway::open(&node).await;
    gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    for part in body.chunks(90_000) {
        gw.send(request_body(part, false)).await;
    }
    gw.send(processing_request::Request::RequestTrailers(Default::default())).await;
    assert_eq!(destination(&gw.answer_with_metadata().await).0, Some(authority(&engines[0])));
    let mut back = Vec::new();
    let mut sizes = Vec::new();
    while back.len() < body.len() {
        let (chunk, eos) = streamed_body(&gw.answer().await);
        assert!(!eos, "the trailers end the stream, not the body");
        sizes.push(chunk.len());
        back.extend(chunk);
    }
    assert_eq!(back, body);
    assert!(sizes.iter().all(|&n| n <= 64 * 1024) && sizes.len() == body.len().div_ceil(64 * 1024), "{sizes:?}");
    assert!(matches!(gw.answer().await, Answer::RequestTrailers(_)));
    assert_eq!(live_bookings(&node), 1);
    drop(gw);
    eventually("released", || live_bookings(&node) == 0).await;
    node.stop().await;
    engines.into_iter().next().unwrap().stop().await;
}

/// A request waiting in the admission queue whose gateway stream is reset gives up its place:
/// counted abandoned, never booked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_that_goes_away_while_its_request_waits_for_capacity_abandons_it() {
    let engines = common::engines(1, 20.0).await;
    // One 480-token request (30 blocks plus its output) fits the 40 blocks at a time.
    let replicas = vec![kvmesh_node::config::ReplicaConfig { capacity_blocks: 40, ..common::replica(0, &engines[0]) }];
    let admission = kvmesh_node::config::AdmissionSection { enabled: true, ..Default::default() };
    let node =
        kvmesh_node::start(NodeConfig { admission, ..common::single(common::section(), replicas) }).await.unwrap();
    eventually("ready", || kvmesh_node::health::Readiness::of(&node.shared).routable == 1).await;
    let send = |i: u32| {
        let body = serde_json::json!({"prompt": format!("{i:04}").repeat(480), "max_tokens": 16});
        serde_json::to_vec(&body).unwrap()
    };
    let mut first = Gateway::open(&node).await;
    first.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    first.send(request_body(&send(1), true)).await;
    assert_eq!(destination(&first.answer_with_metadata().await).0, Some(authority(&engines[0])));
    let second = Gateway::open(&node).await;
    second.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    second.send(request_body(&send(2), true)).await;
    eventually("the second waits", || node.shared.admission.depth() == 1).await;
    drop(second);
    eventually("the wait abandoned", || node.shared.admission.depth() == 0).await;
    assert!(metric(&node, "kvmesh_admission_abandoned").contains("kvmesh_admission_abandoned_total 1"));
    assert_eq!(live_bookings(&node), 1, "only the first is booked");
    drop(first);
    eventually("released", || live_bookings(&node) == 0).await;
    node.stop().await;
    engines.into_iter().next().unwrap().stop().await;
}

/// C14 through the picker: 300 gateway streams that break off at every point — before the
/// body is complete, right after the pick, after the response headers, mid-stream — leave no
/// booking and no token load behind. C16: with every replica gone, a request gets a 503.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c14_c16_streams_broken_anywhere_leave_no_load_and_no_replica_is_a_503() {
    let (node, engines) = fleet(2, EppSection::default()).await;
    let body = completion(true);
    for i in 0..300 {
        let mut gw = Gateway::open(&node).await;
        gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
        if i % 4 == 0 {
            gw.send(request_body(&body[..10], false)).await;
            drop(gw);
            continue;
        }
        gw.send(request_body(&body, true)).await;
        let _ = gw.answer().await;
        let _ = gw.answer().await;
        if i % 4 >= 2 {
            gw.send(response_headers(200, "text/event-stream")).await;
            let _ = gw.answer().await;
        }
        if i % 4 == 3 {
            gw.send(response_body(b"data: {\"choices\":[{\"text\":\" t\"}]}\n\n", false)).await;
            let _ = gw.answer().await;
        }
        drop(gw);
    }
    eventually("every booking released", || live_bookings(&node) == 0).await;
    let page = metric(&node, "kvmesh_replica_queued_prefill_tokens");
    assert!(page.lines().all(|l| l.ends_with(" 0")), "{page}");
    assert!(metric(&node, "kvmesh_requests_total").contains("outcome=\"disconnected\"} 225"));
    assert_eq!(node.shared.body_budget.used(), 0);
    // C16: every replica down.
    for e in engines {
        e.stop().await;
    }
    eventually("no replica routable", || kvmesh_node::health::Readiness::of(&node.shared).routable == 0).await;
    let mut gw = Gateway::open(&node).await;
    gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    gw.send(request_body(&body, true)).await;
    let Answer::ImmediateResponse(i) = gw.answer().await else { panic!("an immediate answer") };
    assert_eq!(i.status.unwrap().code, 503);
    node.stop().await;
}

/// A disaggregated fleet (2 prefill, 2 decode replicas): the gateway is sent to a decode
/// replica, with the prefill replica named in `x-prefiller-host-port` (llm-d's P/D
/// convention for the decode pod's sidecar); both sides are booked, the prefill leg released
/// when the response starts, the decode side at its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disaggregated_request_goes_to_a_decode_replica_naming_its_prefill_replica() {
    use kvmesh_core::Role;
    let engines = common::engines(4, 50.0).await;
    let roles = [Role::Prefill, Role::Prefill, Role::Decode, Role::Decode];
    let replicas = engines
        .iter()
        .enumerate()
        .map(|(i, e)| kvmesh_node::config::ReplicaConfig { role: roles[i], ..common::replica(i, e) });
    let mut section = common::section();
    section.model = "m".into();
    let node = kvmesh_node::start(common::single(section, replicas.collect())).await.unwrap();
    eventually("every replica ready", || kvmesh_node::health::Readiness::of(&node.shared).routable == 4).await;
    let body = completion(false);
    let mut gw = Gateway::open(&node).await;
    gw.send_with(request_headers("/v1/completions", false), Some(FULL_DUPLEX), None).await;
    gw.send(request_body(&body, true)).await;
    let answer = gw.answer_with_metadata().await;
    let (endpoint, meta) = destination(&answer);
    let endpoint = endpoint.expect("a destination");
    assert_eq!(meta.as_deref(), Some(endpoint.as_str()));
    assert!([authority(&engines[2]), authority(&engines[3])].contains(&endpoint), "{endpoint} is a decode replica");
    let Answer::RequestHeaders(h) = answer.response.unwrap() else { panic!() };
    let set = &h.response.as_ref().unwrap().header_mutation.as_ref().unwrap().set_headers;
    let prefill = set.iter().filter_map(|o| o.header.as_ref()).find(|h| h.key == "x-prefiller-host-port").unwrap();
    let prefill = String::from_utf8(prefill.raw_value.clone()).unwrap();
    assert!([authority(&engines[0]), authority(&engines[1])].contains(&prefill), "{prefill} is a prefill replica");
    assert_eq!(streamed_body(&gw.answer().await), (body, true));
    assert_eq!(live_bookings(&node), 2, "both sides booked");
    gw.send(response_headers(200, "application/json")).await;
    assert!(matches!(gw.answer().await, Answer::ResponseHeaders(_)));
    eventually("the prefill leg released at the response's start", || live_bookings(&node) == 1).await;
    let usage = br#"{"choices":[{"text":" t t"}],"usage":{"prompt_tokens":12,"completion_tokens":2}}"#;
    gw.send(response_body(usage, true)).await;
    let _ = gw.answer().await;
    eventually("the decode side released at the end", || live_bookings(&node) == 0).await;
    assert!(metric(&node, "kvmesh_requests_total").contains("kvmesh_requests_total{outcome=\"ok\"} 1"));
    node.stop().await;
    for e in engines {
        e.stop().await;
    }
}

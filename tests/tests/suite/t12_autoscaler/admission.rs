//! Admission control while capacity is short: requests wait, the excess is refused, a TTFT SLO
//! holds requests at the router.

use super::*;

/// A node with admission control (at most 2 waiting) in front of one engine that the router
/// believes holds 40 blocks of KV: one 480-token request (30 blocks plus its output) at a time.
/// Its capacity is set at 200 tokens/s, so `Retry-After` is the backlog's tokens ÷ 200.
/// Bookings not released end after `booking_lease`.
async fn short_node(booking_lease_s: f64) -> (Node, Vec<kvmesh_engine_sim::EngineSim>) {
    use kvmesh_node::config::AdmissionSection;
    let engines = engines(1, 20.0).await;
    let replicas = vec![ReplicaConfig { capacity_blocks: 40, replay: None, ..replica(0, &engines[0]) }];
    let config = NodeConfig {
        // The node believes its engine 100,000× slower than an H100: a booking's 480 prompt
        // tokens stay queued (in its estimate) for ~15 minutes, so Retry-After's backlog is
        // exact here however slow the test machine.
        node: NodeSection {
            booking_lease: std::time::Duration::from_secs_f64(booking_lease_s),
            engine_speed: 1e-5,
            ..section()
        },
        replicas,
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: AutoscalerSection { capacity_tokens_per_s: 200.0, ..Default::default() },
        admission: AdmissionSection {
            enabled: true,
            queue_limit: 2,
            max_wait: std::time::Duration::from_millis(10000),
            ttft_slo: None,
        },
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("the replica ready", || node.shared.core().fleet.replicas().iter().any(|r| r.routable())).await;
    (node, engines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_capacity_is_short_requests_wait_and_the_excess_gets_429() {
    let (node, _engines) = short_node(600.0).await;
    let http = node.http;
    let send = |i: usize| async move {
        let body = serde_json::json!({"model": "m", "prompt": format!("{i:04}").repeat(480), "max_tokens": 16});
        let r = reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send().await.unwrap();
        let retry = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
        let status = r.status().as_u16();
        let body: serde_json::Value = r.json().await.unwrap_or_default();
        if status == 429 {
            // OpenAI clients read the type.
            assert_eq!(body["error"]["type"], "rate_limit_exceeded", "{body}");
        }
        (status, retry)
    };
    let calls: Vec<_> = (0..6).map(|i| tokio::spawn(send(i))).collect();
    let mut results = Vec::new();
    for c in calls {
        results.push(c.await.unwrap());
    }
    let ok = results.iter().filter(|(s, _)| *s == 200).count();
    let refused: Vec<_> = results.iter().filter(|(s, _)| *s == 429).collect();
    // One runs, two wait and run after it, the rest are refused at once with Retry-After.
    assert_eq!((ok, refused.len()), (3, 3), "{results:?}");
    // Retry-After: the backlog at 200 tokens/s — the two waiting (496 tokens each) and the
    // booked one's 480 prompt tokens (queued in the node's estimate): 1,472 / 200 → 8 s; or,
    // if a waiter was already booked in the first one's place, one waiting: 976 / 200 → 5 s.
    assert!(refused.iter().all(|(_, r)| matches!(r.as_deref(), Some("5" | "8"))), "{results:?}");
    // Every admitted request was released; nothing waits.
    assert!(node.shared.core().fleet.bookings().is_empty());
    assert_eq!(node.shared.admission.depth(), 0);
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_requests_total{outcome=\"queue_full\"} 3"), "{page}");
    assert!(page.contains("kvmesh_admission_refused_total{outcome=\"queue_full\"} 3"), "{page}");
    // `kvmesh status` counts them too.
    let list = v1::admin_client::AdminClient::new(common::grpc(node.grpc).await)
        .list_replicas(v1::ListReplicasRequest {})
        .await
        .unwrap();
    let a = list.into_inner().admission.unwrap();
    assert_eq!((a.waiting, a.waiting_tokens, a.queue_limit, a.ttft_slo_s), (0, 0, 2, 0.0));
    assert_eq!((a.refused_queue_full, a.refused_evicted_late, a.refused_timeout), (3, 0, 0));
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_route_waits_while_capacity_is_short_and_refuses_the_excess_with_resource_exhausted() {
    let (node, _engines) = short_node(600.0).await;
    let ch = common::grpc(node.grpc).await;
    let route = |i: usize| {
        let mut router = v1::router_client::RouterClient::new(ch.clone());
        async move {
            let text = format!("{i:04}").repeat(480);
            let req = v1::RouteRequest {
                model: "m".into(),
                prompt: Some(v1::route_request::Prompt::Text(text)),
                max_tokens: Some(16),
                session_key: None,
                lora_name: None,
                expected_output_tokens: None,
                cache_salt: None,
                accept_disaggregated: false,
            };
            router.route(req).await.map(|r| r.into_inner().booking)
        }
    };
    let release = |booking: String| {
        let mut router = v1::router_client::RouterClient::new(ch.clone());
        async move { router.release(v1::ReleaseRequest { booking, output_tokens: Some(16) }).await.unwrap() }
    };
    // The first is booked at once; the next two wait (nothing booked for them); the fourth
    // finds the queue full.
    let first = route(0).await.unwrap();
    let second = tokio::spawn(route(1));
    eventually("the second waiting", || node.shared.admission.depth() == 1).await;
    let third = tokio::spawn(route(2));
    eventually("the third waiting", || node.shared.admission.depth() == 2).await;
    assert_eq!(node.shared.core().fleet.bookings().len(), 1);
    let refused = route(3).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
    assert!(refused.message().contains("the admission queue is full"), "{}", refused.message());
    // The backlog ahead: the first one's 480 prompt tokens queued on the engine (the node's
    // estimate drains one in ~2 s) and the two waiting (480 + 16 output tokens each): about
    // 1,472 tokens at 200 tokens/s, 7.36 s.
    let after = refused.metadata().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_string);
    assert_eq!(after.as_deref(), Some("8"));
    assert!(refused.message().ends_with("retry after 8 s"), "{}", refused.message());
    // Each release lets the next one go, in turn.
    release(first).await;
    let second = second.await.unwrap().unwrap();
    assert_eq!(node.shared.admission.depth(), 1);
    // A caller that gives up while waiting (its call cancelled) leaves the queue.
    let gone = tokio::spawn(route(4));
    eventually("a fourth waiting", || node.shared.admission.depth() == 2).await;
    gone.abort();
    eventually("the fourth's wait abandoned", || node.shared.admission.depth() == 1).await;
    release(second).await;
    let third = third.await.unwrap().unwrap();
    release(third).await;
    assert!(node.shared.core().fleet.bookings().is_empty());
    assert_eq!(node.shared.admission.depth(), 0);
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_admission_refused_total{outcome=\"queue_full\"} 1"), "{page}");
    // Three waited (one gave up), each observed once; the one refused at once by the full
    // queue never waited.
    assert!(page.contains("kvmesh_admission_wait_seconds_count 3\n"), "{page}");
    assert!(page.contains("kvmesh_admission_abandoned_total 1\n"), "{page}");
    assert_eq!(node.shared.admission.refused_total(), (1, 0, 0));
    // A proxied request whose client gives up while it waits counts as disconnected too.
    let held = route(5).await.unwrap();
    let http = node.http;
    let client = tokio::spawn(async move {
        let body = serde_json::json!({"model": "m", "prompt": "0006".repeat(480), "max_tokens": 16});
        reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send().await
    });
    eventually("the proxied request waiting", || node.shared.admission.depth() == 1).await;
    client.abort();
    eventually("its wait abandoned", || node.shared.admission.depth() == 0).await;
    release(held).await;
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_admission_abandoned_total 2\n"), "{page}");
    assert!(page.contains("kvmesh_requests_total{outcome=\"disconnected\"} 1\n"), "{page}");
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_can_never_fit_is_refused_at_once_not_held() {
    let (node, _engines) = short_node(600.0).await;
    let completions = format!("http://{}/v1/completions", node.http);
    // 480 prompt tokens (30 blocks of 16) and up to 1,000 output tokens (63 blocks), in a
    // replica of 40 blocks. Held, it would wait max_wait (10 s) for room that never comes.
    // Token ids are an exact count: 400 at once.
    let ids: Vec<u32> = (0..480).collect();
    let body = serde_json::json!({"model": "m", "prompt": ids, "max_tokens": 1000});
    let r = reqwest::Client::new().post(&completions).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(
        body["error"]["message"],
        "the prompt (480 tokens) and max_tokens (1000) need 93 KV blocks of 16 tokens; the largest replica holds 40 \
         (capacity_blocks): lower max_tokens or shorten the prompt"
    );
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let req = v1::RouteRequest {
        model: "m".into(),
        prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids })),
        max_tokens: Some(1000),
        session_key: None,
        lora_name: None,
        expected_output_tokens: None,
        cache_salt: None,
        accept_disaggregated: false,
    };
    assert_eq!(router.route(req).await.unwrap_err().code(), tonic::Code::InvalidArgument);
    // Text without a tokenizer is an approximate count: not refused, not held either — sent
    // for the engine to judge (this stand-in serves it).
    let body = serde_json::json!({"model": "m", "prompt": "0000".repeat(480), "max_tokens": 1000});
    let r = reqwest::Client::new().post(&completions).json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    // A body the router cannot read: 400 saying where, and counted.
    let r =
        reqwest::Client::new().post(&completions).body(r#"{"prompt": "hi", "max_tokens": -1}"#).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.starts_with("the body is not a JSON completion request: invalid value: integer `-1`"), "{message}");
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_requests_total{outcome=\"too_long\"} 1\n"), "{page}");
    assert!(page.contains("kvmesh_requests_total{outcome=\"bad_request\"} 1\n"), "{page}");
    assert!(page.contains("kvmesh_admission_wait_seconds_count 0\n"), "{page}");
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_never_released_ends_at_its_lease_and_the_waiting_one_goes() {
    let (node, _engines) = short_node(1.0).await;
    let mut router = v1::router_client::RouterClient::new(common::grpc(node.grpc).await);
    let route = |i: usize| v1::RouteRequest {
        model: "m".into(),
        prompt: Some(v1::route_request::Prompt::Text(format!("{i:04}").repeat(480))),
        max_tokens: Some(16),
        session_key: None,
        lora_name: None,
        expected_output_tokens: None,
        cache_salt: None,
        accept_disaggregated: false,
    };
    // Booked and never released: it fills the replica.
    let forgotten = router.route(route(0)).await.unwrap().into_inner().booking;
    let mut r2 = router.clone();
    let second = tokio::spawn(async move { r2.route(route(1)).await.map(|r| r.into_inner().booking) });
    eventually("the second waiting", || node.shared.admission.depth() == 1).await;
    // The lease (1 s) ends the forgotten booking, and the second is booked in its place.
    let booked = second.await.unwrap().unwrap();
    assert_ne!(booked, forgotten);
    // Released before its own 1 s lease can end it.
    router.release(v1::ReleaseRequest { booking: booked, output_tokens: None }).await.unwrap();
    let page = reqwest::get(format!("http://{}/metrics", node.http)).await.unwrap().text().await.unwrap();
    assert!(page.contains("kvmesh_bookings_expired_total 1\n"), "{page}");
    // Releasing it late is an unknown booking, not an error that hurts anything.
    let late = router.release(v1::ReleaseRequest { booking: forgotten, output_tokens: None }).await;
    assert_eq!(late.unwrap_err().code(), tonic::Code::NotFound);
    assert!(node.shared.core().fleet.bookings().is_empty());
    node.stop().await;
}

/// One engine 20× slower than the H100 profile (a 960-token prompt takes ~0.45 s to its first
/// token), known as such to the node, with admission control and `ttft_slo`.
async fn slow_node(ttft_slo_s: Option<f64>) -> (Node, kvmesh_engine_sim::EngineSim) {
    use kvmesh_node::config::AdmissionSection;
    let engine = kvmesh_engine_sim::start(EngineSimConfig { speed: 0.05, ..EngineSimConfig::default() }).await.unwrap();
    let config = NodeConfig {
        node: NodeSection { engine_speed: 0.05, ..section() },
        replicas: vec![ReplicaConfig { replay: None, ..replica(0, &engine) }],
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: Default::default(),
        admission: AdmissionSection {
            enabled: true,
            ttft_slo: ttft_slo_s.map(std::time::Duration::from_secs_f64),
            ..AdmissionSection::default()
        },
        limits: Default::default(),
        epp: Default::default(),
    };
    let node = kvmesh_node::start(config).await.unwrap();
    eventually("the replica ready", || node.shared.core().fleet.replicas().iter().any(|r| r.routable())).await;
    (node, engine)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_a_ttft_slo_a_request_that_would_queue_past_it_waits_at_the_router() {
    for slo in [Some(0.2), None] {
        let (node, _engine) = slow_node(slo).await;
        let http = node.http;
        let send = |i: usize| {
            tokio::spawn(async move {
                let prompt = format!("{i:04}").repeat(960);
                let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4, "stream": true});
                let r = reqwest::Client::new().post(format!("http://{http}/v1/completions")).json(&body).send();
                let r = r.await.unwrap();
                let status = r.status().as_u16();
                r.bytes().await.unwrap();
                status
            })
        };
        let first = send(0);
        eventually("the first request booked", || node.shared.core().fleet.bookings().len() == 1).await;
        let one = node.shared.core().booked_tokens;
        let second = send(1);
        if slo.is_some() {
            // ~0.45 s of prefill queued ahead of it, more than half the SLO: it waits.
            eventually("the second request held", || node.shared.admission.depth() == 1).await;
            assert_eq!(node.shared.core().fleet.bookings().len(), 1);
            // What `kvmesh status` shows: one waiting, with the first's load (the same size,
            // nothing shared), and the settings.
            let mut admin = v1::admin_client::AdminClient::new(common::grpc(node.grpc).await);
            // A waiter leaves the queue for a moment at each 250 ms re-check: ask again then.
            let mut a = v1::AdmissionState::default();
            for _ in 0..5 {
                let list = admin.list_replicas(v1::ListReplicasRequest {}).await.unwrap().into_inner();
                a = list.admission.unwrap();
                if a.waiting == 1 {
                    break;
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
            assert_eq!((a.enabled, a.waiting, a.waiting_tokens as f64), (true, 1, one));
            assert_eq!((a.queue_limit, a.max_wait_s, a.ttft_slo_s), (256, 30.0, 0.2));
            assert_eq!((a.refused_queue_full, a.refused_evicted_late, a.refused_timeout), (0, 0, 0));
        } else {
            eventually("the second request sent", || node.shared.core().fleet.bookings().len() == 2).await;
        }
        assert_eq!((first.await.unwrap(), second.await.unwrap()), (200, 200), "slo {slo:?}");
        assert!(node.shared.core().fleet.bookings().is_empty());
        assert_eq!(node.shared.admission.depth(), 0);
        // The autoscaler's demand counts each request once, however often it was re-routed
        // while it waited (the same prompt size, so twice the first one's load).
        assert_eq!(node.shared.core().booked_tokens, 2.0 * one, "slo {slo:?}");
        // Both (streamed) TTFTs are measured; each is over 0.2 s (0.45 s of prefill alone),
        // counted as over the SLO only when one is set.
        let page = reqwest::get(format!("http://{http}/metrics")).await.unwrap().text().await.unwrap();
        let over = if slo.is_some() { 2 } else { 0 };
        assert!(page.contains("kvmesh_ttft_seconds_count 2\n"), "{page}");
        assert!(page.contains(&format!("kvmesh_ttft_over_slo_total {over}\n")), "{page}");
        // The held request's wait is measured once, when it was routed.
        let waited = if slo.is_some() { 1 } else { 0 };
        assert!(page.contains(&format!("kvmesh_admission_wait_seconds_count {waited}\n")), "{page}");
        node.stop().await;
    }
}

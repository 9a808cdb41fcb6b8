//! Unit tests of `loadtest`.

use super::*;

#[test]
fn prompts_have_the_prefix_length_asked_for() {
    // The default is sixteen 42-byte sentences, as before the flag.
    let sentence = "System prompt number 3 for the load test. ";
    assert_eq!(prompt(3, 8, "", 168), format!("{}Question 3: what is the answer?", sentence.repeat(16)));
    // 2,000 tokens of 4 bytes: the sentence repeated and cut at 8,000 bytes.
    let long = prompt(11, 8, "b", 2_000);
    assert_eq!(long.find("Question"), Some(8_000));
    assert!(long.starts_with(sentence) && long.ends_with("Question b11: what is the answer?"));
}

/// A stand-in engine: answers `/v1/completions` after `delay_ms`, keeping each prompt.
async fn engine(delay_ms: u64, prompts: Arc<Mutex<Vec<String>>>) -> String {
    use axum::{routing::post, Json, Router};
    let app = Router::new().route(
        "/v1/completions",
        post(move |Json(body): Json<serde_json::Value>| {
            let prompts = prompts.clone();
            async move {
                prompts.lock().unwrap().push(body["prompt"].as_str().unwrap_or_default().to_string());
                tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                Json(serde_json::json!({"choices": []}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// An HTTP run of 1 s at `rate` to `url`, no warm-up, 8 prefixes, 1 output token.
fn open_loop(url: String, rate: f64, baseline: Option<String>) -> LoadtestArgs {
    LoadtestArgs {
        mode: "http".into(),
        url,
        rate,
        concurrency: 64,
        duration: 1.0,
        warmup: 0.0,
        prefixes: 8,
        prefix_tokens: 168,
        max_tokens: 1,
        json: true,
        retry_once: false,
        stream: false,
        baseline,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_baseline_stream_runs_interleaved_at_the_same_rate_and_is_measured_apart() {
    let (slow_seen, fast_seen) = (Arc::new(Mutex::new(Vec::new())), Arc::new(Mutex::new(Vec::new())));
    let (slow, fast) = (engine(80, slow_seen.clone()).await, engine(0, fast_seen.clone()).await);
    let (target, baseline, seconds) = http(&open_loop(slow, 40.0, Some(fast))).await.unwrap();
    let baseline = baseline.expect("a baseline tally");
    // 40/s each over 1 s: 80 arrivals, alternating.
    assert_eq!((target.ok, baseline.ok, target.dropped, baseline.dropped, seconds), (40, 40, 0, 0, 1.0));
    let (t, b) = (Summary::new(&target, seconds), Summary::new(&baseline, seconds));
    // The slow engine's 80 ms, less the fast side's own overhead (up to tens of ms on a busy
    // test machine).
    assert!(t.p50_ms - b.p50_ms >= 50.0, "added {} ms", t.p50_ms - b.p50_ms);
    assert!(b.p50_ms < 60.0, "the baseline waited on the slow engine: {} ms", b.p50_ms);
    // Each stream has its own questions on the same shared system prompts.
    let (slow_seen, fast_seen) = (slow_seen.lock().unwrap().clone(), fast_seen.lock().unwrap().clone());
    assert_eq!(slow_seen[3], prompt(3, 8, "", 168));
    assert_eq!(fast_seen[3], prompt(3, 8, "b", 168));
    assert!(fast_seen[3].ends_with("Question b3: what is the answer?"));
    assert!(slow_seen.iter().all(|p| !p.contains("Question b")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_answers_report_ttft_at_their_first_chunk() {
    // A stand-in vLLM at a fifth of real speed: the first token after one prefill step
    // (~45 ms for these ~180-token prompts), then 7 decode steps of ~30 ms each. Slowed so
    // that a busy test machine's scheduling delays (tens of ms) cannot close the gap.
    let engine = kvmesh_engine_sim::start(kvmesh_engine_sim::EngineSimConfig {
        speed: 0.2,
        ..kvmesh_engine_sim::EngineSimConfig::default()
    })
    .await
    .unwrap();
    let args = LoadtestArgs { stream: true, max_tokens: 8, ..open_loop(engine.base_url(), 20.0, None) };
    let (tally, _, seconds) = http(&args).await.unwrap();
    assert_eq!((tally.ok, tally.dropped), (20, 0), "{:?}", tally.errors);
    let s = Summary::new(&tally, seconds);
    let [ttft_p50, _, _] = s.ttft_ms.expect("TTFT measured");
    // At the first chunk, after the prefill step (not at the response headers, sent at once),
    // and well before the last of the 7 decode steps.
    assert!(ttft_p50 >= 25.0 && ttft_p50 + 100.0 < s.p50_ms, "TTFT {ttft_p50} ms, latency {} ms", s.p50_ms);
    // Not streamed: no TTFT.
    let (tally, _, seconds) = http(&LoadtestArgs { stream: false, ..args }).await.unwrap();
    assert_eq!(Summary::new(&tally, seconds).ttft_ms, None);
    let refused = LoadtestArgs { stream: true, mode: "route".into(), ..open_loop(engine.base_url(), 1.0, None) };
    assert_eq!(run(&refused).unwrap_err().to_string(), "--stream needs --mode http (it is \"route\")");
}

/// Through a real node's endpoint picker: every request picked, followed and released,
/// each counted once by the node as the gateway's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn epp_mode_drives_a_nodes_endpoint_picker_to_the_release() {
    let engine = kvmesh_engine_sim::start(kvmesh_engine_sim::EngineSimConfig {
        speed: 50.0,
        ..kvmesh_engine_sim::EngineSimConfig::default()
    })
    .await
    .unwrap();
    let replica = kvmesh_tests::node::replica(0, &engine);
    let config = kvmesh_tests::node::single(kvmesh_tests::node::section(), vec![replica]);
    let node = kvmesh_node::start(config).await.unwrap();
    let t0 = Instant::now();
    while kvmesh_node::health::Readiness::of(&node.shared).routable == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "replica not ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let args = LoadtestArgs {
        mode: "epp".into(),
        concurrency: 4,
        duration: 0.5,
        ..open_loop(format!("http://{}", node.grpc), 0.0, None)
    };
    let (tally, seconds) = epp::run(&args).await.unwrap();
    assert!(tally.ok >= 10 && tally.errors.is_empty(), "{} ok, {:?}", tally.ok, tally.errors);
    assert!(Summary::new(&tally, seconds).p50_ms > 0.0);
    while !node.shared.core().fleet.bookings().is_empty() {
        assert!(t0.elapsed() < Duration::from_secs(20), "bookings left");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let page = kvmesh_node::metrics_page::render(&node.shared);
    let ok = format!("kvmesh_replica_requests_total{{replica=\"e0\",outcome=\"ok\"}} {}", tally.ok);
    assert!(page.contains(&ok), "{ok} in\n{page}");
    assert_eq!(node.shared.recent_decisions(1)[0].via, "gateway");
    node.stop().await;
    engine.stop().await;
    // A picker that fails open (no replica at all) answers without a destination: an
    // error for every request, and the run fails.
    let mut config = kvmesh_tests::node::single(kvmesh_tests::node::section(), vec![]);
    config.epp.fail_open = true;
    let node = kvmesh_node::start(config).await.unwrap();
    let args = LoadtestArgs { url: format!("http://{}", node.grpc), duration: 0.2, ..args };
    let (tally, _) = epp::run(&args).await.unwrap();
    assert_eq!(
        (tally.ok, tally.errors.keys().map(String::as_str).collect::<Vec<_>>()),
        (0, vec!["no destination (the picker failed open)"])
    );
    let failed = tokio::task::spawn_blocking(move || run(&LoadtestArgs { json: true, ..args })).await.unwrap();
    assert!(failed.unwrap_err().to_string().starts_with("no request to http://"), "the run fails");
    node.stop().await;
}

#[test]
fn the_headline_says_route_runs_closed_loop_whatever_the_rate() {
    let http = open_loop("http://127.0.0.1:9".into(), 50.0, None);
    assert_eq!(headline(&http, 49.6, 2.0), "http http://127.0.0.1:9: 50 req/s offered, 50 ok/s over 2.0 s");
    let route = LoadtestArgs { mode: "route".into(), ..open_loop("http://127.0.0.1:9".into(), 50.0, None) };
    assert_eq!(
        headline(&route, 4721.0, 2.0),
        "route http://127.0.0.1:9: closed loop, saturation (64 workers), 4721 ok/s over 2.0 s"
    );
}

#[test]
fn a_baseline_needs_an_open_loop_run_valid_urls_and_answers_on_both_sides() {
    let args = open_loop("http://127.0.0.1:9".into(), 0.0, Some("http://127.0.0.1:9".into()));
    assert_eq!(run(&args).unwrap_err().to_string(), "--baseline needs an open-loop run: --rate > 0");
    let args = open_loop("http://127.0.0.1:9".into(), 10.0, Some("http://127.0.0.1:9,localhost:1".into()));
    assert_eq!(
        run(&args).unwrap_err().to_string(),
        "--baseline: \"localhost:1\" is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000)"
    );
    // Nothing listens on port 9: no request succeeds on either side, so there is no
    // difference to report.
    let args = open_loop("http://127.0.0.1:9".into(), 10.0, Some("http://127.0.0.1:9".into()));
    assert_eq!(
        run(&args).unwrap_err().to_string(),
        "no added latency: 0 requests succeeded on --url http://127.0.0.1:9, 0 on --baseline (see the errors above)"
    );
}

/// `read_body` of a streamed answer whose body arrives as `chunks`.
async fn read_streamed(chunks: &[&'static str]) -> Result<(Option<u64>, Vec<u64>), String> {
    let parts: Vec<Result<&'static str, std::io::Error>> = chunks.iter().map(|c| Ok(*c)).collect();
    let body = reqwest::Body::wrap_stream(tokio_stream::iter(parts));
    read_body(reqwest::Response::from(axum::http::Response::new(body)), Some(Instant::now())).await
}

#[tokio::test]
async fn a_stream_counts_only_when_it_ends_with_done_and_carries_no_error_event() {
    let token = "data: {\"choices\":[{\"text\":\" t\"}]}\n\n";
    let (first, gaps) = read_streamed(&[token, token, "data: [DO", "NE]\n\n"]).await.unwrap();
    assert!(first.is_some());
    assert_eq!(gaps.len(), 3, "one gap between each pair of the 4 chunks");
    // A router's error event after the 200 (its upstream broke off), then the end.
    let error = "data: {\"error\":{\"message\":\"replica e0 failed mid-stream\",\"type\":\"upstream_error\"}}\n\n";
    assert_eq!(read_streamed(&[token, error]).await, Err("sse_error".to_string()));
    // Cut short with no word.
    assert_eq!(read_streamed(&[token]).await, Err("sse_truncated".to_string()));
    // "error" inside a token's text is text.
    let text = "data: {\"choices\":[{\"text\":\"\\\"error\\\"\"}]}\n\n";
    assert!(read_streamed(&[text, "data: [DONE]\n\n"]).await.is_ok());
}

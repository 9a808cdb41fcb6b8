//! Outputs the router does not know: engine-sims whose answers end at lengths drawn from a
//! heavy-tailed distribution (not their `max_tokens`), a node that learns from each answer's
//! `usage.completion_tokens`, an output-length hint header honoured by the router only, and
//! the estimator's error in the node's metrics.

use crate::common;

use common::{eventually_within, metric};
use kvmesh_engine_sim::outputs::OutputLengths;
use kvmesh_engine_sim::EngineSimConfig;
use kvmesh_node::config::NodeSection;
use serde_json::{json, Value};

fn counter(node: &kvmesh_node::Node, name: &str) -> u64 {
    let line = metric(node, name);
    line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or_else(|| panic!("{name}: {line:?}")) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_of_drawn_lengths_teach_the_node_and_its_error_is_measured() {
    let lengths = OutputLengths { median: 12.0, sigma: 1.0, seed: 3 };
    let config = EngineSimConfig { output_lengths: Some(lengths), speed: 50.0, ..EngineSimConfig::default() };
    let engine = kvmesh_engine_sim::start(config).await.unwrap();
    let section = NodeSection { scrape_interval: std::time::Duration::from_millis(50), ..common::section() };
    let node = kvmesh_node::start(common::single(section, vec![common::replica(0, &engine)])).await.unwrap();
    eventually_within("scraped", 10, || node.shared.core().replicas["e0"].health.lock().engine.is_some()).await;
    let client = reqwest::Client::new();
    let url = format!("http://{}/v1/completions", node.http);
    // One task prompt (its first 4 blocks are the output key), 20 questions, max_tokens 256.
    let task = "task: summarise the report. ".repeat(12);
    let (mut outputs, mut stopped) = (0u64, 0);
    for k in 0..20 {
        let body = json!({"model": "m", "prompt": format!("{task}question {k}"), "max_tokens": 256});
        let answer: Value = client.post(&url).json(&body).send().await.unwrap().json().await.unwrap();
        outputs += answer["usage"]["completion_tokens"].as_u64().unwrap();
        stopped += (answer["choices"][0]["finish_reason"] == "stop") as u32;
    }
    assert_eq!(stopped, 20, "every answer ended before max_tokens");
    // The node counted exactly what the engine generated, and what it expected: max_tokens
    // for the first 4 of the key, then the key's learned mean — far closer.
    assert_eq!(counter(&node, "kvmesh_output_tokens_total"), outputs);
    let expected = counter(&node, "kvmesh_expected_output_tokens_total");
    assert!((4 * 256..4 * 256 + 16 * 128).contains(&expected), "{expected}");
    assert_eq!(counter(&node, "kvmesh_output_estimate_ratio_count"), 20);
    // Learned: a 21st question is expected near the mean of the 20, not at 256.
    let before = counter(&node, "kvmesh_expected_output_tokens_total");
    let body = json!({"model": "m", "prompt": format!("{task}question 20"), "max_tokens": 256});
    let answer: Value = client.post(&url).json(&body).send().await.unwrap().json().await.unwrap();
    let learned = counter(&node, "kvmesh_expected_output_tokens_total") - before;
    assert!(learned < 128, "expected {learned} tokens of a 256-token cap");
    assert!(answer["usage"]["completion_tokens"].as_u64().unwrap() < 256);
    // A hint is the router's: booked as sent (the engine never reads it).
    let before = counter(&node, "kvmesh_expected_output_tokens_total");
    let body = json!({"model": "m", "prompt": format!("{task}question 21"), "max_tokens": 256});
    let r = client.post(&url).header("x-kvmesh-expected-output-tokens", "5").json(&body).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(counter(&node, "kvmesh_expected_output_tokens_total") - before, 5);
    node.stop().await;
    engine.stop().await;
}

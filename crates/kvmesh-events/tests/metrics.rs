//! Engine load from real-shaped vLLM and SGLang `/metrics` pages, with exact values.

use kvmesh_core::load::EngineMetrics;
use kvmesh_events::{parse_engine_metrics, Dialect, MetricsError};
use proptest::prelude::*;

/// The shape vLLM's `prometheus_client` exposition has: HELP/TYPE lines, `model_name` and
/// `engine` labels (one series per data-parallel engine), counters, histograms.
const VLLM_TWO_ENGINES: &str = r#"# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 4321.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
vllm:num_requests_running{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 123456.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.75
"#;

const VLLM_OLD: &str = r#"# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 12.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.875
"#;

const SGLANG: &str = r#"# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",dp_rank="0"} 9.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",dp_rank="0"} 2.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",dp_rank="0"} 0.125
"#;

#[test]
fn vllm_engines_sum_requests_and_average_kv_usage() {
    let (dialect, m) = parse_engine_metrics(VLLM_TWO_ENGINES, 42.0).unwrap();
    assert_eq!(dialect, Dialect::Vllm);
    assert_eq!(m, EngineMetrics { running: 5, waiting: 4, kv_usage: 0.375, at: 42.0 });
}

#[test]
fn older_vllm_and_sglang_names() {
    assert_eq!(
        parse_engine_metrics(VLLM_OLD, 1.0).unwrap(),
        (Dialect::Vllm, EngineMetrics { running: 7, waiting: 12, kv_usage: 0.875, at: 1.0 })
    );
    assert_eq!(
        parse_engine_metrics(SGLANG, 2.0).unwrap(),
        (Dialect::Sglang, EngineMetrics { running: 9, waiting: 2, kv_usage: 0.125, at: 2.0 })
    );
}

#[test]
fn missing_metrics_are_named() {
    let no_waiting = VLLM_OLD.replace("vllm:num_requests_waiting", "vllm:something_else");
    assert_eq!(parse_engine_metrics(&no_waiting, 0.0), Err(MetricsError::Missing("vllm:num_requests_waiting")));
    let no_kv = SGLANG.replace("sglang:token_usage", "sglang:other");
    assert_eq!(parse_engine_metrics(&no_kv, 0.0), Err(MetricsError::Missing("sglang:token_usage")));
    let err = parse_engine_metrics("# TYPE up gauge\nup 1\n", 0.0).unwrap_err();
    assert_eq!(
        err.to_string(),
        "metrics page has no vllm:num_requests_running or sglang:num_running_reqs: not a vLLM or SGLang engine, or a version with other metric names"
    );
}

#[test]
fn html_is_unparseable() {
    let err = parse_engine_metrics("<html><body>502 Bad Gateway</body></html>", 0.0).unwrap_err();
    assert!(matches!(err, MetricsError::Unparseable(_)), "{err:?}");
}

proptest! {
    /// No page panics the parser through this function.
    #[test]
    fn never_panics(text in "(#|[a-z:_]{1,12}|\\{|\\}|=|\"|,| |\n|[0-9.e+-]{1,6}|le|NaN|\\+Inf){0,40}") {
        let _ = parse_engine_metrics(&text, 0.0);
    }
}

#[test]
fn served_tokens_are_computed_prefill_plus_decode_over_all_engines() {
    let vllm = r#"# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 1.0
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0"} 10000.0
vllm:prompt_tokens_total{engine="1"} 5000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0"} 4000.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0"} 700.0
vllm:generation_tokens_total{engine="1"} 300.0
"#;
    // 15,000 prompt tokens, 4,000 of them cached, and 1,000 generated.
    assert_eq!(kvmesh_events::parse_served_tokens(vllm), Some(12_000.0));
    let sglang = format!(
        "{SGLANG}# TYPE sglang:prompt_tokens_total counter\nsglang:prompt_tokens_total 900.0\n\
         # TYPE sglang:cached_tokens_total counter\nsglang:cached_tokens_total 100.0\n\
         # TYPE sglang:generation_tokens_total counter\nsglang:generation_tokens_total 50.0\n"
    );
    assert_eq!(kvmesh_events::parse_served_tokens(&sglang), Some(850.0));
    // One parse of the page gives the scrape all: the load, the served tokens, and the
    // generated tokens (what tells an engine restart).
    let (dialect, metrics) = parse_engine_metrics(&sglang, 3.0).unwrap();
    let page = kvmesh_events::EnginePage {
        dialect,
        metrics,
        served_tokens: Some(850.0),
        generated_tokens: Some(50.0),
        kv_blocks: None,
        kv_block_size: None,
    };
    assert_eq!(kvmesh_events::parse_engine_page(&sglang, 3.0), Ok(page));
    assert_eq!(kvmesh_events::parse_engine_page(VLLM_OLD, 3.0).unwrap().served_tokens, None);
    // Without the counters (or not a metrics page at all): nothing measured.
    assert_eq!(kvmesh_events::parse_served_tokens(VLLM_OLD), None);
    assert_eq!(kvmesh_events::parse_served_tokens(VLLM_TWO_ENGINES), None);
    assert_eq!(kvmesh_events::parse_served_tokens("{{{"), None);
}

#[test]
fn kv_blocks_come_from_vllms_cache_config_info() {
    let info = |engine: u32| {
        format!(
            "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",\
             engine=\"{engine}\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"None\",num_gpu_blocks=\"29375\"}} 1.0\n"
        )
    };
    let page = format!(
        "{VLLM_TWO_ENGINES}# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n{}{}",
        info(0),
        info(1)
    );
    // vLLM labels the same (already summed) cache config once per data-parallel engine.
    let parsed = kvmesh_events::parse_engine_page(&page, 0.0).unwrap();
    assert_eq!((parsed.kv_blocks, parsed.kv_block_size), (Some(29_375), Some(16)));
    assert_eq!(kvmesh_events::parse_engine_page(VLLM_TWO_ENGINES, 0.0).unwrap().kv_blocks, None);
    // A value that is not a count is ignored, not an error.
    let odd = page.replace("num_gpu_blocks=\"29375\"", "num_gpu_blocks=\"None\"");
    assert_eq!(kvmesh_events::parse_engine_page(&odd, 0.0).unwrap().kv_blocks, None);
}

#[test]
fn one_data_parallel_rank_reads_its_own_series() {
    use kvmesh_events::parse_engine_page_of;
    let rank = |k| parse_engine_page_of(VLLM_TWO_ENGINES, 7.0, Some(k));
    assert_eq!(rank(0).unwrap().metrics, EngineMetrics { running: 3, waiting: 4, kv_usage: 0.5, at: 7.0 });
    assert_eq!(rank(1).unwrap().metrics, EngineMetrics { running: 2, waiting: 0, kv_usage: 0.25, at: 7.0 });
    // The whole engine, as before.
    assert_eq!(parse_engine_page_of(VLLM_TWO_ENGINES, 7.0, None).unwrap().metrics.running, 5);
    // A rank the page has no series for has no load.
    assert_eq!(rank(2), Err(MetricsError::Missing("vllm:num_requests_running")));
    // SGLang labels its ranks dp_rank.
    assert_eq!(parse_engine_page_of(SGLANG, 7.0, Some(0)).unwrap().metrics.running, 9);
    // Counters per rank: rank 1 served 5,000 prompt tokens and 300 generated, no hits.
    let counters = r#"# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0"} 1.0
vllm:num_requests_running{engine="1"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0"} 0.0
vllm:num_requests_waiting{engine="1"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0"} 0.1
vllm:kv_cache_usage_perc{engine="1"} 0.1
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0"} 10000.0
vllm:prompt_tokens_total{engine="1"} 5000.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0"} 4000.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0"} 700.0
vllm:generation_tokens_total{engine="1"} 300.0
"#;
    let one = parse_engine_page_of(counters, 1.0, Some(1)).unwrap();
    assert_eq!((one.served_tokens, one.generated_tokens), (Some(5_300.0), Some(300.0)));
    let zero = parse_engine_page_of(counters, 1.0, Some(0)).unwrap();
    assert_eq!((zero.served_tokens, zero.generated_tokens), (Some(6_700.0), Some(700.0)));
}

/// A page as vLLM's server exposes it: the families kvmesh reads among histograms, `_created`
/// series and the HTTP instrumentator's, for two engines.
fn full_page(extra: &str) -> String {
    let mut page = String::from(VLLM_TWO_ENGINES);
    page.push_str(
        "# HELP vllm:prompt_tokens_created Number of prefill tokens processed.\n\
         # TYPE vllm:prompt_tokens_created gauge\n\
         vllm:prompt_tokens_created{engine=\"0\",model_name=\"m\"} 1.765e+09\n\
         # HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n\
         # TYPE vllm:prefix_cache_hits_total counter\n\
         vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 23456.0\n\
         # HELP vllm:generation_tokens_total Number of generation tokens processed.\n\
         # TYPE vllm:generation_tokens_total counter\n\
         vllm:generation_tokens_total{engine=\"0\",model_name=\"m\"} 5000.0\n\
         vllm:generation_tokens_total{engine=\"1\",model_name=\"m\"} 1000.0\n\
         # HELP http_request_duration_seconds Latency with only few buckets by handler.\n\
         # TYPE http_request_duration_seconds histogram\n\
         http_request_duration_seconds_bucket{handler=\"/v1/completions\",le=\"0.1\",method=\"POST\"} 3.0\n\
         http_request_duration_seconds_bucket{handler=\"/v1/completions\",le=\"+Inf\",method=\"POST\"} 9.0\n\
         http_request_duration_seconds_count{handler=\"/v1/completions\",method=\"POST\"} 9.0\n\
         http_request_duration_seconds_sum{handler=\"/v1/completions\",method=\"POST\"} 4.5\n\
         # HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n\
         # TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{block_size=\"16\",engine=\"0\",num_gpu_blocks=\"29375\"} 1.0\n",
    );
    page.push_str(extra);
    page
}

#[test]
fn a_full_vllm_page_reads_its_families_exactly() {
    let page = kvmesh_events::parse_engine_page(&full_page(""), 3.0).unwrap();
    assert_eq!(page.metrics, EngineMetrics { running: 5, waiting: 4, kv_usage: 0.375, at: 3.0 });
    // Served: 123,456 prompt − 23,456 hits + 6,000 generated.
    assert_eq!((page.served_tokens, page.generated_tokens), (Some(106_000.0), Some(6_000.0)));
    assert_eq!((page.kv_blocks, page.kv_block_size), (Some(29_375), Some(16)));
    // Engine 1's own: 1,000 generated; no prompt counter of its own, so nothing served.
    let one = kvmesh_events::parse_engine_page_of(&full_page(""), 3.0, Some(1)).unwrap();
    assert_eq!((one.metrics.running, one.generated_tokens, one.served_tokens), (2, Some(1_000.0), None));
}

#[test]
fn a_malformed_line_of_a_family_kvmesh_does_not_read_loses_nothing() {
    // The same page with a broken histogram line, and with a comment the format does not know.
    let broken = full_page("http_request_size_bytes_bucket{le=\"+Inf\" 1.0 oops\n# EOF of sorts\n");
    let page = kvmesh_events::parse_engine_page(&broken, 3.0).unwrap();
    assert_eq!((page.metrics.running, page.served_tokens), (5, Some(106_000.0)));
    // A broken line in a family it reads still fails the page, as before.
    let bad = full_page("vllm:num_requests_running{engine=\"2\" 1.0\n");
    assert!(matches!(kvmesh_events::parse_engine_page(&bad, 3.0), Err(MetricsError::Unparseable(_))));
}

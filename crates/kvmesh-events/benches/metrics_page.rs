//! Parsing engines' `/metrics` pages: `cargo bench -p kvmesh-events --bench metrics_page`.
//!
//! A node scrapes every replica's page once a second (`node.scrape_interval`), so at a
//! thousand replicas it parses a thousand pages a second. Two pages:
//! - **full vLLM**: what a vLLM 0.1x OpenAI server exposes for one engine — the v1 engine's
//!   gauges, counters and histograms with their bucket bounds (vllm/v1/metrics/loggers.py:
//!   request latencies, TTFT, inter-token latency, token-count histograms, iteration tokens),
//!   each counter and histogram with its `_created` series (Python prometheus_client's
//!   default), the HTTP server's instrumentator series per handler
//!   (prometheus-fastapi-instrumentator), and the Python process collectors;
//! - **minimal**: the families kvmesh reads and nothing else (kvmesh-engine-sim's page).
//!
//! 64 distinct pages per cell (counter values differ), each parsed once per pass.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvmesh_events::parse_engine_page;
use std::fmt::Write;

const PAGES: usize = 64;
const MODEL: &str = "meta-llama/Llama-3.1-8B-Instruct";

/// A histogram family: one series per label prefix in `extras` (each ends with a comma).
fn histogram(out: &mut String, name: &str, help: &str, bounds: &[f64], seed: u64, extras: &[&str]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for extra in extras {
        let mut count = 0u64;
        for (k, b) in bounds.iter().enumerate() {
            count += (seed * 7 + k as u64 * 13) % 50;
            let _ = writeln!(out, "{name}_bucket{{{extra}engine=\"0\",le=\"{b:?}\",model_name=\"{MODEL}\"}} {count}.0");
        }
        let _ = writeln!(out, "{name}_bucket{{{extra}engine=\"0\",le=\"+Inf\",model_name=\"{MODEL}\"}} {count}.0");
        let _ = writeln!(out, "{name}_count{{{extra}engine=\"0\",model_name=\"{MODEL}\"}} {count}.0");
        let _ = writeln!(out, "{name}_sum{{{extra}engine=\"0\",model_name=\"{MODEL}\"}} {}.25", count * 3);
    }
    let _ = writeln!(out, "# HELP {name}_created {help}\n# TYPE {name}_created gauge");
    for extra in extras {
        let _ = writeln!(out, "{name}_created{{{extra}engine=\"0\",model_name=\"{MODEL}\"}} 1.7650e+09");
    }
}

/// A counter family: one series per label prefix in `extras` (each ends with a comma).
fn counter(out: &mut String, name: &str, help: &str, value: u64, extras: &[&str]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
    for extra in extras {
        let _ = writeln!(out, "{name}{{{extra}engine=\"0\",model_name=\"{MODEL}\"}} {value}.0");
    }
    let created = name.trim_end_matches("_total");
    let _ = writeln!(out, "# HELP {created}_created {help}\n# TYPE {created}_created gauge");
    for extra in extras {
        let _ = writeln!(out, "{created}_created{{{extra}engine=\"0\",model_name=\"{MODEL}\"}} 1.7650e+09");
    }
}

fn gauge(out: &mut String, name: &str, help: &str, value: f64) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge");
    let _ = writeln!(out, "{name}{{engine=\"0\",model_name=\"{MODEL}\"}} {value:?}");
}

/// vLLM's token-count buckets for a 131,072-token context: 1, 2, 5, 10, 20, 50, … ≤ 131,072.
fn one_two_five() -> Vec<f64> {
    let mut out = Vec::new();
    let mut exp = 1.0;
    'outer: loop {
        for m in [1.0, 2.0, 5.0] {
            if m * exp > 131_072.0 {
                break 'outer;
            }
            out.push(m * exp);
        }
        exp *= 10.0;
    }
    out
}

fn full_vllm_page(seed: u64) -> String {
    let mut p = String::new();
    // The Python process collectors.
    for (name, v) in [("python_gc_objects_collected_total", 1234.0), ("python_gc_collections_total", 56.0)] {
        let _ = writeln!(p, "# HELP {name} Python garbage collector.\n# TYPE {name} counter");
        for generation in 0..3 {
            let _ = writeln!(p, "{name}{{generation=\"{generation}\"}} {v:?}");
        }
    }
    for name in ["process_virtual_memory_bytes", "process_resident_memory_bytes", "process_start_time_seconds"] {
        let _ = writeln!(p, "# HELP {name} Process metric.\n# TYPE {name} gauge\n{name} {}.5", seed + 100);
    }
    gauge(&mut p, "vllm:num_requests_running", "Number of requests in model execution batches.", (seed % 7) as f64);
    gauge(&mut p, "vllm:num_requests_waiting", "Number of requests waiting to be processed.", (seed % 3) as f64);
    gauge(
        &mut p,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        0.25 + (seed % 50) as f64 / 100.0,
    );
    counter(&mut p, "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", seed, &[""]);
    counter(&mut p, "vllm:prompt_tokens_total", "Number of prefill tokens processed.", 1_000_000 + seed * 977, &[""]);
    counter(
        &mut p,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        400_000 + seed * 311,
        &[""],
    );
    counter(
        &mut p,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        900_000 + seed,
        &[""],
    );
    counter(
        &mut p,
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        300_000 + seed,
        &[""],
    );
    let reasons = ["finished_reason=\"stop\",", "finished_reason=\"length\",", "finished_reason=\"abort\","];
    counter(&mut p, "vllm:request_success_total", "Count of successfully processed requests.", seed * 3, &reasons);
    let tokens = one_two_five();
    for (name, help) in [
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed."),
        ("vllm:request_generation_tokens", "Number of generation tokens processed."),
        ("vllm:request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens."),
        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    ] {
        histogram(&mut p, name, help, &tokens, seed, &[""]);
    }
    histogram(
        &mut p,
        "vllm:request_params_n",
        "Histogram of the n request parameter.",
        &[1.0, 2.0, 5.0, 10.0, 20.0],
        seed,
        &[""],
    );
    let iteration = [1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0];
    histogram(
        &mut p,
        "vllm:iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        &iteration,
        seed,
        &[""],
    );
    let ttft = [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0,
    ];
    histogram(
        &mut p,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        &ttft,
        seed,
        &[""],
    );
    let itl =
        [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0];
    histogram(
        &mut p,
        "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        &itl,
        seed,
        &[""],
    );
    histogram(
        &mut p,
        "vllm:time_per_output_token_seconds",
        "Histogram of time per output token in seconds.",
        &itl,
        seed,
        &[""],
    );
    let latency = [
        0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
        1920.0, 7680.0,
    ];
    for (name, help) in [
        ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request."),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
    ] {
        histogram(&mut p, name, help, &latency, seed, &[""]);
    }
    let _ = writeln!(
        p,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge"
    );
    let _ = writeln!(
        p,
        "vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",\
         gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"0\",num_gpu_blocks=\"29375\",prefix_caching_hash_algo=\"sha256\"}} 1.0"
    );
    // The HTTP server's instrumentator, per handler.
    let http = [
        0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0,
        60.0,
    ];
    let handlers: Vec<String> = ["/v1/chat/completions", "/v1/completions", "/metrics", "/health", "/v1/models"]
        .iter()
        .map(|h| format!("handler=\"{h}\",method=\"POST\","))
        .collect();
    let handlers: Vec<&str> = handlers.iter().map(String::as_str).collect();
    counter(&mut p, "http_requests_total", "Total number of requests by method, status and handler.", seed, &handlers);
    histogram(&mut p, "http_request_duration_highr_seconds", "Latency with many buckets.", &http, seed, &handlers);
    histogram(
        &mut p,
        "http_request_duration_seconds",
        "Latency with only few buckets by handler.",
        &[0.1, 0.5, 1.0],
        seed,
        &handlers,
    );
    p
}

fn minimal_page(seed: u64) -> String {
    let mut p = String::new();
    gauge(&mut p, "vllm:num_requests_running", "Running.", (seed % 7) as f64);
    gauge(&mut p, "vllm:num_requests_waiting", "Waiting.", (seed % 3) as f64);
    gauge(&mut p, "vllm:kv_cache_usage_perc", "KV usage.", 0.25 + (seed % 50) as f64 / 100.0);
    counter(&mut p, "vllm:prompt_tokens_total", "Prompt tokens.", 1_000_000 + seed * 977, &[""]);
    counter(&mut p, "vllm:generation_tokens_total", "Generation tokens.", 400_000 + seed * 311, &[""]);
    p
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("metrics_page");
    for (name, make) in [("full_vllm", full_vllm_page as fn(u64) -> String), ("minimal", minimal_page)] {
        let pages: Vec<String> = (0..PAGES as u64).map(make).collect();
        // Every page must parse: a bench of failures would time the error path.
        for page in &pages {
            parse_engine_page(page, 0.0).expect("the bench's page parses");
        }
        let bytes = pages.iter().map(String::len).sum::<usize>() / PAGES;
        let lines = pages[0].lines().count();
        g.throughput(Throughput::Bytes(bytes as u64));
        let mut k = 0;
        g.bench_function(BenchmarkId::new(name, format!("{lines}_lines_{bytes}_bytes")), |b| {
            b.iter(|| {
                k = (k + 1) % PAGES;
                parse_engine_page(&pages[k], 0.0).map(|p| p.metrics.running)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

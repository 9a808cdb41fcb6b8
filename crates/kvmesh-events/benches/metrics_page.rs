//! Parsing engines' `/metrics` pages: `cargo bench -p kvmesh-events --bench metrics_page`.
//!
//! A node scrapes every replica's page once a second (`node.scrape_interval`), so at a
//! thousand replicas it parses a thousand pages a second. Two pages:
//! - **full vLLM**: what a vLLM server exposes for one engine — the families a router reads
//!   among the rest of the page, kvmesh-engine-sim's model of it
//!   (`crates/kvmesh-engine-sim/src/fleet/vllm_page_rest.prom`: the v1 engine's histograms with
//!   their bucket bounds, `_created` series, the HTTP server's and the Python process's);
//! - **minimal**: the families kvmesh reads and nothing else.
//!
//! 64 distinct pages per cell (counter values differ), each parsed once per pass.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvmesh_events::parse_engine_page;
use std::fmt::Write;

const PAGES: usize = 64;

/// The families of a vLLM server's page a router does not read.
const REST: &str = include_str!("../../kvmesh-engine-sim/src/fleet/vllm_page_rest.prom");

/// The families kvmesh reads, as vLLM writes them (values from `seed`).
fn minimal_page(seed: u64) -> String {
    let mut p = String::new();
    let labels = "engine=\"0\",model_name=\"meta-llama/Llama-3.1-8B-Instruct\"";
    let mut family = |name: &str, kind: &str, help: &str, value: String| {
        let _ = writeln!(p, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}");
    };
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        format!("{}.0", seed % 7),
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        format!("{}.0", seed % 3),
    );
    family("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage.", format!("{:?}", 0.25 + (seed % 50) as f64 / 100.0));
    family(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        format!("{}.0", 1_000_000 + seed * 977),
    );
    family("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits.", format!("{}.0", 300_000 + seed));
    family(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        format!("{}.0", 400_000 + seed * 311),
    );
    let _ = writeln!(
        p,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\n\
         vllm:cache_config_info{{block_size=\"16\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",engine=\"0\",\
         gpu_memory_utilization=\"0.9\",num_gpu_blocks=\"29375\"}} 1.0"
    );
    p
}

fn full_vllm_page(seed: u64) -> String {
    minimal_page(seed) + REST
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

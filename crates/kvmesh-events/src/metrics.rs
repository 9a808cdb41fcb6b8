//! An engine's load from its Prometheus `/metrics` text: requests running and waiting, and KV
//! usage, for vLLM and SGLang.
//!
//! | | running | waiting | KV usage (0–1) |
//! |---|---|---|---|
//! | vLLM | `vllm:num_requests_running` | `vllm:num_requests_waiting` | `vllm:kv_cache_usage_perc` (≥ 0.10), `vllm:gpu_cache_usage_perc` (older) |
//! | SGLang | `sglang:num_running_reqs` | `sglang:num_queue_reqs` | `sglang:token_usage` |
//!
//! A replica with several engines (data-parallel ranks, one series each, labelled `engine` or
//! `dp_rank`) reports the sum of their requests and the mean of their KV usage. Parsing uses
//! openmetrics-parser's Prometheus text parser (it accepts the `:` in these names, which
//! recording-rule style names need and some parsers reject).

use kvmesh_core::load::EngineMetrics;
use openmetrics_parser::{MetricsExposition, PrometheusType, PrometheusValue};

/// Which engine's metric names a report used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// vLLM (`vllm:*`).
    Vllm,
    /// SGLang (`sglang:*`).
    Sglang,
}

/// Why a metrics page gave no load.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MetricsError {
    /// The text is not Prometheus exposition format.
    #[error("metrics page is not Prometheus text format: {0}")]
    Unparseable(String),
    /// The page parsed but lacks a load metric (named) of the dialect it uses, or has none at
    /// all.
    #[error("metrics page has no {0}: not a vLLM or SGLang engine, or a version with other metric names")]
    Missing(&'static str),
}

/// One dialect's families: each list the spellings tried in turn (a counter with and without
/// `_total`, a gauge renamed between versions).
struct Names {
    running: &'static str,
    waiting: &'static str,
    kv_usage: &'static [&'static str],
    prompt: &'static [&'static str],
    hits: &'static [&'static str],
    generation: &'static [&'static str],
}

impl Names {
    /// Every family name of the dialect.
    fn all(&self) -> impl Iterator<Item = &'static str> {
        let lists = [self.kv_usage, self.prompt, self.hits, self.generation];
        [self.running, self.waiting].into_iter().chain(lists.into_iter().flatten().copied())
    }
}

const VLLM: Names = Names {
    running: "vllm:num_requests_running",
    waiting: "vllm:num_requests_waiting",
    kv_usage: &["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
    prompt: &["vllm:prompt_tokens_total", "vllm:prompt_tokens"],
    hits: &["vllm:prefix_cache_hits_total", "vllm:prefix_cache_hits"],
    generation: &["vllm:generation_tokens_total", "vllm:generation_tokens"],
};
const SGLANG: Names = Names {
    running: "sglang:num_running_reqs",
    waiting: "sglang:num_queue_reqs",
    kv_usage: &["sglang:token_usage"],
    prompt: &["sglang:prompt_tokens_total"],
    hits: &["sglang:cached_tokens_total"],
    generation: &["sglang:generation_tokens_total"],
};
/// vLLM's cache config (its KV blocks and block size).
const CACHE_CONFIG: &str = "vllm:cache_config_info";

type Exposition = MetricsExposition<PrometheusType, PrometheusValue>;

/// Reads an engine's load from its metrics page, stamped `at` (seconds, the caller's clock).
///
/// # Errors
/// [`MetricsError::Unparseable`] when the text is not Prometheus format;
/// [`MetricsError::Missing`] naming the first load metric absent.
pub fn parse_engine_metrics(text: &str, at: f64) -> Result<(Dialect, EngineMetrics), MetricsError> {
    load(&Page { exposition: &parse(text)?, rank: None }, at)
}

/// What one scrape of an engine's metrics page gives.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EnginePage {
    /// Whose metric names the page uses.
    pub dialect: Dialect,
    /// The engine's load ([`parse_engine_metrics`]).
    pub metrics: EngineMetrics,
    /// Tokens served so far ([`parse_served_tokens`]).
    pub served_tokens: Option<f64>,
    /// Tokens generated so far, summed over the page's series: vLLM
    /// `vllm:generation_tokens_total`, SGLang `sglang:generation_tokens_total`. Unlike
    /// `served_tokens` it only ever rises while the engine runs (vLLM adds prefix-cache hits
    /// when it schedules a request but its prompt tokens only at its first token, and counts
    /// a preempted request's hits again), so a fall means the engine restarted.
    pub generated_tokens: Option<f64>,
    /// KV blocks the engine allocated: vLLM's `vllm:cache_config_info{num_gpu_blocks="…"}`
    /// (vllm/v1/metrics/loggers.py). With data-parallel ranks vLLM already sums the ranks'
    /// blocks into the one cache config it labels for every engine, so this is the largest
    /// series', not their sum. `None` for SGLang, or when the page lacks it.
    pub kv_blocks: Option<u64>,
    /// Tokens per block of [`EnginePage::kv_blocks`]: the same series' `block_size` label.
    pub kv_block_size: Option<u32>,
}

/// Everything a scrape reads from one parse of the page (a vLLM page runs to hundreds of
/// kilobytes).
///
/// # Errors
/// As [`parse_engine_metrics`].
pub fn parse_engine_page(text: &str, at: f64) -> Result<EnginePage, MetricsError> {
    parse_engine_page_of(text, at, None)
}

/// [`parse_engine_page`] for one data-parallel rank of the engine (`None`: all of them): only
/// the series labelled `engine="<rank>"` (vLLM: its engine index, the rank) or
/// `dp_rank="<rank>"` (SGLang) count, so each rank routed as a replica of its own reads its
/// own load and counters.
///
/// # Errors
/// As [`parse_engine_metrics`]; a metric with no series for the rank is missing.
pub fn parse_engine_page_of(text: &str, at: f64, rank: Option<u32>) -> Result<EnginePage, MetricsError> {
    let parsed = parse(text)?;
    let parsed = Page { exposition: &parsed, rank: rank.map(|k| k.to_string()) };
    let (dialect, metrics) = load(&parsed, at)?;
    let (kv_blocks, kv_block_size) = cache_config(&parsed).unzip();
    Ok(EnginePage {
        dialect,
        metrics,
        served_tokens: served(&parsed),
        generated_tokens: generated(&parsed),
        kv_blocks,
        kv_block_size: kv_block_size.flatten(),
    })
}

/// The largest `num_gpu_blocks` of `vllm:cache_config_info`, with its series' `block_size`.
fn cache_config(parsed: &Page) -> Option<(u64, Option<u32>)> {
    parsed
        .exposition
        .families
        .get(CACHE_CONFIG)?
        .iter_samples()
        .filter_map(|s| {
            let labels = s.get_labelset().ok()?;
            let blocks: u64 = labels.get_label_value("num_gpu_blocks")?.parse().ok()?;
            Some((blocks, labels.get_label_value("block_size").and_then(|b| b.parse().ok())))
        })
        .max_by_key(|(blocks, _)| *blocks)
}

/// Tokens the engine has served so far — computed prefill plus decode, the unit of token
/// load — from its counters: vLLM `vllm:prompt_tokens_total` (whole prompts, cached tokens
/// included, vllm/v1/metrics/stats.py) `− vllm:prefix_cache_hits_total + vllm:generation_tokens_total`;
/// SGLang `sglang:prompt_tokens_total − sglang:cached_tokens_total +
/// sglang:generation_tokens_total`. Summed over the page's series (data-parallel ranks).
/// `None` when the page lacks the prompt or generation counter or is not Prometheus text.
pub fn parse_served_tokens(text: &str) -> Option<f64> {
    served(&Page { exposition: &parse(text).ok()?, rank: None })
}

/// A parsed page, read for one data-parallel rank's series or all.
struct Page<'a> {
    exposition: &'a Exposition,
    rank: Option<String>,
}

impl Page<'_> {
    fn has(&self, name: &str) -> bool {
        self.exposition.families.contains_key(name)
    }
}

/// The page parsed: only the lines of the families this module reads ([`VLLM`], [`SGLANG`],
/// [`CACHE_CONFIG`]: their samples, `# HELP` and `# TYPE`), or the whole page when it has no
/// sample of them (so that a page that is not Prometheus text is still named unparseable). A vLLM page is mostly histograms kvmesh does
/// not read — 600 lines and 69 KB for one engine, which the parser took 2.5 ms over
/// (`cargo bench -p kvmesh-events --bench metrics_page`), once a second per replica — and a
/// malformed line in one of them no longer loses the scrape.
fn parse(text: &str) -> Result<Exposition, MetricsError> {
    match wanted_lines(text) {
        Some(wanted) => parse_all(&wanted),
        None => parse_all(text),
    }
}

/// The lines of `text` that belong to a family this module reads, if any of them is a sample.
fn wanted_lines(text: &str) -> Option<String> {
    let mut out = String::new();
    let mut samples = false;
    for line in text.lines() {
        let t = line.trim_start();
        let (name, sample) = match t.strip_prefix('#') {
            Some(comment) => {
                let mut words = comment.split_whitespace();
                match words.next() {
                    Some("HELP" | "TYPE") => (words.next().unwrap_or(""), false),
                    _ => continue,
                }
            }
            None => (&t[..t.find(|c: char| c == '{' || c.is_whitespace()).unwrap_or(t.len())], true),
        };
        let read = |n: &str| n == CACHE_CONFIG || VLLM.all().chain(SGLANG.all()).any(|r| r == n);
        if (name.starts_with("vllm:") || name.starts_with("sglang:")) && read(name) {
            out.push_str(line);
            out.push('\n');
            samples |= sample;
        }
    }
    samples.then_some(out)
}

fn parse_all(text: &str) -> Result<Exposition, MetricsError> {
    // The parser has `unwrap`s on paths its grammar should rule out; a page from the network
    // must never take the node down, so a panic in it counts as unparseable.
    std::panic::catch_unwind(|| openmetrics_parser::prometheus::parse_prometheus(text))
        .map_err(|_| MetricsError::Unparseable("the parser failed on this input".into()))?
        .map_err(|e| MetricsError::Unparseable(e.to_string()))
}

fn load(parsed: &Page, at: f64) -> Result<(Dialect, EngineMetrics), MetricsError> {
    let (dialect, names) = if parsed.has(VLLM.running) {
        (Dialect::Vllm, VLLM)
    } else if parsed.has(SGLANG.running) {
        (Dialect::Sglang, SGLANG)
    } else {
        return Err(MetricsError::Missing("vllm:num_requests_running or sglang:num_running_reqs"));
    };
    let running = values(parsed, names.running).ok_or(MetricsError::Missing(names.running))?;
    let waiting = values(parsed, names.waiting).ok_or(MetricsError::Missing(names.waiting))?;
    let usage =
        names.kv_usage.iter().find_map(|n| values(parsed, n)).ok_or(MetricsError::Missing(names.kv_usage[0]))?;
    let count = |v: &[f64]| v.iter().sum::<f64>().clamp(0.0, u32::MAX as f64).round() as u32;
    let kv_usage = usage.iter().sum::<f64>() / usage.len() as f64;
    // NaN passes a clamp untouched (Prometheus text may say `NaN`): refuse the page instead.
    if kv_usage.is_nan() {
        return Err(MetricsError::Unparseable(format!("{} is NaN", names.kv_usage[0])));
    }
    let kv_usage = kv_usage.clamp(0.0, 1.0);
    Ok((dialect, EngineMetrics { running: count(&running), waiting: count(&waiting), kv_usage, at }))
}

/// The page's counter names: vLLM's when it has vLLM's running gauge, else SGLang's.
fn dialect_of(parsed: &Page) -> &'static Names {
    if parsed.has(VLLM.running) {
        &VLLM
    } else {
        &SGLANG
    }
}

/// The sum of the first of `names` the page has.
fn total(parsed: &Page, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|n| values(parsed, n)).map(|v| v.iter().sum::<f64>())
}

fn generated(parsed: &Page) -> Option<f64> {
    let total = total(parsed, dialect_of(parsed).generation)?;
    (total.is_finite() && total >= 0.0).then_some(total)
}

fn served(parsed: &Page) -> Option<f64> {
    let names = dialect_of(parsed);
    let prompt = total(parsed, names.prompt)?;
    let hits = total(parsed, names.hits).unwrap_or(0.0);
    let served = prompt - hits + total(parsed, names.generation)?;
    (served.is_finite() && served >= 0.0).then_some(served)
}

/// Every finite gauge (or untyped) sample of `name` (of the page's rank, when it has one);
/// `None` when the family is absent or has no usable sample.
fn values(parsed: &Page, name: &str) -> Option<Vec<f64>> {
    let family = parsed.exposition.families.get(name)?;
    let of_rank = |s: &&openmetrics_parser::Sample<PrometheusValue>| {
        let Some(rank) = &parsed.rank else { return true };
        s.get_labelset().is_ok_and(|l| {
            ["engine", "dp_rank"].iter().any(|k| l.get_label_value(k).is_some_and(|v| v == rank.as_str()))
        })
    };
    let v: Vec<f64> = family
        .iter_samples()
        .filter(of_rank)
        .filter_map(|s| match &s.value {
            PrometheusValue::Gauge(n) | PrometheusValue::Unknown(n) => Some(n.as_f64()),
            PrometheusValue::Counter(c) => Some(c.value.as_f64()),
            _ => None,
        })
        .filter(|x| x.is_finite())
        .collect();
    (!v.is_empty()).then_some(v)
}

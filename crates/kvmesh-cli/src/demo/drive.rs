//! Sends the demo's requests through the router nodes' OpenAI endpoints at their arrival
//! times (streaming completions, `stream_options.include_usage`), measuring each one's TTFT
//! and the cached prompt tokens the engine reports.

use super::workload::prompt_text;
use kvmesh_sim::tokens::prompt_tokens;
use kvmesh_sim::trace::Trace;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One request's outcome. Times are engine seconds (wall seconds × speed).
#[derive(Debug, Clone, serde::Serialize)]
pub struct Outcome {
    /// Arrival, engine seconds from the start.
    pub arrival_s: f64,
    /// The router node it went to (1-based).
    pub node: usize,
    /// The replica that served it (`x-kvmesh-replica`).
    pub replica: String,
    /// Time to first token, engine seconds (`None`: failed).
    pub ttft_s: Option<f64>,
    /// Time to the last token, engine seconds.
    pub e2e_s: Option<f64>,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens the engine served from its prefix cache.
    pub cached_tokens: u32,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

impl Outcome {
    /// A request that got nothing: no replica, no tokens, `error`.
    fn failed(error: String) -> Outcome {
        Outcome {
            arrival_s: 0.0,
            node: 0,
            replica: String::new(),
            ttft_s: None,
            e2e_s: None,
            prompt_tokens: 0,
            cached_tokens: 0,
            error: Some(error),
        }
    }
}

/// Progress shared with the live view.
#[derive(Debug, Default)]
pub struct Live {
    /// Requests sent.
    pub sent: usize,
    /// Outcomes so far.
    pub done: Vec<Outcome>,
}

/// Sends every request of `trace` through `urls` in turn at `arrival / speed` wall seconds.
/// Dropping the future aborts every request in flight.
pub async fn run(trace: &Trace, urls: &[String], speed: f64, live: Arc<Mutex<Live>>) -> Vec<Outcome> {
    let client = reqwest::Client::builder().pool_max_idle_per_host(256).build().unwrap_or_default();
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for (i, r) in trace.requests.iter().enumerate() {
        let at = start + Duration::from_secs_f64(r.arrival_s / speed);
        tokio::time::sleep_until(at.into()).await;
        let tokens = prompt_tokens(r, i as u64, trace.block_tokens);
        let body = serde_json::json!({
            "model": "kvmesh-sim-llama-3-8b",
            "prompt": prompt_text(&tokens),
            "max_tokens": r.output_tokens.max(1),
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        let node = i % urls.len();
        let url = format!("{}/v1/completions", urls[node]);
        let (client, live, arrival_s) = (client.clone(), live.clone(), r.arrival_s);
        live.lock().unwrap_or_else(|p| p.into_inner()).sent += 1;
        tasks.spawn(async move {
            // TTFT counts from the scheduled arrival: a late send is the system's delay too.
            let mut o = one(&client, &url, body, speed, at).await;
            o.arrival_s = arrival_s;
            o.node = node + 1;
            o.prompt_tokens = tokens.len() as u32;
            live.lock().unwrap_or_else(|p| p.into_inner()).done.push(o.clone());
            o
        });
    }
    let mut out = Vec::with_capacity(tasks.len());
    while let Some(done) = tasks.join_next().await {
        match done {
            Ok(o) => out.push(o),
            // A request task that panicked is a failed request, not a missing one.
            Err(e) => out.push(Outcome { arrival_s: f64::NAN, ..Outcome::failed(format!("client task failed: {e}")) }),
        }
    }
    out.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    out
}

async fn one(client: &reqwest::Client, url: &str, body: serde_json::Value, speed: f64, t0: Instant) -> Outcome {
    let mut o = Outcome { error: None, ..Outcome::failed(String::new()) };
    let mut resp = match client.post(url).json(&body).send().await {
        Ok(r) if r.status().is_success() => r,
        Ok(r) => {
            o.error = Some(format!("HTTP {}", r.status().as_u16()));
            return o;
        }
        Err(e) => {
            o.error = Some(if e.is_connect() { "connect".into() } else { "request".into() });
            return o;
        }
    };
    o.replica = resp.headers().get("x-kvmesh-replica").and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    // Server-sent events: `data: {json}\n\n` chunks; a chunk with choices is a token, the one
    // with `usage` and no choices carries the cached tokens, `[DONE]` ends the stream.
    let mut sse = kvmesh_events::SseReader::new();
    loop {
        match resp.chunk().await {
            Ok(Some(bytes)) => sse.push(&bytes),
            Ok(None) => break,
            Err(e) => {
                o.error = Some(format!("stream: {e}"));
                return o;
            }
        }
        while let Some(event) = sse.next_event() {
            if event.is_done() {
                o.e2e_s = Some(t0.elapsed().as_secs_f64() * speed);
                continue;
            }
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&event.data) else { continue };
            if let Some(err) = v.get("error") {
                o.error = Some(format!("engine: {}", err["message"].as_str().unwrap_or("error")));
                return o;
            }
            if o.ttft_s.is_none() && v["choices"].as_array().is_some_and(|c| !c.is_empty()) {
                o.ttft_s = Some(t0.elapsed().as_secs_f64() * speed);
            }
            if let Some(c) = v.pointer("/usage/prompt_tokens_details/cached_tokens").and_then(|c| c.as_u64()) {
                o.cached_tokens = c as u32;
            }
        }
        // Events are taken as they complete; nothing of them is kept.
        drop(sse.take_parsed());
    }
    if o.ttft_s.is_none() {
        o.error = Some("stream ended before the first token".into());
    }
    o
}

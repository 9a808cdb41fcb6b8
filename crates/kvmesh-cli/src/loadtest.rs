//! `kvmesh loadtest`: a small, real load generator for routers and engines.
//!
//! - `--mode http`: POSTs `/v1/completions` (prompt = one of `--prefixes` shared system
//!   prompts of `--prefix-tokens` + a unique question, `max_tokens` as given) open-loop at `--rate` requests/s
//!   (arrivals evenly spaced; at most `--concurrency` in flight, excess counted as dropped),
//!   or closed-loop with `--concurrency` workers when `--rate 0` (saturation). Reports
//!   achieved requests/s and latency p50/p90/p99 (HdrHistogram; successful requests only),
//!   errors by status, and the same latencies by the replica that served each request (a
//!   kvmesh node's `x-kvmesh-replica` answer header). With
//!   `--baseline`, a second stream at the same rate goes to other URLs, interleaved, and the
//!   difference of the two is reported (a router's added latency).
//! - `--mode route`: closed-loop gRPC `Router.Route` + `Router.Release` pairs against a kvmesh
//!   node; reports Route calls/s and Route latency.
//! - `--mode epp`: closed-loop requests through a node's endpoint picker (Envoy ext_proc,
//!   full duplex) as a gateway sends them; reports picks/s and the pick's latency ([`epp`]).

mod epp;

mod summary;
use summary::Summary;

use crate::cli::LoadtestArgs;
use hdrhistogram::Histogram;
use kvmesh_proto::v1;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Tally {
    latency: Option<Histogram<u64>>,
    /// With `--stream`: microseconds to each successful answer's first chunk.
    ttft: Option<Histogram<u64>>,
    /// With `--stream`: microseconds between successive chunks of successful answers (ITL:
    /// one token per chunk, as vLLM streams).
    itl: Option<Histogram<u64>>,
    ok: u64,
    errors: BTreeMap<String, u64>,
    /// Requests retried once on the next URL after a refused or reset connection.
    retried: u64,
    /// Open loop: arrivals not sent because `--concurrency` requests were in flight.
    dropped: u64,
    /// Successful requests' latency by the replica that served them (`x-kvmesh-replica`).
    by_replica: BTreeMap<String, Histogram<u64>>,
}

/// What one successful request brought back: microseconds to its first chunk when streamed,
/// the replica a kvmesh node says served it, and the gaps between its chunks (streamed),
/// microseconds.
type Answer = (Option<u64>, Option<String>, Vec<u64>);

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds")
}

impl Tally {
    /// One request that took `us` microseconds; on success, what it brought back.
    fn record(&mut self, us: u64, result: Result<Answer, String>) {
        let h = self.latency.get_or_insert_with(histogram);
        match result {
            Ok((ttft_us, replica, gaps)) => {
                self.ok += 1;
                let _ = h.record(us.max(1));
                if let Some(t) = ttft_us {
                    let _ = self.ttft.get_or_insert_with(histogram).record(t.max(1));
                }
                for g in gaps {
                    let _ = self.itl.get_or_insert_with(histogram).record(g.max(1));
                }
                if let Some(r) = replica {
                    let _ = self.by_replica.entry(r).or_insert_with(histogram).record(us.max(1));
                }
            }
            Err(e) => *self.errors.entry(e).or_default() += 1,
        }
    }
}

/// Whether the run is open loop: HTTP at `--rate` > 0 (`route` and `epp` run closed loop
/// whatever `--rate` says).
fn is_open_loop(args: &LoadtestArgs) -> bool {
    args.rate > 0.0 && args.mode == "http"
}

/// The report's first line: what was driven, how, and the rate achieved (`rps`, successful
/// requests per second over `elapsed` seconds).
fn headline(args: &LoadtestArgs, rps: f64, elapsed: f64) -> String {
    let offered = if is_open_loop(args) {
        format!("{:.0} req/s offered", args.rate)
    } else {
        format!("closed loop, saturation ({} workers)", args.concurrency)
    };
    format!("{} {}: {offered}, {rps:.0} ok/s over {elapsed:.1} s", args.mode, args.url)
}

pub fn run(args: &LoadtestArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.duration > 0.0 && args.warmup >= 0.0, "duration must be positive and warmup non-negative");
    anyhow::ensure!(args.rate >= 0.0 && args.rate.is_finite(), "rate must be ≥ 0 (0: saturation)");
    anyhow::ensure!(args.concurrency > 0, "concurrency must be positive");
    if let Some(b) = &args.baseline {
        anyhow::ensure!(args.mode == "http", "--baseline needs --mode http (it is {:?})", args.mode);
        anyhow::ensure!(args.rate > 0.0, "--baseline needs an open-loop run: --rate > 0");
        check_urls("--baseline", b)?;
    }
    if args.mode == "http" {
        check_urls("--url", &args.url)?;
    }
    anyhow::ensure!(!args.stream || args.mode == "http", "--stream needs --mode http (it is {:?})", args.mode);
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (tally, baseline, elapsed) = runtime.block_on(async {
        match args.mode.as_str() {
            "http" => http(args).await,
            "route" => route(args).await.map(|(t, e)| (t, None, e)),
            "epp" => epp::run(args).await.map(|(t, e)| (t, None, e)),
            other => anyhow::bail!("unknown --mode {other:?}: use http, route or epp"),
        }
    })?;
    let target = Summary::new(&tally, elapsed);
    let baseline = baseline.map(|b| Summary::new(&b, elapsed));
    let comparable = baseline.as_ref().is_some_and(|b| b.ok > 0 && target.ok > 0);
    let open_loop = is_open_loop(args);
    if args.json {
        let mut v = serde_json::json!({
            "mode": args.mode, "url": args.url, "offered_rps": if open_loop { args.rate } else { 0.0 },
            "workers": (!open_loop).then_some(args.concurrency), "achieved_rps": target.rps, "ok": tally.ok,
            "errors": tally.errors, "retried": tally.retried, "dropped": tally.dropped, "p50_ms": target.p50_ms,
            "p90_ms": target.p90_ms, "p99_ms": target.p99_ms, "max_ms": target.max_ms, "seconds": elapsed,
        });
        if !tally.by_replica.is_empty() {
            let by: serde_json::Map<String, serde_json::Value> = tally
                .by_replica
                .iter()
                .map(|(name, h)| {
                    let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
                    let v = serde_json::json!({"ok": h.len(), "p50_ms": q(0.5), "p99_ms": q(0.99), "max_ms": h.max() as f64 / 1000.0});
                    (name.clone(), v)
                })
                .collect();
            v["by_replica"] = by.into();
        }
        let ttft = |v: &mut serde_json::Value, s: &Summary| {
            if let Some([p50, p90, p99]) = s.ttft_ms {
                v["ttft_p50_ms"] = p50.into();
                v["ttft_p90_ms"] = p90.into();
                v["ttft_p99_ms"] = p99.into();
            }
            if let Some([p50, p99]) = s.itl_ms {
                v["itl_p50_ms"] = p50.into();
                v["itl_p99_ms"] = p99.into();
            }
        };
        ttft(&mut v, &target);
        if let (Some(b), Some(url)) = (&baseline, &args.baseline) {
            v["baseline"] = serde_json::json!({
                "url": url, "achieved_rps": b.rps, "ok": b.ok, "errors": b.errors, "retried": b.retried, "dropped": b.dropped,
                "p50_ms": b.p50_ms, "p90_ms": b.p90_ms, "p99_ms": b.p99_ms, "max_ms": b.max_ms,
            });
            ttft(&mut v["baseline"], b);
            // Null when a side has no successful request: there is nothing to subtract.
            let added = |t: f64, b: f64| comparable.then(|| ((t - b) * 1000.0).round() / 1000.0);
            v["added_p50_ms"] = added(target.p50_ms, b.p50_ms).into();
            v["added_p99_ms"] = added(target.p99_ms, b.p99_ms).into();
        }
        println!("{v}");
    } else {
        println!("{}", headline(args, target.rps, elapsed));
        target.print();
        for (name, h) in &tally.by_replica {
            let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
            println!("  served by {name}: {} ok, p50 {:.2} ms, p99 {:.2} ms", h.len(), q(0.5), q(0.99));
        }
        if let (Some(b), Some(url)) = (&baseline, &args.baseline) {
            println!("baseline {url}: {:.0} ok/s (interleaved with the above)", b.rps);
            b.print();
            if comparable {
                println!(
                    "added by {} (its p50 and p99 minus the baseline's): p50 {:.3} ms, p99 {:.3} ms",
                    args.url,
                    target.p50_ms - b.p50_ms,
                    target.p99_ms - b.p99_ms
                );
            }
        }
    }
    if let (false, Some(b)) = (comparable, &baseline) {
        anyhow::bail!(
            "no added latency: {} requests succeeded on --url {}, {} on --baseline (see the errors above)",
            target.ok,
            args.url,
            b.ok
        );
    }
    // A run in which nothing succeeded measured nothing: say so in the exit status.
    if target.ok == 0 && !tally.errors.is_empty() {
        anyhow::bail!("no request to {} succeeded (errors above: {:?})", args.url, tally.errors);
    }
    Ok(())
}

/// Every comma-separated entry of `urls` must be an `http://` or `https://` URL with a host.
fn check_urls(flag: &str, urls: &str) -> anyhow::Result<()> {
    for u in urls.split(',').map(str::trim) {
        let ok = reqwest::Url::parse(u).is_ok_and(|p| matches!(p.scheme(), "http" | "https") && p.host().is_some());
        anyhow::ensure!(ok, "{flag}: {u:?} is not an http:// or https:// URL with a host (e.g. http://127.0.0.1:8000)");
    }
    Ok(())
}

/// The `i`-th prompt of a stream: one of `prefixes` shared system prompts of `prefix_tokens`
/// tokens (4 bytes each, as `kvmesh_core::prompt::approximate_tokens` counts) and a unique
/// question (`tag` keeps two interleaved streams' questions apart, so neither hits the
/// other's cached blocks beyond the shared prefix).
fn prompt(i: u64, prefixes: u32, tag: &str, prefix_tokens: u32) -> String {
    let sentence = format!("System prompt number {} for the load test. ", i % prefixes.max(1) as u64);
    let system: String = sentence.chars().cycle().take(4 * prefix_tokens as usize).collect();
    format!("{system}Question {tag}{i}: what is the answer?")
}

/// The requests sent to one list of base URLs (in turn), and what came back. Each stream has
/// its own `--concurrency` cap: a slow router does not hold back its baseline.
struct Stream {
    urls: Vec<String>,
    tag: &'static str,
    next: AtomicU64,
    in_flight: AtomicU64,
    tally: Mutex<Tally>,
}

impl Stream {
    fn new(urls: &str, tag: &'static str) -> Arc<Stream> {
        let urls = urls.split(',').map(|u| format!("{}/v1/completions", u.trim().trim_end_matches('/'))).collect();
        Arc::new(Stream {
            urls,
            tag,
            next: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            tally: Mutex::new(Tally::default()),
        })
    }

    fn into_tally(self: Arc<Stream>) -> anyhow::Result<Tally> {
        let s = Arc::try_unwrap(self).map_err(|_| anyhow::anyhow!("tasks still running"))?;
        Ok(s.tally.into_inner().unwrap_or_default())
    }

    fn tally(&self) -> std::sync::MutexGuard<'_, Tally> {
        self.tally.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// What each HTTP request is made of (from [`LoadtestArgs`]).
#[derive(Debug, Clone, Copy)]
struct Knobs {
    max_tokens: u32,
    prefixes: u32,
    prefix_tokens: u32,
    retry_once: bool,
    streamed: bool,
}

/// Sends one request of `stream` (its next prompt, to its next URL) and records it if it
/// started at or after `measure_from`.
async fn one(client: reqwest::Client, stream: Arc<Stream>, knobs: Knobs, measure_from: Instant) {
    let Knobs { max_tokens, prefixes, prefix_tokens, retry_once, streamed } = knobs;
    let i = stream.next.fetch_add(1, Ordering::Relaxed);
    let url = &stream.urls[i as usize % stream.urls.len()];
    let next_url = &stream.urls[(i as usize + 1) % stream.urls.len()];
    let text = prompt(i, prefixes, stream.tag, prefix_tokens);
    let mut body = serde_json::json!({"model": "kvmesh-sim-llama-3-8b", "prompt": text, "max_tokens": max_tokens});
    if streamed {
        body["stream"] = true.into();
    }
    let t = Instant::now();
    let send = |url: &str| {
        let request = client.post(url).json(&body);
        async move {
            match request.send().await {
                Ok(r) if r.status().is_success() => {
                    let replica = r.headers().get("x-kvmesh-replica").and_then(|v| v.to_str().ok()).map(str::to_string);
                    read_body(r, streamed.then_some(t)).await.map(|(ttft, gaps)| (ttft, replica, gaps))
                }
                Ok(r) => Err(format!("HTTP {}", r.status().as_u16())),
                Err(e) => Err(if e.is_connect() { "connect".into() } else { "request".into() }),
            }
        }
    };
    let mut result = send(url).await;
    // A client of a router tier retries a refused or reset connection once, on the next
    // router (no response means the request never reached an engine's answer).
    let transport = matches!(&result, Err(e) if e == "connect" || e == "request");
    if retry_once && transport {
        result = send(next_url).await;
        stream.tally().retried += 1;
    }
    if t >= measure_from {
        stream.tally().record(t.elapsed().as_micros() as u64, result);
    }
}

/// Reads an answer to its end; with `streamed_since`, returns the microseconds from then to
/// its first chunk, and the gaps between its chunks. A stream is whole only if it ends with
/// `data: [DONE]` and carries no error event (what a router sends when its upstream breaks
/// off after the 200: `sse_error`, `sse_truncated`), as OpenAI's clients judge it.
async fn read_body(
    mut r: reqwest::Response,
    streamed_since: Option<Instant>,
) -> Result<(Option<u64>, Vec<u64>), String> {
    let mut first = None;
    let mut gaps = Vec::new();
    let mut last: Option<Instant> = None;
    let mut sse = kvmesh_events::SseReader::new();
    let (mut done, mut error) = (false, false);
    while let Some(chunk) = r.chunk().await.map_err(|e| format!("body: {e}"))? {
        first = first.or_else(|| streamed_since.map(|t| t.elapsed().as_micros() as u64));
        if streamed_since.is_some() {
            let now = Instant::now();
            if let Some(l) = last {
                gaps.push(now.duration_since(l).as_micros() as u64);
            }
            last = Some(now);
            sse.push(&chunk);
            while let Some(event) = sse.next_event() {
                done |= event.is_done();
                error |= is_error_event(&event.data);
            }
            sse.take_parsed();
        }
    }
    match (streamed_since.is_some(), error, done) {
        (true, true, _) => Err("sse_error".into()),
        (true, false, false) => Err("sse_truncated".into()),
        _ => Ok((first, gaps)),
    }
}

/// Whether an SSE event's data is an error object (`{"error": …}`), not a token chunk.
fn is_error_event(data: &str) -> bool {
    data.contains("\"error\"")
        && serde_json::from_str::<serde_json::Value>(data).is_ok_and(|v| v.get("error").is_some_and(|e| !e.is_null()))
}

async fn http(args: &LoadtestArgs) -> anyhow::Result<(Tally, Option<Tally>, f64)> {
    let target = Stream::new(&args.url, "");
    let baseline = args.baseline.as_deref().map(|b| Stream::new(b, "b"));
    let streams: Vec<Arc<Stream>> = std::iter::once(target.clone()).chain(baseline.clone()).collect();
    let client = reqwest::Client::builder().pool_max_idle_per_host(args.concurrency).build()?;
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.duration);
    let knobs = Knobs {
        max_tokens: args.max_tokens,
        prefixes: args.prefixes,
        prefix_tokens: args.prefix_tokens,
        retry_once: args.retry_once,
        streamed: args.stream,
    };
    if args.rate > 0.0 {
        // Each stream at `rate`, their arrivals alternating: both see the same seconds of the
        // machine, so drift between runs cancels out of their difference.
        let gap = Duration::from_secs_f64(1.0 / args.rate / streams.len() as f64);
        let mut at = start;
        let mut tasks = Vec::new();
        for slot in 0usize.. {
            if at >= end {
                break;
            }
            tokio::time::sleep_until(at.into()).await;
            let stream = streams[slot % streams.len()].clone();
            if stream.in_flight.load(Ordering::Relaxed) >= args.concurrency as u64 {
                if at >= measure_from {
                    stream.tally().dropped += 1;
                }
            } else {
                stream.in_flight.fetch_add(1, Ordering::Relaxed);
                let f = one(client.clone(), stream.clone(), knobs, measure_from);
                tasks.push(tokio::spawn(async move {
                    f.await;
                    stream.in_flight.fetch_sub(1, Ordering::Relaxed);
                }));
            }
            at += gap;
        }
        for t in tasks {
            let _ = t.await;
        }
    } else {
        let workers: Vec<_> = (0..args.concurrency)
            .map(|_| {
                let (client, target) = (client.clone(), target.clone());
                tokio::spawn(async move {
                    while Instant::now() < end {
                        one(client.clone(), target.clone(), knobs, measure_from).await;
                    }
                })
            })
            .collect();
        for w in workers {
            let _ = w.await;
        }
    }
    drop(streams);
    let baseline = baseline.map(Stream::into_tally).transpose()?;
    Ok((target.into_tally()?, baseline, args.duration))
}

async fn route(args: &LoadtestArgs) -> anyhow::Result<(Tally, f64)> {
    let (prefixes, prefix_tokens) = (args.prefixes, args.prefix_tokens);
    grpc_closed_loop(args, move |channel, i| async move {
        let mut client = v1::router_client::RouterClient::new(channel);
        let t = Instant::now();
        let req = v1::RouteRequest {
            model: String::new(),
            prompt: Some(v1::route_request::Prompt::Text(prompt(i, prefixes, "", prefix_tokens))),
            max_tokens: Some(16),
            session_key: None,
            lora_name: None,
            expected_output_tokens: None,
            cache_salt: None,
            accept_disaggregated: false,
        };
        let r = client.route(req).await.map_err(|e| format!("{:?}", e.code()))?;
        let us = t.elapsed().as_micros() as u64;
        let booking = r.into_inner().booking;
        let _ = client.release(v1::ReleaseRequest { booking, output_tokens: Some(16) }).await;
        Ok(us)
    })
    .await
}

/// Closed loop against a node's gRPC port: `--concurrency` workers on a few HTTP/2
/// connections (as a fleet of proxies would open; one would serialize on its connection
/// task), each calling `one(channel, i)` for request `i` — its latency, microseconds, or what
/// went wrong — until the run ends. Requests begun in the warm-up are not recorded.
async fn grpc_closed_loop<F, Fut>(args: &LoadtestArgs, one: F) -> anyhow::Result<(Tally, f64)>
where
    F: Fn(tonic::transport::Channel, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<u64, String>> + Send,
{
    let mut channels = Vec::new();
    for _ in 0..args.concurrency.clamp(1, 4) {
        channels.push(crate::connect::channel(&args.url, "is the node's gRPC port there?").await?);
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next = Arc::new(AtomicU64::new(0));
    let measure_from = Instant::now() + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.duration);
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let (channel, tally, next, one) =
                (channels[w % channels.len()].clone(), tally.clone(), next.clone(), one.clone());
            tokio::spawn(async move {
                while Instant::now() < end {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let result = one(channel.clone(), i).await;
                    if t >= measure_from {
                        let mut tl = tally.lock().unwrap_or_else(|p| p.into_inner());
                        match result {
                            Ok(us) => tl.record(us, Ok((None, None, Vec::new()))),
                            Err(e) => tl.record(0, Err(e)),
                        }
                    }
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.await;
    }
    let tally =
        Arc::try_unwrap(tally).map_err(|_| anyhow::anyhow!("tasks still running"))?.into_inner().unwrap_or_default();
    Ok((tally, args.duration))
}

#[cfg(test)]
mod tests;

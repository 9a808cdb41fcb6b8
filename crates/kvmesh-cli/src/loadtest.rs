//! `kvmesh loadtest`: a small, real load generator for routers and engines.
//!
//! - `--mode http`: POSTs `/v1/completions` (prompt = one of `--prefixes` shared system
//!   prompts + a unique question, `max_tokens` as given) open-loop at `--rate` requests/s
//!   (arrivals evenly spaced; at most `--concurrency` in flight, excess counted as dropped),
//!   or closed-loop with `--concurrency` workers when `--rate 0` (saturation). Reports
//!   achieved requests/s and latency p50/p90/p99 (HdrHistogram), errors by status.
//! - `--mode route`: closed-loop gRPC `Router.Route` + `Router.Release` pairs against a kvmesh
//!   node; reports Route calls/s and Route latency.

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
    ok: u64,
    errors: BTreeMap<String, u64>,
    /// Requests retried once on the next URL after a refused or reset connection.
    retried: u64,
}

impl Tally {
    fn record(&mut self, us: u64, result: Result<(), String>) {
        let h =
            self.latency.get_or_insert_with(|| Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds"));
        match result {
            Ok(()) => {
                self.ok += 1;
                let _ = h.record(us.max(1));
            }
            Err(e) => *self.errors.entry(e).or_default() += 1,
        }
    }
}

pub fn run(args: &LoadtestArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.duration > 0.0 && args.warmup >= 0.0, "duration must be positive and warmup non-negative");
    anyhow::ensure!(args.rate >= 0.0 && args.rate.is_finite(), "rate must be ≥ 0 (0: saturation)");
    anyhow::ensure!(args.concurrency > 0, "concurrency must be positive");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let (tally, elapsed, dropped) = runtime.block_on(async {
        match args.mode.as_str() {
            "http" => http(args).await,
            "route" => route(args).await,
            other => anyhow::bail!("unknown --mode {other:?}: use http or route"),
        }
    })?;
    let h = tally.latency.unwrap_or_else(|| Histogram::new(3).expect("valid"));
    let q = |p: f64| h.value_at_quantile(p) as f64 / 1000.0;
    let rps = tally.ok as f64 / elapsed;
    if args.json {
        let v = serde_json::json!({
            "mode": args.mode, "url": args.url, "offered_rps": args.rate, "achieved_rps": rps, "ok": tally.ok,
            "errors": tally.errors, "retried": tally.retried, "dropped": dropped, "p50_ms": q(0.5), "p90_ms": q(0.9), "p99_ms": q(0.99),
            "max_ms": h.max() as f64 / 1000.0, "seconds": elapsed,
        });
        println!("{v}");
    } else {
        let offered = if args.rate > 0.0 {
            format!("{:.0} req/s offered", args.rate)
        } else {
            format!("saturation ({} workers)", args.concurrency)
        };
        println!("{} {}: {offered}, {rps:.0} ok/s over {elapsed:.1} s", args.mode, args.url);
        println!(
            "  latency p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            q(0.5),
            q(0.9),
            q(0.99),
            h.max() as f64 / 1000.0
        );
        if tally.retried > 0 {
            println!("  retried on the next URL after a refused or reset connection: {}", tally.retried);
        }
        if !tally.errors.is_empty() || dropped > 0 {
            println!("  errors {:?}, dropped (over --concurrency in flight) {dropped}", tally.errors);
        }
    }
    Ok(())
}

fn prompt(i: u64, prefixes: u32) -> String {
    let system = format!("System prompt number {} for the load test. ", i % prefixes.max(1) as u64).repeat(16);
    format!("{system}Question {i}: what is the answer?")
}

async fn http(args: &LoadtestArgs) -> anyhow::Result<(Tally, f64, u64)> {
    let urls: Vec<String> =
        args.url.split(',').map(|u| format!("{}/v1/completions", u.trim().trim_end_matches('/'))).collect();
    let client = reqwest::Client::builder().pool_max_idle_per_host(args.concurrency).build()?;
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next = Arc::new(AtomicU64::new(0));
    let in_flight = Arc::new(AtomicU64::new(0));
    let retried = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.duration);
    let one = {
        let (client, urls, tally, max_tokens, prefixes) =
            (client.clone(), urls.clone(), tally.clone(), args.max_tokens, args.prefixes);
        let (retry_once, retried) = (args.retry_once, retried.clone());
        move |i: u64| {
            let (client, url, tally) = (client.clone(), urls[i as usize % urls.len()].clone(), tally.clone());
            let next_url = urls[(i as usize + 1) % urls.len()].clone();
            let retried = retried.clone();
            async move {
                let body = serde_json::json!({"model": "kvmesh-sim-llama-3-8b", "prompt": prompt(i, prefixes), "max_tokens": max_tokens});
                let t = Instant::now();
                let send = |url: String| {
                    let (client, body) = (client.clone(), body.clone());
                    async move {
                        match client.post(&url).json(&body).send().await {
                            Ok(r) if r.status().is_success() => {
                                r.bytes().await.map(|_| ()).map_err(|e| format!("body: {e}"))
                            }
                            Ok(r) => Err(format!("HTTP {}", r.status().as_u16())),
                            Err(e) => Err(if e.is_connect() { "connect".into() } else { "request".into() }),
                        }
                    }
                };
                let mut result = send(url).await;
                // A client of a router tier retries a refused or reset connection once, on the
                // next router (no response means the request never reached an engine's answer).
                let transport = matches!(&result, Err(e) if e == "connect" || e == "request");
                if retry_once && transport {
                    result = send(next_url).await;
                    retried.fetch_add(1, Ordering::Relaxed);
                }
                if t >= measure_from {
                    tally.lock().unwrap_or_else(|p| p.into_inner()).record(t.elapsed().as_micros() as u64, result);
                }
            }
        }
    };
    let mut dropped = 0;
    if args.rate > 0.0 {
        let gap = Duration::from_secs_f64(1.0 / args.rate);
        let mut at = start;
        let mut tasks = Vec::new();
        while at < end {
            tokio::time::sleep_until(at.into()).await;
            if in_flight.load(Ordering::Relaxed) >= args.concurrency as u64 {
                if at >= measure_from {
                    dropped += 1;
                }
            } else {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let (f, flight) = (one(i), in_flight.clone());
                flight.fetch_add(1, Ordering::Relaxed);
                tasks.push(tokio::spawn(async move {
                    f.await;
                    flight.fetch_sub(1, Ordering::Relaxed);
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
                let (one, next) = (one.clone(), next.clone());
                tokio::spawn(async move {
                    while Instant::now() < end {
                        one(next.fetch_add(1, Ordering::Relaxed)).await;
                    }
                })
            })
            .collect();
        for w in workers {
            let _ = w.await;
        }
    }
    drop(one);
    let mut tally =
        Arc::try_unwrap(tally).map_err(|_| anyhow::anyhow!("tasks still running"))?.into_inner().unwrap_or_default();
    tally.retried = retried.load(Ordering::Relaxed);
    Ok((tally, args.duration, dropped))
}

async fn route(args: &LoadtestArgs) -> anyhow::Result<(Tally, f64, u64)> {
    // A few HTTP/2 connections, as a fleet of proxies would open; one would serialize on its
    // connection task.
    let mut channels = Vec::new();
    for _ in 0..args.concurrency.clamp(1, 4) {
        channels.push(crate::connect::channel(&args.url, "is the node's gRPC port there?").await?);
    }
    let tally = Arc::new(Mutex::new(Tally::default()));
    let next = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let measure_from = start + Duration::from_secs_f64(args.warmup);
    let end = measure_from + Duration::from_secs_f64(args.duration);
    let workers: Vec<_> = (0..args.concurrency)
        .map(|w| {
            let channel = channels[w % channels.len()].clone();
            let (mut client, tally, next, prefixes) =
                (v1::router_client::RouterClient::new(channel), tally.clone(), next.clone(), args.prefixes);
            tokio::spawn(async move {
                while Instant::now() < end {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let t = Instant::now();
                    let req = v1::RouteRequest {
                        model: String::new(),
                        prompt: Some(v1::route_request::Prompt::Text(prompt(i, prefixes))),
                        max_tokens: Some(16),
                        session_key: None,
                        lora_name: None,
                    };
                    let result = match client.route(req).await {
                        Ok(r) => {
                            let us = t.elapsed().as_micros() as u64;
                            let id = r.into_inner().booking_id;
                            let _ =
                                client.release(v1::ReleaseRequest { booking_id: id, output_tokens: Some(16) }).await;
                            Ok(us)
                        }
                        Err(e) => Err(format!("{:?}", e.code())),
                    };
                    if t >= measure_from {
                        let mut tl = tally.lock().unwrap_or_else(|p| p.into_inner());
                        match result {
                            Ok(us) => tl.record(us, Ok(())),
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
    Ok((tally, args.duration, 0))
}

//! `node-follow`: how many replicas one kvmesh node can follow.
//!
//! Per fleet size: the fleet emulator ([`kvmesh_engine_sim::fleet`], in this process) publishes
//! vLLM-format KV events and metrics for N replicas; a `kvmesh node` (a child process, built
//! beforehand) follows all of them; after a warm-up that fills every replica's cache, two
//! windows are measured: events alone, then events with `kvmesh loadtest --mode route`
//! (closed-loop gRPC `Route` + `Release`) running against the node. Reported per window:
//! batches published and applied, event lag p50/p99 (engine publish → applied at the node,
//! from the node's `kvmesh_event_lag_seconds` histogram, interpolated within its buckets as
//! Prometheus' `histogram_quantile` does), the node's CPU per applied batch (`/proc` utime +
//! stime over the window ÷ batches), its RSS, and Route calls/s and p50/p99.
//!
//! All three processes share the machine's cores: on a 2-core machine the emulator and the
//! load generator take CPU the node would otherwise have.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use anyhow::Context;
use clap::Parser;
use comfy_table::{presets::ASCII_MARKDOWN, Table};
use kvmesh_engine_sim::fleet::{self, FleetConfig};
use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// One kvmesh node following an emulated fleet of busy vLLM replicas: event lag, Route
/// throughput and latency alongside, CPU per event batch, RSS.
#[derive(Debug, Parser)]
#[command(name = "node-follow")]
struct Args {
    /// Fleet sizes, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    replicas: Vec<usize>,
    /// Scheduler steps per second of each replica (one event batch per busy step).
    #[arg(long, default_value_t = 25.0)]
    steps_per_s: f64,
    /// Requests per second arriving at each emulated replica.
    #[arg(long, default_value_t = 1.0)]
    request_rate: f64,
    /// KV-cache capacity of each replica, blocks.
    #[arg(long, default_value_t = 2048)]
    capacity_blocks: usize,
    /// Seconds after every replica's first event before measuring (fills the caches).
    #[arg(long, default_value_t = 20.0)]
    warmup: f64,
    /// Seconds of each measured window.
    #[arg(long, default_value_t = 10.0)]
    duration: f64,
    /// Closed-loop Route workers of the load generator.
    #[arg(long, default_value_t = 8)]
    route_workers: usize,
    /// Serve each replica's metrics as only the families a router reads, instead of a vLLM
    /// server's whole page (600 lines, 60 KB, mostly histograms), as the runs before
    /// 2026-12-07 did.
    #[arg(long)]
    minimal_metrics_pages: bool,
    /// The `kvmesh` binary (`cargo build --release -p kvmesh-cli`).
    #[arg(long, default_value = "target/release/kvmesh")]
    kvmesh: PathBuf,
    /// The node's HTTP address.
    #[arg(long, default_value = "127.0.0.1:19501")]
    node_http: String,
    /// The node's gRPC address.
    #[arg(long, default_value = "127.0.0.1:19502")]
    node_grpc: String,
    /// Fail (exit 1) when a window's node applied under 90 % of the batches published, or a
    /// Route call failed (CI's smoke run).
    #[arg(long)]
    strict: bool,
    /// Also write the results here as JSON.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// The node's figures at one moment.
#[derive(Debug, Clone, Default)]
struct Snapshot {
    /// `kvmesh_event_lag_seconds` buckets: (upper bound, cumulative count); +Inf last.
    lag: Vec<(f64, u64)>,
    /// CPU seconds the node has used.
    cpu_s: f64,
    /// Resident set, bytes.
    rss: u64,
    /// Batches the emulator has published.
    published: u64,
    /// Replicas with at least one applied store.
    replicas_applied: usize,
}

/// One measured window.
#[derive(Debug, serde::Serialize)]
struct Window {
    replicas: usize,
    route: bool,
    seconds: f64,
    published: u64,
    applied: u64,
    lag_p50_ms: Option<f64>,
    lag_p99_ms: Option<f64>,
    cpu_us_per_batch: f64,
    node_cpu_share: f64,
    rss_mib: f64,
    rss_kib_per_replica: f64,
    route_calls_per_s: Option<f64>,
    route_p50_ms: Option<f64>,
    route_p99_ms: Option<f64>,
    route_errors: Option<serde_json::Value>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.kvmesh.exists(),
        "{} not found: build it first (cargo build --release -p kvmesh-cli) or pass --kvmesh",
        args.kvmesh.display()
    );
    // One thread for the emulator: the node and the load generator need the other core.
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let mut windows = Vec::new();
    for &n in &args.replicas {
        eprintln!("node-follow: {n} replicas");
        windows.extend(runtime.block_on(measure(&args, n))?);
    }
    print_table(&windows);
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&windows)?).with_context(|| format!("{}", path.display()))?;
    }
    if args.strict {
        for w in &windows {
            anyhow::ensure!(
                w.applied as f64 >= 0.9 * w.published as f64 && w.published > 0,
                "{} replicas: the node applied {} of {} batches published",
                w.replicas,
                w.applied,
                w.published
            );
            let errors = w.route_errors.as_ref().and_then(|e| e.as_object()).map_or(0, |e| e.len());
            anyhow::ensure!(errors == 0, "{} replicas: Route calls failed: {:?}", w.replicas, w.route_errors);
            anyhow::ensure!(!w.route || w.route_calls_per_s.unwrap_or(0.0) > 0.0, "no Route call succeeded");
        }
    }
    Ok(())
}

/// Kills the node when dropped (every exit path of [`measure`]).
struct NodeProcess(Child);

impl Drop for NodeProcess {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

async fn measure(args: &Args, n: usize) -> anyhow::Result<Vec<Window>> {
    let config = FleetConfig {
        replicas: n,
        steps_per_s: args.steps_per_s,
        request_rate: args.request_rate,
        capacity_blocks: args.capacity_blocks,
        full_metrics_pages: !args.minimal_metrics_pages,
        ..FleetConfig::default()
    };
    let fleet = fleet::start(config).await?;
    let dir = std::env::temp_dir().join(format!("kvmesh-node-follow-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config_path = dir.join("node.toml");
    let mut toml =
        format!("[node]\nhttp = \"{}\"\ngrpc = \"{}\"\nscrape_interval = \"1s\"\n", args.node_http, args.node_grpc);
    for (i, (events, metrics)) in fleet.kv_events.iter().zip(&fleet.metrics_urls).enumerate() {
        let _ = write!(
            toml,
            "\n[[replicas]]\nname = \"r{i}\"\nhttp = \"{}\"\nkv_events = \"{events}\"\nmetrics_url = \"{metrics}\"\ncapacity_blocks = {}\n",
            metrics.trim_end_matches("/metrics"),
            args.capacity_blocks
        );
    }
    std::fs::write(&config_path, toml)?;
    let log = std::fs::File::create(dir.join("node.log"))?;
    let child = Command::new(&args.kvmesh)
        .args(["node", "--config"])
        .arg(&config_path)
        .env("RUST_LOG", "warn")
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", args.kvmesh.display()))?;
    let node = NodeProcess(child);
    let pid = node.0.id();
    let client = reqwest::Client::new();
    let metrics_url = format!("http://{}/metrics", args.node_http);
    let snap = |client: &reqwest::Client| {
        let (client, url, stats) = (client.clone(), metrics_url.clone(), fleet.stats.clone());
        async move {
            let text = client.get(&url).send().await?.error_for_status()?.text().await?;
            let mut s = parse_metrics(&text);
            let (cpu_s, rss) = process_usage(pid)?;
            s.cpu_s = cpu_s;
            s.rss = rss;
            s.published = stats.batches.load(Ordering::Relaxed);
            anyhow::Ok(s)
        }
    };
    // Up, and every replica's events arriving.
    let deadline = Instant::now() + Duration::from_secs_f64(60.0 + n as f64 / 10.0);
    loop {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the node did not apply events from all {n} replicas in time (log: {})",
            dir.join("node.log").display()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
        if let Ok(s) = snap(&client).await {
            if s.replicas_applied >= n {
                break;
            }
        }
    }
    eprintln!("node-follow: {n} replicas followed; warming up {} s", args.warmup);
    tokio::time::sleep(Duration::from_secs_f64(args.warmup)).await;
    let mut windows = Vec::new();
    let s0 = snap(&client).await?;
    tokio::time::sleep(Duration::from_secs_f64(args.duration)).await;
    let s1 = snap(&client).await?;
    windows.push(window(n, None, &s0, &s1, args.duration));
    let started = Instant::now();
    let mut loadtest = Command::new(&args.kvmesh);
    loadtest
        .args(["loadtest", "--mode", "route", "--url"])
        .arg(format!("http://{}", args.node_grpc))
        .args(["--concurrency", &args.route_workers.to_string()])
        .args(["--duration", &args.duration.to_string(), "--warmup", "0", "--json"])
        .args(["--prefixes", "8", "--prefix-tokens", "1024"]);
    let out = tokio::task::spawn_blocking(move || loadtest.output()).await?.context("running kvmesh loadtest")?;
    let s2 = snap(&client).await?;
    anyhow::ensure!(out.status.success(), "loadtest failed: {}", String::from_utf8_lossy(&out.stderr));
    let route: serde_json::Value =
        serde_json::from_slice(&out.stdout).with_context(|| String::from_utf8_lossy(&out.stdout).to_string())?;
    windows.push(window(n, Some(route), &s1, &s2, started.elapsed().as_secs_f64()));
    drop(node);
    fleet.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(windows)
}

fn window(n: usize, route: Option<serde_json::Value>, a: &Snapshot, b: &Snapshot, seconds: f64) -> Window {
    let delta: Vec<(f64, u64)> =
        b.lag.iter().zip(&a.lag).map(|((le, x), (_, y))| (*le, x.saturating_sub(*y))).collect();
    let applied = delta.last().map_or(0, |(_, c)| *c);
    let cpu = b.cpu_s - a.cpu_s;
    let f = |k: &str| route.as_ref().and_then(|r| r[k].as_f64());
    Window {
        replicas: n,
        route: route.is_some(),
        seconds,
        published: b.published - a.published,
        applied,
        lag_p50_ms: quantile(&delta, 0.5).map(|s| s * 1e3),
        lag_p99_ms: quantile(&delta, 0.99).map(|s| s * 1e3),
        cpu_us_per_batch: if applied > 0 { cpu * 1e6 / applied as f64 } else { 0.0 },
        node_cpu_share: cpu / seconds,
        rss_mib: b.rss as f64 / (1 << 20) as f64,
        rss_kib_per_replica: b.rss as f64 / 1024.0 / n as f64,
        route_calls_per_s: f("achieved_rps"),
        route_p50_ms: f("p50_ms"),
        route_p99_ms: f("p99_ms"),
        route_errors: route.as_ref().map(|r| r["errors"].clone()),
    }
}

/// The `q` quantile of a cumulative histogram (bucket upper bounds, counts; +Inf last),
/// linear within the bucket; `None` with no samples or when it falls in the +Inf bucket.
fn quantile(buckets: &[(f64, u64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total == 0 {
        return None;
    }
    let rank = q * total as f64;
    let mut lower = (0.0, 0u64);
    for &(le, count) in buckets {
        if count as f64 >= rank {
            if le.is_infinite() {
                return None;
            }
            let within = (rank - lower.1 as f64) / (count - lower.1).max(1) as f64;
            return Some(lower.0 + (le - lower.0) * within);
        }
        lower = (le, count);
    }
    None
}

/// The lag buckets and the replicas with applied stores, from a node's `/metrics` page.
fn parse_metrics(text: &str) -> Snapshot {
    let mut s = Snapshot::default();
    let mut replicas = std::collections::HashSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("kvmesh_event_lag_seconds_bucket{le=\"") {
            let Some((le, count)) = rest.split_once("\"} ") else { continue };
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().unwrap_or(f64::NAN) };
            if let Ok(c) = count.trim().parse::<f64>() {
                s.lag.push((le, c as u64));
            }
        } else if line.starts_with("kvmesh_events_applied_total{") && line.contains("kind=\"stored\"") {
            if let Some(name) = line.split("replica=\"").nth(1).and_then(|r| r.split('"').next()) {
                replicas.insert(name.to_string());
            }
        }
    }
    s.replicas_applied = replicas.len();
    s
}

/// (CPU seconds, resident bytes) of process `pid`, from `/proc`.
fn process_usage(pid: u32) -> anyhow::Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at state, field 3.
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| fields.get(i - 3).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    // utime and stime are fields 14 and 15, in clock ticks (USER_HZ, 100 on Linux).
    let cpu = (ticks(14) + ticks(15)) / 100.0;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    Ok((cpu, rss_kib * 1024))
}

fn print_table(windows: &[Window]) {
    let mut t = Table::new();
    t.load_preset(ASCII_MARKDOWN);
    t.set_header([
        "replicas",
        "window",
        "batches published / applied",
        "event lag p50 / p99 ms",
        "node CPU µs / batch",
        "node CPU (cores)",
        "RSS MiB (KiB / replica)",
        "Route calls/s",
        "Route p50 / p99 ms",
    ]);
    let ms = |v: Option<f64>| v.map_or("> 554".to_string(), |v| format!("{v:.2}"));
    for w in windows {
        t.add_row([
            w.replicas.to_string(),
            if w.route { "events + Route" } else { "events" }.to_string(),
            format!("{} / {}", w.published, w.applied),
            format!("{} / {}", ms(w.lag_p50_ms), ms(w.lag_p99_ms)),
            format!("{:.1}", w.cpu_us_per_batch),
            format!("{:.2}", w.node_cpu_share),
            format!("{:.0} ({:.0})", w.rss_mib, w.rss_kib_per_replica),
            w.route_calls_per_s.map_or("—".into(), |v| format!("{v:.0}")),
            match (w.route_p50_ms, w.route_p99_ms) {
                (Some(a), Some(b)) => format!("{a:.3} / {b:.3}"),
                _ => "—".into(),
            },
        ]);
    }
    println!("{t}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_within_the_bucket() {
        let b = [(0.001, 50), (0.002, 90), (0.004, 100), (f64::INFINITY, 100)];
        assert_eq!(quantile(&b, 0.5), Some(0.001));
        // Rank 70 of 100: halfway through the (1, 2] ms bucket's 40.
        assert!((quantile(&b, 0.7).unwrap() - 0.0015).abs() < 1e-12);
        assert!((quantile(&b, 0.99).unwrap() - 0.0038).abs() < 1e-12);
        assert_eq!(quantile(&[(0.001, 1), (f64::INFINITY, 10)], 0.99), None);
        assert_eq!(quantile(&[(f64::INFINITY, 0)], 0.5), None);
    }

    #[test]
    fn the_metrics_page_gives_buckets_and_replicas() {
        let page =
            "kvmesh_event_lag_seconds_bucket{le=\"0.00025\"} 3\nkvmesh_event_lag_seconds_bucket{le=\"+Inf\"} 7\n\
                    kvmesh_events_applied_total{replica=\"r0\",kind=\"stored\"} 5\n\
                    kvmesh_events_applied_total{replica=\"r1\",kind=\"removed\"} 5\n\
                    kvmesh_events_applied_total{replica=\"r2\",kind=\"stored\"} 1\n";
        let s = parse_metrics(page);
        assert_eq!(s.lag, vec![(0.00025, 3), (f64::INFINITY, 7)]);
        assert_eq!(s.replicas_applied, 2);
    }
}

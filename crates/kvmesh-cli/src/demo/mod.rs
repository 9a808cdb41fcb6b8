//! `kvmesh demo`: a whole kvmesh tier on this machine, driven by real traffic, in about a
//! minute per policy.
//!
//! - [`workload`]: the requests (fitted built-in workload or a trace), rescaled to the rate.
//! - [`tier`]: engine-sims and a Raft cluster of router nodes, in this process, on loopback.
//! - [`drive`]: streaming OpenAI completions through the nodes, measuring TTFT.
//! - [`view`]: the live terminal view.
//! - [`report`]: the summary table and the report files.
//!
//! Everything runs in this process, so Ctrl-C (or any error) tears it all down: no orphans.

mod drive;
mod report;
mod tier;
mod view;
mod workload;

use crate::cli::DemoArgs;
use anyhow::Context;
use drive::Live;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tier::{Tier, TierSpec};

/// Resolves on Ctrl-C or SIGTERM; false if neither can be listened for.
async fn stop_signal() -> bool {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            return tokio::select! {
                r = tokio::signal::ctrl_c() => r.is_ok(),
                _ = term.recv() => true,
            };
        }
    }
    tokio::signal::ctrl_c().await.is_ok()
}

pub fn run(args: &DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.replicas > 0 && args.nodes > 0, "--replicas and --nodes must be at least 1");
    anyhow::ensure!(args.speed.is_finite() && args.speed > 0.0, "--speed must be a positive number");
    anyhow::ensure!(
        args.rate.is_finite() && args.rate > 0.0,
        "--rate must be a positive number of requests per second"
    );
    anyhow::ensure!(args.requests > 0, "--requests must be at least 1");
    // Before minutes of running, not after: the report must have somewhere to go.
    std::fs::create_dir_all(&args.out).map_err(|e| anyhow::anyhow!("--out {}: {e}", args.out.display()))?;
    if args.nodes == 2 || args.nodes == 4 {
        eprintln!(
            "note: {} router nodes tolerate no more node failures than {} (Raft needs a majority); 3 or 5 is the \
             usual choice",
            args.nodes,
            args.nodes - 1
        );
    }
    let mut policies = vec![args.policy.clone()];
    if args.compare != "none" && args.compare != args.policy {
        policies.push(args.compare.clone());
    }
    for p in &policies {
        p.parse::<kvmesh_core::PolicyKind>()?;
    }
    // Quiet logs: the live view is the output.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "error,openraft=off".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let requests = workload::build(args.trace.as_deref(), args.requests, args.rate, args.seed)?;
    let stats = kvmesh_sim::analyze::analyze(&requests.trace, 1);
    let setup = format!(
        "{} requests from {}; {}, {} kvmesh-engine-sim replicas (Llama-3-8B on H100 \
         profile) at speed {}; {:.1} requests/s; prompts mean {:.0} tokens (p50 {}, p99 {}), outputs mean {:.0}; \
         times in engine seconds",
        requests.trace.requests.len(),
        requests.source,
        match args.nodes {
            1 => "1 router node".to_string(),
            n => format!("{n} router nodes (Raft + gossip)"),
        },
        args.replicas,
        args.speed,
        args.rate,
        stats.input_tokens.mean,
        stats.input_tokens.p50,
        stats.input_tokens.p99,
        stats.output_tokens.mean,
    );
    eprintln!("kvmesh demo: {setup}\n");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    let result = runtime.block_on(async {
        // One listener for the whole demo (Ctrl-C, or SIGTERM: a shell's background jobs
        // ignore SIGINT); a second signal exits at once.
        let (cancel_tx, cancel) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            if stop_signal().await {
                let _ = cancel_tx.send(true);
                eprintln!("\nstopping (Ctrl-C again to quit at once) …");
                if stop_signal().await {
                    std::process::exit(130);
                }
            }
        });
        let cancelled = || {
            let mut c = cancel.clone();
            async move {
                let _ = c.wait_for(|v| *v).await;
            }
        };
        let mut rows = Vec::new();
        let mut runs = Vec::new();
        for policy in &policies {
            let data = tempfile::tempdir().context("a temporary directory for the Raft data")?;
            let spec_replication = args.replication && *policy == policies[0];
            let spec = TierSpec {
                replicas: args.replicas,
                nodes: args.nodes,
                policy,
                speed: args.speed,
                data_dir: data.path(),
                replication: spec_replication,
                autoscale: args.autoscale && *policy == policies[0],
            };
            eprintln!("starting {} router nodes and {} engines for {policy} …", args.nodes, args.replicas);
            let tier = tokio::select! {
                t = Tier::start(&spec) => t?,
                _ = cancelled() => return Ok((rows, runs, true)),
            };
            let names = tier.replica_names();
            let live = Arc::new(Mutex::new(Live::default()));
            let mut view = view::View::new(policy, requests.trace.requests.len(), args.speed, args.quiet);
            let urls = tier.urls();
            // Boxed so it can be dropped (aborting its requests) before the tier stops.
            let mut sending = Box::pin(drive::run(&requests.trace, &urls, args.speed, live.clone()));
            let mut tick = tokio::time::interval(Duration::from_millis(250));
            let outcome = loop {
                tokio::select! {
                    out = &mut sending => break Some(out),
                    _ = tick.tick() => view.update(&live, &tier),
                    _ = cancelled() => break None,
                }
            };
            // Dropping the sender aborts its requests in flight before the tier stops.
            drop(sending);
            view.update(&live, &tier);
            view.finish();
            tier.stop().await;
            let Some(outcomes) = outcome else {
                return Ok((rows, runs, true));
            };
            let label = if spec_replication { format!("{policy}+replication") } else { policy.clone() };
            let row = report::Row::of(&label, &outcomes, &names);
            eprintln!(
                "{label}: {} requests, {} errors, TTFT p99 {}",
                row.requests,
                row.errors,
                report::secs(row.ttft_p99_s)
            );
            rows.push(row);
            runs.push((label, outcomes));
        }
        anyhow::Ok((rows, runs, false))
    });
    runtime.shutdown_timeout(Duration::from_secs(2));
    let (rows, runs, interrupted) = result?;
    if interrupted {
        eprintln!("interrupted: every node and engine stopped, nothing left running");
        if !rows.is_empty() {
            let written = report::write(&args.out, &rows, &runs, &setup)?;
            eprintln!(
                "reports of the finished runs: {}",
                written.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
            );
        }
        std::process::exit(130);
    }
    println!("\n{}", report::table(&rows));
    if let [a, b] = &rows[..] {
        if a.ttft_p99_s > 0.0 && b.ttft_p99_s > 0.0 {
            println!(
                "{} p99 TTFT {} vs {} for {} ({:.2}×); hit rate {:.1}% vs {:.1}%",
                a.policy,
                report::secs(a.ttft_p99_s),
                report::secs(b.ttft_p99_s),
                b.policy,
                b.ttft_p99_s / a.ttft_p99_s,
                a.hit_rate * 100.0,
                b.hit_rate * 100.0
            );
        }
    }
    let written = report::write(&args.out, &rows, &runs, &setup)?;
    println!("reports written: {}", written.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "));
    let failed: usize = rows.iter().map(|r| r.errors).sum();
    anyhow::ensure!(failed == 0, "{failed} requests failed (see the CSV files)");
    Ok(())
}

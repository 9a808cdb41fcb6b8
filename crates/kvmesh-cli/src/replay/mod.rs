//! `kvmesh replay`: every chosen policy on the same trace through the fleet simulator.

mod plot;
mod render;

mod checks;
use checks::{pd_of, policy_params, validate};

use crate::cli::ReplayArgs;
use anyhow::{bail, Context};
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use kvmesh_core::admission::TtftGate;
use kvmesh_core::autoscale::AutoscaleConfig;
use kvmesh_core::PolicyKind;
use kvmesh_sim::engine::EngineProfile;
use kvmesh_sim::simulation::{
    floors, simulate, simulate_pd, AdmissionConfig, Autoscaler, Floors, PdConfig, ReplicationConfig, RunMetrics,
    ScalingConfig, SimConfig,
};
use kvmesh_sim::trace::{self, Trace};
use kvmesh_sim::workload::arrivals;
use kvmesh_sim::workload::scenarios::{Scenario, ScenarioParams};
use std::sync::Mutex;

/// A policy, with or without hot-prefix replication, on a fixed or an autoscaled pool.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Variant {
    kind: PolicyKind,
    replication: bool,
    autoscaler: Option<Autoscaler>,
}

impl Variant {
    /// `token_load` or `token_load+replication`.
    fn parse(s: &str) -> anyhow::Result<Variant> {
        let s = s.trim();
        let (name, replication) = match s.strip_suffix("+replication") {
            Some(name) => (name, true),
            None => (s, false),
        };
        Ok(Variant { kind: name.parse()?, replication, autoscaler: None })
    }
}

impl std::fmt::Display for Variant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.kind, if self.replication { "+replication" } else { "" })?;
        match self.autoscaler {
            Some(a) => write!(f, "/{a}"),
            None => Ok(()),
        }
    }
}

/// One policy's results over the seeds.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PolicyResult {
    /// The policy.
    pub policy: String,
    /// Mean over seeds.
    pub mean: RunMetrics,
    /// Per seed, in seed order.
    pub per_seed: Vec<RunMetrics>,
    /// Sorted TTFTs of the first seed, seconds (for the CDF plot).
    #[serde(skip)]
    pub ttfts: Vec<f64>,
}

/// Everything a replay reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Report {
    /// What was replayed.
    pub source: String,
    /// Requests replayed.
    pub requests: usize,
    /// Replay span (first to last arrival after scaling), seconds.
    pub span_s: f64,
    /// Replicas.
    pub replicas: u32,
    /// The prefill:decode split and link, when disaggregated (`--pd`).
    pub disaggregated: Option<String>,
    /// Engine profile name.
    pub profile: String,
    /// Rate scale applied.
    pub rate_scale: f64,
    /// KV-event delivery delay, seconds.
    pub event_delay_s: f64,
    /// Router nodes.
    pub routers: u32,
    /// Whether they share bookings.
    pub gossip: bool,
    /// Their gossip delay, seconds.
    pub gossip_delay_s: f64,
    /// Seeds run.
    pub seeds: Vec<u64>,
    /// TTFT SLO, seconds.
    pub ttft_slo_s: f64,
    /// What the router knew of output lengths (`--output-info`).
    pub output_info: String,
    /// The floors no router can beat.
    pub floors: Floors,
    /// Per policy, in the order asked.
    pub results: Vec<PolicyResult>,
}

pub fn run(args: &ReplayArgs) -> anyhow::Result<()> {
    validate(args)?;
    let profile = EngineProfile::resolve(&args.profile).map_err(anyhow::Error::msg)?;
    let mut policies: Vec<Variant> = match (&args.policies, &args.autoscale) {
        (None, None) => {
            PolicyKind::ALL.iter().map(|&kind| Variant { kind, replication: false, autoscaler: None }).collect()
        }
        (None, Some(_)) => vec![Variant { kind: PolicyKind::TokenLoad, replication: false, autoscaler: None }],
        (Some(list), _) => list.split(',').map(Variant::parse).collect::<anyhow::Result<_>>()?,
    };
    if let Some(list) = &args.autoscale {
        let scalers: Vec<Autoscaler> = if list.trim() == "all" {
            Autoscaler::ALL.to_vec()
        } else {
            list.split(',').map(|a| a.parse::<Autoscaler>()).collect::<Result<_, _>>().map_err(anyhow::Error::msg)?
        };
        policies =
            policies.iter().flat_map(|v| scalers.iter().map(move |&a| Variant { autoscaler: Some(a), ..*v })).collect();
    }
    let with_replication = Variant { kind: PolicyKind::TokenLoad, replication: true, autoscaler: None };
    if args.replication && !policies.contains(&with_replication) {
        policies.push(with_replication);
    }
    let seeds: Vec<u64> = (args.seed..args.seed + args.seeds as u64).collect();
    let (traces, source) = load(args, &seeds)?;
    let trace = &traces[0];
    let gate = args.admission_slo.then(|| TtftGate::new(args.ttft_slo)).transpose()?;
    let pd = pd_of(args)?;
    let config = SimConfig {
        replicas: pd.map_or(args.replicas, |p| p.prefill + p.decode),
        profile: profile.clone(),
        block_size: args.block_size,
        event_delay_s: args.event_delay_ms / 1000.0,
        ttft_slo_s: args.ttft_slo,
        send_max_tokens: args.max_tokens_known,
        output_info: args.output_info.parse().map_err(anyhow::Error::msg)?, // checked in validate
        routers: args.routers,
        gossip: !args.no_gossip,
        gossip_delay_s: args.gossip_delay_ms / 1000.0,
        admission: (args.admission || args.admission_slo)
            .then_some(AdmissionConfig { gate, ..AdmissionConfig::default() }),
        ..SimConfig::default()
    };
    // One trace per seed for a generated scenario (one in all for a file): the floors, like
    // the figures, are means over them.
    let floors = Floors::mean(&traces.iter().map(|t| floors(t, &profile.step(), args.block_size)).collect::<Vec<_>>());
    let span_s = trace.requests.last().map_or(0.0, |r| r.arrival_s);
    let results = run_all(&config, &traces, &policies, &seeds, args)?;
    let report = Report {
        source,
        requests: trace.requests.len(),
        span_s,
        replicas: config.replicas,
        disaggregated: pd.map(|p| format!("{}:{} over {} Gb/s", p.prefill, p.decode, p.link_gbps)),
        profile: profile.name.clone(),
        rate_scale: args.rate_scale,
        event_delay_s: config.event_delay_s,
        routers: config.routers,
        gossip: config.gossip,
        gossip_delay_s: config.gossip_delay_s,
        seeds,
        ttft_slo_s: args.ttft_slo,
        output_info: config.output_info.to_string(),
        floors,
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else if args.markdown {
        print!("{}", render::markdown(&report));
    } else {
        print!("{}", render::table(&report));
    }
    // After the table, so a bad plot path never costs the results.
    if let Some(path) = &args.plot {
        plot::ttft_cdf(&report, path).with_context(|| format!("writing the TTFT plot {}", path.display()))?;
        eprintln!("TTFT CDFs written to {}", path.display());
    }
    Ok(())
}

/// What to replay, prepared (buckets spread, rate scaled, truncated): one trace for a trace
/// file, one per seed for a scenario (each seed generates its own arrivals, the same for every
/// policy).
fn load(args: &ReplayArgs, seeds: &[u64]) -> anyhow::Result<(Vec<Trace>, String)> {
    let (raw, source): (Vec<Trace>, String) = match (&args.trace, &args.scenario) {
        (Some(_), Some(_)) => bail!("give --trace or --scenario, not both"),
        (Some(path), None) => {
            let t = trace::load(path).with_context(|| format!("replaying {}", path.display()))?;
            for e in t.skipped.iter().take(10) {
                eprintln!("warning: skipped {} {e}", path.display());
            }
            (vec![t], path.display().to_string())
        }
        (None, scenario) => {
            let name = scenario.as_deref().unwrap_or("chat");
            let s: Scenario = name.parse().map_err(anyhow::Error::msg)?;
            let (requests, rate) = (args.requests.unwrap_or(2000) as u32, args.rate.unwrap_or(10.0));
            let traces = seeds.iter().map(|&seed| s.generate(&ScenarioParams { requests, rate, seed })).collect();
            (traces, format!("scenario {name} ({requests} requests at {rate} req/s)"))
        }
    };
    let mut traces = Vec::with_capacity(raw.len());
    for mut trace in raw {
        if !args.no_spread {
            arrivals::spread_buckets(&mut trace);
        }
        arrivals::scale_rate(&mut trace, args.rate_scale).map_err(anyhow::Error::msg)?;
        // Truncated first: the steps split the span of what is replayed, not of the whole file.
        if let (Some(n), Some(_)) = (args.requests, &args.trace) {
            arrivals::truncate(&mut trace, n);
        }
        if let Some(steps) = &args.rate_steps {
            let factors: Vec<f64> = steps
                .split(',')
                .map(|f| f.trim().parse::<f64>().map_err(|_| anyhow::anyhow!("--rate-steps: {f:?} is not a number")))
                .collect::<anyhow::Result<_>>()?;
            arrivals::rate_steps(&mut trace, &factors).map_err(|e| anyhow::anyhow!("--rate-steps: {e}"))?;
        }
        if trace.requests.is_empty() {
            bail!("nothing to replay: the trace has no requests");
        }
        traces.push(trace);
    }
    let source = match &args.rate_steps {
        Some(steps) => format!("{source}, rate steps {steps}"),
        None => source,
    };
    Ok((traces, source))
}

/// Columns of `--scale-csv`: token loads in tokens per second, times in seconds.
const SCALE_CSV_HEADER: &str =
    "policy,seed,at_s,demand_tokens_per_s,forecast_tokens_per_s,capacity_tokens_per_s,desired,ready,starting,queued_tokens";

/// One `--scale-csv` row (with its newline).
fn scale_row(policy: &str, seed: u64, p: &kvmesh_sim::simulation::ScalePoint) -> String {
    format!(
        "{policy},{seed},{:.1},{:.0},{:.0},{:.0},{},{},{},{:.0}\n",
        p.at,
        p.demand_tokens_per_s,
        p.forecast_tokens_per_s,
        p.capacity_tokens_per_s,
        p.desired,
        p.ready,
        p.starting,
        p.queued_tokens
    )
}

/// `--outcomes-csv` columns.
const OUTCOMES_CSV_HEADER: &str = "policy,seed,arrival_s,replica,prompt_tokens,cached_tokens,output_tokens,ttft_s,\
                                   estimated_ttft_s,e2e_s,rejected,no_queue_ttft_s,floor_ttft_s";

/// One run's `--outcomes-csv` rows (TTFT and E2E empty when never served; so are the
/// replica and the no-queue time of a request never routed, whose prompt is the trace's; in a
/// disaggregated run the replica is the decode side's). Per
/// request also its prefill alone on its replica (`profile`'s step model, no queue) with the
/// cache hit it got, and with every reusable prefix cached (`floor_uncached`, per request in
/// order, as [`kvmesh_sim::simulation::uncached_prompt_tokens`] counts them): TTFT above the
/// first is waiting, the first above the second is caching lost.
fn outcome_rows(
    policy: &str,
    seed: u64,
    outcomes: &[kvmesh_sim::simulation::Outcome],
    trace: &Trace,
    profile: &kvmesh_core::load::ReplicaProfile,
    floor_uncached: &[u64],
) -> String {
    use std::fmt::Write;
    let mut csv = String::new();
    let secs = |x: f64| if x.is_finite() { format!("{x:.6}") } else { String::new() };
    for (k, o) in outcomes.iter().enumerate() {
        let served = o.first_token_s.is_finite();
        let prompt =
            if o.prompt_tokens == 0 { trace.requests.get(k).map_or(0, |r| r.input_tokens) } else { o.prompt_tokens };
        let no_queue = if served { o.no_queue_ttft_s(profile) } else { f64::NAN };
        let floor = floor_uncached.get(k).map_or(f64::NAN, |&u| profile.ttft(u, 0));
        let replica = if o.replica == u32::MAX { String::new() } else { o.replica.to_string() };
        let _ = writeln!(
            csv,
            "{policy},{seed},{:.6},{replica},{prompt},{},{},{},{},{},{},{},{}",
            o.arrival_s,
            o.cached_tokens,
            o.output_tokens,
            secs(o.first_token_s - o.arrival_s),
            secs(o.estimated_ttft_s),
            secs(o.finish_s - o.arrival_s),
            o.rejected,
            secs(no_queue),
            secs(floor),
        );
    }
    csv
}

/// Runs every (policy, seed) pair on `--jobs` threads, with a progress bar each.
fn run_all(
    config: &SimConfig,
    traces: &[Trace],
    policies: &[Variant],
    seeds: &[u64],
    args: &ReplayArgs,
) -> anyhow::Result<Vec<PolicyResult>> {
    let pd = pd_of(args)?;
    let params =
        policies.iter().map(|v| policy_params(&args.policy_params, v.kind)).collect::<anyhow::Result<Vec<_>>>()?;
    for s in &args.policy_params {
        let named = s.split_once('.').and_then(|(policy, _)| policy.parse::<PolicyKind>().ok());
        if let Some(named) = named.filter(|k| !policies.iter().any(|v| v.kind == *k)) {
            bail!("--policy-param {s:?} names {}, which --policies does not run", named.as_str());
        }
    }
    for (v, params) in policies.iter().zip(&params) {
        v.kind.build_with(params).map_err(|e| anyhow::anyhow!("--policy-param for {}: {e}", v.kind.as_str()))?;
    }
    let jobs: Vec<(usize, usize)> = (0..policies.len()).flat_map(|p| (0..seeds.len()).map(move |s| (p, s))).collect();
    let next = Mutex::new(0usize);
    type Slot = Option<(RunMetrics, Vec<f64>)>;
    let done: Mutex<Vec<Slot>> = Mutex::new(vec![None; jobs.len()]);
    let bars = MultiProgress::new();
    if args.quiet {
        bars.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let style = ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len} requests {elapsed}")
        .expect("static template")
        .progress_chars("=> ");
    let workers = args.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    // `--scale-csv` rows as (policy, seed, time, row), sorted on those before writing.
    let timelines: Mutex<Vec<(String, u64, f64, String)>> = Mutex::new(Vec::new());
    // `--outcomes-csv` rows per run as (policy, seed, rows).
    let outcomes: Mutex<Vec<(String, u64, String)>> = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..workers.min(jobs.len()) {
            scope.spawn(|| loop {
                let k = {
                    let mut n = next.lock().expect("job counter");
                    let k = *n;
                    *n += 1;
                    k
                };
                let Some(&(p, s)) = jobs.get(k) else { break };
                let trace = &traces[s % traces.len()];
                let bar = bars.add(ProgressBar::new(trace.requests.len() as u64));
                bar.set_style(style.clone());
                bar.set_prefix(format!("{} seed {}", policies[p], seeds[s]));
                let mut policy = match policies[p].kind.build_with(&params[p]) {
                    Ok(policy) => policy,
                    Err(e) => {
                        errors.lock().expect("errors").push(format!("{}: {e}", policies[p]));
                        continue;
                    }
                };
                let config = &SimConfig {
                    replication: policies[p].replication.then(ReplicationConfig::default),
                    scaling: policies[p].autoscaler.map(|autoscaler| ScalingConfig {
                        autoscaler,
                        policy: AutoscaleConfig {
                            min_replicas: args.min_replicas,
                            max_replicas: args.replicas,
                            cold_start_s: args.cold_start,
                            target_utilisation: args.target_utilisation,
                            ..AutoscaleConfig::default()
                        },
                        cold_start_s: args.cold_start,
                        initial: args.initial_replicas,
                    }),
                    ..config.clone()
                };
                let ran = match pd {
                    None => simulate(config, trace, policy.as_mut(), seeds[s], &mut |n| bar.set_position(n)),
                    Some(pd) => {
                        // The decode side: --decode-policy, else the policy's own kind;
                        // token_load's is kvmesh's decode pick.
                        let kind = args.decode_policy.as_deref().map_or(Ok(policies[p].kind), str::parse);
                        match kind {
                            Ok(PolicyKind::TokenLoad) => {
                                simulate_pd(config, &pd, trace, policy.as_mut(), None, seeds[s])
                            }
                            Ok(kind) => {
                                let mut decode = kind.build();
                                simulate_pd(config, &pd, trace, policy.as_mut(), Some(decode.as_mut()), seeds[s])
                            }
                            Err(e) => Err(e.to_string()),
                        }
                    }
                };
                match ran {
                    Ok(run) => {
                        let metrics = RunMetrics::of(&run, config);
                        if args.scale_csv.is_some() {
                            let label = policies[p].to_string();
                            let mut rows = timelines.lock().expect("timelines");
                            rows.extend(
                                run.scale_timeline
                                    .iter()
                                    .map(|pt| (label.clone(), seeds[s], pt.at, scale_row(&label, seeds[s], pt))),
                            );
                        }
                        if args.outcomes_csv.is_some() {
                            let label = policies[p].to_string();
                            let floor = kvmesh_sim::simulation::uncached_prompt_tokens(trace, config.block_size);
                            let step = config.profile.step();
                            let csv = outcome_rows(&label, seeds[s], &run.outcomes, trace, &step, &floor);
                            outcomes.lock().expect("outcomes").push((label, seeds[s], csv));
                        }
                        let mut ttfts: Vec<f64> = run
                            .outcomes
                            .iter()
                            .filter(|o| o.first_token_s.is_finite())
                            .map(|o| o.first_token_s - o.arrival_s)
                            .collect();
                        ttfts.sort_by(f64::total_cmp);
                        done.lock().expect("results")[k] = Some((metrics, ttfts));
                    }
                    Err(e) => errors.lock().expect("errors").push(format!("{} seed {}: {e}", policies[p], seeds[s])),
                }
                bar.finish_and_clear();
            });
        }
    });
    if let Some(e) = errors.into_inner().expect("errors").into_iter().next() {
        bail!("simulation failed: {e}");
    }
    if let Some(path) = &args.scale_csv {
        let mut rows = timelines.into_inner().expect("timelines");
        rows.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.total_cmp(&b.2)));
        let csv = rows.iter().fold(format!("{SCALE_CSV_HEADER}\n"), |csv, row| csv + &row.3);
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.outcomes_csv {
        let mut runs = outcomes.into_inner().expect("outcomes");
        runs.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
        let csv = runs.iter().fold(format!("{OUTCOMES_CSV_HEADER}\n"), |csv, run| csv + &run.2);
        std::fs::write(path, csv).with_context(|| format!("writing {}", path.display()))?;
    }
    let done = done.into_inner().expect("results");
    Ok(policies
        .iter()
        .enumerate()
        .map(|(p, kind)| {
            let runs: Vec<&(RunMetrics, Vec<f64>)> =
                (0..seeds.len()).filter_map(|s| done[p * seeds.len() + s].as_ref()).collect();
            let per_seed: Vec<RunMetrics> = runs.iter().map(|r| r.0).collect();
            PolicyResult {
                policy: kind.to_string(),
                mean: RunMetrics::mean(&per_seed),
                per_seed,
                ttfts: runs.first().map(|r| r.1.clone()).unwrap_or_default(),
            }
        })
        .collect())
}

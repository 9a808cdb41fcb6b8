//! The discrete-event fleet simulation: a trace's requests arrive at a router running
//! kvmesh-core's real [`Fleet`] and [`Policy`], which routes each to one of N simulated
//! engines ([`crate::engine::Engine`]).
//!
//! The router sees only what a real router sees: KV events `event_delay_s` after the engine
//! emitted them, engine metrics polled every `metrics_interval_s` (or as often as the policy's
//! router scrapes them, when that is more often: llm-d every 50 ms), and its own bookings
//! (first token and completion as the proxied stream shows them). It never reads an engine's true
//! state. Time is simulated; randomness comes from the run's seed, so a run replays exactly.
//!
//! With `routers` > 1, requests arrive at N router nodes in turn (a client-side round robin),
//! each with its own fleet view fed by every engine's events, and each node's booking deltas
//! reach the others `gossip_delay_s` later through kvmesh-core's gossip merge — the same code
//! the node runs (no loss in the simulator, so no summaries).

mod config;
mod events;
mod metrics;
mod pd;
mod periodic;
mod queue;
mod scaling;

pub use config::{AdmissionConfig, OutputInfo, SimConfig};
pub use kvmesh_core::replication::ReplicationConfig;
pub use metrics::{floors, uncached_prompt_tokens, Floors, RunMetrics};
pub use pd::{simulate_pd, PdConfig};
pub use scaling::{Autoscaler, ScalePoint, ScalingConfig, ScalingStats};

use crate::engine::{Engine, EngineProfile, EngineRequest};
use crate::tokens::prompt_tokens;
use crate::trace::{Trace, TraceRequest};
use kvmesh_core::admission::TtftGate;
use kvmesh_core::gossip::{Delta, NodeId, Outbox, RemoteBookings};
use kvmesh_core::index::KvEvent;
use kvmesh_core::load::{BookingId, EngineMetrics};
use kvmesh_core::replication::{plan_round, warm_round, PrefixSketch, ReplicationPlan, SketchReport, WarmLimiter};
use kvmesh_core::{
    BlockHash, BlockHasher, Fleet, FleetConfig, Namespace, Policy, PolicyKind, ReplicaId, ReplicaSpec, RouteRequest,
};
use queue::{Ev, Queue};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::collections::HashMap;
use std::collections::VecDeque;
use std::time::Instant;

/// Per group of `requests` (in group order), the last finish minus the first arrival among
/// `outcomes` (parallel to `requests`), seconds; infinite when one was never served. Empty
/// when no request has a group.
pub(crate) fn group_times(requests: &[TraceRequest], outcomes: &[Outcome]) -> Vec<f64> {
    let finish = |o: &Outcome| if o.finish_s.is_finite() { o.finish_s } else { f64::INFINITY };
    group_spans(requests.iter().zip(outcomes).map(|(r, o)| (r.group, o.arrival_s, finish(o))))
}

/// Per group (in group order) of `(group, arrival, finish)` items, the last finish minus the
/// first arrival, seconds; items without a group are left out.
pub(crate) fn group_spans(items: impl IntoIterator<Item = (Option<u32>, f64, f64)>) -> Vec<f64> {
    let mut span: std::collections::BTreeMap<u32, (f64, f64)> = std::collections::BTreeMap::new();
    for (group, arrival, finish) in items {
        let Some(g) = group else { continue };
        let e = span.entry(g).or_insert((f64::INFINITY, f64::NEG_INFINITY));
        (e.0, e.1) = (e.0.min(arrival), e.1.max(finish));
    }
    span.values().map(|(first, last)| last - first).collect()
}

/// What happened to one request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Arrival at the router, seconds.
    pub arrival_s: f64,
    /// The replica it was routed to.
    pub replica: u32,
    /// The router node that routed it.
    pub router: u32,
    /// First token, seconds (NaN if never).
    pub first_token_s: f64,
    /// Completion, seconds (NaN if never).
    pub finish_s: f64,
    /// Prompt tokens.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the engine's prefix cache.
    pub cached_tokens: u32,
    /// Output tokens.
    pub output_tokens: u32,
    /// The router's estimated TTFT at the decision, seconds.
    pub estimated_ttft_s: f64,
    /// Never served: the engine could not (prompt larger than its KV cache), or admission
    /// control refused it.
    pub rejected: bool,
}

impl Outcome {
    /// Its prefill alone on its replica with the cache hit it got, no queue, seconds:
    /// `profile`'s [`ReplicaProfile::ttft`](kvmesh_core::load::ReplicaProfile::ttft) of its
    /// uncached tokens (at least the last one). Its TTFT above this is waiting.
    pub fn no_queue_ttft_s(&self, profile: &kvmesh_core::load::ReplicaProfile) -> f64 {
        profile.ttft(u64::from(self.prompt_tokens.saturating_sub(self.cached_tokens).max(1)), 0)
    }
}

/// A finished simulation.
#[derive(Debug)]
pub struct Run {
    /// Per request, in trace order.
    pub outcomes: Vec<Outcome>,
    /// Max and mean of engines' true prefill queues, averaged over arrivals, tokens.
    pub load_max_mean: (f64, f64),
    /// Events processed.
    pub events: u64,
    /// Wall-clock seconds the simulation took.
    pub wall_s: f64,
    /// The first router's fleet at the end (bookings should be empty).
    pub fleet: Fleet,
    /// What replication did, when enabled.
    pub replication: Option<ReplicationStats>,
    /// What scaling did, when enabled.
    pub scaling: Option<ScalingStats>,
    /// Every autoscaling decision, when scaling.
    pub scale_timeline: Vec<ScalePoint>,
    /// Token load the first router booked in each metrics interval, tokens per second (what an
    /// oracle autoscaler is told ahead of time).
    pub booked_load: Vec<f64>,
    /// Sequences the engines preempted (KV freed for a running sequence's next block, then
    /// recomputed), warm-ups' included.
    pub preemptions: u64,
    /// Per group of the trace (an RL step), in group order: the last finish minus the first
    /// arrival, seconds; infinite when one of its requests was never served.
    pub group_times: Vec<f64>,
}

/// What replication did in one run.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize)]
pub struct ReplicationStats {
    /// Distinct prefixes ever planned.
    pub prefixes_planned: u64,
    /// Warm-up requests sent.
    pub warmups: u64,
    /// Tokens the warm-ups prefilled.
    pub warm_tokens: u64,
    /// KV blocks the plan placed on targets, mean over ticks from the first arrival.
    pub planned_blocks_mean: f64,
    /// The most KV blocks the plan placed on targets at once.
    pub planned_blocks_peak: u64,
    /// The fleet's KV capacity, blocks (for shares).
    pub fleet_blocks: u64,
}

/// Simulates `trace` through `policy` with `seed`. `progress(n)` is called as requests arrive.
///
/// # Errors
/// A message for an invalid configuration or a routing error.
pub fn simulate(
    config: &SimConfig,
    trace: &Trace,
    policy: &mut dyn Policy,
    seed: u64,
    progress: &mut dyn FnMut(u64),
) -> Result<Run, String> {
    run(config, trace, policy, seed, progress, None)
}

/// Passes of the oracle autoscaler over its own pool before the one measured: on the
/// synthetic Mooncake trace (×4, seed 1) the second raised no 10 s mean of its known load by
/// more than 1.5 %.
const ORACLE_PASSES: usize = 2;

/// [`simulate`], with the oracle's known load given (`known_load`) or to be found.
fn run(
    config: &SimConfig,
    trace: &Trace,
    policy: &mut dyn Policy,
    seed: u64,
    progress: &mut dyn FnMut(u64),
    known_load: Option<Vec<f64>>,
) -> Result<Run, String> {
    let started = Instant::now();
    config.profile.validate()?;
    if config.replicas == 0 {
        return Err("replicas must be at least 1".into());
    }
    if config.profile.kv_blocks(config.block_size) == 0 {
        return Err(format!(
            "profile {}: kv_tokens ({}) must hold at least one block of {} tokens",
            config.profile.name, config.profile.kv_tokens, config.block_size
        ));
    }
    if !(config.event_delay_s.is_finite() && config.event_delay_s >= 0.0) {
        return Err(format!("KV-event delay must be a non-negative number of seconds, got {}", config.event_delay_s));
    }
    if config.routers == 0 {
        return Err("routers must be at least 1".into());
    }
    if !(config.gossip_delay_s.is_finite() && config.gossip_delay_s >= 0.0) {
        return Err(format!("gossip delay must be a non-negative number of seconds, got {}", config.gossip_delay_s));
    }
    let fleet_config = FleetConfig {
        block_size: config.block_size,
        // A client that sends its true length as max_tokens is believed, as before learning.
        learn_output_lengths: config.output_info == OutputInfo::Learned && !config.send_max_tokens,
        ..config.fleet.clone()
    };
    let engine_ns = Namespace { model: "kvmesh-engine-sim".into(), ..Namespace::default() };
    let engine_hasher = BlockHasher::new(config.block_size, &engine_ns).map_err(|e| e.to_string())?;
    let mut engines = Vec::new();
    let mut routers = Vec::new();
    for k in 0..config.routers {
        let mut fleet = Fleet::new(fleet_config.clone()).map_err(|e| e.to_string())?;
        for r in 0..config.replicas {
            let spec = ReplicaSpec {
                name: format!("sim-{r}"),
                capacity_blocks: config.profile.kv_blocks(config.block_size),
                profile: config.profile.step(),
                publishes_events: true,
                model: String::new(),
                block_size: 0,
                role: kvmesh_core::Role::Both,
            };
            let id = fleet.add_replica(spec).map_err(|e| e.to_string())?;
            debug_assert_eq!(id.index(), r as usize);
        }
        let extra = if k == 0 {
            None
        } else {
            let kind: PolicyKind = policy.name().parse().map_err(|e: kvmesh_core::Error| e.to_string())?;
            Some(kind.build())
        };
        routers.push(Router {
            fleet,
            policy: extra,
            rng: SmallRng::seed_from_u64(seed ^ (k as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15)),
            outbox: (config.routers > 1 && config.gossip).then(|| Outbox::new(usize::MAX, usize::MAX)),
            remote: RemoteBookings::new(1e9),
            sketch: config.replication.as_ref().map(|c| PrefixSketch::new(c.sketch, config.block_size)),
        });
    }
    for _ in 0..config.replicas {
        engines.push(Engine::new(config.profile.clone(), engine_hasher));
    }
    if let Some(c) = &config.replication {
        c.validate().map_err(|e| e.to_string())?;
    }
    let fleet_blocks = config.profile.kv_blocks(config.block_size) * config.replicas as u64;
    if let Some(sc) = &config.scaling {
        sc.policy.validate().map_err(|e| e.to_string())?;
        if !(sc.cold_start_s.is_finite() && sc.cold_start_s >= 0.0) {
            return Err(format!("cold start must be non-negative seconds, got {}", sc.cold_start_s));
        }
    }
    // The oracle is told the load ahead. What the router books depends on the pool (a
    // smaller pool caches less, so more of each prompt is prefilled), so the load comes from
    // runs of the oracle itself: a first pass on the whole pool, then oracle passes each told
    // the most load any pass before it booked. Told only the previous pass's load, it
    // alternated: sized for a pass that cached well, it cached badly, booked more than it
    // was told and missed 7–8 % of its SLO on the synthetic trace.
    let oracle_load = match (&config.scaling, known_load) {
        (_, Some(load)) => load,
        (Some(sc), None) if sc.autoscaler == Autoscaler::Oracle => {
            let kind: PolicyKind = policy.name().parse().map_err(|e: kvmesh_core::Error| e.to_string())?;
            let fixed = SimConfig { scaling: None, ..config.clone() };
            let mut load = simulate(&fixed, trace, kind.build().as_mut(), seed, &mut |_| {})?.booked_load;
            for _ in 0..ORACLE_PASSES {
                let booked = run(config, trace, kind.build().as_mut(), seed, &mut |_| {}, Some(load.clone()))?;
                scaling::raise_to(&mut load, &booked.booked_load);
            }
            load
        }
        _ => Vec::new(),
    };
    let mut sim = Sim {
        scaler: config.scaling.clone().map(|sc| {
            let prior = config.profile.step().full_load_tokens_per_s_prior();
            scaling::Scaler::new(sc, config.replicas as usize, prior, &oracle_load, config.metrics_interval_s)
        }),
        saturated: vec![None; config.replicas as usize],
        booked: (0.0, Vec::new()),
        replication: config.replication.clone().map(|config| Replicator {
            config,
            plan: ReplicationPlan::default(),
            limiter: WarmLimiter::default(),
            warm: HashMap::new(),
            next_warm: trace.requests.len() as u64,
            planned: Vec::new(),
            block_ticks: (0.0, 0),
            stats: ReplicationStats { fleet_blocks, ..ReplicationStats::default() },
        }),
        config,
        trace,
        routers,
        engines,
        queue: Queue::default(),
        in_flight: VecDeque::new(),
        gossip_in_flight: VecDeque::new(),
        bookings: vec![None; trace.requests.len()],
        outcomes: Vec::with_capacity(trace.requests.len()),
        arrived: 0,
        load_sum: (0.0, 0.0),
        rejected: Vec::new(),
        waiting: BinaryHeap::new(),
        demand: vec![None; trace.requests.len()],
        events: policy.reads_kv_events(),
        scrape_s: policy.scrape_interval_s().filter(|&s| s.is_finite() && s > 0.0 && s < config.metrics_interval_s),
    };
    for (i, r) in trace.requests.iter().enumerate() {
        sim.queue.push(r.arrival_s, Ev::Arrival(i as u32));
    }
    sim.queue.push(0.0, Ev::Tick);
    if let Some(s) = sim.scrape_s {
        sim.queue.push(0.0, Ev::Scrape);
        debug_assert!(s > 0.0);
    }
    if let Some(sc) = sim.scaler.as_ref() {
        let off: Vec<usize> = (0..sc.slots.len()).filter(|&r| !sc.routable(r)).collect();
        for router in &mut sim.routers {
            for &r in &off {
                let _ = router.fleet.set_status(ReplicaId(r as u32), kvmesh_core::ReplicaStatus::Draining);
            }
        }
        sim.queue.push(0.0, Ev::Autoscale);
    }
    if sim.replication.is_some() {
        sim.queue.push(0.0, Ev::Replicate);
    }
    while let Some((t, ev)) = sim.queue.pop() {
        match ev {
            Ev::Arrival(i) => {
                sim.arrive(policy, i as usize, t)?;
                if sim.arrived.is_multiple_of(256) {
                    progress(sim.arrived);
                }
            }
            Ev::StepDone(r) => {
                sim.step_done(r as usize, t);
                sim.admit_waiting(policy, t)?;
            }
            Ev::Deliver => {
                if let Some((r, ev)) = sim.in_flight.pop_front() {
                    for router in &mut sim.routers {
                        router.fleet.apply_event(ReplicaId(r as u32), &ev, t).map_err(|e| e.to_string())?;
                    }
                }
            }
            Ev::Gossip => {
                if let Some((from, deltas)) = sim.gossip_in_flight.pop_front() {
                    for (k, router) in sim.routers.iter_mut().enumerate() {
                        if k != from {
                            router.remote.apply(&mut router.fleet, NodeId(from as u64), &deltas, t);
                        }
                    }
                }
            }
            Ev::Tick => {
                sim.tick(t);
                sim.admit_waiting(policy, t)?;
            }
            Ev::Scrape => {
                sim.scrape(t);
                if let Some(s) = sim.scrape_s.filter(|_| sim.more()) {
                    sim.queue.push(t + s, Ev::Scrape);
                }
            }
            Ev::Autoscale => {
                sim.autoscale(t);
                if let Some(sc) = sim.scaler.as_ref().filter(|_| sim.more()) {
                    sim.queue.push(t + sc.config.policy.interval_s, Ev::Autoscale);
                }
            }
            Ev::Ready(r) => {
                sim.replica_ready(r as usize, t);
                sim.admit_waiting(policy, t)?;
            }
            Ev::Transferred(_) => unreachable!("only disaggregated runs transfer"),
            Ev::Replicate => {
                sim.replicate(t);
                if let Some(r) = sim.replication.as_ref().filter(|_| sim.more()) {
                    sim.queue.push(t + r.config.interval_s, Ev::Replicate);
                }
            }
        }
    }
    progress(sim.arrived);
    let n = sim.arrived.max(1) as f64;
    let end = sim.outcomes.iter().map(|o| o.finish_s).filter(|f| f.is_finite()).fold(0.0, f64::max);
    let group_times = group_times(&trace.requests, &sim.outcomes);
    Ok(Run {
        preemptions: sim.engines.iter().map(Engine::preemptions).sum(),
        group_times,
        load_max_mean: (sim.load_sum.0 / n, sim.load_sum.1 / n),
        events: sim.queue.processed(),
        wall_s: started.elapsed().as_secs_f64(),
        outcomes: sim.outcomes,
        replication: sim.replication.as_ref().map(|r| {
            let (sum, ticks) = r.block_ticks;
            ReplicationStats { planned_blocks_mean: sum / ticks.max(1) as f64, ..r.stats }
        }),
        scaling: sim.scaler.as_mut().map(|sc| sc.finish(end)),
        scale_timeline: sim.scaler.as_mut().map(|sc| std::mem::take(&mut sc.timeline)).unwrap_or_default(),
        booked_load: std::mem::take(&mut sim.booked.1),
        fleet: sim.routers.swap_remove(0).fleet,
    })
}

/// One router node of the simulation.
struct Router {
    fleet: Fleet,
    /// `None`: the caller's policy (router 0).
    policy: Option<Box<dyn Policy>>,
    rng: SmallRng,
    outbox: Option<Outbox>,
    remote: RemoteBookings,
    /// This node's hot-prefix counts (replication only).
    sketch: Option<PrefixSketch>,
}

/// The leader's replication state (router 0).
struct Replicator {
    config: ReplicationConfig,
    plan: ReplicationPlan,
    limiter: WarmLimiter,
    /// Warm-up engine request id → its booking on router 0.
    warm: HashMap<u64, BookingId>,
    /// Engine request ids from here on are warm-ups (trace requests come first).
    next_warm: u64,
    /// Every (hash, depth) ever planned.
    planned: Vec<(BlockHash, u32)>,
    /// Sum of planned blocks over ticks, and the ticks counted.
    block_ticks: (f64, u64),
    stats: ReplicationStats,
}

struct Sim<'a> {
    config: &'a SimConfig,
    trace: &'a Trace,
    routers: Vec<Router>,
    engines: Vec<Engine>,
    queue: Queue,
    /// KV events emitted and not yet delivered, oldest first (the delay is constant).
    in_flight: VecDeque<(usize, KvEvent)>,
    /// Booking deltas sent and not yet delivered, oldest first, with their sender.
    gossip_in_flight: VecDeque<(usize, Vec<Delta>)>,
    bookings: Vec<Option<BookingId>>,
    outcomes: Vec<Outcome>,
    arrived: u64,
    load_sum: (f64, f64),
    rejected: Vec<u64>,
    /// Token load booked since the last tick, tokens; and the per-tick rates so far.
    booked: (f64, Vec<f64>),
    replication: Option<Replicator>,
    scaler: Option<scaling::Scaler>,
    /// Per replica: the duration of the step in flight when it started with requests waiting.
    saturated: Vec<Option<f64>>,
    /// Admission control's queue: (late, token load, request); requests that are not late
    /// first (see [`TtftGate::late`]), then smallest load first.
    waiting: BinaryHeap<Reverse<(bool, u64, u32)>>,
    /// Per request: its token load once counted as demand, tokens.
    demand: Vec<Option<u64>>,
    /// The policy's own metrics interval, when shorter than the tick's, seconds.
    scrape_s: Option<f64>,
    /// Whether the routers read KV events at all ([`Policy::reads_kv_events`]): a peer that
    /// does not is not fed them (its routing decisions are the same without the index's
    /// cost; an autoscaler's drain choice and the replication planner, which read the index,
    /// then see no blocks).
    events: bool,
}

#[cfg(test)]
mod tests;

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

mod metrics;
mod pd;
mod queue;
mod scaling;

pub use kvmesh_core::replication::ReplicationConfig;
pub(crate) use metrics::uncached_prompt_tokens;
pub use metrics::{floors, Floors, RunMetrics};
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

/// One simulation's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Engine replicas.
    pub replicas: u32,
    /// Every replica's profile.
    pub profile: EngineProfile,
    /// Tokens per KV block, engines and router alike. Default 16.
    pub block_size: u32,
    /// Delay from an engine emitting a KV event to the router applying it, seconds.
    pub event_delay_s: f64,
    /// How often the router polls engine metrics, seconds. Default 1.
    pub metrics_interval_s: f64,
    /// TTFT above which a request counts as queued past the SLO, seconds. Default 5.
    pub ttft_slo_s: f64,
    /// Whether clients send `max_tokens` equal to the true output length (default false: they
    /// send the trace's `max_tokens`, if it has one).
    pub send_max_tokens: bool,
    /// What the router is told or learns of each request's output length (default
    /// [`OutputInfo::Learned`]; it overrides `fleet.learn_output_lengths`).
    pub output_info: OutputInfo,
    /// Router nodes sharing the fleet. Default 1. Nodes after the first run the same policy
    /// kind with its default parameters.
    pub routers: u32,
    /// Delay from a node's booking change to its peers applying it (gossip batching plus the
    /// network), seconds. Default 0.005.
    pub gossip_delay_s: f64,
    /// Whether router nodes share bookings at all. Default true.
    pub gossip: bool,
    /// Hot-prefix replication: router 0 plays the Raft leader — each tick it merges every
    /// node's sketch, plans, and sends warm-ups (prefill-only requests of `max_tokens` 1) to
    /// the engines; every node routes by the plan. `None` (default): no replication.
    pub replication: Option<ReplicationConfig>,
    /// Replicas that scale: `replicas` is then the pool's largest size, and an autoscaler keeps
    /// some of them running (see `scaling`). `None` (default): all run all along.
    pub scaling: Option<ScalingConfig>,
    /// Admission control while capacity is short, as a router node's `[admission]`: a request
    /// that finds no replica with room (or, with its TTFT gate, none where it would meet the
    /// SLO) waits at the router and is routed as capacity frees, smallest token load first
    /// (late ones last, with the gate); beyond the queue bound or after the longest wait it is
    /// refused (429 on a node; an SLO miss here). `None` (default): every request is routed
    /// on arrival.
    pub admission: Option<AdmissionConfig>,
    /// Router settings (its block size is forced to `block_size`). The simulation's default
    /// lease is effectively infinite: every simulated request is released, and overloaded
    /// runs must not lose their queue from the router's view to lease expiry.
    pub fleet: FleetConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            replicas: 16,
            profile: EngineProfile::h100(),
            block_size: 16,
            event_delay_s: 0.0,
            metrics_interval_s: 1.0,
            ttft_slo_s: 5.0,
            send_max_tokens: false,
            output_info: OutputInfo::Learned,
            routers: 1,
            gossip_delay_s: 0.005,
            gossip: true,
            replication: None,
            scaling: None,
            admission: None,
            fleet: FleetConfig { lease_s: 1e9, ..FleetConfig::default() },
        }
    }
}

/// What the router is told or learns of a request's output length, which it needs for the
/// decode work and KV a request will take (see [`kvmesh_core::load::OutputEstimator`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputInfo {
    /// Nothing but the request's `max_tokens` (the trace's, when it has one), booked whole: a
    /// node with `learn_output_lengths` off.
    MaxTokens,
    /// A request with `max_tokens` is expected at what requests alike produced, re-estimated
    /// as it decodes ([`FleetConfig::learn_output_lengths`], a node's default).
    #[default]
    Learned,
    /// The client sends a length class as its hint: the true length rounded up to a power of
    /// two (what a harness that knows its task kinds can say: within 2× above the truth).
    Hint,
    /// The client's hint is the true length (an oracle: the bound the others are judged by).
    Oracle,
}

impl OutputInfo {
    /// Every mode's name, as `kvmesh replay --output-info` takes it.
    pub const NAMES: [&'static str; 4] = ["max-tokens", "learned", "hint", "oracle"];

    /// The hint a client sends in this mode for a request of `truth` output tokens.
    pub fn hint(self, truth: u32) -> Option<u32> {
        match self {
            OutputInfo::Hint => Some(truth.max(1).next_power_of_two()),
            OutputInfo::Oracle => Some(truth.max(1)),
            OutputInfo::MaxTokens | OutputInfo::Learned => None,
        }
    }
}

impl std::str::FromStr for OutputInfo {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "max-tokens" => Ok(OutputInfo::MaxTokens),
            "learned" => Ok(OutputInfo::Learned),
            "hint" => Ok(OutputInfo::Hint),
            "oracle" => Ok(OutputInfo::Oracle),
            other => Err(format!("unknown output info {other:?}; known: {}", OutputInfo::NAMES.join(", "))),
        }
    }
}

impl std::fmt::Display for OutputInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let i = match self {
            OutputInfo::MaxTokens => 0,
            OutputInfo::Learned => 1,
            OutputInfo::Hint => 2,
            OutputInfo::Oracle => 3,
        };
        f.write_str(OutputInfo::NAMES[i])
    }
}

/// Per group of `requests` (in group order), the last finish minus the first arrival among
/// `outcomes` (parallel to `requests`), seconds; infinite when one was never served. Empty
/// when no request has a group.
pub(crate) fn group_times(requests: &[TraceRequest], outcomes: &[Outcome]) -> Vec<f64> {
    let mut span: std::collections::BTreeMap<u32, (f64, f64)> = std::collections::BTreeMap::new();
    for (r, o) in requests.iter().zip(outcomes) {
        let Some(g) = r.group else { continue };
        let e = span.entry(g).or_insert((f64::INFINITY, f64::NEG_INFINITY));
        e.0 = e.0.min(o.arrival_s);
        e.1 = e.1.max(if o.finish_s.is_finite() { o.finish_s } else { f64::INFINITY });
    }
    span.values().map(|(first, last)| last - first).collect()
}

/// Admission control's settings (a router node's `[admission]`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdmissionConfig {
    /// Requests that may wait at once; more are refused. Default 256.
    pub queue_limit: usize,
    /// Longest wait before a request is refused, seconds. Default 30.
    pub max_wait_s: f64,
    /// The TTFT gate (`admission.ttft_slo_s`): also hold a request whose estimated TTFT
    /// would miss what is left of the SLO while more than half the SLO is queued ahead of it
    /// ([`TtftGate::admits`]), route requests that have waited half the SLO or more after the
    /// others, and when the queue is full refuse its largest such late request instead of a
    /// new one. Default `None`.
    pub gate: Option<TtftGate>,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        AdmissionConfig { queue_limit: 256, max_wait_s: 30.0, gate: None }
    }
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

impl Sim<'_> {
    fn arrive(&mut self, policy: &mut dyn Policy, i: usize, t: f64) -> Result<(), String> {
        debug_assert_eq!(self.outcomes.len(), i);
        let req = &self.trace.requests[i];
        self.outcomes.push(Outcome {
            arrival_s: t,
            replica: u32::MAX,
            router: (i % self.routers.len()) as u32,
            first_token_s: f64::NAN,
            finish_s: f64::NAN,
            prompt_tokens: 0,
            cached_tokens: 0,
            output_tokens: req.output_tokens.max(1),
            estimated_ttft_s: f64::NAN,
            rejected: false,
        });
        self.arrived += 1;
        let loads = self.engines.iter().map(|e| e.pending_prefill() as f64);
        let (max, sum) = loads.fold((0.0f64, 0.0), |(m, s), l| (m.max(l), s + l));
        self.load_sum.0 += max;
        self.load_sum.1 += sum / self.engines.len() as f64;
        // Behind others waiting, or with capacity short: wait (admission control).
        let routed = self.waiting.is_empty() && self.dispatch(policy, i, t)?;
        if !routed {
            // Only admission control defers a request.
            let adm = self.config.admission.unwrap_or_default();
            let load = match self.demand[i] {
                Some(load) => load,
                None => self.decide_for(policy, i, t)?.3,
            };
            self.note_demand(i, load);
            if self.waiting.len() >= adm.queue_limit && !self.evict_late(t) {
                self.outcomes[i].rejected = true;
            } else {
                self.waiting.push(Reverse((false, load, i as u32)));
                // It may fit now, ahead of those waiting (smallest first).
                self.admit_waiting(policy, t)?;
            }
        }
        Ok(())
    }

    /// Counts request `i`'s token load as demand for the autoscaler, once.
    fn note_demand(&mut self, i: usize, load: u64) {
        if self.demand[i].is_none() {
            self.demand[i] = Some(load);
            self.booked.0 += load as f64;
            if let Some(sc) = self.scaler.as_mut() {
                sc.booked += load as f64;
            }
        }
    }

    /// Request `i`'s routing decision at `t` by its router (nothing booked): its prompt
    /// tokens, route request, decision, and token load (uncached prefill plus expected
    /// output, tokens).
    fn decide_for(
        &mut self,
        policy: &mut dyn Policy,
        i: usize,
        t: f64,
    ) -> Result<(Vec<u32>, RouteRequest, kvmesh_core::policy::Decision, u64), String> {
        let req = &self.trace.requests[i];
        let tokens = prompt_tokens(req, i as u64, self.trace.block_tokens);
        let truth = req.output_tokens.max(1);
        let max_tokens = if self.config.send_max_tokens { Some(truth) } else { req.max_tokens };
        let hint = self.config.output_info.hint(truth);
        let k = i % self.routers.len();
        let router = &mut self.routers[k];
        let route = RouteRequest::new(router.fleet.hasher(), &tokens, max_tokens).with_output_hint(hint);
        let (peers, rank) = router.remote.active_peers(NodeId(k as u64), t, 10.0);
        router.fleet.set_active_peers(peers, rank);
        let policy: &mut dyn Policy = match router.policy.as_mut() {
            Some(p) => p.as_mut(),
            None => policy,
        };
        let decision = router.fleet.decide(policy, &route, &mut router.rng, t).map_err(|e| e.to_string())?;
        let load = u64::from(decision.uncached_tokens) + u64::from(router.fleet.expected_output_tokens(&route));
        Ok((tokens, route, decision, load))
    }

    /// Routes request `i` at `t` and hands it to its engine; with admission control only when
    /// capacity is not short (see [`Fleet::capacity_short`]) and its TTFT gate, if any,
    /// admits it ([`TtftGate::admits`]). Returns whether it was routed.
    fn dispatch(&mut self, policy: &mut dyn Policy, i: usize, t: f64) -> Result<bool, String> {
        let (tokens, route, decision, load) = self.decide_for(policy, i, t)?;
        // Counted on its first decision, routed or not: demand is what arrives.
        self.note_demand(i, load);
        let k = i % self.routers.len();
        let router = &mut self.routers[k];
        if let Some(adm) = self.config.admission {
            let waited = t - self.outcomes[i].arrival_s;
            if router.fleet.capacity_short(&decision) || adm.gate.is_some_and(|g| !g.admits(&decision, waited)) {
                return Ok(false);
            }
        }
        let policy: &mut dyn Policy = match router.policy.as_mut() {
            Some(p) => p.as_mut(),
            None => policy,
        };
        let routed = router.fleet.book_decision(policy, &route, decision, t).map_err(|e| e.to_string())?;
        let r = routed.decision.replica.index();
        if let Some(sketch) = router.sketch.as_mut() {
            sketch.observe(t, &route.hashes, Some(&tokens), load as f64);
        }
        if let Some(out) = router.outbox.as_mut() {
            out.routed(&router.fleet, &routed, &route.hashes, t);
        }
        self.send_gossip(k, t);
        self.bookings[i] = Some(routed.booking);
        let o = &mut self.outcomes[i];
        o.replica = r as u32;
        o.prompt_tokens = tokens.len() as u32;
        o.estimated_ttft_s = routed.decision.estimated_ttft_s;
        let output_tokens = self.trace.requests[i].output_tokens.max(1);
        self.engines[r].enqueue(EngineRequest {
            id: i as u64,
            tokens: tokens.into(),
            output_tokens,
            lora: None,
            remote_prefill: false,
        });
        self.kick(r, t);
        Ok(true)
    }

    /// Admission control at `t`: routes waiting requests — with the TTFT gate, those not yet
    /// late first — smallest token load first, until one is held (as a node wakes one waiter
    /// per freed booking); refuses those past `max_wait_s`.
    fn admit_waiting(&mut self, policy: &mut dyn Policy, t: f64) -> Result<(), String> {
        let Some(adm) = self.config.admission.filter(|_| !self.waiting.is_empty()) else { return Ok(()) };
        let outcomes = &mut self.outcomes;
        let mut waiting = std::mem::take(&mut self.waiting).into_vec();
        waiting.retain_mut(|Reverse((late, _, i))| {
            let o = &mut outcomes[*i as usize];
            let waited = t - o.arrival_s;
            o.rejected = waited > adm.max_wait_s;
            *late = adm.gate.is_some_and(|g| g.late(waited));
            !o.rejected
        });
        self.waiting = waiting.into();
        while let Some(&Reverse((_, _, i))) = self.waiting.peek() {
            if !self.dispatch(policy, i as usize, t)? {
                break;
            }
            self.waiting.pop();
        }
        Ok(())
    }

    /// With the TTFT gate, a full queue makes room at `t` by refusing its largest late
    /// request rather than a new one. Returns whether it made room.
    fn evict_late(&mut self, t: f64) -> bool {
        let Some(gate) = self.config.admission.and_then(|a| a.gate) else { return false };
        let mut waiting = std::mem::take(&mut self.waiting).into_vec();
        let late = |i: u32| gate.late(t - self.outcomes[i as usize].arrival_s);
        let worst =
            waiting.iter().enumerate().filter(|(_, w)| late((w.0).2)).max_by_key(|(_, w)| (w.0).1).map(|(k, _)| k);
        if let Some(k) = worst {
            let Reverse((_, _, i)) = waiting.swap_remove(k);
            self.outcomes[i as usize].rejected = true;
        }
        self.waiting = waiting.into();
        worst.is_some()
    }

    /// Starts a step on replica `r` if it is idle and has work.
    fn kick(&mut self, r: usize, t: f64) {
        if self.engines[r].stepping() || !self.engines[r].has_work() {
            return;
        }
        loop {
            let waiting = self.engines[r].metrics().1 > 0;
            if let Some(d) = self.engines[r].start_step(&mut self.rejected) {
                self.saturated[r] = waiting.then_some(d);
                self.queue.push(t + d, Ev::StepDone(r as u32));
                break;
            }
            // An idle engine that cannot schedule its head request never will: drop it rather
            // than wait forever.
            match self.engines[r].has_work().then(|| self.engines[r].reject_head()).flatten() {
                Some(id) => self.rejected.push(id),
                None => break,
            }
        }
        for id in std::mem::take(&mut self.rejected) {
            if self.warm_done(id) {
                continue;
            }
            let o = &mut self.outcomes[id as usize];
            o.rejected = true;
            if let Some(b) = self.bookings[id as usize].take() {
                let k = o.router as usize;
                self.release(k, b, None, t);
            }
        }
    }

    /// Ends booking `b` of router `k` and tells its peers.
    fn release(&mut self, k: usize, b: BookingId, output_tokens: Option<u32>, t: f64) {
        let router = &mut self.routers[k];
        let _ = router.fleet.release(b, output_tokens);
        if let Some(out) = router.outbox.as_mut() {
            out.release(b.0, output_tokens, t);
        }
        self.send_gossip(k, t);
    }

    /// Sends router `k`'s pending booking deltas to its peers, arriving `gossip_delay_s` later.
    fn send_gossip(&mut self, k: usize, t: f64) {
        let Some(out) = self.routers[k].outbox.as_mut() else { return };
        let deltas = out.take();
        if !deltas.is_empty() {
            self.gossip_in_flight.push_back((k, deltas));
            self.queue.push(t + self.config.gossip_delay_s, Ev::Gossip);
        }
    }

    fn step_done(&mut self, r: usize, t: f64) {
        let out = self.engines[r].finish_step();
        if let (Some(d), Some(sc)) = (self.saturated[r].take(), self.scaler.as_mut()) {
            let tokens = out.prefill_tokens + (out.decoded.len() + out.first_tokens.len()) as u64;
            sc.saturated_step(r, tokens as f64, d);
        }
        for ev in out.events.into_iter().filter(|_| self.events) {
            if self.config.event_delay_s <= 0.0 {
                for router in &mut self.routers {
                    let _ = router.fleet.apply_event(ReplicaId(r as u32), &ev, t);
                }
            } else {
                self.in_flight.push_back((r, ev));
                self.queue.push(t + self.config.event_delay_s, Ev::Deliver);
            }
        }
        for (id, cached) in out.first_tokens {
            if id >= self.trace.requests.len() as u64 {
                continue; // a warm-up: its end releases it
            }
            let o = &mut self.outcomes[id as usize];
            debug_assert!(o.first_token_s.is_nan(), "one first token per request");
            o.first_token_s = t;
            o.cached_tokens = cached;
            let k = o.router as usize;
            if let Some(b) = self.bookings[id as usize] {
                let router = &mut self.routers[k];
                let _ = router.fleet.first_token(b, t);
                if let Some(out) = router.outbox.as_mut() {
                    out.first_token(b.0, t);
                }
                self.send_gossip(k, t);
            }
        }
        for id in out.finished {
            if self.warm_done(id) {
                continue;
            }
            let o = &mut self.outcomes[id as usize];
            o.finish_s = t;
            let (k, output) = (o.router as usize, o.output_tokens);
            if let Some(b) = self.bookings[id as usize].take() {
                self.release(k, b, Some(output), t);
            }
        }
        self.kick(r, t);
        if !self.engines[r].has_work() {
            if let Some(sc) = self.scaler.as_mut() {
                sc.release(r, t);
            }
        }
    }

    fn tick(&mut self, t: f64) {
        if t > 0.0 {
            let rate = std::mem::take(&mut self.booked.0) / self.config.metrics_interval_s;
            self.booked.1.push(rate);
        }
        self.scrape(t);
        for router in &mut self.routers {
            router.fleet.expire(t);
        }
        if self.more() {
            self.queue.push(t + self.config.metrics_interval_s, Ev::Tick);
        }
    }
}

impl Sim<'_> {
    /// Every router reads every engine's metrics at `t`.
    fn scrape(&mut self, t: f64) {
        for (r, e) in self.engines.iter().enumerate() {
            let (running, waiting, kv_usage) = e.metrics();
            for router in &mut self.routers {
                let m = EngineMetrics { running, waiting, kv_usage, at: t };
                let _ = router.fleet.report_metrics(ReplicaId(r as u32), m);
            }
        }
    }

    /// The autoscaler's evaluation at `t`: start and drain replicas.
    fn autoscale(&mut self, t: f64) {
        // Prefill queued on the engines and the token load waiting at the router.
        let waiting: u64 = self.waiting.iter().map(|Reverse((_, load, _))| load).sum();
        let queued: u64 = self.engines.iter().map(Engine::pending_prefill).sum::<u64>() + waiting;
        let Some(sc) = self.scaler.as_mut() else { return };
        let (engines, fleet) = (&self.engines, &self.routers[0].fleet);
        let load = |r: usize| {
            let (running, waiting, _) = engines[r].metrics();
            let id = ReplicaId(r as u32);
            let booked = fleet.bookings().load(id);
            ((booked.prefilling + booked.decoding).max(running + waiting), fleet.index().replica_blocks(id) as u64)
        };
        let (start, drain) = sc.evaluate(t, queued as f64, load);
        let cold = sc.config.cold_start_s;
        for r in start {
            self.queue.push(t + cold, Ev::Ready(r as u32));
        }
        for r in drain {
            for router in &mut self.routers {
                let _ = router.fleet.set_status(ReplicaId(r as u32), kvmesh_core::ReplicaStatus::Draining);
            }
            if !self.engines[r].has_work() {
                if let Some(sc) = self.scaler.as_mut() {
                    sc.release(r, t);
                }
            }
        }
    }

    /// Replica `r`'s cold start may have ended at `t`.
    fn replica_ready(&mut self, r: usize, t: f64) {
        if self.scaler.as_mut().is_some_and(|sc| sc.ready(r, t)) {
            for router in &mut self.routers {
                let _ = router.fleet.set_status(ReplicaId(r as u32), kvmesh_core::ReplicaStatus::Ready);
            }
        }
    }

    /// Whether requests are still to arrive or engines still work.
    fn more(&self) -> bool {
        (self.arrived as usize) < self.trace.requests.len()
            || self.engines.iter().any(Engine::has_work)
            || !self.waiting.is_empty()
    }

    /// Whether engine request `id` is a warm-up; if so, ends its booking on router 0.
    fn warm_done(&mut self, id: u64) -> bool {
        if id < self.trace.requests.len() as u64 {
            return false;
        }
        if let Some(b) = self.replication.as_mut().and_then(|r| r.warm.remove(&id)) {
            let _ = self.routers[0].fleet.release(b, Some(1));
        }
        true
    }

    /// The leader's replication round at `t`: plan from every node's sketch (cut as the node
    /// gossips it: 16 prefixes, token ids on the hottest 4), warm, and let every node route by
    /// the plan.
    fn replicate(&mut self, t: f64) {
        let Some(rep) = self.replication.as_mut() else { return };
        let reports: Vec<SketchReport> =
            self.routers.iter().filter_map(|r| r.sketch.as_ref()).map(|s| s.report(t, 16).for_gossip()).collect();
        let merged = SketchReport::merge(&reports);
        let leader = &mut self.routers[0].fleet;
        rep.plan = plan_round(&rep.config, t, &merged, leader, &rep.plan);
        let (warmups, _) = warm_round(&rep.config, t, leader, &mut rep.plan, &mut rep.limiter);
        for p in &rep.plan.prefixes {
            if !rep.planned.contains(&(p.hash, p.depth_blocks)) {
                rep.planned.push((p.hash, p.depth_blocks));
                rep.stats.prefixes_planned += 1;
            }
        }
        if self.arrived > 0 {
            let blocks = rep.plan.planned_blocks();
            rep.block_ticks.0 += blocks as f64;
            rep.block_ticks.1 += 1;
            rep.stats.planned_blocks_peak = rep.stats.planned_blocks_peak.max(blocks);
        }
        let mut kicks = Vec::new();
        for w in warmups {
            let Some(r) = leader.replica_by_name(&w.replica).map(|r| r.id) else { continue };
            let spec = kvmesh_core::load::BookingSpec {
                uncached_prefill_tokens: w.tokens.len() as u32,
                uncached_blocks: w.depth_blocks,
                expected_output_tokens: 1,
                reports_first_token: false,
                output_key: None,
                reestimate_up_to: None,
            };
            let Ok(booking) = leader.book(r, spec, t) else { continue };
            let id = rep.next_warm;
            rep.next_warm += 1;
            rep.warm.insert(id, booking);
            rep.stats.warmups += 1;
            rep.stats.warm_tokens += w.tokens.len() as u64;
            self.engines[r.index()].enqueue(EngineRequest {
                id,
                tokens: w.tokens.clone(),
                output_tokens: 1,
                lora: None,
                remote_prefill: false,
            });
            kicks.push(r.index());
        }
        let grace = rep.config.grace_ttl_s;
        for router in &mut self.routers {
            router.fleet.set_replication_plan(&rep.plan, grace, t);
        }
        for r in kicks {
            self.kick(r, t);
        }
    }
}

#[cfg(test)]
mod tests;

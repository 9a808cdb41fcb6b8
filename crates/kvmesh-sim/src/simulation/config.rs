//! A simulation's settings ([`SimConfig`]), what the router knows of output lengths
//! ([`OutputInfo`]), and admission control ([`AdmissionConfig`]).

use super::*;

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

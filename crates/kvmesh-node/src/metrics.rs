//! The node's Prometheus metrics (`GET /metrics` on the HTTP port). Names are stable and
//! carry their unit; per-replica gauges are refreshed from the routing core at each scrape.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

mod families;

/// A metric's label pairs.
pub(crate) type Labels = Vec<(&'static str, String)>;

/// `kvmesh_raft_*`: this node's Raft state, one gauge each (name, help).
const RAFT: [(&str, &str); 6] = [
    ("term", "This node's Raft term"),
    ("leader_id", "The Raft leader's node id as this node knows it (0: none)"),
    (
        "is_leader",
        "1 while this node leads the Raft group: in the leader state with a quorum acknowledging it within twice cluster.election_timeout_max",
    ),
    ("last_applied_index", "The last Raft log index applied to this node's state machine"),
    ("last_log_index", "The last Raft log index in this node's log"),
    ("voters", "Voting members of the Raft group"),
];

/// `kvmesh_replication_plan_*`: the committed replication plan, one gauge each.
const PLAN: [(&str, &str); 3] = [
    ("version", "The committed replication plan's version"),
    ("prefixes", "Hot prefixes in the committed replication plan"),
    ("blocks", "KV blocks the committed replication plan places on its targets"),
];

/// `kvmesh_autoscaler_*{decision}`: the latest autoscaler decision, one gauge each, with
/// `decision` `committed` (the leader's, through Raft) or `evaluated` (this node's latest
/// evaluation, committed or not).
const AUTOSCALER: [(&str, &str); 8] = [
    ("desired_replicas", "Replicas the autoscaler wants"),
    ("ready_replicas", "Ready replicas the autoscaler counted"),
    ("starting_replicas", "Replicas still starting (cold start) the autoscaler counted"),
    ("demand_tokens_per_second", "Token load arriving across the tier, tokens per second"),
    ("forecast_tokens_per_second", "Token load forecast over the cold start, tokens per second"),
    ("capacity_tokens_per_second", "Token load one replica serves, tokens per second"),
    ("panic", "1 while the autoscaler is in panic mode (a burst)"),
    ("decided_at_unix_seconds", "When the decision was taken, Unix seconds"),
];

/// A histogram per label set, all with the request-latency buckets.
pub type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// Request latency buckets, seconds: 5 ms to ~41 s, doubling.
fn latency_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.005, 2.0, 14))
}

/// Every metric the node exports.
pub struct Metrics {
    pub(crate) registry: Registry,
    /// Routing decisions, by policy and reason.
    pub decisions: Family<Labels, Counter>,
    /// Time to take one decision (hash + index + score + book), seconds.
    pub decision_latency: Histogram,
    /// TTFT of streamed requests as their clients see it: from the request's arrival at the
    /// node (parsing, any wait in the admission queue and retries included) to the first
    /// streamed chunk, seconds. A non-streamed answer arrives whole and is not measured.
    pub ttft: Histogram,
    /// Streamed requests whose TTFT exceeded `admission.ttft_slo` (counted only when set).
    pub ttft_over_slo: Counter,
    /// Proxied requests by replica and outcome (the outcomes of [`Metrics::requests`] that
    /// reached a replica: `ok`, `client_error`, `upstream_error`, `backpressure`,
    /// `disconnected`).
    pub replica_requests: Family<Labels, Counter>,
    /// Disaggregated requests' failed hand-offs, by `side` (`prefill`, `decode`) and `kind`:
    /// `unreachable`, `overloaded` (429/503), `failed` (another error status or a broken
    /// answer), `no_transfer_params` (a vLLM prefill replica that answered without
    /// `kv_transfer_params`: it has no KV connector, and the decode replica computed the
    /// prompt itself).
    pub pd_errors: Family<Labels, Counter>,
    /// TTFT by replica, from the request's arrival at the node, seconds, with `streamed`
    /// `true` (the first streamed chunk) or `false` (a non-streamed answer: its first byte is
    /// the whole answer).
    pub replica_ttft: Histograms,
    /// End-to-end time of proxied requests that completed (`ok`), by replica, from arrival at
    /// the node to the answer's end, seconds.
    pub replica_e2e: Histograms,
    /// Time requests that waited in the admission queue spent there, until routed or
    /// refused, seconds.
    pub admission_wait: Histogram,
    /// Requests admission control refused, from both paths that route (the proxy's 429s and
    /// gRPC `Route`'s `RESOURCE_EXHAUSTED`), by outcome: `queue_full`, `evicted_late`,
    /// `admission_timeout`.
    pub admission_refused: Family<Labels, Counter>,
    /// Requests whose client went away (an HTTP disconnect, a cancelled gRPC call) while
    /// they waited in the admission queue.
    pub admission_abandoned: Counter,
    /// Bookings ended by `node.booking_lease` because no release came (a gRPC `Route`
    /// caller that never called `Release`, say): each held its token load on a replica until
    /// then.
    pub bookings_expired: Counter,
    /// Proxied request attempts by outcome: `ok`, `client_error` (a 4xx passed through),
    /// `upstream_error`, `backpressure` (a 429/503, retried elsewhere), `no_replica`,
    /// `disconnected` (the client went away); requests the router answers itself:
    /// `bad_request` (a body it cannot read), `body_too_large` (over `limits.http_max_body_bytes`),
    /// `body_timeout` (not all in within `limits.http_idle_timeout`), `body_budget` (the bodies
    /// in flight use `limits.http_body_budget_bytes`), `unknown_model`, `too_long` (a prompt over
    /// `node.max_prompt_tokens`, or with admission control a prompt and `max_tokens` over the
    /// largest replica's KV); and admission control's 429s: `queue_full`,
    /// `evicted_late` (refused to make room, with the TTFT gate), `admission_timeout` (waited
    /// `max_wait`). A retried request counts once per attempt.
    pub requests: Family<Labels, Counter>,
    /// Prompt tokens routed, and the part the chosen replica was believed to hold.
    pub prompt_tokens: Counter,
    /// See [`Metrics::prompt_tokens`].
    pub predicted_cached_tokens: Counter,
    /// Prompt tokens the engines reported as cached (`usage.prompt_tokens_details`): in a
    /// proxied non-streamed answer, or in a proxied stream's usage chunk (sent when the client
    /// asks for it with `stream_options.include_usage`; a stream without one reports nothing).
    /// Not counted: streams through a gateway (the endpoint picker) and SGLang's disaggregated
    /// streams.
    pub engine_cached_tokens: Counter,
    /// Output tokens of the requests that ended well with a known output (the answer's
    /// `usage.completion_tokens`, or a stream's chunks), and what routing expected of them when
    /// it booked them (the learned estimate, the hint or `max_tokens`).
    pub output_tokens: Counter,
    /// See [`Metrics::output_tokens`].
    pub expected_output_tokens: Counter,
    /// Per such request, its output over its expected output: the estimator's error (above 1:
    /// the replica was booked short and may preempt; below: KV held back from others).
    pub output_estimate_ratio: Histogram,
    /// KV events applied, by replica and kind.
    pub events_applied: Family<Labels, Counter>,
    /// Time from an engine's publish (its batch's `ts`) to the batch applied at this node,
    /// seconds, live batches only (not replayed ones). Engine clock against node clock: exact
    /// on one host, off by the clocks' skew across hosts.
    pub event_lag: Histogram,
    /// KV events rejected (decoder or index), by replica and reason.
    pub events_rejected: Family<Labels, Counter>,
    /// Resyncs, by replica and method: `replay` (a gap fully recovered), `replay_incomplete`,
    /// `clear` (a gap without replay: blocks dropped), `restart` (the sequence went back, or
    /// the engine's generated-token counter did),
    /// `recovery` (the replica came back from unhealthy), `unknown_parent` (case C03).
    pub resyncs: Family<Labels, Counter>,
    /// Live KV-event messages skipped as copies of ones a replay had just applied (queued in
    /// the subscriber while the replay ran), by replica. Not restarts.
    pub replay_copies: Family<Labels, Counter>,
    /// KV-event quarantines begun, by replica (its stream kept bringing bad messages).
    pub quarantines: Family<Labels, Counter>,
    /// Blocks of stores whose parent this node never saw, kept aside because the replica's
    /// history is partial (it was followed from a replay buffer that no longer starts at the
    /// engine's first message), by replica.
    pub orphaned_blocks: Family<Labels, Counter>,
    /// Blocks kept aside and then placed, their parent stored at last or found in a prompt
    /// this node routed there, by replica.
    pub adopted_blocks: Family<Labels, Counter>,
    /// Blocks of a partial history's lost prefixes placed from the prompts this node routed
    /// there (`PrefixIndex::adopt_prompt`), by replica.
    pub inferred_blocks: Family<Labels, Counter>,
    pub(crate) replica_orphan_blocks: Family<Labels, Gauge>,
    pub(crate) replica_recovered: Family<Labels, Gauge<f64, AtomicU64>>,
    pub(crate) replica_status: Family<Labels, Gauge>,
    pub(crate) replica_queued_prefill: Family<Labels, Gauge>,
    pub(crate) replica_bookings: Family<Labels, Gauge>,
    pub(crate) replica_kv_usage: Family<Labels, Gauge<f64, AtomicU64>>,
    pub(crate) replica_index_blocks: Family<Labels, Gauge>,
    pub(crate) replica_capacity_blocks: Family<Labels, Gauge>,
    pub(crate) replica_idle: Family<Labels, Gauge>,
    /// Gossip batches sent to peers.
    pub gossip_sent: Counter,
    /// Gossip batches not sent: a peer's queue was full, or an injected fault dropped them.
    pub gossip_dropped: Counter,
    /// Booking deltas received from peers.
    pub gossip_deltas_received: Counter,
    pub(crate) gossip_peer_bookings: Family<Labels, Gauge>,
    pub(crate) gossip_peer_age: Family<Labels, Gauge<f64, AtomicU64>>,
    pub(crate) gossip_peer_up: Family<Labels, Gauge>,
    pub(crate) raft: [Gauge; RAFT.len()],
    /// Warm-ups by result: `sent` (the engine answered), `failed`, `transferred` (the
    /// transfer sidecar accepted it).
    pub replication_warmups: Family<Labels, Counter>,
    pub(crate) replication: [Gauge; PLAN.len()],
    pub(crate) replication_targets: Family<Labels, Gauge>,
    pub(crate) replication_top_share: Gauge<f64, AtomicU64>,
    pub(crate) autoscaler: [Family<Labels, Gauge<f64, AtomicU64>>; AUTOSCALER.len()],
    pub(crate) admission_queue: Gauge,
    /// Bytes of request bodies reserved from `limits.http_body_budget_bytes` now; kept by
    /// [`crate::body_budget::BodyBudget`].
    pub http_body_bytes: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Counts one request outcome.
    pub fn request(&self, outcome: &'static str) {
        count_outcome(&self.requests, outcome);
    }

    /// Counts one refusal by admission control.
    pub fn admission_refused(&self, outcome: &'static str) {
        self.admission_refused.get_or_create(&vec![("outcome", outcome.to_string())]).inc();
    }
}

/// Of `placed + waiting` blocks a replica's events named, the fraction placed (1 when none).
pub fn recovered_ratio(placed: usize, waiting: usize) -> f64 {
    if placed + waiting == 0 {
        1.0
    } else {
        placed as f64 / (placed + waiting) as f64
    }
}

/// Counts one in `family`'s `outcome` series (`kvmesh_requests_total` and its like).
pub(crate) fn count_outcome(family: &Family<Labels, Counter>, outcome: &'static str) {
    family.get_or_create(&vec![("outcome", outcome.to_string())]).inc();
}

//! Fleet-wide settings ([`FleetConfig`]): block size and namespace, the load model's knobs,
//! event freshness.

use crate::error::Error;
use crate::hashing::{Namespace, DEFAULT_BLOCK_SIZE};

/// Fleet-wide settings.
#[derive(Debug, Clone, PartialEq)]
pub struct FleetConfig {
    /// Tokens per block; must equal the engines' (`--block-size` in vLLM). Default 16.
    pub block_size: u32,
    /// Model / adapter / salt seeding the hash chain.
    pub namespace: Namespace,
    /// A booking ends by itself this long after booking or first token, seconds. Default 600.
    pub lease_s: f64,
    /// Life of a routing-record entry from its decision time, seconds. Default 120.
    pub record_ttl_s: f64,
    /// Bound on routing-record (block, replica) entries. Default 1,048,576.
    pub record_max_entries: usize,
    /// Event overlap keeps full credit while the replica's last event is this recent, seconds.
    /// Default 30.
    pub event_fresh_s: f64,
    /// Event overlap has no credit once the last event is this old, seconds. Default 300.
    pub event_stale_s: f64,
    /// Engine metrics older than this are ignored, seconds. Default 5.
    pub metrics_fresh_s: f64,
    /// Learn each replica's prefill cost from its delivered first tokens (see
    /// [`crate::load::PrefillRate`]) instead of trusting the configured profile. Default
    /// false: a first token also waits for work the router did not book (preempted requests,
    /// decode steps, other routers), so the learned cost runs high and noisy; in the simulator
    /// with exact profiles it raised p99 TTFT on the Mooncake conversation trace at 17.6× from
    /// 1.47 s to 2.06 s. Turn it on when the profile is unknown.
    pub learn_prefill_rate: bool,
    /// Share of its peak prefill rate (1/β1) an engine sustains while it works off a queue,
    /// in (0, 1]: each step also pays its fixed cost β0 and its decode tokens, and short
    /// prompts leave chunks part empty. A replica's booked prefill drains on the router's
    /// clock at this rate (see [`crate::load::TokenLoad::queued_prefill_at`]). Default 0.95.
    /// Measured in the simulator (16 H100 replicas, p99 TTFT, 1.0 → 0.95): Mooncake
    /// conversation ×11 1.444 → 1.416 s, ×17.6 1.473 → 1.418 s, ×22 5.36 → 4.95 s; synthetic
    /// ×10.5 1.002 → 0.988 s, ×16.8 1.034 → 1.031 s, ×21 5.21 → 6.18 s; hot prompt on 4
    /// replicas 91.5 → 82.0 ms. 0.85–0.92 did as well below capacity (within 0.5 %) and
    /// differently past it, where small changes move p99 by tens of percent either way.
    pub prefill_efficiency: f64,
    /// Seed of the prefix index's hash tables (see [`crate::PrefixIndex::with_seed`]). A node
    /// sets a random one, since engine ids come from the network; default 0 keeps simulations
    /// reproducible.
    pub index_seed: u64,
    /// Expect a request that gives `max_tokens` to produce what completed requests whose
    /// prompts start alike produced (the mean per output key, once a key has 4 of them; its
    /// `max_tokens` until then), and re-estimate it from its first token on as it decodes
    /// (E[L | L > generated], from its key's lengths or all): see
    /// [`crate::load::OutputEstimator`]. Requests without a first-token report (non-streamed
    /// answers, gRPC callers that do not report it) keep their estimate. RL trainers and agents send a `max_tokens` ~10× the
    /// median output; booked whole, it made every replica look full of KV (BENCHMARKS.md,
    /// decode-heavy traffic). Default true.
    pub learn_output_lengths: bool,
}

impl Default for FleetConfig {
    fn default() -> Self {
        FleetConfig {
            block_size: DEFAULT_BLOCK_SIZE,
            namespace: Namespace::default(),
            lease_s: 600.0,
            record_ttl_s: 120.0,
            record_max_entries: 1 << 20,
            event_fresh_s: 30.0,
            event_stale_s: 300.0,
            metrics_fresh_s: 5.0,
            learn_prefill_rate: false,
            prefill_efficiency: 0.95,
            index_seed: 0,
            learn_output_lengths: true,
        }
    }
}

impl FleetConfig {
    /// Checks ranges and combinations.
    ///
    /// # Errors
    /// [`Error::ZeroBlockSize`] or [`Error::InvalidConfig`] quoting the bad value.
    pub fn validate(&self) -> Result<(), Error> {
        if self.block_size == 0 {
            return Err(Error::ZeroBlockSize);
        }
        for (field, v) in [
            ("lease_s", self.lease_s),
            ("record_ttl_s", self.record_ttl_s),
            ("event_fresh_s", self.event_fresh_s),
            ("event_stale_s", self.event_stale_s),
            ("metrics_fresh_s", self.metrics_fresh_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::InvalidConfig { field, reason: format!("must be positive seconds, got {v}") });
            }
        }
        if !(self.prefill_efficiency > 0.0 && self.prefill_efficiency <= 1.0) {
            return Err(Error::InvalidConfig {
                field: "prefill_efficiency",
                reason: format!("must be in (0, 1], got {}", self.prefill_efficiency),
            });
        }
        if self.event_stale_s <= self.event_fresh_s {
            return Err(Error::InvalidConfig {
                field: "event_stale_s",
                reason: format!("must exceed event_fresh_s ({}), got {}", self.event_fresh_s, self.event_stale_s),
            });
        }
        Ok(())
    }
}

//! Hot-prefix detection and partial KV replication.
//!
//! When one prefix (a popular system prompt, a shared agent context) carries more load than
//! the replicas holding it can serve, affinity builds a hotspot and load-only routing throws
//! the cache away. Holding the prefix on `k` replicas, `k` sized to its load, keeps both the
//! hit rate and the spread (the idea of Mooncake's and Preble's schedulers, here in the router).
//!
//! ```text
//!  route ──► PrefixSketch::observe ──► SketchReport ─gossip─► SketchReport::merge (leader)
//!                                                                   │
//!  Fleet (holders, load, capacity) ──► plan_round ◄─────────────────┘
//!                                          │  ReplicationPlan (Raft)
//!              every node: Fleet::set_replication_plan (planned targets warm for a grace TTL)
//!              leader: warm_round ──► Warmup (prefill-only request, max_tokens 1) ──► engine
//!                      KV events ──► index ──► warm_round confirms
//! ```
//!
//! - [`sketch`]: per-node decayed heavy-hitter counts of prefixes.
//! - [`plan`]: the plan every node routes by.
//! - [`planner`]: the leader's round: hot with hysteresis, `k` from the load share, targets
//!   within the memory budget.
//! - [`warm`]: warm-ups, their rate limit, confirmation by KV events, retries.
//!
//! Pure like the rest of the core: the caller passes `now` and does the I/O.

pub mod plan;
pub mod planner;
mod route;
pub mod sketch;
pub mod warm;

#[cfg(test)]
mod tests;

pub use plan::{Origin, PlannedPrefix, ReplicationPlan, Target, TargetState};
pub use planner::{plan_round, trigger};
pub use sketch::{HotPrefix, PrefixSketch, SketchConfig, SketchReport};
pub use warm::{warm_failed, warm_round, WarmLimiter, Warmup};

use crate::error::Error;

/// Replication settings (the `[replication]` config section of a node; the simulator's
/// `--replication`). Deserialised from that table (durations as text: `cooldown = "30s"`;
/// every key optional).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReplicationConfig {
    /// How often the leader plans and sends warm-ups. Default 250 ms: a prompt that
    /// turns hot is planned as soon as its decayed share crosses the threshold (a share ramps
    /// as 1 − e^{−λt}, so a few seconds with the 10 s half-life) and warmed on every target at
    /// once, where routing alone adds holders one miss at a time.
    #[serde(rename = "interval", with = "crate::seconds")]
    pub interval_s: f64,
    /// Share of a replica's capacity a hot prefix's holders should run at, in (0, 1]. A
    /// prefix carrying share `s` of the fleet's token load over `n` replicas needs
    /// `s·n / target_utilisation` holders. Default 0.7.
    pub target_utilisation: f64,
    /// A prefix needs at least this many requests per second to be planned or stay planned
    /// (shares alone do not fall when all traffic stops). Default 0.5.
    pub min_requests_per_s: f64,
    /// Fewest replicas a planned prefix is held on. Default 2.
    pub min_replicas: u32,
    /// A planned prefix cools when it needs fewer than `cool_ratio × want_replicas` holders.
    /// Default 0.5.
    pub cool_ratio: f64,
    /// A prefix cool this long leaves the plan. Default 30 s.
    #[serde(rename = "cooldown", with = "crate::seconds")]
    pub cooldown_s: f64,
    /// Share of each replica's KV capacity the plan may fill with replicated prefixes, in
    /// [0, 1]. Default 0.1.
    pub memory_budget: f64,
    /// Most prefixes planned at once. Default 8.
    pub max_prefixes: usize,
    /// A router treats a planned target as holding the prefix for this long after it first
    /// sees it planned, until the target's KV events confirm it. Default 10 s.
    #[serde(rename = "grace_ttl", with = "crate::seconds")]
    pub grace_ttl_s: f64,
    /// Warm-ups never take more than this share of a replica's prefill time, in (0, 1].
    /// Default 0.1.
    pub warm_share: f64,
    /// A warm-up not confirmed by KV events this long after it was sent is retried.
    /// Default 10 s.
    #[serde(rename = "warm_timeout", with = "crate::seconds")]
    pub warm_timeout_s: f64,
    /// Warm-ups per target before giving up. Default 3.
    pub max_attempts: u32,
    /// The per-node sketch.
    pub sketch: SketchConfig,
}

impl Default for ReplicationConfig {
    fn default() -> Self {
        ReplicationConfig {
            interval_s: 0.25,
            target_utilisation: 0.7,
            min_requests_per_s: 0.5,
            min_replicas: 2,
            cool_ratio: 0.5,
            cooldown_s: 30.0,
            memory_budget: 0.1,
            max_prefixes: 8,
            grace_ttl_s: 10.0,
            warm_share: 0.1,
            warm_timeout_s: 10.0,
            max_attempts: 3,
            sketch: SketchConfig::default(),
        }
    }
}

impl ReplicationConfig {
    /// Checks ranges.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the field and quoting the value.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |field: &'static str, reason: String| Err(Error::InvalidConfig { field, reason });
        let unit = |v: f64| v.is_finite() && v > 0.0 && v <= 1.0;
        if !unit(self.target_utilisation) {
            return bad("target_utilisation", format!("must be in (0, 1], got {}", self.target_utilisation));
        }
        if !unit(self.warm_share) {
            return bad("warm_share", format!("must be in (0, 1], got {}", self.warm_share));
        }
        if !(self.cool_ratio.is_finite() && self.cool_ratio > 0.0 && self.cool_ratio < 1.0) {
            return bad("cool_ratio", format!("must be in (0, 1), got {}", self.cool_ratio));
        }
        if !(self.memory_budget.is_finite() && (0.0..=1.0).contains(&self.memory_budget)) {
            return bad("memory_budget", format!("must be in [0, 1], got {}", self.memory_budget));
        }
        if !(self.min_requests_per_s.is_finite() && self.min_requests_per_s >= 0.0) {
            return bad("min_requests_per_s", format!("must be a non-negative rate, got {}", self.min_requests_per_s));
        }
        if self.min_replicas < 2 {
            return bad("min_replicas", format!("must be at least 2, got {}", self.min_replicas));
        }
        if self.max_attempts == 0 {
            return bad("max_attempts", "must be at least 1".into());
        }
        for (field, v) in [
            ("interval", self.interval_s),
            ("cooldown", self.cooldown_s),
            ("grace_ttl", self.grace_ttl_s),
            ("warm_timeout", self.warm_timeout_s),
            ("sketch.half_life", self.sketch.half_life_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return bad(field, format!("must be positive seconds, got {v}"));
            }
        }
        if self.sketch.max_depth_blocks < sketch::MIN_DEPTH_BLOCKS {
            return bad(
                "sketch.max_depth_blocks",
                format!("must be at least {}, got {}", sketch::MIN_DEPTH_BLOCKS, self.sketch.max_depth_blocks),
            );
        }
        if self.sketch.capacity == 0 {
            return bad("sketch.capacity", "must be at least 1".into());
        }
        Ok(())
    }
}

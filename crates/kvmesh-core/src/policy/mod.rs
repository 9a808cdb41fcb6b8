//! Routing policies: one trait, one file per policy.
//!
//! Every peer policy reproduces its project's current code — formula, defaults, tie-breaks,
//! fallbacks — and what that router sees: its own record of routed requests, scraped engine
//! gauges, or KV events (each file names the repository, file and version it follows).
//!
//! | name | project | decides on | sees |
//! |---|---|---|---|
//! | `round_robin` | — | rotation | nothing |
//! | `random` | — | uniform choice | nothing |
//! | `least_outstanding_requests` | (load balancers) | fewest in flight | own in-flight counts |
//! | `power_of_two` | vLLM router | fewer in flight of two random | own in-flight counts |
//! | `consistent_hash` | vLLM router | hash ring on the session or prompt | nothing |
//! | `cache_aware` | SGLang router (smg) | approximate tree, creator of the deepest match; else least loaded | own tree of routed prompts, own in-flight counts |
//! | `vllm_cache_aware` | vLLM router | least loaded of the workers with the best own-prefix match | own tree, own in-flight counts |
//! | `prefix_affinity` | Ray Serve | best-matching replicas, else smallest tree; fewest ongoing | own tree, ongoing requests |
//! | `kv_cost` | Dynamo KV router | prefill blocks − overlap + active blocks | KV events, own active sequences |
//! | `weighted_scorer` | llm-d | 3·prefix + 2·queue + 2·KV | own approximate prefix index, engine gauges scraped every 50 ms |
//! | `token_load` (default) | kvmesh | lowest estimated TTFT on token load; overlap as a prefill discount; a KV shortage priced as the wait until room; affinity within the tail budget | KV events, own bookings, engine gauges |
//!
//! Every policy returns a [`Decision`] with the chosen replica, the [`Reason`], the overlap
//! in blocks and the estimated TTFT. kvmesh's own policies break ties at random (case C10),
//! never by "first"; a peer keeps its own tie-break (SGLang, Ray and the vLLM router take the
//! first of their worker list).

mod active_sequences;
mod cache_aware;
pub(crate) mod choose;
mod consistent_hash;
mod kv_cost;
mod least_outstanding;
mod lru_prefix;
mod power_of_two;
mod prefix_affinity;
mod random;
mod recent_p99;
mod round_robin;
mod tenant_tree;
mod token_load;
mod vllm_cache_aware;
mod weighted_scorer;

pub use cache_aware::{CacheAware, CacheAwareParams};
pub use consistent_hash::{ConsistentHash, ConsistentHashParams};
pub use kv_cost::{KvCost, KvCostParams};
pub use least_outstanding::LeastOutstanding;
pub use power_of_two::PowerOfTwo;
pub use prefix_affinity::{PrefixAffinity, PrefixAffinityParams};
pub use random::Random;
pub use round_robin::RoundRobin;
pub use token_load::{TokenLoadParams, TokenLoadPolicy};
pub use vllm_cache_aware::VllmCacheAware;
pub use weighted_scorer::{WeightedScorer, WeightedScorerParams};

use crate::error::Error;
use crate::ids::ReplicaId;
use crate::load::{BookingId, FleetEvent};
use crate::view::FleetView;
use crate::view::RouteRequest;
use rand::RngCore;
use std::fmt;
use std::str::FromStr;

/// A routing policy: picks one routable replica of the view for a request.
///
/// A policy that reproduces another router keeps what that router records of its own routing
/// (SGLang's and Ray's trees of routed prompts, llm-d's approximate prefix index, Dynamo's
/// active sequences) itself: [`Policy::booked`] tells it where each request went, and
/// [`Policy::observe`] what became of it.
pub trait Policy: Send + fmt::Debug {
    /// The policy's name, as in configs and reports.
    fn name(&self) -> &'static str;

    /// When `Some(w)`: prefixes this router sent to a replica less than `w` seconds ago count
    /// as cached there in [`FleetView::overlaps`] — booked, not yet confirmed by the replica's
    /// KV events — and the router records every decision for it.
    fn pending_prefix_s(&self) -> Option<f64> {
        None
    }

    /// Whether the policy reads the replicas' KV events (their overlaps in the view). A peer
    /// whose router never subscribes to them says no: its view then has no overlaps, the fleet
    /// keeps no approximate record for it, and the simulator does not feed it events.
    fn reads_kv_events(&self) -> bool {
        true
    }

    /// How often the router this policy reproduces reads its engines' metrics, seconds (llm-d
    /// scrapes every 50 ms); `None` when it reads none or any interval will do. The simulator
    /// reports engine metrics to the policy at this interval.
    fn scrape_interval_s(&self) -> Option<f64> {
        None
    }

    /// Picks a replica. `view` has at least one routable replica.
    ///
    /// # Errors
    /// [`Error::NoReplicaReady`] if no replica is routable.
    fn pick(&mut self, req: &RouteRequest, view: &FleetView<'_>, rng: &mut dyn RngCore) -> Result<Decision, Error>;

    /// `decision` (this policy's, for `req`) was booked as `booking` at `now`, seconds: the
    /// request is on its way to the replica. A decision that admission control holds back is
    /// not booked, and not told.
    fn booked(&mut self, _req: &RouteRequest, _decision: &Decision, _booking: BookingId, _now: f64) {}

    /// First tokens and ends of bookings this router's decisions made, and replicas removed,
    /// since the last pick, oldest first (also of bookings made under another policy: ignore
    /// unknown ids). Policies that keep a record per replica drop a removed one's here.
    fn observe(&mut self, _events: &[FleetEvent]) {}
}

/// Why a policy chose its replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// Next in rotation.
    Rotation,
    /// Uniformly random.
    Random,
    /// Fewest outstanding requests.
    FewestOutstanding,
    /// The less loaded of two random replicas.
    LowerOfTwo,
    /// The key's owner on the hash ring.
    RingOwner,
    /// The key's owner was not routable; the first routable replica took it.
    RingSpill,
    /// Prefix match above the policy's threshold.
    PrefixMatch,
    /// Load imbalance overrode cache affinity.
    Imbalance,
    /// No good match: the replica with the smallest record of routed prompts.
    LeastCached,
    /// Lowest cost or estimated TTFT.
    LowestCost,
    /// Highest weighted score.
    HighestScore,
    /// No replica had KV headroom for the request; lowest cost regardless.
    NoKvHeadroom,
}

impl Reason {
    /// A stable snake_case name, for logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            Reason::Rotation => "rotation",
            Reason::Random => "random",
            Reason::FewestOutstanding => "fewest_outstanding",
            Reason::LowerOfTwo => "lower_of_two",
            Reason::RingOwner => "ring_owner",
            Reason::RingSpill => "ring_spill",
            Reason::PrefixMatch => "prefix_match",
            Reason::Imbalance => "imbalance",
            Reason::LeastCached => "least_cached",
            Reason::LowestCost => "lowest_cost",
            Reason::HighestScore => "highest_score",
            Reason::NoKvHeadroom => "no_kv_headroom",
        }
    }
}

/// One routing decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Decision {
    /// The chosen replica.
    pub replica: ReplicaId,
    /// Why.
    pub reason: Reason,
    /// Leading prompt blocks the chosen replica holds by the fleet's overlap source (its events,
    /// or its routing record in approximate mode) — also for policies that decide on the
    /// router's record, since this is what the booking is priced on, blocks.
    pub overlap_blocks: u32,
    /// Prompt tokens it must compute, tokens.
    pub uncached_tokens: u32,
    /// KV blocks the prompt adds there, blocks.
    pub uncached_blocks: u32,
    /// Estimated time to first token there, seconds.
    pub estimated_ttft_s: f64,
    /// The part of `estimated_ttft_s` spent queued behind other requests there, seconds.
    pub estimated_queue_wait_s: f64,
}

impl Decision {
    /// The decision for position `i` of `view`, with the shared estimate filled in.
    pub fn at(view: &FleetView<'_>, req: &RouteRequest, i: usize, reason: Reason) -> Decision {
        let e = view.estimate(i, req);
        Decision {
            replica: view.replicas[i].id,
            reason,
            overlap_blocks: view.overlaps[i].gpu,
            uncached_tokens: e.uncached_tokens,
            uncached_blocks: e.uncached_blocks,
            estimated_ttft_s: e.ttft_s,
            estimated_queue_wait_s: view.queue_wait_s(i, &e),
        }
    }
}

/// The policies by name, for configs and the CLI.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PolicyKind {
    /// [`RoundRobin`].
    RoundRobin,
    /// [`Random`].
    Random,
    /// [`LeastOutstanding`].
    LeastOutstandingRequests,
    /// [`PowerOfTwo`].
    PowerOfTwo,
    /// [`ConsistentHash`].
    ConsistentHash,
    /// [`CacheAware`].
    CacheAware,
    /// [`VllmCacheAware`].
    VllmCacheAware,
    /// [`PrefixAffinity`].
    PrefixAffinity,
    /// [`KvCost`].
    KvCost,
    /// [`WeightedScorer`].
    WeightedScorer,
    /// [`TokenLoadPolicy`], the default.
    #[default]
    TokenLoad,
}

impl PolicyKind {
    /// Every policy, anchors first, ours last.
    pub const ALL: [PolicyKind; 11] = [
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::LeastOutstandingRequests,
        PolicyKind::PowerOfTwo,
        PolicyKind::ConsistentHash,
        PolicyKind::CacheAware,
        PolicyKind::VllmCacheAware,
        PolicyKind::PrefixAffinity,
        PolicyKind::KvCost,
        PolicyKind::WeightedScorer,
        PolicyKind::TokenLoad,
    ];

    /// The config name.
    pub fn as_str(&self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::Random => "random",
            PolicyKind::LeastOutstandingRequests => "least_outstanding_requests",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::ConsistentHash => "consistent_hash",
            PolicyKind::CacheAware => "cache_aware",
            PolicyKind::VllmCacheAware => "vllm_cache_aware",
            PolicyKind::PrefixAffinity => "prefix_affinity",
            PolicyKind::KvCost => "kv_cost",
            PolicyKind::WeightedScorer => "weighted_scorer",
            PolicyKind::TokenLoad => "token_load",
        }
    }

    /// The policy with its documented default parameters.
    pub fn build(&self) -> Box<dyn Policy> {
        match self {
            PolicyKind::RoundRobin => Box::new(RoundRobin::default()),
            PolicyKind::Random => Box::new(Random),
            PolicyKind::LeastOutstandingRequests => Box::new(LeastOutstanding::default()),
            PolicyKind::PowerOfTwo => Box::new(PowerOfTwo::default()),
            PolicyKind::ConsistentHash => Box::new(ConsistentHash::new(ConsistentHashParams::default())),
            PolicyKind::CacheAware => Box::new(CacheAware::new(CacheAwareParams::default())),
            PolicyKind::VllmCacheAware => Box::new(VllmCacheAware::new(CacheAwareParams::vllm_router())),
            PolicyKind::PrefixAffinity => Box::new(PrefixAffinity::new(PrefixAffinityParams::default())),
            PolicyKind::KvCost => Box::new(KvCost::new(KvCostParams::default())),
            PolicyKind::WeightedScorer => Box::new(WeightedScorer::new(WeightedScorerParams::default())),
            PolicyKind::TokenLoad => Box::new(TokenLoadPolicy::new(TokenLoadParams::default())),
        }
    }
}

impl PolicyKind {
    /// The policy with some of its parameters set by name (the rest at their defaults): the
    /// cluster's replicated policy configuration. Names are the fields of the policy's
    /// `…Params` struct; whole-number parameters take integral values.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] for a name the policy does not have or a value out of range.
    pub fn build_with(&self, params: &[(String, f64)]) -> Result<Box<dyn Policy>, Error> {
        fn set(field: &mut f64, v: f64) {
            *field = v;
        }
        // Ranges outside which a policy stops routing sensibly (an empty hash ring, a bound of
        // zero, a ring too large to build under the core lock).
        let range = |name: &str, v: f64, lo: f64, hi: f64| -> Result<(), Error> {
            if (lo..=hi).contains(&v) {
                Ok(())
            } else {
                Err(Error::InvalidConfig {
                    field: "policy_params",
                    reason: format!("{name} must be within {lo}..={hi}, got {v}"),
                })
            }
        };
        for (name, v) in params {
            match name.as_str() {
                "vnodes" => range(name, *v, 1.0, 4096.0)?,
                "eviction_interval_s" => range(name, *v, 1.0, 86_400.0)?,
                "max_tree_size" => range(name, *v, 1.0, 1e15)?,
                "cache_threshold"
                | "balance_rel_threshold"
                | "match_rate_threshold"
                | "near_equal_rel"
                | "kv_wait_weight"
                | "affinity_budget"
                | "interference_weight" => range(name, *v, 0.0, 10.0)?,
                "affinity_room_share" => range(name, *v, 0.0, 100.0)?,
                "near_equal_s" | "pending_prefix_s" | "peer_order_step_s" => range(name, *v, 0.0, 600.0)?,
                _ => {}
            }
        }
        fn set_u32(field: &mut u32, name: &str, v: f64) -> Result<(), Error> {
            if !(v.fract() == 0.0 && (0.0..=u32::MAX as f64).contains(&v)) {
                return Err(Error::InvalidConfig {
                    field: "policy_params",
                    reason: format!("{name} must be a whole number, got {v}"),
                });
            }
            *field = v as u32;
            Ok(())
        }
        let unknown = |name: &str| Error::InvalidConfig {
            field: "policy_params",
            reason: format!("policy {self} has no parameter {name:?}"),
        };
        for (name, v) in params {
            if !v.is_finite() || *v < 0.0 {
                return Err(Error::InvalidConfig {
                    field: "policy_params",
                    reason: format!("{name} must be a non-negative number, got {v}"),
                });
            }
        }
        Ok(match self {
            PolicyKind::TokenLoad => {
                let mut p = TokenLoadParams::default();
                for (name, v) in params {
                    match name.as_str() {
                        "near_equal_s" => set(&mut p.near_equal_s, *v),
                        "near_equal_rel" => set(&mut p.near_equal_rel, *v),
                        "move_weight" => set(&mut p.move_weight, *v),
                        "max_pressure" => set(&mut p.max_pressure, *v),
                        "pressure_floor" => set(&mut p.pressure_floor, *v),
                        "pending_prefix_s" => set(&mut p.pending_prefix_s, *v),
                        "peer_order_step_s" => set(&mut p.peer_order_step_s, *v),
                        "kv_wait_weight" => set(&mut p.kv_wait_weight, *v),
                        "affinity_budget" => set(&mut p.affinity_budget, *v),
                        "affinity_room_share" => set(&mut p.affinity_room_share, *v),
                        "interference_weight" => set(&mut p.interference_weight, *v),
                        other => return Err(unknown(other)),
                    }
                }
                Box::new(TokenLoadPolicy::new(p))
            }
            PolicyKind::ConsistentHash => {
                let mut p = ConsistentHashParams::default();
                for (name, v) in params {
                    match name.as_str() {
                        "vnodes" => set_u32(&mut p.vnodes, name, *v)?,
                        other => return Err(unknown(other)),
                    }
                }
                Box::new(ConsistentHash::new(p))
            }
            PolicyKind::CacheAware | PolicyKind::VllmCacheAware => {
                let vllm = *self == PolicyKind::VllmCacheAware;
                let mut p = if vllm { CacheAwareParams::vllm_router() } else { CacheAwareParams::default() };
                for (name, v) in params {
                    match name.as_str() {
                        "cache_threshold" => set(&mut p.cache_threshold, *v),
                        "balance_abs_threshold" => set_u32(&mut p.balance_abs_threshold, name, *v)?,
                        "balance_rel_threshold" => set(&mut p.balance_rel_threshold, *v),
                        "eviction_interval_s" => set(&mut p.eviction_interval_s, *v),
                        "max_tree_size" => set(&mut p.max_tree_size, *v),
                        other => return Err(unknown(other)),
                    }
                }
                if vllm {
                    Box::new(VllmCacheAware::new(p))
                } else {
                    Box::new(CacheAware::new(p))
                }
            }
            PolicyKind::PrefixAffinity => {
                let mut p = PrefixAffinityParams::default();
                for (name, v) in params {
                    match name.as_str() {
                        "imbalanced_threshold" => set(&mut p.imbalanced_threshold, *v),
                        "match_rate_threshold" => set(&mut p.match_rate_threshold, *v),
                        other => return Err(unknown(other)),
                    }
                }
                Box::new(PrefixAffinity::new(p))
            }
            PolicyKind::KvCost => {
                let mut p = KvCostParams::default();
                for (name, v) in params {
                    match name.as_str() {
                        "overlap_weight" => set(&mut p.overlap_weight, *v),
                        "prefill_load_scale" => set(&mut p.prefill_load_scale, *v),
                        other => return Err(unknown(other)),
                    }
                }
                Box::new(KvCost::new(p))
            }
            PolicyKind::WeightedScorer => {
                let mut p = WeightedScorerParams::default();
                for (name, v) in params {
                    match name.as_str() {
                        "prefix_weight" => set(&mut p.prefix_weight, *v),
                        "queue_weight" => set(&mut p.queue_weight, *v),
                        "kv_weight" => set(&mut p.kv_weight, *v),
                        other => return Err(unknown(other)),
                    }
                }
                Box::new(WeightedScorer::new(p))
            }
            _ => {
                if let Some((name, _)) = params.first() {
                    return Err(unknown(name));
                }
                self.build()
            }
        })
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PolicyKind {
    type Err = Error;

    /// Parses a config name (`-` and `_` both accepted).
    fn from_str(s: &str) -> Result<Self, Error> {
        let norm = s.trim().replace('-', "_");
        PolicyKind::ALL.into_iter().find(|k| k.as_str() == norm).ok_or_else(|| Error::UnknownPolicy {
            name: s.to_string(),
            known: PolicyKind::ALL.iter().map(|k| k.as_str()).collect::<Vec<_>>().join(", "),
        })
    }
}

#[cfg(test)]
mod tests;

//! The replication plan: which hot prefixes are held on which extra replicas, and how far each
//! warm-up has got. The Raft leader writes it; every router node routes by it.

use crate::ids::BlockHash;
use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Every planned prefix, with a version that grows on each change.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReplicationPlan {
    /// Incremented by every change the planner or a warm-up makes.
    pub version: u64,
    /// Planned prefixes, hottest first.
    pub prefixes: Vec<PlannedPrefix>,
}

/// One hot prefix and the replicas that should hold it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PlannedPrefix {
    /// Hash of the prefix's last block (chained: names the whole prefix).
    pub hash: BlockHash,
    /// Prefix length, blocks of `block_size` tokens.
    pub depth_blocks: u32,
    /// The prefix's token ids, `depth_blocks × block_size` of them: what warm-ups send. (A
    /// Raft entry may leave them out for a prefix the committed plan already has; the state
    /// machine copies them over.)
    #[serde(default = "no_tokens")]
    pub tokens: Arc<[u32]>,
    /// Its share of the fleet's token load when the plan last changed, in [0, 1] (a share change
    /// alone does not make a new plan version).
    pub load_share: f64,
    /// Replicas that should hold it (holders before the plan plus targets), at least
    /// `min_replicas`.
    pub want_replicas: u32,
    /// Replicas that held it (by their KV events) when last planned, by name.
    pub holders: Vec<String>,
    /// Replicas the plan warms, by name.
    pub targets: Vec<Target>,
    /// When the prefix was first planned, seconds on the leader's clock.
    pub planned_at: f64,
    /// Since when its load has stayed below the cooling threshold, seconds; `None` while hot.
    pub cool_since: Option<f64>,
    /// Why it is planned.
    pub origin: Origin,
    /// A manual trigger keeps the prefix planned at least until then, seconds.
    pub pinned_until: f64,
}

fn no_tokens() -> Arc<[u32]> {
    Arc::from(Vec::new())
}

/// Why a prefix is in the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Origin {
    /// The detector found it hot.
    Detected,
    /// An operator asked for it (`Replication.Trigger`).
    Manual,
}

/// One replica the plan warms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Target {
    /// Replica name.
    pub replica: String,
    /// When it was chosen, seconds.
    pub planned_at: f64,
    /// How far it has got.
    pub state: TargetState,
    /// Warm-up attempts made.
    pub attempts: u32,
}

/// Where one target is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum TargetState {
    /// Chosen; no warm-up sent yet (waiting for the rate limit or the first round).
    Pending,
    /// A warm-up was sent at `since` (seconds); waiting for the replica's KV events.
    Warming {
        /// When the last attempt was sent, seconds.
        since: f64,
    },
    /// The replica's KV events show the whole prefix since `at` (seconds).
    Confirmed {
        /// When confirmed, seconds.
        at: f64,
    },
    /// Gave up at `at` (seconds); the replica is not chosen again for this prefix for
    /// `cooldown_s`.
    Failed {
        /// Why, for operators.
        reason: String,
        /// When, seconds.
        #[serde(default)]
        at: f64,
    },
}

impl TargetState {
    /// Short name: `pending`, `warming`, `confirmed`, `failed`.
    pub fn name(&self) -> &'static str {
        match self {
            TargetState::Pending => "pending",
            TargetState::Warming { .. } => "warming",
            TargetState::Confirmed { .. } => "confirmed",
            TargetState::Failed { .. } => "failed",
        }
    }

    /// Whether the target counts as (becoming) a holder.
    pub fn is_live(&self) -> bool {
        !matches!(self, TargetState::Failed { .. })
    }

    /// Whether a warm-up is on its way or done: what routers may count as warm.
    pub fn is_sent(&self) -> bool {
        matches!(self, TargetState::Warming { .. } | TargetState::Confirmed { .. })
    }
}

impl ReplicationPlan {
    /// The planned prefix with this hash and depth.
    pub fn find(&self, hash: BlockHash, depth_blocks: u32) -> Option<&PlannedPrefix> {
        self.prefixes.iter().find(|p| p.hash == hash && p.depth_blocks == depth_blocks)
    }

    /// KV blocks the plan places on `replica` through its live targets.
    pub fn planned_blocks_on(&self, replica: &str) -> u64 {
        self.prefixes
            .iter()
            .filter(|p| p.targets.iter().any(|t| t.replica == replica && t.state.is_live()))
            .map(|p| p.depth_blocks as u64)
            .sum()
    }

    /// KV blocks the plan places on all replicas together (each live target's prefix once).
    pub fn planned_blocks(&self) -> u64 {
        self.prefixes
            .iter()
            .map(|p| p.depth_blocks as u64 * p.targets.iter().filter(|t| t.state.is_live()).count() as u64)
            .sum()
    }

    /// Live targets in each state: (pending, warming, confirmed, failed).
    pub fn target_counts(&self) -> [usize; 4] {
        let mut c = [0; 4];
        for t in self.prefixes.iter().flat_map(|p| &p.targets) {
            c[match t.state {
                TargetState::Pending => 0,
                TargetState::Warming { .. } => 1,
                TargetState::Confirmed { .. } => 2,
                TargetState::Failed { .. } => 3,
            }] += 1;
        }
        c
    }
}

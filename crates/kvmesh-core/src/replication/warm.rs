//! Warm-ups: a prefill-only request for the prefix (`max_tokens: 1` through the engine's
//! OpenAI API, which works with unmodified vLLM and SGLang), rate-limited per replica,
//! confirmed by the replica's own KV events, retried on timeout, given up with a reason.

use super::plan::{ReplicationPlan, TargetState};
use super::ReplicationConfig;
use crate::ids::BlockHash;
use crate::Fleet;
use rustc_hash::FxHashMap;
use std::sync::Arc;

/// One warm-up to send.
#[derive(Debug, Clone, PartialEq)]
pub struct Warmup {
    /// The prefix's hash and depth (blocks), as in the plan.
    pub hash: BlockHash,
    /// Prefix length, blocks of `block_size` tokens.
    pub depth_blocks: u32,
    /// Target replica name.
    pub replica: String,
    /// Token ids to prefill.
    pub tokens: Arc<[u32]>,
    /// 1 for the first attempt.
    pub attempt: u32,
    /// Estimated prefill time on the target, seconds (its profile's β1 × tokens).
    pub cost_s: f64,
}

/// Per-replica budget of warm-up prefill time: each replica earns `warm_share` seconds of
/// warm-up per second (up to one second's worth banked) and may start a warm-up while its
/// balance is not negative; the warm-up's cost is then charged, possibly into debt. Over any
/// long window, warm-ups take at most `warm_share` of the replica's prefill time.
#[derive(Debug, Clone, Default)]
pub struct WarmLimiter {
    balance: FxHashMap<String, (f64, f64)>,
}

impl WarmLimiter {
    /// Charges `cost_s` to `replica` at `now` if its balance allows a start.
    pub fn try_take(&mut self, share: f64, replica: &str, cost_s: f64, now: f64) -> bool {
        let (balance, at) = self.balance.entry(replica.to_string()).or_insert((share, now));
        *balance = (*balance + share * (now - *at).max(0.0)).min(share);
        *at = now;
        if *balance < 0.0 {
            return false;
        }
        *balance -= cost_s.max(0.0);
        true
    }

    /// Forgets replicas no longer in `keep`.
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.balance.retain(|k, _| keep(k));
    }
}

/// One warm-up round at `now`: confirms targets whose KV events (in `fleet`'s index) show the
/// whole prefix, sends timed-out warm-ups back to pending or gives up after `max_attempts`,
/// fails targets whose replica left or drains, and starts the pending warm-ups the limiter
/// allows. Returns the warm-ups to send and whether the plan changed.
pub fn warm_round(
    config: &ReplicationConfig,
    now: f64,
    fleet: &Fleet,
    plan: &mut ReplicationPlan,
    limiter: &mut WarmLimiter,
) -> (Vec<Warmup>, bool) {
    let mut out = Vec::new();
    let mut changed = false;
    for p in &mut plan.prefixes {
        let chain = fleet.hasher().hash_blocks(&p.tokens);
        let held = fleet.holders(&chain);
        for t in &mut p.targets {
            let Some(r) = fleet.replica_by_name(&t.replica) else {
                if t.state.is_live() {
                    t.state = TargetState::Failed { reason: "the replica is no longer registered".into(), at: now };
                    changed = true;
                }
                continue;
            };
            let holds = held.contains(&r.id);
            let next = match &t.state {
                TargetState::Failed { .. } => None,
                TargetState::Confirmed { .. } if !holds => Some(TargetState::Pending),
                TargetState::Confirmed { .. } => None,
                _ if holds => Some(TargetState::Confirmed { at: now }),
                TargetState::Warming { since } if now - since >= config.warm_timeout_s => {
                    Some(if t.attempts >= config.max_attempts {
                        TargetState::Failed {
                            reason: format!(
                                "KV events did not show the prefix within {} s of each of {} warm-ups",
                                config.warm_timeout_s, t.attempts
                            ),
                            at: now,
                        }
                    } else {
                        TargetState::Pending
                    })
                }
                TargetState::Warming { .. } => None,
                // Overloaded, unhealthy or draining for now: no warm-up until it takes traffic
                // again (a replica that leaves fails above).
                TargetState::Pending if !r.routable() => None,
                TargetState::Pending => {
                    let cost_s = p.tokens.len() as f64 * r.spec.profile.prefill_s_per_token;
                    limiter.try_take(config.warm_share, &t.replica, cost_s, now).then(|| {
                        t.attempts += 1;
                        out.push(Warmup {
                            hash: p.hash,
                            depth_blocks: p.depth_blocks,
                            replica: t.replica.clone(),
                            tokens: p.tokens.clone(),
                            attempt: t.attempts,
                            cost_s,
                        });
                        TargetState::Warming { since: now }
                    })
                }
            };
            if let Some(s) = next {
                t.state = s;
                changed = true;
            }
        }
    }
    if changed {
        plan.version += 1;
    }
    (out, changed)
}

/// Attempt `attempt` of a warm-up could not be sent or the engine refused it, at `now`: the
/// target goes back to pending for another attempt, or fails with `reason` after
/// `max_attempts`. A report about an older attempt than the target's latest changes nothing.
/// Returns whether the plan changed.
#[allow(clippy::too_many_arguments)]
pub fn warm_failed(
    config: &ReplicationConfig,
    plan: &mut ReplicationPlan,
    hash: BlockHash,
    depth_blocks: u32,
    replica: &str,
    attempt: u32,
    reason: &str,
    now: f64,
) -> bool {
    let Some(p) = plan.prefixes.iter_mut().find(|p| p.hash == hash && p.depth_blocks == depth_blocks) else {
        return false;
    };
    let Some(t) = p
        .targets
        .iter_mut()
        .find(|t| t.replica == replica && t.attempts == attempt && matches!(t.state, TargetState::Warming { .. }))
    else {
        return false;
    };
    t.state = if t.attempts >= config.max_attempts {
        TargetState::Failed {
            reason: format!("warm-up {} of {} failed: {reason}", t.attempts, config.max_attempts),
            at: now,
        }
    } else {
        TargetState::Pending
    };
    plan.version += 1;
    true
}

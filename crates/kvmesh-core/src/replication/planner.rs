//! The leader's planning round: which prefixes are hot, how many replicas each needs, and
//! which replicas to warm.
//!
//! A prefix carrying share `s` of the fleet's token load (its requests' booked token load over
//! everyone's) on `n` routable replicas needs `required = s·n / target_utilisation` holders:
//! with load spread evenly each replica carries `1/n`, so holders running the prefix's load at
//! the target utilisation of that fair share need this many. Then:
//!
//! - **hot** when `required` exceeds the replicas holding it now (by KV events) — affinity
//!   alone would pile its load onto too few;
//! - `want_replicas = clamp(⌈required⌉, min_replicas, n)`, grown (never shrunk) while planned,
//!   so a plan does not flap with the load;
//! - targets are the least-loaded routable replicas not holding it, each within the memory
//!   budget (planned prefix blocks ≤ `memory_budget × capacity_blocks`);
//! - **cooling** once `required < cool_ratio × want_replicas` or its requests fall below
//!   `min_requests_per_s`; cool for `cooldown_s` → retired.
//!
//! A deeper hot prefix covers its shallower ancestors: only the deepest of a chain is planned.

use super::plan::{Origin, PlannedPrefix, ReplicationPlan, Target, TargetState};
use super::sketch::{HotPrefix, SketchReport, MIN_DEPTH_BLOCKS};
use super::ReplicationConfig;
use crate::error::Error;
use crate::ids::BlockHash;
use crate::Fleet;
use std::sync::Arc;

/// One planning round at `now` (seconds on the leader's clock): updates `current` from the
/// merged `report` and the leader's `fleet` (holders from its index, load from its bookings,
/// capacity from registrations). Returns the new plan, with `version` incremented when
/// anything but the load shares changed.
pub fn plan_round(
    config: &ReplicationConfig,
    now: f64,
    report: &SketchReport,
    fleet: &Fleet,
    current: &ReplicationPlan,
) -> ReplicationPlan {
    let n = fleet.replicas().iter().filter(|r| warmable(fleet, r)).count() as f64;
    let total = report.total_load_tokens_per_s;
    let required = |load: f64| if total > 0.0 { load / total * n / config.target_utilisation } else { 0.0 };
    let mut plan = current.clone();
    let mut changed = false;

    // Refresh what is planned: shares, holders, cooling, retirement.
    let before = plan.prefixes.len();
    plan.prefixes.retain_mut(|p| {
        let (load, rate) = report
            .prefixes
            .iter()
            .find(|c| c.hash == p.hash && c.depth_blocks == p.depth_blocks)
            .map_or((0.0, 0.0), |c| (c.load_tokens_per_s, c.requests_per_s));
        p.load_share = if total > 0.0 { load / total } else { 0.0 };
        let need = required(load);
        let chain = fleet.hasher().hash_blocks(&p.tokens);
        p.holders = holder_names(fleet, &chain, p.depth_blocks);
        let pinned = now < p.pinned_until;
        let cool = need < config.cool_ratio * p.want_replicas as f64 || rate < config.min_requests_per_s;
        // Cooling state is part of the plan: a new leader (or the next round, which starts
        // from the committed plan) must count the cooldown from when it began.
        if cool && !pinned {
            if p.cool_since.is_none() {
                p.cool_since = Some(now);
                changed = true;
            }
            if now - p.cool_since.unwrap_or(now) >= config.cooldown_s {
                return false;
            }
        } else {
            changed |= p.cool_since.take().is_some();
            let want = want(config, need, n);
            // A pinned prefix that is not hot keeps the replicas it was given.
            if !cool && want > p.want_replicas {
                p.want_replicas = want;
                changed = true;
            }
        }
        true
    });
    changed |= plan.prefixes.len() != before;

    // New hot prefixes, deepest of each chain first.
    let bs = fleet.hasher().block_size() as usize;
    let mut candidates: Vec<(&HotPrefix, Vec<BlockHash>)> = report
        .prefixes
        .iter()
        .filter(|c| c.depth_blocks >= MIN_DEPTH_BLOCKS && c.requests_per_s >= config.min_requests_per_s)
        .filter(|c| plan.find(c.hash, c.depth_blocks).is_none())
        .filter_map(|c| {
            // Reports come from the network: the ids must be exactly the prefix's blocks.
            let tokens = c.tokens.as_ref().filter(|t| t.len() == c.depth_blocks as usize * bs)?;
            let chain = fleet.hasher().hash_blocks(tokens);
            (chain.len() == c.depth_blocks as usize && chain.last() == Some(&c.hash)).then_some((c, chain))
        })
        .collect();
    candidates.sort_by(|a, b| {
        b.0.depth_blocks.cmp(&a.0.depth_blocks).then(b.0.load_tokens_per_s.total_cmp(&a.0.load_tokens_per_s))
    });
    let mut taken: Vec<Vec<BlockHash>> = plan.prefixes.iter().map(|p| fleet.hasher().hash_blocks(&p.tokens)).collect();
    for (c, chain) in candidates {
        if plan.prefixes.len() >= config.max_prefixes {
            break;
        }
        // One prefix per chain: skip ancestors and descendants of what is already planned.
        let related = |t: &Vec<BlockHash>| {
            let (short, long) = if t.len() <= chain.len() { (t, &chain) } else { (&chain, t) };
            !short.is_empty() && long[short.len() - 1] == short[short.len() - 1]
        };
        if taken.iter().any(related) {
            continue;
        }
        let need = required(c.load_tokens_per_s);
        let holders = holder_names(fleet, &chain, c.depth_blocks);
        if need <= holders.len().max(1) as f64 {
            continue;
        }
        plan.prefixes.push(PlannedPrefix {
            hash: c.hash,
            depth_blocks: c.depth_blocks,
            tokens: c.tokens.clone().unwrap_or_else(|| Arc::from(Vec::new())),
            load_share: c.load_tokens_per_s / total,
            want_replicas: want(config, need, n),
            holders,
            targets: Vec::new(),
            planned_at: now,
            cool_since: None,
            origin: Origin::Detected,
            pinned_until: 0.0,
        });
        taken.push(chain);
        changed = true;
    }

    // Targets for every prefix short of replicas.
    for i in 0..plan.prefixes.len() {
        changed |= add_targets(config, now, fleet, &mut plan, i);
    }
    plan.prefixes.sort_by(|a, b| b.load_share.total_cmp(&a.load_share).then(a.hash.cmp(&b.hash)));
    if changed {
        plan.version += 1;
    }
    plan
}

/// An operator's trigger at `now`: plans the prefix of `tokens`, cut to whole blocks and down
/// to the sketch's ladder (4, 6, 8, 12, … blocks: the depths whose load the sketch measures),
/// pinned for `cooldown_s`. On `replicas` (names) exactly, when given; else on `min_replicas`
/// chosen like a detected prefix's. `expect`: the prefix's hash, when the caller names it by
/// hash. Returns the new plan.
///
/// # Errors
/// [`Error::InvalidConfig`] for a prefix shorter than 4 blocks or longer than the sketch's
/// deepest depth, a hash that does not match, an unknown or unroutable replica name, or a
/// memory budget that leaves no room.
pub fn trigger(
    config: &ReplicationConfig,
    now: f64,
    fleet: &Fleet,
    current: &ReplicationPlan,
    tokens: &[u32],
    replicas: &[String],
    expect: Option<BlockHash>,
) -> Result<ReplicationPlan, Error> {
    let bad = |field: &'static str, reason: String| Error::InvalidConfig { field, reason };
    let bs = fleet.hasher().block_size() as usize;
    let blocks = (tokens.len() / bs) as u32;
    if blocks > config.sketch.max_depth_blocks {
        return Err(bad(
            "prefix",
            format!("{blocks} blocks is longer than the deepest prefix counted ({})", config.sketch.max_depth_blocks),
        ));
    }
    let Some(depth) = super::sketch::ladder(blocks).last() else {
        return Err(bad(
            "prefix",
            format!("needs at least {MIN_DEPTH_BLOCKS} blocks of {bs} tokens, got {} tokens", tokens.len()),
        ));
    };
    let tokens: Arc<[u32]> = Arc::from(&tokens[..depth as usize * bs]);
    let chain = fleet.hasher().hash_blocks(&tokens);
    let hash = chain[depth as usize - 1];
    if expect.is_some_and(|h| h != hash) {
        return Err(bad("prefix", "the token ids known for this hash do not hash to it".into()));
    }
    let n = fleet.replicas().iter().filter(|r| warmable(fleet, r)).count() as u32;
    for name in replicas {
        let Some(r) = fleet.replica_by_name(name).filter(|r| warmable(fleet, r)) else {
            return Err(bad("replicas", format!("{name:?} is not a routable replica")));
        };
        let budget = (config.memory_budget * r.spec.capacity_blocks as f64).floor() as u64;
        let planned = current.planned_blocks_on(name);
        if planned + depth as u64 > budget {
            return Err(bad(
                "memory_budget",
                format!("{name:?} has {planned} of its {budget} replication blocks planned; {depth} more do not fit"),
            ));
        }
    }
    let mut plan = current.clone();
    let i = match plan.prefixes.iter().position(|p| p.hash == hash && p.depth_blocks == depth) {
        Some(i) => i,
        None => {
            plan.prefixes.push(PlannedPrefix {
                hash,
                depth_blocks: depth,
                tokens,
                load_share: 0.0,
                want_replicas: 0,
                holders: holder_names(fleet, &chain, depth),
                targets: Vec::new(),
                planned_at: now,
                cool_since: None,
                origin: Origin::Manual,
                pinned_until: 0.0,
            });
            plan.prefixes.len() - 1
        }
    };
    let p = &mut plan.prefixes[i];
    p.origin = Origin::Manual;
    p.pinned_until = now + config.cooldown_s;
    p.cool_since = None;
    for name in replicas {
        if !p.holders.contains(name) && !p.targets.iter().any(|t| &t.replica == name && t.state.is_live()) {
            p.targets.retain(|t| &t.replica != name);
            p.targets.push(Target { replica: name.clone(), planned_at: now, state: TargetState::Pending, attempts: 0 });
        }
    }
    let live = p.holders.len() as u32
        + p.targets.iter().filter(|t| t.state.is_live() && !p.holders.contains(&t.replica)).count() as u32;
    p.want_replicas = if replicas.is_empty() { p.want_replicas.max(config.min_replicas.min(n.max(1))) } else { live };
    add_targets(config, now, fleet, &mut plan, i);
    let p = &plan.prefixes[i];
    if !p.targets.iter().any(|t| t.state.is_live()) && p.holders.len() < p.want_replicas as usize {
        return Err(bad(
            "memory_budget",
            format!("no replica has room for {depth} more blocks within the replication memory budget"),
        ));
    }
    plan.version += 1;
    Ok(plan)
}

fn want(config: &ReplicationConfig, need: f64, n: f64) -> u32 {
    let n = n.max(1.0) as u32;
    (need.ceil().min(u32::MAX as f64) as u32).max(config.min_replicas).min(n)
}

/// Names of the routable replicas whose KV events show the first `depth` blocks of `chain`.
fn holder_names(fleet: &Fleet, chain: &[BlockHash], depth: u32) -> Vec<String> {
    let mut names: Vec<String> = fleet
        .holders(&chain[..(depth as usize).min(chain.len())])
        .into_iter()
        .filter_map(|id| fleet.replica(id))
        .filter(|r| warmable(fleet, r))
        .map(|r| r.spec.name.clone())
        .collect();
    names.sort();
    names
}

/// Tops prefix `i` up to `want_replicas` with new targets; returns whether any was added.
fn add_targets(config: &ReplicationConfig, now: f64, fleet: &Fleet, plan: &mut ReplicationPlan, i: usize) -> bool {
    let p = &plan.prefixes[i];
    let live = |name: &str| {
        p.holders.iter().any(|h| h == name) || p.targets.iter().any(|t| t.replica == name && t.state.is_live())
    };
    let have =
        p.holders.len() + p.targets.iter().filter(|t| t.state.is_live() && !p.holders.contains(&t.replica)).count();
    let short = (p.want_replicas as usize).saturating_sub(have);
    if short == 0 {
        return false;
    }
    let depth = p.depth_blocks as u64;
    let mut free: Vec<(bool, u64, &str)> = fleet
        .replicas()
        .iter()
        .filter(|r| warmable(fleet, r) && !live(&r.spec.name))
        // A replica that failed this prefix rests for `cooldown_s` before it is tried again.
        .filter(|r| {
            !p.targets.iter().any(|t| {
                t.replica == r.spec.name
                    && matches!(t.state, TargetState::Failed { at, .. } if now - at < config.cooldown_s)
            })
        })
        .filter(|r| {
            let budget = (config.memory_budget * r.spec.capacity_blocks as f64).floor() as u64;
            plan.planned_blocks_on(&r.spec.name) + depth <= budget
        })
        .map(|r| {
            let l = fleet.bookings().load(r.id);
            // Replicas that failed a warm-up of this prefix before come last.
            let failed = p.targets.iter().any(|t| t.replica == r.spec.name);
            (failed, l.queued_prefill_tokens + l.expected_decode_tokens, r.spec.name.as_str())
        })
        .collect();
    free.sort();
    let chosen: Vec<String> = free.into_iter().take(short).map(|(_, _, n)| n.to_string()).collect();
    let added = !chosen.is_empty();
    let p = &mut plan.prefixes[i];
    for name in chosen {
        // A failed earlier attempt on this replica is replaced by the fresh target.
        p.targets.retain(|t| t.replica != name);
        p.targets.push(Target { replica: name, planned_at: now, state: TargetState::Pending, attempts: 0 });
    }
    added
}

/// Whether `r` can take warm-ups: routable, serving the fleet's namespace model, the one
/// whose requests feed the hot-prefix sketch (a replica of another model would compute the
/// prefix in its own namespace, of no use to the requests that made it hot), and computing
/// prompts: not a decode replica of a disaggregated fleet (a plain one-token warm-up is no
/// request its engine expects, and prompts are computed on the prefill side).
fn warmable(fleet: &Fleet, r: &crate::fleet::ReplicaState) -> bool {
    r.routable() && r.model == fleet.hasher().model() && r.spec.role != crate::Role::Decode
}

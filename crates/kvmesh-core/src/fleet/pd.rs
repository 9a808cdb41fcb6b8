//! Prefill/decode-disaggregated routing: a request gets a prefill replica and a decode
//! replica, both picked (and booked) before anything is sent, so the decode side is booked
//! with the blocks it will receive.
//!
//! - **Prefill side:** the policy's pick among the model's [`Role::Prefill`] replicas for the
//!   request's prefill leg ([`RouteRequest::prefill_leg`]: its prompt and one output token,
//!   as vLLM's disaggregated proxy sends `max_tokens` 1 there). For `token_load` that is
//!   token load with the prefix overlap of the prefill replicas' own KV events as a discount,
//!   as for a whole request.
//! - **Decode side:** kvmesh's pick among the model's [`Role::Decode`] replicas
//!   ([`decode_pick`]): KV headroom for the transferred prompt blocks (those the decode replica
//!   does not hold already) plus the expected output is a hard limit, then the lowest
//!   estimated decode time there — the wait for KV room and for a batch slot, plus the
//!   request's expected output at the step time of a batch one sequence larger.
//!
//! A model is served disaggregated while it has a routable replica of each side
//! ([`Fleet::disaggregated`]); otherwise its [`Role::Both`] replicas serve it whole.

use super::{Fleet, FleetView, Role, RouteRequest, Routed};
use crate::error::Error;
use crate::hashing::ModelKey;
use crate::ids::ReplicaId;
use crate::policy::{choose, Decision, Policy, Reason};
use rand::RngCore;

/// Where both sides of a disaggregated request go.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdDecision {
    /// The prefill replica (the policy's decision for the prefill leg).
    pub prefill: Decision,
    /// The decode replica. `uncached_tokens` is 0 (it computes no prompt), `uncached_blocks`
    /// the prompt blocks it receives, `estimated_ttft_s` the estimated wait for KV room and a
    /// batch slot plus one decode step there (the transfer not included), seconds.
    pub decode: Decision,
}

/// Both sides of a disaggregated request, booked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdRouted {
    /// The prefill leg's booking: its uncached prompt and one output token, released when the
    /// prefill replica's answer is in.
    pub prefill: Routed,
    /// The decode side's booking: the received blocks and the expected output.
    pub decode: Routed,
}

impl Fleet {
    /// Whether requests for `model` (`None`: the namespace model; [`ModelKey::ANY`]: any) are
    /// served disaggregated now: among `subset` (replica ids, sorted; `None`: all) it has a
    /// routable [`Role::Prefill`] and a routable [`Role::Decode`] replica. When not, its
    /// [`Role::Both`] replicas serve it whole.
    pub fn disaggregated(&self, model: Option<ModelKey>, subset: Option<&[ReplicaId]>) -> bool {
        let model = model.unwrap_or(self.hasher.model());
        let of = |role: Role| {
            self.replicas.iter().any(|r| {
                r.routable()
                    && r.spec.role == role
                    && (model == ModelKey::ANY || r.model == model)
                    && subset.is_none_or(|s| s.binary_search(&r.id).is_ok())
            })
        };
        of(Role::Prefill) && of(Role::Decode)
    }

    /// Replicas that can serve a request now: routable, and of role [`Role::Both`] or of a
    /// model with a routable replica on each side (a prefill replica without a decode
    /// replica serves nothing).
    pub fn servable_replicas(&self) -> usize {
        // Per model, whether a routable prefill and a routable decode replica exist: one pass.
        let mut sides: rustc_hash::FxHashMap<ModelKey, [bool; 2]> = Default::default();
        for r in self.replicas.iter().filter(|r| r.routable() && r.spec.role != Role::Both) {
            sides.entry(r.model).or_default()[usize::from(r.spec.role == Role::Decode)] = true;
        }
        let serves =
            |r: &&super::ReplicaState| r.spec.role == Role::Both || sides.get(&r.model).is_some_and(|s| s[0] && s[1]);
        self.replicas.iter().filter(|r| r.routable()).filter(serves).count()
    }

    /// Routable replicas of `model` (`None`: the namespace model) by role: `[both, prefill,
    /// decode]`.
    pub fn routable_roles(&self, model: Option<ModelKey>) -> [usize; 3] {
        let model = model.unwrap_or(self.hasher.model());
        let mut n = [0; 3];
        for r in self.replicas.iter().filter(|r| r.routable() && (model == ModelKey::ANY || r.model == model)) {
            n[r.spec.role as usize] += 1;
        }
        n
    }

    /// Decides both sides of `req` at `now` among `subset` (replica ids, sorted; `None`: all),
    /// booking nothing (see the [module docs](self)).
    ///
    /// # Errors
    /// [`Error::NoReplicaReady`] when either side has no routable replica.
    pub fn decide_pd(
        &mut self,
        policy: &mut dyn Policy,
        req: &RouteRequest,
        subset: Option<&[ReplicaId]>,
        rng: &mut dyn RngCore,
        now: f64,
    ) -> Result<PdDecision, Error> {
        let prefill = self.decide_role(Role::Prefill, policy, &req.prefill_leg(), subset, rng, now)?;
        // The overlaps were filled for the leg, whose blocks are the request's.
        let view = self.view(Role::Decode, req, subset, now);
        let decode = decode_pick(&view, req, rng)?;
        Ok(PdDecision { prefill, decode })
    }

    /// Books both sides of `d` (from [`Fleet::decide_pd`] for `req`) at `now`: the prefill
    /// leg as [`RouteRequest::prefill_leg`], the decode side as `req` with no prefill. Nothing
    /// stays booked when either fails.
    ///
    /// # Errors
    /// [`Error::UnknownReplica`] when either replica is gone or no longer routable.
    pub fn book_pd(
        &mut self,
        policy: &mut dyn Policy,
        req: &RouteRequest,
        d: PdDecision,
        now: f64,
    ) -> Result<PdRouted, Error> {
        let prefill = self.book_decision(policy, &req.prefill_leg(), d.prefill, now)?;
        match self.book_decision(policy, req, d.decode, now) {
            Ok(decode) => Ok(PdRouted { prefill, decode }),
            Err(e) => {
                self.release(prefill.booking, None)?;
                Err(e)
            }
        }
    }
}

/// The decode replica for `req` among `view`'s (of [`Role::Decode`]): those with KV headroom
/// for its received blocks and expected output first (KV is a hard limit; reason
/// [`Reason::NoKvHeadroom`] when none has it), then the lowest estimated decode time —
/// `kv_wait + slot_wait + o · (β0 + β2 · (n + 1))` for `o` expected output tokens and `n`
/// sequences booked there — uniformly at random among exact ties (case C10).
///
/// # Errors
/// [`Error::NoReplicaReady`] when no replica of the view takes the request.
pub fn decode_pick(view: &FleetView<'_>, req: &RouteRequest, rng: &mut dyn RngCore) -> Result<Decision, Error> {
    let est = view.estimator(req);
    let output = view.expected_output_tokens.max(1);
    let mut fitting = Vec::new();
    let mut all = Vec::new();
    for i in view.routable() {
        let e = est.at(i);
        let load = view.load(i);
        let p = &view.replicas[i].spec.profile;
        let n = load.outstanding();
        let wait = e.kv_wait_s + p.slot_wait(n, load.decoding, output);
        let step = p.step_overhead_s + p.decode_s_per_token * f64::from(n + 1);
        let cost = wait + step * f64::from(output);
        if e.kv_headroom_blocks >= 0 {
            fitting.push((i, cost));
        }
        all.push((i, cost));
    }
    let (scores, reason) =
        if fitting.is_empty() { (&all, Reason::NoKvHeadroom) } else { (&fitting, Reason::LowestCost) };
    let i = choose::lowest(scores, 0.0, rng).ok_or(Error::NoReplicaReady)?;
    let e = est.at(i);
    let load = view.load(i);
    let p = &view.replicas[i].spec.profile;
    let wait = e.kv_wait_s + p.slot_wait(load.outstanding(), load.decoding, output);
    let step = p.step_overhead_s + p.decode_s_per_token * f64::from(load.outstanding() + 1);
    Ok(Decision {
        replica: view.replicas[i].id,
        reason,
        overlap_blocks: view.overlaps[i].gpu,
        uncached_tokens: 0,
        uncached_blocks: e.uncached_blocks,
        estimated_ttft_s: wait + step,
        estimated_queue_wait_s: wait,
    })
}

#[cfg(test)]
#[path = "pd_tests.rs"]
mod tests;

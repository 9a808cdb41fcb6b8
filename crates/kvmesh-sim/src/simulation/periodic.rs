//! What runs on the simulated clock: scrapes, the autoscaler, replica starts, replication.

use super::*;

impl Sim<'_> {
    /// Every router reads every engine's metrics at `t`.
    pub(super) fn scrape(&mut self, t: f64) {
        for (r, e) in self.engines.iter().enumerate() {
            let (running, waiting, kv_usage) = e.metrics();
            for router in &mut self.routers {
                let m = EngineMetrics { running, waiting, kv_usage, at: t };
                let _ = router.fleet.report_metrics(ReplicaId(r as u32), m);
            }
        }
    }

    /// The autoscaler's evaluation at `t`: start and drain replicas.
    pub(super) fn autoscale(&mut self, t: f64) {
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
    pub(super) fn replica_ready(&mut self, r: usize, t: f64) {
        if self.scaler.as_mut().is_some_and(|sc| sc.ready(r, t)) {
            for router in &mut self.routers {
                let _ = router.fleet.set_status(ReplicaId(r as u32), kvmesh_core::ReplicaStatus::Ready);
            }
        }
    }

    /// Whether requests are still to arrive or engines still work.
    pub(super) fn more(&self) -> bool {
        (self.arrived as usize) < self.trace.requests.len()
            || self.engines.iter().any(Engine::has_work)
            || !self.waiting.is_empty()
    }

    /// Whether engine request `id` is a warm-up; if so, ends its booking on router 0.
    pub(super) fn warm_done(&mut self, id: u64) -> bool {
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
    pub(super) fn replicate(&mut self, t: f64) {
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

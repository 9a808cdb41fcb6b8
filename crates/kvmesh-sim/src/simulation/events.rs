//! The simulation's events: arrivals, dispatch and admission, engine steps, first tokens and
//! releases, gossip between simulated routers.

use super::*;

impl Sim<'_> {
    pub(super) fn arrive(&mut self, policy: &mut dyn Policy, i: usize, t: f64) -> Result<(), String> {
        debug_assert_eq!(self.outcomes.len(), i);
        let req = &self.trace.requests[i];
        self.outcomes.push(Outcome {
            arrival_s: t,
            replica: u32::MAX,
            router: (i % self.routers.len()) as u32,
            first_token_s: f64::NAN,
            finish_s: f64::NAN,
            prompt_tokens: 0,
            cached_tokens: 0,
            output_tokens: req.output_tokens.max(1),
            estimated_ttft_s: f64::NAN,
            rejected: false,
        });
        self.arrived += 1;
        let loads = self.engines.iter().map(|e| e.pending_prefill() as f64);
        let (max, sum) = loads.fold((0.0f64, 0.0), |(m, s), l| (m.max(l), s + l));
        self.load_sum.0 += max;
        self.load_sum.1 += sum / self.engines.len() as f64;
        // Behind others waiting, or with capacity short: wait (admission control).
        let routed = self.waiting.is_empty() && self.dispatch(policy, i, t)?;
        if !routed {
            // Only admission control defers a request.
            let adm = self.config.admission.unwrap_or_default();
            let load = match self.demand[i] {
                Some(load) => load,
                None => self.decide_for(policy, i, t)?.3,
            };
            self.note_demand(i, load);
            if self.waiting.len() >= adm.queue_limit && !self.evict_late(t) {
                self.outcomes[i].rejected = true;
            } else {
                self.waiting.push(Reverse((false, load, i as u32)));
                // It may fit now, ahead of those waiting (smallest first).
                self.admit_waiting(policy, t)?;
            }
        }
        Ok(())
    }

    /// Counts request `i`'s token load as demand for the autoscaler, once.
    pub(super) fn note_demand(&mut self, i: usize, load: u64) {
        if self.demand[i].is_none() {
            self.demand[i] = Some(load);
            self.booked.0 += load as f64;
            if let Some(sc) = self.scaler.as_mut() {
                sc.booked += load as f64;
            }
        }
    }

    /// Request `i`'s routing decision at `t` by its router (nothing booked): its prompt
    /// tokens, route request, decision, and token load (uncached prefill plus expected
    /// output, tokens).
    pub(super) fn decide_for(
        &mut self,
        policy: &mut dyn Policy,
        i: usize,
        t: f64,
    ) -> Result<(Vec<u32>, RouteRequest, kvmesh_core::policy::Decision, u64), String> {
        let req = &self.trace.requests[i];
        let tokens = prompt_tokens(req, i as u64, self.trace.block_tokens);
        let truth = req.output_tokens.max(1);
        let max_tokens = if self.config.send_max_tokens { Some(truth) } else { req.max_tokens };
        let hint = self.config.output_info.hint(truth);
        let k = i % self.routers.len();
        let router = &mut self.routers[k];
        let route = RouteRequest::new(router.fleet.hasher(), &tokens, max_tokens).with_output_hint(hint);
        let (peers, rank) = router.remote.active_peers(NodeId(k as u64), t, 10.0);
        router.fleet.set_active_peers(peers, rank);
        let policy: &mut dyn Policy = match router.policy.as_mut() {
            Some(p) => p.as_mut(),
            None => policy,
        };
        let decision = router.fleet.decide(policy, &route, &mut router.rng, t).map_err(|e| e.to_string())?;
        let load = u64::from(decision.uncached_tokens) + u64::from(router.fleet.expected_output_tokens(&route));
        Ok((tokens, route, decision, load))
    }

    /// Routes request `i` at `t` and hands it to its engine; with admission control only when
    /// capacity is not short (see [`Fleet::capacity_short`]) and its TTFT gate, if any,
    /// admits it ([`TtftGate::admits`]). Returns whether it was routed.
    pub(super) fn dispatch(&mut self, policy: &mut dyn Policy, i: usize, t: f64) -> Result<bool, String> {
        let (tokens, route, decision, load) = self.decide_for(policy, i, t)?;
        // Counted on its first decision, routed or not: demand is what arrives.
        self.note_demand(i, load);
        let k = i % self.routers.len();
        let router = &mut self.routers[k];
        if let Some(adm) = self.config.admission {
            let waited = t - self.outcomes[i].arrival_s;
            if router.fleet.capacity_short(&decision) || adm.gate.is_some_and(|g| !g.admits(&decision, waited)) {
                return Ok(false);
            }
        }
        let policy: &mut dyn Policy = match router.policy.as_mut() {
            Some(p) => p.as_mut(),
            None => policy,
        };
        let routed = router.fleet.book_decision(policy, &route, decision, t).map_err(|e| e.to_string())?;
        let r = routed.decision.replica.index();
        if let Some(sketch) = router.sketch.as_mut() {
            sketch.observe(t, &route.hashes, Some(&tokens), load as f64);
        }
        if let Some(out) = router.outbox.as_mut() {
            out.routed(&router.fleet, &routed, &route.hashes, t);
        }
        self.send_gossip(k, t);
        self.bookings[i] = Some(routed.booking);
        let o = &mut self.outcomes[i];
        o.replica = r as u32;
        o.prompt_tokens = tokens.len() as u32;
        o.estimated_ttft_s = routed.decision.estimated_ttft_s;
        let output_tokens = self.trace.requests[i].output_tokens.max(1);
        self.engines[r].enqueue(EngineRequest {
            id: i as u64,
            tokens: tokens.into(),
            output_tokens,
            lora: None,
            remote_prefill: false,
        });
        self.kick(r, t);
        Ok(true)
    }

    /// Admission control at `t`: routes waiting requests — with the TTFT gate, those not yet
    /// late first — smallest token load first, until one is held (as a node wakes one waiter
    /// per freed booking); refuses those past `max_wait_s`.
    pub(super) fn admit_waiting(&mut self, policy: &mut dyn Policy, t: f64) -> Result<(), String> {
        let Some(adm) = self.config.admission.filter(|_| !self.waiting.is_empty()) else { return Ok(()) };
        let outcomes = &mut self.outcomes;
        let mut waiting = std::mem::take(&mut self.waiting).into_vec();
        waiting.retain_mut(|Reverse((late, _, i))| {
            let o = &mut outcomes[*i as usize];
            let waited = t - o.arrival_s;
            o.rejected = waited > adm.max_wait_s;
            *late = adm.gate.is_some_and(|g| g.late(waited));
            !o.rejected
        });
        self.waiting = waiting.into();
        while let Some(&Reverse((_, _, i))) = self.waiting.peek() {
            if !self.dispatch(policy, i as usize, t)? {
                break;
            }
            self.waiting.pop();
        }
        Ok(())
    }

    /// With the TTFT gate, a full queue makes room at `t` by refusing its largest late
    /// request rather than a new one. Returns whether it made room.
    pub(super) fn evict_late(&mut self, t: f64) -> bool {
        let Some(gate) = self.config.admission.and_then(|a| a.gate) else { return false };
        let mut waiting = std::mem::take(&mut self.waiting).into_vec();
        let late = |i: u32| gate.late(t - self.outcomes[i as usize].arrival_s);
        let worst =
            waiting.iter().enumerate().filter(|(_, w)| late((w.0).2)).max_by_key(|(_, w)| (w.0).1).map(|(k, _)| k);
        if let Some(k) = worst {
            let Reverse((_, _, i)) = waiting.swap_remove(k);
            self.outcomes[i as usize].rejected = true;
        }
        self.waiting = waiting.into();
        worst.is_some()
    }

    /// Starts a step on replica `r` if it is idle and has work.
    pub(super) fn kick(&mut self, r: usize, t: f64) {
        if self.engines[r].stepping() || !self.engines[r].has_work() {
            return;
        }
        loop {
            let waiting = self.engines[r].metrics().1 > 0;
            if let Some(d) = self.engines[r].start_step(&mut self.rejected) {
                self.saturated[r] = waiting.then_some(d);
                self.queue.push(t + d, Ev::StepDone(r as u32));
                break;
            }
            // An idle engine that cannot schedule its head request never will: drop it rather
            // than wait forever.
            match self.engines[r].has_work().then(|| self.engines[r].reject_head()).flatten() {
                Some(id) => self.rejected.push(id),
                None => break,
            }
        }
        for id in std::mem::take(&mut self.rejected) {
            if self.warm_done(id) {
                continue;
            }
            let o = &mut self.outcomes[id as usize];
            o.rejected = true;
            if let Some(b) = self.bookings[id as usize].take() {
                let k = o.router as usize;
                self.release(k, b, None, t);
            }
        }
    }

    /// Ends booking `b` of router `k` and tells its peers.
    pub(super) fn release(&mut self, k: usize, b: BookingId, output_tokens: Option<u32>, t: f64) {
        let router = &mut self.routers[k];
        let _ = router.fleet.release(b, output_tokens);
        if let Some(out) = router.outbox.as_mut() {
            out.release(b.0, output_tokens, t);
        }
        self.send_gossip(k, t);
    }

    /// Sends router `k`'s pending booking deltas to its peers, arriving `gossip_delay_s` later.
    pub(super) fn send_gossip(&mut self, k: usize, t: f64) {
        let Some(out) = self.routers[k].outbox.as_mut() else { return };
        let deltas = out.take();
        if !deltas.is_empty() {
            self.gossip_in_flight.push_back((k, deltas));
            self.queue.push(t + self.config.gossip_delay_s, Ev::Gossip);
        }
    }

    pub(super) fn step_done(&mut self, r: usize, t: f64) {
        let out = self.engines[r].finish_step();
        if let (Some(d), Some(sc)) = (self.saturated[r].take(), self.scaler.as_mut()) {
            let tokens = out.prefill_tokens + (out.decoded.len() + out.first_tokens.len()) as u64;
            sc.saturated_step(r, tokens as f64, d);
        }
        for ev in out.events.into_iter().filter(|_| self.events) {
            if self.config.event_delay_s <= 0.0 {
                for router in &mut self.routers {
                    let _ = router.fleet.apply_event(ReplicaId(r as u32), &ev, t);
                }
            } else {
                self.in_flight.push_back((r, ev));
                self.queue.push(t + self.config.event_delay_s, Ev::Deliver);
            }
        }
        for (id, cached) in out.first_tokens {
            if id >= self.trace.requests.len() as u64 {
                continue; // a warm-up: its end releases it
            }
            let o = &mut self.outcomes[id as usize];
            debug_assert!(o.first_token_s.is_nan(), "one first token per request");
            o.first_token_s = t;
            o.cached_tokens = cached;
            let k = o.router as usize;
            if let Some(b) = self.bookings[id as usize] {
                let router = &mut self.routers[k];
                let _ = router.fleet.first_token(b, t);
                if let Some(out) = router.outbox.as_mut() {
                    out.first_token(b.0, t);
                }
                self.send_gossip(k, t);
            }
        }
        for id in out.finished {
            if self.warm_done(id) {
                continue;
            }
            let o = &mut self.outcomes[id as usize];
            o.finish_s = t;
            let (k, output) = (o.router as usize, o.output_tokens);
            if let Some(b) = self.bookings[id as usize].take() {
                self.release(k, b, Some(output), t);
            }
        }
        self.kick(r, t);
        if !self.engines[r].has_work() {
            if let Some(sc) = self.scaler.as_mut() {
                sc.release(r, t);
            }
        }
    }

    pub(super) fn tick(&mut self, t: f64) {
        if t > 0.0 {
            let rate = std::mem::take(&mut self.booked.0) / self.config.metrics_interval_s;
            self.booked.1.push(rate);
        }
        self.scrape(t);
        for router in &mut self.routers {
            router.fleet.expire(t);
        }
        if self.more() {
            self.queue.push(t + self.config.metrics_interval_s, Ev::Tick);
        }
    }
}

//! Prefill/decode-disaggregated fleets (xPyD): `prefill` replicas compute prompts, `decode`
//! replicas receive their KV over a link and generate, as vLLM's disaggregated serving with a
//! KV connector runs them.
//!
//! A request's path: the router picks both sides at once and books both
//! ([`kvmesh_core::Fleet::decide_pd`] for kvmesh, or a peer policy per side); the prefill
//! replica computes the prompt and one token (the prefill leg, `max_tokens` 1); its KV then
//! crosses the link — the prompt blocks the decode replica does not hold already,
//! `blocks × block_size × kv_bytes_per_token × 8 / link` seconds, each transfer on its own
//! (links are not shared or contended); the decode replica loads them
//! ([`crate::engine::EngineRequest::remote_prefill`]) and generates the whole answer. The
//! client's first token is the decode replica's first (vLLM's proxy drops the prefill leg's
//! token), so TTFT includes the prefill, the transfer and one decode step. Both sides'
//! engines publish their KV events to the router.
//!
//! Not modelled here: admission control, scaling, replication and several router nodes (the
//! aggregated simulation has them), transfer failures.

use super::queue::{Ev, Queue};
use super::{group_times, Outcome, Run, SimConfig};
use crate::engine::{Engine, EngineRequest};
use crate::tokens::prompt_tokens;
use crate::trace::Trace;
use kvmesh_core::load::{BookingId, EngineMetrics};
use kvmesh_core::policy::Policy;
use kvmesh_core::{BlockHasher, Fleet, FleetConfig, Namespace, ReplicaId, ReplicaSpec, Role, RouteRequest};
use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::time::Instant;

/// The shape of a disaggregated fleet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdConfig {
    /// Prefill replicas.
    pub prefill: u32,
    /// Decode replicas.
    pub decode: u32,
    /// The link a decode replica receives a prompt's KV over, gigabits per second. Default
    /// 100 (an RDMA-class NIC per GPU).
    pub link_gbps: f64,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig { prefill: 8, decode: 8, link_gbps: 100.0 }
    }
}

impl std::str::FromStr for PdConfig {
    type Err = String;

    /// `P:D`, e.g. `8:8`.
    ///
    /// # Errors
    /// A message for anything but two positive counts.
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("expected PREFILL:DECODE replica counts, each at least 1, such as 8:8; got {s:?}");
        let (p, d) = s.split_once(':').ok_or_else(bad)?;
        let (prefill, decode) =
            (p.trim().parse::<u32>().map_err(|_| bad())?, d.trim().parse::<u32>().map_err(|_| bad())?);
        if prefill == 0 || decode == 0 {
            return Err(bad());
        }
        Ok(PdConfig { prefill, decode, ..PdConfig::default() })
    }
}

/// Simulates `trace` on a disaggregated fleet: `config` gives the engines' profile, block
/// size, event delay, metrics interval and router settings (its `replicas` must be
/// `prefill + decode`, for the run's figures); `prefill_policy` picks each request's prefill
/// replica; `decode_policy` its decode replica, or `None` for kvmesh's decode pick
/// ([`kvmesh_core::fleet`]'s disaggregated module: KV headroom, then decode time).
///
/// # Errors
/// A message for an invalid configuration (admission, scaling, replication or several
/// routers asked for; a non-positive link) or a routing error.
pub fn simulate_pd(
    config: &SimConfig,
    pd: &PdConfig,
    trace: &Trace,
    prefill_policy: &mut dyn Policy,
    mut decode_policy: Option<&mut dyn Policy>,
    seed: u64,
) -> Result<Run, String> {
    let started = Instant::now();
    config.profile.validate()?;
    if config.admission.is_some() || config.scaling.is_some() || config.replication.is_some() || config.routers != 1 {
        return Err("a disaggregated run has one router and no admission control, scaling or replication".into());
    }
    if config.replicas != pd.prefill + pd.decode {
        return Err(format!(
            "replicas ({}) must be prefill + decode ({} + {})",
            config.replicas, pd.prefill, pd.decode
        ));
    }
    if !(pd.link_gbps.is_finite() && pd.link_gbps > 0.0) {
        return Err(format!("the KV link must be a positive number of Gb/s, got {}", pd.link_gbps));
    }
    let fleet_config = FleetConfig { block_size: config.block_size, ..config.fleet.clone() };
    let mut fleet = Fleet::new(fleet_config).map_err(|e| e.to_string())?;
    let engine_ns = Namespace { model: "kvmesh-engine-sim".into(), ..Namespace::default() };
    let engine_hasher = BlockHasher::new(config.block_size, &engine_ns).map_err(|e| e.to_string())?;
    let mut engines = Vec::new();
    for r in 0..pd.prefill + pd.decode {
        let role = if r < pd.prefill { Role::Prefill } else { Role::Decode };
        let spec = ReplicaSpec {
            role,
            profile: config.profile.step(),
            ..ReplicaSpec::new(format!("{}-{r}", role.as_str()), config.profile.kv_blocks(config.block_size))
        };
        fleet.add_replica(spec).map_err(|e| e.to_string())?;
        engines.push(Engine::new(config.profile.clone(), engine_hasher));
    }
    let n = trace.requests.len();
    let mut sim = PdSim {
        config,
        trace,
        fleet,
        engines,
        queue: Queue::default(),
        rng: SmallRng::seed_from_u64(seed),
        prefill_booking: vec![None; n],
        decode_booking: vec![None; n],
        decode_of: vec![u32::MAX; n],
        tokens: vec![Vec::new(); n],
        outcomes: Vec::with_capacity(n),
        bytes_per_block: config.profile.kv_bytes_per_token as f64 * f64::from(config.block_size),
        link_bps: pd.link_gbps * 1e9,
        rejected: Vec::new(),
    };
    for (i, r) in trace.requests.iter().enumerate() {
        sim.queue.push(r.arrival_s, Ev::Arrival(i as u32));
    }
    sim.queue.push(0.0, Ev::Tick);
    let mut load_sum = (0.0, 0.0);
    while let Some((t, ev)) = sim.queue.pop() {
        match ev {
            Ev::Arrival(i) => {
                let loads = sim.engines.iter().map(|e| e.pending_prefill() as f64);
                let (max, sum) = loads.fold((0.0f64, 0.0), |(m, s), l| (m.max(l), s + l));
                load_sum.0 += max;
                load_sum.1 += sum / sim.engines.len() as f64;
                let dp: Option<&mut dyn Policy> = match &mut decode_policy {
                    Some(p) => Some(&mut **p),
                    None => None,
                };
                sim.arrive(prefill_policy, dp, i as usize, t)?;
            }
            Ev::StepDone(r) => sim.step_done(r as usize, t),
            Ev::Transferred(i) => sim.transferred(i as usize, t),
            Ev::Tick => {
                sim.scrape(t);
                sim.fleet.expire(t);
                if sim.outcomes.len() < n || sim.engines.iter().any(Engine::has_work) {
                    sim.queue.push(t + config.metrics_interval_s, Ev::Tick);
                }
            }
            other => return Err(format!("unexpected event {other:?} in a disaggregated run")),
        }
    }
    let arrived = sim.outcomes.len().max(1) as f64;
    let group_times = group_times(&trace.requests, &sim.outcomes);
    Ok(Run {
        preemptions: sim.engines.iter().map(Engine::preemptions).sum(),
        group_times,
        load_max_mean: (load_sum.0 / arrived, load_sum.1 / arrived),
        events: sim.queue.processed(),
        wall_s: started.elapsed().as_secs_f64(),
        outcomes: sim.outcomes,
        replication: None,
        scaling: None,
        scale_timeline: Vec::new(),
        booked_load: Vec::new(),
        fleet: sim.fleet,
    })
}

struct PdSim<'a> {
    config: &'a SimConfig,
    trace: &'a Trace,
    fleet: Fleet,
    engines: Vec<Engine>,
    queue: Queue,
    rng: SmallRng,
    prefill_booking: Vec<Option<BookingId>>,
    decode_booking: Vec<Option<BookingId>>,
    /// Per request, its decode replica (u32::MAX until routed).
    decode_of: Vec<u32>,
    /// Per request, its prompt (kept from the prefill leg for the decode side).
    tokens: Vec<Vec<u32>>,
    outcomes: Vec<Outcome>,
    bytes_per_block: f64,
    link_bps: f64,
    rejected: Vec<u64>,
}

impl PdSim<'_> {
    fn arrive(
        &mut self,
        prefill_policy: &mut dyn Policy,
        decode_policy: Option<&mut dyn Policy>,
        i: usize,
        t: f64,
    ) -> Result<(), String> {
        let req = &self.trace.requests[i];
        let tokens = prompt_tokens(req, i as u64, self.trace.block_tokens);
        let truth = req.output_tokens.max(1);
        let max_tokens = if self.config.send_max_tokens { Some(truth) } else { req.max_tokens };
        let route = RouteRequest::new(self.fleet.hasher(), &tokens, max_tokens)
            .with_output_hint(self.config.output_info.hint(truth));
        let (prefill, decode, booked) = match decode_policy {
            None => {
                let d =
                    self.fleet.decide_pd(prefill_policy, &route, None, &mut self.rng, t).map_err(|e| e.to_string())?;
                let booked = self.fleet.book_pd(prefill_policy, &route, d, t).map_err(|e| e.to_string())?;
                (d.prefill, d.decode, (booked.prefill.booking, booked.decode.booking))
            }
            Some(dp) => {
                let leg = route.prefill_leg();
                let p = self
                    .fleet
                    .decide_role(Role::Prefill, prefill_policy, &leg, None, &mut self.rng, t)
                    .map_err(|e| e.to_string())?;
                let mut d = self
                    .fleet
                    .decide_role(Role::Decode, dp, &route, None, &mut self.rng, t)
                    .map_err(|e| e.to_string())?;
                // A decode replica computes no prompt: booked with none.
                d.uncached_tokens = 0;
                let bp = self.fleet.book_decision(prefill_policy, &leg, p, t).map_err(|e| e.to_string())?;
                let bd = self.fleet.book_decision(dp, &route, d, t).map_err(|e| e.to_string())?;
                (p, d, (bp.booking, bd.booking))
            }
        };
        let (booked_prefill, booked_decode) = booked;
        self.prefill_booking[i] = Some(booked_prefill);
        self.decode_booking[i] = Some(booked_decode);
        self.decode_of[i] = decode.replica.0;
        self.outcomes.push(Outcome {
            arrival_s: t,
            replica: decode.replica.0,
            router: 0,
            first_token_s: f64::NAN,
            finish_s: f64::NAN,
            prompt_tokens: tokens.len() as u32,
            cached_tokens: 0,
            output_tokens: truth,
            estimated_ttft_s: prefill.estimated_ttft_s,
            rejected: false,
        });
        let r = prefill.replica.index();
        self.engines[r].enqueue(EngineRequest {
            id: i as u64,
            tokens: tokens.clone().into(),
            output_tokens: 1,
            lora: None,
            remote_prefill: false,
        });
        self.tokens[i] = tokens;
        self.kick(r, t);
        Ok(())
    }

    fn is_prefill(&self, r: usize) -> bool {
        self.fleet.replicas()[r].spec.role == Role::Prefill
    }

    fn step_done(&mut self, r: usize, t: f64) {
        let out = self.engines[r].finish_step();
        for ev in &out.events {
            let _ = self.fleet.apply_event(ReplicaId(r as u32), ev, t);
        }
        let prefill = self.is_prefill(r);
        for &(id, cached) in &out.first_tokens {
            let i = id as usize;
            let booking = if prefill {
                self.outcomes[i].cached_tokens = cached;
                self.prefill_booking[i]
            } else {
                self.outcomes[i].first_token_s = t;
                self.decode_booking[i]
            };
            if let Some(b) = booking {
                let _ = self.fleet.first_token(b, t);
            }
        }
        for &id in &out.finished {
            let i = id as usize;
            if prefill {
                if let Some(b) = self.prefill_booking[i].take() {
                    let _ = self.fleet.release(b, None);
                }
                let d = self.decode_of[i] as usize;
                let secs = self.transfer_blocks(i, d) as f64 * self.bytes_per_block * 8.0 / self.link_bps;
                self.queue.push(t + secs, Ev::Transferred(id as u32));
            } else {
                self.outcomes[i].finish_s = t;
                if let Some(b) = self.decode_booking[i].take() {
                    let _ = self.fleet.release(b, Some(self.outcomes[i].output_tokens));
                }
            }
        }
        self.kick(r, t);
    }

    /// Prompt blocks of request `i` decode replica `d` does not hold (what crosses the link).
    fn transfer_blocks(&mut self, i: usize, d: usize) -> u64 {
        self.engines[d].lacking_blocks(&self.tokens[i], None)
    }

    fn transferred(&mut self, i: usize, t: f64) {
        let d = self.decode_of[i] as usize;
        self.engines[d].enqueue(EngineRequest {
            id: i as u64,
            tokens: std::mem::take(&mut self.tokens[i]).into(),
            output_tokens: self.outcomes[i].output_tokens,
            lora: None,
            remote_prefill: true,
        });
        self.kick(d, t);
    }

    fn kick(&mut self, r: usize, t: f64) {
        if self.engines[r].stepping() || !self.engines[r].has_work() {
            return;
        }
        loop {
            if let Some(d) = self.engines[r].start_step(&mut self.rejected) {
                self.queue.push(t + d, Ev::StepDone(r as u32));
                break;
            }
            match self.engines[r].has_work().then(|| self.engines[r].reject_head()).flatten() {
                Some(id) => self.rejected.push(id),
                None => break,
            }
        }
        for id in std::mem::take(&mut self.rejected) {
            let i = id as usize;
            self.outcomes[i].rejected = true;
            for b in [self.prefill_booking[i].take(), self.decode_booking[i].take()].into_iter().flatten() {
                let _ = self.fleet.release(b, None);
            }
        }
    }

    fn scrape(&mut self, t: f64) {
        for (r, e) in self.engines.iter().enumerate() {
            let (running, waiting, kv_usage) = e.metrics();
            let _ = self.fleet.report_metrics(ReplicaId(r as u32), EngineMetrics { running, waiting, kv_usage, at: t });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::simulation::tests::profile;
    use crate::trace::{TraceFormat, TraceRequest};
    use kvmesh_core::policy::PolicyKind;

    /// Requests `(arrival, block ids, output tokens)` of 4-token blocks.
    fn trace(reqs: &[(f64, &[u64], u32)]) -> Trace {
        let requests = reqs
            .iter()
            .map(|&(arrival_s, ids, output_tokens)| TraceRequest {
                arrival_s,
                input_tokens: 4 * ids.len() as u32,
                output_tokens,
                block_ids: ids.to_vec(),
                max_tokens: None,
                group: None,
            })
            .collect();
        Trace { format: TraceFormat::Mooncake, block_tokens: Some(4), requests, skipped: vec![] }
    }

    fn config(replicas: u32) -> SimConfig {
        SimConfig { replicas, profile: profile(), block_size: 4, ..SimConfig::default() }
    }

    fn close(a: f64, b: f64) {
        assert!((a - b).abs() < 1e-12, "{a} != {b}");
    }

    #[test]
    fn a_request_prefills_crosses_the_link_and_decodes_in_known_times() {
        let pd = PdConfig { prefill: 1, decode: 1, link_gbps: 100.0 };
        let t = trace(&[(0.0, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 3)]);
        let mut p = PolicyKind::TokenLoad.build();
        let r = simulate_pd(&config(2), &pd, &t, p.as_mut(), None, 1).unwrap();
        let o = r.outcomes[0];
        // Prefill: β0 + 40 β1. Transfer: 10 blocks × 4 tokens × 128 KiB × 8 bit / 100 Gb/s.
        // Decode: the load step (β0, nothing computed), then two decode steps (β0 + β2).
        let prefill = 1e-3 + 40.0 * 1e-3;
        let transfer = 10.0 * 4.0 * 131_072.0 * 8.0 / 100e9;
        close(o.first_token_s, prefill + transfer + 1e-3);
        close(o.finish_s, prefill + transfer + 1e-3 + 2.0 * 1.1e-3);
        assert_eq!((o.replica, o.prompt_tokens, o.cached_tokens, o.rejected), (1, 40, 0, false));
        assert!(r.fleet.bookings().is_empty(), "both bookings released");
        // The decode replica announced the 10 blocks it received: the router's index has them.
        assert_eq!(r.fleet.index().replica_blocks(ReplicaId(1)), 10);
        assert_eq!(r.fleet.index().replica_blocks(ReplicaId(0)), 10);
    }

    #[test]
    fn a_decode_replica_holding_the_prefix_receives_only_the_rest() {
        // The second request shares 8 of its 10 blocks with the first: it prefills 2 blocks'
        // tokens on the prefill replica holding them and receives 2 blocks.
        let pd = PdConfig { prefill: 1, decode: 1, link_gbps: 100.0 };
        let t = trace(&[(0.0, &[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2), (1.0, &[1, 2, 3, 4, 5, 6, 7, 8, 20, 21], 2)]);
        let mut p = PolicyKind::TokenLoad.build();
        let r = simulate_pd(&config(2), &pd, &t, p.as_mut(), None, 1).unwrap();
        let o = r.outcomes[1];
        assert_eq!(o.cached_tokens, 32);
        let prefill = 1e-3 + 8.0 * 1e-3;
        let transfer = 2.0 * 4.0 * 131_072.0 * 8.0 / 100e9;
        close(o.first_token_s - o.arrival_s, prefill + transfer + 1e-3);
    }

    #[test]
    fn peer_pairs_pick_each_side_with_their_own_policy() {
        let pd = PdConfig { prefill: 2, decode: 2, link_gbps: 100.0 };
        let reqs: Vec<(f64, Vec<u64>, u32)> =
            (0..8).map(|k| (k as f64 * 0.001, (100 * k..100 * k + 5).collect(), 4)).collect();
        let reqs: Vec<(f64, &[u64], u32)> = reqs.iter().map(|(a, ids, o)| (*a, ids.as_slice(), *o)).collect();
        let t = trace(&reqs);
        let (mut p, mut d) = (PolicyKind::RoundRobin.build(), PolicyKind::RoundRobin.build());
        let r = simulate_pd(&config(4), &pd, &t, p.as_mut(), Some(d.as_mut()), 1).unwrap();
        // Round robin on the decode side alternates its two replicas (ids 2 and 3).
        let decodes: Vec<u32> = r.outcomes.iter().map(|o| o.replica).collect();
        assert_eq!(decodes.iter().filter(|&&x| x == 2).count(), 4);
        assert_eq!(decodes.iter().filter(|&&x| x == 3).count(), 4);
        assert!(r.outcomes.iter().all(|o| o.finish_s.is_finite()));
        assert!(r.fleet.bookings().is_empty());
        assert_eq!(
            simulate_pd(&config(3), &pd, &t, p.as_mut(), None, 1).unwrap_err(),
            "replicas (3) must be prefill + decode (2 + 2)"
        );
        assert_eq!("8:8".parse::<PdConfig>().unwrap(), PdConfig::default());
        assert!("8:0".parse::<PdConfig>().is_err() && "8".parse::<PdConfig>().is_err());
    }
}

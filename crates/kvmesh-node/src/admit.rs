//! Routing one request through admission control, for both paths that route: the OpenAI
//! proxy and gRPC `Router.Route`. While capacity is short (or the TTFT gate holds the
//! request), nothing is booked: the request waits in the queue and is decided afresh when
//! capacity frees.

use crate::admission::Refused;
use crate::endpoints::Endpoints;
use crate::state::Shared;
use kvmesh_core::{RouteRequest, Routed};
use std::sync::Arc;
use std::time::Instant;

/// A request routed and booked.
pub struct Admitted {
    /// The decision and its booking.
    pub routed: Routed,
    /// The chosen replica's name.
    pub replica: String,
    /// Its URLs.
    pub endpoints: Arc<Endpoints>,
    /// When it was decided, on the node's clock, seconds.
    pub at: f64,
    /// How long the deciding and booking took (the core's lock included; waits in the queue
    /// not), seconds.
    pub decision_s: f64,
    /// A disaggregated request's decode side (then `routed`, `replica` and `endpoints` are
    /// its prefill side's); `None` for a request served whole.
    pub decode: Option<Leg>,
}

/// One side of a disaggregated request, booked.
pub struct Leg {
    /// The decision and its booking.
    pub routed: Routed,
    /// The replica's name.
    pub replica: String,
    /// Its URLs.
    pub endpoints: Arc<Endpoints>,
}

/// What one pass through the core produced.
enum Decided {
    /// Booked: the (prefill) replica's, and a decode side's when disaggregated.
    Booked((Routed, String, Arc<Endpoints>), Option<Leg>),
    /// Held: capacity is short; the token load it waits with.
    Held(u64),
}

/// Why a request was not routed.
pub enum NotAdmitted {
    /// The core had no replica for it (none ready, …).
    NoReplica(kvmesh_core::Error),
    /// Admission control refused it (answer 429 / `RESOURCE_EXHAUSTED`).
    Refused(Refused),
    /// It would wait for capacity that never comes: its prompt and `max_tokens` need more KV
    /// blocks than the largest replica holds (answer 400 / `INVALID_ARGUMENT`; vLLM would
    /// refuse it too). Only when the prompt's token count is exact (a tokenizer, or token ids).
    NeverFits(kvmesh_core::fleet::FitsNowhere),
}

impl NotAdmitted {
    /// The client's message for [`NotAdmitted::NeverFits`].
    pub fn never_fits(f: &kvmesh_core::fleet::FitsNowhere) -> String {
        format!(
            "the prompt ({} tokens) and max_tokens ({}) need {} KV blocks of {} tokens; the largest replica holds {} \
             (capacity_blocks): lower max_tokens or shorten the prompt",
            f.prompt_tokens, f.max_tokens, f.needed_blocks, f.block_size, f.largest_blocks
        )
    }
}

/// The path a request came by.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Via {
    /// The OpenAI proxy: its outcomes count in `kvmesh_requests_total{outcome}`.
    Proxy,
    /// gRPC `Router.Route`.
    Route,
    /// A gateway's endpoint picker ([`crate::epp`]): the node follows the response as the
    /// proxy does, so it counts as the proxy's requests do.
    Gateway,
}

/// One request's passage through admission control, kept across its retries on other
/// replicas: its demand is counted once, and its waits share one `max_wait`.
pub struct Ticket<'a> {
    shared: &'a Shared,
    via: Via,
    /// Whether the prompt's token count is exact (a tokenizer, or token ids given).
    exact: bool,
    /// It fits no replica by the router's count, which may be off (approximate tokens, or
    /// prompt and output rounded up to blocks apart): sent without waiting, for the engine
    /// (which counts exactly) to serve or refuse.
    unqueued: bool,
    /// When the request reached the node (its TTFT clock starts there).
    arrived: tokio::time::Instant,
    demand_counted: bool,
    deadline: Option<tokio::time::Instant>,
    /// Whether its prompt feeds the hot-prefix sketch (see [`Ticket::for_selected`]).
    hot_prefix: bool,
    /// The replicas it may go to (sorted ids), when a gateway named a subset.
    subset: Option<Vec<kvmesh_core::ReplicaId>>,
    /// The model and LoRA adapter it runs under: only replicas serving it may take it.
    adapter: Option<(String, String)>,
    /// Replicas it is not to go to again (one that failed it before any byte reached the
    /// client), sorted ids.
    excluded: Vec<kvmesh_core::ReplicaId>,
    /// Served whole even where its model is disaggregated (a gRPC caller that cannot run the
    /// disaggregated flow).
    whole_only: bool,
}

/// Observes a wait in the admission queue once, however it ends (routed, refused after
/// waiting, or the client gone and the future dropped); `None` metrics: not observed (a
/// request refused at once by a full queue never waited). Dropped while still waiting
/// (`settled` false), it counts the request as abandoned (and, proxied, as `disconnected` in
/// `kvmesh_requests_total`, as a client that goes away after routing is).
struct Held<'a> {
    since: tokio::time::Instant,
    metrics: Option<&'a crate::metrics::Metrics>,
    via: Via,
    settled: bool,
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(m) = self.metrics {
            m.admission_wait.observe(self.since.elapsed().as_secs_f64());
            if !self.settled {
                m.admission_abandoned.inc();
                if self.via != Via::Route {
                    m.request("disconnected");
                }
            }
        }
    }
}

/// Marks a wait as ended by the router, not by the client going away.
fn settle(held: &mut Option<Held<'_>>) {
    if let Some(h) = held {
        h.settled = true;
    }
}

impl<'a> Ticket<'a> {
    /// A request that reached the node at `arrived` by `via`; `exact`: its prompt's token
    /// count is exact (a tokenizer, or token ids given), not kvmesh's approximate one.
    pub fn new(shared: &'a Shared, via: Via, exact: bool, arrived: tokio::time::Instant) -> Self {
        Ticket {
            shared,
            via,
            exact,
            unqueued: false,
            arrived,
            demand_counted: false,
            deadline: None,
            hot_prefix: true,
            subset: None,
            adapter: None,
            excluded: Vec::new(),
            whole_only: false,
        }
    }

    /// Routes it whole, among its model's `both` replicas, even where the model is served
    /// disaggregated.
    pub fn whole_only(mut self, whole: bool) -> Self {
        self.whole_only = whole;
        self
    }

    /// Keeps the request off `replica` from now on (its retries go elsewhere).
    pub fn exclude(&mut self, replica: kvmesh_core::ReplicaId) {
        if let Err(i) = self.excluded.binary_search(&replica) {
            self.excluded.insert(i, replica);
        }
    }

    /// The replicas it may go to: the adapter's servers or the gateway's subset, without the
    /// excluded ones (sorted ids); `None`: any.
    fn allowed(&self, core: &crate::state::Core) -> Option<Vec<kvmesh_core::ReplicaId>> {
        let serving = self.adapter.as_ref().and_then(|(m, a)| core.serving_adapter(m, a, self.subset.as_deref()));
        let base = serving.or_else(|| self.subset.clone());
        if self.excluded.is_empty() {
            return base;
        }
        let all = || {
            let mut ids: Vec<_> = core.replicas.values().map(|r| r.id).collect();
            ids.sort_unstable();
            ids
        };
        let mut ids = base.unwrap_or_else(all);
        ids.retain(|id| self.excluded.binary_search(id).is_err());
        Some(ids)
    }

    /// For a request selecting `selected`: the prompt of a LoRA adapter's, a non-default
    /// model's or a salted request stays out of the hot-prefix sketch, since replication warms
    /// `node.model`'s unsalted base-model prefixes only.
    pub fn for_selected(mut self, selected: &crate::models::Selected) -> Self {
        self.hot_prefix = *selected == crate::models::Selected::default();
        let model = self.shared.models.of_replica(selected.model.as_deref());
        self.adapter = selected.adapter.clone().map(|a| (model.to_string(), a));
        self
    }

    /// Restricts the pick to `subset` (replica ids, any order), when given.
    pub fn within(mut self, subset: Option<Vec<kvmesh_core::ReplicaId>>) -> Self {
        self.subset = subset.map(|mut s| {
            s.sort_unstable();
            s.dedup();
            s
        });
        self
    }

    /// Decides where `req` (`tokens`, answer of at most `max_tokens` tokens) goes and books
    /// it — after waiting in the admission queue while capacity is short (with `[admission]`
    /// on): no replica with room for it, or with `ttft_slo` the best replica would make it
    /// miss the SLO with more than half the SLO queued there.
    ///
    /// # Errors
    /// [`NotAdmitted::NoReplica`] when the core has no replica for it;
    /// [`NotAdmitted::Refused`] when the queue is full, it was evicted for a newer request,
    /// or it waited `max_wait` (the refusal is counted and logged here);
    /// [`NotAdmitted::NeverFits`] (with `[admission]` on and an exact token count) when no
    /// replica could ever hold it, before its demand is counted.
    pub async fn route(
        &mut self,
        req: &RouteRequest,
        tokens: &[u32],
        max_tokens: Option<u32>,
    ) -> Result<Admitted, NotAdmitted> {
        let shared = self.shared;
        let adm = &shared.admission;
        // Waiting is for capacity that frees; none frees enough for a request that fits no
        // replica even empty. With an approximate count, let the engine judge instead.
        if adm.section.enabled && !self.demand_counted && !self.unqueued {
            if let Some(f) = shared.core().fleet.fits_nowhere_for(req.model, req.prompt_tokens, max_tokens) {
                if self.exact && f.certain() {
                    return Err(NotAdmitted::NeverFits(f));
                }
                // The router's count may be off (approximate tokens, per-part rounding).
                self.unqueued = true;
            }
        }
        // This call's wait in the queue, observed once however it ends.
        let mut held: Option<Held<'_>> = None;
        loop {
            let t0 = Instant::now();
            let now = shared.now();
            // The core's lock lives in this block only: the caller's future must stay Send.
            let decided = {
                let mut core = shared.core();
                let allowed = self.allowed(&core);
                let arrived = self.arrived;
                // Capacity short, or (with the TTFT gate) the best replica would make it miss
                // its SLO: wait rather than pile onto a full replica.
                let holds = |core: &crate::state::Core, d: &kvmesh_core::Decision, gated: bool| {
                    adm.section.enabled
                        && !self.unqueued
                        && (core.fleet.capacity_short(d)
                            || gated && adm.gate().is_some_and(|g| !g.admits(d, arrived.elapsed().as_secs_f64())))
                };
                let load =
                    |d: &kvmesh_core::Decision| u64::from(d.uncached_tokens) + u64::from(max_tokens.unwrap_or(0));
                let via = self.via;
                // The proxy waits on what it sends (the hung-engine check counts it); a gRPC
                // caller's request is the caller's to wait on.
                let proxied = |core: &mut crate::state::Core, name: &str| {
                    if via != Via::Route {
                        if let Some(r) = core.replicas.get_mut(name) {
                            r.proxied += 1;
                        }
                    }
                };
                if !self.whole_only && core.disaggregated(req.model, allowed.as_deref()) {
                    core.decide_pd_within(req, allowed.as_deref(), now).and_then(|d| {
                        if !std::mem::replace(&mut self.demand_counted, true) {
                            core.count_demand(req, tokens, &d.prefill, now, self.hot_prefix);
                        }
                        // The prefill side's TTFT is the request's; the decode side's KV and
                        // slots must have room too.
                        if holds(&core, &d.prefill, true) || holds(&core, &d.decode, false) {
                            return Ok(Decided::Held(load(&d.prefill)));
                        }
                        let (routed, [(pname, pend), (dname, dend)]) = core.book_pd(req, d, now)?;
                        proxied(&mut core, &pname);
                        proxied(&mut core, &dname);
                        let decode = Leg { routed: routed.decode, replica: dname, endpoints: dend };
                        Ok(Decided::Booked((routed.prefill, pname, pend), Some(decode)))
                    })
                } else {
                    core.decide_within(req, allowed.as_deref(), now).and_then(|d| {
                        if !std::mem::replace(&mut self.demand_counted, true) {
                            core.count_demand(req, tokens, &d, now, self.hot_prefix);
                        }
                        if holds(&core, &d, true) {
                            return Ok(Decided::Held(load(&d)));
                        }
                        let booked = core.book(req, d, now)?;
                        proxied(&mut core, &booked.1);
                        Ok(Decided::Booked(booked, None))
                    })
                }
            };
            match decided {
                Err(e) => {
                    settle(&mut held);
                    return Err(NotAdmitted::NoReplica(e));
                }
                Ok(Decided::Booked((routed, replica, endpoints), decode)) => {
                    settle(&mut held);
                    drop(held);
                    let decision_s = t0.elapsed().as_secs_f64();
                    return Ok(Admitted { routed, replica, endpoints, at: now, decision_s, decode });
                }
                Ok(Decided::Held(load)) => {
                    let first = held.is_none();
                    let h = held.get_or_insert_with(|| Held {
                        since: tokio::time::Instant::now(),
                        metrics: Some(&shared.metrics),
                        via: self.via,
                        settled: false,
                    });
                    let deadline =
                        *self.deadline.get_or_insert_with(|| tokio::time::Instant::now() + adm.section.max_wait);
                    let model = req.model.unwrap_or(shared.settings.hasher.model());
                    if let Err(why) = adm.wait_as(load, model, self.arrived, deadline).await {
                        h.settled = true;
                        if first && why == Refused::QueueFull {
                            h.metrics = None;
                        }
                        adm.refused(why);
                        shared.metrics.admission_refused(why.outcome());
                        return Err(NotAdmitted::Refused(why));
                    }
                }
            }
        }
    }
}

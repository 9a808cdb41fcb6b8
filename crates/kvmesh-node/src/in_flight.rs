//! A routed request this node follows to its end — through its own proxy, or as a gateway's
//! endpoint picker watching the response go by ([`crate::epp`]): its booking, released
//! exactly once on every path, its TTFT and E2E, and its span.

use crate::state::Shared;
use crate::telemetry::REQUEST_TARGET;
use kvmesh_core::load::BookingId;
use kvmesh_core::Routed;
use std::sync::Arc;

/// A routed request's span, `request`, its decision fields empty until routed.
///
/// At debug, as the per-request events: exported to OpenTelemetry all the same (see
/// [`crate::telemetry`]), but not formatted into every log line at info, where building and
/// recording its fields was ~6 % of the node's CPU (BENCHMARKS.md, router node).
pub(crate) fn request_span(path: &str, prompt_tokens: usize, policy: &str) -> tracing::Span {
    tracing::debug_span!(
        target: REQUEST_TARGET,
        "request",
        otel.kind = "server",
        path,
        prompt_tokens,
        policy,
        replica = tracing::field::Empty,
        decode_replica = tracing::field::Empty,
        reason = tracing::field::Empty,
        overlap_blocks = tracing::field::Empty,
        uncached_tokens = tracing::field::Empty,
        estimated_ttft_s = tracing::field::Empty,
        attempts = tracing::field::Empty,
        outcome = tracing::field::Empty,
    )
}

/// A routed request's booking: released exactly once, on every path (completion, error,
/// client disconnect — the drop).
pub(crate) struct InFlight {
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: Option<BookingId>,
    pub(crate) replica: String,
    pub(crate) first_token_seen: bool,
    /// The request's span: it ends when the booking does (a streamed answer outlives the
    /// handler).
    pub(crate) span: tracing::Span,
    /// Prompt tokens and the leading blocks the replica was believed to hold: a request that
    /// fills no KV block beyond those makes the engine publish no event, so its success says
    /// nothing about the event stream.
    pub(crate) prompt_tokens: u32,
    pub(crate) overlap_blocks: u32,
    /// When it was routed, node seconds.
    pub(crate) routed_at: f64,
    /// When the request reached the node: its TTFT is measured from here.
    pub(crate) arrived: tokio::time::Instant,
    /// Its exact prompt tokens and namespace, kept to place what a partial history lost
    /// ([`InFlight::with_prompt`]).
    pub(crate) prompt: Option<(Arc<[u32]>, crate::models::Selected)>,
    /// Which part of the request this booking is.
    pub(crate) side: Side,
}

/// The part of a request one booking follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    /// A request served whole.
    Whole,
    /// A disaggregated request's prefill leg: its decision counts the request's prompt and
    /// predicted hits; its end is not the request's (no `kvmesh_requests_total`).
    Prefill,
    /// A disaggregated request's decode side: its end is the request's; its decision adds no
    /// prompt tokens (the prefill side counted them).
    Decode,
}

/// Wakes the admission queue's next waiter of the released replica's model when dropped
/// (after the booking's release).
struct WakeOnDrop<'a>(&'a Shared, Option<kvmesh_core::ModelKey>);

impl Drop for WakeOnDrop<'_> {
    fn drop(&mut self) {
        self.0.admission.capacity_freed_for(self.1);
    }
}

impl InFlight {
    /// Follows `routed` (decided at `at`, node seconds, in `decision_s`) on `replica`: counts
    /// the decision in the metrics and the decision log (`via`: `http`, `gateway`), records
    /// it on `span`, and holds its booking until released or dropped.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn routed(
        shared: &Arc<Shared>,
        routed: &Routed,
        replica: &str,
        at: f64,
        decision_s: f64,
        prompt_tokens: u32,
        via: &'static str,
        span: &tracing::Span,
        arrived: tokio::time::Instant,
    ) -> InFlight {
        Self::routed_side(shared, routed, replica, (at, decision_s), prompt_tokens, via, span, arrived, Side::Whole)
    }

    /// [`InFlight::routed`] for one side of a request (see [`Side`]); `(at, decision_s)`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn routed_side(
        shared: &Arc<Shared>,
        routed: &Routed,
        replica: &str,
        (at, decision_s): (f64, f64),
        prompt_tokens: u32,
        via: &'static str,
        span: &tracing::Span,
        arrived: tokio::time::Instant,
        side: Side,
    ) -> InFlight {
        let d = &routed.decision;
        let m = &shared.metrics;
        if side != Side::Decode {
            // One decision per request, as gRPC Route counts it: the prefill side's (the
            // decode side is kvmesh's decode pick, logged with the request's span).
            let labels = vec![("policy", shared.policy_name().to_string()), ("reason", d.reason.as_str().into())];
            m.decisions.get_or_create(&labels).inc();
            m.decision_latency.observe(decision_s);
            m.prompt_tokens.inc_by(u64::from(prompt_tokens));
            m.predicted_cached_tokens.inc_by(u64::from(prompt_tokens).saturating_sub(u64::from(d.uncached_tokens)));
        }
        span.in_scope(|| {
            tracing::debug!(
                target: REQUEST_TARGET,
                replica,
                reason = d.reason.as_str(),
                overlap_blocks = d.overlap_blocks,
                estimated_ttft_s = d.estimated_ttft_s,
                "routed"
            );
        });
        if side != Side::Decode {
            shared.record_decision(crate::state::DecisionRecord {
                at,
                via,
                replica: replica.to_string(),
                reason: d.reason.as_str(),
                prompt_tokens,
                overlap_blocks: d.overlap_blocks,
                uncached_tokens: d.uncached_tokens,
                estimated_ttft_s: d.estimated_ttft_s,
            });
        }
        match side {
            Side::Decode => {
                span.record("decode_replica", replica);
            }
            _ => {
                span.record("replica", replica);
                span.record("reason", d.reason.as_str());
                span.record("overlap_blocks", d.overlap_blocks);
                span.record("uncached_tokens", d.uncached_tokens);
                span.record("estimated_ttft_s", d.estimated_ttft_s);
            }
        }
        shared.in_flight.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        InFlight {
            shared: shared.clone(),
            id: Some(routed.booking),
            replica: replica.to_string(),
            first_token_seen: false,
            span: span.clone(),
            prompt_tokens,
            overlap_blocks: d.overlap_blocks,
            routed_at: at,
            arrived,
            prompt: None,
            side,
        }
    }

    /// Keeps the request's prompt `tokens` and namespace: when it ends well on a replica
    /// whose history is partial, the stores waiting there that continue it are placed
    /// ([`kvmesh_core::PrefixIndex::adopt_prompt`]). Tokens that are not the engine's own
    /// (no tokenizer configured) match no store's token ids, so they place nothing.
    pub(crate) fn with_prompt(mut self, tokens: &Arc<[u32]>, selected: &crate::models::Selected) -> Self {
        self.prompt = Some((tokens.clone(), selected.clone()));
        self
    }

    /// The first token arrived: with `streamed`, the first chunk of a streamed answer (a
    /// non-streamed answer arrives whole, so its wait is not a TTFT and is not measured).
    pub(crate) fn first_token(&mut self, streamed: bool) {
        if !std::mem::replace(&mut self.first_token_seen, true) {
            if let Some(id) = self.id {
                let ttft = self.arrived.elapsed().as_secs_f64();
                let m = &self.shared.metrics;
                let labels = vec![("replica", self.replica.clone()), ("streamed", streamed.to_string())];
                m.replica_ttft.get_or_create(&labels).observe(ttft);
                if streamed {
                    m.ttft.observe(ttft);
                    if self.shared.admission.gate().is_some_and(|g| ttft > g.slo_s()) {
                        m.ttft_over_slo.inc();
                    }
                }
                let now = self.shared.now();
                let _ = self.shared.core().first_token(id, now);
                self.span.in_scope(|| tracing::debug!(target: REQUEST_TARGET, replica = %self.replica, "first token"));
            }
        }
    }

    /// Ends the booking with the request's final `outcome` (`kvmesh_requests_total`) and the
    /// replica's (`kvmesh_replica_requests_total`).
    pub(crate) fn release(&mut self, output_tokens: Option<u32>, outcome: &'static str) {
        self.release_charging(output_tokens, outcome, Count { replica: true, request: true });
    }

    /// Ends the booking of an attempt the request goes on from (to another replica): the
    /// outcome counts against the replica only; the request's own outcome is counted once it
    /// ends, so `kvmesh_requests_total` has one outcome per client request.
    pub(crate) fn release_retried(&mut self, outcome: &'static str) {
        self.release_charging(None, outcome, Count { replica: true, request: false });
    }

    /// Ends the booking of a side that was never sent the request (its partner failed, and the
    /// request goes on elsewhere): counted neither for the request nor against its replica.
    pub(crate) fn release_untouched(&mut self, outcome: &'static str) {
        self.release_charging(None, outcome, Count { replica: false, request: false });
    }

    fn release_charging(&mut self, output_tokens: Option<u32>, outcome: &'static str, count: Count) {
        if let Some(id) = self.id.take() {
            // Whatever happens below, a queued request may fit now.
            let mut wake = WakeOnDrop(&self.shared, None);
            self.shared.in_flight.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            let now = self.shared.now();
            let mut core = self.shared.core();
            wake.1 = core.replicas.get(&self.replica).and_then(|r| core.fleet.replica(r.id)).map(|s| s.model);
            let expected = core.fleet.bookings().get(id).map(|b| b.expected_at_booking);
            let _ = core.release(id, output_tokens, now);
            if let Some(r) = core.replicas.get_mut(&self.replica) {
                r.proxied = r.proxied.saturating_sub(1);
            }
            // Full blocks of prompt and output beyond those it was believed to hold: the
            // engine computed (and so published) at least one.
            let tokens = u64::from(self.prompt_tokens) + u64::from(output_tokens.unwrap_or(0));
            let bs = self.prompt.as_ref().and_then(|(_, s)| s.block_size).unwrap_or(self.shared.settings.block_size);
            let new_blocks = tokens / u64::from(bs) > u64::from(self.overlap_blocks);
            if outcome == "ok" && new_blocks {
                core.served_new_blocks(&self.replica, self.routed_at);
            }
            let prompt = self.prompt.take().filter(|_| outcome == "ok");
            let waiting =
                prompt.as_ref().and_then(|(tokens, selected)| core.keep_prompt(&self.replica, tokens, selected));
            drop(core);
            // Stores waiting there that continue the prompt are placed through the index's
            // writer, after the core's lock (which never waits for the writer's holder).
            let adopted = match (waiting, &prompt) {
                (Some(id), Some((tokens, s))) => {
                    self.shared.index.write().adopt_prompt(id, tokens, s.adapter.as_deref(), s.salt.as_deref())
                }
                _ => None,
            };
            if let (Some(out), Some(expected), "ok") = (output_tokens, expected, outcome) {
                let m = &self.shared.metrics;
                m.output_tokens.inc_by(u64::from(out));
                m.expected_output_tokens.inc_by(u64::from(expected));
                m.output_estimate_ratio.observe(f64::from(out) / f64::from(expected.max(1)));
            }
            if let Some(o) = adopted.filter(|o| o.inferred > 0) {
                let l = vec![("replica", self.replica.clone())];
                self.shared.metrics.inferred_blocks.get_or_create(&l).inc_by(u64::from(o.inferred));
                self.shared.metrics.adopted_blocks.get_or_create(&l).inc_by(u64::from(o.adopted));
            }
            let m = &self.shared.metrics;
            if count.request && self.side != Side::Prefill {
                m.request(outcome);
            }
            if count.replica {
                m.replica_requests
                    .get_or_create(&vec![("replica", self.replica.clone()), ("outcome", outcome.into())])
                    .inc();
            }
            if outcome == "ok" && self.side != Side::Prefill {
                m.replica_e2e
                    .get_or_create(&vec![("replica", self.replica.clone())])
                    .observe(self.arrived.elapsed().as_secs_f64());
            }
            if count.request && self.side != Side::Prefill {
                self.span.record("outcome", outcome);
                if outcome != "ok" {
                    crate::telemetry::failed(&self.span, outcome);
                }
            }
            // Per request at debug: two info lines per request cost ~35 µs of CPU (synchronous
            // writes to stderr) and ~40 µs of added p50 at 500 req/s (BENCHMARKS.md);
            // the metrics count every outcome.
            self.span.in_scope(
                || tracing::debug!(target: REQUEST_TARGET, replica = %self.replica, outcome, output_tokens, "complete"),
            );
        }
    }
}

/// Which counters a booking's end moves.
#[derive(Debug, Clone, Copy)]
struct Count {
    /// `kvmesh_replica_requests_total`: the replica took (or failed) the attempt.
    replica: bool,
    /// `kvmesh_requests_total`: the request ends here.
    request: bool,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.release(None, "disconnected");
    }
}

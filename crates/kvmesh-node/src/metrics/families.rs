//! Every metric family, registered under its name, help and unit.

use super::*;

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("kvmesh");
        let m = Metrics {
            decisions: Family::default(),
            decision_latency: Histogram::new(exponential_buckets(1e-6, 2.0, 20)),
            // 5 ms to 41 s.
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            ttft_over_slo: Counter::default(),
            replica_requests: Family::default(),
            pd_errors: {
                // Every series present from the start, at 0: an alert on the rate sees a
                // healthy fleet, not no data.
                let f: Family<Labels, Counter> = Family::default();
                for side in ["prefill", "decode"] {
                    for kind in ["unreachable", "overloaded", "failed", "no_transfer_params"] {
                        if side == "decode" && kind == "no_transfer_params" {
                            continue;
                        }
                        let _ = f.get_or_create(&vec![("side", side.to_string()), ("kind", kind.to_string())]);
                    }
                }
                f
            },
            replica_ttft: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            replica_e2e: Family::new_with_constructor(latency_histogram as fn() -> Histogram),
            // 5 ms to 41 s.
            admission_wait: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            requests: Family::default(),
            admission_refused: Family::default(),
            admission_abandoned: Counter::default(),
            bookings_expired: Counter::default(),
            prompt_tokens: Counter::default(),
            predicted_cached_tokens: Counter::default(),
            engine_cached_tokens: Counter::default(),
            output_tokens: Counter::default(),
            expected_output_tokens: Counter::default(),
            // 1/64 to 64.
            output_estimate_ratio: Histogram::new(exponential_buckets(1.0 / 64.0, 2.0, 13)),
            events_applied: Family::default(),
            event_lag: Histogram::new(exponential_buckets(0.000_25, 1.5, 20)),
            events_rejected: Family::default(),
            resyncs: Family::default(),
            replay_copies: Family::default(),
            quarantines: Family::default(),
            orphaned_blocks: Family::default(),
            adopted_blocks: Family::default(),
            inferred_blocks: Family::default(),
            replica_orphan_blocks: Family::default(),
            replica_recovered: Family::default(),
            replica_status: Family::default(),
            replica_queued_prefill: Family::default(),
            replica_bookings: Family::default(),
            replica_kv_usage: Family::default(),
            replica_index_blocks: Family::default(),
            replica_capacity_blocks: Family::default(),
            replica_idle: Family::default(),
            gossip_sent: Counter::default(),
            gossip_dropped: Counter::default(),
            gossip_deltas_received: Counter::default(),
            gossip_peer_bookings: Family::default(),
            gossip_peer_age: Family::default(),
            gossip_peer_up: Family::default(),
            raft: Default::default(),
            replication_warmups: Family::default(),
            replication: Default::default(),
            replication_targets: Family::default(),
            replication_top_share: Gauge::default(),
            autoscaler: Default::default(),
            admission_queue: Gauge::default(),
            http_body_bytes: Gauge::default(),
            registry: Registry::default(),
        };
        registry.register("decisions", "Routing decisions by policy and reason", m.decisions.clone());
        registry.register("decision_latency_seconds", "Time to take one routing decision", m.decision_latency.clone());
        registry.register(
            "ttft_seconds",
            "Time from a streamed request's arrival at the node to its first chunk (queueing and retries included)",
            m.ttft.clone(),
        );
        registry.register(
            "replica_requests",
            "Attempts followed to their end (proxied, or picked for a gateway) by replica and outcome; a request retried elsewhere counts once per replica tried",
            m.replica_requests.clone(),
        );
        registry.register(
            "pd_errors",
            "Failed prefill/decode hand-offs of disaggregated requests by side and kind",
            m.pd_errors.clone(),
        );
        registry.register(
            "replica_ttft_seconds",
            "Time from a request's arrival at the node to its first token from the replica (streamed: the first chunk; not streamed: the answer)",
            m.replica_ttft.clone(),
        );
        registry.register(
            "replica_e2e_seconds",
            "Time from a request's arrival at the node to the end of its answer, completed requests, by replica",
            m.replica_e2e.clone(),
        );
        registry.register(
            "ttft_over_slo",
            "Streamed requests whose TTFT exceeded admission.ttft_slo (counted only when it is set)",
            m.ttft_over_slo.clone(),
        );
        registry.register(
            "admission_wait_seconds",
            "Time requests that waited in the admission queue spent there, until routed or refused",
            m.admission_wait.clone(),
        );
        registry.register(
            "requests",
            "Requests routed by the proxy or picked for a gateway (the endpoint picker), by final outcome: one per proxied request whatever its retries (a gateway's own retry is a new pick)",
            m.requests.clone(),
        );
        registry.register("prompt_tokens", "Prompt tokens routed", m.prompt_tokens.clone());
        registry.register(
            "predicted_cached_tokens",
            "Prompt tokens the chosen replica was believed to hold",
            m.predicted_cached_tokens.clone(),
        );
        registry.register(
            "output_tokens",
            "Output tokens of requests that ended well with a known output",
            m.output_tokens.clone(),
        );
        registry.register(
            "expected_output_tokens",
            "What routing expected of those requests' outputs when it booked them, tokens",
            m.expected_output_tokens.clone(),
        );
        registry.register(
            "output_estimate_ratio",
            "Per request, its output over what routing expected of it (the output-length estimator's error)",
            m.output_estimate_ratio.clone(),
        );
        registry.register(
            "engine_cached_tokens",
            "Prompt tokens engines reported as cached (proxied answers, and proxied streams' usage chunks)",
            m.engine_cached_tokens.clone(),
        );
        registry.register("events_applied", "KV events applied by replica and kind", m.events_applied.clone());
        registry.register(
            "event_lag_seconds",
            "Engine publish (batch ts) to applied at this node, live KV-event batches",
            m.event_lag.clone(),
        );
        registry.register("events_rejected", "KV events rejected by replica and reason", m.events_rejected.clone());
        registry.register("resyncs", "Event-stream resyncs by replica and method", m.resyncs.clone());
        registry.register(
            "event_replay_copies",
            "Live KV-event messages skipped as copies of ones a replay had just applied, by replica",
            m.replay_copies.clone(),
        );
        registry.register(
            "event_quarantines",
            "KV-event quarantines begun by replica (bad messages kept coming)",
            m.quarantines.clone(),
        );
        registry.register(
            "events_orphaned_blocks",
            "Stored blocks whose parent this node never saw, kept aside (the replica's history is partial), by replica",
            m.orphaned_blocks.clone(),
        );
        registry.register(
            "events_adopted_blocks",
            "Blocks kept aside and placed once their parent was stored or routed there, by replica",
            m.adopted_blocks.clone(),
        );
        registry.register(
            "events_inferred_blocks",
            "Blocks of a partial history's lost prefixes placed from prompts routed to the replica, by replica",
            m.inferred_blocks.clone(),
        );
        registry.register(
            "replica_recovered_ratio",
            "Of the blocks the replica's events named, the fraction placed in the index (1 unless its history is partial)",
            m.replica_recovered.clone(),
        );
        registry.register(
            "replica_orphan_blocks",
            "Blocks kept aside now, waiting for their parent",
            m.replica_orphan_blocks.clone(),
        );
        registry.register("replica_status", "1 for the replica's current status", m.replica_status.clone());
        registry.register(
            "replica_queued_prefill_tokens",
            "Router-side queued uncached prefill tokens",
            m.replica_queued_prefill.clone(),
        );
        registry.register("replica_live_bookings", "Requests routed and not yet released", m.replica_bookings.clone());
        registry.register(
            "replica_idle",
            "1 while the replica is draining with nothing in flight: safe to release",
            m.replica_idle.clone(),
        );
        registry.register(
            "replica_kv_usage_ratio",
            "Engine-reported KV-cache usage, 0 to 1",
            m.replica_kv_usage.clone(),
        );
        registry.register(
            "replica_index_blocks",
            "Blocks the prefix index holds for the replica",
            m.replica_index_blocks.clone(),
        );
        registry.register(
            "replica_capacity_blocks",
            "KV-cache capacity the node routes by, blocks: capacity_blocks, or when that is left out the engine's \
             num_gpu_blocks in the replica's block size (0 until read)",
            m.replica_capacity_blocks.clone(),
        );
        registry.register("gossip_batches_sent", "Gossip batches sent to peers", m.gossip_sent.clone());
        registry.register(
            "gossip_batches_dropped",
            "Gossip batches not sent (peer queue full or injected fault); summaries repair them",
            m.gossip_dropped.clone(),
        );
        registry.register(
            "gossip_deltas_received",
            "Booking deltas received from peers",
            m.gossip_deltas_received.clone(),
        );
        registry.register(
            "gossip_peer_bookings",
            "A peer's live bookings as this node holds them",
            m.gossip_peer_bookings.clone(),
        );
        registry.register(
            "gossip_peer_up",
            "1 while a cluster member is heard from within cluster.peer_timeout, 0 once it is silent",
            m.gossip_peer_up.clone(),
        );
        registry.register(
            "gossip_peer_age_seconds",
            "Seconds since this node last heard a peer's gossip (gossip lag)",
            m.gossip_peer_age.clone(),
        );
        for ((name, help), g) in RAFT.iter().zip(&m.raft) {
            registry.register(format!("raft_{name}"), *help, g.clone());
        }
        registry.register(
            "replication_warmups",
            "Replication warm-ups by result (sent, failed, transferred)",
            m.replication_warmups.clone(),
        );
        for ((name, help), g) in PLAN.iter().zip(&m.replication) {
            registry.register(format!("replication_plan_{name}"), *help, g.clone());
        }
        registry.register(
            "replication_targets",
            "Replication targets by state (pending, warming, confirmed, failed)",
            m.replication_targets.clone(),
        );
        registry.register(
            "replication_top_prefix_load_share",
            "Token-load share of the hottest prefix this node knows of, 0 to 1",
            m.replication_top_share.clone(),
        );
        for ((name, help), f) in AUTOSCALER.iter().zip(&m.autoscaler) {
            let help = format!("{help}: the latest decision, committed (the leader's) or evaluated (this node's)");
            registry.register(format!("autoscaler_{name}"), help, f.clone());
        }
        registry.register(
            "admission_queue_depth",
            "Requests waiting for capacity in the admission queue",
            m.admission_queue.clone(),
        );
        registry.register(
            "http_body_bytes_in_flight",
            "Bytes of HTTP request bodies being read or handled, reserved from limits.http_body_budget_bytes (a full budget answers 503)",
            m.http_body_bytes.clone(),
        );
        registry.register(
            "admission_abandoned",
            "Requests whose client went away (HTTP disconnect, gRPC cancel) while they waited in the admission queue",
            m.admission_abandoned.clone(),
        );
        registry.register(
            "bookings_expired",
            "Bookings ended by node.booking_lease without a release (a gRPC Route caller that never called Release)",
            m.bookings_expired.clone(),
        );
        registry.register(
            "admission_refused",
            "Requests admission control refused (HTTP 429 and gRPC Route RESOURCE_EXHAUSTED) by outcome: queue_full, evicted_late, admission_timeout",
            m.admission_refused.clone(),
        );
        // Series for the outcomes that can happen, at 0 from the start: a rate() or an alert
        // on a series that appears only at its first increment misses that first one.
        for outcome in ["queue_full", "evicted_late", "admission_timeout"] {
            let _ = m.admission_refused.get_or_create(&vec![("outcome", outcome.to_string())]);
        }
        for outcome in [
            "ok",
            "client_error",
            "upstream_error",
            "backpressure",
            "no_replica",
            "disconnected",
            "bad_request",
            "unknown_model",
            "too_long",
            "queue_full",
            "evicted_late",
            "admission_timeout",
        ] {
            let _ = m.requests.get_or_create(&vec![("outcome", outcome.to_string())]);
        }
        Metrics { registry, ..m }
    }
}

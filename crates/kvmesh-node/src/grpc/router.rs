//! `kvmesh.v1.Router`: routing decisions for external proxies (Route, FirstToken, Release).

use super::Services;
use crate::admit::{Admitted, NotAdmitted};
use kvmesh_core::prompt::approximate_tokens;
use kvmesh_core::RouteRequest;
use kvmesh_proto::v1::{self, router_server};
use tonic::{Request, Response, Status as GrpcStatus};

#[tonic::async_trait]
impl router_server::Router for Services {
    async fn route(&self, request: Request<v1::RouteRequest>) -> Result<Response<v1::RouteResponse>, GrpcStatus> {
        // The TTFT gate's clock starts here.
        let arrived = tokio::time::Instant::now();
        let caller = crate::booking_token::Caller::of(&request);
        let r = request.into_inner();
        let mut selected =
            self.shared.models.select(Some(&r.model)).map_err(|e| GrpcStatus::not_found(e.to_string()))?;
        // Token ids given are exact; text is as exact as the node's tokenizer.
        let (tokens, exact) = match r.prompt {
            Some(v1::route_request::Prompt::TokenIds(t)) if !t.ids.is_empty() => (t.ids, true),
            Some(v1::route_request::Prompt::Text(t)) if !t.is_empty() => {
                (self.shared.tokenizer.encode(&t), self.shared.tokenizer.exact(false))
            }
            _ => return Err(GrpcStatus::invalid_argument("set token_ids or text to a non-empty prompt")),
        };
        let limit = self.shared.settings.max_prompt_tokens;
        if tokens.len() > limit as usize {
            return Err(GrpcStatus::invalid_argument(format!(
                "the prompt has {} tokens; this router accepts at most {limit} (node.max_prompt_tokens)",
                tokens.len()
            )));
        }
        // An adapter's blocks chain from its own seed: overlap counts only blocks stored under it.
        let adapter = r.lora_name.as_deref().filter(|a| !a.is_empty());
        if let Some(a) = adapter {
            self.shared.models.adapter(a).map_err(|e| GrpcStatus::not_found(e.to_string()))?;
            let model = self.shared.models.of_replica(selected.model.as_deref());
            if let Some(message) = self.shared.core().adapter_unserved(model, a) {
                return Err(GrpcStatus::not_found(message));
            }
            if let Some(m) = &selected.model {
                return Err(GrpcStatus::invalid_argument(format!(
                    "LoRA adapter {a:?} with model {m:?}: adapters belong to node.model (name the adapter as the model, or leave model empty)"
                )));
            }
            selected.adapter = Some(a.to_string());
        }
        // Hash before taking the core lock: a long prompt is microseconds of work.
        selected.salt = r.cache_salt.filter(|s| !s.is_empty());
        let hasher = &self.shared.settings.hasher_for(&selected);
        // A gRPC caller may never report its first token: its prefill drains on the clock.
        if r.expected_output_tokens == Some(0) {
            return Err(GrpcStatus::invalid_argument(
                "expected_output_tokens must be a whole number of tokens from 1 to 4294967295, got 0",
            ));
        }
        let mut req =
            RouteRequest::new(hasher, &tokens, r.max_tokens).streamed(false).with_output_hint(r.expected_output_tokens);
        if let Some(key) = &r.session_key {
            req = req.with_key(hasher.sequence_key(&approximate_tokens(key)));
        }
        // A sequence no replica can ever hold is refused, admission on or off: booked, it would
        // take its replica's whole KV until the lease ended, and the engine refuses it anyway.
        // With an approximate prompt count, judged by max_tokens alone.
        let counted = if exact { tokens.len() as u32 } else { 0 };
        if let Some(f) =
            self.shared.core().fleet.fits_nowhere_for(req.model, counted, r.max_tokens).filter(|f| f.certain())
        {
            return Err(GrpcStatus::invalid_argument(NotAdmitted::never_fits(&f)));
        }
        let mut ticket = crate::admit::Ticket::new(&self.shared, crate::admit::Via::Route, exact, arrived)
            .for_selected(&selected)
            .whole_only(!r.accept_disaggregated);
        let Admitted { routed, replica: name, endpoints, at: now, decision_s, decode } = match ticket
            .route(&req, &tokens, r.max_tokens)
            .await
        {
            Ok(a) => a,
            Err(NotAdmitted::NoReplica(_))
                if !r.accept_disaggregated && self.shared.core().disaggregated(req.model, None) =>
            {
                return Err(GrpcStatus::failed_precondition(
                    "this model is served disaggregated (prefill and decode replicas) and has no `both` replica: set \
                     accept_disaggregated and run the flow (RouteResponse.decode), or register a `both` replica",
                ))
            }
            Err(NotAdmitted::NoReplica(e)) => {
                let why = crate::disaggregated::why_unserved(&self.shared, req.model);
                return Err(GrpcStatus::unavailable(why.unwrap_or_else(|| e.to_string())));
            }
            Err(NotAdmitted::Refused(why)) => return Err(self.too_many(why)),
            Err(NotAdmitted::NeverFits(f)) => return Err(GrpcStatus::invalid_argument(NotAdmitted::never_fits(&f))),
        };
        let m = &self.shared.metrics;
        m.decision_latency.observe(decision_s);
        m.decisions
            .get_or_create(&vec![
                ("policy", self.shared.policy_name().to_string()),
                ("reason", routed.decision.reason.as_str().into()),
            ])
            .inc();
        let d = routed.decision;
        self.shared.record_decision(crate::state::DecisionRecord {
            at: now,
            via: "grpc",
            replica: name.clone(),
            reason: d.reason.as_str(),
            prompt_tokens: tokens.len() as u32,
            overlap_blocks: d.overlap_blocks,
            uncached_tokens: d.uncached_tokens,
            estimated_ttft_s: d.estimated_ttft_s,
        });
        let bootstrap = decode.as_ref().and_then(|_| {
            let core = self.shared.core();
            let r = core.replicas.get(&name).filter(|r| r.config.engine == "sglang")?;
            let (host, port, room) = crate::disaggregated::bootstrap(&r.endpoints, r.config.bootstrap_port);
            Some(v1::Bootstrap { host, port: u32::from(port), room })
        });
        let decode = decode.map(|leg| {
            let d = leg.routed.decision;
            v1::DecodeSide {
                replica_id: leg.replica,
                endpoint: leg.endpoints.base.clone(),
                overlap_blocks: d.overlap_blocks,
                reason: d.reason.as_str().into(),
                booking: self.shared.booking_keys.issue(leg.routed.booking, &caller),
                data_parallel_rank: leg.endpoints.data_parallel_rank,
                estimated_ttft_s: d.estimated_ttft_s,
            }
        });
        Ok(Response::new(v1::RouteResponse {
            decode,
            bootstrap,
            replica_id: name,
            endpoint: endpoints.base.clone(),
            overlap_blocks: d.overlap_blocks,
            block_size: hasher.block_size(),
            uncached_tokens: d.uncached_tokens,
            estimated_ttft_s: d.estimated_ttft_s,
            reason: d.reason.as_str().into(),
            booking: self.shared.booking_keys.issue(routed.booking, &caller),
            data_parallel_rank: endpoints.data_parallel_rank,
        }))
    }

    async fn first_token(
        &self,
        request: Request<v1::FirstTokenRequest>,
    ) -> Result<Response<v1::FirstTokenResponse>, GrpcStatus> {
        let id = self.open_booking(&request, &request.get_ref().booking)?;
        let now = self.shared.now();
        self.shared.core().first_token(id, now).map_err(|e| GrpcStatus::not_found(e.to_string()))?;
        Ok(Response::new(v1::FirstTokenResponse {}))
    }

    async fn release(&self, request: Request<v1::ReleaseRequest>) -> Result<Response<v1::ReleaseResponse>, GrpcStatus> {
        let id = self.open_booking(&request, &request.get_ref().booking)?;
        let r = request.into_inner();
        let now = self.shared.now();
        let (released, model) = {
            let mut core = self.shared.core();
            let replica = core.fleet.bookings().get(id).map(|b| b.replica);
            let model = replica.and_then(|id| core.fleet.replica(id)).map(|s| s.model);
            (core.release(id, r.output_tokens, now), model)
        };
        self.shared.admission.capacity_freed_for(model);
        released.map_err(|e| GrpcStatus::not_found(e.to_string()))?;
        Ok(Response::new(v1::ReleaseResponse {}))
    }
}

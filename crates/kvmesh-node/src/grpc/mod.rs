//! The gRPC API (`proto/kvmesh/v1/`): `Router` for external proxies, `Admin` for operators,
//! `Events.Publish` for engines without ZMQ; plus the standard health service and server
//! reflection, so `grpcurl -plaintext host:50051 list` works out of the box.

pub mod autoscaler;
pub mod cluster;
pub mod replication;

use crate::admission::Refused;
use crate::admit::{Admitted, NotAdmitted};
use crate::cluster::registry::Command;
use crate::cluster::{Cluster, ClusterError};
use crate::config::ReplicaConfig;
use crate::replica::SupervisorMsg;
use crate::state::{RegistryError, Shared};
use kvmesh_core::load::BookingId;
use kvmesh_core::prompt::approximate_tokens;
use kvmesh_core::ReplicaStatus;
use kvmesh_core::RouteRequest;
use kvmesh_proto::v1::{self, admin_server, events_server, router_server};
use ractor::ActorRef;
use std::sync::Arc;
use tonic::{Request, Response, Status as GrpcStatus, Streaming};

/// The services' shared handles.
#[derive(Clone)]
pub struct Services {
    /// Node state.
    pub shared: Arc<Shared>,
    /// The replica supervisor (admin add/remove).
    pub supervisor: ActorRef<SupervisorMsg>,
    /// In a cluster, admin writes go through Raft.
    pub cluster: Option<Arc<crate::cluster::Cluster>>,
    /// Pushing replicas' bad-event records (`Events.Publish`).
    pub push: Arc<crate::replica::push::PushGuards>,
}

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

fn not_found_or(e: ClusterError) -> GrpcStatus {
    match e {
        ClusterError::Rejected(m) if m.starts_with("unknown replica") => GrpcStatus::not_found(m),
        e => GrpcStatus::from(e),
    }
}

impl Services {
    /// The booking a `FirstToken` or `Release` names, if it was issued to `request`'s caller.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` for a malformed handle, `PERMISSION_DENIED` for another's.
    fn open_booking<T>(&self, request: &Request<T>, handle: &str) -> Result<BookingId, GrpcStatus> {
        use crate::booking_token::{Caller, HandleError};
        self.shared.booking_keys.open(handle, &Caller::of(request)).map_err(|e| match e {
            HandleError::Malformed(_) => GrpcStatus::invalid_argument(e.to_string()),
            HandleError::NotYours => GrpcStatus::permission_denied(e.to_string()),
        })
    }

    /// Admission control's refusal: `RESOURCE_EXHAUSTED` saying why, with when to retry in
    /// seconds in a `retry-after` metadata entry (as the proxy's `Retry-After` header).
    fn too_many(&self, why: Refused) -> GrpcStatus {
        let (after, message) = self.shared.refusal(why);
        let mut status = GrpcStatus::resource_exhausted(message);
        if let Ok(v) = after.to_string().parse() {
            status.metadata_mut().insert("retry-after", v);
        }
        status
    }

    /// Drains or undrains `name`: through Raft in a cluster, locally otherwise.
    async fn set_draining(&self, name: String, draining: bool) -> Result<Response<v1::Replica>, GrpcStatus> {
        if let Some(c) = &self.cluster {
            let state = if draining { ReplicaStatus::Draining } else { ReplicaStatus::Ready };
            c.write(Command::SetReplicaState { name: name.clone(), state, from: None }).await.map_err(not_found_or)?;
            // The follower task applies it too; doing it here makes the answer show it.
            let _ = self.shared.set_draining(&name, draining);
            return self.await_replica(&name).await;
        }
        self.shared.set_draining(&name, draining).map_err(|e| GrpcStatus::not_found(e.to_string()))?;
        self.replica(&name).map(Response::new).ok_or_else(|| GrpcStatus::not_found(name))
    }

    /// Moves `name` from `from` to `to` in the registry, a compare-and-set (`MarkReady`,
    /// `MarkStarting`): one already `to` is left as it is; one draining is refused with
    /// `draining`, also when it was drained between the look and the write.
    async fn transition(
        &self,
        c: &Cluster,
        name: &str,
        from: ReplicaStatus,
        to: ReplicaStatus,
        draining: GrpcStatus,
    ) -> Result<Response<v1::Replica>, GrpcStatus> {
        let state = c.state.borrow().replicas.get(name).map(|e| e.state);
        match state {
            None | Some(ReplicaStatus::Removed) => {
                return Err(GrpcStatus::not_found(format!("unknown replica {name:?}")))
            }
            Some(ReplicaStatus::Draining) => return Err(draining),
            Some(s) if s == to => return self.await_replica(name).await,
            Some(_) => {}
        }
        let write = Command::SetReplicaState { name: name.to_string(), state: to, from: Some(from) };
        match c.write(write).await {
            Ok(_) => {}
            // Moved by another call meanwhile: what was asked.
            Err(ClusterError::Rejected(m)) if m.contains(&format!(" is {}, ", to.as_str())) => {}
            Err(ClusterError::Rejected(m)) if m.contains(" is draining, ") => return Err(draining),
            Err(e) => return Err(not_found_or(e)),
        }
        // The follower task applies it too; doing it here makes the answer show it.
        let _ = self.shared.set_rotation(name, to != ReplicaStatus::Ready, to == ReplicaStatus::Starting);
        self.await_replica(name).await
    }

    fn admin_auth(&self, meta: &tonic::metadata::MetadataMap) -> Result<(), GrpcStatus> {
        crate::auth::check(meta, &[&self.shared.tokens.admin])
    }

    /// A replica committed through Raft, once this node's follower has applied it (2 s).
    async fn await_replica(&self, name: &str) -> Result<Response<v1::Replica>, GrpcStatus> {
        for _ in 0..200 {
            if let Some(r) = self.replica(name) {
                return Ok(Response::new(r));
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        Err(GrpcStatus::deadline_exceeded(format!("replica {name:?} committed, but not yet applied on this node")))
    }

    fn replica(&self, name: &str) -> Option<v1::Replica> {
        let now = self.shared.now();
        let core = self.shared.core();
        let r = core.replicas.get(name)?;
        let status = core.status(r, now);
        let load = core.fleet.bookings().load(r.id);
        let block_size = core.fleet.block_size_of(core.fleet.replica(r.id).map(|s| s.model));
        let detail = core.status_detail(r, status, now);
        let mut spec = r.config.to_spec(block_size);
        if spec.lora_adapters.is_empty() {
            // Not declared: what its engine lists.
            spec.lora_adapters = r.listed_adapters.clone().unwrap_or_default();
        }
        Some(v1::Replica {
            spec: Some(spec),
            status: v1::ReplicaStatus::from(status) as i32,
            status_detail: detail,
            running: r.engine.map_or(0, |e| e.running),
            waiting: r.engine.map_or(0, |e| e.waiting),
            kv_usage: r.engine.map_or(0.0, |e| e.kv_usage),
            queued_prefill_tokens: load.queued_prefill_tokens,
            live_bookings: load.prefilling + load.decoding,
            index_blocks: core.fleet.index().replica_blocks(r.id) as u64,
            events_applied: r.events_applied,
            events_rejected: r.events_rejected,
            last_event_age_s: r.last_event_at.map(|t| now - t),
            last_seq: r.last_seq,
            idle: core.drain_progress(r, now).is_some_and(|p| p.idle()),
            engine_up: r.failures == 0 && r.engine.is_some(),
        })
    }
}

#[tonic::async_trait]
impl admin_server::Admin for Services {
    async fn list_replicas(
        &self,
        request: Request<v1::ListReplicasRequest>,
    ) -> Result<Response<v1::ListReplicasResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let names: Vec<String> = self.shared.core().replicas.keys().cloned().collect();
        let a = &self.shared.admission;
        let (queue_full, evicted_late, timeout) = a.refused_total();
        let admission = v1::AdmissionState {
            enabled: a.section.enabled,
            waiting: u32::try_from(a.depth()).unwrap_or(u32::MAX),
            waiting_tokens: a.waiting_load(),
            queue_limit: u32::try_from(a.section.queue_limit).unwrap_or(u32::MAX),
            max_wait_s: a.section.max_wait_s,
            // A gate configured on a queue that is off holds nothing.
            ttft_slo_s: a.gate().filter(|_| a.section.enabled).map_or(0.0, |g| g.slo_s()),
            refused_queue_full: queue_full,
            refused_evicted_late: evicted_late,
            refused_timeout: timeout,
        };
        Ok(Response::new(v1::ListReplicasResponse {
            replicas: names.iter().filter_map(|n| self.replica(n)).collect(),
            admission: Some(admission),
        }))
    }

    async fn add_replica(&self, request: Request<v1::AddReplicaRequest>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let request = request.into_inner();
        let starting = request.starting;
        let spec = request.spec.ok_or_else(|| GrpcStatus::invalid_argument("spec is required"))?;
        let config = ReplicaConfig::from_spec(spec)?;
        // One block size per model (node.model's is the node's): refused here, before the
        // registry would take it.
        let model = self.shared.models.of_replica(config.model.as_deref()).to_string();
        let core_spec = kvmesh_core::ReplicaSpec {
            model,
            block_size: config.block_size.unwrap_or(0),
            ..kvmesh_core::ReplicaSpec::new(config.name.clone(), config.capacity_blocks.max(1))
        };
        if let Err(e) = self.shared.core().fleet.block_size_for(&core_spec) {
            return Err(GrpcStatus::invalid_argument(e.to_string()));
        }
        let name = config.name.clone();
        if let Some(c) = &self.cluster {
            config.validate().map_err(GrpcStatus::invalid_argument)?;
            c.write(Command::AddReplica { config, starting }).await.map_err(|e| match e {
                ClusterError::Rejected(m) if m.contains("already exists") => GrpcStatus::already_exists(m),
                e => GrpcStatus::from(e),
            })?;
            if starting && c.state.borrow().replicas.get(&name).is_some_and(|e| e.state == ReplicaStatus::Starting) {
                // Once added here; the follower task applies it too, doing it here makes the
                // answer show it.
                let _ = self.await_replica(&name).await;
                let _ = self.shared.set_rotation(&name, true, true);
            }
            return self.await_replica(&name).await;
        }
        if starting {
            return Err(GrpcStatus::failed_precondition(
                "starting replicas live in the cluster's registry: this node runs without [cluster]",
            ));
        }
        let result = ractor::call!(self.supervisor, SupervisorMsg::Add, Box::new(config))
            .map_err(|e| GrpcStatus::internal(e.to_string()))?;
        result.map_err(|e| match e {
            RegistryError::Exists(_) => GrpcStatus::already_exists(e.to_string()),
            RegistryError::Unknown(_) | RegistryError::Invalid(_) => GrpcStatus::invalid_argument(e.to_string()),
            RegistryError::NotStarted { .. } => GrpcStatus::internal(e.to_string()),
        })?;
        self.replica(&name).map(Response::new).ok_or_else(|| GrpcStatus::internal("added replica vanished"))
    }

    async fn remove_replica(
        &self,
        request: Request<v1::ReplicaRef>,
    ) -> Result<Response<v1::RemoveReplicaResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let name = request.into_inner().name;
        if let Some(c) = &self.cluster {
            c.write(Command::RemoveReplica { name }).await.map_err(not_found_or)?;
            return Ok(Response::new(v1::RemoveReplicaResponse {}));
        }
        let result = ractor::call!(self.supervisor, SupervisorMsg::Remove, name)
            .map_err(|e| GrpcStatus::internal(e.to_string()))?;
        result.map_err(|e| GrpcStatus::not_found(e.to_string()))?;
        Ok(Response::new(v1::RemoveReplicaResponse {}))
    }

    async fn drain_replica(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        self.set_draining(request.into_inner().name, true).await
    }

    async fn undrain_replica(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        self.set_draining(request.into_inner().name, false).await
    }

    async fn mark_ready(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let name = request.into_inner().name;
        let Some(c) = &self.cluster else {
            // No starts without a cluster: ready unless an operator drained it.
            let draining = self.shared.core().replicas.get(&name).map(|r| r.draining());
            return match draining {
                None => Err(GrpcStatus::not_found(format!("unknown replica {name:?}"))),
                Some(true) => Err(GrpcStatus::failed_precondition(format!(
                    "replica {name:?} is draining: `kvmesh replica undrain` puts it back into rotation"
                ))),
                Some(false) => self.replica(&name).map(Response::new).ok_or_else(|| GrpcStatus::not_found(name)),
            };
        };
        let drained = GrpcStatus::failed_precondition(format!(
            "replica {name:?} is draining (a scale-down cancelled its start, or an operator drained it): release \
             it, or `kvmesh replica undrain` to put it into rotation anyway"
        ));
        self.transition(c, &name, ReplicaStatus::Starting, ReplicaStatus::Ready, drained).await
    }

    async fn mark_starting(&self, request: Request<v1::ReplicaRef>) -> Result<Response<v1::Replica>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let name = request.into_inner().name;
        let Some(c) = &self.cluster else {
            return Err(GrpcStatus::failed_precondition(
                "starting replicas live in the cluster's registry: this node runs without [cluster]",
            ));
        };
        // Only a replica in rotation starts: a drain that came first (its pod is going away)
        // must not be undone.
        let draining = GrpcStatus::failed_precondition(format!(
            "replica {name:?} is draining: a start marked now would put it back (undrain it first)"
        ));
        self.transition(c, &name, ReplicaStatus::Ready, ReplicaStatus::Starting, draining).await
    }

    async fn recent_decisions(
        &self,
        request: Request<v1::RecentDecisionsRequest>,
    ) -> Result<Response<v1::RecentDecisionsResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let n = match request.into_inner().limit {
            0 => 20,
            n => n.min(64) as usize,
        };
        let now = self.shared.now();
        let decisions = self
            .shared
            .recent_decisions(n)
            .into_iter()
            .map(|d| v1::RecentDecision {
                age_s: now - d.at,
                via: d.via.into(),
                replica: d.replica,
                reason: d.reason.into(),
                prompt_tokens: d.prompt_tokens,
                overlap_blocks: d.overlap_blocks,
                uncached_tokens: d.uncached_tokens,
                estimated_ttft_s: d.estimated_ttft_s,
            })
            .collect();
        Ok(Response::new(v1::RecentDecisionsResponse { decisions }))
    }

    async fn get_config(
        &self,
        request: Request<v1::GetConfigRequest>,
    ) -> Result<Response<v1::GetConfigResponse>, GrpcStatus> {
        self.admin_auth(request.metadata())?;
        let toml = self.shared.config.lock().unwrap_or_else(|p| p.into_inner()).to_toml();
        Ok(Response::new(v1::GetConfigResponse { toml }))
    }
}

#[tonic::async_trait]
impl events_server::Events for Services {
    async fn publish(
        &self,
        request: Request<Streaming<v1::PublishRequest>>,
    ) -> Result<Response<v1::PublishResponse>, GrpcStatus> {
        // Event pushers (engine sidecars) hold the events token (or an operator's): not the
        // nodes' token, which would let a sidecar talk Raft.
        let t = &self.shared.tokens;
        crate::auth::check(request.metadata(), &[&t.events, &t.admin])?;
        let mut stream = request.into_inner();
        let mut summary = v1::PublishResponse::default();
        while let Some(batch) = stream.message().await? {
            use crate::replica::push::PushError;
            let pushed = self.push.apply(&self.shared, batch).map_err(|e| match e {
                PushError::UnknownReplica(_) => GrpcStatus::not_found(e.to_string()),
                PushError::Quarantined { .. } => GrpcStatus::unavailable(e.to_string()),
            })?;
            summary.batches += 1;
            summary.events_applied += pushed.applied;
            summary.events_rejected += pushed.rejected;
        }
        Ok(Response::new(summary))
    }
}

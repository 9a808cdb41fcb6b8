//! The pick: an exchange's request read (or taken from its headers), admitted and routed to
//! one endpoint, or refused; the picker's subset and fallback.

use super::*;
use crate::admit::{NotAdmitted, Ticket, Via};
use crate::in_flight::{InFlight, Side};
use bytes::Bytes;
use kvmesh_core::{ReplicaId, RouteRequest};
use protocol::BodyMode;

impl Exchange {
    /// Picks for the request (with `body`, if it has one) and answers the gateway: the
    /// destination, or the refusal (or, failing open, a destination-less continue). With
    /// `trailers_follow`, the body sent back does not end the stream (the trailers do).
    /// A gateway that goes away meanwhile (the stream reset while the request waits for
    /// capacity) ends it: the wait is abandoned, nothing is booked.
    pub(super) async fn pick_and_answer(&mut self, body: Option<Bytes>, trailers_follow: bool) -> Result<bool, ()> {
        self.picked = true;
        let full_duplex = self.request_mode == BodyMode::FullDuplex;
        let out = self.out.clone();
        let picked = tokio::select! {
            r = self.pick(body.as_ref()) => r,
            () = out.closed() => return Err(()),
        };
        let (name, header, metadata) = match picked {
            Ok((endpoint, rank, prefill)) => {
                let body_len = body.as_ref().filter(|_| full_duplex).map(|b| b.len());
                let (mut common, metadata) = protocol::destination(
                    &self.section.destination_header,
                    &self.section.metadata_namespace,
                    &endpoint,
                    rank,
                    body_len,
                );
                if let Some(m) = common.header_mutation.as_mut() {
                    protocol::prefill_header(m, prefill.as_deref());
                }
                (endpoint, Some(common), Some(metadata))
            }
            Err(r) if r.may_fail_open && self.section.fail_open => {
                // Per request, so at debug: the outcome is counted in kvmesh_requests_total.
                tracing::debug!(status = r.status, reason = %r.message, "epp: no pick; failing open (the gateway places it)");
                (String::new(), None, None)
            }
            Err(r) => {
                let answer = protocol::immediate(r.status, &r.message, r.kind, r.retry_after_s);
                self.send(answer).await?;
                return Ok(false);
            }
        };
        tracing::debug!(endpoint = %name, path = %self.path, "epp: picked");
        match (body, self.request_mode) {
            // No body: the headers' answer carries the pick.
            (None, _) => self.send(protocol::request_headers(header, metadata)).await?,
            (Some(b), BodyMode::FullDuplex) => {
                self.send(protocol::request_headers(header, metadata)).await?;
                // In chunks, as Envoy's proto asks (a whole 64 MiB body would also pass the
                // gRPC message cap).
                let chunks = b.len().div_ceil(BODY_CHUNK).max(1);
                for i in 0..chunks {
                    let part = b.slice((i * BODY_CHUNK).min(b.len())..((i + 1) * BODY_CHUNK).min(b.len()));
                    let last = i + 1 == chunks && !trailers_follow;
                    self.send(protocol::request_body(Some((part.to_vec(), last)), None, None)).await?;
                }
            }
            (Some(_), _) => self.send(protocol::request_body(None, header, metadata)).await?,
        }
        // The body is back with the gateway: its bytes leave the budget.
        self.held = None;
        Ok(true)
    }

    /// The endpoint (`<ip:port>`) for the request, its data-parallel rank, and — for a
    /// disaggregated request, whose endpoint is its decode replica — its prefill replica's
    /// `<ip:port>`; booked when it is a completion.
    async fn pick(&mut self, body: Option<&Bytes>) -> Result<Picked, Refusal> {
        let subset = self.subset_ids()?;
        let path = self.path.split('?').next().unwrap_or_default();
        let read: Option<crate::request::Reader> = match path {
            "/v1/completions" => Some(read_completion),
            "/v1/chat/completions" => Some(read_chat),
            _ => None,
        };
        let (Some(read), Some(body)) = (read, body) else {
            return self.least_loaded(subset, body).map(|(e, r)| (e, r, None));
        };
        let shared = self.shared.clone();
        let Parsed { model, max_tokens, tokens, exact, stream, cache_salt } =
            parse(&shared, body, read).await.map_err(Refusal::from_rejected)?;
        let asked = (model.as_deref(), cache_salt);
        let checked = check(&shared, asked, tokens.len(), max_tokens, &self.headers).map_err(|r| {
            shared.metrics.request(r.outcome);
            Refusal::from_rejected(r)
        })?;
        let req = RouteRequest::new(&shared.settings.hasher_for(&checked.selected), &tokens, checked.max_tokens)
            .streamed(stream)
            .with_output_hint(checked.hint);
        let span = crate::in_flight::request_span(path, tokens.len(), &shared.policy_name());
        span.record("attempts", 1);
        crate::telemetry::parent_from(&span, &self.headers);
        let mut ticket =
            Ticket::new(&shared, Via::Gateway, exact, self.arrived).for_selected(&checked.selected).within(subset);
        let admitted = match ticket.route(&req, &tokens, checked.max_tokens).await {
            Ok(a) => a,
            Err(NotAdmitted::NoReplica(e)) => {
                shared.metrics.request("no_replica");
                crate::telemetry::failed(&span, "no_replica");
                // Within a subset, none eligible is the protocol's 503, failing open or not.
                return Err(Refusal::unavailable(e.to_string(), self.subset.is_none()));
            }
            Err(NotAdmitted::Refused(why)) => {
                shared.metrics.request(why.outcome());
                span.record("outcome", why.outcome());
                crate::telemetry::failed(&span, why.outcome());
                let (after, message) = shared.refusal(why);
                return Err(Refusal {
                    status: 429,
                    message,
                    kind: "rate_limit_exceeded",
                    retry_after_s: Some(after),
                    may_fail_open: false,
                });
            }
            Err(NotAdmitted::NeverFits(f)) => {
                shared.metrics.request("too_long");
                crate::telemetry::failed(&span, "too_long");
                return Err(Refusal {
                    status: 400,
                    message: NotAdmitted::never_fits(&f),
                    kind: "invalid_request_error",
                    retry_after_s: None,
                    may_fail_open: true,
                });
            }
        };
        self.warn_if_named(&admitted.replica, &admitted.endpoints);
        let n = tokens.len() as u32;
        let when = (admitted.at, admitted.decision_s);
        let follow = |routed: &kvmesh_core::Routed, replica: &str, side: Side| {
            InFlight::routed_side(&shared, routed, replica, when, n, "gateway", &span, self.arrived, side)
                .with_prompt(&tokens, &checked.selected)
        };
        let Some(decode) = admitted.decode else {
            self.in_flight = Some(follow(&admitted.routed, &admitted.replica, Side::Whole));
            return Ok((admitted.endpoints.authority.clone(), admitted.endpoints.data_parallel_rank, None));
        };
        // Disaggregated, as llm-d's P/D scheduling hands it to the decode pod's sidecar: the
        // gateway sends the request to the decode replica, naming the prefill replica in
        // `x-prefiller-host-port`; the sidecar runs the prefill leg first.
        self.warn_if_named(&decode.replica, &decode.endpoints);
        self.prefill_in_flight = Some(follow(&admitted.routed, &admitted.replica, Side::Prefill));
        self.in_flight = Some(follow(&decode.routed, &decode.replica, Side::Decode));
        let prefill = admitted.endpoints.authority.clone();
        Ok((decode.endpoints.authority.clone(), decode.endpoints.data_parallel_rank, Some(prefill)))
    }

    /// Warns (once per replica) that `replica` is registered by host name: the gateway's
    /// endpoints are pod IPs, so its pick will not match one.
    fn warn_if_named(&self, replica: &str, endpoints: &crate::endpoints::Endpoints) {
        if endpoints.host_is_ip {
            return;
        }
        let mut warned = self.by_name.lock().unwrap_or_else(|p| p.into_inner());
        if warned.insert(replica.to_string()) {
            tracing::warn!(replica, endpoint = %endpoints.authority,
                "epp: replica registered by host name; a gateway's endpoints are <ip:port>, so register it by its pod IP");
        }
    }

    /// The subset as replica ids, when the gateway sent one.
    ///
    /// # Errors
    /// A 503 when none of its endpoints is a registered replica (the protocol's rule).
    fn subset_ids(&self) -> Result<Option<Vec<ReplicaId>>, Refusal> {
        let Some(subset) = &self.subset else { return Ok(None) };
        let core = self.shared.core();
        let ids: Vec<ReplicaId> = core
            .replicas
            .values()
            .filter(|r| subset.iter().any(|e| *e == r.endpoints.authority))
            .filter_map(|r| core.fleet.replica_by_name(&r.config.name).map(|s| s.id))
            .collect();
        if ids.is_empty() {
            self.shared.metrics.request("no_replica");
            let message = format!("none of the gateway's endpoint subset {subset:?} is a replica of this router");
            return Err(Refusal::unavailable(message, false));
        }
        Ok(Some(ids))
    }

    /// A request that is not a completion: the replica the policy picks for an empty prompt
    /// (for token load, the least loaded) among those of the model its JSON `body` names, or
    /// of any model without one; not booked.
    fn least_loaded(
        &self,
        subset: Option<Vec<ReplicaId>>,
        body: Option<&Bytes>,
    ) -> Result<(String, Option<u32>), Refusal> {
        let subset = subset.map(|mut s| {
            s.sort_unstable();
            s
        });
        #[derive(serde::Deserialize)]
        struct Named<'a> {
            #[serde(borrow)]
            model: Option<std::borrow::Cow<'a, str>>,
        }
        let named = body.and_then(|b| serde_json::from_slice::<Named<'_>>(b).ok()).and_then(|n| n.model);
        let model = match named.as_deref().map(|m| self.shared.models.select(Some(m))) {
            Some(Ok(selected)) => self.shared.settings.hasher_for(&selected).model(),
            Some(Err(e)) => {
                self.shared.metrics.request("unknown_model");
                return Err(Refusal::from_rejected(crate::request::Rejected {
                    status: axum::http::StatusCode::NOT_FOUND,
                    message: e.to_string(),
                    outcome: "unknown_model",
                }));
            }
            None => kvmesh_core::ModelKey::ANY,
        };
        let req = RouteRequest { model: Some(model), ..RouteRequest::new(&self.shared.settings.hasher, &[], None) };
        let now = self.shared.now();
        let mut core = self.shared.core();
        let in_subset = subset.is_some();
        let d = core.decide_within(&req, subset.as_deref(), now).map_err(|e| {
            self.shared.metrics.request("no_replica");
            Refusal::unavailable(e.to_string(), !in_subset)
        })?;
        let name = core.fleet.replica(d.replica).map(|r| r.spec.name.clone());
        let endpoints = name.and_then(|n| core.replicas.get(&n)).map(|r| (r.config.name.clone(), r.endpoints.clone()));
        drop(core);
        if let Some((name, e)) = &endpoints {
            self.warn_if_named(name, e);
        }
        endpoints.map(|(_, e)| (e.authority.clone(), e.data_parallel_rank)).ok_or_else(|| {
            self.shared.metrics.request("no_replica");
            Refusal::unavailable(format!("replica {} is gone", d.replica), true)
        })
    }
}

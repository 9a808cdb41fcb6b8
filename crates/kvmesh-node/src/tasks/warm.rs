//! Sending one warm-up: the transfer sidecar first when one is configured, else (or when it
//! refuses) a prefill-only OpenAI completion with `max_tokens: 1` and the prefix's token ids
//! as the prompt — vLLM and SGLang accept token-id prompts unmodified. The warm-up is booked
//! on the target while it runs, so routing sees its prefill. Its success is judged later, by
//! the target's KV events (`kvmesh_core::replication::warm_round`).

use crate::replication::WarmFailure;
use crate::state::Shared;
use kvmesh_core::load::BookingSpec;
use kvmesh_core::replication::Warmup;
use kvmesh_proto::v1;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// Why one way of warming a prefix failed; each names where.
#[derive(Debug, thiserror::Error)]
enum WarmError {
    /// The completion request got no answer (refused, timed out, reset: the whole chain).
    #[error("warm-up request to {url}: {chain}")]
    Request { url: String, chain: String },
    /// The engine answered with an error status (the body's first 200 characters).
    #[error("the engine answered {status}: {body}")]
    Engine { status: reqwest::StatusCode, body: String },
    /// No replica holds the prefix, so the sidecar has nothing to copy from.
    #[error("no replica holds the prefix to copy from")]
    NoHolder,
    /// `replication.transfer_endpoint` is not a URI tonic takes.
    #[error("transfer_endpoint {endpoint:?}: {error}")]
    Endpoint { endpoint: String, error: String },
    /// The transfer sidecar could not be reached.
    #[error("connecting to the transfer sidecar {endpoint}: {chain}")]
    Connect { endpoint: String, chain: String },
    /// The sidecar's call failed.
    #[error("transfer sidecar: {0}")]
    Sidecar(String),
    /// The sidecar answered and declined.
    #[error("the transfer sidecar declined: {0}")]
    Declined(String),
}

pub(super) async fn send(shared: Arc<Shared>, w: Warmup, failed: mpsc::UnboundedSender<WarmFailure>) {
    let section = &shared.replication.section;
    let now = shared.now();
    let (target_url, target_rank, model, holder, booking) = {
        let mut core = shared.core();
        let Some(id) = core.fleet.replica_by_name(&w.replica).map(|r| r.id) else {
            let _ = failed.send(failure(&w, "the replica is no longer registered".into()));
            return;
        };
        let url = core.replicas.get(&w.replica).map(|r| r.endpoints.base.clone());
        let rank = core.replicas.get(&w.replica).and_then(|r| r.endpoints.data_parallel_rank);
        let model = core.replicas.get(&w.replica).and_then(|r| r.config.model.clone());
        let chain = core.fleet.hasher().hash_blocks(&w.tokens);
        let holder = core.fleet.holders(&chain).into_iter().find_map(|h| {
            let name = core.fleet.replica(h)?.spec.name.clone();
            let endpoints = &core.replicas.get(&name)?.endpoints;
            Some((name, endpoints.base.clone(), endpoints.data_parallel_rank))
        });
        let spec = BookingSpec {
            uncached_prefill_tokens: w.tokens.len() as u32,
            uncached_blocks: w.depth_blocks,
            expected_output_tokens: 1,
            reports_first_token: false,
            output_key: None,
            reestimate_up_to: None,
        };
        let booking = core.fleet.book(id, spec, now).ok();
        (url.unwrap_or_default(), rank, model.unwrap_or_else(|| shared.settings.model.clone()), holder, booking)
    };
    // The whole send ends before the round that would retry it: the transfer and the prefill
    // share 90 % of `warm_timeout`.
    let transfer_first = !section.transfer_endpoint.is_empty();
    let budget = section.plan.warm_timeout_s * 0.9;
    let timeout = Duration::from_secs_f64(if transfer_first { budget / 2.0 } else { budget });
    let mut transferred = false;
    if transfer_first {
        match transfer(&section.transfer_endpoint, &w, &model, holder.as_ref(), (&target_url, target_rank), timeout)
            .await
        {
            Ok(()) => {
                shared.metrics.replication_warmups.get_or_create(&vec![("result", "transferred".into())]).inc();
                tracing::info!(replica = %w.replica, prefix = w.hash.0, "replication: transfer started by the sidecar");
                transferred = true;
            }
            Err(e) => {
                tracing::warn!(replica = %w.replica, error = %e, "replication: transfer refused; warming with a prefill")
            }
        }
    }
    let result = if transferred {
        Ok(())
    } else {
        let sent = prefill(&shared, &w, &model, (&target_url, target_rank), timeout).await;
        let label = if sent.is_ok() { "sent" } else { "failed" };
        shared.metrics.replication_warmups.get_or_create(&vec![("result", label.into())]).inc();
        sent
    };
    if let Some(b) = booking {
        let _ = shared.core().fleet.release(b, Some(1));
    }
    match result {
        Ok(()) => {
            tracing::debug!(replica = %w.replica, prefix = w.hash.0, tokens = w.tokens.len(), "replication: warm-up done")
        }
        Err(reason) => {
            let _ = failed.send(failure(&w, reason.to_string()));
        }
    }
}

fn failure(w: &Warmup, reason: String) -> WarmFailure {
    WarmFailure { hash: w.hash, depth_blocks: w.depth_blocks, replica: w.replica.clone(), attempt: w.attempt, reason }
}

/// POST `{url}/v1/completions` with the prefix as token ids and `max_tokens: 1` (to data-parallel
/// rank `rank` of the engine there, when given).
async fn prefill(
    shared: &Shared,
    w: &Warmup,
    model: &str,
    (url, rank): (&str, Option<u32>),
    timeout: Duration,
) -> Result<(), WarmError> {
    let mut body = serde_json::json!({
        "prompt": &*w.tokens,
        "max_tokens": 1,
        "temperature": 0,
        "stream": false,
    });
    // Without a configured model name the engine serves its default (vLLM allows no `model`).
    if !model.is_empty() {
        body["model"] = model.into();
    }
    let mut post = shared.probe_http.post(format!("{url}/v1/completions"));
    if let Some(k) = rank {
        post = post.header(crate::endpoints::DATA_PARALLEL_RANK_HEADER, k);
    }
    let resp = post
        .timeout(timeout)
        .json(&body)
        .send()
        .await
        .map_err(|e| WarmError::Request { url: url.into(), chain: crate::errors::error_chain(&e) })?;
    let status = resp.status();
    if status.is_success() {
        return Ok(());
    }
    let text = resp.text().await.unwrap_or_default();
    Err(WarmError::Engine { status, body: text.chars().take(200).collect() })
}

/// Asks the sidecar at `endpoint` to copy the prefix from a holder to the target.
async fn transfer(
    endpoint: &str,
    w: &Warmup,
    model: &str,
    from: Option<&(String, String, Option<u32>)>,
    (to_url, to_rank): (&str, Option<u32>),
    timeout: Duration,
) -> Result<(), WarmError> {
    let (from_replica, from_endpoint, from_rank) = from.cloned().ok_or(WarmError::NoHolder)?;
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| WarmError::Endpoint { endpoint: endpoint.into(), error: e.to_string() })?
        .connect_timeout(Duration::from_secs(2))
        .timeout(timeout)
        .connect()
        .await
        .map_err(|e| WarmError::Connect { endpoint: endpoint.into(), chain: crate::errors::error_chain(&e) })?;
    let req = v1::TransferRequest {
        hash: w.hash.0,
        depth_blocks: w.depth_blocks,
        token_ids: w.tokens.to_vec(),
        model: model.to_string(),
        from_replica,
        from_endpoint,
        to_replica: w.replica.clone(),
        to_endpoint: to_url.to_string(),
        from_data_parallel_rank: from_rank,
        to_data_parallel_rank: to_rank,
    };
    let resp = v1::replication_transfer_client::ReplicationTransferClient::new(channel)
        .transfer(req)
        .await
        .map_err(|e| WarmError::Sidecar(e.message().to_string()))?
        .into_inner();
    if resp.accepted {
        Ok(())
    } else {
        Err(WarmError::Declined(resp.detail))
    }
}

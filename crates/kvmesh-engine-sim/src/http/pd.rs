//! What a prefill or decode replica is sent (vLLM's `kv_transfer_params`, SGLang's bootstrap
//! fields) and what it counts of them (`GET /admin/pd`).

use super::*;

/// A replica's part in disaggregated serving, as a vLLM with `NixlConnector` plays it
/// (vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py): a request whose
/// `kv_transfer_params` say `do_remote_decode` is a prefill leg — computed, answered with
/// one token and the params a decode replica needs (`do_remote_prefill`, `remote_engine_id`,
/// `remote_block_ids`, `remote_request_id`, `remote_host`, `remote_port`, `tp_size`); one
/// that says `do_remote_prefill` is a decode leg — its prompt's blocks are received over the
/// link — the leading blocks its own prefix cache lacks, as NIXL pulls only those (a wait,
/// [`crate::EngineSimConfig::kv_link_gbps`]) — loaded into the cache (announced in
/// `BlockStored`s), and the answer generated. A request carrying SGLang's `bootstrap_room`
/// is a prefill leg on a replica of role `prefill` and a decode leg (its whole prompt
/// received) on one of role `decode`, as an SGLang server's `--disaggregation-mode` decides.
#[derive(Debug)]
pub struct PdState {
    /// The role it was started with.
    pub role: kvmesh_core::Role,
    /// Its engine id in the params it hands out.
    pub engine_id: String,
    /// Its host, as `remote_host`.
    pub host: String,
    /// Its port, as `remote_port`.
    pub port: u16,
    /// Receive link, Gb/s.
    pub kv_link_gbps: f64,
    /// Time compression (the transfer wait is divided by it).
    pub speed: f64,
    /// Whole requests, prefill legs, decode legs, as they arrived (faults included).
    pub counts: [std::sync::atomic::AtomicU64; 3],
}

impl PdState {
    /// The counts so far.
    pub fn counts(&self) -> PdCounts {
        let n = |k: usize| self.counts[k].load(Ordering::Relaxed);
        PdCounts { whole: n(0), prefill: n(1), decode: n(2) }
    }
}

/// Completion requests a replica was sent, by disaggregated kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct PdCounts {
    /// Plain requests (no `kv_transfer_params`).
    pub whole: u64,
    /// Prefill legs (`do_remote_decode`).
    pub prefill: u64,
    /// Decode legs (`do_remote_prefill`).
    pub decode: u64,
}

/// What a request's `kv_transfer_params` ask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Transfer {
    /// Nothing: a whole request.
    Whole,
    /// Compute the prompt and hand its KV to a decode replica.
    ToDecode,
    /// Receive `blocks` prompt blocks (`None`: the whole prompt's) from a prefill replica,
    /// then decode.
    FromPrefill { blocks: Option<u64> },
}

/// Reads vLLM's `kv_transfer_params`.
///
/// # Errors
/// The message of a 400: a decode leg without the prefill replica's `remote_engine_id` and
/// `remote_block_ids` (vLLM's connector cannot fetch anything then).
pub(super) fn transfer(body: &Value, role: kvmesh_core::Role) -> Result<Transfer, String> {
    if body.get("bootstrap_room").is_some_and(|r| !r.is_null()) {
        // SGLang: the server's mode decides; the decode side receives the whole prompt.
        return Ok(match role {
            kvmesh_core::Role::Prefill => Transfer::ToDecode,
            kvmesh_core::Role::Decode => Transfer::FromPrefill { blocks: None },
            kvmesh_core::Role::Both => Transfer::Whole,
        });
    }
    let Some(p) = body.get("kv_transfer_params").filter(|p| !p.is_null()) else { return Ok(Transfer::Whole) };
    let flag = |k: &str| p.get(k).and_then(Value::as_bool).unwrap_or(false);
    if flag("do_remote_prefill") {
        let engine = p.get("remote_engine_id").and_then(Value::as_str);
        // One list, or one list per KV cache group (hybrid models): the first group's.
        let ids = p.get("remote_block_ids").and_then(Value::as_array).map(|a| match a.first() {
            Some(Value::Array(first)) => first.len(),
            _ => a.len(),
        });
        return match (engine, ids) {
            (Some(_), Some(n)) => Ok(Transfer::FromPrefill { blocks: Some(n as u64) }),
            _ => Err("kv_transfer_params: do_remote_prefill needs the prefill replica's remote_engine_id and \
                      remote_block_ids (pass on what the prefill replica answered)"
                .into()),
        };
    }
    Ok(if flag("do_remote_decode") { Transfer::ToDecode } else { Transfer::Whole })
}

/// Counts the request by its disaggregated kind as it arrives, before any fault answers it:
/// what a router sent where (a malformed `kv_transfer_params` counts nowhere).
pub(super) fn note_pd(s: &AppState, body: &Value) {
    let kind = match transfer(body, s.pd.role) {
        Ok(Transfer::Whole) => 0,
        Ok(Transfer::ToDecode) => 1,
        Ok(Transfer::FromPrefill { .. }) => 2,
        Err(_) => return,
    };
    s.pd.counts[kind].fetch_add(1, Ordering::Relaxed);
}

//! What each side of a disaggregated request is sent: vLLM's prefill leg (`kv_transfer_params`,
//! one token) and SGLang's bootstrap fields.

use super::*;

/// SGLang's bootstrap fields for a request whose prefill replica is at `endpoints` with
/// bootstrap port `port` (its `bootstrap_port`, else SGLang's default): the replica's host,
/// the port, and a fresh room in [0, 2^63), as SGLang draws one.
pub(crate) fn bootstrap(endpoints: &Endpoints, port: Option<u16>) -> (String, u16, u64) {
    let authority = &endpoints.authority;
    let host = authority.rsplit_once(':').map_or(authority.as_str(), |(h, _)| h);
    let port = port.unwrap_or(crate::config::DEFAULT_BOOTSTRAP_PORT);
    (host.trim_start_matches('[').trim_end_matches(']').to_string(), port, random_u64() >> 1)
}

/// The prefill leg's body (vLLM): the request with `kv_transfer_params` asking for a remote
/// decode, one token, not streamed.
pub(super) fn prefill_leg(request: &Map<String, Value>) -> Vec<u8> {
    let mut leg = request.clone();
    leg.insert(
        "kv_transfer_params".into(),
        json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
               "remote_block_ids": null, "remote_host": null, "remote_port": null}),
    );
    leg.insert("stream".into(), json!(false));
    leg.insert("max_tokens".into(), json!(1));
    if leg.contains_key("max_completion_tokens") {
        leg.insert("max_completion_tokens".into(), json!(1));
    }
    // Not for a one-token, non-streamed prefill (vLLM's proxy drops them too).
    for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
        leg.remove(k);
    }
    serde_json::to_vec(&leg).unwrap_or_default()
}

/// 64 random bits from the system's source (a bootstrap room, a request id).
pub(crate) fn random_u64() -> u64 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 8];
    if ring::rand::SystemRandom::new().fill(&mut b).is_err() {
        // Unreachable on supported platforms; a room must still differ per request.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
        return t as u64;
    }
    u64::from_le_bytes(b)
}

//! A request as the router sees it when deciding: its prompt's block hashes and lengths.

use crate::hashing::BlockHasher;
use crate::ids::BlockHash;

/// One request to route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteRequest {
    /// Prompt length, tokens.
    pub prompt_tokens: u32,
    /// Chained hashes of the prompt's full blocks (see [`crate::hashing`]).
    pub hashes: Vec<BlockHash>,
    /// The client's `max_tokens`, if given.
    pub max_tokens: Option<u32>,
    /// A 64-bit key for the whole prompt, partial last block included: from tokens, equal keys
    /// mean equal prompts (within one namespace; [`BlockHasher::prompt_key`]); from a trace's
    /// block hashes, equal full blocks and length.
    pub prompt_key: u64,
    /// Key for consistent hashing: the client's session key when it sends one, else
    /// `prompt_key` (the vLLM router hashes the request text when no session header or field
    /// is given).
    pub key: u64,
    /// Whether this router sees the request's first token when it comes (a streamed answer
    /// through its proxy, or the simulator): a non-streamed answer shows its first token only
    /// at its end, and a gRPC `Route` caller may never report it, so their prefill is not
    /// assumed queued until then. Default true.
    pub streamed: bool,
    /// The client's expected output length, tokens (a length hint an agent harness or RL
    /// trainer sends): trusted over everything but `max_tokens`, which caps it
    /// ([`crate::load::OutputEstimator::expect_for`]).
    pub output_hint: Option<u32>,
    /// The model asked for (set from the hasher by [`RouteRequest::new`]); `None`: the
    /// fleet's namespace model. Only replicas serving it are candidates.
    pub model: Option<crate::hashing::ModelKey>,
}

impl RouteRequest {
    /// Hashes `tokens` with `hasher`.
    pub fn new(hasher: &BlockHasher, tokens: &[u32], max_tokens: Option<u32>) -> Self {
        let hashes = hasher.hash_blocks(tokens);
        let prompt_key = hasher.prompt_key(&hashes, tokens);
        RouteRequest {
            prompt_tokens: tokens.len() as u32,
            hashes,
            max_tokens,
            prompt_key,
            key: prompt_key,
            streamed: true,
            output_hint: None,
            model: Some(hasher.model()),
        }
    }

    /// A request whose block hashes are already known (e.g. a trace's prefix-chained ids). Its
    /// prompt key mixes the last full block's hash with the length, as
    /// [`BlockHasher::prompt_key`] does: prompts built from the same ids agree, and a
    /// block-aligned prompt's key is the one its tokens would give.
    pub fn from_hashes(prompt_tokens: u32, hashes: Vec<BlockHash>, max_tokens: Option<u32>) -> Self {
        let last = hashes.last().map_or(0, |h| h.0);
        let prompt_key = crate::hashing::length_key(u64::from(prompt_tokens), last);
        RouteRequest {
            prompt_tokens,
            hashes,
            max_tokens,
            prompt_key,
            key: prompt_key,
            streamed: true,
            output_hint: None,
            model: None,
        }
    }

    /// Expects `tokens` output tokens (a client's hint; see [`Self::output_hint`]).
    pub fn with_output_hint(mut self, tokens: Option<u32>) -> Self {
        self.output_hint = tokens;
        self
    }

    /// Uses `session` as the consistent-hashing key.
    pub fn with_key(mut self, session: u64) -> Self {
        self.key = session;
        self
    }

    /// Sets [`Self::streamed`].
    pub fn streamed(mut self, streamed: bool) -> Self {
        self.streamed = streamed;
        self
    }

    /// The prefill leg of a disaggregated request: the same prompt, answered with one token
    /// (`max_tokens` 1, as vLLM's disaggregated proxy asks the prefill replica), not streamed.
    /// Its expected output is that one token (a hint), so the prefill replica is booked for
    /// the prompt alone.
    pub fn prefill_leg(&self) -> RouteRequest {
        RouteRequest { max_tokens: Some(1), output_hint: Some(1), streamed: false, ..self.clone() }
    }

    /// Full prompt blocks.
    pub fn blocks(&self) -> u32 {
        self.hashes.len() as u32
    }
}

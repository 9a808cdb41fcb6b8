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
    /// Key for consistent hashing: the client's session key when it sends one, else the first
    /// block's hash, else (prompt shorter than a block) a hash of the whole prompt.
    pub key: u64,
}

impl RouteRequest {
    /// Hashes `tokens` with `hasher`.
    pub fn new(hasher: &BlockHasher, tokens: &[u32], max_tokens: Option<u32>) -> Self {
        let hashes = hasher.hash_blocks(tokens);
        let key = hashes.first().map_or_else(|| hasher.sequence_key(tokens), |h| h.0);
        RouteRequest { prompt_tokens: tokens.len() as u32, hashes, max_tokens, key }
    }

    /// A request whose block hashes are already known (e.g. a trace's prefix-chained ids).
    pub fn from_hashes(prompt_tokens: u32, hashes: Vec<BlockHash>, max_tokens: Option<u32>) -> Self {
        let key = hashes.first().map_or(prompt_tokens as u64, |h| h.0);
        RouteRequest { prompt_tokens, hashes, max_tokens, key }
    }

    /// Uses `session` as the consistent-hashing key.
    pub fn with_key(mut self, session: u64) -> Self {
        self.key = session;
        self
    }

    /// Full prompt blocks.
    pub fn blocks(&self) -> u32 {
        self.hashes.len() as u32
    }
}

//! The node settings the request path reads without the lock.

use crate::endpoints::Endpoints;
use kvmesh_core::Namespace;
use std::sync::Arc;

/// A replica's name and URLs.
pub type NamedReplica = (String, Arc<Endpoints>);

/// The node settings the request path reads, fixed at start (no lock).
#[derive(Debug, Clone)]
pub struct Settings {
    /// Served model name; empty accepts any.
    pub model: String,
    /// Other replicas tried after a connect failure, a connection closed unanswered, or
    /// backpressure.
    pub retries: u32,
    /// How long a 429/503 keeps a replica out, seconds.
    pub overload_backoff_s: f64,
    /// Tokens per block.
    pub block_size: u32,
    /// The routing core's block hasher (a copy), so requests are hashed outside the core lock.
    pub hasher: kvmesh_core::BlockHasher,
    /// The engines' step-time profile (`node.engine_profile` at `node.engine_speed`).
    pub profile: kvmesh_core::load::ReplicaProfile,
    /// Longest prompt routed, tokens.
    pub max_prompt_tokens: u32,
}

impl Settings {
    /// The hasher of requests selecting `selected`: its model's namespace (the routing
    /// core's hasher for `node.model`, as [`kvmesh_core::Fleet::hasher_for`] makes it for
    /// another), then its LoRA adapter's seed, as the index hashes stores with that
    /// `lora_name`, then its `cache_salt`, as the index salts a sequence's first block.
    pub fn hasher_for(&self, selected: &crate::models::Selected) -> kvmesh_core::BlockHasher {
        let base = match &selected.model {
            Some(m) if *m != self.model => {
                let ns = Namespace { model: m.clone(), ..Namespace::default() };
                let bs = selected.block_size.unwrap_or(self.block_size);
                kvmesh_core::BlockHasher::new(bs, &ns).unwrap_or(self.hasher)
            }
            _ => self.hasher,
        };
        let adapted = selected.adapter.as_deref().map_or(base, |a| base.for_adapter(a));
        adapted.for_salt(selected.salt.as_deref().unwrap_or_default())
    }
}

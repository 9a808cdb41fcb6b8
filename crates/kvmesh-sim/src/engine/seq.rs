//! One sequence in a simulated engine: its prompt, what of it is cached, computed and held.

use super::*;

#[derive(Debug)]
pub(super) struct Seq {
    pub(super) req: EngineRequest,
    /// Engine hashes of the prompt's full blocks, then of the blocks its output filled (when
    /// output blocks are cached).
    pub(super) hashes: Vec<u64>,
    /// Tokens whose KV exists: prompt tokens (cache hits included), then generated tokens.
    pub(super) computed: u32,
    /// Prompt tokens served from the prefix cache at the request's first admission; `None`
    /// until then. Set once, as vLLM's `Request.num_cached_tokens` (`Scheduler.schedule`,
    /// vllm/v1/core/sched/scheduler.py): a preempted request that re-hits its own blocks
    /// does not count them again (vLLM counts those as `preempted_hits`, outside its hit rate).
    pub(super) cached_tokens: Option<u32>,
    /// Output tokens produced (the client has them; a preemption does not take them back).
    pub(super) generated: u32,
    /// Leading prompt blocks held as cached (shared) blocks.
    pub(super) shared: usize,
    /// Private blocks held (partial prompt block, blocks computed but not yet promoted, output).
    pub(super) private: u64,
    /// Tokens scheduled in the step in flight.
    pub(super) scheduled: u32,
}

impl Seq {
    pub(super) fn prompt(&self) -> u32 {
        self.req.tokens.len() as u32
    }
    pub(super) fn held(&self) -> u64 {
        self.shared as u64 + self.private
    }
    /// Tokens to (re)compute before decoding: the prompt, plus — after a preemption, as vLLM
    /// recomputes — every generated token but the last, whose KV the next decode step writes.
    pub(super) fn prefill_target(&self) -> u32 {
        self.prompt() + self.generated.saturating_sub(1)
    }
    pub(super) fn prefilling(&self) -> bool {
        self.computed < self.prefill_target()
    }
    /// Prefill tokens still to compute, tokens.
    pub(super) fn remaining_prefill(&self) -> u64 {
        self.prefill_target().saturating_sub(self.computed) as u64
    }
}

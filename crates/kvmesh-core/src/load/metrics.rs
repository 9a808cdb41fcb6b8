//! What the engine itself reports about its load (vLLM `/metrics`: `vllm:num_requests_running`,
//! `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`).

/// One engine load report.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EngineMetrics {
    /// Requests the engine is running (in its batch).
    pub running: u32,
    /// Requests waiting in the engine's queue.
    pub waiting: u32,
    /// Fraction of KV-cache blocks in use, 0.0 to 1.0.
    pub kv_usage: f64,
    /// When the report was taken, seconds (the caller's clock).
    pub at: f64,
}

impl EngineMetrics {
    /// Age of the report at `now`, seconds (never negative).
    pub fn age(&self, now: f64) -> f64 {
        (now - self.at).max(0.0)
    }
}

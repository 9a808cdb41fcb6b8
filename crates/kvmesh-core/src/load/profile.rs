//! A replica's speed, as a per-step time model, and the TTFT estimate built on it.
//!
//! vLLM-style continuous batching runs steps of `t = β0 + β1·prefill_tokens + β2·decode_tokens`
//! (the linear step model fitted in Vidur, Agrawal et al., MLSys 2024, and used by the kvmesh
//! simulator). Prefill of `P` tokens in chunks of `C` tokens takes `⌈P/C⌉` steps, and every
//! step also carries one token for each of the `D` sequences in decode, so
//!
//! ```text
//! TTFT ≈ β1·P + ⌈P/C⌉·(β0 + β2·D)
//! ```
//!
//! Defaults: Llama-3-8B on one H100 under vLLM, β0 = 5.75 ms, β1 = 17.25 µs/token,
//! β2 = 6.0 µs/token, C = 8,192 tokens.

use crate::error::Error;

/// A replica's step-time model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReplicaProfile {
    /// β1: seconds per prefill token.
    pub prefill_s_per_token: f64,
    /// β2: seconds per decode token in a step.
    pub decode_s_per_token: f64,
    /// β0: fixed seconds per step.
    pub step_overhead_s: f64,
    /// C: prefill token budget per step (chunked prefill), tokens.
    pub chunk_tokens: u32,
    /// Most sequences the engine runs at once (vLLM `--max-num-seqs`, SGLang
    /// `--max-running-requests`); a request beyond them waits for one to finish.
    pub max_num_seqs: u32,
}

impl Default for ReplicaProfile {
    fn default() -> Self {
        ReplicaProfile::H100_LLAMA3_8B
    }
}

impl ReplicaProfile {
    /// Llama-3-8B, one H100, vLLM: β0 5.75 ms, β1 17.25 µs, β2 6.0 µs, chunk 8,192, 256
    /// sequences.
    pub const H100_LLAMA3_8B: ReplicaProfile = ReplicaProfile {
        prefill_s_per_token: 17.25e-6,
        decode_s_per_token: 6.0e-6,
        step_overhead_s: 5.75e-3,
        chunk_tokens: 8192,
        max_num_seqs: 256,
    };

    /// Llama-3-8B, one A100, vLLM: β0 16.4 ms, β1 47.8 µs, β2 18.2 µs, chunk 8,192, 256
    /// sequences.
    pub const A100_LLAMA3_8B: ReplicaProfile = ReplicaProfile {
        prefill_s_per_token: 47.8e-6,
        decode_s_per_token: 18.2e-6,
        step_overhead_s: 16.4e-3,
        chunk_tokens: 8192,
        max_num_seqs: 256,
    };

    /// Checks every field is finite and positive.
    ///
    /// # Errors
    /// [`Error::InvalidConfig`] naming the first bad field.
    pub fn validate(&self) -> Result<(), Error> {
        let pos = |field: &'static str, v: f64| {
            if v.is_finite() && v > 0.0 {
                Ok(())
            } else {
                Err(Error::InvalidConfig { field, reason: format!("must be a positive number of seconds, got {v}") })
            }
        };
        pos("prefill_s_per_token", self.prefill_s_per_token)?;
        pos("decode_s_per_token", self.decode_s_per_token)?;
        pos("step_overhead_s", self.step_overhead_s)?;
        if self.chunk_tokens == 0 {
            return Err(Error::InvalidConfig {
                field: "chunk_tokens",
                reason: "must be at least 1 token, got 0".into(),
            });
        }
        if self.max_num_seqs == 0 {
            return Err(Error::InvalidConfig { field: "max_num_seqs", reason: "must be at least 1, got 0".into() });
        }
        Ok(())
    }

    /// Prefill throughput, tokens per second (1/β1).
    pub fn prefill_tokens_per_s(&self) -> f64 {
        1.0 / self.prefill_s_per_token
    }

    /// Estimated seconds until the first token of a request whose `prefill_tokens` (tokens,
    /// queue ahead of it included) must be computed while `decoding` sequences run alongside.
    #[inline]
    pub fn ttft(&self, prefill_tokens: u64, decoding: u32) -> f64 {
        // ⌈P/C⌉ without an integer division or a libm call on the hot path. Converted through
        // i64: x86-64 converts u64 ⇄ f64 in a branchy sequence, i64 in one instruction (token
        // counts past 2⁵³ are not exact in f64 anyway). Within one chunk (a lightly loaded
        // replica) it is one step, without the f64 division, a fifth of the pick at 1,024
        // replicas.
        let tokens = prefill_tokens.min(1 << 53) as i64 as f64;
        let steps = if prefill_tokens <= u64::from(self.chunk_tokens) {
            1.0
        } else {
            let chunks = tokens / f64::from(self.chunk_tokens);
            let whole = chunks as i64 as f64;
            if whole < chunks {
                whole + 1.0
            } else {
                whole
            }
        };
        self.prefill_s_per_token * tokens
            + steps * (self.step_overhead_s + self.decode_s_per_token * f64::from(decoding))
    }
}

impl ReplicaProfile {
    /// What a replica serves at full load before any is measured, tokens per second: whole
    /// prefill chunks, derated to 0.6 for the decode steps that share them — the autoscaler's
    /// prior until replicas are measured at full load (H100 profile: 33,423 tokens/s).
    pub fn full_load_tokens_per_s_prior(&self) -> f64 {
        let chunk = f64::from(self.chunk_tokens);
        0.6 * chunk / (self.step_overhead_s + self.prefill_s_per_token * chunk)
    }

    /// Estimated seconds a new request waits for a sequence slot on a replica running
    /// `outstanding` requests (prefilling and decoding) of which `decoding` decode, each
    /// expected to produce `output_tokens`: 0 below `max_num_seqs`; past it, each request
    /// ahead beyond the cap waits for one to finish. With `D` sequences whose remaining decode
    /// times spread evenly over one whole decode `T = output_tokens · (β0 + β2·D)`, one
    /// finishes every `T / (D + 1)` on average.
    #[inline]
    pub fn slot_wait(&self, outstanding: u32, decoding: u32, output_tokens: u32) -> f64 {
        let over = (outstanding + 1).saturating_sub(self.max_num_seqs);
        if over == 0 {
            return 0.0;
        }
        let d = decoding.max(1) as f64;
        let whole = output_tokens.max(1) as f64 * (self.step_overhead_s + self.decode_s_per_token * d);
        over as f64 * whole / (d + 1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_full_load_prior_is_whole_chunks_derated() {
        // 0.6 · 8,192 / (5.75 ms + 17.25 µs · 8,192).
        let p = ReplicaProfile::H100_LLAMA3_8B;
        assert!((p.full_load_tokens_per_s_prior() - 0.6 * 8192.0 / (5.75e-3 + 17.25e-6 * 8192.0)).abs() < 1e-9);
        assert_eq!(p.full_load_tokens_per_s_prior().round(), 33_423.0);
    }

    #[test]
    fn a_full_batch_makes_new_requests_wait_for_slots() {
        let p = ReplicaProfile::H100_LLAMA3_8B;
        assert_eq!(p.slot_wait(255, 200, 300), 0.0, "the 256th sequence still fits");
        // 2 over the cap, 255 decoding, 300 output tokens each: 2 · 300 · (5.75 ms + 255 · 6 µs) / 256.
        let want = 2.0 * 300.0 * (5.75e-3 + 6.0e-6 * 255.0) / 256.0;
        assert!((p.slot_wait(257, 255, 300) - want).abs() < 1e-12);
    }

    #[test]
    fn ttft_follows_the_step_model() {
        let p = ReplicaProfile::H100_LLAMA3_8B;
        // 10,000 tokens: 2 chunks; 4 decoding sequences.
        let want = 17.25e-6 * 10_000.0 + 2.0 * (5.75e-3 + 6.0e-6 * 4.0);
        assert!((p.ttft(10_000, 4) - want).abs() < 1e-12);
        assert!((p.ttft(0, 0) - 5.75e-3).abs() < 1e-12, "a cached prompt still takes one step");
    }

    #[test]
    fn invalid_profiles_name_the_field() {
        let bad = ReplicaProfile { chunk_tokens: 0, ..ReplicaProfile::default() };
        assert!(matches!(bad.validate(), Err(Error::InvalidConfig { field: "chunk_tokens", .. })));
        let bad = ReplicaProfile { prefill_s_per_token: f64::NAN, ..ReplicaProfile::default() };
        assert!(matches!(bad.validate(), Err(Error::InvalidConfig { field: "prefill_s_per_token", .. })));
    }
}

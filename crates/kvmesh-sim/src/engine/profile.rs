//! What a simulated engine replica is: its step-time model, KV capacity, batch limit and cold
//! start, with the built-in calibrations and a JSON file format for your own.
//!
//! Built-in profiles (Llama-3-8B under vLLM, the linear step model of Vidur, Agrawal et al.,
//! MLSys 2024, fitted to public vLLM measurements):
//!
//! | name | β0 (per step) | β1 (per prefill token) | β2 (per decode token) | KV cache |
//! |---|---|---|---|---|
//! | `h100` (default) | 5.75 ms | 17.25 µs | 6.0 µs | 470,000 tokens |
//! | `a100` | 16.4 ms | 47.8 µs | 18.2 µs | 450,000 tokens |
//!
//! A profile file is JSON with the same fields as [`EngineProfile`], e.g.
//! `{"name": "mine", "prefill_s_per_token": 2e-5, "decode_s_per_token": 7e-6,
//! "step_overhead_s": 0.006, "chunk_tokens": 8192, "kv_tokens": 400000, "max_batch": 256,
//! "cold_start_s": 60}` (`kv_bytes_per_token`, for disaggregated serving, defaults to
//! Llama-3-8B's 131,072).

use kvmesh_core::load::ReplicaProfile;
use std::path::Path;

/// One engine replica's performance and limits.
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct EngineProfile {
    /// A name for reports.
    pub name: String,
    /// β1: seconds per prefill token.
    pub prefill_s_per_token: f64,
    /// β2: seconds per decode token in a step.
    pub decode_s_per_token: f64,
    /// β0: fixed seconds per step.
    pub step_overhead_s: f64,
    /// Token budget per step (vLLM `max_num_batched_tokens`, chunked prefill), tokens.
    pub chunk_tokens: u32,
    /// KV cache capacity, tokens.
    pub kv_tokens: u64,
    /// Sequences per batch (vLLM `max_num_seqs`).
    pub max_batch: u32,
    /// Seconds from start to serving (for the autoscaling simulation; fixed fleets start
    /// warm and do not use it).
    #[serde(default = "default_cold_start")]
    pub cold_start_s: f64,
    /// KV-cache bytes per token (all layers, keys and values): what a prefill replica sends a
    /// decode replica per prompt token in disaggregated serving. Default 131,072: Llama-3-8B
    /// in fp16, 32 layers × 8 KV heads × 128 dims × 2 (K, V) × 2 bytes.
    #[serde(default = "default_kv_bytes_per_token")]
    pub kv_bytes_per_token: u64,
}

fn default_cold_start() -> f64 {
    60.0
}

fn default_kv_bytes_per_token() -> u64 {
    131_072
}

impl EngineProfile {
    /// Llama-3-8B on one H100.
    pub fn h100() -> Self {
        EngineProfile {
            name: "h100".into(),
            prefill_s_per_token: 17.25e-6,
            decode_s_per_token: 6.0e-6,
            step_overhead_s: 5.75e-3,
            chunk_tokens: 8192,
            kv_tokens: 470_000,
            max_batch: 256,
            cold_start_s: 60.0,
            kv_bytes_per_token: default_kv_bytes_per_token(),
        }
    }

    /// Llama-3-8B on one A100.
    pub fn a100() -> Self {
        EngineProfile {
            name: "a100".into(),
            prefill_s_per_token: 47.8e-6,
            decode_s_per_token: 18.2e-6,
            step_overhead_s: 16.4e-3,
            kv_tokens: 450_000,
            ..EngineProfile::h100()
        }
    }

    /// A built-in profile by name (`h100`, `a100`) or a JSON profile file.
    ///
    /// # Errors
    /// A message naming the profile or file and what is wrong.
    pub fn resolve(name_or_path: &str) -> Result<Self, String> {
        let p = match name_or_path {
            "h100" => EngineProfile::h100(),
            "a100" => EngineProfile::a100(),
            path => {
                let text = std::fs::read_to_string(Path::new(path))
                    .map_err(|e| format!("profile {path:?} is neither h100, a100 nor a readable file: {e}"))?;
                serde_json::from_str(&text).map_err(|e| format!("profile file {path}: {e}"))?
            }
        };
        p.validate()?;
        Ok(p)
    }

    /// Checks every field.
    ///
    /// # Errors
    /// A message naming the bad field and value.
    pub fn validate(&self) -> Result<(), String> {
        self.step().validate().map_err(|e| format!("profile {}: {e}", self.name))?;
        if self.kv_tokens == 0 || self.max_batch == 0 {
            return Err(format!("profile {}: kv_tokens and max_batch must be positive", self.name));
        }
        Ok(())
    }

    /// The step-time model, in the core's terms.
    pub fn step(&self) -> ReplicaProfile {
        ReplicaProfile {
            prefill_s_per_token: self.prefill_s_per_token,
            decode_s_per_token: self.decode_s_per_token,
            step_overhead_s: self.step_overhead_s,
            chunk_tokens: self.chunk_tokens,
            max_num_seqs: self.max_batch,
        }
    }

    /// KV capacity in blocks of `block_size` tokens.
    pub fn kv_blocks(&self, block_size: u32) -> u64 {
        self.kv_tokens / block_size as u64
    }
}

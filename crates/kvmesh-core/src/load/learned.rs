//! Learning a replica's prefill speed from the first tokens it actually delivers.
//!
//! A configured [`ReplicaProfile`] may be wrong for the GPU, model or engine version in front
//! of us, so each first token is a measurement: the request waited for `P` prefill tokens (the
//! queue booked ahead of it plus its own uncached tokens) and took `t` seconds. Taking the
//! profile's step overhead out, `β1 ≈ (t − ⌈P/C⌉·(β0 + β2·D)) / P`. Samples under
//! [`MIN_SAMPLE_TOKENS`] are dominated by fixed costs and are ignored; the estimate is the mean
//! of the first 16 samples, then an exponentially weighted mean (weight 1/16), and is used once
//! [`MIN_SAMPLES`] samples are in.

use super::ReplicaProfile;

/// Prefill tokens a first token must have waited for to count as a sample.
pub const MIN_SAMPLE_TOKENS: u64 = 1024;
/// Samples needed before the learned rate replaces the configured one.
pub const MIN_SAMPLES: u32 = 8;
/// Weight of one sample once the running mean is warm.
const ALPHA: f64 = 1.0 / 16.0;

/// A replica's learned prefill cost, seconds per token.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefillRate {
    s_per_token: f64,
    samples: u32,
}

impl PrefillRate {
    /// Folds in one first token: `prefill_tokens` waited for (queue ahead included), `seconds`
    /// from booking to first token, `decoding` sequences on the replica at booking, under
    /// `profile`. Returns whether it counted.
    pub fn observe(&mut self, profile: &ReplicaProfile, prefill_tokens: u64, seconds: f64, decoding: u32) -> bool {
        if prefill_tokens < MIN_SAMPLE_TOKENS || !(seconds.is_finite() && seconds > 0.0) {
            return false;
        }
        let fixed = profile.ttft(prefill_tokens, decoding) - profile.prefill_s_per_token * prefill_tokens as f64;
        // Never below a tenth of the configured cost: a first token faster than the fixed
        // costs says the profile's overheads are wrong, not that prefill is free.
        let sample = ((seconds - fixed) / prefill_tokens as f64).max(profile.prefill_s_per_token / 10.0);
        self.samples = self.samples.saturating_add(1);
        let w = ALPHA.max(1.0 / self.samples as f64);
        self.s_per_token += w * (sample - self.s_per_token);
        true
    }

    /// Samples folded in.
    pub fn samples(&self) -> u32 {
        self.samples
    }

    /// The learned seconds per prefill token, once [`MIN_SAMPLES`] samples are in.
    pub fn s_per_token(&self) -> Option<f64> {
        (self.samples >= MIN_SAMPLES).then_some(self.s_per_token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn learns_the_per_token_cost_net_of_step_overheads() {
        let p = ReplicaProfile::H100_LLAMA3_8B;
        let mut r = PrefillRate::default();
        assert!(!r.observe(&p, 1000, 1.0, 0), "short prompts are no sample");
        // A replica twice as slow as the profile: β1 = 34.5 µs/token, same overheads.
        let slow = ReplicaProfile { prefill_s_per_token: 34.5e-6, ..p };
        for _ in 0..7 {
            assert!(r.observe(&p, 10_000, slow.ttft(10_000, 4), 4));
        }
        assert_eq!(r.s_per_token(), None, "7 samples are not enough");
        r.observe(&p, 20_000, slow.ttft(20_000, 0), 0);
        assert!((r.s_per_token().unwrap() - 34.5e-6).abs() < 1e-12);
        assert_eq!(r.samples(), 8);
    }
}

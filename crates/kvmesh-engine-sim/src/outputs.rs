//! Output lengths from a distribution, as a real model's answers vary: a request generates
//! `min(max_tokens, L)` tokens, `L` drawn from a lognormal (the shape of completion lengths in
//! public serving traces; kvmesh-sim's RL rollouts use it too), and stops early (`finish_reason`
//! `stop`) when `L` is the smaller. Without it every request generates its `max_tokens`.

use rand::rngs::SmallRng;
use rand::SeedableRng;
use std::sync::Mutex;

/// A lognormal output-length distribution.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputLengths {
    /// Its median, tokens (≥ 1).
    pub median: f64,
    /// The σ of its logarithm (0: every output is the median).
    pub sigma: f64,
    /// Seed of the draws (one stream per engine, in request order).
    pub seed: u64,
}

/// Draws output lengths, one per request, in arrival order.
#[derive(Debug)]
pub struct OutputSampler {
    lengths: OutputLengths,
    rng: Mutex<SmallRng>,
}

impl OutputSampler {
    /// A sampler of `lengths`.
    ///
    /// # Errors
    /// A median below 1 or a negative or non-finite σ.
    pub fn new(lengths: OutputLengths) -> anyhow::Result<Self> {
        anyhow::ensure!(lengths.median.is_finite() && lengths.median >= 1.0, "output median must be ≥ 1 token");
        anyhow::ensure!(lengths.sigma.is_finite() && lengths.sigma >= 0.0, "output sigma must be ≥ 0");
        Ok(OutputSampler { lengths, rng: Mutex::new(SmallRng::seed_from_u64(lengths.seed)) })
    }

    /// The next request's output length, at most `max_tokens` and at least 1.
    pub fn sample(&self, max_tokens: u32) -> u32 {
        let mut rng = self.rng.lock().unwrap_or_else(|p| p.into_inner());
        let l = kvmesh_sim::workload::lognormal(&mut rng, self.lengths.median, self.lengths.sigma);
        (l.round().clamp(1.0, f64::from(u32::MAX)) as u32).min(max_tokens.max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_seeded_capped_and_centred_on_the_median() {
        let lengths = OutputLengths { median: 64.0, sigma: 1.0, seed: 7 };
        let (a, b) = (OutputSampler::new(lengths).unwrap(), OutputSampler::new(lengths).unwrap());
        let draws: Vec<u32> = (0..2_000).map(|_| a.sample(100_000)).collect();
        assert_eq!(draws, (0..2_000).map(|_| b.sample(100_000)).collect::<Vec<_>>(), "same seed, same draws");
        let mut sorted = draws.clone();
        sorted.sort_unstable();
        let median = sorted[1_000];
        assert!((54..=75).contains(&median), "median {median}");
        assert!(sorted[1_990] > 500, "a heavy tail: {}", sorted[1_990]);
        assert!((0..100).all(|_| a.sample(16) <= 16), "capped by max_tokens");
        let fixed = OutputSampler::new(OutputLengths { median: 9.0, sigma: 0.0, seed: 1 }).unwrap();
        assert_eq!(fixed.sample(100), 9);
        assert!(OutputSampler::new(OutputLengths { median: 0.5, sigma: 1.0, seed: 1 }).is_err());
    }
}

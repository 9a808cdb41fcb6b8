//! The expected output length of a request, which nobody knows up front.
//!
//! Choice: when the client gives `max_tokens`, use it — it is the only per-request signal and
//! a hard upper bound on the KV the request can take, so KV headroom checks stay safe. Without
//! it, use an exponentially weighted mean of observed output lengths (weight 1/32 per
//! observation, so it follows a shift in traffic within ~100 requests), starting from
//! `initial` tokens before any observation.

/// A running estimate of output tokens per request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputEstimator {
    mean: f64,
    observed: u64,
}

/// Weight of one observation in the running mean.
const ALPHA: f64 = 1.0 / 32.0;

impl OutputEstimator {
    /// An estimator that answers `initial` tokens until it has observed outputs.
    pub fn new(initial: u32) -> Self {
        OutputEstimator { mean: initial as f64, observed: 0 }
    }

    /// Folds in one finished request's output length, tokens.
    pub fn observe(&mut self, output_tokens: u32) {
        self.observed += 1;
        // The first observations get a plain mean so the initial guess fades quickly.
        let w = ALPHA.max(1.0 / self.observed as f64);
        self.mean += w * (output_tokens as f64 - self.mean);
    }

    /// Expected output tokens of a request with the given `max_tokens`.
    pub fn expect(&self, max_tokens: Option<u32>) -> u32 {
        match max_tokens {
            Some(m) => m,
            None => self.mean.round() as u32,
        }
    }

    /// Outputs observed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }
}

impl Default for OutputEstimator {
    /// 256 tokens before the first observation.
    fn default() -> Self {
        OutputEstimator::new(256)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_tokens_wins_then_running_mean() {
        let mut e = OutputEstimator::new(256);
        assert_eq!(e.expect(Some(10)), 10);
        assert_eq!(e.expect(None), 256);
        e.observe(100);
        assert_eq!(e.expect(None), 100);
        e.observe(200);
        assert_eq!(e.expect(None), 150);
        for _ in 0..1000 {
            e.observe(40);
        }
        assert_eq!(e.expect(None), 40);
    }
}

//! The expected output length of a request, which nobody knows up front.
//!
//! Order of trust, per request ([`OutputEstimator::expect_for`]):
//! 1. a client **hint** (an agent harness or RL trainer that knows its length class), capped
//!    by `max_tokens`;
//! 2. for a request that gives `max_tokens`, with learning on, the **learned** mean of
//!    completed outputs of requests with the same *output key* — the hash of the prompt's
//!    first [`KEY_BLOCKS`] blocks ([`output_key`]): requests that start alike (one task's
//!    system prompt and instructions) produce outputs alike — once [`MIN_KEYED`] of them
//!    completed, capped by `max_tokens`;
//! 3. `max_tokens` — a hard upper bound on the KV the request can take, so KV headroom checks
//!    stay safe; but RL trainers and agents send a `max_tokens` far above the median (8,192
//!    against a few hundred), and booking it reserves KV that never fills;
//! 4. the running mean of all observed outputs (weight 1/32 per observation, so it follows a
//!    shift in traffic within ~100 requests), `initial` tokens before any.
//!
//! Learning replaces `max_tokens`, a bound, and not the running mean: without `max_tokens`
//! the mean stands (per-key means measured no better there: on the Mooncake traces at ~100 %
//! load, p99 TTFT 1.62 → 1.73 s and 1.92 → 2.05 s, BENCHMARKS.md, decode-heavy traffic).
//!
//! Learned means per key are exponentially weighted too (1/16), over at most [`MAX_KEYS`]
//! keys; past that, the half not seen for longest is dropped.
//!
//! **As tokens stream.** A request that has generated `g` tokens is more likely a long one:
//! with heavy-tailed lengths the running population is length-biased, so booking every live
//! request at the mean undercounts the KV its survivors will still take.
//! [`OutputEstimator::expect_given`] answers E[L | L > g] from a histogram of completed
//! lengths (the key's once it has [`MIN_KEYED`], else all), in buckets of a quarter octave
//! ([`Lengths`]). A request booked at its `max_tokens` because its key is new is re-estimated
//! so from its first token on, from all completed lengths.

use crate::ids::BlockHash;
use rustc_hash::FxHashMap;

/// Leading full blocks that make a request's output key (64 tokens at 16-token blocks).
pub const KEY_BLOCKS: usize = 4;
/// Completed outputs a key needs before its mean is trusted over `max_tokens`.
pub const MIN_KEYED: u32 = 4;
/// Output keys learned at most.
pub const MAX_KEYS: usize = 4096;

/// Weight of one observation in the running mean.
const ALPHA: f64 = 1.0 / 32.0;
/// Weight of one observation in a key's mean.
const KEY_ALPHA: f64 = 1.0 / 16.0;

/// The output key of a prompt whose full blocks hash to `hashes`: its [`KEY_BLOCKS`]-th block
/// hash (which chains over all before it), or its last when shorter; `None` without a full
/// block.
pub fn output_key(hashes: &[BlockHash]) -> Option<u64> {
    hashes.get(hashes.len().min(KEY_BLOCKS).checked_sub(1)?).map(|h| h.0)
}

/// Buckets of [`Lengths`]: a quarter octave each, 1 to 2^24 tokens.
const BUCKETS: usize = 96;

/// A histogram of output lengths in quarter-octave buckets (bucket `k` holds lengths in
/// [2^(k/4), 2^((k+1)/4)), represented by its geometric middle), halved whenever it holds
/// 4,096 observations (rounding up, so a rare long length is not forgotten), so it follows
/// the recent past.
#[derive(Debug, Clone, PartialEq)]
pub struct Lengths {
    counts: [u32; BUCKETS],
    total: u32,
}

impl Default for Lengths {
    fn default() -> Self {
        Lengths { counts: [0; BUCKETS], total: 0 }
    }
}

impl Lengths {
    fn bucket(n: u32) -> usize {
        ((f64::from(n.max(1)).log2() * 4.0) as usize).min(BUCKETS - 1)
    }

    fn middle(k: usize) -> f64 {
        ((k as f64 + 0.5) / 4.0).exp2()
    }

    /// Adds one length, tokens.
    pub fn observe(&mut self, n: u32) {
        if self.total >= 4096 {
            self.total = 0;
            for c in &mut self.counts {
                *c = c.div_ceil(2);
                self.total += *c;
            }
        }
        self.counts[Self::bucket(n)] += 1;
        self.total += 1;
    }

    /// Lengths held.
    pub fn len(&self) -> u32 {
        self.total
    }

    /// Whether no length is held.
    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// E[L | L > g], tokens: the mean over the buckets whose middle is at least `g + 1` (the
    /// bucket holding `g + 1` counts only then); `None` when none holds a length.
    pub fn expect_given(&self, g: u32) -> Option<f64> {
        let next = g.saturating_add(1);
        let mut from = Self::bucket(next);
        if Self::middle(from) < f64::from(next) {
            from += 1;
        }
        let (mut n, mut sum) = (0u64, 0.0);
        for (k, &c) in self.counts.iter().enumerate().skip(from) {
            n += u64::from(c);
            sum += f64::from(c) * Self::middle(k);
        }
        (n > 0).then(|| sum / n as f64)
    }
}

#[derive(Debug, Clone, PartialEq)]
struct Keyed {
    mean: f64,
    observed: u32,
    /// Observation count of the whole estimator when this key was last observed.
    seen: u64,
    lengths: Lengths,
}

/// A running estimate of output tokens per request.
#[derive(Debug, Clone, PartialEq)]
pub struct OutputEstimator {
    mean: f64,
    observed: u64,
    keyed: FxHashMap<u64, Keyed>,
    lengths: Lengths,
}

impl OutputEstimator {
    /// An estimator that answers `initial` tokens until it has observed outputs.
    pub fn new(initial: u32) -> Self {
        OutputEstimator { mean: initial as f64, observed: 0, keyed: FxHashMap::default(), lengths: Lengths::default() }
    }

    /// Folds in one finished request's output length, tokens.
    pub fn observe(&mut self, output_tokens: u32) {
        self.observe_keyed(None, output_tokens);
    }

    /// Folds in one finished request's output length, tokens, under its output `key`
    /// ([`output_key`]) too when it has one.
    pub fn observe_keyed(&mut self, key: Option<u64>, output_tokens: u32) {
        self.observed += 1;
        // The first observations get a plain mean so the initial guess fades quickly.
        let w = ALPHA.max(1.0 / self.observed as f64);
        self.mean += w * (output_tokens as f64 - self.mean);
        self.lengths.observe(output_tokens);
        let Some(key) = key else { return };
        if self.keyed.len() >= MAX_KEYS && !self.keyed.contains_key(&key) {
            let mut seen: Vec<u64> = self.keyed.values().map(|k| k.seen).collect();
            let (_, median, _) = seen.select_nth_unstable(MAX_KEYS / 2);
            let median = *median;
            self.keyed.retain(|_, k| k.seen > median);
        }
        let observed = self.observed;
        let k = self.keyed.entry(key).or_insert(Keyed {
            mean: 0.0,
            observed: 0,
            seen: observed,
            lengths: Lengths::default(),
        });
        k.lengths.observe(output_tokens);
        k.observed = k.observed.saturating_add(1);
        k.seen = observed;
        let w = KEY_ALPHA.max(1.0 / f64::from(k.observed));
        k.mean += w * (output_tokens as f64 - k.mean);
    }

    /// Expected output tokens of a request with the given `max_tokens` (rules 3 and 4).
    pub fn expect(&self, max_tokens: Option<u32>) -> u32 {
        match max_tokens {
            Some(m) => m,
            None => self.mean.round() as u32,
        }
    }

    /// Expected output tokens of a request with `max_tokens`, a client `hint` and output `key`,
    /// learned means used only when `learn` (the rules of the module docs, in order).
    pub fn expect_for(&self, max_tokens: Option<u32>, hint: Option<u32>, key: Option<u64>, learn: bool) -> u32 {
        let cap = |n: u32| max_tokens.map_or(n, |m| n.min(m));
        if let Some(h) = hint {
            return cap(h.max(1));
        }
        if learn && max_tokens.is_some() {
            if let Some(k) = key.and_then(|k| self.keyed.get(&k)).filter(|k| k.observed >= MIN_KEYED) {
                return cap((k.mean.round() as u32).max(1));
            }
        }
        self.expect(max_tokens)
    }

    /// Expected output tokens of a request with output `key` that has generated `generated`
    /// tokens so far: E[L | L > generated] from the key's completed lengths once it has
    /// [`MIN_KEYED`] of them, else from all, at least `generated + 1` and at most `cap` (its
    /// `max_tokens`, which wins); `None` before any length was observed.
    pub fn expect_given(&self, key: Option<u64>, generated: u32, cap: u32) -> Option<u32> {
        let keyed = key.and_then(|k| self.keyed.get(&k)).filter(|k| k.observed >= MIN_KEYED).map(|k| &k.lengths);
        let lengths = keyed.unwrap_or(&self.lengths);
        if lengths.is_empty() {
            return None;
        }
        // Past every length seen: it runs on; a quarter more than it has is the guess.
        let e = lengths.expect_given(generated).unwrap_or(f64::from(generated) * 1.25);
        Some((e.round() as u32).max(generated.saturating_add(1)).min(cap.max(1)))
    }

    /// Outputs observed so far.
    pub fn observed(&self) -> u64 {
        self.observed
    }

    /// Output keys with a learned mean.
    pub fn keys(&self) -> usize {
        self.keyed.len()
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

    #[test]
    fn hint_then_learned_key_then_max_tokens() {
        let mut e = OutputEstimator::new(256);
        let (a, b) = (Some(7), Some(9));
        // A hint wins, capped by max_tokens.
        assert_eq!(e.expect_for(Some(8192), Some(300), a, true), 300);
        assert_eq!(e.expect_for(Some(200), Some(300), a, true), 200);
        // Three outputs under key a: not yet trusted, max_tokens stands.
        for n in [100, 200, 300] {
            e.observe_keyed(a, n);
        }
        assert_eq!(e.expect_for(Some(8192), None, a, true), 8192);
        e.observe_keyed(a, 400);
        // Four: their plain mean, 250; not with learning off; not for another key.
        assert_eq!(e.expect_for(Some(8192), None, a, true), 250);
        assert_eq!(e.expect_for(Some(8192), None, a, false), 8192);
        assert_eq!(e.expect_for(Some(8192), None, b, true), 8192);
        // Without max_tokens the global mean stands, key or not (the plain mean of five), and
        // the learned mean is capped by a smaller max_tokens.
        e.observe_keyed(b, 1250);
        assert_eq!(e.expect_for(None, None, None, true), 450);
        assert_eq!(e.expect_for(None, None, a, true), 450);
        assert_eq!(e.expect_for(Some(100), None, a, true), 100);
        // The 17th observation of a key moves its mean by 1/16.
        for _ in 0..12 {
            e.observe_keyed(a, 250);
        }
        e.observe_keyed(a, 1850);
        assert_eq!(e.expect_for(Some(8192), None, a, true), 350);
    }

    #[test]
    fn keys_are_bounded_oldest_half_dropped() {
        let mut e = OutputEstimator::new(256);
        for k in 0..MAX_KEYS as u64 {
            for _ in 0..MIN_KEYED {
                e.observe_keyed(Some(k), 10);
            }
        }
        assert_eq!(e.keys(), MAX_KEYS);
        e.observe_keyed(Some(u64::MAX), 10);
        assert_eq!(e.keys(), MAX_KEYS / 2);
        // The oldest keys went, the newest stayed.
        assert_eq!(e.expect_for(Some(500), None, Some(0), true), 500);
        assert_eq!(e.expect_for(Some(500), None, Some(MAX_KEYS as u64 - 1), true), 10);
    }

    #[test]
    fn survivors_are_expected_longer() {
        let mut l = Lengths::default();
        assert_eq!(l.expect_given(0), None);
        // Buckets: 16 is bucket 16 (middle 2^(16.5/4) = 17.45), 256 bucket 32 (middle 2^8.125).
        for _ in 0..3 {
            l.observe(16);
        }
        l.observe(256);
        let (m16, m256) = (2f64.powf(16.5 / 4.0), 2f64.powf(32.5 / 4.0));
        assert!((l.expect_given(0).unwrap() - (3.0 * m16 + m256) / 4.0).abs() < 1e-9);
        // Past 16's bucket only the 256 remains; past it, nothing.
        assert!((l.expect_given(20).unwrap() - m256).abs() < 1e-9);
        assert_eq!(l.expect_given(300), None);
        // 17 is below the middle of its bucket (17.45): the bucket still counts.
        assert!((l.expect_given(16).unwrap() - (3.0 * m16 + m256) / 4.0).abs() < 1e-9);
        // Halved at 4,096, rounding up: 4,095 → 2,048 and 1 → 1, then the new one.
        for _ in 0..4092 {
            l.observe(16);
        }
        assert_eq!(l.len(), 4096);
        l.observe(4096);
        assert_eq!(l.len(), 2050);
        assert_eq!(l.expect_given(300).map(|e| e.round()), Some(2f64.powf(48.5 / 4.0).round()));

        let mut e = OutputEstimator::new(256);
        assert_eq!(e.expect_given(None, 10, 8192), None);
        for n in [100, 100, 100, 1000] {
            e.observe_keyed(Some(1), n);
        }
        // Key 1's lengths: a survivor past 200 tokens is expected at 1000's bucket middle,
        // capped by max_tokens, and past all seen at 1.25 × what it has.
        let m1000 = 2f64.powf(39.5 / 4.0).round() as u32;
        assert_eq!(e.expect_given(Some(1), 200, 8192), Some(m1000));
        assert_eq!(e.expect_given(Some(1), 200, 500), Some(500));
        assert_eq!(e.expect_given(Some(1), 2000, 8192), Some(2500));
        // An unknown key uses every length seen: the same four here.
        assert_eq!(e.expect_given(Some(2), 200, 8192), Some(m1000));
    }

    #[test]
    fn output_key_is_the_fourth_block_or_the_last() {
        let h = |n: u64| (1..=n).map(BlockHash).collect::<Vec<_>>();
        assert_eq!(output_key(&h(0)), None);
        assert_eq!(output_key(&h(2)), Some(2));
        assert_eq!(output_key(&h(9)), Some(4));
    }
}

//! A rolling p99 over the last [`RecentP99::LEN`] samples, refreshed every
//! [`RecentP99::EVERY`] samples (one pass over the window keeping its largest few, no
//! allocation once full).

/// See the module docs.
#[derive(Debug, Clone)]
pub(crate) struct RecentP99 {
    samples: Vec<f64>,
    next: usize,
    since: usize,
    p99: f64,
    scratch: Vec<f64>,
}

impl RecentP99 {
    /// Samples kept.
    pub(crate) const LEN: usize = 1024;
    /// Samples between refreshes (each of the first `EVERY` samples refreshes).
    pub(crate) const EVERY: usize = 64;

    pub(crate) fn new() -> Self {
        RecentP99 { samples: Vec::with_capacity(Self::LEN), next: 0, since: 0, p99: 0.0, scratch: Vec::new() }
    }

    /// Adds `x` (NaN is ignored).
    pub(crate) fn observe(&mut self, x: f64) {
        if x.is_nan() {
            return;
        }
        if self.samples.len() < Self::LEN {
            self.samples.push(x);
        } else {
            self.samples[self.next] = x;
            self.next = (self.next + 1) % Self::LEN;
        }
        self.since += 1;
        if self.since >= Self::EVERY || self.samples.len() <= Self::EVERY {
            self.since = 0;
            // Nearest rank: the ⌈0.99·n⌉-th smallest, which is the (n − ⌈0.99·n⌉ + 1)-th
            // largest: at most 11 of 1,024, kept sorted in one pass over the window (a copy
            // of the window and a selection on it cost ~0.15 µs a decision, amortized).
            let n = self.samples.len();
            let rank = ((n as f64 * 0.99).ceil() as usize).clamp(1, n);
            let top = n - rank + 1;
            self.scratch.clear();
            for &x in &self.samples {
                let full = self.scratch.len() == top;
                if full && x.total_cmp(&self.scratch[top - 1]).is_le() {
                    continue;
                }
                if full {
                    self.scratch.pop();
                }
                let at = self.scratch.partition_point(|&y| y.total_cmp(&x).is_gt());
                self.scratch.insert(at, x);
            }
            self.p99 = self.scratch[top - 1];
        }
    }

    /// The p99 as of the last refresh; 0 before any sample.
    pub(crate) fn p99(&self) -> f64 {
        self.p99
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_p99_of_the_last_1024_refreshed_every_64() {
        let mut w = RecentP99::new();
        assert_eq!(w.p99(), 0.0);
        for x in 1..=100 {
            w.observe(x as f64);
        }
        // Each of the first 64 samples refreshes, then every 64th: after 100 the p99 is the
        // first 64's, the ⌈63.36⌉ = 64th smallest.
        assert_eq!(w.p99(), 64.0);
        let mut w = RecentP99::new();
        for x in 1..=1024 {
            w.observe(x as f64);
        }
        // Refreshed at every 64th sample up to 1024: the whole window.
        assert_eq!(w.p99(), 1014.0, "⌈0.99 · 1024⌉ = 1014");
        // 64 larger samples push the 64 oldest out; the refresh comes with the 64th.
        for x in 0..63 {
            w.observe(5000.0 + x as f64);
        }
        assert_eq!(w.p99(), 1014.0, "not refreshed yet");
        w.observe(6000.0);
        // Window: 65..=1024 and the 64 new ones; the 1014th smallest of 1024 is 5053.
        assert_eq!(w.p99(), 5053.0);
    }

    proptest::proptest! {
        /// The kept-largest pass gives the nearest-rank p99 a sort of the window gives, ties
        /// and repeated values included, at every refresh.
        #[test]
        fn equals_sorting_the_window(xs in proptest::collection::vec(0u8..40, 1..2500)) {
            let mut w = RecentP99::new();
            let mut window: Vec<f64> = Vec::new();
            let mut want = 0.0;
            for (seen, &x) in xs.iter().enumerate() {
                w.observe(f64::from(x));
                window.push(f64::from(x));
                if window.len() > RecentP99::LEN {
                    window.remove(0);
                }
                if (seen + 1) % RecentP99::EVERY == 0 || window.len() <= RecentP99::EVERY {
                    let mut sorted = window.clone();
                    sorted.sort_by(f64::total_cmp);
                    want = sorted[(sorted.len() as f64 * 0.99).ceil() as usize - 1];
                }
                proptest::prop_assert_eq!(w.p99(), want);
            }
        }
    }
}

//! A rolling p99 over the last [`RecentP99::LEN`] samples, refreshed every
//! [`RecentP99::EVERY`] samples (one selection over the window, no allocation once full).

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
            self.scratch.clear();
            self.scratch.extend_from_slice(&self.samples);
            // Nearest rank: the ⌈0.99·n⌉-th smallest.
            let k = ((self.scratch.len() as f64 * 0.99).ceil() as usize).clamp(1, self.scratch.len()) - 1;
            let (_, v, _) = self.scratch.select_nth_unstable_by(k, f64::total_cmp);
            self.p99 = *v;
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
}

//! Arrival-time preparation: spreading bucketed timestamps and scaling the rate.
//!
//! Mooncake's conversation trace records arrivals in buckets about 3 s apart (a median of 10
//! requests share one timestamp). Replayed as is, each bucket would hit the fleet as one burst
//! that the real service never saw, so the requests of a bucket are spread evenly over the
//! time to the next bucket (at most [`MAX_SPREAD_S`]): request `k` of `n` at
//! `t + k · gap / n`. Deterministic, order-preserving. Rate scaling then divides every arrival
//! time by the scale: `--rate-scale 2` replays the same requests twice as fast.

use crate::trace::Trace;

/// Longest interval a bucket is spread over, seconds.
pub const MAX_SPREAD_S: f64 = 3.0;

/// Spreads groups of requests with identical arrival times over the gap to the next group.
/// Returns how many groups were spread.
pub fn spread_buckets(trace: &mut Trace) -> usize {
    let reqs = &mut trace.requests;
    let mut spread = 0;
    let mut i = 0;
    while i < reqs.len() {
        let t = reqs[i].arrival_s;
        let mut j = i + 1;
        while j < reqs.len() && reqs[j].arrival_s == t {
            j += 1;
        }
        let n = j - i;
        if n > 1 {
            let gap = reqs.get(j).map_or(MAX_SPREAD_S, |r| r.arrival_s - t).min(MAX_SPREAD_S);
            for (k, r) in reqs[i..j].iter_mut().enumerate() {
                r.arrival_s = t + gap * k as f64 / n as f64;
            }
            spread += 1;
        }
        i = j;
    }
    spread
}

/// Divides every arrival time by `scale` (> 0): the same requests, `scale` times as fast.
///
/// # Errors
/// A message when `scale` is not a positive number.
pub fn scale_rate(trace: &mut Trace, scale: f64) -> Result<(), String> {
    if !(scale.is_finite() && scale > 0.0) {
        return Err(format!("rate scale must be a positive number, got {scale}"));
    }
    for r in &mut trace.requests {
        r.arrival_s /= scale;
    }
    Ok(())
}

/// Rate steps: splits the trace's span into `factors.len()` equal parts (by arrival time) and
/// replays part `i` `factors[i]` times as fast, parts back to back — e.g. `[1, 2, 1]` doubles
/// the rate for the middle third. Arrival times stay increasing.
///
/// # Errors
/// A message for no factors or a factor that is not a positive number.
pub fn rate_steps(trace: &mut Trace, factors: &[f64]) -> Result<(), String> {
    if factors.is_empty() {
        return Err("rate steps need at least one factor".into());
    }
    if let Some(f) = factors.iter().find(|f| !(f.is_finite() && **f > 0.0)) {
        return Err(format!("rate steps must be positive numbers, got {f}"));
    }
    let span = trace.requests.last().map_or(0.0, |r| r.arrival_s).max(f64::MIN_POSITIVE);
    let part = span / factors.len() as f64;
    // Where each part starts after the earlier parts were compressed.
    let mut starts = Vec::with_capacity(factors.len());
    let mut at = 0.0;
    for f in factors {
        starts.push(at);
        at += part / f;
    }
    for r in &mut trace.requests {
        let i = ((r.arrival_s / part) as usize).min(factors.len() - 1);
        r.arrival_s = starts[i] + (r.arrival_s - i as f64 * part) / factors[i];
    }
    Ok(())
}

/// Keeps the first `n` requests.
pub fn truncate(trace: &mut Trace, n: usize) {
    trace.requests.truncate(n);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{TraceFormat, TraceRequest};

    fn trace(times: &[f64]) -> Trace {
        let requests = times
            .iter()
            .map(|&t| TraceRequest {
                arrival_s: t,
                input_tokens: 1,
                output_tokens: 1,
                block_ids: vec![],
                max_tokens: None,
                group: None,
            })
            .collect();
        Trace { format: TraceFormat::Mooncake, block_tokens: Some(512), requests, skipped: vec![] }
    }

    fn times(t: &Trace) -> Vec<f64> {
        t.requests.iter().map(|r| r.arrival_s).collect()
    }

    #[test]
    fn rate_steps_compress_each_part_by_its_factor() {
        let mut t = trace(&[0.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0]);
        // Parts of 20 s: [0, 20) at 1×, [20, 40) at 2×, [40, 60] at 1×.
        rate_steps(&mut t, &[1.0, 2.0, 1.0]).unwrap();
        assert_eq!(times(&t), vec![0.0, 10.0, 20.0, 25.0, 30.0, 40.0, 50.0]);
        assert!(rate_steps(&mut t, &[1.0, 0.0]).is_err());
        assert!(rate_steps(&mut t, &[]).is_err());
    }

    #[test]
    fn buckets_spread_over_the_gap_to_the_next() {
        let mut t = trace(&[0.0, 0.0, 0.0, 0.0, 3.0, 10.0, 10.0]);
        assert_eq!(spread_buckets(&mut t), 2);
        assert_eq!(times(&t), vec![0.0, 0.75, 1.5, 2.25, 3.0, 10.0, 11.5]);
    }

    #[test]
    fn rate_scale_divides_arrivals_and_rejects_nonsense() {
        let mut t = trace(&[0.0, 1.0, 4.0]);
        scale_rate(&mut t, 2.0).unwrap();
        assert_eq!(times(&t), vec![0.0, 0.5, 2.0]);
        assert_eq!(scale_rate(&mut t, 0.0).unwrap_err(), "rate scale must be a positive number, got 0");
    }
}

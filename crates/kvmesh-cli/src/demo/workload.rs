//! The demo's requests: the built-in workload fitted to the Mooncake conversation trace, or a
//! real trace, with arrivals rescaled to the demo's rate and prompts rendered as text.

use anyhow::Context;
use kvmesh_sim::trace::{Trace, TraceRequest};
use kvmesh_sim::workload::Workload;
use std::path::Path;

/// What the demo sends.
pub struct Requests {
    /// Where they came from, for the report.
    pub source: String,
    /// The trace, arrivals rescaled (engine seconds from the start).
    pub trace: Trace,
}

/// Builds about `n` requests arriving at `rate` requests per second (engine time) on average:
/// from `trace` (its first `n`) or from the fitted built-in workload (seeded).
///
/// # Errors
/// An unreadable trace, or one without requests.
pub fn build(trace: Option<&Path>, n: usize, rate: f64, seed: u64) -> anyhow::Result<Requests> {
    let (mut t, source) = match trace {
        Some(p) => {
            let mut t = kvmesh_sim::trace::load(p).with_context(|| format!("reading {}", p.display()))?;
            t.requests.truncate(n);
            let source = format!("{} (first {} requests)", p.display(), t.requests.len());
            (t, source)
        }
        None => {
            // A session is at least one request: n sessions give at least n; the first n by
            // arrival are kept (later turns of the last sessions fall off).
            let w = Workload { sessions: n.max(1) as u32, seed, ..Workload::conversation() };
            let mut t = w.generate();
            t.requests.truncate(n);
            (t, "the built-in workload fitted to the Mooncake conversation trace".to_string())
        }
    };
    anyhow::ensure!(!t.requests.is_empty(), "no requests to send");
    rescale(&mut t.requests, rate);
    Ok(Requests { source, trace: t })
}

/// Shifts arrivals to start at 0 and stretches them so their mean rate is `rate` per second.
fn rescale(requests: &mut [TraceRequest], rate: f64) {
    let first = requests.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
    let last = requests.iter().map(|r| r.arrival_s).fold(f64::NEG_INFINITY, f64::max);
    let span = (last - first).max(1e-9);
    let target = requests.len() as f64 / rate;
    for r in requests.iter_mut() {
        r.arrival_s = (r.arrival_s - first) / span * target;
    }
}

/// 32 ASCII characters, 5 bits each: 4 of them spell one token id below 2^20.
const ALPHABET: &[u8; 32] = b"abcdefghijklmnopqrstuvwxyz234567";

/// A prompt whose text has exactly one 4-byte group per token, so the router's and the
/// engine-sim's approximate tokenizer (4 UTF-8 bytes per token, `kvmesh_core::prompt`) see the
/// trace's tokens: equal leading blocks give equal leading text.
pub fn prompt_text(tokens: &[u32]) -> String {
    let mut out = String::with_capacity(tokens.len() * 4);
    for &t in tokens {
        for shift in [15, 10, 5, 0] {
            out.push(ALPHABET[((t >> shift) & 31) as usize] as char);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvmesh_core::prompt::approximate_tokens;

    #[test]
    fn prompts_keep_shared_prefixes_and_token_counts() {
        let a = prompt_text(&[1, 2, 3, 70_000]);
        let b = prompt_text(&[1, 2, 3, 9]);
        assert_eq!(a.len(), 16);
        assert_eq!(&a[..12], &b[..12]);
        assert_ne!(a, b);
        let (ta, tb) = (approximate_tokens(&a), approximate_tokens(&b));
        assert_eq!(ta.len(), 4);
        assert_eq!(&ta[..3], &tb[..3]);
        assert_ne!(ta[3], tb[3]);
    }

    #[test]
    fn arrivals_are_rescaled_to_the_rate() {
        let r = build(None, 200, 20.0, 1).unwrap();
        let reqs = &r.trace.requests;
        assert_eq!(reqs.len(), 200);
        let last = reqs.iter().map(|r| r.arrival_s).fold(0.0, f64::max);
        assert!((last - reqs.len() as f64 / 20.0).abs() < 1e-9, "{last}");
        assert_eq!(reqs.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min), 0.0);
    }
}

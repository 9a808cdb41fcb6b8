//! kvmesh's own trace format, for users' traces: JSON Lines, one request per line.
//!
//! ```json
//! {"arrival_s": 0.25, "input_tokens": 1800, "output_tokens": 210, "block_ids": [7, 8, 9, 10], "block_tokens": 512}
//! ```
//!
//! - `arrival_s`: seconds (any origin; replays count from the earliest);
//! - `input_tokens`, `output_tokens`: tokens;
//! - `block_ids` (optional): prefix-chained ids, as Mooncake's `hash_ids` — an id names the
//!   whole prefix up to and including its block, so equal leading ids mean a shared prefix;
//! - `block_tokens` (optional, default 512): tokens per id; must be the same on every line.
//!
//! Export your gateway logs into it by hashing each prompt's 512-token prefixes (for instance
//! with chained hashes) into `block_ids`.

use super::jsonl::read_lines;
use super::{Trace, TraceError, TraceFormat, TraceRequest};
use std::io::BufRead;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Line {
    arrival_s: f64,
    input_tokens: u32,
    output_tokens: u32,
    #[serde(default)]
    block_ids: Vec<u64>,
    block_tokens: Option<u32>,
}

/// Reads a native JSONL trace, skipping (and recording) malformed lines.
///
/// # Errors
/// [`TraceError::Io`] when reading fails.
pub fn read(reader: impl BufRead) -> Result<Trace, TraceError> {
    let mut block_tokens: Option<u32> = None;
    let (requests, skipped) = read_lines(reader, |l: Line| {
        if !(l.arrival_s.is_finite() && l.arrival_s >= 0.0) {
            return Err(format!("arrival_s must be a non-negative number of seconds, got {}", l.arrival_s));
        }
        let bt = l.block_tokens.unwrap_or(512);
        if bt == 0 {
            return Err("block_tokens must be at least 1".into());
        }
        if !l.block_ids.is_empty() {
            match block_tokens {
                Some(b) if b != bt => return Err(format!("block_tokens {bt} differs from earlier lines' {b}")),
                _ => block_tokens = Some(bt),
            }
        }
        Ok(TraceRequest {
            arrival_s: l.arrival_s,
            input_tokens: l.input_tokens,
            output_tokens: l.output_tokens,
            block_ids: l.block_ids,
            max_tokens: None,
            group: None,
        })
    })?;
    Ok(Trace { format: TraceFormat::Native, block_tokens, requests, skipped })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_requests_and_reports_bad_lines() {
        let text = concat!(
            "{\"arrival_s\": 2.0, \"input_tokens\": 1000, \"output_tokens\": 10, \"block_ids\": [1, 2], \"block_tokens\": 512}\n",
            "{\"arrival_s\": 1.5, \"input_tokens\": 20, \"output_tokens\": 5}\n",
            "{\"arrival_s\": -1, \"input_tokens\": 20, \"output_tokens\": 5}\n",
            "{\"arrival_s\": 3, \"input_tokens\": 20, \"output_tokens\": 5, \"block_ids\": [4], \"block_tokens\": 16}\n",
            "{\"arrival_s\": 3, \"input_tokens\": 20, \"output_tokens\": 5, \"prompt\": \"hi\"}\n",
        );
        let t = read(text.as_bytes()).unwrap();
        assert_eq!((t.format, t.block_tokens, t.requests.len()), (TraceFormat::Native, Some(512), 2));
        assert_eq!(t.requests[0].arrival_s, 0.0);
        assert_eq!(t.requests[1].arrival_s, 0.5);
        let lines: Vec<(u64, &str)> = t.skipped.iter().map(|e| (e.line, e.reason.as_str())).collect();
        assert_eq!(lines[0], (3, "arrival_s must be a non-negative number of seconds, got -1"));
        assert_eq!(lines[1], (4, "block_tokens 16 differs from earlier lines' 512"));
        assert!(lines[2].1.starts_with("unknown field `prompt`"), "{}", lines[2].1);
    }
}

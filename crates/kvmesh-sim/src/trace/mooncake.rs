//! Mooncake FAST'25 traces (kvcache-ai/Mooncake `FAST25-release/traces/*.jsonl`).
//!
//! One JSON object per line: `{"timestamp": ms since trace start, "input_length": tokens,
//! "output_length": tokens, "hash_ids": [ids of 512-token blocks]}`. An id names the whole
//! prefix up to and including its block, so two requests share a cacheable prefix exactly as
//! long as their leading ids are equal. The last block is partial: `len(hash_ids) ==
//! ⌈input_length / 512⌉`. Blank lines are ignored; unknown keys are allowed.

use super::jsonl::read_lines;
use super::{Trace, TraceError, TraceFormat, TraceRequest};
use std::io::BufRead;

/// Tokens per `hash_ids` block.
pub const BLOCK_TOKENS: u32 = 512;

#[derive(serde::Deserialize)]
struct Line {
    timestamp: u64,
    input_length: u32,
    output_length: u32,
    #[serde(default)]
    hash_ids: Vec<u64>,
}

/// Reads a Mooncake JSONL trace, skipping (and recording) malformed lines.
///
/// # Errors
/// [`TraceError::Io`] when reading fails.
pub fn read(reader: impl BufRead) -> Result<Trace, TraceError> {
    let (requests, skipped) = read_lines(reader, |l: Line| {
        let want = l.input_length.div_ceil(BLOCK_TOKENS) as usize;
        if !l.hash_ids.is_empty() && l.hash_ids.len() != want {
            return Err(format!(
                "{} hash_ids for input_length {} (expected ⌈{}/512⌉ = {want})",
                l.hash_ids.len(),
                l.input_length,
                l.input_length
            ));
        }
        Ok(TraceRequest {
            arrival_s: l.timestamp as f64 / 1000.0,
            input_tokens: l.input_length,
            output_tokens: l.output_length,
            block_ids: l.hash_ids,
            max_tokens: None,
            group: None,
        })
    })?;
    Ok(Trace { format: TraceFormat::Mooncake, block_tokens: Some(BLOCK_TOKENS), requests, skipped })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_requests_and_reports_bad_lines_by_number() {
        let text = concat!(
            "{\"timestamp\": 1000, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [0, 1]}\n",
            "\n",
            "{\"timestamp\": 1500, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0, 1]}\n",
            "not json\n",
            "{\"timestamp\": 4000, \"input_length\": 512, \"output_length\": 7, \"hash_ids\": [0], \"extra\": 1}\n",
            "{\"timestamp\": 900, \"input_length\": 1, \"output_length\": 1, \"hash_ids\": [3]}\n",
        );
        let t = read(text.as_bytes()).unwrap();
        assert_eq!(t.requests.len(), 3);
        // The unsorted last line is kept; arrivals count from the earliest (900 ms).
        assert_eq!(t.requests[0].block_ids, vec![3]);
        assert_eq!(
            t.requests[2],
            TraceRequest {
                arrival_s: 3.1,
                input_tokens: 512,
                output_tokens: 7,
                block_ids: vec![0],
                max_tokens: None,
                group: None
            }
        );
        let lines: Vec<u64> = t.skipped.iter().map(|e| e.line).collect();
        assert_eq!(lines, vec![3, 4]);
        assert_eq!(t.skipped[0].reason, "2 hash_ids for input_length 10 (expected ⌈10/512⌉ = 1)");
        assert!(t.skipped[1].reason.starts_with("expected ident at line 1 column 2"), "{}", t.skipped[1].reason);
    }
}

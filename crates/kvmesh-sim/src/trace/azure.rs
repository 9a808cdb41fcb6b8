//! Azure LLM inference traces 2023 (Azure/AzurePublicDataset
//! `data/AzureLLMInferenceTrace_{code,conv}.csv`; Patel et al., "Splitwise", ISCA 2024;
//! CC-BY-4.0).
//!
//! Header `TIMESTAMP,ContextTokens,GeneratedTokens`; TIMESTAMP is a wall-clock string with up
//! to 9 fractional digits (`2023-11-16 18:17:03.9799600`). No prefix information.

use super::{LineError, Trace, TraceError, TraceFormat, TraceRequest};
use chrono::NaiveDateTime;
use std::io::Read;

/// The expected header.
pub const HEADER: [&str; 3] = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"];

/// Reads an Azure LLM CSV trace, skipping (and recording) malformed rows.
///
/// # Errors
/// [`TraceError::BadHeader`] when the header differs; [`TraceError::Io`] when reading fails.
pub fn read(reader: impl Read) -> Result<Trace, TraceError> {
    let mut csv = csv::ReaderBuilder::new().has_headers(true).flexible(true).from_reader(reader);
    let header = csv.headers().map_err(csv_io)?.clone();
    if header.iter().map(str::trim).ne(HEADER) {
        return Err(TraceError::BadHeader(header.iter().collect::<Vec<_>>().join(",")));
    }
    let mut rows = Vec::new();
    let mut skipped = Vec::new();
    for record in csv.records() {
        let record = match record {
            Ok(r) => r,
            Err(e) => {
                let line = e.position().map_or(0, |p| p.line());
                skipped.push(LineError { line, reason: e.to_string() });
                continue;
            }
        };
        let line = record.position().map_or(0, |p| p.line());
        match parse_row(&record) {
            Ok(row) => rows.push(row),
            Err(reason) => skipped.push(LineError { line, reason }),
        }
    }
    rows.sort_by_key(|r| r.0);
    let first = rows.first().map(|r| r.0);
    let requests = rows
        .into_iter()
        .map(|(at, input, output)| TraceRequest {
            arrival_s: first.map_or(0.0, |f| (at - f).num_microseconds().unwrap_or(0) as f64 / 1e6),
            input_tokens: input,
            output_tokens: output,
            block_ids: Vec::new(),
            max_tokens: None,
            group: None,
        })
        .collect();
    Ok(Trace { format: TraceFormat::Azure, block_tokens: None, requests, skipped })
}

fn parse_row(r: &csv::StringRecord) -> Result<(NaiveDateTime, u32, u32), String> {
    if r.len() != 3 {
        return Err(format!("expected 3 fields, found {}", r.len()));
    }
    let at = NaiveDateTime::parse_from_str(r[0].trim(), "%Y-%m-%d %H:%M:%S%.f")
        .map_err(|e| format!("bad TIMESTAMP {:?}: {e}", &r[0]))?;
    let num = |i: usize, name: &str| r[i].trim().parse::<u32>().map_err(|e| format!("bad {name} {:?}: {e}", &r[i]));
    Ok((at, num(1, "ContextTokens")?, num(2, "GeneratedTokens")?))
}

fn csv_io(e: csv::Error) -> TraceError {
    TraceError::Io { path: String::new(), source: std::io::Error::other(e.to_string()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_rows_relative_to_the_first_and_reports_bad_ones() {
        let text = "TIMESTAMP,ContextTokens,GeneratedTokens\n\
                    2023-11-16 18:15:46.6805900,374,44\n\
                    2023-11-16 18:15:50.9951690,396,109\n\
                    yesterday,1,2\n\
                    2023-11-16 18:15:51.0000000,-3,2\n\
                    2023-11-16 18:15:52.0000000,5\n";
        let t = read(text.as_bytes()).unwrap();
        assert_eq!(t.requests.len(), 2);
        assert_eq!(t.requests[0].arrival_s, 0.0);
        assert!((t.requests[1].arrival_s - 4.314579).abs() < 1e-9);
        assert_eq!(t.requests[1].input_tokens, 396);
        let lines: Vec<u64> = t.skipped.iter().map(|e| e.line).collect();
        assert_eq!(lines, vec![4, 5, 6]);
        assert!(t.skipped[0].reason.starts_with("bad TIMESTAMP \"yesterday\""), "{}", t.skipped[0].reason);
        assert_eq!(t.skipped[1].reason, "bad ContextTokens \"-3\": invalid digit found in string");
        assert_eq!(t.skipped[2].reason, "expected 3 fields, found 2");
    }

    #[test]
    fn wrong_header_is_an_error() {
        let err = read("a,b,c\n1,2,3\n".as_bytes()).unwrap_err();
        assert_eq!(err.to_string(), "bad header: expected `TIMESTAMP,ContextTokens,GeneratedTokens`, found `a,b,c`");
    }
}

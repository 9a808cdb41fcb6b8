//! The line loop shared by the JSON Lines trace formats: read, skip blank lines, parse, and
//! record each bad line with its number instead of failing the trace.

use super::{LineError, TraceError, TraceRequest};
use serde::de::DeserializeOwned;
use std::io::BufRead;

/// Parses every non-blank line of `reader` as `T` and turns it into a request with `convert`
/// (which may refuse a line with a reason). Returns the requests sorted by arrival, arrivals
/// counted from the earliest (a trace need not be sorted), and the skipped lines.
///
/// # Errors
/// [`TraceError::Io`] when reading fails.
pub(crate) fn read_lines<T: DeserializeOwned>(
    reader: impl BufRead,
    mut convert: impl FnMut(T) -> Result<TraceRequest, String>,
) -> Result<(Vec<TraceRequest>, Vec<LineError>), TraceError> {
    let (mut requests, mut skipped) = (Vec::new(), Vec::new());
    for (n, line) in reader.lines().enumerate() {
        let text = line.map_err(|e| TraceError::Io { path: String::new(), source: e })?;
        if text.trim().is_empty() {
            continue;
        }
        let parsed = serde_json::from_str::<T>(&text).map_err(|e| e.to_string()).and_then(&mut convert);
        match parsed {
            Ok(r) => requests.push(r),
            Err(reason) => skipped.push(LineError { line: n as u64 + 1, reason }),
        }
    }
    let first = requests.iter().map(|r| r.arrival_s).fold(f64::INFINITY, f64::min);
    for r in &mut requests {
        r.arrival_s -= first;
    }
    requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    Ok((requests, skipped))
}

//! Public LLM serving traces, read into one [`Trace`] shape.
//!
//! | format | file | per request | prefix information |
//! |---|---|---|---|
//! | [Mooncake](mooncake) JSONL | `*.jsonl` | arrival (ms), input and output tokens, `hash_ids` | prefix-chained ids of 512-token blocks |
//! | [Azure LLM 2023](azure) CSV | `*.csv` | wall-clock arrival, context and generated tokens | none |
//! | [kvmesh native](native) JSONL | `*.jsonl` with `arrival_s` keys | arrival (s), input and output tokens, optional `block_ids` | optional prefix-chained ids |
//!
//! Malformed lines are skipped and kept in [`Trace::skipped`] with their 1-based line numbers,
//! so one bad line does not hide a whole trace; [`load`] fails only when the file cannot be
//! read, its format is unknown, or no line is usable.

pub mod azure;
mod error;
mod jsonl;
pub mod mooncake;
pub mod native;

pub use error::{LineError, TraceError};

use std::fs::File;
use std::io::BufReader;
use std::path::Path;

/// The environment variable naming the folder of public traces (default `../shared/traces`).
pub const TRACES_ENV: &str = "KVMESH_TRACES";

/// The public traces folder: `$KVMESH_TRACES`, else `../shared/traces`.
pub fn traces_dir() -> std::path::PathBuf {
    std::env::var_os(TRACES_ENV).map_or_else(|| "../shared/traces".into(), Into::into)
}

/// Which format a trace file is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceFormat {
    /// Mooncake FAST'25 JSONL.
    Mooncake,
    /// Azure LLM inference trace 2023 CSV.
    Azure,
    /// kvmesh's own JSONL.
    Native,
}

/// One request of a trace.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceRequest {
    /// Arrival, seconds since the trace's first request.
    pub arrival_s: f64,
    /// Prompt length, tokens.
    pub input_tokens: u32,
    /// Output length, tokens.
    pub output_tokens: u32,
    /// Prefix-chained block ids (Mooncake `hash_ids`, blocks of [`Trace::block_tokens`]
    /// tokens); empty when the format has no prefix information.
    pub block_ids: Vec<u64>,
    /// The client's `max_tokens`, when the trace gives one (its generated scenarios: the RL
    /// rollouts' cap); `None` for the public traces.
    pub max_tokens: Option<u32>,
    /// The group the request belongs to (an RL step: the rollouts a trainer waits for
    /// together), when the trace has groups; `None` otherwise.
    pub group: Option<u32>,
}

/// A loaded trace.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The file's format.
    pub format: TraceFormat,
    /// Tokens per block of `block_ids` (512 for Mooncake); `None` without prefix information.
    pub block_tokens: Option<u32>,
    /// Requests in arrival order.
    pub requests: Vec<TraceRequest>,
    /// Lines that could not be used, with why.
    pub skipped: Vec<LineError>,
}

impl TraceFormat {
    /// The format of `path`, by extension (`.jsonl`/`.json` → Mooncake, `.csv` → Azure); a
    /// JSONL file whose first request has an `arrival_s` key is kvmesh's native format (see
    /// [`load`]).
    ///
    /// # Errors
    /// [`TraceError::UnknownFormat`] for any other extension.
    pub fn of(path: &Path) -> Result<Self, TraceError> {
        match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("jsonl" | "json") => Ok(TraceFormat::Mooncake),
            Some("csv") => Ok(TraceFormat::Azure),
            _ => Err(TraceError::UnknownFormat(path.display().to_string())),
        }
    }
}

/// Reads the trace at `path`, in the format its extension names.
///
/// # Errors
/// [`TraceError::Io`] when the file cannot be opened or read, [`TraceError::UnknownFormat`],
/// [`TraceError::Empty`] when no line holds a usable request.
pub fn load(path: &Path) -> Result<Trace, TraceError> {
    if path.is_dir() {
        return Err(TraceError::IsDirectory(path.display().to_string()));
    }
    // A missing file is that, whatever its name says.
    if let Err(e) = std::fs::metadata(path) {
        return Err(TraceError::Io { path: path.display().to_string(), source: e });
    }
    let format = TraceFormat::of(path)?;
    let file = File::open(path).map_err(|e| TraceError::Io { path: path.display().to_string(), source: e })?;
    let mut reader = BufReader::new(file);
    let format = if format == TraceFormat::Mooncake && first_line_has(&mut reader, "\"arrival_s\"") {
        TraceFormat::Native
    } else {
        format
    };
    let trace = match format {
        TraceFormat::Mooncake => mooncake::read(reader),
        TraceFormat::Azure => azure::read(reader),
        TraceFormat::Native => native::read(reader),
    }
    .map_err(|e| match e {
        TraceError::Io { source, .. } => TraceError::Io { path: path.display().to_string(), source },
        other => other,
    })?;
    if trace.requests.is_empty() {
        return Err(TraceError::Empty { path: path.display().to_string(), skipped: trace.skipped });
    }
    Ok(trace)
}

/// Whether the first non-blank line of `reader` contains `needle` (without consuming it).
fn first_line_has(reader: &mut impl std::io::BufRead, needle: &str) -> bool {
    let Ok(buf) = reader.fill_buf() else { return false };
    let text = String::from_utf8_lossy(buf);
    text.lines().find(|l| !l.trim().is_empty()).is_some_and(|l| l.contains(needle))
}

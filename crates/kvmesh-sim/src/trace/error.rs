//! Trace reading errors: whole-file failures, and per-line problems that skip a line.

use std::fmt;

/// A line that was skipped, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LineError {
    /// 1-based line number in the file (the CSV header is line 1).
    pub line: u64,
    /// What is wrong with it.
    pub reason: String,
}

impl fmt::Display for LineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.reason)
    }
}

/// Why a trace could not be read at all.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("cannot read trace {path}")]
    Io {
        /// The file.
        path: String,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The extension names no known format.
    #[error("unknown trace format for {0}: expected a .jsonl (Mooncake or kvmesh JSONL) or an Azure LLM .csv file")]
    UnknownFormat(String),
    /// The path is a directory.
    #[error("{0} is a directory, not a trace file")]
    IsDirectory(String),
    /// The CSV header is not the Azure trace's.
    #[error("bad header: expected `TIMESTAMP,ContextTokens,GeneratedTokens`, found `{0}`")]
    BadHeader(String),
    /// No line held a usable request.
    #[error("trace {path} has no usable request ({} lines skipped{})", skipped.len(), first(skipped))]
    Empty {
        /// The file.
        path: String,
        /// Every skipped line.
        skipped: Vec<LineError>,
    },
}

fn first(skipped: &[LineError]) -> String {
    skipped.first().map_or_else(String::new, |e| format!("; first: {e}"))
}

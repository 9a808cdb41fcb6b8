//! Decoding errors: a truncated message is "incomplete", anything else invalid is "malformed".

/// Why a message or payload did not decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// The bytes end before the value they started does (a truncated frame or payload). The
    /// same bytes with more appended might decode.
    #[error("incomplete KV-event message: {0}")]
    Incomplete(String),
    /// The bytes can never decode as a KV-event message (wrong frame count, wrong types,
    /// nesting too deep, trailing bytes, …).
    #[error("malformed KV-event message: {0}")]
    Malformed(String),
}

impl DecodeError {
    /// Whether the input was cut short rather than wrong.
    pub fn is_incomplete(&self) -> bool {
        matches!(self, DecodeError::Incomplete(_))
    }

    pub(crate) fn malformed(what: impl Into<String>) -> Self {
        DecodeError::Malformed(what.into())
    }
}

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
    /// The message is larger, or declares more events or values, than the receiver's
    /// [`crate::DecodeLimits`] allow; refused before decoding.
    #[error("KV-event message over budget: {0}")]
    OverBudget(String),
}

impl DecodeError {
    /// Whether the input was cut short rather than wrong.
    pub fn is_incomplete(&self) -> bool {
        matches!(self, DecodeError::Incomplete(_))
    }

    /// A stable lower-case name of the error's kind (a metrics label): `incomplete`,
    /// `malformed` or `over_budget`.
    pub fn kind(&self) -> &'static str {
        match self {
            DecodeError::Incomplete(_) => "incomplete",
            DecodeError::Malformed(_) => "malformed",
            DecodeError::OverBudget(_) => "over_budget",
        }
    }

    pub(crate) fn malformed(what: impl Into<String>) -> Self {
        DecodeError::Malformed(what.into())
    }
}

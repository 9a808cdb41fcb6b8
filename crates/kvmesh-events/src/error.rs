//! Decoding errors: a truncated message is "incomplete", anything else invalid is "malformed"
//! ([`DecodeError`], the whole message); one event of a batch that does not decode is left out
//! with an [`EventError`] and the others still apply.

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

/// Why one event of a batch was left out ([`crate::SkippedEvent`]). The message names the
/// field as vLLM's `vllm/distributed/kv_events.py` does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EventError {
    /// Neither a map with a string `"type"` nor an array led by a string tag.
    #[error("{0}")]
    NoTag(&'static str),
    /// A tag kvmesh does not know (`BlockStored`, `BlockRemoved`, `AllBlocksCleared` are).
    #[error("unknown event type {0:?}")]
    UnknownType(String),
    /// A required field is absent.
    #[error("{event} without {field}")]
    Missing {
        /// The event's tag.
        event: &'static str,
        /// The field.
        field: &'static str,
    },
    /// A field holds another msgpack type than the one it must.
    #[error("{field} is {found}, not {expected}")]
    WrongType {
        /// The field (`event` for the event itself).
        field: &'static str,
        /// The msgpack type found (`a string`, `nil`, …).
        found: &'static str,
        /// What it must be (`an array`, `an integer`, …).
        expected: &'static str,
    },
    /// A number out of the field's range (a token id over `u32`, a hash over 64 bits, …).
    #[error("{field} {value} is not {expected}")]
    OutOfRange {
        /// The field, as the message names it (`token id`, `group_idx`, …).
        field: &'static str,
        /// The value as sent.
        value: String,
        /// What it must be (`a u32`, `a 64-bit integer`).
        expected: &'static str,
    },
    /// `block_size` is not a positive integer.
    #[error("block_size is not a positive integer")]
    BlockSize,
    /// A string field that is not UTF-8.
    #[error("{0} is not UTF-8")]
    NotUtf8(&'static str),
    /// `extra_keys` has another length than `block_hashes`.
    #[error("extra_keys has {keys} entries for {blocks} blocks")]
    ExtraKeysLength {
        /// Entries of `extra_keys`.
        keys: usize,
        /// Entries of `block_hashes`.
        blocks: usize,
    },
    /// An event pushed over gRPC (`Events.Publish`) that does not convert (kvmesh-proto's
    /// conversion error, as text: this crate does not depend on the wire crate).
    #[error("{0}")]
    Pushed(String),
    /// A medium other than GPU or CPU.
    #[error("unsupported medium {0:?} (kvmesh indexes GPU and CPU)")]
    UnsupportedMedium(String),
}

//! One ZMQ multipart message from an engine's PUB socket: `[topic, seq, payload]`.

use crate::batch::{decode_batch_with, EventBatch};
use crate::budget::DecodeLimits;
use crate::error::DecodeError;

/// A decoded publisher message.
#[derive(Debug, Clone, PartialEq)]
pub struct EventMessage {
    /// The ZMQ topic frame (vLLM's `topic` setting; empty by default).
    pub topic: Vec<u8>,
    /// The publisher's sequence number: +1 per message, from 0 at engine start.
    pub seq: u64,
    /// The decoded payload.
    pub batch: EventBatch,
}

/// Decodes the three frames of one publisher message.
///
/// # Errors
/// [`DecodeError::Malformed`] for a frame count other than 3 or a sequence frame that is not
/// 8 bytes; the payload's errors from [`crate::decode_batch`].
pub fn decode_message<F: AsRef<[u8]>>(frames: &[F]) -> Result<EventMessage, DecodeError> {
    decode_message_with(frames, &DecodeLimits::default())
}

/// [`decode_message`] within `limits`: the frames' total size first, then the payload's
/// declared sizes, both before anything is decoded.
///
/// # Errors
/// As [`decode_message`], and [`DecodeError::OverBudget`].
pub fn decode_message_with<F: AsRef<[u8]>>(frames: &[F], limits: &DecodeLimits) -> Result<EventMessage, DecodeError> {
    check_size(frames, limits)?;
    let [topic, seq, payload] = frames else {
        return Err(DecodeError::malformed(format!("{} frames, expected 3: [topic, seq, payload]", frames.len())));
    };
    Ok(EventMessage {
        topic: topic.as_ref().to_vec(),
        seq: seq_number(seq.as_ref())?,
        batch: decode_batch_with(payload.as_ref(), limits)?,
    })
}

/// Refuses a message whose frames together exceed `limits.max_message_bytes`.
pub(crate) fn check_size<F: AsRef<[u8]>>(frames: &[F], limits: &DecodeLimits) -> Result<(), DecodeError> {
    let total: usize = frames.iter().map(|f| f.as_ref().len()).fold(0, usize::saturating_add);
    if total > limits.max_message_bytes {
        return Err(DecodeError::OverBudget(format!(
            "message of {total} bytes, over the {}-byte limit",
            limits.max_message_bytes
        )));
    }
    Ok(())
}

/// A sequence frame: a u64, 8 bytes big-endian.
pub(crate) fn seq_number(frame: &[u8]) -> Result<u64, DecodeError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| DecodeError::malformed(format!("sequence frame is {} bytes, expected 8", frame.len())))?;
    Ok(u64::from_be_bytes(bytes))
}

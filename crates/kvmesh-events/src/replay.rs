//! Gap recovery through the publisher's ROUTER replay socket (vLLM `replay_endpoint`).
//!
//! A DEALER sends `["", start_seq (u64 big-endian)]` (the empty delimiter a REQ socket would
//! add). The publisher answers with every buffered message from `start_seq` on, then an end
//! marker whose payload frame is empty. Reply framings differ by vLLM version: after the
//! delimiter, newer publishers send `[topic, seq, payload]` and older ones `[seq, payload]`;
//! both are accepted, as are replies without the delimiter.

use crate::batch::{decode_batch_with, EventBatch};
use crate::budget::DecodeLimits;
use crate::error::DecodeError;
use crate::message::{check_size, seq_number};

/// The frames of a replay request for every message from `start_seq` on.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

/// One reply from the replay socket.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplayReply {
    /// A buffered message.
    Message {
        /// Its sequence number.
        seq: u64,
        /// Its payload.
        batch: EventBatch,
    },
    /// The end marker: nothing more to replay.
    End,
}

/// Decodes one replay reply (2 to 4 frames, see the module docs).
///
/// # Errors
/// [`DecodeError::Malformed`] for fewer than 2 or more than 4 frames or a bad sequence frame;
/// the payload's errors from [`crate::decode_batch`].
pub fn decode_replay_reply<F: AsRef<[u8]>>(frames: &[F]) -> Result<ReplayReply, DecodeError> {
    decode_replay_reply_with(frames, &DecodeLimits::default())
}

/// [`decode_replay_reply`] within `limits` (as [`crate::decode_message_with`]).
///
/// # Errors
/// As [`decode_replay_reply`], and [`DecodeError::OverBudget`].
pub fn decode_replay_reply_with<F: AsRef<[u8]>>(
    frames: &[F],
    limits: &DecodeLimits,
) -> Result<ReplayReply, DecodeError> {
    check_size(frames, limits)?;
    if !(2..=4).contains(&frames.len()) {
        return Err(DecodeError::malformed(format!(
            "replay reply of {} frames, expected [\"\", topic?, seq, payload]",
            frames.len()
        )));
    }
    let payload = frames[frames.len() - 1].as_ref();
    if payload.is_empty() {
        return Ok(ReplayReply::End);
    }
    let seq = seq_number(frames[frames.len() - 2].as_ref())?;
    Ok(ReplayReply::Message { seq, batch: decode_batch_with(payload, limits)? })
}

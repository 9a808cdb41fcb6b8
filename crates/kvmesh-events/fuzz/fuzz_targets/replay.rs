//! Any bytes as the answers of an engine's replay socket: the input is cut into replies of up
//! to four frames each (lengths taken from its bytes), each decoded under tight limits and the
//! default ones, as the node does. Decoding may fail but must never panic, and a reply under
//! the tight limits never decodes to more events than they allow.
#![no_main]

use kvmesh_events::{decode_replay_reply_with, DecodeLimits, ReplayReply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let tight = DecodeLimits { max_message_bytes: 4096, max_events: 8, max_elements: 256 };
    let mut rest = data;
    while let Some((&n, tail)) = rest.split_first() {
        let frames_in_reply = (n % 4) as usize + 1;
        let mut frames = Vec::with_capacity(frames_in_reply);
        let mut cur = tail;
        for _ in 0..frames_in_reply {
            let Some((&len, t)) = cur.split_first() else { break };
            let len = (len as usize).min(t.len());
            frames.push(&t[..len]);
            cur = &t[len..];
        }
        if let Ok(ReplayReply::Message { batch, .. }) = decode_replay_reply_with(&frames, &tight) {
            assert!(batch.events.len() + batch.skipped.len() <= tight.max_events);
        }
        let _ = decode_replay_reply_with(&frames, &DecodeLimits::default());
        if cur.len() == rest.len() {
            break;
        }
        rest = cur;
    }
});

//! Any bytes, as a payload, as the frames of a message and as a replay reply: decoding may
//! fail but must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvmesh_events::decode_batch(data);
    // Split the input into up to four frames at positions taken from its first bytes.
    let mut frames = Vec::new();
    let mut start = 0;
    for &b in data.iter().take(3) {
        let end = (b as usize % (data.len() + 1)).max(start);
        frames.push(&data[start..end]);
        start = end;
    }
    frames.push(&data[start..]);
    let _ = kvmesh_events::decode_message(&frames);
    let _ = kvmesh_events::decode_replay_reply(&frames);
});

//! Unit tests of `frame_guard`.

use super::*;

fn frame(more: bool, body: usize) -> Vec<u8> {
    let mut f = Vec::new();
    if body > 255 {
        f.push(0b10 | more as u8);
        f.extend_from_slice(&(body as u64).to_be_bytes());
    } else {
        f.push(more as u8);
        f.push(body as u8);
    }
    f.resize(f.len() + body, 0xc0);
    f
}

/// Feeds `stream` in chunks of `step`: what is forwarded and how many messages dropped,
/// or the cut.
fn run(limits: DecodeLimits, stream: &[u8], step: usize) -> Result<(Vec<u8>, u64), Cut> {
    let (mut f, mut out, mut dropped) = (Frames::new(limits), Vec::new(), 0);
    for chunk in stream.chunks(step) {
        dropped += f.feed(chunk, &mut out)?.dropped;
    }
    Ok((out, dropped))
}

#[test]
fn frames_and_messages_are_capped_wherever_the_reads_split() {
    let mut stream = vec![0xffu8; 64];
    stream.extend(frame(true, 0));
    stream.extend(frame(true, 8));
    stream.extend(frame(false, 300));
    // Fed a byte at a time or whole, the same verdict, and every byte forwarded in order.
    for step in [1, 7, stream.len()] {
        assert_eq!(run(cap(308), &stream, step), Ok((stream.clone(), 0)));
    }
    assert_eq!(run(cap(307), &stream, 5), Err(Cut("a message of 308 bytes or more, over the 307-byte limit".into())));
}

#[test]
fn a_huge_declared_frame_is_refused_at_its_header() {
    let mut stream = vec![0u8; 64];
    stream.push(0b10);
    stream.extend_from_slice(&(1u64 << 50).to_be_bytes());
    assert_eq!(
        run(DecodeLimits::default(), &stream, stream.len()),
        Err(Cut(format!("a frame of {} bytes, over the 8388608-byte limit", 1u64 << 50)))
    );
    // Commands (READY, …) count against the frame cap but are not message parts.
    let mut s = vec![0u8; 64];
    s.extend([0b100, 10]);
    s.extend([0u8; 10]);
    s.extend(frame(false, 10));
    assert_eq!(run(cap(10), &s, s.len()), Ok((s.clone(), 0)));
}

fn cap(bytes: usize) -> DecodeLimits {
    DecodeLimits { max_message_bytes: bytes, ..DecodeLimits::default() }
}

/// A vLLM message `[topic "", seq, payload]` as ZMTP frames.
fn message(payload: &[u8]) -> Vec<u8> {
    let mut m = frame(true, 0);
    m.extend(frame(true, 8));
    let mut last = frame(false, payload.len());
    let start = last.len() - payload.len();
    last[start..].copy_from_slice(payload);
    m.extend(last);
    m
}

#[test]
fn a_message_declaring_too_many_events_is_left_out_whole_and_the_stream_goes_on() {
    let limits = DecodeLimits { max_events: 1000, ..DecodeLimits::default() };
    let sound = message(&kvmesh_events::encode::encode_nil_batch(1.0, 1000));
    let hostile = message(&kvmesh_events::encode::encode_nil_batch(1.0, 100_000));
    let greeting = vec![0u8; 64];
    let stream = [&greeting[..], &sound, &hostile, &sound, &hostile, &hostile, &sound].concat();
    let forwarded = [&greeting[..], &sound, &sound, &sound].concat();
    for step in [1, 13, 4096, stream.len()] {
        assert_eq!(run(limits, &stream, step), Ok((forwarded.clone(), 3)), "step {step}");
    }
    // Nothing of a message is forwarded before its payload is judged: the topic and seq
    // frames wait, the sound payload follows them at once.
    let (mut f, mut out) = (Frames::new(limits), Vec::new());
    let upto_payload = greeting.len() + 2 + 10 + 9;
    f.feed(&stream[..upto_payload + 10], &mut out).unwrap();
    assert_eq!(out, greeting);
    f.feed(&stream[upto_payload + 10..upto_payload + PAYLOAD_PREFIX], &mut out).unwrap();
    assert_eq!(out, stream[..upto_payload + PAYLOAD_PREFIX]);
}

#[test]
fn only_a_last_frame_is_judged_and_commands_pass_a_dropped_message() {
    // The same over-budget header in a MORE frame or a command passes (the decoder judges
    // those); in the last frame its whole message is left out.
    let header = [0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff];
    let with_body = |flags: u8| {
        let mut f = vec![flags, header.len() as u8];
        f.extend_from_slice(&header);
        f
    };
    let greeting = [0u8; 64];
    let sound = [&greeting[..], &with_body(0b001), &with_body(0b100), &frame(false, 3)].concat();
    // A command passes at once, ahead of the message it came in the middle of.
    let reordered = [&greeting[..], &with_body(0b100), &with_body(0b001), &frame(false, 3)].concat();
    assert_eq!(run(DecodeLimits::default(), &sound, 3), Ok((reordered, 0)));
    // A payload shorter than the 64-byte prefix is judged at its end, however it is split;
    // a command between its frames still passes.
    let hostile = [&greeting[..], &with_body(0b001), &with_body(0b100), &with_body(0b000), &frame(false, 3)].concat();
    let forwarded = [&greeting[..], &with_body(0b100), &frame(false, 3)].concat();
    for step in [1, 2, 5, hostile.len()] {
        assert_eq!(run(DecodeLimits::default(), &hostile, step), Ok((forwarded.clone(), 1)), "step {step}");
    }
    // An empty payload is the decoder's to refuse: forwarded.
    let empty = [&greeting[..], &frame(true, 0), &frame(false, 0)].concat();
    assert_eq!(run(DecodeLimits::default(), &empty, 1), Ok((empty.clone(), 0)));
}

//! Booking deltas and summaries (`kvmesh.v1.Gossip`) ↔ [`kvmesh_core::gossip`] types.

use crate::convert::ConvertError;
use crate::v1;
use kvmesh_core::gossip::{Delta, DeltaKind, Summary, SummaryEntry};
use kvmesh_core::load::BookingSpec;
use kvmesh_core::BlockHash;

/// The longest age a received delta is believed, seconds: beyond the peer timeout anyway, and
/// a bound on what a broken or hostile peer can claim.
pub const MAX_AGE_S: f64 = 3600.0;

/// An age from the wire: absent, negative or not finite is 0 (the arrival); at most
/// [`MAX_AGE_S`].
fn received_age(age_s: Option<f64>) -> f64 {
    age_s.filter(|a| a.is_finite() && *a > 0.0).map_or(0.0, |a| a.min(MAX_AGE_S))
}

/// `d` on the wire in a batch built at `now` (the sender's node seconds): its age, not its
/// time, since nodes' clocks differ.
pub fn delta_to_proto(d: &Delta, now: f64) -> v1::BookingDelta {
    let mut out =
        v1::BookingDelta { seq: d.seq, booking: d.booking, age_s: Some((now - d.at).max(0.0)), ..Default::default() };
    match &d.kind {
        DeltaKind::Book { replica, spec, prefix } => {
            out.kind = v1::booking_delta::Kind::Book as i32;
            out.replica = replica.clone();
            out.uncached_prefill_tokens = spec.uncached_prefill_tokens;
            out.uncached_blocks = spec.uncached_blocks;
            out.expected_output_tokens = spec.expected_output_tokens;
            out.output_key = spec.output_key;
            out.reestimate_up_to = spec.reestimate_up_to;
            out.prefix = prefix.iter().map(|h| h.0).collect();
        }
        DeltaKind::FirstToken => out.kind = v1::booking_delta::Kind::FirstToken as i32,
        DeltaKind::Release { output_tokens } => {
            out.kind = v1::booking_delta::Kind::Release as i32;
            out.output_tokens = *output_tokens;
        }
    }
    out
}

/// A delta received at `now` (the receiver's node seconds), timed `age_s` before it.
///
/// # Errors
/// An unknown kind.
pub fn delta_from_proto(d: v1::BookingDelta, now: f64) -> Result<Delta, ConvertError> {
    let at = now - received_age(d.age_s);
    let kind = match v1::booking_delta::Kind::try_from(d.kind) {
        Ok(v1::booking_delta::Kind::Book) => DeltaKind::Book {
            spec: BookingSpec {
                uncached_prefill_tokens: d.uncached_prefill_tokens,
                uncached_blocks: d.uncached_blocks,
                expected_output_tokens: d.expected_output_tokens,
                // A peer's first token reaches this node late, or (non-streamed) not at all.
                reports_first_token: false,
                output_key: d.output_key,
                reestimate_up_to: d.reestimate_up_to,
            },
            replica: d.replica,
            prefix: d.prefix.into_iter().map(BlockHash).collect(),
        },
        Ok(v1::booking_delta::Kind::FirstToken) => DeltaKind::FirstToken,
        Ok(v1::booking_delta::Kind::Release) => DeltaKind::Release { output_tokens: d.output_tokens },
        _ => return Err(ConvertError::UnknownEnum { field: "BookingDelta.kind", value: d.kind }),
    };
    Ok(Delta { seq: d.seq, booking: d.booking, kind, at })
}

/// `s` on the wire, built at `now` (the sender's node seconds).
pub fn summary_to_proto(s: &Summary, now: f64) -> v1::BookingSummary {
    v1::BookingSummary {
        seq: s.seq,
        live: s
            .live
            .iter()
            .map(|e| v1::SummaryBooking {
                booking: e.booking,
                replica: e.replica.clone(),
                uncached_prefill_tokens: e.spec.uncached_prefill_tokens,
                uncached_blocks: e.spec.uncached_blocks,
                expected_output_tokens: e.spec.expected_output_tokens,
                first_token: e.first_token,
                age_s: Some((now - e.booked_at).max(0.0)),
                output_key: e.spec.output_key,
                reestimate_up_to: e.spec.reestimate_up_to,
            })
            .collect(),
    }
}

/// A summary received at `now` (the receiver's node seconds).
pub fn summary_from_proto(s: v1::BookingSummary, now: f64) -> Summary {
    Summary {
        seq: s.seq,
        live: s
            .live
            .into_iter()
            .map(|e| SummaryEntry {
                booking: e.booking,
                replica: e.replica,
                spec: BookingSpec {
                    uncached_prefill_tokens: e.uncached_prefill_tokens,
                    uncached_blocks: e.uncached_blocks,
                    expected_output_tokens: e.expected_output_tokens,
                    reports_first_token: false,
                    output_key: e.output_key,
                    reestimate_up_to: e.reestimate_up_to,
                },
                first_token: e.first_token,
                booked_at: now - received_age(e.age_s),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_and_summaries_round_trip_with_their_age() {
        let spec = BookingSpec {
            uncached_prefill_tokens: 1000,
            uncached_blocks: 63,
            expected_output_tokens: 200,
            reports_first_token: false,
            output_key: Some(u64::MAX - 7),
            reestimate_up_to: Some(8192),
        };
        let book = DeltaKind::Book { replica: "vllm-3".into(), spec, prefix: vec![BlockHash(u64::MAX), BlockHash(1)] };
        let deltas = [
            Delta { seq: 1, booking: 9, kind: book, at: 10.0 },
            Delta { seq: 2, booking: 9, kind: DeltaKind::FirstToken, at: 10.5 },
            Delta { seq: 3, booking: 9, kind: DeltaKind::Release { output_tokens: Some(17) }, at: 12.0 },
            Delta { seq: 4, booking: 8, kind: DeltaKind::Release { output_tokens: None }, at: 12.0 },
        ];
        // Built at 12.0 on the sender, received at 100.0 on the receiver: as old on arrival.
        for d in deltas {
            let wire = delta_to_proto(&d, 12.0);
            assert_eq!(wire.age_s, Some(12.0 - d.at));
            assert_eq!(delta_from_proto(wire, 100.0).unwrap(), Delta { at: 100.0 - (12.0 - d.at), ..d });
        }
        let entry = SummaryEntry { booking: 3, replica: "a".into(), spec, first_token: true, booked_at: 7.0 };
        let summary = Summary { seq: 44, live: vec![entry.clone()] };
        let back = summary_from_proto(summary_to_proto(&summary, 9.0), 50.0);
        assert_eq!(back, Summary { seq: 44, live: vec![SummaryEntry { booked_at: 48.0, ..entry }] });
        let bad = v1::BookingDelta { kind: 0, ..Default::default() };
        assert_eq!(
            delta_from_proto(bad, 0.0).unwrap_err(),
            ConvertError::UnknownEnum { field: "BookingDelta.kind", value: 0 }
        );
    }

    #[test]
    fn ages_from_the_wire_are_bounded() {
        let at = |age_s: Option<f64>| {
            let wire =
                v1::BookingDelta { kind: v1::booking_delta::Kind::FirstToken as i32, age_s, ..Default::default() };
            delta_from_proto(wire, 10_000.0).unwrap().at
        };
        // An older sender (no age), a negative or non-finite one: the arrival.
        for age in [None, Some(-5.0), Some(f64::NAN), Some(f64::INFINITY)] {
            assert_eq!(at(age), 10_000.0, "{age:?}");
        }
        assert_eq!(at(Some(2.5)), 9_997.5);
        assert_eq!(at(Some(1e9)), 10_000.0 - MAX_AGE_S);
    }
}

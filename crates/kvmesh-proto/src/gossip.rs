//! Booking deltas and summaries (`kvmesh.v1.Gossip`) ↔ [`kvmesh_core::gossip`] types.

use crate::convert::ConvertError;
use crate::v1;
use kvmesh_core::gossip::{Delta, DeltaKind, Summary, SummaryEntry};
use kvmesh_core::load::BookingSpec;
use kvmesh_core::BlockHash;

impl From<&Delta> for v1::BookingDelta {
    fn from(d: &Delta) -> Self {
        let mut out = v1::BookingDelta { seq: d.seq, booking: d.booking, ..Default::default() };
        match &d.kind {
            DeltaKind::Book { replica, spec, prefix } => {
                out.kind = v1::booking_delta::Kind::Book as i32;
                out.replica = replica.clone();
                out.uncached_prefill_tokens = spec.uncached_prefill_tokens;
                out.uncached_blocks = spec.uncached_blocks;
                out.expected_output_tokens = spec.expected_output_tokens;
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
}

impl TryFrom<v1::BookingDelta> for Delta {
    type Error = ConvertError;

    fn try_from(d: v1::BookingDelta) -> Result<Self, ConvertError> {
        let kind = match v1::booking_delta::Kind::try_from(d.kind) {
            Ok(v1::booking_delta::Kind::Book) => DeltaKind::Book {
                spec: BookingSpec {
                    uncached_prefill_tokens: d.uncached_prefill_tokens,
                    uncached_blocks: d.uncached_blocks,
                    expected_output_tokens: d.expected_output_tokens,
                    // A peer's first token reaches this node late, or (non-streamed) not at all.
                    reports_first_token: false,
                },
                replica: d.replica,
                prefix: d.prefix.into_iter().map(BlockHash).collect(),
            },
            Ok(v1::booking_delta::Kind::FirstToken) => DeltaKind::FirstToken,
            Ok(v1::booking_delta::Kind::Release) => DeltaKind::Release { output_tokens: d.output_tokens },
            _ => return Err(ConvertError::UnknownEnum { field: "BookingDelta.kind", value: d.kind }),
        };
        Ok(Delta { seq: d.seq, booking: d.booking, kind })
    }
}

impl From<&Summary> for v1::BookingSummary {
    fn from(s: &Summary) -> Self {
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
                })
                .collect(),
        }
    }
}

impl From<v1::BookingSummary> for Summary {
    fn from(s: v1::BookingSummary) -> Self {
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
                    },
                    first_token: e.first_token,
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deltas_and_summaries_round_trip() {
        let spec = BookingSpec {
            uncached_prefill_tokens: 1000,
            uncached_blocks: 63,
            expected_output_tokens: 200,
            reports_first_token: false,
        };
        let deltas = [
            Delta {
                seq: 1,
                booking: 9,
                kind: DeltaKind::Book {
                    replica: "vllm-3".into(),
                    spec,
                    prefix: vec![BlockHash(u64::MAX), BlockHash(1)],
                },
            },
            Delta { seq: 2, booking: 9, kind: DeltaKind::FirstToken },
            Delta { seq: 3, booking: 9, kind: DeltaKind::Release { output_tokens: Some(17) } },
            Delta { seq: 4, booking: 8, kind: DeltaKind::Release { output_tokens: None } },
        ];
        for d in deltas {
            assert_eq!(Delta::try_from(v1::BookingDelta::from(&d)).unwrap(), d);
        }
        let summary =
            Summary { seq: 44, live: vec![SummaryEntry { booking: 3, replica: "a".into(), spec, first_token: true }] };
        assert_eq!(Summary::from(v1::BookingSummary::from(&summary)), summary);
        let bad = v1::BookingDelta { kind: 0, ..Default::default() };
        assert_eq!(
            Delta::try_from(bad).unwrap_err(),
            ConvertError::UnknownEnum { field: "BookingDelta.kind", value: 0 }
        );
    }
}

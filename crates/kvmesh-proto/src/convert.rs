//! Conversions between `kvmesh.v1` messages and core types.

use crate::v1;
use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium, ReplicaStatus};

/// A wire event that cannot become a core event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConvertError {
    /// The `event` oneof is not set.
    #[error("KvEvent without an event (set stored, removed or cleared)")]
    EmptyEvent,
    /// An enum field holds a value this build does not know.
    #[error("unknown {field} value {value}")]
    UnknownEnum {
        /// The field.
        field: &'static str,
        /// Its raw value.
        value: i32,
    },
}

/// A wire medium → core medium.
///
/// # Errors
/// [`ConvertError::UnknownEnum`] for values newer than this build.
pub fn medium(raw: i32) -> Result<Medium, ConvertError> {
    match v1::Medium::try_from(raw) {
        Ok(v1::Medium::Gpu) => Ok(Medium::Gpu),
        Ok(v1::Medium::Cpu) => Ok(Medium::Cpu),
        Err(_) => Err(ConvertError::UnknownEnum { field: "medium", value: raw }),
    }
}

impl TryFrom<v1::KvEvent> for KvEvent {
    type Error = ConvertError;

    fn try_from(e: v1::KvEvent) -> Result<Self, ConvertError> {
        use v1::kv_event::Event;
        match e.event.ok_or(ConvertError::EmptyEvent)? {
            Event::Stored(s) => Ok(KvEvent::Stored(Stored {
                block_hashes: s.block_hashes.into_iter().map(EngineBlockHash).collect(),
                parent: s.parent_block_hash.map(EngineBlockHash),
                token_ids: s.token_ids,
                block_size: s.block_size,
                medium: medium(s.medium)?,
                lora_name: s.lora_name,
                extra_keys: None,
                kv_group: None,
            })),
            Event::Removed(r) => Ok(KvEvent::Removed(Removed {
                block_hashes: r.block_hashes.into_iter().map(EngineBlockHash).collect(),
                medium: medium(r.medium)?,
                kv_group: None,
            })),
            Event::Cleared(_) => Ok(KvEvent::Cleared),
        }
    }
}

impl From<&KvEvent> for v1::KvEvent {
    fn from(e: &KvEvent) -> Self {
        use v1::kv_event::Event;
        let wire_medium = |m: Medium| match m {
            Medium::Gpu => v1::Medium::Gpu as i32,
            Medium::Cpu => v1::Medium::Cpu as i32,
        };
        let event = match e {
            KvEvent::Stored(s) => Event::Stored(v1::BlockStored {
                block_hashes: s.block_hashes.iter().map(|h| h.0).collect(),
                parent_block_hash: s.parent.map(|h| h.0),
                token_ids: s.token_ids.clone(),
                block_size: s.block_size,
                medium: wire_medium(s.medium),
                lora_name: s.lora_name.clone(),
            }),
            KvEvent::Removed(r) => Event::Removed(v1::BlockRemoved {
                block_hashes: r.block_hashes.iter().map(|h| h.0).collect(),
                medium: wire_medium(r.medium),
            }),
            KvEvent::Cleared => Event::Cleared(v1::AllBlocksCleared {}),
        };
        v1::KvEvent { event: Some(event) }
    }
}

impl From<ReplicaStatus> for v1::ReplicaStatus {
    fn from(s: ReplicaStatus) -> Self {
        match s {
            ReplicaStatus::Ready => v1::ReplicaStatus::Ready,
            ReplicaStatus::Draining => v1::ReplicaStatus::Draining,
            ReplicaStatus::Starting => v1::ReplicaStatus::Starting,
            ReplicaStatus::OutOfSync => v1::ReplicaStatus::OutOfSync,
            ReplicaStatus::NoEvents => v1::ReplicaStatus::NoEvents,
            ReplicaStatus::BlockSizeMismatch => v1::ReplicaStatus::BlockSizeMismatch,
            ReplicaStatus::Unhealthy => v1::ReplicaStatus::Unhealthy,
            ReplicaStatus::Overloaded => v1::ReplicaStatus::Overloaded,
            ReplicaStatus::BadEvents => v1::ReplicaStatus::BadEvents,
            ReplicaStatus::Removed => v1::ReplicaStatus::Removed,
        }
    }
}

impl TryFrom<v1::ReplicaStatus> for ReplicaStatus {
    type Error = ConvertError;

    fn try_from(s: v1::ReplicaStatus) -> Result<Self, ConvertError> {
        Ok(match s {
            v1::ReplicaStatus::Unspecified => {
                return Err(ConvertError::UnknownEnum { field: "ReplicaStatus", value: s as i32 })
            }
            v1::ReplicaStatus::Ready => ReplicaStatus::Ready,
            v1::ReplicaStatus::Draining => ReplicaStatus::Draining,
            v1::ReplicaStatus::Starting => ReplicaStatus::Starting,
            v1::ReplicaStatus::OutOfSync => ReplicaStatus::OutOfSync,
            v1::ReplicaStatus::NoEvents => ReplicaStatus::NoEvents,
            v1::ReplicaStatus::BlockSizeMismatch => ReplicaStatus::BlockSizeMismatch,
            v1::ReplicaStatus::Unhealthy => ReplicaStatus::Unhealthy,
            v1::ReplicaStatus::Overloaded => ReplicaStatus::Overloaded,
            v1::ReplicaStatus::BadEvents => ReplicaStatus::BadEvents,
            v1::ReplicaStatus::Removed => ReplicaStatus::Removed,
        })
    }
}

/// A message's raw `ReplicaStatus` field (an `i32` on the wire) as the core's status.
///
/// # Errors
/// [`ConvertError::UnknownEnum`]: unset, or a value this build does not know (a newer server).
pub fn replica_status(raw: i32) -> Result<ReplicaStatus, ConvertError> {
    let wire = v1::ReplicaStatus::try_from(raw)
        .map_err(|_| ConvertError::UnknownEnum { field: "ReplicaStatus", value: raw })?;
    ReplicaStatus::try_from(wire)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_status_has_its_own_wire_value_named_as_in_the_metrics_and_comes_back() {
        let mut all = kvmesh_core::ReplicaStatus::OBSERVED.to_vec();
        all.push(kvmesh_core::ReplicaStatus::Removed);
        for s in all {
            let wire = v1::ReplicaStatus::from(s);
            assert_eq!(wire.as_str_name().trim_start_matches("REPLICA_STATUS_").to_lowercase(), s.as_str());
            assert_eq!(super::replica_status(wire as i32), Ok(s));
        }
        assert_eq!(super::replica_status(0), Err(ConvertError::UnknownEnum { field: "ReplicaStatus", value: 0 }));
        assert_eq!(super::replica_status(99), Err(ConvertError::UnknownEnum { field: "ReplicaStatus", value: 99 }));
    }

    use super::*;

    #[test]
    fn events_round_trip_and_bad_ones_are_named() {
        let stored = KvEvent::Stored(Stored {
            block_hashes: vec![EngineBlockHash(u64::MAX), EngineBlockHash(1)],
            parent: Some(EngineBlockHash(7)),
            token_ids: (0..8).collect(),
            block_size: 4,
            medium: Medium::Cpu,
            lora_name: Some("sql".into()),
            extra_keys: None,
            kv_group: None,
        });
        let removed =
            KvEvent::Removed(Removed { block_hashes: vec![EngineBlockHash(1)], medium: Medium::Gpu, kv_group: None });
        for e in [stored, removed, KvEvent::Cleared] {
            assert_eq!(KvEvent::try_from(v1::KvEvent::from(&e)), Ok(e));
        }
        assert_eq!(KvEvent::try_from(v1::KvEvent { event: None }), Err(ConvertError::EmptyEvent));
        let bad = v1::KvEvent {
            event: Some(v1::kv_event::Event::Removed(v1::BlockRemoved { block_hashes: vec![], medium: 9 })),
        };
        assert_eq!(KvEvent::try_from(bad).unwrap_err().to_string(), "unknown medium value 9");
    }

    #[test]
    fn descriptor_set_names_every_service() {
        use prost::Message;
        let fds = prost_types_shim::decode(crate::FILE_DESCRIPTOR_SET);
        for service in ["Router", "Admin", "Events"] {
            assert!(fds.contains(&service.to_string()), "{service} missing from {fds:?}");
        }
        let _ = v1::RouteRequest::default().encode_to_vec();
    }

    /// Service names from the encoded descriptor set, without depending on prost-types.
    mod prost_types_shim {
        use prost::Message;

        #[derive(Clone, PartialEq, prost::Message)]
        struct Set {
            #[prost(message, repeated, tag = "1")]
            file: Vec<File>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        struct File {
            #[prost(message, repeated, tag = "6")]
            service: Vec<Service>,
        }
        #[derive(Clone, PartialEq, prost::Message)]
        struct Service {
            #[prost(string, tag = "1")]
            name: String,
        }

        pub fn decode(bytes: &[u8]) -> Vec<String> {
            let set = Set::decode(bytes).expect("descriptor set decodes");
            set.file.into_iter().flat_map(|f| f.service.into_iter().map(|s| s.name)).collect()
        }
    }
}

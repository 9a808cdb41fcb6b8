//! Conversions between `kvmesh.v1` messages and core types.

use crate::v1;
use kvmesh_core::index::{KvEvent, Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};

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

#[cfg(test)]
mod tests {
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

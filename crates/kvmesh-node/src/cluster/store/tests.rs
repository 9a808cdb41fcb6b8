//! Unit tests of `store`.

use super::super::registry::Command;
use super::*;
use kvmesh_core::ReplicaStatus;
use openraft::{CommittedLeaderId, EntryPayload, Membership};
use std::collections::BTreeSet;

fn entry(index: u64, payload: EntryPayload<TypeConfig>) -> Entry<TypeConfig> {
    Entry { log_id: LogId::new(CommittedLeaderId::new(1, 1), index), payload }
}

#[tokio::test]
async fn vote_state_and_snapshot_survive_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (mut log, mut sm) = open(dir.path()).unwrap();
        assert!(!log.initialized());
        log.save_vote(&Vote::new(3, 2)).await.unwrap();
        let members = Membership::new(vec![BTreeSet::from([1, 2, 3])], None);
        let seed = Command::Seed { replicas: vec![], policy: "kv_cost".into(), params: Default::default() };
        let drain = Command::SetReplicaState { name: "x".into(), state: ReplicaStatus::Draining, from: None };
        let results = sm
            .apply([
                entry(1, EntryPayload::Membership(members)),
                entry(2, EntryPayload::Normal(seed)),
                entry(3, EntryPayload::Normal(drain)),
            ])
            .await
            .unwrap();
        assert_eq!(results[1].error, None);
        assert_eq!(results[2].error.as_deref(), Some("unknown replica \"x\""));
        let snap = sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
        assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(3));
        log.purge(LogId::new(CommittedLeaderId::new(1, 1), 3)).await.unwrap();
    }
    // sled's background flusher may hold the file lock a moment after the drop.
    let (mut log, mut sm) = (0..100)
        .find_map(|_| open(dir.path()).map_err(|_| std::thread::sleep(std::time::Duration::from_millis(20))).ok())
        .expect("the store reopens");
    assert!(log.initialized());
    assert_eq!(log.read_vote().await.unwrap(), Some(Vote::new(3, 2)));
    let state = log.get_log_state().await.unwrap();
    assert_eq!(state.last_purged_log_id.map(|l| l.index), Some(3));
    assert_eq!(state.last_log_id.map(|l| l.index), Some(3));
    let (applied, membership) = sm.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(3));
    assert_eq!(membership.membership().voter_ids().collect::<Vec<_>>(), vec![1, 2, 3]);
    assert_eq!(sm.subscribe().borrow().policy.as_deref(), Some("kv_cost"));
    assert_eq!(sm.get_current_snapshot().await.unwrap().map(|s| s.meta.snapshot_id), Some("3-1".to_string()));
}

#[test]
fn a_corrupt_value_is_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(open(dir.path()).unwrap());
    {
        // What a torn write or a flipped bit leaves: a value whose checksum does not match.
        // sled's background flusher may hold the file lock a moment after the drop.
        let db = (0..100)
            .find_map(|_| {
                sled::open(dir.path().join("raft.sled"))
                    .map_err(|_| std::thread::sleep(std::time::Duration::from_millis(20)))
                    .ok()
            })
            .expect("the store reopens");
        let mut bad = encode(&serde_json::json!({"vote": 1}));
        bad[6] ^= 0x20;
        db.open_tree("meta").unwrap().insert(VOTE, bad).unwrap();
        db.flush().unwrap();
    }
    let err = (0..100)
        .map(|_| open(dir.path()).err().expect("a corrupt store must not open").to_string())
        .find(|e| {
            let locked = e.contains("lock");
            if locked {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
            !locked
        })
        .expect("the store opens past the lock");
    assert!(err.contains("is corrupt (meta key") && err.contains("checksum mismatch"), "{err}");
    assert!(err.contains("kvmesh cluster leave"), "{err}");
}

#[test]
fn values_round_trip_and_short_or_bad_values_fail() {
    let v = encode(&vec![1u64, 2, 3]);
    assert_eq!(decode::<Vec<u64>>(&v).unwrap(), vec![1, 2, 3]);
    let short = decode::<u64>(&v[..3]).unwrap_err();
    assert!(matches!(short, Corrupt::Short(3)));
    assert_eq!(short.to_string(), "value of 3 bytes is shorter than its checksum");
    let mut flipped = v.clone();
    flipped[4] ^= 1;
    assert!(matches!(decode::<Vec<u64>>(&flipped).unwrap_err(), Corrupt::Checksum));
    // A good checksum over what is not this type's JSON.
    assert!(matches!(decode::<u64>(&encode(&"text")).unwrap_err(), Corrupt::Json(_)));
}

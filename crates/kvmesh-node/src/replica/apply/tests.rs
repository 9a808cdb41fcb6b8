//! Applying batches: the published index and the core's record, stale targets, the metrics.

use super::*;
use kvmesh_core::index::{Removed, Stored};
use kvmesh_core::{EngineBlockHash, Medium};

fn node() -> Shared {
    let shared = crate::state::test_node(Default::default());
    add(&shared);
    shared
}

fn add(shared: &Shared) {
    let replica =
        "name = \"e\"\nhttp = \"http://127.0.0.1:9\"\nkv_events = \"tcp://127.0.0.1:9\"\ncapacity_blocks = 100";
    shared.add_replica(toml::from_str(replica).unwrap()).unwrap();
}

/// Applies `events` as message `seq` of replica `e`, looked up now.
fn apply(shared: &Shared, seq: u64, events: Vec<KvEvent>) -> (Problems, u64) {
    let target = shared.core().replicas.get("e").map(Target::of).unwrap();
    apply_to(shared, "e", &target, seq, batch(events))
}

fn batch(events: Vec<KvEvent>) -> EventBatch {
    EventBatch { ts: 0.0, events, data_parallel_rank: None, skipped: Vec::new() }
}

/// Two 16-token blocks (the node's default block size), engine ids 1 and 2.
fn store() -> KvEvent {
    KvEvent::Stored(Stored {
        block_hashes: vec![EngineBlockHash(1), EngineBlockHash(2)],
        parent: None,
        token_ids: (0..32).collect(),
        block_size: 16,
        medium: Medium::Gpu,
        lora_name: None,
        extra_keys: None,
        kv_group: None,
    })
}

fn remove_unknown() -> KvEvent {
    KvEvent::Removed(Removed { block_hashes: vec![EngineBlockHash(99)], medium: Medium::Gpu, kv_group: None })
}

#[test]
fn a_batch_goes_to_the_published_index_and_the_core_records_it_once() {
    let shared = node();
    let id = shared.core().replicas["e"].id;
    // A store, and a removal of a block never seen (a sound stream's, after a clear): one
    // applied, one refused, no bad event.
    let (problems, applied) = apply(&shared, 7, vec![store(), remove_unknown()]);
    assert_eq!((problems.events, applied), (0, 1));
    assert_eq!(shared.index.read().replica_blocks(id), 2);
    let core = shared.core();
    let s = core.replicas["e"].stream.lock().clone();
    assert_eq!((s.events_applied, s.events_rejected, s.last_seq), (1, 1, Some(7)));
    let state = core.fleet.replica(id).unwrap();
    assert_eq!((state.last_event_at.is_some(), state.events_usable), (true, true));
    drop(core);
    // An empty batch moves the sequence on and touches nothing else.
    assert_eq!(apply(&shared, 8, Vec::new()).1, 0);
    let s = shared.core().replicas["e"].stream.lock().clone();
    assert_eq!((s.events_applied, s.last_seq), (1, Some(8)));
}

#[test]
fn a_batch_for_a_replica_removed_and_added_again_meanwhile_touches_neither() {
    let shared = node();
    let target = shared.core().replicas.get("e").map(Target::of).unwrap();
    let old = target.id;
    shared.remove_replica("e").unwrap();
    add(&shared);
    let new = shared.core().replicas["e"].id;
    assert_ne!(old, new);
    let (_, applied) = apply_to(&shared, "e", &target, 3, batch(vec![store()]));
    assert_eq!(applied, 0);
    let index = shared.index.read();
    assert_eq!((index.replica_blocks(old), index.replica_blocks(new)), (0, 0));
    drop(index);
    let s = shared.core().replicas["e"].stream.lock().clone();
    assert_eq!((s.events_applied, s.events_rejected, s.last_seq), (0, 0, None));
    // An empty batch, which reaches the core's record, leaves the new replica alone too.
    apply_to(&shared, "e", &target, 4, batch(Vec::new()));
    assert_eq!(shared.core().replicas["e"].last_event_at, None);
    // The same batch for the replica as registered now is heard.
    apply(&shared, 4, Vec::new());
    assert!(shared.core().replicas["e"].last_event_at.is_some());
}

#[test]
fn a_quarantine_or_resync_through_a_stale_target_leaves_the_new_replica_alone() {
    let shared = node();
    let stale = shared.core().replicas.get("e").map(Target::of).unwrap();
    shared.remove_replica("e").unwrap();
    add(&shared);
    let fresh = shared.core().replicas.get("e").map(Target::of).unwrap();
    assert_eq!(apply_to(&shared, "e", &fresh, 0, batch(vec![store()])).1, 1);
    shared.index.write().set_partial_history(fresh.id, true);

    let until = shared.now() + 60.0;
    quarantine(&shared, "e", &stale, until);
    resync_by_clearing(&shared, "e", &stale, "restart");
    set_partial_history(&shared, "e", &stale, false);

    // The new replica keeps its blocks, its history mark, its stream record and its status.
    assert_eq!(shared.index.read().replica_blocks(fresh.id), 2);
    assert!(shared.index.write().index().history_is_partial(fresh.id));
    let core = shared.core();
    let s = core.replicas["e"].stream.lock().clone();
    assert_eq!((s.bad_events_until, s.last_seq, s.events_applied), (None, Some(0), 1));
    assert_eq!(core.status(&core.replicas["e"], shared.now()), kvmesh_core::ReplicaStatus::Ready);
    drop(core);
    // Only the old, unregistered record heard of the quarantine.
    assert_eq!(stale.stream().lock().bad_events_until, Some(until));

    // Through the replica as registered now, the same quarantine takes hold.
    quarantine(&shared, "e", &fresh, until);
    assert_eq!(shared.index.read().replica_blocks(fresh.id), 0);
    let core = shared.core();
    assert_eq!(core.status(&core.replicas["e"], shared.now()), kvmesh_core::ReplicaStatus::BadEvents);
}

#[test]
fn applied_events_count_in_the_replica_s_series_by_kind() {
    let shared = node();
    let target = shared.core().replicas.get("e").map(Target::of).unwrap();
    let series = |kind: &str| {
        shared.metrics.events_applied.get_or_create(&vec![("replica", "e".into()), ("kind", kind.into())]).get()
    };
    apply_to(&shared, "e", &target, 1, batch(vec![store()]));
    // The same target again (its counters kept), and a new one (looked up afresh).
    apply_to(&shared, "e", &target, 2, batch(vec![KvEvent::Cleared]));
    apply(&shared, 3, vec![store(), store()]);
    // A kind never applied has no series (the lookup below would make one).
    let listed = |kind: &str| {
        let mut page = String::new();
        prometheus_client::encoding::text::encode(&mut page, &shared.metrics.registry).unwrap();
        page.contains(&format!("replica=\"e\",kind=\"{kind}\""))
    };
    assert_eq!((listed("stored"), listed("removed"), listed("cleared")), (true, false, true));
    assert_eq!((series("stored"), series("removed"), series("cleared")), (3, 0, 1));
}

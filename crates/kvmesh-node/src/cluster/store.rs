//! Raft storage on disk: the log, the vote and the state machine in one sled database,
//! implementing openraft 0.9's v2 storage traits (`storage-v2`).
//!
//! Rules (sled 0.34 and openraft's durability contract; see `../shared/LIBRARIES.md` §2–3):
//! - Every value carries a CRC32 of its JSON; a mismatch is a corrupt store, refused at open.
//! - Writes are durable before openraft hears of them: the synchronous `Db::flush()` runs
//!   before `save_vote` returns and before the `append` callback fires (never `flush_async`,
//!   which deadlocks in sled 0.34).
//! - Purge writes its marker before deleting entries, so a crash leaves no hole.
//! - A snapshot install replaces the state machine and the stored snapshot in one batch.
//! - The state machine is flushed after each applied batch, so a snapshot (built from applied
//!   state) never covers more than the disk holds; the snapshot builder stores only a snapshot
//!   newer than the stored one and never writes the state (it runs beside `apply`).
//! - fsyncs run on the blocking pool, not on the async workers.

// openraft's trait methods return its `StorageError` (224 bytes); the helpers return the same.
#![allow(clippy::result_large_err)]

use super::registry::{ClusterState, CommandResult};
use super::TypeConfig;
use openraft::storage::{LogFlushed, LogState, RaftLogStorage, RaftStateMachine, Snapshot};
use openraft::{
    BasicNode, Entry, EntryPayload, LogId, RaftLogReader, RaftSnapshotBuilder, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership, Vote,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::fmt::Debug;
use std::io::Cursor;
use std::ops::{Bound, RangeBounds};
use std::path::Path;
use std::sync::Arc;
use tokio::sync::watch;

type NodeId = u64;
type StoreResult<T> = Result<T, StorageError<NodeId>>;

/// A value on disk: CRC32 (big-endian) of the JSON, then the JSON.
fn encode<T: Serialize>(v: &T) -> Vec<u8> {
    // Every stored type is plain data (derive(Serialize) over maps with string keys).
    let json = serde_json::to_vec(v).unwrap_or_default();
    let mut out = Vec::with_capacity(json.len() + 4);
    out.extend_from_slice(&crc32fast::hash(&json).to_be_bytes());
    out.extend_from_slice(&json);
    out
}

/// Why a stored value cannot be read back (a torn write, a disk fault, another version's data).
#[derive(Debug, thiserror::Error)]
enum Corrupt {
    #[error("value of {0} bytes is shorter than its checksum")]
    Short(usize),
    #[error("checksum mismatch")]
    Checksum,
    #[error("not the JSON this version stores: {0}")]
    Json(#[from] serde_json::Error),
}

/// Reverses [`encode`].
fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, Corrupt> {
    if bytes.len() < 4 {
        return Err(Corrupt::Short(bytes.len()));
    }
    let (crc, json) = bytes.split_at(4);
    let want = u32::from_be_bytes([crc[0], crc[1], crc[2], crc[3]]);
    if crc32fast::hash(json) != want {
        return Err(Corrupt::Checksum);
    }
    Ok(serde_json::from_slice(json)?)
}

/// `Db::flush` (an fsync) off the async workers: a slow disk must not stall request handling
/// or Raft heartbeats. Never `flush_async`, which deadlocks in sled 0.34.
async fn flush(db: &sled::Db) -> StoreResult<()> {
    let db = db.clone();
    match tokio::task::spawn_blocking(move || db.flush()).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(write_err(e)),
        Err(e) => Err(write_err(e)),
    }
}

fn io_err(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

fn read_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::read(&io_err(e)).into()
}

fn write_err(e: impl std::fmt::Display) -> StorageError<NodeId> {
    StorageIOError::write(&io_err(e)).into()
}

const VOTE: &str = "vote";
const COMMITTED: &str = "committed";
const LAST_PURGED: &str = "last_purged";
const STATE: &str = "state";
const SNAPSHOT: &str = "snapshot";

/// How long [`open_waiting`] waits for a store whose lock is still held.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// [`open`], waiting up to 5 s while the store's lock is held: a node stopped in this process
/// (or a process still exiting) may be closing it, its lock going with the last of its
/// handles. A store another live node holds is refused after the wait.
///
/// # Errors
/// As [`open`]; a lock still held after the wait, asking whether another node uses `dir`.
pub async fn open_waiting(dir: &Path) -> anyhow::Result<(LogStore, StateMachineStore)> {
    let deadline = tokio::time::Instant::now() + LOCK_WAIT;
    loop {
        match open(dir) {
            Err(e) if format!("{e:#}").contains("could not acquire lock") => {
                if tokio::time::Instant::now() >= deadline {
                    return Err(e.context("is another kvmesh node using this data_dir?"));
                }
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            opened => return opened,
        }
    }
}

/// Opens (or creates) the store in `dir`, checking every stored value's checksum.
///
/// # Errors
/// The directory cannot be opened by sled, or a value is corrupt (the message says which and
/// what to do).
pub fn open(dir: &Path) -> anyhow::Result<(LogStore, StateMachineStore)> {
    std::fs::create_dir_all(dir).map_err(|e| anyhow::anyhow!("creating {}: {e}", dir.display()))?;
    let db = sled::Config::new()
        .path(dir.join("raft.sled"))
        // sled's default cache is 1 GiB and RSS grows to several times it; the Raft state is tiny.
        .cache_capacity(64 << 20)
        .open()
        .map_err(|e| anyhow::anyhow!("opening the Raft store in {}: {e}", dir.display()))?;
    let log = db.open_tree("log")?;
    let meta = db.open_tree("meta")?;
    let sm = db.open_tree("sm")?;
    for (name, tree) in [("log", &log), ("meta", &meta), ("sm", &sm)] {
        for kv in tree.iter() {
            let (k, v) = kv?;
            if let Err(e) = decode::<serde_json::Value>(&v) {
                anyhow::bail!(
                    "the Raft store in {} is corrupt ({name} key {k:?}: {e}); remove this node from the cluster \
                     (`kvmesh cluster leave`), wipe the directory and join it again",
                    dir.display()
                );
            }
        }
    }
    let data = match sm.get(STATE)? {
        Some(v) => decode::<SmData>(&v).map_err(|e| anyhow::anyhow!("state machine: {e}"))?,
        None => SmData::default(),
    };
    let (tx, _) = watch::channel(Arc::new(data.state.clone()));
    let log_store = LogStore { db: db.clone(), log, meta };
    let sm_store = StateMachineStore { db, sm, data, tx: Arc::new(tx), snapshots_built: 0 };
    Ok((log_store, sm_store))
}

/// The Raft log and vote.
#[derive(Clone)]
pub struct LogStore {
    db: sled::Db,
    log: sled::Tree,
    meta: sled::Tree,
}

impl LogStore {
    async fn flush(&self) -> StoreResult<()> {
        flush(&self.db).await
    }

    fn meta_get<T: DeserializeOwned>(&self, key: &str) -> StoreResult<Option<T>> {
        match self.meta.get(key).map_err(read_err)? {
            Some(v) => decode(&v).map(Some).map_err(read_err),
            None => Ok(None),
        }
    }

    async fn meta_put<T: Serialize>(&self, key: &str, v: &T) -> StoreResult<()> {
        self.meta.insert(key, encode(v)).map_err(write_err)?;
        self.flush().await
    }

    /// Whether this node was ever part of an initialized cluster (it has a vote or a log).
    #[cfg(test)]
    fn initialized(&self) -> bool {
        self.meta.contains_key(VOTE).unwrap_or(false) || !self.log.is_empty()
    }
}

fn key_bound(b: Bound<&u64>) -> Bound<[u8; 8]> {
    match b {
        Bound::Included(i) => Bound::Included(i.to_be_bytes()),
        Bound::Excluded(i) => Bound::Excluded(i.to_be_bytes()),
        Bound::Unbounded => Bound::Unbounded,
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(
        &mut self,
        range: RB,
    ) -> StoreResult<Vec<Entry<TypeConfig>>> {
        let bounds = (key_bound(range.start_bound()), key_bound(range.end_bound()));
        let mut out = Vec::new();
        for kv in self.log.range::<[u8; 8], _>(bounds) {
            let (_, v) = kv.map_err(read_err)?;
            out.push(decode(&v).map_err(read_err)?);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> StoreResult<LogState<TypeConfig>> {
        let last_purged: Option<LogId<NodeId>> = self.meta_get(LAST_PURGED)?.flatten();
        let last = match self.log.last().map_err(read_err)? {
            Some((_, v)) => Some(decode::<Entry<TypeConfig>>(&v).map_err(read_err)?.log_id),
            None => None,
        };
        Ok(LogState { last_purged_log_id: last_purged, last_log_id: last.or(last_purged) })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> StoreResult<()> {
        self.meta_put(VOTE, vote).await
    }

    async fn read_vote(&mut self) -> StoreResult<Option<Vote<NodeId>>> {
        self.meta_get(VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> StoreResult<()> {
        // Advisory (openraft recomputes it from a quorum): written, flushed with the next write
        // or by sled's 500 ms background flush, not fsynced on its own.
        self.meta.insert(COMMITTED, encode(&committed)).map_err(write_err)?;
        Ok(())
    }

    async fn read_committed(&mut self) -> StoreResult<Option<LogId<NodeId>>> {
        Ok(self.meta_get(COMMITTED)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> StoreResult<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut batch = sled::Batch::default();
        for e in entries {
            batch.insert(&e.log_id.index.to_be_bytes(), encode(&e));
        }
        self.log.apply_batch(batch).map_err(write_err)?;
        let flushed = flush(&self.db).await;
        let failed = flushed.as_ref().err().map(|e| e.to_string());
        callback.log_io_completed(flushed.map_err(io_err));
        match failed {
            Some(e) => Err(write_err(e)),
            None => Ok(()),
        }
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> StoreResult<()> {
        let mut batch = sled::Batch::default();
        for k in self.log.range(log_id.index.to_be_bytes()..).keys() {
            batch.remove(k.map_err(read_err)?);
        }
        self.log.apply_batch(batch).map_err(write_err)?;
        self.flush().await
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> StoreResult<()> {
        // The marker first: a crash between the two steps leaves entries below it, not a hole.
        self.meta_put(LAST_PURGED, &Some(log_id)).await?;
        let mut batch = sled::Batch::default();
        for k in self.log.range(..=log_id.index.to_be_bytes()).keys() {
            batch.remove(k.map_err(read_err)?);
        }
        self.log.apply_batch(batch).map_err(write_err)?;
        self.flush().await
    }
}

/// What the state machine persists: the replicated state and how far it has applied.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SmData {
    last_applied: Option<LogId<NodeId>>,
    last_membership: StoredMembership<NodeId, BasicNode>,
    state: ClusterState,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta<NodeId, BasicNode>,
    data: Vec<u8>,
}

/// The state machine ([`ClusterState`]) and its snapshots. Every change is published on a
/// watch channel ([`StateMachineStore::subscribe`]) for the node to follow.
pub struct StateMachineStore {
    db: sled::Db,
    sm: sled::Tree,
    data: SmData,
    tx: Arc<watch::Sender<Arc<ClusterState>>>,
    snapshots_built: u64,
}

impl StateMachineStore {
    /// The replicated state as applied on this node, now and on every change.
    pub fn subscribe(&self) -> watch::Receiver<Arc<ClusterState>> {
        self.tx.subscribe()
    }

    async fn persist(&self) -> StoreResult<()> {
        self.sm.insert(STATE, encode(&self.data)).map_err(write_err)?;
        flush(&self.db).await
    }
}

/// Builds a snapshot from a copy of the state taken when openraft asked for it.
pub struct SnapshotBuilder {
    db: sled::Db,
    sm: sled::Tree,
    data: SmData,
    id: String,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> StoreResult<Snapshot<TypeConfig>> {
        let data = serde_json::to_vec(&self.data).map_err(read_err)?;
        let meta = SnapshotMeta {
            last_log_id: self.data.last_applied,
            last_membership: self.data.last_membership.clone(),
            snapshot_id: self.id.clone(),
        };
        // The builder runs beside the state machine: `apply` already persisted this state (and
        // maybe newer), and an installed snapshot may be newer than this one. Store it only if
        // it is the newest, atomically, and never touch the state.
        let stored = encode(&StoredSnapshot { meta: meta.clone(), data: data.clone() });
        let mine = meta.last_log_id.map_or(0, |l| l.index);
        loop {
            let current = self.sm.get(SNAPSHOT).map_err(read_err)?;
            if let Some(c) = &current {
                let theirs = decode::<StoredSnapshot>(c).map_err(read_err)?.meta.last_log_id.map_or(0, |l| l.index);
                if theirs >= mine {
                    break;
                }
            }
            match self.sm.compare_and_swap(SNAPSHOT, current, Some(stored.clone())).map_err(write_err)? {
                Ok(()) => break,
                Err(_) => continue,
            }
        }
        flush(&self.db).await?;
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(data)) })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> StoreResult<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>)> {
        Ok((self.data.last_applied, self.data.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> StoreResult<Vec<CommandResult>>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + Send,
        I::IntoIter: Send,
    {
        let mut out = Vec::new();
        for e in entries {
            self.data.last_applied = Some(e.log_id);
            out.push(match e.payload {
                EntryPayload::Blank => CommandResult::default(),
                EntryPayload::Normal(cmd) => self.data.state.apply(&cmd, e.log_id.index),
                EntryPayload::Membership(m) => {
                    self.data.last_membership = StoredMembership::new(Some(e.log_id), m);
                    CommandResult::default()
                }
            });
        }
        self.persist().await?;
        self.tx.send_replace(Arc::new(self.data.state.clone()));
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.snapshots_built += 1;
        let last = self.data.last_applied.map_or(0, |l| l.index);
        SnapshotBuilder {
            db: self.db.clone(),
            sm: self.sm.clone(),
            data: self.data.clone(),
            id: format!("{last}-{}", self.snapshots_built),
        }
    }

    async fn begin_receiving_snapshot(&mut self) -> StoreResult<Box<Cursor<Vec<u8>>>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> StoreResult<()> {
        let bytes = snapshot.into_inner();
        let mut data: SmData = serde_json::from_slice(&bytes).map_err(read_err)?;
        data.last_applied = meta.last_log_id;
        data.last_membership = meta.last_membership.clone();
        let stored = StoredSnapshot { meta: meta.clone(), data: bytes };
        let mut batch = sled::Batch::default();
        batch.insert(SNAPSHOT, encode(&stored));
        batch.insert(STATE, encode(&data));
        self.sm.apply_batch(batch).map_err(write_err)?;
        flush(&self.db).await?;
        self.data = data;
        self.tx.send_replace(Arc::new(self.data.state.clone()));
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> StoreResult<Option<Snapshot<TypeConfig>>> {
        match self.sm.get(SNAPSHOT).map_err(read_err)? {
            Some(v) => {
                let s: StoredSnapshot = decode(&v).map_err(read_err)?;
                Ok(Some(Snapshot { meta: s.meta, snapshot: Box::new(Cursor::new(s.data)) }))
            }
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests;

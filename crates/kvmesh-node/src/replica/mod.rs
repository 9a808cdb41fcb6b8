//! One actor per engine replica, under a supervisor.
//!
//! ```text
//! Supervisor ──spawns/links──► ReplicaActor (one per replica)
//!                                ├─ ingest task: frame guard → ZMQ SUB → budget → decode → seq check (replay | clear)
//!                                │               → index writer → its stream record → core (one short section)
//!                                │               (at subscribe: replay all the engine holds; live copies of
//!                                │               replayed messages skipped, `replayed`; a stream that stays
//!                                │               bad: quarantined, `event_guard`)
//!                                └─ scrape task: GET /metrics → its health record → load + status → core
//! Events.Publish (gRPC) ──────────────► push: budget → seq check (clear) → the same apply, same quarantine
//! ```
//!
//! The actor looks its replica up once, when it starts (`apply::Target`: id, rank, the stream
//! record `crate::state::Stream` and the health record `crate::state::Health`), so a batch's
//! sequence check and bookkeeping, and a scrape's health, need no lookup under the core's
//! lock; what the actor's tasks do to the replica (clear, quarantine, record a scrape) reaches
//! only the replica it started for, never another registered later under the same name.
//!
//! A replica actor fails when one of its tasks dies; the supervisor restarts it (with a
//! backoff and an intensity limit) without touching the others. Adding and removing replicas
//! at runtime starts and stops actors.

pub mod actor;
pub mod adapters;
pub mod apply;
pub mod event_guard;
pub mod frame_guard;
pub mod ingest;
pub mod push;
pub mod replayed;
pub mod scrape;
pub mod supervisor;

pub use supervisor::{Supervisor, SupervisorMsg};

//! kvmesh-core: the pure routing core of kvmesh.
//!
//! - [`hashing`]: token ids → chained [`BlockHash`]es of `block_size`-token blocks.
//! - [`index`]: the [`PrefixIndex`] built from replicas' KV events; overlap queries.
//! - [`record`]: the router's own [`RoutingRecord`] (approximate mode, pending prefixes).
//! - [`load`]: the token-load model — [`Bookings`](load::Bookings), [`TokenLoad`](load::TokenLoad),
//!   engine metrics, step-time profiles and the TTFT estimate.
//! - [`policy`]: every routing [`Policy`], ours (`token_load`) and the published anchors.
//! - [`fleet`]: the [`Fleet`] that ties them together and the per-decision [`FleetView`].
//! - [`autoscale`]: the cold-start-aware autoscaling policy and its baselines.
//! - [`admission`]: admission control's TTFT gate (who may go to a replica while it is overloaded).
//! - [`replication`]: hot-prefix detection, the replication plan, warm-ups.
//! - [`prompt`]: approximate token ids and chat rendering for routers without a tokenizer.
//! - [`seconds`]: serde for `f64`-second settings written as durations (`"250ms"`, `"2s"`).
//!
//! No async runtime, no I/O, no clock and no RNG of its own: time (`now`, seconds on the
//! caller's clock) and randomness are arguments, so the simulator and the node run the same
//! code and a simulation replays from its seed.
//!
//! ```
//! use kvmesh_core::{Fleet, FleetConfig, ReplicaSpec, RouteRequest, PolicyKind};
//! use rand::{rngs::SmallRng, SeedableRng};
//!
//! let mut fleet = Fleet::new(FleetConfig::default()).unwrap();
//! let a = fleet.add_replica(ReplicaSpec::new("vllm-0", 30_000)).unwrap();
//! fleet.add_replica(ReplicaSpec::new("vllm-1", 30_000)).unwrap();
//! let mut policy = PolicyKind::TokenLoad.build();
//! let mut rng = SmallRng::seed_from_u64(7);
//! let tokens: Vec<u32> = (0..100).collect();
//! let req = RouteRequest::new(fleet.hasher(), &tokens, Some(64));
//! let routed = fleet.route(policy.as_mut(), &req, &mut rng, 0.0).unwrap();
//! assert_eq!(routed.decision.uncached_tokens, 100);
//! fleet.first_token(routed.booking, 0.1).unwrap();
//! fleet.release(routed.booking, Some(64)).unwrap();
//! assert!(fleet.bookings().is_empty());
//! # let _ = a;
//! ```

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod admission;
pub mod autoscale;
pub mod error;
pub mod fleet;
pub mod gossip;
pub mod hashing;
pub mod ids;
pub mod index;
pub mod load;
mod overlap;
pub mod policy;
pub mod prompt;
pub mod record;
pub mod replication;
pub mod seconds;
pub mod view;

pub use error::Error;
pub use fleet::{Fleet, PdDecision, PdRouted, Routed};
pub use hashing::{BlockHasher, ModelKey, Namespace};
pub use ids::{BlockHash, EngineBlockHash, Medium, ReplicaId};
pub use index::PrefixIndex;
pub use overlap::Overlap;
pub use policy::{Decision, Policy, PolicyKind, Reason};
pub use record::RoutingRecord;
pub use view::{FleetConfig, FleetView, ReplicaSpec, ReplicaState, ReplicaStatus, Role, RouteRequest};

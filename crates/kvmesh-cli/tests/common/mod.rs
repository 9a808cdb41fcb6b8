//! A node for the CLI's end-to-end tests: one engine-sim behind it, on loopback ports.

// Each test file uses its own subset.
#![allow(dead_code)]

use kvmesh_engine_sim::{EngineSim, EngineSimConfig};
use kvmesh_node::config::{NodeConfig, NodeSection, ReplicaConfig};
use kvmesh_tests::node::{replica, section, single};
use std::time::{Duration, Instant};

/// The engine-sim's KV capacity, blocks of 16 tokens.
pub fn capacity_blocks() -> u64 {
    EngineSimConfig::default().profile.kv_blocks(16)
}

/// A single node's config in front of `engine` (replica `e0`) at engine speed `speed`.
pub fn config(engine: &EngineSim, speed: f64) -> NodeConfig {
    // No replay socket: `replica add` in the tests registers the same endpoints without one.
    single(NodeSection { engine_speed: speed, ..section() }, vec![ReplicaConfig { replay: None, ..replica(0, engine) }])
}

/// Waits (up to 10 s) until `node` routes to a replica.
pub async fn routable(node: &kvmesh_node::Node) {
    let t0 = Instant::now();
    while !node.shared.core().fleet.replicas().iter().any(|r| r.routable()) {
        assert!(t0.elapsed() < Duration::from_secs(10), "the replica never turned ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

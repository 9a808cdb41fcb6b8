//! A node for the CLI's end-to-end tests: one engine-sim behind it, on loopback ports.

use kvmesh_engine_sim::{EngineSim, EngineSimConfig};
use kvmesh_node::config::{NodeConfig, NodeSection, ReplicaConfig};
use std::time::{Duration, Instant};

/// The engine-sim's KV capacity, blocks of 16 tokens.
pub fn capacity_blocks() -> u64 {
    EngineSimConfig::default().profile.kv_blocks(16)
}

/// A single node's config in front of `engine` (replica `e0`) at engine speed `speed`.
pub fn config(engine: &EngineSim, speed: f64) -> NodeConfig {
    let replica = ReplicaConfig {
        name: "e0".into(),
        http: engine.base_url(),
        kv_events: Some(engine.kv_events.clone()),
        replay: None,
        kv_events_bind: false,
        metrics_url: None,
        capacity_blocks: capacity_blocks(),
        engine: "vllm".into(),
        model: None,
        block_size: None,
    };
    NodeConfig {
        node: NodeSection {
            http: "127.0.0.1:0".parse().unwrap(),
            grpc: "127.0.0.1:0".parse().unwrap(),
            scrape_interval_ms: 100,
            engine_speed: speed,
            ..NodeSection::default()
        },
        replicas: vec![replica],
        cluster: None,
        security: Default::default(),
        replication: Default::default(),
        autoscaler: Default::default(),
        admission: Default::default(),
    }
}

/// Waits (up to 10 s) until `node` routes to a replica.
pub async fn routable(node: &kvmesh_node::Node) {
    let t0 = Instant::now();
    while !node.shared.core().fleet.replicas().iter().any(|r| r.routable()) {
        assert!(t0.elapsed() < Duration::from_secs(10), "the replica never turned ready");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

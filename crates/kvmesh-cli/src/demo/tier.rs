//! The demo's serving tier, in this process: engine-sims and a Raft cluster of router nodes on
//! loopback (real HTTP, gRPC, ZMQ and sled), torn down completely by [`Tier::stop`].

use anyhow::Context;
use kvmesh_engine_sim::{EngineSim, EngineSimConfig};
use kvmesh_node::config::{ClusterSection, NodeConfig, NodeSection, ReplicaConfig};
use kvmesh_node::Node;
use std::path::Path;
use std::time::{Duration, Instant};

/// Engines and nodes.
pub struct Tier {
    /// The stand-in engines.
    pub engines: Vec<EngineSim>,
    /// The router nodes.
    pub nodes: Vec<Node>,
}

/// What to start.
pub struct TierSpec<'a> {
    /// Engine replicas.
    pub replicas: usize,
    /// Router nodes (1 = no cluster).
    pub nodes: usize,
    /// Routing policy.
    pub policy: &'a str,
    /// Engine time compression.
    pub speed: f64,
    /// Raft data lives here.
    pub data_dir: &'a Path,
    /// Hot-prefix replication on.
    pub replication: bool,
    /// The autoscaler on.
    pub autoscale: bool,
}

/// `[replication]` for the demo: on when asked, its times compressed like the engines'.
fn replication_section(spec: &TierSpec<'_>) -> kvmesh_node::config::ReplicationSection {
    let d = kvmesh_node::config::ReplicationSection::default();
    let s = spec.speed.max(1e-3);
    let plan = kvmesh_core::replication::ReplicationConfig {
        interval_s: (d.plan.interval_s / s).max(0.02),
        cooldown_s: d.plan.cooldown_s / s,
        grace_ttl_s: d.plan.grace_ttl_s / s,
        warm_timeout_s: d.plan.warm_timeout_s / s,
        min_requests_per_s: d.plan.min_requests_per_s * s,
        sketch: kvmesh_core::replication::SketchConfig { half_life_s: d.plan.sketch.half_life_s / s, ..d.plan.sketch },
        ..d.plan.clone()
    };
    kvmesh_node::config::ReplicationSection { enabled: spec.replication, plan, ..d }
}

/// Free loopback ports (peers must know each other's address before binding), from
/// 20000–31999: below Linux's ephemeral range (32768 up), so that between this check and the
/// node's bind no outgoing connection can be handed one of them as its source port (what
/// `bind(:0)` returns is such a port). Spread by process id, so that demos side by side differ.
fn free_ports(n: usize) -> anyhow::Result<Vec<u16>> {
    let start = (std::process::id() % 600) * 20;
    let mut out = Vec::with_capacity(n);
    for k in 0..12_000u32 {
        let port = 20_000 + ((start + k) % 12_000) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            out.push(port);
            if out.len() == n {
                return Ok(out);
            }
        }
    }
    anyhow::bail!("no {n} free loopback ports in 20000-31999")
}

impl Tier {
    /// Starts the engines, then the nodes, bootstraps the cluster and waits until every node
    /// has a leader and sees every replica ready.
    ///
    /// # Errors
    /// A port or engine that does not come up, or a cluster without a leader after 20 s.
    pub async fn start(spec: &TierSpec<'_>) -> anyhow::Result<Tier> {
        let mut engines = Vec::new();
        for _ in 0..spec.replicas {
            let e = kvmesh_engine_sim::start(EngineSimConfig { speed: spec.speed, ..EngineSimConfig::default() })
                .await
                .context("starting an engine-sim")?;
            engines.push(e);
        }
        let blocks = EngineSimConfig::default().profile.kv_blocks(16);
        let replicas: Vec<ReplicaConfig> = engines
            .iter()
            .enumerate()
            .map(|(i, e)| ReplicaConfig {
                name: format!("e{i}"),
                http: e.base_url(),
                kv_events: Some(e.kv_events.clone()),
                replay: Some(e.replay.clone()),
                kv_events_bind: false,
                metrics_url: None,
                capacity_blocks: blocks,
                engine: "vllm".into(),
                model: None,
                block_size: None,
                data_parallel_rank: None,
                data_parallel_size: None,
                lora_adapters: None,
                role: Default::default(),
                bootstrap_port: None,
            })
            .collect();
        let ports = free_ports(spec.nodes)?;
        let peers: Vec<String> = ports.iter().enumerate().map(|(i, p)| format!("{}=127.0.0.1:{p}", i + 1)).collect();
        let mut nodes = Vec::new();
        for (i, port) in ports.iter().enumerate() {
            let node = NodeSection {
                http: "127.0.0.1:0".parse()?,
                grpc: format!("127.0.0.1:{port}").parse()?,
                policy: spec.policy.to_string(),
                scrape_interval: std::time::Duration::from_millis(200),
                engine_speed: spec.speed,
                ..NodeSection::default()
            };
            let cluster = (spec.nodes > 1).then(|| ClusterSection {
                id: i as u64 + 1,
                peers: peers.clone(),
                data_dir: spec.data_dir.join(format!("node{}", i + 1)),
                insecure: true,
                ..ClusterSection::default()
            });
            let config = NodeConfig {
                node,
                replicas: replicas.clone(),
                cluster,
                security: Default::default(),
                replication: replication_section(spec),
                autoscaler: kvmesh_node::config::AutoscalerSection {
                    enabled: spec.autoscale,
                    policy: kvmesh_core::autoscale::AutoscaleConfig {
                        interval_s: 2.0 / spec.speed.max(1e-3),
                        cold_start_s: 60.0 / spec.speed.max(1e-3),
                        // 0: one (sped-up) cold start.
                        scale_down_delay_s: 0.0,
                        max_replicas: 4 * spec.replicas as u32,
                        ..Default::default()
                    },
                    ..Default::default()
                },
                admission: Default::default(),
                limits: Default::default(),
                epp: Default::default(),
            };
            nodes.push(kvmesh_node::start(config).await.with_context(|| format!("starting router node {}", i + 1))?);
        }
        let tier = Tier { engines, nodes };
        if let Some(c) = tier.nodes[0].cluster.as_ref() {
            c.init().await.map_err(|e| anyhow::anyhow!("cluster init: {e}"))?;
        }
        let t0 = Instant::now();
        while !tier.ready() {
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(20), "the tier did not become ready within 20 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(tier)
    }

    /// Every node knows a leader (in a cluster) and has every replica scraped.
    fn ready(&self) -> bool {
        self.nodes.iter().all(|n| {
            let leader = n.cluster.as_ref().is_none_or(|c| c.leader().is_some());
            let core = n.shared.core();
            leader
                && core.replicas.len() == self.engines.len()
                && core.replicas.values().all(|r| r.health.lock().engine.is_some())
        })
    }

    /// The nodes' OpenAI base URLs.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| format!("http://{}", n.http)).collect()
    }

    /// The leader's node id and the term, if a cluster.
    pub fn leader(&self) -> Option<(u64, u64)> {
        let c = self.nodes[0].cluster.as_ref()?;
        let m = c.raft.metrics().borrow().clone();
        Some((m.current_leader?, m.current_term))
    }

    /// Queued uncached prefill tokens per replica, as the first node sees them (its own and,
    /// through gossip, the other nodes' bookings).
    pub fn token_load(&self) -> Vec<(String, u64)> {
        let core = self.nodes[0].shared.core();
        core.replicas
            .values()
            .map(|r| (r.config.name.clone(), core.fleet.bookings().load(r.id).queued_prefill_tokens))
            .collect()
    }

    /// The autoscaler's evaluation of the last interval (what it would decide now, with the
    /// load just measured), when it is on: committed decisions change only when the count
    /// does, so the latest one's load can be minutes old.
    pub fn scale_decision(&self) -> Option<kvmesh_node::autoscaler::Decision> {
        self.nodes[0].shared.autoscaler.evaluated()
    }

    /// The committed replication plan, when replication is on.
    pub fn replication_plan(&self) -> Option<std::sync::Arc<kvmesh_core::replication::ReplicationPlan>> {
        let shared = &self.nodes[0].shared;
        shared.replication.enabled().then(|| shared.replication.plan())
    }

    /// Stops every node (all at once), then every engine.
    pub async fn stop(self) {
        let mut stopping = tokio::task::JoinSet::new();
        for n in self.nodes {
            stopping.spawn(n.stop());
        }
        while stopping.join_next().await.is_some() {}
        for e in self.engines {
            e.stop().await;
        }
    }

    /// The replicas' names.
    pub fn replica_names(&self) -> Vec<String> {
        (0..self.engines.len()).map(|i| format!("e{i}")).collect()
    }
}

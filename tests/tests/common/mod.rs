//! What the node-level tests share: engine-sims on loopback, replica entries pointing at them,
//! a node section on free loopback ports, free ports for cluster peers, and polling for a
//! condition with a deadline.

// Each test file uses its own subset.
#![allow(dead_code)]

pub mod publisher;

use kvmesh_engine_sim::{EngineSim, EngineSimConfig};
use std::time::{Duration, Instant};

/// `n` engine-sims, `speed` times faster than the H100 profile's step times.
pub async fn engines(n: usize, speed: f64) -> Vec<EngineSim> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(kvmesh_engine_sim::start(EngineSimConfig { speed, ..EngineSimConfig::default() }).await.unwrap());
    }
    out
}

#[allow(unused_imports)]
pub use kvmesh_tests::node::{replica, section, single};

/// Free loopback ports for `n` nodes' gRPC servers (peers must know them before they bind).
///
/// Taken from 20000–31999, below Linux's ephemeral range (32768 up): a port is free when
/// chosen but bound only later by its node, and an ephemeral port (what `bind(:0)` hands out)
/// can meanwhile become another test's outgoing connection ("address already in use"); a port
/// below that range cannot. One counter per test process, so tests running in parallel never
/// get the same port; the process id spreads test binaries apart.
pub fn ports(n: usize) -> Vec<u16> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let port = next_ports(1);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            out.push(port);
        }
    }
    out
}

/// The first of `n` consecutive free loopback ports, taken from the same counter as [`ports`]
/// (so no other test in this process is handed any of them).
pub fn consecutive_ports(n: u16) -> u16 {
    for _ in 0..200 {
        let first = next_ports(n);
        if first + n <= 32_000 && (0..n).all(|k| std::net::TcpListener::bind(("127.0.0.1", first + k)).is_ok()) {
            return first;
        }
    }
    panic!("no {n} consecutive free ports");
}

/// Advances this process's port counter by `n`, returning the first port of the run.
fn next_ports(n: u16) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let offset = (std::process::id() % 600) * 20;
    loop {
        let k = NEXT.fetch_add(u32::from(n), Ordering::Relaxed);
        let first = 20_000 + (offset + k) % 12_000;
        // A run never wraps past 31,999 back to 20,000.
        if first + u32::from(n) <= 32_000 {
            return first as u16;
        }
    }
}

/// One multi-node test at a time in this process (every test that starts a cluster takes it:
/// t06, t10, t11, t12, t22): each starts several nodes, and C12 and the failover tests measure
/// timing among them, which another cluster's nodes on the same two cores would skew by tens of
/// milliseconds.
pub async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// Waits until `ok` holds, polling every 10 ms; panics with `what` after 10 s. Returns the
/// time it took.
pub async fn eventually(what: &str, ok: impl FnMut() -> bool) -> Duration {
    eventually_within(what, 10, ok).await
}

/// [`eventually`] with a deadline of `secs` seconds.
pub async fn eventually_within(what: &str, secs: u64, mut ok: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !ok() {
        assert!(t0.elapsed() < Duration::from_secs(secs), "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    t0.elapsed()
}

/// A gRPC channel to a node's gRPC address.
pub async fn grpc(addr: impl std::fmt::Display) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap()
}

/// Blocks the node's prefix index holds for replica `name` (0 for an unknown one).
pub fn blocks(node: &kvmesh_node::Node, name: &str) -> usize {
    let core = node.shared.core();
    core.replicas.get(name).map_or(0, |r| core.fleet.index().replica_blocks(r.id))
}

/// The lines of the node's metrics page that start with `name`.
pub fn metric(node: &kvmesh_node::Node, name: &str) -> String {
    kvmesh_node::metrics_page::render(&node.shared)
        .lines()
        .filter(|l| l.starts_with(name))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every `kvmesh_*` metric name the shipped dashboard and alert rules use
/// (deploy/observability).
pub fn observability_metrics() -> std::collections::BTreeSet<String> {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/observability");
    let mut named = std::collections::BTreeSet::new();
    for file in ["grafana-dashboard.json", "alerts.yaml"] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        let mut rest = text.as_str();
        while let Some(at) = rest.find("kvmesh_") {
            let tail = &rest[at..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            named.insert(tail[..end].to_string());
            rest = &tail[end..];
        }
    }
    named
}

/// Whether `page` (a metrics page) has a sample named exactly `name` (`kvmesh_requests_total`,
/// `kvmesh_event_lag_seconds_bucket`, `kvmesh_replica_status`): a series a query can select.
pub fn serves(page: &str, name: &str) -> bool {
    page.lines().any(|l| l.strip_prefix(name).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
}

/// A gRPC Route for the token ids `ids` asking for `model` (and LoRA adapter `lora`), with
/// `max_tokens` 4.
pub fn route_request(model: &str, ids: &[u32], lora: Option<&str>) -> kvmesh_proto::v1::RouteRequest {
    use kvmesh_proto::v1;
    v1::RouteRequest {
        model: model.into(),
        prompt: Some(v1::route_request::Prompt::TokenIds(v1::TokenIds { ids: ids.to_vec() })),
        max_tokens: Some(4),
        lora_name: lora.map(str::to_string),
        ..v1::RouteRequest::default()
    }
}

//! Streams this node's booking deltas to every peer: one long-lived `Gossip.Stream` call per
//! peer, fed a batch every `gossip_interval` and a full summary every
//! `summary_interval`. A peer that is down or slow loses batches (bounded queues); the next
//! summary repairs them. Peers are the Raft members.

use crate::cluster::network::channel;
use crate::cluster::Cluster;
use crate::config::ClusterSection;
use crate::state::Shared;
use kvmesh_core::gossip::NodeId;
use kvmesh_proto::v1;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};

/// Batches queued per peer before new ones are dropped.
const PEER_QUEUE: usize = 256;
/// Deltas per batch (a Book with a long prefix is ~4 KiB); the rest go in the next tick.
const MAX_DELTAS_PER_BATCH: usize = 2000;

/// Runs the broadcaster until `stop` turns true.
pub async fn run(shared: Arc<Shared>, cluster: Arc<Cluster>, section: ClusterSection, mut stop: watch::Receiver<bool>) {
    let incarnation: u64 = rand::rngs::SmallRng::from_os_rng().random();
    let mut rng = rand::rngs::SmallRng::from_os_rng();
    let mut tick = tokio::time::interval(section.gossip_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let summary_every = section.summary_interval;
    let mut last_summary =
        tokio::time::Instant::now().checked_sub(summary_every).unwrap_or_else(tokio::time::Instant::now);
    let mut peers: BTreeMap<u64, (String, mpsc::Sender<v1::GossipBatch>)> = BTreeMap::new();
    let report_every = shared.replication.section.interval();
    let mut last_report =
        tokio::time::Instant::now().checked_sub(report_every).unwrap_or_else(tokio::time::Instant::now);
    let mut last_demand = 0.0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.wait_for(|s| *s) => return,
        }
        // A removed node shares nothing with its former peers.
        if cluster.removed() {
            peers.clear();
            continue;
        }
        // Follow membership: start senders for new peers, stop those of departed ones.
        let members = cluster.members();
        peers.retain(|id, (addr, _)| members.get(id) == Some(addr));
        for (id, addr) in &members {
            if *id != cluster.id && !peers.contains_key(id) {
                let (tx, rx) = mpsc::channel(PEER_QUEUE);
                tokio::spawn(peer_sender(*id, addr.clone(), rx, cluster.token.clone(), cluster.tls.clone()));
                peers.insert(*id, (addr.clone(), tx));
            }
        }
        let summary_due = last_summary.elapsed() >= summary_every;
        let (deltas, summary, demand) = {
            let mut core = shared.core();
            let core = &mut *core;
            // Bookings of nodes that left the cluster go with them.
            let gone: Vec<NodeId> =
                core.remote.peers().map(|(n, _, _)| n).filter(|n| !members.contains_key(&n.0)).collect();
            for n in gone {
                core.remote.drop_peer(&mut core.fleet, n);
            }
            let demand = core.own_demand_tokens;
            match core.outbox.as_mut() {
                Some(out) => (out.take_at_most(MAX_DELTAS_PER_BATCH), summary_due.then(|| out.summary()), demand),
                None => return,
            }
        };
        let hot = (shared.replication.enabled() && last_report.elapsed() >= report_every).then(|| {
            last_report = tokio::time::Instant::now();
            v1::HotPrefixReport::from(&shared.own_report(shared.replication.section.report_top).for_gossip())
        });
        // A request held at the router and refused changes demand without a booking delta.
        if deltas.is_empty() && summary.is_none() && hot.is_none() && demand == last_demand {
            continue;
        }
        last_demand = demand;
        if summary.is_some() {
            last_summary = tokio::time::Instant::now();
        }
        let now = shared.now();
        let batch = v1::GossipBatch {
            node_id: cluster.id,
            incarnation,
            deltas: deltas.iter().map(|d| kvmesh_proto::gossip::delta_to_proto(d, now)).collect(),
            summary: summary.as_ref().map(|s| kvmesh_proto::gossip::summary_to_proto(s, now)),
            hot,
            demand_tokens: Some(demand),
        };
        let m = &shared.metrics;
        for (_, tx) in peers.values() {
            if cluster.faults.drop_gossip(rng.random()) {
                m.gossip_dropped.inc();
                continue;
            }
            // Full: the peer is slow or down; the next summary repairs what this batch carried.
            match tx.try_send(batch.clone()) {
                Ok(()) => m.gossip_sent.inc(),
                Err(_) => m.gossip_dropped.inc(),
            };
        }
    }
}

/// Keeps one `Gossip.Stream` call open to a peer and forwards its batches, reconnecting after
/// errors. Ends when the broadcaster drops the peer's queue.
async fn peer_sender(
    id: u64,
    addr: String,
    mut rx: mpsc::Receiver<v1::GossipBatch>,
    token: Option<crate::auth::Secret>,
    tls: Option<tonic::transport::ClientTlsConfig>,
) {
    let Ok(ch) = channel(&addr, tls.as_ref()) else {
        tracing::error!(peer = id, %addr, "bad gossip address");
        return;
    };
    loop {
        let mut client = v1::gossip_client::GossipClient::new(ch.clone())
            .max_encoding_message_size(crate::cluster::MAX_MESSAGE_BYTES);
        let (tx, stream_rx) = mpsc::channel::<v1::GossipBatch>(PEER_QUEUE);
        let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(stream_rx));
        if let Some(t) = &token {
            t.attach(request.metadata_mut());
        }
        let call = client.stream(request);
        tokio::pin!(call);
        loop {
            tokio::select! {
                b = rx.recv() => match b {
                    Some(b) => if let Err(mpsc::error::TrySendError::Closed(_)) = tx.try_send(b) { break },
                    None => return,
                },
                r = &mut call => {
                    if let Err(e) = r {
                        tracing::debug!(peer = id, error = %e, "gossip stream ended");
                    }
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

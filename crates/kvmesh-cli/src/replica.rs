//! `kvmesh replica add|remove|drain`: a node's admin API (`kvmesh.v1.Admin`) from the shell.

use crate::cli::{ClusterTarget, ReplicaCommand};
use crate::cluster::authed;
use anyhow::Context;
use kvmesh_proto::v1;

pub fn run(cmd: &ReplicaCommand) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async {
        match cmd {
            ReplicaCommand::Add(a) => {
                let spec = v1::ReplicaSpec {
                    name: a.name.clone(),
                    http_endpoint: a.http.clone(),
                    kv_events_endpoint: a.kv_events.clone().unwrap_or_default(),
                    replay_endpoint: a.replay.clone().unwrap_or_default(),
                    capacity_blocks: a.capacity_blocks,
                    ..Default::default()
                };
                admin(&a.target)
                    .await?
                    .add_replica(authed(&a.target, v1::AddReplicaRequest { spec: Some(spec) })?)
                    .await
                    .context("Admin.AddReplica")?;
                println!("replica {} added", a.name);
            }
            ReplicaCommand::Remove(a) => {
                admin(&a.target)
                    .await?
                    .remove_replica(authed(&a.target, v1::ReplicaRef { name: a.name.clone() })?)
                    .await
                    .context("Admin.RemoveReplica")?;
                println!("replica {} removed", a.name);
            }
            ReplicaCommand::Drain(a) => {
                admin(&a.target)
                    .await?
                    .drain_replica(authed(&a.target, v1::ReplicaRef { name: a.name.clone() })?)
                    .await
                    .context("Admin.DrainReplica")?;
                println!("replica {} draining", a.name);
            }
            ReplicaCommand::Undrain(a) => {
                admin(&a.target)
                    .await?
                    .undrain_replica(authed(&a.target, v1::ReplicaRef { name: a.name.clone() })?)
                    .await
                    .context("Admin.UndrainReplica")?;
                println!("replica {} back in rotation", a.name);
            }
            ReplicaCommand::Starting(a) => {
                admin(&a.target)
                    .await?
                    .mark_starting(authed(&a.target, v1::ReplicaRef { name: a.name.clone() })?)
                    .await
                    .map_err(|s| anyhow::anyhow!("Admin.MarkStarting: {}", s.message()))?;
                println!("replica {} starting: not routed to, counted by the autoscaler", a.name);
            }
        }
        anyhow::Ok(())
    })
}

async fn admin(t: &ClusterTarget) -> anyhow::Result<v1::admin_client::AdminClient<tonic::transport::Channel>> {
    let channel = crate::connect::channel(&t.grpc, "is `kvmesh node` running?").await?;
    Ok(v1::admin_client::AdminClient::new(channel))
}

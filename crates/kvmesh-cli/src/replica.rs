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
            ReplicaCommand::Drain(d) => {
                let a = &d.replica;
                if d.wait && !(d.timeout.is_finite() && d.timeout > 0.0) {
                    anyhow::bail!("--timeout must be a positive number of seconds, got {}", d.timeout);
                }
                let mut client = admin(&a.target).await?;
                client
                    .drain_replica(authed(&a.target, v1::ReplicaRef { name: a.name.clone() })?)
                    .await
                    .context("Admin.DrainReplica")?;
                println!("replica {} draining", a.name);
                if d.wait && wait_idle(&mut client, a, d.timeout).await? && d.remove {
                    client
                        .remove_replica(authed(&a.target, v1::ReplicaRef { name: a.name.clone() })?)
                        .await
                        .context("Admin.RemoveReplica")?;
                    println!("replica {} removed", a.name);
                }
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

/// Polls the node until replica `a.name` is idle, printing what is left whenever it changes;
/// returns whether it is still registered. A node that does not answer (restarting, electing
/// a leader) is asked again until the timeout.
async fn wait_idle(
    client: &mut v1::admin_client::AdminClient<tonic::transport::Channel>,
    a: &crate::cli::ReplicaNameArgs,
    timeout_s: f64,
) -> anyhow::Result<bool> {
    let began = std::time::Instant::now();
    let mut said = String::new();
    loop {
        let ask = client.list_replicas(authed(&a.target, v1::ListReplicasRequest {})?);
        match tokio::time::timeout(std::time::Duration::from_secs(5), ask).await {
            Ok(Ok(list)) => {
                let found =
                    list.into_inner().replicas.into_iter().find(|r| r.spec.as_ref().is_some_and(|s| s.name == a.name));
                let Some(r) = found else {
                    println!("replica {} is no longer registered: nothing routes to it", a.name);
                    return Ok(false);
                };
                if r.idle {
                    println!("replica {} idle after {:.1} s: safe to release", a.name, began.elapsed().as_secs_f64());
                    return Ok(true);
                }
                if r.status != v1::ReplicaStatus::Draining as i32 {
                    anyhow::bail!("replica {} was put back into rotation while waiting", a.name);
                }
                if r.status_detail != said {
                    println!("replica {}: {}", a.name, r.status_detail);
                    said = r.status_detail;
                }
            }
            Ok(Err(e)) if e.code() == tonic::Code::Unauthenticated || e.code() == tonic::Code::PermissionDenied => {
                anyhow::bail!("Admin.ListReplicas: {}", e.message());
            }
            Ok(Err(e)) => {
                let now = format!("the node answered {:?}: {}; asking again", e.code(), e.message());
                if now != said {
                    eprintln!("replica {}: {now}", a.name);
                    said = now;
                }
            }
            Err(_) => {
                let now = "the node did not answer within 5 s; asking again".to_string();
                if now != said {
                    eprintln!("replica {}: {now}", a.name);
                    said = now;
                }
            }
        }
        if began.elapsed().as_secs_f64() >= timeout_s {
            anyhow::bail!("replica {} not idle after {timeout_s} s ({said}); it stays draining", a.name);
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
}

async fn admin(t: &ClusterTarget) -> anyhow::Result<v1::admin_client::AdminClient<tonic::transport::Channel>> {
    let channel = crate::connect::channel(&t.grpc, "is `kvmesh node` running?").await?;
    Ok(v1::admin_client::AdminClient::new(channel))
}
